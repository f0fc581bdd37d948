"""``edgemtp bench``: drafters x block complexity x prompt sets, at matched BC.

Every method runs in the same runtime on the same backend and prompts; every output is
checked against plain greedy decoding (a difference is a failure, reported and counted in the
exit code). ``transformers``' own prompt lookup (``generate(prompt_lookup_num_tokens=...)``)
runs as an outside reference for speed and output. Writes JSON, a Markdown table and PNG
plots (BE per task and method, like the paper's Figures 4-5; tokens/s vs BC).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

from edgemtp.config import GenerationConfig
from edgemtp.drafters import get as drafter_spec
from edgemtp.errors import ConfigError

SHARED = Path(__file__).resolve().parents[1] / ".." / "shared"


def prompt_sets(names: list[str], per_set: int) -> dict[str, list[str]]:
    """``{task: prompts}``: ``stories`` (the shared story prompts) and ``spec_bench`` (the
    Spec-Bench questions, first turn, ``per_set`` per category)."""
    out: dict[str, list[str]] = {}
    for name in names:
        if name == "stories":
            from .demo import story_prompts

            out["stories"] = story_prompts(per_set)
        elif name == "spec_bench":
            path = SHARED / "data" / "spec_bench" / "question.jsonl"
            if not path.is_file():
                raise ConfigError(f"Spec-Bench questions not found at {path}")
            by_cat: dict[str, list[str]] = defaultdict(list)
            with open(path) as f:
                for line in f:
                    row = json.loads(line)
                    if len(by_cat[row["category"]]) < per_set:
                        by_cat[row["category"]].append(row["turns"][0])
            out.update(by_cat)
        else:
            raise ConfigError(f"unknown prompt set {name!r}; expected stories or spec_bench")
    return out


def methods(drafters: list[str], budgets: list[int]) -> list[tuple[str, int, dict]]:
    """(drafter, BC, generation options): drafters that carry mask tokens use k = 1 at every
    budget, the others their own BC accounting."""
    out = []
    for d in drafters:
        for bc in budgets:
            opts = dict(drafter=d, bc=bc)
            if drafter_spec(d).uses_masks:
                opts["mask_tokens"] = 1
            out.append((d, bc, opts))
    return out


def run_bench(model, tasks: dict[str, list[str]], drafters: list[str], budgets: list[int],
              max_new_tokens: int, hf_reference: bool = True, repeats: int = 1) -> dict:
    """Tokens/s of a method on a task is the median over ``repeats`` runs of its prompts
    (run back to back, so the first, cold one does not count when ``repeats >= 3``); every
    run's outputs are checked against greedy's."""
    if repeats < 1:
        raise ConfigError(f"repeats must be >= 1, got {repeats}")
    from tqdm import tqdm

    plan = methods(drafters, budgets)
    hf = _reference_model(model) if hf_reference else None
    tasks, skipped = _fitting(model, tasks, max_new_tokens)
    total = sum(len(p) for p in tasks.values()) * ((len(plan) + 1) * repeats + int(hf_reference))
    bar = tqdm(total=total, desc="bench", unit="gen", file=sys.stderr)
    rows, failures = [], []
    for task, prompts in tasks.items():
        greedy = _measure(model, prompts, GenerationConfig(drafter="none",
                                                           max_new_tokens=max_new_tokens), bar,
                          repeats)
        rows.append(dict(task=task, method="greedy", bc=1, **greedy["summary"]))
        for name, bc, opts in plan:
            try:
                config = GenerationConfig(max_new_tokens=max_new_tokens, **opts)
            except ConfigError as e:  # a budget this drafter cannot use
                rows.append(dict(task=task, method=name, bc=bc, skipped=str(e)))
                bar.update(len(prompts))
                continue
            res = _measure(model, prompts, config, bar, repeats)
            bad = sorted({i for outputs in res["runs"] for i, (a, b)
                          in enumerate(zip(outputs, greedy["outputs"])) if a != b})
            failures += [dict(task=task, method=name, bc=bc, prompt=i) for i in bad]
            rows.append({"task": task, "method": name, "bc": bc, **res["summary"],
                         "lossless": not bad})
        if hf_reference:
            ref = _hf_prompt_lookup(model, hf, prompts, max_new_tokens, bar)
            if ref is not None:
                bad = [i for i, (a, b) in enumerate(zip(ref["outputs"], greedy["outputs"]))
                       if a != b]
                rows.append({"task": task, "method": "transformers prompt lookup", "bc": 11,
                             **ref["summary"], "lossless": not bad})
    bar.close()
    for row in rows:
        base = next(r for r in rows if r["task"] == row["task"] and r["method"] == "greedy")
        if "tokens_per_second" in row:
            row["speedup"] = round(row["tokens_per_second"] / base["tokens_per_second"], 3)
    return dict(rows=rows, failures=failures, max_new_tokens=max_new_tokens, repeats=repeats,
                backend=model.backend.name, date=time.strftime("%Y-%m-%d"),
                prompts={t: len(p) for t, p in tasks.items()}, skipped_prompts=skipped)


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


def _measure(model, prompts: list[str], config: GenerationConfig, bar, repeats: int = 1
             ) -> dict:
    runs, rates, counts = [], [], []
    for _ in range(repeats):
        outputs, tokens, calls, t0 = [], 0, 0, time.perf_counter()
        for p in prompts:
            r = model.generate(p, config)
            outputs.append(r.token_ids)
            tokens, calls = tokens + r.stats.new_tokens, calls + r.stats.forward_calls
            bar.update()
        rates.append(tokens / (time.perf_counter() - t0))
        runs.append(outputs)
        counts.append((tokens, calls))
    # BE from the first run: later ones would have learned (calibration, hit rates) on the
    # very prompts they are scored on
    tokens, calls = counts[0]
    return dict(outputs=runs[0], runs=runs, summary=dict(
        tokens=tokens, forward_calls=calls, block_efficiency=round(tokens / calls, 4),
        tokens_per_second=round(statistics.median(rates), 2), lossless=True))


def _reference_model(model):
    """The ``transformers`` model behind the backend: its own for the torch backend, else the
    Hugging Face folder a package was exported from (the manifest's ``source``), if it is
    still there and PyTorch is installed; None otherwise."""
    hf = getattr(model.backend, "hf", None)
    if hf is not None:
        return hf
    package = getattr(model.backend, "package", None)
    source = getattr(package, "manifest", {}).get("source") if package is not None else None
    if not source or not (Path(source) / "config.json").is_file():
        return None
    try:
        import torch
        from transformers import AutoModelForCausalLM
    except ModuleNotFoundError:
        return None
    return AutoModelForCausalLM.from_pretrained(source).eval()


def _hf_prompt_lookup(model, hf, prompts: list[str], max_new_tokens: int, bar) -> dict | None:
    """``transformers`` prompt lookup decoding on ``hf`` (the same model; for a package, the
    folder it was exported from), greedy, ``prompt_lookup_num_tokens=10``."""
    if hf is None or model.tokenizer is None:
        bar.update(len(prompts))
        return None
    import torch

    outputs, tokens, t0 = [], 0, time.perf_counter()
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([model.tokenizer.encode(p)], device=hf.device)
            out = hf.generate(ids, max_new_tokens=max_new_tokens, do_sample=False,
                              prompt_lookup_num_tokens=10)
            new = out[0, ids.shape[1]:].tolist()
            outputs.append(new)
            tokens += len(new)
            bar.update()
    return dict(outputs=outputs, summary=dict(
        tokens=tokens, forward_calls=None, block_efficiency=None,
        tokens_per_second=round(tokens / (time.perf_counter() - t0), 2), lossless=True))


def markdown(result: dict, title: str) -> str:
    rows = [r for r in result["rows"] if "skipped" not in r]
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    keys = list(dict.fromkeys((r["method"], r["bc"]) for r in rows))
    out = [f"# {title}", "", f"{result['max_new_tokens']} new tokens per prompt, backend "
           f"{result['backend']}, {result['date']}. Cells: BE (tokens per forward call, prefill "
           "included) / tokens per second (median of the repeats). Every output is checked against "
           "greedy decoding.",
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
    ax.legend(ncol=len(methods_))
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
