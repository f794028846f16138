"""`ouroboros-local chat`: an interactive, streaming chat in the terminal.

The whole conversation is rendered with the model's chat template on every turn; the engine reuses
the KV cache for the common prefix, so only the new turn is prefilled. Commands: /reset, /stats,
/help, /quit. Ctrl-C stops the current answer (the prompt comes back); Ctrl-C at the prompt, or
Ctrl-D (EOF), quits. After each answer a compact line on stderr shows speed and draft acceptance.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from typing import TYPE_CHECKING, Any, Callable, Sequence, TextIO

from .errors import ContextOverflowError, OuroborosError, ParameterError
from .server import defer_method_default

if TYPE_CHECKING:  # pragma: no cover
    from .engine import Engine, GenerationResult
    from .sampling import SamplingParams

PROMPT = ">>> "
HELP = ("commands: /reset (forget the conversation), /stats (session totals), /quit (or Ctrl-D); "
        "Ctrl-C stops an answer")


class Totals:
    """The session's statistics: answers, stopped answers, and the GenerationStats fields below summed."""

    _SUMMED = ("tokens", "decode_seconds", "prefill_seconds", "target_passes", "drafted", "accepted")

    def __init__(self) -> None:
        self.turns = 0
        self.cancelled = 0
        self.tokens = self.target_passes = self.drafted = self.accepted = 0
        self.decode_seconds = self.prefill_seconds = 0.0

    def add(self, result: "GenerationResult") -> None:
        s = result.stats
        self.turns += 1
        self.cancelled += s.finish_reason == "cancelled"
        for name in self._SUMMED:
            setattr(self, name, getattr(self, name) + getattr(s, name))


class ChatSession:
    """A conversation with one engine: history, generation, statistics. No terminal I/O here."""

    def __init__(self, engine: "Engine", *, method: str, sampling: "SamplingParams | None" = None,
                 options: dict[str, Any] | None = None, system: str | None = None,
                 max_tokens: int | None = None, stop: Sequence[str] = ()):
        self.engine = engine
        self.method = method
        self.sampling = sampling
        self.options = dict(options or {})
        self.system = system
        self.max_tokens = max_tokens
        self.stop = list(stop)
        self.messages: list[dict[str, str]] = []
        self.totals = Totals()
        self.context_used = 0
        self.reset()

    @property
    def n_ctx(self) -> int:
        return self.engine.target_ctx.n_ctx

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []
        self.context_used = 0

    def ask(self, text: str, on_text: Callable[[str], None] | None = None,
            cancel: threading.Event | None = None) -> "GenerationResult":
        """Answer one user turn, streaming text to ``on_text``; the turn joins the history (a stopped
        answer too, as far as it got). Raises ContextOverflowError when the conversation is full."""
        messages = self.messages + [{"role": "user", "content": text}]
        prompt = self.engine.apply_chat_template(messages)
        try:   # counted, not listed, when far too long (a pasted file)
            tokens = self.engine.tokenize(prompt, add_special=False, parse_special=True, limit=self.n_ctx - 1)
        except ContextOverflowError as exc:
            n_tokens = exc.n_tokens if exc.n_tokens is not None else self.n_ctx
            shown = exc.counted
        else:
            n_tokens = len(tokens)
            shown = str(n_tokens)
        room = self.n_ctx - n_tokens - 1
        if room <= 0:
            raise ContextOverflowError(
                f"the conversation has {shown} tokens and the context holds {self.n_ctx}: "
                "/reset to start over (or use a larger --ctx-size)")
        max_tokens = room if self.max_tokens is None else min(self.max_tokens, room)
        result = None
        for event in self.engine.stream(tokens, max_tokens=max_tokens, method=self.method,
                                        sampling=self.sampling, stop=self.stop, options=self.options,
                                        cancel=cancel):
            if event.text and on_text is not None:
                on_text(event.text)
            result = event.result or result
        assert result is not None
        self.messages = messages + [{"role": "assistant", "content": result.text}]
        self.context_used = len(tokens) + result.stats.tokens
        self.totals.add(result)
        return result

    @staticmethod
    def turn_line(result: "GenerationResult") -> str:
        s = result.stats
        parts = [f"[{s.method}] {s.tokens} tokens", f"{s.tokens_per_second:.1f} tok/s"]
        if s.target_passes:
            parts.append(f"{s.tokens_per_pass:.2f} tok/pass")
        if s.drafted:
            parts.append(f"accepted {s.accepted}/{s.drafted} ({100.0 * s.accepted / s.drafted:.0f}%)")
        if s.finish_reason == "cancelled":
            parts.append("stopped")
        elif s.finish_reason == "length":
            parts.append("length limit")
        return ", ".join(parts)

    def summary(self) -> str:
        t = self.totals
        tps = t.tokens / t.decode_seconds if t.decode_seconds > 0 else 0.0
        parts = [f"{t.turns} answers ({t.cancelled} stopped)",
                 f"{t.tokens} tokens in {t.decode_seconds:.2f}s ({tps:.1f} tok/s)",
                 f"prefill {t.prefill_seconds:.2f}s"]
        if t.target_passes:
            # as each answer's line counts it (GenerationStats.tokens_per_pass): accepted draft tokens per
            # pass plus the pass's own; tokens / passes reads below 1 where an answer's last pass emits nothing
            parts.append(f"{t.target_passes} target passes ({t.accepted / t.target_passes + 1:.2f} tok/pass)")
        if t.drafted:
            parts.append(f"accepted {t.accepted}/{t.drafted} drafted ({100.0 * t.accepted / t.drafted:.0f}%)")
        parts.append(f"context {self.context_used}/{self.n_ctx} tokens, {len(self.messages)} messages")
        parts.append(f"method {self.method}")
        return "; ".join(parts)


def run_repl(session: ChatSession, *, read: Callable[[str], str] = input, out: TextIO | None = None,
             err: TextIO | None = None) -> int:
    """The read-answer loop. Returns 0 on /quit, EOF or two Ctrl-C in a row at the prompt (one Ctrl-C
    pressed a moment too late to stop an answer must not end the conversation)."""
    out = out or sys.stdout
    err = err or sys.stderr
    main_thread = threading.current_thread() is threading.main_thread()

    def write(text: str) -> None:
        out.write(text)
        out.flush()

    interrupted = False
    while True:
        try:
            line = read(PROMPT)
        except EOFError:
            write("\n")
            return 0
        except KeyboardInterrupt:
            write("\n")
            if interrupted:
                return 0
            interrupted = True
            print("(Ctrl-C again, Ctrl-D or /quit to leave)", file=err, flush=True)
            continue
        interrupted = False
        line = line.removeprefix("\ufeff")   # a byte-order mark opening piped input is not text
        text = line.strip()
        if not text:
            continue
        if text.startswith("/"):
            command = text.split()[0].lower()
            if command in ("/quit", "/exit", "/q"):
                return 0
            if command == "/reset":
                session.reset()
                print("(conversation cleared)", file=err, flush=True)
            elif command == "/stats":
                print(session.summary(), file=err, flush=True)
            else:
                print(HELP, file=err, flush=True)
            continue

        cancel = threading.Event()
        previous = None
        if main_thread:
            previous = signal.signal(signal.SIGINT, lambda signum, frame, event=cancel: event.set())
        try:
            result = session.ask(line, write, cancel)
        except OuroborosError as exc:
            write("\n")
            print(f"error: {exc}", file=err, flush=True)
            continue
        finally:
            if main_thread:
                signal.signal(signal.SIGINT, previous if previous is not None else signal.default_int_handler)
        if not result.text.endswith("\n"):
            write("\n")
        print(session.turn_line(result), file=err, flush=True)


def cmd_chat(args: argparse.Namespace) -> int:
    from . import cli

    if args.max_tokens is not None and args.max_tokens < 1:
        raise ParameterError("-n/--max-tokens must be >= 1")
    sampling = cli._sampling_from_args(args)
    method, options = cli.checked_method(args)
    engine = cli._engine_from_args(args)
    try:
        cli.warn_without_chat_template(engine)
        session = ChatSession(engine, method=method, sampling=sampling, options=options, system=args.system,
                              max_tokens=args.max_tokens, stop=args.stop or ())
        if sys.stdin.isatty():
            try:
                import readline  # noqa: F401  (line editing and history for input())
            except ImportError:  # pragma: no cover
                pass
        engine.prepare(method, options)   # a first calibration here, where Ctrl-C quits, not in the first answer
        print(f"chatting with {engine.target.path.name} (method {method}, context {session.n_ctx}); {HELP}",
              file=sys.stderr, flush=True)
        return run_repl(session)
    finally:
        engine.close()


def register(subparsers: Any, add_model_args: Callable, add_sampling_args: Callable,
             add_method_args: Callable) -> argparse.ArgumentParser:
    p = subparsers.add_parser("chat", help="interactive chat with streaming output",
                              description="Chat with a model in the terminal. " + HELP + ".")
    add_model_args(p)
    p.add_argument("--system", default=None, help="system prompt")
    p.add_argument("-n", "--max-tokens", type=int, default=None,
                   help="longest answer in tokens (default: until the model stops or the context is full)")
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    add_sampling_args(p)
    add_method_args(p)
    defer_method_default(p, "decoding method (default: auto if available, else speculative with -d, "
                            "else prompt-lookup)")
    p.set_defaults(func=cmd_chat)
    return p
