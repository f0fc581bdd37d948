"""Stopping is exact, even in the middle of an accepted path.

Every case runs probing at BC 60 (k = 2 as in the paper, some with k = 1) on the real
stories260K checkpoint and compares against a plain greedy run (``drafter="none"``) of the
same model, cut where the stop rule says. The expected cut is always computed here, from
the greedy tokens and the tokenizer, never by edgemtp's own stopper.

Cases are picked so that stops land strictly inside the path a step accepted (the step
committed more tokens than were emitted); each test checks that it really exercised such
stops, so it cannot pass vacuously.

About EOS: stories260K (llama2.c TinyStories) never emits its EOS id 2 -- over all 48 shared
prompts id 2 never ranks better than 217th in 300 greedy tokens; a story ends with BOS
(id 1, ``<s>``) instead. So EOS is tested (a) with ``eos_token_ids`` overrides and (b) with a
view of the model folder whose generation_config.json lists ``[2, 1]`` as EOS ids, which
exercises the real loading path of EOS ids.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from edgemtp import ConfigError, GenerationConfig, Model

from conftest import story_prompts

SHARED = Path(__file__).resolve().parents[1] / ".." / "shared"
MODEL_DIR = SHARED / "models" / "stories260K"
EOS_ID, BOS_ID = 2, 1
PROBE = dict(drafter="probe", bc=60, mask_tokens=2)
PROBE_K1 = dict(drafter="probe", bc=60, mask_tokens=1)


PROMPTS = story_prompts()


# -- fixtures and helpers ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def model() -> Model:
    assert MODEL_DIR.is_dir(), f"missing shared model {MODEL_DIR}"
    # one intra-op thread: this tiny model is far faster so, above all on a busy machine
    return Model.load(str(MODEL_DIR), threads=1)


@pytest.fixture(scope="module")
def greedy(model):
    """greedy(prompt, n): the first n tokens of plain greedy decoding, cached per prompt."""
    cache: dict = {}

    def run(prompt, n: int) -> list[int]:
        key = prompt if isinstance(prompt, str) else tuple(prompt)
        have = cache.get(key)
        if have is None or (len(have) < n):
            r = model.generate(prompt, max_new_tokens=n, drafter="none",
                               eos_token_ids=())  # never stop early: the reference is uncut
            assert r.stop_reason == "max_new_tokens" and len(r.token_ids) == n
            have = cache[key] = list(r.token_ids)
        return have[:n]

    return run


@pytest.fixture(scope="module")
def eos_model_dir(tmp_path_factory) -> Path:
    """The shared model folder, seen through symlinks, with EOS ids [2, 1] (1 = story end)."""
    d = tmp_path_factory.mktemp("stories_eos")
    for f in MODEL_DIR.iterdir():
        if f.name != "generation_config.json":
            (d / f.name).symlink_to(f.resolve())
    gen = json.loads((MODEL_DIR / "generation_config.json").read_text())
    gen["eos_token_id"] = [EOS_ID, BOS_ID]
    (d / "generation_config.json").write_text(json.dumps(gen))
    return d


@pytest.fixture(scope="module")
def eos_model(eos_model_dir) -> Model:
    return Model.load(str(eos_model_dir), threads=1)


@pytest.fixture(scope="module")
def small_model() -> Model:
    return Model.load(str(MODEL_DIR), max_context=40, threads=1)


def run_chunks(model: Model, prompt, **options):
    """Run a generation step by step: (tokens each forward pass committed, result)."""
    gen = model.generation(prompt, **options)
    chunks = [list(c) for c in gen]
    result = gen.result
    assert sum(chunks, []) == result.token_ids
    return chunks, result


def stopped_mid_path(chunks, result) -> bool:
    """True when the last step accepted a longer path than it emitted (the stop cut it)."""
    if len(chunks) < 2 or not result.stats.accept_lengths:
        return False  # stopped at prefill
    return len(chunks[-1]) < result.stats.accept_lengths[-1] + 1


def chunk_ends(chunks) -> set[int]:
    """Token counts at which a forward pass's commit ended (cuts there are not mid-path)."""
    ends, n = set(), 0
    for c in chunks:
        n += len(c)
        ends.add(n)
    return ends


def decode(model: Model, ids) -> str:
    return model.tokenizer.decode(list(ids))


# -- sanity: the model and the probing setup -----------------------------------------------------


def test_probing_accepts_multi_token_paths(model, greedy):
    """Otherwise no stop could land mid-path and the tests below would be vacuous."""
    chunks, r = run_chunks(model, PROMPTS[0], max_new_tokens=60, **PROBE)
    assert r.token_ids == greedy(PROMPTS[0], 60)
    assert max(len(c) for c in chunks) >= 2
    assert r.stats.block_efficiency > 1.0


def test_eos_ids_come_from_the_model_folder(model, eos_model):
    assert tuple(model.backend.eos_token_ids) == (EOS_ID,)
    assert tuple(eos_model.backend.eos_token_ids) == (EOS_ID, BOS_ID)


# -- max_new_tokens ------------------------------------------------------------------------------


@pytest.mark.parametrize("probe, prompt_index, ns", [(PROBE, 0, range(1, 41)),
                                                     (PROBE_K1, 3, range(1, 41, 2))],
                         ids=["bc60-k2", "bc60-k1"])
def test_max_new_tokens_is_exact(model, greedy, probe, prompt_index, ns):
    prompt = PROMPTS[prompt_index]
    ref = greedy(prompt, 40)
    mid = 0
    for n in ns:
        chunks, r = run_chunks(model, prompt, max_new_tokens=n, **probe)
        assert r.token_ids == ref[:n], f"max_new_tokens={n}"
        assert r.stop_reason == "max_new_tokens", f"max_new_tokens={n}"
        assert r.stats.new_tokens == n
        mid += stopped_mid_path(chunks, r)
    assert mid >= 3, f"only {mid} of {len(ns)} runs stopped inside an accepted path"


# -- EOS ---------------------------------------------------------------------------------------


def test_eos_override_stops_at_first_occurrence(model, greedy):
    """``eos_token_ids=(t,)`` ends the output at t's first occurrence, t included."""
    prompt, n = PROMPTS[1], 60
    ref = greedy(prompt, n)
    chunks, _ = run_chunks(model, prompt, max_new_tokens=n, **PROBE)
    ends = chunk_ends(chunks)
    first = {}
    for i, t in enumerate(ref):
        first.setdefault(t, i)
    frequent = [t for t, _ in Counter(ref).most_common(3)]
    mid_path = [t for t, i in sorted(first.items(), key=lambda kv: kv[1]) if i + 1 not in ends]
    picks = list(dict.fromkeys(frequent + mid_path[:5]))
    assert len(mid_path) >= 2, "the probing run accepted too few multi-token paths"
    mid = 0
    for t in picks:
        cut = first[t] + 1
        chunks, r = run_chunks(model, prompt, max_new_tokens=n, eos_token_ids=(t,), **PROBE)
        assert r.token_ids == ref[:cut], f"eos {t}"
        assert r.token_ids[-1] == t and t not in r.token_ids[:-1]
        assert r.stop_reason == "eos", f"eos {t}"
        mid += stopped_mid_path(chunks, r)
    assert mid >= 2
    # several EOS ids: the earliest of them wins
    a, b = mid_path[0], mid_path[1]
    r = model.generate(prompt, max_new_tokens=n, eos_token_ids=(b, a), **PROBE)
    assert r.token_ids == ref[:min(first[a], first[b]) + 1] and r.stop_reason == "eos"


def test_eos_override_through_config_object(model, greedy):
    prompt = PROMPTS[1]
    ref = greedy(prompt, 60)
    t = ref[7]
    cfg = GenerationConfig(max_new_tokens=60, eos_token_ids=(t,), **PROBE)
    r = model.generate(prompt, cfg)
    assert r.token_ids == ref[:ref.index(t) + 1] and r.stop_reason == "eos"


def _story_end_cases(model, greedy, limit=200):
    """Prompts whose greedy output ends its story (an EOS id of eos_model) within limit."""
    cases = []
    for i in (20, 1):  # stories end after 144 and 150 tokens
        ref = greedy(PROMPTS[i], limit)
        hits = [j for j, t in enumerate(ref) if t in (EOS_ID, BOS_ID)]
        if hits:
            cases.append((PROMPTS[i], ref[:hits[0] + 1]))
    return cases


@pytest.mark.slow  # (~10-16 s of the default run; CI runs the slow set)
def test_eos_from_generation_config_stops_at_story_end(model, eos_model, greedy):
    cases = _story_end_cases(model, greedy)
    assert len(cases) == 2, "expected greedy stories that end within 200 tokens"
    mid = 0
    for prompt, expected in cases:
        for probe in (PROBE, PROBE_K1, dict(drafter="none")):
            chunks, r = run_chunks(eos_model, prompt, max_new_tokens=300, **probe)
            assert r.token_ids == expected, (prompt, probe)
            assert r.stop_reason == "eos", (prompt, probe)
            mid += stopped_mid_path(chunks, r)
    assert mid >= 1, "no EOS stop landed inside an accepted path"


def test_empty_eos_override_disables_eos(eos_model, model, greedy):
    prompt, expected = _story_end_cases(model, greedy)[0]
    n = len(expected) + 10
    r = eos_model.generate(prompt, max_new_tokens=n, eos_token_ids=(), **PROBE)
    assert r.stop_reason == "max_new_tokens"
    assert r.token_ids == greedy(prompt, n)


# -- stop strings --------------------------------------------------------------------------------


def _expected_stop_cut(model, ref, stops) -> int | None:
    """Smallest m such that decode(ref[:m]) contains a stop string, by decoding prefixes."""
    for m in range(1, len(ref) + 1):
        text = decode(model, ref[:m])
        if any(s in text for s in stops):
            return m
    return None


def test_stop_strings_cut_at_first_match(model, greedy):
    prompt, n = PROMPTS[2], 120
    ref = greedy(prompt, n)
    full = decode(model, ref)
    chunks, _ = run_chunks(model, prompt, max_new_tokens=n, **PROBE)
    ends = chunk_ends(chunks)

    natural = [s for s in ("park", ".", "\n", '"', " day", ", ", "big", "She", "happy")
               if s in full]
    # targeted: text that first appears with a token that is not the last of its commit
    targeted = []
    for j in range(2, n):
        if j in ends:
            continue
        before, upto = decode(model, ref[:j - 1]), decode(model, ref[:j])
        for length in (2, 4, 7):
            s = upto[-length:]
            if len(upto) >= length and s not in before and s.strip():
                targeted.append(s)
                break
        if len(targeted) >= 5:
            break
    assert len(natural) >= 4 and len(targeted) >= 3
    mid = 0
    for s in natural + targeted:
        cut = _expected_stop_cut(model, ref, [s])
        assert cut is not None
        chunks, r = run_chunks(model, prompt, max_new_tokens=n, stop=(s,), **PROBE)
        assert r.token_ids == ref[:cut], f"stop {s!r}"
        assert r.stop_reason == "stop_string", f"stop {s!r}"
        assert s in decode(model, r.token_ids) and s not in decode(model, r.token_ids[:-1])
        mid += stopped_mid_path(chunks, r)
    assert mid >= 3, f"only {mid} stop-string stops landed inside an accepted path"


def test_several_stop_strings_earliest_wins(model, greedy):
    prompt, n = PROMPTS[2], 120
    ref = greedy(prompt, n)
    full = decode(model, ref)
    late, early = full[-12:-6], full[30:35]
    stops = (late, early)
    cut = _expected_stop_cut(model, ref, stops)
    r = model.generate(prompt, max_new_tokens=n, stop=stops, **PROBE_K1)
    assert r.token_ids == ref[:cut] and r.stop_reason == "stop_string"


def test_stop_string_across_story_end(model, eos_model, greedy):
    """A stop string spanning the skipped special token that ends a story."""
    prompt, expected = _story_end_cases(model, greedy)[0]
    ref = greedy(prompt, len(expected) + 20)
    text = decode(model, ref)
    end = len(decode(model, expected))
    s = text[end - 3:end + 5]  # e.g. 'un. Once'
    cut = _expected_stop_cut(model, ref, [s])
    assert cut is not None and cut > len(expected)
    r = model.generate(prompt, max_new_tokens=len(ref), stop=(s,), **PROBE)
    assert r.token_ids == ref[:cut] and r.stop_reason == "stop_string"


def test_eos_wins_over_a_stop_string_the_same_token_completes(model, greedy):
    """qa10a E6: the documented order (EOS, then a stop string) had no test. The first
    generated token made EOS by override and its text the stop string: the reason is eos."""
    prompt = "Once upon a time, there"
    ref = greedy(prompt, 20)
    for options in (dict(drafter="none"), PROBE):
        r = model.generate(prompt, max_new_tokens=20, stop=(" was",),
                           eos_token_ids=(ref[0],), **options)
        assert r.token_ids == ref[:1] and r.stop_reason == "eos", options


def test_a_stop_string_may_begin_with_the_first_tokens_leading_space(model, greedy):
    # SentencePiece decodes a first token alone without its leading space; the stop string is
    # looked for in the text as it reads after the prompt (" was" stopped at token 57 before)
    prompt = "Once upon a time, there"
    ref = greedy(prompt, 20)
    first = decode(model, ref[:1])
    assert first == "was" and " was" not in decode(model, ref[:1])
    for options in (dict(drafter="none"), PROBE):
        r = model.generate(prompt, max_new_tokens=20, stop=(" was",), **options)
        assert r.token_ids == ref[:1] and r.stop_reason == "stop_string", options
    # generated text only: a string that begins in the prompt does not stop it
    r = model.generate("Once upon a time", max_new_tokens=12, stop=("time,",), **PROBE)
    assert r.stop_reason == "max_new_tokens"


def test_a_multibyte_stop_string_is_found_however_many_tokens_it_takes(model):
    # byte fallback (stories260K) and byte-level BPE split a character into up to 4 tokens:
    # the look-back window counts bytes, not characters (an emoji stop never matched)
    from edgemtp.engine import Stopper
    tok = model.tokenizer
    cases = [("Tom saw a star 🌟🌟 over the 日本 hill and smiled", s)
             for s in ("🌟🌟", "🌟 over", "日本", "本 hill")]
    # (the review's: byte tokens of another character right before or after the stop string
    # in one run; byte fallback decodes a run with a cut character as U+FFFD throughout)
    cases += [("Tom saw 日🌟日本語 and smiled", "🌟"), ("Tom saw 日🌟 over the hill", "🌟"),
              ("Tom saw 日🌟日本語 and smiled", "日本")]
    for text, stop in cases:
        ids = tok.encode(text, add_special_tokens=False)
        expected = next(m for m in range(1, len(ids) + 1) if stop in tok.decode(ids[:m]))
        assert expected >= len(stop) + 2  # (more tokens than characters: the old window)
        for chunk in (1, 2, 3, 7):
            stopper = Stopper(GenerationConfig(stop=(stop,)), (), 10 ** 6, tok.decode)
            kept = 0
            for i in range(0, len(ids), chunk):
                kept += stopper.push(ids[i:i + chunk])
                if stopper.reason:
                    break
            assert stopper.reason == "stop_string" and kept == expected, (text, stop, chunk)
            assert stopper.tokens == ids[:expected]
    # a prompt that ends inside a run of byte tokens: its last token is no prefix to decode
    # the first generated ones after (it turned their text into U+FFFD)
    prompt = tok.encode("Tom saw 日", add_special_tokens=False)
    ids = tok.encode("Tom saw 日🌟 and he smiled", add_special_tokens=False)[len(prompt):]
    stopper = Stopper(GenerationConfig(stop=("🌟",)), (), 10 ** 6, tok.decode, prompt[-1])
    kept = sum(stopper.push([i]) for i in ids[:8] if not stopper.reason)
    assert stopper.reason == "stop_string" and kept == 4


def test_stop_string_absent_from_output(model, greedy):
    prompt = PROMPTS[2]
    word = "school"  # in the prompt, not in the first 40 generated tokens
    ref = greedy(prompt, 40)
    assert word in prompt and word not in decode(model, ref)
    r = model.generate(prompt, max_new_tokens=40, stop=(word, "zebra-xylophone"), **PROBE)
    assert r.token_ids == ref and r.stop_reason == "max_new_tokens"


# -- full cache ----------------------------------------------------------------------------------


def _prompt_ids(model, greedy, t: int) -> list[int]:
    """A real token-id prompt of exactly t tokens: a story prompt, then its greedy text."""
    ids = model.encode(PROMPTS[0])
    return (ids + greedy(PROMPTS[0], 60))[:t]


@pytest.mark.parametrize("t", [12, 17, 27, 33, 38, 39])
@pytest.mark.parametrize("probe", [PROBE, PROBE_K1, dict(drafter="none")],
                         ids=["bc60-k2", "bc60-k1", "greedy"])
def test_full_cache_stops_exactly(small_model, model, greedy, t, probe):
    assert small_model.backend.max_context == 40
    prompt = _prompt_ids(model, greedy, t)
    expected = greedy(prompt, 40 - t)
    gen, peak = small_model.generation(prompt, max_new_tokens=200, **probe), 0
    for _ in gen:
        peak = max(peak, gen.session.cache_len if gen.session is not None else 0)
    r = gen.result
    assert len(r.token_ids) == 40 - t
    assert r.token_ids == expected
    assert r.stop_reason == "max_context"
    assert peak <= 40  # (a generation that ends at prefill hands its session back at once)


def test_full_cache_with_text_prompts(small_model, greedy):
    seen = set()
    for prompt in PROMPTS[:12]:
        t = len(small_model.encode(prompt))
        if t in seen:
            continue
        seen.add(t)
        r = small_model.generate(prompt, max_new_tokens=500, **PROBE)
        assert r.token_ids == greedy(prompt, 40 - t), prompt
        assert r.stop_reason == "max_context"
    assert len(seen) >= 3


@pytest.mark.parametrize("t", [40, 41, 57])
def test_prompt_filling_the_cache_is_a_config_error(small_model, model, greedy, t):
    prompt = _prompt_ids(model, greedy, t)
    assert len(prompt) == t
    with pytest.raises(ConfigError, match=r"max context is 40"):
        small_model.generate(prompt, max_new_tokens=5, **PROBE)
    # still usable afterwards
    r = small_model.generate(PROMPTS[0], max_new_tokens=3, **PROBE)
    assert r.token_ids == greedy(PROMPTS[0], 3)


def test_long_text_prompt_is_a_config_error(small_model):
    prompt = " ".join(PROMPTS[:4])
    with pytest.raises(ConfigError, match=r"max context is 40"):
        small_model.generate(prompt, max_new_tokens=5)


# -- streaming -----------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["max_new_tokens", "stop_string", "eos", "max_context"])
def test_stream_text_equals_final_text(model, eos_model, small_model, greedy, case):
    prompt = PROMPTS[5]
    m, options = model, dict(max_new_tokens=50, **PROBE)
    if case == "stop_string":
        options["stop"] = (decode(model, greedy(prompt, 50))[60:64],)
    elif case == "eos":
        prompt, expected = _story_end_cases(model, greedy)[0]
        m, options = eos_model, dict(max_new_tokens=300, **PROBE)
    elif case == "max_context":
        m, options = small_model, dict(max_new_tokens=300, **PROBE)
    gen = m.stream(prompt, **options)
    pieces = []
    while True:
        try:
            pieces.append(next(gen))
        except StopIteration as stop:
            returned = stop.value
            break
    final = m.last_result
    assert returned is final
    assert final.stop_reason == case
    assert all(isinstance(p, str) and p for p in pieces)
    assert len(pieces) >= 2
    assert "".join(pieces) == final.text
    # the text as it reads after the prompt: SentencePiece's leading space kept, which the
    # decode of the new ids alone drops (the server's text, text_after)
    assert final.text.startswith(" ") and final.text[1:] == decode(m, final.token_ids)
    same = m.generate(prompt, **options)
    assert same.token_ids == final.token_ids and same.text == final.text
