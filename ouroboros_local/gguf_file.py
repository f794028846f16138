"""Reading and validating GGUF files, without loading llama.cpp.

A small parser of our own (``gguf.GGUFReader`` takes seconds on a 150k-token vocabulary, this takes
a fraction of one), cached per file; ``validate_gguf`` summarises a model file and
``tokenizer_fingerprint`` identifies its tokenizer independently of the weights.
"""

from __future__ import annotations

import errno
import hashlib
import json
import mmap
import os
import re
import struct
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import ModelError
from .filestore import link_loop

__all__ = ["RECURRENT_ARCHS", "GGUFInfo", "read_metadata", "tokenizer_fingerprint", "validate_gguf"]

# Architectures whose memory cannot be partially rolled back (recurrent or hybrid), as named in
# llama.cpp's llm_arch_is_recurrent / llm_arch_is_hybrid. Best effort: llama.cpp decides at load.
RECURRENT_ARCHS = frozenset({
    "mamba", "mamba2", "rwkv6", "rwkv6qwen2", "rwkv7", "arwkv7",
    "jamba", "falcon-h1", "plamo2", "granitehybrid", "lfm2", "lfm2moe", "nemotron_h",
    "nemotron_h_moe", "qwen3next", "qwen35", "qwen35moe", "kimi-linear",
    "bailingmoe3", "kimi-k3", "glm5-next", "qwen4exp", "deepseek4", "minimax-01",   # llama-cpp-python 0.3.36's
})


def recurrent_refusal(name: str, what: str) -> ModelError:
    """The refusal of model file ``name``, which is ``what`` ("a mamba model, ..."): from its header before
    the weights load (the engine), or from llama.cpp once they have (the binding)."""
    return ModelError(f"{name} is {what}: speculative decoding needs to roll back rejected tokens, which "
                      "llama.cpp cannot do for recurrent state; use a transformer model")


@dataclass(frozen=True)
class GGUFInfo:
    """What validation learned about a GGUF file."""

    path: Path
    file_size: int   # bytes of the model: of all its parts, for a split model
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
    kv_bytes_per_token: int | None = None   # an F16 KV cache's bytes per context token (None: unknown)


@dataclass(frozen=True)
class _Parsed:
    version: int
    metadata: dict[str, Any]  # strings decoded, except token and merge lists (lists of bytes)
    n_tensors: int
    file_size: int


class _Corrupt(Exception):
    pass


class DamagedGGUFError(ModelError):
    """A GGUF file cut short or corrupt (a download's copy can be fetched again; its caller says how)."""


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


# What a Git LFS pointer file (a clone without `git lfs pull`) starts with.
_LFS_POINTER = b"version https://git-lfs"

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
        loop = link_loop(p) if e.errno == errno.ELOOP else None
        raise ModelError(f"{loop}: fix the link, or give the model file's own path" if loop else
                         f"cannot read {p}: {e.strerror or e}") from None
    if not p.is_file():
        raise ModelError(f"{p} is not a file")
    key = (str(p.resolve()), st.st_size, st.st_mtime_ns)
    with _PARSE_LOCK:
        hit = _PARSE_CACHE.get(key)
        if hit is not None:
            _PARSE_CACHE.move_to_end(key)
            return p, hit
    if st.st_size == 0:
        raise DamagedGGUFError(f"{p} is empty (0 bytes), not a GGUF file")
    try:
        with open(p, "rb") as f:
            head = f.read(len(_LFS_POINTER))
            magic = head[:4]
            if head == _LFS_POINTER:
                raise ModelError(f"{p} is a Git LFS pointer, not the model's bytes: fetch them (git lfs pull)")
            if magic != b"GGUF":
                if len(magic) < 4 and b"GGUF".startswith(magic):
                    raise DamagedGGUFError(f"{p} is truncated or corrupt (only {len(magic)} bytes)")
                raise ModelError(f"{p} is not a GGUF file (it starts with {magic!r}, not b'GGUF')")
            if st.st_size < 24:
                raise DamagedGGUFError(f"{p} is truncated or corrupt (only {st.st_size} bytes)")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                parsed = _parse_mapped(buf, st.st_size)
    except (_Corrupt, struct.error, OverflowError, MemoryError, ValueError) as e:
        raise DamagedGGUFError(f"{p} is truncated or corrupt ({e})") from None
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


_SPLIT_NAME_RE = re.compile(r"^(.*)-(\d{5})-of-(\d{5})\.gguf$")


def _other_parts_size(first: Path, meta: Mapping[str, Any]) -> int:
    """The bytes of a split model's other parts (0 for a whole file), which llama.cpp loads beside the first
    from their names (PREFIX-0000K-of-0000N.gguf); a later part or a missing one is refused here."""
    count, number = _int_or_none(meta.get("split.count")) or 1, _int_or_none(meta.get("split.no")) or 0
    if count <= 1:
        return 0
    m = _SPLIT_NAME_RE.match(first.name)
    prefix = m.group(1) if m else first.name.removesuffix(".gguf")
    if number > 0:
        raise ModelError(f"{first} is part {number + 1} of {count} of a split model: give its first part "
                         f"({prefix}-00001-of-{count:05d}.gguf)")
    if m is None or int(m.group(3)) != count:
        raise ModelError(f"{first} is the first of {count} parts of a split model, but is not named "
                         f"PREFIX-00001-of-{count:05d}.gguf, by which llama.cpp finds the others")
    total = 0
    for k in range(2, count + 1):
        part = first.with_name(f"{prefix}-{k:05d}-of-{count:05d}.gguf")
        try:
            total += part.stat().st_size
        except OSError:
            raise ModelError(f"{first} is the first of {count} parts of a split model; part {k} "
                             f"({part.name}) is not beside it") from None
    return total


def validate_gguf(path: str | os.PathLike[str]) -> GGUFInfo:
    """Check that `path` is a complete GGUF model file and summarise it; raise ModelError if not."""
    p, parsed = _parse(path)
    meta = parsed.metadata
    file_size = parsed.file_size + _other_parts_size(p, meta)
    arch = meta.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        raise ModelError(f"{p} has no general.architecture: not a GGUF model")
    if meta.get("general.type") == "adapter":   # llama.cpp would say only "failed to load model"
        raise ModelError(f"{p} is an adapter ({meta.get('adapter.type', 'LoRA')}), not a model: load the model "
                         "it was trained for")
    if parsed.n_tensors == 0 and file_size == parsed.file_size:   # a split model's first part may hold none
        raise ModelError(f"{p} holds no weights (a vocabulary-only GGUF): not a model to generate with")
    tokens = meta.get("tokenizer.ggml.tokens")
    n_vocab = len(tokens) if isinstance(tokens, list) else (_int_or_none(meta.get(f"{arch}.vocab_size")) or 0)
    template = meta.get("tokenizer.chat_template")
    return GGUFInfo(
        path=p,
        file_size=file_size,
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
        kv_bytes_per_token=_kv_bytes_per_token(meta, arch),
    )


def _kv_bytes_per_token(meta: Mapping[str, Any], arch: str) -> int | None:
    """Keys and values of every layer for one token in an F16 cache: what a context of n tokens takes
    besides the weights (n_layer x n_head_kv x (key_length + value_length) x 2 bytes)."""
    n_layer = _int_or_none(meta.get(f"{arch}.block_count"))
    n_embd = _int_or_none(meta.get(f"{arch}.embedding_length"))
    n_head = meta.get(f"{arch}.attention.head_count")
    n_head_kv = meta.get(f"{arch}.attention.head_count_kv", n_head)
    heads = n_head if isinstance(n_head, int) else max(n_head, default=0) if isinstance(n_head, list) else 0
    # a per-layer list (some architectures) sums over the layers
    kv_heads = ([int(h) for h in n_head_kv] if isinstance(n_head_kv, list)
                else [int(n_head_kv)] * (n_layer or 0) if isinstance(n_head_kv, int) else [])
    if not n_layer or not n_embd or not heads or not kv_heads:
        return None
    key = _int_or_none(meta.get(f"{arch}.attention.key_length")) or n_embd // heads
    value = _int_or_none(meta.get(f"{arch}.attention.value_length")) or n_embd // heads
    return sum(kv_heads[:n_layer]) * (key + value) * 2


def _tokens(meta: Mapping[str, Any]) -> list[bytes]:
    toks = meta.get("tokenizer.ggml.tokens")
    return toks if isinstance(toks, list) else []


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
