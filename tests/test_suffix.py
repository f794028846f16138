"""Suffix drafting: the suffix trie (counts, pointers, incremental growth, eviction, memory bound), the
draft trees (shape, budget, branches, classes, EOG), the global trie's persistence, option checks, and
greedy equality with plain decoding (fake target and tiny GGUF through the engine)."""

from __future__ import annotations

import itertools
import random
import tracemalloc
from pathlib import Path
from types import SimpleNamespace

import pytest

from ouroboros_local.errors import MethodOptionError, ParameterError, PoolError
from ouroboros_local.history import History
from ouroboros_local.proposers import check_options, method_names
from ouroboros_local.proposers.suffix import OPTIONS, SuffixProposer, create, node_class, suffix_file
from ouroboros_local.suffix_trie import Matcher, SuffixCache, SuffixTrie, load_global, save_global
from ouroboros_local.testing.engines import E2E_PROMPTS
from ouroboros_local.testing.sim import FakeTarget, assert_greedy_under_budgets, make_setup, simulate
from ouroboros_local.tree import check_layout, layout


def occurrences(docs: list[list[int]], sub: list[int]) -> int:
    n = len(sub)
    return sum(1 for d in docs for i in range(len(d) - n + 1) if d[i:i + n] == sub)


def assert_counts(trie: SuffixTrie, docs: list[list[int]], vocab: int) -> None:
    for length in range(1, trie.depth + 1):
        for sub in itertools.product(range(vocab), repeat=length):
            assert trie.count(list(sub)) == occurrences(docs, list(sub)), sub


def node_strings(trie: SuffixTrie) -> dict[int, list[int]]:
    out = {0: []}
    stack = [0]
    while stack:
        node = stack.pop()
        for child in trie.children(node):
            out[child] = out[node] + [trie._token[child]]
            stack.append(child)
    return out


# ---- the trie ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(40))
def test_counts_equal_brute_force_while_growing_and_after_evicting_the_oldest(seed: int) -> None:
    rng = random.Random(seed)
    depth, vocab = rng.choice([(1, 3), (2, 3), (3, 3), (4, 2), (5, 2)])
    trie = SuffixTrie(depth)
    docs: list[list[int]] = []
    for _ in range(rng.randint(1, 4)):
        doc = [rng.randrange(vocab) for _ in range(rng.randint(0, 25))]
        trie.start_document()
        docs.append([])
        for tok in doc:                      # token by token: the counts hold after every append
            trie.append(tok)
            docs[-1].append(tok)
            if rng.random() < 0.15:
                trie.check()
                assert_counts(trie, docs, vocab)
        trie.end_document()
    trie.check()
    assert_counts(trie, docs, vocab)
    for doc_id in sorted(trie.docs):
        trie.remove_document(doc_id)
        docs.pop(0)
        trie.check()
        assert_counts(trie, docs, vocab)
    assert trie.n_nodes == 1                  # everything evicted: the root alone


@pytest.mark.parametrize("seed", range(12))
def test_pointers_give_the_most_recent_continuing_occurrence(seed: int) -> None:
    rng = random.Random(100 + seed)
    trie = SuffixTrie(4)
    for _ in range(4):
        trie.start_document()
        trie.extend([rng.randrange(3) for _ in range(rng.randint(5, 30))])
        trie.end_document()
    if rng.random() < 0.5:
        trie.remove_document(min(trie.docs))
    for node, string in node_strings(trie).items():
        if node == 0:
            continue
        n = len(string)
        continuing = [(d, i + n) for d, text in trie.docs.items() for i in range(len(text) - n)
                      if text[i:i + n] == string]
        doc, pos = trie._doc[node], trie._pos[node]
        if trie._count[node] == 1 and doc >= 0:   # a lazy leaf: its one occurrence
            assert trie.docs[doc][pos - n:pos] == string
        elif continuing:
            assert (doc, pos) == max(continuing), string
        else:
            assert doc == -1 or pos >= len(trie.docs[doc])


def test_longest_match_and_continuations_by_frequency() -> None:
    trie = SuffixTrie(6)
    text = [1, 2, 3, 4, 9, 1, 2, 3, 4, 9, 1, 2, 3, 5, 7, 2, 3, 4]
    trie.extend(text)
    # the open document's repeated suffixes: [], [4], [3 4], [2 3 4], [1 2 3 4]? no: "1 2 3 4" does not
    # end the text (7 2 3 4 does), so the longest match is "2 3 4"
    states = trie.active_states()
    assert len(states) - 1 == 3
    conts = trie.continuations(states[3], 4)
    assert [(tok, freq, support) for tok, freq, support, _ in conts] == [(9, 1.0, 2)]
    conts = trie.continuations(states[1], 4)   # after "4": 9 twice (the open end does not continue)
    assert [(t, f) for t, f, _, _ in conts] == [(9, 1.0)]
    # "2 3" occurs 4 times, all continuing: with 4 three times, with 5 once
    two_three = trie.step(trie.step((0, -1, 0), 2), 3)
    conts = trie.continuations(two_three, 4)
    assert [(t, f, s) for t, f, s, _ in conts] == [(4, 0.75, 4), (5, 0.25, 4)]
    assert trie.count([2, 3]) == 4 and trie.count([2, 3, 4]) == 3


def test_incremental_growth_equals_a_fresh_build() -> None:
    rng = random.Random(5)
    text = [rng.randrange(4) for _ in range(300)]
    grown = SuffixTrie(5)
    for i in range(0, len(text), 7):
        grown.extend(text[i:i + 7])
        fresh = SuffixTrie(5)
        fresh.extend(text[:i + 7])
        assert [grown._depth[n] for n, _, _ in grown.active_states()] == \
            [fresh._depth[n] for n, _, _ in fresh.active_states()]
        assert grown.n_nodes == fresh.n_nodes
    grown.check()


def test_matcher_finds_the_longest_match_in_earlier_documents() -> None:
    trie = SuffixTrie(8)
    trie.rebuild_from([[5, 6, 7, 8, 9], [1, 6, 7, 3]])
    m = Matcher(trie)
    for tok in [4, 4, 6, 7]:
        m.push(tok)
    assert len(m.states) - 1 == 2                      # "6 7"
    conts = trie.continuations(m.states[2], 4)
    assert sorted((t, f) for t, f, _, _ in conts) == [(3, 0.5), (8, 0.5)]
    m.push(8)
    assert len(m.states) - 1 == 3                      # "6 7 8", inside the lazy leaf of document 0
    assert [t for t, _, _, _ in trie.continuations(m.states[3], 1)] == [9]
    m.push(2)
    assert len(m.states) == 1


def test_global_cache_evicts_the_oldest_and_stays_bounded() -> None:
    cache = SuffixCache(max_requests=5, max_tokens=400, depth=8)
    rng = random.Random(3)
    outputs = []
    for i in range(40):
        out = [rng.randrange(50) for _ in range(rng.randint(20, 120))]
        outputs.append(out)
        cache.add(out)
        assert cache.n_requests <= 5 and cache.n_tokens <= 400
        assert cache.n_nodes <= cache.n_tokens * (cache.trie.depth + 1) + 1
    cache.trie.check()
    kept = cache.documents()
    assert kept == outputs[-len(kept):]                  # the newest, in order
    assert cache.trie.count(outputs[0][:6]) == occurrences(kept, outputs[0][:6])
    # one request longer than the token cap keeps its last max_tokens tokens
    cache.add(list(range(1000)))
    assert cache.documents() == [list(range(600, 1000))]


def test_memory_of_the_global_trie_is_bounded_on_repetitive_outputs() -> None:
    """Repetitive text is the worst case (up to D + 1 nodes per token); the caps bound it all the same."""
    motif = list(range(100, 137))
    cache = SuffixCache(max_requests=1000, max_tokens=3000)
    tracemalloc.start()
    try:
        peaks = []
        for i in range(80):
            cache.add((motif * 9)[i % 7:][:300] + [i])     # 301 tokens: 9 requests fit
            peaks.append(tracemalloc.get_traced_memory()[0])
    finally:
        tracemalloc.stop()
    assert cache.n_tokens <= 3000 and cache.n_requests == 9
    assert cache.n_nodes <= cache.n_tokens * (cache.trie.depth + 1) + 1
    # full after 9 requests; afterwards the memory stays flat (eviction frees what insertion takes)
    assert max(peaks[40:]) < 1.3 * max(peaks[10:20])
    assert max(peaks) < 20 * 2**20
    cache.trie.check()


# ---- draft trees ------------------------------------------------------------------------------------------

def started(prop: SuffixProposer, prompt: list[int], **setup_kw) -> SuffixProposer:
    prop.begin(list(prompt), make_setup(**setup_kw))
    return prop


def test_tree_follows_the_most_frequent_continuation_with_branches() -> None:
    # "1 2" was followed by 3 4 5 twice and by 6 7 once
    prompt = [1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5, 0, 1, 2, 6, 7, 0, 9, 1, 2]
    prop = started(SuffixProposer(max_branches=2, spec_offset=16), prompt)
    tree = prop.propose(prompt, budget=20)
    check_layout(layout(tree))
    assert tree.tokens[0] == 2
    first = tree.children(0)
    assert [tree.tokens[i] for i in first] == [3, 6]       # the likelier branch first
    paths = sorted(tuple(tree.tokens[i] for i in tree.path_to(leaf)[1:]) for leaf in tree.leaves())
    assert paths[0][:4] == (3, 4, 5, 0) and paths[1][:2] == (6, 7)
    assert len(tree.leaves()) == 2
    assert set(tree.sources.values()) == {"suffix"}
    assert set(tree.classes) == set(range(1, len(tree.tokens)))
    assert tree.classes[first[0]] == "sx m1 f1 d1"        # 2 of 3 after a 2-token match
    assert tree.classes[first[1]] == "sx m1 f0 d1"
    assert not tree.draft_probs


def test_tree_respects_budget_branches_depth_and_sequences() -> None:
    # "0 1" was followed by 8 different phrases
    prompt = [t for k in range(2, 10) for t in (0, 1, k, k + 10, k + 20, 30 + k)] + [0, 1]
    prop = started(SuffixProposer(max_branches=3, max_depth=5, min_match=1, spec_factor=8.0, min_prob=0.0),
                   prompt)
    for budget in (0, 1, 2, 5, 13, 40):
        tree = prop.propose(prompt, budget)
        check_layout(layout(tree))
        assert tree.tokens[0] == prompt[-1]
        assert tree.n_candidates <= budget
        assert len(tree.leaves()) <= 3
        assert tree.max_depth <= 5
    assert prop.propose(prompt, 40).n_candidates > 5      # a wide tree where the budget allows
    narrow = started(SuffixProposer(max_branches=8, min_match=1, min_prob=0.0), prompt, max_branches=2)
    assert len(narrow.propose(prompt, 40).leaves()) <= 2
    small = started(SuffixProposer(max_branches=8, min_match=1, min_prob=0.0), prompt, max_tree_nodes=3)
    assert small.propose(prompt, 40).n_candidates <= 3


def test_tree_size_grows_with_the_match_length() -> None:
    block = list(range(10, 40))
    prompt = block + [1, 2] + block[:2]
    prop = started(SuffixProposer(spec_factor=1.0, spec_offset=1, max_depth=64), prompt)
    short = prop.propose(prompt, budget=60)
    assert short.n_candidates == 3                          # 2-token match: 1 * 2 + 1 nodes
    longer = prompt + block[2:10]
    assert prop.propose(longer, budget=60).n_candidates == 11


def test_drafts_stop_at_end_of_generation_and_copy_periodically() -> None:
    prompt = [1, 2, 3, 99, 5, 1, 2]
    prop = started(SuffixProposer(spec_offset=10), prompt, eog=frozenset({99}))
    assert prop.propose(prompt, budget=10).tokens == [2, 3, 99]
    loop = [7, 8, 9, 7, 8, 9, 7, 8]
    prop = started(SuffixProposer(spec_offset=10, max_depth=7), loop)
    assert prop.propose(loop, budget=10).tokens == [8, 9, 7, 8, 9, 7, 8, 9]
    # no match of min_match tokens: the root alone (a plain step)
    assert started(SuffixProposer(), [1, 2, 3]).propose([1, 2, 3], budget=8).tokens == [3]


def test_classes_are_few() -> None:
    classes = {node_class(m, f, s, d, o) for m in range(1, 20) for f in (0.1, 0.5, 0.9, 1.0)
               for s in (1, 2, 5) for d in range(1, 20) for o in (False, True)}
    assert len(classes) == 72


def test_a_global_match_through_the_prompts_end_is_classed_as_an_opening() -> None:
    # every prompt ends with the same markers (7 8): an earlier answer's opening matches this answer's
    # through them and is classed apart from copies; a repeated request, whose whole text matches, is not
    cache = SuffixCache()
    first, other = [40, 41, 42, 43, 7, 8], [50, 51, 52, 53, 7, 8]
    earlier = started(SuffixProposer(cache), first)
    earlier._live = None
    earlier.observe(first + [1, 2, 3, 4, 5, 6], None)
    earlier.end()
    prop = started(SuffixProposer(cache), other)
    tree = prop.propose(other + [1], budget=8)       # "7 8 1": one of its three tokens is the answer's
    assert tree.tokens[1:3] == [2, 3]
    assert tree.classes[1] == node_class(3, 1.0, 1, 1, opening=True) != node_class(3, 1.0, 1, 1)
    assert prop.first_class(other + [1]) == tree.classes[1]
    assert prop.propose(other + [1, 2, 3, 4], budget=8).classes[1] == node_class(6, 1.0, 1, 1, opening=True)
    again = started(SuffixProposer(cache), first)
    tree = again.propose(first + [1], budget=8)
    assert tree.tokens[1:3] == [2, 3]
    assert tree.classes[1] == node_class(7, 1.0, 1, 1)


def test_the_global_trie_drafts_what_an_earlier_request_answered() -> None:
    cache = SuffixCache()
    answer = [40, 41, 42, 43, 44, 45, 46, 47]
    prompt = [1, 2, 3, 9]
    prop = SuffixProposer(cache, spec_offset=10)
    committed = list(prompt)
    prop.begin(committed, make_setup())                  # a request that answered ``answer``
    committed += answer[:5]
    prop.observe(committed, None)
    committed += answer[5:]                              # the last round is not observed
    prop.end()
    assert cache.documents() == [prompt + answer]         # the prompt's tail (<= D tokens), the answer
    prop2 = started(SuffixProposer(cache, spec_offset=10), [5, 5, 40, 41])
    tree = prop2.propose([5, 5, 40, 41], budget=10)
    assert tree.tokens == [41, 42, 43, 44, 45, 46, 47]
    assert prop2.stats()["sx_global"] == 1 and prop2.stats()["sx_global_requests"] == 1


# ---- persistence ------------------------------------------------------------------------------------------

def test_persistence_round_trip_and_refusal(tmp_path: Path) -> None:
    cache = SuffixCache(max_requests=3)
    for i in range(5):
        cache.add([i, i + 1, i + 2, 7, 8, 9])
    path = tmp_path / "history.suffix"
    save_global(cache, path, "fp-one")
    assert [p.name for p in tmp_path.iterdir()] == ["history.suffix"]      # no temp file left
    loaded = load_global(path, "fp-one")
    assert loaded.documents() == cache.documents()
    assert loaded.trie.count([7, 8, 9]) == 3
    with pytest.raises(PoolError) as exc:
        load_global(path, "fp-two")
    assert "another tokenizer" in str(exc.value) and "\n" not in str(exc.value)
    data = path.read_bytes()
    path.write_bytes(data[:-3])
    with pytest.raises(PoolError, match="truncated or corrupt"):
        load_global(path, "fp-one")
    path.write_bytes(b"garbage")
    with pytest.raises(PoolError, match="not a suffix history"):
        load_global(path, "fp-one")
    assert load_global_limits(cache, tmp_path) == 3     # smaller limits do not cut what a file holds


def load_global_limits(cache: SuffixCache, tmp_path: Path) -> int:
    path = tmp_path / "small.suffix"
    save_global(cache, path, "fp")
    return load_global(path, "fp", max_requests=2).n_requests


# ---- options ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name,value", [("max_depth", 0), ("max_depth", 65), ("max_depth", 2.5),
                                        ("max_branches", True), ("max_branches", "4"), ("min_match", 0),
                                        ("max_requests", 100_001), ("max_tokens", 0),
                                        ("spec_factor", float("nan")),
                                        ("min_prob", 1.5), ("spec_offset", -1)])
def test_bad_options_name_the_option(name: str, value: object) -> None:
    with pytest.raises(MethodOptionError, match=repr(name)):
        check_options("suffix", {name: value})


def test_options_defaults_and_shared_global() -> None:
    defaults = check_options("suffix", {})
    assert {o.name: defaults[o.name] for o in OPTIONS} == {o.name: o.default for o in OPTIONS}
    assert check_options("suffix", {"max_depth": 8.0})["max_depth"] == 8
    ctx = SimpleNamespace(history=History(None))
    a = create(ctx, check_options("suffix", {"max_depth": 8, "max_requests": 3}))
    b = create(ctx, check_options("suffix", {}))
    assert isinstance(a, SuffixProposer) and a.max_depth == 8
    assert a.cache is b.cache is ctx.history.suffix_cache
    assert b.cache.max_requests == 256                     # the largest request's limits hold
    with pytest.raises(ParameterError, match="'pool'"):
        check_options("suffix", {"pool": 5})
    assert "suffix" in method_names()


def test_a_folder_as_the_history_file_is_refused(tmp_path: Path) -> None:
    ctx = SimpleNamespace(history=History(None))   # it was taken, and FOLDER.suffix written beside it
    with pytest.raises(PoolError, match="is not a file"):
        create(ctx, check_options("suffix", {"pool": str(tmp_path)}))
    assert ctx.history.suffix_file is None and ctx.history.named_file is None


# ---- end to end -------------------------------------------------------------------------------------------

def repetitive_corpus(seed: int, vocab: int = 40, length: int = 400) -> list[int]:
    rng = random.Random(seed)
    motifs = [[rng.randrange(vocab) for _ in range(rng.randint(4, 9))] for _ in range(6)]
    out: list[int] = []
    while len(out) < length:
        out += motifs[rng.randrange(len(motifs))]
        if rng.random() < 0.3:
            out.append(rng.randrange(vocab))
    return out


WIDE = {"min_match": 1, "min_prob": 0.0, "spec_factor": 4.0}   # short matches, wide trees


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("kw", [{}, {"max_branches": 1}, WIDE])
def test_greedy_equality_on_a_fake_target(seed: int, kw: dict) -> None:
    corpus = repetitive_corpus(seed)
    target = FakeTarget(corpus, 40)
    prompt = corpus[:60]
    out, st = simulate(SuffixProposer(SuffixCache(), **kw), target, prompt, 80)
    assert out == target.greedy(prompt, 80)
    assert st.accepted / st.passes > 1.0                   # repetitive text: more than one token per pass
    assert_greedy_under_budgets(lambda: SuffixProposer(SuffixCache(), **kw), target, prompt, 40,
                                ((1, 1), (2, 2), (5, 3)))




@pytest.fixture(scope="module")
def engine(tiny_target):
    pytest.importorskip("llama_cpp")
    from ouroboros_local.testing.engines import tiny_engine

    eng = tiny_engine(tiny_target)
    yield eng
    eng.close()


@pytest.mark.parametrize("options", [{}, {"max_branches": 1}, WIDE])
def test_engine_greedy_equality(engine, options: dict) -> None:
    engine.history.clear()
    for prompt in E2E_PROMPTS:
        base = engine.generate(prompt, max_tokens=40)
        res = engine.generate(prompt, max_tokens=40, method="suffix", options=dict(options))
        assert res.tokens == base.tokens
        assert res.stats.target_passes + res.stats.accepted == base.stats.target_passes


def test_engine_second_pass_reuses_the_first_answer(engine) -> None:
    engine.history.clear()
    prompt = "Once upon a time"
    base = engine.generate(prompt, max_tokens=48)
    first = engine.generate(prompt, max_tokens=48, method="suffix")
    second = engine.generate(prompt, max_tokens=48, method="suffix")
    assert first.tokens == second.tokens == base.tokens
    assert engine.history.suffix_cache.n_requests == 2
    # the whole answer is in the global trie: most of it comes in long accepted drafts
    assert second.stats.accepted / second.stats.target_passes > 1.0
    assert second.stats.extra["sx_global"] > 0
    assert second.stats.target_passes < first.stats.target_passes


def test_engine_seeded_sampling_and_the_scheduler_keep_vanilla_s_output(engine, tiny_target) -> None:
    from ouroboros_local.sampling import SamplingParams
    from ouroboros_local.testing.engines import tiny_engine

    engine.history.clear()
    for seed in range(3):
        sp = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, seed=seed)
        base = engine.generate(E2E_PROMPTS[seed % 2], max_tokens=30, sampling=sp)
        for _ in range(2):        # the second run drafts from the first one's answer
            res = engine.generate(E2E_PROMPTS[seed % 2], max_tokens=30, method="suffix", sampling=sp)
            assert res.tokens == base.tokens
    assert engine.history.suffix_cache.n_requests == 6
    # scheduled (adaptive) drafting: the cost model trims drafts by their confidence classes
    with tiny_engine(tiny_target, adaptive=True) as scheduled:
        prompt = E2E_PROMPTS[0]
        base = scheduled.generate(prompt, max_tokens=40)
        for _ in range(3):
            res = scheduled.generate(prompt, max_tokens=40, method="suffix")
            assert res.tokens == base.tokens
        assert res.stats.accepted > 0
        assert any(k.startswith("sx m") for k in scheduled.scheduler().confidence["suffix"].trials)


def test_engine_pool_file_survives_a_restart_and_refuses_another_tokenizer(engine, tmp_path: Path) -> None:

    given = tmp_path / "history"                         # --pool FILE: the trie lives in FILE.suffix
    path = Path(suffix_file(str(given)))
    engine.history.clear()
    prompt = E2E_PROMPTS[1]
    res = engine.generate(prompt, max_tokens=24, method="suffix", options={"pool": str(given)})
    assert path.exists()
    saved = load_global(path, engine.history.fingerprint())
    doc = saved.documents()[-1]
    assert saved.n_requests == 1
    assert res.tokens in (doc[-len(res.tokens):], doc[-len(res.tokens) - 1:-1])   # (an end token may follow)
    # a "restart": a fresh shared state loads the file
    engine.history.clear()
    again = engine.generate(prompt, max_tokens=24, method="suffix", options={"pool": str(given)})
    assert again.tokens == res.tokens and again.stats.extra["sx_global"] > 0
    save_global(saved, path, "another tokenizer's fingerprint")
    engine.history.clear()
    with pytest.raises(PoolError, match="another tokenizer"):
        engine.generate(prompt, max_tokens=4, method="suffix", options={"pool": str(given)})
    engine.history.clear()


def test_a_history_file_keeps_what_larger_limits_kept(engine, tmp_path: Path) -> None:
    """An API user kept 30 answers (max_requests=40); one run with smaller limits (the defaults: 256 of
    thousands) cut the file to its own limits, without a word."""
    given = tmp_path / "history"
    path = Path(suffix_file(str(given)))
    kept = SuffixCache(max_requests=40)
    for i in range(30):
        kept.add([i + 1, i + 2, i + 3])
    save_global(kept, path, engine.history.fingerprint())
    assert load_global(path, engine.history.fingerprint(), max_requests=5).n_requests == 30
    engine.history.clear()
    engine.generate(E2E_PROMPTS[0], max_tokens=8, method="suffix", options={"pool": str(given), "max_requests": 5})
    engine.history.clear()
    docs = load_global(path, engine.history.fingerprint()).documents()
    assert len(docs) == 30 and docs[0] == [2, 3, 4]        # the oldest made room for the new answer
    small = SuffixCache(max_requests=5)                     # another process's save, merged
    small.add([7, 7, 7])
    small.save_merged(path, engine.history.fingerprint())
    assert len(load_global(path, engine.history.fingerprint()).documents()) == 30


def test_suffix_refuses_a_history_file_that_is_no_phrase_pool(engine, tmp_path: Path) -> None:
    """suffix keeps only FILE.suffix: it took notes.txt as FILE, and every method with a phrase pool then
    refused the file (a server's clients got a 400 for the server's own setting)."""
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    engine.history.clear()
    with pytest.raises(PoolError, match="not a phrase pool file"):
        engine.generate(E2E_PROMPTS[0], max_tokens=4, method="suffix", options={"pool": str(notes)})
    assert not Path(suffix_file(str(notes))).exists() and notes.read_text() == "my notes\n"
    engine.history.clear()


@pytest.mark.parametrize("first, then", [("ouroboros", "suffix"), ("suffix", "ouroboros")])
def test_a_pool_file_named_once_keeps_every_store(engine, tmp_path: Path, first: str, then: str) -> None:
    """README: ``pool=FILE`` names the engine's history file from then on, and later calls save to it,
    whatever their method: the phrase pool in FILE, the suffix trie in FILE.suffix. (A store that no
    call had named the file for stayed in memory.)"""
    given = tmp_path / "history"
    engine.history.clear()
    engine.generate(E2E_PROMPTS[0], max_tokens=16, method=first, options={"pool": str(given)})
    engine.generate(E2E_PROMPTS[1], max_tokens=16, method=then)
    engine.history.save()
    assert given.exists() and Path(suffix_file(str(given))).exists()
    engine.history.clear()


def test_auto_keeps_the_phrase_pool_of_a_file_named_once(engine, tmp_path: Path) -> None:
    """auto's later calls without a pool fed the suffix trie of the named file but not its phrase pool,
    which they neither read nor fed (only a call naming the file did)."""
    engine.history.clear()
    engine.generate(E2E_PROMPTS[0], max_tokens=16, method="auto", options={"pool": str(tmp_path / "history")})
    before = len(engine.history.phrase_pool)
    engine.generate(E2E_PROMPTS[1], max_tokens=16, method="auto")
    assert len(engine.history.phrase_pool) > before
    engine.history.clear()


def test_a_refused_pool_file_is_not_taken_by_later_calls(engine, tmp_path: Path, caplog) -> None:
    """A pool file refused (another tokenizer's, a folder that does not exist) does not become the
    history's file: later calls without a pool ran into the same error, or saved the other store beside
    it. A named file that does not take the other store leaves that store in memory, with a warning."""
    from ouroboros_local.pool import PhrasePool

    def run(method: str, pool: Path | None = None) -> None:
        engine.generate(E2E_PROMPTS[0], max_tokens=8, method=method, options={"pool": str(pool)} if pool else {})
        engine.history.save()

    bad, missing = tmp_path / "bad", tmp_path / "missing" / "history"
    PhrasePool(key_len=1, phrase_len=4).save(str(bad), "another tokenizer's fingerprint")
    for first, refused, then in [("ouroboros", bad, "suffix"), ("ouroboros", missing, "suffix"),
                                 ("suffix", missing, "ouroboros")]:
        engine.history.clear()
        with pytest.raises(PoolError):
            run(first, refused)
        run(first)
        run(then)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["bad"]
    # a file that takes the phrase pool, beside another tokenizer's trie: the trie stays in memory
    engine.history.clear()
    given = tmp_path / "good"
    run("ouroboros", given)
    save_global(SuffixCache(), Path(suffix_file(str(given))), "another tokenizer's fingerprint")
    run("suffix")
    run("suffix")   # not asked again: one warning
    assert caplog.text.count("kept in memory") == 1 and engine.history.suffix_file is None
    engine.history.clear()


@pytest.mark.parametrize("method, options", [("auto", {}), ("prompt-lookup", {"min_ngram": 5, "max_ngram": 2})])
def test_a_request_that_fails_names_no_file(engine, tmp_path: Path, method: str, options: dict) -> None:
    """auto opens the suffix trie (FILE.suffix, taken) before the phrase pool (FILE, another tokenizer's);
    prompt lookup opens the pool before it checks its options. Either request failed with the file
    named and bound, and later requests without a pool saved beside it."""
    from ouroboros_local.pool import PhrasePool

    engine.history.clear()
    given = tmp_path / "history"
    if method == "auto":
        PhrasePool(key_len=1, phrase_len=4).save(str(given), "another tokenizer's fingerprint")
    with pytest.raises(ParameterError if method == "prompt-lookup" else PoolError):
        engine.generate(E2E_PROMPTS[0], max_tokens=8, method=method, options={**options, "pool": str(given)})
    assert engine.history.named_file is None and engine.history.suffix_file is None
    engine.generate(E2E_PROMPTS[0], max_tokens=8, method="suffix")
    engine.history.save()
    assert not Path(suffix_file(str(given))).exists()
    engine.history.clear()


def test_damaged_history_files_are_set_aside_and_empty_ones_start_afresh(engine, tmp_path: Path, caplog) -> None:
    """A crafted file with the right fingerprint but ids past the vocabulary failed every generation inside
    llama_decode, then was refused at every start, as a file cut short was; a file made by ``touch`` was
    refused as "bad header"."""
    from ouroboros_local.pool import PhrasePool

    fingerprint, n_vocab = engine.history.fingerprint(), engine.target.n_vocab
    prompt = E2E_PROMPTS[1]
    base = engine.generate(prompt, max_tokens=8)
    for method, damage in itertools.product(("suffix", "prompt-lookup"), ("ids", "cut", "magic")):
        given = tmp_path / f"{method}-{damage}.pool"
        crafted = SuffixCache()
        crafted.add([1, 2, n_vocab + 5 if damage == "ids" else 4, 3])
        save_global(crafted, suffix_file(str(given)), fingerprint)
        pool = PhrasePool(key_len=1, phrase_len=4)
        pool.add([engine.tokenize(prompt)[-1]], (n_vocab if damage == "ids" else 5, 1, 2))
        pool.save(given, fingerprint)
        damaged = Path(suffix_file(str(given))) if method == "suffix" else given
        if damage != "ids":   # cut short, inside its magic too (that one was refused as another kind of file)
            damaged.write_bytes(damaged.read_bytes()[:4] if damage == "magic" else damaged.read_bytes()[:-6])
        engine.history.clear()
        caplog.clear()
        result = engine.generate(prompt, max_tokens=8, method=method, options={"pool": str(given)})
        assert result.tokens == base.tokens
        assert f"{damaged} is " in caplog.text and "moved to" in caplog.text
        assert damaged.with_name(damaged.name + ".bad").is_file()
    not_ours = tmp_path / "notes.txt"
    not_ours.write_text("my notes\n" * 20)
    with pytest.raises(PoolError, match="not a phrase pool file"):   # another kind of file: refused, untouched
        engine.generate(prompt, max_tokens=8, method="prompt-lookup", options={"pool": str(not_ours)})
    assert not_ours.read_text() == "my notes\n" * 20
    model = tmp_path / "model.gguf"   # --pool and -m swapped: refused from its header, not read whole (1.1 GB)
    with open(model, "wb") as f:
        f.write(b"GGUF")
        f.truncate(64 * 2**20)
    tracemalloc.start()
    try:
        with pytest.raises(PoolError, match="not a phrase pool file"):
            engine.generate(prompt, max_tokens=8, method="prompt-lookup", options={"pool": str(model)})
        assert tracemalloc.get_traced_memory()[1] < 8 * 2**20
    finally:
        tracemalloc.stop()
    empty = tmp_path / "touched.pool"
    empty.touch()
    Path(suffix_file(str(empty))).touch()
    for method in ("suffix", "prompt-lookup"):
        engine.history.clear()
        base = engine.generate(prompt, max_tokens=8)
        assert engine.generate(prompt, max_tokens=8, method=method, options={"pool": str(empty)}).tokens \
            == base.tokens
    assert PhrasePool.load(empty, fingerprint).n_tokens > 0               # written at the first save
    assert load_global(suffix_file(str(empty)), fingerprint).n_requests == 1
    engine.history.clear()


def test_a_proposer_asked_now_and_then_drafts_what_one_that_followed_every_round_drafts() -> None:
    # observe() is lazy on the engine's committed list: rounds that do not ask suffix cost it nothing,
    # and a later propose() catches up (match states rebuilt from the last depth tokens when many are new)
    rng = random.Random(3)
    cache = SuffixCache()
    cache.add([rng.randrange(12) for _ in range(300)])          # an earlier answer in the global trie
    text = [rng.randrange(12) for _ in range(400)]
    lazy = SuffixProposer(cache, min_match=1, max_branches=3)
    eager = SuffixProposer(cache, min_match=1, max_branches=3)
    committed = text[:20]
    lazy.begin(committed, make_setup())
    eager.begin(tuple(committed), make_setup())                # not a list: follows every observe()
    end = 20
    for skip in (1, 3, 40, 2, 17, 16, 1, 90, 5):              # rounds between two proposals
        for _ in range(skip):
            end += 1
            committed.append(text[end - 1])
            lazy.observe(committed, None)
            eager.observe(list(committed), None)
        a, b = lazy.propose(committed, budget=12), eager.propose(list(committed), budget=12)
        assert (a.tokens, a.parents, a.classes) == (b.tokens, b.parents, b.classes)
        assert lazy.matcher.states == eager.matcher.states
    assert lazy._seen == eager._seen == committed


def test_catching_up_is_not_counted_as_drafting_cost() -> None:
    # the trie work of rounds it was not asked in is timed apart (catch_up_seconds): counted as drafting,
    # a probe after many idle rounds made suffix look too dear to ask (codeedit's second pass, SmolLM2:
    # 1.44x -> 1.19x)
    from ouroboros_local.calibration import CostModel
    from ouroboros_local.scheduler import Scheduler

    rng = random.Random(5)
    text = [rng.randrange(50) for _ in range(300)]
    prop = SuffixProposer(min_match=1)
    committed = text[:]
    prop.begin(committed, make_setup())
    committed += text * 7                                     # 2100 tokens it has not seen yet
    sched = Scheduler(CostModel(sizes=[1, 16], seconds=[0.01, 0.011]))
    sched.enroll(prop)
    tree = sched.draft(prop, committed, budget=8)
    assert tree.n_candidates and prop._seen == committed
    assert prop.catch_up_seconds > 0
    assert sched.draft_cost(prop.name) < prop.catch_up_seconds / (10 * tree.n_candidates)


@pytest.mark.parametrize("seed", range(3))
def test_first_class_is_the_class_of_the_proposals_first_node(seed: int) -> None:
    # a look asks first_class before it proposes (Scheduler._look_promising): with one trie to draft
    # from it names the class of the proposal's first node, or "" where the proposal is empty
    corpus = repetitive_corpus(seed, length=300)
    pairs = [[started(SuffixProposer(**kw), corpus[:2]) for _ in range(2)] for kw in ({}, WIDE)]
    for n in range(2, len(corpus)):
        for a, b in pairs:
            tree = b.propose(corpus[:n], 16)
            assert a.first_class(corpus[:n]) == (tree.classes[1] if tree.n_candidates else ""), n


def test_first_class_prefers_the_longer_match_of_the_global_trie() -> None:
    cache = SuffixCache()
    earlier = started(SuffixProposer(cache), [7, 8])
    earlier._live = None
    earlier.observe([7, 8, 1, 2, 3, 4, 5, 6], None)
    earlier.end()                                     # the global trie holds 1 2 3 4 5 6 once
    prop = started(SuffixProposer(cache), [1, 2, 9, 1, 2, 3, 4, 5])
    # the match reaches back into the prompt, so it is classed as an answer's opening: the rule cannot tell
    # an earlier answer quoted at a prompt's end from prompts that end alike
    assert prop.first_class([1, 2, 9, 1, 2, 3, 4, 5]) == node_class(5, 1.0, 1, 1, opening=True)


def test_the_next_call_continues_the_trie_of_the_text_its_prompt_continues() -> None:
    """A chat's next turn rebuilt the request's trie over the whole conversation (0.1-0.2 s a turn at 6,000
    tokens); now it continues the last call's, into the trie a fresh build makes."""
    rng = random.Random(3)
    first = [rng.randrange(20) for _ in range(200)]
    ctx = SimpleNamespace(history=History(None))
    for second, kept in ((first + [rng.randrange(20) for _ in range(30)], True), (first[:150], False),
                         ([5] + first[1:], False)):
        last = create(ctx, check_options("suffix", {}))
        last.begin(list(first), make_setup())
        last.end()
        now = create(ctx, check_options("suffix", {}))
        now.begin(list(second), make_setup())
        fresh = SuffixProposer(SuffixCache())
        fresh.begin(list(second), make_setup())
        assert (now.local is last.local) is kept
        assert now._seen == fresh._seen and node_strings(now.local) == node_strings(fresh.local)
        assert [now.local.count(second[i:i + 3]) for i in range(0, 150, 7)] == \
            [fresh.local.count(second[i:i + 3]) for i in range(0, 150, 7)]
        other = create(ctx, check_options("suffix", {}))   # a second proposer of the same call: its own
        other.begin(list(second), make_setup())
        assert other.local is not now.local and node_strings(other.local) == node_strings(now.local)
        other.end()
        now.end()


def test_a_trie_a_ctrl_c_cut_short_is_not_continued_by_the_next_call(monkeypatch) -> None:
    """Interrupted between the trie's append and the proposer's record of it, the kept trie held a token
    more than its text, and the next calls continued it so for the rest of a chat."""
    rng = random.Random(4)
    first = [rng.randrange(20) for _ in range(100)]
    ctx = SimpleNamespace(history=History(None))
    last = create(ctx, check_options("suffix", {}))
    last.begin(list(first), make_setup())
    last.end()
    appended = {"n": 0}
    append = SuffixTrie.append

    def ctrl_c_after_some(self, token):
        append(self, token)
        appended["n"] += 1
        if appended["n"] == 10:
            raise KeyboardInterrupt

    monkeypatch.setattr(SuffixTrie, "append", ctrl_c_after_some)
    second = first + [rng.randrange(20) for _ in range(30)]
    cut = create(ctx, check_options("suffix", {}))
    with pytest.raises(KeyboardInterrupt):
        cut.begin(list(second), make_setup())
    cut.end()
    monkeypatch.setattr(SuffixTrie, "append", append)
    now = create(ctx, check_options("suffix", {}))
    now.begin(list(second), make_setup())
    fresh = SuffixProposer(SuffixCache())
    fresh.begin(list(second), make_setup())
    assert now._seen == fresh._seen and node_strings(now.local) == node_strings(fresh.local)
