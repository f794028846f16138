"""The one small interface every drafting strategy implements.

The engine's loop (engine.py) is the same for every method::

    proposer.begin(prompt_tokens, setup)
    while not done:
        tree   = proposer.propose(committed, budget)   # TokenTree rooted at committed[-1]
        result = verify(tree)                          # ONE target decode, greedy or lossless sampling
        emit(result.tokens)
        proposer.observe(committed, result)            # committed already includes result.tokens
    proposer.end()

Proposers never touch the target's KV cache (the engine owns it); draft-model proposers own their
draft context and keep it in step with ``committed`` themselves. A method's factory sees only a
``DraftingContext`` (the models, the draft context, the history state, the scheduler), never the engine.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

from ..errors import DrafterError
from ..tree import TokenTree

if TYPE_CHECKING:  # pragma: no cover
    from ..calibration import CostModel
    from ..history import History
    from ..kv import KVCache
    from ..llama import Context, Model
    from ..sampling import SamplingParams
    from ..scheduler import Scheduler
    from ..verify import VerifyResult


@dataclass(frozen=True)
class DraftingContext:
    """What a method's factory may use to build its proposer (the engine makes one per generation)."""

    target: "Model"                          # vocabulary, end-of-generation tokens, tokenizer
    target_context: "Context"                # its thread settings (PEARL splits the cores)
    draft: "Model | None"
    pair_compatible: bool | None             # False: the draft speaks another vocabulary (text bridge)
    pair_reason: str | None                  # why not, in words
    draft_kv: "Callable[[], KVCache]"        # the draft model's context: made on first call, then kept
    history: "History"                       # state kept across requests (phrase pool, suffix tries, ...)
    scheduler: "Callable[[], Scheduler]"     # the cost model's scheduler: calibrates on first call
    adaptive: bool = True                    # drafts are priced by the cost model (engine-wide setting)
    check_kv: bool = False                   # tests: proposers assert their draft KV invariants


@dataclass
class ProposeSetup:
    """What a proposer may use for one generation."""

    sampling: "SamplingParams"
    rng: np.random.Generator
    max_tree_nodes: int          # candidate nodes (root excluded) one target batch may hold
    max_branches: int            # sequence ids available for leaf paths + extra sequences
    eog_tokens: frozenset[int] = frozenset()
    # extend_pays(proposer name, classes of the tokens drafted so far) -> may one more token pay?
    # Set when a scheduler runs the proposer; draft-model proposers ask it before each draft step.
    extend_pays: Callable[[str, Sequence[str]], bool] | None = None
    # every round decodes this many tokens (``EngineConfig.round_size``; 0: each its draft's size), so a
    # draft of up to round_size - 1 tokens costs what a round without one does
    round_size: int = 0
    # the scheduler will not ask this proposer to draft (``Scheduler.hopeless``: it cannot pay here), so
    # nothing is prepared for drafts (a draft model's read of the prompt)
    retired: bool = False


class Proposer(ABC):
    """A drafting strategy. Subclasses set ``name``."""

    name: str = "base"
    # True when the proposer honours small budgets sensibly (a chain or trunk first), so the engine
    # may cap its budget by the cost model; proposers with fixed-size extras (lookahead) say False.
    adaptive: bool = False
    # True when the proposer labels its nodes with confidence classes (tree.classes) and asks
    # ``setup.extend_pays`` while drafting: the scheduler then decides per class (scheduler.py).
    confidence_classes: bool = False
    # True when a draft runs no model (copies from the context, a pool or a trie: microseconds): the
    # scheduler may look at its proposals before it has timed one (``Scheduler._looks_at``).
    free_drafts: bool = False
    # Seconds of the last propose() spent catching up on text of rounds it did not draft (a draft model's
    # decode, see ``CatchUp``; the suffix tries' appends): a scheduler keeps them out of the proposer's
    # per-token drafting cost.
    catch_up_seconds: float = 0.0
    # True when a proposal may be made while the target decodes the root alone, its first level checked
    # by that step and the rest verified next round (``EngineConfig.overlap``): no extras ride along, and
    # ``observe`` reads no predictions beyond the accepted path (a ``JoinedPredictions`` has no others).
    # Read once ``begin`` has run: a draft model's depends on the request's sampling.
    drafts_ahead: bool = False
    # True while a thread of the proposer's own drafts between rounds (PEARL in parallel): the time a
    # stream's reader takes between events is then drafting time, and the decode's clock keeps it.
    drafts_while_read: bool = False

    def begin(self, prompt: Sequence[int], setup: ProposeSetup) -> None:
        """Start a generation whose committed tokens are ``prompt``."""
        self.setup = setup

    @abstractmethod
    def propose(self, committed: Sequence[int], budget: int) -> TokenTree:
        """Return a tree rooted at ``committed[-1]`` with at most ``budget`` candidate nodes (``budget`` may be
        0: the answer's last token; ``committed`` is the engine's list, to read, not to change)."""

    def first_class(self, committed: Sequence[int]) -> str | None:
        """The confidence class the first node of a proposal after ``committed`` would have, where that is
        much cheaper to find than the proposal (a copy's match length): "" when it would draft nothing,
        None when it cannot tell without proposing. A scheduler skips looks at classes whose drafts it
        keeps cutting to nothing (``Looks.promising``)."""
        return None

    def draft_cost_floor(self, draft_costs: "CostModel") -> float | None:
        """Seconds one drafted token costs at least, from the draft model's calibrated curve: the
        scheduler's prior of this proposer's drafting cost before it has drafted (its ceiling). None
        when unknown, or when the proposer runs no model."""
        return None

    def catch_up_tokens(self, committed: Sequence[int]) -> int:
        """Tokens a draft model must decode before it can draft after ``committed`` (the prompt, or text
        of rounds it did not draft); 0 for drafters without a model. The scheduler prices them."""
        return 0

    def observe(self, committed: Sequence[int], result: "VerifyResult") -> None:
        """Learn from a verification; ``committed`` already ends with ``result.tokens``."""

    def end(self) -> None:
        """The generation is over (finished, stopped or cancelled), or its ``begin`` raised."""

    def stats(self) -> dict[str, Any]:
        """Method-specific numbers merged into the generation stats (optional)."""
        return {}


class CatchUp:
    """Did a draft model draft in the round just before this one?

    If not (a new prompt, or rounds that another proposer or plain decoding served), the text it must
    decode before drafting is a catch-up on those rounds: timed apart, so that one catch-up does not
    make every later draft token look expensive, while it still counts in full against a probe budget.
    """

    def __init__(self) -> None:
        self.start()

    def start(self) -> None:
        self.rounds = 0          # rounds observed in this generation
        self._asked_at = -2

    def observed(self) -> None:
        self.rounds += 1

    def asked(self) -> bool:
        """The proposer drafts now; True when it must first catch up on skipped rounds."""
        skipped = self._asked_at != self.rounds - 1
        self._asked_at = self.rounds
        return skipped

    def before_draft(self, catch_up: Callable[[], object]) -> float:
        """The proposer drafts now: run ``catch_up`` if it skipped rounds; its seconds (0 if not)."""
        if not self.asked():
            return 0.0
        t0 = time.perf_counter()
        catch_up()
        return time.perf_counter() - t0


class NoDraft(Proposer):
    """Vanilla decoding: the tree is the root alone, so each pass yields exactly one token."""

    name = "vanilla"
    drafts_ahead = True

    def propose(self, committed: Sequence[int], budget: int) -> TokenTree:
        return TokenTree.rooted_at(committed[-1])


def checked_tree(proposer: "Proposer", tree: object) -> TokenTree:
    """``tree``, where a drafter's ``propose`` returned one: else an error naming the drafter (a plug-in's
    None was an AttributeError deep in the loop)."""
    if not isinstance(tree, TokenTree):
        raise DrafterError(f"drafter {proposer.name!r}: propose() returned {type(tree).__name__}, not a TokenTree")
    return tree
