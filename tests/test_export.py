"""``edgemtp export`` / ``edgemtp inspect`` and package validation, through the real CLI.

One stories260K package is exported per module; every bad-package case works on its own
copy, runs ``python -m edgemtp.cli`` in a subprocess and checks: non-zero exit, one clear
line on stderr, no traceback, and not one byte of the package changed.
"""

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")

from edgemtp.cli import main  # noqa: E402
from edgemtp.errors import ModelLoadError  # noqa: E402
from edgemtp.export.onnx_export import ExportError, export_package  # noqa: E402
from edgemtp.export.selfcheck import SelfCheckError  # noqa: E402
from edgemtp.plans import dynamic_plans, static_plan  # noqa: E402
from edgemtp.runtimes.package import load_package, plan_arrays  # noqa: E402

SHARED = Path(__file__).resolve().parents[1] / ".." / "shared"
STORIES = SHARED / "models" / "stories260K"
ROOT = Path(__file__).resolve().parents[1]


def cli(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "edgemtp.cli", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def snapshot(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def assert_one_line_error(proc: subprocess.CompletedProcess, *words: str) -> str:
    assert proc.returncode != 0, proc.stdout
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("edgemtp: error: "), lines[0]
    for w in words:
        assert w in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def pkg(tmp_path_factory) -> Path:
    """stories260K exported through the CLI, as a user would."""
    assert STORIES.is_dir(), f"missing shared model {STORIES}"
    out = tmp_path_factory.mktemp("export") / "stories"
    proc = cli("export", str(STORIES), "-o", str(out), "--max-context", "128", "--quiet")
    assert proc.returncode == 0, proc.stderr
    assert "exported llama (fp32)" in proc.stdout
    return out


@pytest.fixture
def copy(pkg, tmp_path) -> Path:
    dst = tmp_path / "pkg"
    shutil.copytree(pkg, dst)
    return dst


# -- what export writes ---------------------------------------------------------------------------


def test_package_layout_and_manifest(pkg):
    names = {p.name for p in pkg.iterdir()}
    assert {"edgemtp.json", "model.onnx", "kv_commit.onnx", "embeddings.npy", "plans",
            "tokenizer.json"} <= names
    assert not list(pkg.parent.glob(".stories.*")), "temporary export folders left behind"
    m = json.loads((pkg / "edgemtp.json").read_text())
    assert m["format_version"] == 1 and m["family"] == "llama" and m["dtype"] == "fp32"
    assert (m["hidden_size"], m["num_layers"], m["num_heads"], m["num_kv_heads"],
            m["head_dim"], m["vocab_size"]) == (64, 5, 8, 4, 8, 512)
    assert m["eos_token_ids"] == [2] and m["max_context"] == 128
    assert m["cache"]["layout"] == "[1, P, H_kv, D] per layer, sequence-major"
    assert m["graph"]["inputs"][:6] == ["input_ids", "position_ids", "tree_mask", "mask_embeds",
                                        "past_key_0", "past_value_0"]
    assert m["graph"]["outputs"][:5] == ["topk_ids", "topk_logprobs", "argmax", "logits",
                                         "present_key_0"]
    assert m["graph"]["external_data"] is None
    assert m["topk"] == 31  # widest plan: BC 60, k 1 -> N = 30, plus one
    assert [(p["bc"], p["k"]) for p in m["plans"]] == [(10, 1), (10, 2), (30, 1), (30, 2),
                                                       (60, 1), (60, 2)]
    table = np.load(pkg / "embeddings.npy")
    assert table.shape == (512, 64) and table.dtype == np.float32
    np.testing.assert_allclose(m["embeddings"]["mu"], table.mean(0), atol=1e-6)
    np.testing.assert_allclose(m["embeddings"]["sigma"], table.std(0, ddof=1), rtol=1e-5)
    check = m["self_check"]
    assert check["token_rows_max_logit_diff"] <= 1e-4 * check["logit_scale"]
    assert check["mask_rows_max_logit_diff"] <= 1e-4 * check["logit_scale"]


@pytest.mark.parametrize("bc,k", [(10, 1), (30, 2), (60, 2)])
def test_plan_files_hold_every_static_and_dynamic_plan(pkg, bc, k):
    with np.load(pkg / f"plans/bc{bc}_k{k}.npz") as f:
        arrays = {key: f[key] for key in f.files}
    static, table = static_plan(bc, k), dynamic_plans(bc, k).table
    np.testing.assert_array_equal(arrays["static_mask"], static.tree_mask)
    np.testing.assert_array_equal(arrays["static_positions"], static.positions)
    assert [tuple(s) for s in arrays["dynamic_shapes"]] == list(table)
    for i, shape in enumerate(table):
        np.testing.assert_array_equal(arrays["dynamic_masks"][i], table[shape].tree_mask)
        np.testing.assert_array_equal(arrays["dynamic_parents"][i], table[shape].parents)
    assert arrays["dynamic_masks"].shape[1:] == (static.bc, static.bc)


def test_graph_contract(pkg):
    model = onnx.load(str(pkg / "model.onnx"))
    dims = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim]
            for i in [*model.graph.input, *model.graph.output]}
    assert dims["input_ids"] == [1, "T"] and dims["tree_mask"] == [1, 1, "T", "T"]
    assert dims["mask_embeds"] == ["k", 64]
    assert dims["past_key_0"] == [1, "P", 4, 8] and dims["present_value_4"] == [1, "T", 4, 8]
    assert dims["topk_ids"] == [1, "T", 31] and dims["argmax"] == [1, "T"]
    # argmax must break ties on the first index, as torch.argmax and np.argmax do
    (argmax,) = [n for n in model.graph.node if n.op_type == "ArgMax"]
    attrs = {a.name: a.i for a in argmax.attribute}
    assert attrs.get("select_last_index", 0) == 0
    # grouped-query attention reads the cache without copying it per query head (a
    # repeat_interleave of K and V would tile twice per layer; the one Tile is the mask's)
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("Tile") + ops.count("Expand") < 2 * 5 and "IsNaN" not in ops


def test_inspect_prints_manifest_plans_and_memory(pkg, capsys):
    assert main(["inspect", str(pkg)]) == 0
    out = capsys.readouterr().out
    assert "llama" in out and "5 layers" in out and "max context 128" in out
    assert "60   2   60   20  [15, 4]" in out            # bc, k, T, N, static counts
    kv32 = 2 * 5 * 128 * 4 * 8 * 4                       # 2 * L * ctx * H_kv * D * bytes
    assert f"{kv32 / 1024:.1f} KiB" in out and f"{kv32 / 2 / 1024:.1f} KiB" in out
    assert "weights 1.2 MiB" in out


def test_generate_from_package_matches_torch_backend_json(pkg):
    args = ["generate", "--prompt", "Once upon a time", "--bc", "30", "--json",
            "--max-new-tokens", "48"]
    ours, ref = cli(*args, "--model", str(pkg)), cli(*args, "--model", str(STORIES))
    assert ours.returncode == 0 and ref.returncode == 0, ours.stderr + ref.stderr
    a, b = json.loads(ours.stdout), json.loads(ref.stdout)
    assert a["token_ids"] == b["token_ids"] and a["text"] == b["text"]
    assert set(a) == set(b)


# -- failures: one line, non-zero exit, nothing overwritten ------------------------------------


def _break_missing_graph(p: Path) -> None:
    (p / "model.onnx").unlink()


def _break_manifest(p: Path) -> None:
    (p / "edgemtp.json").write_text('{"format_version": 1, "family": "lla')


def _break_version(p: Path) -> None:
    m = json.loads((p / "edgemtp.json").read_text())
    m["format_version"] = 99
    (p / "edgemtp.json").write_text(json.dumps(m))


def _break_plan(p: Path) -> None:
    np.savez(p / "plans/bc30_k1.npz", **plan_arrays(10, 1))  # T = 10, manifest says 30


def _break_graph_io(p: Path) -> None:
    # a valid graph whose input names are not the manifest's (a mixed-up package)
    model = onnx.load(str(p / "model.onnx"))
    for i in model.graph.input:
        if i.name == "past_key_4":
            i.name = "past_k_4"
    for node in model.graph.node:
        node.input[:] = ["past_k_4" if n == "past_key_4" else n for n in node.input]
    onnx.save(model, str(p / "model.onnx"))


BROKEN = [
    ("missing-graph", _break_missing_graph, ("model.onnx",)),
    ("corrupt-manifest", _break_manifest, ("manifest", "corrupt")),
    ("newer-format", _break_version, ("format version 99", "reads format version 1")),
    ("plan-mismatch", _break_plan, ("bc=30 k=1", "T=10", "T=30")),
    ("graph-mismatch", _break_graph_io, ("does not match the manifest",)),
]


@pytest.mark.parametrize("name,breaker,words", BROKEN, ids=[b[0] for b in BROKEN])
def test_bad_package_fails_in_one_line_and_changes_nothing(copy, name, breaker, words):
    breaker(copy)
    before = snapshot(copy)
    proc = cli("generate", "--model", str(copy), "--prompt", "Once upon a time",
               "--max-new-tokens", "8")
    assert_one_line_error(proc, *words)
    assert snapshot(copy) == before


def test_prompt_longer_than_max_context(copy):
    before = snapshot(copy)
    proc = cli("generate", "--model", str(copy), "--prompt", "Once upon a time " * 60)
    assert_one_line_error(proc, "max context is 128")
    assert snapshot(copy) == before


def test_export_into_existing_folder_needs_force(copy):
    before = snapshot(copy)
    proc = cli("export", str(STORIES), "-o", str(copy), "--quiet")
    assert_one_line_error(proc, "exists", "--force")
    assert snapshot(copy) == before


def test_unsupported_architecture_names_supported_families(tmp_path):
    transformers = pytest.importorskip("transformers")
    bert = tmp_path / "bert"
    transformers.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                            intermediate_size=64, vocab_size=100).save_pretrained(bert)
    proc = cli("export", str(bert), "-o", str(tmp_path / "out"), "--quiet")
    assert_one_line_error(proc, "'bert'", "llama", "mistral", "qwen2", "qwen3")
    assert not (tmp_path / "out").exists()


def test_failed_export_leaves_no_folder_and_force_keeps_the_old_one(copy, tmp_path):
    out = tmp_path / "never"
    with pytest.raises(SelfCheckError, match="largest logit difference"):
        export_package(str(STORIES), out, bc=(10,), mask_tokens=(1,), tolerance=(1e-12, 1e-12),
                       progress=False)
    assert not out.exists() and not list(tmp_path.glob(".never.*"))
    before = snapshot(copy)
    with pytest.raises(SelfCheckError):
        export_package(str(STORIES), copy, bc=(10,), mask_tokens=(1,), force=True,
                       tolerance=(1e-12, 1e-12), progress=False)
    assert snapshot(copy) == before


def test_force_replaces_a_package_whole(copy):
    (copy / "stale.txt").write_text("from an older export")
    report = export_package(str(STORIES), copy, bc=(10,), mask_tokens=(1,), force=True,
                            progress=False)
    assert not (copy / "stale.txt").exists()
    pkg = load_package(copy)
    assert [(p["bc"], p["k"]) for p in pkg.manifest["plans"]] == [(10, 1)]
    assert pkg.manifest["topk"] == 6 and report.check.worst < 1e-3


def test_export_refuses_to_overwrite_its_source(tmp_path):
    src = tmp_path / "model"
    shutil.copytree(STORIES, src)
    with pytest.raises(ExportError, match="holds the model being exported"):
        export_package(str(src), src, force=True, progress=False)
    assert (src / "model.safetensors").is_file()


def test_package_loader_reports_missing_folder(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_package(tmp_path / "nowhere")
    with pytest.raises(ModelLoadError, match="no edgemtp.json"):
        load_package(tmp_path)


def test_external_data_package_runs(tmp_path, monkeypatch):
    # large models keep their weights in model.onnx.data; force it on a tiny random model
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from edgemtp import GenerationConfig
    from edgemtp.engine import Generation
    from edgemtp.export import onnx_export
    from edgemtp.runtimes.onnxrt_backend import OrtBackend
    from edgemtp.runtimes.torch_backend import TorchBackend

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=200, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=128,
                                      initializer_range=0.3)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "hf")
    monkeypatch.setattr(onnx_export, "EXTERNAL_DATA_BYTES", 0)
    out = tmp_path / "pkg"
    export_package(str(tmp_path / "hf"), out, bc=(10,), mask_tokens=(1,), progress=False)
    manifest = json.loads((out / "edgemtp.json").read_text())
    assert manifest["graph"]["external_data"] == "model.onnx.data"
    assert (out / "model.onnx.data").stat().st_size > (out / "model.onnx").stat().st_size
    gen = GenerationConfig(max_new_tokens=24, bc=10)
    ids = [5, 17, 33, 90]
    want = Generation(TorchBackend(str(tmp_path / "hf")), gen, ids).run().token_ids
    assert Generation(OrtBackend(out), gen, ids).run().token_ids == want
    (out / "model.onnx.data").unlink()
    with pytest.raises(ModelLoadError, match="missing the external weights model.onnx.data"):
        OrtBackend(out)


def test_length_dependent_rope_is_refused_before_loading_weights(tmp_path):
    transformers = pytest.importorskip("transformers")
    from edgemtp.errors import UnsupportedModelError

    transformers.LlamaConfig(rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                              "rope_theta": 10000.0}).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match="rope type 'dynamic'"):
        export_package(str(tmp_path), tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
