"""Shared test fixtures: real checkpoints and prompts from ../shared (never copied)."""

import json
import os
import re
from collections.abc import Sequence
from pathlib import Path

import pytest

SHARED = Path(__file__).resolve().parents[1] / ".." / "shared"
STORIES = SHARED / "models" / "stories260K"
STORY_PROMPTS = SHARED / "data" / "stories_prompts.jsonl"


def smollm2_dir() -> Path:
    """The folder of SmolLM2-135M-Instruct's GGUF: ``../shared``'s, else the copy the main job
    fetched into the user cache (``edgemtp.tools.fetch``; never fetched here), else the
    shared path, absent (its tests then skip: :func:`pytest_runtest_makereport`)."""
    from edgemtp.tools.fetch import GGUF_BYTES, GGUF_NAME, SHARED_DIR
    from edgemtp.latency import cache_dir

    cached = cache_dir() / "models" / SHARED_DIR.name
    if not (SHARED_DIR / GGUF_NAME).is_file() and (cached / GGUF_NAME).is_file() \
            and (cached / GGUF_NAME).stat().st_size == GGUF_BYTES:
        return cached
    return SHARED_DIR


# -- a machine without ../shared ----------------------------------------------------------------
# The tests' real checkpoints and prompts are read from ../shared, never copied. Where a test's
# model or data file is absent there, the error it raises names that path: it is reported as a
# skip saying what is missing, not as a failure (and only then: where the file exists, every
# failure stays one).
_SHARED_PATH = re.compile(r"shared[/\\]+(models|data)[/\\]+([^/\\'\"\s:,)]+)")
_SKIPPED_FOR: dict[str, int] = {}


def _missing_shared(text: str) -> str | None:
    for m in _SHARED_PATH.finditer(text):
        if not (SHARED / m[1] / m[2]).exists():
            return f"../shared/{m[1]}/{m[2]}"
    return None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if not rep.failed or call.excinfo is None:
        return
    # the error, or what the test's CLI subprocess said (captured), names the missing file
    said = "\n".join(content for _, content in rep.sections)
    missing = _missing_shared(f"{call.excinfo.value!s} {call.excinfo.exconly()}\n{said}")
    if missing is None:
        return
    rep.outcome = "skipped"
    rep.longrepr = (str(item.path), item.location[1] or 0, f"Skipped: {_lacks(missing)}")


def _lacks(missing: str) -> str:
    return (f"needs {missing}, which this machine lacks (the tests' real checkpoints and "
            f"prompts; see README, Tests)")


def pytest_report_header(config):
    if not SHARED.is_dir():
        return (f"../shared is absent ({SHARED.resolve()}): the tests that read its real "
                f"checkpoints and prompts will be skipped")
    return None


def pytest_runtest_logreport(report):
    # (counted where the reports arrive: pytest-xdist's controller, or the one process)
    reason = report.longrepr[2] if report.skipped and isinstance(report.longrepr, tuple) else ""
    if "which this machine lacks" in reason:
        what = reason.split("needs ", 1)[1].split(",", 1)[0]
        _SKIPPED_FOR[what] = _SKIPPED_FOR.get(what, 0) + 1


pytest_collectreport = pytest_runtest_logreport  # (a module skipped whole: story_prompts)


def pytest_terminal_summary(terminalreporter):
    if _SKIPPED_FOR:
        said = ", ".join(f"{n} for {what}" for what, n in sorted(_SKIPPED_FOR.items()))
        terminalreporter.write_line(f"skipped for files this machine lacks: {said}",
                                    yellow=True)


def story_prompts(n: int = 48) -> list[str]:
    if not STORY_PROMPTS.is_file():  # (modules read them as they load: skipped whole)
        pytest.skip(_lacks("../shared/data/stories_prompts.jsonl"), allow_module_level=True)
    with open(STORY_PROMPTS) as f:
        return [json.loads(line)["prompt"] for line in f if line.strip()][:n]


def family_configs() -> dict:
    """Small random-initialisable configs of every supported family (Llama-3 rope scaling
    included), for equality tests against transformers."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                  max_position_embeddings=256, initializer_range=0.2, eos_token_id=255,
                  bos_token_id=1, pad_token_id=0, tie_word_embeddings=False)
    llama3_rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
                   "rope_theta": 500000.0}
    return {
        "llama3": LlamaConfig(**common, rope_parameters=llama3_rope),
        "qwen2": Qwen2Config(**common),
        "qwen3": Qwen3Config(**common, head_dim=16),
        "mistral": MistralConfig(**common, sliding_window=None),
    }



def save_random_llama(out: Path, seed: int = 0, **config) -> Path:
    """A random Llama of ``config`` (LlamaConfig's arguments) saved as a Hugging Face folder
    at ``out``, its norms randomised (norms of ones would be one shared initializer in an
    exported graph)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**config)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(out)
    return out

@pytest.fixture(scope="session")
def stories_path() -> str:
    assert STORIES.is_dir(), f"missing shared model {STORIES}"
    return str(STORIES)


N_REFS, REF_TOKENS = 24, 128
QUICK = 6  # prompts of the default run's equality sweeps; the slow ones take all N_REFS


class GreedyRefs(Sequence):
    """transformers' greedy ``generate`` of REF_TOKENS new tokens per prompt, each computed the
    first time a test reads it (a worker whose tests read the first few prompts only does not
    pay for all 24)."""

    def __init__(self, hf, prompts) -> None:
        self.hf, self.prompts, self.done = hf, prompts, {}

    def __len__(self) -> int:
        return len(self.prompts)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        i = range(len(self))[i]
        if i not in self.done:
            import torch

            ids = self.prompts[i]
            with torch.no_grad():
                self.done[i] = self.hf.generate(
                    torch.tensor([ids]), max_new_tokens=REF_TOKENS, do_sample=False,
                    attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                    pad_token_id=0)[0, len(ids):].tolist()
        return self.done[i]

    def __eq__(self, other) -> bool:
        return list(self) == list(other)


@pytest.fixture(scope="session")
def stories_refs(stories_path):
    """``(hf, prompts, refs)``: the shared model in transformers, the first 24 story prompts
    as its tokenizer encodes them, and transformers' own greedy ``generate`` of 128 new
    tokens for each (a prefix of it is the greedy output of fewer tokens; :class:`GreedyRefs`,
    computed when first read). Shared by every module that checks equality against it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(stories_path)
    hf = AutoModelForCausalLM.from_pretrained(stories_path).eval()
    prompts = [tok(p).input_ids for p in story_prompts(N_REFS)]
    return hf, prompts, GreedyRefs(hf, prompts)


@pytest.fixture(scope="session")
def stories_pkg(tmp_path_factory):
    """stories260K exported once per test session (max context 256): the package every
    onnxruntime test reads (copy it before changing it)."""
    pytest.importorskip("onnx")
    from edgemtp.export.onnx_export import export_package

    assert STORIES.is_dir(), f"missing shared model {STORIES}"
    out = tmp_path_factory.mktemp("ort") / "stories"
    export_package(str(STORIES), out, max_context=256, progress=False)
    return out


# the shared test models are tiny: one intra-op thread is fastest, and several test processes
# (and their CLI and server subprocesses, which inherit this) on CI's 2 cores must not
# oversubscribe them: a spinning thread pool waiting on a busy core made a 48-token CLI run
# of stories260K take 32 s instead of 9
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("EDGEMTP_THREADS", "1")
# auto measures its latency curve in each test run (a curve kept from another run or machine
# state would make its choices depend on history); tests of the kept curve set their own cache
os.environ.setdefault("EDGEMTP_LATENCY_CACHE", "0")


def pytest_configure(config):
    # the shared test models are tiny: one intra-op thread is fastest and keeps several test
    # processes (and CI's 2 cores) from oversubscribing
    try:
        import torch
    except ModuleNotFoundError:
        return
    torch.set_num_threads(1)
