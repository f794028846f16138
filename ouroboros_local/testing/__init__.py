"""Test helpers: tiny generated GGUF models (no downloads).

The names are looked up when first used: importing ``tiny_models`` here made
``python -m ouroboros_local.testing.tiny_models`` run a module already imported, and runpy warned."""

from importlib import import_module
from typing import Any

__all__ = ["CHATML_TEMPLATE", "ENDOFTEXT", "IM_END", "IM_START", "TinyVocab", "corrupt_copies", "tiny_vocab",
           "write_tiny_model"]


def __getattr__(name: str) -> Any:
    if name in __all__ or name == "tiny_models":
        tiny_models = import_module(f"{__name__}.tiny_models")   # not `from . import`: it asks this again
        return tiny_models if name == "tiny_models" else getattr(tiny_models, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
