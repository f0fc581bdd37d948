"""The small interface every backend implements, and the registry that finds them.

The decode loop, drafters and verifier never know which backend runs. A backend owns its
KV cache, preallocated to ``max_context`` rows, and keeps it on its device.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from .errors import BackendUnavailableError, ConfigError


@dataclass
class StepOut:
    """What one forward pass returns to the host, O(T * K) unless full logits are asked.

    argmax: [T] int64, the model's greedy next token at every block row.
    topk_ids / topk_logprobs: [T, K] for drafting (K = 0 gives empty arrays).
    logits: [T, V] float32, only when the step asked for them (sampling).
    """

    argmax: np.ndarray
    topk_ids: np.ndarray
    topk_logprobs: np.ndarray
    logits: np.ndarray | None = None


class Backend(Protocol):
    name: str
    vocab_size: int
    hidden_size: int
    max_context: int
    eos_token_ids: tuple[int, ...]
    cache_len: int  # committed rows in the KV cache (P)

    def forward(self, input_ids: np.ndarray, position_ids: np.ndarray, tree_mask: np.ndarray,
                mask_embeds: np.ndarray | None, topk: int = 0,
                full_logits: bool = False) -> StepOut:
        """Run one block. ``input_ids >= vocab_size`` select rows of ``mask_embeds``;
        ``tree_mask`` [T, T] covers the block only (the cache is visible to every row)."""
        ...

    def commit(self, rows: np.ndarray) -> None:
        """Append these rows of the last block's K/V to the cache, in order."""
        ...

    def reset(self) -> None:
        """Empty the cache (the buffer stays allocated)."""
        ...

    def embed(self, token_ids: np.ndarray) -> np.ndarray:
        """Input embeddings [n, d] float32 of these tokens (for mask initialisation)."""
        ...

    def embedding_stats(self) -> tuple[np.ndarray, np.ndarray]:
        """Per-dimension mean and std [d] of the embedding table."""
        ...


# name -> "module:Class"; imported only when asked, so the core never pulls torch in.
BACKENDS: dict[str, str] = {
    "torch": "edgemtp.runtimes.torch_backend:TorchBackend",
    "onnxruntime": "edgemtp.runtimes.onnxrt_backend:OrtBackend",
}


def backend_class(name: str):
    if name not in BACKENDS:
        raise ConfigError(f"unknown backend {name!r}; available: {', '.join(sorted(BACKENDS))}")
    module, _, attr = BACKENDS[name].partition(":")
    try:
        return getattr(importlib.import_module(module), attr)
    except ModuleNotFoundError as e:
        raise BackendUnavailableError(
            f"backend {name!r} needs the Python package {e.name!r}, which is not installed "
            f"(pip install 'edgemtp[{name}]')") from None
