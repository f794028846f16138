"""Test helpers: tiny generated GGUF models (no downloads)."""

from .tiny_models import (
    CHATML_TEMPLATE,
    ENDOFTEXT,
    IM_END,
    IM_START,
    TinyVocab,
    corrupt_copies,
    tiny_vocab,
    write_tiny_model,
)

__all__ = [
    "CHATML_TEMPLATE",
    "ENDOFTEXT",
    "IM_END",
    "IM_START",
    "TinyVocab",
    "corrupt_copies",
    "tiny_vocab",
    "write_tiny_model",
]
