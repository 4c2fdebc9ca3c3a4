"""Broker addresses: one AMQP URL may name several broker nodes of one RabbitMQ cluster.

``amqp://user:password@node1:5672,node2:5672,node3:5672/vhost`` is the same user, password,
vhost and options on three nodes (the form libpq and MongoDB use for their clusters). Every
part of swarm-gpu that connects (the allocator, the hub's client, ``gpu-ledger``, the node
agents) takes such a URL: it connects to the first node that answers and, when that
connection drops or an attempt fails, tries the next one, round the list. A one-node URL
behaves exactly as before.

Why in the client and not behind a load balancer: a site that wants the broker highly
available has three broker nodes and no load balancer in front of them (that would be one
more thing to fail), and aio-pika connects to one URL only. Quorum queues and streams are
reachable from every node of the cluster, so any node that answers will do.

One trap of a three-node RabbitMQ 3.10 comes with it (:func:`is_refused`): a channel opened on
a surviving node while a quorum queue is electing a new leader can never publish to that
queue; the publisher must see the refusal (publisher confirms) and open another channel.

TLS is one rule here too (docs/operations.md, "TLS to the broker"): an ``amqps://`` URL (port
5671 by default) and the CA that signed the broker's certificate, and a client certificate
where the broker asks for one. Every process takes them as the settings ``amqp_ca_file``,
``amqp_cert_file`` and ``amqp_key_file`` (:class:`BrokerTLSSettings`) or as the URL's own
query parameters ``cafile``, ``certfile``, ``keyfile`` (which aiormq reads); :func:`with_tls`
puts the one into the other, so a URL naming several nodes carries them to each. A plain
``amqp://`` URL to a host off this machine logs a warning when the process first connects
(:func:`plaintext_warning`), and a connection that TLS refused says why in one line
(:func:`connection_failure`).

Every ``amqps://`` connection uses a context made here (:func:`tls_context`), not aiormq's
own: TLS 1.2 or newer (:data:`MINIMUM_TLS`), the broker's certificate checked against the CA
and for the URL's host name. aiormq's ``no_verify_ssl`` query parameter, which turns that
check off, is refused (:func:`check_tls_parameters`) unless the process's environment says
:data:`INSECURE_NO_VERIFY_ENV` ``=1``, and then every start logs a warning.

A connection the broker refused (its TLS, the login, the vhost, the user's permissions) is
worded here once for every process (:func:`refusal`, :func:`start_failure`): the allocator's
start and a node agent's log say the same line for the same mistake.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import ipaddress
import logging
import os
import socket
import ssl
import urllib.parse
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import aio_pika
import aio_pika.abc
from aio_pika.abc import TimeoutType
from aiormq.exceptions import (
    AMQPError,
    ChannelAccessRefused,
    DeliveryError,
    InvalidFrameError,
    ProbableAuthenticationError,
    PublishError,
)
from pydantic import Field, model_validator
from pydantic_settings import BaseSettings
from yarl import URL

log = logging.getLogger(__name__)
security_log = logging.getLogger(f"{__name__}.security")
"""Where the warning about a plain URL goes: its own logger, so that a command-line client
that keeps the broker's connection log quiet (``gpu-ledger``) can still show it."""

DEFAULT_AMQP_URL = "amqp://guest:guest@127.0.0.1:5672/"
"""The broker URL every part uses when none is configured: RabbitMQ's own default user on
this machine (development and tests; a deployment names its broker and user)."""


def broker_user(amqp_url: str) -> str:
    """The broker user name in an AMQP URL (``guest`` when the URL names none): the
    ``user_id`` a publisher stamps on its messages, which RabbitMQ checks against the
    connection's user."""
    return urllib.parse.unquote(urllib.parse.urlparse(amqp_url).username or "guest")


def broker_urls(amqp_url: str) -> list[str]:
    """One URL per broker node named in ``amqp_url`` (``host1:port1,host2:port2``), in order.

    Raises ValueError for an empty host in the list (``node1,,node2``).
    """
    parts = urllib.parse.urlsplit(amqp_url)
    credentials, at, hosts = parts.netloc.rpartition("@")
    if "," not in hosts:
        return [amqp_url]
    urls = []
    for host in hosts.split(","):
        if not host.strip():
            raise ValueError(f"an empty broker address in {redact(amqp_url)}")
        netloc = f"{credentials}{at}{host.strip()}"
        urls.append(urllib.parse.urlunsplit(parts._replace(netloc=netloc)))
    return urls


def rotate_nodes(amqp_url: str, by: int) -> str:
    """``amqp_url`` with its list of broker nodes rotated so that node ``by`` (modulo their
    number) comes first: where a new connection should try first. A one-node URL is returned
    as it is."""
    urls = broker_urls(amqp_url)
    if len(urls) == 1:
        return amqp_url
    by %= len(urls)
    parts = urllib.parse.urlsplit(amqp_url)
    credentials, at, _ = parts.netloc.rpartition("@")
    hosts = [urllib.parse.urlsplit(url).netloc.rpartition("@")[2] for url in urls]
    netloc = credentials + at + ",".join(hosts[by:] + hosts[:by])
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


async def silent_nodes(amqp_url: str, timeout: float) -> list[str]:  # noqa: ASYNC109
    """The addresses (``host:port``) of the broker nodes named in ``amqp_url`` that do not
    accept an AMQP connection within ``timeout`` seconds (each tried at once, on its own
    connection).

    A RabbitMQ node opens its AMQP listener only at the end of its boot, after it has joined
    its cluster: a node that accepts a connection is a running member of it.
    """

    async def answers(url: str) -> bool:
        try:
            async with asyncio.timeout(timeout):
                connection = await open_connection(url, timeout=timeout)
                await connection.close()
            return True
        except (OSError, TimeoutError, AMQPError, aio_pika.exceptions.AMQPError):
            return False

    warn_if_plaintext(amqp_url)
    urls = broker_urls(amqp_url)
    answered = await asyncio.gather(*(answers(url) for url in urls))
    return [broker_address(url).partition("/")[0]
            for url, ok in zip(urls, answered, strict=True) if not ok]


def redact(amqp_url: str) -> str:
    """The URL without its password, for messages and log lines."""
    parts = urllib.parse.urlsplit(amqp_url)
    credentials, at, hosts = parts.netloc.rpartition("@")
    user, colon, _ = credentials.partition(":")
    if not (at and colon):
        return amqp_url
    return urllib.parse.urlunsplit(parts._replace(netloc=f"{user}:***@{hosts}"))


DEFAULT_PORTS = {"amqp": 5672, "amqps": 5671}
"""The port of a node a URL names without one, by scheme (aiormq's own defaults)."""


def broker_address(amqp_url: str) -> str:
    """``host:port[,host:port...]/vhost`` of an AMQP URL, without credentials."""
    urls = [urllib.parse.urlsplit(url) for url in broker_urls(amqp_url)]
    default_port = DEFAULT_PORTS.get(urls[0].scheme, DEFAULT_PORTS["amqp"])
    hosts = ",".join(f"{url.hostname}:{url.port or default_port}" for url in urls)
    return f"{hosts}{urls[0].path or '/'}"


# ------------------------------------------------------------------------------------ TLS

TLS_QUERY = {"cafile": "amqp_ca_file", "certfile": "amqp_cert_file", "keyfile": "amqp_key_file"}
"""The URL's TLS query parameters (what aiormq reads), each with the setting that names it."""

MINIMUM_TLS = ssl.TLSVersion.TLSv1_2
"""The oldest TLS version a client offers or accepts: TLS 1.0 and 1.1 are deprecated (RFC
8996); the shipped broker configuration allows 1.2 and 1.3 only, too."""

INSECURE_NO_VERIFY_ENV = "SWARM_GPU_AMQP_INSECURE_SKIP_TLS_VERIFY"
"""The environment variable that, set to ``1``, lets a broker URL's ``no_verify_ssl=1`` turn
off the check of the broker's certificate (a test broker with a certificate nobody signed).
Anyone who can reach the network path can then read and change every message and password."""

NO_VERIFY_PARAMETER = "no_verify_ssl"
"""aiormq's URL parameter that turns off the check of the broker's certificate (any value but
``0`` does, ``no_verify_ssl=false`` included)."""

UNREAD_TLS_PARAMETERS = ("verify", "verify_ssl", "ssl_verify", "check_hostname", "cert_reqs",
                         "ssl_version", "ssl_options")
"""URL parameters that look as if they set how TLS is checked, but that no client here reads:
refused, so that nobody believes a URL with ``verify=0`` (or ``verify=1``) does what it says."""


class InsecureTLSError(ValueError):
    """A broker URL that would turn off, or seem to change, the check of the broker's TLS
    certificate. Its message begins with :data:`INSECURE_TLS_CODE`."""


INSECURE_TLS_CODE = "insecure-broker-tls"
"""The stable code at the start of :class:`InsecureTLSError`'s message."""


def insecure_no_verify_allowed(environ: Mapping[str, str] | None = None) -> bool:
    """Whether :data:`INSECURE_NO_VERIFY_ENV` is ``1`` in ``environ`` (the process's)."""
    return (os.environ if environ is None else environ).get(INSECURE_NO_VERIFY_ENV) == "1"


def check_tls_parameters(amqp_url: str, environ: Mapping[str, str] | None = None) -> bool:
    """Raise :class:`InsecureTLSError`, in one line, for a URL parameter that would turn off
    the check of the broker's certificate (``no_verify_ssl`` other than ``0``, unless
    :func:`insecure_no_verify_allowed`) or that looks like a TLS switch no client reads
    (:data:`UNREAD_TLS_PARAMETERS`). Returns whether the URL turns the check off (allowed).
    """
    query = urllib.parse.parse_qs(urllib.parse.urlsplit(amqp_url).query,
                                  keep_blank_values=True)
    unread = [key for key in UNREAD_TLS_PARAMETERS if key in query]
    if unread:
        raise InsecureTLSError(
            f"{INSECURE_TLS_CODE}: the broker URL {redact(amqp_url)} has {', '.join(unread)}, "
            "which no swarm-gpu client reads: the broker's certificate is always checked "
            "(TLS 1.2 or newer, against amqp_ca_file, for the URL's host); remove it")
    values = query.get(NO_VERIFY_PARAMETER, [])
    if all(value == "0" for value in values):
        return False
    if insecure_no_verify_allowed(environ):
        return True
    raise InsecureTLSError(
        f"{INSECURE_TLS_CODE}: the broker URL {redact(amqp_url)} has "
        f"{NO_VERIFY_PARAMETER}={values[-1]}, which turns off the check of the broker's TLS "
        "certificate (anyone on the way could read the password and every message): remove "
        f"it and set amqp_ca_file to the CA that signed the broker's certificate; only a "
        f"test setup may allow it, with {INSECURE_NO_VERIFY_ENV}=1 in the environment")


def tls_context(amqp_url: str) -> ssl.SSLContext | None:
    """The TLS context of a connection to ``amqp_url``: None for ``amqp://``; for
    ``amqps://`` the URL's CA (``cafile``, ``capath`` or ``cadata``; else the system's) and
    client certificate (``certfile``, ``keyfile``), TLS :data:`MINIMUM_TLS` or newer, the
    broker's certificate and host name checked (unless :func:`check_tls_parameters` allows
    otherwise). Raises :class:`InsecureTLSError` as that function, OSError or ssl.SSLError
    for a file it cannot load.
    """
    parts = urllib.parse.urlsplit(amqp_url)
    if parts.scheme != "amqps":
        return None
    no_verify = check_tls_parameters(amqp_url)
    query = dict(urllib.parse.parse_qsl(parts.query, keep_blank_values=True))
    cadata = query.get("cadata")
    context = ssl.create_default_context(
        ssl.Purpose.SERVER_AUTH, cafile=query.get("cafile") or None,
        capath=query.get("capath") or None,
        # aiormq's cadata is base64 of the DER certificates
        cadata=base64.b64decode(cadata) if cadata else None)
    context.minimum_version = MINIMUM_TLS
    if query.get("certfile"):
        context.load_cert_chain(query["certfile"], query.get("keyfile") or None)
    if no_verify:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    return context


def with_tls(amqp_url: str, *, ca_file: str | Path | None = None,
             cert_file: str | Path | None = None, key_file: str | Path | None = None) -> str:
    """``amqp_url`` with the TLS files as its query parameters ``cafile``, ``certfile`` and
    ``keyfile``: one query, so every node of a URL naming several gets them.

    Without any file it is ``amqp_url`` as it is. Raises ValueError, in one line, when a file
    is given for a plain ``amqp://`` URL (its traffic would not be encrypted at all), or when
    the URL names another file for the same parameter; :class:`InsecureTLSError` for a URL
    that turns off the check of the broker's certificate (:func:`check_tls_parameters`:
    every client's URL passes through here when its settings are read). Giving the same file
    twice is fine (a setting read again).
    """
    check_tls_parameters(amqp_url)
    given = {key: str(value) for key, value in
             (("cafile", ca_file), ("certfile", cert_file), ("keyfile", key_file))
             if value is not None and str(value) != ""}
    if not given:
        return amqp_url
    parts = urllib.parse.urlsplit(amqp_url)
    if parts.scheme != "amqps":
        settings = ", ".join(TLS_QUERY[key] for key in given)
        raise ValueError(f"{settings} set, but the broker URL {redact(amqp_url)} is not "
                         f"amqps://: TLS needs an amqps:// URL (the broker's TLS port, 5671)")
    query = urllib.parse.parse_qsl(parts.query, keep_blank_values=True)
    in_url = dict(query)
    for key, value in given.items():
        if key not in in_url:
            query.append((key, value))
        elif in_url[key] != value:
            raise ValueError(f"{TLS_QUERY[key]} is {value} but the broker URL's {key} is "
                             f"{in_url[key]}: set one of them")
    return urllib.parse.urlunsplit(parts._replace(query=urllib.parse.urlencode(query, safe="/")))


class BrokerTLSSettings(BaseSettings):
    """The broker URL of a process and its TLS files, one setting each; a settings class of
    a process that connects (allocator, node agent, GPU page) takes these from here.

    After validation ``amqp_url`` carries the files (:func:`with_tls`), so whatever takes the
    URL connects with them.
    """

    amqp_url: str = Field(default=DEFAULT_AMQP_URL, description="Broker URL.")
    amqp_ca_file: Path | None = Field(
        default=None,
        description="The CA certificate (PEM) that signed the broker's certificate, for an "
        "amqps:// amqp_url (the URL's cafile parameter does the same). Unset: the system's "
        "trusted CAs.")
    amqp_cert_file: Path | None = Field(
        default=None,
        description="This client's own certificate (PEM), where the broker asks for one "
        "(ssl_options.verify = verify_peer with fail_if_no_peer_cert); the URL's certfile.")
    amqp_key_file: Path | None = Field(
        default=None,
        description="The private key (PEM) of amqp_cert_file, unless that file holds it too; "
        "the URL's keyfile.")

    @model_validator(mode="after")
    def _tls_into_url(self) -> Any:
        # A missing file is found now, in one line naming the setting, rather than at every
        # connection attempt as an OSError that names no file.
        for name in TLS_QUERY.values():
            path = getattr(self, name)
            if path is not None and not path.is_file():
                raise ValueError(f"{name}: {path} does not exist or is not a file")
        self.amqp_url = with_tls(self.amqp_url, ca_file=self.amqp_ca_file,
                                 cert_file=self.amqp_cert_file, key_file=self.amqp_key_file)
        return self


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address) is this machine's loopback."""
    if host.lower() in ("localhost", "localhost.localdomain") or host.lower().endswith(
            ".localhost"):
        return True
    try:
        address = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)  # ::ffff:127.0.0.1
    return address.is_loopback or (mapped is not None and mapped.is_loopback)


def plaintext_warning(amqp_url: str) -> str | None:
    """The warning a plain ``amqp://`` URL deserves when it names a node off this machine
    (its password and every message would cross the network in clear); None for an
    ``amqps://`` URL or one to loopback only. Pure: reads no network."""
    if urllib.parse.urlsplit(amqp_url).scheme != "amqp":
        return None
    remote = [host for host in (urllib.parse.urlsplit(url).hostname or "127.0.0.1"
                                for url in broker_urls(amqp_url)) if not is_loopback(host)]
    if not remote:
        return None
    return (f"the broker URL {redact(amqp_url)} is plain amqp:// to {', '.join(remote)}: "
            "the broker password and every message cross the network unencrypted; use "
            "amqps:// with amqp_ca_file (docs/operations.md, TLS to the broker)")


def no_verify_warning(amqp_url: str) -> str | None:
    """The warning an allowed ``no_verify_ssl`` deserves (:func:`check_tls_parameters`);
    None when the URL checks the broker's certificate. Pure but for the environment."""
    if urllib.parse.urlsplit(amqp_url).scheme != "amqps" or not check_tls_parameters(amqp_url):
        return None
    return (f"the broker URL {redact(amqp_url)} has {NO_VERIFY_PARAMETER} and "
            f"{INSECURE_NO_VERIFY_ENV}=1 allows it: the broker's TLS certificate is NOT "
            "checked, so anyone on the way can read the password and every message; give "
            "the clients the broker's CA (amqp_ca_file) and remove both")


_warned_plaintext: set[str] = set()


def warn_if_plaintext(amqp_url: str) -> None:
    """Log :func:`plaintext_warning` or :func:`no_verify_warning` once per process and broker
    address (the first connection of each process that connects, through :func:`connect`
    and :func:`connect_robust`: every start)."""
    warning = plaintext_warning(amqp_url) or no_verify_warning(amqp_url)
    address = broker_address(amqp_url)
    if warning is not None and address not in _warned_plaintext:
        _warned_plaintext.add(address)
        security_log.warning("%s", warning)


TLS_ENVIRONMENT = {"cafile": "SWARM_GPU_AMQP_CA_FILE", "certfile": "SWARM_GPU_AMQP_CERT_FILE",
                   "keyfile": "SWARM_GPU_AMQP_KEY_FILE"}
"""The environment variables of the command-line clients' TLS files (the allocator's own
settings of the same names)."""


def add_tls_arguments(parser: argparse.ArgumentParser) -> None:
    """The command-line clients' TLS options (``gpu-allocator``, ``gpu-ledger``):
    ``--amqp-ca-file``, ``--amqp-cert-file``, ``--amqp-key-file``."""
    group = parser.add_argument_group("TLS to the broker (an amqps:// URL)")
    for key, setting in TLS_QUERY.items():
        what = {"cafile": "the CA that signed the broker's certificate",
                "certfile": "this client's certificate, where the broker asks for one",
                "keyfile": "the key of --amqp-cert-file"}[key]
        group.add_argument(f"--{setting.replace('_', '-')}", dest=setting, default=None,
                           metavar="PEM", help=f"{what} (default: ${TLS_ENVIRONMENT[key]})")


def url_with_tls_arguments(amqp_url: str, args: argparse.Namespace,
                           environ: Mapping[str, str] | None = None) -> str:
    """``amqp_url`` with the TLS files of :func:`add_tls_arguments` (or their environment
    variables); ValueError as :func:`with_tls`."""
    env = os.environ if environ is None else environ
    files = {key: getattr(args, setting, None) or env.get(TLS_ENVIRONMENT[key]) or None
             for key, setting in TLS_QUERY.items()}
    return with_tls(amqp_url, ca_file=files["cafile"], cert_file=files["certfile"],
                    key_file=files["keyfile"])


def connection_failure(exc: BaseException, amqp_url: str = "") -> str:
    """Why a connection attempt to ``amqp_url`` failed, in one line a person understands:
    TLS refusals (:func:`tls_failure`) in words, anything else as its own message."""
    return tls_failure(exc, amqp_url) or str(exc) or type(exc).__name__


HOST_MISMATCH_CODES = (62, 64)
"""OpenSSL's X509_V_ERR_HOSTNAME_MISMATCH and X509_V_ERR_IP_ADDRESS_MISMATCH: a certificate
the CA signed, for another name."""


def tls_failure(exc: BaseException, amqp_url: str = "") -> str | None:
    """What TLS refused, in words, when that is why ``exc`` (a failed connection attempt to
    ``amqp_url``, or what it was raised from) happened: the broker's certificate not
    trusted or for another host name, this client's certificate refused or missing, a TLS
    version one side does not speak, TLS against a port that does not
    speak it; else None."""
    seen: list[BaseException] = []
    cause: BaseException | None = exc
    while cause is not None and cause not in seen:
        seen.append(cause)
        cause = cause.__cause__ or cause.__context__
    for error in seen:
        if isinstance(error, ssl.SSLCertVerificationError) \
                and error.verify_code in HOST_MISMATCH_CODES:
            host = urllib.parse.urlsplit(amqp_url).hostname if amqp_url else None
            named = f"the host {host} of the URL" if host else "the host of the URL"
            return (f"the broker's TLS certificate does not name {named} "
                    f"({error.verify_message}): connect with a name the certificate holds, "
                    "or give the broker a certificate for this name")
        if isinstance(error, ssl.SSLCertVerificationError):
            return (f"the broker's TLS certificate is not trusted ({error.verify_message}): "
                    "amqp_ca_file must be the CA that signed it, and the certificate must "
                    "name the host of the URL")
        if isinstance(error, ssl.SSLError):
            reason = (error.reason or "").upper()
            if "CERTIFICATE_REQUIRED" in reason or "BAD_CERTIFICATE" in reason \
                    or "UNKNOWN_CA" in reason:
                return ("the broker refused this client's TLS certificate (or got none): set "
                        "amqp_cert_file and amqp_key_file to a certificate its CA signed")
            if "UNSUPPORTED_PROTOCOL" in reason or "PROTOCOL_VERSION" in reason \
                    or "NO_PROTOCOLS_AVAILABLE" in reason:
                return ("the broker offers only a TLS version older than 1.2, which this "
                        "client refuses: allow TLS 1.2 and 1.3 at the broker "
                        "(ssl_options.versions in rabbitmq.conf)")
            if "WRONG_VERSION_NUMBER" in reason or "RECORD_LAYER" in reason:
                return ("the broker did not answer TLS on that port: amqps:// needs the "
                        "broker's TLS port (5671 by default)")
            return f"TLS with the broker failed: {error.reason or error}"
    parts = urllib.parse.urlsplit(amqp_url)
    if parts.scheme == "amqps" and "certfile" not in urllib.parse.parse_qs(parts.query) \
            and any(isinstance(error, ConnectionResetError | asyncio.IncompleteReadError)
                    for error in seen):
        # A broker that asks for a client certificate (fail_if_no_peer_cert) and got none
        # ends the connection over TLS 1.3 after the client's side of the handshake is done:
        # the client sees a reset, not the alert that says why.
        return ("the broker ended the TLS connection before AMQP began: it may ask for a "
                "client certificate (set amqp_cert_file and amqp_key_file)")
    return None


START_ERRORS = (AMQPError, aio_pika.exceptions.AMQPError, ConnectionError, socket.gaierror,
                TimeoutError)
"""What the broker, or the way to it, makes a connection attempt fail with (refused,
unreachable, a name that does not resolve); :func:`start_failure` words them. Any other
OSError (a port in use, say) is not the broker's."""


def refusal(exc: BaseException, amqp_url: str, role: str) -> str | None:
    """What the broker at ``amqp_url`` refused, when that is why a connection attempt failed
    with ``exc``, in one line that says what to fix: TLS (:func:`tls_failure`), the login, the
    vhost, the user's permissions. None for anything else (a broker that does not answer).
    ``role`` names the process in the advice ("allocator", "node agent").

    One wording for every process, so that an admin who meets a missing vhost in the
    allocator's start and in a node agent's log reads the same line.
    """
    where = broker_address(amqp_url)
    user = broker_user(amqp_url)
    tls = tls_failure(exc, amqp_url)
    if tls is not None:
        return f"cannot connect to the broker at {where}: {tls}"
    if isinstance(exc, ProbableAuthenticationError):
        return (f"the broker at {where} refused the login of user {user!r}: check the user "
                "and password of amqp_url (or of the file amqp_url_file names)")
    if isinstance(exc, InvalidFrameError) and "Connection.Close" in str(exc):
        # RabbitMQ closes the connection at its open when the vhost does not exist or the user
        # has no permissions on it; aiormq keeps neither the code nor the text of that close.
        vhost = urllib.parse.unquote(urllib.parse.urlsplit(amqp_url).path[1:]) or "/"
        return (f"the broker at {where} refused to open vhost {vhost!r} for user {user!r}: "
                "the vhost does not exist or the user has no permissions on it; check the "
                "vhost in amqp_url (the path after the host) or create it and grant the user "
                "(rabbitmqctl add_vhost, set_permissions)")
    if isinstance(exc, ChannelAccessRefused):
        text = next((arg for arg in reversed(exc.args) if isinstance(arg, str)), str(exc))
        return (f"the broker at {where} refused user {user!r}: {text}; give it the "
                f"{role}'s permissions of compose/rabbitmq-definitions.json "
                "(docs/operations.md, broker users and what each may do)")
    return None


def start_failure(exc: BaseException, amqp_url: str, *, role: str, broker_wait_s: float) -> str:
    """Why a process could not start on the broker at ``amqp_url`` (``exc``, one of
    :data:`START_ERRORS`, after trying for ``broker_wait_s``), in one line that says what to
    fix: :func:`refusal`, a broker that cannot be reached, or the error itself."""
    refused = refusal(exc, amqp_url, role)
    if refused is not None:
        return refused
    where = broker_address(amqp_url)
    if isinstance(exc, ConnectionError | socket.gaierror | TimeoutError):
        return (f"cannot reach the broker at {where} within broker_wait_s = "
                f"{broker_wait_s:g} s ({connection_failure(exc)}): check the host and port "
                "of amqp_url and that RabbitMQ runs there, or raise broker_wait_s")
    return f"the broker at {where} failed the start: {connection_failure(exc)}"


FAILOVER_RECONNECT_S = 1.0
"""Pause before reconnecting over a list of nodes (aio-pika's default is 5 s): the next
attempt goes to another node, which is most likely up."""


class FailoverConnection(aio_pika.RobustConnection):
    """A robust connection over several broker nodes: each new attempt after a drop or a
    failed attempt goes to the next node of the list.

    aio-pika's robust connection clears its transport at the start of every connection
    attempt (and on close); that is where this class moves on to the next URL. The channels,
    queues and consumers are then restored on the node that answers, as after any reconnect.
    """

    def __init__(self, urls: Sequence[str], **kwargs: Any) -> None:
        self._urls = [URL(url) for url in urls]
        self._current = 0
        self._armed = False
        """Whether the first attempt has begun (the constructor clears the transport too)."""
        self._transport: Any = None
        super().__init__(self._urls[0], **kwargs)

    @property
    def transport(self) -> Any:
        return self._transport

    @transport.setter
    def transport(self, value: Any) -> None:
        if value is None and self._armed and len(self._urls) > 1:
            self._current = (self._current + 1) % len(self._urls)
            self.url = self._urls[self._current]
            log.info("broker connection: next attempt to %s", self)
        self._transport = value

    async def connect(self, timeout: TimeoutType = None) -> None:  # noqa: ASYNC109 (aio-pika's)
        # The first attempt goes to the first node; every later one to the next.
        self._armed = False
        self._transport = None
        self.url = self._urls[self._current]
        await super().connect(timeout)

    def arm(self) -> None:
        """From now on, each cleared transport moves to the next node."""
        self._armed = True


REFUSED_RETRY_S = 0.25
"""Pause before publishing a refused message again, on a new channel: a quorum queue's leader
election takes a fraction of a second to a few seconds on a loaded machine."""


def is_refused(exc: BaseException) -> bool:
    """Whether a publish failed because the broker refused it (a ``basic.nack``): nothing was
    enqueued, so sending it again cannot duplicate it; a returned (unroutable) message is not
    a refusal.

    Why a refused publish is sent again **on a new channel**: in RabbitMQ 3.10 a channel's
    first publish to a quorum queue asks the node of the leader named in the queue's record
    (read when the channel first uses the queue) which queue version it runs
    (``rabbit_fifo_client:enqueue/3``). When that node is down, the publish is refused and the
    channel's state is left as it was, so every later publish of that channel to that queue
    asks the dead node again and is refused too, for as long as the channel lives: nacked
    with publisher confirms, dropped without a trace without them. A channel opened on a
    surviving node after the leader's node died and before the new leader is recorded (a
    fraction of a second; seconds on a loaded machine) is in that state, and a client whose
    connection was on the lost node reconnects to the next node at once, into exactly that
    window. A new channel reads the record again and finds the new leader.
    """
    return isinstance(exc, DeliveryError) and not isinstance(exc, PublishError)


class _ClosedWhenItFailsRobustConnection(aio_pika.RobustConnection):
    """aio-pika's robust connection, closed when its first connect fails (a refused TLS
    handshake, a wrong password): aio-pika leaves a failed one to its ``__del__``, which
    leaves a ``close()`` coroutine nobody awaits (see :func:`open_connection`). Reconnects
    after a drop do not come through here (aio-pika calls the base class's ``connect``)."""

    async def connect(self, timeout: TimeoutType = None) -> None:  # noqa: ASYNC109 (aio-pika's)
        try:
            await super().connect(timeout=timeout)
        except BaseException:
            with contextlib.suppress(Exception):
                await self.close()
            raise


async def connect_robust(amqp_url: str, **kwargs: Any) -> aio_pika.abc.AbstractRobustConnection:
    """A robust connection to the first node of ``amqp_url`` that answers; on a drop it
    reconnects to the next node, round the list (one-node URLs: aio-pika's own)."""
    warn_if_plaintext(amqp_url)
    urls = broker_urls(amqp_url)
    if len(urls) > 1:
        kwargs.setdefault("reconnect_interval", FAILOVER_RECONNECT_S)
    # One context for every node: the host name each is checked for is its own URL's.
    kwargs.setdefault("ssl_context", tls_context(amqp_url))
    if len(urls) == 1:
        kwargs.setdefault("connection_class", _ClosedWhenItFailsRobustConnection)
        robust: aio_pika.abc.AbstractRobustConnection = await aio_pika.connect_robust(
            amqp_url, **kwargs)
        return robust
    last: BaseException | None = None
    for index in range(len(urls)):
        ordered = urls[index:] + urls[:index]
        connection = FailoverConnection(ordered, **_connection_kwargs(kwargs))
        try:
            await connection.connect(timeout=kwargs.get("timeout"))
        except (OSError, TimeoutError, AMQPError, aio_pika.exceptions.AMQPError) as exc:
            last = exc
            with contextlib.suppress(Exception):
                await connection.close()
            log.warning("broker node %s not reachable: %s", broker_address(ordered[0]),
                        connection_failure(exc, amqp_url))
            continue
        connection.arm()
        return connection
    assert last is not None
    raise last


async def open_connection(url: str, timeout: TimeoutType = None,  # noqa: ASYNC109 (aio-pika's)
                          client_properties: dict[str, Any] | None = None,
                          ) -> aio_pika.abc.AbstractConnection:
    """``aio_pika.connect`` to one node, closing the connection object when the attempt
    fails. aio-pika leaves a failed one to its ``__del__``, which schedules ``close()`` on
    whatever loop runs when the object is collected, or, with none running, leaves a
    coroutine that is never awaited (a warning at an arbitrary later moment)."""
    extra: dict[str, Any] = {} if client_properties is None \
        else {"client_properties": client_properties}
    connection = aio_pika.Connection(aio_pika.connection.make_url(url),
                                     ssl_context=tls_context(url), **extra)
    try:
        await connection.connect(timeout=timeout)
    except BaseException:
        with contextlib.suppress(Exception):
            await connection.close()
        raise
    return connection


async def connect(amqp_url: str, **kwargs: Any) -> aio_pika.abc.AbstractConnection:
    """A plain connection to the first node of ``amqp_url`` that answers."""
    warn_if_plaintext(amqp_url)
    last: BaseException | None = None
    urls = broker_urls(amqp_url)
    for url in urls:
        try:
            return await open_connection(url, **kwargs)
        except (OSError, TimeoutError, AMQPError, aio_pika.exceptions.AMQPError) as exc:
            last = exc
            if len(urls) > 1:  # the caller says why when no node answers
                log.info("broker node %s not reachable: %s", broker_address(url),
                         connection_failure(exc, amqp_url))
    assert last is not None
    raise last


def _connection_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """connect_robust's keyword arguments as the connection class takes them."""
    return {key: value for key, value in kwargs.items() if key != "timeout"}
