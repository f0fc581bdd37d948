"""What a quantized K/V cache costs in fidelity, before any kernel is written for it.

A cache of fewer bytes a row makes a long context's one-row step cheaper (issue 10's
t(1) at P = 2048 against P = 64 is bound by the cache's reads: the int8 cache's 25.8 MB a
step). This measures what 8 and 4 bits would do to SmolLM2-135M-Instruct's outputs, by
rounding K (after the rotary embedding) and V inside transformers' eager attention, in float32:

- each K row per head in blocks of ``k`` dimensions, each V row in blocks of ``v`` lanes,
  symmetric, amax / 127 (8 bits) or amax / 7 (4 bits), rounded to nearest even: edgemtp's
  int8 cache is ``k8/64 v8/32`` (its query is rounded to 16 bits there, not here);
- teacher-forced over Spec-Bench's chat prompts (SmolLM2's template, concatenated, the first
  ``--tokens``): per row, the largest logit change over the row's largest logit (median,
  90th percentile) and how often the top-1 token stays;
- greedy answers to ``--prompts`` chat prompts: where each leaves the float cache's answer.

With ``--package`` (an int4 package on the native backend) the real int8 cache is measured the
same way against the package's float16 cache, as a check of the simulation.

    python bench/bench_kv_quant.py --package out/peers/edgemtp-int4 \\
        --out bench/results/kv_quant_smollm2

Writes ``--out`` ``.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
CHAT = ROOT / "bench" / "data" / "gpu_prompts_smollm2.json"
GGUF = ROOT.parent / "shared" / "models" / "SmolLM2-135M-Instruct-GGUF" / \
    "SmolLM2-135M-Instruct.Q4_1.gguf"
# (label, K (bits, block), V (bits, block)); None: float
MODES = [("float", None, None), ("k8/64 v8/32 (edgemtp int8)", (8, 64), (8, 32)),
         ("k8/64 v4/32", (8, 64), (4, 32)), ("k4/32 v8/32", (4, 32), (8, 32)),
         ("k4/32 v4/32", (4, 32), (4, 32)), ("k4/64 v4/32", (4, 64), (4, 32))]


def fake_quant(x, bits: int, block: int):
    """``x`` [..., D] rounded per block of ``block`` along the last axis to symmetric
    ``bits``-bit codes (amax / 127 or amax / 7, ties to even) and back to floats: a zero
    block stays zero.

    >>> import torch
    >>> fake_quant(torch.tensor([[1.0, -0.5, 0.25, 0.0]]), 4, 2).tolist()
    [[1.0, -0.4285714626312256, 0.25, 0.0]]
    """
    import torch

    shape, d = x.shape, x.shape[-1]
    xb = x.reshape(*shape[:-1], d // block, block)
    levels = 127 if bits == 8 else 7
    s = xb.abs().amax(-1, keepdim=True) / levels
    safe = torch.where(s > 0, s, torch.ones_like(s))
    q = torch.where(s > 0, torch.round(xb / safe).clamp(-levels, levels), torch.zeros_like(xb))
    return (q * s).reshape(shape)


def rel_change(logits: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """Per row: the largest logit change over the reference row's largest |logit|."""
    return np.abs(logits - ref).max(-1) / np.abs(ref).max(-1)


def first_difference(a: list, b: list) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def simulate(gguf: Path, seq: list[int], prompts: list[list[int]], new_tokens: int,
             threads: int, int4: bool = False, a8: bool = False) -> list[dict]:
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.models.llama import modeling_llama

    torch.set_num_threads(threads)
    hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                              dtype=torch.float32,
                                              attn_implementation="eager").eval()
    if int4:  # the int4 package's weights: the export's quantizer on every linear layer
        from bench_gguf_fidelity import requantize

        with torch.no_grad():
            for mod in hf.modules():
                if isinstance(mod, torch.nn.Linear):
                    mod.weight.copy_(torch.from_numpy(requantize(mod.weight.numpy(), 4)))
    if a8:  # every linear layer's input rounded to int8 per block of 32 (amax / 127), as the
        # native decoder's int4 products take their activations (quant_row)
        for mod in hf.modules():
            if isinstance(mod, torch.nn.Linear):
                mod.register_forward_pre_hook(lambda _, args: (fake_quant(args[0], 8, 32),))
    plain = modeling_llama.eager_attention_forward
    mode: dict = {}

    def attention(module, query, key, value, attention_mask, **kw):
        if mode.get("k"):
            key = fake_quant(key, *mode["k"])
        if mode.get("v"):
            value = fake_quant(value, *mode["v"])
        return plain(module, query, key, value, attention_mask, **kw)

    modeling_llama.eager_attention_forward = attention
    rows, ref, ref_answers = [], None, None
    try:
        with torch.no_grad():
            for label, k, v in MODES:
                mode.update(k=k, v=v)
                logits = hf(torch.tensor([seq])).logits[0].numpy()
                answers = []
                for ids in prompts:
                    x = torch.tensor([ids])
                    y = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                    max_new_tokens=new_tokens)
                    answers.append(y[0, len(ids):].tolist())
                if ref is None:
                    ref, ref_answers = logits, answers
                    continue
                rel = rel_change(logits, ref)
                rows.append(dict(cache=label, k=k, v=v,
                                 bytes_per_row_head=row_bytes(k, v, 64),
                                 rel_median=float(np.median(rel)),
                                 rel_p90=float(np.percentile(rel, 90)),
                                 top1_same=float(np.mean(logits.argmax(-1) == ref.argmax(-1))),
                                 first_difference=[first_difference(a, b) for a, b in
                                                   zip(ref_answers, answers)]))
                print(f"{label}: median {100 * rows[-1]['rel_median']:.2f} %, top-1 "
                      f"{100 * rows[-1]['top1_same']:.1f} %, answers part at "
                      f"{rows[-1]['first_difference']}", flush=True)
    finally:
        modeling_llama.eager_attention_forward = plain
    return rows


def row_bytes(k, v, d: int) -> float:
    """Bytes a cached row and KV head takes: codes plus a float scale a block, as the native
    int8 cache keeps them (140 a row at d = 64)."""
    def part(q):
        return 2 * d if q is None else d * q[0] / 8 + 4 * d // q[1]
    return part(k) + part(v)


def native_int8(package: str, seq: list[int], threads: int) -> dict:
    """The real int8 cache against the same package's float16 cache, teacher-forced."""
    from edgemtp.runtimes.native_backend import NativeBackend

    t = len(seq)
    out = {}
    for kv in ("fp16", "int8"):
        b = NativeBackend(package, threads=threads, kv_cache=kv)
        step = b.session().forward(np.asarray(seq, np.int64), np.arange(t, dtype=np.int64),
                                   np.tril(np.ones((t, t), bool)), None, topk=0,
                                   full_logits=True)
        out[kv] = step.logits.astype(np.float64)
    rel = rel_change(out["int8"], out["fp16"])
    return dict(rel_median=float(np.median(rel)), rel_p90=float(np.percentile(rel, 90)),
                top1_same=float(np.mean(out["int8"].argmax(-1) == out["fp16"].argmax(-1))))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gguf", default=str(GGUF), help="SmolLM2's GGUF (default: the shared file)")
    p.add_argument("--tokens", type=int, default=1200, help="teacher-forced rows (1200)")
    p.add_argument("--prompts", type=int, default=6, help="chat prompts answered greedily (6)")
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--package", help="an int4 package: its real int8 cache, as a check")
    p.add_argument("--int4-weights", action="store_true",
                   help="simulate on the int4 package's weights (the export's quantizer)")
    p.add_argument("--int8-activations", action="store_true",
                   help="round every linear layer's input to int8 blocks of 32, as the "
                        "native decoder does")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "kv_quant_smollm2"))
    a = p.parse_args(argv)
    for name in ("tokens", "prompts", "new_tokens", "threads"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} {getattr(a, name)}: expected a positive count")
    gguf = Path(a.gguf)
    if not gguf.is_file():
        p.error(f"--gguf {gguf}: no such file")
    if a.package and not (Path(a.package) / "edgemtp.json").is_file():
        p.error(f"--package {a.package}: not an exported package (no edgemtp.json)")
    chat = json.loads(CHAT.read_text())["prompts"]
    seq = [t for ids in chat for t in ids][:a.tokens]
    t0 = time.perf_counter()
    rows = simulate(gguf, seq, chat[:a.prompts], a.new_tokens, a.threads, a.int4_weights,
                    a.int8_activations)
    real = native_int8(a.package, seq, a.threads) if a.package else None
    result = dict(command=" ".join(sys.argv), gguf=gguf.name, int4_weights=a.int4_weights,
                  int8_activations=a.int8_activations,
                  tokens=len(seq),
                  prompts=a.prompts, new_tokens=a.new_tokens, rows=rows, native_int8=real,
                  seconds=round(time.perf_counter() - t0, 1))
    out = Path(a.out)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    md = [f"# A quantized K/V cache's fidelity, simulated on {gguf.name}"
          + (" (int4 weights)" if a.int4_weights else "")
          + (" (int8 activations)" if a.int8_activations else ""), "",
          f"`{result['command']}` ({result['seconds']} s). Teacher-forced over {len(seq)} "
          "tokens of Spec-Bench chat prompts (SmolLM2's template); greedy answers to "
          f"{a.prompts} of them, {a.new_tokens} new tokens, against the float cache's.", "",
          "| cache | bytes a row and head | logit change, median | 90th pct | top-1 same | "
          "answers part at token |", "|---|---:|---:|---:|---:|---|",
          "| float16 | 256 | | | | |"]
    md += [f"| {r['cache']} | {r['bytes_per_row_head']:.0f} | {100 * r['rel_median']:.2f} % | "
           f"{100 * r['rel_p90']:.2f} % | {100 * r['top1_same']:.1f} % | "
           f"{', '.join(map(str, r['first_difference']))} |" for r in rows]
    if real:
        md += ["", f"The real int8 cache (native backend, `{a.package}`) against the same "
               "package's float16 cache over the same rows: median "
               f"{100 * real['rel_median']:.2f} %, 90th pct {100 * real['rel_p90']:.2f} %, "
               f"top-1 same {100 * real['top1_same']:.1f} %."]
    out.with_suffix(".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
