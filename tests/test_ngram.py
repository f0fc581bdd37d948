"""The n-gram drafters (PLD, STAND, hybrid; LADE's own tests are in ``test_lookahead.py``):
exactly the tokens of ``transformers`` greedy decoding on the shared model and on random
configs at every BC, their trees row by row, and the hybrid's block efficiency against every
single drafter (probing, PLD, STAND, LADE) on the same prompts.
"""

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from edgemtp import GenerationConfig
from edgemtp.engine import Generation
from edgemtp.drafters import hybrid as H
from edgemtp.drafters.lookahead import LookaheadPlan
from edgemtp.budgets import hybrid_window
from edgemtp.drafters.prompt_lookup import PromptLookupDrafter
from edgemtp.runtimes.torch_backend import TorchBackend

from conftest import QUICK, family_configs
from test_lookahead import check_lookahead_plan
from test_plans import check_plan

N_PROMPTS, NEW_TOKENS, BCS = 24, 128, (10, 30, 60)
QUICK_BCS = (10, 60)
LOOKUP = ("pld", "stand", "hybrid")
SINGLE = ("probe", "pld", "stand", "lade")  # the drafters the hybrid must beat


@pytest.fixture(scope="module")
def stories(stories_path, stories_refs):
    hf, prompts, refs = stories_refs
    return (TorchBackend.from_model(hf), AutoTokenizer.from_pretrained(stories_path),
            prompts[:N_PROMPTS], refs)


def _sweep(stories, n: int, drafters=(*SINGLE, "hybrid"), bcs=BCS) -> dict:
    """Every drafter at every BC over the first ``n`` prompts: outputs and BE. Each run keeps
    one drafter memory across its prompts, as a loaded ``Model`` does. Probing uses k = 1,
    its best on this model at every BC."""
    backend, _, prompts, _ = stories
    prompts = prompts[:n]
    out = {}
    for drafter in drafters:
        for bc in bcs:
            config = GenerationConfig(max_new_tokens=NEW_TOKENS, bc=bc, drafter=drafter)
            memory, outputs, calls, tokens = {}, [], 0, 0
            for ids in prompts:
                r = Generation(backend, config, ids, memory=memory).run()
                outputs.append(r.token_ids)
                calls += r.stats.forward_calls
                tokens += r.stats.new_tokens
            out[drafter, bc] = outputs, tokens / calls
    return out


@pytest.fixture(scope="module")
def sweep(stories):
    return _sweep(stories, N_PROMPTS)


@pytest.fixture(scope="module")
def quick_sweep(stories):
    # the default run's check: the drafters this module owns (probing has test_lossless),
    # on the first 4 prompts at the narrowest and widest budget; the slow pass sweeps all 24
    # prompts, every BC and every single drafter
    return _sweep(stories, min(QUICK, 4), (*LOOKUP, "lade"), QUICK_BCS)


def _first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@pytest.mark.parametrize("bc", QUICK_BCS)
@pytest.mark.parametrize("drafter", (*LOOKUP, "lade"))
def test_equals_transformers_greedy_on_stories(stories, quick_sweep, drafter, bc):
    _check_sweep(stories, quick_sweep, drafter, bc)


@pytest.mark.slow
@pytest.mark.parametrize("bc", BCS)
@pytest.mark.parametrize("drafter", (*LOOKUP, "lade"))
def test_equals_transformers_greedy_on_all_stories(stories, sweep, drafter, bc):
    _check_sweep(stories, sweep, drafter, bc)


def _check_sweep(stories, sweep, drafter, bc):
    refs = stories[3]
    outputs, be = sweep[drafter, bc]
    for i, (got, ref) in enumerate(zip(outputs, refs)):
        assert got == ref, (f"{drafter} BC={bc}: prompt {i} differs from greedy at token "
                            f"{_first_difference(got, ref)}")
    assert be > 1.3, f"{drafter} BC={bc}: BE {be:.3f}; lookup must accept drafts on this model"


@pytest.mark.slow
def test_hybrid_beats_every_single_drafter_at_every_budget(sweep):
    be = {key: value[1] for key, value in sweep.items()}
    table = "; ".join(f"BC {bc}: " + ", ".join(f"{d} {be[d, bc]:.3f}"
                                               for d in (*SINGLE, "hybrid")) for bc in BCS)
    for bc in BCS:
        best = max(be[d, bc] for d in SINGLE)
        assert be["hybrid", bc] >= best, table
        if bc >= 30:  # the bar: 1.1x the best single drafter at BC 30 and 60
            assert be["hybrid", bc] >= 1.1 * best, table


# -- the trees each drafter proposes -----------------------------------------------------------


def _proposals(backend, config, ids):
    """Run one generation and return every (plan, tokens, mask rows per node) it proposed."""
    gen = Generation(backend, config, ids)
    drafter, seen = gen.drafter, []
    propose = drafter.propose

    def recording(root):
        plan, tokens = propose(root)
        seen.append((plan, tokens.copy(), dict(getattr(drafter, "_masks_of", {}))))
        return plan, tokens

    drafter.propose = recording
    result = gen.run()
    return seen, result


@pytest.mark.parametrize("bc", [10, 30, 60])
def test_stand_trees_row_by_row(stories, bc):
    backend, _, prompts, refs = stories
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, bc=bc, drafter="stand")
    branched = 0
    for ids, ref in zip(prompts[:4], refs):
        seen, result = _proposals(backend, config, ids)
        assert result.token_ids == ref
        for plan, tokens, _ in seen:
            check_plan(plan, plan.parents, 0)  # every row attends to exactly its ancestors
            assert plan.bc == plan.n_nodes <= bc
            assert plan.depth.max() <= 10
            assert np.all((tokens >= 0) & (tokens < backend.vocab_size))
            for kids in plan.children:  # a repeated child would be a wasted position
                assert len({int(tokens[c]) for c in kids}) == len(kids)
            branched += any(len(k) > 1 for k in plan.children)
    if bc > 10:
        assert branched > 0  # with room, the trees do branch


@pytest.mark.parametrize("drafter", ["stand", "hybrid"])
def test_the_stored_distributions_are_those_of_the_committed_rows(stories, drafter):
    """qa10a DR3: STAND stored the top-K of the block's first rows rather than of the accepted
    path's, and only its BE (1.69 -> 1.55, above its bound) moved. Greedy decoding commits
    the model's argmax, so the distribution stored at every generated position must have the
    next committed token on top."""
    backend, _, prompts, refs = stories
    gen = Generation(backend, GenerationConfig(max_new_tokens=NEW_TOKENS, bc=60,
                                               drafter=drafter), prompts[0])
    result = gen.run()
    assert result.token_ids == refs[0]
    assert max(result.stats.accept_lengths) >= 2  # paths whose rows are not the block's first
    d = gen.drafter.context.dists
    d._flush()
    ids = [*prompts[0], *result.token_ids]
    # (the last step, which reached max_new_tokens, is not observed)
    assert len(ids) - 1 - max(result.stats.accept_lengths) - 1 <= d.size < len(ids)
    for p in range(len(prompts[0]) - 1, d.size):
        assert d.ids[p, 0] == ids[p + 1], p


@pytest.mark.parametrize("bc,k", [(10, 1), (30, 1), (60, 1), (60, 2)])
def test_hybrid_trees_row_by_row_with_mask_leaves(stories, bc, k):
    backend, _, prompts, refs = stories
    vocab = backend.vocab_size
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, bc=bc, mask_tokens=k, drafter="hybrid")
    with_masks = windowed = steps = 0
    for ids, ref in zip(prompts[:4], refs):
        seen, result = _proposals(backend, config, ids)
        steps += len(seen)
        assert result.token_ids == ref
        for plan, tokens, masks_of in seen:
            if isinstance(plan, LookaheadPlan):  # the tree, then the Jacobi window's cells
                assert (plan.levels, plan.window) == hybrid_window(bc)
                check_lookahead_plan(plan, plan.parents, plan.levels, plan.window)
                windowed += 1
                tokens = tokens[:plan.n_nodes]
            else:
                check_plan(plan, plan.parents, 0)
            assert plan.bc <= bc
            is_mask = tokens >= vocab
            for node, rows in masks_of.items():
                # mask j of a node: a leaf chain under it at depth + j with slot id vocab + j - 1
                assert not is_mask[node]
                assert tokens[rows].tolist() == [vocab + j for j in range(k)]
                assert plan.parents[rows[0]] == node
                assert [plan.parents[r] for r in rows[1:]] == rows[:-1].tolist()
                assert plan.depth[rows].tolist() == [plan.depth[node] + 1 + j for j in range(k)]
                assert not plan.children[rows[-1]]
            owned = sorted(int(r) for rows in masks_of.values() for r in rows)
            assert owned == np.flatnonzero(is_mask).tolist()  # no stray mask slot
            with_masks += bool(masks_of)
    assert with_masks > 0
    assert windowed == (steps if hybrid_window(bc) else 0)


# -- PLD ----------------------------------------------------------------------------------------


def _pld_after(context: list[int], bc: int):
    d = PromptLookupDrafter(None, GenerationConfig(bc=bc, drafter="pld"))
    d.start(np.array(context[:-1]))
    d.observe(None, np.zeros(0, dtype=np.int64), [context[-1]], np.arange(len(context) - 1))
    return d.propose(context[-1])


def test_pld_proposes_what_followed_the_last_match():
    context = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 1, 2, 3]  # "1 2 3" seen at 0..2
    plan, tokens = _pld_after(context, bc=10)
    assert tokens.tolist() == [3, 4, 5, 6, 7, 8, 9, 10, 11, 12]    # 9 draft nodes: BC 10
    assert plan.parents == (-1, 0, 1, 2, 3, 4, 5, 6, 7, 8) and plan.bc == 10
    plan, tokens = _pld_after(context, bc=60)
    assert tokens.tolist() == [3, *range(4, 14)]                     # depth 10 at most
    assert plan.bc == 11
    plan, tokens = _pld_after(context, bc=4)
    assert tokens.tolist() == [3, 4, 5, 6]
    plan, tokens = _pld_after([1, 2, 3, 4], bc=10)                   # nothing to match
    assert tokens.tolist() == [4] and plan.bc == 1


def test_pld_prefers_the_longest_ngram_then_the_newest_full_continuation():
    # "8 1 2" occurs once (followed by 7); "1 2" alone is newer (followed by 5)
    plan, tokens = _pld_after([8, 1, 2, 7, 7, 1, 2, 5, 9, 8, 1, 2], bc=3)
    assert tokens.tolist() == [2, 7, 7]
    # "4 5" twice: the newest runs into the end after 2 tokens, the older gives the full 3
    plan, tokens = _pld_after([4, 5, 6, 7, 8, 4, 5, 4, 5], bc=4)
    assert tokens.tolist() == [5, 6, 7, 8]
    # two full continuations of "3 1 2": the newer one (qa10a DR2: a scan from the oldest
    # occurrence passed the two cases above)
    plan, tokens = _pld_after([3, 1, 2, 7, 8, 3, 1, 2, 5, 6, 3, 1, 2], bc=3)
    assert tokens.tolist() == [2, 5, 6]


def test_pld_finds_the_obvious_match_in_a_repetitive_prompt(stories):
    backend, tok, _, _ = stories
    ids = tok("The dog ran to the park. The dog ran to the park. The dog ran to the").input_ids
    with torch.no_grad():
        ref = backend.hf.generate(torch.tensor([ids]), max_new_tokens=40, do_sample=False)
    result = Generation(backend, GenerationConfig(max_new_tokens=40, bc=10, drafter="pld"),
                        ids).run()
    assert result.token_ids == ref[0, len(ids):].tolist()
    assert result.stats.accept_lengths[0] >= 2  # " park. He": copied from the prompt
    assert max(result.stats.accept_lengths) == 9  # the model loops; PLD drafts whole chains


# -- random-initialised configs ---------------------------------------------------------------


_family_configs = family_configs


@pytest.mark.parametrize("family", ["llama3", pytest.param("qwen3", marks=pytest.mark.slow)])
def test_equals_transformers_greedy_on_random_configs(family, tmp_path):
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(_family_configs()[family]).eval()
    hf.save_pretrained(tmp_path)
    backend = TorchBackend(str(tmp_path))
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 250, size=n).tolist() for n in (3, 9, 30)]
    prompts.append(rng.integers(3, 250, size=6).tolist() * 4)  # something to look up
    for ids in prompts:
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=64, do_sample=False)
        ref = ref[0, len(ids):].tolist()
        for drafter in LOOKUP:
            for bc in BCS if family != "llama3" else QUICK_BCS:  # (llama3: the default run)
                for k in (1, 2) if drafter == "hybrid" else (1,):
                    config = GenerationConfig(max_new_tokens=64, bc=bc, drafter=drafter,
                                              mask_tokens=k)
                    got = Generation(backend, config, ids).run().token_ids
                    assert got == ref, (family, drafter, bc, k, _first_difference(got, ref))


# -- sampling and options ----------------------------------------------------------------------


@pytest.mark.parametrize("drafter", LOOKUP)
def test_sampling_draws_the_same_tokens_as_plain_sampling(stories, drafter):
    # the verifier draws once per committed token, each from the model's processed
    # distribution at that prefix: with one seed, any lossless drafter must give plain
    # sampling's exact tokens
    backend, _, prompts, _ = stories
    for seed, ids in enumerate(prompts[:4]):
        config = GenerationConfig(max_new_tokens=48, temperature=0.9, top_k=20, seed=seed)
        plain = Generation(backend, config.with_(drafter="none"), ids).run().token_ids
        for bc in (10, 60):
            got = Generation(backend, config.with_(drafter=drafter, bc=bc), ids).run()
            assert got.token_ids == plain, (drafter, bc, seed)


def test_hybrid_without_calibration_or_pruning_is_still_lossless(stories):
    backend, _, prompts, refs = stories
    for options in (dict(calibrate=False), dict(prune=False), dict(mask_init="last-k", ema=0.0)):
        config = GenerationConfig(max_new_tokens=NEW_TOKENS, bc=30, drafter="hybrid", **options)
        for ids, ref in zip(prompts[:3], refs):
            assert Generation(backend, config, ids).run().token_ids == ref, options


@pytest.mark.parametrize("drafter", ["hybrid", "stand"])
def test_measured_tree_cost_grows_only_nodes_that_pay(stories, drafter, monkeypatch):
    # tree_cost="measured" with a fit in which every row costs what a step's tokens are worth
    # over 4 rows (min_score 0.5; kept fixed: no real timings recorded): the trees shrink to
    # sure nodes, the output is still greedy's, and every step of the drafter's own tree is
    # recorded with its rows and the tokens it committed
    from edgemtp.drafters.tree_cost import TreeCost

    backend, _, prompts, refs = stories
    fit = TreeCost(warmup=2)
    for rows in (2, 6, 2, 6):
        fit.record(rows, 0.001 * rows, 2)
    assert fit.min_score(0.001) == pytest.approx(0.5)
    records = []
    monkeypatch.setattr(TreeCost, "record", lambda self, *a: records.append(a))
    key = ("hybrid-tree-cost", 60, 1) if drafter == "hybrid" else ("stand-tree-cost", 60)
    rows, windows = {}, {}
    for cost in ("budget", "measured"):
        config = GenerationConfig(max_new_tokens=NEW_TOKENS, bc=60, drafter=drafter,
                                  tree_cost=cost)
        # hybrid: a Jacobi window that has got nothing accepted so far runs only on probes
        memory = {key: fit, ("hybrid-window", 60, 1): {"gain": 0.0, "steps": 0}}
        gen = Generation(backend, config, prompts[0], memory=memory)
        seen = []
        propose = gen.drafter.propose
        gen.drafter.propose = lambda root: seen.append(propose(root)) or seen[-1]
        assert gen.run().token_ids == refs[0]
        rows[cost] = [plan.bc for plan, _ in seen]
        windows[cost] = sum(isinstance(plan, LookaheadPlan) for plan, _ in seen)
    # budget: nothing recorded; measured: every step observed (the last, which ends the
    # generation, is not)
    assert len(rows["measured"]) - 1 <= len(records) <= len(rows["measured"])
    assert [r for r, _, _ in records] == rows["measured"][:len(records)]
    assert all(s > 0 and 1 <= t <= 60 for _, s, t in records)
    assert max(rows["measured"]) < max(rows["budget"])
    assert sum(rows["measured"]) < 0.5 * sum(rows["budget"])
    if drafter == "hybrid":
        assert windows["budget"] == len(rows["budget"])          # every step at BC 60
        n = len(rows["measured"])
        assert 1 <= windows["measured"] <= n // H.HybridDrafter.WINDOW_PROBE + 1, (windows, n)


def test_tree_cost_fit():
    from edgemtp.drafters.tree_cost import TreeCost

    c = TreeCost(warmup=3)
    c.record(10, 0.002, 2)
    c.record(30, 0.004, 2)
    assert c.min_score(0.001) == 0.001                 # warming up: grow to the budget
    c.record(10, 0.002, 2)
    assert c.slope == pytest.approx(1e-4, rel=0.02)     # 0.1 ms a row
    assert c.min_score(0.001) == pytest.approx(2 * 1e-4 / c.seconds, rel=0.02)
    flat = TreeCost(warmup=1)
    for _ in range(20):
        flat.record(20, 0.003, 2)                       # one block size: no slope to read
    assert flat.slope == 0.0 and flat.min_score(0.001) == 0.001
    cheaper = TreeCost(warmup=1)
    for rows, sec in [(10, 0.004), (30, 0.002)] * 5:    # bigger blocks ran faster (noise)
        cheaper.record(rows, sec, 2)
    assert cheaper.slope == 0.0 and cheaper.min_score(0.001) == 0.001


def test_tiny_budgets(stories):
    # BC 1: nothing to draft; BC 2: one position for a draft node or a mask
    backend, _, prompts, refs = stories
    for drafter in LOOKUP:
        for bc in (1, 2, 3):
            config = GenerationConfig(max_new_tokens=NEW_TOKENS, bc=bc, drafter=drafter)
            seen, result = _proposals(backend, config, prompts[0])
            assert result.token_ids == refs[0]
            assert all(plan.bc <= bc for plan, _, _ in seen)


def test_stored_distributions_written_late_keep_what_was_appended():
    """Appends are written when next read: an array the step owns is kept until then, a
    view of a backend's reused buffer is copied at once (the buffer changes next step), and
    skipped positions stay empty, in order, across a growth of the arrays."""
    from edgemtp.drafters.ngram_index import StoredDistributions

    d = StoredDistributions(2)
    buf = np.array([[[3, 4], [5, 6]]])  # [1, T, K], as a backend's output buffer
    lp = np.log(np.array([[[0.6, 0.4], [0.9, 0.1]]], dtype=np.float32))
    d.append(buf[0], lp[0], np.array([1]))  # views: copied now
    buf[...], lp[...] = 0, 0.0              # the backend reuses its buffers
    d.skip(300)                             # past the first 256 rows: the arrays grow
    owned = np.array([[7, 8]]), np.log(np.array([[0.5, 0.5]], dtype=np.float32))
    d.append(*owned)
    assert [(t, round(p, 2)) for t, p in d.mixture([0])] == [(5, 0.9), (6, 0.1)]
    assert d.mixture([1]) == [] and d.size == 302
    assert [(t, round(p, 2)) for t, p in d.mixture([301])] == [(7, 0.5), (8, 0.5)]
