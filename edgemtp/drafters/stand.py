"""STAND (Song et al. 2025; paper App. F) as a drafter: lookup trees from the model's own
stored distributions."""

from __future__ import annotations

from time import perf_counter
from typing import TYPE_CHECKING

import numpy as np

from ..backend import Backend, StepOut
from ..budgets import MAX_DEPTH
from ..plans import Plan
from .base import fitted_topk
from .ngram_index import MAX_NGRAM, MIN_SCORE, ContextModel, tree_plan
from .tree_cost import tree_cost

if TYPE_CHECKING:
    from ..config import GenerationConfig

STAND_TOPK = 10        # stored candidates per committed position


class StandDrafter:
    """STAND (Song et al. 2025; paper App. F): a token tree from the model's own stored
    distributions. A node's children are the model's guesses after the most recent earlier
    occurrences of the node's context suffix (its path included; :class:`ContextModel`);
    the tree grows best-first by cumulative probability to at most ``bc`` nodes and depth 10
    (no masks: ``BC = N``). At a small budget it is a chain, as PLD's, drawn from what the
    model itself predicted after each match rather than from the text that followed it.
    """

    mask_tokens = 0
    topk = STAND_TOPK

    def __init__(self, backend: Backend, config: GenerationConfig, memory: dict | None = None,
                 max_ngram: int = MAX_NGRAM, depth: int = MAX_DEPTH) -> None:
        self.topk = fitted_topk(backend, STAND_TOPK)  # (a package may export fewer)
        self.max_nodes, self.depth, self.max_ngram = config.bc, depth, max_ngram
        self.context = ContextModel(self.topk, max_ngram, native=True)
        # tree_cost="measured": kept in the caller's memory, so it carries across generations
        self.cost = tree_cost(config, memory, ("stand-tree-cost", config.bc))
        self._drafted: tuple[float, int] | None = None  # our step: its start, its rows

    def start(self, prompt_ids: np.ndarray) -> None:
        self.context = ContextModel(self.topk, self.max_ngram, native=True)
        self.context.extend(prompt_ids)

    def propose(self, root: int) -> tuple[Plan, np.ndarray]:
        t0 = perf_counter()
        parents, tokens, n = self.context.stand_layout(
            root, self.max_nodes, self.depth,
            MIN_SCORE if self.cost is None else self.cost.min_score(MIN_SCORE))
        self._drafted = t0, n
        return tree_plan(parents), tokens

    def mask_embeds(self) -> None:
        return None

    def observe(self, out: StepOut, mask_rows: np.ndarray, new_tokens: list[int],
                path_rows: np.ndarray) -> None:
        if self._drafted is not None and self.cost is not None:  # a step of our tree
            self.cost.record(self._drafted[1], perf_counter() - self._drafted[0],
                             len(new_tokens))
        self._drafted = None  # (a step someone else planned, auto's, only feeds the context)
        self.context.extend(new_tokens, out.topk_ids, out.topk_logprobs, path_rows)
