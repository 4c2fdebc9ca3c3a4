"""Pure: the hub over HTTPS, JupyterHub's settings from a certificate and its key.

The hub's public port is JupyterHub's proxy (configurable-http-proxy): with ``ssl_cert`` and
``ssl_key`` it speaks TLS itself, 1.2 and 1.3 only (Node's floor, held by a test). The
certificate and key come from files, Docker secrets in the stack: the variables
:data:`CERT_FILE_VARIABLE` and :data:`KEY_FILE_VARIABLE`, else the secrets
:data:`CERT_SECRET` and :data:`KEY_SECRET` where mounted. Over HTTPS every cookie of the
hub is ``Secure`` (``cookie_options``, which JupyterHub also gives its XSRF cookie), and plain
HTTP on a port of its own is answered with a redirect to the same path over HTTPS
(:mod:`hubplugin.https_redirect`; JupyterHub has no such answer of its own).

Nothing here reads a file or opens a port: :func:`tls_from_env` takes the environment and a
lookup of secret files, :func:`hub_settings` returns new settings, :func:`redirect_location`
is the redirect's answer.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "CERT_FILE_VARIABLE", "CERT_SECRET", "HTTPS_PORT_VARIABLE", "KEY_FILE_VARIABLE",
    "KEY_SECRET", "PLAIN_HTTP_WARNING", "REDIRECT_PORT_VARIABLE", "HubTLS", "TLSSettingError",
    "hub_settings", "redirect_location", "tls_from_env",
]

CERT_FILE_VARIABLE = "SWARM_GPU_HUB_TLS_CERT_FILE"
"""The file (a Docker secret) holding the hub's certificate, PEM, with its chain."""
KEY_FILE_VARIABLE = "SWARM_GPU_HUB_TLS_KEY_FILE"
"""The file (a Docker secret) holding the certificate's private key, PEM."""
CERT_SECRET = "swarm-gpu-hub-tls-cert"
"""The secret read for the certificate when :data:`CERT_FILE_VARIABLE` is not set."""
KEY_SECRET = "swarm-gpu-hub-tls-key"
"""The secret read for the key when :data:`KEY_FILE_VARIABLE` is not set."""
REDIRECT_PORT_VARIABLE = "SWARM_GPU_HUB_HTTP_REDIRECT_PORT"
"""The port where plain HTTP is answered with a redirect to HTTPS (0 = none)."""
HTTPS_PORT_VARIABLE = "SWARM_GPU_HUB_HTTPS_PUBLIC_PORT"
"""The HTTPS port that browsers reach, the one the redirect names (the published port, which
the routing mesh may map to another inside the service)."""

DEFAULT_REDIRECT_PORT = 8080
DEFAULT_HTTPS_PORT = 443

PLAIN_HTTP_WARNING = (
    "THE HUB SERVES PLAIN HTTP: passwords and session cookies cross the network unencrypted. "
    f"Give it a certificate and key ({CERT_FILE_VARIABLE} and {KEY_FILE_VARIABLE}, or the "
    f"secrets {CERT_SECRET} and {KEY_SECRET}), or end TLS in front of it "
    "(docs/operations.md, \"The hub over HTTPS\")."
)
"""The line the example config logs when the hub has no certificate."""

# A host as a browser sends it: a name, an IPv4 address, or an IPv6 one in brackets; an
# optional port. Anything else (spaces, '@', '/', another scheme) is refused, so the
# Location header never names a place the request did not.
_HOST = re.compile(r"^(?P<host>[A-Za-z0-9.-]+|\[[0-9A-Fa-f:.]+\])(?::(?P<port>[0-9]{1,5}))?$")


class TLSSettingError(ValueError):
    """The hub's TLS settings are incomplete or not numbers where numbers belong."""


@dataclass(frozen=True)
class HubTLS:
    """Where the hub's certificate and key are, and its plain-HTTP redirect."""

    cert_file: str
    key_file: str
    redirect_port: int = DEFAULT_REDIRECT_PORT
    """Where plain HTTP is redirected from; 0: no redirect."""
    https_port: int = DEFAULT_HTTPS_PORT
    """The HTTPS port the redirect names (left out of the URL when 443)."""


def _port(environ: Mapping[str, str], name: str, default: int, *, zero: bool) -> int:
    text = environ.get(name, "").strip()
    if not text:
        return default
    try:
        port = int(text)
    except ValueError:
        raise TLSSettingError(f"{name}={text!r}: not a port number") from None
    if not (0 if zero else 1) <= port <= 65535:
        raise TLSSettingError(f"{name}={port}: not a port (1 to 65535{', or 0' if zero else ''})")
    return port


def tls_from_env(environ: Mapping[str, str],
                 secret_file: Callable[[str], str | None]) -> HubTLS | None:
    """The hub's TLS from its environment: the certificate and key files of
    :data:`CERT_FILE_VARIABLE` and :data:`KEY_FILE_VARIABLE`, else of the secrets
    :data:`CERT_SECRET` and :data:`KEY_SECRET` (``secret_file(name)``: the secret's path, or
    None when not mounted). None when neither is given: the hub serves plain HTTP. One
    without the other is an error, never a silent fall back to HTTP."""
    cert = environ.get(CERT_FILE_VARIABLE, "").strip() or secret_file(CERT_SECRET)
    key = environ.get(KEY_FILE_VARIABLE, "").strip() or secret_file(KEY_SECRET)
    if not cert and not key:
        return None
    if not cert or not key:
        given, missing = ((CERT_FILE_VARIABLE, KEY_FILE_VARIABLE) if cert
                          else (KEY_FILE_VARIABLE, CERT_FILE_VARIABLE))
        raise TLSSettingError(
            f"the hub has a TLS {'certificate' if cert else 'key'} ({given} or its secret) "
            f"but no {'key' if cert else 'certificate'}: set {missing} too")
    return HubTLS(
        cert_file=cert, key_file=key,
        redirect_port=_port(environ, REDIRECT_PORT_VARIABLE, DEFAULT_REDIRECT_PORT, zero=True),
        https_port=_port(environ, HTTPS_PORT_VARIABLE, DEFAULT_HTTPS_PORT, zero=False),
    )


def hub_settings(tls: HubTLS, tornado_settings: Mapping[str, Any]) -> dict[str, Any]:
    """JupyterHub's settings for HTTPS: ``ssl_cert`` and ``ssl_key`` (the proxy's TLS), and
    ``tornado_settings`` (a new dict over the given ones) whose ``cookie_options`` make every
    cookie ``Secure``. A browser then never sends the login cookie over plain HTTP, not even
    to the redirect."""
    settings = copy.deepcopy(dict(tornado_settings))
    settings["cookie_options"] = {**settings.get("cookie_options", {}), "secure": True}
    return {"ssl_cert": tls.cert_file, "ssl_key": tls.key_file, "tornado_settings": settings}


def redirect_location(host_header: str | None, uri: str, https_port: int) -> str | None:
    """Where a plain-HTTP request for ``uri`` with ``Host: host_header`` is sent: the same
    host and path over HTTPS on ``https_port``. None when the Host is missing or not a host
    (the answer is then 400, never a redirect elsewhere)."""
    match = _HOST.match((host_header or "").strip())
    if match is None or not uri.startswith("/") or uri.startswith("//"):
        return None
    port = "" if https_port == DEFAULT_HTTPS_PORT else f":{https_port}"
    return f"https://{match.group('host')}{port}{uri}"
