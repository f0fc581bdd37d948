"""Mask-token probing (paper §3): the accepted node's mask tokens propose the next tree."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ..backend import Backend, StepOut
from ..budgets import nodes_for_budget
from ..embeddings import MaskEmbeddings
from ..errors import ConfigError
from ..plans import DynamicPlans, Plan, frozen, dynamic_plans, static_plan
from ..tree import RankCalibration, dynamic_tree, ranked_tree, static_tree

if TYPE_CHECKING:
    from ..config import GenerationConfig


# a step without mask rows (prefill aside, only under auto) leaves no candidates
_NO_CANDIDATES = (frozen(np.zeros((0, 0), dtype=np.int64)),
                  frozen(np.zeros((0, 0), dtype=np.float32)))


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
        plan, tokens, *pools = ranked_tree(self.plans, root, ids, lp, self.prune, cal.bias_rows())
        self._pools = tuple(pools)
        return plan, tokens

    def mask_embeds(self) -> np.ndarray:
        return self.embeds.value

    def observe(self, out: StepOut, mask_rows: np.ndarray, new_tokens: list[int],
                path_rows: np.ndarray) -> None:
        if self._pools is not None:  # new_tokens: the true tokens at depths 1, 2, ...
            self.calibration.record(*self._pools, truth=new_tokens)
            self._pools = None
        self._cand = ((out.topk_ids[mask_rows], out.topk_logprobs[mask_rows]) if len(mask_rows)
                      else _NO_CANDIDATES)
        self.embeds.update(new_tokens)

    def catch_up(self, tokens) -> None:
        """Tokens committed while not observing (auto's dormant drafters): folded into the
        mask embeddings in bulk; no candidates are left until a step with masks."""
        self.embeds.update(tokens)
        self._cand, self._pools = None, None
