"""Block efficiency and tokens/s of plain greedy decoding vs mask-token probing.

Runs every plan on the same backend and prompts (the shared story prompts by default, 128 new
tokens), checks every output equals greedy decoding, and writes a Markdown table and JSON to
bench/results/. Speed-ups are ratios measured in this one run (timings here are noisy).

    python bench/bench_probe.py [--model PATH] [--prompts 48] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

from tqdm import tqdm

from edgemtp import GenerationConfig, Model
from edgemtp.tools.measure import measure
from edgemtp.tools.prompts import story_prompts

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT / ".." / "shared"

# (label, options, prototype BE from the issue where one was given)
PLANS = [
    ("greedy", dict(drafter="none"), None),
    ("probe k=1 BC=10", dict(bc=10), 1.11),
    ("probe k=1 BC=30", dict(bc=30), 1.24),
    ("probe k=1 BC=60", dict(bc=60), 1.38),
    ("probe k=1 BC=60, EMA 0.3", dict(bc=60, ema=0.3), None),
    ("probe k=1 BC=60, mask init sample", dict(bc=60, mask_init="sample"), None),
    ("probe k=1 BC=60, mask init last-k", dict(bc=60, mask_init="last-k"), None),
    ("probe k=2 BC=10 dynamic", dict(bc=10, mask_tokens=2), None),
    ("probe k=2 BC=30 dynamic", dict(bc=30, mask_tokens=2), None),
    ("probe k=2 BC=30 dynamic, Algorithm 1 uncalibrated", dict(bc=30, mask_tokens=2,
                                                               calibrate=False), None),
    ("probe k=2 BC=30 static [8,1]", dict(bc=30, mask_tokens=2, tree="static",
                                          branching=(8, 1)), None),
    ("probe k=2 BC=30 static [7,2]", dict(bc=30, mask_tokens=2, tree="static",
                                          branching=(7, 2)), None),
    ("probe k=2 BC=30 static [5,4]", dict(bc=30, mask_tokens=2, tree="static",
                                          branching=(5, 4)), None),
    ("probe k=2 BC=60 dynamic", dict(bc=60, mask_tokens=2), 1.23),
    ("probe k=2 BC=60 dynamic, Algorithm 1 uncalibrated", dict(bc=60, mask_tokens=2,
                                                               calibrate=False), 1.23),
    ("probe k=2 BC=60 static [18,1]", dict(bc=60, mask_tokens=2, tree="static",
                                           branching=(18, 1)), None),
    ("probe k=2 BC=60 static [15,4]", dict(bc=60, mask_tokens=2, tree="static",
                                           branching=(15, 4)), 1.26),
    ("probe k=2 BC=60 static [12,7]", dict(bc=60, mask_tokens=2, tree="static",
                                           branching=(12, 7)), None),
    ("probe k=3 BC=60 dynamic", dict(bc=60, mask_tokens=3), None),
]


def run(model: Model, prompts: list[str], new_tokens: int, repeats: int) -> list[dict]:
    rows, reference = [], None
    with tqdm(total=len(PLANS) * len(prompts) * repeats, desc="bench", unit="gen",
              file=sys.stderr) as bar:  # closed before a Ctrl-C message
        for label, opts, proto in PLANS:
            config = GenerationConfig(max_new_tokens=new_tokens, **{"drafter": "probe", **opts})
            m = measure(model, prompts, config, bar, repeats)
            hist = Counter()
            for r in m.results[0]:
                hist.update(r.stats.accept_histogram())
            reference = reference or m.outputs
            rows.append(dict(
                method=label, options=opts, tokens=m.tokens, forward_calls=m.forward_calls,
                block_efficiency=m.tokens / m.forward_calls, prototype_be=proto,
                tokens_per_second=statistics.median(m.rates),
                host_overhead=statistics.median(r.stats.host_overhead for run in m.results
                                                for r in run),
                accept_histogram=dict(sorted(hist.items())),
                lossless=all(a == b for a, b in zip(m.outputs, reference))))
    base = rows[0]["tokens_per_second"]
    for row in rows:
        row["speedup_vs_greedy"] = row["tokens_per_second"] / base
    return rows


def markdown(rows: list[dict], meta: dict) -> str:
    out = [f"# Probing vs greedy: {meta['model_name']}, backend {meta['backend']} "
           f"({meta['device']})", "",
           f"{meta['prompts']} story prompts x {meta['new_tokens']} new tokens, "
           f"{meta['repeats']} repeat(s), {meta['date']}, {meta['machine']}.", "",
           "BE = committed tokens / forward calls (prefill included). tok/s is the median over "
           "repeats of total tokens / wall time, on this backend; speed-up is against greedy on "
           "the same backend in the same run. Lossless = every output equals greedy decoding.",
           "", "| method | BE | prototype BE | fwd calls | tok/s | speed-up | host overhead "
           "| lossless |", "|---|---:|---:|---:|---:|---:|---:|:---:|"]
    for r in rows:
        proto = f"{r['prototype_be']:.2f}" if r["prototype_be"] else ""
        out.append(f"| {r['method']} | {r['block_efficiency']:.3f} | {proto} | "
                   f"{r['forward_calls']} | {r['tokens_per_second']:.1f} | "
                   f"{r['speedup_vs_greedy']:.2f}x | {100 * r['host_overhead']:.0f}% | "
                   f"{'yes' if r['lossless'] else '**NO**'} |")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str((SHARED / "models" / "stories260K").resolve()))
    ap.add_argument("--backend", default="torch")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    a = ap.parse_args(argv)
    model = Model.load(a.model, backend=a.backend, device=a.device, threads=a.threads)
    prompts = story_prompts(a.prompts)
    rows = run(model, prompts, a.new_tokens, a.repeats)
    meta = dict(model=a.model, model_name=Path(a.model).name, backend=a.backend,
                device=a.device, prompts=len(prompts), new_tokens=a.new_tokens,
                repeats=a.repeats, date=time.strftime("%Y-%m-%d"),
                machine=f"{platform.machine()}, {platform.processor() or 'cpu'}, "
                        f"python {platform.python_version()}")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"probe_{Path(a.model).name}_{a.backend}_{a.device}"
    (out / f"{stem}.md").write_text(markdown(rows, meta))
    (out / f"{stem}.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    print(markdown(rows, meta))
    print(f"wrote {out / stem}.md and .json", file=sys.stderr)
    return 0 if all(r["lossless"] for r in rows) else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # results are written once every plan has run: nothing to keep
        print("bench_probe: interrupted; nothing was written", file=sys.stderr)
        sys.exit(130)
