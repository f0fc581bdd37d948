"""TensorRT backend: runs a package's prebuilt engine (``edgemtp build-engine``) on device
buffers, behind the same interface as the onnxruntime backend.

- :class:`TrtBackend` deserializes the engine built for this GPU architecture and TensorRT
  version once (the weights); each :class:`TrtSession` (one generation) has its own execution
  context, KV cache and I/O buffers on the device.
- The KV cache is ``[L, max_context, H_kv, D]`` for K and V; layer ``i``'s past is the prefix
  ``cache[i, :P]``, bound by address (no copy), and its present output lands in
  ``new[i, :T]``; a commit gathers the accepted rows into the cache on the device.
- Per step the host uploads ids, positions, the block mask and the mask embeddings, picks the
  optimisation profile (:func:`~edgemtp.runtimes.trt_engine.select_profile`), and reads back
  argmax and top-K (O(T * K); logits and hidden states only when asked) after one
  synchronisation.
- Sessions of one backend run one at a time (a lock): TensorRT lets execution contexts of
  one engine use a profile only one at a time.

Device memory comes from torch's CUDA tensors when torch with CUDA is importable (torch is
then only the allocator and copy engine), else from cuda-python (``pip install
cuda-python``). This module has not run on a GPU yet (see README: what was measured).
"""

from __future__ import annotations

import math
import threading
from pathlib import Path
from time import perf_counter

import numpy as np

from edgemtp.backend import StepOut, check_options
from edgemtp.errors import BackendUnavailableError, ConfigError, EdgeMTPError, ModelLoadError
from edgemtp.runtimes.package import NP_DTYPES, PAST_LEN, check_step, kv_names, load_package
from edgemtp.runtimes.trt_engine import (_logger, check_trt_cache, check_trt_weights,
                                         engine_name, import_tensorrt, select_profile)

ALIGN_ROWS = 64  # row counts of cache and block buffers are rounded up to a multiple (the
# block buffers' first size too): a bound address must be 256-byte aligned (TensorRT's
# setTensorAddress), and 64 rows of any K/V row (a multiple of 4 bytes) are


def aligned_rows(n: int) -> int:
    """``n`` rounded up to a whole number of ALIGN_ROWS.

    >>> aligned_rows(1), aligned_rows(64), aligned_rows(65)
    (64, 64, 128)
    """
    return -(-max(1, n) // ALIGN_ROWS) * ALIGN_ROWS


class DeviceArray:
    """A device allocation: its address, shape and dtype, and what keeps it alive."""

    __slots__ = ("ptr", "shape", "dtype", "owner")

    def __init__(self, ptr: int, shape: tuple[int, ...], dtype, owner) -> None:
        self.ptr, self.shape, self.dtype, self.owner = ptr, shape, np.dtype(dtype), owner


def runs(rows: np.ndarray, p: int) -> list[tuple[int, int, int]]:
    """Consecutive stretches of ``rows`` as ``(first source row, count, first cache row)``:
    one device copy each (a top-1 path is one stretch).

    >>> runs(np.array([0, 1, 2, 5, 9, 10]), p=40)
    [(0, 3, 40), (5, 1, 43), (9, 2, 44)]
    """
    out, at = [], p
    for row in rows.tolist():
        if out and out[-1][0] + out[-1][1] == row:
            first, count, dest = out[-1]
            out[-1] = (first, count + 1, dest)
        else:
            out.append((row, 1, at))
        at += 1
    return out


class TorchMemory:
    """Device memory as torch CUDA tensors, on one stream of ours."""

    def __init__(self, torch, index: int) -> None:
        if index >= torch.cuda.device_count():
            raise BackendUnavailableError(f"backend 'tensorrt' needs CUDA GPU {index}, and "
                                          f"this machine has {torch.cuda.device_count()}")
        self.torch, self.device = torch, torch.device("cuda", index)
        # TensorRT loads engines and creates contexts on the current device: make it ours
        torch.cuda.set_device(index)
        self._stream = torch.cuda.Stream(self.device)
        self.stream = self._stream.cuda_stream  # the handle TensorRT enqueues on

    def identity(self) -> tuple[str, str]:
        props = self.torch.cuda.get_device_properties(self.device)
        return props.name, f"{props.major}.{props.minor}"

    def _dtype(self, dtype):
        return self.torch.from_numpy(np.empty(0, dtype=dtype)).dtype

    def empty(self, shape, dtype) -> DeviceArray:
        t = self.torch.empty(shape, dtype=self._dtype(dtype), device=self.device)
        return DeviceArray(t.data_ptr(), tuple(shape), dtype, t)

    def host(self, shape, dtype) -> np.ndarray:
        # pinned: device-to-host copies run asynchronously, one synchronisation per step
        return self.torch.empty(shape, dtype=self._dtype(dtype), pin_memory=True).numpy()

    def upload(self, buf: DeviceArray, arr: np.ndarray) -> None:
        with self.torch.cuda.stream(self._stream):
            buf.owner.view(-1)[:arr.size].copy_(self.torch.from_numpy(arr.reshape(-1)),
                                                non_blocking=True)

    def download(self, arr: np.ndarray, buf: DeviceArray, n: int) -> None:
        with self.torch.cuda.stream(self._stream):
            self.torch.from_numpy(arr).view(-1)[:n].copy_(buf.owner.view(-1)[:n],
                                                           non_blocking=True)

    def commit(self, cache: DeviceArray, new: DeviceArray, rows: np.ndarray, p: int) -> None:
        # cache, new: [L, rows, H_kv, D]; a gather of the accepted rows on the device
        with self.torch.cuda.stream(self._stream):
            idx = self.torch.from_numpy(rows).to(self.device, non_blocking=True)
            cache.owner[:, p:p + len(rows)] = new.owner.index_select(1, idx)

    def synchronize(self) -> None:
        self._stream.synchronize()


class CudaMemory:
    """Device memory from cuda-python's runtime bindings, on one stream of ours."""

    def __init__(self, cudart, index: int) -> None:
        self.rt, self.index = cudart, index
        count = self._ok(cudart.cudaGetDeviceCount(), "counting GPUs")
        if index >= count:
            raise BackendUnavailableError(f"backend 'tensorrt' needs CUDA GPU {index}, and "
                                          f"this machine has {count}")
        self._ok(cudart.cudaSetDevice(index), "selecting the GPU")
        self._stream = self._ok(cudart.cudaStreamCreate(), "creating a stream")
        self.stream = int(self._stream)
        kinds = cudart.cudaMemcpyKind
        self._h2d, self._d2h = kinds.cudaMemcpyHostToDevice, kinds.cudaMemcpyDeviceToHost
        self._d2d = kinds.cudaMemcpyDeviceToDevice

    def _ok(self, result, what: str):
        err, *rest = result
        if err != self.rt.cudaError_t.cudaSuccess:
            raise EdgeMTPError(f"CUDA failed {what}: {getattr(err, 'name', err)}")
        return rest[0] if len(rest) == 1 else None

    def identity(self) -> tuple[str, str]:
        props = self._ok(self.rt.cudaGetDeviceProperties(self.index), "reading the GPU")
        name = props.name.decode() if isinstance(props.name, bytes) else str(props.name)
        return name.rstrip("\x00"), f"{props.major}.{props.minor}"

    def empty(self, shape, dtype) -> DeviceArray:
        nbytes = max(1, math.prod(shape) * np.dtype(dtype).itemsize)
        ptr = int(self._ok(self.rt.cudaMalloc(nbytes), f"allocating {nbytes} bytes"))
        return DeviceArray(ptr, tuple(shape), dtype, _Free(self.rt, ptr))

    def host(self, shape, dtype) -> np.ndarray:
        return np.zeros(shape, dtype=dtype)

    def upload(self, buf: DeviceArray, arr: np.ndarray) -> None:
        self._ok(self.rt.cudaMemcpyAsync(buf.ptr, arr.ctypes.data, arr.nbytes, self._h2d,
                                         self._stream), "copying to the GPU")

    def download(self, arr: np.ndarray, buf: DeviceArray, n: int) -> None:
        self._ok(self.rt.cudaMemcpyAsync(arr.ctypes.data, buf.ptr, n * arr.itemsize,
                                         self._d2h, self._stream), "copying from the GPU")

    def commit(self, cache: DeviceArray, new: DeviceArray, rows: np.ndarray, p: int) -> None:
        # one 2D copy per stretch of consecutive rows moves them for every layer at once
        row = math.prod(cache.shape[2:]) * cache.dtype.itemsize
        layers, dst_pitch, src_pitch = cache.shape[0], cache.shape[1] * row, new.shape[1] * row
        for first, count, dest in runs(rows, p):
            self._ok(self.rt.cudaMemcpy2DAsync(cache.ptr + dest * row, dst_pitch,
                                               new.ptr + first * row, src_pitch, count * row,
                                               layers, self._d2d, self._stream), "committing")

    def synchronize(self) -> None:
        self._ok(self.rt.cudaStreamSynchronize(self._stream), "synchronising")


class _Free:
    def __init__(self, rt, ptr: int) -> None:
        self.rt, self.ptr = rt, ptr

    def __del__(self) -> None:
        self.rt.cudaFree(self.ptr)


def device_memory(index: int = 0):
    """torch's CUDA memory when torch sees a GPU, else cuda-python's; one line when neither
    can give device memory."""
    try:
        import torch
    except ModuleNotFoundError:
        torch = None
    if torch is not None and torch.cuda.is_available():
        return TorchMemory(torch, index)
    try:
        from cuda.bindings import runtime as cudart  # cuda-python >= 12.6
    except ModuleNotFoundError:
        try:
            from cuda import cudart  # older cuda-python
        except ModuleNotFoundError:
            cudart = None
    if cudart is None:
        seen = "torch sees no CUDA GPU and " if torch is not None else ""
        raise BackendUnavailableError(f"backend 'tensorrt' needs device memory: {seen}neither "
                                      f"torch with CUDA nor cuda-python is installed "
                                      f"(pip install \"cuda-python>=12.6,<13\": 13.x needs a "
                                      f"CUDA 13 driver)")
    return CudaMemory(cudart, index)


def cuda_device(index: int = 0) -> tuple[str, str]:
    """(name, compute capability) of CUDA GPU ``index``."""
    return device_memory(index).identity()


def _device_index(device: str) -> int:
    name, _, index = device.partition(":")
    if name != "cuda" or (index and not index.isdigit()):
        raise ConfigError(f"backend 'tensorrt' runs on an NVIDIA GPU: pass --device cuda (or "
                          f"cuda:N), got {device!r}")
    return int(index or 0)


class TrtBackend:
    """A package's TensorRT engine (the weights) on one GPU, shared by every :meth:`session`.
    ``dtype`` must be the package's own (or None); ``threads`` and ``trust_remote_code`` are
    accepted for interface parity."""

    name = "tensorrt"

    def __init__(self, package_dir, device: str = "cuda", threads: int | None = None,
                 max_context: int | None = None, dtype: str | None = None,
                 trust_remote_code: bool = False) -> None:
        check_options(device, dtype, max_context, threads)
        index = _device_index(device)
        self.package = pkg = load_package(package_dir)
        m = pkg.meta
        if dtype is not None and dtype != m.dtype:
            raise ConfigError(f"the package {str(pkg.root)!r} computes in {m.dtype} "
                              f"({pkg.weights.name} weights), and a package's dtype is fixed at "
                              f"export; drop --dtype {dtype}")
        check_trt_weights(pkg.weights.format, f"the package {str(pkg.root)!r}")
        check_trt_cache(pkg, f"the package {str(pkg.root)!r}")
        try:  # the graph the engines were built from, against the manifest (types included)
            pkg.check_graph_file()
        except ImportError:  # (onnx is not needed to run engines)
            pass
        # what this machine lacks first (TensorRT, a GPU), then the engine: build-engine
        # would need them too
        trt = self.trt = import_tensorrt()
        self.memory = device_memory(index)
        if not m.engines:
            raise ModelLoadError(f"the package {str(pkg.root)!r} has no TensorRT engine; build "
                                 f"one on this machine: edgemtp build-engine {str(pkg.root)}")
        self.engine, self.info = self._load_engine(trt, pkg)
        self.vocab_size, self.hidden_size, self.topk = m.vocab_size, m.hidden_size, m.topk
        self.eos_token_ids = tuple(m.eos_token_ids)
        self.has_tokenizer = m.tokenizer
        self.source = m.source if m.source and (Path(m.source) / "config.json").is_file() else None
        self.max_context = min(m.max_context, max_context or m.max_context)
        self.supports_hidden = "hidden_states" in m.graph.outputs
        self.k_max = max(p.k for p in m.plans)
        self.lock = threading.Lock()
        self._scratch: DeviceArray | None = None  # the contexts' shared activation memory
        self._table = pkg.embedding_table()  # (memory-mapped, whichever layout it has)
        self._stats = (np.asarray(m.embeddings.mu, dtype=np.float32),
                       np.asarray(m.embeddings.sigma, dtype=np.float32))

    def _load_engine(self, trt, pkg):
        gpu, capability = self.memory.identity()
        want = engine_name(trt.__version__, capability)
        info = next((e for e in pkg.meta.engines if e.file == want), None)
        if info is None:
            built = "; ".join(e.label for e in pkg.meta.engines)
            raise ModelLoadError(f"the package {str(pkg.root)!r} has no engine for this machine "
                                 f"({gpu}, sm {capability}, TensorRT {trt.__version__}): it has "
                                 f"{built}; build one here: edgemtp build-engine {str(pkg.root)}")
        pkg.check_engine(info)  # (only this one: the others are other GPUs')
        runtime = trt.Runtime(_logger(trt))
        engine = runtime.deserialize_cuda_engine((pkg.root / info.file).read_bytes())
        if engine is None:
            raise ModelLoadError(f"TensorRT {trt.__version__} cannot load the engine {info.label} "
                                 f"(its log above says why); rebuild it: edgemtp build-engine "
                                 f"{str(pkg.root)}")
        names = {engine.get_tensor_name(i) for i in range(engine.num_io_tensors)}
        want_names = set(pkg.meta.graph.inputs) | set(pkg.meta.graph.outputs)
        if names != want_names or engine.num_optimization_profiles != len(info.profiles):
            raise ModelLoadError(f"the engine {info.label} does not match the package's graph "
                                 f"and profiles; rebuild it: edgemtp build-engine "
                                 f"{str(pkg.root)}")
        self._runtime = runtime  # kept alive as long as the engine
        return engine, info

    def session(self) -> TrtSession:
        return TrtSession(self)

    def context(self):
        """An execution context on the engine. Its activation memory (as much as the engine's
        largest profile needs) is one scratch buffer that every session of this backend
        shares, where TensorRT lets the caller manage it (10.1 on): sessions run one at a
        time (``lock``), on one stream, and each context would otherwise hold its own."""
        trt, engine = self.trt, self.engine
        strategy = getattr(trt, "ExecutionContextAllocationStrategy", None)
        size = getattr(engine, "device_memory_size_v2", None)
        if strategy is None or size is None:
            return engine.create_execution_context()
        context = engine.create_execution_context(strategy.USER_MANAGED)
        if context is None:
            raise EdgeMTPError("TensorRT could not create an execution context (its log "
                               "above says why)")
        if self._scratch is None or self._scratch.shape[0] < size:
            self._scratch = self.memory.empty((max(1, int(size)),), np.uint8)
        context.set_device_memory(self._scratch.ptr, int(size))
        return context

    def embed(self, token_ids) -> np.ndarray:
        return self._table.rows(np.asarray(token_ids, dtype=np.int64))

    def embedding_stats(self) -> tuple[np.ndarray, np.ndarray]:
        return self._stats


class TrtSession:
    """One generation on a :class:`TrtBackend`: an execution context, a KV cache and I/O
    buffers on the device, and pinned host buffers for what comes back."""

    def __init__(self, backend: TrtBackend) -> None:
        self.backend = b = backend
        m, mem, engine = b.package.meta, b.memory, b.engine
        self.context = b.context()
        self._dtype = {n: np.dtype(b.trt.nptype(engine.get_tensor_dtype(n)))
                       for n in (*m.graph.inputs, *m.graph.outputs)}
        layers, self._tail = m.num_layers, (m.num_kv_heads, m.head_dim)
        kv_dtype = NP_DTYPES[m.dtype]
        rows = aligned_rows(b.max_context)  # (each layer's past 256-byte aligned)
        self.k = mem.empty((layers, rows, *self._tail), kv_dtype)
        self.v = mem.empty((layers, rows, *self._tail), kv_dtype)
        self._row_bytes = math.prod(self._tail) * np.dtype(kv_dtype).itemsize
        stride = rows * self._row_bytes  # layer i's past starts at cache[i, 0]
        self._past = [(name, base.ptr + i * stride) for i in range(layers) for name, base in
                      zip(kv_names("past", layers)[2 * i:2 * i + 2], (self.k, self.v))]
        self._embeds = mem.empty((b.k_max, m.hidden_size), self._dtype["mask_embeds"])
        # format 2 graphs take past_len; the past is bound as exactly P rows here
        self._past_len = (mem.empty((1,), self._dtype[PAST_LEN]) if PAST_LEN in m.graph.inputs
                          else None)
        self._no_masks = np.zeros((1, m.hidden_size), dtype=np.float32)
        self.cap, self.profile, self.cache_len, self.last_run_s = 0, -1, 0, 0.0
        self._profile_for: dict[tuple[int, bool, int], int] = {}
        self._grow(ALIGN_ROWS)

    def _grow(self, t: int) -> None:
        # block buffers sized for ``cap`` rows, grown (never per step) when a block is larger
        if t <= self.cap:
            return
        b, mem, cap = self.backend, self.backend.memory, aligned_rows(t)
        widths = {"input_ids": (cap,), "position_ids": (cap,), "tree_mask": (cap * cap,),
                  "argmax": (cap,), "topk_ids": (cap, b.topk), "topk_logprobs": (cap, b.topk),
                  "logits": (cap, b.vocab_size)}
        if b.supports_hidden:
            widths["hidden_states"] = (cap, b.hidden_size)
        self._dev = {n: mem.empty(shape, self._dtype[n]) for n, shape in widths.items()}
        self._host = {n: mem.host(widths[n], self._dtype[n])
                      for n in ("argmax", "topk_ids", "topk_logprobs")}
        layers = b.package.meta.num_layers
        self.new_k = mem.empty((layers, cap, *self._tail), self.k.dtype)
        self.new_v = mem.empty((layers, cap, *self._tail), self.v.dtype)
        self.cap = cap
        self._set_addresses()

    def _set_addresses(self) -> None:
        stride = self.cap * self._row_bytes
        bind = [(name, buf.ptr) for name, buf in self._dev.items()]
        bind.append(("mask_embeds", self._embeds.ptr))
        if self._past_len is not None:
            bind.append((PAST_LEN, self._past_len.ptr))
        bind += self._past
        present = kv_names("present", self.backend.package.meta.num_layers)
        for i in range(len(present) // 2):
            bind += [(present[2 * i], self.new_k.ptr + i * stride),
                     (present[2 * i + 1], self.new_v.ptr + i * stride)]
        for name, ptr in bind:
            if not self.context.set_tensor_address(name, ptr):
                raise EdgeMTPError(f"TensorRT refused the address of {name} ({ptr:#x}, "
                                   f"{'' if ptr % 256 == 0 else 'not '}256-byte aligned; its "
                                   f"log above says why)")

    # -- Session interface ------------------------------------------------------------------

    def forward(self, input_ids, position_ids, tree_mask, mask_embeds, topk: int = 0,
                full_logits: bool = False, hidden: bool = False) -> StepOut:
        # input_ids, position_ids: [T]; tree_mask: [T, T] bool; mask_embeds: [k, d] or None
        t, b = len(input_ids), self.backend
        check_step(b, topk, hidden)
        embeds = self._no_masks if mask_embeds is None else mask_embeds
        with b.lock:
            self._grow(t)
            self._use_profile(t, len(embeds))
            self._feed(t, input_ids, position_ids, tree_mask, embeds)
            t0 = perf_counter()
            if not self.context.execute_async_v3(b.memory.stream):
                raise EdgeMTPError(f"TensorRT failed to run a block of {t} rows after "
                                   f"{self.cache_len} cached rows (its log above says why)")
            out = self._read(t, topk, full_logits, hidden)
            b.memory.synchronize()
            self.last_run_s = perf_counter() - t0  # the run and the copies back
        return StepOut(argmax=out[0].copy(), topk_ids=out[1][:, :topk].copy(),
                       topk_logprobs=out[2][:, :topk].copy(), logits=out[3], hidden=out[4])

    def _use_profile(self, t: int, k: int) -> None:
        # the profile chosen for (T, an empty cache or not, k) serves until a step's P falls
        # outside it (a block near the end of the context: block T=30 covers P <= ctx - 30,
        # the catch-all the rest)
        profiles, p, key = self.backend.info.profiles, self.cache_len, (t, self.cache_len == 0, k)
        index = self._profile_for.get(key)
        if index is None or not profiles[index].covers(t, p, k):
            index = self._profile_for[key] = select_profile(profiles, t, p, k)
        if index != self.profile:  # a switch drops the context's shapes: all set again below
            try:
                self.context.set_optimization_profile_async(index, self.backend.memory.stream)
            except RuntimeError as e:  # (TensorRT's Python API raises where C++ returns false)
                raise EdgeMTPError(f"TensorRT could not switch to the profile "
                                   f"{profiles[index].name!r} for a block of {t} rows after {p} "
                                   f"cached rows: {str(e).strip().splitlines()[0]}") from None
            self.profile = index
            self._set_addresses()

    def _feed(self, t: int, input_ids, position_ids, tree_mask, embeds) -> None:
        mem, dev, ctx, d = self.backend.memory, self._dev, self.context, self._dtype
        mem.upload(dev["input_ids"], np.ascontiguousarray(input_ids, dtype=d["input_ids"]))
        mem.upload(dev["position_ids"],
                   np.ascontiguousarray(position_ids, dtype=d["position_ids"]))
        mem.upload(dev["tree_mask"], np.ascontiguousarray(tree_mask, dtype=np.bool_).reshape(-1))
        embeds = np.ascontiguousarray(embeds, dtype=d["mask_embeds"])
        mem.upload(self._embeds, embeds)
        shapes = [("input_ids", (1, t)), ("position_ids", (1, t)), ("tree_mask", (1, 1, t, t)),
                  ("mask_embeds", embeds.shape)]
        past = (1, self.cache_len, *self._tail)
        shapes += [(name, past) for name, _ in self._past]
        if self._past_len is not None:
            mem.upload(self._past_len, np.array([self.cache_len], dtype=d[PAST_LEN]))
            shapes.append((PAST_LEN, (1,)))
        for name, shape in shapes:
            if not ctx.set_input_shape(name, tuple(int(n) for n in shape)):
                profile = self.backend.info.profiles[self.profile]
                raise EdgeMTPError(f"TensorRT refused the shape {tuple(shape)} of {name} under "
                                   f"the profile {profile.name!r} (T {profile.T}, P "
                                   f"{profile.P}, k {profile.k}; its log above says why)")

    def _read(self, t: int, topk: int, logits: bool, hidden: bool):
        # queued copies back; the caller synchronises once
        mem, dev, host, k = self.backend.memory, self._dev, self._host, self.backend.topk
        mem.download(host["argmax"], dev["argmax"], t)
        if topk:
            mem.download(host["topk_ids"], dev["topk_ids"], t * k)
            mem.download(host["topk_logprobs"], dev["topk_logprobs"], t * k)
        extra = []
        for wanted, name, width in ((logits, "logits", self.backend.vocab_size),
                                    (hidden, "hidden_states", self.backend.hidden_size)):
            arr = np.empty((t, width), dtype=self._dtype[name]) if wanted else None
            if wanted:
                mem.download(arr, dev[name], t * width)
            extra.append(arr)
        return host["argmax"][:t], host["topk_ids"][:t], host["topk_logprobs"][:t], *extra

    def commit(self, rows) -> None:
        rows = np.ascontiguousarray(rows, dtype=np.int64)
        b = self.backend
        if self.cache_len + len(rows) > b.max_context:
            raise ConfigError(f"committing {len(rows)} rows overruns the KV cache "
                              f"({self.cache_len} of {b.max_context} rows used)")
        if len(rows):
            with b.lock:  # queued on the stream, ahead of the next forward
                b.memory.commit(self.k, self.new_k, rows, self.cache_len)
                b.memory.commit(self.v, self.new_v, rows, self.cache_len)
        self.cache_len += len(rows)

    def reset(self) -> None:
        self.cache_len = 0
