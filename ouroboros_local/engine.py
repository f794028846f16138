"""The one decoding loop, and the public Engine API.

    engine = Engine.load("qwen2.5-coder-1.5b-instruct", draft=None)
    result = engine.generate("def fib(n):", max_tokens=64, method="prompt-lookup")
    for event in engine.stream("Hello", max_tokens=32): print(event.text, end="")

Every method runs the same loop (docs/design.md#the-loop): propose a token tree, verify it in ONE target
decode, emit the accepted tokens, let the proposer learn. Only the proposer differs.
"""

from __future__ import annotations

import atexit
import inspect
import logging
import os
import secrets
import sys
import threading
import time
import weakref
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Generator, Iterator, Mapping, Sequence, TypeVar, cast

import numpy as np

from .calibration import (CalibrationCache, CostModel, cached_or_measured, calibration_key, measure_costs,
                          measure_round)
from .cpu_load import cpu_model
from .engine_config import EngineConfig, default_flash_attn, default_round_size
# moved to engine_config.py and generation.py, and still importable from here: code outside the package
# imports them (patching them here no longer changes the defaults: engine_config's copies do)
from .engine_config import (CUDA_ROUND_SIZE, MAX_CTX, MAX_SEQS, MAX_THREADS, UNQUANTISED_CACHE,  # noqa: F401
                            has_cuda_gpu)
from .errors import (ContextOverflowError, DrafterError, MethodOptionError, OuroborosError, ParameterError,
                     PoolError, counted)
from .generation import AnswerOutput, GenerationResult, GenerationStats, StreamEvent
from .generation import PREFIX_SET_CHARS, StopMatcher  # noqa: F401  (moved; see the note above)
from .gguf_file import recurrent_refusal, validate_gguf
from .history import History
from .kv import KVCache
from .learned import PRIOR_WEIGHT, RESTORE_WEIGHT, SAVE_INTERVAL, LearnedEstimates, copy_priors, estimates_key
from .llama import Context, ContextParams, Model, supports_gpu_offload
from .llama.binding import decode_seconds as llama_decode_clock
from .options import is_integer
from .pairs import check_pair
from .proposers import Method, create_method, method_names, needs_draft
from .proposers.base import DraftingContext, ProposeSetup, Proposer, checked_tree
from .round_sizer import RoundSizer
from .sampling import SamplingParams
from .scheduler import Scheduler
from .time_split import TimeSplit
from .tree import BatchLayout, TokenTree, tree_problem
from .verify import VerifyResult, is_plain_step, joined, judged, verify_round, verify_step, walked


log = logging.getLogger("ouroboros_local")
_EngineT = TypeVar("_EngineT", bound="Engine")   # Engine.load and `with` give a subclass its own type

# ``EngineConfig.overlap`` left to None drafts during plain steps where at least this share of a step is
# spent waiting for its logits after llama_decode returned: time the draft's Python can use. A CUDA
# build on an H200 waited 0.93 of SmolLM2's step; a CPU build computes inside llama_decode (~0).
ASYNC_WAIT_SHARE = 0.5


@dataclass
class Learning:
    """What an engine learns while it generates (``Engine.swap_learning``); empty until its first use."""

    scheduler: Scheduler | None = None
    sizers: dict[str, RoundSizer] = field(default_factory=dict)


class Engine:
    """A target model (and optionally a draft model) loaded once; generations run one at a time."""

    def __repr__(self) -> str:   # which models a notebook's engines hold, and whether each is still open
        draft = f", draft={Path(str(self.draft.path)).name!r}" if self.draft is not None else ""
        return (f"<Engine target={Path(str(self.target.path)).name!r}{draft}, n_ctx={self.config.n_ctx}, "
                f"{'closed' if self._closed else 'open'}>")

    def __init__(self, target: Model, draft: Model | None = None, config: EngineConfig | None = None,
                 pair_compatible: bool | None = None, pair_reason: str | None = None):
        if not isinstance(target, Model) or not (draft is None or isinstance(draft, Model)):
            raise ParameterError("Engine(...) takes loaded models; Engine.load(target_path, draft_path) loads "
                                 "them from files")
        if not (config is None or isinstance(config, EngineConfig)):
            raise ParameterError(f"config must be an EngineConfig (got {type(config).__name__})")
        for model in (target, draft):   # its first decode aborted the process (a GGML_ASSERT)
            if model is not None and model.vocab_only:
                raise ParameterError(f"{model.path.name} was loaded with vocab_only=True: it has no weights to "
                                     "generate with (load it without)")
        self.config = config or EngineConfig()
        if self.config.round_size is None:
            self.config = replace(self.config, round_size=default_round_size(target, self.config.n_batch))
        # left to None, each model's own placement decides (a draft kept on the CPU stays exact there)
        self._draft_flash_attn = self.config.flash_attn
        if self.config.flash_attn is None:
            self._draft_flash_attn = default_flash_attn(draft, self.config.draft_type_v) if draft is not None else "off"
            self.config = replace(self.config, flash_attn=default_flash_attn(target, self.config.type_v))
        self.target = target
        self.draft = draft
        self._closed = False
        # calls into the models outside the engine's lock (``_using_models``), each with its thread
        self._users: dict[object, threading.Thread] = {}
        self._users_left = threading.Condition()
        self._closing = False   # close() waits for those calls: no new ones
        self._streams: weakref.WeakSet[Iterator[StreamEvent]] = weakref.WeakSet()   # close() ends this thread's
        if draft is not None and pair_compatible is None:
            pair_reason = check_pair(target.path, draft.path).reason
            pair_compatible = pair_reason is None
        # False: the draft speaks another vocabulary, so draft methods bridge through text
        self.pair_compatible = pair_compatible
        self.pair_reason = pair_reason
        cfg = self.config
        self.target_ctx = Context(target, ContextParams(
            n_ctx=cfg.n_ctx, n_batch=cfg.n_batch, n_seq_max=cfg.n_seq_max, n_threads=cfg.threads,
            n_threads_batch=cfg.threads_batch, flash_attn=cfg.flash_attn, type_k=cfg.type_k,
            type_v=cfg.type_v))
        self.kv = KVCache(self.target_ctx)
        self._draft_ctx: Context | None = None
        self._draft_kv: KVCache | None = None
        self._lock = threading.Lock()
        # the thread holding it (_exclusive); the object, not its ident, which a new thread may reuse
        self._lock_owner: threading.Thread | None = None
        self._planning = False   # its holder plans a generation (_plan): cost measurements take no second hold
        self._forked_busy = False   # a fork's copy of an engine another thread was using (_after_fork)
        _ENGINES.add(self)
        # state kept across requests (phrase pool, ...); its guard holds the engine weakly: a bound method
        # made a cycle, and an engine dropped without close() kept its model and KV cache (150 MB for
        # SmolLM2, 1.2 GB for the 1.5B) until a full garbage collection, which native memory never triggers
        self.history = History(target, guard=_queued_of(weakref.ref(self)))
        # dropped without close(): the answers whose save was not yet due still reach their files
        self._finalizer = weakref.finalize(self, self.history.save_pending, "an engine dropped without close()")
        self._finalizer.atexit = False   # at exit, _close_at_exit closes what is still open
        self.check_kv = False               # tests: assert the KV invariant after every round
        self._scheduler: Scheduler | None = None
        self._sizers: dict[str, RoundSizer] = {}   # per method (round_sizer.py)
        self._curves: tuple[CostModel, CostModel | None] | None = None   # the schedulers' cost curves
        self._learned_saved_at = 0.0        # when the scheduler's estimates were last saved (learned.py)
        for model in (target, draft):   # two engines may share a model: the last to close frees it
            if model is not None:       # (held once nothing above can fail: a failed engine holds none)
                model.hold()

    # ---- construction ---------------------------------------------------------------------------
    @classmethod
    def load(cls: type[_EngineT], target: str | os.PathLike[str], draft: str | os.PathLike[str] | None = None, *,
             config: EngineConfig | None = None, progress: bool = True, **overrides: Any) -> _EngineT:
        """Resolve (path, hf://, catalogue name), validate and load a target and optional draft."""
        unknown = [key for key in overrides if key not in EngineConfig.__dataclass_fields__]
        if unknown:
            raise ParameterError(f"unknown engine option {unknown[0]!r}; EngineConfig's are "
                                 f"{', '.join(EngineConfig.__dataclass_fields__)}")
        if not (config is None or isinstance(config, EngineConfig)):   # a dict: its fields go as keywords
            raise ParameterError(f"config must be an EngineConfig (got {type(config).__name__}); "
                                 "EngineConfig(**fields) or Engine.load(path, field=value, ...)")
        config = replace(config or EngineConfig(), **overrides)   # checked; the caller's config unchanged
        target_path, draft_path, compatible, reason = resolve_and_check(target, draft, progress=progress)
        mib = {path: validate_gguf(path).file_size / 2**20 for path in (target_path, draft_path) if path}
        log.info("loading %s (%.0f MiB)%s ...", target_path.name, mib[target_path],
                 f" and draft {draft_path.name} ({mib[draft_path]:.0f} MiB)" if draft_path else "")
        target_model = Model(target_path, n_gpu_layers=config.gpu_layers, main_gpu=config.main_gpu,
                             huge_pages=config.huge_pages)
        draft_model = (Model(draft_path, n_gpu_layers=config.draft_gpu_layers, main_gpu=config.main_gpu,
                             huge_pages=config.huge_pages) if draft_path else None)
        return cls(target_model, draft_model, config, pair_compatible=compatible, pair_reason=reason)

    @property
    def round_size(self) -> int:
        """Tokens every round of a drafting method decodes (``EngineConfig.round_size``; 0: its draft's)."""
        return self.config.round_size or 0

    def draft_kv(self) -> KVCache:
        """The draft model's context (created on first use, kept across generations)."""
        if self.draft is None:
            raise _needs_draft("this method")   # one whose module does not say so (NEEDS_DRAFT)
        if self._draft_kv is None:
            cfg = self.config
            self._draft_ctx = Context(self.draft, ContextParams(
                n_ctx=cfg.draft_n_ctx or cfg.n_ctx, n_batch=cfg.n_batch, n_seq_max=cfg.n_seq_max,
                n_threads=cfg.threads, n_threads_batch=cfg.threads_batch, flash_attn=self._draft_flash_attn,
                type_k=cfg.draft_type_k, type_v=cfg.draft_type_v))
            self._draft_kv = KVCache(self._draft_ctx)
        return self._draft_kv

    # ---- cost model -----------------------------------------------------------------------------
    def calibration_settings(self, draft: bool = False) -> dict[str, Any]:
        """What a cost curve of the target (or the draft) depends on besides the model file."""
        cfg = self.config
        from .llama import library_identity, system_info

        if draft and self.draft is None:
            raise ParameterError("this engine has no draft model")
        ctx = self.draft_kv().ctx if draft else self.target_ctx
        model = self.draft if draft else self.target
        # the model's own layers: an engine built on a loaded Model may hold other numbers in its config
        # on a build without GPU offload every --gpu-layers runs the same: one curve, not one per value
        layers = model.n_gpu_layers if supports_gpu_offload() else 0
        settings = {"gpu_layers": layers, "threads": ctx.n_threads,
                    "n_batch": ctx.n_batch, "flash_attn": self._draft_flash_attn if draft else cfg.flash_attn,
                    "huge_pages": model.huge_page_bytes > 0,
                    "type_k": cfg.draft_type_k if draft else cfg.type_k,
                    "type_v": cfg.draft_type_v if draft else cfg.type_v, "system": system_info(),
                    "cpu": cpu_model(), "library": library_identity()}
        # the rest only where set, so that every other curve keeps its key: one GPU of several; batches
        # (every decode of more than a token) on other threads than single steps, which the start-up
        # check times alone (a curve of 2 batch threads priced verification 2x too cheap at 1)
        if model.main_gpu is not None:
            settings["main_gpu"] = model.main_gpu
        if ctx.n_threads_batch != ctx.n_threads:
            settings["threads_batch"] = ctx.n_threads_batch
        return settings

    def cost_model(self, refresh: bool = False) -> CostModel:
        """The target's verify-cost curve: from the on-disk cache, else measured now (a few decodes)."""
        if self.config.calibration == "off":
            return CostModel.flat()
        key = calibration_key(self.target.file_id, self.calibration_settings())
        with self._exclusive():   # a cached curve is checked with a few decodes, a stale one re-measured
            curve = cached_or_measured(self.kv, key, CalibrationCache(), refresh, measure=measure_costs)
            size = min(self.round_size, self.target_ctx.n_batch)
            return curve.with_rounds_of(size, measure_round(self.kv, size)) if size > 1 else curve

    def draft_cost_model(self, refresh: bool = False) -> CostModel | None:
        """The draft model's decode-cost curve (cached like the target's); None without a draft model or
        with calibration off. The scheduler's prior of what draft steps and catch-ups cost."""
        if self.draft is None or self.config.calibration == "off":
            return None
        kv = self.draft_kv()
        key = calibration_key(self.draft.file_id, self.calibration_settings(draft=True))
        with self._exclusive():
            return cached_or_measured(kv, key, CalibrationCache(), refresh, measure=measure_costs)

    @property
    def priced_curves(self) -> tuple[CostModel, CostModel | None] | None:
        """The target's and the draft's cost curves that rounds are priced with, once ``scheduler()``
        loaded or measured them (a method that prices rounds, or rounds of one size); None before. Reading
        it measures nothing."""
        return self._curves

    def scheduler(self) -> Scheduler:
        """The cost-model scheduler (the first call loads or measures the cost curve)."""
        if self._scheduler is None:
            # the draft's own curve prices its steps and catch-ups until measured (without it: its share of
            # the target's weights)
            scale = self.draft.size_bytes / max(self.target.size_bytes, 1) if self.draft is not None else 1.0
            if self._curves is None:   # once per engine: every Learning's scheduler prices rounds alike
                self._curves = (self.cost_model(), self.draft_cost_model())
            costs, draft_costs = self._curves
            self._scheduler = Scheduler(costs, max_length=self.config.max_draft, draft_scale=scale,
                                        draft_costs=draft_costs)
            self._restore_learned(self._scheduler)
            self._learned_saved_at = time.monotonic()
        return self._scheduler

    def swap_learning(self, state: "Learning") -> "Learning":
        """Put ``state`` in place of what this engine learns as it generates (the scheduler's estimates
        and round costs, the round sizers); returns what it had. The bench gives each contender its own,
        so that no row learns from another's rounds (``auto`` from ``prompt-lookup``'s on the same prompt).
        An empty ``Learning`` starts from the saved estimates, as a new engine does, and prices rounds with
        the engine's cost curves (measured once). Estimates are saved from whichever is in place."""
        if not isinstance(state, Learning):
            raise ParameterError(f"swap_learning takes a Learning (got {type(state).__name__})")
        held = Learning(self._scheduler, self._sizers)
        self._scheduler, self._sizers = state.scheduler, state.sizers
        return held

    def _learned_key(self) -> str | None:
        if not self.config.learned:
            return None
        return estimates_key(self.target.file_id, self.draft.file_id if self.draft is not None else None)

    def _restore_learned(self, sched: Scheduler) -> None:
        """The copy priors (learned.py), then what earlier sessions learned with these models, which
        replaces them proposer by proposer."""
        sched.restore_estimates(copy_priors(), PRIOR_WEIGHT)
        key = self._learned_key()
        saved = LearnedEstimates().get(key) if key else None
        if saved:
            restored = sched.restore_estimates(saved, RESTORE_WEIGHT)
            log.debug("estimates learned in earlier sessions restored for %s", ", ".join(restored) or "nothing")

    def save_learned(self, min_interval: float = 0.0) -> None:
        """Save what the scheduler learned (``EngineConfig.learned``), unless saved less than
        ``min_interval`` seconds ago. A cache that cannot be written costs only the next start's warm-up."""
        key = self._learned_key()
        sched = self._scheduler
        if key is None or sched is None or time.monotonic() - self._learned_saved_at < min_interval:
            return
        try:
            LearnedEstimates().put(key, sched.estimates())
        except (OSError, PoolError) as exc:
            log.debug("learned estimates not saved: %s", exc)
        self._learned_saved_at = time.monotonic()

    def drafting_context(self) -> DraftingContext:
        """What a method's factory may use (proposers never see the engine itself)."""
        return DraftingContext(target=self.target, target_context=self.target_ctx, draft=self.draft,
                               pair_compatible=self.pair_compatible, pair_reason=self.pair_reason,
                               draft_kv=self.draft_kv, history=self.history, scheduler=self.scheduler,
                               adaptive=self.config.adaptive, check_kv=self.check_kv)

    @contextmanager
    def _exclusive(self) -> Iterator[None]:
        """The engine's lock. A thread that asks for it while holding it (a stream it started and has not
        read to its end or closed) gets an error, where a plain lock would wait for itself forever."""
        if self._planning and self._lock_owner is threading.current_thread():
            yield   # the first cost measurements, under the hold of the generation being planned
            return
        self._refuse_reentry()
        with self._lock:
            self._check_open()   # closed while this call waited for the lock
            self._lock_owner = threading.current_thread()
            try:
                yield
            finally:
                self._lock_owner = None

    @contextmanager
    def _queued(self) -> Iterator[None]:
        """The engine's lock for a call from outside the engine (``engine.history.clear()``): it waits for a
        generation in another thread, as ``generate`` does; nothing where this thread holds the lock."""
        if self._lock_owner is threading.current_thread():
            yield
            return
        with self._lock:
            yield

    def _refuse_reentry(self) -> None:
        self._check_open()
        if self._lock_owner is threading.current_thread():
            raise OuroborosError("this thread has a generation of this engine still open (a stream() not "
                                 "read to its end): read it to the end or close() it first")

    @contextmanager
    def _using_models(self) -> Iterator[None]:
        """A call into the models outside the engine's lock (tokenizing, the chat template: the server
        does that while another request generates). ``close`` waits for these before it frees the
        models: it freed them under a tokenizing thread, which crashed the process."""
        call = object()
        try:
            with self._users_left:
                self._check_open()
                self._users[call] = threading.current_thread()
            yield
        finally:
            # first, and outside the condition, whose enter and exit are Python code: a Ctrl-C there left a
            # count up, and close() (and the exit that runs it) waited forever
            self._users.pop(call, None)
            with self._users_left:
                self._users_left.notify_all()

    def _others_using_models(self) -> bool:
        """Calls into the models under way in other threads that are alive: a call of this thread is not
        under way while it closes (one a Ctrl-C cut short may have left its mark)."""
        me = threading.current_thread()
        return any(thread is not me and thread.is_alive() for thread in list(self._users.values()))

    def close(self) -> None:
        """Free the contexts, and the models no other engine holds. A stream this thread left open (a
        ``with`` block left mid-stream), or that a thread that has ended left open, is closed first; one
        running in another thread is waited for, as are tokenizing calls."""
        if self._closed:
            return
        if self._forked_busy:   # nothing here is in a known state (a decode's threads): the process's exit frees it
            self._closed = True
            return
        owner = self._lock_owner
        if owner is threading.current_thread() or (owner is not None and not _running(owner)):
            # this thread's open stream, or one whose reader ended without closing it: no one else will
            for stream in list(self._streams):
                if inspect.getgeneratorstate(stream) == inspect.GEN_SUSPENDED:   # the one holding the lock
                    stream.close()
        if self._lock_owner is threading.current_thread():   # a plain lock would wait for itself
            raise OuroborosError("this thread has a generation of this engine still open: close it first")
        with self._lock:   # after a generation still running in another thread: it changes the estimates
            if self._closed:   # another thread closed it while this one waited
                return
            self._lock_owner = threading.current_thread()
            try:
                if self.history.pending:   # the last answers' history, not yet due when they ended
                    self._save_history(None)
                self._finalizer.detach()
                if not self.history.pending:   # saved: its memory goes with the models' (a failed save's stays)
                    self.history.clear()
                self.save_learned()
                with self._users_left:
                    self._closing = True   # no new calls; those under way end first
                    try:
                        while self._others_using_models():   # (a missed notify costs a tenth of a second)
                            self._users_left.wait(0.1)
                    except BaseException:   # Ctrl-C: open as it was, and a later close() frees it
                        self._closing = False
                        raise
                self._closed = True   # (a second closer waits for the lock, then finds it closed)
                for ctx in (self._draft_ctx, self.target_ctx):
                    if ctx is not None:
                        ctx.close()
                for model in (self.draft, self.target):
                    if model is not None:
                        model.let_go()
            finally:
                self._lock_owner = None

    def __reduce__(self) -> Any:
        # its models and contexts live in llama.cpp's memory, in this process: "cannot pickle
        # '_thread.lock' object" said nothing of what to do
        raise OuroborosError("an Engine cannot be pickled or sent to another process: load one in each process "
                             "(Engine.load there), and send prompts and results between them")

    def __enter__(self: _EngineT) -> _EngineT:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- text helpers ---------------------------------------------------------------------------
    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True,
                 limit: int | None = None) -> list[int]:
        """``limit``: more tokens raise ContextOverflowError (with ``n_tokens``) before they are listed."""
        if not isinstance(text, str):
            raise ParameterError(f"tokenize takes a str (got {type(text).__name__})")
        _check_flags(add_special=add_special, parse_special=parse_special)
        if not (limit is None or (is_integer(limit) and limit >= 0)):
            raise ParameterError(f"limit must be None or an integer >= 0 (got {limit!r})")
        with self._using_models():
            return self.target.tokenize(text, add_special=bool(add_special), parse_special=bool(parse_special),
                                        limit=None if limit is None else int(limit))

    def detokenize(self, tokens: Sequence[int]) -> str:
        """The text of target token ids (special tokens spelled out)."""
        ids = _token_ids(tokens, "detokenize")
        with self._using_models():
            return self.target.detokenize(ids)

    def _check_open(self) -> None:
        if self._closed or self._closing:
            raise OuroborosError("this engine is closed")
        if self._forked_busy:
            raise OuroborosError("this process was forked while another thread used this engine: its state "
                                 "here is unknown; load a new engine in this process")

    def _after_fork(self) -> None:
        """In a forked child: the lock another thread held (a generation mid-round) would be waited for
        forever, the child having no such thread; the engine is refused in one line instead."""
        if self._lock.locked() and self._lock_owner is not threading.current_thread():
            self._lock = threading.Lock()
            self._forked_busy = True
        # calls under way in other threads (tokenizing) are not in the child: close() waited for them at
        # its exit forever; their condition's lock may have been held by one of them, so it is made anew
        self._users = {}
        self._users_left = threading.Condition()

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, *,
                            continue_final: bool = False, template_kwargs: dict[str, Any] | None = None) -> str:
        """The conversation in the model's chat template. ``continue_final``: the final assistant message
        continued (a prefill, ``chat.render_chat``); ``template_kwargs``: more variables for the template."""
        from .chat import render_chat

        _check_flags(add_generation_prompt=add_generation_prompt, continue_final=continue_final)
        with self._using_models():
            return render_chat(self.target, messages, add_generation_prompt=bool(add_generation_prompt),
                               continue_final=bool(continue_final), template_kwargs=template_kwargs)

    def chat_prompt(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                    **template_options: Any) -> str:
        """The rendered chat as ``tokenize(text, add_special=True)`` takes it (llama-server's tokens);
        ``template_options`` as ``apply_chat_template``'s."""
        from .chat import for_added_specials

        text = self.apply_chat_template(messages, add_generation_prompt, **template_options)
        with self._using_models():
            return for_added_specials(self.target, text)

    def chat_tokens(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                    limit: int | None = None, **template_options: Any) -> list[int]:
        """The chat's prompt tokens as llama-server makes them: one BOS where the vocabulary asks for it,
        whether the template writes it or not. ``limit`` as ``tokenize``'s; ``template_options`` as
        ``apply_chat_template``'s."""
        return self.tokenize(self.chat_prompt(messages, add_generation_prompt, **template_options),
                             add_special=True, parse_special=True, limit=limit)

    def prompt_tokens(self, prompt: str | Sequence[int] | np.ndarray, chat: bool = False) -> list[int]:
        """The prompt's tokens; ContextOverflowError where they leave no room in the context."""
        self._check_open()
        if isinstance(prompt, str):
            text = self.chat_prompt([{"role": "user", "content": prompt}]) if chat else prompt
            try:
                return self.tokenize(text, add_special=True, parse_special=True, limit=self.target_ctx.n_ctx - 1)
            except ContextOverflowError as exc:
                raise self._overflow(exc.n_tokens or 0, exc.at_least) from None
        items = _items(prompt, "the prompt", "a str or a sequence of token ids")
        if any(isinstance(m, dict) for m in items[:self.target_ctx.n_ctx]):   # (a list far too long: counted)
            raise ParameterError("the prompt is a str or token ids; a conversation (a list of messages) goes "
                                 "through engine.chat_tokens(messages), whose tokens are the prompt")
        if chat:   # it was ignored: the ids were taken as they are
            raise ParameterError("chat=True wraps a text prompt in the chat template; token ids are taken as "
                                 "they are (chat=False)")
        if len(items) >= self.target_ctx.n_ctx:   # counted before each id is checked (4M ids took 17 s)
            raise self._overflow(len(items))
        tokens = _token_ids(items, "the prompt", "a str or a sequence of token ids")
        n_vocab = self.target.n_vocab
        if tokens and not 0 <= min(tokens) <= max(tokens) < n_vocab:   # llama.cpp says only "failed to decode"
            bad = next(t for t in tokens if not 0 <= t < n_vocab)
            raise ParameterError(f"prompt token {bad} is not in the vocabulary (0..{n_vocab - 1})")
        return tokens

    def _overflow(self, n_tokens: int, at_least: bool = False) -> ContextOverflowError:
        n_ctx = self.target_ctx.n_ctx   # "256 tokens but the context holds 256" read as a contradiction
        return ContextOverflowError(f"the prompt has {counted(n_tokens, at_least)} tokens but the context holds "
                                    f"{n_ctx}, a prompt of at most {n_ctx - 1} and a token of answer; use a "
                                    "larger --ctx-size (EngineConfig.n_ctx) or a shorter prompt",
                                    n_tokens=n_tokens, at_least=at_least)

    # ---- generation -----------------------------------------------------------------------------
    def generate(self, prompt: str | Sequence[int] | np.ndarray, *, max_tokens: int = 128, method: str = "vanilla",
                 sampling: SamplingParams | dict[str, Any] | None = None, stop: str | Sequence[str] | None = (),
                 chat: bool = False, options: Mapping[str, Any] | None = None,
                 cancel: Callable[[], bool] | threading.Event | None = None) -> GenerationResult:
        """Generate up to ``max_tokens`` tokens after ``prompt`` (text, or token ids taken as they are) and
        return the whole answer. ``method``: one of the registered methods; ``sampling``: None for greedy;
        ``stop``: strings that end the answer (not included in its text); ``chat``: wrap a text prompt in
        the model's chat template; ``options``: the method's options; ``cancel``: an Event or a function
        polled between rounds (finish_reason 'cancelled'). ``stream`` yields the same answer piece by piece."""
        result = None
        for event in self.stream(prompt, max_tokens=max_tokens, method=method, sampling=sampling, stop=stop,
                                 chat=chat, options=options, cancel=cancel):
            result = event.result or result
        assert result is not None
        return result

    def stream(self, prompt: str | Sequence[int] | np.ndarray, *, max_tokens: int = 128, method: str = "vanilla",
               sampling: SamplingParams | dict[str, Any] | None = None, stop: str | Sequence[str] | None = (),
               chat: bool = False, options: Mapping[str, Any] | None = None,
               cancel: Callable[[], bool] | threading.Event | None = None) -> Generator[StreamEvent, None, None]:
        """Yield text pieces as they are accepted; the last event carries the GenerationResult. Nothing
        runs before the first ``next()``."""
        stream = self._stream(prompt, max_tokens, method, sampling, stop, chat, options, cancel)
        self._streams.add(stream)
        return stream

    def _stream(self, prompt: str | Sequence[int] | np.ndarray, max_tokens: int, method: str,
                sampling: SamplingParams | dict[str, Any] | None, stop: str | Sequence[str] | None, chat: bool,
                options: Mapping[str, Any] | None,
                cancel: Callable[[], bool] | threading.Event | None) -> Generator[StreamEvent, None, None]:
        self._refuse_reentry()   # before the prompt is tokenized for a generation that cannot start
        stops = _stop_strings(stop)
        sampling = _sampling_params(sampling)
        if not is_integer(max_tokens) or max_tokens < 0:
            raise ParameterError(f"max_tokens must be an integer >= 0 (got {max_tokens!r})")
        max_tokens = int(max_tokens)
        _check_flags(chat=chat)
        chat = bool(chat)
        if method not in method_names():
            raise ParameterError(f"unknown method {method!r}; choose one of {', '.join(method_names())}")
        tokens = self.prompt_tokens(prompt, chat=chat)
        if not tokens:
            raise ParameterError("the prompt is empty")
        if len(tokens) + 1 > self.target_ctx.n_ctx:
            raise self._overflow(len(tokens))
        is_cancelled = _cancel_check(cancel)
        with self._exclusive():   # a method's options may name history files: not while another generates
            chosen, sched, sizer = self._plan(method, options)
            run = self._run(tokens, chosen.proposer, sched, sizer, max_tokens, sampling, stops,
                            is_cancelled)
            saved = False
            try:
                for event in run:
                    if event.result is not None:   # saved before the caller hears that the answer is done
                        if event.text or event.tokens:   # its last text first: a failed save's warning after it
                            yield StreamEvent(event.text, event.tokens)
                            self._lock_owner = threading.current_thread()
                            event = StreamEvent("", [], event.result)
                        self._save_history(event.result.stats, if_due=True)   # (history files, if named)
                        self.save_learned(SAVE_INTERVAL)
                        saved = True
                    yield event
                    self._lock_owner = threading.current_thread()   # whichever thread reads the stream holds it
            finally:
                run.close()
                if not saved:   # a stream closed early: as a finished answer's, when due (close() saves the rest)
                    self._save_history(None, if_due=True)

    def prepare(self, method: str = "vanilla", options: Mapping[str, Any] | None = None) -> None:
        """Measure now what the first generation with ``method`` would measure first (this machine's
        cost curves, where none are cached yet: seconds to minutes), so that it starts at once. The chat
        does this before its first prompt: there Ctrl-C quits, while during an answer it only stops it."""
        self._refuse_reentry()
        if method not in method_names():
            raise ParameterError(f"unknown method {method!r}; choose one of {', '.join(method_names())}")
        with self._exclusive():
            self._plan(method, options)   # the proposer it makes has not begun: nothing to end

    def _plan(self, method: str, options: Mapping[str, Any] | None
              ) -> tuple[Method, Scheduler | None, RoundSizer | None]:
        """A generation's proposer, the scheduler that prices its drafts and its round sizer; the first
        call measures the cost curves. Called holding the engine's lock."""
        self._planning = True
        try:
            return self._new_plan(method, options)
        finally:
            self._planning = False

    def _new_plan(self, method: str, options: Mapping[str, Any] | None
                  ) -> tuple[Method, Scheduler | None, RoundSizer | None]:
        if self.draft is None and needs_draft(method):   # not an option's fault, whatever options are given
            raise _needs_draft(method)
        try:
            with self.history.unchanged_on_error():
                # (create_method takes any Mapping: check_options copies it into a dict)
                chosen = create_method(method, self.drafting_context(), cast("dict[str, Any]", options or {}))
        except MethodOptionError:
            raise
        except ParameterError as exc:
            if not options:
                raise
            raise MethodOptionError(str(exc)) from None
        # in rounds of one size every draft up to it costs the same, so a copy's draft is not priced but
        # verified as proposed (cut to the size); a draft model's steps still cost their time, so its
        # drafts are priced against rounds of that size (unpriced, `speculative` drafted with the 0.5B
        # every round, however little it kept)
        priced = chosen.scheduled and (self.round_size < 2 or not chosen.proposer.free_drafts)
        sched = self.scheduler() if priced else None
        sizer = self._round_sizer(chosen.proposer)   # measures the costs too, where none are yet
        return chosen, sched, sizer

    def _save_history(self, stats: GenerationStats | None, if_due: bool = False) -> None:
        """Save the history files (``if_due``: see ``History.save``); a failure (a full disk, a folder made
        read-only) is a warning, and a note in the answer's stats: the answer itself must reach the
        caller (it was once discarded)."""
        try:
            self.history.save(if_due=if_due)
        except PoolError as exc:
            log.warning("warning: %s (the answer is kept; the save is tried again after the next answer, or at "
                        "close)", exc)
            if stats is not None:
                stats.extra["history_not_saved"] = str(exc)

    def _run(self, prompt: list[int], proposer: Proposer, sched: Scheduler | None, sizer: RoundSizer | None,
             max_tokens: int, sampling: SamplingParams, stops: list[str],
             is_cancelled: Callable[[], bool]) -> Iterator[StreamEvent]:
        """``sched``: prices the proposer's drafts (None: they run as proposed; ``auto`` and scheduled
        Ouroboros price their candidates themselves). ``sizer``: plain steps or rounds of one size, where
        those draft while they decode (``_round_sizer``)."""
        # a sampled answer without a seed draws one, said in its stats so that a good sample can be had
        # again (plain decoding's, token for token); the drafters still see a request without a seed,
        # which lets them sample their drafts (a seeded request's are greedy: README, Exactness)
        seed = None if sampling.greedy else sampling.seed if sampling.seed is not None else secrets.randbits(32)
        stats = GenerationStats(method=proposer.name, prompt_tokens=len(prompt), seed=seed)
        rng = replace(sampling, seed=seed).rng()
        eog = self.target.eog_tokens
        cfg = self.config
        round_size = self.round_size if proposer.name != "vanilla" else 0
        setup = ProposeSetup(sampling=sampling, rng=rng, max_tree_nodes=self.target_ctx.n_batch - 1,
                             max_branches=self.target_ctx.n_seq_max, eog_tokens=eog,
                             extend_pays=sched.extend_rule() if sched is not None else None,
                             round_size=round_size)
        # once a method has calibrated the cost curve, every round (any method's) refines what rounds cost
        costs_learner = self._scheduler if cfg.adaptive else None
        if costs_learner is not None:
            costs_learner.use_method(proposer.name)
        if sched is not None:
            sched.begin_request()
            sched.enroll(proposer)
            setup = replace(setup, retired=sched.hopeless(proposer.name))
        out = AnswerOutput(self.target, stops, eog, max_tokens)
        committed = list(prompt)
        target_before, draft_before = _graph_counts(self.target_ctx), _graph_counts(self._draft_ctx)

        t0 = time.perf_counter()
        try:
            self.kv.sync_to(prompt[:-1], stop=is_cancelled)   # a cancel stops a long prefill too
        except BaseException:
            self.kv.reset()  # a failed prefill leaves the cache in an unknown state
            raise
        if is_cancelled():   # during the prefill: nothing more, not even a draft's own prefill in begin()
            stats.prefill_seconds = time.perf_counter() - t0
            stats.finish_reason = "cancelled"
            stats.finalize()
            yield StreamEvent(text="", tokens=[], result=GenerationResult(text="", tokens=[], stats=stats))
            return
        try:
            proposer.begin(committed, setup)
        except BaseException:   # Ctrl-C in a draft's prefill: what it began (PEARL's threads) is undone
            _end_drafting(proposer, raising=True)
            self._drop_draft_cells()
            raise
        t1 = time.perf_counter()
        llama_at_t1 = llama_decode_clock()   # this thread's seconds decoding in llama.cpp
        stats.prefill_seconds = t1 - t0
        draft_context_full = False
        overlap = self._overlaps(proposer)
        ahead = overlap           # this round decodes a plain step while its draft is made
        # in rounds of one size every round does: a round's guesses are the last draft's tokens past what
        # its round wrote (``_Round.guesses``), so a draft is never verified in the open
        pipelined = overlap and round_size > 1
        if not pipelined:
            sizer = None
        elif sizer is not None:
            sizer.begin_request()
        carried: tuple[TokenTree, int] | None = None   # a draft and the child the last plain step accepted
        guesses: list[int] = []
        observe_later: Callable[[], None] | None = None
        ahead_drafts = ahead_carried = 0   # drafts made during a plain step, and those it accepted a token of
        split = TimeSplit()
        consumer_seconds = 0.0   # the caller's, between a yield and the next round: its terminal, not ours
        failed = raising = False
        try:
            while out.finish is None:
                if is_cancelled():
                    out.finish = "cancelled"
                    break
                room = self.target_ctx.n_ctx - self.kv.n_past - 1
                if room <= 0:
                    out.finish = "length"
                    break
                budget = max(0, min(setup.max_tree_nodes, max_tokens - len(out.tokens) - 1, room - 1))
                draft_budget = budget
                if round_size > 1:
                    budget = min(budget, round_size - 1)   # every round the same size: no larger tree
                    draft_budget = min(draft_budget, 2 * round_size - 1)   # this round's guesses and the next's
                was_carried = carried is not None
                if ahead:
                    step = self._step_ahead(proposer, sched, committed, room, sampling, rng, observe_later,
                                            round_size, draft_budget, guesses,
                                            sizer.size() if sizer is not None else round_size)
                    if sizer is not None:
                        sizer.observe(step.tree.batch_size, step.stand_in, step.result.tokens, step.seconds)
                    observe_later = None
                    ahead_drafts += step.drafted > 0
                    ahead_carried += step.carried is not None or bool(step.guesses)
                    guesses = step.guesses
                else:
                    step = self._round(proposer, sched, committed, budget, room, sampling, rng, carried,
                                       draft_context_full, round_size)
                split.add_round(step.tree.batch_size, step.drafted > 0 and not ahead, ahead, was_carried,
                                step.seconds, step.propose_seconds)
                tree, result, seen, carried = step.tree, step.result, step.seen, step.carried
                draft_context_full = step.draft_context_full
                stats.target_passes += 1
                if self.check_kv:
                    self.kv.check()
                # the guesses a round filled in count as drafted: they are verified, and accepted, as drafts
                stats.drafted += step.drafted + step.filled
                committed.extend(result.tokens)
                before = len(out.tokens)
                event = out.take(result.tokens)
                # accepted draft tokens that are the answer's: the budget, a stop string or an end token may
                # cut the round (a round of one size may pass the budget); the pass's own token is not one
                stats.accepted += min(len(result.accepted), len(out.tokens) - before)
                if sched is not None and seen is not None:
                    sched.learn(proposer.name, seen.tree, len(seen.accepted), seen.path)
                if event is not None:
                    handed = time.perf_counter()
                    drafting = proposer.drafts_while_read   # the reader's time is then the drafter's too
                    yield event
                    if not drafting:
                        consumer_seconds += time.perf_counter() - handed
                if out.finish is not None:
                    break
                # the next round decodes while this one is observed: one without a draft, if nothing is
                # carried (in rounds of one size, every round)
                ahead = overlap and not draft_context_full and (pipelined or (carried is None and step.plain))
                observe = self._observer(proposer, committed, seen, result, costs_learner, tree, step.seconds)
                if ahead:
                    result.release()   # what it read is known; a row read later would be the next decode's
                    observe_later = observe
                else:
                    t_observe = time.perf_counter()
                    observe(t_observe)
                    split.add_observe(time.perf_counter() - t_observe)
            if observe_later is not None:   # cancelled, or the context full, before the next step began
                observe_later()
        except BaseException as exc:
            # raised mid-round (a proposer's error, Ctrl-C): the round's cells were decoded but never
            # committed, and the next request on this engine would decode on top of them. A stream
            # closed at a yield (GeneratorExit) has committed all it decoded: nothing to drop, and its
            # context may be gone already (a stream collected after its engine).
            raising = True
            if not isinstance(exc, GeneratorExit):
                self.kv.repair()
                failed = True
            raise
        finally:
            _end_drafting(proposer, raising)
            if failed:   # once its drafting has stopped (PEARL's thread)
                self._drop_draft_cells()
            stats.extra.update(_drafter_stats(proposer))
            if overlap:
                stats.extra["overlap"] = {"drafts": ahead_drafts, "carried": ahead_carried}
            if sizer is not None:
                timed = sizer.timed_ratio   # None: rounds of K not timed yet (the calibrated ratio counted)
                stats.extra["round_switch"] = {"plain_rounds": sizer.plain_rounds, "changes": sizer.changes,
                                               "timed_ratio": None if timed is None else round(timed, 3),
                                               "calibrated_ratio": round(sizer.calibrated_ratio, 3)}
            if sched is not None and proposer.name in sched.retired:
                stats.extra["draft_ceiling"] = {proposer.name: sched.retired[proposer.name]}
        text_tail = out.flush()
        stats.decode_seconds = time.perf_counter() - t1 - consumer_seconds
        stats.extra["time_split"] = split.to_dict(stats.decode_seconds)
        stats.extra["graphs_rebuilt"] = _graphs_built(self.target_ctx, target_before)[1]
        draft_decodes, draft_rebuilt = _graphs_built(self._draft_ctx, draft_before)
        if draft_decodes:   # the draft model decoded: its own graphs, [decodes, rebuilt]
            stats.extra["draft_graphs"] = [draft_decodes, draft_rebuilt]
        _add_python_time(stats, llama_decode_clock() - llama_at_t1)
        stats.tokens = len(out.tokens)
        stats.finish_reason = out.finish or "length"
        stats.finalize()
        final = GenerationResult(text=out.matcher.text, tokens=out.tokens, stats=stats)
        yield StreamEvent(text=text_tail, tokens=[], result=final)

    def _step_ahead(self, proposer: Proposer, sched: Scheduler | None, committed: list[int], room: int,
                    sampling: SamplingParams, rng: np.random.Generator,
                    observe_last: Callable[[], None] | None, round_size: int, draft_budget: int,
                    guesses: Sequence[int], size: int) -> "_Round":
        """A round without a draft, decoding while the last round is observed (``observe_last``) and the
        next draft is made (``EngineConfig.overlap``): on a GPU, llama_decode returns before the decode
        ends. By default a plain step of the root: it checks the draft's first level, and the subtree
        below the child it accepted is carried to the next round (``_Round.carried``). In rounds of one
        size, the root and ``guesses`` (the last draft's tokens past what its round wrote; filled): what
        the round wrote judges the draft, ``draft_budget`` tokens deep, and its tokens past that are the
        next round's guesses (``_Round.guesses``); ``size`` 1 decodes the root alone, its round of
        ``round_size`` standing in (``_Round.stand_in``)."""
        root = TokenTree.rooted_at(committed[-1])
        round_tokens = self._round_tokens(round_size, room) if round_size > 1 else 1
        tree = filled(root, round_tokens, committed, guesses) if size > 1 else root
        draft: TokenTree | None = None
        stand_in: list[int] = []
        t0 = time.perf_counter()

        def decode_and_draft(lay: BatchLayout | None = None) -> np.ndarray:
            nonlocal draft, stand_in
            if lay is None:
                self.kv.begin_step(root.tokens[0])
            else:
                self.kv.begin_layout(lay)
            if observe_last is not None:
                observe_last()
            draft = self._propose_hidden(proposer, sched, committed, draft_budget, room)
            if tree is root and round_tokens > 1:   # while the GPU decodes: the round it stands in for
                stand_in = fill_tokens(root.tokens[0], round_tokens - 1, committed, guesses)
            return self.kv.step_logits() if lay is None else self.kv.layout_rows()

        if tree is root:
            result = verify_step(tree, decode_and_draft(), sampling, rng)
        else:
            result, lay = verify_round(tree, decode_and_draft, sampling, rng)
            self.kv.commit_tree(tree.tokens[0], result.accepted, result.winner_seq, lay.n_seqs, len(lay.tokens))
        seen = result if tree is root else _as_proposed(result, root)
        step = _Round(tree, result, seen, time.perf_counter() - t0, draft_context_full=draft is None, stand_in=stand_in,
                      filled=max(tree.n_candidates - len(guesses), 0))   # the guesses were the last draft's
        if draft is not None and draft.n_candidates:
            step.drafted = draft.n_candidates
            if round_size > 1:
                step.seen, node = judged(draft, result.tokens)
                if node is not None:
                    step.guesses = [draft.tokens[i] for i in draft.first_path(node)[:round_size - 1]]
            else:
                step.seen, node = walked(draft, result.tokens)
                if node is not None:
                    step.carried = (draft, node)
        return step

    def _round(self, proposer: Proposer, sched: Scheduler | None, committed: list[int], budget: int, room: int,
               sampling: SamplingParams, rng: np.random.Generator, carried: tuple[TokenTree, int] | None,
               draft_context_full: bool, round_size: int) -> "_Round":
        """A round drafted before its decode: the rest of a carried draft, or the proposer's tree (the root
        alone once its draft model's context is full; filled to ``round_size``), verified in one decode."""
        drafted = 0
        t_start = time.perf_counter()
        if carried is not None:
            whole, node = carried
            proposed = whole.below(node)
        else:
            tree = None if draft_context_full else self._propose_in_room(proposer, sched, committed, budget, room)
            if tree is None:   # the draft model's context is full: plain steps to the end
                draft_context_full, tree = True, TokenTree.rooted_at(committed[-1])
            proposed, drafted = tree, tree.n_candidates
        tree = proposed
        if round_size > 1 and not draft_context_full:
            tree = filled(proposed, self._round_tokens(round_size, room), committed)
        t0 = time.perf_counter()
        result = self._verify(tree, sampling, rng)
        seconds = time.perf_counter() - t0
        seen = result if proposed is tree else _as_proposed(result, proposed)
        if carried is not None:
            seen = joined(whole, node, seen)
        return _Round(tree, result, seen, seconds, drafted=drafted, draft_context_full=draft_context_full,
                      propose_seconds=t0 - t_start, plain=is_plain_step(proposed),
                      filled=tree.n_candidates - proposed.n_candidates)

    def _round_tokens(self, round_size: int, room: int) -> int:
        """What a round of one size decodes: ``round_size`` tokens, the last rounds of an answer too
        (what passes the token budget is cut from the answer; a smaller round would make llama.cpp
        build a graph, on a GPU without its CUDA graph: ~2 steps), unless the context or a batch is full."""
        return min(round_size, room, self.target_ctx.n_batch)

    def _round_sizer(self, proposer: Proposer) -> RoundSizer | None:
        """Plain steps where a method's rounds of one size would not pay (``EngineConfig.round_switch``),
        as the calibrated costs of both, each decoded back to back, and of a change of size say; None
        where rounds take their draft's size or the costs are not measured. Whether ``proposer`` drafts ahead
        is not asked here: a draft model's depends on the request's sampling, which it learns when its
        generation begins (``_run`` drops the sizer where its rounds do not draft while they decode)."""
        round_size = self.round_size
        if (round_size < 2 or proposer.name == "vanilla" or not self.config.round_switch
                or self.config.calibration == "off" or not self._overlap_here()):
            return None
        costs = self.scheduler().costs
        if costs.round_size != round_size or costs.plain_seconds <= 0:
            return None
        sizer = self._sizers.get(proposer.name)
        if sizer is None:
            sizer = self._sizers[proposer.name] = RoundSizer(
                round_size, costs.cost(round_size) / costs.plain_seconds,
                max(costs.switch_seconds, 0.0) / costs.plain_seconds, costs.plain_seconds)
        return sizer

    def _overlaps(self, proposer: Proposer) -> bool:
        """Does this generation draft while a round without a draft decodes (``EngineConfig.overlap``)?
        By default where llama_decode has been seen to return well before its decode ends
        (``ASYNC_WAIT_SHARE``), and before any step was timed, where the target's layers are on a GPU.
        Asked once ``proposer`` has begun its generation (``Proposer.drafts_ahead``)."""
        return proposer.drafts_ahead and self._overlap_here()

    def _overlap_here(self) -> bool:
        """``_overlaps`` for a proposer that drafts ahead: the setting, or what this machine's steps say."""
        if self.config.overlap is not None:
            return self.config.overlap
        share = self.target_ctx.step_wait_share()
        if share is None:
            return self.target.n_gpu_layers != 0 and supports_gpu_offload()
        return share >= ASYNC_WAIT_SHARE

    @staticmethod
    def _observer(proposer: Proposer, committed: list[int], seen: VerifyResult | None, result: VerifyResult,
                  costs_learner: Scheduler | None, tree: TokenTree,
                  round_seconds: float) -> Callable[[float | None], None]:
        """The end of a round: the proposer observes it (``seen``; None while a carried draft waits for
        the rest of its verification), then its logits rows are released and what it cost is learned.
        Called with the time the observing began (it counts towards the round), or with None during the
        next round's decode (``EngineConfig.overlap``), where it costs the round nothing."""
        def observe(t_observe: float | None = None) -> None:
            if seen is not None:
                proposer.observe(committed, seen)
            result.release()   # its logits rows are overwritten by the next decode
            if costs_learner is not None:
                seconds = round_seconds + (time.perf_counter() - t_observe if t_observe is not None else 0.0)
                costs_learner.observe_round(tree.batch_size, seconds)
        return observe

    def _drop_draft_cells(self) -> None:
        """Drop the draft cache's cells past what it records: a Ctrl-C that Python raises just after a
        draft decode returns leaves them written but unrecorded, and every later draft decode failed."""
        if self._draft_kv is not None:
            self._draft_kv.repair()

    def _propose_hidden(self, proposer: Proposer, sched: Scheduler | None, committed: list[int], budget: int,
                        room: int) -> TokenTree | None:
        """``_propose_in_room`` while a plain step decodes: the scheduler's looks cost no time there."""
        if self._scheduler is None:
            return self._propose_in_room(proposer, sched, committed, budget, room)
        looks = self._scheduler.looks
        looks.hidden = True
        try:
            return self._propose_in_room(proposer, sched, committed, budget, room)
        finally:
            looks.hidden = False

    def _propose_in_room(self, proposer: Proposer, sched: Scheduler | None, committed: list[int], budget: int,
                         room: int) -> TokenTree | None:
        """The proposer's tree (priced by ``sched`` when given; the contract checked), cut to the cells
        left in the context, or None when a draft model's own context is full."""
        try:
            tree = sched.draft(proposer, committed, budget) if sched else proposer.propose(committed, budget)
        except ContextOverflowError:
            return None
        _check_tree(proposer, tree, committed[-1], budget, self.target.n_vocab, self.target_ctx.n_seq_max,
                    self.target_ctx.n_batch)
        if tree.batch_size <= room + 1:
            return tree
        # its first nodes (parents come first), without a window's extra tokens: a tree too large was
        # dropped, and every later round was a plain step, tens of tokens before the context's end
        return tree.subtree(range(min(len(tree), room + 1)))

    def _verify(self, tree: TokenTree, sampling: SamplingParams, rng: np.random.Generator) -> VerifyResult:
        if is_plain_step(tree):   # no layout, no walk: what one round of plain decoding must cost
            return verify_step(tree, self.kv.decode_step(tree.tokens[0]), sampling, rng)
        result, lay = verify_round(tree, self.kv.decode_layout, sampling, rng)
        self.kv.commit_tree(tree.tokens[0], result.accepted, result.winner_seq, lay.n_seqs, len(lay.tokens))
        return result


_ENGINES: "weakref.WeakSet[Engine]" = weakref.WeakSet()   # the live engines, for a fork's child


def _after_fork_in_child() -> None:
    for engine in list(_ENGINES):
        engine._after_fork()


if hasattr(os, "register_at_fork"):   # not on Windows
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _queued_of(engine: "weakref.ref[Engine]") -> Callable[[], Any]:
    """``Engine._queued`` of an engine held weakly (``History``'s guard)."""
    def guard() -> Any:
        alive = engine()
        return alive._queued() if alive is not None else nullcontext()
    return guard


def _close_at_exit() -> None:
    """At interpreter exit, close the engines a script left open: a stream left suspended would otherwise
    run its save while the modules are torn down (a traceback, the answer's history lost), and the answers
    whose save was not yet due would never reach their files. An engine that another thread is still
    generating with is left: waiting for it would hold the exit for as long as that answer takes."""
    for engine in list(_ENGINES):
        owner = engine._lock_owner
        if owner is not None and owner is not threading.current_thread() and _running(owner):
            log.warning("warning: a generation was still running in thread %r at exit: what it learned is "
                        "not saved (close() the engine before exiting)", owner.name)
            continue
        try:
            engine.close()
        except Exception as exc:   # the exit goes on; the others are still closed
            log.warning("warning: closing an engine at exit failed: %s: %s", type(exc).__name__, exc)


atexit.register(_close_at_exit)   # after numpy's own (atexit runs the last registered first)


def _running(thread: threading.Thread) -> bool:
    """Is ``thread`` still running? ``is_alive()`` says False for one whose ``join()`` a Ctrl-C interrupted
    (CPython 3.11): ``close`` then closed that thread's stream under it, its answer cut off unsaid."""
    return thread.is_alive() or thread.ident in sys._current_frames()


def _end_drafting(proposer: Proposer, raising: bool) -> None:
    """``proposer.end()``; where the generation is already failing, an error of its own is logged, not
    raised: it would hide the one that stopped the generation (a plug-in's)."""
    try:
        proposer.end()
    except Exception as exc:
        if not raising:
            raise
        log.warning("drafter %r: end() failed too, after the generation's own error: %s: %s", proposer.name,
                    type(exc).__name__, exc)


def _drafter_stats(proposer: Proposer) -> dict[str, Any]:
    """The drafter's own numbers for the stats: a plug-in's that fail are left out with a warning, not the
    finished answer with them."""
    try:
        extra = proposer.stats()
        if not isinstance(extra, dict):
            raise TypeError(f"stats() returned {type(extra).__name__}, not a dict")
        return extra
    except Exception as exc:
        log.warning("drafter %r: its stats are left out: %s: %s", proposer.name, type(exc).__name__, exc)
        return {}


def _check_tree(proposer: Proposer, tree: TokenTree, root: int, budget: int, n_vocab: int, max_seqs: int,
                max_batch: int) -> None:
    """A drafter's broken contract (a plug-in's) as one line naming it: else every pass decoded an
    oversized tree unnoticed, llama.cpp failed without a word on a token outside the vocabulary, or a
    malformed tree changed the text (``tree_problem``)."""
    checked_tree(proposer, tree)
    if not len(tree.tokens):
        raise DrafterError(f"drafter {proposer.name!r}: an empty tree (a tree holds its root at least)")
    if tree.tokens[0] != root:
        raise DrafterError(f"drafter {proposer.name!r}: the tree's root is not the last committed token"
                           " (committed is the engine's list: a drafter reads it, never changes it)")
    if tree.n_candidates > budget:
        raise DrafterError(f"drafter {proposer.name!r}: {tree.n_candidates} drafted tokens for a budget "
                           f"of {budget}")
    problem = tree_problem(tree, n_vocab, max_seqs, max_batch)
    if problem is not None:
        raise DrafterError(f"drafter {proposer.name!r}: {problem}")


@dataclass
class _Round:
    """One target pass of the loop: the tree decoded, its verification, what the proposer observes of it
    (``seen``: its own tree's verdict; None while a carried draft waits for the rest of its
    verification), and what the round leaves for the next."""

    tree: TokenTree
    result: VerifyResult
    seen: VerifyResult | None
    seconds: float                 # the decode and verification (a plain step's: with the work done during it)
    drafted: int = 0               # candidates proposed this round
    filled: int = 0                # candidates ``filled`` added to the round (rounds of one size)
    draft_context_full: bool = False   # the proposer's draft model has no room left: plain steps to the end
    carried: tuple[TokenTree, int] | None = None   # a draft and the node this round's written tokens reached
    propose_seconds: float = 0.0   # the proposal before the decode, in the open (a plain step's is in ``seconds``)
    plain: bool = True             # the proposer's part was the root alone (whatever ``filled`` added)
    guesses: list[int] = field(default_factory=list)   # rounds of one size: the draft's tokens past what
    #                                                     this round wrote, the next round's guesses
    stand_in: list[int] = field(default_factory=list)  # a plain step in their place: the guesses its round
    #                                                     of one size would have checked after the root


FILL_WINDOW = 256   # tokens of the context ``filled`` looks back through


def filled(tree: TokenTree, size: int, context: Sequence[int], guesses: Sequence[int] = ()) -> TokenTree:
    """A chain of fewer than ``size`` tokens continued to ``size`` (``EngineConfig.round_size``): by
    ``guesses`` first (the last draft's rest, ``_Round.guesses``), then by what followed its last token
    where that token last occurred in the context's last FILL_WINDOW tokens, else by that token again.
    Branching trees and trees with extra rows are left as they are."""
    need = size - len(tree.tokens)
    if need <= 0 or tree.extras or tree.n_extra_seqs or not tree.is_chain():
        return tree
    # a copy, labels and draft distributions included (a root alone has none)
    out = TokenTree.rooted_at(tree.tokens[0]) if len(tree.tokens) == 1 else tree.subtree(range(len(tree.tokens)))
    out.add_path(len(out.tokens) - 1, fill_tokens(tree.tokens[-1], need, context, guesses), source="fill")
    return out


def fill_tokens(last: int, need: int, context: Sequence[int], guesses: Sequence[int] = ()) -> list[int]:
    """The ``need`` tokens ``filled`` hangs below a chain ending in ``last``: ``guesses`` first, then
    what followed the last of them where it last occurred in the context's last FILL_WINDOW tokens, else
    that token again."""
    guess = list(guesses[:need])
    last = guess[-1] if guess else last
    more = need - len(guess)
    if more:
        start = max(len(context) - FILL_WINDOW, 0)
        # the window before the context's last token, newest first: ``index`` finds the last occurrence
        # at C speed
        before = context[len(context) - 2:start - 1 if start > 0 else None:-1] if len(context) >= 2 else []
        try:
            i = len(context) - 2 - before.index(last)
            guess += context[i + 1:i + 1 + more]
        except ValueError:
            pass
        guess += [last] * (need - len(guess))
    return guess


def _as_proposed(result: VerifyResult, proposed: TokenTree) -> VerifyResult:
    """The round as the proposer's own chain saw it (before ``filled``): its nodes' verdicts, and as the
    bonus the token the target wrote after them (filled tokens that were accepted are text it wrote)."""
    kept = min(len(result.accepted), len(proposed.tokens) - 1)
    return VerifyResult(tree=proposed, path=result.path[:kept + 1], accepted=result.accepted[:kept],
                        bonus=result.tokens[kept], predictions=result.predictions,
                        accepted_by_source={k: v for k, v in result.accepted_by_source.items() if k != "fill"})


def _graph_counts(ctx: Context | None) -> tuple[int, int]:
    """A context's decodes and those that reused the previous decode's graph ((0, 0) before it exists)."""
    return (ctx.decodes, ctx.graphs_reused()) if ctx is not None else (0, 0)


def _graphs_built(ctx: Context | None, before: tuple[int, int]) -> tuple[int, int]:
    """The decodes since ``before`` (``_graph_counts``) and those that built a new graph: a change of
    batch shape (the target's round size; a draft model's catch-up batches between one-token steps),
    on a CUDA build a decode without its CUDA graph."""
    decodes, reused = (a - b for a, b in zip(_graph_counts(ctx), before))
    return decodes, decodes - reused


def _add_python_time(stats: GenerationStats, llama_seconds: float) -> None:
    """Split the decode phase into time in llama.cpp's decoding (llama_decode and the wait for its
    logits; target and draft models, this thread)
    and the rest: the runtime's own Python per round, what a fast GPU step would expose."""
    python_seconds = max(0.0, stats.decode_seconds - llama_seconds)
    rounds = stats.target_passes
    stats.extra.update({"llama_decode_seconds": round(llama_seconds, 6),
                        "python_seconds": round(python_seconds, 6),
                        "python_ms_per_round": round(1e3 * python_seconds / rounds, 4) if rounds else None})


def resolve_and_check(target: str | os.PathLike[str], draft: str | os.PathLike[str] | None, progress: bool = True
                      ) -> tuple[Path, Path | None, bool | None, str | None]:
    """Resolve model specs to validated GGUF files and compare the pair's vocabularies.

    Returns (target, draft, compatible, reason): a draft with another vocabulary is not refused here;
    draft methods then run through the cross-vocabulary proposer (proposers/__init__.py).
    """
    from . import models

    for what, spec in (("target", target), ("draft", draft)):
        if not (spec is None and what == "draft" or isinstance(spec, (str, os.PathLike))):
            raise ParameterError(f"the {what} must be a GGUF path, hf://OWNER/REPO/FILE.gguf or a catalogue name "
                                 f"(got {type(spec).__name__})")
    # a Path stays one: Path("gemma3-270m") is a file here, never the catalogue's name
    target_path = models.resolve_model(target, progress=progress)
    _refuse_recurrent(models.validate_gguf(target_path))
    draft = models.resolve_draft_spec(target, draft)   # -d auto
    if draft is None:
        return target_path, None, None, None
    draft_path = models.resolve_model(draft, progress=progress)
    _refuse_recurrent(models.validate_gguf(draft_path))
    report = models.check_pair(target_path, draft_path)
    return target_path, draft_path, report.compatible, report.reason


def _refuse_recurrent(info: Any) -> None:
    """ModelError for a recurrent or hybrid architecture named in the file's header, before its weights load
    (the load refuses it too, once minutes of a large model's weights are read)."""
    if info.is_recurrent:
        raise recurrent_refusal(info.path.name, f"a {info.arch} model, whose memory is recurrent")


def _sampling_params(sampling: SamplingParams | dict[str, Any] | None) -> SamplingParams:
    """``sampling`` checked; a dict of SamplingParams' fields is taken too."""
    if sampling is None:
        return SamplingParams().validated()
    if isinstance(sampling, dict):
        try:
            sampling = SamplingParams(**sampling)
        except TypeError:
            fields = ", ".join(SamplingParams.__dataclass_fields__)
            got = ", ".join(map(str, sampling))
            raise ParameterError(f"sampling takes the fields {fields} (got {got})") from None
    if not isinstance(sampling, SamplingParams):
        raise ParameterError(f"sampling must be a SamplingParams or a dict (got {type(sampling).__name__})")
    return sampling.validated()


def _needs_draft(what: str) -> ParameterError:
    return ParameterError(f"{what} needs a draft model: Engine.load(TARGET, DRAFT) (on the command line: -d DRAFT)")


def _cancel_check(cancel: Callable[[], bool] | threading.Event | None) -> Callable[[], bool]:
    if cancel is None:
        return lambda: False
    if isinstance(cancel, threading.Event):
        return cancel.is_set
    if not callable(cancel):
        raise ParameterError(f"cancel takes a threading.Event or a function returning True to stop "
                             f"(got {type(cancel).__name__})")
    return cancel


def _items(values: Any, what: str, expected: str) -> list[Any]:
    """Any iterable but a str or bytes, as a list (a generator, an array, a set)."""
    if isinstance(values, (str, bytes, bytearray)) or (isinstance(values, np.ndarray) and values.ndim != 1):
        raise ParameterError(f"{what} must be {expected} (got {type(values).__name__})")
    try:
        return list(values)
    except TypeError:
        raise ParameterError(f"{what} must be {expected} (got {type(values).__name__})") from None


def _check_flags(**flags: Any) -> None:
    """Each flag a bool: "no" is truthy (chat="no" applied the template unasked)."""
    for name, value in flags.items():
        if not isinstance(value, (bool, np.bool_)):
            raise ParameterError(f"{name} must be True or False (got {value!r})")


def _token_ids(tokens: Any, what: str, expected: str = "a sequence of token ids") -> list[int]:
    """``tokens`` as a list of ints; a float, bool, str or bytes among them is an error, not a guess
    (``int()`` took 1.9 as 1 and b"hi" as the ids 104, 105)."""
    out = _items(tokens, what, expected)
    if all(type(t) is int for t in out):   # the usual list (a chat's every turn): the check below costs
        return out                          # 2.6 us a token, 16 ms at 6,000
    for t in out:
        if not is_integer(t):
            raise ParameterError(f"{what}: token ids are integers (got {t!r})")
    return [int(t) for t in out]


def _stop_strings(stop: Any) -> list[str]:
    """``stop`` as a list of strings: one str is one stop string (list("dad") would be three)."""
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    stops = _items(stop, "stop", "a string or a list of strings")
    if not all(isinstance(s, str) for s in stops):
        raise ParameterError(f"stop takes a string or a list of strings (got {stop!r})")
    return stops
