"""Forward latency against the cache length: t(T) at P cached rows for one or more packages
on onnxruntime (CPU by default), interleaved (every round measures each package at every P,
alternating the order), medians over rounds. It shows how a step's cost grows with the
context: with the attention alone it should grow slowly; a copy of the cache per step makes
it grow faster.

    python bench/bench_context.py --package old=out/pkg/a --package new=out/pkg/b \\
        [--contexts 64,512,2000] [--sizes 1,10] [--rounds 5] [--threads 2]

A path may name its backend: ``--package c=native:out/pkg/int4`` (default onnxruntime;
``native-q8:PATH`` for the native decoder with its int8 cache, ``--kv-cache int8``), or
be llama.cpp on a GGUF (llama-cpp-python, a bench extra): ``--package
llama=llama.cpp:../shared/models/SmolLM2-135M-Instruct-GGUF/SmolLM2-135M-Instruct.Q4_1.gguf``
(its default cache, float16 K/V; ``llama.cpp-q8:PATH`` for its 8-bit cache with flash
attention), a step being ``eval`` of T chained tokens after P.

Writes bench/results/context_<model>_cpu.{md,json} (``--out`` to change).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from edgemtp.backend import backend_class

ROOT = Path(__file__).resolve().parents[1]


class LlamaCpp:
    """llama.cpp through llama-cpp-python as a backend of this bench: one context per
    session, a step evaluates T chained tokens after the P cached ones and is then dropped
    from its cache, so every step sees P rows."""

    name = "llama.cpp"

    def __init__(self, path: str, threads: int, q8: bool = False) -> None:
        try:
            import llama_cpp
        except ImportError:
            raise SystemExit("llama.cpp:PATH needs llama-cpp-python (pip install "
                             "llama-cpp-python; it builds from source, ~15 min)") from None
        if not Path(path).is_file():
            raise SystemExit(f"llama.cpp:PATH takes a GGUF file; {path!r} is not one")
        self.llama_cpp, self.path, self.threads = llama_cpp, path, threads
        self.kw = (dict(type_k=llama_cpp.GGML_TYPE_Q8_0, type_v=llama_cpp.GGML_TYPE_Q8_0,
                        flash_attn=True) if q8 else {})
        self.max_context = 4096
        if q8:
            self.name = "llama.cpp q8_0 cache"

    def session(self):
        return _LlamaSession(self.llama_cpp.Llama(
            model_path=self.path, n_ctx=self.max_context, n_threads=self.threads,
            n_threads_batch=self.threads, verbose=False, **self.kw))


class _LlamaSession:
    def __init__(self, llm) -> None:
        self.llm, self.cache_len = llm, 0

    def forward(self, ids, positions, mask, embeds, topk: int = 0):
        llm = self.llm
        llm.n_tokens = self.cache_len  # the last step's tokens out of the cache
        llm._ctx.kv_cache_seq_rm(-1, self.cache_len, -1)
        llm.eval([int(i) for i in ids])

    def commit(self, rows) -> None:
        self.cache_len += len(rows)


KINDS = ("native", "native-q8", "onnxruntime", "llama.cpp", "llama.cpp-q8")


def spec_kind(spec: str) -> str:
    kind = spec.split(":", 1)[0]
    return "llama.cpp" if kind.startswith("llama.cpp") else kind if kind in KINDS else \
        "onnxruntime"


def make_spec_path(spec: str) -> str:
    return spec.split(":", 1)[1] if spec.split(":", 1)[0] in KINDS else spec


def make_backend(spec: str, threads: int):
    """``[kind:]path`` -> (backend, path)."""
    kind, path = "onnxruntime", spec
    if spec.split(":", 1)[0] in KINDS:
        kind, path = spec.split(":", 1)
    if kind.startswith("llama.cpp"):
        return LlamaCpp(path, threads, q8=kind.endswith("q8")), path
    if kind == "native-q8":
        return backend_class("native")(path, threads=threads, kv_cache="int8"), path
    return backend_class(kind)(path, threads=threads), path


def fill(backend, p: int):
    """A session with ``p`` cached rows (prefilled in chunks of 256)."""
    s = backend.session()
    ids = np.arange(p) % 1000 + 100
    for c in range(0, p, 256):
        blk = ids[c:c + 256]
        t = len(blk)
        s.forward(blk, c + np.arange(t), np.tril(np.ones((t, t), dtype=bool)), None)
        s.commit(np.arange(t))
    return s


def one_step(session, t: int, shift: int = 0) -> float:
    """Seconds of one t-row causal step after the session's cached rows (not committed)."""
    p = session.cache_len
    mask = np.tril(np.ones((t, t), dtype=bool))
    t0 = time.perf_counter()
    session.forward(np.arange(t) + 5 + shift, p + np.arange(t), mask, None, topk=4)
    return time.perf_counter() - t0


def step_ms(session, t: int, repeats: int) -> float:
    runs = [one_step(session, t) for _ in range(repeats + 2)]  # two warm-ups
    return statistics.median(runs[2:]) * 1e3


def pair_ratios(short, long, t: int, n: int) -> list[float]:
    """``n`` pairs of one t-row step at each of two cache lengths, back to back (the order
    alternating): each pair's long / short. A slow stretch of the machine then slows both
    sides of a pair, where medians of separate runs each take their own stretch."""
    out = []
    for i in range(n + 2):  # two warm-up pairs
        ms = {}
        for key, s in ((("s", short), ("l", long)) if i % 2 == 0 else (("l", long), ("s", short))):
            ms[key] = one_step(s, t, i % 50)
        if i >= 2:
            out.append(ms["l"] / ms["s"])
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--package", action="append", required=True, metavar="NAME=PATH")
    ap.add_argument("--contexts", default="64,512,2000")
    ap.add_argument("--sizes", default="1,10")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--isolate", action="store_true",
                    help="each package in a process of its own, a fresh one per round (the "
                         "order alternating), so runtimes cannot slow each other (with "
                         "llama.cpp's contexts in the same process the native steps measured "
                         "slower, for a reason not established)")
    ap.add_argument("--pairs", type=int, default=0,
                    help="also this many pairs of steps per round at the shortest and longest "
                         "context, back to back in one process: the ratio of the two as the "
                         "median over pairs, which a slow stretch of the machine moves far "
                         "less than it moves separate medians")
    ap.add_argument("--round-json", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    from edgemtp.errors import ConfigError
    if a.pairs < 0:
        raise ConfigError(f"--pairs takes a number of pairs, 0 or more; got {a.pairs}")
    bad = [p for p in a.package if "=" not in p or not p.split("=", 1)[0]]
    if bad:
        raise ConfigError(f"--package takes NAME=[KIND:]PATH (e.g. q8=native-q8:out/pkg), "
                          f"got {bad[0]!r}")
    packages = dict(p.split("=", 1) for p in a.package)
    try:
        contexts = [int(c) for c in a.contexts.split(",")]
        sizes = [int(t) for t in a.sizes.split(",")]
    except ValueError:
        raise ConfigError(f"--contexts and --sizes take comma-separated whole numbers, got "
                          f"{a.contexts!r} and {a.sizes!r}") from None
    if min(contexts) < 0 or min(sizes) < 1:
        raise ConfigError(f"--contexts takes cache lengths of 0 or more and --sizes block "
                          f"rows of 1 or more, got {a.contexts!r} and {a.sizes!r}")
    pairs: dict[str, dict[int, list[float]]] = {}  # package -> t -> long / short, per pair
    if a.isolate:
        times, names = {}, list(packages)
        for r in range(a.rounds):
            for n in (names if r % 2 == 0 else names[::-1]):
                cmd = [sys.executable, __file__, "--package", f"{n}={packages[n]}",
                       "--contexts", a.contexts, "--sizes", a.sizes, "--rounds", "1",
                       "--repeats", str(a.repeats), "--threads", str(a.threads),
                       "--pairs", str(a.pairs), "--round-json"]
                got = json.loads(subprocess.run(cmd, check=True, capture_output=True,
                                                text=True).stdout.splitlines()[-1])
                for t, rs in got.pop("pairs", {}).items():
                    pairs.setdefault(n, {}).setdefault(int(t), []).extend(rs)
                for p, by_t in got.items():
                    for t, ms in by_t.items():
                        times.setdefault((n, int(p)), {}).setdefault(int(t), []).append(ms)
            print(f"round {r + 1}/{a.rounds} done", flush=True)
        packages = {n: make_spec_path(spec) for n, spec in packages.items()}
        kinds = ", ".join(sorted({spec_kind(spec) for spec in dict(
            p.split("=", 1) for p in a.package).values()}))
    else:
        backends = {}
        for n, spec in list(packages.items()):
            backends[n], packages[n] = make_backend(spec, a.threads)
        sessions = {(n, p): fill(b, p) for n, b in backends.items() for p in contexts
                    if p + max(sizes) <= b.max_context}
        times = {key: {t: [] for t in sizes} for key in sessions}
        order = list(sessions)
        for r in range(a.rounds):
            for key in (order if r % 2 == 0 else order[::-1]):
                for t in sizes:
                    times[key][t].append(step_ms(sessions[key], t, a.repeats))
            for n in backends:
                lo, hi = sessions.get((n, contexts[0])), sessions.get((n, contexts[-1]))
                if a.pairs and lo is not None and hi is not None:
                    for t in sizes:
                        pairs.setdefault(n, {}).setdefault(t, []).extend(
                            pair_ratios(lo, hi, t, a.pairs))
            if not a.round_json:
                print(f"round {r + 1}/{a.rounds} done", flush=True)
        if a.round_json:
            got = {str(p): {str(t): v[0] for t, v in ts.items()} for (_, p), ts in times.items()}
            if pairs:
                got["pairs"] = {str(t): v for t, v in next(iter(pairs.values())).items()}
            print(json.dumps(got))
            return 0
        kinds = ", ".join(sorted({b.name for b in backends.values()}))
    med = {f"{n}@P={p}": {t: statistics.median(v) for t, v in ts.items()}
           for (n, p), ts in times.items()}
    model = Path(next(iter(packages.values()))).stem
    rows = ["| package | " + " | ".join(f"t({t}) at P={p}, ms" for t in sizes for p in contexts)
            + " | " + " | ".join(f"t({t}) P={contexts[-1]} / P={contexts[0]}" for t in sizes)
            + "".join(f" | t({t}) P={contexts[-1]} / P={contexts[0]}, paired" for t in sizes
                      if pairs) + " |",
            "|---|" + "---:|" * (len(sizes) * len(contexts) + len(sizes) * (2 if pairs else 1))]
    for n in packages:
        cells = [f"{med[f'{n}@P={p}'][t]:.2f}" if f"{n}@P={p}" in med else "–"
                 for t in sizes for p in contexts]
        ratios = [f"{med[f'{n}@P={contexts[-1]}'][t] / med[f'{n}@P={contexts[0]}'][t]:.2f}"
                  if f"{n}@P={contexts[-1]}" in med else "–" for t in sizes]
        if pairs:
            ratios += [f"{statistics.median(pairs[n][t]):.3f}" if pairs.get(n, {}).get(t)
                       else "–" for t in sizes]
        rows.append(f"| {n} | " + " | ".join(cells + ratios) + " |")
    text = (f"# Step latency against the cache length, {model}, {kinds} on the CPU\n\n"
            f"{a.threads} threads; medians over {a.rounds} interleaved rounds of "
            f"{a.repeats} steps each" + (", each package in a fresh process per round"
                                          if a.isolate else "") + "."
            + (f" `paired`: the median over {a.pairs} pairs a round of one step at each of "
               f"the two lengths back to back in one process, each pair's ratio." if pairs
               else "") + "\n\n"
            + "\n".join(rows) + "\n")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"context_{model}_cpu"
    stem.with_suffix(".md").write_text(text)
    stem.with_suffix(".json").write_text(json.dumps(dict(packages=packages, rounds=a.rounds,
                                                         threads=a.threads, ms=med,
                                                         paired={n: {t: statistics.median(v)
                                                                     for t, v in by_t.items()}
                                                                 for n, by_t in pairs.items()}),
                                                    indent=1))
    print(text)
    return 0


if __name__ == "__main__":
    from edgemtp.errors import EdgeMTPError

    try:
        raise SystemExit(main())
    except EdgeMTPError as e:  # a bad package or option: one line, as the CLI says it
        print(f"bench_context: {e}", file=sys.stderr)
        raise SystemExit(2) from None
