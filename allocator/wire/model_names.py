"""GPU model names: which spellings mean which model. Part of the allocator's public surface.

One rule for everyone who reads a model name a person typed: the allocator resolves requested
models with it, and the hub checks a user's choice against the admin's model list with the
very same rule, so the hub never refuses a spelling the allocator accepts ("gtx 1070").

Accepted spellings of a model, strongest first (a spelling an earlier tier took is not
overridden, so an exact model name always beats an alias, and an alias a derived spelling):

1. the canonical name (NVML's, ``NVIDIA GeForce GTX 1070``) in any case;
2. an admin's alias (``1070``), in any case, also without spaces and punctuation;
3. the canonical name with everything but letters and digits removed (``nvidiageforcegtx1070``);
4. that without the vendor words of :data:`BRAND_WORDS` (``gtx1070``, so "GTX-1070");
5. for a MIG instance (NVML names it ``NVIDIA A100-SXM4-40GB MIG 1g.5gb``, see
   :func:`mig_model_name`): its GPU's name and the profile without the word MIG
   (``a100 sxm4 40gb 1g.5gb``), the GPU's family and the profile (``a100 1g.5gb``) and the
   profile alone (``1g.5gb``).

A derived spelling that two models share is ambiguous and accepted for neither (so ``1g.10gb``
on both an A100 80GB and an H100 must be named with its family).

Pure: no I/O. Build a :class:`ModelNames` from the models the cluster has and the aliases
(:meth:`ModelNames.build`), or from the allocator's inventory reply
(:meth:`ModelNames.from_summaries`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from allocator.wire.protocol import ErrorCode, ModelSummary

BRAND_WORDS = frozenset({"nvidia", "geforce", "tesla", "quadro"})
"""Vendor and brand words a user may leave out of a model name ("gtx 1070")."""

_TOKEN = re.compile(r"[a-z0-9]+")

_MIG_NAME = re.compile(r"^(?P<parent>.+?)\s+MIG\s+(?P<profile>\S+)$")


def mig_model_name(parent_model: str, profile: str) -> str:
    """The name NVML gives a MIG device, its canonical model: the GPU's name, ``MIG`` and the
    GPU instance profile (``NVIDIA A100-SXM4-40GB MIG 1g.5gb``)."""
    return f"{parent_model} MIG {profile}"


def mig_parts(name: str) -> tuple[str, str] | None:
    """``(GPU model, profile)`` of a MIG device's name, or None for any other name."""
    match = _MIG_NAME.match(name.strip())
    return (match.group("parent"), match.group("profile")) if match else None


def display_name(model: str) -> str:
    """The model as a person reads it: ``NVIDIA A100-SXM4-40GB · 1g.5gb`` for a MIG instance,
    the model itself otherwise."""
    parts = mig_parts(model)
    return model if parts is None else f"{parts[0]} · {parts[1]}"


def _mig_spellings(model: str) -> list[str]:
    """Tier 5: the short spellings of a MIG instance's model (none for other models)."""
    parts = mig_parts(model)
    if parts is None:
        return []
    parent, profile = parts
    family = next((t for t in _tokens(parent) if t not in BRAND_WORDS), "")
    return [unbranded(f"{parent} {profile}"), compact(f"{family} {profile}"), compact(profile)]


def _tokens(name: str) -> list[str]:
    return _TOKEN.findall(name.lower())


def compact(name: str) -> str:
    """The name without anything but letters and digits: "GTX-1070" -> "gtx1070"."""
    return "".join(_tokens(name))


def unbranded(name: str) -> str:
    """The compact name without vendor words: "NVIDIA GeForce GTX 1070" -> "gtx1070"."""
    return "".join(token for token in _tokens(name) if token not in BRAND_WORDS)


def spellings_of(name: str) -> tuple[str, ...]:
    """The keys a typed name is looked up by, strongest first."""
    return (name.strip().lower(), compact(name), unbranded(name))


@dataclass(frozen=True)
class ModelNameError:
    """Why requested names could not be resolved: a stable code and a message for people."""

    code: ErrorCode
    message: str
    details: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ModelNames:
    """Every accepted spelling of every known model, and the aliases of each."""

    spellings: dict[str, str]
    """Accepted spelling (lowercase) -> canonical model."""
    ambiguous: dict[str, tuple[str, ...]]
    """Derived spellings that fit more than one model, so they are not accepted."""
    known: tuple[str, ...]
    """Canonical models, sorted."""
    aliases: dict[str, list[str]]
    """Canonical model -> configured aliases that point to it, sorted."""

    @classmethod
    def build(cls, models: Iterable[str], aliases: Mapping[str, str]) -> ModelNames:
        """The names of ``models`` (as the node agents report them) and of the aliases.

        Known models are ``models`` and the targets of the aliases. An admin who writes an
        alias target in another case or spacing still means the model the agents report, so
        targets are matched against the reported names first.
        """
        reported = sorted(set(models))
        by_compact: dict[str, set[str]] = {}
        for model in reported:
            by_compact.setdefault(compact(model), set()).add(model)
        alias_targets: dict[str, str] = {}
        for alias, target in aliases.items():
            matches = by_compact.get(compact(target), set())
            alias_targets[alias] = next(iter(matches)) if len(matches) == 1 else target.strip()
        known = sorted(set(reported) | set(alias_targets.values()))

        spellings: dict[str, str] = {}
        ambiguous: dict[str, tuple[str, ...]] = {}

        def add_tier(pairs: list[tuple[str, str]]) -> None:
            tier: dict[str, set[str]] = {}
            for key, model in pairs:
                if key and key not in spellings and key not in ambiguous:
                    tier.setdefault(key, set()).add(model)
            for key, candidates in tier.items():
                if len(candidates) == 1:
                    spellings[key] = next(iter(candidates))
                else:
                    ambiguous[key] = tuple(sorted(candidates))

        add_tier([(model.strip().lower(), model) for model in known])
        add_tier(
            [(alias.strip().lower(), target) for alias, target in alias_targets.items()]
            + [(compact(alias), target) for alias, target in alias_targets.items()]
        )
        add_tier([(compact(model), model) for model in known])
        add_tier([(unbranded(model), model) for model in known])
        add_tier([(key, model) for model in known for key in _mig_spellings(model)])

        by_model: dict[str, list[str]] = {model: [] for model in known}
        for alias, target in alias_targets.items():
            by_model[target].append(alias)
        return cls(
            spellings=spellings,
            ambiguous=ambiguous,
            known=tuple(known),
            aliases={model: sorted(names) for model, names in by_model.items()},
        )

    @classmethod
    def from_summaries(cls, summaries: Iterable[ModelSummary]) -> ModelNames:
        """The names as the allocator's inventory reply lists them (models with their aliases)."""
        listed = list(summaries)
        return cls.build(
            (s.model for s in listed),
            {alias: s.model for s in listed for alias in s.aliases},
        )

    def lookup(self, name: str) -> str | tuple[str, ...] | None:
        """The canonical model for a spelling, the candidates if it is ambiguous, or None."""
        for key in spellings_of(name):
            if key in self.spellings:
                return self.spellings[key]
            if key in self.ambiguous:
                return self.ambiguous[key]
        return None

    def canonical(self, name: str) -> str | None:
        """The canonical model a spelling means, or None (unknown or ambiguous)."""
        found = self.lookup(name)
        return found if isinstance(found, str) else None

    def known_text(self) -> str:
        """The known models and their aliases, as a sentence for a refusal."""
        if not self.known:
            return "No GPU model is known yet: no node has reported a GPU."
        parts = []
        for model in self.known:
            names = self.aliases.get(model, [])
            parts.append(f"{model} (aliases: {', '.join(names)})" if names else model)
        return "Known models: " + "; ".join(parts) + "."

    def resolve(self, requested: Sequence[str]) -> tuple[str, ...] | ModelNameError:
        """Resolve names or aliases to canonical models, keeping the order of preference.

        Duplicates are dropped. Unknown or ambiguous names give ``unknown_model`` with the
        known models (and their aliases) in the message; an empty list is a ``bad_request``.
        """
        if not requested:
            return ModelNameError(
                ErrorCode.BAD_REQUEST,
                "The list of acceptable models is empty; leave it out to accept any model.",
            )
        resolved: list[str] = []
        unknown: list[str] = []
        ambiguous: dict[str, list[str]] = {}
        for name in requested:
            found = self.lookup(name)
            if found is None:
                unknown.append(name)
            elif isinstance(found, tuple):
                ambiguous[name] = list(found)
            elif found not in resolved:
                resolved.append(found)
        if unknown or ambiguous:
            sentences = []
            if unknown:
                quoted = ", ".join(repr(name) for name in unknown)
                sentences.append(f"Unknown GPU model {quoted}.")
            for name, candidates in ambiguous.items():
                sentences.append(f"{name!r} could mean {' or '.join(candidates)}; name one.")
            sentences.append(self.known_text())
            return ModelNameError(
                ErrorCode.UNKNOWN_MODEL,
                " ".join(sentences),
                {
                    "unknown": unknown,
                    "ambiguous": ambiguous,
                    "known": {model: self.aliases.get(model, []) for model in self.known},
                },
            )
        return tuple(resolved)


def same_model(a: str, b: str, names: ModelNames | None = None) -> bool:
    """Whether two typed names mean the same model.

    With the cluster's :class:`ModelNames` (aliases included) both are resolved; names it
    does not know, or no names at all, are compared by their spellings (case, spaces,
    punctuation and vendor words do not matter), as the allocator would match them.
    """
    if names is not None:
        ca, cb = names.canonical(a), names.canonical(b)
        if ca is not None and cb is not None:
            return ca == cb
    return ModelNames.build([b], {}).canonical(a) is not None
