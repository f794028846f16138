"""The text bridge between two vocabularies (used by ``proposers/cross_vocab.py``).

``DraftView`` keeps the committed target tokens re-tokenized in the draft's vocabulary, incrementally:
only from the last *chunk boundary* (``is_chunk_start``) before new text, a byte offset where every
GPT-2-family pre-tokenizer must split, so the view equals a full re-tokenization at the cost of the new
text plus one chunk. ``text_to_target`` turns draft text back into target tokens after an anchor of
committed text, dropping the last, still unstable token; ``target_confidences`` carries the draft's
per-token confidences over to those target tokens.

SentencePiece tokenizers of the Llama-2 family (Mistral, TinyLlama, Phi-3, ...) put a space before the
text they are given (``adds_space_prefix``): their pieces spell one byte more than the text. Text that
continues earlier text is then tokenized without its own leading space, which the prefix stands for
(``tokenize_spelled``), and only a space after a non-space is a boundary (their pieces hold a space
first, or only spaces). A restart that finds no boundary spells one space more, which the draft reads:
the view restarts at the last such point again while it is less than ``_SPACE_BACKTRACK`` bytes back.
"""

from __future__ import annotations

import codecs
from bisect import bisect_left, bisect_right
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

if TYPE_CHECKING:  # pragma: no cover
    from .llama import Model

_WS = frozenset(b" \t\n\r\x0b\x0c")
_SPACE, _NL = 0x20, 0x0A
_MAX_BACKTRACK = 64    # tokens to walk back looking for a chunk boundary before giving up on exactness
# bytes a SentencePiece draft that puts a space before its text looks back for a space past that: a
# restart without one spells a space the text does not have (a URL, base64, a long identifier)
_SPACE_BACKTRACK = 1024


def is_chunk_start(buf: bytes | bytearray, p: int, spaces_only: bool = False) -> bool:
    """Must every GPT-2-family pre-tokenizer start a chunk at byte ``p`` of ``buf``, whatever follows?

    True for p == 0, for a space after a non-whitespace byte, and for a non-whitespace byte after a
    newline that itself follows a non-whitespace byte. (No pattern of those regexes matches
    non-space + space or newline + non-space. The lookahead ``\\s+(?!\\S)`` re-splits a run of
    several whitespace bytes once a non-space follows it, "\\n\\n" + "d" -> "\\n", "\\n", "d", so a
    boundary after a longer whitespace run is not stable.) ``spaces_only``: the space case alone, for a
    SentencePiece tokenizer, whose pieces start at a space (U+2581) but may hold a newline anywhere.
    """
    if p <= 0:
        return True
    if p >= len(buf):
        return False
    prev, cur = buf[p - 1], buf[p]
    if cur == _SPACE:
        return prev not in _WS
    return not spaces_only and prev == _NL and cur not in _WS and (p < 2 or buf[p - 2] not in _WS)


def valid_utf8_prefix(data: bytes) -> int:
    """Length of the longest prefix of ``data`` that decodes as UTF-8 (strict)."""
    try:
        data.decode("utf-8")
        return len(data)
    except UnicodeDecodeError as exc:
        return exc.start


def adds_space_prefix(tokenize: Callable[[str], list[int]], piece: Callable[[int], bytes]) -> bool:
    """Does the tokenizer put a space before the text it is given (a Llama-2-family SentencePiece)?"""
    return b"".join(piece(t) for t in tokenize("a")) == b" a"


def tokenize_spelled(tokenize: Callable[[str], list[int]], piece: Callable[[int], bytes], text: bytes,
                     adds_space: bool, continues: bool) -> tuple[list[int], int]:
    """Tokens of ``text`` (valid UTF-8) and the offset in ``text`` where the first one starts: -1 where
    it also spells a space the tokenizer put before the text (``adds_space``), else 0.

    ``continues``: the text continues earlier text, so a leading space of its own is left to the
    tokenizer's prefix (the pieces then spell the text exactly, as in the whole text's tokenization);
    a lone prefix token (a piece of one space) is dropped. (A space alone is tokenized whole: without
    it nothing would be left for the prefix to go before.)"""
    strip = adds_space and continues and text[:1] == b" " and len(text) > 1
    tokens = tokenize(text[1:].decode("utf-8") if strip else text.decode("utf-8"))
    if not adds_space or strip:
        return tokens, 0
    if continues and tokens and piece(tokens[0]) == b" ":
        return tokens[1:], 0
    return tokens, -1


def text_to_target(tokenize: Callable[[str], list[int]], piece: Callable[[int], bytes],
                   anchor: bytes, new: bytes, closed: bool = False,
                   adds_space: bool = False) -> tuple[list[int], bool]:
    """Target tokens for ``new`` text that follows committed text ending with ``anchor``.

    ``tokenize(text)`` is the target tokenizer without specials (add_special=False,
    parse_special=False) and ``piece(token)`` a target token's bytes; ``adds_space``: it puts a space
    before the text (``adds_space_prefix``). ``anchor`` must be valid UTF-8 and start at a committed
    target token boundary. Tokenizes ``anchor + new`` and returns the tokens after the one ending
    exactly at ``len(anchor)`` (or, when a token straddles that point, ``new`` tokenized alone). Unless
    ``closed`` (the text is known to end there: a special token follows), the last token is dropped
    because more text could still merge into it; a partial UTF-8 character at the end of ``new`` is cut
    off (and then nothing is closed). Returns ``(tokens, complete)`` where ``complete`` says the tokens
    spell all of ``new``.
    """
    n = valid_utf8_prefix(new)
    complete = n == len(new)
    closed = closed and complete
    new = new[:n]
    if not new:
        return [], complete
    tokens, acc = tokenize_spelled(tokenize, piece, anchor + new, adds_space, True) if anchor else ([], 0)
    start = -1
    if anchor:
        for j, tok in enumerate(tokens):
            if acc == len(anchor):
                start = j
                break
            acc += len(piece(tok))
            if acc > len(anchor):
                break
        else:
            if acc == len(anchor):
                start = len(tokens)
    if start < 0:
        tokens, offset = tokenize_spelled(tokenize, piece, new, adds_space, True)
        if offset:   # the first token spells a space that is not in the text
            return [], False
        start = 0
    out = tokens[start:]
    if not closed and out:
        out.pop()
        complete = False
    return out, complete


def target_confidences(target_tokens: Sequence[int], piece: Callable[[int], bytes], draft_spans: Sequence[int],
                       draft_confidences: Sequence[float]) -> list[float]:
    """Confidence of each target token of a converted draft: the least confident draft token whose
    bytes overlap it (both token lists spell the same text from its start; ``draft_spans`` are the
    draft tokens' byte lengths)."""
    ends = np.cumsum(draft_spans)
    starts = ends - np.asarray(draft_spans)
    out = []
    a = 0
    for tok in target_tokens:
        b = a + len(piece(tok))
        hit = [c for s0, e0, c in zip(starts, ends, draft_confidences) if s0 < b and e0 > a]
        out.append(min(hit) if hit else (draft_confidences[-1] if draft_confidences else 0.0))
        a = b
    return out


class DraftView:
    """The committed text in the draft's vocabulary, kept up to date incrementally.

    ``tokens`` are the draft tokens of the committed target tokens seen so far (``extend``).
    ``dirty`` is the lowest index of ``tokens`` changed since the caller last reset it (to
    ``len(tokens)``): draft KV cells before it are still valid. ``pending`` are committed bytes of an
    incomplete UTF-8 character, not yet in the view. ``anchor()`` gives the committed text the
    target-side conversion starts from.
    """

    def __init__(self, target: "Model", draft: "Model", map_specials: bool = True, tail_bytes: int = 16,
                 n_anchor: int = 8):
        self.target = target
        self.draft = draft
        self.map_specials = map_specials
        self.tail_bytes = tail_bytes
        self.n_anchor = n_anchor
        self._target_kind: dict[int, tuple[str, Any]] = {}
        self._draft_special: dict[int, int | None] = {}   # draft token -> target EOG token | None
        self.retokenized_bytes = 0     # bytes passed to the draft tokenizer (cost counter)
        self.inexact_restarts = 0      # re-tokenizations that found no chunk boundary
        self.adds_space = adds_space_prefix(self._tokenize_draft, draft.piece)
        self.target_adds_space = adds_space_prefix(
            lambda text: target.tokenize(text, add_special=False, parse_special=False), target.piece)
        # a run of such a target starts with the space its tokenizer put there: the draft's stands for it
        self._target_spaced = self.adds_space and self.target_adds_space
        self.reset()

    def _tokenize_draft(self, text: str) -> list[int]:
        return self.draft.tokenize(text, add_special=False, parse_special=False)

    def reset(self) -> None:
        d = self.draft
        self.tokens: list[int] = [d.bos] if d.add_bos and d.bos >= 0 else []
        self.dirty = 0
        self.n_target = 0                          # committed target tokens consumed
        self._run = bytearray()                    # valid UTF-8 text since the last mapped special
        self._run_base = len(self.tokens)          # index in tokens of the run's first token
        self._ends: list[int] = []                 # per run token: end offset in _run
        self._covered = 0                          # bytes of _run that the run tokens spell
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._bounds: list[int] = []               # _run offsets where committed target tokens end
        self._floor = 0                            # target tokenization restarts here (specials)
        self._seam: int | None = None              # _run offset of the last restart without a boundary
        self.exact = True

    # ---- the committed side ----------------------------------------------------------------------
    @property
    def pending(self) -> bytes:
        return self._decoder.getstate()[0]

    def _classify(self, token: int) -> tuple[str, Any]:
        kind = self._target_kind.get(token)
        if kind is not None:
            return kind
        t, d = self.target, self.draft
        text = t.piece(token, False)
        if text:
            kind = ("text", text)
        else:
            raw = t.piece(token, True)
            if not raw:
                kind = ("skip", None)
            elif token == t.bos:
                kind = ("bos", raw)
            else:
                mapped = None
                if self.map_specials:
                    ids = d.tokenize(raw.decode("utf-8", "replace"), add_special=False, parse_special=True)
                    if len(ids) == 1 and not d.piece(ids[0], False) and d.piece(ids[0], True) == raw:
                        mapped = ids[0]
                kind = ("special", mapped) if mapped is not None else ("render", raw)
        self._target_kind[token] = kind
        return kind

    def extend(self, target_tokens: Sequence[int]) -> None:
        """Append committed target tokens to the view."""
        grew = False
        for tok in target_tokens:
            tok = int(tok)
            kind, data = self._classify(tok)
            if kind == "bos" and self.n_target == 0:
                kind, data = "skip", None
            elif kind == "bos":
                kind = "render"
            self.n_target += 1
            if kind == "text" or kind == "render":
                s = self._decoder.decode(data)
                if s:
                    self._run += s.encode("utf-8")
                    grew = True
                if kind == "render":
                    self._floor, self._bounds = len(self._run), []
                elif not self.pending:
                    self._bounds.append(len(self._run))
                    if len(self._bounds) > 2 * self.n_anchor:
                        del self._bounds[:self.n_anchor]
            elif kind == "special":
                self._close_run()
                self.tokens.append(data)
                self._run, self._ends, self._covered, self._seam = bytearray(), [], 0, None
                self._run_base = len(self.tokens)
                self._bounds, self._floor = [], 0
                grew = False
        if grew:
            self._retokenize()

    def _close_run(self) -> None:
        self._decoder.reset()   # a partial character before a special token is dropped
        self._retokenize()
        self.dirty = min(self.dirty, len(self.tokens))

    def _restart_point(self) -> int:
        """Index (in the run) of the first run token to re-tokenize."""
        ends = self._ends
        if not self.exact or not ends:
            return 0
        i = len(ends)          # every old token ends at or before _covered
        run = self._run
        for j in range(i, max(i - _MAX_BACKTRACK, 0) - 1, -1):
            if j == 0 or self._stable_start(run, ends[j - 1]):
                return j
        if self.adds_space and (j := self._space_further_back()) is not None:
            return j
        self.inexact_restarts += 1
        j = bisect_right(ends, max(self._covered - self.tail_bytes, 0))
        # a byte-level token may end inside a character: restart where one begins (the window is decoded)
        while j > 0 and run[ends[j - 1]] & 0xC0 == 0x80:
            j -= 1
        if self.adds_space:
            self._seam = ends[j - 1] if j else None
        return j

    def _space_further_back(self) -> int | None:
        """A restart (index in the run) at the last stable space less than ``_SPACE_BACKTRACK`` bytes back,
        or at the run's start where that is, else at the last restart without a boundary (it spelled its
        space already), else None."""
        run, ends = self._run, self._ends
        low = max(self._covered - _SPACE_BACKTRACK, 0)
        p = run.rfind(b" ", low, self._covered)
        while p >= 0:
            if self._stable_start(run, p):
                k = bisect_left(ends, p)
                if k < len(ends) and ends[k] == p:
                    return k + 1
            p = run.rfind(b" ", low, p)
        if low == 0:
            return 0
        if self._seam is not None and self._seam >= low:
            k = bisect_left(ends, self._seam)
            if k < len(ends) and ends[k] == self._seam:
                return k + 1   # (counted when it was made)
        return None

    def _stable_start(self, run: bytearray, p: int) -> bool:
        """Does the whole run's tokenization have a token starting at byte ``p``, whatever follows?"""
        if not self.adds_space:
            return is_chunk_start(run, p)
        # not a trailing space: no word begins there yet (alone it would be tokenized as two spaces)
        return is_chunk_start(run, p, spaces_only=True) and p < len(run) - 1

    def _retokenize(self) -> None:
        run = self._run
        if self._covered == len(run):
            return
        j = self._restart_point()
        start = self._ends[j - 1] if j else 0
        window = bytes(run[start:])
        piece = self.draft.piece
        continues = j > 0 or (self._target_spaced and window[:1] == b" ")
        new, offset = tokenize_spelled(self._tokenize_draft, piece, window, self.adds_space, continues)
        self.retokenized_bytes += len(window)
        ends = []
        acc = start + offset
        for tok in new:
            acc += len(piece(tok))
            ends.append(acc)
        if self.exact and acc != len(run):
            # Pieces do not spell the text back (a normalizing tokenizer): byte offsets are
            # meaningless, so the whole run is re-tokenized from now on (still correct, slower).
            self.exact = False
            if start:
                self._ends, self._covered = [], 0
                self._retokenize()
                return
        base = self._run_base + j
        old = self.tokens
        k = 0
        limit = min(len(old) - base, len(new))
        while k < limit and old[base + k] == new[k]:
            k += 1
        self.dirty = min(self.dirty, base + k)
        del old[base:]
        old.extend(new)
        del self._ends[j:]
        self._ends.extend(ends)
        self._covered = len(run)

    def anchor(self) -> bytes:
        """Committed text from a target token boundary a few tokens back (valid UTF-8)."""
        run = self._run
        bounds = [b for b in self._bounds[-self.n_anchor:] if b >= self._floor]
        start = bounds[0] if bounds else self._floor
        for b in bounds:
            if b < len(run) and is_chunk_start(run, b):
                start = b
        return bytes(run[start:])

    # ---- the draft side --------------------------------------------------------------------------
    def draft_special(self, token: int) -> int | None | bool:
        """False for a plain draft token; for a special: the target EOG token it maps to, or None."""
        token = int(token)
        if token in self._draft_special:
            return self._draft_special[token]
        d, t = self.draft, self.target
        if d.piece(token, False) or not d.piece(token, True):
            self._draft_special[token] = False
            return False
        mapped = None
        if self.map_specials and token in d.eog_tokens:
            raw = d.piece(token, True)
            ids = t.tokenize(raw.decode("utf-8", "replace"), add_special=False, parse_special=True)
            if len(ids) == 1 and ids[0] in t.eog_tokens and t.piece(ids[0], True) == raw:
                mapped = ids[0]
        self._draft_special[token] = mapped
        return mapped


__all__ = ["DraftView", "adds_space_prefix", "is_chunk_start", "target_confidences", "text_to_target",
           "tokenize_spelled", "valid_utf8_prefix"]
