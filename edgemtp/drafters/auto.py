"""The ``auto`` drafter: probe only when it pays on this device, by block complexity.

Per step it picks, among plain decoding (T = 1), a mask-only step (root + 1 mask, T = 2, which
still emits one token but keeps the acceptance estimate fresh), k = 1 probing plans with
``m`` draft nodes (T = 2(m + 1) <= budget) and prompt-lookup chains of ``L`` tokens
(T = L + 1 <= budget), the one with the most expected tokens per second::

    probe:  (1 + P(the next token is among the mask's top m)) / t(2(m + 1))
    lookup: (1 + sum_{d <= L} P(the chain's first d tokens are right)) / t(L + 1)

``t(T)`` is the device's forward latency curve (measured once per loaded model, or read from
an ``edgemtp profile`` file) plus the host time of a step, measured while generating as the
time between steps minus ``t(T)``, for plain and speculative steps apart (a speculative step
binds new shapes and drafts; it is charged at least a plain step's host time). The measured
host time also absorbs an error of the curve at the sizes actually used. The acceptance
comes from the ranks at which the true tokens appeared among the mask token's candidates so
far, and from how far every lookup chain (used or not) agreed with the tokens that followed,
per matched n-gram length and weighted to the recent past (a code prompt's chains fare worse
than a story's).
Where speculation cannot pay (a mid-size model on a 2-core CPU) it decodes plainly, so it
is never much slower than plain decoding.
"""
from __future__ import annotations

import time
from functools import lru_cache
from typing import TYPE_CHECKING

import numpy as np

from ..backend import Backend, StepOut
from ..budgets import chain_length, probe_draft_nodes
from ..embeddings import MaskEmbeddings
from ..errors import ConfigError
from ..latency import measure_latency
from ..plans import Plan
from ..tree import prune, static_tree
from .ngram_index import MAX_NGRAM, NgramIndex, chain_plan
from .prompt_lookup import lookup

if TYPE_CHECKING:
    from ..config import GenerationConfig

PLAIN = Plan.root_only()
MASK_ONLY = Plan((-1,), 1)  # root + its mask: one token, and candidates for the next step


@lru_cache(maxsize=16)
def _probe_plans(m_max: int) -> dict[int, Plan]:
    # k = 1 plans with m draft nodes, compiled once per process
    return {m: Plan.top1((m,), 1) for m in range(1, max(m_max, 0) + 1)}


class AutoDrafter:
    """Picks the plan with the best expected tokens/s each step (see module docstring)."""

    mask_tokens = 1
    explore_every = 8  # in plain mode, a mask-only step this often keeps acceptance known
    decay = 0.98  # weight of a lookup chain's record per newer chain of its n-gram length
    host_ema = 0.1     # weight of the newest step in the host-time estimates
    refresh = 8        # steps between recomputations of the lookup-chain rate table

    def __init__(self, backend: Backend, config: GenerationConfig,
                 memory: dict | None = None) -> None:
        memory = {} if memory is None else memory
        m_max = probe_draft_nodes(config.bc)  # k = 1: BC = 2 * (1 + m)
        self.plans = _probe_plans(m_max)
        if backend.vocab_size < m_max + 2:
            raise ConfigError(f"a plan of {m_max + 1} nodes needs a vocabulary of at least "
                              f"{m_max + 2} tokens, the model has {backend.vocab_size}")
        self.width = m_max + 1  # candidates a probing step needs
        # a sparse grid (interpolated between): powers of two up to the budget, and the budget
        top = max([MASK_ONLY.bc, *(p.bc for p in self.plans.values())])
        sizes = sorted({1, top, *(2 ** i for i in range(1, top.bit_length()) if 2 ** i <= top)})
        key = ("latency", tuple(sizes))
        if config.latency is not None:
            self.latency = config.latency
        else:
            if key not in memory:
                memory[key] = measure_latency(backend, sizes, topk=self.width)
            self.latency = memory[key]
        # ranks at which true tokens appeared among the mask's pruned candidates; starts from
        # a pessimistic prior (a few misses), so an unknown model decodes plainly first
        self.rank_hits = memory.setdefault(("auto-ranks", self.width),
                                           {"hits": np.zeros(self.width), "steps": 4.0})
        self.topk = self.width  # what the next forward must return (0 on plain steps)
        self.prune = config.prune
        self._lat = np.array([self.latency(max(t, 1)) for t in range(max(config.bc, 4) + 1)])
        # mask-only steps only where probing could ever pay: even a sure accept doubles the
        # tokens of a step at best, so a 4-position block must cost under twice a 1-position one
        self.explore = config.bc >= 4 and 2.0 * self.latency(1) > self.latency(4)
        self.embeds = MaskEmbeddings(1, config.mask_init, config.ema, backend.embed,
                                     stats=backend.embedding_stats()
                                     if config.mask_init == "sample" else None,
                                     vector=None if config.mask_vector is None
                                     else np.asarray(config.mask_vector), seed=config.seed)
        self._cand: tuple[np.ndarray, np.ndarray] | None = None
        self.n_chain = chain_length(config.bc)
        # per matched n-gram length n (row n - 1): chains tried / right up to depth d
        self.chain_hits = memory.setdefault(("auto-chain", self.n_chain), {
            "hits": np.zeros((MAX_NGRAM, self.n_chain)),
            "tries": np.full((MAX_NGRAM, self.n_chain), 4.0)})
        # host seconds per step beyond t(T): [plain steps, speculative steps]
        self.host = memory.setdefault("auto-host", [0.0, -1.0])  # -1: not measured yet
        self._t_step: float | None = None
        self._last_t = 1
        self.index = NgramIndex()
        self._chains: list[tuple[int, int, list[int]]] = []  # (position, n, chain) to score
        self._chain: list[int] = []
        self._chain_n = 0
        self._chain_table: list | None = None
        self._steps = 0
        self._root = -1
        self._plain_steps = 0
        self.choices: dict[int, int] = {}  # plan BC -> steps, for reports

    def start(self, prompt_ids: np.ndarray) -> None:
        self.embeds.start(prompt_ids)
        self.index.extend(prompt_ids)
        self._t_step = None

    def choose(self) -> Plan:
        lat = self._lat  # t(T) for T = 0..budget, looked up once
        # whole step costs: the forward plus the host time measured around it (a speculative
        # step's is at least a plain one's: it also binds new shapes and drafts)
        plain_s, spec_s = self.host[0], max(self.host)
        best, best_rate = PLAIN, 1.0 / (lat[1] + plain_s)
        if self._chain:  # prompt lookup: the chain prefix with the best rate (T = n + 1)
            if self._steps % self.refresh == 0 or self._chain_table is None:
                self._chain_table = self._chain_rates(spec_s)
            i, rate = self._chain_table[self._chain_n - 1][len(self._chain) - 1]
            if rate > best_rate:
                best, best_rate = chain_plan(i), rate
        if self._cand is not None and self.plans:  # probing with m nodes (T = 2(m + 1))
            m = np.arange(1, len(self.plans) + 1)
            rates = (1.0 + np.cumsum(self.rank_hits["hits"])[m - 1] / self.rank_hits["steps"]
                     ) / (lat[2 * (m + 1)] + spec_s)
            i = int(rates.argmax())
            if rates[i] > best_rate:
                best, best_rate = self.plans[i + 1], rates[i]
        elif best is PLAIN:  # nothing to probe from: now and then a mask-only step
            self._plain_steps += 1
            if self.explore and self._plain_steps % self.explore_every == 0:
                best = MASK_ONLY
        return best

    def _chain_rates(self, spec_s: float) -> list[list[tuple[int, float]]]:
        """Per matched n-gram length and chain length L: the best prefix length and its
        expected tokens/s (a table, so most steps choose without numpy)."""
        h, lat, n = self.chain_hits, self._lat, self.n_chain
        rates = (1.0 + np.cumsum(h["hits"] / h["tries"], axis=1)) / (lat[2:n + 2] + spec_s)
        table = []
        for row in rates.tolist():
            best, out = (0, 0.0), []
            for i, r in enumerate(row, start=1):
                if r > best[1]:
                    best = (i, r)
                out.append(best)
            table.append(out)
        return table

    def propose(self, root: int) -> tuple[Plan, np.ndarray]:
        self._steps += 1
        now = time.perf_counter()
        if self._t_step is not None:  # the last step's host time beyond its forward
            i = int(self._last_t > 1)
            extra = now - self._t_step - self._lat[min(self._last_t, len(self._lat) - 1)]
            # clipped: a pause (GC, a busy consumer) must not swing the estimate
            extra = min(max(extra, 0.0), 2.0 * max(self.host) + self._lat[1])
            h = self.host[i]
            self.host[i] = extra if h < 0 else h + self.host_ema * (extra - h)
        self._t_step = now
        # the index holds the context up to the root: a chain guesses what follows it
        self._chain_n, self._chain = lookup(self.index, self.n_chain)
        if self._chain:
            self._chains.append((len(self.index.tokens), self._chain_n, self._chain))
        plan = self.choose()
        self._last_t = plan.bc
        self.topk = self.width if plan.k else 0
        self.choices[plan.bc] = self.choices.get(plan.bc, 0) + 1
        self._root = root
        if plan.k == 0 and plan.n_nodes > 1:  # a lookup chain
            return plan, np.array([root, *self._chain[:plan.n_nodes - 1]], dtype=np.int64)
        if plan.n_nodes == 1:
            return plan, np.array([root], dtype=np.int64)
        ids, lp = self._cand
        return plan, static_tree(plan, root, ids, lp, self.prune)

    def mask_embeds(self) -> np.ndarray | None:
        # only a step that carries masks reads them (and folds in the EMA)
        return self.embeds.value if self.topk else None

    def observe(self, out: StepOut, mask_rows: np.ndarray, new_tokens: list[int],
                path_rows: np.ndarray) -> None:
        if self._cand is not None and self._root >= 0:  # where was the true next token?
            ids, _ = prune(self._cand[0][0], self._cand[1][0], self._root, self.width - 1,
                           self.prune)
            rank = np.flatnonzero(ids == new_tokens[0])
            self.rank_hits["steps"] += 1.0
            if rank.size:
                self.rank_hits["hits"][rank[0]] += 1.0
        if len(mask_rows):
            self._cand = out.topk_ids[mask_rows], out.topk_logprobs[mask_rows]
        else:
            self._cand = None
        self.embeds.update(new_tokens)
        self.index.extend(new_tokens)
        self._score_chains()

    def _score_chains(self) -> None:
        # how far each chain agreed with what followed, once that is known (used or not)
        ctx, h, waiting = self.index.tokens, self.chain_hits, []
        for start, n, chain in self._chains:
            seen = ctx[start:start + len(chain)]
            agree = next((i for i, (a, b) in enumerate(zip(chain, seen)) if a != b), len(seen))
            if agree == len(seen) and len(seen) < len(chain):
                waiting.append((start, n, chain))  # all right so far: wait for more tokens
                continue
            tries, hits = h["tries"][n - 1], h["hits"][n - 1]
            tries *= self.decay
            hits *= self.decay
            tries[:len(chain)] += 1.0
            hits[:agree] += 1.0
        self._chains = waiting
