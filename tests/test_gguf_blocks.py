"""An int4 export of a GGUF keeps the file's own blocks (export.gguf_blocks): on a small GGUF
written here with the ``gguf`` package's own quantizers, rows are found by value (permuted,
fused, from several tensors), the rewritten graph computes the file's weights in onnxruntime
and stays batch-invariant, and the native decoder reads the offsets back."""

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
onnx = pytest.importorskip("onnx")
from onnx import numpy_helper  # noqa: E402
ort = pytest.importorskip("onnxruntime")

from edgemtp.export.gguf_blocks import FileBlocks, keep_file_blocks, offset_branches  # noqa: E402

K = 96  # 3 blocks of 32: an odd count, so the packed zero points have a pad nibble


@pytest.fixture(scope="module")
def file(tmp_path_factory):
    """A GGUF with a Q4_1, a Q4_0 and a Q8_0 matrix and a float vector; returns (path,
    {name: the de-quantized weights [N, K]})."""
    from gguf import GGMLQuantizationType as Q
    from gguf import GGUFWriter, quants

    rng = np.random.default_rng(0)
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    w = GGUFWriter(str(path), "llama")
    want = {}
    for name, n, kind in (("q41", 48, Q.Q4_1), ("q40", 16, Q.Q4_0), ("q80", 40, Q.Q8_0)):
        x = (rng.standard_normal((n, K)) * 0.05 + rng.standard_normal((n, 1)) * 0.02)
        blocks = quants.quantize(x.astype(np.float32), kind)
        w.add_tensor(name, blocks, raw_dtype=kind)
        want[name] = quants.dequantize(blocks, kind).reshape(n, K).astype(np.float32)
    w.add_tensor("norm", np.ones(K, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path, want


def test_rows_are_found_by_value_in_any_order_and_mix(file):
    path, want = file
    blocks = FileBlocks(path)
    assert blocks.types == {"Q4_1": 1, "Q4_0": 1, "Q8_0": 1} and len(blocks) == 3
    # the export's weights: llama's q/k rows permuted, q/k/v fused
    mixed = np.concatenate([want["q41"][::-1], want["q40"][[3, 1, 2, 0] * 4]])
    found = blocks.find(mixed)
    assert found is not None and found.types == ("Q4_0", "Q4_1")
    assert np.array_equal(found.dequantize(), mixed)
    assert (found.zero_points[:48] == 0).all() and (found.zero_points[48:] == 8).all()
    assert (found.offsets[48:] == 0).all() and (found.offsets[:48] != 0).any()
    assert np.array_equal(found.d.astype(np.float16).astype(np.float32), found.d)
    assert blocks.find(want["q40"]).offsets is None           # Q4_0 alone: no offsets
    off = mixed.copy()
    off[5, 7] = np.nextafter(off[5, 7], np.float32(1))         # one ulp off: not the file's
    assert blocks.find(off) is None
    assert blocks.find(want["q80"]) is None                     # 8 bits: find8's
    eight = blocks.find8(want["q80"][::-1])
    assert eight is not None and np.array_equal(eight.dequantize(), want["q80"][::-1])
    assert blocks.find8(want["q41"]) is None


def _graph(b1: np.ndarray, b2: np.ndarray):
    from onnx import TensorProto, helper, numpy_helper

    nodes = [helper.make_node("MatMul", ["x", "B1"], ["h"], name="/body/MatMul"),
             helper.make_node("Slice", ["h", "s0", "s1", "s2"], ["h2"]),
             helper.make_node("MatMul", ["h2", "B2"], ["logits"], name="/lm_head/MatMul")]
    inits = [numpy_helper.from_array(b1, "B1"), numpy_helper.from_array(b2, "B2"),
             numpy_helper.from_array(np.array([0], np.int64), "s0"),
             numpy_helper.from_array(np.array([K], np.int64), "s1"),
             numpy_helper.from_array(np.array([2], np.int64), "s2")]
    g = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "T", K])],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, "T", w])
         for n, w in (("h", K), ("logits", 40))],
        inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17),
                                               helper.make_opsetid("com.microsoft", 1)])


def _session(proto, level: int):
    from edgemtp.export.quantize import float_activations

    proto = onnx.ModelProto.FromString(proto.SerializeToString())
    if level == 0:
        float_activations(proto)
    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    return ort.InferenceSession(proto.SerializeToString(), so,
                                providers=["CPUExecutionProvider"])


def test_rewritten_graph_computes_the_files_weights_and_is_batch_invariant(file):
    path, want = file
    body = np.concatenate([want["q41"], want["q40"], want["q41"][:32]])  # N = 96 = K
    proto = _graph(np.ascontiguousarray(body.T), np.ascontiguousarray(want["q80"].T))
    kept, offsets = keep_file_blocks(proto, FileBlocks(path), 4, head="B2")
    assert kept == ["/body/MatMul", "/lm_head/MatMul"] and offsets == ["/body/MatMul_Q4_offsets"]
    ops = [n.op_type for n in proto.graph.node]
    assert "MatMul" in ops and ops.count("MatMulNBits") == 2
    onnx.checker.check_model(proto)
    nbits = [n for n in proto.graph.node if n.op_type == "MatMulNBits"]
    assert [a.i for n in nbits for a in n.attribute if a.name == "bits"] == [4, 8]
    branches = offset_branches(proto.graph)
    mt, add, shift = branches[nbits[0].name]
    assert add.output[0] == "h" and nbits[1].name not in branches
    # Q4_1 rows: zero point 8 and an offset of m + 8 d (E 8), Q4_0 rows zero point 8, E 0
    inits = {i.name: numpy_helper.to_array(i) for i in proto.graph.initializer}
    e = inits[shift].reshape(-1)
    assert e.tolist() == [8.0] * 48 + [0.0] * 16 + [8.0] * 32
    zp = inits[nbits[0].input[3]]  # two a byte, K / 32 = 3 of them (the 4th nibble a pad)
    assert (np.stack([zp & 15, zp >> 4], -1).reshape(len(zp), -1)[:, :3] == 8).all()
    x = np.random.default_rng(1).standard_normal((1, 300, K)).astype(np.float32)
    # float activations: the file's weights to float32 rounding
    h, logits = _session(proto, 0).run(None, {"x": x[:, :7]})
    ref_h = x[0, :7].astype(np.float64) @ body.T.astype(np.float64)
    assert np.abs(h[0] - ref_h).max() <= 1e-5 * np.abs(ref_h).max()
    ref_l = h[0].astype(np.float64) @ want["q80"].T.astype(np.float64)
    assert np.abs(logits[0] - ref_l).max() <= 1e-5 * np.abs(ref_l).max()
    # int8 activations (as shipped): a row's outputs do not depend on its block's size from
    # 2 rows on (the package's min_rows)
    s = _session(proto, 4)
    first = s.run(None, {"x": x[:, :2]})
    assert np.abs(first[0][0] - ref_h[:2]).max() <= 0.02 * np.abs(ref_h).max()
    for t in (3, 8, 17, 130, 257):
        got = s.run(None, {"x": x[:, :t]})
        for a, b in zip(got, first):
            assert np.array_equal(a[0, :2], b[0]), t


def test_native_packing_holds_offsets_as_halves_and_drops_zero_zero_points():
    from edgemtp.runtimes.native_backend import pack_q4

    rng = np.random.default_rng(2)
    q = rng.integers(0, 16, (20, 64)).astype(np.uint8)
    d = np.full((20, 2), 0.125, np.float32)
    m = (-rng.random((20, 2)) * 0.1).astype(np.float16).astype(np.float32)
    G, nb, w, sc, z, mn = pack_q4(q, d, np.zeros((20, 2), np.uint8), m)
    assert z is None and mn.dtype == np.float16 and mn.shape == (2, 2, 16)
    assert mn[1, 0, 3] == np.float16(m[19, 0]) and mn[1, 0, 4] == 0  # column 19; 20 is a pad
    assert pack_q4(q, d, np.full((20, 2), 8, np.uint8), m)[4] is not None  # Q4_0 rows mixed in
    assert pack_q4(q, d, np.zeros((20, 2), np.uint8))[5] is None
    with pytest.raises(ValueError, match="half-precision"):
        pack_q4(q, d, np.zeros((20, 2), np.uint8), m + np.float32(1e-6))


def test_a_wide_head_takes_q8_0_blocks_as_llama_cpp_writes_them(tmp_path):
    """An LM head the file stores in more than 4 bits (F16 here; Q6_K from llama-quantize)
    goes into Q8_0 blocks bit for bit as llama.cpp (and gguf-py) quantize them, not down to
    4 bits; a 4-bit head, --requantize head (eight_bit False) or K off the 32 grid: None."""
    from gguf import GGMLQuantizationType as Q

    from edgemtp.export.gguf_blocks import Blocks8

    rng = np.random.default_rng(3)
    w = (rng.standard_normal((40, K)) * 0.05).astype(np.float32)
    w[3, :32] = 0  # an all-zero block: d 0, q 0
    want = gguf.quants.dequantize(gguf.quants.quantize(w, Q.Q8_0), Q.Q8_0)
    b = Blocks8.quantize(w)
    assert np.array_equal(b.dequantize(), want) and b.types == ()

    def written(head):
        path = tmp_path / f"head-{head.name}.gguf"
        g = gguf.GGUFWriter(str(path), "llama")
        if head in (Q.F16, Q.F32):
            g.add_tensor("token_embd.weight", w.astype(np.float16 if head == Q.F16 else np.float32))
        else:
            data = gguf.quants.quantize(w, head)
            g.add_tensor("token_embd.weight", data, raw_shape=data.shape, raw_dtype=head)
        g.write_header_to_file()
        g.write_kv_data_to_file()
        g.write_tensors_to_file()
        g.close()
        return path

    f16 = FileBlocks(written(Q.F16))
    assert f16.head_name == "F16" and np.array_equal(f16.head8(w).dequantize(), want)
    assert FileBlocks(written(Q.F16), eight_bit=False).head8(w) is None  # --requantize head
    assert f16.head8(w[:, :48]) is None                                   # K off the grid
    q40 = FileBlocks(written(Q.Q4_0))
    assert q40.head8(gguf.quants.dequantize(gguf.quants.quantize(w, Q.Q4_0), Q.Q4_0)) is None
    q80 = FileBlocks(written(Q.Q8_0))  # the file's own Q8_0 blocks: found, not re-made
    assert q80.head8(want).types == ("Q8_0",)
