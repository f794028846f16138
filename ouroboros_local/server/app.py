"""The OpenAI-compatible HTTP application: FastAPI routes, a FIFO generation queue, SSE streaming.

One engine generation runs at a time, in one worker thread (llama.cpp releases the GIL while it
decodes, so the event loop keeps answering). Requests wait in a bounded FIFO queue; a full queue
answers 503. Each request owns a cancel Event: a client that disconnects (while queued or while
streaming) sets it, the engine's loop stops at the next round and the KV cache stays consistent.

Errors use OpenAI's body: ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import threading
import time
import uuid
from collections import deque
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import __version__
from ..chat import validate_messages
from ..errors import ContextOverflowError, MethodOptionError, OuroborosError, ParameterError
from ..proposers import applicable_options, check_options, method_names
from ..sampling import SamplingParams
from . import default_method
from .metrics import CONTENT_TYPE, Metrics

if TYPE_CHECKING:  # pragma: no cover
    from ..engine import Engine, GenerationResult

log = logging.getLogger("ouroboros_local.server")

ENDPOINTS = ("/v1/models", "/v1/completions", "/v1/chat/completions", "/health", "/metrics")
MAX_STOPS = 16
DEFAULT_COMPLETION_TOKENS = 16      # OpenAI's default for /v1/completions


# ---- configuration ------------------------------------------------------------------------------
@dataclass
class ServerConfig:
    model_id: str = "local"
    aliases: tuple[str, ...] = ()                 # other names accepted in the "model" field
    method: str | None = None                     # None: default_method() for the engine's pair
    method_options: dict[str, Any] = field(default_factory=dict)
    sampling: SamplingParams = field(default_factory=SamplingParams)   # defaults for omitted fields
    api_key: str | None = None
    max_queue: int = 16                           # requests waiting behind the running one
    default_max_tokens: int = 512                 # chat completions without max_tokens
    max_body_bytes: int = 8 * 1024 * 1024
    disconnect_poll_seconds: float = 0.25


# ---- errors -------------------------------------------------------------------------------------
class ApiError(Exception):
    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def _error_response(exc: ApiError) -> JSONResponse:
    return JSONResponse(error_body(exc.message, exc.type, exc.param, exc.code), status_code=exc.status,
                        headers=exc.headers)


def _bad(param: str, message: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


class QueueFull(Exception):
    pass


class ClientGone(Exception):
    pass


class Cancelled(Exception):
    pass


# ---- the generation queue -----------------------------------------------------------------------
class Job:
    """One generation request travelling from the event loop to the worker thread and back."""

    def __init__(self, tokens: list[int], params: dict[str, Any], loop: asyncio.AbstractEventLoop,
                 user_options: bool = False):
        self.tokens = tokens
        self.params = params
        self.user_options = user_options
        self.cancel = threading.Event()
        self.loop = loop
        self.items: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self.enqueued = time.perf_counter()

    def emit(self, kind: str, payload: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.items.put_nowait, (kind, payload))
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            self.cancel.set()


class Scheduler:
    """A bounded FIFO of jobs served one at a time by a single worker thread."""

    def __init__(self, engine: "Engine", metrics: Metrics, max_queue: int):
        self.engine = engine
        self.metrics = metrics
        self.max_queue = max(0, int(max_queue))
        self._cond = threading.Condition()
        self._waiting: deque[Job] = deque()
        self._running: Job | None = None
        self._closed = False
        self.completed = 0
        self._thread = threading.Thread(target=self._loop, name="ouroboros-generate", daemon=True)
        self._thread.start()

    @property
    def depth(self) -> int:
        with self._cond:
            return len(self._waiting)

    @property
    def busy(self) -> bool:
        with self._cond:
            return self._running is not None

    def submit(self, job: Job) -> None:
        with self._cond:
            if self._closed:
                raise QueueFull("the server is shutting down")
            # An idle server always takes a request; otherwise at most max_queue may wait.
            if len(self._waiting) >= self.max_queue and (self._running is not None or self._waiting):
                raise QueueFull(f"the server is busy: {len(self._waiting)} requests are queued "
                                f"(--max-queue {self.max_queue}); retry later")
            job.enqueued = time.perf_counter()
            self._waiting.append(job)
            self._cond.notify()

    def close(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._closed = True
            for job in self._waiting:
                job.cancel.set()
            if self._running is not None:
                self._running.cancel.set()
            self._cond.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._waiting and not self._closed:
                    self._cond.wait()
                if not self._waiting:
                    return
                job = self._waiting.popleft()
                self._running = job
            try:
                self._run(job)
            except BaseException:  # pragma: no cover - _run reports its own errors
                log.exception("generation worker failed")
            finally:
                with self._cond:
                    self._running = None
                    self.completed += 1

    def _run(self, job: Job) -> None:
        self.metrics.observe_queue_wait(time.perf_counter() - job.enqueued)
        if job.cancel.is_set():
            job.emit("error", Cancelled())
            return
        stream = self.engine.stream(job.tokens, cancel=job.cancel, **job.params)
        try:
            for event in stream:
                if event.result is not None:
                    self.metrics.observe_generation(event.result.stats)
                job.emit("event", event)
        except Exception as exc:  # reported to the client; the engine keeps its KV consistent
            if not isinstance(exc, (OuroborosError, ValueError, TypeError)):
                log.exception("generation failed")
            job.emit("error", exc)
        finally:
            stream.close()


# ---- request parsing ----------------------------------------------------------------------------
def _number(body: dict[str, Any], name: str, default: Any, *, integer: bool = False) -> Any:
    value = body.get(name)
    if value is None:
        return default
    kind = "an integer" if integer else "a number"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _bad(name, f"{name} must be {kind} (got {json.dumps(value)[:40]})", "invalid_type")
    if isinstance(value, float) and not math.isfinite(value):
        raise _bad(name, f"{name} must be a finite number (got {value})")
    if integer and isinstance(value, float):
        if not value.is_integer():
            raise _bad(name, f"{name} must be an integer (got {value})", "invalid_type")
        value = int(value)
    return value


def _sampling(body: dict[str, Any], base: SamplingParams) -> SamplingParams:
    temperature = _number(body, "temperature", base.temperature)
    if temperature < 0:
        raise _bad("temperature", f"temperature must be >= 0 (got {temperature})")
    top_p = _number(body, "top_p", base.top_p)
    if not 0.0 < top_p <= 1.0:
        raise _bad("top_p", f"top_p must be in (0, 1] (got {top_p})")
    top_k = _number(body, "top_k", base.top_k, integer=True)
    if top_k < 0:
        raise _bad("top_k", f"top_k must be >= 0 (0 = off) (got {top_k})")
    min_p = _number(body, "min_p", base.min_p)
    if not 0.0 <= min_p < 1.0:
        raise _bad("min_p", f"min_p must be in [0, 1) (got {min_p})")
    seed = _number(body, "seed", base.seed, integer=True)
    if seed is not None and seed < 0:
        if seed != -1:
            raise _bad("seed", f"seed must be >= 0, or -1 for a random seed (got {seed})")
        seed = None
    try:
        return SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                              seed=seed).validated()
    except ParameterError as exc:  # pragma: no cover - the checks above are the same
        raise _bad("temperature", str(exc)) from None


def _stops(body: dict[str, Any]) -> list[str]:
    value = body.get("stop")
    if value is None:
        return []
    if isinstance(value, str):
        return [value] if value else []
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise _bad("stop", "stop must be a string or a list of strings", "invalid_type")
    if len(value) > MAX_STOPS:
        raise _bad("stop", f"at most {MAX_STOPS} stop strings are supported (got {len(value)})")
    return [s for s in value if s]


def _unsupported(body: dict[str, Any], chat: bool) -> None:
    """Refuse OpenAI features that this server cannot honour rather than silently ignoring them."""
    def refuse(name: str, why: str) -> ApiError:
        return _bad(name, f"{name} is not supported by this server ({why})", "unsupported_parameter")

    n = body.get("n")
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n != 1):
        raise refuse("n", "one choice per request")
    best_of = body.get("best_of")
    if best_of is not None and best_of != 1:
        raise refuse("best_of", "one choice per request")
    for name in ("presence_penalty", "frequency_penalty"):
        value = body.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise _bad(name, f"{name} must be a number", "invalid_type")
        if value not in (None, 0, 0.0):
            raise refuse(name, "penalties would change the target distribution; decoding is lossless")
    if body.get("logit_bias"):
        raise refuse("logit_bias", "decoding follows the target model's distribution")
    if body.get("logprobs") not in (None, False, 0):
        raise refuse("logprobs", "not implemented")
    if body.get("top_logprobs") not in (None, 0):
        raise refuse("top_logprobs", "not implemented")
    if not chat:
        if body.get("echo"):
            raise refuse("echo", "not implemented")
        if body.get("suffix"):
            raise refuse("suffix", "not implemented")
    else:
        for name in ("tools", "functions"):
            if body.get(name):
                raise refuse(name, "no tool calling")
        fmt = body.get("response_format")
        if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
            raise refuse("response_format", "only plain text output")


def _stream_flags(body: dict[str, Any]) -> tuple[bool, bool]:
    stream = body.get("stream")
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise _bad("stream", "stream must be a boolean", "invalid_type")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not isinstance(options, dict):
            raise _bad("stream_options", "stream_options must be an object", "invalid_type")
        include_usage = options.get("include_usage") or False
        if not isinstance(include_usage, bool):
            raise _bad("stream_options", "stream_options.include_usage must be a boolean", "invalid_type")
    return stream, include_usage


def _method(body: dict[str, Any], default: str, server_options: dict[str, Any]) -> tuple[str, dict[str, Any], bool]:
    """The method and its options: the server's (those the method has) under the request's, all checked
    here, before anything is queued or allocated. A request cannot name a file (the history pool is the
    server's, set when it starts)."""
    method = body.get("method")
    if method is None:
        method = default
    if not isinstance(method, str):
        raise _bad("method", "method must be a string", "invalid_type")
    names = method_names()
    if method not in names:
        raise _bad("method", f"unknown method {method!r}; choose one of {', '.join(names)}")
    options = body.get("method_options")
    if options is None:
        options = {}
    if not isinstance(options, dict):
        raise _bad("method_options", "method_options must be an object", "invalid_type")
    try:
        check_options(method, options, per_request=True)
        merged = {**applicable_options(method, server_options), **options}
        check_options(method, merged)
    except ParameterError as exc:
        raise _bad("method_options", f"invalid method_options: {exc}") from None
    return method, merged, bool(options)


# ---- the application ----------------------------------------------------------------------------
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


class _Gate:
    """Outermost ASGI layer: API-key check on every request, and request counting by endpoint/status."""

    def __init__(self, app: Any, *, api_key: str | None, metrics: Metrics):
        self.app = app
        self.key = api_key.encode() if api_key else None
        self.metrics = metrics

    def _authorized(self, scope: dict[str, Any]) -> bool:
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)
        return False

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        endpoint = _endpoint_label(scope.get("path", ""))
        status = [0]

        async def send_(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status[0] = int(message["status"])
            await send(message)

        try:
            if self.key is not None and not self._authorized(scope):
                response = JSONResponse(
                    error_body("missing or invalid API key: send 'Authorization: Bearer KEY'",
                               "invalid_request_error", None, "invalid_api_key"),
                    status_code=401, headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send_)
                return
            await self.app(scope, receive, send_)
        finally:
            self.metrics.observe_request(endpoint, status[0] or 500)


def _endpoint_label(path: str) -> str:
    if path in ENDPOINTS:
        return path
    if path.startswith("/v1/models/"):
        return "/v1/models/*"
    return "other"


def _now() -> int:
    return int(time.time())


def _sse(payload: dict[str, Any] | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False,
                                                               separators=(",", ":"))
    return f"data: {data}\n\n"


def _finish_reason(result: "GenerationResult") -> str:
    return "length" if result.stats.finish_reason == "length" else "stop"


def _stats(result: "GenerationResult") -> dict[str, Any]:
    s = result.stats
    return {"method": s.method, "tokens_per_second": round(s.tokens_per_second, 3),
            "target_passes": s.target_passes, "drafted": s.drafted, "accepted": s.accepted,
            "accepted_per_pass": round(s.accepted_per_pass, 4), "tokens_per_pass": round(s.tokens_per_pass, 4),
            "prefill_seconds": round(s.prefill_seconds, 6), "decode_seconds": round(s.decode_seconds, 6),
            "finish_reason": s.finish_reason}


def _usage(n_prompt: int, result: "GenerationResult") -> dict[str, int]:
    return {"prompt_tokens": n_prompt, "completion_tokens": result.stats.tokens,
            "total_tokens": n_prompt + result.stats.tokens}


def _engine_error(exc: BaseException, job: Job) -> ApiError:
    if isinstance(exc, ContextOverflowError):
        return ApiError(413, str(exc), code="context_length_exceeded")
    if isinstance(exc, MethodOptionError) and job.user_options:
        return _bad("method_options", f"invalid method_options: {exc}")
    if isinstance(exc, OuroborosError):
        return ApiError(400, str(exc), code="invalid_value")
    if isinstance(exc, (ValueError, TypeError)) and job.user_options:
        return _bad("method_options", f"invalid method_options: {exc}")
    return ApiError(500, f"generation failed: {type(exc).__name__}: {exc}", type="server_error",
                    code="internal_error")


def create_app(engine: "Engine", config: ServerConfig | None = None) -> FastAPI:
    """The ASGI application serving ``engine``. Its worker thread stops at lifespan shutdown."""
    config = config or ServerConfig()
    metrics = Metrics()
    scheduler = Scheduler(engine, metrics, config.max_queue)
    method_default = config.method or default_method(engine.draft is not None)
    if method_default not in method_names():
        raise ParameterError(f"unknown method {method_default!r}; choose one of {', '.join(method_names())}")
    sampling_default = config.sampling.validated()
    model_ids = {config.model_id, *config.aliases}
    n_ctx = engine.target_ctx.n_ctx
    n_vocab = engine.target.n_vocab
    created = _now()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await anyio.to_thread.run_sync(scheduler.close)

    app = FastAPI(title="ouroboros-local", version=__version__, lifespan=lifespan,
                  docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine = engine
    app.state.scheduler = scheduler
    app.state.metrics = metrics
    app.state.config = config
    app.state.default_method = method_default

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return _error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return JSONResponse(error_body(message, "invalid_request_error", None, code),
                            status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:  # pragma: no cover
        log.exception("unhandled error")
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}", "server_error", None,
                                       "internal_error"), status_code=500)

    # ---- helpers using the app's state ----------------------------------------------------------
    async def read_json(request: Request) -> dict[str, Any]:
        # JSON only: a web page may POST text/plain to 127.0.0.1 without a CORS preflight, JSON it may not
        media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if media_type != "application/json":
            raise ApiError(415, f"send the request body as JSON with 'Content-Type: application/json' "
                                f"(got {media_type or 'no content type'!r})", code="unsupported_media_type")
        limit = config.max_body_bytes
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
        raw = b"".join(chunks)
        if not raw.strip():
            raise ApiError(400, "the request body is empty: send a JSON object", code="invalid_json")
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError) as exc:
            raise ApiError(400, f"the request body is not valid JSON: {exc}", code="invalid_json") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
        return body

    def check_model(body: dict[str, Any]) -> None:
        model = body.get("model")
        if model is None:
            return
        if not isinstance(model, str):
            raise _bad("model", "model must be a string", "invalid_type")
        if model not in model_ids:
            raise ApiError(404, f"the model {model!r} does not exist; this server serves {config.model_id!r}",
                           param="model", code="model_not_found")

    def completion_tokens(prompt: Any) -> list[int]:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return engine.tokenize(prompt)
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                       for t in prompt):
            bad = [t for t in prompt if not 0 <= t < n_vocab]
            if bad:
                raise _bad("prompt", f"token id {bad[0]} is outside the vocabulary (0..{n_vocab - 1})")
            return list(prompt)
        if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
            raise _bad("prompt", "batched prompts are not supported: send one prompt per request",
                       "unsupported_parameter")
        raise _bad("prompt", "prompt must be a string, a list of token ids, or a list holding one of those",
                   "invalid_type")

    def chat_tokens(messages: Any) -> list[int]:
        try:
            clean = validate_messages(messages)
            text = engine.apply_chat_template(clean)
        except ParameterError as exc:
            raise _bad("messages", str(exc)) from None
        return engine.tokenize(text, add_special=False, parse_special=True)

    async def next_item(job: Job, request: Request) -> tuple[str, Any]:
        """The job's next item; polls for a client disconnect while waiting (queued or generating)."""
        getter = asyncio.ensure_future(job.items.get())
        try:
            while True:
                done, _ = await asyncio.wait({getter}, timeout=config.disconnect_poll_seconds)
                if done:
                    return getter.result()
                if await request.is_disconnected():
                    job.cancel.set()
                    raise ClientGone()
        finally:
            if not getter.done():
                getter.cancel()

    async def batches(job: Job, first: tuple[str, Any]):
        """(text, result, error) per wake-up, coalescing the events queued meanwhile."""
        item = first
        while True:
            pending = [item]
            while not job.items.empty():
                pending.append(job.items.get_nowait())
            texts: list[str] = []
            result = error = None
            for kind, payload in pending:
                if kind == "error":
                    error = payload
                    break
                texts.append(payload.text)
                if payload.result is not None:
                    result = payload.result
                    break
            yield "".join(texts), result, error
            if result is not None or error is not None:
                return
            item = await job.items.get()

    async def generate(request: Request, chat: bool) -> Response:
        body = await read_json(request)
        check_model(body)
        _unsupported(body, chat)
        stream, include_usage = _stream_flags(body)
        sampling = _sampling(body, sampling_default)
        stops = _stops(body)
        method, options, user_options = _method(body, method_default, config.method_options)
        max_tokens = _number(body, "max_tokens", None, integer=True)
        if chat and max_tokens is None:
            max_tokens = _number(body, "max_completion_tokens", None, integer=True)
        if max_tokens is not None and max_tokens < 0:
            raise _bad("max_tokens", f"max_tokens must be >= 0 (got {max_tokens})")

        if chat:
            if "messages" not in body:
                raise _bad("messages", "messages is required", "missing_required_parameter")
            make_tokens: Callable[[], list[int]] = lambda: chat_tokens(body["messages"])
            param = "messages"
        else:
            if "prompt" not in body:
                raise _bad("prompt", "prompt is required", "missing_required_parameter")
            make_tokens = lambda: completion_tokens(body["prompt"])
            param = "prompt"
        try:
            tokens = await anyio.to_thread.run_sync(make_tokens)
        except OuroborosError as exc:
            raise _bad(param, str(exc)) from None
        if not tokens:
            raise _bad(param, "the prompt is empty")
        if len(tokens) + 1 > n_ctx:
            raise ApiError(413, f"the prompt has {len(tokens)} tokens but the context holds {n_ctx}: "
                                "shorten the prompt (or start the server with a larger --ctx-size)",
                           param=param, code="context_length_exceeded")
        room = n_ctx - len(tokens)
        if max_tokens is None:
            max_tokens = min(config.default_max_tokens if chat else DEFAULT_COMPLETION_TOKENS, room)
        elif max_tokens > room:
            raise ApiError(400, f"this model's context holds {n_ctx} tokens, but {len(tokens) + max_tokens} "
                                f"were requested ({len(tokens)} in the prompt, {max_tokens} for the "
                                f"completion): reduce max_tokens to at most {room}",
                           param="max_tokens", code="context_length_exceeded")

        params = dict(max_tokens=max_tokens, method=method, sampling=sampling, stop=stops, options=options)
        job = Job(tokens, params, asyncio.get_running_loop(), user_options=user_options)
        try:
            scheduler.submit(job)
        except QueueFull as exc:
            metrics.observe_rejected()
            raise ApiError(503, str(exc), type="server_error", code="queue_full",
                           headers={"Retry-After": "1"}) from None
        try:
            first = await next_item(job, request)
        except ClientGone:
            return Response(status_code=499)
        except BaseException:
            job.cancel.set()
            raise
        if first[0] == "error":
            if isinstance(first[1], Cancelled):
                return Response(status_code=499)
            raise _engine_error(first[1], job)

        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        ts = _now()
        n_prompt = len(tokens)
        model = config.model_id

        if not stream:
            try:
                text_parts: list[str] = []
                result = None
                item = first
                while True:
                    kind, payload = item
                    if kind == "error":
                        raise _engine_error(payload, job)
                    text_parts.append(payload.text)
                    if payload.result is not None:
                        result = payload.result
                        break
                    item = await next_item(job, request)
            except ClientGone:
                return Response(status_code=499)
            finally:
                job.cancel.set()
            text = result.text
            if chat:
                choice = {"index": 0, "message": {"role": "assistant", "content": text},
                          "logprobs": None, "finish_reason": _finish_reason(result)}
                obj = "chat.completion"
            else:
                choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": _finish_reason(result)}
                obj = "text_completion"
            return JSONResponse({"id": rid, "object": obj, "created": ts, "model": model,
                                 "system_fingerprint": None, "choices": [choice],
                                 "usage": _usage(n_prompt, result), "stats": _stats(result)})

        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(text: str | None, finish: str | None, first_chunk: bool = False) -> dict[str, Any]:
            if chat:
                delta: dict[str, Any] = {}
                if first_chunk:
                    delta["role"] = "assistant"
                if text is not None:
                    delta["content"] = text
                choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
            return {"id": rid, "object": obj, "created": ts, "model": model, "system_fingerprint": None,
                    "choices": [choice]}

        async def events() -> AsyncIterator[str]:
            if chat:
                yield _sse(chunk("", None, first_chunk=True))
            async for text, result, error in batches(job, first):
                if text:
                    yield _sse(chunk(text, None))
                if error is not None:
                    err = _engine_error(error, job)
                    yield _sse(error_body(err.message, err.type, err.param, err.code))
                    break
                if result is not None:
                    final = chunk(None if chat else "", _finish_reason(result))
                    final["stats"] = _stats(result)
                    yield _sse(final)
                    if include_usage:
                        yield _sse({"id": rid, "object": obj, "created": ts, "model": model,
                                    "system_fingerprint": None, "choices": [],
                                    "usage": _usage(n_prompt, result)})
            yield _sse("[DONE]")

        return _GenerationStreamingResponse(
            events(), job, media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    # ---- routes ---------------------------------------------------------------------------------
    def model_card() -> dict[str, Any]:
        return {"id": config.model_id, "object": "model", "created": created, "owned_by": "ouroboros-local",
                "meta": {"n_ctx": n_ctx, "n_vocab": n_vocab, "draft": engine.draft is not None,
                         "default_method": method_default, "methods": method_names()}}

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str) -> dict[str, Any]:
        if model not in model_ids:
            raise ApiError(404, f"the model {model!r} does not exist", param="model", code="model_not_found")
        return model_card()

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generate(request, chat=True)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": config.model_id, "default_method": method_default,
                "queue_depth": scheduler.depth, "busy": scheduler.busy, "max_queue": scheduler.max_queue,
                "completed": scheduler.completed}

    @app.get("/metrics")
    async def prometheus() -> Response:
        gauges = {
            "queue_depth": ("Requests waiting for the generation worker.", scheduler.depth),
            "generations_in_progress": ("Generations running now (0 or 1).", int(scheduler.busy)),
            "max_queue": ("Largest number of waiting requests before 503.", scheduler.max_queue),
            "context_size": ("Target context size in tokens.", n_ctx),
        }
        return Response(metrics.render(gauges), media_type=CONTENT_TYPE)

    app.add_middleware(_Gate, api_key=config.api_key, metrics=metrics)
    return app
