"""TensorRT engines and backend, as far as a machine without TensorRT or a GPU can check them:
the profile plan against the real graph and the shapes a real generation feeds, the
onnxruntime TensorRT EP's profile strings, the manifest's ``engines`` entry, the one-line
errors of the CLI, and the finite attention mask; and the builder and the backend run over
stand-ins for TensorRT's API and the GPU (``fake_tensorrt``: the profiles TensorRT is given,
the addresses, shapes and profiles a session binds, its cache commits, and its tokens against
the onnxruntime backend's). TensorRT's own kernels and numerics are not tested here (README
says so)."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
from conftest import STORIES, story_prompts

from edgemtp.runtimes.package import EngineInfo, load_package
from edgemtp.runtimes.trt_engine import (_list_engine, engine_name, envelope, input_shapes,
                                         ort_profile_options, ort_trt_options, plan_profiles,
                                         select_profile)

no_tensorrt = pytest.mark.skipif(importlib.util.find_spec("tensorrt") is not None,
                                 reason="checks the behaviour without TensorRT")


def _graph_inputs(pkg) -> list[tuple[str, list]]:
    import onnx

    proto = onnx.load(str(pkg.graph_path), load_external_data=False)
    return [(i.name, [d.dim_value if d.HasField("dim_value") else d.dim_param
                      for d in i.type.tensor_type.shape.dim]) for i in proto.graph.input]


def test_profiles_cover_every_plan_and_fit_the_graph(stories_pkg):
    pkg = load_package(stories_pkg)
    meta, ctx = pkg.meta, pkg.meta.max_context
    profiles = plan_profiles(meta)
    names = [p.name for p in profiles]
    assert names[:2] == ["prefill", "decode"] and names[-1] == "blocks"
    assert sorted({p.T for p in meta.plans}) == [p.T[0] for p in profiles[2:-1]]
    graph = _graph_inputs(pkg)
    for profile in profiles:
        shapes = input_shapes(meta, profile)
        assert list(shapes) == [name for name, _ in graph]  # names, in the graph's order
        for name, dims in graph:
            for shape in shapes[name]:  # min, opt, max
                assert len(shape) == len(dims), (profile.name, name)
                assert all(s == d for s, d in zip(shape, dims) if isinstance(d, int) and d)
            lo, opt, hi = shapes[name]
            assert all(a <= b <= c for a, b, c in zip(lo, opt, hi)), (profile.name, name)
        # a full cache, never more (the catch-all bounds T and P each: a profile cannot
        # bound their sum)
        assert max(profile.T[2], profile.P[2]) < ctx if profile.name == "blocks" else (
            profile.T[2] + profile.P[2] <= ctx), profile.name
    prefill, decode = profiles[0], profiles[1]
    assert prefill.P == (0, 0, 0) and prefill.T == (1, 128, ctx)
    assert decode.T == (1, 1, 1) and decode.P == (1, ctx - 1, ctx - 1)  # ctx 256 < 512


@pytest.mark.parametrize("drafter", ["probe", "pld", "lade", "hybrid", "auto"])
def test_every_step_of_a_generation_has_a_profile(stories_pkg, monkeypatch, drafter):
    # the shapes a real generation feeds, recorded on onnxruntime, each fall in a profile:
    # the prompt in prefill, a probing plan's block in its own size's profile
    from edgemtp import GenerationConfig, Model
    from edgemtp.runtimes.onnxrt_backend import OrtSession

    seen, forward = [], OrtSession.forward

    def record(self, input_ids, position_ids, tree_mask, mask_embeds, **kw):
        k = 1 if mask_embeds is None else len(mask_embeds)
        seen.append((len(input_ids), self.cache_len, k))
        return forward(self, input_ids, position_ids, tree_mask, mask_embeds, **kw)

    monkeypatch.setattr(OrtSession, "forward", record)
    model = Model.load(str(stories_pkg))
    profiles = plan_profiles(model.backend.package.meta)
    sizes = {p.T for p in model.backend.package.meta.plans}
    for prompt in story_prompts(2):
        model.generate(prompt, GenerationConfig(bc=30, drafter=drafter, max_new_tokens=48))
    assert seen and seen[0][1] == 0
    for t, p, k in seen:
        chosen = profiles[select_profile(profiles, t, p, k)]
        assert chosen.covers(t, p, k)
        want = "prefill" if p == 0 else "decode" if t == 1 else (
            f"block T={t}" if t in sizes else "blocks")
        assert chosen.name == want, (t, p, k)
    if drafter == "probe":
        assert {t for t, p, _ in seen if p} <= sizes | {1}


def _parse(option: str) -> list[dict[str, tuple[int, ...]]]:
    # "a:1x2,b:3,a:1x4,b:5" -> one dict per profile (a name seen again opens the next one)
    profiles: list[dict] = [{}]
    for item in option.split(","):
        name, _, dims = item.rpartition(":")
        if name in profiles[-1]:
            profiles.append({})
        profiles[-1][name] = tuple(int(d) for d in dims.split("x"))
    return profiles


def test_ort_tensorrt_ep_options_parse_back(stories_pkg):
    pkg = load_package(stories_pkg)
    meta = pkg.meta
    for profiles in ([envelope(meta)], list(plan_profiles(meta))):
        options = ort_profile_options(meta, profiles)
        for i, key in enumerate(("min", "opt", "max")):
            got = _parse(options[f"trt_profile_{key}_shapes"])
            assert got == [{n: s[i] for n, s in input_shapes(meta, p).items()}
                           for p in profiles]
    options = ort_trt_options(pkg)
    one = _parse(options["trt_profile_max_shapes"])
    assert len(one) == 1 and one[0]["input_ids"] == (1, meta.max_context)
    assert _parse(options["trt_profile_min_shapes"])[0]["past_key_0"][1] == 0  # empty cache
    assert options["trt_fp16_enable"] == "False"
    assert options["trt_engine_cache_path"] == str(pkg.root / "engines")


def _with_engine(stories_pkg, tmp_path, keep_file: bool = True):
    """A copy of the package listing a (fake) engine, as build-engine would write it."""
    root = tmp_path / "pkg"
    shutil.copytree(stories_pkg, root)
    meta = load_package(root).meta
    name, data = engine_name("10.3.0", "8.7"), b"a serialized engine would be here"
    (root / name).parent.mkdir(exist_ok=True)
    (root / name).write_bytes(data)
    _list_engine(root, EngineInfo(
        file=name, bytes=len(data), sha256=hashlib.sha256(data).hexdigest(),
        tensorrt_version="10.3.0", gpu="Orin", compute_capability="8.7",
        max_context=meta.max_context, profiles=plan_profiles(meta)))
    if not keep_file:
        (root / name).unlink()
    return root, name


def _cli(*argv) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "edgemtp.cli", *map(str, argv)],
                          capture_output=True, text=True, timeout=120)


def _one_line_error(p: subprocess.CompletedProcess, *needles: str) -> None:
    assert p.returncode == 2, p.stderr
    assert "Traceback" not in p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("edgemtp: error: "), p.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_an_engine_entry_round_trips_and_inspect_shows_it(stories_pkg, tmp_path):
    root, name = _with_engine(stories_pkg, tmp_path)
    meta = load_package(root).meta
    assert [e.file for e in meta.engines] == [name]
    assert meta.engines[0].profiles == plan_profiles(meta)
    p = _cli("inspect", root)
    assert p.returncode == 0, p.stderr
    assert f"engine    {name}" in p.stdout and "TensorRT 10.3.0 on Orin (sm 8.7)" in p.stdout
    assert "engine " not in _cli("inspect", stories_pkg).stdout  # an older package: none


def test_a_missing_or_changed_engine_stops_only_the_tensorrt_backend(stories_pkg, tmp_path):
    """Engines are built on the device (a Jetson's sm 8.7); a package copied back without its
    engines/ folder must still run on the other backends, and inspect says which engine is
    unusable (it refused the whole package, and pointed an x86 box without TensorRT at
    build-engine)."""
    from edgemtp.errors import ModelLoadError

    root, name = _with_engine(stories_pkg, tmp_path / "a", keep_file=False)
    p = _cli("inspect", root)
    assert p.returncode == 0, p.stderr
    assert "unusable: the file is missing; the tensorrt backend needs it rebuilt on that " \
           f"GPU: edgemtp build-engine {root}" in p.stdout
    gen = _cli("generate", "--model", root, "--prompt", "Once upon a time",
               "--max-new-tokens", "8", "--backend", "onnxruntime")
    assert gen.returncode == 0 and "Traceback" not in gen.stderr, gen.stderr
    pkg = load_package(root)
    with pytest.raises(ModelLoadError, match=f"lists the TensorRT engine {name}.* missing; "
                                             "rebuild it on that GPU: edgemtp build-engine"):
        pkg.check_engine(pkg.meta.engines[0])
    with pytest.raises(ModelLoadError, match="missing"):
        load_package(root, check_engines=True)  # (build-engine's check after writing one)
    root, name = _with_engine(stories_pkg, tmp_path / "b")
    (root / name).write_bytes(b"another engine")
    assert "is not the one that was built (14 bytes, not 33)" in _cli("inspect", root).stdout
    pkg = load_package(root)
    with pytest.raises(ModelLoadError, match="is not the one that was built"):
        pkg.check_engine(pkg.meta.engines[0])


def test_a_bad_engine_entry_is_a_manifest_error(stories_pkg, tmp_path):
    root, _ = _with_engine(stories_pkg, tmp_path)
    raw = json.loads((root / "edgemtp.json").read_text())
    raw["engines"][0]["profiles"][0]["P"] = [5, 0, 3]
    (root / "edgemtp.json").write_text(json.dumps(raw))
    _one_line_error(_cli("inspect", root), "engine profile",
                    "[min, opt, max]")


@no_tensorrt
def test_build_engine_without_tensorrt_is_one_line(stories_pkg, tmp_path):
    _one_line_error(_cli("build-engine", stories_pkg), "needs the Python package 'tensorrt'",
                    "python3-libnvinfer", "pip install tensorrt")
    out = tmp_path / "never"
    _one_line_error(_cli("export", STORIES, "-o", out, "--trt"),
                    "edgemtp export --trt needs the Python package 'tensorrt'")
    assert not out.exists()  # refused before the export ran


@no_tensorrt
def test_generate_on_tensorrt_says_what_is_missing(stories_pkg, tmp_path):
    gen = ("generate", "--backend", "tensorrt", "--prompt", "Once upon a time", "--model")
    # what the machine lacks is said first: build-engine would need TensorRT too
    _one_line_error(_cli(*gen, stories_pkg, "--device", "cuda"),
                    "backend 'tensorrt' needs the Python package 'tensorrt'")
    _one_line_error(_cli(*gen, stories_pkg), "runs on an NVIDIA GPU", "--device cuda")
    root, _ = _with_engine(stories_pkg, tmp_path)
    _one_line_error(_cli(*gen, root, "--device", "cuda"),
                    "backend 'tensorrt' needs the Python package 'tensorrt' (on JetPack 6: "
                    "sudo apt install python3-libnvinfer; on a desktop: pip install tensorrt)")


def test_the_graph_masks_with_a_finite_value(stories_pkg):
    # a fully masked row gives finite logits (with -inf: NaN, and so would fp16); the graph
    # holds no infinite constant
    import onnx
    from onnx import numpy_helper

    from edgemtp.runtimes.onnxrt_backend import OrtBackend

    session = OrtBackend(stories_pkg).session()
    mask = np.tril(np.ones((4, 4), dtype=bool))
    mask[2] = False  # row 2 sees nothing: no cache (P = 0) and no block column
    out = session.forward(np.array([1, 2, 3, 4]), np.arange(4), mask, None, full_logits=True)
    assert np.isfinite(out.logits).all()
    proto = onnx.load(str(load_package(stories_pkg).graph_path))
    consts = [numpy_helper.to_array(a.t) for n in proto.graph.node if n.op_type == "Constant"
              for a in n.attribute if a.name == "value"]
    consts += [numpy_helper.to_array(t) for t in proto.graph.initializer]
    floats = [c for c in consts if c.dtype.kind == "f"]
    assert all(np.isfinite(c).all() for c in floats)
    assert any(c.size == 1 and float(c.reshape(-1)[0]) == -65504.0 for c in floats)


def test_tensorrt_refuses_an_int4_package_in_one_line(tmp_path):
    # int4/int8 graphs run onnxruntime's MatMulNBits and float64 values: refused before
    # TensorRT is imported or an export starts
    from edgemtp.export.onnx_export import export_package

    pkg = tmp_path / "int4"
    export_package(str(STORIES), pkg, dtype="int4", max_context=128, bc=(10,),
                   mask_tokens=(1,), progress=False)
    why = "TensorRT builds fp16 or fp32 packages, not int4"
    _one_line_error(_cli("build-engine", pkg), why, "--dtype fp16")
    _one_line_error(_cli("generate", "--backend", "tensorrt", "--device", "cuda", "--model", pkg,
                         "--prompt", "Once upon a time"), why)
    out = tmp_path / "never"
    _one_line_error(_cli("export", STORIES, "-o", out, "--trt", "--dtype", "int8"),
                    "TensorRT builds fp16 or fp32 packages, not int8")
    assert not out.exists()


# -- the builder and the backend over stand-ins for TensorRT and the GPU (fake_tensorrt) ---------


@pytest.fixture
def fake_trt(monkeypatch):
    from fake_tensorrt import install

    return install(monkeypatch)


@pytest.fixture
def trt_package(stories_pkg, tmp_path, fake_trt):
    from edgemtp.runtimes.trt_engine import build_engine

    root = tmp_path / "pkg"
    shutil.copytree(stories_pkg, root)
    return root, build_engine(root, progress=False)


def test_build_engine_gives_tensorrt_the_planned_profiles(trt_package, fake_trt):
    root, info = trt_package
    trt, _ = fake_trt
    meta = load_package(root).meta
    assert info.file == engine_name("10.3.0", "8.7") and (root / info.file).is_file()
    assert [e.file for e in meta.engines] == [info.file] and info.gpu == "Fake Orin"
    assert info.profiles == plan_profiles(meta)
    built = trt.built[-1]
    assert trt.BuilderFlag.TF32 not in built["flags"]  # fp32 stays fp32 (TensorRT's default: on)
    assert built["workspace"] == 2 * 2**30
    assert built["profiles"] == [input_shapes(meta, p) for p in info.profiles]
    timing = root / info.file.replace(".engine", ".timing")
    assert timing.read_bytes() == b"fake timing cache"
    # a timing cache TensorRT cannot read (another version's, damaged) is a fresh start
    timing.write_bytes(b"damaged beyond use")
    from edgemtp.runtimes.trt_engine import build_engine

    assert build_engine(root, progress=False).file == info.file
    assert len(load_package(root).meta.engines) == 1


def _tokens(model, prompts, **config):
    from edgemtp import GenerationConfig

    return [model.generate(p, GenerationConfig(**config)).token_ids for p in prompts]


@pytest.mark.parametrize("drafter", ["none", "probe", "pld", "hybrid", "auto"])
def test_the_tensorrt_backend_generates_what_onnxruntime_does(trt_package, drafter):
    # the backend's binding (addresses, per-layer strides, shapes, profiles) and cache
    # commits, over the stand-in's onnxruntime run of the same graph: the same tokens
    from edgemtp import Model

    root, _ = trt_package
    prompts = story_prompts(2)
    want = _tokens(Model.load(str(root), backend="onnxruntime"), prompts, drafter="none",
                   max_new_tokens=40)
    model = Model.load(str(root), backend="tensorrt", device="cuda")
    assert model.backend.name == "tensorrt"
    assert _tokens(model, prompts, drafter=drafter, bc=30, max_new_tokens=40) == want


def test_a_generation_to_the_end_of_the_context_keeps_a_covering_profile(trt_package,
                                                                          monkeypatch):
    # blocks of a plan's size near the end of the context fall outside that size's profile
    # (P <= ctx - T): the session must move to the catch-all there
    from edgemtp import Model
    from edgemtp.runtimes.trt_backend import TrtSession

    root, _ = trt_package
    prompt = story_prompts(1)
    ctx = load_package(root).meta.max_context
    config = dict(bc=30, max_new_tokens=ctx, eos_token_ids=())
    want = _tokens(Model.load(str(root), backend="onnxruntime"), prompt, drafter="none",
                   **config)
    steps, use = [], TrtSession._use_profile

    def record(self, t, k):
        use(self, t, k)
        steps.append((t, self.cache_len, self.backend.info.profiles[self.profile].name))

    monkeypatch.setattr(TrtSession, "_use_profile", record)
    model = Model.load(str(root), backend="tensorrt", device="cuda")
    assert _tokens(model, prompt, drafter="probe", **config) == want
    size = next(t for t, _, name in steps if name.startswith("block T="))
    late = [name for t, p, name in steps if t == size and p > ctx - size]
    assert late and set(late) == {"blocks"}  # it reached the end, on the catch-all
    assert {name for t, p, name in steps if t == size and p <= ctx - size} == {
        f"block T={size}"}


def test_tensorrt_sessions_share_one_activation_buffer_and_bind_aligned(trt_package):
    from edgemtp.runtimes.trt_backend import TrtBackend

    root, _ = trt_package
    backend = TrtBackend(root, device="cuda")
    a, b = backend.session(), backend.session()
    assert a.context.memory == b.context.memory == (backend._scratch.ptr,
                                                    backend.engine.device_memory_size_v2)
    a.forward(np.array([1, 2, 3]), np.arange(3), np.tril(np.ones((3, 3), dtype=bool)), None)
    assert a.context.addresses and all(p % 256 == 0 for p in a.context.addresses.values())


def test_tensorrt_before_10_is_refused_in_one_line(stories_pkg, monkeypatch):
    from fake_tensorrt import install

    from edgemtp.errors import BackendUnavailableError
    from edgemtp.runtimes.trt_engine import build_engine

    install(monkeypatch, version="8.6.2")
    with pytest.raises(BackendUnavailableError, match="needs TensorRT 10 or newer, found "
                                                      "8.6.2 .JetPack 6.1"):
        build_engine(stories_pkg, progress=False)


def test_export_trt_refuses_engine_options_before_exporting(tmp_path):
    from edgemtp.cli import _engine_defaults, build_parser
    from edgemtp.runtimes.trt_engine import MAX_BLOCK

    for argv in (["export", "m", "-o", "o"], ["build-engine", "p"]):
        a = build_parser().parse_args(argv)
        assert a.max_block is None  # (not given: export without --trt takes it so)
        _engine_defaults(a)
        assert (a.max_block, a.workspace) == (MAX_BLOCK, 2.0)
    out = tmp_path / "never"
    _one_line_error(_cli("export", STORIES, "-o", out, "--trt", "--cache-layout", "head"),
                    "--cache-layout head", "onnxruntime's CPU provider only")
    _one_line_error(_cli("export", STORIES, "-o", out, "--trt", "--max-block", "0"),
                    "--max-block must be a number of rows in [1, 1024], got 0")
    _one_line_error(_cli("export", STORIES, "-o", out, "--trt", "--workspace", "0"),
                    "--workspace must be a number of GiB > 0, got 0")
    assert not out.exists()
