"""Where a decode step's time goes, per drafter: drafting, the forward pass, binding,
verification and commit, in µs per step, from the engine's own stage timers
(:class:`edgemtp.metrics.Stats`), on any backend and device; with ``--profile LABEL`` also
cProfile's top functions for one configuration.

Runs uninstalled from this tree (a bare GPU machine with PyTorch):

    python bench/bench_step_host.py carry/stories260K --backend torch --device cuda \
        --drafters none,probe,pld,stand,hybrid,auto --bc 10,60 --tree-cost measured \
        --profile hybrid@10

On real weights (SmolLM2-135M-Instruct from the shared GGUF, carried to the GPU machine by
``bench/gguf_gpu_parts.sh``), a ``.gguf`` model reads Spec-Bench's chat prompts as that model's
token ids (``bench/data/gpu_prompts_smollm2.json``; ``--prompts-file`` for others):

    python bench/bench_step_host.py /tmp/gguf/SmolLM2-135M-Instruct.Q4_1.gguf --backend torch \
        --device cuda --dtype fp16 --drafters none,hybrid,auto --bc 60 --profile hybrid@60

Every configuration generates the same prompts (4 untimed, then ``--prompts`` timed,
``--new-tokens`` new tokens each, 128 by default) on one loaded model; a step's parts are the
engine's timers summed over the timed prompts and divided by their decode steps (prefill left
out). ``other`` is the rest of the wall time: the engine's loop, stop checks, the drafter's
observe.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gpu import CHAT_PROMPTS_FILE, PROMPTS_FILE, sync  # noqa: E402  (imports edgemtp)

from edgemtp import GenerationConfig, Model  # noqa: E402
from edgemtp import drafters as drafter_registry  # noqa: E402
from edgemtp.errors import EdgeMTPError  # noqa: E402
from edgemtp.latency import measure_latency  # noqa: E402

PARTS = ("draft", "forward", "bind", "verify", "commit")
TOPK_SLICES = 64  # --topk-curve's two-stage top-K (runtimes.torch_backend.chunked_topk)


def prompts(n: int, path: Path = PROMPTS_FILE) -> list[list[int]]:
    """The first ``n`` prompts of a bench_gpu prompts file (token ids): by default the shared
    story prompts as stories260K's ids."""
    return json.loads(Path(path).read_text())["prompts"][:n]


def run(model: Model, texts: list[list[int]], config: GenerationConfig, device: str,
        warmup: int = 4) -> dict:
    for t in texts[:warmup]:
        model.generate(t, config)
    acc = dict.fromkeys(PARTS, 0.0)
    steps = tokens = calls = 0
    wall = 0.0
    events = getattr(model.backend, "graph_events", None)  # the torch backend's
    before = dict(events) if events is not None else {}
    inside = getattr(model.backend, "step_seconds", None)  # (also the torch backend's)
    inside_before = dict(inside) if inside is not None else {}
    for t in texts:
        sync(device)
        t0 = time.perf_counter()
        s = model.generate(t, config).stats
        wall += time.perf_counter() - t0 - s.time_prefill
        for k in PARTS:
            acc[k] += getattr(s, f"time_{k}")
        steps += s.forward_calls - 1
        tokens += s.new_tokens
        calls += s.forward_calls
    us = {k: round(1e6 * v / steps, 1) for k, v in acc.items()}
    us["other"] = round(1e6 * wall / steps - sum(us.values()), 1)
    us["step"] = round(1e6 * wall / steps, 1)
    out = dict(us=us, be=round(tokens / calls, 3), steps=steps)
    if inside is not None:  # inside the backend's forward, µs per decode step
        n = inside["steps"] - inside_before.get("steps", 0)
        if n:
            out["inside_us"] = {k: round(1e6 * (inside[k] - inside_before.get(k, 0)) / n, 1)
                                for k in ("load", "run", "wait", "read")}
    if events is not None:  # step shapes first met and CUDA graphs captured in the timed
        # prompts (after the warm-up), and their host seconds as µs a step: inside `forward`
        out["graphs"] = {k: events[k] - before.get(k, 0) for k in ("shapes", "captures")}
        out["graphs"].update({f"{k[:-2]}_us": round(1e6 * (events[k] - before.get(k, 0))
                                                    / steps, 1)
                              for k in ("shape_s", "capture_s")})
    return out


def table(rows: list[dict], key: str, fields: tuple, heads: tuple, title: str) -> None:
    """A Markdown table of ``row[key][field]`` per configuration that has ``key``."""
    rows = [r for r in rows if key in r]
    if rows:
        print(f"\n{title}:\n\n| config | " + " | ".join(heads) + " |\n|---|"
              + "---:|" * len(heads))
        for r in rows:
            print(f"| {r['config']} | " + " | ".join(f"{r[key][f]:.0f}" for f in fields) + " |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="a Hugging Face folder or an exported package")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--drafters", default="none,probe,pld,stand,hybrid,auto")
    ap.add_argument("--bc", default="10,60")
    ap.add_argument("--tree-cost", default="budget", choices=("budget", "measured"))
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompts-file", default=None,
                    help="token-id prompts (bench_gpu's JSON; default: the story prompts, or "
                         "SmolLM2's Spec-Bench chat prompts for a .gguf model)")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--profile", default="", help="DRAFTER@BC,... to run again under cProfile")
    ap.add_argument("--profile-filter", default="", metavar="REGEX",
                    help="list only the profiled functions whose file or name matches (e.g. "
                         "'edgemtp': the engine and the drafters, not torch)")
    ap.add_argument("--profile-lines", type=int, default=30,
                    help="the profile's slowest functions listed (30)")
    ap.add_argument("--topk-curve", type=int, default=0, metavar="K",
                    help="also t(T) at T = 1, 2, 8, 16, 64 with and without a top-K of K "
                         "(bench_gpu's t_ms is without: drafters that read candidates pay "
                         "the log-softmax and top-K over the vocabulary on top)")
    ap.add_argument("--out", default=None, help="write the table (JSON) here")
    a = ap.parse_args(argv)
    source = a.prompts_file or (CHAT_PROMPTS_FILE if a.model.endswith(".gguf")
                                else PROMPTS_FILE)
    if not Path(source).is_file():
        ap.error(f"--prompts-file {source}: no such file")
    rows = []
    configs = {}
    try:
        for d in a.drafters.split(","):
            for bc in ([1] if d == "none" else [int(b) for b in a.bc.split(",")]):
                c = GenerationConfig(drafter=d, bc=bc, max_new_tokens=a.new_tokens)
                if a.tree_cost != "budget" and "tree_cost" in drafter_registry.get(d).options:
                    c = c.with_(tree_cost=a.tree_cost)
                configs[f"{d}@{bc}"] = c
    except (ValueError, EdgeMTPError) as e:  # a drafter or budget that does not exist
        ap.error(str(e))
    if a.topk_curve < 0:
        ap.error(f"--topk-curve must be >= 0, got {a.topk_curve}")
    unknown = [x for x in filter(None, a.profile.split(",")) if x not in configs]
    if unknown:
        ap.error(f"--profile {','.join(unknown)}: not among the configurations run "
                 f"({', '.join(configs)})")
    model = Model.load(a.model, backend=a.backend, device=a.device, dtype=a.dtype)
    texts = prompts(a.prompts + 4, source)
    print("| config | BE | step µs | " + " | ".join(PARTS) + " | other |")
    print("|---|---:|---:|" + "---:|" * (len(PARTS) + 1))
    for label, c in configs.items():
        r = run(model, texts, c, a.device)
        rows.append(dict(config=label, **r))
        print(f"| {label} | {r['be']:.2f} | {r['us']['step']:.0f} | "
              + " | ".join(f"{r['us'][k]:.0f}" for k in (*PARTS, "other")) + " |", flush=True)
    table(rows, "graphs", ("shapes", "shape_us", "captures", "capture_us"),
          ("new shapes", "µs/step", "captures", "µs/step"),
          "Step shapes first met (an eager run) and CUDA graphs captured in the timed "
          "prompts, with their host time as µs a step (part of `forward` above)")
    curves = {}
    if a.topk_curve:
        sizes = [t for t in (1, 2, 8, 16, 64) if t < model.backend.max_context - 65]
        b = model.backend
        runs = [("0", 0, 0), (str(a.topk_curve), a.topk_curve, 0)]
        if hasattr(b, "topk_chunks"):  # the torch backend: its two-stage top-K too
            runs.append((f"{a.topk_curve}, 64 slices", a.topk_curve, TOPK_SLICES))
        for label, k, chunks in runs:
            if hasattr(b, "topk_chunks"):
                b.topk_chunks = chunks  # (each measurement captures its own graphs)
            sync(a.device)
            c = measure_latency(b, sizes, context=64, repeats=7, topk=k)
            curves[label] = {str(t): round(s * 1e6, 1) for t, s in zip(c.sizes, c.seconds)}
        if hasattr(b, "topk_chunks"):
            b.topk_chunks = 0
        print(f"\nt(T) in µs over 64 cached rows, without and with a top-{a.topk_curve} "
              f"(the torch backend's: also in two stages over {TOPK_SLICES} slices of the "
              f"vocabulary):\n")
        print("| top-K | " + " | ".join(f"T={t}" for t in sizes) + " |\n|---|"
              + "---:|" * len(sizes))
        for k, row in curves.items():
            print(f"| {k} | " + " | ".join(f"{row[str(t)]:.0f}" for t in sizes) + " |")
    table(rows, "inside_us", ("load", "run", "wait", "read"), ("load", "run", "wait", "read"),
          "Inside the torch backend's forward, µs a decode step: loading the inputs, running "
          "(CPU) or replaying (GPU) the step, waiting for the device, reading the outputs back")
    for label in filter(None, a.profile.split(",")):
        pr = cProfile.Profile()
        pr.enable()
        run(model, texts, configs[label], a.device, warmup=0)
        pr.disable()
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(
            *([a.profile_filter] if a.profile_filter else []), a.profile_lines)
        print(f"## {label} under cProfile\n{s.getvalue()}")
    if a.out:
        Path(a.out).write_text(json.dumps(dict(command=" ".join(sys.argv), rows=rows,
                                               topk_curves=curves), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
