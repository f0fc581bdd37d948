"""The hybrid drafter: mask-token probing fused with n-gram lookup and a Jacobi window in one
tree under one BC budget (the paper's App. C direction)."""

from __future__ import annotations

import operator
from bisect import bisect_right
from functools import reduce
from time import perf_counter
from typing import TYPE_CHECKING

import numpy as np

from ..backend import Backend, StepOut
from ..budgets import MAX_DEPTH, hybrid_tree_budget, hybrid_window
from ..embeddings import MaskEmbeddings
from ..plans import Plan
from .base import fitted_topk
from .lookahead import JacobiWindow, LookaheadPlan, MirroredPool
from .ngram_index import (MAX_NGRAM, MIN_SCORE, P_EDGES, ContextModel, GrownTree, Lookup,
                          NativeIndex, NativePool, grow, layout, tree_plan)
from .tree_cost import tree_cost

if TYPE_CHECKING:
    from ..config import GenerationConfig

HYBRID_TOPK = 20       # candidates per block row for the hybrid (stored and mask proposals)
MASK_GAIN = 0.35       # prior: tokens a node's masks add to the next step if the path ends there
HYBRID_POOL = 7        # continuations kept per key in the hybrid's Jacobi pool


def candidates(ids: np.ndarray, logprobs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Mask rows' top-K as the tree growers read them: ids ``int64`` and probabilities
    ``float64``, C-contiguous, each probability the ``exp`` of its log-probability in the
    backend's precision, widened (the values ``np.exp(logprobs).tolist()`` gives)."""
    return (np.ascontiguousarray(ids, dtype=np.int64),
            np.ascontiguousarray(np.exp(logprobs), dtype=np.float64))


class HitRates:
    """Online hit rates of draft candidates per bucket, kept across generations.

    The true token under every node of the accepted path is known after verification, so
    each step tells whether each candidate there was right. A lookup candidate's bucket is
    its matched n-gram length and probability bin (a 1-gram match at p = 0.9 is right far
    less often than a 3-gram one); the token that literally followed the match (PLD's
    guess: what an induction head copies) by n and whether the model's own guess agreed; a
    mask candidate's by its rank (on small models mask probabilities say little, ranks
    more); a Jacobi candidate's (an n-gram from the lookahead window's trajectories) by its
    index in the n-gram's continuation. ``rate = (hits + w * prior) / (seen + w)``.

    >>> h = HitRates(max_ngram=3, ranks=2)
    >>> b = h.lookup_bucket(3, 0.95)
    >>> round(float(h.rates()[b]), 3)          # the prior: the bin's middle
    0.95
    >>> h.record([b] * 4, [False] * 4); round(float(h.rates()[b]), 3)
    0.475

    ``gain`` is the running mean of the tokens a step accepted through mask-only
    candidates when the previous path ended at a node carrying masks: what masks on a node
    are worth, in the same unit as a draft node's chance of acceptance.
    """

    def __init__(self, max_ngram: int, ranks: int, jacobi: int = 0,
                 weight: float = 4.0) -> None:
        edges = (0.0, *P_EDGES, 1.0)
        mids = [(a + b) / 2 for a, b in zip(edges, edges[1:])]
        # buckets: [lookup: n x bin | literal: n x (agrees, not) | mask: rank | jacobi: index]
        self.n_bins, self.weight = len(mids), weight
        self.first_literal = len(mids) * max_ngram
        self.first_mask = self.first_literal + 2 * max_ngram
        self.first_jacobi = self.first_mask + ranks
        self.prior = np.array(mids * max_ngram + [0.5, 0.2] * max_ngram
                              + [0.5 / (r + 2) for r in range(ranks)]
                              + [0.3 if i == 0 else 0.5 for i in range(jacobi)])
        self.hits = np.zeros_like(self.prior)
        self.seen = np.zeros_like(self.prior)
        self.gain_sum, self.gain_n = MASK_GAIN * 20.0, 20.0

    def lookup_bucket(self, n: int, p: float) -> int:
        return (n - 1) * self.n_bins + bisect_right(P_EDGES, p)

    def lookup_buckets(self, lk: Lookup) -> list[int]:
        base = (lk.n - 1) * self.n_bins
        return [base + b for b in lk.bins]

    def literal_bucket(self, n: int, agrees: bool) -> int:
        return self.first_literal + 2 * (n - 1) + (0 if agrees else 1)

    def mask_bucket(self, rank: int) -> int:
        return self.first_mask + rank

    def jacobi_bucket(self, index: int) -> int:
        return self.first_jacobi + index

    def rates(self) -> np.ndarray:
        return (self.hits + self.weight * self.prior) / (self.seen + self.weight)

    def record(self, buckets: list[int], hits: list[bool]) -> None:
        n = len(self.seen)  # (bincount: a few us less than np.add.at, the same sums)
        self.seen += np.bincount(buckets, minlength=n)
        self.hits += np.bincount(buckets, weights=np.asarray(hits, dtype=np.float64),
                                 minlength=n)

    @property
    def gain(self) -> float:
        return self.gain_sum / self.gain_n

    def record_gain(self, tokens: float) -> None:
        self.gain_sum += tokens
        self.gain_n += 1.0


class HybridDrafter:
    """Mask-token probing fused with n-gram lookup in one tree under one BC budget (the
    paper's App. C direction).

    A node's children come from :class:`ContextModel` (as STAND) and, under the root (and
    along the top-1 chain for ``k >= 2``), from the masks the last accepted node carried
    (as probing). Every candidate is scored by the online hit rate of its kind
    (:class:`HitRates`; ``calibrate=False``: its raw probability); a token both sources
    propose scores ``1 - (1 - a)(1 - b)``. The tree grows best-first by cumulative score, so
    probe candidates fill the root's children, lookup chains run deep, and a probe
    candidate gets a lookup continuation of its own.

    Masks go only where they pay. A mask token is a leaf whose id is a mask slot: it
    attends to its node's path and itself at position ``depth + 1``, exactly the mask rule
    of :class:`~edgemtp.plans.Plan`, so ``k`` masks on a node cost ``k`` positions and the
    plan stays a plain tree (``BC`` = positions <= the budget). :func:`place_masks` splits
    the budget between draft nodes and masks by the tokens each is expected to add.

    From BC 10 up, part of the budget also runs a Jacobi lookahead window (LADE's lookahead
    branch, :class:`~edgemtp.drafters.lookahead.JacobiWindow`; ``budgets.HYBRID_WINDOWS``)
    next to the tree: the n-grams of its trajectories are a third candidate source, keyed by
    a node's token and followed along their continuation (the paper's App. C: fuse LADE's
    n-grams with probing). ``BC`` = tree positions + window cells <= the budget.
    """

    topk = HYBRID_TOPK

    def __init__(self, backend: Backend, config: GenerationConfig, memory: dict | None = None,
                 max_ngram: int = MAX_NGRAM, depth: int = MAX_DEPTH) -> None:
        self.topk = fitted_topk(backend, HYBRID_TOPK)  # (a package may export fewer)
        self.k = self.mask_tokens = config.mask_tokens
        self.bc, self.depth, self.max_ngram = config.bc, depth, max_ngram
        self.vocab, self.prune, self.calibrate = backend.vocab_size, config.prune, config.calibrate
        vector = None if config.mask_vector is None else np.asarray(config.mask_vector)
        stats = backend.embedding_stats() if config.mask_init == "sample" else None
        self.embeds = MaskEmbeddings(self.k, config.mask_init, config.ema, backend.embed,
                                     stats=stats, vector=vector, seed=config.seed)
        # kept in the caller's memory, if any, so it keeps learning across generations
        window = hybrid_window(config.bc)  # (levels, width) or None
        self.jacobi = None if window is None else JacobiWindow(*window, pool_size=HYBRID_POOL,
                                                               seed=config.seed)
        self.tree_bc = hybrid_tree_budget(config.bc)
        key = ("hybrid-hit-rates", config.bc, self.k, config.prune, config.calibrate)
        fresh = HitRates(max_ngram, self.topk, jacobi=0 if window is None else window[0])
        self.rates = fresh if memory is None else memory.setdefault(key, fresh)
        self.context = ContextModel(self.topk, max_ngram)
        # tree_cost="measured": nodes (and masks) only where they pay on this device
        self.cost = tree_cost(config, memory, ("hybrid-tree-cost", config.bc, self.k))
        # ... and the Jacobi window only while its rows pay: the tokens a step accepted that
        # only the window's n-grams proposed (running mean, every step of our tree)
        self.window_gain: dict | None = None
        if self.cost is not None:
            fresh_window = {"gain": 1.0, "steps": 0}
            self.window_gain = (fresh_window if memory is None else memory.setdefault(
                ("hybrid-window", config.bc, self.k), fresh_window))
        self._t0 = 0.0  # when this step's propose began
        # a context someone else keeps current (auto: one for both hybrids, its STAND trees
        # and lookup chains); set before ``start``, it is neither rebuilt nor extended here
        self.shared: ContextModel | None = None
        self._reset()

    def _reset(self) -> None:
        self._cand: tuple | None = None  # per mask j: its top-K ids, probs (candidates())
        self._tree: GrownTree | None = None
        self._asked: dict[int, tuple] = {}  # node -> what proposed its children
        self._masks_of: dict[int, np.ndarray] = {}
        self._offers: dict[int, list] = {}  # node -> Jacobi (n-gram, index) it offers
        self._plan: Plan | None = None
        # id(Lookup) -> (it, its tokens, their buckets): the context memoises its Lookups
        self._lookup_buckets: dict[int, tuple[Lookup, list[int], list[int]]] = {}
        # a tree grown in C: the context's length then (its learning asks the lookups as of
        # that length, along the accepted path only); None: grown in Python (``_asked``)
        self._grown_at: int | None = None
        self._grown: tuple | None = None  # its arrays as the C learner reads them
        self._grown_cand: tuple | None = None  # the mask candidates it was grown with
        self._counts: tuple = (None, None)  # (HitRates, addresses of its hits and seen)

    def start(self, prompt_ids: np.ndarray) -> None:
        if self.shared is not None:
            self.context = self.shared
        else:
            self.context = ContextModel(self.topk, self.max_ngram, native=True)
            self.context.extend(prompt_ids)
        self.embeds.start(prompt_ids)
        if self.jacobi is not None:
            self.jacobi.start(prompt_ids)
            native = self.context.native
            if native is not None:  # the tree grows in C: so does a mirror of the pool
                self.jacobi.pool = MirroredPool(self.jacobi.pool.size, NativePool(
                    native.lib, self.jacobi.pool.size, self.jacobi.levels))
        self._reset()

    def mask_embeds(self) -> np.ndarray:
        return self.embeds.value

    @property
    def has_mask_guesses(self) -> bool:
        """The last step left mask candidates for the next tree (auto's estimate reads it)."""
        return self._cand is not None

    def propose(self, root: int) -> tuple[Plan, np.ndarray]:
        self._t0 = perf_counter()
        floor = MIN_SCORE if self.cost is None else self.cost.min_score(MIN_SCORE)
        self._asked, self._offers = {}, {}
        window = self.jacobi is not None and self._window_pays(floor)
        tree_bc = self.tree_bc if window or self.jacobi is None else self.bc
        self._tree = self._grow_native(root, tree_bc, floor)
        if self._tree is None:
            self._grown_at = None
            self._tree = self._grow(root, tree_bc, floor)
        parents, tokens, self._masks_of = place_masks(
            self._tree, tree_bc, self.k, self.vocab, self.rates.gain,
            0.0 if self.cost is None else floor,
            self.context.native if self._grown_at is not None else None)
        if not window:
            self._plan = tree_plan(parents)
            return self._plan, tokens
        plan, ids = self.jacobi.block(parents, tokens)
        self._plan = plan
        return plan, ids

    def _grow(self, root: int, tree_bc: int, floor: float) -> GrownTree:
        tree = GrownTree(root, tuple(self.context.tokens[-self.max_ngram:]), self.max_ngram)
        rates = self.rates.rates().tolist() if self.calibrate else None
        chain = [0]  # the top-1 chain: mask j's candidates hang under its depth-j node

        def children(t: GrownTree, node: int) -> list[tuple[int, float]]:
            d = t.depths[node]
            if node and d == len(chain) and t.parents[node] == chain[-1]:
                chain.append(node)
            j = d if d < len(chain) and chain[d] == node else None
            return self._children(t, node, j, rates)

        return grow(tree, children, tree_bc, self.depth, floor)

    def _grow_native(self, root: int, tree_bc: int, floor: float) -> GrownTree | None:
        """The same tree as :meth:`_grow`, grown in C (``edgemtp/native/ngram.c``); None
        where the library is not there (or a token id is beyond what it holds)."""
        native: NativeIndex | None = self.context.native
        pool = None if self.jacobi is None else self.jacobi.pool
        if native is None or not (pool is None or isinstance(pool, MirroredPool)
                                  and pool.native is not None):
            return None
        h = self.rates
        cand = self._cand if self._cand is not None and len(self._cand[0]) else None
        self._grown_cand = cand
        tail = tuple(self.context.tokens[-self.max_ngram:])
        grown = native.grow_hybrid(
            self.context, root, tail, tree_bc, self.depth, floor,
            h.rates() if self.calibrate else None, h.prior,
            (h.n_bins, h.first_literal, h.first_mask, h.first_jacobi), cand, self.prune,
            None if pool is None else pool.native)
        if grown is None:  # a token id beyond the C index: Python from here on
            self.context.native = None
            if pool is not None:
                pool.native = None
            return None
        self._grown_at, self._grown = len(self.context.tokens), native.grown
        return GrownTree.from_arrays(*grown, tail, self.max_ngram)

    WINDOW_PROBE = 32  # tree_cost="measured": a window step at least this often
    learn_in_c = True  # False: a tree grown in C is learned from in Python (tests)

    def _window_pays(self, floor: float) -> bool:
        """Always with ``tree_cost="budget"``; with ``"measured"``, while the tokens the window's
        n-grams alone got accepted per step beat its rows times what a node must add (and on
        one step in WINDOW_PROBE, which refreshes its n-gram pool and the measurement)."""
        if self.cost is None or self.cost.n < self.cost.warmup:
            return True
        w = self.window_gain
        w["steps"] += 1
        rows = self.jacobi.cells.size - 1  # (its cell (0, 0) is the root)
        return w["gain"] >= rows * floor or w["steps"] % self.WINDOW_PROBE == 0

    def observe(self, out: StepOut, mask_rows: np.ndarray, new_tokens: list[int],
                path_rows: np.ndarray) -> None:
        if self._tree is not None:  # a step of our tree: our masks are leaves of it
            if self.cost is not None:
                self.cost.record(self._plan.bc, perf_counter() - self._t0, len(new_tokens))
            self._learn(new_tokens)
            mask_rows = self._masks_of.get(int(path_rows[-1]), mask_rows[:0])
            if isinstance(self._plan, LookaheadPlan):
                self.jacobi.advance(self._plan, out.argmax)
            self._tree = None  # a step someone else planned (auto) only feeds the context
        self._cand = None
        if len(mask_rows):
            k = self.topk  # a step may carry more candidates than ours (auto asks for more)
            self._cand = candidates(out.topk_ids[mask_rows, :k], out.topk_logprobs[mask_rows, :k])
        if self.shared is None:
            self.context.extend(new_tokens, out.topk_ids, out.topk_logprobs, path_rows)
        self.embeds.update(new_tokens)

    def catch_up(self, tokens) -> None:
        """Tokens committed while not observing (auto's dormant drafters; the shared context
        has them): fold them into the mask embeddings in bulk; no mask candidates are left."""
        self.embeds.update(tokens)
        self._cand, self._tree = None, None

    def _children(self, tree: GrownTree, node: int, j: int | None,
                  rates: list[float] | None) -> list[tuple[int, float]]:
        """``(token, score)`` under ``node``."""
        h, lk = self.rates, self.context.next_tokens(tree.tails[node])
        masks = self._mask_guesses(j, tree.tokens[node])
        jac = self._jacobi_guesses(tree, node)
        self._asked[node] = lk, masks, jac
        if rates is None:
            score = dict(lk.guesses)
        elif not lk.guesses:
            score = {}
        else:
            tb = self._lookup_buckets.get(id(lk))
            if tb is None or tb[0] is not lk:  # (the Lookup is memoised: so is this)
                tb = self._lookup_buckets[id(lk)] = (lk, [t for t, _ in lk.guesses],
                                                     h.lookup_buckets(lk))
            score = dict(zip(tb[1], map(rates.__getitem__, tb[2])))
            if lk.literal >= 0:  # mostly the same evidence as the guesses: no noisy-or
                b = h.literal_bucket(lk.n, lk.literal == lk.guesses[0][0])
                score[lk.literal] = max(score.get(lk.literal, 0.0), rates[b])
        for rank, (t, p) in enumerate(masks):
            q = p if rates is None else rates[h.mask_bucket(rank)]
            score[t] = 1.0 - (1.0 - score.get(t, 0.0)) * (1.0 - q)
        for t, b in jac:
            q = h.prior[b] if rates is None else rates[b]
            score[t] = 1.0 - (1.0 - score.get(t, 0.0)) * (1.0 - q)
        total = reduce(operator.add, score.values(), 0.0)  # (in order, as ngram.c sums)
        if total > 0.99:  # siblings are exclusive events: keep their sum a probability
            return [(t, s * 0.99 / total) for t, s in score.items()]
        return list(score.items())

    def _jacobi_guesses(self, tree: GrownTree, node: int) -> list[tuple[int, int]]:
        """``(token, bucket)`` the Jacobi pool proposes under ``node``: the next token of
        every n-gram continuation the node's parent offered and the node's token matched,
        and the first token of every continuation keyed by the node's token (one bucket per
        token: the lowest index offering it)."""
        if self.jacobi is None:
            return []
        jac, self._offers[node] = self._jacobi_of(tree.tokens[node],
                                                  self._offers.get(tree.parents[node], ()))
        return jac

    def _jacobi_of(self, tok: int, parent_offers) -> tuple[list[tuple[int, int]], list]:
        """A node's Jacobi guesses and its offers, from its token and its parent's offers."""
        offers = [(c, i + 1) for c, i in parent_offers if c[i] == tok and i + 1 < len(c)]
        offers.extend((c, 0) for c in self.jacobi.pool.get(tok))
        best: dict[int, int] = {}
        for c, i in offers:
            if c[i] not in best or i < best[c[i]]:
                best[c[i]] = i
        return [(t, self.rates.jacobi_bucket(i)) for t, i in best.items()], offers

    def _mask_guesses(self, j: int | None, parent: int) -> list[tuple[int, float]]:
        """Mask ``j``'s candidates under the chain node of depth ``j``, best first."""
        if j is None or self._cand is None or j >= len(self._cand[0]):
            return []
        pairs = zip(self._cand[0][j].tolist(), self._cand[1][j].tolist())
        # §3.6: a mask echoes its node's own next token, which is the parent here
        return [(t, p) for t, p in pairs if not (self.prune and t == parent)]

    def _learn(self, truth: list[int]) -> None:
        """Hit or miss for every candidate under the true path (known to its end)."""
        native = self.context.native
        if self._grown_at is not None and native is not None and self.learn_in_c and \
                native._synced == self._grown_at:  # the tree grew in C: learn there too
            h = self.rates
            if self._counts[0] is not h:  # (the arrays are updated in place: kept)
                self._counts = h, (h.hits.ctypes.data, h.seen.ctypes.data)
            learned = native.learn_hybrid(
                self.context, self._grown, truth, self._grown_cand,
                None if self.jacobi is None else self.jacobi.pool.native,
                self._counts[1] if self.calibrate else None)
            if learned is not None:
                self._learned(truth, *learned, None)
                return
        h, tree, node = self.rates, self._tree, 0
        buckets: list[int] = []
        hits: list[bool] = []
        mask_only, window_only = False, 0
        lazy = self._grown_at is not None  # grown in C: what each node asked, recomputed
        if lazy:  # (the C index moved on since the tree grew: recomputed here)
            tail, offers, chain = tree.tails[0], (), self._chain(tree)
        for t in truth:
            if lazy:
                d = tree.depths[node]
                if d >= self.depth:  # (never expanded)
                    break
                lk = self.context.next_tokens_at(tail, self._grown_at)
                masks = self._mask_guesses(d if d < len(chain) and chain[d] == node else None,
                                           tree.tokens[node])
                jac, offers = (([], ()) if self.jacobi is None
                               else self._jacobi_of(tree.tokens[node], offers))
            elif node not in self._asked:
                break
            else:
                lk, masks, jac = self._asked[node]
            for tok, b in jac:
                buckets.append(b)
                hits.append(tok == t)
            for (tok, _), b in zip(lk.guesses, h.lookup_buckets(lk)):
                buckets.append(b)
                hits.append(tok == t)
            if lk.literal >= 0:
                buckets.append(h.literal_bucket(lk.n, lk.literal == lk.guesses[0][0]))
                hits.append(lk.literal == t)
            for rank, (tok, _) in enumerate(masks):
                buckets.append(h.mask_bucket(rank))
                hits.append(tok == t)
            if node == 0:
                mask_only = (t != lk.literal and all(g != t for g, _ in lk.guesses)
                             and all(g != t for g, _ in jac) and any(m == t for m, _ in masks))
            node_t = tree.child.get((node, t))
            if (self.window_gain is not None and node_t is not None
                    and any(g == t for g, _ in jac) and t != lk.literal
                    and all(g != t for g, _ in lk.guesses) and all(m != t for m, _ in masks)):
                window_only += 1  # accepted, and only the window's n-grams proposed it
            node = node_t
            if node is None:
                break
            if lazy:
                tail = (tail + (t,))[-self.max_ngram:]
        self._learned(truth, mask_only, window_only, (buckets, hits))

    def _learned(self, truth: list[int], mask_only: bool, window_only: int,
                 record: tuple | None) -> None:
        if self.calibrate and record is not None:
            self.rates.record(*record)
        if self.window_gain is not None and self.jacobi is not None:
            w = self.window_gain
            w["gain"] += 0.05 * (window_only - w["gain"])
        if self._cand is not None:  # this step's root had mask candidates
            self.rates.record_gain(len(truth) - 1 if mask_only else 0.0)

    def _chain(self, tree: GrownTree) -> list[int]:
        """The top-1 chain of a grown tree as :meth:`_grow` built it while expanding."""
        chain = [0]
        for v in range(1, len(tree)):
            d = tree.depths[v]
            if d < self.depth and d == len(chain) and tree.parents[v] == chain[-1]:
                chain.append(v)
        return chain


def place_masks(tree: GrownTree, bc: int, k: int, vocab: int, gain: float,
                min_score: float = 0.0, native: NativeIndex | None = None
                ) -> tuple[tuple[int, ...], np.ndarray, dict[int, np.ndarray]]:
    """Split the budget between the first ``r`` grown nodes and ``m`` nodes carrying ``k``
    masks each (``r + m * k <= bc``), maximising the expected accepted nodes plus ``gain``
    times the chance the accepted path ends at a masked node; lay the tree out
    (:func:`layout`). A node's masks must add at least ``min_score`` per mask row
    (``tree_cost``), as a node must. ``native``: the index that grew ``tree`` in C, which
    computes the same split there.

    >>> t = GrownTree(5, (5,), 3)
    >>> _ = t.add(6, 0, 0.5); _ = t.add(7, 1, 0.05)    # 5 -> 6 (p 0.5) -> 7 (p 0.05)
    >>> place_masks(t, bc=3, k=1, vocab=100, gain=0.4)   # a root mask is worth more than 7
    ((-1, 0, 0), array([  5,   6, 100]), {0: array([2])})
    """
    # plain Python: a tree holds at most BC nodes, and a dozen numpy calls per split on
    # arrays that small cost more than the arithmetic (~70 us a step at BC 30 on a 2-core
    # CPU; a GPU step is ~0.5 ms)
    if native is not None:
        out = native.place_masks(len(tree), bc, k, vocab, gain, min_score)
        if out is not None:
            return out
    s, par = tree.scores, tree.parents
    best, choice, worse = -np.inf, (min(len(s), bc), []), 0
    # grown scores never increase, so each mask displaces a node worth at least the last
    # one's: the value rises then falls, and a few worse splits in a row end the search
    last_r, end, kept = -1, [], 0.0
    for m in range((bc - 1) // k + 1 if k else 1):
        r = min(len(s), bc - m * k)
        if r != last_r:  # P(the accepted path ends at each of the first r nodes)
            below = [0.0] * r
            for c in range(1, r):
                below[par[c]] += s[c]
            end = [max(a - b, 0.0) for a, b in zip(s, below)]
            order = sorted(range(r), key=lambda i: -end[i])  # stable: ties keep grow order
            kept, last_r = reduce(operator.add, s[1:r], 0.0), r  # (as ngram.c sums)
        top = order[:m]
        if m and gain * end[top[-1]] < k * min_score:  # (0: masks cost nothing)
            break  # this node's masks, and every later one's, add less than they cost
        value = kept + gain * reduce(operator.add, (end[i] for i in top), 0.0)
        if value > best:
            best, choice, worse = value, (r, sorted(top)), 0
        elif (worse := worse + 1) >= 4:
            break
    r, masked = choice
    return layout(tree, r, masked, k, vocab)
