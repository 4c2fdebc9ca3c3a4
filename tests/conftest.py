"""Shared fixtures: real services, no mocks.

Services come from `scripts/services start` (run by `scripts/test`). A missing service
skips the tests that need it on a developer machine and fails them in CI
(``SWARM_GPU_REQUIRE_SERVICES=1``); see `services.require_service`.

Fixtures:

- ``rabbitmq`` (session): `services.RabbitMQ` - host, port, api_url, user, password.
- ``amqp_vhost`` (function): `services.AmqpVhost` - a fresh vhost (``.name``, ``.url``),
  deleted after the test.
- ``private_rabbitmq`` (module): `services.PrivateRabbitMQ` - a broker node of its own that a
  test may stop and start (``.url``, ``.stop()``, ``.start()``).
- ``docker_engine`` (session): the ``unix://`` DOCKER_HOST of an active Swarm manager; also
  exported as ``DOCKER_HOST`` for the session.
- ``private_docker`` (function): `services.PrivateDocker` - a Docker engine of its own (no
  Swarm, busybox imported) that a test may stop and start.
- ``busybox_image`` (session): ``"local/busybox:latest"``, checked to exist on the engine.
- ``chp_path`` / ``chromium_path`` (session): `pathlib.Path` of configurable-http-proxy and
  Chromium.
- ``ledger_path`` (function): ``tmp_path / "ledger.sqlite"`` (not created).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from allocator.logs import LIBRARY_LOGGERS
from tests.support import services
from tests.support.services import require_service

# ----------------------------------------------------------------------------- timeouts

MARKER_TIMEOUTS_S = {"hub": 300, "browser": 300, "slow": 300, "docker": 180}
"""pytest-timeout's bound for a test by its markers (the largest that applies). A test that
needs more says so itself with ``@pytest.mark.timeout``."""

UNIT_TIMEOUT_S = 60
"""The bound for a test with none of those markers (a pure unit or a broker round trip):
generous on a loaded machine, yet a hang or a slow unit test is found in a minute, not five."""


# ------------------------------------------------------------------ parallel runs (xdist)

SHARED_ENGINE_GROUP = "shared-docker-engine"
"""The one work unit, under ``pytest -n N`` (.ci/run), of every module that uses the suite's
Docker engine, or engines of ``scripts/cluster``'s (one ``.cluster/`` per checkout, fixed
loopback addresses): a node agent reports every lease-labelled container of its engine, so
two such tests at once would see each other's notebooks. They run one after another, on one
worker, while the other workers take every other module, a module at a time."""

SHARED_ENGINE_FIXTURES = frozenset({"docker_engine", "busybox_image"})

SHARED_ENGINE_MODULES = frozenset({
    "test_agent_metrics.py", "test_bookings_window_e2e.py", "test_compose.py",
    "test_deploy_swarm.py",
    "test_demo_e2e.py", "test_fairshare_e2e.py",
    "test_fault_node_truth.py", "test_fault_node_truth_labels.py", "test_fault_nodes.py",
    "test_hub_e2e.py", "test_hub_volumes.py", "test_infra.py", "test_interconnect_e2e.py",
    "test_mig_hub.py", "test_monitoring.py",
    "test_nodeagent.py", "test_nodeagent_listing.py", "test_release_e2e.py",
    "test_spawner_task_wait.py", "test_stop_on_release.py",
    # These use the engines through scripts they run, not through the fixtures.
    "test_stack_e2e.py", "test_stack_broker_cluster_e2e.py",
})
"""Listed by name because xdist's scheduler sees test ids only, not fixtures; collection
fails if a test with one of :data:`SHARED_ENGINE_FIXTURES` is in a module not listed."""


def work_unit_of(nodeid: str) -> str:
    """The work unit of a test under xdist: the shared engine's, or else its module's (so a
    module's fixtures are set up once, on one worker)."""
    module = nodeid.split("::", 1)[0]
    return SHARED_ENGINE_GROUP if Path(module).name in SHARED_ENGINE_MODULES else module


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Schedule by :func:`work_unit_of`, in collection order (the shared engine's first).

    xdist's own ``--dist loadgroup`` cannot do this with pytest 9.2, whose test ids no longer
    take the group suffix xdist appends.
    """
    from xdist.scheduler import LoadScopeScheduling

    class SharedEngineScheduling(LoadScopeScheduling):  # type: ignore[misc]  # untyped
        def _split_scope(self, nodeid: str) -> str:
            return work_unit_of(nodeid)

    config.option.loadscopereorder = False  # the longest unit, the engine's, must start first
    return SharedEngineScheduling(config, log)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Give every test without its own timeout the bound of its markers.

    Tests of the shared engine's modules are moved to the front (in their own order), so
    that under xdist one worker starts them at once while the others take every other module.
    """
    for item in items:
        if SHARED_ENGINE_FIXTURES & set(getattr(item, "fixturenames", ())) \
                and item.path.name not in SHARED_ENGINE_MODULES:
            raise pytest.UsageError(
                f"{item.nodeid} uses the shared Docker engine: add {item.path.name} to "
                "SHARED_ENGINE_MODULES in tests/conftest.py, or parallel runs would put it "
                "beside the engine's other tests")
        if item.get_closest_marker("timeout") is not None:
            continue
        limit = max((seconds for marker, seconds in MARKER_TIMEOUTS_S.items()
                     if item.get_closest_marker(marker) is not None), default=UNIT_TIMEOUT_S)
        item.add_marker(pytest.mark.timeout(limit))
    items.sort(key=lambda item: work_unit_of(item.nodeid) != SHARED_ENGINE_GROUP)

# ----------------------------------------------------------------------------- RabbitMQ


@pytest.fixture(autouse=True)
def _root_logging_restored() -> Iterator[None]:
    """A command's ``main`` run in this process sets logging up for a whole process
    (``allocator.logs.configure_logging``: the root level, e.g. CRITICAL for ``gpu-ledger``, and
    a stderr handler). Put the levels back and drop that handler after each test, so that a
    later test's ``caplog`` still sees the warnings it looks for."""
    root = logging.getLogger()
    level = root.level
    libraries = {name: logging.getLogger(name).level for name in LIBRARY_LOGGERS}
    yield
    root.setLevel(level)
    for handler in list(root.handlers):
        if type(handler) is logging.StreamHandler:  # pytest's own handlers are subclasses
            root.removeHandler(handler)
    for name, library_level in libraries.items():
        logging.getLogger(name).setLevel(library_level)
    logging.captureWarnings(False)


@pytest.fixture(scope="session")
def rabbitmq() -> services.RabbitMQ:
    """The broker (AMQP and management API), checked to answer.

    Also deletes test vhosts left behind by earlier runs that were killed.
    """
    broker = services.rabbitmq_from_env()
    problem = services.check_rabbitmq(broker)
    if problem:
        require_service("RabbitMQ", problem)
    services.delete_stale_vhosts(broker)
    return broker


@pytest.fixture
def amqp_vhost(rabbitmq: services.RabbitMQ) -> Iterator[services.AmqpVhost]:
    """A vhost of the test's own (about 20 ms to create, 20 ms to delete)."""
    with services.temporary_vhost(rabbitmq) as vhost:
        yield vhost


@pytest.fixture(scope="module")
def private_rabbitmq(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[services.PrivateRabbitMQ]:
    """A RabbitMQ node of the module's own (``.url``, ``.stop()``, ``.start()``...), for tests
    that restart the broker: the shared broker on 5672 is never restarted. About 5 s to start.
    """
    with services.private_rabbitmq(tmp_path_factory.mktemp("rabbitmq")) as broker:
        yield broker


@pytest.fixture(scope="module")
def rabbitmq_cluster(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[services.PrivateRabbitMQCluster]:
    """Three RabbitMQ nodes clustered (``.url`` names all three, ``.nodes[i].stop()``...), for
    tests that stop one broker node of three. About 30-60 s to form on a loaded machine."""
    with services.private_rabbitmq_cluster(tmp_path_factory.mktemp("rabbitmq-cluster")) as cluster:
        yield cluster


# ------------------------------------------------------------------------------- Docker


@pytest.fixture(scope="session")
def docker_engine() -> Iterator[str]:
    """DOCKER_HOST (``unix://...``) of a Docker engine that is an active Swarm manager.

    Exported as ``DOCKER_HOST`` for the session, so that code that reads the environment
    (aiodocker, dockerspawner, the docker CLI) reaches the same engine.
    """
    host = services.docker_host()
    problem = services.check_docker(host)
    if problem:
        require_service("Docker engine in Swarm mode", problem)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DOCKER_HOST", host)
        yield host


@pytest.fixture(scope="session")
def busybox_image(docker_engine: str) -> str:
    """The tiny local image every test service runs (built by `scripts/services`)."""
    if not services.docker_image_exists(docker_engine, services.BUSYBOX_IMAGE):
        require_service(services.BUSYBOX_IMAGE, f"image missing on {docker_engine}")
    return services.BUSYBOX_IMAGE


@pytest.fixture
def private_docker() -> Iterator[services.PrivateDocker]:
    """A Docker engine of the test's own (no Swarm) that it may stop and start
    (``.url``, ``.stop()``, ``.start(live_restore=...)``): the shared engine is never restarted.
    It starts with ``--live-restore`` (containers outlive an engine restart); pass
    ``live_restore=False`` to ``start()`` for an engine that kills them.
    """
    with services.private_docker(live_restore=True) as engine:
        yield engine


# ---------------------------------------------------------------------- executables


@pytest.fixture(scope="session")
def chp_path() -> Path:
    """The configurable-http-proxy executable, for a real JupyterHub."""
    path = services.chp_path()
    if path is None:
        require_service("configurable-http-proxy", "executable not found")
    return path


@pytest.fixture(scope="session")
def chromium_path() -> Path:
    """The Chromium executable, for tests that drive a page in a headless browser."""
    path = services.chromium_path()
    if path is None:
        require_service("Chromium", "executable not found")
    return path


# ------------------------------------------------------------------------------ files


@pytest.fixture
def ledger_path(tmp_path: Path) -> Path:
    """Where a test's own allocation ledger (SQLite) goes; the file is not created."""
    return tmp_path / "ledger.sqlite"


# ---------------------------------------------------------------------------- allocator


@pytest.fixture
async def allocator(amqp_vhost: services.AmqpVhost, ledger_path: Path):
    """A real allocator consuming the test's vhost, with its own ledger file.

    Nodes may report from the broker's guest user and guest is an admin, so tests can play
    every role; the permission tests build their own settings.
    """
    from allocator.config import AllocatorSettings
    from allocator.service import AllocatorService
    from tests.support.common import started

    settings = AllocatorSettings(
        amqp_url=amqp_vhost.url, ledger_path=ledger_path, allow_any_node_user=True,
        admin_users=["guest"], tick_s=0.1, share_slots={"NVIDIA GeForce GTX 1070": 4},
        aliases={"1070": "NVIDIA GeForce GTX 1070", "3090": "NVIDIA GeForce RTX 3090"},
        # No start fence: several tests report nodes from agents that watch no Docker engine
        # (their listings are never complete). The fence has tests of its own
        # (test_engine_node_truth.py, test_fault_node_truth.py).
        start_fence_s=0,
    )
    async with started(AllocatorService(settings)) as service:
        yield service


@pytest.fixture
async def client(allocator, amqp_vhost: services.AmqpVhost):
    """An RPC client connected to the test's allocator."""
    from allocator.amqp.client import AllocatorClient

    async with AllocatorClient(amqp_vhost.url, timeout_s=10) as rpc:
        yield rpc


@pytest.fixture
async def nodes(amqp_vhost: services.AmqpVhost):
    """A `support.NodeSimulator` publishing heartbeats and events into the test's vhost."""
    from tests.support.common import NodeSimulator

    async with NodeSimulator(amqp_vhost.url) as simulator:
        yield simulator
