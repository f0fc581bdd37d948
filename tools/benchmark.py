"""``edgemtp bench``: drafters x block complexity x prompt sets, at matched BC.

Every method runs in the same runtime on the same backend and prompts; every output is
checked against plain greedy decoding (a difference is a failure, reported and counted in the
exit code). ``transformers``' own prompt lookup (``generate(prompt_lookup_num_tokens=10)``)
runs as an outside reference for speed and output when the backend names the Hugging Face
folder its weights came from (``backend.source``). Writes JSON, a Markdown table and PNG plots
(BE per task and method, like the paper's Figures 4-5; tokens/s vs BC) to ``out/bench/`` by
default.

Each finished (task, method, BC) row is also appended to ``<stem>.rows.jsonl`` at once
(:class:`~edgemtp.tools.rowlog.RowLog`): after a Ctrl-C, the same command measures only the
rows still missing (of the same model: a package exported again to the same folder is measured
anew); ``--fresh`` measures everything again.

Before any row is measured, every method is checked against what the loaded model can run (a
package's graph exports a fixed top-K), and each method with rows to measure runs once untimed
(:func:`~edgemtp.tools.measure.warm_up`: a runtime's first runs, ``auto``'s latency curve).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

from edgemtp import drafters
from edgemtp.budgets import check_bc
from edgemtp.config import GenerationConfig
from edgemtp.drafters.tree_cost import TREE_COSTS
from edgemtp.errors import BudgetError, ConfigError
from edgemtp.runtimes.heads import HEAD_KINDS

from . import at_least_one, check_fits, output_folder, quiet_transformers
from .measure import WARM_TOKENS, measure, misfit, warm_prompt, warm_up
from .prompts import chat_turns, prompt_sets
from .rowlog import RowLog, model_identity

GREEDY = "greedy"
HF_METHOD = "transformers prompt lookup"
HF_DRAFT = 10  # prompt_lookup_num_tokens: a chain of 10 drafts after the root is BC 11


def command(a, load) -> int:
    """``edgemtp bench``: check every option, load the model with ``load(a)``, measure (or
    reuse) the rows, write the results. Returns the exit code."""
    greedy = GenerationConfig(drafter="none", max_new_tokens=a.max_new_tokens)
    plan = methods(check_drafters(a.drafters), [check_bc(bc, "--bc") for bc in a.bc], greedy,
                   check_tree_costs(getattr(a, "tree_cost", "budget")),
                   check_heads(getattr(a, "heads", None)))
    at_least_one(per_set=a.per_set, repeats=a.repeats)
    tasks = prompt_sets([s for s in a.sets.split(",") if s], a.per_set)
    with output_folder(a.out):
        return _run(a, load, tasks, greedy, plan)


def _run(a, load, tasks, greedy, plan) -> int:
    """``command``'s work once every option is checked and ``--out`` is made."""
    quiet_transformers(a.model)
    model = load(a)
    tasks = chat_turns(model, tasks)
    check_fits(a.bc, model.backend.max_context)
    out, name = Path(a.out), Path(a.model).name
    # runs of one model on other devices or dtypes get files of their own
    device, dtype = a.device or "cpu", a.dtype or _package_dtype(model)
    stem = bench_stem(name, model.backend.name, device, a.dtype)
    log = RowLog(out / f"{stem}.rows.jsonl", fresh=a.fresh, settings=dict(
        model=str(Path(a.model).resolve()) if Path(a.model).exists() else a.model,
        model_id=model_identity(a.model), backend=model.backend.name, device=a.device,
        dtype=a.dtype, threads=a.threads, max_new_tokens=a.max_new_tokens, repeats=a.repeats))
    check_runnable(model, plan)  # before any row is measured
    if log.kept:
        print(f"bench: {log.path} holds {log.kept} rows measured with these settings; those "
              f"this run asks for are reused (--fresh measures them again)", file=sys.stderr)
    try:
        result = run_bench(model, tasks, greedy, plan, log, hf_reference=not a.no_hf_reference,
                           repeats=a.repeats, device=a.device)
    except KeyboardInterrupt:
        print(f"edgemtp: interrupted; {log.kept} measured rows are kept in {log.path}; run the "
              f"same command again to measure only the rest" if log.kept else
              "edgemtp: interrupted before any row was measured", file=sys.stderr)
        return 130
    finally:
        log.close()
    out.mkdir(parents=True, exist_ok=True)
    result.update(device=device, dtype=dtype, threads=a.threads)
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1))
    text = markdown(result, f"edgemtp bench: {name} on {model.backend.name}, {device}"
                            + (f", {dtype}" if dtype else ""))
    (out / f"{stem}.md").write_text(text)
    pngs = plots(result, out, stem)
    print(text)
    print(f"wrote {out / stem}.json, .md, " + ", ".join(p.name for p in pngs), file=sys.stderr)
    if result["failures"]:
        print(f"edgemtp: error: {len(result['failures'])} outputs differ from greedy decoding",
              file=sys.stderr)
        return 1
    return 0


def bench_stem(name: str, backend: str, device: str = "cpu", dtype: str | None = None) -> str:
    """The files' name of a bench run: the model and backend, and the device and dtype where
    asked for, so that runs of one model on a GPU or in another dtype keep files of their own.

    >>> bench_stem("stories260K", "torch"), bench_stem("stories260K", "torch", "cuda:1", "bf16")
    ('bench_stories260K_torch', 'bench_stories260K_torch_cuda1_bf16')
    """
    return "_".join(["bench", name, backend] + ([device.replace(":", "")] if device != "cpu"
                                                 else []) + ([dtype] if dtype else []))


def _package_dtype(model) -> str | None:
    """The weights of the package a backend runs (``int4``, ``fp16``...), None for a Hugging
    Face folder run as it is."""
    pkg = getattr(model.backend, "package", None)
    return getattr(getattr(pkg, "weights", None), "format", None)


def check_drafters(text: str) -> list[str]:
    """The drafters of ``--drafters`` (comma-separated), each a speculative one: greedy always
    runs, as the reference."""
    known = drafters.names(speculative=True)
    chosen = [d for d in text.split(",") if d]
    if not chosen or any(d not in known for d in chosen):
        raise ConfigError(f"--drafters must be a comma-separated list of {', '.join(known)}, "
                          f"got {text!r}")
    return chosen


def check_tree_costs(text: str) -> tuple[str, ...]:
    """``--tree-cost``: one or both of ``budget``, ``measured``, comma-separated."""
    chosen = tuple(dict.fromkeys(c for c in text.split(",") if c))
    if not chosen or any(c not in TREE_COSTS for c in chosen):
        raise ConfigError(f"--tree-cost must be {' or '.join(TREE_COSTS)}, or both "
                          f"comma-separated, got {text!r}")
    return chosen


def check_heads(text: str | None) -> tuple[str | None, ...]:
    """``--heads``: learned heads kinds, comma-separated (None: the ``heads`` drafter runs the
    package's first kind, the hybrid and auto run without heads).

    >>> check_heads(None), check_heads("residual,medusa")
    ((None,), ('residual', 'medusa'))
    """
    if text is None:
        return (None,)
    chosen = tuple(dict.fromkeys(k for k in text.split(",") if k))
    if not chosen or any(k not in HEAD_KINDS for k in chosen):
        raise ConfigError(f"--heads must be one or more of {', '.join(HEAD_KINDS)}, "
                          f"comma-separated, got {text!r}")
    return chosen


def methods(names: list[str], budgets: list[int], greedy: GenerationConfig,
            tree_costs: tuple[str, ...] = ("budget",), heads: tuple[str | None, ...] = (None,)
            ) -> list[tuple[str, int, GenerationConfig | str]]:
    """(method, BC, config) for every drafter and budget; the config is the reason instead
    when the drafter cannot use the budget (a skipped row). Drafters that carry mask tokens use
    k = 1 at every budget, the others their own BC accounting. A drafter that takes
    ``tree_cost`` runs once per cost in ``tree_costs`` (method ``"NAME measured"`` for the
    measured one); one that takes learned heads once per kind in ``heads`` (``"NAME KIND"``;
    None: as the drafter runs without ``--heads``). Refuses a plan where no drafter can run at
    all, before any model is loaded."""
    out = []
    for name in names:
        spec = drafters.get(name)
        costs = tree_costs if "tree_cost" in spec.options else ("budget",)
        kinds = heads if "heads" in spec.options else (None,)
        for cost, kind in ((c, k) for c in costs for k in kinds):
            method = " ".join([name] + ([kind] if kind else []) + ([cost] if cost != "budget"
                                                                     else []))
            for bc in budgets:
                opts = dict(mask_tokens=1) if spec.uses_masks else {}
                try:
                    out.append((method, bc, greedy.with_(drafter=name, bc=bc, tree_cost=cost,
                                                         heads=kind, **opts)))
                except ConfigError as e:
                    out.append((method, bc, str(e)))
    if all(isinstance(config, str) for _, _, config in out):
        raise ConfigError("no drafter can run at these budgets: " + "; ".join(
            f"{name} at BC {bc}: {reason}" for name, bc, reason in out))
    return out


def check_runnable(model, plan: list) -> None:
    """Every (method, BC) of ``plan`` that is to run must run on ``model`` (a package's
    graph exports a fixed top-K: probing at BC B asks for about B / 2 candidates a row),
    checked without a forward pass; else one line naming ``--bc`` and the largest BC that
    runs."""
    for method, bc, config in plan:
        if isinstance(config, str):
            continue
        reason = misfit(model.backend, config)
        if reason is None:
            continue
        if not reason.startswith("needs top-"):  # not a matter of the BC (no learned heads)
            raise BudgetError(f"--drafters {method}: {reason}")
        fits = None
        for b in range(bc - 1, 0, -1):
            try:
                smaller = config.with_(bc=b)
            except ConfigError:
                break  # (below what the drafter can use at all)
            if misfit(model.backend, smaller) is None:
                fits = b
                break
        raise BudgetError(f"--bc {bc} is more than this package can run for {method}: it "
                          f"{reason}; "
                          + (f"use --bc {fits} or less for it, or " if fits else "")
                          + f"re-export the package with --bc {bc}")


def run_bench(model, tasks: dict[str, list[str]], greedy: GenerationConfig, plan: list,
              log: RowLog, hf_reference: bool = True, repeats: int = 1,
              device: str = "cpu") -> dict:
    """Greedy (``greedy``), every (drafter, BC, config) of ``plan`` (:func:`methods`), then the
    ``transformers`` reference, on every task; a row already in ``log`` is reused, the others
    are measured and added to it as soon as they finish.

    Tokens/s of a method on a task is the median over ``repeats`` runs of its prompts (run back
    to back; the reference runs once), after one untimed warm-up generation of every method
    that has rows to measure; every run's outputs are checked against greedy's."""
    from tqdm import tqdm

    at_least_one(repeats=repeats)
    check_runnable(model, plan)
    tasks, skipped = _fitting(model, tasks, greedy.max_new_tokens)
    source = reference_source(model) if hf_reference else None
    extra = [(HF_METHOD, HF_DRAFT + 1, greedy)] if source else []
    jobs = [(task, prompts, name, bc, config) for task, prompts in tasks.items()
            for name, bc, config in [(GREEDY, 1, greedy), *plan, *extra]]
    todo = sum(len(p) * (1 if name == HF_METHOD else repeats) for task, p, name, bc, c in jobs
               if not isinstance(c, str) and log.get(task, name, bc, p) is None)
    hf = functools.cache(lambda: _reference_model(source, device))
    rows, failures, greedy_outputs, reused = [], [], {}, 0
    # one untimed generation of each method with rows to measure, before any is timed
    warm = list(dict.fromkeys((name, bc) for task, p, name, bc, c in jobs
                              if not isinstance(c, str) and log.get(task, name, bc, p) is None))
    configs = {(name, bc): c for _, _, name, bc, c in jobs}
    with tqdm(total=todo + len(warm), desc="bench", unit="gen", file=sys.stderr) as bar:
        warm_up(model, [configs[k] for k in warm if k[0] != HF_METHOD], bar)
        if (HF_METHOD, HF_DRAFT + 1) in warm:
            _hf_prompt_lookup(model, hf(), [warm_prompt(model)],
                              greedy.with_(max_new_tokens=min(greedy.max_new_tokens,
                                                              WARM_TOKENS)), bar)
        for task, prompts, name, bc, config in jobs:
            if isinstance(config, str):
                rows.append(dict(task=task, method=name, bc=bc, skipped=config))
                continue
            record = log.get(task, name, bc, prompts)
            reused += int(record is not None)
            if record is None:
                runs, summary = (_hf_prompt_lookup(model, hf(), prompts, config, bar)
                                 if name == HF_METHOD else
                                 _measure(model, prompts, config, bar, repeats))
                record = _record(summary, runs, greedy_outputs.get(task))
                log.add(task, name, bc, prompts, record)
            greedy_outputs.setdefault(task, record.get("outputs"))  # greedy runs first
            failures += [dict(task=task, method=name, bc=bc, prompt=i) for i in record["differ"]]
            rows.append({"task": task, "method": name, "bc": bc, **record["summary"],
                         "lossless": not record["differ"]})
    for row in rows:
        base = next(r for r in rows if r["task"] == row["task"] and r["method"] == GREEDY)
        if "tokens_per_second" in row:
            row["speedup"] = round(row["tokens_per_second"] / base["tokens_per_second"], 3)
    return dict(rows=rows, failures=failures, max_new_tokens=greedy.max_new_tokens,
                repeats=repeats, backend=model.backend.name, date=time.strftime("%Y-%m-%d"),
                prompts={t: len(p) for t, p in tasks.items()}, skipped_prompts=skipped,
                reference_source=source, reused_rows=reused)


def _record(summary: dict, runs: list[list[list[int]]], greedy: list[list[int]] | None
            ) -> dict:
    """A measured row as the log keeps it: greedy's keeps its outputs (the reference of the
    task's other rows), the others the prompts where any run's output differs from it."""
    if greedy is None:
        return dict(summary=summary, differ=[], outputs=runs[0])
    return dict(summary=summary, differ=sorted({i for outputs in runs for i, (a, b)
                                                in enumerate(zip(outputs, greedy)) if a != b}))


def _fitting(model, tasks: dict[str, list[str]], max_new_tokens: int):
    """Prompts whose tokens plus the new tokens fit the model's context; the rest are counted
    as skipped (a 512-position model cannot take a long Spec-Bench question)."""
    room = model.backend.max_context - max_new_tokens
    kept, skipped = {}, {}
    for task, prompts in tasks.items():
        fit = [p for p in prompts if len(model.encode(p)) <= room]
        skipped[task] = len(prompts) - len(fit)
        if fit:
            kept[task] = fit
    if not kept:
        raise ConfigError(f"no prompt fits the model's context of {model.backend.max_context} "
                          f"tokens with {max_new_tokens} new tokens")
    return kept, skipped


def _measure(model, prompts: list[str], config: GenerationConfig, bar, repeats: int):
    """Every run's outputs, and the summary: BE from the first run, tokens/s the median."""
    m = measure(model, prompts, config, bar, repeats)
    return [[r.token_ids for r in run] for run in m.results], dict(
        tokens=m.tokens, forward_calls=m.forward_calls,
        block_efficiency=round(m.tokens / m.forward_calls, 4),
        tokens_per_second=round(statistics.median(m.rates), 2))


def reference_source(model) -> str | None:
    """The Hugging Face folder the backend's weights came from (``backend.source``), when
    the model has a tokenizer and ``transformers`` and PyTorch are installed here; else None
    (no outside reference)."""
    source = getattr(model.backend, "source", None)
    if not source or model.tokenizer is None:
        return None
    if any(importlib.util.find_spec(m) is None for m in ("torch", "transformers")):
        return None
    return source


def _reference_model(source: str, device: str):
    from transformers import AutoModelForCausalLM

    quiet_transformers()
    kind, _, index = device.partition(":")  # the reference runs where the backend runs
    where = f"cuda:{index or 0}" if kind in ("cuda", "tensorrt") else "cpu"
    return AutoModelForCausalLM.from_pretrained(source).to(where).eval()


def _hf_prompt_lookup(model, hf, prompts: list[str], config: GenerationConfig, bar):
    """``transformers`` prompt lookup decoding on ``hf`` (the Hugging Face model the backend's
    weights came from), greedy, ``prompt_lookup_num_tokens=10``, one run: ``([outputs],
    summary)`` like :func:`_measure`."""
    import torch

    outputs, tokens, t0 = [], 0, time.perf_counter()
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([model.encode(p)], device=hf.device)  # text or chat ids
            out = hf.generate(ids, max_new_tokens=config.max_new_tokens, do_sample=False,
                              prompt_lookup_num_tokens=HF_DRAFT)
            new = out[0, ids.shape[1]:].tolist()
            outputs.append(new)
            tokens += len(new)
            bar.update()
    return [outputs], dict(tokens=tokens, forward_calls=None, block_efficiency=None,
                           tokens_per_second=round(tokens / (time.perf_counter() - t0), 2))


def markdown(result: dict, title: str) -> str:
    rows = [r for r in result["rows"] if "skipped" not in r]
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    keys = list(dict.fromkeys((r["method"], r["bc"]) for r in rows))
    n = result.get("threads")
    threads = f", {n} thread{'s' if n != 1 else ''}" if n else ""
    out = [f"# {title}", "", f"{result['max_new_tokens']} new tokens per prompt, backend "
           f"{result['backend']}{threads}, {result['date']}. Cells: BE (tokens per forward call, "
           f"prefill included) / tokens per second (median of {result['repeats']} runs"
           f"{'; the transformers reference: one run' if result.get('reference_source') else ''})"
           ". Every output is checked against greedy decoding.",
           "", "| method | BC | " + " | ".join(tasks) + " | mean BE | lossless |",
           "|---|---:|" + "---:|" * len(tasks) + "---:|:---:|"]
    for method, bc in keys:
        cells, bes, ok = [], [], True
        for task in tasks:
            r = next((r for r in rows if (r["method"], r["bc"], r["task"]) == (method, bc, task)),
                     None)
            if r is None:
                cells.append("")
                continue
            ok &= r.get("lossless", True)
            be = r["block_efficiency"]
            bes += [be] if be is not None else []
            cells.append((f"{be:.2f}" if be is not None else "-") +
                         f" / {r['tokens_per_second']:.0f}")
        mean = f"{statistics.mean(bes):.3f}" if bes else "-"
        out.append(f"| {method} | {bc} | " + " | ".join(cells) +
                   f" | {mean} | {'yes' if ok else '**NO**'} |")
    counts = ", ".join(f"{t} {n}" for t, n in result["prompts"].items())
    out += ["", f"Prompts per task: {counts}."]
    skipped = {t: n for t, n in result["skipped_prompts"].items() if n}
    if skipped:
        out += ["Skipped (prompt + new tokens longer than the model's context): "
                + ", ".join(f"{t} {n}" for t, n in skipped.items()) + "."]
    if result.get("reused_rows"):
        out += [f"{result['reused_rows']} rows are reused from an earlier run with the same "
                "settings (the row log)."]
    if result["failures"]:
        out += ["", f"**{len(result['failures'])} outputs differ from greedy decoding.**"]
    return "\n".join(out) + "\n"


def plots(result: dict, out: Path, stem: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    rows = [r for r in result["rows"] if "skipped" not in r and r["block_efficiency"]]
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    methods_ = [m for m in dict.fromkeys(r["method"] for r in rows) if m != "greedy"]
    budgets = sorted({r["bc"] for r in rows if r["method"] != "greedy"})
    colors = dict(zip(methods_, plt.cm.tab10.colors))
    paths = []
    fig, ax = plt.subplots(figsize=(min(16, max(8, 0.45 * len(tasks) * len(methods_) + 3)), 4.5))
    slots = max(1, len(methods_) * len(budgets))
    width = 0.8 / slots
    x = np.arange(len(tasks))
    for i, m in enumerate(methods_):
        for j, bc in enumerate(budgets):  # side by side; higher opacity = larger BC (paper)
            vals = [next((r["block_efficiency"] for r in rows
                          if (r["method"], r["bc"], r["task"]) == (m, bc, t)), 0) for t in tasks]
            ax.bar(x + (i * len(budgets) + j) * width, vals, width, color=colors[m],
                   alpha=0.35 + 0.65 * (j + 1) / len(budgets),
                   label=m if j == len(budgets) - 1 else None)
    ax.set_xticks(x + width * (slots - 1) / 2, tasks, rotation=20)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set(ylabel="block efficiency", title=f"BE per task and method (BC {budgets}, left to "
                                            "right; darker = larger BC)")
    # one row of legend in headroom above the tallest bar, so it covers none of them
    tallest = max((r["block_efficiency"] for r in rows if r["method"] != "greedy"), default=1)
    ax.set_ylim(0, 1.22 * max(tallest, 1.0))
    ax.legend(ncol=len(methods_), loc="upper center", fontsize=8)
    fig.tight_layout()
    paths.append(out / f"{stem}_be.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for m in methods_:
        pts = [(bc, statistics.mean(r["tokens_per_second"] for r in rows
                                    if r["method"] == m and r["bc"] == bc))
               for bc in budgets if any(r["method"] == m and r["bc"] == bc for r in rows)]
        if pts:
            ax.plot(*zip(*pts), "o-", color=colors[m], label=m)
    greedy = statistics.mean(r["tokens_per_second"] for r in rows if r["method"] == "greedy")
    ax.axhline(greedy, color="gray", ls="--", label="greedy")
    ax.set(xlabel="block complexity BC", ylabel="tokens / s (mean over tasks)",
           title=f"tokens/s vs BC ({result['backend']})")
    ax.legend()
    fig.tight_layout()
    paths.append(out / f"{stem}_tps.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths
