"""What a generation hands back: its result and stats, the events of a stream, and the answer as the loop
emits it (``AnswerOutput``: end tokens, stop strings and the token budget end it; text that may begin a
stop string is held back)."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

from .llama import Model, TextStream


def _shown_text(text: str, limit: int = 60) -> str:
    """``text`` for a repr: its first ``limit`` characters, and how many more."""
    return repr(text) if len(text) <= limit else f"{text[:limit]!r}... ({len(text)} characters)"


def _shown_ids(tokens: Sequence[int], limit: int = 8) -> str:
    shown = ", ".join(map(str, tokens[:limit]))
    return f"[{shown}]" if len(tokens) <= limit else f"[{shown}, ...] ({len(tokens)} tokens)"


@dataclass
class GenerationStats:
    """How a generation went: tokens, times, target passes, drafted and accepted tokens, ``finish_reason``
    (stop: an end-of-generation token or a stop string; length: the token budget or the context's end;
    cancelled), the seed a sampled answer used, and the method's own numbers in ``extra``. The decode's
    seconds leave out the time a ``stream``'s reader spends between events (printing them, say)."""

    method: str
    tokens: int = 0
    prompt_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    tokens_per_second: float = 0.0
    target_passes: int = 0
    drafted: int = 0
    accepted: int = 0
    accepted_per_pass: float = 0.0    # accepted draft tokens per target pass (bonus excluded)
    tokens_per_pass: float = 0.0      # tokens the target produced per pass: accepted_per_pass + 1 (the bonus)
    finish_reason: str = ""
    seed: int | None = None           # a sampled answer's seed, drawn here where none was given: it repeats it
    extra: dict[str, Any] = field(default_factory=dict)

    def finalize(self) -> None:
        self.tokens_per_second = self.tokens / self.decode_seconds if self.decode_seconds > 0 else 0.0
        if self.target_passes:
            self.accepted_per_pass = self.accepted / self.target_passes
            # not tokens / passes: a pass that ends the answer (end of generation, a stop string, the
            # token budget) emits less than it produced, and "0.88 tokens per pass" reads as a bug
            self.tokens_per_pass = self.accepted_per_pass + 1.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class GenerationResult:
    """An answer: its ``text``, its token ids (through the one that completed a stop string, whose text is
    cut off) and its ``stats``."""

    text: str
    tokens: list[int]
    stats: GenerationStats

    @property
    def finish_reason(self) -> str:
        return self.stats.finish_reason

    def __repr__(self) -> str:   # bounded: a notebook cell showing a 100k-token answer printed a megabyte
        st = self.stats
        return (f"GenerationResult(text={_shown_text(self.text)}, tokens={_shown_ids(self.tokens)}, "
                f"finish_reason={st.finish_reason!r}, method={st.method!r}, "
                f"{st.tokens_per_second:.1f} tokens/s, {st.tokens_per_pass:.2f} tokens per pass)")

    def to_dict(self) -> dict[str, Any]:
        return {"text": self.text, "tokens": list(self.tokens), "stats": self.stats.to_dict()}   # a copy, as stats


@dataclass
class StreamEvent:
    """A piece of a streamed answer; the final event carries the whole ``result``."""

    text: str                          # new text since the previous event ("" is possible)
    tokens: list[int]                  # new tokens since the previous event
    result: GenerationResult | None = None   # set on the final event only

    def __repr__(self) -> str:
        final = f", result={self.result!r}" if self.result is not None else ""
        return f"StreamEvent(text={_shown_text(self.text)}, tokens={_shown_ids(self.tokens)}{final})"


PREFIX_SET_CHARS = 4_000_000   # the stop strings' prefixes are kept in a set up to this many characters


class StopMatcher:
    """Finds stop strings in streamed text and holds back text that may begin one."""

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self._longest = max(map(len, self.stops), default=0)
        # one search over every stop string, and their proper prefixes in a set where that is small: each
        # stop string searched and its prefixes tried in turn cost every token that much (1,000 of them
        # took the CLI from 1,152 to 244 tokens a second)
        self._any_stop = re.compile("|".join(map(re.escape, self.stops))) if self.stops else None
        small = sum(len(s) * len(s) for s in self.stops) <= PREFIX_SET_CHARS
        self._prefixes = {s[:k] for s in self.stops for k in range(1, len(s))} if small else None
        self._released: list[str] = []   # everything released so far, joined once at the end
        self._tail = ""                   # its last characters, where a stop string could begin
        self.pending = ""
        self.stopped = False

    @property
    def text(self) -> str:
        return "".join(self._released)

    def _release(self, out: str) -> str:
        if out:
            self._released.append(out)
            if self._longest:
                self._tail = (self._tail + out)[-self._longest:]
        return out

    def push(self, piece: str) -> str:
        if not self.stops:
            return self._release(piece)
        self.pending += piece
        window = self._tail + self.pending
        offset = len(window) - len(self.pending)
        hit = self._any_stop.search(window)   # the leftmost start of any stop string
        if hit is not None:
            cut = hit.start() - offset
            out = self.pending[:max(cut, 0)]   # cut < 0 cannot happen: text that may begin a stop is held
            self.pending = ""
            self.stopped = True
            return self._release(out)
        hold = self._held_back(self.pending)
        out = self.pending[:len(self.pending) - hold]
        self.pending = self.pending[len(self.pending) - hold:]
        return self._release(out)

    def _held_back(self, pending: str) -> int:
        """The length of ``pending``'s longest end that begins a stop string (held until it is decided)."""
        if self._prefixes is not None:
            for k in range(min(self._longest - 1, len(pending)), 0, -1):
                if pending[len(pending) - k:] in self._prefixes:
                    return k
            return 0
        hold = 0
        for s in self.stops:   # long stop strings: their prefixes would take too much memory
            for k in range(min(len(s) - 1, len(pending)), hold, -1):
                if pending.endswith(s[:k]):
                    hold = k
                    break
        return hold

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return self._release(out)


class AnswerOutput:
    """The answer as it is emitted: end-of-generation tokens, stop strings and the token budget end it,
    and text is released only where it cannot begin a stop string."""

    def __init__(self, target: Model, stops: Sequence[str], eog: frozenset[int], max_tokens: int):
        self.text_stream = TextStream(target)
        self.matcher = StopMatcher(stops)
        self.eog = eog
        self.max_tokens = max_tokens
        self.tokens: list[int] = []
        self.finish: str | None = None if max_tokens > 0 else "length"

    def take(self, new: Sequence[int]) -> StreamEvent | None:
        """Emit a round's tokens up to whatever ends the answer; the event to stream, if any."""
        emitted: list[int] = []
        text = ""
        for tok in new:
            if tok in self.eog:
                self.finish = "stop"
                break
            emitted.append(tok)
            text += self.matcher.push(self.text_stream.push(tok))
            if self.matcher.stopped:
                self.finish = "stop"
                break
            if len(self.tokens) + len(emitted) >= self.max_tokens:
                self.finish = "length"
                break
        self.tokens.extend(emitted)
        return StreamEvent(text=text, tokens=emitted) if emitted or text else None

    def flush(self) -> str:
        """The text held back at the end (an incomplete character, a partial stop string)."""
        if self.matcher.stopped:
            return ""
        tail = self.text_stream.flush()
        return (self.matcher.push(tail) if tail else "") + self.matcher.flush()
