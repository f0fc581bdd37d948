"""Lossless sweep: every drafter's output against plain decoding of the same package, on the
Spec-Bench first turns (chat template, one question per category, as ``bench_peers.py``).
No timing: equality only, so it means the same on a loaded machine.

    python bench/check_lossless.py out/peers/edgemtp-int4 [--tokens 128] [--bc 10]
        [--drafters probe,pld,hybrid,lade,stand,auto] [--categories summarization,rag]
        [--backend onnxruntime|native]

Prints one line per prompt and drafter (the first differing token, if any) and writes
``--out`` (JSON) with the counts; exit 1 if any output differs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bench_peers import gguf_path, prompts_by_category  # noqa: E402
from edgemtp import Model  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("package")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--bc", type=int, default=10)
    ap.add_argument("--drafters", default="probe,pld,hybrid,lade,stand,auto")
    ap.add_argument("--categories", default="", help="comma-separated; default all 13")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--backend", default="onnxruntime",
                    help="onnxruntime (default), native (int4), or auto")
    ap.add_argument("--gguf", default=None, help="the GGUF whose tokenizer makes the prompts")
    ap.add_argument("--out", default=None, help="JSON path")
    a = ap.parse_args(argv)
    only = set(filter(None, a.categories.split(",")))
    tasks = {c: p[0] for c, p in prompts_by_category(gguf_path(a.gguf), 1, False).items()
             if not only or c in only}
    model = Model.load(a.package, backend=a.backend, threads=a.threads)
    rows, same = [], {}
    for cat, ids in tasks.items():
        plain = model.generate(ids, drafter="none", max_new_tokens=a.tokens).token_ids
        for d in a.drafters.split(","):
            got = model.generate(ids, drafter=d, bc=a.bc, max_new_tokens=a.tokens).token_ids
            first = next((i for i, (x, y) in enumerate(zip(plain, got)) if x != y),
                         None if len(plain) == len(got) else min(len(plain), len(got)))
            rows.append({"category": cat, "prompt_tokens": len(ids), "drafter": d,
                         "identical": first is None, "first_difference": first})
            same.setdefault(d, [0, 0])
            same[d][0] += first is None
            same[d][1] += 1
            print(f"{cat:15s} P={len(ids):4d} {d:7s} "
                  f"{'identical' if first is None else f'differs at new token {first}'}",
                  flush=True)
    print("identical:", ", ".join(f"{d} {s}/{n}" for d, (s, n) in same.items()))
    if a.out:
        Path(a.out).write_text(json.dumps({"package": a.package, "tokens": a.tokens,
                                           "bc": a.bc, "identical": same, "rows": rows},
                                          indent=1))
    return 0 if all(s == n for s, n in same.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
