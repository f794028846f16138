"""scripts/*.py on bad input: one line `error: ...` on stderr and exit status 2, never a traceback, and
nothing written; the checks each script makes of what it is given (runs, slices, budgets) and its help."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest

from ouroboros_local.errors import OuroborosError

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"
NO_MODEL = "/nonexistent/model.gguf"   # a script that checks its input first never loads it


def load_script(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_script(name: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OUROBOROS_OFFLINE": "1", "PYTHONPATH": str(ROOT),
           "OUROBOROS_CALIBRATION_FILE": str(cwd / "cal.json"), "OUROBOROS_ESTIMATES_FILE": str(cwd / "est.json")}
    return subprocess.run([sys.executable, str(SCRIPTS / f"{name}.py"), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=60, check=False)


def assert_one_line_error(done: subprocess.CompletedProcess, *words: str) -> str:
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    assert all(word in lines[0] for word in words), lines[0]
    return lines[0]


def record(label: str, seconds: float = 1.0, name: str = "gsm8k") -> dict:
    return {"set": name, "id": "p0", "label": label, "tokens": 10, "decode_seconds": seconds, "error": None}


@pytest.fixture
def files(tmp_path: Path) -> Path:
    """tmp_path with the inputs the bad-input cases name."""
    (tmp_path / "empty.json").write_text("")
    (tmp_path / "wrong.json").write_text(json.dumps({"x": 1}))
    (tmp_path / "results.json").write_text(json.dumps({"records": [record("vanilla"), record("auto", 0.5)]}))
    (tmp_path / "ab" / "s-a1").mkdir(parents=True)
    (tmp_path / "ab" / "s-a1" / "results.json").write_text("{}")
    (tmp_path / "two.jsonl").write_text("".join(json.dumps({"id": f"q{i}", "turns": [f"question {i}"]}) + "\n"
                                                for i in range(2)))
    return tmp_path


BAD_INPUTS = {
    "pool_runs, a missing file": ("pool_runs", ["results.json", "nosuch.json"], ["nosuch.json"]),
    "pool_runs, an empty file": ("pool_runs", ["results.json", "empty.json"], ["empty.json"]),
    "pool_runs, not a results file": ("pool_runs", ["results.json", "wrong.json"], ["wrong.json"]),
    "ab_summary, a missing run": ("ab_summary", ["ab", "nosuch"], ["nosuch"]),
    "ab_summary, a run without a summary": ("ab_summary", ["ab", "s-a1"], ["s-a1"]),
    "replay_auto, missing answers": ("replay_auto", ["-m", NO_MODEL, "--answers", "nosuch.json"], ["nosuch.json"]),
    "replay_auto, empty answers": ("replay_auto", ["-m", NO_MODEL, "--answers", "empty.json"], ["empty.json"]),
    "replay_auto, a results file as answers": (
        "replay_auto", ["-m", NO_MODEL, "--answers", "results.json"], ["results.json"]),
    "copy_bound, empty outputs": (
        "copy_bound", ["-m", NO_MODEL, "--prompts", "two.jsonl", "--outputs", "empty.json"], ["empty.json"]),
    "copy_bound, a missing prompt file": ("copy_bound", ["-m", NO_MODEL, "--prompts", "nosuch.jsonl"], ["nosuch"]),
    "draft_ledger, missing estimates": (
        "draft_ledger", ["-m", NO_MODEL, "--prompts", "two.jsonl", "--estimates", "nosuch.json"], ["nosuch.json"]),
    "draft_ledger, estimates not JSON": (
        "draft_ledger", ["-m", NO_MODEL, "--prompts", "two.jsonl", "--estimates", "empty.json"], ["empty.json"]),
    "bridge_cost, a missing text": (
        "bridge_cost", ["-m", NO_MODEL, "-d", NO_MODEL, "-f", "nosuch.py"], ["nosuch.py"]),
    "hot_path_bench, a missing prompt file": (
        "hot_path_bench", ["engine", "-m", NO_MODEL, "-f", "nosuch.txt"], ["nosuch.txt"]),
    "context_size, sizes not numbers": (
        "context_size", ["-m", NO_MODEL, "--prompts", "two.jsonl", "--sizes", "1k"], ["--sizes", "1k"]),
    "context_size, a missing prompt file": (
        "context_size", ["-m", NO_MODEL, "--prompts", "nosuch.jsonl"], ["nosuch"]),
    "learn_copy_priors, a malformed slice": (
        "learn_copy_priors", ["-m", NO_MODEL, "--prompts", "two.jsonl:a:b", "--out", "priors.json"],
        ["two.jsonl:a:b"]),
    "a missing model (the package's own error)": (
        "replay_auto", ["-m", NO_MODEL, "--answers", "answers.json"], ["model"]),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_one_line_and_exit_status_2(files: Path, case: str) -> None:
    script, args, words = BAD_INPUTS[case]
    (files / "answers.json").write_text(json.dumps([{"set": "s", "id": "a", "prompt": [1, 2], "answer": [3]}]))
    assert_one_line_error(run_script(script, *args, cwd=files), *words)


def test_a_slice_that_selects_no_prompt_writes_no_priors(files: Path) -> None:
    done = run_script("learn_copy_priors", "-m", NO_MODEL, "--prompts", "two.jsonl:400:460",
                      "--out", "priors.json", cwd=files)
    assert_one_line_error(done, "two.jsonl:400:460", "selects no prompt", "2")
    assert not (files / "priors.json").exists()


def test_a_reference_no_run_has_is_refused_naming_the_labels(files: Path) -> None:
    (files / "again.json").write_text((files / "results.json").read_text())
    done = run_script("pool_runs", "results.json", "again.json", "--reference", "Vanilla", cwd=files)
    assert_one_line_error(done, "Vanilla", "vanilla", "auto")


def test_a_run_without_a_timed_record_is_named_not_bracketed(files: Path) -> None:
    (files / "failed.json").write_text(json.dumps({"records": [{**record("vanilla"), "error": "boom"}]}))
    (files / "again.json").write_text((files / "results.json").read_text())
    done = run_script("pool_runs", "results.json", "failed.json", "again.json", cwd=files)
    assert done.returncode == 0, done.stderr
    assert "| gsm8k | 2.00x (2.00 / 2.00) |" in done.stdout
    assert "in brackets: run 1 / run 3" in done.stdout and "run 2 (failed.json)" in done.stdout


def test_copy_bound_records_the_budget_of_each_answer() -> None:
    engine = SimpleNamespace(generate=lambda tokens, max_tokens, method: SimpleNamespace(tokens=[7, 8]))
    built = [SimpleNamespace(set_name="s", id="a", tokens=(1, 2), max_tokens=16)]
    (answer,) = load_script("copy_bound").greedy_answers(engine, built)
    assert answer == {"set": "s", "id": "a", "prompt": [1, 2], "answer": [7, 8], "max_tokens": 16}


def test_replay_auto_replays_at_the_recorded_budget_and_refuses_another() -> None:
    budget = load_script("replay_auto").answers_budget
    recorded = [{"set": "s", "max_tokens": 16}]
    assert budget(recorded, None) == 16 and budget(recorded, 16) == 16
    with pytest.raises(OuroborosError, match="-n 32: the answers were generated with -n 16"):
        budget(recorded, 32)
    with pytest.raises(OuroborosError, match="different budgets"):
        budget(recorded + [{"set": "t", "max_tokens": 64}], None)
    old = [{"set": "s"}]   # written before copy_bound.py recorded the budget: no check
    assert budget(old, 32) == 32 and budget(old, None) == 128


def test_replay_auto_refuses_another_budget_before_loading_a_model(files: Path) -> None:
    (files / "answers.json").write_text(json.dumps(
        [{"set": "s", "id": "a", "prompt": [1, 2], "answer": [3], "max_tokens": 16}]))
    done = run_script("replay_auto", "-m", NO_MODEL, "--answers", "answers.json", "-n", "128", cwd=files)
    assert_one_line_error(done, "-n 128", "-n 16")


@pytest.mark.parametrize("script", ["compare_runs", "ab_summary"])
def test_help_prints_what_the_script_does(tmp_path: Path, script: str) -> None:
    done = run_script(script, "--help", cwd=tmp_path)
    assert done.returncode == 0 and done.stdout.startswith(load_script(script).__doc__.strip()[:60]), done


def test_draft_ledgers_usage_names_the_draft_option() -> None:
    usage = load_script("draft_ledger").__doc__.split("\n\n")[1]
    assert "-d DRAFT" in usage


def test_pool_runs_refuses_runs_of_other_prompts_and_a_file_twice(files: Path) -> None:
    """A chat -n 24 run pooled with a --no-chat -n 16 one, or a file with itself, was pooled without a word."""
    def run_file(name: str, max_tokens: int) -> str:
        recs = [{**record(label, seconds), "kind": "ours", "max_tokens": max_tokens}
                for label, seconds in (("vanilla", 1.0), ("auto", 0.5))]
        (files / name).write_text(json.dumps({"records": recs}))
        return name

    assert run_script("pool_runs", run_file("a.json", 24), run_file("b.json", 24), cwd=files).returncode == 0
    assert_one_line_error(run_script("pool_runs", "a.json", run_file("c.json", 16), cwd=files),
                          "the runs measured different things", "gsm8k/p0 has max_tokens 16 in c.json, 24 in a.json")
    assert_one_line_error(run_script("pool_runs", "a.json", "./a.json", cwd=files), "./a.json is given twice")


def test_pool_runs_brackets_keep_one_place_per_run(files: Path) -> None:
    """A method timed in run 2 only showed its ratio in run 1's place."""
    (files / "one.json").write_text(json.dumps({"records": [record("vanilla"), record("prompt-lookup", 0.5)]}))
    (files / "two.json").write_text(json.dumps({"records": [record("vanilla"), record("suffix", 0.25)]}))
    done = run_script("pool_runs", "one.json", "two.json", cwd=files)
    assert done.returncode == 0, done.stderr
    assert "| gsm8k | 2.00x (2.00 / –) | 4.00x (– / 4.00) |" in done.stdout
    assert "in brackets: run 1 / run 2" in done.stdout


def test_a_reader_that_goes_away_ends_the_scripts_quietly(files: Path) -> None:
    """`| head -1` printed a BrokenPipeError traceback (compare_runs, pool_runs, ab_summary)."""
    text_run = [{**record(label), "match": match, "text": "x"} for label, match in (("vanilla", "reference"),
                                                                                    ("auto", "identical"))]
    (files / "text.json").write_text(json.dumps({"records": text_run}))
    (files / "again.json").write_text((files / "results.json").read_text())
    (files / "ab" / "s-b1").mkdir()
    summary = {"gsm8k": {"vanilla": {"speedup": 1.0}, "auto": {"speedup": 1.5}}}
    for run in ("s-a1", "s-b1"):
        (files / "ab" / run / "results.json").write_text(json.dumps({"summary": summary, "records": []}))
    for script, args in (("pool_runs", ["results.json", "again.json"]), ("compare_runs", ["text.json", "text.json"]),
                         ("ab_summary", ["ab", "s-a1", "s-b1"])):
        done = run_into_closed_pipe(script, *args, cwd=files)
        assert (done.returncode, done.stderr) == (0, ""), (script, done.stderr)


def run_into_closed_pipe(name: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    """A script run with its stdout a pipe whose reader has gone (`| head -1` after its line)."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    env = {**os.environ, "OUROBOROS_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    try:
        return subprocess.run([sys.executable, str(SCRIPTS / f"{name}.py"), *args], cwd=cwd, env=env,
                              stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=60, check=False)
    finally:
        os.close(write_end)
