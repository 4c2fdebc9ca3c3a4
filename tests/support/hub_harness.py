"""A real JupyterHub in a subprocess, configured from ``compose/jupyterhub_config.py``.

The example configuration is loaded first (so the tests prove it works), then the overrides
TEST-INFRA.md verified for this machine: host networking, ``use_internal_ip``, 127.0.0.1,
one fixed port per user, busybox ``httpd`` as the server, ``get_ip_and_port`` overridden.
The example's authenticator stays: the test users and their groups are made through the
hub's REST API with an admin token, as an admin would, and a user who logs in through the
login form first signs up and is authorized by that admin (:meth:`Hub.login_password`).
Users talk to the hub over its REST API with their own tokens, as they would in real life.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import signal
import ssl
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

from tests.support.ports import free_port
from tests.support.tls_certs import Issued

REPO_ROOT = Path(__file__).resolve().parents[2]
EXAMPLE_CONFIG = REPO_ROOT / "compose" / "jupyterhub_config.py"

CONFIG_TEMPLATE = """\
import json
from hubplugin.spawner import GPUSwarmSpawner

SETTINGS = json.loads(__SETTINGS__)
# before the example: it binds its plain-HTTP redirect (with a certificate) to the hub's address
get_config().JupyterHub.ip = "127.0.0.1"
load_subconfig(__EXAMPLE__)
c = get_config()


class E2ESwarmSpawner(GPUSwarmSpawner):
    # host networking: the server listens on the host's loopback at a fixed port
    async def get_ip_and_port(self):
        return self.host_ip, self.port


def pre_spawn_hook(spawner):
    port = SETTINGS["ports"][spawner.user.name]
    spawner.port = port
    # `sh -c` swallows the hub's --arguments, which httpd would refuse
    spawner.cmd = ["sh", "-c", "exec httpd -f -p 127.0.0.1:%d" % port, "server"]


c.JupyterHub.spawner_class = E2ESwarmSpawner
c.JupyterHub.ip = "127.0.0.1"
c.JupyterHub.port = SETTINGS["hub_port"]
c.JupyterHub.hub_ip = "127.0.0.1"
c.JupyterHub.hub_port = SETTINGS["hub_api_port"]
c.JupyterHub.hub_connect_ip = "127.0.0.1"
c.JupyterHub.cleanup_servers = SETTINGS["cleanup_servers"]
c.JupyterHub.db_url = "sqlite:///" + SETTINGS["dir"] + "/hub.sqlite"
c.JupyterHub.cookie_secret_file = SETTINGS["dir"] + "/cookie_secret"
c.JupyterHub.pid_file = SETTINGS["dir"] + "/hub.pid"
c.JupyterHub.log_level = "DEBUG"
c.ConfigurableHTTPProxy.command = [SETTINGS["chp"]]
c.ConfigurableHTTPProxy.api_url = "http://127.0.0.1:%d" % SETTINGS["proxy_api_port"]
c.ConfigurableHTTPProxy.pid_file = SETTINGS["dir"] + "/proxy.pid"
# The example's GPU page service (and the user role that may open it) only where a test
# asks for it: every other hub test runs without that process.
page_services = [s for s in c.JupyterHub.services if SETTINGS["page"] and s["name"] == "gpu"]
page_roles = [r for r in c.JupyterHub.load_roles if SETTINGS["page"] and r["name"] == "user"]
c.JupyterHub.services = [*page_services, {"name": "e2e", "api_token": SETTINGS["admin_token"]}]
c.JupyterHub.load_roles = [*page_roles, {
    "name": "e2e-admin",
    "scopes": ["admin:users", "admin:servers", "admin:groups", "tokens", "list:users",
               "read:users"],
    "services": ["e2e"],
}]

c.Spawner.pre_spawn_hook = pre_spawn_hook
c.Spawner.http_timeout = 30
c.GPUSwarmSpawner.image = SETTINGS["image"]
c.GPUSwarmSpawner.network_name = "host"
c.GPUSwarmSpawner.use_internal_ip = True
c.GPUSwarmSpawner.host_ip = "127.0.0.1"
c.GPUSwarmSpawner.prefix = SETTINGS["prefix"]
# the example's users' volumes, named after this hub (the engine is shared): the hub factory
# removes them with the hub
c.GPUSwarmSpawner.user_volume = SETTINGS["prefix"] + "-home-{username}"
c.GPUSwarmSpawner.allocator_url = SETTINGS["amqp_url"]
c.GPUSwarmSpawner.hub_id = SETTINGS["hub_id"]
c.GPUSwarmSpawner.allocator_timeout = SETTINGS["allocator_timeout"]
c.GPUSwarmSpawner.allocator_connect_timeout = 3.0
c.GPUSwarmSpawner.release_timeout = 3.0
c.GPUSwarmSpawner.wait_s = SETTINGS["wait_s"]
# the single test node is a manager, and busybox httpd as PID 1 ignores SIGTERM
c.GPUSwarmSpawner.extra_placement_spec = {"constraints": ["node.role == manager"]}
c.GPUSwarmSpawner.extra_container_spec = {"stop_grace_period": 1_000_000_000,
                                          "labels": {"swarm-gpu.test": "e2e"}}
for key, value in SETTINGS["extra"].items():
    setattr(c.GPUSwarmSpawner, key, value)
"""


class HubError(AssertionError):
    pass


class Hub:
    """One JupyterHub process and an HTTP session to talk to it."""

    def __init__(
        self,
        directory: Path,
        *,
        chp: Path,
        amqp_url: str,
        docker_host: str,
        image: str,
        users: dict[str, list[str]],
        hub_id: str = "e2e",
        wait_s: float = 0.0,
        allocator_timeout: float = 5.0,
        extra: dict[str, Any] | None = None,
        cleanup_servers: bool = True,
        page: dict[str, str] | None = None,
        first_admin: bool = False,
        tls: Issued | None = None,
        tls_ca: Path | None = None,
    ) -> None:
        """``users``: each test user's groups, made through the REST API at each start.
        ``page``: run the example's GPU page service too, with these ``SWARM_GPU_PAGE_*``
        settings over the test defaults (its own port, history file in ``directory``).
        ``first_admin``: give the hub the secret ``swarm-gpu-hub-admin-password`` (in
        ``admin_password``), so the example makes the first admin's account from it (a bcrypt
        hash: a fraction of a second at the first start, so only where a test asks).
        ``tls``: the hub's certificate and key, given as the example reads them (its
        variables), so the hub serves HTTPS, checked against ``tls_ca``, and redirects plain
        HTTP from ``redirect_port``."""
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self.port}"
        self.redirect_port = free_port() if tls else 0
        self.ssl: ssl.SSLContext | None = (
            ssl.create_default_context(cafile=str(tls_ca)) if tls and tls_ca else None)
        self.admin_token = secrets.token_hex(16)
        self.prefix = f"sgtest-{secrets.token_hex(3)}"
        self.hub_id = hub_id
        self.users = users
        self.ports = {user: free_port() for user in users}
        self.settings = {
            "dir": str(self.dir), "hub_port": self.port, "hub_api_port": free_port(),
            "proxy_api_port": free_port(), "chp": str(chp),
            "admin_token": self.admin_token, "image": image,
            "prefix": self.prefix, "amqp_url": amqp_url, "hub_id": hub_id,
            "allocator_timeout": allocator_timeout, "wait_s": wait_s, "ports": self.ports,
            "extra": extra or {}, "cleanup_servers": cleanup_servers, "page": page is not None,
        }
        # The example reads its secrets from SECRETS_DIR: the hub's own folder, never the
        # machine's /run/secrets.
        secrets_dir = self.dir / "secrets"
        secrets_dir.mkdir(exist_ok=True)
        self.admin_password = ""
        if first_admin:
            self.admin_password = secrets.token_hex(24)
            (secrets_dir / "swarm-gpu-hub-admin-password").write_text(self.admin_password + "\n")
        self.env = {**os.environ, "DOCKER_HOST": docker_host, "PYTHONUNBUFFERED": "1",
                    "SECRETS_DIR": str(secrets_dir)}
        if tls is not None:
            self.env.update({
                "SWARM_GPU_HUB_TLS_CERT_FILE": str(tls.cert),
                "SWARM_GPU_HUB_TLS_KEY_FILE": str(tls.key),
                "SWARM_GPU_HUB_HTTP_REDIRECT_PORT": str(self.redirect_port),
                "SWARM_GPU_HUB_HTTPS_PUBLIC_PORT": str(self.port),
            })
        self.page_url = f"{self.url}/services/gpu/"
        if page is not None:
            self.env.update({
                "SWARM_GPU_PAGE_URL": f"http://127.0.0.1:{free_port()}",
                "SWARM_GPU_PAGE_HISTORY_PATH": str(self.dir / "gpu-page-history.sqlite"),
                "SWARM_GPU_PAGE_REFRESH_S": "0",
                "SWARM_GPU_PAGE_AMQP_URL": amqp_url,
                "SWARM_GPU_PAGE_HUB_ID": hub_id,
                **page,
            })
        self.config_path = self.dir / "jupyterhub_config.py"
        self.log_path = self.dir / "hub.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.session: aiohttp.ClientSession | None = None
        self.tokens: dict[str, str] = {}
        self.passwords: dict[str, str] = {"admin": self.admin_password} if first_admin else {}
        self._admin_jar: aiohttp.CookieJar | None = None

    def client_session(self, **kwargs: Any) -> aiohttp.ClientSession:
        """A client of this hub: over HTTPS, one that trusts only the test's CA."""
        if self.ssl is not None:
            kwargs["connector"] = aiohttp.TCPConnector(ssl=self.ssl)
        return aiohttp.ClientSession(**kwargs)

    def service_name(self, user: str, server: str = "") -> str:
        return f"{self.prefix}-{user}" + (f"--{server}" if server else "")

    def request_key(self, user: str, server: str = "") -> str:
        return f"{self.hub_id}/{user}/{server}"

    # ---------------------------------------------------------------- lifecycle

    def _launch(self) -> subprocess.Popen[bytes]:
        self.config_path.write_text(
            CONFIG_TEMPLATE.replace("__EXAMPLE__", repr(str(EXAMPLE_CONFIG)))
            .replace("__SETTINGS__", repr(json.dumps(self.settings))))
        with open(self.log_path, "ab") as log:
            return subprocess.Popen(
                [sys.executable, "-m", "jupyterhub", "-f", str(self.config_path)],
                cwd=self.dir, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    async def start(self, within: float = 60.0) -> None:
        """Start the hub (again, after stop(): same ports, same database)."""
        self.proc = self._launch()
        timeout = within
        self.session = self.client_session(timeout=aiohttp.ClientTimeout(total=30))
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise HubError(f"JupyterHub exited with {self.proc.returncode}:\n{self.log_tail()}")
            with contextlib.suppress(aiohttp.ClientError, OSError):
                status, _ = await self.api("GET", "/", token=self.admin_token)
                if status == 200:
                    break
            if time.monotonic() > deadline:
                raise HubError(f"JupyterHub did not answer within {timeout} s:\n{self.log_tail()}")
            await asyncio.sleep(0.3)
        await self._make_users()
        for user in self.users:
            status, body = await self.api("POST", f"/users/{user}/tokens",
                                          {"note": "e2e", "expires_in": 3600},
                                          token=self.admin_token)
            if status != 201:
                raise HubError(f"token for {user}: {status} {body}")
            self.tokens[user] = body["token"]

    async def _make_users(self) -> None:
        """The test users and their groups, through the REST API as an admin makes them
        (again after a restart: what exists already stays)."""
        if self.users:
            status, body = await self.api("POST", "/users", {"usernames": sorted(self.users)})
            if status not in (201, 409):  # 409: all of them exist (a restart)
                raise HubError(f"creating the users: {status} {body}")
        groups: dict[str, list[str]] = {}
        for user, user_groups in self.users.items():
            for group in user_groups:
                groups.setdefault(group, []).append(user)
        for group, members in sorted(groups.items()):
            status, body = await self.api("POST", f"/groups/{group}")
            if status not in (201, 409):  # 409: the example's groups, or a restart
                raise HubError(f"creating the group {group}: {status} {body}")
            status, body = await self.api("POST", f"/groups/{group}/users",
                                          {"users": sorted(members)})
            if status != 200:
                raise HubError(f"adding {members} to {group}: {status} {body}")

    async def stop(self, within: float = 40.0) -> None:
        if self.session is not None:
            await self.session.close()
            self.session = None
        if self.proc is None:
            return
        proc, self.proc = self.proc, None
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.to_thread(proc.wait, within)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                await asyncio.to_thread(proc.wait, 10)
        # Whatever else is left of the hub's session goes too.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        # JupyterHub starts its proxy in a session of its own (so that a hub restart keeps
        # it) and stops it only on a clean shutdown: a killed hub leaves it running.
        self._stop_proxy()

    def _stop_proxy(self) -> None:
        try:
            pid = int((self.dir / "proxy.pid").read_text().strip())
            command = Path(f"/proc/{pid}/cmdline").read_bytes()
        except (OSError, ValueError):
            return  # no proxy left, or none was started
        if b"configurable-http-proxy" in command:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, lines: int = 80) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    # ---------------------------------------------------------------- REST API

    async def api(self, method: str, path: str, body: Any = None, *,
                  token: str | None = None, user: str | None = None) -> tuple[int, Any]:
        assert self.session is not None
        token = token or (self.tokens[user] if user else self.admin_token)
        headers = {"Authorization": f"token {token}"}
        async with self.session.request(
            method, f"{self.url}/hub/api{path}", headers=headers,
            data=json.dumps(body) if body is not None else None,
        ) as response:
            text = await response.text()
            try:
                data = json.loads(text) if text else None
            except ValueError:
                data = text
            return response.status, data

    async def spawn(self, user: str, options: dict[str, Any] | None,
                    server: str = "") -> tuple[int, Any]:
        path = f"/users/{user}/servers/{server}" if server else f"/users/{user}/server"
        body = {"user_options": options} if options is not None else None
        return await self.api("POST", path, body, user=user)

    async def start_server(self, user: str, options: dict[str, Any] | None, server: str = "",
                           within: float = 60.0) -> dict:
        """Spawn and wait until the server is ready; fails when the hub refuses the spawn."""
        status, body = await self.spawn(user, options, server)
        if status not in (201, 202):
            raise HubError(f"spawn of {user}'s server: {status} {body}\n{self.log_tail()}")
        return await self.wait_ready(user, server, within)

    async def server_model(self, user: str, server: str = "") -> dict[str, Any] | None:
        status, body = await self.api("GET", f"/users/{user}", user=user)
        if status != 200:
            raise HubError(f"GET user {user}: {status} {body}")
        return (body.get("servers") or {}).get(server)

    async def wait_ready(self, user: str, server: str = "", within: float = 60.0) -> dict:
        """Wait until the server is ready; fails at once if the spawn ended without it."""
        timeout = within
        deadline = time.monotonic() + timeout
        model = None
        while time.monotonic() < deadline:
            model = await self.server_model(user, server)
            if model and model.get("ready"):
                return model
            if not model or not model.get("pending"):
                raise HubError(f"{user}'s server is not starting ({model}):\n{self.log_tail()}")
            await asyncio.sleep(0.3)
        raise HubError(f"{user}'s server not ready in {timeout} s ({model}):\n{self.log_tail()}")

    async def stop_server(self, user: str, server: str = "", within: float = 40.0) -> None:
        timeout = within
        path = f"/users/{user}/servers/{server}" if server else f"/users/{user}/server"
        status, body = await self.api("DELETE", path, user=user)
        if status not in (202, 204):
            raise HubError(f"DELETE {path}: {status} {body}")
        deadline = time.monotonic() + timeout
        while await self.server_model(user, server):
            if time.monotonic() > deadline:
                raise HubError(f"{user}'s server still there {timeout} s after DELETE")
            await asyncio.sleep(0.3)

    async def progress_events(self, user: str, server: str = "", *, until: str,
                              within: float = 30.0) -> list[dict[str, Any]]:
        """Read the spawn progress stream until an event's message contains ``until``.

        The stream answers 404 until the spawn is pending: retried until ``within``.
        """
        assert self.session is not None
        path = f"/users/{user}/servers/{server}/progress" if server else \
            f"/users/{user}/server/progress"
        events: list[dict[str, Any]] = []
        headers = {"Authorization": f"token {self.tokens[user]}"}
        async with asyncio.timeout(within):
            while True:
                async with self.session.get(
                    f"{self.url}/hub/api{path}", headers=headers,
                    timeout=aiohttp.ClientTimeout(total=None, sock_read=within),
                ) as response:
                    if response.status == 404:
                        await asyncio.sleep(0.1)
                        continue
                    if response.status != 200:
                        raise HubError(f"progress: {response.status} {await response.text()}")
                    async for raw in response.content:
                        line = raw.decode().strip()
                        if not line.startswith("data:"):
                            continue
                        event = json.loads(line[5:])
                        events.append(event)
                        if until in str(event.get("message", "")) or event.get("failed"):
                            return events
                    return events

    # ---------------------------------------------------------------- browser login

    async def form_post(self, path: str, fields: dict[str, str],
                        jar: aiohttp.CookieJar | None = None, *, action: str | None = None,
                        xsrf: bool = True) -> tuple[int, str]:
        """GET the hub's page ``path`` for its XSRF cookie, then POST its form (to ``action``,
        by default ``path`` itself) with ``fields`` and the token, as a browser does (without
        the token if not ``xsrf``); the status (redirects not followed) and the page."""
        jar = jar if jar is not None else aiohttp.CookieJar(unsafe=True)
        async with self.client_session(cookie_jar=jar) as session:
            async with session.get(f"{self.url}{path}") as response:
                await response.text()
            token = next((c.value for c in jar if c.key == "_xsrf"), "")
            data = {**fields, "_xsrf": token} if xsrf else fields
            async with session.post(f"{self.url}{action or path}", data=data,
                                    allow_redirects=False) as response:
                return response.status, await response.text()

    async def sign_up(self, user: str, password: str) -> str:
        """Sign up at /hub/signup as a person does; the page's message."""
        status, page = await self.form_post("/hub/signup", {
            "username": user, "signup_password": password,
            "signup_password_confirmation": password})
        if status != 200:
            raise HubError(f"signup of {user}: {status}\n{self.log_tail()}")
        return page

    async def toggle_authorization(self, user: str) -> None:
        """What the first admin's click in /hub/authorize does: authorize ``user``'s account
        (or take the authorization back). The admin logs in once, in a session of its own:
        the hub's pages take no API token."""
        if not self.admin_password:
            raise HubError("this hub has no admin to authorize a signup: Hub(first_admin=True)")
        if self._admin_jar is None:
            jar = aiohttp.CookieJar(unsafe=True)
            if await self.log_in("admin", self.admin_password, jar) != 302:
                raise HubError(f"the first admin cannot log in:\n{self.log_tail()}")
            self._admin_jar = jar
        # the form of the list at /hub/authorize, with the page's XSRF token
        status, _ = await self.form_post("/hub/authorize", {}, self._admin_jar,
                                         action=f"/hub/authorize/{user}")
        if status != 302:
            raise HubError(f"authorizing {user}: {status}\n{self.log_tail()}")

    async def login_password(self, user: str) -> str:
        """``user``'s password for the login form (the first admin's is the secret's): at the
        first call the user signs up with a new random one and the first admin authorizes the
        account (so only on a hub started with ``first_admin``)."""
        if user not in self.passwords:
            password = secrets.token_urlsafe(16)
            await self.sign_up(user, password)
            await self.toggle_authorization(user)
            self.passwords[user] = password
        return self.passwords[user]

    async def log_in(self, user: str, password: str,
                     jar: aiohttp.CookieJar | None = None) -> int:
        """Post the login form as ``user``; the status: 302 when let in, 403 (the form again,
        with its error) when not."""
        status, _ = await self.form_post("/hub/login?next=", {"username": user,
                                                              "password": password}, jar)
        return status

    async def login_cookies(self, user: str) -> dict[str, str]:
        """Log in through the login form (as a browser does) and return the session cookies."""
        jar = aiohttp.CookieJar(unsafe=True)
        status = await self.log_in(user, await self.login_password(user), jar)
        if status not in (302, 303):
            raise HubError(f"login as {user}: {status}")
        return {c.key: c.value for c in jar}
