"""`ouroboros-local chat`: an interactive, streaming chat in the terminal.

The whole conversation is rendered with the model's chat template on every turn; the engine reuses
the KV cache for the common prefix, so only the new turn is prefilled (where the conversation outgrows
the context, its oldest turns make way until half the context is free: then all of it is read again).
Commands: /reset, /stats, /help, /quit; three double quotes open and close a message of several lines. Ctrl-C stops the
current answer (the prompt comes back; stopped before its first token, the message is dropped);
Ctrl-C twice at the prompt, or Ctrl-D (EOF), quits. After each answer a compact line on stderr shows
speed and draft acceptance. The ">>> " prompt is shown only where stdin is a terminal (on stderr
where stdout is not).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import signal
import sys
import threading
from typing import TYPE_CHECKING, Any, Callable, Sequence, TextIO

from .errors import ContextOverflowError, OuroborosError, ParameterError
from .cli import METHODS_IN_HELP
from .server import defer_method_default
from .text_input import check_argument

if TYPE_CHECKING:  # pragma: no cover
    from .engine import Engine
    from .generation import GenerationResult
    from .sampling import SamplingParams

PROMPT = ">>> "
ANSWER_ROOM = 512   # tokens a turn keeps free for its answer, dropping the oldest turns (a quarter at most)
MULTILINE = '"""'
HELP = ('commands: /reset (forget the conversation), /stats (session totals), /help, /quit (or /exit, Ctrl-D); '
        '""" opens and closes a message of several lines; // starts a message with /; Ctrl-C stops an answer')


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
        if self.messages:   # the system prompt's tokens (a template may refuse a system turn alone)
            try:
                self.context_used = self._tokens(self.messages)[2]
            except OuroborosError:
                pass
        self.dropped = 0   # messages the last turn dropped from the conversation's start to fit the context

    def check_system(self) -> None:
        """ContextOverflowError where the system prompt leaves no room for a message and its answer (no
        turn could ever be answered: /reset keeps it)."""
        if not self.system:
            return
        _, shown, n_tokens = self._tokens(self.messages + [{"role": "user", "content": ""}])
        if n_tokens >= self.n_ctx:
            raise ContextOverflowError(f"the system prompt has {shown} tokens and the context holds "
                                       f"{self.n_ctx}: shorten --system (or use a larger --ctx-size)")

    def _tokens(self, messages: list[dict[str, str]]) -> tuple[list[int], str, int]:
        """``messages``' tokens (none past the context), their count as a message says it, and the count
        (or a bound past the context)."""
        try:   # counted, not listed, when far too long (a pasted file)
            tokens = self.engine.chat_tokens(messages, limit=self.n_ctx - 1)
        except ContextOverflowError as exc:
            return [], exc.counted, exc.n_tokens if exc.n_tokens is not None else self.n_ctx
        return tokens, str(len(tokens)), len(tokens)

    def ask(self, text: str, on_text: Callable[[str], None] | None = None,
            cancel: threading.Event | None = None) -> "GenerationResult":
        """Answer one user turn, streaming text to ``on_text``; the turn joins the history (a stopped
        answer too, as far as it got; not one stopped before its first token, during a long message's
        prefill, where the message was meant to be dropped). The oldest turns make way where the
        conversation outgrows the context (``dropped`` says how many messages went); ContextOverflowError
        only where the message cannot fit beside the system prompt alone."""
        turn = {"role": "user", "content": text}
        first = int(bool(self.system))   # the messages before it are kept whatever is dropped
        alone, shown, n_alone = self._tokens(self.messages[:first] + [turn])
        if n_alone >= self.n_ctx:   # nothing to drop would make room: the history stays as it is
            raise ContextOverflowError(f"the message has {shown} tokens with the chat template and the "
                                       f"context holds {self.n_ctx}, a prompt of at most {self.n_ctx - 1} and a "
                                       "token of answer: shorten it (or use a larger --ctx-size)")
        # as chat apps do, the oldest turns make way for an answer (one answer that filled the context
        # left every later message refused, the conversation lost to /reset)
        wanted = min(self.max_tokens or ANSWER_ROOM, ANSWER_ROOM, self.n_ctx // 4)
        history = self.messages[first:]
        messages = self.messages[:first] + history + [turn]
        tokens, shown, n_tokens = self._tokens(messages) if history else (alone, shown, n_alone)
        if history and self.n_ctx - n_tokens < wanted:
            history, messages, tokens, n_tokens = self._make_room(first, history, turn, (alone, n_alone), cancel)
        self.dropped = len(self.messages) - first - len(history)
        room = self.n_ctx - n_tokens   # what generate and the server give: the answer may fill the context
        max_tokens = room if self.max_tokens is None else min(self.max_tokens, room)
        result = None
        for event in self.engine.stream(tokens, max_tokens=max_tokens, method=self.method,
                                        sampling=self.sampling, stop=self.stop, options=self.options,
                                        cancel=cancel):
            if event.text and on_text is not None:
                on_text(event.text)
            result = event.result or result
        assert result is not None
        self.totals.add(result)
        if result.stats.finish_reason == "cancelled" and not result.tokens:
            return result
        # an answer cut inside a character (-n) ends in U+FFFD: the model wrote no such character, and
        # every later prompt would carry it
        text = result.text if result.stats.finish_reason == "stop" else result.text.rstrip("\ufffd")
        self.messages = messages + [{"role": "assistant", "content": text}]
        self.context_used = len(tokens) + result.stats.tokens
        return result

    def _make_room(self, first: int, history: list[dict[str, str]], turn: dict[str, str],
                   alone: tuple[list[int], int], cancel: threading.Event | None
                   ) -> tuple[list[dict[str, str]], list[dict[str, str]], list[int], int]:
        """The history with its oldest turns dropped, a user turn and its answer at a time, until half the
        context is free (as llama.cpp's context shift frees half): every drop changes the prompt's start,
        so the whole conversation is read again, and freeing only the next answer's room made every
        later turn do so (10-18 s a turn, SmolLM2 at 512). The cut is found by bisection: one render per
        try (one per dropped turn took 38 s at 16384 tokens); a cancel stops the search at the last cut
        that fits (the answer is then stopped before it begins)."""
        cuts = [0]   # history[cut:] kept: whole turns (a user message with its answer) from the oldest on
        while cuts[-1] < len(history):
            at = cuts[-1]
            cuts.append(at + (2 if history[at]["role"] == "user" and at + 1 < len(history) else 1))
        wanted = min(self.max_tokens or ANSWER_ROOM, ANSWER_ROOM, self.n_ctx // 4)
        everything = ([], self.messages[:first] + [turn], *alone)   # fits: the message alone was checked
        found = everything
        for free in (max(self.n_ctx // 2, wanted), wanted):   # half the context, else the answer's room
            found = self._first_cut(first, history, turn, cuts, free, everything, cancel)
            if found is not everything:
                break
        return found

    def _first_cut(self, first: int, history: list[dict[str, str]], turn: dict[str, str], cuts: list[int],
                   free: int, everything: tuple, cancel: threading.Event | None) -> tuple:
        """The fewest turns dropped that leave ``free`` tokens (bisection over ``cuts``)."""
        best = everything
        lo, hi = 1, len(cuts) - 1
        while lo < hi and not (cancel is not None and cancel.is_set()):
            mid = (lo + hi) // 2
            kept = history[cuts[mid]:]
            messages = self.messages[:first] + kept + [turn]
            tokens, _, n_tokens = self._tokens(messages)
            if self.n_ctx - n_tokens >= free:
                hi, best = mid, (kept, messages, tokens, n_tokens)
            else:
                lo = mid + 1
        return best

    def turn_line(self, result: "GenerationResult") -> str:
        s = result.stats
        if s.finish_reason == "cancelled" and not result.tokens:
            return f"[{s.method}] stopped before the answer began: the message was not kept"
        parts = [f"[{s.method}] {s.tokens} tokens", f"{s.tokens_per_second:.1f} tok/s"]
        if s.target_passes:
            parts.append(f"{s.tokens_per_pass:.2f} tok/pass")
        if s.drafted:
            parts.append(f"accepted {s.accepted}/{s.drafted} ({100.0 * s.accepted / s.drafted:.0f}%)")
        if s.finish_reason == "cancelled":
            parts.append("stopped")
        elif s.finish_reason == "length":
            full = self.context_used >= self.n_ctx
            parts.append(f"the context of {self.n_ctx} tokens is full (the next message drops the oldest turns)"
                         if full else "length limit")
        if self.dropped:
            parts.append(f"the {self.dropped} oldest message{'s' if self.dropped > 1 else ''} dropped to fit the "
                         "context")
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


def run_repl(session: ChatSession, *, read: Callable[[str], str] = input, prompt: str = PROMPT,
             out: TextIO | None = None, err: TextIO | None = None) -> int:
    """The read-answer loop. Returns 0 on /quit, EOF or two Ctrl-C in a row at the prompt (one Ctrl-C
    pressed a moment too late to stop an answer must not end the conversation); 1 instead where piped
    messages were refused, so that a script sees it. ``prompt``: "" where none is shown (piped input)."""
    out = out or sys.stdout
    err = err or sys.stderr
    main_thread = threading.current_thread() is threading.main_thread()

    def write(text: str) -> None:
        out.write(text)
        out.flush()

    def say(text: str) -> None:
        print(text, file=err, flush=True)

    interrupted = False
    refused = 0   # messages refused: piped ones make the exit status 1, for a script to see

    def finished() -> int:
        return 1 if refused and not prompt else 0

    while True:
        try:
            line = read(prompt)
            line = line.removeprefix("\ufeff")   # a byte-order mark opening piped input is not text
            message, between_quotes = _message(line, read, prompt)
        except EOFError:
            if prompt:   # the prompt's line, on stderr with the prompt (stdout may be a transcript)
                say("")
            return finished()
        except KeyboardInterrupt:
            if not prompt:   # piped: no one is there to press it twice; it ends the chat, status 130
                raise
            say("")
            if interrupted:
                return finished()
            interrupted = True
            say("(Ctrl-C again, Ctrl-D or /quit to leave)")
            continue
        interrupted = False
        if message is None:
            continue
        command = message.split()[0].lower() if not between_quotes else ""
        if command.startswith("/") and not command.startswith("//"):
            if command in ("/quit", "/exit", "/q"):
                return finished()
            if command == "/reset":
                session.reset()
                say("(conversation cleared)")
            elif command == "/stats":
                say(session.summary())
            elif command == "/help":
                say(HELP)
            else:   # a question that began with a path was once dropped in silence
                say(f"unknown command {command} (not sent; start the message with // to send it); {HELP}")
                refused += 1
            continue
        if command.startswith("//"):
            message = message.replace("/", "", 1)   # "//etc" sends "/etc"

        cancel = threading.Event()
        previous = None
        stops_answer = main_thread and bool(prompt)   # at a terminal Ctrl-C stops the answer; piped, the chat
        if stops_answer:
            previous = signal.signal(signal.SIGINT, lambda signum, frame, event=cancel: event.set())
        written: list[str] = []

        def on_text(text: str) -> None:
            written.append(text)
            write(text)

        try:
            result = session.ask(message, on_text, cancel)
        except OuroborosError as exc:
            if written:   # end the answer's line (the message's own ended with its Enter)
                write("\n")
            say(f"error: {exc}")
            refused += 1
            continue
        except BaseException:   # Ctrl-C piped, SIGTERM, SIGHUP: the answer's line ends before the exit
            if written and not written[-1].endswith("\n"):
                with contextlib.suppress(OSError):
                    write("\n")
            raise
        finally:
            if stops_answer:
                signal.signal(signal.SIGINT, previous if previous is not None else signal.default_int_handler)
        if not result.text.endswith("\n"):
            write("\n")
        say(session.turn_line(result))


def _message(line: str, read: Callable[[str], str], prompt: str) -> tuple[str | None, bool]:
    """(the message ``line`` opens, None for nothing to send; whether it came between triple quotes). A
    line opening with three double quotes takes the lines up to the one that ends with them (a line of
    them alone, where they opened alone; EOF closes it too): a message of several lines, where each line
    is otherwise sent on its own. A closing line is not indented: pasted code's docstrings are."""
    text = line.strip()
    if not text.startswith(MULTILINE):
        return (line if text else None), False
    rest = text[len(MULTILINE):]
    if rest.endswith(MULTILINE):          # opened and closed on one line
        lines = [rest[:-len(MULTILINE)]]
    else:
        # opened alone, only a line of three quotes alone closes it (pasted code holds docstrings)
        lines = [rest]
        while True:
            try:
                more = read("... " if prompt else "")
            except EOFError:
                break
            indented = more[:1] in (" ", "\t")
            closing = not indented and (more.rstrip() == MULTILINE if not rest else more.rstrip().endswith(MULTILINE))
            if closing:
                tail = more.rstrip()[:-len(MULTILINE)]
                if tail.strip():
                    lines.append(tail)
                break
            lines.append(more)
    message = "\n".join(lines).strip("\n")
    return (message if message.strip() else None), True


def cmd_chat(args: argparse.Namespace) -> int:
    from . import cli

    if args.max_tokens is not None and args.max_tokens < 1:
        raise ParameterError("-n/--max-tokens must be >= 1")
    check_argument(args.system, "--system")
    for stop in args.stop or ():
        check_argument(stop, "--stop")
    sampling = cli._sampling_from_args(args)
    method, options = cli.checked_method(args)
    read, prompt = _terminal_reader()
    engine = cli._engine_from_args(args, method, options)
    try:
        cli.warn_without_chat_template(engine, "use `generate -p TEXT` for plain completion")
        session = ChatSession(engine, method=method, sampling=sampling, options=options, system=args.system,
                              max_tokens=args.max_tokens, stop=args.stop or ())
        session.check_system()
        engine.prepare(method, options)   # a first calibration here, where Ctrl-C quits, not in the first answer
        print(f"chatting with {engine.target.path.name} (method {method}, context {session.n_ctx}); {HELP}",
              file=sys.stderr, flush=True)
        return run_repl(session, read=read, prompt=prompt)
    finally:
        engine.close()


def _terminal_reader() -> tuple[Callable[[str], str], str]:
    """How the REPL reads a line, and its prompt. Bytes that are not UTF-8 reach the message as
    escapes, refused there in one line (a strict stdin ended the chat with a traceback). The prompt is
    for a person at a terminal: piped input shows none, and where stdout is a file (a transcript) it goes
    to stderr, as Python's REPL does; input() wrote it into the answers."""
    if sys.stdin is None:   # closed (<&-)
        raise ParameterError("stdin is closed: nothing to read the messages from")
    piped = not sys.stdin.isatty()
    if isinstance(sys.stdin, io.TextIOWrapper):
        # piped or redirected messages are UTF-8, as `generate -f -` reads them (Windows' code page made
        # "Café" "CafÃ©"); a terminal's are in its own encoding, and PYTHONIOENCODING is the user's choice
        # lines end at "\n" alone: universal newlines (None) also split a message at a lone "\r", where a
        # prompt file keeps it; a CRLF's "\r" is dropped below (POSIX stdin kept it for the model)
        utf8 = piped and not os.environ.get("PYTHONIOENCODING")
        sys.stdin.reconfigure(errors="surrogateescape", newline="\n", **({"encoding": "utf-8"} if utf8 else {}))
    if piped:
        return _line_without_cr, ""
    try:
        import readline  # noqa: F401  (line editing and history for input())
    except ImportError:  # pragma: no cover
        pass
    if sys.stdout.isatty():
        return input, PROMPT

    def read(prompt: str) -> str:
        print(prompt, end="", file=sys.stderr, flush=True)
        return _line_without_cr("")

    return read, PROMPT


def _line_without_cr(prompt: str) -> str:
    """input(), CRLF read as "\n" as prompt files read it."""
    return input(prompt).removesuffix("\r")


def register(subparsers: Any, add_model_args: Callable, add_sampling_args: Callable,
             add_method_args: Callable) -> argparse.ArgumentParser:
    p = subparsers.add_parser("chat", help="interactive chat with streaming output",
                              description="Chat with a model in the terminal. " + HELP + ".")
    add_model_args(p)
    p.add_argument("--system", default=None,
                   help="system prompt (none or '': no system message, and the chat template's own default "
                        "where it has one)")
    p.add_argument("-n", "--max-tokens", type=int, default=None,
                   help="longest answer in tokens (default: until the model stops or the context is full)")
    p.add_argument("--stop", action="append",
                   help="stop string, taken as it is (repeatable; a newline in bash: $'\\n')")
    add_sampling_args(p)
    add_method_args(p)
    defer_method_default(p, f"{METHODS_IN_HELP} (default auto)")
    p.set_defaults(func=cmd_chat)
    return p
