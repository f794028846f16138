"""Prompt lookup: draft by copying what followed an earlier occurrence of the last few tokens.

Matches the last n committed tokens (n from ``max_ngram`` down to ``min_ngram``) against earlier
positions of the prompt and the output, as llama.cpp's ngram-simple and ``lookup`` do; among the
positions of one n-gram, the match that extends furthest back comes first (then the most recent), and
how far it extends labels the copy's confidence class. An n-gram -> positions index is updated
incrementally as tokens are committed, so a step costs O(max_ngram) dictionary lookups instead of a
scan of the context. A shared ``PhrasePool`` (phrases
from earlier requests, like llama.cpp's "dynamic cache": docs/design.md#prompt-lookup) is consulted after
the context.

Nodes are deterministic, so sampling verification uses sample-and-match (the verifier handles that).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterator, Sequence

from .. import options as opt
from ..drafting import cut_at_eog, hang_phrases
from ..errors import ParameterError
from ..history import History
from ..pool import PhrasePool, continues
from ..tree import TokenTree
from .base import DraftingContext, Proposer, ProposeSetup

if TYPE_CHECKING:  # pragma: no cover
    from ..verify import VerifyResult


class NgramIndex:
    """n-gram (min_n..max_n tokens) -> positions where it ends, most recent last, for a growing sequence."""

    def __init__(self, min_n: int, max_n: int, max_positions: int = 4):
        self.min_n = min_n
        self.max_n = max_n
        self.max_positions = max_positions
        self.tokens: list[int] = []
        self._maps: dict[int, dict[tuple[int, ...], list[int]]] = {n: {} for n in range(min_n, max_n + 1)}
        self._indexed = 0   # n-grams ending before this position are indexed

    def follow(self, prompt: Sequence[int]) -> None:
        """Index a new generation's prompt: from where the indexed text ends, where the prompt continues it
        (a chat's next turn), else from scratch. Either way, the index a fresh build would make."""
        if not continues(prompt, self.tokens):
            self.reset()
        self.sync(prompt)

    def reset(self) -> None:
        self.tokens = []
        for m in self._maps.values():
            m.clear()
        self._indexed = 0

    def sync(self, committed: Sequence[int]) -> None:
        """Follow ``committed``: extend if it grew, rebuild if it is not a continuation."""
        have = len(self.tokens)
        if have > len(committed) or (have and int(committed[have - 1]) != self.tokens[-1]):
            self.reset()
            have = 0
        if len(committed) > have:
            self.tokens.extend(int(t) for t in committed[have:])
        try:
            self._index_new()
        except BaseException:   # a Ctrl-C midway: indexed again, the n-grams would count twice (kept for
            self.reset()        # the next call, the index stayed so for the rest of a chat)
            raise

    def _index_new(self) -> None:
        # Index every n-gram that has at least one following token (so it can be copied from).
        toks = self.tokens
        cap = self.max_positions
        for end in range(self._indexed, len(toks) - 1):
            for n, m in self._maps.items():
                if end + 1 < n:
                    continue
                key = tuple(toks[end + 1 - n:end + 1])
                positions = m.get(key)
                if positions is None:
                    m[key] = [end]
                else:
                    positions.append(end)
                    if len(positions) > cap:
                        del positions[0]
        self._indexed = max(self._indexed, len(toks) - 1)

    def continuations(self, length: int) -> Iterator[tuple[int, list[int]]]:
        """(match length, tokens that followed a match) for the current suffix: longest n first; among
        the positions of one n-gram, the longest match (extended back up to MATCH_CAP), most recent first.

        When a copy reaches the end of the sequence it continues with its own tokens (a match at distance
        d predicts a period-d repetition), so repetitive text gets full-length drafts.
        """
        toks = self.tokens
        total = len(toks)
        done: set[int] = set()   # a position found by a longer n-gram is found again by each shorter one
        for n in range(self.max_n, self.min_n - 1, -1):
            if total < n + 1:
                continue
            found = self._maps[n].get(tuple(toks[total - n:]))
            if not found:
                continue
            ends = [end for end in found if end not in done]
            done.update(ends)
            for m, end in sorted(((self._extend(end, n), end) for end in ends), reverse=True):
                start = end + 1
                out = toks[start:start + length]
                while len(out) < length:   # past the end: the period total - start repeats
                    out.append(out[len(out) - (total - start)])
                yield m, out

    def _extend(self, end: int, n: int) -> int:
        """How many tokens before ``end`` (inclusive) equal the sequence's last ones (at least n)."""
        toks = self.tokens
        last = len(toks) - 1
        m = n
        while m < MATCH_CAP and end - m >= 0 and toks[end - m] == toks[last - m]:
            m += 1
        return m


MATCH_CAP = 16   # a match is extended back this far at most: 16 tokens and more is one class


def match_class(length: int) -> str:
    """The confidence class of a copy whose match is ``length`` tokens long: 1, 2, 3, 4-7, 8-15, 16+."""
    if length <= 3:
        return f"ctx{length}"
    return "ctx4" if length < 8 else "ctx8" if length < 16 else "ctx16"


class PromptLookupProposer(Proposer):
    """Draft-free drafting from the context (and optionally a shared phrase pool)."""

    name = "prompt-lookup"
    adaptive = True  # a chain (or shallow tree) first: the engine may cap its length by the cost model
    confidence_classes = True
    free_drafts = True
    drafts_ahead = True

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, gamma: int = 16, max_branches: int = 1,
                 pool: PhrasePool | None = None, feed_pool: bool = True, max_positions: int = 4,
                 history: History | None = None):
        """``history``: the engine's, which keeps the index for the next call (``History.context_index``)."""
        if not 1 <= min_ngram <= max_ngram:   # each bound alone is checked with the options (options.py)
            raise ParameterError(f"need 1 <= min_ngram <= max_ngram (got {min_ngram}, {max_ngram})")
        self.gamma = gamma
        self.max_branches = max_branches
        self.pool = pool
        self.feed_pool = feed_pool
        shape = (min_ngram, max_ngram, max(max_positions, max_branches))
        self.index = NgramIndex(*shape) if history is None else \
            history.context_index(("prompt-lookup", *shape), lambda: NgramIndex(*shape))
        self._fed = 0
        self._stats = {"proposals": 0, "context_phrases": 0, "pool_phrases": 0}

    def begin(self, prompt: Sequence[int], setup: ProposeSetup) -> None:
        super().begin(prompt, setup)
        self.index.follow(prompt)
        # an earlier call's text this one continues (a chat's earlier turns) is in the pool already
        feeds = self.pool is not None and self.feed_pool
        self._fed = self.pool.fed_before(prompt, self.pool.phrase_len + 1) if feeds else 0
        self._feed(prompt)
        self._stats = {"proposals": 0, "context_phrases": 0, "pool_phrases": 0}

    def _feed(self, committed: Sequence[int]) -> None:
        # Grow the shared pool with the n-grams of new committed text: the history future requests use.
        if self.pool is not None and self.feed_pool:
            self.pool.add_ngrams(committed, self.pool.phrase_len + 1, start=self._fed)
            self._fed = len(committed)

    def _phrases(self, committed: Sequence[int], seen: list[tuple[list[int], str]] | None = None
                 ) -> Iterator[tuple[list[int], str]]:
        """Candidate phrases, best first; each one's confidence class prefix goes to ``seen``."""
        eog = self.setup.eog_tokens
        for length, cont in self.index.continuations(self.gamma):
            phrase = cut_at_eog(cont, eog)
            if seen is not None:
                seen.append((phrase, match_class(length)))
            yield phrase, "prompt-lookup"
        if self.pool is not None:
            for phrase in self.pool.lookup(committed, k=max(self.max_branches, 2), max_len=POOL_PHRASE_LEN):
                phrase = cut_at_eog(phrase[:self.gamma], eog)
                if seen is not None:
                    seen.append((phrase, "pool"))
                yield phrase, "pool"

    def first_class(self, committed: Sequence[int]) -> str | None:
        """The class of the longest copy's first node (``label_chain``); "" when nothing is copyable."""
        self.index.sync(committed)
        for length, _ in self.index.continuations(1):
            return f"{match_class(length)}d1"
        return None if self.pool is not None else ""   # a pool's phrases: only a proposal tells

    def propose(self, committed: Sequence[int], budget: int) -> TokenTree:
        tree = TokenTree.rooted_at(committed[-1])
        max_nodes = min(budget, self.setup.max_tree_nodes)
        if max_nodes <= 0:
            return tree
        self.index.sync(committed)
        max_leaves = max(1, min(self.max_branches, self.setup.max_branches))
        seen: list[tuple[list[int], str]] = []
        hang_phrases(tree, 0, self._phrases(committed, seen), max_nodes, max_leaves, stop_after_skips=3)
        if tree.n_candidates and tree.is_chain():
            label_chain(tree, seen)
        if tree.n_candidates:
            self._stats["proposals"] += 1
            for src in tree.sources.values():
                key = "pool_phrases" if src == "pool" else "context_phrases"
                self._stats[key] += 1
        return tree

    def observe(self, committed: Sequence[int], result: "VerifyResult") -> None:
        # the index catches up when asked (``propose``): under a scheduler most rounds do not ask, and
        # indexing each token as it came cost 20 µs a round in a real run (cold caches), 0.25% of a
        # SmolLM2 step; the shared pool is fed at once, for the readers of the pool
        self._feed(committed)

    def stats(self) -> dict[str, Any]:
        # node counts per source ("*_phrases" count drafted nodes from each source)
        return {"pl_" + k: v for k, v in self._stats.items()}


def label_chain(tree: TokenTree, phrases: Sequence[tuple[Sequence[int], str]]) -> None:
    """Class of each chain node: the kind of the first phrase that reaches it (context copies by how
    far their match extends back: after a 4-token match a copy is right far more often than after a
    1-token one) and its depth (a copy that was right so far tends to stay right)."""
    chain = tree.tokens[1:]
    for depth in range(1, len(chain) + 1):
        for phrase, kind in phrases:
            if len(phrase) >= depth and list(phrase[:depth]) == chain[:depth]:
                tree.classes[depth] = f"{kind}d{min(depth, 4)}"
                break


OPTIONS: tuple[opt.Option, ...] = (opt.MAX_NGRAM, opt.MIN_NGRAM, opt.GAMMA, opt.MAX_BRANCHES,
                                   opt.POOL, opt.FEED_POOL, opt.ADAPTIVE)
DEFAULT_GAMMA = 16
POOL_PHRASE_LEN = 4   # phrases kept per key in the history pool when prompt lookup reads it
POOL_PER_KEY = 8


def create(ctx: DraftingContext, options: dict[str, Any], named_history: bool = False) -> Proposer:
    """``options``: checked against ``OPTIONS``. A pool file makes the engine's history pool a source;
    ``named_history`` (auto's): so does the file an earlier call named (``History.named_file``)."""
    pool = None
    if options["pool"] is not None or (named_history and ctx.history.named_file is not None):
        pool = ctx.history.pool(POOL_PHRASE_LEN, POOL_PER_KEY, options["pool"])
    return PromptLookupProposer(max_ngram=options["max_ngram"], min_ngram=options["min_ngram"],
                                gamma=options["gamma"] or DEFAULT_GAMMA, max_branches=options["max_branches"],
                                pool=pool, feed_pool=options["feed_pool"], history=ctx.history)
