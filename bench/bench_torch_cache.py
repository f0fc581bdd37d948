"""The torch backend's static KV cache against the reference session that concatenates the
past K/V every step, on this machine's CPU: forward latency per block size at two cache
lengths, and tokens/s of greedy decoding and probing, interleaved (each round runs both
session kinds on the same prompts, alternating), medians over rounds. Checks both give the
same tokens.

    python bench/bench_torch_cache.py [--model PATH] [--prompts 6] [--rounds 3] [--threads 2]

Writes bench/results/torch_cache_<model>_cpu.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from edgemtp import Model
from edgemtp.runtimes.torch_backend import TorchBackend
from edgemtp.tokenizer import Tokenizer
from edgemtp.tools.prompts import story_prompts

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT / ".." / "shared"
KINDS = {"static": True, "concat": False}
CONFIGS = {"greedy": dict(drafter="none"), "probe BC 10": dict(drafter="probe", bc=10),
           "probe BC 30": dict(drafter="probe", bc=30),
           "hybrid BC 30": dict(drafter="hybrid", bc=30)}


def latency(backend, t: int, p: int, repeats: int) -> float:
    session = backend.session()
    ids = np.arange(p, dtype=np.int64) % backend.vocab_size
    session.forward(ids, np.arange(p), np.tril(np.ones((p, p), dtype=bool)), None)
    session.commit(np.arange(p))
    block = np.tril(np.ones((t, t), dtype=bool))
    runs = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        session.forward(np.arange(t) % backend.vocab_size, p + np.arange(t), block, None, topk=4)
        runs.append(time.perf_counter() - t0)
    return float(np.median(runs[1:]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(SHARED / "models" / "stories260K"))
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--contexts", default="64,512")
    ap.add_argument("--sizes", default="1,10,30,60")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    models = {kind: Model(TorchBackend(a.model, static_cache=static), Tokenizer(a.model))
              for kind, static in KINDS.items()}
    name = Path(a.model).name
    prompts = [models["static"].encode(p) for p in story_prompts(a.prompts)]
    sizes = [int(s) for s in a.sizes.split(",")]
    contexts = [int(c) for c in a.contexts.split(",")]
    lat = {k: {(t, p): [] for t in sizes for p in contexts} for k in KINDS}
    tps = {k: {c: [] for c in CONFIGS} for k in KINDS}
    tokens = {k: {} for k in KINDS}
    for r in range(a.rounds):
        for kind in (list(KINDS) if r % 2 == 0 else list(KINDS)[::-1]):
            m = models[kind]
            for p in contexts:
                for t in sizes:
                    if p + t < m.backend.max_context:
                        lat[kind][(t, p)].append(latency(m.backend, t, p, 5))
            for label, opts in CONFIGS.items():
                n, wall = 0, 0.0
                for i, ids in enumerate(prompts):
                    t0 = time.perf_counter()
                    out = m.generate(ids, max_new_tokens=a.max_new_tokens, **opts)
                    wall += time.perf_counter() - t0
                    n += len(out.token_ids)
                    tokens[kind][(label, i)] = out.token_ids
                tps[kind][label].append(n / wall)
            print(f"round {r + 1}/{a.rounds} {kind} done", flush=True)
    same = sum(tokens["static"][key] == tokens["concat"][key] for key in tokens["static"])
    rows = ["| measure | static | concat | static / concat |", "|---|---:|---:|---:|"]
    result = {"model": name, "threads": a.threads, "rounds": a.rounds, "prompts": a.prompts,
              "machine": platform.processor() or platform.machine(), "latency_ms": {},
              "tokens_per_second": {}, "identical": f"{same}/{len(tokens['static'])}"}
    for (t, p), _ in lat["static"].items():
        if not lat["static"][(t, p)]:
            continue
        s, c = (statistics.median(lat[k][(t, p)]) * 1e3 for k in KINDS)
        result["latency_ms"][f"T={t},P={p}"] = {"static": s, "concat": c}
        rows.append(f"| t(T={t}) at P={p}, ms | {s:.2f} | {c:.2f} | {s / c:.2f} |")
    for label in CONFIGS:
        s, c = (statistics.median(tps[k][label]) for k in KINDS)
        result["tokens_per_second"][label] = {"static": s, "concat": c}
        rows.append(f"| {label}, tok/s | {s:.1f} | {c:.1f} | {s / c:.2f} |")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"torch_cache_{name}_cpu"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1))
    text = (f"# torch backend on CPU: static KV cache vs the concatenating session, {name}\n\n"
            f"{a.threads} threads, {a.prompts} story prompts, {a.max_new_tokens} new tokens, "
            f"medians over {a.rounds} interleaved rounds (latency: median of 5 per round). "
            f"Identical tokens: {result['identical']}.\n\n" + "\n".join(rows) + "\n")
    stem.with_suffix(".md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
