"""Text a user hands us (prompt files, stdin, arguments, request bodies) must be UTF-8: anything else is
a one-line ParameterError that says where it broke, never a UnicodeError traceback (a latin-1 file, a
terminal in another encoding, a JSON string holding half of a UTF-16 pair)."""

from __future__ import annotations

import codecs
import json
import sys
from pathlib import Path
from typing import Any

from .environment import expand_home
from .errors import ParameterError

_FIX = "save or send it as UTF-8 (e.g. iconv -f latin1 -t utf-8)"
# more text than we read from a file or stdin: tens of millions of tokens, past any context, where reading
# /dev/zero or `yes` as a prompt would fill the memory
MAX_TEXT_BYTES = 256 * 2**20


# UTF-16 (what Windows PowerShell 5.1's ">" writes) and UTF-32, known by their byte-order marks; UTF-32's
# first (its little-endian mark starts as UTF-16's)
_UNICODE_BOMS = ((codecs.BOM_UTF32_LE, "utf-32"), (codecs.BOM_UTF32_BE, "utf-32"),
                 (codecs.BOM_UTF16_LE, "utf-16"), (codecs.BOM_UTF16_BE, "utf-16"))


def decode_utf8(raw: bytes, name: str) -> str:
    """``raw`` as text; ``name`` (a path, "<stdin>") heads the error, with the line of the bad byte. A
    leading byte-order mark (Windows editors write one) is dropped: it would reach the model as text.
    One of UTF-16 or UTF-32 says the text is in that encoding: it was refused with advice (iconv from
    latin1) that made mojibake and NULs of it.
    Windows line ends (CRLF) are read as "\n", as Python's text files and the chat's input() read them:
    each "\r" was a token of the prompt, and the model answered in kind."""
    codec = next((codec for bom, codec in _UNICODE_BOMS if raw.startswith(bom)), "utf-8")
    try:
        return raw.decode(codec).removeprefix("\ufeff").replace("\r\n", "\n")
    except UnicodeDecodeError as exc:
        if codec != "utf-8":
            raise ParameterError(f"{name}: not {codec.upper()} text, though it starts with that byte-order mark "
                                 f"(bytes at offset {exc.start} do not decode); save it as UTF-8") from None
        line = raw.count(b"\n", 0, exc.start) + 1
        raise ParameterError(f"{name}:{line}: not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset "
                             f"{exc.start}); {_FIX}") from None


def read_text(path: str | Path, what: str = "file") -> str:
    """A UTF-8 text file's contents (``decode_utf8``'s error otherwise); a pipe (``<(...)``) too.
    ``what``: the file's part, for the error where it does not exist. A leading ``~`` is expanded: no shell
    does it after --file=, as -m and --pool take it."""
    if not str(path):
        raise ParameterError(f"the {what} name is empty")
    if str(path).startswith("~"):
        path = expand_home(path, f"give the {what}'s path without ~")
    try:
        with open(path, "rb") as f:
            data = _bounded_read(f, str(path))
    except FileNotFoundError:
        raise ParameterError(f"{what} not found: {path}") from None
    except IsADirectoryError:
        raise ParameterError(f"{path} is a directory, not a text file") from None
    except OSError as exc:
        raise ParameterError(f"cannot read {path}: {exc.strerror or exc}") from None
    return decode_utf8(data, str(path))


def read_json(path: str | Path, what: str) -> Any:
    """A JSON file's contents; one that is missing, unreadable or not UTF-8 JSON is a ParameterError
    naming it (``what``: what it should be, e.g. "bench results.json")."""
    text = read_text(path, what)
    try:
        return json.loads(text)
    except ValueError as exc:   # empty, truncated, not JSON
        raise ParameterError(f"{path}: not a {what} ({exc})") from None


def read_stdin() -> str:
    if sys.stdin is None:   # closed (<&-)
        raise ParameterError("stdin is closed: nothing to read the prompt from")
    return decode_utf8(_bounded_read(sys.stdin.buffer, "<stdin>"), "<stdin>")


def _bounded_read(f: Any, name: str) -> bytes:
    """Everything ``f`` holds, in chunks (one read of the whole limit would allocate it for a 6-byte file)."""
    chunks: list[bytes] = []
    size = 0
    while chunk := f.read(2**20):
        size += len(chunk)
        if size > MAX_TEXT_BYTES:
            raise ParameterError(f"{name} holds more than {MAX_TEXT_BYTES // 2**20} MiB of text: more than any "
                                 "context holds")
        chunks.append(chunk)
    return b"".join(chunks)


def utf8_bytes(text: str) -> bytes:
    """``text`` encoded for llama.cpp. Python strings may hold what UTF-8 cannot encode: a byte that
    was not UTF-8 in an argument or a line read from the terminal (kept as U+DC80-U+DCFF), or a lone
    surrogate from a JSON escape such as "\\ud800"."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as exc:
        code = ord(text[exc.start])
        what = (f"the byte 0x{code - 0xDC00:02x}, which is not UTF-8" if 0xDC80 <= code <= 0xDCFF
                else f"U+{code:04X}, half of a UTF-16 surrogate pair")
        raise ParameterError(f"the text is not valid Unicode: it holds {what}; {_FIX}") from None


def check_argument(value: str | None, flag: str) -> None:
    """ParameterError naming ``flag`` where its value is not UTF-8 text (a terminal in another encoding),
    checked before a model loads: found later, the error named no flag (chat's --system on every turn)."""
    if value is not None:
        try:
            utf8_bytes(value)
        except ParameterError as exc:
            raise ParameterError(f"{flag}: {exc}") from None
