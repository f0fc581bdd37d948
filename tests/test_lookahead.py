"""Lookahead decoding (LADE): its BC accounting, its block mask row by row, every lookahead
row's output against plain decoding of the chain it continues, the window and pool updates,
and exact equality with ``transformers`` greedy decoding on the shared model and on random
configs (the sweep on story prompts lives in ``test_ngram.py`` with the other drafters).
"""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM, AutoTokenizer

from edgemtp import GenerationConfig
from edgemtp.backend import StepOut
from edgemtp.engine import Generation
from edgemtp.errors import BudgetError, ConfigError
from edgemtp.budgets import LADE_CONFIGS, lade_shape
from edgemtp.drafters.lookahead import LookaheadDrafter, LookaheadPlan, guess_trie, lookahead_plan
from edgemtp.plans import Plan
from edgemtp.runtimes.torch_backend import TorchBackend

from conftest import family_configs, story_prompts
from test_plans import compiled_in

# -- BC accounting ----------------------------------------------------------------------------


def test_paper_configurations_and_budgets():
    assert LADE_CONFIGS == {10: (3, 4, 1), 30: (4, 5, 5), 60: (5, 8, 7)}
    for bc in range(3, 121):
        n, w, g = lade_shape(bc)
        assert n >= 2 and w >= 1 and g >= 1
        assert (n - 1) * (w + g) <= bc, bc  # never above the budget
        assert (n - 1) * (w + g) > bc - (n - 1), bc  # and no wasted row of the window
    for bc in (1, 2):
        with pytest.raises(BudgetError, match="at least 3"):
            lade_shape(bc)
    assert lade_shape(12, (3, 4, 2)) == (3, 4, 2)
    with pytest.raises(BudgetError, match="needs BC"):
        lade_shape(11, (3, 4, 2))
    with pytest.raises(ConfigError, match="L >= 2"):
        lade_shape(30, (1, 4, 2))
    with pytest.raises(ConfigError, match="three integers"):
        GenerationConfig(drafter="lade", lookahead=(3, 4))
    with pytest.raises(ConfigError, match="only applies"):
        GenerationConfig(drafter="probe", lookahead=(3, 4, 1))
    with pytest.raises(BudgetError):
        GenerationConfig(drafter="lade", bc=30, lookahead=(5, 8, 7))


# -- the block mask, row by row ---------------------------------------------------------------


def _ancestors(parents, i):
    out = {i}
    while parents[i] >= 0:
        i = parents[i]
        out.add(i)
    return out


def check_lookahead_plan(plan: LookaheadPlan, parents, levels: int, window: int) -> None:
    """Every row's attended set and position, from the rule in words (module docstring of
    ``edgemtp.lookahead``), independently of how the plan builds them."""
    n = len(parents)
    assert plan.bc == n + levels * window - 1
    assert plan.tree_mask.shape == (plan.bc, plan.bc) and plan.tree_mask.dtype == np.bool_
    tree = Plan(tuple(parents), 0)
    # row of cell (l, i): level 0 columns 1.. first, then whole levels, after the tree nodes
    cell = {(0, 0): 0}
    r = n
    for lvl in range(levels):
        for i in range(window):
            if (lvl, i) != (0, 0):
                cell[lvl, i] = r
                r += 1
    assert plan.grid.tolist() == [[cell[lvl, i] for i in range(window)] for lvl in range(levels)]
    rows_seen = set()
    for i in range(n):  # tree rows: their ancestors only, never a lookahead row
        got = set(np.flatnonzero(plan.tree_mask[i]).tolist())
        assert got == _ancestors(parents, i), f"node row {i}"
        assert plan.positions[i] == tree.positions[i]
        rows_seen.add(i)
    for (lvl, i), row in cell.items():
        if row == 0:
            continue
        want = {cell[0, c] for c in range(i + 1)} | {cell[m, i] for m in range(1, lvl + 1)}
        got = set(np.flatnonzero(plan.tree_mask[row]).tolist())
        assert got == want, f"lookahead row ({lvl}, {i}): attends {sorted(got)}, want {sorted(want)}"
        assert plan.positions[row] == lvl + i
        # the attended rows are one chain of consecutive positions ending at the row itself
        assert sorted(plan.positions[sorted(want)].tolist()) == list(range(lvl + i + 1))
        rows_seen.add(row)
    assert rows_seen == set(range(plan.bc))
    assert plan.children == tree.children  # the verifier walks the tree part only
    with pytest.raises(ValueError):
        plan.tree_mask[0, 0] = False


@st.composite
def trees_and_windows(draw):
    """A tree of 1-70 nodes in depth order (parents[i] < i) and a window of 1-4 x 1-13."""
    n = draw(st.integers(1, 70))
    rng = np.random.default_rng(draw(st.integers(0, 2 ** 32 - 1)))
    parents, depth = [-1], [0]
    for i in range(1, n):
        allowed = [p for p in range(i) if depth[p] + 1 >= depth[-1]]
        parents.append(int(rng.choice(allowed)))
        depth.append(depth[parents[-1]] + 1)
    return tuple(parents), draw(st.integers(1, 4)), draw(st.integers(1, 13))


@pytest.mark.parametrize("where", ["python", "c"])
@settings(max_examples=100, deadline=None)
@given(trees_and_windows())
def test_lookahead_plan_compiled_in_python_and_in_c(where, case):
    # (a plan of a tree without masks compiles in C from plans.NATIVE_MIN_NODES nodes up:
    # both ways checked row by row against the rule)
    parents, levels, window = case
    with compiled_in(where):
        plan = LookaheadPlan(parents, 0, levels=levels, window=window)
    check_lookahead_plan(plan, parents, levels, window)


@st.composite
def tries(draw):
    levels = draw(st.integers(1, 4))
    window = draw(st.integers(1, 8))
    guesses = draw(st.lists(st.lists(st.integers(0, 3), min_size=levels, max_size=levels),
                            max_size=6))
    return levels, window, [tuple(g) for g in guesses]


@settings(max_examples=150, deadline=None)
@given(tries())
def test_lookahead_plan_row_by_row(case):
    levels, window, guesses = case
    parents, tokens = guess_trie(9, guesses)
    plan = lookahead_plan(parents, levels, window)
    check_lookahead_plan(plan, parents, levels, window)
    # the trie holds each guess as a path, once, and nothing else
    paths = set()
    for i in range(1, len(parents)):
        path = sorted(_ancestors(parents, i) - {0}, key=lambda a: plan.depth[a])
        paths.add(tuple(tokens[a] for a in path))
    assert {g[:d] for g in guesses for d in range(1, len(g) + 1)} == paths
    for kids in plan.children:
        assert len({tokens[c] for c in kids}) == len(kids)


def test_paper_plans_use_exactly_their_budget():
    for bc, (n, w, g) in LADE_CONFIGS.items():
        guesses = [tuple(range(10 * j, 10 * j + n - 1)) for j in range(g)]  # disjoint guesses
        plan = lookahead_plan(guess_trie(1, guesses)[0], n - 1, w)
        assert plan.bc == (n - 1) * (w + g) == bc


# -- on a real model ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stories(stories_path, stories_refs):
    tok = AutoTokenizer.from_pretrained(stories_path)
    return TorchBackend.from_model(stories_refs[0]), tok


@pytest.mark.parametrize("bc", [10, 30, 60])
def test_every_row_equals_plain_decoding_of_its_chain(stories, bc):
    """A lookahead cell must see exactly the chain it continues, at the right positions: its
    logits equal those of a plain causal forward of the prompt plus that chain."""
    backend, tok = stories
    prompt = tok("Tom saw a big dog. The dog ran to Tom. Tom saw a big dog. The").input_ids
    config = GenerationConfig(drafter="lade", bc=bc)
    drafter = LookaheadDrafter(backend, config)
    drafter.start(np.array(prompt))
    t, session, plain = len(prompt), backend.session(), backend.session()
    out = session.forward(np.array(prompt), np.arange(t), np.tril(np.ones((t, t), bool)), None)
    session.commit(np.arange(t))
    root = int(out.argmax[-1])
    plan, ids = drafter.propose(root)
    assert plan.n_nodes > 1  # the prompt's n-grams give the root guesses to verify
    step = session.forward(ids, plan.positions + t, plan.tree_mask, None, full_logits=True)
    for row in range(plan.bc):
        chain = sorted(np.flatnonzero(plan.tree_mask[row]), key=lambda c: plan.positions[c])
        seq = np.array(prompt + ids[chain].tolist())
        plain.reset()
        ref = plain.forward(seq, np.arange(len(seq)), np.tril(np.ones((len(seq),) * 2, bool)),
                            None, full_logits=True)
        np.testing.assert_allclose(step.logits[row], ref.logits[-1], atol=1e-4, rtol=0,
                                   err_msg=f"row {row}")


def test_window_moves_up_a_level_and_feeds_the_pool():
    config = GenerationConfig(drafter="lade", bc=30)  # L 4, W 5, G 5
    d = LookaheadDrafter(None, config)
    d.start(np.array([11, 12, 13, 14, 15, 16, 17]))
    assert d.window.shape == (3, 5)
    assert set(d.window.ravel().tolist()) <= set(range(11, 18))  # filled from the prompt
    assert d.pool.get(11) == [(12, 13, 14)]                      # the prompt's 4-grams
    d.observe(None, np.zeros(0, np.int64), [40], np.arange(7))  # prefill committed 40
    assert d.pool.get(15) == [(16, 17, 40)]
    before = d.window.copy()
    plan, ids = d.propose(40)
    assert plan.n_nodes == 1 and ids[0] == 40                    # nothing known after 40
    assert ids[plan.grid.ravel()[1:]].tolist() == before.ravel()[1:].tolist()
    argmax = np.zeros(plan.bc, dtype=np.int64)
    argmax[plan.grid[-1]] = [50, 51, 52, 53, 54]                 # the last level's outputs
    empty = np.zeros((plan.bc, 0))
    d.observe(StepOut(argmax, empty.astype(np.int64), empty), np.zeros(0, np.int64), [41],
              np.array([0]))
    assert d.window[:2].tolist() == before[1:].tolist()
    assert d.window[2].tolist() == [50, 51, 52, 53, 54]
    for i in range(5):  # column i's n-gram: level 0 (the root in column 0), 1, 2, output
        key = 40 if i == 0 else int(before[0, i])
        assert (int(before[1, i]), int(before[2, i]), 50 + i) in d.pool.get(key)
    assert d.pool.get(16) == [(17, 40, 41)]                      # committed output n-grams


@pytest.mark.slow  # the default run checks LADE on the stories in test_onnx_backend
def test_lossless_on_stories_with_other_shapes(stories, stories_refs):
    backend, _ = stories
    _, prompts, refs = stories_refs  # transformers' own greedy decoding
    prompts, refs = prompts[:6], refs[:6]
    for bc, shape in ((3, None), (7, None), (20, None), (24, (2, 8, 4)), (60, (7, 6, 4))):
        config = GenerationConfig(drafter="lade", bc=bc, lookahead=shape)
        for ids, ref in zip(prompts, refs):
            result = Generation(backend, config, ids).run()
            assert result.token_ids == ref, (bc, shape)


def test_sampling_draws_the_same_tokens_as_plain_sampling(stories):
    backend, tok = stories
    for seed, text in enumerate(story_prompts(3)):
        ids = tok(text).input_ids
        config = GenerationConfig(max_new_tokens=48, temperature=0.9, top_k=20, seed=seed)
        plain = Generation(backend, config.with_(drafter="none"), ids).run().token_ids
        for bc in (10, 60):
            got = Generation(backend, config.with_(drafter="lade", bc=bc), ids).run().token_ids
            assert got == plain, (bc, seed)


@pytest.mark.parametrize("family", ["llama3", "qwen2", "qwen3", "mistral"])
def test_equals_transformers_greedy_on_random_configs(family, tmp_path):
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(family_configs()[family]).eval()
    hf.save_pretrained(tmp_path)
    backend = TorchBackend(str(tmp_path))
    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, 250, size=n).tolist() for n in (2, 9, 30)]
    prompts.append(rng.integers(3, 250, size=5).tolist() * 4)
    for ids in prompts:
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=64, do_sample=False)
        ref = ref[0, len(ids):].tolist()
        for bc in (10, 30, 60):
            got = Generation(backend, GenerationConfig(max_new_tokens=64, bc=bc, drafter="lade"),
                             ids).run().token_ids
            assert got == ref, (family, bc, len(ids))
