"""Forward latency against the cache length: t(T) at P cached rows for one or more packages
on onnxruntime (CPU by default), interleaved (every round measures each package at every P,
alternating the order), medians over rounds. It shows how a step's cost grows with the
context: with the attention alone it should grow slowly; a copy of the cache per step makes
it grow faster.

    python bench/bench_context.py --package old=out/pkg/a --package new=out/pkg/b \\
        [--contexts 64,512,2000] [--sizes 1,10] [--rounds 5] [--threads 2]

A path may name its backend: ``--package c=native:out/pkg/int4`` (default onnxruntime).

Writes bench/results/context_<model>_cpu.{md,json} (``--out`` to change).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

from edgemtp.backend import backend_class

ROOT = Path(__file__).resolve().parents[1]


def fill(backend, p: int):
    """A session with ``p`` cached rows (prefilled in chunks of 256)."""
    s = backend.session()
    ids = np.arange(p) % 1000 + 100
    for c in range(0, p, 256):
        blk = ids[c:c + 256]
        t = len(blk)
        s.forward(blk, c + np.arange(t), np.tril(np.ones((t, t), dtype=bool)), None)
        s.commit(np.arange(t))
    return s


def step_ms(session, t: int, repeats: int) -> float:
    p = session.cache_len
    mask = np.tril(np.ones((t, t), dtype=bool))
    runs = []
    for _ in range(repeats + 2):  # two warm-ups
        t0 = time.perf_counter()
        session.forward(np.arange(t) + 5, p + np.arange(t), mask, None, topk=4)
        runs.append(time.perf_counter() - t0)
    return statistics.median(runs[2:]) * 1e3


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--package", action="append", required=True, metavar="NAME=PATH")
    ap.add_argument("--contexts", default="64,512,2000")
    ap.add_argument("--sizes", default="1,10")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    a = ap.parse_args(argv)
    packages = dict(p.split("=", 1) for p in a.package)
    backends = {}
    for n, spec in list(packages.items()):
        kind, path = ("onnxruntime", spec)
        if spec.split(":", 1)[0] in ("native", "onnxruntime"):
            kind, path = spec.split(":", 1)
        packages[n] = path
        backends[n] = backend_class(kind)(path, threads=a.threads)
    contexts = [int(c) for c in a.contexts.split(",")]
    sizes = [int(t) for t in a.sizes.split(",")]
    sessions = {(n, p): fill(b, p) for n, b in backends.items() for p in contexts
                if p + max(sizes) <= b.max_context}
    times = {key: {t: [] for t in sizes} for key in sessions}
    order = list(sessions)
    for r in range(a.rounds):
        for key in (order if r % 2 == 0 else order[::-1]):
            for t in sizes:
                times[key][t].append(step_ms(sessions[key], t, a.repeats))
        print(f"round {r + 1}/{a.rounds} done", flush=True)
    med = {f"{n}@P={p}": {t: statistics.median(v) for t, v in ts.items()}
           for (n, p), ts in times.items()}
    model = Path(next(iter(packages.values()))).name
    rows = ["| package | " + " | ".join(f"t({t}) at P={p}, ms" for t in sizes for p in contexts)
            + " | " + " | ".join(f"t({t}) P={contexts[-1]} / P={contexts[0]}" for t in sizes)
            + " |", "|---|" + "---:|" * (len(sizes) * len(contexts) + len(sizes))]
    for n in packages:
        cells = [f"{med[f'{n}@P={p}'][t]:.2f}" if f"{n}@P={p}" in med else "–"
                 for t in sizes for p in contexts]
        ratios = [f"{med[f'{n}@P={contexts[-1]}'][t] / med[f'{n}@P={contexts[0]}'][t]:.2f}"
                  if f"{n}@P={contexts[-1]}" in med else "–" for t in sizes]
        rows.append(f"| {n} | " + " | ".join(cells + ratios) + " |")
    kinds = ", ".join(sorted({b.name for b in backends.values()}))
    text = (f"# Step latency against the cache length, {model}, {kinds} on the CPU\n\n"
            f"{a.threads} threads; medians over {a.rounds} interleaved rounds of "
            f"{a.repeats} steps each.\n\n" + "\n".join(rows) + "\n")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"context_{model}_cpu"
    stem.with_suffix(".md").write_text(text)
    stem.with_suffix(".json").write_text(json.dumps(dict(packages=packages, rounds=a.rounds,
                                                         threads=a.threads, ms=med), indent=1))
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
