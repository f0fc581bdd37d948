"""Native (C) helpers for the drafters' host work, compiled on first use.

A small model's decode step on a GPU is ~0.5 ms, and Python drafting was a fifth to a half of
it (STAND's tree ~90 µs, the hybrid's ~200 µs a step on an H200 host). ``ngram.c`` grows
STAND's tree as :func:`edgemtp.drafters.ngram_index.grow` does, and the hybrid drafter's
(three candidate sources, hit-rate scores) as
:class:`~edgemtp.drafters.hybrid.HybridDrafter` does, bit for bit. It is compiled once per
source version with the machine's C compiler (``cc -O2 -shared``; ``$CC`` where set) into the
user cache (``$EDGEMTP_CACHE``, else ``$XDG_CACHE_HOME/edgemtp`` or ``~/.cache/edgemtp``) and
loaded with :mod:`ctypes`. Where there is no compiler, or ``EDGEMTP_NATIVE=0``, :func:`lib` is
None and the Python code runs: the same trees, slower.

``heads.c`` runs a package's learned heads (:mod:`edgemtp.runtimes.heads`) for one hidden
state: the same function as the heads graph, without onnxruntime's per-node cost, which is
most of a heads run on a small model. It is built the same way (``-O3``; on x86-64 Linux with
GCC an AVX2/FMA clone picked at load); :func:`heads_lib` is None where it cannot be, and the
heads graph runs in onnxruntime.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SOURCE = Path(__file__).with_name("ngram.c")
HEADS_SOURCE = Path(__file__).with_name("heads.c")
DECODER_SOURCE = Path(__file__).with_name("decoder.c")
_LIB: list = []  # [ctypes.CDLL or None] once tried
_WHY: list[str] = []
_HEADS: list = []
# this machine's vector units where the compiler knows them, else the portable build
HEADS_OPTIONS = (("-O3", "-march=native", "-ffp-contract=fast"), ("-O3",))
_HEADS_WHY: list[str] = []
# the native backend's decoder: OpenMP threads where the compiler has them; no contraction of
# multiply-adds (a vector lane and a scalar tail must compute the same, see decoder.c)
DECODER_OPTIONS = (("-O3", "-march=native", "-fopenmp", "-ffp-contract=off"),
                   ("-O3", "-fopenmp", "-ffp-contract=off"), ("-O3", "-ffp-contract=off"))
_DECODER: list = []
_DECODER_WHY: list[str] = []


def address(a) -> int:
    """The address of a C-contiguous numpy array's first element: ``a.ctypes.data`` without
    numpy's wrapper object (~0.5 against ~1.4 us warm, and several times that right after a
    forward pass; a step asks for several), where ``a`` is writable and not empty.

    >>> import numpy as np
    >>> a = np.zeros(3); address(a) == a.ctypes.data == address(a[:0])
    True
    """
    return ctypes.addressof(ctypes.c_char.from_buffer(a)) if a.flags.writeable and a.size \
        else a.ctypes.data


def _compiler() -> str | None:
    for cc in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cc and shutil.which(cc):
            return cc
    return None


def _cpu() -> bytes:
    """What ``-march=native`` builds for: the CPU's model and feature flags (a cache shared by
    machines of different CPUs keeps one library per CPU)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return "\n".join(sorted({x for x in lines if x.split(":")[0].strip() in
                                  ("model name", "flags", "Features", "CPU part")})).encode()
    except OSError:
        return platform.processor().encode()


KEEP = 4  # libraries kept per source file in the cache (other versions, other CPUs)
# seconds one compile may take: decoder.c at -O3 takes ~20-40 s on a 2-core x86 VM, 100-190 s
# under a sanitizer on a loaded one (qa10b: 120 s failed it), longer on a small Arm board
BUILD_TIMEOUT = 900


def _prune(new: Path) -> None:
    """Drop all but the newest :data:`KEEP` builds of ``new``'s source from the cache (one is
    made per source version and, for ``-march=native``, per CPU; nothing else removes them).
    A process that still runs an older one keeps its mapping."""
    old = sorted((f for f in new.parent.glob(f"{new.name.split('-')[0]}-*.so") if f != new),
                 key=lambda f: f.stat().st_mtime, reverse=True)
    for f in old[KEEP - 1:]:
        try:
            f.unlink()
        except OSError:
            pass


def _build(source: Path = SOURCE, options: tuple[tuple[str, ...], ...] = (("-O2",),)) -> Path:
    """``source`` compiled into the cache with the first of ``options`` the compiler takes."""
    # the source and the headers it may include from its folder (v8.h): a changed header
    # is a new library
    src = source.read_bytes() + b"".join(h.read_bytes()
                                         for h in sorted(source.parent.glob("*.h")))
    from ..latency import cache_dir  # ($EDGEMTP_CACHE, else ~/.cache/edgemtp)
    cc = None
    errors = []
    for opts in options:
        key = src + platform.machine().encode() + sys.platform.encode()
        if opts != ("-O2",):  # (the n-gram library's tag from before options were part of it)
            key += " ".join(opts).encode() + (_cpu() if "-march=native" in opts else b"")
        if os.environ.get("CC"):  # another compiler, another library (qa10b: an ASan build
            key += b"|CC=" + os.environ["CC"].encode()  # was reused by a later plain cc)
        out = cache_dir() / f"{source.stem}-{hashlib.sha256(key).hexdigest()[:16]}.so"
        if out.exists():
            return out
        cc = cc or _compiler()
        if cc is None:
            raise OSError("no C compiler (cc, gcc or clang) on PATH")
        out.parent.mkdir(parents=True, exist_ok=True)
        # build beside the target, then rename: concurrent first uses never load a partial file
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
        os.close(fd)
        try:
            r = subprocess.run([cc, *opts, "-shared", "-fPIC", "-std=c99", "-o", tmp,
                                str(source)], capture_output=True, text=True,
                               timeout=BUILD_TIMEOUT)
            if not r.returncode:
                os.replace(tmp, out)
                _prune(out)
                return out
            errors.append(f"{cc} failed: {(r.stderr or r.stdout).strip().splitlines()[:1]}")
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    raise OSError(errors[-1])


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    p, i32, i64, f64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_double
    lib.ctx_new.restype, lib.ctx_new.argtypes = p, [i32]
    lib.ctx_free.restype, lib.ctx_free.argtypes = None, [p]
    lib.ctx_extend.restype, lib.ctx_extend.argtypes = i32, [p, p, i64]
    lib.ctx_grow.restype = i32
    lib.ctx_grow.argtypes = [p, p, i64, p, p, i64, i32, i64, p, i32, i32, i32, f64, p, p, p, p]
    lib.ctx_layout.restype = i32
    lib.ctx_layout.argtypes = [i32, p, p, p, p, p, i32, i32, i64, p, p, p]
    lib.ctx_grow_hybrid.restype = i32
    lib.ctx_grow_hybrid.argtypes = [p, p, f64] + [p] * 13
    lib.ctx_place_masks.restype = i32
    lib.ctx_place_masks.argtypes = [i32, p, p, i32, i32, f64, f64, p, p]
    lib.ctx_learn_hybrid.restype = i32
    lib.ctx_learn_hybrid.argtypes = [p, p, p, i32, p, p, p, i32] + [p] * 8
    lib.pool_new.restype, lib.pool_new.argtypes = p, [i32, i32]
    lib.pool_free.restype, lib.pool_free.argtypes = None, [p]
    lib.pool_add_many.restype, lib.pool_add_many.argtypes = i32, [p, p, i64]
    lib.plan_tree.restype, lib.plan_tree.argtypes = i32, [p, i32, i32, i32, p, p, p]
    return lib


def lib() -> ctypes.CDLL | None:
    """The compiled library, or None (no compiler, a failed build, or ``EDGEMTP_NATIVE=0``);
    :func:`why_not` says why."""
    if os.environ.get("EDGEMTP_NATIVE", "1") == "0":
        return None
    return _load(_LIB, _WHY, lambda: _declare(ctypes.CDLL(str(_build()))))


def _load(slot: list, why: list, make) -> ctypes.CDLL | None:
    # once per process: the library, or None with the first line of why it is not
    if not slot:
        try:
            slot.append(make())
        except (OSError, subprocess.SubprocessError) as e:
            slot.append(None)
            why.append(str(e).splitlines()[0] if str(e) else type(e).__name__)
    return slot[0]


def _why(why: list) -> str | None:
    if os.environ.get("EDGEMTP_NATIVE", "1") == "0":
        return "EDGEMTP_NATIVE=0"
    return why[0] if why else None


def why_not() -> str | None:
    """Why :func:`lib` is None (None where it loaded or was not tried)."""
    return _why(_WHY)


def _declare_heads(lib: ctypes.CDLL) -> ctypes.CDLL:
    lib.heads_run.restype = ctypes.c_int
    lib.heads_run.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    return lib


class HeadsCall(ctypes.Structure):
    """``heads.c``'s ``HeadsCall``: one heads run's shapes and buffers."""
    _fields_ = ([(n, ctypes.c_int32) for n in ("kind", "d", "w", "heads", "c", "m", "k",
                                               "by_id")]
                + [(n, ctypes.c_void_p) for n in ("h", "emb", "w1", "b1", "scale", "wh", "wd",
                                                  "bd", "table", "we", "bu", "lm", "work", "u0",
                                                  "ids", "lp")])


def heads_lib() -> ctypes.CDLL | None:
    """The learned heads' C kernels (``heads.c``), or None (no compiler, a failed build, or
    ``EDGEMTP_NATIVE=0``); :func:`heads_why_not` says why."""
    if os.environ.get("EDGEMTP_NATIVE", "1") == "0":
        return None
    return _load(_HEADS, _HEADS_WHY, lambda: _declare_heads(
        ctypes.CDLL(str(_build(HEADS_SOURCE, HEADS_OPTIONS)))))


def heads_why_not() -> str | None:
    """Why :func:`heads_lib` is None (None where it loaded or was not tried)."""
    return _why(_HEADS_WHY)


def _declare_decoder(lib: ctypes.CDLL) -> ctypes.CDLL:
    p, i32 = ctypes.c_void_p, ctypes.c_int
    lib.decoder_scratch.restype, lib.decoder_scratch.argtypes = ctypes.c_size_t, [p, i32, i32, i32]
    lib.decoder_forward.restype, lib.decoder_forward.argtypes = i32, [p, p, p, p]
    lib.decoder_commit.restype, lib.decoder_commit.argtypes = None, [p, p, p, i32]
    lib.decoder_threads.restype, lib.decoder_threads.argtypes = i32, []
    lib.decoder_kernel.restype, lib.decoder_kernel.argtypes = i32, []
    lib.decoder_set_group_min_p.restype, lib.decoder_set_group_min_p.argtypes = None, [i32]
    if hasattr(lib, "decoder_set_split_rows"):  # (bench_native_ab loads older builds too)
        lib.decoder_set_split_rows.restype = None
        lib.decoder_set_split_rows.argtypes = [i32]
    return lib


def decoder_lib() -> ctypes.CDLL | None:
    """The native backend's decoder (``decoder.c``), or None (no compiler, a failed build, or
    ``EDGEMTP_NATIVE=0``); :func:`decoder_why_not` says why."""
    if os.environ.get("EDGEMTP_NATIVE", "1") == "0":
        return None
    return _load(_DECODER, _DECODER_WHY, lambda: _declare_decoder(
        ctypes.CDLL(str(_build(DECODER_SOURCE, DECODER_OPTIONS)))))


def decoder_build() -> str:
    """The decoder library's file name: its source's and build options' hash (a latency curve
    measured with one build is not another's; see ``NativeBackend.identity``)."""
    return _build(DECODER_SOURCE, DECODER_OPTIONS).name


def decoder_kernel() -> str | None:
    """The native decoder's int4 kernel in words, None where it does not load."""
    lib = decoder_lib()
    if lib is None:
        return None
    kind = {1: "AVX-512 VNNI", 2: "Arm dot-product", 3: "AVX2"}.get(lib.decoder_kernel(),
                                                                 "portable C")
    return (f"{kind} int4 kernel, "
            f"{lib.decoder_threads()} OpenMP thread(s)")


def decoder_why_not() -> str | None:
    """Why :func:`decoder_lib` is None (None where it loaded or was not tried)."""
    return _why(_DECODER_WHY)
