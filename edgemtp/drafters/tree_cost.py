"""How far a best-first tree should grow on this device: ``tree_cost="measured"``.

A tree drafter grows nodes best first while the budget (BC) allows. Each node adds its score
(the chance it is accepted: expected tokens) to a step, and costs a step its share of the
block's time: a row of the forward pass and the host time of drafting it. Where a step is
cheap next to drafting (a GPU step of a small model is ~0.5 ms, the hybrid's tree building
~15 us a node in Python), the last nodes of a 60-node tree cost more than they return.

:class:`TreeCost` fits a step's wall time (draft, forward, verification, commit) against
the rows of its block online, ``t ~ a + b * T``, with the tokens a step commits ``E``, all
as exponentially weighted means. Tokens per second ``E / t`` rise with one more row as long
as what that row adds beats ``E * b / t``: that is the least score a node must have
(:meth:`min_score`). The fit is the device's and the drafter's own, so it needs no latency
measurement up front; until it has enough steps with different block sizes, trees grow to
the budget. The hybrid holds its Jacobi window to the same rule: its rows run while the
tokens that only the window's n-grams got accepted per step beat its rows times that least
score (and on a probe step now and then). Lossless either way: only the tree changes, never
the verification.
"""

from __future__ import annotations

TREE_COSTS = ("budget", "measured")


class TreeCost:
    """An online fit of step seconds against block rows, and the score a node must beat.

    >>> c = TreeCost(warmup=4)
    >>> for rows, tokens in [(10, 2), (20, 2), (30, 3), (40, 3)] * 3:
    ...     c.record(rows, 0.001 + 0.0001 * rows, tokens)    # 0.1 ms a row, 1 ms a step
    >>> round(c.slope * 1e6), round(c.min_score(0.001), 3)   # E 2.5, t ~3.5 ms
    (100, 0.071)
    """

    def __init__(self, alpha: float = 0.05, warmup: int = 16) -> None:
        self.alpha, self.warmup = alpha, warmup
        self.n = 0
        self.rows = self.seconds = self.tokens = 0.0    # means
        self.var_rows = self.cov = 0.0                  # rows' variance, rows x seconds

    def record(self, rows: int, seconds: float, tokens: int) -> None:
        """One step of this drafter's own tree: its block rows, wall time, committed tokens."""
        a = max(self.alpha, 1.0 / (self.n + 1))  # a plain mean over the first 1 / alpha
        d_rows, d_sec = rows - self.rows, seconds - self.seconds
        self.rows += a * d_rows
        self.seconds += a * d_sec
        self.tokens += a * (tokens - self.tokens)
        self.var_rows = (1.0 - a) * (self.var_rows + a * d_rows * d_rows)
        self.cov = (1.0 - a) * (self.cov + a * d_rows * d_sec)
        self.n += 1

    @property
    def slope(self) -> float:
        """Seconds a step gains per block row (0 until the rows have varied)."""
        return max(self.cov / self.var_rows, 0.0) if self.var_rows > 1e-9 else 0.0

    def min_score(self, floor: float) -> float:
        """The least expected tokens a node must add for one more row to raise tokens/s."""
        if self.n < self.warmup or self.seconds <= 0.0:
            return floor
        return max(floor, self.tokens * self.slope / self.seconds)


def tree_cost(config, memory: dict | None, key: tuple) -> TreeCost | None:
    """A drafter's :class:`TreeCost` where ``config.tree_cost == "measured"`` (kept in
    ``memory`` under ``key`` where there is one, so it carries across generations), else
    None."""
    if config.tree_cost != "measured":
        return None
    return TreeCost() if memory is None else memory.setdefault(key, TreeCost())
