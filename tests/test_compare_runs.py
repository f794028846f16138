"""scripts/compare_runs.py: two --save-text runs' outputs compared, with a documented exit status."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "compare_runs.py"
spec = importlib.util.spec_from_file_location("compare_runs", SCRIPT)
compare_runs = importlib.util.module_from_spec(spec)
spec.loader.exec_module(compare_runs)


def rec(pid: str, label: str, text: str | None, match: str, set_name: str = "p") -> dict:
    r = {"set": set_name, "id": pid, "label": label, "match": match}
    if text is not None:
        r["text"] = text
    return r


def write(path: Path, records: list[dict]) -> str:
    path.write_text(json.dumps({"records": records, "methods": []}))
    return str(path)


RUN = [rec("a", "vanilla", "x", "reference"), rec("a", "pl", "x", "identical"),
       rec("b", "vanilla", "y", "reference"), rec("b", "pl", "y", "identical")]


def test_identical_runs_pass(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    run = write(tmp_path / "a.json", RUN)
    assert compare_runs.main([run, run]) == 0
    assert capsys.readouterr().out.splitlines() == ["pl: 2/2 identical", "vanilla: 2/2 identical"]


def test_a_mismatch_fails_even_when_both_runs_wrote_it(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """The same lossy output in both runs once printed "2/2 identical" and exited 0."""
    lossy = [r if r["label"] == "vanilla" else {**r, "text": r["text"] + " WRONG", "match": "mismatch"} for r in RUN]
    run = write(tmp_path / "m.json", lossy)
    assert compare_runs.main([run, run]) == 1
    assert "pl: 2/2 identical; a MISMATCH against vanilla in either run: 2" in capsys.readouterr().out


def test_outputs_in_one_run_only_are_named_and_runs_sharing_none_are_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A prompt missing from AFTER went unmentioned; runs sharing nothing printed nothing and exited 0."""
    before = write(tmp_path / "a.json", RUN)
    fewer = write(tmp_path / "f.json", [r for r in RUN if r["id"] == "a"])
    assert compare_runs.main([before, fewer]) == 0
    assert "only in BEFORE: 2 output(s), not compared: p/b pl, p/b vanilla" in capsys.readouterr().out
    renamed = write(tmp_path / "o.json", [{**r, "set": "other"} for r in RUN])
    assert compare_runs.main([before, renamed]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "error: the runs share no output (set, id, method)" in captured.err


def test_unreadable_files_are_one_line_errors(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    good = write(tmp_path / "a.json", RUN)
    truncated = tmp_path / "t.json"
    truncated.write_text(Path(good).read_text()[:40])
    no_text = write(tmp_path / "n.json", [{k: v for k, v in r.items() if k != "text"} for r in RUN])
    for files, message in (([str(tmp_path / "nope.json"), good], "results file not found: "),
                           ([str(truncated), good], "t.json is not JSON"),
                           ([good, write(tmp_path / "x.json", [])][::-1], "the runs share no output"),
                           ([good, no_text], "n.json: run the benchmark with --save-text")):
        assert compare_runs.main(files) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_failed_generations_are_listed_not_refused(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A --save-text run with one failed peer generation (no text) was refused: "run with --save-text"."""
    flaky = RUN + [rec("a", "llama.cpp:vanilla", "x", "identical"),
                   {**rec("b", "llama.cpp:vanilla", None, "error"), "error": "OuroborosError: exited with 1"}]
    run = write(tmp_path / "e.json", flaky)
    assert compare_runs.main([run, run]) == 0
    assert "llama.cpp:vanilla: 1/1 identical; not compared (failed in either run): p/b llama.cpp:vanilla" \
        in capsys.readouterr().out


def test_runs_of_other_prompts_are_refused_not_compared(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A chat -n 24 run against a --no-chat -n 16 one printed "vanilla: 0/2 identical", as if a code change
    had altered vanilla."""
    def measured(name: str, prompt: str, max_tokens: int) -> str:
        return write(tmp_path / name, [{**r, "kind": "ours", "prompt": f"{prompt} {r['id']}",
                                        "max_tokens": max_tokens} for r in RUN])

    chat = measured("chat.json", "<|im_start|>user", 24)
    assert compare_runs.main([chat, measured("same.json", "<|im_start|>user", 24)]) == 0
    capsys.readouterr()
    for other, words in ((measured("plain.json", "plain", 24), "p/a has another prompt in"),
                         (measured("short.json", "<|im_start|>user", 16), "p/a has max_tokens 16 in")):
        assert compare_runs.main([chat, other]) == 2
        captured = capsys.readouterr()
        assert captured.out == "" and len(captured.err.strip().splitlines()) == 1
        assert captured.err.startswith("error: the runs measured different things: ") and words in captured.err
