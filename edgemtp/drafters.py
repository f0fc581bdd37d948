"""Drafters: who proposes the next tree. Every drafter fits the same small interface, so the
decode loop and the lossless verifier never change when a drafter does.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from .backend import Backend, StepOut
from .config import GenerationConfig
from .embeddings import MaskEmbeddings
from .errors import ConfigError
from .lookahead import LookaheadDrafter
from .ngram import HybridDrafter, PromptLookupDrafter, StandDrafter
from .plans import DynamicPlans, Plan, dynamic_plans, nodes_for_budget, static_plan
from .tree import RankCalibration, dynamic_tree, ranked_tree, static_tree

ROOT_ONLY = Plan.root_only()


class Drafter(Protocol):
    mask_tokens: int  # mask slots per node the block carries (0: the drafter uses none)
    topk: int         # candidates per block row the drafter reads from a step

    def start(self, prompt_ids: np.ndarray) -> None: ...

    def propose(self, root: int) -> tuple[Plan, np.ndarray]:
        """The plan of the next step and its node tokens [N], root first."""
        ...

    def mask_embeds(self) -> np.ndarray | None: ...

    def observe(self, out: StepOut, mask_rows: np.ndarray, new_tokens: list[int],
                path_rows: np.ndarray) -> None:
        """Learn from a step: the accepted node's mask rows, the tokens just committed
        (accepted nodes + bonus) and the block rows of the root and accepted nodes (whose
        outputs are the model's own distributions at committed positions; for prefill, the
        prompt's rows)."""
        ...


class NoDrafter:
    """Plain autoregressive decoding, the BE = 1.0 reference: one position per step."""

    mask_tokens = 0
    topk = 0

    def start(self, prompt_ids: np.ndarray) -> None:
        pass

    def propose(self, root: int) -> tuple[Plan, np.ndarray]:
        return ROOT_ONLY, np.array([root], dtype=np.int64)

    def mask_embeds(self) -> None:
        return None

    def observe(self, out: StepOut, mask_rows: np.ndarray, new_tokens: list[int],
                path_rows: np.ndarray) -> None:
        pass


class ProbeDrafter:
    """Mask-token probing: the accepted node's ``k`` masks propose depths ``1..k`` of the
    next tree, static (a fixed top-1 shape) or dynamic (Algorithm 1 over a plan table)."""

    def __init__(self, backend: Backend, config: GenerationConfig,
                 memory: dict | None = None) -> None:
        k = self.mask_tokens = config.mask_tokens
        n = nodes_for_budget(config.bc, k)
        self.plans: DynamicPlans | None = None
        self.static: Plan | None = None
        if config.tree == "dynamic" and k >= 2:
            self.plans = dynamic_plans(config.bc, k)
        else:
            self.static = static_plan(config.bc, k, config.branching)
            n = self.static.n_nodes
        if backend.vocab_size < n + 1:
            raise ConfigError(f"a plan of {n} nodes needs a vocabulary of at least {n + 1} "
                              f"tokens, the model has {backend.vocab_size}")
        self.topk = n  # N - 1 candidates per depth, plus one a pruned parent token may take
        self.prune = config.prune
        vector = None if config.mask_vector is None else np.asarray(config.mask_vector)
        stats = backend.embedding_stats() if config.mask_init == "sample" else None
        self.embeds = MaskEmbeddings(k, config.mask_init, config.ema, backend.embed,
                                     stats=stats, vector=vector, seed=config.seed)
        self._cand: tuple[np.ndarray, np.ndarray] | None = None
        self.calibration = None
        if config.calibrate and self.plans is not None:
            # kept in the caller's memory, if any, so it keeps learning across generations
            key = ("rank-calibration", config.bc, k, config.prune)
            fresh = RankCalibration(k, n - 1)
            self.calibration = fresh if memory is None else memory.setdefault(key, fresh)
        self._pools: tuple[list, list] | None = None

    def start(self, prompt_ids: np.ndarray) -> None:
        self.embeds.start(prompt_ids)

    def propose(self, root: int) -> tuple[Plan, np.ndarray]:
        ids, lp = self._cand
        if self.plans is None:
            return self.static, static_tree(self.static, root, ids, lp, self.prune)
        cal = self.calibration
        if cal is None:
            return dynamic_tree(self.plans, root, ids, lp, self.prune)
        # the tree's own pruned rankings are the ones calibration records
        plan, tokens, *pools = ranked_tree(self.plans, root, ids, lp, self.prune, cal.bias())
        self._pools = tuple(pools)
        return plan, tokens

    def mask_embeds(self) -> np.ndarray:
        return self.embeds.value

    def observe(self, out: StepOut, mask_rows: np.ndarray, new_tokens: list[int],
                path_rows: np.ndarray) -> None:
        if self._pools is not None:  # new_tokens: the true tokens at depths 1, 2, ...
            self.calibration.record(*self._pools, truth=new_tokens)
            self._pools = None
        self._cand = out.topk_ids[mask_rows], out.topk_logprobs[mask_rows]
        self.embeds.update(new_tokens)


def make_drafter(backend: Backend, config: GenerationConfig, memory: dict | None = None
                 ) -> Drafter:
    """The drafter a config asks for; ``memory`` is state a drafter may keep across
    generations of one loaded model (never anything that changes the output tokens)."""
    return DRAFTERS[config.drafter](backend, config, memory)


def _auto(backend: Backend, config: GenerationConfig, memory: dict | None) -> Drafter:
    from .policy import AutoDrafter  # noqa: PLC0415  (policy imports this module's neighbours)

    return AutoDrafter(backend, config, memory)


DRAFTERS = {
    "probe": ProbeDrafter,
    "auto": _auto,
    "pld": PromptLookupDrafter,
    "stand": StandDrafter,
    "lade": LookaheadDrafter,
    "hybrid": HybridDrafter,
    "none": lambda backend, config, memory: NoDrafter(),
}
