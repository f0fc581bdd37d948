"""Plans: block masks, position templates, budgets and the dynamic-plan lookup table.

Every expectation here is computed independently of ``edgemtp.plans`` (by walking parents,
by counting compositions), so a wrong mask or table fails instead of agreeing with itself.
"""

from __future__ import annotations

import math
import textwrap
from contextlib import contextmanager

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgemtp.errors import BudgetError, ConfigError
from edgemtp.budgets import default_branching, nodes_for_budget
from edgemtp import native, plans
from edgemtp.plans import DynamicPlans, Plan, dynamic_plans, dynamic_shapes, static_plan

FAST = settings(max_examples=150, deadline=None)


# -- independent reference --------------------------------------------------------------


def ref_depths(parents) -> list[int]:
    depth = []
    for i, p in enumerate(parents):
        depth.append(0 if p < 0 else depth[p] + 1)
    return depth


def ref_path(parents, i) -> set[int]:
    """Node ``i`` and all its ancestors, by walking parents."""
    out = {i}
    while parents[i] >= 0:
        i = parents[i]
        out.add(i)
    return out


def check_plan(plan: Plan, parents, k: int) -> None:
    """Check every row of the mask, every position and the children lists of ``plan``."""
    parents = tuple(parents)
    n = len(parents)
    depth = ref_depths(parents)
    assert plan.parents == parents
    assert plan.k == k
    assert plan.n_nodes == n
    assert plan.bc == (k + 1) * n
    assert plan.tree_mask.shape == (plan.bc, plan.bc)
    assert plan.tree_mask.dtype == np.bool_
    assert plan.positions.shape == (plan.bc,)
    assert plan.depth.tolist() == depth

    rows_seen = set()
    for i in range(n):
        want = ref_path(parents, i)
        got = set(np.flatnonzero(plan.tree_mask[i]).tolist())
        assert got == want, f"node row {i}: attends {sorted(got)}, expected {sorted(want)}"
        assert plan.positions[i] == depth[i]
        assert plan.path(i) == sorted(want, key=lambda a: depth[a])
        rows_seen.add(i)
        for j in range(1, k + 1):
            r = plan.mask_row(i, j)
            assert r == n + i * k + j - 1
            want_m = want | {n + i * k + jj - 1 for jj in range(1, j + 1)}
            got_m = set(np.flatnonzero(plan.tree_mask[r]).tolist())
            assert got_m == want_m, (f"mask row ({i}, {j}): attends {sorted(got_m)}, "
                                     f"expected {sorted(want_m)}")
            assert plan.positions[r] == depth[i] + j
            rows_seen.add(r)
    assert rows_seen == set(range(plan.bc))  # the mask rows tile the block exactly

    want_children = [[c for c in range(n) if parents[c] == p] for p in range(n)]
    assert [list(c) for c in plan.children] == want_children
    assert plan.counts == tuple(depth.count(d) for d in range(1, max(depth) + 1))

    # compiled once and shared: nobody may scribble on a plan's arrays
    with pytest.raises(ValueError):
        plan.tree_mask[0, 0] = False
    with pytest.raises(ValueError):
        plan.positions[0] = 5


@contextmanager
def compiled_in(where: str):
    """Plans without masks compile in C (ngram.c's plan_tree) from NATIVE_MIN_NODES nodes up:
    ``"c"`` sends every such plan there, ``"python"`` none."""
    if where == "c" and native.lib() is None:
        pytest.skip(f"no native library: {native.why_not()}")
    old = plans.NATIVE_MIN_NODES
    plans.NATIVE_MIN_NODES = 1 if where == "c" else 10 ** 9
    try:
        yield
    finally:
        plans.NATIVE_MIN_NODES = old


# -- random shapes ------------------------------------------------------------------------


@st.composite
def top1_shapes(draw):
    k = draw(st.integers(1, 3))
    counts = draw(st.lists(st.integers(1, 5), min_size=1, max_size=k))
    pad = draw(st.integers(0, k - len(counts)))
    return counts + [0] * pad, k


@st.composite
def general_trees(draw):
    """Random trees with parents[i] < i and non-decreasing depth."""
    n = draw(st.integers(1, 12))
    parents, depth = [-1], [0]
    for i in range(1, n):
        allowed = [p for p in range(i) if depth[p] + 1 >= depth[-1]]
        p = draw(st.sampled_from(allowed))
        parents.append(p)
        depth.append(depth[p] + 1)
    return parents, draw(st.integers(0, 3))


def top1_parents(counts) -> list[int]:
    """Parents of a top-1 shape: every depth-d node hangs under the first depth-(d-1) node."""
    parents, first_above = [-1], 0
    for c in counts:
        if c == 0:
            break
        first_here = len(parents)
        parents += [first_above] * c
        first_above = first_here
    return parents


@FAST
@given(top1_shapes())
def test_top1_plan_mask_rows_positions(shape):
    counts, k = shape
    plan = Plan.top1(counts, k)
    parents = top1_parents(counts)
    check_plan(plan, parents, k)
    assert plan.counts == tuple(c for c in counts if c)
    assert plan.n_nodes == 1 + sum(counts)


@pytest.mark.parametrize("where", ["python", "c"])
@FAST
@given(general_trees())
def test_general_plan_mask_rows_positions(where, tree):
    parents, k = tree
    with compiled_in(where):
        plan = Plan(tuple(parents), k)
    check_plan(plan, parents, k)


@st.composite
def big_trees(draw):
    """Trees of 60-140 nodes (the ancestor bits span one, two or three 64-bit words)."""
    n = draw(st.integers(60, 140))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    depth, parents = [0], [-1]
    for i in range(1, n):  # a parent at the deepest depth so far, or one above it
        allowed = [p for p in range(i) if depth[p] + 1 >= depth[-1]]
        parents.append(int(rng.choice(allowed)))
        depth.append(depth[parents[-1]] + 1)
    return parents, draw(st.integers(0, 1))


@pytest.mark.parametrize("where", ["python", "c"])
@FAST
@given(big_trees())
def test_big_plan_mask_rows_positions(where, tree):
    parents, k = tree
    with compiled_in(where):
        plan = Plan(tuple(parents), k)
    check_plan(plan, parents, k)


@pytest.mark.parametrize("where", ["python", "c"])
def test_plan_refuses_a_tree_out_of_depth_order(where):
    with compiled_in(where):
        with pytest.raises(ConfigError, match="depth order"):
            Plan((-1, 0, 1, 0), 0)
        with pytest.raises(ConfigError, match="earlier node"):
            Plan((-1, 2, 0), 0)
        with pytest.raises(ConfigError, match="node 7 has parent 7"):
            Plan((-1, 0, 0, 1, 1, 2, 2, 7), 0)
        with pytest.raises(ConfigError, match="node 6 has parent -1"):
            Plan((-1, 0, 0, 1, 1, 2, -1), 0)
        with pytest.raises(ConfigError, match="depth order"):
            Plan((-1, 0, 0, 1, 1, 2, 0), 0)


def test_plans_equal_and_hash_by_shape():
    a, b = Plan.top1((2, 1), 1), Plan((-1, 0, 0, 1), 1)
    assert a == b and hash(a) == hash(b)
    assert a != Plan.top1((2, 1), 2)
    assert a != Plan.top1((1, 2), 1)


def test_root_only_plan():
    p = Plan.root_only()
    assert (p.n_nodes, p.k, p.bc, p.counts) == (1, 0, 1, ())
    assert p.tree_mask.tolist() == [[True]]
    assert p.positions.tolist() == [0]


# -- the dynamic lookup table ----------------------------------------------------------


def n_shapes(n: int, k: int) -> int:
    # compositions of the N - 1 draft nodes into d = 1..k positive parts, zeros padded
    return sum(math.comb(n - 2, d - 1) for d in range(1, k + 1))


@pytest.mark.parametrize("bc", [10, 30, 60])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_dynamic_lut_covers_every_shape(bc, k):
    plans = dynamic_plans(bc, k)
    n = bc // (k + 1)
    assert isinstance(plans, DynamicPlans)
    assert plans.n_nodes == n
    assert len(plans) == len(plans.table) == n_shapes(n, k)

    # every composition of N - 1 into at most k parts, independently enumerated
    want = set()

    def compose(left, parts):
        if left == 0:
            want.add(tuple(parts) + (0,) * (k - len(parts)))
            return
        if len(parts) == k:
            return
        for c in range(1, left + 1):
            compose(left - c, parts + [c])

    compose(n - 1, [])
    assert set(plans.table) == want

    for shape, plan in plans.table.items():
        assert len(shape) == k
        assert plan.k == k
        assert plan.n_nodes == n
        assert plan.bc == (k + 1) * n <= bc
        assert plan.counts == tuple(c for c in shape if c)
        depth = plan.depth.tolist()
        for i in range(1, n):
            first_above = depth.index(depth[i] - 1)
            assert plan.parents[i] == first_above, f"shape {shape}: node {i} not top-1"
        assert plans[plan.counts] is plan  # short keys are zero-padded
    assert dynamic_plans(bc, k) is plans  # cached


def test_dynamic_shapes_doc_order():
    assert dynamic_shapes(3, 2) == [(3, 0), (1, 2), (2, 1)]
    assert dynamic_shapes(1, 3) == [(1, 0, 0)]
    assert dynamic_shapes(4, 1) == [(4,)]


def test_dynamic_lut_unknown_shape():
    plans = dynamic_plans(30, 2)
    with pytest.raises(KeyError):
        plans[(3, 3)]  # 6 draft nodes; the budget holds 9


# -- budgets ------------------------------------------------------------------------------


@pytest.mark.parametrize("bc,k,n", [(4, 1, 2), (5, 1, 2), (30, 1, 15), (31, 1, 15),
                                    (30, 2, 10), (60, 2, 20), (62, 2, 20), (8, 3, 2),
                                    (60, 3, 15)])
def test_nodes_for_budget(bc, k, n):
    assert nodes_for_budget(bc, k) == n
    assert (k + 1) * n <= bc < (k + 1) * (n + 1)


@pytest.mark.parametrize("bc,k", [(1, 1), (3, 1), (5, 2), (7, 3), (0, 1)])
def test_budget_too_small(bc, k):
    with pytest.raises(BudgetError, match="too small") as e:
        nodes_for_budget(bc, k)
    assert str(2 * (k + 1)) in str(e.value)  # the least budget that works
    with pytest.raises(BudgetError, match="too small"):
        static_plan(bc, k)
    with pytest.raises(BudgetError, match="too small"):
        dynamic_plans(bc, k)


def test_budget_needs_a_mask_token():
    with pytest.raises(ConfigError):
        nodes_for_budget(30, 0)
    with pytest.raises(ConfigError):
        static_plan(30, 0)


@pytest.mark.parametrize("bc", [4, 10, 30, 31, 60])
def test_static_plan_k1(bc):
    plan = static_plan(bc, 1)
    n = bc // 2
    assert plan.counts == (n - 1,)
    assert plan.bc == 2 * n <= bc
    assert plan.parents == (-1,) + (0,) * (n - 1)


@pytest.mark.parametrize("bc,counts", [(30, (7, 2)), (60, (15, 4))])
def test_static_plan_k2_default_branching(bc, counts):
    assert default_branching(bc, 2) == counts
    plan = static_plan(bc, 2)
    assert plan.counts == counts
    assert plan.bc == bc
    assert plan.parents == tuple(top1_parents(counts))


@pytest.mark.parametrize("bc,k", [(30, 2), (60, 2), (60, 3), (24, 3), (100, 3), (9, 2)])
def test_default_branching_fits_budget(bc, k):
    counts = default_branching(bc, k)
    assert len(counts) == k and all(c >= 1 for c in counts)
    assert 1 + sum(counts) == bc // (k + 1)
    assert list(counts) == sorted(counts, reverse=True)


def test_static_plan_explicit_branching():
    plan = static_plan(30, 2, (5, 4))
    assert plan.counts == (5, 4) and plan.bc == 30
    plan = static_plan(60, 3, (3, 2, 1))
    assert plan.counts == (3, 2, 1) and plan.bc == 28


def test_static_plan_branching_too_big():
    with pytest.raises(BudgetError) as e:
        static_plan(30, 2, (8, 3))  # 3 * (1 + 11) = 36 > 30
    msg = str(e.value)
    assert "36" in msg and "30" in msg
    with pytest.raises(BudgetError, match="99"):
        static_plan(60, 2, (20, 12))  # 3 * 33 = 99


@pytest.mark.parametrize("branching", [(9,), (5, 2, 1), (5, 0), (0, 3)])
def test_static_plan_bad_branching(branching):
    with pytest.raises(ConfigError):
        static_plan(30, 2, branching)


def test_static_plan_budget_holds_fewer_nodes_than_depths():
    # BC 6 with k = 2 holds 2 nodes = 1 draft node, not enough for 2 depths
    with pytest.raises(BudgetError):
        static_plan(6, 2)


# -- invalid trees ------------------------------------------------------------------------


@pytest.mark.parametrize("parents", [
    (),                 # no root
    (0,),               # root with a parent
    (-1, -1),           # two roots
    (-1, 1),            # own parent
    (-1, 2, 0),         # parent after the node
    (-1, 0, 5),         # parent out of range
    (-1, 0, 1, 0),      # depth 2 before depth 1: not depth ordered
    (-1, 0, 1, 2, 1),   # depth 3 before depth 2
])
def test_invalid_parents(parents):
    with pytest.raises(ConfigError):
        Plan(parents, 1)


@pytest.mark.parametrize("counts", [(1, 0, 2), (0, 1), (2, -1), (-1,)])
def test_invalid_top1_counts(counts):
    with pytest.raises(ConfigError):
        Plan.top1(counts, 3)


def test_negative_k():
    with pytest.raises(ConfigError):
        Plan((-1, 0), -1)


# -- render -------------------------------------------------------------------------------

RENDER_EXAMPLE = """\
pos  row         0 1 2 3 | 4 5 6 7
  0  node 0      x . . . | . . . .
  1  node 1      x x . . | . . . .
  1  node 2      x . x . | . . . .
  2  node 3      x x . x | . . . .
  1  mask 0.1    x . . . | x . . .
  2  mask 1.1    x x . . | . x . .
  2  mask 2.1    x . x . | . . x .
  3  mask 3.1    x x . x | . . . x"""


def test_render_worked_example():
    assert Plan.top1((2, 1), k=1).render() == RENDER_EXAMPLE
    assert textwrap.indent(RENDER_EXAMPLE, "    ") in Plan.__doc__


def test_render_k2_rows_follow_the_mask():
    plan = Plan.top1((2, 1), k=2)
    lines = plan.render().splitlines()
    assert len(lines) == 1 + plan.bc
    for r, line in enumerate(lines[1:]):
        pos, _, rest = line.strip().partition("  ")
        assert int(pos) == plan.positions[r]
        cells = rest.split("|")
        marks = [c for c in (cells[0] + " " + cells[1]).split() if c in ("x", ".")]
        assert marks == ["x" if v else "." for v in plan.tree_mask[r]]
    assert lines[plan.mask_row(3, 2) + 1].split()[:3] == ["4", "mask", "3.2"]
