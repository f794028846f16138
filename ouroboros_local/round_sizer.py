"""In rounds of one size (``EngineConfig.round_size`` K), whether the next round decodes K tokens or a
plain one-token step (``EngineConfig.round_switch``).

A round of K keeps a CUDA graph but costs more than a plain step (on an H200, SmolLM2: 1.33 steps), so it
pays only where the root and its K - 1 guesses write more tokens than that on average. Where text does
not repeat (SmolLM2's mt_bench: 1.31 tokens a round of 4, 0.95x of plain decoding), plain steps write as
much for less. The sizer counts what a round of K writes, and where plain steps decode, what one would
have written (its guesses against the tokens that followed), so both sizes are judged on the same
measure; it changes size only past a margin, since each change costs a decode without its graph on both
sides (docs/design.md#cost-model).
"""

from __future__ import annotations

from typing import Sequence

# the tokens a round of K writes, averaged over about the last 1 / WEIGHT rounds
WEIGHT = 0.2
# rounds of K resume where they would write this much more than they cost, and stop where they would
# write less than they cost: the gap keeps the size from changing back and forth on noise
RESUME_MARGIN = 0.10
STOP_MARGIN = 0.0


class RoundSizer:
    """``size()``: the next round's size; ``observe``: what the last round decoded and wrote. One per
    method and engine: a request begins (``begin_request``) at the size and average the last one left,
    since a request's first decode has no graph to keep either way."""

    def __init__(self, round_size: int, cost_ratio: float):
        """``cost_ratio``: a round of ``round_size`` over a plain step, both decoded back to back."""
        self.round_size = round_size
        self.cost_ratio = cost_ratio
        self.tokens = float(round_size)   # starts in rounds of K, as without the sizer
        self.plain = False
        self.plain_rounds = 0
        self.changes = 0
        self._pending: list[list] = []    # [guesses, matched]: rounds of K that plain steps stand for
        self._whole = False               # a stand-in would have written all K tokens: a copy under way

    def begin_request(self) -> None:
        self.plain_rounds = self.changes = 0
        self._pending.clear()
        self._whole = False

    def size(self) -> int:
        return 1 if self.plain else self.round_size

    def observe(self, decoded: int, guesses: Sequence[int], written: Sequence[int]) -> None:
        """A round that decoded ``decoded`` tokens wrote ``written``; ``guesses``: the K - 1 tokens a round
        of K would have checked after the root (those it did check, where it was one)."""
        for token in written:    # the plain steps' stand-ins, judged on the tokens that followed them
            self._pending = [entry for entry in self._pending if self._advance(entry, token)]
        if decoded > 1:
            self._count(len(written))
        else:
            self.plain_rounds += 1
            stand_in = [list(guesses[:self.round_size - 1]), 0]
            if self._advance(stand_in, written[0]):   # its first guess meets the token this step wrote
                self._pending.append(stand_in)
        self._decide()

    def _advance(self, stand_in: list, token: int) -> bool:
        """One more token written after a stand-in's root: False once it is judged (and counted)."""
        guesses, matched = stand_in
        if matched < len(guesses) and guesses[matched] == token:
            stand_in[1] = matched = matched + 1
            if matched < len(guesses):
                return True
        self._count(1 + matched)
        self._whole = self._whole or matched == self.round_size - 1
        return False

    def _count(self, tokens: int) -> None:
        self.tokens += WEIGHT * (tokens - self.tokens)

    def _decide(self) -> None:
        # tokens a round of K writes against its cost in plain steps, past a margin each way
        resume, stop = self.cost_ratio * (1 + RESUME_MARGIN), self.cost_ratio * (1 - STOP_MARGIN)
        if self.plain and self._whole:
            # a copy under way: rounds of K at once, not after the average has caught up with it (a false
            # start costs about two rounds before the average stops them again)
            self.tokens = max(self.tokens, resume)
        self._whole = False
        plain = self.tokens < (resume if self.plain else stop)
        if plain != self.plain:
            self.plain, self.changes = plain, self.changes + 1
