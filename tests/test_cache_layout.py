"""``--cache-layout head``: a package whose past K/V is head-major (``[1, H_kv, P, D]``), read
by onnxruntime's CPU provider as one contiguous block per KV head. Exported, self-checked and
run on the real stories260K; its generations equal transformers greedy for every drafter
(blocks that cross the cache's 64-row buckets, so the cache moves mid-generation); the paths
that cannot bind it say so in one line."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from edgemtp import GenerationConfig
from edgemtp.engine import Generation

from conftest import QUICK, STORIES

pytest.importorskip("onnx")


@pytest.fixture(scope="module")
def head_pkg(tmp_path_factory):
    from edgemtp.export.onnx_export import export_package

    out = tmp_path_factory.mktemp("layout") / "stories-head"
    export_package(str(STORIES), out, max_context=256, progress=False, cache_layout="head")
    return out


def test_the_package_says_its_layout_and_the_graph_takes_it(head_pkg):
    import onnx

    from edgemtp.runtimes.package import HEAD_MAJOR, load_package

    pkg = load_package(head_pkg)
    assert pkg.meta.cache.layout == HEAD_MAJOR and pkg.meta.cache.head_major
    graph = onnx.load(str(head_pkg / "model.onnx"), load_external_data=False).graph
    past = next(i for i in graph.input if i.name == "past_key_0")
    dims = [d.dim_value or d.dim_param for d in past.type.tensor_type.shape.dim]
    assert dims == [1, pkg.meta.num_kv_heads, "P", pkg.meta.head_dim]
    r = subprocess.run([sys.executable, "-m", "edgemtp.cli", "inspect", str(head_pkg)],
                       capture_output=True, text=True)
    assert r.returncode == 0 and "head-major" in r.stdout
    assert "cuda      not for CUDA: the cache is head-major" in r.stdout


@pytest.mark.parametrize("drafter,bc", [("none", 10), ("probe", 10), ("probe", 60),
                                        ("pld", 10), ("hybrid", 30), ("stand", 60),
                                        ("auto", 60)])
def test_head_major_generations_equal_transformers_greedy(head_pkg, stories_refs, drafter, bc):
    from edgemtp.runtimes.onnxrt_backend import HostKVHeads, OrtBackend

    hf, prompts, refs = stories_refs
    backend = OrtBackend(head_pkg, threads=1)
    session = backend.session()
    assert isinstance(session.kv, HostKVHeads)
    config = GenerationConfig(drafter=drafter, bc=bc, max_new_tokens=128)
    for i, (ids, ref) in enumerate(zip(prompts[:QUICK], refs)):
        r = Generation(backend, config, ids, session=session).run()
        assert r.token_ids == ref, f"{drafter} BC {bc}: prompt {i} differs"
    # 128 new tokens after the prompt: the cache crossed at least one 64-row bucket
    assert session.kv.moves >= 3 and session.kv.width >= 128


def test_the_cache_moves_keep_every_row(head_pkg):
    """A commit past the bound width widens the cache with the rows in use intact, and a
    binding made before a move is redone (the cache counts its moves)."""
    from edgemtp.runtimes.onnxrt_backend import HostKVHeads

    kv = HostKVHeads(2, 256, 4, 8, np.float32)
    kv.new_k = np.arange(2 * 70 * 4 * 8, dtype=np.float32).reshape(2, 70, 4, 8)
    kv.new_v = -kv.new_k
    moves = kv.moves
    kv.commit(np.arange(62), 0)
    assert kv.width == 64 and kv.moves == moves
    kv.commit(np.array([65, 61, 69]), 62)   # rows 62..64: past the first 64-row bucket
    assert kv.width == 128 and kv.moves == moves + 1
    want = np.concatenate([kv.new_k[:, :62], kv.new_k[:, [65, 61, 69]]], axis=1)
    np.testing.assert_array_equal(kv.k[:, :, :65], want.transpose(0, 2, 1, 3))
    np.testing.assert_array_equal(kv.v[:, :, :65], -want.transpose(0, 2, 1, 3))
    assert not kv.k[:, :, 65:].any()  # zeroed past P: masked rows are never NaN


def test_what_cannot_bind_a_head_major_cache_says_so(head_pkg, tmp_path):
    from edgemtp.errors import ConfigError
    from edgemtp.export.onnx_export import ExportOptions
    from edgemtp.runtimes.onnxrt_backend import OrtBackend
    from edgemtp.runtimes.package import load_package
    from edgemtp.runtimes.trt_engine import check_trt_cache

    with pytest.raises(ConfigError, match="head-major.*CPU provider with a host cache"):
        OrtBackend(head_pkg, device_cache=True)
    with pytest.raises(ConfigError, match="head-major.*CPU provider"):
        OrtBackend(head_pkg, static_past=True)
    r = subprocess.run([sys.executable, "-m", "edgemtp.cli", "generate", "--model",
                        str(head_pkg), "--device", "cuda", "--prompt", "Once"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "keeps its cache head-major" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    with pytest.raises(ConfigError, match="head-major.*without --cache-layout head for "
                                          "TensorRT"):
        check_trt_cache(load_package(head_pkg), "build-engine")
    with pytest.raises(ConfigError, match="--cache-layout head is for fp32/fp16"):
        ExportOptions("int4", cache_layout="head")
    with pytest.raises(ConfigError, match="cache layout must be one of seq, head"):
        ExportOptions("fp32", cache_layout="rows")
    r = subprocess.run([sys.executable, "-m", "edgemtp.cli", "export", str(STORIES), "-o",
                        str(tmp_path / "x"), "--dtype", "int4", "--cache-layout", "head"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "--cache-layout head is for fp32/fp16" in r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "x").exists()
    # a manifest that claims a head-major cache with exact sums is refused at load
    bad = tmp_path / "bad"
    subprocess.run(["cp", "-r", str(head_pkg), str(bad)], check=True)
    raw = json.loads((bad / "edgemtp.json").read_text())
    raw["cache"]["value_dtype"] = "fp64"
    (bad / "edgemtp.json").write_text(json.dumps(raw))
    with pytest.raises(Exception, match="head-major cache is for packages without exact"):
        load_package(bad)
