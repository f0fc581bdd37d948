"""Learned heads end to end on stories260K: hidden states out of the graph, a short
self-distillation run that lowers the loss, heads graphs that agree with PyTorch, the heads
drafter identical to transformers greedy and exact when sampling, and one clear line when a
package has no heads."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from edgemtp import GenerationConfig
from edgemtp.engine import Generation
from edgemtp.runtimes.package import load_package

from conftest import QUICK, STORIES, story_prompts

pytest.importorskip("onnx")

SHORT = dict(heads=3, steps=80, batch=128, repeats=1, bos_samples=12, new_tokens=64,
             max_prompts=6, threads=1)


@pytest.fixture(scope="module")
def hidden_pkg(tmp_path_factory):
    """stories260K exported with --hidden-states (max context 256)."""
    from edgemtp.export.onnx_export import export_package

    out = tmp_path_factory.mktemp("heads") / "stories-h"
    export_package(str(STORIES), out, max_context=256, progress=False, hidden_states=True)
    return out


@pytest.fixture(scope="module")
def trained(hidden_pkg, tmp_path_factory):
    """A copy of the package with short-trained medusa and residual heads: (path, infos)."""
    from edgemtp.export.heads import TrainOptions, train_heads

    pkg = tmp_path_factory.mktemp("trained") / "stories-heads"
    shutil.copytree(hidden_pkg, pkg)
    infos = {kind: train_heads(pkg, TrainOptions(kind=kind, **SHORT), progress=False)
             for kind in ("medusa", "residual")}
    return pkg, infos


def _ort(pkg):
    from edgemtp.runtimes.onnxrt_backend import OrtBackend

    return OrtBackend(pkg, threads=1)


# -- hidden states -------------------------------------------------------------------------


def test_graph_hidden_states_equal_transformers(hidden_pkg, stories_refs):
    hf, prompts, _ = stories_refs
    backend = _ort(hidden_pkg)
    assert backend.supports_hidden
    ids = np.array(prompts[0], dtype=np.int64)
    n = len(ids)
    out = backend.session().forward(ids, np.arange(n), np.tril(np.ones((n, n), bool)), None,
                                    hidden=True)
    with torch.no_grad():
        ref = hf.model(torch.tensor([prompts[0]])).last_hidden_state[0].numpy()
    assert out.hidden.shape == ref.shape
    np.testing.assert_allclose(out.hidden, ref, atol=1e-4, rtol=1e-4)


def test_package_without_hidden_states_refuses_them(stories_pkg):
    from edgemtp.errors import ConfigError

    backend = _ort(stories_pkg)
    assert not backend.supports_hidden
    with pytest.raises(ConfigError, match="hidden states.*re-export"):
        backend.session().forward(np.array([1]), np.array([0]), np.ones((1, 1), bool), None,
                                  hidden=True)


# -- prompts ---------------------------------------------------------------------------------


@pytest.mark.parametrize("chat", [False, True])
def test_training_and_evaluation_prompts_are_disjoint(chat):
    from edgemtp.export.heads import training_prompts

    train, _, held = training_prompts(chat)
    assert train and held and not set(train) & set(held)
    if not chat:  # what the tests and benches evaluate on is held out
        assert set(story_prompts(24)) == set(held)
        assert not set(train) & set(story_prompts(24))
    # --max-prompts 4: the summary names the four used (qa9 D5: "story prompts 24-47")
    first, what, _ = training_prompts(chat, 4)
    assert first == train[:4]
    assert what == ("story prompts 24-27 and BOS" if not chat else
                    "the first 4 of the Spec-Bench questions after the first 5 of each "
                    "category, categories interleaved (chat template)")


# -- training and export -------------------------------------------------------------------


def test_short_training_lowers_the_loss_and_lists_the_heads(trained):
    from edgemtp.runtimes.package import load_package

    pkg, infos = trained
    for kind, info in infos.items():
        t = info.training
        assert t.loss_last < 0.8 * t.loss_first, (kind, t.loss_first, t.loss_last)
        assert t.val_top1[0] > 0.2, (kind, t.val_top1)
        assert (pkg / info.file).is_file() and (pkg / info.loss_plot).is_file()
    meta = load_package(pkg).meta
    assert [h.kind for h in meta.heads] == ["medusa", "residual"]
    assert all(f in meta.files for h in meta.heads for f in h.files())


@pytest.mark.parametrize("kind,chain,by_id", [("medusa", None, False),
                                              ("residual", None, True),
                                              ("residual", None, False),
                                              ("residual", 40, False)])
def test_heads_graph_agrees_with_pytorch(kind, chain, by_id, tmp_path):
    from edgemtp.export.heads import export_heads
    from edgemtp.models.heads import HeadsGraph, build
    from edgemtp.runtimes.heads import ROW_INPUTS, HeadsInfo, HeadsRunner, heads_session

    torch.manual_seed(0)
    table = torch.randn(96, 16)
    heads = build(kind, table, 3)
    with torch.no_grad():  # away from the zero start, so the heads differ from each other
        for p in heads.parameters():
            p.add_(0.3 * torch.randn_like(p))
    path = tmp_path / f"{kind}.onnx"
    assert export_heads(heads, table.numpy(), path, topk=8, chain=chain, by_id=by_id) < 1e-3
    # the LM-head rows are not in the file: the runtime supplies them (a view for the chain)
    import onnx

    proto = onnx.load(str(path), load_external_data=False).graph
    held = {t.name: t for t in proto.initializer}
    if kind == "residual":  # the residual add rides in the down Gemm (its C input; BIAS_UNIT)
        gemm_out = {o for n in proto.node if n.op_type == "Gemm" for o in n.output}
        assert not [n for n in proto.node if n.op_type == "Add" and set(n.input) & gemm_out]
    supplied = ("lm_head", "lm_chain") if kind == "residual" and not by_id else ("lm_head",)
    for name in supplied:
        assert held[name].data_location == onnx.TensorProto.EXTERNAL
        assert not held[name].raw_data
    info = HeadsInfo(kind=kind, file=path.name, heads=3, topk=8, vocab=96, chain=chain)
    rows = {k: v for k, v in HeadsRunner.rows(info, table.numpy()).items() if k in ROW_INPUTS}
    assert np.shares_memory(rows["lm_chain"], rows["lm_head"])
    sess = heads_session(path, 1, {k: rows[k] for k in supplied})
    root_input = [] if kind == "medusa" else ["root_ids"] if by_id else ["root_embeds"]
    assert {i.name for i in sess.get_inputs()} == {"hidden", "k", *root_input}
    x, root_ids = torch.randn(5, 16), torch.randint(0, 96, (5,))
    roots = root_ids if by_id else torch.randn(5, 16)
    feeds = {"hidden": x.numpy(), "root_embeds": roots.numpy(), "root_ids": roots.numpy(),
             "k": np.array([8])}
    ids, lp = sess.run(None, {i.name: feeds[i.name] for i in sess.get_inputs()})
    with torch.no_grad():
        ref_ids, ref_lp = HeadsGraph(heads, 8, table[:chain or 96])(
            x, roots, table, None if by_id else table[:chain or 96])
    np.testing.assert_allclose(lp, ref_lp.numpy(), atol=1e-4)
    assert (ids[..., 0] == ref_ids[..., 0].numpy()).all()
    assert ids.shape == (5, 3, 8)
    # k: the first k candidates of each head, in the same order
    few = sess.run(None, {**{i.name: feeds[i.name] for i in sess.get_inputs()},
                          "k": np.array([3])})
    assert few[0].shape == (5, 3, 3) and (few[0] == ids[..., :3]).all()
    if kind == "medusa":  # the heads are trained apart: they do not all predict the same
        assert len({tuple(ids[0, j, :3]) for j in range(3)}) > 1


def _torch_load(load):
    # the runner as a torch backend on a GPU loads it, the device here the CPU's
    def on_device(package, kind=None, threads=1, k=None, native=True, device=None):
        return load(package, kind, threads, k, "torch" if native else native, device)
    return staticmethod(on_device)


def _variant(kind, chain, by_id, d, tmp_path):
    """A heads graph with random weights (away from the zero start) over a 96-row table."""
    from edgemtp.export.heads import export_heads
    from edgemtp.models.heads import build
    from edgemtp.runtimes.heads import ROW_INPUTS, HeadsInfo, HeadsRunner, heads_session

    torch.manual_seed(d)
    table = torch.randn(96, d)
    heads = build(kind, table, 3)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(0.3 * torch.randn_like(p))
    path = tmp_path / f"{kind}.onnx"
    export_heads(heads, table.numpy(), path, topk=8, chain=chain, by_id=by_id)
    info = HeadsInfo(kind=kind, file=path.name, heads=3, topk=8, vocab=96, chain=chain,
                     supplied=ROW_INPUTS if kind == "residual" and not by_id else ("lm_head",))
    lm = np.ascontiguousarray(table.numpy())
    rows = {k: v for k, v in HeadsRunner.rows(info, lm).items() if k in info.supplied}
    return path, info, lm, heads_session(path, 1, rows)


@pytest.mark.parametrize("kind,chain,by_id,d", [("medusa", None, False, 16),
                                                ("medusa", None, False, 20),
                                                ("residual", None, True, 16),
                                                ("residual", None, True, 20),
                                                ("residual", None, False, 16),
                                                ("residual", 37, False, 20)])
def test_native_heads_compute_the_graph(kind, chain, by_id, d, tmp_path):
    """``heads.c`` against the exported graph in onnxruntime: every candidate's log-prob
    within 1e-4, the same ids wherever neighbouring log-probs are apart (widths that are
    not a multiple of 8 and a chain of 37 rows exercise the kernels' remainders)."""
    from edgemtp import native
    from edgemtp.runtimes.heads import NativeHeads, agrees

    if native.heads_lib() is None:
        pytest.skip(f"no C heads kernel here: {native.heads_why_not()}")
    path, info, lm, sess = _variant(kind, chain, by_id, d, tmp_path)
    inputs = tuple(i.name for i in sess.get_inputs())
    nh = NativeHeads.from_graph(path, info, lm, inputs)
    assert agrees(nh, sess, inputs, 8)
    rng = np.random.default_rng(1)
    x, e = (rng.standard_normal((20, d)).astype(np.float32) * 3 for _ in range(2))
    roots = rng.integers(0, 96, 20)
    feeds = {"hidden": x, "root_ids": roots, "root_embeds": e, "k": np.array([8])}
    ref_ids, ref_lp = sess.run(None, {n: feeds[n] for n in inputs})
    ids, lp = np.zeros((3, 8), np.int64), np.zeros((3, 8), np.float32)
    for r in range(20):
        nh.run(x[r], int(roots[r]), e[r], 8, ids, lp)
        np.testing.assert_allclose(lp, ref_lp[r], atol=1e-4)
        gap = np.diff(ref_lp[r], axis=-1) < -2e-4
        apart = np.ones_like(gap[:, :1])
        clear = np.concatenate([gap, apart], -1) & np.concatenate([apart, gap], -1)
        assert (ids == ref_ids[r])[clear].all() and clear.mean() > 0.5
    few_ids, few_lp = np.zeros((3, 3), np.int64), np.zeros((3, 3), np.float32)
    nh.run(x[0], int(roots[0]), e[0], 3, few_ids, few_lp)  # k = 3: a prefix
    nh.run(x[0], int(roots[0]), e[0], 8, ids, lp)
    assert (few_ids == ids[:, :3]).all()


@pytest.mark.parametrize("kind,chain,by_id", [("medusa", None, False),
                                              ("residual", None, True),
                                              ("residual", 37, False)])
def test_torch_heads_compute_the_graph(kind, chain, by_id, tmp_path):
    """The heads in PyTorch (what a torch backend on a GPU may run; here on the CPU)
    against the exported graph: log-probs within 1e-4, the same top-1 where it is clear."""
    from edgemtp.runtimes.heads import NativeHeads, TorchHeads, agrees

    path, info, lm, sess = _variant(kind, chain, by_id, 20, tmp_path)
    inputs = tuple(i.name for i in sess.get_inputs())
    th = TorchHeads(NativeHeads.from_graph(path, info, lm, inputs), "cpu")
    assert agrees(th, sess, inputs, 8) and agrees(th, sess, inputs, 3, seed=4)
    th.w["wh" if kind == "residual" else "w1"][2, 3] += 1.0  # one weight off: refused
    assert not agrees(th, sess, inputs, 8)


def test_native_heads_run_in_parallel_threads(tmp_path):
    """Calls of one heads file from several threads (a server's generations) each have their
    own scratch: the results are those of the same calls one after another."""
    from concurrent.futures import ThreadPoolExecutor

    from edgemtp import native
    from edgemtp.runtimes.heads import NativeHeads

    if native.heads_lib() is None:
        pytest.skip(f"no C heads kernel here: {native.heads_why_not()}")
    path, info, lm, sess = _variant("residual", 37, False, 20, tmp_path)
    nh = NativeHeads.from_graph(path, info, lm, tuple(i.name for i in sess.get_inputs()))
    rng = np.random.default_rng(2)
    states = rng.standard_normal((4, 2, 20)).astype(np.float32)  # [thread, hidden/embed, d]

    def calls(t):
        h, e = np.ascontiguousarray(states[t, 0]), np.ascontiguousarray(states[t, 1])
        ids, lp = np.zeros((3, 8), np.int64), np.zeros((3, 8), np.float32)
        call, seen = nh.bind(h, e, ids, lp, 8), []
        for _ in range(300):
            assert call(0) == 0
            seen.append((ids.copy(), lp.copy()))
        return seen

    alone = [calls(t) for t in range(4)]
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(calls, range(4)))
    for a, b in zip(alone, together):
        assert all((x[0] == y[0]).all() and (x[1] == y[1]).all() for x, y in zip(a, b))
        assert all((x[0] == a[0][0]).all() for x in a)


def test_native_heads_refuse_what_they_cannot_reproduce(tmp_path, monkeypatch):
    """A file the kernel would compute wrongly, or cannot read, runs in onnxruntime."""
    import onnx

    from edgemtp import native
    from edgemtp.runtimes.heads import NativeHeads, agrees, native_heads

    if native.heads_lib() is None:
        pytest.skip(f"no C heads kernel here: {native.heads_why_not()}")
    path, info, lm, sess = _variant("residual", None, True, 16, tmp_path)
    inputs = tuple(i.name for i in sess.get_inputs())
    nh = NativeHeads.from_graph(path, info, lm, inputs)
    nh.arrays["wd"][3, 5] += 1.0  # one weight off
    assert not agrees(nh, sess, inputs, 8)
    model = onnx.load(str(path), load_external_data=False)  # a graph laid out otherwise
    for t in model.graph.initializer:
        t.name = t.name.replace("g.wh_t", "other")
    for n in model.graph.node:
        n.input[:] = [i.replace("g.wh_t", "other") for i in n.input]
    onnx.save(model, str(path))
    assert native_heads(path, (0, 1), info, lm, sess) is None
    monkeypatch.setenv("EDGEMTP_NATIVE", "0")
    assert native.heads_lib() is None and native.heads_why_not() == "EDGEMTP_NATIVE=0"


@pytest.mark.parametrize("kind", ["medusa", "residual"])
def test_heads_step_does_not_depend_on_the_input_scale(kind):
    """Inputs are RMS-normalised inside the module and the step is scaled by the states'
    own RMS per dimension: a model whose final norm is 40x larger gets the same step."""
    from edgemtp.models.heads import build

    torch.manual_seed(2)
    table = torch.randn(50, 12)
    heads = build(kind, table, 2)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(0.3 * torch.randn_like(p))
        x, toks = torch.randn(4, 12), torch.randint(0, 50, (4, 2))
        heads.set_scale(x)
        small = heads.states(x, toks) - x[:, None]
        heads.set_scale(40 * x)
        big = heads.states(40 * x, toks) - 40 * x[:, None]
    np.testing.assert_allclose(big.numpy(), 40 * small.numpy(), rtol=1e-4, atol=1e-4)


def test_residual_graph_feeds_its_own_argmax_like_teacher_forcing():
    """The graph's step j reads the argmax of step j - 1; teacher-forced with those tokens,
    the training path gives the same logits (one module, two uses)."""
    from edgemtp.models.heads import HeadsGraph, ResidualHeads

    torch.manual_seed(1)
    table = torch.randn(64, 8)
    heads = ResidualHeads(table, 3)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(0.2 * torch.randn_like(p))
        x, root = torch.randn(4, 8), torch.randint(0, 64, (4,))
        graph = HeadsGraph(heads, 64, table)
        ids, lp = graph(x, root, table)                    # the root by id, the chain's logits
        by_embed = graph(x, table[root], table, table)     # the root by embedding
        forced = torch.stack([root, ids[:, 0, 0], ids[:, 1, 0]], dim=1)
        ref = torch.log_softmax(heads.logits(x, forced), dim=-1)
    np.testing.assert_allclose(lp[:, :, 0].numpy(), ref.max(-1).values.numpy(), atol=1e-5)
    np.testing.assert_allclose(by_embed[1].numpy(), lp.numpy(), atol=1e-5)
    assert (by_embed[0][..., 0] == ids[..., 0]).all()


# -- the drafter: lossless, and better than probing -----------------------------------------


@pytest.mark.parametrize("engine", ["C", "onnxruntime", "torch"])
@pytest.mark.parametrize("bc", [10, *(pytest.param(b, marks=pytest.mark.slow) for b in (30, 60))])
def test_heads_equal_transformers_greedy(trained, stories_refs, bc, engine, monkeypatch):
    import edgemtp.runtimes.heads as rh
    from edgemtp import native

    if engine == "C" and native.heads_lib() is None:
        pytest.skip(f"no C heads kernel here: {native.heads_why_not()}")
    # the runner keeps whichever engine is faster here; each is held to greedy (torch: as
    # on a torch backend's GPU, here on the CPU device)
    monkeypatch.setattr(rh, "faster", lambda a, b: engine in ("C", "torch"))
    monkeypatch.setattr(rh, "_FASTER", {})
    if engine == "torch":
        monkeypatch.setattr(rh.HeadsRunner, "load", _torch_load(rh.HeadsRunner.load))
    hf, prompts, refs = stories_refs
    pkg, _ = trained
    assert rh.HeadsRunner.load(load_package(pkg), "residual", k=bc).engine == engine
    backend = _ort(pkg)
    session = backend.session()
    for drafter, kind in (("heads", "medusa"), ("heads", "residual"), ("hybrid", "residual")):
        config = GenerationConfig(drafter=drafter, heads=kind, bc=bc, max_new_tokens=128)
        calls = tokens = 0
        for i, (ids, ref) in enumerate(zip(prompts[:QUICK], refs)):
            r = Generation(backend, config, ids, session=session).run()
            assert r.token_ids == ref, f"{drafter} {kind} BC={bc}: prompt {i} differs"
            assert r.stats.mask_tokens == 0 and r.stats.bc == bc
            calls += r.stats.forward_calls
            tokens += r.stats.new_tokens
        assert tokens / calls > 1.2, (drafter, kind, bc, tokens / calls)  # drafts accepted


def test_auto_weighs_the_heads_and_stays_transformers_greedy(trained, stories_refs):
    # on a device where a block costs what a row does (a GPU's curve, given), auto runs the
    # heads (and the hybrid with heads) for most steps, and every output is still greedy's
    from edgemtp.latency import LatencyCurve

    hf, prompts, refs = stories_refs
    pkg, _ = trained
    backend = _ort(pkg)
    flat = LatencyCurve((1, 64), (0.02, 0.02))
    picked: dict[str, int] = {}
    calls = tokens = 0
    memory: dict = {None: {}, "residual": {}}  # what auto learns, kept across generations
    for i, (ids, ref) in enumerate(zip(prompts[:QUICK], refs)):
        for heads in (None, "residual"):
            config = GenerationConfig(drafter="auto", heads=heads, bc=30, max_new_tokens=128,
                                      latency=flat)
            g = Generation(backend, config, ids, memory=memory[heads])
            r = g.run()
            assert r.token_ids == ref, f"auto heads={heads}: prompt {i} differs"
            if heads:
                assert g.drafter.hidden
                for name, n in g.drafter.picked.items():
                    picked[name] = picked.get(name, 0) + n
                calls += r.stats.forward_calls
                tokens += r.stats.new_tokens
            else:
                assert not g.drafter.hidden  # no heads: no hidden states bound
    with_heads = sum(n for name, n in picked.items()
                     if name.startswith("heads") or name.startswith("hybrid"))
    # (a share, not a majority: auto adds the host time it measures per kind of step, and a
    # heads step's is the dearest, so the share moves with the machine's load: 209 of 342
    # steps on a quiet machine, 144 of 382 during a full test run)
    assert with_heads > sum(picked.values()) / 4, picked
    assert tokens / calls > 1.5, tokens / calls


def test_heads_sampling_matches_model_distribution(trained, stories_refs):
    from test_lossless import SAMPLING, _chi_square_p, _exact_joint

    hf, prompts, _ = stories_refs
    pkg, _ = trained
    ids = prompts[2]
    joint = _exact_joint(hf, ids)
    config = GenerationConfig(drafter="heads", bc=10, max_new_tokens=3, **SAMPLING)
    assert _chi_square_p(_ort(pkg), ids, joint, config) > 1e-3


# -- errors and the command line -------------------------------------------------------------


def _cli(*argv):
    return subprocess.run([sys.executable, "-m", "edgemtp.cli", *argv], capture_output=True,
                          text=True, timeout=300)


@pytest.mark.parametrize("which", ["no-hidden", "no-heads"])
def test_package_without_heads_is_one_line_and_exit_2(which, stories_pkg, hidden_pkg):
    pkg = stories_pkg if which == "no-hidden" else hidden_pkg
    r = _cli("generate", "--model", str(pkg), "--prompt", "Once upon a time",
             "--drafter", "heads", "--max-new-tokens", "8")
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "no learned heads" in lines[0] and "train-heads" in lines[0]


def test_heads_on_the_torch_backend_is_one_clear_error(stories_path):
    from edgemtp.errors import ConfigError
    from edgemtp.runtimes.torch_backend import TorchBackend

    with pytest.raises(ConfigError, match="no package"):
        Generation(TorchBackend(stories_path), GenerationConfig(drafter="heads"), [1, 2])


@pytest.mark.slow  # ~11 s; test_heads_equal_transformers_greedy[10-torch] covers the backend
def test_heads_on_the_torch_backend_from_a_package(trained, stories_refs, tmp_path):
    """``--backend torch`` on a package runs the model it was exported from, with the
    package's learned heads: the heads drafter (and the hybrid with heads) equals
    transformers greedy there too. A package whose source is not on this machine is one
    clear error."""
    from edgemtp.errors import ModelLoadError
    from edgemtp.runtimes.torch_backend import TorchBackend

    hf, prompts, refs = stories_refs
    pkg, _ = trained
    backend = TorchBackend(str(pkg))
    assert backend.package is not None and backend.source == str(STORIES.resolve())
    for drafter, kind in (("heads", "residual"), ("heads", "medusa"), ("hybrid", "residual")):
        config = GenerationConfig(drafter=drafter, heads=kind, bc=10, max_new_tokens=128)
        calls = tokens = 0
        for i, (ids, ref) in enumerate(zip(prompts[:3], refs)):
            r = Generation(backend, config, ids).run()
            assert r.token_ids == ref, f"torch {drafter} {kind}: prompt {i} differs"
            calls, tokens = calls + r.stats.forward_calls, tokens + r.stats.new_tokens
        assert tokens / calls > 1.2, (drafter, kind, tokens / calls)
    moved = tmp_path / "moved"
    shutil.copytree(pkg, moved)
    raw = json.loads((moved / "edgemtp.json").read_text())
    raw["source"] = "/nowhere/stories260K"
    (moved / "edgemtp.json").write_text(json.dumps(raw))
    with pytest.raises(ModelLoadError, match="exported from '/nowhere/stories260K', which is "
                                             "not on this machine"):
        TorchBackend(str(moved))
    r = _cli("generate", "--model", str(moved), "--backend", "torch", "--prompt", "Once")
    assert r.returncode == 2 and "not on this machine" in r.stderr
    assert "Traceback" not in r.stderr


def test_heads_option_needs_the_heads_drafter():
    from edgemtp.errors import ConfigError

    with pytest.raises(ConfigError, match="only applies to drafter='heads', 'hybrid' or 'auto'"):
        GenerationConfig(drafter="probe", heads="medusa")
    with pytest.raises(ConfigError, match="medusa or residual"):
        GenerationConfig(drafter="heads", heads="eagle")


def test_inspect_lists_the_heads_with_their_training(trained):
    pkg, infos = trained
    r = _cli("inspect", str(pkg))
    assert r.returncode == 0, r.stderr
    lines = [line for line in r.stdout.splitlines() if line.startswith("heads")]
    assert len(lines) == 2
    for line, (kind, info) in zip(lines, infos.items()):
        assert kind in line and f"{info.training.steps} steps" in line and "loss" in line
    manifest = json.loads((pkg / "edgemtp.json").read_text())
    # (the prompts --max-prompts kept, qa9 D5: it said 24-47 whatever the count)
    n = SHORT["max_prompts"]
    assert manifest["heads"][0]["training"]["data"].startswith(f"story prompts 24-{23 + n} ")


def test_runner_through_the_public_binding_gives_the_same_candidates(trained):
    """The runner calls onnxruntime's C++ session where it can reach it; through the public
    ``run_with_iobinding`` (a session object without that attribute) it gives the same ids
    and log-probs."""
    from edgemtp.runtimes.heads import HeadsRunner
    from edgemtp.runtimes.package import load_package

    pkg, _ = trained
    package = load_package(pkg)
    fast = HeadsRunner.load(package, "residual", k=10, native=False)  # onnxruntime runs it

    class PublicOnly:  # the real session, its C++ object out of reach
        def __init__(self, s):
            self._s = s

        def __getattr__(self, name):
            if name == "_sess":
                raise AttributeError(name)
            return getattr(self._s, name)

    public = HeadsRunner(fast.info, PublicOnly(fast.session), fast.lm_head, fast.vocab, 10)
    rng = np.random.default_rng(0)
    for _ in range(3):
        h = rng.standard_normal(fast.lm_head.shape[1]).astype(np.float32)
        a, b = fast.run(h, 7), public.run(h, 7)
        np.testing.assert_array_equal(a[0], b[0])
        np.testing.assert_array_equal(a[1], b[1])


def test_the_hybrid_with_heads_takes_a_measured_tree_cost(trained, stories_refs):
    # (the review's: it handed tree_cost="measured" on to its heads drafter, which refused it)
    _, prompts, refs = stories_refs
    pkg, _ = trained
    backend = _ort(pkg)
    config = GenerationConfig(drafter="hybrid", heads="residual", bc=30, tree_cost="measured",
                              max_new_tokens=128)
    for ids, ref in zip(prompts[:2], refs):
        assert Generation(backend, config, ids).run().token_ids == ref


# -- a package's heads as files: written whole, checked per kind ----------------------------


def _copy(trained, tmp_path):
    pkg, _ = trained
    out = tmp_path / "copy"
    shutil.copytree(pkg, out)
    return out


def _heads_run(pkg, kind):
    from edgemtp import Model

    model = Model.load(str(pkg), backend="onnxruntime", threads=1)
    return model.generate("Once upon a time", drafter="heads" if kind else "none",
                          heads=kind, bc=10, max_new_tokens=16).token_ids


@pytest.mark.parametrize("damage", ["truncated", "missing"])
def test_a_broken_heads_file_stops_only_its_own_kind(trained, tmp_path, damage):
    """Heads are optional: a damaged heads file (a copy cut short, a file left behind) stopped
    plain decoding, the other kind, inspect and train-heads itself, with 're-export the
    package', which would throw away every trained head."""
    from edgemtp.errors import ModelLoadError

    pkg = _copy(trained, tmp_path)
    want = {kind: _heads_run(pkg, kind) for kind in (None, "medusa")}
    f = pkg / "heads" / "residual.onnx"
    if damage == "missing":
        f.unlink()
    else:
        f.write_bytes(f.read_bytes()[:1000])
    assert {kind: _heads_run(pkg, kind) for kind in (None, "medusa")} == want
    with pytest.raises(ModelLoadError, match=r"residual heads file .*; train them again: "
                                             rf"edgemtp train-heads {pkg} --kind residual$"):
        _heads_run(pkg, "residual")
    r = _cli("inspect", str(pkg))
    assert r.returncode == 0, r.stderr
    assert "unusable: " in r.stdout and "--kind residual" in r.stdout
    r = _cli("generate", "--model", str(pkg), "--prompt", "Once", "--drafter", "heads",
             "--heads", "residual", "--max-new-tokens", "4")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_a_retraining_that_fails_leaves_the_heads_as_they_were(trained, tmp_path, monkeypatch):
    """train-heads writes a kind's files in a staging folder and moves them in with the
    manifest: a run stopped or failing before then (it wrote heads/<kind>.onnx in place, then
    failed its check or was interrupted, and the manifest no longer matched) leaves the old
    heads running; the next run replaces them and leaves nothing behind."""
    from edgemtp.export import heads as export
    from edgemtp.export.heads import TrainOptions, train_heads, work_folder

    pkg = _copy(trained, tmp_path)
    before = {p.name: p.read_bytes() for p in (pkg / "heads").iterdir()}
    manifest = (pkg / "edgemtp.json").read_text()
    want = _heads_run(pkg, "residual")

    def broken(*args, **kwargs):
        raise RuntimeError("stopped after the new heads graph was written")

    monkeypatch.setattr(export, "plot_loss", broken)
    work = work_folder(trained[0])  # the trained package's generations, reused
    opt = TrainOptions(kind="residual", **{**SHORT, "steps": 20})
    with pytest.raises(RuntimeError, match="stopped after"):
        train_heads(pkg, opt, work=work, progress=False)
    assert (pkg / "edgemtp.json").read_text() == manifest
    assert {p.name: p.read_bytes() for p in (pkg / "heads").iterdir()
            if not p.name.startswith(".")} == before
    assert _heads_run(pkg, "residual") == want
    monkeypatch.undo()
    info = train_heads(pkg, opt, work=work, progress=False)
    assert info.training.steps == 20 and not list((pkg / "heads").glob(".*"))
    # the generations were an earlier run's: said so, not as this run's minutes
    assert info.training.gen_reused and "generations reused (they took" in info.summary()
    assert next(h for h in load_package(pkg).meta.heads if h.kind == "residual").training.gen_reused
    assert load_package(pkg).heads_problem(info) is None
    assert _heads_run(pkg, "residual") == _heads_run(pkg, None)[:len(want)]


@pytest.mark.parametrize("option, value", [("vocab", 1), ("vocab", 0), ("max_prompts", 0),
                                           ("max_prompts", -1)])
def test_train_options_refuse_what_would_fail_or_misread(option, value):
    from edgemtp.errors import ConfigError
    from edgemtp.export.heads import TrainOptions

    with pytest.raises(ConfigError, match=f"--{option.replace('_', '-')} must be an integer"):
        TrainOptions(**{option: value})


def test_chat_with_heads_the_package_lacks_is_refused_at_start(hidden_pkg, tmp_path):
    """It printed the error at every turn and exited 0 at the end of input."""
    from test_chat import CHATML

    pkg = tmp_path / "chat"
    shutil.copytree(hidden_pkg, pkg)
    (pkg / "chat_template.jinja").write_text(CHATML)
    r = subprocess.run([sys.executable, "-m", "edgemtp.cli", "chat", str(pkg), "--drafter",
                        "heads"], input="hi\nhello\n", capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "has no learned heads" in lines[0] and r.stdout == "", r.stderr


def test_bench_and_profile_of_heads_a_package_lacks_say_just_that(hidden_pkg, tmp_path):
    """It read "--bc 10 is more than this package can run for heads: it the package ... has
    no learned heads ...; re-export the package with --bc 10"."""
    r = _cli("bench", "--model", str(hidden_pkg), "--drafters", "heads", "--bc", "10",
             "--sets", "stories", "--per-set", "1", "--repeats", "1", "--max-new-tokens", "8",
             "--no-hf-reference", "--threads", "1", "--out", str(tmp_path / "b"))
    assert r.returncode == 2, r.stderr
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith("edgemtp: error: --drafters heads: the package") and \
        "has no learned heads" in line and "--bc" not in line and "re-export" not in line, line


def test_bench_runs_each_heads_kind_with_every_drafter_that_takes_heads(trained, tmp_path):
    """The README's "hybrid + residual heads" and "heads medusa" rows, from edgemtp bench
    (it had no --heads: heads ran the package's first kind, the hybrid none)."""
    pkg, _ = trained
    r = _cli("bench", "--model", str(pkg), "--drafters", "heads,hybrid,pld", "--heads",
             "residual,medusa", "--bc", "10", "--sets", "stories", "--per-set", "1",
             "--repeats", "1", "--max-new-tokens", "24", "--no-hf-reference", "--threads", "1",
             "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    data = json.loads((tmp_path / f"bench_{pkg.name}_onnxruntime.json").read_text())
    rows = {row["method"]: row for row in data["rows"]}
    assert set(rows) == {"greedy", "heads residual", "heads medusa", "hybrid residual",
                         "hybrid medusa", "pld"}
    assert all(row["lossless"] for row in rows.values()) and data["failures"] == []
    assert rows["heads residual"]["block_efficiency"] > 1.5
    bad = _cli("bench", "--model", str(pkg), "--heads", "eagle", "--out", str(tmp_path / "x"))
    assert bad.returncode == 2 and "--heads must be one or more of medusa, residual" in bad.stderr


@pytest.mark.slow  # (a training subprocess interrupted: ~9 s of the default run; CI runs it)
def test_ctrl_c_in_train_heads_keeps_the_package_and_says_how_to_resume(hidden_pkg, tmp_path):
    import signal
    import time

    pkg, work = tmp_path / "pkg", tmp_path / "work"
    shutil.copytree(hidden_pkg, pkg)
    manifest = (pkg / "edgemtp.json").read_text()
    argv = [sys.executable, "-m", "edgemtp.cli", "train-heads", str(pkg), "--kind", "residual",
            "--max-prompts", "2", "--repeats", "1", "--bos-samples", "2", "--new-tokens", "16",
            "--steps", "100000", "--threads", "1", "--quiet", "--work", str(work)]
    # (a pytest-xdist worker ignores SIGINT, and its children inherit that: restore it)
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 240
    while proc.poll() is None and time.monotonic() < deadline and not list(
            work.glob("cache_*[0-9].npz")):
        time.sleep(0.05)
    time.sleep(1.0)  # training
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    # (it ended by the signal itself, rc -2, in ~1 run of 3 once: see entry() in cli.py)
    assert proc.returncode == 130 and "Traceback" not in err, (proc.returncode, err[-2000:])
    assert err.strip().splitlines()[-1] == (
        f"edgemtp: interrupted; the package's heads are whole (new ones are moved in only when "
        f"complete), and the generations and checkpoints so far are kept in {str(work)!r}: run "
        f"the same command again to resume")
    assert (pkg / "edgemtp.json").read_text() == manifest
    assert not (pkg / "heads").exists() or not [p for p in (pkg / "heads").iterdir()
                                                if not p.name.startswith(".")]


def test_train_heads_threads_default_to_edgemtp_threads(hidden_pkg):
    """Its --threads defaulted to 2 whatever $EDGEMTP_THREADS said (~20x slower than 1 thread
    on a 2-core machine busy with other work, QA heads D11)."""
    import os

    r = subprocess.run([sys.executable, "-m", "edgemtp.cli", "train-heads", str(hidden_pkg)],
                       capture_output=True, text=True, timeout=120,
                       env={**os.environ, "EDGEMTP_THREADS": "zero"})
    assert r.returncode == 2 and r.stderr.strip() == (
        "edgemtp: error: EDGEMTP_THREADS must be a positive integer, got 'zero'"), r.stderr
