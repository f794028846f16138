"""OpenAI-compatible HTTP server (``ouroboros-local serve``).

FastAPI and uvicorn are the optional extra ``server``; importing this package does not need them.
``create_app`` (in ``.app``) builds the ASGI application around a loaded Engine, with a ``ServerConfig``.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:   # the real types for type checkers; at runtime .app (FastAPI) loads when first used
    from fastapi import FastAPI

    from ..engine import Engine
    from .app import ServerConfig


def default_method(has_draft: bool, available: list[str] | None = None) -> str:
    """The fastest lossless method for a model pair: "auto" where the build has it, else a draft
    model's speculative decoding, else prompt lookup (needs no draft), else plain decoding."""
    if available is None:
        from ..proposers import method_names

        available = method_names()
    order = ["auto", "speculative", "prompt-lookup", "vanilla"] if has_draft else \
        ["auto", "prompt-lookup", "vanilla"]
    for name in order:
        if name in available:
            return name
    return "vanilla"


def defer_method_default(parser: argparse.ArgumentParser, help: str) -> None:
    """Make ``parser``'s --method default to None, so that default_method() picks the method once the
    model pair is loaded; ``help`` describes that choice."""
    for action in parser._actions:
        if action.dest == "method":
            action.default = None
            action.help = help


def create_app(engine: Engine, config: ServerConfig | None = None) -> FastAPI:
    """Build the FastAPI application (see ``ouroboros_local.server.app.create_app``)."""
    from .app import create_app as _create_app

    return _create_app(engine, config)


if not TYPE_CHECKING:   # hidden from type checkers, which see the import above
    def __getattr__(name: str) -> object:
        if name == "ServerConfig":   # loaded with .app, as create_app is: FastAPI only when used
            from .app import ServerConfig

            return ServerConfig
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ServerConfig (lazily, with FastAPI) is not in __all__: `from ouroboros_local.server import *` needs no FastAPI
__all__ = ["create_app", "default_method", "defer_method_default"]
