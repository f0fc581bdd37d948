"""Command-line defects a QA pass found (tools report, 2026-11-29), each run for real in a
subprocess: a profile's budget for another drafter, ``inspect`` of a mistyped path, a
package without a tokenizer, and ``export``'s TensorRT options without ``--trt``."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from conftest import STORIES

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def cli(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "edgemtp.cli", *args], cwd=cwd, env=ENV,
                          capture_output=True, text=True, timeout=300)


def one_line(p: subprocess.CompletedProcess, *words: str) -> str:
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    (line,) = p.stderr.strip().splitlines()
    assert line.startswith("edgemtp: error: "), line
    for w in words:
        assert w in line, line
    return line


@pytest.fixture(scope="module")
def no_tokenizer_pkg(tmp_path_factory) -> Path:
    """stories260K exported from a folder with its config and weights only."""
    from edgemtp.export.onnx_export import export_package

    src = tmp_path_factory.mktemp("notok") / "model"
    src.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(STORIES / name, src)
    out = src.parent / "pkg"
    report = export_package(str(src), out, max_context=64, bc=(10,), mask_tokens=(1,),
                            progress=False)
    assert "; no tokenizer (the model folder has no tokenizer files)" in report.summary()
    return out


@pytest.fixture(scope="module")
def runs(stories_pkg, no_tokenizer_pkg, tmp_path_factory) -> dict:
    """Every command of this file, a few at a time."""
    tmp = tmp_path_factory.mktemp("cli_qa")
    prof = tmp / "profile.json"  # a profile that found plain decoding best (bc 1)
    prof.write_text(json.dumps({
        "format_version": 1, "latency": {"block_sizes": [1, 10], "seconds": [0.001, 0.002]},
        "recommendation": {"drafter": "none", "bc": 1, "mask_tokens": 1}}))
    gen = ["generate", "--model", str(stories_pkg), "--prompt", "Once upon a time",
           "--max-new-tokens", "4", "--threads", "1", "--json", "--profile", str(prof)]
    notok = ["--model", str(no_tokenizer_pkg), "--prompt", "Once upon a time",
             "--max-new-tokens", "4"]
    jobs = {
        "profile-own": (gen, ROOT),
        "profile-probe": ([*gen, "--drafter", "probe"], ROOT),
        "profile-probe-bc": ([*gen, "--drafter", "probe", "--bc", "10"], ROOT),
        "inspect-typo": (["inspect", "out/typo"], tmp),
        "notok-text": (["generate", *notok], ROOT),
        "notok-json": (["generate", *notok, "--json"], ROOT),
        "notok-chat": (["chat", str(no_tokenizer_pkg)], ROOT),
        "workspace-0": (["export", str(STORIES), "-o", str(tmp / "w0"), "--workspace", "0"],
                        ROOT),
        "max-block-0": (["export", str(STORIES), "-o", str(tmp / "b0"), "--max-block", "0"],
                        ROOT),
    }
    with ThreadPoolExecutor(max_workers=4) as pool:
        futures = {k: pool.submit(cli, *argv, cwd=cwd) for k, (argv, cwd) in jobs.items()}
        done = {k: f.result() for k, f in futures.items()}
    done["tmp"] = tmp
    return done


def test_another_drafter_than_the_profile_s_takes_the_default_budget(runs):
    # the profile's bc 1 (for 'none') carried over to probing: "block complexity 1 is too
    # small for k=1 mask tokens"
    out = {}
    for key in ("profile-own", "profile-probe", "profile-probe-bc"):
        p = runs[key]
        assert p.returncode == 0, p.stderr
        out[key] = json.loads(p.stdout)
    assert (out["profile-own"]["drafter"], out["profile-own"]["bc"]) == ("none", 1)
    assert (out["profile-probe"]["drafter"], out["profile-probe"]["bc"]) == ("probe", 30)
    assert out["profile-probe-bc"]["bc"] == 10  # --bc given: it wins
    assert out["profile-probe"]["token_ids"] == out["profile-own"]["token_ids"]


def test_inspect_of_a_missing_relative_path_never_asks_the_hub(runs):
    # it said "'out/typo' is not a local folder, and the Hugging Face hub cannot be reached"
    line = one_line(runs["inspect-typo"], "package folder 'out/typo' does not exist")
    assert "hub" not in line


@pytest.mark.parametrize("key", ["notok-text", "notok-json", "notok-chat"])
def test_a_package_without_a_tokenizer_says_so_and_how_to_proceed(runs, key):
    # plain text said "streaming text needs a tokenizer", --json "pass token ids" (which the
    # command line cannot)
    one_line(runs[key], "has no tokenizer", "re-export", "Python API")


@pytest.mark.parametrize("key, words", [
    ("workspace-0", "--workspace must be a number of GiB > 0, got 0"),
    ("max-block-0", "--max-block must be a number of rows in [1, 1024], got 0")])
def test_export_checks_the_engine_options_without_trt_too(runs, key, words):
    # accepted in silence without --trt, where build-engine refuses them
    one_line(runs[key], words)
    assert not (runs["tmp"] / key.replace("workspace-0", "w0").replace("max-block-0", "b0")
                ).exists()


def test_the_command_ignores_a_ctrl_c_once_its_work_is_done(monkeypatch):
    # (the QA's find: a Ctrl-C in the ~0.2 s of shutdown after a finished export printed a
    # traceback from torch's finalizers, or ended the process by the signal)
    import signal

    from edgemtp import cli

    before = signal.getsignal(signal.SIGINT)
    monkeypatch.setattr(cli, "main", lambda: 0)
    try:
        with pytest.raises(SystemExit) as done:
            cli.entry()
        assert done.value.code == 0
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, before)


@pytest.mark.parametrize("flags, said", [
    (["--chat", "--system", "be \udcff brief"], "--system is not valid UTF-8 text (an "
                                                 "undecodable byte at character 3)"),
    (["--stop", "\udcff"], "stop string 0 is not valid UTF-8 text")])
def test_text_options_that_are_not_utf8_are_named(stories_pkg, capsys, flags, said):
    """qa8b D9, D10: a non-UTF-8 --system was "message 0's content ..."; a non-UTF-8 --stop
    was taken (it can never match)."""
    from edgemtp import cli

    rc = cli.main(["generate", "--model", str(stories_pkg), "--prompt", "Once", *flags])
    assert rc == 2 and said in capsys.readouterr().err


@pytest.mark.parametrize("argv, said", [
    (["generate", "--model", "m", "--prompt", "x", "-n", "5"],
     "edgemtp: error: unrecognized arguments: -n 5 (see 'edgemtp generate --help')"),
    (["inspect", "p", "--bogus"],
     "edgemtp: error: unrecognized arguments: --bogus (see 'edgemtp inspect --help')")])
def test_an_unknown_flag_points_to_its_subcommand_s_help(argv, said, capsys):
    """qa8b D14: "see 'edgemtp --help'", where the missing-argument error names the
    subcommand's."""
    from edgemtp import cli

    with pytest.raises(SystemExit) as done:  # (argparse's exit, as for every usage error)
        cli.main(argv)
    assert done.value.code == 2 and capsys.readouterr().err.strip() == said


def test_a_package_folder_without_its_manifest_is_not_called_a_hf_folder(stories_pkg,
                                                                          tmp_path, capsys):
    """qa8b D15: generate said "has no config.json; expected a Hugging Face model folder"."""
    from edgemtp import cli

    pkg = tmp_path / "pkg"
    shutil.copytree(stories_pkg, pkg)
    (pkg / "edgemtp.json").unlink()
    assert cli.main(["generate", "--model", str(pkg), "--prompt", "x"]) == 2
    assert "holds an edgemtp package's files but no edgemtp.json (a damaged or unfinished " \
           "export); export it again" in capsys.readouterr().err


def test_every_option_of_every_command_says_what_it_does():
    """qa8b D13: --max-new-tokens, --prompt, --top-k, --top-p, --seed, --mask-init had no
    help text, and --temperature no default."""
    import argparse

    from edgemtp.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    silent = [(name, a.option_strings or a.dest) for name, p in sub.choices.items()
              for a in p._actions if not a.help]
    assert silent == []
    gen = sub.choices["generate"].format_help()
    for words in ("most tokens to generate (default: 128", "(default: 0 = greedy)"):
        assert words in " ".join(gen.split()), words


def test_python_dash_m_edgemtp_is_the_command_and_says_its_version():
    from edgemtp import __version__

    r = subprocess.run([sys.executable, "-m", "edgemtp", "--version"], capture_output=True,
                       text=True, timeout=120)
    assert (r.returncode, r.stdout, r.stderr) == (0, f"edgemtp {__version__}\n", "")
    r = subprocess.run([sys.executable, "-m", "edgemtp", "inspect", "/nonexistent/pkg"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr == (
        "edgemtp: error: package folder '/nonexistent/pkg' does not exist\n"), r.stderr


def test_a_handled_ctrl_c_inside_exec_still_exits_with_the_command_s_code(tmp_path):
    """A Ctrl-C landing in exec() of a string (dataclasses' generated methods, while torch's
    lazy imports run) left CPython's unhandled-KeyboardInterrupt flag set though the command
    caught it: `python -m edgemtp.cli train-heads` then ended by SIGINT (rc -2) in ~1 run of 3
    instead of 130. Here the interrupt is raised inside exec() every time."""
    (tmp_path / "probe_exec_interrupt.py").write_text(
        "from edgemtp import cli\n"
        "def main():\n"
        "    try:\n"
        "        exec('raise KeyboardInterrupt')\n"
        "    except KeyboardInterrupt:\n"
        "        return 130\n"
        "cli.main = main\n"
        "cli.entry()\n")
    r = subprocess.run([sys.executable, "-m", "probe_exec_interrupt"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    assert r.returncode == 130, (r.returncode, r.stderr[-2000:])


@pytest.mark.parametrize("flags, drafter", [(["-k", "2"], "pld"), (["--tree", "static"], "auto"),
                                            (["--mask-tokens", "1"], "heads"),
                                            (["--branching", "4"], "none")])
def test_probing_options_with_a_drafter_that_ignores_them_are_refused(stories_pkg, flags,
                                                                      drafter):
    """QA (heads report D10): they were accepted and silently ignored, while --lade with
    another drafter was refused."""
    r = cli("generate", "--model", str(stories_pkg), "--prompt", "Once", "--drafter", drafter,
            *flags)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    flag = " ".join(flags) if flags[0] == "--tree" else "--mask-tokens" if flags[0] == "-k" \
        else flags[0]
    assert r.stderr.strip() == (f"edgemtp: error: {flag} only applies to drafters that probe "
                                f"with mask tokens (probe, hybrid); --drafter {drafter} takes "
                                f"none")


@pytest.mark.slow  # loads the torch backend in a subprocess: ~15 s
def test_a_max_context_above_the_package_is_said_not_silently_clamped(tmp_path):
    """QA (qa6 context, 2): --max-context 1024 on a 512-token package ran at 512 without a
    word, and a later error named the 512 the user never asked for."""
    import subprocess
    import sys
    from pathlib import Path

    pkg = Path(__file__).resolve().parents[1] / ".." / "shared" / "models" / "stories260K"
    r = subprocess.run([sys.executable, "-m", "edgemtp.cli", "generate", "--model", str(pkg),
                        "--max-context", "4096", "--prompt", "Once", "--max-new-tokens", "2"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "edgemtp: note: --max-context 4096 is above what" in r.stderr
    assert "using its 512 tokens" in r.stderr and "Warning" not in r.stderr  # (once, a note)


def test_the_api_warns_when_max_context_is_above_the_package(stories_pkg):
    """QA (qa8a, minor): Model.load(max_context=10**7) on a 512-token package clamped to 512
    without a word, where the CLI says so (the test package holds 256)."""
    import warnings

    from edgemtp import Model
    from edgemtp.errors import ContextClampedWarning

    with pytest.warns(ContextClampedWarning, match=r"max_context 10000000 is above what .* "
                                                   r"holds; using its 256 tokens"):
        m = Model.load(str(stories_pkg), max_context=10 ** 7, threads=1)
    assert m.backend.max_context == 256  # (the test package's)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Model.load(str(stories_pkg), max_context=256, threads=1)  # (below: no warning)


def test_ctrl_c_in_any_command_is_one_line_and_exit_130(monkeypatch, capsys):
    """qa10a CL2: main()'s KeyboardInterrupt -> 130 was tested only through train-heads' own
    handler (slow); a command interrupted anywhere says so in one line, as a shell's 128 +
    SIGINT, with no traceback."""
    from edgemtp import cli, doctor

    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(doctor, "probe", interrupted)  # doctor's first piece of work
    assert cli.main(["doctor"]) == 130
    assert capsys.readouterr().err == "edgemtp: interrupted\n"


def test_run_sh_gives_an_option_to_the_main_job():
    """qa10c D10: ./run.sh --prompts 1 handed "--prompts" to the CLI as its command
    ("invalid choice: '1'"); an option is the main job's, --help and --version the CLI's."""
    root = Path(__file__).resolve().parents[1]
    if not (root / ".venv" / ".edgemtp-installed").is_file():
        pytest.skip("run.sh has not set up .venv here")  # (it would install it)
    p = subprocess.run(["bash", str(root / "run.sh"), "--no-such-option"], cwd=root,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stderr.strip().splitlines()[-1] == (
        "edgemtp: error: unrecognized arguments: --no-such-option (see 'edgemtp demo --help')")
    v = subprocess.run(["bash", str(root / "run.sh"), "--version"], cwd=root,
                       capture_output=True, text=True, timeout=120)
    assert v.returncode == 0 and v.stdout.startswith("edgemtp ")
