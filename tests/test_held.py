"""Held drafts: matched against the text as it grows, reported once it decides them (held.py)."""

from ouroboros_local.held import HeldDrafts
from ouroboros_local.tree import TokenTree


def chain(*tokens: int, cls: str = "a") -> TokenTree:
    tree = TokenTree.rooted_at(0)
    node = 0
    for tok in tokens:
        node = tree.add(node, tok)
        tree.classes[node] = cls
    return tree


def test_drafts_are_reported_once_decided_in_the_order_held() -> None:
    held = HeldDrafts()
    held.hold("x", chain(1, 2, 3), start=1)          # text 1, 2, 9: decided at its 3rd token
    held.hold("x", chain(1, 2), start=1)             # text 1, 2: matched whole
    held.hold("x", chain(9, 5, 6), start=3)          # waits: the text has not reached its end
    text = [0, 1]
    assert held.score("x", text, probe_length=2) == []   # nothing decided yet
    text += [2, 9]
    scored = held.score("x", text, probe_length=2)
    assert [(d.tokens, d.matched, decided) for d, decided in scored] == [([1, 2, 3], 2, True), ([1, 2], 2, True)]
    assert [d.tokens for d in held.waiting("x")] == [[9, 5, 6]]
    text.append(6)                                   # 5 was expected: decided after one token
    assert [(d.matched, decided) for d, decided in held.score("x", text, 2)] == [(1, True)]
    assert "x" not in held


def test_an_early_looks_draft_is_reported_once_at_a_probes_length() -> None:
    held = HeldDrafts()
    held.hold("x", chain(1, 2, 3, 4), start=1, probe=True)
    text = [0, 1, 2]
    (draft, decided), = held.score("x", text, probe_length=2)
    assert not decided and draft.verified == 2       # learned as a probe's two tokens, held on for the rest
    text.append(3)
    assert held.score("x", text, probe_length=2) == []   # not reported twice
    text.append(7)
    (draft, decided), = held.score("x", text, probe_length=2)
    assert decided and draft.matched == 3


def test_a_verified_draft_is_scored_only_past_what_was_verified() -> None:
    held = HeldDrafts()
    held.hold("x", chain(1, 2, 3), start=1)
    held.verified("x", chain(1, 2))                  # its first two nodes were verified
    assert held.waiting("x")[0].verified == 2
    held.verified("x", chain(1, 2))                  # (once: a later verification is another draft's)
    held.hold("x", chain(4, 5), start=4)
    held.verified("x", chain(4, 5))                  # verified whole: nothing left to score
    assert [d.tokens for d in held.waiting("x")] == [[1, 2, 3]]
    held.hold("x", chain(6), start=6)
    held.verified("x", chain(7))                     # a different chain: not this draft's verification
    assert held.waiting("x")[-1].verified == -1
