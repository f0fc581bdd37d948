"""Learned heads against the training-free drafters: BE and tokens/s per drafter and BC on
held-out prompts, every output checked against greedy decoding, the heads' training record
and what a heads step costs next to the base model's t(1).

The package must be exported with ``--hidden-states`` and carry both kinds of heads
(``edgemtp train-heads PKG --kind medusa`` and ``--kind residual``). Prompts are the
evaluation split of ``export.heads``: the first 24 story prompts (a plain-text model), or
the first questions of every Spec-Bench category under the chat template (a chat model);
training never saw them.

    python bench/bench_heads.py --package out/stories-h [--prompts 24] [--bc 10,30]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from edgemtp import GenerationConfig, Model
from edgemtp.export.heads import EVAL_PER_CATEGORY, training_prompts
from edgemtp.runtimes.heads import HeadsRunner
from edgemtp.tools.measure import measure

ROOT = Path(__file__).resolve().parents[1]

# (label, drafter options); BC is added per budget
METHODS = [
    ("greedy", dict(drafter="none")),
    ("probe k=1", dict(drafter="probe")),
    ("pld", dict(drafter="pld")),
    ("hybrid", dict(drafter="hybrid")),
    ("heads medusa", dict(drafter="heads", heads="medusa")),
    ("heads residual", dict(drafter="heads", heads="residual")),
    ("hybrid + medusa heads", dict(drafter="hybrid", heads="medusa")),
    ("hybrid + residual heads", dict(drafter="hybrid", heads="residual")),
    ("auto", dict(drafter="auto")),
    ("auto + residual heads", dict(drafter="auto", heads="residual")),
]


def eval_prompts(model: Model, n: int, stride: int = 1) -> tuple[list, str]:
    chat = model.tokenizer is not None and model.tokenizer.chat_template is not None
    train, _, held = training_prompts(chat)
    assert not set(train) & set(held)
    if not chat:
        return held[:n], f"story prompts 0-{min(n, len(held)) - 1} (held out)"
    # held = the first EVAL_PER_CATEGORY of each category, in file order: take n per category
    per = max(1, n)
    picked = [q for i, q in enumerate(held) if i % EVAL_PER_CATEGORY < per
              and (i // EVAL_PER_CATEGORY) % stride == 0]
    which = "each category" if stride == 1 else f"every {stride}th category in file order"
    return ([model.encode_chat([{"role": "user", "content": q}]) for q in picked],
            f"Spec-Bench, first {per} question(s) of {which}, chat template (held out)")


def step_costs(model: Model, rounds: int = 15, reps: int = 10, bcs=()) -> dict:
    """Median microseconds of a one-row base forward at P = 64 (t(1)) and of one heads run
    per kind (the drafter's extra work per step; where a graph takes the root's embedding,
    its lookup included), and each kind's cost as a share of t(1), for the graph's whole
    top-K (``KIND``) and for the candidates a BC-N heads drafter asks for (``KIND@N``,
    ``k = N``, for N in ``bcs``): the median over ``rounds``
    of (heads median / t(1) median) measured back to back in that round, so a load that
    comes and goes on a shared machine moves both sides of each ratio alike."""
    b = model.backend
    s = b.session()
    n = 65
    s.forward(np.arange(n) % b.vocab_size, np.arange(n), np.tril(np.ones((n, n), bool)), None)
    s.commit(np.arange(64))

    def timed(fn) -> float:
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts) * 1e6

    one = np.ones((1, 1), bool)
    h = np.random.default_rng(0).standard_normal(b.hidden_size).astype(np.float32)
    fns = {"t1": lambda: s.forward(np.array([5]), np.array([64]), one, None),
           "t1_hidden": lambda: s.forward(np.array([5]), np.array([64]), one, None,
                                          hidden=True)}
    kinds, engines = [], {}
    for info in b.package.meta.heads:
        for k in (None, *bcs):
            r = HeadsRunner.load(b.package, info.kind, k=k)
            if k is not None and r.k == r.info.topk:
                continue  # no k input (an older graph), or k >= its top-K: the same run
            base = info.kind if k is None else f"{info.kind}@{k}"
            engines[base] = r.engine  # what the drafter runs (C where it is the faster)
            # both engines side by side: onnxruntime's graph and the C kernel (heads.c)
            for engine, native in (("onnxruntime", False), ("C", "always")):
                r = HeadsRunner.load(b.package, info.kind, k=k, native=native)
                if r.engine != engine:
                    continue  # no C kernel here
                embed, key = r.needs_embedding, f"{base} {engine}"
                kinds.append(key)
                fns[key] = (lambda r=r, embed=embed:
                            r.run(h, 5, b.embed(np.array([5]))[0] if embed else None))
    per: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():  # warm up
        for _ in range(3):
            fn()
    for _ in range(rounds):
        for k, fn in fns.items():
            per[k].append(timed(fn))
    out = {f"{k}_us": statistics.median(v) for k, v in per.items()}
    for key in kinds:
        ratios = [x / t for x, t in zip(per[key], per["t1_hidden"])]
        out[f"{key}_share"] = statistics.median(ratios)
    out["load_1min"], out["rounds"] = os.getloadavg()[0], rounds
    out["engines"] = engines
    return out


def run(model: Model, prompts: list, bcs: list[int], new_tokens: int, repeats: int) -> list:
    rows, greedy = [], None
    todo = [(label, opts, bc) for bc in bcs for label, opts in METHODS
            if bc == bcs[0] or label != "greedy"]
    with tqdm(total=len(todo) * len(prompts) * repeats, desc="bench", unit="gen",
              file=sys.stderr) as bar:
        for label, opts, bc in todo:
            config = GenerationConfig(max_new_tokens=new_tokens, bc=bc, **opts)
            m = measure(model, prompts, config, bar, repeats)
            greedy = greedy or m.outputs
            rows.append(dict(method=label, bc=None if label == "greedy" else bc,
                             options=opts, tokens=m.tokens, forward_calls=m.forward_calls,
                             block_efficiency=m.tokens / m.forward_calls,
                             tokens_per_second=statistics.median(m.rates),
                             lossless=m.outputs == greedy))
    return rows


def markdown(rows: list, costs: dict, heads: list, meta: dict) -> str:
    out = [f"# Learned heads vs training-free drafters: {meta['model']}", "",
           f"{meta['prompts']} prompts ({meta['prompt_set']}) x {meta['new_tokens']} new "
           f"tokens, onnxruntime CPU, {meta['threads']} thread(s), {meta['date']}, "
           f"{meta['machine']}. BE = committed tokens / forward calls (prefill included); "
           f"tok/s: median of {meta['repeats']} run(s) on a shared machine (noisy). Lossless: "
           f"every output equals greedy decoding's.", "",
           "| method | BC | BE | BE / probe | fwd calls | tok/s | tok/s / greedy | lossless |",
           "|---|---:|---:|---:|---:|---:|---:|:---:|"]
    probe = {r["bc"]: r["block_efficiency"] for r in rows if r["method"] == "probe k=1"}
    greedy = next(r["tokens_per_second"] for r in rows if r["method"] == "greedy")
    for r in rows:
        ratio = (f"{r['block_efficiency'] / probe[r['bc']]:.2f}x" if r["bc"] in probe else "")
        out.append(f"| {r['method']} | {r['bc'] or 1} | {r['block_efficiency']:.3f} | {ratio} | "
                   f"{r['forward_calls']} | {r['tokens_per_second']:.1f} | "
                   f"{r['tokens_per_second'] / greedy:.2f}x | "
                   f"{'yes' if r['lossless'] else '**NO**'} |")
    out += ["", "## Heads", "", "| kind | heads | scored tokens | training | val top-1 per "
            "head | loss first -> last | train min | generate min |",
            "|---|---:|---:|---|---|---|---:|---:|"]
    for h in heads:
        t = h["training"]
        out.append(f"| {h['kind']} | {h['heads']} | {h['vocab']} | {t['steps']} steps x "
                   f"{t['batch']} rows, {t['positions']} positions of {t['sequences']} "
                   f"generations ({t['data']}) | {'/'.join(f'{a:.2f}' for a in t['val_top1'])} | "
                   f"{t['loss_first']:.2f} -> {t['loss_last']:.2f} | {t['minutes']:.1f} | "
                   f"{t['gen_minutes']:.1f} |")
    return "\n".join(out + [""] + cost_markdown(costs, heads)) + "\n"


def cost_markdown(costs: dict, heads: list) -> list[str]:
    t1 = costs["t1_hidden_us"]
    out = ["## Step cost", "",
            f"t(1) at P = 64: {costs['t1_us']:.0f} us ({t1:.0f} us with the hidden state "
            f"bound, as the heads drafter runs it); 1-minute load average "
            f"{costs.get('load_1min', float('nan')):.2f} on {os.cpu_count()} cores. One heads "
            f"run (the drafter's extra work per step), median of {costs.get('rounds', 15)} "
            f"rounds each timing both back to back:"]
    out += ["", "| heads | candidates | onnxruntime (heads graph) | C (heads.c) | the drafter "
            "runs |", "|---|---|---:|---:|---|"]
    engines = costs.get("engines", {})
    for h in heads:
        bases = [h["kind"]] + sorted({k.split(" ")[0] for k in costs
                                      if k.startswith(h["kind"] + "@") and k.endswith("_us")},
                                     key=lambda k: int(k.split("@")[1]))
        for base in bases:
            what = (f"all {h['topk']}" if "@" not in base else
                    f"k = {base.split('@')[1]} (BC {base.split('@')[1]})")
            cells = []
            for engine in ("onnxruntime", "C"):
                us = costs.get(f"{base} {engine}_us")
                share = costs.get(f"{base} {engine}_share", (us or 0) / t1)
                cells.append("–" if us is None else f"{us:.1f} us = {100 * share:.1f} %")
            out.append(f"| {h['kind']} | {what} | {cells[0]} | {cells[1]} | "
                       f"{engines.get(base, '?')} |")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--package", required=True)
    ap.add_argument("--prompts", type=int, default=24,
                    help="story prompts, or questions per Spec-Bench category (default 24)")
    ap.add_argument("--stride", type=int, default=1,
                    help="chat model: every STRIDE-th Spec-Bench category only (default 1: all)")
    ap.add_argument("--bc", default="10,30")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--name", default=None, help="results file stem (default: the package's)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--costs-only", action="store_true",
                    help="only the step costs (printed; no results file written)")
    a = ap.parse_args(argv)
    model = Model.load(a.package, backend="onnxruntime", threads=a.threads)
    prompts, what = eval_prompts(model, a.prompts, a.stride)
    bcs = [int(b) for b in a.bc.split(",")]
    if a.costs_only:
        costs = step_costs(model, bcs=bcs)
        heads = model.backend.package.manifest["heads"]
        print("\n".join(cost_markdown(costs, heads)))
        return 0
    rows = run(model, prompts, bcs, a.new_tokens, a.repeats)
    costs = step_costs(model, bcs=bcs)
    heads = model.backend.package.manifest["heads"]
    name = a.name or Path(a.package).name
    meta = dict(model=name, package=a.package, prompts=len(prompts), prompt_set=what,
                new_tokens=a.new_tokens, repeats=a.repeats, threads=a.threads,
                date=time.strftime("%Y-%m-%d"),
                machine=f"{platform.machine()}, python {platform.python_version()}")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    text = markdown(rows, costs, heads, meta)
    (out / f"heads_{name}.md").write_text(text)
    (out / f"heads_{name}.json").write_text(json.dumps(
        dict(meta=meta, rows=rows, step_costs=costs, heads=heads), indent=1))
    print(text)
    return 0 if all(r["lossless"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
