"""The swarm-gpu node agent: one per GPU host.

It reads the host's GPUs (from NVML, or from a simulated inventory file on hosts without
GPUs), judges their health, watches the Docker engine for containers that carry a lease
label, and publishes heartbeats and container events to the broker.

It imports only the allocator's public surface, these modules exactly:
:mod:`allocator.amqp.broker`, :mod:`allocator.amqp.declare`, :mod:`allocator.logs`,
:mod:`allocator.metrics.endpoint`, :mod:`allocator.settings_files`, :mod:`allocator.tasks`,
:mod:`allocator.wire.heartbeat_delta`, :mod:`allocator.wire.interconnect`,
:mod:`allocator.wire.lease_container`, :mod:`allocator.wire.model_names`,
:mod:`allocator.wire.protocol` and :mod:`allocator.wire.topology`
(``tests/static/test_design_map.py`` holds this list to the code).

Modules, one concept each:

- :mod:`nodeagent.config`     settings (environment ``SWARM_GPU_AGENT_*`` over a TOML file)
- :mod:`nodeagent.inventory`  the :class:`~nodeagent.inventory.InventorySource` protocol and samples
- :mod:`nodeagent.nvml`       the real inventory source (nvidia-ml-py)
- :mod:`nodeagent.interconnect_nvml` how the GPUs are joined, from NVML (NVLink, PCIe, NUMA, CPUs)
- :mod:`nodeagent.simulated`  the simulated inventory source (a JSON file) and its writer
- :mod:`nodeagent.health`     pure health evaluation with recovery
- :mod:`nodeagent.mig`        MIG: parent health on instances, held instances through a re-partition
- :mod:`nodeagent.cgroups`    process → container mapping through ``/proc/<pid>/cgroup``
- :mod:`nodeagent.containers` lease-labelled containers and their events (aiodocker)
- :mod:`nodeagent.cpu_pinning` ``pin_cpus``: lease containers pinned to the CPUs near their GPUs
- :mod:`nodeagent.publisher`  bounded, buffered publishing to the nodes exchange (aio-pika)
- :mod:`nodeagent.commands`   the allocator's stop commands for this host's lease containers
- :mod:`nodeagent.metrics`    Prometheus metrics on a port of its own (``metrics_port``)
- :mod:`nodeagent.agent`      the agent itself: heartbeat loop, event forwarding, XID thread
- :mod:`nodeagent.cli`        ``gpu-nodeagent``
- :mod:`nodeagent.nvml_check` ``python -m nodeagent.nvml_check`` for a real GPU machine
"""
