"""Mask-token embeddings (paper §3.1): initialisation and the per-token EMA update."""

from __future__ import annotations

from typing import Callable

import numpy as np

from .errors import ConfigError

EmbedFn = Callable[[np.ndarray], np.ndarray]  # token ids [n] -> embeddings [n, d]


class MaskEmbeddings:
    """The ``[k, d]`` mask embeddings of one generation.

    ``init``: ``mean`` of the prompt's embeddings (default), ``sample`` from N(mu, sigma^2)
    of the embedding table (per-dimension sigma, seeded), ``last-k`` prompt embeddings, or a
    user ``vector``. After each committed token ``m <- m + ema * (e - m)`` (0 disables).

    >>> table = np.eye(3, dtype=np.float32)
    >>> m = MaskEmbeddings(k=2, init="mean", ema=0.5, embed=lambda ids: table[ids])
    >>> m.start(np.array([0, 1]))
    >>> m.value.tolist()
    [[0.5, 0.5, 0.0], [0.5, 0.5, 0.0]]
    >>> m.update([2]); m.value[0].tolist()
    [0.25, 0.25, 0.5]
    """

    def __init__(self, k: int, init: str, ema: float, embed: EmbedFn,
                 stats: tuple[np.ndarray, np.ndarray] | None = None,
                 vector: np.ndarray | None = None, seed: int = 0) -> None:
        self.k, self.init, self.ema, self.embed = k, init, ema, embed
        self.stats, self.vector, self.seed = stats, vector, seed
        self._value: np.ndarray | None = None
        self._pending: list[int] = []  # committed tokens not yet folded in (see update)

    @property
    def value(self) -> np.ndarray | None:
        """The current ``[k, d]`` embeddings, with every committed token folded in."""
        if self._pending:
            self._fold()
        return self._value

    def start(self, prompt_ids: np.ndarray) -> None:
        # value: [k, d] float32, re-initialised for every prompt
        e = self.embed(np.asarray(prompt_ids, dtype=np.int64)).astype(np.float32)
        d = e.shape[1]
        if self.init == "mean":
            v = np.repeat(e.mean(axis=0, keepdims=True), self.k, axis=0)
        elif self.init == "last-k":
            idx = np.arange(len(e) - self.k, len(e)).clip(min=0)
            v = e[idx]
        elif self.init == "sample":
            if self.stats is None:
                raise ConfigError("mask_init='sample' needs the embedding table's mean and std")
            mu, sigma = self.stats
            rng = np.random.default_rng(self.seed)
            v = mu[None, :] + sigma[None, :] * rng.standard_normal((self.k, d))
        else:
            vec = np.asarray(self.vector, dtype=np.float32)
            if vec.size not in (d, self.k * d):
                raise ConfigError(f"mask vector has {vec.size} values; expected the hidden "
                                  f"size {d} (or k*d = {self.k * d})")
            v = np.broadcast_to(vec.reshape(-1, d), (self.k, d))
        self._value = np.array(v, dtype=np.float32, copy=True)  # ours to update in place
        self._scratch = np.empty_like(self._value)
        self._pending = []

    def update(self, token_ids) -> None:
        """EMA towards each newly committed token, in order. Folded in lazily, when the value
        is next read, so steps that carry no mask tokens pay nothing."""
        if self.ema != 0.0:
            self._pending.extend(int(t) for t in token_ids)

    def _fold(self) -> None:
        e = self.embed(np.asarray(self._pending, dtype=np.int64))
        n, lam = len(e), self.ema
        if n <= 4:  # the usual step: a few tokens, cheaper one by one, in place
            v, step = self._value, self._scratch
            for row in e:
                np.subtract(row, v, out=step)
                step *= lam
                v += step
        else:  # after plain steps: m_n = (1-l)^n m + sum_i l (1-l)^(n-i) e_i in one go
            w = lam * (1.0 - lam) ** np.arange(n - 1, -1, -1)
            folded = (1.0 - lam) ** n * self._value + (w @ e.astype(np.float64))[None, :]
            self._value[...] = folded
        self._pending = []
