"""bench/bench_decoder_phases.py: every work-sharing loop of the shipped decoder is placed in
a phase and timed in an instrumented copy that computes the same bits; a real run on an int4
package prints each phase per thread; bad arguments are one line and exit 2."""

import platform
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import bench_decoder_phases as phases  # noqa: E402

SRC = ROOT / "edgemtp" / "native" / "decoder.c"
x86 = pytest.mark.skipif(platform.machine() != "x86_64", reason="reads x86-64's rdtsc")


def test_every_work_sharing_loop_is_placed_and_keeps_its_synchronisation():
    src = SRC.read_text()
    text, counts = phases.instrument(src)
    loops = len(re.findall(r"^[ \t]*#pragma omp for", src, re.M))
    assert sum(counts.values()) == loops
    assert counts["scores"] == counts["softmax"] == counts["weight products"] == 1
    # each loop that had an implicit barrier has one explicit barrier instead, timed apart
    implicit = len([m for m in re.finditer(r"^[ \t]*#pragma omp for([^\n]*)", src, re.M)
                    if "nowait" not in m.group(1)])
    assert text.count("#pragma omp barrier") == src.count("#pragma omp barrier") + implicit
    assert text.count("nowait") == src.count("nowait") + implicit
    assert "PH_STEPS++" in text and "decoder_phase_take" in text


def test_a_loop_outside_the_known_functions_is_refused():
    src = SRC.read_text() + ("\nvoid extra(int n) {\n#pragma omp for\n"
                             "    for (int i = 0; i < n; i++)\n        (void)i;\n}\n")
    with pytest.raises(phases.ConfigError, match="extra"):
        phases.instrument(src)


def test_statement_end_takes_braced_bodies_single_statements_and_nested_fors():
    s = "for (int i = 0; i < (n); i++) { if (a) { b(); } } X"
    assert s[phases._statement_end(s, 0):] == " X"
    s = "for (int i = 0; i < n; i++)\n    f(g(i), (h));\nX"
    assert s[phases._statement_end(s, 0):] == "\nX"
    s = "for (int i = 0; i < n; i++)\n  for (int j = 0; j < m; j++) { a[i] += j; }\nX"
    assert s[phases._statement_end(s, 0):] == "\nX"


@x86
@pytest.mark.slow  # exports a package, builds the instrumented decoder (~6 s here): CI only
def test_a_real_run_times_the_grouped_attention_per_thread(tmp_path):
    # head_dim 64 (the grouped attention's shape: stories260K's heads are 8 wide)
    from conftest import save_random_llama
    from edgemtp.export.onnx_export import export_package

    save_random_llama(tmp_path / "hf", hidden_size=256, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      vocab_size=256, max_position_embeddings=512, eos_token_id=255,
                      bos_token_id=1, tie_word_embeddings=True)
    pkg = tmp_path / "int4"
    export_package(str(tmp_path / "hf"), pkg, dtype="int4", max_context=256, progress=False)
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_decoder_phases.py"),
                           str(pkg), "--contexts", "16,200", "--steps", "5", "--rounds", "1",
                           "--grouped-from", "0", "--out", str(tmp_path / "p.json")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {ln.split("|")[1].strip(): ln for ln in proc.stdout.splitlines()
            if ln.startswith("| ")}
    for name in ("scores", "softmax", "p @ V", "weight products", "step",
                 "decoder_forward, entry to exit"):
        assert name in rows, proc.stdout
    import json

    out = json.loads((tmp_path / "p.json").read_text())
    us = np.asarray(out["contexts"]["200"]["us"])  # [thread][phase][work, wait]
    assert us.shape == (2, len(phases.PHASES), 2)
    assert (us[:, :3, 0] > 0).all() and (us[:, 4, 0] > 0).all()  # both threads worked
    assert us[:, 4, 0].sum() < out["contexts"]["200"]["step_ms"] * 1e3 * 2


def test_bad_arguments_end_in_one_line(tmp_path):
    for args in (["--contexts", "0"], ["--contexts", "64,abc"], ["--steps", "0"],
                 ["--threads", "0"], []):  # [] no package
        proc = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_decoder_phases.py"),
                               str(tmp_path / "none"), *args],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2, (args, proc.stderr)
        assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("error:"), proc.stderr
