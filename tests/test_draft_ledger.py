"""scripts/draft_ledger.py: each verified draft of a real run, netted against its neighbouring plain steps."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from ouroboros_local.engine import Engine, EngineConfig
from ouroboros_local.llama import Model
from ouroboros_local.scheduler import Scheduler

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "draft_ledger.py"
spec = importlib.util.spec_from_file_location("draft_ledger", SCRIPT)
draft_ledger = importlib.util.module_from_spec(spec)
spec.loader.exec_module(draft_ledger)


def draft(accepted: int, gain: float = 1.1, probe: str | None = None) -> dict:
    return {"source": "x", "first": "c", "n": 2, "expected": 1.0, "gain": gain, "probe": probe,
            "accepted": accepted}


def test_a_drafted_round_is_priced_by_the_plain_steps_around_it() -> None:
    # a slow spell: the drafted round is dear against the run's median step, not against its neighbours
    rounds = ([{"seconds": 1.0, "draft": None}] * 10 + [{"seconds": 2.0, "draft": None}] * 3
              + [{"seconds": 5.0, "draft": draft(2)}] + [{"seconds": 2.0, "draft": None}] * 3)
    [priced] = draft_ledger.net_steps(rounds)
    assert priced["steps"] == pytest.approx(2.5) and priced["net"] == pytest.approx(0.5)
    lone = draft_ledger.net_steps([{"seconds": 3.0, "draft": draft(0)}])   # no plain step: its own
    assert lone[0]["net"] == pytest.approx(0.0)


def test_the_summary_splits_drafts_by_predicted_gain_and_probes_by_phase() -> None:
    drafts = [dict(draft(1, gain=1.1), net=0.5), dict(draft(0, gain=1.3), net=-1.5),
              dict(draft(0, gain=0.6, probe="early"), net=-1.4), dict(draft(2, gain=0.7, probe="late"), net=0.6),
              dict(draft(3, gain=0.0), source=draft_ledger.UNLABELLED, net=1.0)]
    rows = {kind: rest for kind, *rest in draft_ledger.summary_rows(drafts)}
    assert rows["drafts, predicted 1.05-1.20x"][0] == 1 and rows["drafts, predicted 1.20-1.50x"][3] == -1.5
    assert rows["probes, early"][:2] == [1, 0] and rows["probes, late"][1] == 2
    assert rows["drafts not priced by class"][:2] == [1, 3]
    assert rows["all drafted rounds"][0] == 5 and rows["all drafted rounds"][3] == pytest.approx(-0.8)
    assert "drafts, predicted 0.00-1.00x" not in rows   # empty groups are left out


def test_a_run_logs_every_round_and_leaves_the_engine_as_it_was(tiny_target: Path) -> None:
    trim, run_round = Scheduler.trim, Engine._round
    eng = Engine(Model(tiny_target), None, EngineConfig(n_ctx=512, n_batch=64, n_seq_max=8, learned=False))
    try:
        text = "one two three four five six seven eight nine ten " * 6
        ledger = draft_ledger.run(eng, {"repeated": [text] * 3}, "auto", max_tokens=48)
    finally:
        eng.close()
    assert Scheduler.trim is trim and Engine._round is run_round
    entry = ledger["repeated"]
    assert entry["rounds"] > len(entry["drafts"])
    for d in entry["drafts"]:
        assert 0 <= d["accepted"] <= d["n"] and d["steps"] > 0
    # a repeated request copies its earlier answer: labelled drafts, accepted
    assert any(d["source"] in ("prompt-lookup", "suffix") and d["accepted"] > 0 for d in entry["drafts"])
