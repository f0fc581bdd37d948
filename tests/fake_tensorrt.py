"""Stand-ins for TensorRT's Python API and cuda-python's runtime, for machines with neither
(CI, this project's CPU machines), so the TensorRT builder and backend run everything but
TensorRT itself.

- :data:`cudart` is the "device": ``cudaMalloc`` hands out host memory at real, 256-byte
  aligned addresses (filled with NaN bytes, so a read of memory nothing wrote shows), and every
  copy is ``ctypes.memmove``, bounds-checked against the allocation it lands in.
- :mod:`tensorrt` here builds an "engine" that records the optimisation profiles the builder
  was given (checked as TensorRT checks them: every input, ``min <= opt <= max``, strongly
  typed networks take no precision flags) and, to run, an onnxruntime session over the same
  ``model.onnx``. An execution context checks what TensorRT checks before it runs (addresses
  256-byte aligned, each input's shape inside the selected profile, activation memory set
  where the caller manages it), reads its inputs from the addresses bound and writes its
  outputs to theirs, bounds-checked. So the backend's binding, strides, profile choice and
  cache commits are exercised with real numbers, and its tokens can be compared with the
  onnxruntime backend's.

What it cannot show: TensorRT's own kernels, numerics and tactic choice, its build time and
memory, and a real GPU's asynchrony (every copy here completes at once).
"""

from __future__ import annotations

import ctypes
import json
import types
from pathlib import Path

import numpy as np

ALIGN = 256
GARBAGE = 0xFF  # a float made of these bytes is NaN


# -- the device ---------------------------------------------------------------------------


class _Err:
    cudaSuccess = 0


class _Kind:
    cudaMemcpyHostToDevice, cudaMemcpyDeviceToHost, cudaMemcpyDeviceToDevice = 1, 2, 3


class FakeCudart:
    """The part of ``cuda.bindings.runtime`` the backend calls, over host memory."""

    cudaError_t = _Err
    cudaMemcpyKind = _Kind

    def __init__(self) -> None:
        self.blocks: dict[int, np.ndarray] = {}  # aligned address -> the array holding it
        self.sizes: dict[int, int] = {}
        self.device = -1

    # allocations ---------------------------------------------------------------------------

    def cudaMalloc(self, nbytes: int):
        raw = np.full(int(nbytes) + ALIGN, GARBAGE, dtype=np.uint8)
        ptr = raw.ctypes.data
        ptr += -ptr % ALIGN
        self.blocks[ptr], self.sizes[ptr] = raw, int(nbytes)
        return _Err.cudaSuccess, ptr

    def cudaFree(self, ptr: int):
        self.blocks.pop(ptr, None)
        self.sizes.pop(ptr, None)
        return (_Err.cudaSuccess,)

    def check(self, ptr: int, nbytes: int, what: str) -> None:
        """``[ptr, ptr + nbytes)`` lies inside one allocation."""
        for base, size in self.sizes.items():
            if base <= ptr and ptr + nbytes <= base + size:
                return
        raise AssertionError(f"{what}: {nbytes} bytes at {ptr:#x} are outside every device "
                             f"allocation")

    def view(self, ptr: int, shape, dtype) -> np.ndarray:
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        self.check(ptr, nbytes, f"a {dtype} tensor of shape {tuple(shape)}")
        buf = (ctypes.c_uint8 * max(1, nbytes)).from_address(ptr)
        return np.frombuffer(buf, dtype=np.uint8, count=nbytes).view(dtype).reshape(shape)

    # the rest -------------------------------------------------------------------------------

    def cudaGetDeviceCount(self):
        return _Err.cudaSuccess, 1

    def cudaSetDevice(self, index: int):
        self.device = index
        return (_Err.cudaSuccess,)

    def cudaStreamCreate(self):
        return _Err.cudaSuccess, 7

    def cudaGetDeviceProperties(self, index: int):
        return _Err.cudaSuccess, types.SimpleNamespace(name=b"Fake Orin\x00", major=8, minor=7)

    def cudaMemcpyAsync(self, dst: int, src: int, nbytes: int, kind, stream):
        if kind in (_Kind.cudaMemcpyHostToDevice, _Kind.cudaMemcpyDeviceToDevice):
            self.check(dst, nbytes, "a copy's destination")
        if kind in (_Kind.cudaMemcpyDeviceToHost, _Kind.cudaMemcpyDeviceToDevice):
            self.check(src, nbytes, "a copy's source")
        ctypes.memmove(dst, src, nbytes)
        return (_Err.cudaSuccess,)

    def cudaMemcpy2DAsync(self, dst: int, dpitch: int, src: int, spitch: int, width: int,
                          height: int, kind, stream):
        for row in range(height):
            self.cudaMemcpyAsync(dst + row * dpitch, src + row * spitch, width, kind, stream)
        return (_Err.cudaSuccess,)

    def cudaStreamSynchronize(self, stream):
        return (_Err.cudaSuccess,)


# -- TensorRT -----------------------------------------------------------------------------


def tensorrt_module(cudart: FakeCudart, version: str = "10.3.0") -> types.ModuleType:
    """A fresh ``tensorrt`` stand-in whose engines run on ``cudart``'s memory."""
    trt = types.ModuleType("tensorrt")
    trt.__version__ = version
    trt.built = []  # what each build was given (tests read it)

    class Logger:
        WARNING = 2

        def __init__(self, level=None) -> None:
            self.level = level

    class NetworkDefinitionCreationFlag:
        STRONGLY_TYPED = 1

    class BuilderFlag:
        FP16, TF32 = 0, 1

    class MemoryPoolType:
        WORKSPACE = 0

    class ExecutionContextAllocationStrategy:
        STATIC, ON_PROFILE_CHANGE, USER_MANAGED = 0, 1, 2

    class IProgressMonitor:
        def __init__(self) -> None:
            pass

    class Network:
        def __init__(self, flags: int) -> None:
            self.flags, self.graph, self.inputs = flags, None, {}

    class OnnxParser:
        num_errors = 0

        def __init__(self, network: Network, logger) -> None:
            self.network = network

        def parse_from_file(self, path: str) -> bool:
            import onnx

            proto = onnx.load(path, load_external_data=False)
            self.network.graph = path
            self.network.inputs = {i.name: len(i.type.tensor_type.shape.dim)
                                   for i in proto.graph.input}
            return True

    class Profile:
        def __init__(self) -> None:
            self.shapes: dict[str, tuple] = {}

        def set_shape(self, name, lo, opt, hi) -> None:
            self.shapes[name] = (tuple(lo), tuple(opt), tuple(hi))

    class TimingCache:
        def serialize(self):
            return b"fake timing cache"

    class Config:
        def __init__(self) -> None:
            self.flags = {BuilderFlag.TF32}  # TensorRT's default
            self.profiles, self.cache, self.workspace = [], None, None
            self.progress_monitor = None

        def set_flag(self, flag) -> None:
            self.flags.add(flag)

        def clear_flag(self, flag) -> None:
            self.flags.discard(flag)

        def set_memory_pool_limit(self, pool, size: int) -> None:
            self.workspace = size

        def create_timing_cache(self, blob: bytes):
            return None if blob.startswith(b"damaged") else TimingCache()

        def set_timing_cache(self, cache, ignore_mismatch: bool) -> bool:
            if not isinstance(cache, TimingCache):  # pybind: a TypeError, not False
                raise TypeError("set_timing_cache(): incompatible function arguments")
            self.cache = cache
            return True

        def get_timing_cache(self):
            return self.cache

        def add_optimization_profile(self, profile: Profile) -> int:
            self.profiles.append(profile)
            return len(self.profiles) - 1

    class Builder:
        def __init__(self, logger) -> None:
            pass

        def create_network(self, flags: int) -> Network:
            return Network(flags)

        def create_builder_config(self) -> Config:
            return Config()

        def create_optimization_profile(self) -> Profile:
            return Profile()

        def build_serialized_network(self, network: Network, config: Config):
            typed = network.flags & (1 << NetworkDefinitionCreationFlag.STRONGLY_TYPED)
            assert typed, "the network is not strongly typed"
            assert BuilderFlag.FP16 not in config.flags, "FP16 flag on a strongly typed network"
            assert config.cache is not None, "no timing cache set"
            assert config.profiles, "no optimisation profile"
            for p in config.profiles:
                assert set(p.shapes) == set(network.inputs), "a profile misses inputs"
                for name, (lo, opt, hi) in p.shapes.items():
                    assert len(lo) == len(opt) == len(hi) == network.inputs[name], name
                    assert all(a <= b <= c for a, b, c in zip(lo, opt, hi)), (name, lo, opt, hi)
            monitor = config.progress_monitor
            if monitor is not None:
                monitor.phase_start("Building", None, 2)
                for step in range(2):
                    assert monitor.step_complete("Building", step)
                monitor.phase_finish("Building")
            trt.built.append({"flags": sorted(config.flags), "workspace": config.workspace,
                              "profiles": [p.shapes for p in config.profiles]})
            return json.dumps({"graph": network.graph,
                               "profiles": [{n: [list(x) for x in s] for n, s in p.shapes.items()}
                                            for p in config.profiles]}).encode()

    class Runtime:
        def __init__(self, logger) -> None:
            pass

        def deserialize_cuda_engine(self, blob: bytes):
            try:
                spec = json.loads(blob)
            except ValueError:
                return None
            return Engine(spec)

    ort_types = {"tensor(float)": np.float32, "tensor(float16)": np.float16,
                 "tensor(int64)": np.int64, "tensor(bool)": np.bool_,
                 "tensor(int32)": np.int32}

    class Engine:
        device_memory_size_v2 = 3 * ALIGN

        def __init__(self, spec: dict) -> None:
            import onnxruntime as ort

            options = ort.SessionOptions()
            options.intra_op_num_threads = 1
            self.session = ort.InferenceSession(spec["graph"], options,
                                                providers=["CPUExecutionProvider"])
            self.profiles = [{n: tuple(tuple(x) for x in s) for n, s in p.items()}
                             for p in spec["profiles"]]
            self.inputs = [i.name for i in self.session.get_inputs()]
            self.outputs = [o.name for o in self.session.get_outputs()]
            self.dtypes = {i.name: np.dtype(ort_types[i.type]) for i in
                           (*self.session.get_inputs(), *self.session.get_outputs())}

        @property
        def num_io_tensors(self) -> int:
            return len(self.inputs) + len(self.outputs)

        @property
        def num_optimization_profiles(self) -> int:
            return len(self.profiles)

        def get_tensor_name(self, i: int) -> str:
            return (self.inputs + self.outputs)[i]

        def get_tensor_dtype(self, name: str):
            return self.dtypes[name]

        def create_execution_context(self, strategy=ExecutionContextAllocationStrategy.STATIC):
            return Context(self, strategy)

    class Context:
        def __init__(self, engine: Engine, strategy) -> None:
            self.engine, self.strategy = engine, strategy
            self.profile, self.shapes, self.addresses = 0, {}, {}
            self.memory = None
            self.switches = 0

        def set_device_memory(self, ptr: int, size: int) -> None:
            cudart.check(ptr, size, "the context's activation memory")
            self.memory = (ptr, size)

        def set_optimization_profile_async(self, index: int, stream) -> bool:
            if not 0 <= index < len(self.engine.profiles):
                raise RuntimeError(f"profile index {index} is out of range")
            self.profile, self.shapes = index, {}
            self.switches += 1
            return True

        def set_input_shape(self, name: str, shape) -> bool:
            lo, _, hi = self.engine.profiles[self.profile][name]
            shape = tuple(shape)
            if len(shape) != len(lo) or not all(a <= s <= b for a, s, b in zip(lo, shape, hi)):
                return False
            self.shapes[name] = shape
            return True

        def set_tensor_address(self, name: str, ptr: int) -> bool:
            if name not in self.engine.dtypes or ptr % ALIGN:
                return False
            self.addresses[name] = ptr
            return True

        def execute_async_v3(self, stream) -> bool:
            e = self.engine
            if (self.strategy == ExecutionContextAllocationStrategy.USER_MANAGED
                    and self.memory is None):
                return False
            missing = [n for n in e.inputs if n not in self.shapes or n not in self.addresses]
            missing += [n for n in e.outputs if n not in self.addresses]
            if missing:
                return False
            feed = {n: cudart.view(self.addresses[n], self.shapes[n], e.dtypes[n]).copy()
                    for n in e.inputs}
            for name, value in zip(e.outputs, e.session.run(e.outputs, feed)):
                cudart.view(self.addresses[name], value.shape, e.dtypes[name])[...] = value
            return True

    def nptype(dtype):
        return np.dtype(dtype).type

    for obj in (Logger, NetworkDefinitionCreationFlag, BuilderFlag, MemoryPoolType,
                ExecutionContextAllocationStrategy, IProgressMonitor, OnnxParser, Builder,
                Runtime, nptype):
        setattr(trt, obj.__name__, obj)
    return trt


def install(monkeypatch, version: str = "10.3.0") -> tuple[types.ModuleType, FakeCudart]:
    """``import tensorrt`` gives the stand-in, and the TensorRT backend's device memory is
    cuda-python's path over :class:`FakeCudart`."""
    import sys

    from edgemtp.runtimes import trt_backend

    cudart = FakeCudart()
    trt = tensorrt_module(cudart, version)
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    monkeypatch.setattr(trt_backend, "device_memory",
                        lambda index=0: trt_backend.CudaMemory(cudart, index))
    return trt, cudart


def engine_files(root: Path) -> list[Path]:
    return sorted((Path(root) / "engines").glob("*.engine"))
