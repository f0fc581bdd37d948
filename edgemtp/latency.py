"""A device's forward latency as a function of block size, the number that decides whether a
budget pays."""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from .errors import ConfigError

if TYPE_CHECKING:
    from .backend import Backend


@dataclass(frozen=True)
class LatencyCurve:
    """Forward latency (seconds) at block sizes ``T``, linearly interpolated between them.

    >>> c = LatencyCurve((1, 10), (0.001, 0.002))
    >>> round(c(4) * 1e3, 3), round(c(20) * 1e3, 3)
    (1.333, 3.111)
    """

    sizes: tuple[int, ...]
    seconds: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.sizes) != len(self.seconds) or not self.sizes:
            raise ConfigError("a latency curve needs one time per block size")
        if list(self.sizes) != sorted(set(self.sizes)) or min(self.seconds) <= 0:
            raise ConfigError("latency curve block sizes must increase and times be > 0")

    def __call__(self, t: int) -> float:
        s, y = self.sizes, self.seconds
        if t > s[-1] and len(s) > 1:  # extrapolate the last segment's slope
            return y[-1] + (t - s[-1]) * (y[-1] - y[-2]) / (s[-1] - s[-2])
        return float(np.interp(t, s, y))

    def to_dict(self) -> dict:
        return {"block_sizes": list(self.sizes), "seconds": list(self.seconds)}

    @classmethod
    def from_dict(cls, d: dict) -> "LatencyCurve":
        try:
            sizes = tuple(int(t) for t in d["block_sizes"])
            seconds = tuple(float(s) for s in d["seconds"])
        except (KeyError, TypeError, ValueError):
            raise ConfigError("a latency curve needs 'block_sizes' and 'seconds' lists") from None
        return cls(sizes, seconds)  # its own checks say what else is wrong


def measure_latency(backend: Backend, sizes, context: int = 64, repeats: int = 7,
                    topk: int = 0) -> LatencyCurve:
    """Median forward latency per block size over a causal block after ``context`` cached
    tokens (clipped to the cache), on a session of its own, with a cache just large enough
    where the backend can size one (a second full cache is real memory on a GPU)."""
    p = max(1, min(context, backend.max_context - max(sizes) - 1))
    sized = "rows" in inspect.signature(backend.session).parameters
    session = backend.session(rows=p + max(sizes) + 1) if sized else backend.session()
    ids = np.arange(p, dtype=np.int64) % backend.vocab_size
    session.forward(ids, np.arange(p), np.tril(np.ones((p, p), dtype=bool)), None)
    session.commit(np.arange(p))
    masks = np.zeros((1, backend.hidden_size), dtype=np.float32)
    out = []
    for t in sizes:
        block = np.tril(np.ones((t, t), dtype=bool))
        runs = []
        for _ in range(repeats + 1):  # the first run warms up allocations
            t0 = time.perf_counter()
            session.forward(np.arange(t) % backend.vocab_size, p + np.arange(t), block, masks,
                            topk=topk)
            runs.append(time.perf_counter() - t0)
        out.append(float(np.median(runs[1:])))
    # a bigger block never costs less: smooth timing noise into a non-decreasing curve
    return LatencyCurve(tuple(sizes), tuple(np.maximum.accumulate(out).tolist()))


# -- a measured curve kept on disk ---------------------------------------------------------------

LATENCY_CACHE_DAYS = 7  # a curve older than this is measured again (drivers, load, clocks move)


def cache_dir() -> Path:
    """``$EDGEMTP_CACHE`` or ``$XDG_CACHE_HOME/edgemtp`` (``~/.cache/edgemtp``)."""
    if os.environ.get("EDGEMTP_CACHE"):
        return Path(os.environ["EDGEMTP_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "edgemtp"


def _host() -> str:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")),
                       cpu)
    except OSError:
        pass
    return f"{platform.node()}|{platform.machine()}|{cpu}|{os.cpu_count()}"


def cached_latency(backend: Backend, sizes, context: int = 64, repeats: int = 7,
                   topk: int = 0) -> LatencyCurve:
    """:func:`measure_latency`, kept in ``cache_dir()/latency`` for the next process that
    runs the same weights on the same backend, device, threads and host (``auto``'s curve:
    measuring it costs ~1-2 s at the start of a command on a 2-core CPU). A backend without
    an ``identity()`` (weights it cannot name), ``EDGEMTP_LATENCY_CACHE=0``, or an unwritable
    cache folder: measured every time. The curve only steers which plans ``auto`` picks,
    never the tokens."""
    from . import __version__

    switch = os.environ.get("EDGEMTP_LATENCY_CACHE", "1").strip()
    if switch not in ("0", "1"):
        raise ConfigError(f"EDGEMTP_LATENCY_CACHE must be 1 (keep measured latency curves) or "
                          f"0 (measure every time), got {switch!r}")
    ident = getattr(backend, "identity", None)
    ident = ident() if callable(ident) else None
    if ident is None or switch == "0":
        return measure_latency(backend, sizes, context, repeats, topk)
    key = json.dumps([__version__, _host(), ident, list(sizes), context, repeats, topk])
    try:
        path = cache_dir() / "latency" / f"{hashlib.sha1(key.encode()).hexdigest()}.json"
    except RuntimeError:  # no home folder to put a cache in (Path.home() without $HOME)
        return measure_latency(backend, sizes, context, repeats, topk)
    try:
        entry = json.loads(path.read_text())
        if (entry.get("key") == key
                and time.time() - float(entry["measured"]) < LATENCY_CACHE_DAYS * 86400):
            return LatencyCurve.from_dict(entry["curve"])
    except (OSError, ValueError, KeyError, TypeError, ConfigError):
        pass  # absent, unreadable or stale: measure
    curve = measure_latency(backend, sizes, context, repeats, topk)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"key": key, "measured": time.time(),
                                   "curve": curve.to_dict()}))
        os.replace(tmp, path)  # whole or absent, for a process reading it at the same time
    except OSError:
        pass
    return curve
