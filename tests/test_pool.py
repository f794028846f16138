"""Phrase pool: LRU per key, caps, persistence, and the two verification-harvest strategies."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

from ouroboros_local.errors import ParameterError, PoolError
from ouroboros_local.pool import HARVEST_STRATEGIES, PhrasePool, harvest_strategy, harvest_verification
from ouroboros_local.tree import TokenTree

# ---- LRU semantics ------------------------------------------------------------------------------------

def test_lru_refresh_and_per_key_cap() -> None:
    pool = PhrasePool(max_per_key=3, phrase_len=3)
    for ph in [(1, 2), (3, 4), (5, 6)]:
        assert pool.add([9], ph)
    assert pool.lookup([9]) == [(5, 6), (3, 4), (1, 2)]        # most recent first
    pool.add([9], (1, 2))                                       # refresh moves it to the end
    assert pool.lookup([9]) == [(1, 2), (5, 6), (3, 4)]
    pool.add([9], (7, 8))                                       # full: the oldest (3, 4) goes
    assert pool.lookup([9]) == [(7, 8), (1, 2), (5, 6)]
    assert pool.lookup([9], k=2) == [(7, 8), (1, 2)]
    assert pool.lookup([4, 5, 9], k=1) == [(7, 8)]              # the key is the last key_len tokens
    assert pool.lookup([10]) == [] and pool.lookup([]) == []
    assert len(pool) == 3 and pool.n_keys == 1
    assert pool.n_tokens == 1 + 6


def test_phrases_are_truncated_and_prefixes_merge() -> None:
    pool = PhrasePool(phrase_len=3)
    pool.add([1], (2, 3, 4, 5, 6))
    assert pool.lookup([1]) == [(2, 3, 4)]
    pool.add([1], (7,))
    pool.add([1], (2, 3))              # a prefix of a stored phrase refreshes it, taking no slot
    assert pool.lookup([1]) == [(2, 3, 4), (7,)]
    pool.add([1], (7, 8))              # a stored prefix is replaced by its extension
    assert pool.lookup([1]) == [(7, 8), (2, 3, 4)]
    assert len(pool) == 2 and pool.n_tokens == 1 + 5
    assert not pool.add([1], ())


def test_key_len_two() -> None:
    pool = PhrasePool(key_len=2, phrase_len=2)
    assert not pool.add([5], (1, 2))               # context shorter than the key
    pool.add([4, 5], (1, 2))
    pool.add([3, 5], (6, 7))
    assert pool.lookup([9, 4, 5]) == [(1, 2)]
    assert pool.lookup([3, 5]) == [(6, 7)]
    assert pool.lookup([5]) == []
    assert pool.n_tokens == 2 * (2 + 2)


def test_add_ngrams_slides_and_feeds_incrementally() -> None:
    pool = PhrasePool(phrase_len=2)
    seq = [1, 2, 3, 1, 2, 4]
    assert pool.add_ngrams(seq, 3) == 4
    assert pool.lookup([1]) == [(2, 4), (2, 3)]
    assert pool.lookup([2]) == [(3, 1)] and pool.lookup([3]) == [(1, 2)]
    # incremental: only n-grams ending in the new tokens
    inc = PhrasePool(phrase_len=2)
    inc.add_ngrams(seq[:4], 3)
    assert inc.add_ngrams(seq, 3, start=4) == 2
    assert dict(inc.items()) == dict(pool.items())
    assert inc.add_ngrams(seq, 3, start=6) == 0
    # key_len 2: the key is the two tokens before each phrase
    pool2 = PhrasePool(key_len=2, phrase_len=2)
    pool2.add_ngrams(seq, 3)
    assert pool2.lookup([1, 2]) == [(3, 1)]       # (1, 2) -> (4,) would be too short
    assert pool2.lookup([2, 3]) == [(1, 2)] and pool2.lookup([3, 1]) == [(2, 4)]


def test_global_cap_evicts_least_recently_used_keys() -> None:
    pool = PhrasePool(max_per_key=4, max_tokens=12, phrase_len=2)
    for key in range(4):                 # 4 keys x (1 + 2) tokens = 12
        pool.add([key], (key, key))
    assert pool.n_tokens == 12
    pool.lookup([0])                     # key 0 is used: key 1 becomes the least recently used
    pool.add([7], (1, 1))
    assert pool.n_tokens <= 12
    assert pool.lookup([1]) == []
    assert pool.lookup([0]) and pool.lookup([2]) and pool.lookup([7])
    # a big stream stays within the cap and keeps the newest phrases
    big = PhrasePool(max_per_key=8, max_tokens=1000, phrase_len=3)
    rng = np.random.default_rng(0)
    big.add_ngrams(rng.integers(0, 5000, 20000).tolist(), 4)
    assert big.n_tokens <= 1000
    assert sum(len(p) for _, ps in big.items() for p in ps) + big.n_keys == big.n_tokens
    big.clear()
    assert len(big) == 0 and big.n_tokens == 0 and big.lookup([1]) == []


def test_replace_in_place_keeps_order() -> None:
    pool = PhrasePool(phrase_len=3)
    pool.add([1], (2, 3, 4))
    pool.add([1], (5, 6, 7))
    assert pool.replace([1], (2, 3, 4), (2, 9, 9))
    assert pool.lookup([1]) == [(5, 6, 7), (2, 9, 9)]
    assert not pool.replace([1], (8, 8, 8), (1, 1, 1))
    assert pool.replace([1], (2, 9, 9), (5, 6))        # clashes with a stored extension: merged
    assert pool.lookup([1]) == [(5, 6, 7)]
    assert pool.n_tokens == 1 + 3


def test_bad_parameters() -> None:
    with pytest.raises(ParameterError):
        PhrasePool(key_len=0)
    with pytest.raises(ParameterError):
        PhrasePool(max_per_key=0)


def test_concurrent_adds_keep_counters_consistent() -> None:
    pool = PhrasePool(max_per_key=4, max_tokens=3000, phrase_len=3)

    def work(seed: int) -> None:
        rng = np.random.default_rng(seed)
        for _ in range(20):
            pool.add_ngrams(rng.integers(0, 300, 200).tolist(), 4)
            pool.lookup([int(rng.integers(0, 300))])

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    items = pool.items()
    assert pool.n_tokens == sum(len(p) for _, ps in items for p in ps) + len(items)
    assert len(pool) == sum(len(ps) for _, ps in items)
    assert pool.n_tokens <= 3000


# ---- persistence --------------------------------------------------------------------------------------

FP = "sha256:0123456789abcdef0123456789abcdef"


def sample_pool(key_len: int = 1) -> PhrasePool:
    pool = PhrasePool(key_len=key_len, max_per_key=5, phrase_len=4)
    rng = np.random.default_rng(1)
    pool.add_ngrams(rng.integers(0, 50, 400).tolist(), 5)
    pool.add_ngrams([1, 2, 3], 3)          # shorter phrases too
    return pool


@pytest.mark.parametrize("key_len", [1, 2])
def test_save_load_roundtrip(tmp_path, key_len: int) -> None:
    pool = sample_pool(key_len)
    path = tmp_path / "pool.bin"
    pool.save(path, FP)
    loaded = PhrasePool.load(path, FP)
    assert loaded.items() == pool.items()
    assert (loaded.key_len, loaded.phrase_len) == (pool.key_len, pool.phrase_len)
    assert loaded.n_tokens == pool.n_tokens and len(loaded) == len(pool)
    # caps given at load time apply
    small = PhrasePool.load(path, FP, max_per_key=1, max_tokens=50)
    assert small.n_tokens <= 50
    assert all(len(ps) == 1 for _, ps in small.items())
    assert not list(tmp_path.glob(".*tmp"))            # no temp files left behind


def test_empty_pool_roundtrip(tmp_path) -> None:
    PhrasePool().save(tmp_path / "p", FP)
    assert len(PhrasePool.load(tmp_path / "p", FP)) == 0


def test_load_refuses_another_tokenizer(tmp_path) -> None:
    path = tmp_path / "pool.bin"
    sample_pool().save(path, FP)
    other = "sha256:fedcba9876543210fedcba9876543210"
    with pytest.raises(PoolError) as err:
        PhrasePool.load(path, other)
    msg = str(err.value)
    assert FP[:12] in msg and other[:12] in msg and FP not in msg


@pytest.mark.parametrize("damage", ["truncate", "flip", "garbage", "empty", "header"])
def test_corrupt_files_give_a_clear_error(tmp_path, damage: str) -> None:
    path = tmp_path / "pool.bin"
    sample_pool().save(path, FP)
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        data = data[:len(data) - 7]
    elif damage == "flip":
        data[-10] ^= 0x40
    elif damage == "garbage":
        data = bytearray(b"not a pool at all" * 20)
    elif damage == "empty":
        data = bytearray()
    else:
        data = data[:20]
    path.write_bytes(bytes(data))
    with pytest.raises(PoolError, match="pool"):
        PhrasePool.load(path, FP)


def test_missing_file_is_a_pool_error(tmp_path) -> None:
    with pytest.raises(PoolError):
        PhrasePool.load(tmp_path / "nope.bin", FP)


def test_a_fifo_is_refused_and_a_saved_file_keeps_its_permissions(tmp_path) -> None:
    """A FIFO as pool, calibration or estimates file blocked forever; a save reset a shared pool to 0600."""
    import faulthandler
    import os
    import stat

    from ouroboros_local.filestore import read_json_object

    fifo = tmp_path / "pool.fifo"
    os.mkfifo(fifo)
    faulthandler.dump_traceback_later(60, exit=True)   # the old read waited for a writer forever
    try:
        with pytest.raises(PoolError, match="not a regular file"):
            PhrasePool.load(fifo, FP)
        assert read_json_object(fifo) == {}
    finally:
        faulthandler.cancel_dump_traceback_later()
    pool = PhrasePool(key_len=1, max_per_key=4, phrase_len=3)
    pool.add((1,), (2, 3, 4))
    shared = tmp_path / "shared.pool"
    pool.save(shared, FP)
    shared.chmod(0o644)
    pool.save(shared, FP)
    assert stat.S_IMODE(shared.stat().st_mode) == 0o644


def test_a_history_file_in_a_missing_folder_is_refused_before_any_answer(tmp_path) -> None:
    """Saved after each answer, such a file once failed only then: the chat turn was lost with it."""
    from ouroboros_local.history import History

    history = History()
    with pytest.raises(PoolError, match="is not a writable folder"):
        history.pool(4, 8, str(tmp_path / "missing" / "h.pool"))
    history.pool(4, 8, str(tmp_path / "h.pool"))
    history.save()   # a folder that exists takes the file
    assert (tmp_path / "h.pool").is_file()


def test_naming_another_history_file_leaves_the_first_as_it_was(tmp_path) -> None:
    """A desktop app's project switch: B started with A's history, and every save rewrote A with B's."""
    from ouroboros_local.history import History
    from ouroboros_local.proposers.suffix import shared_cache
    from ouroboros_local.suffix_trie import load_global

    a, b = str(tmp_path / "a.pool"), str(tmp_path / "b.pool")
    history = History(None)
    fp = history.fingerprint()
    history.pool(4, 8, a).add([1], (2, 3))
    shared_cache(history, 8, 1000, a + ".suffix").add([1, 2, 3])
    history.save()
    a_bytes = {p: open(p, "rb").read() for p in (a, a + ".suffix")}
    history.pending = True   # an answer of A's not yet saved is written before A is let go
    pool_b = history.pool(4, 8, b)
    trie_b = shared_cache(history, 8, 1000, b + ".suffix")
    assert pool_b.n_tokens == 0 and trie_b.n_tokens == 0   # B starts afresh
    pool_b.add([7], (8, 9))
    trie_b.add([7, 8, 9])
    history.save()
    assert {p: open(p, "rb").read() for p in a_bytes} == a_bytes
    assert PhrasePool.load(b, fp).lookup([7]) and not PhrasePool.load(b, fp).lookup([1])
    assert load_global(b + ".suffix", fp, 8, 1000).n_tokens == 3
    assert sorted(history._files) == [b, b + ".suffix"]   # no file named before is kept, or written


def test_a_store_follows_the_latest_named_file(tmp_path) -> None:
    """After pool=B, a call naming no file kept the other store (the suffix trie after a pool call, the
    phrase pool after a suffix call) in A, and wrote its answer there."""
    from types import SimpleNamespace

    from ouroboros_local.history import History
    from ouroboros_local.proposers import check_options
    from ouroboros_local.proposers.suffix import create

    a, b = str(tmp_path / "a.pool"), str(tmp_path / "b.pool")
    history = History(None)
    ctx = SimpleNamespace(history=history)
    history.pool(4, 8, a)
    create(ctx, check_options("suffix", {}))   # no file named: beside the named one
    assert history.suffix_file == a + ".suffix"
    history.pool(4, 8, b)
    create(ctx, check_options("suffix", {}))
    assert history.suffix_file == b + ".suffix" and sorted(history._files) == [b, b + ".suffix"]
    create(ctx, check_options("suffix", {"pool": a}))   # the mirror: the pool follows a suffix call's file
    history.pool(4, 8, None)
    assert history.phrase_pool_file == a and sorted(history._files) == [a, a + ".suffix"]


def test_state_learned_before_any_file_is_named_goes_into_the_file(tmp_path) -> None:
    from ouroboros_local.history import History

    history = History(None)
    history.pool(4, 8, None).add([1], (2, 3))
    assert history.pool(4, 8, str(tmp_path / "h.pool")).lookup([1])   # nothing learned so far is dropped


def test_methods_own_states_are_bounded() -> None:
    """A server's requests naming a new lookahead shape each kept one more pool (up to ~100 MB) for ever."""
    from ouroboros_local.history import MAX_METHOD_STATES, History

    history = History(None)
    first = history.kept(("shape", 0), list)
    made = [history.kept(("shape", n), list) for n in range(1, 3 * MAX_METHOD_STATES)
            if history.kept(("shape", 0), list) is first]   # one in use stays
    assert len(made) == 3 * MAX_METHOD_STATES - 1 and len(history._method_state) == MAX_METHOD_STATES
    assert history.kept(("shape", 1), dict) is not made[0]   # the least recently used was let go


@pytest.mark.parametrize("method", ["suffix", "prompt-lookup"])
def test_a_folder_named_as_the_history_file_is_refused_before_the_model_loads(tmp_path, method, capsys) -> None:
    """suffix took it and wrote FOLDER.suffix beside it; the others refused it only once generating."""
    from ouroboros_local.cli import main

    folder = tmp_path / "history"
    folder.mkdir()
    # no such model: had the check come later, the missing model would be the error
    assert main(["generate", "-m", str(tmp_path / "none.gguf"), "--method", method, "--pool", str(folder),
                 "-p", "x"]) == 2
    assert f"{folder} is not a file" in capsys.readouterr().err
    assert not (tmp_path / "history.suffix").exists()


def test_two_processes_sharing_a_history_file_keep_each_others_phrases(tmp_path) -> None:
    """Two chats on one --pool FILE: each save overwrote what the other had saved since it loaded."""
    from ouroboros_local.history import History
    from ouroboros_local.suffix_trie import SuffixCache, read_documents

    path = str(tmp_path / "shared.pool")
    first, second = History(None), History(None)          # both start before either has saved
    fp = first.fingerprint()
    pools = [history.pool(4, 8, path) for history in (first, second)]
    tries = [SuffixCache(max_requests=4) for _ in (first, second)]
    for history, trie in zip((first, second), tries):
        history.persist(path + ".suffix", trie)
    pools[0].add([1], (2, 3))
    tries[0].add([1, 2, 3])
    first.save()
    pools[1].add([1], (4, 5))
    pools[1].add([7], (8,))
    tries[1].add([4, 5])
    second.save()                                         # keeps the first one's, its own the newest
    assert PhrasePool.load(path, fp).lookup([1]) == [(4, 5), (2, 3)]
    assert read_documents(path + ".suffix", fp) == [[1, 2, 3], [4, 5]]
    for docs in ([6], [7]):
        pools[0].add([9], tuple(docs))
        tries[0].add(docs)
        first.save()                                      # and back, every save from then on
    merged = PhrasePool.load(path, fp)
    assert merged.lookup([1]) == [(2, 3), (4, 5)] and merged.lookup([7]) == [(8,)]
    assert merged.lookup([9]) == [(7,), (6,)]
    assert read_documents(path + ".suffix", fp) == [[4, 5], [1, 2, 3], [6], [7]]
    tries[0].add([8])
    first.save()                                          # the limits keep the newest
    assert read_documents(path + ".suffix", fp) == [[1, 2, 3], [6], [7], [8]]


def test_history_saves_after_answers_take_at_most_a_twentieth_of_the_time(tmp_path, monkeypatch) -> None:
    """A pool of a million tokens takes half a second to write, which every answer of a server paid."""
    from ouroboros_local import history as history_module
    from ouroboros_local.history import History

    clock = [100.0]
    monkeypatch.setattr(history_module.time, "monotonic", lambda: clock[0])
    history = History(None)
    path = tmp_path / "h.pool"
    pool = history.pool(4, 8, str(path))
    writes = []
    real_save = PhrasePool.save
    monkeypatch.setattr(PhrasePool, "save", lambda self, *a: (writes.append(clock[0]), clock.__setitem__(0, clock[0] + 0.5),
                                                          real_save(self, *a)))
    pool.add([1], (2,))
    history.save(if_due=True)                 # the first is due: 0.5 s to write
    pool.add([1], (3,))
    clock[0] += 9.0
    history.save(if_due=True)                 # 9 s later: not due before 10 s
    assert len(writes) == 1 and history.pending
    clock[0] += 1.0
    history.save(if_due=True)
    assert len(writes) == 2 and not history.pending
    # a save that fails stays pending: the engine's close tries it again
    monkeypatch.setattr(PhrasePool, "save", lambda self, *a: (_ for _ in ()).throw(PoolError("disk full")))
    clock[0] += 60.0
    with pytest.raises(PoolError):
        history.save(if_due=True)
    assert history.pending
    assert PhrasePool.load(path, history.fingerprint()).lookup([1]) == [(3,), (2,)]


@pytest.mark.parametrize("end", ["close", "clear"])
def test_closing_or_clearing_writes_the_history_save_that_was_not_yet_due(tiny_target, tmp_path, end) -> None:
    """history.clear() dropped the answers whose save was not yet due (found by a new-user review)."""
    from ouroboros_local.suffix_trie import read_documents
    from ouroboros_local.testing.engines import E2E_PROMPTS, tiny_engine

    path = tmp_path / "h.pool"
    with tiny_engine(tiny_target) as engine:
        engine.generate(E2E_PROMPTS[0], max_tokens=6, method="suffix", options={"pool": str(path)})
        engine.history._save_seconds = 3600.0      # as if the last save had taken an hour: none is due
        engine.generate(E2E_PROMPTS[1], max_tokens=6, method="suffix", options={"pool": str(path)})
        fingerprint = engine.history.fingerprint()
        assert engine.history.pending and len(read_documents(f"{path}.suffix", fingerprint)) == 1
        if end == "clear":
            engine.history.clear()
            assert not engine.history.pending and len(read_documents(f"{path}.suffix", fingerprint)) == 2
            engine.generate(E2E_PROMPTS[0], max_tokens=6, method="suffix")   # cleared: the file is not named
    assert len(read_documents(f"{path}.suffix", fingerprint)) == 2


def test_interrupted_save_keeps_the_old_file(tmp_path, monkeypatch) -> None:
    path = tmp_path / "pool.bin"
    old = sample_pool()
    old.save(path, FP)
    before = path.read_bytes()
    newer = PhrasePool()
    newer.add([1], (2,))

    def boom(src, dst):
        raise OSError("simulated crash during rename")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(PoolError, match="cannot save"):
        newer.save(path, FP)
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert PhrasePool.load(path, FP).items() == old.items()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pool.bin"]   # temp file removed


def test_interrupted_write_keeps_the_old_file(tmp_path, monkeypatch) -> None:
    path = tmp_path / "pool.bin"
    sample_pool().save(path, FP)
    before = path.read_bytes()

    def boom(fd):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "fsync", boom)
    with pytest.raises(KeyboardInterrupt):
        PhrasePool().save(path, FP)
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pool.bin"]


def test_save_load_is_fast_for_a_million_tokens(tmp_path) -> None:
    pool = PhrasePool(max_per_key=8, phrase_len=4)
    rng = np.random.default_rng(2)
    pool.add_ngrams(rng.integers(0, 60000, 260_000).tolist(), 5)
    assert pool.n_tokens > 1_000_000
    t0 = time.perf_counter()
    pool.save(tmp_path / "big", FP)
    t1 = time.perf_counter()
    loaded = PhrasePool.load(tmp_path / "big", FP)
    t2 = time.perf_counter()
    assert loaded.n_tokens == pool.n_tokens
    assert t1 - t0 < 3.0 and t2 - t1 < 3.0


# ---- harvest from verification ------------------------------------------------------------------------

def chain_tree(root: int, tokens: list[int]) -> TokenTree:
    tree = TokenTree.rooted_at(root)
    tree.add_path(0, tokens)
    return tree


def test_strategy_names() -> None:
    assert set(HARVEST_STRATEGIES) == {"none", "predicted-tail", "agreeing-runs"}
    assert harvest_strategy("core") == "agreeing-runs"
    assert harvest_strategy("specbench") == "predicted-tail"
    assert harvest_strategy(None) == "none"
    with pytest.raises(ParameterError):
        harvest_strategy("bogus")


def test_predicted_tail_on_a_rejected_chain() -> None:
    # root 10, draft 11 12 13 14; the target accepts 11, then wants 20 (not 12).
    tree = chain_tree(10, [11, 12, 13, 14])
    preds = np.array([11, 20, 21, 22, 23])       # predictions at nodes 0..4
    path = [0, 1]
    pool = PhrasePool(phrase_len=2)
    n = harvest_verification(pool, tree, preds, path, "predicted-tail")
    # R = [pred(1), pred(2), pred(3), pred(4)] = [20, 21, 22, 23]: keys 20, 21 -> next two tokens
    assert pool.lookup([20]) == [(21, 22)]
    assert pool.lookup([21]) == [(22, 23)]
    assert pool.lookup([22]) == []                # too short for phrase_len
    assert n == 2
    short = PhrasePool(phrase_len=2)
    harvest_verification(short, tree, preds, path, "specbench", min_len=1)
    assert short.lookup([22]) == [(23,)]


def test_predicted_tail_on_a_tree_and_key_len_two() -> None:
    tree = TokenTree.rooted_at(10)
    a = tree.add(0, 11)
    tree.add_path(a, [12, 13])        # accepted: 11 12 13
    tree.add_path(0, [30, 31])        # rejected branch below the root
    preds = np.array([11, 12, 13, 50, 40, 41])
    path = [0, 1, 2, 3]
    pool = PhrasePool(key_len=2, phrase_len=2)
    harvest_verification(pool, tree, preds, path, "predicted-tail", context=[9])
    # branch below the root: R = [pred(root)=11, pred(30)=40, pred(31)=41]; key (10, 11) -> (40, 41)
    assert pool.lookup([10, 11]) == [(40, 41)]
    # no chain leaves the path below node 3 (13 is a leaf), so nothing keyed by 50
    assert pool.n_keys == 1


def test_agreeing_runs_on_a_rejected_chain() -> None:
    # root 10; draft 11 12 13 14 15; target accepts nothing (wants 20).
    tree = chain_tree(10, [11, 12, 13, 14, 15])
    # predictions at draft tokens A = [11, 12, 13, 14, 15]:
    #   after 11 -> 12 (agrees with A[1]), after 12 -> 13 (agrees), after 13 -> 30 (A[3]=14 disagrees),
    #   after 14 -> 15 (agrees), after 15 -> 16
    preds = np.array([20, 12, 13, 30, 15, 16])
    pool = PhrasePool(phrase_len=3)
    harvest_verification(pool, tree, preds, [0], "agreeing-runs")
    assert pool.lookup([11]) == [(12, 13, 30)]      # run 12, 13, then the divergent 30 ends it
    assert pool.lookup([12]) == []                  # (13, 30): only 2 tokens
    assert pool.lookup([14]) == []                  # (15, 16): only 2 tokens
    pool1 = PhrasePool(phrase_len=3)
    harvest_verification(pool1, tree, preds, [0], "core", min_len=2)
    assert pool1.lookup([12]) == [(13, 30)]
    assert pool1.lookup([13]) == []                 # (30,) then stop: a single token
    assert pool1.lookup([14]) == [(15, 16)]


def test_agreeing_runs_corrects_tried_pool_phrases_in_place() -> None:
    pool = PhrasePool(phrase_len=3)
    pool.add([10], (11, 12, 13))       # was hung below the root and partly failed
    pool.add([10], (40, 41, 42))       # newer, not tried: untouched
    pool.add([10], (11, 50, 51))       # tried? no: the tree below 11 holds 12, not 50
    pool.replace([10], (11, 50, 51), (11, 50, 51))
    tree = chain_tree(10, [11, 12, 13])
    preds = np.array([11, 12, 60, 61])         # target: 11 12 then 60 (13 rejected)
    harvest_verification(pool, tree, preds, [0, 1, 2], "agreeing-runs")
    phrases = pool.lookup([10])
    assert (11, 12, 60) in phrases and (11, 12, 13) not in phrases
    assert (40, 41, 42) in phrases and (11, 50, 51) in phrases
    # order kept: the corrected phrase keeps its (oldest) slot
    assert phrases[-1] == (11, 12, 60)


def test_none_strategy_and_full_acceptance() -> None:
    tree = chain_tree(10, [11, 12])
    preds = np.array([11, 12, 13])
    pool = PhrasePool(phrase_len=2)
    assert harvest_verification(pool, tree, preds, [0, 1, 2], "none") == 0
    for s in ("predicted-tail", "agreeing-runs"):
        assert harvest_verification(pool, tree, preds, [0, 1, 2], s) == 0   # nothing was rejected
    assert len(pool) == 0


def test_lookup_cut_to_a_shorter_length_reads_what_a_pool_that_short_would_hold() -> None:
    long, short = PhrasePool(max_per_key=8, phrase_len=4), PhrasePool(max_per_key=8, phrase_len=2)
    for phrase in ((1, 2, 3, 4), (1, 2, 9, 9), (5, 6, 7, 8), (1, 3, 3, 3)):
        long.add([0], phrase)
        short.add([0], phrase)
    assert long.lookup([0], max_len=2) == short.lookup([0]) == [(1, 3), (5, 6), (1, 2)]
    assert long.lookup([0], k=2, max_len=2) == [(1, 3), (5, 6)]
    assert long.lookup([0], max_len=9) == long.lookup([0])


def test_the_shared_pool_keeps_every_methods_phrases(tmp_path) -> None:
    """A request whose method keeps shorter phrases, or fewer per key, must not cut the shared pool (or
    the file it is saved to) down to its own settings."""
    from ouroboros_local.history import History

    history = History(None)
    path = str(tmp_path / "shared.pool")
    pool = history.pool(4, 8, path)
    for i in range(8):
        pool.add([0], (1, 2, 3, i))
    stored = pool.lookup([0])
    narrow = history.pool(2, 2, path)                 # lookahead N=3, G=2 on the same engine
    assert narrow is pool and narrow.lookup([0]) == stored
    wider = history.pool(6, 16, path)                 # longer phrases, more per key: grown, history kept
    assert (wider.phrase_len, wider.max_per_key) == (6, 16) and wider.lookup([0]) == stored
    history.save()
    assert PhrasePool.load(path, history.fingerprint()).lookup([0]) == stored
