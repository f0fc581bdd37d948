"""A device's forward latency as a function of block size, the number that decides whether a
budget pays."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import ConfigError


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
            return cls(tuple(int(t) for t in d["block_sizes"]),
                       tuple(float(s) for s in d["seconds"]))
        except (KeyError, TypeError, ValueError):
            raise ConfigError("a latency curve needs 'block_sizes' and 'seconds' lists") from None
