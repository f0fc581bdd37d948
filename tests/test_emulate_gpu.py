"""bench/emulate_gpu.py (drafters on a GPU's latency curve, on a virtual clock): forward passes
cost the curve's buckets, every clock the engine and `auto` read is the virtual one (and the
real ones come back), outputs stay plain decoding's, and bad arguments are one line."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "emulate_gpu.py"
STORY_IDS = ROOT / "bench" / "data" / "gpu_prompts.json"
FLAT = {str(t): 2.0 for t in (1, 2, 4, 8, 16, 32, 64)}  # every block of <= 64 rows: 2 ms


@pytest.fixture(scope="module")
def emu():
    sys.path.insert(0, str(ROOT / "bench"))
    import emulate_gpu

    return emulate_gpu


def test_curve_charges_the_padded_bucket(emu):
    c = emu.Curve({"1": 1.0, "2": 1.1, "4": 1.2, "8": 1.3, "16": 1.5, "32": 1.7, "64": 2.0},
                  binding_ms=0.25)
    assert c(1) == pytest.approx(1.25e-3)
    assert c(11) == c(16) == pytest.approx(1.75e-3)  # 11 rows run as a 16-row graph
    assert c(33) == c(64) == pytest.approx(2.25e-3)
    assert c(200) == pytest.approx(2.0e-3 * 1.3 + 0.25e-3)  # 4 x 64 rows: 3 more tenths
    with pytest.raises(ValueError, match="T = 1, 2, 4"):
        emu.Curve({"1": 1.0, "64": 2.0}, 0.0)


def test_extras_charge_top_k_steps_and_plans_new_to_the_device(emu):
    from edgemtp.plans import Plan

    x = emu.Extras(topk_ms=0.3, plan_ms=0.5)
    a, b = Plan.top1((3,), 1).tree_mask, Plan.top1((2,), 1).tree_mask
    assert x(a, topk=0) == pytest.approx(0.5e-3)      # a plan the device has not held
    assert x(a, topk=0) == 0.0                       # held now
    assert x(a, topk=8) == pytest.approx(0.3e-3)     # a top-K step
    assert x(b, topk=8) == pytest.approx(0.8e-3)     # both
    one = emu.Extras(plan_ms=0.5)
    one.MASKS = 1                                    # the device holds one plan mask
    assert [one(m, topk=0) for m in (a, a, b, a)] == pytest.approx([5e-4, 0.0, 5e-4, 5e-4])
    assert emu.Extras()(b, topk=8) == 0.0            # none asked: none charged


def test_a_shape_is_run_eagerly_then_captured_then_replayed(emu):
    x, shapes = emu.Extras(capture_ms=20.0, eager_ms=12.0), {}
    got = [x.captured(shapes, key) for key in ("a", "a", "b", "a", "b", "b")]
    assert got == pytest.approx([12e-3, 20e-3, 12e-3, 0.0, 20e-3, 0.0])
    assert x.events == {"shapes": 2, "captures": 2}


def test_the_virtual_clock_replaces_forward_time_and_scales_the_rest(emu):
    real = iter([100.0, 101.0, 113.0]).__next__  # real seconds at each read
    clock = emu.VirtualClock(host_scale=0.5, real=real)
    t0 = clock()                                   # 0.5 * 100
    t1 = clock()                                   # one real second of host work later
    clock.forward_took(real=10.0, modelled=0.002)  # then ten real seconds of CPU forward
    t2 = clock()                                   # and two more of host work
    assert t1 - t0 == pytest.approx(0.5)
    assert t2 - t1 == pytest.approx(0.5 * 2.0 + 0.002)


def test_auto_measures_the_emulated_curve_and_the_real_clocks_come_back(emu, stories_path):
    """measure_latency under the installed clock reads the curve (the latency module's clock
    was replaced), a generation's forward time is the curve's, and restore() puts the real
    perf_counter back in every module."""
    import time as real_time

    import edgemtp.drafters.auto as auto
    import edgemtp.engine as engine
    import edgemtp.latency as latency
    from edgemtp import Model

    curve = emu.Curve({"1": 1.0, "2": 1.1, "4": 1.2, "8": 1.3, "16": 1.5, "32": 1.7,
                       "64": 2.0}, 0.0)
    clock = emu.VirtualClock(host_scale=1e-9)
    restore = emu.install_clock(clock)
    try:
        model = Model.load(stories_path, backend="torch")
        model.backend = emu.EmuBackend(model.backend, clock, curve)
        got = latency.measure_latency(model.backend, (1, 4, 11, 60), context=16, repeats=3)
        np.testing.assert_allclose(got.seconds, [1.0e-3, 1.2e-3, 1.5e-3, 2.0e-3], rtol=1e-4)
        prompt = json.loads(STORY_IDS.read_text())["prompts"][0]
        r = model.generate(prompt, max_new_tokens=12, drafter="none")
        # every decode step a 1-row forward: 1 ms each in the engine's own timer
        assert r.stats.time_forward == pytest.approx(1e-3 * (r.stats.forward_calls - 1),
                                                     rel=1e-3)
    finally:
        restore()
    assert engine.perf_counter is real_time.perf_counter
    assert auto.time is real_time and latency.time is real_time


def _run(*args, timeout=300):
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT)


class _Cache:
    """A session that only keeps its cache length (each forward commits its block)."""

    def __init__(self):
        self.cache_len = 0

    def forward(self, ids, *args, **kwargs):
        self.cache_len += len(ids)


@pytest.mark.parametrize("span, widths", [(256, 4), ("doubling", 1), ("full", 1)])
def test_step_shapes_are_keyed_on_the_torch_backends_attention_span(emu, span, widths):
    """One-row steps from an empty cache to 1000 rows: 256-row buckets meet 4 widths (4 step
    shapes, each run eagerly first), doubling spans (the CUDA default) and the full cache 1."""
    from edgemtp.runtimes.torch_backend import DOUBLING, FULL_SPAN

    code = {"doubling": DOUBLING, "full": FULL_SPAN}.get(span, span)
    x = emu.Extras(eager_ms=1.0)
    s = emu.EmuSession(_Cache(), emu.VirtualClock(1.0), emu.Curve(FLAT, 0.0), x, code,
                       rows=1000 + 64)
    causal = np.ones((1, 1), dtype=bool)
    for _ in range(1000):
        s.forward(np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.int64), causal)
    assert x.events["shapes"] == widths


@pytest.mark.slow  # a subprocess emulation run (~9 s of the default run): CI only
def test_a_run_on_a_flat_curve_gives_be_as_its_speed_up(tmp_path, stories_path):
    """On a flat curve with the host's time scaled away, a drafter's virtual tok/s over plain
    decoding's is its tokens per forward call over theirs; and its tokens are plain's."""
    curve = tmp_path / "curve.json"
    curve.write_text(json.dumps({"entries": {"flat": {"t_ms": FLAT, "device": "test"}}}))
    out = tmp_path / "emu"
    r = _run(stories_path, "--backend", "torch", "--curve", f"{curve}:flat", "--binding-ms", 0,
             "--host-scale", 1e-9, "--drafters", "pld", "--bc", 10, "--prompts", 2,
             "--new-tokens", 24, "--warmup", 1, "--prompts-file", STORY_IDS, "--out", out)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(out.with_suffix(".json").read_text())["results"]
    plain, pld = res["plain"], res["pld@10"]
    for m in (plain, pld):  # each forward pass (prefill included) 2 ms
        assert m["tps"] == pytest.approx(m["tokens"] / (m["forward_calls"] * 2e-3), rel=1e-3)
    assert pld["identical"] == [2, 2] and pld["be"] > 1.0
    assert "not a GPU measurement" in out.with_suffix(".md").read_text()


@pytest.mark.parametrize("args, says", [
    (["--curve", "nowhere.json:x"], "cannot read"),
    (["--curve", "{curve}:missing"], "no entry 'missing'"),
    (["--curve", "{curve}:flat", "--prompts", "0"], "--prompts must be >= 1"),
    (["--curve", "{curve}:flat", "--host-scale", "0"], "--host-scale must be > 0"),
    (["--curve", "{curve}:flat", "--auto-param", "nosuch=1"], "neither AutoDrafter"),
    (["--curve", "{curve}:flat", "--span", "100"], "--span must be a multiple of 64 cached rows"),
])
def test_bad_arguments_are_one_line(emu, tmp_path, stories_path, args, says, capsys):
    # in this process (argparse's exit 2 and its usage lines; a subprocess each cost ~8 s of
    # imports on CI's 2 cores): every refusal comes before the model loads
    curve = tmp_path / "curve.json"
    curve.write_text(json.dumps({"entries": {"flat": {"t_ms": FLAT}}}))
    with pytest.raises(SystemExit) as e:
        emu.main([str(stories_path), "--backend", "torch",
                  *[a.replace("{curve}", str(curve)) for a in args]])
    err = capsys.readouterr().err
    assert e.value.code == 2 and says in err, err[-1500:]
    assert "Traceback" not in err and "error: " in err.strip().splitlines()[-1]
