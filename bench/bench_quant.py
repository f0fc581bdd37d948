"""Quantized packages on CPU (issue 10, part 3): which MatMulNBits configuration keeps
speculation lossless, and what it costs.

For every configuration (a package's graph with another ``accuracy_level``, same weights):

- t(T): the graph on a block of T rows after a 40-token prompt (past bound as a 64-row
  bucket, as the backend binds it), the fastest of ``--repeat`` runs;
- batch invariance: each of those T rows alone (T = 1, same past) against the same row inside
  the block, bitwise (rows equal) and the largest logit difference;
- tok/s of plain decoding, and whether hybrid / PLD / probe give exactly plain decoding's
  tokens, on Spec-Bench chat prompts (first turn of the first question of each category).

    python bench/bench_quant.py out/pkg/smol32 out/pkg/smol4 out/pkg/smol8 \\
        --threads 2 --prompts 6 --out bench/results/quant_cpu

Writes ``OUT.md`` and ``OUT.json``. Variant packages go to ``out/quant_variants/`` (the
external weights hard-linked, only ``model.onnx`` rewritten).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from edgemtp.runtimes.package import MANIFEST, load_package, record_files  # noqa: E402
from tools.prompts import prompt_sets  # noqa: E402

DRAFTERS = (("hybrid", 10), ("pld", 10), ("probe", 30))
BLOCKS = (1, 10, 30, 60)


def variant(pkg: Path, level: int, dest_root: Path) -> Path:
    """A copy of the quantized package ``pkg`` whose MatMulNBits run at ``level``."""
    import onnx

    dest = dest_root / f"{pkg.name}-acc{level}"
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    for f in pkg.rglob("*"):
        target = dest / f.relative_to(pkg)
        if f.is_dir():
            target.mkdir(exist_ok=True)
        elif f.name.endswith(".data"):
            os.link(f, target)
        else:
            shutil.copy2(f, target)
    proto = onnx.load(str(dest / "model.onnx"), load_external_data=False)
    for node in proto.graph.node:
        if node.op_type == "MatMulNBits":
            for a in list(node.attribute):
                if a.name == "accuracy_level":
                    node.attribute.remove(a)
            if level:
                node.attribute.append(onnx.helper.make_attribute("accuracy_level", level))
    onnx.save_model(proto, str(dest / "model.onnx"))
    manifest = json.loads((dest / MANIFEST).read_text())
    manifest["weights"]["accuracy_level"] = level
    manifest["files"] = {k: {"bytes": v.bytes, "sha256": v.sha256}
                         for k, v in record_files(dest).items()}
    (dest / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    load_package(dest, check_plans=False)
    return dest


def graph_study(pkg: Path, threads: int, repeat: int) -> dict:
    """t(T) and bitwise batch invariance of one package's graph."""
    import onnxruntime as ort

    package = load_package(pkg, check_plans=False)
    m, rows = package.meta, package.weights.min_rows  # a shorter block runs padded, as live
    so = ort.SessionOptions()
    so.log_severity_level, so.intra_op_num_threads = 3, threads
    s = ort.InferenceSession(str(pkg / "model.onnx"), so, providers=["CPUExecutionProvider"])
    names = [i.name for i in s.get_inputs()]
    kv = (1, 0, m.num_kv_heads, m.head_dim)

    def feed(ids, pos, mask, past, plen):
        f = {"input_ids": ids[None], "position_ids": pos[None], "tree_mask": mask[None, None],
             "mask_embeds": np.zeros((1, m.hidden_size), np.float32),
             "past_len": np.array([plen])}
        f.update(zip(names[4:-1], past))
        return f

    rng = np.random.default_rng(0)
    p = 40
    empty = [np.zeros(kv, np.float32)] * (2 * m.num_layers)
    prompt = rng.integers(100, m.vocab_size // 2, p)
    out = s.run(None, feed(prompt, np.arange(p), np.tril(np.ones((p, p), bool)), empty, 0))
    past = [np.concatenate([o, np.zeros((1, 64 - p, *kv[2:]), np.float32)], 1)
            for o in out[4:]]
    result = {"t_ms": {}, "rows_equal": {}, "max_diff": {}}
    def alone(i):  # row i alone, padded with copies of itself to the package's min_rows
        one = np.repeat(ids[i:i + 1], rows), np.repeat(pos[i:i + 1], rows)
        return s.run(["logits"], feed(*one, np.eye(rows, dtype=bool), past, p))[0][0, :1]

    for t in BLOCKS:
        ids, pos = rng.integers(100, m.vocab_size // 2, t), np.full(t, p)
        ids, pos = np.resize(ids, max(t, rows)), np.resize(pos, max(t, rows))
        f = feed(ids, pos, np.eye(len(ids), dtype=bool), past, p)  # rows see the past, self
        block = s.run(["logits"], f)[0][0, :t]
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            s.run(["argmax"], f)
            times.append(time.perf_counter() - t0)
        alone_rows = np.concatenate([alone(i) for i in range(t)])
        result["t_ms"][t] = round(1e3 * min(times), 2)
        result["rows_equal"][t] = int((block == alone_rows).all(-1).sum())
        result["max_diff"][t] = float(np.abs(block - alone_rows).max())
    result["invariant"] = all(result["rows_equal"][t] == t for t in BLOCKS)
    return result


def generation_study(pkg: Path, threads: int, prompts: list[str], new_tokens: int) -> dict:
    from edgemtp import Model

    model = Model.load(str(pkg), threads=threads)
    runs = {"plain": [], **{d: [] for d, _ in DRAFTERS}}
    same = {d: 0 for d, _ in DRAFTERS}
    be = {d: [] for d, _ in DRAFTERS}
    for text in prompts:
        ids = model.encode_chat([{"role": "user", "content": text}])
        plain = model.generate(ids, drafter="none", max_new_tokens=new_tokens)
        runs["plain"].append(plain.stats.tokens_per_second)
        for name, bc in DRAFTERS:
            r = model.generate(ids, drafter=name, bc=bc, max_new_tokens=new_tokens)
            runs[name].append(r.stats.tokens_per_second)
            be[name].append(r.stats.block_efficiency)
            same[name] += r.token_ids == plain.token_ids
    return {"tok_s": {k: round(float(np.mean(v)), 1) for k, v in runs.items()},
            "identical": same, "be": {k: round(float(np.mean(v)), 2) for k, v in be.items()},
            "prompts": len(prompts)}


def package_size(pkg: Path) -> int:
    return sum(f.stat().st_size for f in pkg.rglob("*") if f.is_file())


def report(rows: list[dict], threads: int, new_tokens: int) -> str:
    n = rows[0]["gen"]["prompts"] if rows and "gen" in rows[0] else 0
    lines = [
        "# Quantized packages on CPU: batch invariance and speed (SmolLM2-135M-Instruct)",
        "",
        f"`python bench/bench_quant.py` on this 2-core machine (shared with other jobs, so "
        f"t(T) is the fastest of several runs), {threads} threads. t(T): one graph run on a "
        f"block of T rows after a 40-token prompt. *Rows equal*: of those T rows, how many "
        f"give bitwise the logits the same row gives alone (T = 1, same past). Generation: "
        f"{n} Spec-Bench questions (first turn, chat template), {new_tokens} new tokens; "
        f"*same* = drafter's tokens identical to plain decoding of the same package.",
        "",
        "| config | package MB | t(1) | t(10) | t(30) | t(60) ms | rows equal T=10/30/60 | "
        "max \\|Δlogit\\| | plain tok/s | hybrid BC10 same | PLD BC10 same | probe BC30 same "
        "| hybrid / PLD / probe tok/s |",
        "|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        g, gen = r["graph"], r.get("gen")
        eq = "/".join(f"{g['rows_equal'][t]}" for t in BLOCKS[1:])
        cells = [r["config"], f"{r['bytes'] / 1e6:.1f}",
                 *(f"{g['t_ms'][t]:.1f}" for t in BLOCKS), eq,
                 f"{max(g['max_diff'].values()):.1e}"]
        if gen:
            cells += [f"{gen['tok_s']['plain']:.1f}",
                      *(f"{gen['identical'][d]}/{gen['prompts']}" for d, _ in DRAFTERS),
                      " / ".join(f"{gen['tok_s'][d]:.1f}" for d, _ in DRAFTERS)]
        else:
            cells += ["–"] * 5
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("packages", nargs="+", help="packages; int4/int8 ones are also run at "
                    "every --levels accuracy level")
    ap.add_argument("--levels", default="1,4", help="MatMulNBits accuracy levels to compare")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--no-generate", action="store_true")
    ap.add_argument("--out", default="bench/results/quant_cpu")
    a = ap.parse_args(argv)
    chats = [p for ps in prompt_sets(["spec_bench"], 1).values() for p in ps][:a.prompts]
    configs = []
    for path in map(Path, a.packages):
        w = load_package(path, check_plans=False).manifest.get("weights") or {}
        if w.get("block_size") and a.levels:
            for level in (int(x) for x in a.levels.split(",") if x):
                configs.append((f"{w['format']}-b{w['block_size']}-acc{level}",
                                variant(path, level, ROOT / "out" / "quant_variants")))
        else:
            configs.append((w.get("format", "fp32"), path))
    rows = []
    for name, path in configs:
        row = {"config": name, "bytes": package_size(path),
               "graph": graph_study(path, a.threads, a.repeat)}
        print(name, row["graph"], flush=True)
        if not a.no_generate:
            row["gen"] = generation_study(path, a.threads, chats, a.new_tokens)
            print(name, row["gen"], flush=True)
        rows.append(row)
        Path(a.out + ".json").write_text(json.dumps(rows, indent=1) + "\n")
        Path(a.out + ".md").write_text(report(rows, a.threads, a.new_tokens))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
