"""bench/bench_gpu.py on CPU: the whole script end to end in --quick mode (as a machine
without edgemtp installed runs it), and its parts that decide what the GPU results say: the
shipped prompt ids, the divergence report, the targets and the expected speed-up."""

import doctest
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import STORIES, smollm2_dir, story_prompts

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "bench_gpu.py"
# run the script with the editable install's finder removed, as on a machine where edgemtp
# is not installed: the script must find edgemtp (and edgemtp.runtimes, .models, .tools) in
# the source tree by itself
BARE = ("import runpy, sys\n"
        "sys.meta_path = [f for f in sys.meta_path\n"
        "                 if '__editable__' not in getattr(f, '__module__', '')]\n"
        "sys.argv = sys.argv[1:]\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')\n")


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_gpu", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_quick_cpu_run_writes_every_key(tmp_path):
    proc = subprocess.run([sys.executable, "-c", BARE, str(SCRIPT), "--device", "cpu",
                           "--quick", "--stories", str(STORIES), "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    summary = json.loads((tmp_path / "gpu_summary.json").read_text())
    meta = summary["meta"]
    assert meta["edgemtp_source"] == str(ROOT / "edgemtp")
    assert meta["runtimes_source"] == str(ROOT / "runtimes")
    entries = summary["entries"]
    assert set(entries) == {"stories260K/fp32", "smollm2-135m/fp32", "qwen3-0.6b/fp32",
                            "llama3.2-1b/fp32"}
    drafters = ["probe", "auto", "pld", "stand", "lade", "hybrid"]
    for key, e in entries.items():
        assert e["device"].startswith("cpu") and e["dtype"] == "fp32", key
        assert list(e["t_ms"]) == ["1", "2", "4", "8", "16", "32", "64"], key
        assert all(v > 0 for v in e["t_ms"].values()), key
        tps = e["tps"]
        for name in ("transformers_eager", "transformers_static", "plain"):
            assert tps[name] > 0, (key, name)
        for d in drafters:
            assert sorted(tps[d], key=int) == ["10", "30", "60"], (key, d)
            assert all(v > 0 for v in tps[d].values()), (key, d)
            assert all(v >= 1.0 for v in e["be"][d].values()), (key, d)
            assert all(v >= 1.0 for v in e["be_measured"][d].values()), (key, d)
            assert all(n == e["prompts"] for _, n in e["identical"]["rows"][d].values())
        # plain decoding before and after the drafters; speed-ups against the faster run, or
        # (stories260K, real weights) against plain decoding timed beside each drafter
        assert len(e["tps_plain_runs"]) == 2 and tps["plain"] == max(e["tps_plain_runs"])
        base = (e["tps_plain_paired"]["pld"]["10"] if key.startswith("stories")
                else tps["plain"])
        # (the file keeps tok/s to 2 decimals and the ratio to 4, each rounded from the
        # unrounded figures: 150.3 / 229.02 gives 0.6563, the file 0.6562)
        assert e["speedup"]["pld"]["10"] == pytest.approx(tps["pld"]["10"] / base, abs=2e-4)
        assert e["paired"] == (1 if key.startswith("stories") else 0)
        ident = e["identical"]
        assert ident["total"] == len(drafters) * 3 * e["prompts"] == 36
        assert ident["count"] == ident["total"], e["divergences"]  # fp32: lossless
        assert e["divergences"] == []
    stories = entries["stories260K/fp32"]
    assert stories["be"] == stories["be_measured"] and stories["weights"] == "stories260K"
    # each drafter's blocks timed in the decode loop, per block size it ran
    assert set(stories["block_ms"]["pld"]["10"]) == set(stories["block_sizes"]["pld"]["10"])
    assert all(ms > 0 for ms in stories["block_ms"]["pld"]["10"].values())
    # what auto decided from: one record per BC, its steps per kind summing to the decode
    # steps of its timed generations (each generation's prefill is one more forward call)
    for b, st in stories["auto_state"].items():
        assert sum(st["steps_by_kind"].values()) == (stories["forward_calls"]["auto"][b]
                                                     - stories["prompts"]), b
        assert "plain" in st["host_us"] and st["curve_ms"]["1"] > 0 and st["slope"] > 0
    # where a decode step's time goes, per method: the stages and the rest add up to the step,
    # and a step is mostly its forward call
    for d, by in stories["step_us"].items():
        for b, us in ({"1": by} if d == "plain" else by).items():
            parts = sum(us[k] for k in ("draft", "forward", "bind", "verify", "commit", "other"))
            assert parts == pytest.approx(us["step"], abs=1.0), (d, b, us)
            assert 0 < us["forward"] < us["step"] and us["draft"] >= 0, (d, b, us)
    assert set(stories["step_us"]) == {"plain", *drafters}
    # step shapes met and graphs captured inside the timed passes: none captured on a CPU
    for d in drafters:
        for b, g in stories["graphs"][d].items():
            assert g["captures"] == 0 and g["capture_s"] == 0 and g["shapes"] >= 0, (d, b, g)
    assert "Host and device time of a decode step" in (tmp_path / "gpu_cpu.md").read_text()
    # the torch backend's forward split per method: no device to wait for on a CPU, and the
    # parts inside the engine's `forward` stage
    assert set(stories["inside_us"]) == {"plain", *drafters}
    for d, by in stories["inside_us"].items():
        for b, i in ({"1": by} if d == "plain" else by).items():
            us = stories["step_us"][d] if d == "plain" else stories["step_us"][d][b]
            assert i["wait"] == 0 and i["run"] > 0 and i["load"] >= 0 and i["read"] >= 0
            assert i["load"] + i["run"] + i["read"] <= us["forward"] + 1.0, (d, b, i, us)
    assert "Inside the torch backend's forward" in (tmp_path / "gpu_cpu.md").read_text()
    assert stories["block_sizes"]["probe"]["10"] == {"10": stories["forward_calls"]["probe"]["10"]
                                                    - stories["prompts"]}
    for key in ("smollm2-135m/fp32", "qwen3-0.6b/fp32", "llama3.2-1b/fp32"):
        e = entries[key]
        assert e["weights"] == "random" and "stories260K/fp32" in e["be_source"]
        assert e["be"] == stories["be"]  # the real BE, not the random model's
        assert all(v > 0 for by in e["expected_speedup"].values() for v in by.values())
    names = [t["target"] for t in summary["targets"]]
    assert "fp32 identical on every prompt [stories260K/fp32]" in names
    assert "auto >= 1.3x plain on story prompts [stories260K/fp32]" in names
    for t in summary["targets"]:  # and one PASS/FAIL line each on stdout
        assert f"{'PASS' if t['passed'] else 'FAIL'}  {t['target']}: {t['detail']}" in proc.stdout
    md = (tmp_path / "gpu_cpu.md").read_text()
    assert "## llama3.2-1b/fp32" in md and "BE means nothing" in md


def test_bad_arguments_end_in_one_line(bench, tmp_path, capsys):
    for args, says in ((["--models", "gpt2:fp16"], "--models takes name:dtype"),
                       (["--skip", "plain"], "--skip takes some of"),
                       (["--stories", str(tmp_path)], "is not a model folder"),
                       (["--models", "smollm2-gguf:fp16", "--gguf", str(tmp_path / "x.gguf")],
                        "is not a file"),
                       (["--models", "smollm2-gguf:fp16", "--gguf", str(SCRIPT)],
                        "is not a GGUF file"),
                       (["--auto-param", "nope=1"], "--auto-param takes NAME=VALUE"),
                       (["--auto-param", "host_floor"], "--auto-param takes NAME=VALUE"),
                       (["--auto-param", "chain_margin=wide"], "takes a float")):
        with pytest.raises(SystemExit) as stop:
            bench.parse(["--device", "cpu", *args])
        assert stop.value.code == 2 and says in capsys.readouterr().err


def test_auto_params_are_parsed_by_the_attributes_type(bench):
    a = bench.parse(["--device", "cpu", "--auto-param", "host_floor=0",
                     "--auto-param", "chain_margin=1.1", "--auto-param", "refresh=4"])
    assert a.auto_params == {"host_floor": False, "chain_margin": 1.1, "refresh": 4}
    assert bench.parse(["--device", "cpu"]).auto_params == {}


def test_shipped_prompt_ids_are_the_tokenizers():
    from edgemtp.tokenizer import Tokenizer

    ids = json.loads((ROOT / "bench" / "data" / "gpu_prompts.json").read_text())["prompts"]
    texts = story_prompts()
    assert len(ids) == len(texts) == 48
    tok = Tokenizer(str(STORIES))
    assert ids == [tok.encode(t) for t in texts]


SMOLLM_GGUF = smollm2_dir() / "SmolLM2-135M-Instruct.Q4_1.gguf"
needs_gguf = pytest.mark.skipif(not SMOLLM_GGUF.is_file(),
                                reason="no SmolLM2 GGUF (../shared or the main job's fetched copy)")


@pytest.mark.slow
@needs_gguf
def test_shipped_chat_prompts_are_the_gguf_chat_template(bench):
    # the GPU machine has neither ../shared nor the GGUF's tokenizer: the ids travel
    shipped = json.loads(bench.CHAT_PROMPTS_FILE.read_text())
    assert shipped == bench.chat_prompts(SMOLLM_GGUF)
    assert len(shipped["prompts"]) == len(set(shipped["categories"])) == 13


@pytest.mark.slow
@needs_gguf
def test_gguf_entry_runs_real_weights_paired(tmp_path):
    # the real 135M model through transformers' GGUF loader, on CPU: real BE, speed-ups
    # paired with plain decoding, fp32 identical, the context sized for the prompt
    proc = subprocess.run([sys.executable, "-c", BARE, str(SCRIPT), "--device", "cpu",
                           "--models", "smollm2-gguf:fp32", "--gguf", str(SMOLLM_GGUF),
                           "--prompts", "1", "--new-tokens", "8", "--drafters", "pld,auto",
                           "--bc", "10", "--skip", "t_ms,static", "--warmup", "1",
                           "--paired", "1", "--threads", "2", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    e = json.loads((tmp_path / "gpu_summary.json").read_text())["entries"]["smollm2-gguf/fp32"]
    assert e["weights"] == SMOLLM_GGUF.name and e["shape"]["layers"] == 30
    assert e["paired"] == 1 and e["be"] == e["be_measured"]
    assert e["identical"]["count"] == e["identical"]["total"] == 2
    assert set(e["auto_state"]) == {"10"}
    assert "auto >= 1.3x plain on Spec-Bench chat prompts [smollm2-gguf/fp32]" in proc.stdout


def test_doctests(bench):
    result = doctest.testmod(bench, report=False)
    assert result.attempted >= 3 and result.failed == 0


def test_divergence_names_position_tokens_and_logit_gap(bench):
    import torch
    from transformers import AutoModelForCausalLM

    from edgemtp import Model
    from edgemtp.runtimes.torch_backend import TorchBackend

    hf = AutoModelForCausalLM.from_pretrained(STORIES).eval()
    backend = TorchBackend.from_model(hf, max_context=256)
    prompts = json.loads((ROOT / "bench" / "data" / "gpu_prompts.json").read_text())["prompts"][:2]
    plain = [Model(backend).generate(p, drafter="none", max_new_tokens=12).token_ids
             for p in prompts]
    pos = 5
    with torch.no_grad():
        logits = hf(torch.tensor([prompts[1] + plain[1][:pos]])).logits[0, -1]
    top2 = logits.topk(2).indices.tolist()
    assert top2[0] == plain[1][pos]
    other = plain[1][:pos] + [top2[1]] + plain[1][pos + 1:]
    rows = bench.divergences(backend, prompts, plain, [plain[0], other], "probe", 30)
    assert len(rows) == 1
    row = rows[0]
    assert (row["drafter"], row["bc"], row["prompt"], row["position"]) == ("probe", 30, 1, pos)
    assert (row["plain_token"], row["token"], row["top1_here"]) == (top2[0], top2[1], top2[0])
    want = (logits[top2[0]] - logits[top2[1]]).item()
    assert row["logit_gap"] == pytest.approx(want, abs=1e-4) and row["logit_gap"] > 0
    # a shorter output: the position where it ends, no second token to compare
    rows = bench.divergences(backend, prompts, plain, [plain[0], plain[1][:4]], "pld", 10)
    assert (rows[0]["position"], rows[0]["token"]) == (4, None)


def entry(dtype="fp16", weights="random", **changes):
    e = dict(dtype=dtype, weights=weights, device="gpu", t_ms={"1": 1.0, "64": 1.2},
             tps={"plain": 300.0, "transformers_eager": 100.0, "transformers_static": 250.0},
             tps_plain_on_hf_prompts=300.0, be_measured={"pld": {"10": 2.0}},
             speedup={"pld": {"10": 1.7}}, identical=dict(count=99, total=100),
             divergences=[{}])
    e.update(changes)
    return e


def test_targets_pass_and_fail_where_the_issue_says(bench):
    entries = {"smollm2-135m/fp16": entry(),
               "qwen3-0.6b/fp16": entry(tps_plain_on_hf_prompts=199.0, t_ms={"1": 1.0},
                                        speedup={"pld": {"10": 1.5}},
                                        identical=dict(count=98, total=100)),
               "stories260K/fp32": entry("fp32", "stories260K", tps={"plain": 1.0},
                                         speedup={"auto": {"10": 1.2, "60": 1.31}},
                                         be_measured={"auto": {"10": 1.3, "60": 1.5}},
                                         identical=dict(count=35, total=36))}
    got = {t["target"]: t["passed"] for t in bench.targets(entries)}
    assert got == {
        "plain >= 2x transformers_eager [smollm2-135m/fp16]": True,
        "plain >= 1x transformers_static [smollm2-135m/fp16]": True,
        "plain >= 2x transformers_eager [qwen3-0.6b/fp16]": False,      # 1.99x
        "plain >= 1x transformers_static [qwen3-0.6b/fp16]": False,     # 0.80x
        "t(64)/t(1) <= 1.3 [smollm2-135m/fp16]": True,
        "speed-up >= 0.8 x BE, every drafter [smollm2-135m/fp16]": True,    # 1.7 / 2.0
        "speed-up >= 0.8 x BE, every drafter [qwen3-0.6b/fp16]": False,     # 1.5 / 2.0
        "speed-up >= 0.8 x BE, every drafter [stories260K/fp32]": True,     # 0.92, 0.87
        "auto >= 1.3x plain on story prompts [stories260K/fp32]": True,     # BC 60: 1.31
        "fp16 identical >= 99% [smollm2-135m/fp16]": True,
        "fp16 identical >= 99% [qwen3-0.6b/fp16]": False,
        "fp32 identical on every prompt [stories260K/fp32]": False,
    }


def test_step_recorder_counts_decode_blocks_only(bench):
    from transformers import AutoModelForCausalLM

    from edgemtp import Model
    from edgemtp.runtimes.torch_backend import TorchBackend

    hf = AutoModelForCausalLM.from_pretrained(STORIES).eval()
    sizes = bench.StepSizes(TorchBackend.from_model(hf, max_context=256))
    model = Model(sizes)
    model.generate([1, 300, 301], drafter="probe", bc=10, max_new_tokens=8)
    assert not sizes.counts  # off
    sizes.on = True
    r = model.generate([1, 300, 301], drafter="probe", bc=10, max_new_tokens=8)
    assert sizes.counts == {10: r.stats.forward_calls - 1}  # prefill left out
    assert set(sizes.seconds) == {10} and sizes.seconds[10] > 0  # their time in the loop
    assert np.all(np.asarray(r.token_ids) < 512)


def test_merge_keeps_each_runs_entries_under_their_labels(bench, tmp_path):
    def part(name, device, keys, command):
        meta = dict(device=device, date="2026-11-25 18:4" + name[-1], torch="2", command=command,
                    transformers="5.17.0", edgemtp_commit="abc")
        path = tmp_path / f"{name}.json"
        full = entry(shape=dict(hidden=8, layers=1, heads=2, kv_heads=1, vocab=16, params=1e6),
                     prompts=2, new_tokens=4, cuda_graphs=True, elapsed_s={}, be={},
                     identical=dict(count=2, total=2, rows={"pld": {"10": [2, 2]}}), divergences=[],
                     be_measured={"pld": {"10": 2.0}}, tps={"plain": 300.0,
                                                            "pld": {"10": 510.0}})
        path.write_text(json.dumps(dict(meta=meta, entries={k: full for k in keys})))
        return str(path)

    a = part("a1", "H100", ["smollm2-135m/fp16", "qwen3-0.6b/fp16"], "run a")
    b = part("b2", "H100", ["smollm2-135m/fp16"], "run b")
    md = bench.merge([f"{a}=:smollm2-135m/fp16", f"{b}=no CUDA graphs"], tmp_path / "out",
                     ["a note"])
    summary = json.loads((tmp_path / "out" / "gpu_summary.json").read_text())
    assert list(summary["entries"]) == ["smollm2-135m/fp16", "smollm2-135m/fp16 (no CUDA graphs)"]
    meta = summary["meta"]
    assert (meta["command"], meta["date"], meta["transformers"]) == ("run a; run b",
                                                                      "2026-11-25 18:41", "5.17.0")
    assert "t(64)/t(1) <= 1.3 [smollm2-135m/fp16]" in {t["target"] for t in summary["targets"]}
    assert "- a note" in md.read_text() and md.name == "gpu_h100.md"
    other = part("c3", "A100", ["llama3.2-1b/fp16"], "run c")
    with pytest.raises(SystemExit, match="different devices"):
        bench.merge([a, other], tmp_path / "out2", [])
    with pytest.raises(SystemExit, match="has no entry qwen3-0.6b/fp16"):
        bench.merge([f"{b}=x:qwen3-0.6b/fp16"], tmp_path / "out3", [])
    with pytest.raises(SystemExit, match="is not a gpu_summary.json"):
        bench.merge([str(tmp_path / "missing.json")], tmp_path / "out4", [])


@pytest.mark.slow  # a bench script run in a subprocess (7-17 s here): CI only
def test_cli_runs_from_the_tree_without_an_install(tmp_path):
    """bench/edgemtp_tree.py: the command line on a bare machine (edgemtp not installed)."""
    run = subprocess.run([sys.executable, "-c", BARE, str(ROOT / "bench" / "edgemtp_tree.py"),
                          "doctor"], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "backends" in run.stdout and "torch        cpu       ok" in run.stdout


@pytest.mark.slow  # a bench script run in a subprocess (7-17 s here): CI only
def test_ort_gpu_bench_dry_runs_on_cpu_and_names_a_missing_provider(tmp_path):
    """bench/bench_ort_gpu.py end to end on the CPU EP (a tiny random model exported on the
    spot); the CUDA EP this onnxruntime lacks is a skipped row with the reason."""
    if torch_cuda_available():
        pytest.skip("this machine has a CUDA device")
    run = subprocess.run([sys.executable, "-c", BARE, str(ROOT / "bench" / "bench_ort_gpu.py"),
                          "--export", "tiny:fp32", "--devices", "cpu,cuda", "--drafters", "pld",
                          "--bc", "10", "--prompts", "2", "--new-tokens", "12", "--repeats", "2",
                          "--out", str(tmp_path)], capture_output=True, text=True, timeout=300,
                         cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    rows = json.loads((tmp_path / "ort_gpu.json").read_text())["rows"]
    cpu, cuda = rows
    assert cpu["device"] == "cpu" and list(cpu["t_ms"]) == ["1", "2", "4", "8", "16", "32", "64"]
    assert cpu["tps_plain"] > 0 and cpu["drafters"][0]["identical"] == [2, 2]
    assert "CUDAExecutionProvider" in cuda["skipped"]
    assert "## tiny-fp32 on cpu" in (tmp_path / "ort_gpu.md").read_text()


def torch_cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.slow  # a subprocess bench on the GGUF (~9 s of the default run): CI only
def test_step_host_bench_reads_the_chat_prompts_for_a_gguf(tmp_path):
    """A .gguf model reads SmolLM2's Spec-Bench chat prompts (the real weights' token ids);
    a --prompts-file that is not there is one line and exit 2, before any model loads."""
    sys.path.insert(0, str(ROOT / "bench"))
    import bench_step_host

    chat = bench_step_host.prompts(3, bench_step_host.CHAT_PROMPTS_FILE)
    assert len(chat) == 3 and max(max(p) for p in chat) >= 512  # beyond stories260K's vocab
    assert chat != bench_step_host.prompts(3)
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_step_host.py"),
                           str(tmp_path / "model.gguf"), "--prompts-file",
                           str(tmp_path / "nope.json")],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].endswith("nope.json: no such file")


@pytest.mark.slow  # a bench script run in a subprocess (7-17 s here): CI only
def test_step_host_bench_runs_on_cpu(tmp_path):
    """bench/bench_step_host.py (where a GPU step's time goes) runs from the tree on CPU: one
    row per configuration, the stages adding up to the step."""
    out = tmp_path / "steps.json"
    proc = subprocess.run([sys.executable, "-c", BARE, str(ROOT / "bench" / "bench_step_host.py"),
                           str(STORIES), "--backend", "torch", "--drafters", "none,probe",
                           "--bc", "10", "--prompts", "1", "--topk-curve", "4",
                           "--out", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = {r["config"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"none@1", "probe@10"}
    for r in rows.values():
        us = r["us"]
        parts = sum(us[k] for k in ("draft", "forward", "bind", "verify", "commit", "other"))
        assert us["forward"] > 0 and abs(parts - us["step"]) < 1.0
    assert rows["none@1"]["be"] == 1.0 and rows["probe@10"]["be"] >= 1.0
    assert "| probe@10 |" in proc.stdout
    for r in rows.values():  # the torch backend's step shapes and (GPU only) captures
        assert r["graphs"]["captures"] == 0 and r["graphs"]["shapes"] >= 0, r
    assert "CUDA graphs captured" in proc.stdout
    curves = json.loads(out.read_text())["topk_curves"]  # t(T) without and with a top-4
    assert set(curves) == {"0", "4", "4, 64 slices"}  # (the last: in two stages)
    for row in curves.values():
        assert list(row) == ["1", "2", "8", "16", "64"] and min(row.values()) > 0
    assert "without and with a top-4" in proc.stdout
    for r in rows.values():  # inside the backend's forward: the parts of `forward`
        i = r["inside_us"]
        assert i["wait"] == 0 and i["run"] > 0 and min(i.values()) >= 0, i
        assert i["load"] + i["run"] + i["read"] <= r["us"]["forward"] + 1.0, (i, r["us"])
    assert "Inside the torch backend's forward" in proc.stdout
