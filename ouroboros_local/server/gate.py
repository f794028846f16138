"""The outermost ASGI layer: the API-key check on every request, and request counting per endpoint."""

from __future__ import annotations

import hmac
from typing import Any

from fastapi.responses import JSONResponse

from .metrics import Metrics
from .protocol import error_body

ENDPOINTS = ("/v1/models", "/v1/completions", "/v1/chat/completions", "/health", "/metrics")


class RequestGate:
    """ASGI middleware: refuses requests without the API key (when one is set) with 401, and counts
    every HTTP request by endpoint and status."""

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
        endpoint = endpoint_label(scope.get("path", ""))
        status = [0]

        async def send_(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status[0] = int(message["status"])
            await send(message)

        try:
            if self.key is not None and not self._authorized(scope):
                await _unauthorized()(scope, receive, send_)
                return
            await self.app(scope, receive, send_)
        finally:
            self.metrics.observe_request(endpoint, status[0] or 500)


def _unauthorized() -> JSONResponse:
    return JSONResponse(error_body("missing or invalid API key: send 'Authorization: Bearer KEY'",
                                   "invalid_request_error", None, "invalid_api_key"),
                        status_code=401, headers={"WWW-Authenticate": "Bearer"})


def endpoint_label(path: str) -> str:
    """The metrics label for a request path: one of ENDPOINTS, "/v1/models/*" or "other"."""
    if path in ENDPOINTS:
        return path
    if path.startswith("/v1/models/"):
        return "/v1/models/*"
    return "other"
