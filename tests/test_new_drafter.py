"""A new drafter is one file plus one registry line (issue #17): examples/bigram_drafter.py, registered
with one call, is then scheduled, benchmarked, served and passes the contract checks, with nothing else
touched."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from ouroboros_local import proposers
from ouroboros_local.errors import ParameterError
from ouroboros_local.sampling import SamplingParams
from ouroboros_local.testing.engines import tiny_engine
from ouroboros_local.testing.lossless import assert_first_pairs_follow_the_target

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
    assert_first_pairs_follow_the_target(engine, tiny_target, PROMPTS[1], params, 400, method="bigram")


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
