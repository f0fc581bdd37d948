"""The ``auto`` drafter against plain greedy, the previous ``auto`` and every fixed drafter, on
onnxruntime CPU.

Issue 10 part 5: ``auto`` weighs plain steps, k = 1 probing, PLD chains, STAND trees, and whole
hybrid / LADE / k = 2 probing drafters by expected tokens/s on the measured latency curve.
Runs, in one sitting and interleaved over repeats (median tok/s, ratios within this run):

- stories260K (exported to a temporary folder): the 24 story prompts, 128 new tokens;
- SmolLM2-135M-Instruct fp32 (a package from ``edgemtp export ... --max-context 2048``,
  ``--smollm2 PATH``): Spec-Bench first turns under its chat template, ``--per-category``
  questions per category, 64 new tokens, tok/s per category.

Methods: greedy, ``auto`` as it was at ``--before`` (loaded from git into this process), the
new ``auto`` (BC <= 60), and pld / probe k=1 / stand / lade / hybrid at BC 10 and 30. Every
output is checked equal to greedy. Writes bench/results/auto_cpu.md / .json; the previous
JSON's numbers become the "before" column.

    python bench/bench_auto.py [--repeats 3] [--smollm2 out/pkg/smollm2] [--per-category 1]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from tqdm import tqdm

from bench_probe import ROOT, SHARED
from edgemtp import Model, drafters
from edgemtp.export.onnx_export import export_package
from edgemtp.tools.prompts import chat_turns, prompt_sets, story_prompts

BEFORE_REV = "4085ab4"  # main before issue 10 part 5
FIXED = [(f"{d} BC={bc}", dict(drafter=d, bc=bc)) for d in ("pld", "probe", "stand", "lade",
                                                            "hybrid") for bc in (10, 30)]
METHODS = ([("greedy", dict(drafter="none")), ("auto before BC<=60", dict(drafter="auto-before", bc=60)),
            ("auto BC<=60", dict(drafter="auto", bc=60))] + FIXED)


def register_before(rev: str, name: str = "auto-before") -> None:
    """The ``auto`` drafter of git revision ``rev``, registered as ``name`` (this process
    only), so old and new run interleaved in one sitting."""
    src = subprocess.run(["git", "show", f"{rev}:edgemtp/drafters/auto.py"], cwd=ROOT,
                         check=True, capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "auto_before.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(f"edgemtp.drafters.{name.replace('-', '_')}",
                                                  path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    new = drafters.REGISTRY["auto"]
    drafters.REGISTRY[name] = drafters.DrafterSpec(name, f"auto at {rev}", module.AutoDrafter,
                                                   new.budget)


def measure(model, tasks: dict[str, list], methods, new_tokens: int, repeats: int) -> dict:
    """Per method: BE, median tok/s (all prompts and per task), host draft us/step, lossless."""
    for _, opts in methods:  # latency curves and compiled plans, once per model
        if opts["drafter"].startswith("auto"):
            model.generate(next(iter(tasks.values()))[0], max_new_tokens=8, **opts)
    runs = {label: [] for label, _ in methods}
    outputs, picks = {}, {}
    steps = tqdm(total=repeats * len(methods), desc="bench", leave=False)
    for rep in range(repeats):
        for label, opts in (methods if rep % 2 == 0 else methods[::-1]):
            per_task, outs, draft, calls = {}, [], 0.0, 0
            for task, prompts in tasks.items():
                t0, n, c = time.perf_counter(), 0, 0
                for p in prompts:
                    gen = model.generation(p, max_new_tokens=new_tokens, **opts)
                    r = gen.run()
                    n, c = n + r.stats.new_tokens, c + r.stats.forward_calls
                    draft, calls = draft + r.stats.time_draft, calls + r.stats.forward_calls - 1
                    outs.append(r.token_ids)
                    for k, v in getattr(gen.drafter, "picked", {}).items():
                        picks.setdefault(label, defaultdict(int))[k] += v if rep == 0 else 0
                per_task[task] = (n, c, time.perf_counter() - t0)
            runs[label].append((per_task, draft / max(calls, 1)))
            outputs.setdefault(label, outs)
            steps.update()
    steps.close()
    greedy = outputs[methods[0][0]]
    report = {}
    for label, _ in methods:
        tps = {task: statistics.median(r[0][task][0] / r[0][task][2] for r in runs[label])
               for task in tasks}
        n = sum(v[0] for v in runs[label][0][0].values())
        c = sum(v[1] for v in runs[label][0][0].values())
        total = statistics.median(sum(v[0] for v in r[0].values()) / sum(v[2] for v in r[0].values())
                                  for r in runs[label])
        report[label] = dict(block_efficiency=round(n / c, 3), tokens_per_second=round(total, 2),
                             per_task={t: round(v, 2) for t, v in tps.items()},
                             draft_us_per_step=round(1e6 * statistics.median(r[1] for r in runs[label]), 1),
                             lossless=outputs[label] == greedy,
                             picked=dict(picks.get(label, {})))
    return report


def table(name: str, rows: dict, before: dict) -> list[str]:
    g = rows["greedy"]["tokens_per_second"]
    lines = [f"## {name}", "", "| method | BE | tok/s | vs greedy | before: vs greedy | draft us/step "
             "| lossless |", "|---|---:|---:|---:|---:|---:|:---:|"]
    for label, r in rows.items():
        old = before.get(label.replace("auto before", "auto").replace(" BC=", " BC="), None)
        lines.append(f"| {label} | {r['block_efficiency']:.3f} | {r['tokens_per_second']:.1f} | "
                     f"{r['tokens_per_second'] / g:.2f}x | {old or '-'} | "
                     f"{r['draft_us_per_step']:.0f} | {'yes' if r['lossless'] else '**NO**'} |")
    return lines + [""]


def per_task_table(rows: dict) -> list[str]:
    tasks = list(rows["greedy"]["per_task"])
    ratio = {label: {t: r["per_task"][t] / rows["greedy"]["per_task"][t] for t in tasks}
             for label, r in rows.items()}
    lines = ["tok/s ratio to greedy per Spec-Bench category (median over repeats):", "",
             "| category | greedy tok/s | " + " | ".join(l for l in rows if l != "greedy") + " |",
             "|---|---:|" + "---:|" * (len(rows) - 1)]
    for t in tasks:
        lines.append(f"| {t} | {rows['greedy']['per_task'][t]:.1f} | " + " | ".join(
            f"{ratio[l][t]:.2f}" for l in rows if l != "greedy") + " |")
    lines.append("| **mean** | | " + " | ".join(
        f"**{statistics.mean(ratio[l].values()):.3f}**" for l in rows if l != "greedy") + " |")
    lines.append("| **min** | | " + " | ".join(
        f"{min(ratio[l].values()):.2f}" for l in rows if l != "greedy") + " |")
    return lines + [""]


def before_ratios(path: Path) -> dict:
    """vs-greedy ratios of the previous results file, by method label (stories260K)."""
    if not path.is_file():
        return {}
    old = json.loads(path.read_text())
    old = old.get("before", old)  # a file this script wrote keeps the older numbers there
    rows = old.get("stories260K", [])
    if isinstance(rows, dict):
        return {}
    g = next((r["tokens_per_second"] for r in rows if r["method"] == "greedy"), None)
    names = {"pld BC=10": "pld BC=10", "probe k=1 BC=10": "probe BC=10",
             "stand BC=10": "stand BC=10", "auto BC<=60": "auto BC<=60", "greedy": "greedy"}
    return {names[r["method"]]: f"{r['tokens_per_second'] / g:.2f}x (BE {r['block_efficiency']:.2f})"
            for r in rows if r["method"] in names and g}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--smollm2", default=str(ROOT / "out" / "pkg" / "smollm2"),
                    help="SmolLM2 fp32 package ('' skips it)")
    ap.add_argument("--per-category", type=int, default=1)
    ap.add_argument("--smol-repeats", type=int, default=2)
    ap.add_argument("--before", default=BEFORE_REV)
    ap.add_argument("--also", default="", help="a third auto, at this git revision, run too")
    ap.add_argument("--methods", default="", help="comma-separated labels (default: all)")
    ap.add_argument("--smol-methods", default="", help="the same for SmolLM2 (default: --methods)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "auto_cpu"))
    a = ap.parse_args(argv)
    register_before(a.before)
    methods = [m for m in METHODS if not a.methods or m[0] in a.methods.split(",")]
    if a.also:
        register_before(a.also, "auto-also")
        methods.insert(2, (f"auto at {a.also} BC<=60", dict(drafter="auto-also", bc=60)))
    out = Path(a.out)
    old_json = out.with_suffix(".json")
    before = before_ratios(old_json)
    previous = json.loads(old_json.read_text()) if old_json.is_file() else {}
    report = {"before": previous.get("before", previous)}
    with tempfile.TemporaryDirectory() as tmp:
        pkg = export_package(str(SHARED / "models" / "stories260K"), Path(tmp) / "stories",
                             force=True, progress=False).out
        model = Model.load(str(pkg), threads=a.threads)
        report["stories260K"] = measure(model, {"stories": story_prompts(a.prompts)}, methods,
                                        128, a.repeats)
    if not a.smollm2 and "SmolLM2-135M fp32" in previous:  # not measured: the last run's kept
        report["SmolLM2-135M fp32 (previous run)"] = previous["SmolLM2-135M fp32"]
    if a.smollm2:
        model = Model.load(a.smollm2, threads=a.threads)
        tasks = chat_turns(model, {k: v for k, v in prompt_sets(["spec_bench"], a.per_category).items()})
        smol = [m for m in METHODS if m[0] in a.smol_methods.split(",")] or methods
        report["SmolLM2-135M fp32"] = measure(model, tasks, smol, 64, a.smol_repeats)
    lines = ["# auto vs plain greedy, the previous auto and every fixed drafter (onnxruntime CPU)",
             "", f"{time.strftime('%Y-%m-%d')}, {a.threads} threads, a shared 2-core machine; "
             "median tok/s over repeats (methods interleaved, order reversed every other "
             "repeat); ratios within this run. `auto before` is `auto` at "
             f"{a.before} (k = 1 probing and PLD chains only), run in the same process. "
             "`before: vs greedy` is the previous results file's ratio (issue 4, 1 thread). "
             "`draft us/step`: host time of propose + observe per decode step.", ""]
    lines += table(f"stories260K ({a.prompts} story prompts, 128 new tokens)",
                   report["stories260K"], before)
    if "SmolLM2-135M fp32" in report:
        rows = report["SmolLM2-135M fp32"]
        lines += table(f"SmolLM2-135M-Instruct fp32 (Spec-Bench, {a.per_category} question(s) "
                       "per category, chat template, 64 new tokens)", rows, {})
        lines += per_task_table(rows)
    for name in ("stories260K", "SmolLM2-135M fp32"):
        if name in report:
            lines += [f"What new `auto` picked on {name} (steps, first repeat): "
                      + ", ".join(f"{k} {v}" for k, v in sorted(
                          report[name].get("auto BC<=60", {}).get("picked", {}).items(),
                          key=lambda kv: -kv[1])), ""]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text("\n".join(lines))
    out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    print("\n".join(lines))
    return 0 if all(r["lossless"] for name, rows in report.items() if name != "before"
                    for r in rows.values()) else 1


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    sys.exit(main())
