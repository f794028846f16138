"""Suffix drafting (SuffixDecoding, Oliaro et al., NeurIPS 2025): frequency-scored trees from suffix tries.

Two tries answer "what followed the most recent tokens before, and how often?":

* a per-request trie over the prompt and the output so far, grown as tokens are committed;
* a global trie over the outputs of earlier requests (each after its prompt's last D tokens, so that
  a repeated request matches from its first output token), kept per engine (``History.suffix_cache``) so that
  a server's requests share it, bounded by requests and tokens (the oldest request is evicted first),
  and optionally persisted to a file (tokenizer fingerprint in the header, atomic save).

Each round the deepest node that matches the end of the committed text (the longest match, at least
``min_match`` tokens) is looked up in both tries; below it, continuations are scored by how often they
followed (count of the child / continuing occurrences of the node) and a tree is grown best-first by the
product of those frequencies along the path, its size growing with the match length
(``spec_factor * match + spec_offset`` nodes, capped by the budget). Of the two trees the one with the
larger expected number of accepted tokens (the sum of its path frequencies) is proposed.

The tries themselves (``SuffixTrie``, ``Matcher``, the global ``SuffixCache`` and its file format) are
in ``suffix_trie.py``.

Nodes are deterministic proposals (no draft distribution), so sampling verification uses
sample-and-match and every output equals the target's own.
"""

from __future__ import annotations

import heapq
import time
from typing import TYPE_CHECKING, Any, Sequence

from .. import options as opt
from ..history import History, resolve_pool_path
from ..pool import continues
from ..suffix_trie import TRIE_DEPTH, Matcher, State, SuffixCache, SuffixTrie, load_global
from ..tree import TokenTree
from . import check_options
from .base import DraftingContext, ProposeSetup, Proposer

if TYPE_CHECKING:  # pragma: no cover
    from ..verify import VerifyResult

OPTIONS: tuple[opt.Option, ...] = (
    opt.Option("max_depth", "int", 16, "suffix: longest draft path", 1, 64, flag=False),
    opt.Option("max_branches", "int", 4, "suffix: leaf paths per tree", 1, 16, flag=False),
    opt.Option("min_match", "int", 2, "suffix: shortest match that drafts", 1, TRIE_DEPTH, flag=False),
    # the global trie's bounds hold for every request: one request must neither evict the others' history
    # (max_requests 1) nor let the trie grow to gigabytes (10M tokens, up to 17 nodes each)
    opt.Option("max_requests", "int", 256, "suffix: requests kept in the global trie", 1, 100_000, flag=False,
               per_request=False),
    opt.Option("max_tokens", "int", 65_536, "suffix: output tokens kept in the global trie", 1, 10_000_000,
               flag=False, per_request=False),
    opt.Option("spec_factor", "float", 1.0, "suffix: tree nodes per matched token", 0.0, 64.0, flag=False),
    opt.Option("spec_offset", "int", 4, "suffix: tree nodes added to that", 0, 64, flag=False),
    opt.Option("min_prob", "float", 0.1, "suffix: least path frequency drafted", 0.0, 1.0, flag=False),
    opt.POOL, opt.ADAPTIVE)


class _Context:
    """A request's own trie and the tokens it holds, kept by the engine for the next call."""

    def __init__(self) -> None:
        self.trie: SuffixTrie | None = None
        self.seen: list[int] = []
        self.in_use = False   # by a proposer between its begin and end


def shared_cache(history: History, max_requests: int, max_tokens: int, path: str | None) -> SuffixCache:
    """The engine's global trie (``history.suffix_cache``), loaded from ``path`` the first time that file
    is named and exists; its limits only grow, to the largest asked for or held in the file."""
    cache = history.reload(history.suffix_cache, history.suffix_file, path,
                           lambda p, fingerprint, n_vocab: load_global(p, fingerprint, max_requests, max_tokens,
                                                                      n_vocab))
    if cache is None:
        cache = SuffixCache(max_requests, max_tokens)
    if path is not None:
        history.persist(path, cache)   # raises before any change (a folder it cannot write)
        history.move(history.suffix_file, path)
        history.suffix_file = path
    cache.grow_limits(max_requests, max_tokens)
    history.suffix_cache = cache
    return cache


# ---- drafting -----------------------------------------------------------------------------------------

def _bucket(value: int, bounds: Sequence[int]) -> int:
    for i, bound in enumerate(bounds):
        if value <= bound:
            return i + 1
    return len(bounds) + 1


def node_class(match: int, frequency: float, support: int, depth: int, opening: bool = False) -> str:
    """Confidence class of a drafted node: match length (<=3, 4-7, 8+; "p" where the match is an
    answer's opening, ``SuffixProposer._opening``), how often its token followed (f0 < 1/2 <= f1 < 1;
    f2: the one earlier occurrence, or a copy past the trie; f3: all of >= 2 occurrences agree) and
    depth (1, 2-3, 4+): 72 classes."""
    if frequency >= 1.0:
        f = 3 if support >= 2 else 2
    else:
        f = 1 if frequency >= 0.5 else 0
    return f"sx m{_bucket(match, (3, 7))}{'p' if opening else ''} f{f} d{_bucket(depth, (1, 3))}"


def grow_tree(tree: TokenTree, trie: SuffixTrie, anchor: State, match: int, max_nodes: int, max_depth: int,
              max_leaves: int, min_prob: float, eog: frozenset[int], open_tail: bool,
              opening: bool = False) -> float:
    """Hang the continuations of ``anchor`` below the root, best path frequency first (SuffixDecoding's
    greedy tree expansion). Returns the tree's expected accepted tokens (sum of path frequencies)."""
    score = 0.0
    leaves = 1
    has_child: set[int] = set()
    heap: list[tuple[float, int, int, int, float, int, State]] = []
    seq = 0

    def push(parent: int, prob: float, state: State) -> None:
        nonlocal seq
        tail = (lambda: [tree.tokens[i] for i in tree.path_to(parent)[1:]]) if open_tail else None
        for token, freq, support, nxt in trie.continuations(state, max_leaves, tail):
            p = prob * freq
            if p >= min_prob:
                seq += 1
                heapq.heappush(heap, (-p, seq, parent, token, freq, support, nxt))

    push(0, 1.0, anchor)
    while heap and tree.n_candidates < max_nodes:
        neg_p, _, parent, token, freq, support, state = heapq.heappop(heap)
        if parent in has_child:
            if leaves >= max_leaves:
                continue
            leaves += 1
        has_child.add(parent)
        node = tree.add(parent, token, source="suffix")
        depth = tree.depths[node]
        tree.classes[node] = node_class(match, freq, support, depth, opening)
        score -= neg_p
        if token not in eog and depth < max_depth:
            push(node, -neg_p, state)
    return score


class SuffixProposer(Proposer):
    """Frequency-scored draft trees from a per-request and a global suffix trie (module docstring)."""

    name = "suffix"
    adaptive = True              # best-first: the likeliest path first, so small budgets stay sensible
    confidence_classes = True
    free_drafts = True
    drafts_ahead = True

    def __init__(self, cache: SuffixCache | None = None, *, max_depth: int = 16, max_branches: int = 4,
                 min_match: int = 2, spec_factor: float = 1.0, spec_offset: int = 4, min_prob: float = 0.1,
                 history: History | None = None):
        """``history``: the engine's, which keeps this request's trie for the next call, which continues it
        where it continues its text (``History.context_index``)."""
        self.cache = cache if cache is not None else SuffixCache()
        self.max_depth = max_depth
        self.max_branches = max_branches
        self.min_match = min_match
        # the tree's size: at most spec_factor * match + spec_offset nodes, none below min_prob
        self.spec_factor, self.spec_offset, self.min_prob = spec_factor, spec_offset, min_prob
        depth = self.cache.trie.depth
        self._context = _Context() if history is None else history.context_index(("suffix", depth), _Context)
        self.local = SuffixTrie(depth)
        self.matcher = Matcher(self.cache.trie)
        self._seen: list[int] = []
        self._prompt_len = 0
        self._live: list[int] | None = None
        self._version = -1
        self._stats = self._fresh_stats()

    @staticmethod
    def _fresh_stats() -> dict[str, int]:
        return {"proposals": 0, "local": 0, "global": 0, "nodes": 0, "match_tokens": 0}

    def begin(self, prompt: Sequence[int], setup: ProposeSetup) -> None:
        super().begin(prompt, setup)
        # The engine passes its committed list and extends it in place; reading it at end() lets the
        # last round's tokens (after which observe is not called) reach the global trie too.
        self._live = prompt if isinstance(prompt, list) else None
        self._prompt_len = len(prompt)
        self._stats = self._fresh_stats()
        if self._context.in_use:   # another proposer of this call grows it: this one keeps its own
            self._context = _Context()
        kept = self._context
        kept.in_use = True
        if kept.trie is not None and kept.seen and continues(prompt, kept.seen):   # (kept per depth)
            self.local, self._seen = kept.trie, kept.seen   # the trie a fresh build would make, less the work
            self._extend_local_only(prompt[len(kept.seen):])
            self._rematch()
        else:
            self._restart(prompt)

    def _restart(self, committed: Sequence[int]) -> None:
        self.local = SuffixTrie(self.cache.trie.depth)
        self.local.start_document()
        self._seen = []
        self._context.trie, self._context.seen = self.local, self._seen
        self._extend_local_only(committed)
        self._rematch()

    def _rematch(self) -> None:
        # the global trie changed (another request ended): match the recent tokens again
        with self.cache.lock:
            self.matcher = Matcher(self.cache.trie)
            for tok in self._seen[-self.cache.trie.depth:]:
                self.matcher.push(tok)
            self._version = self.cache.version

    def _sync(self, committed: Sequence[int]) -> None:
        """Catch up on ``committed`` (any number of new tokens: rounds that did not ask this proposer)."""
        have = len(self._seen)
        if have > len(committed) or (have and int(committed[have - 1]) != self._seen[-1]):
            self._restart(committed)
            return
        new = committed[have:]
        self._extend_local_only(new)
        if self._version != self.cache.version or len(new) > self.cache.trie.depth:
            self._rematch()            # only the last depth tokens decide the match states
        else:
            for tok in new:
                self.matcher.push(int(tok))

    def _extend_local_only(self, tokens: Sequence[int]) -> None:
        try:
            for tok in tokens:
                self.local.append(int(tok))
                self._seen.append(int(tok))
        except BaseException:   # a Ctrl-C midway: the trie may hold a token _seen does not; the next call
            self._context.trie, self._context.seen = None, []   # builds afresh, not on a damaged one
            raise

    def _candidate(self, trie: SuffixTrie, states: list[State], budget: int, root: int,
                   is_global: bool) -> tuple[float, int, TokenTree] | None:
        """The tree from the longest match (>= min_match) that has a continuation."""
        found = self._longest_match(trie, states)
        if found is None:
            return None
        match = found[0]
        max_leaves = max(1, min(self.max_branches, self.setup.max_branches))
        limit = min(budget, max(1, int(self.spec_factor * match) + self.spec_offset))
        tree = TokenTree.rooted_at(root)
        score = grow_tree(tree, trie, states[match], match, limit, self.max_depth, max_leaves,
                          self.min_prob, self.setup.eog_tokens, open_tail=not is_global,
                          opening=is_global and self._opening(match))
        return (score, match, tree) if tree.n_candidates else None

    def _opening(self, match: int) -> bool:
        """Is a global match of ``match`` tokens an answer's opening: one that reaches back into this
        prompt without filling the trie's window or the whole text, as a repeated request does? The
        global trie keeps each answer after its prompt's last D tokens, and prompts end alike (the chat
        template's turn markers, often an instruction or a question mark), so such a match says that
        answers open alike, which holds for some texts (code edits' "Here is the rewritten function")
        and not others: on gsm8k, ~10-token matches of markers and an answer's first words were drafted
        12-15 tokens deep as long copies are, expected to keep 8-10 tokens, and kept 0-2. Their own
        classes learn which."""
        return len(self._seen) - self._prompt_len < match < min(self.cache.trie.depth, len(self._seen))

    def _longest_match(self, trie: SuffixTrie, states: list[State]
                       ) -> tuple[int, tuple[int, float, int, State]] | None:
        """The longest match (>= min_match) that has a continuation, and its most frequent one."""
        for match in range(len(states) - 1, self.min_match - 1, -1):
            top = trie.continuations(states[match], 1)
            if top:
                return match, top[0]
        return None

    def first_class(self, committed: Sequence[int]) -> str | None:
        """The class of the first node of the longer, then more frequent, of the two tries' heads (the
        proposal picks between their grown trees); "" when neither has one. The catch-up on the rounds
        since the tries were last asked is timed apart, as in ``propose``."""
        t0 = time.perf_counter()
        self._sync(committed)
        self.catch_up_seconds = time.perf_counter() - t0
        head = self._head(self.local, self.local.active_states())
        opening = False
        with self.cache.lock:
            glob = self._head(self.cache.trie, self.matcher.states)
        if glob is not None and (head is None or glob > head):
            head, opening = glob, self._opening(glob[0])
        return "" if head is None else node_class(*head, 1, opening)

    def _head(self, trie: SuffixTrie, states: list[State]) -> tuple[int, float, int] | None:
        """(match, frequency, support) of the first node ``_candidate`` would draft from ``trie``."""
        found = self._longest_match(trie, states)
        if found is None:
            return None
        match, (_, frequency, support, _) = found
        return (match, frequency, support) if frequency >= self.min_prob else None

    def propose(self, committed: Sequence[int], budget: int) -> TokenTree:
        self.catch_up_seconds = 0.0
        budget = min(budget, self.setup.max_tree_nodes)
        if budget <= 0:
            return TokenTree.rooted_at(committed[-1])
        # the rounds since it was last asked (observe is lazy): timed apart, so that the scheduler does
        # not take their trie work for what drafting costs (a probe after 100 idle rounds looked ~100x dearer)
        t0 = time.perf_counter()
        self._sync(committed)
        self.catch_up_seconds = time.perf_counter() - t0
        root = int(committed[-1])
        local = self._candidate(self.local, self.local.active_states(), budget, root, is_global=False)
        with self.cache.lock:
            glob = self._candidate(self.cache.trie, self.matcher.states, budget, root, is_global=True)
        best, kind = local, "local"
        if glob is not None and (best is None or glob[:2] > best[:2]):
            best, kind = glob, "global"
        if best is None:
            return TokenTree.rooted_at(root)
        _, match, tree = best
        self._stats["proposals"] += 1
        self._stats[kind] += 1
        self._stats["nodes"] += tree.n_candidates
        self._stats["match_tokens"] += match
        return tree

    def observe(self, committed: Sequence[int], result: "VerifyResult") -> None:
        # Lazy: propose() and end() catch up on the engine's committed list (``_live``), so rounds that
        # do not ask this proposer (most of auto's, where nothing pays) cost it nothing; the match
        # states are then rebuilt from the last depth tokens instead of stepped through every token.
        if self._live is None:
            self._sync(committed)

    def end(self) -> None:
        live, have = self._live, len(self._seen)
        try:
            if live is not None and len(live) > have and (not have or live[have - 1] == self._seen[-1]):
                self._extend_local_only(live[have:])
        finally:   # (a Ctrl-C here left it in use: no later call would have continued it)
            self._context.in_use = False
        self._live = None
        if len(self._seen) > self._prompt_len:
            # the output, after the prompt's last D tokens: a repeated request is drafted from its first token
            start = max(0, self._prompt_len - self.cache.trie.depth)
            self.cache.add(self._seen[start:])

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {"sx_" + k: v for k, v in self._stats.items()}
        out.update(sx_global_requests=self.cache.n_requests, sx_global_tokens=self.cache.n_tokens,
                   sx_global_nodes=self.cache.n_nodes, sx_local_nodes=self.local.n_nodes)
        return out


def suffix_file(pool_file: str) -> str:
    """Where the global trie of history file ``pool_file`` lives (the phrase pool keeps ``pool_file``)."""
    return pool_file + ".suffix"


def create(ctx: DraftingContext, options: dict[str, Any]) -> Proposer:
    """``options``: checked against ``OPTIONS``; a ``pool`` file keeps the global trie in ``FILE.suffix``
    (the engine saves it after each answer, see History.save)."""
    history = ctx.history
    belongs_to = history.suffix_file.removesuffix(".suffix") if history.suffix_file is not None else None

    def open_trie(path: str | None) -> SuffixCache:
        if path is not None:
            history.check_pool_file(path)
        return shared_cache(history, options["max_requests"], options["max_tokens"],
                            suffix_file(path) if path is not None else None)

    cache = history.open_store("suffix trie", resolve_pool_path(options["pool"]), belongs_to, open_trie)
    return SuffixProposer(cache, max_depth=options["max_depth"], max_branches=options["max_branches"],
                          min_match=options["min_match"], spec_factor=options["spec_factor"],
                          spec_offset=options["spec_offset"], min_prob=options["min_prob"], history=history)


def earlier_answers(ctx: DraftingContext, pool: str | None) -> Proposer:
    """The suffix tries of this request and earlier answers as a candidate of a proposer that picks per
    round (``auto``, scheduled ``ouroboros``): one branch, which the scheduler trims by confidence class
    like any chain (a tree it cannot trim lost up to 12% on a fast target, SmolLM2 on 2 cores); ``pool``
    the history file, kept in ``pool``.suffix."""
    return create(ctx, check_options("suffix", {"pool": pool, "max_branches": 1}))


__all__ = ["OPTIONS", "SuffixProposer", "create", "earlier_answers", "grow_tree", "node_class", "shared_cache",
           "suffix_file"]
