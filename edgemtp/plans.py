"""Plans: a tree shape compiled once into its block mask and position template.

A block of one decode step holds ``T = (k + 1) * N`` positions::

    [root, draft nodes in depth order (top-1 first at each depth), k masks per node, node-major]

- node ``i`` attends to the cache, its ancestors and itself;
- mask ``(i, j)`` attends to the cache, node ``i``'s path and masks ``(i, 1..j)``;
- node ``i`` sits at position ``P + depth(i)``, mask ``(i, j)`` at ``P + depth(i) + j``.

The plan stores only the block-internal ``[T, T]`` mask and the position template with
``P = 0``; a step shifts the template by the cache length and the backend prepends the
all-visible cache columns, so no mask is ever built on the decode path (paper App. E).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from functools import cached_property, lru_cache

import numpy as np

from . import native
from .budgets import default_branching, dynamic_table_size, nodes_for_budget
from .errors import BudgetError, ConfigError


NATIVE_MIN_NODES = 6  # trees of fewer nodes compile in Python (a C call costs more there)
_NATIVE: list = []  # [ngram.c's library or None], once looked up


def frozen(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


@dataclass(frozen=True)
class Plan:
    """A tree of ``N`` nodes (node 0 is the root) with ``k`` mask tokens per node.

    ``parents[i]`` is node ``i``'s parent (``-1`` for the root); nodes are in depth order.

    >>> p = Plan.top1((2, 1), k=1)     # root, two depth-1 nodes, one depth-2 under the best
    >>> p.n_nodes, p.bc, p.counts
    (4, 8, (2, 1))
    >>> print(p.render())
    pos  row         0 1 2 3 | 4 5 6 7
      0  node 0      x . . . | . . . .
      1  node 1      x x . . | . . . .
      1  node 2      x . x . | . . . .
      2  node 3      x x . x | . . . .
      1  mask 0.1    x . . . | x . . .
      2  mask 1.1    x x . . | . x . .
      2  mask 2.1    x . x . | . . x .
      3  mask 3.1    x x . x | . . . x
    """

    parents: tuple[int, ...]
    k: int
    depth: np.ndarray = field(init=False, repr=False, compare=False)
    tree_mask: np.ndarray = field(init=False, repr=False, compare=False)
    positions: np.ndarray = field(init=False, repr=False, compare=False)
    children: tuple[tuple[int, ...], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        parents = tuple(map(int, self.parents))
        object.__setattr__(self, "parents", parents)
        if not parents or parents[0] != -1:
            raise ConfigError(f"a plan's node 0 must be the root (parent -1), got parents {parents[:4]}")
        if self.k < 0:
            raise ConfigError(f"mask tokens per node must be >= 0, got {self.k}")
        if self.k == 0 and len(parents) >= NATIVE_MIN_NODES and self._compile_native(parents):
            return
        # plain Python over the parents (lookup drafters compile a new tree shape on many
        # steps: a numpy call per node cost 20-60 us a plan on a 2-core CPU)
        depth = [0] * len(parents)
        kids: list[list[int]] = [[] for _ in parents]
        for i in range(1, len(parents)):
            p = parents[i]
            if not 0 <= p < i:
                raise ConfigError(f"node {i} has parent {p}; a parent must be an earlier node")
            depth[i] = depth[p] + 1
            if depth[i] < depth[i - 1]:
                raise ConfigError(f"nodes must be in depth order, got depths {depth[:i + 1]}")
            kids[p].append(i)
        object.__setattr__(self, "depth", frozen(np.array(depth, dtype=np.int64)))
        object.__setattr__(self, "children", tuple(map(tuple, kids)))
        object.__setattr__(self, "tree_mask", frozen(self._build_mask()))
        object.__setattr__(self, "positions", frozen(self._build_positions()))

    @cached_property
    def counts(self) -> tuple[int, ...]:
        """Nodes per depth (depth 1 first); computed when first asked (lookup trees, a new
        shape most steps, are never asked)."""
        return tuple(np.bincount(self.depth, minlength=2)[1:].tolist()) if len(self.depth) > 1 \
            else ()

    def _window(self) -> tuple[int, int]:
        """(levels, columns) of a lookahead window after the tree; (0, 0): none."""
        return 0, 0

    def _compile_native(self, parents: tuple[int, ...]) -> bool:
        # a tree without masks (lookup and hybrid trees, a new shape most steps) compiled in C
        # (ngram.c's plan_tree): the same depths, mask and positions as the Python below, in
        # less host time. False where the library is not there or the parents are invalid
        # (the Python then says how)
        if not _NATIVE:  # (asked once a process: the environment lookup costs ~10 us a step)
            _NATIVE.append(native.lib())
        lib = _NATIVE[0]
        if lib is None:
            return False
        levels, width = self._window()
        n, t = len(parents), self.bc
        # one buffer for the parents in and the depths, positions and mask out (each address
        # asked of numpy costs ~1 us): views of it are what the plan keeps
        buf = np.empty(16 * n + 8 * t + t * t, dtype=np.uint8)
        at = buf.ctypes.data
        ints = buf[:16 * n + 8 * t].view(np.int64)
        ints[:n] = parents
        depth = ints[n:2 * n]
        if lib.plan_tree(at, n, levels, width, at + 16 * n + 8 * t, at + 8 * n, at + 16 * n):
            return False
        kids: list[list[int]] = [[] for _ in parents]
        for i in range(1, n):
            kids[parents[i]].append(i)
        object.__setattr__(self, "depth", frozen(depth))
        object.__setattr__(self, "children", tuple(map(tuple, kids)))
        object.__setattr__(self, "tree_mask",
                           frozen(buf[16 * n + 8 * t:].view(bool).reshape(t, t)))
        object.__setattr__(self, "positions", frozen(ints[2 * n:]) if levels else depth)
        return True

    # -- construction -------------------------------------------------------------------

    @classmethod
    def top1(cls, counts: tuple[int, ...] | list[int], k: int) -> "Plan":
        """Top-1 expansion: ``counts[d-1]`` nodes at depth ``d``, all under the best node of
        depth ``d-1`` (the first one, since nodes are ranked). Trailing zeros are allowed."""
        counts = tuple(int(c) for c in counts)
        if any(c < 0 for c in counts):
            raise ConfigError(f"node counts per depth must be >= 0, got {list(counts)}")
        nz = [c for c in counts if c > 0]
        if counts[: len(nz)] != tuple(nz):
            raise ConfigError(f"a depth needs a node at the depth above it, got counts {list(counts)}")
        parents, first_above = [-1], 0
        for c in nz:
            first_here = len(parents)
            parents.extend([first_above] * c)
            first_above = first_here
        return cls(tuple(parents), k)

    @classmethod
    def root_only(cls) -> "Plan":
        """Plain autoregressive decoding: one position, BC = 1."""
        return cls((-1,), 0)

    # -- shape ---------------------------------------------------------------------------

    @property
    def n_nodes(self) -> int:
        return len(self.parents)

    @property
    def bc(self) -> int:
        """Block complexity, paper eq. 5: ``(k + 1) * N``."""
        return (self.k + 1) * self.n_nodes

    def mask_row(self, node: int, j: int) -> int:
        """Block row of mask ``j`` (1-based) of ``node``."""
        return self.n_nodes + node * self.k + (j - 1)

    def path(self, node: int) -> list[int]:
        """Nodes from the root to ``node``, both included."""
        out = [node]
        while self.parents[out[-1]] >= 0:
            out.append(self.parents[out[-1]])
        return out[::-1]

    # -- compilation (once per plan) --------------------------------------------------------

    def _build_mask(self) -> np.ndarray:
        n, k = self.n_nodes, self.k
        # each node's ancestors (itself included) as the bits of a Python int, unpacked once
        bits = [0] * n
        for i, p in enumerate(self.parents):
            bits[i] = (bits[p] if p >= 0 else 0) | (1 << i)
        if n <= 64:
            packed = np.array(bits, dtype="<u8").view(np.uint8).reshape(n, 8)
        else:
            words = (n + 63) // 64
            packed = np.array([[(b >> (64 * w)) & 0xFFFFFFFFFFFFFFFF for w in range(words)]
                               for b in bits], dtype="<u8").view(np.uint8)
        anc = np.ascontiguousarray(
            np.unpackbits(packed, axis=1, bitorder="little")[:, :n].view(bool))
        if k == 0:  # a plain tree (lookup drafters build one most steps)
            return anc
        mask = np.zeros((self.bc, self.bc), dtype=bool)
        mask[:n, :n] = anc
        causal = np.tril(np.ones((k, k), dtype=bool))
        for i in range(n):
            rows = slice(n + i * k, n + (i + 1) * k)
            mask[rows, :n] = anc[i]
            mask[rows, rows] = causal
        return mask

    def _build_positions(self) -> np.ndarray:
        if self.k == 0:
            return self.depth  # (read-only: the same array serves both)
        masks = (self.depth[:, None] + np.arange(1, self.k + 1)[None, :]).reshape(-1)
        return np.concatenate([self.depth, masks]).astype(np.int64)

    def _labels(self) -> list[str]:
        return ([f"node {i}" for i in range(self.n_nodes)]
                + [f"mask {i}.{j}" for i in range(self.n_nodes) for j in range(1, self.k + 1)])

    def render(self) -> str:
        """ASCII picture of the block mask (``x`` = attends), for docs and debugging."""
        n, labels = self.n_nodes, self._labels()
        head = " ".join(str(c % 10) for c in range(n)) + " | " + " ".join(
            str(c % 10) for c in range(n, self.bc))
        lines = [f"pos  row         {head}"]
        for r in range(self.bc):
            cells = ["x" if v else "." for v in self.tree_mask[r]]
            lines.append(f"{self.positions[r]:>3}  {labels[r]:<11} "
                         + " ".join(cells[:n]) + " | " + " ".join(cells[n:]))
        return "\n".join(line.rstrip() for line in lines)


def static_plan(bc: int, k: int, branching: tuple[int, ...] | None = None) -> Plan:
    """The static plan a budget allows: ``[N-1]`` for k = 1, ``branching`` (or the default
    one) for k >= 2. An installed plan (a package's) first, else compiled once per process
    (plans are immutable)."""
    installed = _INSTALLED.get((bc, k)) if branching is None else None
    return installed[0] if installed else _static_plan(bc, k, branching)


@lru_cache(maxsize=256)
def _static_plan(bc: int, k: int, branching: tuple[int, ...] | None) -> Plan:
    n = nodes_for_budget(bc, k)
    if k == 1 and branching is None:
        return Plan.top1((n - 1,), k)
    counts = tuple(branching) if branching is not None else default_branching(bc, k)
    if len(counts) != k or any(c < 1 for c in counts):
        raise ConfigError(f"a static branching for k={k} needs {k} counts >= 1, got {list(counts)}")
    plan = Plan.top1(counts, k)
    if plan.bc > bc:
        raise BudgetError(f"branching {list(counts)} with k={k} needs BC {plan.bc} = "
                          f"{k + 1}*(1+{sum(counts)}), above the budget {bc}")
    return plan


def dynamic_shapes(n_draft: int, k: int) -> list[tuple[int, ...]]:
    """Every top-1 shape with ``n_draft`` draft nodes over at most ``k`` depths.

    >>> dynamic_shapes(3, 2)
    [(3, 0), (1, 2), (2, 1)]
    """
    shapes = []
    for depths in range(1, k + 1):
        for cuts in itertools.combinations(range(1, n_draft), depths - 1):
            edges = (0, *cuts, n_draft)
            shapes.append(tuple(b - a for a, b in zip(edges, edges[1:])) + (0,) * (k - depths))
    return shapes


@dataclass(frozen=True)
class DynamicPlans:
    """Lookup table of every plan a budget allows for dynamic trees (Algorithm 1), compiled
    once at load time: a step picks its shape by the node counts per depth."""

    bc: int
    k: int
    table: dict | None = field(default=None, repr=False, compare=False)  # None: compile it

    def __post_init__(self) -> None:
        dynamic_table_size(self.bc, self.k)  # refuses a table too large to compile
        shapes = dynamic_shapes(nodes_for_budget(self.bc, self.k) - 1, self.k)
        if self.table is None:
            object.__setattr__(self, "table", {s: Plan.top1(s, self.k) for s in shapes})
        elif list(self.table) != shapes or any(
                p.k != self.k or p.counts + (0,) * (self.k - len(p.counts)) != s
                for s, p in self.table.items()):
            raise ConfigError(f"a plan table for bc={self.bc} k={self.k} must hold the "
                              f"{len(shapes)} top-1 shapes {shapes[:3]}... in order, got "
                              f"{list(self.table)[:3]}...")

    @property
    def n_nodes(self) -> int:
        return nodes_for_budget(self.bc, self.k)

    def __getitem__(self, counts: tuple[int, ...]) -> Plan:
        plan = self.table.get(counts)  # a step passes all k counts: no padding on the hot path
        return plan if plan is not None else self.table[counts + (0,) * (self.k - len(counts))]

    def __len__(self) -> int:
        return len(self.table)


def dynamic_plans(bc: int, k: int) -> DynamicPlans:
    """The installed :class:`DynamicPlans` (a package's), else compiled once per process
    (plans are immutable, so sharing is safe)."""
    installed = _INSTALLED.get((bc, k))
    return installed[1] if installed else _dynamic_plans(bc, k)


@lru_cache(maxsize=64)
def _dynamic_plans(bc: int, k: int) -> DynamicPlans:
    return DynamicPlans(bc, k)


# plans read from a package (runtimes.package checks them equal to the compiled ones first),
# served by static_plan / dynamic_plans in place of compiling: (bc, k) -> (static, dynamic)
_INSTALLED: dict[tuple[int, int], tuple[Plan, DynamicPlans]] = {}


def install(bc: int, k: int, static: Plan, dynamic: DynamicPlans) -> None:
    """Serve ``static_plan(bc, k)`` and ``dynamic_plans(bc, k)`` from these plans from now on."""
    if static.k != k or static.bc > bc or (dynamic.bc, dynamic.k) != (bc, k):
        raise ConfigError(f"plans to install for bc={bc} k={k} must be of that budget, got a "
                          f"static plan of T={static.bc} k={static.k} and a dynamic table "
                          f"for bc={dynamic.bc} k={dynamic.k}")
    _INSTALLED[(bc, k)] = (static, dynamic)
