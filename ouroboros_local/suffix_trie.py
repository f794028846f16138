"""The suffix trie behind suffix drafting (``proposers/suffix.py``) and its global, persisted form.

``SuffixTrie`` keeps, for every substring of length <= ``depth`` (D, default 16) of a set of documents,
its number of occurrences, with one compression: a substring that occurs once is a *lazy leaf*, a node
that points at its occurrence in the text instead of holding children; it is split when a second
occurrence arrives. Appending a token touches only the suffixes of the text that occurred before (at
most D + 1 nodes), so the cost of a round does not grow with the context, and distinct text costs a few
nodes per token. Why D = 16: the match length only picks a node and a confidence class (its buckets end
at 8), drafts continue past depth D along the node's most recent occurrence, and both the per-token cost
and the worst-case memory (repetitive text materialises up to D + 1 nodes per token) grow linearly with D.

``Matcher`` follows the states that match the end of a token stream; ``SuffixCache`` holds earlier
requests' outputs in one trie, bounded by requests and tokens, with an atomic file format (tokenizer
fingerprint in the header).
"""

from __future__ import annotations

import heapq
import os
import struct
import threading
import zlib
from array import array
from collections import deque
from typing import Callable, Sequence

import numpy as np

from .filestore import DamagedStateError, check_fingerprint, check_token_ids, mergeable, read_checked, write_atomic

TRIE_DEPTH = 16
ROOT = 0


# ---- the trie -------------------------------------------------------------------------------------------

State = tuple[int, int, int]   # (trie node, -1, 0) or (-1, document, index of the next token in it)


class SuffixTrie:
    """Occurrence counts of every substring of length <= ``depth`` of a set of documents.

    Node fields live in flat arrays; edges in one dict keyed ``node << 32 | token``, children also in a
    doubly linked sibling list (for enumeration and O(1) removal). ``count`` is the number of
    occurrences of the node's string; ``total`` how many of them continue (the sum of the children's
    counts); ``doc``/``pos`` where the most recent continuing occurrence continues (for a lazy leaf, its
    only occurrence). A node with count 1 is a lazy leaf (no children), except the root.
    """

    def __init__(self, depth: int = TRIE_DEPTH):
        if not 1 <= depth <= 1024:
            raise ValueError(f"trie depth must be 1..1024 (got {depth})")
        self.depth = depth
        z = [0]
        self._count, self._total, self._depth = array("q", z), array("q", z), array("i", z)
        self._doc, self._pos, self._token = array("q", [-1]), array("q", z), array("q", [-1])
        self._first, self._next, self._prev = array("q", [-1]), array("q", [-1]), array("q", [-1])
        self._edges: dict[int, int] = {}
        self._free: list[int] = []
        self.docs: dict[int, list[int]] = {}
        self._next_doc = 0
        self._open: int | None = None
        self._active: list[int] = []   # nodes of the open document's repeated suffixes, depth 0, 1, ...

    # ---- sizes ------------------------------------------------------------------------------------
    @property
    def n_nodes(self) -> int:
        """Nodes in use, the root included."""
        return len(self._count) - len(self._free)

    @property
    def n_tokens(self) -> int:
        return sum(len(d) for d in self.docs.values())

    def count(self, tokens: Sequence[int]) -> int:
        """Occurrences of ``tokens`` (length 1..depth) in the documents (for tests and diagnostics)."""
        node = ROOT
        for j, tok in enumerate(tokens):
            if node != ROOT and self._count[node] == 1:
                doc, pos = self._doc[node], self._pos[node]
                text = self.docs.get(doc, [])
                rest = [int(t) for t in tokens[j:]]
                return 1 if text[pos:pos + len(rest)] == rest else 0
            child = self._edges.get(node << 32 | int(tok))
            if child is None:
                return 0
            node = child
        return int(self._count[node]) if node != ROOT else self.n_tokens

    def check(self) -> None:
        """Assert the structure's invariants (tests; O(nodes)): children's counts add up to ``total``,
        lazy leaves have no children, nothing is deeper than D, every live node is reachable once."""
        free = set(self._free)
        seen = 0
        stack = [ROOT]
        while stack:
            node = stack.pop()
            seen += 1
            kids = self.children(node)
            assert self._depth[node] <= self.depth
            if node != ROOT and self._count[node] == 1:
                assert not kids, f"lazy leaf {node} has children"
            assert sum(self._count[c] for c in kids) == self._total[node], f"node {node}: total"
            for c in kids:
                assert c not in free and self._count[c] >= 1
                assert self._edges[node << 32 | self._token[c]] == c
                assert self._depth[c] == self._depth[node] + 1
                stack.append(c)
        assert seen == self.n_nodes == len(self._edges) + 1, (seen, self.n_nodes, len(self._edges))

    # ---- nodes ------------------------------------------------------------------------------------
    def _new(self, parent: int, token: int, doc: int, pos: int) -> int:
        """A lazy leaf (count 1) below ``parent``, at the head of its sibling list."""
        sibling = self._first[parent]
        if self._free:
            node = self._free.pop()
            self._count[node], self._total[node], self._depth[node] = 1, 0, self._depth[parent] + 1
            self._doc[node], self._pos[node], self._token[node] = doc, pos, token
            self._first[node], self._next[node], self._prev[node] = -1, sibling, -1
        else:
            node = len(self._count)
            self._count.append(1)
            self._total.append(0)
            self._depth.append(self._depth[parent] + 1)
            self._doc.append(doc)
            self._pos.append(pos)
            self._token.append(token)
            self._first.append(-1)
            self._next.append(sibling)
            self._prev.append(-1)
        if sibling >= 0:
            self._prev[sibling] = node
        self._first[parent] = node
        self._edges[parent << 32 | token] = node
        return node

    def _delete(self, parent: int, node: int) -> None:
        nxt, prv = self._next[node], self._prev[node]
        if prv >= 0:
            self._next[prv] = nxt
        else:
            self._first[parent] = nxt
        if nxt >= 0:
            self._prev[nxt] = prv
        del self._edges[parent << 32 | self._token[node]]
        self._count[node] = 0
        self._free.append(node)

    def children(self, node: int) -> list[int]:
        out = []
        child = self._first[node]
        while child >= 0:
            out.append(child)
            child = self._next[child]
        return out

    def _split(self, node: int) -> None:
        """A lazy leaf gets a second occurrence: its first one becomes an explicit child."""
        doc, pos = self._doc[node], self._pos[node]
        text = self.docs.get(doc)
        if self._depth[node] < self.depth and text is not None and pos < len(text):
            self._new(node, text[pos], doc, pos + 1)
            self._total[node] = 1
        else:
            self._total[node] = 0

    # ---- documents --------------------------------------------------------------------------------
    def start_document(self) -> int:
        if self._open is not None:
            self.end_document()
        doc = self._next_doc
        self._next_doc += 1
        self.docs[doc] = []
        self._open = doc
        self._active = [ROOT]
        return doc

    def end_document(self) -> None:
        self._open = None
        self._active = []

    @property
    def open_document(self) -> list[int] | None:
        return None if self._open is None else self.docs[self._open]

    def extend(self, tokens: Sequence[int]) -> None:
        for tok in tokens:
            self.append(int(tok))

    def append(self, token: int) -> None:
        """Append one token to the open document: O(number of repeated suffixes) <= depth + 1."""
        doc = self._open
        if doc is None:
            doc = self.start_document()
        text = self.docs[doc]
        n = len(text)
        text.append(token)
        count, total, depth, pos, docs = self._count, self._total, self._depth, self._pos, self._doc
        edges, limit = self._edges, self.depth
        active = [ROOT]
        count[ROOT] += 1
        for node in self._active:
            # this occurrence of the node's string continues at n: the most recent continuing one
            pos[node] = n
            docs[node] = doc
            if depth[node] >= limit:
                continue
            total[node] += 1
            child = edges.get(node << 32 | token)
            if child is None:
                self._new(node, token, doc, n + 1)     # first occurrence: a lazy leaf
                continue
            if count[child] == 1:
                self._split(child)
            count[child] += 1
            active.append(child)
        self._active = active

    def active_states(self) -> list[State]:
        """The open document's repeated suffixes as match states, shortest first."""
        return [(node, -1, 0) for node in self._active]

    def remove_document(self, doc: int) -> None:
        """Forget a closed document (the oldest: pointers into it are then the only ones left)."""
        if doc == self._open:
            raise ValueError("cannot remove the open document")
        text = self.docs.get(doc)
        if text is None:
            return
        for start in range(len(text)):
            self._remove_occurrence(doc, text, start)
        del self.docs[doc]
        self._count[ROOT] -= len(text)
        self._total[ROOT] -= len(text)

    def _remove_occurrence(self, doc: int, text: list[int], start: int) -> None:
        count, depth = self._count, self._depth
        path = [ROOT]
        node = ROOT
        for j in range(start, min(len(text), start + self.depth)):
            if node != ROOT and (count[node] == 1 or depth[node] >= self.depth):
                break
            node = self._edges[node << 32 | text[j]]
            path.append(node)
        for i in range(len(path) - 1, 0, -1):
            node, parent = path[i], path[i - 1]
            count[node] -= 1
            if parent != ROOT:
                self._total[parent] -= 1
            if count[node] == 0:
                self._delete(parent, node)
                continue
            if self._doc[node] == doc:
                self._doc[node] = -1   # its most recent continuing occurrence was in the oldest document
            if count[node] == 1:
                # a lazy leaf again: its one occurrence continues at pos (if anywhere)
                for child in self.children(node):
                    self._delete(node, child)
                self._total[node] = 0

    def rebuild_from(self, documents: Sequence[Sequence[int]]) -> None:
        for tokens in documents:
            self.start_document()
            self.extend(tokens)
            self.end_document()

    # ---- matching and continuations --------------------------------------------------------------
    def step(self, state: State, token: int) -> State | None:
        """The state after ``token`` (None if the string plus ``token`` never occurred)."""
        node, doc, idx = state
        if node >= 0:
            if (node == ROOT or self._count[node] >= 2) and self._depth[node] < self.depth:
                child = self._edges.get(node << 32 | token)
                return None if child is None else (child, -1, 0)
            doc, idx = self._doc[node], self._pos[node]
        text = self.docs.get(doc)
        if text is not None and idx < len(text) and text[idx] == token:
            return (-1, doc, idx + 1)
        return None

    def continuations(self, state: State, k: int, tail: Callable[[], Sequence[int]] | None = None
                      ) -> list[tuple[int, float, int, State]]:
        """Up to ``k`` (token, frequency, support, next state) that followed ``state``, most frequent first.

        ``support`` is the number of continuing occurrences the frequency was counted over. Past a lazy
        leaf or depth D the continuation is the recorded occurrence's next token; a copy that runs into
        the end of the open document continues with ``tail()`` (the tokens drafted after the document's
        end), i.e. a match at distance d predicts a period-d repetition.
        """
        node, doc, idx = state
        if node >= 0:
            if (node == ROOT or self._count[node] >= 2) and self._depth[node] < self.depth:
                tot = self._total[node]
                if tot <= 0:
                    return []
                count = self._count
                kids = heapq.nlargest(k, self.children(node), key=count.__getitem__)
                return [(self._token[c], count[c] / tot, tot, (c, -1, 0)) for c in kids]
            doc, idx = self._doc[node], self._pos[node]
        text = self.docs.get(doc)
        if text is None:
            return []
        if idx < len(text):
            return [(text[idx], 1.0, 1, (-1, doc, idx + 1))]
        if doc == self._open and tail is not None:
            drafted = tail()
            if idx - len(text) < len(drafted):
                return [(int(drafted[idx - len(text)]), 1.0, 1, (-1, doc, idx + 1))]
        return []


class Matcher:
    """The states of a trie that match the end of a token stream, by match length 0, 1, ..., depth."""

    def __init__(self, trie: SuffixTrie):
        self.trie = trie
        self.states: list[State] = [(ROOT, -1, 0)]

    def push(self, token: int) -> None:
        trie = self.trie
        out: list[State] = [(ROOT, -1, 0)]
        for state in self.states[:trie.depth]:
            nxt = trie.step(state, token)
            if nxt is None:
                break      # a longer suffix can only match where this one does
            out.append(nxt)
        self.states = out


# ---- the global trie: earlier requests' outputs ---------------------------------------------------------

_MAGIC = b"OUROSFX1"
_VERSION = 1
# magic, version, fingerprint bytes, documents, tokens, crc32 of the payload
_HEADER = struct.Struct("<8sIIQQI")


class SuffixCache:
    """Earlier requests' outputs in one trie, at most ``max_requests`` of them and ``max_tokens`` tokens
    (oldest evicted first). Thread-safe; ``version`` changes whenever the trie does."""

    def __init__(self, max_requests: int = 256, max_tokens: int = 65_536, depth: int = TRIE_DEPTH):
        self.trie = SuffixTrie(depth)
        self.max_requests = max_requests
        self.max_tokens = max_tokens
        self._order: deque[int] = deque()
        self._tokens = 0
        self.version = 0
        self.lock = threading.RLock()

    @property
    def n_requests(self) -> int:
        return len(self._order)

    @property
    def n_tokens(self) -> int:
        return self._tokens

    @property
    def n_nodes(self) -> int:
        return self.trie.n_nodes

    def documents(self) -> list[list[int]]:
        with self.lock:
            return [list(self.trie.docs[d]) for d in self._order]

    def grow_limits(self, max_requests: int, max_tokens: int) -> None:
        """Raise the limits to at least these (never cut what a run with larger ones kept)."""
        with self.lock:
            self.max_requests = max(self.max_requests, max_requests)
            self.max_tokens = max(self.max_tokens, max_tokens)

    def add(self, tokens: Sequence[int]) -> None:
        """Remember one request's output (its last ``max_tokens`` tokens if longer)."""
        tokens = [int(t) for t in tokens[max(0, len(tokens) - self.max_tokens):]]
        if not tokens:
            return
        with self.lock:
            doc = self.trie.start_document()
            self.trie.extend(tokens)
            self.trie.end_document()
            self._order.append(doc)
            self._tokens += len(tokens)
            self._evict()
            self.version += 1

    def _evict(self) -> None:
        while self._order and (len(self._order) > self.max_requests or self._tokens > self.max_tokens):
            doc = self._order.popleft()
            self._tokens -= len(self.trie.docs[doc])
            self.trie.remove_document(doc)
            self.version += 1

    # ---- persistence ------------------------------------------------------------------------------
    def save(self, path: str | os.PathLike[str], fingerprint: str) -> None:
        """Write the documents atomically (temp file + os.replace): an interrupted save keeps the old file."""
        _write_documents(path, fingerprint, self.documents())

    def save_merged(self, path: str | os.PathLike[str], fingerprint: str, n_vocab: int | None = None) -> None:
        """``save``, keeping the documents another process saved to ``path`` meanwhile as the oldest (the
        limits hold, grown to what the file holds as at ``load``: the newest are kept). This trie itself is
        left as it is; a damaged file is moved aside and replaced, another tokenizer's or another kind of
        file is refused with a PoolError (``mergeable``)."""
        theirs = mergeable(lambda: read_documents(path, fingerprint, n_vocab), "suffix history", path) or []
        ours = self.documents()
        known = {tuple(doc) for doc in ours}
        docs = [doc for doc in theirs if tuple(doc) not in known] + ours
        max_requests = max(self.max_requests, len(theirs))
        max_tokens = max(self.max_tokens, sum(len(doc) for doc in theirs))
        kept, n_tokens = 0, 0
        for doc in reversed(docs):   # the newest that fit the limits
            if kept == max_requests or n_tokens + len(doc) > max_tokens:
                break
            kept, n_tokens = kept + 1, n_tokens + len(doc)
        _write_documents(path, fingerprint, docs[len(docs) - kept:])

    @classmethod
    def load(cls, path: str | os.PathLike[str], fingerprint: str, max_requests: int = 256,
             max_tokens: int = 65_536, depth: int = TRIE_DEPTH, n_vocab: int | None = None) -> "SuffixCache":
        """Read a saved history; another tokenizer's file or a damaged one (token ids of ``n_vocab`` or
        more included) raises PoolError (one line). The limits grow to hold all of it: a run with smaller
        ones (the defaults) must not cut a history that larger ones built."""
        docs = read_documents(path, fingerprint, n_vocab)
        cache = cls(max_requests=max(max_requests, len(docs)),
                    max_tokens=max(max_tokens, sum(len(doc) for doc in docs)), depth=depth)
        for doc in docs:
            cache.add(doc)
        return cache


def _write_documents(path: str | os.PathLike[str], fingerprint: str, docs: list[list[int]]) -> None:
    lengths = np.array([len(d) for d in docs], dtype="<i4")
    tokens = np.fromiter((t for d in docs for t in d), dtype="<i4", count=int(lengths.sum()))
    payload = lengths.tobytes() + tokens.tobytes()
    fp = fingerprint.encode("utf-8")
    header = _HEADER.pack(_MAGIC, _VERSION, len(fp), len(docs), len(tokens), zlib.crc32(payload))
    write_atomic(path, header + fp + payload, "suffix history")


def read_documents(path: str | os.PathLike[str], fingerprint: str, n_vocab: int | None = None) -> list[list[int]]:
    """The documents of a saved history, oldest first (PoolError as ``SuffixCache.load``)."""
    target, (fp_len, n_docs, n_tokens, crc), body = read_checked(path, _MAGIC, _VERSION, _HEADER,
                                                                 "suffix history")
    payload = check_fingerprint(target, body, fp_len, fingerprint, "history")
    if len(payload) != 4 * (n_docs + n_tokens) or zlib.crc32(payload) != crc:
        raise DamagedStateError(f"{target} is truncated or corrupt")
    arr = np.frombuffer(payload, dtype="<i4")
    lengths = arr[:n_docs]
    if (lengths < 0).any() or int(lengths.sum()) != n_tokens:
        raise DamagedStateError(f"{target} is corrupt (inconsistent document lengths)")
    check_token_ids(target, arr[n_docs:], n_vocab)
    tokens = arr[n_docs:].tolist()
    ends = np.cumsum(lengths).tolist()
    return [tokens[end - length:end] for end, length in zip(ends, lengths.tolist())]


def save_global(cache: SuffixCache, path: str | os.PathLike[str], fingerprint: str) -> None:
    """Persist the global trie's documents (see ``SuffixCache.save``)."""
    cache.save(path, fingerprint)


def load_global(path: str | os.PathLike[str], fingerprint: str, max_requests: int = 256,
                max_tokens: int = 65_536, n_vocab: int | None = None) -> SuffixCache:
    """A global trie read from ``path`` (see ``SuffixCache.load``)."""
    return SuffixCache.load(path, fingerprint, max_requests=max_requests, max_tokens=max_tokens,
                            n_vocab=n_vocab)


__all__ = ["ROOT", "TRIE_DEPTH", "Matcher", "State", "SuffixCache", "SuffixTrie", "load_global",
           "save_global"]
