"""Smaller packages: the tied embedding stored once, and weight-only quantization
(``--dtype int4|int8``) through onnxruntime's own ``MatMulNBitsQuantizer``.

Every ``MatMul`` with a constant weight ``B [K, N]`` becomes a ``MatMulNBits`` (com.microsoft):
``B`` quantized along K in blocks of 32, asymmetric (a scale and a zero point per block),
stored as ``blob [N, K/32, 32*bits/8]`` uint8, ``scales [N, K/32]`` float32 and packed
``zero_points [N, ceil(K/32*bits/8)]``. The scales are then rounded to half-precision values
(still float32 in the graph; :func:`half_scales`), as GGUF's blocks keep theirs: the native
decoder reads them as halves, 10 % fewer bytes a step. A tied model's input embedding then reads the
lm_head's own blob through ``GatherBlockQuantized`` (the same bytes, viewed as
``[V, d*bits/8]``), so the largest matrix is stored once, quantized::

    ids --> GatherBlockQuantized(Reshape(blob), scales, zero_points) --> layers --> h
    h   --> MatMulNBits(blob, scales, zero_points)                   --> logits [1, T, V]

Activations, the KV cache and the logits stay float32; the kernels quantize activations to
int8 per block (``accuracy_level`` 4: 2.7x faster than float32 activations at one row on an
AVX2 CPU). Speculation is lossless only if a row's logits do not depend on the block it sits in;
measured (``bench/results/quant_cpu.md``), each row against the same row alone:

- the attention's float32 softmax and ``probs @ values`` sum in orders that depend on the
  row's column count and its ancestors' columns (float64 only makes a different order rarer):
  made exact sums on fixed grids, equal in any order (``graph.exact_sums``,
  ``graph.ExportTreeDecoder.exact_attention``);
- int4 ``MatMulNBits`` take another kernel for a chunk of one row (MLAS cuts the rows into
  chunks of 128): the package says ``min_rows`` 2, and the runtime pads a forward of one row
  (plain decoding) or ``128 j + 1`` rows (a 769-token prefill) with a throwaway row
  (``runtimes.package.run_rows``);
- int8 ``MatMulNBits`` at level 4 agree at every M.

With both, a block's rows are bitwise the rows plain decoding computes.

The export's self-check holds the graph to the PyTorch decoder with the same de-quantized
weights, computed here independently of the graph (:func:`fake_quantize`): strictly (float32
tolerance) on a copy of the graph whose kernels keep float32 activations
(:func:`float_activations`), so a corrupted blob or scale fails it, and loosely on the graph
as shipped (its int8 activations).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from edgemtp.runtimes.host_table import dequantize_rows

BLOCK_SIZE = 32


@dataclass(frozen=True)
class QuantSpec:
    """One weight-only quantization: ``int4-b32-asym-acc1``."""

    bits: int
    block_size: int = BLOCK_SIZE
    symmetric: bool = False
    accuracy_level: int = 4  # activations quantized to int8 per block (1: kept float32)
    min_rows: int = 1        # the fewest rows a forward may run (see the module docstring)

    def __post_init__(self) -> None:
        assert self.bits in (4, 8) and self.block_size >= 16, self

    @property
    def name(self) -> str:
        return (f"int{self.bits}-b{self.block_size}-{'sym' if self.symmetric else 'asym'}"
                f"-acc{self.accuracy_level}")


QUANTIZED = {"int4": QuantSpec(4, min_rows=2), "int8": QuantSpec(8)}


@dataclass(frozen=True)
class TiedTable:
    """Initializer names of an embedding table the graph shares with its lm_head."""

    data: str
    scales: str | None = None        # block-quantized tables only
    zero_points: str | None = None
    bits: int | None = None          # block-quantized tables: 4, or 8 (a GGUF's Q8_0 head)


# -- numpy: the block format ----------------------------------------------------------------


def block_quantize(w: np.ndarray, spec: QuantSpec):
    """``w [N, K]`` (a torch Linear's weight) -> (blob, scales, zero_points) exactly as
    ``MatMulNBitsQuantizer`` writes them for ``B = w.T``."""
    from onnxruntime.capi._pybind_state import quantize_matmul_4bits, quantize_matmul_8bits

    n, k = w.shape
    kb, blob = -(-k // spec.block_size), spec.block_size * spec.bits // 8
    b = np.ascontiguousarray(w.T, dtype=np.float32)
    if k % spec.block_size:  # the quantizer pads K with zeros to whole blocks
        b = np.pad(b, ((0, kb * spec.block_size - k), (0, 0)))
    packed = np.zeros((n, kb, blob), np.uint8)
    scales = np.zeros((n, kb), np.float32)
    zp = np.zeros((n, -(-kb * spec.bits // 8)), np.uint8)
    fn = quantize_matmul_4bits if spec.bits == 4 else quantize_matmul_8bits
    fn(packed, b, scales, zp, spec.block_size, n, b.shape[0], spec.symmetric)
    return packed, half_scales(scales), zp


def half_scales(scales: np.ndarray) -> np.ndarray:
    """Block scales rounded to the nearest half-precision value (kept float32), unless one
    would overflow it: a block's weights move by at most 2^-11 of their size, far inside the
    quantization's own step, and the native decoder (``runtimes.native_backend.pack_q4``)
    then stores every scale in 2 bytes rather than 4 with the same products. GGUF's Q4_0,
    Q4_1 and Q8_0 blocks keep a half-precision scale too.

    >>> half_scales(np.array([0.1, 3e-3], np.float32)).tolist()
    [0.0999755859375, 0.0030002593994140625]
    >>> half_scales(np.array([0.1, 7e4], np.float32)).tolist()  # 7e4 overflows a half
    [0.10000000149011612, 70000.0]
    """
    with np.errstate(over="ignore"):
        half = scales.astype(np.float16)
    if not np.isfinite(half).all():
        return scales
    return half.astype(np.float32)


def dequantize(packed, scales, zero_points, spec: QuantSpec, k: int) -> np.ndarray:
    """(blob, scales, zero points) of :func:`block_quantize` -> ``[N, K]`` float32, as the
    kernels (and the runtime's host table) de-quantize it.

    >>> w = np.linspace(-1, 1, 64, dtype=np.float32).reshape(1, 64)  # 2 blocks, range ~1
    >>> err = np.abs(dequantize(*block_quantize(w, QuantSpec(4)), QuantSpec(4), 64) - w)
    >>> bool(err.max() <= 0.5 / 15 + 1e-6)     # half a step of 15 levels over the range
    True
    """
    if spec.symmetric:  # the quantizer leaves zero_points untouched; the kernels use 2^(bits-1)
        zero_points = None
    return dequantize_rows(packed, scales, zero_points, spec.bits, spec.block_size)[:, :k]


# -- torch: the reference the self-check compares against -----------------------------------


def fake_quantize(hf, spec: QuantSpec, file_blocks=None) -> int:
    """Replace every ``nn.Linear`` weight of ``hf`` (lm_head included, and so a tied input
    embedding) with its quantize-dequantize round trip, and round every value projection's
    output to the grid the quantized graph keeps its values on (``graph.exact_sums``); returns
    how many weights were replaced. Weights that are a GGUF file's own 4-bit blocks
    (``file_blocks``, as :func:`quantize_graph` keeps them) stay as loaded: they are already
    exactly those blocks' values; an LM head the file stores in more than 4 bits takes the
    8-bit blocks :meth:`export.gguf_blocks.FileBlocks.head8` puts it in."""
    import torch
    from torch import nn

    from .graph import V_GRID

    def on_grid(module, args, out):
        return torch.round(out * V_GRID) / V_GRID

    count = 0
    with torch.no_grad():
        for module in hf.modules():
            if isinstance(module, nn.Linear):
                w = module.weight.detach().float().cpu().numpy()
                head8 = (file_blocks.head8(w) if file_blocks is not None and spec.bits == 4
                         and module is hf.get_output_embeddings() else None)
                if head8 is not None and not head8.types:  # the file's wide head at 8 bits
                    module.weight.copy_(torch.from_numpy(head8.dequantize()))
                    count += 1
                    continue
                found = (file_blocks.find(w) if file_blocks is not None and spec.bits == 4
                         and head8 is None else None)
                if head8 is not None or (found is not None and (
                        _tied_to(hf, module) is None or found.offsets is None)):
                    continue  # (a tied head keeps Q4_0 blocks only, as quantize_graph)
                deq = dequantize(*block_quantize(w, spec), spec, w.shape[1])
                if _tied_to(hf, module) is not None and w.shape[1] % spec.block_size:
                    # the graph's embedding keeps its float table there (quantize_graph):
                    # only the lm_head is quantized
                    module.weight = nn.Parameter(torch.from_numpy(deq), requires_grad=False)
                else:
                    module.weight.copy_(torch.from_numpy(deq))
                count += 1
    for name, module in hf.named_modules():
        if name.endswith("v_proj"):
            module.register_forward_hook(on_grid)
    return count


def _tied_to(hf, module):
    """The input embedding ``module`` (a Linear) shares its weight with, or None."""
    emb = hf.get_input_embeddings()
    return emb if emb is not None and emb.weight is module.weight else None


# -- the graph ------------------------------------------------------------------------------


def float_activations(proto) -> None:
    """The same graph with every MatMulNBits keeping float32 activations (accuracy level 0):
    the weights unchanged, for the strict self-check."""
    for node in proto.graph.node:
        if node.op_type == "MatMulNBits":
            keep = [a for a in node.attribute if a.name != "accuracy_level"]
            del node.attribute[:]
            node.attribute.extend(keep)


def tie_float_embedding(proto) -> TiedTable | None:
    """fp32/fp16: the lm_head ``MatMul`` reads ``Transpose(E)`` of the embedding Gather's
    table ``E [V, d]`` instead of its own copy ``E^T`` (ONNX Runtime folds the Transpose when
    it loads the graph). None when the model's embeddings are not tied."""
    from onnx import helper

    found = _tied_pair(proto)
    if found is None:
        return None
    gather, matmul, table = found
    graph = proto.graph
    old = matmul.input[1]
    out = f"{table}_transposed"
    graph.node.insert(list(graph.node).index(matmul),
                      helper.make_node("Transpose", [table], [out], perm=[1, 0],
                                       name="/decoder/lm_head/tied_transpose"))
    matmul.input[1] = out
    _drop_initializer(graph, old)
    return TiedTable(data=table)


def quantize_graph(proto, spec: QuantSpec, file_blocks=None,
                   kept: list | None = None) -> TiedTable | None:
    """Quantize ``proto``'s MatMul weights in place; a tied embedding's Gather then reads the
    lm_head's quantized table. Returns that table's initializer names (None: not tied).

    ``file_blocks`` (:class:`export.gguf_blocks.FileBlocks`, int4 only): products whose
    weights are a GGUF file's own Q4_0/Q4_1 blocks keep them (:mod:`export.gguf_blocks`)
    rather than being re-quantized; their node names are appended to ``kept``."""
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    tied = _tied_pair(proto)
    lm_head_b = tied[1].input[1] if tied else None
    exclude: list[str] = []
    if file_blocks is not None and spec.bits == 4 and spec.block_size == 32:
        from .gguf_blocks import keep_file_blocks

        inits = {i.name for i in proto.graph.initializer}
        head = [n.input[1] for n in proto.graph.node
                if n.op_type == "MatMul" and n.input[1] in inits][-1:]
        names, exclude = keep_file_blocks(proto, file_blocks, spec.accuracy_level,
                                          skip=(lm_head_b,) if lm_head_b else (),
                                          head=head[0] if head else None)
        if kept is not None:
            kept.extend(names)
    quant_log = logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer")
    level = quant_log.level
    quant_log.setLevel(logging.WARNING)  # it logs every node it visits at INFO
    try:
        q = MatMulNBitsQuantizer(proto, bits=spec.bits, block_size=spec.block_size,
                                 is_symmetric=spec.symmetric,
                                 accuracy_level=spec.accuracy_level,
                                 nodes_to_exclude=exclude)
        q.process()
    finally:
        quant_log.setLevel(level)
    out = q.model.model
    if out is not proto:
        proto.CopyFrom(out)
    _round_scales(proto)
    if tied is None:
        return None
    width = next(i.dims[1] for i in proto.graph.initializer if i.name == tied[2])
    if width % spec.block_size:
        # GatherBlockQuantized gives whole blocks: a hidden size of 48 would come out 64 wide
        # (onnxruntime refused the graph). The Gather keeps its float table, as an untied
        # model's does
        return None
    return _share_quantized_table(proto, spec, tied[0].output[0], lm_head_b)


def _round_scales(proto) -> None:
    """Every ``MatMulNBits``' scales through :func:`half_scales`, in place (the tied
    embedding's ``GatherBlockQuantized`` reads the lm_head's, so it follows)."""
    from onnx import numpy_helper

    names = {n.input[2] for n in proto.graph.node if n.op_type == "MatMulNBits"}
    for init in proto.graph.initializer:
        if init.name in names:
            a = numpy_helper.to_array(init)
            init.CopyFrom(numpy_helper.from_array(half_scales(a).astype(a.dtype), init.name))


def _tied_pair(proto):
    """(embedding Gather, lm_head MatMul, table name) when the MatMul's constant weight is
    exactly the transpose of the Gather's table; else None."""
    from onnx import numpy_helper

    graph = proto.graph
    inits = {i.name: i for i in graph.initializer}
    gathers = [n for n in graph.node if n.op_type == "Gather" and n.input[0] in inits
               and len(inits[n.input[0]].dims) == 2]
    matmuls = [n for n in graph.node if n.op_type == "MatMul" and n.input[1] in inits]
    if not gathers or not matmuls:
        return None
    gather = max(gathers, key=lambda n: inits[n.input[0]].dims[0])  # the vocabulary table
    matmul = matmuls[-1]                                            # the lm_head, last
    e, b = inits[gather.input[0]], inits[matmul.input[1]]
    if list(b.dims) != list(e.dims)[::-1]:
        return None
    if not np.array_equal(numpy_helper.to_array(b), numpy_helper.to_array(e).T):
        return None
    return gather, matmul, gather.input[0]


def _share_quantized_table(proto, spec: QuantSpec, gather_out: str, lm_head_b: str):
    from onnx import helper, numpy_helper

    graph = proto.graph
    node = next(n for n in graph.node if n.op_type == "MatMulNBits"
                and n.input[1].startswith(lm_head_b))
    blob, scales = node.input[1], node.input[2]
    zp = node.input[3] if len(node.input) > 3 and node.input[3] else None
    bits = next(a.i for a in node.attribute if a.name == "bits")  # 8: a GGUF's Q8_0 head
    gather = next(n for n in graph.node if n.output[0] == gather_out)
    inits = {i.name: i for i in graph.initializer}
    n, kb, nbytes = inits[blob].dims
    shape = f"{blob}_gather_shape"
    graph.initializer.append(numpy_helper.from_array(np.array([n, kb * nbytes],
                                                              dtype=np.int64), shape))
    flat = f"{blob}_rows"
    at = list(graph.node).index(gather)
    table = gather.input[0]
    graph.node.remove(gather)
    # the blob is [V, d/bs, bs*bits/8]; GatherBlockQuantized wants the same bytes as rows
    # [V, d*bits/8] (ONNX Runtime folds the Reshape once, at load)
    graph.node.insert(at, helper.make_node("Reshape", [blob, shape], [flat],
                                           name="/decoder/embed_tokens/tied_rows"))
    graph.node.insert(at + 1, helper.make_node(
        "GatherBlockQuantized", [flat, gather.input[1], scales] + ([zp] if zp else []),
        [gather_out], domain="com.microsoft", name="/decoder/embed_tokens/GatherBlockQuantized",
        bits=bits, block_size=spec.block_size, gather_axis=0, quantize_axis=1))
    _drop_initializer(graph, table)
    return TiedTable(data=blob, scales=scales, zero_points=zp, bits=bits)


def _drop_initializer(graph, name: str) -> None:
    if any(name in n.input for n in graph.node):
        return
    for i, init in enumerate(graph.initializer):
        if init.name == name:
            del graph.initializer[i]
            return
