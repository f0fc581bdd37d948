"""bench/bench_context.py, run as a user runs it, on the stories260K package."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_paired_ratios_come_out_beside_the_medians(stories_pkg, tmp_path):
    cmd = [sys.executable, str(ROOT / "bench" / "bench_context.py"), "--package",
           f"n={stories_pkg}", "--contexts", "16,160", "--sizes", "1,4", "--rounds", "2",
           "--repeats", "2", "--pairs", "3", "--threads", "1", "--out", str(tmp_path)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(next(tmp_path.glob("context_*_cpu.json")).read_text())
    # two rounds of 3 pairs, per block size: each a ratio of two real steps
    paired = got["paired"]["n"]
    assert sorted(paired) == ["1", "4"] and all(0.2 < v < 20 for v in paired.values())
    assert set(got["ms"]) == {"n@P=16", "n@P=160"}
    md = next(tmp_path.glob("context_*_cpu.md")).read_text()
    assert "t(1) P=160 / P=16, paired" in md and "t(4) P=160 / P=16, paired" in md
    row = next(line for line in md.splitlines() if line.startswith("| n |"))
    assert len(row.split("|")[2:-1]) == 2 * 2 + 2 + 2  # 4 times, 2 ratios, 2 paired ratios


def test_a_negative_pair_count_is_one_line_and_exit_2(stories_pkg, tmp_path):
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_context.py"), "--package",
                          f"n={stories_pkg}", "--pairs", "-3", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert run.stderr.strip().splitlines() == [
        "bench_context: --pairs takes a number of pairs, 0 or more; got -3"]
    assert not list(tmp_path.iterdir())  # nothing written


def test_a_package_without_a_name_or_bad_lengths_are_one_line_and_exit_2(tmp_path):
    for args, line in (
            (["--package", "native:out/pkg"],
             "--package takes NAME=[KIND:]PATH (e.g. q8=native-q8:out/pkg), got 'native:out/pkg'"),
            (["--package", "n=out/pkg", "--sizes", "1,x"],
             "--contexts and --sizes take comma-separated whole numbers"),
            (["--package", "n=out/pkg", "--sizes", "0"],
             "--sizes block rows of 1 or more")):
        run = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_context.py"), *args,
                              "--out", str(tmp_path)], capture_output=True, text=True,
                             timeout=300)
        assert run.returncode == 2 and "Traceback" not in run.stderr
        assert len(run.stderr.strip().splitlines()) == 1 and line in run.stderr
    assert not list(tmp_path.iterdir())
