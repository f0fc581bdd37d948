"""What an app developer hands the Python API: wrong types and values are one ConfigError
naming the option (never a TypeError from inside numpy or ctypes), keyword options choose the
drafter as GenerationConfig does, and a stream left early gives its KV cache back.
"""

import numpy as np
import pytest

from edgemtp import ConfigError, GenerationConfig, Model

from conftest import story_prompts

PROMPT = story_prompts(1)[0]


@pytest.fixture(scope="module")
def model(stories_pkg):
    return Model.load(str(stories_pkg), threads=1)


@pytest.mark.parametrize("options, message", [
    (dict(temperature="1"), "temperature must be a number"),
    (dict(temperature=None), "temperature must be a number"),
    (dict(top_p="0.5"), "top_p must be a number"),
    (dict(ema="0.1"), "ema must be a number"),
    (dict(stop=5), "stop must be a string or a list of strings"),
    (dict(tree="static", branching=3), "branching must be a list of integers >= 1"),
    (dict(tree="static", branching=(0,)), "branching must be a list of integers >= 1"),
    (dict(tree="static", branching=(2.5,)), "branching must be a list of integers >= 1"),
    (dict(mask_tokens=2, tree="static", branching=(-3, 2)), "branching must be a list"),
    (dict(max_new_tokens=True), "max_new_tokens must be an integer >= 1"),
    (dict(seed=True), "seed must be an integer >= 0"),
    (dict(top_k=1.5), "top_k must be an integer >= 0"),
    (dict(calibrate="no"), "calibrate must be True or False"),
    (dict(prune=None), "prune must be True or False"),
    (dict(eos_token_ids=("a",)), "eos_token_ids must be token ids"),
    (dict(eos_token_ids=(-1,)), "eos_token_ids must be token ids"),
    (dict(mask_init="vector", mask_vector=(float("nan"),) * 64), "mask_vector must be"),
    (dict(foo=1), "unknown generation option foo; the options are max_new_tokens"),
])
def test_a_wrong_option_is_one_config_error(model, options, message):
    with pytest.raises(ConfigError, match=message):
        model.generate(PROMPT, **{"max_new_tokens": 4, **options})


@pytest.mark.parametrize("prompt, message", [
    (None, "the prompt must be text .* got NoneType"),
    (5, "the prompt must be text .* got int"),
    (b"Once", "the prompt must be text .* got bytes"),
    ([[1, 403]], r"token ids must be integers, got \[1, 403\]"),
    (["a", "b"], "token ids must be integers, got 'a'"),
    ([1.7, 403.2], "token ids must be integers, got 1.7"),
    ([True, 3], "token ids must be integers, got True"),
    ([1, 2 ** 70], r"prompt token ids must be in \[0, 512\)"),
    ([1, -1], r"prompt token ids must be in \[0, 512\)"),
])
def test_a_wrong_prompt_is_one_config_error(model, prompt, message):
    with pytest.raises(ConfigError, match=message):
        model.generate(prompt, max_new_tokens=4)


def test_other_wrong_arguments_are_config_errors(model):
    with pytest.raises(ConfigError, match="config must be a GenerationConfig, got dict"):
        model.generate(PROMPT, {"bc": 10})
    with pytest.raises(ConfigError, match="the model path must be a string or a path"):
        Model.load(None)
    with pytest.raises(ConfigError, match="max_new_tokens must be an integer >= 1"):
        model.stream(PROMPT, max_new_tokens=0)  # at the call, not at the first next()


def test_numpy_integers_and_one_eos_id_are_taken(model):
    ids = model.encode(PROMPT)
    want = model.generate(ids, max_new_tokens=6, drafter="none").token_ids
    assert model.generate(np.array(ids), max_new_tokens=np.int64(6),
                          drafter="none").token_ids == want
    assert GenerationConfig(eos_token_ids=2).eos_token_ids == (2,)
    assert GenerationConfig(stop=None).stop == ()


def test_keyword_probing_options_mean_probing_as_in_the_config():
    # the README: asking for mask tokens or a static tree without a drafter means probing;
    # Model.generate(**options) builds its config with with_() on a default one
    assert GenerationConfig().with_(mask_tokens=2).drafter == "probe"
    assert GenerationConfig().with_(tree="static").drafter == "probe"
    assert GenerationConfig().with_(bc=10).drafter == "auto"
    assert GenerationConfig().with_(bc=10).mask_tokens == 1
    assert GenerationConfig(mask_tokens=2).with_(bc=60).drafter == "probe"
    assert GenerationConfig(drafter="pld").with_(bc=10).drafter == "pld"
    assert GenerationConfig().with_(mask_tokens=2).with_(mask_tokens=1).drafter == "probe"


def test_keyword_mask_tokens_run_probing(model):
    r = model.generate(PROMPT, max_new_tokens=32, mask_tokens=2, bc=60)
    assert r.stats.mask_tokens == 2 and not r.stats.steps_by_kind  # (auto reports its kinds)
    want = model.generate(PROMPT, max_new_tokens=32, drafter="none").token_ids
    assert r.token_ids == want


def test_a_tiny_temperature_samples_the_argmax(model):
    want = model.generate(PROMPT, max_new_tokens=8, drafter="none").token_ids
    for t in (1e-300, 1e-310):  # (1e-310: every logit / T overflowed, NaN probabilities)
        got = model.generate(PROMPT, max_new_tokens=8, drafter="none", temperature=t)
        assert got.token_ids == want, t


def test_a_stream_left_early_gives_its_cache_back(stories_pkg):
    m = Model.load(str(stories_pkg), threads=1)
    assert m.last_result is None  # (README QA: no stream has finished yet)
    m.generate(PROMPT, max_new_tokens=4)
    assert len(m._idle) == 1 and m.last_result is None  # (generate is not a stream)
    first = m._idle[0]
    s = m.stream(PROMPT, max_new_tokens=64)
    next(s)
    assert not m._idle
    s.close()
    assert m._idle == [first] and first.cache_len == 0
    s = m.stream(PROMPT, max_new_tokens=64)  # closed before its first item (the review's)
    assert not m._idle
    s.close()
    assert m._idle == [first]
    s = m.stream(PROMPT, max_new_tokens=64)
    del s  # dropped unstarted
    assert m._idle == [first]
    for i, _ in enumerate(m.stream(PROMPT, max_new_tokens=64)):
        if i == 1:
            break
    assert m._idle == [first]
    text = "".join(m.stream(PROMPT, max_new_tokens=16))  # and a whole one still ends right
    assert text == m.last_result.text and m._idle == [first]


def test_a_generation_is_a_context_manager(stories_pkg):
    m = Model.load(str(stories_pkg), threads=1)
    m.generate(PROMPT, max_new_tokens=4)
    first = m._idle[0]
    with m.generation(PROMPT, max_new_tokens=64) as gen:
        next(gen)
        assert not m._idle
    assert gen.result.stop_reason == "closed" and m._idle == [first]


def test_every_path_gives_the_text_as_it_reads_after_the_prompt(model):
    """QA (qa6 gguf, 2): a step-by-step generation's result had no text; generate's, a
    stream's and the CLI's had the decode of the new ids alone ("was": SentencePiece drops
    the first token's leading space), where the server gave " was"."""
    prompt = "Once upon a time, there"
    gen = model.generation(prompt, max_new_tokens=6, drafter="none")
    gen.run()
    want = gen.result.text
    assert want.startswith(" ") and want[1:] == model.tokenizer.decode(gen.result.token_ids)
    assert model.generate(prompt, max_new_tokens=6, drafter="none").text == want
    assert "".join(model.stream(prompt, max_new_tokens=6, drafter="none")) == want
    assert model.last_result.text == want
