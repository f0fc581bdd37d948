"""The ``edgemtp`` command line, run for real in subprocesses.

Bad input must end in exit code 2 and exactly one line on stderr that says what was wrong
(no traceback, no usage dump); good input must print what the docs promise, with the same
tokens ``transformers`` greedy decoding gives.

Subprocesses are started together (a small pool) the first time a test needs one, so the
whole file costs a few model loads of wall time rather than one per case.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from conftest import story_prompts

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT / ".." / "shared"
MODEL_DIR = SHARED / "models" / "stories260K"
EXIT_USAGE = 2
MAX_NEW = 40

PROMPT = story_prompts(1)[0]  # "Amy and Ben were playing with a happy toy."

LONG_PROMPT = ("Once upon a time, in a soft school, there lived a little girl named Lily who "
               "loved to play with her friends in the big green park every day.")

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}

# (id, argv after "generate" with {model}/{missing}/{noconfig}/{bert} placeholders,
#  regexes the one stderr line must match, case-insensitive)
M = ["--model", "{model}"]
P = ["--prompt", "Once upon a time"]
ERROR_CASES = [
    ("missing-model-folder", ["--model", "{missing}", *P], [r"does not exist", r"nope-model"]),
    ("folder-without-config", ["--model", "{noconfig}", *P], [r"config\.json"]),
    ("not-a-causal-lm", ["--model", "{bert}", *P],
     [r"bert", r"supported", r"llama", r"mistral", r"qwen2", r"qwen3"]),
    ("bc-too-small-for-k", [*M, *P, "--drafter", "probe", "--bc", "3", "-k", "2"],
     [r"too small", r"\b3\b", r"k=2"]),
    ("empty-prompt", [*M, "--prompt", ""], [r"prompt", r"empty"]),
    ("missing-prompt", [*M], [r"--prompt"]),
    ("unknown-option", [*M, *P, "--frobnicate"], [r"unrecognized", r"--frobnicate"]),
    ("bad-branching", [*M, *P, "--branching", "a,b"], [r"--branching", r"a,b", r"integers"]),
    ("branching-with-dynamic-tree", [*M, *P, "--branching", "2", "--tree", "dynamic"],
     [r"branching", r"static"]),
    ("negative-temperature", [*M, *P, "--temperature", "-1"], [r"temperature", r"-1"]),
    ("zero-top-p", [*M, *P, "--top-p", "0"], [r"top[-_ ]p", r"\(0, 1\]"]),
    ("zero-max-new-tokens", [*M, *P, "--max-new-tokens", "0"], [r"max[-_ ]new[-_ ]tokens", r"1"]),
    ("prompt-longer-than-context", [*M, "--prompt", LONG_PROMPT, "--max-context", "16"],
     [r"max context", r"\b16\b", r"prompt has \d+ tokens"]),
    ("bad-dtype", [*M, *P, "--dtype", "fp8"], [r"--dtype", r"fp8"]),
    ("negative-seed", [*M, *P, "--seed", "-1"], [r"seed", r">= 0", r"-1"]),
    ("zero-threads", [*M, *P, "--threads", "0"], [r"threads", r">= 1"]),
    ("unknown-device", [*M, *P, "--device", "tpu"], [r"device", r"tpu"]),
    ("lade-over-budget", [*M, *P, "--drafter", "lade", "--lade", "5,8,7", "--bc", "30"],
     [r"L=5, W=8, G=7", r"\b60\b", r"budget 30"]),
    ("lade-shape-without-lade", [*M, *P, "--lade", "3,4,1"], [r"lookahead", r"lade"]),
    ("tree-cost-on-pld", [*M, *P, "--drafter", "pld", "--tree-cost", "measured"],
     [r"tree_cost", r"hybrid", r"stand"]),
    ("lade-shape-not-three", [*M, *P, "--drafter", "lade", "--lade", "3,4"],
     [r"three integers", r"\(L, W, G\)"]),
    ("huge-bc", [*M, *P, "--bc", "100000"], [r"100000", r"1024"]),
    ("huge-plan-table", [*M, *P, "--drafter", "probe", "--bc", "1000", "-k", "3"],
     [r"shapes", r"--tree static"]),
    ("invalid-utf8-prompt", [*M, "--prompt", "Once \udcff upon"], [r"not valid UTF-8"]),
    ("negative-threads", [*M, *P, "--threads", "-1"], [r"threads", r">= 1", r"-1"]),
    # (tens of thousands of threads segfaulted or hung the runtimes)
    ("too-many-threads", [*M, *P, "--threads", "65536"], [r"threads must be at most \d+",
                                                           r"cores", r"65536"]),
    ("hub-id-unreachable", ["--model", "HuggingFaceTB/no-such-model-here", *P],
     [r"not a local folder", r"no-such-model-here"]),
    ("dtype-on-a-package", ["--model", "{pkg}", *P, "--dtype", "bf16"],
     [r"fp32 weights", r"fixed at export"]),
    ("threads-on-a-package", ["--model", "{pkg}", *P, "--threads", "-1"], [r"threads", r"-1"]),
]

# positive runs: (id, argv after "generate")
COMMON = ["--model", "{model}", "--prompt", PROMPT, "--max-new-tokens", str(MAX_NEW),
          "--threads", "1"]
# (json-bc60 and json-default on the Hugging Face folder, through PyTorch; the others on its
# exported package, through onnxruntime, which starts in ~1 s rather than ~9 s of imports:
# every one must still give transformers' greedy tokens, and plain-stream json-bc60's text)
PKG_COMMON = ["--model", "{pkg}", *COMMON[2:]]
GOOD_CASES = {
    "json-bc60": [*COMMON, "--json", "--drafter", "probe", "--bc", "60", "-k", "2"],
    "json-stream": [*PKG_COMMON, "--json", "--stream", "--drafter", "probe"],
    "json-default": [*COMMON, "--json"],
    "plain-stream": [*PKG_COMMON, "--drafter", "probe", "--bc", "60", "-k", "2"],
    "json-lade": [*PKG_COMMON, "--json", "--drafter", "lade", "--bc", "10", "--lade", "3,3,2"],
}


def _fill(argv: list[str], paths: dict[str, str]) -> list[str]:
    return [a.format(**paths) if a.startswith("{") else a for a in argv]


def _run(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "edgemtp.cli", "generate", *argv],
                          capture_output=True, text=True, cwd=ROOT, env=ENV, timeout=300)


# which positive runs each test reads (so a -k selection starts only what it needs)
NEEDS = {"test_json_prints_one_result_object": ["json-bc60"],
         "test_json_stream_lines_add_up_to_the_result": ["json-stream"],
         "test_plain_mode_streams_text_and_one_stats_line": ["plain-stream", "json-bc60"],
         "test_lookahead_drafter_from_the_command_line": ["json-lade"],
         "test_default_drafter_is_auto": ["json-default"]}
# the slow ones: they import torch and load a model or its config
SLOW = {"json-bc60", "json-default", "not-a-causal-lm", "prompt-longer-than-context"}


class Runs:
    """CLI runs on a small thread pool; ``runs[case_id]`` waits for that run's result."""

    def __init__(self, jobs: dict[str, list[str]]) -> None:
        self.jobs, self.futures = jobs, {}
        self.pool = ThreadPoolExecutor(max_workers=4)

    def start(self, case_ids) -> None:
        for cid in sorted(case_ids, key=lambda c: c not in SLOW):
            if cid not in self.futures:
                self.futures[cid] = self.pool.submit(_run, self.jobs[cid])

    def __getitem__(self, case_id: str) -> subprocess.CompletedProcess:
        self.start([case_id])
        return self.futures[case_id].result()


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory, stories_pkg):
    """Every CLI run the selected tests of this file need, started together."""
    from transformers import BertConfig

    tmp = tmp_path_factory.mktemp("cli")
    (tmp / "noconfig").mkdir()
    (tmp / "noconfig" / "README.md").write_text("not a model\n")
    BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
               intermediate_size=32).save_pretrained(tmp / "bert")
    paths = {"model": str(MODEL_DIR), "missing": str(tmp / "nope-model"),
             "noconfig": str(tmp / "noconfig"), "bert": str(tmp / "bert"),
             "pkg": str(stories_pkg)}
    jobs = {cid: _fill(argv, paths) for cid, argv, _ in ERROR_CASES}
    jobs.update({cid: _fill(argv, paths) for cid, argv in GOOD_CASES.items()})
    r = Runs(jobs)
    needed = set()
    for item in request.session.items:
        if getattr(item, "module", None) is not request.module:
            continue
        params = getattr(getattr(item, "callspec", None), "params", {})
        needed.update([params["case_id"]] if "case_id" in params else
                      NEEDS.get(getattr(item, "originalname", item.name), []))
    r.start(needed)
    yield r
    r.pool.shutdown(wait=True, cancel_futures=True)


_PROGRESS = re.compile(r"^\s*(Loading weights|Loading checkpoint shards)|\d+%\|")


def message_lines(stderr: str) -> list[str]:
    """stderr lines that are not transformers/tqdm progress bars (which redraw with \\r)."""
    return [ln for ln in stderr.splitlines() if ln.strip() and not _PROGRESS.search(ln)]


# -- bad input -----------------------------------------------------------------------------------


@pytest.mark.parametrize("case_id, argv, patterns", ERROR_CASES,
                         ids=[c[0] for c in ERROR_CASES])
def test_bad_input_is_one_line_error(runs, case_id, argv, patterns):
    p = runs[case_id]
    assert "Traceback" not in p.stderr, p.stderr
    assert p.returncode == EXIT_USAGE, (p.returncode, p.stderr)
    lines = message_lines(p.stderr)
    assert len(lines) == 1, f"expected one error line, got {lines!r}"
    line = lines[0]
    assert line.startswith("edgemtp") and "error:" in line, line
    for pat in patterns:
        assert re.search(pat, line, re.IGNORECASE), f"{pat!r} not in {line!r}"
    assert p.stdout.strip() == "", p.stdout


# -- good input ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_greedy() -> list[int]:
    """transformers' own greedy decoding of PROMPT, tokenized exactly as AutoTokenizer does."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(str(MODEL_DIR))
    hf = AutoModelForCausalLM.from_pretrained(str(MODEL_DIR)).eval()
    ids = tok(PROMPT).input_ids
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=int),
                          max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(MODEL_DIR))


def _ok(p: subprocess.CompletedProcess) -> None:
    assert "Traceback" not in p.stderr, p.stderr
    assert p.returncode == 0, p.stderr


def _check_result_object(obj: dict, bc: int, k: int | None, tokenizer) -> None:
    for key, typ in (("text", str), ("token_ids", list), ("forward_calls", int),
                     ("block_efficiency", (int, float)), ("tokens_per_second", (int, float)),
                     ("bc", int), ("mask_tokens", int), ("stop_reason", str)):
        assert key in obj, f"missing {key!r} in {sorted(obj)}"
        assert isinstance(obj[key], typ) and not isinstance(obj[key], bool), (key, obj[key])
    ids = obj["token_ids"]
    assert ids and all(isinstance(t, int) and not isinstance(t, bool) for t in ids)
    assert len(ids) <= MAX_NEW
    assert obj["stop_reason"] in ("eos", "stop_string", "max_new_tokens", "max_context")
    if len(ids) < MAX_NEW:
        assert obj["stop_reason"] != "max_new_tokens"
    assert 1 <= obj["forward_calls"] <= len(ids)
    assert obj["block_efficiency"] == pytest.approx(len(ids) / obj["forward_calls"], abs=1e-4)
    assert obj["tokens_per_second"] > 0
    assert obj["bc"] == bc and (k is None or obj["mask_tokens"] == k)
    # the text as it reads after the prompt (a SentencePiece first token's leading space
    # kept, as the API and the server give it)
    assert obj["text"].removeprefix(" ") == tokenizer.decode(ids, skip_special_tokens=True)


def test_json_prints_one_result_object(runs, tokenizer, hf_greedy):
    p = runs["json-bc60"]
    _ok(p)
    lines = [ln for ln in p.stdout.splitlines() if ln.strip()]
    assert len(lines) == 1, p.stdout
    obj = json.loads(lines[0])
    assert isinstance(obj, dict)
    _check_result_object(obj, bc=60, k=2, tokenizer=tokenizer)
    assert obj["stop_reason"] == "max_new_tokens" and len(obj["token_ids"]) == MAX_NEW
    assert obj["block_efficiency"] > 1.0  # probing did accept drafted tokens
    # lossless: exactly transformers' greedy tokens
    assert obj["token_ids"] == hf_greedy


def test_json_stream_lines_add_up_to_the_result(runs, tokenizer, hf_greedy):
    p = runs["json-stream"]
    _ok(p)
    objs = [json.loads(ln) for ln in p.stdout.splitlines() if ln.strip()]
    assert len(objs) >= 2
    *steps, final = objs
    _check_result_object(final, bc=30, k=1, tokenizer=tokenizer)
    assert all(set(s) == {"token_ids"} and s["token_ids"] for s in steps), steps[:3]
    assert sum((s["token_ids"] for s in steps), []) == final["token_ids"]
    assert len(steps) == final["forward_calls"]  # one line per forward pass
    assert final["token_ids"] == hf_greedy


def test_plain_mode_streams_text_and_one_stats_line(runs):
    text_run, json_run = runs["plain-stream"], runs["json-bc60"]
    _ok(text_run)
    _ok(json_run)
    expected = json.loads(json_run.stdout)["text"]
    assert text_run.stdout.endswith("\n")
    assert text_run.stdout.strip() == expected.strip()
    lines = message_lines(text_run.stderr)
    assert len(lines) == 1, lines
    assert re.match(rf"^\[max_new_tokens\] {MAX_NEW} tokens in \d+ forward calls", lines[0]), lines
    assert "BC 60" in lines[0] and "k 2" in lines[0], lines[0]


def test_default_drafter_is_auto(runs, tokenizer, hf_greedy):
    # no --drafter, no probing option: auto (speculates only where it pays on this device;
    # which mask-token plans it may use depends on the measured latency, so k is not fixed)
    p = runs["json-default"]
    _ok(p)
    obj = json.loads(p.stdout)
    _check_result_object(obj, bc=30, k=None, tokenizer=tokenizer)
    assert obj["drafter"] == "auto" and obj["token_ids"] == hf_greedy


def test_lookahead_drafter_from_the_command_line(runs, tokenizer, hf_greedy):
    p = runs["json-lade"]
    _ok(p)
    obj = json.loads(p.stdout)
    _check_result_object(obj, bc=10, k=0, tokenizer=tokenizer)
    assert obj["token_ids"] == hf_greedy
    assert obj["block_efficiency"] > 1.0


def test_hf_prompt_tokenization_matches(tokenizer):
    """The CLI's tokenizer is exactly AutoTokenizer(TEXT).input_ids (BOS included)."""
    from edgemtp.tokenizer import Tokenizer

    ids = tokenizer(PROMPT).input_ids
    assert ids[0] == tokenizer.bos_token_id
    assert Tokenizer(str(MODEL_DIR)).encode(PROMPT) == ids


@pytest.mark.parametrize("name, value, message", [
    ("EDGEMTP_THREADS", "two", "EDGEMTP_THREADS must be a positive integer, got 'two'"),
    # the default drafter (auto) reads it when it looks for a kept latency curve
    ("EDGEMTP_LATENCY_CACHE", "yes", "EDGEMTP_LATENCY_CACHE must be 1 (keep measured latency "
                                     "curves) or 0 (measure every time), got 'yes'")])
def test_bad_environment_variable_is_one_line_error(stories_pkg, name, value, message):
    p = subprocess.run([sys.executable, "-m", "edgemtp.cli", "generate", "--model",
                        str(stories_pkg), "--prompt", "hi", "--max-new-tokens", "4"],
                       capture_output=True, text=True, cwd=ROOT, env={**ENV, name: value},
                       timeout=300)
    assert p.returncode == EXIT_USAGE and "Traceback" not in p.stderr, p.stderr
    assert message_lines(p.stderr) == [f"edgemtp: error: {message}"]


@pytest.mark.parametrize("requantize", ["none", "head"])
def test_symmetric_with_an_explicit_requantize_that_keeps_blocks_is_one_line(requantize,
                                                                             tmp_path, capsys):
    # --symmetric re-quantizes every weight: asking it to keep a GGUF's blocks too is a
    # contradiction, refused before anything is read or written (the bare defaults are fine)
    from edgemtp.cli import main

    out = tmp_path / "pkg"
    rc = main(["export", str(tmp_path / "absent.gguf"), "-o", str(out), "--dtype", "int4",
               "--symmetric", "--requantize", requantize])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == EXIT_USAGE and len(err) == 1, err
    assert err[0].startswith("edgemtp: error: --symmetric puts every weight into new symmetric")
    assert f"(--requantize {requantize})" in err[0] and not out.exists()


@pytest.mark.parametrize("dtype, extra, requantize", [("int8", ["--symmetric"], "none"),
                                                      ("fp16", [], "all")])
def test_requantize_on_other_than_int4_is_one_line(dtype, extra, requantize, tmp_path, capsys):
    from edgemtp.cli import main

    out = tmp_path / "pkg"
    rc = main(["export", str(tmp_path / "absent"), "-o", str(out), "--dtype", dtype, *extra,
               "--requantize", requantize])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == EXIT_USAGE and err == [
        f"edgemtp: error: --requantize {requantize} picks which weights an int4 export puts "
        f"into new 4-bit blocks; this is an {dtype} export: drop --requantize"]
    assert not out.exists()
