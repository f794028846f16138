"""Files that hold learned state (phrase pools, suffix tries): written atomically, refused when another
tokenizer wrote them. One place for both formats; each keeps its own header and payload. The JSON state
files (cost curves, learned estimates) are written the same way and read with ``read_json_object``."""

from __future__ import annotations

import codecs
import contextlib
import errno
import glob
import json
import logging
import math
import os
import stat
import struct
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, TypeVar

from filelock import FileLock, Timeout

from .errors import PoolError

if TYPE_CHECKING:  # pragma: no cover
    import numpy as np

log = logging.getLogger("ouroboros_local")

T = TypeVar("T")

STALE_TEMP_SECONDS = 3600.0   # a temp file untouched this long was left by a save killed mid-write
LOCK_WAIT_SECONDS = 60.0      # longer than any save takes (a pool of a million tokens: half a second)
MAX_JSON_STATE_BYTES = 16 * 2**20   # a cost-curve or estimates file is kilobytes; a larger one is another file
_warned_unsaved: set[str] = set()   # files whose failed save was already warned about in this process
_warned_frozen: set[str] = set()    # read-only files whose skipped saves were already warned about
# FILE.SUFFIX is saved beside FILE, with FILE's permissions (the suffix trie beside a history file)
COMPANION_SUFFIXES = (".suffix",)


class DamagedStateError(PoolError):
    """A state file of ours that cannot be read back (cut short by a crash or a full disk, bytes changed):
    set aside (``set_aside``) rather than refused at every start."""


class ForeignStateError(PoolError):
    """A readable state file that is not this model's: another tokenizer's, or another format version's.
    Never merged into, nor replaced (its owner would lose it)."""


class NotSavedError(PoolError):
    """A save that failed: "cannot save the WHAT to PATH: REASON"; ``reason`` alone for a warning that
    names the file itself (``warn_not_saved``)."""

    def __init__(self, what: str, target: object, reason: str):
        super().__init__(f"cannot save the {what} to {target}: {reason}")
        self.reason = reason


_TEMP_SUFFIX = ".tmp"


def temp_name_bytes(name: str) -> int:
    """The length in bytes of the temporary copy's name ``write_atomic`` writes a file ``name`` through
    (".NAME.XXXXXXXX.tmp": mkstemp's 8 random characters)."""
    return len(os.fsencode(f".{name}.")) + 8 + len(_TEMP_SUFFIX)


def write_atomic(path: str | os.PathLike[str], data: bytes, what: str) -> None:
    """Write ``data`` to ``path`` through a temp file and os.replace: a crash or error mid-save leaves
    any previous file intact. ``what`` names the content in the one-line error. A symbolic link is
    followed: the file it points to is replaced, the link kept."""
    target = Path(os.path.realpath(path))
    if _frozen(target):
        _warn_frozen(target, what)
        return
    directory = target.parent
    _remove_stale_temps(directory, target.name)
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=_TEMP_SUFFIX, dir=directory)
        mode = _shared_mode(target)
        if mode is not None:   # keep its permissions (mkstemp's 0600 made a group's shared pool unreadable)
            os.chmod(tmp, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
        tmp = None
    except OSError as e:
        raise NotSavedError(what, target, str(e)) from e
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
    _fsync_dir(directory)


def replace_text(path: Path, text: str, tmp: Path) -> None:
    """``path`` holds ``text`` whole or is left as it was: written to ``tmp`` beside it, then renamed over
    it; ``tmp`` is removed where that fails (a full disk left an empty one at every try). Raises the OSError.
    The plain writer for files of no lock or shared mode (a model's sha256 record, a bench's results)."""
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):   # the write's own error is the one to report
            tmp.unlink(missing_ok=True)
        raise


@contextmanager
def locked(path: str | os.PathLike[str], what: str) -> Iterator[None]:
    """Hold the lock of ``path`` (the hidden ``.NAME.lock`` beside the file it names) while the block reads,
    merges and writes it. Two processes saving into one file (two chats on one --pool, two engines'
    cost curves) each read it before either replaced it, and the later write dropped what the earlier
    added. The lock is the operating system's (it goes with a process that dies); a wait past
    LOCK_WAIT_SECONDS raises PoolError."""
    target = Path(os.path.realpath(path))
    if _frozen(target):   # never written (``write_atomic``): nothing to lock, and no lock file made beside it
        yield
        return
    # whoever may write the file may take its lock (a group's shared pool); the owner always
    mode = (_shared_mode(target) or 0) | 0o600
    lock = FileLock(target.with_name(f".{target.name}.lock"), timeout=LOCK_WAIT_SECONDS, mode=mode)
    _match_lock_mode(lock.lock_file, mode)
    try:
        try:
            lock.acquire(timeout=0)
        except Timeout:
            _check_lock_file(lock.lock_file, mode, what, target)
            lock.acquire()
    except Timeout:
        raise NotSavedError(what, target, f"another process held its lock {lock.lock_file} for "
                                          f"{LOCK_WAIT_SECONDS:.0f} s") from None
    except OSError as e:   # a folder or another user's file where the lock goes: the lock is named, not FILE
        raise NotSavedError(what, target, f"cannot use its lock file {lock.lock_file} ({e.strerror or e})") from None
    try:
        yield
    finally:
        lock.release()


def _check_lock_file(lock_file: str, mode: int, what: str, target: Path) -> None:
    """A lock not taken at once is held by another process, or its file cannot be made at all (filelock
    then retries in silence until its timeout: a minute's wait on each save, then "another process held
    it"): the second is a PoolError now, with the system's reason."""
    if os.path.lexists(lock_file):
        return
    try:
        os.close(os.open(lock_file, os.O_RDWR | os.O_CREAT, mode))
    except OSError as e:
        raise NotSavedError(what, target, f"cannot make its lock file {lock_file} ({e.strerror or e})") from None


def _match_lock_mode(lock_file: str, mode: int) -> None:
    """Give a lock file its file's permissions now (it keeps those of its creation: a pool shared with a
    group after its first save kept a lock only its owner could open). Only its owner (or root) can."""
    try:
        st = os.lstat(lock_file)
        if stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) != mode and st.st_uid == _euid():
            os.chmod(lock_file, mode)
    except OSError:
        pass


def _euid() -> int:
    return os.geteuid() if hasattr(os, "geteuid") else -1   # -1: no such thing (Windows)


def _shared_mode(target: Path) -> int | None:
    """The permissions a save gives ``target``: its own where it is a file; a new companion file (FILE.suffix)
    takes FILE's, as its lock does (a pool made group-writable had a suffix history only its creator could
    read). None: mkstemp's 0600."""
    owner = next((target.with_name(target.name[:-len(s)]) for s in COMPANION_SUFFIXES
                  if target.name.endswith(s) and len(target.name) > len(s)), None)
    for candidate in (target, owner):
        try:
            if candidate is not None and candidate.is_file():
                # a companion may be written by its owner whatever FILE's mode: FILE made read-only made
                # its new FILE.suffix read-only too, and every later save of it was skipped
                return stat.S_IMODE(candidate.stat().st_mode) | (0o200 if candidate is owner else 0)
        except OSError:
            pass
    return None


def _frozen(target: Path) -> bool:
    """Was the existing file ``target`` made read-only (chmod 444, or not writable by this user)? Its state
    is used, never saved: a save replaces the file through its folder, and undid the freeze in silence.
    Root may write any file: for it, a file without any write bit counts as made read-only."""
    try:
        if not target.is_file():
            return False
        return not stat.S_IMODE(target.stat().st_mode) & 0o222 or not os.access(target, os.W_OK)
    except OSError:
        return False


def _warn_frozen(target: Path, what: str) -> None:
    """One warning per process and file that a read-only file is used but not saved."""
    key = os.fspath(target)
    if key in _warned_frozen:
        return
    _warned_frozen.add(key)
    log.warning("warning: %s is read-only: what it holds is used, and the %s is not saved to it (make it "
                "writable to save there again)", key, what)


def _remove_stale_temps(directory: Path, name: str) -> None:
    """Remove the temp files of ``name`` that a save killed mid-write left (``.NAME.XXXXXXXX.tmp``, as
    ``mkstemp`` names them; a pool's is megabytes). Only old ones: a younger one may be another process's
    save in progress."""
    prefix = f".{name}."
    now = time.time()
    for leftover in directory.glob(glob.escape(prefix) + "*.tmp"):
        if "." in leftover.name[len(prefix):-len(".tmp")]:   # another file's: .NAME.suffix.XXXX.tmp
            continue
        try:
            if now - leftover.stat().st_mtime > STALE_TEMP_SECONDS:
                leftover.unlink()
        except OSError:
            pass


def warn_not_saved(path: str | os.PathLike[str], what: str, env_var: str, cost: str, exc: Exception) -> None:
    """One warning per process and file that the ``what`` could not be saved (every later failure of the
    same file is silent): what that ``cost``s, and the settings that move the file."""
    key = os.fspath(path)
    if key in _warned_unsaved:
        return
    _warned_unsaved.add(key)
    cause = exc.__cause__ if isinstance(exc.__cause__, OSError) else exc   # write_atomic's wraps the OSError
    if isinstance(exc, NotSavedError) and not isinstance(exc.__cause__, OSError):
        reason = exc.reason   # the file is named once, by this warning
    else:
        reason = cause.strerror if isinstance(cause, OSError) and cause.strerror else str(cause)
    log.warning("warning: cannot save the %s to %s (%s); %s. %s", what, key, reason, cost, save_advice(env_var))


def save_advice(env_var: str) -> str:
    """The settings that move a state file that cannot be saved where it is."""
    if os.environ.get(env_var):   # the variable named this file: only it moves the file
        return f"Set {env_var} to a writable file"
    return f"Set OUROBOROS_CACHE to a writable folder, or {env_var} to a writable file"


def save_obstacle(path: str | os.PathLike[str]) -> str | None:
    """Why a save to ``path`` would fail now, found without writing anything (``doctor``); None where none
    is seen: the file, if there, is a regular file this user may read and write, and its folder (or the
    nearest part of it that exists, made at the save) is a writable folder on a disk that is not full."""
    target = Path(os.path.abspath(path))
    if os.path.lexists(target):
        if not target.is_file():
            return f"{target} is not a regular file"
        if _frozen(Path(os.path.realpath(target))):
            return f"{target} is read-only"
        try:
            open(target, "rb").close()
        except OSError as e:
            return f"{target} cannot be read ({e.strerror or e})"
        target = Path(os.path.realpath(target))   # a link: saved where it points
    folder = next((p for p in target.parents if os.path.lexists(p)), Path(target.anchor))
    if not folder.is_dir():
        return f"{folder} is not a folder"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"the folder {folder} is not writable"
    try:
        disk = os.statvfs(folder)
    except (OSError, AttributeError):   # no statvfs (Windows): not known
        return None
    free = disk.f_bfree if _euid() == 0 else disk.f_bavail   # root may use the blocks kept for it
    return f"the disk of {folder} is full" if free == 0 else None


def read_json_object(path: str | os.PathLike[str], what: str | None = None) -> dict[str, Any]:
    """A JSON state file's object; {} when it is missing, unreadable, not JSON or not an object (a file
    edited by hand is measured or learned again, never fatal). ``what``: the file's content, named in one
    warning per process where the file exists but cannot be read (its save is then refused, not warned)."""
    target = Path(path)
    try:
        return _json_object(target) or {}
    except OSError as e:
        key = os.fspath(path)
        if what is not None and key not in _warned_unsaved:
            _warned_unsaved.add(key)   # the save's own warning would say only "not saved"
            log.warning("warning: cannot read the %s file %s (%s): what it holds is not used, and nothing is "
                        "saved there; make it readable, or name another file", what, key, e.strerror or e)
        return {}


def _json_object(target: Path) -> dict[str, Any] | None:
    """The file's JSON object; {} where there is none (missing, empty); None where the file holds something
    else (not JSON, JSON but not an object, or over MAX_JSON_STATE_BYTES). OSError where it cannot be read.
    A leading byte-order mark (Notepad's, PowerShell's) is dropped."""
    if not target.is_file():   # missing, or a FIFO that would block the read forever
        return {}
    if target.stat().st_size > MAX_JSON_STATE_BYTES:   # not read into memory (a model named by mistake)
        return None
    text = target.read_text(encoding="utf-8-sig", errors="replace")
    if not text.strip():
        return {}
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):   # RecursionError: nested thousands of levels deep
        return None
    return data if isinstance(data, dict) else None


def _json_at_start(target: Path) -> bool:
    """Does a file that is no JSON object start like JSON, a state file of ours damaged or edited by hand?"""
    try:
        if target.stat().st_size > MAX_JSON_STATE_BYTES:
            return False
        with open(target, "rb") as f:
            start = f.read(4096)
        return start.removeprefix(codecs.BOM_UTF8).lstrip().startswith((b"{", b"["))
    except OSError:
        return False


def file_identity(path: str | os.PathLike[str]) -> list[Any]:
    """What a file's learned state belongs to: its resolved path, size and modification time (a file
    re-downloaded or edited starts afresh). Taken when a model loads: the file may go while it runs."""
    target = Path(path)
    st = target.stat()
    return [str(target.resolve()), st.st_size, st.st_mtime_ns]


def keep_newest(data: dict[str, Any], keep: int, stamp_key: str, fresh: str | None = None) -> None:
    """Drop from ``data`` all but the ``keep`` entries with the latest ``stamp_key`` (a time.time()); an
    entry without a numeric stamp counts as the oldest, and ``fresh`` (the one just written) as the
    newest: entries stamped by a clock ahead of this one evicted it as soon as it was written. Keeps a
    state file bounded however many models, devices and settings are tried."""
    def stamp(key: str) -> float:
        if key == fresh:
            return math.inf
        entry = data[key]
        return finite_number(entry.get(stamp_key) if isinstance(entry, dict) else None, 0.0)

    for old in sorted(data, key=stamp)[:max(0, len(data) - keep)]:
        del data[old]


def finite_number(value: Any, default: float) -> float:
    """``value`` as a float where it is a finite JSON number, else ``default``: a file edited by hand may
    hold NaN, or an integer no float holds (1 and 400 zeros: OverflowError at every start)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return default
    try:
        number = float(value)
    except OverflowError:
        return default
    return number if math.isfinite(number) else default


def link_loop(path: str | os.PathLike[str]) -> str | None:
    """The line "PART is a symbolic link loop" where ``path``, or a folder on its way, is a link that leads
    back to itself (the system's ELOOP), else None. Path.exists says False for one, as for a missing file: a loop was
    reported as "not found" or "does not exist"."""
    path = Path(path)
    for part in (*reversed(path.parents), path):
        try:
            os.stat(part)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                return f"{part} is a symbolic link loop"
        except ValueError:   # a NUL in the name: no such file
            return None
    return None


def make_folder(folder: Path) -> None:
    """``folder`` and its parents; PoolError naming the part that is a file (mkdir says only "File
    exists", of the folder asked for)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        loop = link_loop(folder)
        if loop:   # said "does not exist" of the link's target, which does
            raise PoolError(f"{loop}: make it point to a folder") from None
        if not isinstance(exc, (FileExistsError, NotADirectoryError)):
            raise
        for part in (folder, *folder.parents):
            if part.is_symlink() and not part.exists():   # it was called "a file"
                raise PoolError(f"{part} is a link to {os.readlink(part)}, which does not exist") from None
        part = next((p for p in (folder, *folder.parents) if p.exists() and not p.is_dir()), folder)
        raise PoolError(f"{part} is a file, not a folder") from None


def put_json_entry(path: Path, key: str, entry: Any, *, keep: int, stamp_key: str, what: str,
                   indent: int | None = None) -> None:
    """Set ``key`` of the JSON state file ``path`` to ``entry`` and keep its ``keep`` newest entries
    (``keep_newest``), under the file's lock: an entry another process saved meanwhile is kept.
    OSError or PoolError when the file cannot be written."""
    if os.path.exists(path) and not os.path.isfile(path):   # /dev/null, a FIFO: replaced by a file, once
        raise PoolError(f"{path} is not a regular file: nothing is saved there")
    if _frozen(Path(os.path.realpath(path))):   # a failed save for its callers (calibrate's status), and
        raise NotSavedError(what, path, "it is read-only")   # a damaged one is not set aside either
    make_folder(path.parent)
    with locked(path, what):
        try:
            data = _json_object(path)
        except OSError as e:   # what it holds is unknown: written over, its other entries would be lost
            raise NotSavedError(what, path, f"it cannot be read ({e.strerror or e}), so it is not written "
                                            "over") from None
        if data is None and not _json_at_start(path):   # a model or notes named by mistake: left alone
            raise PoolError(f"{path} is not a {what} file: left as it is, and nothing saved there")
        if data is None:   # ours, edited by hand into a syntax error or cut short: kept aside, not written over
            set_aside(path, what, f"{path} is not a {what} file (not a JSON object)")
            data = {}
        data[key] = entry
        keep_newest(data, keep, stamp_key, fresh=key)
        write_atomic(path, json.dumps(data, indent=indent).encode(), what)


def read_checked(path: str | os.PathLike[str], magic: bytes, version: int, header: struct.Struct,
                 what: str) -> tuple[Path, tuple, bytes]:
    """Read a state file: (its path, its header fields after magic and version, the bytes after the
    header); PoolError in one line when it cannot be read, is another kind of file or another version."""
    target = Path(path)
    if target.exists() and not target.is_file():   # a FIFO would block the read forever
        raise PoolError(f"the {what} {target} is not a regular file")
    try:
        with open(target, "rb") as f:
            data = f.read(header.size)
            # a file of another kind (a model named by mistake: gigabytes) is refused before it is read
            if data[:len(magic)] != magic and not (0 < len(data) < len(magic) and magic.startswith(data)):
                raise PoolError(f"{target} is not a {what} file (bad header)")
            if len(data) < header.size:   # ours, cut short (inside its magic too)
                raise DamagedStateError(f"{target} is truncated (a {what} file cut short in its header)")
            data += f.read()
    except OSError as e:
        raise PoolError(f"cannot read the {what} {target}: {e}") from e
    _, found, *fields = header.unpack_from(data)
    if found != version:
        raise ForeignStateError(f"{target}: unsupported {what} version {found} (expected {version})")
    return target, tuple(fields), data[header.size:]


def check_fingerprint(target: Path, body: bytes, fp_len: int, fingerprint: str, what: str) -> bytes:
    """The payload after the stored tokenizer fingerprint, or PoolError when it is not ``fingerprint``."""
    if len(body) < fp_len:
        raise DamagedStateError(f"{target} is truncated (header says more data than the file holds)")
    try:
        stored = body[:fp_len].decode("utf-8")
    except UnicodeDecodeError as e:
        raise DamagedStateError(f"{target} is corrupt (unreadable tokenizer fingerprint)") from e
    if stored != fingerprint:
        raise ForeignStateError(f"{target} was built for another tokenizer ({what} fingerprint "
                                f"{_short(stored)}, model fingerprint {_short(fingerprint)})")
    return body[fp_len:]


def check_token_ids(target: Path, tokens: "np.ndarray", n_vocab: int | None) -> None:
    """PoolError when a saved token id lies outside the model's vocabulary (a crafted or foreign file whose
    fingerprint matches would otherwise fail every later generation inside llama_decode)."""
    if n_vocab is not None and tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) >= n_vocab):
        raise DamagedStateError(f"{target} is corrupt (token ids outside the vocabulary of {n_vocab})")


def mergeable(read: Callable[[], T], what: str, path: str | os.PathLike[str]) -> T | None:
    """What ``read`` reads of the file at ``path`` a save is about to merge with, or None where there is
    nothing to keep: no file any more, or a damaged one (moved to FILE.bad with a warning, as at load).
    PoolError, for a save to refuse, when it is another tokenizer's or another version's file, or no
    state file at all (notes written over it): replaced, its owner would lose it at every save."""
    if not os.path.lexists(path):
        return None
    try:
        return read()
    except ForeignStateError as exc:
        raise ForeignStateError(f"{exc}; not overwritten: name another {what} file for this model") from exc
    except DamagedStateError as exc:
        set_aside(path, what, exc)
        return None
    except PoolError as exc:
        raise PoolError(f"{exc}; not overwritten") from exc


def set_aside(path: str | os.PathLike[str], what: str, why: object) -> Path:
    """Move a state file that cannot be read back (``why``: the error or words saying so) to FILE.bad
    (one earlier .bad is replaced), with a warning; its path."""
    target = Path(path)
    aside = target.with_name(target.name + ".bad")
    try:
        os.replace(target, aside)
    except OSError as e:
        raise PoolError(f"{why}; and it cannot be moved aside to {aside}: {e}") from e
    log.warning("warning: %s; moved to %s, a new %s takes its place", why, aside, what)
    return aside


def is_empty_file(path: str | os.PathLike[str]) -> bool:
    """A regular file of no bytes (made by ``touch``): read as no saved state yet, written at the next save."""
    target = Path(path)
    return target.is_file() and target.stat().st_size == 0


def _short(fingerprint: str) -> str:
    return fingerprint[:12] + ("…" if len(fingerprint) > 12 else "")


def _fsync_dir(directory: Path) -> None:
    # Make the rename itself durable; not possible on every platform, and never fatal.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
