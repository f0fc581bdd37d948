"""N-gram drafters: prompt lookup (PLD), STAND, and the hybrid of mask-token probing and
lookup (paper App. F baselines, App. C future direction), under the same BC accounting.

A tree without mask tokens costs one position per node, so a lookup tree of ``N`` nodes has
``BC = N``. Every drafter here returns a plain tree (``Plan(parents, 0)``, compiled once per
shape and cached); the hybrid puts its mask tokens in that tree as leaves (see
:class:`HybridDrafter`), so for all three ``BC`` = positions in the block <= the budget.
"""

from __future__ import annotations

import heapq
import itertools
from bisect import bisect_right
from functools import lru_cache
from typing import Callable, NamedTuple

import numpy as np

from .backend import Backend, StepOut
from .config import GenerationConfig
from .embeddings import MaskEmbeddings
from .lookahead import JacobiWindow, LookaheadPlan
from .plans import Plan

MAX_NGRAM = 3          # longest context suffix matched against earlier context (PLD's default)
MAX_DEPTH = 10         # PLD and STAND trees are at most 10 deep (paper App. F)
PLD_OCCURRENCES = 8    # most recent matches PLD considers for the longest continuation
STAND_TOPK = 10        # stored candidates per committed position
STAND_OCCURRENCES = 4  # most recent matches whose stored distributions are mixed
MIN_SCORE = 1e-3       # a candidate whose cumulative score is below this never gets a node
HYBRID_TOPK = 20       # candidates per block row for the hybrid (stored and mask proposals)
P_EDGES = (0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9)  # probability bins of lookup candidates
MASK_GAIN = 0.35       # prior: tokens a node's masks add to the next step if the path ends there
# the hybrid's Jacobi lookahead window (levels, width) from a budget up: LADE's trajectories
# are a strong candidate source on small models (paper App. C). One level (bigrams) beat 2-4
# levels at every budget on story prompts 24-47 (bench: BC 60 BE 2.197 without a window,
# 2.358 with (1, 12), 2.329 with (2, 12), 2.246 with (3, 12))
HYBRID_WINDOWS = ((60, (1, 12)), (30, (1, 8)), (10, (1, 3)))
HYBRID_POOL = 7        # continuations kept per key in the hybrid's Jacobi pool


@lru_cache(maxsize=1024)
def tree_plan(parents: tuple[int, ...], k: int = 0) -> Plan:
    """The compiled plan of a tree shape, cached: a shape seen before costs no mask build.

    >>> tree_plan((-1, 0, 1)) is tree_plan((-1, 0, 1))
    True
    """
    return Plan(parents, k)


def chain_plan(n_draft: int) -> Plan:
    """A chain of ``n_draft`` nodes under the root, no masks: ``BC = n_draft + 1``.

    >>> chain_plan(2).parents, chain_plan(2).bc
    ((-1, 0, 1), 3)
    """
    return tree_plan((-1, *range(n_draft)))


# -- the committed context --------------------------------------------------------------------


class NgramIndex:
    """Where every n-gram (``n = 1..max_n``) of a growing token sequence ends.

    Only occurrences followed by a token are indexed, so the sequence's own suffix never
    matches itself.

    >>> ix = NgramIndex(2)
    >>> ix.extend([5, 6, 7, 5, 6])
    >>> ix.match([5, 6])              # "5 6" ends at position 1 (followed by 7)
    (2, [1])
    >>> ix.match([9, 7])              # no "9 7": back off to "7", which ends at 2
    (1, [2])
    """

    def __init__(self, max_n: int = MAX_NGRAM) -> None:
        self.max_n = max_n
        self.tokens: list[int] = []
        self.ends: dict[tuple[int, ...], list[int]] = {}

    def extend(self, tokens) -> None:
        for t in tokens:
            p = len(self.tokens) - 1  # the position that just got a follower
            self.tokens.append(int(t))
            for n in range(1, min(self.max_n, p + 1) + 1):
                self.ends.setdefault(tuple(self.tokens[p - n + 1:p + 1]), []).append(p)

    def match(self, suffix) -> tuple[int, list[int]]:
        """The longest ``n`` whose last ``n`` tokens of ``suffix`` occurred before, and the
        end positions of those occurrences (oldest first); ``(0, [])`` when none did."""
        for n in range(min(self.max_n, len(suffix)), 0, -1):
            ends = self.ends.get(tuple(suffix[-n:]))
            if ends:
                return n, ends
        return 0, []


class StoredDistributions:
    """The model's own top-K next-token distributions at committed positions (STAND's
    "stored logits"), as probabilities, in arrays that grow by doubling.

    ``ids[p]`` / ``probs[p]``: the model's top-K after the context up to position ``p``.

    >>> d = StoredDistributions(2)
    >>> d.append(np.array([[4, 5], [4, 6]]), np.log([[0.5, 0.5], [1.0, 1e-9]]))
    >>> [(t, round(p, 2)) for t, p in d.mixture([0, 1])]
    [(4, 0.75), (5, 0.25), (6, 0.0)]
    """

    def __init__(self, k: int) -> None:
        self.k, self.size = k, 0
        self.ids = np.zeros((256, k), dtype=np.int64)
        self.probs = np.zeros((256, k), dtype=np.float32)

    def append(self, ids: np.ndarray, logprobs: np.ndarray) -> None:
        # ids / logprobs: [n, >= K], the top-K of n newly committed positions
        n = len(ids)
        if self.size + n > len(self.ids):
            cap = max(2 * len(self.ids), self.size + n)
            self.ids = np.resize(self.ids, (cap, self.k))
            self.probs = np.resize(self.probs, (cap, self.k))
        self.ids[self.size:self.size + n] = ids[:, :self.k]
        self.probs[self.size:self.size + n] = np.exp(logprobs[:, :self.k])
        self.size += n

    def mixture(self, positions: list[int]) -> list[tuple[int, float]]:
        """The average distribution over these positions, as ``(token, probability)``."""
        out: dict[int, float] = {}
        w = 1.0 / len(positions)
        for t, q in zip(self.ids[positions].ravel().tolist(),
                        self.probs[positions].ravel().tolist()):
            out[t] = out.get(t, 0.0) + w * q
        return list(out.items())


class Lookup(NamedTuple):
    """What the committed context says about the token after a suffix."""

    n: int                            # matched n-gram length (0: no match)
    guesses: list[tuple[int, float]]  # the model's own (token, p) after the matches, best first
    bins: list[int]                   # each guess's probability bin (edges P_EDGES)
    literal: int                      # the token after the most recent match (-1: none)


NO_MATCH = Lookup(0, [], [], -1)


class ContextModel:
    """An n-gram model of the committed context built from the model's own distributions:
    the guesses after a suffix are the distributions the model gave after the most recent
    earlier occurrences of the suffix's longest matched n-gram.

    >>> cm = ContextModel(topk=2)
    >>> cm.extend([1, 2, 3, 1], np.array([[2, 3], [3, 1], [1, 2]]),
    ...           np.log([[.85, .15], [.9, .1], [.8, .2]]))
    >>> lk = cm.next_tokens((3, 1))   # "3 1" is new; after "1" the model said 2 | 3, 2 came
    >>> lk.n, [(t, round(p, 2)) for t, p in lk.guesses], lk.bins, lk.literal
    (1, [(2, 0.85), (3, 0.15)], [6, 2], 2)
    """

    def __init__(self, topk: int, max_n: int = MAX_NGRAM) -> None:
        self.index = NgramIndex(max_n)
        self.dists = StoredDistributions(topk)
        self._memo: dict[tuple, Lookup] = {}

    @property
    def tokens(self) -> list[int]:
        return self.index.tokens

    def extend(self, tokens, ids: np.ndarray | None = None,
               logprobs: np.ndarray | None = None) -> None:
        """Commit tokens, with the model's top-K at the positions that just became known
        (all but the newest token's)."""
        if ids is not None:
            self.dists.append(ids, logprobs)
        self.index.extend(tokens)
        assert self.dists.size in (0, len(self.index.tokens) - 1)

    def next_tokens(self, tail: tuple[int, ...]) -> Lookup:
        n, ends = self.index.match(tail)
        if not ends:
            return NO_MATCH
        key = (tail[-n:], len(ends))  # stored distributions never change: memoise
        hit = self._memo.get(key)
        if hit is None:
            guesses = sorted(self.dists.mixture(ends[-STAND_OCCURRENCES:]), key=lambda g: -g[1])
            hit = self._memo[key] = Lookup(n, guesses, [bisect_right(P_EDGES, p)
                                                        for _, p in guesses],
                                           self.index.tokens[ends[-1] + 1])
        return hit


# -- growing a tree best-first ------------------------------------------------------------------


class GrownTree:
    """Draft nodes in the order they were grown: best first, parents before children."""

    def __init__(self, root: int, tail: tuple[int, ...], n: int) -> None:
        self.tokens, self.parents, self.depths = [root], [-1], [0]
        self.scores, self.tails, self.n = [1.0], [tail], n
        self.child: dict[tuple[int, int], int] = {}  # (parent, token) -> node

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, token: int, parent: int, score: float) -> int:
        node = len(self.tokens)
        self.tokens.append(token)
        self.parents.append(parent)
        self.depths.append(self.depths[parent] + 1)
        self.scores.append(score)
        self.tails.append((self.tails[parent] + (token,))[-self.n:])
        self.child[(parent, token)] = node
        return node


Children = Callable[[GrownTree, int], list[tuple[int, float]]]


def grow(tree: GrownTree, children: Children, max_nodes: int, max_depth: int) -> GrownTree:
    """Algorithm 1 for any candidate source: rank candidates by cumulative score
    (``score(parent) * p``) and add the best until ``max_nodes``; ``children(tree, node)``
    proposes ``(token, p)`` under a node just added (called in the order nodes are added).

    >>> kids = {0: [(7, 0.6), (8, 0.4)], 1: [(9, 0.5)]}
    >>> t = grow(GrownTree(5, (5,), 3), lambda t, v: kids.get(v, []), 3, 10)
    >>> t.tokens, t.parents, t.scores         # 9 scores 0.3 < 0.4: it waits for node 4
    ([5, 7, 8], [-1, 0, 0], [1.0, 0.6, 0.4])
    """
    heap: list[tuple[float, int, int, int]] = []
    order = itertools.count()  # ties: the earlier candidate first

    def expand(node: int) -> None:
        if tree.depths[node] < max_depth:
            base = tree.scores[node]
            for t, p in children(tree, node):
                s = base * p
                if s >= MIN_SCORE:
                    heapq.heappush(heap, (-s, next(order), node, t))

    expand(0)
    while heap and len(tree) < max_nodes:
        neg, _, parent, token = heapq.heappop(heap)
        expand(tree.add(token, parent, -neg))
    return tree


def layout(tree: GrownTree, r: int, masked: list[int] = (), k: int = 0, vocab: int = 0
           ) -> tuple[tuple[int, ...], np.ndarray, dict[int, np.ndarray]]:
    """The first ``r`` grown nodes, plus ``k`` mask leaves (ids ``vocab + j``) under each
    ``masked`` node, in a plan's order: depth order, best first within a depth, masks after
    the draft nodes of their depth. Returns parents, tokens and each masked node's mask rows.

    >>> t = GrownTree(7, (7,), 3)
    >>> _ = t.add(8, 0, 0.5); _ = t.add(9, 1, 0.4); _ = t.add(6, 0, 0.3)
    >>> layout(t, 4)[:2]                  # 9 (depth 2) moves after 6 (depth 1)
    ((-1, 0, 0, 1), array([7, 8, 6, 9]))
    >>> layout(t, 2, masked=[0, 1], k=1, vocab=100)
    ((-1, 0, 0, 1), array([  7,   8, 100, 100]), {0: array([2]), 1: array([3])})
    """
    toks, pars = list(tree.tokens[:r]), list(tree.parents[:r])
    keys = [(d, 0, -s) for d, s in zip(tree.depths[:r], tree.scores[:r])]
    for v in masked:
        for j in range(k):
            toks.append(vocab + j)
            pars.append(v if j == 0 else len(toks) - 2)
            keys.append((tree.depths[v] + 1 + j, 1, v))
    order = sorted(range(len(toks)), key=keys.__getitem__)
    new = {old: i for i, old in enumerate(order)}
    parents = tuple(-1 if pars[o] < 0 else new[pars[o]] for o in order)
    masks_of = {new[v]: np.array([new[r + i * k + j] for j in range(k)], dtype=np.int64)
                for i, v in enumerate(masked)}
    return parents, np.array([toks[o] for o in order], dtype=np.int64), masks_of


# -- PLD ------------------------------------------------------------------------------------------


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
                 max_ngram: int = MAX_NGRAM, depth: int = MAX_DEPTH) -> None:
        self.n_draft = min(config.bc - 1, depth)
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


# -- STAND ----------------------------------------------------------------------------------------


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
        self.max_nodes, self.depth, self.max_ngram = config.bc, depth, max_ngram
        self.context = ContextModel(self.topk, max_ngram)

    def start(self, prompt_ids: np.ndarray) -> None:
        self.context = ContextModel(self.topk, self.max_ngram)
        self.context.extend(prompt_ids)

    def propose(self, root: int) -> tuple[Plan, np.ndarray]:
        cm = self.context
        tree = GrownTree(root, tuple(cm.tokens[-self.max_ngram:]), self.max_ngram)
        grow(tree, lambda t, node: cm.next_tokens(t.tails[node]).guesses, self.max_nodes,
             self.depth)
        parents, tokens, _ = layout(tree, len(tree))
        return tree_plan(parents), tokens

    def mask_embeds(self) -> None:
        return None

    def observe(self, out: StepOut, mask_rows: np.ndarray, new_tokens: list[int],
                path_rows: np.ndarray) -> None:
        self.context.extend(new_tokens, out.topk_ids[path_rows], out.topk_logprobs[path_rows])


# -- hybrid: probing + lookup in one tree ----------------------------------------------------------


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
        np.add.at(self.seen, buckets, 1.0)
        np.add.at(self.hits, buckets, np.asarray(hits, dtype=np.float64))

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
    branch, :class:`~edgemtp.lookahead.JacobiWindow`; ``HYBRID_WINDOWS``) next to the tree:
    the n-grams of its trajectories are a third candidate source, keyed by a node's token
    and followed along their continuation (the paper's App. C: fuse LADE's n-grams with
    probing). ``BC`` = tree positions + window cells <= the budget.
    """

    topk = HYBRID_TOPK

    def __init__(self, backend: Backend, config: GenerationConfig, memory: dict | None = None,
                 max_ngram: int = MAX_NGRAM, depth: int = MAX_DEPTH) -> None:
        self.k = self.mask_tokens = config.mask_tokens
        self.bc, self.depth, self.max_ngram = config.bc, depth, max_ngram
        self.vocab, self.prune, self.calibrate = backend.vocab_size, config.prune, config.calibrate
        vector = None if config.mask_vector is None else np.asarray(config.mask_vector)
        stats = backend.embedding_stats() if config.mask_init == "sample" else None
        self.embeds = MaskEmbeddings(self.k, config.mask_init, config.ema, backend.embed,
                                     stats=stats, vector=vector, seed=config.seed)
        # kept in the caller's memory, if any, so it keeps learning across generations
        window = hybrid_window(config.bc)
        self.jacobi = None if window is None else JacobiWindow(*window, pool_size=HYBRID_POOL,
                                                               seed=config.seed)
        self.tree_bc = self.bc - (0 if window is None else window[0] * window[1] - 1)
        key = ("hybrid-hit-rates", config.bc, self.k, config.prune, config.calibrate)
        fresh = HitRates(max_ngram, self.topk, jacobi=0 if window is None else window[0])
        self.rates = fresh if memory is None else memory.setdefault(key, fresh)
        self.context = ContextModel(self.topk, max_ngram)
        self._reset()

    def _reset(self) -> None:
        self._cand: tuple[list, list] | None = None  # per mask j: its top-K ids, probs
        self._tree: GrownTree | None = None
        self._asked: dict[int, tuple] = {}  # node -> what proposed its children
        self._masks_of: dict[int, np.ndarray] = {}
        self._offers: dict[int, list] = {}  # node -> Jacobi (n-gram, index) it offers
        self._plan: Plan | None = None

    def start(self, prompt_ids: np.ndarray) -> None:
        self.context = ContextModel(self.topk, self.max_ngram)
        self.context.extend(prompt_ids)
        self.embeds.start(prompt_ids)
        if self.jacobi is not None:
            self.jacobi.start(prompt_ids)
        self._reset()

    def mask_embeds(self) -> np.ndarray:
        return self.embeds.value

    def propose(self, root: int) -> tuple[Plan, np.ndarray]:
        tree = GrownTree(root, tuple(self.context.tokens[-self.max_ngram:]), self.max_ngram)
        rates = self.rates.rates().tolist() if self.calibrate else None
        chain = [0]  # the top-1 chain: mask j's candidates hang under its depth-j node
        self._asked = {}

        def children(t: GrownTree, node: int) -> list[tuple[int, float]]:
            d = t.depths[node]
            if node and d == len(chain) and t.parents[node] == chain[-1]:
                chain.append(node)
            j = d if d < len(chain) and chain[d] == node else None
            return self._children(t, node, j, rates)

        self._offers = {}
        self._tree = grow(tree, children, self.tree_bc, self.depth)
        parents, tokens, self._masks_of = place_masks(self._tree, self.tree_bc, self.k,
                                                     self.vocab, self.rates.gain)
        if self.jacobi is None:
            self._plan = tree_plan(parents)
            return self._plan, tokens
        plan, ids = self.jacobi.block(parents, tokens)
        self._plan = plan
        return plan, ids

    def observe(self, out: StepOut, mask_rows: np.ndarray, new_tokens: list[int],
                path_rows: np.ndarray) -> None:
        if self._tree is not None:  # a step: our masks are leaves of our own tree
            self._learn(new_tokens)
            mask_rows = self._masks_of.get(int(path_rows[-1]), mask_rows[:0])
            if isinstance(self._plan, LookaheadPlan):
                self.jacobi.advance(self._plan, out.argmax)
        self._cand = None
        if len(mask_rows):
            self._cand = (out.topk_ids[mask_rows].tolist(),
                          np.exp(out.topk_logprobs[mask_rows]).tolist())
        self.context.extend(new_tokens, out.topk_ids[path_rows], out.topk_logprobs[path_rows])
        self.embeds.update(new_tokens)

    def _children(self, tree: GrownTree, node: int, j: int | None,
                  rates: list[float] | None) -> list[tuple[int, float]]:
        """``(token, score)`` under ``node``."""
        h, lk = self.rates, self.context.next_tokens(tree.tails[node])
        masks = self._mask_guesses(j, tree.tokens[node])
        jac = self._jacobi_guesses(tree, node)
        self._asked[node] = lk, masks, jac
        if rates is None:
            score = dict(lk.guesses)
        else:
            score = {t: rates[b] for (t, _), b in zip(lk.guesses, h.lookup_buckets(lk))}
            if lk.literal >= 0:  # mostly the same evidence as the guesses: no noisy-or
                b = h.literal_bucket(lk.n, lk.literal == lk.guesses[0][0])
                score[lk.literal] = max(score.get(lk.literal, 0.0), rates[b])
        for rank, (t, p) in enumerate(masks):
            q = p if rates is None else rates[h.mask_bucket(rank)]
            score[t] = 1.0 - (1.0 - score.get(t, 0.0)) * (1.0 - q)
        for t, b in jac:
            q = h.prior[b] if rates is None else rates[b]
            score[t] = 1.0 - (1.0 - score.get(t, 0.0)) * (1.0 - q)
        total = sum(score.values())
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
        tok, parent = tree.tokens[node], tree.parents[node]
        offers = [(c, i + 1) for c, i in self._offers.get(parent, ())
                  if c[i] == tok and i + 1 < len(c)]
        offers.extend((c, 0) for c in self.jacobi.pool.get(tok))
        self._offers[node] = offers
        best: dict[int, int] = {}
        for c, i in offers:
            if c[i] not in best or i < best[c[i]]:
                best[c[i]] = i
        return [(t, self.rates.jacobi_bucket(i)) for t, i in best.items()]

    def _mask_guesses(self, j: int | None, parent: int) -> list[tuple[int, float]]:
        """Mask ``j``'s candidates under the chain node of depth ``j``, best first."""
        if j is None or self._cand is None or j >= len(self._cand[0]):
            return []
        pairs = zip(self._cand[0][j], self._cand[1][j])
        # §3.6: a mask echoes its node's own next token, which is the parent here
        return [(t, p) for t, p in pairs if not (self.prune and t == parent)]

    def _learn(self, truth: list[int]) -> None:
        """Hit or miss for every candidate under the true path (known to its end)."""
        h, tree, node = self.rates, self._tree, 0
        buckets: list[int] = []
        hits: list[bool] = []
        mask_only = False
        for t in truth:
            if node not in self._asked:
                break
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
            node = tree.child.get((node, t))
            if node is None:
                break
        if self.calibrate:
            self.rates.record(buckets, hits)
        if self._cand is not None:  # this step's root had mask candidates
            self.rates.record_gain(len(truth) - 1 if mask_only else 0.0)


def hybrid_window(bc: int) -> tuple[int, int] | None:
    """The hybrid's Jacobi window ``(levels, width)`` for a budget (None: no window).

    >>> hybrid_window(9), hybrid_window(10), hybrid_window(30), hybrid_window(60)
    (None, (1, 3), (1, 8), (1, 12))
    """
    return next((w for floor, w in HYBRID_WINDOWS if bc >= floor), None)


def place_masks(tree: GrownTree, bc: int, k: int, vocab: int, gain: float
                ) -> tuple[tuple[int, ...], np.ndarray, dict[int, np.ndarray]]:
    """Split the budget between the first ``r`` grown nodes and ``m`` nodes carrying ``k``
    masks each (``r + m * k <= bc``), maximising the expected accepted nodes plus ``gain``
    times the chance the accepted path ends at a masked node; lay the tree out
    (:func:`layout`).

    >>> t = GrownTree(5, (5,), 3)
    >>> _ = t.add(6, 0, 0.5); _ = t.add(7, 1, 0.05)    # 5 -> 6 (p 0.5) -> 7 (p 0.05)
    >>> place_masks(t, bc=3, k=1, vocab=100, gain=0.4)   # a root mask is worth more than 7
    ((-1, 0, 0), array([  5,   6, 100]), {0: array([2])})
    """
    s, par = np.asarray(tree.scores), np.asarray(tree.parents)
    best, choice, worse = -np.inf, (min(len(s), bc), []), 0
    # grown scores never increase, so each mask displaces a node worth at least the last
    # one's: the value rises then falls, and a few worse splits in a row end the search
    for m in range((bc - 1) // k + 1 if k else 1):
        r = min(len(s), bc - m * k)
        below = np.bincount(par[1:r], weights=s[1:r], minlength=r)
        end = np.maximum(s[:r] - below, 0.0)  # P(the accepted path ends at this node)
        top = np.argsort(-end, kind="stable")[:m]
        value = s[1:r].sum() + gain * end[top].sum()
        if value > best:
            best, choice, worse = value, (r, sorted(top.tolist())), 0
        elif (worse := worse + 1) >= 4:
            break
    r, masked = choice
    return layout(tree, r, masked, k, vocab)
