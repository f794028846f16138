"""Cross-vocabulary speculative decoding: any draft model for any target, through text.

When the draft's tokenizer differs from the target's, draft token ids mean nothing to the target. The
draft therefore works in its own token space on a *re-tokenized view* of the committed text, and its
guesses travel to the target as text (bytes):

1. **View** (``DraftView``). Committed target tokens are turned into bytes incrementally (one cached
   piece lookup per token; an incremental UTF-8 decoder holds back a partial character). The text is
   tokenized with the draft tokenizer, but only from the last *chunk boundary* before the new text:
   a byte offset where every pre-tokenizer of the GPT-2 family (GPT-2, Llama-3, Qwen2, SmolLM, ...)
   must split (a space after a non-space, or a non-space after ``\\n``). Tokens before such a boundary
   cannot change when text is appended, so the incremental view equals a full re-tokenization while
   costing O(new text + one chunk) per round. A SentencePiece draft of the Llama-2 family, which puts a
   space before its text, restarts at a space, tokenizing the text after it (the prefix is that space).
2. **Draft KV** is kept in step with the view by prefix reuse: the view records the lowest index it
   changed; only the draft tokens from there on are decoded again (typically the target's bonus token
   re-tokenized, and any drafted tokens the target did not take).
3. **Draft** ``gamma`` tokens greedily in the draft vocabulary.
4. **Convert** (``text_to_target``): tokenize ``anchor + draft_text`` with the TARGET tokenizer, where
   ``anchor`` is the text of the last committed target tokens (pre-tokenizer context), take the target
   tokens after the anchor, and drop the last one: it may still merge with text the draft did not write
   yet (an unstable boundary). If no target token ends exactly at the anchor's end, the draft text is
   tokenized alone. ``parse_special=False``: draft text never becomes a target control token.
5. **Verify**: the target checks the target-token chain as usual. Nodes are deterministic (no draft
   distribution), so greedy output is the target's own and sampling uses sample-and-match: the output
   distribution is exactly the target's.

Special tokens and chat templates (the rule). The target's prompt is already rendered with the target's
chat template; the draft reads the same text. A control token of the target (``<|im_start|>``, ...) is
*mapped* to the draft's control token with the same text when the draft has one, and otherwise
*rendered as its text* (``"<|im_start|>"`` as plain draft tokens). The target's BOS at position 0 is
dropped (the draft gets its own BOS when its vocabulary asks for one). In the other direction, a draft
control token ends the draft; only an end-of-generation token that both models have under the same
text (e.g. ``<|im_end|>``) is proposed, as the target's own EOG token, after the draft's text (text
before a special token is a stable tokenization boundary, so nothing is dropped then). Option
``map_specials=False`` renders every target special as text and never proposes one.

Reuse (an Ouroboros variant): ``DraftView`` (committed target tokens -> draft tokens, with the anchor
for conversion) and ``text_to_target`` live in ``text_bridge.py``, independent of the drafting
strategy; after each ``propose`` the proposer exposes ``last_draft_tokens`` / ``last_draft_text``
(draft space) and ``last_target_tokens`` (what was proposed).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from ..drafting import cut_at_eog, hang_phrases
from ..errors import IncompatiblePairError, ParameterError
from ..kv import common_prefix
from ..pool import PhrasePool, harvest_verification
from ..acceptance import probability_class
from ..text_bridge import DraftView, target_confidences, text_to_target
from ..tree import TokenTree
from .base import CatchUp, DraftingContext, ProposeSetup, Proposer
from .draft_model import ADAEDL_OPTIONS, top_probability
from .ouroboros import OuroborosProposer, scheduled

if TYPE_CHECKING:  # pragma: no cover
    from ..calibration import CostModel
    from ..kv import KVCache
    from ..llama import Model
    from ..verify import VerifyResult


# target tokens one draft token is counted as, for the drafting cost's floor before it is timed: the
# text of a draft token is rarely more than one target token in Latin text and code (1.1-1.3 from a larger
# vocabulary's draft into a smaller one's target), and the last converted token is dropped each round;
# text the target's vocabulary spells in more pieces makes more (CJK from a Qwen draft: 3-4 SmolLM2 tokens)
MAX_TARGET_PER_DRAFT = 1.5


class CrossVocabProposer(Proposer):
    """Greedy draft model with another vocabulary; its text becomes a deterministic target chain."""

    name = "speculative"
    cross_vocab = True
    adaptive = True   # a chain: the scheduler caps, stops and trims it by the cost model
    confidence_classes = True

    def __init__(self, kv: "KVCache", target: "Model", draft: "Model", gamma: int = 6,
                 map_specials: bool = True, keep_unstable: bool = False, prefill_in_begin: bool = True):
        # False: the draft reads the prompt when first asked to draft (auto, which may never ask it)
        self.prefill_in_begin = prefill_in_begin
        self.kv = kv
        self.target = target
        self.draft = draft
        self.gamma = gamma
        self.keep_unstable = keep_unstable
        self.view = DraftView(target, draft, map_specials=map_specials)
        self._kv_equal = 0     # kv.cached[:_kv_equal] == view.tokens[:_kv_equal] (known)
        self._catch_up = CatchUp()
        self.last_draft_tokens: list[int] = []
        self.last_draft_text = b""
        self.last_target_tokens: list[int] = []
        self._zero_stats()

    def _zero_stats(self) -> None:
        self.draft_steps = 0        # draft decodes
        self.draft_fed = 0          # tokens decoded by the draft (view catch-up + drafted)
        self.draft_tokens = 0       # tokens the draft wrote
        self.rounds = 0
        self.empty_rounds = 0       # rounds that proposed nothing
        self.cost_stops = 0         # drafts stopped because one more token could not pay
        self.view.retokenized_bytes = 0
        self.view.inexact_restarts = 0

    # ---- target-side conversion ------------------------------------------------------------------
    def _tokenize_target(self, text: str) -> list[int]:
        return self.target.tokenize(text, add_special=False, parse_special=False)

    def to_target(self, draft_text: bytes, closed: bool = False) -> tuple[list[int], bool]:
        """Target tokens for draft text that continues the committed text (see ``text_to_target``)."""
        if self.view.pending:
            # the committed target tokens end inside a character: no target token boundary to start at
            return [], False
        return text_to_target(self._tokenize_target, self.target.piece, self.view.anchor(), draft_text,
                              closed=closed or self.keep_unstable, adds_space=self.view.target_adds_space)

    def drafted_to_target(self, drafted: list[int], closing: int | None, budget: int) -> list[int]:
        """At most ``budget`` target tokens for the draft tokens ``drafted``, then the target EOG token
        ``closing`` (a mapped draft special that ended the draft) once their text converts completely.
        Counts the draft tokens and records the ``last_*`` attributes."""
        self.draft_tokens += len(drafted)
        text = b"".join(self.draft.piece(t) for t in drafted)
        self.last_draft_tokens, self.last_draft_text = drafted, text
        toks, complete = self.to_target(text, closed=closing is not None)
        if closing is not None and complete:
            toks.append(closing)
        toks = toks[:budget]
        self.last_target_tokens = toks
        return toks

    # ---- draft KV --------------------------------------------------------------------------------
    def _sync(self, upto: int | None = None, logits: bool = True) -> np.ndarray | None:
        """Make the draft KV hold view.tokens[:upto] (prefix reuse); logits of its last token."""
        view = self.view.tokens
        n = len(view) if upto is None else upto
        cached = self.kv.cached
        keep = min(self._kv_equal, self.view.dirty, len(cached), n)
        m = min(len(cached), n)
        while keep < m and cached[keep] == view[keep]:
            keep += 1
        if logits and keep == n:
            keep -= 1
        self.kv.truncate(keep)
        todo = view[keep:n]
        out = self.kv.feed(todo, logits_last=logits)
        if todo:
            self.draft_steps += 1
            self.draft_fed += len(todo)
        self._kv_equal = n
        self.view.dirty = len(view)
        return out

    # ---- Proposer --------------------------------------------------------------------------------
    def begin(self, prompt: Sequence[int], setup: ProposeSetup) -> None:
        super().begin(prompt, setup)
        self._zero_stats()
        self.view.reset()
        self.view.extend(prompt)
        self._kv_equal = 0
        self._catch_up.start()
        n = len(self.view.tokens)
        if self.prefill_in_begin and not setup.retired and 1 < n < self.kv.ctx.n_ctx:
            self._sync(n - 1, logits=False)   # draft prefill, counted as prefill by the engine

    def draft_cost_floor(self, draft_costs: "CostModel") -> float | None:
        """One draft decode per draft token, at most MAX_TARGET_PER_DRAFT target tokens each: without a
        floor a draft that could not pay even if always right (SmolLM2-135M's target, Qwen-0.5B's draft:
        3 target steps a token) read the prompt and drafted, at 0.52x of plain decoding."""
        return self._draft_token_floor(draft_costs) / MAX_TARGET_PER_DRAFT

    def _draft_token_floor(self, draft_costs: "CostModel") -> float:
        return draft_costs.cost(1)

    def catch_up_tokens(self, committed: Sequence[int]) -> int:
        # target tokens the view has not converted yet count one draft token each (an estimate)
        pending = max(0, len(committed) - self.view.n_target)
        return max(0, len(self.view.tokens) + pending - 1 - self.kv.n_past)

    def _start_round(self, committed: Sequence[int]) -> TokenTree:
        """Bring the view up to ``committed``; this round's tree, the root alone so far."""
        view = self.view
        if len(committed) > view.n_target:
            view.extend(committed[view.n_target:])
        self.rounds += 1
        self.last_draft_tokens, self.last_draft_text, self.last_target_tokens = [], b"", []
        return TokenTree.rooted_at(committed[-1])

    def propose(self, committed: Sequence[int], budget: int) -> TokenTree:
        view = self.view
        tree = self._start_round(committed)
        self.catch_up_seconds = 0.0
        n_view = len(view.tokens)
        n = min(self.gamma, self.kv.ctx.n_ctx - n_view - 1)
        if budget <= 0 or n <= 0 or n_view == 0 or view.pending:
            self.empty_rounds += 1
            return tree
        # the text of the rounds it skipped
        self.catch_up_seconds = self._catch_up.before_draft(
            lambda: self._sync(len(view.tokens) - 1, logits=False))
        logits = self._sync()
        drafted: list[int] = []
        confidences: list[float] = []
        classes: list[str] = []
        extend_pays = self.setup.extend_pays
        closing: int | None = None
        for i in range(n):
            tok = int(np.argmax(logits))
            special = view.draft_special(tok)
            if special is not False:
                closing = special      # None: a draft special without a target equivalent
                break
            drafted.append(tok)
            confidences.append(top_probability(logits, tok))
            classes.append(probability_class(confidences[-1]))
            if i == n - 1:
                break
            # the last target token of a draft is dropped (it could still merge with more text), so the
            # value so far is that of all draft tokens but the newest
            if extend_pays is not None and not extend_pays(self.name, classes[:-1]):
                self.cost_stops += 1
                break
            logits = self.kv.feed([tok], logits_last=True)
            self.draft_steps += 1
            self.draft_fed += 1
        toks = self.drafted_to_target(drafted, closing, budget)
        if toks:
            tree.add_path(0, toks, source="draft")
            spans = [len(self.draft.piece(t)) for t in drafted]
            for node, conf in enumerate(target_confidences(toks, self.target.piece, spans, confidences), 1):
                tree.classes[node] = probability_class(conf)
        else:
            self.empty_rounds += 1
        return tree

    def observe(self, committed: Sequence[int], result: "VerifyResult") -> None:
        # Nothing to do eagerly: the next propose() extends the view with the new committed tokens and
        # re-decodes only the draft tokens that changed.
        self._catch_up.observed()

    def stats(self) -> dict[str, Any]:
        return {"cross_vocab": True, "draft_steps": self.draft_steps, "draft_fed": self.draft_fed,
                "draft_tokens": self.draft_tokens, "cross_rounds": self.rounds,
                "cross_empty_rounds": self.empty_rounds, "cost_stops": self.cost_stops,
                "retokenized_bytes": self.view.retokenized_bytes,
                "inexact_restarts": self.view.inexact_restarts}


def refuse_ignored(options: dict[str, Any], reason: str | None) -> None:
    """Same-vocabulary draft settings this drafter would ignore, refused (options.py: an option that
    would not take effect is an error): its drafts are greedy, in full, and not cut by confidence."""
    ignored = [name for name, neutral in (("adaedl", False), ("p_min", 0.0))
               if options.get(name) not in (None, neutral)]
    ignored += [name for name in ADAEDL_OPTIONS if options.get(name) is not None]
    if options.get("greedy_draft") is False:
        ignored.append("greedy_draft")
    if ignored:
        raise IncompatiblePairError(f"{', '.join(ignored)}: not for a draft of another vocabulary ({reason}), "
                                    "whose drafts are greedy and not cut by confidence or AdaEDL", tuple(ignored))


def create(ctx: DraftingContext, options: dict[str, Any], prefill_in_begin: bool = True) -> Proposer:
    """``speculative`` for a draft of another vocabulary (``options`` checked against its OPTIONS, and the
    same-vocabulary settings it would ignore refused by ``check_pair_options``, which ``create_method``
    asks). ``prefill_in_begin=False``: the draft reads the prompt only when first asked to draft (``auto``)."""
    if ctx.draft is None:
        raise ParameterError("this method needs a draft model (-d/--draft; Engine.load(TARGET, DRAFT))")
    return CrossVocabProposer(ctx.draft_kv(), ctx.target, ctx.draft, gamma=options["gamma"] or 6,
                              map_specials=options["map_specials"], keep_unstable=options["keep_unstable"],
                              prefill_in_begin=prefill_in_begin)


class CrossVocabOuroboros(CrossVocabProposer):
    """Ouroboros across vocabularies: phrase-level drafting in the draft's vocabulary, the phrase pool
    for long drafts and verification phrases in the target's.

    ``inner`` is an ``OuroborosProposer`` over the draft context working on ``view.tokens`` (its Jacobi
    window and its own draft-vocabulary pool make one draft forward yield several tokens); its draft
    text is converted to target tokens as in ``CrossVocabProposer``; then the target-vocabulary pool's
    phrases for the last converted token hang below the draft (long drafts), and ``observe`` harvests
    the target's predictions over rejected tails into that pool.

    Scheduled by the cost model with one acceptance estimate (its trunk + phrase branches are no chain
    to trim by class): on a CPU it drafts only while its measured acceptance pays for the verification.
    """

    name = "ouroboros"
    confidence_classes = False

    def __init__(self, kv: "KVCache", target: "Model", draft: "Model", inner: Proposer,
                 pool: "PhrasePool", *, gamma: int, topk: int, harvest: str, pool_from_prompt: bool,
                 phrase_len: int, map_specials: bool = True):
        super().__init__(kv, target, draft, gamma=gamma, map_specials=map_specials)
        self.inner = inner
        self.pool = pool
        self.topk = topk
        self.phrase_len = phrase_len    # of the pool's phrases it hangs (the shared pool may hold longer)
        self.harvest = harvest
        self.pool_from_prompt = pool_from_prompt
        self._fed = 0
        self.suffix_nodes = 0
        self.suffix_accepted = 0
        self.verify_phrases = 0

    def _draft_token_floor(self, draft_costs: "CostModel") -> float:
        floor = self.inner.draft_cost_floor(draft_costs)   # a window's forward yields several draft tokens
        return draft_costs.cost(1) if floor is None else floor

    def begin(self, prompt: Sequence[int], setup: ProposeSetup) -> None:
        Proposer.begin(self, prompt, setup)
        self._zero_stats()
        self.view.reset()
        self.view.extend(prompt)
        self._kv_equal = 0
        draft_setup = ProposeSetup(sampling=setup.sampling, rng=setup.rng,
                                   max_tree_nodes=setup.max_tree_nodes, max_branches=setup.max_branches,
                                   eog_tokens=self.draft.eog_tokens)
        self.inner.begin(list(self.view.tokens), draft_setup)   # window reset; no draft prefill
        self._catch_up.start()
        # an earlier call's text this one continues (a chat's earlier turns) is in the pool already
        self._fed = self.pool.fed_before(prompt, self.pool.phrase_len + 1) if self.pool_from_prompt else 0
        self._feed(prompt)
        self.suffix_nodes = self.suffix_accepted = self.verify_phrases = 0

    def _feed(self, committed: Sequence[int]) -> None:
        if self.pool_from_prompt:
            self.pool.add_ngrams(committed, self.pool.phrase_len + 1, start=self._fed)
            self._fed = len(committed)

    def propose(self, committed: Sequence[int], budget: int) -> TokenTree:
        view = self.view
        tree = self._start_round(committed)
        self.catch_up_seconds = 0.0
        tokens = view.tokens   # not copied (O(context) a round): nothing changes the view while it drafts
        if budget <= 0 or len(tokens) < 2 or view.pending or len(tokens) + 1 >= self.kv.ctx.n_ctx:
            self.empty_rounds += 1
            return tree
        # the draft KV must be a prefix of the view (re-tokenization may have changed its tail);
        # watermark: it held the view's first _kv_equal tokens, of which view.dirty are unchanged
        agreed = min(self._kv_equal, view.dirty)
        self.kv.truncate(min(common_prefix(self.kv.cached, tokens, agreed), len(tokens) - 1))
        # the text of the rounds it skipped (the prompt, in a generation's first draft)
        self.catch_up_seconds = self._catch_up.before_draft(lambda: self.kv.feed(tokens[self.kv.n_past:-1]))
        # one draft token more than the budget: the last converted token is dropped
        drafted = self.inner.draft_tokens(tokens, min(self.gamma, budget + 1))
        self._kv_equal, view.dirty = len(tokens), len(tokens)   # drafting appends after them only
        self.draft_steps = self.inner._stats.get("draft_forwards", 0)
        closing: int | None = None
        for i, tok in enumerate(drafted):
            special = view.draft_special(tok)
            if special is not False:
                closing, drafted = special, drafted[:i]
                break
        toks = self.drafted_to_target(drafted, closing, budget)
        node = tree.add_path(0, toks, source="draft") if toks else 0
        eog = self.setup.eog_tokens
        last = toks[-1] if toks else committed[-1]
        if self.topk and last not in eog:
            phrases = ((cut_at_eog(p, eog), "pool")
                       for p in self.pool.lookup([last], k=self.topk, max_len=self.phrase_len))
            self.suffix_nodes += hang_phrases(tree, node, phrases, budget, self.setup.max_branches)
        if not tree.n_candidates:
            self.empty_rounds += 1
        return tree

    def observe(self, committed: Sequence[int], result: "VerifyResult") -> None:
        self._catch_up.observed()
        self.suffix_accepted += result.accepted_by_source.get("pool", 0)
        if self.harvest != "none" and result.tree.n_candidates:
            self.verify_phrases += harvest_verification(self.pool, result.tree, result.predictions,
                                                        result.path, self.harvest, context=())
        self._feed(committed)

    def end(self) -> None:
        self.inner.end()

    def stats(self) -> dict[str, Any]:
        out = super().stats()
        inner = self.inner.stats()
        out.update({k: v for k, v in inner.items() if k.startswith("ouro_draft") or k == "ouro_window_phrases"})
        out.update({"ouro_suffix_nodes": self.suffix_nodes, "ouro_suffix_accepted": self.suffix_accepted,
                    "ouro_verify_phrases": self.verify_phrases, "ouro_pool_size": len(self.pool),
                    "ouro_draft_pool_size": len(self.inner.pool)})
        return out


def create_ouroboros(ctx: DraftingContext, options: dict[str, Any]) -> Proposer:
    """Ouroboros for a draft with another vocabulary (see ``CrossVocabOuroboros``)."""
    if ctx.draft is None:
        raise ParameterError("this method needs a draft model (-d/--draft; Engine.load(TARGET, DRAFT))")
    gamma, window, level, guess, topk = (options[k] for k in ("gamma", "window", "level", "guess_set", "topk"))
    harvest = options["harvest"]
    pool = ctx.history.pool(level - 1, max(guess, topk, 1), options["pool"])      # target vocabulary
    # the draft's own window/phrase pool (draft vocabulary), kept across requests like the target's
    draft_pool = ctx.history.kept(("ouroboros draft pool", level, guess), lambda: PhrasePool(
        key_len=1, max_per_key=max(guess, 1), phrase_len=level - 1))
    kv = ctx.draft_kv()
    inner = OuroborosProposer(kv, draft_pool, ctx.draft.n_vocab, gamma=gamma, window=window,
                              level=level, guess_set=guess, topk=0, harvest="none",
                              pool_from_prompt=options["pool_from_prompt"], overshoot=options["overshoot"],
                              seed=options["seed"], check=ctx.check_kv)
    drafter = CrossVocabOuroboros(kv, ctx.target, ctx.draft, inner, pool, gamma=gamma, topk=topk,
                                  harvest=harvest, pool_from_prompt=options["pool_from_prompt"],
                                  phrase_len=level - 1, map_specials=options["map_specials"])
    return scheduled(ctx, drafter, pool, options)


__all__ = ["CrossVocabOuroboros", "CrossVocabProposer", "create", "create_ouroboros"]
