"""Tokenizer access: exactly ``AutoTokenizer.from_pretrained(PATH)(TEXT).input_ids``, plus an
incremental detokenizer for streaming."""

from __future__ import annotations

from .errors import BackendUnavailableError, ModelLoadError


class Tokenizer:
    def __init__(self, path: str, trust_remote_code: bool = False) -> None:
        try:
            from transformers import AutoTokenizer
        except ModuleNotFoundError:
            raise BackendUnavailableError(
                "tokenizing text needs the 'transformers' package (pip install "
                "'edgemtp[tokenizer]'); or pass token ids instead of text") from None
        try:
            self.hf = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        except (OSError, ValueError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ModelLoadError(f"cannot load a tokenizer from {path!r}: {first}") from None

    def encode(self, text: str) -> list[int]:
        return list(self.hf(text).input_ids)

    def decode(self, ids: list[int]) -> str:
        return self.hf.decode(ids, skip_special_tokens=True)


class TextStream:
    """Turns committed token ids into printable text deltas, holding back an incomplete
    multi-byte character until its last byte arrives."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tok, self.ids, self.shown = tokenizer, [], 0

    def push(self, ids: list[int]) -> str:
        self.ids.extend(ids)
        text = self.tok.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""
        delta, self.shown = text[self.shown:], len(text)
        return delta
