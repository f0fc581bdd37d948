"""PyTorch reference backend: a local Hugging Face causal LM, with a preallocated,
sequence-major KV cache per session. CPU, and CUDA when present."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import threading
import time
import weakref
from collections import Counter
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from edgemtp.backend import StepOut, check_options, check_torch_device
from edgemtp.errors import ConfigError, ModelLoadError
from edgemtp.runtimes.host_table import HostRows
from edgemtp.models.static_decoder import StaticTreeDecoder
from edgemtp.models.families import family_for, max_context, missing_weights
from edgemtp.runtimes.gguf_source import check_gguf, check_hf_folder, resolve_model

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
MASK_CACHE = 512  # device copies of plan masks kept (oldest out first)
SLACK = 64        # cache rows past the max context where a block's K/V wait for their commit
PAD_TO = 64       # blocks longer than this (prefill) are padded to a multiple of it, so one
                  # step shape (and one CUDA graph) serves many prompt lengths
BUCKET = {"cuda": 0, "cpu": 64}  # attention spans the cache in buckets of this many rows
# (0, DOUBLING: spans of a power of two rows, at least SPAN_FLOOR)
SPAN_ENV = "EDGEMTP_ATTENTION_SPAN"  # rows per bucket (a multiple of 64), "doubling" or "full"
FULL_SPAN = 1 << 40  # a bucket no cache reaches: every step attends over the whole cache
DOUBLING = 0  # spans that double: a handful of widths up to any max context
SPAN_FLOOR = 1024  # the smallest doubling span


def step_rows(t: int, buckets: bool) -> int:
    """The rows a block of ``t`` runs as: past PAD_TO (a prefill) padded to a multiple of it;
    up to it, with ``buckets`` (where CUDA graphs run), to the next power of two.

    >>> [step_rows(t, True) for t in (1, 3, 11, 64, 65)], step_rows(11, False)
    ([1, 4, 16, 64, 128], 11)
    """
    if t > PAD_TO:
        return -(-t // PAD_TO) * PAD_TO
    return 1 << (t - 1).bit_length() if buckets else t


def attention_width(need: int, bucket: int, rows: int) -> int:
    """The cache rows a step attends over when its cache and block fill ``need`` rows: whole
    buckets of ``bucket`` rows, or (``DOUBLING``) the next power of two, at least SPAN_FLOOR;
    never more than the session's ``rows``. Each width is a step shape of its own, so a CUDA
    graph of its own: with 256-row buckets a chat generation crossing 1024 rows met 4 widths,
    and each of the (up to 7) block sizes a lookup tree uses was an eager run and a capture
    mid-generation at every one; doubling spans meet 1 (and 4 up to 8192 rows), at the cost
    of attending over at most twice the rows needed (SmolLM2-135M in fp16: 23 KiB a row).

    >>> [attention_width(n, 256, 1000) for n in (1, 256, 257, 999)]
    [256, 256, 512, 1000]
    >>> [attention_width(n, DOUBLING, 5000) for n in (1, 1024, 1025, 2049, 4097)]
    [1024, 1024, 2048, 4096, 5000]
    >>> attention_width(3000, FULL_SPAN, 8256)
    8256
    """
    if bucket == DOUBLING:
        width = max(SPAN_FLOOR, 1 << (max(1, need) - 1).bit_length())
    else:
        width = -(-max(1, need) // bucket) * bucket
    return min(width, rows)


def attention_bucket(device_type: str) -> int:
    """Cache rows a step's attention spans at a time: the device's default (CUDA: doubling
    spans, CPU: 64-row buckets, where no graph is captured and a step reads no more of the
    cache than it must), or ``$EDGEMTP_ATTENTION_SPAN``: a multiple of 64, ``doubling``, or
    ``full`` (one span, the whole cache, so a step's shape, and so its CUDA graph, never
    depends on the cache's length: the graphs of a generation are captured by its first
    steps, not whenever the cache enters a bucket it has not reached before; each step reads
    the whole cache's K/V instead)."""
    value = os.environ.get(SPAN_ENV, "").strip().lower()
    if not value:
        return BUCKET["cuda" if device_type == "cuda" else "cpu"]
    return parse_span(value, SPAN_ENV)


def parse_span(value: str, what: str) -> int:
    """An attention span policy as ``$EDGEMTP_ATTENTION_SPAN`` spells it (``what`` names
    where it came from in the error)."""
    value = value.strip().lower()
    if value == "full":
        return FULL_SPAN
    if value == "doubling":
        return DOUBLING
    if not value.isdigit() or int(value) < 64 or int(value) % 64:
        raise ConfigError(f"{what} must be a multiple of 64 cached rows, 'doubling' or "
                          f"'full', got {value!r}")
    return int(value)


def span_name(bucket: int) -> str:
    """How a latency curve's identity names the span policy."""
    return {DOUBLING: "doubling", FULL_SPAN: "full"}.get(bucket, str(bucket))


EMBED_ROWS = 8192  # embedding rows kept on the host by a GPU backend (mask-embedding updates)


def check_cuda_seen(device: str) -> None:
    """A ``cuda[:N]`` device this PyTorch build can use, or one line saying it sees none."""
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device {device!r} asked, but this PyTorch build sees no CUDA "
                          f"device")


def load_hf_config(path: str, trust_remote_code: bool = False):
    """The ``transformers`` config of a local folder, a GGUF file (or a folder holding one),
    or a hub id when online, with one-line errors for a missing folder, a folder that is not
    a model, and a GGUF file that is damaged or of an unsupported architecture."""
    from transformers import AutoConfig

    source = resolve_model(path)
    if source.gguf_file:
        check_gguf(source)
    else:
        check_hf_folder(path)
    try:
        return AutoConfig.from_pretrained(source.folder, trust_remote_code=trust_remote_code,
                                          **source.pretrained_kwargs())
    except (OSError, ValueError, json.JSONDecodeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelLoadError(f"cannot read the model config at {source.path!r}: {first}") from None


def package_source(model: str):
    """``(package, source)``: for an exported package, the package and the model it was
    exported from (its manifest's ``source``, as written or relative to the package's
    folder); else ``(None, model)``. One line where the source is not on this machine."""
    from edgemtp.runtimes.package import is_package, load_package

    if not is_package(model):
        return None, model
    pkg = load_package(model, check_plans=False, check_engines=False)
    src = pkg.meta.source
    for cand in (Path(src), pkg.root / src, pkg.root.parent / src):
        if src and cand.exists():
            return pkg, str(cand)
    raise ModelLoadError(f"the torch backend runs the model a package was exported from, and "
                         f"{str(pkg.root)!r} was exported from {src!r}, which is not on this "
                         f"machine; give --model that Hugging Face folder or GGUF file")


class TorchBackend:
    """A Hugging Face causal LM in PyTorch: the weights once; each :meth:`session` owns a
    KV cache preallocated on the device at the max context and written in place.

    ``static_cache`` (default) runs every step over fixed shapes (one per block size and
    cache bucket), replayed as CUDA graphs on a CUDA device (``cuda_graphs``, default on
    there). ``block_buckets`` (default: where graphs run) pads a block of up to 64 rows to the
    next power of two (its padding rows see only themselves and are never committed): at most
    7 block shapes per cache bucket, so lookup trees of every size replay a few captured
    graphs instead of capturing one per size mid-generation; on a GPU a 16-row step costs what
    a 10-row one does. ``static_cache=False`` is the reference session that concatenates the
    past and the block's K/V in every layer, as the exported graph does. ``batch_invariant``
    pads every step to one shape and sums attention in float64 (see :meth:`_init`), so
    speculation in fp16/bf16 on a GPU gives what plain decoding run the same way gives.
    """

    name = "torch"
    has_tokenizer = True
    supports_hidden = True

    def __init__(self, model: str, device: str = "cpu", dtype: str | None = None,
                 max_context: int | None = None, trust_remote_code: bool = False,
                 threads: int | None = None, static_cache: bool = True,
                 cuda_graphs: bool | None = None, batch_invariant: bool = False,
                 block_buckets: bool | None = None) -> None:
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        check_options(device, dtype, max_context, threads)
        dtype = dtype or "fp32"
        check_torch_device(device)
        check_cuda_seen(device)
        if threads is not None:
            torch.set_num_threads(int(threads))
        # an exported package: the model it was exported from, and the package for what it
        # adds (learned heads, edgemtp train-heads), so the heads drafter runs here too
        self.package, model = package_source(model)
        source = resolve_model(model)
        if source.gguf_file:  # its architecture, checked without the seconds transformers
            check_gguf(source)  # takes to parse a GGUF (it does so once more to load it)
        else:
            family_for(load_hf_config(model, trust_remote_code))  # before any weight loads
        hf_logging.disable_progress_bar()  # edgemtp shows its own progress where it is long
        try:
            level = hf_logging.get_verbosity()
            hf_logging.set_verbosity_error()  # (its load report: missing_weights says it)
            try:
                hf, info = AutoModelForCausalLM.from_pretrained(
                    source.folder, dtype=DTYPES[dtype], trust_remote_code=trust_remote_code,
                    output_loading_info=True, **source.pretrained_kwargs())
            finally:
                hf_logging.set_verbosity(level)
        except (OSError, ValueError, RuntimeError) as e:  # RuntimeError: a truncated file
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ModelLoadError(f"cannot load {model!r} as a causal LM: {first}") from None
        problem = missing_weights(model, info)
        if problem:  # (random values would decode as if they were the model)
            raise ModelLoadError(problem)
        self.family = family_for(hf.config)
        self.source = str(Path(model).resolve()) if Path(model).exists() else model
        if self.package is not None:
            m, cfg = self.package.meta, hf.config
            if (m.vocab_size, m.hidden_size, m.num_layers) != (
                    int(cfg.vocab_size), int(cfg.hidden_size), int(cfg.num_hidden_layers)):
                raise ModelLoadError(
                    f"the package {str(self.package.root)!r} does not match its source "
                    f"{model!r}: vocab/hidden/layers {m.vocab_size}/{m.hidden_size}/"
                    f"{m.num_layers} against {cfg.vocab_size}/{cfg.hidden_size}/"
                    f"{cfg.num_hidden_layers}")
        self._init(hf, device, max_context, static_cache, cuda_graphs, batch_invariant,
                   block_buckets)

    @classmethod
    def from_model(cls, hf_model, device: str = "cpu", max_context: int | None = None,
                   static_cache: bool = True, cuda_graphs: bool | None = None,
                   batch_invariant: bool = False, block_buckets: bool | None = None):
        """Wrap an already loaded ``transformers`` causal LM (tests, notebooks, benchmarks)."""
        check_cuda_seen(device)
        self = cls.__new__(cls)
        self.family = family_for(hf_model.config)
        self.source, self.package = None, None
        self._init(hf_model, device, max_context, static_cache, cuda_graphs, batch_invariant,
                   block_buckets)
        return self

    def _init(self, hf, device: str, requested_context: int | None, static_cache: bool,
              cuda_graphs: bool | None, batch_invariant: bool = False,
              block_buckets: bool | None = None) -> None:
        if batch_invariant and not static_cache:
            raise ConfigError("batch_invariant needs the static cache (static_cache=True)")
        # every step of up to PAD_TO rows (plain decoding's one row too) padded to PAD_TO: one
        # matrix shape for all of them, so a row's logits do not depend on the block it sits in
        # (fp16/bf16 GPU kernels are picked, and round, by the row count); and attention summed
        # in float64, so neither does it depend on where a row's ancestors sit in the cache
        # (StaticTreeDecoder.exact_attention); costs t(64)/t(1) and the float64 attention
        self.batch_invariant = bool(batch_invariant)
        self.device = torch.device(device)
        self.hf = hf.to(self.device).eval()
        cfg = hf.config
        self.decoder = StaticTreeDecoder(self.hf, self.family)
        self.decoder.exact_attention = self.batch_invariant
        cuda = self.device.type == "cuda"
        self.static_cache = bool(static_cache)
        self.cuda_graphs = cuda and self.static_cache and cuda_graphs is not False
        self.block_buckets = self.static_cache and (
            self.cuda_graphs if block_buckets is None else bool(block_buckets))
        self.bucket = attention_bucket(self.device.type)
        # one CUDA stream does the work of every session: steps of concurrent sessions take
        # turns (each session's graphs share a memory pool of its own); on CPU they run side
        # by side
        self.lock = threading.Lock() if cuda else contextlib.nullcontext()
        # step shapes met (StepGraph's first, eager run), CUDA graphs captured, and the
        # seconds each took on the host (a capture mid-generation stalls that step): what a
        # bench sets beside the steps' time (bench_step_host, bench_gpu)
        self.graph_events = Counter()
        # seconds inside a step, summed over steps (TorchSession.forward): loading the inputs,
        # running or replaying the step, waiting for the device, reading the outputs back
        self.step_seconds = Counter()
        # a step's top-K in two stages over this many slices of the vocabulary (0: one
        # torch.topk; see chunked_topk): read when a step shape is first run or captured
        self.topk_chunks = 0
        self.vocab_size = int(cfg.vocab_size)
        self.hidden_size = int(cfg.hidden_size)
        self.max_context = max_context(cfg, self.family, requested_context)
        eos = getattr(hf.generation_config, "eos_token_id", None)
        eos = cfg.eos_token_id if eos is None else eos
        self.eos_token_ids = tuple(eos if isinstance(eos, (list, tuple)) else
                                   ([] if eos is None else [eos]))
        d = self.decoder
        self.dtype = next(hf.parameters()).dtype
        # a session's cache: [layers, max_context, H_kv, D], sequence-major so a prefix is a view
        self.cache_shape = (cfg.num_hidden_layers, self.max_context, d.n_kv, d.head_dim)
        self._table = hf.get_input_embeddings().weight.detach()
        self._masks: dict = {}
        self._rows = HostRows(lambda ids: self._table.index_select(
            0, torch.as_tensor(ids, device=self.device)).float().cpu().numpy(),
            self.hidden_size, EMBED_ROWS)
        # on the CPU a float32 or float16 table is read through a numpy view of its memory:
        # the same values as torch's lookup, without ~50 us of dispatch a step (every step of
        # a drafter with mask tokens: their EMA reads the committed tokens' rows)
        self._np_table = (self._table.numpy() if self.device.type == "cpu"
                          and self._table.dtype in (torch.float32, torch.float16) else None)

    def session(self, rows: int | None = None) -> "TorchSession | ConcatSession":
        """A generation's session; ``rows``: a smaller static cache to start with than the
        max context (a latency measurement's: on a GPU a second full cache is real memory);
        it grows if a block needs more."""
        return TorchSession(self, rows) if self.static_cache else ConcatSession(self)

    def identity(self) -> str | None:
        """What a measured latency depends on (``latency.cached_latency``); None for a model
        handed in already loaded (:meth:`from_model`), whose weights have no name."""
        if self.source is None:
            return None
        src = Path(self.source)  # a folder or a GGUF file (or a hub id: no files here)
        files = [src] if src.is_file() else [f for f in src.glob("*") if f.is_file()]
        stats = [f.stat() for f in files]
        stamp = f"{max((s.st_mtime_ns for s in stats), default=0)}|" \
                f"{sum(s.st_size for s in stats)}"
        return (f"torch {torch.__version__}|{self.device}|{self.dtype}|"
                f"threads={torch.get_num_threads()}|static={self.static_cache}|"
                f"graphs={self.cuda_graphs}|invariant={self.batch_invariant}|"
                f"span={span_name(self.bucket)}|"
                f"ctx={self.max_context}|{self.source}|{stamp}")

    @torch.inference_mode()
    def device_mask(self, tree_mask: np.ndarray) -> torch.Tensor:
        # the reference session's (a static session's step loads its own, StepGraph): plan
        # masks are immutable and live as long as their plan, so each moves to the device
        # once and is reused in every session (keyed by the buffer, held so the address
        # cannot be recycled)
        if tree_mask.flags.writeable:
            return torch.as_tensor(tree_mask, dtype=torch.bool, device=self.device)
        key = tree_mask.__array_interface__["data"][0], tree_mask.shape
        hit = self._masks.get(key)
        if hit is None:
            if len(self._masks) >= MASK_CACHE:  # lookup drafters make a new tree most steps
                del self._masks[next(iter(self._masks))]
            hit = self._masks[key] = (tree_mask, torch.tensor(tree_mask, dtype=torch.bool,
                                                              device=self.device))
        return hit[1]

    def cache_bytes(self, rows: int | None = None) -> int:
        """Bytes of K/V one session of ``rows`` positions (default: the max context)
        allocates: the static cache holds SLACK rows past them, where a block's rows wait for
        their commit."""
        rows = (rows or self.max_context) + (SLACK if self.static_cache else 0)
        layers, _, kv_heads, head_dim = self.cache_shape
        return 2 * layers * kv_heads * rows * head_dim * self.dtype.itemsize

    def embed(self, token_ids) -> np.ndarray:
        ids = np.asarray(token_ids, dtype=np.int64)
        if self._np_table is not None:
            return self._np_table[ids].astype(np.float32, copy=False)
        if self.device.type == "cpu":  # (a bfloat16 table: numpy has no such type)
            return self._table.index_select(0, torch.from_numpy(ids)).float().numpy()
        # on a GPU each lookup is a device round trip (~50 us with its synchronisation, every
        # step of a drafter with mask tokens: their EMA reads the committed tokens' rows)
        return self._rows(ids)

    def embedding_stats(self) -> tuple[np.ndarray, np.ndarray]:
        t = self._table.float()
        return t.mean(0).cpu().numpy(), t.std(0).cpu().numpy()


def chunked_topk(x: torch.Tensor, k: int, chunks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x.topk(k, -1)`` in two stages: the top ``k`` of each of ``chunks`` slices of a row,
    then the top ``k`` of those. The same values, and the same ids wherever no two values tie
    (the order of tied candidates is not specified either way). For a GPU, where one top-K
    over a 49152-wide row runs a handful of rows on as many blocks; on a CPU it is slower
    (SmolLM2's vocabulary, 16 rows: 3.6 ms against 0.5), so it is off unless a backend's
    ``topk_chunks`` is set (``bench_step_host.py --topk-curve`` measures both).

    >>> x = torch.tensor([[0.1, 0.9, 0.3, 0.7, 0.2]])
    >>> [t.tolist() for t in chunked_topk(x, 2, 2)]
    [[[0.8999999761581421, 0.699999988079071]], [[1, 3]]]
    """
    t, v = x.shape
    width = -(-v // chunks)
    if k > width:  # a slice holds fewer than k: one stage
        return x.topk(k, -1)
    if width * chunks != v:  # pad the last slice with -inf (never among the top k)
        x = F.pad(x, (0, width * chunks - v), value=float("-inf"))
    vals, ids = x.view(t, chunks, width).topk(k, -1)
    ids = ids + torch.arange(0, width * chunks, width, device=x.device)[None, :, None]
    top, at = vals.view(t, -1).topk(k, -1)
    return top, ids.view(t, -1).gather(-1, at)


class TorchSession:
    """One generation's KV cache on a :class:`TorchBackend`'s device, static: preallocated
    ``[L, H_kv, S, D]`` (``S`` = the max context plus scratch rows for a block), written in
    place, and one :class:`StepGraph` per step shape (see
    :mod:`edgemtp.models.static_decoder`)."""

    last_run_s = None  # the torch step is all run: no binding to tell apart

    def __init__(self, backend: TorchBackend, rows: int | None = None) -> None:
        self.backend = backend
        self.cache_len = 0
        self.rows = 0
        if rows is not None:  # whole attention buckets, so a step spans what it would in a
            # full cache (the same width, the same latency)
            rows = attention_width(int(rows), backend.bucket, FULL_SPAN)
        self._grow(min(backend.max_context if rows is None else rows, backend.max_context)
                   + SLACK)

    def _grow(self, rows: int) -> None:
        # a block's K/V land at [P, P + T) before its commit: a block past the scratch rows
        # reallocates (rare: blocks over SLACK rows near the end of the context) and drops
        # the graphs, which hold the old buffers' addresses
        b = self.backend
        # K and V in one tensor [2, L, H_kv, S, D]: a commit moves both in one gather
        kv = torch.zeros((2, b.cache_shape[0], b.cache_shape[2], rows, b.cache_shape[3]),
                         dtype=b.dtype, device=b.device)
        if self.rows:
            kv[:, :, :, :self.cache_len] = self.kv[:, :, :, :self.cache_len]
        self.kv, self.rows = kv, rows
        self.k_cache, self.v_cache = kv[0], kv[1]
        self._graphs: dict[tuple, StepGraph] = {}
        # the graphs' memory pool, one per session and cache: PyTorch frees a pool when its
        # last graph goes, and a handle used again after that fails an internal assert (an
        # H200: a pool shared by every session died with a latency measurement's session)
        self.graph_pool = torch.cuda.graph_pool_handle() if b.cuda_graphs else None
        # a commit's source rows, staged in pinned memory on a GPU (no pageable copy)
        self._src = (torch.zeros(PAD_TO, dtype=torch.long).pin_memory()
                     if b.device.type == "cuda" else None)
        self._src_done = torch.cuda.Event() if self._src is not None else None

    @torch.inference_mode()
    def forward(self, input_ids, position_ids, tree_mask, mask_embeds, topk: int = 0,
                full_logits: bool = False, hidden: bool = False) -> StepOut:
        b, p, t = self.backend, self.cache_len, len(input_ids)
        tp = step_rows(t, b.block_buckets)
        if b.batch_invariant:
            tp = max(tp, PAD_TO)
        if p + tp > self.rows:
            self._grow(-(-(p + tp) // PAD_TO) * PAD_TO)
        width = attention_width(p + tp, b.bucket, self.rows)
        k = 1 if mask_embeds is None else len(mask_embeds)
        topk = min(int(topk), b.vocab_size)
        key = (tp, width, k, topk)
        g = self._graphs.get(key)
        if g is None:
            g = self._graphs[key] = StepGraph(self, tp, width, k, topk)
        clock = time.perf_counter
        with b.lock:  # (the step's timers too: steps of concurrent sessions take turns here)
            t0 = clock()
            g.load(input_ids, position_ids, tree_mask, mask_embeds, p)
            t1 = clock()
            g.run()
            t2 = clock()
            out = g.read(t, full_logits, hidden)
            t3 = clock()
            # where a step's time goes inside the backend (host seconds, summed over the
            # steps after a prompt's first block): the bench sets them beside a step's stages
            # (bench_step_host); "wait" is the synchronisation in read, the device finishing
            # the step (CPU: 0, the work ran in "run")
            if p:
                st = b.step_seconds
                st["load"] += t1 - t0
                st["run"] += t2 - t1
                st["read"] += t3 - t2 - g.waited
                st["wait"] += g.waited
                st["steps"] += 1
        return out

    @torch.inference_mode()
    def commit(self, rows) -> None:
        rows = np.asarray(rows, dtype=np.int64)
        r, p = len(rows), self.cache_len
        if p + r > self.backend.max_context:
            raise ConfigError(f"committing {r} rows overruns the KV cache "
                              f"({p} of {self.backend.max_context} rows used)")
        # (a step's path: a list compare costs ~1 us against numpy's ~5 for its three calls,
        # on a host that waits for a GPU; a prefill's thousands of rows: numpy)
        if r and (rows[-1] != r - 1 or (rows.tolist() != list(range(r)) if r <= PAD_TO
                                        else bool(np.any(rows != np.arange(r))))):
            # the accepted rows sit at P + rows; move them down to [P, P + r) (a path that is
            # a prefix of the block, as in plain decoding and prefill, is already in place)
            if self._src is not None and r <= len(self._src):
                self._src_done.synchronize()  # the last commit's copy has left the buffer
                self._src.numpy()[:r] = p + rows
                src = self._src[:r].to(self.backend.device, non_blocking=True)
                self._src_done.record()
            else:
                src = torch.as_tensor(p + rows, device=self.backend.device)
            with self.backend.lock:
                self.kv[:, :, :, p:p + r] = self.kv.index_select(3, src)
        self.cache_len += r

    def reset(self) -> None:
        self.cache_len = 0


class StepGraph:
    """The static buffers of one step shape ``(T, B, k, K)`` on one session's cache, and the
    step over them: on CUDA captured once as a CUDA graph (at its second use, after an eager
    run and a warm-up) and replayed; elsewhere the same code, run eagerly."""

    def __init__(self, session: TorchSession, t: int, width: int, k: int, topk: int) -> None:
        b = session.backend
        dev = b.device
        # a weak reference: a session and its graphs form no cycle, so a dropped session
        # (a latency measurement's) frees its CUDA graphs at once, not whenever Python's cycle
        # collector runs, which may be during another graph's capture (where freeing a graph
        # is not permitted and invalidates that capture: seen on an H200)
        self.session = weakref.proxy(session)
        self.t, self.width, self.topk = t, width, topk
        # ids, positions and P in one buffer: one host-to-device copy a step
        self.inputs = torch.zeros(2 * t + 1, dtype=torch.long, device=dev)
        self.idpos = self.inputs[:2 * t].view(2, t)
        self.p = self.inputs[2 * t]
        self.mask = torch.zeros((t, t), dtype=torch.bool, device=dev)
        self.embeds = torch.zeros((k, b.hidden_size), dtype=b.dtype, device=dev)
        self.embeds_zero = True
        self.cuda = dev.type == "cuda"
        if self.cuda:  # pinned host staging: the step's copies in and out do not block
            self.staging = torch.zeros(2 * t + 1, dtype=torch.long).pin_memory()
            self.embeds_staging = torch.zeros((k, b.hidden_size), dtype=b.dtype).pin_memory()
            self.packed_host = torch.zeros((t, 1 + 2 * topk), dtype=torch.float32).pin_memory()
            self.mask_staging = torch.zeros((t, t), dtype=torch.bool).pin_memory()
        self._mask_of = None  # the (immutable) plan mask self.mask holds now
        self.waited = 0.0  # seconds the last read waited for the device
        self.graph = None
        self.uses = 0

    def load(self, ids, positions, tree_mask, mask_embeds, p: int) -> None:
        t, tp = len(ids), self.t
        flat = (self.staging if self.cuda else self.inputs).numpy()
        host = flat[:2 * tp].reshape(2, tp)
        host[0, :t], host[1, :t] = ids, positions
        if tp != t:  # padding rows: token 0 at the last position, each sees only itself
            host[:, t:] = 0
            host[1, t:] = positions[-1]
        flat[2 * tp] = p
        if self.cuda:
            self.inputs.copy_(self.staging, non_blocking=True)
        self._load_mask(tree_mask, t)
        if mask_embeds is None:
            if not self.embeds_zero:
                self.embeds.zero_()
                self.embeds_zero = True
        else:
            m = torch.from_numpy(np.asarray(mask_embeds, dtype=np.float32))
            if self.cuda:
                self.embeds_staging.copy_(m)
                self.embeds.copy_(self.embeds_staging, non_blocking=True)
            else:
                self.embeds.copy_(m)
            self.embeds_zero = False

    def _load_mask(self, tree_mask: np.ndarray, t: int) -> None:
        """The block's [T, T] mask into ``self.mask``, padding rows each seeing only itself:
        on a GPU written into pinned memory and copied without blocking (a tree drafter's plan
        is new most steps; a blocking copy of it from pageable memory waited for the stream
        every step), and nothing at all when the plan is the one already there (a static
        plan's steps: plain decoding, probing, chains of one length)."""
        if tree_mask is self._mask_of:
            return
        tp = self.t
        host = (self.mask_staging if self.cuda else self.mask).numpy()
        host[:t, :t] = tree_mask
        if tp != t:
            host[:t, t:] = False
            host[t:] = False
            pad = np.arange(t, tp)
            host[pad, pad] = True
        if self.cuda:
            self.mask.copy_(self.mask_staging, non_blocking=True)
        # only a read-only (plan) mask can be known again by identity: a writable one may
        # have changed in place since
        self._mask_of = None if tree_mask.flags.writeable else tree_mask

    def _compute(self) -> None:
        s = self.session
        h, logits = s.backend.decoder.step(self.idpos[0], self.idpos[1], self.mask, self.embeds,
                                           self.p, s.k_cache, s.v_cache, self.width)
        self.hidden, self.logits = h, logits.float()
        self.argmax = self.logits.argmax(-1)
        if self.topk:
            lp = torch.log_softmax(self.logits, -1)
            chunks = s.backend.topk_chunks
            self.topk_lp, self.topk_ids = (chunked_topk(lp, self.topk, chunks) if chunks
                                           else lp.topk(self.topk, -1))
        if self.cuda:  # what the host reads, in one buffer: one copy back (ids < 2^24: exact)
            parts = [self.argmax[:, None].float()]
            if self.topk:
                parts += [self.topk_ids.float(), self.topk_lp]
            self.packed = torch.cat(parts, 1)

    def run(self) -> None:
        self.uses += 1
        b = self.session.backend
        if not (self.cuda and b.cuda_graphs) or self.uses == 1:
            t0 = time.perf_counter() if self.uses == 1 else 0.0
            self._compute()  # CPU; and on CUDA a shape's first use (most never recur)
            if self.uses == 1:
                b.graph_events["shapes"] += 1
                b.graph_events["shape_s"] += time.perf_counter() - t0
            return
        if self.graph is None:
            t0 = time.perf_counter()
            side = torch.cuda.Stream(device=b.device)
            side.wait_stream(torch.cuda.current_stream(b.device))
            with torch.cuda.stream(side):
                self._compute()
            torch.cuda.current_stream(b.device).wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            # no garbage collection inside the capture: collected objects may own CUDA graphs
            # or memory, and neither may be freed while a stream captures (no gc.collect()
            # first: a full collection costs tens of ms, and sessions hold no cycles)
            enabled = gc.isenabled()
            gc.disable()
            try:
                with torch.cuda.graph(self.graph, pool=self.session.graph_pool,
                                      capture_error_mode="thread_local"):
                    self._compute()
            finally:
                if enabled:
                    gc.enable()
            b.graph_events["captures"] += 1
            b.graph_events["capture_s"] += time.perf_counter() - t0
        self.graph.replay()

    def read(self, t: int, full_logits: bool, hidden: bool) -> StepOut:
        """The first ``t`` rows' outputs on the host: argmax and top-K, logits and hidden
        states only when asked; one synchronisation."""
        if self.cuda:
            extra = []
            if full_logits:
                extra.append(self.logits[:t])
            if hidden:
                extra.append(self.hidden[:t].float())
            host = self.packed_host[:t]
            host.copy_(self.packed[:t], non_blocking=True)
            extra = [x.to("cpu", non_blocking=True) for x in extra]
            t0 = time.perf_counter()
            torch.cuda.current_stream(self.session.backend.device).synchronize()
            self.waited = time.perf_counter() - t0
            packed = host.numpy()
            k = self.topk
            parts = [packed[:, 0].astype(np.int64)]  # (fresh arrays: the buffer is reused)
            if k:
                parts += [packed[:, 1:1 + k].astype(np.int64), packed[:, 1 + k:].copy()]
            arrays = iter(parts + [x.numpy() for x in extra])
        else:  # eager buffers are new tensors every step: no copy needed
            parts = [self.argmax[:t]]
            if self.topk:
                parts += [self.topk_ids[:t], self.topk_lp[:t]]
            if full_logits:
                parts.append(self.logits[:t])
            if hidden:
                parts.append(self.hidden[:t].float())
            arrays = iter([x.numpy() for x in parts])
        out = StepOut(argmax=next(arrays), topk_ids=np.zeros((t, 0), dtype=np.int64),
                      topk_logprobs=np.zeros((t, 0), dtype=np.float32))
        if self.topk:
            out.topk_ids, out.topk_logprobs = next(arrays), next(arrays)
        if full_logits:
            out.logits = next(arrays)
        if hidden:
            out.hidden = next(arrays)
        return out


class ConcatSession:
    """The reference session: the past K/V sliced from the cache and concatenated with the
    block's in every layer (:class:`~edgemtp.models.decoder.TreeDecoder`, what the export
    traces), no graphs. ``TorchBackend(..., static_cache=False)``; tests hold the static
    session to it."""

    last_run_s = None

    def __init__(self, backend: TorchBackend) -> None:
        self.backend = b = backend
        self.k_cache = torch.zeros(b.cache_shape, dtype=b.dtype, device=b.device)
        self.v_cache = torch.zeros(b.cache_shape, dtype=b.dtype, device=b.device)
        self.cache_len = 0
        self._pending: tuple[torch.Tensor, torch.Tensor] | None = None

    @torch.inference_mode()
    def forward(self, input_ids, position_ids, tree_mask, mask_embeds, topk: int = 0,
                full_logits: bool = False, hidden: bool = False) -> StepOut:
        b, p = self.backend, self.cache_len
        dev = b.device
        ids = torch.as_tensor(input_ids, dtype=torch.long, device=dev)[None]
        pos = torch.as_tensor(position_ids, dtype=torch.long, device=dev)[None]
        mask = b.device_mask(tree_mask)[None, None]
        if mask_embeds is None:
            mask_embeds = np.zeros((1, b.hidden_size), dtype=np.float32)
        m = torch.as_tensor(mask_embeds, device=dev)
        past_k = [self.k_cache[i, :p][None] for i in range(self.k_cache.shape[0])]
        past_v = [self.v_cache[i, :p][None] for i in range(self.v_cache.shape[0])]
        h, new_k, new_v = b.decoder.body(ids, pos, mask, m, past_k, past_v)
        self._pending = torch.cat(new_k), torch.cat(new_v)           # [L, T, H_kv, D]
        logits = b.decoder.lm_head(h)[0].float()
        t = len(input_ids)
        out = StepOut(argmax=logits.argmax(-1).cpu().numpy(),
                      topk_ids=np.zeros((t, 0), dtype=np.int64),
                      topk_logprobs=np.zeros((t, 0), dtype=np.float32))
        if topk:
            lp, ix = torch.log_softmax(logits, -1).topk(min(topk, b.vocab_size), dim=-1)
            out.topk_ids, out.topk_logprobs = ix.cpu().numpy(), lp.cpu().numpy()
        if full_logits:
            out.logits = logits.cpu().numpy()
        if hidden:
            out.hidden = h[0].float().cpu().numpy()
        return out

    def commit(self, rows) -> None:
        k, v = self._pending
        r = len(rows)
        if self.cache_len + r > self.backend.max_context:
            raise ConfigError(f"committing {r} rows overruns the KV cache "
                              f"({self.cache_len} of {self.backend.max_context} rows used)")
        idx = torch.as_tensor(np.asarray(rows), dtype=torch.long, device=self.backend.device)
        self.k_cache[:, self.cache_len:self.cache_len + r] = k.index_select(1, idx)
        self.v_cache[:, self.cache_len:self.cache_len + r] = v.index_select(1, idx)
        self.cache_len += r

    def reset(self) -> None:
        self.cache_len = 0
        self._pending = None
