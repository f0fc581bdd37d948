"""The ONNX Runtime backend on real exported packages: exact token equality of probing (BC
10/30/60, k 1/2, static and dynamic trees) against ``transformers`` greedy ``generate``, on
stories260K and on small random-initialised llama (Llama-3 rope scaling), qwen2, qwen3 and
mistral configs; plus the backend's own contract (top-K width, logits, device cache, errors).
"""

import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("onnxruntime")
pytest.importorskip("onnx")
transformers = pytest.importorskip("transformers")

from edgemtp import GenerationConfig, Model  # noqa: E402
from edgemtp.engine import Generation  # noqa: E402
from edgemtp.errors import BackendUnavailableError, ConfigError  # noqa: E402
from edgemtp.export.onnx_export import export_package  # noqa: E402
from edgemtp.runtimes.onnxrt_backend import OrtBackend  # noqa: E402

SHARED = Path(__file__).resolve().parents[1] / ".." / "shared"
STORIES = SHARED / "models" / "stories260K"
NEW_TOKENS = 128

# (bc, k, tree): every budget of the issue, static and dynamic (for k = 1 both are one shape)
PROBES = [(10, 1, "static"), (30, 1, "static"), (60, 1, "static"),
          (10, 2, "static"), (10, 2, "dynamic"), (30, 2, "static"), (30, 2, "dynamic"),
          (60, 2, "static"), (60, 2, "dynamic")]


def story_prompts(n: int) -> list[str]:
    with open(SHARED / "data" / "stories_prompts.jsonl") as f:
        return [json.loads(line)["prompt"] for line in f if line.strip()][:n]


def hf_greedy(model, prompts: list[list[int]], new_tokens: int = NEW_TOKENS) -> list[list[int]]:
    out = []
    with torch.no_grad():
        for ids in prompts:
            seq = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=new_tokens,
                                 attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 pad_token_id=model.config.pad_token_id or 0)
            out.append(seq[0, len(ids):].tolist())
    return out


def run(backend, prompts, **options) -> list[list[int]]:
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, **{"drafter": "probe", **options})
    return [Generation(backend, config, ids).run().token_ids for ids in prompts]


# -- stories260K --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stories_case(stories_pkg, stories_refs):
    _, prompts, refs = stories_refs  # transformers' own greedy generate, 128 new tokens
    return OrtBackend(stories_pkg, threads=1), prompts, refs


@pytest.mark.parametrize("n", [8, pytest.param(24, marks=pytest.mark.slow)])
def test_stories_greedy_equals_transformers(stories_case, n):
    # plain decoding on onnxruntime: 8 prompts in the default run, all 24 in the slow one
    backend, prompts, want = stories_case
    assert len(prompts) >= 24
    assert run(backend, prompts[:n], drafter="none") == want[:n]


@pytest.mark.slow
@pytest.mark.parametrize("bc,k,tree", PROBES, ids=[f"bc{b}-k{k}-{t}" for b, k, t in PROBES])
def test_stories_probe_equals_transformers(stories_case, bc, k, tree):
    backend, prompts, want = stories_case
    got = run(backend, prompts, bc=bc, mask_tokens=k, tree=tree)
    bad = [i for i, (g, w) in enumerate(zip(got, want)) if g != w]
    assert not bad, f"prompts {bad} differ from transformers greedy generate"


@pytest.mark.parametrize("drafter", ["pld", pytest.param("stand", marks=pytest.mark.slow),
                                     pytest.param("lade", marks=pytest.mark.slow), "hybrid"])
def test_stories_lookup_drafters_equal_transformers(stories_case, drafter):
    # LADE and the hybrid carry a lookahead window next to the tree: rows the graph runs
    # but the cache never keeps
    backend, prompts, want = stories_case
    for bc in (10, 60):
        got = run(backend, prompts[:8], drafter=drafter, bc=bc)
        bad = [i for i, (g, w) in enumerate(zip(got, want)) if g != w]
        assert not bad, f"{drafter} BC {bc}: prompts {bad} differ from transformers greedy"


def test_device_cache_path_matches_host_cache(stories_case, stories_pkg):
    # the CUDA / TensorRT cache path (OrtValues bound by pointer, commits by the package's
    # gather graph), exercised here on CPU memory
    backend, prompts, want = stories_case
    on_device = OrtBackend(stories_pkg, threads=1, device_cache=True)
    assert run(on_device, prompts[:4], bc=60, mask_tokens=2) == want[:4]
    assert run(on_device, prompts[:2], drafter="none") == want[:2]


def test_fixed_buffer_session_matches_transformers(stories_case, stories_pkg):
    # the CUDA-graph session (GraphSession: every input and output at a fixed address per
    # block shape, the past always the whole cache with past_len masking the unused rows),
    # run here uncaptured on CPU memory; the cache starts zeroed, so masked rows are finite
    from edgemtp.runtimes.onnxrt_backend import GraphSession

    _, prompts, want = stories_case
    backend = OrtBackend(stories_pkg, threads=1, device_cache=True)
    assert not backend.cuda_graphs and backend.past_len  # CPU: asked only for CUDA
    for opts in (dict(drafter="probe", bc=30), dict(drafter="hybrid", bc=30),
                 dict(drafter="none")):
        config = GenerationConfig(max_new_tokens=128, **opts)
        for ids, ref in zip(prompts[:2], want[:2]):
            session = GraphSession(backend)
            assert Generation(backend, config, ids, session=session).run().token_ids == ref
            assert len(session._shapes) <= 6  # (T, k) shapes: prefill, the plans', T = 1


def test_static_past_graph_holds_no_shape_nodes(stories_pkg, tmp_path):
    """The CUDA-graph session loads the graph with the past's rows fixed (``P``, the whole
    cache): onnxruntime then folds every shape computation away, T and k staying symbolic.
    A node computing a shape from an input's size runs on the CPU under the CUDA EP, and
    onnxruntime refuses a CUDA graph for a graph with any such node (H200: 18 of them)."""
    import onnx
    import onnxruntime as ort

    def shape_nodes(rows):
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
        so.optimized_model_filepath = str(tmp_path / f"opt{rows}.onnx")
        if rows:
            so.add_free_dimension_override_by_name("P", rows)
        ort.InferenceSession(str(Path(stories_pkg) / "model.onnx"), so,
                             providers=["CPUExecutionProvider"])
        graph = onnx.load(so.optimized_model_filepath, load_external_data=False).graph
        inputs = {i.name: [d.dim_param for d in i.type.tensor_type.shape.dim]
                  for i in graph.input}
        return sum(n.op_type == "Shape" for n in graph.node), inputs

    # the past's rows vary by bucket on the CPU path: read once, for every layer (the
    # exporter's ExportTreeDecoder._past_rows; one Shape node per layer before)
    assert shape_nodes(None)[0] == 1
    raw = onnx.load(str(Path(stories_pkg) / "model.onnx"), load_external_data=False).graph
    assert sum(n.op_type == "Shape" for n in raw.node) == 1
    count, inputs = shape_nodes(512)
    assert count == 0
    assert inputs["input_ids"][1] == "T" and inputs["mask_embeds"][0] == "k"


def test_static_past_session_matches_transformers(stories_case, stories_pkg):
    # the CUDA-graph path's session (past rows fixed at the whole cache) run on CPU memory
    from edgemtp.runtimes.onnxrt_backend import GraphSession

    _, prompts, want = stories_case
    backend = OrtBackend(stories_pkg, threads=1, static_past=True, max_context=256)
    session = backend.session()
    assert isinstance(session, GraphSession) and backend.commit_graph is not None
    for opts in (dict(drafter="probe", bc=30, mask_tokens=2), dict(drafter="hybrid", bc=30),
                 dict(drafter="none")):
        config = GenerationConfig(max_new_tokens=128, **opts)
        for ids, ref in zip(prompts[:2], want[:2]):
            assert Generation(backend, config, ids,
                              session=backend.session()).run().token_ids == ref, opts


def test_graph_ids_keep_their_buffers_across_generations(stories_case, stories_pkg):
    """A CUDA graph replays on the addresses it was captured with: every graph id the
    backend hands out must always come with the same bound buffers, whichever generation
    runs it, and two generations alive at once must not share ids or memory. (Each session
    used to number its graphs from 1 on buffers of its own: on an H100 the second
    generation replayed the first one's captures onto freed memory and read garbage.)"""
    from edgemtp.runtimes.onnxrt_backend import GraphSession

    _, prompts, want = stories_case
    backend = OrtBackend(stories_pkg, threads=1, static_past=True, max_context=256)
    seen: dict[int, tuple] = {}

    def record(session):
        for io in session._shapes.values():
            ptrs = (id(session.kv), session.kv.k_ptr, io.argmax.data_ptr(),
                    io.top_ids.data_ptr(), io.ids.data_ptr(), io.mask.data_ptr())
            if io.graph_id > 0:
                assert seen.setdefault(io.graph_id, ptrs) == ptrs, io.graph_id

    config = GenerationConfig(max_new_tokens=48, drafter="probe", bc=30)
    first = None
    for ids, ref in zip(prompts[:3], want[:3]):
        session = backend.session()
        assert isinstance(session, GraphSession)
        first = first or session.kv.k_ptr
        assert Generation(backend, config, ids, session=session).run().token_ids == ref[:48]
        record(session)
        assert session.kv.k_ptr == first  # the finished generation's memory, reused
        del session
    assert len(backend._graph_buffers) == 1
    # two generations at once: the second gets memory and graph ids of its own
    a, b = backend.session(), backend.session()
    assert a.kv is not b.kv and len(backend._graph_buffers) == 2
    ga = Generation(backend, config, prompts[0], session=a)
    gb = Generation(backend, config, prompts[1], session=b)
    assert ga.run().token_ids == want[0][:48] and gb.run().token_ids == want[1][:48]
    record(a), record(b)
    ids_a = {io.graph_id for io in a._shapes.values()} - {-1}
    ids_b = {io.graph_id for io in b._shapes.values()} - {-1}
    assert ids_a and ids_b and not ids_a & ids_b


def test_uncaptured_shapes_stay_with_their_generation(stories_case, stories_pkg, monkeypatch):
    # blocks wider than GRAPH_MAX_T (prefills) run uncaptured on buffers of their own: those
    # die with the generation, so a server's many prompt lengths do not pile up on the device
    from edgemtp.runtimes.onnxrt_backend import GraphSession

    monkeypatch.setattr(GraphSession, "GRAPH_MAX_T", 4)
    _, prompts, want = stories_case
    backend = OrtBackend(stories_pkg, threads=1, static_past=True, max_context=256)
    for ids, ref, drafter in zip(prompts[:3], want[:3], ("none", "probe", "none")):
        config = GenerationConfig(max_new_tokens=32, drafter=drafter, bc=30)
        session = backend.session()
        assert Generation(backend, config, ids, session=session).run().token_ids == ref[:32]
        assert session._uncaptured and all(io.graph_id == -1
                                           for io in session._uncaptured.values())
    kept = backend._graph_buffers[0].shapes
    assert kept and all(t <= 4 and io.graph_id > 0 for (t, _), io in kept.items())


def test_public_binding_path_gives_the_same_tokens(stories_case, stories_pkg):
    # the backend binds through onnxruntime's C++ binding where it can (faster per step);
    # the public IOBinding methods must give exactly the same generations
    _, prompts, want = stories_case
    public = OrtBackend(stories_pkg, threads=1, public_binding=True)
    assert run(public, prompts[:3], bc=30, mask_tokens=2) == want[:3]
    assert run(public, prompts[:2], drafter="hybrid", bc=30) == want[:2]


def test_model_load_picks_onnxruntime_and_package_tokenizer(stories_pkg, stories_case):
    _, prompts, want = stories_case
    model = Model.load(str(stories_pkg))
    assert model.backend.name == "onnxruntime"
    text = story_prompts(1)[0]
    assert model.tokenizer.encode(text) == prompts[0]
    result = model.generate(text, drafter="probe", bc=30, max_new_tokens=NEW_TOKENS)
    assert result.token_ids == want[0]
    assert result.text


def test_step_outputs_match_torch_backend(stories_pkg):
    from edgemtp.runtimes.torch_backend import TorchBackend

    ort_b, torch_b = OrtBackend(stories_pkg), TorchBackend(str(STORIES))
    ids = np.array([1, 403, 407, 261, 512, 513])             # prompt + two mask slots
    mask = np.tril(np.ones((6, 6), dtype=bool))
    embeds = ort_b.embed(np.array([1, 403, 407, 261])).mean(0, keepdims=True).repeat(2, 0)
    outs = [b.session().forward(ids, np.arange(6), mask, embeds, topk=5, full_logits=True)
            for b in (ort_b, torch_b)]
    np.testing.assert_array_equal(outs[0].argmax, outs[1].argmax)
    np.testing.assert_array_equal(outs[0].topk_ids[:4], outs[1].topk_ids[:4])
    np.testing.assert_allclose(outs[0].topk_logprobs, outs[1].topk_logprobs, atol=2e-3)
    np.testing.assert_allclose(outs[0].logits, outs[1].logits, atol=2e-3)
    assert outs[0].topk_ids.shape == (6, 5) and outs[0].logits.shape == (6, 512)
    lean = ort_b.session().forward(ids, np.arange(6), mask, embeds)  # no top-K, no logits asked
    assert lean.logits is None and lean.topk_ids.shape == (6, 0)
    np.testing.assert_array_equal(lean.argmax, outs[0].argmax)
    np.testing.assert_allclose(ort_b.embed([5, 7]), torch_b.embed([5, 7]), atol=0)
    for a, b in zip(ort_b.embedding_stats(), torch_b.embedding_stats()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_sampling_matches_torch_backend(stories_case):
    # sampling reads full logits every step (bound per step, then unbound); with one seed the
    # two backends draw the same tokens unless a draw lands within ~1e-6 of a boundary
    from edgemtp.runtimes.torch_backend import TorchBackend

    backend, prompts, _ = stories_case
    torch_b = TorchBackend(str(STORIES))
    for opts in (dict(drafter="none"), dict(drafter="probe", bc=30, mask_tokens=2)):
        config = GenerationConfig(max_new_tokens=64, temperature=0.8, top_p=0.9, seed=3, **opts)
        for ids in prompts[:3]:
            ours = Generation(backend, config, ids).run().token_ids
            assert ours == Generation(torch_b, config, ids).run().token_ids


def test_commit_copies_only_accepted_rows(stories_pkg):
    b = OrtBackend(stories_pkg).session()
    b.forward(np.array([1, 403, 407]), np.arange(3), np.tril(np.ones((3, 3), bool)), None)
    b.commit(np.array([0, 1, 2]))
    assert b.cache_len == 3
    b.forward(np.array([9, 10, 11]), np.array([3, 4, 4]),
              np.array([[1, 0, 0], [1, 1, 0], [1, 0, 1]], bool), None)
    b.commit(np.array([0, 2]))
    assert b.cache_len == 5
    np.testing.assert_array_equal(b.kv.k[:, 3], b.kv.new_k[:, 0])
    np.testing.assert_array_equal(b.kv.k[:, 4], b.kv.new_k[:, 2])
    assert not b.kv.k[:, 5:].any()
    b.reset()
    assert b.cache_len == 0


def test_inputs_bound_once_still_reach_the_graph(stories_pkg):
    # ids/positions buffers are bound once per block size and a mask or mask-embeddings array
    # once per object: new values in them, arrays changed in place and a new T must all reach
    # the graph exactly as a backend that binds everything afresh sees them
    rng = np.random.default_rng(0)
    mask = np.tril(np.ones((6, 6), dtype=bool))
    embeds = rng.standard_normal((2, 64)).astype(np.float32)
    backend = OrtBackend(stories_pkg, threads=1)
    reused = backend.session()

    def check(ids, pos, m, e, topk=5):
        got = reused.forward(ids, pos, m, e, topk=topk)
        want = backend.session().forward(
            ids.copy(), pos.copy(), m.copy(), None if e is None else e.copy(), topk=topk)
        np.testing.assert_array_equal(got.argmax, want.argmax)
        np.testing.assert_array_equal(got.topk_ids, want.topk_ids)
        np.testing.assert_allclose(got.topk_logprobs, want.topk_logprobs, atol=1e-6)
        assert reused.last_run_s > 0

    for ids in ([1, 403, 407, 261, 512, 513], [1, 300, 301, 302, 512, 513]):
        for _ in range(2):
            check(np.array(ids), np.arange(6), mask, embeds)
            embeds *= 0.5                    # the same arrays, new values
            mask[5, 1] = not mask[5, 1]
    other = mask.copy()                      # new arrays of the same shapes, new values
    other[5, 1] = not other[5, 1]
    check(np.array([1, 403, 407, 261, 512, 513]), np.arange(6), other, embeds * 2.0)
    check(np.array([1, 403, 512]), np.arange(3), np.tril(np.ones((3, 3), bool)), embeds[:1])
    check(np.array([7]), np.array([0]), np.ones((1, 1), bool), None, topk=0)
    # a read-only mask (a compiled plan's) is copied only when another array comes: the
    # same object twice, then another of the same shape with other values, then back
    ro = [np.tril(np.ones((3, 3), bool)), np.eye(3, dtype=bool)]
    for m in ro:
        m.flags.writeable = False
    for m in (ro[0], ro[0], ro[1], ro[0]):
        check(np.array([1, 403, 512]), np.arange(3), m, embeds[:1])


def test_bindings_per_block_shape_survive_eviction(stories_case, stories_pkg, monkeypatch):
    # a session keeps one IOBinding per block shape and drops the oldest past MAX_BOUND:
    # drafters whose block size changes every step, on a session that holds only two
    from edgemtp.runtimes.onnxrt_backend import OrtSession

    monkeypatch.setattr(OrtSession, "MAX_BOUND", 2)
    _, prompts, want = stories_case
    backend = OrtBackend(stories_pkg, threads=1)
    assert run(backend, prompts[:2], drafter="hybrid", bc=30) == want[:2]
    assert run(backend, prompts[:2], drafter="pld", bc=10) == want[:2]


def test_no_step_feeds_the_graph_an_empty_past(stories_case, stories_pkg, monkeypatch):
    # a zero-row past kills onnxruntime on some machines (SIGFPE: the CUDA EP 1.31 on an
    # H200, the CPU EP 1.30/1.31 on that machine's Xeon): a prefill binds a bucket of the
    # cache that past_len masks, and the output is still plain decoding's
    from edgemtp.runtimes.onnxrt_backend import KVCache

    widths, bind_past = [], KVCache.bind_past

    def record(self, bind, p):
        widths.append(p)
        return bind_past(self, bind, p)

    monkeypatch.setattr(KVCache, "bind_past", record)
    _, prompts, want = stories_case
    backend = OrtBackend(stories_pkg, threads=1)
    assert run(backend, prompts[:2], drafter="probe", bc=10) == want[:2]
    assert widths and min(widths) >= 1


def test_stats_split_the_runtime_run_from_binding(stories_case):
    backend, prompts, _ = stories_case
    s = Generation(backend, GenerationConfig(max_new_tokens=16, bc=30, drafter="probe"),
                   prompts[0]).run().stats
    assert s.time_forward > 0 and s.time_bind > 0   # run_with_iobinding vs the rest of forward
    assert 0 < s.host_overhead < 1
    assert s.to_dict()["time_s"]["bind"] == round(s.time_bind, 6)


def test_topk_wider_than_exported_is_refused(stories_pkg):
    b = OrtBackend(stories_pkg).session()
    # (the message names the plans and context the top-K came from: a package exported at a
    # small --max-context keeps small plans only, and "a larger --bc" was the wrong hint)
    with pytest.raises(ConfigError, match=r"exports top-31, what its plans need \(bc 10 k 1, "
                                          r".*bc 60 k 2, at a max context of 256\)"):
        b.forward(np.array([1]), np.array([0]), np.ones((1, 1), bool), None, topk=32)


def test_cuda_runs_fp32_without_tf32(stories_pkg):
    # onnxruntime's CUDA EP rounds fp32 matrix products to TF32 by default, which depends on
    # the block shape: on an H200 an fp32 package then matched its plain decoding on 11/12
    # prompts per drafter, 12/12 with TF32 off (bench/results/ort_gpu_h200.md)
    assert OrtBackend(stories_pkg)._provider_options("cuda") == {"device_id": "0",
                                                                 "use_tf32": "0"}


def test_cuda_n_picks_the_gpu_as_the_other_backends_do(stories_pkg):
    # QA (gpu D5): the torch and tensorrt backends took cuda:N, onnxruntime refused it and
    # its error dropped the index. Checked on CPU: GPU N's device_id in the providers'
    # options (onnxruntime cannot run CUDA here), and the grammar's errors.
    b = OrtBackend(stories_pkg)
    b.device_id = 3
    assert b._provider_options("cuda") == {"device_id": "3", "use_tf32": "0"}
    assert b._provider_options("tensorrt")["device_id"] == "3"
    import onnxruntime

    if "CUDAExecutionProvider" not in onnxruntime.get_available_providers():
        with pytest.raises(BackendUnavailableError, match="device 'cuda:1' needs"):
            OrtBackend(stories_pkg, device="cuda:1")
    for bad in ("cpu:1", "cuda:x", "cuda:"):
        with pytest.raises(ConfigError, match=r"cpu, cuda\[:N\] or tensorrt\[:N\], got"):
            OrtBackend(stories_pkg, device=bad)


def test_missing_execution_provider_is_one_clear_line(stories_pkg):
    import onnxruntime

    if "CUDAExecutionProvider" in onnxruntime.get_available_providers():
        pytest.skip("this onnxruntime has CUDA")
    with pytest.raises(BackendUnavailableError) as e:
        OrtBackend(stories_pkg, device="cuda")
    msg = str(e.value)
    assert "CUDAExecutionProvider" in msg and "onnxruntime-gpu" in msg and "\n" not in msg
    with pytest.raises(ConfigError, match=r"device must be cpu, cuda\[:N\] or tensorrt"):
        OrtBackend(stories_pkg, device="npu")


def test_max_context_option_shrinks_the_cache(stories_pkg):
    b = OrtBackend(stories_pkg, max_context=32)
    assert b.max_context == 32 and b.session().kv.k.shape[1] == 32
    assert OrtBackend(stories_pkg, max_context=10_000).max_context == 256
    with pytest.raises(ConfigError, match="the max context is 32"):
        Generation(b, GenerationConfig(), list(range(1, 40)))


def test_fp16_package_is_lossless_on_its_own_backend(tmp_path):
    out = tmp_path / "stories16"
    report = export_package(str(STORIES), out, dtype="fp16", bc=(30,), mask_tokens=(1, 2),
                            max_context=256, progress=False)
    manifest = json.loads((out / "edgemtp.json").read_text())
    assert manifest["dtype"] == "fp16"
    assert np.load(out / "embeddings.npy").dtype == np.float16
    assert report.check.token_rows <= 2e-2 * report.check.scale
    tok = transformers.AutoTokenizer.from_pretrained(STORIES)
    prompts = [tok(p).input_ids for p in story_prompts(4)]
    b = OrtBackend(out, threads=1)
    assert b.session().kv.k.dtype == np.float16
    greedy = run(b, prompts, drafter="none")
    assert run(b, prompts, bc=30) == greedy
    assert run(b, prompts, bc=30, mask_tokens=2) == greedy


# -- random-initialised families ------------------------------------------------------------------

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
               "rope_theta": 500000.0}


def tiny_config(family: str):
    # initializer_range 0.3 gives decisive logits (top-2 margins >= ~1e-3, far above fp32
    # noise), so equality tests the runtime and not tie-breaking
    common = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  initializer_range=0.3, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                  tie_word_embeddings=False)
    if family == "llama":
        return transformers.LlamaConfig(**common, rope_parameters=LLAMA3_ROPE)
    if family == "qwen2":
        return transformers.Qwen2Config(**common)
    if family == "qwen3":
        return transformers.Qwen3Config(**common, head_dim=24)
    return transformers.MistralConfig(**common, sliding_window=None)


# the default run takes the narrowest and the widest plan of each family; the slow one all four
FAMILY_PROBES = [(10, 1, "static"), pytest.param(30, 1, "static", marks=pytest.mark.slow),
                 pytest.param(30, 2, "dynamic", marks=pytest.mark.slow), (60, 2, "static")]


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3", "mistral"])
def family_case(request, tmp_path_factory):
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(tiny_config(request.param)).eval()
    folder = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(folder / "hf")
    out = folder / "pkg"
    export_package(str(folder / "hf"), out, bc=(10, 30, 60), progress=False)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 320, n).tolist() for n in (5, 11, 17)]
    return request.param, out, prompts, hf_greedy(hf, prompts)


def test_random_family_plain_decoding_equals_transformers(family_case):
    family, pkg, prompts, want = family_case
    manifest = json.loads((pkg / "edgemtp.json").read_text())
    assert manifest["family"] == family and manifest["tokenizer"] is False
    assert run(OrtBackend(pkg, threads=1), prompts, drafter="none") == want


@pytest.mark.parametrize("bc,k,tree", FAMILY_PROBES,
                         ids=["bc10-k1-static", "bc30-k1-static", "bc30-k2-dynamic",
                              "bc60-k2-static"])
def test_random_family_probe_equals_transformers(family_case, bc, k, tree):
    _, pkg, prompts, want = family_case
    assert run(OrtBackend(pkg, threads=1), prompts, bc=bc, mask_tokens=k, tree=tree) == want


def test_tensorrt_profile_covers_every_generation_shape(stories_pkg):
    # checked on CPU: the options the TensorRT EP would get (one engine for all shapes)
    opts = OrtBackend(stories_pkg)._provider_options("tensorrt")
    assert "input_ids:1x1," in opts["trt_profile_min_shapes"]
    assert "past_value_4:1x0x4x8" in opts["trt_profile_min_shapes"]
    assert "tree_mask:1x1x60x60" in opts["trt_profile_opt_shapes"]
    assert "input_ids:1x256," in opts["trt_profile_max_shapes"]
    assert "past_key_0:1x256x4x8" in opts["trt_profile_max_shapes"]
    assert opts["trt_engine_cache_path"].endswith("engines")
