"""Lookahead decoding (LADE; Fu et al. 2024; paper App. F) in the same runtime and the same
BC accounting: ``BC = (L - 1)(W + G)`` for n-gram size ``L``, window ``W`` and guess set
``G``.

One block carries two branches next to each other:

- the **verification branch**: the root and a trie of up to ``G`` guessed ``(L - 1)``-token
  continuations of it from the n-gram pool, a plain tree the lossless verifier walks;
- the **lookahead branch**: a window of ``L - 1`` levels by ``W`` columns of Jacobi
  iterates. Level 0 column 0 is the root itself; the cell ``(l, i)`` sits at position
  ``P + l + i`` and attends to the cache, the level-0 cells of columns ``0..i`` and the
  cells of column ``i`` at levels ``1..l``, i.e. to the chain of positions ``P .. P + l + i``
  it continues. Lookahead rows are never committed and no tree node sees them.

After each step the model's argmax at the last level gives one new token per column; column
``i`` then yields the n-gram ``(level 0, level 1, ..., level L-2 of column i, new token)``
for the pool, and the window moves up a level (the new tokens become the last level). The
pool is keyed by an n-gram's first token and keeps the ``G`` most recent continuations per
key (least recently seen out first), seeded from the prompt's n-grams and fed the n-grams
of the committed output as well (the reference implementation's ``POOL_FROM_PROMPT``).

The window is filled from the prompt at start (random positions, seeded) rather than by
the reference implementation's warm-up steps, so every step has the same lookahead shape.
The verification branch merges guesses that share a prefix into one trie, so a step may
use fewer than ``(L - 1)(W + G)`` positions, never more.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import TYPE_CHECKING

import numpy as np

from ..backend import Backend, StepOut
from ..budgets import lade_shape
from ..errors import ConfigError
from ..plans import Plan

if TYPE_CHECKING:
    from ..config import GenerationConfig


@dataclass(frozen=True)
class LookaheadPlan(Plan):
    """A verification tree (``parents``, no masks) followed by a lookahead window of
    ``levels`` x ``window`` Jacobi cells whose cell ``(0, 0)`` is the root (node 0).

    Block rows: ``[tree nodes, level 0 columns 1..W-1, level 1 columns 0..W-1, ...]``.

    >>> p = LookaheadPlan((-1, 0), 0, levels=2, window=3)   # L = 3, W = 3, one guess node
    >>> p.bc, p.grid.tolist()
    (7, [[0, 2, 3], [4, 5, 6]])
    >>> print(p.render())
    pos  row         0 1 | 2 3 4 5 6
      0  node 0      x . | . . . . .
      1  node 1      x x | . . . . .
      1  look 0.1    x . | x . . . .
      2  look 0.2    x . | x x . . .
      1  look 1.0    x . | . . x . .
      2  look 1.1    x . | x . . x .
      3  look 1.2    x . | x x . . x
    """

    levels: int = 1
    window: int = 1
    grid: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.k != 0:
            raise ConfigError(f"a lookahead plan carries no mask tokens, got k={self.k}")
        if self.levels < 1 or self.window < 1:
            raise ConfigError(f"a lookahead window needs >= 1 level and >= 1 column, got "
                              f"{self.levels} x {self.window}")
        n = len(self.parents)
        grid = np.arange(n - 1, n - 1 + self.levels * self.window,
                         dtype=np.int64).reshape(self.levels, self.window)
        grid[0, 0] = 0  # the root is the window's first cell
        object.__setattr__(self, "grid", grid)
        grid.flags.writeable = False
        super().__post_init__()

    def _window(self) -> tuple[int, int]:
        return self.levels, self.window

    @property
    def bc(self) -> int:
        """Positions in the block: tree nodes plus ``levels * window - 1`` lookahead cells."""
        return self.n_nodes + self.levels * self.window - 1

    def _build_mask(self) -> np.ndarray:
        n = self.n_nodes
        mask = np.zeros((self.bc, self.bc), dtype=bool)
        mask[:n, :n] = super()._build_mask()
        # the window's cells see the root (column 0) and cells only: the same block for every
        # tree, shifted past its nodes
        window = _window_mask(self.levels, self.window)
        mask[n:, 0] = window[1:, 0]
        mask[n:, n:] = window[1:, 1:]
        return mask

    def _build_positions(self) -> np.ndarray:
        # the window's cells follow the tree in the grid's order (row-major, cell (0, 0)
        # being the root): level + column each, the same for every tree (_window_positions)
        return np.concatenate((self.depth, _window_positions(self.levels, self.window)))

    def _labels(self) -> list[str]:
        names = [f"node {i}" for i in range(self.n_nodes)]
        cells = {int(r): f"look {lvl}.{i}" for (lvl, i), r in np.ndenumerate(self.grid)}
        return names + [cells[r] for r in range(self.n_nodes, self.bc)]


@lru_cache(maxsize=64)
def _window_mask(levels: int, window: int) -> np.ndarray:
    """The mask of a window after a one-node tree (row and column 0: the root), read-only."""
    g = np.arange(levels * window, dtype=np.int64).reshape(levels, window)
    mask = np.zeros((levels * window, levels * window), dtype=bool)
    for i in range(window):
        prefix = g[0, :i + 1]  # the root and level 0 up to column i
        for lvl in range(levels):
            if lvl == 0 and i == 0:
                continue  # the root's row belongs to the tree
            mask[g[lvl, i], prefix] = True
            mask[g[lvl, i], g[1:lvl + 1, i]] = True
    mask.flags.writeable = False
    return mask


@lru_cache(maxsize=64)
def _window_positions(levels: int, window: int) -> np.ndarray:
    """Positions (level + column) of a window's cells after its root, in block order.

    >>> _window_positions(2, 3).tolist()
    [1, 2, 1, 2, 3]
    """
    lvl, col = np.indices((levels, window))
    out = (lvl + col).ravel()[1:].astype(np.int64)
    out.flags.writeable = False
    return out


@lru_cache(maxsize=1024)
def lookahead_plan(parents: tuple[int, ...], levels: int, window: int) -> LookaheadPlan:
    """The compiled plan of a guess trie and a window, cached by shape.

    >>> lookahead_plan((-1, 0), 2, 3) is lookahead_plan((-1, 0), 2, 3)
    True
    """
    return LookaheadPlan(parents, 0, levels=levels, window=window)


def guess_trie(root: int, guesses) -> tuple[tuple[int, ...], list[int]]:
    """Merge guessed continuations of ``root`` into one trie, in a plan's depth order.

    >>> guess_trie(5, [(6, 7), (6, 8), (9, 7)])
    ((-1, 0, 0, 1, 1, 2), [5, 6, 9, 7, 8, 7])
    """
    toks, par, dep, kids = [root], [-1], [0], [{}]
    for guess in guesses:
        node = 0
        for t in guess:
            nxt = kids[node].get(t)
            if nxt is None:
                nxt = len(toks)
                kids[node][t] = nxt
                toks.append(t)
                par.append(node)
                dep.append(dep[node] + 1)
                kids.append({})
            node = nxt
    order = sorted(range(len(toks)), key=lambda i: (dep[i], i))
    new = {old: i for i, old in enumerate(order)}
    return tuple(-1 if par[o] < 0 else new[par[o]] for o in order), [toks[o] for o in order]


class NgramPool:
    """LADE's n-gram pool: per first token, the ``size`` most recently seen continuations
    (a continuation seen again moves to the back; the oldest leaves when full).

    >>> pool = NgramPool(size=2)
    >>> for gram in [(1, 2, 3), (1, 4, 5), (1, 2, 3), (1, 6, 7)]:
    ...     pool.add(gram[0], gram[1:])
    >>> pool.get(1)
    [(2, 3), (6, 7)]
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self.table: dict[int, list[tuple[int, ...]]] = {}

    def add(self, key: int, cont: tuple[int, ...]) -> None:
        self.add_many([(key, cont)])

    def add_many(self, grams: list[tuple[int, tuple[int, ...]]]) -> None:
        """:meth:`add` for each ``(key, continuation)`` in order (one call a step: the
        window's columns)."""
        if self.size <= 0:
            return
        table, size = self.table, self.size
        for key, cont in grams:
            row = table.setdefault(key, [])
            if cont in row:
                row.remove(cont)
            elif len(row) >= size:
                del row[0]
            row.append(cont)

    def get(self, key: int) -> list[tuple[int, ...]]:
        return self.table.get(key, [])

    def add_sequence(self, tokens: list[int], n: int, first: int = 0) -> None:
        """Every n-gram of ``tokens`` that starts at or after ``first``."""
        self.add_many([(tokens[s], tuple(tokens[s + 1:s + n]))
                       for s in range(first, len(tokens) - n + 1)])


class MirroredPool(NgramPool):
    """An :class:`NgramPool` whose adds also go to a C mirror
    (:class:`~edgemtp.drafters.ngram_index.NativePool`), for the hybrid's tree grown in C."""

    def __init__(self, size: int, native) -> None:
        super().__init__(size)
        self.native = native

    def add_many(self, grams: list[tuple[int, tuple[int, ...]]]) -> None:
        super().add_many(grams)
        if self.size > 0 and self.native is not None:  # (None: the C grower was dropped)
            self.native.pending.extend((key, *cont) for key, cont in grams)


class JacobiWindow:
    """LADE's lookahead branch: ``levels`` x ``width`` Jacobi iterates whose cell ``(0, 0)``
    is the root, and the pool of the n-grams (``levels + 1`` tokens) their trajectories give.
    Used by :class:`LookaheadDrafter` and by the hybrid drafter."""

    def __init__(self, levels: int, width: int, pool_size: int, seed: int) -> None:
        self.levels, self.width, self.seed = levels, width, seed
        self.pool = NgramPool(pool_size)
        self.cells = np.zeros((levels, width), dtype=np.int64)

    def start(self, prompt: np.ndarray) -> None:
        """Fill the window from the prompt (random positions, seeded); empty the pool."""
        rng = np.random.default_rng(self.seed)
        self.cells = rng.choice(np.asarray(prompt, dtype=np.int64), size=self.cells.shape)
        self.pool = NgramPool(self.pool.size)

    def block(self, tree_parents: tuple[int, ...], tree_tokens) -> tuple[LookaheadPlan,
                                                                          np.ndarray]:
        """The plan of a tree (node 0 the root) with this window after it, and the block's
        ids: the tree's tokens, then the window's cells."""
        plan = lookahead_plan(tree_parents, self.levels, self.width)
        ids = np.empty(plan.bc, dtype=np.int64)
        ids[:plan.n_nodes] = tree_tokens
        self.cells[0, 0] = ids[0]
        ids[plan.grid.ravel()[1:]] = self.cells.ravel()[1:]
        return plan, ids

    def advance(self, plan: LookaheadPlan, argmax: np.ndarray) -> None:
        """After a step: pool every column's n-gram, then move the window up a level (the
        last level's outputs become its new last level)."""
        fresh = argmax[plan.grid[-1]].astype(np.int64)
        cells = self.cells
        self.pool.add_many([(column[0], (*column[1:], last))  # column i: its n-gram
                            for column, last in zip(cells.T.tolist(), fresh.tolist())])
        self.cells = np.concatenate((cells[1:], fresh[None, :]))


class LookaheadDrafter:
    """Lookahead decoding as a drafter (module docstring): each step verifies the pool's
    guesses for the root and advances the Jacobi window in the same forward pass."""

    mask_tokens = 0
    topk = 0

    def __init__(self, backend: Backend, config: GenerationConfig,
                 memory: dict | None = None) -> None:
        self.n, w, g = lade_shape(config.bc, config.lookahead)
        self.jacobi = JacobiWindow(self.n - 1, w, g, config.seed)
        self.history: list[int] = []
        self._plan: LookaheadPlan | None = None

    @property
    def pool(self) -> NgramPool:
        return self.jacobi.pool

    @property
    def window(self) -> np.ndarray:
        return self.jacobi.cells

    def start(self, prompt_ids: np.ndarray) -> None:
        self.jacobi.start(prompt_ids)
        self.history = np.asarray(prompt_ids).tolist()
        self.pool.add_sequence(self.history, self.n)
        self._plan = None

    def propose(self, root: int) -> tuple[LookaheadPlan, np.ndarray]:
        parents, tokens = guess_trie(root, reversed(self.pool.get(root)))  # newest first
        plan, ids = self.jacobi.block(parents, tokens)
        self._plan = plan
        return plan, ids

    def mask_embeds(self) -> None:
        return None

    def observe(self, out: StepOut, mask_rows: np.ndarray, new_tokens: list[int],
                path_rows: np.ndarray) -> None:
        if self._plan is not None:  # a step (not prefill): the window's n-grams, then move
            self.jacobi.advance(self._plan, out.argmax)
            self._plan = None
        self.catch_up(new_tokens)

    def catch_up(self, tokens) -> None:
        """Commit tokens and pool their n-grams, without a step's outputs: one call may
        bring many (auto's dormant drafters catch up in bulk when woken)."""
        start = len(self.history) - self.n + 1
        self.history.extend(tokens)
        self.pool.add_sequence(self.history, self.n, first=max(start, 0))
