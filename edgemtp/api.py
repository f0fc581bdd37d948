"""The embeddable Python API: load once, generate many.

>>> from edgemtp import Model                                   # doctest: +SKIP
>>> model = Model.load("../shared/models/stories260K")          # doctest: +SKIP
>>> model.generate("Once upon a time", bc=30).text              # doctest: +SKIP
>>> for piece in model.stream("Once upon a time"): print(piece, end="")   # doctest: +SKIP
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator, Sequence

from .backend import Backend, backend_class
from .config import GenerationConfig
from .engine import Generation, GenerationResult
from .errors import ConfigError, ModelLoadError
from .tokenizer import TextStream, Tokenizer


def check_model_path(path: str) -> None:
    """Fail fast, before any heavy import, on a local path that is not there."""
    p = Path(path)
    looks_local = p.exists() or os.sep in path or path.startswith(".")
    if looks_local and not p.is_dir():
        raise ModelLoadError(f"model folder {path!r} does not exist")


class Model:
    """A loaded model (a backend with its KV cache) and its tokenizer."""

    def __init__(self, backend: Backend, tokenizer: Tokenizer | None = None) -> None:
        self.backend, self.tokenizer = backend, tokenizer
        self.memory: dict = {}  # drafter state learned across generations (calibration)

    @classmethod
    def load(cls, path: str, backend: str = "auto", device: str = "cpu", dtype: str = "fp32",
             max_context: int | None = None, trust_remote_code: bool = False,
             threads: int | None = None) -> "Model":
        """``backend="auto"``: onnxruntime for a package written by ``edgemtp export`` (a
        folder with ``edgemtp.json``), torch for a Hugging Face folder. A package carries its
        own tokenizer files (a package exported without one loads with no tokenizer)."""
        check_model_path(path)
        if backend == "auto":
            backend = "onnxruntime" if (Path(path) / "edgemtp.json").is_file() else "torch"
        impl = backend_class(backend)(path, device=device, dtype=dtype, max_context=max_context,
                                      trust_remote_code=trust_remote_code, threads=threads)
        if not getattr(impl, "has_tokenizer", True):
            return cls(impl, None)
        return cls(impl, Tokenizer(path, trust_remote_code=trust_remote_code))

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ConfigError("the prompt is empty; give some text")
            if self.tokenizer is None:
                raise ConfigError("this model has no tokenizer; pass token ids")
            return self.tokenizer.encode(prompt)
        return [int(t) for t in prompt]

    def generation(self, prompt: str | Sequence[int], config: GenerationConfig | None = None,
                   **options) -> Generation:
        """A step-by-step generation (iterate it for the tokens each forward pass commits)."""
        config = (config or GenerationConfig()).with_(**options) if options else (
            config or GenerationConfig())
        decode = self.tokenizer.decode if self.tokenizer else None
        return Generation(self.backend, config, self.encode(prompt), decode, self.memory)

    def generate(self, prompt: str | Sequence[int], config: GenerationConfig | None = None,
                 **options) -> GenerationResult:
        result = self.generation(prompt, config, **options).run()
        if self.tokenizer is not None:
            result.text = self.tokenizer.decode(result.token_ids)
        return result

    def stream(self, prompt: str | Sequence[int], config: GenerationConfig | None = None,
               **options) -> Iterator[str]:
        """Text as it is committed; the finished :class:`GenerationResult` is the generator's
        return value (``StopIteration.value``) and :attr:`last_result`."""
        if self.tokenizer is None:
            raise ConfigError("streaming text needs a tokenizer")
        gen, text = self.generation(prompt, config, **options), TextStream(self.tokenizer)
        for ids in gen:
            delta = text.push(ids)
            if delta:
                yield delta
        self.last_result = gen.result
        self.last_result.text = self.tokenizer.decode(gen.result.token_ids)
        return self.last_result
