"""Prompt lookup proposer: n-gram index, tree building, and greedy equality on a fake target."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from ouroboros_local.drafting import would_add_leaf
from ouroboros_local.errors import ParameterError
from ouroboros_local.history import History
from ouroboros_local.proposers import check_options
from ouroboros_local.pool import PhrasePool
from ouroboros_local.proposers.prompt_lookup import NgramIndex, PromptLookupProposer, create
from ouroboros_local.testing.engines import E2E_PROMPTS
from ouroboros_local.testing.sim import FakeTarget, assert_greedy_under_budgets, make_setup, simulate
from ouroboros_local.tree import TokenTree, check_layout, layout


def started(prop: PromptLookupProposer, prompt: list[int], **setup_kw) -> PromptLookupProposer:
    prop.begin(prompt, make_setup(**setup_kw))
    return prop


def test_index_is_incremental_and_most_recent_first() -> None:
    seq = [1, 2, 3, 9, 1, 2, 4, 7, 1, 2]
    idx = NgramIndex(1, 3)
    for n in range(1, len(seq) + 1):           # grow token by token
        idx.sync(seq[:n])
    full = NgramIndex(1, 3)
    full.sync(seq)
    assert idx._maps == full._maps
    conts = list(idx.continuations(3))
    # suffix (1, 2): 2-gram matches ending at 5 then 1 (most recent first); no 3-gram (7, 1, 2) before
    assert conts[0] == (2, [4, 7, 1])
    assert conts[1] == (2, [3, 9, 1])
    # the 1-gram (2) ends only where the 2-gram does: nothing more
    assert len(conts) == 2
    # a diverging sequence (new generation) rebuilds
    idx.sync([5, 6, 5])
    assert list(idx.continuations(2)) == [(1, [6, 5])]


def test_longest_match_first_among_one_ngram() -> None:
    # the 2-gram (8, 9) ends at 2 (after 6, 7: matches the tail for 4 tokens) and at 6 (after 5: 2 tokens)
    seq = [6, 7, 8, 9, 1, 5, 8, 9, 2, 6, 7, 8, 9]
    idx = NgramIndex(1, 2)
    idx.sync(seq)
    conts = list(idx.continuations(2))
    assert conts == [(4, [1, 5]), (2, [2, 6])]   # the longer, older match first; the 1-gram (9) adds nothing


def test_copy_past_the_end_repeats_the_period() -> None:
    idx = NgramIndex(1, 2)
    idx.sync([8, 1, 2, 1, 2])
    n, cont = next(idx.continuations(5))
    assert n == 2 and cont == [1, 2, 1, 2, 1]
    idx.sync([7, 7, 7])
    assert next(idx.continuations(4)) == (2, [7, 7, 7, 7])


def test_chain_from_the_longest_most_recent_match() -> None:
    prop = started(PromptLookupProposer(gamma=4), [1, 2, 3, 4, 5, 6, 9, 2, 3, 7, 1, 2, 3])
    tree = prop.propose([1, 2, 3, 4, 5, 6, 9, 2, 3, 7, 1, 2, 3], budget=10)
    assert tree.tokens == [3, 4, 5, 6, 9]          # 3-gram (1, 2, 3) wins over the later 2-gram (2, 3)
    assert tree.is_chain()
    assert not tree.draft_probs                     # deterministic nodes: sample-and-match
    assert set(tree.sources.values()) == {"prompt-lookup"}
    assert prop.propose([1, 2, 3, 4, 5, 6, 9, 2, 3, 7, 1, 2, 3], budget=2).tokens == [3, 4, 5]
    assert prop.propose([1, 2, 3, 4, 5, 6, 9, 2, 3, 7, 1, 2, 3], budget=0).tokens == [3]
    # no match at all: root only (the engine then does a plain step)
    prop2 = started(PromptLookupProposer(), [1, 2, 3])
    assert prop2.propose([1, 2, 3], budget=8).tokens == [3]


def test_branches_respect_budget_and_sequence_limits() -> None:
    prompt = [5, 1, 2, 3, 1, 2, 4, 4, 1, 2, 6, 6, 1, 2, 3, 8, 1, 2]
    prop = started(PromptLookupProposer(gamma=3, max_branches=3), prompt)
    tree = prop.propose(prompt, budget=20)
    check_layout(layout(tree))
    assert len(tree.leaves()) == 3
    paths = sorted(tuple(tree.tokens[i] for i in tree.path_to(leaf)[1:]) for leaf in tree.leaves())
    # the 2-gram (1, 2) ended at 13, 9, 5 and 2: the three most recent give the branches
    assert paths == [(3, 8, 1), (4, 4, 1), (6, 6, 1)]
    small = prop.propose(prompt, budget=4)
    assert small.n_candidates <= 4
    # the context's sequence ids cap the leaves too
    prop_b = started(PromptLookupProposer(gamma=3, max_branches=8), prompt, max_branches=2)
    assert len(prop_b.propose(prompt, budget=20).leaves()) == 2
    # shared prefixes merge: continuations 3 8 1 and 3 1 2 share the node 3
    prompt2 = [1, 2, 3, 1, 2, 9, 1, 2, 3, 8, 1, 2]
    prop_c = started(PromptLookupProposer(gamma=3, max_branches=4, min_ngram=2, max_ngram=2), prompt2)
    tree_c = prop_c.propose(prompt2, budget=20)
    assert tree_c.children(0) and len(tree_c.children(0)) == 2
    assert sorted(tree_c.tokens[i] for i in tree_c.children(0)) == [3, 9]


def test_would_add_leaf() -> None:
    tree = TokenTree.rooted_at(0)
    assert would_add_leaf(tree, [1, 2]) is False       # extends the root leaf
    tree.add_path(0, [1, 2])
    assert would_add_leaf(tree, [1, 2]) is None
    assert would_add_leaf(tree, [1, 2, 3]) is False
    assert would_add_leaf(tree, [1, 5]) is True


def test_drafts_stop_at_end_of_generation_tokens() -> None:
    prompt = [1, 2, 99, 4, 5, 1, 2]
    prop = started(PromptLookupProposer(gamma=5), prompt, eog=frozenset({99}))
    assert prop.propose(prompt, budget=10).tokens == [2, 99]


def test_pool_is_consulted_and_fed() -> None:
    pool = PhrasePool(phrase_len=3)
    pool.add([7], (8, 9, 10))
    prompt = [1, 2, 3, 4, 7]
    prop = started(PromptLookupProposer(pool=pool), prompt)
    assert pool.lookup([1]) == [(2, 3, 4)]          # the prompt's n-grams went in
    tree = prop.propose(prompt, budget=8)
    assert tree.tokens == [7, 8, 9, 10]              # no match in the context: the pool's phrase
    assert set(tree.sources.values()) == {"pool"}
    committed = prompt + [8, 9, 10, 11]
    result = SimpleNamespace(tree=tree, path=[0, 1, 2, 3], accepted=[8, 9, 10], bonus=11,
                             predictions=np.array([8, 9, 10, 11]), extra_predictions=None, winner_seq=0)
    prop.observe(committed, result)
    assert pool.lookup([8]) == [(9, 10, 11)]
    assert pool.lookup([4]) == [(7, 8, 9)]
    assert prop.stats()["pl_pool_phrases"] == 3
    # without feeding
    pool2 = PhrasePool()
    started(PromptLookupProposer(pool=pool2, feed_pool=False), [1, 2, 3, 4, 5, 6])
    assert len(pool2) == 0


def test_parameters_and_factory() -> None:
    with pytest.raises(ParameterError):
        PromptLookupProposer(min_ngram=3, max_ngram=2)
    with pytest.raises(ParameterError, match="gamma"):
        check_options("prompt-lookup", {"gamma": 0})
    engine = SimpleNamespace(history=History(None))   # the part of a DraftingContext these factories use
    prop = create(engine, check_options("prompt-lookup", {"gamma": 5, "max_branches": 2, "pool": "h.pool"}))
    assert isinstance(prop, PromptLookupProposer) and prop.gamma == 5 and prop.max_branches == 2
    assert prop.pool is engine.history.phrase_pool    # a pool file makes the history pool a source
    assert create(engine, check_options("prompt-lookup", {})).pool is None
    with pytest.raises(ParameterError):
        check_options("prompt-lookup", {"pool": True})
    with pytest.raises(ParameterError, match="min_ngram"):
        create(engine, check_options("prompt-lookup", {"min_ngram": 4, "max_ngram": 2}))


# ---- end to end on a fake target ----------------------------------------------------------------------

def repetitive_corpus(seed: int = 0, vocab: int = 40, length: int = 400) -> list[int]:
    rng = np.random.default_rng(seed)
    motifs = [rng.integers(0, vocab, int(rng.integers(4, 9))).tolist() for _ in range(6)]
    out: list[int] = []
    while len(out) < length:
        out += motifs[int(rng.integers(len(motifs)))]
        if rng.random() < 0.3:
            out.append(int(rng.integers(vocab)))
    return out


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("kw", [{}, {"max_branches": 3}, {"max_branches": 4, "gamma": 3, "min_ngram": 2}])
def test_greedy_equality_on_a_fake_target(seed: int, kw: dict) -> None:
    vocab = 40
    corpus = repetitive_corpus(seed, vocab)
    target = FakeTarget(corpus, vocab)
    prompt = corpus[:60]
    reference = target.greedy(prompt, 80)
    out, st = simulate(PromptLookupProposer(**kw), target, prompt, 80)
    assert out == reference
    assert st.accepted > 0
    assert st.passes < 80


def test_small_batches_and_few_sequences() -> None:
    corpus = repetitive_corpus(7)
    target = FakeTarget(corpus, 40)
    prompt = corpus[:50]
    assert_greedy_under_budgets(lambda: PromptLookupProposer(max_branches=4), target, prompt, 40,
                                ((1, 1), (2, 2), (5, 3)))


# ---- end to end through the engine on a tiny generated GGUF (llama.cpp) ---------------------------------



@pytest.fixture(scope="module")
def engine(tiny_target):
    pytest.importorskip("llama_cpp")
    from ouroboros_local.engine import Engine, EngineConfig
    from ouroboros_local.llama import Model

    eng = Engine(Model(tiny_target), None, EngineConfig(n_ctx=512, n_batch=64, n_seq_max=8))
    eng.check_kv = True
    yield eng
    eng.close()


@pytest.mark.parametrize("options", [{}, {"max_branches": 3, "gamma": 4}, {"pool": "FILE", "min_ngram": 2}])
def test_engine_greedy_equality(engine, options: dict, tmp_path) -> None:
    if options.get("pool") == "FILE":   # the history pool, persisted after each answer
        options = {**options, "pool": str(tmp_path / "history.pool")}
    for prompt in E2E_PROMPTS:
        base = engine.generate(prompt, max_tokens=40)
        res = engine.generate(prompt, max_tokens=40, method="prompt-lookup", options=dict(options))
        assert res.tokens == base.tokens
        assert res.stats.target_passes + res.stats.accepted == base.stats.target_passes
        assert res.stats.extra["pl_proposals"] >= 0


def test_chain_nodes_are_labelled_by_match_length_and_depth() -> None:
    # "1 2 3 4 5 ... 1 2 3" -> a 3-gram match copies "4 5 6"; nodes carry ctx3 and their depth
    prop = PromptLookupProposer(max_ngram=3, gamma=3)
    prompt = [1, 2, 3, 4, 5, 6, 9, 9, 1, 2, 3]
    prop.begin(prompt, make_setup())
    tree = prop.propose(prompt, budget=3)
    assert tree.tokens == [3, 4, 5, 6]
    assert tree.classes == {1: "ctx3d1", 2: "ctx3d2", 3: "ctx3d3"}
    # only a 1-gram match: "7" was followed by "8" once
    prop.begin([7, 8, 5, 7], make_setup())
    tree = prop.propose([7, 8, 5, 7], budget=2)
    assert tree.tokens[:2] == [7, 8] and tree.classes[1] == "ctx1d1"


@pytest.mark.parametrize("seed", range(3))
def test_first_class_is_the_class_of_the_proposals_first_node(seed: int) -> None:
    # a look asks first_class before it proposes (Scheduler._look_promising): it must name the class
    # the proposal's first node gets, or "" where the proposal is empty
    rng = np.random.default_rng(seed)
    seq = [int(t) for t in rng.integers(0, 6, 300)]
    eog = frozenset({5})
    peek, prop = PromptLookupProposer(), PromptLookupProposer()
    peek.begin(seq[:2], make_setup(eog=eog))
    prop.begin(seq[:2], make_setup(eog=eog))
    for n in range(2, len(seq)):
        tree = prop.propose(seq[:n], 16)
        assert peek.first_class(seq[:n]) == (tree.classes[1] if tree.n_candidates else ""), n


def test_first_class_defers_to_the_proposal_where_a_pool_may_answer() -> None:
    prop = started(PromptLookupProposer(pool=PhrasePool()), [1, 2, 3])
    assert prop.first_class([1, 2, 3]) is None


def test_an_index_kept_for_the_next_call_follows_a_continued_prompt_as_a_fresh_build_would() -> None:
    """A chat's next turn continues the text the last call indexed: it was indexed from scratch at every
    call (30 ms a turn at 6,000 tokens); a prompt that does not continue it is indexed afresh."""
    rng = np.random.default_rng(5)
    first = rng.integers(0, 12, 300).tolist()
    turn = first + rng.integers(0, 12, 40).tolist()
    for second in (turn, rng.integers(0, 12, 320).tolist(), first[:200], first[:-1] + [99] + first[-1:]):
        kept = NgramIndex(1, 3)
        kept.follow(first)
        kept.follow(second)
        fresh = NgramIndex(1, 3)
        fresh.sync(second)
        assert kept.tokens == fresh.tokens and kept._maps == fresh._maps and kept._indexed == fresh._indexed


def test_a_pool_is_fed_only_what_a_continued_prompt_adds() -> None:
    pool = PhrasePool(key_len=1, max_per_key=8, phrase_len=4)
    earlier = list(range(50))
    pool.add_ngrams(earlier, 5)
    assert pool.fed_before(earlier + [7, 8, 9], 5) == 50
    assert pool.fed_before(earlier + [7], 3) == 0                      # another n-gram size
    assert pool.fed_before([1] + earlier[1:] + [7], 5) == 0            # not its continuation
    assert pool.fed_before(earlier[:30], 5) == 0


def test_a_chat_s_turns_reuse_the_index_and_keep_plain_decoding_s_tokens(engine) -> None:
    """Each call's context indexes (prompt lookup's, the suffix trie) continue the last call's where its
    prompt continues that call's text; the answers stay plain decoding's."""
    from ouroboros_local.suffix_trie import SuffixTrie

    prompt = engine.tokenize(E2E_PROMPTS[1])
    appended: list[int] = []
    append = SuffixTrie.append
    for method in ("auto", "suffix", "prompt-lookup", "ouroboros"):
        engine.history.clear()
        conversation = list(prompt)
        for turn in range(3):
            result = engine.generate(conversation, max_tokens=12, method=method)
            assert result.tokens == engine.generate(conversation, max_tokens=12, method="vanilla").tokens
            conversation += result.tokens + engine.tokenize(f" and then {turn}", add_special=False)
        appended.clear()
        SuffixTrie.append = lambda self, token: (appended.append(token), append(self, token))[1]
        try:
            engine.generate(conversation, max_tokens=4, method=method)
        finally:
            SuffixTrie.append = append
        if method in ("auto", "suffix", "ouroboros"):   # the new turn's tokens only, and the answer's
            assert 0 < len(appended) < 30 < len(conversation)
        if method != "suffix":
            kept = [i for i in engine.history._context_indexes.values() if isinstance(i, NgramIndex)]
            assert any(index.tokens[:len(conversation)] == conversation for index in kept)


def test_an_index_a_ctrl_c_cut_short_is_built_afresh_not_continued() -> None:
    """Interrupted midway, the kept index was continued by the next call with n-grams counted twice."""
    class CtrlCAfter(dict):
        calls = 0

        def get(self, key, default=None):
            CtrlCAfter.calls += 1
            if CtrlCAfter.calls == 50:
                raise KeyboardInterrupt
            return super().get(key, default)

    tokens = np.random.default_rng(2).integers(0, 9, 200).tolist()
    index = NgramIndex(1, 3)
    index._maps[2] = CtrlCAfter()
    with pytest.raises(KeyboardInterrupt):
        index.follow(tokens)
    index.follow(tokens)
    fresh = NgramIndex(1, 3)
    fresh.sync(tokens)
    assert index.tokens == fresh.tokens and index._maps == fresh._maps
