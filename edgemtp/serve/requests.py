"""Request bodies of the OpenAI API, checked at the boundary, and the errors the server sends.

Status codes (the README's bad-request table lists examples):

- 400 ``invalid_request_error``: the body is not a JSON object, or a value that fits the
  schema but cannot be honoured (``max_tokens`` 0 or above the server's limit, an empty
  prompt or message list, a message role other than OpenAI's, a user/system message without
  content, text that is not UTF-8 (a lone surrogate), a prompt over the context, a model
  without a chat template, an unsupported option such as ``n=2``, a ``bc``/``drafter``
  edgemtp rejects), or a body nested too deeply to parse;
- 422 ``invalid_request_error``: the JSON does not fit the schema (a wrong type, a missing
  field); no value is coerced (``"max_tokens": "5"`` is refused, not read as 5);
- 401 / 404 / 413 / 429 / 503: a wrong API key, an unknown model or path, a body over the
  limit, a full queue, a server shutting down (raised in :mod:`.app` and :mod:`.scheduler`).

Every error is ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, ValidationError

from ..config import GenerationConfig
from ..errors import ConfigError
from ..tokenizer import undecodable_at


@dataclass
class APIError(Exception):
    """An error the client gets as OpenAI's JSON error with this status."""

    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


# -- schema ----------------------------------------------------------------------------------

class _Strict(BaseModel):
    # strict: no coercion ("5" is not 5); extra fields are read by check_unsupported
    model_config = ConfigDict(strict=True, extra="allow")


class StreamOptions(_Strict):
    include_usage: bool = False


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class Message(_Strict):
    role: str
    content: Union[str, list[TextPart], None] = None


class _Common(_Strict):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # not OpenAI's; llama.cpp's server takes it too
    seed: int | None = None
    stop: Union[str, list[str], None] = None
    stream: bool | None = False  # (null: not streamed, as OpenAI's API and vLLM take it)
    stream_options: StreamOptions | None = None
    max_completion_tokens: int | None = None  # OpenAI's newer name; wins over max_tokens
    # edgemtp's own options, as extra body fields (openai client: extra_body={...})
    bc: int | None = None
    drafter: str | None = None
    mask_tokens: int | None = None
    tree_cost: str | None = None
    heads: str | None = None  # the learned heads' kind (drafter heads, hybrid or auto)


class CompletionRequest(_Common):
    prompt: Union[str, list[int], list[str], list[list[int]]]


class ChatRequest(_Common):
    messages: list[Message]


FIELDS = {name for m in (_Common, CompletionRequest, ChatRequest, Message, TextPart,
                         StreamOptions) for name in m.model_fields}

# OpenAI options this server honours only at their neutral value: anything else would give an
# output the client did not ask for, so it is refused rather than ignored
NEUTRAL = {"n": (None, 1), "best_of": (None, 1), "echo": (None, False),
           "logprobs": (None, False, 0), "top_logprobs": (None, 0),
           "presence_penalty": (None, 0), "frequency_penalty": (None, 0),
           "logit_bias": (None, {}), "suffix": (None, ""), "tools": (None, []),
           "tool_choice": (None, "none", "auto"), "functions": (None, []),
           "response_format": (None, {"type": "text"})}


def parse(kind: type[_Common], raw) -> _Common:
    """A checked request body, or the APIError to send (400 / 422)."""
    if not isinstance(raw, dict):
        raise APIError(400, f"the body must be a JSON object, got {type(raw).__name__}")
    for name, neutral in NEUTRAL.items():
        if raw.get(name) not in neutral:
            ok = " or ".join(json.dumps(v) for v in neutral[1:])  # (as JSON: false, not False)
            raise APIError(400, f"{name}={_short(raw[name])} is not supported by this server "
                                f"(leave it out, or send {ok})", param=name,
                           code="unsupported_parameter")
    try:
        return kind.model_validate(raw)
    except ValidationError as e:
        first = e.errors()[0]
        path = ".".join(str(p) for p in first["loc"] if isinstance(p, int) or p in FIELDS)
        raise APIError(422, f"invalid {path or 'body'}: {first['msg']} (got "
                            f"{_short(first.get('input'))})", param=path or None,
                       code="invalid_type") from None


def _short(value, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


# -- to a generation ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Limits:
    max_tokens: int       # the largest max_tokens a request may ask for
    max_context: int      # the model's context: prompt tokens must leave room to generate


# request field -> GenerationConfig field
OPTIONS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "seed": "seed",
           "bc": "bc", "drafter": "drafter", "mask_tokens": "mask_tokens",
           "tree_cost": "tree_cost", "heads": "heads"}
# a ConfigError's first word -> the request field it is about
PARAM_OF = {v: k for k, v in OPTIONS.items()} | {"max_new_tokens": "max_tokens", "stop": "stop",
                                                  "block": "bc"}  # "block complexity 3 is ..."


def generation_config(req: _Common, base: GenerationConfig, limits: Limits,
                      random_seed: bool = False) -> GenerationConfig:
    """The server's defaults with the request's options; bad values are 400s naming them.
    ``random_seed`` (serve without --seed): a request without ``seed`` samples with a fresh
    random one, as OpenAI's API and llama-server do (its answer's usage.seed says which)."""
    changes = {OPTIONS[k]: v for k, v in req.model_dump(include=set(OPTIONS)).items()
               if v is not None}
    if random_seed and "seed" not in changes:
        import secrets

        changes["seed"] = secrets.randbelow(2 ** 31)
    if changes.get("drafter", base.drafter) != base.drafter:
        from .. import drafters

        try:
            takes = drafters.get(changes["drafter"]).options
        except ConfigError:
            takes = ()  # (an unknown drafter: refused below)
        # a server default that only some drafters take (their specs' options) goes back to
        # GenerationConfig's own default for a request that picks another drafter (a server
        # run with --heads residual serves "drafter": "pld" without it) rather than refusing it
        for f in fields(GenerationConfig):
            if f.name in drafters.OPTIONS and f.name not in changes and f.name not in takes:
                changes[f.name] = f.default
    # both checked where both are given; the newer name wins
    for name in ("max_tokens", "max_completion_tokens"):
        max_tokens = getattr(req, name)
        if max_tokens is None:
            continue
        if not 1 <= max_tokens <= limits.max_tokens:
            why = ("the server's --max-tokens-limit" if limits.max_tokens < limits.max_context
                   else f"the model's context of {limits.max_context} tokens")
            raise APIError(400, f"{name} must be between 1 and {limits.max_tokens} ({why}), "
                                f"got {max_tokens}",
                           param=name, code="invalid_value")
        changes["max_new_tokens"] = max_tokens
    if req.stop is not None:
        stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop)
        if len(stop) > 4:
            raise APIError(400, f"stop takes at most 4 strings, got {len(stop)}", param="stop")
        for j, text in enumerate(stop):  # (a lone surrogate can never match generated text)
            _check_utf8(text, "stop", f"stop string {j}")
        changes["stop"] = stop
    try:
        return base.with_(**changes)
    except ConfigError as e:
        word = str(e).split()[0]
        raise APIError(400, str(e), param=PARAM_OF.get(word), code="invalid_value") from None


def prompt_of(req: CompletionRequest) -> str | list[int]:
    """One prompt: text or token ids (a one-element batch is unwrapped; batches are 400s)."""
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise APIError(400, f"one prompt per request, got a batch of {len(prompt)}; send "
                                f"them as separate requests (they run concurrently)",
                           param="prompt")
        prompt = prompt[0]
    if not prompt:
        raise APIError(400, "the prompt is empty; give some text or token ids", param="prompt")
    return prompt


# the roles a chat message may have (OpenAI's); developer is OpenAI's newer name for system
ROLES = ("system", "user", "assistant", "tool", "developer")
ROLE_AS = {"developer": "system"}  # what the chat template sees: templates know system
NEEDS_CONTENT = ("system", "user", "developer")  # assistant (tool calls) and tool may omit it


def messages_of(req: ChatRequest) -> list[dict]:
    """The conversation as ``{"role", "content": str}`` dicts (text parts joined), each
    message checked: a known role, content where the role needs it, and UTF-8 text in every
    string (a lone surrogate, an undecodable byte, would fail in the tokenizer)."""
    if not req.messages:
        raise APIError(400, "messages is empty; give at least one message", param="messages")
    out = []
    for i, m in enumerate(req.messages):
        for param, what, text in _strings(m, f"messages.{i}"):
            _check_utf8(text, param, what)
        if m.role not in ROLES:
            raise APIError(400, f"messages.{i}.role {_short(m.role)} is not a role this server "
                                f"accepts; use one of {', '.join(ROLES)}",
                           param=f"messages.{i}.role", code="invalid_value")
        content = m.content
        if content is None and m.role in NEEDS_CONTENT:
            raise APIError(400, f"messages.{i} ({m.role}) has no content; give a string or a "
                                f"list of text parts", param=f"messages.{i}.content",
                           code="invalid_value")
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        out.append({"role": ROLE_AS.get(m.role, m.role),
                    "content": "" if content is None else content})
    return out


def _strings(message: Message, where: str):
    """``(param, what, text)`` for every string in a message, the keys and values of its extra
    fields (``name``, ``tool_calls``, ...) included; iterative: a body may nest as deep as the
    JSON parser allows."""
    todo = [(f"{where}.role", message.role)]
    if isinstance(message.content, str):
        todo.append((f"{where}.content", message.content))
    elif message.content is not None:
        todo += [(f"{where}.content.{j}.text", p.text) for j, p in enumerate(message.content)]
    todo.append((where, message.model_extra or {}))
    while todo:
        path, value = todo.pop()
        if isinstance(value, str):
            yield path, path, value
        elif isinstance(value, dict):
            for k, v in value.items():
                yield path, f"a field name in {path}", k
                todo.append((f"{path}.{_escaped(k)}", v))
        elif isinstance(value, list):
            todo += [(f"{path}.{j}", v) for j, v in enumerate(value)]


def _escaped(text: str) -> str:
    """``text`` with any lone surrogate as ``\\udXXX``: safe in a path inside an error."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _check_utf8(text: str, param: str, what: str) -> None:
    """The check :func:`edgemtp.api.check_prompt` makes of a prompt: a lone surrogate (JSON's
    ``"\\ud800"``) is not a character, so it cannot be encoded, tokenized or sent back."""
    at = undecodable_at(text)
    if at is not None:
        raise APIError(400, f"{what} is not valid UTF-8 text (an undecodable byte or lone "
                            f"surrogate at character {at}); give UTF-8 text",
                       param=param, code="invalid_value")


def check_prompt_length(n_tokens: int, limits: Limits, param: str) -> None:
    if n_tokens >= limits.max_context:
        raise APIError(400, f"the prompt has {n_tokens} tokens; this model's context is "
                            f"{limits.max_context} tokens, which leaves no room to generate",
                       param=param, code="context_length_exceeded")
