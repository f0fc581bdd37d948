"""The FastAPI application: OpenAI's completions and chat completions (plain JSON or
server-sent events), ``/v1/models`` and ``/v1/models/{id}``, ``/health`` and ``/metrics``,
with the safety limits.

Every failure a client can cause is an OpenAI-style JSON error with its status code (see
:mod:`.requests`); an unexpected one is a 500 with a one-line message (the traceback goes to
the server's log only), and the server keeps answering.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator, Awaitable, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from .. import __version__
from ..api import Model
from ..config import GenerationConfig
from ..engine import GenerationResult
from ..errors import ConfigError
from .metrics import Metrics
from .requests import (APIError, ChatRequest, CompletionRequest, Limits, check_prompt_length,
                       generation_config, messages_of, parse, prompt_of)
from .scheduler import Job, Scheduler, StopText, first_stop

log = logging.getLogger("edgemtp.serve")
T = TypeVar("T")
DRAIN_BYTES = 16 << 20  # a body this far over the limit is refused without reading the rest
FINISH = {"eos": "stop", "stop_string": "stop", "max_new_tokens": "length",
          "max_context": "length", "closed": "length"}  # closed: stopped at the time limit
KNOWN_PATHS = ("/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions")
MODEL_PATH = "/v1/models/{model_id}"  # one model's entry; counted under this label


@dataclass(frozen=True)
class Settings:
    model_name: str
    base: GenerationConfig        # the server's defaults (its generation flags)
    limits: Limits
    api_key: str | None = None
    max_body_bytes: int = 1 << 20
    timeout_s: float = 300.0      # per request: queue wait and generation together
    source: str | None = None     # the path the model was loaded from (never shown)
    allowed_origins: tuple[str, ...] = ()  # CORS (--allowed-origins); none: no CORS headers
    random_seed: bool = False     # no --seed: a request without seed gets a random one


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


def create_app(model: Model, settings: Settings, parallel: int, queue: int) -> FastAPI:
    server = _Server(model, settings, Scheduler(model, parallel, queue))
    app = FastAPI(title="edgemtp", version=__version__, docs_url=None, redoc_url=None,
                  openapi_url=None, lifespan=server.lifespan)
    app.state.server = server
    app.add_middleware(_CountRequests, metrics=server.metrics)
    if settings.allowed_origins:  # (added last: the outermost, so errors carry it too)
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(settings.allowed_origins),
                           allow_methods=["GET", "POST"], allow_headers=["*"],
                           expose_headers=["Retry-After"], max_age=600)
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected)
    app.add_api_route("/health", server.health, methods=["GET"])
    app.add_api_route("/v1/models", server.models, methods=["GET"])
    # :path, as an id given with --model-name may hold a slash ("org/model")
    app.add_api_route("/v1/models/{model_id:path}", server.model_entry, methods=["GET"])
    app.add_api_route("/metrics", server.metrics_text, methods=["GET"])
    app.add_api_route("/v1/completions", server.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", server.chat_completions, methods=["POST"])
    return app


class _Server:
    def __init__(self, model: Model, settings: Settings, scheduler: Scheduler) -> None:
        self.model, self.settings, self.scheduler = model, settings, scheduler
        self.metrics = Metrics(scheduler)
        self.created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(self, app: FastAPI):
        yield
        await asyncio.to_thread(self.scheduler.close)  # after uvicorn drained the connections

    # -- small endpoints -----------------------------------------------------------------------

    async def health(self) -> dict:
        s = self.scheduler
        return {"status": "stopping" if s.draining else "ok", "model": self.settings.model_name,
                "running": s.running, "queued": s.waiting, "parallel": s.parallel}

    async def models(self, request: Request) -> dict:
        self._check_key(request)
        return {"object": "list", "data": [self._entry()]}

    async def model_entry(self, request: Request, model_id: str) -> dict:
        self._check_key(request)
        self._check_model(model_id)
        return self._entry()

    def _entry(self) -> dict:
        return {"id": self.settings.model_name, "object": "model", "created": self.created,
                "owned_by": "edgemtp", "max_context": self.settings.limits.max_context}

    def _check_model(self, model: str) -> None:
        name = self.settings.model_name
        if model != name:
            raise APIError(404, f"the model {model!r} does not exist; this server has {name!r}",
                           param="model", code="model_not_found")

    async def metrics_text(self, request: Request) -> Response:
        self._check_key(request)
        return Response(self.metrics.text(), media_type=self.metrics.content_type)

    # -- generations ---------------------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, CompletionRequest)

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, ChatRequest)

    async def _generate(self, request: Request, kind) -> Response:
        try:
            return await self._answer(request, kind)
        except ClientGone:  # while queued or generating: nobody reads an answer
            self.metrics.cancelled.inc()
            return Response(status_code=499)  # nginx's "client closed request", for /metrics

    async def _answer(self, request: Request, kind) -> Response:
        arrived, s = time.monotonic(), self.settings
        self._check_key(request)
        req = parse(kind, await self._read_json(request))
        if req.model is not None:
            self._check_model(req.model)
        config = generation_config(req, s.base, s.limits, s.random_seed)
        ids = await asyncio.to_thread(self._prompt_ids, req)  # tokenizing is CPU work too
        job = Job(ids, config, deadline=arrived + s.timeout_s)
        waited = time.monotonic()
        await _unless_disconnected(request, self.scheduler.acquire(job), self.scheduler.release)
        self.metrics.queue_wait.observe(time.monotonic() - waited)
        reply = _Reply(kind is ChatRequest, s.model_name, job, len(ids))
        if req.stream:
            return await self._stream(request, reply, bool(
                req.stream_options and req.stream_options.include_usage), arrived)
        try:
            result = await _unless_disconnected(request, self.scheduler.run(job))
        except ConfigError as e:  # the drafter refused the prompt (checked where it is built)
            raise APIError(400, self._public(e)) from None
        self._finished(result, reply, arrived)
        cut = first_stop(result.text, config.stop)
        text = result.text if cut is None else result.text[:cut]
        return JSONResponse(reply.whole(text, result))

    def _prompt_ids(self, req) -> list[int]:
        limits, vocab = self.settings.limits, self.model.backend.vocab_size
        param = "messages" if isinstance(req, ChatRequest) else "prompt"
        try:
            if isinstance(req, ChatRequest):
                messages = messages_of(req)  # checked before the template: its 400s first
                self._check_chat_template()
                ids = self.model.encode_chat(messages)
            else:
                ids = self.model.encode(prompt_of(req))
        except ConfigError as e:
            raise APIError(400, str(e), param=param) from None
        if any(not 0 <= t < vocab for t in ids):
            raise APIError(400, f"prompt token ids must be in [0, {vocab})", param=param)
        check_prompt_length(len(ids), limits, param)
        return ids

    def _check_chat_template(self) -> None:
        """A 400 naming the served model, not the folder it was loaded from (the core's
        ConfigError says the path, which a remote client has no business seeing)."""
        tokenizer = self.model.tokenizer
        if tokenizer is None or tokenizer.chat_template is None:
            raise APIError(400, f"the model {self.settings.model_name!r} has no chat template; "
                                f"send a plain prompt to /v1/completions instead",
                           param="messages")

    def _public(self, e: ConfigError) -> str:
        """A ConfigError's message for a remote client: the folder the model was loaded from
        named as the served model (the client has no business seeing the server's paths)."""
        text, source = str(e), self.settings.source
        if source:
            for form in {source, str(Path(source).resolve())}:
                text = text.replace(repr(form), repr(self.settings.model_name))
                text = text.replace(form, self.settings.model_name)
        return text

    async def _stream(self, request: Request, reply: "_Reply", include_usage: bool,
                      arrived: float) -> Response:
        # the job starts here, not in the body iterator: if the client left before the first
        # event, the iterator never runs, but the job still ends (cancelled) and frees its slot
        deltas: asyncio.Queue[str] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        begun = loop.create_future()  # the worker built the generation (drafter, plans)

        def on_begin() -> None:
            loop.call_soon_threadsafe(lambda: begun.done() or begun.set_result(None))

        task = asyncio.ensure_future(self.scheduler.run(
            reply.job, lambda d: loop.call_soon_threadsafe(deltas.put_nowait, d), on_begin))
        task.add_done_callback(lambda _: deltas.put_nowait(""))  # queued after every delta
        # the headers wait for the drafter: an option the package cannot run (a drafter it
        # has no heads for, a plan wider than its top-K) is a 400, as without streaming, not
        # an error event after a 200
        try:
            await _unless_disconnected(request, asyncio.wait(
                [begun, task], return_when=asyncio.FIRST_COMPLETED))
        except ClientGone:
            reply.job.cancel()
            raise
        if not begun.done():
            e = task.exception()
            if isinstance(e, ConfigError):
                raise APIError(400, self._public(e))
            task.result()  # (anything else: the 500 handler, the traceback to the log)

        def on_close() -> None:
            if not task.done():  # the client went away mid-stream
                self.metrics.cancelled.inc()
                reply.job.cancel()  # the worker stops after its current forward pass

        events = self._events(reply, task, deltas, include_usage, arrived)
        return _EventStream(events, on_close)

    async def _events(self, reply: "_Reply", task: asyncio.Future, deltas: asyncio.Queue,
                      include_usage: bool, arrived: float) -> AsyncIterator[str]:
        stop = StopText(reply.job.config.stop)

        def chunk(*args, **kw) -> str:  # with include_usage every chunk says "usage": null
            return _sse({**reply.chunk(*args, **kw), **({"usage": None} if include_usage
                                                        else {})})  # (as OpenAI documents)
        yield chunk(None, first=True)
        while not task.done() or not deltas.empty():
            delta = stop.push(await deltas.get())
            if delta:
                if stop.sent == len(delta):
                    self.metrics.first_token.observe(time.monotonic() - arrived)
                yield chunk(delta)
        try:
            result = task.result()
        except Exception as e:  # noqa: BLE001 (after the headers: an error event)
            if not isinstance(e, ConfigError):
                log.error("generation failed", exc_info=e)
            yield _sse(APIError(400, self._public(e)).body() if isinstance(e, ConfigError)
                       else _unexpected_body(e))
            yield "data: [DONE]\n\n"
            return
        self._finished(result, reply, arrived)
        yield chunk(stop.finish(result.text), finish=result)
        if include_usage:
            yield _sse(reply.usage_chunk(result))
        yield "data: [DONE]\n\n"

    def _finished(self, result: GenerationResult, reply: "_Reply", arrived: float) -> None:
        self.metrics.finished(result)
        self.metrics.latency.labels("chat" if reply.chat else "completions").observe(
            time.monotonic() - arrived)

    # -- limits --------------------------------------------------------------------------------

    def _check_key(self, request: Request) -> None:
        key = self.settings.api_key
        if key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(),
                                                                 key.encode()):
            raise APIError(401, "missing or wrong API key: send 'Authorization: Bearer KEY' "
                                "with the server's --api-key", type="authentication_error",
                           code="invalid_api_key")

    async def _read_json(self, request: Request):
        limit = self.settings.max_body_bytes
        declared = request.headers.get("content-length", "")
        too_big = APIError(413, f"the body is over the server's limit of {limit} bytes "
                                f"(--max-body-bytes)", code="request_too_large")
        if declared.isdigit() and int(declared) > limit + DRAIN_BYTES:
            raise too_big
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size <= limit:
                    chunks.append(chunk)
                elif size > limit + DRAIN_BYTES:
                    break
        except ClientDisconnect:
            raise APIError(400, "the client disconnected while sending the body") from None
        if size > limit:
            raise too_big
        try:
            return json.loads(b"".join(chunks))
        except RecursionError:  # ~1000 nested arrays or objects: Python's recursion limit
            raise APIError(400, "the body's JSON is nested too deeply to read (arrays or "
                                "objects about 1000 levels inside each other); a request needs "
                                "only a few levels", code="invalid_json") from None
        except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, and int()'s refusal
            # of a number over 4300 digits
            raise APIError(400, f"the body is not valid JSON: {e}", code="invalid_json") from None


class _Reply:
    """The OpenAI response objects of one request (completion or chat)."""

    def __init__(self, chat: bool, model: str, job: Job, prompt_tokens: int) -> None:
        self.chat, self.model, self.job, self.prompt_tokens = chat, model, job, prompt_tokens
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": f"edgemtp-{__version__}"}

    def finish_reason(self, result: GenerationResult) -> str:
        return "length" if self.job.timed_out else FINISH.get(result.stop_reason, "stop")

    def usage(self, result: GenerationResult) -> dict:
        st, n = result.stats, len(result.token_ids)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": n,
                "total_tokens": self.prompt_tokens + n,
                "block_efficiency": round(st.block_efficiency, 4),
                "forward_calls": st.forward_calls,
                "stop_reason": self.job.limit if self.job.timed_out else result.stop_reason,
                # (sampled: the seed it used, so an answer can be drawn again with it)
                **({"seed": self.job.config.seed} if self.job.config.temperature > 0 else {})}

    def whole(self, text: str, result: GenerationResult) -> dict:
        choice = {"index": 0, "logprobs": None, "finish_reason": self.finish_reason(result)}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
            return {**self._head("chat.completion"), "choices": [choice],
                    "usage": self.usage(result)}
        choice["text"] = text
        return {**self._head("text_completion"), "choices": [choice], "usage": self.usage(result)}

    def chunk(self, text: str | None, first: bool = False,
              finish: GenerationResult | None = None) -> dict:
        reason = None if finish is None else self.finish_reason(finish)
        choice = {"index": 0, "logprobs": None, "finish_reason": reason}
        if self.chat:
            choice["delta"] = ({"role": "assistant", "content": ""} if first else
                               {"content": text} if text else {})
            return {**self._head("chat.completion.chunk"), "choices": [choice]}
        choice["text"] = text or ""
        return {**self._head("text_completion"), "choices": [choice]}

    def usage_chunk(self, result: GenerationResult) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head(obj), "choices": [], "usage": self.usage(result)}


class _EventStream(StreamingResponse):
    """Server-sent events that call ``on_close`` however the response ends (a client that
    left before the first event included)."""

    def __init__(self, events: AsyncIterator[str], on_close) -> None:
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


class _CountRequests:
    """Pure ASGI middleware: every answered request counted by endpoint and status."""

    def __init__(self, app, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = 500

        async def counted(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, counted)
        finally:
            path = scope["path"]
            path = (path if path in KNOWN_PATHS else
                    MODEL_PATH if path.startswith("/v1/models/") else "other")
            self.metrics.requests.labels(path, str(status)).inc()


async def _unless_disconnected(request: Request, work: Awaitable[T], undo=None) -> T:
    """``await work``, unless the client disconnects first: then cancel it, call ``undo`` if
    it had completed anyway, and raise :class:`ClientGone`."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if not task.done():
        task.cancel()
        await asyncio.wait([task])
        if undo is not None and not task.cancelled() and task.exception() is None:
            undo()
        raise ClientGone
    return task.result()


async def _disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def _api_error(request: Request, e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


async def _http_error(request: Request, e: HTTPException) -> JSONResponse:
    what = {404: ("not_found", f"no route {request.url.path!r}; this server answers "
                               f"/v1/completions, /v1/chat/completions, /v1/models, /health "
                               f"and /metrics"),
            405: ("method_not_allowed", f"{request.method} is not allowed on "
                                        f"{request.url.path!r}")}
    code, message = what.get(e.status_code, (None, str(e.detail)))
    return JSONResponse(APIError(e.status_code, message, code=code).body(),
                        status_code=e.status_code, headers=getattr(e, "headers", None))


def _unexpected_body(e: Exception) -> dict:
    return APIError(500, f"internal error ({type(e).__name__}); the server log has the "
                         f"details", type="server_error").body()


async def _unexpected(request: Request, e: Exception) -> JSONResponse:
    log.error("unexpected error on %s %s", request.method, request.url.path, exc_info=e)
    return JSONResponse(_unexpected_body(e), status_code=500)
