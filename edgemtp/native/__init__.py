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
_LIB: list = []  # [ctypes.CDLL or None] once tried
_WHY: list[str] = []


def _compiler() -> str | None:
    for cc in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cc and shutil.which(cc):
            return cc
    return None


def _build() -> Path:
    src = SOURCE.read_bytes()
    tag = hashlib.sha256(src + platform.machine().encode() + sys.platform.encode()).hexdigest()[:16]
    from ..latency import cache_dir  # ($EDGEMTP_CACHE, else ~/.cache/edgemtp)
    out = cache_dir() / f"ngram-{tag}.so"
    if out.exists():
        return out
    cc = _compiler()
    if cc is None:
        raise OSError("no C compiler (cc, gcc or clang) on PATH")
    out.parent.mkdir(parents=True, exist_ok=True)
    # build beside the target, then rename: concurrent first uses never load a partial file
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        r = subprocess.run([cc, "-O2", "-shared", "-fPIC", "-std=c99", "-o", tmp, str(SOURCE)],
                           capture_output=True, text=True, timeout=120)
        if r.returncode:
            raise OSError(f"{cc} failed: {(r.stderr or r.stdout).strip().splitlines()[:1]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    p, i32, i64, f64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_double
    lib.ctx_new.restype, lib.ctx_new.argtypes = p, [i32]
    lib.ctx_free.restype, lib.ctx_free.argtypes = None, [p]
    lib.ctx_extend.restype, lib.ctx_extend.argtypes = i32, [p, p, i64]
    lib.ctx_grow.restype = i32
    lib.ctx_grow.argtypes = [p, p, i64, p, p, i64, i32, i64, p, i32, i32, i32, f64, p, p, p, p]
    lib.ctx_layout.restype = i32
    lib.ctx_layout.argtypes = [i32, p, p, p, p, p, p]
    lib.ctx_grow_hybrid.restype = i32
    lib.ctx_grow_hybrid.argtypes = [p, p, f64] + [p] * 13
    lib.ctx_place_masks.restype = i32
    lib.ctx_place_masks.argtypes = [i32, p, p, i32, i32, f64, f64, p, p]
    lib.ctx_learn_hybrid.restype = i32
    lib.ctx_learn_hybrid.argtypes = [p, p, p, i32, p, p, p, i32] + [p] * 8
    lib.pool_new.restype, lib.pool_new.argtypes = p, [i32, i32]
    lib.pool_free.restype, lib.pool_free.argtypes = None, [p]
    lib.pool_add_many.restype, lib.pool_add_many.argtypes = i32, [p, p, i64]
    return lib


def lib() -> ctypes.CDLL | None:
    """The compiled library, or None (no compiler, a failed build, or ``EDGEMTP_NATIVE=0``);
    :func:`why_not` says why."""
    if os.environ.get("EDGEMTP_NATIVE", "1") == "0":
        return None
    if not _LIB:
        try:
            _LIB.append(_declare(ctypes.CDLL(str(_build()))))
        except (OSError, subprocess.SubprocessError) as e:
            _LIB.append(None)
            _WHY.append(str(e).splitlines()[0] if str(e) else type(e).__name__)
    return _LIB[0]


def why_not() -> str | None:
    """Why :func:`lib` is None (None where it loaded or was not tried)."""
    if os.environ.get("EDGEMTP_NATIVE", "1") == "0":
        return "EDGEMTP_NATIVE=0"
    return _WHY[0] if _WHY else None
