"""bench/bench_peers.py's input checks, run as a user runs it (the sitting itself needs the
peers, which are bench extras: not run here)."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("spec, says", [
    ("lookahead@10", "drafter must be one of probe, auto, pld, stand, lade, hybrid"),
    ("auto@x", "invalid literal for int()"),
])
def test_a_bad_drafter_is_a_usage_error_before_anything_is_built(spec, says, tmp_path):
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_peers.py"), "--peers",
                          "edgemtp", "--drafters", f"auto@60,{spec}", "--out",
                          str(tmp_path / "peers")], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "Traceback" not in run.stderr
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("bench_peers.py: error: --drafters takes drafter@BC") and says in last
    assert not list(tmp_path.iterdir())
