"""Where a native decoder step's time goes, thread by thread: each work-sharing loop's own time
and the wait at its barrier.

An instrumented copy of ``edgemtp/native/decoder.c`` is built for this run only (the shipped
source is not touched): every ``#pragma omp for`` gets ``nowait``, a time-stamp counter read
before and after the loop, and an explicit barrier whose wait is timed apart (the same
work-sharing and synchronisation as the implicit barrier it replaces, so the same bits).
Loops are grouped into phases: the grouped attention's scores, softmax and p @ V
(``attend_groups``, ``pv_groups8``), the per-head attention (``attend_rows``), the int4/int8
weight products (``q4_gemm``), and every other per-row loop (embedding, RoPE and cache
writes, norms, quantization, SiLU, the LM head's rows). The rest of a step (serial code
between loops) is decoder_forward's own time less the busiest thread's phases, and the step
less decoder_forward is the Python side. x86-64 only (``rdtsc``).

    python bench/bench_decoder_phases.py out/peers/edgemtp-int4 --kv-cache int8 \\
        --contexts 64,2048 --steps 200 --rounds 3
"""

from __future__ import annotations

import argparse
import ctypes
import json
import platform
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from edgemtp import native  # noqa: E402
from edgemtp.errors import ConfigError, EdgeMTPError  # noqa: E402

PHASES = ("scores", "softmax", "p @ V", "attention (rows path)", "weight products",
          "other row loops", "decoder_forward, entry to exit")
WHOLE = len(PHASES) - 1  # (its work slot, on thread 0; no loop is placed there)
NPH, MAXT = len(PHASES), 64

HEADER = f"""
#include <x86intrin.h>
static unsigned long long PH_T[{MAXT}][{2 * NPH}];
static long PH_STEPS;
unsigned long long decoder_phase_tsc(void) {{ return __rdtsc(); }}
/* per thread and phase: work, wait (time-stamp counts a step), then resets */
void decoder_phase_take(double *out, int threads) {{
    for (int t = 0; t < threads && t < {MAXT}; t++)
        for (int k = 0; k < {2 * NPH}; k++)
            out[t * {2 * NPH} + k] = PH_STEPS ? (double)PH_T[t][k] / PH_STEPS : 0.0;
    memset(PH_T, 0, sizeof PH_T);
    PH_STEPS = 0;
}}
"""


def _statement_end(src: str, i: int) -> int:
    """The index just past the C statement starting at ``i`` (a ``for`` with its body)."""
    j = src.index("(", i)
    depth = 0
    while True:  # the for's header
        depth += {"(": 1, ")": -1}.get(src[j], 0)
        j += 1
        if depth == 0:
            break
    while src[j].isspace():
        j += 1
    if src[j] == "{":
        depth = 0
        while True:
            depth += {"{": 1, "}": -1}.get(src[j], 0)
            j += 1
            if depth == 0:
                return j
    if src.startswith("for", j):  # a nested for without braces
        return _statement_end(src, j)
    depth = 0
    while True:  # one statement: to its ';' outside parentheses
        depth += {"(": 1, ")": -1}.get(src[j], 0)
        j += 1
        if src[j - 1] == ";" and depth == 0:
            return j


def _function_of(src: str, i: int) -> str:
    """The name of the C function whose body holds index ``i``."""
    names = list(re.finditer(r"^\w[^\n;{]*\b(\w+)\([^;{}]*\)\s*\{", src[:i], re.M))
    return names[-1].group(1) if names else ""


def instrument(src: str) -> tuple[str, dict[str, int]]:
    """The decoder's source with every work-sharing loop timed, and the loops per phase."""
    pragma = re.compile(r"^([ \t]*)#pragma omp for([^\n]*)\n", re.M)
    out, pos, counts = [], 0, {p: 0 for p in PHASES}
    for m in pragma.finditer(src):
        indent, clauses = m.group(1), m.group(2)
        start = m.end()
        end = _statement_end(src, start + len(src[start:]) - len(src[start:].lstrip()))
        fn, body = _function_of(src, m.start()), src[start:end]
        if fn == "attend_groups":
            ph = 0 if counts["scores"] == 0 else 1 if counts["softmax"] == 0 else 2
        elif fn == "pv_groups8":
            ph = 2
        elif fn == "q4_gemm":
            ph = 4
        elif fn == "decoder_forward":
            ph = 3 if "attend_rows(" in body else 5
        else:
            raise ConfigError(f"a work-sharing loop in {fn or '?'}() that this bench does not "
                              f"place in a phase: update bench/bench_decoder_phases.py")
        counts[PHASES[ph]] += 1
        n = len(out)
        out.append(src[pos:m.start()])
        if "nowait" in clauses:  # no barrier to time: the loop's own time only
            out.append(f"{indent}unsigned long long ph_t0_{n} = __rdtsc();\n"
                       f"{indent}#pragma omp for{clauses}\n{src[start:end]}\n"
                       f"{indent}PH_T[omp_get_thread_num()][{2 * ph}] += __rdtsc() - ph_t0_{n};")
            pos = end
            continue
        out.append(f"{indent}unsigned long long ph_t0_{n} = __rdtsc();\n"
                   f"{indent}#pragma omp for{clauses} nowait\n{src[start:end]}\n"
                   f"{indent}{{ unsigned long long ph_t1 = __rdtsc();\n"
                   f"#pragma omp barrier\n"
                   f"{indent}  PH_T[omp_get_thread_num()][{2 * ph}] += ph_t1 - ph_t0_{n};\n"
                   f"{indent}  PH_T[omp_get_thread_num()][{2 * ph + 1}] += __rdtsc() - ph_t1; }}")
        pos = end
    out.append(src[pos:])
    text = "".join(out)
    inc = '#include "v8.h"\n'
    entry = "int decoder_forward(const Model *M, Cache *C, const Call *X, float *work) {\n"
    if inc not in text or "    free(lead);\n    return 0;\n}" not in text or entry not in text:
        raise ConfigError("decoder.c no longer has the anchors this bench instruments "
                          "(its v8.h include, decoder_forward's end): update the bench")
    text = text.replace(inc, inc + HEADER, 1)
    text = text.replace("    free(lead);\n    return 0;\n}",
                        f"    free(lead);\n    PH_T[0][{2 * WHOLE}] += __rdtsc() - ph_f0;\n"
                        "    PH_STEPS++;\n    return 0;\n}", 1)
    text = text.replace(entry, entry + "    const unsigned long long ph_f0 = __rdtsc();\n", 1)
    return text, counts


def tsc_hz(lib) -> float:
    """The time-stamp counter's rate, against the monotonic clock over 0.2 s."""
    lib.decoder_phase_tsc.restype = ctypes.c_ulonglong
    t0, c0 = time.perf_counter_ns(), lib.decoder_phase_tsc()
    while time.perf_counter_ns() - t0 < 200_000_000:
        pass
    return (lib.decoder_phase_tsc() - c0) / ((time.perf_counter_ns() - t0) * 1e-9)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("package", help="an int4/int8 package the native backend runs")
    ap.add_argument("--kv-cache", choices=("fp16", "int8"), default="int8")
    ap.add_argument("--contexts", default="64,2048", help="cached rows P (64,2048)")
    ap.add_argument("--rows", type=int, default=1, help="block rows T of each step (1)")
    ap.add_argument("--steps", type=int, default=200, help="steps a round and context (200)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds over the contexts (3)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--grouped-from", type=int, default=None,
                    help="the shortest cache the grouped attention runs at (default: the "
                         "decoder's own, 512 rows for one-row steps)")
    ap.add_argument("--out", help="write the table's numbers as JSON here")
    args = ap.parse_args(argv)
    try:
        if platform.machine() not in ("x86_64", "AMD64"):
            raise ConfigError(f"this bench reads x86-64's time-stamp counter; this machine is "
                              f"{platform.machine()}")
        try:
            contexts = [int(x) for x in args.contexts.split(",")]
        except ValueError:
            contexts = []
        if not contexts or min(contexts) < 1 or args.rows < 1 or args.steps < 1 \
                or args.rounds < 1 or not 1 <= args.threads <= MAXT:
            raise ConfigError(f"--contexts takes comma-separated positive integers (got "
                              f"{args.contexts!r}); --rows, --steps and --rounds at least 1; "
                              f"--threads 1-{MAXT}")
        from edgemtp.runtimes.native_backend import NativeBackend
        from bench_context import fill

        src = Path(native.__file__).with_name("decoder.c")
        text, counts = instrument(src.read_text())
        tmp = Path(tempfile.mkdtemp(prefix="edgemtp-phases-"))
        (tmp / "decoder.c").write_text(text)
        shutil.copy(src.with_name("v8.h"), tmp / "v8.h")
        native.DECODER_SOURCE = tmp / "decoder.c"
        native._DECODER.clear(), native._DECODER_WHY.clear()
        backend = NativeBackend(args.package, threads=args.threads, kv_cache=args.kv_cache,
                                check=False)
    except (EdgeMTPError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    lib = backend.lib
    lib.decoder_phase_take.argtypes = [ctypes.c_void_p, ctypes.c_int]
    if args.grouped_from is not None:
        lib.decoder_set_group_min_p(args.grouped_from)
    hz = tsc_hz(lib)
    print("instrumented loops: " + ", ".join(f"{p} {n}" for p, n in counts.items() if n)
          + f"; time-stamp counter {hz / 1e9:.3f} GHz", flush=True)
    t = args.rows
    mask = np.tril(np.ones((t, t), dtype=bool))
    buf = np.zeros(MAXT * 2 * NPH)
    sessions = {p: fill(backend, p) for p in contexts}
    rows = {p: {"ms": [], "us": []} for p in contexts}
    for r in range(args.rounds):
        for p, s in sessions.items():
            for i in range(3):  # warm-up steps, not counted
                s.forward(np.arange(t) + 5 + i, s.cache_len + np.arange(t), mask, None, topk=4)
            lib.decoder_phase_take(buf.ctypes.data, args.threads)
            took = []
            for i in range(args.steps):
                t0 = time.perf_counter()
                s.forward(np.arange(t) + 5 + i % 50, s.cache_len + np.arange(t), mask, None,
                          topk=4)
                took.append(time.perf_counter() - t0)
            lib.decoder_phase_take(buf.ctypes.data, args.threads)
            rows[p]["ms"].append(statistics.fmean(took) * 1e3)  # (phases are means too)
            rows[p]["us"].append((buf[:args.threads * 2 * NPH] / hz * 1e6).tolist())
        print(f"round {r + 1}/{args.rounds} done", flush=True)
    print(f"\n{Path(args.package).name}, {args.kv_cache} cache, T = {t}, {args.threads} "
          f"threads; µs a step, the mean over {args.steps} steps, the median over "
          f"{args.rounds} rounds; "
          "each cell: thread 0 work + wait / thread 1 ...\n")
    print("| phase | " + " | ".join(f"P = {p}" for p in contexts) + " |")
    print("|---|" + "---:|" * len(contexts))
    table = {}
    for p in contexts:
        us = np.median(np.array(rows[p]["us"]), axis=0).reshape(args.threads, NPH, 2)
        table[p] = {"step_ms": statistics.median(rows[p]["ms"]), "us": us.tolist()}
    for k, name in enumerate(PHASES[:WHOLE]):
        if not any(np.asarray(table[p]["us"])[:, k].sum() for p in contexts):
            continue
        cells = [" / ".join(f"{w:.0f} + {x:.0f}" for w, x in np.asarray(table[p]["us"])[:, k])
                 for p in contexts]
        print(f"| {name} | " + " | ".join(cells) + " |")
    gaps, rest, whole = [], [], []
    for p in contexts:
        us = np.asarray(table[p]["us"])
        w = us[0, WHOLE, 0]
        busiest = us[:, :WHOLE].sum(axis=(1, 2)).max()
        whole.append(f"{w:.0f}")
        gaps.append(f"{w - busiest:.0f}")
        rest.append(f"{table[p]['step_ms'] * 1e3 - w:.0f}")
    print("| decoder_forward, entry to exit | " + " | ".join(whole) + " |")
    print("| in it, outside the loops above (the busiest thread) | " + " | ".join(gaps) + " |")
    print("| the step less decoder_forward (Python, ctypes) | " + " | ".join(rest) + " |")
    print("| step | " + " | ".join(f"{table[p]['step_ms'] * 1e3:.0f}"
                                          for p in contexts) + " |")
    if args.out:
        Path(args.out).write_text(json.dumps(
            {"package": args.package, "kv_cache": args.kv_cache, "rows": t,
             "threads": args.threads, "tsc_ghz": hz / 1e9, "phases": PHASES,
             "contexts": {str(p): table[p] for p in contexts}}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
