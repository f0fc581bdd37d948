"""ONNX Runtime backend: runs a package written by ``edgemtp export`` on CPU, CUDA or the
TensorRT execution provider, behind the same interface as the PyTorch reference backend.

The :class:`OrtBackend` holds the package's ``InferenceSession`` (the weights) once; each
:class:`OrtSession` (one generation) owns a KV cache and its own IOBinding, through which
every tensor crosses the session boundary:

- the KV cache is preallocated from the manifest, ``[L, max_context, H_kv, D]`` for K and V
  (sequence-major), and each layer's past is bound, without a host-side copy, as the prefix
  ``cache[i, :P]`` (the graph's attention then concatenates past and new K/V itself);
- the block's new K/V land in a preallocated buffer; a commit copies only accepted rows;
- the host reads back ``argmax`` and ``top-K`` (O(T * K)); ``logits`` only when sampling,
  the last hidden states only when asked and the package exports them.

On CPU the cache is a numpy array. On CUDA / TensorRT it is an ``OrtValue`` on the device and
a commit runs the package's tiny ``kv_commit.onnx`` gather with its outputs bound straight
into the cache, so K/V never leave the device.
"""

from __future__ import annotations

import itertools
import mmap
import weakref
from pathlib import Path
from time import perf_counter

import numpy as np

from edgemtp.backend import StepOut, check_options, parse_device
from edgemtp.errors import BackendUnavailableError, ConfigError, ModelLoadError
from edgemtp.runtimes.package import (COMMIT, PAST_LEN, check_step, cuda_graph_readiness,
                                      kv_names, load_package, run_rows)

_INT64, _BOOL, _FLOAT32 = np.dtype(np.int64), np.dtype(np.bool_), np.dtype(np.float32)
_KEEP_MASK = 256  # largest block whose mask the backend keeps a bound copy of
PAST_BUCKET = 64  # a graph with past_len sees the cache in views of this many rows: the
                  # 2 x layers past bindings change once every 64 tokens, not every step

# --device -> (execution provider, OrtValue device type, how to get it)
DEVICES = {
    "cpu": ("CPUExecutionProvider", "cpu", "pip install onnxruntime"),
    "cuda": ("CUDAExecutionProvider", "cuda",
             "pip install onnxruntime-gpu, with a CUDA runtime and cuDNN that match it"),
    "tensorrt": ("TensorrtExecutionProvider", "cuda",
                 "pip install onnxruntime-gpu and TensorRT (on Jetson: the JetPack wheel)"),
}


def _ort():
    try:
        import onnxruntime
    except ModuleNotFoundError:
        raise BackendUnavailableError("the onnxruntime backend needs the 'onnxruntime' package "
                                      "(pip install onnxruntime, or onnxruntime-gpu)") from None
    return onnxruntime


def check_provider(kind: str, device_name: str, ort=None) -> str:
    """The execution provider a device kind (``DEVICES``) needs, or one line saying this
    onnxruntime build lacks it and how to get it."""
    ort = ort or _ort()
    provider, _, install = DEVICES[kind]
    if provider not in ort.get_available_providers():
        raise BackendUnavailableError(
            f"device {device_name!r} needs onnxruntime's {provider}, which this onnxruntime "
            f"build lacks (available: {', '.join(ort.get_available_providers())}); {install}")
    return provider


def _ort_errors(ort) -> tuple[type[BaseException], ...]:
    state = ort.capi.onnxruntime_pybind11_state
    names = ("Fail", "InvalidArgument", "InvalidGraph", "InvalidProtobuf", "NoSuchFile",
             "NotImplemented", "RuntimeException", "EPFail")
    return tuple(getattr(state, n) for n in names if hasattr(state, n))


def _bind(io, name: str, arr: np.ndarray, output: bool = False) -> None:
    # zero-copy: ORT reads (or writes) the numpy buffer in place
    fn = io.bind_output if output else io.bind_input
    fn(name, "cpu", 0, arr.dtype, arr.shape, arr.ctypes.data)


class Binder:
    """Binds buffers by pointer to one IOBinding: ``input(name, dtype, shape, ptr)`` and
    ``output(...)``, on one device.

    Every decode step rebinds the 2 x layers past K/V (P grows), so a bind's cost is host
    overhead per step. The public ``IOBinding.bind_input/output`` build a fresh device object
    and re-check the element type on every call: 11.3 us a bind here, against 7.0 us for
    onnxruntime's own C++ binding with a device built once (a 5-layer model: +43 us a step,
    +80 % of greedy decoding's host time; ``bench/bench_host.py``). So this class takes the
    C++ binding where the installed onnxruntime exposes it and the public methods otherwise;
    ``tests/test_onnx_backend.py`` checks both give the same outputs.
    """

    def __init__(self, ort, io, device: str, public: bool = False, device_id: int = 0) -> None:
        raw = None if public else getattr(io, "_iobinding", None)
        if raw is not None:
            try:
                c_dev = ort.OrtDevice.make(device, device_id)._get_c_device()
            except AttributeError:  # an onnxruntime without these internals
                raw = None
        if raw is not None:
            raw_in, raw_out = raw.bind_input, raw.bind_output
            self.input = lambda name, dtype, shape, ptr: raw_in(name, c_dev, dtype, shape, ptr)
            self.output = lambda name, dtype, shape, ptr: raw_out(name, c_dev, dtype, shape, ptr)
        else:
            self.input = lambda name, dtype, shape, ptr: io.bind_input(
                name, device, device_id, dtype, shape, ptr)
            self.output = lambda name, dtype, shape, ptr: io.bind_output(
                name, device, device_id, dtype, shape, ptr)


class KVCache:
    """K and V caches ``[L, rows, H_kv, D]`` plus the last block's new K/V ``[L, cap, H, D]``,
    bound to the graph by pointer: layer ``i``'s past is the prefix ``cache[i, :P]`` (rebound
    every step, P grows) and its present output is written to ``new[i, :T]`` (rebound only
    when T changes). Subclasses own the memory and the commit."""

    device, device_id = "cpu", 0
    moves = 0  # times the cache memory moved (a binding of an older one must be redone)

    def __init__(self, layers: int, rows: int, heads: int, dim: int, dtype,
                 v_dtype=None) -> None:
        # v_dtype: the values' own dtype where it differs from the keys' (float64 in an exact
        # package: its attention sums p @ V in float64, so it keeps V in float64 rather than
        # casting the whole past every step)
        self.layers, self.rows, self.tail = layers, rows, [heads, dim]
        self.dtype, self.v_dtype = np.dtype(dtype), np.dtype(v_dtype or dtype)
        self.row_bytes = heads * dim * self.dtype.itemsize
        self.v_row_bytes = heads * dim * self.v_dtype.itemsize
        self.past = kv_names("past", layers)
        self.present = kv_names("present", layers)
        self.k_ptr, self.v_ptr = self._alloc_cache()
        self.cap, self.new_k_ptr, self.new_v_ptr = 0, 0, 0
        # (name, pointer, dtype) of every layer's past, graph order
        k_stride, v_stride = rows * self.row_bytes, rows * self.v_row_bytes
        self._past_at = [at for i in range(layers) for at in (
            (self.past[2 * i], self.k_ptr + i * k_stride, self.dtype),
            (self.past[2 * i + 1], self.v_ptr + i * v_stride, self.v_dtype))]

    def bind_past(self, bind: Binder, p: int) -> None:
        shape, fn = [1, p, *self.tail], bind.input
        for name, ptr, dtype in self._past_at:
            fn(name, dtype, shape, ptr)

    def bind_present(self, bind: Binder, t: int) -> None:
        if self.cap < t:
            self.cap = max(t, 64)
            self.new_k_ptr, self.new_v_ptr = self._alloc_new(self.cap)
        shape = [1, t, *self.tail]
        k_stride, v_stride = self.cap * self.row_bytes, self.cap * self.v_row_bytes
        for i in range(self.layers):
            bind.output(self.present[2 * i], self.dtype, shape, self.new_k_ptr + i * k_stride)
            bind.output(self.present[2 * i + 1], self.v_dtype, shape,
                        self.new_v_ptr + i * v_stride)


def lazy_zeros(shape, dtype) -> np.ndarray:
    """A zeroed array in its own anonymous memory map: a page becomes resident only once it
    is written, so a cache sized for the whole context costs memory for the rows in use.
    (``np.zeros`` would do the same through ``calloc``, but numpy asks the kernel for huge
    pages on large arrays, and one row written per layer then faults in 2 MB per layer:
    the whole cache of a 30-layer model at a 2048-token context.)"""
    dtype = np.dtype(dtype)
    count = int(np.prod(shape))
    buf = mmap.mmap(-1, max(count * dtype.itemsize, 1))
    return np.frombuffer(buf, dtype=dtype, count=count).reshape(shape)


class HostKV(KVCache):
    """numpy memory; a commit is one fancy-indexed copy per K and V."""

    def _alloc_cache(self):
        shape = (self.layers, self.rows, *self.tail)
        self.k, self.v = lazy_zeros(shape, self.dtype), lazy_zeros(shape, self.v_dtype)
        return self.k.ctypes.data, self.v.ctypes.data

    def _alloc_new(self, cap: int):
        self.new_k = np.empty((self.layers, cap, *self.tail), dtype=self.dtype)
        self.new_v = np.empty((self.layers, cap, *self.tail), dtype=self.v_dtype)
        return self.new_k.ctypes.data, self.new_v.ctypes.data

    def commit(self, rows: np.ndarray, p: int) -> None:
        r = len(rows)
        if r == 0:
            return
        few = rows.tolist() if r <= 8 else None  # a step's path: plain ints are cheaper
        first = few[0] if few else int(rows[0])
        if (few == list(range(first, first + r))) if few else np.all(np.diff(rows) == 1):
            # consecutive rows (a prefill, a top-1 path): one slice copy each
            self.k[:, p:p + r] = self.new_k[:, first:first + r]
            self.v[:, p:p + r] = self.new_v[:, first:first + r]
        elif few:  # a few rows: row-by-row slices skip the gather's temporary
            k, v, new_k, new_v = self.k, self.v, self.new_k, self.new_v
            for j, row in enumerate(few, start=p):
                k[:, j] = new_k[:, row]
                v[:, j] = new_v[:, row]
        else:
            self.k[:, p:p + r] = self.new_k[:, rows]
            self.v[:, p:p + r] = self.new_v[:, rows]


class HostKVHeads(HostKV):
    """A head-major host cache (a ``--cache-layout head`` package): K and V ``[L, H_kv,
    width, D]``, where ``width`` is the past the graph is bound to (a 64-row bucket). A
    head's first P rows are contiguous but a prefix of all heads is not, so the cache is as
    wide as the bound past and moves (a copy of the rows in use) when the bucket changes:
    an O(P) copy once every 64 tokens, where the graph then reads each KV head's rows as one
    block (``bench/results/attention_layout_cpu.md``). A commit writes the block's new rows
    (sequence-major ``[L, T, H_kv, D]``) transposed into place."""

    def __init__(self, layers: int, rows: int, heads: int, dim: int, dtype) -> None:
        self.width = 0
        super().__init__(layers, rows, heads, dim, dtype)

    def _alloc_cache(self):
        self._resize(min(PAST_BUCKET, self.rows))
        return self.k.ctypes.data, self.v.ctypes.data

    def _resize(self, width: int) -> None:
        # zeroed: the rows past P are masked, but 0 x NaN is NaN
        shape = (self.layers, self.tail[0], width, self.tail[1])
        k, v = np.zeros(shape, self.dtype), np.zeros(shape, self.v_dtype)
        keep = min(width, self.width)
        if keep:
            k[:, :, :keep], v[:, :, :keep] = self.k[:, :, :keep], self.v[:, :, :keep]
        self.k, self.v, self.width = k, v, width
        self.moves += 1

    def bind_past(self, bind: Binder, p: int) -> None:
        if p != self.width:
            self._resize(p)
        shape, fn = [1, self.tail[0], p, self.tail[1]], bind.input
        k_layer, v_layer = self.k[0].nbytes, self.v[0].nbytes
        k_ptr, v_ptr = self.k.ctypes.data, self.v.ctypes.data
        for i in range(self.layers):
            fn(self.past[2 * i], self.dtype, shape, k_ptr + i * k_layer)
            fn(self.past[2 * i + 1], self.v_dtype, shape, v_ptr + i * v_layer)

    def commit(self, rows: np.ndarray, p: int) -> None:
        r = len(rows)
        if r == 0:
            return
        if p + r > self.width:
            self._resize(min(-(-(p + r) // PAST_BUCKET) * PAST_BUCKET, self.rows))
        first = int(rows[0])
        take = (slice(first, first + r) if r == 1 or np.all(np.diff(rows) == 1) else rows)
        self.k[:, :, p:p + r] = self.new_k[:, take].transpose(0, 2, 1, 3)
        self.v[:, :, p:p + r] = self.new_v[:, take].transpose(0, 2, 1, 3)


class DeviceKV(KVCache):
    """``OrtValue`` memory on the session's device; a commit runs the package's gather graph
    with each layer's output bound into the cache at row P, so K/V never leave the device."""

    def __init__(self, ort, commit_session, device: str, *dims, device_id: int = 0) -> None:
        self.ort, self.session, self.device = ort, commit_session, device
        self.device_id = device_id
        self.io = commit_session.io_binding()
        self.bind = Binder(ort, self.io, device, device_id=device_id)
        super().__init__(*dims)

    def _alloc(self, rows: int, dtype):
        return self.ort.OrtValue.ortvalue_from_shape_and_type(
            [self.layers, rows, *self.tail], dtype, self.device, self.device_id)

    def _alloc_cache(self):
        # zeroed: a format 2 graph reads rows past P (masked, but 0 x NaN is NaN, and fresh
        # device memory may hold any bit pattern)
        # (on CPU an OrtValue wraps the array it is made from: one array each)
        shape = [self.layers, self.rows, *self.tail]
        self.k, self.v = (self.ort.OrtValue.ortvalue_from_numpy(
            np.zeros(shape, dtype=dtype), self.device, self.device_id)
            for dtype in (self.dtype, self.v_dtype))
        return self.k.data_ptr(), self.v.data_ptr()

    def _alloc_new(self, cap: int):
        self.new_k, self.new_v = self._alloc(cap, self.dtype), self._alloc(cap, self.v_dtype)
        return self.new_k.data_ptr(), self.new_v.data_ptr()

    def commit(self, rows: np.ndarray, p: int) -> None:
        io, shape = self.io, [1, len(rows), *self.tail]
        io.bind_ortvalue_input("present_keys", self.new_k)
        io.bind_ortvalue_input("present_values", self.new_v)
        _bind(io, "rows", rows)
        out = self.bind.output
        for i in range(self.layers):
            at = i * self.rows + p
            out(f"commit_key_{i}", self.dtype, shape, self.k_ptr + at * self.row_bytes)
            out(f"commit_value_{i}", self.v_dtype, shape, self.v_ptr + at * self.v_row_bytes)
        self.session.run_with_iobinding(io)


class OrtBackend:
    """A package on ONNX Runtime: the graph's ``InferenceSession`` (the weights) once, shared
    by every :meth:`session`. ``dtype`` must be the package's own (or None): a package's
    dtype is fixed at export. ``trust_remote_code`` is accepted for interface parity: a
    package runs no model code. ``device_cache`` forces the device-resident cache path
    (default: off on CPU). ``cuda_graphs`` (default: on for ``device="cuda"`` with a format 2
    package) runs every step on device buffers at fixed addresses, one CUDA graph per block
    shape (:class:`GraphSession`); if onnxruntime refuses it for this graph, the backend
    runs without and says why in :attr:`graphs_off`. That session's graph is loaded with the
    past's rows fixed at the whole cache (``P`` = the max context), so onnxruntime folds every
    shape computation away and can keep all nodes on the GPU (packages exported before
    2026-11-26 also traced T and k into shape nodes: re-export them). ``static_past`` runs
    that same graph and session on any device (tests: on CPU, uncaptured)."""

    name = "onnxruntime"

    def __init__(self, package_dir, device: str = "cpu", threads: int | None = None,
                 max_context: int | None = None, dtype: str | None = None,
                 trust_remote_code: bool = False, device_cache: bool | None = None,
                 public_binding: bool = False, cuda_graphs: bool | None = None,
                 static_past: bool = False) -> None:
        check_options(device, dtype, max_context, threads)
        self.device_name = device
        device, self.device_id = parse_device(device)  # (cuda:N: GPU N)
        self.public_binding = public_binding  # onnxruntime's public bind methods only
        ort = self.ort = _ort()
        self.package = pkg = load_package(package_dir)
        m = pkg.manifest
        if dtype is not None and dtype != m["dtype"]:
            raise ConfigError(f"the package {str(pkg.root)!r} computes in {m['dtype']} "
                              f"({pkg.weights.name} weights), and a package's dtype is fixed at "
                              f"export; drop --dtype {dtype}, or "
                              f"export another package (edgemtp export --dtype fp32|fp16)")
        self.vocab_size, self.hidden_size = m["vocab_size"], m["hidden_size"]
        self.eos_token_ids = tuple(int(e) for e in m["eos_token_ids"])
        self.topk = m["topk"]
        self.has_tokenizer = bool(m.get("tokenizer", True))
        source = m.get("source")
        self.source = source if source and (Path(source) / "config.json").is_file() else None
        self.max_context = self._context(m["max_context"], max_context)
        self.device, self.threads = device, threads
        self.past_len = PAST_LEN in m["graph"]["inputs"]  # format 2: past views, past_len
        self.head_major = pkg.meta.cache.head_major  # --cache-layout head: host cache only
        if self.head_major and (device != "cpu" or device_cache or static_past):
            raise ConfigError(f"the package {str(pkg.root)!r} keeps its cache head-major "
                              f"(exported with --cache-layout head), which runs on "
                              f"onnxruntime's CPU provider with a host cache only; export "
                              f"again without --cache-layout head for --device {device}")
        self.cuda_graphs, self.graphs_off = False, "not asked"
        if device == "cuda" and cuda_graphs is not False:
            if not self.past_len:
                self.graphs_off = "the package is format 1 (no past_len input): re-export it"
            else:
                try:
                    self.graph = self._session(ort, device, threads, cuda_graph=True,
                                               past_rows=self.max_context)
                    self.cuda_graphs, self.graphs_off = True, ""
                except ModelLoadError as e:
                    ready = cuda_graph_readiness(pkg.meta.graph)  # why, where the graph says
                    self.graphs_off = str(e) + ("" if ready.startswith("ready") else
                                                f" (this package: {ready})")
        if static_past and not self.past_len:
            raise ConfigError("static_past needs a format 2 package (a past_len input): "
                              "re-export it")
        self.static_past = self.cuda_graphs or bool(static_past)
        # a CUDA graph id names one capture in this InferenceSession, with the addresses it
        # was captured on: ids are never reused, and the buffers behind them outlive the
        # generation that made them (GraphSession takes a free _GraphBuffers)
        self._graph_ids = itertools.count(1)  # 0 is onnxruntime's own
        self._graph_buffers: list[_GraphBuffers] = []
        if not self.cuda_graphs:
            self.graph = self._session(ort, device, threads,
                                       past_rows=self.max_context if self.static_past else None)
        self._check_graph()
        self.supports_hidden = "hidden_states" in m["graph"]["outputs"]
        self.commit_graph = None
        if self.static_past or (device_cache if device_cache is not None else device != "cpu"):
            self.commit_graph = self._session(ort, device, threads, pkg.root / COMMIT,
                                              graph="commit")
        self._table = pkg.embedding_table()  # memory-mapped; block-quantized rows de-quantized
        # int4 kernels take another path for a chunk of one row: such a package pads those
        # forwards (package.run_rows), so plain decoding computes what verification does
        self.min_rows = pkg.weights.min_rows
        self._stats = (np.asarray(m["embeddings"]["mu"], dtype=np.float32),
                       np.asarray(m["embeddings"]["sigma"], dtype=np.float32))

    def check_step(self, topk: int, hidden: bool) -> None:
        check_step(self, topk, hidden)

    def identity(self) -> str:
        """What a measured latency depends on (``latency.cached_latency``): the graph file,
        the device and its options, the threads and the cache size."""
        st = self.package.graph_path.stat()
        return (f"onnxruntime|{self.device_name}|threads={self.threads}|graphs={self.cuda_graphs}|"
                f"cache={self.commit_graph is not None}|ctx={self.max_context}|"
                f"{self.package.graph_path.resolve()}|{st.st_size}|{st.st_mtime_ns}")

    def session(self, rows: int | None = None) -> "OrtSession | GraphSession":
        """A generation's session; ``rows``: a smaller KV cache than the max context (a
        latency measurement's; ignored by a CUDA-graph session, whose graphs read the whole
        cache)."""
        return GraphSession(self) if self.static_past else OrtSession(self, rows)

    def embed(self, token_ids) -> np.ndarray:
        ids = token_ids if isinstance(token_ids, np.ndarray) and token_ids.dtype == np.int64 \
            else np.asarray(token_ids, dtype=np.int64)
        return self._table.rows(ids)  # a fresh float32 array, the caller's to keep

    def embedding_stats(self) -> tuple[np.ndarray, np.ndarray]:
        return self._stats

    # -- loading ----------------------------------------------------------------------------

    @staticmethod
    def _context(limit: int, requested: int | None) -> int:
        if requested is None:
            return limit
        if requested < 2:
            raise ConfigError(f"max context must be >= 2 tokens, got {requested}")
        return min(limit, int(requested))

    def _session(self, ort, device: str, threads: int | None, path: Path | None = None,
                 graph: str = "model", cuda_graph: bool = False, past_rows: int | None = None):
        provider = check_provider(device, self.device_name, ort)
        providers = [provider] if provider == "CPUExecutionProvider" else [
            (provider, self._provider_options(device)), "CPUExecutionProvider"]
        if graph == "commit" and device == "tensorrt":
            providers = [("CUDAExecutionProvider", self._provider_options("cuda")),
                         "CPUExecutionProvider"]
        if cuda_graph:
            providers = [("CUDAExecutionProvider", {**self._provider_options("cuda"),
                                                    "enable_cuda_graph": "1"}),
                         "CPUExecutionProvider"]
        so = ort.SessionOptions()
        so.log_severity_level = 3
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if threads:
            so.intra_op_num_threads = int(threads)
        if past_rows is not None:  # the whole cache is always bound (GraphSession)
            so.add_free_dimension_override_by_name("P", int(past_rows))
        path = path or self.package.graph_path
        if not path.is_file():
            raise ModelLoadError(f"the package {str(self.package.root)!r} has no {path.name}; "
                                 f"re-export it")
        try:
            return ort.InferenceSession(str(path), so, providers=providers)
        except _ort_errors(ort) as e:
            text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ModelLoadError(f"onnxruntime cannot load {str(path)!r}: {text}") from None

    def _provider_options(self, device: str) -> dict:
        """The execution provider's options for ``device`` (on GPU ``device_id``)."""
        gpu = {"device_id": str(self.device_id)}
        if device == "cuda":  # no TF32: an fp32 package's rows must not round by block shape
            return {**gpu, "use_tf32": "0"}
        if device != "tensorrt":
            return {}
        # one optimisation profile over every shape a generation feeds (the EP's execution
        # context stays on profile 0), planned with the package's TensorRT engines; without
        # it the EP would build a new engine for every new cache length
        from edgemtp.runtimes.trt_engine import ort_trt_options

        return {**gpu, **ort_trt_options(self.package)}

    def _check_graph(self) -> None:
        # the manifest describes the graph the package ships; disagreement means a mixed-up
        # or edited package, which would otherwise fail later mid-generation (a shape error,
        # or onnxruntime's "Unexpected input data type")
        def io(values) -> dict:
            return {v.name: (_ORT_TYPES.get(v.type, v.type),
                             [d if isinstance(d, int) else None for d in v.shape])
                    for v in values}

        self.package.check_graph_io(io(self.graph.get_inputs()), io(self.graph.get_outputs()))
        # a fused graph's rotary tables end at the exported context: past it onnxruntime
        # read garbage rows and the text degraded without a word (a hand-edited max_context)
        self.package.check_rotary(self.max_context)


# onnxruntime's element type names as numpy's (Package.check_graph_io)
_ORT_TYPES = {"tensor(float)": "float32", "tensor(float16)": "float16",
              "tensor(double)": "float64", "tensor(int64)": "int64", "tensor(int32)": "int32",
              "tensor(bool)": "bool", "tensor(uint8)": "uint8", "tensor(int8)": "int8"}


def _pad_rows(input_ids, position_ids, tree_mask, rows: int):
    """A block padded to ``rows`` rows with copies of its last row, each attending to itself
    only (never committed: the block's own rows do not see them)."""
    t = len(input_ids)
    ids, pos = np.asarray(input_ids, dtype=np.int64), np.asarray(position_ids, dtype=np.int64)
    ids = np.concatenate([ids, np.repeat(ids[-1:], rows - t)])
    pos = np.concatenate([pos, np.repeat(pos[-1:], rows - t)])
    mask = np.eye(rows, dtype=np.bool_)
    mask[:t, :t] = tree_mask
    return ids, pos, mask


class _CacheCommits:
    """Commit and reset over ``self.kv`` (a :class:`KVCache`), shared by the sessions."""

    cache_len = 0

    def commit(self, rows) -> None:
        rows = np.ascontiguousarray(rows, dtype=np.int64)
        if self.cache_len + len(rows) > self.kv.rows:
            raise ConfigError(f"committing {len(rows)} rows overruns the KV cache "
                              f"({self.cache_len} of {self.kv.rows} rows used)")
        self.kv.commit(rows, self.cache_len)
        self.cache_len += len(rows)

    def reset(self) -> None:
        self.cache_len = 0


class _Bound:
    """One IOBinding of an :class:`OrtSession` for one block shape: ``key`` = (rows, padded
    rows, top-K bound, logits bound, hidden bound). Its inputs are buffers of its own (ids,
    positions, mask; bound once), its outputs the session's shared buffers at this shape, its
    past the session's cache (rebound when the 64-row bucket moves). A session keeps one per
    shape it has run, so a drafter whose block size changes step to step (auto, lookup
    chains, the hybrid) binds a shape's 2 x layers present outputs once, not at each change
    (~160 us of binds on a 30-layer model, cache-cold after a forward)."""

    def __init__(self, s: "OrtSession", key: tuple) -> None:
        b = s.backend
        t, run_t, with_topk, logits, hidden = self.key = key
        self.io = b.graph.io_binding()
        self.host = Binder(b.ort, self.io, "cpu", b.public_binding)
        self.kv_bind = Binder(b.ort, self.io, s.kv.device, b.public_binding, s.kv.device_id)
        self.ids = np.zeros(run_t, dtype=np.int64)
        self.pos = np.zeros(run_t, dtype=np.int64)
        # rows t .. run_t - 1 are padding (``weights.min_rows``): copies of row t - 1 that
        # see only themselves, never committed; the block's own rows do not see them
        self.mask = np.eye(run_t, dtype=np.bool_)
        self.mask_t = self.mask[:t, :t]
        self.mask_src = None  # the read-only array copied into mask_t last step
        self.embeds = np.zeros((0, 0), dtype=np.float32)
        self.embeds_src = None
        self.past_width = -1
        self.views: dict[int, tuple] = {}  # top-K -> this block's rows of the outputs
        self.bind_inputs(s)
        out = self.host.output
        s.kv.bind_present(self.kv_bind, run_t)
        out("argmax", _INT64, [1, run_t], s._argmax.ctypes.data)
        if with_topk:
            out("topk_ids", _INT64, [1, run_t, b.topk], s._top_ids.ctypes.data)
            out("topk_logprobs", _FLOAT32, [1, run_t, b.topk], s._top_lp.ctypes.data)
        if logits:
            out("logits", _FLOAT32, [1, run_t, b.vocab_size], s._logits.ctypes.data)
        if hidden:
            out("hidden_states", _FLOAT32, [1, run_t, b.hidden_size], s._hidden.ctypes.data)

    def bind_inputs(self, s: "OrtSession") -> None:
        # device providers copy a host input when it is bound: there, every step
        bind, run_t = self.host.input, len(self.ids)
        bind("input_ids", _INT64, [1, run_t], self.ids.ctypes.data)
        bind("position_ids", _INT64, [1, run_t], self.pos.ctypes.data)
        if s.backend.past_len:
            bind(PAST_LEN, _INT64, [1], s._past_len.ctypes.data)
        bind("tree_mask", _BOOL, [1, 1, run_t, run_t], self.mask.ctypes.data)
        self.embeds_src = None  # (re)bound with the next step's mask embeddings


class OrtSession(_CacheCommits):
    """One generation on an :class:`OrtBackend`: its KV cache (host or device memory), and
    one IOBinding per block shape it runs (:class:`_Bound`), with the input buffers bound to
    it and the output buffers the shapes share."""

    MAX_BOUND = 128  # block shapes whose bindings a session keeps (the oldest goes first)

    def __init__(self, backend: OrtBackend, rows: int | None = None) -> None:
        self.backend = b = backend
        m, ort = b.package.manifest, b.ort
        layers, dims = m["num_layers"], (m["num_kv_heads"], m["head_dim"])
        cache = b.max_context if rows is None else max(1, min(int(rows), b.max_context))
        if b.commit_graph is not None:
            self.kv = DeviceKV(ort, b.commit_graph, DEVICES[b.device][1], layers, cache,
                               *dims, b.package.np_dtype, b.package.np_value_dtype,
                               device_id=b.device_id)
        elif b.head_major:
            self.kv = HostKVHeads(layers, cache, *dims, b.package.np_dtype)
        else:
            self.kv = HostKV(layers, cache, *dims, b.package.np_dtype,
                             b.package.np_value_dtype)
        self._no_masks = np.zeros((1, b.hidden_size), dtype=np.float32)
        # the fixed inputs are copied into buffers of ours, bound while their shapes hold
        # (see _feed); device providers copy a host input when it is bound, so there they
        # are bound every step
        self._rebind_inputs = b.device != "cpu"
        self._bound: dict[tuple, _Bound] = {}
        self._past_len = np.zeros(1, dtype=np.int64)  # bound while the bindings last
        self.last_run_s = 0.0  # seconds the last forward spent in InferenceSession's run
        self._argmax = np.zeros((1, 0), dtype=np.int64)
        self._top_ids = np.zeros((1, 0, b.topk), dtype=np.int64)
        self._top_lp = np.zeros((1, 0, b.topk), dtype=np.float32)
        self._logits = np.zeros((1, 0, b.vocab_size), dtype=np.float32)
        self._hidden = np.zeros((1, 0, b.hidden_size), dtype=np.float32)
        self.cache_len = 0

    # -- Session interface ------------------------------------------------------------------

    def forward(self, input_ids, position_ids, tree_mask, mask_embeds, topk: int = 0,
                full_logits: bool = False, hidden: bool = False) -> StepOut:
        # input_ids, position_ids: [T]; tree_mask: [T, T] bool; mask_embeds: [k, d] or None
        t, b = len(input_ids), self.backend
        b.check_step(topk, hidden)
        p, run_t = self.cache_len, run_rows(t, b.min_rows)
        self._past_len[0] = p  # before the feed: a device provider copies it when bound
        key = (t, run_t, topk > 0, full_logits, hidden)
        bound = self._bound.get(key)
        if bound is None:
            bound = self._bind(key)
        self._feed(bound, t, run_t, input_ids, position_ids, tree_mask, mask_embeds)
        if b.past_len:  # the past is a bucket of the cache, rebound when the bucket changes
            # never zero wide (a prefill): the CUDA EP's kernels die on an empty past
            # (SIGFPE, onnxruntime-gpu 1.31); the columns past P are masked by past_len
            width = min(max(1, -(-p // PAST_BUCKET)) * PAST_BUCKET, self.kv.rows)
            if (width, self.kv.moves) != bound.past_width:  # (a head-major cache moves)
                self.kv.bind_past(bound.kv_bind, width)
                bound.past_width = (width, self.kv.moves)
        else:
            self.kv.bind_past(bound.kv_bind, p)
        views = bound.views.get(topk)
        if views is None:  # this block's rows of the output buffers
            views = bound.views[topk] = (self._argmax[0, :t], self._top_ids[0, :t, :topk],
                                         self._top_lp[0, :t, :topk])
            if not topk:
                for v in views[1:]:
                    v.flags.writeable = False
        t0 = perf_counter()
        b.graph.run_with_iobinding(bound.io)
        self.last_run_s = perf_counter() - t0
        argmax, top_ids, top_lp = views  # copies: the buffers are reused next step
        # logits and hidden states are views, valid until this session's next forward
        # (no top-K asked: the views are empty, and read-only, so they need no copy; each
        # numpy call after a forward that streamed the weights runs cache-cold, ~10 us)
        return StepOut(argmax=argmax.copy(), topk_ids=top_ids.copy() if topk else top_ids,
                       topk_logprobs=top_lp.copy() if topk else top_lp,
                       logits=self._logits[0, :t] if full_logits else None,
                       hidden=self._hidden[0, :t] if hidden else None)

    def _bind(self, key: tuple) -> _Bound:
        """A binding for this block shape; output buffers grown first if it needs more rows
        (every binding then points at the old ones: all are dropped)."""
        b, run_t = self.backend, key[1]
        grow = self._argmax.shape[1] < run_t or self.kv.cap < run_t  # (the binding grows kv)
        if self._argmax.shape[1] < run_t:
            cap = max(run_t, 64)
            self._argmax = np.zeros((1, cap), dtype=np.int64)
            self._top_ids = np.zeros((1, cap, b.topk), dtype=np.int64)
            self._top_lp = np.zeros((1, cap, b.topk), dtype=np.float32)
        if key[3] and self._logits.shape[1] < run_t:  # one [T, V] buffer, grown, not per step
            self._logits, grow = np.zeros((1, run_t, b.vocab_size), dtype=np.float32), True
        if key[4] and self._hidden.shape[1] < run_t:
            self._hidden, grow = np.zeros((1, run_t, b.hidden_size), dtype=np.float32), True
        if grow:
            self._bound.clear()
        bound = _Bound(self, key)
        if run_t <= _KEEP_MASK:  # a long prefill's binding (and its mask) is not kept
            if len(self._bound) >= self.MAX_BOUND:
                del self._bound[next(iter(self._bound))]
            self._bound[key] = bound
        return bound

    def _feed(self, bound: _Bound, t: int, run_t: int, input_ids, position_ids, tree_mask,
              mask_embeds) -> None:
        # The fixed inputs are copied into the binding's own buffers, which stay bound: a
        # step's copies are a few hundred bytes, while a bind costs a microsecond or more of
        # Python and C++; ORT reads bound memory when it runs. A copy is skipped where the
        # source is the read-only array copied last step (a compiled plan's mask, the
        # no-mask embedding): after a forward that streamed the weights through the caches,
        # each numpy call runs cold (~10 us).
        ids, pos = bound.ids, bound.pos
        ids[:t] = input_ids
        pos[:t] = position_ids
        if run_t > t:
            ids[t:] = ids[t - 1]
            pos[t:] = pos[t - 1]
        if tree_mask is not bound.mask_src:
            if getattr(tree_mask, "shape", None) != (t, t):
                tree_mask = np.asarray(tree_mask, dtype=np.bool_).reshape(t, t)
            bound.mask_t[...] = tree_mask
            bound.mask_src = None if tree_mask.flags.writeable else tree_mask
        if self._rebind_inputs:  # after every input is written: the bind copies it
            bound.bind_inputs(self)
        embeds = self._no_masks if mask_embeds is None else mask_embeds
        if embeds is bound.embeds_src:
            return
        if not isinstance(embeds, np.ndarray):
            embeds = np.asarray(embeds, dtype=np.float32)
        if embeds.shape != bound.embeds.shape or self._rebind_inputs:
            bound.embeds = np.array(embeds, dtype=np.float32, order="C")
            bound.host.input("mask_embeds", _FLOAT32, list(bound.embeds.shape),
                             bound.embeds.ctypes.data)
        else:
            bound.embeds[...] = embeds
        bound.embeds_src = embeds if embeds is self._no_masks else None


class _ShapeIO:
    """Device buffers and the IOBinding of one block shape ``(T, k)`` in a
    :class:`GraphSession`: every input and output at a fixed address, as a CUDA graph
    replay needs (``gpu_graph_id`` is this shape's)."""

    def __init__(self, s: "GraphSession", t: int, k: int, graph_id: int) -> None:
        b, ort = s.backend, s.backend.ort
        m = b.package.manifest

        def buf(shape, dtype):
            return ort.OrtValue.ortvalue_from_shape_and_type(shape, dtype, s.device,
                                                             b.device_id)

        self.t, self.graph_id = t, graph_id
        self.ids, self.pos = buf([1, t], np.int64), buf([1, t], np.int64)
        self.mask = buf([1, 1, t, t], np.bool_)
        self.embeds = buf([k, b.hidden_size], np.float32)
        self.past_len = buf([1], np.int64)
        self.argmax = buf([1, t], np.int64)
        self.top_ids, self.top_lp = buf([1, t, b.topk], np.int64), buf([1, t, b.topk], np.float32)
        self.logits = buf([1, t, b.vocab_size], np.float32)
        self.hidden = buf([1, t, b.hidden_size], np.float32) if b.supports_hidden else None
        io = self.io = b.graph.io_binding()
        for name, value in (("input_ids", self.ids), ("position_ids", self.pos),
                            ("tree_mask", self.mask), ("mask_embeds", self.embeds),
                            (PAST_LEN, self.past_len)):
            io.bind_ortvalue_input(name, value)
        for name, value in (("argmax", self.argmax), ("topk_ids", self.top_ids),
                            ("topk_logprobs", self.top_lp), ("logits", self.logits),
                            ("hidden_states", self.hidden)):
            if value is not None and name in m["graph"]["outputs"]:
                io.bind_ortvalue_output(name, value)
        bind = Binder(ort, io, s.device, device_id=b.device_id)
        s.kv.bind_past(bind, s.kv.rows)   # the whole cache: past_len masks the unused rows
        s.kv.bind_present(bind, t)        # the new K/V buffers never move (see GraphSession)
        self.run_options = ort.RunOptions()
        self.run_options.add_run_config_entry("gpu_graph_id", str(graph_id))


class _GraphBuffers:
    """The device memory a :class:`GraphSession` runs on: the cache, the block's new K/V and
    each block shape's buffers and binding (:class:`_ShapeIO`). A captured graph replays on
    the addresses it was captured with, whichever session replays it, so these belong to
    the backend and pass from a finished generation to the next (``owner``: the session
    using them, weakly). Two generations alive at once get two sets, with graph ids of
    their own."""

    def __init__(self, b: OrtBackend, device: str) -> None:
        m = b.package.manifest
        self.kv = DeviceKV(b.ort, b.commit_graph, device, m["num_layers"], b.max_context,
                           m["num_kv_heads"], m["head_dim"], b.package.np_dtype,
                           b.package.np_value_dtype, device_id=b.device_id)
        # the block's new K/V: allocated once for the longest block (a prefill of the whole
        # context plus mask slots), so their addresses hold for every captured shape
        self.kv.cap = b.max_context + 8
        self.kv.new_k_ptr, self.kv.new_v_ptr = self.kv._alloc_new(self.kv.cap)
        self.shapes: dict[tuple[int, int], _ShapeIO] = {}
        self.owner = lambda: None

    @staticmethod
    def take(session: "GraphSession") -> "_GraphBuffers":
        b = session.backend
        free = next((g for g in b._graph_buffers if g.owner() is None), None)
        if free is None:
            free = _GraphBuffers(b, session.device)
            b._graph_buffers.append(free)
        free.owner = weakref.ref(session)
        return free


class GraphSession(_CacheCommits):
    """One generation on CUDA with captured graphs: the cache, the block's inputs and every
    output live on the device at fixed addresses per block shape; the past is always the
    whole cache (format 2's ``past_len`` masks the unused rows), so each shape's run is the
    same kernels on the same buffers and onnxruntime captures it once as a CUDA graph
    (``gpu_graph_id``, one per shape) and replays it. A step copies ids, positions, mask and
    mask embeddings in (a few KB) and argmax and top-K out; a commit is the package's
    on-device gather. Blocks longer than ``GRAPH_MAX_T`` (a prefill) run uncaptured
    (``gpu_graph_id -1``) on buffers of their own. The buffers and the graph ids are the
    backend's (:class:`_GraphBuffers`): the next generation replays the same graphs on the
    same memory. (Until 2026-11-26 each session numbered its graphs from 1 on buffers of
    its own, so a second generation replayed the first one's captures onto freed memory
    and read garbage tokens: found on an H100, the first time onnxruntime captured.)

    Written against onnxruntime-gpu's documented CUDA-graph contract. On an H200,
    onnxruntime-gpu 1.31.1 refused the capture for the package graph (18 shape nodes placed on
    the CPU), so the backend ran uncaptured (``graphs_off``); see the README's table. Since,
    the export traces no size of T or k and this session's graph is loaded with the past's
    rows fixed, so no shape node is left and onnxruntime captures (H100). On CPU (tests) the
    same buffers and bindings run, uncaptured (``static_past=True``)."""

    GRAPH_MAX_T = 256

    def __init__(self, backend: OrtBackend) -> None:
        self.backend = b = backend
        if not b.past_len or b.commit_graph is None:
            raise ConfigError("fixed-buffer sessions need a format 2 package and the "
                              "device cache (device_cache=True)")
        self.device = DEVICES[b.device][1]
        self.buffers = _GraphBuffers.take(self)
        self.kv, self._shapes = self.buffers.kv, self.buffers.shapes
        self._uncaptured: dict[tuple[int, int], _ShapeIO] = {}
        self.cache_len = 0
        self.last_run_s = 0.0

    def forward(self, input_ids, position_ids, tree_mask, mask_embeds, topk: int = 0,
                full_logits: bool = False, hidden: bool = False) -> StepOut:
        b, n = self.backend, len(input_ids)
        b.check_step(topk, hidden)
        t = run_rows(n, b.min_rows)
        if t > n:  # a throwaway copy of the last row, seeing only itself; never committed
            input_ids, position_ids, tree_mask = _pad_rows(input_ids, position_ids, tree_mask, t)
        if t > self.kv.cap:
            raise ConfigError(f"a block of {t} rows exceeds the context ({b.max_context})")
        embeds = (np.zeros((1, b.hidden_size), dtype=np.float32) if mask_embeds is None
                  else np.ascontiguousarray(mask_embeds, dtype=np.float32))
        key = (t, len(embeds))
        # captured shapes are the backend's, kept for the next generation; an uncaptured
        # prefill's buffers (one per prompt length, logits included) are this session's only,
        # so a server's many prompt lengths do not pile up on the device
        shapes = self._shapes if t <= self.GRAPH_MAX_T else self._uncaptured
        io = shapes.get(key)
        if io is None:
            gid = next(b._graph_ids) if t <= self.GRAPH_MAX_T else -1
            io = shapes[key] = _ShapeIO(self, t, len(embeds), gid)
        io.ids.update_inplace(np.asarray(input_ids, dtype=np.int64).reshape(1, t))
        io.pos.update_inplace(np.asarray(position_ids, dtype=np.int64).reshape(1, t))
        io.mask.update_inplace(np.asarray(tree_mask, dtype=np.bool_).reshape(1, 1, t, t))
        io.embeds.update_inplace(embeds)
        io.past_len.update_inplace(np.array([self.cache_len], dtype=np.int64))
        t0 = perf_counter()
        b.graph.run_with_iobinding(io.io, io.run_options)
        self.last_run_s = perf_counter() - t0
        out = StepOut(argmax=io.argmax.numpy()[0, :n],
                      topk_ids=io.top_ids.numpy()[0, :n, :topk],
                      topk_logprobs=io.top_lp.numpy()[0, :n, :topk])
        if full_logits:
            out.logits = io.logits.numpy()[0, :n]
        if hidden:
            out.hidden = io.hidden.numpy()[0, :n]
        return out

