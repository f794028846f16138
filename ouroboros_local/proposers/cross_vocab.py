"""Cross-vocabulary speculative decoding: any draft model for any target, through text.

When the draft's tokenizer differs from the target's, draft token ids mean nothing to the target. The
draft therefore works in its own token space on a *re-tokenized view* of the committed text, and its
guesses travel to the target as text (bytes):

1. **View** (``DraftView``). Committed target tokens are turned into bytes incrementally (one cached
   piece lookup per token; an incremental UTF-8 decoder holds back a partial character). The text is
   tokenized with the draft tokenizer, but only from the last *chunk boundary* before the new text:
   a byte offset where every pre-tokenizer of the GPT-2 family (GPT-2, Llama-3, Qwen2, SmolLM, ...)
   must split (a space after a non-space, or a non-space after ``\\n``). Tokens before such a boundary
   cannot change when text is appended, so the incremental view equals a full re-tokenization while
   costing O(new text + one chunk) per round.
2. **Draft KV** is kept in step with the view by prefix reuse: the view records the lowest index it
   changed; only the draft tokens from there on are decoded again (typically the target's bonus token
   re-tokenized, and any drafted tokens the target did not take).
3. **Draft** ``gamma`` tokens greedily in the draft vocabulary.
4. **Convert** (``text_to_target``): tokenize ``anchor + draft_text`` with the TARGET tokenizer, where
   ``anchor`` is the text of the last committed target tokens (pre-tokenizer context), take the target
   tokens after the anchor, and drop the last one: it may still merge with text the draft did not write
   yet (an unstable boundary). If no target token ends exactly at the anchor's end, the draft text is
   tokenized alone. ``parse_special=False``: draft text never becomes a target control token.
5. **Verify**: the target checks the target-token chain as usual. Nodes are deterministic (no draft
   distribution), so greedy output is the target's own and sampling uses sample-and-match: the output
   distribution is exactly the target's.

Special tokens and chat templates (the rule). The target's prompt is already rendered with the target's
chat template; the draft reads the same text. A control token of the target (``<|im_start|>``, ...) is
*mapped* to the draft's control token with the same text when the draft has one, and otherwise
*rendered as its text* (``"<|im_start|>"`` as plain draft tokens). The target's BOS at position 0 is
dropped (the draft gets its own BOS when its vocabulary asks for one). In the other direction, a draft
control token ends the draft; only an end-of-generation token that both models have under the same
text (e.g. ``<|im_end|>``) is proposed, as the target's own EOG token, after the draft's text (text
before a special token is a stable tokenization boundary, so nothing is dropped then). Option
``map_specials=False`` renders every target special as text and never proposes one.

Reuse (an Ouroboros variant): ``DraftView`` (committed target tokens -> draft tokens, with the anchor
for conversion) and ``text_to_target`` are independent of the drafting strategy; after each
``propose`` the proposer exposes ``last_draft_tokens`` / ``last_draft_text`` (draft space) and
``last_target_tokens`` (what was proposed).
"""

from __future__ import annotations

import codecs
from bisect import bisect_right
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

from ..errors import ParameterError
from ..kv import common_prefix
from ..scheduler import probability_class
from ..tree import TokenTree
from .base import CatchUp, ProposeSetup, Proposer
from .draft_model import top_probability

if TYPE_CHECKING:  # pragma: no cover
    from ..engine import Engine
    from ..kv import KVCache
    from ..llama import Model
    from ..pool import PhrasePool
    from ..verify import VerifyResult

_WS = frozenset(b" \t\n\r\x0b\x0c")
_SPACE, _NL = 0x20, 0x0A
_MAX_BACKTRACK = 64    # tokens to walk back looking for a chunk boundary before giving up on exactness


def is_chunk_start(buf: bytes | bytearray, p: int) -> bool:
    """Must every GPT-2-family pre-tokenizer start a chunk at byte ``p`` of ``buf``, whatever follows?

    True for p == 0, for a space after a non-whitespace byte, and for a non-whitespace byte after a
    newline that itself follows a non-whitespace byte. (No pattern of those regexes matches
    non-space + space or newline + non-space. The lookahead ``\\s+(?!\\S)`` re-splits a run of
    several whitespace bytes once a non-space follows it, "\\n\\n" + "d" -> "\\n", "\\n", "d", so a
    boundary after a longer whitespace run is not stable.)
    """
    if p <= 0:
        return True
    if p >= len(buf):
        return False
    prev, cur = buf[p - 1], buf[p]
    if cur == _SPACE:
        return prev not in _WS
    return prev == _NL and cur not in _WS and (p < 2 or buf[p - 2] not in _WS)


def valid_utf8_prefix(data: bytes) -> int:
    """Length of the longest prefix of ``data`` that decodes as UTF-8 (strict)."""
    try:
        data.decode("utf-8")
        return len(data)
    except UnicodeDecodeError as exc:
        return exc.start


def text_to_target(tokenize: Callable[[str], list[int]], piece: Callable[[int], bytes],
                   anchor: bytes, new: bytes, closed: bool = False) -> tuple[list[int], bool]:
    """Target tokens for ``new`` text that follows committed text ending with ``anchor``.

    ``tokenize(text)`` is the target tokenizer without specials (add_special=False,
    parse_special=False) and ``piece(token)`` a target token's bytes. ``anchor`` must be valid UTF-8 and
    start at a committed target token boundary. Tokenizes ``anchor + new`` and returns the tokens after
    the one ending exactly at ``len(anchor)`` (or, when a token straddles that point, ``new`` tokenized
    alone). Unless ``closed`` (the text is known to end there: a special token follows), the last token
    is dropped because more text could still merge into it; a partial UTF-8 character at the end of
    ``new`` is cut off (and then nothing is closed). Returns ``(tokens, complete)`` where ``complete``
    says the tokens spell all of ``new``.
    """
    n = valid_utf8_prefix(new)
    complete = n == len(new)
    closed = closed and complete
    new = new[:n]
    if not new:
        return [], complete
    tokens = tokenize((anchor + new).decode("utf-8")) if anchor else []
    start = -1
    if anchor:
        acc = 0
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
        tokens, start = tokenize(new.decode("utf-8")), 0
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
        self.reset()

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
                self._run, self._ends, self._covered = bytearray(), [], 0
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
            if j == 0 or is_chunk_start(run, ends[j - 1]):
                return j
        self.inexact_restarts += 1
        return bisect_right(ends, max(self._covered - self.tail_bytes, 0))

    def _retokenize(self) -> None:
        run = self._run
        if self._covered == len(run):
            return
        j = self._restart_point()
        start = self._ends[j - 1] if j else 0
        window = bytes(run[start:])
        new = self.draft.tokenize(window.decode("utf-8"), add_special=False, parse_special=False)
        self.retokenized_bytes += len(window)
        ends = []
        acc = start
        piece = self.draft.piece
        for tok in new:
            acc += len(piece(tok))
            ends.append(acc)
        if self.exact and acc != len(run):
            # Pieces do not spell the text back (a SentencePiece space prefix...): byte offsets are
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


class CrossVocabProposer(Proposer):
    """Greedy draft model with another vocabulary; its text becomes a deterministic target chain."""

    name = "speculative"
    cross_vocab = True
    adaptive = True   # a chain: the scheduler caps, stops and trims it by the cost model
    confidence_classes = True

    def __init__(self, kv: "KVCache", target: "Model", draft: "Model", gamma: int = 6,
                 map_specials: bool = True, keep_unstable: bool = False):
        if gamma < 1:
            raise ParameterError(f"gamma must be >= 1 (got {gamma})")
        self.kv = kv
        self.target = target
        self.draft = draft
        self.gamma = gamma
        self.keep_unstable = keep_unstable
        self.view = DraftView(target, draft, map_specials=map_specials)
        self._kv_equal = 0     # kv.cached[:_kv_equal] == view.tokens[:_kv_equal] (known)
        self._catch_up = CatchUp()
        self.last_draft_tokens: list[int] = []
        self.last_draft_text = b""
        self.last_target_tokens: list[int] = []
        self._zero_stats()

    def _zero_stats(self) -> None:
        self.draft_steps = 0        # draft decodes
        self.draft_fed = 0          # tokens decoded by the draft (view catch-up + drafted)
        self.draft_tokens = 0       # tokens the draft wrote
        self.rounds = 0
        self.empty_rounds = 0       # rounds that proposed nothing
        self.cost_stops = 0         # drafts stopped because one more token could not pay
        self.view.retokenized_bytes = 0
        self.view.inexact_restarts = 0

    # ---- target-side conversion ------------------------------------------------------------------
    def _tokenize_target(self, text: str) -> list[int]:
        return self.target.tokenize(text, add_special=False, parse_special=False)

    def to_target(self, draft_text: bytes, closed: bool = False) -> tuple[list[int], bool]:
        """Target tokens for draft text that continues the committed text (see ``text_to_target``)."""
        if self.view.pending:
            # the committed target tokens end inside a character: no target token boundary to start at
            return [], False
        return text_to_target(self._tokenize_target, self.target.piece, self.view.anchor(), draft_text,
                              closed=closed or self.keep_unstable)

    # ---- draft KV --------------------------------------------------------------------------------
    def _sync(self, upto: int | None = None, logits: bool = True) -> np.ndarray | None:
        """Make the draft KV hold view.tokens[:upto] (prefix reuse); logits of its last token."""
        view = self.view.tokens
        n = len(view) if upto is None else upto
        cached = self.kv.cached
        keep = min(self._kv_equal, self.view.dirty, len(cached), n)
        m = min(len(cached), n)
        while keep < m and cached[keep] == view[keep]:
            keep += 1
        if logits and keep == n:
            keep -= 1
        self.kv.truncate(keep)
        todo = view[keep:n]
        out = self.kv.feed(todo, logits_last=logits)
        if todo:
            self.draft_steps += 1
            self.draft_fed += len(todo)
        self._kv_equal = n
        self.view.dirty = len(view)
        return out

    # ---- Proposer --------------------------------------------------------------------------------
    def begin(self, prompt: Sequence[int], setup: ProposeSetup) -> None:
        super().begin(prompt, setup)
        self._zero_stats()
        self.view.reset()
        self.view.extend(prompt)
        self._kv_equal = 0
        self._catch_up.start()
        n = len(self.view.tokens)
        if self.prefill_in_begin and 1 < n < self.kv.ctx.n_ctx:
            self._sync(n - 1, logits=False)   # draft prefill, counted as prefill by the engine

    def propose(self, committed: Sequence[int], budget: int) -> TokenTree:
        view = self.view
        if len(committed) > view.n_target:
            view.extend(committed[view.n_target:])
        tree = TokenTree.rooted_at(committed[-1])
        self.rounds += 1
        self.catch_up_seconds = 0.0
        self.last_draft_tokens, self.last_draft_text, self.last_target_tokens = [], b"", []
        n_view = len(view.tokens)
        n = min(self.gamma, self.kv.ctx.n_ctx - n_view - 1)
        if budget <= 0 or n <= 0 or n_view == 0 or view.pending:
            self.empty_rounds += 1
            return tree
        # the text of the rounds it skipped
        self.catch_up_seconds = self._catch_up.before_draft(
            lambda: self._sync(len(view.tokens) - 1, logits=False))
        logits = self._sync()
        drafted: list[int] = []
        confidences: list[float] = []
        classes: list[str] = []
        extend_pays = self.setup.extend_pays
        closing: int | None = None
        for i in range(n):
            tok = int(np.argmax(logits))
            special = view.draft_special(tok)
            if special is not False:
                closing = special      # None: a draft special without a target equivalent
                break
            drafted.append(tok)
            confidences.append(top_probability(logits, tok))
            classes.append(probability_class(confidences[-1]))
            if i == n - 1:
                break
            # the last target token of a draft is dropped (it could still merge with more text), so the
            # value so far is that of all draft tokens but the newest
            if extend_pays is not None and not extend_pays(self.name, classes[:-1]):
                self.cost_stops += 1
                break
            logits = self.kv.feed([tok], logits_last=True)
            self.draft_steps += 1
            self.draft_fed += 1
        self.draft_tokens += len(drafted)
        text = b"".join(self.draft.piece(t) for t in drafted)
        self.last_draft_tokens, self.last_draft_text = drafted, text
        toks, complete = self.to_target(text, closed=closing is not None)
        if closing is not None and complete:
            toks.append(closing)
        toks = toks[:budget]
        self.last_target_tokens = toks
        if toks:
            tree.add_path(0, toks, source="draft")
            spans = [len(self.draft.piece(t)) for t in drafted]
            for node, conf in enumerate(target_confidences(toks, self.target.piece, spans, confidences), 1):
                tree.classes[node] = probability_class(conf)
        else:
            self.empty_rounds += 1
        return tree

    def observe(self, committed: Sequence[int], result: "VerifyResult") -> None:
        # Nothing to do eagerly: the next propose() extends the view with the new committed tokens and
        # re-decodes only the draft tokens that changed.
        self._catch_up.observed()

    def stats(self) -> dict[str, Any]:
        return {"cross_vocab": True, "draft_steps": self.draft_steps, "draft_fed": self.draft_fed,
                "draft_tokens": self.draft_tokens, "cross_rounds": self.rounds,
                "cross_empty_rounds": self.empty_rounds, "cost_stops": self.cost_stops,
                "retokenized_bytes": self.view.retokenized_bytes,
                "inexact_restarts": self.view.inexact_restarts}


def vocabulary_difference(target: "Model", draft: "Model", max_size_difference: int = 128) -> str | None:
    """Why the draft cannot propose target token ids directly, or None when it can.

    The rule of ``models.check_pair`` on loaded models: sizes within ``max_size_difference``, the same
    special ids, and the same token texts over the common range.
    """
    if abs(target.n_vocab - draft.n_vocab) > max_size_difference:
        return f"draft vocabulary differs from target: size {draft.n_vocab} vs {target.n_vocab}"
    for label, t_val, d_val in (("bos id", target.bos, draft.bos), ("eos id", target.eos, draft.eos)):
        if t_val != d_val:
            return f"draft {label} {d_val} differs from the target's {t_val}"
    for t in range(min(target.n_vocab, draft.n_vocab)):
        if target.token_text(t) != draft.token_text(t):
            return f"token {t} is {target.token_text(t)!r} in the target but {draft.token_text(t)!r} in the draft"
    return None


def create(engine: "Engine", options: dict[str, Any]) -> Proposer:
    """``speculative`` for a draft of another vocabulary (``options`` checked against its OPTIONS)."""
    if engine.draft is None:
        raise ParameterError("this method needs a draft model (-d/--draft)")
    return CrossVocabProposer(engine.draft_kv(), engine.target, engine.draft, gamma=options["gamma"] or 6,
                              map_specials=options["map_specials"], keep_unstable=options["keep_unstable"])


class CrossVocabOuroboros(CrossVocabProposer):
    """Ouroboros across vocabularies: phrase-level drafting in the draft's vocabulary, the phrase pool
    for long drafts and verification phrases in the target's.

    ``inner`` is an ``OuroborosProposer`` over the draft context working on ``view.tokens`` (its Jacobi
    window and its own draft-vocabulary pool make one draft forward yield several tokens); its draft
    text is converted to target tokens as in ``CrossVocabProposer``; then the target-vocabulary pool's
    phrases for the last converted token hang below the draft (long drafts), and ``observe`` harvests
    the target's predictions over rejected tails into that pool.

    Scheduled by the cost model with one acceptance estimate (its trunk + phrase branches are no chain
    to trim by class): on a CPU it drafts only while its measured acceptance pays for the verification.
    """

    name = "ouroboros"
    confidence_classes = False

    def __init__(self, kv: "KVCache", target: "Model", draft: "Model", inner: Proposer,
                 pool: "PhrasePool", *, gamma: int, topk: int, harvest: str, pool_from_prompt: bool,
                 map_specials: bool = True):
        super().__init__(kv, target, draft, gamma=gamma, map_specials=map_specials)
        self.inner = inner
        self.pool = pool
        self.topk = topk
        self.harvest = harvest
        self.pool_from_prompt = pool_from_prompt
        self._fed = 0
        self.suffix_nodes = 0
        self.suffix_accepted = 0
        self.verify_phrases = 0

    def begin(self, prompt: Sequence[int], setup: ProposeSetup) -> None:
        Proposer.begin(self, prompt, setup)
        self._zero_stats()
        self.view.reset()
        self.view.extend(prompt)
        self._kv_equal = 0
        draft_setup = ProposeSetup(sampling=setup.sampling, rng=setup.rng,
                                   max_tree_nodes=setup.max_tree_nodes, max_branches=setup.max_branches,
                                   eog_tokens=self.draft.eog_tokens)
        self.inner.begin(list(self.view.tokens), draft_setup)   # window reset + draft prefill
        self._fed = 0
        self._feed(prompt)
        self.suffix_nodes = self.suffix_accepted = self.verify_phrases = 0

    def _feed(self, committed: Sequence[int]) -> None:
        if self.pool_from_prompt:
            self.pool.add_ngrams(committed, self.pool.phrase_len + 1, start=self._fed)
            self._fed = len(committed)

    def propose(self, committed: Sequence[int], budget: int) -> TokenTree:
        from .ouroboros import hang_pool_phrases

        view = self.view
        if len(committed) > view.n_target:
            view.extend(committed[view.n_target:])
        tree = TokenTree.rooted_at(committed[-1])
        self.rounds += 1
        self.last_draft_tokens, self.last_draft_text, self.last_target_tokens = [], b"", []
        tokens = list(view.tokens)
        if budget <= 0 or len(tokens) < 2 or view.pending or len(tokens) + 1 >= self.kv.ctx.n_ctx:
            self.empty_rounds += 1
            return tree
        # the draft KV must be a prefix of the view (re-tokenization may have changed its tail);
        # watermark: it held the view's first _kv_equal tokens, of which view.dirty are unchanged
        agreed = min(self._kv_equal, view.dirty)
        self.kv.truncate(min(common_prefix(self.kv.cached, tokens, agreed), len(tokens) - 1))
        # one draft token more than the budget: the last converted token is dropped
        drafted = self.inner.draft_tokens(tokens, min(self.gamma, budget + 1))
        self._kv_equal, view.dirty = len(tokens), len(tokens)   # drafting appends after them only
        self.draft_steps = self.inner._stats.get("draft_forwards", 0)
        closing: int | None = None
        for i, tok in enumerate(drafted):
            special = view.draft_special(tok)
            if special is not False:
                closing, drafted = special, drafted[:i]
                break
        self.draft_tokens += len(drafted)
        text = b"".join(self.draft.piece(t) for t in drafted)
        self.last_draft_tokens, self.last_draft_text = drafted, text
        toks, complete = self.to_target(text, closed=closing is not None)
        if closing is not None and complete:
            toks.append(closing)
        toks = toks[:budget]
        self.last_target_tokens = toks
        node = tree.add_path(0, toks, source="draft") if toks else 0
        eog = self.setup.eog_tokens
        last = toks[-1] if toks else committed[-1]
        if self.topk and last not in eog:
            self.suffix_nodes += hang_pool_phrases(tree, node, self.pool.lookup([last], k=self.topk),
                                                   budget, self.setup.max_branches, eog)
        if not tree.n_candidates:
            self.empty_rounds += 1
        return tree

    def observe(self, committed: Sequence[int], result: "VerifyResult") -> None:
        from ..pool import harvest_verification

        self.suffix_accepted += result.accepted_by_source.get("pool", 0)
        if self.harvest != "none" and result.tree.n_candidates:
            self.verify_phrases += harvest_verification(self.pool, result.tree, result.predictions,
                                                        result.path, self.harvest, context=())
        self._feed(committed)

    def end(self) -> None:
        self.inner.end()

    def stats(self) -> dict[str, Any]:
        out = super().stats()
        inner = self.inner.stats()
        out.update({k: v for k, v in inner.items() if k.startswith("ouro_draft") or k == "ouro_window_phrases"})
        out.update({"ouro_suffix_nodes": self.suffix_nodes, "ouro_suffix_accepted": self.suffix_accepted,
                    "ouro_verify_phrases": self.verify_phrases, "ouro_pool_size": len(self.pool),
                    "ouro_draft_pool_size": len(self.inner.pool)})
        return out


def create_ouroboros(engine: "Engine", options: dict[str, Any]) -> Proposer:
    """Ouroboros for a draft with another vocabulary (see ``CrossVocabOuroboros``)."""
    from ..history import shared_pool
    from ..pool import PhrasePool
    from .ouroboros import OuroborosProposer, scheduled

    if engine.draft is None:
        raise ParameterError("this method needs a draft model (-d/--draft)")
    gamma, window, level, guess, topk = (options[k] for k in ("gamma", "window", "level", "guess_set", "topk"))
    harvest = options["harvest"]
    pool = shared_pool(engine, level - 1, max(guess, topk, 1), options["pool"])      # target vocabulary
    # the draft's own window/phrase pool (draft vocabulary), kept across requests like the target's
    draft_pool = engine.shared.setdefault(
        f"ouroboros_draft_pool:N={level}:G={guess}",
        PhrasePool(key_len=1, max_per_key=max(guess, 1), phrase_len=level - 1))
    kv = engine.draft_kv()
    inner = OuroborosProposer(kv, draft_pool, engine.draft.n_vocab, gamma=gamma, window=window,
                              level=level, guess_set=guess, topk=0, harvest="none",
                              pool_from_prompt=options["pool_from_prompt"], overshoot=options["overshoot"],
                              seed=options["seed"], check=engine)
    drafter = CrossVocabOuroboros(kv, engine.target, engine.draft, inner, pool, gamma=gamma, topk=topk,
                                  harvest=harvest, pool_from_prompt=options["pool_from_prompt"],
                                  map_specials=options["map_specials"])
    return scheduled(engine, drafter, pool, options)


__all__ = ["CrossVocabOuroboros", "CrossVocabProposer", "DraftView", "create", "create_ouroboros",
           "is_chunk_start", "text_to_target", "valid_utf8_prefix", "vocabulary_difference"]
