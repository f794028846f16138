"""scripts/ab_summary.py: two settings' speed-ups and time splits over several bench runs."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

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
    (root / name / "results.json").write_text(json.dumps({"summary": summary}))


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
