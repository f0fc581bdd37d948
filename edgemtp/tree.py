"""Draft trees from the mask tokens' top-K candidates (paper §3.3, §3.5, §3.6, App. D).

Mask ``j`` of the accepted node proposes candidates for depth ``j`` of the next tree; with
top-1 expansion depth-``j`` candidates hang under the best depth-``j-1`` node, so a tree is
fully given by its node count per depth and its plan comes from a precompiled table.
"""

from __future__ import annotations

import numpy as np

from .plans import DynamicPlans, Plan


def prune(ids: np.ndarray, logprobs: np.ndarray, parent: int, n: int, enabled: bool = True):
    """The best ``n`` candidates of one mask row, without the parent's own token (§3.6).

    >>> prune(np.array([7, 5, 9]), np.array([-0.1, -0.5, -2.0]), parent=7, n=2)
    (array([5, 9]), array([-0.5, -2. ]))
    """
    if enabled:
        keep = ids != parent
        ids, logprobs = ids[keep], logprobs[keep]
    return ids[:n], logprobs[:n]


def static_tree(plan: Plan, root: int, cand_ids: np.ndarray, cand_lp: np.ndarray,
                prune_parent: bool = True) -> np.ndarray:
    """Tokens ``[N]`` (root first) filling a fixed top-1 plan.

    cand_ids / cand_lp: [k, K] top-K of the accepted node's mask rows, best first.
    """
    tokens, parent = [np.array([root])], root
    for j, count in enumerate(plan.counts):
        ids, _ = prune(cand_ids[j], cand_lp[j], parent, count, prune_parent)
        tokens.append(ids)
        parent = int(ids[0])
    return np.concatenate(tokens).astype(np.int64)


def dynamic_tree(plans: DynamicPlans, root: int, cand_ids: np.ndarray, cand_lp: np.ndarray,
                 prune_parent: bool = True, bias: np.ndarray | None = None
                 ) -> tuple[Plan, np.ndarray]:
    """Algorithm 1 with top-1 expansion: rank candidates of every depth by cumulative
    log-probability and keep the best ``N - 1``; the shape picks a precompiled plan.
    ``bias[j, r]`` (log scale, see :class:`RankCalibration`) is added to the score of the
    rank-``r`` candidate of depth ``j + 1``, capped so that no node outranks its parent or a
    better-ranked sibling.

    >>> plans = DynamicPlans(bc=8, k=2)           # N = 2 nodes: root + 1 draft node
    >>> ids = np.array([[4, 5], [6, 7]]); lp = np.log([[0.9, 0.1], [0.8, 0.2]])
    >>> plan, tokens = dynamic_tree(plans, 0, ids, lp)
    >>> plan.counts, tokens.tolist()
    ((1,), [0, 4])
    """
    m = plans.n_nodes - 1
    parent, base = root, 0.0
    pools_ids, pools_cum = [], []
    cap = np.inf
    for j in range(plans.k):
        ids, lp = prune(cand_ids[j], cand_lp[j], parent, m, prune_parent)
        score = base + lp.astype(np.float64)
        if bias is not None:
            # never above the parent, never above a better-ranked sibling: kept nodes stay a
            # prefix of each depth's ranking, so the shape still names the tree
            score = np.minimum.accumulate(np.minimum(score + bias[j, :len(score)], cap))
        pools_ids.append(ids)
        pools_cum.append(score)
        parent, base, cap = int(ids[0]), float(score[0]), score[0]
    # stable sort: among equal scores the shallower / better-ranked candidate wins, so every
    # kept node's parent is kept too and each depth keeps a prefix of its ranking
    depth_of = np.concatenate([np.full(len(p), j) for j, p in enumerate(pools_ids)])
    order = np.argsort(-np.concatenate(pools_cum), kind="stable")[:m]
    counts = np.bincount(depth_of[order], minlength=plans.k)
    tokens = [np.array([root])] + [p[:c] for p, c in zip(pools_ids, counts)]
    return plans[tuple(int(c) for c in counts)], np.concatenate(tokens).astype(np.int64)


class RankCalibration:
    """Online calibration of the mask tokens' probabilities, per depth and candidate rank.

    The true token at every depth is known after verification whether or not its candidate
    was in the tree, so each step tells, for every rank ``r`` of depth ``j``'s (pruned)
    ranking, the probability the mask token gave it and whether it was the true token (depth
    ``j > 1`` only when the shallower top-1 candidates were all right, the condition under
    which its candidates are tried). ``bias = log((hits + 1) / (probability mass + 1))`` then
    corrects the dynamic tree's scores: a mask token that is over-confident at depth 2 on this
    model makes the tree spend fewer nodes there. Starts neutral (bias 0).

    >>> c = RankCalibration(k=1, width=2)
    >>> c.record([np.array([7, 5])], [np.log([0.5, 0.25])], truth=[5])
    >>> np.exp(c.bias()).round(3).tolist()
    [[0.667, 1.6]]
    """

    def __init__(self, k: int, width: int) -> None:
        self.hits = np.zeros((k, width))
        self.mass = np.zeros((k, width))

    def record(self, pools_ids: list[np.ndarray], pools_lp: list[np.ndarray],
               truth: list[int]) -> None:
        for j, (ids, lp) in enumerate(zip(pools_ids, pools_lp)):
            if j >= len(truth):
                return
            n = min(len(ids), self.mass.shape[1])
            self.mass[j, :n] += np.exp(lp[:n].astype(np.float64))
            rank = np.flatnonzero(ids[:n] == truth[j])
            if rank.size:
                self.hits[j, rank[0]] += 1.0
            if ids[0] != truth[j]:  # deeper candidates hang under this top-1: not tried
                return

    def bias(self) -> np.ndarray:
        return np.log((self.hits + 1.0) / (self.mass + 1.0))


