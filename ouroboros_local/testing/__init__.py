"""Test helpers: tiny generated GGUF models (no downloads).

The names are looked up when first used: importing ``tiny_models`` here made
``python -m ouroboros_local.testing.tiny_models`` run a module already imported, and runpy warned."""

from importlib import import_module
from typing import TYPE_CHECKING

__all__ = ["CHATML_TEMPLATE", "ENDOFTEXT", "IM_END", "IM_START", "TinyVocab", "corrupt_copies", "tiny_vocab",
           "write_tiny_model"]

if TYPE_CHECKING:   # what type checkers see of the lazy names below (their real types, not Any)
    from .tiny_models import (CHATML_TEMPLATE, ENDOFTEXT, IM_END, IM_START, TinyVocab, corrupt_copies, tiny_vocab,
                              write_tiny_model)
else:   # hidden from type checkers: a module __getattr__ made every unknown name Any for them
    def __getattr__(name: str) -> object:
        if name in __all__ or name == "tiny_models":
            tiny_models = import_module(f"{__name__}.tiny_models")   # not `from . import`: it asks this again
            return tiny_models if name == "tiny_models" else getattr(tiny_models, name)
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
