"""Every JSON example in docs/protocol.md is a valid message of the protocol."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from allocator.protocol import INBOUND_ADAPTER, REPLY_ADAPTER, ErrorCode

DOC = Path(__file__).resolve().parents[1] / "docs" / "protocol.md"
EXAMPLES = re.findall(r"```json\n(.*?)```", DOC.read_text(), flags=re.DOTALL)


def test_the_page_has_examples_of_every_message_kind():
    kinds = {json.loads(example)["kind"] for example in EXAMPLES}
    assert kinds >= {"allocate", "release", "status", "inventory", "queue", "drain", "lease",
                     "error", "drained", "heartbeat", "container_event"}


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda e: json.loads(e)["kind"])
def test_example_validates(example: str):
    body = json.loads(example)
    adapter = REPLY_ADAPTER if "ok" in body else INBOUND_ADAPTER
    message = adapter.validate_python(body)
    assert message.kind == body["kind"]


def test_every_error_code_is_documented():
    text = DOC.read_text()
    missing = [code.value for code in ErrorCode if f"`{code.value}`" not in text]
    assert missing == []
