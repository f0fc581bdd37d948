"""The native backend: an int4 package's decoder run by edgemtp's own C code on the CPU
(``edgemtp/native/decoder.c``), from the weights in the package's graph.

Why it exists: on onnxruntime's CPU kernels a row's logits depend on the block it sits in, so
the onnxruntime int4 package pays, every plain step, for a throwaway second row and, in every
attention, for exact sums spelled out in ~1400 small nodes (``bench/results/peers_cpu.md``).
``decoder.c`` computes each row with the same instructions in the same order whatever block it
sits in, so verification is exact by construction, with no padding row and no float64 sums;
and it runs the whole step in one call, its int4 products on the CPU's integer dot-product
instructions where it has them (AVX-512 VNNI), on two threads with OpenMP.

Its numerics are its own: int8 activations per block of 32 (as onnxruntime's accuracy level 4),
float32 attention. Its greedy output is lossless against its own plain decoding (tested), and
at load it is checked against the package's onnxruntime graph on a probe block, once per
package and library (the result is cached): logits within the self-check's tolerance and the
same argmax. Packages it cannot run (not int4, another architecture) are refused in one line
naming the backend that can.

The package keeps its graph: ``model.onnx`` stays the portable artifact (onnxruntime on any
device); this backend is the fast path for int4 packages on x86-64 and ARM CPUs.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import sys
from pathlib import Path
from time import perf_counter
from typing import NamedTuple

import numpy as np

from edgemtp import native
from edgemtp.backend import StepOut, check_options, parse_device
from edgemtp.errors import BackendUnavailableError, ConfigError, ModelLoadError
from edgemtp.runtimes.host_table import _unpack
from edgemtp.runtimes.package import check_step, graph_io, load_package

_P = ctypes.c_void_p
BLOCK = 32
MAX_DIFF, MIN_SAME = 0.1, 0.5  # the load check's bounds against the onnxruntime graph
MARGIN = 256  # cache rows past the max context: a block near the end may hold draft rows past it
# the K/V cache's element: half floats (as llama.cpp's default), or int8 codes with a float
# scale per key row and per 32 value lanes (as llama.cpp's q8_0 cache: half the bytes a long
# context's attention reads; see decoder.c)
KV_CACHES = ("fp16", "int8")


# families whose decoder layer it computes: Llama's (Mistral's is the same without a sliding
# window), Qwen2's (q/k/v biases) and Qwen3's (RMSNorm per head of q and k); the load check
# against the package's graph catches a layer read wrong
FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


def runs_natively(path) -> bool:
    """Whether ``--backend auto`` takes this package to the native backend: int4 weights in
    blocks of 32, a Llama-style family (:data:`FAMILIES`), a tied embedding or an untied
    float32 one, shapes its
    kernels take (a hidden size of whole 16s, heads of whole 8s), and a C decoder that builds
    here. (What only the graph shows, the backend finds when it loads; ``Model.load`` then
    runs the package on onnxruntime.)"""
    try:
        m = json.loads((Path(path) / "edgemtp.json").read_text())
        w = m.get("weights") or {}
        if (w.get("format") != "int4" or w.get("block_size", BLOCK) != BLOCK
                or m.get("family") not in FAMILIES
                or (w.get("tied_embedding") is False
                    and (m.get("embeddings") or {}).get("dtype") != "fp32")
                or int(m["hidden_size"]) % 16 or int(m["head_dim"]) % 8
                or int(m["num_heads"]) % int(m["num_kv_heads"])):
            return False
    except (OSError, ValueError, AttributeError, KeyError, TypeError, ZeroDivisionError):
        return False
    return native.decoder_lib() is not None


def cache_bytes(layers: int, kv_heads: int, head_dim: int, rows: int, kv_cache: str) -> int:
    """A native session's KV cache in bytes for ``rows`` positions (:class:`NativeSession`'s
    arrays: MARGIN rows more, in blocks of 16): ``"fp16"`` keys and values, or ``"int8"``
    codes with a float32 scale per key row and KV head and per value row and 32-lane chunk.

    >>> cache_bytes(30, 3, 64, 2048, "fp16") / 2**20, cache_bytes(30, 3, 64, 2048, "int8")
    (50.625, 29030400)
    """
    cap = -(-(rows + MARGIN) // 16) * 16
    if kv_cache == "int8":
        chunks = head_dim // (32 if head_dim % 32 == 0 else head_dim)
        return layers * kv_heads * cap * (2 * head_dim + 4 + 4 * chunks)
    return layers * kv_heads * cap * head_dim * 2 * 2


class NativeUnsupported(ConfigError):
    """A package the native decoder does not know how to run (an untied or float embedding,
    a norm or rotary form it does not take, shapes its kernels do not): onnxruntime runs it,
    and ``--backend auto`` goes there instead."""


class Q4W(ctypes.Structure):
    _fields_ = [("G", ctypes.c_int), ("nb", ctypes.c_int), ("w", _P), ("sc", _P), ("zp", _P),
                ("sc16", _P), ("mn16", _P), ("bits", ctypes.c_int)]


class _Model(ctypes.Structure):
    _fields_ = ([(n, ctypes.c_int) for n in ("L", "d", "H", "Hkv", "D", "F", "V", "rope_rows",
                                             "threads")]
                + [("eps", ctypes.c_float), ("scale", ctypes.c_float)]
                + [(n, _P) for n in ("cos", "sin", "norm_in", "norm_post", "norm_final", "qkv",
                                     "o", "gu", "down", "lm", "emb_q", "emb_sc", "emb_zp",
                                     "qkv_bias", "q_norm", "k_norm")]
                + [("emb_bits", ctypes.c_int)])


class _Cache(ctypes.Structure):
    _fields_ = [("k", _P), ("v", _P), ("cap", ctypes.c_int), ("len", ctypes.c_int),
                ("ks", _P), ("vs", _P)]


class _Call(ctypes.Structure):
    _fields_ = ([(n, ctypes.c_int) for n in ("T", "topk", "rows_from")]
                + [(n, _P) for n in ("ids", "pos", "mask", "mask_embeds")]
                + [("n_mask", ctypes.c_int)]
                + [(n, _P) for n in ("argmax", "topk_ids", "topk_lp", "logits", "hidden")])


def pack_q4(q: np.ndarray, scales: np.ndarray, zp: np.ndarray,
            offsets: np.ndarray | None = None):
    """Columns ``q [N, K]`` (values 0..15), ``scales``/``zp [N, K / 32]`` -> decoder.c's
    layout: groups of 16 columns, blocks of 32 inputs, chunk c byte r*4+e holding input 8c+e
    (low nibble) and 8c+4+e (high nibble) of column 16g+r. The scales come back as halves
    where every one is a half-precision value (packages exported since scales are rounded so,
    :func:`edgemtp.export.quantize.half_scales`): 32 bytes a block less to read each step, the
    same products. ``offsets [N, K / 32]`` (a GGUF file's Q4_1 blocks, half-precision values):
    returned as halves in the same layout (else None); zero points that are all 0 come back
    as None (decoder.c reads none)."""
    n, k = q.shape
    nb, g = k // BLOCK, -(-n // 16)
    qp = np.zeros((g * 16, k), np.uint8)
    qp[:n] = q
    x = qp.reshape(g, 16, nb, 4, 2, 4).transpose(0, 2, 3, 1, 5, 4)  # g b c r e half
    w = np.ascontiguousarray(x[..., 0] | (x[..., 1] << 4))
    sc = pack_scales(scales, g)
    zpp = np.full((g * 16, nb), 8, np.uint8)
    zpp[:n] = zp
    z = np.ascontiguousarray(zpp.reshape(g, 16, nb).transpose(0, 2, 1))
    mn = None
    if offsets is not None:
        mp = np.zeros((g * 16, nb), np.float32)
        mp[:n] = offsets
        mn = np.ascontiguousarray(mp.reshape(g, 16, nb).transpose(0, 2, 1)).astype(np.float16)
        if not np.array_equal(mn.astype(np.float32), mp.reshape(g, 16, nb).transpose(0, 2, 1)):
            raise ValueError("block offsets that are not half-precision values")
        if not zpp[:n].any():
            z = None
    return g, nb, w, sc, z, mn


def pack_scales(x: np.ndarray, g: int, dtype=np.float32) -> np.ndarray:
    """Per column and block ``x [N, nb]`` -> ``[g][nb][16]`` (columns past N: 0); floats come
    back as halves where every one is a half-precision value (as :func:`pack_q4`'s scales)."""
    n, nb = x.shape
    xp = np.zeros((g * 16, nb), dtype)
    xp[:n] = x
    out = np.ascontiguousarray(xp.reshape(g, 16, nb).transpose(0, 2, 1))
    if dtype == np.float32:
        with np.errstate(over="ignore"):
            half = out.astype(np.float16)
        if np.array_equal(half.astype(np.float32), out):
            return half
    return out


class OffsetBranch(NamedTuple):
    """A product's GGUF Q4_1 offset branch (``export.gguf_blocks``)."""

    offsets: str       # the offsets' initializer (``M^T [K/32, N]``, half floats)
    add: object        # the Add node whose output is the product's
    shift: str | None  # ``E [1, N]`` (or ``[1, 1]``): 8 on the Q4_1 rows, whose zero
    #                    points the graph sets to 8 for an offset of m + 8 d; None (packages
    #                    before 2026-11-29): zero point 0, offset m


def offset_branches(graph) -> dict:
    """The offset branches ``export.gguf_blocks.keep_file_blocks`` writes: {MatMulNBits node
    name: :class:`OffsetBranch`}, read off the graph in one pass."""
    made = {o: n for n in graph.node for o in n.output}
    users: dict[str, list] = {}
    for n in graph.node:
        for i in n.input:
            users.setdefault(i, []).append(n)

    def op(name: str, kind: str):
        n = made.get(name)
        return n if n is not None and n.op_type == kind else None

    def other(node, name: str) -> str:
        return node.input[1] if node.input[0] == name else node.input[0]

    found = {}
    for node in graph.node:
        if node.op_type != "MatMulNBits":
            continue
        use = users.get(node.output[0], [])
        if len(use) != 1 or use[0].op_type != "Add":
            continue
        add = use[0]
        mm = op(other(add, node.output[0]), "MatMul")
        rs = mm and op(mm.input[0], "ReduceSum")
        rh = rs and op(rs.input[0], "Reshape")
        if not (rh and rh.input[0] == node.input[0]):
            continue
        cast, shift = op(mm.input[1], "Cast"), None
        added = op(mm.input[1], "Add")
        if added is not None:  # Cast(M) + Transpose(scales) * E
            cast = op(added.input[0], "Cast") or op(added.input[1], "Cast")
            mul = cast and op(other(added, cast.output[0]), "Mul")
            tr = mul and (op(mul.input[0], "Transpose") or op(mul.input[1], "Transpose"))
            if not (tr and tr.input[0] == node.input[2]):
                continue
            shift = other(mul, tr.output[0])
        if cast:
            found[node.name] = OffsetBranch(cast.input[0], add, shift)
    return found


def _ptr(a) -> int | None:
    return None if a is None else a.ctypes.data


WEIGHTS_LAYOUT = "arena-2MB"  # in identity(): latency curves measured on another layout
HUGE = 2 << 20  # a transparent huge page (x86-64, and aarch64 with 4 KB base pages)
MADV_HUGEPAGE = 14  # <sys/mman.h> on Linux


def advise_huge(a: np.ndarray) -> bool:
    """Ask Linux to back the 2 MB pages inside ``a`` with transparent huge pages (where
    /sys/kernel/mm/transparent_hugepage/enabled says ``madvise``, as it does by default on
    Ubuntu and JetPack, memory gets them only when asked). Best effort: whether the kernel
    took the advice (False off Linux, on a kernel without huge pages, or where ``a`` holds no
    whole 2 MB page)."""
    if not sys.platform.startswith("linux"):
        return False
    lo = -(-a.ctypes.data // HUGE) * HUGE
    hi = (a.ctypes.data + a.nbytes) // HUGE * HUGE
    if hi <= lo:
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), MADV_HUGEPAGE) == 0
    except (OSError, AttributeError):
        return False


class _Arena:
    """The packed weights, one after another in the order a step reads them, in a few large
    buffers aligned to 2 MB and backed by transparent huge pages (advise_huge). Each layer's
    matrices are a few hundred KB apiece, under the 4 MB from which numpy asks for huge pages
    itself, so held as separate arrays they sat on 4 KB pages scattered over the heap: a step
    streaming ~110 MB of weights then takes a TLB miss every 4 KB (a two-level page walk in a
    virtual machine), and the hardware prefetchers stop at every 4 KB boundary."""

    CHUNK = 32 << 20

    def __init__(self) -> None:
        self.chunks: list[np.ndarray] = []
        self.free = 0  # bytes left in the last chunk
        self.used = 0
        self.advised = 0  # chunks the kernel took the huge-page advice for

    def put(self, a: np.ndarray | None) -> np.ndarray | None:
        """A copy of ``a`` (C order, 64-byte aligned) inside the arena."""
        if a is None:
            return None
        a = np.ascontiguousarray(a)
        n = -(-a.nbytes // 64) * 64
        if n > self.free:
            size = max(self.CHUNK, -(-n // HUGE) * HUGE)
            raw = np.empty(size + HUGE, np.uint8)  # untouched: pages come on the first copy
            off = -raw.ctypes.data % HUGE
            self.chunks.append(raw[off:off + size])
            self.advised += advise_huge(self.chunks[-1])
            self.free = size
        buf = self.chunks[-1]
        at = buf.nbytes - self.free
        out = buf[at:at + a.nbytes].view(a.dtype).reshape(a.shape)
        out[...] = a
        self.free -= n
        self.used += n
        return out


class _Graph:
    """The tensors of a package graph by name: initializers (external ones memory-mapped) and
    Constant nodes' values."""

    def __init__(self, path: Path) -> None:
        import onnx
        from onnx import numpy_helper
        self.model = onnx.load(str(path), load_external_data=False)
        self.root, self._np = path.parent, numpy_helper
        self.inits = {t.name: t for t in self.model.graph.initializer}
        self.consts = {n.output[0]: n for n in self.model.graph.node if n.op_type == "Constant"}

    def array(self, name: str) -> np.ndarray:
        t = self.inits.get(name)
        if t is None:
            node = self.consts.get(name)
            if node is None:
                raise KeyError(name)
            return self._np.to_array(node.attribute[0].t)
        if t.data_location != 1:  # onnx.TensorProto.EXTERNAL
            return self._np.to_array(t)
        info = {e.key: e.value for e in t.external_data}
        dtype = self._np.helper.tensor_dtype_to_np_dtype(t.data_type)
        return np.asarray(np.memmap(self.root / info["location"], dtype=dtype, mode="r",
                                    offset=int(info.get("offset", 0)), shape=tuple(t.dims)))


def _attrs(node) -> dict:
    from onnx import helper
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


class NativeBackend:
    """An int4 package on edgemtp's own C decoder (CPU only). ``threads``: OpenMP threads
    (default: OpenMP's, all cores). ``kv_cache``: the K/V cache's element (:data:`KV_CACHES`;
    default fp16). Same interface as the other backends."""

    name = "native"

    def __init__(self, package_dir, device: str = "cpu", threads: int | None = None,
                 max_context: int | None = None, dtype: str | None = None,
                 trust_remote_code: bool = False, check: bool = True,
                 kv_cache: str = "fp16") -> None:
        check_options(device, dtype, max_context, threads)
        if kv_cache not in KV_CACHES:
            raise ConfigError(f"kv cache must be one of {', '.join(KV_CACHES)}, got "
                              f"{kv_cache!r}")
        self.kv_cache = kv_cache
        kind, _ = parse_device(device)  # (a malformed device: the grammar's one line)
        if kind != "cpu":
            other = "--backend onnxruntime or torch" if kind == "cuda" else \
                "--backend onnxruntime (its TensorRT provider), or --backend tensorrt --device cuda"
            raise ConfigError(f"the native backend runs on the CPU; for --device {device} use "
                              f"{other}")
        lib = native.decoder_lib()
        if lib is None:
            raise BackendUnavailableError(f"the native backend needs its C decoder, which "
                                          f"could not be built: {native.decoder_why_not()}")
        self.lib = lib
        self.package = pkg = load_package(package_dir)
        m, where = pkg.manifest, f"the package {str(pkg.root)!r}"
        w = pkg.weights
        if w.format != "int4" or (w.block_size or BLOCK) != BLOCK:
            raise NativeUnsupported(f"the native backend runs int4 packages (block size 32); "
                                    f"{where} holds {w.name} weights: use --backend "
                                    f"onnxruntime, or export with --dtype int4")
        if dtype is not None and dtype != m["dtype"]:
            raise ConfigError(f"{where} computes in {m['dtype']} ({w.name} weights), and a "
                              f"package's dtype is fixed at export; drop --dtype {dtype}")
        if kv_cache == "int8" and int(m["head_dim"]) > 256:
            raise ConfigError(f"--kv-cache int8 takes heads of up to 256 dimensions; {where} "
                              f"has {m['head_dim']}: use --kv-cache fp16")
        self.vocab_size, self.hidden_size = m["vocab_size"], m["hidden_size"]
        self.eos_token_ids = tuple(int(e) for e in m["eos_token_ids"])
        self.topk = min(int(m["topk"]), 64)
        self.has_tokenizer = bool(m.get("tokenizer", True))
        source = m.get("source")
        self.source = source if source and (Path(source) / "config.json").is_file() else None
        limit = int(m["max_context"])
        self.max_context = limit if max_context is None else min(limit, int(max_context))
        self.device, self.threads = device, threads
        self.supports_hidden = True
        self.probe: dict | None = None  # the load check's figures (see _check_against_graph)
        self._table = pkg.embedding_table()
        self._stats = (np.asarray(m["embeddings"]["mu"], dtype=np.float32),
                       np.asarray(m["embeddings"]["sigma"], dtype=np.float32))
        self._keep: list = []  # every array the C structs point into
        self._load_weights(m, where)
        if check:
            self._check_against_graph()

    # -- loading ----------------------------------------------------------------------------

    def _load_weights(self, m: dict, where: str) -> None:
        g = _Graph(self.package.graph_path)
        # the graph's inputs and outputs against the manifest, as the onnxruntime backend
        # checks them (the load check below that runs it is skipped once it has passed)
        self.package.check_graph_io(*(graph_io(v) for v in (g.model.graph.input,
                                                             g.model.graph.output)))
        self.package.check_rotary(self.max_context, g.model)  # (positions past it clamped)
        L, d, H, Hkv, D = (m["num_layers"], m["hidden_size"], m["num_heads"],
                           m["num_kv_heads"], m["head_dim"])
        nodes = [n for n in g.model.graph.node if n.op_type == "MatMulNBits"]
        rot = [n for n in g.model.graph.node if n.op_type == "RotaryEmbedding"]
        gather = [n for n in g.model.graph.node if n.op_type == "GatherBlockQuantized"]
        skip = [n for n in g.model.graph.node if n.op_type == "SkipSimplifiedLayerNormalization"]
        ops = {n.op_type for n in g.model.graph.node}
        unknown = ops & {"SimplifiedLayerNormalization", "LayerNormalization", "Gelu",
                         "FastGelu", "Tanh"}
        # the embedding: a tied model's int4/int8 table, which the graph gathers from, or an
        # untied model's float32 rows (embeddings.npy), which the host gathers
        float_rows = getattr(self._table, "_bits", None) is None
        if (m.get("family") not in FAMILIES or len(nodes) != 4 * L + 1 or len(rot) != 2 * L
                or len(gather) != (0 if float_rows else 1) or len(skip) != 2 * L or unknown
                or H % Hkv or d % 16 or D % 8):
            raise NativeUnsupported(f"the native backend runs Llama-style int4 packages ("
                              f"{', '.join(FAMILIES)}: fused q/k/v and gate/up, rotate-half "
                              f"rotary, RMSNorm, a tied int4 or an untied float32 embedding); "
                              f"{where} is a {m.get('family')} graph it does not know: use "
                              f"--backend onnxruntime")

        half: list[bool] = []
        branches = offset_branches(g.model.graph)
        self.kept_blocks = 0  # products holding a GGUF file's Q4_1 blocks (offsets)

        def mat(node, n_out: int, k_in: int, eight: bool = False) -> Q4W:
            a = _attrs(node)
            if eight and a.get("bits") == 8:
                return mat8(node, a, n_out, k_in)
            if (a.get("bits") != 4 or a.get("block_size") != BLOCK or a.get("N") != n_out
                    or a.get("K") != k_in or len(node.input) < 3):
                raise NativeUnsupported(f"{where}: {node.name} is not a {k_in} -> {n_out} int4 "
                                  f"product in blocks of 32 (the native backend reads the graph in "
                                  f"layer order); use --backend onnxruntime")
            b = g.array(node.input[1])
            nb = b.shape[1]
            q = _unpack(b.reshape(n_out, -1), 4)[:, :nb * BLOCK]
            scales = g.array(node.input[2]).reshape(n_out, nb)
            if len(node.input) > 3 and node.input[3]:
                zp = _unpack(g.array(node.input[3]).reshape(n_out, -1), 4)[:, :nb]
            else:
                zp = np.full((n_out, nb), 8, np.uint8)
            branch = branches.get(node.name)
            offsets = None
            if branch is not None:  # a GGUF file's Q4_1 blocks: d q + m
                offsets = g.array(branch.offsets).T
                shift = None if branch.shift is None else g.array(branch.shift).reshape(-1)
                if shift is not None and shift.size == 1:
                    shift = np.full(n_out, shift[0], np.float32)
                if offsets.shape != (n_out, nb) or (shift is not None and (
                        shift.shape != (n_out,) or not np.isin(shift, (0, 8)).all()
                        or (zp[shift == 8] != 8).any())):
                    raise NativeUnsupported(f"{where}: {node.name}'s block offsets are "
                                      f"{list(offsets.shape)}, not [{n_out}, {nb}], or its "
                                      f"shift is not 0 or 8 a row; use --backend onnxruntime")
                if shift is not None:  # d (q - 8) + (m + 8 d) is d q + m: sums of x8 times m
                    zp = np.where(shift[:, None] == 8, 0, zp).astype(np.uint8)
                outputs[node.name] = branch.add.output[0]
                self.kept_blocks += 1
            try:
                G, nb, w, sc, z, mn = pack_q4(q, scales, zp, offsets)
            except ValueError as e:
                raise NativeUnsupported(f"{where}: {node.name}: {e}; use --backend onnxruntime") \
                    from None
            w, sc, z, mn = (arena.put(x) for x in (w, sc, z, mn))  # (the arena keeps them)
            half.append(sc.dtype == np.float16)
            if sc.dtype == np.float16:
                return Q4W(G, nb, w.ctypes.data, None, _ptr(z), sc.ctypes.data, _ptr(mn), 4)
            return Q4W(G, nb, w.ctypes.data, sc.ctypes.data, _ptr(z), None, _ptr(mn), 4)

        def mat8(node, a: dict, n_out: int, k_in: int) -> Q4W:
            """An 8-bit product (a GGUF's Q8_0 LM head) as decoder.c's one plane of bytes
            (Q4W.bits 8): [G][nb][8][16][4], chunk k's bytes r*4 .. r*4 + 3 inputs 4k .. 4k + 3
            of column 16g + r; zero points only where some are not 128."""
            if a.get("block_size") != BLOCK or a.get("N") != n_out or a.get("K") != k_in:
                raise NativeUnsupported(f"{where}: {node.name} is not a {k_in} -> {n_out} 8-bit "
                                  f"product in blocks of 32; use --backend onnxruntime")
            b = g.array(node.input[1])
            nb = b.shape[1]
            u = np.asarray(b).reshape(n_out, -1)[:, :nb * BLOCK]
            scales = g.array(node.input[2]).reshape(n_out, nb).astype(np.float32)
            if len(node.input) > 3 and node.input[3]:
                z = np.asarray(g.array(node.input[3])).reshape(n_out, -1)[:, :nb]
            else:
                z = np.full((n_out, nb), 128, np.uint8)
            G = -(-n_out // 16)
            up = np.zeros((G * 16, nb * BLOCK), np.uint8)
            up[:n_out] = u
            w8 = np.ascontiguousarray(up.reshape(G, 16, nb, 8, 4).transpose(0, 2, 3, 1, 4))
            sc, zq = pack_scales(scales, G), None
            if (z != 128).any():  # (decoder.c: an 8-bit plane without zero points takes 128)
                zq = pack_scales(z, G, np.uint8)
            w8, sc, zq = (arena.put(x) for x in (w8, sc, zq))
            half.append(sc.dtype == np.float16)
            h16 = sc.dtype == np.float16
            self.head_bits = 8
            return Q4W(G, nb, w8.ctypes.data, None if h16 else sc.ctypes.data, _ptr(zq),
                       sc.ctypes.data if h16 else None, None, 8)

        self.head_bits = 4
        arena = self.arena = _Arena()
        outputs: dict[str, str] = {}  # a product's output, after its offset branch's Add
        F = _attrs(nodes[2]).get("N", 0) // 2
        qkv, o, gu, down = (Q4W * L)(), (Q4W * L)(), (Q4W * L)(), (Q4W * L)()
        for i in range(L):
            qkv[i] = mat(nodes[4 * i], (H + 2 * Hkv) * D, d)
            o[i] = mat(nodes[4 * i + 1], d, H * D)
            gu[i] = mat(nodes[4 * i + 2], 2 * F, d)
            down[i] = mat(nodes[4 * i + 3], d, F)
        lm = mat(nodes[-1], self.vocab_size, d, eight=True)
        # "fp16": every matrix's scales held as halves (a package exported since they are
        # rounded so); "fp32": some or all as floats (an older export)
        self.scales = "fp16" if all(half) else "fp32"

        def f32(a) -> np.ndarray:
            a = np.ascontiguousarray(a, dtype=np.float32)
            self._keep.append(a)
            return a

        names = [f"decoder.model.layers.{i}.{k}.weight" for i in range(L)
                 for k in ("input_layernorm", "post_attention_layernorm")]
        try:
            norms = [g.array(n) for n in names] + [g.array("decoder.model.norm.weight")]
        except KeyError as e:
            raise NativeUnsupported(f"{where}: the graph has no norm weight {e.args[0]!r}; use "
                              f"--backend onnxruntime") from None
        norm_in, norm_post = f32(np.stack(norms[0:2 * L:2])), f32(np.stack(norms[1:2 * L:2]))
        # Qwen2: a bias added to the fused q/k/v product (an Add reading its output and a
        # constant of its width); Qwen3: per-head RMSNorm weights of q and k
        users: dict[str, list] = {}
        for n in g.model.graph.node:
            for i in n.input:
                users.setdefault(i, []).append(n)
        consts = {i.name: i.name for i in g.model.graph.initializer}
        for n in g.model.graph.node:  # an initializer the export shared with another one
            if n.op_type == "Identity" and n.input and n.input[0] in consts:
                consts[n.output[0]] = consts[n.input[0]]
        biases = []
        for i in range(L):
            out = outputs.get(nodes[4 * i].name, nodes[4 * i].output[0])
            add = [n for n in users.get(out, []) if n.op_type == "Add"]
            c = [consts[x] for n in add for x in n.input if x in consts]
            if c:
                b = g.array(c[0]).reshape(-1)
                if b.size != (H + 2 * Hkv) * D:
                    raise NativeUnsupported(f"{where}: layer {i}'s q/k/v bias has {b.size} values, "
                                      f"not {(H + 2 * Hkv) * D}; use --backend onnxruntime")
                biases.append(b)
        if biases and len(biases) != L:
            raise NativeUnsupported(f"{where}: q/k/v biases in {len(biases)} of {L} layers; use "
                              f"--backend onnxruntime")
        qkv_bias = f32(np.stack(biases)) if biases else None
        qn = [f"decoder.model.layers.{i}.self_attn.{k}_norm.weight" for i in range(L)
              for k in ("q", "k")]
        have = [n in consts for n in qn]
        if any(have) and not all(have):
            raise NativeUnsupported(f"{where}: q/k norm weights in some layers only; use --backend "
                              f"onnxruntime")
        q_norm = k_norm = None
        if all(have):
            q_norm = f32(np.stack([g.array(n).reshape(-1) for n in qn[0::2]]))
            k_norm = f32(np.stack([g.array(n).reshape(-1) for n in qn[1::2]]))
            if q_norm.shape != (L, D) or k_norm.shape != (L, D):
                raise NativeUnsupported(f"{where}: q/k norm weights are not {D} wide; use "
                                        f"--backend onnxruntime")
        norm_final = f32(norms[-1])
        qa, ka = _attrs(rot[0]), _attrs(rot[1])
        if qa.get("interleaved", 0) or ka.get("num_heads") != Hkv or qa.get("num_heads") != H:
            raise NativeUnsupported(f"{where}: the rotary embedding is not rotate-half over q then "
                              f"k; use --backend onnxruntime")
        cos, sin = f32(g.array(rot[1].input[2])), f32(g.array(rot[1].input[3]))
        qcos = g.array(rot[0].input[2])
        # q's tables may carry the softmax scale (a power of two, exact): cos(0) = 1
        scale = float(qcos[0, 0]) if not np.array_equal(qcos, cos) else D ** -0.5
        eps = float(_attrs(skip[0]).get("epsilon", 1e-5))
        t = self._table  # the manifest's table: block-quantized (the graph gathers from it)
        #                  or, untied, float32 rows
        if float_rows:
            rows = getattr(t, "_table", None)
            if rows is None or rows.dtype != np.float32 or rows.shape != (self.vocab_size, d):
                raise NativeUnsupported(f"{where}: the embedding table is not float32 "
                                        f"[{self.vocab_size}, {d}]; use --backend onnxruntime")
            # (the memory map as it is: C order, read a row at a time, never copied)
            emb_q, emb_sc, emb_zp, emb_bits = np.ascontiguousarray(rows), f32(np.zeros(1)), \
                None, 32
        elif t._bits not in (4, 8) or t._bs != BLOCK:
            raise NativeUnsupported(f"{where}: the embedding table is not int4 or int8 in "
                                    f"blocks of 32; use --backend onnxruntime")
        else:
            emb_q, emb_sc = np.ascontiguousarray(t._data), f32(t._scales)
            emb_zp = None if t._zp is None else np.ascontiguousarray(t._zp)
            emb_bits = t._bits
        self._keep += [emb_q, emb_zp, qkv, o, gu, down, lm]
        self.model = _Model(L=L, d=d, H=H, Hkv=Hkv, D=D, F=F, V=self.vocab_size,
                            rope_rows=cos.shape[0], threads=self.threads or 0, eps=eps,
                            scale=scale, cos=cos.ctypes.data, sin=sin.ctypes.data,
                            norm_in=norm_in.ctypes.data, norm_post=norm_post.ctypes.data,
                            norm_final=norm_final.ctypes.data,
                            qkv=ctypes.addressof(qkv), o=ctypes.addressof(o),
                            gu=ctypes.addressof(gu), down=ctypes.addressof(down),
                            lm=ctypes.addressof(lm), emb_q=emb_q.ctypes.data,
                            emb_sc=emb_sc.ctypes.data,
                            qkv_bias=None if qkv_bias is None else qkv_bias.ctypes.data,
                            q_norm=None if q_norm is None else q_norm.ctypes.data,
                            k_norm=None if k_norm is None else k_norm.ctypes.data,
                            emb_zp=None if emb_zp is None else emb_zp.ctypes.data,
                            emb_bits=emb_bits)
        self.dims = (L, Hkv, D)
        # a row's LM head against the whole row, in the kernel's products: auto's price of a
        # prompt row's outputs (drafters/auto.py). An 8-bit head takes as many as a 4-bit one
        # where a product reads a byte whole (VNNI, Arm, portable C), twice as many on AVX2
        # (each byte's two nibbles)
        body = L * d * ((H + 2 * Hkv) * D + H * D + 3 * F)
        twice = self.head_bits == 8 and self.lib.decoder_kernel() == 3
        head = self.vocab_size * d * (2 if twice else 1)
        self.lm_row_share = head / (head + body)

    def _check_against_graph(self) -> None:
        """Once per package and library: the decoder's logits on a probe block against the
        package's onnxruntime graph (the self-check's tolerance, scaled to the int8
        activations both round to), and the same greedy tokens."""
        from edgemtp.latency import cache_dir
        st = self.package.graph_path.stat()
        lib_path = getattr(self.lib, "_name", "")
        key = hashlib.sha256(f"{self.package.graph_path.resolve()}|{st.st_size}|"
                             f"{st.st_mtime_ns}|{lib_path}".encode()).hexdigest()[:20]
        mark = cache_dir() / "native_checked" / f"{key}.json"
        if mark.is_file():
            try:
                self.probe = json.loads(mark.read_text())
                return
            except ValueError:
                pass
        from edgemtp.runtimes.onnxrt_backend import OrtBackend
        ort = OrtBackend(self.package.root, threads=self.threads, max_context=self.max_context)
        v, n = self.vocab_size, 16
        rng = np.random.default_rng(0)
        ids = rng.integers(0, v, n).astype(np.int64)
        ids[-2:] = [v, v + 1]  # two mask rows
        pos = np.arange(n, dtype=np.int64)
        pos[-2:] = [n - 2, n - 1]
        mask = np.tril(np.ones((n, n), dtype=np.bool_))
        embeds = self.embed(ids[:2]) * 0.5
        outs = []
        for b in (self, ort):
            s = b.session()
            outs.append(s.forward(ids, pos, mask, embeds, topk=0, full_logits=True))
        a, r = outs[0].logits, outs[1].logits
        rows = np.abs(a - r).max(1) / np.maximum(1.0, np.abs(r).max(1))
        diff = float(np.median(rows))
        same = float(np.mean(outs[0].argmax == outs[1].argmax))
        # both round activations to int8 per block of 32, at different points and so
        # differently: the rows differ by ~1-5 % of their logit scale (a graph read wrong: by
        # the whole scale, its greedy tokens by chance)
        if not np.isfinite(diff) or diff > MAX_DIFF or same < MIN_SAME:
            raise ModelLoadError(
                f"the native decoder disagrees with the package's graph on a probe block "
                f"(median row logit difference {diff:.3g} of the logit scale, greedy tokens "
                f"{same:.0%} the same): the graph is not one it reads right; use --backend "
                f"onnxruntime")
        mark.parent.mkdir(parents=True, exist_ok=True)
        self.probe = {"max_diff": diff, "argmax_same": same}
        mark.write_text(json.dumps({**self.probe, "package": str(self.package.root)}))

    # -- interface --------------------------------------------------------------------------

    def check_step(self, topk: int, hidden: bool) -> None:
        check_step(self, topk, hidden)

    def identity(self) -> str:
        st = self.package.graph_path.stat()
        kv = "" if self.kv_cache == "fp16" else f"kv={self.kv_cache}|"
        # (the decoder's build too: a new kernel's curve is measured again, not read back;
        # and how the weights are laid out: the huge-page arena made t(1) 8-12 % cheaper and
        # wide blocks 1-3 %, so a curve from before it overrated every block)
        return (f"native|threads={self.threads}|ctx={self.max_context}|{kv}{WEIGHTS_LAYOUT}|"
                f"{self.package.graph_path.resolve()}|{st.st_size}|{st.st_mtime_ns}|"
                f"{native.decoder_build()}")

    def session(self, rows: int | None = None) -> "NativeSession":
        return NativeSession(self, rows)

    def embed(self, token_ids) -> np.ndarray:
        return self._table.rows(np.asarray(token_ids, dtype=np.int64))

    def cache_bytes(self, kv_cache: str | None = None, rows: int | None = None) -> int:
        """:func:`cache_bytes` for this model at ``rows`` (default: the max context) and
        ``kv_cache`` (default: this backend's); a session takes all of it (see
        :class:`NativeSession`)."""
        return cache_bytes(*self.dims, self.max_context if rows is None else rows,
                           kv_cache or self.kv_cache)

    def embedding_stats(self) -> tuple[np.ndarray, np.ndarray]:
        return self._stats


class NativeSession:
    """One generation on a :class:`NativeBackend`: its K/V cache (keys in transposed blocks of
    16 positions, see decoder.c) as numpy arrays the C code writes in place."""

    def __init__(self, backend: NativeBackend, rows: int | None = None) -> None:
        self.backend = b = backend
        L, Hkv, D = b.dims
        self.rows = b.max_context if rows is None else max(1, min(int(rows), b.max_context))
        cap = -(-(self.rows + MARGIN) // 16) * 16
        # np.zeros: mapped as written, but numpy asks for transparent huge pages for arrays
        # of 4 MB or more, so a short generation's first rows in every (layer, KV head) run
        # touch the whole cache (SmolLM2 at 2048 rows: +49 MiB after 8 tokens; 4 KB pages
        # kept it to +5 MiB but made a step at 2048 rows 1.04-1.07x slower, float16 cache).
        # Keys in blocks of 16 positions, each block transposed (see decoder.c), in half
        # precision (as llama.cpp's default cache) or int8, rounded once when written
        q8 = b.kv_cache == "int8"
        el = np.int8 if q8 else np.float16
        self.k = np.zeros((L, Hkv, cap // 16, D, 16), el)
        # values in 32-lane chunks, each its own [cap][32] run (see decoder.c vidx); int8:
        # in each chunk the rows in pairs, lane by lane side by side (vidx8)
        vw = 32 if D % 32 == 0 else D
        self.v = np.zeros((L, Hkv, D // vw, cap // 2, vw, 2) if q8 else (L, Hkv, D // vw, cap, vw),
                          el)
        # int8: a scale per key row and KV head, and per value row and 32-lane chunk
        self.ks = np.zeros((L, Hkv, cap), np.float32) if q8 else None
        self.vs = np.zeros((L, Hkv, D // vw, cap), np.float32) if q8 else None
        self.cache = _Cache(self.k.ctypes.data, self.v.ctypes.data, cap, 0,
                            None if self.ks is None else self.ks.ctypes.data,
                            None if self.vs is None else self.vs.ctypes.data)
        self._work = np.zeros(0, np.float32)
        self._work_t = 0
        self._no_masks = np.zeros((1, b.hidden_size), np.float32)
        # the step's call, its by-reference arguments and the addresses that do not change,
        # made once: a step's Python around the C call measured ~100 us right after a forward
        # (caches cold), 62 of it building the call and asking numpy for 8 addresses
        self._call = _Call()
        self._refs = (ctypes.byref(b.model), ctypes.byref(self.cache), ctypes.byref(self._call))
        self._work_at = self._no_masks_at = native.address(self._no_masks)
        self._mask: tuple = (None, 0)  # the last caller's tree mask and its address
        self.last_run_s = 0.0

    @property
    def cache_len(self) -> int:
        return self.cache.len

    rows_from = True  # forward() takes rows_from (the engine's prefill asks it, see there)

    def forward(self, input_ids, position_ids, tree_mask, mask_embeds, topk: int = 0,
                full_logits: bool = False, hidden: bool = False, rows_from: int = 0) -> StepOut:
        """As every session's; ``rows_from``: rows before it get no LM head (argmax -1, top-K
        ids 0 and log-probs -inf; ignored when full logits are asked): a prefill's prompt
        rows, for a drafter that reads none of them (the LM head is a fifth of a row's
        weights, its log-softmax a few per cent more)."""
        b = self.backend
        b.check_step(topk, hidden)
        ids = np.ascontiguousarray(input_ids, dtype=np.int64)
        pos = np.ascontiguousarray(position_ids, dtype=np.int64)
        t = len(ids)
        mask = np.ascontiguousarray(tree_mask, dtype=np.bool_).reshape(t, t)
        if self.cache.len + t > self.cache.cap:
            raise ConfigError(f"a block of {t} rows after {self.cache.len} cached ones overruns "
                              f"the KV cache ({self.rows} rows)")
        if t > self._work_t:
            n = b.lib.decoder_scratch(ctypes.byref(b.model), t, self.cache.cap,
                                         int(self.ks is not None))
            self._work, self._work_t = np.zeros(n, np.float32), t
            self._work_at = native.address(self._work)
        address = native.address
        if mask_embeds is None:
            n_mask, embeds_at = 1, self._no_masks_at
        else:
            embeds = np.ascontiguousarray(mask_embeds, dtype=np.float32)
            n_mask, embeds_at = len(embeds), address(embeds)
        owner = getattr(tree_mask, "base", None)  # (numpy points a view's base at the owner)
        if mask.base is not tree_mask and (owner is None or mask.base is not owner):
            mask_at = address(mask)  # (a converted copy: its own address, this step only)
        else:  # the caller's array itself: a plan's, the same object step after step
            if tree_mask is not self._mask[0]:
                self._mask = (tree_mask, address(mask))
            mask_at = self._mask[1]
        argmax = np.empty(t, np.int64)
        top_ids = np.empty((t, topk), np.int64)
        top_lp = np.empty((t, topk), np.float32)
        logits = np.empty((t, b.vocab_size), np.float32) if full_logits else None
        hid = np.empty((t, b.hidden_size), np.float32) if hidden else None
        skip = 0 if full_logits else min(max(int(rows_from), 0), t)
        call = self._call
        call.T, call.topk, call.rows_from, call.n_mask = t, topk, skip, n_mask
        call.ids, call.pos, call.mask, call.mask_embeds = (address(ids), address(pos), mask_at,
                                                           embeds_at)
        call.argmax, call.topk_ids, call.topk_lp = (address(argmax), address(top_ids),
                                                    address(top_lp))
        call.logits = None if logits is None else address(logits)
        call.hidden = None if hid is None else address(hid)
        t0 = perf_counter()
        rc = b.lib.decoder_forward(*self._refs, self._work_at)
        self.last_run_s = perf_counter() - t0
        if rc:
            raise ConfigError(f"the native decoder refused a block of {t} rows (code {rc})")
        if skip:
            argmax[:skip], top_ids[:skip], top_lp[:skip] = -1, 0, -np.inf
        return StepOut(argmax=argmax, topk_ids=top_ids, topk_logprobs=top_lp, logits=logits,
                       hidden=hid)

    def commit(self, rows) -> None:
        n = len(rows)
        if self.cache.len + n > self.rows:
            raise ConfigError(f"committing {n} rows overruns the KV cache "
                              f"({self.cache.len} of {self.rows} rows used)")
        if n and int(rows[0]) == 0 and int(rows[-1]) == n - 1:  # (ascending: 0 .. n - 1)
            # already in place (a plain step, a prefill chunk, a path of first children): no
            # C call. (That call timed 30-50 us a plain step, cache-cold after a forward pass,
            # but skipping it left greedy and auto at 1.00x and 0.99x tok/s on Spec-Bench:
            # the next code touched pays the same cache misses.)
            self.cache.len += n
            return
        rows = np.ascontiguousarray(rows, dtype=np.int64)
        self.backend.lib.decoder_commit(ctypes.byref(self.backend.model),
                                        ctypes.byref(self.cache), rows.ctypes.data, n)

    def reset(self) -> None:
        self.cache.len = 0
