"""MIG on the node: parent health for instances, and a re-partition under held instances.

A GPU in MIG mode is reported with ``mig_mode=True`` and never granted whole; its MIG
instances are reported as units of their own (see :mod:`nodeagent.inventory`). Two rules
join them, both pure functions of what one inventory read produced:

* **Parent health.** An instance has no temperature, ECC counters or XID stream of its own:
  they belong to the physical GPU. So an instance is unhealthy whenever its parent is, with
  the parent's reasons, and healthy again when the parent recovers.
* **Re-partition.** An admin may destroy and create instances while the agent runs
  (``nvidia-smi mig -dci/-dgi/-cgi``). An instance that disappears while a running lease
  container holds it is still reported - as it was last read, unhealthy, so nothing new is
  placed on it - until that container ends; and its parent is still reported in MIG mode, so
  it is never offered whole while an old instance of it is in use. Which instances a
  container holds comes from its grant labels.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping, Sequence

from allocator.wire.protocol import Health
from nodeagent.health import Verdict
from nodeagent.inventory import GPUSample

REMOVED_REASON = (
    "MIG instance removed by a re-partition; reported until the lease container holding "
    "it ends"
)
"""Health reason of an instance kept in the report after it disappeared."""

MAX_REASONS = 32
"""The protocol's limit on health reasons per GPU."""


def inherit_parent_health(
    samples: Sequence[GPUSample], verdicts: Mapping[str, Verdict]
) -> dict[str, Verdict]:
    """Verdicts by uuid where every MIG instance is unhealthy while its parent is.

    ``verdicts`` holds each sample's own verdict; the result has the same keys. An instance
    whose parent is unhealthy gets the parent's reasons (prefixed with the parent's uuid) and
    XIDs after its own.
    """
    result = dict(verdicts)
    for sample in samples:
        parent_uuid = sample.mig_parent_uuid
        if parent_uuid is None or sample.uuid not in verdicts:
            continue
        parent = verdicts.get(parent_uuid)
        if parent is None or parent.healthy:
            continue
        own = verdicts[sample.uuid]
        reasons = (*own.reasons, *(f"parent GPU {parent_uuid}: {r}" for r in parent.reasons))
        result[sample.uuid] = Verdict(
            Health.UNHEALTHY,
            reasons[:MAX_REASONS] or (f"parent GPU {parent_uuid} is unhealthy",),
            (*own.recent_xids, *parent.recent_xids)[-64:],
        )
    return result


@dataclasses.dataclass
class MigLayout:
    """Remembers each MIG instance's last reading, so one that vanishes while a lease
    container holds it stays reported until the container ends."""

    _last: dict[str, GPUSample] = dataclasses.field(default_factory=dict)
    retained: frozenset[str] = frozenset()
    """Instances the last :meth:`apply` kept although the inventory no longer lists them."""

    def apply(self, samples: Sequence[GPUSample], held: Collection[str]) -> list[GPUSample]:
        """The samples to report: ``samples``, plus held instances that vanished.

        ``held`` is every GPU uuid some running lease container holds. A kept instance's
        parent, if the read shows it no longer in MIG mode, is still reported in MIG mode.
        """
        listed = {sample.uuid for sample in samples}
        kept = [
            old for uuid, old in sorted(self._last.items())
            if uuid not in listed and uuid in held and old.mig_parent_uuid in listed
        ]
        kept_parents = {old.mig_parent_uuid for old in kept}
        result = [
            dataclasses.replace(sample, mig_mode=True)
            if sample.uuid in kept_parents and not sample.mig_mode else sample
            for sample in samples
        ]
        # Kept instances stay next to their parent's current ones; a reused mig_index would
        # clash with a new instance, so a kept one moves to a free index.
        taken = {(s.index, s.mig_index) for s in result}
        for old in kept:
            # Gone from the driver: what runs on it can no longer be read.
            old = dataclasses.replace(old, processes=None)
            if (old.index, old.mig_index) in taken:
                free = next(i for i in range(1025) if (old.index, i) not in taken)
                old = dataclasses.replace(old, mig_index=free)
            taken.add((old.index, old.mig_index))
            result.append(old)
        self._last = {s.uuid: s for s in result if s.is_mig_instance}
        self.retained = frozenset(old.uuid for old in kept)
        return result

    def verdict_of_retained(self, verdict: Verdict) -> Verdict:
        """A kept instance is unhealthy whatever its last reading said: it no longer exists."""
        return Verdict(Health.UNHEALTHY, (REMOVED_REASON, *verdict.reasons)[:MAX_REASONS],
                       verdict.recent_xids)
