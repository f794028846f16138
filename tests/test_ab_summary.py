"""scripts/ab_summary.py: two settings' speed-ups and time splits over several bench runs."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "ab_summary.py"
spec = importlib.util.spec_from_file_location("ab_summary", SCRIPT)
ab_summary = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ab_summary)


def _run(root: Path, name: str, speedup: float, propose_ms: float) -> None:
    from ouroboros_local.time_split import PARTS

    split = {part: {"ms": 0.0, "rounds": 0.0} for part in PARTS}
    split["plain"] = {"ms": 600.0, "rounds": 100.0}
    split["propose"]["ms"] = propose_ms
    summary = {"gsm8k": {"vanilla": {"speedup": 1.0, "time_split": None},
                         "auto": {"speedup": speedup, "time_split": split}}}
    (root / name).mkdir()
    (root / name / "results.json").write_text(json.dumps({"summary": summary, "records": []}))


def test_each_setting_gets_its_mean_speedup_and_time_split(tmp_path: Path, capsys) -> None:
    _run(tmp_path, "s-a1", 0.90, 20.0)
    _run(tmp_path, "s-b1", 1.00, 2.0)
    _run(tmp_path, "s-b2", 1.02, 4.0)
    _run(tmp_path, "s-a2", 0.94, 30.0)
    assert ab_summary.main([str(tmp_path), "s-a1", "s-b1", "s-b2", "s-a2"]) == 0
    out = capsys.readouterr().out
    assert "| auto | s-a | 0.92x (0.90-0.94) |" in out and "| auto | s-b | 1.01x (1.00-1.02) |" in out
    split_a = next(line for line in out.splitlines() if line.startswith("| gsm8k | auto | s-a | 600.0"))
    assert "| 25.0 |" in split_a and split_a.endswith("| 625.0 |")      # propose: the mean of 20 and 30
    split_b = next(line for line in out.splitlines() if line.startswith("| gsm8k | auto | s-b | 600.0"))
    assert split_b.endswith("| 603.0 |")


def test_run_folders_named_with_a_trailing_slash_keep_their_setting(tmp_path: Path, capsys) -> None:
    """Tab-completed names (s-a1/ s-b1/) made each run a setting of its own."""
    for name, speedup in (("s-a1", 0.90), ("s-b1", 1.00), ("s-a2", 0.94)):
        _run(tmp_path, name, speedup, 2.0)
    assert ab_summary.main([str(tmp_path), "s-a1/", "s-b1/", "s-a2/"]) == 0
    out = capsys.readouterr().out
    assert "| auto | s-a | 0.92x (0.90-0.94) |" in out and "| auto | s-b | 1.00x (1.00-1.00) |" in out


def _with_records(root: Path, name: str, prompt: str, max_tokens: int, model: str = "t.gguf") -> None:
    _run(root, name, 1.0, 2.0)
    path = root / name / "results.json"
    payload = json.loads(path.read_text())
    payload["records"] = [{"set": "gsm8k", "id": "1", "label": "auto", "kind": "ours", "prompt": prompt,
                           "max_tokens": max_tokens}]
    payload["models"] = {"target": {"file": model}}
    path.write_text(json.dumps(payload))


def test_runs_of_other_prompts_or_budgets_are_refused_and_the_settings_models_may_differ(tmp_path: Path,
                                                                                          capsys) -> None:
    """A run of other prompts (or another -n) was averaged in as one more run of its setting."""
    from ouroboros_local.errors import OuroborosError

    _with_records(tmp_path, "s-a1", "two plus two?", 16)
    _with_records(tmp_path, "s-b1", "two plus two?", 16, model="other.gguf")   # the A/B of two models
    _with_records(tmp_path, "s-a2", "two plus two?", 16)
    assert ab_summary.main([str(tmp_path), "s-a1", "s-b1", "s-a2"]) == 0
    _with_records(tmp_path, "s-b2", "two plus three?", 16, model="other.gguf")
    with pytest.raises(OuroborosError, match="gsm8k/1 has another prompt in s-b2"):
        ab_summary.main([str(tmp_path), "s-a1", "s-b1", "s-b2", "s-a2"])
    _with_records(tmp_path, "s-a3", "two plus two?", 32)
    with pytest.raises(OuroborosError, match="max_tokens 32 in s-a3"):
        ab_summary.main([str(tmp_path), "s-a1", "s-b1", "s-a3"])
    _with_records(tmp_path, "s-a4", "two plus two?", 16, model="other.gguf")
    with pytest.raises(OuroborosError, match="target model is other.gguf in s-a4"):
        ab_summary.main([str(tmp_path), "s-a1", "s-a4"])
    with pytest.raises(OuroborosError, match="given twice"):
        ab_summary.main([str(tmp_path), "s-a1", "s-b1", "s-a1/"])


def test_the_round_switch_is_summed_per_setting(tmp_path: Path, capsys) -> None:
    """How often rounds of K gave way to plain steps, and at what timed cost: what an H200 run lacked to
    tell why rounds of 4 went on where they lost (docs/reports/h200-h)."""
    for name, plain, timed in (("s-a1", 30, 1.7), ("s-b1", 0, None)):
        _run(tmp_path, name, 1.0, 2.0)
        path = tmp_path / name / "results.json"
        payload = json.loads(path.read_text())
        switch = {"plain_rounds": plain, "changes": 2, "calibrated_ratio": 1.3}
        if timed:
            switch["timed_ratio"] = timed
        payload["records"] = [{"set": "gsm8k", "id": str(i), "method": "auto", "label": "auto", "target_passes": 60,
                               "extra": {"round_switch": switch}} for i in range(2)]
        # a --variant of prompt-lookup: a row of its own, as in the tables above
        payload["records"].append({"set": "gsm8k", "id": "0", "method": "prompt-lookup", "label": "pl1",
                                   "target_passes": 10, "extra": {"round_switch": {**switch, "plain_rounds": 1}}})
        path.write_text(json.dumps(payload))
    assert ab_summary.main([str(tmp_path), "s-a1", "s-b1"]) == 0
    out = capsys.readouterr().out
    assert "| gsm8k | auto | s-a | 50% | 2.00 | 1.70 | 1.30 |" in out
    assert "| gsm8k | auto | s-b | 0% | 2.00 | – | 1.30 |" in out
    assert "| gsm8k | pl1 | s-b | 10% | 2.00 | – | 1.30 |" in out and "| prompt-lookup |" not in out
