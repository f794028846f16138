"""The benchmark's summaries on paired prompts, the runner's per-prompt records, text comparison and the
sweep chart: pure Python, no model."""

from __future__ import annotations

from typing import Any

import pytest

from ouroboros_local.bench import charts, prompts, report, runner
from ouroboros_local.bench.cli import resolve_methods
from ouroboros_local.cli import build_parser
from ouroboros_local.errors import ParameterError

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


def test_a_character_cut_by_the_budget_is_no_difference() -> None:
    """-n cut vanilla's last emoji in its bytes ('\ufffd'); the binary's extra token completed it, and the
    same tokens were reported a mismatch at that character."""
    cut, whole = "\U0001f44d\U0001f31f\U0001f525\ufffd", "\U0001f44d\U0001f31f\U0001f525\U0001f44d"
    assert runner.compare_text(cut, whole, 11, 12, "length") is None
    assert runner.compare_text(cut, cut, 11, 11, "length") is None
    assert runner.compare_text(cut, "\U0001f44d\U0001f31fX", 11, 12, "length") == 2   # a real difference stays
    assert runner.compare_text(cut, whole, 11, 12, "stop") == 3      # vanilla ended by itself: no excuse
    # a cut leaves one replacement character; those before it are the model's own text
    assert runner.compare_text("ab\ufffd\ufffd\ufffd", "abQRS", 5, 6, "length") == 2


def test_a_variant_or_sweep_row_that_never_ran_counts_though_its_method_needs_a_draft() -> None:
    """--variant 'sp2=speculative:{...}' without -d was skipped and --strict passed: only the plain rows
    'all' lists without a draft are exempt."""
    from ouroboros_local.bench.cli import unexpected_skips

    planned = [("speculative", "speculative", {}, False), ("sp2", "speculative", {"gamma": 3}, False),
               ("speculative:gamma=2", "speculative", {"gamma": 2}, False), ("vanilla", "vanilla", {}, False)]
    skipped = {"speculative": "no draft", "sp2": "no draft", "speculative:gamma=2": "no draft"}
    assert unexpected_skips(skipped, planned, has_draft=False) == ["sp2", "speculative:gamma=2"]
    assert unexpected_skips(skipped, planned, has_draft=True) == list(skipped)


def test_method_vanilla_is_vanilla_alone() -> None:
    args = build_parser().parse_args(["bench", "-m", "t.gguf", "--prompts", "a.jsonl", "--method", "vanilla"])
    assert resolve_methods(args, ["vanilla", "speculative", "auto"], []) == ["vanilla"]


@pytest.mark.parametrize("flags, message", [(["--methods", "all", "--method", "vanilla"], "not both"),
                                            (["--methods", " , "], "--methods is empty"),
                                            (["--method", ""], "--method is empty")])
def test_methods_given_twice_or_empty_are_refused(flags, message) -> None:
    """`--methods all --method vanilla` dropped --methods unsaid (all was its default); an empty one ran
    every method."""
    args = build_parser().parse_args(["bench", "-m", "t.gguf", "--prompts", "a.jsonl", *flags])
    with pytest.raises(ParameterError, match=message):
        resolve_methods(args, ["vanilla", "speculative", "auto"], [])


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


def test_vanillas_error_mid_run_keeps_the_prompts_measured_before_it() -> None:
    """A ParameterError from vanilla on one prompt (a configuration problem) once escaped the run and lost
    every prompt measured before it; the run now stops there and says why."""
    def vanilla(engine, prompt, max_tokens, sampling, options):
        if prompt.id == "2":
            raise ParameterError("the prompt is empty")
        return _at_speed()(engine, prompt, max_tokens, sampling, options)

    logs: list[str] = []
    contenders = [runner.FnContender(None, "vanilla", vanilla, None),
                  runner.FnContender(None, "same", _at_speed(), None)]
    run = runner.run_benchmark(_prompts(), contenders, warmup=False, progress=False, log=logs.append)
    assert run.failed == "vanilla failed on s/2: the prompt is empty" and not run.interrupted
    assert sorted({r["id"] for r in run.records}) == ["0", "1"]
    assert logs[-1] == "bench: error: vanilla failed on s/2: the prompt is empty; stopped after 2 prompt(s); " \
                       "writing what was measured"


def test_ctrl_c_before_any_prompt_does_not_promise_a_write() -> None:
    """The log once said "interrupted after 0 prompts; writing what was measured", then "nothing written"."""
    def stops(*args):
        raise KeyboardInterrupt

    logs: list[str] = []
    run = runner.run_benchmark(_prompts(), [runner.FnContender(None, "vanilla", stops, None)], warmup=False,
                               progress=False, log=logs.append)
    assert run.interrupted and logs == ["bench: interrupted before any prompt was measured"]


def test_the_progress_bar_names_a_generation_when_it_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    """The postfix was set without a refresh: during a long generation the bar named the one before it."""
    shown: list[tuple[str, bool]] = []

    class Bar:
        def set_postfix_str(self, text: str, refresh: bool = True) -> None:
            shown.append((text, refresh))

        def update(self, n: int) -> None:
            pass

        def close(self) -> None:
            pass

    monkeypatch.setattr(runner, "_progress", lambda total, enabled, desc="bench": Bar())
    contenders = [runner.FnContender(None, "vanilla", _at_speed(), None)]
    runner.run_benchmark(_prompts(("0", "1")), contenders, warmup=False, log=lambda msg: None)
    assert shown == [("s/0 vanilla", True), ("s/1 vanilla", True)]


def test_the_note_on_others_load_speaks_of_peers_only_where_peers_ran() -> None:
    ours = [{"kind": "ours", "extra": {"others_busy_cores": 0.3}}]
    assert runner.disturbed_note(ours).endswith("while our methods ran: their speeds may read low")
    assert runner.disturbed_note(ours + [{"kind": "peer", "extra": {}}]).endswith("may lean against us")


def test_each_row_records_whether_it_forgets_its_history() -> None:
    """A --variant's reset_pool may differ from the run's --reset-pool; results.json said only the latter."""
    from types import SimpleNamespace

    engine = SimpleNamespace(target=None)
    rows = [runner.EngineContender(engine, label, "suffix", {}, sampling=None, reset_shared=reset)
            for label, reset in (("suffix", False), ("forgets", True))]
    assert [(c.describe()["label"], c.describe()["reset_pool"]) for c in rows] == [("suffix", False), ("forgets", True)]
