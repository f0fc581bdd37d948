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
