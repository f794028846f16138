"""Phrase pool: key (the last ``key_len`` tokens) -> a short LRU list of phrases that followed it.

The structure Ouroboros' ``CacheEngine`` and LADE's token map share (docs/design.md#phrase-pool): per key
a de-duplicated list of token tuples, most recent last; adding a phrase that is already there moves it to
the end; a full list drops its oldest entry. On top of that the pool is bounded globally (``max_tokens``)
by evicting the least recently used key's oldest phrase, so a long-lived server pool cannot grow without
bound, and it can be saved and loaded (warm start across processes, docs/design.md#warm-start) with the
tokenizer's fingerprint in the header.

Prefix de-duplication: a phrase that is a prefix of a stored one refreshes the stored one instead of
taking a slot, and a stored phrase that is a prefix of a new one is replaced by it. A token tree merges
shared prefixes anyway, so a shorter copy would only waste a slot.

``harvest_verification`` turns a target pass into phrases (docs/design.md#phrases-from-verification): the
target's greedy predictions over the branches it rejected are often right but misplaced, so they are worth
proposing again.
"""

from __future__ import annotations

import itertools
import os
import struct
import threading
import zlib
from collections import OrderedDict
from typing import Callable, Iterable, Sequence

import numpy as np

from .errors import ParameterError
from .filestore import (DamagedStateError, check_fingerprint, check_token_ids, mergeable, read_checked,
                        write_atomic)
from .tree import TokenTree

Phrase = tuple[int, ...]
Key = tuple[int, ...]

_MAGIC = b"OUROPOOL"
_VERSION = 1
# magic, version, key_len, phrase_len, fingerprint bytes, n_keys, n_phrases, n_tokens, payload bytes, crc32
_HEADER = struct.Struct("<8sIIIIQQQQI")


def continues(tokens: Sequence[int], earlier: Sequence[int]) -> bool:
    """Whether ``tokens`` begin with all of ``earlier`` (a chat's next turn, the last call's text): its last
    token first, where two different texts usually part, then the whole of it (a list compare)."""
    n = len(earlier)
    return n <= len(tokens) and (n == 0 or (int(tokens[n - 1]) == int(earlier[n - 1])
                                            and list(tokens[:n]) == list(earlier)))


class PhrasePool:
    """Thread-safe bounded phrase pool. See the module docstring for the policy."""

    def __init__(self, key_len: int = 1, max_per_key: int = 8, max_tokens: int = 2_000_000,
                 phrase_len: int = 4):
        for name, value, low in (("key_len", key_len, 1), ("max_per_key", max_per_key, 1),
                                 ("max_tokens", max_tokens, 1), ("phrase_len", phrase_len, 1)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ParameterError(f"phrase pool {name} must be an integer >= {low} (got {value!r})")
        self.key_len = key_len
        self.max_per_key = max_per_key
        self.max_tokens = max_tokens
        self.phrase_len = phrase_len
        # Keys in least-recently-used order (oldest first); each list is most-recent-last.
        self._map: OrderedDict[Key, list[Phrase]] = OrderedDict()
        self._n_phrases = 0
        self._n_tokens = 0          # phrase tokens + key tokens currently stored
        self._lock = threading.RLock()
        # per n-gram size, the sequence fed last (the engine's committed list, only ever extended) and how
        # much of it: a chat's next turn continues it, and is fed from there (``fed_before``)
        self._last_fed: dict[int, tuple[Sequence[int], int]] = {}

    # ---- queries ----------------------------------------------------------------------------------
    def __len__(self) -> int:
        """Number of stored phrases."""
        return self._n_phrases

    @property
    def n_tokens(self) -> int:
        """Tokens stored (every phrase's tokens plus each key's tokens); bounded by ``max_tokens``."""
        return self._n_tokens

    @property
    def n_keys(self) -> int:
        return len(self._map)

    def key_of(self, tokens: Sequence[int]) -> Key | None:
        """The key for a context: its last ``key_len`` tokens (None if the context is shorter)."""
        if len(tokens) < self.key_len:
            return None
        return tuple(int(t) for t in tokens[len(tokens) - self.key_len:])

    def lookup(self, key_tokens: Sequence[int], k: int | None = None, max_len: int | None = None) -> list[Phrase]:
        """The ``k`` most recent phrases (all if None) for the context's key, most recent first; with
        ``max_len``, each cut to that length and the repeats the cuts make left out (what a pool of
        phrases that long would hold: a pool shared by several methods has the longest any asked for).

        A hit counts as a use of the key for the global LRU order.
        """
        key = self.key_of(key_tokens)
        if key is None:
            return []
        with self._lock:
            phrases = self._map.get(key)
            if not phrases:
                return []
            self._map.move_to_end(key)
            out = phrases[::-1]
        if max_len is not None and max_len < self.phrase_len:
            out = list(dict.fromkeys(p[:max_len] for p in out))
        return out if k is None else out[:max(k, 0)]

    def items(self) -> list[tuple[Key, list[Phrase]]]:
        """Snapshot of (key, phrases most-recent-last), keys least recently used first."""
        with self._lock:
            return [(key, list(phrases)) for key, phrases in self._map.items()]

    # ---- updates ----------------------------------------------------------------------------------
    def add(self, key_tokens: Sequence[int], phrase: Sequence[int]) -> bool:
        """Store (or refresh) ``phrase`` under the key of ``key_tokens``; False if nothing to store."""
        key = self.key_of(key_tokens)
        if key is None:
            return False
        ph = tuple(int(t) for t in phrase[:self.phrase_len])
        if not ph:
            return False
        with self._lock:
            self._add(key, ph)
            self._evict()
        return True

    def add_ngrams(self, tokens: Sequence[int], n: int, start: int = 0) -> int:
        """Slide over ``tokens``: every key is followed by a phrase of ``n - 1`` tokens.

        Only n-grams whose last token sits at index >= ``start`` are added, so feeding a growing
        sequence incrementally is ``add_ngrams(seq, n, start=len_before)``. Returns the number added.
        """
        length = len(tokens)
        count = self._add_ngrams(tokens, n, start)
        with self._lock:   # once all are in: a Ctrl-C midway leaves the rest to be fed next time
            self._last_fed[n] = (tokens, length)
        return count

    def _add_ngrams(self, tokens: Sequence[int], n: int, start: int) -> int:
        plen = min(n - 1, self.phrase_len)
        if plen < 1:
            return 0
        kl = self.key_len
        span = kl + n - 1                           # key + phrase (phrase_len may cut the phrase)
        first = max(0, start - span + 1)             # first n-gram start that ends at or after start
        if len(tokens) - first < span:
            return 0
        toks = [int(t) for t in tokens[first:]]
        count = 0
        with self._lock:
            for i in range(len(toks) - span + 1):
                self._add(tuple(toks[i:i + kl]), tuple(toks[i + kl:i + kl + plen]))
                count += 1
            self._evict()
        return count

    def fed_before(self, tokens: Sequence[int], n: int) -> int:
        """How much of ``tokens`` the n-grams of size ``n`` were fed already: the length of the sequence
        fed last where ``tokens`` continues it (a chat's next turn, whose every earlier turn was fed: at
        6,000 tokens, feeding them again took 0.1 s a call), else 0."""
        with self._lock:
            fed, length = self._last_fed.get(n, ((), 0))
        return length if length and continues(tokens, fed[:length]) else 0

    def replace(self, key_tokens: Sequence[int], old: Sequence[int], new: Sequence[int]) -> bool:
        """Overwrite stored phrase ``old`` with ``new`` in place (its recency is kept).

        Ouroboros' core package does this with the suffixes the target just corrected
        (docs/design.md#phrases-from-verification).
        Returns False when ``old`` is not stored.
        """
        key = self.key_of(key_tokens)
        if key is None:
            return False
        old_ph = tuple(int(t) for t in old[:self.phrase_len])
        new_ph = tuple(int(t) for t in new[:self.phrase_len])
        with self._lock:
            phrases = self._map.get(key)
            if not phrases or old_ph not in phrases:
                return False
            if old_ph == new_ph or not new_ph:
                return True
            idx = phrases.index(old_ph)
            clash = any(q[:len(new_ph)] == new_ph or new_ph[:len(q)] == q
                        for i, q in enumerate(phrases) if i != idx)
            if clash:   # a prefix or extension of the corrected version is stored: merge with it
                del phrases[idx]
                self._n_phrases -= 1
                self._n_tokens -= len(old_ph)
                self._add(key, new_ph)
            else:
                phrases[idx] = new_ph
                self._n_tokens += len(new_ph) - len(old_ph)
            self._evict()
        return True

    def clear(self) -> None:
        with self._lock:
            self._map.clear()
            self._n_phrases = 0
            self._n_tokens = 0

    def _add(self, key: Key, phrase: Phrase) -> None:
        # Caller holds the lock. The list invariant (no entry is a prefix of another) means at most one
        # stored entry can be a prefix of ``phrase``.
        phrases = self._map.get(key)
        if phrases is None:
            self._map[key] = [phrase]
            self._n_tokens += self.key_len + len(phrase)
            self._n_phrases += 1
            return
        self._map.move_to_end(key)
        n = len(phrase)
        for i in range(len(phrases) - 1, -1, -1):
            q = phrases[i]
            lq = len(q)
            # already stored, or an extension is: refresh it (equal lengths need no slicing: hot path)
            if (q == phrase) if lq == n else (lq > n and q[:n] == phrase):
                del phrases[i]
                phrases.append(q)
                return
            if lq < n and phrase[:lq] == q:     # a stored prefix of the new phrase: replace it
                del phrases[i]
                self._n_tokens -= lq
                self._n_phrases -= 1
                break
        if len(phrases) >= self.max_per_key:
            dropped = phrases.pop(0)
            self._n_tokens -= len(dropped)
            self._n_phrases -= 1
        phrases.append(phrase)
        self._n_tokens += n
        self._n_phrases += 1

    def _evict(self) -> None:
        # Drop the least recently used key's oldest phrases until the pool fits (O(1) amortised: every
        # phrase is dropped at most once after being added).
        while self._n_tokens > self.max_tokens and self._map:
            key, phrases = next(iter(self._map.items()))
            dropped = phrases.pop(0)
            self._n_tokens -= len(dropped)
            self._n_phrases -= 1
            if not phrases:
                del self._map[key]
                self._n_tokens -= self.key_len

    # ---- persistence ------------------------------------------------------------------------------
    def save(self, path: str | os.PathLike[str], fingerprint: str) -> None:
        """Write the pool atomically: a crash or error mid-save leaves any previous file intact."""
        items = self.items()
        kl = self.key_len
        keys = np.fromiter(itertools.chain.from_iterable(k for k, _ in items), dtype=np.int32,
                           count=len(items) * kl)
        counts = np.fromiter((len(p) for _, p in items), dtype=np.int32, count=len(items))
        n_phrases = int(counts.sum())
        lens = np.fromiter((len(ph) for _, p in items for ph in p), dtype=np.int32, count=n_phrases)
        n_tok = int(lens.sum())
        toks = np.fromiter(itertools.chain.from_iterable(ph for _, p in items for ph in p),
                           dtype=np.int32, count=n_tok)
        payload = b"".join(a.astype("<i4", copy=False).tobytes() for a in (keys, counts, lens, toks))
        fp = fingerprint.encode("utf-8")
        header = _HEADER.pack(_MAGIC, _VERSION, kl, self.phrase_len, len(fp), len(items), n_phrases,
                              n_tok, len(payload), zlib.crc32(payload))
        write_atomic(path, header + fp + payload, "phrase pool")

    def save_merged(self, path: str | os.PathLike[str], fingerprint: str, n_vocab: int | None = None) -> None:
        """``save``, keeping the phrases another process saved to ``path`` meanwhile as the older ones
        (this pool's are the newest, and win where a key's list is full). This pool itself is left as it
        is; a damaged file is moved aside and replaced, another tokenizer's or another kind of file is
        refused with a PoolError (``mergeable``)."""
        theirs = mergeable(lambda: PhrasePool.load(path, fingerprint, max_tokens=self.max_tokens,
                                                   n_vocab=n_vocab), "phrase pool", path)
        if theirs is None or theirs.key_len != self.key_len:
            self.save(path, fingerprint)
            return
        merged = PhrasePool.combined((theirs, self), key_len=self.key_len,
                                     max_per_key=max(self.max_per_key, theirs.max_per_key),
                                     phrase_len=max(self.phrase_len, theirs.phrase_len), max_tokens=self.max_tokens)
        merged.save(path, fingerprint)

    @classmethod
    def combined(cls, pools: Iterable["PhrasePool"], *, key_len: int, max_per_key: int, phrase_len: int,
                 max_tokens: int) -> "PhrasePool":
        """A fresh pool of these settings holding ``pools``' phrases, a later pool's as the newer."""
        out = cls(key_len=key_len, max_per_key=max_per_key, phrase_len=phrase_len, max_tokens=max_tokens)
        for pool in pools:
            for key, phrases in pool.items():
                for phrase in phrases:
                    out.add(key, phrase)
        return out

    @staticmethod
    def check_file(path: str | os.PathLike[str], fingerprint: str) -> None:
        """PoolError unless ``path`` is a phrase pool of this tokenizer (its header and fingerprint; the
        phrases are read when it loads)."""
        target, fields, body = read_checked(path, _MAGIC, _VERSION, _HEADER, "phrase pool")
        check_fingerprint(target, body, fields[2], fingerprint, "pool")

    @classmethod
    def load(cls, path: str | os.PathLike[str], fingerprint: str, *, max_per_key: int | None = None,
             max_tokens: int | None = None, n_vocab: int | None = None) -> "PhrasePool":
        """Read a saved pool; refuse another tokenizer's pool or a damaged file (token ids of ``n_vocab``
        or more included) with a PoolError."""
        target, fields, body = read_checked(path, _MAGIC, _VERSION, _HEADER, "phrase pool")
        kl, plen, fp_len, n_keys, n_phrases, n_tok, n_payload, crc = fields
        payload = check_fingerprint(target, body, fp_len, fingerprint, "pool")
        expected = 4 * (n_keys * kl + n_keys + n_phrases + n_tok)
        if len(payload) != n_payload or n_payload != expected:
            raise DamagedStateError(f"{target} is truncated or corrupt ({len(payload)} payload bytes, "
                            f"expected {n_payload})")
        if zlib.crc32(payload) != crc:
            raise DamagedStateError(f"{target} is corrupt (checksum mismatch)")
        if kl < 1 or plen < 1:
            raise DamagedStateError(f"{target} is corrupt (key_len {kl}, phrase_len {plen})")
        arr = np.frombuffer(payload, dtype="<i4")
        keys = arr[:n_keys * kl].reshape(n_keys, kl)
        counts = arr[n_keys * kl:n_keys * kl + n_keys]
        lens = arr[n_keys * kl + n_keys:n_keys * kl + n_keys + n_phrases]
        toks = arr[n_keys * kl + n_keys + n_phrases:]
        if (counts < 1).any() or int(counts.sum()) != n_phrases or (lens < 1).any() \
                or int(lens.sum()) != n_tok or (lens > plen).any():
            raise DamagedStateError(f"{target} is corrupt (inconsistent phrase table)")
        check_token_ids(target, keys, n_vocab)
        check_token_ids(target, toks, n_vocab)
        pool = cls(key_len=int(kl), phrase_len=int(plen),
                   max_per_key=max_per_key if max_per_key is not None else max(8, int(counts.max(initial=1))),
                   max_tokens=max_tokens if max_tokens is not None else 2_000_000)
        tok_list = toks.tolist()
        ends = np.cumsum(lens).tolist()
        starts = [0] + ends[:-1]
        phrases = [tuple(tok_list[a:b]) for a, b in zip(starts, ends)]
        key_tuples = [tuple(k) for k in keys.tolist()]
        per_key = np.cumsum(counts).tolist()
        with pool._lock:
            lo = 0
            for key, hi in zip(key_tuples, per_key):
                kept = phrases[max(lo, hi - pool.max_per_key):hi]
                lo = hi
                pool._map[key] = kept
                pool._n_phrases += len(kept)
                pool._n_tokens += kl + sum(map(len, kept))
            pool._evict()
        return pool




# ---- phrases from verification (docs/design.md#phrases-from-verification) ----------------------------

def _children(tree: TokenTree) -> list[list[int]]:
    kids: list[list[int]] = [[] for _ in tree.tokens]
    for i in range(1, len(tree.tokens)):
        kids[tree.parents[i]].append(i)
    return kids


def _chains_below(kids: list[list[int]], start: int) -> list[list[int]]:
    """Every node chain from ``start`` (inclusive) down to a leaf."""
    out: list[list[int]] = []
    stack = [[start]]
    while stack:
        chain = stack.pop()
        below = kids[chain[-1]]
        if not below:
            out.append(chain)
        else:
            stack.extend(chain + [c] for c in reversed(below))
    return out


def _rejected_chains(tree: TokenTree, path: Sequence[int]) -> list[tuple[int, list[int]]]:
    """(anchor, chain): for every path node, every chain that leaves the accepted path right below it."""
    kids = _children(tree)
    on_path = set(path)
    out: list[tuple[int, list[int]]] = []
    for anchor in path:
        for child in kids[anchor]:
            if child not in on_path:
                out.extend((anchor, chain) for chain in _chains_below(kids, child))
    return out


def _key(context: Sequence[int], key_len: int) -> Sequence[int] | None:
    return context[len(context) - key_len:] if len(context) >= key_len else None


def _harvest_predicted_tail(pool: PhrasePool, tree: TokenTree, predictions: Sequence[int],
                            path: Sequence[int], context: list[int], min_len: int) -> int:
    """Spec-Bench copy of Ouroboros: the target's predictions over a rejected branch, read as one sequence.

    For a branch that leaves the accepted path below node P, R = [pred(P), pred(c1), pred(c2), ...]:
    the token the target really wants after P, then what it predicted after each rejected draft token.
    Rejected drafts are often the right tokens in the wrong place, so R is a plausible continuation;
    every R[i] becomes a key for R[i+1 : i+1+K].
    """
    K = pool.phrase_len
    depth_of = {node: i for i, node in enumerate(path)}
    added = 0
    for anchor, chain in _rejected_chains(tree, path):
        base = context + [tree.tokens[n] for n in path[:depth_of[anchor] + 1]]
        seq = base + [int(predictions[anchor])] + [int(predictions[n]) for n in chain]
        for j in range(len(base), len(seq) - min_len):
            key = _key(seq[:j + 1], pool.key_len)
            if key is not None and pool.add(key, seq[j + 1:j + 1 + K]):
                added += 1
    return added


def _harvest_agreeing_runs(pool: PhrasePool, tree: TokenTree, predictions: Sequence[int],
                           path: Sequence[int], context: list[int], min_len: int) -> int:
    """Core package of Ouroboros (``add_extra_ngram`` + ``update_in_place``).

    1. Inside every rejected branch with drafted tokens A and target predictions B (B[j] = the target's
       token after A[j]): key A[s], phrase B[s], B[s+1], ... for as long as the draft kept agreeing with
       the target (A[j+1] == B[j]); the first disagreeing prediction still ends the phrase. These are
       locally consistent pieces of the target's continuation.
    2. A pool phrase that was tried below a path node P and failed is overwritten in place by what the
       target made of it: [pred(P), pred(first token), ...] (its recency unchanged).
    """
    K = pool.phrase_len
    kids = _children(tree)
    on_path = set(path)
    added = 0
    for depth, anchor in enumerate(path):
        prefix = context + [tree.tokens[n] for n in path[:depth + 1]]
        anchor_key = _key(prefix, pool.key_len)
        stored = pool.lookup(anchor_key) if anchor_key is not None else []
        for child in kids[anchor]:
            for chain in _chains_below(kids, child):
                if all(n in on_path for n in chain):
                    continue
                A = [tree.tokens[n] for n in chain]
                B = [int(predictions[n]) for n in chain]
                # (2) in-place correction of tried pool phrases consistent with this branch
                corrected = [int(predictions[anchor])] + B
                for q in stored:
                    tried = min(len(q), len(A))         # tokens of q the tree actually held
                    checked = min(len(q), len(corrected))
                    if (anchor_key is not None and list(q[:tried]) == A[:tried]
                            and list(q[:checked]) != corrected[:checked]
                            and pool.replace(anchor_key, q, corrected[:len(q)])):
                        added += 1
                if child in on_path:
                    continue    # runs are harvested once, from the branch that left the path
                # (1) agreeing runs inside the rejected branch
                seq = prefix + A
                for s in range(len(A)):
                    phrase: list[int] = []
                    j = s
                    while len(phrase) < K:
                        phrase.append(B[j])
                        if j + 1 < len(A) and A[j + 1] == B[j]:
                            j += 1
                        else:
                            break
                    if len(phrase) >= min_len:
                        key = _key(seq[:len(prefix) + s + 1], pool.key_len)
                        if key is not None and pool.add(key, phrase):
                            added += 1
    return added


_Harvester = Callable[[PhrasePool, TokenTree, Sequence[int], Sequence[int], list[int], int], int]

HARVEST_STRATEGIES: dict[str, _Harvester | None] = {
    "none": None,
    "predicted-tail": _harvest_predicted_tail,
    "agreeing-runs": _harvest_agreeing_runs,
}
_ALIASES = {"off": "none", "specbench": "predicted-tail", "spec-bench": "predicted-tail",
            "core": "agreeing-runs"}


def harvest_strategy(name: str | None) -> str:
    """Canonical strategy name ("none", "predicted-tail", "agreeing-runs"); accepts the aliases
    "specbench" and "core" (after the two places in the Ouroboros repository the variants come from)."""
    canonical = _ALIASES.get(name or "none", name or "none")
    if canonical not in HARVEST_STRATEGIES:
        raise ParameterError(f"unknown harvest strategy {name!r}; choose one of "
                             f"{', '.join(HARVEST_STRATEGIES)}")
    return canonical


def harvest_verification(pool: PhrasePool, tree: TokenTree, predictions: Sequence[int] | np.ndarray,
                         path: Sequence[int], strategy: str | None = "predicted-tail",
                         context: Iterable[int] = (), min_len: int | None = None) -> int:
    """Feed phrases from one verification into ``pool``; returns how many were stored or corrected.

    ``predictions[i]`` is the target's argmax at tree node i (its row predicts the token after node i);
    ``path`` the accepted node indices, root first; ``context`` the committed tokens before the root
    (only needed for keys longer than one token). Phrases shorter than ``min_len`` (default: the pool's
    phrase length) are not stored. The output never depends on this; only speed does.
    """
    fn = HARVEST_STRATEGIES[harvest_strategy(strategy)]
    if fn is None or not path:
        return 0
    ctx = list(context)[-(pool.key_len - 1):] if pool.key_len > 1 else []
    preds = predictions.tolist() if isinstance(predictions, np.ndarray) else list(predictions)
    return fn(pool, tree, preds, path, ctx, pool.phrase_len if min_len is None else max(1, min_len))
