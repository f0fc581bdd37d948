"""``edgemtp doctor``: what this machine is, which backend/device pairs will run on it, the
exact install step for each that will not, and, given a package, a memory plan against the
device's memory.

Two halves. :func:`probe` reads this machine into :class:`Facts`: each optional package
(torch, onnxruntime, tensorrt, cuda-python) is looked up with ``find_spec`` and imported
inside its own ``try`` (torch only when it is a CUDA build: a CPU build's version file says
all there is to know), so a missing or broken one is a fact, never a crash, and importing
this module imports none of them. Everything after that is a pure function of the facts
(:func:`verdicts`, :func:`memory_plan`, :func:`report`), so a test can hand it the facts of
a Jetson or a CUDA desktop it does not have.
"""

from __future__ import annotations

import ctypes
import importlib
import importlib.util
import json
import math
import os
import platform
import re
import shutil
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path

# -- what JetPack ships -------------------------------------------------------------------
# L4T (Jetson Linux) release -> (JetPack, its CUDA, its TensorRT). Sources: NVIDIA's JetPack
# release notes and the Torch-TensorRT JetPack guide (docs.pytorch.org/TensorRT/
# getting_started/jetpack.html: JetPack 6.1 and 6.2 both ship CUDA 12.6, TensorRT 10.3,
# cuDNN 9.3); JetPack 6.0 ships CUDA 12.2, TensorRT 8.6, cuDNN 8.9. L4T R36.4.x is JetPack
# 6.1 (36.4.0) or 6.2 (36.4.3 and later): both have the same CUDA and TensorRT, so the
# install steps do not depend on which.
JETPACK = {
    (36, 2): ("6.0 DP", "12.2", "8.6"),
    (36, 3): ("6.0", "12.2", "8.6"),
    (36, 4): ("6.1 or 6.2", "12.6", "10.3"),
}
JETPACK_PYTHON = "3.10"  # JetPack 6 is Ubuntu 22.04; the Jetson AI Lab wheels are cp310

# Jetson AI Lab's pip index (https://pypi.jetson-ai-lab.io, formerly pypi.jetson-ai-lab.dev):
# one index per JetPack and CUDA, e.g. jp6/cu126 for JetPack 6.1/6.2 and jp6/cu122 for
# JetPack 6.0, each holding aarch64 builds of torch and onnxruntime-gpu (with the CUDA and
# TensorRT providers) linked against JetPack's own CUDA, cuDNN and TensorRT. It mirrors PyPI
# for everything else, so --index-url resolves the dependencies too, and PyPI's wheels of
# the same names can never be picked instead.
JETSON_INDEX = "https://pypi.jetson-ai-lab.io/jp6/cu{cuda_tag}"
# CUDA versions PyTorch 2.13 publishes stable wheels for (download.pytorch.org/whl/cuXYZ:
# cu126 and cu130; cu128 ended with 2.11, cu132 is experimental). A driver runs a wheel of its
# own CUDA major version whatever the minor (CUDA's minor-version compatibility: a CUDA 12.2
# driver runs cu126), and of an older major
TORCH_CUDA_WHEELS = ("12.6", "13.0")
TORCH_PIN = "torch==2.13.0"  # the version the CPU install and CI pin

# the one table of install steps: what -> (desktop or server with PyPI wheels, JetPack 6).
# {torch_cuda}: the newest PyTorch CUDA wheel the driver runs; {index}: JETSON_INDEX.
INSTALL = {
    "torch": (f"pip install {TORCH_PIN} --index-url https://download.pytorch.org/whl/cpu",
              "pip install torch --index-url {index}"),
    "torch-cuda": (f"pip uninstall -y torch && pip install {TORCH_PIN} --index-url "
                   "https://download.pytorch.org/whl/cu{torch_cuda}",
                   "pip uninstall -y torch && pip install torch --index-url {index}"),
    "onnxruntime": ("pip install onnxruntime", "pip install onnxruntime"),
    # onnxruntime and onnxruntime-gpu install the same module: keep exactly one of them
    "onnxruntime-gpu": ("pip uninstall -y onnxruntime && pip install onnxruntime-gpu",
                        "pip uninstall -y onnxruntime && pip install onnxruntime-gpu "
                        "--index-url {index}"),
    # the tensorrt backend needs the Python bindings (the pip wheel brings its own libraries;
    # python3-libnvinfer puts them in the system Python 3.10: a venv sees them only when made
    # with --system-site-packages) ...
    "tensorrt": ("pip install tensorrt",
                 "sudo apt install nvidia-tensorrt python3-libnvinfer"),
    # ... onnxruntime's providers dlopen libnvinfer.so.10 and libcudnn.so.9 through the system
    # loader (a pip wheel's copy is not on its path): NVIDIA's apt repositories
    "tensorrt-libs": ("sudo apt install tensorrt", "sudo apt install nvidia-tensorrt"),
    "cudnn": ("sudo apt install cudnn9-cuda-12", "sudo apt install nvidia-jetpack"),
    # 13.x needs a CUDA 13 driver (JetPack 6 runs CUDA 12.6); 12.x runs on both
    "cuda-python": ('pip install "cuda-python>=12.6,<13"', 'pip install "cuda-python>=12.6,<13"'),
    "gpu": ("with an NVIDIA GPU and its driver (https://www.nvidia.com/drivers): {then}",
            "{then}"),
}


# -- facts ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Gpu:
    name: str
    total_bytes: int | None = None
    free_bytes: int | None = None


@dataclass(frozen=True)
class Facts:
    """What :func:`probe` read; None means not found (or not readable). A test builds these
    by hand."""

    system: str = ""                      # "Linux x86_64"
    python: str = ""                      # "3.11.2"
    cpu_cores: int | None = None
    load1: float | None = None            # the 1-minute load average (os.getloadavg)
    host_total: int | None = None         # /proc/meminfo MemTotal, bytes
    host_available: int | None = None     # MemAvailable
    jetson_model: str | None = None       # /proc/device-tree/model
    l4t: str | None = None                # /etc/nv_tegra_release, "36.4.0"
    gpus: tuple[Gpu, ...] = ()            # nvidia-smi, else torch
    driver: str | None = None             # NVIDIA driver version
    cuda_driver: str | None = None        # the newest CUDA the driver runs (libcuda)
    cuda_toolkit: str | None = None       # /usr/local/cuda
    cudnn: str | None = None              # libcudnn through the system loader
    nvinfer: bool = False                 # TensorRT's libnvinfer through the system loader
    torch: str | None = None
    torch_cuda: str | None = None         # torch.version.cuda: None for a CPU build
    torch_cuda_ok: bool = False           # torch.cuda.is_available()
    torch_cudnn: str | None = None        # the cuDNN torch brings
    onnxruntime: str | None = None
    ort_providers: tuple[str, ...] = ()
    tensorrt: str | None = None
    cuda_python: bool = False
    native: str | None = None             # the drafters' C helpers: None where they load,
    #                                       else why the Python code runs instead
    native_heads: str | None = None       # the learned heads' C kernel: likewise (else
    #                                       onnxruntime runs the heads graphs)
    native_decoder: str | None = "not probed"  # the native backend's C decoder: None where
    #                                       it loads, else why not
    native_kernel: str | None = None      # its int4 kernel and threads, where it loads
    problems: tuple[str, ...] = ()        # probes that failed in an unexpected way

    @property
    def jetson(self) -> bool:
        return self.l4t is not None or "jetson" in (self.jetson_model or "").lower()

    @property
    def jetpack(self) -> tuple[str, str, str] | None:
        """(JetPack, CUDA, TensorRT) for this L4T release, if a JetPack 6 one."""
        return JETPACK.get(_release(self.l4t)) if self.l4t else None

    @property
    def has_gpu(self) -> bool:
        return bool(self.gpus) or self.torch_cuda_ok or self.jetson


def _release(l4t: str) -> tuple[int, int]:
    major, minor = (l4t.split(".") + ["0"])[:2]
    return int(major), int(minor)


def _version(text: str | None) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", text or ""))[:3]


# -- probing this machine -------------------------------------------------------------------


def probe() -> Facts:
    """Read this machine. Never raises: what cannot be read stays None, and a probe that
    failed unexpectedly leaves a line in ``problems``."""
    problems: list[str] = []
    found: dict = {}
    # the system libraries first: once torch or tensorrt is imported, their own copies are
    # loaded and would answer a dlopen by soname that onnxruntime's providers cannot
    for step in (_host, _jetson, _nvidia_smi, _libcuda, _cuda_toolkit, _libraries, _torch,
                 _onnxruntime, _tensorrt, _cuda_python, _native):
        try:
            found.update(step(found))
        except Exception as e:  # a broken optional package must not stop the report
            problems.append(f"{step.__name__.strip('_')}: {type(e).__name__}: {_line(e)}")
    return Facts(system=f"{platform.system()} {platform.machine()}",
                 python=platform.python_version(), cpu_cores=os.cpu_count(),
                 problems=tuple(problems), **found)


def _native(_) -> dict:
    from . import native
    return {"native": None if native.lib() is not None else native.why_not() or "not built",
            "native_heads": (None if native.heads_lib() is not None
                             else native.heads_why_not() or "not built"),
            "native_decoder": (None if native.decoder_lib() is not None
                               else native.decoder_why_not() or "not built"),
            "native_kernel": native.decoder_kernel()}


def _line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:200] if text else ""


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text(errors="replace")
    except OSError:
        return None


def _host(_) -> dict:
    info = _read("/proc/meminfo") or ""
    kib = {k: int(v) * 1024 for k, v in re.findall(r"^(\w+):\s+(\d+) kB", info, re.M)}
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    return {"host_total": kib.get("MemTotal"), "host_available": kib.get("MemAvailable"),
            "load1": load}


def parse_tegra_release(text: str) -> str | None:
    """The L4T version in ``/etc/nv_tegra_release``.

    >>> parse_tegra_release("# R36 (release), REVISION: 4.0, GCID: 37537400, BOARD: generic")
    '36.4.0'
    """
    m = re.search(r"R(\d+)\s*\(release\),\s*REVISION:\s*(\d+)\.(\d+)", text)
    return ".".join(m.groups()) if m else None


def _jetson(_) -> dict:
    release = _read("/etc/nv_tegra_release")
    model = _read("/proc/device-tree/model")
    return {"l4t": parse_tegra_release(release) if release else None,
            "jetson_model": model.strip("\x00\n ") if model else None}


def _nvidia_smi(_) -> dict:
    exe = shutil.which("nvidia-smi")
    if not exe:
        return {}
    out = subprocess.run([exe, "--query-gpu=name,memory.total,memory.free,driver_version",
                          "--format=csv,noheader,nounits"], capture_output=True, text=True,
                         timeout=15)
    gpus, driver = [], None
    for row in out.stdout.strip().splitlines() if out.returncode == 0 else []:
        name, total, free, driver = (c.strip() for c in (row.split(",") + [""] * 4)[:4])
        gpus.append(Gpu(name, _mib(total), _mib(free)))  # Jetson: memory is [N/A]
    return {"gpus": tuple(gpus), "driver": driver or None}


def _mib(text: str) -> int | None:
    return int(text) * 2**20 if text.isdigit() else None


def _libcuda(_) -> dict:
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return {}
    v = ctypes.c_int(0)
    if lib.cuDriverGetVersion(ctypes.byref(v)) != 0:  # needs no cuInit
        return {}
    return {"cuda_driver": f"{v.value // 1000}.{v.value % 1000 // 10}"}


def _cuda_toolkit(_) -> dict:
    text = _read("/usr/local/cuda/version.json")
    if text:
        return {"cuda_toolkit": json.loads(text).get("cuda", {}).get("version")}
    m = re.search(r"CUDA Version ([\d.]+)", _read("/usr/local/cuda/version.txt") or "")
    return {"cuda_toolkit": m.group(1) if m else None}


def _module(name: str):
    """The imported module, or None when it is not installed."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):  # a parent package missing
        return None
    return importlib.import_module(name) if spec else None


def _torch(found: dict) -> dict:
    build = _torch_build()
    if build is None:
        return {}
    if build[0] and not build[1]:  # a CPU build: no need to spend seconds importing it
        return {"torch": build[0]}
    torch = importlib.import_module("torch")
    out = {"torch": torch.__version__, "torch_cuda": torch.version.cuda,
           "torch_cuda_ok": bool(torch.version.cuda) and torch.cuda.is_available()}
    if out["torch_cuda_ok"] and not found.get("gpus"):  # no nvidia-smi: ask torch
        gpus = []
        for i in range(torch.cuda.device_count()):
            free, total = torch.cuda.mem_get_info(i)
            gpus.append(Gpu(torch.cuda.get_device_name(i), total, free))
        out["gpus"] = tuple(gpus)
    if out["torch_cuda_ok"] and torch.backends.cudnn.is_available():
        out["torch_cudnn"] = _cudnn_text(torch.backends.cudnn.version())
    return out


def _torch_build() -> tuple[str | None, str | None] | None:
    """(version, CUDA version) from torch's generated ``version.py``, without importing
    torch; None when torch is not installed, (None, None) when the file does not say."""
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    text = "".join(_read(str(Path(d) / "version.py")) or ""
                   for d in spec.submodule_search_locations or ())
    version = re.search(r"^__version__\s*=\s*['\"]([^'\"]+)", text, re.M)
    cuda = re.search(r"^cuda\b[^=\n]*=\s*(?:None|['\"]([^'\"]+))", text, re.M)
    if not (version and cuda):
        return None, None
    return version.group(1), cuda.group(1)


def _onnxruntime(_) -> dict:
    ort = _module("onnxruntime")
    if ort is None:
        return {}
    return {"onnxruntime": ort.__version__,
            "ort_providers": tuple(ort.get_available_providers())}


def _tensorrt(_) -> dict:
    trt = _module("tensorrt")
    return {"tensorrt": trt.__version__} if trt is not None else {}


def _libraries(_) -> dict:
    # what onnxruntime's CUDA and TensorRT providers will dlopen by soname
    out = {"nvinfer": _loadable("libnvinfer.so.10", "libnvinfer.so.8")}
    for soname in ("libcudnn.so.9", "libcudnn.so.8"):
        try:
            lib = ctypes.CDLL(soname)
        except OSError:
            continue
        lib.cudnnGetVersion.restype = ctypes.c_size_t
        return {**out, "cudnn": _cudnn_text(lib.cudnnGetVersion())}
    return out


def _loadable(*sonames: str) -> bool:
    for soname in sonames:
        try:
            ctypes.CDLL(soname)
            return True
        except OSError:
            continue
    return False


def _cudnn_text(v: int) -> str:
    """cuDNN's version number as text: 9 counts major x 10000, 8 major x 1000.

    >>> _cudnn_text(90300), _cudnn_text(8907)
    ('9.3.0', '8.9.7')
    """
    major = v // 10000 if v >= 10000 else v // 1000
    rest = v - major * (10000 if v >= 10000 else 1000)
    return f"{major}.{rest // 100}.{rest % 100}"


def _cuda_python(_) -> dict:
    return {"cuda_python": any(_spec(n) for n in ("cuda.bindings", "cuda.cudart"))}


def _spec(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


# -- verdicts: which backend/device pairs run here ------------------------------------------


@dataclass(frozen=True)
class Verdict:
    backend: str
    device: str
    ok: bool
    reason: str
    install: str | None = None   # the exact step that makes it work, when it does not


def install_step(what: str, facts: Facts, then: str = "") -> str:
    """The install command for ``what`` on this machine, from :data:`INSTALL`."""
    desktop, jetpack = INSTALL[what]
    jp = facts.jetpack
    if facts.jetson and jp is None:
        return (f"flash JetPack 6 (L4T R36.2 to R36.4; this is L4T R{facts.l4t or '?'}): these "
                f"steps cover JetPack 6 only")
    return (jetpack if facts.jetson else desktop).format(
        index=JETSON_INDEX.format(cuda_tag=jp[1].replace(".", "")) if jp else "",
        torch_cuda=_torch_cuda_wheel(facts).replace(".", ""), then=then)


def _torch_cuda_wheel(facts: Facts) -> str:
    """The newest PyTorch CUDA wheel this driver runs: of its CUDA major version or older
    (the oldest, which every CUDA 12 or 13 driver runs, when the driver is unknown)."""
    drv = _version(facts.cuda_driver)
    fits = [w for w in TORCH_CUDA_WHEELS if _version(w)[:1] <= drv[:1]] if drv else []
    return fits[-1] if fits else TORCH_CUDA_WHEELS[0]


# A check lists the gaps between this machine and a working pair: (gap?, why, INSTALL key or
# a literal step). No gaps: the pair works, described by the check's ok text.
Gap = tuple[bool, str, str]


def _join_steps(steps) -> str:
    """Shell commands joined by ``&&``, a step in words (update a driver, flash JetPack) set
    apart by ``; then``, so that every run of commands can be pasted as it is.

    >>> _join_steps(["update the driver (https://x)", "pip install a", "sudo apt install b"])
    'update the driver (https://x); then pip install a && sudo apt install b'
    """
    out, prev = "", False
    for step in steps:
        command = step.split(" ", 1)[0] in ("pip", "sudo", "apt", "python", "python3")
        out += ("" if not out else " && " if command and prev else "; then ") + step
        prev = command
    return out


def _verdict(f: Facts, backend: str, device: str, ok_text: str, gaps: list[Gap],
             needs_gpu: bool) -> Verdict:
    gaps = [(why, step) for gap, why, step in gaps if gap]
    steps = _join_steps(dict.fromkeys(install_step(s, f) if s in INSTALL else s
                                      for _, s in gaps))
    why = "; ".join(w for w, _ in gaps)
    if needs_gpu and not f.has_gpu:
        return Verdict(backend, device, False, "this machine has no NVIDIA GPU"
                       + (f"; {why}" if why else ""), install_step("gpu", f, then=steps)
                       if steps else "an NVIDIA GPU and its driver")
    if gaps:
        python = (f"; the Jetson AI Lab wheels are for Python {JETPACK_PYTHON} (JetPack 6's), "
                  f"this is Python {f.python}" if f.jetson and f.python
                  and not f.python.startswith(JETPACK_PYTHON + ".") and "pip" in steps else "")
        return Verdict(backend, device, False, why + python, steps)
    return Verdict(backend, device, True, ok_text)


def _torch_cpu(f: Facts) -> Verdict:
    return _verdict(f, "torch", "cpu", f"torch {f.torch}",
                    [(not f.torch, "torch is not installed", "torch")], needs_gpu=False)


def _torch_cuda(f: Facts) -> Verdict:
    oldest = TORCH_CUDA_WHEELS[0].split(".")[0]  # (any driver of that major runs it)
    old_driver = (not f.jetson and bool(f.cuda_driver)
                  and _version(f.cuda_driver)[:1] < _version(TORCH_CUDA_WHEELS[0])[:1])
    cpu_build = f"torch {f.torch} is a CPU-only build" if f.torch else "torch is not installed"
    return _verdict(f, "torch", "cuda", f"torch {f.torch}, CUDA {f.torch_cuda}", [
        (old_driver, f"the driver runs CUDA {f.cuda_driver}, older than PyTorch's wheels "
                     f"(CUDA {oldest}.x)",
         f"update the NVIDIA driver to one for CUDA {oldest} or newer "
         f"(https://www.nvidia.com/drivers)"),
        (not f.torch_cuda, cpu_build, "torch-cuda"),
        (bool(f.torch_cuda) and f.has_gpu and not f.torch_cuda_ok and not old_driver,
         f"torch {f.torch} (CUDA {f.torch_cuda}) sees no device", "torch-cuda"),
    ], needs_gpu=True)


def _ort_cpu(f: Facts) -> Verdict:
    return _verdict(f, "onnxruntime", "cpu", f"onnxruntime {f.onnxruntime}",
                    [(not f.onnxruntime, "onnxruntime is not installed", "onnxruntime")],
                    needs_gpu=False)


def _native_cpu(f: Facts) -> Verdict:
    why = f.native_decoder or ""
    return _verdict(f, "native", "cpu", "int4 packages on edgemtp's C decoder"
                    + (f" ({f.native_kernel})" if f.native_kernel else ""),
                    [(f.native_decoder is not None, f"the C decoder does not load: {why}",
                      "EDGEMTP_NATIVE=1 (unset 0)" if "EDGEMTP_NATIVE" in why
                      else "a C compiler with OpenMP: sudo apt install gcc (or set CC)")],
                    needs_gpu=False)


def _ort_provider(device: str, provider: str, needs_trt: bool):
    def check(f: Facts) -> Verdict:
        have = (f"onnxruntime {f.onnxruntime} has no {provider}" if f.onnxruntime
                else "onnxruntime is not installed")
        return _verdict(f, "onnxruntime", device, f"onnxruntime {f.onnxruntime}, {provider}, "
                        f"cuDNN {f.cudnn}", [
                            (provider not in f.ort_providers, have, "onnxruntime-gpu"),
                            (needs_trt and not f.nvinfer, "libnvinfer.so.10 is not loadable",
                             "tensorrt-libs"),
                            (not f.cudnn, "libcudnn.so.9 is not loadable", "cudnn")],
                        needs_gpu=True)
    return check


def _tensorrt_native(f: Facts) -> Verdict:
    old = bool(f.tensorrt) and _version(f.tensorrt) < (10,)
    return _verdict(f, "tensorrt", "cuda", f"TensorRT {f.tensorrt}", [
        (not f.tensorrt, "the tensorrt Python package is not installed", "tensorrt"),
        (old, f"TensorRT {f.tensorrt}; the tensorrt backend needs TensorRT 10",
         "flash JetPack 6.1 or later" if f.jetson else "pip install --upgrade tensorrt"),
        (not (f.torch_cuda_ok or f.cuda_python),
         "no device allocator: torch with CUDA, or cuda-python", "cuda-python"),
    ], needs_gpu=True)


# (backend, device) -> check(facts)
CHECKS = {
    ("torch", "cpu"): _torch_cpu,
    ("torch", "cuda"): _torch_cuda,
    ("onnxruntime", "cpu"): _ort_cpu,
    ("native", "cpu"): _native_cpu,
    ("onnxruntime", "cuda"): _ort_provider("cuda", "CUDAExecutionProvider", needs_trt=False),
    ("onnxruntime", "tensorrt"): _ort_provider("tensorrt", "TensorrtExecutionProvider",
                                               needs_trt=True),
    ("tensorrt", "cuda"): _tensorrt_native,
}


def verdicts(facts: Facts) -> list[Verdict]:
    return [check(facts) for check in CHECKS.values()]


# -- memory plan ----------------------------------------------------------------------------

MARGIN = 0.10   # allocator arenas, fragmentation, the runtime's own buffers
ACT_WIDTH = 12  # hidden-sized values a position holds at once: residual, norm, q, attention
#                 out, and the MLP's gate and up taken at 4 x hidden (the manifest does not
#                 record intermediate_size; llama-family models use 2.7x to 4x)
PLAN_DTYPES = {"fp32": 4, "fp16": 2}
NPY_HEADER = 128  # numpy's header of a 2-d table


def workspace_bytes(m, t: int, rows: int, itemsize: int) -> int:
    """Activations of one block of ``t`` positions attending to ``rows`` cache rows: the
    hidden-sized tensors, fp32 attention scores over ``rows + t`` columns per head, and fp32
    logits.

    >>> from types import SimpleNamespace as S
    >>> m = S(hidden_size=64, num_heads=8, vocab_size=512)
    >>> workspace_bytes(m, t=60, rows=256, itemsize=4)    # 60 x (12*64*4 + (8*316 + 512)*4)
    913920
    """
    return t * (ACT_WIDTH * m.hidden_size * itemsize + (m.num_heads * (rows + t)
                                                        + m.vocab_size) * 4)


@dataclass(frozen=True)
class Pool:
    """The memory a package's model is planned against."""

    what: str
    available: int | None
    host: bool   # the host's RAM (CPU, or a Jetson's shared memory): the embedding table counts


def device_pool(facts: Facts) -> Pool:
    if facts.jetson:
        return Pool("shared CPU/GPU memory available (Jetson: the GPU uses host RAM)",
                    facts.host_available, host=True)
    if facts.has_gpu and facts.gpus and facts.gpus[0].free_bytes is not None:
        g = facts.gpus[0]
        return Pool(f"GPU 0 ({g.name}) free memory", g.free_bytes, host=False)
    return Pool("host memory available (no CUDA device)" if not facts.has_gpu
                else "host memory available (GPU memory unknown)", facts.host_available,
                host=True)


def parameter_count(pkg) -> int | None:
    """The graph's weights as values, what a float re-export stores at 4 or 2 bytes each,
    read off its graph (its float initializers; a ``MatMulNBits`` product K x N and a
    block-quantized table its rows x columns, without the products' scales, zero points and a
    GGUF file's block offsets): stories260K's 260,032, as transformers counts them. Without
    the ``onnx`` package to read the graph with: a float package's weight bytes over its value
    size (its files' protobuf framing counted too: 276,707 there), a quantized one's None."""
    w = pkg.weights
    try:
        import onnx
        from onnx import helper
    except ModuleNotFoundError:
        return pkg.weight_bytes() // PLAN_DTYPES.get(w.format, 4) if w.bits is None else None
    from edgemtp.runtimes.native_backend import offset_branches

    graph = onnx.load(str(pkg.graph_path), load_external_data=False).graph
    inits = {t.name: t for t in graph.initializer}
    aux, n = {t for b in offset_branches(graph).values() for t in (b.offsets, b.shift) if t}, 0
    for node in graph.node:
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if node.op_type == "MatMulNBits":
            n += attrs["K"] * attrs["N"]
            aux.update(node.input[1:])
        elif node.op_type == "GatherBlockQuantized" and node.input[0] in inits:
            n += math.prod(inits[node.input[0]].dims) * 8 // attrs.get("bits", 4)
            aux.update([node.input[0], *node.input[2:]])
    floats = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16}
    return n + sum(math.prod(t.dims) for t in graph.initializer
                   if t.name not in aux and t.data_type in floats)


@dataclass(frozen=True)
class PlanRow:
    dtype: str                 # the weights: the package's own format (int4 ...) or fp32/fp16
    own: bool                  # the package's weights (another needs a re-export)
    weights: int
    kv_cache: int
    workspace: int
    embeddings: int            # host-side table; counted when the pool is host memory
    total: int
    fits: bool | None          # None: the pool's size is unknown
    max_context: int | None    # the largest cache (rows) whose total fits, at most the
    #                            package's max context
    max_prompt: int | None     # the longest prompt prefilled in one block, with the cache at
    #                            the smaller of the package's and the largest that fits


@dataclass(frozen=True)
class MemoryPlan:
    package: str
    max_context: int
    block: int                 # the largest plan block T
    pool: Pool
    rows: tuple[PlanRow, ...]
    cuda_graphs: str = ""      # whether onnxruntime can capture the graph (inspect's line)
    native: str = ""           # an int4 package on the CPU: the C decoder's memory (line)
    parallel: int = 1          # generations at once (serve --parallel): each its own cache


def memory_plan(pkg, facts: Facts, parallel: int = 1) -> MemoryPlan:
    """Weights + KV cache at the package's max context + workspace against the device's
    memory, for the package's own weights (as they are on disk, the cache as it runs) and for
    the float formats a re-export with ``--dtype fp32|fp16`` would give (weights from the
    parameter count; a row that cannot be estimated is left out); the largest context that
    fits, up to the package's max context (its graph's limit), and the longest one-block
    prompt. ``parallel``: generations running at once (``edgemtp serve --parallel``), each
    with its own KV cache and workspace."""
    from edgemtp.runtimes.package import HOST_TABLE_BYTES

    m, pool = pkg.meta, device_pool(facts)
    t = max(p.T for p in m.plans)
    # a quantized package's host table is the graph's own (in the weights already counted)
    separate = getattr(m.embeddings, "layout", "npy") == "npy"
    emb = (pkg.root / m.embeddings.file).stat().st_size if pool.host and separate else 0
    own = pkg.weights.format
    kinds = [own] + [d for d in PLAN_DTYPES if d != own]
    params = parameter_count(pkg)
    own_emb, rows = emb, []
    for kind in kinds:
        emb = own_emb
        if kind == own:  # as it is: its file, its activations' and cache's dtype
            weights, nbytes = pkg.weight_bytes(), PLAN_DTYPES[m.dtype]
            kv_row = pkg.kv_cache_bytes(1)  # (an exact package: float64 values)
        elif params is None:
            continue  # no parameter count to size a re-export by
        else:
            nbytes = PLAN_DTYPES[kind]
            weights, kv_row = params * nbytes, pkg.kv_cache_bytes(1, kind)
            # a float package's host table: embeddings.npy [V, d] in its dtype, where it is
            # small (else the graph's own, in the weights already counted)
            table = m.vocab_size * m.hidden_size * nbytes
            emb = table + NPY_HEADER if pool.host and table < HOST_TABLE_BYTES else 0
        fixed = weights + emb + parallel * workspace_bytes(m, t, 0, nbytes)
        # each generation's cache row and its attention column
        per_row = parallel * (kv_row + t * m.num_heads * 4)
        total = _with_margin(fixed + per_row * m.max_context)
        budget = pool.available / (1 + MARGIN) if pool.available else None
        ctx = max(0, math.floor((budget - fixed) / per_row)) if budget else None
        ctx = None if ctx is None else (ctx if ctx > t else 0)  # a plan needs T < context
        ctx = None if ctx is None else min(ctx, m.max_context)  # the graph's own limit
        rows.append(PlanRow(
            kind, kind == own, weights, parallel * kv_row * m.max_context,
            parallel * workspace_bytes(m, t, m.max_context, nbytes), emb, total,
            None if budget is None else total <= pool.available, ctx,
            None if ctx is None else _longest_prompt(
                m, nbytes, budget - weights - emb - parallel * kv_row * ctx, ctx)))
    from edgemtp.runtimes.package import cuda_graph_readiness

    return MemoryPlan(str(pkg.root), m.max_context, t, pool, tuple(rows),
                      cuda_graph_readiness(m.graph, m.cache), _native_line(pkg, pool, parallel),
                      parallel)


def _native_line(pkg, pool: Pool, parallel: int = 1) -> str:
    """Where ``generate`` runs this package on the CPU's C decoder (an int4 Llama-style
    package, no GPU): its weights, its KV cache at the max context (float16, or int8 with
    ``--kv-cache int8``) and the largest context each fits, as the rows above do for the
    onnxruntime graph."""
    if not pool.host:  # (a discrete GPU's memory: generate runs it there with --device cuda)
        return ""
    from edgemtp.runtimes.native_backend import cache_bytes, runs_natively

    if not runs_natively(pkg.root):
        return ""
    m, weights = pkg.meta, pkg.weight_bytes()
    parts, fits = [], []
    for kv, name in (("fp16", "float16"), ("int8", "int8")):
        def b(rows: int) -> int:
            return cache_bytes(m.num_layers, m.num_kv_heads, m.head_dim, rows, kv)
        parts.append(f"{size(parallel * b(m.max_context))} {name}")
        if pool.available:  # (the cache has a margin of rows and grows 16 at a time)
            room = pool.available / (1 + MARGIN) - weights
            rows = largest_rows(lambda r: parallel * b(r) <= room, m.max_context)
            fits.append(f"{rows} ({name})")
    # (the files' size: the decoder packs them into somewhat less, which inspect gives,
    #  having loaded them; doctor reads no weights)
    caches = f"{parallel} KV caches" if parallel > 1 else "KV cache"
    return (f"weights {size(weights)} (on disk; packed a little smaller: edgemtp inspect), "
            f"{caches} at {m.max_context} tokens {' or '.join(parts)}"
            + (f"; largest context that fits: {', '.join(fits)} (at most the package's max "
               f"context)" if fits else ""))


def largest_rows(fits, most: int) -> int:
    """The largest rows in 2..``most`` for which ``fits(rows)`` holds (``fits`` monotone),
    or 0.

    >>> largest_rows(lambda r: r * 10 <= 1000, 4096), largest_rows(lambda r: False, 64)
    (100, 0)
    """
    if most < 2 or not fits(2):
        return 0
    lo, hi = 2, most
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def _with_margin(n: float) -> int:
    return math.ceil(n * (1 + MARGIN))


def _longest_prompt(m, itemsize: int, room: float, context: int) -> int:
    """The longest prompt whose prefill (one causal block of P positions over an empty
    cache) fits in ``room`` bytes: solve 4·heads·P² + c·P <= room, capped at ``context``."""
    if room <= 0 or context == 0:
        return 0
    a, c = 4 * m.num_heads, ACT_WIDTH * m.hidden_size * itemsize + 4 * m.vocab_size
    p = math.floor((-c + math.sqrt(c * c + 4 * a * room)) / (2 * a))
    return min(p, context)


# -- the report -----------------------------------------------------------------------------


def size(n: float | None) -> str:
    """Bytes for a person: ``size(1536) == '1.5 KiB'``."""
    if n is None:
        return "?"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _or(value, missing: str = "not found") -> str:
    return str(value) if value else missing


def describe_machine(f: Facts) -> list[str]:
    lines = [f"machine   {f.system}, Python {f.python}, {_or(f.cpu_cores, '?')} CPU cores",
             f"memory    host {size(f.host_total)} total, {size(f.host_available)} available"
             + ("; on Jetson the GPU shares this memory" if f.jetson else "")]
    if f.load1 is not None:
        lines.append(f"load      {f.load1:.2f} runnable over the last minute on "
                     f"{_or(f.cpu_cores, '?')} cores" + (BUSY_NOTE if busy(f) else ""))
    if f.jetson:
        jp = f.jetpack
        jetpack = (f"JetPack {jp[0]} (CUDA {jp[1]}, TensorRT {jp[2]})" if jp
                   else "not a JetPack 6 release")
        lines.append(f"jetson    {_or(f.jetson_model, 'Jetson')}, L4T R{_or(f.l4t, '?')}: "
                     f"{jetpack}")
    else:
        lines.append("jetson    no (no /etc/nv_tegra_release)")
    for i, g in enumerate(f.gpus):
        lines.append(f"gpu {i}     {g.name}, {size(g.total_bytes)} total, "
                     f"{size(g.free_bytes)} free" + (", driver " + f.driver if f.driver else ""))
    if not f.gpus:
        lines.append("gpu       none found (nvidia-smi not on PATH or lists none)"
                     if not f.jetson else "gpu       integrated (nvidia-smi lists none)")
    lines.append(f"cuda      driver {_or(f.cuda_driver and 'runs CUDA ' + f.cuda_driver)}, "
                 f"toolkit {_or(f.cuda_toolkit)}, libcudnn {_or(f.cudnn)}, libnvinfer "
                 f"{'loadable' if f.nvinfer else 'not found'}")
    torch = (f"{f.torch} (" + (f"CUDA {f.torch_cuda}, " if f.torch_cuda else "CPU build, ")
             + (f"cuDNN {f.torch_cudnn}, " if f.torch_cudnn else "")
             + ("sees the GPU)" if f.torch_cuda_ok else "no CUDA device)")) if f.torch else None
    lines += [f"packages  torch {_or(torch, 'not installed')}",
              f"          onnxruntime {_or(f.onnxruntime, 'not installed')}"
              + (f": {', '.join(f.ort_providers)}" if f.onnxruntime else ""),
              f"          tensorrt {_or(f.tensorrt, 'not installed')}, cuda-python "
              f"{'installed' if f.cuda_python else 'not installed'}",
              "drafting  STAND trees in C (compiled here)" if f.native is None
              else f"drafting  STAND trees in Python ({f.native}; the same trees, slower)",
              "          learned heads in C where faster than onnxruntime (compiled here)"
              if f.native_heads is None
              else f"          learned heads in onnxruntime ({f.native_heads})"]
    lines += [f"problem   {p}" for p in f.problems]
    return lines


def busy(f: Facts) -> bool:
    """Other work holds the CPU: a 1-minute load average of at least 3/4 of the cores (and
    at least 1).

    >>> busy(Facts(cpu_cores=2, load1=1.6)), busy(Facts(cpu_cores=2, load1=0.4))
    (True, False)
    """
    return (f.load1 is not None and f.cpu_cores is not None
            and f.load1 >= max(1.0, 0.75 * f.cpu_cores))


BUSY_NOTE = ("; busy: a generation runs a thread per core (the native C decoder's, "
             "onnxruntime's and torch's thread pools), and its threads meet many times a step, "
             "each meeting waiting for a thread another process holds off its core (the native "
             "decoder on a 2-core machine running a test suite beside it: 20-29 tok/s with 2 "
             "threads, 86-120 with --threads 1): give --threads the cores left free")


def describe_verdicts(vs: list[Verdict]) -> list[str]:
    lines = []
    for i, v in enumerate(vs):
        head = "backends  " if i == 0 else " " * 10
        lines.append(f"{head}{v.backend:<12} {v.device:<9} {'ok' if v.ok else 'no'} "
                     f"{v.reason}")
        if v.install:
            lines.append(f"{'':<36}install: {v.install}")
    return lines


def describe_plan(p: MemoryPlan) -> list[str]:
    head = (f"{'format':<7} {'weights':>10} {'KV cache':>10} {'workspace':>10} "
            f"{'embedding':>10} {'total':>10}  {'fits':<4} {'max context':>11} "
            f"{'max prompt':>10}")
    lines = [f"package   {p.package}: max context {p.max_context}, largest plan block "
             f"T = {p.block}",
             f"against   {p.pool.what}: {size(p.pool.available)}",
             *([f"parallel  {p.parallel} generations at once (edgemtp serve --parallel "
                f"{p.parallel}): a KV cache and a workspace each"] if p.parallel > 1 else []),
             *([f"cuda      {p.cuda_graphs}"] if p.cuda_graphs else []),
             *([f"native    generate runs it on the C decoder here: {p.native}"]
               if p.native else []),
             "", f"plan      {head}"]
    for r in p.rows:
        fits = "?" if r.fits is None else ("yes" if r.fits else "no")
        lines.append(f"          {r.dtype + (' *' if r.own else ''):<7} {size(r.weights):>10} "
                     f"{size(r.kv_cache):>10} {size(r.workspace):>10} "
                     f"{size(r.embeddings) if r.embeddings else '-':>10} {size(r.total):>10}  "
                     f"{fits:<4} {_or(r.max_context, '?'):>11} {_or(r.max_prompt, '?'):>10}")
    lines += [
        "",
        "formula   total = (weights + KV cache + workspace + embedding table) x "
        f"{1 + MARGIN:.2f} (allocator and runtime margin)",
        f"          KV cache = {f'{p.parallel} x ' if p.parallel > 1 else ''}2 x layers x max "
        "context x KV heads x head dim x bytes (an int4/int8 package keeps its values in "
        "float64: 4 B keys + 8 B values)",
        "          workspace = T x (12 x hidden x bytes + (heads x (max context + T) + vocab) "
        "x 4 B): one block's activations, fp32 scores and logits",
        "          embedding table: host-side (mask initialisation), counted in host or "
        "shared memory only",
        "          * = the package's own weights, as on disk; fp32/fp16 rows are what a "
        "re-export with --dtype would need (its parameters x 4 or 2 bytes)",
        f"          max context = the largest KV cache that fits, at most the package's max "
        f"context {p.max_context} (its graph's limit; more needs a re-export with "
        f"--max-context, up to the model's position limit)",
        "          max prompt = the longest prompt prefilled in one block (scores grow as heads "
        "x P^2), the cache at the package's max context or the largest that fits",
    ]
    return lines


def fastest(vs: list[Verdict]) -> str | None:
    """Which working pair to run on for speed, from what was measured (README: "What was
    measured on hardware"): on an NVIDIA GPU the torch backend, whose steps replay one CUDA
    graph per block shape, over onnxruntime's CUDA EP, which captures a package exported
    since 2026-11-26 too but ran 0.63-0.75x of torch's tokens/s on an H100 (older packages:
    uncaptured, a third)."""
    ok = {(v.backend, v.device) for v in vs if v.ok}
    if ("torch", "cuda") in ok:
        return ("torch cuda (a model folder, --backend torch --device cuda --dtype fp16): one "
                "CUDA graph per block shape; onnxruntime's CUDA EP with its CUDA graphs ran "
                "0.63-0.75x of its tokens/s (bench/results/gpu_h100_2026-11-26.md)")
    if ("onnxruntime", "cuda") in ok:
        return ("onnxruntime cuda (a package, --device cuda): one CUDA graph per block shape "
                "(packages exported since 2026-11-26); torch with CUDA ran ~1.3-1.6x its "
                "tokens/s on an H100")
    if ("native", "cpu") in ok:
        return ("native cpu (an int4 package, edgemtp export --dtype int4; --backend auto "
                "picks it): edgemtp's C decoder, about 2x onnxruntime's int4 tokens/s on a "
                "2-core x86 CPU (bench/results/peers_cpu.md), lossless against its own plain "
                "decoding")
    if ("onnxruntime", "cpu") in ok:
        return ("onnxruntime cpu (a package; --dtype int4 for speed, lossless against its "
                "own plain decoding)")
    return None


def report(facts: Facts, plan: MemoryPlan | None = None) -> str:
    vs = verdicts(facts)
    lines = describe_machine(facts) + [""] + describe_verdicts(vs)
    best = fastest(vs)
    if best:
        lines += ["", f"fastest   {best}"]
    if plan is not None:
        lines += [""] + describe_plan(plan)
    return "\n".join(lines)


def to_dict(facts: Facts, plan: MemoryPlan | None = None) -> dict:
    """What ``edgemtp doctor --json`` prints."""
    jp = facts.jetpack
    return {"units": "memory figures in bytes",  # (qa9 D6: bare integers, no unit said)
            "machine": asdict(facts),
            "jetpack": dict(zip(("jetpack", "cuda", "tensorrt"), jp)) if jp else None,
            "backends": [asdict(v) for v in verdicts(facts)],
            "fastest": fastest(verdicts(facts)),
            "memory_plan": asdict(plan) if plan is not None else None}
