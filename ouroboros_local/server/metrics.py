"""Server counters, rendered in the Prometheus text exposition format (version 0.0.4).

No dependency on prometheus_client: a handful of counters and gauges kept under one lock. Every label
set is bounded (endpoints are the known routes plus "other", methods come from the registry), so
memory does not grow with the number of requests.
"""

from __future__ import annotations

import math
import threading
import time
from collections import defaultdict
from typing import TYPE_CHECKING, Iterable

if TYPE_CHECKING:  # pragma: no cover
    from ..generation import GenerationStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PREFIX = "ouroboros"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(names: Iterable[str], values: Iterable[object]) -> str:
    pairs = [f'{n}="{_escape(str(v))}"' for n, v in zip(names, values, strict=True)]
    return "{" + ",".join(pairs) + "}" if pairs else ""


def _number(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if value == int(value) and abs(value) < 1e15:
        return str(int(value))
    return repr(float(value))


class Metrics:
    """Thread-safe counters for the HTTP layer and the generation worker."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.started = time.time()
        self.requests: dict[tuple[str, int], int] = defaultdict(int)        # (endpoint, status)
        self.generations: dict[tuple[str, str], int] = defaultdict(int)     # (method, finish)
        self.generated_tokens: dict[str, int] = defaultdict(int)
        self.prompt_tokens: dict[str, int] = defaultdict(int)
        self.target_passes: dict[str, int] = defaultdict(int)
        self.drafted_tokens: dict[str, int] = defaultdict(int)
        self.accepted_tokens: dict[str, int] = defaultdict(int)
        self.decode_seconds: dict[str, float] = defaultdict(float)
        self.prefill_seconds: dict[str, float] = defaultdict(float)
        self.last_tokens_per_second: dict[str, float] = {}
        self.queue_wait_seconds = 0.0
        self.queue_waits = 0
        self.rejected = 0

    # ---- observations ---------------------------------------------------------------------------
    def observe_request(self, endpoint: str, status: int) -> None:
        with self._lock:
            self.requests[(endpoint, int(status))] += 1

    def observe_queue_wait(self, seconds: float) -> None:
        with self._lock:
            self.queue_wait_seconds += max(0.0, seconds)
            self.queue_waits += 1

    def observe_rejected(self) -> None:
        with self._lock:
            self.rejected += 1

    def observe_generation(self, stats: "GenerationStats") -> None:
        m = stats.method
        with self._lock:
            self.generations[(m, stats.finish_reason or "unknown")] += 1
            self.generated_tokens[m] += stats.tokens
            self.prompt_tokens[m] += stats.prompt_tokens
            self.target_passes[m] += stats.target_passes
            self.drafted_tokens[m] += stats.drafted
            self.accepted_tokens[m] += stats.accepted
            self.decode_seconds[m] += stats.decode_seconds
            self.prefill_seconds[m] += stats.prefill_seconds
            if stats.tokens:
                self.last_tokens_per_second[m] = stats.tokens_per_second

    # ---- exposition -----------------------------------------------------------------------------
    def render(self, gauges: dict[str, tuple[str, float]] | None = None) -> str:
        """The exposition text; ``gauges`` adds point-in-time values: name -> (help, value)."""
        out: list[str] = []

        def family(name: str, kind: str, help_: str, label_names: tuple[str, ...],
                   samples: Iterable[tuple[tuple[object, ...], float]]) -> None:
            full = f"{PREFIX}_{name}"
            out.append(f"# HELP {full} {help_}")
            out.append(f"# TYPE {full} {kind}")
            for values, value in samples:
                out.append(f"{full}{_labels(label_names, values)} {_number(value)}")

        with self._lock:
            family("requests_total", "counter", "HTTP requests by endpoint and status code.",
                   ("endpoint", "status"), sorted(((e, s), n) for (e, s), n in self.requests.items()))
            family("requests_rejected_total", "counter", "Requests refused with 503 because the queue was full.",
                   (), [((), self.rejected)])
            family("generations_total", "counter", "Finished generations by method and finish reason.",
                   ("method", "finish_reason"), sorted(((m, f), n) for (m, f), n in self.generations.items()))
            per_method: list[tuple[str, str, str, dict]] = [
                ("generated_tokens_total", "counter", "Tokens generated (sent to clients).", self.generated_tokens),
                ("prompt_tokens_total", "counter", "Prompt tokens of finished generations.", self.prompt_tokens),
                ("target_passes_total", "counter", "Target model forward passes (one per verified tree).",
                 self.target_passes),
                ("drafted_tokens_total", "counter", "Draft tokens proposed for verification.", self.drafted_tokens),
                ("accepted_tokens_total", "counter", "Draft tokens accepted by the target.", self.accepted_tokens),
                ("decode_seconds_total", "counter", "Seconds spent decoding (after prefill).", self.decode_seconds),
                ("prefill_seconds_total", "counter", "Seconds spent on prompt prefill.", self.prefill_seconds),
            ]
            for name, kind, help_, table in per_method:
                family(name, kind, help_, ("method",), sorted(((m,), v) for m, v in table.items()))
            tps = {m: (self.generated_tokens[m] / s if s > 0 else 0.0) for m, s in self.decode_seconds.items()}
            family("tokens_per_second", "gauge",
                   "Decode throughput per method: generated tokens / decode seconds since start.",
                   ("method",), sorted(((m,), v) for m, v in tps.items()))
            family("last_tokens_per_second", "gauge", "Decode throughput of the latest generation per method.",
                   ("method",), sorted(((m,), v) for m, v in self.last_tokens_per_second.items()))
            acc = {m: self.accepted_tokens[m] / n for m, n in self.target_passes.items() if n}
            family("accepted_per_pass", "gauge", "Accepted draft tokens per target pass since start.",
                   ("method",), sorted(((m,), v) for m, v in acc.items()))
            family("queue_wait_seconds", "summary", "Time requests waited in the queue before generating.",
                   (), [])
            out.append(f"{PREFIX}_queue_wait_seconds_sum {_number(self.queue_wait_seconds)}")
            out.append(f"{PREFIX}_queue_wait_seconds_count {self.queue_waits}")
        for name, (help_, value) in (gauges or {}).items():
            family(name, "gauge", help_, (), [((), value)])
        family("uptime_seconds", "gauge", "Seconds since the server started.", (),
               [((), round(time.time() - self.started, 3))])
        return "\n".join(out) + "\n"

    def snapshot(self) -> dict[str, object]:
        """A JSON-friendly copy of the counters (used by /health and tests)."""
        with self._lock:
            return {
                "requests": {f"{e} {s}": n for (e, s), n in self.requests.items()},
                "generated_tokens": dict(self.generated_tokens),
                "target_passes": dict(self.target_passes),
                "accepted_tokens": dict(self.accepted_tokens),
                "rejected": self.rejected,
            }

