"""edgemtp profile and edgemtp bench, the QA report's defects (tools_report.md 2, 3, 6, 15):
stale rows of a replaced package, a cold baseline, budgets checked only after measuring, a
prompts file's line numbers. Real runs on the stories260K package, small."""

import json
import os
import shutil
import subprocess
import sys

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
STORIES = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "models", "stories260K")


def cli(*args):
    return subprocess.run([sys.executable, "-m", "edgemtp.cli", *args], capture_output=True,
                          text=True, env=ENV, timeout=600)


def one_line_error(proc, *parts):
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("edgemtp: error: "), \
        proc.stderr[-2000:]  # (a progress bar before it would mean something was measured)
    for part in parts:
        assert part in proc.stderr, (part, proc.stderr)


BENCH = ["bench", "--drafters", "probe", "--bc", "10", "--sets", "stories", "--per-set", "1",
         "--max-new-tokens", "8", "--repeats", "1", "--threads", "1", "--no-hf-reference"]


def test_bench_measures_a_package_exported_again_to_the_same_folder_anew(stories_pkg,
                                                                          tmp_path):
    from edgemtp.export.onnx_export import export_package

    pkg, out = tmp_path / "pkg", tmp_path / "out"
    shutil.copytree(stories_pkg, pkg)
    argv = [*BENCH, "--model", str(pkg), "--out", str(out)]
    result = out / "bench_pkg_onnxruntime.json"
    assert cli(*argv).returncode == 0
    assert json.loads(result.read_text())["reused_rows"] == 0
    # another model at the same path (export --force): an int8 package
    export_package(STORIES, pkg, dtype="int8", max_context=256, bc=(10,), mask_tokens=(1,),
                   force=True, progress=False)
    proc = cli(*argv)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(result.read_text())["reused_rows"] == 0 and "holds" not in proc.stderr
    # the same model again: its rows are reused (a bench resumed after Ctrl-C)
    proc = cli(*argv)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(result.read_text())["reused_rows"] == 2 and "holds 2 rows" in proc.stderr


def test_model_identity_changes_with_the_files_not_with_a_reread(stories_pkg, tmp_path):
    from edgemtp.tools.rowlog import model_identity

    pkg = tmp_path / "pkg"
    shutil.copytree(stories_pkg, pkg)
    first = model_identity(str(pkg))
    assert first and model_identity(str(pkg)) == first
    assert model_identity(STORIES) not in (None, first)  # a Hugging Face folder
    manifest = json.loads((pkg / "edgemtp.json").read_text())
    manifest["dtype"] = "fp16"  # (what a re-export rewrites)
    (pkg / "edgemtp.json").write_text(json.dumps(manifest))
    assert model_identity(str(pkg)) != first
    assert model_identity("someone/some-model") is None  # a hub id not in the cache


def test_model_identity_of_a_hub_id_is_its_cached_snapshot(tmp_path, monkeypatch):
    """``bench --model org/name`` keys its rows by the snapshot from_pretrained loads: a
    newer revision pulled into the cache is measured anew."""
    from huggingface_hub import constants

    from edgemtp.tools.rowlog import model_identity

    repo = tmp_path / "hub" / "models--someone--some-model"

    def snapshot(commit, config):
        (repo / "snapshots" / commit).mkdir(parents=True)
        (repo / "snapshots" / commit / "config.json").write_text(config)
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / "main").write_text(commit)

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    assert model_identity("someone/some-model") is None
    snapshot("a" * 40, '{"model_type": "llama"}')
    first = model_identity("someone/some-model")
    assert first and model_identity("someone/some-model") == first
    snapshot("b" * 40, '{"model_type": "llama", "vocab_size": 5}')
    assert model_identity("someone/some-model") not in (None, first)
    assert model_identity("someone/other-model") is None


def test_bench_refuses_a_bc_the_package_cannot_run_before_any_row(stories_pkg, tmp_path):
    # the package (plans 10/30/60) exports top-31: probing at BC 100 asks for 50
    out = tmp_path / "out"
    proc = cli("bench", "--model", str(stories_pkg), "--drafters", "pld,probe", "--bc",
               "10,100", "--sets", "stories", "--per-set", "1", "--max-new-tokens", "8",
               "--repeats", "1", "--threads", "1", "--no-hf-reference", "--out", str(out))
    one_line_error(proc, "--bc 100", "probe", "top-50", "top-31", "use --bc 63 or less")
    assert not out.exists()  # no row ran, and the --out folder it made is gone again


def test_profile_checks_the_budget_against_the_package_before_measuring(stories_pkg,
                                                                         tmp_path):
    out = tmp_path / "runs" / "profile"
    proc = cli("profile", str(stories_pkg), "--budget", "90", "--prompts", "1",
               "--max-new-tokens", "8", "--repeats", "1", "--threads", "1", "--out",
               str(out))
    one_line_error(proc, "--budget 90", "probe k=1 BC=90", "top-45", "top-31",
                   "use --budget 89 or less")
    assert "--bc 9" not in proc.stderr.replace("--bc 90", "")  # (profile has no --bc)
    assert not (tmp_path / "runs").exists()  # both folders it made are gone again
    out.mkdir(parents=True)  # a folder that was there stays
    proc = cli("profile", str(stories_pkg), "--budget", "90", "--out", str(out))
    assert proc.returncode == 2 and out.is_dir() and not list(out.iterdir())


def _trace(monkeypatch, module, model):
    """Every generation on ``model``, in order: ("gen", drafter, bc, the model's latency
    curve measured yet) and ("timed", drafter, bc) where ``module``'s timed measure starts."""
    events = []
    generate = model.generate

    def traced_generate(prompt, config=None, **kw):
        events.append(("gen", config.drafter, 1 if config.drafter == "none" else config.bc,
                       any(isinstance(k, tuple) and k[:1] == ("latency",) for k in model.memory)))
        return generate(prompt, config, **kw)

    measure = module.measure

    def traced_measure(m, prompts, config, bar, repeats):
        events.append(("timed", config.drafter, 1 if config.drafter == "none" else config.bc))
        return measure(m, prompts, config, bar, repeats)

    model.generate = traced_generate
    monkeypatch.setattr(module, "measure", traced_measure)
    return events


def test_bench_warms_every_method_up_before_timing_any(stories_pkg, tmp_path, monkeypatch):
    from edgemtp import GenerationConfig, Model
    from edgemtp.tools import benchmark
    from edgemtp.tools.prompts import story_prompts
    from edgemtp.tools.rowlog import RowLog

    model = Model.load(str(stories_pkg), threads=1)
    events = _trace(monkeypatch, benchmark, model)
    greedy = GenerationConfig(drafter="none", max_new_tokens=8)
    prompts = story_prompts(1)
    result = benchmark.run_bench(model, {"stories": prompts}, greedy,
                                 benchmark.methods(["probe", "auto"], [10], greedy),
                                 RowLog(tmp_path / "rows.jsonl", {}), hf_reference=False)
    assert result["failures"] == []
    first = next(i for i, e in enumerate(events) if e[0] == "timed")
    warm = events[:first]
    # one untimed generation per method, none on a scored prompt; auto's curve is measured
    # there, so no timed generation measures it
    assert [e[1:3] for e in warm] == [("none", 1), ("probe", 10), ("auto", 10)]
    assert all(e[3] for e in events[first:] if e[0] == "gen")
    assert len(events) - first == 3 * (1 + len(prompts))


def test_profile_warms_every_plan_up_before_timing_any(stories_pkg, monkeypatch):
    from edgemtp import Model
    from edgemtp.tools import profile
    from edgemtp.tools.prompts import story_prompts

    model = Model.load(str(stories_pkg), threads=1)
    events = _trace(monkeypatch, profile, model)
    data = profile.run_profile(model, 4, story_prompts(1), 8, repeats=1)
    first = next(i for i, e in enumerate(events) if e[0] == "timed")
    plans = [(p["options"]["drafter"], p["options"].get("bc", 1)) for p in data["plans"]]
    assert [e[1:3] for e in events[:first]] == plans  # each plan once, untimed, first
    assert sum(e[0] == "timed" for e in events) == len(plans)


def test_profile_at_a_small_budget_recommends_no_plan_that_drafted_nothing(stories_pkg,
                                                                            tmp_path):
    from edgemtp.tools.profile import MIN_BE, recommend

    proc = cli("profile", str(stories_pkg), "--budget", "2", "--prompts", "1",
               "--max-new-tokens", "8", "--repeats", "1", "--threads", "1", "--out",
               str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads((tmp_path / "profile.json").read_text())
    rec = data["recommendation"]
    chosen = next(p for p in data["plans"] if p["options"]["drafter"] == rec["drafter"]
                  and p["options"].get("bc", 1) == rec["bc"])
    assert rec["drafter"] == "none" or chosen["block_efficiency"] >= MIN_BE, data["plans"]
    # a plan that accepted nothing is never recommended, however its timing came out
    rows = [dict(p, block_efficiency=1.0,
                 tokens_per_second=1.0 if p["options"]["drafter"] == "none" else 1e9)
            for p in data["plans"]]
    assert recommend(rows) == {"drafter": "none", "bc": 1, "mask_tokens": 1}


def test_profile_refuses_a_budget_of_one_in_one_line(stories_pkg, tmp_path):
    proc = cli("profile", str(stories_pkg), "--budget", "1", "--out", str(tmp_path / "out"))
    one_line_error(proc, "--budget 1", "--budget 2 or more")
    assert not (tmp_path / "out").exists()


def test_a_prompts_file_names_the_line_that_is_not_json(stories_pkg, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "Once upon a time"}\n\n{"prompt": oops}\n')
    proc = cli("profile", str(stories_pkg), "--prompts-file", str(prompts), "--out",
               str(tmp_path / "out"))
    one_line_error(proc, repr(str(prompts)), "line 3 is not JSON")
    assert "line 1 column" not in proc.stderr
