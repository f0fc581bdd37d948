"""The auto drafter: weighs plain steps, probing, lookup chains, STAND trees and whole hybrid /
LADE / k = 2 drafters by the device's latency curve, never exceeds the budget, and stays
lossless whatever it picks."""

import time

import numpy as np
import pytest

from edgemtp import ConfigError, GenerationConfig
from edgemtp.engine import PREFILL_CHUNK, Generation
from edgemtp.latency import LatencyCurve, measure_latency
from edgemtp.runtimes.torch_backend import TorchBackend

from conftest import STORIES


# curves slower than the real tiny model, so the host time auto measures (step time minus
# the curve) is zero and the curve alone decides
# curves in tenths of a second: auto adds the host time it measures per step, which must not
# decide these tests on a slow or loaded machine
STEEP = LatencyCurve((1, 2, 60), (0.2, 0.6, 20.0))         # no draft can pay for its block
FLAT = LatencyCurve((1, 60), (1e-2, 1.05e-2))            # wide blocks are almost free
SLOW_FLAT = LatencyCurve((1, 60), (0.2, 0.21))           # the same, slower than any host time


class RecordingBackend:
    """The real backend, with the block size of every decode step (a forward on a non-empty
    cache: prefill excluded) written down."""

    def __init__(self, inner):
        self.inner, self.sizes = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def session(self):
        return RecordingSession(self.inner.session(), self.sizes)


class RecordingSession:
    def __init__(self, inner, sizes):
        self.inner, self.sizes = inner, sizes

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def forward(self, input_ids, *args, **kw):
        if self.inner.cache_len > 0:
            self.sizes.append(len(input_ids))
        return self.inner.forward(input_ids, *args, **kw)


@pytest.fixture(scope="module")
def setup(stories_path, stories_refs):
    _, prompts, refs = stories_refs  # greedy of 128 tokens: its first 96 are greedy of 96
    return TorchBackend(stories_path), prompts[:8], [r[:96] for r in refs[:8]]


def _run(backend, prompts, config, memory=None):
    rec = RecordingBackend(backend)
    results = [Generation(rec, config, ids, memory=memory).run() for ids in prompts]
    return results, rec.sizes


def test_auto_falls_back_to_plain_decoding_when_speculation_loses(setup):
    backend, prompts, refs = setup
    config = GenerationConfig(drafter="auto", bc=60, max_new_tokens=96, latency=STEEP)
    results, sizes = _run(backend, prompts, config, memory={})
    assert [r.token_ids for r in results] == refs
    assert set(sizes) == {1}, "a steep latency curve must never pick a tree or explore"
    assert sum(r.stats.new_tokens for r in results) == sum(r.stats.forward_calls for r in results)


def test_auto_uses_prompt_lookup_when_a_short_chain_pays(setup):
    """t(2) barely above t(1): a one-token lookup chain pays, a probing tree (T >= 4) does
    not, and the output is still exactly greedy."""
    backend, prompts, refs = setup
    curve = LatencyCurve((1, 2, 4, 60), (0.2, 0.202, 1.0, 20.0))
    config = GenerationConfig(drafter="auto", bc=60, max_new_tokens=96, latency=curve)
    results, sizes = _run(backend, prompts, config, memory={})
    assert [r.token_ids for r in results] == refs
    assert set(sizes) <= {1, 2} and 2 in sizes
    be = sum(r.stats.new_tokens for r in results) / sum(r.stats.forward_calls for r in results)
    assert be > 1.1, f"one-token lookup chains should be accepted often here, BE {be:.3f}"


def test_auto_probes_when_wide_blocks_are_cheap(setup, clock):
    backend, prompts, refs = setup
    config = GenerationConfig(drafter="auto", bc=60, max_new_tokens=96, latency=FLAT)
    memory = {}
    paced = PacedBackend(backend, FLAT, clock)  # (steps cost the curve on auto's clock)
    _run(paced, prompts, config, memory)  # learn the acceptance of this model
    results, sizes = _run(paced, prompts, config, memory)
    assert [r.token_ids for r in results] == refs
    be = sum(r.stats.new_tokens for r in results) / sum(r.stats.forward_calls for r in results)
    assert be > 1.2, f"auto should probe with a flat latency curve, got BE {be:.3f}"


def _generations(backend, prompts, config, memory):
    gens = [Generation(backend, config, ids, memory=memory) for ids in prompts]
    return [g.run().token_ids for g in gens], [g.drafter.picked for g in gens]


@pytest.mark.parametrize("name", ["hybrid", "lade", "probe k=2", "stand"])
def test_auto_runs_a_source_that_is_clearly_best_and_stays_lossless(setup, name):
    """Every candidate source auto weighs, made clearly best by its running statistics on a
    flat curve: auto runs it (its plans go through the one lossless walk) and the output is
    still exactly greedy, whatever runs next."""
    backend, prompts, refs = setup
    memory = {}
    if name == "stand":  # every STAND node "always right" so far
        memory["auto-stand"] = {"hits": np.full(8, 1e3), "seen": np.full(8, 1e3)}
    else:  # 8 tokens a step at 10 positions, seen often
        memory[("auto-whole", name, 10)] = {f: [8.0, 10.0, 1e3] for f in range(4)}
    config = GenerationConfig(drafter="auto", bc=10, max_new_tokens=96, latency=SLOW_FLAT)
    outs, picked = _generations(backend, prompts[:3], config, memory)
    assert outs == refs[:3]
    key = "stand" if name == "stand" else f"{name} BC=10"
    assert sum(p.get(key, 0) for p in picked) >= 5, (key, picked)


def test_auto_passes_tree_cost_to_its_hybrids_only(setup):
    # tree_cost="measured" reaches the hybrids (which fit their own step cost as they run);
    # LADE, k = 2 probing and heads take no such option and are built as ever
    backend, prompts, refs = setup
    memory = {("auto-whole", "hybrid", 10): {f: [8.0, 10.0, 1e3] for f in range(4)}}
    config = GenerationConfig(drafter="auto", bc=10, max_new_tokens=96, latency=SLOW_FLAT,
                              tree_cost="measured")
    outs, picked = _generations(backend, prompts[:3], config, memory)
    assert outs == refs[:3]
    assert sum(p.get("hybrid BC=10", 0) for p in picked) >= 5, picked
    assert memory[("hybrid-tree-cost", 10, 1)].n >= 5


def test_auto_weighs_every_source_by_the_curve(setup, clock):
    """A flat curve: wide blocks cost what one position does, so what runs is wide (the
    whole drafters, STAND and probing trees) and BE beats any one-token chain's; a steep
    curve (above): plain decoding only. Steps cost the curve on auto's clock, so the host
    time it measures (and so what it picks) does not depend on how loaded this machine is
    (on wall time a CI run once read BE 1.399)."""
    backend, prompts, refs = setup
    config = GenerationConfig(drafter="auto", bc=30, max_new_tokens=96, latency=SLOW_FLAT)
    memory = {}
    paced = PacedBackend(backend, SLOW_FLAT, clock)
    _generations(paced, prompts, config, memory)  # learn this model's acceptance
    rec = PacedBackend(backend, SLOW_FLAT, clock)
    outs, picked = _generations(rec, prompts, config, memory)
    assert outs == refs
    kinds = {k for p in picked for k in p}
    assert {"hybrid BC=30", "stand"} & kinds, kinds
    assert np.mean(rec.sizes) >= 8, f"mean block {np.mean(rec.sizes):.1f} on a flat curve"
    be = sum(len(o) for o in outs) / (len(rec.sizes) + len(outs))
    assert be > 1.4, f"BE {be:.3f} on a flat curve"


@pytest.mark.parametrize("bc", [1, 3, 4, 10, 30])
def test_auto_never_exceeds_the_budget(setup, bc):
    backend, prompts, refs = setup
    config = GenerationConfig(drafter="auto", bc=bc, max_new_tokens=96, latency=FLAT)
    results, sizes = _run(backend, prompts[:3], config, memory={})
    assert [r.token_ids for r in results] == refs[:3]
    assert sizes and max(sizes) <= bc, (bc, sorted(set(sizes)))


def test_measured_latency_curve_is_monotone_and_leaves_other_sessions_alone(setup):
    backend = setup[0]
    mine = backend.session()
    mine.forward(np.array([1, 2, 3]), np.arange(3), np.tril(np.ones((3, 3), bool)), None)
    mine.commit(np.arange(3))
    curve = measure_latency(backend, (1, 2, 8, 32), repeats=2)
    assert curve.sizes == (1, 2, 8, 32)
    assert all(b >= a > 0 for a, b in zip(curve.seconds, curve.seconds[1:]))
    assert mine.cache_len == 3


class BurstBackend:
    """The real backend, whose first ``slow`` decode forwards (after the measuring session's
    prefill) each take ``pause`` seconds more: a load that passes while a curve is measured."""

    def __init__(self, inner, slow: int, pause: float):
        self.inner, self.slow, self.pause = inner, slow, pause

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def session(self, **kw):
        inner, outer = self.inner.session(**kw), self

        class Session:
            def __getattr__(self, name):
                return getattr(inner, name)

            def forward(self, ids, *a, **kw):
                if inner.cache_len and outer.slow > 0:
                    outer.slow -= 1
                    time.sleep(outer.pause)
                return inner.forward(ids, *a, **kw)

        return Session()


def test_a_passing_load_does_not_flatten_the_measured_curve(setup):
    # measured size by size, five slow forwards in a row made every sample of t(1) slow and
    # the running maximum carried it up the curve (t(1) = t(8)); in interleaved rounds each
    # size gets at most one slow sample of four
    curve = measure_latency(BurstBackend(setup[0], slow=5, pause=0.25), (1, 2, 8), repeats=4)
    assert curve.seconds[0] < 0.1, curve.seconds  # a stories260K step is ~1 ms on CPU
    assert all(b >= a for a, b in zip(curve.seconds, curve.seconds[1:]))


def test_auto_corrects_a_curve_that_overstates_its_steps(setup):
    # SLOW_FLAT says 0.2 s a step; the tiny model takes ~1 ms: the host time auto learns per
    # kind of step goes negative (down to half of t(T)) instead of stopping at zero
    backend, prompts, refs = setup
    memory = {}
    config = GenerationConfig(drafter="auto", bc=10, max_new_tokens=24, latency=SLOW_FLAT)
    results, _ = _run(backend, prompts[:2], config, memory)
    assert [r.token_ids for r in results] == [r[:24] for r in refs[:2]]
    host = memory["auto-host-by-kind"]
    assert -0.1 - 1e-9 <= host["plain"] < -0.05, host


def test_latency_curve_rejects_nonsense():
    with pytest.raises(ConfigError, match="increase"):
        LatencyCurve((4, 1), (1e-3, 2e-3))
    with pytest.raises(ConfigError, match="one time per block size"):
        LatencyCurve((1, 2), (1e-3,))
    assert np.isclose(LatencyCurve((1, 10), (1.0, 2.0))(20), 3.111111, atol=1e-5)


def test_auto_keeps_whole_drafters_off_where_a_forward_is_cheaper_than_their_upkeep(setup):
    """A forward pass faster than WHOLE_MIN_T1 (the tiny model on a CPU): keeping the hybrid,
    LADE and k = 2 drafters current would cost more host time than they can save, so auto
    weighs only probing and lookup chains (and STAND trees, which read the hybrid's stored
    distributions, are off too); still lossless."""
    from edgemtp.drafters.auto import WHOLE_MIN_T1

    backend, prompts, refs = setup
    fast = LatencyCurve((1, 60), (WHOLE_MIN_T1 / 4, WHOLE_MIN_T1 / 4 * 1.05))
    config = GenerationConfig(drafter="auto", bc=30, max_new_tokens=96, latency=fast)
    outs, picked = _generations(backend, prompts[:3], config, {})
    assert outs == refs[:3]
    kinds = {k for p in picked for k in p}
    assert not {k for k in kinds if "BC=" in k or k == "stand"}, kinds
    gen = Generation(backend, config, prompts[0], memory={})
    assert gen.drafter.wholes == [] and gen.drafter.mask_tokens == 1


def test_auto_is_the_default_drafter_unless_probing_options_are_given():
    # a default generation speculates only where it pays (probing at BC 30 costs ~5 tokens a
    # step on a 2-core CPU); asking for mask tokens or a static tree means asking for probing
    assert GenerationConfig().drafter == "auto"
    assert GenerationConfig(bc=60, temperature=0.5).drafter == "auto"
    assert GenerationConfig().mask_tokens == 1
    for options in (dict(mask_tokens=2), dict(mask_tokens=1), dict(tree="static"),
                    dict(tree="static", branching=(4,))):
        assert GenerationConfig(**options).drafter == "probe", options
    assert GenerationConfig(drafter="hybrid", mask_tokens=2).drafter == "hybrid"
    assert GenerationConfig(mask_tokens=2).with_(bc=60).drafter == "probe"
    # a drafter left out is chosen again: Model.generate(prompt, mask_tokens=2) builds its
    # config with with_() on a default one, and ran auto (the QA's find)
    assert GenerationConfig().with_(mask_tokens=2).drafter == "probe"
    assert GenerationConfig(drafter="auto").with_(mask_tokens=2).drafter == "auto"
    with pytest.raises(ConfigError, match="mask_tokens must be an integer >= 1"):
        GenerationConfig(mask_tokens=0)


def test_a_measured_curve_is_kept_for_the_next_process(setup, stories_pkg, tmp_path,
                                                        monkeypatch):
    # auto's first generation measures the device's latency curve (1-2 s for SmolLM2 on a
    # 2-core CPU): kept on disk per weights file, backend, device, threads and host, read back
    # by the next command; stale, corrupt or unnamed: measured again
    import json

    from edgemtp import latency
    from edgemtp.runtimes.onnxrt_backend import OrtBackend

    monkeypatch.setenv("EDGEMTP_CACHE", str(tmp_path))
    monkeypatch.setenv("EDGEMTP_LATENCY_CACHE", "1")
    calls = []
    real = latency.measure_latency

    def counting(*a, **kw):
        calls.append(a[1])
        return real(*a, **kw)

    monkeypatch.setattr(latency, "measure_latency", counting)
    ort = OrtBackend(stories_pkg, threads=1)
    first = latency.cached_latency(ort, (1, 2, 4), repeats=1)
    [kept] = (tmp_path / "latency").glob("*.json")
    assert latency.cached_latency(OrtBackend(stories_pkg, threads=1), (1, 2, 4), repeats=1) \
        == first and len(calls) == 1  # another backend on the same weights: read, not measured
    latency.cached_latency(OrtBackend(stories_pkg, threads=2), (1, 2, 4), repeats=1)
    latency.cached_latency(ort, (1, 2, 8), repeats=1)
    assert len(calls) == 3  # other threads, other sizes: their own curves
    entry = json.loads(kept.read_text())
    entry["measured"] -= 8 * 86400
    kept.write_text(json.dumps(entry))
    latency.cached_latency(ort, (1, 2, 4), repeats=1)
    kept.write_text("{not json")
    latency.cached_latency(ort, (1, 2, 4), repeats=1)
    assert len(calls) == 5  # a week old, then corrupt: measured again (and rewritten)
    assert json.loads(kept.read_text())["key"] == entry["key"]
    entry = json.loads(kept.read_text())
    del entry["curve"]["context"]  # kept before curves carried their cache length
    kept.write_text(json.dumps(entry))
    assert latency.cached_latency(ort, (1, 2, 4), repeats=1).context == 64
    assert len(calls) == 6 and json.loads(kept.read_text())["curve"]["context"] == 64
    assert not list((tmp_path / "latency").glob("*.tmp"))
    latency.cached_latency(ort, (1, 2, 4), repeats=1, again=True)  # kept, measured anyway
    assert len(calls) == 7 and json.loads(kept.read_text())["measured"] > entry["measured"]
    latency.cached_latency(setup[0], (1, 2), repeats=1)  # torch, a named folder: kept too
    assert len(list((tmp_path / "latency").glob("*.json"))) == 4
    monkeypatch.setenv("EDGEMTP_LATENCY_CACHE", "0")
    latency.cached_latency(ort, (1, 2, 4), repeats=1)
    assert len(calls) == 9
    monkeypatch.setenv("EDGEMTP_LATENCY_CACHE", "on")
    with pytest.raises(ConfigError, match="EDGEMTP_LATENCY_CACHE must be 1 .* or 0 .*'on'"):
        latency.cached_latency(ort, (1, 2, 4), repeats=1)
    blocked = tmp_path / "a-file"  # a cache folder that cannot be made (even as root)
    blocked.write_text("")
    monkeypatch.setenv("EDGEMTP_CACHE", str(blocked / "edgemtp"))
    monkeypatch.setenv("EDGEMTP_LATENCY_CACHE", "1")
    assert latency.cached_latency(ort, (1, 2, 4), repeats=1).sizes == (1, 2, 4)
    assert len(calls) == 10  # measured, no error, nothing kept


def test_a_pair_saying_more_cache_costs_less_is_measured_again():
    """A long-context curve cheaper than the short one (measured through a passing load):
    both measured again, bypassing the cache, each size keeping its fastest reading; a
    consistent pair is taken as it is."""
    from types import SimpleNamespace

    from edgemtp import latency

    backend = SimpleNamespace(max_context=2048)
    readings = {  # (context, again) -> the curves measured, in order
        (64, False): [(0.0044, 0.0045)], (512, False): [(0.0041, 0.0045)],
        (64, True): [(0.0045, 0.0046), (0.0032, 0.0033)],
        (512, True): [(0.0040, 0.0046), (0.0038, 0.0042)]}
    asked = []

    def measure(ctx, again):
        asked.append((ctx, again))
        return latency.LatencyCurve((1, 2), readings[(ctx, again)].pop(0), ctx)

    pair = latency.curve_pair(measure, backend, (1, 2))
    # the first retry still said 4.0 ms over 512 rows against 4.4 over 64; the second fixed it
    assert asked == [(64, False), (512, False), (64, True), (512, True), (64, True),
                     (512, True)]
    assert pair.seconds == (0.0032, 0.0033) and pair.long.seconds == (0.0038, 0.0042)
    assert latency.consistent(pair, pair.long)
    asked.clear()
    readings.update({(64, False): [(0.003, 0.004)], (512, False): [(0.0035, 0.0045)]})
    assert latency.curve_pair(measure, backend, (1, 2)).long.seconds == (0.0035, 0.0045)
    assert asked == [(64, False), (512, False)]  # consistent: no second measurement


def test_stats_say_which_kinds_of_step_auto_took(setup):
    # the stats line and --json say what auto chose per decode step (plain, mask, pld, ...);
    # other drafters' stats carry no such field
    backend, prompts, refs = setup
    config = GenerationConfig(drafter="auto", bc=60, max_new_tokens=96, latency=FLAT)
    r = Generation(backend, config, prompts[0], memory={}).run()
    kinds = r.stats.steps_by_kind
    assert r.token_ids == refs[0]
    assert sum(kinds.values()) == r.stats.forward_calls - 1 and len(kinds) >= 2, kinds
    assert r.stats.to_dict()["steps_by_kind"] == kinds
    top, n = min(kinds.items(), key=lambda kv: (-kv[1], kv[0]))  # most used, then by name
    assert f"| steps: {top} {n}" in r.stats.summary()
    assert "BC <= 60)" in r.stats.summary()  # a ceiling, and no one mask count
    probe = Generation(backend, config.with_(drafter="probe"), prompts[0]).run().stats
    assert probe.steps_by_kind == {} and "steps_by_kind" not in probe.to_dict()
    assert "steps:" not in probe.summary() and "BC 60, k 1)" in probe.summary()
    pld = Generation(backend, config.with_(drafter="pld", bc=10), prompts[0]).run().stats
    assert "BC 10)" in pld.summary()  # no mask tokens: no k


def test_latency_is_measured_on_a_small_session(setup, stories_pkg):
    # auto measures while a generation already holds its session: a second cache for the
    # whole context would be real memory on a GPU, so the measurement's is just large enough
    from edgemtp.runtimes.onnxrt_backend import OrtBackend

    for backend in (OrtBackend(stories_pkg, threads=1), setup[0]):
        asked, real = [], backend.session

        def session(rows=None, real=real):
            asked.append(rows)
            return real(rows=rows)

        backend.session = session
        try:
            curve = measure_latency(backend, (1, 2, 8), context=16, repeats=1)
        finally:
            del backend.session
        assert curve.sizes == (1, 2, 8) and asked == [16 + 8 + 1], asked
    ort = OrtBackend(stories_pkg, threads=1)
    s = ort.session(rows=20)
    assert s.kv.rows == 20 and ort.session().kv.rows == ort.max_context
    s.forward(np.arange(1, 19), np.arange(18), np.tril(np.ones((18, 18), bool)), None)
    s.commit(np.arange(18))
    out = s.forward(np.array([5, 6]), np.array([18, 19]), np.tril(np.ones((2, 2), bool)), None)
    assert out.argmax.shape == (2,)
    s.commit(np.arange(2))
    with pytest.raises(ConfigError, match=r"overruns the KV cache \(20 of 20 rows used\)"):
        s.commit(np.arange(1))
    torch_session = setup[0].session(rows=20)
    assert torch_session.rows < setup[0].session().rows  # grows if a block needs more


def test_prefill_carries_masks_only_where_probing_could_pay(setup, clock):
    # mask rows in the prefill feed only a probing step: under a curve where none can pay
    # they are prefill work for nothing; under a flat one, once acceptance is known, they come
    # (decode steps paced on auto's virtual clock: with the wall clock, a loaded CI machine's
    # real forwards and drafting had outweighed the flat curve's 10 ms steps)
    backend, prompts, _ = setup
    prefills = []

    class Prefills(PacedSession):
        def forward(self, input_ids, *args, **kw):
            if self.inner.cache_len == 0:
                prefills.append(len(input_ids))
            return super().forward(input_ids, *args, **kw)

    class Rec(PacedBackend):
        def session(self):
            return Prefills(self.inner.session(), self.sizes, self.curve, 0.0, self.clock)

    for curve, extra in ((STEEP, 0), (FLAT, None)):
        memory, prefills[:], clock.now = {}, [], 0.0
        config = GenerationConfig(drafter="auto", bc=60, max_new_tokens=32, latency=curve)
        for ids in prompts[:4]:
            Generation(Rec(backend, curve, clock), config, ids, memory=memory).run()
        rows = [p - len(ids) for p, ids in zip(prefills, prompts[:4])]
        if extra == 0:
            assert rows == [0, 0, 0, 0], rows
        else:
            assert rows[-1] >= 1, f"a flat curve should probe from the first step: {rows}"


def _rows_asked(asked):
    """A RecordingBackend whose sessions can leave prompt rows out, each prefill's ask noted
    in ``asked`` (True: the prompt rows left out)."""
    class RowsFrom(RecordingSession):
        rows_from = True  # (the torch session computes every row; the engine's ask is noted)

        def forward(self, input_ids, *args, rows_from=None, **kw):
            if self.inner.cache_len == 0:
                asked.append(rows_from is not None)
            return self.inner.forward(input_ids, *args, **kw)

    class Rec(RecordingBackend):
        def session(self):
            return RowsFrom(self.inner.session(), self.sizes)

    return Rec


def test_auto_leaves_the_prompt_rows_out_once_stand_trees_stop_paying(setup):
    # the prompt rows' LM head and top-K feed only the stored distributions STAND trees and
    # the hybrids read; on a backend that can leave rows out (the native one), auto asks for
    # them while STAND trees are still grown often, and no longer once they keep losing
    backend, prompts, refs = setup
    asked = []  # per prefill: whether it left the prompt rows out
    Rec = _rows_asked(asked)

    memory = {}
    config = GenerationConfig(drafter="auto", bc=60, max_new_tokens=96, latency=STEEP)
    outs = [Generation(Rec(backend), config, ids, memory=memory).run().token_ids
            for ids in prompts[:4]]
    assert outs == refs[:4]
    assert asked[0] is False and asked[-1] is True, asked
    assert memory["auto-stand-gap"]["gap"] > 16


def test_auto_leaves_the_prompt_rows_out_where_the_prompt_is_long_for_the_answer(setup):
    # a fresh model reads the prompt rows (STAND trees may pay), unless their LM head and
    # top-K (a fifth of a prefill row, read off the curve) would cost more than a tenth of
    # the answer's plain decoding: the same prompt, 96 new tokens against 4
    backend, prompts, refs = setup
    asked = []
    Rec = _rows_asked(asked)

    ids = prompts[0]
    # STEEP: t(1) 0.2 s, ~0.33 s a row at 60; 96 new tokens allow ~29 prompt rows, 4 none
    assert 2 <= len(ids) <= 28, len(ids)
    for new, left_out in ((96, False), (4, True)):
        config = GenerationConfig(drafter="auto", bc=60, max_new_tokens=new, latency=STEEP)
        out = Generation(Rec(backend), config, ids, memory={}).run().token_ids
        assert out == refs[0][:new]
        assert asked[-1] is left_out, (new, asked)


def test_the_prompt_rows_are_priced_at_the_backends_own_lm_share(setup):
    # a backend that knows its LM head's share of a row says so (the native one: 0.35 with a
    # GGUF's 8-bit head, twice the default fifth); auto prices the prompt rows with it: the
    # prompt whose rows 96 new tokens pay for at a fifth is left out at 1.0
    backend, prompts, refs = setup
    ids = prompts[0]
    assert 8 <= len(ids) <= 28, len(ids)  # STEEP: ~29 rows allowed at 0.2, ~6 at 1.0
    for share, left_out in ((None, False), (0.2, False), (1.0, True)):
        asked = []
        Rec = _rows_asked(asked)
        Rec.lm_row_share = share
        config = GenerationConfig(drafter="auto", bc=60, max_new_tokens=96, latency=STEEP)
        out = Generation(Rec(backend), config, ids, memory={}).run().token_ids
        assert out == refs[0][:96]
        assert asked[-1] is left_out, (share, asked)


def test_auto_reads_its_curve_at_the_cache_length(setup, monkeypatch):
    """A block's cost grows with the cache it attends to, faster for more rows (SmolLM2 fp32
    on 2 cores: t(8) - t(1) = 9.7 ms over 64 cached rows, 16.4 ms over 800). auto measures
    a second curve over LONG_CONTEXT rows and reads t(T) off the line through both at the
    cache's length, so a long prompt's lookup chains are charged what they cost there."""
    import edgemtp.drafters.auto as auto

    backend, prompts, refs = setup
    long_ctx = backend.max_context - 10 - 1  # (under LONG_CONTEXT: the tiny model's 512)
    short = LatencyCurve((1, 2, 60), (0.2, 0.21, 0.3))  # flat: speculation is cheap
    long = LatencyCurve((1, 2, 60), (0.25, 2.0, 20.0), long_ctx)  # ... and dear over 501 rows
    calls = []

    def measured(backend, sizes, context=64, repeats=7, topk=0, again=False):
        calls.append(context)
        return short if context == 64 else long

    monkeypatch.setattr(auto, "cached_latency", measured)
    config = GenerationConfig(drafter="auto", bc=10, max_new_tokens=24)
    d = Generation(backend, config, prompts[0], memory={}).drafter
    assert calls == [64, long_ctx] and d.latency_long is long
    for rows in (0, 63, 96, 300, 480, 90):
        d._at_context(rows)
        x = max(rows // 32 * 32 - 64, 0) / (long_ctx - 64)
        want = [short(t) + x * max(long(t) - short(t), 0.0) for t in range(11)[1:]]
        assert d._latl[1:] == pytest.approx(want), rows
    # the same curves: a short prompt speculates; a ~330-token one decodes plainly (a
    # 2-row block there costs ~4 plain steps), apart from mask-only steps (T = 2), and both
    # are plain decoding's tokens
    longer = np.concatenate([np.concatenate([p, r[:40]]) for p, r in zip(prompts, refs)])
    longer = longer[:330]
    plain = Generation(backend, config.with_(drafter="none"), longer).run().token_ids
    memory = {}
    results, sizes = _run(backend, prompts[:2], config, memory)
    assert [r.token_ids for r in results] == [r[:24] for r in refs[:2]]
    assert max(sizes) > 2, sizes
    results, sizes = _run(backend, [longer], config, memory)
    assert results[0].token_ids == plain
    decode = sizes[-(len(longer) // -PREFILL_CHUNK) - 1:]  # (the prefill's later chunks left out)
    assert max(decode) <= 2 and len(decode) >= 12, sizes
    # a curve handed over (edgemtp profile's) with its long curve: read the same way, and
    # nothing measured
    calls.clear()
    given = config.with_(latency=LatencyCurve(short.sizes, short.seconds, 64, long))
    results, sizes = _run(backend, [longer], given, {})
    assert results[0].token_ids == plain and calls == []
    assert max(sizes[-(len(longer) // -PREFILL_CHUNK) - 1:]) <= 2, sizes
    # round trip through a profile file's form; an older file's curve (no context) reads as
    # over 64 rows; a long curve over fewer rows is one clear error
    curve = given.latency
    assert LatencyCurve.from_dict(curve.to_dict()) == curve
    assert LatencyCurve.from_dict({"block_sizes": [1, 2], "seconds": [0.1, 0.2]}).context == 64
    with pytest.raises(ConfigError, match="long curve must be over more cached rows"):
        LatencyCurve((1, 2), (0.1, 0.2), 512, LatencyCurve((1, 2), (0.1, 0.2), 64))


class VirtualClock:
    """auto's clock in the paced tests: it moves only when a paced forward says so, so the
    time auto measures per step is exactly what the curve (and ``block_extra``) charge, on
    a quiet machine or a loaded one (with the wall clock, a busy 2-core CI machine had the
    real forwards and drafting overrun the paces and the learned slope miss)."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch):
    import edgemtp.drafters.auto as auto_module

    c = VirtualClock()
    monkeypatch.setattr(auto_module, "time", c)
    return c


class PacedSession(RecordingSession):
    """A session whose forwards take the curve's time on ``clock`` (a :class:`VirtualClock`
    that auto reads), so the time auto measures per step is the curve's, as on a device
    where blocks cost that; ``block_extra`` seconds more for every block of more than one
    row."""

    def __init__(self, inner, sizes, curve, block_extra=0.0, clock=None):
        super().__init__(inner, sizes)
        self.curve, self.block_extra, self.clock = curve, block_extra, clock

    def forward(self, input_ids, *args, **kw):
        out = super().forward(input_ids, *args, **kw)
        if self.inner.cache_len > len(input_ids):  # decode steps, not prefill
            cost = self.curve(len(input_ids)) + (self.block_extra if len(input_ids) > 1 else 0)
            self.clock.now += cost
        return out


class PacedBackend(RecordingBackend):
    def __init__(self, inner, curve, clock, block_extra=0.0):
        super().__init__(inner)
        self.curve, self.block_extra, self.clock = curve, block_extra, clock

    def session(self):
        return PacedSession(self.inner.session(), self.sizes, self.curve, self.block_extra,
                            self.clock)


def test_tries_of_whole_drafters_spend_at_most_their_share_of_the_time(setup, clock):
    """A curve where whole drafters (hybrid, LADE, k = 2) are weighed and a 10-position block
    costs 3 plain steps, on a backend whose steps really take that long: their tries commit
    a token or two and lose. What all tries lost is summed over the model's generations, and
    no drafter is tried while it exceeds try_share of the time decoded; a budget already
    spent means no tries at all. Lossless either way."""
    from edgemtp.drafters.auto import WHOLE_MIN_T1, AutoDrafter

    backend, prompts, refs = setup
    t1 = 1.5 * WHOLE_MIN_T1
    curve = LatencyCurve((1, 2, 10, 30), (t1, 1.3 * t1, 3 * t1, 7 * t1))
    config = GenerationConfig(drafter="auto", bc=30, max_new_tokens=96, latency=curve)
    paced = PacedBackend(backend, curve, clock)
    whole = ("hybrid", "lade", "probe k=2")
    memory = {}
    outs, picked = _generations(paced, prompts[:4], config, memory)
    assert outs == refs[:4]
    tried = sum(n for p in picked for k, n in p.items() if k.startswith(whole))
    assert tried >= 1, picked  # tries happen (the budget starts unspent)
    cost = memory["auto-try-cost"]
    # what the steps took on auto's clock: every decode step but each generation's last
    # (no next step times it)
    decode = sum(curve(t) for t in paced.sizes)
    assert decode - 4 * curve(30) <= cost["time"] <= decode, (cost, decode)
    # the gate held before every try; the last try adds at most one block's loss
    assert cost["lost"] <= AutoDrafter.try_share * cost["time"] + curve(30), cost
    # the same fresh start with the budget spent: nothing is tried
    memory, clock.now = {"auto-try-cost": {"time": 1.0, "lost": 1.0}}, 0.0  # (as part 1)
    outs, picked = _generations(paced, prompts[:4], config, memory)
    assert outs == refs[:4]
    assert not [k for p in picked for k in p if k.startswith(whole)], picked


def test_auto_learns_how_much_dearer_blocks_really_are(setup, clock):
    """A device whose compute is twice as slow as its curve says (a busy SMT sibling, a
    throttled core: memory-bound plain steps keep their time, blocks do not): auto learns the
    slope of t(T) - t(1) from its lookup and probing steps and reads the curve with it, also
    where every block carries a fixed extra cost (the fit's intercept, not slope). On a device
    that runs at its curve the slope stays near 1. Lossless either way."""
    backend, prompts, refs = setup
    curve = LatencyCurve((1, 2, 4, 8, 16), (3e-3, 3.6e-3, 4.5e-3, 6e-3, 9e-3))
    slow = LatencyCurve(curve.sizes, tuple(3e-3 + 2 * (s - 3e-3) for s in curve.seconds))
    config = GenerationConfig(drafter="auto", bc=16, max_new_tokens=96, latency=curve)
    # (an average of cost / rise instead of the fit: 2.28 and 1.66 with the extra cost)
    for real, extra, lo, hi in ((slow, 0.0, 1.6, 2.4), (slow, 1e-3, 1.6, 2.4),
                                (curve, 0.0, 0.8, 1.25), (curve, 1e-3, 0.8, 1.25)):
        memory = {}
        outs, picked = _generations(PacedBackend(backend, real, clock, extra), prompts[:6],
                                    config, memory)
        assert outs == refs[:6]
        steps = sum(p.get("pld", 0) + p.get("probe", 0) for p in picked)
        assert steps >= 10, picked
        assert lo <= memory["auto-slope"]["a"] <= hi, (memory["auto-slope"], real.seconds)


def test_lazy_chain_scoring_matches_scoring_every_step(setup, clock, monkeypatch):
    """Lookup chains are scored when the chain table is next recomputed (and when a
    generation ends), not each step: on a clock where steps cost the curve, every pick and
    the chain table the model keeps equal those of scoring after every step, in the order the
    steps came to know each chain's outcome."""
    from edgemtp.drafters.auto import AutoDrafter

    backend, prompts, refs = setup
    curve = LatencyCurve((1, 2, 4, 60), (0.2, 0.203, 0.3, 2.0))  # chains pay, some long
    config = GenerationConfig(drafter="auto", bc=30, max_new_tokens=96, latency=curve)

    def run():
        memory = {}
        paced = PacedBackend(backend, curve, clock)
        outs, picked = _generations(paced, prompts, config, memory)
        table = memory[("auto-chain", 10)]
        return outs, picked, table["hits"].copy(), table["tries"].copy()

    lazy = run()
    observe = AutoDrafter.observe

    def eager(self, *args):
        observe(self, *args)
        self._score_chains()

    monkeypatch.setattr(AutoDrafter, "observe", eager)
    every = run()
    assert lazy[0] == every[0] == refs
    assert sum(p.get("pld", 0) for p in lazy[1]) >= 20, lazy[1]  # chains ran, and were scored
    assert lazy[1] == every[1]
    np.testing.assert_array_equal(lazy[2], every[2])
    np.testing.assert_array_equal(lazy[3], every[3])
    assert every[3].max() > 10  # the table learned from many chains


def test_engine_close_tells_the_drafter_the_generation_ended(setup):
    backend, prompts, _ = setup
    ended = []
    config = GenerationConfig(drafter="auto", bc=10, max_new_tokens=8, latency=STEEP)
    gen = Generation(backend, config, prompts[0], memory={})
    gen.drafter.finish = lambda: ended.append(len(gen.stopper.tokens))
    gen.run()
    gen.close()  # (again: a no-op)
    assert ended == [8]


def test_lazy_chain_scores_come_in_the_order_steps_settled_them():
    """A chain that kept agreeing is settled after a later chain that missed at once: the
    scores go to the table in that order, as scoring after every step would have."""
    from types import SimpleNamespace

    from edgemtp.drafters.auto import AutoDrafter

    tokens = list(range(10)) + [5, 6, 7, 8]
    state = SimpleNamespace(
        index=SimpleNamespace(tokens=tokens), chain_hits={},
        # (start, n, chain): A from 10 agrees on all 3 tokens (settled at 13 tokens), B from
        # 11 misses its first (settled at 12), C from 13 still agrees and waits
        _chains=[(10, 1, [5, 6, 7]), (11, 2, [9, 9]), (13, 3, [8, 1])],
        _observed=[11, 12, 13, 14])  # the context's length after each step
    AutoDrafter._score_chains(state)
    assert state.chain_hits["scored"] == [(1, 2, 0), (0, 3, 3)]
    assert state._chains == [(13, 3, [8, 1])] and state._observed == []
    tokens.append(2)  # C misses its second token
    state._observed = [15]
    AutoDrafter._score_chains(state)
    assert state.chain_hits["scored"] == [(1, 2, 0), (0, 3, 3), (2, 2, 1)]
    assert state._chains == []


def test_host_floor_charges_speculative_kinds_at_least_a_plain_steps_host_time():
    """host_floor (on by default): a kind whose measured host time is below plain's is
    charged plain's; off, its own (a curve that overstates t(T) in the loop is corrected)."""
    from types import SimpleNamespace

    from edgemtp.drafters.auto import AutoDrafter

    state = SimpleNamespace(host={"plain": 1e-4, "pld": 4e-5}, _host_plain=1e-4,
                            _host_max=1e-4, _host_own=1e-4, host_floor=AutoDrafter.host_floor)
    assert AutoDrafter.host_floor is True
    assert AutoDrafter._host(state, "pld") == 1e-4 and AutoDrafter._host(state, "probe") == 1e-4
    state.host_floor = False
    assert AutoDrafter._host(state, "pld") == 4e-5 and AutoDrafter._host(state, "probe") == 1e-4


def test_a_kind_never_run_is_charged_the_dearest_host_time_of_its_own_sort(setup):
    """A kind auto has not run yet is charged the dearest measured host time of its sort:
    auto's own kinds (mask, lookup, probing, STAND) that of its own kinds, a whole drafter
    that of all. A hybrid's large host time (a GPU step's ~1.6 ms) must not lock a k = 1
    probe out before it is ever measured. In a real generation the per-step bookkeeping
    keeps the own kinds' maximum current, and a drafter loaded on the same memory starts
    from it."""
    from types import SimpleNamespace

    from edgemtp.drafters.auto import OWN_KINDS, AutoDrafter

    state = SimpleNamespace(host={"plain": 1e-4, "mask": 3e-4, "hybrid": 2e-3},
                            _host_plain=1e-4, _host_max=2e-3, _host_own=3e-4,
                            host_floor=True)
    assert AutoDrafter._host(state, "probe") == 3e-4   # like the mask step, not the hybrid
    assert AutoDrafter._host(state, "stand") == 3e-4
    assert AutoDrafter._host(state, "lade") == 2e-3    # a whole drafter: the dearest of all
    assert AutoDrafter._host(state, "hybrid") == 2e-3
    assert OWN_KINDS == {"plain", "mask", "pld", "probe", "stand"}

    backend, prompts, refs = setup
    memory = {}
    config = GenerationConfig(drafter="auto", bc=10, max_new_tokens=24, latency=FLAT)
    gen = Generation(RecordingBackend(backend), config, prompts[0], memory=memory)
    assert gen.run().token_ids == refs[0][:24]
    own = [v for k, v in memory["auto-host-by-kind"].items() if k in OWN_KINDS]
    assert len(own) >= 2, memory["auto-host-by-kind"]  # plain and at least one other kind
    assert gen.drafter._host_own == max(own)
    memory["auto-host-by-kind"]["hybrid"] = max(own) + 1.0  # a whole drafter's, dearer
    fresh = AutoDrafter(backend, config, memory)
    assert fresh._host_own == max(own) and fresh._host_max == max(own) + 1.0


@pytest.fixture(scope="module")
def narrow_pkg(tmp_path_factory):
    """stories260K exported with --bc 10,30 --mask-tokens 1: its graph exports top-16, fewer
    candidates than the hybrid (20) reads."""
    from edgemtp.export.onnx_export import export_package

    out = tmp_path_factory.mktemp("narrow") / "stories-bc10-30"
    export_package(str(STORIES), out, max_context=256, bc=(10, 30), mask_tokens=(1,),
                   progress=False)
    return out


def test_every_drafter_runs_on_a_package_with_fewer_candidates_than_it_reads(narrow_pkg,
                                                                              stories_refs):
    # (the QA's find: the default generate, hybrid at any BC, and auto wherever it weighs whole
    # drafters failed with "top-20 candidates asked, but the package's graph exports top-16")
    from edgemtp.runtimes.onnxrt_backend import OrtBackend

    backend = OrtBackend(str(narrow_pkg), threads=1)
    assert backend.topk == 16
    prompts = list(stories_refs[1][:3])
    refs = [Generation(backend, GenerationConfig(drafter="none", max_new_tokens=48), ids).run()
            .token_ids for ids in prompts]
    for options in (dict(drafter="hybrid", bc=10), dict(drafter="hybrid", bc=30),
                    dict(drafter="hybrid", bc=60), dict(drafter="stand", bc=60),
                    dict(drafter="auto", bc=30, latency=SLOW_FLAT),
                    dict(drafter="auto", bc=60, latency=SLOW_FLAT), dict(drafter="auto")):
        config = GenerationConfig(max_new_tokens=48, **options)
        memory: dict = {}
        for ids, ref in zip(prompts, refs):
            gen = Generation(backend, config, ids, memory=memory)
            assert gen.run().token_ids == ref, options
        if options.get("latency") is SLOW_FLAT:  # whole drafters weighed, none wider than 16
            assert gen.drafter.wholes and all(w.drafter.topk <= 16 for w in gen.drafter.wholes)
            assert gen.drafter.width <= 16
    with pytest.raises(ConfigError, match="probing with one mask token fits it up to --bc 33"):
        Generation(backend, GenerationConfig(drafter="probe", bc=60, max_new_tokens=8),
                   prompts[0]).run()
