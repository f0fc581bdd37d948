"""GGUF input: ``edgemtp export`` and the torch backend read a llama.cpp GGUF file (by its
path, or as the one ``*.gguf`` in a folder) through transformers' own GGUF loader, which
de-quantizes its weights. One real model (SmolLM2-135M-Instruct, Q4_1, from ../shared) is
exported once per module, fp32, with one small budget; bad GGUF inputs run the real CLI.
"""

import io
import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from contextlib import redirect_stdout
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("onnxruntime")
gguf = pytest.importorskip("gguf")

from edgemtp.api import Model  # noqa: E402
from edgemtp.cli import main  # noqa: E402
from edgemtp.runtimes.gguf_source import ModelSource, resolve_model  # noqa: E402
from edgemtp.runtimes.package import load_package  # noqa: E402
from edgemtp.tokenizer import Tokenizer  # noqa: E402
from conftest import smollm2_dir  # noqa: E402
from test_export import cli  # noqa: E402
from test_package_errors import error_line  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SMOL = smollm2_dir()  # ../shared's, else the main job's fetched copy
NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
PROMPTS = ["What is the capital of France? Explain in two sentences.",
           "<|im_start|>user\nWrite a haiku about the sea.<|im_end|>\n<|im_start|>assistant\n"]
TEXTS = [*PROMPTS, "  Tabs\tand  spaces, émojis 🙂 and 12345 digits.", "def f(x):\n    return x**2"]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> tuple[Path, str]:
    """The shared GGUF exported through the CLI entry point (in process), fp32, and the
    summary it printed."""
    assert (SMOL / NAME).is_file(), f"missing shared model {SMOL / NAME}"
    out, printed = tmp_path_factory.mktemp("gguf") / "smollm2", io.StringIO()
    with redirect_stdout(printed):
        assert main(["export", str(SMOL / NAME), "-o", str(out), "--max-context", "512",
                     "--bc", "10", "--mask-tokens", "1", "--quiet"]) == 0
    return out, printed.getvalue()


@pytest.fixture(scope="module")
def pkg(exported) -> Path:
    return exported[0]


@pytest.fixture(scope="module")
def reference():
    """transformers on its own: the GGUF-loaded tokenizer and model, and its greedy output."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(SMOL), gguf_file=NAME)
    hf = AutoModelForCausalLM.from_pretrained(str(SMOL), gguf_file=NAME).eval()
    refs = []
    for p in PROMPTS:
        ids = tok(p, return_tensors="pt").input_ids
        with torch.no_grad():
            out = hf.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False,
                              pad_token_id=tok.eos_token_id)
        refs.append(out[0, ids.shape[1]:].tolist())
    return tok, refs


# -- resolving a GGUF path ------------------------------------------------------------------


def test_a_gguf_path_resolves_to_its_folder_and_file(tmp_path):
    assert resolve_model(str(SMOL / NAME)) == ModelSource(str(SMOL), NAME)
    assert resolve_model(str(SMOL)) == ModelSource(str(SMOL), NAME)
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "x.gguf").write_bytes(b"")  # a Hugging Face folder: its config wins
    assert resolve_model(str(tmp_path)) == ModelSource(str(tmp_path))


# -- the exported package -------------------------------------------------------------------


@pytest.mark.slow  # the 135M export: ~1-2 min on 2 cores, CI's -m slow run
def test_summary_says_the_weights_were_dequantized(exported):
    assert f"fp32, weights de-quantized from GGUF {NAME}: Q4_1 x210, F32 x61, Q8_0 x1" \
        in exported[1]


@pytest.mark.slow  # the 135M export: ~1-2 min on 2 cores, CI's -m slow run
def test_manifest_records_the_gguf_source_and_the_tokenizer_files(pkg):
    meta = load_package(pkg).meta
    assert meta.source == str((SMOL / NAME).resolve())
    g = meta.gguf
    assert (g.file, g.architecture, g.sha256) == (NAME, "llama", SHA256)
    assert dict(g.tensor_types) == {"Q4_1": 210, "F32": 61, "Q8_0": 1}
    assert (meta.family, meta.dtype, meta.num_layers, meta.vocab_size) == ("llama", "fp32", 30,
                                                                           49152)
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(meta.tokenizer_files)
    template = json.loads((pkg / "tokenizer_config.json").read_text()).get("chat_template")
    assert template and "<|im_start|>" in template


@pytest.mark.slow  # the 135M export: ~1-2 min on 2 cores, CI's -m slow run
def test_package_tokenizer_encodes_as_transformers_gguf_tokenizer(pkg, reference):
    tok, _ = reference
    ours = Tokenizer(str(pkg))
    assert ours._fast is not None  # read with the tokenizers library alone
    for text in TEXTS:
        assert ours.encode(text) == tok(text).input_ids, text


@pytest.mark.slow  # the 135M export: ~1-2 min on 2 cores, CI's -m slow run
def test_package_greedy_equals_transformers_generate_and_probing_is_lossless(pkg, reference):
    tok, refs = reference
    model = Model.load(str(pkg), threads=2)
    for prompt, ref in zip(PROMPTS, refs):
        ids = tok(prompt).input_ids
        plain = model.generate(ids, max_new_tokens=NEW_TOKENS, drafter="none").token_ids
        assert plain == ref, prompt
        for drafter in ("probe", "pld"):
            out = model.generate(ids, max_new_tokens=NEW_TOKENS, bc=10, drafter=drafter)
            assert out.token_ids == plain, (prompt, drafter)


@pytest.mark.slow  # 40 s a path on 2 shared cores: transformers parses the GGUF 3 times
@pytest.mark.parametrize("path", [SMOL, SMOL / NAME], ids=["folder", "file"])
def test_torch_backend_loads_the_gguf_folder_and_file(reference, path):
    tok, refs = reference
    model = Model.load(str(path), threads=2)  # auto: torch, as for a Hugging Face folder
    assert model.backend.name == "torch"
    assert model.tokenizer.encode(PROMPTS[0]) == tok(PROMPTS[0]).input_ids
    out = model.generate(PROMPTS[0], max_new_tokens=8, bc=10, drafter="probe")
    assert out.token_ids == refs[0][:8]


# -- bad GGUF inputs, through the CLI -------------------------------------------------------


def _tiny_gguf(path: Path, arch: str) -> None:
    import numpy as np

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def bad_inputs(tmp_path_factory) -> dict:
    """``{case: finished export}`` for every bad GGUF input, four subprocesses at a time."""
    tmp = tmp_path_factory.mktemp("bad_gguf")
    truncated = tmp / "truncated.gguf"
    with open(SMOL / NAME, "rb") as src, open(truncated, "wb") as dst:
        dst.write(src.read(60_000_000))
    _tiny_gguf(tmp / "bert.gguf", "bert")
    _tiny_gguf(tmp / "mistral.gguf", "mistral")  # (transformers' GGUF loader cannot read it)
    two = tmp / "two"
    two.mkdir()
    for name in ("a.gguf", "b.gguf"):
        shutil.copy(tmp / "bert.gguf", two / name)
    cases = {"truncated": str(truncated), "architecture": str(tmp / "bert.gguf"),
             "mistral": str(tmp / "mistral.gguf"), "two files": str(two),
             "missing": str(tmp / "nothing.gguf")}
    with ThreadPoolExecutor(max_workers=4) as pool:
        futures = {k: pool.submit(cli, "export", p, "-o", str(tmp / "out" / k.replace(" ", "_")))
                   for k, p in cases.items()}
        return {k: f.result() for k, f in futures.items()}, tmp


@pytest.mark.parametrize("case, words", [
    ("truncated", ("damaged", "60000000 bytes", "truncated")),
    ("architecture", ("'bert'", "supported GGUF architectures: llama, qwen2, qwen3")),
    ("mistral", ("'mistral'", "a Mistral model's GGUF from llama.cpp says 'llama'")),
    ("two files", ("2 GGUF files", "a.gguf, b.gguf")),
    ("missing", ("GGUF file", "does not exist")),
])
def test_bad_gguf_input_is_one_line_and_exit_2(bad_inputs, case, words):
    procs, tmp = bad_inputs
    error_line(procs[case], *words)
    assert not (tmp / "out").exists()  # checked before any output folder is made


def test_truncated_gguf_is_refused_by_generate_too(bad_inputs):
    _, tmp = bad_inputs
    proc = cli("generate", "--model", str(tmp / "truncated.gguf"), "--prompt", "Hi")
    error_line(proc, "damaged")


@pytest.mark.slow  # two exports and six generations: ~15 s (the default run stays under 6 min)
def test_a_trained_models_q4_1_gguf_keeps_its_blocks_and_stays_lossless(tmp_path, monkeypatch):
    """QA (qa5, 1): stories260K as a Q4_1 GGUF (transformers reads it as the folder's model)
    exported with --dtype int4 failed the shipped graph's self-check: with zero point 0 the
    int8 activations' rounding met the Q4_1 codes 0..15, all positive, and a mask row of this
    64-wide model went 7.3 logits off (tolerance 5.9). With zero point 8 and an offset of
    m + 8 d the rows err as Q4_0's do (3.3 there): it exports keeping the file's blocks, and
    every drafter equals plain decoding on both backends. Past the tolerance (tightened here)
    the line says what works instead: --requantize all."""
    from gguf_writer import write_llama_gguf

    from edgemtp.export import selfcheck
    from edgemtp.export.selfcheck import SelfCheckError

    stories = ROOT / ".." / "shared" / "models" / "stories260K"
    src = tmp_path / "stories260K-Q4_1.gguf"
    write_llama_gguf(stories, src, "Q4_1")
    pkg = tmp_path / "kept"
    r = cli("export", str(src), "-o", str(pkg), "--dtype", "int4", "--quiet")
    assert r.returncode == 0, r.stderr
    assert "15 of 21 products keep the file's own blocks" in r.stdout + r.stderr
    for backend in ("native", "onnxruntime"):
        ids = {}
        for drafter in ("none", "hybrid", "auto"):
            g = cli("generate", "--model", str(pkg), "--backend", backend, "--prompt",
                    "Once upon a time", "--drafter", drafter, "--max-new-tokens", "40",
                    "--json")
            assert g.returncode == 0, g.stderr
            ids[drafter] = json.loads(g.stdout)["token_ids"]
        assert len(ids["none"]) == 40 and ids["hybrid"] == ids["none"] == ids["auto"], backend
    monkeypatch.setitem(selfcheck.TOLERANCE, "int4", (1e-3, 1e-3))
    with pytest.raises(SelfCheckError) as e:
        from edgemtp.export.onnx_export import export_package
        export_package(str(src), tmp_path / "tight", dtype="int4", progress=False)
    line = str(e.value)
    assert "products keep the GGUF's own 4-bit blocks" in line and "--requantize all" in line
    assert "exact (checked with float activations)" in line
    assert not (tmp_path / "tight").exists()


@pytest.mark.slow  # two exports and six generations: ~25 s (the default run stays ~6 min)
def test_a_wide_lm_head_stays_at_8_bits_in_an_int4_export(tmp_path):
    """llama-quantize stores a 4-bit model's LM head wider (Q6_K; F16 here, which gguf-py
    writes): the int4 export puts it in 8-bit Q8_0 blocks rather than 4-bit ones (on SmolLM2
    with an F16 head: bench/results/gguf_fidelity_wide_head_2026-11-29.md), says so in the
    export line and in inspect, and speculation stays lossless on both backends;
    --requantize head gives the 4-bit head."""
    from gguf_writer import write_llama_gguf

    src = tmp_path / "stories260K-Q4_0-f16head.gguf"
    write_llama_gguf(ROOT / ".." / "shared" / "models" / "stories260K", src, "Q4_0", "F16")
    pkg = tmp_path / "pkg"
    r = cli("export", str(src), "-o", str(pkg), "--dtype", "int4", "--quiet")
    assert r.returncode == 0, r.stderr
    assert "(the LM head at 8 bits: the file stores it as F16)" in r.stdout + r.stderr
    assert "the LM head at 8 bits (the file's F16)" in cli("inspect", str(pkg)).stdout
    assert load_package(pkg).weights.head8_from == "F16"
    for backend in ("native", "onnxruntime"):
        ids = {d: json.loads(cli("generate", "--model", str(pkg), "--backend", backend,
                                 "--prompt", "Once upon a time", "--drafter", d,
                                 "--max-new-tokens", "40", "--json").stdout)["token_ids"]
               for d in ("none", "hybrid", "pld")}
        assert len(ids["none"]) == 40 and ids["hybrid"] == ids["none"] == ids["pld"], backend
    four = tmp_path / "four"
    r = cli("export", str(src), "-o", str(four), "--dtype", "int4", "--requantize", "head",
            "--quiet")
    assert r.returncode == 0 and "8 bits" not in r.stdout + r.stderr
    assert load_package(four).weights.head8_from is None


@pytest.mark.slow  # an export and four generations: ~15 s
def test_a_tied_q4_0_head_keeps_the_files_blocks(tmp_path):
    """QA (qa6 gguf, 1): a tied Q4_0 embedding/LM head (llama-quantize --pure) was
    re-quantized like a Q4_1 one, whose offsets the embedding gather cannot add; Q4_0 blocks
    need none, so the head keeps them and the input embedding gathers the file's values."""
    import gguf as gg
    from gguf_writer import write_llama_gguf

    src = tmp_path / "stories260K-Q4_0.gguf"
    write_llama_gguf(ROOT / ".." / "shared" / "models" / "stories260K", src, "Q4_0")
    pkg = tmp_path / "pkg"
    r = cli("export", str(src), "-o", str(pkg), "--dtype", "int4", "--quiet")
    assert r.returncode == 0 and "16 of 21 products keep" in r.stdout + r.stderr, r.stderr
    p = load_package(pkg)
    table = p.embedding_table().rows(np.arange(p.meta.vocab_size, dtype=np.int64))
    t = next(t for t in gg.GGUFReader(str(src)).tensors if t.name == "token_embd.weight")
    assert np.array_equal(table, gg.quants.dequantize(t.data, t.tensor_type))
    for backend in ("native", "onnxruntime"):
        ids = [json.loads(cli("generate", "--model", str(pkg), "--backend", backend,
                              "--prompt", "Once upon a time", "--drafter", d,
                              "--max-new-tokens", "40", "--json").stdout)["token_ids"]
               for d in ("none", "hybrid")]
        assert len(ids[0]) == 40 and ids[0] == ids[1], backend


def test_an_unknown_tensor_type_is_said_as_such_not_as_damage(tmp_path):
    """QA (qa5, 2): a tensor type the gguf package does not know (a newer llama.cpp's, or
    a removed one) read as "damaged or not GGUF ...; restore it"."""
    import struct

    path = tmp_path / "newer.gguf"
    _tiny_gguf(path, "llama")
    data = bytearray(path.read_bytes())
    name = b"token_embd.weight"
    at = data.index(name) + len(name)
    n_dims = struct.unpack_from("<I", data, at)[0]
    struct.pack_into("<I", data, at + 4 + 8 * n_dims, 99)  # the tensor's type id
    path.write_bytes(bytes(data))
    line = error_line(cli("export", str(path), "-o", str(tmp_path / "out")),
                      "stores tensors in type 99", "does not know", "pip install -U gguf")
    assert "damaged" not in line and not (tmp_path / "out").exists()
