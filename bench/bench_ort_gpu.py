"""onnxruntime on an NVIDIA GPU (issue 9, part 2): an exported package's steps on the CUDA
execution provider (the cache on the device, one CUDA graph per block shape) and, where
onnxruntime has it, the TensorRT EP, next to the same package on the CPU EP.

Per package and device: whether CUDA graphs run (or why not), ``t_ms`` (T -> ms for T in
1..64, each call synchronised), tokens/s of plain decoding and of each drafter at each BC,
BE, and ``identical`` (outputs equal to plain decoding on the same device, count/total).

Self-contained on a bare GPU machine with no internet: edgemtp comes from this tree;
onnxruntime-gpu from ``--site`` (a folder pip installed it into: ``bench/ort_gpu_parts.sh``
carries its 255 MB wheel in parts). Packages are paths (exported elsewhere and carried), or
``--export NAME:DTYPE`` exports a random-weight model with a real shape (``bench_gpu.SHAPES``;
``tiny:fp32`` for a CPU dry run) on the spot. Writes ``<out>/ort_gpu.json`` and ``.md``.

    python bench/bench_ort_gpu.py carry/pkg-fp16 --export smollm2-135m:fp16 --site /tmp/site
    python bench/bench_ort_gpu.py out/pkg/stories260K --devices cpu --out /tmp/o   # dry run
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("packages", nargs="*", help="exported package folders")
    ap.add_argument("--export", default="", help="NAME:DTYPE,... random-weight shapes to "
                                                 "export here (smollm2-135m, qwen3-0.6b, "
                                                 "llama3.2-1b, tiny)")
    ap.add_argument("--devices", default="cpu,cuda,tensorrt",
                    help="onnxruntime devices to run (those missing are skipped with the "
                         "reason); cuda-nographs: the CUDA EP without CUDA graphs")
    ap.add_argument("--drafters", default="auto,probe,pld,hybrid")
    ap.add_argument("--bc", default="10,60")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=10, help="timed calls per block size")
    ap.add_argument("--site", default=None, help="a folder to import onnxruntime(-gpu) from")
    ap.add_argument("--max-context", type=int, default=512)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    a = ap.parse_args(argv)
    a.devices = [d for d in a.devices.split(",") if d]
    a.drafters = [d for d in a.drafters.split(",") if d]
    a.bcs = [int(b) for b in a.bc.split(",") if b]
    a.export = [tuple(e.split(":")) for e in a.export.split(",") if e]
    if not a.packages and not a.export:
        ap.error("give a package folder or --export NAME:DTYPE")
    return a


def export_random(name: str, dtype: str, work: Path, max_context: int) -> Path:
    """A random-weight model of a real shape, saved and exported to a package here."""
    import torch

    import bench_gpu
    from edgemtp.export.onnx_export import export_package

    quick = name == "tiny"
    hf = bench_gpu.random_model("smollm2-135m" if quick else name, "cpu", "fp32", quick, 0)
    folder = work / f"{name}-hf"
    hf.save_pretrained(folder)
    del hf
    torch.set_num_threads(max(1, torch.get_num_threads()))
    out = work / f"{name}-{dtype}"
    export_package(str(folder), out, dtype=dtype, max_context=max_context, force=True,
                   progress=False)
    return out


def prompts_for(model, n: int) -> list[list[int]]:
    """The shipped story prompts where the vocabulary is stories260K's, else fixed random ids
    (a random-weight model has no tokenizer)."""
    import bench_gpu

    ids = json.loads(bench_gpu.PROMPTS_FILE.read_text())["prompts"]
    if model.backend.vocab_size == 512:
        return ids[:n]
    rng = np.random.default_rng(0)
    return [rng.integers(3, model.backend.vocab_size, size=32).tolist() for _ in range(n)]


def run_device(pkg: Path, device: str, a) -> dict:
    from edgemtp import GenerationConfig, Model
    from edgemtp.errors import EdgeMTPError
    from edgemtp.latency import measure_latency

    from edgemtp.runtimes.onnxrt_backend import OrtBackend

    row: dict = dict(package=str(pkg), device=device)
    t0 = time.perf_counter()
    # "cuda-nographs": the CUDA EP with the cache on the device, every step uncaptured
    dev, graphs = device.split("-")[0], (False if device.endswith("-nographs") else None)
    try:
        model = Model(OrtBackend(str(pkg), device=dev, max_context=a.max_context,
                                 cuda_graphs=graphs), None)
    except EdgeMTPError as e:
        row["skipped"] = str(e)
        return row
    b = model.backend
    row.update(load_s=round(time.perf_counter() - t0, 2), dtype=b.package.manifest["dtype"],
               cuda_graphs=bool(getattr(b, "cuda_graphs", False)),
               graphs_off=getattr(b, "graphs_off", ""),
               device_cache=b.commit_graph is not None)
    sizes = [t for t in (1, 2, 4, 8, 16, 32, 64) if t < b.max_context // 2]
    curve = measure_latency(b, sizes, context=64, repeats=a.repeats)
    row["t_ms"] = {str(t): round(s * 1e3, 4) for t, s in zip(curve.sizes, curve.seconds)}
    prompts = prompts_for(model, a.prompts)

    def timed(config):
        model.generate(prompts[0], config)  # warm-up: plans, graphs, auto's curve
        outs, tokens, calls, t = [], 0, 0, time.perf_counter()
        for p in prompts:
            r = model.generate(p, config)
            outs.append(r.token_ids)
            tokens += r.stats.new_tokens
            calls += r.stats.forward_calls
        return outs, tokens / (time.perf_counter() - t), tokens / calls

    plain, row["tps_plain"], _ = timed(GenerationConfig(drafter="none",
                                                         max_new_tokens=a.new_tokens))
    row["drafters"] = []
    for d in a.drafters:
        for bc in a.bcs:
            config = GenerationConfig(drafter=d, bc=bc, max_new_tokens=a.new_tokens)
            try:
                outs, tps, be = timed(config)
            except EdgeMTPError as e:
                row["drafters"].append(dict(drafter=d, bc=bc, skipped=str(e)))
                continue
            same = sum(o == p for o, p in zip(outs, plain))
            row["drafters"].append(dict(drafter=d, bc=bc, tps=round(tps, 2), be=round(be, 4),
                                        speedup=round(tps / row["tps_plain"], 4),
                                        identical=[same, len(prompts)]))
            print(f"  {pkg.name} {device} {d}@{bc}: BE {be:.2f}, {tps:.0f} tok/s, identical "
                  f"{same}/{len(prompts)}", flush=True)
    row["tps_plain"] = round(row["tps_plain"], 2)
    return row


def markdown(summary: dict) -> str:
    out = [f"# edgemtp on onnxruntime: {summary['gpu']}", "",
           f"{summary['date']}; onnxruntime {summary['onnxruntime']}, providers "
           f"{', '.join(summary['providers'])}. Command: `{summary['command']}`", "",
           "tok/s over the prompts after one warm-up generation; speed-up and identity "
           "against plain decoding on the same device.", ""]
    for r in summary["rows"]:
        out += [f"## {Path(r['package']).name} on {r['device']}", ""]
        if "skipped" in r:
            out += [f"skipped: {r['skipped']}", ""]
            continue
        out += [f"dtype {r['dtype']}; CUDA graphs {r['cuda_graphs']}"
                + (f" ({r['graphs_off']})" if r["graphs_off"] and r["device"] != "cpu" else "")
                + f"; cache on the device {r['device_cache']}; load {r['load_s']} s", "",
                "| T | " + " | ".join(r["t_ms"]) + " |", "|---|" + "---:|" * len(r["t_ms"]),
                "| ms | " + " | ".join(f"{v:.3f}" for v in r["t_ms"].values()) + " |", "",
                "| method | BC | BE | tok/s | speed-up | identical |",
                "|---|---:|---:|---:|---:|---:|",
                f"| plain | 1 | 1.000 | {r['tps_plain']:.1f} | | |"]
        for d in r["drafters"]:
            if "skipped" in d:
                out.append(f"| {d['drafter']} | {d['bc']} | skipped: {d['skipped']} | | | |")
            else:
                out.append(f"| {d['drafter']} | {d['bc']} | {d['be']:.3f} | {d['tps']:.1f} | "
                           f"{d['speedup']:.2f}x | {d['identical'][0]}/{d['identical'][1]} |")
        out.append("")
    return "\n".join(out)


def main(argv=None) -> int:
    a = parse(argv)
    if a.site:
        sys.path.insert(0, a.site)
    import onnxruntime as ort

    if hasattr(ort, "preload_dlls"):  # CUDA and cuDNN from the nvidia-* pip packages
        try:
            ort.preload_dlls()
        except Exception as e:  # noqa: BLE001  (a CPU build has nothing to preload)
            print(f"onnxruntime.preload_dlls: {e}", flush=True)
    import bench_gpu  # (imports edgemtp from this tree)

    providers = ort.get_available_providers()
    print(f"onnxruntime {ort.__version__} from {Path(ort.__file__).parent}: {providers}",
          flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    packages = [Path(p) for p in a.packages]
    work = Path(tempfile.mkdtemp(prefix="ort_gpu_"))
    for name, dtype in a.export:
        t0 = time.perf_counter()
        packages.append(export_random(name, dtype, work, a.max_context))
        print(f"exported {name}:{dtype} in {time.perf_counter() - t0:.0f} s", flush=True)
    gpu = bench_gpu.device_name("cuda" if bench_gpu.torch.cuda.is_available() else "cpu")
    summary = dict(gpu=gpu, date=time.strftime("%Y-%m-%d %H:%M"), onnxruntime=ort.__version__,
                   providers=providers, command="python bench/bench_ort_gpu.py "
                   + " ".join(sys.argv[1:] if argv is None else argv), rows=[])
    for pkg in packages:
        for device in a.devices:
            print(f"{pkg.name} on {device}", flush=True)
            try:
                summary["rows"].append(run_device(pkg, device, a))
            except Exception as e:  # noqa: BLE001  (a failing device must not lose the rest)
                import traceback

                where = traceback.extract_tb(e.__traceback__)[-1]
                text = (str(e).strip().splitlines() or [""])[0][:300]
                summary["rows"].append(dict(package=str(pkg), device=device, skipped=(
                    f"failed: {type(e).__name__}: {text} ({Path(where.filename).name}:"
                    f"{where.lineno})")))
                traceback.print_exc()
            (out / "ort_gpu.json").write_text(json.dumps(summary, indent=1))
            (out / "ort_gpu.md").write_text(markdown(summary))
    print(markdown(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
