"""The outermost ASGI layer: the API-key and Host checks on every request, and request counting per
endpoint."""

from __future__ import annotations

import hmac
import ipaddress
from typing import Any

from fastapi.responses import JSONResponse

from .metrics import Metrics
from .protocol import error_body

ENDPOINTS = ("/v1/models", "/v1/completions", "/v1/chat/completions", "/health", "/metrics")


class RequestGate:
    """ASGI middleware: refuses requests without the API key (when one is set) with 401, and those
    addressed to another name than this machine's own (when ``local_names_only``) with 403; counts every
    HTTP request by endpoint and status."""

    def __init__(self, app: Any, *, api_key: str | None, metrics: Metrics, local_names_only: bool = False):
        self.app = app
        self.key = api_key.encode() if api_key else None
        self.metrics = metrics
        self.local_names_only = local_names_only

    def _addressed_here(self, scope: dict[str, Any]) -> bool:
        """The Host header names this machine (or there is none: only browsers must send one). A web page
        whose name is re-pointed at 127.0.0.1 (DNS rebinding) is same-origin to the browser, so JSON
        alone does not keep it out; its Host header still names the page's site."""
        for name, value in scope.get("headers", []):
            if name == b"host":
                return is_loopback_name(host_name(value.decode("latin-1")))
        return True

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
            if self.local_names_only and not self._addressed_here(scope):
                await _foreign_host()(scope, receive, send_)
                return
            await self.app(scope, receive, send_)
        finally:
            self.metrics.observe_request(endpoint, status[0] or 500)


def _unauthorized() -> JSONResponse:
    return JSONResponse(error_body("missing or invalid API key: send 'Authorization: Bearer KEY'",
                                   "invalid_request_error", None, "invalid_api_key"),
                        status_code=401, headers={"WWW-Authenticate": "Bearer"})


def _foreign_host() -> JSONResponse:
    return JSONResponse(error_body("this server answers requests addressed to localhost or a loopback address "
                                   "only (it listens on this machine, with no API key); serve with --api-key KEY "
                                   "to take other host names", "invalid_request_error", None, "host_not_allowed"),
                        status_code=403)


def host_name(host: str) -> str:
    """A Host header's name without its port: "[::1]:8080" -> "::1", "localhost:8080" -> "localhost"."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host
    return host.rpartition(":")[0] if host.count(":") == 1 else host


def is_loopback_name(host: str) -> bool:
    """localhost (and its subdomains, which resolvers keep on this machine) or a loopback address."""
    host = host.strip("[]").rstrip(".")
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def endpoint_label(path: str) -> str:
    """The metrics label for a request path: one of ENDPOINTS, "/v1/models/*" or "other"."""
    if path in ENDPOINTS:
        return path
    if path.startswith("/v1/models/"):
        return "/v1/models/*"
    return "other"
