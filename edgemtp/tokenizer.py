"""Tokenizer access, giving exactly ``AutoTokenizer.from_pretrained(PATH)(TEXT).input_ids``,
plus an incremental detokenizer for streaming.

A folder with a ``tokenizer.json`` (every package ``edgemtp export`` writes, and Hugging Face
folders with a fast tokenizer) is read with the ``tokenizers`` library alone, so a device
that runs packages never imports transformers or torch; other folders fall back to
``transformers``.
"""

from __future__ import annotations

import json
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import BackendUnavailableError, ConfigError, ModelLoadError

if TYPE_CHECKING:
    from .chat import ChatTemplate

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")
# transformers' clean_up_tokenization, applied when a tokenizer's config asks for it
_CLEANUP = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
            (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))


class Tokenizer:
    def __init__(self, path: str, trust_remote_code: bool = False) -> None:
        from .runtimes.gguf_source import resolve_model  # stdlib only

        source = resolve_model(path)  # a GGUF file carries its tokenizer in its metadata
        root = self.root = Path(source.folder)
        self._gguf = bool(source.gguf_file)
        if not self._gguf and root.is_dir() and not any(
                (root / f).is_file() for f in TOKENIZER_FILES):
            raise ModelLoadError(f"{path!r} has no tokenizer files; expected tokenizer.json "
                                 f"(or tokenizer.model with tokenizer_config.json)")
        self._fast = None
        if not source.gguf_file and (root / "tokenizer.json").is_file():
            self._fast = _load_fast(root)
        if self._fast is None:
            self._hf = _load_transformers(source, trust_remote_code)
        else:
            cfg = read_json(root / "tokenizer_config.json")
            self._cleanup = bool(cfg.get("clean_up_tokenization_spaces", False))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self._fast is None:
            return list(self._hf(text, add_special_tokens=add_special_tokens).input_ids)
        return self._fast.encode(text, add_special_tokens=add_special_tokens).ids

    @cached_property
    def chat_template(self) -> "ChatTemplate | None":
        """The folder's chat template (read on first use), or None when it has none."""
        from .chat import ChatTemplate  # chat reads its files with this module's read_json

        if self.root.is_dir() and not self._gguf:
            return ChatTemplate.from_folder(self.root)
        source = getattr(self._hf, "chat_template", None)  # a GGUF or a hub id: transformers
        if isinstance(source, dict):
            source = source.get("default")
        return ChatTemplate(source, self._hf.special_tokens_map) if source else None

    def encode_chat(self, messages) -> list[int]:
        """``apply_chat_template(messages, tokenize=True, add_generation_prompt=True)``: the
        rendered text encoded without special tokens added (the template writes its own)."""
        if self.chat_template is None:
            raise _no_chat_template(self.root)
        return self.encode(self.chat_template.render(messages), add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        if self._fast is None:
            return self._hf.decode(ids, skip_special_tokens=True)
        text = self._fast.decode(ids, skip_special_tokens=True)
        if self._cleanup:
            for a, b in _CLEANUP:
                text = text.replace(a, b)
        return text


def undecodable_at(text: str) -> int | None:
    """Where ``text`` holds a lone surrogate (what Python makes of bytes that were not UTF-8,
    from argv, stdin or JSON's ``"\\ud800"``: no tokenizer takes it), or None.

    >>> undecodable_at("caf\\udce9"), undecodable_at("café")
    (3, None)
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return e.start
    return None


def _no_chat_template(root: Path) -> ConfigError:
    return ConfigError(f"{str(root)!r} has no chat template (no chat_template in "
                       f"tokenizer_config.json, no chat_template.jinja); give it a plain "
                       f"prompt instead (edgemtp generate --prompt TEXT, without --chat)")


def check_chat_template(path: str) -> None:
    """Fail before a model loads where its folder (a Hugging Face folder or a package) has no
    chat template; a GGUF file or a hub id is looked at once loaded."""
    from .chat import ChatTemplate
    from .runtimes.gguf_source import resolve_model  # stdlib only

    source = resolve_model(path)
    root = Path(source.folder)
    if not source.gguf_file and root.is_dir() and ChatTemplate.from_folder(root) is None:
        raise _no_chat_template(root)


def _load_fast(root: Path):
    try:
        from tokenizers import Tokenizer as FastTokenizer
    except ModuleNotFoundError:
        return None
    try:
        return FastTokenizer.from_file(str(root / "tokenizer.json"))
    except Exception as e:  # the tokenizers library raises a bare Exception on a bad file
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelLoadError(f"cannot read {str(root / 'tokenizer.json')!r}: {first}") from None


def _load_transformers(source, trust_remote_code: bool):
    try:
        from transformers import AutoTokenizer
    except ModuleNotFoundError:
        raise BackendUnavailableError(
            "tokenizing text needs the 'tokenizers' package for a tokenizer.json, or "
            "'transformers' (pip install 'edgemtp[tokenizer]'); or pass token ids instead of "
            "text") from None
    try:
        return AutoTokenizer.from_pretrained(source.folder, trust_remote_code=trust_remote_code,
                                             **source.pretrained_kwargs())
    except (OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelLoadError(f"cannot load a tokenizer from {source.path!r}: {first}") from None


def read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"cannot read {str(path)!r}: {e}") from None
    return data if isinstance(data, dict) else {}


def _whole(text: str) -> bool:
    return "\ufffd" not in text


def text_after(tokenizer: Tokenizer, before: int | None, ids: list[int]) -> str:
    """The decode of ``ids`` as it reads after the token ``before`` (the prompt's last): a
    SentencePiece tokenizer keeps the first token's leading space, which the decode of
    ``ids`` alone drops (byte-level BPE keeps it either way); the decode of ``ids`` where
    ``before`` ends inside a character."""
    if before is not None:
        head = tokenizer.decode([before])
        whole = tokenizer.decode([before, *ids])
        if _whole(head) and whole.startswith(head):
            return whole[len(head):]
    return tokenizer.decode(ids)


class TextStream:
    """Turns committed token ids into printable text deltas, decoding only a short window
    each push (not the whole output), and holding back an incomplete multi-byte character
    until its last byte arrives.

    The window starts at the ids the last delta came from (``prefix``), so a tokenizer that
    drops a leading space at the start of a decode still shows it: the delta is the window's
    text minus the text of its already-shown part (the incremental detokenizer of vLLM and
    text-generation-inference).
    """

    def __init__(self, tokenizer: Tokenizer, before: int | None = None) -> None:
        self.tok, self.ids = tokenizer, []
        self.prefix = self.read = 0  # ids[prefix:read] decoded last time; ids[read:] are new
        if before is not None and _whole(tokenizer.decode([before])):
            # the text as it reads after the prompt's last token: a SentencePiece tokenizer
            # keeps the first token's leading space (" was", as vLLM's detokenizer gives it)
            self.ids, self.read = [before], 1

    def push(self, ids: list[int]) -> str:
        self.ids.extend(ids)
        shown = self.tok.decode(self.ids[self.prefix:self.read])
        text = self.tok.decode(self.ids[self.prefix:])
        if len(text) <= len(shown) or text.endswith("\ufffd"):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(shown):]

    def finish(self) -> str:
        """What :meth:`push` still holds back once no more ids come: a generation that ended
        inside a multi-byte character held back the whole characters before it too. The
        rest of the text, the incomplete character as U+FFFD: the deltas then add up to the
        decode of every id where the tokenizer decodes a cut character without touching the
        ones before it (byte-level BPE: SmolLM2, Llama 3, Qwen). A byte-fallback
        SentencePiece decoder turns every byte of such a run into U+FFFD, the complete
        characters before it too; the deltas keep those characters, and end in U+FFFD."""
        shown = self.tok.decode(self.ids[self.prefix:self.read])
        text = self.tok.decode(self.ids[self.prefix:])
        rest = (text[len(shown):] if text.startswith(shown)
                else self.tok.decode(self.ids[self.read:]))
        self.prefix = self.read = len(self.ids)
        return rest
