"""``edgemtp profile``: measure on this device what a block-complexity budget buys.

It checks first that the loaded model can run every candidate plan under the budget (a
package's graph exports a fixed top-K), then measures the forward latency curve t(T), runs
every plan once untimed (:func:`~edgemtp.tools.measure.warm_up`), then measures the BE and
tokens/s (the best of ``--repeats`` runs over the prompts) of each, and the process's peak
memory, and recommends the drafter, budget and mask-token count of the lossless plan with the
best measured tokens/s among plain decoding and the plans that drafted (BE at least
:data:`MIN_BE`: one that accepted next to nothing cannot be faster than plain decoding, only
look it by noise). The JSON it writes (``out/profile/profile.json`` by default) is what
``generate --profile`` reads back through :func:`read_profile`: the recommendation, and the
latency curve the ``auto`` drafter uses.
"""

from __future__ import annotations

import json
import platform
import resource
import sys
import time
from pathlib import Path

from edgemtp import drafters
from edgemtp.budgets import check_bc
from edgemtp.config import GenerationConfig
from edgemtp.errors import BudgetError, ConfigError
from edgemtp.latency import LatencyCurve, _host

from . import at_least_one, check_fits, output_folder, quiet_transformers
from .measure import measure, misfit, warm_up
from .prompts import load_prompts

FORMAT = 1
BC_GRID = (4, 6, 8, 10, 14, 20, 30, 40, 60, 90, 120)
MIN_BUDGET = 2  # a block of BC positions drafts BC - 1 tokens at most: prompt lookup and
                # STAND draft one from BC 2, probing from BC 4
MIN_BE = 1.01   # a speculative plan below it accepted next to nothing: never recommended


def check_budget(budget, flag: str = "--budget") -> int:
    """The budget, or one line saying why no plan could draft under it.

    >>> check_budget(1)
    Traceback (most recent call last):
    ...
    edgemtp.errors.BudgetError: --budget 1 leaves no position to draft in: ...
    """
    budget = check_bc(budget, flag)
    if budget < MIN_BUDGET:
        raise BudgetError(f"{flag} {budget} leaves no position to draft in: a block of BC "
                          f"positions holds the next token and at most BC - 1 drafted ones; "
                          f"give {flag} {MIN_BUDGET} or more (prompt lookup and STAND draft "
                          f"from 2, probing from 4)")
    return budget


def candidates(budget: int, heads: tuple[str, ...] = ()) -> list[tuple[str, dict]]:
    """Plans worth measuring under ``budget``: plain decoding; k = 1 probing on a grid of BCs
    and k = 2 dynamic trees on its multiples of 3 from 9; prompt lookup at BC
    ``min(budget, 11)`` (a chain is at most 10 deep); STAND, lookahead (from BC 3) and the k = 1
    hybrid at the paper's BCs 10 / 30 / 60 (or at the budget, below 10), STAND and the hybrid
    there also with ``tree_cost="measured"``; ``auto`` at the budget (from BC 4)."""
    out = [("none", dict(drafter="none"))]
    out += [(f"probe k=1 BC={b}", dict(drafter="probe", bc=b, mask_tokens=1))
            for b in BC_GRID if b <= budget]
    out += [(f"probe k=2 BC={b}", dict(drafter="probe", bc=b, mask_tokens=2))
            for b in BC_GRID if b <= budget and b >= 9 and b % 3 == 0]
    if budget >= 2:  # a PLD chain is at most 10 deep: BC 11 is all it can use
        out.append((f"pld BC={min(budget, 11)}", dict(drafter="pld", bc=min(budget, 11))))
    for b in [b for b in (10, 30, 60) if b <= budget] or [budget]:
        out.append((f"stand BC={b}", dict(drafter="stand", bc=b)))
        if b >= 3:
            out.append((f"lade BC={b}", dict(drafter="lade", bc=b)))
        out.append((f"hybrid k=1 BC={b}", dict(drafter="hybrid", bc=b, mask_tokens=1)))
        if b >= 10:  # trees (and the hybrid's window) held to what pays on this device
            out.append((f"stand BC={b} measured", dict(drafter="stand", bc=b,
                                                        tree_cost="measured")))
            out.append((f"hybrid k=1 BC={b} measured", dict(drafter="hybrid", bc=b,
                                                             mask_tokens=1,
                                                             tree_cost="measured")))
    for kind in heads:
        out += [(f"heads {kind} BC={b}", dict(drafter="heads", heads=kind, bc=b))
                for b in BC_GRID if b <= budget]
    if budget >= 4:
        out.append((f"auto BC<={budget}", dict(drafter="auto", bc=budget)))
    return out


def command(a, load) -> int:
    """``edgemtp profile``: check every option, load the model with ``load(a)``, measure,
    write ``profile.json`` and ``profile.png`` to ``a.out``. Returns the exit code."""
    budget = check_budget(a.budget)
    at_least_one(prompts=a.prompts, repeats=a.repeats)
    GenerationConfig(drafter="none", max_new_tokens=a.max_new_tokens)  # checks the count
    prompts = load_prompts(a.prompts_file, a.prompts)
    with output_folder(a.out) as out:
        quiet_transformers(a.model)
        profile = run_profile(load(a), budget, prompts, a.max_new_tokens, repeats=a.repeats)
        (out / "profile.json").write_text(json.dumps(profile, indent=1))
        plot(profile, out / "profile.png")
    print(table(profile))
    print(f"wrote {out / 'profile.json'} (use: edgemtp generate --profile {out / 'profile.json'}) "
          f"and {out / 'profile.png'}")
    return 0


def run_profile(model, budget: int, prompts: list[str], max_new_tokens: int,
                repeats: int = 2) -> dict:
    """The profile of ``model`` under ``budget`` on ``prompts`` (see the module's docstring)."""
    from tqdm import tqdm

    from edgemtp.latency import curve_pair, measure_latency

    budget = check_budget(budget)
    check_fits([budget], model.backend.max_context, "--budget")
    at_least_one(repeats=repeats)
    if not prompts:
        raise ConfigError("a profile needs at least one prompt, got none")
    package = getattr(model.backend, "package", None)
    heads = tuple(h.kind for h in package.meta.heads) if package else ()
    plans = candidates(budget, heads)
    check_runnable(model, budget, heads)  # before anything is measured
    sizes = sorted({1, 2, budget, *(b for b in BC_GRID if b <= budget)})
    # over 64 and over 512 cached rows, as auto measures them (it reads t(T) at the cache's
    # length off the line through both)
    latency = curve_pair(lambda ctx, again: measure_latency(model.backend, sizes, context=ctx,
                                                            repeats=15), model.backend, sizes)
    configs = [(label, opts, GenerationConfig(max_new_tokens=max_new_tokens, latency=latency,
                                              **opts)) for label, opts in plans]
    rows = []
    reference = None
    with tqdm(total=len(plans) * (1 + len(prompts) * repeats), desc="profile", unit="gen",
              file=sys.stderr) as bar:
        warm_up(model, [config for _, _, config in configs], bar)  # untimed, every plan
        for label, opts, config in configs:
            m = measure(model, prompts, config, bar, repeats)
            reference = reference or m.outputs  # plain decoding's, the first plan
            be = m.tokens / m.forward_calls
            rows_per_step = block_rows(config)
            rows.append(dict(plan=label, options=opts, block_efficiency=round(be, 4),
                             tokens_per_second=round(max(m.rates), 2),
                             predicted_tokens_per_second=(
                                 None if rows_per_step is None
                                 else round(be / latency(rows_per_step), 2)),
                             lossless=m.outputs == reference))
    base = rows[0]["tokens_per_second"]
    for row in rows:
        row["speedup"] = round(row["tokens_per_second"] / base, 3)
    return {
        "format_version": FORMAT, "backend": model.backend.name, "budget": budget,
        "model": fingerprint(model), "host": _host(),
        "prompts": len(prompts), "max_new_tokens": max_new_tokens,
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "latency": latency.to_dict(), "plans": rows, "recommendation": recommend(rows),
        "peak_memory_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                                 / (2**20 if sys.platform == "darwin" else 2**10), 1),  # B, KiB
    }


def check_runnable(model, budget: int, heads: tuple[str, ...] = ()) -> None:
    """Every candidate plan under ``budget`` must run on ``model`` (a package's graph exports
    a fixed top-K: probing at BC B asks for about B / 2 candidates a row), checked without a
    forward pass; else one line naming ``--budget`` and the largest budget that runs."""
    seen: dict[str, str | None] = {}

    def first_misfit(b: int):
        for label, opts in candidates(b, heads):
            key = json.dumps(opts, sort_keys=True)
            if key not in seen:
                seen[key] = misfit(model.backend, GenerationConfig(**opts))
            if seen[key]:
                return label, seen[key]
        return None

    bad = first_misfit(budget)
    if bad is None:
        return
    if not bad[1].startswith("needs top-"):  # not a matter of the budget (no learned heads)
        raise BudgetError(f"plan {bad[0]}: {bad[1]}")
    fits = next((b for b in range(budget - 1, MIN_BUDGET - 1, -1) if first_misfit(b) is None),
                None)
    raise BudgetError(f"--budget {budget} is more than this package can run: plan "
                      f"{bad[0]} {bad[1]}; "
                      + (f"use --budget {fits} or less, or " if fits else "")
                      + f"re-export the package with --bc {budget}")


def block_rows(config: GenerationConfig) -> int | None:
    """The rows of the one block every step of ``config`` runs (plain decoding: 1; probing:
    its plan's), or None where the block varies from step to step (lookup, trees, lookahead,
    auto): there ``BE / t(T)`` predicts nothing."""
    if config.drafter == "none":
        return 1
    if config.drafter == "probe":
        return drafters.get("probe").budget(config)
    return None


def recommend(rows: list[dict]) -> dict:
    """The plan to run: the fastest lossless one among plain decoding and the plans that
    drafted (BE >= :data:`MIN_BE`).

    >>> rows = [dict(options=dict(drafter="none"), block_efficiency=1.0, lossless=True,
    ...              tokens_per_second=100.0),
    ...         dict(options=dict(drafter="stand", bc=1), block_efficiency=1.0, lossless=True,
    ...              tokens_per_second=199.0)]
    >>> recommend(rows)
    {'drafter': 'none', 'bc': 1, 'mask_tokens': 1}
    """
    best = max((r for r in rows if r["lossless"] and (
        r["options"]["drafter"] == "none" or r["block_efficiency"] >= MIN_BE)),
        key=lambda r: r["tokens_per_second"])
    rec = {"drafter": best["options"]["drafter"], "bc": best["options"].get("bc", 1),
           "mask_tokens": best["options"].get("mask_tokens", 1)}
    if "heads" in best["options"]:
        rec["heads"] = best["options"]["heads"]
    if "tree_cost" in best["options"]:
        rec["tree_cost"] = best["options"]["tree_cost"]
    return rec


def table(profile: dict) -> str:
    lat = profile["latency"]
    lines = ["block size T  " + "  ".join(f"{t:>6}" for t in lat["block_sizes"]),
             "latency ms    " + "  ".join(f"{1e3 * s:>6.2f}" for s in lat["seconds"])
             + f"  ({lat.get('context', 64)} cached rows)"]
    if lat.get("long"):
        long = lat["long"]
        lines.append("latency ms    " + "  ".join(f"{1e3 * s:>6.2f}" for s in long["seconds"])
                     + f"  ({long['context']} cached rows)")
    lines += ["",
             f"{'plan':<27}{'BE':>7}{'tok/s':>10}{'predicted':>11}{'speed-up':>10}  lossless"]
    for r in profile["plans"]:
        predicted = r.get("predicted_tokens_per_second")
        lines.append(f"{r['plan']:<27}{r['block_efficiency']:>7.3f}{r['tokens_per_second']:>10.1f}"
                     + (f"{predicted:>11.1f}" if predicted is not None else f"{'-':>11}")
                     + f"{r['speedup']:>9.2f}x  {'yes' if r['lossless'] else 'NO'}")
    rec = profile["recommendation"]
    cost = f" --tree-cost {rec['tree_cost']}" if rec.get("tree_cost", "budget") != "budget" else ""
    lines += ["", "predicted: BE / t(T), where every step runs one block of T rows (plain "
                  "decoding, probing);",
              "  the other plans' blocks vary by step (-)",
              f"plans with BE below {MIN_BE} (next to nothing drafted) are not recommended"]
    # the flags to run it with: --heads for learned heads, --mask-tokens where it probes
    heads = f" --heads {rec['heads']}" if rec.get("heads") else ""
    masks = (f" --mask-tokens {rec['mask_tokens']}" if drafters.get(rec["drafter"]).uses_masks
             else "")
    lines += ["", f"recommended: --drafter {rec['drafter']} --bc {rec['bc']}{masks}{heads}{cost}"
                  f"  (peak memory {profile['peak_memory_mib']} MiB)"]
    return "\n".join(lines)


def plot(profile: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    lat = profile["latency"]
    a.plot(lat["block_sizes"], [1e3 * s for s in lat["seconds"]], "o-",
           label=f"{lat.get('context', 64)} cached rows")
    if lat.get("long"):
        a.plot(lat["long"]["block_sizes"], [1e3 * s for s in lat["long"]["seconds"]], "s-",
               label=f"{lat['long']['context']} cached rows")
    a.legend()
    a.set(xlabel="block size T (positions per forward)", ylabel="forward latency (ms)",
          title=f"t(T) on this device ({profile['backend']})")
    for label, marker, xs, ys in plot_series(profile):
        b.plot(xs, ys, marker, label=label)
    base = profile["plans"][0]["tokens_per_second"]
    b.axhline(base, color="gray", ls="--", label="plain decoding")
    b.set(xlabel="block complexity BC", ylabel="tokens / s", title="measured tokens/s")
    b.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


SERIES = [  # (label, drafter, mask tokens (None: any), tree cost, marker)
    ("probe k=1", "probe", 1, "budget", "o-"), ("probe k=2", "probe", 2, "budget", "s-"),
    ("pld", "pld", None, "budget", "D"), ("stand", "stand", None, "budget", "^-"),
    ("stand measured", "stand", None, "measured", "^--"), ("lade", "lade", None, "budget", "v-"),
    ("hybrid k=1", "hybrid", 1, "budget", "P-"),
    ("hybrid k=1 measured", "hybrid", 1, "measured", "P--"), ("auto", "auto", None, "budget", "*"),
]


def plot_series(profile: dict) -> list[tuple[str, str, list[int], list[float]]]:
    """``(label, marker, BCs, tokens/s)`` per drafter of the profile's plans, a tree
    drafter's budget and measured trees apart (one line through both zig-zagged)."""
    out = []
    for label, drafter, k, cost, marker in SERIES:
        rows = sorted((r for r in profile["plans"] if r["options"]["drafter"] == drafter
                       and (k is None or r["options"].get("mask_tokens") == k)
                       and r["options"].get("tree_cost", "budget") == cost),
                      key=lambda r: r["options"]["bc"])
        if rows:
            out.append((label, marker, [r["options"]["bc"] for r in rows],
                        [r["tokens_per_second"] for r in rows]))
    return out


def fingerprint(model) -> dict:
    """Which model a profile was measured on: its folder's name, the backend, and the graph
    file's size (a package's; None for a Hugging Face folder on torch)."""
    b = model.backend
    pkg = getattr(b, "package", None)
    path = str(pkg.root) if pkg is not None else getattr(b, "source", None)
    try:
        size = pkg.graph_path.stat().st_size if pkg is not None else None
    except (OSError, AttributeError):
        size = None
    return {"name": Path(str(path)).name if path else None, "backend": b.name,
            "graph_bytes": size}


def mismatch(path: str, model) -> str | None:
    """A one-line warning where the profile at ``path`` was measured on another model,
    backend or machine than ``model`` on this host (its recommendation and latency curve then
    steer speed by another's figures; the tokens are the same whatever it says), else None.
    A profile written before profiles named their model says nothing."""
    with open(path) as f:
        data = json.load(f)
    was, now = data.get("model"), fingerprint(model)
    if not isinstance(was, dict):
        return None
    def where(d) -> str:
        return f"{d.get('name')!r} on {d.get('backend')}"
    other = (was.get("backend") != now["backend"]
             or (was.get("graph_bytes") is not None and now["graph_bytes"] is not None
                 and was.get("graph_bytes") != now["graph_bytes"])
             or (None in (was.get("graph_bytes"), now["graph_bytes"])
                 and was.get("name") != now["name"]))
    if other:
        return (f"edgemtp: warning: profile {path!r} was measured on {where(was)}; this is "
                f"{where(now)}: its drafter, budget and latency curve fit that one (the text "
                f"is the same either way); run edgemtp profile on this model")
    if data.get("host") not in (None, _host()):
        return (f"edgemtp: warning: profile {path!r} was measured on another machine "
                f"({data.get('machine', '?')}): its latency curve may not fit this one; run "
                f"edgemtp profile here")
    return None


def read_profile(path: str) -> tuple[dict, LatencyCurve]:
    """The recommendation (``drafter``, ``bc``, ``mask_tokens``: a plan ``GenerationConfig``
    accepts) and the latency curve of a profile file. Anything else is a one-line
    :class:`~edgemtp.errors.ConfigError` that names the file."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"cannot read profile {path!r}: {e}") from None
    if not isinstance(data, dict) or data.get("format_version") != FORMAT:
        raise ConfigError(f"{path!r} is not an edgemtp profile (format_version {FORMAT})")
    rec = data.get("recommendation")
    if not isinstance(rec, dict) or not {"drafter", "bc", "mask_tokens"} <= set(rec):
        raise ConfigError(f"profile {path!r} has no recommendation; expected drafter, bc and "
                          f"mask_tokens")
    try:
        GenerationConfig(drafter=rec["drafter"], bc=rec["bc"], mask_tokens=rec["mask_tokens"],
                         tree_cost=rec.get("tree_cost", "budget"))
        curve = LatencyCurve.from_dict(data.get("latency"))
    except ConfigError as e:
        raise ConfigError(f"profile {path!r}: {e}") from None
    return rec, curve
