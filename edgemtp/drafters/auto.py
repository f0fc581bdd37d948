"""The ``auto`` drafter: probe only when it pays on this device, by block complexity.

Per step it picks, among plain decoding (T = 1), a mask-only step (root + 1 mask, T = 2, which
still emits one token but keeps the acceptance estimate fresh), k = 1 probing plans with
``m`` draft nodes (T = 2(m + 1) <= budget) and prompt-lookup chains of ``L`` tokens
(T = L + 1 <= budget) and whole drafters (below), the one with the most expected tokens
per second::

    probe:  (1 + P(the next token is among the mask's top m)) / t(2(m + 1))
    lookup: (1 + sum_{d <= L} P(the chain's first d tokens are right)) / t(L + 1)

``t(T)`` is the device's forward latency curve at the current cache length (measured once
per loaded model over 64 and over 512 cached rows and read off the line through both, as
attention grows with the cache; or both read from an ``edgemtp profile`` file), its rise
``t(T) - t(1)`` scaled by a compute slope: the slope of a weighted line fit of what lookup
and probing blocks really cost beyond a plain step against the curve's rise for their size
(a core's compute can slow for minutes while its memory reads do not), plus the
host time of a step, measured while generating as the
time between steps minus ``t(T)``, for plain and speculative steps apart (a speculative step
binds new shapes and drafts; it is charged at least a plain step's host time). The measured
host time also absorbs an error of the curve at the sizes actually used, either way: it may
be negative where the curve overstates a step (down to half of ``t(T)``). The acceptance
comes from the ranks at which the true tokens appeared among the mask token's candidates so
far, and from how far every lookup chain (used or not) agreed with the tokens that followed,
per matched n-gram length and weighted to the recent past (a code prompt's chains fare worse
than a story's).
Two more kinds of candidate come from whole drafters:

- **STAND trees** (``T = r`` for the first ``r`` nodes of a best-first lookup tree grown
  from the model's stored distributions): ``1 + sum_{i < r} P(node i is on the true path)``,
  each node's chance read from the hit rate of its cumulative-score bin. Every tree grown
  is scored against the tokens that followed (used or not), as lookup chains are.
- **hybrid, LADE and k = 2 probing**, each at a narrow and a wide budget
  (:func:`~edgemtp.budgets.auto_budgets`), run as they are when picked:
  ``E[tokens per step] / t(E[T])`` from running means of what their steps committed and the
  blocks they used, per feature of their next draft (LADE: does the pool hold guesses for
  the root; hybrid: mask candidates, a lookup match). A drafter not run lately is tried
  now and then while an optimistic estimate of it could still beat the best choice; a try
  that commits fewer tokens per second than plain decoding would have doubles the wait
  before that drafter's next try (up to ``try_backoff`` times ``try_every`` steps, counted
  over the model's generations), one that does not resets it. All tries together spend at
  most ``try_share`` of the decoding time: what a try cost beyond the plain steps that would
  have committed its tokens (a winning try earns that back) is summed over the model's
  generations, and no drafter is tried while the sum exceeds that share of the time decoded
  so far. Mask-only steps back off the
  same way while the probing they make possible does not win the step after (unless a
  2-position block costs what one does).
  Every one of them observes every step, so its n-gram pool, stored distributions and mask
  embeddings stay current when another plan runs.

- **learned heads** (``heads=KIND``, a package with ``edgemtp train-heads``): the heads
  drafter at the same two budgets, weighed like the whole drafters above on any device (its
  upkeep is one heads run per awake step); the hybrid then takes the heads' candidates in
  place of mask tokens. A dormant heads drafter woken for a step first runs the heads on the
  last step's hidden state.

Where speculation cannot pay (a mid-size model on a 2-core CPU) it decodes plainly, so it
is never much slower than plain decoding. Verification is the engine's one lossless walk,
whoever drafted.
"""
from __future__ import annotations

import threading
import time
from bisect import bisect_left, bisect_right
from dataclasses import replace
from functools import lru_cache
from math import sqrt
from typing import TYPE_CHECKING

import numpy as np

from ..backend import Backend, StepOut
from ..budgets import MAX_DEPTH, auto_budgets, chain_length, probe_draft_nodes
from ..embeddings import MaskEmbeddings
from ..errors import ConfigError
from ..latency import cached_latency, curve_pair
from ..plans import Plan
from ..tree import prune, static_tree
from .base import fitted_topk
from .heads import HeadsDrafter, HeadsHybridDrafter
from .hybrid import HybridDrafter
from .lookahead import LookaheadDrafter
from .ngram_index import (MAX_NGRAM, P_EDGES, ContextModel, GrownTree, chain_plan, layout,
                          tree_plan)
from .probe import ProbeDrafter
from .prompt_lookup import lookup

if TYPE_CHECKING:
    from ..config import GenerationConfig

PLAIN = Plan.root_only()
OWN_KINDS = frozenset(("plain", "mask", "pld", "probe", "stand"))  # auto's own step kinds
MASK_ONLY = Plan((-1,), 1)  # root + its mask: one token, and candidates for the next step
MASK_ONLY_2 = Plan((-1,), 2)  # the same with 2 masks: candidates for a k = 2 plan
WHOLE_MIN_T1 = 0.004  # seconds: t(1) below which whole drafters and STAND trees are not weighed
STAND_NODES = 16  # widest STAND tree auto grows (its best prefix is what runs)
CONTEXT_STEP = 32    # cache rows between recomputations of the curve at the current length
LM_ROW_SHARE = 0.2   # a prefill row's cost that is its LM head and top-K (SmolLM2: a fifth of
                     # its multiply-adds; Llama-3.2-1B ~0.21, Qwen3-0.6B ~0.26), where the
                     # backend does not say (the native one's lm_row_share: 0.35 with a GGUF's
                     # 8-bit head on AVX2, whose prompt rows measured 0.8-0.95 ms each, not
                     # 0.36; 0.21 with AVX-512 VNNI, where they measured 0.14 ms, 0.18 of a row)
PROMPT_ROWS_BUDGET = 0.1  # the most of an answer's plain decoding the prompt rows may cost
_MEASURING = threading.Lock()  # one latency measurement at a time in a process


@lru_cache(maxsize=16)
def _probe_plans(m_max: int) -> dict[int, Plan]:
    # k = 1 plans with m draft nodes, compiled once per process
    return {m: Plan.top1((m,), 1) for m in range(1, max(m_max, 0) + 1)}


class WholeDrafter:
    """A whole drafter auto may run for a step, with running means of what its steps gave
    per feature of its next draft: ``stats[feature] = [tokens per step, positions, steps]``.

    ``best`` caps its optimistic estimate while it has run few steps: the most tokens a step
    of it could commit (k = 2 probing: 3; LADE: its n-gram size), or, for the hybrid, 3 (a
    good lookup step; its 11-deep ceiling would have it tried on curves where it cannot
    pay).
    """

    ema = 0.1

    def __init__(self, name: str, drafter, best: float, stats: dict) -> None:
        self.name, self.drafter, self.best, self.stats = name, drafter, best, stats
        self.bc = 0  # widest block it may use, set by the caller
        # dormant: not weighed until step ``wake_at``; one that can catch up in bulk (LADE's
        # pool, from the committed tokens) also stops observing while dormant
        self.asleep, self.wake_at = True, 0
        self.seen = 0  # committed tokens it has observed (it catches up from there when woken)
        # upkeep: host seconds its observe takes per awake step, and the share of awake steps
        # it runs; each step it runs is charged upkeep / share (a drafter kept current every
        # step but picked once in 20 pays for 20 observes), so on a fast forward a drafter
        # that seldom wins goes dormant and costs nothing, and on a slow one it stays
        self.upkeep, self.share = 0.0, 0.25
        # steady: dormant only while it cannot beat plain decoding (learned heads, whose
        # upkeep is small and whose estimate holds step to step), not whenever one step's
        # best choice (a long lookup chain) beats it, which would put it to sleep for
        # ``sleep_steps`` steps at a time
        self.steady = False

    def catch_up(self, tokens: list[int]) -> None:
        if len(tokens) > self.seen:
            self.drafter.catch_up(tokens[self.seen:])
            self.seen = len(tokens)

    def charge(self) -> float:
        return self.upkeep / max(self.share, 0.02)

    def kept(self, seconds: float, ran: bool) -> None:
        """An awake step: its observe took ``seconds``; ``ran``: its own step."""
        self.upkeep += 0.1 * (seconds - self.upkeep)
        self.share += 0.05 * (float(ran) - self.share)

    def feature(self, root: int) -> int:
        d = self.drafter
        if isinstance(d, LookaheadDrafter):  # guesses to verify, or only the window
            return int(bool(d.pool.get(root)))
        if isinstance(d, HybridDrafter):
            index = d.context.index
            return 2 * int(d.has_mask_guesses) + int(index.match(index.tokens)[0] > 0)
        return 0

    def hope(self, f: int, cost: float) -> float:
        """The optimistic rate of feature ``f`` at this cost: its mean raised towards ``best``
        while it has run few steps."""
        e, _, n = self.estimate(f)
        return (e + (self.best - e) / sqrt(1.0 + n)) / cost

    def estimate(self, feature: int) -> list[float]:
        # a drafter not yet run: one token a step (no gain) at its full width
        return self.stats.setdefault(feature, [1.0, float(self.bc), 0.0])

    def record(self, feature: int, tokens: int, positions: int) -> None:
        s = self.estimate(feature)
        w = max(self.ema, 1.0 / (s[2] + 2.0))  # the first steps count more than a prior
        s[0] += w * (tokens - s[0])
        s[1] += w * (positions - s[1])
        s[2] += 1.0


class AutoDrafter:
    """Picks the plan with the best expected tokens/s each step (see module docstring)."""

    mask_tokens = 1
    explore_every = 8  # in plain mode, a mask-only step this often keeps acceptance known,
    explore_max = 64   # doubled after each one that probing then did not beat, up to this
    try_every = 16     # steps between tries of a whole drafter not run lately
    try_backoff = 16   # a drafter whose try lost waits 2x longer for its next, up to this
    #                    many times try_every (scaled as try_every is)
    try_share = 0.005  # the most of the decoding time all tries together may lose
    decay = 0.98  # weight of a lookup chain's record per newer chain of its n-gram length
    # a lookup chain runs only where its expected rate beats the best so far by this factor:
    # chains that expect a few per cent more than a plain step are a coin toss at this
    # machine's noise, and their losses (a 2-row block costs 1.26-1.30x a plain step over
    # 700 cached rows) held summarization under 1.0x (bench/results/auto_chain_margin_cpu.md)
    chain_margin = 1.05
    host_ema = 0.1     # weight of the newest step in the host-time estimates
    slope_ema = 0.01   # weight of the newest lookup / probing step in the compute slope
    #                    (each older one counts 1 - slope_ema less; 0: no slope, the curve as is)
    slope_range = (0.7, 3.0)  # the slope's bounds
    refresh = 8        # steps between recomputations of the lookup-chain rate table
    # a speculative kind is charged at least a plain step's host time. Its measured host time
    # also absorbs the curve's error at the sizes it runs, so where the curve overstates t(T)
    # in the loop (suspected on the H100 with real weights: auto@10 ran 1555 plain steps to
    # pld's 902) the floor keeps chains looking dearer than they are; off, that correction
    # may go below plain's. Kept on until a GPU run compares (bench_gpu.py --auto-param)
    host_floor = True
    stand_every = 4    # steps between STAND trees while they lose (grown each step they win),
    stand_max = 64     # doubled after every losing tree up to this
    stand_record = 16  # the stored distributions are recorded while STAND trees come this often
    sleep_steps = 32   # steps a dormant whole drafter stays unweighed between checks

    def __init__(self, backend: Backend, config: GenerationConfig,
                 memory: dict | None = None) -> None:
        memory = {} if memory is None else memory
        # k = 1: BC = 2 * (1 + m), at most what the package's graph exports (top-K = m + 1)
        m_max = fitted_topk(backend, probe_draft_nodes(config.bc) + 1) - 1
        self.plans = _probe_plans(m_max)
        if backend.vocab_size < m_max + 2:
            raise ConfigError(f"a plan of {m_max + 1} nodes needs a vocabulary of at least "
                              f"{m_max + 2} tokens, the model has {backend.vocab_size}")
        self.width = m_max + 1  # candidates a probing step needs
        self._lm_share = float(getattr(backend, "lm_row_share", None) or LM_ROW_SHARE)
        # a sparse grid (interpolated between): powers of two up to the budget, and the budget
        top = max([MASK_ONLY.bc, *(p.bc for p in self.plans.values())])
        sizes = sorted({1, top, *(2 ** i for i in range(1, top.bit_length()) if 2 ** i <= top)})
        key = ("latency", tuple(sizes))
        # a block's cost grows with the cache it attends to, faster for more rows: SmolLM2
        # fp32 on 2 cores, t(8) - t(1) = 9.7 ms over 64 cached rows, 16.4 ms over 800. A curve
        # measured over 64 rows alone had auto take 8-row lookup chains on an 800-token
        # summarization prompt that cost what they saved. So a second curve over
        # 512 rows (latency.curve_pair), and t(T) at the cache's length is read off the line
        # through both (a curve handed over, from edgemtp profile: its own long curve, if any)
        if config.latency is not None:
            self.latency = config.latency
        else:
            with _MEASURING:  # concurrent first generations (a server): one measures, on an
                if key not in memory:  # otherwise idle model; the others wait and read it
                    memory[key] = curve_pair(lambda ctx, again: cached_latency(
                        backend, sizes, context=ctx, topk=self.width, again=again),
                        backend, sizes)
            self.latency = memory[key]
        self.latency_long = self.latency.long
        # whole drafters cost host time every step they are kept current (~0.2-0.5 ms on a
        # 2-core x86 CPU): weighed only where a forward pass is slow enough to hide that
        self.wholes = (self._wholes(backend, config, memory)
                       if self.latency(1) >= WHOLE_MIN_T1 else [])
        # learned heads (heads=KIND): their upkeep is one small heads run per awake step, so
        # they are weighed on any device (the hybrid above then takes heads, not masks)
        if config.heads is not None:
            self.wholes += self._heads(backend, config, memory)
        self.hidden = any(getattr(w.drafter, "hidden", False) for w in self.wholes)
        self._last_obs: tuple | None = None  # the last observe's arguments (waking heads)
        self.hybrid = next((w.drafter for w in self.wholes if w.name.startswith("hybrid")),
                           None)
        self.k2 = [w for w in self.wholes if w.name.startswith("probe k=2")]
        self.hybrids = [w for w in self.wholes if w.name.startswith("hybrid")]
        if self.k2:
            self.mask_tokens = 2  # prefill carries 2 masks: a k = 2 plan may run first
        self._max_new = config.max_new_tokens
        self._rows_cheap = True  # (set per generation by start)
        # ranks at which true tokens appeared among the mask's pruned candidates; starts from
        # a pessimistic prior (a few misses), so an unknown model decodes plainly first
        self.rank_hits = memory.setdefault(("auto-ranks", self.width),
                                           {"hits": np.zeros(self.width), "steps": 4.0})
        # every step asks for the candidates any source reads (stored distributions too)
        # (prefill and steps with masks or a whole drafter; a step without either asks only
        # for what the stored distributions keep, or nothing while no one reads them)
        self.topk_max = self.topk = max([self.width, *(w.drafter.topk for w in self.wholes)])
        self.prune = config.prune
        grid = range(max(config.bc, 4) + 1)
        self._lat0 = self._lat = np.array([self.latency(max(t, 1)) for t in grid])
        # seconds per cached row, per T: the second curve's excess over the first (>= 0; 0
        # without a second curve); t(T) at cache length P is _lat0 + (P - 64) * _lat_row
        self._lat_row = np.zeros_like(self._lat0)
        self._lat_from = self.latency.context  # the cache length _lat0 is for
        if self.latency_long is not None:
            long = np.array([self.latency_long(max(t, 1)) for t in grid])
            self._lat_row = (np.maximum(long - self._lat0, 0.0)
                             / (self.latency_long.context - self.latency.context))
        self._lat_bucket = 0  # the cache length (in CONTEXT_STEP rows) _lat is for
        self._lat_ctx = self._lat  # the curve at that length, before the slope
        # the compute slope: how many times the curve's t(T) - t(1) a block really costs
        # beyond a plain step, learned from lookup and probing steps (little host work of their
        # own) and kept over the model's generations. A core's compute slows while its memory
        # reads do not (a neighbour on its SMT sibling, thermal throttling): on this VM t(8)
        # went from 6.1 to 7.9 ms for minutes at a time while t(1) stayed 2.6-2.7 (SmolLM2
        # int4), and one additive correction per kind of step could not make both a 2-row and
        # an 8-row chain right. The slope of a weighted least-squares line through (curve
        # rise, cost beyond a plain step): its intercept is the host work a speculative step
        # adds, which divided into the cost would have inflated the slope of 2-row chains most
        self._slope = memory.setdefault("auto-slope", {"a": 1.0, "w": 0.0, "x": 0.0, "y": 0.0,
                                                       "xx": 0.0, "xy": 0.0})
        self._slope_at = 1.0  # the slope _lat was computed with
        self._apply_slope()  # sets _lat and _latl
        # a try of a whole drafter that is not winning costs a block of its narrowest budget
        # instead of a plain step: tried more rarely where that block costs more (a 2-core CPU
        # running int4 weights: ~3x at 10 positions), every try_every steps where it is flat
        narrow = min([w.bc for w in self.wholes] or [1])
        self._try_every = int(round(self.try_every * max(1.0, self._lat_at(narrow)
                                                         / self._lat[1])))
        # mask-only steps only where probing could ever pay: even a sure accept doubles the
        # tokens of a step at best, so a 4-position block must cost under twice a 1-position one
        self.explore = config.bc >= 4 and 2.0 * self.latency(1) > self.latency(4)
        self.embeds = MaskEmbeddings(1, config.mask_init, config.ema, backend.embed,
                                     stats=backend.embedding_stats()
                                     if config.mask_init == "sample" else None,
                                     vector=None if config.mask_vector is None
                                     else np.asarray(config.mask_vector), seed=config.seed)
        self._cand: tuple[np.ndarray, np.ndarray] | None = None
        self._k2_ready = False  # the last step left 2 masks' candidates (a k = 2 plan may run)
        self.n_chain = chain_length(config.bc)
        # per matched n-gram length n (row n - 1): chains tried / right up to depth d
        self.chain_hits = memory.setdefault(("auto-chain", self.n_chain), {
            "hits": np.zeros((MAX_NGRAM, self.n_chain)),
            "tries": np.full((MAX_NGRAM, self.n_chain), 4.0)})
        # STAND tree nodes seen / on the true path, per cumulative-score bin (a prior of a
        # few half-misses: a bin's rate starts at half its middle score)
        edges = (0.0, *P_EDGES, 1.0)
        self.stand_hits = memory.setdefault("auto-stand", {
            "hits": np.array([(a + b) / 4 * 4.0 for a, b in zip(edges, edges[1:])]),
            "seen": np.full(len(edges) - 1, 4.0)})
        self.stand_nodes = min(config.bc, STAND_NODES) if self.hybrid is not None else 0
        # steps until the next STAND tree while they lose, kept across generations
        self._stand_gap = memory.setdefault("auto-stand-gap", {"gap": self.stand_every})
        # host seconds per step beyond t(T), per kind of step ("plain", "probe", "pld",
        # "stand", or a whole drafter's name): binding new shapes and drafting
        self.host = memory.setdefault("auto-host-by-kind", {})
        self._host_max = max(self.host.values(), default=0.0)
        self._host_own = max((v for k, v in self.host.items() if k in OWN_KINDS), default=0.0)
        self._host_plain = self.host.get("plain", 0.0)
        self._t_step: float | None = None
        self._last: tuple[str, int] = ("plain", 1)  # kind and T of the last step
        # the committed context, kept once for lookup chains, STAND trees and both hybrids
        # (its stored distributions only where a hybrid reads them)
        self._dists = self.hybrid is not None
        self.context = ContextModel(self.hybrid.topk if self._dists else 1, MAX_NGRAM, native=True)
        self.index = self.context.index
        # (position, n, chain) to score, scored when the chain table is next recomputed (its
        # only reader) rather than each step: after a forward that streamed the weights every
        # object a step touches is a cache miss (~13 us a step on SmolLM2 int4, 2 cores)
        self._chains: list[tuple[int, int, list[int]]] = []
        self._observed: list[int] = []  # the context's length after each step since then
        self._embeds_at = 0  # committed tokens folded into self.embeds (lazily, on a read)
        self._trees: list[tuple[int, GrownTree]] = []  # (position, STAND tree) to score
        self._chain: list[int] = []
        self._chain_n = 0
        self._chain_table: list | None = None
        self._steps = 0
        self._root = -1
        self._stand_next = 0  # the step at which a STAND tree is next grown
        self._tried = -self.try_every  # the step a whole drafter was last tried
        # backoffs kept across generations (a model's prose stays prose): the gap between
        # mask-only steps, and per whole drafter the step (of a clock over generations) before
        # which it is not tried again and its gap; a try that beat plain decoding resets them
        self._explore = memory.setdefault("auto-explore", {"gap": self.explore_every})
        self._since_explore, self._explored, self._explores = 0, False, 0
        self._clock = memory.setdefault("auto-clock", {"steps": 0})
        self._backoff = {w.name: memory.setdefault(("auto-try", w.name), {"gap": 0, "at": 0})
                         for w in self.wholes}
        self._trying: WholeDrafter | None = None  # the whole drafter on trial this step
        # seconds decoded and seconds lost by tries (over the plain steps that would have
        # committed their tokens), over the model's generations: SmolLM2 fp32 on 2 cores tried
        # hybrid and LADE about 5 times a 128-token answer, each try 5-20 ms dearer than plain,
        # which took writing (little to look up) from a 2 % gain to parity
        self._try_cost = memory.setdefault("auto-try-cost", {"time": 0.0, "lost": 0.0})
        self._tried_tokens: int | None = None  # tokens the last step committed, if a try
        self._whole: tuple[WholeDrafter, int] | None = None  # running now, and its feature
        self._embeds_from = self.k2[0].drafter if self.k2 else self.embeds  # prefill's masks
        self.choices: dict[int, int] = {}  # plan BC -> steps, for reports
        self.picked: dict[str, int] = {}   # kind of step -> steps, for reports

    @staticmethod
    def _heads(backend: Backend, config: GenerationConfig, memory: dict
               ) -> list[WholeDrafter]:
        out = []
        for bc in auto_budgets(config.bc) or (config.bc,):
            d = HeadsDrafter(backend, replace(config, bc=bc, drafter="heads",
                                              tree_cost="budget"), memory)
            # optimistic prior: a good step of the heads (their tree is as deep as the heads)
            w = WholeDrafter(f"heads BC={bc}", d, min(3.0, d.runner.info.heads + 1.0),
                             memory.setdefault(("auto-whole", "heads", config.heads, bc), {}))
            w.bc, w.steady = bc, True
            out.append(w)
        return out

    @staticmethod
    def _wholes(backend: Backend, config: GenerationConfig, memory: dict
                ) -> list[WholeDrafter]:
        out = []
        hybrid = HybridDrafter if config.heads is None else HeadsHybridDrafter
        for bc in auto_budgets(config.bc):
            for name, make, best, sub in (
                    ("hybrid", hybrid, 3.0, dict(drafter="hybrid")),
                    ("lade", LookaheadDrafter, None, dict(drafter="lade")),
                    ("probe k=2", ProbeDrafter, 3.0,
                     dict(drafter="probe", mask_tokens=2, tree="dynamic", branching=None))):
                hybrid_only = sub["drafter"] == "hybrid"  # (heads, tree_cost: its options)
                c = replace(config, bc=bc, heads=config.heads if hybrid_only else None,
                            tree_cost=config.tree_cost if hybrid_only else "budget", **sub)
                d = make(backend, c, memory)
                if d.topk > fitted_topk(backend, d.topk):
                    continue  # (k = 2 probing wider than the package's top-K)
                w = WholeDrafter(f"{name} BC={bc}", d, best if best else float(d.n),
                                 memory.setdefault(("auto-whole", name, bc), {}))
                w.bc = bc
                out.append(w)
        return out

    @property
    def prompt_rows(self) -> bool:
        """Whether the prefill's prompt rows' outputs are read: the stored distributions at
        the prompt's positions, which STAND trees and the hybrids read, by the rule decode
        steps record them (while STAND trees are still grown often; at the start every whole
        drafter is asleep and reads none of them). Without, only the last prompt row's and
        the mask rows' outputs are computed, where the backend can leave rows out (the native
        one, Engine._prefill): on SmolLM2 int4 (AVX2) the LM head and top-K over every prompt
        row had made the prefill ~25 % longer, and `auto` lost to plain decoding on prompts
        of 200-800 tokens (bench/results/auto_prompt_rows_cpu.md). Nor where the prompt is
        long for the answer asked (_prompt_rows_cheap)."""
        return (self._dists and self._stand_gap["gap"] <= self.stand_record
                and self._rows_cheap)

    def _prompt_rows_cheap(self, rows: int) -> bool:
        # the prompt rows' LM head and top-K cost about LM_ROW_SHARE of a prefill row each (a
        # block's per-row cost, read off the curve at this length); they are asked for only
        # while that stays under PROMPT_ROWS_BUDGET of the answer's plain decoding (up to
        # max_new_tokens steps). SmolLM2 int4, a 769-token summarization prompt, 116 new
        # tokens: the rows made a fresh model's first prefill 1.73 s against 1.41 s, while
        # its whole decode took 0.75-0.84 s
        lat = self._latl
        top = len(lat) - 1
        row = (lat[top] - lat[top // 2]) / max(top - top // 2, 1)
        return rows * self._lm_share * row <= PROMPT_ROWS_BUDGET * self._max_new * lat[1]

    def start(self, prompt_ids: np.ndarray) -> None:
        self.embeds.start(prompt_ids)
        self._chains, self._trees, self._observed = [], [], []
        self.context = ContextModel(self.context.dists.k, MAX_NGRAM, native=True)
        self.context.extend(prompt_ids)
        self.index = self.context.index
        self._embeds_at = len(self.index.tokens)  # tokens folded into self.embeds so far
        self._at_context(len(prompt_ids))
        self._rows_cheap = self._prompt_rows_cheap(len(prompt_ids))
        self.topk, self._record = self.topk_max, self.prompt_rows
        for w in self.wholes:
            if isinstance(w.drafter, HybridDrafter):
                w.drafter.shared = self.context
            w.drafter.start(prompt_ids)
            w.asleep, w.wake_at, w.seen = True, 0, len(prompt_ids)
        self._t_step = None
        # the prefill carries masks only where a probing step could pay: a k = 1 plan's
        # expected rate beats plain decoding's, or a k = 2 drafter's optimistic one could;
        # else they are prefill rows for nothing (~1.6 ms a row on SmolLM2 int4, 2 threads)
        self.mask_tokens = k = self._prefill_masks()
        self._embeds_from = self.k2[0].drafter if k == 2 else self.embeds if k else None

    def finish(self) -> None:
        """The generation ended (Engine.close): its chains are scored against its own tokens
        (the next generation's drafter shares the table); those still right at the end, and
        such STAND trees, are dropped."""
        self._score_chains()
        self._chains, self._trees, self._observed = [], [], []

    def _prefill_masks(self) -> int:
        plain = 1.0 / (self._latl[1] + self._host("plain"))
        if any(self._ceiling(w) > plain for w in self.k2):
            return 2
        if self.plans and self._probe_rates().max() > plain:
            return 2 if self.k2 else 1
        return 0

    def _probe_rates(self) -> np.ndarray:
        # expected tokens/s of the k = 1 plans with m = 1, 2, ... draft nodes (T = 2(m + 1))
        m = np.arange(1, len(self.plans) + 1)
        return ((1.0 + np.cumsum(self.rank_hits["hits"])[m - 1] / self.rank_hits["steps"])
                / (self._lat[2 * (m + 1)] + self._host("probe")))

    def _host(self, kind: str) -> float:
        # a step's host time beyond its forward: measured per kind, and (host_floor) never
        # less than a plain step's. A kind not measured yet is charged the dearest one seen
        # of its own sort: auto's own kinds (plain, mask, lookup, probing, STAND) the dearest
        # of those, a whole drafter the dearest of all. (Charged a hybrid's host time, ~1.6 ms
        # a step on a GPU, a k = 1 probe that never ran could never win a step, so it would
        # never be measured.)
        mine = self.host.get(kind)
        v = ((self._host_own if kind in OWN_KINDS else self._host_max) if mine is None
             else mine)
        return max(self._host_plain, v) if self.host_floor else v

    def _at_context(self, rows: int) -> None:
        # t(T) over a cache of ``rows`` rows (moved every CONTEXT_STEP rows), and the lookup
        # table that reads it recomputed
        bucket = rows // CONTEXT_STEP
        if bucket == self._lat_bucket or self.latency_long is None:
            return
        self._lat_bucket = bucket
        extra = max(bucket * CONTEXT_STEP - self._lat_from, 0)
        self._lat_ctx = self._lat0 + extra * self._lat_row
        self._apply_slope()

    def _apply_slope(self) -> None:
        # t(T) = t(1) + slope * (curve(T) - curve(1)) at the cache's length; the tables that
        # read it recomputed
        a, ctx = self._slope["a"], self._lat_ctx
        self._slope_at = a
        self._lat = ctx if a == 1.0 else ctx[1] + a * (ctx - ctx[1])
        # the same as Python floats, for the per-step scalar arithmetic (numpy scalars are
        # slower, and cold after a forward that streamed the weights through the caches)
        self._latl: list[float] = self._lat.tolist()
        self._chain_table = None

    def _learn_slope(self, t: int, seconds: float) -> None:
        # a block of t rows took ``seconds``: the point (the curve's t(T) - t(1) at this
        # length, its cost beyond a plain step as plain steps measure it) joins the line fit,
        # each point weighted 1 - slope_ema less than the next
        ctx = self._lat_ctx
        t = min(t, len(ctx) - 1)
        t1 = float(ctx[1])
        x = float(ctx[t]) - t1
        if x < 0.05 * t1:
            return  # the curve says a block this size costs a plain step: nothing to learn
        y = seconds - t1 - self._host_plain
        y = min(max(y, -0.5 * t1), 4.0 * x + t1)  # a pause cannot swing the fit
        s, k = self._slope, 1.0 - self.slope_ema
        for key, v in (("w", 1.0), ("x", x), ("y", y), ("xx", x * x), ("xy", x * y)):
            s[key] = k * s[key] + v
        var = s["w"] * s["xx"] - s["x"] ** 2
        if s["w"] < 4.0 or var <= (0.2 * s["x"]) ** 2:
            return  # too few blocks, or all of one size: no slope to tell from an intercept
        lo, hi = self.slope_range
        a = s["a"] = min(max((s["w"] * s["xy"] - s["x"] * s["y"]) / var, lo), hi)
        if abs(a - self._slope_at) > 0.02 * self._slope_at:
            self._apply_slope()

    def _lat_at(self, t: float) -> float:
        return self._latl[min(max(int(round(t)), 1), len(self._latl) - 1)]

    def choose(self, root: int) -> tuple:
        """The next step's kind and what it needs: ``("plain", PLAIN)``, ``("mask", plan)``,
        ``("pld", L)``, ``("probe", m)``, ``("stand", (tree, r))`` or ``(whole, feature)``."""
        best, best_rate = ("plain", PLAIN), 1.0 / (self._latl[1] + self._host("plain"))
        if self._chain:  # prompt lookup: the chain prefix with the best rate (T = n + 1)
            if self._steps % self.refresh == 0 or self._chain_table is None:
                self._chain_table = self._chain_rates(self._host("pld"))
            i, rate = self._chain_table[self._chain_n - 1][len(self._chain) - 1]
            if rate > best_rate * self.chain_margin:
                best, best_rate = ("pld", i), rate
        if self._cand is not None and self.plans:  # probing with m nodes (T = 2(m + 1))
            rates = self._probe_rates()
            i = int(rates.argmax())
            if rates[i] > best_rate:
                best, best_rate = ("probe", i + 1), rates[i]
        if self.stand_nodes and self._steps >= self._stand_next:
            best, best_rate = self._stand(root, best, best_rate)
        if self.wholes:
            best = self._whole_or(root, best, best_rate)
        if self._explored:  # the step after a mask-only one: did probing win with its masks?
            # (where a 2-position block costs what one does, exploring is free: no backoff)
            g, free = self._explore, self._latl[2] <= 1.02 * self._latl[1]
            g["gap"] = (self.explore_every if best[0] == "probe" or free
                        else min(2 * g["gap"], self.explore_max))
            self._explored = False
        if best[0] == "plain" and self._cand is None:  # now and then a mask-only step
            self._since_explore += 1
            if self.explore and self._since_explore >= self._explore["gap"]:
                self._since_explore, self._explored = 0, True
                self._explores += 1
                two = self.k2 and self._explores % 2 == 0
                best = ("mask", MASK_ONLY_2 if two else MASK_ONLY)
        return best

    def _stand(self, root: int, best: tuple, best_rate: float) -> tuple[tuple, float]:
        """A STAND tree from the stored distributions, its best prefix if that beats
        ``best``; grown every step while it wins, every ``stand_every`` steps while not."""
        cm = self.context
        tail = tuple(cm.tokens[-MAX_NGRAM:])
        self._stand_next = self._steps + self.stand_every
        if not cm.index.match(tail)[1]:
            return best, best_rate
        gap = self._stand_gap["gap"]  # a losing tree waits longer each time
        self._stand_next, self._stand_gap["gap"] = self._steps + gap, min(2 * gap, self.stand_max)
        tree = cm.grow_stand(root, self.stand_nodes, MAX_DEPTH)
        if len(tree) < 2:
            return best, best_rate
        self._trees.append((len(self.index.tokens), tree))
        h = self.stand_hits
        p = (h["hits"] / h["seen"])[[bisect_right(P_EDGES, s) for s in tree.scores[1:]]]
        rates = (1.0 + np.cumsum(p)) / (self._lat[2:len(tree) + 1] + self._host("stand"))
        i = int(rates.argmax())
        if rates[i] <= best_rate:
            return best, best_rate
        self._stand_next, self._stand_gap["gap"] = self._steps + 1, self.stand_every
        return ("stand", (tree, i + 2)), float(rates[i])

    def _whole_or(self, root: int, best: tuple, best_rate: float) -> tuple:
        """The whole drafter with the best expected rate if it beats ``best``; else, once
        every ``try_every`` steps, one whose optimistic estimate could.

        One whose optimistic estimate for any feature cannot beat ``best`` goes dormant for
        ``sleep_steps`` steps: not weighed, not observing, caught up in bulk when it wakes
        (the context they read is auto's own), so drafters that cannot win cost the host
        nothing."""
        hope = None
        trying = (self._steps - self._tried >= self._try_every
                  and self._try_cost["lost"] <= self.try_share * self._try_cost["time"])
        clock = self._clock["steps"]
        plain_rate = 1.0 / (self._latl[1] + self._host("plain"))
        for w in self.wholes:
            if w in self.k2 and not self._k2_ready:
                continue  # a k = 2 plan needs the last step's 2 masks
            floor = plain_rate if w.steady else best_rate  # below it, w goes dormant
            if w.asleep:
                if self._steps < w.wake_at:
                    continue
                if self._ceiling(w) <= floor:
                    w.wake_at = self._steps + self.sleep_steps
                    continue
                w.asleep = False
                w.catch_up(self.index.tokens)
                if hasattr(w.drafter, "refresh") and self._last_obs is not None:
                    w.drafter.refresh(*self._last_obs)  # heads: candidates for this step
            f = w.feature(root)
            e, t, n = w.estimate(f)
            cost = self._lat_at(t) + self._host(w.name) + w.charge()
            if e / cost > best_rate:
                best, best_rate = (w, f), e / cost
                continue
            rate = w.hope(f, cost)
            if rate > best_rate:
                if (trying and clock >= self._backoff[w.name]["at"]
                        and (hope is None or (n, -rate) < hope[0])):
                    hope = ((n, -rate), w, f)  # the least tried of those that could win
            elif self._ceiling(w) <= floor:
                w.asleep, w.wake_at = True, self._steps + self.sleep_steps
        if hope is not None and not isinstance(best[0], WholeDrafter):
            self._tried = self._steps
            self._trying = hope[1]
            return hope[1:]
        return best

    def _ceiling(self, w: WholeDrafter) -> float:
        # the best optimistic rate of any feature w has run with (its prior if none has): a
        # feature never run stays hopeful, but only tries it when it comes up keep w awake
        host = self._host(w.name) + w.charge()
        ran = [(f, s) for f, s in w.stats.items() if s[2] > 0] or [(0, w.estimate(0))]
        return max(w.hope(f, self._lat_at(s[1]) + host) for f, s in ran)

    def _chain_rates(self, spec_s: float) -> list[list[tuple[int, float]]]:
        """Per matched n-gram length and chain length L: the best prefix length and its
        expected tokens/s (a table, so most steps choose without numpy). Plain Python over
        the 3 x n_chain table: numpy's per-call overhead made it ~70 us a recomputation on a
        2-core CPU, recomputed every ``refresh`` steps and whenever the curve moves."""
        self._score_chains()
        tries, hits = self._chain_scores()
        lat = [x + spec_s for x in self._latl[2:self.n_chain + 2]]
        table = []
        for k, t in zip(hits, tries):
            best, out, cum = (0, 0.0), [], 0.0
            for i, (a, b, c) in enumerate(zip(k, t, lat), start=1):
                cum += a / b  # (1 + the running sum) / t(L + 1): numpy's cumsum, bit for bit
                r = (1.0 + cum) / c
                if r > best[1]:
                    best = (i, r)
                out.append(best)
            table.append(out)
        return table

    def propose(self, root: int) -> tuple[Plan, np.ndarray]:
        self._steps += 1
        self._clock["steps"] += 1
        self._trying = None
        now = time.perf_counter()
        if self._t_step is not None:  # the last step's host time beyond its forward
            kind, t = self._last
            if t > 1 and kind in ("pld", "probe", "mask") and self.slope_ema > 0:
                self._learn_slope(t, now - self._t_step)
            latl = self._latl
            lat = latl[t] if t < len(latl) else self._lat_at(t)
            extra = now - self._t_step - lat
            # signed, so it also corrects a curve that overstates t(T) (measured under a
            # passing load, or at another cache length); clipped, so a pause (GC, a busy
            # consumer) cannot swing the estimate, and a step never looks free
            extra = min(max(extra, -0.5 * lat), 2.0 * max(0.0, self._host_max) + latl[1])
            h = self.host.get(kind)
            self.host[kind] = extra if h is None else h + self.host_ema * (extra - h)
            self._host_max, self._host_plain = max(self.host.values()), self.host.get("plain", 0.0)
            if kind in OWN_KINDS:
                self._host_own = max(v for k, v in self.host.items() if k in OWN_KINDS)
            c = self._try_cost
            c["time"] += now - self._t_step
            if self._tried_tokens is not None:  # signed: a try that won earns its cost back
                c["lost"] += (now - self._t_step
                              - self._tried_tokens * (self._latl[1] + self._host_plain))
                self._tried_tokens = None
        self._t_step = now
        rows = len(self.index.tokens)
        if rows // CONTEXT_STEP != self._lat_bucket:
            self._at_context(rows)
        # the index holds the context up to the root: a chain guesses what follows it
        self._chain_n, self._chain = lookup(self.index, self.n_chain)
        if self._chain:
            self._chains.append((len(self.index.tokens), self._chain_n, self._chain))
        kind, arg = self.choose(root)
        plan, tokens = self._draft(kind, arg, root)
        # the stored distributions are recorded while a hybrid is awake or STAND trees are
        # still grown often; else the positions are left empty and plain steps ask for no top-K
        self._record = self._dists and (
            self._stand_gap["gap"] <= self.stand_record
            or any(not w.asleep for w in self.hybrids))
        self.topk = (self.topk_max if plan.k or self._whole is not None
                     else self.context.dists.k if self._record else 0)
        name = kind.name if isinstance(kind, WholeDrafter) else kind
        self._last = (name, plan.bc)
        self.choices[plan.bc] = self.choices.get(plan.bc, 0) + 1
        self.picked[name] = self.picked.get(name, 0) + 1
        self._root = root
        return plan, tokens

    def _draft(self, kind, arg, root: int) -> tuple[Plan, np.ndarray]:
        """The plan and node tokens of the chosen step; sets whose mask embeddings it reads."""
        self._embeds_from, self._whole = None, None
        if isinstance(kind, WholeDrafter):
            self._whole = (kind, arg)
            self._embeds_from = kind.drafter
            return kind.drafter.propose(root)
        if kind == "pld":  # a lookup chain of arg tokens
            return chain_plan(arg), np.array([root, *self._chain[:arg]], dtype=np.int64)
        if kind == "stand":
            parents, tokens, _ = layout(*arg)
            return tree_plan(parents), tokens
        if kind == "plain":
            return PLAIN, np.array([root], dtype=np.int64)
        self._embeds_from = self.k2[0].drafter if kind == "mask" and arg.k == 2 else self.embeds
        if kind == "mask":
            return arg, np.array([root], dtype=np.int64)
        ids, lp = self._cand
        plan = self.plans[arg]
        return plan, static_tree(plan, root, ids, lp, self.prune)

    def mask_embeds(self) -> np.ndarray | None:
        # only a step that carries masks reads them (and folds in the EMA)
        src = self._embeds_from
        if src is None:
            return None
        if src is self.embeds:  # the tokens committed since it was last read, in order
            tokens = self.index.tokens
            if self._embeds_at < len(tokens):
                src.update(tokens[self._embeds_at:])
                self._embeds_at = len(tokens)
        return src.value if isinstance(src, MaskEmbeddings) else src.mask_embeds()

    def observe(self, out: StepOut, mask_rows: np.ndarray, new_tokens: list[int],
                path_rows: np.ndarray) -> None:
        if self._cand is not None and self._root >= 0:  # where was the true next token?
            ids, _ = prune(self._cand[0][0], self._cand[1][0], self._root, self.width - 1,
                           self.prune)
            rank = np.flatnonzero(ids == new_tokens[0])
            self.rank_hits["steps"] += 1.0
            if rank.size:
                self.rank_hits["hits"][rank[0]] += 1.0
        self._cand = None
        if len(mask_rows):  # depth 1 of a k = 2 step is what a k = 1 plan reads
            first = mask_rows[:1]
            self._cand = (out.topk_ids[first], out.topk_logprobs[first])
        self._k2_ready = len(mask_rows) == 2
        ran = None
        if self._whole is not None:
            ran, f = self._whole
            ran.record(f, len(new_tokens), self._last[1])
            self._whole = None
            if ran is self._trying:  # a try: did it beat plain decoding's expected rate?
                self._tried_tokens = len(new_tokens)
                b = self._backoff[ran.name]
                cost = self._lat_at(self._last[1]) + self._host(ran.name)
                won = len(new_tokens) / cost >= 1.0 / (self._latl[1] + self._host("plain"))
                b["gap"] = 0 if won else min(max(2 * b["gap"], 2 * self._try_every),
                                             self.try_backoff * self._try_every)
                b["at"] = self._clock["steps"] + b["gap"]
        if self._record:  # the model's top-K at the positions just committed, for STAND / hybrid
            self.context.extend(new_tokens, out.topk_ids, out.topk_logprobs, path_rows)
        else:
            if self._dists:
                self.context.dists.skip(len(path_rows))
            self.context.extend(new_tokens)
        tokens, k2_step = self.index.tokens, len(mask_rows) == 2
        self._last_obs = (out, mask_rows, new_tokens, path_rows) if self.hidden else None
        for w in self.wholes:  # every awake drafter sees every step; a dormant one catches up
            if w.asleep and not (k2_step and w in self.k2):  # (k = 2: 2 masks' candidates)
                continue
            t0 = time.perf_counter()
            if w.seen < len(tokens) - len(new_tokens):
                w.catch_up(tokens[:len(tokens) - len(new_tokens)])
            w.drafter.observe(out, mask_rows, new_tokens, path_rows)
            w.seen = len(tokens)
            if not w.asleep:
                w.kept(time.perf_counter() - t0, w is ran)
        if self._chains:  # (an observe before every waiting chain began settles none)
            self._observed.append(len(self.index.tokens))
        if self._trees:
            self._score_trees()

    def _score_trees(self) -> None:
        # which nodes of each STAND tree (used or not) lay on the path that followed
        ctx, h, waiting = self.index.tokens, self.stand_hits, []
        for start, tree in self._trees:
            node, on = 0, set()
            for tok in ctx[start:start + MAX_DEPTH]:
                node = tree.child.get((node, tok))
                if node is None:
                    break
                on.add(node)
            if node is not None and node in tree.parents:
                waiting.append((start, tree))  # right so far, and the tree goes deeper
                continue
            bins = [bisect_right(P_EDGES, s) for s in tree.scores[1:]]
            h["hits"] *= self.decay
            h["seen"] *= self.decay
            np.add.at(h["seen"], bins, 1.0)
            np.add.at(h["hits"], bins, [float(i in on) for i in range(1, len(tree))])
        self._trees = waiting

    def _score_chains(self) -> None:
        # how far each chain agreed with what followed, once that is known (used or not);
        # noted as (n - 1, length, agreed) in the order the steps since the last call came to
        # know them (a chain that agreed longer is known later), which is the order
        # _chain_scores adds them to the table in
        ctx, waiting, known = self.index.tokens, [], []
        observed = self._observed
        for start, n, chain in self._chains:
            seen = ctx[start:start + len(chain)]
            agree = next((i for i, (a, b) in enumerate(zip(chain, seen)) if a != b), len(seen))
            if agree == len(seen) and len(seen) < len(chain):
                waiting.append((start, n, chain))  # all right so far: wait for more tokens
                continue
            need = start + min(agree + 1, len(chain))  # tokens that settle it
            known.append((bisect_left(observed, need), (n - 1, len(chain), agree)))
        known.sort(key=lambda k: k[0])  # stable: within a step, in the chains' order
        self.chain_hits.setdefault("scored", []).extend(k[1] for k in known)
        self._chains, self._observed = waiting, []

    def _chain_scores(self) -> tuple[list[list[float]], list[list[float]]]:
        # the chain table (tries, hits per row) with every scored chain added, in the order
        # they were scored: each decays its row once and adds its prefix (on Python lists: a
        # row is 9 numbers, and numpy's per-call overhead made this ~3 µs a chain)
        h = self.chain_hits
        tries, hits = h["tries"].tolist(), h["hits"].tolist()
        scored = h.get("scored")
        if scored:
            d = self.decay
            for row, length, agree in scored:
                t, k = tries[row], hits[row]
                t[:] = [x * d + (i < length) for i, x in enumerate(t)]
                k[:] = [x * d + (i < agree) for i, x in enumerate(k)]
            h["tries"][:], h["hits"][:] = tries, hits
        h["scored"] = []
        return tries, hits
