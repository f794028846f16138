"""AdaEDL early draft stopping in the draft-model proposer (options["adaedl"] = True)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from ouroboros_local.errors import ParameterError
from ouroboros_local.proposers import check_options
from ouroboros_local.proposers.base import ProposeSetup
from ouroboros_local.proposers.draft_model import (AdaEDL, DraftModelProposer, adaedl_from_options,
                                                   logits_entropy, probs_entropy)
from ouroboros_local.sampling import SamplingParams
from ouroboros_local.testing.lossless import assert_first_pairs_follow_the_target
from ouroboros_local.tree import TokenTree
from ouroboros_local.verify import VerifyResult

from test_engine import PROMPTS, make_engine


@pytest.fixture(scope="module")
def engine(tiny_target, tiny_draft):
    eng = make_engine(tiny_target, tiny_draft)
    yield eng
    eng.close()


# ---- the rule on synthetic logits ---------------------------------------------------------------

def test_entropies() -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=300).astype(np.float32) * 3
    p = np.exp(x - x.max())
    p /= p.sum()
    exact = float(-(p * np.log(p)).sum())
    assert logits_entropy(x) == pytest.approx(exact, rel=1e-4)
    assert probs_entropy(p.astype(np.float64)) == pytest.approx(exact, rel=1e-6)
    assert logits_entropy(np.zeros(1000, dtype=np.float32)) == pytest.approx(math.log(1000), rel=1e-5)
    padded = np.concatenate([x, np.full(50, -np.inf, dtype=np.float32)])
    assert logits_entropy(padded) == pytest.approx(exact, rel=1e-4)     # -inf padding is fine
    one_hot = np.full(100, -np.inf, dtype=np.float32)
    one_hot[7] = 1.0
    assert logits_entropy(one_hot) == pytest.approx(0.0, abs=1e-6)
    q = np.zeros(10)
    q[3] = 1.0
    assert probs_entropy(q) == 0.0


def test_stopping_rule_and_threshold() -> None:
    ada = AdaEDL()                       # gamma_e 0.2, lambda 0.7 -> stop above 0.45 nats
    assert ada.entropy_threshold == pytest.approx(0.45)
    assert not ada.should_stop(0.44) and ada.should_stop(0.46)
    peaked = np.full(1000, -10.0, dtype=np.float32)
    peaked[0] = 10.0
    flat = np.zeros(1000, dtype=np.float32)
    assert not ada.should_stop(logits_entropy(peaked))
    assert ada.should_stop(logits_entropy(flat))
    assert ada.acceptance_bound(0.0) == 1.0


def test_lambda_update_follows_algorithm_1() -> None:
    ada = AdaEDL(lam=0.5)
    assert ada.ar == 0.9
    ada.update(n_drafted=4, n_accepted=0, l_max=8)       # AR = 0.45 < alpha: lambda' = lambda + eps
    assert ada.ar == pytest.approx(0.45)
    assert ada.lam == pytest.approx(0.9 * 0.5 + 0.1 * 0.51)
    ada = AdaEDL(lam=0.5)
    ada.update(n_drafted=3, n_accepted=3, l_max=8)        # AR = 0.95, stopped short: lambda - eps
    assert ada.lam == pytest.approx(0.9 * 0.5 + 0.1 * 0.49)
    ada = AdaEDL(lam=0.5)
    ada.update(n_drafted=8, n_accepted=8, l_max=8)        # all L_max accepted: unchanged
    assert ada.lam == pytest.approx(0.5)
    before = (ada.lam, ada.ar)
    ada.update(n_drafted=0, n_accepted=0, l_max=8)        # nothing drafted: no update
    assert (ada.lam, ada.ar) == before
    for _ in range(2000):                                 # stays a valid threshold
        ada.update(4, 0, 8)
    assert 0.0 <= ada.lam < 1.0


def test_options_and_validation() -> None:
    assert adaedl_from_options({}) is None
    assert adaedl_from_options({"adaedl": False}) is None
    ada = adaedl_from_options(check_options("speculative", {"adaedl": "true", "adaedl_lambda": 0.4,
                                                            "adaedl_gamma_e": 0.3}))
    assert ada.lam == 0.4 and ada.gamma_e == 0.3 and ada.beta1 == 0.5 and ada.eps == 0.01
    for key, bad in (("adaedl_lambda", 1.5), ("adaedl_gamma_e", 0.0), ("adaedl_alpha", -0.1),
                     ("adaedl_beta2", "x")):
        with pytest.raises(ParameterError, match=key):
            adaedl_from_options(check_options("speculative", {"adaedl": True, key: bad}))


class FakeKV:
    """Stands in for the draft KVCache: serves scripted logits rows."""

    def __init__(self, rows: list[np.ndarray]):
        self.rows = rows
        self.i = 0
        self.cached: list[int] = []

    def _next(self) -> np.ndarray:
        row = self.rows[min(self.i, len(self.rows) - 1)]
        self.i += 1
        return row

    def sync_to(self, tokens, logits_last=False, agreed=0, end=None):
        self.cached = list(tokens[:end])
        return self._next() if logits_last else None

    def feed(self, tokens, logits_last=False):
        self.cached.extend(tokens)
        return self._next() if logits_last else None

    def truncate(self, n):
        del self.cached[n:]


def _row(top: int, n: int = 200, peak: float = 20.0) -> np.ndarray:
    row = np.zeros(n, dtype=np.float32)
    row[top] = peak
    return row


@pytest.mark.parametrize("greedy", [True, False])
def test_stops_early_on_a_high_entropy_draft(greedy: bool) -> None:
    # two confident rows, then a flat (high-entropy) one: the draft stops after 2 tokens
    rows = [_row(5), _row(6), np.zeros(200, dtype=np.float32), _row(7)]
    proposer = DraftModelProposer(FakeKV(rows), n_target_vocab=200, gamma=8, adaedl=AdaEDL())
    sampling = SamplingParams() if greedy else SamplingParams(temperature=1.0, top_k=0, top_p=1.0,
                                                                min_p=0.0)
    proposer.begin([1, 2, 3], ProposeSetup(sampling=sampling, rng=np.random.default_rng(0),
                                           max_tree_nodes=63, max_branches=8))
    tree = proposer.propose([1, 2, 3], budget=8)
    assert tree.tokens == [3, 5, 6]
    stats = proposer.stats()
    assert stats["adaedl_early_stops"] == 1 and stats["mean_draft_len"] == 2.0
    # without AdaEDL the same draft runs to the cap
    plain = DraftModelProposer(FakeKV(rows), n_target_vocab=200, gamma=8)
    plain.begin([1, 2, 3], ProposeSetup(sampling=sampling, rng=np.random.default_rng(0),
                                        max_tree_nodes=63, max_branches=8))
    assert plain.propose([1, 2, 3], budget=8).n_candidates == 8


def test_the_first_token_is_always_drafted() -> None:
    proposer = DraftModelProposer(FakeKV([np.zeros(200, dtype=np.float32)]), 200, gamma=4,
                                  adaedl=AdaEDL())
    proposer.begin([1], ProposeSetup(sampling=SamplingParams(), rng=np.random.default_rng(0),
                                     max_tree_nodes=63, max_branches=8))
    assert proposer.propose([1], budget=4).n_candidates == 1


def test_lambda_learns_only_from_its_own_rounds() -> None:
    rows = [_row(5), _row(6), np.zeros(200, dtype=np.float32)]
    proposer = DraftModelProposer(FakeKV(rows), 200, gamma=8, adaedl=AdaEDL())
    proposer.begin([1], ProposeSetup(sampling=SamplingParams(), rng=np.random.default_rng(0),
                                     max_tree_nodes=63, max_branches=8))
    proposer.propose([1], budget=8)
    foreign = TokenTree.rooted_at(1)            # e.g. method "auto" let another proposer draft
    foreign.add(0, 9)
    lam = proposer.adaedl.lam
    result = VerifyResult(tree=foreign, path=[0], accepted=[], bonus=4, predictions=np.zeros(2))
    proposer.observe([1, 4], result)
    assert proposer.adaedl.lam == lam


# ---- in the engine ------------------------------------------------------------------------------

SETTINGS = [
    {"adaedl": True},                                            # defaults (cap 8)
    {"adaedl": True, "gamma": 3},
    {"adaedl": True, "adaedl_gamma_e": 0.01, "adaedl_lambda": 0.3},   # rarely stops: long drafts
    {"adaedl": True, "adaedl_lambda": 0.95, "gamma": 6},         # stops almost always
]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_equals_vanilla(engine, prompt) -> None:
    base = engine.generate(prompt, max_tokens=40)
    lengths = []
    for opts in SETTINGS:
        res = engine.generate(prompt, max_tokens=40, method="speculative", options=opts)
        assert res.tokens == base.tokens, opts
        extra = res.stats.extra
        assert {"adaedl_early_stops", "adaedl_stop_rate", "mean_draft_len", "adaedl_lambda"} <= set(extra)
        assert 0.0 <= extra["adaedl_stop_rate"] <= 1.0
        lengths.append(extra["mean_draft_len"])
    assert lengths[2] > lengths[3]          # the threshold really changes the draft length


def test_high_entropy_tiny_models_stop_early(engine) -> None:
    # random tiny models are uncertain (H of several nats over 509 tokens): the default stops
    res = engine.generate(PROMPTS[1], max_tokens=30, method="speculative", options={"adaedl": True})
    assert res.stats.extra["adaedl_early_stops"] > 0
    assert res.stats.extra["mean_draft_len"] < 8


def test_sampling_is_lossless(engine, tiny_target) -> None:
    # seeded, the draft is greedy: the rule reads the entropy of its untruncated softmax (sampled drafts,
    # whose q is truncated, are test_engine's test_sampled_drafts_are_lossless); lambda 0.5 stops often
    opts = {"adaedl": True, "adaedl_lambda": 0.5, "gamma": 4}
    params = SamplingParams(temperature=1.0, top_k=6, top_p=1.0, min_p=0.0)
    # 4 tokens so that the first round may draft 3 (the rule never stops the first token);
    # the first two emitted tokens must follow the target's joint distribution
    results = assert_first_pairs_follow_the_target(engine, tiny_target, PROMPTS[1], params, 1200,
                                                   max_tokens=4, method="speculative", options=opts)
    assert sum(r.stats.extra["adaedl_early_stops"] for r in results) > 0   # the rule was active


def test_seeded_sampling_is_reproducible(engine) -> None:
    sp = SamplingParams(temperature=0.8, seed=7)
    a = engine.generate(PROMPTS[0], max_tokens=20, method="speculative", sampling=sp,
                        options={"adaedl": True})
    b = engine.generate(PROMPTS[0], max_tokens=20, method="speculative", sampling=sp,
                        options={"adaedl": True})
    assert a.tokens == b.tokens


@pytest.mark.parametrize("round_size, overlap", [(0, False), (4, True)])
def test_adaedl_learns_in_rounds_that_draft_while_they_decode(tiny_target, tiny_self_draft, monkeypatch,
                                                              round_size, overlap) -> None:
    """In rounds of one size drafting while they decode (a GPU's defaults) the verdict is on a copy of the
    draft cut to what was verified: AdaEDL learned only from the draft object itself, so never there."""
    updates: list[tuple[int, int, int]] = []
    real = AdaEDL.update
    monkeypatch.setattr(AdaEDL, "update", lambda self, *args: updates.append(args) or real(self, *args))
    with make_engine(tiny_target, tiny_self_draft, round_size=round_size, overlap=overlap) as eng:
        base = eng.generate(PROMPTS[1], max_tokens=40)
        res = eng.generate(PROMPTS[1], max_tokens=40, method="speculative",
                           options={"adaedl": True, "adaedl_lambda": 0.0})
    assert res.tokens == base.tokens
    assert len(updates) >= 3 and all(accepted <= drafted for drafted, accepted, _ in updates), updates
