"""Budgets in one place: how many positions, nodes and window cells a block-complexity budget
buys each drafter, and the caps that keep a budget from allocating more than a model or a
plan table can use. Imports nothing of edgemtp but its errors, so config, plans and every
drafter can read it.

A budget ``bc`` is the number of input positions one decode forward pass may use.
"""

from __future__ import annotations

import numbers
from math import comb

import numpy as np

from .errors import BudgetError, ConfigError

MAX_BC = 1024            # no plan, window or chain is ever wider than this
MAX_PLAN_TABLE = 4096    # dynamic plans one budget may precompile (k >= 2 grows combinatorially)
MAX_TABLE_BYTES = 256 << 20  # and the bytes of their [T, T] masks together
MAX_DEPTH = 10           # lookup trees and chains are at most 10 deep (paper App. F)
# the paper's lookahead configurations (App. F): BC -> (L, W, G)
LADE_CONFIGS = {10: (3, 4, 1), 30: (4, 5, 5), 60: (5, 8, 7)}
# the hybrid's Jacobi lookahead window (levels, width) from a budget up. One level (bigrams)
# beat 2-4 levels at every budget on story prompts 24-47 (bench: BC 60 BE 2.197 without a
# window, 2.358 with (1, 12), 2.329 with (2, 12), 2.246 with (3, 12))
HYBRID_WINDOWS = ((60, (1, 12)), (30, (1, 8)), (10, (1, 3)))
# budgets at which ``auto`` keeps whole drafters (hybrid, LADE, k = 2 probing) ready to run,
# each capped by its own budget: a narrow and a wide block, so the latency curve can choose
AUTO_BUDGETS = (10, 30)


def is_int(value) -> bool:
    """An integer (numpy's too), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def check_bc(bc, what: str = "block complexity (bc)") -> int:
    """A budget as an int in ``[1, MAX_BC]``, before anything is allocated for it.

    >>> check_bc(30)
    30
    """
    if not is_int(bc) or bc < 1:
        raise ConfigError(f"{what} must be an integer >= 1, got {bc!r}")
    bc = int(bc)
    if bc > MAX_BC:
        raise BudgetError(f"{what} {bc} is above the largest supported block of {MAX_BC} "
                          f"positions (a decode step that wide is slower than plain decoding "
                          f"on every device edgemtp targets)")
    return bc


def check_context(bc: int, max_context: int) -> None:
    """A plan compiled into a package must fit its KV cache next to at least one committed
    token (the exporter drops budgets that do not)."""
    if bc >= max_context:
        fix = (f"use a budget below {max_context}" if max_context > 4 else
               "the smallest probing plan (BC 4) needs a context of 5; use a larger one")
        raise BudgetError(f"block complexity {bc} does not fit the model's context of "
                          f"{max_context} tokens; {fix}")


# -- mask-token probing -------------------------------------------------------------------------


def nodes_for_budget(bc: int, k: int) -> int:
    """Largest node count ``N`` with ``(k + 1) * N <= bc``; at least a root and one draft node.

    >>> nodes_for_budget(30, 1), nodes_for_budget(60, 2)
    (15, 20)
    """
    if k < 1:
        raise ConfigError(f"probing needs at least 1 mask token per node, got k={k}")
    if bc > MAX_BC:
        check_bc(bc)
    n = bc // (k + 1)
    if n < 2:
        raise BudgetError(
            f"block complexity {bc} is too small for k={k} mask tokens: a probing plan needs at "
            f"least {2 * (k + 1)} positions (root + 1 draft node, each with {k} mask tokens)")
    return n


def default_branching(bc: int, k: int) -> tuple[int, ...]:
    """Static branching ``[K1, ..., Kk]`` used when a static k >= 2 plan is asked without one.

    Deeper depths get ~20 % of the draft nodes between them, the paper's shapes for k = 2:

    >>> default_branching(30, 2), default_branching(60, 2), default_branching(60, 3)
    ((7, 2), (15, 4), (11, 2, 1))
    """
    m = nodes_for_budget(bc, k) - 1
    if m < k:
        raise BudgetError(f"block complexity {bc} holds {m} draft nodes, fewer than the {k} "
                          f"depths a static k={k} plan needs; use k={m} or a larger budget")
    deep = max(k - 1, round(0.2 * m))
    per, extra = divmod(deep, k - 1) if k > 1 else (0, 0)
    tail = [per + (1 if d < extra else 0) for d in range(k - 1)] if k > 1 else []
    return (m - sum(tail), *tail)


def dynamic_table_size(bc: int, k: int) -> int:
    """How many top-1 shapes a dynamic tree of this budget can take (every one is compiled):
    ``sum over depths d = 1..k of C(n_draft - 1, d - 1)``.

    >>> dynamic_table_size(30, 1), dynamic_table_size(60, 2), dynamic_table_size(60, 3)
    (1, 19, 92)
    """
    m = nodes_for_budget(bc, k) - 1
    size = sum(comb(m - 1, d - 1) for d in range(1, k + 1))
    t = (m + 1) * (k + 1)
    if size > MAX_PLAN_TABLE or size * t * t > MAX_TABLE_BYTES:
        raise BudgetError(f"a dynamic tree with k={k} mask tokens at block complexity {bc} has "
                          f"{size} shapes to precompile ({t} positions each, "
                          f"{size * t * t / 2**20:.0f} MiB of masks), above the limit of "
                          f"{MAX_PLAN_TABLE} shapes and {MAX_TABLE_BYTES >> 20} MiB; use fewer "
                          f"mask tokens, a smaller budget or --tree static")
    return size


def probe_draft_nodes(bc: int) -> int:
    """Draft nodes of the largest k = 1 plan (``BC = 2 (1 + m)``), for ``auto``; 0 below 4.

    >>> probe_draft_nodes(3), probe_draft_nodes(4), probe_draft_nodes(60)
    (0, 1, 29)
    """
    return max(check_bc(bc) // 2 - 1, 0)


def auto_budgets(bc: int) -> tuple[int, ...]:
    """Budgets of the whole drafters ``auto`` weighs next to its own plans (none below 6:
    a k = 2 plan needs 6 positions, and narrower blocks are covered by auto's own plans).

    >>> auto_budgets(4), auto_budgets(8), auto_budgets(30), auto_budgets(60)
    ((), (8,), (10, 30), (10, 30))
    """
    if check_bc(bc) < 6:
        return ()
    return tuple(sorted({min(bc, b) for b in AUTO_BUDGETS}))


# -- lookup drafters ------------------------------------------------------------------------------


def chain_length(bc: int) -> int:
    """Draft tokens a prompt-lookup chain may carry: ``BC = L + 1``, at most 10 deep.

    >>> chain_length(1), chain_length(5), chain_length(60)
    (0, 4, 10)
    """
    return min(check_bc(bc) - 1, MAX_DEPTH)


def lade_shape(bc: int, given: tuple[int, int, int] | None = None) -> tuple[int, int, int]:
    """Lookahead decoding's ``(L, W, G)`` for a budget: the one given (checked against the
    budget), the paper's for BC 10 / 30 / 60, else the largest of the same proportions that
    fits. ``BC = (L - 1)(W + G)``.

    >>> lade_shape(30), lade_shape(60), lade_shape(20), lade_shape(6)
    ((4, 5, 5), (5, 8, 7), (3, 6, 4), (3, 2, 1))
    """
    check_bc(bc)
    if given is not None:
        n, w, g = (int(v) for v in given)
        if n < 2 or w < 1 or g < 0:
            raise ConfigError(f"lookahead (L, W, G) needs L >= 2, W >= 1 and G >= 0, "
                              f"got {list(given)}")
        if (n - 1) * (w + g) > bc:
            raise BudgetError(f"lookahead L={n}, W={w}, G={g} needs BC (L-1)(W+G) = "
                              f"{(n - 1) * (w + g)}, above the budget {bc}")
        return n, w, g
    if bc in LADE_CONFIGS:
        return LADE_CONFIGS[bc]
    n = 5 if bc >= 60 else 4 if bc >= 30 else 3
    while n > 2 and bc // (n - 1) < 3:
        n -= 1
    per = bc // (n - 1)
    if per < 3:
        raise BudgetError(f"lookahead decoding needs a block complexity of at least 3 "
                          f"(L=2, W=2, G=1), got {bc}")
    g = max(1, min(per - 2, round(0.45 * per)))
    return n, per - g, g


def hybrid_window(bc: int) -> tuple[int, int] | None:
    """The hybrid's Jacobi window ``(levels, width)`` for a budget (None: no window).

    >>> hybrid_window(9), hybrid_window(10), hybrid_window(30), hybrid_window(60)
    (None, (1, 3), (1, 8), (1, 12))
    """
    return next((w for floor, w in HYBRID_WINDOWS if check_bc(bc) >= floor), None)


def hybrid_tree_budget(bc: int) -> int:
    """Positions the hybrid's tree (nodes and masks) may use next to its window.

    >>> hybrid_tree_budget(9), hybrid_tree_budget(10), hybrid_tree_budget(60)
    (9, 8, 49)
    """
    window = hybrid_window(bc)
    return bc - (0 if window is None else window[0] * window[1] - 1)
