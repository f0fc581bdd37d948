"""Drafters: who proposes the next tree, one module each, all behind :class:`Drafter`, and the
one registry (name -> class and budget rule) that config, CLI, bench, profile and demo read.

=========  =====================================================  ==========================
name       module                                                 positions a step may use
=========  =====================================================  ==========================
probe      :mod:`.probe` mask-token probing (static / dynamic)     ``(k + 1) * N <= bc``
auto       :mod:`.auto` plain, probing or lookup, per step         ``<= bc``
pld        :mod:`.prompt_lookup` prompt lookup chains              ``min(bc, 11)``
stand      :mod:`.stand` trees from stored distributions           ``<= bc``
lade       :mod:`.lookahead` lookahead decoding                    ``(L - 1)(W + G) <= bc``
hybrid     :mod:`.hybrid` probing + lookup + Jacobi window         ``<= bc``
heads      :mod:`.heads` learned Medusa / residual heads            ``N <= bc``
none       :mod:`.base` plain decoding                             ``1``
=========  =====================================================  ==========================
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from ..budgets import (chain_length, check_bc, dynamic_table_size, lade_shape,
                       nodes_for_budget)
from ..errors import ConfigError
from ..plans import static_plan
from .auto import AutoDrafter
from .base import Drafter, NoDrafter
from .heads import HeadsDrafter, HeadsHybridDrafter, heads_budget
from .hybrid import HybridDrafter
from .lookahead import LookaheadDrafter
from .probe import ProbeDrafter
from .prompt_lookup import PromptLookupDrafter
from .stand import StandDrafter

if TYPE_CHECKING:
    from ..backend import Backend
    from ..config import GenerationConfig


def _probe_budget(c: GenerationConfig) -> int:
    if c.tree == "dynamic" and c.mask_tokens >= 2:
        dynamic_table_size(c.bc, c.mask_tokens)  # refuses a table too large to precompile
        return nodes_for_budget(c.bc, c.mask_tokens) * (c.mask_tokens + 1)
    return static_plan(c.bc, c.mask_tokens, c.branching).bc


def _hybrid(backend: Backend, config: GenerationConfig, memory: dict | None) -> Drafter:
    # heads=KIND: the package's learned heads take the place of mask tokens
    cls = HybridDrafter if config.heads is None else HeadsHybridDrafter
    return cls(backend, config, memory)


def _lade_budget(c: GenerationConfig) -> int:
    n, w, g = lade_shape(c.bc, c.lookahead)
    return (n - 1) * (w + g)


@dataclass(frozen=True)
class DrafterSpec:
    """A drafter's entry: how to build it, and its budget rule.

    ``budget(config)`` checks the config's budget for this drafter before any model is loaded
    (one-line :class:`~edgemtp.errors.BudgetError`) and returns the widest block, in
    positions, a step of it may use. ``uses_masks``: it reads ``mask_tokens`` (the CLI's
    ``-k``). ``options``: the config fields that apply to this drafter only.
    """

    name: str
    summary: str
    factory: Callable[["Backend", "GenerationConfig", dict | None], Drafter]
    budget: Callable[["GenerationConfig"], int]
    uses_masks: bool = False
    options: frozenset[str] = frozenset()

    @property
    def speculative(self) -> bool:
        return self.name != "none"


REGISTRY: dict[str, DrafterSpec] = {spec.name: spec for spec in (
    DrafterSpec("probe", "mask-token probing, static or dynamic tree", ProbeDrafter,
                _probe_budget, uses_masks=True),
    DrafterSpec("auto", "plain decoding, probing or a lookup chain per step, by expected "
                        "tokens/s on this device (--heads KIND: a package's learned heads "
                        "too)", AutoDrafter, lambda c: check_bc(c.bc),
                options=frozenset({"heads", "tree_cost"})),
    DrafterSpec("pld", "prompt lookup: a chain of the tokens that followed the context's "
                       "suffix earlier", PromptLookupDrafter,
                lambda c: chain_length(c.bc) + 1),
    DrafterSpec("stand", "STAND: lookup trees from the model's stored distributions",
                StandDrafter, lambda c: check_bc(c.bc), options=frozenset({"tree_cost"})),
    DrafterSpec("lade", "lookahead decoding: Jacobi window and n-gram pool in one block",
                LookaheadDrafter, _lade_budget, options=frozenset({"lookahead"})),
    DrafterSpec("hybrid", "probing (or a package's learned heads: --heads KIND), lookup and a "
                          "Jacobi window in one tree", _hybrid,
                lambda c: check_bc(c.bc), uses_masks=True,
                options=frozenset({"heads", "tree_cost"})),
    DrafterSpec("heads", "a package's learned Medusa or residual heads (edgemtp train-heads) "
                         "on the last hidden state, dynamic tree", HeadsDrafter, heads_budget,
                options=frozenset({"heads"})),
    DrafterSpec("none", "plain decoding (BE 1.0)", lambda backend, config, memory: NoDrafter(),
                lambda c: 1),
)}


# the config fields that apply to some drafters only (a spec's ``options``)
OPTIONS = frozenset().union(*(spec.options for spec in REGISTRY.values()))


def names(speculative: bool = False) -> list[str]:
    """Registered drafter names, in registry order (``speculative``: without ``none``)."""
    return [n for n, spec in REGISTRY.items() if spec.speculative or not speculative]


def get(name: str) -> DrafterSpec:
    spec = REGISTRY.get(name)
    if spec is None:
        raise ConfigError(f"drafter must be one of {', '.join(REGISTRY)}, got {name!r}")
    return spec


def make_drafter(backend: Backend, config: GenerationConfig, memory: dict | None = None
                 ) -> Drafter:
    """The drafter a config asks for; ``memory`` is state a drafter may keep across
    generations of one loaded model (never anything that changes the output tokens)."""
    return get(config.drafter).factory(backend, config, memory)


__all__ = ["AutoDrafter", "Drafter", "DrafterSpec", "HeadsDrafter", "HybridDrafter",
           "LookaheadDrafter", "NoDrafter", "ProbeDrafter", "PromptLookupDrafter", "REGISTRY",
           "StandDrafter", "get", "make_drafter", "names"]
