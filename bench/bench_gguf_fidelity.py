"""How far an int4 export of a GGUF is from the file's own model.

``edgemtp export FILE.gguf --dtype int4`` de-quantizes the file's weights and quantizes
them again into ``MatMulNBits`` blocks (onnxruntime's layout, also the native decoder's):
blocks of 32 with a float scale and an *integer* zero point. A Q4_1 block is ``d * q + m``
with any float offset ``m``, so re-quantizing it shifts the block by up to half a step, and
the tied embedding / LM head (Q8_0 in SmolLM2's file) drops to 4 bits. This measures both:

- per linear weight: the share of its 32-blocks the re-quantization moves, and by how much
  (in units of the block's own step, (max - min) / 15);
- per weight set, teacher-forced on the file's own greedy answers (the GGUF de-quantized to
  float32, what llama.cpp computes up to its own rounding) to Spec-Bench first turns: how
  often the top-1 token agrees with the file's model, and the mean KL divergence from it.

The weight sets are the export's quantizer (``export.quantize.block_quantize``, exactly what
``MatMulNBitsQuantizer`` writes) applied in PyTorch to the body, the LM head, or both.

With ``--answers`` (llama-cpp-python installed, the packages under ``--work`` exported by
``bench/bench_peers.py``), the greedy answers themselves: llama.cpp on the file, edgemtp's
int4 and fp32 packages, each against the file's fp32 model's answers (identical answers,
and the median token at which they part).

    python bench/bench_gguf_fidelity.py                 # the shared SmolLM2 Q4_1 file

Writes ``--out`` ``.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_peers import edgemtp_package, gguf_path, hf_folder  # noqa: E402
from edgemtp.export.quantize import QUANTIZED, block_quantize, dequantize  # noqa: E402
from tools.prompts import prompt_sets  # noqa: E402

# (name, body bits, LM head bits); 0 = the file's own weights (de-quantized to float32)
SETS = [("the int4 package: 4-bit body and LM head", 4, 4),
        ("4-bit body, 8-bit LM head", 4, 8),
        ("4-bit body, the file's LM head", 4, 0),
        ("the file's body, 4-bit LM head", 0, 4)]


def requantize(w: np.ndarray, bits: int) -> np.ndarray:
    spec = QUANTIZED[f"int{bits}"]
    return dequantize(*block_quantize(w, spec), spec, w.shape[1])


def block_shift(w: np.ndarray) -> dict:
    """How the 4-bit re-quantization moves w's 32-blocks, in steps of (max - min) / 15."""
    k = w.shape[1] // 32 * 32
    b = w[:, :k].reshape(w.shape[0], -1, 32)
    step = (b.max(-1) - b.min(-1)) / 15
    err = np.abs(requantize(w, 4)[:, :k] - w[:, :k]).reshape(b.shape).max(-1)
    rel = err / np.maximum(step, 1e-30)
    return {"blocks": int(rel.size), "moved": float(np.mean(rel > 1e-3)),
            "median_steps": float(np.median(rel)), "max_steps": float(rel.max())}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", help="the GGUF (default: the shared SmolLM2 file, or fetched)")
    p.add_argument("--per-category", type=int, default=1)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--work", default=str(ROOT / "out" / "peers"))
    p.add_argument("--package", action="append", default=[], metavar="LABEL=BACKEND:PATH",
                   help="also teacher-force an exported package on a backend (native, "
                        "onnxruntime); repeatable")
    p.add_argument("--answers", action="store_true",
                   help="also compare greedy answers: llama.cpp and edgemtp's packages")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "gguf_fidelity_cpu"))
    a = p.parse_args(argv)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(a.threads)
    gguf = gguf_path(a.gguf)
    src = hf_folder(gguf, Path(a.work))
    tok = AutoTokenizer.from_pretrained(str(src))
    base = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()
    linears = {n: m for n, m in base.named_modules() if isinstance(m, torch.nn.Linear)}

    shifts = {n: block_shift(m.weight.detach().numpy()) for n, m in linears.items()
              if n != "lm_head"}
    moved = np.average([s["moved"] for s in shifts.values()],
                       weights=[s["blocks"] for s in shifts.values()])

    answers = []
    for qs in prompt_sets(["spec_bench"], a.per_category).values():
        for q in qs:
            ids = tok.apply_chat_template([{"role": "user", "content": q}],
                                          add_generation_prompt=True, return_tensors="pt",
                                          return_dict=False)
            with torch.no_grad():
                out = base.generate(ids, max_new_tokens=a.new_tokens, do_sample=False)
            answers.append((ids.shape[1], out))

    def log_probs(model) -> list:
        with torch.no_grad():
            return [torch.log_softmax(model(out).logits[0, n - 1:-1].double(), -1)
                    for n, out in answers]

    ref = log_probs(base)
    rows = []
    for name, body, head in SETS:
        m = copy.deepcopy(base)
        with torch.no_grad():
            for n, mod in m.named_modules():
                bits = head if n == "lm_head" else body
                if isinstance(mod, torch.nn.Linear) and bits:  # (a tied head: the table too)
                    w = mod.weight.detach().numpy()
                    mod.weight.copy_(torch.from_numpy(requantize(w, bits)))
        got = log_probs(m)
        same = np.concatenate([(r.argmax(-1) == g.argmax(-1)).numpy() for r, g in zip(ref, got)])
        kl = np.concatenate([(r.exp() * (r - g)).sum(-1).numpy() for r, g in zip(ref, got)])
        rows.append({"weights": name, "body_bits": body, "head_bits": head,
                     "top1_agrees": float(same.mean()), "mean_kl": float(kl.mean()),
                     "tokens": int(same.size)})
        print(f"{name}: top-1 {same.mean():.1%}, KL {kl.mean():.3f}", flush=True)

    for spec in a.package:
        label, _, rest = spec.partition("=")
        backend, _, path = rest.partition(":")
        got = package_log_probs(path, backend, answers, a.threads)
        same = np.concatenate([(r.argmax(-1) == g.argmax(-1)).numpy() for r, g in zip(ref, got)])
        kl = np.concatenate([(r.exp() * (r - g)).sum(-1).numpy() for r, g in zip(ref, got)])
        rows.append({"weights": f"{label} ({backend} backend)", "body_bits": None,
                     "head_bits": None, "top1_agrees": float(same.mean()),
                     "mean_kl": float(kl.mean()), "tokens": int(same.size), "package": path})
        print(f"{label}: top-1 {same.mean():.1%}, KL {kl.mean():.3f}", flush=True)

    agreement = answers_agreement(gguf, Path(a.work), answers, a) if a.answers else []
    if a.answers:  # llama.cpp's own logits on the same answers (its Q8_1 activations)
        from llama_cpp import Llama

        llm = Llama(model_path=str(gguf), n_ctx=2048, n_threads=a.threads,
                    n_threads_batch=a.threads, verbose=False, seed=0, logits_all=True)
        got = []
        for n, out in answers:
            llm.reset()
            llm.eval(out[0].tolist())
            got.append(torch.log_softmax(torch.from_numpy(
                np.array(llm.scores[n - 1:out.shape[1] - 1], np.float64)), -1))
        same = np.concatenate([(r.argmax(-1) == g.argmax(-1)).numpy() for r, g in zip(ref, got)])
        kl = np.concatenate([(r.exp() * (r - g)).sum(-1).numpy() for r, g in zip(ref, got)])
        rows.append({"weights": "llama.cpp on the file itself (its 8-bit activations)",
                     "body_bits": None, "head_bits": None, "top1_agrees": float(same.mean()),
                     "mean_kl": float(kl.mean()), "tokens": int(same.size)})
        print(f"llama.cpp: top-1 {same.mean():.1%}, KL {kl.mean():.3f}", flush=True)
    result = {"gguf": gguf.name, "answers_agreement": agreement, "answers": len(answers),
              "new_tokens": a.new_tokens,
              "block_shift": {"moved": float(moved), "per_weight": shifts}, "rows": rows,
              "date": time.strftime("%Y-%m-%d")}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    med = np.median([s["median_steps"] for s in shifts.values()])
    lines = [f"# An int4 export against its GGUF's own model ({gguf.name})", "",
             f"`bench/bench_gguf_fidelity.py`, {result['date']}. Teacher-forced on the file's "
             f"own greedy answers ({a.new_tokens} new tokens at most) to {len(answers)} "
             f"Spec-Bench first turns, {rows[0]['tokens']} answer tokens.", "",
             f"Re-quantizing the body's 4-bit blocks moved {moved:.1%} of them "
             f"({sum(s['blocks'] for s in shifts.values())} blocks over {len(shifts)} "
             f"weights; median shift per weight {med:.2f} of a block's step, at most "
             f"{max(s['max_steps'] for s in shifts.values()):.2f}).", "",
             "| weights | top-1 equal to the file's model | mean KL from it |",
             "|---|---:|---:|"]
    lines += [f"| {r['weights']} | {r['top1_agrees']:.1%} | {r['mean_kl']:.3f} |" for r in rows]
    if agreement:
        lines += ["", f"Greedy answers against the file's fp32 model's (first {a.new_tokens} "
                  "tokens; the last row against llama.cpp's):", "",
                  "| runtime, weights | identical answers | median token where they part |",
                  "|---|---:|---:|"]
        lines += [f"| {r['runtime']} | {r['identical']}/{r['answers']} | "
                  f"{r['median_first_difference']} |" for r in agreement]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


def package_log_probs(path: str, backend: str, answers: list, threads: int) -> list:
    """Teacher-forced log-probabilities of an exported package: each prompt + answer as one
    causal block on ``backend``, the answer's rows."""
    import torch

    from edgemtp.backend import backend_class

    b = backend_class(backend)(path, threads=threads)
    out = []
    for n, ids in answers:
        seq = ids[0].numpy().astype(np.int64)
        t = len(seq)
        s = b.session()
        step = s.forward(seq, np.arange(t, dtype=np.int64), np.tril(np.ones((t, t), bool)),
                         None, topk=0, full_logits=True)
        out.append(torch.log_softmax(torch.from_numpy(
            step.logits[n - 1:t - 1].astype(np.float64)), -1))
    return out


def answers_agreement(gguf: Path, work: Path, answers: list, a) -> list[dict]:
    """Greedy answers of llama.cpp and edgemtp's packages against the fp32 model's."""
    from llama_cpp import Llama

    from edgemtp.api import Model
    from edgemtp.config import GenerationConfig

    refs = [(out[0, n:].tolist(), out[0, :n].tolist()) for n, out in answers]
    llm = Llama(model_path=str(gguf), n_ctx=2048, n_threads=a.threads,
                n_threads_batch=a.threads, verbose=False, seed=0)

    def llama_cpp(ids):
        llm.reset()
        got = []
        for t in llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0,
                              repeat_penalty=1.0, reset=True):
            got.append(int(t))
            if t == llm.token_eos() or len(got) >= a.new_tokens:
                break
        return got

    runners = {"llama.cpp (llama-cpp-python), the GGUF": llama_cpp}
    int4_answers: list = []
    config = GenerationConfig(drafter="none", max_new_tokens=a.new_tokens)
    for dtype in ("int4", "fp32"):
        model = Model.load(str(edgemtp_package(gguf, work, dtype)), threads=a.threads)
        runners[f"edgemtp, {dtype} package ({model.backend.name})"] = (
            lambda ids, m=model: list(m.generate(ids, config).token_ids))
    rows, llama_answers = [], []
    for name, run in list(runners.items()) + [("edgemtp, int4 package, against llama.cpp's "
                                               "answers", None)]:
        firsts = []
        for i, (want, prompt) in enumerate(refs):
            if run is None:  # the int4 package's answers against llama.cpp's
                got, want = int4_answers[i], llama_answers[i]
            else:
                got = run(prompt)
                if name.startswith("llama.cpp"):
                    llama_answers.append(got)
                elif "int4" in name:
                    int4_answers.append(got)
            firsts.append(next((i for i, (x, y) in enumerate(zip(got, want)) if x != y),
                               None if len(got) == len(want) else min(len(got), len(want))))
        differ = sorted(f for f in firsts if f is not None)
        rows.append({"runtime": name, "answers": len(refs),
                     "identical": firsts.count(None),
                     "median_first_difference": (differ[len(differ) // 2] if differ
                                                 else None)})
        print(f"{name}: {rows[-1]}", flush=True)
    return rows


if __name__ == "__main__":
    sys.exit(main())
