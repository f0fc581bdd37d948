"""Prompt lookup decoding (Saxena 2023; paper App. F) as a drafter."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ..backend import Backend, StepOut
from ..budgets import chain_length
from ..plans import Plan
from .ngram_index import MAX_NGRAM, NgramIndex, chain_plan

if TYPE_CHECKING:
    from ..config import GenerationConfig

PLD_OCCURRENCES = 8    # most recent matches PLD considers for the longest continuation


class PromptLookupDrafter:
    """Prompt lookup decoding (Saxena 2023; paper App. F): match the context's last n-gram
    (``n = 3, 2, 1``) against earlier context and propose the tokens that followed it, as a
    chain of at most ``min(bc - 1, 10)`` nodes. No match: a plain decoding step (BC = 1).

    Of the most recent occurrences, the most recent with the longest continuation wins: the
    most recent is the freshest guess, but one that runs into the end of the context
    proposes fewer tokens than an older one does.
    """

    mask_tokens = 0
    topk = 0

    def __init__(self, backend: Backend, config: GenerationConfig, memory: dict | None = None,
                 max_ngram: int = MAX_NGRAM) -> None:
        self.n_draft = chain_length(config.bc)
        self.max_ngram = max_ngram
        self.index = NgramIndex(max_ngram)

    def start(self, prompt_ids: np.ndarray) -> None:
        self.index = NgramIndex(self.max_ngram)
        self.index.extend(prompt_ids)

    def propose(self, root: int) -> tuple[Plan, np.ndarray]:
        chain = lookup_chain(self.index, self.n_draft)
        return chain_plan(len(chain)), np.array([root, *chain], dtype=np.int64)

    def mask_embeds(self) -> None:
        return None

    def observe(self, out: StepOut, mask_rows: np.ndarray, new_tokens: list[int],
                path_rows: np.ndarray) -> None:
        self.index.extend(new_tokens)


def lookup_chain(index: NgramIndex, n: int) -> list[int]:
    """Up to ``n`` tokens that followed an earlier match of the context's suffix.

    >>> ix = NgramIndex(3); ix.extend([1, 2, 3, 4, 1, 2, 3, 9, 1, 2])
    >>> lookup_chain(ix, 4)    # "1 2" was last followed by "3 9 1 2"
    [3, 9, 1, 2]
    """
    return lookup(index, n)[1]


def lookup(index: NgramIndex, n: int) -> tuple[int, list[int]]:
    """:func:`lookup_chain` with the length of the n-gram it matched (0: no chain).

    >>> ix = NgramIndex(3); ix.extend([1, 2, 3, 4, 1, 2, 3, 9, 1, 2])
    >>> lookup(ix, 2)
    (2, [3, 9])
    """
    if n <= 0:
        return 0, []
    matched, ends = index.match(index.tokens)
    best: list[int] = []
    for p in reversed(ends[-PLD_OCCURRENCES:]):
        cont = index.tokens[p + 1:p + 1 + n]
        if len(cont) > len(best):
            best = cont
            if len(best) == n:
                break
    return (matched if best else 0), best
