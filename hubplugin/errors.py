"""What the user reads when a GPU request fails: allocator errors as HTTP errors.

Pure: no I/O. JupyterHub shows an ``HTTPError``'s ``jupyterhub_message`` on the spawn page as
is, so every message here says what happened and what the user can do next.
"""

from __future__ import annotations

from tornado import web

from allocator.amqp.client import AllocatorError
from allocator.wire.protocol import ErrorCode

__all__ = ["allocator_http_error", "holds_no_lease", "user_error"]

REFUSALS = {
    ErrorCode.BAD_REQUEST: 400,
    ErrorCode.UNSUPPORTED_VERSION: 500,
    ErrorCode.TOO_LARGE: 400,
    ErrorCode.UNKNOWN_MODEL: 400,
    ErrorCode.UNKNOWN_HOST: 400,
    ErrorCode.UNSATISFIABLE: 400,
    ErrorCode.NOT_SHAREABLE: 400,
    ErrorCode.CONFLICT: 409,
    ErrorCode.QUOTA_EXCEEDED: 403,
    ErrorCode.FORBIDDEN: 403,
    ErrorCode.NO_CAPACITY: 409,
}
"""Errors that mean "the allocator looked and said no", with their HTTP status."""

FAILURES = {
    ErrorCode.TIMEOUT: 503,
    ErrorCode.UNAVAILABLE: 503,
    ErrorCode.STORAGE_ERROR: 503,
    ErrorCode.INTERNAL_ERROR: 503,
    ErrorCode.NOT_FOUND: 503,
}
"""Errors that mean the allocator could not answer the question, with their HTTP status."""


def holds_no_lease(exc: AllocatorError) -> bool:
    """Whether the allocator refused outright, so it holds no lease (not even a queued one).

    ``no_capacity`` is not such a refusal: it also ends a wait in the queue, and the queued
    lease is withdrawn by the release that follows.
    """
    return exc.code in REFUSALS and exc.code is not ErrorCode.NO_CAPACITY


def user_error(status: int, message: str) -> web.HTTPError:
    """An HTTPError whose message JupyterHub shows to the user as is."""
    error = web.HTTPError(status, "%s", message)
    error.jupyterhub_message = message  # type: ignore[attr-defined]
    return error


def allocator_http_error(exc: AllocatorError, *, what: str = "GPU request") -> web.HTTPError:
    """Map an allocator error to an HTTP error with a message for people."""
    if exc.code in (ErrorCode.TIMEOUT, ErrorCode.UNAVAILABLE):
        return user_error(
            503,
            f"The GPU allocator cannot be reached right now ({exc.message}). Try again in a "
            "minute, or start a server without a GPU.",
        )
    if exc.code is ErrorCode.NO_CAPACITY:
        return user_error(
            409,
            f"No GPU is free for your request right now ({exc.message}). Try again later, "
            "ask for fewer GPUs or another model, or start without a GPU.",
        )
    status = REFUSALS.get(exc.code) or FAILURES.get(exc.code, 500)
    if status >= 500:
        return user_error(status, f"The GPU allocator failed ({exc.code.value}): {exc.message}")
    return user_error(status, f"The {what} was refused ({exc.code.value}): {exc.message}")
