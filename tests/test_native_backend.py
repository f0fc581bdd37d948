"""The native backend (``--backend native``): an int4 package's decoder in edgemtp's own C.

What must hold: it computes the package's int4 model (its weights, int8 activations per block
of 32) to float32 rounding; a row's logits are bitwise the same in any block as in plain
decoding, so every drafter's greedy output equals its plain decoding; threads and the
portable build change no bit; what it cannot run is one line naming the backend that can; a
graph it would read wrong is refused at load. stories260K, one int4 export per module.
"""

import ctypes
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")
from onnx import numpy_helper  # noqa: E402

from edgemtp import Model, native  # noqa: E402
from edgemtp.api import auto_backend  # noqa: E402
from edgemtp.errors import ConfigError, ModelLoadError  # noqa: E402
from edgemtp.export.onnx_export import export_package  # noqa: E402
from edgemtp.runtimes.host_table import _unpack  # noqa: E402
from edgemtp.runtimes.native_backend import (MAX_DIFF, MIN_SAME, NativeBackend, Q4W,  # noqa: E402
                                              _attrs, _Graph)

SHARED = Path(__file__).resolve().parents[1] / ".." / "shared"
STORIES = SHARED / "models" / "stories260K"
DRAFTERS = ("probe", "pld", "hybrid", "lade", "stand", "auto")

if native.decoder_lib() is None:
    pytest.skip(f"no C decoder here: {native.decoder_why_not()}", allow_module_level=True)


@pytest.fixture(scope="module")
def int4_pkg(tmp_path_factory):
    out = tmp_path_factory.mktemp("native") / "stories-int4"
    export_package(str(STORIES), out, dtype="int4", max_context=256, progress=False)
    return out


@pytest.fixture(scope="module")
def backend(int4_pkg):
    return NativeBackend(str(int4_pkg), threads=1)


def _dequant(g: _Graph, node) -> np.ndarray:
    a = _attrs(node)
    n, k, bits = a["N"], a["K"], a.get("bits", 4)
    b = g.array(node.input[1])
    nb = b.shape[1]
    sc = g.array(node.input[2]).reshape(n, nb)
    if bits == 8:  # (an 8-bit LM head: a byte a code, a byte a zero point)
        q = b.reshape(n, nb * 32).astype(np.float32)
        zp = g.array(node.input[3]).reshape(n, nb).astype(np.float32)
        return ((q.reshape(n, nb, 32) - zp[:, :, None]) * sc[:, :, None]).reshape(n, -1)[:, :k]
    q = _unpack(b.reshape(n, -1), 4)[:, :nb * 32].astype(np.float32)
    zp = _unpack(g.array(node.input[3]).reshape(n, -1), 4)[:, :nb].astype(np.float32)
    return ((q.reshape(n, nb, 32) - zp[:, :, None]) * sc[:, :, None]).reshape(n, -1)[:, :k]


def reference_logits(backend, ids: np.ndarray) -> np.ndarray:
    """The package's int4 model in numpy, causal, with decoder.c's roundings (activations to
    int8 per block of 32, round half to even; cached K and V to float16) and float64
    products: what the decoder computes, up to float32 rounding."""
    m = backend.package.manifest
    g = _Graph(backend.package.graph_path)
    L, H, Hkv, D = m["num_layers"], m["num_heads"], m["num_kv_heads"], m["head_dim"]
    nodes = [n for n in g.model.graph.node if n.op_type == "MatMulNBits"]
    rot = [n for n in g.model.graph.node if n.op_type == "RotaryEmbedding"]
    cos, sin = g.array(rot[1].input[2]), g.array(rot[1].input[3])
    t = len(ids)

    def lin(x, node):
        k = x.shape[1]
        nb = -(-k // 32)
        xp = np.zeros((t, nb * 32), np.float32)
        xp[:, :k] = x
        xb = xp.reshape(t, nb, 32)
        amax = np.abs(xb).max(-1, keepdims=True)
        q = np.rint(xb * np.where(amax > 0, 127 / np.where(amax > 0, amax, 1), 0))
        x = (q * (amax / 127)).reshape(t, -1)[:, :k]
        return (x.astype(np.float64) @ _dequant(g, node).T.astype(np.float64)).astype(np.float32)

    def rms(x, name):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-5) * g.array(name)

    def rope(z):
        c, s, h = cos[:t, None], sin[:t, None], D // 2
        a, b = z[..., :h], z[..., h:]
        return np.concatenate([a * c - b * s, b * c + a * s], -1)

    x = backend.embed(ids)
    causal = np.tril(np.ones((t, t), bool))
    for i in range(L):
        qkv = lin(rms(x, f"decoder.model.layers.{i}.input_layernorm.weight"), nodes[4 * i])
        q = rope(qkv[:, :H * D].reshape(t, H, D))
        # the cache keeps K and V in half precision
        k = rope(qkv[:, H * D:(H + Hkv) * D].reshape(t, Hkv, D)).astype(np.float16)
        v = qkv[:, (H + Hkv) * D:].reshape(t, Hkv, D).astype(np.float16)
        k, v = k.astype(np.float32), v.astype(np.float32)
        out = np.zeros((t, H, D), np.float32)
        for h in range(H):
            kv = h // (H // Hkv)
            s = np.where(causal, q[:, h] @ k[:, kv].T * D ** -0.5, -np.inf)
            p = np.exp(s - s.max(1, keepdims=True))
            out[:, h] = (p / p.sum(1, keepdims=True)) @ v[:, kv]
        x = x + lin(out.reshape(t, -1), nodes[4 * i + 1])
        gu = lin(rms(x, f"decoder.model.layers.{i}.post_attention_layernorm.weight"),
                 nodes[4 * i + 2])
        f = gu.shape[1] // 2
        x = x + lin(gu[:, :f] / (1 + np.exp(-gu[:, :f])) * gu[:, f:], nodes[4 * i + 3])
    return lin(rms(x, "decoder.model.norm.weight"), nodes[-1])


def _prefill(backend, ids, lib=None):
    s = backend.session()
    out = s.forward(ids, np.arange(len(ids)), np.tril(np.ones((len(ids),) * 2, bool)), None,
                    full_logits=True)
    s.commit(np.arange(len(ids)))
    return s, out


def test_decoder_computes_the_packages_int4_model(backend):
    ids = np.random.default_rng(0).integers(0, backend.vocab_size, 24)
    got = _prefill(backend, ids)[1].logits
    want = reference_logits(backend, ids)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    # the load check against onnxruntime ran, and passed
    assert backend.probe["argmax_same"] >= MIN_SAME and backend.probe["max_diff"] <= MAX_DIFF


def test_an_export_s_scales_are_read_as_halves(int4_pkg, backend):
    # the export rounds every block scale to a half-precision value (export.quantize.
    # half_scales), and the decoder then holds them in 2 bytes: the same products
    # (tests/c/q4_kernels.c checks every kernel both ways), 10 % fewer bytes a step
    proto = onnx.load(str(int4_pkg / "model.onnx"))
    names = {n.input[2] for n in proto.graph.node if n.op_type == "MatMulNBits"}
    for init in proto.graph.initializer:
        if init.name in names:
            a = numpy_helper.to_array(init)
            assert np.array_equal(a.astype(np.float16).astype(a.dtype), a), init.name
    assert backend.scales == "fp16"


def test_scales_that_are_not_halves_stay_floats():
    from edgemtp.runtimes.native_backend import pack_q4

    q = np.random.default_rng(0).integers(0, 16, (20, 64)).astype(np.uint8)
    zp = np.full((20, 2), 8, np.uint8)
    assert pack_q4(q, np.full((20, 2), 0.125, np.float32), zp)[3].dtype == np.float16
    s = np.full((20, 2), 0.1, np.float32)  # 0.1 is no half
    got = pack_q4(q, s, zp)[3]
    assert got.dtype == np.float32 and got.shape == (2, 2, 16) and got[0, 0, 0] == s[0, 0]
    assert pack_q4(q, np.full((20, 2), 7e4, np.float32), zp)[3].dtype == np.float32


def test_weights_sit_in_one_huge_page_arena_in_the_order_a_step_reads_them(backend):
    from edgemtp.runtimes.native_backend import HUGE, _Arena

    a = _Arena()
    a.CHUNK = 4 << 20
    rng = np.random.default_rng(0)
    srcs = [rng.integers(0, 255, n).astype(np.uint8) for n in (100, 3 << 20, 5 << 20, 7)]
    srcs.append(rng.standard_normal((3, 5)).astype(np.float16).T)  # not C order
    got = [a.put(x) for x in srcs]
    for x, y in zip(srcs, got):
        assert y.dtype == x.dtype and np.array_equal(x, y) and y.ctypes.data % 64 == 0
    assert a.put(None) is None
    # a chunk per 2 MB boundary, bigger arrays get a chunk of their size, copies in order
    assert all(c.ctypes.data % HUGE == 0 for c in a.chunks)
    assert [c.nbytes for c in a.chunks] == [4 << 20, 6 << 20]
    assert got[2].ctypes.data == a.chunks[1].ctypes.data
    assert got[0].ctypes.data < got[1].ctypes.data < a.chunks[0].ctypes.data + (4 << 20)
    assert got[2].ctypes.data < got[3].ctypes.data < got[4].ctypes.data
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if sys.platform.startswith("linux") and thp.is_file() and "[never]" not in thp.read_text():
        assert a.advised == len(a.chunks)  # the kernel took the advice for every chunk
    # the backend's every int4 plane points into its arena, layer after layer
    lo = [c.ctypes.data for c in backend.arena.chunks]
    inside = lambda p: any(b <= p < b + c.nbytes for b, c in zip(lo, backend.arena.chunks))
    m, seen = backend.model, []
    for name in ("qkv", "o", "gu", "down"):
        arr = ctypes.cast(getattr(m, name), ctypes.POINTER(Q4W * m.L)).contents
        seen.append([arr[i].w for i in range(m.L)])
    lm = ctypes.cast(m.lm, ctypes.POINTER(Q4W)).contents
    for w in [w for ws in seen for w in ws] + [lm.w]:
        assert inside(w)
    order = [seen[k][i] for i in range(m.L) for k in range(4)] + [lm.w]
    assert order == sorted(order)
    # auto's price of a prompt row's outputs: the LM head's share of a row's products
    L, d, H, Hkv, D, F, V = m.L, m.d, m.H, m.Hkv, m.D, m.F, m.V
    # (an HF folder's int4 export has an 8-bit head: twice the products on AVX2's kernel)
    twice = 2 if backend.lib.decoder_kernel() == 3 else 1
    head, body = V * d * twice, L * d * ((H + 2 * Hkv) * D + H * D + 3 * F)
    assert backend.head_bits == 8 and backend.lm_row_share == pytest.approx(head / (head + body))


def _random_tree(rng, n: int, vocab: int, masks: int):
    parent = [-1] + [int(rng.integers(0, i)) for i in range(1, n)]
    mask = np.eye(n, dtype=bool)
    depth = np.zeros(n, np.int64)
    for i in range(1, n):
        mask[i] |= mask[parent[i]]
        depth[i] = depth[parent[i]] + 1
    ids = rng.integers(0, vocab, n)
    ids[rng.random(n) < 0.3] = vocab + rng.integers(0, masks)  # some mask rows
    ids[0] = rng.integers(0, vocab)
    return parent, mask, depth, ids


@pytest.fixture(scope="module")
def backend_q8(int4_pkg):
    return NativeBackend(str(int4_pkg), threads=1, kv_cache="int8")


def test_inspect_says_the_native_memory_a_session_really_allocates(int4_pkg, backend,
                                                                   backend_q8, capsys):
    # inspect's lines above are the onnxruntime graph's cache (fp32 keys, float64 values);
    # generate runs an int4 package here natively, so inspect says that backend's memory too
    from edgemtp.cli import main

    for b in (backend, backend_q8):
        s = b.session()
        arrays = [a for a in (s.k, s.v, s.ks, s.vs) if a is not None]
        assert b.cache_bytes() == sum(a.nbytes for a in arrays)
    assert backend.cache_bytes("int8") == backend_q8.cache_bytes()
    assert backend_q8.cache_bytes() < backend.cache_bytes()
    assert main(["inspect", str(int4_pkg)]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if "its memory" in ln)
    mib = 2 ** 20
    assert f"weights {backend.arena.used / mib:.1f} MiB (packed)" in line
    assert f"{backend.cache_bytes() / mib:.1f} MiB (float16)" in line
    assert f"{backend_q8.cache_bytes() / mib:.1f} MiB (--kv-cache int8)" in line


def test_doctor_plans_the_native_memory_on_the_cpu(int4_pkg, stories_pkg, backend):
    # doctor's plan rows are the onnxruntime graph's; on a CPU an int4 package runs on the C
    # decoder, whose cache doctor states beside them (and not for a package it cannot run)
    from edgemtp.doctor import size

    def native_line(pkg):
        proc = subprocess.run([sys.executable, "-m", "edgemtp.cli", "doctor", str(pkg)],
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        return [ln for ln in proc.stdout.splitlines() if ln.startswith("native ")]

    [line] = native_line(int4_pkg)
    ctx = backend.max_context
    # the files' size (doctor loads no weights), an upper bound of what the decoder packs
    from edgemtp.runtimes.package import load_package

    on_disk = load_package(int4_pkg, check_plans=False).weight_bytes()
    assert f"weights {size(on_disk)} (on disk; packed a little smaller" in line, line
    assert backend.arena.used <= on_disk
    assert (f"KV cache at {ctx} tokens {size(backend.cache_bytes('fp16'))} float16 or "
            f"{size(backend.cache_bytes('int8'))} int8") in line
    fits = re.search(r"largest context that fits: (\d+) \(float16\), (\d+) \(int8\)", line)
    # (capped at the package's max context: a larger one needs a re-export)
    assert fits and int(fits[2]) == int(fits[1]) == ctx, line
    assert native_line(stories_pkg) == []  # fp32: onnxruntime runs it


@pytest.mark.parametrize("size", [10, 30, 60])
def test_a_row_is_bitwise_the_same_in_any_block_as_alone(backend, size):
    _tree_rows_equal_plain(backend, size)


@pytest.mark.parametrize("size", [10, 60])
def test_with_an_int8_cache_too(backend_q8, size):
    _tree_rows_equal_plain(backend_q8, size)


@pytest.mark.parametrize("kv", ["fp16", "int8"])
def test_gqa_head_dim_64_rows_are_bitwise_the_same_in_any_block(gqa_pkg, kv):
    # head_dim 64 and four query heads per KV head, tree rows moved by commits (keys, values
    # and, in an int8 cache, their scales); one-row steps on the grouped path too
    b = NativeBackend(str(gqa_pkg), threads=2, kv_cache=kv)
    b.lib.decoder_set_group_min_p(0)
    try:
        _tree_rows_equal_plain(b, 30)
        # lists that cross the int8 cache's first int32 flush (256 entries, decoder.c pv_int)
        # in the block's rows, and in the cache's rows where the path is decoded alone
        _tree_rows_equal_plain(b, 30, prompt_len=251)
        # a tree step whose accepted path is not a prefix of the block: commit moves its
        # rows down; the next step must see plain decoding's cache
        rng = np.random.default_rng(11)
        prompt = rng.integers(0, b.vocab_size, 40)
        tree_s, plain_s = _prefill(b, prompt)[0], _prefill(b, prompt)[0]
        for step in range(4):
            parent, mask, depth, ids = _random_tree(rng, 12, b.vocab_size, 1)
            ids %= b.vocab_size  # token rows only: they are committed
            p = tree_s.cache_len
            tree_s.forward(ids, p + depth, mask, None)
            path = np.flatnonzero(mask[int(np.argmax(depth))])
            assert np.any(path != np.arange(len(path)))  # rows move
            tree_s.commit(path)
            for j in path:
                plain_s.forward(ids[j:j + 1], np.array([plain_s.cache_len]),
                                np.ones((1, 1), bool), None)
                plain_s.commit([0])
            nxt = rng.integers(0, b.vocab_size, 1)
            a, c = (x.forward(nxt, np.array([x.cache_len]), np.ones((1, 1), bool), None,
                              full_logits=True) for x in (tree_s, plain_s))
            assert np.array_equal(a.logits, c.logits), step
            tree_s.commit([0]), plain_s.commit([0])
    finally:
        b.lib.decoder_set_group_min_p(-2)


def _tree_rows_equal_plain(backend, size, prompt_len=17):
    rng = np.random.default_rng(size)
    prompt = rng.integers(0, backend.vocab_size, prompt_len)
    embeds = rng.standard_normal((3, backend.hidden_size)).astype(np.float32) * 0.1
    parent, mask, depth, ids = _random_tree(rng, size, backend.vocab_size, 3)
    s, _ = _prefill(backend, prompt)
    block = s.forward(ids, prompt_len + depth, mask, embeds, topk=8, full_logits=True)
    for row in rng.choice(size, 6, replace=False):
        path = np.flatnonzero(mask[row])  # its ancestors and itself, in block order
        alone, _ = _prefill(backend, prompt)
        for j in path:  # plain decoding of the path, one row a step
            out = alone.forward(ids[j:j + 1], np.array([prompt_len + depth[j]]),
                                np.ones((1, 1), bool), embeds, topk=8, full_logits=True)
            alone.commit([0])
        assert np.array_equal(out.logits[0], block.logits[row])
        assert np.array_equal(out.topk_ids[0], block.topk_ids[row])
        assert np.array_equal(out.topk_logprobs[0], block.topk_logprobs[row])


def test_every_drafter_equals_native_plain_decoding(int4_pkg):
    model = Model.load(str(int4_pkg), backend="native", threads=1)
    for prompt in ("Once upon a time", "Lily and Tom went to the park. They saw"):
        want = model.generate(prompt, max_new_tokens=64, drafter="none").token_ids
        for drafter in DRAFTERS:
            for bc in (10, 30, 60):
                got = model.generate(prompt, max_new_tokens=64, drafter=drafter, bc=bc)
                assert got.token_ids == want, (prompt, drafter, bc)


def test_every_drafter_equals_plain_decoding_with_an_int8_cache(int4_pkg):
    model = Model.load(str(int4_pkg), backend="native", threads=2, kv_cache="int8")
    prompt = "Lily and Tom went to the park. They saw"
    want = model.generate(prompt, max_new_tokens=64, drafter="none").token_ids
    for drafter in DRAFTERS:
        got = model.generate(prompt, max_new_tokens=64, drafter=drafter, bc=30)
        assert got.token_ids == want, drafter


def test_an_int8_cache_is_half_the_memory_and_close_to_fp16(int4_pkg, backend, backend_q8):
    # the cache's int8 codes round each key row / 32 value lanes to 1/254 of their largest
    # magnitude: the logits move by a small fraction of their scale, not by the whole of it
    ids = np.random.default_rng(5).integers(0, backend.vocab_size, 120)
    half, q8 = (_prefill(b, ids)[1].logits for b in (backend, backend_q8))
    rows = np.abs(half - q8).max(1) / np.abs(half).max(1)
    assert 0 < np.median(rows) < 0.05
    assert np.mean(half.argmax(1) == q8.argmax(1)) >= 0.8
    s16, s8 = backend.session(), backend_q8.session()
    bytes16 = s16.k.nbytes + s16.v.nbytes
    bytes8 = s8.k.nbytes + s8.v.nbytes + s8.ks.nbytes + s8.vs.nbytes
    # a byte a lane and 4 a scale (one per key row, one per value row's 32 lanes; head_dim 8
    # here, so the scales weigh: 24 bytes a row against 32; SmolLM2's 64: 140 against 256)
    L, hkv, d = backend.dims
    rows = s8.k.shape[2] * 16
    assert bytes16 == L * hkv * rows * 4 * d
    assert bytes8 == L * hkv * rows * (2 * d + 4 + 4 * -(-d // 32))
    with pytest.raises(ConfigError, match="kv cache must be one of fp16, int8"):
        NativeBackend(str(int4_pkg), kv_cache="q4")
    with pytest.raises(ConfigError, match="option of the native backend, which runs int4 "
                                          "packages on the CPU; this model runs on onnxruntime"):
        Model.load(str(int4_pkg), backend="onnxruntime", kv_cache="int8")


def test_kv_cache_from_the_cli(int4_pkg, stories_pkg):
    def cli(*args):
        return subprocess.run([sys.executable, "-m", "edgemtp.cli", "generate", "--prompt",
                               "Once upon a time", "--max-new-tokens", "24", "--drafter",
                               "none", "--json", *args], capture_output=True, text=True,
                              timeout=300)

    want = Model.load(str(int4_pkg), backend="native", threads=1, kv_cache="int8").generate(
        "Once upon a time", max_new_tokens=24, drafter="none").text
    run = cli("--model", str(int4_pkg), "--kv-cache", "int8", "--threads", "1")
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["text"] == want
    for bad in (("--model", str(stories_pkg), "--kv-cache", "int8"),  # an onnxruntime package
                ("--model", str(int4_pkg), "--kv-cache", "q4")):
        run = cli(*bad)
        lines = run.stderr.strip().splitlines()
        assert run.returncode == 2 and lines and "Traceback" not in run.stderr, run.stderr
        assert "kv" in lines[-1].lower(), lines


def test_threads_change_no_bit(int4_pkg, backend):
    ids = np.random.default_rng(3).integers(0, backend.vocab_size, 40)
    two = NativeBackend(str(int4_pkg), threads=2)
    assert np.array_equal(_prefill(backend, ids)[1].logits, _prefill(two, ids)[1].logits)


def test_the_portable_build_computes_the_same_bits(int4_pkg, backend):
    # the build for machines without -march=native (and the ARM one): no AVX-512 kernel
    path = native._build(native.DECODER_SOURCE, (("-O3", "-ffp-contract=off"),))
    portable = NativeBackend(str(int4_pkg), threads=1, check=False)
    import ctypes
    portable.lib = native._declare_decoder(ctypes.CDLL(str(path)))
    ids = np.random.default_rng(4).integers(0, backend.vocab_size, 20)
    assert np.array_equal(_prefill(backend, ids)[1].logits, _prefill(portable, ids)[1].logits)
    # the int8 cache's code conversion too (one vector instruction here, a loop there)
    q8 = NativeBackend(str(int4_pkg), threads=1, check=False, kv_cache="int8")
    q8p = NativeBackend(str(int4_pkg), threads=1, check=False, kv_cache="int8")
    q8p.lib = portable.lib
    assert np.array_equal(_prefill(q8, ids)[1].logits, _prefill(q8p, ids)[1].logits)
    # lists long enough for the 16-lane softmax, maximum and value-weight loops and their
    # 8-lane tails, the vocabulary's log-softmax (top-K), on both attention paths
    ids = np.random.default_rng(5).integers(0, backend.vocab_size, 45)
    for group_min_p in (-1, 0):  # rows always, then the grouped passes always
        got = []
        for b in (backend, portable, q8, q8p):
            b.lib.decoder_set_group_min_p(group_min_p)
            try:
                s = _prefill(b, ids)[0]
                got.append(s.forward(ids[:3], 45 + np.arange(3),
                                     np.tril(np.ones((3, 3), bool)), None, topk=8))
                got.append(s.forward(ids[:1], 45 + np.arange(1), np.ones((1, 1), bool), None,
                                     topk=8))
            finally:
                b.lib.decoder_set_group_min_p(-2)
        for a, c in ((got[0:2], got[2:4]), (got[4:6], got[6:8])):
            for x, y in zip(a, c):
                assert np.array_equal(x.topk_ids, y.topk_ids)
                assert np.array_equal(x.topk_logprobs, y.topk_logprobs)


def test_auto_picks_native_for_an_int4_package_only(int4_pkg, stories_pkg, monkeypatch):
    assert auto_backend(str(int4_pkg)) == "native"
    assert auto_backend(str(int4_pkg), "cuda") == "onnxruntime"
    assert auto_backend(str(stories_pkg)) == "onnxruntime"  # fp32
    assert auto_backend(str(STORIES)) == "torch"
    monkeypatch.setenv("EDGEMTP_NATIVE", "0")
    assert auto_backend(str(int4_pkg)) == "onnxruntime"


def test_what_it_cannot_run_is_one_line(int4_pkg, stories_pkg):
    with pytest.raises(ConfigError, match="runs int4 packages.*--backend onnxruntime"):
        NativeBackend(str(stories_pkg))
    with pytest.raises(ConfigError, match="runs on the CPU"):
        NativeBackend(str(int4_pkg), device="cuda")
    r = subprocess.run([sys.executable, "-m", "edgemtp.cli", "generate", "--model",
                        str(stories_pkg), "--backend", "native", "--prompt", "Once",
                        "--max-new-tokens", "4"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert "int4" in r.stderr


def test_a_graph_it_would_read_wrong_is_refused_at_load(int4_pkg, tmp_path):
    # an op the decoder does not model (here: o_proj's output of layer 2 scaled by 3):
    # onnxruntime runs it, the decoder cannot know; the load check sees them disagree
    pkg = tmp_path / "edited"
    shutil.copytree(int4_pkg, pkg)
    proto = onnx.load(str(pkg / "model.onnx"), load_external_data=False)
    o_proj = [n for n in proto.graph.node if n.op_type == "MatMulNBits"][4 * 2 + 1]
    out = o_proj.output[0]
    o_proj.output[0] = out + "_unscaled"
    proto.graph.initializer.append(onnx.numpy_helper.from_array(np.array(3.0, np.float32),
                                                                 "edit_scale"))
    proto.graph.node.append(onnx.helper.make_node("Mul", [out + "_unscaled", "edit_scale"],
                                                  [out]))
    onnx.save(proto, str(pkg / "model.onnx"))
    size = (pkg / "model.onnx").stat().st_size
    import json
    manifest = json.loads((pkg / "edgemtp.json").read_text())
    manifest["files"]["model.onnx"].update(bytes=size, sha256=None)
    (pkg / "edgemtp.json").write_text(json.dumps(manifest))
    with pytest.raises(ModelLoadError, match="disagrees with the package's graph"):
        NativeBackend(str(pkg), threads=1)
    # inspect fails where generate (--backend auto: native) would, with the same line
    for cmd in (["inspect", str(pkg)], ["generate", "--model", str(pkg), "--prompt", "Once",
                                         "--max-new-tokens", "2"]):
        r = subprocess.run([sys.executable, "-m", "edgemtp.cli", *cmd], capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert "disagrees with the package's graph" in r.stderr, r.stderr
    r = subprocess.run([sys.executable, "-m", "edgemtp.cli", "inspect", str(int4_pkg)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "--backend auto, CPU): native" in r.stdout, r.stderr


@pytest.mark.parametrize("kv", ["fp16", "int8"])
def test_a_causal_block_is_bitwise_the_tokens_decoded_one_at_a_time(int4_pkg, kv):
    # a prefill (and a causal block after a cache) scores the keys its rows share for 4 rows
    # at once (decoder.c attend_rows); a row's logits must still be the bits plain decoding
    # computes for that token alone
    b = NativeBackend(str(int4_pkg), threads=2, kv_cache=kv)
    ids = np.random.default_rng(8).integers(0, b.vocab_size, 45)
    for start in (0, 19):  # an empty cache, then a causal block of 26 rows after 19
        blk, one = b.session(), b.session()
        if start:
            for x in (blk, one):
                x.forward(ids[:start], np.arange(start), np.tril(np.ones((start,) * 2, bool)),
                          None)
                x.commit(np.arange(start))
        n = len(ids) - start
        got = blk.forward(ids[start:], start + np.arange(n), np.tril(np.ones((n, n), bool)),
                          None, full_logits=True)
        for i in range(n):
            r = one.forward(ids[start + i:start + i + 1], np.array([start + i]),
                            np.ones((1, 1), bool), None, full_logits=True)
            one.commit([0])
            assert np.array_equal(got.logits[i], r.logits[0]), (start, i)


def test_a_prefill_can_leave_the_prompt_rows_out(backend):
    # plain decoding and auto (no hybrid sharing stored distributions) read only the last
    # prompt row and the mask rows: the engine asks the rows before them for no LM head
    ids = np.random.default_rng(6).integers(0, backend.vocab_size, 30)
    mask = np.tril(np.ones((30, 30), bool))
    full = backend.session().forward(ids, np.arange(30), mask, None, topk=8)
    part = backend.session().forward(ids, np.arange(30), mask, None, topk=8, rows_from=25)
    assert np.array_equal(full.argmax[25:], part.argmax[25:]) and (part.argmax[:25] == -1).all()
    assert np.array_equal(full.topk_ids[25:], part.topk_ids[25:])
    assert np.array_equal(full.topk_logprobs[25:], part.topk_logprobs[25:])
    assert (part.topk_ids[:25] == 0).all() and np.isneginf(part.topk_logprobs[:25]).all()
    logits = backend.session().forward(ids, np.arange(30), mask, None, full_logits=True,
                                       rows_from=25)
    assert (logits.argmax == full.argmax).all()  # full logits: every row, always


@pytest.fixture(scope="module")
def gqa_pkg(tmp_path_factory):
    # head_dim 64 and four query heads per KV head: the shape the grouped attention path
    # (decoder.c attend_groups: GQA groups share each key and value load) runs on
    from conftest import save_random_llama

    root = tmp_path_factory.mktemp("gqa")
    save_random_llama(root / "hf", hidden_size=512, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=2, vocab_size=512,
                      max_position_embeddings=1024, initializer_range=0.1,
                      eos_token_id=511, bos_token_id=1, tie_word_embeddings=True)
    export_package(str(root / "hf"), root / "int4", dtype="int4", max_context=512,
                   progress=False)
    return root / "int4"


@pytest.mark.parametrize("threads,kv", [(1, "fp16"), (2, "fp16"), (2, "int8")])
def test_grouped_attention_is_bitwise_the_rows_path(gqa_pkg, threads, kv):
    """A step over a long cache runs attention in three passes split by KV group, key slice
    and value lanes (decoder.c attend_groups) instead of by query head: the same chains, so
    the same bits. Blocks of more rows convert each key block and value slice to floats once
    and carry the value sums between slices. Compared here at cache lengths from a ragged 247
    on (neither 16, the 64-row value slice nor the 128-key slice divides it; the int8 cache's
    lists cross their first int32 flush at 256 entries, in the block and then in the cache),
    for one-row steps, two-row blocks and trees of 7 and 21 rows (ancestors beyond the leading
    run, mask rows), with the path forced on and off."""
    b = NativeBackend(str(gqa_pkg), threads=threads, kv_cache=kv)
    rng = np.random.default_rng(threads)
    embeds = rng.standard_normal((2, b.hidden_size)).astype(np.float32) * 0.1
    s, _ = _prefill(b, rng.integers(0, b.vocab_size, 247))
    blocks = [(np.ones((1, 1), bool), 1), (np.tril(np.ones((2, 2), bool)), 2),
              (np.eye(2, dtype=bool), 2), (_random_tree(rng, 7, b.vocab_size, 2)[1], 7),
              (_random_tree(rng, 21, b.vocab_size, 2)[1], 21)]
    try:
        for step in range(15):
            mask, t = blocks[step % 5]
            ids = rng.integers(0, b.vocab_size, t)
            ids[-1] = b.vocab_size + step % 2 if step % 4 == 3 else ids[-1]  # a mask row
            got = {}
            for min_p in (-1, 0):
                b.lib.decoder_set_group_min_p(min_p)
                got[min_p] = s.forward(ids, s.cache_len + np.arange(t), mask, embeds, topk=8,
                                       full_logits=True)
            assert np.array_equal(got[-1].logits, got[0].logits), step
            assert np.array_equal(got[-1].topk_logprobs, got[0].topk_logprobs), step
            s.commit([0])
    finally:
        b.lib.decoder_set_group_min_p(-2)


@pytest.fixture(scope="module")
def family_pkgs(tmp_path_factory):
    # small random Mistral, Qwen2 (q/k/v biases) and Qwen3 (q/k RMSNorm per head) models with
    # tied embeddings, norms and biases randomised (a zero bias would test nothing)
    import torch
    from transformers import AutoModelForCausalLM

    from conftest import family_configs

    root, out = tmp_path_factory.mktemp("families"), {}
    for name, config in family_configs().items():
        if name == "llama3":
            continue  # Llama: stories260K and the GQA model above
        config.tie_word_embeddings = True
        torch.manual_seed(1)
        model = AutoModelForCausalLM.from_config(config).eval()
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "norm" in n:
                    p.uniform_(0.5, 1.5)
                elif n.endswith("bias"):
                    p.uniform_(-0.5, 0.5)
        model.save_pretrained(root / name)
        export_package(str(root / name), root / f"{name}-int4", dtype="int4",
                       max_context=256, progress=False)
        out[name] = root / f"{name}-int4"
    return out


@pytest.mark.parametrize("family", ["mistral", "qwen2", "qwen3"])
def test_other_llama_style_families_run_natively_and_losslessly(family_pkgs, family):
    """Mistral's layer is Llama's; Qwen2 adds q/k/v biases and Qwen3 an RMSNorm per head of q
    and k before the rotary embedding. The load check compares the decoder with the package's
    onnxruntime graph (leaving the biases or the q/k norms out fails it: ~0.3 and ~1.0 of the
    logit scale), and every drafter equals the decoder's own plain decoding."""
    pkg = family_pkgs[family]
    assert auto_backend(str(pkg)) == "native"
    model = Model.load(str(pkg), backend="native", threads=1)
    b = model.backend
    assert b.probe["argmax_same"] >= MIN_SAME and b.probe["max_diff"] <= MAX_DIFF
    assert (b.model.qkv_bias is not None) == (family == "qwen2")
    assert (b.model.q_norm is not None) == (family == "qwen3")
    rng = np.random.default_rng(2)
    for prompt in (rng.integers(0, b.vocab_size, 12).tolist(), [5, 6, 7, 5, 6, 7, 5, 6]):
        want = model.generate(prompt, max_new_tokens=40, drafter="none").token_ids
        for drafter in ("probe", "pld", "hybrid", "auto"):
            for bc in (10, 30):
                got = model.generate(prompt, max_new_tokens=40, drafter=drafter, bc=bc)
                assert got.token_ids == want, (family, drafter, bc)


def test_bench_prefill_runs_and_leaves_out_what_is_missing(int4_pkg, tmp_path):
    # the prefill bench on a real package, in its subprocesses; a peer whose file is not
    # there is left out in one line, and no native package is exit 2
    bench = Path(__file__).resolve().parents[1] / "bench" / "bench_prefill.py"
    r = subprocess.run([sys.executable, str(bench), "--lengths", "8,24", "--rounds", "1",
                        "--native", str(int4_pkg), "--genai", str(tmp_path / "none"),
                        "--gguf", str(tmp_path / "none.gguf"), "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "onnxruntime-genai int4: left out" in r.stdout and "llama.cpp Q4_1: left out" in r.stdout
    data = json.loads(next(tmp_path.glob("prefill_*_cpu.json")).read_text())
    assert set(data["median_s"]) == {"edgemtp native int4"}
    assert all(v > 0 for v in data["median_s"]["edgemtp native int4"].values())
    r = subprocess.run([sys.executable, str(bench), "--native", str(tmp_path / "no-pkg")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    r = subprocess.run([sys.executable, str(bench), "--lengths", "12,abc"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--lengths takes" in r.stderr and "Traceback" not in r.stderr


def test_bench_native_ab_pairs_two_builds_in_one_process(int4_pkg, tmp_path):
    # bench/bench_native_ab.py as a user runs it: HEAD's decoder and Python side against the
    # working tree's, each step of one paired with the other's; the same source gives the
    # same bits. Bad input: one line, exit 2, nothing written.
    script = str(Path(__file__).resolve().parents[1] / "bench" / "bench_native_ab.py")
    out = tmp_path / "ab.json"
    run = subprocess.run([sys.executable, script, "--package", str(int4_pkg), "--base", "HEAD",
                          "--sizes", "1,3", "--contexts", "0,40", "--pairs", "2", "--rounds",
                          "2", "--threads", "1", "--out", str(out)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["P"], r["T"]) for r in rows] == [(0, 1), (0, 3), (40, 1), (40, 3)]
    assert all(len(r["round_ratios"]) == 2 and 0.1 < r["ratio"] < 10 for r in rows)
    if not subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "edgemtp/native",
                           "runtimes/native_backend.py"], cwd=Path(script).parents[1]).returncode:
        assert all(r["same_bits"] for r in rows)  # (the tree's decoder is HEAD's)
    for bad, line in ((["--sizes", "0,x"], "--sizes takes a comma-separated list of positive "
                       "integers, got '0,x'"),
                      (["--base", "no-such-rev"], "--base 'no-such-rev': git has no")):
        run = subprocess.run([sys.executable, script, "--package", str(int4_pkg), *bad,
                              "--out", str(tmp_path / "bad.json")],
                             capture_output=True, text=True, timeout=120)
        assert run.returncode == 2 and "Traceback" not in run.stderr
        assert len(run.stderr.strip().splitlines()) == 1 and line in run.stderr
        assert not (tmp_path / "bad.json").exists()


@pytest.mark.parametrize("kv", ["fp16", "int8"])
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_one_row_steps_split_between_threads_give_the_row_loops_bits(int4_pkg, family_pkgs,
                                                                     family, kv):
    # a one-row step deals its heads' RoPE, query pairs and cache writes to the threads
    # (decoder.c's split_rows); a step of more rows runs the row loop. On two threads both ways
    # give the same outputs and the same cache, biases (Qwen2) and q/k norms (Qwen3) included
    pkg = int4_pkg if family == "llama" else family_pkgs[family]
    b = NativeBackend(str(pkg), threads=2, kv_cache=kv, check=False)
    prompt = np.random.default_rng(3).integers(0, b.vocab_size, 9)
    got = {}
    try:
        for split in (0, 1):
            b.lib.decoder_set_split_rows(split)
            s, outs = b.session(), []
            n = len(prompt)
            out = s.forward(prompt, np.arange(n), np.tril(np.ones((n, n), dtype=bool)), None,
                            topk=4)
            s.commit(np.arange(n))
            tok = int(out.argmax[-1])
            for _ in range(12):
                out = s.forward(np.array([tok]), np.array([s.cache_len]),
                                np.ones((1, 1), dtype=bool), None, topk=4)
                s.commit(np.arange(1))
                outs.append((out.argmax.copy(), out.topk_ids.copy(), out.topk_logprobs.copy()))
                tok = int(out.argmax[0])
            cache = [a.copy() for a in (s.k, s.v, s.ks, s.vs) if a is not None]
            got[split] = outs, cache
    finally:
        b.lib.decoder_set_split_rows(1)
    for (a, b_) in zip(got[0][0], got[1][0]):
        for x, y in zip(a, b_):
            assert np.array_equal(x, y)
    for x, y in zip(got[0][1], got[1][1]):
        assert np.array_equal(x, y)


def _tiny_llama(folder, hidden, heads, kv_heads, fresh_norms=False):
    """A random-weight Llama with stories260K's tokenizer (norms of 1 everywhere where
    ``fresh_norms``: the graph then holds them as one shared initializer)."""
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=512,
                      max_position_embeddings=256, tie_word_embeddings=True)
    hf = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name and not fresh_norms:
                p.uniform_(0.5, 1.5)
    hf.save_pretrained(folder)
    for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json"):
        shutil.copy(STORIES / f, folder)
    return folder


def _rename_final_norm(pkg) -> None:
    """The package's graph with its final norm weight under another name (onnxruntime runs
    it the same; the native decoder finds norms by name), the manifest's digest updated."""
    import hashlib
    import json

    import onnx

    graph = pkg / "model.onnx"
    proto = onnx.load(str(graph), load_external_data=False)
    old, new = "decoder.model.norm.weight", "renamed_final_norm"
    for init in proto.graph.initializer:
        if init.name == old:
            init.name = new
    for node in proto.graph.node:
        node.input[:] = [new if i == old else i for i in node.input]
    onnx.save_model(proto, str(graph))
    manifest = json.loads((pkg / "edgemtp.json").read_text())
    data = graph.read_bytes()
    manifest["files"]["model.onnx"] = {"bytes": len(data),
                                       "sha256": hashlib.sha256(data).hexdigest()}
    (pkg / "edgemtp.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("shape", ["heads of 12", "graph it declines"])
def test_auto_runs_a_package_the_native_decoder_declines_on_onnxruntime(tmp_path, shape):
    """QA (export_report.md D3): an int4 package the C decoder does not take ran into the
    native backend's refusal in generate and inspect. --backend auto now runs it on
    onnxruntime: where the manifest shows it (heads of 12 dimensions; its kernels take
    multiples of 8) without trying, where only the graph does (here a norm weight under a
    name it does not look for) once the native backend declines it, and inspect says why;
    --backend native still refuses it in one line. (The hidden size of 48, not whole blocks
    of 32, also made the int4 export's tied embedding 64 wide, a traceback from onnxruntime:
    the embedding keeps its float table there.)"""
    from edgemtp import Model

    folder = tmp_path / "tiny"
    if shape == "heads of 12":
        _tiny_llama(folder, 48, 4, 2)
    else:
        _tiny_llama(folder, 64, 8, 4)
    pkg = tmp_path / "tiny-int4"
    export_package(str(folder), pkg, dtype="int4", max_context=128, bc=(10,),
                   mask_tokens=(1,), progress=False)
    if shape == "graph it declines":
        _rename_final_norm(pkg)
    model = Model.load(str(pkg), threads=1)
    assert model.backend.name == "onnxruntime"
    if shape == "heads of 12":
        assert model.native_declined is None  # (not tried: the manifest says it all)
    else:
        assert "no norm weight 'decoder.model.norm.weight'" in model.native_declined
        assert "use --backend" not in model.native_declined
    ort = Model.load(str(pkg), backend="onnxruntime", threads=1)
    assert ort.native_declined is None
    want = ort.generate("Once upon a time", drafter="none", max_new_tokens=12).token_ids
    for drafter in ("none", "probe", "auto"):
        got = model.generate("Once upon a time", drafter=drafter, bc=10, max_new_tokens=12)
        assert got.token_ids == want, drafter
    run = subprocess.run([sys.executable, "-m", "edgemtp.cli", "inspect", str(pkg)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "generate on this machine (--backend auto, CPU): onnxruntime" in run.stdout
    assert ("(not the native C decoder: " in run.stdout) == (shape == "graph it declines")
    run = subprocess.run([sys.executable, "-m", "edgemtp.cli", "generate", "--model", str(pkg),
                          "--backend", "native", "--prompt", "Once"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and run.stderr.count("\n") == 1, run.stderr
    assert "use --backend onnxruntime" in run.stderr


def test_a_model_whose_layers_repeat_exports_to_int4_and_runs_natively(tmp_path):
    """QA (export_report.md D2): the tracer stores bit-identical weights once (a layer that
    copies another, as depth up-scaled models and passthrough merges have; a fresh model's
    norms of 1) and read the copies through Identity nodes. The quantizer left those products
    in float32 (the int4 self-check failed by a logit of 1.24) and the native decoder found no
    norm weight for layer 1. Each copy is now an initializer of its own."""
    import torch
    from safetensors.torch import load_file, save_file

    from edgemtp import Model

    folder = _tiny_llama(tmp_path / "dup", 64, 8, 4, fresh_norms=True)
    weights = load_file(str(folder / "model.safetensors"))
    for name in list(weights):
        if name.startswith("model.layers.1."):
            weights[name] = weights[name.replace("layers.1.", "layers.0.")].clone()
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    pkg = tmp_path / "dup-int4"
    export_package(str(folder), pkg, dtype="int4", max_context=128, bc=(10,),
                   mask_tokens=(1,), progress=False)  # (raised: self-check failed)
    import onnx

    proto = onnx.load(str(pkg / "model.onnx"), load_external_data=False)
    assert not [n for n in proto.graph.node if n.op_type == "Identity"
                and n.input[0] in {i.name for i in proto.graph.initializer}]
    inits = {i.name for i in proto.graph.initializer}
    float_weights = [n.name for n in proto.graph.node if n.op_type == "MatMul"
                     and n.input[1] in inits]
    assert not float_weights  # every product quantized, layer 1's too
    assert sum(n.op_type == "MatMulNBits" for n in proto.graph.node) == 4 * 2 + 1
    model = Model.load(str(pkg), threads=1)
    assert model.backend.name == "native" and model.native_declined is None
    want = model.generate("Once upon a time", drafter="none", max_new_tokens=12).token_ids
    for drafter in ("probe", "pld", "auto"):
        got = model.generate("Once upon a time", drafter=drafter, bc=10, max_new_tokens=12)
        assert got.token_ids == want, drafter
    assert torch.equal(weights["model.layers.1.mlp.up_proj.weight"],
                       weights["model.layers.0.mlp.up_proj.weight"])


def test_an_untied_int4_package_runs_on_the_native_decoder(tmp_path):
    """An untied model (Llama-3-8B, Mistral-7B, Qwen2.5-7B: an LM head of its own) exports
    its embedding as float32 rows the host gathers (embeddings.npy); the native decoder
    reads them (it took only a tied int4/int8 table, and --backend auto ran such packages on
    onnxruntime at half the speed). Its load check holds its logits to the graph's, and every
    drafter gives its plain decoding's tokens."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    from edgemtp import Model
    from edgemtp.runtimes.package import load_package

    hf = AutoModelForCausalLM.from_pretrained(str(STORIES))
    hf.config.tie_word_embeddings = False
    table = hf.model.embed_tokens.weight.detach().clone()
    head = torch.nn.Linear(table.shape[1], table.shape[0], bias=False)
    with torch.no_grad():  # (its own weights: not the embedding's)
        head.weight.copy_(table + 0.05 * torch.randn(table.shape,
                                                     generator=torch.Generator().manual_seed(0)))
    hf.lm_head = head
    folder = tmp_path / "untied"
    hf.save_pretrained(folder)
    for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json",
              "generation_config.json"):
        shutil.copy(STORIES / f, folder)
    pkg = tmp_path / "untied-int4"
    export_package(str(folder), pkg, dtype="int4", max_context=256, bc=(10, 30),
                   mask_tokens=(1,), progress=False)
    package = load_package(pkg, check_plans=False)
    meta = package.meta
    # the float table is stored once: the graph's own, which the host maps from its weights
    # file (it was written again to embeddings.npy: SmolLM2 untied, 301 MB against 192)
    assert meta.weights.tied_embedding is False and meta.embeddings.layout == "graph-rows"
    assert meta.embeddings.file == "model.onnx.data" and not (pkg / "embeddings.npy").exists()
    rows = package.embedding_table().rows(np.arange(meta.vocab_size, dtype=np.int64))
    assert np.array_equal(rows, table.numpy())
    import json

    manifest = json.loads((pkg / "edgemtp.json").read_text())
    bad = pkg.parent / "bad"
    shutil.copytree(pkg, bad)
    manifest["embeddings"]["data"]["offset"] = (pkg / "model.onnx.data").stat().st_size
    (bad / "edgemtp.json").write_text(json.dumps(manifest))
    with pytest.raises(ModelLoadError, match="ends before the embedding table"):
        load_package(bad, check_plans=False)
    model = Model.load(str(pkg), threads=1)
    assert model.backend.name == "native" and model.native_declined is None
    assert model.backend.probe is not None  # the load check ran against the graph
    ort = Model.load(str(pkg), backend="onnxruntime", threads=1)
    for prompt in ("Once upon a time", "The little dog"):
        want = model.generate(prompt, drafter="none", max_new_tokens=24).token_ids
        assert want[:8] == ort.generate(prompt, drafter="none", max_new_tokens=8).token_ids
        for drafter in ("probe", "pld", "hybrid", "auto"):
            got = model.generate(prompt, drafter=drafter, bc=10, max_new_tokens=24)
            assert got.token_ids == want, (prompt, drafter)


def test_the_torch_backend_on_an_int4_package_says_it_runs_the_source(int4_pkg):
    """QA (gpu report D8): --backend torch on a package runs the model it was exported from,
    in float: on an int4 package the text can differ from the package's own, and it said
    nothing."""
    r = subprocess.run([sys.executable, "-m", "edgemtp.cli", "generate", "--model",
                        str(int4_pkg), "--backend", "torch", "--prompt", "Once upon a time",
                        "--max-new-tokens", "4"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert (f"note: --backend torch runs the model {str(int4_pkg)!r} was exported from "
            f"({STORIES.resolve()}), not its int4 weights") in r.stderr


def test_a_device_is_checked_for_its_form_before_the_backend_says_where_it_runs(int4_pkg):
    """QA (qa6 gguf, 4): the native backend answered a malformed device (cpu:1, cuda:x) with
    "use --backend onnxruntime or torch", which then refused it too, and sent tensorrt to
    torch."""
    from edgemtp.errors import ConfigError

    for bad in ("cpu:1", "cuda:x", "gpu"):
        with pytest.raises(ConfigError, match=r"^device must be cpu, cuda\[:N\] or "):
            NativeBackend(str(int4_pkg), device=bad)
    with pytest.raises(ConfigError, match=r"for --device cuda:1 use --backend onnxruntime or "
                                          r"torch$"):
        NativeBackend(str(int4_pkg), device="cuda:1")
    with pytest.raises(ConfigError, match=r"its TensorRT provider\), or --backend tensorrt "):
        NativeBackend(str(int4_pkg), device="tensorrt")


@pytest.mark.parametrize("parallel", [1, 3])
def test_doctor_s_native_context_that_fits_is_exact(int4_pkg, parallel):
    # the native cache has a margin of rows and grows 16 at a time: the largest context that
    # fits is found on those bytes, not on a straight line through them (QA qa7 D7)
    from edgemtp.doctor import MARGIN, Pool, _native_line
    from edgemtp.runtimes.native_backend import cache_bytes
    from edgemtp.runtimes.package import load_package

    pkg = load_package(int4_pkg, check_plans=False)
    m = pkg.meta
    b = lambda r: cache_bytes(m.num_layers, m.num_kv_heads, m.head_dim, r, "fp16")  # noqa: E731
    room = parallel * b(100) + 7  # between 100 and 101 rows' caches, past the weights
    avail = int((room + pkg.weight_bytes()) * (1 + MARGIN)) + 1
    line = _native_line(pkg, Pool("test", avail, host=True), parallel)
    rows = int(re.search(r"largest context that fits: (\d+) \(float16\)", line)[1])
    budget = avail / (1 + MARGIN) - pkg.weight_bytes()
    assert parallel * b(rows) <= budget < parallel * b(rows + 1) and rows >= 100, line


def test_a_manifest_max_context_past_the_graph_s_rotary_table_is_refused(int4_pkg, tmp_path):
    """qa8b D6: max_context raised by hand in edgemtp.json: the decoder clamped positions
    past its rotary table's rows, and the text degraded without a word."""
    import json
    import shutil

    from edgemtp.runtimes.package import ManifestError

    pkg = tmp_path / "edited"
    shutil.copytree(int4_pkg, pkg)
    m = json.loads((pkg / "edgemtp.json").read_text())
    m["max_context"] = 4 * m["max_context"]
    (pkg / "edgemtp.json").write_text(json.dumps(m))
    said = (r"says max_context 1024, but the graph's rotary table holds 256 positions: the "
            r"manifest was edited or damaged")
    with pytest.raises(ManifestError, match=said):
        NativeBackend(str(pkg), threads=1)
    assert NativeBackend(str(pkg), threads=1, max_context=256).max_context == 256
    # onnxruntime read past the same table (its positions clipped) and answered garbage;
    # doctor judges the package from its graph file as generate would
    from edgemtp.runtimes.onnxrt_backend import OrtBackend
    from edgemtp.runtimes.package import load_package

    with pytest.raises(ManifestError, match=said):
        OrtBackend(str(pkg), threads=1)
    assert OrtBackend(str(pkg), threads=1, max_context=256).max_context == 256
    with pytest.raises(ManifestError, match=said):
        load_package(pkg).check_graph_file()
    load_package(int4_pkg).check_graph_file()


def test_the_int8_cache_rounds_each_row_to_its_own_scale(backend, int4_pkg):
    """qa10a D4: the int8 cache's scale (a row's largest magnitude / 127) was checked only by
    a loose closeness to the float16 cache, and a scale of amax / 128 passed. After a
    prefill, every key row and value chunk's codes must reach 127 at its largest element,
    and layer 0's codes (whose inputs do not depend on the cache) must round the float16
    cache's values to within half a step."""
    q8 = NativeBackend(str(int4_pkg), threads=1, kv_cache="int8")
    ids = np.arange(3, 43, dtype=np.int64)
    n = len(ids)
    sessions = [b.session() for b in (q8, backend)]
    for s in sessions:
        s.forward(ids, np.arange(n), np.tril(np.ones((n, n), dtype=bool)), None)
        s.commit(np.arange(n))
    s8, s16 = sessions
    L, Hkv, D = q8.dims
    p = np.arange(n)
    # (decoder.c kidx8: in each block of 16 positions, the lanes in pairs, 16 x 2 per pair)
    k8 = s8.k.reshape(L, Hkv, -1, D // 2, 16, 2)[:, :, p // 16, :, p % 16, :]
    keys = k8.reshape(n, L, Hkv, D).astype(np.int32)
    ks = s8.ks[:, :, :n].transpose(2, 0, 1)                       # [n, L, Hkv]
    assert (np.abs(keys).max(-1) == 127).all()
    vw = s8.v.shape[4]
    values = s8.v[:, :, :, p // 2, :, p % 2].astype(np.int32)     # [n, L, Hkv, D/vw, vw]
    assert (np.abs(values).max(-1) == 127).all()
    vs = s8.vs[:, :, :, :n].transpose(3, 0, 1, 2)                 # [n, L, Hkv, D/vw]
    k16 = s16.k[0][:, p // 16, :, p % 16].astype(np.float32)      # layer 0: [n, Hkv, D]
    v16 = s16.v[0][:, :, p, :].astype(np.float32)                # [Hkv, D/vw, n, vw]
    half = 2.0 ** -10  # float16's own rounding of the float row
    err_k = np.abs(keys[:, 0] * ks[:, 0, :, None] - k16)
    assert (err_k <= ks[:, 0, :, None] / 2 + half * np.abs(k16) + 1e-7).all()
    err_v = np.abs(values[:, 0] * vs[:, 0, :, :, None] - v16.transpose(2, 0, 1, 3))
    assert (err_v <= vs[:, 0, :, :, None] / 2 + half * np.abs(v16.transpose(2, 0, 1, 3))
            + 1e-7).all()
    assert D % vw == 0 and values.shape[-2:] == (D // vw, vw)
