"""The embeddable Python API: load once, generate many.

>>> from edgemtp import Model                                   # doctest: +SKIP
>>> model = Model.load("../shared/models/stories260K")          # doctest: +SKIP
>>> model.generate("Once upon a time", bc=30).text              # doctest: +SKIP
>>> for piece in model.stream("Once upon a time"): print(piece, end="")   # doctest: +SKIP
>>> model.chat([{"role": "user", "content": "Hi!"}]).text      # doctest: +SKIP
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Iterator, Mapping

import numpy as np

from .backend import Backend, Session, backend_class, check_options, check_torch_device
from .budgets import is_int
from .config import GenerationConfig
from .engine import Generation, GenerationResult
from .errors import ConfigError, ModelLoadError
from .tokenizer import TextStream, Tokenizer, undecodable_at

Messages = Sequence[Mapping[str, str]]  # [{"role": "user", "content": "..."}, ...]


HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")  # name or org/name


def check_model_path(path: str) -> None:
    """Fail fast, before any heavy import, on a model that cannot be there: a local path
    that does not exist, or a hub id (``name`` or ``org/name``) with no local folder of
    that name while the hub cannot be reached or has no such model (one request, not the
    retries a hub download makes). A GGUF path must name one file that exists."""
    from .runtimes.gguf_source import resolve_model  # stdlib only

    if resolve_model(path).gguf_file:
        return
    p = Path(path).expanduser()
    if p.exists():
        if not p.is_dir():
            raise ModelLoadError(f"model path {path!r} is a file; expected a model folder "
                                 f"(Hugging Face or an edgemtp package)")
        return
    if not HUB_ID.match(path) or path.startswith("."):
        raise ModelLoadError(f"model folder {path!r} does not exist")
    _check_hub(path)


def check_prompt(prompt: str) -> None:
    """A text prompt must be non-empty UTF-8 (lone surrogates are bytes that were not).

    >>> check_prompt("")
    Traceback (most recent call last):
    ...
    edgemtp.errors.ConfigError: the prompt is empty; give some text
    """
    if not prompt:
        raise ConfigError("the prompt is empty; give some text")
    at = undecodable_at(prompt)
    if at is not None:
        raise ConfigError(f"the prompt is not valid UTF-8 text (an undecodable byte "
                          f"at character {at}); give UTF-8 text")


def _check_torch_model(path: str, device: str) -> None:
    """What the torch backend would refuse about a Hugging Face folder and a device, said
    before torch is imported (seconds on a small CPU)."""
    from .runtimes.gguf_source import check_hf_folder, resolve_model  # stdlib only
    from .runtimes.package import is_package  # numpy only

    check_torch_device(device)
    if not is_package(path) and not resolve_model(path).gguf_file:
        check_hf_folder(path)


def _check_hub(repo: str) -> None:
    try:
        from huggingface_hub import model_info
        from huggingface_hub.errors import RepositoryNotFoundError
    except ModuleNotFoundError:
        raise ModelLoadError(f"model folder {repo!r} does not exist (and without the "
                             f"huggingface_hub package it cannot be fetched as a hub id)") from None
    try:
        model_info(repo, timeout=10)
    except RepositoryNotFoundError:
        raise ModelLoadError(f"{repo!r} is neither a local folder nor a model on the Hugging "
                             f"Face hub") from None
    except Exception as e:  # connection errors: httpx, requests or OSError by hub version
        raise ModelLoadError(f"{repo!r} is not a local folder, and the Hugging Face hub "
                             f"cannot be reached to fetch it ({type(e).__name__}); give a "
                             f"local model folder") from None


class _Stream:
    """A text stream (an iterator of deltas whose ``StopIteration.value`` is the result) that
    gives its generation's KV cache back when closed, also before its first item (a plain
    generator runs no ``finally`` when closed before it started) or when dropped."""

    def __init__(self, deltas: Iterator[str], gen: Generation) -> None:
        self._deltas, self._gen = deltas, gen

    def __iter__(self) -> "_Stream":
        return self

    def __next__(self) -> str:
        return next(self._deltas)

    def close(self) -> None:
        self._deltas.close()
        self._gen.close()  # (a no-op once it ended)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 (at interpreter exit)
            pass


def token_ids(prompt, vocab_size: int) -> list[int]:
    """A prompt given as token ids, checked: a flat sequence of integers in the vocabulary."""
    if isinstance(prompt, (bytes, bytearray)) or not isinstance(prompt, (Sequence, np.ndarray)):
        raise ConfigError(f"the prompt must be text (str) or a list of token ids, got "
                          f"{type(prompt).__name__}")
    ids = prompt.tolist() if isinstance(prompt, np.ndarray) else list(prompt)
    bad = next((t for t in ids if not is_int(t)), None)
    if bad is not None:
        raise ConfigError(f"token ids must be integers, got {bad!r} ({type(bad).__name__})")
    out = [int(t) for t in ids]
    wrong = next((t for t in out if not 0 <= t < vocab_size), None)
    if wrong is not None:
        raise ConfigError(f"prompt token ids must be in [0, {vocab_size}), got {wrong}")
    return out


def env_threads() -> int | None:
    """Intra-op threads from ``$EDGEMTP_THREADS`` (a positive integer), None if unset."""
    raw = os.environ.get("EDGEMTP_THREADS", "").strip()
    if not raw:
        return None
    if not raw.isdigit() or int(raw) < 1:
        raise ConfigError(f"EDGEMTP_THREADS must be a positive integer, got {raw!r}")
    return int(raw)


def auto_backend(path, device: str = "cpu") -> str:
    """The backend ``--backend auto`` picks: ``native`` for an int4 Llama-style package on the
    CPU where the C decoder builds (``EDGEMTP_NATIVE=0``: never), ``onnxruntime`` for any
    other package, ``torch`` for a Hugging Face folder."""
    from .runtimes.package import is_package  # numpy only

    if not is_package(path):
        return "torch"
    if device == "cpu":
        from .runtimes.native_backend import runs_natively
        if runs_natively(path):
            return "native"
    return "onnxruntime"


def check_keep_sessions(n) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ConfigError(f"keep_sessions must be an integer >= 0 (idle KV caches kept for "
                          f"reuse), got {n!r}")
    return n


class Model:
    """A loaded model (a backend: the weights, once) and its tokenizer.

    Every generation runs on its own session (KV cache). Finished generations hand their
    session back to a pool, so generating one after another allocates one cache; generations
    in progress at the same time (interleaved, or on threads) each get one of their own and
    produce exactly the tokens they would alone.
    """

    def __init__(self, backend: Backend, tokenizer: Tokenizer | None = None,
                 keep_sessions: int = 1) -> None:
        self.backend, self.tokenizer = backend, tokenizer
        self.keep_sessions = check_keep_sessions(keep_sessions)
        self.closed = False
        self.memory: dict = {}  # drafter state learned across generations (calibration)
        self.last_result: GenerationResult | None = None  # the last finished stream's
        # why backend="auto" did not take an int4 package to the native decoder (None: it did,
        # or it was not asked to)
        self.native_declined: str | None = None
        self._idle: list[Session] = []
        self._lock = threading.Lock()

    def _take_session(self) -> Session:
        with self._lock:
            if self.closed:
                raise ConfigError("this Model is closed (Model.close(), or its `with` block "
                                  "ended): load it again to generate")
            if self._idle:
                return self._idle.pop()
        return self.backend.session()

    def _give_back(self, session: Session) -> None:
        # at most keep_sessions idle caches are kept for the next generations; one more (a
        # generation that ran beside others) is dropped here, and its memory with it
        with self._lock:
            if not self.closed and len(self._idle) < self.keep_sessions:
                self._idle.append(session)

    def release_sessions(self) -> int:
        """Drop the idle sessions (their KV caches' memory); returns how many. Generations in
        progress keep theirs; the next generation allocates a cache again."""
        with self._lock:
            n, self._idle = len(self._idle), []
        return n

    def close(self) -> None:
        """Free the idle KV caches and refuse new generations (:class:`ConfigError`); those in
        progress finish and drop their caches. The weights go with the last reference to the
        model. ``with Model.load(...) as model:`` closes it at the block's end."""
        with self._lock:
            self.closed, self._idle = True, []

    def __enter__(self) -> "Model":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @classmethod
    def load(cls, path: str, backend: str = "auto", device: str = "cpu", dtype: str | None = None,
             max_context: int | None = None, trust_remote_code: bool = False,
             threads: int | None = None, batch_invariant: bool = False,
             kv_cache: str | None = None, keep_sessions: int = 1) -> "Model":
        """``backend="auto"``: for a package written by ``edgemtp export`` (a folder with
        ``edgemtp.json``) native on the CPU where it is int4 and the C decoder builds, else
        onnxruntime; torch for a Hugging Face folder (see :func:`auto_backend`). A package
        carries its own tokenizer files (a package exported without one loads with no tokenizer).
        ``dtype=None``: the model's own (fp32 for a Hugging Face folder). ``threads=None``:
        ``$EDGEMTP_THREADS`` if set, else the runtime's default (every physical core).
        ``batch_invariant`` (torch backend): every step padded to one block shape and attention
        summed in float64, so fp16/bf16 GPU kernels give a row the same logits in a block as
        alone (see README). ``kv_cache`` (native backend): ``"fp16"`` (default) or ``"int8"``
        (half the cache memory; lossless against its own plain decoding). ``keep_sessions``:
        how many finished generations' KV caches the model keeps for the next ones (default
        1: one after another reuse one; generations run at the same time on N threads
        allocate N, and all but this many are freed as they end; 0 frees each at its end)."""
        if not isinstance(path, (str, os.PathLike)):
            raise ConfigError(f"the model path must be a string or a path, got "
                              f"{type(path).__name__}")
        check_model_path(path)
        threads = threads if threads is not None else env_threads()
        check_options(device, dtype, max_context, threads)  # before any heavy import
        check_keep_sessions(keep_sessions)
        auto = backend == "auto"
        if auto:
            backend = auto_backend(path, device)
        if backend == "torch":
            _check_torch_model(path, device)
        extra = {}
        if batch_invariant:
            if backend != "torch":
                raise ConfigError(f"batch_invariant is an option of the torch backend, not of "
                                  f"{backend!r} (use --backend torch on a model folder)")
            extra["batch_invariant"] = True
        if kv_cache is not None:
            if backend != "native":
                raise ConfigError(f"kv_cache (--kv-cache) is an option of the native backend, "
                                  f"which runs int4 packages on the CPU; this model runs on "
                                  f"{backend}: drop it")
            extra["kv_cache"] = kv_cache
        declined = None
        try:
            impl = backend_class(backend)(path, device=device, dtype=dtype,
                                          max_context=max_context,
                                          trust_remote_code=trust_remote_code, threads=threads,
                                          **extra)
        except ConfigError as e:
            from .runtimes.native_backend import NativeUnsupported

            if not (auto and backend == "native" and isinstance(e, NativeUnsupported)
                    and not extra):
                raise
            # a package the C decoder does not know (an untied embedding, say): onnxruntime
            # runs every package, and auto goes there
            declined = str(e).split("; use --backend onnxruntime")[0].split(
                ": use --backend onnxruntime")[0]
            backend = "onnxruntime"
            impl = backend_class(backend)(path, device=device, dtype=dtype,
                                          max_context=max_context,
                                          trust_remote_code=trust_remote_code, threads=threads)
        model = cls(impl, Tokenizer(path, trust_remote_code=trust_remote_code)
                    if impl.has_tokenizer else None, keep_sessions=keep_sessions)
        model.native_declined = declined
        if max_context is not None and max_context > impl.max_context:
            import warnings

            from .errors import ContextClampedWarning

            warnings.warn(f"max_context {max_context} is above what {str(path)!r} holds; "
                          f"using its {impl.max_context} tokens", ContextClampedWarning,
                          stacklevel=2)
        return model

    def kv_cache_bytes(self, rows: int | None = None) -> int | None:
        """Bytes one generation's K/V cache takes at most, at ``rows`` positions (default: the
        backend's max context; None where the backend cannot say). Each concurrent
        generation has its own cache (a server holds one per ``--parallel`` slot and keeps it
        for the next request). Count it whole: the native decoder's arrays are mapped as they
        are written, but in transparent huge pages (numpy asks for them, and a step at 2048
        rows ran 4-7 % slower without), so one short generation touches all of it."""
        b = self.backend
        if hasattr(b, "cache_bytes"):  # native (float16, or int8 codes and scales), torch
            return int(b.cache_bytes(rows=rows))
        pkg = getattr(b, "package", None)
        if pkg is not None and hasattr(pkg, "kv_cache_bytes"):
            return int(pkg.kv_cache_bytes(rows=rows or b.max_context))
        return None

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            check_prompt(prompt)
            if self.tokenizer is None:
                raise ConfigError("this model has no tokenizer; pass token ids")
            return self.tokenizer.encode(prompt)
        return token_ids(prompt, self.backend.vocab_size)

    def check_config(self, config: GenerationConfig) -> None:
        """Refuse now, in one :class:`ConfigError` or :class:`ModelLoadError`, a config this
        model cannot run whatever the prompt (a drafter whose learned heads or top-K the
        package lacks): what a REPL or a server checks once at start rather than at every
        turn or request. Builds the generation's drafter; runs nothing."""
        self.generation([0], config.with_(max_new_tokens=1, stop=())).close()

    def generation(self, prompt: str | Sequence[int], config: GenerationConfig | None = None,
                   **options) -> Generation:
        """A step-by-step generation (iterate it for the tokens each forward pass commits)."""
        if config is not None and not isinstance(config, GenerationConfig):
            raise ConfigError(f"config must be a GenerationConfig, got {type(config).__name__} "
                              f"(options go as keywords: generate(prompt, bc=10))")
        config = (config or GenerationConfig()).with_(**options) if options else (
            config or GenerationConfig())
        decode = self.tokenizer.decode if self.tokenizer else None
        ids, session = self.encode(prompt), self._take_session()
        try:
            return Generation(self.backend, config, ids, decode, self.memory, session=session,
                              on_done=self._give_back)
        except BaseException:
            self._give_back(session)
            raise

    def generate(self, prompt: str | Sequence[int], config: GenerationConfig | None = None,
                 **options) -> GenerationResult:
        return self.generation(prompt, config, **options).run()  # (its text: as it reads
        #                                                            after the prompt)

    def stream(self, prompt: str | Sequence[int], config: GenerationConfig | None = None,
               **options) -> Iterator[str]:
        """Text as it is committed. Bad options raise here, at the call. The finished
        :class:`GenerationResult` is the generator's return value (``StopIteration.value``)
        and :attr:`last_result` (the model's last finished stream: with streams on several
        threads, use ``generation()`` or the return value). A stream closed or left before its
        end (``close()``, a ``break``) hands its KV cache back to the model at once."""
        if self.tokenizer is None:
            raise ConfigError("streaming text needs a tokenizer")
        gen = self.generation(prompt, config, **options)
        return _Stream(self._stream(gen), gen)

    def _stream(self, gen: Generation) -> Iterator[str]:
        before = int(gen.prompt[-1])  # the text as it reads after the prompt (" was", not
        text = TextStream(self.tokenizer, before)  # "was", from a SentencePiece tokenizer)
        try:
            for ids in gen:
                delta = text.push(ids)
                if delta:
                    yield delta
        finally:
            gen.close()  # (a no-op once it ended; a stream left early gives its session back)
        rest = text.finish()  # (a generation that ended inside a character)
        if rest:
            yield rest
        result = gen.result
        self.last_result = result
        return result

    def encode_chat(self, messages: Messages) -> list[int]:
        """The prompt ids of a conversation under the model's chat template, ending in the
        assistant's turn header (transformers' ``apply_chat_template(messages,
        add_generation_prompt=True)``)."""
        if self.tokenizer is None:
            raise ConfigError("this model has no tokenizer, so no chat template; pass token ids")
        return self.tokenizer.encode_chat(messages)

    def chat(self, messages: Messages, config: GenerationConfig | None = None,
             **options) -> GenerationResult:
        """The assistant's next turn: :meth:`generate` on the templated conversation."""
        return self.generate(self.encode_chat(messages), config, **options)

    def chat_stream(self, messages: Messages, config: GenerationConfig | None = None,
                    **options) -> Iterator[str]:
        """:meth:`chat` as text deltas, like :meth:`stream`."""
        return self.stream(self.encode_chat(messages), config, **options)
