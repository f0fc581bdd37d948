"""``edgemtp profile``: measure on this device what a block-complexity budget buys.

It measures the forward latency curve t(T), the BE and tokens/s of every candidate plan under
the budget on a prompt set, and peak memory, then recommends the drafter, budget and mask-token
count with the best measured tokens/s. The JSON it writes is what ``generate --profile`` reads
(the recommendation, and the latency curve the ``auto`` drafter uses).
"""

from __future__ import annotations

import json
import platform
import resource
import sys
import time
from pathlib import Path

from edgemtp.config import GenerationConfig
from edgemtp.errors import ConfigError
from edgemtp.latency import LatencyCurve

FORMAT = 1
BC_GRID = (4, 6, 8, 10, 14, 20, 30, 40, 60, 90, 120)


def candidates(budget: int) -> list[tuple[str, dict]]:
    """Plans worth measuring under ``budget``: plain decoding, k = 1 probing on a grid of BCs,
    k = 2 dynamic trees, the lookup drafters (PLD, STAND, LADE, hybrid) at the paper's BCs
    (or the budget, when below 10), and the auto policy."""
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
    if budget >= 4:
        out.append((f"auto BC<={budget}", dict(drafter="auto", bc=budget)))
    return out


def load_prompts(path: str | None, n: int) -> list[str]:
    """Prompts from a JSONL file (``prompt`` or Spec-Bench ``turns``), default: the shared
    story prompts."""
    if path is None:
        from .demo import story_prompts

        return story_prompts(n)
    try:
        with open(path) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"cannot read prompts from {path!r}: {e}") from None
    prompts = [r.get("prompt") or (r.get("turns") or [None])[0] for r in rows]
    prompts = [p for p in prompts if isinstance(p, str) and p]
    if not prompts:
        raise ConfigError(f"{path!r} has no prompts; expected JSON lines with 'prompt' or 'turns'")
    return prompts[:n]


def run_profile(model, budget: int, prompts: list[str], max_new_tokens: int,
                repeats: int = 2) -> dict:
    from tqdm import tqdm

    from edgemtp.latency import measure_latency

    if budget < 1:
        raise ConfigError(f"budget must be >= 1, got {budget}")
    sizes = sorted({1, 2, budget, *(b for b in BC_GRID if b <= budget)})
    latency = measure_latency(model.backend, sizes, repeats=15)
    plans = candidates(budget)
    rows = []
    bar = tqdm(total=len(plans) * len(prompts) * repeats, desc="profile", unit="gen",
               file=sys.stderr)
    reference = None
    for label, opts in plans:
        config = GenerationConfig(max_new_tokens=max_new_tokens, latency=latency, **opts)
        speeds, tokens, calls, outputs = [], 0, 0, []
        for rep in range(repeats):
            t0, n = time.perf_counter(), 0
            for p in prompts:
                r = model.generate(p, config)
                bar.update()
                n += r.stats.new_tokens
                if rep == 0:
                    tokens, calls = tokens + r.stats.new_tokens, calls + r.stats.forward_calls
                    outputs.append(r.token_ids)
            speeds.append(n / (time.perf_counter() - t0))
        reference = reference or outputs
        be = tokens / calls
        bc = opts.get("bc", 1)
        rows.append(dict(plan=label, options=opts, block_efficiency=round(be, 4),
                         tokens_per_second=round(max(speeds), 2),
                         predicted_tokens_per_second=round(be / latency(bc), 2),
                         lossless=outputs == reference))
    bar.close()
    base = rows[0]["tokens_per_second"]
    for row in rows:
        row["speedup"] = round(row["tokens_per_second"] / base, 3)
    best = max(rows, key=lambda r: r["tokens_per_second"])
    rec = {"drafter": best["options"]["drafter"], "bc": best["options"].get("bc", 1),
           "mask_tokens": best["options"].get("mask_tokens", 1)}
    return {
        "format_version": FORMAT, "backend": model.backend.name, "budget": budget,
        "prompts": len(prompts), "max_new_tokens": max_new_tokens,
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "latency": latency.to_dict(), "plans": rows, "recommendation": rec,
        "peak_memory_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }


def table(profile: dict) -> str:
    lat = profile["latency"]
    lines = ["block size T  " + "  ".join(f"{t:>6}" for t in lat["block_sizes"]),
             "latency ms    " + "  ".join(f"{1e3 * s:>6.2f}" for s in lat["seconds"]), "",
             f"{'plan':<22}{'BE':>7}{'tok/s':>10}{'predicted':>11}{'speed-up':>10}  lossless"]
    for r in profile["plans"]:
        lines.append(f"{r['plan']:<22}{r['block_efficiency']:>7.3f}{r['tokens_per_second']:>10.1f}"
                     f"{r['predicted_tokens_per_second']:>11.1f}{r['speedup']:>9.2f}x  "
                     f"{'yes' if r['lossless'] else 'NO'}")
    rec = profile["recommendation"]
    lines += ["", f"recommended: --drafter {rec['drafter']} --bc {rec['bc']} --mask-tokens "
                  f"{rec['mask_tokens']}  (peak memory {profile['peak_memory_mib']} MiB)"]
    return "\n".join(lines)


def plot(profile: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    lat = profile["latency"]
    a.plot(lat["block_sizes"], [1e3 * s for s in lat["seconds"]], "o-")
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
    """The recommendation and latency curve of a profile file, with one-line errors."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"cannot read profile {path!r}: {e}") from None
    if not isinstance(data, dict) or data.get("format_version") != FORMAT:
        raise ConfigError(f"{path!r} is not an edgemtp profile (format_version {FORMAT})")
    rec = data.get("recommendation")
    if not isinstance(rec, dict) or not {"drafter", "bc", "mask_tokens"} <= set(rec):
        raise ConfigError(f"profile {path!r} has no recommendation")
    return rec, LatencyCurve.from_dict(data.get("latency") or {})
