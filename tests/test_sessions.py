"""Sessions: each generation owns its KV cache, over one copy of the weights.

Generations in progress at the same time (interleaved step by step, or on threads) must give
exactly the tokens each gives alone; finished generations hand their session back for reuse;
a closed generation frees its session at once; hidden states come back when asked.
"""

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from edgemtp import ConfigError, Model

from conftest import STORIES, story_prompts

PROMPTS = story_prompts(6)
CONFIGS = [dict(drafter="none"), dict(drafter="probe", bc=30), dict(drafter="hybrid", bc=30),
           dict(drafter="probe", bc=60, mask_tokens=2), dict(drafter="lade", bc=10),
           dict(drafter="pld", bc=10)]


@pytest.fixture(scope="module", params=["torch", "onnxruntime"])
def model(request, stories_pkg):
    path = STORIES if request.param == "torch" else stories_pkg
    return Model.load(str(path), backend=request.param, threads=1)


def alone(model, i):
    return model.generate(PROMPTS[i], max_new_tokens=48, **CONFIGS[i]).token_ids


def test_interleaved_generations_give_their_own_tokens(model):
    want = [alone(model, i) for i in range(len(PROMPTS))]
    gens = [model.generation(PROMPTS[i], max_new_tokens=48, **CONFIGS[i])
            for i in range(len(PROMPTS))]
    assert len({id(g.session) for g in gens}) == len(gens)  # one cache each
    got = [[] for _ in gens]
    while any(not g.done for g in gens):
        for i, g in enumerate(gens):  # one step of each in turn
            if not g.done:
                got[i].extend(next(g, []))
    assert got == want


def test_threads_share_the_weights_not_the_cache(model):
    want = [alone(model, i) for i in range(len(PROMPTS))]
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda i: alone(model, i), range(len(PROMPTS))))
    assert got == want


def test_sessions_are_reused_and_a_closed_generation_frees_its_own():
    m = Model.load(str(STORIES), threads=1)
    for p in PROMPTS[:3]:  # one after another: one session, handed on
        m.generate(p, max_new_tokens=8)
    assert len(m._idle) == 1
    first = m._idle[0]
    gen = m.generation(PROMPTS[0], max_new_tokens=64, bc=30)
    assert gen.session is first and not m._idle
    next(gen), next(gen)
    gen.close()
    assert gen.result.stop_reason == "closed" and gen.done
    assert m._idle == [first] and first.cache_len == 0  # back, and empty
    assert list(gen) == []  # a closed generation yields nothing more


def test_the_pool_keeps_at_most_keep_sessions_and_close_frees_them(stories_pkg):
    """QA (qa8a D2): a Model kept one full KV cache for every thread that ever used it (8
    threads: 189 -> 1656 MiB on SmolLM2 int4, never given back) and had no close()."""
    import gc
    import weakref

    m = Model.load(str(stories_pkg), threads=1)
    gens = [m.generation(p, max_new_tokens=4) for p in PROMPTS[:4]]  # four at once
    caches = [weakref.ref(g.session) for g in gens]
    for g in gens:
        g.run()
    del gens
    gc.collect()
    assert len(m._idle) == 1 and sum(r() is not None for r in caches) == 1  # three freed
    m.keep_sessions = 3
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda p: m.generate(p, max_new_tokens=4), PROMPTS[:4]))
    n = len(m._idle)
    assert 1 <= n <= 3 and m.release_sessions() == n and not m._idle
    with Model.load(str(stories_pkg), threads=1, keep_sessions=0) as m0:
        want = m0.generate(PROMPTS[0], max_new_tokens=8).token_ids
        assert not m0._idle  # 0: each cache freed at its generation's end
        gen = m0.generation(PROMPTS[0], max_new_tokens=8)
    assert m0.closed and not m0._idle
    assert gen.run().token_ids == want  # one in progress finishes, then drops its cache
    assert not m0._idle
    with pytest.raises(ConfigError, match="this Model is closed"):
        m0.generate(PROMPTS[0], max_new_tokens=2)
    for bad in (-1, 1.5, "2", True):
        with pytest.raises(ConfigError, match="keep_sessions must be an integer >= 0"):
            Model.load(str(stories_pkg), keep_sessions=bad)


def test_hidden_states_feed_the_lm_head():
    torch = pytest.importorskip("torch")
    m = Model.load(str(STORIES), threads=1)
    s = m.backend.session()
    assert m.backend.supports_hidden
    out = s.forward(np.array([1, 403, 407]), np.arange(3), np.tril(np.ones((3, 3), bool)),
                    None, full_logits=True, hidden=True)
    assert out.hidden.shape == (3, m.backend.hidden_size)
    with torch.no_grad():
        logits = m.backend.hf.lm_head(torch.from_numpy(out.hidden)).numpy()
    np.testing.assert_allclose(logits, out.logits, atol=1e-4)


def test_package_without_hidden_states_says_so(stories_pkg):
    b = Model.load(str(stories_pkg), threads=1).backend
    assert not b.supports_hidden
    with pytest.raises(ConfigError, match="does not export the last hidden states"):
        b.session().forward(np.array([1]), np.array([0]), np.ones((1, 1), bool), None,
                            hidden=True)
