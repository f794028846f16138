"""Vanilla speculative decoding: a small draft model writes ``gamma`` tokens, the target checks them.

Greedy: the draft's argmax chain (deterministic). Sampling: each draft token is drawn from the draft's
processed distribution q, which travels with the node so the verifier can do rejection sampling.
The draft's KV cache is kept in step with the committed text by prefix reuse: only tokens the draft has
not seen (the target's bonus, a corrected token) are decoded again.

Early draft stopping (optional, ``options["adaedl"] = True``): AdaEDL (Agrawal, Jeon & Lee,
arXiv 2410.18351; docs/design.md#adaedl). Before appending draft token i >= 1 the proposer
computes the entropy H (nats) of the draft distribution at that position and stops if
``1 - sqrt(gamma_e * H) < lambda``; ``gamma`` becomes the hard cap L_max. ``lambda`` adapts after every
round from an EMA of the acceptance rate (see ``AdaEDL.update``). For a greedy draft H is taken from the
draft's temperature-1 softmax of the raw logits (the one-hot q would have H = 0); for a sampled draft it
is the entropy of the processed q the token is drawn from. Stopping only shortens the draft, so the
output is unchanged (greedy) or keeps the target's distribution (sampling).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from .. import options as opt
from ..errors import ParameterError
from ..kv import KVCache, common_prefix
from ..sampling import Sparse, support
from ..acceptance import probability_class
from ..tree import TokenTree
from .base import CatchUp, DraftingContext, ProposeSetup, Proposer

if TYPE_CHECKING:  # pragma: no cover
    from ..calibration import CostModel
    from ..verify import VerifyResult


def _shifted(logits: np.ndarray, top: float) -> np.ndarray:
    """max(logits - top, -80) as a new float32 array (exp(-80) ~ 1e-35 keeps 0 * -inf and
    denormals out, and changes no float32 sum)."""
    z = np.subtract(logits, np.float32(top), dtype=np.float32)
    return np.maximum(z, np.float32(-80.0), out=z)


def logits_entropy(logits: np.ndarray) -> float:
    """Entropy (nats) of softmax(logits) at temperature 1; -inf entries are allowed."""
    z = _shifted(logits, float(np.max(logits)))
    e = np.exp(z)
    s = float(e.sum())
    return max(0.0, math.log(s) - float(np.dot(e, z)) / s)


def top_probability(logits: np.ndarray, token: int | None = None) -> float:
    """Probability of the argmax token (pass it as ``token`` when known: saves the max pass) under
    softmax(logits) at temperature 1.

    Exact needs exp over the whole vocabulary: done in place on one float32 array (subtract, exp,
    sum). No clamp: a logit 80 below the top adds under 2e-35 to a sum >= 1, nothing in float32."""
    top = float(logits[token]) if token is not None else float(np.max(logits))
    z = np.subtract(logits, np.float32(top), dtype=np.float32)
    return 1.0 / float(np.exp(z, out=z).sum())


def probs_entropy(probs: np.ndarray | Sparse) -> float:
    """Entropy (nats) of a dense probability vector (zeros allowed) or a ``Sparse`` one."""
    if isinstance(probs, Sparse):
        return probs.entropy()
    p = probs[probs > 0]
    return max(0.0, float(-np.dot(p, np.log(p))))


@dataclass
class AdaEDL:
    """Entropy-based early draft stopping with an adaptive threshold (AdaEDL's Algorithm 1).

    Defaults follow the paper (docs/design.md#adaedl); ``lam`` (the initial lambda) is not fixed
    by the paper (it sweeps 0.3-0.9): 0.7 stops when H > 0.45 nats.
    """

    gamma_e: float = 0.2   # entropy scale in the bound  beta ~ 1 - sqrt(gamma_e * H)
    lam: float = 0.7       # current threshold lambda (initial value lambda_0)
    alpha: float = 0.9     # acceptance-rate target
    beta1: float = 0.5     # EMA weight of the acceptance rate
    beta2: float = 0.9     # smoothing of lambda
    eps: float = 0.01      # lambda step
    ar: float | None = None  # acceptance-rate EMA; starts at alpha

    def __post_init__(self) -> None:
        checks = [("adaedl_gamma_e", self.gamma_e, 0.0, math.inf, False),
                  ("adaedl_lambda", self.lam, 0.0, 1.0, True),
                  ("adaedl_alpha", self.alpha, 0.0, 1.0, True),
                  ("adaedl_beta1", self.beta1, 0.0, 1.0, True),
                  ("adaedl_beta2", self.beta2, 0.0, 1.0, True),
                  ("adaedl_eps", self.eps, 0.0, 1.0, True)]
        for name, value, lo, hi, closed_lo in checks:
            ok = isinstance(value, (int, float)) and math.isfinite(value) and value < hi and \
                (value >= lo if closed_lo else value > lo)
            if not ok:
                raise ParameterError(f"{name} must be in {'[' if closed_lo else '('}{lo}, {hi}) "
                                     f"(got {value!r})")
        if self.ar is None:
            self.ar = self.alpha

    def acceptance_bound(self, entropy: float) -> float:
        return 1.0 - math.sqrt(self.gamma_e * entropy)

    def should_stop(self, entropy: float) -> bool:
        return self.acceptance_bound(entropy) < self.lam

    @property
    def entropy_threshold(self) -> float:
        """The entropy (nats) above which drafting stops at the current lambda."""
        return (1.0 - self.lam) ** 2 / self.gamma_e

    def update(self, n_drafted: int, n_accepted: int, l_max: int) -> None:
        """Adapt lambda after a round that drafted ``n_drafted`` (>= 1) tokens under cap ``l_max``."""
        if n_drafted <= 0:
            return
        assert self.ar is not None
        self.ar = self.beta1 * self.ar + (1.0 - self.beta1) * (n_accepted / n_drafted)
        if self.ar < self.alpha:
            target = self.lam + self.eps          # acceptance too low: stop earlier
        elif n_accepted != l_max:
            target = self.lam - self.eps          # high acceptance but we stopped short: draft longer
        else:
            target = self.lam
        lam = self.beta2 * self.lam + (1.0 - self.beta2) * target
        self.lam = min(max(lam, 0.0), 0.999)


class DraftModelProposer(Proposer):
    name = "speculative"
    adaptive = True   # a chain: the scheduler caps, stops and trims it by the cost model
    confidence_classes = True

    def __init__(self, kv: KVCache, n_target_vocab: int, gamma: int = 4, p_min: float = 0.0,
                 adaedl: AdaEDL | None = None, greedy_draft: bool | None = None):
        self.kv = kv
        self.gamma = gamma
        self.p_min = p_min
        self.n_target_vocab = n_target_vocab
        self.adaedl_init = adaedl
        self.adaedl: AdaEDL | None = None
        # Greedy drafts even when sampling: verified by sample-and-match, every emitted token uses
        # exactly one uniform, so a seeded run equals plain seeded decoding whatever the draft lengths
        # (up to the batch shape's floating-point effects on the rows: docs/design.md#exactness).
        # Sampled drafts are accepted more often (min(1, p/q)), but how many uniforms a round uses
        # depends on its draft's length, which the scheduler sets from timings: a seeded text would
        # change from run to run. None: greedy exactly when the request has a seed.
        self.greedy_draft_option = greedy_draft
        self.greedy_draft = bool(greedy_draft)
        self._catch_up = CatchUp()
        self._reset_counters()

    def draft_cost_floor(self, draft_costs: "CostModel") -> float | None:
        return draft_costs.cost(1)    # one draft decode per drafted token

    @property
    def drafts_ahead(self) -> bool:   # type: ignore[override]
        # a sampled draft would meet the step's token by sample-and-match: lossless, but accepted less
        # often than by its own rule (min(1, p/q))
        return self.greedy_draft or self.setup.sampling.greedy

    def _reset_counters(self) -> None:
        self.draft_steps = 0
        self.rounds = 0
        self.drafted = 0
        self.early_stops = 0
        self.cost_stops = 0       # drafts the scheduler stopped (one more token could not pay)
        self._last_tree: TokenTree | None = None
        self._last_cap = 0
        # watermark: the draft KV holds committed[:_agreed] (committed only grows within a generation),
        # so syncing compares the new tokens only
        self._agreed = 0

    def begin(self, prompt: Sequence[int], setup: ProposeSetup) -> None:
        super().begin(prompt, setup)
        option = self.greedy_draft_option
        self.greedy_draft = setup.sampling.seed is not None if option is None else option
        self._reset_counters()
        self._catch_up.start()
        # a fresh copy per generation: lambda adapts within a generation, never across requests
        # (keeps seeded sampling runs reproducible)
        if self.adaedl_init is not None:
            self.adaedl = AdaEDL(**{**self.adaedl_init.__dict__, "ar": None})

    def _row(self, logits: np.ndarray) -> np.ndarray:
        # Tokens the target does not have can never be accepted: keep q on the target's vocabulary
        # (a view; a shorter draft vocabulary needs no padding, its missing ids have probability 0).
        n = self.n_target_vocab
        return logits[:n] if len(logits) > n else logits

    def catch_up_tokens(self, committed: Sequence[int]) -> int:
        return max(0, len(committed) - 1 - self._agreed)

    def propose(self, committed: Sequence[int], budget: int) -> TokenTree:
        tree = TokenTree.rooted_at(committed[-1])
        self._last_tree = None
        self.catch_up_seconds = 0.0
        n = min(self.gamma, budget)
        if n <= 0:
            return tree
        # the text of the rounds it skipped
        self.catch_up_seconds = self._catch_up.before_draft(
            lambda: self.kv.sync_to(committed, agreed=self._agreed, end=len(committed) - 1))
        logits = self.kv.sync_to(committed, logits_last=True, agreed=self._agreed)
        self._agreed = len(committed)
        self.draft_steps += 1
        sampling = self.setup.sampling
        ada = self.adaedl
        extend_pays = self.setup.extend_pays
        classes: list[str] = []
        node = 0
        for i in range(n):
            row = self._row(logits)
            if sampling.greedy or self.greedy_draft:
                if ada is not None and i > 0 and ada.should_stop(logits_entropy(row)):
                    self.early_stops += 1
                    break
                token = int(np.argmax(row))
                q = None
                conf = top_probability(row, token)
                if self.p_min > 0.0 and conf < self.p_min and i > 0:
                    break
            else:
                q = support(row, sampling)
                if ada is not None and i > 0 and ada.should_stop(q.entropy()):
                    self.early_stops += 1
                    break
                # judged on the distribution before the draw: a token dropped for its own q(x) would
                # bias what is kept toward likelier drafts
                if self.p_min > 0.0 and i > 0 and float(q.probs.max()) < self.p_min:
                    break
                token = q.sample(self.setup.rng)
                conf = q.prob(token)
            node = tree.add(node, token, draft_probs=q, source="draft")
            tree.classes[node] = probability_class(conf)
            classes.append(tree.classes[node])
            if token in self.setup.eog_tokens or i == n - 1:
                break
            if extend_pays is not None and not extend_pays(self.name, classes):
                self.cost_stops += 1
                break
            logits = self.kv.feed([token], logits_last=True)
            self.draft_steps += 1
        self.rounds += 1
        self.drafted += tree.n_candidates
        self._last_tree = tree
        self._last_cap = n
        return tree

    def observe(self, committed: Sequence[int], result: "VerifyResult") -> None:
        # Drop the draft's cells past what the target accepted; the next propose() decodes the
        # missing tokens (a corrected token, the bonus) in one batch. A round it did not draft in left
        # nothing to drop (most rounds of auto where the draft does not pay).
        cached, agreed = self.kv.cached, self._agreed
        if (len(cached) != agreed or agreed > len(committed)
                or (agreed and cached[agreed - 1] != committed[agreed - 1])):
            self._agreed = common_prefix(cached, committed, agreed)
            self.kv.truncate(self._agreed)
        self._catch_up.observed()
        # learn only from rounds whose tree this proposer made (method "auto" lets every
        # candidate observe every round)
        # (a round that drafted while it decoded judges the draft's first levels: the verdict's tree is the
        # draft cut above what is not yet verified, a copy; taking only the draft object itself, AdaEDL
        # never learned in rounds of one size with overlap, a GPU's defaults)
        if self.adaedl is not None and self._last_tree is not None and _cut_of(result.tree, self._last_tree):
            self.adaedl.update(result.tree.n_candidates, len(result.accepted), self._last_cap)
        self._last_tree = None

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {"draft_steps": self.draft_steps,
                               "draft_rounds": self.rounds,
                               "mean_draft_len": round(self.drafted / self.rounds, 3) if self.rounds else 0.0,
                               "cost_stops": self.cost_stops}
        if self.adaedl is not None:
            out.update({"adaedl_early_stops": self.early_stops,
                        "adaedl_stop_rate": round(self.early_stops / self.rounds, 3) if self.rounds else 0.0,
                        "adaedl_lambda": round(self.adaedl.lam, 4),
                        "adaedl_acceptance_ema": round(float(self.adaedl.ar or 0.0), 4)})
        return out


def _cut_of(tree: TokenTree, draft: TokenTree) -> bool:
    """Is ``tree`` the chain ``draft`` or its first nodes (``verify.judged``'s cut)?"""
    n = len(tree.tokens)
    return tree is draft or (1 < n <= len(draft.tokens) and tree.tokens == draft.tokens[:n]
                             and tree.parents == draft.parents[:n])


ADAEDL_OPTIONS = {"adaedl_gamma_e": "gamma_e", "adaedl_lambda": "lam", "adaedl_alpha": "alpha",
                  "adaedl_beta1": "beta1", "adaedl_beta2": "beta2", "adaedl_eps": "eps"}
ADAEDL_DEFAULT_CAP = 8   # gamma (= L_max) when AdaEDL is on and no gamma is given
# speculative's options; map_specials/keep_unstable matter only for a draft of another vocabulary
NEEDS_DRAFT = True   # refused before the models load when no draft is given
OPTIONS: tuple[opt.Option, ...] = (opt.GAMMA, opt.P_MIN, opt.ADAEDL, opt.ADAEDL_LAMBDA, *opt.ADAEDL_TUNING,
                                   opt.GREEDY_DRAFT, opt.MAP_SPECIALS, opt.KEEP_UNSTABLE, opt.ADAPTIVE)


def adaedl_from_options(options: dict[str, Any]) -> AdaEDL | None:
    """``AdaEDL`` built from ``adaedl`` (bool) and ``adaedl_*`` options, or None when off."""
    if not options.get("adaedl"):
        return None
    return AdaEDL(**{attr: float(options[key]) for key, attr in ADAEDL_OPTIONS.items()
                     if options.get(key) is not None})


def create(ctx: DraftingContext, options: dict[str, Any]) -> Proposer:
    """``options``: checked against ``OPTIONS``."""
    adaedl = adaedl_from_options(options)
    gamma = options["gamma"] or (ADAEDL_DEFAULT_CAP if adaedl is not None else 4)
    return DraftModelProposer(ctx.draft_kv(), ctx.target.n_vocab, gamma=gamma, p_min=options["p_min"],
                              adaedl=adaedl, greedy_draft=options["greedy_draft"])
