"""``auto`` against plain greedy, two code versions side by side, on a real package.

Each ``--src`` is a source tree of edgemtp (as in ``bench_host.py``); every round runs each
version in a fresh child process, alternating, on the same package, prompts and threads.
A child measures its own latency curve (an empty ``EDGEMTP_CACHE``, so nothing measured by
an earlier process is read back) and runs, per prompt, greedy and ``auto`` in turns:

- ``measured``: ``auto`` on the curve the child just measured;
- ``tree cost`` (``--tree-cost``): ``auto`` with ``tree_cost="measured"``;
- ``stale``: ``auto`` on a curve given to it (``--stale FILE``, a latency-cache JSON or
  ``{"block_sizes": [...], "seconds": [...]}``), as a curve kept on disk from a bad moment
  would be: what ``auto`` does when its curve is wrong.

On each prompt an untimed one-token greedy run comes first (it sizes onnxruntime's arena
for that prompt's prefill, which greedy and ``auto`` share), then the two methods in turns,
who goes first alternating with the prompt and the round. Reported per scenario: ``auto``
tok/s over greedy's per prompt (median over rounds), their median and minimum, BE, and
whether every output equals greedy's.

    python bench/bench_auto_ab.py --src before=/path/to/old/checkout --src after=. \\
        --package out/SmolLM2-135M-Instruct-GGUF-int4 --stale bad_curve.json [--rounds 3]
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

from bench_host import tree_for

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, sys, time
sys.meta_path = [f for f in sys.meta_path if "__editable__" not in getattr(f, "__module__", "")]
from edgemtp import GenerationConfig, Model
from edgemtp.latency import LatencyCurve
pkg, qs = sys.argv[1], json.loads(sys.argv[2])
bc, tokens, threads, rnd = (int(x) for x in sys.argv[3:7])
stale = LatencyCurve.from_dict(json.loads(sys.argv[7])) if sys.argv[7] != "null" else None
model = Model.load(pkg, threads=threads)
chat = model.tokenizer is not None and model.tokenizer.chat_template is not None
prompts = [model.encode_chat([{"role": "user", "content": q}]) if chat else model.encode(q)
           for q in qs]
greedy = GenerationConfig(drafter="none", max_new_tokens=tokens)
scen = {"measured": GenerationConfig(drafter="auto", bc=bc, max_new_tokens=tokens)}
if stale is not None:
    scen["stale"] = scen["measured"].with_(latency=stale)
if sys.argv[8] == "1":
    scen["tree cost"] = scen["measured"].with_(tree_cost="measured")
model.generate(prompts[0], greedy.with_(max_new_tokens=16))
out = {}
for name, cfg in scen.items():
    model.memory.clear()  # each scenario learns from nothing
    model.generate(prompts[0], cfg.with_(max_new_tokens=16))  # measures the curve (measured)
    curve = next((v for k, v in model.memory.items()
                  if isinstance(k, tuple) and k[0] == "latency"), None)
    rows = []
    for i, p in enumerate(prompts):
        # untimed: the first run on a prompt's length grows onnxruntime's arena for the
        # prefill, which greedy and auto share (one session): whoever ran first paid for it
        model.generate(p, greedy.with_(max_new_tokens=1))
        runs = {}
        for label, c in (("greedy", greedy), ("auto", cfg))[:: 1 if (i + rnd) % 2 == 0 else -1]:
            t0 = time.perf_counter()
            r = model.generate(p, c)
            runs[label] = (r.stats.new_tokens / (time.perf_counter() - t0),
                           r.stats.forward_calls, r.token_ids)
        rows.append({"ratio": runs["auto"][0] / runs["greedy"][0], "greedy_tps": runs["greedy"][0],
                     "auto_tps": runs["auto"][0],
                     "tokens": len(runs["greedy"][2]), "auto_calls": runs["auto"][1],
                     "same": runs["auto"][2] == runs["greedy"][2]})
    out[name] = {"rows": rows, "curve": None if curve is None else curve.to_dict()}
print(json.dumps(out))
"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--src", action="append", required=True, metavar="NAME=PATH")
    ap.add_argument("--package", required=True)
    ap.add_argument("--stale", default=None, help="a latency curve JSON for the stale scenario")
    ap.add_argument("--prompts", type=int, default=13, help="Spec-Bench first turns, one per "
                                                             "category in turn")
    ap.add_argument("--bc", type=int, default=30)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=4, help="even: each method goes first on "
                                                          "each prompt equally often")
    ap.add_argument("--tree-cost", action="store_true",
                    help="a third scenario: auto with tree_cost='measured' (its hybrids and "
                         "STAND trees grow only while a node pays; needs a tree that has it)")
    ap.add_argument("--out", default=None, help="write the Markdown table here too")
    a = ap.parse_args(argv)
    stale = None
    if a.stale:
        raw = json.loads(Path(a.stale).read_text())
        stale = raw.get("curve", raw)
    from edgemtp.tools.demo import _questions

    # chosen here, by this tree, and handed over: a child resolves nothing from its own tree
    # (an older checkout elsewhere may not see ../shared and would fall back to 4 questions)
    questions = _questions(a.prompts)
    versions = dict(s.split("=", 1) for s in a.src)
    runs: dict[str, list[dict]] = {v: [] for v in versions}
    with tempfile.TemporaryDirectory() as tmp:
        trees = {v: tree_for(Path(p), Path(tmp) / v) for v, p in versions.items()}
        for r in range(a.rounds):
            for v in (list(versions) if r % 2 == 0 else list(versions)[::-1]):
                cache = Path(tmp) / f"cache-{v}-{r}"  # nothing measured earlier is read back
                env = dict(os.environ, PYTHONPATH=str(trees[v]), EDGEMTP_CACHE=str(cache))
                res = subprocess.run(
                    [sys.executable, "-c", CHILD, str(Path(a.package).resolve()),
                     json.dumps(questions),
                     str(a.bc), str(a.tokens), str(a.threads), str(r), json.dumps(stale),
                     "1" if a.tree_cost else "0"],
                    capture_output=True, text=True, env=env, cwd=trees[v])
                if res.returncode:
                    sys.exit(f"{v}: the child failed:\n{res.stderr[-2000:]}")
                runs[v].append(json.loads(res.stdout.strip().splitlines()[-1]))
                print(f"round {r + 1}/{a.rounds}: {v} done", file=sys.stderr)
    lines = [f"`auto` BC <= {a.bc} / greedy tok/s per prompt (median over {a.rounds} rounds), "
             f"{len(questions)} prompts x {a.tokens} new tokens, {a.threads} threads, "
             f"package `{a.package}`", "",
             "Tok/s columns: per prompt the median over rounds, then the median over prompts.",
             "",
             "| version | scenario | median | min | per prompt | greedy tok/s | auto tok/s | "
             "auto BE | identical | t(1), t(4), t(8) ms (first round) |",
             "|---|---|---:|---:|---|---:|---:|---:|:---:|---|"]
    for v, rs in runs.items():
        for scen in rs[0]:
            n = len(rs[0][scen]["rows"])
            per = [statistics.median(r[scen]["rows"][i]["ratio"] for r in rs) for i in range(n)]
            tps = {m: statistics.median(statistics.median(r[scen]["rows"][i].get(f"{m}_tps", 0.0)
                                                          for r in rs) for i in range(n))
                   for m in ("greedy", "auto")}
            be = (sum(row["tokens"] for row in rs[0][scen]["rows"])
                  / sum(row["auto_calls"] for row in rs[0][scen]["rows"]))
            same = all(row["same"] for r in rs for row in r[scen]["rows"])
            c = rs[0][scen]["curve"]
            pts = ""
            if c:
                t = dict(zip(c["block_sizes"], c["seconds"]))
                pts = ", ".join(f"{t[k] * 1e3:.1f}" for k in (1, 4, 8) if k in t)
            lines.append(f"| {v} | {scen} | {statistics.median(per):.3f} | {min(per):.3f} | "
                         f"{' '.join(f'{x:.2f}' for x in per)} | {tps['greedy']:.1f} | "
                         f"{tps['auto']:.1f} | {be:.2f} | "
                         f"{'yes' if same else 'NO'} | {pts} |")
    text = "\n".join(lines)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
