"""Draft trees from the mask tokens' top-K candidates (paper §3.3, §3.5, §3.6, App. D).

Mask ``j`` of the accepted node proposes candidates for depth ``j`` of the next tree; with
top-1 expansion depth-``j`` candidates hang under the best depth-``j-1`` node, so a tree is
fully given by its node count per depth and its plan comes from a precompiled table.
"""

from __future__ import annotations

from math import inf

import numpy as np

from .plans import DynamicPlans, Plan

# The functions below run once per decode step on arrays of a few dozen entries, where a
# numpy call's fixed cost dominates: they use plain Python lists where that measured faster.


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
    tokens, parent = [root], root
    for j, count in enumerate(plan.counts):
        row = cand_ids[j].tolist()  # prune() on lists
        ids = [t for t in row if t != parent][:count] if prune_parent else row[:count]
        tokens.extend(ids)
        parent = ids[0]
    return np.array(tokens, dtype=np.int64)


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
    plan, tokens, _, _ = ranked_tree(plans, root, cand_ids, cand_lp, prune_parent, bias)
    return plan, tokens


def ranked_tree(plans: DynamicPlans, root: int, cand_ids: np.ndarray, cand_lp: np.ndarray,
                prune_parent: bool = True, bias=None
                ) -> tuple[Plan, np.ndarray, list[list[int]], list[list[float]]]:
    """:func:`dynamic_tree`, plus each depth's pruned ranking (ids, log-probs, as lists)
    under the top-1 of the depth above, as :meth:`RankCalibration.record` takes them."""
    m, k = plans.n_nodes - 1, plans.k
    id_rows, lp_rows = cand_ids.tolist(), cand_lp.tolist()
    bias_rows = bias if bias is None or isinstance(bias, list) else bias.tolist()
    parent, base, cap = root, 0.0, inf
    pools_ids, pools_lp, scores, monotone = [], [], [], True
    for j in range(k):
        row, lps = id_rows[j], lp_rows[j]
        if prune_parent:  # prune() on lists
            cols = [c for c, t in enumerate(row) if t != parent][:m]
            ids, lp = [row[c] for c in cols], [lps[c] for c in cols]
        else:
            ids, lp = row[:m], lps[:m]
        if bias_rows is None:
            score = [base + x for x in lp]
            monotone = monotone and all(a >= b for a, b in zip(score, score[1:]))
        else:
            # never above the parent, never above a better-ranked sibling: kept nodes stay a
            # prefix of each depth's ranking, so the shape still names the tree
            score, run = [], cap
            for x, b in zip(lp, bias_rows[j]):
                s = base + x + b
                if s < run:
                    run = s
                score.append(run)
        pools_ids.append(ids)
        pools_lp.append(lp)
        scores.append(score)
        parent, base = ids[0], score[0]
        cap = base
    # keep the best m of all depths by a stable sort on score: among equal scores the
    # shallower / better-ranked candidate wins, so every kept node's parent is kept too and
    # each depth keeps a prefix of its ranking. Each depth's scores are non-increasing (top-K
    # log-probs come sorted; the bias path makes them so), so a k-way merge of the depths
    # gives that sort's top m; otherwise sort.
    counts = [0] * k
    if monotone:
        for _ in range(min(m, sum(map(len, scores)))):
            best, top = -1, -inf
            for j in range(k):
                h = counts[j]
                if h < len(scores[j]) and (best < 0 or scores[j][h] > top):
                    best, top = j, scores[j][h]
            counts[best] += 1
    else:
        flat = [(-s, j) for j, score in enumerate(scores) for s in score]
        for _, j in sorted(flat, key=lambda e: e[0])[:m]:
            counts[j] += 1
    tokens = [root]
    for ids, c in zip(pools_ids, counts):
        tokens.extend(ids[:c])
    return plans[tuple(counts)], np.array(tokens, dtype=np.int64), pools_ids, pools_lp


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
        self._rows = [[0.0] * width for _ in range(k)]  # the bias, as the tree reads it

    def record(self, pools_ids: list[np.ndarray], pools_lp: list[np.ndarray],
               truth: list[int]) -> None:
        for j, (ids, lp) in enumerate(zip(pools_ids, pools_lp)):
            if j >= len(truth):
                return
            n = min(len(ids), self.mass.shape[1])
            self.mass[j, :n] += np.exp(np.asarray(lp[:n], dtype=np.float64))
            ranked, true = ids[:n], truth[j]
            if isinstance(ranked, np.ndarray):
                ranked = ranked.tolist()
            if true in ranked:
                self.hits[j, ranked.index(true)] += 1.0
            # only the rows a step touched change: the rest of the bias stays as it was
            self._rows[j] = np.log((self.hits[j] + 1.0) / (self.mass[j] + 1.0)).tolist()
            if ranked[0] != true:  # deeper candidates hang under this top-1: not tried
                return

    def bias(self) -> np.ndarray:
        """``log((hits + 1) / (mass + 1))`` per depth and rank, ``[k, width]``."""
        return np.array(self._rows)

    def bias_rows(self) -> list[list[float]]:
        """:meth:`bias` as rows of plain floats, kept up to date by :meth:`record` (the hot
        path: the tree reads them as lists, and a step changes a row or two)."""
        return self._rows


