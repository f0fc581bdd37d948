"""Chat templates with jinja2 alone: the text and token ids of transformers'
``apply_chat_template(messages, add_generation_prompt=True)``, without importing transformers.

The template comes from the model folder (or package): ``chat_template.jinja`` and
``additional_chat_templates/*.jinja`` if present, else ``chat_template`` in
``tokenizer_config.json`` (a string, or the list of ``{"name", "template"}``). It is compiled
as transformers compiles it (a sandbox with ``trim_blocks`` and ``lstrip_blocks``, loop
controls, ``raise_exception``, a ``tojson`` that does not escape HTML, ``strftime_now``) and
sees the named special tokens (``bos_token``, ``eos_token``, ...) as variables. The rendered
text is encoded without adding special tokens again: the template writes its own BOS.

>>> t = ChatTemplate("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{{ eos_token }}"
...                  "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}",
...                  {"eos_token": "</s>"})
>>> t.render([{"role": "user", "content": "Hi"}])
'<|user|>Hi</s><|assistant|>'
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Mapping, Sequence

from .errors import BackendUnavailableError, ConfigError, ModelLoadError
from .tokenizer import read_json, undecodable_at

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                  "mask_token")  # transformers' SPECIAL_TOKENS_ATTRIBUTES: what a template sees
TEMPLATE_FILE, TEMPLATE_DIR = "chat_template.jinja", "additional_chat_templates"
Message = Mapping[str, str]


class ChatTemplate:
    """One compiled chat template and the special tokens it may reference."""

    def __init__(self, source: str, special_tokens: Mapping[str, str]) -> None:
        self.source, self.special_tokens = source, dict(special_tokens)
        self._template = _compile(source)

    @classmethod
    def from_folder(cls, path: str | Path) -> "ChatTemplate | None":
        """The folder's default template, or None when it has none."""
        root = Path(path)
        config = read_json(root / "tokenizer_config.json")
        source = _pick(_templates(root, config), root)
        if source is None:
            return None
        # the legacy special_tokens_map.json wins over the config where it names a token, as
        # transformers' from_pretrained merges them (qa10a C4: edgemtp had it the other way)
        legacy = read_json(root / "special_tokens_map.json")
        tokens = {name: _token_text(legacy[name] if legacy.get(name) is not None
                                    else config.get(name)) for name in SPECIAL_TOKENS}
        return cls(source, {k: v for k, v in tokens.items() if v is not None})

    def render(self, messages: Sequence[Message]) -> str:
        """The prompt text for ``messages`` followed by the assistant's turn header."""
        import jinja2

        chat = [{k: v for k, v in m.items() if v is not None} for m in check_messages(messages)]
        try:
            return self._template.render(messages=chat, tools=None, documents=None,
                                         add_generation_prompt=True, **self.special_tokens)
        except jinja2.TemplateError as e:  # raise_exception() in the template, or a bad template
            raise ConfigError(f"the chat template rejected the messages: {e}") from None


def check_messages(messages) -> list[Message]:
    """``messages`` as a list, or a one-line ConfigError naming the first bad message."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ConfigError(f"messages must be a non-empty list of {{'role': ..., 'content': ...}} "
                          f"dicts, got {_short(messages)}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or "role" not in m or "content" not in m:
            raise ConfigError(f"message {i} must be a dict with 'role' and 'content', got "
                              f"{_short(m)}")
        if not isinstance(m["role"], str) or not m["role"].strip():
            raise ConfigError(f"message {i}'s role must be a non-empty string such as 'user', "
                              f"got {m['role']!r}")
        content = m["content"]
        if isinstance(content, (list, tuple)):  # OpenAI's text parts, joined as the server does
            content = _text_parts(content, i)
            m = {**m, "content": content}
        elif not isinstance(content, str):
            raise ConfigError(f"message {i}'s content must be a string or a list of "
                              f"{{'type': 'text', 'text': ...}} parts, got "
                              f"{type(content).__name__}")
        for field in ("role", "content"):
            at = undecodable_at(m[field])
            if at is not None:
                raise ConfigError(f"message {i}'s {field} is not valid UTF-8 text (an "
                                  f"undecodable byte at character {at}); give UTF-8 text")
        out.append(m)
    return out


def _text_parts(parts, i: int) -> str:
    """OpenAI's content parts ``[{"type": "text", "text": ...}, ...]`` as one string."""
    texts = []
    for j, part in enumerate(parts):
        if (not isinstance(part, Mapping) or part.get("type") != "text"
                or not isinstance(part.get("text"), str)):
            raise ConfigError(f"message {i}'s content part {j} must be {{'type': 'text', "
                              f"'text': str}} (text only), got {_short(part)}")
        texts.append(part["text"])
    return "".join(texts)


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _templates(root: Path, config: dict) -> dict[str, str] | str | None:
    """What transformers would set as ``tokenizer.chat_template``: the template files win over
    the config's entry; a lone default file is a string, anything else a dict by name."""
    files = {}
    if (root / TEMPLATE_FILE).is_file():
        files["default"] = _read_text(root / TEMPLATE_FILE)
    if (root / TEMPLATE_DIR).is_dir():
        for f in sorted((root / TEMPLATE_DIR).glob("*.jinja")):
            files[f.name.removesuffix(".jinja")] = _read_text(f)
    if files:
        return files["default"] if list(files) == ["default"] else files
    entry = config.get("chat_template")
    if isinstance(entry, list):
        return {t["name"]: t["template"] for t in entry
                if isinstance(t, dict) and "name" in t and "template" in t}
    return entry if isinstance(entry, str) else None


def _pick(templates: dict[str, str] | str | None, root: Path) -> str | None:
    if not isinstance(templates, dict):
        return templates
    if "default" not in templates:
        raise ModelLoadError(f"{str(root)!r} has chat templates named "
                             f"{', '.join(sorted(templates))} but none named 'default'; "
                             f"expected one to use")
    return templates["default"]


def _token_text(value) -> str | None:
    if isinstance(value, dict):  # a saved AddedToken: {"content": "<s>", "lstrip": ..., ...}
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"cannot read {str(path)!r}: {e}") from None


@lru_cache(maxsize=8)
def _compile(source: str):
    """The template compiled in the environment transformers uses
    (``transformers.utils.chat_template_utils._compile_jinja_template``)."""
    try:
        import jinja2
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ModuleNotFoundError:
        raise BackendUnavailableError("chat templates need the 'jinja2' package "
                                      "(pip install jinja2)") from None
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_generation_tag(), loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["dict"] = dict
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ModelLoadError(f"the model's chat template is not valid Jinja (line {e.lineno}: "
                             f"{e.message})") from None


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # jinja's own tojson escapes HTML characters; transformers' does not
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _raise_exception(message):
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


def _generation_tag():
    """``{% generation %}...{% endgeneration %}`` (transformers marks assistant tokens with it):
    rendered as its body, so templates that use it compile."""
    import jinja2
    from jinja2.ext import Extension

    class GenerationTag(Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    return GenerationTag
