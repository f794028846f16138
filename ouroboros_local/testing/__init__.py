"""Test helpers: tiny generated GGUF models (no downloads)."""

from . import tiny_models
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

__all__ = tiny_models.__all__
