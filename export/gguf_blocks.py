"""An int4 export of a GGUF file keeps the file's own blocks.

A GGUF ``Q4_0`` block of 32 weights is ``d * (q - 8)``, a ``Q4_1`` block ``d * q + m`` (``q``
in 0..15; ``d`` and ``m`` half floats). onnxruntime's ``MatMulNBits`` computes ``scale * (q -
zero_point)`` with an *integer* zero point: ``Q4_0`` maps onto it exactly (zero point 8), but
``Q4_1``'s float offset does not, and re-quantizing moved 99.5 % of SmolLM2's Q4_1 blocks by
up to half a step (``bench/results/gguf_fidelity_cpu.md``). So a product whose weight rows
are all rows of the file's ``Q4_0``/``Q4_1`` tensors is written with the file's blocks as
they are::

    x --> MatMulNBits(q, d, zero_point 8) ----------------------------------------------> Add --> y
      \\-> Reshape [1, T, K/32, 32] -> ReduceSum -> MatMul(Cast(M^T) + d^T * E, [K/32, N]) --/

``M [N, K/32]`` holds the blocks' offsets ``m`` (0 on Q4_0 rows), stored as the file's half-
precision values, and ``E [1, N]`` is 8 on Q4_1 rows and 0 on Q4_0 ones (``[1, 1]`` where
all are Q4_1), so a Q4_1 row is ``d * (q - 8) + (m + 8 d)`` (onnxruntime folds the constant
part to float32 when it loads the graph); a matrix of Q4_0 rows only needs no offset branch.
With int8 activations the product's rounding error is ``d * sum((q - 8) * (x8 - x))``,
centred as a Q4_0 block's is: a zero point of 0 made it ``d * sum(q * (x8 - x))`` with ``q``
all positive, whose terms do not cancel, and put a 64-wide trained model's mask rows 7.3
logits off (stories260K as Q4_1, the self-check's tolerance 5.9). The LM head, which
llama.cpp's 4-bit types store as ``Q8_0`` (``d * q``, ``q`` int8), becomes an 8-bit
``MatMulNBits`` of ``q + 128`` with zero point 128, exact too; a tied input embedding
gathers from the same bytes.

With float32 activations (the self-check's strict copy) that is the file's de-quantized
weights to float32 rounding, exactly what ``transformers`` loads from the file; with the
shipped int8 activations close to what llama.cpp computes (its ``Q4_1 x Q8_1`` dot product
adds ``m * sum(x8)``, the sum of the rounded activations, which a graph cannot reach; the
native decoder does exactly that). The offset branch and the 8-bit product are the same bits
for a row in any block of 2 rows or more (onnxruntime's CPU provider, T = 2..257; tested),
so the package's ``min_rows`` 2 keeps speculation lossless. The native decoder reads the
branch back as half-precision offsets and the 8-bit head as one plane of bytes
(``runtimes.native_backend``, ``decoder.c``).

Rows are matched by value, not by name: ``transformers`` de-quantizes each tensor and
permutes llama's q/k rows for its rotary layout, and the export may fuse q/k/v and gate/up,
but every graph row is still, bit for bit, one de-quantized file row. Other block types
(K-quants, Q5 ...) and weights that do not match are quantized by onnxruntime's
``MatMulNBitsQuantizer`` as for any model, and the export says how many products kept the
file's blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edgemtp.runtimes.native_backend import offset_branches  # noqa: F401 (the graph's reader)

BLOCK = 32
Q4_0, Q4_1, Q8_0 = 2, 3, 8  # GGML type ids (gguf.GGMLQuantizationType)
# the types that store a weight in more than 4 bits (F32, F16, Q5_0, Q5_1, Q8_0, Q8_1, Q5_K,
# Q6_K, Q8_K, BF16, F64): an LM head stored so keeps 8 bits in an int4 package
WIDE_TYPES = {0, 1, 6, 7, 8, 9, 13, 14, 15, 30, 28}
BLOCK_BYTES = {Q4_0: 18, Q4_1: 20, Q8_0: 34}
TYPE_NAMES = {Q4_0: "Q4_0", Q4_1: "Q4_1", Q8_0: "Q8_0"}


@dataclass
class Blocks:
    """One matrix's file blocks, rows in the graph's order (``[N, K]``, a Linear's weight)."""

    q: np.ndarray           # [N, K] uint8, 0..15
    d: np.ndarray           # [N, K/32] float32 (half-precision values)
    zero_points: np.ndarray  # [N, K/32] uint8: 0 (Q4_1 rows: d q + m) or 8 (Q4_0 rows); the
    #                          graph writes 8 for both (keep_file_blocks)
    offsets: np.ndarray | None  # [N, K/32] float32 (half values), None: Q4_0 rows only
    types: tuple[str, ...]  # the file's block types these rows came from

    def dequantize(self) -> np.ndarray:
        """The weights as ``gguf.quants`` (and so ``transformers``) de-quantize them: float32
        ``d * q + m`` (Q4_1), ``d * (q - 8)`` (Q4_0)."""
        n, k = self.q.shape
        q = self.q.reshape(n, k // BLOCK, BLOCK).astype(np.float32)
        z = self.zero_points[..., None].astype(np.float32)
        w = self.d[..., None] * (q - z)
        if self.offsets is not None:
            w = w + self.offsets[..., None]
        return w.reshape(n, k)

    def pack(self):
        """``MatMulNBits``' (blob [N, K/32, 16], scales [N, K/32], zero points [N,
        ceil(K/64)]), as onnxruntime's quantizer writes them: two weights a byte, the lower
        index in the low nibble."""
        n, k = self.q.shape
        nb = k // BLOCK
        blob = (self.q[:, 0::2] | (self.q[:, 1::2] << 4)).reshape(n, nb, BLOCK // 2)
        z = self.zero_points
        if nb % 2:
            z = np.pad(z, ((0, 0), (0, 1)))
        zp = (z[:, 0::2] | (z[:, 1::2] << 4)).astype(np.uint8)
        return (np.ascontiguousarray(blob), self.d.astype(np.float32), np.ascontiguousarray(zp))


@dataclass
class Blocks8:
    """A matrix of the file's Q8_0 blocks (``d * q``, ``q`` int8), rows in the graph's order;
    or (:meth:`quantize`) another wide head's weights put into such blocks."""

    q: np.ndarray           # [N, K] int8
    d: np.ndarray           # [N, K/32] float32 (half-precision values)
    types: tuple[str, ...] = ("Q8_0",)  # (): not the file's blocks, quantized from its values

    @classmethod
    def quantize(cls, w: np.ndarray) -> "Blocks8":
        """``w [N, K]`` (K a multiple of 32) in Q8_0 blocks as llama.cpp's
        ``quantize_row_q8_0`` (and gguf-py) writes them: ``d = amax / 127``, ``q = x * (1 /
        d)`` rounded half away from zero, ``d`` stored as a half; a weight moves by about half
        of 1/127 of its block's largest."""
        n, k = w.shape
        b = w.reshape(n, k // BLOCK, BLOCK).astype(np.float32)
        d = np.abs(b).max(-1, keepdims=True) / np.float32(127)
        with np.errstate(divide="ignore"):
            inv = np.where(d == 0, np.float32(0), np.float32(1) / d)
        x = b * inv
        a = np.abs(x)
        q = np.sign(x) * (np.floor(a) + np.floor(2 * (a - np.floor(a))))  # C's roundf
        q = q.astype(np.int8).reshape(n, k)
        return cls(q, d[..., 0].astype(np.float16).astype(np.float32), ())

    def dequantize(self) -> np.ndarray:
        n, k = self.q.shape
        w = self.d[..., None] * self.q.reshape(n, k // BLOCK, BLOCK).astype(np.float32)
        return w.reshape(n, k)

    def pack(self):
        """8-bit ``MatMulNBits``' (blob [N, K/32, 32] of ``q + 128``, scales [N, K/32],
        zero points [N, K/32], all 128): ``(u - 128) * d`` is the block exactly."""
        n, k = self.q.shape
        blob = (self.q.astype(np.int16) + 128).astype(np.uint8).reshape(n, k // BLOCK, BLOCK)
        return (blob, self.d.astype(np.float32), np.full((n, k // BLOCK), 128, np.uint8))


class FloatHead:
    """A float model's LM head in an int4 export: put into Q8_0 blocks
    (:meth:`Blocks8.quantize`) rather than 4-bit ones, as llama.cpp keeps a 4-bit model's head
    at 6-8 bits and as an int4 export of a GGUF file whose head is wider than 4 bits does. The
    part of :class:`FileBlocks`' interface that :func:`keep_file_blocks` and
    ``quantize.fake_quantize`` read: no other product has blocks of its own."""

    eight_bit = True
    head_type = None
    types: dict = {}

    def __init__(self, head_name: str) -> None:
        self.head_name = head_name  # the source weights' type (F32, BF16, F16), for messages
        self.head_at_8 = False

    def __len__(self) -> int:
        return 0

    def find(self, w: np.ndarray) -> None:
        return None

    def find8(self, w: np.ndarray) -> None:
        return None

    def head8(self, w: np.ndarray) -> Blocks8 | None:
        """``w [N, K]`` in 8-bit blocks (None where K is not a multiple of 32: 4 bits, as
        every other product)."""
        if w.shape[1] % BLOCK:
            return None
        return Blocks8.quantize(np.ascontiguousarray(w, dtype=np.float32))


class FileBlocks:
    """The Q4_0 / Q4_1 / Q8_0 tensors of a GGUF file (memory-mapped), every row indexed by
    the bytes of its de-quantized values; ``eight_bit`` False: the 4-bit ones only."""

    def __init__(self, path, eight_bit: bool = True) -> None:
        from edgemtp.runtimes.gguf_source import _Header

        self.path = Path(path)
        with open(self.path, "rb") as f:
            header = _Header(f)
        data = np.memmap(self.path, dtype=np.uint8, mode="r")
        self._raw: list[tuple[int, np.ndarray]] = []   # (type, [N, K/32, bytes])
        self._index: dict[tuple[int, int], tuple[int, int]] = {}
        self.types: dict[str, int] = {}
        kinds = {name: kind for name, kind, _, _ in header.table}
        # the LM head's type: output.weight's, or a tied model's token_embd.weight's
        self.head_type = kinds.get("output.weight", kinds.get("token_embd.weight"))
        self.eight_bit = eight_bit
        self.head_at_8 = False  # keep_file_blocks wrote the LM head at 8 bits
        for name, kind, dims, offset in header.table:
            if kind not in BLOCK_BYTES or dims[0] % BLOCK or (kind == Q8_0 and not eight_bit):
                continue
            k, n = int(dims[0]), int(np.prod(dims[1:], dtype=np.int64))
            start = header.data_start + offset
            nbytes = n * (k // BLOCK) * BLOCK_BYTES[kind]
            raw = data[start:start + nbytes].reshape(n, k // BLOCK, BLOCK_BYTES[kind])
            t = len(self._raw)
            self._raw.append((kind, raw))
            self.types[TYPE_NAMES[kind]] = self.types.get(TYPE_NAMES[kind], 0) + 1
            deq = (_decode8(raw) if kind == Q8_0 else _decode(kind, raw)).dequantize()
            for r in range(n):
                self._index[(k, hash(deq[r].tobytes()))] = (t, r)

    def __len__(self) -> int:
        return len(self._raw)

    def _rows(self, w: np.ndarray, kinds: tuple[int, ...]):
        """{file tensor: (rows of ``w``, its rows there)} when every row of ``w`` is found
        among ``kinds``' tensors, else None."""
        n, k = w.shape
        if k % BLOCK or not self._index:
            return None
        by_tensor: dict[int, tuple[list[int], list[int]]] = {}
        for i in range(n):
            hit = self._index.get((k, hash(w[i].tobytes())))
            if hit is None or self._raw[hit[0]][0] not in kinds:
                return None
            dst, src = by_tensor.setdefault(hit[0], ([], []))
            dst.append(i)
            src.append(hit[1])
        return by_tensor

    def find8(self, w: np.ndarray) -> Blocks8 | None:
        """The file's Q8_0 blocks for ``w [N, K]`` float32, as :meth:`find` finds 4-bit ones
        (an LM head: llama.cpp's 4-bit types keep it at 8 bits)."""
        w = np.ascontiguousarray(w, dtype=np.float32)
        by_tensor = self._rows(w, (Q8_0,))
        if by_tensor is None:
            return None
        n, k = w.shape
        q = np.empty((n, k), np.int8)
        d = np.empty((n, k // BLOCK), np.float32)
        for t, (rows, src) in by_tensor.items():
            b = _decode8(self._raw[t][1][src])
            q[rows], d[rows] = b.q, b.d
        blocks = Blocks8(q, d)
        return blocks if np.array_equal(blocks.dequantize(), w) else None

    def head8(self, w: np.ndarray) -> Blocks8 | None:
        """The LM head ``w [N, K]`` at 8 bits: the file's Q8_0 blocks (:meth:`find8`), or,
        where the file stores its head in more than 4 bits (Q6_K, as ``llama-quantize`` writes
        a 4-bit model's head, Q5_x, F16 ...), its values put into Q8_0 blocks
        (:meth:`Blocks8.quantize`) rather than down to 4 bits. None: 4 bits (a 4-bit file
        head, ``--requantize head``, or K not a multiple of 32)."""
        if not self.eight_bit:
            return None
        found = self.find8(w)
        if found is not None or self.head_type not in WIDE_TYPES or w.shape[1] % BLOCK:
            return found
        return Blocks8.quantize(np.ascontiguousarray(w, dtype=np.float32))

    @property
    def head_name(self) -> str:
        """The file's LM head type, by name."""
        try:
            import gguf

            return gguf.GGMLQuantizationType(self.head_type).name
        except (ImportError, ValueError):
            return f"type {self.head_type}"

    def find(self, w: np.ndarray) -> Blocks | None:
        """The file's blocks for ``w [N, K]`` float32 (rows in any order, from any of the
        file's 4-bit tensors): None unless every row is, bit for bit, a de-quantized file
        row."""
        w = np.ascontiguousarray(w, dtype=np.float32)
        by_tensor = self._rows(w, (Q4_0, Q4_1))
        if by_tensor is None:
            return None
        n, k = w.shape
        kinds = set()
        q = np.empty((n, k), np.uint8)
        d = np.empty((n, k // BLOCK), np.float32)
        zp = np.empty((n, k // BLOCK), np.uint8)
        m = np.zeros((n, k // BLOCK), np.float32)
        for t, (rows, src) in by_tensor.items():
            kind, raw = self._raw[t]
            kinds.add(TYPE_NAMES[kind])
            b = _decode(kind, raw[src])
            q[rows], d[rows], zp[rows] = b.q, b.d, b.zero_points
            if b.offsets is not None:
                m[rows] = b.offsets
        blocks = Blocks(q, d, zp, m if "Q4_1" in kinds else None, tuple(sorted(kinds)))
        if not np.array_equal(blocks.dequantize(), w):  # a hash collision, however unlikely
            return None
        return blocks


def _decode8(raw: np.ndarray) -> Blocks8:
    """``raw [N, K/32, 34]`` Q8_0 blocks (``d`` half, 32 int8) -> :class:`Blocks8`."""
    n, nb, _ = raw.shape
    d = raw[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    q = np.ascontiguousarray(raw[..., 2:34]).view(np.int8).reshape(n, nb * BLOCK)
    return Blocks8(q, d)


def _decode(kind: int, raw: np.ndarray) -> Blocks:
    """``raw [N, K/32, bytes]`` GGUF blocks -> :class:`Blocks`. A block: ``d`` (half), for
    Q4_1 ``m`` (half), then 16 bytes whose low nibbles are weights 0..15 and high ones
    16..31."""
    n, nb, _ = raw.shape
    d = raw[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    at = 4 if kind == Q4_1 else 2
    qs = raw[..., at:at + 16]
    q = np.concatenate([qs & 15, qs >> 4], axis=-1).reshape(n, nb * BLOCK)
    if kind == Q4_1:
        m = raw[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        return Blocks(q, d, np.zeros((n, nb), np.uint8), m, ("Q4_1",))
    return Blocks(q, d, np.full((n, nb), 8, np.uint8), None, ("Q4_0",))


# -- the graph ------------------------------------------------------------------------------


def keep_file_blocks(proto, blocks: FileBlocks, accuracy_level: int,
                     skip: tuple[str, ...] = (),
                     head: str | None = None) -> tuple[list[str], list[str]]:
    """Every ``MatMul`` of ``proto`` whose constant weight ``B [K, N]`` :meth:`FileBlocks.find`
    finds, rewritten in place as the module docstring's ``MatMulNBits`` (+ offset branch).
    ``skip``: weight names not kept where they hold Q4_1 blocks (a tied LM head, whose
    embedding gather has no offset input; Q4_0 blocks it keeps). ``head``: the LM head's
    weight, kept as an 8-bit ``MatMulNBits`` where :meth:`FileBlocks.head8` gives it 8 bits
    (the file's Q8_0 blocks, or a wider head's values in such blocks). Returns (the rewritten
    nodes' names, the offset MatMuls' names: onnxruntime's quantizer must leave those
    float)."""
    from onnx import TensorProto, helper, numpy_helper

    from .quantize import _drop_initializer

    graph = proto.graph
    inits = {i.name: i for i in graph.initializer}
    kept, offset_nodes = [], []
    for node in list(graph.node):
        if node.op_type != "MatMul" or node.input[1] not in inits:
            continue
        b = numpy_helper.to_array(inits[node.input[1]])
        if b.ndim != 2 or b.dtype != np.float32 or b.shape[0] % BLOCK:
            continue
        k, n = b.shape
        nb = k // BLOCK
        name, wname = node.name or node.output[0], node.input[1]
        if wname == head:
            found8 = blocks.head8(b.T)
            if found8 is not None:
                blob, scales, zp = found8.pack()
                new = [numpy_helper.from_array(blob, f"{wname}_Q8"),
                       numpy_helper.from_array(scales, f"{wname}_scales"),
                       numpy_helper.from_array(zp, f"{wname}_zero_points")]
                at = list(graph.node).index(node)
                graph.node.remove(node)
                graph.node.insert(at, helper.make_node(
                    "MatMulNBits", [node.input[0]] + [t.name for t in new], [node.output[0]],
                    name=f"{name}_Q8", domain="com.microsoft", K=k, N=n, bits=8,
                    block_size=BLOCK, accuracy_level=accuracy_level))
                graph.initializer.extend(new)
                _drop_initializer(graph, wname)
                if found8.types:  # the file's own blocks (else its values at 8 bits)
                    kept.append(name)
                blocks.head_at_8 = True
                continue
        found = blocks.find(b.T)
        if found is None or (wname in skip and found.offsets is not None):
            continue  # (a tied head of Q4_0 blocks is kept: its gather needs no offset)
        shift = None
        if found.offsets is not None:  # Q4_1 rows: zero point 8, offset m + 8 d (docstring)
            q41 = found.zero_points == 0
            shift = np.where(q41[:, 0], 8, 0).astype(np.float32)[None]  # E [1, N]
            if q41.all():
                shift = shift[:, :1]  # [1, 1]: every row Q4_1
            assert (q41 == q41[:, :1]).all()  # (a row's blocks come from one file tensor)
            found = Blocks(found.q, found.d, np.full_like(found.zero_points, 8),
                           found.offsets, found.types)
        blob, scales, zp = found.pack()
        new = [numpy_helper.from_array(blob, f"{wname}_Q4"),
               numpy_helper.from_array(scales, f"{wname}_scales"),
               numpy_helper.from_array(zp, f"{wname}_zero_points")]
        y = node.output[0]
        at = list(graph.node).index(node)
        graph.node.remove(node)
        out = f"{y}_nbits" if found.offsets is not None else y
        nodes = [helper.make_node(
            "MatMulNBits", [node.input[0]] + [t.name for t in new], [out],
            name=f"{name}_Q4", domain="com.microsoft", K=k, N=n, bits=4,
            block_size=BLOCK, accuracy_level=accuracy_level)]
        if found.offsets is not None:
            shape, axes, mt = f"{wname}_block_shape", f"{wname}_block_axis", f"{wname}_offsets"
            et = f"{wname}_offset_shift"
            new += [numpy_helper.from_array(np.array([0, 0, nb, BLOCK], np.int64), shape),
                    numpy_helper.from_array(np.array([3], np.int64), axes),
                    numpy_helper.from_array(np.ascontiguousarray(found.offsets.T)
                                            .astype(np.float16), mt),
                    numpy_helper.from_array(shift, et)]
            xb, xs, off = f"{y}_x_blocks", f"{y}_x_block_sums", f"{y}_offsets"
            sc = new[1].name
            nodes += [
                helper.make_node("Cast", [mt], [f"{mt}_float"], to=TensorProto.FLOAT,
                                 name=f"{name}_Q4_offsets_float"),
                helper.make_node("Transpose", [sc], [f"{sc}_T"], perm=[1, 0],
                                 name=f"{name}_Q4_scales_T"),
                helper.make_node("Mul", [f"{sc}_T", et], [f"{et}_scaled"],
                                 name=f"{name}_Q4_shift"),
                helper.make_node("Add", [f"{mt}_float", f"{et}_scaled"], [f"{mt}_shifted"],
                                 name=f"{name}_Q4_offsets_shifted"),
                helper.make_node("Reshape", [node.input[0], shape], [xb],
                                 name=f"{name}_Q4_blocks"),
                helper.make_node("ReduceSum", [xb, axes], [xs], keepdims=0,
                                 name=f"{name}_Q4_block_sums"),
                helper.make_node("MatMul", [xs, f"{mt}_shifted"], [off],
                                 name=f"{name}_Q4_offsets"),
                helper.make_node("Add", [out, off], [y], name=f"{name}_Q4_add_offsets")]
            offset_nodes.append(f"{name}_Q4_offsets")
        for i, n_ in enumerate(nodes):
            graph.node.insert(at + i, n_)
        graph.initializer.extend(new)
        _drop_initializer(graph, wname)
        kept.append(name)
    return kept, offset_nodes
