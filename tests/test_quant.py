"""``edgemtp export --dtype int4|int8``: weight-only MatMulNBits graphs, the tied embedding
stored once (and read by the host from the graph's own table), a self-check that catches a
corrupted weight, and speculation that equals plain decoding of the same package.

stories260K in the default run (one int4 export per module, one traced graph per weight
format); SmolLM2 from its GGUF in the slow run.
"""

import json
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")

from edgemtp import Model  # noqa: E402
from edgemtp.errors import ModelLoadError  # noqa: E402
from edgemtp.export.onnx_export import export_package  # noqa: E402
from edgemtp.export.selfcheck import TOLERANCE, SelfCheckError  # noqa: E402
from edgemtp.runtimes.package import MANIFEST, load_package  # noqa: E402

from conftest import smollm2_dir  # noqa: E402

SHARED = Path(__file__).resolve().parents[1] / ".." / "shared"
STORIES = SHARED / "models" / "stories260K"
SMOLLM = smollm2_dir()  # ../shared's, else the main job's fetched copy
DRAFTERS = ("probe", "pld", "hybrid", "lade", "stand", "auto")


@pytest.fixture(scope="module")
def int4_pkg(tmp_path_factory):
    out = tmp_path_factory.mktemp("quant") / "stories-int4"
    export_package(str(STORIES), out, dtype="int4", max_context=256, progress=False)
    return out


def test_int4_package_holds_the_tied_table_once_quantized(int4_pkg):
    pkg = load_package(int4_pkg)
    assert pkg.weights.name == "int4-b32-asym-acc4" and pkg.weights.tied_embedding
    assert pkg.weights.min_rows == 2 and pkg.weights.softmax == "exact"
    assert pkg.meta.dtype == "fp32" and pkg.meta.cache.dtype == "fp32"
    assert not (int4_pkg / "embeddings.npy").exists()
    proto = onnx.load(str(int4_pkg / "model.onnx"), load_external_data=False)
    ops = [n.op_type for n in proto.graph.node]
    assert ops.count("GatherBlockQuantized") == 1 and "Gather" in ops
    assert ops.count("MatMulNBits") == 5 * 4 + 1  # qkv, o, gate-up, down per layer + lm_head
    floats = [i for i in proto.graph.initializer if i.data_type == onnx.TensorProto.FLOAT
              and sorted(i.dims) == [64, 512]]
    assert not floats, [i.name for i in floats]  # no float [V, d] or [d, V] table left
    gather = next(n for n in proto.graph.node if n.op_type == "GatherBlockQuantized")
    lm_head = [n for n in proto.graph.node if n.op_type == "MatMulNBits"][-1]
    assert gather.input[2:] == lm_head.input[2:4]  # the same scales and zero points


def test_int4_graph_runs_rotary_and_residual_norms_as_fused_contrib_ops(int4_pkg):
    """Quantized graphs, tied to onnxruntime by MatMulNBits anyway, take its fused
    RotaryEmbedding and SkipSimplifiedLayerNormalization (fewer nodes per layer); rotary
    tables cover the whole context; fp32 graphs stay standard ONNX (TensorRT parses them)."""
    proto = onnx.load(str(int4_pkg / "model.onnx"), load_external_data=False)
    ops = [n.op_type for n in proto.graph.node]
    layers = load_package(int4_pkg).meta.num_layers
    assert load_package(int4_pkg).weights.fused
    assert ops.count("RotaryEmbedding") == 2 * layers           # q and k
    assert ops.count("SkipSimplifiedLayerNormalization") == 2 * layers
    assert "ReduceLogSumExp" not in ops
    rotary = next(n for n in proto.graph.node if n.op_type == "RotaryEmbedding")
    tables = {i.name: i for i in proto.graph.initializer}
    nodes = {o: n for n in proto.graph.node for o in n.output}
    cos = rotary.input[2]
    dims = (tables[cos].dims if cos in tables
            else onnx.helper.get_attribute_value(nodes[cos].attribute[0]).dims)
    assert list(dims) == [256, load_package(int4_pkg).meta.head_dim // 2]  # max_context 256


def test_blocks_reaching_past_the_context_end_run_on_the_fused_graph(tmp_path):
    """Near the end of the context a tree may hold draft rows at positions past the rotary
    tables (max_context rows); they are never committed, and the generation ends at the
    context with plain decoding's tokens."""
    out = tmp_path / "int4-64"
    export_package(str(STORIES), out, dtype="int4", max_context=64, progress=False)
    model = Model.load(str(out), backend="onnxruntime", threads=1)
    prompt = model.encode("Once upon a time, there was a little girl named Lily. She loved to")
    plain = model.generate(prompt, drafter="none", max_new_tokens=200)
    assert plain.stop_reason == "max_context"
    for d in ("probe", "pld", "hybrid", "auto"):
        got = model.generate(prompt, drafter=d, bc=30, max_new_tokens=200)
        assert got.token_ids == plain.token_ids and got.stop_reason == "max_context", d


def test_a_bad_fused_flag_in_the_manifest_is_one_line(int4_pkg, tmp_path):
    pkg = tmp_path / "pkg"
    shutil.copytree(int4_pkg, pkg)
    m = json.loads((pkg / MANIFEST).read_text())
    m["weights"]["fused"] = "yes"
    (pkg / MANIFEST).write_text(json.dumps(m))
    with pytest.raises(ModelLoadError, match="'weights.fused' should be true or false, got 'yes'"
                       ) as err:
        load_package(pkg)
    assert "\n" not in str(err.value)
    out = subprocess.run([sys.executable, "-m", "edgemtp.cli", "inspect", str(pkg)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr


def test_fp32_graph_has_no_onnxruntime_contrib_ops(tmp_path):
    out = tmp_path / "fp32"
    export_package(str(STORIES), out, dtype="fp32", max_context=64, progress=False)
    proto = onnx.load(str(out / "model.onnx"), load_external_data=False)
    assert {n.domain for n in proto.graph.node} <= {"", "ai.onnx"}


def test_host_table_is_the_graphs_dequantized_embedding(int4_pkg):
    from transformers import AutoModelForCausalLM

    from edgemtp.export.gguf_blocks import Blocks8

    hf = AutoModelForCausalLM.from_pretrained(str(STORIES)).eval()
    w = hf.get_input_embeddings().weight.detach().numpy()
    # the tied LM head, and so the table, is 8-bit: llama.cpp's Q8_0 blocks
    want = Blocks8.quantize(w).dequantize()
    pkg = load_package(int4_pkg)
    assert pkg.weights.head8_from == "F32"
    ids = np.array([0, 7, 511, 7])
    got = pkg.embedding_table().rows(ids)
    assert got.dtype == np.float32 and np.array_equal(got, want[ids])
    assert np.allclose(pkg.meta.embeddings.mu, want.mean(0), atol=1e-6)


def test_host_table_dequantizes_a_row_once_and_hands_out_copies(int4_pkg):
    # the mask embeddings' EMA asks for each step's committed tokens: a row already asked
    # for comes from the cache, the same values, and a caller's edits never reach it
    table = load_package(int4_pkg).embedding_table()
    asked = []
    fetch = table.rows.fetch
    table.rows.fetch = lambda ids: (asked.append(list(ids)), fetch(ids))[1]
    first = table.rows(np.array([7, 9, 7]))
    again = table.rows(np.array([[9], [7], [11]]))
    assert asked == [[7, 9], [11]]
    assert np.array_equal(again[:2, 0], first[[1, 0]]) and again.shape == (3, 1, first.shape[1])
    assert np.array_equal(again[2, 0], fetch(np.array([11]))[0])
    first[:] = 0.0
    assert np.array_equal(table.rows(np.array([7])), fetch(np.array([7])))


def test_int4_package_keeps_its_values_in_float64_and_binds_them_as_such(int4_pkg):
    # the exact sums add p @ V in float64: the graph takes and gives V in float64 and the
    # cache holds it so, rather than a cast of the whole past every layer and step
    pkg = load_package(int4_pkg)
    assert pkg.meta.cache.value_dtype == "fp64" and pkg.np_value_dtype == np.float64
    proto = onnx.load(str(int4_pkg / "model.onnx"), load_external_data=False)
    types = {v.name: v.type.tensor_type.elem_type
             for v in list(proto.graph.input) + list(proto.graph.output)}
    assert types["past_value_0"] == types["present_value_4"] == onnx.TensorProto.DOUBLE
    assert types["past_key_0"] == types["present_key_4"] == onnx.TensorProto.FLOAT
    commit = onnx.load(str(int4_pkg / "kv_commit.onnx"))
    ctypes = {v.name: v.type.tensor_type.elem_type
              for v in list(commit.graph.input) + list(commit.graph.output)}
    assert ctypes["present_values"] == ctypes["commit_value_0"] == onnx.TensorProto.DOUBLE
    assert ctypes["present_keys"] == ctypes["commit_key_0"] == onnx.TensorProto.FLOAT
    # both caches: the committed rows are the block's V on the exact grid, and the KV bytes
    # the package reports are the ones it holds (4 B keys + 8 B values)
    m = pkg.meta
    assert pkg.kv_cache_bytes(10) == m.num_layers * 10 * m.num_kv_heads * m.head_dim * 12
    from edgemtp.runtimes.onnxrt_backend import OrtBackend

    for device_cache in (False, True):
        s = OrtBackend(str(int4_pkg), threads=1, device_cache=device_cache).session()
        n = 6
        s.forward(np.arange(n) + 3, np.arange(n), np.tril(np.ones((n, n), bool)), None)
        s.commit(np.arange(n))
        kv = s.kv
        v = kv.v if isinstance(kv.v, np.ndarray) else kv.v.numpy()
        assert v.dtype == np.float64 and np.abs(v[:, :n]).max() > 0
        assert np.array_equal(v[:, :n] * 2.0 ** 18, np.round(v[:, :n] * 2.0 ** 18))
        assert not np.any(v[:, n:])
    # and a generation through either cache is plain decoding's
    from edgemtp import GenerationConfig
    from edgemtp.engine import Generation

    ids = [1, 403, 407, 261]
    want = Generation(OrtBackend(str(int4_pkg), threads=1),
                      GenerationConfig(max_new_tokens=24, drafter="none"), ids).run().token_ids
    for device_cache in (False, True):
        got = Generation(OrtBackend(str(int4_pkg), threads=1, device_cache=device_cache),
                         GenerationConfig(max_new_tokens=24, bc=30, drafter="hybrid"),
                         ids).run().token_ids
        assert got == want, device_cache


def test_every_drafter_equals_plain_decoding_of_the_int4_package(int4_pkg):
    model, prompt = Model.load(str(int4_pkg), backend="onnxruntime", threads=1), "Once upon a time"
    plain = model.generate(prompt, drafter="none", max_new_tokens=48).token_ids
    for drafter in DRAFTERS:
        got = model.generate(prompt, drafter=drafter, bc=30, max_new_tokens=48).token_ids
        assert got == plain, drafter


def test_symmetric_int4_has_no_zero_points_and_stays_lossless(tmp_path):
    # --symmetric: onnxruntime-genai's layout (a scale per block, no zero point), the
    # self-check's reference de-quantizes it the same way (it passes: the export completes)
    out = tmp_path / "sym"
    export_package(str(STORIES), out, dtype="int4", max_context=128, progress=False,
                   symmetric=True)
    pkg = load_package(out)
    assert pkg.weights.name == "int4-b32-sym-acc4" and pkg.weights.min_rows == 2
    proto = onnx.load(str(out / "model.onnx"), load_external_data=False)
    nbits = [n for n in proto.graph.node if n.op_type in ("MatMulNBits", "GatherBlockQuantized")]
    assert nbits and all(len([i for i in n.input if i]) == 3 for n in nbits)
    model, prompt = Model.load(str(out), backend="onnxruntime", threads=1), "Once upon a time"
    plain = model.generate(prompt, drafter="none", max_new_tokens=32).token_ids
    for drafter in ("probe", "hybrid", "auto"):
        assert model.generate(prompt, drafter=drafter, bc=10,
                              max_new_tokens=32).token_ids == plain, drafter


def test_symmetric_without_int_weights_is_one_line(tmp_path):
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "edgemtp.cli", "export", str(STORIES), "-o",
                           str(tmp_path / "x"), "--symmetric"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].endswith(
        "symmetric quantization is for int4/int8 exports, not fp32; drop --symmetric or "
        "export --dtype int4|int8")
    assert not (tmp_path / "x").exists()


def _graph_and_reference(fmt: str, folder: Path):
    """What export does up to the self-check: trace, quantize, and the PyTorch reference with
    the same de-quantized weights."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from edgemtp.export.graph import ExportDecoder, ExportTreeDecoder
    from edgemtp.export.onnx_export import _write_graph
    from edgemtp.export.quantize import fake_quantize
    from edgemtp.models.decoder import TreeDecoder
    from edgemtp.models.families import family_for

    hf = AutoModelForCausalLM.from_pretrained(str(STORIES), dtype=torch.float32).eval()
    family = family_for(hf.config)
    decoder = ExportTreeDecoder(hf, family)
    decoder.exact_attention = True
    graph = _write_graph(ExportDecoder(decoder, 31).eval(), folder, torch.float32, 17, fmt)
    fake_quantize(hf, graph.spec)
    return ExportDecoder(TreeDecoder(hf, family), 31).eval(), \
        AutoTokenizer.from_pretrained(str(STORIES))


@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_self_check_catches_one_corrupted_block_of_scales(fmt, tmp_path):
    from edgemtp.export.onnx_export import _check_quantized

    job = SimpleNamespace(budgets=[(30, 1)])
    good, broken = tmp_path / "good", tmp_path / "broken"
    good.mkdir()
    reference, tok = _graph_and_reference(fmt, good)
    strict, loose = TOLERANCE["fp32"], TOLERANCE[fmt]
    check = _check_quantized(good, reference, job, tok, strict, loose)  # the real one passes
    assert check.token_rows <= strict[0] * check.scale
    proto = onnx.load(str(good / "model.onnx"))
    node = next(n for n in proto.graph.node
                if n.op_type == "MatMulNBits" and "down_proj" in n.name)
    init = next(i for i in proto.graph.initializer if i.name == node.input[2])
    scales = onnx.numpy_helper.to_array(init).copy()
    scales[0, 0] = -scales[0, 0]  # one block of 32 weights of one output channel
    init.CopyFrom(onnx.numpy_helper.from_array(scales, init.name))
    broken.mkdir()
    onnx.save_model(proto, str(broken / "model.onnx"), save_as_external_data=True,
                    location="model.onnx.data")
    with pytest.raises(SelfCheckError) as err:
        _check_quantized(broken, reference, job, tok, strict, loose)
    text = str(err.value)
    assert "self-check failed" in text and "\n" not in text


def test_one_row_computes_what_the_same_row_computes_inside_a_block(int4_pkg):
    """Batch invariance, bitwise: a block of rows that each see the cache and themselves,
    against each row alone (plain decoding's step; run as two rows, min_rows 2)."""
    model = Model.load(str(int4_pkg), backend="onnxruntime", threads=1)
    session = model.backend.session()
    prompt = model.encode("Once upon a time, there was a")
    session.forward(prompt, np.arange(len(prompt)), np.tril(np.ones((len(prompt),) * 2, bool)),
                    None)
    session.commit(np.arange(len(prompt)))
    ids, pos = np.array([5, 77, 300, 9, 42]), np.full(5, len(prompt))
    block = session.forward(ids, pos, np.eye(5, dtype=bool), None, full_logits=True).logits.copy()
    for i in range(5):
        alone = session.forward(ids[i:i + 1], pos[i:i + 1], np.ones((1, 1), bool), None,
                                full_logits=True).logits
        assert np.array_equal(alone[0], block[i]), i


def _edit(pkg: Path, change) -> None:
    m = json.loads((pkg / MANIFEST).read_text())
    change(m["embeddings"])
    (pkg / MANIFEST).write_text(json.dumps(m))


@pytest.mark.parametrize("change, message", [
    (lambda e: e["data"].__setitem__("shape", [512, 16]), "embeddings.data is [512, 16]"),
    (lambda e: e["scales"].__setitem__("offset", 10**9), "runs past the end"),
    (lambda e: e.__setitem__("layout", "rows"), "'embeddings.layout' must be one of"),
    (lambda e: e.pop("bits"), "needs 'bits' (4 or 8)"),
])
def test_bad_quantized_table_in_the_manifest_is_one_line(int4_pkg, tmp_path, change, message):
    pkg = tmp_path / "pkg"
    shutil.copytree(int4_pkg, pkg)
    _edit(pkg, change)
    with pytest.raises(ModelLoadError, match=message.replace("[", r"\[").replace("(", r"\(")
                       .replace(")", r"\)")) as err:
        load_package(pkg)
    assert "\n" not in str(err.value)


@pytest.mark.slow
def test_smollm2_gguf_int4_package_is_small_and_chats_losslessly(tmp_path):
    out = tmp_path / "smollm2-int4"
    export_package(str(SMOLLM), out, dtype="int4", max_context=1024, progress=False)
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    assert size <= 120e6, size
    pkg = load_package(out)  # the file's own blocks: 4-bit body, Q8_0 tied LM head
    assert pkg.weights.kept_blocks == pkg.weights.products == 4 * 30 + 1
    assert pkg.manifest["embeddings"]["bits"] == 8
    # (qa8b D11: neither the export line nor inspect said the head is at 8 bits)
    assert pkg.weights.head8_from == "Q8_0"
    from edgemtp.runtimes.package import describe

    shown = describe(pkg)
    assert "121 of 121 products keep the GGUF file's own blocks, the LM head at 8 bits " \
           "(the file's Q8_0)" in shown and "int4 weights, fp32 activations" in shown, shown
    _close_to_the_files_model(out)
    for backend in ("onnxruntime", "native"):  # each lossless against its own plain decoding
        model = Model.load(str(out), backend=backend, threads=2)
        for question in ("What is the capital of France? Explain in two sentences.",
                         "Write a haiku about a KV cache."):
            ids = model.encode_chat([{"role": "user", "content": question}])
            plain = model.generate(ids, drafter="none", max_new_tokens=48).token_ids
            for drafter in ("hybrid", "pld", "probe", "auto"):
                got = model.generate(ids, drafter=drafter, bc=10, max_new_tokens=48).token_ids
                assert got == plain, (backend, question, drafter)


def _close_to_the_files_model(out: Path) -> None:
    """The package's native decoder, teacher-forced on the GGUF's own fp32 model's greedy
    answer (transformers), picks the same top-1 token on >= 90 % of its rows; a package
    whose blocks were re-quantized agreed on 69 % (bench/results/gguf_fidelity_cpu.md)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from edgemtp.runtimes.native_backend import NativeBackend

    gguf = next(SMOLLM.glob("*.gguf"))
    tok = AutoTokenizer.from_pretrained(str(SMOLLM), gguf_file=gguf.name)
    hf = AutoModelForCausalLM.from_pretrained(str(SMOLLM), gguf_file=gguf.name,
                                              dtype=torch.float32).eval()
    backend = NativeBackend(out, threads=2)
    assert backend.kept_blocks == 4 * 30 and backend.head_bits == 8
    # the 8-bit head: twice a 4-bit one's products on AVX2 (two nibbles a byte), as many
    # where a product reads the byte whole
    if backend.lib.decoder_kernel() == 3:
        assert 0.33 < backend.lm_row_share < 0.37
    else:
        assert 0.19 < backend.lm_row_share < 0.23
    same = []
    for q in ("Explain why the sky is blue.", "Write a short poem about the sea."):
        ids = tok.apply_chat_template([{"role": "user", "content": q}],
                                      add_generation_prompt=True, return_tensors="pt",
                                      return_dict=False)
        with torch.no_grad():
            seq = hf.generate(ids, max_new_tokens=40, do_sample=False)[0]
            want = hf(seq[None]).logits[0].argmax(-1).numpy()
        t, n = len(seq), ids.shape[1]
        got = backend.session().forward(seq.numpy(), np.arange(t), np.tril(np.ones((t, t), bool)),
                                        None, full_logits=True).logits.argmax(-1)
        same += list(got[n - 1:t - 1] == want[n - 1:t - 1])
    assert np.mean(same) >= 0.9, np.mean(same)


def test_a_chain_inside_one_block_gives_plain_decodings_bits_at_a_long_context(int4_pkg):
    """The chain test at 200 tokens of context: plain decoding's steps (each token alone, its
    ancestors in the cache) against one causal block of the same tokens (its ancestors in the
    block, at other columns), logits compared bitwise."""
    model = Model.load(str(int4_pkg), backend="onnxruntime", threads=1)
    prompt = np.random.default_rng(3).integers(3, 512, 200)
    chain = np.random.default_rng(4).integers(3, 512, 12)

    def prefilled():
        session = model.backend.session()
        session.forward(prompt, np.arange(200), np.tril(np.ones((200, 200), bool)), None)
        session.commit(np.arange(200))
        return session

    session, steps = prefilled(), []
    for i, token in enumerate(chain):
        out = session.forward(chain[i:i + 1], np.array([200 + i]), np.ones((1, 1), bool), None,
                              full_logits=True)
        steps.append(out.logits[0].copy())
        session.commit(np.array([0]))
    block = prefilled().forward(chain, 200 + np.arange(12), np.tril(np.ones((12, 12), bool)),
                                None, full_logits=True).logits
    for i in range(12):
        assert np.array_equal(steps[i], block[i]), i


def test_exact_sums_give_the_same_bits_whichever_columns_the_ancestors_sit_in(tmp_path):
    """exact_sums in onnxruntime: one row's attention over 700 columns, its last 10 either in
    the past part or in the block part (shifted), is bitwise the same; the plain float64
    softmax and ``probs @ values`` it replaced are not (so the test can fail)."""
    import onnxruntime as ort
    import torch

    from edgemtp.export.graph import V_GRID, exact_sums

    class Attention(torch.nn.Module):
        def __init__(self, exact: bool, past: int):
            super().__init__()
            self.exact, self.past = exact, past

        def forward(self, logits, v_past, v_new):
            if self.exact:
                return exact_sums(logits, v_past, v_new, self.past).float()
            probs = torch.softmax(logits.double(), dim=-1)
            return (probs[..., :self.past] @ v_past.double()
                    + probs[..., self.past:] @ v_new.double()).float()

    # uniform rows over values whose columns sum to nearly 0: the exact result is tiny, so the
    # float64 rounding errors of a different grouping show in its float32 bits
    rng = np.random.default_rng(0)
    n, d = 700, 64
    logits = np.zeros((3, 6, n), np.float32)
    half = np.round(rng.normal(0, 100, (3, n // 2, d)) * V_GRID)
    values = np.concatenate([half, -half[:, ::-1]], axis=1)
    values[:, 0] += 1  # each column sums to 2^-18
    values = (values / V_GRID).astype(np.float32)
    assert np.abs(values).max() < 2 ** 10
    outs = {}
    for exact in (True, False):
        for past in (n - 10, n - 1, 512, 256):
            path = tmp_path / f"{exact}-{past}.onnx"
            args = tuple(torch.from_numpy(x) for x in (logits, values[:, :past], values[:, past:]))
            torch.onnx.export(Attention(exact, past), args, str(path), opset_version=17,
                              input_names=["l", "vp", "vn"], dynamo=False)
            s = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
            outs[exact, past] = s.run(None, {"l": logits, "vp": values[:, :past],
                                             "vn": values[:, past:]})[0]
    exact = [outs[True, p] for p in (n - 10, n - 1, 512, 256)]
    assert all(np.array_equal(exact[0], o) for o in exact[1:])
    plain = [outs[False, p] for p in (n - 10, n - 1, 512, 256)]
    assert not all(np.array_equal(plain[0], o) for o in plain[1:])
    assert np.abs(exact[0] - plain[0]).max() < 1e-7  # the grids cost next to nothing


def test_a_block_of_128j_plus_1_rows_gives_the_rows_of_a_longer_block(int4_pkg):
    """MLAS cuts a MatMulNBits' rows into chunks of 128 and runs a chunk of one row through
    its one-row kernel: the runtime pads a block of 129 rows (as a one-row step) with a
    throwaway row, so its rows are the bits the same rows give inside 130."""
    from edgemtp.runtimes.package import run_rows

    assert [run_rows(t, 2) for t in (1, 2, 128, 129, 257, 769)] == [2, 2, 128, 130, 258, 770]
    assert [run_rows(t, 1) for t in (1, 129)] == [1, 129]
    model = Model.load(str(int4_pkg), backend="onnxruntime", threads=2)
    ids = np.random.default_rng(5).integers(3, 512, 130)

    def rows(t):
        causal = np.tril(np.ones((t, t), bool))
        return model.backend.session().forward(ids[:t], np.arange(t), causal, None,
                                               full_logits=True).logits.copy()

    assert np.array_equal(rows(129), rows(130)[:129])
