"""The exported package on disk: what ``edgemtp export`` writes and every package backend
reads. Numpy only, so a device that runs packages never imports torch.

::

    out/<name>/
      edgemtp.json     manifest (:class:`Manifest`: format version, dims, EOS ids, dtype, max
                       context, graph I/O names, cache layout, plans, embedding statistics,
                       the byte size and sha256 of every file the export wrote)
      model.onnx       one decoder graph for prefill, plain decoding and tree steps
      model.onnx.data  external weights (large models only)
      kv_commit.onnx   gathers accepted K/V rows into a device-resident cache (CUDA, TensorRT)
      embeddings.npy   the input embedding table [V, d], for host-side mask initialisation
                       (none in a quantized package of a tied model: the host reads the
                       graph's own block-quantized table from model.onnx.data)
      plans/bc30_k1.npz   static and every dynamic plan of one budget: masks, positions, parents
      tokenizer.json, tokenizer_config.json, ...
      engines/sm87_trt10.3.0.engine   TensorRT engines, one per GPU architecture and TensorRT
                       version (``edgemtp build-engine``; optional, listed under ``engines``)

:func:`load_package` verifies everything a generation would load (every recorded file whole,
the embedding table, the tokenizer files, every plan) and says in one line what is wrong
(:class:`ModelLoadError`), so ``edgemtp inspect`` fails exactly where ``generate`` would. The
plans it reads become the plans the runtime uses (:func:`edgemtp.plans.install`).
"""

from __future__ import annotations

import hashlib
import json
import math
import zipfile
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from functools import lru_cache
from pathlib import Path, PurePosixPath
from types import MappingProxyType, UnionType
from typing import ClassVar, Union, get_args, get_origin, get_type_hints

import numpy as np

from edgemtp.errors import ConfigError, ModelLoadError
from edgemtp.plans import DynamicPlans, Plan, dynamic_plans, install, static_plan
from edgemtp.runtimes.heads import HeadsInfo
from edgemtp.runtimes.host_table import EmbeddingTable

FORMAT_VERSION = 2  # 2: the graph takes past_len (format 1 graphs attend to all past rows)
MANIFEST = "edgemtp.json"
GRAPH = "model.onnx"
COMMIT = "kv_commit.onnx"  # gathers accepted K/V rows into a device-resident cache
EMBEDDINGS = "embeddings.npy"
ENGINES = "engines"  # TensorRT engines (and their timing caches) built on a device
CACHE_LAYOUT = "[1, P, H_kv, D] per layer, sequence-major"
# --cache-layout head (fp32/fp16 packages for onnxruntime's CPU provider): each KV head's rows
# contiguous, read faster on long contexts (bench/results/attention_layout_cpu.md)
HEAD_MAJOR = "[1, H_kv, P, D] per layer, head-major"
CACHE_LAYOUTS = {"seq": CACHE_LAYOUT, "head": HEAD_MAJOR}
NP_DTYPES = {"fp32": np.float32, "fp16": np.float16}
# the graph's weights: float as the activations, or weight-only block-quantized (MatMulNBits)
WEIGHT_FORMATS = ("fp32", "fp16", "int4", "int8")
EMBEDDING_LAYOUTS = ("npy", "block-quantized", "graph-rows")
# a float package's embedding table at least this big is read by the host from the graph's
# weights file (model.onnx.data, then written whatever the weights' size) rather than stored
# again in embeddings.npy: SmolLM2-135M fp16, 56 MB of 325
HOST_TABLE_BYTES = 4 << 20
HASH_LIMIT = 4 * 2**20  # files up to this size get a sha256 in the manifest, checked at load
# files a Hugging Face tokenizer may be saved as (an older package names none of its own)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json",
                   "vocab.txt", "spiece.model", "merges.txt")

FIXED_INPUTS = ("input_ids", "position_ids", "tree_mask", "mask_embeds")
PAST_LEN = "past_len"  # [1] int64 after the past K/V: rows of the bound past that are cache
FIXED_OUTPUTS = ("topk_ids", "topk_logprobs", "argmax", "logits")
HIDDEN = "hidden_states"  # [1, T, d] after the final norm, last output (export --hidden-states)


def kv_names(prefix: str, layers: int) -> list[str]:
    """``prefix_key_0, prefix_value_0, prefix_key_1, ...``: the graph's per-layer K/V order."""
    return [f"{prefix}_{kv}_{i}" for i in range(layers) for kv in ("key", "value")]


def graph_inputs(layers: int) -> list[str]:
    return [*FIXED_INPUTS, *kv_names("past", layers), PAST_LEN]


def graph_outputs(layers: int, hidden: bool = False) -> list[str]:
    return [*FIXED_OUTPUTS, *kv_names("present", layers), *([HIDDEN] if hidden else [])]


def plan_file(bc: int, k: int) -> str:
    return f"plans/bc{bc}_k{k}.npz"


def check_step(backend, topk: int, hidden: bool) -> None:
    """What a step asks of a package backend's graph: top-K within what it exports
    (``backend.topk``), hidden states only if it has them (``backend.supports_hidden``)."""
    if topk > backend.topk:
        meta = backend.package.meta
        plans = ", ".join(f"bc {p.bc} k {p.k}" for p in meta.plans)
        raise ConfigError(f"top-{topk} candidates asked, but the package's graph exports "
                          f"top-{backend.topk}, what its plans need ({plans}, at a max context "
                          f"of {meta.max_context}); probing with one mask token fits it up to "
                          f"--bc {2 * backend.topk + 1}: run a smaller --bc, --drafter pld or "
                          f"stand, or re-export with the --bc, --mask-tokens (and "
                          f"--max-context) you run")
    if hidden and not backend.supports_hidden:
        raise ConfigError(f"the package {str(backend.package.root)!r} does not export the last "
                          f"hidden states; re-export it with them to run learned heads")


def is_package(path) -> bool:
    return (Path(path) / MANIFEST).is_file()


class ManifestError(ModelLoadError):
    """A manifest whose fields are missing, of the wrong type, or inconsistent."""


# -- plans ------------------------------------------------------------------------------------


def plan_arrays(bc: int, k: int) -> dict[str, np.ndarray]:
    """The static plan and every dynamic plan of one budget as arrays, for ``plans/*.npz``.

    >>> a = plan_arrays(8, 1)                  # N = 4: root + 3 depth-1 nodes, T = 8
    >>> a["static_mask"].shape, a["dynamic_shapes"].tolist(), a["static_positions"].tolist()
    ((8, 8), [[3]], [0, 1, 1, 1, 1, 2, 2, 2])
    """
    static = static_plan(bc, k)
    table = dynamic_plans(bc, k).table
    shapes = list(table)
    plans = [table[s] for s in shapes]
    return {
        "static_parents": np.array(static.parents, dtype=np.int64),
        "static_mask": static.tree_mask,
        "static_positions": static.positions,
        "dynamic_shapes": np.array(shapes, dtype=np.int64).reshape(len(shapes), k),
        "dynamic_parents": np.stack([np.array(p.parents, dtype=np.int64) for p in plans]),
        "dynamic_masks": np.stack([p.tree_mask for p in plans]),
        "dynamic_positions": np.stack([p.positions for p in plans]),
    }


@dataclass(frozen=True)
class BudgetPlans:
    """One budget's plans as a package ships them (``plans/bc{bc}_k{k}.npz``)."""

    bc: int
    k: int
    static: Plan
    dynamic: DynamicPlans


def _read_plans(root: Path, entry: PlanInfo) -> BudgetPlans:
    # the file must hold exactly the plans the runtime compiles for this budget, with the T
    # the manifest (and so the graph's plan shapes) declares; the plans are built from the
    # file's parents
    bc, k = entry.bc, entry.k
    label = f"plan bc={bc} k={k} ({entry.file})"
    arrays = _load_npz(root / entry.file, label)
    want = plan_arrays(bc, k)
    if set(arrays) != set(want):
        raise ModelLoadError(f"{label} holds arrays {sorted(arrays)}; expected {sorted(want)}")
    got_t = arrays["static_mask"].shape[-1]
    if got_t != entry.T or arrays["dynamic_masks"].shape[-1] != entry.T:
        raise ModelLoadError(f"{label} has T={got_t} positions but the manifest says "
                             f"T={entry.T} (= (k+1)*N = {want['static_mask'].shape[-1]}); "
                             f"re-export")
    for key, value in want.items():
        if arrays[key].shape != value.shape or not np.array_equal(arrays[key], value):
            raise ModelLoadError(f"{label}: {key} {list(arrays[key].shape)} does not match the "
                                 f"plan this runtime compiles {list(value.shape)}; re-export")
    table = {tuple(int(c) for c in shape): Plan(tuple(parents), k)
             for shape, parents in zip(arrays["dynamic_shapes"], arrays["dynamic_parents"])}
    return BudgetPlans(bc, k, Plan(tuple(arrays["static_parents"]), k),
                       DynamicPlans(bc, k, table=table))


def _load_npz(path: Path, label: str) -> dict[str, np.ndarray]:
    if not path.is_file():
        raise ModelLoadError(f"{label} is missing from the package {str(path.parent.parent)!r}")
    try:
        with np.load(path) as f:
            return {key: f[key] for key in f.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
        raise ModelLoadError(f"{label} cannot be read: {_first_line(e)}") from None


# -- manifest ---------------------------------------------------------------------------------


def _relative(name: str, key: str) -> str:
    """A file the manifest names must lie inside the package."""
    p = PurePosixPath(name)
    if not name or p.is_absolute() or ".." in p.parts:
        raise ManifestError(f"{key!r} must be a path inside the package, got {name!r}")
    return name


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ManifestError(message)


def _check_dtype(dtype: str, key: str) -> None:
    _check(dtype in NP_DTYPES, f"{key!r} must be one of {', '.join(NP_DTYPES)}, got {dtype!r}")


@dataclass(frozen=True, kw_only=True)
class GraphInfo:
    opset: int
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    file: str = GRAPH
    external_data: str | None = None
    commit_file: str = COMMIT
    # what the graph's Shape nodes read (graph inputs by name; None: not recorded, a package
    # from before 2026-11-26). onnxruntime's CUDA EP keeps shape arithmetic on the CPU and
    # then refuses a CUDA graph; the fixed-buffer session fixes the past's rows at load, so
    # a graph whose Shape nodes read only past_* inputs folds them all away
    shape_reads: tuple[str, ...] | None = None
    NOTES: ClassVar[dict] = {
        "mask_slots": "input ids >= vocab_size select row id - vocab_size of mask_embeds",
        "tree_mask": "block only [1, 1, T, T]; the graph prepends the cache columns"}

    def __post_init__(self) -> None:
        for key in ("file", "commit_file", "external_data"):
            if getattr(self, key) is not None:
                _relative(getattr(self, key), f"graph.{key}")


@dataclass(frozen=True, kw_only=True)
class CacheInfo:
    dtype: str
    layout: str = CACHE_LAYOUT
    # the values' dtype where it is not ``dtype``: "fp64" in a package with exact attention
    # sums (int4/int8), which add p @ V in float64 and so keep V in float64 (None: ``dtype``)
    value_dtype: str | None = None

    @property
    def head_major(self) -> bool:
        return self.layout == HEAD_MAJOR

    def __post_init__(self) -> None:
        _check(self.layout in CACHE_LAYOUTS.values(), f"'cache.layout' must be one of "
               f"{', '.join(repr(x) for x in CACHE_LAYOUTS.values())}, got {self.layout!r}")
        _check(self.layout == CACHE_LAYOUT or self.value_dtype is None,
               "a head-major cache is for packages without exact attention sums "
               "('cache.value_dtype' must be absent)")
        _check_dtype(self.dtype, "cache.dtype")
        _check(self.value_dtype in (None, "fp64"),
               f"'cache.value_dtype' must be absent or 'fp64', got {self.value_dtype!r}")


@dataclass(frozen=True, kw_only=True)
class PlanInfo:
    """The manifest's description of one budget's plans."""

    bc: int
    k: int
    T: int
    n_nodes: int
    static_counts: tuple[int, ...]
    dynamic_shapes: int
    file: str

    @classmethod
    def compile(cls, bc: int, k: int) -> PlanInfo:
        static = static_plan(bc, k)
        return cls(bc=bc, k=k, T=static.bc, n_nodes=static.n_nodes,
                   static_counts=static.counts, dynamic_shapes=len(dynamic_plans(bc, k)),
                   file=plan_file(bc, k))

    def __post_init__(self) -> None:
        label = f"plan bc={self.bc} k={self.k}"
        _check(self.k >= 1 and self.n_nodes >= 2 and self.T == (self.k + 1) * self.n_nodes
               and self.T <= self.bc and sum(self.static_counts) == self.n_nodes - 1,
               f"{label} is inconsistent: T={self.T}, N={self.n_nodes}, static counts "
               f"{list(self.static_counts)} (expected T = (k+1)*N <= bc and N-1 draft nodes)")
        _relative(self.file, f"{label} file")


SOFTMAX = ("float32", "float64", "exact")
# what inspect says of a package's attention sums (the float32 default says nothing)
INVARIANCE = {"exact": "; attention as exact sums (a row's bits do not depend on its block)",
              "float64": "; float64 attention (invariant on short contexts only: re-export)"}
ROW_CHUNK = 128  # MLAS's SQNBitGemm splits a MatMulNBits' rows into chunks of this many


def run_rows(t: int, min_rows: int) -> int:
    """How many rows a forward of ``t`` rows runs as. ``min_rows`` 2 (int4 ``MatMulNBits``):
    a chunk of one row takes the kernel's one-row path, which rounds differently, and MLAS
    cuts the rows into chunks of :data:`ROW_CHUNK` -- so one row runs as two, and a block of
    ``128 j + 1`` rows (a 769-token prefill) gets one throwaway row more."""
    if min_rows > 1 and t % ROW_CHUNK == 1:
        return t + 1
    return max(t, min_rows)


@dataclass(frozen=True, kw_only=True)
class WeightsInfo:
    """How the graph stores its weights. ``format`` fp32/fp16: as the activations; int4/int8:
    every MatMul weight ``MatMulNBits``, quantized along K in blocks of ``block_size``
    (``accuracy_level`` 4: activations quantized to int8 per block inside the kernel, 0 or 1:
    kept float32). ``tied_embedding``: the input embedding and the lm_head read one
    initializer. ``min_rows`` 2: the kernels take another path for one row, so the runtime
    runs a one-row forward as two (a throwaway copy second) and a row's logits never depend
    on the block it sits in (``export.quantize``)."""

    format: str
    block_size: int | None = None
    symmetric: bool = False
    accuracy_level: int | None = None
    tied_embedding: bool = False
    min_rows: int = 1  # a forward of fewer rows runs padded to this many (batch invariance)
    # the attention's sums: float32; float64 (exports before exact sums: invariant on short
    # contexts only); exact (export.graph.exact_sums: the same bits in any block)
    softmax: str = "float32"
    # rotary and residual + RMSNorm as onnxruntime's fused contrib ops (int4/int8 exports
    # from 2026-11-25 on: export.graph.ExportTreeDecoder.fuse)
    fused: bool = False
    # int4 from a GGUF file: how many of the graph's ``products`` (MatMulNBits) keep the file's
    # own Q4_0/Q4_1 blocks, a Q4_1 block's offsets as a float branch (export.gguf_blocks)
    kept_blocks: int = 0
    products: int = 0
    # int4 from a GGUF file that stores its LM head in more than 4 bits (its type: Q6_K, F16
    # ...; not Q8_0, whose blocks are kept): the head's values in 8-bit Q8_0 blocks
    # (export.gguf_blocks.FileBlocks.head8), not 4-bit ones
    head8_from: str | None = None

    def __post_init__(self) -> None:
        _check(self.format in WEIGHT_FORMATS, f"'weights.format' must be one of "
                                              f"{', '.join(WEIGHT_FORMATS)}, got {self.format!r}")
        quantized = self.format in ("int4", "int8")
        _check(quantized == (self.block_size is not None),
               f"'weights.block_size' is set for int4/int8 weights only, got "
               f"{self.block_size!r} for {self.format}")
        _check(self.min_rows in (1, 2), f"'weights.min_rows' must be 1 or 2, got "
                                        f"{self.min_rows!r}")
        _check(self.softmax in SOFTMAX, f"'weights.softmax' must be one of "
                                        f"{', '.join(SOFTMAX)}, got {self.softmax!r}")
        _check(0 <= self.kept_blocks <= self.products,
               f"'weights.kept_blocks' must be from 0 to 'weights.products' "
               f"({self.products!r}), got {self.kept_blocks!r}")
        _check(self.block_size is None or (self.block_size >= 16
                                           and self.block_size & (self.block_size - 1) == 0),
               f"'weights.block_size' must be a power of 2 >= 16, got {self.block_size!r}")

    @property
    def bits(self) -> int | None:
        return {"int4": 4, "int8": 8}.get(self.format)

    @property
    def name(self) -> str:
        """``int4-b32-asym-acc1``, or the float format."""
        if self.bits is None:
            return self.format
        return (f"{self.format}-b{self.block_size}-{'sym' if self.symmetric else 'asym'}"
                f"-acc{self.accuracy_level or 0}")


@dataclass(frozen=True, kw_only=True)
class TensorRef:
    """An array at ``offset`` bytes into a package file (the graph's external data)."""

    offset: int
    shape: tuple[int, ...]
    dtype: str  # numpy dtype name: float32, float16, uint8

    def __post_init__(self) -> None:
        _check(self.offset >= 0 and all(d >= 0 for d in self.shape)
               and self.dtype in ("float32", "float16", "uint8"),
               f"a tensor reference needs offset >= 0, sizes >= 0 and dtype float32, float16 or "
               f"uint8, got offset {self.offset}, shape {list(self.shape)}, {self.dtype!r}")

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize


@dataclass(frozen=True, kw_only=True)
class EmbeddingInfo:
    """The host's copy of the input embedding (mask initialisation). ``layout`` npy: the
    ``[V, d]`` table ``file`` (``embeddings.npy``); block-quantized: the graph's own tied
    table inside ``file`` (its external data), ``data [V, d*bits/8]`` uint8, ``scales
    [V, d/block_size]`` and ``zero_points`` (packed, low bits first), read row by row and
    de-quantized as ``GatherBlockQuantized`` does; graph-rows: the graph's own float table
    (an untied int4/int8 model's embedding, or a float package's, which its Gather reads),
    ``data [V, d]`` in the package's dtype inside ``file``, stored once rather than again in
    ``embeddings.npy``."""

    dtype: str
    mu: tuple[float, ...]
    sigma: tuple[float, ...]
    file: str = EMBEDDINGS
    layout: str = "npy"
    bits: int | None = None
    block_size: int | None = None
    data: TensorRef | None = None
    scales: TensorRef | None = None
    zero_points: TensorRef | None = None

    def __post_init__(self) -> None:
        _relative(self.file, "embeddings.file")
        _check_dtype(self.dtype, "embeddings.dtype")
        bad = [v for v in (*self.mu, *self.sigma) if not math.isfinite(v)]
        _check(not bad and min(self.sigma, default=0) >= 0,
               f"'embeddings.mu' and 'sigma' must be finite with sigma >= 0, got {bad[:1]}")
        _check(self.layout in EMBEDDING_LAYOUTS, f"'embeddings.layout' must be one of "
                                                 f"{', '.join(EMBEDDING_LAYOUTS)}, got "
                                                 f"{self.layout!r}")
        if self.layout == "block-quantized":
            _check(self.bits in (4, 8) and self.block_size is not None
                   and self.data is not None and self.scales is not None,
                   "a block-quantized embedding table needs 'bits' (4 or 8), 'block_size', "
                   "'data' and 'scales'")
        if self.layout == "graph-rows":
            _check(self.data is not None, "a graph-rows embedding table needs 'data'")


@dataclass(frozen=True, kw_only=True)
class Tolerance:
    token_rows: float
    mask_rows: float


@dataclass(frozen=True, kw_only=True)
class SelfCheckInfo:
    """What the export's own check measured (``export.selfcheck``)."""

    token_rows_max_logit_diff: float
    mask_rows_max_logit_diff: float
    logit_scale: float
    tolerance: Tolerance
    NOTES: ClassVar[dict] = {"rule": "|d| <= tolerance * max(1, max |logit|)"}


@dataclass(frozen=True, kw_only=True)
class FileInfo:
    """A file as the export wrote it: its size, and its sha256 when at most ``HASH_LIMIT``."""

    bytes: int
    sha256: str | None = None

    def __post_init__(self) -> None:
        _check(self.bytes >= 0, f"a file size must be >= 0, got {self.bytes}")
        _check(self.sha256 is None or (len(self.sha256) == 64 and all(
            c in "0123456789abcdef" for c in self.sha256)),
            f"a sha256 must be 64 lowercase hex digits, got {self.sha256!r:.70}")


@dataclass(frozen=True, kw_only=True)
class GGUFSourceInfo:
    """The llama.cpp GGUF file a package was exported from (its weights de-quantized to
    ``dtype``); absent in packages exported from a Hugging Face folder, or from before it was
    recorded."""

    file: str
    bytes: int
    architecture: str
    tensor_types: Mapping[str, int]     # GGUF tensor type -> tensors of that type
    sha256: str | None = None

    def __post_init__(self) -> None:
        FileInfo(bytes=self.bytes, sha256=self.sha256)  # the same checks as a package file
        object.__setattr__(self, "tensor_types", MappingProxyType(dict(self.tensor_types)))


@dataclass(frozen=True, kw_only=True)
class EngineProfile:
    """One optimisation profile of a TensorRT engine: ``[min, opt, max]`` of the block rows
    ``T``, the cached rows ``P`` and the mask tokens ``k``; every graph input's shape follows
    from them (``runtimes.trt_engine.input_shapes``).

    >>> EngineProfile(name="block T=8", T=(8, 8, 8), P=(1, 64, 248), k=(1, 1, 2)).covers(8, 0, 1)
    False
    """

    name: str
    T: tuple[int, ...]
    P: tuple[int, ...]
    k: tuple[int, ...]

    def __post_init__(self) -> None:
        for key in ("T", "P", "k"):
            r = getattr(self, key)
            _check(len(r) == 3 and 0 <= r[0] <= r[1] <= r[2],
                   f"engine profile {self.name!r}: {key} must be [min, opt, max] with "
                   f"0 <= min <= opt <= max, got {list(r)}")
        _check(self.T[0] >= 1 and self.k[0] >= 1,
               f"engine profile {self.name!r}: T and k start at 1, got T {list(self.T)}, "
               f"k {list(self.k)}")

    def covers(self, t: int, p: int, k: int) -> bool:
        return (self.T[0] <= t <= self.T[2] and self.P[0] <= p <= self.P[2]
                and self.k[0] <= k <= self.k[2])


@dataclass(frozen=True, kw_only=True)
class EngineInfo:
    """A TensorRT engine built from ``model.onnx`` on one device (``edgemtp build-engine``).
    An engine runs only on the GPU architecture (compute capability) and TensorRT version that
    built it, so a package may list one per pair."""

    file: str
    bytes: int
    sha256: str
    tensorrt_version: str
    gpu: str
    compute_capability: str
    max_context: int
    profiles: tuple[EngineProfile, ...]
    timing_cache: str | None = None
    built: str = ""

    def __post_init__(self) -> None:
        _relative(self.file, "engines.file")
        if self.timing_cache is not None:
            _relative(self.timing_cache, "engines.timing_cache")
        FileInfo(bytes=self.bytes, sha256=self.sha256)  # the same checks as a package file
        _check(len(self.profiles) > 0, f"engine {self.file} lists no optimisation profile")

    @property
    def label(self) -> str:
        return (f"{self.file} (TensorRT {self.tensorrt_version}, {self.gpu}, "
                f"sm {self.compute_capability})")


@dataclass(frozen=True, kw_only=True)
class Manifest:
    """``edgemtp.json``, typed. The exporter builds it with keywords and writes
    :meth:`to_dict`; :func:`load_package` reads it with :meth:`from_dict`.

    ``files`` (every file the export wrote, by path inside the package) and
    ``tokenizer_files`` are absent (None / empty) in packages from before they were recorded
    (format 1; every format 2 export records its files, so a format 2 manifest without
    ``files`` is refused: nothing would check the package's bytes);
    ``engines`` is empty until ``edgemtp build-engine`` adds one (their files are not among
    ``files``: they are written after export, on the device).
    """

    format_version: int = FORMAT_VERSION
    edgemtp_version: str = ""
    # a digest of the export code that wrote it (edgemtp.export.onnx_export.exporter_digest;
    # "" in packages from before it was recorded): benches re-export a package another
    # version of that code wrote, so they measure this edgemtp's graph
    exporter: str = ""
    source: str = ""
    family: str
    model_type: str = ""
    architectures: tuple[str, ...] = ()
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None = None
    dtype: str
    max_context: int
    topk: int
    graph: GraphInfo
    cache: CacheInfo
    plans: tuple[PlanInfo, ...]
    embeddings: EmbeddingInfo
    tokenizer: bool = True
    tokenizer_files: tuple[str, ...] = ()
    files: Mapping[str, FileInfo] | None = field(default=None, hash=False)
    self_check: SelfCheckInfo | None = None
    gguf: GGUFSourceInfo | None = field(default=None, hash=False)
    engines: tuple[EngineInfo, ...] = ()  # absent before 'edgemtp build-engine' ran
    weights: WeightsInfo | None = None  # absent in packages from before it was recorded
    heads: tuple[HeadsInfo, ...] = ()  # learned draft heads ('edgemtp train-heads')

    def __post_init__(self) -> None:
        _check_version(self.format_version)
        dims = {k: getattr(self, k) for k in ("hidden_size", "num_layers", "num_heads",
                                              "num_kv_heads", "head_dim", "vocab_size")}
        _check(min(dims.values()) >= 1, f"model dimensions must be >= 1, got {dims}")
        _check(self.num_heads % self.num_kv_heads == 0,
               f"'num_heads' {self.num_heads} is not a multiple of 'num_kv_heads' "
               f"{self.num_kv_heads}")
        _check_dtype(self.dtype, "dtype")
        _check(self.cache.dtype == self.dtype,
               f"'cache.dtype' {self.cache.dtype!r} differs from 'dtype' {self.dtype!r}: the "
               f"graph's cache is in the package's dtype (fixed at export)")
        _check(all(0 <= e < self.vocab_size for e in self.eos_token_ids),
               f"'eos_token_ids' must lie in [0, vocab_size {self.vocab_size}), got "
               f"{list(self.eos_token_ids)}")
        _check(self.bos_token_id is None or 0 <= self.bos_token_id < self.vocab_size,
               f"'bos_token_id' must lie in [0, vocab_size {self.vocab_size}), got "
               f"{self.bos_token_id}")
        from ..models.families import FAMILIES  # (the standard library only)

        _check(self.family in FAMILIES, f"'family' must be one of {', '.join(sorted(FAMILIES))}"
                                        f", got {self.family!r}")
        _check(self.max_context >= 2, f"'max_context' must be >= 2, got {self.max_context}")
        _check(1 <= self.topk <= self.vocab_size,
               f"'topk' must lie in [1, vocab_size {self.vocab_size}], got {self.topk}")
        inputs = graph_inputs(self.num_layers)
        if self.format_version < 2:  # format 1 graphs have no past_len
            inputs.remove(PAST_LEN)
        hidden = HIDDEN in self.graph.outputs  # optional: learned heads read it
        _check((list(self.graph.inputs), list(self.graph.outputs))
               == (inputs, graph_outputs(self.num_layers, hidden)),
               f"the graph inputs/outputs do not follow the contract for {self.num_layers} "
               f"layers (input_ids, position_ids, tree_mask, mask_embeds, past_key_i/"
               f"past_value_i, past_len; outputs topk_ids, topk_logprobs, argmax, logits, "
               f"present_key_i/present_value_i, optionally hidden_states last)")
        self._check_plans()
        _check(hidden or not self.heads, "'heads' are listed but the graph does not output "
                                         "hidden_states, which they read; re-export with "
                                         "--hidden-states")
        _check(len(self.embeddings.mu) == len(self.embeddings.sigma) == self.hidden_size,
               f"'embeddings.mu' and 'sigma' must have hidden_size = {self.hidden_size} "
               f"values, got {len(self.embeddings.mu)} and {len(self.embeddings.sigma)}")
        # every format 2 export records its files (they were recorded before format 2
        # existed): without the record nothing would check the graph's bytes
        _check(self.files is not None or self.format_version < 2,
               f"'files' is missing: a format {self.format_version} package records the size "
               f"and sha256 of every file it holds; re-export the package")
        if self.files is not None:
            for name in self.files:
                _relative(name, "files")
            object.__setattr__(self, "files", MappingProxyType(dict(self.files)))
            missing = [f for f in self.tokenizer_files if f not in self.files]
            _check(not missing, f"'tokenizer_files' {missing} are not among 'files'")

    def _check_plans(self) -> None:
        _check(len(self.plans) > 0, "'plans' is empty; a package ships at least one budget")
        budgets = [(p.bc, p.k) for p in self.plans]
        _check(len(set(budgets)) == len(budgets), f"'plans' repeats a budget: {budgets}")
        for p in self.plans:
            _check(p.n_nodes <= self.topk, f"plan bc={p.bc} k={p.k} has {p.n_nodes} nodes but "
                                           f"the graph exports top-{self.topk} candidates; "
                                           f"re-export the package")
            _check(p.T < self.max_context, f"plan bc={p.bc} k={p.k} needs T={p.T} positions, "
                                           f"which leave no room in max_context "
                                           f"{self.max_context}")

    @classmethod
    def from_dict(cls, data) -> Manifest:
        """Parse and validate a manifest read from JSON; :class:`ManifestError` names the
        first field that is missing, of the wrong type or inconsistent."""
        _check(isinstance(data, dict), f"expected a JSON object, got {type(data).__name__}")
        _check_version(data.get("format_version"))  # first: a newer format may differ anywhere
        return _parse(cls, data, "")

    def to_dict(self) -> dict:
        """The JSON object ``edgemtp.json`` holds."""
        return _plain(self)


def _check_version(version) -> None:
    _check(isinstance(version, int) and not isinstance(version, bool),
           f"'format_version' should be an int, got {version!r:.60}")
    _check(version >= 1, f"format version {version} is not a valid version (versions count "
                         f"from 1; this edgemtp reads format version {FORMAT_VERSION})")
    _check(version <= FORMAT_VERSION, f"format version {version}: this edgemtp reads format "
                                      f"version {FORMAT_VERSION} or older (upgrade edgemtp or "
                                      f"re-export the package)")


_KINDS = {int: "an int", float: "a number", str: "a string", bool: "true or false"}


def _parse(kind, value, key: str):
    """``value`` (from JSON) as ``kind``: a manifest dataclass, ``tuple[X, ...]``,
    ``Mapping[str, X]``, ``X | None``, int, float, str or bool."""
    origin, args = get_origin(kind), get_args(kind)
    if is_dataclass(kind):
        _check(isinstance(value, dict), f"{key!r} should be an object, got {value!r:.60}")
        hints, given = _hints(kind), {}
        for f in fields(kind):
            name = f"{key}.{f.name}" if key else f.name
            if f.name in value:
                given[f.name] = _parse(hints[f.name], value[f.name], name)
            elif f.default is MISSING:
                raise ManifestError(f"{name!r} is missing")
        return kind(**given)
    if origin in (Union, UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _parse(inner, value, key)
    if origin is tuple:
        _check(isinstance(value, list), f"{key!r} should be a list, got {value!r:.60}")
        return tuple(_parse(args[0], v, f"{key}[{i}]") for i, v in enumerate(value))
    if origin is Mapping:
        _check(isinstance(value, dict), f"{key!r} should be an object, got {value!r:.60}")
        return {k: _parse(args[1], v, f"{key}[{k!r}]") for k, v in value.items()}
    ok = isinstance(value, (int, float) if kind is float else kind)
    _check(ok and (kind is bool or not isinstance(value, bool)),
           f"{key!r} should be {_KINDS[kind]}, got {value!r:.60}")
    return float(value) if kind is float else value


@lru_cache(maxsize=None)
def _hints(cls) -> dict:
    return get_type_hints(cls)


def _plain(value):
    """A manifest dataclass as JSON values (tuples as lists), with its constant notes."""
    if is_dataclass(value):
        out = {f.name: _plain(getattr(value, f.name)) for f in fields(value)}
        return {**out, **getattr(value, "NOTES", {})}
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    return value


def record_files(folder: Path) -> dict[str, FileInfo]:
    """Every file under ``folder`` but the manifest: size, and sha256 for small files."""
    out = {}
    for p in sorted(folder.rglob("*")):
        name = p.relative_to(folder).as_posix()
        if p.is_file() and name != MANIFEST:
            size = p.stat().st_size
            out[name] = FileInfo(bytes=size, sha256=_sha256(p) if size <= HASH_LIMIT else None)
    return out


def _stat(path: Path) -> tuple[int, int] | None:
    """A file's (size, modification time in ns), None where it is not a file."""
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_size, st.st_mtime_ns) if path.is_file() else None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(2**20), b""):
            digest.update(block)
    return digest.hexdigest()


# -- the package ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Package:
    """A validated package folder: ``manifest`` is the JSON object as read (for readers of
    raw keys), ``meta`` the same typed."""

    root: Path
    manifest: dict
    meta: Manifest

    @property
    def graph_path(self) -> Path:
        return self.root / self.meta.graph.file

    @property
    def np_dtype(self):
        return NP_DTYPES[self.meta.dtype]

    @property
    def np_value_dtype(self):
        """The V cache's dtype: float64 in a package whose exact attention reads V in float64
        (``cache.value_dtype``), else the package's dtype."""
        return np.float64 if self.meta.cache.value_dtype == "fp64" else self.np_dtype

    @property
    def weights(self) -> WeightsInfo:
        """The graph's weight format (an older package: the same as its dtype)."""
        return self.meta.weights or WeightsInfo(format=self.meta.dtype)

    def embedding_table(self) -> EmbeddingTable:
        """The host's view of the input embedding table (memory-mapped, rows read on demand)."""
        return EmbeddingTable(self.root / self.meta.embeddings.file, self.meta.embeddings)

    def kv_cache_bytes(self, rows: int | None = None, dtype: str | None = None) -> int:
        """K and V for every layer at ``rows`` cache rows (default: the max context)."""
        m = self.meta
        k = np.dtype(NP_DTYPES[dtype or m.dtype]).itemsize
        v = np.dtype(self.np_value_dtype).itemsize if dtype is None else k
        return (m.num_layers * (rows or m.max_context) * m.num_kv_heads * m.head_dim
                * (k + v))

    def weight_bytes(self) -> int:
        g = self.meta.graph
        files = [g.file] + ([g.external_data] if g.external_data else [])
        return sum((self.root / f).stat().st_size for f in files if (self.root / f).is_file())

    def read_plans(self) -> dict[tuple[int, int], BudgetPlans]:
        """Every budget's plans read from ``plans/*.npz`` (built from the files' parents and
        checked equal, mask and positions, to what :mod:`edgemtp.plans` compiles)."""
        return {(e.bc, e.k): _read_plans(self.root, e) for e in self.meta.plans}

    # -- checks (load_package runs them all) -------------------------------------------------

    def _where(self) -> str:
        return f"the package {str(self.root)!r}"

    def _roles(self) -> dict[str, str]:
        """What each file the manifest names is, for messages."""
        m = self.meta
        roles = {m.graph.file: "graph", m.graph.commit_file: "commit graph",
                 m.embeddings.file: "embedding table"}
        if m.graph.external_data:
            roles[m.graph.external_data] = "external weights"
        roles.update({p.file: f"plan bc={p.bc} k={p.k}" for p in m.plans})
        roles.update({f: "tokenizer file" for f in m.tokenizer_files})
        roles.update({f: f"{h.kind} heads file" for h in m.heads for f in h.files()})
        return roles

    def _role(self, name: str) -> str:
        return self._roles().get(name, "file")

    def _missing(self, name: str, detail: str = "") -> ModelLoadError:
        return ModelLoadError(f"{self._where()} is missing the {self._role(name)} {name}"
                              f"{detail}; re-export it")

    def check_files(self) -> None:
        """Every file the export wrote is there and whole; older packages (no record): the
        graph, its external weights and some tokenizer file."""
        m = self.meta
        if m.tokenizer:
            self._check_tokenizer()
        if m.files is None:
            for name in (m.graph.file, m.graph.external_data):
                if name and not (self.root / name).is_file():
                    raise self._missing(name)
            return
        unrecorded = [name for name in self._roles() if name not in m.files]
        if unrecorded:
            raise ModelLoadError(f"the manifest of {self._where()} records no size for "
                                 f"{unrecorded[0]}; re-export the package")
        # learned heads are optional: a kind's files are checked where its heads are loaded
        # (check_heads), so a broken kind stops only the generations that use it
        heads = {f for h in m.heads for f in h.files()}
        for name, info in m.files.items():
            if name not in heads:
                self._check_file(name, info)

    def heads_problem(self, info) -> str | None:
        """Why the learned heads ``info`` (a :class:`HeadsInfo` of the manifest) cannot run:
        a file of theirs is missing or not what ``train-heads`` wrote; None when whole. Read
        once per state of the files (a generation with heads asks each time it starts)."""
        files = self.meta.files or {}
        state = tuple((f, _stat(self.root / f)) for f in info.files())
        cache = self.__dict__.setdefault("_heads_checked", {})
        if state not in cache:
            cache[state] = None
            for f, st in state:
                why = (self._file_problem(f, files[f]) if f in files else None if st else
                       f"{self._where()} is missing the {self._role(f)} {f}")
                if why:
                    cache[state] = (f"{why}; train them again: edgemtp train-heads "
                                    f"{str(self.root)} --kind {info.kind}")
                    break
        return cache[state]

    def check_heads(self, info) -> None:
        """:meth:`heads_problem` as a one-line :class:`ModelLoadError`."""
        problem = self.heads_problem(info)
        if problem:
            raise ModelLoadError(problem)

    def _check_tokenizer(self) -> None:
        want = self.meta.tokenizer_files or TOKENIZER_FILES
        have = [f for f in want if (self.root / f).is_file()]
        if len(have) < (len(want) if self.meta.tokenizer_files else 1):
            missing = [f for f in want if f not in have]
            expected = (", ".join(want) if self.meta.tokenizer_files
                        else f"one of {', '.join(want)}")
            raise ModelLoadError(f"the manifest says {self._where()} has a tokenizer, but "
                                 f"{missing[0]} is missing (expected {expected}); re-export, or "
                                 f"copy the tokenizer files from the model folder")

    def _file_problem(self, name: str, info: FileInfo) -> str | None:
        """What is wrong with file ``name`` against its record (missing, another size, another
        sha256), without the remedy; None when it is whole."""
        path = self.root / name
        if not path.is_file():
            return (f"{self._where()} is missing the {self._role(name)} {name} (the export "
                    f"wrote {info.bytes} bytes)")
        size, what = path.stat().st_size, f"the {self._role(name)} {str(path)!r}"
        if size != info.bytes:
            cut = "truncated" if size < info.bytes else "grown"
            return (f"{what} is {size} bytes but the export wrote {info.bytes}: it was {cut} "
                    f"or replaced after export")
        if info.sha256 is not None and _sha256(path) != info.sha256:
            return (f"{what} differs from what the export wrote (same size, different "
                    f"sha256): it is corrupt or was edited")
        return None

    def _check_file(self, name: str, info: FileInfo) -> None:
        problem = self._file_problem(name, info)
        if problem:
            raise ModelLoadError(f"{problem}; re-export "
                                 f"{'it' if problem.startswith(self._where()) else 'the package'}")

    def check_rotary(self, max_context: int, graph=None) -> None:
        """Refuse a ``max_context`` past the positions the graph's rotary tables hold (a fused
        graph's ``RotaryEmbedding`` reads cos/sin rows by position: past them onnxruntime and
        the native decoder computed garbage, qa8b D6). ``graph``: the loaded ``onnx``
        ModelProto where the caller has one, else the graph file is read without its
        weights. A graph that computes its rotary embedding has no table and any context."""
        if graph is None:
            import onnx

            graph = onnx.load(str(self.graph_path), load_external_data=False)
        rot = next((n for n in graph.graph.node if n.op_type == "RotaryEmbedding"), None)
        if rot is None:
            return
        name = rot.input[2]  # its cos table: an initializer, or a Constant node's value
        table = next((t for t in graph.graph.initializer if t.name == name), None) or next(
            (a.t for n in graph.graph.node if n.op_type == "Constant" and n.output[0] == name
             for a in n.attribute if a.name == "value"), None)
        rows = int(table.dims[0]) if table is not None and table.dims else None
        if rows is not None and rows < max_context:
            raise ManifestError(f"{self._where()}: its edgemtp.json says max_context "
                                f"{max_context}, but the graph's rotary table holds {rows} "
                                f"positions: the manifest was edited or damaged; export the "
                                f"package again (or give --max-context {rows})")

    def check_graph_file(self) -> None:
        """:meth:`check_graph_io` on the graph file's declared inputs and outputs, and
        :meth:`check_rotary`, read without its weights (``doctor``: a package is judged
        without loading it)."""
        import onnx

        model = onnx.load(str(self.graph_path), load_external_data=False)
        self.check_graph_io(graph_io(model.graph.input), graph_io(model.graph.output))
        self.check_rotary(self.meta.max_context, model)

    def check_graph_io(self, inputs: Mapping[str, tuple], outputs: Mapping[str, tuple]) -> None:
        """The graph's own inputs and outputs against the manifest, as a backend reads them
        (``name -> (element type as a numpy dtype name or None, shape with None for a named
        dimension)``, in graph order): the names, the shapes the manifest implies and the
        element types the runtime binds. A mixed-up or edited package fails at load in one
        line, not mid-generation in onnxruntime (every backend that loads the graph calls
        it, so ``inspect`` fails where ``generate`` would)."""
        m, graph = self.meta, self.meta.graph.file
        want_in, want_out = list(m.graph.inputs), list(m.graph.outputs)
        if list(inputs) != want_in or list(outputs) != want_out:
            missing = [n for n in want_in + want_out if n not in inputs and n not in outputs]
            extra = [n for n in list(inputs) + list(outputs) if n not in want_in + want_out]
            raise ModelLoadError(f"{graph} does not match the manifest: graph inputs/outputs "
                                 f"missing {missing[:3]}, unexpected {extra[:3]}")
        found = {**inputs, **outputs}
        expect = {"mask_embeds": [None, m.hidden_size],
                  "past_key_0": ([1, m.num_kv_heads, None, m.head_dim] if m.cache.head_major
                                 else [1, None, m.num_kv_heads, m.head_dim]),
                  "topk_ids": [1, None, m.topk], "logits": [1, None, m.vocab_size]}
        for name, dims in expect.items():
            got = list(found[name][1])
            if len(got) != len(dims) or any(w is not None and g != w
                                            for g, w in zip(got, dims)):
                raise ModelLoadError(f"{graph} does not match the manifest: {name} has shape "
                                     f"{got}, the manifest implies {dims}")
        key, value = np.dtype(self.np_dtype).name, np.dtype(self.np_value_dtype).name
        why_value = (f"'cache.value_dtype' {m.cache.value_dtype!r}" if m.cache.value_dtype
                     else f"'dtype' {m.dtype!r} and no 'cache.value_dtype'")
        types = {"input_ids": "int64", "position_ids": "int64", "tree_mask": "bool",
                 "mask_embeds": "float32", PAST_LEN: "int64", "topk_ids": "int64",
                 "topk_logprobs": "float32", "argmax": "int64", "logits": "float32"}
        for name in (*kv_names("past", m.num_layers), *kv_names("present", m.num_layers)):
            types[name] = value if "_value_" in name else key
        for name, (got, _) in found.items():
            want = types.get(name)
            if want is not None and got is not None and got != want:
                why = (why_value if "_value_" in name else f"'dtype' {m.dtype!r}"
                       if name.startswith(("past_", "present_")) else "every package")
                raise ModelLoadError(f"{graph} does not match the manifest: {name} is {got} in "
                                     f"the graph, but the manifest ({why}) implies {want}; "
                                     f"the manifest was edited or is another package's: "
                                     f"re-export")

    def engine_problem(self, e) -> str | None:
        """Why the listed TensorRT engine ``e`` (an :class:`EngineInfo`) cannot be loaded:
        "the file is missing", or it is not the one that was built (its size, and its sha256
        when at most ``HASH_LIMIT`` bytes, like the export's files); None when it is whole.
        Only the tensorrt backend reads an engine: the others run a package whose engines are
        gone (built on a Jetson, the package copied back without ``engines/``)."""
        path = self.root / e.file
        if not path.is_file():
            return "the file is missing"
        size = path.stat().st_size
        if size != e.bytes or (size <= HASH_LIMIT and _sha256(path) != e.sha256):
            what = f"{size} bytes, not {e.bytes}" if size != e.bytes else "its sha256 differs"
            return f"it is not the one that was built ({what})"
        return None

    def check_engine(self, e) -> None:
        """:meth:`engine_problem` as a one-line :class:`ModelLoadError` (the tensorrt backend,
        for the engine it is about to load)."""
        problem = self.engine_problem(e)
        if problem:
            raise ModelLoadError(f"{self._where()} lists the TensorRT engine {e.label}, but "
                                 f"{problem}; rebuild it on that GPU: edgemtp build-engine "
                                 f"{str(self.root)}")

    def check_embeddings(self) -> None:
        """The table must be ``[vocab_size, hidden_size]`` of the recorded dtype (npy), or its
        block-quantized arrays must lie inside their file with the shapes that implies."""
        m, e = self.meta, self.meta.embeddings
        path = self.root / e.file
        if not path.is_file():
            raise self._missing(e.file)
        if e.layout == "block-quantized":
            self._check_quantized_table(path)
            return
        if e.layout == "graph-rows":
            ref, want = e.data, (m.vocab_size, m.hidden_size)
            dtype = np.dtype(NP_DTYPES[e.dtype]).name
            if tuple(ref.shape) != want or ref.dtype != dtype:
                raise ModelLoadError(f"the manifest's embeddings.data is {list(ref.shape)} "
                                     f"{ref.dtype}, but the table is [vocab_size {want[0]}, "
                                     f"hidden_size {want[1]}] {dtype}; re-export")
            if ref.offset + ref.nbytes > path.stat().st_size:
                raise ModelLoadError(f"{str(path)!r} ends before the embedding table the "
                                     f"manifest places in it; re-export")
            return
        try:
            table = np.load(path, mmap_mode="r")  # reads the header only
        except (OSError, ValueError, EOFError) as err:
            raise ModelLoadError(f"{str(path)!r} cannot be read: {_first_line(err)}") from None
        want = (m.vocab_size, m.hidden_size)
        if table.shape != want or table.dtype != NP_DTYPES[e.dtype]:
            raise ModelLoadError(f"{str(path)!r} holds a {list(table.shape)} {table.dtype} "
                                 f"table, but the manifest says [vocab_size {want[0]}, "
                                 f"hidden_size {want[1]}] {np.dtype(NP_DTYPES[e.dtype])}; the "
                                 f"manifest and the table do not belong together: re-export")

    def _check_quantized_table(self, path: Path) -> None:
        m, e = self.meta, self.meta.embeddings
        v, d, bs = m.vocab_size, m.hidden_size, e.block_size
        blocks = -(-d // bs)
        want = {"data": ((v, d * e.bits // 8), "uint8"), "scales": ((v, blocks), e.scales.dtype),
                "zero_points": ((v, -(-blocks * e.bits // 8)), "uint8")}
        size = path.stat().st_size
        for key, (shape, dtype) in want.items():
            ref = getattr(e, key)
            if ref is None:
                continue
            if tuple(ref.shape) != shape or ref.dtype != dtype:
                raise ModelLoadError(f"the manifest's embeddings.{key} is {list(ref.shape)} "
                                     f"{ref.dtype}, but [vocab_size {v}, hidden_size {d}] in "
                                     f"blocks of {bs} needs {list(shape)} {dtype}; re-export")
            if ref.offset + ref.nbytes > size:
                raise ModelLoadError(f"the embedding table's {key} runs past the end of "
                                     f"{str(path)!r} ({size} bytes): the file is truncated or "
                                     f"does not belong to this manifest; re-export")


def check_folder(path) -> Path:
    """``path`` as a package folder: one that exists and holds a manifest (what a command that
    reads only packages checks first, before anything would take it for a hub id)."""
    root = Path(path)
    if root.is_file():
        hint = (f"; export it first: edgemtp export {str(path)} -o PACKAGE"
                if root.suffix.lower() == ".gguf" else "")
        raise ModelLoadError(f"{str(path)!r} is a file; expected a package folder written by "
                             f"'edgemtp export'{hint}")
    if not root.is_dir():
        raise ModelLoadError(f"package folder {str(path)!r} does not exist")
    if not (root / MANIFEST).is_file():
        raise ModelLoadError(f"{str(path)!r} has no {MANIFEST}; expected a folder written by "
                             f"'edgemtp export'")
    return root


def graph_io(values) -> dict:
    """Graph inputs or outputs (onnx ``ValueInfoProto``s) as ``name -> (numpy dtype name,
    shape)`` (:meth:`Package.check_graph_io`), a named dimension as None."""
    from onnx import helper

    out = {}
    for v in values:
        t = v.type.tensor_type
        try:
            elem = np.dtype(helper.tensor_dtype_to_np_dtype(t.elem_type)).name
        except (KeyError, TypeError, ValueError):
            elem = None
        out[v.name] = (elem, [d.dim_value if d.HasField("dim_value") else None
                              for d in t.shape.dim])
    return out


def load_package(path, check_plans: bool = True, check_engines: bool = False) -> Package:
    """Read and validate a package folder; one-line :class:`ModelLoadError` when it is bad.
    With ``check_plans`` (the default), the plans read from it become the runtime's plans;
    ``check_engines``: every listed TensorRT engine must be whole too (``build-engine``, after
    writing one; the tensorrt backend checks the one engine it loads)."""
    root = check_folder(path)
    mpath = root / MANIFEST
    try:
        raw = json.loads(mpath.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"the manifest {str(mpath)!r} is corrupt: {_first_line(e)}") from None
    try:
        meta = Manifest.from_dict(raw)
    except ManifestError as e:
        raise ModelLoadError(f"the manifest {str(mpath)!r} is invalid: {e}") from None
    pkg = Package(root, raw, meta)
    pkg.check_files()
    if check_engines:
        for e in meta.engines:
            pkg.check_engine(e)
    pkg.check_embeddings()
    if check_plans:
        for p in pkg.read_plans().values():
            install(p.bc, p.k, p.static, p.dynamic)
    return pkg


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


# -- inspect ----------------------------------------------------------------------------------


def _dtype_shown(dtype: str, weights: str) -> str:
    """The dtype line: a quantized package's weights first (qa8b D12: "fp32" for an int4
    package, its activations' type)."""
    return dtype if weights == dtype else f"{weights} weights, {dtype} activations"


def _kept(w: WeightsInfo, gguf: bool = True) -> str:
    head = (f", the LM head at 8 bits (the {'file' if gguf else 'source'}'s {w.head8_from})"
            if w.head8_from else "")
    if not w.kept_blocks:
        return head
    return f", {w.kept_blocks} of {w.products} products keep the GGUF file's own blocks{head}"


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def cuda_graph_readiness(graph: GraphInfo, cache: CacheInfo | None = None) -> str:
    """Whether onnxruntime can capture this graph as CUDA graphs (``inspect``'s line).

    >>> cuda_graph_readiness(GraphInfo(opset=17, inputs=(), outputs=(),
    ...                                shape_reads=("past_key_0",)))[:5]
    'ready'
    """
    if cache is not None and cache.head_major:
        return ("not for CUDA: the cache is head-major (--cache-layout head), which runs on "
                "onnxruntime's CPU provider only")
    if graph.shape_reads is None:
        return ("graphs not recorded (exported before 2026-11-26, whose graphs onnxruntime "
                "will not capture): re-export for onnxruntime's CUDA graphs")
    other = [n for n in graph.shape_reads if not n.startswith("past_")]
    if not other:
        return ("ready for onnxruntime's CUDA graphs (no shape node once the past's rows "
                "are fixed at load)")
    return (f"no onnxruntime CUDA graphs: shape nodes read {', '.join(other[:3])} "
            f"(onnxruntime keeps them on the CPU and refuses the capture)")


def _shown(text) -> str:
    """A manifest's free text as one printable line ('?' where empty)."""
    return "".join(c if c.isprintable() else "?" for c in str(text)) if text else "?"


def describe(pkg: Package) -> str:
    """What ``edgemtp inspect`` prints: manifest summary, plans, memory estimate."""
    m = pkg.meta
    g, check = m.graph, m.self_check
    lines = [
        f"package   {pkg.root}",
        f"format    {m.format_version} (edgemtp {_shown(m.edgemtp_version)}, exporter "
        f"{_shown(m.exporter)}), from {_shown(m.source)}",
        f"model     {m.family} ({', '.join(m.architectures) or m.family}): "
        f"{m.num_layers} layers, hidden {m.hidden_size}, {m.num_heads} heads, "
        f"{m.num_kv_heads} KV heads x {m.head_dim}, vocab {m.vocab_size}",
        f"dtype     {_dtype_shown(m.dtype, pkg.weights.format)}   max context "
        f"{m.max_context}   EOS "
        f"{list(m.eos_token_ids)}   tokenizer {'yes' if m.tokenizer else 'no'}",
        f"graph     {g.file}{' + ' + g.external_data if g.external_data else ''}, "
        f"opset {g.opset}, top-K {m.topk}, {len(g.inputs)} inputs, {len(g.outputs)} outputs",
        f"cache     {m.cache.layout}"
        f"{', values in float64 (exact attention sums)' if m.cache.value_dtype else ''}",
        f"weights   {pkg.weights.name}"
        f"{', tied embedding stored once' if pkg.weights.tied_embedding else ''}"
        f"{INVARIANCE.get(pkg.weights.softmax, '')}"
        f"{', fused rotary and RMSNorm kernels' if pkg.weights.fused else ''}"
        f"{_kept(pkg.weights, m.gguf is not None)}",
    ]
    if m.gguf:
        types = ", ".join(f"{t} x{n}" for t, n in m.gguf.tensor_types.items())
        fmt = pkg.weights.format
        if fmt in ("int4", "int8"):
            how = (f"its blocks kept as they are where MatMulNBits holds them, the rest "
                   f"de-quantized and quantized again to {fmt}" if pkg.weights.kept_blocks
                   else f"de-quantized, then quantized again to {fmt}")
        else:
            how = f"de-quantized to {m.dtype}"
        lines.append(f"gguf      {m.gguf.file} ({m.gguf.architecture}: {types}), {how}")
    lines.append(f"cuda      {cuda_graph_readiness(g, m.cache)}")
    if check:
        lines.append(f"checked   max |logit diff| {check.token_rows_max_logit_diff:.1e} "
                     f"token rows, {check.mask_rows_max_logit_diff:.1e} mask rows "
                     f"(logit scale {check.logit_scale:.3g})")
    lines += ["", f"plans     {'bc':>4} {'k':>3} {'T':>4} {'N':>4}  {'static counts':<14} "
                  f"{'dynamic shapes':>14}"]
    for e in m.plans:
        lines.append(f"          {e.bc:>4} {e.k:>3} {e.T:>4} {e.n_nodes:>4}  "
                     f"{str(list(e.static_counts)):<14} {e.dynamic_shapes:>14}")
    for e in m.engines:
        names = ", ".join(p.name for p in e.profiles)
        lines.append(f"engine    {e.file}, {_size(e.bytes)}: TensorRT {e.tensorrt_version} on "
                     f"{e.gpu} (sm {e.compute_capability}), {len(e.profiles)} profiles "
                     f"({names})")
        problem = pkg.engine_problem(e)
        if problem:  # (the other backends run without it)
            lines.append(f"          unusable: {problem}; the tensorrt backend needs it "
                         f"rebuilt on that GPU: edgemtp build-engine {str(pkg.root)}")
    for h in m.heads:
        lines.append(f"heads     {h.file}: {h.summary()}")
        problem = pkg.heads_problem(h)
        if problem:  # (the other drafters run without them)
            lines.append(f"          unusable: {problem}")
    weights = pkg.weight_bytes()
    lines += ["", f"memory    weights {_size(weights)} ({pkg.weights.name}, on disk)"]
    if m.cache.value_dtype:  # exact attention sums: fp32 keys, float64 values, as it runs
        k, v = np.dtype(pkg.np_dtype).itemsize, np.dtype(pkg.np_value_dtype).itemsize
        lines.append(f"          KV cache at {m.max_context} tokens: "
                     f"{_size(pkg.kv_cache_bytes())} ({m.num_layers} layers x {m.max_context} x "
                     f"{m.num_kv_heads} x {m.head_dim} x ({k} B keys + {v} B values))")
    else:
        for dt in NP_DTYPES:
            kv, size = pkg.kv_cache_bytes(dtype=dt), np.dtype(NP_DTYPES[dt]).itemsize
            lines.append(f"          KV cache at {m.max_context} tokens, {dt}: {_size(kv)} "
                         f"(2 x {m.num_layers} layers x {m.max_context} x "
                         f"{m.num_kv_heads} x {m.head_dim} x {size} B)")
    lines.append(f"          total ({m.dtype} cache"
                 f"{', float64 values' if m.cache.value_dtype else ''}): "
                 f"{_size(weights + pkg.kv_cache_bytes())}")
    return "\n".join(lines)
