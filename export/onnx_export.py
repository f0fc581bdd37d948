"""``edgemtp export``: a Hugging Face causal LM -> a self-contained ONNX package.

Stages: read the config (unsupported families fail here, before any weight is loaded) ->
load the model -> trace the decoder graph -> ``onnx.checker`` -> self-check (the graph in
ONNX Runtime against the PyTorch decoder on a real prefill and a real tree step) -> plans,
embeddings, tokenizer, manifest. Everything is written to a temporary folder beside the
output and renamed at the very end, so a failed or interrupted export never leaves a folder
that looks complete, and ``--force`` replaces an old package only once the new one is whole.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from edgemtp import __version__
from edgemtp.errors import BudgetError, ConfigError, EdgeMTPError
from edgemtp.budgets import nodes_for_budget
from edgemtp.plans import static_plan
from edgemtp.runtimes.package import (CACHE_LAYOUT, COMMIT, EMBEDDINGS, FORMAT_VERSION, GRAPH,
                                      MANIFEST, graph_inputs, graph_outputs, plan_arrays,
                                      plan_entry)

if TYPE_CHECKING:
    from .selfcheck import CheckResult

EXPORT_DTYPES = ("fp32", "fp16")
EXTERNAL_DATA_BYTES = 1_500_000_000  # above this, weights go to model.onnx.data
DEFAULT_OPSET = 17
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json",
                   "vocab.txt", "spiece.model", "merges.txt")


class ExportError(EdgeMTPError):
    """An export that cannot be done, or whose graph failed its own check."""


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

    def summary(self) -> str:
        skipped = f"; skipped {', '.join(self.skipped)}" if self.skipped else ""
        return (f"exported {self.family} ({self.dtype}) to {self.out} in {self.seconds:.1f} s: "
                f"graph {self.graph_bytes / 2**20:.1f} MiB, {len(self.plans)} plan budgets"
                f"{skipped}; self-check max |logit diff| {self.check.token_rows:.1e} on token "
                f"rows, {self.check.mask_rows:.1e} on mask rows (logit scale "
                f"{self.check.scale:.3g})")


# -- entry point ----------------------------------------------------------------------------


def export_package(model: str, out, dtype: str = "fp32", max_context: int | None = None,
                   bc: tuple[int, ...] = (10, 30, 60), mask_tokens: tuple[int, ...] = (1, 2),
                   opset: int = DEFAULT_OPSET, force: bool = False,
                   trust_remote_code: bool = False,
                   tolerance: tuple[float, float] | None = None,
                   progress: bool = True) -> ExportReport:
    """Export ``model`` (a local Hugging Face folder, or a hub id when online) to ``out``.

    ``tolerance``: (token rows, mask rows) for the self-check, relative to the logit scale;
    default ``selfcheck.TOLERANCE[dtype]``.
    """
    t0 = time.perf_counter()
    out = Path(out)
    _check_destination(model, out, force)  # before the heavy imports: fail fast
    if dtype not in EXPORT_DTYPES:
        raise ConfigError(f"export dtype must be one of {', '.join(EXPORT_DTYPES)}, got {dtype!r}")
    from tqdm import tqdm

    from edgemtp.models.families import family_for
    from edgemtp.runtimes.torch_backend import load_hf_config

    from .graph import check_rope

    config = load_hf_config(model, trust_remote_code)
    family = family_for(config)          # unsupported families fail before any weight loads
    check_rope(config)
    budgets, skipped = _budgets(bc, mask_tokens, int(config.vocab_size))
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    out.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    bar = tqdm(total=6, desc=f"export {out.name}", disable=not progress,  # 6 stages
               bar_format="{desc}: {n_fmt}/{total_fmt}{postfix} [{elapsed}]")
    try:
        check = _export_into(tmp, model, family, dtype, max_context, budgets, opset,
                             trust_remote_code, tolerance, bar)
        _swap_in(tmp, out)
    except BaseException:  # interrupts included: never leave a half-written package
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        bar.close()
    return ExportReport(out, family.name, dtype, time.perf_counter() - t0, check, budgets,
                        skipped, sum(f.stat().st_size for f in out.glob(f"{GRAPH}*")))


@contextmanager
def _stage(bar, label: str):
    bar.set_postfix_str(label, refresh=True)
    yield
    bar.update()


def _export_into(tmp: Path, model: str, family, dtype: str, max_context: int | None,
                 budgets: list[tuple[int, int]], opset: int, trust_remote_code: bool,
                 tolerance: tuple[float, float] | None, bar) -> CheckResult:
    import onnx
    import torch
    from transformers import AutoModelForCausalLM

    from edgemtp.models.decoder import TreeDecoder
    from edgemtp.models.families import max_context as context_limit

    from .graph import ExportDecoder, ExportTreeDecoder, commit_graph
    from .selfcheck import TOLERANCE, self_check

    with _stage(bar, "loading the model"):
        torch_dtype = {"fp32": torch.float32, "fp16": torch.float16}[dtype]
        try:
            hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch_dtype,
                                                      trust_remote_code=trust_remote_code)
        except (OSError, ValueError) as e:
            raise ExportError(f"cannot load {model!r} as a causal LM: {_first_line(e)}") from None
        hf.eval()
        decoder = ExportTreeDecoder(hf, family)
        topk = min(int(hf.config.vocab_size),
                   max(nodes_for_budget(b, k) for b, k in budgets) + 1)
        module = ExportDecoder(decoder, topk).eval()
        # the self-check holds the graph to the decoder the PyTorch backend runs
        reference = ExportDecoder(TreeDecoder(hf, family), topk).eval()

    with _stage(bar, "tracing the graph"):
        external = _write_graph(module, tmp, torch_dtype, opset)

    with _stage(bar, "onnx.checker"):
        onnx.save_model(commit_graph(len(decoder.model.layers), dtype, opset), str(tmp / COMMIT))
        for name in (GRAPH, COMMIT):
            try:
                onnx.checker.check_model(str(tmp / name))  # by path: works with external data
            except onnx.checker.ValidationError as e:
                raise ExportError(f"the exported {name} fails onnx.checker: "
                                  f"{_first_line(e)}") from None

    with _stage(bar, "self-check against PyTorch"):
        tokenizer = _save_tokenizer(model, tmp, trust_remote_code)
        tol = TOLERANCE[dtype] if tolerance is None else tuple(tolerance)
        check = self_check(tmp / GRAPH, reference, budgets, tokenizer, tol)

    with _stage(bar, "plans and embeddings"):
        (tmp / "plans").mkdir()
        for b, k in budgets:
            np.savez(tmp / plan_entry(b, k)["file"], **plan_arrays(b, k))
        table = hf.get_input_embeddings().weight.detach()
        np.save(tmp / EMBEDDINGS, table.cpu().numpy())
        t32 = table.float()  # statistics as the PyTorch backend computes them
        mu, sigma = t32.mean(0).cpu().numpy(), t32.std(0).cpu().numpy()

    with _stage(bar, "manifest"):
        manifest = _manifest(model, hf, decoder, family, dtype,
                             context_limit(hf.config, family, max_context), budgets, topk,
                             opset, external, tokenizer is not None, mu, sigma, check, tol)
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return check


# -- pieces ---------------------------------------------------------------------------------


def _check_destination(model: str, out: Path, force: bool) -> None:
    if out.exists() and not force:
        raise ExportError(f"the output folder {str(out)!r} exists; pass --force to replace it")
    if out.exists() and not out.is_dir():
        raise ExportError(f"the output {str(out)!r} is a file, not a folder; remove it first")
    src = Path(model)
    if src.exists() and out.exists():
        s, o = src.resolve(), out.resolve()
        if s == o or o in s.parents:
            raise ExportError(f"the output folder {str(out)!r} holds the model being exported; "
                              f"choose another output folder")


def _budgets(bcs, ks, vocab: int) -> tuple[list[tuple[int, int]], list[str]]:
    """Every (bc, k) pair that makes a valid static and dynamic plan; the others are skipped
    and reported, and an export with no plan at all fails."""
    keep, skipped, last = [], [], None
    for b in sorted(set(int(x) for x in bcs)):
        for k in sorted(set(int(x) for x in ks)):
            try:
                plan = static_plan(b, k)
                if vocab < plan.n_nodes + 1:
                    raise BudgetError(f"a plan of {plan.n_nodes} nodes needs a vocabulary of "
                                      f"at least {plan.n_nodes + 1} tokens")
                keep.append((b, k))
            except ConfigError as e:  # BudgetError included
                skipped.append(f"bc={b} k={k}")
                last = e
    if not keep:
        raise ExportError(f"no requested budget makes a plan ({', '.join(skipped)}): {last}")
    return keep, skipped


def _write_graph(module, tmp: Path, torch_dtype, opset: int) -> str | None:
    """Trace into a scratch folder, tidy, then save ``model.onnx`` as one file (weights
    inside) or, for large models, with one external weights file. Returns its name."""
    import onnx

    from .graph import tidy_graph, trace_to_onnx

    scratch = tmp / "_trace"
    scratch.mkdir()
    try:
        trace_to_onnx(module, scratch / GRAPH, torch_dtype, opset)
        proto = onnx.load(str(scratch / GRAPH))
        tidy_graph(proto, module)
        weights = sum(p.numel() * p.element_size() for p in module.parameters())
        external = f"{GRAPH}.data" if weights > EXTERNAL_DATA_BYTES else None
        if external:
            onnx.save_model(proto, str(tmp / GRAPH), save_as_external_data=True,
                            all_tensors_to_one_file=True, location=external, size_threshold=1024)
        else:
            onnx.save_model(proto, str(tmp / GRAPH))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return external


def _save_tokenizer(model: str, tmp: Path, trust_remote_code: bool):
    """Copy the tokenizer into the package; None when the model folder has none."""
    from transformers import AutoTokenizer

    src = Path(model)
    if src.is_dir() and not any((src / f).is_file() for f in TOKENIZER_FILES):
        return None  # some tokenizer classes build an empty tokenizer from nothing
    try:
        tok = AutoTokenizer.from_pretrained(model, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, TypeError):
        return None
    if len(tok) < 2:
        return None
    tok.save_pretrained(str(tmp))
    return tok


def _eos_ids(hf) -> list[int]:
    eos = getattr(hf.generation_config, "eos_token_id", None)
    eos = hf.config.eos_token_id if eos is None else eos
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else
                             ([] if eos is None else [eos]))]


def _manifest(model, hf, decoder, family, dtype, context, budgets, topk, opset, external,
              has_tokenizer, mu, sigma, check, tol) -> dict:
    cfg = hf.config
    layers = len(decoder.model.layers)
    return {
        "format_version": FORMAT_VERSION,
        "edgemtp_version": __version__,
        "source": str(model),
        "family": family.name,
        "model_type": cfg.model_type,
        "architectures": list(getattr(cfg, "architectures", None) or []),
        "hidden_size": int(cfg.hidden_size),
        "num_layers": layers,
        "num_heads": int(decoder.n_heads),
        "num_kv_heads": int(decoder.n_kv),
        "head_dim": int(decoder.head_dim),
        "vocab_size": int(cfg.vocab_size),
        "eos_token_ids": _eos_ids(hf),
        "bos_token_id": getattr(cfg, "bos_token_id", None),
        "dtype": dtype,
        "max_context": int(context),
        "topk": int(topk),
        "graph": {
            "file": GRAPH, "external_data": external, "opset": opset, "commit_file": COMMIT,
            "inputs": graph_inputs(layers), "outputs": graph_outputs(layers),
            "mask_slots": "input ids >= vocab_size select row id - vocab_size of mask_embeds",
            "tree_mask": "block only [1, 1, T, T]; the graph prepends the cache columns",
        },
        "cache": {"layout": CACHE_LAYOUT, "dtype": dtype},
        "plans": [plan_entry(b, k) for b, k in budgets],
        "embeddings": {"file": EMBEDDINGS, "dtype": dtype,
                       "mu": [float(x) for x in mu], "sigma": [float(x) for x in sigma]},
        "tokenizer": bool(has_tokenizer),
        "self_check": {"token_rows_max_logit_diff": check.token_rows,
                       "mask_rows_max_logit_diff": check.mask_rows, "logit_scale": check.scale,
                       "tolerance": {"token_rows": tol[0], "mask_rows": tol[1]},
                       "rule": "|d| <= tolerance * max(1, max |logit|)"},
    }


def _swap_in(tmp: Path, out: Path) -> None:
    # the old package (with --force) is moved aside only now that the new one is whole
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    if out.exists():
        out.rename(old)
    tmp.rename(out)
    shutil.rmtree(old, ignore_errors=True)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
