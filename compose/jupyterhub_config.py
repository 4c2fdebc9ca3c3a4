"""Example JupyterHub configuration for swarm-gpu: GPUs per notebook server on Docker Swarm.

Runs the hub as a Swarm service next to RabbitMQ and the allocator (see the stack file in this
folder). Everything site-specific comes from environment variables, so the same file serves a
laptop demo and a cluster:

    SWARM_GPU_AMQP_URL     broker URL with the hub's own broker user
    SWARM_GPU_HUB_ID       names this hub in lease request keys (unique per hub)
    NOTEBOOK_IMAGE         the single-user image (with CUDA libraries for GPU work)
    SWARM_GPU_NETWORK      overlay network shared by the hub and the notebook services
    HUB_CONNECT_IP         how notebook containers reach the hub (its service name)
    SWARM_GPU_WAIT_S       how long a GPU request may wait in the queue (seconds)

GPU nodes need the NVIDIA container runtime as Docker's *default* runtime
(``"default-runtime": "nvidia"`` in /etc/docker/daemon.json): Swarm services cannot ask for
``--gpus``, so the runtime exposes exactly the GPUs named by ``NVIDIA_VISIBLE_DEVICES``, which
the spawner sets from the lease (``void`` = none for servers without a GPU).

Pick an authenticator for your site (``c.JupyterHub.authenticator_class``); groups used below
(``students``, ``staff``) are JupyterHub groups, e.g. from ``load_groups`` or your
authenticator's ``manage_groups``.
"""

import os

c = get_config()  # noqa: F821  (provided by JupyterHub when it loads this file)

# ------------------------------------------------------------------------------- the hub
c.JupyterHub.spawner_class = "gpu-swarm"  # hubplugin.spawner.GPUSwarmSpawner
c.JupyterHub.hub_ip = "0.0.0.0"
c.JupyterHub.hub_connect_ip = os.environ.get("HUB_CONNECT_IP", "jupyterhub")
c.JupyterHub.cleanup_servers = False  # a hub restart leaves notebooks (and their GPUs) alone

c.JupyterHub.load_groups = {
    "students": {"users": []},
    "staff": {"users": []},
}

# -------------------------------------------------------------------------- the allocator
# The broker user `hub` of compose/rabbitmq-definitions.json (vhost `swarm-gpu`): it may only
# publish requests to the allocator and read its own replies. Keep the password in a secret,
# e.g. SWARM_GPU_AMQP_URL=amqp://hub:$(cat /run/secrets/hub-password)@rabbitmq:5672/swarm-gpu
c.GPUSwarmSpawner.allocator_url = os.environ.get(
    "SWARM_GPU_AMQP_URL", "amqp://hub:CHANGE-ME@rabbitmq:5672/swarm-gpu"
)
c.GPUSwarmSpawner.hub_id = os.environ.get("SWARM_GPU_HUB_ID", "hub")
c.GPUSwarmSpawner.allocator_timeout = 10.0  # one RPC call
c.GPUSwarmSpawner.allocator_form_timeout = 3.0  # the spawn form renders without GPUs after this
c.GPUSwarmSpawner.wait_s = float(os.environ.get("SWARM_GPU_WAIT_S", "300"))
# start_timeout defaults to wait_s + 120 s, so a queued request is not cut short by the hub.

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
c.GPUSwarmSpawner.network_name = os.environ.get("SWARM_GPU_NETWORK", "swarm-gpu_default")
c.GPUSwarmSpawner.extra_placement_spec = {"constraints": ["node.role == worker"]}
c.GPUSwarmSpawner.extra_container_spec = {
    "stop_grace_period": 10_000_000_000,  # nanoseconds
}
c.GPUSwarmSpawner.environment = {"JUPYTER_ENABLE_LAB": "1"}
