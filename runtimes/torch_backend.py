"""PyTorch reference backend: a local Hugging Face causal LM, with a preallocated,
sequence-major KV cache per session. CPU, and CUDA when present."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch

from edgemtp.backend import StepOut, check_options
from edgemtp.errors import ConfigError, ModelLoadError
from edgemtp.models.decoder import TreeDecoder
from edgemtp.models.families import family_for, max_context
from edgemtp.runtimes.gguf_source import check_gguf, resolve_model

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
MASK_CACHE = 512  # device copies of plan masks kept (oldest out first)


def load_hf_config(path: str, trust_remote_code: bool = False):
    """The ``transformers`` config of a local folder, a GGUF file (or a folder holding one),
    or a hub id when online, with one-line errors for a missing folder, a folder that is not
    a model, and a GGUF file that is damaged or of an unsupported architecture."""
    from transformers import AutoConfig

    source = resolve_model(path)
    if source.gguf_file:
        check_gguf(source)
    else:
        _check_hf_folder(path)
    try:
        return AutoConfig.from_pretrained(source.folder, trust_remote_code=trust_remote_code,
                                          **source.pretrained_kwargs())
    except (OSError, ValueError, json.JSONDecodeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelLoadError(f"cannot read the model config at {source.path!r}: {first}") from None


def _check_hf_folder(path: str) -> None:
    p = Path(path)
    looks_local = p.exists() or os.sep in path or path.startswith(".")
    if looks_local and not p.is_dir():
        raise ModelLoadError(f"model folder {path!r} does not exist")
    if p.is_dir() and not (p / "config.json").is_file():
        raise ModelLoadError(f"{path!r} has no config.json; expected a Hugging Face model folder")


class TorchBackend:
    """A Hugging Face causal LM in PyTorch: the weights once; each :meth:`session` owns a
    preallocated, sequence-major KV cache ``[L, max_context, H_kv, D]`` on the device."""

    name = "torch"
    has_tokenizer = True
    supports_hidden = True

    def __init__(self, model: str, device: str = "cpu", dtype: str | None = None,
                 max_context: int | None = None, trust_remote_code: bool = False,
                 threads: int | None = None) -> None:
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        check_options(device, dtype, max_context, threads)
        dtype = dtype or "fp32"
        if device != "cpu" and not device.split(":")[0] == "cuda":
            raise ConfigError(f"the torch backend runs on cpu or cuda[:N], got device {device!r}")
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise ConfigError("device 'cuda' asked, but this PyTorch build sees no CUDA device")
        if threads is not None:
            torch.set_num_threads(int(threads))
        source = resolve_model(model)
        if source.gguf_file:  # its architecture, checked without the seconds transformers
            check_gguf(source)  # takes to parse a GGUF (it does so once more to load it)
        else:
            family_for(load_hf_config(model, trust_remote_code))  # before any weight loads
        hf_logging.disable_progress_bar()  # edgemtp shows its own progress where it is long
        try:
            hf = AutoModelForCausalLM.from_pretrained(
                source.folder, dtype=DTYPES[dtype], trust_remote_code=trust_remote_code,
                **source.pretrained_kwargs())
        except (OSError, ValueError, RuntimeError) as e:  # RuntimeError: a truncated file
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ModelLoadError(f"cannot load {model!r} as a causal LM: {first}") from None
        self.family = family_for(hf.config)
        self.source = str(Path(model).resolve()) if Path(model).exists() else model
        self._init(hf, device, max_context)

    @classmethod
    def from_model(cls, hf_model, device: str = "cpu", max_context: int | None = None):
        """Wrap an already loaded ``transformers`` causal LM (tests, notebooks)."""
        self = cls.__new__(cls)
        self.family = family_for(hf_model.config)
        self.source = None
        self._init(hf_model, device, max_context)
        return self

    def _init(self, hf, device: str, requested_context: int | None) -> None:
        self.device = torch.device(device)
        self.hf = hf.to(self.device).eval()
        cfg = hf.config
        self.decoder = TreeDecoder(self.hf, self.family)
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

    def session(self) -> "TorchSession":
        return TorchSession(self)

    @torch.inference_mode()
    def device_mask(self, tree_mask: np.ndarray) -> torch.Tensor:
        # plan masks are immutable and live as long as their plan: move each to the device
        # once and reuse it in every session (keyed by the buffer, held so the address
        # cannot be recycled)
        if tree_mask.flags.writeable:
            return torch.as_tensor(tree_mask, dtype=torch.bool, device=self.device)[None, None]
        key = tree_mask.__array_interface__["data"][0], tree_mask.shape
        hit = self._masks.get(key)
        if hit is None:
            if len(self._masks) >= MASK_CACHE:  # lookup drafters make a new tree most steps
                del self._masks[next(iter(self._masks))]
            t = torch.tensor(tree_mask, dtype=torch.bool, device=self.device)[None, None]
            hit = self._masks[key] = (tree_mask, t)
        return hit[1]

    def embed(self, token_ids) -> np.ndarray:
        idx = torch.as_tensor(np.asarray(token_ids), dtype=torch.long, device=self.device)
        return self._table.index_select(0, idx).float().cpu().numpy()

    def embedding_stats(self) -> tuple[np.ndarray, np.ndarray]:
        t = self._table.float()
        return t.mean(0).cpu().numpy(), t.std(0).cpu().numpy()


class TorchSession:
    """One generation's KV cache on a :class:`TorchBackend`'s device."""

    last_run_s = None  # the torch forward is all run: no binding to tell apart

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
        mask = b.device_mask(tree_mask)
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
