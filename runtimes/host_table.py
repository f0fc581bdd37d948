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


class EmbeddingTable:
    """Rows of the input embedding on the host, float32, memory-mapped: only the rows asked
    for are read (a block-quantized table de-quantizes them as ``GatherBlockQuantized``:
    ``(q - zero_point) * scale``)."""

    def __init__(self, path: Path, info) -> None:
        # info: package.EmbeddingInfo, its layout and (block-quantized) array references
        if info.layout == "npy":
            # a plain ndarray over the memory map: indexing a np.memmap costs a subclass wrap
            self._table = np.asarray(np.load(path, mmap_mode="r"))
            self.rows = self._float_rows
            return
        self._bits, self._bs = info.bits, info.block_size
        self._data, self._scales = _mapped(path, info.data), _mapped(path, info.scales)
        self._zp = _mapped(path, info.zero_points) if info.zero_points else None
        self.rows = self._quantized_rows

    def _float_rows(self, ids: np.ndarray) -> np.ndarray:
        rows = self._table[ids]  # fancy indexing: a fresh array, the caller's to keep
        return rows if rows.dtype == np.float32 else rows.astype(np.float32)

    def _quantized_rows(self, ids: np.ndarray) -> np.ndarray:
        zp = None if self._zp is None else self._zp[ids]
        return dequantize_rows(self._data[ids], self._scales[ids], zp, self._bits, self._bs)


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
