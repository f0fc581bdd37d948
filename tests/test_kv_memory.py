"""``Model.kv_cache_bytes`` is what a session really allocates, on every CPU backend, and
``edgemtp serve`` states --parallel such caches at start, warning (with what fits) where they
exceed the host's available memory."""

from __future__ import annotations

import re

import pytest

from edgemtp import Model
from edgemtp.serve.launch import memory_lines

from conftest import STORIES


def _ort_bytes(session) -> int:
    kv = session.kv
    return kv.k.nbytes + kv.v.nbytes


def test_onnxruntime_cache_bytes_are_the_sessions_arrays(stories_pkg):
    m = Model.load(str(stories_pkg), backend="onnxruntime", threads=1)
    s = m.backend.session()
    assert m.kv_cache_bytes() == _ort_bytes(s) > 0
    short = Model.load(str(stories_pkg), backend="onnxruntime", threads=1, max_context=64)
    assert short.kv_cache_bytes() == _ort_bytes(short.backend.session())
    assert short.kv_cache_bytes() * 4 == m.kv_cache_bytes()  # 64 of the package's 256 rows


def test_torch_cache_bytes_are_the_sessions_tensors():
    pytest.importorskip("torch")
    m = Model.load(str(STORIES), backend="torch", threads=1, max_context=128)
    s = m.backend.session()
    tensors = [getattr(s, n) for n in ("k_cache", "v_cache") if hasattr(s, n)]
    got = sum(t.numel() * t.element_size() for t in tensors) if tensors else None
    if got is None:  # a session that concatenates: its cache is [2, L, H_kv, rows, D]
        got = s.kv.numel() * s.kv.element_size()
    assert m.kv_cache_bytes() == got > 0


def test_native_cache_bytes_are_the_sessions_arrays(tmp_path_factory):
    from edgemtp import native
    from edgemtp.export.onnx_export import export_package

    if native.decoder_lib() is None:
        pytest.skip(f"no native decoder here: {native.decoder_why_not()}")
    out = tmp_path_factory.mktemp("kvmem") / "stories-int4"
    export_package(str(STORIES), out, dtype="int4", max_context=256, progress=False)
    for kv in ("fp16", "int8"):
        m = Model.load(str(out), backend="native", threads=1, kv_cache=kv)
        s = m.backend.session()
        arrays = [a for a in (s.k, s.v, s.ks, s.vs) if a is not None]
        assert m.kv_cache_bytes() == sum(a.nbytes for a in arrays)
        avail = 2 * m.kv_cache_bytes()
        lines = memory_lines(m, 3, "cpu", available=avail)
        assert lines[0].endswith("(one per --parallel generation)")
        assert "--parallel 2" in lines[1]
        # the context suggested really fits: the native cache has a margin and 16-row blocks
        ctx = int(re.search(r"--max-context (\d+)", lines[1]).group(1))
        assert 3 * m.kv_cache_bytes(ctx) <= avail < 3 * m.kv_cache_bytes(ctx + 1)
        # int8 is suggested only where it fits (3 x int8 here: ~1.7 fp16 caches)
        q8 = m.backend.cache_bytes("int8")
        assert ("--kv-cache int8" in lines[1]) == (kv == "fp16" and 3 * q8 <= avail)
        tight = memory_lines(m, 3, "cpu", available=int(1.2 * m.kv_cache_bytes()))
        assert "--kv-cache int8" not in tight[1]


def test_serve_memory_lines(stories_pkg):
    m = Model.load(str(stories_pkg), backend="onnxruntime", threads=1)
    one = m.kv_cache_bytes()
    assert one == 320 * 1024  # 5 layers x 256 rows x 4 KV heads x 8 dims, K and V in fp32
    roomy = memory_lines(m, 4, "cpu", available=100 * one)
    assert roomy == ["edgemtp: KV cache: 4 x 320.0 KiB = 1.2 MiB at 256 tokens (one per "
                     "--parallel generation)"]
    assert memory_lines(m, 4, "cpu", available=None) == roomy  # (no /proc/meminfo)
    tight = memory_lines(m, 4, "cpu", available=int(2.5 * one))
    assert len(tight) == 2 and tight[1].startswith("edgemtp: warning: 4 full KV caches")
    # 2 caches fit, or 4 at 2.5 / 4 of the context (onnxruntime's cache: linear in its rows)
    assert "fits: --parallel 2 or --max-context 160 (the caches alone" in tight[1]
    assert "--kv-cache" not in tight[1]  # (the native backend's option)
    # a GPU's cache is on the device: the host's memory says nothing about it
    assert memory_lines(m, 4, "cuda", available=int(2.5 * one)) == roomy
    none_fit = memory_lines(m, 4, "cpu", available=one // 1000)
    assert "fits:" not in none_fit[1]  # not one cache, nor 2 rows of each
