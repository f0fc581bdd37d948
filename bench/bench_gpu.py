"""GPU bench (issue 9, part 5): edgemtp's torch backend on one NVIDIA GPU against
``transformers`` generate, every drafter at BC 10/30/60, and the issue's targets.

Self-contained on a bare machine with PyTorch and transformers and no internet: edgemtp is
imported from this source tree (no install), the big models are random-weight models with the
real shapes of SmolLM2-135M, Qwen3-0.6B and Llama-3.2-1B (built from configs written here),
and the story prompts come pre-tokenized from ``bench/data/gpu_prompts.json``. stories260K
(real weights, ~1 MB) is read from ``--stories PATH``.

Per entry (a model and a dtype, e.g. ``smollm2-135m/fp16``) it measures

- ``t_ms``: edgemtp's forward latency per block size T in 1..64 (median, each call reads its
  results back to the host, so it is synchronised);
- ``tps``: tokens/s of ``transformers_eager`` (``generate``, default cache),
  ``transformers_static`` (``cache_implementation="static"``, which ``transformers``
  compiles with ``torch.compile`` on CUDA), ``plain`` (edgemtp, drafter ``none``) and every
  drafter at every BC;
- ``be``: block efficiency per drafter and BC. On random weights BE means nothing, so ``be``
  there is the real BE of stories260K (fp32, this run; else the CPU figures in
  ``bench/results/bench_stories260K_onnxruntime.json``), and ``expected_speedup`` is what that
  BE buys on this shape's ``t_ms`` curve. ``be_measured`` is the BE of what actually ran;
- ``identical``: outputs equal to edgemtp's own plain decoding (count/total), and every
  divergence: prompt, position, the two tokens and their logit gap.

Writes ``<out>/gpu_summary.json`` (after every entry, so a timeout loses nothing; entries
already there are kept unless ``--fresh``) and ``<out>/gpu_<device>.md``, and prints one
PASS/FAIL line per target.

    python bench/bench_gpu.py --stories carry/stories260K                  # everything
    python bench/bench_gpu.py --stories carry/stories260K --models stories260K:fp32,stories260K:fp16
    python bench/bench_gpu.py --models llama3.2-1b:fp16 --skip static      # one shape, no compile
    python bench/bench_gpu.py --device cpu --quick --out /tmp/b             # tiny, CPU, < 1 min
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import inspect
import json
import platform
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def _edgemtp_from_tree() -> None:
    """Import ``edgemtp`` from this tree laid out as pyproject.toml installs it
    (``edgemtp.runtimes`` = runtimes/, ``.models`` = models/, ``.export`` = export/,
    ``.tools`` = tools/): subpackages are looked up in edgemtp/ first, then in the root."""
    spec = importlib.util.spec_from_file_location(
        "edgemtp", ROOT / "edgemtp" / "__init__.py",
        submodule_search_locations=[str(ROOT / "edgemtp"), str(ROOT)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["edgemtp"] = module
    spec.loader.exec_module(module)


if "edgemtp" not in sys.modules:
    _edgemtp_from_tree()

import torch  # noqa: E402

import edgemtp  # noqa: E402
from edgemtp import GenerationConfig, Model  # noqa: E402
from edgemtp import drafters as drafter_registry  # noqa: E402
from edgemtp.drafters.auto import AutoDrafter  # noqa: E402
from edgemtp.latency import LatencyCurve, measure_latency  # noqa: E402
from edgemtp.runtimes.torch_backend import TorchBackend  # noqa: E402
from edgemtp.tools.benchmark import methods  # noqa: E402

PROMPTS_FILE = ROOT / "bench" / "data" / "gpu_prompts.json"
CPU_BE_FILE = ROOT / "bench" / "results" / "bench_stories260K_onnxruntime.json"
SIZES = (1, 2, 4, 8, 16, 32, 64)
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
GAP_TOPK = 64  # candidates read back to find a divergence's two tokens
STORIES = "stories260K"
# a real 135M instruct model: the shared GGUF (Q4_1 blocks, dequantized by transformers' own
# GGUF loader), run on Spec-Bench's first turns through its chat template
GGUF = "smollm2-gguf"
GGUF_FILE = ("SmolLM2-135M-Instruct-GGUF", "SmolLM2-135M-Instruct.Q4_1.gguf")
CHAT_PROMPTS_FILE = ROOT / "bench" / "data" / "gpu_prompts_smollm2.json"
REAL = (STORIES, GGUF)  # real weights: real BE, speed-ups paired with plain decoding
DEFAULT_MODELS = ("stories260K:fp32,stories260K:fp16,smollm2-135m:fp16,qwen3-0.6b:fp16,"
                  "llama3.2-1b:fp16")
STAGES = ("t_ms", "eager", "static", "drafters")

# the real shapes (config.json of HuggingFaceTB/SmolLM2-135M, Qwen/Qwen3-0.6B,
# meta-llama/Llama-3.2-1B); no EOS, so every generation runs to its length
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
SHAPES = {
    "smollm2-135m": ("LlamaConfig", dict(
        hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, head_dim=64, vocab_size=49152, max_position_embeddings=8192,
        rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True)),
    "qwen3-0.6b": ("Qwen3Config", dict(
        hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
        rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)),
    "llama3.2-1b": ("LlamaConfig", dict(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, vocab_size=128256, max_position_embeddings=131072,
        rope_theta=500000.0, rope_scaling=LLAMA3_ROPE, rms_norm_eps=1e-5,
        tie_word_embeddings=True)),
}
# --quick: the same families at toy size (CPU, seconds)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=512)
RANDOM_COMMON = dict(initializer_range=0.02, bos_token_id=1, eos_token_id=None, pad_token_id=0)


# -- progress ---------------------------------------------------------------------------------

class Progress:
    """One line per stage with its elapsed seconds (tqdm over a stage's rows on a terminal)."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        try:
            import tqdm
            self.tqdm = tqdm.tqdm if sys.stderr.isatty() else None
        except ModuleNotFoundError:
            self.tqdm = None

    def say(self, text: str) -> None:
        print(f"[{time.perf_counter() - self.t0:7.1f}s] {text}", flush=True)

    def rows(self, items: list, what: str):
        if self.tqdm is not None:
            return self.tqdm(items, desc=what, file=sys.stderr, leave=False)
        return items


# -- models -----------------------------------------------------------------------------------

def device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return f"cpu ({platform.machine()}, {torch.get_num_threads()} threads)"


def random_model(shape: str, device: str, dtype: str, quick: bool, seed: int):
    import transformers

    cls, kwargs = SHAPES[shape]
    kwargs = {**kwargs, **RANDOM_COMMON, **(TINY if quick else {})}
    if quick:
        kwargs.pop("rope_scaling", None)
    config = getattr(transformers, cls)(**kwargs)
    torch.manual_seed(seed)
    with torch.device(device):  # fp32 init on the device (fast), the same weights per dtype
        hf = transformers.AutoModelForCausalLM.from_config(config)
    return hf.to(DTYPES[dtype]).eval()


def stories_model(path: str, device: str, dtype: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype]).to(device).eval()


def gguf_model(path: str, device: str, dtype: str):
    from transformers import AutoModelForCausalLM

    p = Path(path)
    return AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name,
                                                dtype=DTYPES[dtype]).to(device).eval()


def chat_prompts(gguf: str | Path, per_category: int = 1) -> dict:
    """Spec-Bench's first turns (``per_category`` a category) through the GGUF's own chat
    template, as ``bench_peers.py`` builds them: what ``CHAT_PROMPTS_FILE`` holds, made where
    ``../shared`` and the tokenizer are (the GPU machine has neither)."""
    if str(ROOT / "bench") not in sys.path:
        sys.path.insert(0, str(ROOT / "bench"))
    import bench_peers

    by_cat = bench_peers.prompts_by_category(Path(gguf), per_category, False)
    return dict(about=f"Spec-Bench first turns ({per_category} a category, in order) through "
                      f"the chat template of {GGUF_FILE[1]}, tokenized by transformers "
                      f"(bench_gpu.chat_prompts); tests/test_bench_gpu.py checks them.",
                categories=[c for c, ps in by_cat.items() for _ in ps],
                prompts=[p for ps in by_cat.values() for p in ps])


def make_backend(hf, device: str, max_context: int, graphs: bool, invariant: bool = False):
    # the static-cache session; on CUDA one graph per step shape unless --no-graphs
    return TorchBackend.from_model(hf, device=device, max_context=max_context,
                                   cuda_graphs=None if graphs else False,
                                   batch_invariant=invariant)


class StepSizes:
    """A backend seen through a recorder of the block size of every decode step (prefill
    left out) its sessions run while :attr:`on`: what a drafter's BE costs on another
    device's latency curve."""

    def __init__(self, backend) -> None:
        self._backend, self.on, self.counts = backend, False, Counter()
        self.seconds: Counter = Counter()  # per block size: forward calls' seconds, in the loop

    def __getattr__(self, name):
        return getattr(self._backend, name)

    def session(self):
        return _RecordingSession(self._backend.session(), self)


class _RecordingSession:
    def __init__(self, inner, sizes: StepSizes) -> None:
        self.inner, self.sizes = inner, sizes

    cache_len = property(lambda self: self.inner.cache_len)
    last_run_s = property(lambda self: self.inner.last_run_s)

    def forward(self, input_ids, *args, **kwargs):
        if not (self.sizes.on and self.inner.cache_len):
            return self.inner.forward(input_ids, *args, **kwargs)
        # (a forward returns its outputs on the host, so it has synchronised: this is the
        # block's cost inside the decode loop, to set beside t_ms and auto's own curve)
        t0 = time.perf_counter()
        out = self.inner.forward(input_ids, *args, **kwargs)
        self.sizes.seconds[len(input_ids)] += time.perf_counter() - t0
        self.sizes.counts[len(input_ids)] += 1
        return out

    def commit(self, rows) -> None:
        self.inner.commit(rows)

    def reset(self) -> None:
        self.inner.reset()


# -- measurements -----------------------------------------------------------------------------

def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def latency_ms(backend, device: str, repeats: int) -> dict[str, float]:
    sync(device)
    sizes = [t for t in SIZES if t < backend.max_context - 1]
    curve = measure_latency(backend, sizes, context=64, repeats=repeats)
    return {str(t): round(s * 1e3, 4) for t, s in zip(curve.sizes, curve.seconds)}


def edgemtp_run(model: Model, prompts: list[list[int]], config: GenerationConfig,
                device: str, warmup: int, sizes: StepSizes | None = None,
                beside: GenerationConfig | None = None, passes: int = 1) -> dict:
    """The first ``warmup`` prompts untimed (plans, the CUDA graphs of the block sizes they
    use, the auto drafter's latency curve), then every prompt timed: outputs, tokens,
    forward calls and seconds per prompt.

    ``beside`` (plain decoding) is timed next to ``config`` on every prompt, the order
    alternating prompt to prompt and pass to pass, over ``passes`` passes (``plain_tokens``,
    ``plain_seconds``): a speed-up is then a ratio of two rates measured together, which
    drift, clocks and noise move alike. On stories260K a pass over 12 prompts is ~0.7 s on a
    GPU, and four runs of the same unpaired command gave `auto` 0.93-1.36x
    (bench/results/gpu_h100_2026-11-26.md). Outputs are the first pass's; forward calls and
    block sizes count every pass."""
    for ids in prompts[:max(warmup, 1)]:
        model.generate(ids, config)
    if sizes is not None:
        sizes.counts.clear()
        sizes.seconds.clear()
    events = getattr(model.backend, "graph_events", None)  # the torch backend's
    before = dict(events) if events is not None else {}
    inside = getattr(model.backend, "step_seconds", None)  # (the torch backend's too)
    inside_acc: Counter = Counter()  # this method's steps' seconds inside the forward
    outputs, tokens, calls, seconds, p_tokens, p_seconds = [], [], 0, [], [], []
    kinds: Counter = Counter()  # auto: its timed steps per kind (plain, pld, probe, stand...)
    stages: Counter = Counter()  # seconds per stage of the decode steps (step_us)
    steps = 0
    for k in range(passes):
        for i, ids in enumerate(prompts):
            order = ([config] if beside is None else
                     [beside, config] if (i + k) % 2 == 0 else [config, beside])
            for c in order:
                mine = c is config
                if sizes is not None:
                    sizes.on = mine
                snap = dict(inside) if inside is not None else {}
                try:
                    sync(device)
                    t0 = time.perf_counter()
                    r = model.generate(ids, c)
                    dt = time.perf_counter() - t0
                finally:
                    if sizes is not None:
                        sizes.on = False
                if mine and inside is not None:
                    inside_acc.update({k: inside[k] - snap.get(k, 0) for k in INSIDE + ("steps",)})
                if not mine:
                    p_tokens.append(r.stats.new_tokens)
                    p_seconds.append(dt)
                    continue
                if k == 0:
                    outputs.append(r.token_ids)
                tokens.append(r.stats.new_tokens)
                seconds.append(dt)
                kinds.update(r.stats.steps_by_kind)
                calls += r.stats.forward_calls
                steps += r.stats.forward_calls - 1  # (the first call is the prefill)
                for st in STEP_STAGES:
                    stages[st] += getattr(r.stats, f"time_{st}")
                stages["wall"] += dt - r.stats.time_prefill
    out = dict(outputs=outputs, tokens=tokens, forward_calls=calls, seconds=seconds,
               block_sizes=dict(sorted(sizes.counts.items())) if sizes is not None else None,
               block_ms=None if sizes is None else {
                   t: round(sizes.seconds[t] / n * 1e3, 4)
                   for t, n in sorted(sizes.counts.items())},
               steps_by_kind=dict(kinds), step_us=step_us(stages, steps))
    if events is not None:  # step shapes first met (an eager run) and CUDA graphs captured
        # in the timed passes (plain decoding's beside them too), with their host seconds
        out["graphs"] = {k: round(events[k] - before.get(k, 0), 4)
                         for k in ("shapes", "shape_s", "captures", "capture_s")}
    if inside_acc["steps"]:  # inside the forward, µs a decode step (see TorchSession)
        out["inside_us"] = {k: round(1e6 * inside_acc[k] / inside_acc["steps"], 1)
                            for k in INSIDE}
    if beside is not None:
        out.update(plain_tokens=p_tokens, plain_seconds=p_seconds)
    return out


STEP_STAGES = ("draft", "forward", "bind", "verify", "commit")


def us_table(by_method: dict, cols: tuple, title: str) -> list[str]:
    """Markdown lines: a row of ``cols`` per method and BC (plain decoding's entry holds its
    columns directly, a drafter's one entry per BC).

    >>> us_table({"plain": {"a": 1.0}, "pld": {"10": {"a": 2.4}}}, ("a",), "T")[-2:]
    ['| plain | 1 | 1 |', '| pld | 10 | 2 |']
    """
    out = ["", f"{title}:", "", "| method | BC | " + " | ".join(cols) + " |",
           "|---|---:|" + "---:|" * len(cols)]
    for d, by in by_method.items():
        for b, us in ({"1": by} if d == "plain" else by).items():
            out.append(f"| {d} | {b} | " + " | ".join(f"{us[c]:.0f}" for c in cols) + " |")
    return out
INSIDE = ("load", "run", "wait", "read")  # the torch backend's step_seconds


def step_us(stages: Counter, steps: int) -> dict[str, float]:
    """Microseconds a decode step spends per stage (the engine's timers: drafting, the
    runtime's forward call, binding, verification, commit), ``other`` the rest of its wall
    time, and ``step`` all of it: where a speculative step's time goes beside a plain one's.

    >>> us = step_us(Counter(draft=0.002, forward=0.02, wall=0.025), 10)
    >>> us["draft"], us["forward"], us["commit"], us["other"], us["step"]
    (200.0, 2000.0, 0.0, 300.0, 2500.0)
    """
    n = max(steps, 1)
    out = {st: round(1e6 * stages[st] / n, 1) for st in STEP_STAGES}
    out["other"] = round(1e6 * stages["wall"] / n - sum(out.values()), 1)
    out["step"] = round(1e6 * stages["wall"] / n, 1)
    return out


def rate(run: dict, first: int | None = None) -> float:
    return sum(run["tokens"][:first]) / sum(run["seconds"][:first])


def hf_run(hf, prompts: list[list[int]], new_tokens: int, device: str, static: bool) -> dict:
    """``generate`` greedy on every prompt (longest first, so a static cache made for the
    first is reused), after one untimed warm-up (and compile) on the longest."""
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
    pad = hf.generation_config.pad_token_id
    kwargs = dict(max_new_tokens=new_tokens, do_sample=False,
                  pad_token_id=0 if pad is None else pad)
    if static:
        kwargs["cache_implementation"] = "static"

    def generate(ids):
        x = torch.tensor([ids], device=device)  # (generate runs under no_grad itself)
        y = hf.generate(x, attention_mask=torch.ones_like(x), **kwargs)
        return y[0, len(ids):].tolist()

    generate(prompts[order[0]])
    outputs, seconds = [None] * len(prompts), [0.0] * len(prompts)
    for i in order:
        sync(device)
        t0 = time.perf_counter()
        outputs[i] = generate(prompts[i])
        seconds[i] = time.perf_counter() - t0
    return dict(outputs=outputs, tokens=[len(o) for o in outputs], seconds=seconds,
                compiled=hasattr(hf, "_compiled_call"))


def logit_gap(backend, prompt: list[int], plain: list[int], pos: int, other: int) -> dict:
    """Plain decoding's token and the other at ``pos``: their log-probability gap (= logit
    gap) in one causal pass over the prompt and plain's tokens before ``pos``."""
    ids = np.asarray(prompt + plain[:pos], dtype=np.int64)
    t = len(ids)
    out = backend.session().forward(ids, np.arange(t), np.tril(np.ones((t, t), dtype=bool)),
                                    None, topk=GAP_TOPK)
    lp = dict(zip(out.topk_ids[-1].tolist(), out.topk_logprobs[-1].tolist()))
    a, b = plain[pos], other
    gap = lp[a] - lp[b] if a in lp and b in lp else None
    return dict(logit_gap=None if gap is None else round(gap, 6),
                top1_here=int(out.argmax[-1]))


def divergences(backend, prompts, plain, outputs, drafter: str, bc: int) -> list[dict]:
    out = []
    for i, (want, got) in enumerate(zip(plain, outputs)):
        if want == got:
            continue
        pos = next((j for j, (a, b) in enumerate(zip(want, got)) if a != b),
                   min(len(want), len(got)))
        row = dict(drafter=drafter, bc=bc, prompt=i, position=pos,
                   plain_token=want[pos] if pos < len(want) else None,
                   token=got[pos] if pos < len(got) else None)
        if row["plain_token"] is not None and row["token"] is not None:
            row.update(logit_gap(backend, prompts[i], want, pos, row["token"]))
        out.append(row)
    return out


# -- real BE for random weights ---------------------------------------------------------------

def real_be_source(entries: dict) -> tuple[str, dict, dict | None]:
    """(description, be[drafter][bc], the stories260K entry or None): stories260K's BE in
    this summary (fp32 first), else the CPU bench's story rows."""
    for key in (f"{STORIES}/fp32", f"{STORIES}/fp16", f"{STORIES}/bf16"):
        e = entries.get(key)
        if e and e.get("be"):
            return (f"{key} on {e['device']}, {e['prompts']} story prompts x "
                    f"{e['new_tokens']} tokens", e["be"], e)
    if CPU_BE_FILE.is_file():
        rows = json.loads(CPU_BE_FILE.read_text())["rows"]
        be: dict = {}
        for r in rows:
            if r["task"] == "stories" and r["method"] != "greedy" and "block_efficiency" in r:
                be.setdefault(r["method"], {})[str(r["bc"])] = r["block_efficiency"]
        return (f"{CPU_BE_FILE.relative_to(ROOT)} (stories260K, onnxruntime CPU, story "
                f"prompts)", be, None)
    return "none", {}, None


def expected_speedup(t_ms: dict, steps: dict | None, decode_tokens: int, be: float,
                     width: int) -> float:
    """What a real run's BE buys on this latency curve, forward time only: its decode steps
    (``steps``: block size -> count, ``decode_tokens`` committed by them) against plain
    decoding's t(1) per token; without the steps, BE x t(1) / t(widest block).

    >>> t_ms = {"1": 1.0, "64": 2.0}           # t(10) = 1 + 9/63 ms: 50 steps, 100 tokens
    >>> round(expected_speedup(t_ms, {"10": 50}, 100, 0.0, 0), 3)
    1.75
    >>> expected_speedup(t_ms, None, 0, 2.0, 64)  # BE 2 at t(64) = 2 t(1)
    1.0
    """
    curve = LatencyCurve(tuple(int(t) for t in t_ms), tuple(t_ms.values()))
    if steps:
        return decode_tokens * curve(1) / sum(n * curve(int(t)) for t, n in steps.items())
    return be * curve(1) / curve(width)


# -- one entry --------------------------------------------------------------------------------

def load(name: str, dtype: str, a):
    """The model, its prompts and the entry to fill."""
    if name == STORIES:
        hf = stories_model(a.stories, a.device, dtype)
        prompts = json.loads(PROMPTS_FILE.read_text())["prompts"][:a.prompts]
    elif name == GGUF:
        hf = gguf_model(a.gguf, a.device, dtype)
        prompts = json.loads(CHAT_PROMPTS_FILE.read_text())["prompts"][:a.prompts]
    else:
        hf = random_model(name, a.device, dtype, a.quick, a.seed)
        rng = np.random.default_rng(a.seed)
        prompts = [rng.integers(3, hf.config.vocab_size, a.prompt_len).tolist()
                   for _ in range(a.random_prompts)]
    cfg = hf.config
    entry = dict(model=name, dtype=dtype, device=device_name(a.device),
                 weights={STORIES: STORIES, GGUF: Path(a.gguf).name}.get(name, "random"),
                 shape=dict(hidden=cfg.hidden_size, layers=cfg.num_hidden_layers,
                            heads=cfg.num_attention_heads, kv_heads=cfg.num_key_value_heads,
                            vocab=cfg.vocab_size,
                            params=sum(p.numel() for p in hf.parameters())),
                 prompts=len(prompts), new_tokens=a.new_tokens, warmup=a.warmup,
                 date=time.strftime("%Y-%m-%d %H:%M"), t_ms={}, tps={}, be={},
                 be_measured={}, tokens={}, forward_calls={}, speedup={}, identical={},
                 divergences=[], elapsed_s={},
                 **({"auto_params": dict(a.auto_params)} if a.auto_params else {}))
    return hf, prompts, entry


def run_entry(key: str, a, progress: Progress, summary: dict, checkpoint) -> None:
    """Measure one entry into ``summary["entries"][key]``; ``checkpoint()`` saves the summary
    after each long stage. Order: edgemtp first, transformers last (its compile is the stage
    most likely to run long or fail)."""
    name, dtype = key.split("/")
    t0 = time.perf_counter()

    def stage(label):
        nonlocal t0
        entry["elapsed_s"][label] = round(time.perf_counter() - t0, 1)
        progress.say(f"{key}: {label} done in {entry['elapsed_s'][label]} s")
        t0 = time.perf_counter()

    hf, prompts, entry = load(name, dtype, a)
    summary["entries"][key] = entry
    # the longest prompt and its answer fit (Spec-Bench's summarization turn is 769 tokens)
    context = max(a.max_context, max(map(len, prompts)) + a.new_tokens + 64)
    backend = make_backend(hf, a.device, context, not a.no_graphs, a.batch_invariant)
    entry["cuda_graphs"] = bool(getattr(backend, "cuda_graphs", False))
    entry["batch_invariant"] = backend.batch_invariant
    entry["tree_cost"] = a.tree_cost
    entry["paired"] = a.paired if name in REAL else 0  # real weights: the real speed-ups
    sizes = StepSizes(backend) if name in REAL else None
    model = Model(sizes or backend)
    stage("load")
    # the GPU idled while the weights loaded (a GGUF: ~15 s of host work), so its clocks are
    # warmed again before anything of this entry is timed: on the H100's SmolLM2 run, warmed
    # only before loading, the first plain run read 393.7 tok/s and the second 457.1, and
    # `auto` at BC 10, run first, measured its latency curve in that cold stretch
    warm_up(a.device)
    if "t_ms" not in a.skip:
        entry["t_ms"] = latency_ms(backend, a.device, a.repeats)
        stage("t_ms")
    greedy = GenerationConfig(drafter="none", max_new_tokens=a.new_tokens)
    plain = edgemtp_run(model, prompts, greedy, a.device, a.warmup)
    entry["tps"]["plain"] = round(rate(plain), 2)
    entry["tps_plain_runs"] = [entry["tps"]["plain"]]
    entry.setdefault("step_us", {})["plain"] = plain["step_us"]
    if "inside_us" in plain:
        entry.setdefault("inside_us", {})["plain"] = plain["inside_us"]
    entry["tps_plain_on_hf_prompts"] = round(rate(plain, min(a.hf_prompts, len(prompts))), 2)
    stage("plain")
    if "drafters" not in a.skip:
        run_drafters(entry, model, backend, sizes, prompts, plain, greedy, a, progress,
                      checkpoint)
        stage("drafters")
        # plain decoding again after the drafters: a GPU whose clocks were still rising
        # during the first run (the first bench on a fresh machine: 1518 tok/s, then ~2200
        # on the same H200) would make every speed-up look larger; the faster run is the base
        again = edgemtp_run(model, prompts, greedy, a.device, a.warmup)
        rebase(entry, round(rate(again), 2))
        stage("plain_again")
    if name not in REAL:
        add_real_be(entry, summary["entries"], a)
    checkpoint()
    for label in ("eager", "static"):
        if label not in a.skip and (dtype != "fp32" or a.quick):  # fp32: identity only
            transformers_stage(entry, hf, prompts, plain, label, a, progress)
            stage(f"transformers_{label}")
    del model, backend, sizes, hf
    gc.collect()
    if a.device.startswith("cuda"):
        torch._dynamo.reset()
        torch.cuda.empty_cache()


def warm_up(device: str, seconds: float = 3.0) -> None:
    """Keep a GPU busy for a few seconds before anything is timed, so its clocks have risen."""
    if not device.startswith("cuda"):
        return
    x = torch.randn(4096, 4096, device=device, dtype=torch.float16)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(20):
            x = (x @ x).clamp_(-1, 1)
        torch.cuda.synchronize()


def rebase(entry: dict, tps: float) -> None:
    """One more plain-decoding rate: the base becomes the fastest plain run so far and every
    drafter's speed-up is taken against it (the conservative choice).

    >>> e = {"tps": {"plain": 100.0, "pld": {"10": 150.0}}, "tps_plain_runs": [100.0],
    ...      "speedup": {"pld": {"10": 1.5}}}
    >>> rebase(e, 120.0); e["tps"]["plain"], e["speedup"]["pld"]["10"], e["tps_plain_runs"]
    (120.0, 1.25, [100.0, 120.0])
    """
    entry["tps_plain_runs"].append(tps)
    base = entry["tps"]["plain"] = max(entry["tps_plain_runs"])
    if entry.get("paired"):  # each speed-up has its own plain rate, timed beside it
        return
    for drafter, by_bc in entry["speedup"].items():
        for b in by_bc:
            by_bc[b] = round(entry["tps"][drafter][b] / base, 4)


def transformers_stage(entry, hf, prompts, plain, label: str, a, progress) -> None:
    n = min(a.hf_prompts, len(prompts))
    try:
        run = hf_run(hf, prompts[:n], a.new_tokens, a.device, static=label == "static")
    except Exception as e:  # noqa: BLE001  compile failures come in many types
        entry[f"transformers_{label}_error"] = f"{type(e).__name__}: {e}"[:300]
        progress.say(f"transformers {label} failed: {type(e).__name__}")
        return
    entry["tps"][f"transformers_{label}"] = round(rate(run), 2)
    entry[f"transformers_{label}_equal_plain"] = [
        sum(o == p for o, p in zip(run["outputs"], plain["outputs"])), n]
    if label == "static":
        entry["transformers_static_compiled"] = run["compiled"]


def run_drafters(entry, model, backend, sizes, prompts, plain, greedy, a, progress,
                  checkpoint) -> None:
    plan = methods(a.drafters, a.bcs, greedy)
    same, total, block_sizes = 0, 0, {}
    base = rate(plain)
    for drafter, bc, config in progress.rows(plan, f"{entry['model']}/{entry['dtype']}"):
        if isinstance(config, str):
            entry.setdefault("skipped", []).append(dict(drafter=drafter, bc=bc, reason=config))
            continue
        t0 = time.perf_counter()
        if a.tree_cost != "budget" and "tree_cost" in drafter_registry.get(drafter).options:
            config = config.with_(tree_cost=a.tree_cost)
        paired = entry.get("paired", 0)
        run = edgemtp_run(model, prompts, config, a.device, a.warmup, sizes,
                          beside=greedy if paired else None, passes=max(paired, 1))
        b = str(bc)
        be = sum(run["tokens"]) / run["forward_calls"]
        entry["be_measured"].setdefault(drafter, {})[b] = round(be, 4)
        entry["tokens"].setdefault(drafter, {})[b] = sum(run["tokens"])
        entry["forward_calls"].setdefault(drafter, {})[b] = run["forward_calls"]
        entry["tps"].setdefault(drafter, {})[b] = round(rate(run), 2)
        entry.setdefault("step_us", {}).setdefault(drafter, {})[b] = run["step_us"]
        if "inside_us" in run:
            entry.setdefault("inside_us", {}).setdefault(drafter, {})[b] = run["inside_us"]
        if paired:  # against plain decoding timed beside it
            beside = sum(run["plain_tokens"]) / sum(run["plain_seconds"])
            entry.setdefault("tps_plain_paired", {}).setdefault(drafter, {})[b] = round(
                beside, 2)
            entry["speedup"].setdefault(drafter, {})[b] = round(rate(run) / beside, 4)
        else:
            entry["speedup"].setdefault(drafter, {})[b] = round(rate(run) / base, 4)
        ok = sum(o == p for o, p in zip(run["outputs"], plain["outputs"]))
        entry["identical"].setdefault("rows", {}).setdefault(drafter, {})[b] = [ok, len(prompts)]
        same, total = same + ok, total + len(prompts)
        entry["divergences"] += divergences(backend, prompts, plain["outputs"], run["outputs"],
                                            drafter, bc)
        if drafter == "auto":
            entry.setdefault("auto_state", {})[b] = auto_state(model.memory,
                                                                run["steps_by_kind"])
        if "graphs" in run:
            entry.setdefault("graphs", {}).setdefault(drafter, {})[b] = run["graphs"]
        if run["block_sizes"] is not None:
            block_sizes.setdefault(drafter, {})[b] = {str(t): n for t, n in
                                                     run["block_sizes"].items()}
            entry.setdefault("block_ms", {}).setdefault(drafter, {})[b] = {
                str(t): ms for t, ms in run["block_ms"].items()}
        checkpoint()  # a row at a time: a timeout loses one row at most
        if progress.tqdm is None:
            progress.say(f"  {drafter} BC {bc}: BE {be:.2f}, {rate(run):.0f} tok/s, "
                         f"identical {ok}/{len(prompts)} ({time.perf_counter() - t0:.1f} s)")
    entry["identical"].update(count=same, total=total)
    if sizes is not None:  # real weights: the BE is the real one
        entry["be"], entry["be_source"] = entry["be_measured"], "measured (real weights)"
        entry["block_sizes"] = block_sizes


def auto_state(memory: dict, steps_by_kind: dict) -> dict:
    """What ``auto`` decided from, as it stands after a run (kept in the model's memory
    across its generations): its steps per kind, the host time per kind of step beyond the
    latency curve (µs), its compute slope and the curve itself (ms over 64 cached rows)."""
    curve = next((v for k, v in memory.items()
                  if isinstance(k, tuple) and k and k[0] == "latency"), None)
    return dict(
        steps_by_kind=steps_by_kind,
        host_us={k: round(v * 1e6, 1) for k, v in memory.get("auto-host-by-kind", {}).items()},
        slope=round(memory.get("auto-slope", {}).get("a", 1.0), 3),
        curve_ms=None if curve is None else {
            str(t): round(sec * 1e3, 4) for t, sec in zip(curve.sizes, curve.seconds)})


def add_real_be(entry: dict, entries: dict, a) -> None:
    source, be, src = real_be_source(entries)
    entry["be_source"] = (f"random weights: BE is meaningless here, so `be` is the real BE of "
                          f"{source}; `be_measured` is what ran on the random weights")
    bcs = {str(b) for b in a.bcs}
    entry["be"] = {d: {b: v for b, v in by_bc.items() if b in bcs}
                   for d, by_bc in be.items() if d in a.drafters}
    if not entry["t_ms"]:
        return
    greedy = GenerationConfig(drafter="none", max_new_tokens=a.new_tokens)
    exp = entry["expected_speedup"] = {}
    for drafter, by_bc in entry["be"].items():
        for b, v in by_bc.items():
            try:
                width = drafter_registry.get(drafter).budget(greedy.with_(drafter=drafter,
                                                                          bc=int(b)))
            except edgemtp.ConfigError:
                continue
            steps = src["block_sizes"].get(drafter, {}).get(b) if src else None
            decode = src["tokens"][drafter][b] - src["prompts"] if steps else 0
            exp.setdefault(drafter, {})[b] = round(expected_speedup(
                entry["t_ms"], steps, decode, v, width), 4)


# -- targets ----------------------------------------------------------------------------------

def targets(entries: dict) -> list[dict]:
    out = []

    def add(name, ok, detail):
        out.append(dict(target=name, passed=bool(ok), detail=detail))

    for key, e in entries.items():
        tps = e["tps"]
        plain = e.get("tps_plain_on_hf_prompts", tps.get("plain"))
        for hf, need in (("transformers_eager", 2.0), ("transformers_static", 1.0)):
            if hf in tps:
                r = plain / tps[hf]
                add(f"plain >= {need:g}x {hf} [{key}]", r >= need, f"{r:.2f}x")
    e = entries.get("smollm2-135m/fp16")
    if e and e["t_ms"].get("64"):
        r = e["t_ms"]["64"] / e["t_ms"]["1"]
        add("t(64)/t(1) <= 1.3 [smollm2-135m/fp16]", r <= 1.3, f"{r:.2f}")
    for key, e in entries.items():
        ratios = {f"{d}@{b}": s / e["be_measured"][d][b] for d, by in e["speedup"].items()
                  for b, s in by.items()}
        if ratios:
            worst = min(ratios, key=ratios.get)
            n = sum(r >= 0.8 for r in ratios.values())
            add(f"speed-up >= 0.8 x BE, every drafter [{key}]", n == len(ratios),
                f"{n}/{len(ratios)} rows pass; worst {worst}: speed-up / BE "
                f"{ratios[worst]:.2f}")
    for key, e in entries.items():
        auto = e["speedup"].get("auto")
        if e["weights"] != "random" and auto:
            best = max(auto, key=auto.get)
            where = "story prompts" if e["weights"] == STORIES else "Spec-Bench chat prompts"
            add(f"auto >= 1.3x plain on {where} [{key}]", auto[best] >= 1.3,
                f"best BC {best}: {auto[best]:.2f}x (" + ", ".join(
                    f"BC {b}: {v:.2f}x" for b, v in auto.items()) + ")")
    for key, e in entries.items():
        ident = e["identical"]
        if not ident.get("total"):
            continue
        share = ident["count"] / ident["total"]
        if e["dtype"] == "fp32":
            add(f"fp32 identical on every prompt [{key}]", share == 1.0,
                f"{ident['count']}/{ident['total']}")
        else:
            add(f"{e['dtype']} identical >= 99% [{key}]", share >= 0.99,
                f"{ident['count']}/{ident['total']} ({100 * share:.1f}%), "
                f"{len(e['divergences'])} divergences listed")
    return out


# -- report -----------------------------------------------------------------------------------

def markdown(summary: dict) -> str:
    meta = summary["meta"]
    out = [f"# edgemtp on {meta['device']}", "",
           f"{meta['date']}; torch {meta['torch']}, transformers {meta['transformers']}, "
           f"edgemtp {meta['edgemtp_commit']}. Command: `{meta['command']}`", "",
           f"tok/s: total new tokens / wall time over the prompts (prefill included), after "
           f"{meta.get('warmup', 1)} untimed warm-up prompt(s) per edgemtp method (one "
           f"generation for transformers, which compiles there); speed-up: against edgemtp's "
           f"plain decoding in the same run (on stories260K, where an entry says `paired`: "
           f"against plain decoding timed beside the method on every prompt, over that many "
           f"passes). BE: committed tokens / forward calls (the timed "
           f"pass; drafters keep acceptance statistics across generations of one loaded model, "
           f"as a server would). **On random weights BE "
           "means nothing** (random models fall into loops that lookup drafters copy): there "
           "`BE` is the real BE of stories260K (source below), `expected` is the speed-up that "
           "real BE gives on this shape's t(T) curve (forward time only, host time left out), "
           "and `BE ran` / tok/s / speed-up are what ran on the random weights. "
           f"`{GGUF}`: real weights (SmolLM2-135M-Instruct, the shared Q4_1 GGUF dequantized "
           "by transformers), one Spec-Bench question a category through its chat template, "
           "BE measured, speed-ups paired.", "",
           ]
    out += [*(f"- {n}" for n in meta.get("notes", [])), *([""] if meta.get("notes") else []),
            "## Targets", ""]
    out += [f"- {'PASS' if t['passed'] else '**FAIL**'} {t['target']}: {t['detail']}"
            for t in summary["targets"]]
    for key, e in summary["entries"].items():
        s = e["shape"]
        out += ["", f"## {key} ({e['weights']} weights, {e['device']})", "",
                f"hidden {s['hidden']}, {s['layers']} layers, {s['heads']}/{s['kv_heads']} "
                f"heads, vocab {s['vocab']}, {s['params'] / 1e6:.1f}M parameters; "
                f"{e['prompts']} prompts x {e['new_tokens']} new tokens; CUDA graphs: "
                f"{e['cuda_graphs']}; every step padded to 64 rows (batch-invariant): "
                f"{e.get('batch_invariant', False)}; trees (hybrid, stand, auto): "
                f"{e.get('tree_cost', 'budget')}; speed-ups paired with plain decoding: "
                f"{e.get('paired') or 'no'} pass(es); stage seconds: {e['elapsed_s']}", ""]
        if e["t_ms"]:
            out += ["| T | " + " | ".join(e["t_ms"]) + " |",
                    "|---|" + "---:|" * len(e["t_ms"]),
                    "| ms | " + " | ".join(f"{v:.3f}" for v in e["t_ms"].values()) + " |", ""]
        if e.get("be_source"):
            out += [f"BE: {e['be_source']}.", ""]
        if "transformers_static_compiled" in e:
            out += [f"transformers static cache compiled: {e['transformers_static_compiled']}",
                    ""]
        for k in ("transformers_eager_error", "transformers_static_error"):
            if k in e:
                out += [f"{k}: `{e[k]}`", ""]
        out += ["| method | BC | BE | BE ran | tok/s | speed-up | expected | identical |",
                "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for m in ("transformers_eager", "transformers_static", "plain"):
            if m in e["tps"]:
                out.append(f"| {m} | 1 | | | {e['tps'][m]:.1f} | | | |")
        for d, by in e["speedup"].items():
            for b in by:
                be = e["be"].get(d, {}).get(b)
                exp = e.get("expected_speedup", {}).get(d, {}).get(b)
                ok, n = e["identical"]["rows"][d][b]
                out.append(f"| {d} | {b} | {'' if be is None else f'{be:.3f}'} | "
                           f"{e['be_measured'][d][b]:.3f} | {e['tps'][d][b]:.1f} | "
                           f"{by[b]:.2f}x | {'' if exp is None else f'{exp:.2f}x'} | "
                           f"{ok}/{n} |")
        if e.get("step_us"):  # where a decode step's time goes (the engine's timers)
            out += us_table(e["step_us"], (*STEP_STAGES, "other", "step"),
                            "Host and device time of a decode step, µs (the engine's stage "
                            "timers; `forward`: the runtime's call, graph replay and its one "
                            "synchronisation included; `other`: the step's wall time beyond the "
                            "stages)")
        if e.get("inside_us"):  # the torch backend's forward, split
            out += us_table(e["inside_us"], INSIDE,
                            "Inside the torch backend's forward, µs a decode step (the method's "
                            "own steps): loading the inputs, replaying the graph (running it, on "
                            "CPU), waiting for the device, reading back")
        if e.get("graphs"):  # shapes met and graphs captured inside the timed passes
            out += ["", "Step shapes first met (an eager run) and CUDA graphs captured inside "
                    "the timed passes (plain decoding's beside them included), with their "
                    "host seconds:", "",
                    "| method | BC | new shapes | s | captures | s |",
                    "|---|---:|---:|---:|---:|---:|"]
            for d, by in e["graphs"].items():
                for b, g in by.items():
                    out.append(f"| {d} | {b} | {g['shapes']:.0f} | {g['shape_s']:.3f} | "
                               f"{g['captures']:.0f} | {g['capture_s']:.3f} |")
        if e.get("auto_params"):
            out += ["", f"AutoDrafter parameters set for this run: {e['auto_params']}"]
        for b, st in e.get("auto_state", {}).items():
            out += ["", f"auto at BC {b}: steps by kind {st['steps_by_kind']}; host time "
                    f"beyond its curve (µs) {st['host_us']}; compute slope {st['slope']}; its "
                    f"curve (ms) {st['curve_ms']}"]
        if e["divergences"]:
            out += ["", "Divergences from plain decoding (first differing position; gap = "
                    "log-prob of plain's token minus the other's in one causal pass over the "
                    "prompt and plain's tokens before it):", "",
                    "| drafter | BC | prompt | position | plain token | token | logit gap |",
                    "|---|---:|---:|---:|---:|---:|---:|"]
            out += [f"| {d['drafter']} | {d['bc']} | {d['prompt']} | {d['position']} | "
                    f"{d['plain_token']} | {d['token']} | {d.get('logit_gap')} |"
                    for d in e["divergences"]]
    return "\n".join(out) + "\n"


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", text.lower()).strip("_")


def git_commit() -> str:
    try:
        # "-dirty": the tree differs from that commit (a device's copy of a working tree may
        # carry a .git older than its files)
        return subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT, check=True,
                              capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (no git)"


def save(summary: dict, out: Path, device: str) -> Path:
    import transformers

    summary["targets"] = targets(summary["entries"])
    summary["meta"].setdefault("transformers", transformers.__version__)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_summary.json").write_text(json.dumps(summary, indent=1))
    md = out / f"gpu_{slug(device.split(' (')[0])}.md"
    md.write_text(markdown(summary))
    return md


# -- command line -----------------------------------------------------------------------------

def parse(argv=None):
    ap = argparse.ArgumentParser(
        description=" ".join(__doc__.split("\n\n")[0].split()),
        epilog="python bench/bench_gpu.py --merge PART.json ... [--out DIR] [--note TEXT] "
               "joins the gpu_summary.json of runs on one GPU")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--models", default=None, help=f"name:dtype,... (default {DEFAULT_MODELS})")
    ap.add_argument("--stories", default=str(ROOT / ".." / "shared" / "models" / STORIES),
                    help="the stories260K folder (real weights)")
    ap.add_argument("--gguf", default=str(ROOT.parent / "shared" / "models" / GGUF_FILE[0] /
                                          GGUF_FILE[1]), help=f"the GGUF of {GGUF}")
    ap.add_argument("--skip", default="", help=f"stages to leave out: {','.join(STAGES)}")
    ap.add_argument("--drafters", default=",".join(  # heads: only packages trained for them
        d for d in drafter_registry.names(speculative=True) if d != "heads"))
    ap.add_argument("--bc", default="10,30,60")
    ap.add_argument("--prompts", type=int, default=24,
                    help="prompts of a real-weights model (stories: up to 24, Spec-Bench: 13)")
    ap.add_argument("--random-prompts", type=int, default=4, help="prompts per random shape")
    ap.add_argument("--prompt-len", type=int, default=32, help="tokens of a random prompt")
    ap.add_argument("--hf-prompts", type=int, default=4, help="prompts transformers runs")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=20, help="timed calls per block size")
    ap.add_argument("--warmup", type=int, default=4, help="untimed prompts per method before "
                    "its timed pass (CUDA graphs are captured at a block size's second use)")
    ap.add_argument("--paired", type=int, default=3, metavar="PASSES",
                    help="stories260K (real weights): each drafter's speed-up from PASSES "
                         "passes over the prompts with plain decoding timed beside it on "
                         "every prompt (0: against the plain runs before and after)")
    ap.add_argument("--max-context", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (--quick: 1)")
    ap.add_argument("--no-graphs", action="store_true", help="TorchBackend(cuda_graphs=False)")
    ap.add_argument("--tree-cost", choices=("budget", "measured"), default="budget",
                    help="hybrid, stand, auto: GenerationConfig.tree_cost (measured: trees "
                         "grow only while a node pays for its measured share of a step)")
    ap.add_argument("--batch-invariant", action="store_true",
                    help="TorchBackend(batch_invariant=True): every step padded to 64 rows")
    ap.add_argument("--auto-param", action="append", default=[], metavar="NAME=VALUE",
                    help="set an AutoDrafter class parameter for this run (repeatable), e.g. "
                         "host_floor=0; recorded in each entry as auto_params")
    ap.add_argument("--quick", action="store_true", help="toy shapes, 2 prompts, 16 tokens, "
                    "fp32 (a CPU end-to-end check)")
    ap.add_argument("--fresh", action="store_true", help="drop the entries of an earlier run")
    ap.add_argument("--out", default=None, help="results folder (default: bench/results; "
                    "with --quick or a CPU device: out/bench_gpu, so that a smoke run never "
                    "replaces the checked-in GPU results)")
    a = ap.parse_args(argv)
    if a.out is None:
        smoke = a.quick or not str(a.device).startswith("cuda")
        a.out = str(ROOT / ("out/bench_gpu" if smoke else "bench/results"))
    if a.quick:
        a.prompts, a.random_prompts, a.hf_prompts = min(a.prompts, 2), 2, 2
        a.new_tokens, a.prompt_len, a.repeats = 16, 8, 2
        a.threads, a.warmup, a.paired = a.threads or 1, 1, min(a.paired, 1)
        a.models = a.models or ",".join(f"{m}:fp32" for m in (STORIES, *SHAPES))
    a.models = [tuple(m.split(":")) for m in (a.models or DEFAULT_MODELS).split(",") if m]
    a.skip = {s for s in a.skip.split(",") if s}
    a.drafters = [d for d in a.drafters.split(",") if d]
    a.bcs = [int(b) for b in a.bc.split(",") if b]
    for m in a.models:
        if len(m) != 2 or m[0] not in (*REAL, *SHAPES) or m[1] not in DTYPES:
            ap.error(f"--models takes name:dtype with a name of {', '.join(REAL)}, "
                     f"{', '.join(SHAPES)} and a dtype of {', '.join(DTYPES)}; got "
                     f"{':'.join(m)!r}")
    a.auto_params = {}
    for item in a.auto_param:
        name, eq, value = item.partition("=")
        default = getattr(AutoDrafter, name, None)
        if not eq or name.startswith("_") or not isinstance(default, (bool, int, float)):
            ap.error(f"--auto-param takes NAME=VALUE with NAME a number or switch of "
                     f"AutoDrafter (e.g. host_floor=0, chain_margin=1.1), got {item!r}")
        try:
            a.auto_params[name] = (value.strip().lower() in ("1", "true", "yes")
                                   if isinstance(default, bool) else type(default)(value))
        except ValueError:
            ap.error(f"--auto-param {name} takes a {type(default).__name__}, got {value!r}")
    if a.paired < 0:
        ap.error(f"--paired takes a number of passes >= 0 (0: unpaired), got {a.paired}")
    if a.skip - set(STAGES):
        ap.error(f"--skip takes some of {', '.join(STAGES)}, got {','.join(sorted(a.skip))}")
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error("--device cuda, but this PyTorch sees no CUDA device (use --device cpu)")
    if any(m[0] == STORIES for m in a.models) and not Path(a.stories, "config.json").is_file():
        ap.error(f"--stories {a.stories!r} is not a model folder (copy ../shared/models/"
                 f"stories260K next to the repository and pass its path)")
    if any(m[0] == GGUF for m in a.models):
        if not Path(a.gguf).is_file():
            ap.error(f"--gguf {a.gguf!r} is not a file (the shared {GGUF_FILE[1]})")
        with open(a.gguf, "rb") as f:
            if f.read(4) != b"GGUF":  # transformers would fail deep in its loader
                ap.error(f"--gguf {a.gguf!r} is not a GGUF file (it does not start with "
                         f"'GGUF'); expected the shared {GGUF_FILE[1]}")
    return a


def merge(parts: list[str], out: Path, notes: list[str]) -> Path:
    """One results file from several runs' ``gpu_summary.json`` (one device call can hold
    only so much): ``FILE`` takes its entries as they are, ``FILE=LABEL`` names each of them
    ``key (LABEL)``, ``FILE=LABEL:key1+key2`` only those keys; an entry of a later part replaces an
    earlier one of the same name. Every ratio stays inside the run that measured it.

    >>> merge_key("smollm2-135m/fp16", "no CUDA graphs")
    'smollm2-135m/fp16 (no CUDA graphs)'
    """
    entries, commands, metas = {}, [], []
    for part in parts:
        path, _, label = part.partition("=")
        label, _, keys = label.partition(":")
        try:
            summary = json.loads(Path(path).read_text())
            metas.append(summary["meta"])
            commands.append(summary["meta"]["command"])
            found = summary["entries"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise SystemExit(f"--merge: {path!r} is not a gpu_summary.json written by this "
                             f"script ({type(e).__name__}: {e})") from None
        wanted = keys.split("+") if keys else list(found)
        missing = [k for k in wanted if k not in found]
        if missing:
            raise SystemExit(f"--merge: {path!r} has no entry {', '.join(missing)}; it has "
                             f"{', '.join(found)}")
        for key in (k for k in found if k in wanted):  # in the file's order
            entries[merge_key(key, label)] = found[key]
    devices = {m["device"] for m in metas}
    if len(devices) != 1:
        raise SystemExit(f"--merge: the parts come from different devices ({sorted(devices)})")
    meta = dict(metas[-1], date=min(m["date"] for m in metas), command="; ".join(commands),
                notes=notes)
    return save(dict(meta=meta, entries=entries), out, meta["device"])


def merge_key(key: str, label: str) -> str:
    return f"{key} ({label})" if label else key


def main(argv=None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv and argv[0] == "--merge":
        ap = argparse.ArgumentParser(prog="bench_gpu.py --merge")
        ap.add_argument("parts", nargs="+", help="FILE[=LABEL[:key1+key2]]")
        ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
        ap.add_argument("--note", action="append", default=[], help="a line for the report")
        m = ap.parse_args(argv[1:])
        print(merge(m.parts, Path(m.out), m.note))
        return 0
    a = parse(argv)
    progress = Progress()
    for name, value in a.auto_params.items():  # (this process only: a run of its own)
        setattr(AutoDrafter, name, value)
    if a.threads:
        torch.set_num_threads(a.threads)
    # fp32 means fp32: no TF32 matmuls (identity checks and the fp32 entries)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    out = Path(a.out)
    old = out / "gpu_summary.json"
    entries = {} if a.fresh or not old.is_file() else json.loads(old.read_text())["entries"]
    summary = dict(meta=dict(device=device_name(a.device), date=time.strftime("%Y-%m-%d %H:%M"),
                             torch=torch.__version__, edgemtp_commit=git_commit(),
                             edgemtp_source=str(Path(edgemtp.__file__).parent),
                             runtimes_source=str(Path(inspect.getfile(TorchBackend)).parent),
                             warmup=a.warmup,
                             command="python bench/bench_gpu.py " + " ".join(
                                 sys.argv[1:] if argv is None else argv)),
                   entries=entries)
    progress.say(f"bench_gpu on {summary['meta']['device']}, edgemtp from "
                 f"{summary['meta']['edgemtp_source']}; {len(a.models)} entries")
    warm_up(a.device)

    # stories260K first: its real BE is what the random shapes' speculative rows rest on
    def checkpoint():
        return save(summary, out, summary["meta"]["device"])

    for name, dtype in sorted(a.models, key=lambda m: m[0] != STORIES):
        key = f"{name}/{dtype}"
        progress.say(f"{key}: start")
        run_entry(key, a, progress, summary, checkpoint)
        md = checkpoint()
        progress.say(f"{key}: saved to {out / 'gpu_summary.json'} and {md}")
    for t in summary["targets"]:
        print(f"{'PASS' if t['passed'] else 'FAIL'}  {t['target']}: {t['detail']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
