"""How every swarm-gpu process logs: lines for a person, or one JSON object a line for a log
collector, and never a password.

Each process (``gpu-allocator``, ``gpu-nodeagent``, ``gpu-ledger``, the GPU page) calls
:func:`configure_logging` once at start with its ``log_level`` and ``log_format`` settings
(:class:`LogSettings`, which its settings model inherits):

- ``text`` (the default): ``2026-12-03 11:09:35,832 INFO allocator.service.app: message``,
  as in 0.1.0.
- ``json``: one object a line, for Loki, Elasticsearch and the like, made by
  python-json-logger: ``timestamp`` (ISO 8601, UTC), ``level``, ``logger``, ``message``,
  the fields of :data:`CONTEXT_FIELDS` when the log call passes them
  (``log.info("...", extra=lease_context(lease_id, host, user))``), and ``exc_info``
  (the traceback, as text) when there is one.

JupyterHub formats its own log, the spawner's lines included (they are the hub's logger's):
its ``log_format`` is text. For JSON, ``jupyterhub_config.py`` sets
``c.JupyterHub.logging_config = JUPYTERHUB_JSON_LOGGING`` (:data:`JUPYTERHUB_JSON_LOGGING`):
the hub's lines are then these JSON lines too, logger ``JupyterHub``.

Whatever the format, :func:`hide_passwords` runs over every finished line: a URL with a
password in it (``amqp://user:secret@broker/``) is written as :func:`allocator.amqp.broker.redact`
writes it (``amqp://user:***@broker/``), whether it came from our own messages, a library's
or a traceback.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import re
import sys
from typing import Annotated, Any, Literal, TextIO

from pydantic import AfterValidator, Field
from pydantic_settings import BaseSettings
from pythonjsonlogger.core import RESERVED_ATTRS
from pythonjsonlogger.json import JsonFormatter

from allocator.amqp.broker import redact

__all__ = [
    "CONTEXT_FIELDS",
    "JUPYTERHUB_JSON_LOGGING",
    "LIBRARY_LOGGERS",
    "LOG_LEVELS",
    "TEXT_FORMAT",
    "JsonLinesFormatter",
    "LogFormat",
    "LogLevel",
    "LogSettings",
    "add_verbose_flag",
    "configure_logging",
    "hide_passwords",
    "lease_context",
    "log_settings_from_environment",
    "quiet_libraries",
]

LogFormat = Literal["text", "json"]
"""``text``: lines for a person; ``json``: one JSON object a line, for a log collector."""

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def _a_level(value: str) -> str:
    level = value.strip().upper()
    if level not in LOG_LEVELS:
        raise ValueError(f"not a log level: use one of {', '.join(LOG_LEVELS)}")
    return level


# A string, not a Literal: a Literal would become argparse choices of the agent's --log-level,
# which would refuse the lower case that 0.1.0's --log-level took.
LogLevel = Annotated[str, AfterValidator(_a_level)]
"""A level name, in either case (``debug`` is ``DEBUG``)."""

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
"""The text format (the one of 0.1.0, unchanged)."""

CONTEXT_FIELDS = ("lease_id", "host", "user")
"""What a log call may pass in ``extra`` for a JSON line to carry (the lease, the GPU host,
the JupyterHub user), so that a collector can select one lease's or one host's lines. Any
other ``extra`` field is written too; these are the ones the code passes."""


def lease_context(lease_id: str, host: str | None = None,
                  user: str | None = None) -> dict[str, str]:
    """The ``extra`` of a log line about one lease: its id, and its host and user where known
    (a field that is not known is left out, not written as null)."""
    context = {"lease_id": lease_id}
    if host:
        context["host"] = host
    if user:
        context["user"] = user
    return context


# Python 3.12 gives every record the asyncio task's name; it is no context worth a field.
_NOT_EXTRA = (*RESERVED_ATTRS, "taskName")

_URL_CREDENTIALS = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s/@:\"'<>]*:[^\s/\"'<>]*@")
"""``scheme://user:password@``: the password runs to the last ``@`` before the host (a
password of a valid URL has no ``/``, space or quote: those are percent-encoded)."""


def hide_passwords(text: str) -> str:
    """``text`` with the password of every URL in it replaced as
    :func:`allocator.amqp.broker.redact` replaces it (``user:***@``)."""
    return _URL_CREDENTIALS.sub(lambda match: redact(match.group(0)), text)


class LogSettings(BaseSettings):
    """The logging settings every process has (its settings model inherits them, so they take
    that model's environment prefix: ``SWARM_GPU_LOG_FORMAT`` for the allocator,
    ``SWARM_GPU_AGENT_LOG_FORMAT`` for the node agent, ``SWARM_GPU_PAGE_LOG_FORMAT`` for the
    GPU page)."""

    log_level: LogLevel = Field(
        default="INFO",
        description="The least severe log lines written: DEBUG, INFO, WARNING, ERROR or "
        "CRITICAL (either case).")
    log_format: LogFormat = Field(
        default="text",
        description="'text': a line for a person (time, level, logger, message). 'json': one "
        "JSON object a line for a log collector (Loki, Elasticsearch), with timestamp, level, "
        "logger, message and, where the line is about one, lease_id, host and user "
        "(docs/operations.md, Logs). No format ever shows a password.")


def log_settings_from_environment(prefix: str) -> LogSettings:
    """The logging settings alone, from ``<prefix>LOG_LEVEL`` and ``<prefix>LOG_FORMAT``: for
    a command that has no settings model of its own (``gpu-ledger``, the client commands of
    ``gpu-allocator``). Raises pydantic's ValidationError for a bad value."""
    return LogSettings(_env_prefix=prefix)


class TextFormatter(logging.Formatter):
    """The text lines, passwords hidden."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        return hide_passwords(super().format(record))


class JsonLinesFormatter(JsonFormatter):
    """One JSON object a line (python-json-logger), passwords hidden."""

    def __init__(self) -> None:
        super().__init__(
            "%(asctime)s %(levelname)s %(name)s %(message)s",
            rename_fields={"asctime": "timestamp", "levelname": "level", "name": "logger"},
            reserved_attrs=_NOT_EXTRA,
        )

    def formatTime(self, record: logging.LogRecord,
                   datefmt: str | None = None) -> str:
        moment = datetime.datetime.fromtimestamp(record.created, tz=datetime.UTC)
        return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")

    def format(self, record: logging.LogRecord) -> str:
        return hide_passwords(super().format(record))


JUPYTERHUB_JSON_LOGGING: dict[str, Any] = {
    "formatters": {"swarm_gpu_json": {"()": f"{__name__}.JsonLinesFormatter"}},
    "handlers": {"console": {"formatter": "swarm_gpu_json"}},
}
"""For ``c.JupyterHub.logging_config``: the hub's console handler (traitlets' ``console``)
writes :class:`JsonLinesFormatter`'s lines; traitlets merges it into its own logging config."""


def formatter(log_format: LogFormat) -> logging.Formatter:
    """The formatter of ``log_format``."""
    return JsonLinesFormatter() if log_format == "json" else TextFormatter()


# aiormq logs every failed connection attempt at ERROR before raising; the caller (the
# allocator's start, the agent's publisher, a client) logs or prints the failure itself, once
# and saying what to fix, so this line would only double it.
_DOUBLED = frozenset({"error when creating transport: %r"})


def _not_doubled(record: logging.LogRecord) -> bool:
    return not (record.name == "aiormq.connection" and record.msg in _DOUBLED)


def configure_logging(level: str | int = "INFO", log_format: LogFormat = "text",
                      *, stream: TextIO | None = None) -> logging.Handler:
    """Send every log line of this process, at ``level`` and above, to ``stream`` (stderr) in
    ``log_format``; replaces the handlers set before. Python's warnings become log lines too
    (logger ``py.warnings``), so that a JSON log holds nothing but JSON. Returns the handler."""
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(formatter(log_format))
    handler.addFilter(_not_doubled)
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper() if isinstance(level, str) else level)
    logging.captureWarnings(True)
    return handler


LIBRARY_LOGGERS = ("aio_pika", "aiormq", "pamqp")
"""The broker client's libraries: they log each reconnect and each closed connection."""


def quiet_libraries(verbose: bool) -> None:
    """A command-line client's libraries say only warnings and worse unless ``verbose``: the
    command prints its own one line on what failed, and aio-pika's note that it reconnects
    (INFO) would come before it as noise. A service keeps them: there they are its history."""
    for name in LIBRARY_LOGGERS:
        logging.getLogger(name).setLevel(logging.NOTSET if verbose else logging.WARNING)


def add_verbose_flag(parser: argparse.ArgumentParser, help_text: str) -> None:
    """``-v``/``--verbose`` (``args.verbose``) on ``parser`` and on every subcommand under
    it, so that ``gpu-allocator serve -v`` works as ``gpu-allocator -v serve`` does. Call it
    once the subcommands are added."""
    parser.add_argument("-v", "--verbose", action="store_true", help=help_text)
    _verbose_on_subcommands(parser, help_text)


def _verbose_on_subcommands(parser: argparse.ArgumentParser, help_text: str) -> None:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):  # aliases: one parser
                # SUPPRESS: a subcommand without -v leaves the value given before it alone.
                sub.add_argument("-v", "--verbose", action="store_true",
                                 default=argparse.SUPPRESS, help=help_text)
                _verbose_on_subcommands(sub, help_text)
