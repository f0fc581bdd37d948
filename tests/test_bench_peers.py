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


def test_a_package_other_export_code_wrote_is_exported_again(tmp_path, stories_path):
    """The sitting measures this edgemtp's graph: a package in its work folder is reused
    while its manifest's exporter digest is this code's, and exported again once it is not
    (a package from before a change to edgemtp.export or edgemtp.models). A real export of
    stories260K each time; ``edgemtp inspect`` shows the digest."""
    import json

    sys.path.insert(0, str(ROOT / "bench"))
    from bench_peers import edgemtp_package

    from edgemtp.export.onnx_export import exporter_digest
    from edgemtp.runtimes.package import MANIFEST, describe, load_package

    digest = exporter_digest()
    assert len(digest) == 16 and digest == exporter_digest()
    pkg = edgemtp_package(Path(stories_path), tmp_path, "fp32", context=256)
    manifest = pkg / MANIFEST
    assert json.loads(manifest.read_text())["exporter"] == digest
    assert f"exporter {digest}" in describe(load_package(str(pkg)))
    written = manifest.stat().st_mtime_ns
    assert edgemtp_package(Path(stories_path), tmp_path, "fp32", context=256) == pkg
    assert manifest.stat().st_mtime_ns == written  # the same code's package: reused
    data = json.loads(manifest.read_text())
    data["exporter"] = "0" * 16
    manifest.write_text(json.dumps(data))
    assert edgemtp_package(Path(stories_path), tmp_path, "fp32", context=256) == pkg
    assert json.loads(manifest.read_text())["exporter"] == digest  # exported again
    del data["exporter"]  # a package from before the digest was recorded: loads, and is stale
    manifest.write_text(json.dumps(data))
    assert load_package(str(pkg)).meta.exporter == ""
    edgemtp_package(Path(stories_path), tmp_path, "fp32", context=256)
    assert json.loads(manifest.read_text())["exporter"] == digest
    # not a package, or a manifest that is not JSON: not this code's package
    from edgemtp.export.onnx_export import exported_here

    assert exported_here(pkg) and not exported_here(tmp_path / "none")
    manifest.write_text("{not json")
    assert not exported_here(pkg)
    manifest.write_text("[1, 2]")
    assert not exported_here(pkg)
