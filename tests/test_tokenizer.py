"""The tokenizer a package runs with (``tokenizers`` on its tokenizer.json, no transformers)
encodes and decodes exactly as ``AutoTokenizer`` does, and the streaming detokenizer's
deltas add up to the whole text however the tokens arrive."""

import json

import pytest

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
