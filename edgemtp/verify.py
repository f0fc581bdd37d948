"""Lossless verification: walk the tree from the root, following the model's own target.

The target at a node is the model's next token there: the argmax (greedy), or a fresh
sample from the processed distribution (sampling). If a child carries the target, accept it
and go on; otherwise stop. The last target is the bonus token and becomes the next root.
Because every target is drawn from exactly the distribution plain decoding would use at that
prefix, the output is token-identical (greedy) or identically distributed (sampling).
"""

from __future__ import annotations

import numpy as np

from .backend import StepOut
from .config import GenerationConfig
from .plans import Plan


def process_logits(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """Probabilities after temperature, top-k and top-p, in the order ``transformers`` applies
    them (a token tied with the k-th largest is kept, as ``TopKLogitsWarper`` does).

    >>> process_logits(np.log(np.array([0.5, 0.3, 0.2])), 1.0, 0, 0.7).round(3).tolist()
    [0.625, 0.375, 0.0]
    >>> process_logits(np.array([1.0, 3.0, 2.0]), 1e-310, 0, 1.0).tolist()  # (as greedy)
    [0.0, 1.0, 0.0]
    """
    x = logits.astype(np.float64)
    # the largest logit subtracted first: a tiny temperature then sends the others to -inf,
    # not every logit to +-inf (NaN probabilities, the last token drawn every time)
    with np.errstate(over="ignore"):
        x = (x - x.max()) / temperature
    if 0 < top_k < x.size:
        kth = np.partition(x, -top_k)[-top_k]
        x = np.where(x < kth, -np.inf, x)
    p = np.exp(x - x.max())
    p /= p.sum()
    if top_p < 1.0:
        order = np.argsort(p, kind="stable")           # ascending, like TopPLogitsWarper
        drop = np.cumsum(p[order]) <= 1.0 - top_p
        drop[-1] = False                               # always keep the best token
        p[order[drop]] = 0.0
        p /= p.sum()
    return p


class Verifier:
    """Greedy or sampling target selection, and the tree walk."""

    def __init__(self, config: GenerationConfig) -> None:
        self.sample = config.do_sample
        self.t, self.top_k, self.top_p = config.temperature, config.top_k, config.top_p
        self.rng = np.random.default_rng(config.seed)

    def target(self, out: StepOut, row: int) -> int:
        if not self.sample:
            return int(out.argmax[row])
        p = process_logits(out.logits[row], self.t, self.top_k, self.top_p)
        c = np.cumsum(p)
        return int(min(np.searchsorted(c, self.rng.random() * c[-1], side="right"), c.size - 1))

    def walk(self, plan: Plan, tokens: np.ndarray, out: StepOut) -> tuple[list[int], int]:
        """Accepted nodes (root excluded) and the bonus token."""
        node, accepted = 0, []
        if not self.sample:  # the same walk on plain ints: no numpy scalar per comparison
            argmax, tokens, children = out.argmax, np.asarray(tokens).tolist(), plan.children
            while True:
                target = int(argmax[node])
                for child in children[node]:
                    if tokens[child] == target:
                        break
                else:
                    return accepted, target
                accepted.append(child)
                node = child
        while True:
            target = self.target(out, node)
            child = next((c for c in plan.children[node] if tokens[c] == target), None)
            if child is None:
                return accepted, target
            accepted.append(child)
            node = child
