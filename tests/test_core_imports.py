"""The numpy core runs a package on a device with numpy, onnxruntime and tokenizers only:
``import edgemtp`` and a whole text generation from an exported package on onnxruntime load
no torch, transformers or matplotlib, with a chat template too (checked in a fresh interpreter, where nothing else has
imported them)."""

import json
import shutil
import subprocess
import sys

HEAVY = ("torch", "transformers", "matplotlib", "edgemtp.tools", "edgemtp.export")

PROBE = """
import json, sys
import edgemtp, edgemtp.cli
after_import = sorted(m for m in {heavy} if m in sys.modules)
result = None
if len(sys.argv) > 1:
    from edgemtp.cli import main
    rc = main(["generate", "--model", sys.argv[1], "--prompt", "Once upon a time",
               "--max-new-tokens", "24", "--drafter", "hybrid", "--bc", "30", "--json",
               *sys.argv[2:]])
    assert rc == 0, rc
after_generate = sorted(m for m in {heavy} if m in sys.modules)
print(json.dumps([after_import, after_generate]))
"""


def _heavy_modules(*args) -> tuple[list[str], list[str]]:
    code = PROBE.format(heavy=repr(HEAVY))
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return tuple(json.loads(out.stdout.strip().splitlines()[-1]))


def test_import_edgemtp_and_its_cli_loads_no_heavy_module():
    after_import, _ = _heavy_modules()
    assert after_import == []


def test_package_generate_on_onnxruntime_loads_no_heavy_module(stories_pkg):
    after_import, after_generate = _heavy_modules(str(stories_pkg))
    assert after_import == [] and after_generate == []


def test_package_generate_chat_loads_no_heavy_module(stories_pkg, tmp_path):
    from test_chat import CHATML

    pkg = tmp_path / "chat-pkg"
    shutil.copytree(stories_pkg, pkg)
    (pkg / "chat_template.jinja").write_text(CHATML)
    after_import, after_generate = _heavy_modules(str(pkg), "--chat", "--system", "Be brief.")
    assert after_import == [] and after_generate == []
