"""Quotas: each user's and group's guarantee and borrow limit (whole-cluster and per model),
what each holds now, and whether a grant would pass one."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from fractions import Fraction

from allocator.config import PolicySettings
from allocator.placement.cluster import Claim, Cluster
from allocator.placement.demand import Demand, Placement, Refusal
from allocator.wire.model_names import ModelNames
from allocator.wire.protocol import ErrorCode

# Quotas are floats in the settings; a quota of "one slice of three" is written 0.333...,
# which must compare equal to 1/3. Slots are at most 64, so a bounded denominator is exact
# for every sensible quota.


_QUOTA_DENOMINATOR = 1_000_000


def _fmt_units(units: Fraction | float) -> str:
    """1 -> "1", 1/4 -> "0.25", 1/3 -> "0.333"."""
    value = Fraction(units)
    if value.denominator == 1:
        return str(value.numerator)
    return f"{float(value):.3f}".rstrip("0")


def _gpus(units: Fraction | float) -> str:
    return f"{_fmt_units(units)} GPU" + ("" if Fraction(units) == 1 else "s")


def _limit(value: float | None) -> Fraction | None:
    if value is None or not math.isfinite(value):
        return None  # unlimited (a NaN quota is a typo, not a ban)
    return Fraction(value).limit_denominator(_QUOTA_DENOMINATOR)


@dataclass(frozen=True)
class QuotaStanding:
    """One quota that applies to a user (their own, or one of their groups') and its use."""

    scope: str
    """``user`` or ``group``."""
    name: str
    limit: Fraction | None
    """GPUs that may be held at once, borrowed ones included (a slice counts 1/slots); None =
    no limit. This is the borrow limit; without one configured, the guarantee."""
    held: Fraction
    """Held now by the user, or by all members of the group together."""
    guarantee: Fraction | None = None
    """GPUs held within it are never reclaimed; beyond it (up to ``limit``) they are
    borrowed. None = no limit (nothing counted here is borrowed)."""
    model: str | None = None
    """A per-model quota's model (it counts only GPUs of that model); None: every model."""


def _user_limits(user: str, settings: PolicySettings) -> tuple[Fraction | None, Fraction | None]:
    """(guarantee, borrow limit) of a user: ``user_quota`` or ``default_user_quota``, and the
    borrow limit configured for them, else the guarantee."""
    guarantee: float | None
    borrow: float | None
    if user in settings.user_quota:
        guarantee = settings.user_quota[user]
        borrow = settings.user_borrow_limit.get(user, guarantee)
    else:
        guarantee = settings.default_user_quota
        borrow = settings.user_borrow_limit.get(user, settings.default_user_borrow_limit)
        if borrow is None:
            borrow = guarantee
    return _limit(guarantee), _limit(borrow)


@dataclass(frozen=True)
class QuotaScope:
    """One quota: whose (a user, or a group's members together), of which model (None: of
    every model), its guarantee and its borrow limit (None: unlimited)."""

    scope: str
    name: str
    guarantee: Fraction | None
    borrow_limit: Fraction | None
    model: str | None = None

    def counts(self, claim: Claim, cluster: Cluster, uuid: str) -> bool:
        """Whether a claim on GPU ``uuid`` counts against this quota."""
        mine = claim.user == self.name if self.scope == "user" else self.name in claim.groups
        if not mine or self.model is None:
            return mine
        gpu = cluster.gpus.get(uuid)
        return gpu is not None and gpu.model == self.model


def _model_scopes(scope: str, name: str, guarantees: Mapping[str, Mapping[str, float]],
                  limits: Mapping[str, Mapping[str, float]], aliases: Mapping[str, str],
                  model: str | None, every_model: bool) -> list[QuotaScope]:
    found = []
    configured = guarantees.get(name, {})
    # A per-model key is a name an admin typed ("gtx 1070", an alias): matched to the grant's
    # model by the same rule as a user's request (allocator.wire.model_names), not by equality.
    names = ModelNames.build([model], aliases) if configured and model is not None else None
    for key, guarantee in configured.items():
        if names is not None and names.canonical(key) == model:
            canonical = model
        elif every_model:
            canonical = aliases.get(key, key)
        else:
            continue
        borrow = limits.get(name, {}).get(key, guarantee)
        found.append(QuotaScope(scope, name, _limit(guarantee), _limit(borrow), canonical))
    return found


def quota_scopes(user: str, groups: Sequence[str], settings: PolicySettings, *,
                 model: str | None = None, every_model: bool = False) -> list[QuotaScope]:
    """The quotas of the user, then of each of their groups with one (each once, in the order
    given): the whole-cluster ones, and the per-model ones (``user_model_quota``,
    ``group_model_quota``) of ``model`` (a grant's one model), or of every model."""
    guarantee, borrow = _user_limits(user, settings)
    scopes = [QuotaScope("user", user, guarantee, borrow)]
    scopes += _model_scopes("user", user, settings.user_model_quota,
                            settings.user_model_borrow_limit, settings.aliases, model,
                            every_model)
    for group in dict.fromkeys(groups):
        if group in settings.group_quota:
            group_guarantee = settings.group_quota[group]
            scopes.append(QuotaScope("group", group, _limit(group_guarantee), _limit(
                settings.group_borrow_limit.get(group, group_guarantee))))
        scopes += _model_scopes("group", group, settings.group_model_quota,
                                settings.group_model_borrow_limit, settings.aliases, model,
                                every_model)
    return scopes


def quota_standings(user: str, groups: Sequence[str], cluster: Cluster,
                    settings: PolicySettings, *, limited_only: bool = False,
                    model: str | None = None, every_model: bool = False
                    ) -> list[QuotaStanding]:
    """The user's own quota, then one per group of theirs that has one (each group once, in
    the order given), with what each holds now; per-model quotas as :func:`quota_scopes`.

    Holdings are the claims in the cluster: one per GPU a lease holds (1 unit each for
    exclusive leases, 1/slots for a slice); a per-model quota counts the claims on GPUs of its
    model. The user's guarantee is ``user_quota[user]``, else ``default_user_quota`` (None =
    unlimited); each of the user's groups in ``group_quota`` guarantees what all claims
    carrying that group hold together. The limit of each is its borrow limit
    (``user_borrow_limit``, ``group_borrow_limit``, ``default_user_borrow_limit``, and the
    ``*_model_borrow_limit`` ones), the guarantee where none is set. ``limited_only`` leaves
    out the unlimited ones, and counts nothing when none is limited.
    """
    scopes = quota_scopes(user, groups, settings, model=model, every_model=every_model)
    if limited_only:
        scopes = [scope for scope in scopes if scope.borrow_limit is not None]
        if not scopes:
            return []  # no quota applies: no need to count what everybody holds
    claims = [(uuid, claim) for uuid, held in cluster.claims.items() for claim in held]
    return [
        QuotaStanding(scope.scope, scope.name, scope.borrow_limit, sum(
            (c.units for uuid, c in claims if scope.counts(c, cluster, uuid)), Fraction(0)),
            scope.guarantee, scope.model)
        for scope in scopes
    ]


def would_borrow(demand_units: Fraction, standings: Sequence[QuotaStanding]) -> bool:
    """Whether granting ``demand_units`` more would go beyond one of the guarantees."""
    return any(s.guarantee is not None and s.held + demand_units > s.guarantee
               for s in standings)


def check_quota(
    demand_units: Fraction,
    user: str,
    groups: Sequence[str],
    cluster: Cluster,
    settings: PolicySettings,
    model: str | None = None,
) -> Refusal | None:
    """``quota_exceeded`` if granting ``demand_units`` more (of ``model``, the grant's one
    model) would pass a user or group quota (see :func:`quota_standings`)."""
    for standing in quota_standings(user, groups, cluster, settings, limited_only=True,
                                    model=model):
        assert standing.limit is not None
        if standing.held + demand_units <= standing.limit:
            continue
        who = (f"User {user} may" if standing.scope == "user"
               else f"Group {standing.name} may")
        of = f" of {standing.model}" if standing.model is not None else ""
        holds = "holds" if standing.scope == "user" else "its members hold"
        return Refusal(
            ErrorCode.QUOTA_EXCEEDED,
            f"{who} hold {_gpus(standing.limit)}{of} at once and {holds} "
            f"{_fmt_units(standing.held)}; this request asks for {_fmt_units(demand_units)} more.",
            {
                "scope": standing.scope,
                "name": standing.name,
                "limit": float(standing.limit),
                "held": float(standing.held),
                "asked": float(demand_units),
                **({"model": standing.model} if standing.model is not None else {}),
            },
        )
    return None


def place_within_quota(demand: Demand, place: Callable[[Demand, bool], Placement | Refusal],
                       refuse: Callable[[Placement], Refusal | None]) -> Placement | Refusal:
    """Where ``demand`` fits and its quota allows it: the one rule of placement and quota.

    ``place(demand, retry)`` is best fit (``retry``: a placement tried again without a model,
    whose refusal nobody reads); ``refuse(placement)`` the quota's refusal of a placement, or
    None. Best fit picks a host and model without the quota, so when a per-model quota
    (``details["model"]``) refuses the placement found, that model is left out and the demand
    placed again, as long as it accepts another model: an any-model request is never refused
    while a model its user may take is free. Else the first quota refusal stands.
    """
    found = place(demand, False)
    first: Refusal | None = None
    while isinstance(found, Placement):
        refusal = refuse(found)
        if refusal is None:
            return found
        first = first or refusal
        model = refusal.details.get("model")
        refused = demand.refused_models | {model} if isinstance(model, str) else None
        if refused is None or refused == demand.refused_models or (
                demand.models is not None and refused.issuperset(demand.models)):
            return first
        demand = replace(demand, refused_models=refused)
        found = place(demand, True)
    return first if first is not None else found
