"""Memory: the host KV cache is sized for the whole context but costs resident memory only for
the rows in use (issue 10: peak RSS of generate <= package + KV cache + 150 MB)."""

import sys

import numpy as np
import pytest

from edgemtp.runtimes.onnxrt_backend import HostKV, lazy_zeros


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_a_cache_for_a_long_context_is_resident_only_where_rows_are_written():
    # 30 layers x 2048 rows x 3 heads x 64 (SmolLM2's shape at a 2048-token context): 45 MiB
    # each for K and V; one row written per layer (what a prefill's commit does) must not
    # fault in the whole cache, as numpy's huge-page advice on np.zeros made it
    before = _rss_mib()
    kv = HostKV(30, 2048, 3, 64, np.float32)
    kv.k[:, :40] = 1.0
    kv.v[:, :40] = 1.0
    grew = _rss_mib() - before
    assert grew < 12, f"writing 40 rows of a 90 MiB cache made {grew:.0f} MiB resident"
    assert kv.k[:, 40:].max() == 0 and kv.v.sum() == 30 * 40 * 3 * 64


def test_lazy_zeros_is_a_plain_writable_zeroed_array():
    a = lazy_zeros((3, 5, 2), np.float16)
    assert a.shape == (3, 5, 2) and a.dtype == np.float16 and a.flags.writeable
    assert a.flags.c_contiguous and not a.any()
    a[1, 2] = 7
    assert a.sum() == 14
    assert lazy_zeros((0, 4), np.float32).shape == (0, 4)
