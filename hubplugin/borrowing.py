"""Whether the spawn form's choices would be *borrowed*: granted beyond the user's guarantee
(theirs or one of their groups'), and so reclaimable when someone within theirs waits.

The allocator decides, never the hub: the form asks ``quota`` once for each distinct amount its
choices stand for (a whole GPU counts 1, a shared slice ``1/slots`` of its model) and reads
each reply's ``would_borrow``. An amount beyond what a quota says is ``free`` would be refused
(``quota_exceeded``), not borrowed, and is not marked. The calls go out together and the form
renders without hints when any of them fails, or when the allocator cannot tell
(``would_borrow`` null).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from allocator.amqp.client import AllocatorClient, AllocatorError
from allocator.wire.protocol import QuotaView

from .options import GPUMode, GPUOptions, GPUPermissions, ModelCatalog, Profile


def _gpus(n: float) -> str:
    return f"{n:g} GPU{'' if n == 1 else 's'}"


@dataclass(frozen=True)
class BorrowOutlook:
    """The allocator's answers for the amounts a form offers."""

    quotas: Sequence[QuotaView]
    """The user's quotas (theirs, then their groups'), with guarantees and what is held."""
    borrowed: Mapping[float, bool]
    """Amount asked (GPUs; a slice is 1/slots) -> whether granting it now would be borrowed."""

    def would_borrow(self, units: float | None) -> bool:
        """Whether a choice of ``units`` would be borrowed (False when not asked or unknown)."""
        return units is not None and self.borrowed.get(units, False)

    def summary(self) -> str | None:
        """One line on the guarantees that allow borrowing, for the form's limits."""
        parts = []
        for quota in self.quotas:
            if quota.guaranteed is None or quota.borrow_limit == quota.guaranteed:
                continue
            whose = "you" if quota.scope == "user" else f"group {quota.name}"
            holds = "you hold" if quota.scope == "user" else "its members hold"
            beyond = ("up to " + _gpus(quota.borrow_limit) + " in all"
                      if quota.borrow_limit is not None else "more")
            parts.append(f"{_gpus(quota.guaranteed)} guaranteed to {whose} ({holds} "
                         f"{quota.held:g}); beyond it, {beyond} while GPUs are free, borrowed")
        return "; ".join(parts) or None


def choice_units(options: GPUOptions, catalog: ModelCatalog | None) -> float | None:
    """The GPUs a choice asks for (a slice: 1/slots of its model); None when that is not
    known before placement ("all GPUs of a host", a slice of any model) or no GPU is asked."""
    if options.mode is GPUMode.EXCLUSIVE:
        return None if options.all_gpus_of_host else float(options.count)
    if options.mode is GPUMode.SHARED and catalog is not None and not options.any_model:
        model = catalog.canonical(options.model)
        slots = catalog.models[model].share_slots if model is not None else 0
        return 1.0 / slots if slots > 1 else None
    return None


def amounts_offered(permissions: GPUPermissions, profiles: Iterable[Profile],
                    catalog: ModelCatalog | None) -> set[float]:
    """Every amount the form offers: counts 1..max, the profiles', a slice of each model."""
    amounts = {float(n) for n in range(1, max(permissions.max_gpus, 0) + 1)}
    amounts |= {u for p in profiles if (u := choice_units(p.options(), catalog)) is not None}
    if catalog is not None:
        amounts |= {1.0 / m.share_slots for m in catalog.models.values() if m.share_slots > 1}
    return amounts


async def borrow_outlook(client: AllocatorClient, user: str, groups: Sequence[str],
                         amounts: Iterable[float], *, timeout_s: float) -> BorrowOutlook | None:
    """Ask the allocator about each amount; None when it cannot tell (an error, a timeout,
    or an allocator without guarantees)."""
    asked = sorted(set(amounts))
    if not asked:
        return None
    try:
        replies = await asyncio.gather(*(
            client.quota(user, groups, count=amount, timeout_s=timeout_s) for amount in asked))
    except AllocatorError:
        return None
    if any(reply.would_borrow is None for reply in replies):
        return None
    quotas = replies[0].quotas
    return BorrowOutlook(
        quotas=quotas,
        borrowed={amount: bool(reply.would_borrow) and not _beyond_a_limit(amount, quotas)
                  for amount, reply in zip(asked, replies, strict=True)})


def _beyond_a_limit(amount: float, quotas: Sequence[QuotaView]) -> bool:
    """Whether ``amount`` is more than a quota's ``free`` (what the allocator says may still
    be held): such a request is refused ``quota_exceeded``, not borrowed."""
    return any(quota.free is not None and amount > quota.free + 1e-9 for quota in quotas)
