"""Token trees: the candidate continuations one target pass verifies, and their llama.cpp batch layout.

Node 0 is the *root*: the last committed token, which is not yet in the target's KV cache. Every other
node is a candidate token whose parent precedes it (``parents[i] < i``), so a tree is stored in batch
order. A node at depth d sits at position ``P + d`` where P is the root's position.

Sequence ids: each root-to-leaf path gets its own sequence id, and a node carries the ids of every leaf
below it. llama.cpp decides what a multi-sequence token attends to through *one* of its ids, and which
one is unspecified (docs/design.md#llamacpp-facts). With one id per leaf path, the cells any of a node's
ids hold below the node's position are exactly the node's ancestors (plus the shared committed prefix),
so every id gives the same view. ``check_layout`` asserts this invariant.

*Extras* are tokens a proposer rides along in the same target decode without them being candidates
(lookahead's Jacobi window). They use their own sequence ids, numbered after the leaf paths; the root
carries those ids too so that the extras see the committed prefix and the root.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

import numpy as np

if TYPE_CHECKING:  # pragma: no cover
    from .sampling import Sparse


@dataclass
class ExtraToken:
    """A non-candidate token decoded in the target batch (e.g. a lookahead window cell).

    ``pos_offset`` is relative to the root (>= 1); ``seqs`` are extra-sequence indices (0-based, local to
    the extras); ``want_logits`` asks for its logits row (its argmax is returned in ``VerifyResult.extra_predictions``).
    """

    token: int
    pos_offset: int
    seqs: tuple[int, ...]
    want_logits: bool = True


@dataclass
class TokenTree:
    tokens: list[int]
    parents: list[int]
    depths: list[int]
    # Draft distribution a node's token was sampled from (stochastic drafts). Nodes without one are
    # deterministic proposals and are verified by sample-and-match.
    draft_probs: dict[int, "np.ndarray | Sparse"] = field(default_factory=dict)
    # Which proposer produced each node (for per-source acceptance statistics); optional.
    sources: dict[int, str] = field(default_factory=dict)
    # Confidence class of a node (e.g. "p6": the draft gave its token probability 0.95-0.98, or
    # "ctx3d1": a context copy whose match is 3 tokens long, at depth 1). The scheduler learns acceptance
    # per class and trims drafts whose expected gain no longer pays for their verification
    # (acceptance.ConfidenceTable).
    classes: dict[int, str] = field(default_factory=dict)
    extras: list[ExtraToken] = field(default_factory=list)
    n_extra_seqs: int = 0
    # (parent, token) -> its lowest-numbered child with that token, for nodes [0, _indexed): caught up
    # lazily, so nodes appended to the lists directly are found too (nodes are never removed)
    _child_index: dict[tuple[int, int], int] = field(default_factory=dict, init=False, repr=False,
                                                     compare=False)
    _indexed: int = field(default=0, init=False, repr=False, compare=False)

    @classmethod
    def rooted_at(cls, token: int) -> "TokenTree":
        return cls(tokens=[int(token)], parents=[-1], depths=[0])

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def n_candidates(self) -> int:
        """Number of non-root nodes (drafted tokens)."""
        return len(self.tokens) - 1

    @property
    def batch_size(self) -> int:
        """Tokens one decode of this tree takes, each a KV cell: its nodes and the extras."""
        return len(self.tokens) + len(self.extras)

    def child_with_token(self, parent: int, token: int) -> int | None:
        """The lowest-numbered child of ``parent`` with ``token``, or None (O(1) amortised)."""
        if self._indexed < len(self.tokens):
            self._index_new_nodes()
        return self._child_index.get((parent, token))

    def _index_new_nodes(self) -> None:
        index, parents, tokens = self._child_index, self.parents, self.tokens
        for i in range(self._indexed, len(tokens)):
            index.setdefault((parents[i], tokens[i]), i)
        self._indexed = len(tokens)

    def children(self, node: int) -> list[int]:
        return [i for i in range(node + 1, len(self.tokens)) if self.parents[i] == node]

    def add(self, parent: int, token: int, draft_probs: "np.ndarray | Sparse | None" = None,
            source: str | None = None) -> int:
        """Add a child (or return the existing deterministic child with the same token)."""
        if not 0 <= parent < len(self.tokens):
            raise IndexError(f"parent {parent} out of range")
        token = int(token)
        if draft_probs is None:
            existing = self.child_with_token(parent, token)
            if existing is not None and existing not in self.draft_probs:
                return existing
        self.tokens.append(token)
        self.parents.append(parent)
        self.depths.append(self.depths[parent] + 1)
        node = len(self.tokens) - 1
        if self._indexed == node:   # the index was current: keep it so (no catch-up on the next lookup)
            self._child_index.setdefault((parent, token), node)
            self._indexed = node + 1
        if draft_probs is not None:
            self.draft_probs[node] = draft_probs
        if source is not None:
            self.sources[node] = source
        return node

    def add_path(self, parent: int, tokens: Sequence[int], source: str | None = None,
                 max_nodes: int | None = None) -> int:
        """Add a chain of deterministic tokens below ``parent`` (sharing existing prefixes).

        Stops early once the tree holds ``max_nodes`` candidate nodes. Returns the last node reached.
        """
        node = parent
        for i, tok in enumerate(tokens):
            existing = self.child_with_token(node, int(tok))
            if existing is None or existing in self.draft_probs:
                return self._append_chain(node, tokens[i:], source, max_nodes)
            node = existing
        return node

    def _append_chain(self, parent: int, tokens: Sequence[int], source: str | None, max_nodes: int | None) -> int:
        """``tokens`` as new nodes, each the child of the one before (a new node has no children, so no
        lookups: the bulk of a copied phrase costs a few list extends). Returns the last node."""
        n = len(tokens) if max_nodes is None else max(0, min(len(tokens), max_nodes - self.n_candidates))
        if n == 0:
            return parent
        first = len(self.tokens)
        self.tokens.extend(map(int, tokens[:n]))
        self.parents.append(parent)
        self.parents.extend(range(first, first + n - 1))
        depth = self.depths[parent] + 1
        self.depths.extend(range(depth, depth + n))
        if source is not None:
            self.sources.update(dict.fromkeys(range(first, first + n), source))
        return first + n - 1

    def truncated(self, max_depth: int) -> "TokenTree":
        """A copy holding only the nodes at depth <= max_depth (ids are kept: parents come first)."""
        if max_depth >= self.max_depth:
            return self
        if max_depth <= 0:   # the root alone (``trim``'s usual verdict on a look: a copy that cannot pay)
            return TokenTree.rooted_at(self.tokens[0])
        return self.subtree([i for i, d in enumerate(self.depths) if d <= max_depth])

    def subtree(self, keep: Sequence[int]) -> "TokenTree":
        """A copy holding only the nodes ``keep`` (ascending: the new root first, then nodes whose parents
        are kept), renumbered in the same order, depths counted from the new root; labels and draft
        distributions go with their nodes (the new root's own are dropped: a root is no candidate)."""
        new_id = {old: new for new, old in enumerate(keep)}
        root = keep[0]
        base = self.depths[root]
        out = TokenTree(tokens=[self.tokens[i] for i in keep],
                        parents=[-1] + [new_id[self.parents[i]] for i in keep[1:]],
                        depths=[self.depths[i] - base for i in keep])
        for attr in ("draft_probs", "sources", "classes"):
            getattr(out, attr).update({new_id[i]: v for i, v in getattr(self, attr).items()
                                       if i in new_id and i != root})
        return out

    def descendants(self, node: int) -> list[int]:
        """``node`` and every node below it, ascending (parents come first, so one pass finds them)."""
        out, inside, parents = [node], {node}, self.parents
        for i in range(node + 1, len(parents)):
            if parents[i] in inside:
                inside.add(i)
                out.append(i)
        return out

    def below(self, node: int) -> "TokenTree":
        """A copy of the subtree under ``node``, which becomes its root (``subtree``)."""
        return self.subtree(self.descendants(node))

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root to ``node`` (inclusive)."""
        path = []
        while node >= 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

    def first_path(self, node: int = 0) -> list[int]:
        """The nodes below ``node`` along each first child (the child added first: a proposer's likeliest,
        or its first phrase): a branching draft's main chain."""
        first: dict[int, int] = {}
        for i in range(node + 1, len(self.parents)):
            first.setdefault(self.parents[i], i)
        path = []
        while node in first:
            node = first[node]
            path.append(node)
        return path

    def leaves(self) -> list[int]:
        has_child = set(self.parents[1:])
        return [i for i in range(len(self.tokens)) if i not in has_child]

    @property
    def max_depth(self) -> int:
        return max(self.depths)

    def is_chain(self) -> bool:
        return all(self.parents[i] == i - 1 for i in range(1, len(self.tokens)))

    def node_classes(self) -> list[str]:
        """The confidence class of each node after the root, in node order ("" where unlabelled)."""
        return [self.classes.get(i, "") for i in range(1, len(self.tokens))]


def tree_problem(tree: TokenTree, n_vocab: int, max_seqs: int, max_batch: int) -> str | None:
    """What makes ``tree`` unfit for one decode, in words (None: nothing). Every token in the vocabulary;
    parents before their children, depths one below them; the leaf paths and extra sequences within
    ``max_seqs`` sequence ids, nodes and extras within ``max_batch``; extras on declared sequences, each
    sequence's positions 1, 2, 3, ... in batch order (``check_layout``'s rule); a draft distribution only on
    candidates, giving its node's token a chance. O(nodes + extras): a plug-in's malformed tree decoded
    anyway verified a view no token had (an extra on an undeclared sequence left a cell behind, and later
    text changed), or failed in llama.cpp, blamed on the request."""
    tokens, parents, depths = tree.tokens, tree.parents, tree.depths
    n = len(tokens)
    if n == 0 or len(parents) != n or len(depths) != n:
        return f"tokens, parents and depths have {n}, {len(parents)} and {len(depths)} entries (a root at least)"
    if parents[0] != -1 or depths[0] != 0:
        return "node 0 (the root) has a parent or a depth"
    if n == 1 and not tree.extras and not tree.n_extra_seqs and not tree.draft_probs:
        return None   # a plain step's root (the last committed token): most rounds, at no cost
    if not 0 <= min(tokens) <= max(tokens) < n_vocab:
        bad = next(t for t in tokens if not 0 <= t < n_vocab)
        return f"drafted token {bad} is not in the vocabulary (0..{n_vocab - 1})"
    if len(tree.extras) + n > max_batch:
        return f"{n} nodes and {len(tree.extras)} extra tokens: a batch holds {max_batch}"
    if tree.is_chain():
        if list(depths) != list(range(n)):   # (numpy arrays and tuples are lists here)
            return "a chain's depths must be 0, 1, 2, ..."
    else:
        for i in range(1, n):
            p = parents[i]
            if not 0 <= p < i or depths[i] != depths[p] + 1:
                return f"node {i}: its parent {p} must come before it and its depth be the parent's + 1"
    n_extra_seqs = tree.n_extra_seqs
    n_seqs = n - len(set(parents[1:])) + n_extra_seqs   # a sequence per leaf path, then the extras'
    if n_extra_seqs < 0 or n_seqs > max_seqs:
        return (f"the tree needs {n_seqs} sequence ids ({n_seqs - n_extra_seqs} leaf paths, {n_extra_seqs} "
                f"extra sequences), the context has {max_seqs} (ProposeSetup.max_branches)")
    last: dict[int, int] = {}   # an extra sequence's last position so far (the root's: 0)
    for extra in tree.extras:
        if not 0 <= extra.token < n_vocab or extra.pos_offset < 1 or not extra.seqs:
            return f"extra token {extra}: in the vocabulary, after the root (pos_offset >= 1), on a sequence"
        if not 0 <= min(extra.seqs) <= max(extra.seqs) < n_extra_seqs:
            return f"extra token {extra}: its sequences must be below n_extra_seqs ({n_extra_seqs})"
        for seq in extra.seqs:
            if extra.pos_offset != last.get(seq, 0) + 1:
                return (f"extra token {extra}: sequence {seq}'s positions must go 1, 2, 3, ... in batch order "
                        f"(its last was {last.get(seq, 0)})")
            last[seq] = extra.pos_offset
    for node, probs in tree.draft_probs.items():
        if not 1 <= node < n:
            return f"a draft distribution for node {node}, which is no candidate"
        # a dense vector may be the draft's vocabulary's length (pairs.py allows a few ids of difference)
        token = tokens[node]
        chance = probs.prob(token) if hasattr(probs, "prob") else float(probs[token]) if token < len(probs) else 0.0
        if not 0 < chance <= 1:   # NaN too
            return (f"node {node}'s draft distribution gives its token {token} probability {chance} "
                    f"(a vector, or a Sparse, that its token was drawn from)")
    return None


@dataclass
class BatchLayout:
    """Where every token of a tree (+ extras) goes in one llama.cpp batch."""

    tokens: list[int]
    pos_offsets: list[int]          # relative to the root position
    seq_ids: list[tuple[int, ...]]  # absolute sequence ids
    logits: list[bool]
    n_tree: int                     # the first n_tree batch entries are the tree nodes, in node order
    n_seqs: int                     # sequence ids used: 0 .. n_seqs-1
    leaf_seq: dict[int, int]        # leaf node -> its sequence id
    extra_rows: list[int]           # output-row index of each extra token that wants logits (-1 if none)
    chain: bool = False             # a plain chain on sequence 0, every token wanting logits


def layout(tree: TokenTree) -> BatchLayout:
    """Assign positions and sequence ids (one per root-to-leaf path, then one per extra sequence)."""
    if not tree.extras and not tree.n_extra_seqs and tree.is_chain():   # most rounds: a plain step or a chain
        n = len(tree.tokens)
        return BatchLayout(tokens=list(tree.tokens), pos_offsets=list(range(n)), seq_ids=[(0,)] * n,
                           logits=[True] * n, n_tree=n, n_seqs=1, leaf_seq={n - 1: 0}, extra_rows=[], chain=True)
    leaves = tree.leaves()
    leaf_seq = {leaf: s for s, leaf in enumerate(leaves)}
    n_paths = len(leaves)
    node_seqs: list[set[int]] = [set() for _ in tree.tokens]
    for leaf, s in leaf_seq.items():
        node = leaf
        while node >= 0:
            node_seqs[node].add(s)
            node = tree.parents[node]
    extra_seq_ids = tuple(range(n_paths, n_paths + tree.n_extra_seqs))
    node_seqs[0].update(extra_seq_ids)

    tokens = list(tree.tokens)
    pos = list(tree.depths)
    seqs = [tuple(sorted(s)) for s in node_seqs]
    logits = [True] * len(tree.tokens)
    extra_rows = []
    row = len(tree.tokens)
    for extra in tree.extras:
        if extra.pos_offset < 1:
            raise ValueError("extra tokens must sit after the root")
        tokens.append(int(extra.token))
        pos.append(extra.pos_offset)
        seqs.append(tuple(n_paths + s for s in extra.seqs))
        logits.append(extra.want_logits)
        if extra.want_logits:
            extra_rows.append(row)
            row += 1
        else:
            extra_rows.append(-1)
    return BatchLayout(tokens=tokens, pos_offsets=pos, seq_ids=seqs, logits=logits,
                       n_tree=len(tree.tokens), n_seqs=n_paths + tree.n_extra_seqs,
                       leaf_seq=leaf_seq, extra_rows=extra_rows)


def check_layout(lay: BatchLayout) -> None:
    """Assert llama.cpp's batch rules and the seq-id view invariant for a layout (raises AssertionError).

    1. Per sequence, batch positions are gap-free, unique, start at the root (offset 0) and never
       decrease in batch order.
    2. A token with several seq ids sees the same cells through each of them: the set of
       (position, batch index) cells at lower positions is identical for all its ids.
    """
    by_seq: dict[int, list[tuple[int, int]]] = {}
    for i, (p, ss) in enumerate(zip(lay.pos_offsets, lay.seq_ids)):
        assert ss, f"token {i} has no sequence id"
        for s in ss:
            by_seq.setdefault(s, []).append((p, i))
    for s, cells in by_seq.items():
        positions = [p for p, _ in cells]
        assert positions == sorted(positions), f"seq {s}: positions decrease in batch order"
        distinct = sorted(set(positions))
        assert len(distinct) == len(positions), f"seq {s}: two tokens at one position"
        assert distinct[0] == 0, f"seq {s} does not start at the root"
        assert distinct[-1] - distinct[0] + 1 == len(distinct), f"seq {s}: positions have gaps"
    for i, (p, ss) in enumerate(zip(lay.pos_offsets, lay.seq_ids)):
        if len(ss) < 2:
            continue
        views = [frozenset(c for c in by_seq[s] if c[0] < p) for s in ss]
        assert all(v == views[0] for v in views), f"token {i}: its seq ids give different views"
