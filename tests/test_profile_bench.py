"""edgemtp profile and edgemtp bench (``edgemtp.tools``), through the real CLI in subprocesses:
what they write, how bad input ends, and a bench resumed after Ctrl-C."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def cli(*args, check=True):
    proc = subprocess.run([sys.executable, "-m", "edgemtp.cli", *args], capture_output=True,
                          text=True, env=ENV, timeout=600)
    if check:
        assert proc.returncode == 0, proc.stderr[-2000:]
    return proc


def cli_together(*argvs):
    """Several CLI runs started at once (each loads torch and the model: seconds apiece on a
    small CPU), their results in order; each must exit 0."""
    procs = [subprocess.Popen([sys.executable, "-m", "edgemtp.cli", *a], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=ENV) for a in argvs]
    outs = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=600)
        assert p.returncode == 0, stderr[-2000:]
        outs.append(stdout)
    return outs


def key(options: dict) -> tuple:
    return (options["drafter"], options.get("bc", 1), options.get("mask_tokens", 1),
            options.get("tree_cost", "budget"))


@pytest.fixture(scope="module")
def profiled(stories_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("profile")
    proc = cli("profile", stories_path, "--budget", "10", "--prompts", "2", "--max-new-tokens",
               "24", "--repeats", "1", "--threads", "1", "--out", str(out))
    return out / "profile.json", proc.stdout


def test_profile_writes_curve_plans_and_plot(profiled):
    path, _ = profiled
    data = json.loads(path.read_text())
    lat = data["latency"]
    assert lat["block_sizes"][0] == 1 and lat["block_sizes"][-1] == 10
    assert all(b >= a > 0 for a, b in zip(lat["seconds"], lat["seconds"][1:]))
    # and over a longer cache (auto reads t(T) at the cache's length off both), read back
    # as generate --profile reads it
    assert lat["context"] == 64 and lat["long"]["context"] > 256
    assert lat["long"]["block_sizes"] == lat["block_sizes"]
    from tools.profile import read_profile
    assert read_profile(str(path))[1].long.context == lat["long"]["context"]
    plans = {p["plan"]: p for p in data["plans"]}
    assert plans["none"]["block_efficiency"] == 1.0
    assert plans["probe k=1 BC=10"]["block_efficiency"] > 1.0
    assert all(p["lossless"] for p in data["plans"])
    assert all(p["options"].get("bc", 1) <= 10 for p in data["plans"])  # under the budget
    assert data["peak_memory_mib"] > 0
    assert (path.parent / "profile.png").stat().st_size > 1000
    # predicted tokens/s (BE / t(T)) only where every step runs one block of T rows
    for p in data["plans"]:
        fixed = p["options"]["drafter"] in ("none", "probe")
        assert (p["predicted_tokens_per_second"] is not None) == fixed, p
    assert "predicted: BE / t(T), where every step runs one block" in profiled[1]
    assert re.search(r"^auto BC<=10 .* - ", profiled[1], re.M), profiled[1]


def test_profile_plot_keeps_budget_and_measured_trees_apart(profiled):
    from tools.profile import plot_series

    data = json.loads(profiled[0].read_text())
    series = {label: xs for label, _, xs, _ in plot_series(data)}
    assert {"stand", "stand measured", "hybrid k=1", "hybrid k=1 measured", "auto"} <= set(series)
    for label, xs in series.items():  # one point per BC: no zig-zag between variants
        assert xs == sorted(set(xs)), (label, xs)
    assert sum(len(xs) for xs in series.values()) == len(data["plans"]) - 1  # all but none


def test_profile_recommends_the_fastest_measured_plan(profiled):
    path, stdout = profiled
    data = json.loads(path.read_text())
    rec = data["recommendation"]
    from tools.profile import MIN_BE  # a plan that drafted next to nothing is never chosen
    fastest = max(p["tokens_per_second"] for p in data["plans"]
                  if p["options"]["drafter"] == "none" or p["block_efficiency"] >= MIN_BE)
    chosen = [p for p in data["plans"] if key(p["options"]) == key(rec)]
    assert chosen and chosen[0]["tokens_per_second"] == fastest, (rec, data["plans"])
    shown = re.search(r"recommended: --drafter (\S+) --bc (\d+)(?: --mask-tokens (\d+))?",
                      stdout)
    # --mask-tokens where the drafter probes (none, pld, stand, lade and auto take none)
    from edgemtp import drafters

    masks = str(rec["mask_tokens"]) if drafters.get(rec["drafter"]).uses_masks else None
    assert shown.groups() == (rec["drafter"], str(rec["bc"]), masks)
    # the tree drafters were profiled with measured trees too
    assert {"stand BC=10 measured", "hybrid k=1 BC=10 measured"} <= {
        p["plan"] for p in data["plans"]}
    assert ("--tree-cost measured" in stdout) == (rec.get("tree_cost") == "measured")


@pytest.mark.slow  # ~20 s; the fixed profile of the next test covers flags over a profile
def test_generate_takes_the_profile_and_flags_still_win(stories_path, profiled):
    path, _ = profiled
    rec = json.loads(path.read_text())["recommendation"]
    base = ["generate", "--model", stories_path, "--prompt", "Once upon a time", "--json",
            "--max-new-tokens", "16", "--threads", "1", "--profile", str(path)]
    out = json.loads(cli(*base).stdout)
    assert out["bc"] == rec["bc"]
    forced = json.loads(cli(*base, "--drafter", "probe", "--bc", "8").stdout)
    assert forced["bc"] == 8 and forced["token_ids"] == out["token_ids"]


def test_a_profile_of_another_model_or_backend_is_said(stories_path, stories_pkg, profiled,
                                                        capsys, tmp_path):
    """qa8b D3: a stories260K profile drove SmolLM2 int4 on the native backend without a
    word (profile.json did not say which model it was measured on)."""
    from edgemtp import Model, cli
    from edgemtp.tools.profile import mismatch

    path, _ = profiled
    was = json.loads(path.read_text())
    assert was["model"] == {"name": "stories260K", "backend": "torch", "graph_bytes": None}
    assert mismatch(str(path), Model.load(stories_path, threads=1)) is None  # its own
    rc = cli.main(["generate", "--model", str(stories_pkg), "--prompt", "Once", "--threads",
                   "1", "--max-new-tokens", "4", "--profile", str(path)])
    err = capsys.readouterr().err
    assert rc == 0 and (f"edgemtp: warning: profile {str(path)!r} was measured on "
                        f"'stories260K' on torch; this is {stories_pkg.name!r} on onnxruntime: "
                        f"its drafter, budget and latency curve fit that one") in err, err
    moved = tmp_path / "elsewhere.json"  # the same model, measured on another machine
    moved.write_text(json.dumps({**was, "host": "another|x86_64|cpu|64"}))
    assert "was measured on another machine" in mismatch(
        str(moved), Model.load(stories_path, threads=1))


def test_generate_takes_a_measured_tree_cost_from_the_profile(stories_pkg, tmp_path):
    # on the exported package: onnxruntime starts in ~1 s where PyTorch and transformers
    # take ~9 s to import, three times over on 2 cores
    prof = tmp_path / "p.json"
    prof.write_text(json.dumps({"format_version": 1, "latency": LATENCY, "recommendation": {
        "drafter": "hybrid", "bc": 10, "mask_tokens": 1, "tree_cost": "measured"}}))
    base = ["generate", "--model", str(stories_pkg), "--prompt", "Once upon a time", "--json",
            "--max-new-tokens", "16", "--threads", "1", "--profile", str(prof)]
    out, forced, other = map(json.loads, cli_together(
        base, [*base, "--tree-cost", "budget"], [*base, "--drafter", "probe", "--bc", "8"]))
    assert (out["drafter"], out["bc"], out["tree_cost"]) == ("hybrid", 10, "measured")
    assert forced["tree_cost"] == "budget" and forced["token_ids"] == out["token_ids"]
    # another drafter on the command line: the hybrid's measured tree cost does not follow
    # it (probing has no trees; it was a usage error once a profile recommended a hybrid)
    assert (other["drafter"], other["bc"], other["tree_cost"]) == ("probe", 8, "budget")
    assert other["token_ids"] == out["token_ids"]


LATENCY = {"block_sizes": [1, 10], "seconds": [0.001, 0.002]}
REC = {"drafter": "probe", "bc": 10, "mask_tokens": 1}
BAD_PROFILES = [  # (id, file content, regexes the one stderr line must match)
    ("other-format", {"format_version": 99}, [r"not an edgemtp profile"]),
    ("no-recommendation", {"format_version": 1, "latency": LATENCY}, [r"no recommendation"]),
    ("bc-not-an-integer", {"recommendation": {**REC, "bc": "abc"}}, [r"\bbc\b", r"'abc'"]),
    ("bc-true", {"recommendation": {**REC, "bc": True}}, [r"\bbc\b", r"True"]),
    ("k-not-an-integer", {"recommendation": {**REC, "mask_tokens": 1.5}},
     [r"mask_tokens", r"1\.5"]),
    ("unknown-drafter", {"recommendation": {**REC, "drafter": "magic"}}, [r"drafter", r"magic"]),
    ("bad-latency-curve", {"recommendation": REC, "latency": [1, 2]}, [r"latency curve"]),
    ("tree-cost-for-probe", {"recommendation": {**REC, "tree_cost": "measured"}},
     [r"tree_cost", r"hybrid"]),
    ("latency-context-not-an-integer", {"recommendation": REC,
                                        "latency": {**LATENCY, "context": "x"}},
     [r"context must be an integer", r"'x'"]),
    ("long-curve-over-fewer-rows", {"recommendation": REC, "latency": {
        **LATENCY, "context": 512, "long": LATENCY}}, [r"long curve", r"512", r"got 64"]),
    ("long-curve-not-a-curve", {"recommendation": REC, "latency": {**LATENCY, "long": 5}},
     [r"'long' must be a curve"]),
]


@pytest.mark.parametrize("content,patterns", [c[1:] for c in BAD_PROFILES],
                         ids=[c[0] for c in BAD_PROFILES])
def test_bad_profile_file_is_one_line(stories_path, tmp_path, content, patterns):
    bad = tmp_path / "p.json"
    bad.write_text(json.dumps({"format_version": 1, "latency": LATENCY, **content}))
    proc = cli("generate", "--model", stories_path, "--prompt", "x", "--profile", str(bad),
               check=False)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("edgemtp: error: ") and repr(str(bad)) in proc.stderr
    for pattern in patterns:
        assert re.search(pattern, proc.stderr), (pattern, proc.stderr)


BAD_TOOL_INPUTS = [  # (id, argv with {model}, regexes the one stderr line must match)
    ("bench-bc-0", ["bench", "--model", "{model}", "--bc", "0"], [r"--bc", r"\b0\b"]),
    ("bench-drafters-comma", ["bench", "--model", "{model}", "--drafters", ","],
     [r"--drafters", r"probe"]),
    ("bench-unknown-drafter", ["bench", "--model", "{model}", "--drafters", "probe,magic"],
     [r"--drafters", r"magic"]),
    ("bench-no-drafter-fits", ["bench", "--model", "{model}", "--drafters", "probe", "--bc", "1"],
     [r"no drafter can run", r"probe at BC 1"]),
    ("bench-repeats-0", ["bench", "--model", "{model}", "--repeats", "0"], [r"--repeats"]),
    ("bench-tree-cost-typo", ["bench", "--model", "{model}", "--tree-cost", "budget,measure"],
     [r"--tree-cost", r"measured", r"budget,measure"]),
    ("profile-budget-huge", ["profile", "{model}", "--budget", "100000"],
     [r"--budget", r"100000", r"1024"]),
    ("profile-budget-0", ["profile", "{model}", "--budget", "0"], [r"--budget", r"\b0\b"]),
    ("profile-prompts-0", ["profile", "{model}", "--prompts", "0"], [r"--prompts", r"\b0\b"]),
    ("profile-repeats-0", ["profile", "{model}", "--repeats", "0"], [r"--repeats", r"\b0\b"]),
]


def test_an_out_that_cannot_be_a_folder_is_one_line_before_measuring(stories_pkg, tmp_path):
    afile = tmp_path / "results.txt"
    afile.write_text("keep me")
    for argv in (["profile", str(stories_pkg)], ["bench", "--model", str(stories_pkg)]):
        for out, pattern in ((afile, r"is a file; expected a folder"),
                             (afile / "sub", r"cannot make the folder")):
            proc = cli(*argv, "--out", str(out), check=False)
            assert proc.returncode == 2, proc.stderr[-2000:]
            assert proc.stderr.count("\n") == 1 and re.search(pattern, proc.stderr), proc.stderr
    assert afile.read_text() == "keep me"


@pytest.mark.parametrize("argv,patterns", [c[1:] for c in BAD_TOOL_INPUTS],
                         ids=[c[0] for c in BAD_TOOL_INPUTS])
def test_bad_tool_input_is_one_line_and_writes_nothing(stories_path, tmp_path, argv, patterns):
    out = tmp_path / "out"
    proc = cli(*[a.format(model=stories_path) for a in argv], "--out", str(out), check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("edgemtp: error: "), \
        proc.stderr[-2000:]
    for pattern in patterns:
        assert re.search(pattern, proc.stderr), (pattern, proc.stderr)
    assert not out.exists()


# rows long enough (~0.5 s each on a quiet machine) that the interrupt below lands mid-run
# even when the test process is starved for a while (the slow pass under load once missed it)
BENCH = ["bench", "--drafters", "probe,pld,auto", "--bc", "10,30", "--sets", "stories",
         "--per-set", "4", "--max-new-tokens", "64", "--repeats", "1", "--threads", "1",
         "--no-hf-reference"]  # the reference has its own test below


@pytest.mark.slow
def test_bench_resumes_after_ctrl_c_without_measuring_kept_rows_again(stories_path, tmp_path):
    argv = [sys.executable, "-m", "edgemtp.cli", *BENCH, "--model", stories_path,
            "--out", str(tmp_path)]
    log = tmp_path / "bench_stories260K_torch.rows.jsonl"
    # a pytest-xdist worker ignores SIGINT, and a child inherits ignored signals (Python then
    # installs no KeyboardInterrupt handler): give the bench the default disposition back
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=ENV, preexec_fn=lambda: signal.signal(signal.SIGINT,
                                                                      signal.SIG_DFL))
    deadline = time.monotonic() + 300
    while proc.poll() is None and time.monotonic() < deadline and not (
            log.is_file() and log.read_text().count("\n") >= 2):
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    kept = log.read_text().splitlines()
    assert "Traceback" not in err and 2 <= len(kept) < 7
    assert err.splitlines()[-1].startswith(f"edgemtp: interrupted; {len(kept)} measured rows "
                                           f"are kept in {log}")
    assert sorted(p.name for p in tmp_path.iterdir()) == [log.name]  # no partial results

    proc = cli(*BENCH, "--model", stories_path, "--out", str(tmp_path))
    lines = log.read_text().splitlines()
    assert lines[:len(kept)] == kept  # the kept rows were not measured again ...
    keys = [json.loads(line)["key"] for line in lines]
    assert len(keys) == len(set(keys)) == 7  # ... and nothing was measured twice
    data = json.loads((tmp_path / "bench_stories260K_torch.json").read_text())
    assert data["reused_rows"] == len(kept) and f"holds {len(kept)} rows" in proc.stderr
    measured = {(r["method"], r["bc"]): r for r in data["rows"]}
    for line in map(json.loads, kept):  # the table shows the kept measurements
        assert measured[line["method"], line["bc"]]["tokens_per_second"] == \
            line["record"]["summary"]["tokens_per_second"]
    assert set(measured) == {("greedy", 1), ("probe", 10), ("probe", 30), ("pld", 10),
                             ("pld", 30), ("auto", 10), ("auto", 30)}
    assert data["failures"] == [] and all(r["lossless"] for r in data["rows"])
    assert "| probe | 30 |" in proc.stdout and "| auto | 10 |" in proc.stdout
    # which run it was: the device, dtype (a folder run as it is: none) and threads
    assert (data["device"], data["dtype"], data["threads"]) == ("cpu", None, 1)
    assert "# edgemtp bench: stories260K on torch, cpu\n" in proc.stdout
    assert "backend torch, 1 thread," in proc.stdout
    for png in ("bench_stories260K_torch_be.png", "bench_stories260K_torch_tps.png"):
        assert (tmp_path / png).stat().st_size > 1000


def test_bench_reference_runs_transformers_on_the_backends_source(stories_path, tmp_path):
    from edgemtp import GenerationConfig, Model
    from edgemtp.tools.benchmark import methods, reference_source, run_bench
    from edgemtp.tools.prompts import story_prompts
    from edgemtp.tools.rowlog import RowLog

    model = Model.load(stories_path, backend="torch", threads=1)
    model.backend.source = None  # a backend that cannot name its Hugging Face folder
    assert reference_source(model) is None
    model.backend.source = stories_path
    greedy = GenerationConfig(drafter="none", max_new_tokens=16)
    result = run_bench(model, {"stories": story_prompts(2)}, greedy,
                       methods(["pld"], [11], greedy), RowLog(tmp_path / "rows.jsonl", {}))
    ref = next(r for r in result["rows"] if r["method"] == "transformers prompt lookup")
    assert ref["bc"] == 11 and ref["lossless"] and ref["tokens"] == 32
    assert result["reference_source"] == stories_path and result["failures"] == []


def test_bench_runs_tree_drafters_once_per_tree_cost():
    # hybrid and stand (and auto) take tree_cost: one row per cost, the measured one named
    # apart (its own row-log key); pld takes none and runs once
    from edgemtp import GenerationConfig
    from edgemtp.tools.benchmark import methods

    greedy = GenerationConfig(drafter="none", max_new_tokens=16)
    plan = methods(["hybrid", "pld", "stand"], [10], greedy, ("budget", "measured"))
    got = {(m, c.tree_cost) for m, _, c in plan}
    assert got == {("hybrid", "budget"), ("hybrid measured", "measured"), ("pld", "budget"),
                   ("stand", "budget"), ("stand measured", "measured")}
    assert [m for m, _, _ in methods(["hybrid"], [10], greedy)] == ["hybrid"]


def test_row_log_reuses_rows_of_the_same_settings_only(tmp_path):
    from edgemtp.tools.rowlog import RowLog

    path, prompts = tmp_path / "rows.jsonl", ["Once upon a time"]
    log = RowLog(path, {"repeats": 1})
    log.add("stories", "probe", 10, prompts, {"tps": 1.0})
    log.close()
    with open(path, "a") as f:
        f.write('{"settings": {"repeats": 1}, "key": "cut sh')  # a killed run's last line
    assert RowLog(path, {"repeats": 1}).get("stories", "probe", 10, prompts) == {"tps": 1.0}
    assert RowLog(path, {"repeats": 1}).get("stories", "probe", 10, ["other"]) is None
    assert RowLog(path, {"repeats": 3}).kept == 0
    fresh = RowLog(path, {"repeats": 1}, fresh=True)
    assert fresh.kept == 0 and path.read_text().count("\n") == 1  # untouched until a new row
    fresh.add("stories", "pld", 11, prompts, {"tps": 2.0})
    fresh.close()
    assert RowLog(path, {"repeats": 1}).records.keys() == fresh.records.keys()
    assert path.read_text().count("\n") == 1


@pytest.mark.slow  # (~11 s of the default run; the demo's early refusals stay in it; CI runs it)
def test_demo_exports_then_runs_every_method_losslessly(stories_path, tmp_path):
    # the main job (./run.sh), small: export to a package, then greedy and every method on
    # onnxruntime, checked token for token against greedy and transformers generate
    proc = cli("demo", "--model", stories_path, "--prompts", "1", "--max-new-tokens", "16",
               "--threads", "1", "--out", str(tmp_path))
    assert (tmp_path / "stories260K" / "edgemtp.json").is_file()
    rows = [ln for ln in proc.stdout.splitlines() if re.search(r"\d+\.\d\dx\s+(yes|NO)$", ln)]
    assert len(rows) >= 10, proc.stdout  # greedy, 8 methods, transformers generate
    assert all(ln.endswith("yes") for ln in rows), proc.stdout
    assert "onnxruntime greedy runs at" in proc.stdout
    assert "each prompt's the median of 2 timed runs" in proc.stdout  # --rounds 2, the default


@pytest.mark.slow
def test_the_default_main_job_chats_with_smollm2_int4(tmp_path):
    # ./run.sh with no arguments: the shared SmolLM2 GGUF exported to an int4 package, chat
    # questions, greedy and the CPU drafters, every output equal to the package's greedy
    from conftest import smollm2_dir

    if not (smollm2_dir() / "SmolLM2-135M-Instruct.Q4_1.gguf").is_file():  # (never fetched here)
        pytest.skip("no SmolLM2 GGUF (../shared or the main job's fetched copy)")
    proc = cli("demo", "--prompts", "1", "--max-new-tokens", "24", "--threads", "2",
               "--out", str(tmp_path))
    manifest = json.loads((tmp_path / "SmolLM2-135M-Instruct-GGUF-int4" / "edgemtp.json")
                          .read_text())
    assert manifest["weights"]["format"] == "int4"
    rows = [ln for ln in proc.stdout.splitlines() if re.search(r"\d+\.\d\dx\s+(yes|NO)$", ln)]
    assert [r.split()[0] for r in rows] == ["greedy", "probe", "prompt", "hybrid", "hybrid",
                                            "auto"]
    assert all(ln.endswith("yes") for ln in rows), proc.stdout
    assert "transformers" not in proc.stdout.split("method")[1], proc.stdout


def test_the_main_jobs_cached_package_is_exported_again_after_the_export_code_changed(
        stories_path, tmp_path):
    # ./run.sh keeps its chat package between runs: while this export code wrote it (the
    # manifest's exporter digest) it is current, and once other code wrote it, not
    from edgemtp.export.onnx_export import export_package
    from tools.demo import _current

    pkg = tmp_path / "stories-int4"
    export_package(stories_path, pkg, dtype="int4", max_context=256, progress=False)
    assert _current(str(pkg), "int4") and not _current(str(pkg), "int8")
    manifest = pkg / "edgemtp.json"
    data = json.loads(manifest.read_text())
    data["exporter"] = "0" * 16
    manifest.write_text(json.dumps(data))
    assert not _current(str(pkg), "int4")
    assert not _current(str(tmp_path / "none"), "int4")


@pytest.mark.parametrize("flags, said", [
    (["--model", "/nonexistent/model"], "model folder '/nonexistent/model' does not exist"),
    (["--model", "{tmp}"], "has no config.json; expected a Hugging Face model folder"),
    (["--model", "{stories}", "--chat"], "has no chat template"),
    (["--model", "{stories}", "--device", "cuda"], "device 'cuda' needs onnxruntime's "
                                                   "CUDAExecutionProvider"),
    (["--model", "{stories}", "--backend", "torch", "--device", "cuda"],
     "this PyTorch build sees no CUDA device")])
def test_demo_refuses_before_the_reference_run_and_the_export(stories_path, tmp_path, capsys,
                                                             flags, said):
    """qa9 D1, D2: a bad --model printed a traceback from the transformers reference run
    (exit 1); --device cuda and --chat failed only after the reference run and an export,
    which left a package behind for a run that could never start."""
    import torch

    from edgemtp import cli

    import onnxruntime

    if "cuda" in flags and (torch.cuda.is_available() or "CUDAExecutionProvider"
                            in onnxruntime.get_available_providers()):
        pytest.skip("CUDA is here")
    out = tmp_path / "out"
    argv = [f.format(tmp=tmp_path, stories=stories_path) for f in flags]
    rc = cli.main(["demo", *argv, "--prompts", "1", "--max-new-tokens", "4", "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and said in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists()


def test_demo_with_no_rounds_is_one_line(stories_pkg):
    proc = subprocess.run([sys.executable, "-m", "edgemtp.cli", "demo", "--model",
                           str(stories_pkg), "--rounds", "0"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].endswith("--rounds must be an integer >= 1, got 0")
    assert "Traceback" not in proc.stderr, proc.stderr


def test_demo_chat_on_a_model_without_a_template_is_one_line(stories_pkg):
    # --chat puts Spec-Bench questions under the model's chat template; stories260K has none
    proc = subprocess.run([sys.executable, "-m", "edgemtp.cli", "demo", "--chat", "--model",
                           str(stories_pkg), "--prompts", "1", "--max-new-tokens", "4"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert "chat template" in lines[-1] and "Traceback" not in proc.stderr, proc.stderr


def test_the_be_plot_legend_covers_no_bar(tmp_path, monkeypatch):
    # the tallest bars used to sit under the legend (upper right, in the bars' own range)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from edgemtp.tools.benchmark import plots

    figs = []
    monkeypatch.setattr(plt, "close", lambda fig=None: figs.append(fig))
    tasks = ["stories", "writing", "roleplay", "reasoning", "math", "coding", "stem",
             "humanities", "translation", "qa", "math_reasoning"]
    methods_ = ["probe", "pld", "stand", "lade", "hybrid", "auto"]
    rows = [{"task": t, "method": "greedy", "bc": 1, "block_efficiency": 1.0,
             "tokens_per_second": 10.0} for t in tasks]
    for i, t in enumerate(tasks):
        for j, m in enumerate(methods_):
            for bc in (10, 30, 60):  # every task's hybrid at 60 near the tallest
                rows.append({"task": t, "method": m, "bc": bc, "tokens_per_second": 12.0,
                             "block_efficiency": (1.1 + 0.2 * j + 0.3 * bc / 60
                                                  + 0.05 * (i % 3))})
    plots({"rows": rows, "backend": "onnxruntime"}, tmp_path, "t")
    fig = figs[0]
    ax = fig.axes[0]
    fig.canvas.draw()
    legend = ax.get_legend().get_window_extent()
    bars = [p for p in ax.patches if p.get_height() > 0]
    assert len(bars) == len(tasks) * len(methods_) * 3
    assert not [b for b in bars if legend.overlaps(b.get_window_extent())]


def test_the_demo_says_when_it_falls_back_to_built_in_prompts(tmp_path, monkeypatch, capsys):
    """qa10c D5: without ../shared/data the main job chatted on built-in questions (and
    ``demo`` ran 2 story prompts for ``--prompts 4``) without a word, so its figures read as
    the README's."""
    from edgemtp.tools import demo, prompts

    monkeypatch.setattr(prompts, "SPEC_BENCH", tmp_path / "question.jsonl")
    assert demo._questions(4) == demo.FALLBACK_QUESTIONS[:4]
    err = capsys.readouterr().err
    assert err.startswith("demo: no Spec-Bench questions at ") and "4 built-in ones" in err
    assert len(set(demo.FALLBACK_PROMPTS)) >= 4  # demo's --prompts default
    if prompts.SHARED.is_dir():  # the real questions where ../shared has them: no note
        monkeypatch.undo()
        assert demo._questions(4) != demo.FALLBACK_QUESTIONS[:4]
        assert capsys.readouterr().err == ""
