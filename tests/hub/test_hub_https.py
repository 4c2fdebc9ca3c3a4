"""The hub of ``compose/jupyterhub_config.py`` over HTTPS (``hubplugin/https.py``,
``hubplugin/https_redirect.py``).

The real hub, given a certificate a CA of the test's made: ``/hub/health`` answers over TLS
checked against that CA (and fails against the system's), TLS 1.1 is refused while the same
client speaks it to a server that allows it, plain HTTP on the redirect port answers 301 to
the same path over HTTPS, and the login cookies are ``Secure``. The pure parts: which
settings the certificate makes, when it is an error, where a redirect goes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import ssl
import subprocess
import sys
import warnings
from pathlib import Path

import aiohttp
import pytest
import yaml
from traitlets.config import Config
from traitlets.config.loader import PyFileConfigLoader

from hubplugin.https import (
    CERT_FILE_VARIABLE,
    CERT_SECRET,
    HTTPS_PORT_VARIABLE,
    KEY_FILE_VARIABLE,
    KEY_SECRET,
    PLAIN_HTTP_WARNING,
    REDIRECT_PORT_VARIABLE,
    HubTLS,
    TLSSettingError,
    hub_settings,
    redirect_location,
    tls_from_env,
)
from tests.support.hub_harness import REPO_ROOT, Hub
from tests.support.tls_certs import Issued, issue, make_ca

TEST_BUDGET_S = 120


# ------------------------------------------------------------------------- the real hub


@pytest.mark.hub
async def test_the_hub_serves_https_redirects_http_and_sets_secure_cookies(
    tmp_path: Path, chp_path: Path,
) -> None:
    ca, ca_key, ca_cert = make_ca(tmp_path, "hub-ca")
    server = issue(tmp_path, "hub", ca_key, ca_cert, server=True)
    hub = Hub(tmp_path / "hub", chp=chp_path, amqp_url="amqp://guest:guest@127.0.0.1:1/",
              docker_host="unix:///nonexistent/docker.sock", image="unused:never-pulled",
              users={}, first_admin=True, tls=server, tls_ca=ca.cert)
    assert hub.url.startswith("https://")
    async with asyncio.timeout(TEST_BUDGET_S):
        try:
            await hub.start()  # it answers the REST API over HTTPS already
            await the_hub_speaks_tls_with_its_certificate(hub)
            await tls_1_1_is_refused(hub, ca.cert, server)
            await plain_http_is_redirected(hub)
            await the_login_cookies_are_secure(hub)
            await the_stacks_health_check_follows_the_scheme(hub)
        finally:
            await hub.stop()


async def the_hub_speaks_tls_with_its_certificate(hub: Hub) -> None:
    async with hub.client_session() as session, \
            session.get(f"{hub.url}/hub/health") as response:
        assert response.status == 200
        assert response.url.scheme == "https"
    # a client that does not trust the test's CA refuses the hub: TLS with that certificate
    async with aiohttp.ClientSession() as session:
        with pytest.raises(aiohttp.ClientConnectorCertificateError):
            async with session.get(f"{hub.url}/hub/health"):
                pass
    # and the hub's port speaks nothing but TLS
    async with aiohttp.ClientSession() as session:
        with pytest.raises(aiohttp.ClientError):
            async with session.get(f"http://127.0.0.1:{hub.port}/hub/health") as response:
                await response.read()


def _tls_1_1_client(ca_file: Path) -> ssl.SSLContext:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # TLS 1.1 is, on purpose
        context = ssl.create_default_context(cafile=str(ca_file))
        context.minimum_version = context.maximum_version = ssl.TLSVersion.TLSv1_1
    context.set_ciphers("DEFAULT:@SECLEVEL=0")  # OpenSSL 3 offers TLS 1.1 only at level 0
    return context


async def tls_1_1_is_refused(hub: Hub, ca_file: Path, certificate: Issued) -> None:
    client = _tls_1_1_client(ca_file)
    # The control: this client does speak TLS 1.1, to a server that allows it...
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        lenient = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        lenient.minimum_version = ssl.TLSVersion.TLSv1_1
    lenient.set_ciphers("DEFAULT:@SECLEVEL=0")
    lenient.load_cert_chain(certificate.cert, certificate.key)
    server = await asyncio.start_server(lambda _r, w: w.close(), "127.0.0.1", 0, ssl=lenient)
    async with server:
        port = server.sockets[0].getsockname()[1]
        _, writer = await asyncio.open_connection("127.0.0.1", port, ssl=client)
        assert writer.get_extra_info("ssl_object").version() == "TLSv1.1"
        writer.close()
        with contextlib.suppress(ssl.SSLError, ConnectionError):
            await writer.wait_closed()
    # ...and the hub refuses it.
    with pytest.raises(ssl.SSLError):
        await asyncio.open_connection("127.0.0.1", hub.port, ssl=client)


async def plain_http_is_redirected(hub: Hub) -> None:
    plain = f"http://127.0.0.1:{hub.redirect_port}"
    async with aiohttp.ClientSession() as session:
        for method in ("GET", "POST"):
            async with session.request(method, f"{plain}/hub/login?next=/hub/home&a=b",
                                       allow_redirects=False) as response:
                assert response.status == 301, method
                assert response.headers["Location"] == (
                    f"https://127.0.0.1:{hub.port}/hub/login?next=/hub/home&a=b")
        # a Host that is no host gets no redirect at all
        async with session.get(f"{plain}/hub/", headers={"Host": "evil.example/x@y"},
                               allow_redirects=False) as response:
            assert response.status == 400
            assert "Location" not in response.headers
    # followed, the redirect lands on the hub over HTTPS
    async with hub.client_session() as session, session.get(f"{plain}/hub/health") as response:
        assert response.status == 200
        assert str(response.url) == f"https://127.0.0.1:{hub.port}/hub/health"


async def the_login_cookies_are_secure(hub: Hub) -> None:
    jar = aiohttp.CookieJar(unsafe=True)
    assert await hub.log_in("admin", hub.admin_password, jar) == 302
    cookies = {cookie.key: cookie for cookie in jar}
    assert {"jupyterhub-hub-login", "jupyterhub-session-id", "_xsrf"} <= set(cookies)
    for name, cookie in cookies.items():
        assert cookie["secure"], f"{name} is not Secure"
        assert cookie["httponly"] or name == "_xsrf", f"{name} is not HttpOnly"


async def the_stacks_health_check_follows_the_scheme(hub: Hub) -> None:
    """compose/stack.yml's check of the hub (its port here): over HTTPS when the certificate
    is given, and it fails when it asks the TLS port over plain HTTP (so the check tests)."""
    stack = yaml.safe_load((REPO_ROOT / "compose" / "stack.yml").read_text())
    test = stack["services"]["jupyterhub"]["healthcheck"]["test"]
    assert test[:3] == ["CMD", "python3", "-c"]
    code = test[3].replace("127.0.0.1:8000", f"127.0.0.1:{hub.port}")
    base = {k: v for k, v in os.environ.items() if not k.startswith("SWARM_GPU_HUB_TLS")}
    for env, passes in (({**base, "SWARM_GPU_HUB_TLS_CERT_FILE": "/run/secrets/x"}, True),
                        (base, False)):
        done = await asyncio.to_thread(subprocess.run, [sys.executable, "-c", code], env=env,
                                       capture_output=True, text=True, timeout=30, check=False)
        assert (done.returncode == 0) is passes, done.stderr


# ----------------------------------------------------------------------- the settings


def _secrets(*mounted: str) -> object:
    return lambda name: f"/run/secrets/{name}" if name in mounted else None


def test_without_a_certificate_the_hub_serves_plain_http() -> None:
    assert tls_from_env({}, _secrets()) is None  # type: ignore[arg-type]


def test_the_certificate_comes_from_the_variables_or_the_secrets() -> None:
    env = {CERT_FILE_VARIABLE: "/certs/hub.pem", KEY_FILE_VARIABLE: "/certs/hub.key"}
    assert tls_from_env(env, _secrets(CERT_SECRET, KEY_SECRET)) == HubTLS(  # type: ignore[arg-type]
        "/certs/hub.pem", "/certs/hub.key", redirect_port=8080, https_port=443)
    assert tls_from_env({REDIRECT_PORT_VARIABLE: "0", HTTPS_PORT_VARIABLE: "8443"},
                        _secrets(CERT_SECRET, KEY_SECRET)) == HubTLS(  # type: ignore[arg-type]
        "/run/secrets/swarm-gpu-hub-tls-cert", "/run/secrets/swarm-gpu-hub-tls-key",
        redirect_port=0, https_port=8443)


@pytest.mark.parametrize("env, secrets, needle", [
    ({CERT_FILE_VARIABLE: "/c.pem"}, (), f"no key: set {KEY_FILE_VARIABLE}"),
    ({}, (KEY_SECRET,), f"no certificate: set {CERT_FILE_VARIABLE}"),
    ({REDIRECT_PORT_VARIABLE: "http"}, (CERT_SECRET, KEY_SECRET), "not a port number"),
    ({HTTPS_PORT_VARIABLE: "0"}, (CERT_SECRET, KEY_SECRET), "not a port"),
    ({REDIRECT_PORT_VARIABLE: "70000"}, (CERT_SECRET, KEY_SECRET), "not a port"),
])
def test_half_a_tls_setting_is_an_error(env: dict[str, str], secrets: tuple[str, ...],
                                        needle: str) -> None:
    with pytest.raises(TLSSettingError, match=needle):
        tls_from_env(env, _secrets(*secrets))  # type: ignore[arg-type]


def test_https_makes_every_cookie_secure_and_keeps_the_admins_settings() -> None:
    theirs = {"cookie_options": {"samesite": "Strict"}, "headers": {"X-Site": "lab"}}
    settings = hub_settings(HubTLS("/c.pem", "/k.pem"), theirs)
    assert settings == {
        "ssl_cert": "/c.pem", "ssl_key": "/k.pem",
        "tornado_settings": {"cookie_options": {"samesite": "Strict", "secure": True},
                             "headers": {"X-Site": "lab"}},
    }
    assert theirs["cookie_options"] == {"samesite": "Strict"}  # a new dict, theirs unchanged


@pytest.mark.parametrize("host, uri, port, location", [
    ("hub.lab.example", "/hub/", 443, "https://hub.lab.example/hub/"),
    ("hub.lab.example:80", "/a?b=c", 443, "https://hub.lab.example/a?b=c"),
    ("10.0.0.5:8000", "/", 8443, "https://10.0.0.5:8443/"),
    ("[::1]:8080", "/hub/health", 443, "https://[::1]/hub/health"),
    (None, "/", 443, None),
    ("", "/", 443, None),
    ("evil.example/x", "/", 443, None),
    ("user@evil.example", "/", 443, None),
    ("hub.lab.example", "//evil.example/", 443, None),
    ("hub.lab.example", "http://evil.example/", 443, None),
])
def test_the_redirect_keeps_host_and_path_and_nothing_else(
    host: str | None, uri: str, port: int, location: str | None,
) -> None:
    assert redirect_location(host, uri, port) == location


def test_the_example_config_says_loudly_that_it_serves_plain_http(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setenv("SECRETS_DIR", str(tmp_path))  # no secret mounted
    for name in (CERT_FILE_VARIABLE, KEY_FILE_VARIABLE):
        monkeypatch.delenv(name, raising=False)
    with caplog.at_level(logging.WARNING, logger="JupyterHub"):
        config = load_example_config()
    assert "ssl_cert" not in config.JupyterHub
    assert [r.getMessage() for r in caplog.records] == [PLAIN_HTTP_WARNING]

    # with the secrets: HTTPS and Secure cookies, no warning; outside a running hub (this
    # loader), no redirect port is opened
    (tmp_path / CERT_SECRET).write_text("cert")
    (tmp_path / KEY_SECRET).write_text("key")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="JupyterHub"):
        config = load_example_config()
    assert config.JupyterHub.ssl_cert == str(tmp_path / CERT_SECRET)
    assert config.JupyterHub.ssl_key == str(tmp_path / KEY_SECRET)
    assert config.JupyterHub.tornado_settings["cookie_options"] == {"secure": True}
    assert not caplog.records


def load_example_config() -> Config:
    loader = PyFileConfigLoader("jupyterhub_config.py", path=str(REPO_ROOT / "compose"))
    config: Config = loader.load_config()
    return config
