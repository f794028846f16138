"""The generation worker: a bounded FIFO of jobs that one thread runs on the engine, one at a time.

llama.cpp releases the GIL while it decodes, so the event loop keeps answering meanwhile. A full queue
refuses a job (the app answers 503). Each job owns a cancel Event: a client that disconnects (while
queued or while its answer is made) sets it, the engine's loop stops at the next round (or prefill batch)
and the KV cache stays consistent. A server asked to stop ends every job (``shut_down``). The worker
sends each job's stream events (or its error) back to the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any, AsyncIterator, Awaitable, Callable

from ..errors import DrafterError, OuroborosError
from .metrics import Metrics

if TYPE_CHECKING:  # pragma: no cover
    from ..engine import Engine
    from ..generation import GenerationResult

log = logging.getLogger("ouroboros_local.server")


class QueueFull(Exception):
    """The queue holds its maximum of waiting jobs."""


class ClientGone(Exception):
    """The client disconnected while its job waited or ran."""


class Cancelled(Exception):
    """The job was cancelled before the worker started it."""


def is_server_fault(exc: BaseException) -> bool:
    """Is ``exc`` the server's to fix (answered 500, its traceback logged), not the request's?"""
    return isinstance(exc, DrafterError) or not isinstance(exc, OuroborosError)


class ShuttingDown(OuroborosError):
    """The server began to shut down (Ctrl-C, SIGTERM) before the job was done: it was ended."""

    def __init__(self) -> None:
        super().__init__("the server is shutting down; retry on another instance or once it is back")


class Job:
    """One generation request travelling from the event loop to the worker thread and back.

    The worker puts ("event", StreamEvent) items, or one ("error", exception), on ``items``."""

    def __init__(self, tokens: list[int], params: dict[str, Any], loop: asyncio.AbstractEventLoop,
                 user_options: bool = False):
        self.tokens = tokens
        self.params = params
        self.user_options = user_options
        self.cancel = threading.Event()
        self.loop = loop
        self.items: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self.enqueued = time.perf_counter()
        self._next_poll = 0.0   # when next_item asks whether the client is still there (monotonic)

    def emit(self, kind: str, payload: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.items.put_nowait, (kind, payload))
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            self.cancel.set()

    async def next_item(self, is_disconnected: Callable[[], Awaitable[bool]],
                        poll_seconds: float) -> tuple[str, Any]:
        """The next item; asks every ``poll_seconds`` whether the client is still there (queued or
        generating: a generation's items come every few milliseconds, so the clock decides, not a quiet
        spell), and on a disconnect cancels the job and raises ClientGone."""
        getter = asyncio.ensure_future(self.items.get())
        try:
            if not self._next_poll:
                self._next_poll = time.monotonic() + poll_seconds
            while True:
                wait = max(0.0, self._next_poll - time.monotonic())
                done, _ = await asyncio.wait({getter}, timeout=wait)
                if time.monotonic() >= self._next_poll:
                    self._next_poll = time.monotonic() + poll_seconds
                    if await is_disconnected():
                        self.cancel.set()
                        raise ClientGone()
                if done:
                    return getter.result()
        finally:
            if not getter.done():
                getter.cancel()

    async def batches(self, first: tuple[str, Any]) -> AsyncIterator[
            tuple[str, "GenerationResult | None", BaseException | None]]:
        """(text, result, error) per wake-up, from ``first`` on, coalescing the items queued meanwhile;
        ends after the one with the result or the error."""
        item = first
        while True:
            text, result, error = self._coalesce(item)
            yield text, result, error
            if result is not None or error is not None:
                return
            item = await self.items.get()

    def _coalesce(self, item: tuple[str, Any]) -> tuple[str, "GenerationResult | None", BaseException | None]:
        pending = [item]
        while not self.items.empty():
            pending.append(self.items.get_nowait())
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
        return "".join(texts), result, error


class GenerationWorker:
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
            self._drop_cancelled()
            return len(self._waiting)

    @property
    def busy(self) -> bool:
        with self._cond:
            return self._running is not None

    def check_room(self) -> None:
        """QueueFull or ShuttingDown where a job would be refused now (asked before a prompt is
        tokenized, which takes seconds for a long one; ``submit`` asks again)."""
        with self._cond:
            if self._closed:
                raise ShuttingDown()
            self._drop_cancelled()   # a client gone while queued holds no place
            # At most max_queue wait beside the one running; between jobs, the first waiting is the next
            # to run (counted as waiting, a client that sent its next request as soon as it had its answer
            # heard a 503 from a server with nothing else to do)
            if len(self._waiting) + (self._running is not None) > self.max_queue:
                raise QueueFull(f"the server is busy: {len(self._waiting)} requests are queued "
                                f"(--max-queue {self.max_queue}); retry later")

    def submit(self, job: Job) -> None:
        with self._cond:
            self.check_room()
            job.enqueued = time.perf_counter()
            self._waiting.append(job)
            self._cond.notify()

    def _drop_cancelled(self) -> None:
        # (with the lock held) jobs whose client left while they waited: nobody reads their answer
        if any(job.cancel.is_set() for job in self._waiting):
            for job in [job for job in self._waiting if job.cancel.is_set()]:
                self._waiting.remove(job)
                self.metrics.observe_queue_wait(time.perf_counter() - job.enqueued)
                job.emit("error", self._ended())

    def _ended(self) -> Exception:
        # why a job cancelled before it ran ends: its client left, or the server is stopping (a 503 then,
        # however the job was found: /health reading ``depth`` meanwhile once made it a 499)
        return ShuttingDown() if self._closed else Cancelled()

    def shut_down(self) -> None:
        """Take no more jobs and end the queued and the running one, whose clients hear ShuttingDown
        (503): called when the server is asked to stop, before it waits for its connections to end."""
        with self._cond:
            self._closed = True
            for job in self._waiting:
                job.cancel.set()
            if self._running is not None:
                self._running.cancel.set()
            self._cond.notify_all()

    def close(self, timeout: float = 10.0) -> None:
        self.shut_down()
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
            job.emit("error", self._ended())
            return
        stream = self.engine.stream(job.tokens, cancel=job.cancel, **job.params)
        try:
            for event in stream:
                if event.result is not None:
                    self.metrics.observe_generation(event.result.stats)
                    if event.result.stats.finish_reason == "cancelled" and self._closed:
                        job.emit("error", ShuttingDown())   # not a short answer passed off as whole
                        break
                if event.result is not None:   # first: the client may send its next request as soon as it
                    self._answered(job)         # has this, before this thread runs again
                job.emit("event", event)
        except Exception as exc:  # reported to the client; the engine keeps its KV consistent
            if is_server_fault(exc):   # the client hears one line; the log keeps the traceback
                log.exception("generation failed")
            job.emit("error", exc)
        finally:
            stream.close()

    def _answered(self, job: Job) -> None:
        """``job``'s client has its answer: it no longer holds the running place, while the stream still
        closes (the history saved): the client's next request, sent at once, found the server full."""
        with self._cond:
            if self._running is job:
                self._running = None
