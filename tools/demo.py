"""``edgemtp demo``, the main job.

Without ``--model`` it chats: SmolLM2-135M-Instruct (the GGUF from ``../shared/models``, or
fetched once from the package index) exported once to an int4 package, on Spec-Bench questions
under its chat template; plain greedy decoding against the drafters that pay on a CPU (probing
at BC 10, prompt lookup, the hybrid at BC 10 and at BC 30 with ``tree_cost="measured"``,
auto), every output checked against the package's own
greedy decoding, with the answer, BE and speed-ups printed.

With ``--model PATH`` (a model folder or package; ``--chat`` for chat questions) it runs every
drafter (probing at BC 10 / 30 / 60 with k = 1 and k = 2, prompt lookup, lookahead, the hybrid,
auto) on story prompts, checking greedy against ``transformers`` ``generate`` as well. With the
``auto`` or ``onnxruntime`` backend a Hugging Face folder is first exported to an ONNX package
under ``--out``.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

from edgemtp.runtimes.package import is_package

from edgemtp.config import GenerationConfig

from . import at_least_one, quiet_transformers
from .prompts import STORY_PROMPTS, story_prompts

# where ../shared/data is absent (said on stderr: the figures are then not README's prompts')
FALLBACK_PROMPTS = ["Once upon a time, there was a little girl named", "The cat sat on the",
                    "One day, a little boy went to the park and saw",
                    "Tom and his dog liked to play in the garden. One morning,",
                    "There was a big red ball in the box.", "Lily wanted to bake a cake for"]
FALLBACK_QUESTIONS = ["What is the capital of France? Explain in two sentences.",
                      "Write a short poem about the sea.",
                      "Give three tips for staying focused while studying.",
                      "Explain what a hash table is to a beginner.",
                      "Write a short story about a robot who learns to paint.",
                      "If a train travels 120 km in 1.5 hours, what is its average speed?"]


def _fallback(kind: str, missing, items: list[str], n: int) -> list[str]:
    print(f"demo: no {kind} at {missing} (../shared/data is not on this machine): "
          f"{min(n, len(items))} built-in ones instead, so the figures are not the README's",
          file=sys.stderr)
    return items[:n]

CONFIGS = [  # (label, options); the first one is the reference
    ("greedy (no drafter)", dict(drafter="none")),
    ("probe k=1 BC=10", dict(drafter="probe", bc=10)),
    ("probe k=1 BC=30", dict(drafter="probe", bc=30)),
    ("probe k=1 BC=60", dict(drafter="probe", bc=60)),
    ("probe k=2 BC=60 dynamic", dict(drafter="probe", bc=60, mask_tokens=2)),
    ("prompt lookup BC=10", dict(drafter="pld", bc=10)),
    ("lookahead (LADE) BC=30", dict(drafter="lade", bc=30)),
    ("hybrid k=1 BC=30", dict(drafter="hybrid", bc=30)),
    ("auto BC<=60", dict(drafter="auto", bc=60)),
]

# the default chat run: the methods that can pay on a 2-core CPU, where a wide block costs
# several tokens (the wide plans are in CONFIGS, with --model)
CHAT_CONFIGS = [
    ("greedy (no drafter)", dict(drafter="none")),
    ("probe k=1 BC=10", dict(drafter="probe", bc=10)),
    ("prompt lookup BC=10", dict(drafter="pld", bc=10)),
    ("hybrid k=1 BC=10", dict(drafter="hybrid", bc=10)),
    # its tree and Jacobi window held to what pays on this device (tree_cost="measured")
    ("hybrid k=1 BC=30 measured", dict(drafter="hybrid", bc=30, tree_cost="measured")),
    ("auto BC<=30", dict(drafter="auto", bc=30)),
]


def command(a) -> int:
    """``edgemtp demo``; returns the exit code (1 when an output differs from greedy's)."""
    from edgemtp.api import Model

    at_least_one(prompts=a.prompts, rounds=getattr(a, "rounds", 1))
    GenerationConfig(drafter="none", max_new_tokens=a.max_new_tokens)  # checks the count
    default = a.model is None
    if default:  # the main job: chat with the real instruct model, int4
        a.chat = True
        a.export_dtype = a.export_dtype or "int4"
    if a.chat:
        from .fetch import smollm2_gguf

        model_path = a.model or str(smollm2_gguf())
        prompts = _questions(a.prompts)
    else:
        model_path = a.model
        prompts = (story_prompts(a.prompts) if STORY_PROMPTS.is_file()
                   else _fallback("story prompts", STORY_PROMPTS, FALLBACK_PROMPTS, a.prompts))
    _check_first(a, model_path)  # (qa9 D1, D2: after the reference run and the export)
    quiet_transformers(model_path)
    packaged = is_package(model_path)
    reference = (None if a.no_reference or packaged or a.chat
                 else _transformers_reference(model_path, prompts, a))
    run_path = model_path
    load_dtype = a.dtype
    if a.backend in ("auto", "onnxruntime") and not packaged:
        # a package holds fp32 or fp16 weights (bf16 exports as fp32) and loads as it is
        export_dtype = a.export_dtype or (a.dtype if a.dtype in ("fp32", "fp16") else "fp32")
        load_dtype = None
        from edgemtp.export.onnx_export import export_package

        run_path = str(Path(a.out) / (Path(model_path).name
                                      + (f"-{export_dtype}" if a.chat else "")))
        if not (a.chat and _current(run_path, export_dtype)):  # the chat model: once
            print(export_package(model_path, run_path, dtype=export_dtype,
                                 max_context=a.max_context or (2048 if a.chat else None),
                                 force=True, trust_remote_code=a.trust_remote_code).summary(),
                  file=sys.stderr)
    model = Model.load(run_path, backend=a.backend, device=a.device, dtype=load_dtype,
                       max_context=a.max_context, trust_remote_code=a.trust_remote_code,
                       threads=a.threads, batch_invariant=a.batch_invariant)
    shown = prompts[0]
    if a.chat:
        prompts = [model.encode_chat([{"role": "user", "content": q}]) for q in prompts]
    return _compare(model, run_path, prompts, a, reference, shown,
                    CHAT_CONFIGS if default else CONFIGS)


def _check_first(a, model_path: str) -> None:
    """What would refuse the run once the transformers reference had run and the package was
    exported, said first in one line: the model path, the device, the chat template."""
    from edgemtp.api import _check_torch_model, check_model_path
    from edgemtp.backend import check_options, parse_device
    from edgemtp.runtimes.gguf_source import check_hf_folder, resolve_model
    from edgemtp.tokenizer import check_chat_template

    check_model_path(model_path)
    packaged = is_package(model_path)
    if not packaged and not resolve_model(model_path).gguf_file:
        check_hf_folder(model_path)
    check_options(a.device, a.dtype, a.max_context, a.threads)
    kind = parse_device(a.device)[0]
    if a.backend == "torch":  # (the checks the backends make as they load)
        _check_torch_model(model_path, a.device)
        if kind == "cuda":
            from edgemtp.runtimes.torch_backend import check_cuda_seen

            check_cuda_seen(a.device)
    elif kind != "cpu" and a.backend in ("auto", "onnxruntime"):
        from edgemtp.runtimes.onnxrt_backend import check_provider

        check_provider(kind, a.device)
    if a.chat:
        check_chat_template(model_path)


def _current(path: str, dtype: str) -> bool:
    """A package already at ``path`` that this version would export the same way: written by
    this export code (the manifest's ``exporter`` digest; a package from before it was
    recorded is exported again), of ``dtype``, and loadable."""
    from edgemtp.export.onnx_export import exported_here

    if not exported_here(path):
        return False
    from edgemtp.runtimes.package import load_package

    from edgemtp.errors import EdgeMTPError

    try:
        return load_package(path).weights.format == dtype
    except EdgeMTPError:
        return False


def _questions(n: int) -> list[str]:
    """The first turn of the first ``n`` Spec-Bench questions, one per category in turn."""
    from .prompts import SPEC_BENCH, prompt_sets

    if not SPEC_BENCH.is_file():
        return _fallback("Spec-Bench questions", SPEC_BENCH, FALLBACK_QUESTIONS, n)
    sets = list(prompt_sets(["spec_bench"], n).values())
    rounds = max(len(qs) for qs in sets)
    return [qs[i] for i in range(rounds) for qs in sets if i < len(qs)][:n]


def _transformers_reference(path: str, prompts: list[str], a) -> dict:
    """Greedy tokens and tokens/s of ``transformers`` ``generate``: the outside reference."""
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if a.threads:
        torch.set_num_threads(a.threads)
    tok = AutoTokenizer.from_pretrained(path, trust_remote_code=a.trust_remote_code)
    hf = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=a.trust_remote_code).eval()
    outputs, speeds = [], []
    bar = tqdm(prompts, desc="transformers generate (reference)", unit="prompt", file=sys.stderr)
    with torch.inference_mode():
        for p in bar:
            ids = torch.tensor([tok(p).input_ids])
            t0 = time.perf_counter()
            out = hf.generate(ids, max_new_tokens=a.max_new_tokens, do_sample=False)
            new = out[0, ids.shape[1]:].tolist()
            speeds.append(len(new) / (time.perf_counter() - t0))
            outputs.append(new)
    return {"outputs": outputs, "tokens_per_second": statistics.median(speeds)}


def _compare(model, model_path: str, prompts: list, a, hf_ref: dict | None,
             shown: str, configs: list) -> int:
    from tqdm import tqdm

    configs = [(label, GenerationConfig(max_new_tokens=a.max_new_tokens, **opts))
               for label, opts in configs]
    # untimed warm-ups: compile plans, bind shapes, and let auto measure the device's latency
    # curve (once per loaded model; a minute or more on a slow or busy CPU: a bar, qa10c D8)
    for _, config in tqdm(configs, desc="warming up (plans; auto's latency curve)",
                              unit="method", file=sys.stderr):
        model.generate(prompts[0], config.with_(max_new_tokens=min(16, a.max_new_tokens)))
    # interleaved: every method on a prompt before the next prompt, so a change in the
    # machine's load touches every method alike; who goes first rotates with the prompt and
    # the round. A prompt's tok/s is the median over its rounds (one 128-token run on a 2-core
    # VM varies by +-15 %); its first round's result is the one reported
    rounds = getattr(a, "rounds", 1)
    results = {label: [] for label, _ in configs}
    differs: set[str] = set()  # methods whose later rounds gave other tokens than their first
    runs = tqdm(total=len(configs) * len(prompts) * rounds, desc="generating", unit="run",
                file=sys.stderr)
    for i, p in enumerate(prompts):
        first, speeds = {}, {label: [] for label, _ in configs}
        for j in range(rounds):
            k = (i + j) % len(configs)
            for label, config in configs[k:] + configs[:k]:
                t0 = time.perf_counter()
                r = model.generate(p, config)
                speeds[label].append(r.stats.new_tokens / (time.perf_counter() - t0))
                first.setdefault(label, r)
                if r.token_ids != first[label].token_ids:  # every round checked, not the first
                    differs.add(label)
                runs.update()
        for label, _ in configs:
            results[label].append((first[label], statistics.median(speeds[label])))
    reference = results[configs[0][0]]
    rows = [(label, results[label],
             label not in differs and
             all(r.token_ids == g.token_ids for (r, _), (g, _) in zip(results[label], reference)))
            for label, _ in configs]
    runs.close()

    name = type(model.backend).__name__
    print(f"model: {model_path} ({model.backend.name} backend)\nprompt: {shown}\n")
    print(rows[-1][1][0][0].text.strip() + "\n")
    base_tps = statistics.median(tps for _, tps in rows[0][1])
    print(f"{'method':<26}{'tokens':>8}{'fwd calls':>11}{'BE':>7}{'tok/s':>9}{'speed-up':>10}"
          f"  lossless")
    for label, results, same in rows:
        toks = sum(r.stats.new_tokens for r, _ in results)
        calls = sum(r.stats.forward_calls for r, _ in results)
        tps = statistics.median(t for _, t in results)
        speedup = statistics.median(t / g for (_, t), (_, g) in zip(results, rows[0][1]))
        print(f"{label:<26}{toks:>8}{calls:>11}{toks / calls:>7.2f}{tps:>9.1f}"
              f"{speedup:>9.2f}x  {'yes' if same else 'NO'}")
    if hf_ref is not None:
        hf_same = all(r.token_ids == h for (r, _), h in zip(rows[0][1], hf_ref["outputs"]))
        hf_tps = hf_ref["tokens_per_second"]
        print(f"{'transformers generate':<26}{'':>8}{'':>11}{1.0:>7.2f}{hf_tps:>9.1f}"
              f"{hf_tps / base_tps:>9.2f}x  {'yes' if hf_same else 'NO'}")
        print(f"\n{model.backend.name} greedy runs at {base_tps / hf_tps:.1f}x the tokens/s of "
              f"transformers greedy generate.")
    else:
        hf_same = True
    print(f"\n{len(prompts)} prompts, {a.max_new_tokens} new tokens, {name} on {a.device}. "
          f"BE = tokens per forward call (prefill included; tokens, calls and BE from each "
          f"prompt's first run); tok/s = median over prompts of "
          f"wall-clock tokens per second, each prompt's the median of {rounds} timed "
          f"run{'s' if rounds > 1 else ''} (after one warm-up run per method; the methods take "
          f"turns on each prompt); speed-up = median over prompts of the tok/s over greedy's "
          f"on the same prompt and backend. Lossless = same tokens as greedy"
          f"{' (and transformers)' if hf_ref is not None else ''}.")
    if not all(same for _, _, same in rows) or not hf_same:
        print("edgemtp: error: probing output differs from greedy decoding", file=sys.stderr)
        return 1
    return 0
