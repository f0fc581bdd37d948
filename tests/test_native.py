"""The native (C) STAND grower (``edgemtp/native/ngram.c``): the same trees as the Python
grower, node for node and score for score, on random contexts with ties, zero probabilities
and repeated ids; the fallback where it cannot run; and whole generations that are the same
with it and without it."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgemtp import GenerationConfig, native
from edgemtp.drafters.ngram_index import (MIN_SCORE, ContextModel, GrownTree, NativeIndex, grow,
                                          layout)
from edgemtp.engine import Generation
from edgemtp.runtimes.torch_backend import TorchBackend

pytestmark = pytest.mark.skipif(native.lib() is None,
                                reason=f"no native library here: {native.why_not()}")


def _python_tree(cm: ContextModel, root: int, max_nodes: int, max_depth: int, min_score: float):
    tail = tuple(cm.tokens[-cm.index.max_n:])
    return grow(GrownTree(root, tail, cm.index.max_n),
                lambda t, v: cm.next_tokens(t.tails[v]).guesses, max_nodes, max_depth, min_score)


def _fill(rng, k: int, vocab: int, rows: int, ties: bool, dup: bool):
    ids = rng.integers(0, vocab, (rows, k))
    lp = np.log(rng.dirichlet(np.full(k, 0.3), rows)).astype(np.float32)
    if ties:  # equal probabilities: the order among them is the tie break
        lp[:] = np.float32(np.log(1.0 / k))
    if dup:  # one id over and over: its probabilities add up
        ids[:] = ids[:, :1]
    if rng.random() < 0.2:
        lp[:, -1] = -np.inf  # a zero probability: never a guess
    return ids, lp


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), vocab=st.integers(2, 40), k=st.integers(1, 12),
       n=st.integers(6, 300), max_n=st.integers(1, 3))
def test_native_trees_equal_the_python_grower(seed, vocab, k, n, max_n):
    rng = np.random.default_rng(seed)
    fast, slow = ContextModel(k, max_n, native=True), ContextModel(k, max_n)
    assert fast.native is not None and slow.native is None
    tokens = rng.integers(0, vocab, n)
    first = _fill(rng, k, vocab, 4, False, False)
    for cm in (fast, slow):
        cm.extend(tokens[:5], *first)
    at, grown = 5, 0
    while at < n:
        new = tokens[at:at + int(rng.integers(1, 6))]
        dist = _fill(rng, k, vocab, len(new), rng.random() < 0.3, rng.random() < 0.2)
        for cm in (fast, slow):
            cm.extend(new.tolist(), *dist)
        at += len(new)
        if rng.random() < 0.4:
            root = slow.tokens[-1]
            nodes, depth = int(rng.integers(0, 70)), int(rng.integers(1, 11))
            # 0.5, 0.25: scores a tied k = 2 or 4 distribution reaches exactly (float32
            # halves), so a node right on the floor is kept by both (qa10a N2: C's ">=" as
            # ">" went unseen)
            floor = float(rng.choice([MIN_SCORE, 0.0, 0.05, 0.25, 0.5]))
            want = _python_tree(slow, root, nodes, depth, floor)
            got = fast.grow_stand(root, nodes, depth, floor)
            assert (got.tokens, got.parents, got.depths, got.scores) == (
                want.tokens, want.parents, want.depths, want.scores)
            assert got.child == want.child
            parents, ids, count = fast.stand_layout(root, nodes, depth, floor)
            want_parents, want_ids, _ = layout(want, len(want))
            assert (parents, ids.tolist(), count) == (want_parents, want_ids.tolist(), len(want))
            grown += 1
    assert fast.native is not None  # it ran in C throughout


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 70), k=st.integers(0, 3),
       ties=st.booleans())
def test_native_layout_with_masks_equals_the_python_layout(seed, n, k, ties):
    """ctx_layout (the hybrid's split laid out in C): the same parents, ids and mask rows as
    :func:`layout`, for any first r nodes of a grown tree and any masked subset of them,
    equal scores (the grow order breaks ties) and masks deeper than every node included."""
    rng = np.random.default_rng(seed)
    tree = GrownTree(int(rng.integers(0, 50)), (1,), 3)
    for _ in range(n - 1):  # scores never rise as a tree grows; ties where asked
        parent = int(rng.integers(0, len(tree)))
        s = tree.scores[-1] if ties and rng.random() < 0.5 else tree.scores[-1] * rng.random()
        tree.add(int(rng.integers(0, 50)), parent, float(s))
    r = int(rng.integers(1, n + 1))
    masked = sorted(rng.choice(r, int(rng.integers(0, r + 1)), replace=False).tolist()) if k \
        else []
    want_par, want_tok, want_rows = layout(tree, r, masked, k, 1000)
    lib = native.lib()
    arr = [np.array(a, dtype=d) for a, d in ((tree.tokens, np.int32), (tree.parents, np.int32),
                                             (tree.depths, np.int32), (tree.scores, np.float64),
                                             (masked or [0], np.int32))]
    total = r + len(masked) * k
    par, tok, rows = (np.zeros(max(total, 1), d) for d in (np.int32, np.int64, np.int64))
    got = lib.ctx_layout(r, *(a.ctypes.data for a in arr), len(masked), k, 1000,
                         par.ctypes.data, tok.ctypes.data, rows.ctypes.data)
    assert got == total
    assert tuple(par[:total].tolist()) == want_par
    assert tok[:total].tolist() == want_tok.tolist()
    for i, v in enumerate(masked):
        node = want_par[int(rows[i * k])]  # the masked node: its first mask's parent
        assert rows[i * k:(i + 1) * k].tolist() == want_rows[node].tolist()
    assert len(want_rows) == len(masked)


def test_a_token_id_the_c_index_cannot_hold_falls_back_to_python():
    cm = ContextModel(2, 3, native=True)
    big = NativeIndex.TOKEN_LIMIT + 5
    ids = np.array([[7, big], [big, 7], [7, 8]])
    lp = np.log(np.array([[0.6, 0.4], [0.9, 0.1], [0.5, 0.5]], dtype=np.float32))
    cm.extend([7, big, 7, big], ids, lp)
    ref = ContextModel(2, 3)
    ref.extend([7, big, 7, big], ids, lp)
    tree = cm.grow_stand(big, 10, 5)
    assert cm.native is None  # from here on the Python grower
    want = _python_tree(ref, big, 10, 5, MIN_SCORE)
    assert (tree.tokens, tree.scores) == (want.tokens, want.scores) and len(tree) > 1


def test_edgemtp_native_0_turns_it_off(monkeypatch):
    monkeypatch.setenv("EDGEMTP_NATIVE", "0")
    assert native.lib() is None and native.why_not() == "EDGEMTP_NATIVE=0"
    assert ContextModel(4, 3, native=True).native is None


def test_a_failed_build_is_an_error_the_loader_turns_into_none(monkeypatch, tmp_path):
    # a compiler that fails: _build raises OSError with its first line (lib() then keeps None
    # and the reason; the process's own library is already loaded, so _build is called here)
    monkeypatch.setenv("EDGEMTP_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "false")
    with pytest.raises(OSError, match="false failed"):
        native._build()
    assert not list(tmp_path.iterdir())  # nothing half-written is left
    monkeypatch.delenv("CC")
    built = native._build()
    assert built.parent == tmp_path  # (and a compiler that works builds there)
    # another $CC builds a library of its own, not the one the default compiler made
    # (qa10b: a sanitizer build was reused by a later plain one, and the other way round)
    import shutil

    monkeypatch.setenv("CC", shutil.which("cc") or shutil.which("gcc"))
    other = native._build()
    assert other != built and other.exists() and built.exists()
    assert native._build() == other


def test_a_build_prunes_old_versions_from_the_cache(monkeypatch, tmp_path):
    """Each source version (and CPU) builds a library of its own; a new build keeps the
    newest few of its kind and leaves other files alone."""
    import os

    monkeypatch.setenv("EDGEMTP_CACHE", str(tmp_path))
    for i in range(6):  # older builds of this source, oldest first
        f = tmp_path / f"heads-{i:016x}.so"
        f.write_bytes(b"old")
        os.utime(f, (1000 + i, 1000 + i))
    other = tmp_path / "ngram-0000000000000000.so"
    other.write_bytes(b"other kind")
    new = native._build(native.HEADS_SOURCE, (("-O3",),))
    left = sorted(f.name for f in tmp_path.glob("heads-*.so"))
    assert new.name in left and len(left) == native.KEEP
    assert {f"heads-{i:016x}.so" for i in (3, 4, 5)} <= set(left)  # the newest old ones
    assert other.exists()


def test_the_heads_kernel_falls_back_to_the_portable_build(monkeypatch, tmp_path):
    """heads.c: this machine's vector units first, then plain -O3 where the compiler refuses
    an option; one library per option set (and per CPU for -march=native)."""
    monkeypatch.setenv("EDGEMTP_CACHE", str(tmp_path))
    bogus = (("-O3", "-fno-such-option-here"), ("-O3",))
    out = native._build(native.HEADS_SOURCE, bogus)
    assert out.parent == tmp_path and out.name.startswith("heads-")
    assert [p.name for p in tmp_path.iterdir()] == [out.name]  # the failed try left nothing
    assert native._build(native.HEADS_SOURCE, bogus) == out     # built once
    best = native._build(native.HEADS_SOURCE, native.HEADS_OPTIONS)
    assert best != out
    import ctypes

    lib = native._declare_heads(ctypes.CDLL(str(best)))
    bad = native.HeadsCall(kind=0, d=0, heads=1, m=8, k=1)  # shapes it refuses: -1, no crash
    assert lib.heads_run(ctypes.addressof(bad), 0) == -1
    root = native.HeadsCall(kind=1, d=4, w=4, heads=1, c=8, m=8, k=1, by_id=1)
    assert lib.heads_run(ctypes.addressof(root), 8) == -1  # a root past the chain's rows


@pytest.mark.parametrize("drafter", ["stand", "auto"])
def test_generations_are_the_same_with_and_without_it(stories_refs, drafter, monkeypatch):
    """STAND and auto (its STAND trees) with the C grower and without: the same tokens in the
    same number of forward passes (auto: its trees' sizes follow measured host time, so only
    the tokens are compared)."""
    hf, prompts, refs = stories_refs
    backend = TorchBackend.from_model(hf)
    config = GenerationConfig(drafter=drafter, bc=30, max_new_tokens=64)
    runs = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("EDGEMTP_NATIVE", flag)
        runs[flag] = [Generation(backend, config, p).run() for p in prompts[:4]]
    for i, (a, b) in enumerate(zip(runs["1"], runs["0"])):
        assert a.token_ids == b.token_ids == refs[i][:len(a.token_ids)]
        if drafter == "stand":
            assert a.stats.forward_calls == b.stats.forward_calls


def test_doctor_says_which_grower_runs(monkeypatch):
    from edgemtp import doctor
    text = doctor.report(doctor.probe())
    assert "drafting  STAND trees in C" in text and "learned heads in C where faster" in text
    monkeypatch.setenv("EDGEMTP_NATIVE", "0")
    text = doctor.report(doctor.probe())
    assert "drafting  STAND trees in Python (EDGEMTP_NATIVE=0" in text
    assert "learned heads in onnxruntime (EDGEMTP_NATIVE=0)" in text


@pytest.mark.parametrize("bc,calibrate,prune,learn_in_c", [
    (10, True, True, True), (30, False, True, True), (60, True, False, True),
    (30, True, True, False)])
def test_hybrid_trees_are_the_same_with_and_without_it(stories_refs, bc, calibrate, prune,
                                                        learn_in_c, monkeypatch):
    """The hybrid's every tree (mask leaves, Jacobi window rows and all), step by step over
    several generations that share its learned hit rates, grown in C and in Python (and
    learned from in C, or in Python from a tree grown in C)."""
    from edgemtp.drafters.hybrid import HybridDrafter
    monkeypatch.setattr(HybridDrafter, "learn_in_c", learn_in_c)
    hf, prompts, refs = stories_refs
    backend = TorchBackend.from_model(hf)
    config = GenerationConfig(drafter="hybrid", bc=bc, max_new_tokens=48, calibrate=calibrate,
                              prune=prune)
    propose, seen = HybridDrafter.propose, []

    def recorded(self, root):
        plan, ids = propose(self, root)
        seen.append((plan.parents, ids.tolist(), self._grown_at is not None))
        return plan, ids

    monkeypatch.setattr(HybridDrafter, "propose", recorded)
    runs = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("EDGEMTP_NATIVE", flag)
        seen.clear()
        memory: dict = {}  # the hit rates carry across the prompts, as in a loaded Model
        outs = [Generation(backend, config, p, memory=memory).run().token_ids
                for p in prompts[:4]]
        runs[flag] = outs, list(seen)
    (fast, fast_trees), (slow, slow_trees) = runs["1"], runs["0"]
    assert all(grown_in_c for *_, grown_in_c in fast_trees)
    assert not any(grown_in_c for *_, grown_in_c in slow_trees)
    assert [t[:2] for t in fast_trees] == [t[:2] for t in slow_trees]
    for i, out in enumerate(fast):
        assert out == slow[i] == refs[i][:len(out)]


def test_a_hybrid_that_loses_the_c_grower_mid_generation_goes_on_in_python(stories_refs,
                                                                           monkeypatch):
    """Where the C grower gives up (a token id it cannot hold), the hybrid carries on in
    Python with the same state: the same tokens as the all-Python run, and the pool mirror
    stops queueing."""
    from edgemtp.drafters.hybrid import HybridDrafter
    hf, prompts, refs = stories_refs
    backend = TorchBackend.from_model(hf)
    config = GenerationConfig(drafter="hybrid", bc=30, max_new_tokens=48)
    real, calls, drafters = NativeIndex.grow_hybrid, [0], []

    def flaky(self, *a, **kw):
        calls[0] += 1
        return None if calls[0] == 5 else real(self, *a, **kw)

    start = HybridDrafter.start

    def kept(self, prompt_ids):
        drafters.append(self)
        start(self, prompt_ids)

    monkeypatch.setattr(NativeIndex, "grow_hybrid", flaky)
    monkeypatch.setattr(HybridDrafter, "start", kept)
    out = Generation(backend, config, prompts[0]).run().token_ids
    assert out == refs[0][:len(out)]
    d = drafters[0]
    assert calls[0] == 5 and d.context.native is None and d.jacobi.pool.native is None
    assert d._grown_at is None  # the last trees grew in Python
