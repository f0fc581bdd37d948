"""bench/bench_kv_quant.py (a quantized K/V cache's fidelity, simulated): its rounding is the
native int8 cache's, its measures say what they claim, and bad arguments are one line."""

import doctest
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "bench_kv_quant.py"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(ROOT / "bench"))
    import bench_kv_quant

    return bench_kv_quant


def test_doctests(bench):
    result = doctest.testmod(bench, report=False)
    assert result.attempted > 0 and result.failed == 0


def test_eight_bit_rounding_is_the_native_int8_caches(bench):
    """amax / 127 a block, ties to even (lrintf's), clamped: the codes decoder.c's q8_code
    writes, so the simulation's int8 row is the cache's row."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(5, 64)).astype(np.float32)
    x[1, 3] = 0.5 * np.abs(x[1]).max() / 127 * 5  # a tie: 2.5 steps rounds to 2
    got = bench.fake_quant(torch.from_numpy(x), 8, 64).numpy()
    s = np.abs(x).max(-1, keepdims=True) / np.float32(127)
    want = np.clip(np.rint(x / s), -127, 127) * s
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-7)
    assert len(np.unique(np.round(got[0] / s[0]))) > 50  # not a degenerate grid
    zero = bench.fake_quant(torch.zeros(2, 64), 4, 32)
    assert torch.equal(zero, torch.zeros(2, 64))  # a zero block stays zero, no NaN


def test_measures(bench):
    ref = np.array([[1.0, -4.0, 2.0], [0.5, 0.25, 0.0]])
    got = np.array([[1.0, -3.0, 2.0], [0.5, 0.25, 0.5]])
    np.testing.assert_allclose(bench.rel_change(got, ref), [0.25, 1.0])
    assert bench.first_difference([1, 2, 3], [1, 2, 4]) == 2
    assert bench.first_difference([1, 2], [1, 2, 5]) == 2
    assert bench.row_bytes((8, 64), (8, 32), 64) == 140  # the native int8 cache's row
    assert bench.row_bytes(None, None, 64) == 256
    assert bench.row_bytes((4, 32), (4, 32), 64) == 80


def test_a_missing_gguf_is_one_line(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--gguf", str(tmp_path / "x.gguf")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].endswith("x.gguf: no such file")


def test_a_count_that_is_not_positive_is_one_line(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--tokens", "0"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].endswith("--tokens 0: expected a positive count")
