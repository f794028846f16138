"""A cached cost curve is checked at start and measured again when it is off or was measured under load."""

from __future__ import annotations

import time

import pytest

from ouroboros_local import calibration
from ouroboros_local.calibration import (CalibrationCache, CostModel, StepCheck, cached_or_measured,
                                         check_step, measure_costs, stale_reason)
from ouroboros_local.engine import Engine, EngineConfig
from ouroboros_local.llama import Model
from ouroboros_local.testing.engines import tiny_engine as make_engine


@pytest.fixture
def engine(tiny_target, tmp_path, monkeypatch):
    monkeypatch.setenv("OUROBOROS_CALIBRATION_FILE", str(tmp_path / "cal.json"))
    with Engine(Model(tiny_target), None, EngineConfig(n_ctx=256, n_batch=32, n_seq_max=4, threads=1)) as eng:
        yield eng


def fake_meter(busy: float | None):
    class FakeMeter:
        busy_cores = busy

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return None

    return FakeMeter


def planted(engine: Engine, factor: float) -> CostModel:
    """Store the engine's true curve scaled by ``factor`` under its key; return the true curve."""
    true = engine.cost_model(refresh=True)
    CalibrationCache().put(CostModel(sizes=true.sizes, seconds=[s * factor for s in true.seconds],
                                     key=true.key, busy_cores=0.0))
    return true


@pytest.mark.parametrize("factor", [50.0, 1 / 50.0])
def test_a_curve_50x_off_is_measured_again(engine, factor) -> None:
    true = planted(engine, factor)
    assert CalibrationCache().get(true.key).seconds[0] == pytest.approx(true.seconds[0] * factor)
    fresh = engine.cost_model()
    assert fresh.origin.startswith("re-measured: one decode takes")
    assert 1 / 5 < fresh.seconds[0] / true.seconds[0] < 5
    assert CalibrationCache().get(true.key).seconds == fresh.seconds        # the cache is repaired
    assert engine.cost_model().origin == "cached, checked"                 # and then trusted


def test_a_curve_that_agrees_is_kept_without_measuring(engine, monkeypatch) -> None:
    true = planted(engine, 1.3)                        # within the tolerance: timer noise, not a wrong curve
    import ouroboros_local.engine as engine_module

    monkeypatch.setattr(engine_module, "measure_costs", lambda *a, **k: pytest.fail("re-measured"))
    kept = engine.cost_model()
    assert kept.origin == "cached, checked"
    assert kept.seconds == pytest.approx([s * 1.3 for s in true.seconds])


def test_the_check_is_a_few_cheap_decodes(engine) -> None:
    t0 = time.perf_counter()
    check = check_step(engine.kv)
    assert time.perf_counter() - t0 < 1.0
    assert check.seconds > 0
    assert engine.kv.n_past == 0          # the context is left empty, as measure_costs leaves it


def test_a_curve_measured_while_others_were_busy_is_provisional(engine, monkeypatch) -> None:
    monkeypatch.setattr(calibration, "usable_cores", lambda: 2)
    monkeypatch.setattr(calibration, "LoadMeter", fake_meter(1.0))
    one_thread = measure_costs(engine.kv, sizes=(1, 2), repeats=1)
    assert one_thread.busy_cores == 1.0 and not one_thread.provisional   # our 1 thread had the other core
    monkeypatch.setattr(calibration, "LoadMeter", fake_meter(1.8))
    crowded = measure_costs(engine.kv, sizes=(1, 2), repeats=1)
    assert crowded.provisional
    monkeypatch.setattr(calibration, "LoadMeter", fake_meter(None))   # no /proc/stat: nothing known
    assert not measure_costs(engine.kv, sizes=(1, 2), repeats=1).provisional


def test_a_provisional_curve_is_used_while_busy_and_measured_again_when_quiet(engine, tmp_path) -> None:
    cache = CalibrationCache(tmp_path / "own.json")
    busy_curve = CostModel(sizes=[1, 2], seconds=[0.01, 0.02], key="k", busy_cores=1.8, provisional=True)
    cache.put(busy_curve)
    measured = []

    def measure(kv):
        measured.append(1)
        return CostModel(sizes=[1, 2], seconds=[0.004, 0.007], busy_cores=0.0)

    def check(busy: bool):
        return lambda kv: StepCheck(seconds=0.011, busy_cores=1.8 if busy else 0.0, contended=busy)

    still_busy = cached_or_measured(engine.kv, "k", cache, measure=measure, check=check(True))
    assert still_busy.provisional and still_busy.origin == "cached, checked" and not measured
    quiet = cached_or_measured(engine.kv, "k", cache, measure=measure, check=check(False))
    assert measured and quiet.origin.startswith("re-measured: it was measured while other processes")
    assert cache.get("k").seconds == [0.004, 0.007] and not cache.get("k").provisional


def test_stale_reason_tolerates_noise_but_not_a_wide_margin() -> None:
    curve = CostModel(sizes=[1, 4], seconds=[0.07, 0.2])
    at = lambda s: StepCheck(seconds=s, busy_cores=0.0, contended=False)   # noqa: E731
    assert stale_reason(curve, at(0.07)) is None
    assert stale_reason(curve, at(0.18)) is None            # 2.6x: busy for a moment, not wrong
    assert stale_reason(curve, at(0.03)) is None
    assert "3.6s" in stale_reason(CostModel(sizes=[1, 4], seconds=[3.6, 9.0]), at(0.068))
    assert stale_reason(curve, at(0.3)) is not None
    assert stale_reason(curve, at(0.02)) is not None
    tiny = CostModel(sizes=[1], seconds=[2e-6])
    assert stale_reason(tiny, at(1.5e-5)) is None            # 7.5x, but within the scheduling jitter


def test_a_check_others_slowed_down_keeps_the_curve_and_an_unknown_load_is_not_quiet(tiny_target, monkeypatch) -> None:
    """One busy start measured a busy curve over a quiet one (112 s on 2 cores) and the next quiet start
    measured it back; a check too short for the load meter read as a quiet machine, so a busy one
    re-measured its provisional curve at every start."""
    from ouroboros_local import calibration

    quiet = CostModel(sizes=[1, 4], seconds=[0.02, 0.05])
    assert stale_reason(quiet, StepCheck(seconds=0.18, busy_cores=6.0, contended=True)) is None
    provisional = CostModel(sizes=[1, 4], seconds=[0.14, 0.3], busy_cores=6.0, provisional=True)
    assert stale_reason(provisional, StepCheck(seconds=0.13, busy_cores=None, contended=False)) is None
    assert "quiet now" in stale_reason(provisional, StepCheck(seconds=0.13, busy_cores=0.0, contended=False))

    class Unreadable:   # fewer clock ticks than the meter needs
        busy_cores = None

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return None

    monkeypatch.setattr(calibration, "LoadMeter", Unreadable)
    monkeypatch.setattr(calibration, "busy_cores_now", lambda reuse=0.0: 2.0)
    monkeypatch.setattr(calibration, "usable_cores", lambda: 2)
    engine = make_engine(tiny_target, n_ctx=256)
    try:
        check = check_step(engine.kv)
    finally:
        engine.close()
    assert check.busy_cores == 2.0 and check.contended


def test_a_curve_is_keyed_by_what_its_batches_run_with(tiny_target, tiny_draft) -> None:
    """Batches run on threads_batch threads, which the key left out (a curve of 2 priced verification 2x
    too cheap at 1); the draft's key named the target's flash attention, not the draft's own."""
    engine = make_engine(tiny_target, tiny_draft, n_ctx=256, threads=1, threads_batch=2)
    try:
        assert engine.calibration_settings()["threads_batch"] == 2
        engine.draft_kv()   # the draft's context
        engine._draft_flash_attn = "on" if engine.config.flash_attn != "on" else "off"
        assert engine.calibration_settings(draft=True)["flash_attn"] == engine._draft_flash_attn
    finally:
        engine.close()
    engine = make_engine(tiny_target, n_ctx=256, threads=1)
    try:   # the same threads for both: the key every curve had
        assert "threads_batch" not in engine.calibration_settings()
    finally:
        engine.close()


def test_a_curve_is_keyed_by_the_llama_cpp_build_and_the_cpu(tiny_target, monkeypatch) -> None:
    """Another libllama (an upgrade, a rebuild) or another CPU with the same features has other kernels
    and speeds: its curve is measured afresh, not taken from the other's."""
    import ouroboros_local.engine as engine_module
    import ouroboros_local.llama as llama

    engine = make_engine(tiny_target, n_ctx=256, threads=1)
    try:
        key = calibration.calibration_key(engine.target.file_id, engine.calibration_settings())
        assert engine.calibration_settings()["library"][0].endswith(("libllama.so", "libllama.dylib", "llama.dll"))
        monkeypatch.setattr(llama, "library_identity", lambda: ["/elsewhere/libllama.so", 1, 2])
        rebuilt = calibration.calibration_key(engine.target.file_id, engine.calibration_settings())
        monkeypatch.setattr(engine_module, "cpu_model", lambda: "Another CPU")
        moved = calibration.calibration_key(engine.target.file_id, engine.calibration_settings())
    finally:
        engine.close()
    assert len({key, rebuilt, moved}) == 3


def test_old_and_broken_cache_entries(tmp_path) -> None:
    cache = CalibrationCache(tmp_path / "cal.json")
    cache.put(CostModel(sizes=[1], seconds=[0.05], key="ok"))
    import json

    data = json.loads(cache.path.read_text())
    for name in ("busy_cores", "provisional"):          # written before loads were recorded
        del data["ok"][name]
    data["zero"] = {"sizes": [1], "seconds": [0.0]}
    data["junk"] = {"sizes": [1], "seconds": [0.1], "colour": "red"}
    cache.path.write_text(json.dumps(data))
    # entries edited by hand: once an AttributeError or TypeError at every start
    data["text"] = {"sizes": [1, 2], "seconds": ["0.1", "0.2"]}
    data["unsorted"] = {"sizes": [1, 4, 2], "seconds": [0.1, 0.3, 0.2]}
    data["short"] = {"sizes": [1, 2], "seconds": [0.1]}
    data["list"] = [1, 2]
    # 8 tokens for a hundredth of one: no measurement makes it, and the start-up check times only one token
    data["cheaper"] = {"sizes": [1, 8], "seconds": [0.1, 0.001]}
    cache.path.write_text(json.dumps(data))
    old = cache.get("ok")
    assert old.seconds == [0.05] and old.busy_cores is None and not old.provisional
    for key in ("zero", "junk", "text", "unsorted", "short", "list", "cheaper", "missing"):
        assert cache.get(key) is None, key
    cache.path.write_text("[1, 2]")   # not an object at all: nothing cached, and the next put repairs it
    assert cache.get("ok") is None
    cache.put(CostModel(sizes=[1], seconds=[0.05], key="ok"))
    assert cache.get("ok").seconds == [0.05]


def test_the_cache_keeps_the_most_recently_measured_curves(tmp_path, monkeypatch) -> None:
    import ouroboros_local.calibration as calibration

    monkeypatch.setattr(calibration, "MAX_CURVES", 3)
    cache = CalibrationCache(tmp_path / "cal.json")
    for i, stamp in enumerate((5.0, 1.0, 4.0, 2.0)):   # measured out of order: the stamp decides
        cache.put(CostModel(sizes=[1], seconds=[0.01 * (i + 1)], key=f"k{i}", measured_at=stamp))
    assert [k for k in ("k0", "k1", "k2", "k3") if cache.get(k) is not None] == ["k0", "k2", "k3"]
    cache.put(CostModel(sizes=[1], seconds=[0.05], key="k4"))   # now: the oldest left (k3, 2.0) goes
    assert [k for k in ("k0", "k2", "k3", "k4") if cache.get(k) is not None] == ["k0", "k2", "k4"]
    # curves stamped by a clock an hour ahead: the one just measured vanished as soon as it was written
    ahead = time.time() + 3600
    for key in ("k0", "k2", "k4"):
        cache.put(CostModel(sizes=[1], seconds=[0.05], key=key, measured_at=ahead))
    cache.put(CostModel(sizes=[1], seconds=[0.06], key="k5"))
    assert cache.get("k5") is not None


class FakeClock:
    """``time.perf_counter`` for ``measure_costs``: each decode of n tokens advances it by ``cost(n)``
    (times ``slow`` for the decodes whose running index is in ``burst``)."""

    def __init__(self, cost, burst=frozenset(), slow=10.0):
        self.now, self.cost, self.burst, self.slow, self.decodes = 0.0, cost, burst, slow, 0

    def perf_counter(self) -> float:
        return self.now

    def decoded(self, n: int) -> None:
        self.now += self.cost(n) * (self.slow if self.decodes in self.burst else 1.0)
        self.decodes += 1


def measured_with(engine: Engine, monkeypatch, clock: FakeClock, sizes) -> CostModel:
    real = engine.kv.decode_layout

    def decode(lay):
        out = real(lay)
        clock.decoded(len(lay.tokens))
        return out

    monkeypatch.setattr(engine.kv, "decode_layout", decode)
    monkeypatch.setattr(calibration.time, "perf_counter", clock.perf_counter)
    return measure_costs(engine.kv, sizes=sizes, repeats=3)


def test_the_curve_keeps_a_larger_batch_that_costs_less(engine, monkeypatch) -> None:
    """llama.cpp's repacked Q4_K kernels take 4 rows at a time: 16 tokens can cost less than 15 (the 1.5B
    on 2 cores: 5.1 against 6.4 steps). The scheduler must see that, not a curve forced to rise."""
    cost = {1: 1.0, 2: 1.7, 15: 6.4, 16: 5.1, 17: 6.3}
    curve = measured_with(engine, monkeypatch, FakeClock(cost.__getitem__), sizes=sorted(cost))
    assert curve.seconds == pytest.approx([cost[n] for n in curve.sizes])
    assert curve.cost(16) < curve.cost(15)


def test_no_size_costs_less_than_one_token(engine, monkeypatch) -> None:
    cost = {1: 1.0, 2: 0.6, 3: 2.0}.__getitem__       # a timer glitch at 2
    curve = measured_with(engine, monkeypatch, FakeClock(cost), sizes=(1, 2, 3))
    assert curve.seconds == pytest.approx([1.0, 1.0, 2.0])


def test_a_burst_of_load_spoils_no_size(engine, monkeypatch) -> None:
    """Three decodes in a row ten times slower (another process woke up): taken size after size, each
    size loses at most one of its three timed decodes, and its median stands."""
    sizes = tuple(range(1, 9))
    clock = FakeClock(lambda n: 0.5 + 0.5 * n, burst=frozenset({13, 14, 15}))   # 7 warm-ups, then timed
    curve = measured_with(engine, monkeypatch, clock, sizes=sizes)
    assert curve.seconds == pytest.approx([0.5 + 0.5 * n for n in sizes])


@pytest.mark.parametrize("shift_at", [9, 40, 10_000])
def test_a_change_of_speed_does_not_bend_the_curve(engine, monkeypatch, shift_at) -> None:
    """Each size is timed against a plain step decoded just before it: where the machine slowed down
    (before the sweep ended, or at 10_000: never) c(n)/c(1) stays what it is. Timed apart, a step
    measured after a slow spell began made every larger decode look 1.4x cheaper."""
    sizes = (1, 2, 3, 4, 8)
    cost = lambda n: 0.5 + 0.5 * n   # noqa: E731
    slow_from_then_on = frozenset(range(shift_at, 10_000))   # more decodes than a calibration makes
    clock = FakeClock(cost, burst=slow_from_then_on, slow=1.4)
    curve = measured_with(engine, monkeypatch, clock, sizes=sizes)
    assert [curve.cost(n) / curve.cost(1) for n in sizes] == pytest.approx([cost(n) / cost(1) for n in sizes])


class ShapeClock(FakeClock):
    """A CUDA-graph-like clock: a plain step costs ``step`` after plain steps, ``first`` right after a
    decode of another size and ``second`` after that (the graph captured again); n > 1 costs ``cost``."""

    def __init__(self, step, first, second, cost):
        super().__init__(lambda n: step if n == 1 else cost(n))
        self.extra, self.history = {1: first - step, 2: second - step}, []

    def decoded(self, n: int) -> None:
        super().decoded(n)
        since = next((i for i, m in enumerate(reversed(self.history)) if m > 1), None)
        if n == 1 and since is not None and since < 2:
            self.now += self.extra[since + 1]
        self.history.append(n)


def test_a_plain_step_is_timed_back_to_back_and_the_switch_apart(engine, monkeypatch) -> None:
    clock = ShapeClock(step=1.35, first=4.0, second=2.7, cost=lambda n: 4.5 + 0.05 * n)
    curve = measured_with(engine, monkeypatch, clock, sizes=(1, 2, 4, 8, 16))
    assert curve.seconds[0] == pytest.approx(1.35)
    assert curve.seconds[1:] == pytest.approx([4.5 + 0.05 * n for n in (2, 4, 8, 16)])
    assert curve.switch_seconds == pytest.approx(4.0 - 1.35 + 2.7 - 1.35)
    flat = measured_with(engine, monkeypatch, FakeClock(lambda n: 0.5 + 0.5 * n), sizes=(1, 2, 4, 8))
    assert flat.switch_seconds == 0.0


def test_beyond_the_curve_a_dip_at_its_end_does_not_make_costs_fall() -> None:
    curve = CostModel(sizes=[1, 15, 16], seconds=[1.0, 6.4, 5.1])
    assert curve.cost(16) == pytest.approx(5.1)
    assert curve.cost(20) == pytest.approx(5.1)
    rising = CostModel(sizes=[1, 24, 32], seconds=[1.0, 7.7, 9.1])
    assert rising.cost(40) == pytest.approx(9.1 + 1.4)      # the last stretch's slope, 1.4 per 8 tokens


def test_a_ctrl_c_during_the_measurement_leaves_the_cache_empty(engine, monkeypatch) -> None:
    """The measurement's cells were cleared only when it finished: a Ctrl-C just after one of its decodes
    left cells the cache did not record, and the next generation failed in llama_decode."""
    from ouroboros_local.llama import Context

    want = engine.generate("abc abd abc", max_tokens=12).tokens
    decode, calls = Context.decode, iter(range(10**6))

    def interrupted(self, batch) -> None:
        decode(self, batch)
        if next(calls) == 3:
            raise KeyboardInterrupt

    monkeypatch.setattr(Context, "decode", interrupted)
    with pytest.raises(KeyboardInterrupt):
        measure_costs(engine.kv, sizes=[1, 2, 4], repeats=1)
    monkeypatch.undo()
    assert engine.kv.n_past == 0
    assert engine.generate("abc abd abc", max_tokens=12).tokens == want


def test_a_blank_or_homeless_calibration_file_variable(tmp_path, monkeypatch) -> None:
    """OUROBOROS_CALIBRATION_FILE=" " was a file named " " in the working folder; `~nosuchuser/x` a
    RuntimeError traceback."""
    from ouroboros_local.errors import ParameterError

    monkeypatch.setenv("OUROBOROS_CACHE", str(tmp_path))
    monkeypatch.setenv("OUROBOROS_CALIBRATION_FILE", " ")
    assert CalibrationCache().path == tmp_path / "calibration.json"
    monkeypatch.setenv("OUROBOROS_CALIBRATION_FILE", "~no-such-user-ouroboros/c.json")
    with pytest.raises(ParameterError, match="'no-such-user-ouroboros' .*set OUROBOROS_CALIBRATION_FILE to an"):
        CalibrationCache()


@pytest.mark.parametrize("value", ["y", "2"])
def test_an_unknown_verbose_word_is_refused_not_taken_for_on(value, monkeypatch, capfd) -> None:
    """OUROBOROS_VERBOSE=y or =2 switched llama.cpp's log on (292 stderr lines), where OUROBOROS_OFFLINE=y
    meant "off": both now take the same words and refuse others."""
    from ouroboros_local.errors import ParameterError
    from ouroboros_local.llama import binding

    monkeypatch.setenv("OUROBOROS_VERBOSE", value)
    with pytest.raises(ParameterError, match=f"OUROBOROS_VERBOSE='{value}' is not a yes/no value"):
        binding.backend_init()
    binding._on_log(2, b"llama.cpp says hello\n", None)   # a log callback cannot raise: off
    monkeypatch.setenv("OUROBOROS_VERBOSE", "on")
    binding._on_log(2, b"llama.cpp says goodbye\n", None)
    err = capfd.readouterr().err
    assert "hello" not in err and "goodbye" in err
