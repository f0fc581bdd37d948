"""Every bad input to ``edgemtp export`` and every broken package, through the real CLI.

Each case runs ``python -m edgemtp.cli`` in a subprocess and checks: exit code 2, exactly one
line on stderr starting ``edgemtp: error:`` that names the problem, no traceback, and nothing
left behind or changed (no output folder, no partial folder, not one byte of a package).
A broken package is run through ``inspect`` and ``generate`` side by side: both must fail with
the same line (``inspect`` fails exactly where ``generate`` would).

One stories260K package is exported per session (``test_export.pkg``); every package case
breaks its own copy. The cases are independent and a CLI subprocess spends most of its time
importing, so each table runs its commands a few at a time (a module fixture) and each case
then checks its result.
"""

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")

from edgemtp.export.onnx_export import export_package  # noqa: E402
from edgemtp.runtimes.package import Manifest, load_package, plan_arrays, record_files  # noqa: E402
from test_export import ROOT, STORIES, cli, pkg, snapshot  # noqa: E402, F401 (pkg: a fixture)


def run_all(commands: dict) -> dict:
    """``{key: CLI arguments}`` -> ``{key: finished process}``, four subprocesses at a time."""
    with ThreadPoolExecutor(max_workers=4) as pool:
        futures = {key: pool.submit(cli, *args) for key, args in commands.items()}
        return {key: f.result() for key, f in futures.items()}


def error_line(proc: subprocess.CompletedProcess, *words: str) -> str:
    """The one ``edgemtp: error:`` line of a finished command (exit code 2) holding ``words``."""
    err = proc.stderr
    assert "Traceback" not in err, err
    assert proc.returncode == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("edgemtp: error: "), lines[0]
    for w in words:
        assert w in lines[0], lines[0]
    return lines[0]


# -- export: bad options, places and models ---------------------------------------------------


def _weightless(tmp: Path) -> Path:
    """stories260K without its weights: an export that loaded (or tried to load) the model
    before rejecting the input would fail on that instead, with another message."""
    model = tmp / "weightless"
    shutil.copytree(STORIES, model, ignore=shutil.ignore_patterns("*.safetensors"))
    return model


def _truncated_model(tmp: Path) -> Path:
    model = tmp / "truncated"
    shutil.copytree(STORIES, model)
    weights = model / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)
    return model


def _nan_weights(tmp: Path) -> Path:
    """stories260K with 5 NaNs in one weight (qa8b D5: a GGUF's damaged block scales)."""
    from safetensors.numpy import load_file, save_file

    model = tmp / "nan"
    shutil.copytree(STORIES, model)
    weights = load_file(STORIES / "model.safetensors")
    name = next(n for n in sorted(weights) if "layers.2.mlp.down_proj" in n)
    w = weights[name].copy()
    w.reshape(-1)[:5] = np.nan
    save_file({**weights, name: w}, model / "model.safetensors", metadata={"format": "pt"})
    return model


def _config_only(tmp: Path, config: dict | None) -> Path:
    model = tmp / "config_only"
    model.mkdir()
    shutil.copy(STORIES / "model.safetensors", model)
    if config is not None:
        (model / "config.json").write_text(json.dumps(config))
    return model


BERT = {"model_type": "bert", "architectures": ["BertModel"], "hidden_size": 32}

# (id, model (a function of the case's folder; None: stories260K without weights), -o (in the
# case's folder, or absolute), extra args, words the error line must hold)
EXPORT_CASES = [
    ("out-under-proc", None, "/proc/edgemtp-no/out", [], ("cannot write", "'/proc/edgemtp-no'")),
    ("out-under-a-file", None, "a_file/out", [], ("a_file' is a file, not a folder",)),
    ("out-is-a-file", None, "a_file", [], ("is a file, not a folder",)),
    ("out-is-empty", None, "", [], ("must name a package folder",)),
    # (qa8b D4: torch's ONNX writer raised a TypeError traceback, exit 1)
    ("out-not-utf8", None, "x\udcffdir", [], ("is not valid UTF-8", "choose a UTF-8 folder")),
    ("workspace-without-trt", None, "out", ["--workspace", "4"],
     ("--workspace", "only with --trt")),
    ("max-block-without-trt", None, "out", ["--max-block", "64"],
     ("--max-block", "only with --trt")),
    ("out-exists", None, "existing", [], ("exists", "--force")),
    ("force-on-non-package", None, "existing", ["--force"], ("not an edgemtp package",)),
    ("truncated-safetensors", _truncated_model, "out", [],
     ("model.safetensors", "damaged", "a header for")),
    ("no-config", lambda t: _config_only(t, None), "out", [], ("has no config.json",)),
    ("nan-weights", _nan_weights, "out", ["--quiet"],
     ("is damaged: its weight model.layers.2.mlp.down_proj.weight holds 5 NaN or infinite "
      "values",)),
    ("unsupported-family", lambda t: _config_only(t, BERT), "out", [],
     ("'bert'", "llama", "mistral", "qwen2", "qwen3")),
    ("missing-model", lambda t: t / "nowhere", "out", [], ("does not exist",)),
    ("opset-5", None, "out", ["--opset", "5"], ("opset", "from 13 to 23", "got 5")),
    ("opset-12", None, "out", ["--opset", "12"], ("from 13 to 23", "got 12")),
    ("opset-24", None, "out", ["--opset", "24"], ("from 13 to 23", "got 24")),
    ("max-context-0", None, "out", ["--max-context", "0"], ("max context", ">= 2", "got 0")),
    ("max-context-1", None, "out", ["--max-context", "1"], ("max context", "got 1")),
    ("max-context-negative", None, "out", ["--max-context", "-4"], ("got -4",)),
    ("max-context-below-every-plan", None, "out", ["--max-context", "8"],
     ("no requested budget", "context of 8 tokens")),
    ("bc-0", None, "out", ["--bc", "0"], ("block complexity", ">= 1", "got 0")),
    ("bc-1", None, "out", ["--bc", "1"], ("no requested budget makes a plan", "bc=1 k=1")),
    ("bc-100000", None, "out", ["--bc", "100000"], ("100000", "1024")),
    ("mask-tokens-0", None, "out", ["--mask-tokens", "0"], ("mask tokens", ">= 1", "got 0")),
    ("mask-tokens-too-many", None, "out", ["--bc", "30", "--mask-tokens", "20"],
     ("no requested budget", "k=20")),
    ("dynamic-table-too-large", None, "out", ["--bc", "1000", "--mask-tokens", "3"],
     ("shapes to precompile", "4096")),
    ("dtype-bf16", None, "out", ["--dtype", "bf16"], ("bf16",)),
    ("requantize-bogus", None, "out", ["--dtype", "int4", "--requantize", "some"],
     ("--requantize", "'some'", "none", "head", "all")),
    # (accepted and ignored on a Hugging Face folder until the QA pass; an int4 export from
    # one now takes it too: its 8-bit head goes to 4 bits)
    ("requantize-not-int4", None, "out", ["--dtype", "fp16", "--requantize", "head"],
     ("--requantize head", "an int4 export puts into new 4-bit blocks", "an fp16 export",
      "drop --requantize")),
]
KNOWN_GAPS: dict[str, str] = {}  # case id -> why it still fails (strict xfail)


def _expect(name: str, words: tuple[str, ...]):
    gap = KNOWN_GAPS.get(name)
    marks = [pytest.mark.xfail(strict=True, reason=gap)] if gap else []
    return pytest.param(name, words, marks=marks, id=name)


@pytest.fixture(scope="module")
def export_runs(tmp_path_factory) -> dict:
    """Every export case run in its own folder: {id: (process, folder, files, names)}."""
    commands, folders = {}, {}
    for name, model, out, args, _ in EXPORT_CASES:
        base = tmp_path_factory.mktemp(name)
        (base / "a_file").write_text("not a folder")
        (base / "existing").mkdir()
        (base / "existing" / "notes.txt").write_text("the user's")
        src = (model or _weightless)(base)
        target = out if out.startswith("/") or not out else str(base / out)
        commands[name] = ("export", str(src), "-o", target, *args)
        folders[name] = (base, snapshot(base), sorted(p.name for p in base.iterdir()))
    done = run_all(commands)
    return {name: (done[name], *folders[name]) for name in commands}


@pytest.mark.parametrize("name,words", [_expect(c[0], c[4]) for c in EXPORT_CASES])
def test_bad_export_fails_in_one_line_and_leaves_nothing(export_runs, name, words):
    proc, base, files, names = export_runs[name]
    error_line(proc, *words)
    assert snapshot(base) == files  # nothing written, nothing replaced
    assert sorted(p.name for p in base.iterdir()) == names  # no output, no partial folder


# -- killed exports ---------------------------------------------------------------------------


def test_a_terminated_export_removes_its_partial_folder(tmp_path):
    # SIGTERM (a service manager, `timeout`, `kill`) unwinds as a Ctrl-C does (QA qa7 D9)
    proc = subprocess.Popen([sys.executable, "-m", "edgemtp.cli", "export", str(STORIES), "-o",
                             str(tmp_path / "pkg"), "--quiet"], cwd=ROOT,
                            stderr=subprocess.PIPE, text=True)
    partial = tmp_path / f".pkg.partial-{proc.pid}"
    deadline = time.monotonic() + 60
    while not partial.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == "edgemtp: terminated"
    assert list(tmp_path.iterdir()) == []  # no package, no partial folder


def test_killed_export_is_cleaned_up_by_the_next_one_never_a_live_one(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "edgemtp.cli", "export", str(STORIES), "-o",
                             str(tmp_path / "pkg"), "--quiet"], cwd=ROOT)
    partial = tmp_path / f".pkg.partial-{proc.pid}"
    deadline = time.monotonic() + 60
    while not partial.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    assert partial.is_dir() and not (tmp_path / "pkg").exists()  # killed: left, never whole
    live = tmp_path / f".other.partial-{os.getpid()}"   # this process runs: a live export
    live.mkdir()
    (tmp_path / "gone").mkdir()                        # replaced by an export killed mid-swap
    (tmp_path / "gone" / "edgemtp.json").write_text("{}")
    (tmp_path / "gone").rename(tmp_path / f".gone.old-{proc.pid}")
    export_package(str(STORIES), tmp_path / "pkg", bc=(10,), mask_tokens=(1,), progress=False)
    assert not partial.exists() and live.is_dir()
    assert (tmp_path / "gone" / "edgemtp.json").is_file(), "the replaced package is put back"
    assert sorted(p.name for p in tmp_path.iterdir()) == [live.name, "gone", "pkg"]
    load_package(tmp_path / "pkg")


def test_a_partial_folder_untouched_for_a_day_is_stale_even_if_its_pid_runs(tmp_path):
    from edgemtp.export.folders import STALE_AFTER_S, tidy

    old, fresh = (tmp_path / f".{n}.partial-{os.getppid()}" for n in ("old", "fresh"))
    for folder in (old, fresh):
        folder.mkdir()
    os.utime(old, (time.time() - STALE_AFTER_S - 60,) * 2)  # a reused PID, another machine
    tidy(tmp_path)
    assert not old.exists() and fresh.is_dir()


# -- packages: every file a generation loads ------------------------------------------------


def manifest(p: Path) -> dict:
    return json.loads((p / "edgemtp.json").read_text())


def edit(p: Path, change) -> None:
    """Rewrite the manifest after ``change(manifest_dict)``."""
    m = manifest(p)
    change(m)
    (p / "edgemtp.json").write_text(json.dumps(m))


def drop_records(p: Path) -> None:
    """An older package: no file sizes, no tokenizer file list. Every format 2 export records
    its files (a format 2 manifest without them is refused: 'no-files-record'), so it is a
    format 1 manifest (no past_len input; the graph keeps its own, which only a session
    would see)."""
    def older(m: dict) -> None:
        m.pop("files"), m.pop("tokenizer_files")
        m["format_version"] = 1
        m["graph"]["inputs"].remove("past_len")
    edit(p, older)


def externalize(p: Path) -> None:
    """The package as a large model's: weights in model.onnx.data, recorded in the manifest."""
    graph = onnx.load(str(p / "model.onnx"))
    onnx.save_model(graph, str(p / "model.onnx"), save_as_external_data=True,
                    all_tensors_to_one_file=True, location="model.onnx.data", size_threshold=1024)
    meta = Manifest.from_dict(manifest(p))
    meta = dataclasses.replace(meta, graph=dataclasses.replace(
        meta.graph, external_data="model.onnx.data"), files=record_files(p))
    (p / "edgemtp.json").write_text(json.dumps(meta.to_dict()))


def cut(name: str, keep: float = 0.5):
    def breaker(p: Path) -> None:
        os.truncate(p / name, int((p / name).stat().st_size * keep))
    return breaker


def flip_last_byte(p: Path) -> None:
    data = bytearray((p / "plans/bc60_k2.npz").read_bytes())
    data[-1] ^= 0xFF
    (p / "plans/bc60_k2.npz").write_bytes(bytes(data))


def rename_graph_input(p: Path) -> None:
    # a valid graph whose input names are not the manifest's (a mixed-up package)
    model = onnx.load(str(p / "model.onnx"))
    for i in model.graph.input:
        if i.name == "past_key_4":
            i.name = "past_k_4"
    for node in model.graph.node:
        node.input[:] = ["past_k_4" if n == "past_key_4" else n for n in node.input]
    onnx.save(model, str(p / "model.onnx"))


def embeddings(array: np.ndarray):
    return lambda p: [drop_records(p), np.save(p / "embeddings.npy", array)]


def remove(*names: str):
    return lambda p: [(p / n).unlink() for n in names]


def set_key(key: str, value):
    return lambda p: edit(p, lambda m: m.__setitem__(key, value))


def both(*breakers):
    return lambda p: [b(p) for b in breakers]


# (id, breaker, words the error line must hold[, commands]); the commands are "inspect" by
# default, and "inspect" and "generate" side by side (BOTH) for one case of each kind of file
BOTH = ("inspect", "generate")
PACKAGE_CASES = [
    ("missing-graph", remove("model.onnx"), ("missing the graph model.onnx",)),
    ("truncated-graph", cut("model.onnx"), ("graph", "model.onnx", "truncated"), BOTH),
    ("replaced-graph", rename_graph_input, ("graph", "model.onnx", "replaced after export")),
    ("truncated-external-weights", both(externalize, cut("model.onnx.data")),
     ("external weights", "model.onnx.data", "truncated"), BOTH),
    ("missing-external-weights", both(externalize, remove("model.onnx.data")),
     ("missing the external weights model.onnx.data",)),
    ("missing-commit-graph", remove("kv_commit.onnx"), ("missing the commit graph",)),
    ("truncated-plan", cut("plans/bc30_k1.npz"), ("plan bc=30 k=1", "truncated")),
    ("truncated-plan-older-package", both(drop_records, cut("plans/bc60_k2.npz", 0.4)),
     ("plan bc=60 k=2", "cannot be read")),
    ("corrupt-plan", flip_last_byte, ("plan bc=60 k=2", "sha256", "corrupt"), BOTH),
    ("plan-of-another-budget", both(drop_records, lambda p: np.savez(
        p / "plans/bc30_k1.npz", **plan_arrays(10, 1))), ("bc=30 k=1", "T=10", "T=30"), BOTH),
    ("missing-plan", remove("plans/bc10_k2.npz"), ("missing the plan bc=10 k=2",)),
    ("missing-embeddings", remove("embeddings.npy"), ("embedding table embeddings.npy",)),
    ("missing-embeddings-older-package", both(drop_records, remove("embeddings.npy")),
     ("missing the embedding table embeddings.npy",)),
    ("truncated-embeddings", cut("embeddings.npy"), ("embedding table", "truncated")),
    ("truncated-embeddings-older-package", both(drop_records, cut("embeddings.npy")),
     ("embeddings.npy", "cannot be read")),
    ("embeddings-wrong-shape", embeddings(np.zeros((512, 32), np.float32)),
     ("[512, 32] float32", "[vocab_size 512, hidden_size 64] float32"), BOTH),
    ("embeddings-wrong-dtype", embeddings(np.zeros((512, 64), np.int32)),
     ("[512, 64] int32", "float32")),
    ("embeddings-without-mu", lambda p: edit(p, lambda m: m["embeddings"].pop("mu")),
     ("'embeddings.mu' is missing",)),
    ("embeddings-sigma-too-short", lambda p: edit(
        p, lambda m: m["embeddings"].__setitem__("sigma", [1.0] * 10)),
     ("'sigma' must have hidden_size = 64 values", "got 64 and 10")),
    ("vocab-size-disagrees", set_key("vocab_size", 600),
     ("vocab_size 600", "holds a [512, 64]"), BOTH),
    ("hidden-size-disagrees", set_key("hidden_size", 32), ("hidden_size = 32", "got 64")),
    ("no-tokenizer-files", remove("tokenizer.json", "tokenizer_config.json"),
     ("has a tokenizer", "tokenizer.json is missing",
      "expected tokenizer.json, tokenizer_config.json"), BOTH),
    ("no-tokenizer-files-older-package", both(drop_records, remove(
        "tokenizer.json", "tokenizer_config.json")), ("has a tokenizer", "one of tokenizer.json")),
    ("format-version-0", set_key("format_version", 0),
     ("format version 0 is not a valid version", "reads format version 2"), BOTH),
    ("format-version-negative", set_key("format_version", -2), ("format version -2",)),
    ("format-version-string", set_key("format_version", "1"),
     ("'format_version' should be an int, got '1'",)),
    ("format-version-float", set_key("format_version", 1.0), ("should be an int, got 1.0",)),
    ("format-version-bool", set_key("format_version", True), ("should be an int, got True",)),
    ("format-version-newer", set_key("format_version", 99),
     ("format version 99", "reads format version 2 or older")),
    ("vocab-size-missing", lambda p: edit(p, lambda m: m.pop("vocab_size")),
     ("'vocab_size' is missing",)),
    ("topk-not-an-int", set_key("topk", "31"), ("'topk' should be an int",)),
    # (qa8b D6: taken by inspect and generate)
    ("eos-outside-the-vocabulary", set_key("eos_token_ids", [99999]),
     ("'eos_token_ids' must lie in [0, vocab_size",)),
    ("bos-outside-the-vocabulary", set_key("bos_token_id", 99999),
     ("'bos_token_id' must lie in [0, vocab_size",)),
    ("family-unknown", set_key("family", "gpt2"),
     ("'family' must be one of llama, mistral, qwen2, qwen3, got 'gpt2'",)),
    ("corrupt-manifest", lambda p: (p / "edgemtp.json").write_text('{"format_version": 1, "fa'),
     ("manifest", "corrupt")),
    # the graph's own names against the manifest's: onnxruntime's session, so generate only
    ("graph-io-mismatch-older-package", both(drop_records, rename_graph_input),
     ("does not match the manifest",), ("generate",)),
    # a current manifest without its file record would check no file's bytes (a corrupted
    # graph then ran and gave garbage)
    ("no-files-record", both(lambda p: edit(p, lambda m: m.pop("files")), cut("model.onnx")),
     ("'files' is missing", "format 2", "re-export"), BOTH),
    # dtype fields edited: generate crashed in onnxruntime ("Unexpected input data type")
    ("dtype-edited", set_key("dtype", "fp16"),
     ("'cache.dtype' 'fp32' differs from 'dtype' 'fp16'",), BOTH),
    ("dtype-and-cache-dtype-edited", lambda p: edit(p, lambda m: [
        m.__setitem__("dtype", "fp16"), m["cache"].__setitem__("dtype", "fp16")]),
     ("model.onnx does not match the manifest", "past_key_0 is float32 in the graph",
      "implies float16"), BOTH),
    ("value-dtype-fp64-on-fp32", lambda p: edit(
        p, lambda m: m["cache"].__setitem__("value_dtype", "fp64")),
     ("past_value_0 is float32 in the graph", "'cache.value_dtype' 'fp64'", "float64"), BOTH),
    ("value-dtype-unknown", lambda p: edit(
        p, lambda m: m["cache"].__setitem__("value_dtype", "fp16")),
     ("'cache.value_dtype' must be absent or 'fp64', got 'fp16'",)),
]


@pytest.fixture(scope="module")
def package_runs(pkg, tmp_path_factory) -> dict:
    """Every package case on its own broken copy: {id: ({command: process}, copy, files)}."""
    commands, copies = {}, {}
    for name, breaker, _, *which in PACKAGE_CASES:
        copy = tmp_path_factory.mktemp(name) / "pkg"
        shutil.copytree(pkg, copy)
        breaker(copy)
        runs = {"inspect": ("inspect", str(copy)),
                "generate": ("generate", "--model", str(copy), "--prompt", "Once upon a time",
                             "--max-new-tokens", "8")}
        commands.update({(name, c): runs[c] for c in (which[0] if which else ("inspect",))})
        copies[name] = (copy, snapshot(copy))
    done = run_all(commands)
    return {name: ({c: p for (n, c), p in done.items() if n == name}, *copies[name])
            for name in copies}


@pytest.mark.parametrize("name,words", [c[:3:2] for c in PACKAGE_CASES],
                         ids=[c[0] for c in PACKAGE_CASES])
def test_bad_package_fails_in_one_line_and_changes_nothing(package_runs, name, words):
    procs, copy, files = package_runs[name]
    lines = {error_line(p, *words) for p in procs.values()}
    assert len(lines) == 1, lines  # inspect fails exactly where generate does
    assert snapshot(copy) == files


def test_prompt_longer_than_max_context(pkg):
    proc = cli("generate", "--model", str(pkg), "--prompt", "Once upon a time " * 60)
    error_line(proc, "max context is 128")


def test_a_file_is_not_a_package_and_a_gguf_gets_the_export_hint(tmp_path):
    # (inspect and doctor said "does not exist" of a file that exists)
    from edgemtp.errors import ModelLoadError
    from edgemtp.runtimes.package import load_package

    for name, hint in (("notes.txt", False), ("model.Q4_1.gguf", True)):
        (tmp_path / name).write_bytes(b"GGUF")
        with pytest.raises(ModelLoadError, match="is a file; expected a package folder") as e:
            load_package(tmp_path / name)
        assert ("export it first: edgemtp export" in str(e.value)) == hint


@pytest.fixture(scope="module")
def int4_copy(tmp_path_factory) -> Path:
    """stories260K as a small int4 package (one plan; the native backend's on the CPU)."""
    out = tmp_path_factory.mktemp("int4") / "stories-int4"
    export_package(str(STORIES), out, dtype="int4", max_context=128, bc=(10,),
                   mask_tokens=(1,), progress=False)
    return out


def test_an_int4_package_whose_value_dtype_is_edited_fails_in_one_line(int4_copy, tmp_path):
    # an exact-sums package keeps its values in float64; with 'cache.value_dtype' null,
    # inspect printed onnxruntime's traceback (the native backend's load check ran the
    # graph) and generate would have fed it float32 values
    copy = tmp_path / "pkg"
    shutil.copytree(int4_copy, copy)
    edit(copy, lambda m: m["cache"].__setitem__("value_dtype", None))
    files = snapshot(copy)
    procs = run_all({"inspect": ("inspect", str(copy)),
                     "generate": ("generate", "--model", str(copy), "--prompt", "Once upon",
                                  "--max-new-tokens", "4"),
                     "doctor": ("doctor", str(copy))})
    lines = {error_line(p, "past_value_0 is float64 in the graph", "implies float32")
             for p in procs.values()}
    assert len(lines) == 1, lines
    assert snapshot(copy) == files
