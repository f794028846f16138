"""PEARL: draft and target run at the same time (Liu et al., arXiv 2408.11850; docs/design.md#pearl).

The draft model works on its own context in a background thread (``llama_decode`` releases the GIL),
so its decodes overlap with the target's verification in the engine's thread. Both PEARL phases fit
the engine's one loop (propose -> one target decode -> observe) with no extra hook:

* **post-verify** - ``propose`` returns the draft tokens still unverified (a chain) and starts a
  background job that keeps drafting ``gamma`` tokens *after* them, assuming they will all be
  accepted, while the engine verifies the chain. ``observe`` joins the job; if the target accepted
  the whole chain and its own next token (the bonus) equals the job's first token, the job's other
  tokens are the next round's chain (the draft never stalled); otherwise they are dropped and the
  draft's KV rolls back to the committed text.
* **pre-verify** - after a rejection there is nothing unverified: ``propose`` returns the root alone
  (the target decodes just the last committed token, which it must do anyway) and the background job
  drafts ``gamma`` tokens from the committed text. The target's token checks the first draft token
  (the bonus-match above); on a match the rest becomes the next post-verify chain.

The adaptive draft length of PEARL is the chaining of successful post-verify rounds; ``gamma`` (the
window) follows the measured speed ratio t_target / t_draft_step unless fixed by the ``gamma`` option.

**Sampling.** The draft is always greedy (argmax) and its tokens carry no draft distribution, so the
verifier checks them by sample-and-match: the target samples its own token from its processed
distribution at every position and a draft token survives only if it equals that sample. Every
emitted token is exactly a target sample, so the output distribution is the target's (lossless), and
since each emitted token consumes exactly one uniform of the seeded RNG, a seeded run gives the same
text as plain decoding whatever the timing-driven choices (window, mode) were (up to floating-point
differences between batch shapes). The cost: at high temperature a greedy draft matches less often
than rejection sampling of a sampled draft would accept.

**Threads.** While both run, ``n_threads_target + n_threads_draft <= cores`` (``Context.set_threads``
on both contexts; the original settings are restored at the end of the generation). Defaults: a
target fully offloaded to a GPU keeps 1 CPU thread (2 from 8 cores), the draft the rest; two CPU
models split the cores 1+1 on 2 cores, else 3/4 to the target.

**Fallback.** PEARL only pays where draft and target do not fight over the same resource (target on a
GPU, draft on the CPU, or two devices). On a CPU-only box it usually loses to sequential speculative
decoding (measured: docs/design.md#pearl). With ``mode="auto"`` (default) the proposer alternates blocks of
``probe_rounds`` rounds of PEARL and of sequential speculative decoding (greedy draft chain of
``seq_gamma`` tokens, every core to whichever model runs) until each mode has two blocks, then keeps
the faster (measured tokens/s). The measurements live in the engine's history (``History.kept``) per
model pair and thread split, so later generations reuse the decision. ``mode="parallel"`` / ``"sequential"`` force one.
With fewer than 2 cores PEARL cannot run without oversubscription and the proposer runs sequentially.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from .. import options as opt
from ..errors import MethodOptionError, ParameterError
from ..kv import KVCache, common_prefix
from ..llama.binding import supports_gpu_offload, usable_cores
from ..tree import TokenTree
from .base import DraftingContext, ProposeSetup, Proposer

if TYPE_CHECKING:  # pragma: no cover
    from ..llama import Context, Model
    from ..verify import VerifyResult

PARALLEL = "parallel"
SEQUENTIAL = "sequential"
GAMMA_MIN, GAMMA_MAX = 2, 12
NEEDS_DRAFT = True   # refused before the models load when no draft is given
OPTIONS: tuple[opt.Option, ...] = (opt.PEARL_MODE, opt.PEARL_GAMMA, *opt.PEARL_TUNING)


def on_gpu(model: "Model") -> bool:
    """True when the whole model is offloaded to an accelerator."""
    layers = getattr(model, "n_gpu_layers", 0)
    if not layers:
        return False
    try:
        if not supports_gpu_offload():
            return False
    except Exception:  # pragma: no cover - defensive
        return False
    return layers < 0 or layers >= model.n_layer


def thread_split(cores: int, target_gpu: bool, draft_gpu: bool) -> tuple[int, int] | None:
    """(n_threads_target, n_threads_draft) with a sum <= cores, or None when PEARL cannot run."""
    if cores < 2:
        return None
    if target_gpu and draft_gpu:
        nt = max(1, min(4, cores // 2))
        return nt, max(1, min(4, cores - nt))
    if target_gpu:
        nt = 1 if cores < 8 else 2
        return nt, cores - nt
    if draft_gpu:
        nd = 1 if cores < 8 else 2
        return cores - nd, nd
    nd = 1 if cores < 4 else cores // 4
    return cores - nd, nd


class _Extended(Sequence[int]):
    """``head[:n_head] + tail`` without copying ``head``: the engine's committed list, which only grows
    within a generation (so the worker thread may read it while the engine appends, and a round costs
    the tokens it adds, not the context)."""

    __slots__ = ("head", "n_head", "tail")

    def __init__(self, head: Sequence[int], n_head: int, tail: list[int]):
        self.head, self.n_head, self.tail = head, n_head, tail

    def __len__(self) -> int:
        return self.n_head + len(self.tail)

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            start, stop, step = i.indices(len(self))
            if step != 1:
                return [self[j] for j in range(start, stop, step)]
            cut = self.n_head
            return list(self.head[start:min(stop, cut)]) + self.tail[max(start - cut, 0):max(stop - cut, 0)]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        return self.head[i] if i < self.n_head else self.tail[i - self.n_head]

    def extended(self, more: list[int]) -> "_Extended":
        return _Extended(self.head, self.n_head, self.tail + more)

    def starts_with(self, committed: Sequence[int]) -> bool:
        """True when ``committed`` is a prefix of this chain; O(tokens past ``n_head``) when it is the
        grown ``head``."""
        n, cut = len(committed), self.n_head
        if n > len(self):
            return False
        if committed is self.head and n >= cut:
            return all(a == b for a, b in zip(self.tail, committed[cut:n]))
        return self[:n] == list(committed)


def _committed_only(committed: Sequence[int]) -> _Extended:
    return _Extended(committed, len(committed), [])


class _ABState:
    """Tokens/seconds per mode for one model pair + thread split (kept across generations)."""

    def __init__(self) -> None:
        self.tokens = {PARALLEL: 0, SEQUENTIAL: 0}
        self.seconds = {PARALLEL: 0.0, SEQUENTIAL: 0.0}
        self.rounds = {PARALLEL: 0, SEQUENTIAL: 0}
        self.decision: str | None = None
        self.reason = "probing"
        self.gamma: float | None = None      # learned PEARL window (EMA of t_target / t_draft)
        self.t_target: float | None = None   # EMA seconds of one post-verify target pass
        self.t_draft: float | None = None    # EMA seconds of one draft step (under concurrency)

    def rate(self, mode: str) -> float:
        s = self.seconds[mode]
        return self.tokens[mode] / s if s > 0 else 0.0


def _ema(old: float | None, new: float, w: float = 0.3) -> float:
    return new if old is None else (1.0 - w) * old + w * new


class PearlProposer(Proposer):
    name = "pearl"

    def __init__(self, kv: KVCache, target_ctx: "Context", n_vocab: int, *, mode: str = "auto",
                 gamma: int | str = "auto", seq_gamma: int = 4, probe_rounds: int = 8,
                 threads: tuple[int, int] | None, ab: _ABState, split_reason: str = ""):
        if mode not in ("auto", PARALLEL, SEQUENTIAL):
            raise ParameterError(f"mode must be auto, parallel or sequential (got {mode!r})")
        if gamma != "auto" and (not isinstance(gamma, int) or gamma < GAMMA_MIN):
            # gamma 1 would leave nothing to post-verify: every round a plain decoding step
            raise ParameterError(f"gamma must be 'auto' or an integer >= {GAMMA_MIN} (got {gamma!r})")
        if not isinstance(seq_gamma, int) or seq_gamma < 1:
            raise ParameterError(f"seq_gamma must be an integer >= 1 (got {seq_gamma!r})")
        if not isinstance(probe_rounds, int) or probe_rounds < 1:
            raise ParameterError(f"probe_rounds must be an integer >= 1 (got {probe_rounds!r})")
        self.kv = kv
        self.target_ctx = target_ctx
        self.n_vocab = n_vocab            # argmax over ids both models have
        self.mode_option = mode
        self.gamma_option = gamma
        self.seq_gamma = seq_gamma
        self.probe_rounds = probe_rounds
        self.threads = threads            # (target, draft) while running concurrently; None: impossible
        self.split_reason = split_reason
        self.ab = ab
        self._executor: ThreadPoolExecutor | None = None
        self._stop = threading.Event()
        self._future: Future | None = None
        self._prefill: Future | None = None
        self._orig_threads: dict[str, tuple[int, int]] = {}
        self._threads_applied: str | None = None
        self.chain = _committed_only([])
        self.mode = SEQUENTIAL
        self._reset_counters()

    # ---- generation lifecycle ---------------------------------------------------------------------
    def _reset_counters(self) -> None:
        self.rounds = {PARALLEL: 0, SEQUENTIAL: 0}
        self.pre_rounds = 0
        self.post_rounds = 0
        self.kept = 0
        self.dropped = 0
        self.draft_steps = 0
        self.draft_wait = 0.0
        self.block_rounds = 0
        self._tree: TokenTree | None = None
        self._t_propose = 0.0
        self._t_proposed = 0.0
        self._agreed = 0     # the draft KV holds committed[:_agreed] (see _truncate_to_chain)
        self._base = _committed_only([])   # what the background job drafts after (committed + the chain)
        self._seq_committed = 0   # committed tokens at the start of the sequence _draft syncs to

    def begin(self, prompt: Sequence[int], setup: ProposeSetup) -> None:
        super().begin(prompt, setup)
        self._reset_counters()
        self.eog = setup.eog_tokens
        self.chain = _committed_only(prompt)
        self._stop.clear()
        if self.threads is None:
            self.mode = SEQUENTIAL
        elif self.mode_option != "auto":
            self.mode = self.mode_option
        else:
            self.mode = self.ab.decision or PARALLEL
        if self.gamma_option == "auto":
            self.gamma = int(round(self.ab.gamma)) if self.ab.gamma else 4
        else:
            self.gamma = int(self.gamma_option)
        self._remember_threads()
        self._apply_threads(self.mode)
        if self.mode == PARALLEL and len(prompt) < self.kv.ctx.n_ctx:
            # The draft's prompt prefill runs in the background: it overlaps the target's first
            # step (and the target's prefill too, if the engine calls begin() before prefilling).
            # A prompt the draft's context cannot hold is never drafted after (_draft): no prefill.
            prefix = list(prompt[:-1])
            # stopped with the answer (a cancel, a closed stream): close() waited for a long prompt's read
            self._prefill = self._submit(lambda: self.kv.sync_to(prefix, stop=self._stop.is_set))

    def end(self) -> None:
        self._stop.set()
        failed = False
        for fut in (self._prefill, self._future):
            if fut is not None:
                try:
                    fut.result()
                except BaseException:
                    failed = True
        self._prefill = self._future = None
        if failed:  # a decode died half-way: the draft cache is in an unknown state
            self.kv.reset()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        self._restore_threads()
        self._stop.clear()

    def close(self) -> None:
        self.end()

    # ---- threads ----------------------------------------------------------------------------------
    @property
    def drafts_while_read(self) -> bool:   # (base.Proposer) the next round's draft is being made now
        job = self._future
        return job is not None and not job.done()

    def _submit(self, fn) -> Future:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pearl-draft")
        return self._executor.submit(fn)

    def _remember_threads(self) -> None:
        self._orig_threads = {}
        for key, ctx in (("target", self.target_ctx), ("draft", self.kv.ctx)):
            n = int(ctx.n_threads)
            nb = int(getattr(ctx.params, "n_threads_batch", None) or n)
            self._orig_threads[key] = (n, nb)
        self._threads_applied = SEQUENTIAL

    def _apply_threads(self, mode: str) -> None:
        """Split the cores while both models run at once; every core to each model otherwise."""
        if mode == self._threads_applied:
            return
        if mode == PARALLEL and self.threads is not None:
            nt, nd = self.threads
            self.target_ctx.set_threads(nt, nt)
            self.kv.ctx.set_threads(nd, nd)
        else:
            self.target_ctx.set_threads(*self._orig_threads["target"])
            self.kv.ctx.set_threads(*self._orig_threads["draft"])
        self._threads_applied = mode

    def _restore_threads(self) -> None:
        if self._orig_threads and self._threads_applied != SEQUENTIAL:
            self._apply_threads(SEQUENTIAL)

    # ---- drafting (runs in the worker thread for PEARL, inline for sequential rounds) -------------
    def _draft(self, seq: Sequence[int], n: int) -> tuple[list[int], int, float]:
        """Greedy-draft up to n tokens after ``seq`` (which starts with the committed text, of
        ``_seq_committed`` tokens); returns (tokens, decodes, seconds)."""
        t0 = time.perf_counter()
        kv = self.kv
        out: list[int] = []
        if n <= 0 or len(seq) >= kv.ctx.n_ctx:
            return out, 0, 0.0
        n_committed = self._seq_committed
        logits = kv.sync_to(seq, logits_last=True, agreed=min(self._agreed, n_committed))
        self._agreed = n_committed
        steps = 1
        nv = self.n_vocab
        eog = self.eog
        stop = self._stop
        for i in range(n):
            row = logits if len(logits) == nv else logits[:nv]
            tok = int(np.argmax(row))
            out.append(tok)
            if tok in eog or i == n - 1 or stop.is_set() or kv.n_past + 1 > kv.ctx.n_ctx:
                break
            logits = kv.feed([tok], logits_last=True)
            steps += 1
        return out, steps, time.perf_counter() - t0

    def _join(self) -> tuple[list[int], int, float]:
        """Wait for the background jobs (prefill, draft); re-raise an error after resetting the draft."""
        prefill, job = self._prefill, self._future
        self._prefill = self._future = None
        result: tuple[list[int], int, float] = ([], 0, 0.0)
        t0 = time.perf_counter()
        try:
            if prefill is not None:
                prefill.result()
            if job is not None:
                result = job.result()
        except BaseException:
            self.kv.reset()
            raise
        finally:
            self.draft_wait += time.perf_counter() - t0
        return result

    # ---- the round --------------------------------------------------------------------------------
    def _leftover(self, committed: Sequence[int]) -> list[int]:
        chain, n = self.chain, len(committed)
        if len(chain) > n and chain[n - 1] == committed[-1] and chain.starts_with(committed):
            return chain[n:]
        return []

    def propose(self, committed: Sequence[int], budget: int) -> TokenTree:
        self._t_propose = time.perf_counter()
        if self._future is not None:  # observe() was skipped: drop the stale job
            self._join()
        cands = self._leftover(committed)[:max(budget, 0)]
        # the engine extends its list while the worker runs: the worker reads the first n_committed
        n_committed = len(committed)
        ends = bool(cands) and cands[-1] in self.eog
        if self.mode == PARALLEL:
            # the next round's chain, drafted while this one is verified: up to a round's budget (in rounds
            # of one size a chain that filled this round left nothing for the next, which then had none)
            n_bg = 0 if ends else min(self.gamma, budget + 1)   # its first token is this round's bonus
            if n_bg > 0:
                base = self._base = _Extended(committed, n_committed, cands)
                self._seq_committed = n_committed
                self._future = self._submit(lambda: self._draft(base, n_bg))
            if cands:
                self.post_rounds += 1
            else:
                self.pre_rounds += 1
        else:
            if self._prefill is not None:
                self._join()
            n_more = 0 if ends else min(self.seq_gamma, budget) - len(cands)
            if n_more > 0:
                self._seq_committed = n_committed
                more, steps, _ = self._draft(_Extended(committed, n_committed, cands), n_more)
                self.draft_steps += steps
                cands = cands + more
        tree = TokenTree.rooted_at(committed[-1])
        node = 0
        for tok in cands:
            node = tree.add(node, tok, source="draft")
        self._tree = tree
        self._t_proposed = time.perf_counter()
        return tree

    def observe(self, committed: Sequence[int], result: "VerifyResult") -> None:
        t_observe = time.perf_counter()
        tree = self._tree
        mode = self.mode
        cont, steps, secs = self._join()
        if tree is None or result.tree is not tree:  # not our round (a wrapper proposed it)
            self.chain = _committed_only(committed)
            self._truncate_to_chain(len(committed))
            self._tree = None
            return
        self.draft_steps += steps
        # the job drafted after the whole chain: it carries on if the target's next token was its first.
        # Tokens a round of one size wrote past that (``filled``, accepted) must agree with it too.
        chain = self._base.extended(cont)
        if (cont and len(result.accepted) == tree.n_candidates and result.bonus == cont[0]
                and len(chain) > len(committed) and chain.starts_with(committed)):
            self.chain = chain
            self.kept += 1
        else:
            self.chain = _committed_only(committed)
            if cont:
                self.dropped += 1
        self._truncate_to_chain(len(committed))
        self._tree = None
        now = time.perf_counter()
        ab = self.ab
        ab.tokens[mode] += len(result.tokens)
        ab.seconds[mode] += now - self._t_propose
        ab.rounds[mode] += 1
        self.rounds[mode] += 1
        if mode == PARALLEL and steps and tree.n_candidates:
            # window ~ t_target / t_draft (docs/design.md#pearl): both sides then take the same wall time
            ab.t_target = _ema(ab.t_target, t_observe - self._t_proposed)
            ab.t_draft = _ema(ab.t_draft, secs / steps)
            if self.gamma_option == "auto" and ab.t_draft > 0:
                ratio = ab.t_target / ab.t_draft
                ab.gamma = min(max(ratio, GAMMA_MIN), GAMMA_MAX)
                self.gamma = int(round(ab.gamma))
        self._schedule()

    def _truncate_to_chain(self, n_committed: int) -> None:
        """Drop the draft's cells past its agreement with the chain. Watermark: the draft KV holds
        committed[:_agreed] (committed only grows, and the chain starts with it)."""
        keep = common_prefix(self.kv.cached, self.chain, self._agreed)
        self.kv.truncate(keep)
        self._agreed = min(keep, n_committed)

    def _schedule(self) -> None:
        """Alternate PEARL / sequential blocks until both are measured, then keep the faster."""
        if self.threads is None or self.mode_option != "auto":
            return
        ab = self.ab
        if ab.decision is not None:
            return
        self.block_rounds += 1
        need = 2 * self.probe_rounds
        if ab.rounds[PARALLEL] >= need and ab.rounds[SEQUENTIAL] >= need:
            rp, rs = ab.rate(PARALLEL), ab.rate(SEQUENTIAL)
            ab.decision = PARALLEL if rp > rs * 1.02 else SEQUENTIAL
            ab.reason = f"measured {rp:.1f} tok/s parallel vs {rs:.1f} tok/s sequential"
            self._switch(ab.decision)
        elif self.block_rounds >= self.probe_rounds:
            other = SEQUENTIAL if self.mode == PARALLEL else PARALLEL
            if ab.rounds[other] < need or ab.rounds[self.mode] >= need:
                self._switch(other)

    def _switch(self, mode: str) -> None:
        self.block_rounds = 0
        if mode == self.mode:
            return
        self.mode = mode
        self._apply_threads(mode)  # no background job is running here (joined in observe)

    # ---- reporting --------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        ab = self.ab
        if self.threads is None:
            decision, reason = SEQUENTIAL, self.split_reason
        elif self.mode_option != "auto":
            decision, reason = self.mode_option, "forced by the mode option"
        else:
            decision, reason = ab.decision or "probing", ab.reason
        out: dict[str, Any] = {
            "pearl_mode": self.mode,
            "pearl_decision": decision,
            "pearl_reason": reason,
            "pearl_rounds_parallel": self.rounds[PARALLEL],
            "pearl_rounds_sequential": self.rounds[SEQUENTIAL],
            "pearl_pre_rounds": self.pre_rounds,
            "pearl_post_rounds": self.post_rounds,
            "pearl_continuations_kept": self.kept,
            "pearl_continuations_dropped": self.dropped,
            "pearl_gamma": self.gamma,
            "pearl_threads": f"{self.threads[0]}+{self.threads[1]}" if self.threads else None,
            "pearl_tok_s_parallel": round(ab.rate(PARALLEL), 2),
            "pearl_tok_s_sequential": round(ab.rate(SEQUENTIAL), 2),
            "pearl_draft_wait_s": round(self.draft_wait, 4),
            "draft_steps": self.draft_steps,
        }
        if ab.t_target is not None and ab.t_draft:
            out["pearl_t_target_ms"] = round(ab.t_target * 1e3, 2)
            out["pearl_t_draft_step_ms"] = round(ab.t_draft * 1e3, 2)
        return out


def create(ctx: DraftingContext, options: dict[str, Any]) -> Proposer:
    """``options``: checked against ``OPTIONS``."""
    opts = options
    kv = ctx.draft_kv()
    target_ctx = ctx.target_context
    gamma, seq_gamma, probe_rounds = opts["gamma"], opts["seq_gamma"], opts["probe_rounds"]

    # Thread budget. Automatic split: the cores this process may use, capped by the engine's own
    # thread setting (a user who configured 4 threads on a 16-core box keeps 12 free). Explicit
    # threads_target / threads_draft: checked against the cores this process may use.
    avail = usable_cores()
    nt, nd = opts["threads_target"], opts["threads_draft"]
    reason = ""
    if nt is not None or nd is not None:
        if nt is None:
            nt = max(1, avail - nd)
        if nd is None:
            nd = max(1, avail - nt)
        if nt < 1 or nd < 1 or nt + nd > avail:
            raise ParameterError(f"threads_target + threads_draft must be <= {avail} cores, each >= 1 "
                                 f"(got {nt} + {nd})")
        threads: tuple[int, int] | None = (nt, nd)
    else:
        cores = min(avail, max(target_ctx.n_threads, kv.ctx.n_threads))
        threads = thread_split(cores, on_gpu(ctx.target), on_gpu(ctx.draft))
        if threads is None:
            reason = (f"{cores} core(s) for this engine: running both models at once would oversubscribe "
                      "them (-t/--threads 2 or more, EngineConfig.threads; or the options threads_target and "
                      "threads_draft)")
    if threads is None and opts["mode"] == PARALLEL:   # it ran sequentially, said only in --json's stats
        raise MethodOptionError(f"pearl's parallel mode cannot run here: {reason}")

    key = ("pearl", str(getattr(ctx.target, "path", "")), str(getattr(ctx.draft, "path", "")),
           threads, gamma, seq_gamma)
    ab = ctx.history.kept(key, _ABState)
    n_vocab = min(ctx.target.n_vocab, ctx.draft.n_vocab) if ctx.draft else ctx.target.n_vocab
    return PearlProposer(kv, target_ctx, n_vocab, mode=str(opts["mode"]), gamma=gamma,
                         seq_gamma=seq_gamma, probe_rounds=probe_rounds, threads=threads, ab=ab,
                         split_reason=reason)
