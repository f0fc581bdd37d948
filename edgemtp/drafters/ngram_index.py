"""The shared n-gram machinery of the lookup drafters: an index of where every n-gram of the
committed context ends, the model's own stored distributions at committed positions, and a
best-first tree grower laid out in a plan's order.

A tree without mask tokens costs one position per node, so a lookup tree of ``N`` nodes has
``BC = N``; every tree here is a plain tree (``Plan(parents, 0)``, compiled once per shape).
"""

from __future__ import annotations

import heapq
import itertools
import weakref
from bisect import bisect_right
from functools import lru_cache
from typing import Callable, NamedTuple

import numpy as np

from ..native import address
from ..plans import Plan

MAX_NGRAM = 3          # longest context suffix matched against earlier context (PLD's default)
STAND_OCCURRENCES = 4  # most recent matches whose stored distributions are mixed
MIN_SCORE = 1e-3       # a candidate whose cumulative score is below this never gets a node
P_EDGES = (0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9)  # probability bins of lookup candidates


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
    Appends are written when the distributions are next read (:meth:`mixture`): a step's
    top-K arrays are kept until then where they are the step's own (arrays that own their
    memory, as every backend's fresh copies do), so a decode step that only records pays no
    numpy call (after a forward that streamed the weights, each one runs cache-cold,
    ~10-40 us on a 2-core CPU), and the reads write many steps in one warm pass.

    >>> d = StoredDistributions(2)
    >>> d.append(np.array([[4, 5], [4, 6]]), np.log([[0.5, 0.5], [1.0, 1e-9]]))
    >>> [(t, round(p, 2)) for t, p in d.mixture([0, 1])]
    [(4, 0.75), (5, 0.25), (6, 0.0)]
    """

    def __init__(self, k: int) -> None:
        self.k, self.size = k, 0
        self.ids = np.zeros((256, k), dtype=np.int64)
        self.probs = np.zeros((256, k), dtype=np.float32)
        self._pending: list[tuple] = []  # (first position, ids, logprobs, rows) not written

    def append(self, ids: np.ndarray, logprobs: np.ndarray, rows=None) -> None:
        # ids / logprobs: [n, >= K], the top-K of n newly committed positions (or of the
        # block's ``rows``); kept as they are if they own their memory, else copied now
        n = len(ids) if rows is None else len(rows)
        if ids.base is not None or logprobs.base is not None:  # a view: the backend's buffer
            ids, logprobs = (np.array(a[:, :self.k] if rows is None else a[rows, :self.k])
                             for a in (ids, logprobs))
            rows = None
        self._pending.append((self.size, ids, logprobs, rows))
        self.size += n

    def skip(self, n: int) -> None:
        """``n`` positions whose distributions were not asked for: left empty (all-zero
        probabilities, no guesses), at no cost."""
        self.size += n

    def _flush(self) -> None:
        # grow by doubling (rows never written stay zero), then write what is pending
        if self.size > len(self.ids):
            cap = max(2 * len(self.ids), self.size)
            ids, probs = np.zeros((cap, self.k), np.int64), np.zeros((cap, self.k), np.float32)
            ids[:len(self.ids)], probs[:len(self.ids)] = self.ids, self.probs
            self.ids, self.probs = ids, probs
        k = self.k
        for at, ids, lp, rows in self._pending:
            s = slice(at, at + (len(ids) if rows is None else len(rows)))
            if rows is None:
                self.ids[s], self.probs[s] = ids[:, :k], lp[:, :k]
            else:
                self.ids[s], self.probs[s] = ids[rows, :k], lp[rows, :k]
            np.exp(self.probs[s], out=self.probs[s])
        self._pending = []

    def mixture(self, positions: list[int]) -> list[tuple[int, float]]:
        """The average distribution over these positions, as ``(token, probability)``."""
        if self._pending or self.size > len(self.ids):
            self._flush()
        out: dict[int, float] = {}
        w = 1.0 / len(positions)
        for t, q in zip(self.ids[positions].ravel().tolist(),
                        self.probs[positions].ravel().tolist()):
            if q > 0.0:  # (a skipped position's are all 0)
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

    def __init__(self, topk: int, max_n: int = MAX_NGRAM, native: bool = False) -> None:
        self.index = NgramIndex(max_n)
        self.dists = StoredDistributions(topk)
        self._memo: dict[tuple, Lookup] = {}
        # native=True: the index is mirrored in C, and STAND's tree grows there
        # (:meth:`grow_stand`); None where the library is not available
        self.native = NativeIndex.new(max_n) if native else None

    @property
    def tokens(self) -> list[int]:
        return self.index.tokens

    def extend(self, tokens, ids: np.ndarray | None = None,
               logprobs: np.ndarray | None = None, rows=None) -> None:
        """Commit tokens, with the model's top-K at the positions that just became known
        (all but the newest token's; ``rows``: those rows of ``ids`` / ``logprobs``)."""
        if ids is not None:
            self.dists.append(ids, logprobs, rows)
        self.index.extend(tokens)
        assert self.dists.size in (0, len(self.index.tokens) - 1)

    def next_tokens(self, tail: tuple[int, ...]) -> Lookup:
        n, ends = self.index.match(tail)
        if not ends:
            return NO_MATCH
        return self._lookup(tail, n, ends)

    def _lookup(self, tail: tuple[int, ...], n: int, ends: list[int]) -> Lookup:
        key = (tail[-n:], len(ends))  # stored distributions never change: memoise
        hit = self._memo.get(key)
        if hit is None:
            guesses = sorted(self.dists.mixture(ends[-STAND_OCCURRENCES:]), key=lambda g: -g[1])
            if not guesses:  # only skipped positions (auto recorded no distributions there)
                hit = self._memo[key] = NO_MATCH
                return hit
            hit = self._memo[key] = Lookup(n, guesses, [bisect_right(P_EDGES, p)
                                                        for _, p in guesses],
                                           self.index.tokens[ends[-1] + 1])
        return hit

    def next_tokens_at(self, tail: tuple[int, ...], length: int) -> Lookup:
        """:meth:`next_tokens` as it answered when the context held its first ``length``
        tokens (only occurrences whose follower was known then): what a tree grown then
        was given, for the hybrid's learning after a tree grown in C."""
        ends_of = self.index.ends
        for n in range(min(self.index.max_n, len(tail)), 0, -1):
            ends = ends_of.get(tuple(tail[-n:]))
            if ends:
                ends = ends[:bisect_right(ends, length - 2)]
                if ends:
                    break
        else:
            return NO_MATCH
        return self._lookup(tail, n, ends)

    def grow_stand(self, root: int, max_nodes: int, max_depth: int,
                   min_score: float = MIN_SCORE) -> GrownTree:
        """STAND's tree under ``root``: :func:`grow` with the guesses of :meth:`next_tokens`
        as each node's children, in C where :attr:`native` is set (the same tree)."""
        tail = tuple(self.tokens[-self.index.max_n:])
        if self.native is None:
            return grow(GrownTree(root, tail, self.index.max_n),
                        lambda t, v: self.next_tokens(t.tails[v]).guesses, max_nodes, max_depth,
                        min_score)
        grown = self.native.grow(self, root, tail, max_nodes, max_depth, min_score)
        if grown is None:  # a token id the C index cannot hold: Python from here on
            self.native = None
            return self.grow_stand(root, max_nodes, max_depth, min_score)
        return GrownTree.from_arrays(*grown, tail, self.index.max_n)

    def stand_layout(self, root: int, max_nodes: int, max_depth: int,
                     min_score: float = MIN_SCORE) -> tuple[tuple[int, ...], np.ndarray, int]:
        """``layout(grow_stand(...), len(tree))`` as parents, tokens and the node count,
        without building the tree in Python where :attr:`native` is set."""
        if self.native is None:
            tree = self.grow_stand(root, max_nodes, max_depth, min_score)
            parents, tokens, _ = layout(tree, len(tree))
            return parents, tokens, len(tree)
        tail = tuple(self.tokens[-self.index.max_n:])
        out = self.native.layout(self, root, tail, max_nodes, max_depth, min_score)
        if out is None:
            self.native = None
            return self.stand_layout(root, max_nodes, max_depth, min_score)
        return out


class NativeIndex:
    """The C mirror of a :class:`NgramIndex` (``edgemtp/native/ngram.c``), and STAND's
    grower over it and a :class:`StoredDistributions`' arrays. Buffers are allocated once and
    their addresses kept (``ndarray.ctypes`` costs ~1 us a use: several per step)."""

    OCCURRENCES, TOKEN_LIMIT, MAX_N = 4, 1 << 20, 3  # what ngram.c is compiled for

    def __init__(self, lib, handle: int) -> None:
        self.lib, self.handle = lib, handle
        weakref.finalize(self, lib.ctx_free, handle)
        self._cap = 0
        self._grow_out(64)
        self._in = np.zeros(64, dtype=np.int64)  # tokens of a step, and the root's tail
        self._in_at = self._in.ctypes.data
        self._dists: tuple = (None, None, 0, 0)  # (ids, probs) arrays and their addresses
        self._synced = 0  # the context's tokens the C index holds
        self._ip = np.zeros(15, dtype=np.int64)  # ctx_grow_hybrid's integer parameters
        self._ip_at = self._ip.ctypes.data
        self._info = np.zeros(2, dtype=np.int64)
        self._info_at = self._info.ctypes.data
        self._nm = np.zeros(1, dtype=np.int32)
        self._nm_at = self._nm.ctypes.data
        self.grown: tuple | None = None  # the last hybrid tree (grow_hybrid)
        self.trees = 0  # trees grown here (the buffers hold the last one's)

    @classmethod
    def new(cls, max_n: int) -> NativeIndex | None:
        from .. import native
        lib = native.lib()
        if lib is None or STAND_OCCURRENCES != cls.OCCURRENCES or not 1 <= max_n <= cls.MAX_N:
            return None
        handle = lib.ctx_new(max_n)
        return None if not handle else cls(lib, handle)

    def _grow_out(self, n: int) -> None:
        if n <= self._cap:
            return
        self._cap = n = max(n, 2 * self._cap)
        # the grown nodes' tokens, parents, depths and scores; a layout's parents and ids; the
        # masked nodes of a split; the layout's mask rows
        self._out = [np.zeros(n, dtype=d) for d in
                     (np.int32, np.int32, np.int32, np.float64, np.int32, np.int64, np.int32,
                      np.int64)]
        self._out_at = [a.ctypes.data for a in self._out]

    def _prepare(self, cm: ContextModel, tail: tuple, max_nodes: int) -> tuple[int, int]:
        # the tokens committed since the last call go in with it: the mirror costs nothing
        # on steps that grow no tree (auto's); returns (new tokens, tail length) as laid out
        # in the input buffer (the tail, then the new tokens)
        dists, tokens = cm.dists, cm.index.tokens
        if dists._pending or dists.size > len(dists.ids):
            dists._flush()
        if self._dists[0] is not dists.ids or self._dists[1] is not dists.probs:
            self._dists = (dists.ids, dists.probs, dists.ids.ctypes.data,
                           dists.probs.ctypes.data)
        self._grow_out(max_nodes)
        nt, new = len(tail), len(tokens) - self._synced
        if new + nt > len(self._in):
            self._in = np.zeros(2 * (new + nt), dtype=np.int64)
            self._in_at = self._in.ctypes.data
        self._in[:nt] = tail
        self._in[nt:nt + new] = tokens[self._synced:]
        return new, nt

    def _done(self, n: int, cm: ContextModel) -> int | None:
        self.trees += 1
        if n == -2:
            return None
        if n < 0:
            raise MemoryError("the native tree grower ran out of memory")
        self._synced = len(cm.index.tokens)
        return n

    def _grow(self, cm: ContextModel, root: int, tail: tuple, max_nodes: int,
              max_depth: int, min_score: float) -> int | None:
        new, nt = self._prepare(cm, tail, max_nodes)
        o, dists = self._out_at, cm.dists
        return self._done(self.lib.ctx_grow(
            self.handle, self._in_at + 8 * nt, new, self._dists[2], self._dists[3],
            min(dists.size, len(dists.ids)), dists.k, root, self._in_at, nt, max_nodes,
            max_depth, min_score, o[0], o[1], o[2], o[3]), cm)

    def grow_hybrid(self, cm: ContextModel, root: int, tail: tuple, max_nodes: int,
                    max_depth: int, min_score: float, rates: np.ndarray | None,
                    prior: np.ndarray, buckets: tuple[int, int, int, int],
                    cand: tuple[np.ndarray, np.ndarray] | None, prune: bool,
                    pool: NativePool | None) -> tuple[list, list, list, list] | None:
        """The hybrid drafter's tree (``HybridDrafter.propose``'s :func:`grow`): ``rates``
        per hit-rate bucket (None: raw probabilities, ``calibrate=False``), ``buckets`` =
        (bins per n, first literal, first mask, first Jacobi bucket), ``cand``: the mask
        rows' candidate ids and probabilities ``[rows, K]``, ``pool``: the Jacobi window's
        n-gram pool. The grown nodes as :meth:`grow` gives them; None as there."""
        new, nt = self._prepare(cm, tail, max_nodes)
        dists = cm.dists
        kmask, ck = (0, 0) if cand is None else cand[0].shape
        ip = self._ip
        ip[:] = (new, min(dists.size, len(dists.ids)), dists.k, root, nt, max_nodes,
                 max_depth, *buckets, kmask, ck, int(prune), int(rates is not None))
        o = self._out_at
        n = self.lib.ctx_grow_hybrid(
            self.handle, self._ip_at, min_score, self._in_at + 8 * nt, self._dists[2],
            self._dists[3], self._in_at, None if rates is None else address(rates),
            address(prior), None if cand is None else address(cand[0]),
            None if cand is None else address(cand[1]),
            None if pool is None else pool.sync(), o[0], o[1], o[2], o[3])
        n = self._done(n, cm)
        if n is None:
            return None
        # what learning from this tree reads again: its parameters and nodes stay in this
        # index's buffers until the next tree (:meth:`learn_hybrid` checks the count)
        self.grown = (self.trees, n, tuple(tail))
        return tuple(a[:n].tolist() for a in self._out[:4])

    def learn_hybrid(self, cm: ContextModel, grown: tuple, truth: list[int],
                     cand: tuple[np.ndarray, np.ndarray] | None, pool: NativePool | None,
                     counts: tuple[int, int] | None) -> tuple[bool, int] | None:
        """``HybridDrafter._learn`` for the tree ``grown`` (:attr:`grown` after
        :meth:`grow_hybrid`): adds every candidate on the accepted path to the hit rates'
        ``counts`` (the addresses of their hits and seen arrays; None: ``calibrate=False``).
        Returns whether the root's true token came from the masks alone, and the accepted
        tokens only the Jacobi window proposed; None where this index has grown another tree
        since (the caller learns in Python then)."""
        trees, n, tail = grown
        if trees != self.trees:
            return None
        dists = cm.dists
        if self._dists[0] is not dists.ids or self._dists[1] is not dists.probs:
            self._dists = (dists.ids, dists.probs, dists.ids.ctypes.data,
                           dists.probs.ctypes.data)
        nt, m = len(tail), len(truth)
        if nt + m > len(self._in):
            self._in = np.zeros(2 * (nt + m), dtype=np.int64)
            self._in_at = self._in.ctypes.data
        self._in[:nt] = tail
        self._in[nt:nt + m] = truth
        o, info = self._out_at, self._info
        if self.lib.ctx_learn_hybrid(
                self.handle, self._ip_at, self._in_at + 8 * nt, m, o[0], o[1], o[2], n,
                self._dists[2], self._dists[3], self._in_at,
                None if cand is None else address(cand[0]),
                None if pool is None else pool.handle,
                None if counts is None else counts[0], None if counts is None else counts[1],
                self._info_at):
            raise MemoryError("the native learner ran out of memory")
        return bool(info[0]), int(info[1])

    def place_masks(self, n: int, bc: int, k: int, vocab: int, gain: float, min_score: float
                    ) -> tuple[tuple[int, ...], np.ndarray, dict[int, np.ndarray]] | None:
        """:func:`~edgemtp.drafters.hybrid.place_masks` for the tree this index grew last
        (``n`` nodes), split and laid out here: the same parents, ids and mask rows as
        :func:`layout` of the same split. None where the split would not fit the buffers
        (a budget above the tree's node limit: the caller lays it out in Python)."""
        if bc > self._cap:
            return None
        o = self._out_at
        r = self.lib.ctx_place_masks(n, o[3], o[1], bc, k, gain, min_score, o[6],
                                     self._nm_at)
        if r < 0:
            raise MemoryError("the native mask placement ran out of memory")
        m = int(self._nm[0])
        total = self.lib.ctx_layout(r, o[0], o[1], o[2], o[3], o[6], m, k, vocab, o[4], o[5],
                                    o[7])
        if total < 0:
            raise MemoryError("the native tree layout ran out of memory")
        parents = self._out[4][:total].tolist()
        rows = self._out[7][:m * k].reshape(m, k)
        # each masked node (the parent of its first mask) and its mask rows, in rows' order
        masks_of = {parents[int(rows[i, 0])]: rows[i].copy() for i in range(m)}
        return tuple(parents), self._out[5][:total].copy(), masks_of

    def grow(self, cm: ContextModel, root: int, tail: tuple, max_nodes: int, max_depth: int,
             min_score: float) -> tuple[list, list, list, list] | None:
        """The grown nodes' tokens, parents, depths and scores, in the order grown; None
        where a token id is outside what the C index holds."""
        n = self._grow(cm, root, tail, max_nodes, max_depth, min_score)
        return None if n is None else tuple(a[:n].tolist() for a in self._out[:4])

    def layout(self, cm: ContextModel, root: int, tail: tuple, max_nodes: int, max_depth: int,
               min_score: float) -> tuple[tuple[int, ...], np.ndarray, int] | None:
        n = self._grow(cm, root, tail, max_nodes, max_depth, min_score)
        if n is None:
            return None
        o = self._out_at
        if self.lib.ctx_layout(n, o[0], o[1], o[2], o[3], None, 0, 0, 0, o[4], o[5], None) < 0:
            raise MemoryError("the native tree layout ran out of memory")
        return tuple(self._out[4][:n].tolist()), self._out[5][:n].copy(), n


class NativePool:
    """The C mirror of a LADE n-gram pool (:class:`~edgemtp.drafters.lookahead.NgramPool`,
    same rows, same order): the pool's adds are queued and sent in one call when a tree is
    next grown (:meth:`sync`)."""

    def __init__(self, lib, size: int, levels: int) -> None:
        self.lib, self.levels = lib, levels
        self.handle = lib.pool_new(size, levels)
        if not self.handle:
            raise MemoryError("the native n-gram pool could not be allocated")
        weakref.finalize(self, lib.pool_free, self.handle)
        self.pending: list[tuple[int, ...]] = []

    def sync(self) -> int:
        if self.pending:
            rows = np.array(self.pending, dtype=np.int64)
            self.pending = []
            if self.lib.pool_add_many(self.handle, rows.ctypes.data, len(rows)):
                raise MemoryError("the native n-gram pool could not grow")
        return self.handle


# -- growing a tree best-first ------------------------------------------------------------------


class GrownTree:
    """Draft nodes in the order they were grown: best first, parents before children."""

    def __init__(self, root: int, tail: tuple[int, ...], n: int) -> None:
        self.tokens, self.parents, self.depths = [root], [-1], [0]
        self.scores, self.tails, self.n = [1.0], [tail], n
        self.child: dict[tuple[int, int], int] = {}  # (parent, token) -> node

    def __len__(self) -> int:
        return len(self.tokens)

    @classmethod
    def from_arrays(cls, tokens: list, parents: list, depths: list, scores: list,
                    tail: tuple[int, ...], n: int) -> GrownTree:
        """A tree grown elsewhere (:class:`NativeIndex`), nodes in the order grown; only the
        root's tail is kept (the tree is not grown further). Its ``child`` table is built
        when first read (a hybrid step grown and learned from in C never reads it)."""
        t = cls.__new__(cls)
        t.tokens, t.parents, t.depths, t.scores = tokens, parents, depths, scores
        t.tails, t.n = [tail], n
        return t

    def __getattr__(self, name: str):
        if name != "child":  # (only a tree from from_arrays lacks an attribute: its table)
            raise AttributeError(name)
        self.child = {(p, x): v for v, (p, x) in enumerate(zip(self.parents, self.tokens)) if v}
        return self.child

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


def grow(tree: GrownTree, children: Children, max_nodes: int, max_depth: int,
         min_score: float = MIN_SCORE) -> GrownTree:
    """Algorithm 1 for any candidate source: rank candidates by cumulative score
    (``score(parent) * p``) and add the best until ``max_nodes``; ``children(tree, node)``
    proposes ``(token, p)`` under a node just added (called in the order nodes are added).
    A candidate scoring under ``min_score`` never gets a node (``tree_cost``: what a node
    must add to pay for itself on this device).

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
                if s >= min_score:
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
