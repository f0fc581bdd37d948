"""The tokenizer a package runs with (``tokenizers`` on its tokenizer.json, no transformers)
encodes and decodes exactly as ``AutoTokenizer`` does, and the streaming detokenizer's
deltas add up to the whole text however the tokens arrive."""

import json

import pytest

from edgemtp.serve.scheduler import StopText
from edgemtp.tokenizer import TextStream, Tokenizer

from conftest import SHARED, STORIES, story_prompts

TEXTS = story_prompts(48) + [
    json.loads(line)["turns"][0]
    for line in open(SHARED / "data" / "spec_bench" / "question.jsonl")][:120] + [
    "  leading spaces", "tabs\tand\nnewlines", "ünïcödé 日本語 🙂 ok", "</s> <s> special", " "]


@pytest.fixture(scope="module")
def pair(stories_pkg):
    transformers = pytest.importorskip("transformers")
    return Tokenizer(str(stories_pkg)), transformers.AutoTokenizer.from_pretrained(STORIES)


def test_package_tokenizer_equals_autotokenizer(pair):
    ours, hf = pair
    assert ours._fast is not None  # the tokenizers path, not transformers
    for text in TEXTS:
        ids = hf(text).input_ids
        assert ours.encode(text) == ids, text
        assert ours.decode(ids + [5, 300]) == hf.decode(ids + [5, 300], skip_special_tokens=True)


@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_stream_deltas_add_up_to_the_text(pair, chunk):
    tok = pair[0]
    for text in TEXTS[::7]:
        ids = tok.encode(text)
        stream = TextStream(tok)
        pieces = [stream.push(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
        assert "".join(pieces) == tok.decode(ids), text
        assert all("\ufffd" not in p for p in pieces)  # no half a character shown


CUT = "Once 🌙🎉 upon ünd 日本"


def _cut_streams(tok):
    """For every prefix of CUT's ids: the stream's deltas (finish included) and the decode."""
    ids = tok.encode(CUT, add_special_tokens=False)
    for n in range(1, len(ids) + 1):
        stream = TextStream(tok)
        shown = "".join(stream.push([i]) for i in ids[:n])
        yield shown + stream.finish(), tok.decode(ids[:n]), ids[:n]


def test_a_stream_cut_inside_a_character_keeps_the_characters_before_it(pair):
    # (the QA's bug: a generation that ended inside an emoji printed one emoji less than its
    # text, the complete one before the cut held back with the cut one and never shown)
    tok, cut_inside = pair[0], 0
    for streamed, text, ids in _cut_streams(tok):
        # every character up to the last whole one (byte fallback decodes a cut run of byte
        # tokens as U+FFFD throughout, the whole characters in it too: the stream keeps
        # those), then U+FFFD where the text ends inside one
        m = max(k for k in range(len(ids) + 1)
                if not tok.decode(ids[:k]).endswith("\ufffd"))
        assert streamed.rstrip("\ufffd") == tok.decode(ids[:m]), (streamed, text)
        assert streamed.endswith("\ufffd") == text.endswith("\ufffd"), (streamed, text)
        cut_inside += m < len(ids)
    assert cut_inside >= 4  # cuts inside 🌙, 🎉, ü and 日本 were tried


def test_the_servers_stop_text_sends_each_character_once_at_a_cut(pair):
    # the server's deltas go through StopText, whose finish gets the whole decode: with byte
    # fallback that decode has U+FFFD where the deltas had the characters before a cut one, and
    # it used to send the decode's tail after them (a character twice, or one lost)
    tok = pair[0]
    ids = tok.encode(CUT, add_special_tokens=False)
    for n in range(1, len(ids) + 1):
        stream, stop = TextStream(tok), StopText(())
        sent = "".join(stop.push(stream.push([i])) for i in ids[:n])
        sent += stop.push(stream.finish())
        sent += stop.finish(tok.decode(ids[:n]))
        streamed = TextStream(tok)  # what the CLI and Model.stream show
        streamed = "".join(streamed.push([i]) for i in ids[:n]) + streamed.finish()
        assert sent == streamed, (sent, streamed)


@pytest.mark.slow
def test_a_byte_level_bpe_stream_cut_inside_a_character_adds_up_to_the_text():
    # SmolLM2's tokenizer (byte-level BPE, from the shared GGUF): the decode of a cut
    # character leaves the characters before it alone, and the deltas add up exactly
    pytest.importorskip("gguf")
    gguf = SHARED / "models" / "SmolLM2-135M-Instruct-GGUF" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    tok = Tokenizer(str(gguf))
    results = list(_cut_streams(tok))
    assert any(text.endswith("\ufffd") for _, text, _ in results)
    for streamed, text, _ in results:
        assert streamed == text
