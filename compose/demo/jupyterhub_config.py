"""JupyterHub for ``scripts/demo``: the example configuration on one machine.

Loads ``compose/jupyterhub_config.py`` (the file a site deploys) and changes only what one
machine without a cluster needs:

- the hub, its proxy, the GPU page and every notebook listen on 127.0.0.1; notebooks run as
  Swarm services of this machine's engine on the host network, each on a port of its own;
- the one Swarm node is a manager, so the example's ``node.role == worker`` constraint goes;
- log in with a password per user, made at random by ``scripts/demo`` into a file that only
  root may read, so its three users can log in at once (the example's own login, which a site
  keeps, is NativeAuthenticator's accounts: people sign up and an admin authorizes each);
- the demo's users: ``admin`` (staff: every GPU), ``alice`` and ``bob`` (the group ``lab``).

Settings come from ``scripts/demo`` through the environment: ``SWARM_GPU_DEMO_DIR`` (state),
``SWARM_GPU_DEMO_PORT`` (the hub's public port), ``SWARM_GPU_DEMO_PORT_BASE`` (its other
ports), ``SWARM_GPU_DEMO_PREFIX`` (the notebook services' name prefix), plus the example's
own variables (``SWARM_GPU_AMQP_URL``, ``NOTEBOOK_IMAGE``, ``SECRETS_DIR`` …).
"""

import hmac
import json
import os
import time
from pathlib import Path

from jupyterhub.auth import Authenticator

from hubplugin.login_throttle import LoginBackoff

c = get_config()  # noqa: F821  (provided by JupyterHub when it loads this file)
load_subconfig(str(Path(__file__).resolve().parents[1] / "jupyterhub_config.py"))  # noqa: F821

DEMO_DIR = Path(os.environ["SWARM_GPU_DEMO_DIR"])
PORT = int(os.environ.get("SWARM_GPU_DEMO_PORT", "8000"))
PORT_BASE = int(os.environ["SWARM_GPU_DEMO_PORT_BASE"])
PASSWORDS_FILE = DEMO_DIR / "secrets" / "passwords.json"


class DemoAuthenticator(Authenticator):  # type: ignore[misc]
    """A password per user, read from the demo's passwords file at each login; failed logins
    wait per name and client address as the example's do (hubplugin/login_throttle.py)."""

    backoff = LoginBackoff()

    async def authenticate(self, handler, data):  # type: ignore[no-untyped-def]
        name, address = data.get("username", ""), handler.request.remote_ip or ""
        now = time.monotonic()
        if self.backoff.wait_s(name, address, now) > 0:
            return None
        passwords = json.loads(PASSWORDS_FILE.read_text())
        expected = passwords.get(name)
        given = data.get("password", "")
        if expected is not None and hmac.compare_digest(expected.encode(), given.encode()):
            self.backoff.succeeded(name, address)
            return name
        self.backoff.failed(name, address, now)
        return None


passwords = json.loads(PASSWORDS_FILE.read_text())
c.JupyterHub.authenticator_class = DemoAuthenticator
c.Authenticator.allow_all = False
c.Authenticator.allowed_users = set(passwords)
c.Authenticator.admin_users = {"admin"}
c.JupyterHub.load_groups = {
    "staff": {"users": ["admin"]},
    "lab": {"users": ["alice", "bob"]},
    "students": {"users": []},
}
c.GPUSwarmSpawner.group_models = {"staff": ["*"], "lab": ["*"], "students": ["1070"]}
c.GPUSwarmSpawner.group_max_gpus = {"staff": 8, "lab": 2}

# One machine, loopback only.
c.JupyterHub.ip = "127.0.0.1"
c.JupyterHub.port = PORT
c.JupyterHub.hub_ip = "127.0.0.1"
c.JupyterHub.hub_port = PORT_BASE
c.JupyterHub.hub_connect_ip = "127.0.0.1"
c.ConfigurableHTTPProxy.api_url = f"http://127.0.0.1:{PORT_BASE + 1}"
c.ConfigurableHTTPProxy.pid_file = str(DEMO_DIR / "hub" / "proxy.pid")
if chp := os.environ.get("SWARM_GPU_CHP"):
    c.ConfigurableHTTPProxy.command = [chp]
c.JupyterHub.db_url = "sqlite:///" + str(DEMO_DIR / "hub" / "jupyterhub.sqlite")
c.JupyterHub.cookie_secret_file = str(DEMO_DIR / "hub" / "cookie_secret")
c.JupyterHub.pid_file = str(DEMO_DIR / "hub" / "jupyterhub.pid")
c.JupyterHub.cleanup_servers = True  # the demo's stop takes its notebooks with it

# Notebooks: Swarm services on this machine's node, on loopback ports of their own.
c.GPUSwarmSpawner.prefix = os.environ["SWARM_GPU_DEMO_PREFIX"]
c.GPUSwarmSpawner.ip = "127.0.0.1"
c.GPUSwarmSpawner.extra_placement_spec = {"constraints": []}
c.GPUSwarmSpawner.extra_container_spec = {"stop_grace_period": 5_000_000_000}
c.Spawner.http_timeout = 60
