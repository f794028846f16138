"""learned.py: the scheduler's estimates kept across processes (saved, bounded, restored scaled down)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from ouroboros_local.acceptance import Acceptance, ConfidenceTable
from ouroboros_local.calibration import CostModel
from ouroboros_local import learned as learned_module
from ouroboros_local.filestore import file_identity
from ouroboros_local.learned import (MAX_ENTRIES, PRIOR_SOURCES, PRIOR_WEIGHT, RESTORE_WEIGHT, LearnedEstimates,
                                     copy_priors, estimates_key)
from ouroboros_local.scheduler import Scheduler
from ouroboros_local.tree import TokenTree

CPU = CostModel(sizes=[1, 2, 4, 8, 16], seconds=[1.0, 1.7, 3.0, 5.5, 9.5])


def chain(classes: list[str]) -> TokenTree:
    tree = TokenTree.rooted_at(0)
    for i, cls in enumerate(classes, 1):
        tree.classes[tree.add(i - 1, 100 + i)] = cls
    return tree


def taught(seed: int = 0) -> Scheduler:
    """A scheduler that learned a copy drafter "x": long matches right, short ones wrong."""
    sched = Scheduler(CPU, max_length=8)
    sched.labels("x")
    rng = np.random.default_rng(seed)
    for _ in range(300):
        classes, rate = (["long"] * 6, 0.95) if rng.random() < 0.4 else (["short"] * 6, 0.1)
        sched.trim("x", chain(classes))           # every draft offered for trimming: its first class counts
        accepted = 0
        while accepted < 6 and rng.random() < rate:
            accepted += 1
        sched.learn("x", chain(classes), accepted)
    sched.begin_request()
    return sched


def test_counts_round_trip_and_are_scaled_down_keeping_each_estimate() -> None:
    sched = taught()
    acc, table = sched.estimate("x"), sched.confidence["x"]
    back = Acceptance.from_dict(json.loads(json.dumps(acc.to_dict())))
    assert back.depth_list(8) == pytest.approx(acc.depth_list(8)) and back.alpha == pytest.approx(acc.alpha)
    light = ConfidenceTable.from_dict(table.to_dict(), weight=5.0)
    assert max(light.trials.values()) <= 5.0 + 1e-9
    for cls in table.trials:   # the rate each class was right at is kept; its weight is not
        assert light.successes[cls] / light.trials[cls] == pytest.approx(table.successes[cls] / table.trials[cls])
    assert light.first == table.first
    assert Acceptance.from_dict(acc.to_dict(), weight=5.0).successes <= 5.0


@pytest.mark.parametrize("bad", [
    {"successes": -1.0},
    {"successes": math.nan},
    {"depth_successes": [1.0, 2.0]},               # lengths differ from the failures'
    {"depth_failures": "ab"},
    {"depth_successes": [0.0] * 100, "depth_failures": [0.0] * 100},
])
def test_malformed_acceptance_counts_are_refused(bad: dict) -> None:
    data = {**Acceptance().to_dict(), "depth_successes": [1.0], "depth_failures": [0.0], **bad}
    with pytest.raises((ValueError, TypeError)):
        Acceptance.from_dict(data)


@pytest.mark.parametrize("bad", [
    {"trials": {"a": 1.0}, "successes": {"a": 2.0}},       # more successes than trials
    {"trials": {"a": 1.0}, "successes": {"b": 1.0}},       # successes of a class never tried
    {"trials": {"a": math.inf}, "successes": {}},
    {"trials": {str(i): 1.0 for i in range(1000)}, "successes": {}},
    {"trials": [1.0], "successes": {}},
])
def test_malformed_class_counts_are_refused(bad: dict) -> None:
    with pytest.raises((ValueError, TypeError, AttributeError)):
        ConfidenceTable.from_dict({"first": {}, **bad})


def test_a_restored_scheduler_decides_as_the_one_that_learned() -> None:
    sched = taught()
    saved = json.loads(json.dumps(sched.estimates()))
    fresh = Scheduler(CPU, max_length=8)
    fresh.labels("x")
    cold = [fresh.trim("x", chain(c)).n_candidates for c in (["long"] * 6, ["short"] * 6)]
    fresh = Scheduler(CPU, max_length=8)
    assert fresh.restore_estimates({**saved, "broken": {"acceptance": {"successes": "x"}}}) == ["x"]
    warm = [fresh.trim("x", chain(c)).n_candidates for c in (["long"] * 6, ["short"] * 6)]
    assert warm == [sched.trim("x", chain(c)).n_candidates for c in (["long"] * 6, ["short"] * 6)]
    assert warm[0] == 6 and warm[1] == 0 and cold != warm       # long copies kept whole, short cut


def test_the_file_keeps_one_entry_per_model_pair_and_survives_a_corrupt_one(tmp_path: Path) -> None:
    store = LearnedEstimates(tmp_path / "estimates.json")
    assert store.get("k") is None                                   # no file yet
    store.path.write_text("{not json")
    assert store.get("k") is None
    store.put("k", {"x": {"acceptance": Acceptance().to_dict(), "classes": None}})
    assert store.get("k")["x"]["acceptance"]["successes"] == 1.0
    for i in range(MAX_ENTRIES + 5):
        store.put(f"other{i}", {})
    data = json.loads(store.path.read_text())
    assert len(data) == MAX_ENTRIES and "k" not in data and f"other{MAX_ENTRIES + 4}" in data
    data["old"] = {"format": 0, "estimates": {}}                    # another format: ignored
    store.path.write_text(json.dumps(data))
    assert store.get("old") is None


def test_the_key_names_both_model_files(tmp_path: Path) -> None:
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    a.write_bytes(b"1")
    b.write_bytes(b"2")
    a, b = file_identity(a), file_identity(b)
    keys = {estimates_key(a, None), estimates_key(b, None), estimates_key(a, b), estimates_key(b, a)}
    assert len(keys) == 4
    assert estimates_key(a, b) == estimates_key(a, b)


def test_an_engine_saves_what_it_learned_and_the_next_one_starts_from_it(tiny_target, monkeypatch) -> None:
    from ouroboros_local.learned import RESTORE_WEIGHT, cache_path
    from ouroboros_local.testing.engines import tiny_engine as make_engine

    prompt = [1, 5, 9, 13, 1, 5, 9, 13, 1, 5]
    with make_engine(tiny_target) as engine:
        want = engine.generate(prompt, max_tokens=24, method="vanilla").tokens
        assert engine.generate(prompt, max_tokens=24, method="auto").tokens == want
        learned = engine.scheduler().estimates()
    saved = LearnedEstimates().get(estimates_key(file_identity(tiny_target), None))
    assert saved is not None and set(saved) == set(learned) and "prompt-lookup" in saved
    with make_engine(tiny_target) as engine:
        restored = engine.scheduler().estimate("prompt-lookup").to_dict()
        assert restored == Acceptance.from_dict(saved["prompt-lookup"]["acceptance"], RESTORE_WEIGHT).to_dict()
        assert restored != Acceptance().to_dict()
        assert engine.generate(prompt, max_tokens=24, method="auto").tokens == want
    before = cache_path().read_text()
    with make_engine(tiny_target, learned=False) as engine:   # neither read nor written: the copy priors
        priors = Acceptance.from_dict(copy_priors()["prompt-lookup"]["acceptance"], PRIOR_WEIGHT)
        assert engine.scheduler().estimate("prompt-lookup").to_dict() == priors.to_dict()
        engine.generate(prompt, max_tokens=24, method="auto")
    assert cache_path().read_text() == before


def test_doctor_says_what_the_next_start_begins_from(tmp_path: Path) -> None:
    from ouroboros_local.learned import describe

    target = tmp_path / "t.gguf"
    target.write_bytes(b"1")
    assert "none yet" in describe(target, None)
    LearnedEstimates().put(estimates_key(file_identity(target), None), {"suffix": {}, "prompt-lookup": {}})
    line = describe(target, None)
    assert "prompt-lookup, suffix, saved" in line and "none yet" in describe(target, target)   # another pair


def test_a_long_lived_engine_saves_after_an_answer_at_most_once_a_minute(tiny_target, monkeypatch) -> None:
    from ouroboros_local import engine as engine_module
    from ouroboros_local.learned import cache_path
    from ouroboros_local.testing.engines import tiny_engine as make_engine

    prompt = [1, 5, 9, 13, 1, 5, 9, 13, 1, 5]
    clock = [1000.0]
    monkeypatch.setattr(engine_module.time, "monotonic", lambda: clock[0])
    with make_engine(tiny_target) as engine:
        engine.generate(prompt, max_tokens=8, method="auto")
        assert not cache_path().exists()                   # less than a minute since the start
        clock[0] += engine_module.SAVE_INTERVAL
        engine.generate(prompt, max_tokens=8, method="auto")
        assert cache_path().exists()                       # a server's estimates survive a crash
        first = cache_path().read_text()
        engine.generate(prompt, max_tokens=8, method="auto")
        assert cache_path().read_text() == first           # not again within the minute


# SmolLM2-135M's verify-cost curve on this project's 2-core VM
SMOL_CPU = CostModel(sizes=[1, 2, 4, 8, 16], seconds=[1.0, 1.71, 2.57, 4.04, 7.24])


def copy_chain(match: int, length: int = 16) -> TokenTree:
    """A prompt-lookup draft after a ``match``-token match, labelled as it labels ("ctx16d1", ...)."""
    return chain([f"ctx{match}d{min(depth, 4)}" for depth in range(1, length + 1)])


def test_the_copy_priors_trust_a_long_match_and_not_a_short_one() -> None:
    priors = copy_priors()
    assert set(priors) == set(PRIOR_SOURCES)
    generic = Scheduler(SMOL_CPU, max_length=16)
    generic.labels("prompt-lookup")
    shipped = Scheduler(SMOL_CPU, max_length=16)
    assert sorted(shipped.restore_estimates(priors, PRIOR_WEIGHT)) == sorted(PRIOR_SOURCES)
    # restored at PRIOR_WEIGHT a class, so that a request's own text soon outweighs them; how often the
    # text copies (the mix of first classes) is the request's to learn
    assert max(shipped.confidence["prompt-lookup"].trials.values()) <= PRIOR_WEIGHT + 1e-9
    assert not shipped.confidence["prompt-lookup"].first
    for sched in (generic, shipped):
        sched.begin_request()
    # from the start: the priors draft a copy after a 16-token match, the generic prior does not
    assert shipped.trim("prompt-lookup", copy_chain(16)).n_candidates >= 4
    assert generic.trim("prompt-lookup", copy_chain(16)).n_candidates == 0
    assert shipped.trim("prompt-lookup", copy_chain(1)).n_candidates == 0
    # one long copy accepted whole: the generic prior now drafts every copy alike, a 1-token match's too;
    # the priors still tell them apart
    for sched in (generic, shipped):
        sched.learn("prompt-lookup", copy_chain(16), 16)
    assert generic.trim("prompt-lookup", copy_chain(1)).n_candidates > 0
    assert shipped.trim("prompt-lookup", copy_chain(1)).n_candidates == 0
    assert shipped.trim("prompt-lookup", copy_chain(16)).n_candidates >= 8


def test_without_the_priors_file_the_generic_priors_stand(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(learned_module, "PRIORS_FILE", tmp_path / "missing.json")
    assert copy_priors() == {}
    (tmp_path / "bad.json").write_text('{"estimates": [1, 2]')
    monkeypatch.setattr(learned_module, "PRIORS_FILE", tmp_path / "bad.json")
    assert copy_priors() == {}


def test_saved_estimates_replace_the_copy_priors_proposer_by_proposer(tiny_target) -> None:
    from ouroboros_local.testing.engines import tiny_engine as make_engine

    mine = taught().estimates()["x"]
    LearnedEstimates().put(estimates_key(file_identity(tiny_target), None), {"prompt-lookup": mine})
    with make_engine(tiny_target) as engine:
        sched = engine.scheduler()
        restored = Acceptance.from_dict(mine["acceptance"], RESTORE_WEIGHT)
        assert sched.estimate("prompt-lookup").to_dict() == restored.to_dict()
        suffix = Acceptance.from_dict(copy_priors()["suffix"]["acceptance"], PRIOR_WEIGHT)
        assert sched.estimate("suffix").to_dict() == suffix.to_dict()


def test_a_model_file_deleted_while_loaded_keeps_its_engine_working(tiny_target, tmp_path) -> None:
    """The learned state's key stat()ed the model file at every save: a chat or server whose file was
    deleted or moved failed every answer after it (and its exit) with FileNotFoundError."""
    import shutil

    from ouroboros_local.testing.engines import tiny_engine as make_engine

    copy = tmp_path / "copy.gguf"
    shutil.copyfile(tiny_target, copy)
    engine = make_engine(copy, adaptive=True, calibration="auto")
    want = engine.generate("hello hello", max_tokens=6, method="auto").tokens
    copy.unlink()
    assert engine.generate("hello hello", max_tokens=6, method="auto").tokens == want
    engine.save_learned()
    engine.close()


def test_counts_no_float_holds_are_skipped_when_restored() -> None:
    """1 and 400 zeros (valid JSON) as a saved count: an OverflowError traceback at every start, then
    "closing an engine at exit failed"."""
    good = Acceptance().to_dict()
    saved = {"huge": {"acceptance": {**good, "successes": 10**400}},
             "huge class": {"acceptance": good, "classes": {"trials": {"a": 10**400}, "successes": {}, "first": {}}},
             "fine": {"acceptance": good}}
    assert Scheduler(CPU, max_length=8).restore_estimates(saved) == ["fine"]


@pytest.mark.parametrize("stamp", ["NaN", "1e300", "-1e300", "1" + "0" * 400, "1" + "0" * 30],
                         ids=["nan", "1e300", "-1e300", "1e400 as an integer", "1e30 as an integer"])
def test_doctor_reads_a_saved_time_edited_by_hand(stamp: str, tmp_path: Path) -> None:
    """``"saved_at": NaN`` (or 1e300) made doctor exit with a traceback."""
    from ouroboros_local.learned import describe

    target = tmp_path / "t.gguf"
    target.write_bytes(b"1")
    key = estimates_key(file_identity(target), None)
    LearnedEstimates().put(key, {"suffix": {}})
    path = learned_module.cache_path()
    data = json.loads(path.read_text())
    data[key]["saved_at"] = "STAMP"
    path.write_text(json.dumps(data).replace('"STAMP"', stamp))
    assert "suffix, saved ? in" in describe(target, None)


@pytest.mark.parametrize("obstacle", ["read-only file", "file for a folder", "full disk"])
def test_doctor_says_when_what_a_run_learns_cannot_be_saved(obstacle: str, tmp_path: Path, monkeypatch) -> None:
    """doctor promised "saves what it learned at its end" where the cache was read-only, a file or full."""
    import os
    from ouroboros_local import filestore
    from ouroboros_local.learned import describe

    target = tmp_path / "t.gguf"
    target.write_bytes(b"1")
    path = learned_module.cache_path()
    if obstacle == "read-only file":
        LearnedEstimates().put("another pair", {})
        path.chmod(0o444)
        expected = f"{path} is read-only"
    elif obstacle == "file for a folder":
        (tmp_path / "cache").write_text("")
        monkeypatch.setenv("OUROBOROS_ESTIMATES_FILE", str(tmp_path / "cache" / "estimates.json"))
        expected = f"{tmp_path / 'cache'} is not a folder"
    else:
        full = os.statvfs_result((4096, 4096, 100, 0, 0, 100, 0, 0, 0, 255))
        monkeypatch.setattr(filestore.os, "statvfs", lambda folder: full)
        expected = "is full"
    line = describe(target, None)
    assert "none yet" in line and "cannot save what it learned there" in line and expected in line
    assert "saves what it learned at its end" not in line


def test_a_blank_or_homeless_estimates_file_variable(tmp_path: Path, monkeypatch) -> None:
    """OUROBOROS_ESTIMATES_FILE="   " was a file named "   " in the working folder; `~nosuchuser/x` a
    RuntimeError traceback (also "closing an engine at exit failed")."""
    from ouroboros_local.errors import ParameterError

    monkeypatch.setenv("OUROBOROS_CACHE", str(tmp_path))
    monkeypatch.setenv("OUROBOROS_ESTIMATES_FILE", "   ")
    assert learned_module.cache_path() == tmp_path / "estimates.json"
    monkeypatch.setenv("OUROBOROS_ESTIMATES_FILE", "~no-such-user-ouroboros/e.json")
    with pytest.raises(ParameterError, match="'no-such-user-ouroboros' .*set OUROBOROS_ESTIMATES_FILE to an abs"):
        learned_module.cache_path()
