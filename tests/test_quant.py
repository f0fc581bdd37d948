"""``edgemtp export --dtype int4|int8``: weight-only MatMulNBits graphs, the tied embedding
stored once (and read by the host from the graph's own table), a self-check that catches a
corrupted weight, and speculation that equals plain decoding of the same package.

stories260K in the default run (one int4 export per module, one traced graph per weight
format); SmolLM2 from its GGUF in the slow run.
"""

import json
import shutil
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
from edgemtp.export.quantize import QUANTIZED, block_quantize, dequantize  # noqa: E402
from edgemtp.export.selfcheck import TOLERANCE, SelfCheckError  # noqa: E402
from edgemtp.runtimes.package import MANIFEST, load_package  # noqa: E402

SHARED = Path(__file__).resolve().parents[1] / ".." / "shared"
STORIES = SHARED / "models" / "stories260K"
SMOLLM = SHARED / "models" / "SmolLM2-135M-Instruct-GGUF"
DRAFTERS = ("probe", "pld", "hybrid", "lade", "stand", "auto")


@pytest.fixture(scope="module")
def int4_pkg(tmp_path_factory):
    out = tmp_path_factory.mktemp("quant") / "stories-int4"
    export_package(str(STORIES), out, dtype="int4", max_context=256, progress=False)
    return out


def test_int4_package_holds_the_tied_table_once_quantized(int4_pkg):
    pkg = load_package(int4_pkg)
    assert pkg.weights.name == "int4-b32-asym-acc4" and pkg.weights.tied_embedding
    assert pkg.weights.min_rows == 2 and pkg.weights.softmax == "float64"
    assert pkg.meta.dtype == "fp32" and pkg.meta.cache.dtype == "fp32"
    assert not (int4_pkg / "embeddings.npy").exists()
    proto = onnx.load(str(int4_pkg / "model.onnx"), load_external_data=False)
    ops = [n.op_type for n in proto.graph.node]
    assert ops.count("GatherBlockQuantized") == 1 and "Gather" in ops
    assert ops.count("MatMulNBits") == 5 * 7 + 1  # q k v o gate up down per layer + lm_head
    floats = [i for i in proto.graph.initializer if i.data_type == onnx.TensorProto.FLOAT
              and sorted(i.dims) == [64, 512]]
    assert not floats, [i.name for i in floats]  # no float [V, d] or [d, V] table left
    gather = next(n for n in proto.graph.node if n.op_type == "GatherBlockQuantized")
    lm_head = [n for n in proto.graph.node if n.op_type == "MatMulNBits"][-1]
    assert gather.input[2:] == lm_head.input[2:4]  # the same scales and zero points


def test_host_table_is_the_graphs_dequantized_embedding(int4_pkg):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(STORIES)).eval()
    w = hf.get_input_embeddings().weight.detach().numpy()
    want = dequantize(*block_quantize(w, QUANTIZED["int4"]), QUANTIZED["int4"], w.shape[1])
    pkg = load_package(int4_pkg)
    ids = np.array([0, 7, 511, 7])
    got = pkg.embedding_table().rows(ids)
    assert got.dtype == np.float32 and np.array_equal(got, want[ids])
    assert np.allclose(pkg.meta.embeddings.mu, want.mean(0), atol=1e-6)


def test_every_drafter_equals_plain_decoding_of_the_int4_package(int4_pkg):
    model, prompt = Model.load(str(int4_pkg), threads=1), "Once upon a time"
    plain = model.generate(prompt, drafter="none", max_new_tokens=48).token_ids
    for drafter in DRAFTERS:
        got = model.generate(prompt, drafter=drafter, bc=30, max_new_tokens=48).token_ids
        assert got == plain, drafter


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
    decoder.softmax_dtype = torch.float64
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
    model = Model.load(str(int4_pkg), threads=1)
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
    model = Model.load(str(out), threads=2)
    for question in ("What is the capital of France? Explain in two sentences.",
                     "Write a haiku about a KV cache."):
        ids = model.encode_chat([{"role": "user", "content": question}])
        plain = model.generate(ids, drafter="none", max_new_tokens=48).token_ids
        for drafter in ("hybrid", "pld", "probe", "auto"):
            got = model.generate(ids, drafter=drafter, bc=10, max_new_tokens=48).token_ids
            assert got == plain, (question, drafter)
