"""The input embedding table as the host reads it (mask initialisation), numpy only: an
``embeddings.npy`` memory map, or the graph's own block-quantized tied table inside its
external data (``package.EmbeddingInfo``), de-quantized row by row as ONNX Runtime's
``GatherBlockQuantized`` does::

    model.onnx.data  ...| data [V, d*bits/8] uint8 | scales [V, d/bs] | zero points |...
                           rows(ids) -> (q - zero_point) * scale -> [n, d] float32
"""

from __future__ import annotations

from pathlib import Path

import numpy as np


CACHED_ROW_BYTES = 16 << 20  # de-quantized embedding rows kept by a block-quantized table


class EmbeddingTable:
    """Rows of the input embedding on the host, float32, memory-mapped: only the rows asked
    for are read (a block-quantized table de-quantizes them as ``GatherBlockQuantized``:
    ``(q - zero_point) * scale``)."""

    def __init__(self, path: Path, info) -> None:
        # info: package.EmbeddingInfo, its layout and (block-quantized) array references
        if info.layout in ("npy", "graph-rows"):
            # a plain ndarray over the memory map: indexing a np.memmap costs a subclass wrap
            self._table = np.asarray(np.load(path, mmap_mode="r")) if info.layout == "npy" \
                else _mapped(path, info.data)  # (the graph's own float table)
            self.rows = self._float_rows
            return
        self._bits, self._bs = info.bits, info.block_size
        self._data, self._scales = _mapped(path, info.data), _mapped(path, info.scales)
        self._zp = _mapped(path, info.zero_points) if info.zero_points else None
        # de-quantized rows kept as first asked for (a drafter with mask tokens asks for the
        # rows of each step's committed tokens: ~35 us a step to de-quantize 1-3 rows of
        # SmolLM2's int4 table through numpy, a few us from the cache)
        width = self._scales.shape[1] * self._bs
        self.rows = HostRows(self._quantized_rows, width,
                             max(256, CACHED_ROW_BYTES // (4 * width)))

    def _float_rows(self, ids: np.ndarray) -> np.ndarray:
        rows = self._table[ids]  # fancy indexing: a fresh array, the caller's to keep
        return rows if rows.dtype == np.float32 else rows.astype(np.float32)

    def _quantized_rows(self, ids: np.ndarray) -> np.ndarray:
        zp = None if self._zp is None else self._zp[ids]
        return dequantize_rows(self._data[ids], self._scales[ids], zp, self._bits, self._bs)


class HostRows:
    """Embedding rows kept on the host as they are first asked for (at most ``cap``; all
    dropped when full): the lookups of the mask embeddings' EMA, whose tokens repeat within
    a generation, without a GPU backend's device round trip or a block-quantized table's
    de-quantization each step.

    >>> table = np.arange(12, dtype=np.float32).reshape(4, 3)
    >>> rows = HostRows(lambda ids: table[ids], 3, cap=2)
    >>> rows(np.array([1, 1])).tolist(), sorted(rows.rows)
    ([[3.0, 4.0, 5.0], [3.0, 4.0, 5.0]], [1])
    >>> rows(np.array([[2], [3]])).shape, sorted(rows.rows)    # full: dropped, then refilled
    ((2, 1, 3), [2, 3])
    >>> rows(np.array([], dtype=np.int64)).shape
    (0, 3)
    """

    def __init__(self, fetch, width: int, cap: int) -> None:
        self.fetch, self.width, self.cap = fetch, width, cap
        self.rows: dict[int, np.ndarray] = {}

    def __call__(self, token_ids) -> np.ndarray:
        ids = np.asarray(token_ids, dtype=np.int64)
        flat = ids.ravel().tolist()
        missing = sorted(set(flat) - self.rows.keys())
        if missing:
            if len(self.rows) + len(missing) > self.cap:
                self.rows.clear()
            self.rows.update(zip(missing, np.asarray(self.fetch(missing), dtype=np.float32)))
        if not flat:
            return np.zeros((*ids.shape, self.width), dtype=np.float32)
        return np.stack([self.rows[i] for i in flat]).reshape(*ids.shape, self.width)


def dequantize_rows(data, scales, zero_points, bits: int, block_size: int) -> np.ndarray:
    """Block-quantized rows -> float32 ``[n, blocks * block_size]``: ``data [n, ...]`` uint8
    (``8 // bits`` values a byte, low bits first), ``scales [n, blocks]``, ``zero_points``
    packed the same way (None: ``2^(bits-1)``); ``(q - zero_point) * scale`` in float32.

    >>> dequantize_rows(np.array([[0x21] * 8]), np.ones((1, 1)), None, 4, 16)[0, :2].tolist()
    [-7.0, -6.0]
    """
    n, blocks = scales.shape
    q = _unpack(np.asarray(data).reshape(n, -1), bits)[:, :blocks * block_size]
    zp = (np.float32(2 ** (bits - 1)) if zero_points is None else
          _unpack(np.asarray(zero_points).reshape(n, -1), bits)[:, :blocks, None]
          .astype(np.float32))
    w = (q.reshape(n, blocks, block_size).astype(np.float32) - zp) \
        * np.asarray(scales, np.float32)[:, :, None]
    return w.reshape(n, -1)


def _mapped(path: Path, ref) -> np.ndarray:
    return np.asarray(np.memmap(path, dtype=ref.dtype, mode="r", offset=ref.offset,
                                shape=tuple(ref.shape)))


def _unpack(a: np.ndarray, bits: int) -> np.ndarray:
    # [n, m] uint8 -> [n, m * 8 // bits]
    return a if bits == 8 else np.stack([a & 15, a >> 4], -1).reshape(a.shape[0], -1)
