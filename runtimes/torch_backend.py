"""PyTorch reference backend: a local Hugging Face causal LM with a preallocated,
sequence-major KV cache. CPU, and CUDA when present."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch

from edgemtp.backend import StepOut
from edgemtp.errors import ConfigError, ModelLoadError
from edgemtp.models.decoder import TreeDecoder
from edgemtp.models.families import family_for, max_context

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
MASK_CACHE = 512  # device copies of plan masks kept (oldest out first)


def load_hf_config(path: str, trust_remote_code: bool = False):
    """The ``transformers`` config of a local folder (or a hub id when online), with one-line
    errors for a missing folder or a folder that is not a model."""
    from transformers import AutoConfig

    p = Path(path)
    looks_local = p.exists() or os.sep in path or path.startswith(".")
    if looks_local and not p.is_dir():
        raise ModelLoadError(f"model folder {path!r} does not exist")
    if p.is_dir() and not (p / "config.json").is_file():
        raise ModelLoadError(f"{path!r} has no config.json; expected a Hugging Face model folder")
    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, json.JSONDecodeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelLoadError(f"cannot read the model config at {path!r}: {first}") from None


class TorchBackend:
    name = "torch"

    def __init__(self, model: str, device: str = "cpu", dtype: str = "fp32",
                 max_context: int | None = None, trust_remote_code: bool = False,
                 threads: int | None = None) -> None:
        from transformers import AutoModelForCausalLM

        if dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        if device != "cpu" and not device.split(":")[0] == "cuda":
            raise ConfigError(f"the torch backend runs on cpu or cuda[:N], got device {device!r}")
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise ConfigError("device 'cuda' asked, but this PyTorch build sees no CUDA device")
        if threads is not None:
            if threads < 1:
                raise ConfigError(f"threads must be >= 1, got {threads}")
            torch.set_num_threads(int(threads))
        config = load_hf_config(model, trust_remote_code)
        self.family = family_for(config)
        try:
            hf = AutoModelForCausalLM.from_pretrained(
                model, dtype=DTYPES[dtype], trust_remote_code=trust_remote_code)
        except (OSError, ValueError) as e:
            first = str(e).strip().splitlines()[0]
            raise ModelLoadError(f"cannot load {model!r} as a causal LM: {first}") from None
        self._init(hf, device, max_context)

    @classmethod
    def from_model(cls, hf_model, device: str = "cpu", max_context: int | None = None):
        """Wrap an already loaded ``transformers`` causal LM (tests, notebooks)."""
        self = cls.__new__(cls)
        self.family = family_for(hf_model.config)
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
        dtype = next(hf.parameters()).dtype
        # cache: [layers, max_context, H_kv, D], sequence-major so a prefix is a view
        shape = (cfg.num_hidden_layers, self.max_context, d.n_kv, d.head_dim)
        self.k_cache = torch.zeros(shape, dtype=dtype, device=self.device)
        self.v_cache = torch.zeros(shape, dtype=dtype, device=self.device)
        self._table = hf.get_input_embeddings().weight.detach()
        self.cache_len = 0
        self._pending: tuple[torch.Tensor, torch.Tensor] | None = None
        self._masks: dict = {}

    # -- Backend interface ---------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, input_ids, position_ids, tree_mask, mask_embeds, topk: int = 0,
                full_logits: bool = False) -> StepOut:
        dev, p = self.device, self.cache_len
        ids = torch.as_tensor(input_ids, dtype=torch.long, device=dev)[None]
        pos = torch.as_tensor(position_ids, dtype=torch.long, device=dev)[None]
        mask = self._device_mask(tree_mask)
        if mask_embeds is None:
            mask_embeds = np.zeros((1, self.hidden_size), dtype=np.float32)
        m = torch.as_tensor(mask_embeds, device=dev)
        past_k = [self.k_cache[i, :p][None] for i in range(self.k_cache.shape[0])]
        past_v = [self.v_cache[i, :p][None] for i in range(self.v_cache.shape[0])]
        logits, new_k, new_v = self.decoder(ids, pos, mask, m, past_k, past_v)
        self._pending = torch.cat(new_k), torch.cat(new_v)           # [L, T, H_kv, D]
        logits = logits[0].float()
        out = StepOut(argmax=logits.argmax(-1).cpu().numpy(),
                      topk_ids=np.zeros((len(input_ids), 0), dtype=np.int64),
                      topk_logprobs=np.zeros((len(input_ids), 0), dtype=np.float32))
        if topk:
            lp, ix = torch.log_softmax(logits, -1).topk(min(topk, self.vocab_size), dim=-1)
            out.topk_ids, out.topk_logprobs = ix.cpu().numpy(), lp.cpu().numpy()
        if full_logits:
            out.logits = logits.cpu().numpy()
        return out

    @torch.inference_mode()
    def _device_mask(self, tree_mask: np.ndarray) -> torch.Tensor:
        # plan masks are immutable and live as long as their plan: move each to the device
        # once and reuse it (keyed by the buffer, held so the address cannot be recycled)
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

    def commit(self, rows) -> None:
        k, v = self._pending
        r = len(rows)
        if self.cache_len + r > self.max_context:
            raise ConfigError(f"committing {r} rows overruns the KV cache "
                              f"({self.cache_len} of {self.max_context} rows used)")
        idx = torch.as_tensor(np.asarray(rows), dtype=torch.long, device=self.device)
        self.k_cache[:, self.cache_len:self.cache_len + r] = k.index_select(1, idx)
        self.v_cache[:, self.cache_len:self.cache_len + r] = v.index_select(1, idx)
        self.cache_len += r

    def reset(self) -> None:
        self.cache_len = 0
        self._pending = None

    def embed(self, token_ids) -> np.ndarray:
        idx = torch.as_tensor(np.asarray(token_ids), dtype=torch.long, device=self.device)
        return self._table.index_select(0, idx).float().cpu().numpy()

    def embedding_stats(self) -> tuple[np.ndarray, np.ndarray]:
        t = self._table.float()
        return t.mean(0).cpu().numpy(), t.std(0).cpu().numpy()
