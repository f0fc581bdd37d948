"""``auto`` with two values of one of its class parameters, side by side in one process.

One package is loaded once per value (each model keeps its own memory of tries, backoffs and
acceptance, as a server's would) and once more for plain greedy; every Spec-Bench question
(chat template, first turn, ``--per-category`` per category, 128 new tokens, 2 threads) runs
greedy and ``auto`` at each value in turns, who goes first rotating. Categories run in
Spec-Bench's order, as ``bench_peers.py`` runs them (writing first, right after one warm-up
generation per model), so what a fresh model spends while it learns falls where it does there.

    python bench/bench_auto_param.py out/peers/edgemtp-fp32 --param try_share=0.005,1e9

Prints per category ``auto`` tok/s over greedy's (median over ``--repeats``) per value, the
mean and minimum over categories, and how many outputs equal greedy's.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_peers import gguf_path, prompts_by_category  # noqa: E402

from edgemtp import GenerationConfig, Model  # noqa: E402
import edgemtp.drafters.auto as auto  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("package")
    p.add_argument("--param", required=True, help="NAME=V1,V2: an AutoDrafter class attribute")
    p.add_argument("--per-category", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--bc", type=int, default=60)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    name, _, vals = a.param.partition("=")
    try:
        values = [float(v) for v in vals.split(",")]
    except ValueError:
        values = []
    if not hasattr(auto.AutoDrafter, name) or not values:
        p.error(f"--param takes NAME=V1,V2 with NAME an AutoDrafter attribute and numbers, "
                f"got {a.param!r}")
    tasks = prompts_by_category(gguf_path(None), a.per_category, False)
    greedy = Model.load(a.package, threads=a.threads)
    models = [Model.load(a.package, threads=a.threads) for _ in values]
    g = GenerationConfig(drafter="none", max_new_tokens=128)
    c = GenerationConfig(drafter="auto", bc=a.bc, max_new_tokens=128)
    first = tasks[next(iter(tasks))][0]
    greedy.generate(first, g)
    for v, m in zip(values, models):
        setattr(auto.AutoDrafter, name, v)
        m.generate(first, c)
    runs = [("greedy", greedy, g, None)] + [(v, m, c, v) for v, m in zip(values, models)]
    secs: dict = {}
    same = {v: 0 for v in values}
    n = 0
    for r in range(a.repeats):
        for cat, qs in tasks.items():
            for q in qs:
                k = n % len(runs)
                outs = {}
                for key, m, cfg, v in runs[k:] + runs[:k]:
                    if v is not None:
                        setattr(auto.AutoDrafter, name, v)
                    t0 = time.perf_counter()
                    outs[key] = m.generate(q, cfg).token_ids
                    secs.setdefault((cat, key), [0.0] * a.repeats)[r] += time.perf_counter() - t0
                n += 1
                if r == 0:
                    for v in values:
                        same[v] += outs[v] == outs["greedy"]
        print(f"repeat {r + 1}/{a.repeats} done", file=sys.stderr, flush=True)
    ratios = {v: {} for v in values}
    print("| category | " + " | ".join(f"{name}={v:g}" for v in values) + " |")
    print("|---|" + "---:|" * len(values))
    for cat in tasks:
        base = statistics.median(secs[(cat, "greedy")])
        for v in values:
            ratios[v][cat] = base / statistics.median(secs[(cat, v)])
        print(f"| {cat} | " + " | ".join(f"{ratios[v][cat]:.3f}" for v in values) + " |")
    total = n // a.repeats
    for row, f in (("mean", statistics.mean), ("min", min)):
        print(f"| **{row}** | " + " | ".join(f"{f(ratios[v].values()):.3f}" for v in values)
              + " |")
    print("| identical to greedy | " + " | ".join(f"{same[v]}/{total}" for v in values) + " |")


if __name__ == "__main__":
    main()
