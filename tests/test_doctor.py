"""``edgemtp doctor``: the probe of this machine, the command run for real, and the pure
verdicts and memory plan on the hand-made facts of machines CI does not have (a Jetson Orin
on JetPack 6, a CUDA desktop)."""

from __future__ import annotations

import json
import math
import os
import platform
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import pytest

from edgemtp import doctor
from edgemtp.doctor import Facts, Gpu
from edgemtp.runtimes.package import load_package

ROOT = Path(__file__).resolve().parents[1]
GiB = 2**30
JP6_INDEX = "https://pypi.jetson-ai-lab.io/jp6/cu126"

# a Jetson Orin Nano 8GB on JetPack 6.1/6.2 with the CPU onnxruntime from PyPI: no
# onnxruntime-gpu, no torch, no TensorRT Python bindings; CUDA, cuDNN, libnvinfer from JetPack
ORIN = Facts(system="Linux aarch64", python="3.10.12", cpu_cores=6,
             host_total=8 * GiB, host_available=6 * GiB,
             jetson_model="NVIDIA Jetson Orin Nano Developer Kit", l4t="36.4.0",
             cuda_driver="12.6", cuda_toolkit="12.6.68", cudnn="9.3.0", nvinfer=True,
             onnxruntime="1.20.1", ort_providers=("CPUExecutionProvider",))
# a desktop with a 24 GB GPU, a CPU-only torch and the CPU onnxruntime
DESKTOP = Facts(system="Linux x86_64", python="3.11.7", cpu_cores=16, host_total=64 * GiB,
                host_available=50 * GiB, gpus=(Gpu("NVIDIA GeForce RTX 4090", 24 * GiB,
                                                   20 * GiB),),
                driver="570.86", cuda_driver="12.8", torch="2.13.0+cpu",
                onnxruntime="1.22.0", ort_providers=("CPUExecutionProvider",))


def test_a_busy_cpu_is_named_with_the_threads_to_give():
    busy = doctor.describe_machine(replace(DESKTOP, cpu_cores=2, load1=1.9))
    quiet = doctor.describe_machine(replace(DESKTOP, cpu_cores=2, load1=0.3))
    line = next(x for x in busy if x.startswith("load"))
    assert "1.90 runnable" in line and "--threads" in line
    assert [x for x in quiet if x.startswith("load")] == [
        "load      0.30 runnable over the last minute on 2 cores"]
    assert not [x for x in doctor.describe_machine(DESKTOP) if x.startswith("load")]
    if hasattr(os, "getloadavg"):
        assert doctor.probe().load1 >= 0


def by_pair(facts: Facts) -> dict[tuple[str, str], doctor.Verdict]:
    return {(v.backend, v.device): v for v in doctor.verdicts(facts)}


# -- this machine ---------------------------------------------------------------------------


def test_probe_reads_this_machine():
    f = doctor.probe()
    assert f.problems == ()
    assert f.python == platform.python_version()
    assert f.jetson == Path("/etc/nv_tegra_release").exists()
    if Path("/proc/meminfo").exists():
        assert 0 < f.host_available <= f.host_total
    import onnxruntime
    import torch

    assert (f.torch, f.torch_cuda) == (torch.__version__, torch.version.cuda)
    assert (f.onnxruntime, f.ort_providers) == (onnxruntime.__version__,
                                                tuple(onnxruntime.get_available_providers()))
    assert f.torch_cuda_ok == torch.cuda.is_available()
    v = by_pair(f)
    assert v["torch", "cpu"].ok and v["onnxruntime", "cpu"].ok
    assert v["torch", "cuda"].ok == torch.cuda.is_available()


def _doctor(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "edgemtp.cli", "doctor", *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)


def test_a_reader_that_goes_away_ends_the_report_quietly():
    # `edgemtp doctor | head -1`: the pipe closes before the report is written
    p = subprocess.Popen([sys.executable, "-m", "edgemtp.cli", "doctor"], cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 141, err
    assert "Traceback" not in err and "BrokenPipe" not in err, err


@pytest.fixture(scope="module")
def runs(stories_pkg, tmp_path_factory):
    """Every doctor run of this file, started together."""
    empty = tmp_path_factory.mktemp("doctor") / "not-a-package"
    empty.mkdir()
    jobs = {"plain": [], "json": ["--json"], "pkg": [str(stories_pkg)],
            "pkg-json": [str(stories_pkg), "--json"],
            "missing": [str(empty.parent / "nope")], "not-a-package": [str(empty)]}
    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        futures = {k: pool.submit(_doctor, *argv) for k, argv in jobs.items()}
        return {k: f.result() for k, f in futures.items()}


def _row(out: str, backend: str, device: str) -> str:
    m = re.search(rf"^ *(?:backends)? +{backend} +{device} +(ok|no) .*$", out, re.M)
    assert m, f"no {backend}/{device} row in:\n{out}"
    return m.group(0)


def test_doctor_command_reports_this_machine(runs):
    p = runs["plain"]
    assert p.returncode == 0 and p.stderr == "", p.stderr
    out = p.stdout
    for section in ("machine", "memory", "jetson", "gpu", "cuda", "packages", "backends"):
        assert re.search(rf"^{section}\b", out, re.M), section
    assert " ok " in _row(out, "torch", "cpu") and " ok " in _row(out, "onnxruntime", "cpu")
    if doctor.probe().has_gpu:
        pytest.skip("the CPU-only checks below need a machine without an NVIDIA GPU")
    assert "gpu       none found" in out and "jetson    no" in out
    assert "this machine has no NVIDIA GPU" in _row(out, "torch", "cuda")
    for backend, device in [("torch", "cuda"), ("onnxruntime", "cuda"),
                            ("onnxruntime", "tensorrt"), ("tensorrt", "cuda")]:
        assert " no " in _row(out, backend, device)
    installs = re.findall(r"^ {36}install: (.*)$", out, re.M)
    assert len(installs) == 4
    assert any("pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cu126" in i
               for i in installs)
    assert any("pip install onnxruntime-gpu" in i for i in installs)


def test_doctor_json_is_one_object_with_the_same_verdicts(runs):
    p = runs["json"]
    assert p.returncode == 0, p.stderr
    (line,) = p.stdout.strip().splitlines()
    data = json.loads(line)
    assert set(data) == {"units", "machine", "jetpack", "backends", "memory_plan", "fastest"}
    assert data["units"] == "memory figures in bytes"  # (qa9 D6)
    assert data["memory_plan"] is None
    assert f"fastest   {data['fastest']}" in runs["plain"].stdout
    assert [(b["backend"], b["device"]) for b in data["backends"]] == list(doctor.CHECKS)
    assert data["machine"]["python"] == platform.python_version()
    for b in data["backends"]:
        assert (b["install"] is None) == b["ok"]
        assert _row(runs["plain"].stdout, b["backend"], b["device"]).split()[-1] \
            in b["reason"]


def test_doctor_with_a_package_prints_its_memory_plan(runs, stories_pkg):
    p = runs["pkg"]
    assert p.returncode == 0 and p.stderr == "", p.stderr
    pkg = load_package(stories_pkg, check_plans=False)
    m = pkg.meta
    assert f"max context {m.max_context}, largest plan block T = 60" in p.stdout
    fp32 = re.search(r"^ +fp32 \* +(.*)$", p.stdout, re.M).group(1).split()
    assert " ".join(fp32[:4]) == f"{doctor.size(pkg.weight_bytes())} " \
                                 f"{doctor.size(pkg.kv_cache_bytes(dtype='fp32'))}"
    assert re.search(r"^ +fp16 +\d", p.stdout, re.M)  # fp16: the other dtype, unmarked
    assert "formula   total = (weights + KV cache + workspace" in p.stdout
    # whether onnxruntime can capture its graph, as inspect says (a fresh export: ready)
    assert "cuda      ready for onnxruntime's CUDA graphs" in p.stdout

    plan = json.loads(runs["pkg-json"].stdout)["memory_plan"]
    assert plan["cuda_graphs"].startswith("ready")
    rows = {r["dtype"]: r for r in plan["rows"]}
    assert rows["fp32"]["own"] and not rows["fp16"]["own"]
    assert rows["fp32"]["weights"] == pkg.weight_bytes()
    assert rows["fp16"]["kv_cache"] == pkg.kv_cache_bytes(dtype="fp16") \
        == 2 * m.num_layers * m.max_context * m.num_kv_heads * m.head_dim * 2
    for r in rows.values():  # a 1 MiB model fits any machine that runs these tests: the
        # largest context that fits is the package's own limit (it said millions)
        assert r["fits"] and r["max_context"] == m.max_context
        assert r["max_prompt"] == m.max_context
    assert f"at most the package's max context {m.max_context}" in p.stdout


@pytest.mark.parametrize("case, expect", [("missing", r"nope.* does not exist"),
                                          ("not-a-package", r"has no edgemtp\.json")])
def test_doctor_with_a_bad_package_is_one_line_and_exit_2(runs, case, expect):
    p = runs[case]
    assert p.returncode == 2 and p.stdout == ""
    (line,) = p.stderr.strip().splitlines()
    assert line.startswith("edgemtp: error: ") and re.search(expect, line), line


# -- facts of machines CI does not have -----------------------------------------------------


def test_jetson_orin_on_jetpack_6_gets_the_jetpack_install_steps():
    assert ORIN.jetson and ORIN.has_gpu
    assert ORIN.jetpack == ("6.1 or 6.2", "12.6", "10.3")
    v = by_pair(ORIN)
    assert v["onnxruntime", "cpu"].ok and not v["torch", "cpu"].ok
    onnx_gpu = ("pip uninstall -y onnxruntime && pip install onnxruntime-gpu --index-url "
                + JP6_INDEX)
    assert v["onnxruntime", "cuda"].install == onnx_gpu
    assert v["onnxruntime", "tensorrt"].install == onnx_gpu  # libnvinfer is JetPack's
    assert "has no CUDAExecutionProvider" in v["onnxruntime", "cuda"].reason
    assert v["torch", "cuda"].install == ("pip uninstall -y torch && pip install torch "
                                          f"--index-url {JP6_INDEX}")
    assert v["tensorrt", "cuda"].install == ("sudo apt install nvidia-tensorrt python3-libnvinfer"
                                             ' && pip install "cuda-python>=12.6,<13"')
    assert not any(x.ok for k, x in v.items() if k[1] != "cpu")
    assert not any("nvidia.com/drivers" in (x.install or "") for x in v.values())

    text = doctor.report(ORIN)
    assert "L4T R36.4.0: JetPack 6.1 or 6.2 (CUDA 12.6, TensorRT 10.3)" in text
    assert "on Jetson the GPU shares this memory" in text


def test_jetson_with_onnxruntime_gpu_and_tensorrt_installed_is_all_ok():
    done = replace(ORIN, ort_providers=("TensorrtExecutionProvider", "CUDAExecutionProvider",
                                        "CPUExecutionProvider"), tensorrt="10.3.0",
                   torch="2.8.0", torch_cuda="12.6", torch_cuda_ok=True, native_decoder=None)
    assert all(v.ok and v.install is None for v in doctor.verdicts(done))


def test_jetpack_6_0_uses_its_cuda_12_2_index_and_jetpack_5_is_told_to_upgrade():
    jp60 = replace(ORIN, l4t="36.3.0", cuda_driver="12.2")
    assert jp60.jetpack == ("6.0", "12.2", "8.6")
    v = by_pair(jp60)
    assert v["onnxruntime", "cuda"].install.endswith("https://pypi.jetson-ai-lab.io/jp6/cu122")
    trt = by_pair(replace(jp60, tensorrt="8.6.2"))["tensorrt", "cuda"]
    assert "needs TensorRT 10" in trt.reason and "flash JetPack 6.1 or later" in trt.install

    jp5 = by_pair(replace(ORIN, l4t="35.4.1"))["onnxruntime", "cuda"]
    assert jp5.install.startswith("flash JetPack 6") and "R35.4.1" in jp5.install


def test_jetson_wheels_are_for_python_3_10():
    v = by_pair(replace(ORIN, python="3.12.3"))["onnxruntime", "cuda"]
    assert "Python 3.10" in v.reason and "3.12.3" in v.reason


@pytest.mark.parametrize("driver, wheel", [("12.8", "cu126"), ("12.6", "cu126"),
                                           ("12.2", "cu126"), ("13.1", "cu130"),
                                           ("13.0", "cu130"), (None, "cu126")])
def test_desktop_torch_cuda_wheel_follows_the_driver(driver, wheel):
    """PyTorch 2.13 publishes cu126 and cu130 wheels (no cu128 since 2.12); a CUDA 12.2
    driver (R535, a datacenter branch) runs cu126 by minor-version compatibility."""
    v = by_pair(replace(DESKTOP, cuda_driver=driver))["torch", "cuda"]
    assert "CPU-only build" in v.reason and "driver" not in v.reason
    assert v.install == ("pip uninstall -y torch && pip install torch==2.13.0 --index-url "
                         f"https://download.pytorch.org/whl/{wheel}")


def test_fastest_pair_follows_what_was_measured():
    # an H200-like box with onnxruntime-gpu and CUDA torch: torch (CUDA graphs) is named
    # over onnxruntime's CUDA EP, which ran 0.63-0.75x of its tokens/s on an H100; without
    # CUDA torch the EP; a CPU-only machine gets onnxruntime on its CPU
    gpu = replace(DESKTOP, torch="2.11.0+cu130", torch_cuda="13.0", torch_cuda_ok=True,
                  cudnn="9.19.0", onnxruntime="1.31.1",
                  ort_providers=("CUDAExecutionProvider", "CPUExecutionProvider"))
    assert by_pair(gpu)["torch", "cuda"].ok and by_pair(gpu)["onnxruntime", "cuda"].ok
    assert doctor.fastest(doctor.verdicts(gpu)).startswith("torch cuda")
    ort_only = replace(gpu, torch="2.13.0+cpu", torch_cuda=None, torch_cuda_ok=False)
    assert doctor.fastest(doctor.verdicts(ort_only)).startswith("onnxruntime cuda")
    # a CPU-only run: the native decoder where it loads, else onnxruntime
    assert doctor.fastest(doctor.verdicts(DESKTOP)).startswith("onnxruntime cpu")
    assert "fastest   onnxruntime cpu" in doctor.report(DESKTOP)
    built = replace(DESKTOP, native_decoder=None, native_kernel="portable C int4 kernel")
    assert by_pair(built)["native", "cpu"].ok
    assert doctor.fastest(doctor.verdicts(built)).startswith("native cpu")
    no_cc = by_pair(replace(DESKTOP, native_decoder="no C compiler (cc, gcc or clang) on PATH"))
    assert not no_cc["native", "cpu"].ok and "apt install gcc" in no_cc["native", "cpu"].install
    assert doctor.to_dict(gpu)["fastest"].startswith("torch cuda")


def test_desktop_verdicts_and_install_steps():
    v = by_pair(DESKTOP)
    assert v["onnxruntime", "cuda"].install == ("pip uninstall -y onnxruntime && pip install "
                                                "onnxruntime-gpu && sudo apt install "
                                                "cudnn9-cuda-12")
    assert v["tensorrt", "cuda"].install == ('pip install tensorrt && pip install '
                                             '"cuda-python>=12.6,<13"')
    old = by_pair(replace(DESKTOP, cuda_driver="11.8"))["torch", "cuda"]
    # (a step in words, then commands that paste as they are)
    assert old.install == ("update the NVIDIA driver to one for CUDA 12 or newer "
                           "(https://www.nvidia.com/drivers); then pip uninstall -y torch && "
                           "pip install torch==2.13.0 --index-url "
                           "https://download.pytorch.org/whl/cu126")
    ready = replace(DESKTOP, cudnn="9.1.0", nvinfer=True, tensorrt="10.9.0", cuda_python=True,
                    ort_providers=("TensorrtExecutionProvider", "CUDAExecutionProvider",
                                   "CPUExecutionProvider"))
    assert [x.ok for x in doctor.verdicts(ready)] == [True, False, True, False, True, True,
                                                      True]  # native: not probed


STORIES_PARAMS = 260032


def _total(pkg, dtype: str, rows: int, host: bool, parallel: int = 1) -> float:
    """The plan's formula as the report states it, written out independently (a float
    package: its own row as on disk, the other's weights its parameters x bytes and its
    host table [V, d] in that dtype)."""
    m, b = pkg.meta, doctor.PLAN_DTYPES[dtype]
    own = dtype == m.dtype
    t = max(p.T for p in m.plans)
    params = STORIES_PARAMS  # (transformers' count: see the test below)
    weights = pkg.weight_bytes() if own else params * b
    kv = 2 * m.num_layers * rows * m.num_kv_heads * m.head_dim * b
    work = t * (12 * m.hidden_size * b + (m.num_heads * (rows + t) + m.vocab_size) * 4)
    table = (pkg.root / "embeddings.npy").stat().st_size if own else \
        m.vocab_size * m.hidden_size * b + 128
    emb = table if host else 0
    return (weights + parallel * (kv + work) + emb) * 1.10


@pytest.mark.parametrize("facts", [ORIN, DESKTOP], ids=["jetson", "desktop"])
@pytest.mark.parametrize("available_kib", [2500, 3072, 8192])  # 2500: fp32 does not fit 256
def test_memory_plan_max_context_is_the_largest_that_fits(stories_pkg, facts, available_kib):
    avail = available_kib * 2**10
    facts = replace(facts, host_available=avail,
                    gpus=tuple(replace(g, free_bytes=avail) for g in facts.gpus))
    pkg = load_package(stories_pkg, check_plans=False)
    plan = doctor.memory_plan(pkg, facts)
    assert plan.pool.available == avail and plan.pool.host == facts.jetson
    for r in plan.rows:
        assert r.total == math.ceil(_total(pkg, r.dtype, pkg.meta.max_context, facts.jetson))
        assert r.fits == (r.total <= avail)
        assert r.max_context > plan.block, "every size here fits the largest plan"
        assert _total(pkg, r.dtype, r.max_context, facts.jetson) <= avail
        # the largest that fits, up to the package's own limit (its graph's)
        assert r.max_context <= pkg.meta.max_context
        assert (r.max_context == pkg.meta.max_context
                or _total(pkg, r.dtype, r.max_context + 1, facts.jetson) > avail)
        assert r.fits == (r.max_context >= pkg.meta.max_context)
    text = "\n".join(doctor.describe_plan(plan))
    assert ("shared CPU/GPU memory" in text) == facts.jetson
    assert ("GPU 0 (NVIDIA GeForce RTX 4090) free memory" in text) == (not facts.jetson)


@pytest.mark.parametrize("parallel", [2, 5])
def test_memory_plan_for_parallel_generations(stories_pkg, parallel):
    # edgemtp serve --parallel N: N caches and workspaces beside one copy of the weights
    avail = 6 * 2**20
    facts = replace(DESKTOP, host_available=avail,
                    gpus=tuple(replace(g, free_bytes=avail) for g in DESKTOP.gpus))
    pkg = load_package(stories_pkg, check_plans=False)
    one = {r.dtype: r for r in doctor.memory_plan(pkg, facts).rows}
    plan = doctor.memory_plan(pkg, facts, parallel)
    assert plan.parallel == parallel
    for r in plan.rows:
        assert r.kv_cache == parallel * one[r.dtype].kv_cache
        assert r.weights == one[r.dtype].weights
        assert r.total == math.ceil(_total(pkg, r.dtype, pkg.meta.max_context, False, parallel))
        assert r.max_context <= one[r.dtype].max_context
        assert (r.max_context == pkg.meta.max_context
                or _total(pkg, r.dtype, r.max_context + 1, False, parallel) > avail)
        assert _total(pkg, r.dtype, r.max_context, False, parallel) <= avail
    # 5 fp32 caches of the package's 256 rows do not fit 6 MiB; of 60-255 rows they do
    assert (plan.rows[0].max_context < pkg.meta.max_context) == (parallel == 5)
    assert plan.rows[0].max_context > plan.block
    text = "\n".join(doctor.describe_plan(plan))
    assert f"parallel  {parallel} generations at once (edgemtp serve --parallel {parallel})" in text
    assert f"KV cache = {parallel} x 2 x layers" in text


def test_memory_plan_figures_match_the_real_model_and_session(stories_pkg):
    """Anchors for the plan's formula, taken where doctor does not look: the parameter count
    is transformers' own, the fp32 row's weights are what the fp32 package's files weigh (the
    graph's protobuf framing aside), its KV cache what a real onnxruntime session holds at
    the max context, and the fp16 row half of both."""
    from conftest import STORIES
    from transformers import AutoModelForCausalLM

    from edgemtp.runtimes.onnxrt_backend import OrtBackend

    pkg = load_package(stories_pkg, check_plans=False)
    assert pkg.meta.dtype == "fp32"
    params = AutoModelForCausalLM.from_pretrained(STORIES).num_parameters()
    assert doctor.parameter_count(pkg) == params == STORIES_PARAMS
    rows = {r.dtype: r for r in doctor.memory_plan(pkg, DESKTOP).rows}
    on_disk = sum(f.stat().st_size for f in stories_pkg.iterdir()
                  if f.name.startswith("model.onnx"))
    assert rows["fp32"].own and rows["fp32"].weights == on_disk
    assert 4 * params < on_disk < 1.1 * 4 * params  # (the graph's nodes and framing)
    session = OrtBackend(str(stories_pkg), threads=1).session()
    kv = session.kv
    if hasattr(kv, "_resize"):  # (a cache that grows in buckets: at its full width)
        kv._resize(pkg.meta.max_context)
    assert rows["fp32"].kv_cache == kv.k.nbytes + kv.v.nbytes
    assert rows["fp16"].kv_cache * 2 == rows["fp32"].kv_cache
    assert rows["fp16"].weights * 2 == 4 * params


def test_memory_plan_when_nothing_fits(stories_pkg):
    pkg = load_package(stories_pkg, check_plans=False)
    plan = doctor.memory_plan(pkg, replace(ORIN, host_available=2**20))
    assert [(r.fits, r.max_context, r.max_prompt) for r in plan.rows] == [(False, 0, 0)] * 2


# -- a package as inspect and generate see it (QA: labels, sizes, refusals) -------------------


@pytest.fixture(scope="module")
def int4_pkg(tmp_path_factory):
    """stories260K as a small int4 package (one plan)."""
    from conftest import STORIES
    from edgemtp.export.onnx_export import export_package

    out = tmp_path_factory.mktemp("doctor-int4") / "stories-int4"
    export_package(str(STORIES), out, dtype="int4", max_context=128, bc=(10,),
                   mask_tokens=(1,), progress=False)
    return out


def test_an_int4_package_s_rows_are_its_weights_and_float_re_exports(int4_pkg, stories_pkg):
    # its row was labelled with the activations' dtype ("fp32 *"), an fp16 row was half the
    # int4 file, and the context figures ran to millions past the graph's limit
    pkg, fp32 = load_package(int4_pkg, check_plans=False), load_package(stories_pkg,
                                                                        check_plans=False)
    plan = doctor.memory_plan(pkg, ORIN)
    rows = {r.dtype: r for r in plan.rows}
    assert list(rows) == ["int4", "fp32", "fp16"]
    assert rows["int4"].own and not rows["fp32"].own and not rows["fp16"].own
    assert rows["int4"].weights == pkg.weight_bytes()
    # a float re-export stores the model's parameters: the fp32 package's graph's (give or
    # take a table that depends on the max context)
    import onnx

    graph = onnx.load(str(fp32.graph_path)).graph
    values = sum(math.prod(t.dims) for t in graph.initializer
                 if t.data_type == onnx.TensorProto.FLOAT)
    assert abs(rows["fp32"].weights - 4 * values) <= 0.01 * 4 * values
    assert rows["fp16"].weights == rows["fp32"].weights // 2 > 1.5 * pkg.weight_bytes()
    assert [r.max_context for r in plan.rows] == [128] * 3  # 6 GiB fit far more
    text = "\n".join(doctor.describe_plan(plan))
    assert re.search(r"^ +int4 \* ", text, re.M) and not re.search(r"fp(32|16) \*", text)
    assert "at most the package's max context 128" in text
    if plan.native:  # the C decoder builds here
        assert "largest context that fits: 128 (float16), 128 (int8)" in plan.native


def _swap_plan(p: Path) -> None:
    # another budget's plan file in place of bc=30 k=1, its record updated to match
    from edgemtp.runtimes.package import record_files

    (p / "plans/bc30_k1.npz").write_bytes((p / "plans/bc10_k1.npz").read_bytes())
    m = json.loads((p / "edgemtp.json").read_text())
    m["files"] = {k: {"bytes": v.bytes, "sha256": v.sha256}
                  for k, v in record_files(p).items()}
    (p / "edgemtp.json").write_text(json.dumps(m))


def _set(*path_value):
    *keys, value = path_value

    def edit(p: Path) -> None:
        m = json.loads((p / "edgemtp.json").read_text())
        d = m
        for k in keys[:-1]:
            d = d[k]
        d[keys[-1]] = value
        (p / "edgemtp.json").write_text(json.dumps(m))
    return edit


BROKEN = {"num-kv-heads": _set("num_kv_heads", 2), "head-dim": _set("head_dim", 4),
          "topk": _set("topk", 40), "swapped-plan": _swap_plan,
          "cache-layout": _set("cache", "layout", "[1, H_kv, P, D] per layer, head-major")}


@pytest.fixture(scope="module")
def broken_runs(stories_pkg, tmp_path_factory):
    """doctor and inspect on each broken copy of the package: {case: (doctor, inspect)}."""
    import shutil

    jobs = {}
    for case, breaker in BROKEN.items():
        copy = tmp_path_factory.mktemp(case) / "pkg"
        shutil.copytree(stories_pkg, copy)
        breaker(copy)
        jobs[(case, "doctor")] = ["doctor", str(copy)]
        jobs[(case, "inspect")] = ["inspect", str(copy)]

    def run(argv):
        return subprocess.run([sys.executable, "-m", "edgemtp.cli", *argv], capture_output=True,
                              text=True, cwd=ROOT, timeout=300)
    with ThreadPoolExecutor(max_workers=4) as pool:
        futures = {k: pool.submit(run, argv) for k, argv in jobs.items()}
        done = {k: f.result() for k, f in futures.items()}
    return {case: (done[(case, "doctor")], done[(case, "inspect")]) for case in BROKEN}


@pytest.mark.parametrize("case", list(BROKEN))
def test_doctor_refuses_what_inspect_refuses_with_the_same_line(broken_runs, case):
    # doctor printed a plan (exit 0) for packages inspect and generate refuse
    doc, ins = broken_runs[case]
    for p in (doc, ins):
        assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
        (line,) = p.stderr.strip().splitlines()
        assert line.startswith("edgemtp: error: "), line
    assert doc.stderr == ins.stderr and doc.stdout == ""


def test_doctor_judges_a_package_without_loading_its_weights(stories_pkg, monkeypatch, capsys):
    # doctor says whether a package fits: loading it to find out (an onnxruntime session, the
    # C decoder's packed weights) could not, where it does not (the review's find)
    from edgemtp import api, cli

    def refuse(*args, **kwargs):
        raise AssertionError("doctor loaded the model")

    monkeypatch.setattr(api.Model, "load", refuse)
    assert cli.main(["doctor", str(stories_pkg)]) == 0
    assert "fits" in capsys.readouterr().out


@pytest.mark.parametrize("args, line", [
    (["--parallel", "0"], "--parallel must be 1..4096, got 0"),
    (["--parallel", "100000", "x"], "--parallel must be 1..4096, got 100000"),
    (["--parallel", "3"], "--parallel plans a package's memory: give the package too (edgemtp "
                          "doctor PACKAGE --parallel N)"),
])
def test_doctor_parallel_bad_input_is_one_line(args, line, capsys):
    from edgemtp.cli import main

    assert main(["doctor", *args]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.strip() == f"edgemtp: error: {line}"
