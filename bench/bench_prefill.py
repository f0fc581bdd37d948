"""Prefill time (time to the first token) against the prompt's length: edgemtp's native int4
decoder and its peers, each runtime in a fresh process per round, the order alternated every
round, medians over rounds. The same random token ids for every runtime (a prefill's cost
does not depend on which tokens they are), 2 threads.

    python bench/bench_prefill.py [--lengths 128,512,1024] [--rounds 3] \\
        [--native out/SmolLM2-135M-Instruct-GGUF-int4] [--genai out/peers/genai-int4] \\
        [--gguf ../shared/models/SmolLM2-135M-Instruct-GGUF/SmolLM2-135M-Instruct.Q4_1.gguf]

A runtime whose path is missing or whose package is not installed (llama-cpp-python,
onnxruntime-genai: bench extras) is left out with one line saying why. ``bench_peers.py``
builds the genai package (``out/peers/genai-int4``). edgemtp's prefill asks the last prompt
row only for its LM head, as plain decoding does; llama.cpp (``eval``) and onnxruntime-genai
(``append_tokens``) compute the last row's logits.

Writes bench/results/prefill_<model>_cpu.{md,json} (``--out`` to change).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SHARED_GGUF = (ROOT.parent / "shared" / "models" / "SmolLM2-135M-Instruct-GGUF"
               / "SmolLM2-135M-Instruct.Q4_1.gguf")


def _child(kind: str, path: str, lengths: list[int], threads: int) -> dict[int, float]:
    """Seconds of one prefill per length, after one warm-up prefill of each length."""
    if kind == "native":
        from edgemtp.runtimes.native_backend import NativeBackend
        b = NativeBackend(path, threads=threads)

        def run(ids):
            s = b.session(rows=len(ids) + 1)
            p = len(ids)
            s.forward(ids, np.arange(p), np.tril(np.ones((p, p), bool)), None, rows_from=p - 1)
    elif kind == "llama.cpp":
        import llama_cpp
        llm = llama_cpp.Llama(path, n_threads=threads, n_threads_batch=threads,
                              n_ctx=max(lengths) + 8, n_batch=max(lengths), verbose=False)

        def run(ids):
            llm.reset()
            llm._ctx.kv_cache_seq_rm(-1, 0, -1)
            llm.eval([int(i) for i in ids])
    else:
        import onnxruntime_genai as og
        model = og.Model(og.Config(path))

        def run(ids):
            p = og.GeneratorParams(model)
            p.set_search_options(max_length=len(ids) + 4)
            og.Generator(model, p).append_tokens(np.asarray(ids, np.int32))
    rng = np.random.default_rng(0)
    out = {}
    for n in lengths:
        ids = rng.integers(100, 40000, n)
        run(ids)
        t0 = time.perf_counter()
        run(ids)
        out[n] = time.perf_counter() - t0
    return out


def _available(kind: str, path: str) -> str | None:
    """Why a runtime cannot run here, or None."""
    if not Path(path).exists():
        return f"{path} not found"
    mod = {"llama.cpp": "llama_cpp", "genai": "onnxruntime_genai"}.get(kind)
    if mod:
        try:
            __import__(mod)
        except ImportError:
            return f"{mod} is not installed (a bench extra)"
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="128,512,1024")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--native", default=str(ROOT / "out" / "SmolLM2-135M-Instruct-GGUF-int4"))
    ap.add_argument("--genai", default=str(ROOT / "out" / "peers" / "genai-int4"))
    ap.add_argument("--gguf", default=str(SHARED_GGUF))
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    try:
        lengths = [int(x) for x in a.lengths.split(",")]
    except ValueError:
        lengths = []
    if not lengths or min(lengths) < 1:
        ap.error(f"--lengths takes prompt lengths >= 1, comma-separated; got {a.lengths!r}")
    if a.child:
        print(json.dumps(_child(a.child[0], a.child[1], lengths, a.threads)))
        return 0
    runtimes = {"edgemtp native int4": ("native", a.native),
                "onnxruntime-genai int4": ("genai", a.genai),
                "llama.cpp Q4_1": ("llama.cpp", a.gguf)}
    for name, (kind, path) in list(runtimes.items()):
        why = _available(kind, path)
        if why:
            print(f"{name}: left out ({why})")
            del runtimes[name]
    if "edgemtp native int4" not in runtimes:
        print(f"no native package at {a.native}: run ./run.sh first", file=sys.stderr)
        return 2
    times: dict[str, list[dict[int, float]]] = {n: [] for n in runtimes}
    names = list(runtimes)
    for r in range(a.rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            kind, path = runtimes[name]
            p = subprocess.run([sys.executable, __file__, "--child", kind, path, "--lengths",
                                a.lengths, "--threads", str(a.threads)],
                               capture_output=True, text=True, timeout=1800)
            if p.returncode:
                raise SystemExit(f"{name} failed:\n{p.stderr[-2000:]}")
            times[name].append({int(k): v for k, v in
                                json.loads(p.stdout.strip().splitlines()[-1]).items()})
            print(f"round {r + 1}/{a.rounds} {name}: " + ", ".join(
                f"P={n} {times[name][-1][n] * 1e3:.0f} ms" for n in lengths), flush=True)
    med = {name: {n: statistics.median(x[n] for x in times[name]) for n in lengths}
           for name in runtimes}
    model = Path(a.native).name.removesuffix("-int4").removesuffix("-GGUF")
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo")
                   if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    lines = [f"# Prefill time against the prompt's length, {model}, on the CPU", "",
             f"`bench/bench_prefill.py`: {cpu}, {a.threads} threads, each runtime in a fresh "
             f"process per round, {a.rounds} rounds, the order alternated; medians. "
             "ms = one prefill of P random token ids (after one warm-up of that length); "
             "tok/s = P / that time.", "",
             "| runtime | " + " | ".join(f"P={n}, ms" for n in lengths) + " | "
             + " | ".join(f"P={n}, tok/s" for n in lengths) + " |",
             "|---|" + "---:|" * (2 * len(lengths))]
    for name in runtimes:
        lines.append(f"| {name} | " + " | ".join(f"{med[name][n] * 1e3:.0f}" for n in lengths)
                     + " | " + " | ".join(f"{n / med[name][n]:.0f}" for n in lengths) + " |")
    base = med["edgemtp native int4"]
    for name in runtimes:
        if name != "edgemtp native int4":
            lines.append("")
            lines.append(f"edgemtp native / {name}, prefill speed: " + ", ".join(
                f"P={n} {med[name][n] / base[n]:.2f}×" for n in lengths))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"prefill_{model.lower().replace('-', '_')}_cpu"
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    (out / f"{stem}.json").write_text(json.dumps(
        {"cpu": cpu, "threads": a.threads, "rounds": a.rounds, "lengths": lengths,
         "median_s": {k: {str(n): v for n, v in x.items()} for k, x in med.items()},
         "runs_s": {k: [{str(n): v for n, v in x.items()} for x in xs]
                    for k, xs in times.items()}}, indent=1) + "\n")
    print("\n".join(lines))
    print(f"wrote {out / stem}.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
