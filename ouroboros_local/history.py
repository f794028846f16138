"""History reuse: what an engine keeps across requests (the phrase pool, the suffix trie, each method's
own learned state) and the files it persists to.

``ouroboros`` always reads the engine's phrase pool; with a pool file (``--pool FILE``) prompt-lookup,
lookahead and auto read it too, so a file written by one method warms the others. Without one,
lookahead keeps a pool of its own per window shape (the shapes used last: ``kept``) and prompt-lookup
none. Files are chosen when the engine (or server) starts, or by a request's ``pool`` option, registered
here with ``persist``, and saved by the engine after each generation (``Engine.stream``), never by a
proposer.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Hashable, Iterator, Protocol, TypeVar

from .errors import PoolError, clipped
from .filestore import DamagedStateError, ForeignStateError, is_empty_file, locked, set_aside, temp_name_bytes
from .pool import PhrasePool

if TYPE_CHECKING:  # pragma: no cover
    from .llama import Model
    from .suffix_trie import SuffixCache

log = logging.getLogger("ouroboros_local")

T = TypeVar("T")


class Persistable(Protocol):
    def save(self, path: str, fingerprint: str) -> None: ...

    def save_merged(self, path: str, fingerprint: str, n_vocab: int | None) -> None: ...


MAX_METHOD_STATES = 8   # settings whose own state (``History.kept``) stays in memory
MAX_CONTEXT_INDEXES = 4   # the last calls' indexes of their own text (``History.context_index``)


class History:
    """An engine's cross-request state. One per engine; the benchmark gives each contender its own."""

    def __init__(self, target: "Model | None" = None,
                 guard: "Callable[[], ContextManager[None]]" = nullcontext):
        self.target = target
        self._guard = guard   # the engine's: ``clear`` from another thread waits for a generation
        self._forget()

    def clear(self) -> None:
        """Forget everything learned (files named so far are no longer written), once the answers whose
        save was not yet due (``pending``) are in their files: they were promised to them. Called from
        another thread while the engine generates, it waits for the generation (it raised "dictionary
        keys changed during iteration", having cleared nothing)."""
        with self._guard():
            self._forget()

    def save_pending(self, note: str) -> None:
        """Write what the files are owed (``pending``); a failure is a warning that ends with ``note``."""
        if getattr(self, "pending", False):   # (not yet set while __init__ forgets)
            try:
                self.save()
            except PoolError as exc:
                log.warning("warning: %s (%s)", exc, note)

    def _forget(self) -> None:
        self.save_pending("the history is cleared all the same")
        self.phrase_pool: PhrasePool | None = None      # shared by every pool method
        self.phrase_pool_file: str | None = None
        self.suffix_cache: "SuffixCache | None" = None  # the suffix tries of earlier answers
        self.suffix_file: str | None = None
        # the file the latest ``pool`` option named (and that took its store): a store no call named a
        # file for is saved beside it (the phrase pool there, the suffix trie in FILE.suffix)
        self.named_file: str | None = None
        self._refused: set[tuple[str, str]] = set()   # (store, named file): not asked again
        self._method_state: dict[Hashable, Any] = {}    # keyed by method and settings (see ``kept``)
        self._context_indexes: dict[Hashable, Any] = {}  # keyed by kind and settings (``context_index``)
        self._files: dict[str, Persistable] = {}
        self._stamps: dict[str, tuple[int, ...] | None] = {}   # each file as this engine last read or wrote it
        self._shared: set[str] = set()   # files another process writes too: merged at every save from then on
        self._foreign: set[str] = set()  # files another tokenizer's process took over: said once, tried again
        self._saved_at = self._save_seconds = 0.0   # when the files were last written, and how long it took
        self.pending = False                         # a save was skipped as not yet due (``save``)
        self._fingerprint: str | None = None

    @contextmanager
    def unchanged_on_error(self) -> Iterator[None]:
        """Undo what the block bound or named if it raises: a method that opens both stores (auto) or
        checks its options after opening one must not leave a file named by a request that failed."""
        saved = (self.phrase_pool, self.phrase_pool_file, self.suffix_cache, self.suffix_file, self.named_file,
                 dict(self._files), dict(self._stamps), set(self._refused))
        try:
            yield
        except BaseException:
            (self.phrase_pool, self.phrase_pool_file, self.suffix_cache, self.suffix_file, self.named_file,
             self._files, self._stamps, self._refused) = saved
            raise

    def kept(self, key: Hashable, make: Callable[[], T]) -> T:
        """A method's own state for ``key`` (its name and settings), made on first use, then kept:
        lookahead's private pools, the cross-vocabulary draft pool, PEARL's timing table. The
        MAX_METHOD_STATES used last are kept: a server's requests may name hundreds of settings, each
        pool up to ~100 MB."""
        return _used_last(self._method_state, key, make, MAX_METHOD_STATES)

    def context_index(self, key: Hashable, make: Callable[[], T]) -> T:
        """An index of a call's own text (prompt lookup's n-grams, the suffix trie of a request) for ``key``
        (its kind and settings), kept for the next call, which continues it where it continues that text:
        a chat's next turn (rebuilding it took 0.1-0.2 s a turn at 6,000 tokens). The
        MAX_CONTEXT_INDEXES used last are kept, each as large as a context."""
        return _used_last(self._context_indexes, key, make, MAX_CONTEXT_INDEXES)

    def persist(self, path: str, state: Persistable) -> None:
        """Save ``state`` to ``path`` after each generation from now on (the latest state for a path wins).
        A folder that cannot take the file is refused now, not after the first answer (whose chat turn
        would be lost with the save's error)."""
        if path not in self._files:
            check_history_folder(path)
            self._stamps.setdefault(path, _stamp(path))
        self._files[path] = state

    def fingerprint(self) -> str:
        """The target tokenizer's fingerprint (computed once)."""
        if self._fingerprint is None:
            self._fingerprint = _fingerprint(self.target)
        return self._fingerprint

    def reload(self, current: T | None, current_file: str | None, path: str | None,
               load: Callable[[str, str, int | None], T]) -> T | None:
        """``current``, or the state saved at ``path`` when that file is named for the first time and
        holds something (``load(path, fingerprint, n_vocab)`` refuses another tokenizer's file, and token
        ids outside the target's vocabulary). An empty file, made by ``touch``, starts afresh; so does a
        damaged one (cut short by a crash, bytes changed), moved to FILE.bad with a warning."""
        if path is None or path == current_file:
            return current
        if os.path.exists(path) and not is_empty_file(path):
            self._stamps[path] = _stamp(path)
            try:
                return load(path, self.fingerprint(), self._n_vocab())
            except ForeignStateError as exc:   # another model's (or version's): kept as it is
                raise _for_this_model(exc) from None
            except DamagedStateError as exc:   # refused at every start: nothing in it could be read back
                set_aside(path, "history file", exc)
                self._stamps[path] = None
        # a new file starts afresh where the state is another file's (one history per project); state
        # that no file holds yet is what this engine learned so far: the new file keeps it
        return current if current_file is None else None

    def check_pool_file(self, path: str) -> None:
        """PoolError where the history file ``path`` holds something other than this tokenizer's phrase
        pool. A method that keeps only FILE.suffix names FILE too: it took any file there, which every
        method with a phrase pool then refused (on a server, as the client's error). A damaged pool passes:
        the phrase pool sets it aside when it opens it."""
        if path == self.phrase_pool_file or not os.path.exists(path) or is_empty_file(path):
            return
        try:
            PhrasePool.check_file(path, self.fingerprint())
        except DamagedStateError:
            pass
        except ForeignStateError as exc:
            raise _for_this_model(exc) from None

    def move(self, old: str | None, new: str | None) -> None:
        """A store's file changes from ``old`` to ``new``: ``old`` is written (if an answer is not yet in
        it) and no longer saved to. It was rewritten with the new file's history at every save."""
        if old is None or old == new or old not in self._files:
            return
        state = self._files.pop(old)
        if self.pending:
            try:
                self._save_file(old, state)
            except PoolError as exc:
                log.warning("warning: %s", exc)
        self._stamps.pop(old, None)
        self._shared.discard(old)
        self._foreign.discard(old)

    def _n_vocab(self) -> int | None:
        return self.target.n_vocab if self.target is not None else None

    def pool(self, phrase_len: int, max_per_key: int, path: str | None) -> PhrasePool:
        """The history phrase pool: reused across requests; loaded from ``path`` when that file exists.

        One pool serves every method and request: it only grows to the longest phrases and the most
        phrases per key any of them asked for (re-shaped into a new one then, the history kept), and each
        reads its own with ``PhrasePool.lookup(max_len=...)``. Shrinking it to one request's settings
        would throw away what the others learned, and re-shape up to ``max_tokens`` tokens per request
        where methods alternate. Naming ``path`` makes the engine save the pool there after each generation.
        """
        return self.open_store("phrase pool", resolve_pool_path(path), self.phrase_pool_file,
                               lambda file: self._pool(phrase_len, max_per_key, file))

    def _pool(self, phrase_len: int, max_per_key: int, path: str | None) -> PhrasePool:
        pool = self.reload(self.phrase_pool, self.phrase_pool_file, path,
                           lambda p, fingerprint, n_vocab: PhrasePool.load(p, fingerprint, n_vocab=n_vocab))
        if pool is not None and (pool.phrase_len < phrase_len or pool.max_per_key < max_per_key
                                 or pool.key_len != 1):
            pool = PhrasePool.combined((pool,), key_len=1, max_per_key=max(max_per_key, pool.max_per_key),
                                       phrase_len=max(phrase_len, pool.phrase_len), max_tokens=pool.max_tokens)
        if pool is None:
            pool = PhrasePool(key_len=1, max_per_key=max_per_key, phrase_len=phrase_len)
        file = path if path is not None else self.phrase_pool_file
        if file is not None:
            self.persist(file, pool)   # (a re-shaped pool replaces the one saved there) raises before any change
        self.move(self.phrase_pool_file, file)
        self.phrase_pool, self.phrase_pool_file = pool, file
        return pool

    def open_store(self, store: str, path: str | None, belongs_to: str | None,
                   use: Callable[[str | None], T]) -> T:
        """``use(path)``, the opening of ``store`` with the file a ``pool`` option named (None: none), which
        is from then on the named file. Without one, a store that belongs to no file yet, or to a file
        named before the latest (``belongs_to``: the named file its own derives from), takes the named file
        (saved beside it; it kept writing to the earlier file's); where that file does not take it
        (another tokenizer's, a folder it cannot write), the store stays in memory, with one warning.
        ``use`` raises before it changes anything."""
        if path is not None:
            if path != self.named_file:   # when named: a folder made read-only later is a failed save's warning
                check_history_folder(path)   # the named file and its FILE.suffix sibling, whichever store opens
            out = use(path)
            self.named_file = path
            return out
        if belongs_to == self.named_file or self.named_file is None or (store, self.named_file) in self._refused:
            return use(None)
        try:
            return use(self.named_file)
        except PoolError as exc:
            self._refused.add((store, self.named_file))
            log.warning("the %s is kept in memory, not beside the history file %s: %s", store, self.named_file, exc)
            return use(None)

    def save(self, if_due: bool = False) -> None:
        """Write every persisted state to its file (each ``save`` writes atomically). Where another
        process (a second chat on the same --pool) wrote the file since this engine last read or wrote
        it, what that one saved is kept too (``save_merged``), where each used to overwrite the other's.

        ``if_due``: not sooner after the last save than 20 times what that took, so saves take at most
        a twentieth of the time (a pool of a million tokens takes half a second to write, which every
        answer of a long-lived server paid); ``pending`` says a save was skipped (the engine's close
        writes it)."""
        if not self._files:
            return
        if if_due and time.monotonic() - self._saved_at < 20 * self._save_seconds:
            self.pending = True
            return
        started = time.monotonic()
        self.pending = True   # until written: a save that fails is tried again at close
        try:
            self._save_files()
            self.pending = False
        finally:   # a failed save is timed too: a file that keeps refusing must not make every save due
            self._saved_at = time.monotonic()
            self._save_seconds = self._saved_at - started

    def _save_files(self) -> None:
        """Save every file, then raise the failures as one PoolError: a file that refuses the save
        (another tokenizer's, a full disk) must not keep the others from being written."""
        failures = []
        for path, state in self._files.items():
            try:
                self._save_file(path, state)
                self._foreign.discard(path)
            except ForeignStateError as exc:
                if path not in self._foreign:   # said once: it stays the other's until someone moves it
                    self._foreign.add(path)
                    failures.append(str(exc))
            except PoolError as exc:
                failures.append(str(exc))
        if failures:
            raise PoolError("; ".join(failures))

    def _save_file(self, path: str, state: Persistable) -> None:
        fingerprint = self.fingerprint()   # (hashing the vocabulary, where needed, outside the lock)
        with locked(path, "history"):   # another process's save, between our look and our write, would be lost
            found = _stamp(path)
            if found is not None and found != self._stamps.get(path):
                self._shared.add(path)   # the file now holds the other's too: a plain save would drop it
            if path in self._shared:
                state.save_merged(path, fingerprint, self._n_vocab())
            else:
                state.save(path, fingerprint)
            self._stamps[path] = _stamp(path)


def _fingerprint(model: "Model | None") -> str:
    try:
        from .gguf_file import tokenizer_fingerprint as from_gguf

        return from_gguf(model.path)  # type: ignore[union-attr]
    except Exception:  # noqa: BLE001 - no metadata reader: hash the token texts instead
        h = hashlib.sha256(b"ouroboros-token-texts\0")
        if model is not None:
            for t in range(model.n_vocab):
                h.update(model.token_text(t).encode("utf-8", "surrogatepass") + b"\0")
        return h.hexdigest()


def _stamp(path: str) -> tuple[int, ...] | None:
    """What tells one write of a file from another (each save is a new file: os.replace); None: none."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def _for_this_model(exc: ForeignStateError) -> ForeignStateError:
    """Another model's (or version's) history file refused, with what to do about it."""
    return ForeignStateError(f"{exc}; name another history file (--pool; the pool option) for this model")


def _used_last(store: dict[Hashable, Any], key: Hashable, make: Callable[[], T], keep: int) -> T:
    """``store[key]``, made on first use, as the most recently used of the ``keep`` kept."""
    state = store.pop(key, None)
    if state is None:
        state = make()
    store[key] = state   # the newest last: the first is the least recently used
    while len(store) > keep:
        del store[next(iter(store))]
    return state


def check_history_folder(path: str | os.PathLike[str]) -> None:
    """PoolError unless the folder of ``path`` can take the file (and its ``.suffix`` sibling), and
    neither names something other than a file (a folder as FILE gave ``suffix`` a FILE.suffix beside it)."""
    file = Path(_resolved(path))
    try:
        if not file.parent.is_dir() or not os.access(file.parent, os.W_OK | os.X_OK):
            raise PoolError(f"cannot save history to {path}: {file.parent} is not a writable folder")
        for name in (file, file.with_name(file.name + ".suffix")):
            if name.exists() and not name.is_file():
                raise PoolError(f"cannot save history to {path}: {name} is not a file")
    except OSError as exc:   # a name longer than the system takes: a raw OS error, and status 1
        raise PoolError(f"cannot save history to {clipped(str(path))}: {exc.strerror or exc}") from None
    over = temp_name_bytes(file.name + ".suffix") - _name_max(file.parent)
    if over > 0:   # FILE took, FILE.suffix's save failed after every answer
        raise PoolError(f"cannot save history to {path}: its name is too long for the files saved beside it "
                        f"(FILE.suffix and their temporary copies); shorten it by {over}")


def _name_max(folder: Path) -> int:
    try:
        return os.pathconf(folder, "PC_NAME_MAX")
    except (AttributeError, OSError, ValueError):   # no pathconf (Windows): its usual limit
        return 255


def resolve_pool_path(path: str | os.PathLike[str] | None) -> str | None:
    return None if path is None else _resolved(path)


def _resolved(path: str | os.PathLike[str]) -> str:
    try:
        return str(Path(path).expanduser().resolve())
    except (OSError, RuntimeError) as exc:   # RuntimeError: a symbolic link loop
        raise PoolError(f"cannot use {path} as a history file: {exc}") from None


__all__ = ["History", "Persistable", "check_history_folder", "resolve_pool_path"]
