"""edgemtp profile and edgemtp bench, through the real CLI in subprocesses."""

import json
import os
import subprocess
import sys

import pytest

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def cli(*args, check=True):
    proc = subprocess.run([sys.executable, "-m", "edgemtp.cli", *args], capture_output=True,
                          text=True, env=ENV, timeout=600)
    if check:
        assert proc.returncode == 0, proc.stderr[-2000:]
    return proc


@pytest.fixture(scope="module")
def profile_file(stories_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("profile")
    proc = cli("profile", stories_path, "--budget", "10", "--prompts", "2", "--max-new-tokens",
               "24", "--repeats", "1", "--threads", "1", "--out", str(out))
    assert "recommended:" in proc.stdout
    return out / "profile.json"


def test_profile_writes_curve_plans_recommendation_and_plot(profile_file):
    data = json.loads(profile_file.read_text())
    lat = data["latency"]
    assert lat["block_sizes"][0] == 1 and lat["block_sizes"][-1] == 10
    assert all(b >= a > 0 for a, b in zip(lat["seconds"], lat["seconds"][1:]))
    plans = {p["plan"]: p for p in data["plans"]}
    assert plans["none"]["block_efficiency"] == 1.0
    assert plans["probe k=1 BC=10"]["block_efficiency"] > 1.0
    assert all(p["lossless"] for p in data["plans"])
    assert all(p["options"].get("bc", 1) <= 10 for p in data["plans"])  # under the budget
    best = max(data["plans"], key=lambda p: p["tokens_per_second"])
    assert data["recommendation"]["drafter"] == best["options"]["drafter"]
    assert data["peak_memory_mib"] > 0
    assert (profile_file.parent / "profile.png").stat().st_size > 1000


def test_generate_takes_the_profile_and_flags_still_win(stories_path, profile_file):
    rec = json.loads(profile_file.read_text())["recommendation"]
    base = ["generate", "--model", stories_path, "--prompt", "Once upon a time", "--json",
            "--max-new-tokens", "16", "--threads", "1", "--profile", str(profile_file)]
    out = json.loads(cli(*base).stdout)
    assert out["bc"] == (rec["bc"] if rec["drafter"] != "none" else 1)
    forced = json.loads(cli(*base, "--drafter", "probe", "--bc", "8").stdout)
    assert forced["bc"] == 8 and forced["token_ids"] == out["token_ids"]


def test_bad_profile_file_is_one_line(stories_path, tmp_path):
    bad = tmp_path / "p.json"
    bad.write_text('{"format_version": 99}')
    proc = cli("generate", "--model", stories_path, "--prompt", "x", "--profile", str(bad),
               check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "not an edgemtp profile" in proc.stderr.strip().splitlines()[-1]


def test_bench_runs_drafters_checks_outputs_and_plots(stories_path, tmp_path):
    proc = cli("bench", "--model", stories_path, "--drafters", "probe,auto", "--bc", "10,30",
               "--sets", "stories", "--per-set", "3", "--max-new-tokens", "24", "--threads", "1",
               "--out", str(tmp_path))
    data = json.loads((tmp_path / "bench_stories260K_torch.json").read_text())
    assert data["failures"] == []
    methods = {(r["method"], r["bc"]) for r in data["rows"]}
    assert {("greedy", 1), ("probe", 10), ("probe", 30), ("auto", 10), ("auto", 30),
            ("transformers prompt lookup", 11)} <= methods
    assert all(r["lossless"] for r in data["rows"])
    assert "| probe | 30 |" in proc.stdout
    for png in ("bench_stories260K_torch_be.png", "bench_stories260K_torch_tps.png"):
        assert (tmp_path / png).stat().st_size > 1000


def test_bench_rejects_unknown_drafter(stories_path, tmp_path):
    proc = cli("bench", "--model", stories_path, "--drafters", "probe,magic", "--out",
               str(tmp_path), check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "magic" in proc.stderr.strip().splitlines()[-1]
