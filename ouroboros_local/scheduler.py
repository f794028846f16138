"""Hardware-aware draft lengths: a measured verify-cost curve times an online acceptance estimate.

The model (docs/design.md#cost-model). Verifying a chain of k draft tokens costs one target decode of
k + 1 tokens, ``c(k + 1)``, measured on this machine (on a 2-core CPU c(8) is ~5.5 c(1); on a GPU it is
nearly flat), plus the proposer's own drafting cost ``d(k)`` (k draft-model steps; zero for prompt
lookup). If each draft token is right with probability alpha given the ones before it were (a geometric
acceptance model), one round yields on average

    E(k) = 1 + alpha + ... + alpha^k = (1 - alpha^(k+1)) / (1 - alpha)

tokens (the bonus token included), so the throughput of length k is ``E(k) / (c(k+1) + d(k))``. The
scheduler picks the k that maximises it, and k = 0 (plain decoding) unless that k beats plain decoding by
(MIN_GAIN - 1) / k (5% for one token: the estimates are noisy, and where verifying two tokens costs 1.6
steps a one-token draft that promised 2% loses more often than it wins). alpha is
estimated per proposer from what verification accepted: every accepted draft token is a success and
every round that stopped short of its draft's end is one failure (maximum likelihood for the geometric
model), with a weak prior and exponential forgetting so it tracks the text as it changes.

When k = 0 wins, no drafts are made and alpha would never be re-measured, so the scheduler still probes
with a short draft now and then; the interval doubles after each probe after which drafting still does
not pay (its measured cost included), and the measured cost of all probes (their drafting, a draft
model's catch-up on the text it skipped, their extra verification) is held within PROBE_BUDGET of the
time (each method's own, where one engine runs several), so hopeless text loses at most ~1% while
drafting can resume when the text turns repetitive; a probe that must first read skipped text waits
until its request has run four times what that reading costs (PROBE_REQUEST_SHARE), so that no short
answer pays for it. A drafter that is looked at (``_worth_a_look``) is probed only in its request's first
EARLY_PROBE_ROUNDS rounds, and by a look past its classes' backoff instead of a verification: the text
scores what it drafted, as a probe's two tokens once it has matched them (``_learn_probe``); after those
rounds, its looks re-measure the classes it drafts.
Before a proposer has drafted at all, the prior (alpha = 0.5) decides: a GPU drafts at once, a CPU
probes first.

A ceiling. Where one draft-model step costs a large share of a target step and verification is steep,
drafting gains nothing even if every draft token is accepted (2 CPU cores: the 0.5B draft costs 0.55
steps of the 1.5B target, so only a 15-token draft accepted whole, verified in 5 steps, would pay: 1.2x).
A drafter whose ceiling is below MIN_GAIN is *retired* (``hopeless``): it is not asked, not probed, and
never catches up on text. Its cost is the floor of what drafting can cost: its prior from the draft's
calibrated curve (``Proposer.draft_cost_floor``: one draft step per token for a chain drafter; for
Ouroboros, a forward over its window divided by the most tokens one forward can commit) until it has
drafted RETIRE_AFTER rounds, then the least it was measured to cost per token.

Confidence classes. One alpha per proposer averages easy and hard tokens; on a CPU, where a draft token
must be right ~70-90% of the time to pay for its share of the verification, that average says "never
draft" although some drafts are nearly always right (a long copy from the prompt, a token the draft
model gives probability 0.99). Proposers therefore label each node with a class (tree.classes: the
draft's probability bin, or how far a copy's match extends, and its depth) and the scheduler learns the
conditional acceptance per class (``ConfidenceTable``, shrunk towards the proposer's depth estimate).
A labelled draft is then *trimmed* to the depth whose expected tokens per second is best
(``trim``), a draft model stops writing once one more token cannot pay (``extend_pays``), and whether
to draft at all is decided from the mix of first-token classes seen so far (``best_length``). What
``trim`` cuts from a chain is never verified, so the text the target writes next scores it: that text is
what verification would have accepted (held.py), and an estimate that said "no" is still corrected.
A branching tree's cut nodes cannot be scored that way; a tree whose first class was verified fewer
than MEASURE_TRIALS times is kept at the probe length as a probe (within the same budget).
The table learns over all requests; within one request the estimates are also scaled by how that
request's drafts fared against them (``request_scale``), so a text unlike the rest stops drafting in a
few failed drafts instead of the ~30 the table's decay needs.
"""

from __future__ import annotations

import logging
import math
import time
from bisect import bisect_right
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np

from .acceptance import Acceptance, ConfidenceTable
from .calibration import CostModel
from .held import HeldDraft, HeldDrafts
from .looks import Looks
from .proposers.base import checked_tree
from .round_costs import RoundCosts
from .tree import TokenTree

if TYPE_CHECKING:  # pragma: no cover
    from .proposers.base import Proposer

log = logging.getLogger("ouroboros_local")

PROBE_BUDGET = 0.01      # share of the time that probes of a draft that does not pay may cost
PROBE_EVERY = 8          # idle rounds before a probe: at first, and after a probe after which drafting pays
PROBE_EVERY_MAX = 256    # ... doubled after each probe that did not, up to this
REFRESH_ROUNDS = 64     # rounds a "does drafting pay" answer is kept while nothing it reads changed
REQUEST_PRIOR = 3.0     # accepted tokens' worth of weight the learned class estimates keep in a request
REQUEST_SCALE = (0.2, 1.25)   # bounds of a request's correction of those estimates
MAX_ALPHA = 0.995       # a corrected estimate stays below certainty (a geometric series must converge)
MIN_GAIN = 1.05         # a one-token draft must promise this much over plain decoding (k tokens: 0.05 / k);
                        # on a CPU whose curve is steep a wrong "pays" costs more than a wrong "does not"
CATCH_UP_MIN = 16       # a draft model this many tokens behind must first be shown to repay its catch-up
CATCH_UP_REPAY_ROUNDS = 64   # ... within this many drafted rounds (or fit the probe budget)
PROBE_REQUEST_SHARE = 0.25   # ... and a probe's catch-up at most this share of the request's time so far
CATCH_UP_PRIOR_BATCH = 16    # until measured, a catch-up token costs the draft's per-token cost in a batch
                             # this size (its calibrated curve; without one, the target's scaled by size)
LOOK_COST = 0.05        # a drafter is looked at (looks.py) if cheap: a full-length proposal costs less than
                        # this share of a target step
EARLY_PROBE_ROUNDS = 32  # a request's first rounds: drafters that are looked at are probed too
MEASURE_TRIALS = 4.0    # a tree whose first class was tried fewer times is a probe (``_kept_at_least``)
RETIRE_AFTER = 3        # drafted rounds timed before their least per-token cost may retire a drafter (the
                        # first draft decode can page the weights in: one slow round must not retire it)
RETIRE_MIN_COST = 0.1   # only a drafter whose token costs this share of a target step or more (a model) can
                        # be retired: free drafters cost microseconds, and one retired for a round-cost factor
                        # that happened to be high would never draft again to correct it


@dataclass(slots=True)
class _PaysMemo:
    """A "does drafting pay" answer (``Scheduler._drafting_pays``) and what it was computed from."""

    key: tuple         # the drafting cost's key and ``Scheduler._epoch``
    limit: int         # the draft length it allowed
    rounds: int        # ``Scheduler._rounds`` then
    changes: int       # ``Scheduler._changes`` of the proposer then
    raises: int        # ``Scheduler._raises`` of the proposer then
    pays: bool


@dataclass(slots=True)
class _QuietRounds:
    """Rounds ``_plan_quiet`` foresaw idle, and what it relied on."""

    left: int          # rounds still to answer at once
    epoch: int         # the request and method (``Scheduler._epoch``)
    raises: int        # news that could make drafting pay (``Scheduler._raises``)
    looks: bool        # each round counts towards the next look (``_worth_a_look``)
    held: bool         # a probe is due but the probe budget holds it back: asked each round
    retired: bool = False   # ``hopeless``: no idle rounds counted towards a probe


class Scheduler:
    """Chooses per round how many draft tokens each proposer may propose."""

    def __init__(self, costs: CostModel, max_length: int = 16, probe_length: int = 2,
                 draft_scale: float = 1.0, draft_costs: CostModel | None = None):
        self.costs = costs
        # the draft model's own calibrated curve: the prior of what its steps and catch-ups cost
        self.draft_costs = draft_costs
        # draft weights / target weights: the prior of a catch-up's cost without that curve
        self.draft_scale = draft_scale
        # What rounds really cost here, per batch size n: an EMA of measured seconds / calibrated c(n)
        # (``RoundCosts``). It covers what the calibration cannot see: the round's own work around the
        # decode (verification, KV bookkeeping, the proposer's observe step: ~0.2 ms against a 8 ms CPU
        # step, as much as a GPU step on a small model), one-token decodes that run as CUDA graphs while
        # batches do not, and a curve measured in a bad moment (one cached SmolLM2 curve said 8 tokens
        # cost 3.5 steps where they cost 5.0: auto then drafted at a loss). Methods differ in what a round
        # costs (ouroboros harvests phrases, lookahead decodes a window), so each generation's method
        # keeps its own figures (see ``use_method``).
        self._round_costs: dict[str, RoundCosts] = {}
        # "Does drafting pay" is asked every round of every candidate; its answer is kept until what it
        # reads changes (the proposer's acceptance and classes: ``_changes``; a new request or method:
        # ``_epoch``; its drafting cost: ``_cost_key``) or REFRESH_ROUNDS rounds pass (what rounds cost
        # drifts slowly). Recomputing costs 0.1-0.2 ms in a real run (cold caches), 1-2% of a fast CPU
        # step. The counts are per proposer: with one shared count, every look at a cheap drafter
        # re-decided both of auto's candidates, 50 µs a round on SmolLM2 (a third of auto's overhead).
        # A "no" stands through news that can only lower the estimates (``_raises`` counts the rest).
        self._changes: dict[str, int] = {}
        self._raises: dict[str, int] = {}
        self._epoch = 0
        self._rounds = 0
        self._request_first_round = 0   # ``_rounds`` when the current request began
        self._pays_memo: dict[str, _PaysMemo] = {}
        self._quiet: dict[str, _QuietRounds] = {}   # rounds foreseen idle, per proposer (``_plan_quiet``)
        self._ahead = 0         # rounds foreseen idle for all of ``_ahead_sources`` at once (``skips``) ...
        self._ahead_sources: tuple[str, ...] = ()
        self._skipped = 0       # ... and those answered, not yet counted (``_count_skipped``)
        self.use_method("")
        self.max_length = max_length
        self.probe_length = probe_length
        self.acceptance: dict[str, Acceptance] = {}
        self._idle: dict[str, int] = {}
        self._probe_every: dict[str, int] = {}
        self._probing: set[str] = set()
        # drafters that are looked at, due an early look past the class backoff (``best_length``)
        self._early_looks: set[str] = set()
        # when cheap labelling drafters are looked at while their drafts do not pay (``_worth_a_look``)
        self.looks = Looks()
        self._free: set[str] = set()   # drafters that run no model (``Proposer.free_drafts``)
        self._last_draft_cost: dict[str, float] = {}
        self.confidence: dict[str, ConfidenceTable] = {}
        # Seconds per drafted token, per proposer (EMA over the engine's life: a new generation does not
        # forget what drafting costs here), and what probes of each proposer have cost so far against
        # the seconds of all rounds observed: probes stay within PROBE_BUDGET of the time, whatever
        # they turn out to cost (a draft model that skipped text must first catch up on all of it).
        # The probe budget is each method's (``use_method``): in a process that runs several methods (a
        # benchmark), the time of the others must not pay for one method's probes; and a method's
        # candidates share it (auto's prompt lookup and suffix tries would otherwise probe 2% of the time).
        self._draft_costs: dict[str, float] = {}
        # The floor of each proposer's drafting cost per token (``ceiling``): its prior (``enroll``), then
        # the least measured once RETIRE_AFTER rounds were timed; and the drafters retired, with ceilings.
        self._prior_costs: dict[str, float] = {}
        self._least_costs: dict[str, float] = {}
        self._timed_rounds: dict[str, int] = {}
        self._ceiling_memo: dict[str, tuple[tuple[float, str], int, float]] = {}
        self._told: set[str] = set()   # drafters whose retirement was logged (once per engine)
        self.retired: dict[str, float] = {}
        # Seconds per token of a draft model's catch-up (decoding a prompt, or rounds it skipped), per
        # proposer (EMA; ``catch_up_cost``). A probe of a draft that skipped a 773-token prompt spent
        # 6 s (the 0.5B draft of the 1.5B target on 2 cores), twice the whole answer's plain decoding.
        self._catch_up_costs: dict[str, float] = {}
        self._probe_spent: dict[str, float] = {}
        self._elapsed: dict[str, float] = {}
        self._request_began: dict[str, float] = {}   # each method's elapsed seconds when its request began
        # This request's record per proposer: [tokens accepted, tokens the class estimates expected] over
        # the draft nodes verification tried (``request_scale``).
        self._request: dict[str, list[float]] = {}
        # Labelled drafts not verified in full, per proposer, until the text scores them (held.py).
        self._held = HeldDrafts()

    # ---- one round: the engine's loop and method auto both schedule through these two -------------
    def draft(self, proposer: "Proposer", committed: Sequence[int], budget: int) -> TokenTree:
        """``proposer``'s draft for this round as the cost model wants it: no longer than pays (the root
        alone when nothing does; the proposer is not asked then), timed for its per-token drafting
        cost, trimmed by confidence class."""
        sources = (proposer.name,)
        if self.skips(sources):
            return TokenTree.rooted_at(committed[-1])
        tree = self.draft_if_any(proposer, committed, budget)
        if tree is None or not tree.n_candidates:
            self.foresee_quiet(sources)
        return TokenTree.rooted_at(committed[-1]) if tree is None else tree

    def draft_if_any(self, proposer: "Proposer", committed: Sequence[int], budget: int) -> TokenTree | None:
        """``draft``, or None where it would be the root alone and the proposer was not asked: ``auto``
        asks each candidate every round and keeps one draft (a tree built for nothing cost ~9 µs a
        candidate with the caches cold after a decode)."""
        name = proposer.name
        if name in self._held:
            self._score_held(name, committed)
        if self._quiet_round(name, budget):
            return None
        if self.hopeless(name):
            # its ceiling is re-priced every REFRESH_ROUNDS rounds (``ceiling``), per method and request:
            # idle until then (the 0.5B draft, retired on an H200, was checked every round of auto)
            self._quiet[name] = _QuietRounds(REFRESH_ROUNDS - 1, self._epoch, self._raises.get(name, 0),
                                             looks=False, held=False, retired=True)
            return None
        k = self.best_length(name, self.draft_cost(name), limit=budget)
        early = k <= 0 and name in self._early_looks
        self._early_looks.discard(name)
        look = k <= 0 and (early or self._worth_a_look(name))
        if look:
            t_look = time.perf_counter()
            peeked = proposer.first_class(committed)
            peek_catch_up = proposer.catch_up_seconds
            if peeked == "" or not (early or self._look_promising(name, peeked)):
                self.looks.dry(name, time.perf_counter() - t_look - peek_catch_up, early)
                self._plan_quiet(name, budget)   # idle until the next look: else the next round asks again
                return None
            k = min(budget, self.max_length)
        if k <= 0:
            self._plan_quiet(name, budget)
            return None
        behind = proposer.catch_up_tokens(committed)
        if behind >= CATCH_UP_MIN and not self.catch_up_pays(name, behind):
            return None
        t0 = time.perf_counter()
        tree = checked_tree(proposer, proposer.propose(committed, k))
        self.note_draft(name, time.perf_counter() - t0, tree.n_candidates,
                        catch_up=proposer.catch_up_seconds, catch_up_tokens=behind)
        if tree.n_candidates:
            drafted, tree = tree, self.trim(name, tree)
            self._held.hold(name, drafted, len(committed), probe=early)
        self.looks.proposed(name, kept=bool(tree.n_candidates))
        if look:   # what one more look costs: the catch-up on the rounds since the last is owed anyway
            seconds = time.perf_counter() - t_look - peek_catch_up - proposer.catch_up_seconds
            if tree.n_candidates or not early:   # an early look that kept nothing leaves the looks' record
                self.looks.outcome(name, peeked, kept=bool(tree.n_candidates))
            if tree.n_candidates:
                self.looks.kept(name, seconds)
            else:
                self.looks.dry(name, seconds, early)
                self._plan_quiet(name, budget)
        return tree

    def _look_promising(self, source: str, peeked: str | None) -> bool:
        """``Looks.promising``; a look it stops still counts its class in the mix of first classes
        (``ConfidenceTable.note_first``): left out, the hopeless classes would be missing from it and
        the mix would promise more than drafting delivers."""
        if self.looks.promising(source, peeked):
            return True
        if peeked:
            self._note_first(source, peeked)
        return False

    def _score_held(self, source: str, committed: Sequence[int]) -> None:
        """Learn from the held drafts of ``source`` (``held.py``) that the text written since scores."""
        for draft, decided in self._held.score(source, committed, self.probe_length):
            if decided:
                self._learn_held(source, draft)
            else:
                self._learn_probe(source, draft)

    def _learn_held(self, source: str, draft: HeldDraft) -> None:
        """The nodes of a decided ``draft`` that verification did not try, as if it had: all of them, or
        those after the verified ones where those were all accepted."""
        done = max(draft.verified, 0)
        if draft.matched < done or done >= len(draft.tokens):
            return
        if draft.verified < 0:
            self.estimate(source).update(len(draft.tokens), draft.matched)
        self._learn_chain(source, draft.classes[done:], draft.matched - done, depth=done)

    def _learn_probe(self, source: str, draft: HeldDraft) -> None:
        """An early look's held draft matched the text for a probe's length: learned now, as if a probe
        had verified those nodes and accepted them all (its other nodes wait for the text, as after a
        verified probe), so that a copy found early drafts from the next round on."""
        k = self.probe_length
        self.estimate(source).update(k, k)
        self._learn_chain(source, draft.classes[:k], k)

    def _worth_a_look(self, source: str) -> bool:
        """May a labelling drafter whose draft does not pay on the mix of classes seen so far be asked
        anyway, for ``trim`` to judge the classes it actually drafts? A cheap one (``_looks_at``) when a
        look is due (looks.py)."""
        return self._looks_at(source) and self.looks.due(source, self.costs.cost(1))

    def _looks_at(self, source: str) -> bool:
        """Is ``source`` a drafter ``_worth_a_look`` may ask while drafting does not pay: one that runs no
        model (``Proposer.free_drafts``), or one timed and cheap (any other is asked on its prior or
        probed)? A probe still pending (its proposal found nothing, or ``auto`` verified another
        candidate's draft) does not bar it: the look's draft is verified as that probe. Barred, the suffix
        tries, whose one probe in the README's request found nothing, were not asked again in the request.

        A free drafter is looked at whatever its proposals were timed at: a copy's proposal costs about
        the same however few tokens it finds, and with the caches cold after a decode (0.1-0.3 ms against
        SmolLM2's 7 ms step) even the least per-token figure measured could stay above the bar where the
        early proposals were short: in such runs the suffix tries proposed 0-1 times a request, and a
        repeated set of code edits ran 1.06x where the runs that looked at them reached 1.4-1.6x. What
        looks cost is held to LOOK_SHARE by ``Looks.every`` whatever they cost. A draft model costs 100
        times more per token at best: it is looked at only while measured cheap."""
        if source not in self.confidence:
            return False
        if source in self._free:
            return True
        return bool(self._timed_rounds.get(source)) and self._cheap(self._least_costs[source], self.max_length)

    def _plan_quiet(self, source: str, budget: int) -> None:
        """After an idle round of ``source``: the rounds after it that will be idle too, whatever
        happens, so that ``draft`` answers them at once (``_quiet_round``).

        "Does drafting pay" is memoised (``_drafting_pays``); until its answer may change (what it reads
        of ``source`` changes, a new request or method, a refresh is due, a budget cut short) and until
        the next probe or look is due, ``draft`` would only count idle rounds: on a 1-2 ms GPU step of
        a small model the checks that find this are a share of the step worth saving (in real runs on
        SmolLM2, with the caches cold after each decode, 23 µs a round for auto's two candidates)."""
        memo = self._pays_memo.get(source)
        if memo is None or memo.pays:
            return
        rounds = REFRESH_ROUNDS - (self._rounds - memo.rounds)
        held = False
        if self._periodic_probes(source):
            every, idle = self._probe_every.get(source, PROBE_EVERY), self._idle.get(source, 0)
            held = idle >= every  # a probe is due but the probe budget holds it back: watched each round
            if not held:
                rounds = min(rounds, every - idle)
        looks = self._looks_at(source)
        if looks:
            rounds = min(rounds, self.looks.rounds_to_next(source, self.costs.cost(1)))
        if rounds > 1:
            self._quiet[source] = _QuietRounds(rounds - 1, self._epoch, self._raises.get(source, 0), looks, held)

    def _quiet_round(self, source: str, budget: int) -> bool:
        """Is this one of the idle rounds ``_plan_quiet`` foresaw (and nothing it relied on changed)? Then
        count it as ``best_length`` and ``_worth_a_look`` would have."""
        quiet = self._quiet.get(source)
        if quiet is None:
            return False
        if quiet.left <= 0 or not self._quiet_stands(source, quiet) or (quiet.held and self._probe_affordable()):
            del self._quiet[source]
            return False
        self._count_quiet(source, quiet, 1)
        return True

    def _quiet_stands(self, source: str, quiet: _QuietRounds) -> bool:
        """Is what ``_plan_quiet`` relied on unchanged: the request and method, and no news that could
        make drafting pay?"""
        return quiet.epoch == self._epoch and quiet.raises == self._raises.get(source, 0)

    def _count_quiet(self, source: str, quiet: _QuietRounds, rounds: int) -> None:
        """``rounds`` foreseen idle rounds of ``source`` went by: count them as ``best_length`` and
        ``_worth_a_look`` would have."""
        quiet.left -= rounds
        if not quiet.retired:
            self._idle[source] += rounds
        if quiet.looks:
            self.looks.count_idle(source, rounds)

    def skips(self, sources: tuple[str, ...]) -> bool:
        """Is this a round ``draft_if_any`` would answer at once with None for each of ``sources``, as
        foreseen after the last (``foresee_quiet``)? It is counted as those calls would have (in bulk,
        ``_count_skipped``) and none is made: ~7 µs a candidate a round saved on the stub's idle rounds,
        caches cold (``scripts/round_overhead.py --idle --cold``)."""
        if self._ahead and sources == self._ahead_sources:
            self._ahead -= 1
            self._skipped += 1
            return True
        self._end_skipping()
        return False

    def foresee_quiet(self, sources: tuple[str, ...]) -> None:
        """Every one of ``sources`` found nothing this round: the rounds after it that ``_quiet_round``
        will answer for all of them whatever the text, as none holds a draft the text will score (its
        learning could end the stretch) or waits on the probe budget."""
        rounds = -1
        for source in sources:
            quiet = self._quiet.get(source)
            if quiet is None or quiet.held or source in self._held or not self._quiet_stands(source, quiet):
                return
            rounds = quiet.left if rounds < 0 else min(rounds, quiet.left)
        self._ahead, self._ahead_sources = max(rounds, 0), sources

    def _end_skipping(self) -> None:
        self._count_skipped()
        self._ahead = 0

    def _count_skipped(self) -> None:
        """The rounds ``skips`` answered so far, counted as ``_quiet_round`` would have."""
        if not self._skipped:
            return
        for source in self._ahead_sources:
            self._count_quiet(source, self._quiet[source], self._skipped)
        self._skipped = 0

    def enroll(self, proposer: "Proposer") -> None:
        """This scheduler prices ``proposer``'s drafts from now on (by class, if it labels its nodes)."""
        if proposer.confidence_classes:
            self.labels(proposer.name)
        if proposer.free_drafts:
            self._free.add(proposer.name)
        floor = proposer.draft_cost_floor(self.draft_costs) if self.draft_costs is not None else None
        if floor is not None:
            self._prior_costs[proposer.name] = floor

    def begin_request(self) -> None:
        """A new generation starts: what the last one's drafts did no longer corrects the estimates."""
        self._end_skipping()
        self._request.clear()
        self._held.clear()
        self._request_began[self._method] = self._elapsed.get(self._method, 0.0)
        self._request_first_round = self._rounds
        self.looks.begin_request(self.confidence)   # every labelling drafter is looked at in its first round
        self.round_costs.begin_request()   # this method's: what another method's requests measured is apart
        self._epoch += 1

    def learn(self, source: str, tree: TokenTree, accepted: int, path: Sequence[int] | None = None) -> None:
        """Verification accepted ``accepted`` tokens of ``source``'s ``tree``: the nodes ``path`` after
        the root (needed to learn the classes of a branching tree; a chain's path is its first nodes)."""
        self.update(source, tree.max_depth, accepted)
        self.update_classes(source, tree, accepted, path)
        self._held.verified(source, tree)

    def estimate(self, source: str) -> Acceptance:
        return self.acceptance.setdefault(source, Acceptance())

    # ---- what the text taught, kept across processes (learned.py) --------------------------------
    def estimates(self) -> dict[str, dict]:
        """Per proposer, its acceptance and confidence-class counts, JSON-ready (``restore_estimates``).
        Only what the text taught: what rounds and drafts cost is this machine's state of the moment."""
        out: dict[str, dict] = {}
        for source, acc in self.acceptance.items():
            table = self.confidence.get(source)
            out[source] = {"acceptance": acc.to_dict(), "classes": table.to_dict() if table else None}
        return out

    def restore_estimates(self, saved: dict[str, dict], weight: float = math.inf) -> list[str]:
        """Start from estimates an earlier session learned (``estimates``), each count scaled down to at
        most ``weight`` observations' worth. A malformed entry is skipped; returns the proposers restored."""
        restored = []
        for source, entry in saved.items():
            try:
                acc = Acceptance.from_dict(entry["acceptance"], weight)
                table = ConfidenceTable.from_dict(entry["classes"], weight) if entry.get("classes") else None
            except (KeyError, TypeError, ValueError, AttributeError) as exc:
                log.debug("saved estimates of %s skipped: %s", source, exc)
                continue
            self.acceptance[str(source)] = acc
            if table is not None:
                self.confidence[str(source)] = table
            self._changed(str(source))
            restored.append(str(source))
        return restored

    # ---- drafting costs -------------------------------------------------------------------------
    def draft_cost(self, source: str) -> float:
        """Measured seconds per token ``source`` drafts (0 until it has drafted)."""
        return self._draft_costs.get(source, 0.0)

    def note_draft(self, source: str, seconds: float, n_tokens: int, catch_up: float = 0.0,
                   catch_up_tokens: int = 0) -> None:
        """``source`` spent ``seconds`` proposing ``n_tokens`` draft tokens this round, ``catch_up`` of
        them decoding ``catch_up_tokens`` tokens of text it did not draft (``Proposer.catch_up_seconds``).

        The catch-up is left out of the per-token figure (it is not what one more draft token costs) but
        counts in full against the probe budget when the round was a probe. A single slow round moves
        the per-token figure by at most 3x, so one hiccup does not brand a draft model hopeless."""
        self._add_elapsed(seconds)
        if source in self._probing:
            self._charge_probe(seconds)
        if catch_up > 0 and catch_up_tokens >= CATCH_UP_MIN:
            per_token = catch_up / catch_up_tokens
            old = self._catch_up_costs.get(source)
            self._catch_up_costs[source] = per_token if old is None else old + 0.3 * (per_token - old)
        if n_tokens <= 0:
            return
        per_token = max(seconds - catch_up, 0.0) / n_tokens
        self._timed_rounds[source] = self._timed_rounds.get(source, 0) + 1
        self._least_costs[source] = min(per_token, self._least_costs.get(source, per_token))
        old = self._draft_costs.get(source)
        self._draft_costs[source] = per_token if old is None else old + 0.2 * (min(per_token, 3 * old) - old)

    def catch_up_cost(self, source: str) -> float:
        """Seconds per token of ``source``'s catch-up: measured, else the draft's per-token cost in a
        CATCH_UP_PRIOR_BATCH-token batch (its calibrated curve; without one, the target's times
        ``draft_scale``, within 10% of the measured figure for the 0.5B draft of the 1.5B target)."""
        measured = self._catch_up_costs.get(source)
        if measured is not None:
            return measured
        if self.draft_costs is not None:
            return self.draft_costs.cost(CATCH_UP_PRIOR_BATCH) / CATCH_UP_PRIOR_BATCH
        return self.draft_scale * self.costs.cost(CATCH_UP_PRIOR_BATCH) / CATCH_UP_PRIOR_BATCH

    def catch_up_pays(self, source: str, behind: int) -> bool:
        """May ``source`` first decode the ``behind`` tokens it skipped, then draft?

        Yes when drafting's expected saving over CATCH_UP_REPAY_ROUNDS rounds covers the catch-up's
        expected seconds. Otherwise only as a probe within the probe budget, the catch-up included (a
        probe of a draft that does not pay, or a first draft on promise alone, e.g. the prior's): a draft
        that never paid must not spend seconds reading a long prompt for one two-token probe. Nor may
        such a probe cost more than PROBE_REQUEST_SHARE of the time its request has run: the budget is
        the whole run's, and the 0.5B draft's first probe in a benchmark of the 1.5B target, after five
        sets, read a 45-token prompt on an 8-token answer (0.40x on it, 0.92x on its set)."""
        seconds = behind * self.catch_up_cost(source)
        if source not in self._probing and seconds <= CATCH_UP_REPAY_ROUNDS * self._round_saving(source):
            return True
        if self._probe_affordable(seconds) and seconds <= PROBE_REQUEST_SHARE * self._request_elapsed():
            self._probing.add(source)   # charged to the probe budget (``note_draft``, ``update``)
            return True
        self._probing.discard(source)
        return False

    def ceiling(self, source: str) -> float | None:
        """The best speed-up over plain decoding ``source``'s drafts could reach if every draft token were
        accepted, at the floor of its drafting cost (module docstring); None for a free drafter
        (RETIRE_MIN_COST) and while the floor is unknown (a model drafter without a prior, not yet timed)."""
        cost = self._draft_floor(source)
        if cost is None or cost < RETIRE_MIN_COST * self.costs.cost(1):
            return None
        key = (cost, self._method)        # each method's rounds cost what they were measured to cost
        memo = self._ceiling_memo.get(source)
        if memo is None or memo[0] != key or self._rounds - memo[1] >= REFRESH_ROUNDS:
            memo = (key, self._rounds, best_case_speedup(self.round_seconds(self.max_length), cost))
            self._ceiling_memo[source] = memo
        return memo[2]

    def _draft_floor(self, source: str) -> float | None:
        if self._timed_rounds.get(source, 0) >= RETIRE_AFTER:
            return self._least_costs[source]
        return self._prior_costs.get(source)

    def hopeless(self, source: str) -> bool:
        """Is ``source`` retired: would it gain less than MIN_GAIN even if every draft token were accepted?
        (Real acceptance is lower, so such a drafter never pays; a ceiling near 1 moves with the measured
        round costs, and a bar at 1 would let it in and out.) A drafter that runs no model never is
        (RETIRE_MIN_COST): asked every round, the answer is given at once."""
        if source in self._free:
            return False
        ceiling = self.ceiling(source)
        if ceiling is None or ceiling >= MIN_GAIN:
            self.retired.pop(source, None)
            return False
        if source not in self._told:
            self._told.add(source)
            steps = (self._draft_floor(source) or 0.0) / self.round_seconds(0)[0]
            log.info("%s stays idle: a draft token costs %.2f target steps here, so drafting would reach "
                     "%.2fx of plain decoding at best, even if every draft token were accepted",
                     source, steps, ceiling)
        self.retired[source] = round(ceiling, 3)
        return True

    def _round_saving(self, source: str) -> float:
        """Seconds a drafted round of ``source`` is expected to save over plain decoding of the same
        tokens (depth model, its best length; at least MIN_GAIN's share of a step when its classes, not
        the depth model, say it pays)."""
        acc = self.estimate(source)
        rates = self.throughputs(acc, self.max_length, self.draft_cost(source))
        k = int(np.argmax(rates))
        tokens = float(acc.expected_all(self.max_length)[k])
        return max(tokens / rates[0] - tokens / rates[k], (MIN_GAIN - 1.0) / rates[0])

    def _request_elapsed(self) -> float:
        """Seconds this method's current request has run (its rounds and drafting)."""
        return self._elapsed.get(self._method, 0.0) - self._request_began.get(self._method, 0.0)

    def _add_elapsed(self, seconds: float) -> None:
        self._elapsed[self._method] = self._elapsed.get(self._method, 0.0) + seconds

    def _charge_probe(self, seconds: float) -> None:
        self._probe_spent[self._method] = self._probe_spent.get(self._method, 0.0) + seconds

    def extend_rule(self) -> "Callable[[str, Sequence[str]], bool]":
        """``ProposeSetup.extend_pays`` for proposers this scheduler runs (their measured draft cost)."""
        return lambda source, classes: self.extend_pays(source, classes, self.draft_cost(source))

    def round_seconds(self, limit: int) -> np.ndarray:
        """Seconds a round verifying k = 0..limit draft tokens costs: the calibrated decode c(k + 1)
        times what rounds of that size were measured to cost against it (read-only; ``RoundCosts``)."""
        return self.round_costs.seconds_array(self.costs, limit)[:limit + 1]

    def _round_seconds_list(self, limit: int) -> list[float]:
        """``round_seconds`` as plain floats (for the per-round arithmetic on a chain's few nodes)."""
        return self.round_costs.seconds(self.costs, limit)[:limit + 1]

    def throughputs(self, acc: Acceptance, limit: int, draft_cost: float) -> np.ndarray:
        """Expected tokens per second of drafting k = 0..limit tokens."""
        seconds = self.round_seconds(limit) + draft_cost * np.arange(limit + 1)
        return acc.expected_all(limit) / seconds

    # ---- confidence classes ---------------------------------------------------------------------
    def request_scale(self, source: str) -> float:
        """How this request's drafts from ``source`` fare against the class estimates: (accepted +
        REQUEST_PRIOR) / (expected + REQUEST_PRIOR), within REQUEST_SCALE; the estimates are scaled by it
        (``_scaled_alpha``: below 1 in proportion, above 1 in odds).

        The class estimates are learned over every request, so they are right on average; one text may
        differ (a summary that paraphrases where most copy: copies of 3-grams accepted 40% of the time
        where the table says 85%). The table's decay takes ~30 failed drafts to notice, each a loss on a
        CPU; the request's own record, pooled over its classes, notices in a few."""
        record = self._request.get(source)
        if record is None:
            return 1.0
        low, high = REQUEST_SCALE
        return min(max((record[0] + REQUEST_PRIOR) / (record[1] + REQUEST_PRIOR), low), high)

    def _corrected(self, source: str, q: np.ndarray) -> np.ndarray:
        """Class estimates ``q`` of ``source``'s drafts, scaled by this request's record."""
        scale = self.request_scale(source)
        return q if scale == 1.0 else np.array([_scaled_alpha(float(v), scale) for v in q])

    def _alphas(self, source: str, table: ConfidenceTable, classes: Sequence[str], base: np.ndarray,
                explore: bool = True) -> np.ndarray:
        """The class estimates of ``classes`` (``ConfidenceTable.alphas``), corrected for this request."""
        return self._corrected(source, table.alphas(classes, base, explore))

    def _chain_expected(self, source: str, classes: Sequence[str], explore: bool = True) -> list[float]:
        """Expected tokens of keeping 0..len(classes) nodes of a chain labelled ``classes``. Plain floats:
        asked for every draft ``trim`` judges, where numpy's per-call cost on a few numbers, with the
        caches cold after a decode, made a trim cost ~0.15 ms in real runs on SmolLM2."""
        table = self.confidence.setdefault(source, ConfidenceTable())
        scale = self.request_scale(source)
        expected, reach, total = [1.0], 1.0, 1.0
        for cls, base in zip(classes, self.estimate(source).depth_list(len(classes))):
            reach *= _scaled_alpha(table.alpha(cls, base, explore), scale)
            total += reach
            expected.append(total)
        return expected

    def trim(self, source: str, tree: TokenTree) -> TokenTree:
        """Cut a labelled chain to the depth with the best expected tokens per second (its drafting
        cost is spent already). A probe keeps a short draft so that classes keep being measured.

        Sampled drafts (nodes with a draft distribution) are never trimmed: keeping node i because of
        what was drafted after it would bias token i away from q, which rejection sampling assumes.
        Deterministic drafts are verified by sample-and-match, where any cut is lossless."""
        first = tree.classes.get(1) if tree.n_candidates else None
        if first is not None:
            self._note_first(source, first)
        if not tree.classes or tree.extras or tree.draft_probs:
            return tree
        if not tree.is_chain():
            return self._trim_branches(source, tree)
        classes = tree.node_classes()
        seconds = self._round_seconds_list(len(classes))
        k = _best_beyond_margin([e / s for e, s in zip(self._chain_expected(source, classes, explore=False),
                                                       seconds)])
        return tree.truncated(self._kept_at_least(source, first, len(classes), k))

    def _note_first(self, source: str, first: str) -> None:
        """A draft of ``source`` starts with a node of class ``first`` (the mix ``_classes_pay`` reads)."""
        table = self.confidence.setdefault(source, ConfidenceTable())
        if first not in table.first:   # a new class in the mix; its slow drift waits for a refresh
            self._changed(source)      # (REFRESH_ROUNDS), or drafting would be re-decided every round
        table.note_first(first)

    def _kept_at_least(self, source: str, first: str | None, n: int, k: int, scored: bool = True) -> int:
        """``trim``'s cut ``k`` of ``n`` nodes, raised to a probe's ``probe_length`` for a probe; and a
        draft whose cut nodes the text cannot score (``scored``: a chain can, held.py) cut below that,
        whose first class was tried fewer than MEASURE_TRIALS times, becomes a probe where the probe
        budget allows.

        A class verified once or twice has an estimate that is mostly luck, and once it says "no" its
        drafts are cut to nothing and never verified again. Seen in real runs: suffix's long matches
        ("sx m3 f2 d1", accepted ~90% of the time where measured) came first in 15 drafts of a set and
        were verified twice, one accepted; at 0.5 every later draft was cut, and the repeated requests
        that followed went undrafted (733 target passes where ~300 were the rule). A periodic probe
        verifies whatever comes next; this one verifies what the table knows least."""
        if (not scored and k < self.probe_length and first is not None and source not in self._probing
                and self.confidence[source].trials.get(first, 0.0) < MEASURE_TRIALS
                and self._probe_affordable()):
            self._probing.add(source)   # charged and backed off as any probe (``update``)
        if source in self._probing:
            k = max(k, min(self.probe_length, n))
        return k

    def _trim_branches(self, source: str, tree: TokenTree) -> TokenTree:
        """``trim`` for a branching tree: keep the nodes likeliest to be accepted, as many as pays.

        A node is accepted with the chance that its parent was, times its class's acceptance (siblings
        exclude each other, so their chances are scaled to sum to at most one). Keeping the k likeliest
        nodes keeps their parents too (a child is never likelier than its parent) and yields 1 + the sum
        of their chances per round; the k with the best rate for the cost of verifying them wins."""
        n = tree.n_candidates
        parents = tree.parents
        depth_base = self.estimate(source).depth_alphas(tree.max_depth)
        classes = tree.node_classes()
        q = self._alphas(source, self.confidence[source], classes, depth_base[np.asarray(tree.depths[1:]) - 1])
        sibling_sum: dict[int, float] = {}
        for i in range(1, n + 1):
            sibling_sum[parents[i]] = sibling_sum.get(parents[i], 0.0) + q[i - 1]
        reach = [1.0] * (n + 1)
        for i in range(1, n + 1):
            reach[i] = reach[parents[i]] * q[i - 1] / max(1.0, sibling_sum[parents[i]])
        order = sorted(range(1, n + 1), key=lambda i: (-reach[i], i))
        expected = 1.0 + np.concatenate(([0.0], np.cumsum([reach[i] for i in order])))
        k = _best_beyond_margin((expected / self.round_seconds(n)).tolist())
        k = self._kept_at_least(source, tree.classes.get(1), n, k, scored=False)
        return tree if k == n else tree.subtree(sorted([0, *order[:k]]))

    def _probe_affordable(self, seconds: float = 0.0) -> bool:
        """Do this method's probes so far leave room for ``seconds`` more (``_probe_allowance``)?"""
        return self._probe_spent.get(self._method, 0.0) + seconds <= self._probe_allowance()

    def _probe_allowance(self) -> float:
        """What probes may cost so far: PROBE_BUDGET of the time, plus one probe's verification so that
        the first probe can run."""
        return PROBE_BUDGET * self._elapsed.get(self._method, 0.0) + self.costs.cost(self.probe_length + 1)

    def chain_rate(self, source: str, tree: TokenTree) -> float:
        """Expected tokens per second of verifying ``tree`` (a labelled chain; else the depth model)."""
        return self.chain_tokens(source, tree) / self._round_seconds_list(tree.n_candidates)[-1]

    def chain_tokens(self, source: str, tree: TokenTree) -> float:
        """Expected tokens a round verifying ``tree`` writes (a labelled chain; else the depth model)."""
        if tree.classes and tree.is_chain():
            return self._chain_expected(source, tree.node_classes())[-1]
        return float(self.estimate(source).expected_all(tree.n_candidates)[-1])

    def best_rate(self, source: str, draft_cost: float, limit: int) -> float:
        """Expected tokens per second of ``source``'s best draft length (depth model, cost included);
        0 for a retired drafter."""
        if self.hopeless(source):
            return 0.0
        limit = min(limit, self.max_length)
        return float(np.max(self.throughputs(self.estimate(source), limit, draft_cost)))

    def extend_pays(self, source: str, classes: Sequence[str], draft_cost: float) -> bool:
        """Could one more draft token (at the best class's acceptance) beat the best cut so far?"""
        n = len(classes)
        if n >= self.max_length:
            return False
        if not n:
            return True
        table = self.confidence.setdefault(source, ConfidenceTable())
        expected = self._chain_expected(source, classes, explore=draft_cost <= 0)
        seconds = self._round_seconds_list(n + 1)
        best_now = max(e / s for e, s in zip(expected, seconds))
        reach = expected[n] - expected[n - 1]   # chance that all n drafted tokens are accepted
        q_next = _scaled_alpha(table.best_alpha(self.estimate(source).depth_list(n + 1)[n]),
                               self.request_scale(source))
        return (expected[-1] + reach * q_next) / (seconds[n + 1] + draft_cost) > best_now

    def _classes_pay(self, source: str, table: ConfidenceTable, draft_cost: float, limit: int) -> bool:
        """Does starting a draft pay, over the mix of first-token classes seen so far? For each first
        class: the best cut of a chain that starts with it (deeper nodes at the depth estimates),
        paying at least one draft step; compared with plain decoding's rate.

        The chains share their tail: one whose first node is right with chance q yields 1 + q * reach[k]
        tokens at length k (reach[k] = 1 + a1 + a1 a2 + ..., k terms, a_i the depth estimates), so its
        best k is where the line (1 + q reach[k]) / cost[k] is highest, and one upper envelope of those
        lines serves every class (``_upper_envelope``). Plain floats: a table of classes x lengths in
        numpy cost ~0.13 ms a call in real runs (caches cold after a decode), asked after most looks."""
        total = sum(table.first.values())
        acc = self.estimate(source)
        if total <= 0:   # nothing drafted yet: the prior decides (a GPU drafts at once, a CPU probes)
            return _best_beyond_margin(self.throughputs(acc, limit, draft_cost).tolist()) > 0
        scale = self.request_scale(source)
        base = acc.depth_list(limit)
        seconds = self._round_seconds_list(limit)
        cost = [s + draft_cost * (k or 1) for k, s in enumerate(seconds)]
        reach, run, prod = [0.0], 0.0, 1.0
        for k in range(1, limit + 1):
            run += prod
            reach.append(run)
            if k < limit:
                prod *= _scaled_alpha(base[k], scale)
        starts, lengths = _upper_envelope([1.0 / c for c in cost], [r / c for r, c in zip(reach, cost)])
        explore = draft_cost <= 0
        tokens = time = 0.0
        for cls, weight in table.first.items():
            q = _scaled_alpha(table.alpha(cls, base[0], explore), scale)
            k = lengths[bisect_right(starts, q) - 1]
            tokens += weight * (1.0 + q * reach[k])
            time += weight * cost[k]
        # a free draft (prompt lookup) needs no margin to start: ``trim`` applies it to each chain
        margin = MIN_GAIN if draft_cost > 0 else 1.0 - 1e-9
        return tokens / time >= margin / seconds[0]

    def _drafting_pays(self, source: str, table: ConfidenceTable, draft_cost: float, limit: int) -> bool:
        """``_classes_pay``, kept while its inputs stand (see ``_pays_memo``). A budget cut short (an
        answer's last tokens) is priced at the power of two below it: a key per budget would recompute
        (~0.1 ms) in every one of those rounds.

        A "no" stands for a shorter budget and through news that can only lower the estimates (a draft
        whose first node was rejected: ``_changed``): on text with nothing to copy, every look's draft
        was such news, and recomputing after each cost auto ~70 µs a round on SmolLM2 (caches cold)."""
        if limit < self.max_length:
            limit = 1 << (limit.bit_length() - 1)
        key = (self._cost_key(draft_cost, limit), self._epoch)
        memo = self._pays_memo.get(source)
        if memo is not None and memo.key == key and self._rounds - memo.rounds < REFRESH_ROUNDS:
            if memo.pays and memo.limit == limit and memo.changes == self._changes.get(source, 0):
                return True
            if not memo.pays and limit <= memo.limit and memo.raises == self._raises.get(source, 0):
                return False
        pays = self._classes_pay(source, table, draft_cost, limit)
        self._pays_memo[source] = _PaysMemo(key, limit, self._rounds, self._changes.get(source, 0),
                                            self._raises.get(source, 0), pays)
        return pays

    def _cost_key(self, draft_cost: float, limit: int) -> tuple[str, int]:
        """The drafting cost as ``_drafting_pays`` keys it: not measured yet; cheap (a full draft costs
        under LOOK_COST of a step: lost in the noise of the round's own cost, and a free drafter's
        per-token figure swings several-fold between rounds); else in 10% steps."""
        if draft_cost <= 0:
            return ("unmeasured", 0)
        if self._cheap(draft_cost, limit):
            return ("cheap", 0)
        return ("steps", round(math.log(draft_cost / self.costs.cost(1)) / math.log(1.1)))

    def _cheap(self, draft_cost: float, tokens: int) -> bool:
        """Does drafting ``tokens`` tokens at ``draft_cost`` each cost under LOOK_COST of a target step?"""
        return draft_cost * tokens < LOOK_COST * self.costs.cost(1)

    def _changed(self, source: str, raises: bool = True) -> None:
        """What ``_drafting_pays`` reads of ``source`` changed; ``raises``: some estimate may have gone up
        (news of a rejected first node only lowers them, up to the estimates' slow decay towards their
        priors, which REFRESH_ROUNDS covers)."""
        self._changes[source] = self._changes.get(source, 0) + 1
        if raises:
            self._raises[source] = self._raises.get(source, 0) + 1

    def labels(self, source: str) -> None:
        """``source`` labels its drafts with confidence classes: schedule it by class from now on."""
        self.confidence.setdefault(source, ConfidenceTable())

    def update_classes(self, source: str, tree: TokenTree, accepted: int,
                       path: Sequence[int] | None = None) -> None:
        """Learn from a verified labelled tree: a chain whose first ``accepted`` nodes were accepted, or
        a branching tree whose accepted nodes are ``path`` (every child of an accepted node was tried)."""
        if not tree.classes or not tree.n_candidates:
            return
        if tree.is_chain():
            self._learn_chain(source, tree.node_classes(), accepted)
            return
        if path is None:
            return
        table = self.confidence.setdefault(source, ConfidenceTable())
        on_path = set(path)
        tried_nodes = [i for i in range(1, len(tree.tokens)) if tree.parents[i] in on_path]
        self._note_request_branches(source, tree, table, tried_nodes, on_path)
        table.update_tried([(tree.classes.get(i, ""), i in on_path) for i in tried_nodes])
        self._changed(source, raises=len(on_path) > 1)

    def _learn_chain(self, source: str, classes: Sequence[str], accepted: int, depth: int = 0) -> None:
        """A chain labelled ``classes``, starting at draft depth ``depth``, had its first ``accepted``
        nodes accepted."""
        table = self.confidence.setdefault(source, ConfidenceTable())
        tried = classes[:accepted + 1]
        base = self.estimate(source).depth_list(depth + len(tried))[depth:]
        self._note_request(source, accepted, sum(table.alpha(c, b, explore=False) for c, b in zip(tried, base)))
        table.update(classes, accepted)
        self._changed(source, raises=accepted > 0)

    def _note_request(self, source: str, accepted: float, expected: float) -> None:
        record = self._request.setdefault(source, [0.0, 0.0])
        record[0] += accepted
        record[1] += expected

    def _note_request_branches(self, source: str, tree: TokenTree, table: ConfidenceTable,
                               tried: list[int], on_path: set[int]) -> None:
        """``_note_request`` for a branching tree: siblings exclude each other, so each tried family
        expects at most one accepted token."""
        if not tried:
            return
        base = self.estimate(source).depth_alphas(tree.max_depth)
        q = table.alphas([tree.classes.get(i, "") for i in tried],
                         base[np.asarray([tree.depths[i] for i in tried]) - 1], explore=False)
        families: dict[int, float] = {}
        for i, qi in zip(tried, q):
            families[tree.parents[i]] = families.get(tree.parents[i], 0.0) + float(qi)
        accepted = sum(1 for i in tried if i in on_path)
        self._note_request(source, accepted, sum(min(1.0, e) for e in families.values()))

    def use_method(self, method: str) -> None:
        """Rounds observed from now on are the given method's (the engine calls this per generation)."""
        self._end_skipping()
        self._method = method
        self.round_costs = self._round_costs.setdefault(method, RoundCosts())
        self._epoch += 1

    def observe_round(self, n_tokens: int, seconds: float) -> None:
        """Learn what a verification round of ``n_tokens`` (root included) cost against c(n)."""
        self._add_elapsed(seconds)
        self._rounds += 1
        self.round_costs.observe(n_tokens, seconds, self.costs.cost(n_tokens))

    def best_length(self, source: str, draft_cost: float = 0.0, limit: int | None = None) -> int:
        """The draft length with the best expected tokens per second (0 = plain decoding)."""
        limit = self.max_length if limit is None else min(limit, self.max_length)
        self._last_draft_cost[source] = draft_cost
        table = self.confidence.get(source)
        if table is not None and limit > 0:
            # a labelling proposer drafts up to the limit and is trimmed (``trim``, ``extend_pays``)
            best = limit if self._drafting_pays(source, table, draft_cost, limit) else 0
        else:
            best = _best_beyond_margin(self.throughputs(self.estimate(source), limit, draft_cost).tolist())
        if best > 0:
            self._idle[source] = 0
            return best
        # nothing pays: probe now and then, less often after each failed probe, and never more often
        # than keeps probes (their drafting, including a draft model's catch-up on the text it skipped,
        # and their extra verification) within PROBE_BUDGET of the time
        idle = self._idle.get(source, 0) + 1
        self._idle[source] = idle
        every = self._probe_every.get(source, PROBE_EVERY)
        if idle >= every and limit > 0 and self._periodic_probes(source):
            if self._looks_at(source):
                # early in a request (``_periodic_probes``), a drafter that is looked at is probed by a
                # look past its classes' backoff: the text scores its held draft (``_learn_probe``) at no
                # verification cost; what a look costs (``Looks.seconds``) is charged to the probe budget
                look = self.looks.seconds(source)
                if self._probe_affordable(look):
                    self._idle[source] = 0
                    self._early_looks.add(source)
                    self._charge_probe(look)
            elif self._probe_affordable():
                self._idle[source] = 0
                self._probing.add(source)
                return min(self.probe_length, limit)
        return 0

    def _periodic_probes(self, source: str) -> bool:
        """Is ``source`` probed now and then while nothing pays? A drafter that is looked at
        (``_looks_at``) only in its request's first EARLY_PROBE_ROUNDS rounds. After those, every few
        rounds a look proposes, ``trim`` judges the classes it drafted and the text scores what was cut
        (held.py), so a probe only verified two tokens the estimates said would not pay: on SmolLM2 (a
        2-token round costs 2.3-2.5 steps here) a probe accepted on gsm8k made drafting look worth it
        and the drafts that followed lost (auto 0.970x / 0.989x of plain decoding on gsm8k / mt_bench
        with such probes throughout, 1.006x / 0.995x without). Early on they stay: from estimates learned
        on text that did not copy, a request that copies is found only by a probe of what the estimates
        would cut (the README's request drafted nothing without them: 0.97x against 1.05-1.07x). For a
        drafter that is looked at, that probe is a look past its classes' backoff whose draft the text
        scores (``best_length``, ``_learn_probe``): verified, early probes cost ~11 steps a set of 16
        gsm8k or mt_bench answers on SmolLM2, most of the drafting's loss there."""
        return not self._looks_at(source) or self._rounds - self._request_first_round < EARLY_PROBE_ROUNDS

    def gain(self, source: str, draft_cost: float = 0.0) -> float:
        """Best expected speed-up over plain decoding for this proposer right now."""
        scores = self.throughputs(self.estimate(source), self.max_length, draft_cost)
        return float(scores.max() / scores[0])

    def update(self, source: str, drafted: int, accepted: int) -> None:
        if drafted <= 0:
            return
        self.estimate(source).update(drafted, accepted)
        self._changed(source, raises=accepted > 0)
        if source in self._probing:
            # its extra verification counts against the probe budget (its drafting did in note_draft)
            seconds = self.round_seconds(drafted)
            self._charge_probe(float(seconds[drafted] - seconds[0]))
            # a probe "succeeds" only if drafting now pays at the updated estimate; one that merely
            # accepted something (while drafting still loses) backs off like a failed one
            self._probing.discard(source)
            every = self._probe_every.get(source, PROBE_EVERY)
            cost = self._last_draft_cost.get(source, 0.0)
            table = self.confidence.get(source)
            if table is not None:
                pays = self._classes_pay(source, table, cost, self.max_length)
            else:
                pays = self.gain(source, cost) >= MIN_GAIN
            self._probe_every[source] = PROBE_EVERY if pays else min(every * 2, PROBE_EVERY_MAX)


def best_case_speedup(round_seconds: np.ndarray, draft_cost: float) -> float:
    """The best speed-up over plain decoding of drafting k = 1..n tokens if every one were accepted, where
    verifying k draft tokens takes ``round_seconds[k]`` and drafting one ``draft_cost`` seconds: the
    ceiling of any drafter."""
    k = np.arange(len(round_seconds))
    rates = (k + 1) / (round_seconds + draft_cost * k)
    return float(rates[1:].max() / rates[0])


def draft_ceiling(target: CostModel, draft: CostModel, max_length: int = 16, tokens_per_step: float = 1.0) -> float:
    """``best_case_speedup`` of a draft model drafting one step per ``tokens_per_step`` target tokens (a
    draft of another vocabulary: its text's tokens, at most), on these calibrated curves (``doctor``)."""
    return best_case_speedup(target.table(max_length + 1), draft.cost(1) / tokens_per_step)


def _upper_envelope(a: Sequence[float], b: Sequence[float]) -> tuple[list[float], list[int]]:
    """The upper envelope of the lines a[k] + q b[k] over 0 <= q < 1: where each line that is highest
    somewhere starts to be (ascending), and its k. Each step moves to the steeper line that overtakes the
    current one first, so it ends after at most len(a) steps."""
    k = max(range(len(a)), key=lambda i: (a[i], b[i]))   # highest just above q = 0
    starts, lengths = [0.0], [k]
    while True:
        best, cross = -1, math.inf
        for j in range(len(a)):
            if b[j] > b[k]:
                q = (a[k] - a[j]) / (b[j] - b[k])
                if q < cross or (q == cross and b[j] > b[best]):
                    best, cross = j, q
        if best < 0 or cross >= 1.0:
            return starts, lengths
        k = best
        starts.append(max(cross, starts[-1]))
        lengths.append(k)


def _best_beyond_margin(rates: Sequence[float]) -> int:
    """The index k of the best of ``rates`` (expected tokens per second of drafting 0, 1, ... tokens), or 0
    (plain decoding) unless it beats plain decoding by 1 + (MIN_GAIN - 1) / k: the margin is for short
    drafts, whose small promised gain the noise in their estimates can turn into a loss. Plain floats
    (callers with an array pass ``tolist()``): ``trim`` asks it for every draft it judges."""
    k = max(range(len(rates)), key=rates.__getitem__)
    return k if k and rates[k] >= (1.0 + (MIN_GAIN - 1.0) / k) * rates[0] else 0


def _scaled_alpha(q: float, scale: float) -> float:
    """A class estimate ``q`` scaled by a request's record (``Scheduler.request_scale``), below certainty:
    a request whose drafts fall short lowers it in proportion (a text unlike the rest stops drafting
    soon); one whose drafts do better raises its odds. Multiplied, 0.8 became certain at 1.25: a request
    whose short copies did a little better than their low estimates had its long, sure-looking chains
    verified at 7-11 tokens, and the text rejected them (a 3% loss on SmolLM2's gsm8k answers). In odds,
    0.8 becomes 0.83 and 0.3 becomes 0.35."""
    if scale == 1.0:
        return q
    if scale < 1.0:
        return min(q * scale, MAX_ALPHA)
    odds = q / max(1.0 - q, 1e-12) * scale
    return min(odds / (1.0 + odds), MAX_ALPHA)
