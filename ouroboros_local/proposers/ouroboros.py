"""Ouroboros: draft-model speculative decoding that drafts phrase by phrase (docs/design.md#ouroboros).

One round (``propose``):

1. **Phrase-level drafting.** Each draft forward is ONE batch on the draft context: the committed tokens
   the draft KV lacks, the current token ``u``, a Jacobi lookahead window (W columns, N-1 levels) and the
   pool phrases keyed by ``u`` (G at most), all in one ``TokenTree`` (window and phrases are branches
   below ``u``; shared prefixes merge). The draft then walks the tree greedily from ``u``: every node
   whose token is the draft's own argmax after its parent is accepted, so one forward commits 1 + h
   tokens (h phrase/window tokens, plus the draft's token after the last of them: the full-match bonus
   that the reference code drops). The window yields W new phrases per forward and shifts by one
   column (LADE's ALWAYS_FWD_ONE); it lives across rounds. Drafting stops at ``gamma`` tokens or an EOG
   token; a forward's overshoot beyond gamma is kept (both: docs/design.md#full-match-bonus-and-overshoot).
2. **Long drafts.** The ``topk`` most recent pool phrases for the last draft token hang below the draft
   as branches; the target verifies trunk + branches in one decode (engine).
3. **Phrases from verification.** ``observe`` feeds the target's argmax over rejected tails and tried
   branches into the pool (``pool.harvest_verification``, strategy ``harvest``), and the n-grams of the
   committed text (``pool_from_prompt``).
4. **History.** The pool lives in the engine's ``History.phrase_pool`` across requests; option ``pool``
   names a file that is loaded at creation (refused for another tokenizer) and saved after every
   generation.

Draft, window and pool are greedy and deterministic (tree nodes carry no draft distribution), so the
verifier's sample-and-match keeps the target's distribution exactly in sampling mode, and seeded runs
are reproducible. Without a draft model ``create`` returns scheduled prompt lookup over the pool (the
target-only lookahead proposer with fixed hyperparameters).

Draft batch geometry, with ``u`` at depth 0 below the uncached chain: level 0 is the chain
``u -> a0[1] -> .. -> a0[W-1]``; column i hangs ``a1[i] -> .. -> a_{N-2}[i]`` below its level-0 node
(``u`` for column 0), so ``a_l[i]`` sits at depth i + l and reads exactly its column trajectory. One
sequence id per leaf (``tree.layout``): each column end and each phrase end.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from .. import options as opt
from ..drafting import JacobiWindow, cut_at_eog, hang_phrases
from ..errors import MethodOptionError, ParameterError
from ..kv import common_prefix
from ..pool import PhrasePool, harvest_strategy, harvest_verification
from ..tree import TokenTree, check_layout, layout
from . import suffix
from .base import CatchUp, DraftingContext, ProposeSetup, Proposer
from .lookahead import LookaheadProposer, check_window_fits_target
from .pick import AutoProposer
from .prompt_lookup import PromptLookupProposer

if TYPE_CHECKING:  # pragma: no cover
    from ..calibration import CostModel
    from ..kv import KVCache
    from ..verify import VerifyResult

OPTIONS: tuple[opt.Option, ...] = (
    opt.GAMMA.with_default(4), opt.WINDOW, opt.LEVEL, opt.GUESS_SET, opt.TOPK, opt.HARVEST,
    opt.POOL, opt.POOL_FROM_PROMPT, opt.OVERSHOOT, opt.SEED, opt.MAP_SPECIALS, opt.ADAPTIVE)


class OuroborosProposer(Proposer):
    name = "ouroboros"

    def __init__(self, kv: "KVCache", pool: PhrasePool, n_target_vocab: int, *, gamma: int = 4,
                 window: int = 4, level: int = 3, guess_set: int = 4, topk: int = 2,
                 harvest: str | None = "predicted-tail", pool_from_prompt: bool = True,
                 overshoot: bool = True, seed: int = 0, check: bool = False):
        for name, value, low in (("gamma", gamma, 1), ("guess_set", guess_set, 0), ("topk", topk, 0),
                                 ("window", window, 0), ("level", level, 3)):
            if value < low:
                raise ParameterError(f"ouroboros {name} must be >= {low} (got {value})")
        self.kv = kv
        self.pool = pool
        self.n_target_vocab = n_target_vocab
        self.gamma = gamma
        self.window = JacobiWindow(window, level)
        self.G = guess_set
        self.topk = topk
        self.harvest = harvest_strategy(harvest)
        self.pool_from_prompt = pool_from_prompt
        self.overshoot = overshoot
        self.seed = seed
        self._check = check            # tests: assert the draft KV invariant after every round
        ctx = kv.ctx
        if self.window.W > ctx.n_seq_max:
            asked = ctx.params.n_ctx   # llama.cpp cuts the batch to it, and the sequences to the batch
            cut_by_context = 0 < asked < min(ctx.params.n_batch, window) and ctx.params.n_seq_max >= window
            remedy = (f"raise the draft's context (draft_n_ctx={asked}), which llama.cpp cuts its batch to"
                      if cut_by_context else "raise --seqs and --batch-size")
            raise MethodOptionError(f"ouroboros window W={window} needs {window} sequence ids; the draft "
                                    f"context has {ctx.n_seq_max} (at most its batch of {ctx.n_batch} tokens): "
                                    f"lower the window, or {remedy}")
        if self.window.n_nodes + 1 > ctx.n_batch:
            raise MethodOptionError(f"ouroboros window W={window}, N={level} needs {self.window.n_nodes + 1} "
                                    f"batch tokens; the batch holds {ctx.n_batch}")
        self._fed = 0
        self._catch_up = CatchUp()
        self._stats: dict[str, Any] = {}

    # ---- lifecycle --------------------------------------------------------------------------------
    def begin(self, prompt: Sequence[int], setup: ProposeSetup) -> None:
        super().begin(prompt, setup)
        self.window.reset(prompt, self.seed)
        # an earlier call's text this one continues (a chat's earlier turns) is in the pool already
        self._fed = self.pool.fed_before(prompt, self.window.N) if self.pool_from_prompt else 0
        self._feed(prompt)
        # No draft prefill here: the first draft catches up (``CatchUp``), so a scheduled Ouroboros that
        # never drafts costs no prefill (the 0.5B draft's added 45% to the 1.5B target's on 2 cores).
        # Cells of an earlier generation beyond the shared prefix go now, which keeps the
        # invariant ``observe`` relies on: the draft KV is a prefix of the committed text.
        self.kv.truncate(common_prefix(self.kv.cached, prompt[:-1]))
        self._catch_up.start()
        self._stats = {"rounds": 0, "draft_forwards": 0, "draft_tokens": 0, "draft_phrase_tokens": 0,
                       "draft_window_tokens": 0, "window_phrases": 0, "suffix_nodes": 0,
                       "suffix_accepted": 0, "verify_phrases": 0}

    def _checking(self) -> bool:
        return self._check

    def _feed(self, committed: Sequence[int]) -> None:
        if self.pool_from_prompt:
            self.pool.add_ngrams(committed, self.window.N, start=self._fed)
            self._fed = len(committed)

    # ---- drafting ---------------------------------------------------------------------------------
    def draft_cost_floor(self, draft_costs: "CostModel") -> float | None:
        """A draft forward decodes at least u and the window, and commits at most one token more than
        the deepest window or phrase node below u."""
        win = self.window
        deepest = max(win.depth, win.K + 1 if self.G else 0)
        return draft_costs.cost(1 + win.n_nodes) / (1 + deepest)

    def catch_up_tokens(self, committed: Sequence[int]) -> int:
        return max(0, len(committed) - 1 - self.kv.n_past)

    def propose(self, committed: Sequence[int], budget: int) -> TokenTree:
        tree = TokenTree.rooted_at(committed[-1])
        self.catch_up_seconds = 0.0
        budget = min(budget, self.setup.max_tree_nodes)
        if budget <= 0:
            return tree
        eog = self.setup.eog_tokens
        # the text of the rounds it skipped (the prompt, in a generation's first draft)
        self.catch_up_seconds = self._catch_up.before_draft(lambda: self.kv.feed(committed[self.kv.n_past:-1]))
        d = self.draft_tokens(committed, budget)
        node = 0
        for tok in d:
            node = tree.add(node, tok, source="draft")
        # Long draft: the most recent pool phrases for the last draft token, as parallel branches.
        if d and d[-1] not in eog and self.topk:
            kl = self.pool.key_len
            ctx = d[-kl:] if len(d) >= kl else list(committed[len(committed) - (kl - len(d)):]) + d
            phrases = ((cut_at_eog(p, eog), "pool")
                       for p in self.pool.lookup(ctx, k=self.topk, max_len=self.window.K))
            self._stats["suffix_nodes"] += hang_phrases(tree, node, phrases, budget, self.setup.max_branches)
        return tree

    def draft_tokens(self, committed: Sequence[int], budget: int) -> list[int]:
        """Phrase-level drafting: up to ``gamma`` (plus a forward's overshoot) tokens after committed."""
        self._stats["rounds"] += 1
        if self.kv.n_past >= len(committed):   # observe() keeps it shorter; be safe if it was skipped
            self.kv.truncate(len(committed) - 1)
        eog = self.setup.eog_tokens
        limit = min(self.gamma, budget)
        d: list[int] = []
        while len(d) < limit:
            new = self._draft_forward(committed, d)
            if not new:
                break
            stop = next((i for i, t in enumerate(new) if t in eog), None)
            if stop is not None:
                d.extend(new[:stop + 1])
                break
            d.extend(new)
        if not self.overshoot:
            del d[limit:]
        del d[budget:]
        return d

    def _draft_forward(self, committed: Sequence[int], d: list[int]) -> list[int]:
        """One draft decode at the end of ``committed + d``; returns the 1 + h tokens it commits."""
        kv = self.kv
        ctx = kv.ctx
        n_past = kv.n_past
        n_com = len(committed)
        chain = list(committed[n_past:]) + d if n_past <= n_com else d[n_past - n_com:]
        win = self.window
        if len(chain) + win.n_nodes >= ctx.n_batch:
            kv.feed(chain[:-1])            # a long uncached run (rare): feed it in chunks first
            chain = chain[-1:]
            n_past = kv.n_past
        depth_room = ctx.n_ctx - n_past - len(chain)   # offsets below u that still fit the context
        if depth_room < 1:
            return []
        # every node takes a cell: a window deeper than the room, or wider, is left out near the end (a
        # decode that could not fit raised, and drafting stopped for the rest of the answer)
        use_window = win.W > 0 and win.depth < depth_room and win.n_nodes <= depth_room
        tree = TokenTree.rooted_at(chain[0])
        node = 0
        for tok in chain[1:]:
            node = tree.add(node, tok)
        u_node = node
        last_nodes: list[int] = []
        if use_window:
            cells = win.cells.tolist()
            lvl0 = [u_node]
            for i in range(1, win.W):
                lvl0.append(tree.add(lvl0[-1], cells[0][i], source="window"))
            for i in range(win.W):
                p = lvl0[i]
                for lev in range(1, win.N - 1):
                    p = tree.add(p, cells[lev][i], source="window")
                last_nodes.append(p)
        if self.G:
            max_len = min(self.window.K + 1, depth_room - 1)
            eog = self.setup.eog_tokens
            phrases = ((cut_at_eog(p[:max_len], eog), "pool")
                       for p in self.pool.lookup(self._key_context(chain, committed, d), k=self.G,
                                                 max_len=self.window.K))
            hang_phrases(tree, u_node, phrases, min(ctx.n_batch, ctx.n_ctx - n_past) - 1, ctx.n_seq_max)
        lay = layout(tree)
        if self._checking():
            check_layout(lay)
        for i in range(u_node):          # the uncached chain needs no logits
            lay.logits[i] = False
        rows = kv.decode_layout(lay)
        if rows.shape[1] > self.n_target_vocab:
            rows = rows[:, :self.n_target_vocab]   # tokens the target lacks can never be accepted
        # the draft's argmax after a node, read in place and only where asked: along the walk and at the
        # window's last level (every row's was 16 vocabulary-sized passes a forward, most never read)
        preds: dict[int, int] = {}

        def pred(node: int) -> int:
            if node not in preds:
                preds[node] = int(rows[node - u_node].argmax())
            return preds[node]

        # Greedy walk from u through window and phrase nodes.
        path: list[int] = []
        node = u_node
        while True:
            y = pred(node)
            nxt = tree.child_with_token(node, y)
            if nxt is None:
                break
            path.append(nxt)
            node = nxt
        toks = tree.tokens
        accepted = [toks[i] for i in path]
        winner = min(lay.seq_ids[node]) if lay.n_seqs > 1 else 0
        kv.commit_tree(chain[0], chain[1:] + accepted, winner, lay.n_seqs)
        if self._checking():
            kv.check()
        st = self._stats
        st["draft_forwards"] += 1
        st["draft_tokens"] += len(accepted) + 1
        for i in path:
            if tree.sources.get(i) == "pool":
                st["draft_phrase_tokens"] += 1
            else:
                st["draft_window_tokens"] += 1
        if use_window:
            new = np.array([pred(n) for n in last_nodes], dtype=np.int64)
            if win.ready:
                st["window_phrases"] += self._harvest_window(chain, committed, d, new)
            win.shift(new)
        return accepted + [y]

    def _key_context(self, chain: list[int], committed: Sequence[int], d: list[int]) -> list[int]:
        """The pool key's context for ``u`` = ``chain[-1]``: the last ``key_len`` tokens up to it."""
        kl = self.pool.key_len
        return chain[-kl:] if len(chain) >= kl else (list(committed) + d)[-kl:]

    def _harvest_window(self, chain: list[int], committed: Sequence[int], d: list[int],
                        new: np.ndarray) -> int:
        return self.window.harvest(self.pool, self._key_context(chain, committed, d), new)

    # ---- learning from the target ------------------------------------------------------------------
    def observe(self, committed: Sequence[int], result: "VerifyResult") -> None:
        kv = self.kv
        prev = len(committed) - len(result.tokens)     # committed length when the tree was proposed
        start = min(kv.n_past, prev)                   # the draft KV is a prefix of the old committed + d
        keep = common_prefix(kv.cached, committed, start)   # no slices: O(new tokens), not O(context)
        kv.truncate(min(keep, len(committed) - 1))
        self._catch_up.observed()
        if self._checking():
            kv.check()
        self._stats["suffix_accepted"] += result.accepted_by_source.get("pool", 0)
        if self.harvest != "none" and result.tree.n_candidates:
            root = prev - 1
            kl = self.pool.key_len
            ctx = committed[max(0, root - kl + 1):root] if kl > 1 else ()
            self._stats["verify_phrases"] += harvest_verification(
                self.pool, result.tree, result.predictions, result.path, self.harvest, context=ctx)
        self._feed(committed)

    def stats(self) -> dict[str, Any]:
        out = {"ouro_" + k: v for k, v in self._stats.items()}
        out["ouro_pool_size"] = len(self.pool)
        out["ouro_pool_keys"] = self.pool.n_keys
        return out


class _Fallback(Proposer):
    """Ouroboros without a draft model: a target-only proposer under the same name, saying so in stats."""

    name = "ouroboros"

    def __init__(self, inner: Proposer, kind: str, pool: PhrasePool | None):
        self.inner = inner
        # the scheduler reads these flags from the proposer the engine runs
        self.adaptive = inner.adaptive
        self.confidence_classes = inner.confidence_classes
        self.kind = kind
        self.pool = pool

    def begin(self, prompt: Sequence[int], setup: ProposeSetup) -> None:
        super().begin(prompt, setup)
        self.inner.begin(prompt, setup)

    def propose(self, committed: Sequence[int], budget: int) -> TokenTree:
        return self.inner.propose(committed, budget)

    def observe(self, committed: Sequence[int], result: "VerifyResult") -> None:
        self.inner.observe(committed, result)

    def end(self) -> None:
        self.inner.end()

    def stats(self) -> dict[str, Any]:
        out = dict(self.inner.stats())
        out["ouroboros_fallback"] = self.kind
        if self.pool is not None:
            out["ouro_pool_size"] = len(self.pool)
        return out


def create(ctx: DraftingContext, options: dict[str, Any]) -> Proposer:
    """``options``: checked by ``proposers.create_method`` against ``OPTIONS`` (defaults filled in)."""
    if ctx.draft is None:
        return _fallback(ctx, options)
    level, guess, topk = options["level"], options["guess_set"], options["topk"]
    pool = _history_pool(ctx, options)
    return scheduled(ctx, OuroborosProposer(
        ctx.draft_kv(), pool, ctx.target.n_vocab, gamma=options["gamma"], window=options["window"],
        level=level, guess_set=guess, topk=topk, harvest=options["harvest"],
        pool_from_prompt=options["pool_from_prompt"], overshoot=options["overshoot"], seed=options["seed"],
        check=ctx.check_kv), pool, options)


def scheduled(ctx: DraftingContext, drafter: Proposer, pool: PhrasePool, options: dict[str, Any]) -> Proposer:
    """Ouroboros under the cost model (the default; ``EngineConfig.adaptive``).

    Each round the scheduler picks, as method ``auto`` does, between free drafts and the draft model:
    first phrases copied from the context and from the Ouroboros pool (which holds the prompt's
    n-grams, the phrases harvested from verification and the history of earlier requests), trimmed by
    their confidence classes; else the draft model's phrase-level draft plus pool branches when its
    measured acceptance pays for its drafting and verification cost; else a plain step. On a GPU the
    draft model pays nearly always; on a small CPU mostly the free phrases do, and Ouroboros never falls
    far below plain decoding. With ``adaptive`` off (engine-wide, or the method option), the fixed
    hyperparameters run every round.
    """
    if not ctx.adaptive:
        return drafter
    phrases = PromptLookupProposer(gamma=max(options["gamma"], 8), pool=pool, feed_pool=False, history=ctx.history)
    return AutoProposer(ctx.scheduler(), [_earlier_answers(ctx, options), phrases, drafter], name="ouroboros")


def _earlier_answers(ctx: DraftingContext, options: dict[str, Any]) -> Proposer:
    """The suffix tries of this request and earlier answers (``auto``'s), asked before the pool's phrases:
    those are ``level - 1`` tokens long, and with them alone (or first, in hand whenever the tries would
    have drafted) a question asked again drafted next to nothing (62 of 64 plain steps, SmolLM2; 7 with
    the tries first, ``auto`` 5)."""
    return suffix.earlier_answers(ctx, options["pool"])


def _history_pool(ctx: DraftingContext, options: dict[str, Any]) -> PhrasePool:
    return ctx.history.pool(options["level"] - 1, max(options["guess_set"], options["topk"], 1), options["pool"])


def _fallback(ctx: DraftingContext, options: dict[str, Any]) -> Proposer:
    """Without a draft model: phrases from the context and the pool, scheduled like prompt lookup
    (the lookahead window runs only with fixed hyperparameters: on a CPU it costs more than it saves)."""
    window = 0 if ctx.adaptive else options["window"]
    if window:   # checked before a history file is named
        check_window_fits_target(ctx, window, options["level"])
    pool = _history_pool(ctx, options)
    if not ctx.adaptive and not window:   # no window: the pool's and the context's phrases
        return _Fallback(PromptLookupProposer(gamma=options["gamma"], pool=pool, feed_pool=True, history=ctx.history),
                         "prompt-lookup", pool)
    if window:
        inner: Proposer = LookaheadProposer(
            window=options["window"], ngram=options["level"], guess=options["guess_set"], pool=pool,
            pool_from_prompt=options["pool_from_prompt"], harvest=options["harvest"], seed=options["seed"])
        return _Fallback(inner, "lookahead", pool)
    # priced as a prompt-lookup candidate, as with a draft model (``scheduled``): what the scheduler
    # learned of context copies under prompt lookup and auto applies here too, and the other way round
    phrases = PromptLookupProposer(gamma=max(options["gamma"], 8), pool=pool, feed_pool=True, history=ctx.history)
    return _Fallback(AutoProposer(ctx.scheduler(), [_earlier_answers(ctx, options), phrases], name="ouroboros"),
                     "prompt-lookup", pool)


__all__ = ["OPTIONS", "OuroborosProposer", "create", "scheduled"]
