"""``edgemtp export``: a Hugging Face causal LM -> a self-contained ONNX package.

Stages: check the options and the output folder (bad ones fail here, before anything is read
or loaded) -> read the config (unsupported families and budgets that do not fit the model fail
here, before any weight is loaded) -> load the model -> trace the decoder graph ->
``onnx.checker`` -> self-check (the graph in ONNX Runtime against the PyTorch decoder on a real
prefill and a real tree step) -> plans, embeddings, tokenizer, manifest -> load the result as a
runtime would. Everything is written to a hidden partial folder beside the output and renamed
at the very end (``folders``), so a failed, interrupted or killed export never leaves a folder
that looks complete, and ``--force`` replaces an old package only once the new one is whole.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import math
import shutil
import struct
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING

import numpy as np

from edgemtp import __version__
from edgemtp.api import check_model_path
from edgemtp.budgets import check_bc, check_context, dynamic_table_size
from edgemtp.errors import ConfigError, ModelLoadError
from edgemtp.models.families import attention_window, family_for, missing_weights
from edgemtp.models.families import max_context as context_limit
from edgemtp.plans import static_plan
from edgemtp.runtimes.gguf_source import GGUFInfo, ModelSource, check_gguf, resolve_model
from edgemtp.runtimes.package import (CACHE_LAYOUTS, COMMIT, EMBEDDINGS, GRAPH, HOST_TABLE_BYTES,
                                      MANIFEST, TOKENIZER_FILES, CacheInfo, EmbeddingInfo,
                                      GGUFSourceInfo, GraphInfo, Manifest, PlanInfo,
                                      SelfCheckInfo, TensorRef, Tolerance, WeightsInfo,
                                      graph_inputs, graph_outputs, load_package, plan_arrays,
                                      record_files)

from .folders import ExportError, check_destination, partial_folder, swap_in, touch

if TYPE_CHECKING:
    from .selfcheck import CheckResult

__all__ = ["ExportError", "ExportOptions", "ExportReport", "export_package"]

# fp32/fp16: weights and activations; int4/int8: weight-only (MatMulNBits, blocks of 32),
# float32 activations and cache (export.quantize)
EXPORT_DTYPES = ("fp32", "fp16", "int4", "int8")
REQUANTIZE = ("none", "head", "all")  # ExportOptions.requantize
EXTERNAL_DATA_BYTES = 1_500_000_000  # above this, weights go to model.onnx.data
DEFAULT_OPSET = 17
# 13: kv_commit.onnx's Split takes its sizes as an input (and the decoder's dynamic Slice
# needs 10+); 23: the newest opset torch 2.13's TorchScript exporter writes. Both ends export,
# pass onnx.checker and the self-check, and generate (tests/test_package_errors.py)
OPSETS = range(13, 24)


@dataclass(frozen=True)
class ExportOptions:
    """What an export is asked for, checked before anything is read or loaded. ``budgets``
    (every (bc, k) pair that makes a plan) and ``skipped`` (the others) are derived."""

    dtype: str = "fp32"
    max_context: int | None = None
    bc: tuple[int, ...] = (10, 30, 60)
    mask_tokens: tuple[int, ...] = (1, 2)
    opset: int = DEFAULT_OPSET
    tolerance: tuple[float, float] | None = None
    hidden_states: bool = False  # the graph's last output: hidden states, for learned heads
    symmetric: bool = False      # int4/int8: scales only (no zero points), faster kernels
    # the past's layout: "seq" [1, P, H_kv, D] (every backend) or "head" [1, H_kv, P, D]
    # (fp32/fp16 on onnxruntime's CPU provider: faster long contexts)
    cache_layout: str = "seq"
    # int4 from a GGUF file: "none" keeps the file's own Q4_0/Q4_1 blocks and Q8_0 LM head
    # (export.gguf_blocks); "head" the body's blocks, the LM head re-quantized to 4 bits
    # (faster steps); "all" re-quantizes every weight
    requantize: str = "none"
    budgets: tuple[tuple[int, int], ...] = field(init=False)
    skipped: tuple[str, ...] = field(init=False)

    @property
    def activations(self) -> str:
        """The float dtype of activations and KV cache (the manifest's ``dtype``)."""
        return "fp32" if self.dtype in ("int4", "int8") else self.dtype

    def __post_init__(self) -> None:
        if self.dtype not in EXPORT_DTYPES:
            raise ConfigError(f"export dtype must be one of {', '.join(EXPORT_DTYPES)}, got "
                              f"{self.dtype!r}")
        if not _is_int(self.opset) or self.opset not in OPSETS:
            raise ConfigError(f"ONNX opset must be an integer from {OPSETS[0]} to "
                              f"{OPSETS[-1]}, got {self.opset!r}")
        if self.max_context is not None and (not _is_int(self.max_context)
                                             or self.max_context < 2):
            raise ConfigError(f"max context (--max-context) must be an integer >= 2 tokens, got "
                              f"{self.max_context!r}")
        if self.requantize not in REQUANTIZE:
            raise ConfigError(f"requantize must be one of {', '.join(REQUANTIZE)}, got "
                              f"{self.requantize!r}")
        if self.cache_layout not in CACHE_LAYOUTS:
            raise ConfigError(f"cache layout must be one of {', '.join(CACHE_LAYOUTS)}, got "
                              f"{self.cache_layout!r}")
        if self.cache_layout == "head" and self.dtype in ("int4", "int8"):
            raise ConfigError(f"--cache-layout head is for fp32/fp16 packages; {self.dtype} "
                              f"graphs keep exact attention sums, which read a sequence-major "
                              f"past (drop --cache-layout or export --dtype fp32)")
        if self.symmetric and self.dtype not in ("int4", "int8"):
            raise ConfigError(f"symmetric quantization is for int4/int8 exports, not "
                              f"{self.dtype}; drop --symmetric or export --dtype int4|int8")
        tol = self.tolerance
        if tol is not None and (len(tol) != 2 or not all(
                isinstance(t, (int, float)) and math.isfinite(t) and t > 0 for t in tol)):
            raise ConfigError(f"self-check tolerance must be two numbers > 0 (token rows, mask "
                              f"rows), got {tol!r}")
        bcs = sorted({check_bc(b, "block complexity (--bc)") for b in self.bc})
        ks = sorted({_mask_tokens(k) for k in self.mask_tokens})
        if not bcs or not ks:
            raise ConfigError(f"an export needs at least one budget and one mask-token count, "
                              f"got bc {list(self.bc)} and mask tokens {list(self.mask_tokens)}")
        object.__setattr__(self, "bc", tuple(bcs))
        object.__setattr__(self, "mask_tokens", tuple(ks))
        budgets, skipped = _plannable([(b, k) for b in bcs for k in ks], self._fits_context)
        object.__setattr__(self, "budgets", tuple(budgets))
        object.__setattr__(self, "skipped", tuple(skipped))

    def _fits_context(self, bc: int, k: int, context: int | None = None) -> None:
        # a plan's block must fit the KV cache next to a committed token; the model's own
        # limit can only make the context smaller than the one asked for
        context = context or self.max_context
        if context is not None:
            check_context(static_plan(bc, k).bc, context)

    def fit(self, vocab: int, context: int) -> tuple[list[tuple[int, int]], list[str]]:
        """The budgets whose plans fit the model: N + 1 <= vocab (top-K), T < max context."""
        def fits(b: int, k: int) -> None:
            n = static_plan(b, k).n_nodes
            if vocab < n + 1:
                raise ConfigError(f"a plan of {n} nodes needs a vocabulary of at least "
                                  f"{n + 1} tokens, the model has {vocab}")
            self._fits_context(b, k, context)

        budgets, skipped = _plannable(self.budgets, fits)
        return budgets, [*self.skipped, *skipped]


@lru_cache(maxsize=1)
def exporter_digest() -> str:
    """16 hex digits of SHA-256 over the code that writes a package's graph and weights
    (``edgemtp.export`` and the PyTorch models it traces, ``edgemtp.models``), recorded in
    the manifest: a package that holds another digest was written by other export code."""
    import hashlib

    from edgemtp import models

    h = hashlib.sha256()
    for folder in (Path(__file__).parent, Path(models.__file__).parent):
        for f in sorted(folder.glob("*.py")):
            h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:16]


def exported_here(path) -> bool:
    """Whether ``path`` holds a package this export code wrote (its manifest's ``exporter``
    digest is :func:`exporter_digest`): one another version wrote is exported again by the
    main job and the benches, so they run this edgemtp's graph."""
    manifest = Path(path) / MANIFEST
    try:
        return json.loads(manifest.read_text()).get("exporter") == exporter_digest()
    except (OSError, ValueError, AttributeError):
        return False


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _mask_tokens(k) -> int:
    if not _is_int(k) or k < 1:
        raise ConfigError(f"mask tokens per node (--mask-tokens) must be integers >= 1, "
                          f"got {k!r}")
    return k


def _plannable(pairs, check) -> tuple[list[tuple[int, int]], list[str]]:
    """The (bc, k) pairs whose static and dynamic plans compile and pass ``check``; the others
    are skipped (and reported), and none at all is an error."""
    keep, skipped, last = [], [], None
    for b, k in pairs:
        try:
            static_plan(b, k)
            dynamic_table_size(b, k)  # a dynamic table too large to precompile
            check(b, k)
            keep.append((b, k))
        except ConfigError as e:  # BudgetError included
            skipped.append(f"bc={b} k={k}")
            last = e
    if not keep:
        raise ExportError(f"no requested budget makes a plan ({', '.join(skipped)}): {last}")
    return keep, skipped


@dataclass
class ExportReport:
    out: Path
    family: str
    dtype: str
    seconds: float
    check: CheckResult
    plans: list[tuple[int, int]]
    skipped: list[str] = field(default_factory=list)
    graph_bytes: int = 0
    gguf: GGUFInfo | None = None
    kept_blocks: int = 0     # products that keep the GGUF file's own 4-bit blocks
    products: int = 0        # weight products (MatMul / MatMulNBits) in the graph
    context: int = 0         # the package's max context
    asked_context: int | None = None  # --max-context, where the model's limit capped it
    window: int | None = None  # the model's sliding attention window, where it set the limit
    tokenizer: bool = True     # the package carries tokenizer files
    head8_from: str | None = None  # the file's wide LM head type, kept at 8 bits

    def _head(self) -> str:
        return (f" (the LM head at 8 bits: the file stores it as {self.head8_from})"
                if self.head8_from else "")

    def summary(self) -> str:
        skipped = f"; skipped {', '.join(self.skipped)}" if self.skipped else ""
        if self.gguf is None:
            dtype = self.dtype + (", the LM head at 8 bits as llama.cpp keeps a 4-bit "
                                  "model's (--requantize head: 4 bits)" if self.head8_from else "")
        elif self.kept_blocks:
            rest = self.products - self.kept_blocks
            dtype = (f"{self.dtype}, weights from GGUF {self.gguf.file}: "
                     f"{self.gguf.quant_summary()}; {self.kept_blocks} of {self.products} "
                     f"products keep the file's own blocks"
                     f"{f', {rest} re-quantized' if rest else ''}{self._head()}")
        else:
            dtype = (f"{self.dtype}, weights de-quantized from GGUF {self.gguf.file}: "
                     f"{self.gguf.quant_summary()}"
                     f"{', then re-quantized' if self.dtype in ('int4', 'int8') else ''}"
                     f"{self._head()}")
        capped = (f" (--max-context {self.asked_context} capped to the model's limit)"
                  if self.asked_context is not None and self.asked_context > self.context else "")
        if self.window is not None and self.window == self.context:
            capped += (" (the model's sliding attention window: edgemtp attends to the whole "
                       "cache, which is the model's attention only within the window)")
        return (f"exported {self.family} ({dtype}) to {self.out} in {self.seconds:.1f} s: "
                f"max context {self.context}{capped}, "
                f"graph {self.graph_bytes / 2**20:.1f} MiB, {len(self.plans)} plan "
                f"budget{'' if len(self.plans) == 1 else 's'}"
                f"{skipped}; self-check max |logit diff| {self.check.token_rows:.1e} on token "
                f"rows, {self.check.mask_rows:.1e} on mask rows (logit scale "
                f"{self.check.scale:.3g})"
                + ("" if self.tokenizer else
                   "; no tokenizer (the model folder has no tokenizer files): the CLI needs "
                   "one, the Python API takes token ids"))


# -- entry point ----------------------------------------------------------------------------


def export_package(model: str, out, dtype: str = "fp32", max_context: int | None = None,
                   bc: tuple[int, ...] = (10, 30, 60), mask_tokens: tuple[int, ...] = (1, 2),
                   opset: int = DEFAULT_OPSET, force: bool = False,
                   trust_remote_code: bool = False,
                   tolerance: tuple[float, float] | None = None,
                   progress: bool = True, hidden_states: bool = False,
                   symmetric: bool = False, cache_layout: str = "seq",
                   requantize: str | None = None) -> ExportReport:
    """Export ``model`` (a local Hugging Face folder, a llama.cpp GGUF file or a folder
    holding one, or a hub id when online) to ``out``.

    ``tolerance``: (token rows, mask rows) for the self-check, relative to the logit scale;
    default ``selfcheck.TOLERANCE[dtype]``. ``hidden_states``: the graph also outputs the
    last hidden states ``[1, T, d]`` (after the final norm), which learned heads read
    (``edgemtp train-heads``). ``symmetric`` (int4/int8): blocks with a scale and no zero
    point, as onnxruntime-genai's builder writes them: about a quarter faster per quantized
    MatMul on a few rows, and a coarser grid than asymmetric blocks (a Q4_1 GGUF's own weights
    are asymmetric). ``cache_layout`` "head" (fp32/fp16): the past K/V head-major, ``[1, H_kv,
    P, D]``, which onnxruntime's CPU provider reads faster on long contexts; such a package
    runs on onnxruntime's CPU provider only. ``requantize`` (int4; None: not asked, as
    "none", which ``symmetric`` contradicts only when asked): by default ("none") the
    LM head is 8-bit, as llama.cpp keeps a 4-bit model's (a float model's head in Q8_0 blocks;
    from a GGUF file its Q8_0 head as it is, a wider one's values in Q8_0 blocks), and the
    products whose weights are a GGUF file's own Q4_0/Q4_1 blocks keep them exactly
    (:mod:`export.gguf_blocks`); "head" puts the head into 4-bit blocks (one-row steps ~15 %
    faster on SmolLM2, further from the source model); "all" quantizes every weight again
    with onnxruntime's quantizer.
    """
    t0 = time.perf_counter()
    options = ExportOptions(dtype, max_context, tuple(bc), tuple(mask_tokens), opset,
                            None if tolerance is None else tuple(tolerance), hidden_states,
                            symmetric, cache_layout, requantize or "none")
    # (None: not asked; "none" asked is a choice too, which --symmetric contradicts)
    if requantize is not None and options.dtype != "int4":
        raise ConfigError(f"--requantize {requantize} picks which weights an int4 export puts "
                          f"into new 4-bit blocks; this is an {options.dtype} export: drop "
                          f"--requantize")  # ("an": eff-, int-)
    if options.symmetric and requantize in ("none", "head"):
        raise ConfigError(f"--symmetric puts every weight into new symmetric 4-bit blocks, so "
                          f"it cannot keep an 8-bit LM head or a GGUF's own blocks "
                          f"(--requantize {requantize}); drop one of the two")
    out = check_destination(model, out, force)  # before the heavy imports: fail fast
    source, gguf = _check_source(model)
    with partial_folder(out) as tmp:  # an unwritable place fails here, before any loading
        from tqdm import tqdm

        from edgemtp.runtimes.torch_backend import load_hf_config

        from .graph import check_rope

        config = load_hf_config(model, trust_remote_code)
        family = family_for(config)          # unsupported families fail before any weight loads
        check_rope(config)
        context = context_limit(config, family, options.max_context)
        budgets, skipped = options.fit(int(config.vocab_size), context)
        bar = tqdm(total=6, desc=f"export {out.name}", disable=not progress,  # 6 stages
                   bar_format="{desc}: {n_fmt}/{total_fmt}{postfix} [{elapsed}]")
        try:
            job = _Job(model, source, gguf, family, options, context, budgets,
                       trust_remote_code, progress)
            check = _export_into(tmp, job, bar)
        except OSError as e:  # a full disk, a folder removed underneath
            raise ExportError(f"writing the package failed: {_write_error(e, out.parent)}"
                              ) from None
        finally:
            bar.close()
        written = load_package(tmp)  # what export wrote must load before it may look complete
        w = written.weights
        swap_in(tmp, out)
    return ExportReport(out, family.name, options.dtype, time.perf_counter() - t0, check,
                        budgets, skipped, sum(f.stat().st_size for f in out.glob(f"{GRAPH}*")),
                        gguf, w.kept_blocks, w.products, context, options.max_context,
                        attention_window(config, family),
                        bool(written.manifest.get("tokenizer", True)), w.head8_from)


@dataclass(frozen=True)
class _Job:
    """One export's resolved inputs (options checked, config read, budgets fitted)."""

    model: str
    source: ModelSource     # what from_pretrained reads (a GGUF file: folder + file name)
    gguf: GGUFInfo | None   # the GGUF file's own description, when the source is one
    family: object          # models.families.Family
    options: ExportOptions
    context: int            # KV cache rows the package declares
    budgets: list[tuple[int, int]]
    trust_remote_code: bool
    progress: bool


@contextmanager
def _stage(bar, label: str, tmp: Path):
    bar.set_postfix_str(label, refresh=True)
    touch(tmp)  # a live export's partial folder is never stale
    yield
    bar.update()


def _export_into(tmp: Path, job: _Job, bar) -> CheckResult:
    import onnx
    import torch

    from edgemtp.models.decoder import TreeDecoder

    from .graph import ExportDecoder, ExportTreeDecoder, commit_graph, shape_reads
    from .quantize import QUANTIZED, fake_quantize
    from .selfcheck import TOLERANCE, self_check

    dtype, opset = job.options.activations, job.options.opset
    with _stage(bar, "loading the model", tmp):
        hf = _load_model(job, {"fp32": torch.float32, "fp16": torch.float16}[dtype])
        decoder = ExportTreeDecoder(hf, job.family)
        if job.options.dtype in QUANTIZED:  # batch-invariant softmax (export.quantize)
            decoder.exact_attention = True
            decoder.fuse(job.context)  # onnxruntime contrib ops, as MatMulNBits already are
        decoder.head_major = job.options.cache_layout == "head"
        topk = min(int(hf.config.vocab_size),
                   max(static_plan(b, k).n_nodes for b, k in job.budgets) + 1)
        hidden = job.options.hidden_states
        module = ExportDecoder(decoder, topk, hidden).eval()
        # the self-check holds the graph to the decoder the PyTorch backend runs (its hidden
        # states too, at the K/V tolerance)
        reference = ExportDecoder(TreeDecoder(hf, job.family), topk, hidden).eval()

    with _stage(bar, "tracing the graph", tmp):
        blocks = _file_blocks(job, hf.config)
        graph = _write_graph(module, tmp, hf.dtype, opset, job.options.dtype,
                             job.options.symmetric, blocks)
        if graph.spec is not None:  # the reference gets the same de-quantized weights
            fake_quantize(hf, graph.spec, blocks)

    with _stage(bar, "onnx.checker", tmp):
        value_dtype = "fp64" if decoder.exact_attention else None  # see graph.exact_sums
        onnx.save_model(commit_graph(len(decoder.model.layers), dtype, opset, value_dtype),
                        str(tmp / COMMIT))
        for name in (GRAPH, COMMIT):
            try:
                onnx.checker.check_model(str(tmp / name))  # by path: works with external data
            except onnx.checker.ValidationError as e:
                raise ExportError(f"the exported {name} fails onnx.checker: "
                                  f"{_first_line(e)}") from None

    with _stage(bar, "self-check against PyTorch", tmp):
        tokenizer, tokenizer_files = _save_tokenizer(job, tmp)
        tol, fmt = job.options.tolerance, job.options.dtype
        if graph.spec is None:
            tol = tol or TOLERANCE[fmt]
            check = self_check(tmp / GRAPH, reference, job.budgets, tokenizer, tol,
                               head_major=decoder.head_major)
        else:  # the weights strictly, with float32 activations; the shipped graph loosely
            tol = tol or TOLERANCE["fp32"]
            check = _check_quantized(tmp, reference, job, tokenizer, tol, TOLERANCE[fmt],
                                     graph.weights.kept_blocks)

    with _stage(bar, "plans and embeddings", tmp):
        plans = [PlanInfo.compile(b, k) for b, k in job.budgets]
        (tmp / "plans").mkdir()
        for p in plans:
            np.savez(tmp / p.file, **plan_arrays(p.bc, p.k))
        table = hf.get_input_embeddings().weight.detach()
        if graph.table is None:
            np.save(tmp / EMBEDDINGS, table.cpu().numpy())
        t32 = table.float()  # statistics as the PyTorch backend computes them
        stats = {"dtype": dtype, "mu": tuple(t32.mean(0).tolist()),
                 "sigma": tuple(t32.std(0).tolist())}
        embeddings = EmbeddingInfo(**stats, **(graph.table or {}))

    with _stage(bar, "manifest", tmp):
        cfg, layers = hf.config, len(decoder.model.layers)
        manifest = Manifest(
            edgemtp_version=__version__, exporter=exporter_digest(),
            source=_source_name(job), family=job.family.name,
            model_type=cfg.model_type,
            architectures=tuple(getattr(cfg, "architectures", None) or ()),
            hidden_size=int(cfg.hidden_size), num_layers=layers,
            num_heads=int(decoder.n_heads), num_kv_heads=int(decoder.n_kv),
            head_dim=int(decoder.head_dim), vocab_size=int(cfg.vocab_size),
            eos_token_ids=_eos_ids(hf), bos_token_id=_int_or_none(cfg, "bos_token_id"),
            dtype=dtype, max_context=job.context, topk=topk,
            graph=GraphInfo(opset=opset, external_data=graph.external,
                            inputs=tuple(graph_inputs(layers)),
                            outputs=tuple(graph_outputs(layers, hidden)),
                            shape_reads=shape_reads(tmp / GRAPH)),
            cache=CacheInfo(dtype=dtype, value_dtype=value_dtype,
                            layout=CACHE_LAYOUTS[job.options.cache_layout]),
            plans=tuple(plans),
            embeddings=embeddings,
            tokenizer=tokenizer is not None, tokenizer_files=tokenizer_files,
            files=record_files(tmp),
            self_check=SelfCheckInfo(
                token_rows_max_logit_diff=check.token_rows,
                mask_rows_max_logit_diff=check.mask_rows, logit_scale=check.scale,
                tolerance=Tolerance(token_rows=tol[0], mask_rows=tol[1])),
            gguf=_gguf_info(job.gguf), weights=graph.weights)
        (tmp / MANIFEST).write_text(json.dumps(manifest.to_dict(), indent=1) + "\n")
    return check


SOURCE_TYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}


def _file_blocks(job: _Job, config=None):
    """The GGUF file's Q4_0/Q4_1 blocks an int4 export keeps, and its LM head's 8 bits; from
    a float model (a folder), its LM head's 8 bits (:class:`FloatHead`). None: not int4,
    symmetric or ``requantize`` "all" asked (or "head" from a folder), or neither such blocks
    nor a head wider than 4 bits in the GGUF file."""
    o = job.options
    if o.dtype != "int4" or o.symmetric or o.requantize == "all":
        return None
    from .gguf_blocks import WIDE_TYPES, FileBlocks, FloatHead

    if job.gguf is None:  # a float model: its head at 8 bits unless --requantize head
        if o.requantize == "head":
            return None
        dtype = getattr(config, "dtype", None)  # (transformers 5; torch_dtype before)
        if dtype is None:
            dtype = getattr(config, "torch_dtype", None)
        dtype = str(dtype or "float32").replace("torch.", "")
        return FloatHead(SOURCE_TYPES.get(dtype, dtype))

    blocks = FileBlocks(job.source.path, eight_bit=o.requantize == "none")
    wide_head = blocks.eight_bit and blocks.head_type in WIDE_TYPES  # (an 8-bit head)
    return blocks if len(blocks) or wide_head else None


def _check_quantized(tmp: Path, reference, job: _Job, tokenizer, strict, loose,
                     kept: int = 0):
    """Self-check a quantized graph twice against PyTorch with the same de-quantized weights:
    a copy whose kernels keep float32 activations at the float32 tolerance (every weight and
    scale exactly right), then the graph as shipped at ``loose`` (int8 activations). ``kept``:
    the products that keep a GGUF's own blocks (a failure then says how to re-quantize them:
    stories260K's Q4_1 blocks beside int8 activations went past the loose tolerance while
    the graph gave them zero point 0, where onnxruntime's own re-quantization stayed
    within it)."""
    import onnx

    from .quantize import float_activations
    from .selfcheck import SelfCheckError, self_check

    proto = onnx.load(str(tmp / GRAPH), load_external_data=False)
    float_activations(proto)
    copy = tmp / f"_strict_{GRAPH}"  # beside the graph: it reads the same external data
    onnx.save_model(proto, str(copy))
    try:
        check = self_check(copy, reference, job.budgets, tokenizer, strict)
    finally:
        copy.unlink()
    try:
        self_check(tmp / GRAPH, reference, job.budgets, tokenizer, loose)
    except SelfCheckError as e:
        if not kept:
            raise
        raise SelfCheckError(f"{e} ({kept} products keep the GGUF's own 4-bit blocks, whose "
                             f"weights are exact (checked with float activations); with int8 "
                             f"activations they go past the tolerance: --requantize all "
                             f"re-quantizes them with onnxruntime's quantizer, or --dtype int8 "
                             f"keeps more precision)") from None
    return check


# -- pieces ---------------------------------------------------------------------------------


def _check_source(model: str) -> tuple[ModelSource, GGUFInfo | None]:
    """A local model is read before anything heavy is imported: a folder needs a config.json
    of a supported family and whole ``*.safetensors`` files, a GGUF file must be whole and of
    a supported architecture (a hub id is checked on loading)."""
    check_model_path(model)
    source = resolve_model(model)
    if source.gguf_file:
        return source, check_gguf(source, sha256=True)
    _check_folder(model)
    return source, None


def _source_name(job: _Job) -> str:
    """The manifest's ``source``: the GGUF file's absolute path, a local folder's absolute
    path (``--backend torch`` on the package then finds it from any directory), else the hub
    id given."""
    if job.gguf:
        return str(Path(job.source.path).resolve())
    local = Path(str(job.model)).expanduser()
    return str(local.resolve()) if local.is_dir() else str(job.model)


def _gguf_info(info: GGUFInfo | None) -> GGUFSourceInfo | None:
    if info is None:
        return None
    return GGUFSourceInfo(file=info.file, bytes=info.bytes, architecture=info.architecture,
                          tensor_types=info.tensor_types, sha256=info.sha256)


def _check_folder(model: str) -> None:
    src = Path(model)
    if not src.is_dir():
        return
    path = src / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"{model!r} has no config.json; expected a Hugging Face model folder")
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"cannot read the model config {str(path)!r}: "
                             f"{_first_line(e)}") from None
    if not isinstance(config, dict):
        raise ModelLoadError(f"the model config {str(path)!r} should be a JSON object, got "
                             f"{type(config).__name__}")
    if "auto_map" not in config:  # the model's own code may name another type: load decides
        family_for(SimpleNamespace(model_type=config.get("model_type"),
                                   architectures=config.get("architectures")))
    for weights in sorted(src.glob("*.safetensors")):
        _check_safetensors(weights)


def _check_safetensors(path: Path) -> None:
    """Its size must be exactly what its header describes (8-byte length, JSON header,
    tensors): a truncated file fails here, by name, before any weight loads."""
    if path.is_file():
        size = path.stat().st_size
        want = _safetensors_size(path, size)
        if want != size:
            described = "no readable header" if want is None else f"a header for {want} bytes"
            raise ModelLoadError(f"the weights file {str(path)!r} is damaged: {size} bytes with "
                                 f"{described} (truncated or incomplete download?); restore it")


def _safetensors_size(path: Path, size: int) -> int | None:
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8)) if size >= 8 else (size,)
            if 8 + n > size:
                return None
            header = json.loads(f.read(n))
        ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
        return 8 + n + max(ends, default=0)
    except (OSError, ValueError, TypeError, KeyError, IndexError, AttributeError, struct.error):
        return None


@contextmanager
def _transformers_progress(enabled: bool):
    """transformers' own progress bars (``Loading weights``, and the GGUF loader's
    ``Converting and de-quantizing GGUF tensors``, a tqdm of its own) follow ``progress``;
    its load report (missing and unexpected tensors) is left out: :func:`_load_model` says
    what matters of it in one line."""
    import functools

    from transformers.utils import logging as hf_logging

    try:
        from transformers import modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:  # (an older transformers without it: nothing to quiet)
        gguf_utils = None
    bar = getattr(gguf_utils, "tqdm", None)
    was, level = hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity()
    (hf_logging.enable_progress_bar if enabled else hf_logging.disable_progress_bar)()
    hf_logging.set_verbosity_error()
    if bar is not None and not enabled:
        gguf_utils.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        (hf_logging.enable_progress_bar if was else hf_logging.disable_progress_bar)()
        hf_logging.set_verbosity(level)
        if bar is not None:
            gguf_utils.tqdm = bar


def _load_model(job: _Job, torch_dtype):
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM

    try:
        with _transformers_progress(job.progress):
            hf, info = AutoModelForCausalLM.from_pretrained(
                job.source.folder, dtype=torch_dtype, trust_remote_code=job.trust_remote_code,
                output_loading_info=True, **job.source.pretrained_kwargs())
    except (OSError, ValueError, RuntimeError, SafetensorError) as e:
        raise ExportError(f"cannot load {job.model!r} as a causal LM: {_first_line(e)}") from None
    # (transformers would fill a missing weight with random values: an export would ship
    #  them as the model)
    problem = missing_weights(job.model, info)
    if problem:
        raise ExportError(problem)
    # (qa8b D5: a GGUF with NaN block scales exported, self-checked against the same NaNs, and
    #  ran; llama.cpp's --check-tensors reports such blocks)
    import torch

    for name, p in hf.named_parameters():
        bad = int((~torch.isfinite(p)).sum())
        if bad:
            raise ExportError(f"{job.model!r} is damaged: its weight {name} holds {bad} NaN or "
                              f"infinite values (of {p.numel()}); get the file again")
    return hf.eval()


@dataclass
class _Graph:
    """What writing ``model.onnx`` produced."""

    external: str | None          # the external weights file, if any
    weights: WeightsInfo
    spec: object | None = None    # export.quantize.QuantSpec of an int4/int8 graph
    table: dict | None = None     # EmbeddingInfo fields of a graph-resident host table


def _write_graph(module, tmp: Path, torch_dtype, opset: int, fmt: str,
                 symmetric: bool = False, file_blocks=None) -> _Graph:
    """Trace into a scratch folder, tidy, store a tied embedding once, quantize (int4/int8),
    then save ``model.onnx`` as one file (weights inside) or, for large or quantized models,
    with one external weights file (a quantized tied table is read from it by the host)."""
    import onnx
    from torch.onnx import OnnxExporterError

    from .graph import tidy_graph, trace_to_onnx
    from .quantize import QUANTIZED, quantize_graph, tie_float_embedding

    scratch = tmp / "_trace"
    scratch.mkdir()
    try:
        try:
            trace_to_onnx(module, scratch / GRAPH, torch_dtype, opset)
        except OnnxExporterError as e:
            raise ExportError(f"torch.onnx cannot export this model at opset {opset}: "
                              f"{_first_line(e)}") from None
        proto = onnx.load(str(scratch / GRAPH))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    tidy_graph(proto, module)
    spec = QUANTIZED.get(fmt)
    if spec is not None and symmetric:
        spec = dataclasses.replace(spec, symmetric=True)
    kept: list[str] = []
    tied = quantize_graph(proto, spec, file_blocks, kept) if spec else tie_float_embedding(proto)
    products = sum(n.op_type == "MatMulNBits" for n in proto.graph.node) if spec else 0
    weights = WeightsInfo(format=fmt, tied_embedding=tied is not None,
                          **({"kept_blocks": len(kept), "products": products} if kept else {}),
                          # (a Q8_0 head is one of the kept blocks too, and named: qa8b D11)
                          **({"head8_from": file_blocks.head_name} if file_blocks is not None
                             and file_blocks.head_at_8 else {}),
                          **({"block_size": spec.block_size, "symmetric": spec.symmetric,
                              "accuracy_level": spec.accuracy_level,
                              "min_rows": spec.min_rows, "softmax": "exact",
                              "fused": bool(getattr(module.decoder, "fused", False))}
                             if spec else {}))
    size = sum(p.numel() * p.element_size() for p in module.parameters())
    # the float embedding the graph's Gather reads (an untied quantized model's; a float
    # model's, tied or not, where it is big): the host maps it from the graph's weights file
    # rather than from a second copy in embeddings.npy
    emb = module.decoder.model.embed_tokens.weight
    big = emb.numel() * emb.element_size() >= HOST_TABLE_BYTES
    rows = _float_table(proto, module) if (spec and tied is None) or (not spec and big) \
        else None
    external = f"{GRAPH}.data" if spec or size > EXTERNAL_DATA_BYTES or rows else None
    if external:
        from onnx.external_data_helper import convert_model_to_external_data, set_external_data

        convert_model_to_external_data(proto, all_tensors_to_one_file=True, location=external,
                                       size_threshold=1024)
        for init in proto.graph.initializer:  # the host maps a table, however small
            if ((tied and init.name in (tied.data, tied.scales, tied.zero_points))
                    or init.name == rows) and not init.external_data:
                set_external_data(init, external)
        onnx.save_model(proto, str(tmp / GRAPH))
        # onnx creates the weights file owner-only; give it model.onnx's mode (the umask's)
        (tmp / external).chmod((tmp / GRAPH).stat().st_mode & 0o777)
    else:
        onnx.save_model(proto, str(tmp / GRAPH))
    table = _table_refs(tmp / GRAPH, tied, spec, external) if spec and tied else None
    if rows is not None:
        table = {"file": external, "layout": "graph-rows",
                 "data": _external_ref(tmp / GRAPH, rows, external)}
    return _Graph(external, weights, spec, table)


def _float_table(proto, module) -> str | None:
    """The initializer the graph's embedding Gather reads, where it is the float32 or
    float16 ``[vocab, hidden]`` table; else None."""
    vocab, hidden = module.decoder.model.embed_tokens.weight.shape
    inits = {i.name: i for i in proto.graph.initializer}
    for node in proto.graph.node:
        if node.op_type == "Gather" and node.input[0] in inits:
            init = inits[node.input[0]]
            if list(init.dims) == [vocab, hidden] and init.data_type in (1, 10):  # FLOAT(16)
                return init.name
    return None


def _external_ref(path: Path, name: str, external: str) -> TensorRef:
    """Where initializer ``name`` of the saved graph lies in its external data file."""
    import onnx

    init = next(i for i in onnx.load(str(path), load_external_data=False).graph.initializer
                if i.name == name)
    where = {e.key: e.value for e in init.external_data}
    assert where.get("location") == external, (name, where)
    dtype = onnx.helper.tensor_dtype_to_np_dtype(init.data_type)
    return TensorRef(offset=int(where.get("offset", 0)), shape=tuple(init.dims), dtype=dtype.name)


def _table_refs(path: Path, tied, spec, external: str) -> dict:
    """Where the saved graph's tied quantized table lies in its external data file."""

    def ref(name: str) -> TensorRef:
        r = _external_ref(path, name, external)
        if name == tied.data:  # the blob [V, d/bs, bs*bits/8] read as rows [V, d*bits/8]
            r = dataclasses.replace(r, shape=(r.shape[0], math.prod(r.shape[1:])))
        return r

    return {"file": external, "layout": "block-quantized", "bits": tied.bits or spec.bits,
            "block_size": spec.block_size, "data": ref(tied.data), "scales": ref(tied.scales),
            "zero_points": ref(tied.zero_points) if tied.zero_points else None}


def _save_tokenizer(job: _Job, tmp: Path):
    """Copy the tokenizer into the package: (tokenizer, files written), or (None, ()) when the
    model folder has none."""
    from transformers import AutoTokenizer

    src = Path(job.model)
    if not job.gguf and src.is_dir() and not any((src / f).is_file() for f in TOKENIZER_FILES):
        return None, ()  # some tokenizer classes build an empty tokenizer from nothing
    try:  # a GGUF file carries its tokenizer (and chat template) in its metadata
        tok = AutoTokenizer.from_pretrained(job.source.folder,
                                            trust_remote_code=job.trust_remote_code,
                                            **job.source.pretrained_kwargs())
    except (OSError, ValueError, TypeError):
        return None, ()
    if len(tok) < 2:
        return None, ()
    # the chat template goes inside tokenizer_config.json (not chat_template.jinja): one JSON
    # holds everything a runtime reading the package with the tokenizers library needs
    written = tok.save_pretrained(str(tmp), save_jinja_files=False)
    return tok, tuple(sorted(Path(f).relative_to(tmp).as_posix() for f in written
                             if Path(f).is_file()))


def _eos_ids(hf) -> tuple[int, ...]:
    eos = getattr(hf.generation_config, "eos_token_id", None)
    eos = hf.config.eos_token_id if eos is None else eos
    return tuple(int(e) for e in (eos if isinstance(eos, (list, tuple)) else
                                  ([] if eos is None else [eos])))


def _int_or_none(cfg, key: str) -> int | None:
    value = getattr(cfg, key, None)
    return value if _is_int(value) else None


def _write_error(e: OSError, folder: Path) -> str:
    """An OSError while writing, said as the disk's state where that is the cause (numpy's
    short write says "32768 requested and 14304 written", not "no space left")."""
    full = e.errno == errno.ENOSPC
    if not full:
        try:
            full = shutil.disk_usage(folder).free < (1 << 20)
        except OSError:
            pass
    if full:
        return f"no space left on the device holding {str(folder)!r}"
    return _first_line(e)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
