"""Learned heads (Medusa-style or residual, ``edgemtp train-heads``): the accepted node's last
hidden state proposes the next tree, with the probing drafter's dynamic tree.

Head ``j`` gives the candidates of depth ``j`` (the root, the model's own next token, is
depth 0), so a tree needs no mask tokens: ``BC = N`` nodes. As for probing, depth-``j``
candidates hang under the best depth-``j-1`` node and the best ``N - 1`` of all depths by
cumulative log-probability are kept (:func:`edgemtp.tree.ranked_tree`); the shape's plan is
compiled on first use (``N`` and the heads' depths allow too many shapes to precompile).
Verification is the engine's lossless walk, unchanged.
"""

from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING

import numpy as np

from ..backend import Backend, StepOut
from ..budgets import check_bc
from ..errors import BudgetError, ConfigError
from ..plans import Plan
from ..tree import RankCalibration, ranked_tree
from .hybrid import HitRates, HybridDrafter, candidates

if TYPE_CHECKING:
    from ..config import GenerationConfig


class HeadPlans:
    """Top-1 plans of ``n_nodes`` nodes (root included) over at most ``k`` depths, no mask
    tokens, each compiled the first time a step picks its shape (the interface of
    :class:`~edgemtp.plans.DynamicPlans` that :func:`~edgemtp.tree.ranked_tree` reads).

    >>> plans = HeadPlans(4, 2)
    >>> p = plans[(2, 1)]; p.parents, p.bc, p.k
    ((-1, 0, 0, 1), 4, 0)
    >>> plans[(2, 1)] is p
    True
    """

    def __init__(self, n_nodes: int, k: int) -> None:
        self.n_nodes, self.k = n_nodes, k
        self._table: dict[tuple[int, ...], Plan] = {}

    def __getitem__(self, counts: tuple[int, ...]) -> Plan:
        plan = self._table.get(counts)
        if plan is None:
            plan = self._table[counts] = Plan.top1(counts, 0)
        return plan


@lru_cache(maxsize=32)
def head_plans(n_nodes: int, depths: int) -> HeadPlans:
    """One plan table per (N, H), shared by every generation (plans are immutable)."""
    return HeadPlans(n_nodes, depths)


def heads_budget(config: GenerationConfig) -> int:
    """Heads need no mask tokens: a budget of ``bc`` positions is ``bc`` nodes."""
    if check_bc(config.bc) < 2:
        raise BudgetError(f"the heads drafter needs a block complexity of at least 2 (root + "
                          f"1 draft node), got {config.bc}")
    return config.bc


class HeadsDrafter:
    """The package's learned heads (``config.heads`` picks a kind when it has several)."""

    mask_tokens = 0
    topk = 0        # verification reads argmax (greedy) or logits (sampling) only
    hidden = True   # every step returns the rows' last hidden states

    def __init__(self, backend: Backend, config: GenerationConfig,
                 memory: dict | None = None, candidates: int | None = None) -> None:
        package = getattr(backend, "package", None)
        if package is None:
            raise ConfigError(f"the heads drafter runs a package's learned heads; the "
                              f"{backend.name} backend has no package (export the model, then "
                              f"edgemtp train-heads PACKAGE)")
        from ..runtimes.heads import HeadsRunner  # onnxruntime, when heads are asked for

        # a tree of N nodes reads at most N candidates of a head (N - 1 after the parent's
        # token is pruned): the graph is asked for no more (``candidates``: the caller's own)
        n = heads_budget(config)
        self.runner = HeadsRunner.load(package, config.heads,
                                       k=n if candidates is None else candidates,
                                       device=getattr(backend, "device", None))
        if not backend.supports_hidden:
            raise ConfigError(f"the package {str(package.root)!r} has heads but its graph "
                              f"does not output hidden states; re-export with --hidden-states")
        depth = self.runner.info.heads
        self.plans = head_plans(n, depth)
        self.prune = config.prune
        self.embed = backend.embed if self.runner.needs_embedding else None
        self.calibration = None
        if config.calibrate:
            key = ("heads-calibration", self.runner.info.kind, n, config.prune)
            fresh = RankCalibration(depth, n - 1)
            self.calibration = fresh if memory is None else memory.setdefault(key, fresh)
        self._cand: tuple[np.ndarray, np.ndarray] | None = None
        self._pools: tuple[list, list] | None = None

    def start(self, prompt_ids: np.ndarray) -> None:
        self._cand = self._pools = None

    def propose(self, root: int) -> tuple[Plan, np.ndarray]:
        ids, lp = self._cand
        cal = self.calibration
        plan, tokens, *pools = ranked_tree(self.plans, root, ids, lp, self.prune,
                                           None if cal is None else cal.bias_rows())
        self._pools = tuple(pools) if cal is not None else None
        return plan, tokens

    def mask_embeds(self) -> None:
        return None

    def observe(self, out: StepOut, mask_rows: np.ndarray, new_tokens: list[int],
                path_rows: np.ndarray) -> None:
        if self._pools is not None:  # new_tokens: the true tokens at depths 1, 2, ...
            self.calibration.record(*self._pools, truth=new_tokens)
            self._pools = None
        self.refresh(out, mask_rows, new_tokens, path_rows)

    def refresh(self, out: StepOut, mask_rows: np.ndarray, new_tokens: list[int],
                path_rows: np.ndarray) -> None:
        """The candidates for the step after ``out``: the heads on the last committed row's
        hidden state (the bonus token is the next root). ``auto`` calls it alone when it wakes
        a dormant heads drafter, which did not observe the steps it slept through."""
        root = new_tokens[-1]
        hidden = out.hidden[path_rows[-1]]
        self._cand = self.runner.run(hidden, root, None if self.embed is None else
                                     self.embed(np.array([root], dtype=np.int64))[0])

    def catch_up(self, tokens) -> None:
        """Nothing to catch up: the heads read only the last step (see :meth:`refresh`)."""


class HeadsHybridDrafter(HybridDrafter):
    """The hybrid drafter (``drafter="hybrid"`` with ``heads=KIND``) with the package's
    heads in place of mask tokens: head ``j``'s candidates hang under the depth-``j`` node of
    the top-1 chain, where mask ``j``'s would, and are scored by their online hit rate per
    rank like them; lookup chains and the Jacobi window stay. No node carries masks, so the
    whole tree budget goes to draft nodes."""

    hidden = True

    def __init__(self, backend: Backend, config: GenerationConfig,
                 memory: dict | None = None) -> None:
        super().__init__(backend, config, memory)
        self.heads = HeadsDrafter(backend, config.with_(drafter="heads", calibrate=False,
                                                        tree_cost="budget"),
                                  candidates=self.topk)  # (the tree cost is the hybrid's)
        self.k = self.mask_tokens = 0
        key = ("hybrid-heads-hit-rates", config.bc, config.heads, config.prune,
               config.calibrate)
        fresh = HitRates(self.max_ngram, self.topk, jacobi=self.rates.prior.size
                         - self.rates.first_jacobi)
        self.rates = fresh if memory is None else memory.setdefault(key, fresh)

    def mask_embeds(self) -> None:
        return None

    def observe(self, out: StepOut, mask_rows: np.ndarray, new_tokens: list[int],
                path_rows: np.ndarray) -> None:
        super().observe(out, mask_rows[:0], new_tokens, path_rows)
        self.refresh(out, mask_rows, new_tokens, path_rows)

    def refresh(self, out: StepOut, mask_rows: np.ndarray, new_tokens: list[int],
                path_rows: np.ndarray) -> None:
        """The heads' candidates for the step after ``out`` (see :meth:`HeadsDrafter.refresh`)."""
        self.heads.refresh(out, mask_rows, new_tokens, path_rows)
        ids, lp = self.heads._cand
        self._cand = candidates(ids[:, :self.topk], lp[:, :self.topk])
