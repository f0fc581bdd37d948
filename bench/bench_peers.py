"""edgemtp side by side with the runtimes its users know (issue 10, part 7), in one sitting on
the same machine, the same prompts and the same thread count.

Prompts: Spec-Bench, first turn of the first ``--per-category`` questions of every category,
under the model's chat template. The prompt ids are made once (transformers'
``apply_chat_template``, which edgemtp's tokenizer reproduces exactly) and every runtime gets
the same ids, so only the runtime differs.

Peers (each skipped with one line when its package is missing; they are bench extras, not CI
dependencies: ``pip install -e ".[peers]"``):

- llama.cpp (llama-cpp-python) on the GGUF itself: greedy, and its prompt-lookup draft model
  (``LlamaPromptLookupDecoding``, 2 and 10 tokens);
- onnxruntime-genai: its model builder on the same weights (the GGUF de-quantized by
  transformers and saved as a Hugging Face folder), fp32 and int4, greedy;
- transformers ``generate`` (fp32): greedy and ``prompt_lookup_num_tokens=10``;
- edgemtp, fp32 and int4 packages exported from the GGUF: greedy, ``auto``, and fixed
  drafters (``--drafters``), every output checked against the same package's greedy. The
  int4 package runs on the backend ``--backend auto`` picks (the native C decoder on a CPU),
  and on onnxruntime as its own group (``edgemtp int4 onnxruntime``).

Timing: every method runs every prompt once per repeat, the methods in a rotating order per
prompt (interleaved, so drift and load spread over all of them), after one warm-up
generation each. tok/s = generated tokens / wall time from the prompt ids to the last token
(prefill included), per category; ratios are per category against a baseline measured in the
same sitting, then averaged over categories.

    python bench/bench_peers.py                        # everything installed, 1 question/category
    python bench/bench_peers.py --peers edgemtp --quick

Writes ``--out`` ``.md``, ``.json`` and ``.png``; the converted models go to ``--work``
(``out/peers``), built once and reused.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from edgemtp.config import GenerationConfig  # noqa: E402
from edgemtp.errors import ConfigError  # noqa: E402
from tools.prompts import prompt_sets  # noqa: E402

PEERS = ("llama.cpp", "genai", "transformers", "edgemtp")
EDGEMTP_DRAFTERS = ("auto@60", "pld@10", "hybrid@10", "probe@10", "probe@30")
QUICK_CATEGORIES = 3


# --- preparing the models (once, cached under --work) -------------------------------------

def gguf_path(arg: str | None) -> Path:
    if arg:
        return Path(arg)
    from tools.fetch import GGUF_NAME, smollm2_gguf

    return smollm2_gguf() / GGUF_NAME


def hf_folder(gguf: Path, work: Path) -> Path:
    """The GGUF de-quantized by transformers and saved as a Hugging Face folder (what
    onnxruntime-genai's builder and transformers load)."""
    dest = work / "hf-fp32"
    if (dest / "config.json").is_file():
        return dest
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log(f"de-quantizing {gguf.name} to {dest} (transformers) ...")
    part = dest.with_name(dest.name + ".part")
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                 dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model.hf_quantizer = None  # de-quantized already: plain float32 tensors
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(str(part))
    tok.save_pretrained(str(part))
    part.rename(dest)
    return dest


def edgemtp_package(gguf: Path, work: Path, dtype: str, context: int = 2048) -> Path:
    """The edgemtp package of ``dtype`` in ``work``, exported again where other export code
    wrote the one there (its manifest's ``exporter`` digest), so the sitting measures this
    edgemtp's graph."""
    from edgemtp.export.onnx_export import export_package, exported_here
    from edgemtp.runtimes.package import is_package

    dest = work / f"edgemtp-{dtype}"
    if exported_here(dest):
        return dest
    why = ("other export code wrote the one there: exporting again" if is_package(str(dest))
           else "exporting")
    log(f"the edgemtp {dtype} package in {dest}: {why} ...")
    export_package(str(gguf), str(dest), dtype=dtype, max_context=context, force=True,
                   progress=False)
    return dest


def genai_model(hf: Path, work: Path, precision: str, threads: int) -> Path:
    """onnxruntime-genai's builder on the Hugging Face folder, CPU, with ``threads``
    intra-op threads written into its ``genai_config.json``."""
    dest = work / f"genai-{precision}"
    if not (dest / "genai_config.json").is_file():
        log(f"building the onnxruntime-genai {precision} model to {dest} ...")
        part = dest.with_name(dest.name + ".part")
        run = subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder",
                              "-i", str(hf), "-o", str(part), "-p", precision, "-e", "cpu",
                              "-c", str(work / "genai-cache")], capture_output=True, text=True)
        if run.returncode != 0 or not (part / "genai_config.json").is_file():
            tail = (run.stderr.strip().splitlines() or ["no output"])[-1]
            raise RuntimeError(f"onnxruntime-genai's builder failed: {tail}")
        part.rename(dest)
    cfg_path = dest / "genai_config.json"
    cfg = json.loads(cfg_path.read_text())
    opts = cfg["model"]["decoder"].setdefault("session_options", {})
    opts["intra_op_num_threads"] = threads
    opts["inter_op_num_threads"] = 1
    cfg_path.write_text(json.dumps(cfg, indent=2))
    return dest


# --- one runner per method: ids -> (new ids, seconds) --------------------------------------

# the time the current generation's first new token came out (perf_counter), set by each
# runner: the prefill and first token are then told apart from the decoding that follows
FIRST: dict[str, float] = {}


def first_token(at: float | None = None) -> None:
    """Mark the current generation's first new token (now, or at ``at``), once."""
    FIRST.setdefault("at", time.perf_counter() if at is None else at)


class Method:
    """A named way to generate: ``run(ids) -> new token ids``; ``group``/``kind`` say what its
    greedy reference is (``group``'s ``greedy`` method) for the identity check."""

    def __init__(self, name: str, group: str, run, greedy: bool = False, stats=None):
        self.name, self.group, self.run, self.greedy, self.stats = name, group, run, greedy, stats


def llama_cpp_methods(gguf: Path, threads: int, new_tokens: int, ctx: int) -> list[Method]:
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    def runner(draft_tokens: int | None):
        llm = Llama(model_path=str(gguf), n_ctx=ctx, n_threads=threads, n_threads_batch=threads,
                    n_batch=512, verbose=False, seed=0,
                    # a draft model needs every position's logits; 0.3.36 sizes its score
                    # buffer by the argument (n_batch rows), not by the draft model, and
                    # overruns it on a prompt longer than n_batch unless logits_all is given
                    logits_all=bool(draft_tokens),
                    draft_model=(LlamaPromptLookupDecoding(num_pred_tokens=draft_tokens)
                                 if draft_tokens else None))
        eos = llm.token_eos()

        def run(ids):
            llm.reset()  # no prefix reuse between prompts or repeats
            out = []
            for tok in llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0,
                                    repeat_penalty=1.0, reset=True):
                first_token()
                out.append(int(tok))
                if tok == eos or len(out) >= new_tokens:
                    break
            return out

        return run

    return [Method("llama.cpp greedy", "llama.cpp", runner(None), greedy=True),
            Method("llama.cpp PLD 2", "llama.cpp", runner(2)),
            Method("llama.cpp PLD 10", "llama.cpp", runner(10))]


def genai_methods(hf: Path, work: Path, threads: int, new_tokens: int) -> list[Method]:
    import onnxruntime_genai as og

    out = []
    for precision in ("fp32", "int4"):
        model = og.Model(str(genai_model(hf, work, precision, threads)))

        def run(ids, model=model):
            params = og.GeneratorParams(model)
            params.set_search_options(max_length=len(ids) + new_tokens, do_sample=False)
            gen = og.Generator(model, params)
            gen.append_tokens(ids)
            while not gen.is_done():
                gen.generate_next_token()
                first_token()
            return [int(t) for t in gen.get_sequence(0)[len(ids):]]

        out.append(Method(f"genai {precision} greedy", f"genai {precision}", run, greedy=True))
    return out


def transformers_methods(hf: Path, threads: int, new_tokens: int) -> list[Method]:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32).eval()

    from transformers.generation.streamers import BaseStreamer

    class FirstToken(BaseStreamer):  # put() gets the prompt first, then the new tokens
        def __init__(self):
            self.calls = 0

        def put(self, value):
            self.calls += 1
            if self.calls == 2:
                first_token()

        def end(self):
            pass

    def runner(**kw):
        def run(ids):
            x = torch.tensor([ids])
            with torch.inference_mode():
                y = model.generate(x, attention_mask=torch.ones_like(x),
                                   max_new_tokens=new_tokens, do_sample=False,
                                   streamer=FirstToken(), **kw)
            return y[0, len(ids):].tolist()

        return run

    return [Method("transformers greedy", "transformers", runner(), greedy=True),
            Method("transformers PLD 10", "transformers", runner(prompt_lookup_num_tokens=10))]


def edgemtp_methods(pkg: Path, dtype: str, threads: int, new_tokens: int,
                    drafters: list[str], backend: str = "auto") -> list[Method]:
    """``backend="auto"``: what a user gets (the native decoder for int4 on the CPU), named
    ``edgemtp DTYPE``; another backend is its own group, ``edgemtp DTYPE BACKEND``."""
    from edgemtp.api import Model

    model = Model.load(str(pkg), backend=backend, threads=threads)
    group = f"edgemtp {dtype}" + ("" if backend == "auto" else f" {backend}")

    def runner(config: GenerationConfig, stats: list):
        def run(ids):
            t0 = time.perf_counter()
            r = model.generate(list(ids), config)
            first_token(t0 + r.stats.time_prefill)
            stats.append((r.stats.new_tokens, r.stats.forward_calls))
            return list(r.token_ids)

        return run

    out = []
    for spec in ["none@1"] + drafters:
        drafter, bc = spec.split("@")
        config = GenerationConfig(drafter=drafter, bc=int(bc), max_new_tokens=new_tokens)
        stats: list = []
        name = f"{group} {'greedy' if drafter == 'none' else spec}"
        out.append(Method(name, group, runner(config, stats), greedy=drafter == "none",
                          stats=stats))
    return out


# --- the sitting --------------------------------------------------------------------------

def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def missing(module: str, pip: str) -> str | None:
    return (None if importlib.util.find_spec(module)
            else f"{module} not installed (pip install {pip})")


def prepare(a) -> tuple[list[Method], dict[str, str]]:
    gguf = gguf_path(a.gguf)
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    methods, skipped = [], {}
    peers = a.peers.split(",")
    needs_hf = any(p in peers for p in ("genai", "transformers"))
    hf = hf_folder(gguf, work) if needs_hf else None
    if "edgemtp" in peers:
        for dtype in a.dtypes.split(","):
            pkg = edgemtp_package(gguf, work, dtype)
            methods += edgemtp_methods(pkg, dtype, a.threads, a.new_tokens,
                                       a.drafters.split(","))
            if dtype == "int4" and a.int4_onnxruntime:  # the portable path, for comparison
                methods += edgemtp_methods(pkg, dtype, a.threads, a.new_tokens,
                                           a.drafters.split(","), backend="onnxruntime")
    if "llama.cpp" in peers:
        why = missing("llama_cpp", "llama-cpp-python")
        if why:
            skipped["llama.cpp"] = why
        else:
            methods += llama_cpp_methods(gguf, a.threads, a.new_tokens, ctx=2048)
    if "genai" in peers:
        why = missing("onnxruntime_genai", "onnxruntime-genai")
        if why:
            skipped["onnxruntime-genai"] = why
        else:
            try:
                methods += genai_methods(hf, work, a.threads, a.new_tokens)
            except RuntimeError as e:
                skipped["onnxruntime-genai"] = str(e)
    if "transformers" in peers:
        methods += transformers_methods(hf, a.threads, a.new_tokens)
    for peer, why in skipped.items():
        log(f"skipped {peer}: {why}")
    return methods, skipped


def prompts_by_category(gguf: Path, per_category: int,
                        quick: bool) -> dict[str, list[list[int]]]:
    """Spec-Bench first turns as prompt ids, by transformers' ``apply_chat_template`` on the
    GGUF's own tokenizer and template."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tasks = prompt_sets(["spec_bench"], per_category)
    if quick:
        tasks = dict(list(tasks.items())[:QUICK_CATEGORIES])
    return {cat: [list(tok.apply_chat_template([{"role": "user", "content": q}],
                                               add_generation_prompt=True, tokenize=True,
                                               return_dict=False)) for q in qs]
            for cat, qs in tasks.items()}


def sitting(methods: list[Method], tasks: dict[str, list[list[int]]], repeats: int) -> dict:
    """{method: {category: {"tokens": n, "seconds": [per repeat], "outputs": [...]}}}."""
    from tqdm import tqdm

    warm = next(iter(tasks.values()))[0]
    for m in tqdm(methods, desc="warm-up", unit="method", file=sys.stderr):
        m.run(warm)  # loads kernels, measures auto's latency curve, fills caches
        if m.stats is not None:
            m.stats.clear()
    rec = {m.name: {c: {"tokens": 0, "seconds": [0.0] * repeats, "outputs": [], "forward": 0,
                        "decode_tokens": 0, "decode_seconds": [0.0] * repeats}
                    for c in tasks} for m in methods}
    jobs = [(r, c, i, ids) for r in range(repeats) for c, prompts in tasks.items()
            for i, ids in enumerate(prompts)]
    bar = tqdm(total=len(jobs) * len(methods), desc="generations", unit="gen", file=sys.stderr)
    failed = rec["__failed__"] = {}
    for n, (r, cat, _, ids) in enumerate(jobs):
        k = n % len(methods)
        for m in methods[k:] + methods[:k]:  # rotate who goes first
            if m.name in failed:
                bar.update()
                continue
            FIRST.clear()
            t0 = time.perf_counter()
            try:
                new = m.run(ids)
            except Exception as e:  # a peer's bug: drop that method, keep the sitting
                failed[m.name] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
                log(f"{m.name} failed on a {cat} prompt and is left out: {failed[m.name]}")
                bar.update()
                continue
            end = time.perf_counter()
            dt = end - t0
            cell = rec[m.name][cat]
            cell["seconds"][r] += dt
            # decoding only: from the first new token to the last (prefill and first token out)
            cell["decode_seconds"][r] += end - FIRST.get("at", end)
            if r == 0:
                cell["tokens"] += len(new)
                cell["decode_tokens"] += max(len(new) - 1, 0)
                cell["outputs"].append(new)
                if m.stats:
                    cell["forward"] += m.stats[-1][1]
            bar.update()
    bar.close()
    return rec


def summarise(methods: list[Method], rec: dict, tasks: dict) -> dict:
    cats = list(tasks)
    greedy = {m.group: m.name for m in methods if m.greedy}
    rows = []
    for m in methods:
        per_cat = {}
        for c in cats:
            cell = rec[m.name][c]
            per_cat[c] = cell["tokens"] / statistics.median(cell["seconds"])
        ref = greedy.get(m.group)
        identical, differs = None, []
        if ref and ref != m.name:
            pairs = [(a, b) for c in cats for a, b in zip(rec[m.name][c]["outputs"],
                                                         rec[ref][c]["outputs"])]
            identical = [sum(a == b for a, b in pairs), len(pairs)]
            differs = [c for c in cats for a, b in zip(rec[m.name][c]["outputs"],
                                                       rec[ref][c]["outputs"]) if a != b]
        tokens = sum(rec[m.name][c]["tokens"] for c in cats)
        forward = sum(rec[m.name][c]["forward"] for c in cats)
        # decode tok/s over all categories: new tokens after the first / the time they took
        dec_s = statistics.median([sum(rec[m.name][c]["decode_seconds"][r] for c in cats)
                                   for r in range(len(rec[m.name][cats[0]]["seconds"]))])
        dec_tokens = sum(rec[m.name][c]["decode_tokens"] for c in cats)
        rows.append(dict(method=m.name, group=m.group, tok_s=per_cat,
                         decode_tok_s=dec_tokens / dec_s if dec_s > 0 else None,
                         tokens={c: rec[m.name][c]["tokens"] for c in cats},
                         mean_tok_s=statistics.mean(per_cat.values()),
                         identical_to_greedy=identical, differs_in=sorted(set(differs)),
                         be=round(tokens / forward, 3) if forward else None))
    by = {r["method"]: r for r in rows}
    for r in rows:
        ref = greedy.get(r["group"])
        if ref and ref != r["method"]:
            ratios = {c: r["tok_s"][c] / by[ref]["tok_s"][c] for c in cats}
            r["vs_own_greedy"] = ratios
            r["vs_own_greedy_mean"] = statistics.mean(ratios.values())
            r["vs_own_greedy_min"] = min(ratios.values())
    return dict(categories=cats, rows=rows)


def peer_ratios(rows: list[dict]) -> list[tuple[str, str, float, float | None]]:
    """edgemtp plain decoding against the peers' (the issue's targets): the mean over
    categories of the per-category tok/s ratios, and the ratio of decode tok/s."""
    by = {r["method"]: r for r in rows}
    pairs = [("edgemtp int4 greedy", "genai int4 greedy"), ("edgemtp int4 greedy",
             "llama.cpp greedy"), ("edgemtp int4 greedy", "edgemtp int4 onnxruntime greedy"),
             ("edgemtp int4 onnxruntime greedy", "genai int4 greedy"),
             ("edgemtp fp32 greedy", "genai fp32 greedy"),
             ("edgemtp fp32 greedy", "transformers greedy")]
    out = []
    for a, b in pairs:
        if a in by and b in by:
            cats = by[a]["tok_s"]
            da, db = by[a].get("decode_tok_s"), by[b].get("decode_tok_s")
            out.append((a, b, statistics.mean(by[a]["tok_s"][c] / by[b]["tok_s"][c]
                                              for c in cats),
                        da / db if da and db else None))
    return out


def markdown(result: dict) -> str:
    cats, rows = result["categories"], result["rows"]
    env = result["environment"]
    lines = [
        "# edgemtp and its peers on CPU (SmolLM2-135M-Instruct)", "",
        f"`bench/bench_peers.py`, one sitting, {env['date']}: {env['cpu']}, {env['threads']} "
        f"threads per runtime, {result['new_tokens']} new tokens at most, Spec-Bench first turns "
        f"under the chat template ({result['per_category']} per category, {len(cats)} "
        f"categories), {result['repeats']} repeat(s), methods interleaved per prompt. "
        f"Load average at the start / end: {env['load_start']} / {env['load_end']}.", "",
        "tok/s = generated tokens / wall time from prompt ids to the last token (prefill "
        "included), per category, then the mean over categories. `vs greedy`: per-category "
        "ratio to the same runtime's greedy, mean (min). `identical`: outputs equal to that "
        "greedy's, prompts.", "",
        "`decode tok/s`: the new tokens after the first over the time from the first to the "
        "last, summed over all prompts: decoding speed without the prefill, so runtimes whose "
        "weights answer at other lengths compare like for like.", "",
        "| method | mean tok/s | decode tok/s | vs greedy, mean (min) | BE | identical |",
        "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        vs = (f"{r['vs_own_greedy_mean']:.2f}× ({r['vs_own_greedy_min']:.2f}×)"
              if "vs_own_greedy" in r else "–")
        ident = "–" if r["identical_to_greedy"] is None else "{}/{}".format(
            *r["identical_to_greedy"]) + (f" (not: {', '.join(r['differs_in'])})"
                                          if r.get("differs_in") else "")
        dec = r.get("decode_tok_s")
        lines.append(f"| {r['method']} | {r['mean_tok_s']:.1f} | "
                     f"{'–' if dec is None else f'{dec:.1f}'} | {vs} | "
                     f"{r['be'] if r['be'] else '–'} | {ident} |")
    lines += ["", "## Plain decoding against the peers", "",
              "| ratio | tok/s (mean of per-category ratios) | decode tok/s |",
              "|---|---:|---:|"]
    lines += [f"| {a} / {b} | {v:.2f}× | {'–' if d is None else f'{d:.2f}×'} |"
              for a, b, v, d in result["peer_ratios"]]
    lines += ["", "## tok/s per category", "",
              "| method | " + " | ".join(cats) + " |", "|---|" + "---:|" * len(cats)]
    lines += [f"| {r['method']} | " + " | ".join(f"{r['tok_s'][c]:.1f}" for c in cats) + " |"
              for r in rows]
    # runtimes with other weights write other answers: a short answer to a long prompt is
    # mostly prefill, so its tok/s is not the same measure as a long answer's
    lines += ["", "## Generated tokens per category (first repeat)", "",
              "| method | " + " | ".join(cats) + " |", "|---|" + "---:|" * len(cats)]
    lines += [f"| {r['method']} | " + " | ".join(str(r["tokens"][c]) for c in cats) + " |"
              for r in rows if "tokens" in r]
    if result["skipped"]:
        lines += ["", "Skipped: " + "; ".join(f"{k}: {v}" for k, v in result["skipped"].items())]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(9, 0.35 * len(rows) + 1.5))
    names = [r["method"] for r in rows][::-1]
    vals = [r["mean_tok_s"] for r in rows][::-1]
    colors = ["tab:blue" if n.startswith("edgemtp") else "tab:gray" for n in names]
    ax.barh(names, vals, color=colors)
    for y, v in enumerate(vals):
        ax.text(v, y, f" {v:.1f}", va="center", fontsize=8)
    ax.set_xlabel("tokens/s, mean over Spec-Bench categories")
    ax.set_title(f"SmolLM2-135M-Instruct on CPU, {result['environment']['threads']} threads")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", help="the GGUF (default: the shared SmolLM2 file, or fetched)")
    p.add_argument("--peers", default=",".join(PEERS), help=f"some of {','.join(PEERS)}")
    p.add_argument("--dtypes", default="fp32,int4", help="edgemtp package dtypes")
    p.add_argument("--drafters", default=",".join(EDGEMTP_DRAFTERS),
                   help="edgemtp drafters besides greedy, as drafter@BC")
    p.add_argument("--no-int4-onnxruntime", dest="int4_onnxruntime", action="store_false",
                   help="leave out the int4 package on onnxruntime (by default it runs beside "
                        "the native backend, which --backend auto picks for int4)")
    p.add_argument("--per-category", type=int, default=1)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--skip", default="", help="comma-separated method names to leave out "
                   "(e.g. 'transformers PLD 10,llama.cpp PLD 2')")
    p.add_argument("--quick", action="store_true", help=f"{QUICK_CATEGORIES} categories")
    p.add_argument("--work", default=str(ROOT / "out" / "peers"))
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "peers_cpu"))
    a = p.parse_args(argv)
    unknown = set(a.peers.split(",")) - set(PEERS)
    if unknown:
        p.error(f"unknown peers {sorted(unknown)}; expected some of {','.join(PEERS)}")
    for spec in a.drafters.split(","):  # checked before anything is built
        d, _, bc = spec.partition("@")
        try:
            GenerationConfig(drafter=d, bc=int(bc or 0))
        except (ValueError, ConfigError) as e:
            p.error(f"--drafters takes drafter@BC, e.g. auto@60; {spec!r}: {e}")
    os.environ.setdefault("OMP_NUM_THREADS", str(a.threads))
    load_start = os.getloadavg()[0]
    tasks = prompts_by_category(gguf_path(a.gguf), a.per_category, a.quick)
    methods, skipped = prepare(a)
    leave = {n.strip() for n in a.skip.split(",") if n.strip()}
    unknown = leave - {m.name for m in methods}
    if unknown:
        p.error(f"--skip names no method: {', '.join(sorted(unknown))}; the methods are "
                f"{', '.join(m.name for m in methods)}")
    methods = [m for m in methods if m.name not in leave]
    rec = sitting(methods, tasks, a.repeats)
    for name, why in rec.pop("__failed__").items():
        skipped[name] = why
    methods = [m for m in methods if m.name not in skipped]
    result = summarise(methods, rec, tasks)
    result["peer_ratios"] = peer_ratios(result["rows"])
    result.update(new_tokens=a.new_tokens, per_category=a.per_category, repeats=a.repeats,
                  skipped=skipped, environment=dict(
                      date=time.strftime("%Y-%m-%d"), cpu=platform.processor() or _cpu(),
                      threads=a.threads, load_start=round(load_start, 1),
                      load_end=round(os.getloadavg()[0], 1), versions=_versions()))
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(result))
    plot(result, out.with_suffix(".png"))
    print(markdown(result))
    return 0


def _cpu() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("onnxruntime", "onnxruntime-genai", "llama-cpp-python", "transformers", "torch"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            pass
    return out


if __name__ == "__main__":
    sys.exit(main())
