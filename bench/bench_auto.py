"""The ``auto`` drafter against plain greedy and fixed plans, on onnxruntime CPU.

Issue 4's targets: auto tokens/s >= 0.97x plain greedy on a ~100M random Llama (where
probing cannot pay), and >= the best fixed plan minus 5 % on stories260K. Exports both models
to a temporary folder, runs every method interleaved over repeats (median tok/s, ratios within
this run), checks every output equals greedy, and writes bench/results/auto_cpu.md / .json.

    python bench/bench_auto.py [--repeats 3] [--prompts 24]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench_probe import ROOT, SHARED
from edgemtp import Model
from edgemtp.export.onnx_export import export_package
from edgemtp.tools.prompts import story_prompts

STORIES_FIXED = [("greedy", dict(drafter="none")), ("pld BC=10", dict(drafter="pld", bc=10)),
                 ("probe k=1 BC=10", dict(drafter="probe", bc=10)),
                 ("stand BC=10", dict(drafter="stand", bc=10))]
AUTO = ("auto BC<=60", dict(drafter="auto", bc=60))


def measure(model, prompts, methods, new_tokens, repeats):
    model.generate(prompts[0], max_new_tokens=16, **AUTO[1])  # latency curve, once per model
    runs = {label: [] for label, _ in methods}
    outputs = {}
    for rep in range(repeats):
        for label, opts in (methods if rep % 2 == 0 else methods[::-1]):
            t0, n, c, outs = time.perf_counter(), 0, 0, []
            for p in prompts:
                r = model.generate(p, max_new_tokens=new_tokens, **opts)
                n, c = n + r.stats.new_tokens, c + r.stats.forward_calls
                outs.append(r.token_ids)
            runs[label].append((n / (time.perf_counter() - t0), n / c))
            outputs.setdefault(label, outs)
    greedy = outputs[methods[0][0]]
    return [dict(method=label, block_efficiency=round(runs[label][0][1], 3),
                 tokens_per_second=round(statistics.median(x for x, _ in runs[label]), 1),
                 lossless=outputs[label] == greedy) for label, _ in methods]


def random_llama(folder: Path) -> str:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                      num_attention_heads=12, num_key_value_heads=12, vocab_size=32000,
                      max_position_embeddings=512, eos_token_id=31999, bos_token_id=1)
    AutoModelForCausalLM.from_config(cfg).eval().save_pretrained(folder)
    return str(folder)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    report = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        pkg = export_package(str(SHARED / "models" / "stories260K"), tmp / "stories", force=True,
                             progress=False).out
        model = Model.load(str(pkg), threads=a.threads)
        report["stories260K"] = measure(model, story_prompts(a.prompts),
                                        STORIES_FIXED + [AUTO], 128, a.repeats)
        big = export_package(random_llama(tmp / "llama"), tmp / "llama_pkg", force=True,
                             bc=(10, 30, 60), mask_tokens=(1,), progress=False).out
        model = Model.load(str(big), threads=a.threads)
        rng = np.random.default_rng(0)
        prompts = [rng.integers(3, 31000, size=24).tolist() for _ in range(4)]
        report["llama ~110M (random)"] = measure(
            model, prompts, [STORIES_FIXED[0], ("probe k=1 BC=10", dict(drafter="probe", bc=10)),
                             AUTO], 64, max(2, a.repeats - 1))
    lines = ["# auto drafter vs plain greedy and fixed plans (onnxruntime CPU)", "",
             f"{time.strftime('%Y-%m-%d')}, {a.threads} thread(s); median tok/s over repeats "
             "(methods interleaved); ratios within this run. stories260K: 128 new tokens on "
             f"{a.prompts} story prompts. Llama ~110M: random weights, 4 random-id prompts x 64 "
             "tokens (random models loop, so prompt lookup finds chains).", ""]
    for model_name, rows in report.items():
        greedy = rows[0]["tokens_per_second"]
        best_fixed = max(r["tokens_per_second"] for r in rows if not r["method"].startswith("auto"))
        lines += [f"## {model_name}", "", "| method | BE | tok/s | vs greedy | lossless |",
                  "|---|---:|---:|---:|:---:|"]
        for r in rows:
            lines.append(f"| {r['method']} | {r['block_efficiency']:.3f} | "
                         f"{r['tokens_per_second']:.1f} | {r['tokens_per_second'] / greedy:.2f}x | "
                         f"{'yes' if r['lossless'] else '**NO**'} |")
        auto = rows[-1]["tokens_per_second"]
        lines += ["", f"auto / greedy = {auto / greedy:.3f}; auto / best fixed plan = "
                      f"{auto / best_fixed:.3f}", ""]
    out = ROOT / "bench" / "results"
    (out / "auto_cpu.md").write_text("\n".join(lines))
    (out / "auto_cpu.json").write_text(json.dumps(report, indent=1))
    print("\n".join(lines))
    return 0 if all(r["lossless"] for rows in report.values() for r in rows) else 1


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    sys.exit(main())
