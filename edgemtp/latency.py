"""A device's forward latency as a function of block size, the number that decides whether a
budget pays."""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import platform
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from .errors import ConfigError

if TYPE_CHECKING:
    from .backend import Backend


@dataclass(frozen=True)
class LatencyCurve:
    """Forward latency (seconds) at block sizes ``T``, linearly interpolated between them,
    over ``context`` cached rows; ``long``: the same device's curve over more cached rows
    (``auto`` reads t(T) at the cache's length off the line through both).

    >>> c = LatencyCurve((1, 10), (0.001, 0.002))
    >>> round(c(4) * 1e3, 3), round(c(20) * 1e3, 3)
    (1.333, 3.111)
    """

    sizes: tuple[int, ...]
    seconds: tuple[float, ...]
    context: int = 64
    long: "LatencyCurve | None" = None

    def __post_init__(self) -> None:
        if len(self.sizes) != len(self.seconds) or not self.sizes:
            raise ConfigError("a latency curve needs one time per block size")
        if list(self.sizes) != sorted(set(self.sizes)) or min(self.seconds) <= 0:
            raise ConfigError("latency curve block sizes must increase and times be > 0")
        if self.context < 0:
            raise ConfigError(f"a latency curve's context must be >= 0 cached rows, got "
                              f"{self.context}")
        if self.long is not None and self.long.context <= self.context:
            raise ConfigError(f"a latency curve's long curve must be over more cached rows "
                              f"than its {self.context}, got {self.long.context}")

    def __call__(self, t: int) -> float:
        s, y = self.sizes, self.seconds
        if t > s[-1] and len(s) > 1:  # extrapolate the last segment's slope
            return y[-1] + (t - s[-1]) * (y[-1] - y[-2]) / (s[-1] - s[-2])
        return float(np.interp(t, s, y))

    def to_dict(self) -> dict:
        d = {"block_sizes": list(self.sizes), "seconds": list(self.seconds),
             "context": self.context}
        if self.long is not None:
            d["long"] = self.long.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "LatencyCurve":
        """A curve from :meth:`to_dict`'s form; ``context`` (64) and ``long`` may be absent
        (files written before they were kept)."""
        try:
            sizes = tuple(int(t) for t in d["block_sizes"])
            seconds = tuple(float(s) for s in d["seconds"])
        except (KeyError, TypeError, ValueError):
            raise ConfigError("a latency curve needs 'block_sizes' and 'seconds' lists") from None
        try:
            context = int(d.get("context", 64))
        except (TypeError, ValueError):
            raise ConfigError(f"a latency curve's context must be an integer, got "
                              f"{d.get('context')!r}") from None
        long = d.get("long")
        if long is not None and not isinstance(long, dict):
            raise ConfigError("a latency curve's 'long' must be a curve like itself")
        # its own checks say what else is wrong
        return cls(sizes, seconds, context, None if long is None else cls.from_dict(long))


def measure_latency(backend: Backend, sizes, context: int = 64, repeats: int = 7,
                    topk: int = 0) -> LatencyCurve:
    """Median forward latency per block size over a causal block after ``context`` cached
    tokens (clipped to the cache), on a session of its own, with a cache just large enough
    where the backend can size one (a second full cache is real memory on a GPU).

    The sizes are measured in interleaved rounds (every size once per round, the order
    reversed every other round; the first round warms up each shape and is dropped), so a
    load that comes and goes, or a first run that pays for allocations, moves every size
    alike rather than one size's whole sample: measured size by size, one slow stretch during
    ``T = 1`` had made ``t(1) = t(4)`` in a cached curve, and ``auto`` then took 4-position
    blocks for free (SmolLM2 int4 on 2 cores: 0.97x plain decoding instead of 1.13x)."""
    sizes = [int(t) for t in sizes]
    p = max(1, min(context, backend.max_context - max(sizes) - 1))
    sized = "rows" in inspect.signature(backend.session).parameters
    session = backend.session(rows=p + max(sizes) + 1) if sized else backend.session()
    ids = np.arange(p, dtype=np.int64) % backend.vocab_size
    session.forward(ids, np.arange(p), np.tril(np.ones((p, p), dtype=bool)), None)
    session.commit(np.arange(p))
    masks = np.zeros((1, backend.hidden_size), dtype=np.float32)
    blocks = {t: np.tril(np.ones((t, t), dtype=bool)) for t in sizes}
    runs: dict[int, list[float]] = {t: [] for t in sizes}
    for r in range(repeats + 1):
        for t in (sizes if r % 2 == 0 else sizes[::-1]):
            t0 = time.perf_counter()
            session.forward(np.arange(t) % backend.vocab_size, p + np.arange(t), blocks[t],
                            masks, topk=topk)
            runs[t].append(time.perf_counter() - t0)
    out = [float(np.median(runs[t][1:])) for t in sizes]  # round 0 warmed up each shape
    return LatencyCurve(tuple(sizes), tuple(non_decreasing(out)), p)


SHORT_CONTEXT = 64   # cached rows under a device's latency curve
LONG_CONTEXT = 512   # ... and under its second curve, which gives t(T)'s growth with the cache


PAIR_TOLERANCE = 0.03  # a long-context curve may read this much under the short one (noise)
PAIR_RETRIES = 2       # measurements again of a pair that says more cache costs less


def curve_pair(measure, backend: Backend, sizes) -> LatencyCurve:
    """``measure(context, again)``'s curve over SHORT_CONTEXT cached rows, with its curve
    over LONG_CONTEXT rows (fewer where the cache holds fewer, none under 4 x SHORT_CONTEXT)
    as ``long``: a block's attention grows with the cache, faster for more rows, and ``auto``
    reads t(T) at the cache's length off the line through both.

    A block never costs less over more cached rows, so a pair whose long curve reads under
    its short one at some size (beyond PAIR_TOLERANCE) was measured through a passing load:
    both are measured again (``again=True``: not read from a cache, and the new curve kept
    there), up to PAIR_RETRIES times, each size keeping its fastest reading (a load only
    slows a forward). Seen on a 2-core VM: a curve measured while another job finished read
    t(1) = 4.41 ms over 64 rows against 4.09 over 512 (3.19 when measured again), and
    ``auto`` at BC 30 then never ran a lookup chain (0.92-0.96x plain decoding, against
    0.98-1.00x with the curve measured again)."""
    short = measure(SHORT_CONTEXT, False)
    long_ctx = min(LONG_CONTEXT, backend.max_context - max(sizes) - 1)
    if long_ctx < 4 * SHORT_CONTEXT:
        return short
    long = measure(long_ctx, False)
    if long.context <= short.context:
        return short
    for _ in range(PAIR_RETRIES):
        if consistent(short, long):
            break
        short = fastest(short, measure(SHORT_CONTEXT, True))
        long = fastest(long, measure(long_ctx, True))
    return replace(short, long=long)


def consistent(short: LatencyCurve, long: LatencyCurve) -> bool:
    """Whether ``long`` (over more cached rows) costs at least what ``short`` does at every
    size both have, within PAIR_TOLERANCE.

    >>> a = LatencyCurve((1, 2), (0.004, 0.005), 64)
    >>> consistent(a, LatencyCurve((1, 2), (0.0041, 0.0052), 512))
    True
    >>> consistent(a, LatencyCurve((1, 2), (0.0037, 0.0052), 512))
    False
    """
    at = dict(zip(long.sizes, long.seconds))
    return all(at[t] >= (1.0 - PAIR_TOLERANCE) * s for t, s in zip(short.sizes, short.seconds)
               if t in at)


def fastest(a: LatencyCurve, b: LatencyCurve) -> LatencyCurve:
    """Each size's faster reading of two measurements of one curve (kept non-decreasing).

    >>> fastest(LatencyCurve((1, 2), (0.005, 0.006), 64),
    ...         LatencyCurve((1, 2), (0.004, 0.007), 64)).seconds
    (0.004, 0.006)
    """
    return replace(a, seconds=tuple(non_decreasing([min(x, y) for x, y in
                                                    zip(a.seconds, b.seconds)])))


def non_decreasing(y) -> list[float]:
    """The closest non-decreasing sequence in least squares (pool adjacent violators): a
    bigger block never costs less, and timing noise that says otherwise is averaged with its
    neighbours, not carried up the curve as a running maximum would.

    >>> non_decreasing([3.0, 1.0, 2.0, 5.0])
    [2.0, 2.0, 2.0, 5.0]
    >>> non_decreasing([1.0, 2.0, 2.0])
    [1.0, 2.0, 2.0]
    """
    blocks: list[list[float]] = []  # [sum, count]
    for v in y:
        blocks.append([float(v), 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            s, n = blocks.pop()
            blocks[-1][0] += s
            blocks[-1][1] += n
    return [s / n for s, n in blocks for _ in range(int(n))]


# -- a measured curve kept on disk ---------------------------------------------------------------

MEASURE_METHOD = "interleaved rounds"  # part of a cached curve's key
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
                   topk: int = 0, again: bool = False) -> LatencyCurve:
    """:func:`measure_latency`, kept in ``cache_dir()/latency`` for the next process that
    runs the same weights on the same backend, device, threads and host (``auto``'s curve:
    measuring it costs ~1-2 s at the start of a command on a 2-core CPU). A backend without
    an ``identity()`` (weights it cannot name), ``EDGEMTP_LATENCY_CACHE=0``, or an unwritable
    cache folder: measured every time. ``again``: measured even where a curve is kept (which
    the new one replaces). The curve only steers which plans ``auto`` picks, never the
    tokens."""
    from . import __version__

    switch = os.environ.get("EDGEMTP_LATENCY_CACHE", "1").strip()
    if switch not in ("0", "1"):
        raise ConfigError(f"EDGEMTP_LATENCY_CACHE must be 1 (keep measured latency curves) or "
                          f"0 (measure every time), got {switch!r}")
    ident = getattr(backend, "identity", None)
    ident = ident() if callable(ident) else None
    if ident is None or switch == "0":
        return measure_latency(backend, sizes, context, repeats, topk)
    # MEASURE_METHOD: curves measured size by size (before interleaved rounds) are measured
    # again, not read back
    key = json.dumps([__version__, MEASURE_METHOD, _host(), ident, list(sizes), context,
                      repeats, topk])
    try:
        path = cache_dir() / "latency" / f"{hashlib.sha1(key.encode()).hexdigest()}.json"
    except RuntimeError:  # no home folder to put a cache in (Path.home() without $HOME)
        return measure_latency(backend, sizes, context, repeats, topk)
    if not again:
        try:
            entry = json.loads(path.read_text())
            # (a curve kept without its cache length, from before curves carried one: measured
            # again, as its length may have been clipped to the cache)
            if (entry.get("key") == key and "context" in entry["curve"]
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
