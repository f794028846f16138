"""Drafting while the target decodes a round without a draft (EngineConfig.overlap): a plain step, or in
rounds of one size a round filled with guesses; what it wrote checks the draft's first levels, the next
round verifies the rest; outputs unchanged, sampling still follows the target."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from ouroboros_local.engine import Engine
from ouroboros_local.errors import DrafterError, OuroborosError
from ouroboros_local.proposers import method_names
from ouroboros_local.sampling import SamplingParams
from ouroboros_local.testing.engines import tiny_engine
from ouroboros_local.testing.lossless import (assert_first_pairs_follow_the_target,
                                              assert_greedy_equals_vanilla, assert_seeded_equals_vanilla)
from ouroboros_local.tree import ExtraToken, TokenTree
from ouroboros_local.verify import Predictions, VerifyResult, joined, verify_step, walked

PROMPTS = ["def add(a, b):\n    return a + b\n\ndef add(a, b):\n",
           "The quick brown fox jumps over the lazy dog. The quick brown"]


@pytest.fixture(scope="module")
def overlap_engine(tiny_target, tiny_draft):
    engine = tiny_engine(tiny_target, tiny_draft, overlap=True)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def overlap_rounds_engine(tiny_target, tiny_draft):
    """Rounds of one size: a round without a draft is the root filled with guesses."""
    engine = tiny_engine(tiny_target, tiny_draft, overlap=True, round_size=4)
    yield engine
    engine.close()


@pytest.fixture(params=["plain steps", "rounds of 4"])
def either_engine(request) -> Engine:
    return request.getfixturevalue("overlap_engine" if request.param == "plain steps" else "overlap_rounds_engine")


@pytest.mark.parametrize("method", [m for m in method_names() if m != "vanilla"])
def test_every_method_is_greedy_lossless_when_drafting_during_the_step(overlap_engine: Engine,
                                                                        method: str) -> None:
    assert_greedy_equals_vanilla(overlap_engine, PROMPTS, method, max_tokens=40)


def test_a_draft_made_during_the_step_is_carried_into_the_next_round(overlap_engine: Engine) -> None:
    first = overlap_engine.generate(PROMPTS[1], max_tokens=40, method="suffix")
    again = overlap_engine.generate(PROMPTS[1], max_tokens=40, method="suffix")   # copyable from the start
    assert again.tokens == first.tokens
    ahead = again.stats.extra["overlap"]
    assert ahead["carried"] >= 1 and ahead["drafts"] >= ahead["carried"]
    # the carried draft was verified in the next round: fewer target passes than tokens
    assert again.stats.target_passes + again.stats.accepted == len(again.tokens)
    assert again.stats.target_passes < len(again.tokens) / 2
    # the time split names both halves: plain steps that drafted while decoding, and the carried rest
    split = again.stats.extra["time_split"]
    assert split["ahead"][0] >= 1 and split["carried"][0] == ahead["carried"]
    assert sum(n for n, _ in split.values()) == again.stats.target_passes
    assert sum(t for _, t in split.values()) == pytest.approx(again.stats.decode_seconds, abs=1e-5)


def test_looks_are_free_only_while_the_step_decodes(overlap_engine: Engine, monkeypatch) -> None:
    seen = []
    propose = overlap_engine._propose_in_room

    def spy(proposer, sched, committed, budget, room):
        seen.append(overlap_engine.scheduler().looks.hidden)
        return propose(proposer, sched, committed, budget, room)

    monkeypatch.setattr(overlap_engine, "_propose_in_room", spy)
    overlap_engine.generate(PROMPTS[1], max_tokens=40, method="suffix")
    again = overlap_engine.generate(PROMPTS[1], max_tokens=40, method="suffix")
    assert again.stats.extra["overlap"]["carried"] >= 1
    assert True in seen and False in seen          # drafts asked during a step, and before a decode
    assert overlap_engine.scheduler().looks.hidden is False


@pytest.mark.parametrize("overlap", [True, False])
def test_a_tree_rooted_elsewhere_is_refused_in_both_kinds_of_round(tiny_target, monkeypatch,
                                                                   overlap: bool) -> None:
    from ouroboros_local.proposers.prompt_lookup import PromptLookupProposer

    def elsewhere(self, committed, budget):
        tree = TokenTree.rooted_at(committed[-1] + 1)
        tree.add(0, 5)
        return tree

    monkeypatch.setattr(PromptLookupProposer, "propose", elsewhere)
    with tiny_engine(tiny_target, overlap=overlap) as engine:
        with pytest.raises(OuroborosError, match="'prompt-lookup': the tree's root is not the last committed token"):
            engine.generate(PROMPTS[0], max_tokens=8, method="prompt-lookup", options={"adaptive": False})


@pytest.mark.parametrize("broken, message", [
    ("over_budget", "100 drafted tokens for a budget of"),   # was verified, 101 tokens a pass, unnoticed
    ("not_a_tree", "propose\\(\\) returned NoneType, not a TokenTree"),   # was an AttributeError on n_candidates
    ("outside_vocabulary", "drafted token 509 is not in the vocabulary"),   # was "llama_decode failed"
    # an extra on a sequence the tree did not declare left a stale cell: later text changed, unnoticed
    ("undeclared_extra", "extra token .*: its sequences must be below n_extra_seqs \\(0\\)"),
    ("many_leaves", "the tree needs 6 sequence ids \\(6 leaf paths.* the context has 4"),   # was ValueError from kv.py
    ("bad_parent", "node 2: its parent 5 must come before it"),   # was an IndexError in the layout
    ("nan_draft", "node 1's draft distribution gives its token 7 probability nan"),   # was an IndexError
    ("empty", "an empty tree"),   # was an IndexError
    # both failed inside llama_decode, answered as the request's fault
    ("extra_gap", "extra token .*: sequence 0's positions must go 1, 2, 3, ... in batch order \\(its last was 0\\)"),
    ("many_extras", "1 nodes and 70 extra tokens: a batch holds 64"),
])
def test_a_drafter_that_breaks_its_contract_is_named(tiny_target, monkeypatch, broken: str, message: str) -> None:
    from ouroboros_local.proposers.prompt_lookup import PromptLookupProposer

    def propose(self, committed, budget):
        if broken == "not_a_tree":
            return None
        tree = TokenTree.rooted_at(committed[-1])
        if broken in ("over_budget", "outside_vocabulary"):
            tree.add_path(0, [509] if broken == "outside_vocabulary" else [7] * 100)
        elif broken == "undeclared_extra":
            tree.extras.append(ExtraToken(token=7, pos_offset=1, seqs=(0,)))
        elif broken == "many_leaves":
            for token in range(6):
                tree.add(0, token)
        elif broken == "empty":
            tree.tokens, tree.parents, tree.depths = [], [], []
        elif broken in ("extra_gap", "many_extras"):
            tree.n_extra_seqs = 1
            tree.extras = ([ExtraToken(token=7, pos_offset=3, seqs=(0,))] if broken == "extra_gap" else
                           [ExtraToken(token=7, pos_offset=1 + i, seqs=(0,)) for i in range(70)])
        elif broken == "bad_parent":
            tree.add_path(0, [7, 8])
            tree.parents[2] = 5
        else:
            tree.add(0, 7, draft_probs=np.full(509, np.nan))
        return tree

    monkeypatch.setattr(PromptLookupProposer, "propose", propose)
    for adaptive in (False, True):   # bare, and through the scheduler (which read the tree first)
        with tiny_engine(tiny_target, adaptive=True, n_seq_max=4) as engine:
            with pytest.raises(DrafterError, match=f"drafter 'prompt-lookup': {message}"):
                engine.generate(PROMPTS[0], max_tokens=8, method="prompt-lookup", options={"adaptive": adaptive})


@pytest.mark.parametrize("kind", ["numpy", "tuple", "short_dense_probs"])
def test_a_drafters_tree_of_other_sequence_types_is_taken(tiny_target, monkeypatch, kind: str) -> None:
    """A chain of numpy arrays or tuples ran before the whole tree was checked, and must still (it failed
    with numpy's "truth value ... ambiguous", or a false "depths must be 0, 1, 2"); so must a dense draft
    vector of a draft vocabulary a few ids shorter than the target's."""
    from ouroboros_local.proposers.prompt_lookup import PromptLookupProposer

    def propose(self, committed, budget):
        tokens = [committed[-1], *committed[-3:-1]][:budget + 1]
        if kind == "short_dense_probs":
            tree = TokenTree.rooted_at(committed[-1])
            if not budget:
                return tree
            probs = np.zeros(506)
            probs[tokens[1]] = 1.0
            tree.add(0, tokens[1], draft_probs=probs)
            return tree
        seq = np.asarray if kind == "numpy" else tuple
        return TokenTree(tokens=seq(tokens), parents=seq(range(-1, len(tokens) - 1)), depths=seq(range(len(tokens))))

    monkeypatch.setattr(PromptLookupProposer, "propose", propose)
    with tiny_engine(tiny_target) as engine:
        for sampling in (None, SamplingParams(temperature=1.0, seed=3)):
            base = engine.generate(PROMPTS[0], max_tokens=12, sampling=sampling)
            res = engine.generate(PROMPTS[0], max_tokens=12, method="prompt-lookup", sampling=sampling,
                                  options={"adaptive": False})
            assert res.stats.drafted > 0
            # a drawn draft is verified by rejection sampling: the target's distribution, not seeded plain
            # decoding's very tokens
            assert res.tokens == base.tokens or (sampling and kind == "short_dense_probs")


def test_overlap_is_off_on_a_cpu_and_for_proposers_with_extras(tiny_target) -> None:
    with tiny_engine(tiny_target) as engine:   # no GPU layers: llama_decode waits for the decode
        assert "overlap" not in engine.generate(PROMPTS[0], max_tokens=8, method="prompt-lookup").stats.extra
    with tiny_engine(tiny_target, overlap=True) as engine:
        assert "overlap" in engine.generate(PROMPTS[0], max_tokens=8, method="prompt-lookup").stats.extra
        # lookahead's window rides along with every round
        assert "overlap" not in engine.generate(PROMPTS[0], max_tokens=8, method="lookahead").stats.extra
    with tiny_engine(tiny_target, overlap=True, round_size=4) as engine:   # rounds filled with guesses
        assert "overlap" in engine.generate(PROMPTS[0], max_tokens=8, method="prompt-lookup").stats.extra


@pytest.mark.parametrize("method", ["prompt-lookup", "auto"])
def test_drafts_checked_by_the_step_sample_the_target_distribution(either_engine: Engine, tiny_target,
                                                                   method: str) -> None:
    # the prompt, its greedy answer, the prompt again: a lookup copies that answer, which the target
    # samples often (its first token in ~3 of 4 answers here), so steps accept and carry drafts (in
    # rounds of 4 the first pair is written by one round, filled with guesses, while its draft is judged)
    prompt = either_engine.prompt_tokens(PROMPTS[1])
    prompt = prompt + either_engine.generate(prompt, max_tokens=8).tokens + prompt
    params = SamplingParams(temperature=1.0, top_k=6, top_p=1.0, min_p=0.0)
    answers = assert_first_pairs_follow_the_target(either_engine, tiny_target, prompt, params, 1200,
                                                   method=method)
    kind = "drafts" if either_engine.config.round_size else "carried"
    assert sum(a.stats.extra["overlap"][kind] for a in answers) > 300


def test_seeded_auto_equals_seeded_vanilla_when_drafting_during_the_step(either_engine: Engine) -> None:
    """Each emitted token consumes one uniform, however it was drafted: the draft carried into the next
    round, or in rounds of 4 the draft's rest guessed in the next round."""
    answers = assert_seeded_equals_vanilla(either_engine, PROMPTS)
    assert sum(a.stats.extra["overlap"]["carried"] for a in answers) >= 3


def _step(token: int, vocab: int = 10) -> VerifyResult:
    rows = np.zeros((1, vocab), dtype=np.float32)
    rows[0, token] = 1.0
    return verify_step(TokenTree.rooted_at(0), rows, SamplingParams(), np.random.default_rng(0))


def test_the_two_rounds_of_a_carried_draft_are_one_verification() -> None:
    draft = TokenTree.rooted_at(0)
    draft.add_path(0, [1, 2, 3], source="a")
    draft.add_path(0, [4, 5], source="b")        # nodes 4, 5: a branch the step rules out
    draft.add_path(1, [6], source="a")           # node 6: a second child of node 1
    draft.classes.update({1: "x1", 2: "x2", 6: "x6"})
    rejected, child = walked(draft, [7])
    assert child is None and rejected.tree is draft and rejected.path == [0] and rejected.tokens == [7]
    assert rejected.predictions[0] == 7
    with pytest.raises(RuntimeError, match="never decoded"):
        rejected.predictions[1]
    step = _step(1)
    assert walked(draft, step.tokens) == (None, 1)
    rest = draft.below(1)
    assert rest.tokens == [1, 2, 3, 6] and rest.parents == [-1, 0, 1, 0] and rest.depths == [0, 1, 2, 1]
    assert rest.classes == {1: "x2", 3: "x6"} and 0 not in rest.sources
    rows = np.zeros((len(rest.tokens), 10), dtype=np.float32)
    for node, token in enumerate([2, 9, 0, 0]):   # the target writes 2 after 1, then 9 after 2
        rows[node, token] = 1.0
    path = [0, 1]
    second = verify_step(rest, rows, SamplingParams(), np.random.default_rng(0))
    second.path, second.accepted, second.bonus = path, [2], 9
    second.predictions = Predictions(rows)
    second.accepted_by_source = {"a": 1}
    whole = joined(draft, 1, second)
    assert whole.tree is draft and whole.path == [0, 1, 2] and whole.tokens == [1, 2, 9]
    assert whole.accepted_by_source == {"a": 2}
    assert [whole.predictions[i] for i in (0, 1, 2)] == [1, 2, 9] and len(whole.predictions) == 7
    with pytest.raises(RuntimeError, match="never decoded"):
        whole.predictions[4]


def test_looks_hidden_in_the_step_come_every_round() -> None:
    from ouroboros_local.calibration import CostModel
    from ouroboros_local.scheduler import Scheduler

    sched = Scheduler(CostModel(sizes=[1, 2, 4, 8, 16], seconds=[1.0, 2.0, 3.0, 4.0, 6.0]))
    sched.looks._dry["x"] = 6          # a request whose looks keep coming up dry: they thin out
    assert sched.looks.every("x", sched.costs.cost(1)) > 4
    sched.looks.hidden = True          # unless they cost nothing
    assert sched.looks.every("x", sched.costs.cost(1)) == 1


def test_by_default_overlap_follows_what_a_step_was_seen_to_wait_for(tiny_target) -> None:
    with tiny_engine(tiny_target) as engine:
        engine.generate(PROMPTS[0], max_tokens=12, method="vanilla")
        share = engine.target_ctx.step_wait_share()
        assert share is not None and share < 0.5          # a CPU computes inside llama_decode
        pl = engine.generate(PROMPTS[0], max_tokens=4, method="prompt-lookup")
        assert "overlap" not in pl.stats.extra
        engine.target_ctx.step_seconds = [0.1, 0.9]         # as a GPU's queued decodes would look
        assert "overlap" in engine.generate(PROMPTS[0], max_tokens=4, method="prompt-lookup").stats.extra
        engine.config = replace(engine.config, overlap=False)   # an explicit setting wins
        assert "overlap" not in engine.generate(PROMPTS[0], max_tokens=4, method="prompt-lookup").stats.extra


def test_a_round_observed_during_the_next_step_is_observed_when_no_step_follows(overlap_engine: Engine,
                                                                               monkeypatch) -> None:
    """Cancelled before the next round: the last round, whose observing waited for that round's decode,
    is observed all the same (a proposer feeding a shared pool must not miss the answer's end)."""
    from ouroboros_local.proposers.base import NoDraft

    seen = []
    monkeypatch.setattr(NoDraft, "observe", lambda self, committed, result: seen.append(len(committed)))
    rounds = iter(range(10**6))
    # asked once after the prefill, then before each round
    res = overlap_engine.generate(PROMPTS[0], max_tokens=20, method="vanilla", cancel=lambda: next(rounds) >= 4)
    assert res.stats.finish_reason == "cancelled" and len(res.tokens) == 3
    assert len(seen) == 3 and seen[-1] == len(overlap_engine.prompt_tokens(PROMPTS[0])) + 3


def test_a_round_that_wrote_several_tokens_checks_the_draft_levels_it_wrote() -> None:
    draft = TokenTree.rooted_at(0)
    draft.add_path(0, [1, 2, 3], source="a")     # nodes 1, 2, 3
    draft.add_path(0, [4, 5], source="b")        # nodes 4, 5
    left, node = walked(draft, [1, 2, 9])        # the path leaves the draft below node 2
    assert node is None and left.path == [0, 1, 2] and left.tokens == [1, 2, 9]
    assert left.accepted_by_source == {"a": 2} and [left.predictions[i] for i in (0, 1, 2)] == [1, 2, 9]
    left, node = walked(draft, [1, 2, 3, 7])     # all of it accepted, then the target's own token
    assert node is None and left.path == [0, 1, 2, 3] and left.tokens == [1, 2, 3, 7]
    assert walked(draft, [1, 2]) == (None, 2)
    rest = draft.below(2)                        # 2 -> 3: the next round verifies the rest
    rows = np.zeros((len(rest.tokens), 10), dtype=np.float32)
    rows[0, 3] = rows[1, 8] = 1.0
    second = VerifyResult(tree=rest, path=[0, 1], accepted=[3], bonus=8, predictions=Predictions(rows),
                          accepted_by_source={"a": 1})
    whole = joined(draft, 2, second)
    assert whole.path == [0, 1, 2, 3] and whole.tokens == [1, 2, 3, 8] and whole.accepted_by_source == {"a": 3}
    assert [whole.predictions[i] for i in (0, 1, 2, 3)] == [1, 2, 3, 8]
    with pytest.raises(RuntimeError, match="never decoded"):
        whole.predictions[4]




@pytest.mark.parametrize("method", [m for m in method_names() if m != "vanilla"])
def test_every_method_is_greedy_lossless_drafting_during_filled_rounds(overlap_rounds_engine: Engine,
                                                                       method: str) -> None:
    assert_greedy_equals_vanilla(overlap_rounds_engine, PROMPTS, method, max_tokens=40)


def test_in_rounds_of_one_size_every_round_drafts_while_it_decodes(overlap_rounds_engine: Engine) -> None:
    """Every round decodes four tokens, the root and guesses, while the next draft is made; the draft's
    tokens past what the round wrote are the next round's guesses, so no draft waits in the open."""
    first = overlap_rounds_engine.generate(PROMPTS[1], max_tokens=40, method="suffix")
    again = overlap_rounds_engine.generate(PROMPTS[1], max_tokens=40, method="suffix")
    assert again.tokens == first.tokens
    ahead = again.stats.extra["overlap"]
    assert ahead["drafts"] >= 1 and ahead["carried"] >= 1
    split = again.stats.extra["time_split"]
    assert split["ahead"][0] == again.stats.target_passes and split["propose"][1] == 0.0
    assert again.stats.target_passes + again.stats.accepted == len(again.tokens)
    assert again.stats.target_passes < len(again.tokens) / 2
    assert again.stats.extra["graphs_rebuilt"] <= 4   # one shape: the first rounds and the shortened last


def test_in_rounds_of_one_size_a_draft_is_judged_by_what_its_round_wrote() -> None:
    from ouroboros_local.verify import judged

    draft = TokenTree.rooted_at(0)
    draft.add_path(0, [1, 2, 3, 4], source="a")   # nodes 1-4
    draft.add_path(1, [7], source="b")            # node 5: beside the path
    verdict, node = judged(draft, [1, 2])         # the round wrote the draft's first two tokens
    assert node == 2 and [draft.tokens[i] for i in draft.first_path(node)] == [3, 4]
    # the verdict is on the nodes above node 2's depth (its token is the bonus): node 1 accepted
    assert verdict.tree.tokens == [0, 1] and verdict.path == [0, 1] and verdict.tokens == [1, 2]
    assert verdict.accepted_by_source == {"a": 1} and [verdict.predictions[i] for i in (0, 1)] == [1, 2]
    left, node = judged(draft, [1, 9])            # the path left the draft: walked's verdict
    assert node is None and left.tree is draft and left.path == [0, 1] and left.tokens == [1, 9]


def test_an_error_mid_round_leaves_the_cache_as_committed(either_engine: Engine, monkeypatch) -> None:
    """A proposer that raises while a round decodes (any error, Ctrl-C): the round's cells were written
    but never committed; the next request, which extends the cached text as a chat turn does, must
    decode as on a fresh cache (once: llama_decode failed, or stray cells read as context)."""
    from ouroboros_local.proposers.draft_model import DraftModelProposer

    propose, calls = DraftModelProposer.propose, []

    def failing(self, committed, budget):
        calls.append(budget)
        if len(calls) == 3:
            raise RuntimeError("injected")
        return propose(self, committed, budget)

    monkeypatch.setattr(DraftModelProposer, "propose", failing)
    with pytest.raises(RuntimeError, match="injected"):
        either_engine.generate(PROMPTS[0], max_tokens=30, method="speculative")
    monkeypatch.setattr(DraftModelProposer, "propose", propose)
    either_engine.kv.check()
    follow_up = list(either_engine.kv.cached) + either_engine.tokenize(" and", add_special=False)
    got = either_engine.generate(follow_up, max_tokens=16, method="vanilla").tokens
    either_engine.kv.reset()
    assert got == either_engine.generate(follow_up, max_tokens=16, method="vanilla").tokens
