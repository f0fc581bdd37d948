"""Two builds of the native decoder in one process, alternated forward by forward.

The native backend's kernels are compared on this machine's noise floor only when both run in
the same process on the same package: a slow stretch of a VM (this repository's 2-core
machines drift by 10-30 % between sittings) then slows both sides of a pair. This bench loads
the package twice, once with the decoder (``edgemtp/native/decoder.c``, ``v8.h``) and Python
side (``runtimes/native_backend.py``) of a git revision, once with the working tree's, and
times one T-row causal step of each at P cached rows, the order alternating, for each T:
the median of the pairs' ratios (working tree / base) and whether every pair gave the same
bits (argmax and top-4 log-probs).

    python bench/bench_native_ab.py --package out/pkg/smollm2-int4 --base HEAD~1 \\
        --sizes 1,2,4,8,16 --contexts 64 --pairs 20 --rounds 3 --out bench/results/native_ab.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from edgemtp import native  # noqa: E402
from edgemtp.errors import ConfigError  # noqa: E402
from edgemtp.runtimes.native_backend import NativeBackend  # noqa: E402
from bench_context import fill  # noqa: E402  (a session with P cached rows)

FILES = ("edgemtp/native/decoder.c", "edgemtp/native/v8.h", "runtimes/native_backend.py")


def ints(text: str, what: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        out = []
    if not out or min(out) < (1 if what == "sizes" else 0):
        raise ConfigError(f"--{what} takes a comma-separated list of positive integers, got "
                          f"{text!r}")
    return out


def checkout(rev: str, where: Path) -> Path:
    """The decoder's files at git revision ``rev`` under ``where``; its decoder.c's path."""
    for f in FILES:
        r = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{f}"], capture_output=True)
        if r.returncode:
            raise ConfigError(f"--base {rev!r}: git has no {f} there "
                              f"({r.stderr.decode().strip().splitlines()[:1]})")
        (where / Path(f).name).write_bytes(r.stdout)
    return where / "decoder.c"


def load(src: Path | None, package: str, threads: int, kv: str):
    """A backend on the decoder at ``src`` with that build's own Python side (None: the
    working tree's)."""
    native.DECODER_SOURCE = src or Path(native.__file__).with_name("decoder.c")
    native._DECODER.clear()
    native._DECODER_WHY.clear()
    cls = NativeBackend
    if src is not None:
        spec = importlib.util.spec_from_file_location("native_backend_base",
                                                      src.with_name("native_backend.py"))
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        cls = mod.NativeBackend
    return cls(package, threads=threads, kv_cache=kv, check=False)


def pairs(sessions, t: int, n: int) -> dict:
    """``n`` pairs of one t-row step of each build: their times and ratios, and whether every
    pair gave the same bits."""
    mask = np.tril(np.ones((t, t), dtype=bool))
    ratios, ms, same = [], ([], []), True
    for i in range(n + 3):  # three warm-up pairs
        took, outs = {}, {}
        for k in ((0, 1) if i % 2 == 0 else (1, 0)):
            s = sessions[k]
            p = s.cache_len
            t0 = time.perf_counter()
            outs[k] = s.forward(np.arange(t) + 5 + i % 50, p + np.arange(t), mask, None, topk=4)
            took[k] = time.perf_counter() - t0
        same &= bool(np.array_equal(outs[0].argmax, outs[1].argmax)
                     and np.array_equal(outs[0].topk_logprobs, outs[1].topk_logprobs))
        if i >= 3:
            ratios.append(took[1] / took[0])
            ms[0].append(took[0] * 1e3)
            ms[1].append(took[1] * 1e3)
    return {"ratios": ratios, "base_ms": ms[0], "new_ms": ms[1], "same_bits": same}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--package", required=True, help="an int4 package the native backend runs")
    ap.add_argument("--base", default="HEAD", help="git revision of the base build (HEAD)")
    ap.add_argument("--sizes", default="1,2,4,8,16", help="block rows T (1,2,4,8,16)")
    ap.add_argument("--contexts", default="64", help="cached rows P (64)")
    ap.add_argument("--pairs", type=int, default=20, help="pairs a (T, P) and round (20)")
    ap.add_argument("--rounds", type=int, default=3,
                    help="rounds over every (P, T) (3): a slow stretch of the machine then "
                         "falls on every size rather than on one")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv-cache", default="fp16", choices=("fp16", "int8"))
    ap.add_argument("--isa", default="native", choices=("native", "avx2", "portable"),
                    help="build both for this CPU (native), for AVX2 without AVX-512 (the "
                         "kernel of AMD Zen 2/3: run here, its speed only hints at theirs), "
                         "or as portable C")
    ap.add_argument("--out", help="write the rows as JSON here")
    a = ap.parse_args(argv)
    isa = {"native": ("-march=native",), "avx2": ("-mavx2", "-mfma", "-mf16c"),
           "portable": ()}[a.isa]
    native.DECODER_OPTIONS = (("-O3", *isa, "-fopenmp", "-ffp-contract=off"),)
    try:
        sizes, contexts = ints(a.sizes, "sizes"), ints(a.contexts, "contexts")
        if a.pairs < 1 or a.rounds < 1:
            raise ConfigError(f"--pairs and --rounds must be at least 1, got {a.pairs} and "
                              f"{a.rounds}")
        with tempfile.TemporaryDirectory() as tmp:
            base_src = checkout(a.base, Path(tmp))
            backends = [load(base_src, a.package, a.threads, a.kv_cache),
                        load(None, a.package, a.threads, a.kv_cache)]
    except (ConfigError, OSError) as e:
        print(f"bench_native_ab: {e}", file=sys.stderr)
        return 2
    sessions = {p: [fill(b, p) for b in backends] for p in contexts}
    runs: dict = {}
    for r in range(a.rounds):
        for p in contexts:
            for t in sizes:
                got = pairs(sessions[p], t, a.pairs)
                acc = runs.setdefault((p, t), {"ratios": [], "base_ms": [], "new_ms": [],
                                               "same_bits": True, "round_ratios": []})
                for k in ("ratios", "base_ms", "new_ms"):
                    acc[k] += got[k]
                acc["same_bits"] &= got["same_bits"]
                acc["round_ratios"].append(statistics.median(got["ratios"]))
        print(f"round {r + 1}/{a.rounds} done", flush=True)
    rows = []
    for (p, t), acc in runs.items():
        row = {"P": p, "T": t, "base_ms": statistics.median(acc["base_ms"]),
               "new_ms": statistics.median(acc["new_ms"]),
               "ratio": statistics.median(acc["ratios"]),
               "round_ratios": acc["round_ratios"], "same_bits": acc["same_bits"]}
        rows.append(row)
        lo, hi = min(acc["round_ratios"]), max(acc["round_ratios"])
        print(f"P={p:5d} T={t:3d}: base {row['base_ms']:7.2f} ms  new {row['new_ms']:7.2f} ms  "
              f"new/base {row['ratio']:.3f} (median of {len(acc['ratios'])} pairs; rounds "
              f"{lo:.3f}-{hi:.3f})  same bits: {row['same_bits']}", flush=True)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps({
            "base": a.base, "new": "working tree", "package": a.package,
            "threads": a.threads, "kv_cache": a.kv_cache, "pairs": a.pairs,
            "rounds": a.rounds, "isa": a.isa,
            "cpu": platform.processor() or platform.machine(),
            "kernel": native.decoder_kernel(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
