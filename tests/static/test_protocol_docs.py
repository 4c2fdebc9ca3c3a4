"""Every JSON example in docs/protocol.md is a valid message of the protocol."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from pydantic import TypeAdapter, ValidationError

from allocator.wire.protocol import AGENT_COMMAND_ADAPTER, INBOUND_ADAPTER, REPLY_ADAPTER, ErrorCode

DOC = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"
EXAMPLES = re.findall(r"```json\n(.*?)```", DOC.read_text(), flags=re.DOTALL)


def test_the_page_has_examples_of_every_message_kind():
    kinds = {json.loads(example)["kind"] for example in EXAMPLES}
    assert kinds >= {"allocate", "release", "status", "inventory", "queue", "drain", "lease",
                     "error", "drained", "heartbeat", "heartbeat_delta", "container_event",
                     "stop_container", "hello"}


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda e: json.loads(e)["kind"])
def test_example_validates(example: str):
    body = json.loads(example)
    if body["kind"] in {"stop_container", "hello"}:
        adapter: TypeAdapter[Any] = AGENT_COMMAND_ADAPTER
    else:
        adapter = REPLY_ADAPTER if "ok" in body else INBOUND_ADAPTER
    message = adapter.validate_python(body)
    assert message.kind == body["kind"]


def test_agent_commands_are_not_requests():
    """A command on the allocator's queue is refused: it is not part of the inbound union."""
    example = next(e for e in EXAMPLES if json.loads(e)["kind"] == "stop_container")
    with pytest.raises(ValidationError):
        INBOUND_ADAPTER.validate_json(example)


def test_every_error_code_is_documented():
    text = DOC.read_text()
    missing = [code.value for code in ErrorCode if f"`{code.value}`" not in text]
    assert missing == []
