"""The torch backend's static KV cache (in-place writes, fixed step shapes, one StepGraph per
shape: a CUDA graph on a GPU, the same code eagerly here) against the reference session that
concatenates past and block K/V, step by step and over whole generations."""

import subprocess
import sys

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import QUICK, family_configs
from edgemtp.config import GenerationConfig
from edgemtp.engine import Generation
from edgemtp.plans import Plan, dynamic_plans
from edgemtp.runtimes.torch_backend import PAD_TO, SLACK, ConcatSession, TorchBackend, TorchSession


def _pair(hf, max_context=None):
    static = TorchBackend.from_model(hf, max_context=max_context)
    reference = TorchBackend.from_model(hf, max_context=max_context, static_cache=False)
    return static, reference


def _same(a, b, what):
    np.testing.assert_array_equal(a.argmax, b.argmax, err_msg=what)
    np.testing.assert_array_equal(a.topk_ids, b.topk_ids, err_msg=what)
    np.testing.assert_allclose(a.topk_logprobs, b.topk_logprobs, atol=2e-5, err_msg=what)
    np.testing.assert_allclose(a.logits, b.logits, atol=2e-5, err_msg=what)
    np.testing.assert_allclose(a.hidden, b.hidden, atol=2e-5, err_msg=what)


def _steps(static, reference, prompt_len, rng, steps=6, bc=30, k=1):
    """Prefill then tree steps with the plans' masks and random accepted paths; both
    sessions see the same blocks and commits; outputs compared at every step."""
    s, r = static.session(), reference.session()
    assert isinstance(s, TorchSession) and isinstance(r, ConcatSession)
    vocab, d = static.vocab_size, static.hidden_size
    ids = rng.integers(0, vocab, size=prompt_len)
    ids = np.concatenate([ids, vocab + np.arange(k)])
    causal = np.tril(np.ones((len(ids), len(ids)), dtype=bool))
    embeds = rng.normal(size=(k, d)).astype(np.float32)
    args = dict(topk=4, full_logits=True, hidden=True)
    _same(s.forward(ids, np.arange(len(ids)), causal, embeds, **args),
          r.forward(ids, np.arange(len(ids)), causal, embeds, **args), "prefill")
    for sess in (s, r):
        sess.commit(np.arange(prompt_len))
    plans = list(dynamic_plans(bc, k).table.values())
    for step in range(steps):
        plan = plans[(7 * step) % len(plans)]
        t = plan.bc
        block = rng.integers(0, vocab + k, size=t)
        pos = plan.positions + s.cache_len
        out = s.forward(block, pos, plan.tree_mask, embeds, **args)
        _same(out, r.forward(block, pos, plan.tree_mask, embeds, **args), f"step {step}")
        # an accepted path: the root, then a walk down the plan's parents
        node, path = int(rng.integers(0, plan.n_nodes)), []
        while node > 0:
            path.append(node)
            node = int(plan.parents[node])
        path = np.array([0, *reversed(path)], dtype=np.int64)
        if s.cache_len + len(path) > static.max_context:
            break
        for sess in (s, r):
            sess.commit(path)
        assert s.cache_len == r.cache_len
    return s, r


@pytest.mark.parametrize("family", ["llama3", "qwen2", "qwen3", "mistral"])
def test_static_steps_equal_the_reference_session(family):
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(family_configs()[family]).eval()
    static, reference = _pair(hf)
    rng = np.random.default_rng(3)
    # 90 prompt rows: the padded prefill (T > PAD_TO); then k = 1 and k = 2 tree steps
    s, _ = _steps(static, reference, 90, rng, bc=30, k=1)
    assert {g.t for g in s._graphs.values()} >= {2 * PAD_TO, 30}
    _steps(static, reference, 5, rng, bc=60, k=2)


def test_block_buckets_pad_blocks_to_powers_of_two_and_stay_exact(stories_refs):
    """``block_buckets`` (on by default where CUDA graphs run, forced here): a block of up to
    64 rows runs padded to the next power of two, its padding rows invisible and never
    committed; every step still equals the reference session, and whole generations of the
    tree drafters equal transformers' greedy."""
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(family_configs()["qwen3"]).eval()
    assert not TorchBackend.from_model(hf).block_buckets  # CPU: off unless asked
    static = TorchBackend.from_model(hf, block_buckets=True)
    reference = TorchBackend.from_model(hf, static_cache=False)
    rng = np.random.default_rng(5)
    s, _ = _steps(static, reference, 90, rng, steps=8, bc=30, k=1)
    shapes = {g.t for g in s._graphs.values()}
    assert shapes <= {1, 2, 4, 8, 16, 32, 64, 2 * PAD_TO} and 32 in shapes, shapes
    hf, prompts, refs = stories_refs
    backend = TorchBackend.from_model(hf, block_buckets=True)
    session = backend.session()
    runs = []
    for drafter, bc in (("stand", 10), ("hybrid", 30), ("probe", 60)):
        config = GenerationConfig(max_new_tokens=64, bc=bc, drafter=drafter)
        for ids, ref in zip(prompts[:2], refs[:2]):
            out = Generation(backend, config, ids, session=session).run()
            assert out.token_ids == ref[:64], (drafter, bc)
            runs.append(out)
    assert {g.t for g in session._graphs.values()} <= {1, 2, 4, 8, 16, 32, 64}
    # the backend counts each step shape at its first (eager) use, once: the benches set
    # these beside a step's time; no graph is captured where CUDA is absent
    ev = backend.graph_events
    assert ev["shapes"] == len(session._graphs) > 0 and ev["shape_s"] > 0, ev
    assert ev["captures"] == 0 and ev["capture_s"] == 0, ev
    # and its time inside each decode step (the prefill's first block left out): no device
    # to wait for here, the step's work all in "run"
    st = backend.step_seconds
    steps = sum(r.stats.forward_calls - 1 for r in runs)
    assert st["steps"] == steps > 0 and st["wait"] == 0, st
    assert st["run"] > st["load"] > 0 and st["read"] > 0, st


def test_a_dropped_session_frees_its_step_graphs_at_once():
    """No reference cycle between a session and its step graphs: on a GPU a cycle left
    sessions (and their CUDA graphs) to Python's cycle collector, which ran inside another
    graph's capture and invalidated it (an H200, a latency measurement's dropped session)."""
    import gc
    import weakref

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(family_configs()["llama3"]).eval()
    backend = TorchBackend.from_model(hf, max_context=64)
    session = backend.session()
    for t in (5, 1, 3):
        ids = np.arange(t) % backend.vocab_size
        session.forward(ids, session.cache_len + np.arange(t),
                        np.tril(np.ones((t, t), dtype=bool)), None, topk=2)
        session.commit(np.arange(t))
    graphs = [weakref.ref(g) for g in session._graphs.values()]
    dropped = weakref.ref(session)
    enabled = gc.isenabled()
    gc.disable()
    try:
        del session
        assert dropped() is None and all(g() is None for g in graphs)
    finally:
        if enabled:
            gc.enable()


def test_static_cache_is_written_in_place_and_grows_for_long_blocks():
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(family_configs()["llama3"]).eval()
    static, reference = _pair(hf, max_context=120)
    s, r = static.session(), reference.session()
    ptr, rows = s.k_cache.data_ptr(), s.rows
    assert rows == 120 + SLACK
    rng = np.random.default_rng(0)
    d = static.hidden_size
    for t in (40, 1, 1, 30):  # every step's K/V land in the same buffer
        ids = rng.integers(0, static.vocab_size, size=t)
        mask = np.tril(np.ones((t, t), dtype=bool))
        pos = s.cache_len + np.arange(t)
        _same(s.forward(ids, pos, mask, None, topk=2, full_logits=True, hidden=True),
              r.forward(ids, pos, mask, None, topk=2, full_logits=True, hidden=True), f"T={t}")
        s.commit(np.arange(t))
        r.commit(np.arange(t))
    assert s.k_cache.data_ptr() == ptr
    # a block of 100 rows (padded to 128) after 72 cached ones needs 200 > 184 rows: the
    # cache grows, keeps its committed rows, and the step still equals the reference
    t = 100
    ids = rng.integers(0, static.vocab_size, size=t)
    mask = np.tril(np.ones((t, t), dtype=bool))
    pos = s.cache_len + np.arange(t)
    embeds = rng.normal(size=(1, d)).astype(np.float32)
    _same(s.forward(ids, pos, mask, embeds, topk=2, full_logits=True, hidden=True),
          r.forward(ids, pos, mask, embeds, topk=2, full_logits=True, hidden=True), "grown")
    assert s.rows > rows and s.k_cache.data_ptr() != ptr


@pytest.mark.slow
def test_step_shapes_are_reused_on_cpu_as_eager_code(stories_path, stories_refs):
    hf, prompts, refs = stories_refs
    backend = TorchBackend(stories_path)
    assert backend.static_cache and not backend.cuda_graphs  # no CUDA here: eager replays
    session = backend.session()
    for ids, ref in zip(prompts[:QUICK // 2], refs[:QUICK // 2]):
        for bc in (10, 30, 60):
            config = GenerationConfig(max_new_tokens=128, bc=bc, drafter="probe")
            out = Generation(backend, config, ids, session=session).run()
            assert out.token_ids == ref, bc
    # one StepGraph per (block size, cache bucket, mask slots, top-K): few shapes, many uses
    graphs = list(session._graphs.values())
    assert all(g.graph is None for g in graphs)
    assert sum(g.uses for g in graphs) > 10 * len(graphs)
    assert {g.width % backend.bucket for g in graphs if g.width < session.rows} == {0}


def test_batch_invariant_runs_every_step_as_one_shape_and_stays_lossless(stories_path,
                                                                        stories_refs):
    """Every step of up to PAD_TO rows (plain decoding's single row too) is padded to PAD_TO
    rows: one matrix shape for all, the padding rows invisible to the real ones."""
    hf, prompts, refs = stories_refs
    backend = TorchBackend.from_model(hf, batch_invariant=True)
    session = backend.session()
    for drafter, bc in (("none", 1), ("probe", 10), ("hybrid", 60)):
        config = GenerationConfig(max_new_tokens=64, bc=max(bc, 10), drafter=drafter)
        for ids, ref in zip(prompts[:2], refs[:2]):
            out = Generation(backend, config, ids, session=session).run()
            assert out.token_ids == ref[:64], drafter
    shapes = {g.t for g in session._graphs.values()}
    assert shapes == {PAD_TO}, shapes  # prompts are shorter than PAD_TO: prefill too
    with pytest.raises(Exception, match="static cache"):
        TorchBackend.from_model(hf, batch_invariant=True, static_cache=False)


@pytest.mark.slow  # ~70 s on 2 cores (float64 attention in fp16 on the CPU): CI runs it
def test_batch_invariant_fp16_speculation_equals_its_plain_decoding():
    """fp16 on CPU shows what fp16 GPU kernels do: a row's logits in a block differ in the
    last bits from the same row alone, and on a random-weight model (flat distributions,
    near-ties everywhere) that flips tokens. With every step one shape and the attention
    summed in float64, every drafter equals plain decoding run the same way."""
    import transformers

    cfg = transformers.LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                   vocab_size=8192, max_position_embeddings=1024,
                                   initializer_range=0.02, bos_token_id=1, eos_token_id=None,
                                   pad_token_id=0)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(cfg).to(torch.float16).eval()
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 8192, size=24).tolist() for _ in range(4)]

    def outputs(backend, drafter, bc=10):
        config = GenerationConfig(max_new_tokens=100, bc=bc, drafter=drafter)
        return [Generation(backend, config, p).run().token_ids for p in prompts]

    loose = TorchBackend.from_model(hf, max_context=512)
    same = sum(a == b for a, b in zip(outputs(loose, "probe"), outputs(loose, "none")))
    assert same < len(prompts), "no fp16 divergence left to fix here: pick another seed"
    exact = TorchBackend.from_model(hf, max_context=512, batch_invariant=True)
    assert exact.decoder.exact_attention
    plain = outputs(exact, "none")
    for drafter, bc in (("probe", 10), ("hybrid", 30)):
        assert outputs(exact, drafter, bc) == plain, drafter


def test_a_step_graph_reloads_a_changed_mask_and_keeps_a_plans():
    """A step's mask is written into the step shape's buffer only when it is not the plan mask
    already there: a writable mask changed in place is read again (and gives the reference
    session's rows), a plan's read-only one is kept, and a padded shape's padding rows still
    see only themselves after a smaller block."""
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(family_configs()["llama3"]).eval()
    static = TorchBackend.from_model(hf, block_buckets=True)
    reference = TorchBackend.from_model(hf, static_cache=False)
    s, r = static.session(), reference.session()
    rng = np.random.default_rng(3)
    prompt = rng.integers(0, static.vocab_size, size=20)
    causal = np.tril(np.ones((20, 20), dtype=bool))
    for sess in (s, r):
        sess.forward(prompt, np.arange(20), causal, None)
        sess.commit(np.arange(20))
    ids = rng.integers(0, static.vocab_size, size=4)
    pos = 20 + np.array([0, 1, 1, 2])
    mask = np.tril(np.ones((4, 4), dtype=bool))  # writable: a caller's own
    first = s.forward(ids, pos, mask, None, topk=3)
    mask[2, 1] = False  # row 2 a sibling of row 1 now, not its child
    second = s.forward(ids, pos, mask, None, topk=3)
    want = r.forward(ids, pos, mask, None, topk=3)
    _same_rows = np.testing.assert_array_equal
    _same_rows(second.argmax, want.argmax)
    np.testing.assert_allclose(second.topk_logprobs, want.topk_logprobs, atol=2e-5)
    assert not np.allclose(first.topk_logprobs[2], second.topk_logprobs[2])
    big, full = Plan.top1((2,), 1), Plan.top1((3,), 1)  # 6 rows (padded to 8), and 8
    for plan in (big, big, full, big):
        t = plan.bc
        block = rng.integers(0, static.vocab_size + 1, size=t)
        embeds = rng.normal(size=(1, static.hidden_size)).astype(np.float32)
        got = s.forward(block, plan.positions + 20, plan.tree_mask, embeds, topk=3)
        ref = r.forward(block, plan.positions + 20, plan.tree_mask, embeds, topk=3)
        _same_rows(got.argmax, ref.argmax)
        np.testing.assert_allclose(got.topk_logprobs, ref.topk_logprobs, atol=2e-5)
    (g,) = [g for g in s._graphs.values() if g.t == 8]
    m = g.mask.numpy()  # after the 8-row block, the 6-row plan's padding again
    assert m[:6, :6].tolist() == big.tree_mask.tolist()
    assert m[6:, 6:].tolist() == np.eye(2, dtype=bool).tolist()
    assert not m[6:, :6].any() and not m[:6, 6:].any()


@pytest.mark.parametrize("vocab, k, chunks", [(512, 4, 64), (49152, 16, 64), (1000, 8, 7),
                                             (100, 30, 8)])
def test_chunked_top_k_is_torch_topk(vocab, k, chunks):
    """The two-stage top-K (slices of the row, then their candidates) gives torch.topk's
    values and ids, with a vocabulary the slices do not divide (padded) and a k larger than
    a slice (one stage)."""
    from edgemtp.runtimes.torch_backend import chunked_topk

    g = torch.Generator().manual_seed(vocab + k)
    x = torch.log_softmax(torch.randn(5, vocab, generator=g), -1)  # no ties (float32 normals)
    want = x.topk(k, -1)
    got = chunked_topk(x, k, chunks)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_a_step_with_a_two_stage_top_k_gives_the_same_outputs(stories_refs, monkeypatch):
    """A backend whose steps take their top-K in two stages (topk_chunks) gives the same
    argmax, top-K ids and log-probabilities as one torch.topk, and the same generations."""
    import edgemtp.runtimes.torch_backend as tb

    calls = []
    real = tb.chunked_topk
    monkeypatch.setattr(tb, "chunked_topk", lambda *a: calls.append(a[1:]) or real(*a))
    hf, prompts, refs = stories_refs
    one = TorchBackend.from_model(hf)
    two = TorchBackend.from_model(hf)
    two.topk_chunks = 16
    rng = np.random.default_rng(0)
    ids = rng.integers(0, one.vocab_size, size=12)
    causal = np.tril(np.ones((12, 12), dtype=bool))
    a = one.session().forward(ids, np.arange(12), causal, None, topk=8)
    b = two.session().forward(ids, np.arange(12), causal, None, topk=8)
    np.testing.assert_array_equal(a.argmax, b.argmax)
    np.testing.assert_array_equal(a.topk_ids, b.topk_ids)
    np.testing.assert_array_equal(a.topk_logprobs, b.topk_logprobs)
    config = GenerationConfig(max_new_tokens=48, bc=30, drafter="hybrid")
    out = Generation(two, config, prompts[0]).run()
    assert out.token_ids == refs[0][:48]
    assert calls and all(c == 16 for _, c in calls)  # the two-stage path ran, only there


def test_full_attention_span_gives_one_shape_per_block_size_and_the_same_tokens(
        stories_path, stories_refs, monkeypatch):
    """EDGEMTP_ATTENTION_SPAN=full: every step attends over the whole cache (the columns past
    the committed rows masked), so its shape does not depend on the cache's length and a
    generation's CUDA graphs are all met by its first steps; outputs are transformers' greedy
    as with the default buckets, which span the cache in pieces (several widths here)."""
    hf, prompts, refs = stories_refs
    default = TorchBackend.from_model(hf, block_buckets=True, max_context=256)
    monkeypatch.setenv("EDGEMTP_ATTENTION_SPAN", "full")
    full = TorchBackend.from_model(hf, block_buckets=True, max_context=256)
    # a latency curve measured over one span is not read back for another
    assert "span=full|" in TorchBackend(stories_path).identity()
    widths = {}
    for name, backend in (("default", default), ("full", full)):
        session = backend.session()
        for drafter, bc in (("none", 1), ("hybrid", 30)):
            config = GenerationConfig(max_new_tokens=100, bc=max(bc, 10), drafter=drafter)
            for ids, ref in zip(prompts[:2], refs[:2]):
                out = Generation(backend, config, ids, session=session).run()
                assert out.token_ids == ref[:100], (name, drafter)
        widths[name] = {g.width for g in session._graphs.values()}
        if name == "full":
            assert widths[name] == {session.rows}, widths
            assert len(session._graphs) == len({(g.t, g.embeds.shape[0], g.topk)
                                               for g in session._graphs.values()})
    assert len(widths["default"]) > 1, widths  # the default did span the cache in pieces
    for bad in ("100", "0", "half"):
        monkeypatch.setenv("EDGEMTP_ATTENTION_SPAN", bad)
        with pytest.raises(Exception, match="multiple of 64 cached rows, 'doubling' or 'full'"):
            TorchBackend.from_model(hf)


def test_batch_invariant_on_another_backend_is_one_line_and_exit_2(stories_pkg):
    run = subprocess.run([sys.executable, "-m", "edgemtp.cli", "generate", "--model",
                          stories_pkg, "--batch-invariant", "--prompt", "Once",
                          "--max-new-tokens", "4"], capture_output=True, text=True, timeout=120)
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 2 and len(lines) == 1, run.stderr
    assert "option of the torch backend" in lines[0]


def test_cuda_without_a_gpu_is_one_line_and_exit_2(stories_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    for backend in ("torch",):
        run = subprocess.run([sys.executable, "-m", "edgemtp.cli", "generate", "--model",
                              stories_path, "--backend", backend, "--device", "cuda",
                              "--prompt", "Once", "--max-new-tokens", "4"],
                             capture_output=True, text=True, timeout=120)
        assert run.returncode == 2, run.stderr
        lines = run.stderr.strip().splitlines()
        assert len(lines) == 1 and "no CUDA device" in lines[0], run.stderr
        assert "Traceback" not in run.stderr
    with pytest.raises(Exception, match="no CUDA device"):
        TorchBackend.from_model(stories_refs_model(stories_path), device="cuda")


def stories_refs_model(path):
    return AutoModelForCausalLM.from_pretrained(path)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_one_kernel_rms_norm_matches_transformers(dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    from edgemtp.models.static_decoder import rms_norm

    torch.manual_seed(0)
    for cls in (LlamaRMSNorm, Qwen3RMSNorm):
        norm = cls(96, eps=1e-5).to(dtype)
        norm.weight.data = torch.randn(96).to(dtype)
        for scale in (1e-3, 1.0, 50.0):
            x = (torch.randn(2, 5, 96) * scale).to(dtype)
            if dtype == torch.float32:
                assert torch.equal(rms_norm(norm, x), norm(x)), (cls.__name__, scale)
            else:  # one rounding instead of two: within about an ulp of transformers'
                torch.testing.assert_close(rms_norm(norm, x), norm(x))

    class Gemmaish(torch.nn.Module):  # any other norm is called as it is
        def forward(self, x):
            return x * 2

    x = torch.randn(3, 96).to(dtype)
    assert torch.equal(rms_norm(Gemmaish(), x), x * 2)


def test_fused_projections_share_the_weights(stories_path):
    """q/k/v and gate/up run as one matrix product each; the modules' own weights become
    views of the fused ones, so nothing is held twice and transformers still runs them."""
    hf = AutoModelForCausalLM.from_pretrained(stories_path).eval()
    ids = torch.tensor([[1, 300, 301, 302]])
    with torch.no_grad():
        before = hf(ids).logits
    backend = TorchBackend.from_model(hf)
    for layer, (w, b), (gu, _) in zip(hf.model.layers, backend.decoder.qkv,
                                      backend.decoder.gate_up):
        attn = layer.self_attn
        for lin in (attn.q_proj, attn.k_proj, attn.v_proj):
            assert lin.weight.untyped_storage().data_ptr() == w.untyped_storage().data_ptr()
        assert layer.mlp.up_proj.weight.untyped_storage().data_ptr() == \
            gu.untyped_storage().data_ptr()
        assert w.shape[0] == attn.q_proj.out_features + 2 * attn.k_proj.out_features
    with torch.no_grad():
        assert torch.equal(hf(ids).logits, before)


def test_the_float32_logits_head_falls_back_where_torch_cannot():
    """On a GPU in float16/bfloat16 the LM head writes float32 logits (torch.mm's out_dtype,
    CUDA only): off on CPU; asked for here anyway, the first step finds the overload missing,
    turns it off and gives the model's own head's logits, the same as never asking."""
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(family_configs()["llama3"]).eval()
    plain = TorchBackend.from_model(hf)
    assert not plain.decoder.fp32_logits
    forced = TorchBackend.from_model(hf)
    forced.decoder.fp32_logits = True
    ids = np.arange(7) % plain.vocab_size
    causal = np.tril(np.ones((7, 7), dtype=bool))
    a = plain.session().forward(ids, np.arange(7), causal, None, topk=4, full_logits=True)
    b = forced.session().forward(ids, np.arange(7), causal, None, topk=4, full_logits=True)
    assert not forced.decoder.fp32_logits
    np.testing.assert_array_equal(a.logits, b.logits)
    np.testing.assert_array_equal(a.topk_ids, b.topk_ids)


def test_doubling_spans_cross_1024_rows_as_one_new_width_and_equal_the_reference(monkeypatch):
    """EDGEMTP_ATTENTION_SPAN=doubling (the CUDA default): a step attends over the next power
    of two rows (at least 1024), the columns past the cache and block masked; its outputs
    equal the reference session's on both sides of 1024 rows, and a latency measurement's
    smaller session spans what a full one does."""
    monkeypatch.setenv("EDGEMTP_ATTENTION_SPAN", "doubling")
    torch.manual_seed(0)
    config = family_configs()["llama3"]
    config.max_position_embeddings = 4096
    hf = AutoModelForCausalLM.from_config(config).eval()
    static, reference = _pair(hf, max_context=3000)
    s, r = static.session(), reference.session()
    rng = np.random.default_rng(1)
    widths = []
    for t in (900, 60, 1, 64, 10):  # the cache: 0, 900, 960, 961, 1025 rows
        ids = rng.integers(0, static.vocab_size, size=t)
        mask = np.tril(np.ones((t, t), dtype=bool))
        pos = s.cache_len + np.arange(t)
        _same(s.forward(ids, pos, mask, None, topk=3, full_logits=True, hidden=True),
              r.forward(ids, pos, mask, None, topk=3, full_logits=True, hidden=True), f"T={t}")
        widths.append(sorted({g.width for g in s._graphs.values()}))
        s.commit(np.arange(t))
        r.commit(np.arange(t))
    # 900 + 64 and 961 + 64 rows: 1024; 961 + 64 = 1025 and 1025 + 16: 2048
    assert widths == [[1024], [1024], [1024], [1024, 2048], [1024, 2048]], widths
    sized = static.session(rows=961 + 16)  # (latency.measure_latency's: P + T + 1 rows)
    assert sized.rows == 1024 + SLACK
