"""Typed method options: one parser for the API, the CLI and the server; every value is checked (type,
bounds, known name) before a proposer allocates anything."""

from __future__ import annotations

import math
import random
import resource

import pytest

from ouroboros_local import options as opt
from ouroboros_local.cli import build_parser, _method_options
from ouroboros_local.engine import Engine, EngineConfig
from ouroboros_local.errors import MethodOptionError, OuroborosError, ParameterError
from ouroboros_local.llama import Model
from ouroboros_local.proposers import (applicable_options, check_options, create_proposer, method_names,
                                       method_options)

PROMPT = "one two three four five one two three four five one two three"


@pytest.fixture(scope="module")
def engine(tiny_target, tiny_draft):
    eng = Engine(Model(tiny_target), Model(tiny_draft),
                 EngineConfig(n_ctx=256, n_batch=64, n_seq_max=8, threads=1, threads_batch=1, calibration="off"))
    eng.check_kv = True
    yield eng
    eng.close()


def test_every_method_declares_typed_options():
    for method in method_names():
        for option in method_options(method):
            assert option.kind in ("int", "float", "bool", "choice", "path", "int_or_auto"), (method, option)
            if option.kind in ("int", "float"):
                assert option.lo is not None and option.hi is not None, f"{method}.{option.name} is unbounded"
    assert method_options("vanilla") == ()


def test_parse_fills_defaults_and_converts():
    got = check_options("lookahead", {"window": 6.0, "level": 5, "guess_set": 8})
    assert (got["window"], got["level"], got["guess_set"]) == (6, 5, 8)
    assert isinstance(got["window"], int)
    assert got["harvest"] == "none" and got["pool"] is None
    assert check_options("lookahead", {"ngram": 4, "guess": 2})["level"] == 4      # old names still work
    assert check_options("speculative", {"adaedl": "true"})["adaedl"] is True


def test_numpy_numbers_are_options_as_they_are_counts():
    """max_tokens and the sampler settings took numpy's numbers; a method's options refused them."""
    import numpy as np

    got = check_options("speculative", {"gamma": np.int64(5), "p_min": np.float32(0.25)})
    assert (got["gamma"], got["p_min"]) == (5, 0.25) and type(got["gamma"]) is int and type(got["p_min"]) is float
    assert check_options("lookahead", {"window": np.float64(6.0)})["window"] == 6
    for bad in ({"gamma": np.True_}, {"gamma": np.float32(2.5)}, {"p_min": np.float64("nan")}):
        with pytest.raises(MethodOptionError):
            check_options("speculative", bad)


@pytest.mark.parametrize("method,options,words", [
    ("lookahead", {"window": 100000}, "'window' must be between 1 and 64"),
    ("lookahead", {"window": 2.5}, "'window' must be an integer"),
    ("lookahead", {"window": True}, "'window' must be an integer"),
    ("prompt-lookup", {"max_ngram": 10**9}, "'max_ngram' must be between"),
    # every size up to it is indexed at every position; 64 took 400 MB more on a 16k-token prompt
    ("prompt-lookup", {"max_ngram": 17}, "'max_ngram' must be between 1 and 16"),
    ("prompt-lookup", {"windoww": 3}, "prompt-lookup has no option 'windoww'"),
    ("speculative", {"p_min": math.nan}, "'p_min' must be a finite number"),
    ("speculative", {"gamma": "many"}, "'gamma' must be an integer"),
    ("ouroboros", {"harvest": "everything"}, "'harvest' must be one of"),
    ("ouroboros", {"level": 2}, "'level' must be between 3 and 16"),
    ("ouroboros", {"pool": 5}, "'pool' must be a file path"),
    ("vanilla", {"gamma": 4}, "vanilla has no option 'gamma'"),
    ("auto", {"adaptive": False}, "auto is the scheduler itself"),
    # declared 1..64, then refused by pearl itself after the models loaded
    ("pearl", {"gamma": 1}, "'gamma' must be between 2 and 64"),
])
def test_bad_options_are_refused_with_their_name(method, options, words):
    with pytest.raises(MethodOptionError, match=words.replace("(", r"\(").replace(")", r"\)")):
        check_options(method, options)


def test_pool_cannot_be_set_per_request():
    with pytest.raises(MethodOptionError, match="cannot be set per request"):
        check_options("ouroboros", {"pool": "/tmp/x.pool"}, per_request=True)
    assert check_options("ouroboros", {"pool": "/tmp/x.pool"})["pool"] == "/tmp/x.pool"


def test_applicable_options_keeps_what_the_method_has():
    shared = {"gamma": 4, "window": 8, "pool": "p"}
    assert applicable_options("speculative", shared) == {"gamma": 4}
    assert applicable_options("lookahead", shared) == {"window": 8, "pool": "p"}
    assert applicable_options("vanilla", shared) == {}


def test_cli_flags_come_from_the_definitions():
    args = build_parser().parse_args(["generate", "-p", "x", "--method", "lookahead", "--level", "5",
                                      "--guess-set", "8", "--window", "3", "--pearl-mode", "sequential"])
    assert _method_options(args) == {"level": 5, "guess_set": 8, "window": 3, "mode": "sequential"}
    flags = {o.flag_name for o in opt.ALL if o.flag}
    assert {"--gamma", "--window", "--level", "--guess-set", "--topk", "--max-ngram", "--p-min", "--pool",
            "--adaedl", "--adaedl-lambda", "--pearl-mode"} <= flags


def test_method_help_names_every_registered_method():
    generate = build_parser()._subparsers._group_actions[0].choices["generate"]
    help_text = " ".join(generate.format_help().split("--method METHOD", 2)[2].split())
    named = {word.strip() for word in help_text.split("(")[0].split("|")}
    assert named == set(method_names())


@pytest.mark.parametrize("command", ["generate", "chat", "serve"])
@pytest.mark.parametrize("flags, message", [
    (["--method", "nosuch"], "unknown method 'nosuch'"),
    # in flags' words: it said "no option 'p_min' (its options: adaptive, feed_pool, ...)", flags or not
    (["--method", "vanilla", "--gamma", "3"], "--gamma does not apply to --method vanilla (it takes no method"),
    (["--method", "lookahead", "--window", "999"], "option 'window' must be between"),
    (["--pool", "/no/such/folder/h.pool"], "/no/such/folder is not a writable folder"),
    (["--method", "speculative"], "speculative needs a draft model: -d DRAFT"),
    (["--method", "pearl"], "pearl needs a draft model: -d DRAFT"),
    # bounds that only the method itself checked, after the models loaded
    (["--method", "lookahead", "--window", "0"], "option 'window' must be between 1 and 64"),
    (["-d", "draft.gguf", "--method", "speculative", "--adaedl", "--adaedl-lambda", "1"],
     "option 'adaedl_lambda' must be in [0, 1) (got 1.0)"),
    # it was silently ignored
    (["-d", "draft.gguf", "--method", "speculative", "--adaedl-lambda", "0.5"],
     "adaedl_lambda tunes AdaEDL, which is off: add adaedl=true (--adaedl)"),
])
def test_a_bad_method_option_or_pool_folder_is_refused_before_a_model_loads(
        command: str, flags: list[str], message: str, tmp_path, capsys) -> None:
    """Found only after the weights loaded (minutes for a large model; the pool folder in chat and serve
    even after the first calibration; a missing draft model after the target's)."""
    from ouroboros_local.cli import main

    if command == "serve":
        pytest.importorskip("uvicorn")
        if flags[:2] == ["--method", "vanilla"]:
            message = "must be between"     # serve gives a flag to the methods that have it: --gamma 0
            flags = ["--method", "vanilla", "--gamma", "0"]
    argv = [command, "-m", str(tmp_path / "no-model.gguf"), *flags]
    if command == "generate":
        argv += ["-p", "hi"]
    if command == "serve":
        argv += ["--port", "0"]
    assert main(argv) != 0
    err = capsys.readouterr().err
    assert message in err and "no-model.gguf" not in err


def test_a_flag_of_another_method_is_named_with_the_methods_own_flags(tmp_path, capsys) -> None:
    from ouroboros_local.cli import main

    argv = ["generate", "-m", str(tmp_path / "no-model.gguf"), "-p", "hi", "--method", "prompt-lookup"]
    assert main([*argv, "--p-min", "0.5", "--window", "4"]) == 2
    assert "--window, --p-min do not apply to --method prompt-lookup (its flags: --gamma, --max-ngram, --pool)" \
        in capsys.readouterr().err


def test_a_server_refuses_adaedl_settings_without_adaedl_at_start(tmp_path, capsys) -> None:
    """Its default method has no AdaEDL: each speculative request would have been refused instead."""
    pytest.importorskip("uvicorn")
    from ouroboros_local.cli import main

    assert main(["serve", "-m", str(tmp_path / "no-model.gguf"), "-d", "d.gguf", "--adaedl-lambda", "0.5",
                 "--port", "0"]) == 2
    assert "adaedl_lambda tunes AdaEDL, which is off" in capsys.readouterr().err


def test_a_requests_adaedl_setting_takes_the_servers_adaedl_switch() -> None:
    """A request's adaedl_lambda on a server started with --adaedl was refused as if AdaEDL were off."""
    from ouroboros_local.server.protocol import ApiError, method_and_options

    body = {"method": "speculative", "method_options": {"adaedl_lambda": 0.3}}
    method, options, _ = method_and_options(body, "auto", {"adaedl": True})
    assert options["adaedl"] is True and options["adaedl_lambda"] == 0.3
    with pytest.raises(ApiError, match="adaedl_lambda tunes AdaEDL, which is off"):
        method_and_options(body, "auto", {})


def test_a_servers_option_another_method_cannot_take_is_left_to_that_methods_default() -> None:
    """serve --method speculative --gamma 1: every request for pearl (gamma 2-64) heard a 400 blaming its
    method_options, which it had not given."""
    from ouroboros_local.server.protocol import ApiError, method_and_options

    method, options, _ = method_and_options({"method": "pearl"}, "speculative", {"gamma": 1, "adaedl": False})
    assert method == "pearl" and "gamma" not in options
    assert method_and_options({}, "speculative", {"gamma": 1})[1]["gamma"] == 1
    with pytest.raises(ApiError, match="gamma"):   # a request's own value is still checked
        method_and_options({"method": "pearl", "method_options": {"gamma": 1}}, "speculative", {"gamma": 1})
    # a draft of another vocabulary: the server's p_min refused every speculative request
    other = (False, "the vocabularies differ")
    _, options, _ = method_and_options({"method": "speculative"}, "vanilla", {"p_min": 0.3}, pair=other)
    assert "p_min" not in options
    same = (True, None)
    assert method_and_options({"method": "speculative"}, "vanilla", {"p_min": 0.3}, pair=same)[1]["p_min"] == 0.3
    # a server limit that clashes with a request's own value gives way (min_ngram 3 under --max-ngram 2)
    _, options, _ = method_and_options({"method": "prompt-lookup", "method_options": {"min_ngram": 3}}, "auto",
                                       {"max_ngram": 2})
    assert options == {"min_ngram": 3}
    # a request that turns the switch off drops the server's tuning of it (it was told to add adaedl=true)
    server = {"adaedl": True, "adaedl_lambda": 0.5}
    _, options, _ = method_and_options({"method": "speculative", "method_options": {"adaedl": False}}, "auto", server)
    assert options == {"adaedl": False}
    with pytest.raises(ApiError, match="adaedl_lambda tunes AdaEDL"):   # the request's own tuning: its error
        method_and_options({"method": "speculative", "method_options": {"adaedl": False, "adaedl_lambda": 0.4}},
                           "auto", server)


def test_an_option_a_pair_of_two_vocabularies_refuses_is_the_requests_method_options() -> None:
    from ouroboros_local.errors import IncompatiblePairError
    from ouroboros_local.proposers.cross_vocab import refuse_ignored
    from ouroboros_local.server.protocol import engine_error

    with pytest.raises(IncompatiblePairError) as caught:
        refuse_ignored({"adaedl": True}, "the vocabularies differ")
    assert engine_error(caught.value, user_options=True).param == "method_options"   # it said "method"
    assert engine_error(IncompatiblePairError("pearl needs ..."), user_options=True).param == "method"


def test_lookahead_level_and_guess_set_change_what_it_does(engine):
    base = engine.generate(PROMPT, max_tokens=12, method="lookahead")
    tuned = engine.generate(PROMPT, max_tokens=12, method="lookahead", options={"level": 5, "guess_set": 8})
    assert tuned.tokens == base.tokens                       # lossless either way
    proposer = create_proposer("lookahead", engine.drafting_context(), {"level": 5, "guess_set": 8})
    assert (proposer.N, proposer.G) == (5, 8)                # the flags reach the window (they once did not)
    assert proposer.n_extras > create_proposer("lookahead", engine.drafting_context(), {}).n_extras


def test_a_request_is_told_only_the_options_it_may_set() -> None:
    """A server's request heard "its options: ..., pool, ..." and then, sending pool, that it cannot set it."""
    from ouroboros_local.proposers import check_options

    def listed(method: str, options: dict, **kw) -> list[str]:
        with pytest.raises(MethodOptionError) as exc:
            check_options(method, options, **kw)
        return str(exc.value).split("its options: ")[1].rstrip(")").split(", ")

    assert "pool" not in listed("lookahead", {"gamma": 3}, per_request=True)
    assert "window" in listed("lookahead", {"gamma": 3}, per_request=True)
    assert "max_requests" not in listed("suffix", {"nope": 3}, per_request=True)
    assert "pool" in listed("lookahead", {"gamma": 3})   # the API's own call may set it: it is listed


def test_unknown_option_through_the_engine_is_one_line(engine):
    with pytest.raises(MethodOptionError) as exc:
        engine.generate(PROMPT, max_tokens=2, method="lookahead", options={"gamma": 3})
    assert "\n" not in str(exc.value) and "lookahead has no option 'gamma'" in str(exc.value)
    for bad in ("ab", 5, [("gamma", 3)]):   # a ValueError, a TypeError, and a list taken as a dict
        with pytest.raises(MethodOptionError, match="options must be a dict of option names and values"):
            engine.generate(PROMPT, max_tokens=2, method="prompt-lookup", options=bad)


@pytest.mark.parametrize("method", ["speculative", "pearl"])
def test_a_method_that_needs_a_draft_says_so_through_the_engine(tiny_target, method):
    """Once told the API user to pass -d/--draft, and with options given called it a bad option."""
    with Engine(Model(tiny_target), None, EngineConfig(n_ctx=256, n_batch=64, threads=1, threads_batch=1,
                                                       calibration="off")) as eng:
        for options in (None, {"gamma": 3}):
            with pytest.raises(ParameterError) as exc:
                eng.generate(PROMPT, max_tokens=2, method=method, options=options)
            assert not isinstance(exc.value, MethodOptionError)
            assert f"{method} needs a draft model: Engine.load(TARGET, DRAFT)" in str(exc.value)
        assert eng.generate(PROMPT, max_tokens=2, method="prompt-lookup").tokens   # still usable


EXTREMES = [0, 1, -1, 3, 64, 65, 10**9, -10**9, 2**70, 0.5, 1e308, -1e308, math.inf, math.nan, True, False,
            "", "x", "auto", "none", [1], {"a": 1}, None]


def _max_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def test_randomized_extreme_values_stay_bounded(engine, tmp_path):
    """Extreme and ill-typed values at every option of every method: each generation either runs or is
    refused with a one-line error, and the process's memory stays bounded."""
    rng = random.Random(15)
    cases = [(m, o, v) for m in method_names() for o in method_options(m) for v in EXTREMES]
    rng.shuffle(cases)
    before = _max_rss_mib()
    ran = refused = 0
    for method, option, value in cases[:400]:
        if option.kind == "path" and isinstance(value, str) and value:
            value = str(tmp_path / f"{method}-{value}.pool")
        try:
            result = engine.generate(PROMPT, max_tokens=3, method=method, options={option.name: value})
        except OuroborosError as exc:
            assert "\n" not in str(exc), (method, option.name, value)
            refused += 1
            continue
        assert result.stats.tokens <= 3
        ran += 1
    engine.history.clear()
    assert ran > 40 and refused > 50, (ran, refused)   # (AdaEDL settings alone are refused: adaedl is off)
    assert _max_rss_mib() - before < 300, "an option value made the process allocate far too much"


def test_text_files_read_from_pipes_and_fail_in_one_line(tmp_path) -> None:
    import os

    from ouroboros_local.errors import ParameterError
    from ouroboros_local.text_input import read_text

    read_fd, write_fd = os.pipe()          # what <(...) and /dev/stdin name: not a regular file
    os.write(write_fd, "héllo".encode())
    os.close(write_fd)
    assert read_text(f"/dev/fd/{read_fd}") == "héllo"
    os.close(read_fd)
    with pytest.raises(ParameterError, match="is a directory"):
        read_text(tmp_path)
    with pytest.raises(ParameterError, match="not found"):
        read_text(tmp_path / "missing.txt")


def test_a_console_in_another_encoding_gets_one_line_not_a_traceback(tmp_path) -> None:
    """On a cp1252 console (PYTHONIOENCODING or a Windows code page) a path or a generated character
    outside it raised UnicodeEncodeError while printing; JSON falls back to \\u escapes."""
    import io
    import subprocess
    import sys

    from ouroboros_local import cli

    missing = tmp_path / "日本.txt"
    run = subprocess.run([sys.executable, "-m", "ouroboros_local", "generate", "-f", str(missing)],
                         capture_output=True, env={**__import__("os").environ, "PYTHONIOENCODING": "cp1252"})
    assert run.returncode == 2 and b"Traceback" not in run.stderr, run.stderr.decode("cp1252", "replace")
    assert b"prompt file not found" in run.stderr

    console = io.TextIOWrapper(io.BytesIO(), encoding="cp1252")
    old = sys.stdout
    sys.stdout = console
    try:
        cli.print_json({"text": "日本 café"})
        console.flush()
    finally:
        sys.stdout = old
    assert console.buffer.getvalue().decode("ascii").strip() == '{"text": "\\u65e5\\u672c caf\\u00e9"}'


def test_a_redirected_answer_is_utf8_whatever_the_code_page(monkeypatch) -> None:
    """Windows gives a redirected stdout its code page: `generate > answer.txt` kept a '?' for every
    character outside cp1252. A file or pipe now gets UTF-8 (as llama.cpp writes it); a terminal, or an
    encoding the user set (PYTHONIOENCODING), keeps its encoding with '?' for what it cannot show."""
    import io
    import sys

    from ouroboros_local import cli

    class Terminal(io.BytesIO):
        def isatty(self) -> bool:
            return True

    def printed(raw: io.BytesIO) -> bytes:
        stream = io.TextIOWrapper(raw, encoding="cp1252")
        monkeypatch.setattr(sys, "stdout", stream)
        monkeypatch.setattr(sys, "stderr", io.TextIOWrapper(io.BytesIO(), encoding="utf-8"))
        cli.tolerate_console_encoding()
        print("α → β")
        stream.flush()
        return raw.getvalue()

    monkeypatch.setattr(cli, "_ascii_json", False)
    monkeypatch.delenv("PYTHONIOENCODING", raising=False)
    assert printed(io.BytesIO()) == "α → β\n".encode()
    assert printed(Terminal()) == b"? ? ?\n"
    monkeypatch.setenv("PYTHONIOENCODING", "cp1252")
    assert printed(io.BytesIO()) == b"? ? ?\n"
    # the JSON line keeps its escapes (a reader may decode the pipe in the code page), and a path's
    # undecodable byte (a surrogate escape) is shown, not fatal: a new encoding alone made errors strict
    monkeypatch.delenv("PYTHONIOENCODING")
    monkeypatch.setattr(cli, "_ascii_json", False)
    out, err = io.BytesIO(), io.BytesIO()
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(out, encoding="ascii"))
    monkeypatch.setattr(sys, "stderr", io.TextIOWrapper(err, encoding="ascii", errors="backslashreplace"))
    cli.tolerate_console_encoding()
    cli.print_json({"text": "ñ"})
    print("error: not found: /tmp/x\udce9.txt", file=sys.stderr)
    print("x\udce9", flush=True)
    sys.stderr.flush()
    assert out.getvalue() == b'{"text": "\\u00f1"}\nx?\n'
    assert err.getvalue() == b"error: not found: /tmp/x\\udce9.txt\n"


def test_command_line_mistakes_are_one_line_and_status_2(tiny_target, tmp_path, capsys) -> None:
    """A usage error printed argparse's usage block (24 lines); abbreviations resolved in surprising ways
    (`bench --warm` was --warm-prefill); an empty --method ran the default; auto's draft flags without a
    draft did nothing; a file name past the system's limit was a raw OS error with status 1; doctor
    took values generate refuses; --main-gpu -1 was refused in EngineConfig's words."""
    from ouroboros_local import cli

    def refused(argv: list[str]) -> str:
        with pytest.raises(SystemExit) as exit_:
            status = cli.main(argv)
            raise SystemExit(status)
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and "Traceback" not in err, err
        return err

    base = ["generate", "-m", str(tiny_target), "-p", "hi", "-n", "2", "-t", "1"]
    err = refused(base + ["--temperature", "0,5"])
    assert err.count("\n") == 1 and "invalid float value: '0,5' (see ouroboros-local generate --help)" in err
    assert "unrecognized arguments: --temper" in refused(base + ["--temper", "0.5"])
    assert "--method is empty" in refused(base + ["--method", ""])
    assert "--adaedl sets how a draft model drafts, and --method auto has none here" in refused(base + ["--adaedl"])
    ouroboros = base + ["--method", "ouroboros", "--window", "8", "--topk", "5", "--guess-set", "9"]
    assert "--window, --topk set how a draft model drafts, and --method ouroboros has none" in refused(ouroboros)
    long_name = str(tmp_path / ("m" * 300 + ".gguf"))
    assert "File name too long" in refused(["generate", "-m", long_name, "-p", "hi"])
    assert "File name too long" in refused(base + ["--pool", str(tmp_path / ("p" * 300))])
    doctor = ["doctor", "-m", str(tiny_target)]
    assert "--batch-size must be from 1" in refused(doctor + ["-b", "-1"])
    assert "--main-gpu must be >= 0: a GPU's index" in refused(doctor + ["--main-gpu", "-1"])
    assert "--round-size must be" in refused(doctor + ["--round-size", "1"])


def test_windows_line_ends_in_a_prompt_are_read_as_newlines(tmp_path, monkeypatch) -> None:
    """Notepad's CRLF reached the model as a "\r" token per line, and SmolLM2 answered in kind."""
    import io
    import sys

    from ouroboros_local.text_input import read_stdin, read_text

    crlf = tmp_path / "prompt.txt"
    crlf.write_bytes(b"\xef\xbb\xbfdef f():\r\n    return 1\r\n")
    assert read_text(crlf) == "def f():\n    return 1\n"
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"a\r\nb\rc")))
    assert read_stdin() == "a\nb\rc"   # a lone carriage return is left as it is


def test_a_utf16_or_utf32_prompt_file_is_read_by_its_byte_order_mark(tmp_path) -> None:
    """PowerShell 5.1's ">" writes UTF-16: it was refused with advice (iconv from latin1) that made a prompt
    of mojibake and NULs."""
    from ouroboros_local.text_input import read_text

    text = "def café():\r\n    return '✓'\n"
    for codec in ("utf-16", "utf-16-be", "utf-32", "utf-32-be"):
        path = tmp_path / f"{codec}.txt"
        path.write_bytes(("\ufeff" if codec.endswith("-be") else "").encode(codec) + text.encode(codec))
        assert read_text(path) == "def café():\n    return '✓'\n", codec
    broken = tmp_path / "broken.txt"
    broken.write_bytes(b"\xff\xfeA")   # a UTF-16 mark, then half a code unit
    with pytest.raises(ParameterError, match="not UTF-16 text, though it starts with that byte-order mark"):
        read_text(broken)


def test_context_flags_are_bounded_and_a_context_past_training_is_named(tiny_target, capsys) -> None:
    """-c 2**32+512 ran with 512 cells, -b 2**32+2 aborted in llama.cpp, --round-size past the context said
    'the context is full' for a one-token prompt; a context past the trained one went unmentioned."""
    from ouroboros_local.cli import main

    base = ["generate", "-m", str(tiny_target), "-t", "1", "-p", "hi", "-n", "2", "--quiet"]
    assert main(base + ["-c", str(2**32 + 512)]) == 2
    assert "--ctx-size must be from 1 to 16777216" in capsys.readouterr().err
    assert main(base + ["-c", "512", "-b", str(2**32 + 2)]) == 2
    assert "--batch-size must be from 1 to" in capsys.readouterr().err
    assert main(base + ["-c", "512", "-b", "1000", "--round-size", "513"]) == 2
    assert "--round-size must be auto, 0 or 2 to 512" in capsys.readouterr().err
    assert main(base + ["-c", "4096"]) == 0                   # the tiny model was trained on 2048
    assert "more than the 2048 the model was trained on" in capsys.readouterr().err


def test_an_answer_cut_by_the_context_says_so(tiny_target, capsys) -> None:
    """-n past what the context leaves stopped the answer there without a word."""
    from ouroboros_local.cli import main

    # a prompt that leaves the answer a few cells, so that it meets the end of the context before an end token
    base = ["generate", "-m", str(tiny_target), "-t", "1", "-p", "hello " * 60, "-c", "256", "--quiet"]
    assert main(base + ["-n", "1000"]) == 0
    err = capsys.readouterr().err
    assert "of the 1000 tokens asked: the context of 256 tokens is full" in err
    assert main(base + ["-n", "8"]) == 0
    assert "tokens asked" not in capsys.readouterr().err


def test_ctrl_c_as_the_command_line_starts_is_one_line(monkeypatch, capsys) -> None:
    """Ctrl-C in the first half second (numpy's import for the package, every command's module for the
    parser) was a traceback: the package now imports nothing heavy, and main hears Ctrl-C from its start."""
    import subprocess
    import sys

    from ouroboros_local import cli

    def interrupted() -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "build_parser", interrupted)
    assert cli.main(["generate", "-p", "hi"]) == 130
    assert capsys.readouterr().err == "interrupted\n"
    code = "import sys, ouroboros_local.cli; print(sorted({'numpy', 'llama_cpp'} & set(sys.modules)))"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.stdout.strip() == "[]", run.stdout + run.stderr


def test_output_and_input_that_fail_are_one_line(tiny_target) -> None:
    """A full disk under stdout, a closed stdout or stdin: tracebacks (OSError, AttributeError on None)."""
    import os
    import subprocess
    import sys

    cmd = f"{sys.executable} -m ouroboros_local generate -m {tiny_target} -t 1 -c 256 -n 4"
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    for shell, rc, message in ((f"{cmd} -p hi > /dev/full", 1, "No space left on device (standard output)"),
                               (f"{cmd} -p hi --json --quiet > /dev/full", 1, "device (standard output)"),
                               (f"{cmd} -p hi >&-", 0, ""),
                               (f"{cmd} -f - <&-", 2, "stdin is closed")):
        run = subprocess.run(["sh", "-c", shell], capture_output=True, text=True, env=env, timeout=120)
        assert run.returncode == rc and "Traceback" not in run.stderr and message in run.stderr, (shell, run.stderr)


def test_text_inputs_and_prompts_are_bounded(tiny_target, tmp_path, monkeypatch, capfd) -> None:
    """/dev/zero or `yes` as a prompt filled the memory; a prompt far past the context became a list of
    Python ints first (a 21 MB file took 1.2 GB); OUROBOROS_VERBOSE=0 turned llama.cpp's log on."""
    from ouroboros_local import text_input
    from ouroboros_local.errors import ContextOverflowError, ParameterError
    from ouroboros_local.llama import binding
    from ouroboros_local.testing.engines import tiny_engine

    monkeypatch.setattr(text_input, "MAX_TEXT_BYTES", 16)
    big = tmp_path / "big.txt"
    big.write_text("x" * 17)
    with pytest.raises(ParameterError, match="more than 0 MiB of text"):
        text_input.read_text(big)
    with pytest.raises(ParameterError, match="prompt file name is empty"):
        text_input.read_text("", "prompt file")
    with tiny_engine(tiny_target, n_ctx=256) as engine:
        with pytest.raises(ContextOverflowError, match="the prompt has 3000 tokens but the context holds 256") as exc:
            engine.prompt_tokens(" a" * 3000)
        assert exc.value.n_tokens == 3000
        # far past the context, the text's bytes alone refuse it: no token stands for more bytes than the
        # longest one (tokenizing the whole of 8 MB took seconds only to be refused)
        longest = engine.target.bytes_per_token()
        assert longest == max(len(engine.target.piece(t, True)) for t in range(engine.target.n_vocab))   # BPE
        calls = []
        monkeypatch.setattr(binding.lc, "llama_tokenize", lambda *a: calls.append(a) or 0)
        huge = "ab " * (64 * 256 * longest)   # past the 64 bytes a token below which it is simply counted
        with pytest.raises(ContextOverflowError, match=f"the prompt has at least {len(huge) // longest} tokens"):
            engine.prompt_tokens(huge)
        assert not calls
        monkeypatch.undo()
        assert len(engine.tokenize(huge)) >= len(huge) // longest   # the bound holds
    # where special tokens strip the whitespace around them (llama.cpp sets that for phi-3 models: one
    # token then covers any run of spaces), nothing bounds a token's bytes: the text is counted
    from ouroboros_local.llama import Model

    strips = binding.lc.LLAMA_TOKEN_ATTR_RSTRIP
    monkeypatch.setattr(binding.lc, "llama_vocab_get_attr", lambda vocab, token: strips if token == 3 else 0)
    model = Model(tiny_target)
    try:
        assert model.bytes_per_token() is None
        with pytest.raises(ContextOverflowError, match="tokens, more than 255") as counted:
            model.tokenize(" a" * 90_000, limit=255)   # counted by llama.cpp, not bounded by bytes
        assert not counted.value.at_least
    finally:
        model.close()
        monkeypatch.undo()
    monkeypatch.setenv("OUROBOROS_VERBOSE", "0")
    binding._on_log(2, b"llama.cpp says hello\n", None)
    assert "llama.cpp says hello" not in capfd.readouterr().err


def test_ctrl_c_in_generate_still_closes_the_engine(tiny_target, monkeypatch, tmp_path) -> None:
    """generate closed its engine only after a whole answer: Ctrl-C lost the learned estimates (closing
    saves them, and the history)."""
    from ouroboros_local import cli

    monkeypatch.setenv("OUROBOROS_CALIBRATION_FILE", str(tmp_path / "c.json"))
    monkeypatch.setenv("OUROBOROS_ESTIMATES_FILE", str(tmp_path / "e.json"))
    closed: list[bool] = []
    real_close = Engine.close
    monkeypatch.setattr(Engine, "close", lambda self: (closed.append(True), real_close(self))[1])

    def interrupted(self, *args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(Engine, "stream", interrupted)
    assert cli.main(["generate", "-m", str(tiny_target), "-p", "hi", "-n", "4", "-t", "1", "-c", "256",
                     "--method", "vanilla"]) == 130
    assert closed


def test_a_window_the_context_cannot_hold_is_a_method_option_error(tiny_target, tiny_draft) -> None:
    """lookahead said so as a MethodOptionError, ouroboros as a plain ParameterError (a server answered
    the first naming method_options, the second without)."""
    eng = Engine(Model(tiny_target), Model(tiny_draft),
                 EngineConfig(n_ctx=256, n_batch=64, n_seq_max=1, threads=1, threads_batch=1, calibration="off"))
    try:
        for method in ("lookahead", "ouroboros"):
            with pytest.raises(MethodOptionError, match=f"{method} window W=4 needs"):
                eng.generate("The", max_tokens=2, method=method)
    finally:
        eng.close()


def test_compare_is_in_the_json_and_says_when_there_is_nothing_to_compare(tiny_target, tmp_path, monkeypatch,
                                                                          capsys) -> None:
    """--json left the speed-up and the verdict on stderr only; --compare with vanilla said nothing."""
    import json

    from ouroboros_local import cli

    monkeypatch.setenv("OUROBOROS_CALIBRATION_FILE", str(tmp_path / "c.json"))
    monkeypatch.setenv("OUROBOROS_ESTIMATES_FILE", str(tmp_path / "e.json"))
    common = ["generate", "-m", str(tiny_target), "-p", "abc abd abc", "-n", "6", "-t", "1", "-c", "256", "--compare"]
    assert cli.main([*common, "--method", "prompt-lookup", "--json"]) == 0
    compared = json.loads(capsys.readouterr().out.splitlines()[-1])["compare"]
    assert compared["identical"] is True and compared["verdict"] == "identical output" and compared["speedup"] > 0
    assert cli.main([*common, "--method", "vanilla", "--json"]) == 0
    captured = capsys.readouterr()
    assert "--method vanilla is plain decoding" in captured.err
    line = json.loads(captured.out.splitlines()[-1])   # the same keys: a script's ["compare"] raised KeyError
    assert line["compare"]["speedup"] == 1.0 and line["compare"]["identical"] is True
    assert line["compare"]["vanilla_tokens_per_second"] == line["stats"]["tokens_per_second"]


def test_an_option_given_under_two_of_its_names_is_refused_and_a_request_overrides_by_either():
    """{"level": 3, "ngram": 16} ran with whichever came last, unsaid; a request's alias then collided
    with the server's own setting of the option."""
    from ouroboros_local.bench.cli import plan_contenders
    from ouroboros_local.proposers import overlaid
    from ouroboros_local.server.protocol import method_and_options

    for raw in ({"level": 3, "ngram": 16}, {"guess_set": 0, "guess": 64}):
        first, second = raw
        with pytest.raises(MethodOptionError, match=f"'{first}' and '{second}' are one option of lookahead"):
            check_options("lookahead", raw)
    assert overlaid("lookahead", {"level": 4, "gamma": 2}, {"ngram": 3}) == {"ngram": 3}
    _, options, _ = method_and_options({"method": "lookahead", "method_options": {"ngram": 3}}, "auto", {"level": 5})
    assert check_options("lookahead", options)["level"] == 3
    planned = plan_contenders(["lookahead"], {"lookahead": {"ngram": 3}}, {"level": 5}, None, [], False)
    assert check_options("lookahead", planned[0][2])["level"] == 3


def test_ouroboros_without_a_draft_takes_window_0_with_fixed_hyperparameters(tiny_target, tiny_draft) -> None:
    """Its help says "0 = no window", yet without a draft it said "lookahead window must be >= 1"; a draft
    context cut small blamed --seqs and --batch-size."""
    eng = Engine(Model(tiny_target), None, EngineConfig(n_ctx=256, n_batch=64, n_seq_max=8, threads=1,
                                                        threads_batch=1, calibration="off", adaptive=False))
    try:
        eng.check_kv = True
        plain = eng.generate(PROMPT, max_tokens=16, method="vanilla")
        result = eng.generate(PROMPT, max_tokens=16, method="ouroboros", options={"window": 0})
        assert result.tokens == plain.tokens and result.stats.extra["ouroboros_fallback"] == "prompt-lookup"
        # its fixed gamma holds (8 were drafted for gamma 1, the scheduled path's floor)
        one = eng.generate(PROMPT, max_tokens=16, method="ouroboros", options={"window": 0, "gamma": 1})
        assert one.tokens == plain.tokens and 0 < one.stats.drafted <= one.stats.target_passes
    finally:
        eng.close()
    eng = Engine(Model(tiny_target), Model(tiny_draft), EngineConfig(n_ctx=256, n_batch=64, draft_n_ctx=2,
                                                                     threads=1, threads_batch=1, calibration="off"))
    try:
        with pytest.raises(MethodOptionError, match=r"raise the draft's context \(draft_n_ctx=2\)"):
            eng.generate("The", max_tokens=2, method="ouroboros", options={"adaptive": False})
    finally:
        eng.close()
    # where --seqs is the limit, a draft context that holds the window is not blamed
    eng = Engine(Model(tiny_target), Model(tiny_draft), EngineConfig(n_ctx=256, n_batch=64, n_seq_max=4,
                                                                     draft_n_ctx=32, threads=1, threads_batch=1,
                                                                     calibration="off"))
    try:
        with pytest.raises(MethodOptionError, match="raise --seqs and --batch-size"):
            eng.generate("The", max_tokens=2, method="ouroboros", options={"adaptive": False, "window": 8})
    finally:
        eng.close()


def test_an_empty_prompt_is_refused_before_the_model_loads_unless_bos_is_the_prompt(
        tiny_target, tiny_sentencepiece, tmp_path, monkeypatch, capsys) -> None:
    """It was refused only after the weights loaded; a vocabulary that adds BOS has BOS for a prompt."""
    from ouroboros_local.cli import main

    empty = tmp_path / "empty.txt"
    empty.write_text("")
    loads: list[str] = []
    real_load = Engine.load.__func__

    def counted_load(cls, target, *args, **kwargs):
        loads.append(str(target))
        return real_load(cls, target, *args, **kwargs)

    monkeypatch.setattr(Engine, "load", classmethod(counted_load))
    for prompt in (["-p", ""], ["-f", str(empty)]):
        assert main(["generate", "-m", str(tiny_target), *prompt, "-n", "2", "-t", "1"]) == 2
        assert "the prompt is empty" in capsys.readouterr().err and loads == []
    assert main(["generate", "-m", str(tiny_sentencepiece), "-p", "", "-n", "2", "-t", "1",
                 "--method", "vanilla"]) == 0
    assert loads == [str(tiny_sentencepiece)]


@pytest.mark.parametrize("method, options", [("lookahead", {}), ("ouroboros", {"adaptive": False})])
def test_a_window_the_batch_cannot_hold_is_refused_before_the_prefill_and_the_history_file(
        tiny_target, tmp_path, method, options) -> None:
    """Said only after the prompt's prefill (minutes on a long prompt), and after the pool file was named."""
    eng = Engine(Model(tiny_target), None,
                 EngineConfig(n_ctx=256, n_batch=64, n_seq_max=2, threads=1, threads_batch=1, calibration="off"))
    try:
        prefills: list[int] = []
        real_sync = eng.kv.sync_to
        eng.kv.sync_to = lambda tokens, **kw: prefills.append(len(tokens)) or real_sync(tokens, **kw)
        pool = tmp_path / "h.pool"
        with pytest.raises(MethodOptionError, match="window W=4 needs 5 sequence ids"):
            eng.generate(PROMPT, max_tokens=2, method=method, options={**options, "pool": str(pool)})
        assert prefills == [] and eng.history.named_file is None and eng.history.phrase_pool_file is None
    finally:
        eng.close()


def test_sigterm_and_sighup_end_a_command_through_its_finally_blocks(tiny_target, monkeypatch) -> None:
    """Their default action ended the process where it stood: a chat's last answers never reached its
    history file. They raise SystemExit (not KeyboardInterrupt, which chat takes as "stop the answer") only
    while a command runs, and the handlers before are put back."""
    import signal

    from ouroboros_local import cli

    seen: dict[str, object] = {}

    def fake_generate(args) -> int:
        seen["term"] = signal.getsignal(signal.SIGTERM)
        try:
            signal.raise_signal(signal.SIGTERM)
            sum(range(1000))
        finally:
            seen["finally"] = True
        return 0

    monkeypatch.setattr(cli, "cmd_generate", fake_generate)
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as ended:
        cli.main(["generate", "-m", str(tiny_target), "-p", "hi"])
    assert ended.value.code == 128 + signal.SIGTERM and seen["finally"] is True
    assert seen["term"] is cli._exit_for and signal.getsignal(signal.SIGTERM) is before


def test_a_lookahead_window_past_the_sequence_ids_is_refused_before_the_model_loads(tmp_path, capsys) -> None:
    """Said only once the target had loaded (minutes for a large one)."""
    from ouroboros_local.cli import main

    never_loaded = tmp_path / "absent.gguf"   # a load would fail first, naming the file
    assert main(["generate", "-m", str(never_loaded), "-p", "x", "--method", "lookahead", "--window", "8",
                 "--seqs", "4"]) == 2
    err = capsys.readouterr().err
    assert "window W=8 needs 9 sequence ids, the context has 4" in err and "absent.gguf" not in err


def test_an_answer_cut_by_a_signal_ends_its_line_before_interrupted(tiny_target, monkeypatch, capsys) -> None:
    """Ctrl-C mid-answer printed "...a tail of a lioninterrupted"; SIGTERM left the shell's prompt on the
    answer's line."""
    from types import SimpleNamespace

    from ouroboros_local import cli

    def stream(*args, **kwargs):
        yield SimpleNamespace(text="a tail of a lion", result=None)
        raise KeyboardInterrupt

    engine = SimpleNamespace(stream=stream, close=lambda: None, target=SimpleNamespace(chat_template=lambda: "x"))
    monkeypatch.setattr(cli, "_engine_from_args", lambda *args: engine)
    assert cli.main(["generate", "-m", str(tiny_target), "-p", "hello", "--method", "vanilla"]) == 130
    captured = capsys.readouterr()
    assert captured.out == "a tail of a lion\n" and captured.err.endswith("interrupted\n")


def _doctor_output(argv: list[str], capsys, monkeypatch, available: int | None = None) -> str:
    """doctor's stdout, its pair speed (seconds of calibration) left out and the available memory set."""
    from ouroboros_local import cli, doctor
    from ouroboros_local.llama import huge_pages

    monkeypatch.setattr(doctor, "pair_speed_line", lambda args, through_text=False: "pair speed: not measured")
    if available is not None:
        monkeypatch.setattr(huge_pages, "memory_available", lambda: available)
    assert cli.main(["doctor", "-t", "1", *argv]) == 0
    return capsys.readouterr().out


def test_doctor_notes_a_context_past_the_trained_one(tiny_target, capsys, monkeypatch) -> None:
    """doctor said the models fit at -c 131072 without generate's note that text past 8192 degrades."""
    out = _doctor_output(["-m", str(tiny_target), "-c", "4096"], capsys, monkeypatch)
    assert "note: a context of 4096 tokens is more than the 2048 the model was trained on: text past" in out
    assert "trained on" not in _doctor_output(["-m", str(tiny_target), "-c", "2048"], capsys, monkeypatch)


def test_doctor_names_what_does_not_fit_and_the_fix(tiny_target, tiny_draft, capsys, monkeypatch) -> None:
    """Every verdict of "does NOT fit" advised a smaller -c, also where the weights or the draft were the
    part that did not fit. At -c 1000000 each tiny model's F16 cache is 244 MiB, compute buffers 512."""
    pair = ["-m", str(tiny_target), "-d", str(tiny_draft), "-c", "1000000"]
    out = _doctor_output(pair, capsys, monkeypatch, available=100 * 2**20)
    assert "does NOT fit (the target's weights alone, with the compute buffers, need 0.5 GiB: a smaller model" in out
    out = _doctor_output(pair, capsys, monkeypatch, available=850 * 2**20)
    assert "does NOT fit (the target alone fits: run without the draft (no -d))" in out
    out = _doctor_output(pair, capsys, monkeypatch, available=600 * 2**20)
    assert "does NOT fit (the KV cache: a smaller -c or a quantised KV cache" in out and "as does no draft" in out


def test_doctor_counts_the_drafts_own_cache_types(tiny_target, tiny_draft, capsys, monkeypatch) -> None:
    """--draft-cache-type-k/-v changed nothing in doctor's estimate; the target's types priced the draft's cache."""
    per_cache = 2 * 2 * 2 * 16 * 2 * 1000000 / 2**30   # the tiny model's F16 cache of -c 1000000 tokens, GiB
    pair = ["-m", str(tiny_target), "-d", str(tiny_draft), "-c", "1000000"]
    assert f"KV cache of 1000000 tokens {2 * per_cache:.1f}" in _doctor_output(pair, capsys, monkeypatch)
    f32_draft = pair + ["--draft-cache-type-k", "f32", "--draft-cache-type-v", "f32"]
    assert f"KV cache of 1000000 tokens {3 * per_cache:.1f}" in _doctor_output(f32_draft, capsys, monkeypatch)
    f32_target = pair + ["--cache-type-k", "f32", "--cache-type-v", "f32"]
    assert f"KV cache of 1000000 tokens {3 * per_cache:.1f}" in _doctor_output(f32_target, capsys, monkeypatch)


def test_doctor_says_whether_this_runs_weights_go_into_huge_pages(tiny_target, capsys, monkeypatch) -> None:
    """--no-huge-pages still said the weights go into 2 MiB pages, as did a model too large for them."""
    from ouroboros_local import doctor
    from ouroboros_local.llama import huge_pages

    monkeypatch.setattr(huge_pages, "setting", lambda: "madvise")
    out = _doctor_output(["-m", str(tiny_target), "--no-huge-pages"], capsys, monkeypatch)
    assert "huge pages: off (--no-huge-pages): weights are mapped from the file in" in out
    monkeypatch.setattr(huge_pages, "memory_available", lambda: 2**30)
    assert "larger than that" not in doctor.huge_pages_line(True, [("target", 2**20)])
    line = doctor.huge_pages_line(True, [("target", 2**20), ("draft", 2**29 + 1)])
    assert line.endswith("; the draft is larger than that, so mapped in 4 KiB pages")


def test_doctor_resolves_each_model_once(tiny_target, tiny_draft, capsys, monkeypatch) -> None:
    """doctor resolved the target and draft up to 4 times each (a catalogue model hashed, and warned, each time)."""
    from ouroboros_local import catalogue

    resolved = []
    real = catalogue.resolve_model
    monkeypatch.setattr(catalogue, "resolve_model", lambda spec, **kw: resolved.append(spec) or real(spec, **kw))
    _doctor_output(["-m", str(tiny_target), "-d", str(tiny_draft)], capsys, monkeypatch)
    assert resolved == [str(tiny_target), str(tiny_draft)]


def test_calibration_names_the_model_it_measures(tmp_path, caplog) -> None:
    """"measuring this machine's verify cost" came once per model without naming it, and said "seconds to a
    minute" where a 1.5B at -t 1 took two."""
    import logging
    from pathlib import Path
    from types import SimpleNamespace

    from ouroboros_local.calibration import CalibrationCache, CostModel, cached_or_measured

    kv = SimpleNamespace(ctx=SimpleNamespace(model=SimpleNamespace(path=Path("/models/qwen-1.5b.gguf"))))
    with caplog.at_level(logging.INFO, logger="ouroboros_local"):
        cached_or_measured(kv, "key", CalibrationCache(tmp_path / "c.json"), refresh=True,  # type: ignore[arg-type]
                           measure=lambda kv: CostModel.flat())
    assert "measuring this machine's verify cost of qwen-1.5b.gguf (--refresh asked for it; seconds to minutes" \
        in caplog.text
