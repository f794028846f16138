"""History reuse: what an engine keeps across requests (the phrase pool, the suffix trie) and the files
it persists to.

Every method with a pool (prompt-lookup, lookahead, ouroboros, auto) reads the same phrase pool, so a
pool file written by one method warms the others. Files are chosen when the engine (or server) starts,
registered here with ``persist``, and saved by the engine after each generation (``Engine.stream``),
never by a proposer.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from .pool import PhrasePool

if TYPE_CHECKING:  # pragma: no cover
    from .engine import Engine

SHARED_POOL = "ouroboros_pool"
SHARED_POOL_FILE = "ouroboros_pool_file"
PERSISTED = "history_files"     # engine.shared[PERSISTED]: {path: object with .save(path, fingerprint)}


class Persistable(Protocol):
    def save(self, path: str, fingerprint: str) -> None: ...


def persist(engine: "Engine", path: str, state: Persistable) -> None:
    """Save ``state`` to ``path`` after each generation from now on (the latest state for a path wins)."""
    engine.shared.setdefault(PERSISTED, {})[path] = state


def tokenizer_fingerprint(engine: "Engine") -> str:
    """The target tokenizer's fingerprint (cached per engine)."""
    fp = engine.shared.get("tokenizer_fingerprint")
    if fp is None:
        try:
            from .models import tokenizer_fingerprint as from_gguf

            fp = from_gguf(engine.target.path)
        except Exception:  # noqa: BLE001 - no metadata reader: hash the token texts instead
            h = hashlib.sha256(b"ouroboros-token-texts\0")
            model = engine.target
            for t in range(model.n_vocab):
                h.update(model.token_text(t).encode("utf-8", "surrogatepass") + b"\0")
            fp = h.hexdigest()
        engine.shared["tokenizer_fingerprint"] = fp
    return fp


def resolve_pool_path(path: str | os.PathLike[str] | None) -> str | None:
    return None if path is None else str(Path(path).expanduser().resolve())


def shared_pool(engine: "Engine", phrase_len: int, max_per_key: int, path: str | None) -> PhrasePool:
    """The engine's history pool: reused across requests; loaded from ``path`` when that file exists.

    A pool of another geometry (phrase length, phrases per key) is re-shaped into a new one, so the
    history is kept and the settings of this request hold. Naming ``path`` makes the engine save the
    pool there after each generation.
    """
    path = resolve_pool_path(path)
    pool = engine.shared.get(SHARED_POOL)
    current = engine.shared.get(SHARED_POOL_FILE)
    if path is not None and path != current and os.path.exists(path):
        pool = PhrasePool.load(path, tokenizer_fingerprint(engine))   # PoolError for another tokenizer
    if pool is not None and (pool.phrase_len != phrase_len or pool.max_per_key != max_per_key
                             or pool.key_len != 1):
        fresh = PhrasePool(key_len=1, max_per_key=max_per_key, phrase_len=phrase_len,
                           max_tokens=pool.max_tokens)
        for key, phrases in pool.items():
            for phrase in phrases:
                fresh.add(key, phrase)
        pool = fresh
    if pool is None:
        pool = PhrasePool(key_len=1, max_per_key=max_per_key, phrase_len=phrase_len)
    engine.shared[SHARED_POOL] = pool
    if path is not None:
        engine.shared[SHARED_POOL_FILE] = path
    current = engine.shared.get(SHARED_POOL_FILE)
    if current is not None:
        persist(engine, current, pool)   # a re-shaped pool replaces the one saved there
    return pool


def save_history(engine: "Engine") -> None:
    """Write every persisted state to its file (each ``save`` writes atomically)."""
    files = engine.shared.get(PERSISTED)
    if files:
        fingerprint = tokenizer_fingerprint(engine)
        for path, state in files.items():
            state.save(path, fingerprint)


__all__ = ["SHARED_POOL", "SHARED_POOL_FILE", "persist", "resolve_pool_path", "save_history", "shared_pool",
           "tokenizer_fingerprint"]
