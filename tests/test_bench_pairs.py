"""The benchmark's summaries on paired prompts, the runner's per-prompt records, text comparison and the
sweep chart: pure Python, no model."""

from __future__ import annotations

from typing import Any

import pytest

from ouroboros_local.bench import charts, prompts, report, runner
from ouroboros_local.bench.cli import resolve_methods
from ouroboros_local.cli import build_parser

SPEED = {"0": 100.0, "1": 100.0, "2": 100.0, "3": 10.0}   # tokens per second; prompt 3 is slow


def _at_speed(fail_on: tuple[str, ...] = (), tokens: tuple[int, ...] = (5, 6, 7)):
    """A method that decodes each prompt at SPEED, failing on ``fail_on``."""
    def fn(engine, prompt, max_tokens, sampling, options):
        if prompt.id in fail_on:
            raise RuntimeError("timed out")
        stats = runner.empty_stats("fake")
        stats.update(tokens=len(tokens), decode_seconds=len(tokens) / SPEED[prompt.id], target_passes=len(tokens))
        return runner.Outcome(tokens=list(tokens), text="x", stats=stats)
    return fn


def _prompts(ids=tuple(SPEED)) -> list[prompts.BuiltPrompt]:
    return [prompts.BuiltPrompt("s", i, "raw", "x", [1, 2, 3], False, 3) for i in ids]


def _summary(contenders: list[runner.Contender]) -> dict[str, dict[str, Any]]:
    run = runner.run_benchmark(_prompts(), contenders, warmup=False, progress=False, log=lambda msg: None)
    return report.summarize(run.records, run.contenders, None)["s"]


def test_speedup_pairs_prompts_both_ran() -> None:
    """A method as fast as vanilla that failed on the slowest prompt once came out 3.25x: its tok/s
    pooled its successes against vanilla's pooled over all four prompts."""
    summary = _summary([runner.FnContender(None, "vanilla", _at_speed(), None),
                        runner.FnContender(None, "same-speed", _at_speed(fail_on=("3",)), None)])
    row = summary["same-speed"]
    assert row["speedup"] == pytest.approx(1.0) and row["paired"] == 3 and row["prompts"] == 3
    assert summary["vanilla"]["speedup"] == pytest.approx(1.0) and summary["vanilla"]["paired"] == 4
    table = report.render_markdown({"summary": {"s": summary}, "sets": []})
    assert "| 1.00x (on 3/4 prompts) |" in table and "| vanilla | 30.8 | 1.00x |" in table


def test_speedup_when_vanilla_failed_covers_the_prompts_both_ran() -> None:
    summary = _summary([runner.FnContender(None, "vanilla", _at_speed(fail_on=("3",)), None),
                        runner.FnContender(None, "same-speed", _at_speed(), None)])
    assert summary["same-speed"]["speedup"] == pytest.approx(1.0) and summary["same-speed"]["paired"] == 3


def test_a_peers_speedup_against_its_own_vanilla_is_paired_too() -> None:
    def rec(label: str, pid: str, seconds: float, error: str | None = None) -> dict[str, Any]:
        return {"set": "s", "id": pid, "label": label, "timed_tokens": 10, "decode_seconds": seconds, "error": error,
                "match": "error" if error else "identical"}

    records = [rec("vanilla", p, 1.0) for p in "01"] + [rec("own", "0", 1.0), rec("own", "1", 9.0, error="boom"),
                                                        rec("pld", "0", 0.5), rec("pld", "1", 4.5)]
    contenders = [{"label": "vanilla"}, {"label": "own", "kind": "peer", "baseline": "own"},
                  {"label": "pld", "kind": "peer", "baseline": "own"}]
    pld = report.summarize(records, contenders, None)["s"]["pld"]
    assert pld["speedup_vs_baseline"] == pytest.approx(2.0)      # prompt 0 only: own failed on prompt 1


def test_unchecked_outputs_are_not_identical() -> None:
    """A method that failed on every prompt once had all_identical None and passed --strict."""
    summary = _summary([runner.FnContender(None, "vanilla", _at_speed(), None),
                        runner.FnContender(None, "broken", _at_speed(fail_on=tuple(SPEED)), None),
                        runner.FnContender(None, "flaky", _at_speed(fail_on=("3",)), None)])
    assert summary["broken"]["unchecked"] == 4 and summary["broken"]["all_identical"] is False
    assert report.identical_cell(summary["broken"]) == "4 unchecked"
    assert summary["flaky"]["all_identical"] is False and report.identical_cell(summary["flaky"]) == "3/3, 1 unchecked"
    assert summary["vanilla"]["all_identical"] is True and report.identical_cell(summary["vanilla"]) == "reference"


def test_ctrl_c_while_a_prompt_is_classified_drops_that_prompt() -> None:
    """Ctrl-C during the tie rule's replay of prompt 1 once kept its records for the contenders classified
    before it: the summary then pooled prompt 1 for some rows only."""
    real = runner.classify

    def interrupted(engine, prompt, ref, got, tolerance):
        if prompt.id == "1" and got.tokens[-1] == 8:
            raise KeyboardInterrupt
        return real(engine, prompt, ref, got, tolerance)

    contenders = [runner.FnContender(None, "vanilla", _at_speed(), None),
                  runner.FnContender(None, "same", _at_speed(), None),
                  runner.FnContender(None, "differs", _at_speed(tokens=(5, 6, 8)), None)]
    mp = pytest.MonkeyPatch()
    mp.setattr(runner, "classify", interrupted)
    try:
        run = runner.run_benchmark(_prompts(), contenders, warmup=False, progress=False, log=lambda msg: None)
    finally:
        mp.undo()
    assert run.interrupted
    assert sorted((r["id"], r["label"]) for r in run.records) == [("0", "differs"), ("0", "same"), ("0", "vanilla")]


def test_a_peers_text_past_vanillas_end_counts_only_where_the_budget_stopped_vanilla() -> None:
    """A llama.cpp binary overshoots -n by a token; that allowance once also excused text past a vanilla
    that had stopped by itself (an end-of-generation token)."""
    assert runner.compare_text("abc", "abcdef", 3, 5, "length") is None
    assert runner.compare_text("abc", "abcdef", 3, 5, "stop") == 3
    assert runner.compare_text("abc", "abcdef", 3, 5) == 3
    assert runner.compare_text("abcdef", "abc", 6, 3, "length") == 3
    assert runner.compare_text("abc", "abX", 3, 3, "length") == 2


def test_method_vanilla_is_vanilla_alone() -> None:
    args = build_parser().parse_args(["bench", "-m", "t.gguf", "--prompts", "a.jsonl", "--method", "vanilla"])
    assert resolve_methods(args, ["vanilla", "speculative", "auto"], []) == ["vanilla"]


class _FakeAxes:
    def __init__(self) -> None:
        self.lines: list[tuple[list[Any], list[float]]] = []

    def plot(self, xs, ys, **kwargs) -> None:
        self.lines.append((list(xs), list(ys)))

    def __getattr__(self, name: str):
        return lambda *args, **kwargs: None


class _FakePyplot:
    def __init__(self) -> None:
        self.ax = _FakeAxes()

    def subplots(self, **kwargs):
        fig = type("Fig", (), {"tight_layout": lambda self: None, "savefig": lambda self, *a, **k: None})()
        return fig, self.ax

    def close(self, fig) -> None:
        pass


def test_sweep_points_are_drawn_in_increasing_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """--sweep gamma=4,1,2 once drew its line 4 -> 1 -> 2."""
    plt = _FakePyplot()
    monkeypatch.setattr(charts, "_pyplot", lambda: plt)
    values = [4, 1, 2]
    sweep = {"param": "gamma", "labels": {f"m[gamma={v}]": {"method": "m", "value": v} for v in values}}
    summary = {"s": {f"m[gamma={v}]": {"speedup": float(v)} for v in values}}
    assert charts.plot_sweep(summary, sweep, "unused.png")
    assert plt.ax.lines == [([1, 2, 4], [1.0, 2.0, 4.0])]
