"""Example JupyterHub configuration for swarm-gpu: GPUs per notebook server on Docker Swarm.

Runs the hub as a Swarm service next to RabbitMQ and the allocator (see the stack file in this
folder). Everything site-specific comes from environment variables and secret files, so the
same file serves a laptop demo and a cluster:

    SWARM_GPU_AMQP_URL_FILE  a file (Docker secret) holding the broker URL with the hub's
                           own broker user and its password (or SWARM_GPU_AMQP_URL: the URL)
    SWARM_GPU_HUB_ID       names this hub in lease request keys (unique per hub)
    NOTEBOOK_IMAGE         the single-user image (with CUDA libraries for GPU work)
    SWARM_GPU_NETWORK      network shared by the hub and the notebook services: the stack's
                           overlay network, or "host" on a Swarm without overlay networks
    HUB_CONNECT_IP         how notebook containers reach the hub (its service name, or an
                           address of the hub's node under host networking)
    NOTEBOOK_PORT_BASE     host networking only: a user's server listens on this + user id
    SWARM_GPU_WAIT_S       how long a GPU request may wait in the queue (seconds)
    SWARM_GPU_HUB_TLS_CERT_FILE, SWARM_GPU_HUB_TLS_KEY_FILE
                           the hub's certificate and key (Docker secrets; or the secrets
                           swarm-gpu-hub-tls-cert and swarm-gpu-hub-tls-key): the hub's port
                           speaks HTTPS, cookies are Secure, and plain HTTP on
                           SWARM_GPU_HUB_HTTP_REDIRECT_PORT (8080; 0 = off) is redirected to
                           HTTPS on SWARM_GPU_HUB_HTTPS_PUBLIC_PORT (443). Without them the
                           hub serves plain HTTP and says so loudly in its log
    SWARM_GPU_USER_VOLUME  each user's volume, mounted at /home/jovyan/work
                           (swarm-gpu-home-{username}; empty = none), with
                           SWARM_GPU_USER_VOLUME_DRIVER and SWARM_GPU_USER_VOLUME_OPTIONS (JSON)

Log in: accounts of JupyterHub's NativeAuthenticator (``hubplugin.login``). People sign up
at /hub/signup; an account lets its person in only once an admin has authorized it at
/hub/authorize, whatever its name. The first admin, ``admin``, gets an account at the hub's
first start with the password in the secret ``swarm-gpu-hub-admin-password``. Who is in
``staff`` (every GPU) or ``students`` is the admins' choice in the admin page (/hub/admin,
Groups) or the REST API, never a name in this file. A site with its own identity provider
replaces the authenticator (``c.JupyterHub.authenticator_class``) and may fill the groups
from it (``manage_groups``). Automation gets an admin API token from the secret
``swarm-gpu-hub-api-token`` (the service ``admin-api``).

GPU nodes need the NVIDIA container runtime as Docker's *default* runtime
(``"default-runtime": "nvidia"`` in /etc/docker/daemon.json): Swarm services cannot ask for
``--gpus``, so the runtime exposes exactly the GPUs named by ``NVIDIA_VISIBLE_DEVICES``, which
the spawner sets from the lease (``void`` = none for servers without a GPU).
"""

import logging
import os
import sys

c = get_config()  # noqa: F821  (provided by JupyterHub when it loads this file)

# ------------------------------------------------------------------------------- the hub
c.JupyterHub.spawner_class = "gpu-swarm"  # hubplugin.spawner.GPUSwarmSpawner
c.JupyterHub.hub_ip = "0.0.0.0"
c.JupyterHub.hub_connect_ip = os.environ.get("HUB_CONNECT_IP", "jupyterhub")
c.JupyterHub.cleanup_servers = False  # a hub restart leaves notebooks (and their GPUs) alone


def secret_file(name: str) -> str | None:
    """The path of the Docker secret ``name``, if mounted."""
    path = os.path.join(os.environ.get("SECRETS_DIR", "/run/secrets"), name)
    return path if os.path.isfile(path) else None


def secret(name: str) -> str | None:
    """The content of the Docker secret ``name`` (trailing newline stripped), if mounted."""
    if (path := secret_file(name)) is None:
        return None
    with open(path) as file:
        return file.read().rstrip("\r\n") or None


# ------------------------------------------------------------------------------- HTTPS
# With a certificate and key (hubplugin/https.py) the hub's port speaks TLS 1.2 or 1.3, every
# cookie is Secure, and plain HTTP on a second port gets a 301 to the same path over HTTPS
# (hubplugin/https_redirect.py, on the hub's own event loop). Without them the hub serves
# plain HTTP: fit for a laptop or behind a proxy that ends TLS, and the log says so loudly.
from hubplugin.https import PLAIN_HTTP_WARNING, hub_settings, tls_from_env  # noqa: E402

if (hub_tls := tls_from_env(os.environ, secret_file)) is not None:
    for _name, _value in hub_settings(
            hub_tls, c.JupyterHub.get("tornado_settings") or {}).items():
        setattr(c.JupyterHub, _name, _value)
    if hub_tls.redirect_port:
        from hubplugin.https_redirect import serve_redirect

        serve_redirect(hub_tls.redirect_port, hub_tls.https_port, c.JupyterHub.get("ip", ""))
else:
    logging.getLogger("JupyterHub").warning(PLAIN_HTTP_WARNING)

# ------------------------------------------------------------------------------- log in
# NativeAuthenticator's accounts (hubplugin/login.py): a signup waits until an admin
# authorizes it at /hub/authorize; only an authorized account may log in. Its name grants
# nothing: an account is never authorized because its name is a hub user, an admin or a
# member of a group already.
c.JupyterHub.authenticator_class = "hubplugin.login.AdminAuthorizedAuthenticator"
c.NativeAuthenticator.open_signup = False  # True would let in everyone who signs up
c.NativeAuthenticator.minimum_password_length = 10
c.NativeAuthenticator.check_common_password = True
# Failed logins wait per name AND client address (a stranger guessing at "admin" cannot lock
# the admin out): 3 free, then 2 s, doubling up to 15 min. Signups: 3 per address and 30 in
# all per hour. NativeAuthenticator's own lockout (allowed_failed_logins, per name alone)
# is not used.
c.AdminAuthorizedAuthenticator.login_free_failures = 3
c.AdminAuthorizedAuthenticator.login_first_wait_s = 2.0
c.AdminAuthorizedAuthenticator.login_max_wait_s = 900.0
c.AdminAuthorizedAuthenticator.signups_per_address = 3
c.AdminAuthorizedAuthenticator.signups_in_total = 30
c.AdminAuthorizedAuthenticator.signup_window_s = 3600.0
# The first admin: an authorized account, made at the hub's first start (before anyone can
# sign up) with the password in this secret; the admin may change it at
# /hub/change-password. Further admins: an admin ticks "admin" on a user in /hub/admin.
first_admin = "admin"
first_admins = []  # those with an account: in staff from the start
c.AdminAuthorizedAuthenticator.first_admin = first_admin
if (admin_password_file := secret_file("swarm-gpu-hub-admin-password")) is not None:
    c.AdminAuthorizedAuthenticator.first_admin_password_file = admin_password_file
    first_admins.append(first_admin)

# The two groups exist from the start; their members are the admins' to set (/hub/admin,
# Groups, or the REST API). Names of people in this file would make hub users before their
# people sign up, and an admin who authorizes such a signup cannot tell who made it.
c.JupyterHub.load_groups = {"students": {"users": []}, "staff": {"users": first_admins}}
for _variable in ("HUB_STAFF", "HUB_STUDENTS"):
    if os.environ.get(_variable):
        logging.getLogger("JupyterHub").warning(
            "%s is no longer read: put users into the groups in the admin page (/hub/admin, "
            "Groups) after authorizing their accounts", _variable)

# Hub services and roles; the GPU page below adds its own.
services: list[dict] = []
roles: list[dict] = []
# An API token for the admin's automation (start and stop servers, list users).
if (api_token := secret("swarm-gpu-hub-api-token")) is not None:
    services.append({"name": "admin-api", "api_token": api_token})
    roles.append({
        "name": "admin-api",
        "scopes": ["admin:users", "admin:servers", "admin:groups", "list:users",
                   "read:users", "tokens"],
        "services": ["admin-api"],
    })

# -------------------------------------------------------------------------- the allocator
# The broker user `hub` of compose/rabbitmq-definitions.json (vhost `swarm-gpu`): it may only
# publish requests to the allocator and read its own replies. Keep its URL (with the
# password) in a file, a Docker secret: SWARM_GPU_AMQP_URL_FILE=/run/secrets/hub-amqp-url.
# The spawner and the GPU page read that file themselves, so the password is in no
# environment variable of the hub or the page. SWARM_GPU_AMQP_URL (the URL itself) still
# works, for a hub whose start script builds the URL from a password file (the stack's); the
# page then gets it in a file of its own (below), never in its environment.
if amqp_url_file := os.environ.get("SWARM_GPU_AMQP_URL_FILE"):
    c.GPUSwarmSpawner.allocator_url_file = amqp_url_file
else:
    c.GPUSwarmSpawner.allocator_url = os.environ.get(
        "SWARM_GPU_AMQP_URL", "amqp://hub:CHANGE-ME@rabbitmq:5672/swarm-gpu"
    )
c.GPUSwarmSpawner.hub_id = os.environ.get("SWARM_GPU_HUB_ID", "hub")
c.GPUSwarmSpawner.allocator_timeout = 10.0  # one RPC call
c.GPUSwarmSpawner.allocator_form_timeout = 3.0  # the spawn form renders without GPUs after this
c.GPUSwarmSpawner.wait_s = float(os.environ.get("SWARM_GPU_WAIT_S", "300"))
# start_timeout defaults to wait_s + 120 s, so a queued request is not cut short by the hub.

# ---------------------------------------------------------------------- the GPU page
# /services/gpu/: each user's GPUs (utilization and memory over the last hours, idle time,
# guaranteed or borrowed, a pending reclaim and its deadline, the queue position); admins and
# the groups in SWARM_GPU_PAGE_ADMIN_GROUPS see every GPU. A managed service: the hub starts
# it (python -m hubplugin.page), routes /services/gpu/ to it and logs users in with OAuth.
# It asks the allocator (its inventory, over the broker) with the hub's broker user and keeps
# its own small SQLite file of usage samples (SWARM_GPU_PAGE_HISTORY_PATH; in the hub's data
# volume in the stack). Every SWARM_GPU_PAGE_* variable of the hub is passed on
# (hubplugin/page/settings.py) but the broker URL: the page gets only the name of a file
# that holds it (SWARM_GPU_PAGE_AMQP_URL_FILE), since a service's environment is handed on to
# whatever it runs and shows in crash reports.


def private_file(text: str, name: str) -> str:
    """A new file ``name`` holding ``text``, readable by the hub's user only (mode 0600, in a
    0700 folder of its own, made with O_EXCL), removed when the hub exits; its path."""
    import atexit
    import shutil
    import tempfile

    folder = tempfile.mkdtemp(prefix="swarm-gpu-hub-")
    atexit.register(shutil.rmtree, folder, True)
    path = os.path.join(folder, name)
    with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as file:
        file.write(text + "\n")
    return path


# The page's broker URL: its own file if the hub names one, else the spawner's file, else the
# URL (the page's own SWARM_GPU_PAGE_AMQP_URL, or the spawner's) written into a private file.
page_url_file = (os.environ.get("SWARM_GPU_PAGE_AMQP_URL_FILE") or amqp_url_file
                 or private_file(os.environ.get("SWARM_GPU_PAGE_AMQP_URL")
                                 or c.GPUSwarmSpawner.allocator_url, "amqp-url"))
services.append({
    "name": "gpu",
    "url": os.environ.get("SWARM_GPU_PAGE_URL", "http://127.0.0.1:10101"),
    "command": [sys.executable, "-m", "hubplugin.page"],
    "oauth_no_confirm": True,  # a page of the hub itself: no "authorize this service" step
    "environment": {
        "SWARM_GPU_PAGE_HUB_ID": c.GPUSwarmSpawner.hub_id,
        "SWARM_GPU_PAGE_ADMIN_GROUPS": "staff",
        **{k: v for k, v in os.environ.items()
           if k.startswith("SWARM_GPU_PAGE_") and k != "SWARM_GPU_PAGE_AMQP_URL"},
        "SWARM_GPU_PAGE_AMQP_URL_FILE": page_url_file,
    },
})
# Every user may open it (the default role "user" has only "self").
roles.append({"name": "user", "scopes": ["self", "access:services!service=gpu"]})
c.JupyterHub.services = services
c.JupyterHub.load_roles = roles

# ------------------------------------------------------------------------ who gets what
c.GPUSwarmSpawner.group_models = {
    "students": ["1070"],  # aliases as configured in the allocator
    "staff": ["*"],
}
c.GPUSwarmSpawner.default_models = []  # users in neither group: no GPU
c.GPUSwarmSpawner.user_max_gpus = 1
c.GPUSwarmSpawner.group_max_gpus = {"staff": 8}
c.GPUSwarmSpawner.max_share_memory_mib = 8192
c.GPUSwarmSpawner.share_default_memory_mib = 2048
c.GPUSwarmSpawner.default_gpu_mode = "none"

c.GPUSwarmSpawner.gpu_profiles = [
    {
        "slug": "cpu",
        "display_name": "CPU only",
        "description": "Editing, plotting, small data.",
        "mode": "none",
        "default": True,
    },
    {
        "slug": "gtx1070",
        "display_name": "One GTX 1070",
        "description": "A whole 8 GB GPU for training small models.",
        "mode": "exclusive",
        "model": "1070",
        "count": 1,
    },
    {
        "slug": "gtx1070-share",
        "display_name": "Shared GTX 1070 (2 GiB)",
        "description": "A slice of a GPU: fine for inference and teaching.",
        "mode": "shared",
        "model": "1070",
        "share_memory_mib": 2048,
    },
    {
        "slug": "two-3090",
        "display_name": "Two RTX 3090",
        "description": "Multi-GPU training.",
        "groups": ["staff"],
        "mode": "exclusive",
        "model": "3090",
        "count": 2,
        "spawner_override": {"mem_limit": "32G", "cpu_limit": 8.0},
    },
    {
        "slug": "a100-node",
        "display_name": "A whole A100 node",
        "description": "Every A100 of one host.",
        "groups": ["staff"],
        "mode": "exclusive",
        "model": "a100",
        "all_gpus_of_host": True,
        "spawner_override": {"mem_limit": "256G"},
    },
]

# -------------------------------------------------------------------- the Swarm service
c.GPUSwarmSpawner.image = os.environ.get(
    "NOTEBOOK_IMAGE", "quay.io/jupyter/pytorch-notebook:cuda12-latest"
)
c.GPUSwarmSpawner.network_name = os.environ.get("SWARM_GPU_NETWORK", "swarm-gpu_notebooks")
if c.GPUSwarmSpawner.network_name == "host":
    # A Swarm without overlay networks: notebook services share their node's network, so
    # no address comes from Swarm and each user's server needs a port of its own.
    from hubplugin.spawner import GPUSwarmSpawner

    class HostNetworkGPUSwarmSpawner(GPUSwarmSpawner):  # type: ignore[misc]
        """The server's address is the one configured (dockerspawner asks for this
        override under host networking)."""

        async def get_ip_and_port(self) -> tuple[str, int]:
            return self.host_ip, self.port

    def host_network_port(spawner) -> None:  # type: ignore[no-untyped-def]
        spawner.port = int(os.environ.get("NOTEBOOK_PORT_BASE", "18800")) + spawner.user.id

    c.JupyterHub.spawner_class = HostNetworkGPUSwarmSpawner
    c.GPUSwarmSpawner.use_internal_ip = True
    c.GPUSwarmSpawner.host_ip = os.environ.get("NOTEBOOK_HOST_IP", "127.0.0.1")
    c.Spawner.pre_spawn_hook = host_network_port
# Placement: a server with GPUs runs on its lease's host, which the spawner pins
# (node.hostname == <host>) whatever that node's role; a constraint here that a GPU node may
# not meet (node.role == worker, with GPUs on a manager) would leave such a server pending
# for good. A server without a GPU runs wherever Swarm places it. To keep notebooks off some
# nodes, constrain on a label that every GPU node has too, e.g.
#   c.GPUSwarmSpawner.extra_placement_spec = {
#       "constraints": ["node.labels.swarm-gpu.notebooks == true"]}
c.GPUSwarmSpawner.extra_container_spec = {
    "stop_grace_period": 10_000_000_000,  # nanoseconds
}
c.GPUSwarmSpawner.environment = {"JUPYTER_ENABLE_LAB": "1"}

# ---------------------------------------------------------------------- users' files
# Each user's Docker volume (hubplugin/volumes.py) at the notebook's work dir, in every server
# of theirs: their files outlive a stop and a reclaim. Without a driver it is a local volume
# of the node the server ran on; a server placed on another node starts with another (empty)
# one. For files that follow the user to any node, give the site's driver, e.g. NFS:
#   SWARM_GPU_USER_VOLUME_DRIVER=local
#   SWARM_GPU_USER_VOLUME_OPTIONS='{"type": "nfs", "o": "addr=10.0.0.5,rw,nfsvers=4",
#                                   "device": ":/export/home/{username}"}'
from hubplugin.volumes import user_volume_from_env  # noqa: E402

if (user_volume := user_volume_from_env(os.environ)) is not None:
    c.GPUSwarmSpawner.user_volume = user_volume.template
    c.GPUSwarmSpawner.user_volume_driver = user_volume.driver
    c.GPUSwarmSpawner.user_volume_driver_options = user_volume.options
