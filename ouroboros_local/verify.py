"""Verification of a token tree against the target's logits rows (one row per tree node).

Greedy: walk from the root, following the child whose token is the target's argmax; the first argmax
with no matching child is the bonus token.

Sampling (lossless): at each node the target distribution p is processed from the node's row. A child
that carries its draft distribution q (stochastic draft) is accepted with probability min(1, p(x)/q(x));
on rejection p becomes norm(max(0, p - q)) (Leviathan et al.). Then a token is drawn from the current p
and, if a deterministic child (pool phrase, greedy draft) carries it, the walk continues there
("sample-and-match"); otherwise the drawn token is the bonus. Every emitted token is therefore
distributed exactly as the target's processed distribution given the accepted prefix.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import numpy as np

from .sampling import SamplingParams, Sparse, prob_of, residual, support
from .tree import BatchLayout, TokenTree, layout


class Predictions:
    """The target's argmax at every tree node (row i predicts the child of node i), read lazily.

    The walk needs only the rows along the accepted path (plus the bonus row); the rest is computed
    when a consumer asks (a phrase pool harvesting rejected branches). ``rows`` may be a view of
    llama.cpp's logits buffer: ``release`` (the engine calls it once the round is observed) forgets
    it, after which a row never read raises instead of reading the next decode's logits.
    """

    def __init__(self, rows: np.ndarray):
        self._rows: np.ndarray | None = rows
        self._known = [-1] * len(rows)      # -1: not read yet

    def __len__(self) -> int:
        return len(self._known)

    def __getitem__(self, node: int) -> int:
        known = self._known[node]
        if known < 0:
            if self._rows is None:
                raise RuntimeError("the target's logits of this round are gone: read predictions in observe()")
            known = self._known[node] = int(self._rows[node].argmax())
        return known

    def tolist(self) -> list[int]:
        todo = [i for i, known in enumerate(self._known) if known < 0]
        if todo:
            if self._rows is None:
                raise RuntimeError("the target's logits of this round are gone: read predictions in observe()")
            rows = self._rows
            for i in todo:   # in place: rows[todo] copied len(todo) vocabulary-sized rows (151,936 floats each)
                self._known[i] = int(rows[i].argmax())
        return list(self._known)

    def __iter__(self) -> Iterator[int]:
        return iter(self.tolist())

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        return np.array(self.tolist(), dtype=dtype)

    def computed_rows(self) -> int:
        """How many rows were read so far (tests, diagnostics)."""
        return sum(known >= 0 for known in self._known)

    def release(self) -> None:
        self._rows = None


class JoinedPredictions(Predictions):
    """The target's argmax at the nodes of a draft verified in two rounds (``joined``): the nodes along
    a prefix by a round that wrote their next tokens (``known``: node -> token), then the subtree below
    the prefix's end (its nodes ``rest_nodes``, predicted by ``rest``). Nodes beside that subtree were
    never decoded."""

    def __init__(self, n_nodes: int, known: dict[int, int], rest: "Predictions | np.ndarray | None" = None,
                 rest_nodes: Sequence[int] = ()):
        self._n = n_nodes
        self._known = known
        self._rest = rest
        self._at = {node: j for j, node in enumerate(rest_nodes)}

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, node: int) -> int:
        token = self._known.get(node)
        if token is not None:
            return token
        j = self._at.get(node)
        if j is None or self._rest is None:
            raise RuntimeError(f"node {node} was never decoded: the target's first token ruled its branch out")
        return self._rest[j]

    def tolist(self) -> list[int]:
        return [self[i] for i in range(self._n)]

    def computed_rows(self) -> int:
        return len(self._known) + (self._rest.computed_rows() if isinstance(self._rest, Predictions) else 0)

    def release(self) -> None:
        if isinstance(self._rest, Predictions):
            self._rest.release()


@dataclass
class VerifyResult:
    tree: TokenTree
    path: list[int]               # accepted node indices, root first
    accepted: list[int]           # accepted candidate tokens (path without the root)
    bonus: int                    # the target's own token after the accepted path
    predictions: Predictions | np.ndarray  # target argmax at every tree node (row i predicts the child of node i)
    extra_predictions: list[int] | None = None   # target argmax after each extra asking for logits
    winner_seq: int = 0
    accepted_by_source: dict[str, int] = field(default_factory=dict)

    @property
    def tokens(self) -> list[int]:
        return self.accepted + [self.bonus]

    def release(self) -> None:
        """The round is over: its logits rows may be overwritten (see ``Predictions.release``)."""
        if isinstance(self.predictions, Predictions):
            self.predictions.release()


def _children_index(tree: TokenTree) -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    parents = tree.parents
    for i in range(1, len(parents)):
        kids.setdefault(parents[i], []).append(i)
    return kids


def verify_greedy(tree: TokenTree, rows: np.ndarray, chain: bool = False) -> tuple[list[int], int, Predictions]:
    """Returns (path, bonus, predictions) for greedy decoding; reads only the rows along the path.
    ``chain``: the tree is known to be a chain (node i's one child is i + 1): no child index needed."""
    predictions = Predictions(rows)
    if chain:
        tokens = tree.tokens
        node = 0
        while node + 1 < len(tokens) and tokens[node + 1] == predictions[node]:
            node += 1
        return list(range(node + 1)), predictions[node], predictions
    path = [0]
    node = 0
    while True:
        token = predictions[node]
        child = tree.child_with_token(node, token)
        if child is None:
            return path, token, predictions
        path.append(child)
        node = child


def verify_sampling(tree: TokenTree, rows: np.ndarray, params: SamplingParams,
                    rng: np.random.Generator) -> tuple[list[int], int, Predictions]:
    """Returns (path, bonus, predictions); lossless for stochastic and deterministic children."""
    predictions = Predictions(rows)
    tokens = tree.tokens
    draft_probs = tree.draft_probs
    kids = _children_index(tree) if len(tokens) > 1 else {}
    path = [0]
    node = 0
    while True:
        p: Sparse = support(rows[node], params)
        children = kids.get(node, ())
        chosen = None
        for child in children:
            q = draft_probs.get(child)
            if q is None:
                continue
            x = tokens[child]
            qx = prob_of(q, x)
            if qx > 0 and rng.random() * qx < p.prob(x):  # accept with min(1, p/q)
                chosen = child
                break
            p_next = residual(p, q)
            if p_next is None:  # p == q on the support: cannot happen after a rejection
                continue
            p = p_next
        if chosen is None:
            x = p.sample(rng)
            deterministic = [c for c in children if c not in draft_probs and tokens[c] == x]
            if not deterministic:
                return path, x, predictions
            chosen = deterministic[0]
        path.append(chosen)
        node = chosen


def verify(tree: TokenTree, rows: np.ndarray, params: SamplingParams,
           rng: np.random.Generator, chain: bool = False) -> tuple[list[int], int, Predictions]:
    if params.greedy:
        return verify_greedy(tree, rows, chain)
    return verify_sampling(tree, rows, params, rng)


def is_plain_step(tree: TokenTree) -> bool:
    """The root alone: no candidate and nothing riding along (most rounds of plain decoding and of any
    method whose draft did not pay), verified by ``verify_step`` without a layout."""
    return len(tree.tokens) == 1 and not tree.extras and not tree.n_extra_seqs


def verify_step(tree: TokenTree, rows: np.ndarray, params: SamplingParams,
                rng: np.random.Generator) -> VerifyResult:
    """``verify_round``'s result for a plain step whose one logits row is ``rows[0]``: the same token and
    the same random draw, without the tree machinery."""
    predictions = Predictions(rows)
    bonus = predictions[0] if params.greedy else support(rows[0], params).sample(rng)
    return VerifyResult(tree=tree, path=[0], accepted=[], bonus=bonus, predictions=predictions)


def verify_round(tree: TokenTree, decode: Callable[[BatchLayout], np.ndarray], params: SamplingParams,
                 rng: np.random.Generator) -> tuple[VerifyResult, BatchLayout]:
    """One round's verification, the same for the engine and the simulator (testing/sim.py): the tree's
    batch in ONE ``decode`` (its output rows: every tree node, then the extras that want logits), the
    walk along the accepted path, and the sequence whose cells hold that path."""
    lay = layout(tree)
    rows = decode(lay)
    path, bonus, predictions = verify(tree, rows[:lay.n_tree], params, rng, lay.chain)
    # an argmax per extra row, read in place: copying the rows cost two vocabulary-sized copies each
    extra = [int(rows[r].argmax()) for r in lay.extra_rows if r >= 0] if lay.extra_rows else None
    winner = min(s for s in lay.seq_ids[path[-1]] if s < len(lay.leaf_seq)) if lay.n_seqs > 1 else 0
    result = VerifyResult(tree=tree, path=path, accepted=[tree.tokens[i] for i in path[1:]], bonus=int(bonus),
                          predictions=predictions, extra_predictions=extra or None, winner_seq=winner,
                          accepted_by_source=_count_sources(tree, path[1:], {}))
    return result, lay


def walked(tree: TokenTree, written: Sequence[int]) -> tuple[VerifyResult | None, int | None]:
    """A round that wrote ``written`` (its accepted tokens and its bonus) after ``tree``'s root, read as
    the first levels of ``tree``'s verification: the node whose path carries all of ``written``, whose
    subtree the next round verifies (``joined``), or, where the path leaves the tree first, ``tree``'s
    whole verification (the nodes matched, then the target's token, as ``verify_round`` would find
    greedily; a sampled token chosen by sample-and-match)."""
    node = 0
    for depth, token in enumerate(written):
        child = tree.child_with_token(node, token)
        if child is None:
            path = tree.path_to(node)
            known = {n: written[i] for i, n in enumerate(path)}
            return VerifyResult(tree=tree, path=path, accepted=list(written[:depth]), bonus=token,
                                predictions=JoinedPredictions(len(tree.tokens), known),
                                accepted_by_source=_count_sources(tree, path[1:], {})), None
        node = child
    return None, node


def judged(tree: TokenTree, written: Sequence[int]) -> tuple[VerifyResult, int | None]:
    """``walked`` for a draft whose rest is not verified but guessed (rounds of one size): the verdict on
    the nodes ``written`` judged, and the node whose path carries all of ``written`` (None where the path
    left the tree). Then the nodes above that node were accepted and its token is the bonus: the verdict
    is on ``tree`` cut above it, so that nothing unverified reads as rejected."""
    verdict, node = walked(tree, written)
    if verdict is not None:
        return verdict, None
    assert node is not None
    depth = tree.depths[node]
    keep = [i for i, d in enumerate(tree.depths) if d < depth]
    new_id = {old: new for new, old in enumerate(keep)}
    above = tree.path_to(tree.parents[node])
    known = {new_id[n]: written[i] for i, n in enumerate(above)}
    cut = tree.subtree(keep)
    path = [new_id[n] for n in above]
    return VerifyResult(tree=cut, path=path, accepted=list(written[:depth - 1]), bonus=written[depth - 1],
                        predictions=JoinedPredictions(len(keep), known),
                        accepted_by_source=_count_sources(tree, above[1:], {})), node


def joined(tree: TokenTree, node: int, rest: VerifyResult) -> VerifyResult:
    """``tree``'s verification in two rounds, as one: a round wrote the tokens of the path to ``node``
    (``walked``), and ``rest`` verified ``tree.below(node)``."""
    prefix = tree.path_to(node)
    nodes = tree.descendants(node)
    path = prefix[:-1] + [nodes[j] for j in rest.path]
    by_source = _count_sources(tree, prefix[1:], dict(rest.accepted_by_source))
    known = {prefix[i]: tree.tokens[prefix[i + 1]] for i in range(len(prefix) - 1)}
    predictions = JoinedPredictions(len(tree.tokens), known, rest.predictions, nodes)
    return VerifyResult(tree=tree, path=path, accepted=[tree.tokens[i] for i in path[1:]], bonus=rest.bonus,
                        predictions=predictions, accepted_by_source=by_source)


def _count_sources(tree: TokenTree, nodes: Sequence[int], counts: dict[str, int]) -> dict[str, int]:
    """``counts`` plus the accepted ``nodes`` of ``tree`` by the proposer that drafted each."""
    if not tree.sources:   # most rounds: a plain step, or a drafter that labels nothing
        return counts
    for i in nodes:
        source = tree.sources.get(i)
        if source:
            counts[source] = counts.get(source, 0) + 1
    return counts
