"""`ouroboros-local chat`: the session logic in-process, and the real CLI through a pseudo-terminal."""

from __future__ import annotations

import io
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from ouroboros_local.chat_cli import PROMPT, ChatSession, run_repl
from ouroboros_local.engine import Engine, EngineConfig
from ouroboros_local.errors import ContextOverflowError
from ouroboros_local.llama import Model
from ouroboros_local.sampling import SamplingParams
from ouroboros_local.testing import write_tiny_model

REPO = Path(__file__).resolve().parents[1]
SYSTEM = "You are terse."
STATS_LINE = re.compile(r"\[[a-z-]+\] \d+ tokens, [\d.]+ tok/s")


@pytest.fixture(scope="module")
def engine(tiny_target, tiny_draft):
    eng = Engine(Model(tiny_target), Model(tiny_draft),
                 EngineConfig(n_ctx=512, n_batch=64, n_seq_max=8, threads=1, threads_batch=1))
    eng.check_kv = True
    yield eng
    eng.close()


def slow_chat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Same file as tests/test_server.py writes: a wider random model whose answers run long."""
    path = tmp_path_factory.getbasetemp() / "slow_chat.gguf"
    if not path.exists():
        write_tiny_model(path, seed=7, n_layer=4, n_embd=512, n_head=8, n_head_kv=4, n_ff=1536,
                         n_ctx_train=4096)
    return path


def chat_tokens(engine: Engine, messages: list[dict[str, str]]) -> list[int]:
    return engine.chat_tokens(messages)


# ---- ChatSession --------------------------------------------------------------------------------
def test_session_history_matches_template_over_whole_conversation(engine):
    session = ChatSession(engine, method="speculative", sampling=SamplingParams(), system=SYSTEM, max_tokens=20)
    pieces: list[str] = []
    first = session.ask("Tell me about the sea.", pieces.append)
    assert "".join(pieces) == first.text
    expected = engine.generate(chat_tokens(engine, [{"role": "system", "content": SYSTEM},
                                                    {"role": "user", "content": "Tell me about the sea."}]),
                               max_tokens=20, method="vanilla")
    assert first.text == expected.text
    second = session.ask("And the boats?")
    history = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Tell me about the sea."},
               {"role": "assistant", "content": first.text}, {"role": "user", "content": "And the boats?"}]
    assert second.text == engine.generate(chat_tokens(engine, history), max_tokens=20, method="vanilla").text
    assert [m["role"] for m in session.messages] == ["system", "user", "assistant", "user", "assistant"]
    assert session.totals.turns == 2
    assert session.context_used == len(chat_tokens(engine, history)) + second.stats.tokens
    summary = session.summary()
    assert "2 answers" in summary and "context" in summary
    # the session's tokens per pass as each answer counts it (accepted per pass + 1), never below 1
    t = session.totals
    assert f"({t.accepted / t.target_passes + 1:.2f} tok/pass)" in summary
    t.tokens, t.target_passes, t.accepted = 9, 10, 0   # an answer ended by an end-of-generation token
    assert "10 target passes (1.00 tok/pass)" in session.summary()
    t.tokens, t.target_passes, t.accepted = 30, 10, 21
    assert "10 target passes (3.10 tok/pass)" in session.summary()
    assert STATS_LINE.match(session.turn_line(second))

    session.reset()
    assert session.messages == [{"role": "system", "content": SYSTEM}]
    again = session.ask("Tell me about the sea.")
    assert again.text == first.text


def test_session_cancel_keeps_partial_answer(engine):
    session = ChatSession(engine, method="vanilla", max_tokens=200)
    cancel = threading.Event()
    seen: list[str] = []

    def on_text(text: str) -> None:
        seen.append(text)
        cancel.set()           # like Ctrl-C right after the first piece

    result = session.ask("hello", on_text, cancel)
    assert result.stats.finish_reason in ("cancelled", "stop")
    if result.stats.finish_reason == "cancelled":
        assert "stopped" in session.turn_line(result)
    assert session.messages[-1] == {"role": "assistant", "content": result.text.rstrip("\ufffd")}
    # The engine is fine afterwards.
    assert session.ask("again").stats.finish_reason in ("stop", "length")


def test_session_context_overflow(engine):
    session = ChatSession(engine, method="vanilla", max_tokens=4)
    with pytest.raises(ContextOverflowError):
        session.ask("the sea " * 400)
    assert session.messages == []      # a refused turn does not join the history


def test_repl_commands_without_a_terminal(engine):
    lines = iter(["", "/help", "hello", "/stats", "/reset", "/stats", "/quit", "never read"])

    def read(prompt: str) -> str:
        assert prompt == PROMPT
        return next(lines)

    session = ChatSession(engine, method="vanilla", max_tokens=8, system=SYSTEM)
    out, err = io.StringIO(), io.StringIO()
    assert run_repl(session, read=read, out=out, err=err) == 0
    assert next(lines) == "never read"
    log = err.getvalue()
    assert "/reset" in log and "conversation cleared" in log
    assert "1 answers" in log and "0 answers" not in log.split("conversation cleared")[0]
    assert STATS_LINE.search(log)
    assert session.messages == [{"role": "system", "content": SYSTEM}]

    def eof(prompt: str) -> str:
        raise EOFError

    transcript = io.StringIO()
    assert run_repl(session, read=eof, out=transcript, err=io.StringIO()) == 0
    assert transcript.getvalue() == ""   # the prompt's line ends where the prompt went, not in the answers


def test_a_byte_order_mark_opening_piped_input_is_not_a_message(engine):
    """'\ufeff/stats' (a Windows editor's file piped in) went to the model as a message."""
    lines = iter(["\ufeff/stats", "/quit"])
    session = ChatSession(engine, method="vanilla", max_tokens=8)
    err = io.StringIO()
    assert run_repl(session, read=lambda prompt: next(lines), out=io.StringIO(), err=err) == 0
    assert "0 answers" in err.getvalue() and session.totals.turns == 0


def test_a_message_that_can_never_fit_says_so_and_one_stopped_before_its_first_token_is_dropped(engine):
    """/reset was offered for a message too long on its own, and for a --system that no turn could fit
    beside; Ctrl-C during a long paste's prefill kept the paste in the conversation (and re-prefilled it)."""
    session = ChatSession(engine, method="vanilla", max_tokens=4)
    with pytest.raises(ContextOverflowError, match="the message has .* shorten it") as exc:
        session.ask("the sea " * 400)
    assert "/reset" not in str(exc.value)
    session.ask("hello")
    kept = list(session.messages)
    with pytest.raises(ContextOverflowError, match="the message has .* shorten it"):   # nothing dropped for it
        session.ask("the sea " * 400)
    assert session.messages == kept
    with pytest.raises(ContextOverflowError, match="the system prompt has .* shorten --system"):
        ChatSession(engine, method="vanilla", system="the sea " * 400).check_system()
    ChatSession(engine, method="vanilla", system=SYSTEM).check_system()
    before = list(session.messages)
    stopped = threading.Event()
    stopped.set()
    result = session.ask("a long paste", cancel=stopped)
    assert result.stats.finish_reason == "cancelled" and not result.tokens
    assert session.messages == before and session.totals.cancelled == 1
    assert "the message was not kept" in session.turn_line(result)   # it said "0 tokens, stopped"


def test_a_conversation_that_outgrows_the_context_drops_its_oldest_turns(engine):
    """An answer that filled the context left every later message refused ("/reset to start over")."""
    from ouroboros_local import chat_cli

    session = ChatSession(engine, method="vanilla", system=SYSTEM, max_tokens=8)
    first = session.ask("Tell me about the sea.")
    session.messages[-1]["content"] = "waves " * 300   # as if the answer had run until the context was full
    session.context_used = session.n_ctx   # prompt and answer fill it
    first.stats.finish_reason = "length"
    assert "the context of 512 tokens is full" in session.turn_line(first)
    second = session.ask("And the boats?")
    assert session.dropped == 2 and "the 2 oldest messages dropped" in session.turn_line(second)
    history = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "And the boats?"}]
    assert session.messages == history + [{"role": "assistant", "content": second.text.rstrip("\ufffd")}]
    assert second.tokens == engine.generate(engine.chat_tokens(history), max_tokens=8).tokens
    drops = 0
    for _ in range(40):   # short turns: whole turns go, the system prompt stays
        answer = session.ask("More, please.")
        assert session.messages[0]["role"] == "system" and session.dropped % 2 == 0   # whole turns
        assert session.context_used + min(8, chat_cli.ANSWER_ROOM) <= session.n_ctx + 8
        if session.dropped:   # half the context freed: the turns after it read only themselves again
            drops += 1
            assert session.context_used - answer.stats.tokens <= session.n_ctx - 1 - session.n_ctx // 2
    # freeing just the next answer's room made every later turn read the whole conversation again
    # (10-18 s a turn, SmolLM2 at 512)
    assert 0 < drops <= 5   # of 40 turns (it was 30)


def test_dropping_turns_renders_the_conversation_a_few_times_and_heeds_a_cancel(engine, monkeypatch):
    """One render per dropped turn: 38 s at 16384 tokens, and Ctrl-C waited for it. A cut answer's
    trailing U+FFFD (no character the model wrote) stayed in every later prompt."""
    session = ChatSession(engine, method="vanilla", max_tokens=4)
    session.messages = [{"role": role, "content": "ab"} for _ in range(200) for role in ("user", "assistant")]
    renders = []
    tokens = session._tokens
    monkeypatch.setattr(session, "_tokens", lambda messages: renders.append(1) or tokens(messages))
    session.ask("cd")
    assert 0 < session.dropped < 400 and len(renders) <= 2 + 2 * 9   # two bisections of 201 cuts
    session.messages = [{"role": role, "content": "ab"} for _ in range(200) for role in ("user", "assistant")]
    before, renders[:] = list(session.messages), []
    stop = threading.Event()
    monkeypatch.setattr(session, "_tokens", lambda messages: renders.append(stop.set()) or tokens(messages))
    result = session.ask("cd", cancel=stop)
    assert result.stats.finish_reason == "cancelled" and session.messages == before and len(renders) <= 3
    session.messages = []
    result = session.ask("cd")
    result.stats.finish_reason, result.text = "length", "ok\ufffd"
    monkeypatch.setattr(engine, "stream", lambda *a, **k: iter([type("E", (), {"text": "", "result": result})]))
    session.ask("ef")
    assert session.messages[-1]["content"] == "ok"


def test_repl_unknown_commands_escapes_and_messages_of_several_lines(engine):
    """A question starting with a path was dropped in silence; there was no way to send several lines."""
    sent: list[str] = []
    lines = iter(["/usr/bin/python3 crashes, why?", "//usr/bin/python3 crashes", '"""first line',
                  "  second line", 'third"""', '"""one line"""', '"""', "/stats", '"""', "/quit"])
    session = ChatSession(engine, method="vanilla", max_tokens=2)
    real_ask = session.ask
    session.ask = lambda text, *a: (sent.append(text), real_ask(text, *a))[1]
    err = io.StringIO()
    assert run_repl(session, read=lambda prompt: next(lines), out=io.StringIO(), err=err) == 0
    assert "unknown command /usr/bin/python3 (not sent; start the message with // to send it)" in err.getvalue()
    assert sent == ["/usr/bin/python3 crashes", "first line\n  second line\nthird", "one line", "/stats"]
    # only an unindented line closes it: pasted code holds docstrings (an indented closing one ended the
    # message, the code after it went out line by line)
    sent.clear()
    lines = iter(['"""', "def f():", '    """Docstring."""', '    """Summary.', "", "    More.", '    """',
                  "    return 1", '"""  ', '"""Review:', "def g():", '    """Return x."""', "    return x", 'done"""',
                  "/quit"])
    assert run_repl(session, read=lambda prompt: next(lines), out=io.StringIO(), err=io.StringIO()) == 0
    assert sent == ['def f():\n    """Docstring."""\n    """Summary.\n\n    More.\n    """\n    return 1',
                    'Review:\ndef g():\n    """Return x."""\n    return x\ndone']


def test_piped_chat_shows_no_prompt_and_takes_bytes_that_are_not_utf8(tiny_target, tmp_path):
    """Piped, '>>> ' went into the answers on stdout; a strict stdin (any UTF-8 locale but C.UTF-8)
    ended the chat with a traceback at the first byte that was not UTF-8."""
    import subprocess

    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "PYTHONIOENCODING": "utf-8", "OUROBOROS_CALIBRATION_FILE": str(tmp_path / "c.json"),
           "OUROBOROS_ESTIMATES_FILE": str(tmp_path / "e.json")}
    run = subprocess.run([sys.executable, "-m", "ouroboros_local.cli", "chat", "-m", str(tiny_target), "-c", "512",
                          "-t", "1", "-n", "4", "--method", "vanilla"], input=b"Hello caf\xe9\nhi\n", env=env,
                         capture_output=True, timeout=120)
    err = run.stderr.decode()
    assert run.returncode == 1 and "Traceback" not in err, err   # 1: a piped message was refused
    assert "error: the text is not valid Unicode: it holds the byte 0xe9" in err
    assert len(STATS_LINE.findall(err)) == 1 and PROMPT not in run.stdout.decode()
    bad = subprocess.run([sys.executable, "-m", "ouroboros_local.cli", "chat", "-m", str(tmp_path / "none.gguf"),
                          "--system", b"caf\xe9".decode("utf-8", "surrogateescape")], env=env, capture_output=True,
                         timeout=60, stdin=subprocess.DEVNULL)
    assert bad.returncode == 2 and b"--system: the text is not valid Unicode" in bad.stderr, bad.stderr


def test_piped_messages_lose_their_windows_line_ends(monkeypatch) -> None:
    """POSIX stdin kept each "\\r" of a CRLF file piped to chat, and it reached the model as a token; a
    lone "\\r" split a message in two, where a prompt file keeps it."""
    import io

    from ouroboros_local import chat_cli

    monkeypatch.delenv("PYTHONIOENCODING", raising=False)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO("Café\r\nsay A\rsay B\n".encode()),
                                                       encoding="ascii", newline="\n"))
    read, prompt = chat_cli._terminal_reader()
    assert prompt == "" and read(prompt) == "Café" and read(prompt) == "say A\rsay B"


def test_piped_messages_are_utf8_whatever_the_locale(tiny_target, tmp_path):
    """Windows reads a pipe in its code page: `chat < questions.txt` sent "CafÃ©" for "Café" (here an
    ASCII locale refused it); `generate -f -` reads the same bytes as UTF-8."""
    import subprocess

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONIOENCODING", "PYTHONUTF8")}
    env.update({"PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), "LC_ALL": "C",
                "PYTHONCOERCECLOCALE": "0", "PYTHONUTF8": "0", "OUROBOROS_CALIBRATION_FILE": str(tmp_path / "c.json"),
                "OUROBOROS_ESTIMATES_FILE": str(tmp_path / "e.json")})
    run = subprocess.run([sys.executable, "-m", "ouroboros_local.cli", "chat", "-m", str(tiny_target), "-c", "512",
                          "-t", "1", "-n", "4", "--method", "vanilla"], input="Hello café ✓\n".encode(), env=env,
                         capture_output=True, timeout=120)
    err = run.stderr.decode()
    assert run.returncode == 0 and "not valid Unicode" not in err, err
    assert len(STATS_LINE.findall(err)) == 1


# ---- the real CLI in a pseudo-terminal ----------------------------------------------------------
try:
    import pexpect
except ImportError:  # pragma: no cover
    pexpect = None
needs_pty = pytest.mark.skipif(pexpect is None or not hasattr(os, "openpty"),
                               reason="needs pexpect and a POSIX pseudo-terminal")


def _spawn(model: Path, *extra: str):
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "TERM": "dumb", "PYTHONUNBUFFERED": "1"}
    args = ["-m", "ouroboros_local.cli", "chat", "-m", str(model), "-c", "2048", "-b", "64", "-t", "1",
            "--method", "vanilla", *extra]
    child = pexpect.spawn(sys.executable, args, env=env, encoding="utf-8", codec_errors="replace", timeout=60,
                          dimensions=(40, 200))
    child.expect_exact("chatting with")
    child.expect_exact(PROMPT)
    return child


def _long_answer_prompt(model: Path) -> str:
    """A first message whose greedy answer does not end within 80 tokens (the model is random)."""
    with Engine(Model(model), None, EngineConfig(n_ctx=2048, n_batch=64, n_seq_max=4, threads=1)) as eng:
        for text in ("hi", "Hello", "Write some code", "Why?", "ok", "Tell me more"):
            msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}]
            if eng.generate(chat_tokens(eng, msgs), max_tokens=80).stats.finish_reason == "length":
                return text
    pytest.skip("no candidate prompt gives a long answer with this random model")


@needs_pty
def test_chat_in_a_pty_ctrl_c_stops_the_answer(tmp_path_factory):
    model = slow_chat_model(tmp_path_factory)
    prompt = _long_answer_prompt(model)
    child = _spawn(model, "--system", SYSTEM, "-n", "1500")
    try:
        child.sendline(prompt)
        child.expect_exact(prompt)                     # the terminal echo
        child.expect(r"\S")                            # streamed answer text arrives ...
        time.sleep(0.3)
        t0 = time.monotonic()
        child.sendintr()                               # ... Ctrl-C in the middle of it
        child.expect(r"\[vanilla\] (\d+) tokens, [\d.]+ tok/s[^\r\n]*stopped", timeout=20)
        stopped_after = time.monotonic() - t0
        n_tokens = int(child.match.group(1))
        assert 0 < n_tokens < 1500
        child.expect_exact(PROMPT)                     # back at the prompt, not quit
        assert child.isalive()

        child.sendline("/stats")
        child.expect(r"1 answers \(1 stopped\)")
        child.expect_exact(PROMPT)

        child.sendline("/reset")
        child.expect_exact("conversation cleared")
        child.expect_exact(PROMPT)

        child.sendline("What is the weather?")       # a full answer afterwards (capped by -n)
        child.expect(r"\[vanilla\] \d+ tokens, [\d.]+ tok/s[^\r\n]*", timeout=60)
        assert "stopped" not in child.match.group(0)
        child.expect_exact(PROMPT)

        child.sendeof()                                # Ctrl-D quits
        child.expect(pexpect.EOF, timeout=30)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0, (child.exitstatus, child.signalstatus)
    print(f"Ctrl-C stopped the answer after {n_tokens} tokens, {stopped_after:.2f}s to the stats line")


@needs_pty
def test_chat_in_a_pty_ctrl_c_at_the_prompt_quits(tiny_target):
    child = _spawn(tiny_target, "-n", "8")
    try:
        child.sendline("hello")
        child.expect(r"\[vanilla\] \d+ tokens")
        child.expect_exact(PROMPT)
        child.sendintr()                       # one Ctrl-C (a late "stop the answer") keeps the session
        child.expect_exact("Ctrl-C again")
        child.expect_exact(PROMPT)
        child.sendintr()                       # the second one in a row leaves
        child.expect(pexpect.EOF, timeout=30)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0, (child.exitstatus, child.signalstatus)


@needs_pty
def test_chat_measures_before_the_first_prompt_where_ctrl_c_quits(tmp_path_factory, tmp_path):
    """The first calibration (seconds to a minute) once ran inside the first answer, where Ctrl-C only
    asks the answer to stop: it went unheeded until the measurement ended. It runs before the prompt now."""
    model = slow_chat_model(tmp_path_factory)   # its calibration takes a second or more: time for Ctrl-C
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "TERM": "dumb", "PYTHONUNBUFFERED": "1", "OUROBOROS_CALIBRATION_FILE": str(tmp_path / "costs.json")}
    args = ["-m", "ouroboros_local.cli", "chat", "-m", str(model), "-c", "2048", "-b", "64", "-t", "1",
            "--method", "prompt-lookup"]
    child = pexpect.spawn(sys.executable, args, env=env, encoding="utf-8", codec_errors="replace", timeout=60)
    try:
        child.expect_exact("measuring this machine's verify cost")
        child.sendintr()
        child.expect(pexpect.EOF, timeout=30)
        assert "chatting with" not in child.before
    finally:
        child.close(force=True)
    assert child.exitstatus == 130, (child.exitstatus, child.signalstatus)


@needs_pty
def test_chat_in_a_pty_quit_command(tiny_target):
    child = _spawn(tiny_target, "-n", "8", "--system", "Be brief.")
    try:
        child.sendline("/quit")
        child.expect(pexpect.EOF, timeout=30)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0


def test_a_chat_answer_may_fill_the_context_as_generate_and_the_server_let_it(tiny_target):
    """The chat kept one cell free: a message of n_ctx - 1 tokens was refused (generate answers it with a
    token), and with k cells left it answered k - 1 tokens, saying the context was full."""
    from ouroboros_local.testing.engines import tiny_engine

    with tiny_engine(tiny_target, n_ctx=256) as eng:
        words = "The quick brown fox jumps over the lazy dog. " * 30
        by_room = {}
        for n in range(len(words), 0, -1):
            room = 256 - len(eng.chat_tokens([{"role": "user", "content": words[:n]}]))
            by_room.setdefault(room, words[:n])
            if room > 3:
                break
        for room in (1, 3):
            message = by_room[room]
            plain = eng.generate(eng.chat_tokens([{"role": "user", "content": message}]), max_tokens=1000)
            session = ChatSession(eng, method="vanilla")
            answer = session.ask(message)
            assert answer.tokens == plain.tokens and len(answer.tokens) <= room, room
            if answer.stats.finish_reason == "length":
                assert "the context of 256 tokens is full" in session.turn_line(answer)
        with pytest.raises(ContextOverflowError, match="a prompt of at most 255 and a token of answer"):
            ChatSession(eng, method="vanilla").ask(words)


def test_piped_ctrl_c_ends_the_chat_and_ends_the_answers_line(engine, monkeypatch):
    """Piped, each Ctrl-C only stopped an answer or dropped the next message, and the chat answered the
    rest and exited 0; a SIGTERM mid-answer left its line open for the next output."""
    lines = iter(["hello", "never read"])

    def interrupt_at_read(prompt: str) -> str:
        raise KeyboardInterrupt

    session = ChatSession(engine, method="vanilla", max_tokens=8)
    with pytest.raises(KeyboardInterrupt):   # the command line says "interrupted" and exits 130
        run_repl(session, read=interrupt_at_read, prompt="", out=io.StringIO(), err=io.StringIO())
    real_ask = session.ask

    def ended_mid_answer(message, on_text, cancel):
        real_ask(message, lambda text: on_text(text.replace("\n", " ") or "x"), cancel)
        raise SystemExit(143)   # as SIGTERM's handler does during a generation

    monkeypatch.setattr(session, "ask", ended_mid_answer)
    out = io.StringIO()
    with pytest.raises(SystemExit):
        run_repl(session, read=lambda prompt: next(lines), prompt="", out=out, err=io.StringIO())
    assert out.getvalue().endswith("\n") and next(lines) == "never read"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler   # piped: never swapped
