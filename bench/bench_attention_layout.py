"""How the attention over the past scales with the cache layout, in onnxruntime on this CPU.

Issue 10's long-context target is t(1) at P = 2048 <= 1.3 x t(1) at P = 64. For SmolLM2's fp32
package it is at ~1.43, and the growth is the attention's MatMuls over the past. This
measures those MatMuls alone, for 30 layers with SmolLM2's shapes (3 KV heads, 3 query heads
per KV head, head size 64; 94 MB of K and V at P = 2048), random data, in three forms:

- ``seq-major fold`` (what the graph does now): the cache ``[1, P, H_kv, D]``, each KV head's
  query group folded into rows (``[H_kv, g*T, D]``), the past read through permutes that
  onnxruntime fuses into FusedMatMul;
- ``head-major fold``: the cache ``[1, H_kv, P, D]``, the same fold;
- ``head-major, M = T``: the cache ``[1, H_kv, P, D]``, the queries ``[1, H_kv, g, T, D]``
  against the past broadcast over ``g`` (``[1, H_kv, 1, P, D]``), so a one-row step is a
  matrix-vector product per query head (MLAS's M = 1 kernels stream the rows unpacked).

Each cell: scores over the past, softmax, and ``p @ V``, all 30 layers in one session run
(distinct caches per layer, so nothing stays in cache), the median of 5 timings of 30 runs.

    python bench/bench_attention_layout.py [--threads 2] [--out bench/results]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
LAYERS, H_KV, G, D = 30, 3, 3, 64  # SmolLM2-135M


def _session(nodes, feeds: dict, outs: list, threads: int):
    import onnxruntime as ort
    from onnx import TensorProto
    from onnx import helper as H

    g = H.make_graph(nodes, "attention",
                     [H.make_tensor_value_info(k, TensorProto.FLOAT, list(v.shape))
                      for k, v in feeds.items()],
                     [H.make_empty_tensor_value_info(o) for o in outs])
    model = H.make_model(g, opset_imports=[H.make_opsetid("", 17)])
    model.ir_version = 8
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return ort.InferenceSession(model.SerializeToString(), opts,
                                providers=["CPUExecutionProvider"])


def timed(sess, feeds: dict, outs: list, runs: int = 30) -> float:
    io = sess.io_binding()
    for k, v in feeds.items():
        io.bind_cpu_input(k, v)
    for o in outs:
        io.bind_output(o, "cpu")
    for _ in range(5):
        sess.run_with_iobinding(io)
    ts = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(runs):
            sess.run_with_iobinding(io)
        ts.append((time.perf_counter() - t0) / runs * 1e6)
    return statistics.median(ts)


def forms(p: int, t: int, rng) -> dict:
    """Per form: (nodes, feeds, outputs)."""
    from onnx import TensorProto
    from onnx import helper as H

    k_heads = [rng.standard_normal((1, H_KV, p, D)).astype(np.float32) for _ in range(LAYERS)]
    v_heads = [rng.standard_normal((1, H_KV, p, D)).astype(np.float32) for _ in range(LAYERS)]
    q = rng.standard_normal((1, H_KV, G, t, D)).astype(np.float32)
    axis2 = H.make_node("Constant", [], ["axis2"],
                        value=H.make_tensor("axis2", TensorProto.INT64, [1], [2]))
    out = {}
    nodes, feeds, outs = [], {"q": q.reshape(1, H_KV, G * t, D)}, []
    for i in range(LAYERS):  # seq-major fold
        feeds[f"k{i}"] = np.ascontiguousarray(k_heads[i].transpose(0, 2, 1, 3))
        feeds[f"v{i}"] = np.ascontiguousarray(v_heads[i].transpose(0, 2, 1, 3))
        nodes += [H.make_node("Transpose", [f"k{i}"], [f"kt{i}"], perm=[0, 2, 3, 1]),
                  H.make_node("MatMul", ["q", f"kt{i}"], [f"s{i}"]),
                  H.make_node("Softmax", [f"s{i}"], [f"p{i}"], axis=-1),
                  H.make_node("Transpose", [f"v{i}"], [f"vt{i}"], perm=[0, 2, 1, 3]),
                  H.make_node("MatMul", [f"p{i}", f"vt{i}"], [f"o{i}"])]
        outs.append(f"o{i}")
    out["seq-major fold (now)"] = (nodes, feeds, outs)
    nodes, feeds, outs = [], {"q": q.reshape(1, H_KV, G * t, D)}, []
    for i in range(LAYERS):  # head-major fold
        feeds[f"k{i}"], feeds[f"v{i}"] = k_heads[i], v_heads[i]
        nodes += [H.make_node("Transpose", [f"k{i}"], [f"kt{i}"], perm=[0, 1, 3, 2]),
                  H.make_node("MatMul", ["q", f"kt{i}"], [f"s{i}"]),
                  H.make_node("Softmax", [f"s{i}"], [f"p{i}"], axis=-1),
                  H.make_node("MatMul", [f"p{i}", f"v{i}"], [f"o{i}"])]
        outs.append(f"o{i}")
    out["head-major fold"] = (nodes, feeds, outs)
    nodes, feeds, outs = [axis2], {"q": q}, []
    for i in range(LAYERS):  # head-major, M = T
        feeds[f"k{i}"], feeds[f"v{i}"] = k_heads[i], v_heads[i]
        nodes += [H.make_node("Unsqueeze", [f"k{i}", "axis2"], [f"ku{i}"]),
                  H.make_node("Transpose", [f"ku{i}"], [f"kt{i}"], perm=[0, 1, 2, 4, 3]),
                  H.make_node("MatMul", ["q", f"kt{i}"], [f"s{i}"]),
                  H.make_node("Softmax", [f"s{i}"], [f"p{i}"], axis=-1),
                  H.make_node("Unsqueeze", [f"v{i}", "axis2"], [f"vu{i}"]),
                  H.make_node("MatMul", [f"p{i}", f"vu{i}"], [f"o{i}"])]
        outs.append(f"o{i}")
    out["head-major, M = T"] = (nodes, feeds, outs)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--past", default="64,512,2048")
    ap.add_argument("--rows", default="1,10")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    a = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    rows = []
    for p in (int(x) for x in a.past.split(",")):
        for t in (int(x) for x in a.rows.split(",")):
            cells = {name: timed(_session(n, f, o, a.threads), f, o)
                     for name, (n, f, o) in forms(p, t, rng).items()}
            rows.append((p, t, cells))
            print(p, t, {k: round(v) for k, v in cells.items()}, file=sys.stderr, flush=True)
    names = list(rows[0][2])
    lines = ["# The attention over the past against the cache layout (onnxruntime CPU)", "",
             f"`bench/bench_attention_layout.py`, {time.strftime('%Y-%m-%d')}, {a.threads} "
             f"threads, load {os.getloadavg()[0]:.2f}: scores, softmax and p @ V over the past "
             f"for {LAYERS} layers of SmolLM2's shapes ({H_KV} KV heads x {G} query heads, "
             f"D = {D}), µs per step, median of 5 x 30 runs.", "",
             "| P | T | " + " | ".join(names) + " |", "|---:|---:|" + "---:|" * len(names)]
    for p, t, cells in rows:
        lines.append(f"| {p} | {t} | " + " | ".join(f"{cells[n]:.0f}" for n in names) + " |")
    text = "\n".join(lines) + "\n"
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "attention_layout_cpu.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
