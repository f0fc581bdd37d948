"""Host overhead per decode step: the time a step spends outside the runtime's own run call
(drafting, binding, verification, commit, stop checks, streaming), on onnxruntime CPU with
stories260K, where a forward costs ~0.3 ms and host work decides the tokens/s.

Compares code versions in one sitting: each ``--src`` is a source tree of edgemtp (the
folders ``edgemtp``, ``export``, ``runtimes``, ``models``); every round runs each version in
a fresh child process, alternating, and the table reports medians over rounds, so machine
drift hits every version alike.

    python bench/bench_host.py --src before=/path/to/old/checkout --src after=. [--rounds 5]
    python bench/bench_host.py --src now=. --package v1=PKG1 --package v2=PKG2  # packages

Every (source tree, package) pair is one column; with several ``--package NAME=PATH`` the
same code runs on packages of different formats or exports.

Writes out/bench_host/host.json (``--out`` to change) and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT / ".." / "shared"
CONFIGS = {  # label -> generation options
    "greedy": dict(drafter="none"),
    "probe k=1 BC 30": dict(drafter="probe", bc=30),
    "probe k=2 BC 60 dynamic": dict(drafter="probe", bc=60, mask_tokens=2),
    "pld BC 10": dict(drafter="pld", bc=10),
    "hybrid BC 30": dict(drafter="hybrid", bc=30),
    "hybrid BC 60": dict(drafter="hybrid", bc=60),
    "probe BC 30, sampling": dict(drafter="probe", bc=30, temperature=0.8, top_p=0.9, seed=1),
    "probe BC 30, 2 stop strings": dict(drafter="probe", bc=30, stop=("zebra xylophone", "qqq")),
}

CHILD = r"""
import json, sys, time
# the source tree on PYTHONPATH, not an editable install's finder, provides edgemtp
sys.meta_path = [f for f in sys.meta_path if "__editable__" not in getattr(f, "__module__", "")]
from edgemtp import Model
pkg, prompts, configs, stream = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3]), sys.argv[4] == "1"
model = Model.load(pkg, threads=1)
out = {}
for label, opts in configs.items():
    opts = {k: tuple(v) if isinstance(v, list) else v for k, v in opts.items()}
    model.generate(prompts[0], max_new_tokens=16, **opts)  # warm-up: plans, bindings
    host = steps = wall = tokens = 0.0
    for p in prompts:
        t0 = time.perf_counter()
        if stream:
            for _ in model.stream(p, max_new_tokens=128, **opts):
                pass
            s = model.last_result.stats
        else:
            s = model.generate(p, max_new_tokens=128, **opts).stats
        wall += time.perf_counter() - t0
        host += s.total_time - s.time_prefill - s.time_forward
        steps += s.forward_calls - 1
        tokens += s.new_tokens
    out[label] = dict(host_us_per_step=1e6 * host / steps, tokens_per_second=tokens / wall,
                      steps=steps)
print(json.dumps(out))
"""


def tree_for(src: Path, work: Path) -> Path:
    """A folder laid out as the installed package is: edgemtp/ with export, runtimes and
    models inside it, so ``PYTHONPATH`` picks this version over the installed one."""
    pkg = work / "edgemtp"
    if not pkg.exists():
        pkg.mkdir(parents=True)
        for f in (src / "edgemtp").iterdir():
            (pkg / f.name).symlink_to(f.resolve())
        for sub in ("export", "runtimes", "models", "tools"):
            if (src / sub).is_dir():
                (pkg / sub).symlink_to((src / sub).resolve())
    return work


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--src", action="append", required=True, metavar="NAME=PATH")
    ap.add_argument("--package", action="append", default=None, metavar="[NAME=]PATH",
                    help="an exported stories260K package, repeatable "
                         "(default: export one into out/bench_host/)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--stream", action="store_true", help="generate through Model.stream")
    ap.add_argument("--out", default=str(ROOT / "out" / "bench_host"))
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.package is None:
        pkg = str(out / "stories260K")
        if not Path(pkg, "edgemtp.json").is_file():
            from edgemtp.export.onnx_export import export_package

            export_package(str(SHARED / "models" / "stories260K"), pkg, max_context=512,
                           force=True, progress=False)
        a.package = [pkg]
    packages = dict(p.split("=", 1) if "=" in p else ("", p) for p in a.package)
    with open(SHARED / "data" / "stories_prompts.jsonl") as f:
        prompts = [json.loads(line)["prompt"] for line in f][:a.prompts]
    versions = dict(s.split("=", 1) for s in a.src)
    columns = {(f"{v}@{n}" if n else v): (v, pkg) for v in versions
               for n, pkg in packages.items()}
    runs: dict[str, list[dict]] = {c: [] for c in columns}
    with tempfile.TemporaryDirectory() as tmp:
        trees = {v: tree_for(Path(p), Path(tmp) / v) for v, p in versions.items()}
        for r in range(a.rounds):
            for col, (v, pkg) in columns.items():
                env = dict(os.environ, PYTHONPATH=str(trees[v]))
                res = subprocess.run([sys.executable, "-c", CHILD, str(Path(pkg).resolve()),
                                      json.dumps(prompts), json.dumps(CONFIGS),
                                      "1" if a.stream else "0"],
                                     capture_output=True, text=True, env=env, check=True,
                                     cwd=trees[v])
                runs[col].append(json.loads(res.stdout.strip().splitlines()[-1]))
                print(f"round {r + 1}/{a.rounds}: {col} done", file=sys.stderr)
    names = list(columns)
    table = {label: {v: {key: statistics.median(run[label][key] for run in runs[v])
                         for key in ("host_us_per_step", "tokens_per_second")}
                     for v in names} for label in CONFIGS}
    lines = ["| config | " + " | ".join(f"{v} host µs/step | {v} tok/s" for v in names)
             + (f" | host {names[-1]} / {names[0]} |" if len(names) > 1 else " |"),
             "|---|" + "---:|---:|" * len(names) + ("---:|" if len(names) > 1 else "")]
    for label, row in table.items():
        cells = " | ".join(f"{row[v]['host_us_per_step']:.0f} | {row[v]['tokens_per_second']:.0f}"
                           for v in names)
        ratio = (f" | {row[names[-1]]['host_us_per_step'] / row[names[0]]['host_us_per_step']:.2f}"
                 if len(names) > 1 else "")
        lines.append(f"| {label} | {cells}{ratio} |")
    text = "\n".join(lines)
    print(text)
    (out / "host.json").write_text(json.dumps(dict(versions=versions, packages=packages,
                                                   rounds=a.rounds,
                                                   prompts=a.prompts, stream=a.stream,
                                                   table=table, runs=runs), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
