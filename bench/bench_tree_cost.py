"""``tree_cost="budget"`` against ``"measured"`` for the tree drafters (hybrid, STAND), in one
process on one loaded model: tokens/s, BE and identity with plain decoding.

Every round runs every configuration over the same prompts, in the same order, so machine
drift moves all alike; tok/s is the median over rounds. Each configuration keeps its drafter
memory across prompts and rounds, as a loaded model serving requests does (the measured fit
carries over). Prompts: stories260K's story prompts (token ids) or Spec-Bench first turns
under the model's chat template.

    python bench/bench_tree_cost.py out/pkg/stories260K --threads 1
    python bench/bench_tree_cost.py out/SmolLM2-135M-Instruct-GGUF-int4 --prompts spec-bench \\
        --n 6 --tokens 96 --bc 10,30 --threads 2 --rounds 2

Writes ``<out>/tree_cost_<package>.md`` (default ``bench/results``) and prints it.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def prompts_for(model, kind: str, n: int) -> tuple[list, str]:
    if kind == "stories":
        path = ROOT / "bench" / "data" / "gpu_prompts.json"  # stories260K's story prompts
        return json.loads(path.read_text())["prompts"][:n], f"{n} story prompts"
    from edgemtp.tools.demo import _questions

    qs = _questions(n)
    return ([model.encode_chat([{"role": "user", "content": q}]) for q in qs],
            f"{len(qs)} Spec-Bench first turns (chat template)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("package")
    ap.add_argument("--prompts", choices=("stories", "spec-bench"), default="stories")
    ap.add_argument("--n", type=int, default=12, help="prompts")
    ap.add_argument("--drafters", default="hybrid,stand")
    ap.add_argument("--bc", default="10,30,60")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    a = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT / "bench"))
    from edgemtp import Model

    model = Model.load(a.package, threads=a.threads)
    prompts, what = prompts_for(model, a.prompts, a.n)
    confs = [("plain", "", dict(drafter="none"))]
    for d in a.drafters.split(","):
        for bc in (int(b) for b in a.bc.split(",")):
            for cost in ("budget", "measured"):
                confs.append((f"{d}@{bc}", cost, dict(drafter=d, bc=bc, tree_cost=cost)))
    memories = {i: {} for i in range(len(confs))}  # one drafter memory per configuration
    tps = {i: [] for i in range(len(confs))}
    be, same = {}, {}
    for i, (_, _, opts) in enumerate(confs):  # warm-up: plans, bindings
        model.memory.clear()
        model.generate(prompts[0], max_new_tokens=16, **opts)
        memories[i] = dict(model.memory)
    for r in range(a.rounds):
        for i, (label, cost, opts) in enumerate(confs):
            model.memory.clear()
            model.memory.update(memories[i])
            t0, tokens, calls, outs = time.perf_counter(), 0, 0, []
            for p in prompts:
                res = model.generate(p, max_new_tokens=a.tokens, **opts)
                tokens += res.stats.new_tokens
                calls += res.stats.forward_calls
                outs.append(res.token_ids)
            tps[i].append(tokens / (time.perf_counter() - t0))
            memories[i] = dict(model.memory)
            be[i] = tokens / calls
            if i == 0:
                plain = outs
            same[i] = same.get(i, 0) + sum(o == p for o, p in zip(outs, plain))
            print(f"round {r + 1}/{a.rounds}: {label} {cost} done", file=sys.stderr)
    base = statistics.median(tps[0])
    lines = [f"# tree_cost: budget against measured ({Path(a.package).name})", "",
             f"{time.strftime('%Y-%m-%d')}; {platform.machine()}, onnxruntime CPU, "
             f"{a.threads} thread(s); {what} x {a.tokens} new tokens; {a.rounds} rounds, "
             f"tok/s the median. Command: `python bench/bench_tree_cost.py "
             f"{' '.join(sys.argv[1:] if argv is None else argv)}`", "",
             "| drafter | trees | BE | tok/s | x plain | identical |",
             "|---|---|---:|---:|---:|---:|"]
    for i, (label, cost, _) in enumerate(confs):
        med = statistics.median(tps[i])
        ident = "" if i == 0 else f"{same[i]}/{len(prompts) * a.rounds}"
        lines.append(f"| {label} | {cost} | {be[i]:.3f} | {med:.1f} | {med / base:.2f}x | "
                     f"{ident} |")
    text = "\n".join(lines)
    print(text)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"tree_cost_{Path(a.package).name}.md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
