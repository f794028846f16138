"""Labelled drafts that verification did not try in full, held until the text written next scores them.

What ``Scheduler.trim`` cuts from a chain is never verified (nor is a draft ``auto`` passed over for
another), so nothing would correct the estimates that cut it: on code edits, copies were cut at every
look once a few had failed, while the answers went on copying the prompt (auto between 0.96x and 1.14x
on the same prompts). The text the target writes next is what verification would have accepted (greedy:
its argmax; sampling: a deterministic draft is accepted where it equals the token sampled), so the cut
part is scored at no cost. Sampled drafts are not held: their acceptance is a draw against the draft's
probabilities. A branching tree is not held either: which branch the text took says nothing of the
others. What the scores teach is the scheduler's (``Scheduler._score_held``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .tree import TokenTree

MAX_HELD = 32   # drafts per proposer waiting for the text that scores them


@dataclass(slots=True)
class HeldDraft:
    """A labelled chain waiting for the text: how far would it have been accepted?"""

    start: int                  # the index in ``committed`` of its first token
    tokens: list[int]
    classes: list[str]
    verified: int = -1          # its first nodes verified in its own round (-1: none were)
    matched: int = 0            # its first tokens found equal to the text so far
    probe: bool = False         # an early look's: learned as a probe's once it matched a probe's length


class HeldDrafts:
    """Per proposer, its held drafts, oldest first, each matched against the text as it grows."""

    def __init__(self) -> None:
        self._waiting: dict[str, list[HeldDraft]] = {}

    def __contains__(self, source: str) -> bool:
        return source in self._waiting

    def waiting(self, source: str) -> list[HeldDraft]:
        return self._waiting.get(source, [])

    def clear(self) -> None:
        """A new request: its text scores none of the last one's drafts."""
        self._waiting.clear()

    def hold(self, source: str, tree: TokenTree, start: int, probe: bool = False) -> None:
        """Hold ``tree``, drafted at ``committed[start]``, if it is a labelled deterministic chain (the
        oldest of ``source``'s is dropped beyond MAX_HELD)."""
        if not tree.classes or tree.extras or tree.draft_probs or not tree.is_chain():
            return
        waiting = self._waiting.setdefault(source, [])
        if len(waiting) >= MAX_HELD:
            del waiting[0]
        waiting.append(HeldDraft(start, tree.tokens[1:], tree.node_classes(), probe=probe))

    def score(self, source: str, committed: Sequence[int], probe_length: int) -> list[tuple[HeldDraft, bool]]:
        """The drafts of ``source`` the text written since scores, in the order held: (draft, True) for
        one it decided (a token that differs, or the whole draft matched; no longer held), (draft, False)
        for an early look's that has just matched ``probe_length`` tokens (marked verified that far, as a
        verified probe's would be, and held on for the rest)."""
        scored: list[tuple[HeldDraft, bool]] = []
        keep = []
        for draft in self._waiting[source]:
            end = min(len(committed) - draft.start, len(draft.tokens))
            i = draft.matched
            while i < end and committed[draft.start + i] == draft.tokens[i]:
                i += 1
            draft.matched = i
            if i < end or i == len(draft.tokens):
                scored.append((draft, True))
                continue
            if draft.probe and draft.verified < 0 and i >= probe_length:
                draft.verified = probe_length
                scored.append((draft, False))
            keep.append(draft)
        if keep:
            self._waiting[source] = keep
        else:
            del self._waiting[source]
        return scored

    def verified(self, source: str, tree: TokenTree) -> None:
        """``source``'s latest held draft was verified as ``tree`` (its first nodes, or all of them: then
        nothing is left for the text to score)."""
        waiting = self._waiting.get(source)
        if not waiting or not tree.is_chain():
            return
        draft, k = waiting[-1], tree.n_candidates
        if draft.verified < 0 and draft.tokens[:k] == tree.tokens[1:]:
            if k >= len(draft.tokens):
                waiting.pop()
                if not waiting:
                    del self._waiting[source]
            else:
                draft.verified = k


__all__ = ["HeldDraft", "HeldDrafts", "MAX_HELD"]
