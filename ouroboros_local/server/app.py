"""The OpenAI-compatible HTTP application: FastAPI routes around one Engine, with SSE streaming.

The routes parse and check requests with ``.protocol``, queue generations on the ``.worker`` thread
(one at a time, in a bounded FIFO: a full queue answers 503), and answer with ``.protocol``'s shapes.
A client that disconnects, while queued or while its answer is made, cancels its generation (499); a
server asked to stop ends the queued and running ones with 503 (``shutting_down``).
``.gate`` checks the API key and counts requests.

Errors use OpenAI's body: ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from .. import __version__
from ..errors import ContextOverflowError, OuroborosError, ParameterError
from ..proposers import method_names
from ..sampling import SamplingParams
from . import default_method
from .gate import RequestGate
from .metrics import CONTENT_TYPE, Metrics
from .protocol import (DEFAULT_COMPLETION_TOKENS, ApiError, ChatTemplateFields, GenerationRequest, Reply,
                       bad_request, chat_messages, check_model, completion_budget, completion_prompt, context_exceeded,
                       engine_error, error_body, now, parse_generation, parse_json_body, require_json, sse)
from .worker import Cancelled, ClientGone, GenerationWorker, Job, QueueFull, ShuttingDown

if TYPE_CHECKING:  # pragma: no cover
    from ..engine import Engine
    from ..generation import GenerationResult

log = logging.getLogger("ouroboros_local.server")

CLIENT_CLOSED = 499     # nginx's status for a request whose client went away


@dataclass
class ServerConfig:
    model_id: str = "local"
    aliases: tuple[str, ...] = ()                 # other names accepted in the "model" field
    method: str | None = None                     # None: default_method() for the engine's pair
    method_options: dict[str, Any] = field(default_factory=dict)
    sampling: SamplingParams = field(default_factory=SamplingParams)   # defaults for omitted fields
    api_key: str | None = None
    local_names_only: bool = False                # 403 for a Host header that is not localhost or loopback
    max_queue: int = 16                           # requests waiting behind the running one
    default_max_tokens: int = 512                 # chat completions without max_tokens
    max_body_bytes: int = 8 * 1024 * 1024
    disconnect_poll_seconds: float = 0.25


def _returning_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` returning the errors answered as 400s, detached from the frames they passed through, instead
    of raising them across anyio's future (others, a 500's, keep their traceback for the log): the
    exception, its traceback (the awaiting frame) and the future form a cycle that held a refused
    request's body, its rendered prompt and their bytes until a full collection (a client resending an
    over-long chat grew the server by gigabytes)."""
    def call(*args: Any) -> Any:
        try:
            return fn(*args)
        except (OuroborosError, ApiError) as exc:   # answered as a 400: no one reads where it came from
            exc.__traceback__ = exc.__context__ = exc.__cause__ = None
            return exc
    return call


def create_app(engine: "Engine", config: ServerConfig | None = None) -> FastAPI:
    """The ASGI application serving ``engine``. Its worker thread stops at lifespan shutdown."""
    service = _Service(engine, config or ServerConfig())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await anyio.to_thread.run_sync(service.worker.close)

    app = FastAPI(title="ouroboros-local", version=__version__, lifespan=lifespan,
                  docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine = engine
    app.state.worker = service.worker
    app.state.metrics = service.metrics
    app.state.config = service.config
    app.state.default_method = service.default_method
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(ClientDisconnect, _client_disconnected)
    app.add_exception_handler(Exception, _internal_error)
    app.get("/v1/models")(service.list_models)
    app.get("/v1/models/{model:path}")(service.get_model)
    app.post("/v1/completions")(service.completions)
    app.post("/v1/chat/completions")(service.chat_completions)
    app.get("/health")(service.health)
    app.get("/metrics")(service.prometheus)
    app.add_middleware(RequestGate, api_key=service.config.api_key, metrics=service.metrics,
                       local_names_only=service.config.local_names_only)
    return app


# ---- error handlers -----------------------------------------------------------------------------
async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    message = f"{request.method} {request.url.path}: {exc.detail}"
    return JSONResponse(error_body(message, "invalid_request_error", None, code),
                        status_code=exc.status_code, headers=getattr(exc, "headers", None))


async def _client_disconnected(request: Request, exc: ClientDisconnect) -> Response:
    # the client closed the connection while sending its body: nobody to answer, nothing to log
    return Response(status_code=CLIENT_CLOSED)


async def _internal_error(request: Request, exc: Exception) -> JSONResponse:  # pragma: no cover
    log.exception("unhandled error")
    return JSONResponse(error_body(f"internal error: {type(exc).__name__}", "server_error", None,
                                   "internal_error"), status_code=500)


# ---- the routes ---------------------------------------------------------------------------------
class _Service:
    """The engine, its generation worker and the server's settings, and the route handlers using them."""

    def __init__(self, engine: "Engine", config: ServerConfig):
        self.engine = engine
        self.config = config
        self.default_method = config.method or default_method(engine.draft is not None)
        if self.default_method not in method_names():
            raise ParameterError(f"unknown method {self.default_method!r}; "
                                 f"choose one of {', '.join(method_names())}")
        self.sampling_default = config.sampling.validated()
        self.model_ids = {config.model_id, *config.aliases}
        self.n_ctx = engine.target_ctx.n_ctx
        self.n_vocab = engine.target.n_vocab
        self.created = now()
        self.metrics = Metrics()
        self.worker = GenerationWorker(engine, self.metrics, config.max_queue)

    def _model_card(self) -> dict[str, Any]:
        return {"id": self.config.model_id, "object": "model", "created": self.created,
                "owned_by": "ouroboros-local",
                "meta": {"n_ctx": self.n_ctx, "n_vocab": self.n_vocab, "draft": self.engine.draft is not None,
                         "default_method": self.default_method, "methods": method_names()}}

    async def list_models(self) -> dict[str, Any]:
        return {"object": "list", "data": [self._model_card()]}

    async def get_model(self, model: str) -> dict[str, Any]:
        if model not in self.model_ids:
            raise ApiError(404, f"the model {model!r} does not exist", param="model", code="model_not_found")
        return self._model_card()

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def health(self) -> dict[str, Any]:
        worker = self.worker
        return {"status": "ok", "model": self.config.model_id, "default_method": self.default_method,
                "queue_depth": worker.depth, "busy": worker.busy, "max_queue": worker.max_queue,
                "completed": worker.completed}

    async def prometheus(self) -> Response:
        gauges = {
            "queue_depth": ("Requests waiting for the generation worker.", self.worker.depth),
            "generations_in_progress": ("Generations running now (0 or 1).", int(self.worker.busy)),
            "max_queue": ("Largest number of waiting requests before 503.", self.worker.max_queue),
            "context_size": ("Target context size in tokens.", self.n_ctx),
        }
        return Response(self.metrics.render(gauges), media_type=CONTENT_TYPE)

    # ---- a generation ---------------------------------------------------------------------------
    async def _generate(self, request: Request, chat: bool) -> Response:
        body = await self._read_json(request)
        check_model(body, self.model_ids, self.config.model_id)
        parsed = parse_generation(body, chat, self.sampling_default, self.default_method,
                                  self.config.method_options, has_draft=self.engine.draft is not None,
                                  pair=(getattr(self.engine, "pair_compatible", None),
                                        getattr(self.engine, "pair_reason", None)))
        self._or_503(self.worker.check_room)   # before the prompt is tokenized: seconds of CPU for a long one
        job = self._submit(parsed, await self._prompt_tokens(parsed))
        try:
            first = await self._next_item(job, request)
        except ClientGone:
            return Response(status_code=CLIENT_CLOSED)
        except BaseException:
            job.cancel.set()
            raise
        if first[0] == "error":
            if isinstance(first[1], Cancelled):
                return Response(status_code=CLIENT_CLOSED)
            raise engine_error(first[1], job.user_options)
        reply = Reply.start(chat, self.config.model_id, len(job.tokens))
        if parsed.stream:
            return _GenerationStreamingResponse(
                _stream_events(job, first, reply, parsed.include_usage), job, media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await self._complete(job, request, first, reply)

    async def _read_json(self, request: Request) -> dict[str, Any]:
        require_json(request.headers.get("content-type", ""))
        limit = self.config.max_body_bytes
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > limit:
            raise ApiError(413, f"request body too large ({length} bytes; limit {limit})",
                           code="request_too_large")
        chunks: list[bytes] = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise ApiError(413, f"request body too large (limit {limit} bytes)", code="request_too_large")
            chunks.append(chunk)
        return parse_json_body(b"".join(chunks))

    async def _prompt_tokens(self, parsed: GenerationRequest) -> list[int]:
        make_tokens = self._chat_tokens if parsed.chat else self._completion_tokens
        outcome = await anyio.to_thread.run_sync(_returning_errors(make_tokens), parsed)
        if isinstance(outcome, ContextOverflowError):   # counted, never listed (a huge prompt's memory stays bounded)
            raise context_exceeded(outcome.counted, self.engine.target_ctx.n_ctx, parsed.param)
        if isinstance(outcome, OuroborosError):
            raise bad_request(parsed.param, str(outcome))
        if isinstance(outcome, BaseException):
            try:
                raise outcome
            finally:   # this frame must not hold the exception whose traceback holds this frame
                outcome = None
        return outcome

    def _completion_tokens(self, parsed: GenerationRequest) -> list[int]:
        return self.engine.prompt_tokens(completion_prompt(parsed.prompt))

    def _chat_tokens(self, parsed: GenerationRequest) -> list[int]:
        clean = chat_messages(parsed.prompt)   # each message a dict with a role, once this returns
        template = parsed.template or ChatTemplateFields(None, None, None)
        try:
            text = self.engine.chat_prompt(clean, **template.options(parsed.prompt, clean))
        except ParameterError as exc:
            raise bad_request("messages", str(exc)) from None
        return self.engine.tokenize(text, add_special=True, parse_special=True, limit=self.n_ctx - 1)

    def _submit(self, parsed: GenerationRequest, tokens: list[int]) -> Job:
        """Queue the generation (after checking that the context holds it), or answer 503."""
        default = self.config.default_max_tokens if parsed.chat else DEFAULT_COMPLETION_TOKENS
        max_tokens = completion_budget(len(tokens), parsed.max_tokens, self.n_ctx, default, parsed.param,
                                       parsed.max_tokens_param)
        params = dict(max_tokens=max_tokens, method=parsed.method, sampling=parsed.sampling,
                      stop=parsed.stops, options=parsed.options)
        job = Job(tokens, params, asyncio.get_running_loop(), user_options=parsed.user_options)
        self._or_503(lambda: self.worker.submit(job))
        return job

    def _or_503(self, action: Callable[[], None]) -> None:
        """Run ``action``, a worker call that may refuse a job; a refusal is a 503."""
        try:
            action()
        except ShuttingDown as exc:
            raise engine_error(exc, False) from None
        except QueueFull as exc:
            self.metrics.observe_rejected()
            raise ApiError(503, str(exc), type="server_error", code="queue_full",
                           headers={"Retry-After": "1"}) from None

    async def _next_item(self, job: Job, request: Request) -> tuple[str, Any]:
        return await job.next_item(request.is_disconnected, self.config.disconnect_poll_seconds)

    async def _complete(self, job: Job, request: Request, first: tuple[str, Any], reply: Reply) -> Response:
        """The whole response, once the generation ends."""
        try:
            result = await self._result(job, request, first)
        except ClientGone:
            return Response(status_code=CLIENT_CLOSED)
        finally:
            job.cancel.set()
        return JSONResponse(reply.body(result))

    async def _result(self, job: Job, request: Request, item: tuple[str, Any]) -> "GenerationResult":
        while True:
            kind, payload = item
            if kind == "error":
                raise engine_error(payload, job.user_options)
            if payload.result is not None:
                return payload.result
            item = await self._next_item(job, request)


async def _stream_events(job: Job, first: tuple[str, Any], reply: Reply,
                         include_usage: bool) -> AsyncIterator[str]:
    """The server-sent events of a streamed generation, ending with "[DONE]"."""
    if reply.chat:
        yield sse(reply.chunk("", None, first_chunk=True))
    async for text, result, error in job.batches(first):
        if text:
            yield sse(reply.chunk(text, None))
        if error is not None:
            yield sse(engine_error(error, job.user_options).body())
            break
        if result is not None:
            yield sse(reply.final_chunk(result))
            if include_usage:
                yield sse(reply.usage_chunk(result))
    yield sse("[DONE]")


class _GenerationStreamingResponse(StreamingResponse):
    """A StreamingResponse that cancels its generation however the response ends (disconnect too)."""

    def __init__(self, content: AsyncIterator[str], job: Job, **kwargs: Any):
        super().__init__(content, **kwargs)
        self._job = job

    async def __call__(self, scope, receive, send) -> None:  # type: ignore[override]
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._job.cancel.set()
