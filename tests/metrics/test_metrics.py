"""Prometheus metrics of a real allocator, scraped over HTTP as Prometheus would."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import aio_pika
import pytest
from prometheus_client.parser import text_string_to_metric_families

from allocator.metrics import exporter as metrics
from allocator.metrics.counters import Count
from allocator.wire.protocol import AllocateRequest, ShareRequest
from allocator.wire.topology import RPC_EXCHANGE, RPC_ROUTING_KEY
from tests.support.common import GTX1070, RTX3090, NodeSimulator, gpus, wait_until
from tests.support.faults import AllocatorProcess, replica_ledger, running_allocator
from tests.support.ports import free_port
from tests.support.services import AmqpVhost


def scrape(port: int) -> dict[str, float]:
    """GET /metrics and flatten it to {'name{label="v",...}': value}."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return samples


@pytest.fixture
async def served(allocator):
    server = metrics.serve(allocator, port=0, addr="127.0.0.1")
    try:
        yield server
    finally:
        server.close()


async def test_scrape_reports_gpus_leases_queue_and_counters(allocator, client, nodes, served,
                                                             amqp_vhost):
    await nodes.beat("gpu-a", gpus("gpu-a", GTX1070, 2))
    await nodes.beat("gpu-b", gpus("gpu-b", RTX3090, 2))

    async def up():
        return sum(n.up for n in (await client.inventory()).nodes) == 2
    await wait_until(up)
    whole = await client.allocate(AllocateRequest(request_key="h/a/", user="a", model="3090",
                                                  count=2))
    await client.allocate(AllocateRequest(request_key="h/s/", user="s", model="1070",
                                          share=ShareRequest(memory_mib=1024)))
    await client.allocate(AllocateRequest(request_key="h/q/", user="q", model="3090",
                                          wait_s=60))
    await client.drain("gpu-a", gpu_uuid=gpus("gpu-a", GTX1070, 2)[1].uuid)
    await client.release(lease_id=whole.lease_id, force=True, reason="metrics test")
    # A body that does not decode and wants no reply: dead-lettered.
    connection = await aio_pika.connect(amqp_vhost.url)
    async with connection:
        channel = await connection.channel()
        exchange = await channel.get_exchange(RPC_EXCHANGE, ensure=False)
        await exchange.publish(aio_pika.Message(b"{not json"), routing_key=RPC_ROUTING_KEY)
    await wait_until(lambda: _dead_lettered(allocator))

    samples = await asyncio.to_thread(scrape, served.port)
    assert samples["swarm_gpu_metrics_ok"] == 1
    # The forced release handed both 3090s to the queue... which wanted one.
    assert samples['swarm_gpu_gpus{model="NVIDIA GeForce RTX 3090",state="held"}'] == 1
    assert samples['swarm_gpu_gpus{model="NVIDIA GeForce RTX 3090",state="free"}'] == 1
    assert samples['swarm_gpu_gpus{model="NVIDIA GeForce GTX 1070",state="held"}'] == 1
    assert samples['swarm_gpu_gpus{model="NVIDIA GeForce GTX 1070",state="drained"}'] == 1
    assert samples['swarm_gpu_gpus{model="NVIDIA GeForce GTX 1070",state="unhealthy"}'] == 0
    assert samples['swarm_gpu_share_slots{model="NVIDIA GeForce GTX 1070",state="held"}'] == 1
    assert samples['swarm_gpu_share_slots{model="NVIDIA GeForce GTX 1070",state="free"}'] == 7
    assert samples['swarm_gpu_leases{state="granted"}'] == 2
    assert samples['swarm_gpu_leases{state="queued"}'] == 0
    assert samples["swarm_gpu_queue_length"] == 0
    assert samples['swarm_gpu_releases_total{reason="admin"}'] == 1
    assert samples["swarm_gpu_grants_total"] == 3 and samples["swarm_gpu_queued_total"] == 1
    assert samples['swarm_gpu_nodes{state="up"}'] == 2
    assert samples['swarm_gpu_node_up{host="gpu-a"}'] == 1
    assert samples["swarm_gpu_heartbeats_total"] >= 2
    assert samples["swarm_gpu_dead_lettered_total"] == 1
    # Every message was taken in some batch; each batch is one commit.
    assert 1 <= samples["swarm_gpu_batches_total"] <= samples["swarm_gpu_messages_received_total"]
    assert samples['swarm_gpu_invalid_messages_total{code="bad_request"}'] == 1
    # What the service itself recorded: its registry is its own, so the counts are exact.
    assert samples['swarm_gpu_request_seconds_count{kind="allocate"}'] == 3
    assert samples['swarm_gpu_request_seconds_count{kind="drain"}'] == 1
    assert samples['swarm_gpu_request_seconds_count{kind="release"}'] == 1
    assert samples['swarm_gpu_request_seconds_count{kind="invalid"}'] == 1
    assert samples['swarm_gpu_request_seconds_count{kind="heartbeat"}'] >= 2
    # One ledger file, no replicated log: none of its families.
    assert not any(name.startswith("swarm_gpu_ledger_log") for name in samples)

    # Each batch's parts, once per batch (polled: the scrape runs beside the applier, and the
    # last batch may still be answering); the commit of each took time.
    async def every_batch_in_each_phase() -> dict[str, float] | None:
        now = await asyncio.to_thread(scrape, served.port)
        counts = {now[f'swarm_gpu_batch_phase_seconds_count{{phase="{phase}"}}']
                  for phase in metrics.BATCH_PHASES}
        return now if counts == {now["swarm_gpu_batches_total"]} else None
    samples = await wait_until(every_batch_in_each_phase)
    assert samples['swarm_gpu_batch_phase_seconds_sum{phase="commit"}'] > 0
    assert samples['swarm_gpu_batch_phase_seconds_sum{phase="decide"}'] > 0
    # Of each commit, the transaction on the ledger's thread: once per batch, within it.
    assert samples["swarm_gpu_ledger_write_seconds_count"] == samples["swarm_gpu_batches_total"]
    assert 0 < samples["swarm_gpu_ledger_write_seconds_sum"] \
        <= samples['swarm_gpu_batch_phase_seconds_sum{phase="commit"}']


def active_gauge(port: int) -> float:
    """``swarm_gpu_allocator_active`` of the replica serving metrics on ``port``."""
    return scrape(port)["swarm_gpu_allocator_active"]


@pytest.mark.parametrize("ledger_log", ["off", "stream"])
async def test_only_the_replica_the_broker_gives_messages_reports_active(
        amqp_vhost, ledger_path, nodes: NodeSimulator, ledger_log: str) -> None:
    # What the alerts and the dashboard select the live view by: a standby reports 0 from its
    # first scrape, while the active one reports 1, and it reports 1 once it takes over.
    async def beat_until_active(port: int) -> bool:
        await nodes.beat("gpu-a")
        return await asyncio.to_thread(active_gauge, port) == 1

    async with contextlib.AsyncExitStack() as first_running:
        first = await first_running.enter_async_context(running_allocator(
            amqp_vhost.url, replica_ledger(ledger_path, "first", ledger_log),
            ledger_log=ledger_log))
        first_port = first_running.enter_context(contextlib.closing(
            metrics.serve(first, port=0, addr="127.0.0.1"))).port
        await nodes.beat("gpu-a", gpus("gpu-a", GTX1070, 1))
        await wait_until(lambda: beat_until_active(first_port))
        async with running_allocator(
                amqp_vhost.url, replica_ledger(ledger_path, "second", ledger_log),
                ledger_log=ledger_log) as second:
            with contextlib.closing(metrics.serve(second, port=0, addr="127.0.0.1")) as served:
                assert await asyncio.to_thread(active_gauge, served.port) == 0
                # Heartbeats go on reaching the first replica only.
                received = first.stats.counters[Count.RECEIVED]
                await nodes.beat("gpu-a")

                async def first_took_it() -> bool:
                    return first.stats.counters[Count.RECEIVED] > received
                await wait_until(first_took_it)
                assert await asyncio.to_thread(active_gauge, first_port) == 1
                assert await asyncio.to_thread(active_gauge, served.port) == 0
                # The active replica stops (a rolling update): the standby takes over.
                await first_running.aclose()
                await wait_until(lambda: beat_until_active(served.port), within=20,
                                 interval=0.2)


def test_a_hostile_kind_becomes_other_instead_of_a_new_series() -> None:
    recorder = metrics.AllocatorMetrics()
    recorder.observe_request("made-up-kind", 0.5)
    samples = {s.name + str(sorted(s.labels.items())): s.value
               for family in recorder.registry.collect() for s in family.samples}
    assert samples["swarm_gpu_request_seconds_count[('kind', 'other')]"] == 1
    assert not any("made-up-kind" in name for name in samples)


def test_each_service_has_a_registry_of_its_own(allocator) -> None:
    from allocator.config import AllocatorSettings
    from allocator.service import AllocatorService

    other = AllocatorService(AllocatorSettings(amqp_url="amqp://127.0.0.1:1/",
                                               ledger_path=allocator.settings.ledger_path))
    other.metrics.observe_request("allocate", 0.1)
    assert other.metrics.registry is not allocator.metrics.registry
    counts = [s.value for f in allocator.metrics.registry.collect() for s in f.samples
              if s.name == "swarm_gpu_request_seconds_count" and s.labels["kind"] == "allocate"]
    assert counts in ([], [0.0]), "another service's request is not counted here"


async def _dead_lettered(allocator) -> bool:
    return allocator.stats.counters["dead_lettered"] >= 1


async def test_queue_wait_is_reported(allocator, client, nodes, served):
    await nodes.beat("gpu-b", gpus("gpu-b", RTX3090, 1))

    async def up():
        return any(n.up for n in (await client.inventory()).nodes)
    await wait_until(up)
    await client.allocate(AllocateRequest(request_key="h/a/", user="a", model="3090"))
    await client.allocate(AllocateRequest(request_key="h/b/", user="b", model="3090", wait_s=60))
    await asyncio.sleep(0.3)
    samples = await asyncio.to_thread(scrape, served.port)
    assert samples["swarm_gpu_queue_length"] == 1
    assert samples['swarm_gpu_leases{state="queued"}'] == 1
    assert samples["swarm_gpu_queue_oldest_wait_seconds"] >= 0.3


async def test_a_blocked_loop_makes_a_short_failed_scrape(allocator):
    """The collector waits for the event loop, bounded; it never reads the engine racily."""
    collector = metrics.AllocatorCollector(allocator, asyncio.get_running_loop(), timeout_s=0.2)
    result: list = []
    thread = threading.Thread(target=lambda: result.extend(collector.collect()))
    thread.start()
    time.sleep(0.5)  # noqa: ASYNC251 - blocks the loop on purpose, as a long sync step would
    thread.join(timeout=5)
    names = {family.name: family for family in result}
    assert names["swarm_gpu_metrics_ok"].samples[0].value == 0
    assert "swarm_gpu_gpus" not in names
    # Once the loop runs again, a scrape reads it.
    again = await asyncio.to_thread(lambda: list(collector.collect()))
    assert {f.name: f for f in again}["swarm_gpu_metrics_ok"].samples[0].value == 1


async def test_a_second_install_replaces_the_first_collector(allocator):
    first = allocator.metrics.install(allocator)
    second = allocator.metrics.install(allocator)
    try:
        names = [m.name for m in allocator.metrics.registry.collect()]
        assert names.count("swarm_gpu_gpus") == 1
    finally:
        allocator.metrics.uninstall(second)
        allocator.metrics.uninstall(first)
    assert "swarm_gpu_gpus" not in [m.name for m in allocator.metrics.registry.collect()]


async def test_the_allocator_serves_metrics_on_its_configured_port(amqp_vhost, ledger_path):
    from allocator.amqp.client import AllocatorClient
    from allocator.config import AllocatorSettings
    from allocator.service import AllocatorService

    settings = AllocatorSettings(amqp_url=amqp_vhost.url, ledger_path=ledger_path,
                                 metrics_port=0)
    service = AllocatorService(settings)
    await service.start()
    try:
        assert service.metrics_server is not None
        port = service.metrics_server.port
        async with AllocatorClient(amqp_vhost.url) as client:
            await client.inventory()

        def inventories() -> float:
            return scrape(port).get('swarm_gpu_request_seconds_count{kind="inventory"}', 0.0)

        assert await asyncio.to_thread(inventories) >= 1
    finally:
        await service.stop()
        await service.stop()  # stopping twice is harmless
    assert service.metrics_server is None


async def test_serve_keeps_what_it_loaded_out_of_the_cycle_collector(
        amqp_vhost: AmqpVhost, tmp_path: Path) -> None:
    """``gpu-allocator serve`` freezes the state it loads (allocator/service/heap.py), and its
    metrics say how many objects the collector skips: the switch is on in the process that
    serves, not only in the module that implements it."""
    port = free_port()
    process = AllocatorProcess("heap", amqp_vhost.url, tmp_path / "ledger.sqlite", tmp_path,
                               metrics_port=port)
    await process.start()
    try:
        await process.wait_consuming(within=60)

        def frozen() -> tuple[float] | None:
            """The gauge once the metrics answer (a tuple, so that 0 is an answer too)."""
            with contextlib.suppress(OSError):
                samples = scrape(port)
                if "swarm_gpu_allocator_heap_frozen_objects" in samples:
                    return (samples["swarm_gpu_allocator_heap_frozen_objects"],)
            return None

        (count,) = await wait_until(lambda: asyncio.to_thread(frozen), within=30, interval=0.2)
    finally:
        code = await process.stop()
    assert code == 0, process.log()[-3000:]
    # Everything the process held at its load is frozen, its modules' objects included: tens
    # of thousands even on an empty ledger (0 where nothing froze).
    assert count > 10_000, count


async def test_the_replicated_ledger_log_is_reported(amqp_vhost, ledger_path, nodes):
    from tests.support.faults import running_allocator

    async with running_allocator(amqp_vhost.url, ledger_path.with_name("replicated.sqlite"),
                                 ledger_log="stream") as service:
        server = metrics.serve(service, port=0, addr="127.0.0.1")
        try:
            await nodes.beat("gpu-a", gpus("gpu-a", GTX1070, 1))  # a batch through the log

            async def applied() -> bool:
                samples = await asyncio.to_thread(scrape, server.port)
                return samples.get("swarm_gpu_ledger_log_entries_applied_total", 0) >= 2
            await wait_until(applied)
            samples = await asyncio.to_thread(scrape, server.port)
        finally:
            server.close()
        assert service.log is not None
        assert samples["swarm_gpu_ledger_log_writer"] == 1
        assert samples["swarm_gpu_ledger_log_caught_up"] == 1
        assert samples["swarm_gpu_ledger_log_epoch"] == service.log.position.epoch == 1
        assert samples["swarm_gpu_ledger_log_entries_fenced_total"] == 0
        assert samples["swarm_gpu_ledger_log_snapshots_taken_total"] == 0
        assert "swarm_gpu_ledger_log_last_snapshot_seconds" not in samples


def get(port: int, token: str | None = None) -> tuple[int, str, str | None]:
    """GET /metrics, with ``Authorization: Bearer <token>`` when given: (status, body, the
    WWW-Authenticate header)."""
    request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics")
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read().decode(), None
    except urllib.error.HTTPError as error:
        with error:
            return error.code, error.read().decode(), error.headers.get("WWW-Authenticate")


async def test_with_a_token_the_metrics_answer_only_to_whoever_sends_it(
        amqp_vhost, ledger_path, tmp_path):
    from allocator.config import AllocatorSettings
    from allocator.service import AllocatorService

    token = "t0ken-" + "x" * 26
    token_file = tmp_path / "metrics-token"
    token_file.write_text(token + "\n")  # as `echo ... > file` writes it
    settings = AllocatorSettings(amqp_url=amqp_vhost.url, ledger_path=ledger_path,
                                 metrics_port=0, metrics_token_file=token_file)
    assert settings.metrics_token == token
    assert token not in repr(settings)
    service = AllocatorService(settings)
    await service.start()
    try:
        assert service.metrics_server is not None
        port = service.metrics_server.port
        status, body, challenge = await asyncio.to_thread(get, port)
        assert (status, challenge) == (401, 'Bearer realm="swarm-gpu metrics"')
        assert "swarm_gpu_" not in body and "need a token" in body
        status, body, _ = await asyncio.to_thread(get, port, token[:-1] + "y")
        assert status == 401 and "swarm_gpu_" not in body and "wrong metrics token" in body
        status, body, _ = await asyncio.to_thread(get, port, token)
        assert status == 200 and "swarm_gpu_metrics_ok 1.0" in body
    finally:
        await service.stop()


def test_a_metrics_token_is_given_once_and_not_too_short(tmp_path):
    from allocator.config import AllocatorSettings
    from allocator.settings_files import settings_error_line

    token_file = tmp_path / "metrics-token"
    token_file.write_text("a" * 32)
    with pytest.raises(ValueError, match="set metrics_token or metrics_token_file, not both"):
        AllocatorSettings(metrics_token="b" * 32, metrics_token_file=token_file)
    with pytest.raises(ValueError) as short:
        AllocatorSettings(metrics_token="short")
    assert "metrics_token" in settings_error_line(short.value)


def test_the_gpu_gauge_counts_what_the_inventory_shows_by_state() -> None:
    """The scrape reads the engine's state itself (not the inventory reply, too dear to build
    per scrape): a silent host's GPUs are ``down``, a GPU its host no longer lists is left
    out, and every GPU the inventory shows is counted once."""
    from allocator.config import AllocatorSettings
    from allocator.engine import Engine
    from allocator.ledger.changes import Changes
    from tests.support.common import NODE, heartbeat
    from tests.support.scraped import EngineOnly

    settings = AllocatorSettings(allow_any_node_user=True, node_down_after_s=30)
    engine = Engine(settings, started_at=0.0)
    engine.handle(heartbeat("gpu-a", gpus("gpu-a", GTX1070, 3), sent_at=1.0), NODE, 1.0,
                  Changes())
    engine.handle(heartbeat("gpu-b", gpus("gpu-b", RTX3090, 2), sent_at=1.0), NODE, 1.0,
                  Changes())
    # gpu-a reports again without its third GPU; gpu-b falls silent.
    engine.handle(heartbeat("gpu-a", gpus("gpu-a", GTX1070, 2), sent_at=40.0), NODE, 40.0,
                  Changes())
    snap = metrics.read_scrape(EngineOnly(engine), 40.0)
    assert {key: count for key, count in snap.gpus.items() if count} == {
        (GTX1070, "free"): 2, (RTX3090, "down"): 2}
    assert sum(snap.gpus.values()) == len(engine.inventory(40.0).gpus)
    assert snap.nodes["gpu-b"][0] is False and snap.nodes["gpu-a"][0] is True
