"""Ouroboros: window harvest/shift, draft batches, a pure-Python run, and greedy equality on tiny models."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Sequence

import numpy as np
import pytest

from ouroboros_local.drafting import JacobiWindow
from ouroboros_local.engine import Engine
from ouroboros_local.errors import ParameterError, PoolError
from ouroboros_local.pool import PhrasePool
from ouroboros_local.proposers.ouroboros import OuroborosProposer
from ouroboros_local.testing.engines import tiny_engine
from ouroboros_local.testing.sim import FakeTarget, make_setup, one_hot, simulate
from ouroboros_local.tree import BatchLayout, check_layout

PROMPTS = [
    "def add(a, b):\n    return a + b\n\ndef add(a, b):\n",
    "The quick brown fox jumps over the lazy dog. The quick brown",
    "héllo wörld ✓ 日本 <|im_start|>user\nhi<|im_end|>\n",
    "for i in range(10):\n    print(i)\nfor i in range(10):\n    print(i)\nfor i in range(10):\n",
]


# ---- the Jacobi window on synthetic data ----------------------------------------------------------

def test_window_phrases_and_shift() -> None:
    win = JacobiWindow(width=3, level=4)                # levels 0..2, K = 3
    win.cells[:] = [[0, 11, 12], [20, 21, 22], [30, 31, 32]]
    new = np.array([40, 41, 42])
    keys, phrases = win.phrases(u=7, new=new)
    assert keys.tolist() == [7, 11, 12]                 # column 0's key is the input token u
    assert phrases.tolist() == [[20, 30, 40], [21, 31, 41], [22, 32, 42]]
    win.shift(new)
    # level 0 = level 1 without column 0, level l = level l+1, last level = new
    assert win.cells[0, 1:].tolist() == [21, 22]
    assert win.cells[1].tolist() == [30, 31, 32]
    assert win.cells[2].tolist() == [40, 41, 42]
    assert win.age == 1


def test_window_n3_shift_and_readiness() -> None:
    win = JacobiWindow(width=4, level=3)
    win.reset([5, 6, 7], seed=1)
    assert set(win.cells[:, :].ravel().tolist()) <= {5, 6, 7}
    assert win.n_nodes == 3 + 4 and win.depth == 4 and not win.ready
    for step in range(3):
        new = np.arange(4) + 10 * (step + 1)
        win.shift(new)
        assert win.cells[1].tolist() == new.tolist()
        assert win.cells[0, 1:].tolist() == (new - 10)[1:].tolist() or step == 0
    assert win.ready
    with pytest.raises(ParameterError):
        JacobiWindow(width=4, level=2)


# ---- a fake draft KV cache (pure Python, llama.cpp's visibility rule) ------------------------------

class FakeDraftKV:
    """KVCache's public surface over a FakeTarget: visibility by sequence id and position."""

    def __init__(self, model: FakeTarget, n_batch: int = 64, n_seq_max: int = 16, n_ctx: int = 4096):
        self.model = model
        self.ctx = SimpleNamespace(n_batch=n_batch, n_seq_max=n_seq_max, n_ctx=n_ctx)
        self.cached: list[int] = []
        self.decodes = 0
        self.batch_sizes: list[int] = []

    @property
    def n_past(self) -> int:
        return len(self.cached)

    def truncate(self, n: int) -> None:
        del self.cached[n:]

    def feed(self, tokens: Sequence[int], logits_last: bool = False):
        self.cached.extend(int(t) for t in tokens)
        return None

    def sync_to(self, tokens: Sequence[int], logits_last: bool = False):
        k = 0
        while k < min(len(tokens), len(self.cached)) and tokens[k] == self.cached[k]:
            k += 1
        self.truncate(k)
        return self.feed(tokens[k:])

    def decode_layout(self, lay: BatchLayout) -> np.ndarray:
        check_layout(lay)
        assert lay.n_seqs <= self.ctx.n_seq_max and len(lay.tokens) <= self.ctx.n_batch
        assert self.n_past + max(lay.pos_offsets) + 1 <= self.ctx.n_ctx
        preds = self.model.decode_layout(self.cached, lay)
        self.decodes += 1
        self.batch_sizes.append(len(lay.tokens))
        return one_hot([p for p, want in zip(preds, lay.logits) if want], self.model.vocab)

    def commit_tree(self, root_token: int, accepted: Sequence[int], winner_seq: int, n_seqs: int) -> None:
        self.cached.append(int(root_token))
        self.cached.extend(int(t) for t in accepted)

    def check(self) -> None:
        pass


def _corpus(vocab: int, seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed)
    motifs = [rng.integers(3, vocab, size=int(rng.integers(4, 9))).tolist() for _ in range(6)]
    out: list[int] = []
    for _ in range(60):
        out += motifs[int(rng.integers(len(motifs)))]
    return out


@pytest.mark.parametrize("W,N,G,gamma,topk", [(4, 3, 4, 4, 2), (0, 3, 4, 3, 1), (5, 4, 2, 6, 3),
                                               (3, 5, 0, 2, 0), (1, 3, 6, 5, 4)])
def test_simulated_greedy_equality_and_batches(W: int, N: int, G: int, gamma: int, topk: int) -> None:
    vocab = 40
    corpus = _corpus(vocab)
    target = FakeTarget(corpus, vocab, order=2)
    draft = FakeTarget(corpus[: len(corpus) // 2], vocab, order=2)    # agrees often, not always
    prompt = corpus[:30]
    expected = target.greedy(prompt, 80)
    kv = FakeDraftKV(draft, n_batch=64, n_seq_max=16)
    pool = PhrasePool(max_per_key=max(G, topk, 1), phrase_len=N - 1)
    prop = OuroborosProposer(kv, pool, vocab, gamma=gamma, window=W, level=N, guess_set=G, topk=topk,
                             harvest="predicted-tail", check=True)
    out, st = simulate(prop, target, prompt, 80, make_setup(max_tree_nodes=63, max_branches=16))
    assert out == expected
    assert st.passes < 80                                 # it speculates
    s = prop.stats()
    assert s["ouro_draft_forwards"] >= s["ouro_rounds"] > 0
    assert s["ouro_draft_tokens"] >= s["ouro_draft_forwards"]
    assert max(kv.batch_sizes) <= 64
    if W:
        assert s["ouro_window_phrases"] > 0
    # the draft KV never runs ahead of committed + 1 forward, and ends as a prefix of the output
    seq = list(prompt) + out
    assert kv.cached == seq[:len(kv.cached)]


def test_simulated_draft_accepts_phrases_and_suffixes() -> None:
    """A perfect draft on periodic text: phrases make draft forwards commit several tokens each, and
    long-draft suffixes from the pool are accepted by the target."""
    vocab = 30
    period = [3, 9, 4, 17, 8, 22, 5, 11]
    corpus = period * 30
    target = FakeTarget(corpus, vocab, order=2)
    prompt = corpus[:24]
    kv = FakeDraftKV(FakeTarget(corpus, vocab, order=2))
    pool = PhrasePool(max_per_key=4, phrase_len=3)
    prop = OuroborosProposer(kv, pool, vocab, gamma=6, window=4, level=4, guess_set=4, topk=2, check=True)
    out, st = simulate(prop, target, prompt, 96)
    assert out == target.greedy(prompt, 96)
    s = prop.stats()
    assert s["ouro_draft_phrase_tokens"] > 0
    assert s["ouro_draft_tokens"] / s["ouro_draft_forwards"] > 2      # phrase-level drafting
    assert s["ouro_suffix_accepted"] > 0                                  # long drafts pay off
    assert 96 / st.passes > 6


def test_draft_batch_columns_read_their_trajectories() -> None:
    """Every window token of a draft forward sees u, a0[1..i], a1[i]..al[i] (the sim asserts the
    per-seq views agree); phrases hang below u and see only u."""
    seen: list[tuple[int, list[int]]] = []

    class Recorder(FakeTarget):
        def next_token(self, context):
            seen.append((len(context), list(context)))
            return super().next_token(context)

    vocab = 1000
    model = Recorder([1, 2, 3], vocab, order=1)
    kv = FakeDraftKV(model)
    pool = PhrasePool(max_per_key=4, phrase_len=2)
    pool.add([3], (500, 501))
    prop = OuroborosProposer(kv, pool, vocab, gamma=1, window=3, level=4, guess_set=4, topk=0,
                             pool_from_prompt=False, check=True)
    prop.begin([1, 2, 3], make_setup())
    prop.window.cells[:] = [[0, 101, 102], [110, 111, 112], [120, 121, 122]]
    seen.clear()
    prop.propose([1, 2, 3], budget=4)
    contexts = [c for _, c in seen]
    prefix = [1, 2, 3]
    assert prefix + [101, 102, 112, 122] in contexts         # column 2: u a0[1] a0[2] a1[2] a2[2]
    assert prefix + [110, 120] in contexts                    # column 0: u a1[0] a2[0]
    assert prefix + [101, 111, 121] in contexts               # column 1
    assert prefix + [500, 501] in contexts                    # the pool phrase below u


def test_budget_eog_and_room_limits() -> None:
    vocab = 30
    corpus = [3, 9, 4, 17, 8, 22, 5, 11] * 20
    model = FakeTarget(corpus, vocab, order=2)
    kv = FakeDraftKV(model, n_ctx=30)
    pool = PhrasePool(max_per_key=4, phrase_len=2)
    prop = OuroborosProposer(kv, pool, vocab, gamma=8, window=4, level=3, guess_set=4, topk=3, check=True)
    prompt = corpus[:16]
    prop.begin(prompt, make_setup(max_tree_nodes=63, max_branches=2, eog=frozenset({22})))
    tree = prop.propose(prompt, budget=3)
    assert tree.n_candidates <= 3
    tree = prop.propose(prompt, budget=20)
    drafted = [tree.tokens[i] for i in range(1, len(tree)) if tree.sources.get(i) == "draft"]
    assert drafted and drafted[-1] == 22 and 22 not in drafted[:-1]  # cut at the EOG token
    assert len(tree.leaves()) <= 2
    assert prop.propose(prompt, budget=0).n_candidates == 0
    # near the end of the draft context the window pauses and nothing overflows
    prop.kv.truncate(0)
    long_prompt = corpus[:28]
    prop.begin(long_prompt, make_setup())
    prop.propose(long_prompt, budget=8)
    assert kv.n_past <= 30


# ---- tiny llama.cpp models ---------------------------------------------------------------------------

make_engine = tiny_engine   # fixed hyperparameters unless a test asks for the scheduler


@pytest.fixture(scope="module")
def pair_engine(tiny_target, tiny_draft):
    engine = make_engine(tiny_target, tiny_draft)
    yield engine
    engine.close()


SETTINGS = [
    {},
    {"window": 2, "level": 4, "guess_set": 2, "gamma": 6, "topk": 3},
    {"window": 0, "guess_set": 6, "gamma": 3, "topk": 1, "harvest": "agreeing-runs"},
    {"window": 5, "level": 3, "guess_set": 3, "gamma": 2, "topk": 0, "harvest": "none"},
]


@pytest.mark.parametrize("options", SETTINGS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "defaults")
def test_greedy_equals_vanilla(pair_engine: Engine, options: dict) -> None:
    pair_engine.history.clear()                        # cold pool first ...
    for warm in (False, True):                         # ... then warm from the previous pass
        for prompt in PROMPTS:
            base = pair_engine.generate(prompt, max_tokens=40, method="vanilla")
            res = pair_engine.generate(prompt, max_tokens=40, method="ouroboros", options=options)
            assert res.tokens == base.tokens, (options, warm, prompt)
            assert res.text == base.text
            assert res.stats.target_passes <= base.stats.target_passes
            pair_engine.draft_kv().check()
            committed = pair_engine.prompt_tokens(prompt) + res.tokens
            dkv = pair_engine.draft_kv()
            assert dkv.cached == committed[:len(dkv.cached)]
            extra = res.stats.extra
            assert extra["ouro_draft_forwards"] > 0 and "ouroboros_fallback" not in extra
    assert len(pair_engine.history.phrase_pool) > 0


def test_the_draft_reads_the_prompt_only_when_first_asked(pair_engine: Engine) -> None:
    """No draft prefill in begin (a scheduled Ouroboros may never ask its draft): the first draft
    catches up on the prompt, timed apart from the drafting; after a round it drafted, nothing is left
    to catch up; a new generation keeps only the prefix it shares with the old one."""
    from ouroboros_local.proposers import create_proposer
    from ouroboros_local.verify import VerifyResult

    kv = pair_engine.draft_kv()
    kv.reset()
    proposer = create_proposer("ouroboros", pair_engine.drafting_context(), {})
    assert isinstance(proposer, OuroborosProposer)         # fixed hyperparameters (this engine)
    prompt = pair_engine.prompt_tokens(PROMPTS[0])
    proposer.begin(prompt, make_setup(eog=pair_engine.target.eog_tokens))
    assert kv.n_past == 0
    tree = proposer.propose(prompt, 4)
    assert proposer.catch_up_seconds > 0 and tree.n_candidates > 0
    assert kv.cached[:len(prompt) - 1] == prompt[:-1]
    bonus = 1 if tree.tokens[1] != 1 else 2                # the target rejects the whole draft
    result = VerifyResult(tree=tree, path=[0], accepted=[], bonus=bonus,
                          predictions=np.full(len(tree.tokens), bonus, dtype=np.int64))
    committed = prompt + [bonus]
    proposer.observe(committed, result)
    assert kv.cached == committed[:len(kv.cached)]
    proposer.propose(committed, 4)
    assert proposer.catch_up_seconds == 0.0
    other = prompt[:3] + [t + 1 for t in prompt[3:]]      # shares 3 tokens with the last generation
    proposer.begin(other, make_setup(eog=pair_engine.target.eog_tokens))
    assert kv.cached == other[:3]


def test_sampling_is_seeded_and_runs(pair_engine: Engine) -> None:
    from ouroboros_local.sampling import SamplingParams

    sp = SamplingParams(temperature=0.8, seed=7)
    a = pair_engine.generate(PROMPTS[1], max_tokens=24, method="ouroboros", sampling=sp)
    b = pair_engine.generate(PROMPTS[1], max_tokens=24, method="ouroboros", sampling=sp)
    assert a.tokens == b.tokens and len(a.tokens) > 0


def test_self_draft_accepts_several_tokens_per_pass(tiny_target, tiny_self_draft) -> None:
    with make_engine(tiny_target, tiny_self_draft) as engine:
        res = engine.generate(PROMPTS[3], max_tokens=48, method="ouroboros")
        assert res.stats.accepted_per_pass > 2
        assert res.tokens == engine.generate(PROMPTS[3], max_tokens=48, method="vanilla").tokens


def test_context_end_is_handled(tiny_target, tiny_draft) -> None:
    with make_engine(tiny_target, tiny_draft, n_ctx=64) as engine:
        prompt = "a b c d e f g h"
        base = engine.generate(prompt, max_tokens=500)
        res = engine.generate(prompt, max_tokens=500, method="ouroboros", options={"gamma": 6})
        assert res.tokens == base.tokens
        assert len(engine.prompt_tokens(prompt)) + len(res.tokens) <= 64


def test_fallback_without_draft(tiny_target) -> None:
    with make_engine(tiny_target) as engine:
        base = engine.generate(PROMPTS[0], max_tokens=24)
        res = engine.generate(PROMPTS[0], max_tokens=24, method="ouroboros")
        assert res.tokens == base.tokens
        assert res.stats.extra["ouroboros_fallback"] == "lookahead"
        assert res.stats.method == "ouroboros"


def test_scheduled_fallback_prices_its_copies_as_prompt_lookup(tiny_target) -> None:
    """Without a draft model, scheduled Ouroboros drafts copies from the context and its pool under the
    scheduler's prompt-lookup estimates: what prompt lookup (or auto) learned applies to it at once, and
    what it learns applies to them (on its own name it drafted 6 tokens where prompt lookup drafted 275,
    SmolLM2 on wmt)."""
    with make_engine(tiny_target, adaptive=True) as engine:
        sched = engine.scheduler()
        base = engine.generate(PROMPTS[0], max_tokens=24)
        res = engine.generate(PROMPTS[0], max_tokens=24, method="ouroboros")
        assert res.tokens == base.tokens and res.stats.method == "ouroboros"
        assert res.stats.extra["ouroboros_fallback"] == "prompt-lookup"
        assert set(res.stats.extra["auto_rounds"]) <= {"prompt-lookup", "plain"}
        assert "prompt-lookup" in sched.acceptance and "ouroboros" not in sched.acceptance


def test_pool_persistence_round_trip(tiny_target, tiny_draft, tiny_other_vocab, tmp_path) -> None:
    path = tmp_path / "ouro.pool"
    with make_engine(tiny_target, tiny_draft) as engine:
        res = engine.generate(PROMPTS[0], max_tokens=32, method="ouroboros", options={"pool": str(path)})
        assert path.exists()
        size = res.stats.extra["ouro_pool_size"]
        assert size > 0
    with make_engine(tiny_target, tiny_draft) as engine:             # a new process, in effect
        pool = engine.history.pool(2, 4, str(path))
        assert len(pool) == size
        base = engine.generate(PROMPTS[0], max_tokens=32)
        res = engine.generate(PROMPTS[0], max_tokens=32, method="ouroboros", options={"pool": str(path)})
        assert res.tokens == base.tokens
        assert res.stats.extra["ouro_pool_size"] >= size
    with make_engine(tiny_other_vocab) as engine:                    # another tokenizer: refused
        with pytest.raises(PoolError, match=r"another tokenizer.*name another history file \(--pool; the pool option\)"):
            engine.generate("x", max_tokens=2, method="ouroboros", options={"pool": str(path)})


def test_methods_sharing_one_pool_stay_lossless(tiny_target, tiny_draft, tmp_path) -> None:
    # one engine's pool serves every method: it grows to the longest phrases asked for (prompt lookup's 4,
    # then a level of 6) and each method reads its own length from it
    path = str(tmp_path / "shared.pool")
    with make_engine(tiny_target, tiny_draft) as engine:
        for method, options in (("prompt-lookup", {}), ("ouroboros", {}), ("lookahead", {"level": 6}),
                                ("ouroboros", {"guess_set": 1}), ("lookahead", {}), ("prompt-lookup", {})):
            for prompt in PROMPTS[:2]:
                base = engine.generate(prompt, max_tokens=24)
                res = engine.generate(prompt, max_tokens=24, method=method, options={**options, "pool": path})
                assert res.tokens == base.tokens, (method, options)
        pool = engine.history.pool(2, 1, path)
        assert (pool.phrase_len, pool.max_per_key) == (5, 8)


def test_bad_options(pair_engine: Engine) -> None:
    for opts, msg in (({"gamma": 0}, "gamma"), ({"level": 2}, "level"), ({"window": 9}, "window"),
                      ({"harvest": "nope"}, "harvest"), ({"gamma": "x"}, "gamma")):
        with pytest.raises(ParameterError, match=msg):
            pair_engine.generate("x", max_tokens=2, method="ouroboros", options=opts)
    assert len(pair_engine.generate("x y", max_tokens=3, method="ouroboros").tokens) == 3


def test_scheduled_ouroboros_mixes_free_phrases_and_the_draft(tiny_target, tiny_draft, monkeypatch) -> None:
    """With the cost model on (the default), ouroboros picks per round between phrases copied from the
    context and its pool and the draft model; the text still equals plain decoding, and a flat cost
    curve (a GPU-like machine) lets both kinds of draft run. From the generic priors, which try every
    copy class: the copy priors, learned on real text, rate the tiny model's short copies below its draft."""
    from ouroboros_local import engine as engine_module
    from ouroboros_local.proposers import create_proposer
    from ouroboros_local.proposers.auto import AutoProposer

    monkeypatch.setattr(engine_module, "copy_priors", lambda: {})

    engine = make_engine(tiny_target, tiny_draft, adaptive=True)   # calibration "off": flat costs
    try:
        proposer = create_proposer("ouroboros", engine.drafting_context(), {})
        assert isinstance(proposer, AutoProposer) and proposer.name == "ouroboros"
        assert [p.name for p in proposer.candidates] == ["suffix", "prompt-lookup", "ouroboros"]
        rounds: dict[str, int] = {}
        for prompt in PROMPTS:
            base = engine.generate(prompt, max_tokens=40, method="vanilla")
            res = engine.generate(prompt, max_tokens=40, method="ouroboros")
            assert res.tokens == base.tokens, prompt
            for key, n in res.stats.extra["auto_rounds"].items():
                rounds[key] = rounds.get(key, 0) + n
        assert rounds.get("prompt-lookup", 0) + rounds.get("suffix", 0) > 0 and rounds.get("ouroboros", 0) > 0, rounds
    finally:
        engine.close()


@pytest.mark.parametrize("draft", [False, True])
def test_ouroboros_drafts_an_answer_asked_again_from_its_history(tiny_target, tiny_draft, draft: bool) -> None:
    """History reuse: a question asked again drafted next to nothing from the pool's 2-token phrases (62
    of 64 plain steps on SmolLM2; auto, with the suffix tries of earlier answers, 5)."""
    engine = make_engine(tiny_target, tiny_draft if draft else None, adaptive=True)
    try:
        base = engine.generate(PROMPTS[1], max_tokens=40, method="vanilla")
        first = engine.generate(PROMPTS[1], max_tokens=40, method="ouroboros")
        again = engine.generate(PROMPTS[1], max_tokens=40, method="ouroboros")
        assert first.tokens == again.tokens == base.tokens
        assert again.stats.target_passes <= base.stats.target_passes // 3, again.stats.extra
    finally:
        engine.close()


def test_method_option_adaptive_false_runs_the_fixed_hyperparameters(tiny_target, tiny_draft) -> None:
    """adaptive=false (a method option) turns the scheduler off for one generation: ouroboros is then
    the bare drafter, every method drafts its fixed gamma, and the text still equals plain decoding."""
    from ouroboros_local.errors import MethodOptionError
    from ouroboros_local.proposers import create_method, create_proposer
    from ouroboros_local.proposers.auto import AutoProposer
    from ouroboros_local.calibration import CostModel
    from ouroboros_local.scheduler import Scheduler

    engine = make_engine(tiny_target, tiny_draft, adaptive=True)
    try:
        # a steep CPU-like curve: the scheduler would draft little or nothing on random tiny models
        engine._scheduler = Scheduler(CostModel(sizes=[1, 2, 4, 8], seconds=[1.0, 1.9, 3.1, 7.8]))
        ctx = engine.drafting_context()
        assert not isinstance(create_proposer("ouroboros", ctx, {"adaptive": False}), AutoProposer)
        assert create_method("prompt-lookup", ctx, {"adaptive": False}).scheduled is False
        assert create_method("prompt-lookup", ctx, {}).scheduled is True
        prompt = PROMPTS[0]
        base = engine.generate(prompt, max_tokens=24, method="vanilla")
        fixed = engine.generate(prompt, max_tokens=24, method="speculative",
                                options={"adaptive": False, "gamma": 3})
        scheduled = engine.generate(prompt, max_tokens=24, method="speculative", options={"gamma": 3})
        assert fixed.tokens == base.tokens == scheduled.tokens
        assert fixed.stats.drafted >= 3 * (fixed.stats.target_passes - 1)   # gamma every round (the last: what is left)
        assert scheduled.stats.drafted < fixed.stats.drafted
        with pytest.raises(MethodOptionError, match="no fixed-parameter mode"):
            engine.generate(prompt, max_tokens=4, method="auto", options={"adaptive": False})
        with pytest.raises(MethodOptionError, match="true or false"):
            engine.generate(prompt, max_tokens=4, method="speculative", options={"adaptive": "no"})
    finally:
        engine.close()


@pytest.mark.parametrize("round_size", [0, 4])
def test_a_draft_that_cannot_pay_even_when_always_right_never_decodes(tiny_target, tiny_draft, round_size) -> None:
    """With this machine's measured curves planted (the 0.5B draft's step costs 0.57 of the 1.5B target's,
    verifying 4 tokens 2.7 steps), the draft model is retired before it drafts: auto, speculative and
    ouroboros never decode on it, say so in the stats, and give plain decoding's text. (Ouroboros's
    floor: a forward over its 7-token window commits at most 5 tokens, 0.51 target steps a token.) In
    rounds of one size too (a CUDA GPU's default), where a copy's drafts go unpriced but a draft model's
    steps still cost their time."""
    from ouroboros_local.calibration import CostModel
    from ouroboros_local.scheduler import MIN_GAIN, Scheduler

    target = CostModel(sizes=[1, 2, 3, 4, 6, 8, 16], seconds=[0.035, 0.058, 0.078, 0.097, 0.144, 0.235, 0.30])
    draft = CostModel(sizes=[1, 2, 4, 8, 16], seconds=[0.020, 0.037, 0.049, 0.089, 0.123])
    engine = make_engine(tiny_target, tiny_draft, adaptive=True, round_size=round_size)
    try:
        engine._scheduler = Scheduler(target, draft_costs=draft)
        engine._scheduler.observe_round = lambda n_tokens, seconds: None   # tiny models' times aside
        base = engine.generate(PROMPTS[0], max_tokens=24, method="vanilla")
        for method in ("auto", "speculative"):
            out = engine.generate(PROMPTS[0], max_tokens=24, method=method)
            assert out.tokens == base.tokens
            assert 0.85 < out.stats.extra["draft_ceiling"]["speculative"] < 1.0
            assert out.stats.extra["draft_steps"] == 0
        out = engine.generate(PROMPTS[0], max_tokens=24, method="ouroboros")
        assert out.tokens == base.tokens
        assert 0.95 < out.stats.extra["draft_ceiling"]["ouroboros"] < MIN_GAIN   # 17 perfect tokens: 1.003
        assert out.stats.extra["ouro_draft_forwards"] == 0
        assert engine.draft_kv().n_past == 0       # the draft never read a token
        # the same pair beside a GPU-like flat curve: the draft is asked (and may then be scheduled out)
        engine._scheduler = Scheduler(CostModel(sizes=[1, 16], seconds=[0.035, 0.04]), draft_costs=draft)
        engine._scheduler.observe_round = lambda n_tokens, seconds: None
        out = engine.generate(PROMPTS[0], max_tokens=24, method="speculative")
        assert out.tokens == base.tokens and "draft_ceiling" not in out.stats.extra
        assert out.stats.extra["draft_steps"] > 0
    finally:
        engine.close()
