"""The small interface every backend implements, and the registry that finds them.

The decode loop, drafters and verifier never know which backend runs. A backend holds the
weights once; each generation runs on a :class:`Session` that owns a KV cache preallocated to
``max_context`` rows on the backend's device.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from .errors import BackendUnavailableError, ConfigError


@dataclass
class StepOut:
    """What one forward pass returns to the host, O(T * K) unless more is asked.

    argmax: [T] int64, the model's greedy next token at every block row.
    topk_ids / topk_logprobs: [T, K] for drafting (K = 0 gives empty arrays).
    logits: [T, V] float32, only when the step asked for them (sampling).
    hidden: [T, d] float32, the last hidden state of every row (after the final norm, what the
    LM head reads), only when the step asked for it (learned heads).
    """

    argmax: np.ndarray
    topk_ids: np.ndarray
    topk_logprobs: np.ndarray
    logits: np.ndarray | None = None
    hidden: np.ndarray | None = None


class Session(Protocol):
    """One generation's state on a backend: its KV cache, preallocated to the backend's
    ``max_context`` rows on the backend's device, and the last block's new K/V. Sessions of
    one backend share its weights and never each other's cache, so generations in progress
    at the same time cannot change each other's tokens."""

    cache_len: int  # committed rows in this session's KV cache (P)
    last_run_s: float | None  # seconds the last forward spent in the runtime's own run
                              # call (None: the backend does not tell it apart)

    def forward(self, input_ids: np.ndarray, position_ids: np.ndarray, tree_mask: np.ndarray,
                mask_embeds: np.ndarray | None, topk: int = 0, full_logits: bool = False,
                hidden: bool = False) -> StepOut:
        """Run one block after the cached rows. ``input_ids >= vocab_size`` select rows of
        ``mask_embeds``; ``tree_mask`` [T, T] covers the block only (the cache is visible to
        every row). ``hidden`` asks for the rows' last hidden states; a backend that cannot
        give them raises :class:`~edgemtp.errors.ConfigError` (see ``supports_hidden``)."""
        ...

    def commit(self, rows: np.ndarray) -> None:
        """Append these rows of the last block's K/V to the cache, in order."""
        ...

    def reset(self) -> None:
        """Empty the cache (the buffer stays allocated, ready for the next generation)."""
        ...


class Backend(Protocol):
    """A loaded model: its weights, once, on one device. Generations run on sessions
    (:meth:`session`), each with its own KV cache.

    Backends are constructed as ``Backend(path, *, device="cpu", dtype=None,
    max_context=None, threads=None, trust_remote_code=False)``; ``dtype=None`` is the model's
    own (a package's export dtype), and every option is checked by :func:`check_options`.
    """

    name: str
    vocab_size: int
    hidden_size: int
    max_context: int
    eos_token_ids: tuple[int, ...]
    has_tokenizer: bool    # the path holds tokenizer files (a package may ship none)
    source: str | None     # the Hugging Face folder the weights came from, if still there
    supports_hidden: bool  # sessions can return last hidden states (StepOut.hidden)

    def session(self) -> Session:
        """A new session with an empty, preallocated KV cache. (The onnxruntime and torch
        backends also take ``rows=N``: a smaller cache, for a latency measurement.)"""
        ...

    def embed(self, token_ids: np.ndarray) -> np.ndarray:
        """Input embeddings [n, d] float32 of these tokens (for mask initialisation)."""
        ...

    def embedding_stats(self) -> tuple[np.ndarray, np.ndarray]:
        """Per-dimension mean and std [d] of the embedding table."""
        ...


DTYPES = ("fp32", "fp16", "bf16")


def check_options(device, dtype, max_context, threads) -> None:
    """The load options every backend takes, checked before anything is loaded.

    >>> check_options("cpu", None, None, 2)
    >>> check_options("cpu", None, None, -1)
    Traceback (most recent call last):
    ...
    edgemtp.errors.ConfigError: threads must be an integer >= 1, got -1
    """
    if not isinstance(device, str) or not device:
        raise ConfigError(f"device must be a name like cpu or cuda, got {device!r}")
    if dtype is not None and dtype not in DTYPES:
        raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if max_context is not None and (isinstance(max_context, bool)
                                    or not isinstance(max_context, int) or max_context < 2):
        raise ConfigError(f"max context (--max-context) must be an integer >= 2 tokens, got "
                          f"{max_context!r}")
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int)
                                or threads < 1):
        raise ConfigError(f"threads must be an integer >= 1, got {threads!r}")
    if threads is not None and threads > max_threads():
        # (tens of thousands of threads crashed or hung the runtimes: libgomp could not
        # create them, a native pool segfaulted, onnxruntime waited minutes)
        raise ConfigError(f"threads must be at most {max_threads()} (4 x this machine's "
                          f"{os.cpu_count() or 1} cores, and never less than 64), got {threads}")


def max_threads() -> int:
    """The most intra-op threads a model may be given: 4 x the cores, at least 64."""
    return max(64, 4 * (os.cpu_count() or 1))


def parse_device(device: str) -> tuple[str, int]:
    """``--device`` -> (cpu, cuda or tensorrt; the GPU's index): ``cuda:N`` and
    ``tensorrt:N`` pick GPU N. Which kinds a backend runs on is the backend's to say.

    >>> parse_device("cuda:1"), parse_device("tensorrt"), parse_device("cpu")
    (('cuda', 1), ('tensorrt', 0), ('cpu', 0))
    >>> parse_device("cpu:1")
    Traceback (most recent call last):
    ...
    edgemtp.errors.ConfigError: device must be cpu, cuda[:N] or tensorrt[:N], got 'cpu:1'
    """
    kind, colon, index = device.partition(":")
    if (kind not in ("cpu", "cuda", "tensorrt")
            or (colon and (kind == "cpu" or not index.isdigit()))):
        raise ConfigError(f"device must be cpu, cuda[:N] or tensorrt[:N], got {device!r}")
    return kind, int(index or 0)


def check_torch_device(device: str) -> None:
    """The devices the torch backend takes: ``cpu`` or ``cuda[:N]``.

    >>> check_torch_device("cuda:1")
    >>> check_torch_device("tpu")
    Traceback (most recent call last):
    ...
    edgemtp.errors.ConfigError: device must be cpu, cuda[:N] or tensorrt[:N], got 'tpu'
    >>> check_torch_device("tensorrt")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    edgemtp.errors.ConfigError: the torch backend runs on cpu or cuda[:N], got device ...
    """
    if parse_device(device)[0] == "tensorrt":
        raise ConfigError(f"the torch backend runs on cpu or cuda[:N], got device {device!r}; "
                          f"use --backend tensorrt or onnxruntime")


# name -> "module:Class"; imported only when asked, so the core never pulls torch in.
BACKENDS: dict[str, str] = {
    "torch": "edgemtp.runtimes.torch_backend:TorchBackend",
    "onnxruntime": "edgemtp.runtimes.onnxrt_backend:OrtBackend",
    "tensorrt": "edgemtp.runtimes.trt_backend:TrtBackend",  # imports tensorrt when loading
    "native": "edgemtp.runtimes.native_backend:NativeBackend",  # int4 packages, C on the CPU
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
