"""``edgemtp profile``: measure on this device what a block-complexity budget buys.

It measures the forward latency curve t(T), the BE and tokens/s (the best of ``--repeats``
runs over the prompts) of every candidate plan under the budget, and the process's peak
memory, then recommends the drafter, budget and mask-token count of the lossless plan with the
best measured tokens/s. The JSON it writes (``out/profile/profile.json`` by default) is what
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

from edgemtp.budgets import check_bc
from edgemtp.config import GenerationConfig
from edgemtp.errors import ConfigError
from edgemtp.latency import LatencyCurve

from . import at_least_one, check_fits, output_folder, quiet_transformers
from .measure import measure
from .prompts import load_prompts

FORMAT = 1
BC_GRID = (4, 6, 8, 10, 14, 20, 30, 40, 60, 90, 120)


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
    budget = check_bc(a.budget, "--budget")
    at_least_one(prompts=a.prompts, repeats=a.repeats)
    GenerationConfig(drafter="none", max_new_tokens=a.max_new_tokens)  # checks the count
    prompts = load_prompts(a.prompts_file, a.prompts)
    out = output_folder(a.out)
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

    check_fits([check_bc(budget, "budget")], model.backend.max_context, "budget")
    at_least_one(repeats=repeats)
    if not prompts:
        raise ConfigError("a profile needs at least one prompt, got none")
    sizes = sorted({1, 2, budget, *(b for b in BC_GRID if b <= budget)})
    # over 64 and over 512 cached rows, as auto measures them (it reads t(T) at the cache's
    # length off the line through both)
    latency = curve_pair(lambda ctx, again: measure_latency(model.backend, sizes, context=ctx,
                                                            repeats=15), model.backend, sizes)
    package = getattr(model.backend, "package", None)
    plans = candidates(budget, tuple(h.kind for h in package.meta.heads) if package else ())
    rows = []
    reference = None
    with tqdm(total=len(plans) * len(prompts) * repeats, desc="profile", unit="gen",
              file=sys.stderr) as bar:
        for label, opts in plans:
            config = GenerationConfig(max_new_tokens=max_new_tokens, latency=latency, **opts)
            m = measure(model, prompts, config, bar, repeats)
            reference = reference or m.outputs  # plain decoding's, the first plan
            be = m.tokens / m.forward_calls
            bc = opts.get("bc", 1)
            rows.append(dict(plan=label, options=opts, block_efficiency=round(be, 4),
                             tokens_per_second=round(max(m.rates), 2),
                             predicted_tokens_per_second=round(be / latency(bc), 2),
                             lossless=m.outputs == reference))
    base = rows[0]["tokens_per_second"]
    for row in rows:
        row["speedup"] = round(row["tokens_per_second"] / base, 3)
    best = max((r for r in rows if r["lossless"]), key=lambda r: r["tokens_per_second"])
    rec = {"drafter": best["options"]["drafter"], "bc": best["options"].get("bc", 1),
           "mask_tokens": best["options"].get("mask_tokens", 1)}
    if "heads" in best["options"]:
        rec["heads"] = best["options"]["heads"]
    if "tree_cost" in best["options"]:
        rec["tree_cost"] = best["options"]["tree_cost"]
    return {
        "format_version": FORMAT, "backend": model.backend.name, "budget": budget,
        "prompts": len(prompts), "max_new_tokens": max_new_tokens,
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "latency": latency.to_dict(), "plans": rows, "recommendation": rec,
        "peak_memory_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                                 / (2**20 if sys.platform == "darwin" else 2**10), 1),  # B, KiB
    }


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
        lines.append(f"{r['plan']:<27}{r['block_efficiency']:>7.3f}{r['tokens_per_second']:>10.1f}"
                     f"{r['predicted_tokens_per_second']:>11.1f}{r['speedup']:>9.2f}x  "
                     f"{'yes' if r['lossless'] else 'NO'}")
    rec = profile["recommendation"]
    cost = f" --tree-cost {rec['tree_cost']}" if rec.get("tree_cost", "budget") != "budget" else ""
    lines += ["", f"recommended: --drafter {rec['drafter']} --bc {rec['bc']} --mask-tokens "
                  f"{rec['mask_tokens']}{cost}  (peak memory {profile['peak_memory_mib']} MiB)"]
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
    series = [("probe k=1", "probe", 1, "o-"), ("probe k=2", "probe", 2, "s-"),
              ("pld", "pld", None, "D"), ("stand", "stand", None, "^-"),
              ("lade", "lade", None, "v-"), ("hybrid k=1", "hybrid", 1, "P-")]
    for label, drafter, k, marker in series:
        rows = [r for r in profile["plans"] if r["options"]["drafter"] == drafter
                and (k is None or r["options"].get("mask_tokens") == k)]
        if rows:
            b.plot([r["options"]["bc"] for r in rows], [r["tokens_per_second"] for r in rows],
                   marker, label=label)
    base = profile["plans"][0]["tokens_per_second"]
    b.axhline(base, color="gray", ls="--", label="plain decoding")
    b.set(xlabel="block complexity BC", ylabel="tokens / s", title="measured tokens/s")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


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
