"""The benchmark harness: prompt building, comparison, peers' output parsing, and a full run on tiny models."""

from __future__ import annotations

import json
import threading
import stat
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ouroboros_local.bench import peers, prompts, report, runner
from ouroboros_local.bench.cli import parse_method_options, parse_methods, parse_variant, resolve_methods
from ouroboros_local.cli import build_parser, main
from ouroboros_local.errors import OuroborosError, ParameterError


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def item(task: str, text: str, **meta) -> prompts.PromptItem:
    return prompts.PromptItem(id="x", task=task, turns=[text], meta=meta)


def fake_template(messages: list[dict[str, str]]) -> str:
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages) + \
        "<|im_start|>assistant\n"


# ---- prompts ---------------------------------------------------------------------------------
def test_render_prompts_per_task() -> None:
    stub = "def f(x):\n    \"\"\"Double x.\"\"\"\n"
    raw = prompts.render_prompt(item("humaneval", stub), "humaneval", chat=False)
    assert raw == prompts.HUMANEVAL_INSTRUCTION + "\n" + stub
    assert len(raw.split("\n")[0]) + 1 == 113          # the paper's prompt[:113] split point
    chat = prompts.render_prompt(item("humaneval", stub), "humaneval", chat=True, template=fake_template)
    assert chat == fake_template([{"role": "user", "content": prompts.HUMANEVAL_INSTRUCTION}]) + stub

    assert prompts.render_prompt(item("cnndm", "ART"), "cnndm", chat=False) == \
        "Please summarize the following document within one sentence. Document: ART  Summary: "
    assert prompts.render_prompt(item("cnndm", "ART"), "cnndm", chat=True, template=fake_template) \
        .startswith("<|im_start|>user\nPlease summarize")

    shot = prompts.PromptItem(id="s", task="gsm8k", turns=["1+1?"],
                              meta={"answer": "1 + 1 = <<1+1=2>>2\n#### 2", "final": "2"})
    gsm = prompts.render_prompt(item("gsm8k", "2+2?"), "gsm8k", chat=False, fewshot=[shot])
    assert gsm == "Q: 1+1?\nA: 1 + 1 = 2 The answer is 2.\n\nQ: 2+2?\nA:"

    wmt = prompts.render_prompt(item("wmt_de_en", "Hallo Welt", src_lang="de", tgt_lang="en"), "wmt", chat=False)
    assert wmt == "Translate German to English: Hallo Welt"
    mt = prompts.PromptItem(id="m", task="mt_bench", turns=["first", "second"])
    assert prompts.render_prompt(mt, "mt_bench", chat=False) == "first"
    assert prompts.render_prompt(item("raw", "as is"), "raw", chat=False) == "as is"
    with pytest.raises(ParameterError):
        prompts.render_prompt(item("raw", "x"), "raw", chat=True, template=None)


def test_load_sets(tmp_path: Path) -> None:
    rows = [{"id": f"g{i}", "task": "gsm8k", "turns": [f"q{i}"], "source": "t",
             "meta": {"answer": f"#### {i}"}} for i in range(5)]
    f = write_jsonl(tmp_path / "gsm.jsonl", rows)
    w = write_jsonl(tmp_path / "w.jsonl", [{"id": "w", "task": "wmt_de_en", "turns": ["a"]}])
    sets = prompts.load_sets(f"{f},{w}", limit=2, fewshot=2)
    assert [s.name for s in sets] == ["gsm", "w"]
    assert [s.task for s in sets] == ["gsm8k", "wmt"]
    assert [i.id for i in sets[0].items] == ["g2", "g3"] and len(sets[0].fewshot) == 2
    assert prompts.load_sets(str(f), task="raw")[0].task == "raw"
    assert prompts.normalize_task("mt-bench") == "mt_bench" and prompts.normalize_task("??") == "raw"
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": 1, "turns": ["a"]}\nnot json\n')
    with pytest.raises(ParameterError, match="bad.jsonl:2"):
        prompts.load_sets(str(bad))
    with pytest.raises(ParameterError, match="turns"):
        prompts.load_sets(str(write_jsonl(tmp_path / "t.jsonl", [{"id": "a", "turns": []}])))
    with pytest.raises(ParameterError, match="not found"):
        prompts.load_sets(str(tmp_path / "missing.jsonl"))
    txt = tmp_path / "p.txt"
    txt.write_text("hello\n")
    assert prompts.load_sets(str(txt))[0].items[0].turns == ["hello\n"]
    # a file in another encoding names its line; a JSON string may hold U+2028 (a line break to
    # str.splitlines, not to JSONL)
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes('{"id": "a", "turns": ["ok"]}\n{"id": "b", "turns": ["caf\u00e9"]}\n'.encode("latin-1"))
    with pytest.raises(ParameterError, match=r"latin.jsonl:2: not UTF-8 text \(byte 0xe9"):
        prompts.load_sets(str(latin))
    sep = tmp_path / "sep.jsonl"
    sep.write_text('{"id": "a", "turns": ["one\u2028two"]}\n', encoding="utf-8")
    assert prompts.load_sets(str(sep))[0].items[0].turns == ["one\u2028two"]
    # a byte-order mark (Notepad's UTF-8) is not text: neither JSON's first line nor the prompt holds it
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + b'{"id": "a", "turns": ["hi"]}\n')
    assert prompts.load_sets(str(bom))[0].items[0].turns == ["hi"]
    bom_txt = tmp_path / "bom.txt"
    bom_txt.write_bytes(b"\xef\xbb\xbfhello")
    assert prompts.load_sets(str(bom_txt))[0].items[0].turns == ["hello"]
    # a file named like the report's pooled row keeps its own name beside it
    pooled = write_jsonl(tmp_path / "all.jsonl", [{"id": "a", "turns": ["x"]}])
    assert [s.name for s in prompts.load_sets(f"{pooled},{w}")] == ["all-2", "w"]
    assert prompts.looks_like_chat_model("Qwen2.5 Coder 1.5B Instruct", True)
    assert not prompts.looks_like_chat_model("Qwen2.5 Coder 1.5B", True)
    assert not prompts.looks_like_chat_model("x-instruct", False)


# ---- parsing helpers ------------------------------------------------------------------------
def test_option_parsing() -> None:
    assert runner.parse_sweep("gamma=1,2,4", ["vanilla", "speculative", "ouroboros"]) == \
        (["speculative", "ouroboros"], "gamma", [1, 2, 4])
    assert runner.parse_sweep("speculative,prompt-lookup:adaptive=true,false",
                              ["vanilla", "speculative", "prompt-lookup", "auto"]) == \
        (["speculative", "prompt-lookup"], "adaptive", [True, False])
    # without METHOD: the methods that have the option (a misspelt option is in none)
    has = {"speculative": {"gamma"}, "lookahead": {"window"}}
    assert runner.parse_sweep("gamma=2,4", ["vanilla", "speculative", "lookahead"],
                              lambda m, name: name in has[m])[0] == ["speculative"]
    with pytest.raises(ParameterError, match="no method of this run has the option 'gamm'"):
        runner.parse_sweep("gamm=2,4", ["vanilla", "speculative", "lookahead"], lambda m, name: name in has[m])
    assert runner.parse_sweep("lookahead:guess-set=4,8", ["vanilla", "lookahead"]) == \
        (["lookahead"], "guess_set", [4, 8])
    with pytest.raises(ParameterError):
        runner.parse_sweep("x:gamma=1", ["vanilla", "speculative"])
    with pytest.raises(ParameterError):
        runner.parse_sweep("gamma", ["vanilla", "speculative"])
    assert [runner.parse_value(v) for v in ("3", "0.5", "true", "none", "abc")] == [3, 0.5, True, None, "abc"]
    assert parse_methods("prompt-lookup,vanilla", ["vanilla", "prompt-lookup"], []) == ["vanilla", "prompt-lookup"]
    assert parse_methods("all", ["vanilla", "lookahead"], ["fake"]) == ["vanilla", "lookahead"]
    with pytest.raises(ParameterError, match="unknown method"):
        parse_methods("nope", ["vanilla"], [])
    assert parse_method_options('{"ouroboros": {"gamma": 4}}') == {"ouroboros": {"gamma": 4}}
    for bad in ("{", '{"a": 1}', "[1]"):
        with pytest.raises(ParameterError):
            parse_method_options(bad)


def test_comparisons() -> None:
    assert runner.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert runner.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert runner.first_difference([1, 2, 3], [1, 2]) == 2
    assert runner.compare_text("abc", "abcdef", 3, 5, "length") is None   # a peer overshooting -n
    assert runner.compare_text("abc", "abX", 3, 3) == 2
    assert runner.compare_text("abcdef", "abc", 6, 3) == 3            # stopped early


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6])
def test_balanced_order(n: int) -> None:
    """Every contender in every position, and right after every other, equally often (Williams design)."""
    rows = [runner.balanced(list(range(n)), k) for k in range(n if n % 2 == 0 else 2 * n)]
    assert all(sorted(row) == list(range(n)) for row in rows)
    for pos in range(n):
        counts = Counter(row[pos] for row in rows)
        assert len(set(counts.values())) == 1 and len(counts) == n
    follows = Counter((a, b) for row in rows for a, b in zip(row, row[1:]))
    assert len(follows) == n * (n - 1) and len(set(follows.values())) <= 1
    assert runner.balanced(list(range(n)), len(rows)) == rows[0]
    assert runner.balanced([], 3) == []


def test_options_for_every_llama_cpp_peer_leave_the_baseline_undrafted() -> None:
    """{"llama.cpp": {"n_max": 4}} reached llama.cpp:vanilla after its own --spec-draft-n-max 0: the
    baseline drafted."""
    from ouroboros_local.bench.cli import peer_options

    opts = {"llama.cpp": {"n_max": 4, "args": ["-fa", "on"]}, "llama.cpp:lookup": {"n_min": 1}}
    assert peer_options("llama.cpp:vanilla", opts) == {"args": ["-fa", "on"]}
    assert peer_options("llama.cpp:lookup", opts) == {"n_max": 4, "args": ["-fa", "on"], "n_min": 1}
    assert peer_options("llama-cpp-python", opts) == {}


def test_peer_names() -> None:
    assert peers.expand_peers("llama-cpp-python-pld", has_draft=False) == ["llama-cpp-python",
                                                                          "llama-cpp-python-pld"]
    labels = peers.expand_peers("llama.cpp", has_draft=False)
    assert labels[0] == "llama.cpp:vanilla" and "llama.cpp:draft-simple" not in labels
    assert "llama.cpp:draft-simple" in peers.expand_peers("llama.cpp", has_draft=True)
    with pytest.raises(ParameterError):
        peers.expand_peers("llama.cpp:draft-simple", has_draft=False)
    with pytest.raises(ParameterError, match="unknown peer"):
        peers.expand_peers("vllm", has_draft=False)


SPEC_SIMPLE_STDERR = """\
main: encoded  120 tokens in    0.412 seconds, speed:  291.262 t/s
main: decoded   65 tokens in    2.000 seconds, speed:   32.500 t/s

main: n_draft   = 8
main: n_predict = 65
main: n_drafted = 80
main: n_accept  = 40
main: accept    = 50.000%
llama_perf_context_print:        load time =     100.00 ms
llama_perf_context_print: prompt eval time =     300.00 ms /   200 tokens
llama_perf_context_print:        eval time =     200.00 ms /    20 runs
"""


def test_parse_llama_cpp_output() -> None:
    nums = peers.parse_llama_cpp_output(SPEC_SIMPLE_STDERR)
    assert nums["prompt_tokens"] == 120 and nums["prefill_seconds"] == pytest.approx(0.412)
    assert nums["decoded"] == 65 and nums["decode_seconds"] == pytest.approx(2.0)
    assert (nums["n_draft"], nums["n_predict"], nums["n_drafted"], nums["n_accept"]) == (8, 65, 80, 40)
    assert nums["accept_percent"] == pytest.approx(50.0)
    la = peers.parse_llama_cpp_output("W = 15\nN =  5\nG = 15\n\nn_predict = 10\nn_accept  = 4\n")
    assert (la["W"], la["N"], la["G"], la["n_predict"], la["n_accept"]) == (15, 5, 15, 10, 4)
    out = "\n\nPROMPT\nline" + "gen \x1b[0;96mtext\x1b[0m<|im_end|>" + "\n\n\n\n"
    assert peers.generated_text(out, "PROMPT\nline") == "gen text<|im_end|>"


class _StubModel:
    add_bos = True
    bos = 0
    eog_tokens = frozenset({1})

    def token_text(self, tok: int) -> str:
        return "<|im_end|>" if tok == 1 else "<s>"

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        return [2] * len(text.split())          # a token a word


FAKE_BINARY = r'''#!{python}
import sys
args = sys.argv[1:]
prompt = open(args[args.index("-f") + 1], encoding="utf-8").read()
assert prompt.endswith("\n")
prompt = prompt[:-1]                      # what llama.cpp's -f does
n = int(args[args.index("-n") + 1])
assert "--no-escape" in args and "0" == args[args.index("--spec-draft-n-max") + 1]
sys.stdout.write("\n\n" + prompt + "abc" * n + "\n\n\n\n")
sys.stderr.write("main: encoded   7 tokens in 0.010 seconds, speed: 700.0 t/s\n"
                 f"main: decoded {{n + 1:4d}} tokens in    0.500 seconds, speed: 10.0 t/s\n"
                 f"n_draft      = 0\nn_predict    = {{n + 1}}\nn_drafted    = 0\nn_accept     = 0\n")
'''


def fake_lookup_binary(tmp_path: Path, source: str, **fields: Any) -> Path:
    """``source`` (a Python script template, filled with ``fields``) installed as tmp_path/bin/llama-lookup."""
    exe = tmp_path / "bin" / "llama-lookup"
    exe.parent.mkdir(parents=True)
    exe.write_text(source.format(python=sys.executable, **fields))
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return exe


ENDING_BINARY = r'''#!{python}
import sys
args = sys.argv[1:]
prompt = open(args[args.index("-f") + 1], encoding="utf-8").read()[:-1]
sys.stdout.write("\n\n" + prompt + {text!r} + "\n\n")   # as llama-lookup prints an end token
sys.stderr.write("main: encoded   7 tokens in 0.010 seconds, speed: 700.0 t/s\n"
                 "main: decoded    {n} tokens in    0.500 seconds, speed: 6.0 t/s\n"
                 "n_draft      = 0\nn_predict    = {n}\nn_drafted    = 0\nn_accept     = 0\n")
'''


def test_a_binary_that_stopped_on_an_end_token_prints_it_and_counts_it(tmp_path: Path) -> None:
    """llama-lookup prints the end token's piece and counts it (n_predict); our texts hold no end token
    and our counts leave it out. Once such a peer's text differed from vanilla's on every prompt that
    ended by itself, and was credited a token."""
    bp = prompts.BuiltPrompt(set_name="s", id="1", task="raw", text="hello\n", tokens=[0, 1, 2], chat=False,
                             max_tokens=16)
    # printed: "abc", the end token, and (llama-lookup, an end token it had drafted) what it drafted after it
    for printed, n, tokens in (("abc<|im_end|>", 3, 2), ("abc<|im_end|>\n<|im_start|>user", 5, 3),
                               ("abc <|im_end|>", 17, 17)):   # past the budget: no end token ended it
        fake_lookup_binary(tmp_path / str(n), ENDING_BINARY, text=printed, n=n)
        peer = peers.LlamaCppBinPeer("llama.cpp:vanilla", tmp_path / str(n), _StubModel(), "t.gguf", n_ctx=512,
                                     threads=1)
        out = peer.run(bp, 16)
        peer.close()
        assert out.text == (printed if n > 16 else "abc")
        assert out.stats["tokens"] == tokens and out.stats["timed_tokens"] == tokens - 1
        assert out.stats["target_passes"] == n - 1
    assert runner.compare_text("abc", "abc", 2, 2, "stop") is None


def test_llama_cpp_binary_peer_with_fake_binary(tmp_path: Path) -> None:
    fake_lookup_binary(tmp_path, FAKE_BINARY)
    peer = peers.LlamaCppBinPeer("llama.cpp:vanilla", tmp_path, _StubModel(), "t.gguf", n_ctx=512, threads=1)
    bp = prompts.BuiltPrompt(set_name="s", id="1", task="raw", text="<s>hello\n", tokens=[0, 1, 2], chat=True,
                             max_tokens=4)
    out = peer.run(bp, 4)
    peer.close()
    assert out.compare == "text" and out.tokens is None
    assert out.text == "abc" * 4                      # the prompt stripped
    assert out.stats["tokens"] == 5 and out.stats["timed_tokens"] == 4 and out.stats["target_passes"] == 4
    assert out.stats["tokens_per_second"] == pytest.approx(8.0)
    missing = peers.LlamaCppBinPeer("llama.cpp:lookahead", tmp_path, _StubModel(), "t.gguf", n_ctx=512)
    with pytest.raises(peers.PeerUnavailable):
        missing.run(bp, 4)
    missing.close()


FLAKY_LOG_BINARY = r'''#!{python}
import pathlib, sys
args = sys.argv[1:]
prompt = open(args[args.index("-f") + 1], encoding="utf-8").read()[:-1]
runs = pathlib.Path({runs!r})
runs.write_text(runs.read_text() + "x" if runs.exists() else "x")
sys.stdout.write("\n\n" + prompt + "abc\n\n")
sys.stderr.write("llama threadpool init\n")
if len(runs.read_text()) > {lost}:   # the first runs' last log lines lost, as llama.cpp's log thread can
    sys.stderr.write("main: decoded    2 tokens in    0.500 seconds, speed: 4.0 t/s\n"
                     "n_draft      = 0\nn_predict    = 2\nn_drafted    = 0\nn_accept     = 0\n")
'''


def test_a_warm_up_whose_timing_lines_were_lost_keeps_the_peer(tmp_path: Path) -> None:
    """The warm-up's numbers are not used, yet its lost log lines dropped the peer from the whole run."""
    fake_lookup_binary(tmp_path, FLAKY_LOG_BINARY, runs=str(tmp_path / "runs"), lost=2)
    peer = peers.LlamaCppBinPeer("llama.cpp:vanilla", tmp_path, _StubModel(), "t.gguf", n_ctx=512, threads=1)
    bp = prompts.BuiltPrompt(set_name="s", id="1", task="raw", text="hi", tokens=[0, 1], chat=False, max_tokens=4)
    try:
        peer.warmup(bp)                         # the first run: lines lost, no matter
        assert peer.run(bp, 4).text == "abc"    # the second lost too, the third has them
    finally:
        peer.close()


@pytest.mark.parametrize("lost", [1, 2])
def test_a_binary_run_whose_timing_lines_were_lost_is_run_again_once(tmp_path: Path, lost: int) -> None:
    """On a busy VM llama.cpp's asynchronous log lost its last lines in 6-10 of 30 runs (exit 0): the prompt
    became an error record and --strict failed."""
    fake_lookup_binary(tmp_path, FLAKY_LOG_BINARY, runs=str(tmp_path / "runs"), lost=lost)
    peer = peers.LlamaCppBinPeer("llama.cpp:vanilla", tmp_path, _StubModel(), "t.gguf", n_ctx=512, threads=1)
    bp = prompts.BuiltPrompt(set_name="s", id="1", task="raw", text="hi", tokens=[0, 1], chat=False, max_tokens=4)
    try:
        if lost == 1:
            assert peer.run(bp, 4).text == "abc"
        else:
            with pytest.raises(OuroborosError, match="timing lines in its output, twice .*threadpool init"):
                peer.run(bp, 4)
    finally:
        peer.close()


def test_llama_cpp_peers_without_any_binary_are_refused_before_the_model_loads(tmp_path: Path,
                                                                                capsys: pytest.CaptureFixture) -> None:
    """A wrong --llama-cpp-bin ran vanilla alone, said so after the warm-up, and exited 0 under --strict."""
    pfile = write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "turns": ["hello there"]}])
    assert main(["bench", "-m", str(tmp_path / "none.gguf"), "--prompts", str(pfile), "--methods", "vanilla",
                 "--peers", "llama.cpp:vanilla,llama.cpp:ngram-mod", "--llama-cpp-bin", str(tmp_path),
                 "--out", str(tmp_path / "out"), "--strict"]) == 2
    assert "no llama.cpp binary (llama-lookup, llama-speculative-simple) in" in capsys.readouterr().err


def test_llama_cpp_peers_decode_in_a_context_of_our_size(tiny_target: Path, tmp_path: Path) -> None:
    """llama.cpp's decode time depends on the context's size (SmolLM2 on 2 cores: 2-3% faster with 768
    cells than 4096), so a peer once given only what the prompts need was measured at other settings."""
    exe = fake_lookup_binary(tmp_path, FAKE_BINARY)
    pfile = write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "turns": ["hello there"]}])
    out = tmp_path / "out"
    main(["bench", "-m", str(tiny_target), "--prompts", str(pfile), "--methods", "vanilla", "-n", "4",
          "-c", "1024", "-t", "1", "--out", str(out), "--no-progress", "--no-bandwidth",
          "--peers", "llama.cpp:vanilla", "--llama-cpp-bin", str(exe.parent)])
    records = json.loads((out / "results.json").read_text())["records"]
    command = next(r for r in records if r["label"] == "llama.cpp:vanilla")["extra"]["command"].split()
    assert command[command.index("-c") + 1] == "1024"   # the prompts need 512
    assert "-ctk" not in command   # f16, llama.cpp's default


def test_peers_get_our_kv_cache_types_and_batch(tiny_target: Path, tmp_path: Path, monkeypatch) -> None:
    """With --cache-type-k/-v our rows ran a q8_0 cache and the peers f16, and llama-cpp-python prefilled
    in batches of 512 beside our 256: unlike settings, unsaid."""
    import llama_cpp

    exe = fake_lookup_binary(tmp_path, FAKE_BINARY)
    pfile = write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "turns": ["hello there"]}])
    loaded: list[dict] = []
    real_llama = llama_cpp.Llama
    monkeypatch.setattr(llama_cpp, "Llama", lambda **kw: loaded.append(kw) or real_llama(**kw))
    out = tmp_path / "out"
    main(["bench", "-m", str(tiny_target), "--prompts", str(pfile), "--methods", "vanilla", "-n", "4",
          "-c", "512", "-b", "128", "-t", "1", "--out", str(out), "--no-progress", "--no-bandwidth",
          "--cache-type-k", "f32", "--cache-type-v", "f32", "--peers", "llama.cpp:vanilla,llama-cpp-python",
          "--llama-cpp-bin", str(exe.parent)])
    records = json.loads((out / "results.json").read_text())["records"]
    command = next(r for r in records if r["label"] == "llama.cpp:vanilla")["extra"]["command"].split()
    assert command[command.index("-ctk") + 1] == "f32" and command[command.index("-ctv") + 1] == "f32"
    assert loaded and loaded[0]["type_k"] == loaded[0]["type_v"] == llama_cpp.GGML_TYPE_F32
    assert loaded[0]["n_batch"] == 128
    draft = peers.LlamaCppBinPeer("llama.cpp:draft-simple", tmp_path, _StubModel(), "t.gguf", "d.gguf",
                                  n_ctx=512, cache_types={"draft_type_k": "q8_0", "draft_type_v": "f16"})
    draft.binary = exe
    drafted = draft.command("p.txt", 4)
    draft.close()
    assert drafted[drafted.index("-ctkd") + 1] == "q8_0" and "-ctvd" not in drafted and "-ctk" not in drafted


def test_an_output_folder_that_cannot_be_written_is_refused_first(tiny_target: Path, tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture) -> None:
    """Once a traceback from mkdir; now a one-line error before any model loads."""
    pfile = write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "turns": ["hello"]}])
    taken = tmp_path / "a-file"
    taken.write_text("x")
    assert main(["bench", "-m", str(tiny_target), "--prompts", str(pfile), "--methods", "vanilla",
                 "-n", "2", "--out", str(taken)]) == 2
    err = capsys.readouterr().err
    assert f"--out {taken}: cannot write there" in err and "loading" not in err


@pytest.mark.parametrize("flags, message", [
    (["--method-options", '{"ouroboro": {"gamma": 4}}'], "--method-options names no method or peer: 'ouroboro'"),
    (["--method-options", '{"suffix": {"max_depth": 999}}'], "max_depth"),
    (["--sweep", "lookahead:windw=2,3"], "windw"),
    (["--sweep", "vanilla:gamma=2,3"], "cannot sweep vanilla"),
    (["--sweep", "windw=2,3"], "no method of this run has the option 'windw'"),
    (["--sweep", "window=2,3"], "model file not found"),   # lookahead's option; suffix is not swept
    (["--tolerance-margin", "nan"], "--tolerance-margin must be >= 0"),
    (["--peer-timeout", "-1"], "--peer-timeout must be > 0"),
    (["--variant", "big=lookahead:{\"levle\": 5}"], "levle"),
    (["--limit", "0", "--learn-first", "2"], "--limit must be >= 1"),   # once "no prompt fits" after loading
    (["--methods", "suffix,speculative,pearl"], "speculative, pearl need a draft model: -d DRAFT"),
    (["--sweep", "lookahead:window=2,2"], "share the label 'lookahead[window=2]'"),
    # peers' options: llama-cpp-python-pld's misspelt one was ignored, llama.cpp's found after the load
    (["--peers", "llama-cpp-python-pld", "--method-options", '{"llama-cpp-python-pld": {"num_pred": 3}}'],
     "llama-cpp-python-pld: unknown option 'num_pred' (it takes num_pred_tokens, max_ngram_size)"),
    (["--peers", "llama-cpp-python-pld", "--method-options", '{"llama-cpp-python-pld": {"num_pred_tokens": 0}}'],
     "num_pred_tokens must be an integer >= 1"),
    (["--method-options", '{"llama.cpp:lookup": {"nmax": 4}}'], "llama.cpp:lookup: unknown option 'nmax'"),
    (["--method-options", '{"llama.cpp": {"n_mx": 4}}'], "llama.cpp: unknown option 'n_mx'"),
    (["--method-options", '{"llama-cpp-python": {"num_pred_tokens": 4}}'], "llama-cpp-python: unknown option"),
    (["--variant", 'x=lookahead:{"reset_pool": "false"}'], '"reset_pool" must be true or false (got "false")'),
])
def test_a_misspelt_method_or_option_is_refused_before_a_model_loads(
        flags: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """--method-options once ignored a key naming no method; a bad option was found mid-run."""
    pfile = write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "turns": ["hello"]}])
    assert main(["bench", "-m", str(tmp_path / "no-model.gguf"), "--prompts", str(pfile),
                 "--methods", "vanilla,lookahead,suffix", "-n", "2", "--out", str(tmp_path / "o"), *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and ("no-model.gguf" not in err or message == "model file not found")


def test_ctrl_c_while_the_results_are_saved_waits_for_them(tiny_target: Path, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C during the write-up (bandwidth measurement, hashing, charts) once lost every measurement."""
    import os
    import signal

    from ouroboros_local.bench import machine

    real = machine.machine_info

    def interrupted_info(**kwargs: object) -> dict:
        os.kill(os.getpid(), signal.SIGINT)
        return real(**kwargs)

    monkeypatch.setattr(machine, "machine_info", interrupted_info)
    pfile = write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "turns": ["hello there"]}])
    out = tmp_path / "out"
    assert main(["bench", "-m", str(tiny_target), "--prompts", str(pfile), "--methods", "vanilla", "-n", "4",
                 "-t", "1", "--out", str(out), "--no-progress", "--no-bandwidth", "--no-warmup"]) == 130
    assert [r["label"] for r in json.loads((out / "results.json").read_text())["records"]] == ["vanilla"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_the_report_refuses_a_file_that_is_not_results_in_one_line(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture) -> None:
    other = tmp_path / "other.json"
    other.write_text('{"a": 1}')
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    for files, message in (([str(tmp_path / "missing.json")], "results file not found"),
                           ([str(other)], "is not a bench results.json"),
                           (["--pool", "auto", str(broken)], "broken.json is not JSON")):
        assert report.main(files) == 2
        assert message in capsys.readouterr().err


def test_a_note_when_others_or_the_host_took_cpu_while_ours_ran() -> None:
    """On this VM a peer process's exit brought host steal into the next few seconds, charged to our
    method that ran then; the records keep others' busy cores per run of ours, the notes say so."""
    def rec(kind: str, load: float) -> dict:
        return {"kind": kind, "extra": {"others_busy_cores": load}}

    quiet = [rec("ours", 0.0), rec("ours", 0.04), rec("peer", 1.9)]
    assert runner.disturbed_note(quiet) is None                       # a peer's own process is not "others"
    busy = quiet + [rec("ours", 0.3)]
    assert "kept 0.11 cores busy on average (at most 0.30)" in runner.disturbed_note(busy)
    assert runner.disturbed_note([{"kind": "ours", "extra": {}}]) is None


def _fake(tokens_fn, fail: Exception | None = None):
    def fn(engine, prompt, max_tokens, sampling, options):
        if fail is not None:
            raise fail
        toks = tokens_fn(prompt)
        stats = runner.empty_stats("fake")
        stats.update(tokens=len(toks), decode_seconds=0.1 * len(toks), target_passes=len(toks))
        return runner.Outcome(tokens=toks, text=" ".join(map(str, toks)), stats=stats)
    return fn


def test_speedup_interval_is_paired_over_prompts() -> None:
    exact = [(10, 1.0 * (i + 1), 10, 2.0 * (i + 1)) for i in range(8)]      # 2x on every prompt
    assert report.bootstrap_speedup(exact) == pytest.approx([2.0, 2.0])
    rng = np.random.default_rng(1)
    noisy = [(10, t * rng.uniform(0.9, 1.1), 10, t) for t in rng.uniform(0.5, 5.0, 40)]
    lo, hi = report.bootstrap_speedup(noisy)
    point = sum(p[0] for p in noisy) / sum(p[1] for p in noisy) / (sum(p[2] for p in noisy) / sum(p[3] for p in noisy))
    assert lo < point < hi and 0.9 < lo and hi < 1.1 and hi - lo < 0.08
    assert report.bootstrap_speedup(exact[:2]) is None                          # too few prompts


def test_variants_are_parsed_with_their_options() -> None:
    methods = ["vanilla", "ouroboros"]
    assert parse_variant('no-window=ouroboros:{"window": 0}', methods) == ("no-window", "ouroboros", {"window": 0})
    assert parse_variant("plain=ouroboros", methods) == ("plain", "ouroboros", {})
    for bad in ("ouroboros", "x=nosuch", "x=ouroboros:{bad", "x=ouroboros:[1]", "=ouroboros"):
        with pytest.raises(ParameterError):
            parse_variant(bad, methods)


def test_runs_are_pooled_per_set_and_sweep_labels_match_plain_ones(capsys) -> None:
    def rec(set_name, pid, label, seconds):
        return {"set": set_name, "id": pid, "label": label, "timed_tokens": 10, "decode_seconds": seconds}

    first = {"records": [rec("a", "1", "vanilla", 1.0), rec("a", "1", "auto", 0.5),
                         rec("b", "1", "vanilla", 1.0), rec("b", "1", "auto", 2.0)]}
    second = {"records": [rec("a", "1", "vanilla", 1.0), rec("a", "1", "auto", 1.0),
                          rec("a", "1", "prompt-lookup[adaptive=True]", 1.0)]}
    pooled = report.pooled_speedups([first, second], "auto")
    assert pooled["a"]["pairs"] == 2 and pooled["a"]["speedup"] == pytest.approx(20 / 1.5 / 10)
    assert pooled["b"]["speedup"] == pytest.approx(0.5) and pooled["all"]["pairs"] == 3
    assert report.pooled_speedups([second], "prompt-lookup")["a"]["speedup"] == pytest.approx(1.0)
    assert report.pooled_speedups([second], "auto", "prompt-lookup")["a"]["pairs"] == 1


def test_run_benchmark_with_injected_methods() -> None:
    bps = [prompts.BuiltPrompt(set_name="s", id=str(i), task="raw", text="x", tokens=[1, 2, i], chat=False,
                               max_tokens=4) for i in range(3)]
    same = _fake(lambda p: [5, 6, 7])
    contenders = [runner.FnContender(None, "vanilla", same, None),
                  runner.FnContender(None, "copy", same, None),
                  runner.FnContender(None, "bad", _fake(lambda p: [5, 9, 7]), None),
                  runner.FnContender(None, "broken", _fake(None, RuntimeError("boom")), None),
                  runner.FnContender(None, "needs-draft", _fake(None, ParameterError("no draft")), None)]
    logs: list[str] = []
    run = runner.run_benchmark(bps, contenders, warmup=False, progress=False, log=logs.append)
    assert "needs-draft" in run.skipped and all(r["label"] != "needs-draft" for r in run.records)
    by = {(r["id"], r["label"]): r for r in run.records}
    assert by[("0", "vanilla")]["match"] == "reference" and by[("0", "copy")]["match"] == "identical"
    assert by[("1", "bad")]["match"] == "mismatch" and by[("1", "bad")]["first_diff"] == 1
    assert by[("2", "broken")]["match"] == "error" and "boom" in by[("2", "broken")]["error"]
    # prompt 1 takes the balanced order's second row (copy, bad, vanilla, broken, needs-draft); a skipped
    # contender takes no slot
    assert [by[("1", lab)]["order"] for lab in ("vanilla", "copy", "bad", "broken")] == [2, 0, 1, 3]
    summary = report.summarize(run.records, run.contenders, model_bytes=1000)["s"]
    assert summary["copy"]["speedup"] == pytest.approx(1.0) and summary["copy"]["all_identical"] is True
    assert summary["bad"]["mismatches"] == 3 and summary["broken"]["errors"] == 3
    assert summary["vanilla"]["passes_per_100_tokens"] == pytest.approx(100.0)
    assert summary["vanilla"]["bandwidth_gbs"] == pytest.approx(1000 * 10 / 1e9)
    sampled = runner.run_benchmark(bps[:1], contenders[:2], warmup=False, greedy=False, progress=False,
                                   log=logs.append)
    assert [r["match"] for r in sampled.records] == ["reference", "n/a"]
    with pytest.raises(ParameterError, match="vanilla"):
        runner.run_benchmark(bps, contenders[1:2], warmup=False, progress=False)


# ---- full runs on the tiny models ---------------------------------------------------------------
def lossy(engine, prompt, max_tokens, sampling, options):
    """A deliberately wrong method: vanilla's output with one token changed."""
    res = engine.generate(prompt.tokens, max_tokens=max_tokens, method="vanilla", sampling=sampling)
    toks = list(res.tokens)
    k = min(2, len(toks) - 1)
    toks[k] = (toks[k] + 1) % engine.target.n_vocab
    return runner.Outcome(tokens=toks, text=engine.detokenize(toks), stats=res.stats.to_dict())


def test_cli_parses() -> None:
    args = build_parser().parse_args(
        ["bench", "-m", "t.gguf", "-d", "d.gguf", "--prompts", "a.jsonl,b.jsonl", "--task", "humaneval",
         "--methods", "vanilla,speculative", "--peers", "llama-cpp-python-pld,llama.cpp", "--llama-cpp-bin",
         "/opt/llama", "--limit", "3", "-n", "16", "--out", "o", "--no-chat", "--sweep", "gamma=2,4",
         "--method-options", '{"speculative": {"gamma": 3}}', "--tolerance-margin", "0.01", "--gamma", "5"])
    assert (args.model, args.draft, args.task, args.limit, args.max_tokens, args.chat) == \
        ("t.gguf", "d.gguf", "humaneval", 3, 16, False)
    assert args.methods == "vanilla,speculative" and args.sweep == "gamma=2,4" and args.opt_gamma == 5
    assert args.tolerance_margin == 0.01 and args.llama_cpp_bin == "/opt/llama"
    assert args.func.__module__ == "ouroboros_local.bench.cli"


def test_default_methods_are_all_and_method_is_a_shorthand() -> None:
    available = ["vanilla", "speculative", "lookahead", "auto"]
    default = build_parser().parse_args(["bench", "-m", "t.gguf", "--prompts", "a.jsonl"])
    assert resolve_methods(default, available, []) == available     # generate's --method default is not used
    one = build_parser().parse_args(["bench", "-m", "t.gguf", "--prompts", "a.jsonl", "--method", "lookahead"])
    assert resolve_methods(one, available, []) == ["vanilla", "lookahead"]
    both = build_parser().parse_args(["bench", "-m", "t.gguf", "--prompts", "a.jsonl", "--methods", "vanilla,auto",
                                      "--method", "lookahead"])
    with pytest.raises(ParameterError, match="--methods or --method, not both"):   # --method was ignored
        resolve_methods(both, available, [])
    bench_help = build_parser()._subparsers._group_actions[0].choices["bench"].format_help()
    assert "shorthand for --methods vanilla,METHOD" in " ".join(bench_help.split())   # it said "(default auto)"


def test_bench_end_to_end(tiny_target: Path, tiny_draft: Path, tmp_path: Path,
                          monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setitem(runner.CUSTOM_METHODS, "lossy", lossy)

    class BusyMeter:
        busy_cores = 0.25

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return None

    monkeypatch.setattr(runner, "LoadMeter", BusyMeter)
    rows = [{"id": "p1", "task": "raw", "turns": ["def add(a, b):\n    return a + b\n\ndef add(a, b):\n"],
             "source": "test", "meta": {}},
            {"id": "p2", "task": "raw", "turns": ["The quick brown fox jumps over the lazy dog. The quick"],
             "source": "test", "meta": {}}]
    pfile = write_jsonl(tmp_path / "tiny.jsonl", rows)
    out = tmp_path / "out"
    peer_args = []
    try:
        import llama_cpp  # noqa: F401

        # a llama.cpp peer whose binary is there, and one whose binary is not (skipped, with a note)
        exe = fake_lookup_binary(tmp_path, FAKE_BINARY)
        peer_args = ["--peers", "llama-cpp-python-pld,llama.cpp:vanilla,llama.cpp:lookahead", "--llama-cpp-bin",
                     str(exe.parent)]
    except ImportError:
        pass
    rc = main(["bench", "-m", str(tiny_target), "-d", str(tiny_draft), "--prompts", str(pfile),
               "--methods", "vanilla,speculative,prompt-lookup,lossy", "--sweep", "speculative:gamma=1,3",
               "-n", "8", "--out", str(out), "-c", "512", "-b", "64", "--seqs", "8", "-t", "1", "--no-progress",
               "--no-bandwidth", "--tolerance-margin", "0.0", "--strict",
               "--variant", 'pl-fresh=prompt-lookup:{"max_ngram": 2, "reset_pool": true}', *peer_args])
    assert rc == 3                                   # --strict: the lossy method differs
    data = json.loads((out / "results.json").read_text())
    assert set(data) == set(report.RESULT_KEYS)
    assert data["schema"] == report.SCHEMA
    labels = [m["label"] for m in data["methods"]]
    assert labels[:4] == ["vanilla", "speculative[gamma=1]", "speculative[gamma=3]", "prompt-lookup"]
    assert "lossy" in labels and "pl-fresh" in labels
    summary = data["summary"]["tiny"]
    for s in summary.values():
        assert set(s) == set(report.SUMMARY_KEYS)
    assert summary["vanilla"]["speedup"] == pytest.approx(1.0)
    for lab in ("speculative[gamma=1]", "speculative[gamma=3]", "prompt-lookup", "pl-fresh"):
        assert summary[lab]["all_identical"] is True, lab
        assert summary[lab]["tokens"] == summary["vanilla"]["tokens"]
    assert summary["lossy"]["all_identical"] is False and summary["lossy"]["mismatches"] == 2
    mism = data["mismatches"]
    mism = [m for m in mism if m["label"] != "llama.cpp:vanilla"]   # the fake binary's text is its own
    assert {m["label"] for m in mism} == {"lossy"} and all(m["first_diff"] == 2 for m in mism)
    assert all(m["margin"] is not None for m in mism)
    assert len(data["records"]) == 2 * len(labels)
    for rec in data["records"]:
        assert set(runner.RECORD_KEYS) <= set(rec)
    assert data["sweep"]["param"] == "gamma" and set(data["sweep"]["labels"]) == {"speculative[gamma=1]",
                                                                                 "speculative[gamma=3]"}
    assert data["machine"]["logical_cores"] and data["versions"]["ouroboros_local"]
    # others' load while each run of ours went on (a stand-in meter: a tiny model's run is too short to
    # measure), and the note it brings
    assert all(r["extra"]["others_busy_cores"] == 0.25 for r in data["records"] if r["kind"] == "ours")
    assert all("others_busy_cores" not in r["extra"] for r in data["records"] if r["kind"] == "peer")
    assert "cores busy on average" in " ".join(data["notes"])
    assert data["models"]["target"]["size_bytes"] > 0 and data["models"]["target"]["sha256"]
    if peer_args:
        assert summary["llama-cpp-python-pld"]["all_identical"] is True
        assert summary["llama-cpp-python-pld"]["baseline"] == "llama-cpp-python"
        assert "llama.cpp:lookahead" in data["skipped"]       # no llama-lookahead beside the fake llama-lookup
        assert summary["llama.cpp:vanilla"]["baseline"] == "llama.cpp:vanilla"
    md = (out / "results.md").read_text()
    assert "| vanilla |" in md and "MISMATCH" in md and "## Outputs that differ from vanilla" in md
    assert summary["vanilla"]["draft_graphs"] is None          # no draft model decoded
    assert "| vanilla |" in capsys.readouterr().out
    # a results.json re-rendered by a newer report module: same summary, same table
    (out / "results.md").unlink()
    assert report.main([str(out / "results.json")]) == 0
    assert json.loads((out / "results.json").read_text())["summary"] == data["summary"]
    assert (out / "results.md").read_text() == md
    # the settings line names flash attention and the rounds' size (a GPU's rounds of 4 lost unseen in
    # the seventh H200 run), and an overlap set by hand (its default says nothing)
    settings = md.split("- settings:")[1].split("\n")[0]
    assert "flash attention off, rounds of each draft's size, created" in settings and "overlap" not in settings
    payload = json.loads((out / "results.json").read_text())
    payload["settings"]["engine_config"].update(round_size=4, overlap=False)
    assert "gpu layers 0, flash attention off, rounds of 4, overlap off, created" in report.render_markdown(payload)
    payload["settings"]["engine_config"].update(round_switch=False)
    assert "rounds of 4, overlap off, round switch off, created" in report.render_markdown(payload)
    # the verify costs the run priced rounds with (speculative's scheduler measured them), and, in rounds of
    # one size, a round's against the plain step (an H200 run could not tell them afterwards)
    curve = data["settings"]["cost_curves"]["target"]
    assert curve["sizes"][0] == 1 and len(curve["seconds"]) == len(curve["sizes"]) and curve["round_size"] == 0
    assert "- verify costs as calibrated, in plain steps of " in md
    payload["settings"]["cost_curves"]["target"] = {"sizes": [1, 4, 8], "seconds": [0.003, 0.003, 0.005],
                                                    "round_size": 4, "plain_seconds": 0.002,
                                                    "switch_seconds": 0.004}
    assert ("in plain steps of 2.00 ms: a round of 4 1.50; c(8) 2.50; the plain steps after another size lose"
            " 2.00") in report.render_markdown(payload)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert (out / "speedup.png").stat().st_size > 0 and (out / "sweep.png").stat().st_size > 0


def test_cost_curves_out_of_shape_leave_the_cost_line_out() -> None:
    """A hand-edited settings.cost_curves (a list, a string, a bool or a text for a number, NaN) made
    re-rendering a results.json a traceback."""
    good = {"sizes": [1, 4, 8], "seconds": [0.003, 0.003, 0.005], "round_size": 4, "plain_seconds": 0.002}
    payload = {"settings": {"cost_curves": {"target": good}}}
    assert "a round of 4 1.50; c(8) 2.50" in report.render_markdown(payload)
    for curves in ([good], "n/a", {"target": [1, 2]}, {"target": {**good, "round_size": "4"}},
                   {"target": {**good, "round_size": True}}, {"target": {**good, "seconds": ["x", 0.003, 0.005]}},
                   {"target": {**good, "plain_seconds": float("nan")}}):
        payload["settings"]["cost_curves"] = curves
        assert "verify costs" not in report.render_markdown(payload)


def test_the_report_pools_the_draft_models_graphs() -> None:
    """extra.draft_graphs ([decodes, new graphs]) pooled per set and method, and a table of them where a
    draft model decoded (none where none did)."""
    records = [{"extra": {"draft_graphs": [45, 18]}}, {"extra": {"draft_graphs": [5, 2]}}, {"extra": {}}]
    assert report.draft_graphs(records) == [50, 20] and report.draft_graphs(records[2:]) is None
    summary = {"gsm8k": {"speculative": {"label": "speculative", "draft_graphs": [50, 20]},
                         "vanilla": {"label": "vanilla", "draft_graphs": None}},
               report.ALL_SETS: {"speculative": {"label": "speculative", "draft_graphs": [50, 20]}}}
    lines = report._draft_graph_lines(summary)
    assert lines[0] == "## The draft model's graphs" and "| gsm8k | speculative | 50 | 20 (40%) |" in lines
    assert not any("vanilla" in line or line.startswith("| all") for line in lines)
    assert report._draft_graph_lines({"gsm8k": {"vanilla": {"label": "vanilla", "draft_graphs": None}}}) == []


def test_tolerance_margin_tie_flip(tiny_target: Path) -> None:
    import numpy as np

    from ouroboros_local.engine import Engine, EngineConfig
    from ouroboros_local.llama import Model

    with Engine(Model(tiny_target), None, EngineConfig(n_ctx=256, n_batch=32, n_seq_max=2, threads=1)) as engine:
        bp = prompts.BuiltPrompt(set_name="s", id="1", task="raw", text="The quick brown fox",
                                 tokens=engine.tokenize("The quick brown fox"), chat=False, max_tokens=6)
        ref = runner.Outcome.from_result(engine.generate(bp.tokens, max_tokens=6))
        runner.cold_start(engine)
        row = np.array(engine.kv.sync_to(bp.tokens + ref.tokens[:3], logits_last=True))
        second = int(np.argsort(-row)[1])
        if second == ref.tokens[3]:
            second = int(np.argsort(-row)[0])
        margin = float(row[ref.tokens[3]] - row[second])
        flipped = list(ref.tokens)
        flipped[3] = second
        got = runner.Outcome(tokens=flipped, text="", stats={})
        strict = runner.classify(engine, bp, ref, got, tolerance_margin=None)
        assert strict["match"] == "mismatch" and strict["first_diff"] == 3 and strict["margin"] is None
        assert (strict["ref_token"], strict["got_token"]) == (ref.tokens[3], second)
        loose = runner.classify(engine, bp, ref, got, tolerance_margin=abs(margin) + 1.0)
        assert loose["match"] == "tie-flip" and loose["margin"] == pytest.approx(margin, abs=1e-3)
        # tolerance 0 excuses nothing: a negative margin (the replay preferring the method's token) once
        # counted as a tie-flip at any size
        tight = runner.classify(engine, bp, ref, got, tolerance_margin=0.0)
        assert tight["match"] == "mismatch"
        assert runner.classify(engine, bp, ref, ref, tolerance_margin=1.0)["match"] == "identical"


def test_tolerance_rule_weighs_an_early_stop_against_the_token(tiny_target: Path) -> None:
    import numpy as np

    from ouroboros_local.compare import compare_greedy
    from ouroboros_local.engine import Engine, EngineConfig
    from ouroboros_local.llama import Model

    with Engine(Model(tiny_target), None, EngineConfig(n_ctx=256, n_batch=32, n_seq_max=2, threads=1)) as engine:
        prompt = engine.tokenize("The quick brown fox")
        ref = engine.generate(prompt, max_tokens=6).tokens
        row = np.array(engine.kv.sync_to(prompt + ref[:3], logits_last=True))
        stop = float(row[sorted(engine.target.eog_tokens)].max())
        want = float(row[ref[3]]) - stop          # plain decoding's token over stopping there
        early = compare_greedy(engine, prompt, ref, ref[:3], tolerance=abs(want) + 1)   # the method stopped
        assert early.first_difference == 3 and early.margin == pytest.approx(want, abs=1e-3) and early.tie_flip
        # vanilla stopped: the margin is the other way round; tolerance 0 excuses no margin, negative or not
        late = compare_greedy(engine, prompt, ref[:3], ref, tolerance=0.0)
        assert late.margin == pytest.approx(-want, abs=1e-3) and not late.tie_flip


def test_tie_rule_refuses_a_reference_the_replay_disowns_and_output_past_the_budget(tiny_target: Path) -> None:
    """Once any negative margin was a tie-flip, however large, and a method that went on past the token
    budget (where vanilla stopped at it) was weighed against an end-of-generation token: a tie-flip too."""
    from ouroboros_local.compare import compare_greedy
    from ouroboros_local.engine import Engine, EngineConfig
    from ouroboros_local.llama import Model

    with Engine(Model(tiny_target), None, EngineConfig(n_ctx=256, n_batch=32, n_seq_max=2, threads=1)) as engine:
        prompt = engine.tokenize("The quick brown fox")
        ref = engine.generate(prompt, max_tokens=6)
        assert ref.stats.finish_reason == "length"
        row = np.array(engine.kv.sync_to(prompt + ref.tokens[:3], logits_last=True))
        worst = int(np.argmin(row))
        disowned = ref.tokens[:3] + [worst] + ref.tokens[4:]       # a "vanilla" token the replay rates last
        report = compare_greedy(engine, prompt, disowned, ref.tokens, tolerance=0.5)
        assert report.margin < -0.5 and not report.tie_flip
        runner.cold_start(engine)
        over = engine.generate(prompt, max_tokens=7).tokens           # one token past a budget of 6
        lenient = abs(report.margin) + 100.0                             # a tolerance that excuses any margin
        assert not compare_greedy(engine, prompt, ref.tokens, over, tolerance=lenient, max_tokens=6).tie_flip
        assert not compare_greedy(engine, prompt, ref.tokens, over, tolerance=lenient,
                                  reference_finish="length").tie_flip
        bp = prompts.BuiltPrompt(set_name="s", id="1", task="raw", text="", tokens=prompt, chat=False, max_tokens=6)
        got = runner.Outcome(tokens=list(over), text="", stats={})
        assert runner.classify(engine, bp, runner.Outcome.from_result(ref), got, lenient)["match"] == "mismatch"


def test_unchecked_outputs_fail_strict_and_an_interrupted_run_counts_its_prompts(
        tiny_target: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--strict once passed a method that failed on every prompt; after Ctrl-C the set's heading once
    counted the prompts built, not those run; a rerun into the same --out once kept the last run's charts."""
    def broken(engine, prompt, max_tokens, sampling, options):
        raise RuntimeError("boom")

    def stops_at_p2(engine, prompt, max_tokens, sampling, options):
        if prompt.id == "p2":
            raise KeyboardInterrupt
        return lossy(engine, prompt, max_tokens, sampling, options)

    monkeypatch.setitem(runner.CUSTOM_METHODS, "broken", broken)
    monkeypatch.setitem(runner.CUSTOM_METHODS, "stops", stops_at_p2)
    pfile = write_jsonl(tmp_path / "p.jsonl", [{"id": "p1", "turns": ["hello there"]},
                                               {"id": "p2", "turns": ["good night"]}])
    later = write_jsonl(tmp_path / "later.jsonl", [{"id": "q1", "turns": ["good day"]}])
    out = tmp_path / "out"
    common = ["bench", "-m", str(tiny_target), "--prompts", f"{pfile},{later}", "-n", "4", "-t", "1", "--out",
              str(out), "--no-progress", "--no-bandwidth", "--no-warmup", "--peers", ""]
    assert main([*common, "--methods", "vanilla,broken", "--strict"]) == 3
    assert "| broken [2 errors] |" in (out / "results.md").read_text()
    out.mkdir(exist_ok=True)
    for chart in ("speedup.png", "sweep.png"):
        (out / chart).write_text("an earlier run's chart")
    assert main([*common, "--methods", "vanilla,stops"]) == 130
    data = json.loads((out / "results.json").read_text())
    assert data["sets"][0]["prompts"] == 1 and "## p (raw, 1 prompts" in (out / "results.md").read_text()
    assert "## later (raw: no prompt of it finished" in (out / "results.md").read_text()
    assert not (out / "sweep.png").exists()
    assert not (out / "speedup.png").exists() or (out / "speedup.png").read_bytes() != b"an earlier run's chart"
    # the earlier run is kept aside, not wiped (a rerun stopped at once wrote an empty report over it)
    previous = out / "previous"
    assert "| broken [2 errors] |" in (previous / "results.md").read_text()
    assert (previous / "sweep.png").read_text() == "an earlier run's chart"
    before = (out / "results.json").read_bytes()
    monkeypatch.setitem(runner.CUSTOM_METHODS, "stops", lambda *a: (_ for _ in ()).throw(KeyboardInterrupt))
    assert main([*common, "--methods", "vanilla,stops"]) == 130
    assert (out / "results.json").read_bytes() == before                    # nothing measured: nothing written
    assert "| broken [2 errors] |" in (previous / "results.md").read_text()
    # a second stopped rerun: the finished run stays in previous/, the stopped one goes beside it
    monkeypatch.setitem(runner.CUSTOM_METHODS, "stops", stops_at_p2)
    assert main([*common, "--methods", "vanilla,stops"]) == 130
    assert "| broken [2 errors] |" in (previous / "results.md").read_text()
    assert (previous / "stopped" / "results.json").read_bytes() == before

    def terminated_at_p2(engine, prompt, max_tokens, sampling, options):   # SIGTERM, as cli.main ends it
        if prompt.id == "p2":
            raise SystemExit(143)
        return lossy(engine, prompt, max_tokens, sampling, options)

    monkeypatch.setitem(runner.CUSTOM_METHODS, "stops", terminated_at_p2)
    assert main([*common, "--methods", "vanilla,stops"]) == 143   # (`timeout`'s SIGTERM) wrote nothing
    data = json.loads((out / "results.json").read_text())
    assert data["sets"][0]["prompts"] == 1 and "interrupted (exit status 143: a signal)" in data["notes"][-1]


def test_each_contender_keeps_its_own_learned_state() -> None:
    """One method's history (say, the suffix trie holding its answer to this prompt) must not reach the
    next method run on the same prompt: each contender has its own engine.history, kept across prompts.
    So are the scheduler's estimates and round costs (once shared: auto learned from prompt-lookup's
    rounds on the same prompt, and the rows of a sweep from each other's)."""
    from types import SimpleNamespace

    from ouroboros_local.bench.prompts import BuiltPrompt
    from ouroboros_local.bench.runner import EngineContender
    from ouroboros_local.engine import Engine
    from ouroboros_local.history import History

    seen: list[dict] = []
    schedulers: list[object] = []

    def generate(tokens, **kwargs):
        seen.append(engine.history.kept("runs", dict).copy())
        runs = engine.history.kept("runs", dict)
        runs[kwargs["method"]] = runs.get(kwargs["method"], 0) + 1   # "learns"
        if engine._scheduler is None:    # as Engine.scheduler(): made on first use
            engine._scheduler = object()
        schedulers.append(engine._scheduler)
        stats = SimpleNamespace(to_dict=lambda: {"tokens": 1})
        return SimpleNamespace(text="x", tokens=[1], stats=stats)

    outside = History(None)
    outside.kept("runs", lambda: {"outside": True})
    outside_scheduler = object()
    engine = SimpleNamespace(history=outside, target=None, generate=generate, _scheduler=outside_scheduler,
                             _sizers={})
    engine.swap_learning = lambda state: Engine.swap_learning(engine, state)
    a = EngineContender(engine, "a", "suffix", {}, sampling=None, cold=False)
    b = EngineContender(engine, "b", "auto", {}, sampling=None, cold=False)
    prompt = BuiltPrompt(set_name="s", id="p", task="raw", text="t", tokens=[1, 2], chat=False, max_tokens=4)
    for _ in range(2):
        a.run(prompt, 4)
        b.run(prompt, 4)
    assert seen == [{}, {}, {"suffix": 1}, {"auto": 1}]      # warm across its own prompts, blind to others'
    assert engine.history is outside and outside.kept("runs", dict) == {"outside": True}   # put back
    a_sched, b_sched = schedulers[0], schedulers[1]
    assert schedulers == [a_sched, b_sched, a_sched, b_sched] and len({id(a_sched), id(b_sched),
                                                                        id(outside_scheduler)}) == 3
    assert engine._scheduler is outside_scheduler


def test_bench_learns_first_on_the_prompts_after_the_limit(tiny_target: Path, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """--learn-first K: our drafting methods answer the K prompts after --limit's untimed (vanilla and
    peers do not), then the timed prompts run as usual; only those are recorded."""
    rows = [{"id": f"p{i}", "task": "raw", "turns": [f"def add{i}(a, b):\n    return a + b\n\ndef add{i}(a, b):\n"],
             "source": "test", "meta": {}} for i in range(4)]
    pfile = write_jsonl(tmp_path / "tiny.jsonl", rows)
    calls: list[tuple[str, str]] = []
    run = runner.EngineContender.run

    def counted(self, prompt, max_tokens):
        calls.append((self.label, prompt.id))
        return run(self, prompt, max_tokens)

    monkeypatch.setattr(runner.EngineContender, "run", counted)
    common = ["bench", "-m", str(tiny_target), "--prompts", str(pfile), "--methods", "vanilla,suffix", "-n", "8",
              "-c", "512", "-b", "64", "--seqs", "8", "-t", "1", "--no-progress", "--no-bandwidth", "--no-warmup",
              "--peers", ""]
    out = tmp_path / "out"
    assert main([*common, "--limit", "1", "--learn-first", "2", "--out", str(out)]) == 0
    assert calls == [("suffix", "p1"), ("suffix", "p2"), ("vanilla", "p0"), ("suffix", "p0")]
    data = json.loads((out / "results.json").read_text())
    assert [(r["label"], r["id"]) for r in data["records"]] == [("vanilla", "p0"), ("suffix", "p0")]
    assert data["settings"]["learn_first"] == 2 and any("warm start" in n for n in data["notes"])
    assert main([*common, "--learn-first", "2", "--out", str(out)]) == 2          # no --limit: nothing to learn from
    assert main([*common, "--limit", "1", "--learn-first", "-1", "--out", str(out)]) == 2


def test_an_empty_turn_is_refused_with_its_line(tmp_path) -> None:
    from ouroboros_local.errors import ParameterError

    path = tmp_path / "p.jsonl"
    path.write_text('{"id": "a", "turns": ["hi"]}\n{"id": "c", "turns": [""]}\n')
    with pytest.raises(ParameterError, match=r"p.jsonl:2: a turn is empty"):
        prompts.read_prompt_file(path)


def test_an_empty_prompt_file_is_refused_when_read(tmp_path: Path) -> None:
    """An empty .txt among the sets was found after the other sets were measured, and the run was lost."""
    for text in ("", "\n"):
        (tmp_path / "empty.txt").write_text(text)
        with pytest.raises(ParameterError, match=r"empty.txt: the prompt file is empty"):
            prompts.load_sets(str(tmp_path / "empty.txt"))


def test_a_file_whose_lines_name_different_tasks_is_refused(tmp_path: Path) -> None:
    """Every line was built with the first line's task and budget, in silence; a set is one task."""
    mixed = write_jsonl(tmp_path / "mixed.jsonl", [{"id": "q", "task": "gsm8k", "turns": ["What is 2+3?"]},
                                                   {"id": "h", "task": "humaneval", "turns": ["def add(a, b):"]}])
    with pytest.raises(ParameterError, match="mixed.jsonl: prompt 'q' is a gsm8k prompt and 'h' a humaneval one"):
        prompts.load_sets(str(mixed))
    assert [s.task for s in prompts.load_sets(str(mixed), task="raw")] == ["raw"]   # --task forces one
    alike = write_jsonl(tmp_path / "wmt.jsonl", [{"id": "a", "task": "wmt_de_en", "turns": ["x"]},
                                                 {"id": "b", "task": "wmt_fr_en", "turns": ["y"]}])
    assert [s.task for s in prompts.load_sets(str(alike))] == ["wmt"]


@pytest.mark.parametrize("layout, message", [
    ({"previous": "file"}, "previous is not a folder"),
    ({"previous/stopped": "file"}, "stopped is not a folder"),
    ({"results.json": "dir"}, "results.json is not a file"),
    ({"previous/results.md": "dir"}, "results.md is not a file"),
    ({"speedup.png": "dir"}, "speedup.png is not a file"),
])
def test_output_paths_that_cannot_take_the_results_are_refused_first(
        layout: dict[str, str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A stray file OUT/previous or a folder OUT/results.json failed the run after everything was measured."""
    out = tmp_path / "out"
    for name, kind in layout.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).mkdir() if kind == "dir" else (out / name).write_text("x")
    (out / "results.json").exists() or (out / "results.json").write_text("{}")   # an earlier run to keep
    pfile = write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "turns": ["hello"]}])
    assert main(["bench", "-m", str(tmp_path / "no-model.gguf"), "--prompts", str(pfile), "--methods", "vanilla",
                 "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert message in err and "no-model.gguf" not in err


def test_the_report_rerenders_files_of_one_folder_apart_and_says_why_it_cannot(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Two results files in one folder once wrote one results.md (the second over the first); a folder
    named results.md gave a traceback, after results.json was rewritten."""
    payload = {"records": [], "methods": [], "settings": {}, "sets": []}
    for name in ("tiny.json", "smol.json"):
        (tmp_path / name).write_text(json.dumps(payload))
    assert report.main([str(tmp_path / "tiny.json"), str(tmp_path / "smol.json")]) == 0
    assert (tmp_path / "tiny.md").is_file() and (tmp_path / "smol.md").is_file()
    assert report.markdown_path(Path("r/results.json")) == Path("r/results.md")
    blocked = tmp_path / "blocked"
    (blocked / "results.md").mkdir(parents=True)
    (blocked / "results.json").write_text(json.dumps(payload))
    assert report.main([str(blocked / "results.json")]) == 2
    assert f"cannot write {blocked / 'results.md'}: it is not a file" in capsys.readouterr().err
    assert json.loads((blocked / "results.json").read_text()) == payload


FAILING_BINARY = """#!{python}
import sys
sys.stderr.write("cannot load model\\n")
sys.exit(1)
"""


def test_strict_fails_when_a_contender_asked_for_never_ran(tiny_target: Path, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture) -> None:
    """Every llama.cpp peer failed at the warm-up: no record to count, and --strict exited 0."""
    exe = fake_lookup_binary(tmp_path, FAILING_BINARY)
    pfile = write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "turns": ["hello there"]}])
    common = ["bench", "-m", str(tiny_target), "--prompts", str(pfile), "--methods", "vanilla", "-n", "4", "-t", "1",
              "--out", str(tmp_path / "out"), "--no-progress", "--no-bandwidth", "--peers", "llama.cpp:lookup",
              "--llama-cpp-bin", str(exe.parent)]
    assert main([*common, "--strict"]) == 3
    assert "WARNING: 2 contender(s) did not run: llama.cpp:vanilla, llama.cpp:lookup" in capsys.readouterr().err
    assert main(common) == 0


def test_vanillas_error_mid_run_writes_what_was_measured(tiny_target: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture) -> None:
    """A ParameterError from vanilla on a later prompt once threw the whole run away, nothing written."""
    run = runner.EngineContender.run

    def refuses_p2(self, prompt, max_tokens):
        if prompt.id == "p2":
            raise ParameterError("the prompt is empty")
        return run(self, prompt, max_tokens)

    monkeypatch.setattr(runner.EngineContender, "run", refuses_p2)
    pfile = write_jsonl(tmp_path / "p.jsonl", [{"id": "p1", "turns": ["hello there"]},
                                               {"id": "p2", "turns": ["good night"]}])
    out = tmp_path / "out"
    assert main(["bench", "-m", str(tiny_target), "--prompts", str(pfile), "--methods", "vanilla", "-n", "4",
                 "-t", "1", "--out", str(out), "--no-progress", "--no-bandwidth", "--no-warmup"]) == 2
    assert "bench: error: vanilla failed on p/p2: the prompt is empty" in capsys.readouterr().err
    data = json.loads((out / "results.json").read_text())
    assert [r["id"] for r in data["records"]] == ["p1"]
    assert any(n.startswith("stopped early (vanilla failed on p/p2") for n in data["notes"])


def test_a_signal_during_the_save_is_noted_and_named_by_the_exit_status(monkeypatch) -> None:
    """SIGTERM (``timeout``) and SIGHUP while the results were written exited 130, Ctrl-C's status."""
    import os
    import signal

    from ouroboros_local.bench.cli import saving_first

    said: list[str] = []
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        with saving_first(said.append) as pressed:
            os.kill(os.getpid(), sig)
            signal.pthread_kill(threading.main_thread().ident, 0)   # (delivered by now)
        assert pressed == [sig] and 128 + pressed[0] == {signal.SIGTERM: 143, signal.SIGHUP: 129}.get(sig, 130)
    assert said and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def _no_space(created: Path | None = None) -> OSError:
    """ENOSPC, after creating ``created`` empty: a full disk still takes an empty file."""
    import errno
    import os

    if created is not None:
        created.write_bytes(b"")
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.mark.parametrize("full", [("results.json", "results.md", "speedup.png"), ("results.md",)])
def test_a_full_disk_costs_only_the_files_it_has_no_room_for(
        full: tuple[str, ...], tiny_target: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture) -> None:
    """A full --out folder once lost the whole run: no table printed, 'No space left on device' naming no
    file, and a 0-byte results.json.tmp or results.md left behind."""
    from ouroboros_local.bench import charts

    out = tmp_path / "out"
    write_text = Path.write_text

    def filling_write_text(self: Path, *args: Any, **kwargs: Any) -> int:
        if self.parent == out and self.name.startswith(full):
            raise _no_space(self)
        return write_text(self, *args, **kwargs)

    def filling_plot(summary: Any, path: Path, title: str = "") -> bool:   # as savefig on a full disk
        if Path(path).name in full:
            raise _no_space(Path(path))
        return False

    monkeypatch.setattr(Path, "write_text", filling_write_text)
    monkeypatch.setattr(charts, "plot_speedup", filling_plot)
    pfile = write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "turns": ["hello there"]}])
    assert main(["bench", "-m", str(tiny_target), "--prompts", str(pfile), "--methods", "vanilla", "-n", "4",
                 "-t", "1", "--out", str(out), "--no-progress", "--no-bandwidth", "--no-warmup"]) == 1
    printed = capsys.readouterr()
    assert "| vanilla | " in printed.out
    for name in full:
        assert f"bench: error: cannot write {out / name}: No space left on device\n" in printed.err
    assert sorted(p.name for p in out.iterdir()) == sorted({"results.json", "results.md"} - set(full))
    if "results.json" not in full:
        assert [r["label"] for r in json.loads((out / "results.json").read_text())["records"]] == ["vanilla"]


def test_an_output_folder_without_room_is_refused_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture) -> None:
    """The pre-load check wrote an empty probe, which a full disk still takes."""
    import io
    import tempfile

    class FullDisk(io.BytesIO):
        def write(self, data: Any) -> int:
            raise _no_space()

    monkeypatch.setattr(tempfile, "NamedTemporaryFile", lambda **kwargs: FullDisk())
    pfile = write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "turns": ["hello"]}])
    assert main(["bench", "-m", str(tmp_path / "no-model.gguf"), "--prompts", str(pfile), "--methods", "vanilla",
                 "--out", str(tmp_path / "o")]) == 2
    assert f"--out {tmp_path / 'o'}: cannot write there (No space left on device)" in capsys.readouterr().err


def test_an_earlier_run_that_cannot_be_kept_is_not_written_over(tiny_target: Path, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture) -> None:
    """No room to move the earlier run to previous/: its files stay, this run's table is printed."""
    from ouroboros_local.bench import cli as bench_cli

    def no_room(out_dir: Path, log: Any) -> None:
        raise _no_space()

    monkeypatch.setattr(bench_cli, "keep_earlier_run", no_room)
    out = tmp_path / "out"
    out.mkdir()
    (out / "results.json").write_text("{}")
    pfile = write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "turns": ["hello there"]}])
    assert main(["bench", "-m", str(tiny_target), "--prompts", str(pfile), "--methods", "vanilla", "-n", "4",
                 "-t", "1", "--out", str(out), "--no-progress", "--no-bandwidth", "--no-warmup"]) == 1
    printed = capsys.readouterr()
    assert "| vanilla | " in printed.out
    assert (f"bench: error: cannot keep the earlier run's results in {out / 'previous'} (No space left on "
            f"device); this run's files were not written over them in {out}\n") in printed.err
    assert sorted(p.name for p in out.iterdir()) == ["results.json"] and (out / "results.json").read_text() == "{}"


# ---- runs put side by side; headings; messages -------------------------------------------------------
def _pool_run(path: Path, max_tokens: int = 16, prompt_tokens: int = 30, model: str = "m.gguf") -> str:
    recs = [{"set": "s", "id": "p", "label": label, "kind": "ours", "max_tokens": max_tokens,
             "prompt_tokens": prompt_tokens, "timed_tokens": 10, "decode_seconds": seconds, "match": "reference"}
            for label, seconds in (("vanilla", 1.0), ("auto", 0.5))]
    path.write_text(json.dumps({"records": recs, "methods": [], "models": {"target": {"file": model}}}))
    return str(path)


def test_pooling_refuses_runs_of_other_prompts_and_a_file_twice(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture) -> None:
    """A chat -n 24 run and a --no-chat -n 16 one were pooled as two runs of one prompt, with an interval;
    a file given twice counted twice."""
    first = _pool_run(tmp_path / "a.json")
    assert report.main(["--pool", "auto", first, _pool_run(tmp_path / "b.json")]) == 0
    capsys.readouterr()
    for other, words in ((_pool_run(tmp_path / "n.json", max_tokens=24), "s/p has max_tokens 24 in"),
                         (_pool_run(tmp_path / "c.json", prompt_tokens=44), "s/p has prompt tokens 44 in"),
                         (_pool_run(tmp_path / "m.json", model="other.gguf"), "the target model is other.gguf"),
                         (first, "is given twice")):
        assert report.main(["--pool", "auto", first, other]) == 2
        captured = capsys.readouterr()
        assert captured.out == "" and len(captured.err.strip().splitlines()) == 1 and words in captured.err


def test_a_set_no_prompt_of_ran_says_why_and_names_only_sections_there() -> None:
    """It said "no prompt of it finished; see Not run and Notes" for prompts too long for the context,
    in a report with no "Not run" section."""
    def heading(set_info: dict, notes: list[str]) -> str:
        md = report.render_markdown({"sets": [set_info], "summary": {}, "notes": notes, "skipped": {}})
        return next(line for line in md.splitlines() if line.startswith("## long"))

    too_long = {"name": "long", "task": "raw", "prompts": 0, "too_long": 2}
    assert heading(too_long, ["2 prompt(s) longer than the context"]) == \
        "## long (raw: not run: 2 prompt(s) longer than the context minus the max new tokens; see Notes)"
    stopped = [f"{report.STOPPED_NOTE} (Ctrl-C): only the prompts completed before it are included"]
    assert heading({**too_long, "too_long": 0}, stopped) == \
        "## long (raw: no prompt of it finished before the run stopped; see Notes)"
    assert "and the run stopped early; see Notes)" in heading(too_long, stopped)
    assert heading({"name": "long", "task": "raw"}, []) == "## long (raw: no prompt of it finished)"


def test_strict_fails_a_sampled_run_and_says_nothing_was_compared(
        tiny_target: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """--strict with --temperature 0.7 exited 0 with nothing compared (identical: n/a); a set whose prompts
    were all too long for the context had a heading pointing to a "Not run" section that was not there."""
    short = write_jsonl(tmp_path / "short.jsonl", [{"id": "s1", "turns": ["hello there"]}])
    long = write_jsonl(tmp_path / "long.jsonl", [{"id": "l1", "turns": ["hello there " * 300]}])
    out = tmp_path / "out"
    assert main(["bench", "-m", str(tiny_target), "--prompts", f"{short},{long}", "-n", "4", "-c", "256",
                 "-t", "1", "--methods", "vanilla,prompt-lookup", "--temperature", "0.7", "--seed", "3",
                 "--strict", "--out", str(out), "--no-progress", "--no-bandwidth", "--no-warmup",
                 "--peers", ""]) == 3
    err = capsys.readouterr().err
    assert "--strict: 1 sampled output(s) not compared with vanilla's" in err
    data = json.loads((out / "results.json").read_text())
    assert [s["too_long"] for s in data["sets"]] == [0, 1]
    md = (out / "results.md").read_text()
    assert "## long (raw: not run: 1 prompt(s) longer than the context minus the max new tokens; see Notes)" in md
    assert "## Not run" not in md


def test_a_pretty_printed_json_prompt_file_is_told_to_be_jsonl(tmp_path: Path) -> None:
    """A valid JSON file over several lines was "pretty.json:1: not valid JSON (Expecting property name ...)"."""
    pretty = tmp_path / "pretty.json"
    pretty.write_text('{\n  "id": "a",\n  "turns": ["hi"]\n}\n')
    with pytest.raises(ParameterError, match=r"pretty.json: a prompt file is JSONL, one JSON object per line"):
        prompts.load_sets(str(pretty))
    broken = tmp_path / "broken.json"
    broken.write_text('{"id": "a", "turns": ["hi"]}\n{"id": \n')
    with pytest.raises(ParameterError, match=r"broken.json:2: not valid JSON"):
        prompts.load_sets(str(broken))


def test_a_peer_timeout_names_the_limit_as_given(tmp_path: Path) -> None:
    """--peer-timeout 2.7 said "timed out after 3s"."""
    peer = peers.LlamaCppBinPeer("llama.cpp:vanilla", tmp_path, _StubModel(), "t.gguf", n_ctx=512, threads=1,
                                 timeout=0.25)
    try:
        with pytest.raises(OuroborosError, match=r"llama.cpp:vanilla timed out after 0.25s$"):
            peer._run_binary([sys.executable, "-c", "import time; time.sleep(10)"])
    finally:
        peer.close()


def test_progress_in_a_log_is_lines_not_a_bar(tiny_target: Path, tmp_path: Path, capsys, monkeypatch) -> None:
    """Without a terminal the bar was redrawn with carriage returns into the log, one per generation."""
    from ouroboros_local.bench import runner

    pfile = write_jsonl(tmp_path / "p.jsonl", [{"id": str(i), "turns": [f"hello {i}"]} for i in range(3)])
    monkeypatch.setattr(runner._ProgressLines.__init__, "__defaults__", (0.0,))   # a line per update
    main(["bench", "-m", str(tiny_target), "--prompts", str(pfile), "--methods", "vanilla,prompt-lookup",
          "-n", "4", "-t", "1", "--out", str(tmp_path / "out"), "--no-bandwidth"])
    err = capsys.readouterr().err
    assert "\r" not in err and "bench: 6/6 generations done" in err


def test_prompt_paths_expand_a_tilde_and_take_a_whole_name_with_a_comma(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """--prompts=~/p.jsonl said "prompt file not found: ~/p.jsonl"; 'set,v2.jsonl' said "not found: set"."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    row = [{"id": "a", "turns": ["hello"]}]
    write_jsonl(tmp_path / "p.jsonl", row)
    write_jsonl(tmp_path / "set,v2.jsonl", row)
    assert [s.path for s in prompts.load_sets("~/p.jsonl")] == [str(tmp_path / "p.jsonl")]
    assert [s.name for s in prompts.load_sets("set,v2.jsonl")] == ["set,v2"]
    assert [s.path for s in prompts.load_sets("~/set,v2.jsonl")] == [str(tmp_path / "set,v2.jsonl")]
    assert [s.name for s in prompts.load_sets("p.jsonl, ~/p.jsonl")] == ["p", "p-2"]
    with pytest.raises(ParameterError, match="prompt file not found: set$"):   # split where the whole is no file
        prompts.load_sets("set,p.jsonl")


def test_results_json_and_md_take_text_utf8_cannot_encode(tmp_path: Path) -> None:
    """A non-UTF-8 byte in a path (kept as U+DC80-U+DCFF) raised UnicodeEncodeError at the end of a run."""
    name = "caf\udce9.gguf and \ud800"
    path = report.write_json(tmp_path / "results.json", {"file": name, "other": "\u00e9"})
    raw = path.read_bytes()
    assert json.loads(raw.decode("utf-8")) == {"file": name, "other": "\u00e9"}   # valid UTF-8, read back the same
    assert "\u00e9".encode() in raw   # escaped only where UTF-8 cannot encode it
    assert report.readable(f"`{name}`") == "`caf\\xe9.gguf and \\ud800`"


def test_bench_saves_its_results_for_a_non_utf8_path_and_an_out_with_a_tilde(
        tiny_target: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """Every prompt ran, then results.json failed (UnicodeEncodeError) and nothing was saved; --out=~/x wrote
    into a folder named '~' in the working folder."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    pfile = write_jsonl(tmp_path / "pr\udce9.jsonl", [{"id": "a", "turns": ["a b a b a b"]}])
    assert main(["bench", "-m", str(tiny_target), "--prompts", str(pfile), "--methods", "vanilla", "-n", "4",
                 "-c", "256", "-t", "1", "--no-progress", "--no-bandwidth", "--no-warmup", "--peers", "",
                 "--task", "raw", "--out=~/o\udce9"]) == 0
    out = tmp_path / "home" / "o\udce9"
    assert json.loads((out / "results.json").read_text(encoding="utf-8"))["sets"][0]["file"] == str(pfile)
    assert "## pr\\xe9 (raw" in (out / "results.md").read_text(encoding="utf-8")
    assert not (tmp_path / "~").exists()


def test_a_full_stdout_keeps_the_results_files(tiny_target: Path, tmp_path: Path, capsys, monkeypatch) -> None:
    """`bench > /dev/full` ran every prompt, then the table's print raised and nothing was saved."""
    import errno
    import io
    import sys

    class Full(io.StringIO):
        def write(self, text: str) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

    pfile = write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "turns": ["hello there"]}])
    monkeypatch.setattr(sys, "stdout", Full())
    out = tmp_path / "out"
    code = main(["bench", "-m", str(tiny_target), "--prompts", str(pfile), "--methods", "vanilla", "-n", "4",
                 "-t", "1", "--out", str(out), "--no-progress", "--no-bandwidth"])
    assert code == 1 and (out / "results.json").is_file() and (out / "results.md").is_file()
    assert "cannot write the table to standard output (No space left on device)" in capsys.readouterr().err


def test_gpus_llama_cpp_offloads_to_are_named_where_nvidia_smi_is_absent(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Mac's results (Metal) named only the CPU: the machine facts listed nvidia-smi's GPUs alone."""
    from ouroboros_local import llama
    from ouroboros_local.bench import machine
    from ouroboros_local.llama import Device

    monkeypatch.setattr(machine.shutil, "which", lambda name: None)
    found = [Device("CPU", "a CPU", "cpu", 1, 2), Device("MTL0", "Apple M2 Max", "gpu", 2**30, 22 * 2**30)]
    monkeypatch.setattr(llama, "devices", lambda: found)
    assert machine.gpus() == ["Apple M2 Max, 22528 MiB, llama.cpp device MTL0"]
    monkeypatch.setattr(llama, "devices", lambda: found[:1])   # a CPU build: no GPU, as before
    assert machine.gpus() == []

    def no_device_api() -> list[Device]:
        raise AttributeError("libggml has no ggml_backend_dev_count")

    monkeypatch.setattr(llama, "devices", no_device_api)
    assert machine.gpus() == []


def test_an_nvidia_smi_that_fails_names_no_gpu_and_llama_cpp_is_asked(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Its message on stdout ("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA
    driver...", exit status 9) was recorded as the machine's GPU, and titled the chart."""
    from ouroboros_local import llama
    from ouroboros_local.bench import machine
    from ouroboros_local.llama import Device

    stub = tmp_path / "nvidia-smi"
    stub.write_text("#!/bin/sh\necho \"NVIDIA-SMI has failed because it couldn't communicate with the driver\"\n"
                    "exit 9\n")
    stub.chmod(0o755)
    monkeypatch.setattr(machine.shutil, "which", lambda name: str(stub))
    monkeypatch.setattr(llama, "devices", lambda: [Device("Vulkan0", "AMD Radeon RX 7900", "gpu", 1, 2**34)])
    assert machine.gpus() == ["AMD Radeon RX 7900, 16384 MiB, llama.cpp device Vulkan0"]


def test_results_nested_too_deep_or_with_records_naming_no_id_are_refused_in_one_line(tmp_path: Path) -> None:
    """A corrupted file raised RecursionError (too deep for json) or KeyError: 'id' (pooling) in every
    reader of results.json."""
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    no_id = tmp_path / "no_id.json"
    no_id.write_text(json.dumps({"records": [{"set": "s", "label": "vanilla"}], "methods": ["vanilla"]}))
    for path, words in ((deep, "nested too deep"), (no_id, "each naming its set, id and label")):
        with pytest.raises(ParameterError, match=words):
            report.read_results(path)
        again = tmp_path / f"again-{path.name}"
        again.write_bytes(path.read_bytes())
        assert report.main(["--pool", "auto", str(path), str(again)]) == 2


def test_a_cost_curve_holding_a_number_no_float_holds_leaves_the_cost_line_out() -> None:
    """1 and 400 zeros is valid JSON: the cost line's own check of the curve raised OverflowError on it,
    where the cost-curve cache's (calibration.curve_problem, now the one check) refuses it."""
    curve = {"sizes": [1, 4, 8], "seconds": [0.003, 0.003, 10**400], "round_size": 4, "plain_seconds": 0.002,
             "origin": "measured: none cached yet"}
    assert "verify costs" not in report.render_markdown({"settings": {"cost_curves": {"target": curve}}})
    curve["seconds"][2] = 0.005   # the origin bench stores beside the fields is no field of the curve
    assert "a round of 4 1.50; c(8) 2.50" in report.render_markdown({"settings": {"cost_curves": {"target": curve}}})
