"""TensorRT engines for a package: the optimisation profiles they need (planned from the
manifest alone, numpy-free and testable anywhere) and the builder (TensorRT's Python API,
imported only when an engine is built).

One engine per GPU architecture and TensorRT version holds every profile of the package::

    profile        T (block rows)          P (cached rows)          k (mask tokens)
    prefill        1 .. 512                0                        1 .. k_max
    decode         1                       1 .. ctx - 1             1 .. k_max
    block T=20     20                      1 .. ctx - 20            1 .. k_max    one per plan size
    blocks         1 .. 256                1 .. ctx - 1             1 .. k_max    any other block

(ctx = the package's max context; no T range beyond it. ``prefill`` takes the prompt's
chunks and a latency measurement's 512 rows; ``blocks`` goes up to ``--max-block``, 256 by
default, or the largest plan, whichever is more.) A step runs on the covering profile with the
narrowest T range (:func:`select_profile`): a plan's own size, plain decoding, the prompt (the
only one with an empty cache: TensorRT supports empty tensors, so ``past_*`` of shape
[1, 0, H, D] is a valid input) or, for blocks no plan has (prompt-lookup chains, lookahead
windows, a long prompt's last chunk), the catch-all. One engine rather than one per size:
profiles share the weights, so the engine holds them once (one per size would hold them once
per size, which an 8 GB Jetson cannot afford for a 1B model); a session switches profiles with
one call when T changes.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

from edgemtp.engine import PREFILL_CHUNK
from edgemtp.errors import BackendUnavailableError, ConfigError, EdgeMTPError, ModelLoadError
from edgemtp.latency import LONG_CONTEXT
from edgemtp.runtimes.package import (ENGINES, MANIFEST, EngineInfo, EngineProfile, Manifest,
                                      PAST_LEN, Package, _plain, _sha256, kv_names,
                                      load_package)

TYPICAL_PAST = 512    # the opt of P: a prompt and a few hundred generated tokens
TYPICAL_PROMPT = 128  # the opt of T for prefill
WORKSPACE_GIB = 2.0   # builder scratch memory (tactics needing more are skipped)
MIN_TENSORRT = 10     # strongly typed networks, int64 I/O, named I/O tensors
# the widest block outside prefill a profile is built for by default (lookup chains, lookahead
# windows and the prompt's last chunk: a budget is at most MAX_BC): a profile's activation
# memory grows with T x (P + T), and the execution context reserves its largest profile's
MAX_BLOCK = 256
INSTALL = ("on JetPack 6: sudo apt install python3-libnvinfer; on a desktop: "
           "pip install tensorrt")


class EngineBuildError(EdgeMTPError):
    """TensorRT could not parse the graph or build an engine."""


TRT_WEIGHTS = ("fp32", "fp16")  # int4/int8 graphs use onnxruntime's MatMulNBits (CPU kernels)


def check_trt_weights(fmt: str, who: str) -> None:
    """One line for a weight format TensorRT cannot build (``fmt``: ``weights.format`` or
    an export's ``--dtype``)."""
    if fmt not in TRT_WEIGHTS:
        raise ConfigError(f"{who}: TensorRT builds fp16 or fp32 packages, not {fmt} (an {fmt} "
                          f"graph runs onnxruntime's MatMulNBits CPU kernels and exact float64 "
                          f"attention); export with --dtype fp16 for TensorRT")


def check_trt_cache(pkg, who: str) -> None:
    """One line for a package whose cache layout the TensorRT path does not bind."""
    if pkg.meta.cache.head_major:
        raise ConfigError(f"{who}: the package keeps its cache head-major (--cache-layout "
                          f"head), which runs on onnxruntime's CPU provider only; export "
                          f"again without --cache-layout head for TensorRT")


def import_tensorrt(who: str = "backend 'tensorrt'"):
    """The ``tensorrt`` module (10.0 or newer), or one line saying how to install it.

    TensorRT 8.6 (JetPack 5 and 6.0) has neither strongly typed networks nor int64 inputs
    and outputs, which the package's graph has, and its ONNX parser rejects the network 8.6
    would build without them with an obscure error: refused here instead."""
    try:
        import tensorrt
    except ModuleNotFoundError:
        raise BackendUnavailableError(f"{who} needs the Python package 'tensorrt' "
                                      f"({INSTALL})") from None
    version = str(getattr(tensorrt, "__version__", "0"))
    major = version.split(".")[0]
    if not major.isdigit() or int(major) < MIN_TENSORRT:
        raise BackendUnavailableError(f"{who} needs TensorRT {MIN_TENSORRT} or newer, found "
                                      f"{version} (JetPack 6.1 and later ship TensorRT 10.3; "
                                      f"on a desktop: pip install tensorrt)")
    return tensorrt


# -- the profile plan -------------------------------------------------------------------------


def plan_profiles(meta: Manifest, max_block: int = MAX_BLOCK) -> tuple[EngineProfile, ...]:
    """The optimisation profiles an engine for this package needs (see the module docstring);
    ``max_block``: the widest block, beyond plan sizes and the prompt's chunks, it runs.

    >>> from types import SimpleNamespace as S
    >>> m = S(max_context=256, plans=[S(T=8, k=1), S(T=20, k=1), S(T=21, k=2)])
    >>> [(p.name, p.T, p.P) for p in plan_profiles(m)][:3]
    [('prefill', (1, 128, 256), (0, 0, 0)), ('decode', (1, 1, 1), (1, 255, 255)), \
('block T=8', (8, 8, 8), (1, 248, 248))]
    >>> [(p.name, p.T) for p in plan_profiles(m)][3:]
    [('block T=20', (20, 20, 20)), ('block T=21', (21, 21, 21)), ('blocks', (1, 21, 255))]
    >>> wide = plan_profiles(S(max_context=8192, plans=m.plans))
    >>> [(p.name, p.T) for p in (wide[0], wide[-1])]
    [('prefill', (1, 128, 512)), ('blocks', (1, 21, 256))]
    """
    ctx, plans = meta.max_context, meta.plans
    k_max = max(p.k for p in plans)
    ks = (1, k_max, k_max)
    sizes = sorted({p.T for p in plans if p.T < ctx})
    # T is bounded by what a generation feeds, not by the context: a prompt goes in chunks
    # of PREFILL_CHUNK rows (the first with the masks on an empty cache), a latency
    # measurement fills up to LONG_CONTEXT rows at once; other blocks are at most max_block
    # rows (or a plan's size). At ctx 8192 on SmolLM2 a T range up to the context made one
    # attention-score tensor ~4.8 GB, which every execution context reserved.
    prefill_t, block_t = t_bounds(meta, max_block)

    def past(t: int) -> tuple[int, int, int]:
        return 1, min(TYPICAL_PAST, ctx - t), ctx - t

    profiles = [EngineProfile(name="prefill", T=(1, min(TYPICAL_PROMPT, prefill_t), prefill_t),
                              P=(0, 0, 0), k=ks),
                EngineProfile(name="decode", T=(1, 1, 1), P=past(1), k=(1, 1, k_max))]
    for t in sizes:
        k_opt = max(p.k for p in plans if p.T == t)
        profiles.append(EngineProfile(name=f"block T={t}", T=(t, t, t), P=past(t),
                                      k=(1, k_opt, k_max)))
    profiles.append(EngineProfile(name="blocks", T=(1, min(max(sizes, default=1), block_t),
                                                    block_t),
                                  P=past(1), k=ks))
    return tuple(profiles)


def t_bounds(meta: Manifest, max_block: int = MAX_BLOCK) -> tuple[int, int]:
    """The widest T of the prefill profile and of the catch-all (see :func:`plan_profiles`)."""
    ctx, k_max = meta.max_context, max(p.k for p in meta.plans)
    widest = max((p.T for p in meta.plans if p.T < ctx), default=1)
    return (min(ctx, max(PREFILL_CHUNK + k_max, LONG_CONTEXT)),
            min(ctx - 1, max(max_block, PREFILL_CHUNK + k_max, widest)))


def envelope(meta: Manifest) -> EngineProfile:
    """One profile covering every step of a generation (for onnxruntime's TensorRT EP, whose
    execution context stays on profile 0); P up to a full cache, as the EP had it before.

    >>> from types import SimpleNamespace as S
    >>> [envelope(S(max_context=c, plans=[S(T=60, k=1)])).T for c in (256, 8192)]
    [(1, 60, 256), (1, 60, 512)]
    """
    ctx = meta.max_context
    k_max = max(p.k for p in meta.plans)
    widest = max(p.T for p in meta.plans)
    # T as wide as plan_profiles' widest (prefill's or the catch-all's), not the context: the
    # profile's activations grow with T x (P + T)
    t_max = max(t_bounds(meta))
    return EngineProfile(name="all", T=(1, min(widest, t_max), t_max),
                         P=(0, min(TYPICAL_PAST, ctx - 1), ctx), k=(1, k_max, k_max))


def select_profile(profiles, t: int, p: int, k: int) -> int:
    """Index of the covering profile with the narrowest T range (a plan's own size first).

    >>> from types import SimpleNamespace as S
    >>> ps = plan_profiles(S(max_context=256, plans=[S(T=8, k=1)]))
    >>> [ps[select_profile(ps, t, p, 1)].name for t, p in [(9, 0), (1, 9), (8, 9), (5, 9)]]
    ['prefill', 'decode', 'block T=8', 'blocks']
    """
    covering = [(q.T[2] - q.T[0], i) for i, q in enumerate(profiles) if q.covers(t, p, k)]
    if not covering:
        raise ModelLoadError(f"no optimisation profile of the engine covers a block of T={t} "
                             f"rows after P={p} cached rows with k={k} mask tokens; rebuild "
                             f"the engine (edgemtp build-engine)")
    return min(covering)[1]


def input_shapes(meta: Manifest, profile: EngineProfile) -> dict[str, tuple[tuple[int, ...], ...]]:
    """Every graph input's (min, opt, max) shape under ``profile``, in the graph's order."""
    d, kv = meta.hidden_size, (meta.num_kv_heads, meta.head_dim)
    past = kv_names("past", meta.num_layers)

    def at(i: int) -> dict[str, tuple[int, ...]]:
        t, p, k = profile.T[i], profile.P[i], profile.k[i]
        shapes = {"input_ids": (1, t), "position_ids": (1, t), "tree_mask": (1, 1, t, t),
                  "mask_embeds": (k, d)}
        shapes.update({name: (1, p, *kv) for name in past})
        if PAST_LEN in meta.graph.inputs:  # format 2
            shapes[PAST_LEN] = (1,)
        return shapes

    lo, opt, hi = at(0), at(1), at(2)
    return {name: (lo[name], opt[name], hi[name]) for name in lo}


# -- onnxruntime's TensorRT execution provider --------------------------------------------------


def ort_profile_options(meta: Manifest, profiles=None) -> dict[str, str]:
    """``trt_profile_{min,opt,max}_shapes`` for onnxruntime's TensorRT EP: ``name:1x8x...``
    joined by commas, a name repeated once per profile (default: the :func:`envelope`)."""
    profiles = profiles or [envelope(meta)]
    out = {}
    for i, key in enumerate(("min", "opt", "max")):
        out[f"trt_profile_{key}_shapes"] = ",".join(
            f"{name}:{'x'.join(str(n) for n in shapes[i])}"
            for profile in profiles for name, shapes in input_shapes(meta, profile).items())
    return out


def ort_trt_options(pkg: Package) -> dict[str, str]:
    """The TensorRT EP's provider options for a package: its profile, fp16 for an fp16
    package, an engine and timing cache in the package's ``engines/`` (the EP names its files
    ``TensorrtExecutionProvider_*``, apart from ours; the user's cache folder when the
    package is read-only)."""
    cache = pkg.root / ENGINES
    if not os.access(pkg.root, os.W_OK):
        cache = Path.home() / ".cache" / "edgemtp" / "ort_trt" / pkg.root.name
    return {"trt_engine_cache_enable": "True", "trt_engine_cache_path": str(cache),
            "trt_timing_cache_enable": "True", "trt_timing_cache_path": str(cache),
            "trt_fp16_enable": str(pkg.meta.dtype == "fp16"),
            **ort_profile_options(pkg.meta)}


# -- the builder --------------------------------------------------------------------------------


def engine_name(version: str, capability: str) -> str:
    """Where the engine for one TensorRT version and GPU architecture lives in a package.

    >>> engine_name("10.3.0", "8.7")
    'engines/sm87_trt10.3.0.engine'
    """
    return f"{ENGINES}/sm{capability.replace('.', '')}_trt{version}.engine"


def build_engine(package, *, workspace_gib: float = WORKSPACE_GIB,
                 timing_cache: str | Path | None = None, progress: bool = True,
                 max_block: int = MAX_BLOCK) -> EngineInfo:
    """Build a TensorRT engine from the package's ``model.onnx`` for this machine's GPU,
    write it under ``engines/`` and list it in the manifest (replacing an engine for the same
    GPU architecture and TensorRT version). The network is strongly typed: its precision is
    the graph's (an fp16 package gives an fp16 engine, no builder precision flags). The
    timing cache (default: beside the engine) is read first and saved after, so a rebuild
    skips the kernel timing already done. ``max_block``: the widest block beyond the plans'
    sizes and the prompt's chunks that the engine runs (a wider budget's steps are refused
    in one line)."""
    from edgemtp.runtimes.trt_backend import cuda_device

    pkg = package if isinstance(package, Package) else load_package(package, check_plans=False,
                                                                    check_engines=False)
    check_trt_weights(pkg.weights.format, f"the package {str(pkg.root)!r}")
    check_trt_cache(pkg, f"the package {str(pkg.root)!r}")
    trt = import_tensorrt("building a TensorRT engine")
    gpu, capability = cuda_device()
    version = trt.__version__
    name = engine_name(version, capability)
    cache_path = Path(timing_cache) if timing_cache else pkg.root / name.replace(".engine",
                                                                                  ".timing")
    profiles = plan_profiles(pkg.meta, max_block)
    serialized, cache_bytes = _build(trt, pkg, profiles, workspace_gib, cache_path, progress)
    partial = pkg.root / ENGINES / f".partial-{os.getpid()}"
    partial.mkdir(parents=True, exist_ok=True)
    try:  # written aside, then renamed: a build that dies never leaves a complete-looking file
        (partial / "engine").write_bytes(serialized)
        (partial / "timing").write_bytes(cache_bytes)
        info = EngineInfo(file=name, bytes=(partial / "engine").stat().st_size,
                          sha256=_sha256(partial / "engine"), tensorrt_version=version, gpu=gpu,
                          compute_capability=capability, max_context=pkg.meta.max_context,
                          profiles=profiles, built=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                          timing_cache=_inside(pkg.root, cache_path))
        os.replace(partial / "engine", pkg.root / name)
        cache_path.parent.mkdir(parents=True, exist_ok=True)
        os.replace(partial / "timing", cache_path)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    _list_engine(pkg.root, info)
    return info


def _inside(root: Path, path: Path) -> str | None:
    try:
        return path.resolve().relative_to(root.resolve()).as_posix()
    except ValueError:
        return None


def _build(trt, pkg: Package, profiles, workspace_gib: float, cache_path: Path,
           progress: bool) -> tuple[bytes, bytes]:
    logger = _logger(trt)
    builder = trt.Builder(logger)
    # TensorRT 10.x: STRONGLY_TYPED is opt-in (EXPLICIT_BATCH is the default and deprecated);
    # 11: always on, the flag kept and ignored (import_tensorrt refused anything before 10)
    flag = trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED
    network = builder.create_network(1 << int(flag))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(pkg.graph_path)):  # reads external weights beside it
        errors = [str(parser.get_error(i)) for i in range(parser.num_errors)] or ["no detail"]
        raise EngineBuildError(f"TensorRT {trt.__version__} cannot parse "
                               f"{str(pkg.graph_path)!r}: {errors[0].strip().splitlines()[0]}")
    config = builder.create_builder_config()
    # TF32 is on by default and rounds fp32 matrix products' inputs to 10 mantissa bits, per
    # tactic: an fp32 package's block and one-row steps would round apart (onnxruntime's CUDA
    # provider showed it: 11/12 outputs identical with TF32, 12/12 without). The network is
    # strongly typed, so precision flags are not allowed; TF32 is not one of them.
    config.clear_flag(trt.BuilderFlag.TF32)
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace_gib * 2**30))
    # the timing cache must outlive the build (kept in a local); a file TensorRT cannot read
    # (another version's, or damaged) gives None or is refused: start afresh
    cache = config.create_timing_cache(cache_path.read_bytes() if cache_path.is_file() else b"")
    if cache is None or not config.set_timing_cache(cache, False):
        cache = config.create_timing_cache(b"")
        config.set_timing_cache(cache, False)
    for profile in profiles:
        shapes = builder.create_optimization_profile()
        for name, (lo, opt, hi) in input_shapes(pkg.meta, profile).items():
            shapes.set_shape(name, lo, opt, hi)
        config.add_optimization_profile(shapes)
    monitor = _progress_monitor(trt) if progress and hasattr(trt, "IProgressMonitor") else None
    if monitor is not None:
        config.progress_monitor = monitor
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise EngineBuildError(f"TensorRT {trt.__version__} could not build an engine from "
                               f"{str(pkg.graph_path)!r} (its log above says why; a larger "
                               f"--workspace may help)")
    return bytes(memoryview(serialized)), bytes(memoryview(config.get_timing_cache().serialize()))


_LOGGERS: dict = {}


def _logger(trt):
    # TensorRT wants one logger per process
    if "trt" not in _LOGGERS:
        _LOGGERS["trt"] = trt.Logger(trt.Logger.WARNING)
    return _LOGGERS["trt"]


def _progress_monitor(trt):
    """A tqdm bar per top-level build phase (TensorRT >= 10.0's IProgressMonitor)."""
    from tqdm import tqdm

    class Monitor(trt.IProgressMonitor):
        def __init__(self) -> None:
            trt.IProgressMonitor.__init__(self)
            self.bars: dict[str, tqdm] = {}

        def phase_start(self, phase_name, parent_phase, num_steps):
            if parent_phase is None:  # nested phases would flicker
                self.bars[phase_name] = tqdm(total=num_steps, desc=phase_name, leave=False)

        def step_complete(self, phase_name, step):
            if phase_name in self.bars:
                self.bars[phase_name].update(1)
            return True  # False would cancel the build

        def phase_finish(self, phase_name):
            bar = self.bars.pop(phase_name, None)
            if bar is not None:
                bar.close()

    return Monitor()


def _list_engine(root: Path, info: EngineInfo) -> None:
    """Add ``info`` to the manifest's ``engines`` (replacing one with the same file, and
    dropping entries whose file is gone), written to a temporary file and renamed over the
    manifest, then loaded back to check it."""
    path = root / MANIFEST
    raw = json.loads(path.read_text())
    engines = [e for e in raw.get("engines", []) if e.get("file") != info.file
               and (root / str(e.get("file"))).is_file()]
    raw["engines"] = engines + [_plain(info)]
    tmp = root / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps(raw, indent=2) + "\n")
    os.replace(tmp, path)
    load_package(root, check_plans=False, check_engines=True)

