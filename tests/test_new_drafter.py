"""A new drafter is one file plus one registry line (issue #17): examples/bigram_drafter.py, registered
with one call, is then scheduled, benchmarked, served and passes the contract checks, with nothing else
touched."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from ouroboros_local import options as opt
from ouroboros_local import proposers
from ouroboros_local.errors import DrafterError, MethodOptionError, ParameterError
from ouroboros_local.proposers.base import Proposer
from ouroboros_local.sampling import SamplingParams
from ouroboros_local.testing.engines import tiny_engine
from ouroboros_local.testing.lossless import assert_first_pairs_follow_the_target
from ouroboros_local.tree import TokenTree

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
PROMPTS = ["def add(a, b):\n    return a + b\n\ndef add(a, b):\n",
           "The quick brown fox jumps over the lazy dog. The quick brown"]


@pytest.fixture
def bigram(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    monkeypatch.setattr(proposers, "_METHODS", dict(proposers._METHODS))   # undone after the test
    proposers.register_method("bigram", "bigram_drafter:create")           # the one registry line
    yield
    sys.modules.pop("bigram_drafter", None)


@pytest.fixture
def engine(tiny_target):
    with tiny_engine(tiny_target, adaptive=True) as eng:   # calibration off: a flat, GPU-like cost curve
        eng.check_kv = True
        yield eng


def test_registered_method_is_greedy_lossless_and_scheduled(bigram, engine) -> None:
    assert "bigram" in proposers.method_names()
    assert proposers.create_method("bigram", engine.drafting_context(), {}).scheduled
    for prompt in PROMPTS:
        base = engine.generate(prompt, max_tokens=32, method="vanilla")
        res = engine.generate(prompt, max_tokens=32, method="bigram", options={"gamma": 5})
        assert res.tokens == base.tokens and res.text == base.text
        assert res.stats.target_passes <= base.stats.target_passes
    assert res.stats.accepted > 0                                   # it drafted, and drafts were accepted
    assert engine.scheduler().estimate("bigram").alpha > 0          # the cost model priced its drafts


def test_registered_method_is_sampling_lossless(bigram, engine, tiny_target) -> None:
    params = SamplingParams(temperature=1.0, top_k=6, top_p=1.0, min_p=0.0)
    assert_first_pairs_follow_the_target(engine, tiny_target, PROMPTS[1], params, 1200, method="bigram")


def test_registered_method_options_are_typed(bigram, engine) -> None:
    with pytest.raises(ParameterError, match="gamma"):
        engine.generate("x", max_tokens=2, method="bigram", options={"gamma": 1000})
    with pytest.raises(ParameterError, match="window"):
        engine.generate("x", max_tokens=2, method="bigram", options={"window": 3})
    with pytest.raises(ParameterError, match="no factory"):
        proposers.register_method("nothing", "bigram_drafter:missing")


def test_registered_method_is_benchmarked(bigram, tiny_target, tmp_path: Path) -> None:
    from ouroboros_local.cli import main

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "task": "raw", "turns": [p], "source": "t", "meta": {}})
                               + "\n" for i, p in enumerate(PROMPTS)))
    out = tmp_path / "out"
    rc = main(["bench", "-m", str(tiny_target), "--prompts", str(prompts), "--methods", "vanilla,bigram",
               "-n", "12", "--out", str(out), "-c", "512", "-b", "64", "-t", "1", "--no-progress",
               "--no-bandwidth", "--strict"])
    assert rc == 0
    labels = [m["label"] for m in json.loads((out / "results.json").read_text())["methods"]]
    assert labels == ["vanilla", "bigram"]


def test_registered_method_is_served(bigram, engine) -> None:
    from fastapi.testclient import TestClient

    from ouroboros_local.server import create_app

    base = engine.generate(PROMPTS[0], max_tokens=8, method="vanilla")
    with TestClient(create_app(engine)) as client:
        ok = client.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0,
                                                  "method": "bigram", "method_options": {"gamma": 4}})
        assert ok.status_code == 200, ok.text
        assert ok.json()["choices"][0]["text"] == base.text
        bad = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "method": "bigram",
                                                   "method_options": {"gamma": 10**9}})
        assert bad.status_code == 400 and "gamma" in bad.json()["error"]["message"]


def test_registered_method_is_listed_in_help(bigram, capsys) -> None:
    from ouroboros_local.cli import build_parser

    for command in ("generate", "chat", "serve"):   # the list was written out by hand: a new method missing
        with pytest.raises(SystemExit):
            build_parser().parse_args([command, "--help"])
        assert "| bigram" in " ".join(capsys.readouterr().out.split())


# ---- a plug-in that breaks the rules: the engine names it, keeps the text exact and the answer whole ----
class _Odd(Proposer):
    """Drafts the bigram's chain; ``how`` picks a misdeed (set per test)."""

    how = ""
    budgets: list[int] = []

    def propose(self, committed, budget):
        _Odd.budgets.append(budget)
        if _Odd.how == "value_error":
            raise ValueError("the drafter's own bug")
        tree = TokenTree.rooted_at(committed[-1])
        if budget:
            tree.add(0, committed[-1])
        return tree

    def end(self):
        if _Odd.how in ("end_error", "value_error"):
            raise RuntimeError("end failed")

    def stats(self):
        if _Odd.how == "stats_error":
            raise KeyError("stats failed")
        return {"odd": 1}


OPTIONS = (opt.GAMMA,)   # the options of this module's plug-ins


def create_odd(ctx, options):   # no name of its own: it goes by the method's
    return _Odd()


def create_picky(ctx, options):   # a factory that checks an option itself, and one with a bug
    if options["gamma"] == 3:
        raise MethodOptionError("gamma must be even")
    raise ValueError("the factory's own bug")


@pytest.fixture
def odd(monkeypatch):
    monkeypatch.setattr(proposers, "_METHODS", dict(proposers._METHODS))
    monkeypatch.setattr(_Odd, "budgets", [])
    proposers.register_method("odd", f"{__name__}:create_odd")
    proposers.register_method("picky", f"{__name__}:create_picky")
    return _Odd


@pytest.mark.parametrize("name, message", [
    ("vanilla", "is a built-in method's"),   # was taken: plain decoding then drafted with the plug-in
    ("auto", "is a built-in method's"),
    ("", "letters, digits"), ("a,b", "letters, digits"),   # unusable in --methods a,b
    (42, "letters, digits"),   # was taken, and every later "unknown method" message a TypeError
])
def test_a_plugin_name_must_be_new_and_usable(odd, name, message) -> None:
    with pytest.raises(ParameterError, match=message):
        proposers.register_method(name, f"{__name__}:create_odd")
    assert "odd" in proposers.method_names() and proposers._METHODS["vanilla"].startswith("ouroboros_local")


NOT_CALLABLE = 42


@pytest.mark.parametrize("factory, message", [
    ("no_such_module_here:create", "cannot import 'no_such_module_here'"),   # a bare ModuleNotFoundError
    (":create", "names no factory function"),         # ValueError: Empty module name
    (".x:create", "cannot import '.x'"),              # TypeError
    (f"{__name__}:NOT_CALLABLE", "names no factory function"),   # failed at the first generation
    ("json:loads", "must declare OPTIONS"),           # as did a module without OPTIONS
])
def test_a_factory_that_cannot_work_is_refused_when_registered(factory, message) -> None:
    with pytest.raises(ParameterError, match=message):
        proposers.register_method("broken", factory)
    assert "broken" not in proposers.method_names()


def test_a_plugin_is_named_by_its_method(odd, engine) -> None:
    res = engine.generate(PROMPTS[0], max_tokens=8, method="odd", options={})
    assert res.stats.method == "odd"   # was "base", shared by every unnamed plug-in (and its estimates)
    assert res.stats.extra["odd"] == 1 and odd.budgets


def test_a_plugins_failing_end_or_stats_neither_hides_an_error_nor_loses_the_answer(odd, engine, caplog) -> None:
    odd.how = "value_error"
    with pytest.raises(ValueError, match="the drafter's own bug"):   # not end()'s RuntimeError
        engine.generate(PROMPTS[0], max_tokens=8, method="odd")
    assert "end() failed too" in caplog.text
    odd.how = "stats_error"
    base = engine.generate(PROMPTS[0], max_tokens=8)
    res = engine.generate(PROMPTS[0], max_tokens=8, method="odd")   # was: the KeyError, the answer lost
    assert res.tokens == base.tokens and "odd" not in res.stats.extra
    assert "its stats are left out: KeyError" in caplog.text


def test_a_factory_refusing_its_options_is_the_requests_fault_a_drafter_error_the_servers(odd, engine) -> None:
    from fastapi.testclient import TestClient

    from ouroboros_local.server import create_app
    from ouroboros_local.server.app import ServerConfig

    with pytest.raises(MethodOptionError, match="gamma must be even"):
        engine.generate("x", max_tokens=2, method="picky", options={"gamma": 3})
    odd.how = "value_error"
    with TestClient(create_app(engine, ServerConfig(method_options={"gamma": 4}))) as client:
        refused = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "method": "picky",
                                                       "method_options": {"gamma": 3}})
        assert refused.status_code == 400 and "gamma must be even" in refused.text
        # the factory's bug on a server started with options of its own was blamed on the request
        buggy = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "method": "picky"})
        assert buggy.status_code == 500, buggy.text
        for options in ({}, {"gamma": 4}):   # a ValueError mid-generation was blamed on the options
            body = {"prompt": PROMPTS[0], "max_tokens": 4, "method": "odd", "method_options": options}
            answer = client.post("/v1/completions", json=body)
            assert answer.status_code == 500, answer.text
        odd.how = ""
        assert client.post("/v1/completions", json={**body, "method_options": {}}).status_code == 200
    from ouroboros_local.server.protocol import engine_error

    assert engine_error(DrafterError("drafter 'x': broke"), user_options=True).status == 500


def test_rounds_of_one_size_count_their_filled_guesses_as_drafted(tiny_target) -> None:
    with tiny_engine(tiny_target, round_size=4) as engine:   # each round filled to 4 tokens with guesses
        for prompt in PROMPTS:
            stats = engine.generate(prompt, max_tokens=24, method="suffix").stats
            assert stats.accepted <= stats.drafted   # was accepted 13 of 12 drafted (108%)
            assert stats.drafted >= 3 * (stats.target_passes - 1)


def test_a_plugin_may_declare_its_options_in_a_list(tmp_path, monkeypatch) -> None:
    """register_method's check took only a tuple, and said "declares no OPTIONS" of a list."""
    import sys

    source = (Path(__file__).parent.parent / "examples" / "bigram_drafter.py").read_text()
    (tmp_path / "bigram_list.py").write_text(source.replace("OPTIONS = (opt.GAMMA,)", "OPTIONS = [opt.GAMMA]"))
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        proposers.register_method("bigram-list", "bigram_list:create")
        assert "bigram-list" in proposers.method_names()
    finally:
        proposers._METHODS.pop("bigram-list", None)
        sys.modules.pop("bigram_list", None)
