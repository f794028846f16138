"""The default thread count leaves out the cores other processes keep busy (mocked /proc/stat)."""

from __future__ import annotations

import re

import pytest

from ouroboros_local import cpu_load
from ouroboros_local.cpu_load import (CpuTimes, busy_cores_now, contended, idle_threads, others_busy_cores,
                                      parse_cpu_times)


def stat_text(*cpus: tuple[int, int]) -> str:
    """A /proc/stat with one line per CPU from (busy user ticks, idle ticks); the sum line first."""
    def line(name: str, busy: int, idle: int) -> str:
        # user nice system idle iowait irq softirq steal guest guest_nice
        return f"{name} {busy} 0 0 {idle} 0 0 0 0 0 0"

    total = line("cpu", sum(b for b, _ in cpus), sum(i for _, i in cpus))
    return "\n".join([total] + [line(f"cpu{n}", b, i) for n, (b, i) in enumerate(cpus)]
                     + ["intr 1 2 3", "ctxt 99"])


def test_parse_sums_the_usable_cpus_and_counts_steal_as_busy() -> None:
    text = stat_text((100, 900), (500, 500), (0, 1000))
    times = parse_cpu_times(text, {0, 1}, own_seconds=1.5)
    assert (times.busy, times.total, times.n_cpus, times.own_seconds) == (600, 2000, 2, 1.5)
    everything = parse_cpu_times(text, None, 0.0)
    assert (everything.busy, everything.total, everything.n_cpus) == (600, 3000, 3)
    stolen = parse_cpu_times("cpu0 10 1 2 50 5 1 1 30 7 0\n", {0}, 0.0)
    assert stolen.busy == 10 + 1 + 2 + 1 + 1 + 30        # guest (7) is already inside user
    assert stolen.total == stolen.busy + 55
    assert parse_cpu_times("intr 1\n", {0}, 0.0) is None


def test_others_busy_cores_subtracts_our_own_cpu_time() -> None:
    before = CpuTimes(busy=1000, total=4000, own_seconds=10.0, n_cpus=2)
    # 30 ticks pass on 2 CPUs (60 ticks in all): 45 busy, 15 of them ours (0.15 s at 100 ticks/s)
    after = CpuTimes(busy=1045, total=4060, own_seconds=10.15, n_cpus=2)
    assert others_busy_cores(before, after, clock_ticks=100) == pytest.approx(1.0)
    quiet = CpuTimes(busy=1015, total=4060, own_seconds=10.15, n_cpus=2)
    assert others_busy_cores(before, quiet, clock_ticks=100) == pytest.approx(0.0)
    assert others_busy_cores(before, before, clock_ticks=100) is None      # no tick passed
    short = CpuTimes(busy=1003, total=4006, own_seconds=10.0, n_cpus=2)
    assert others_busy_cores(before, short, clock_ticks=100) is None       # 6 ticks: too few to tell


@pytest.mark.parametrize("busy, threads", [(None, 2), (0.0, 2), (0.4, 2), (0.6, 1), (1.0, 1), (1.9, 1),
                                           (2.0, 1)])
def test_idle_threads_on_two_cores_never_below_one(busy, threads) -> None:
    assert idle_threads(2, busy) == threads


def test_idle_threads_on_many_cores() -> None:
    assert idle_threads(16, 0.2) == 16
    assert idle_threads(16, 3.1) == 13
    assert idle_threads(16, 40.0) == 1


def test_contended_when_our_threads_share_cores_with_others() -> None:
    assert not contended(None, 2, 2)
    assert not contended(0.3, 2, 2)
    assert contended(1.0, 2, 2)
    assert not contended(1.0, 2, 1)        # one busy core, one thread of ours on the other
    assert not contended(2.0, 16, 8)
    assert not contended(0.0, 2, 3) and contended(1.0, 2, 3)   # our own threads past the cores are no load


class FakeProc:
    """/proc/stat readings that advance by a given busy share of other processes per reading."""

    def __init__(self, others_busy_per_cpu: list[float], ticks: int = 15):
        self.others = others_busy_per_cpu
        self.ticks = ticks
        self.busy = [0] * len(others_busy_per_cpu)
        self.idle = [0] * len(others_busy_per_cpu)
        self.reads = 0

    def __call__(self) -> str:
        text = stat_text(*zip(self.busy, self.idle))
        for n, share in enumerate(self.others):   # the next reading is `ticks` later
            self.busy[n] += round(share * self.ticks)
            self.idle[n] += self.ticks - round(share * self.ticks)
        self.reads += 1
        return text


@pytest.fixture
def two_cpus(monkeypatch):
    monkeypatch.setattr(cpu_load, "_usable_cpu_ids", lambda: {0, 1})
    monkeypatch.setattr(cpu_load, "_own_cpu_seconds", lambda: 0.0)
    monkeypatch.setattr(cpu_load, "_last_sample", None)


def test_busy_cores_now_samples_once_and_reuses_the_sample(two_cpus) -> None:
    proc = FakeProc([1.0, 0.0])          # a busy loop on one core
    slept = []
    assert busy_cores_now(read_stat=proc, sleep=slept.append) == pytest.approx(1.0)
    assert proc.reads == 2 and slept == [cpu_load.SAMPLE_SECONDS]
    assert busy_cores_now(read_stat=proc, sleep=slept.append) == pytest.approx(1.0)   # reused
    assert proc.reads == 2
    quiet = FakeProc([0.0, 0.0])
    assert busy_cores_now(reuse=0.0, read_stat=quiet, sleep=lambda s: None) == pytest.approx(0.0)


def test_load_average_stands_in_without_proc_stat(two_cpus, monkeypatch) -> None:
    monkeypatch.setattr(cpu_load.os, "getloadavg", lambda: (1.2, 0.5, 0.1))
    assert busy_cores_now(reuse=0.0, read_stat=lambda: None, sleep=lambda s: None) == pytest.approx(1.2)


@pytest.mark.parametrize("others, threads", [([0.0, 0.0], 2), ([0.1, 0.2], 2), ([1.0, 0.0], 1),
                                             ([0.5, 0.5], 1), ([1.0, 1.0], 1)])
def test_default_threads_follow_the_load(two_cpus, monkeypatch, others, threads) -> None:
    from ouroboros_local.llama import binding

    proc = FakeProc(others)
    monkeypatch.setattr(binding, "usable_cores", lambda: 2)
    monkeypatch.setattr(binding, "math_cores", lambda: cpu_load.MathCores(2, "physical cores"))
    monkeypatch.setattr(binding, "busy_cores_now",
                        lambda: busy_cores_now(reuse=0.0, read_stat=proc, sleep=lambda s: None))
    assert binding.default_threads() == threads


def _sysfs(root, siblings: dict[int, str], core: str | None = None, atom: str | None = None):
    for cpu, group in siblings.items():
        topology = root / "system" / "cpu" / f"cpu{cpu}" / "topology"
        topology.mkdir(parents=True)
        (topology / "thread_siblings_list").write_text(group + "\n")
    for name, cpus in (("cpu_core", core), ("cpu_atom", atom)):
        if cpus:
            (root / name).mkdir()
            (root / name / "cpus").write_text(cpus + "\n")
    return root


def test_threads_default_to_one_per_physical_core_as_llama_cpp(tmp_path, monkeypatch) -> None:
    """An 8-core, 16-thread CPU ran 16 threads where llama.cpp runs 8: a hyperthread adds no decoding
    speed, and llama.cpp's threads wait for the slowest at every graph node. Apple Silicon and Intel's
    hybrid CPUs: the performance cores only, as llama.cpp counts them."""
    from ouroboros_local.cpu_load import MathCores, linux_math_cores
    from ouroboros_local.llama import binding

    smt = _sysfs(tmp_path / "smt", {i: f"{i % 8},{i % 8 + 8}" for i in range(16)})
    assert linux_math_cores(set(range(16)), smt) == MathCores(8, "physical cores")
    assert linux_math_cores({0, 8, 1}, smt) == MathCores(2, "physical cores")   # an affinity mask
    hybrid = _sysfs(tmp_path / "hybrid", {**{i: f"{i - i % 2}-{i - i % 2 + 1}" for i in range(8)},
                                          **{i: str(i) for i in range(8, 16)}}, core="0-7", atom="8-15")
    assert linux_math_cores(set(range(16)), hybrid) == MathCores(4, "performance cores")
    assert linux_math_cores(set(range(8, 16)), hybrid) == MathCores(8, "physical cores")   # E-cores alone
    assert linux_math_cores({0, 1}, tmp_path / "none") == MathCores(2, "usable cores")

    monkeypatch.setattr(binding, "usable_cores", lambda: 16)
    monkeypatch.setattr(binding, "math_cores", lambda: MathCores(8, "physical cores"))
    for busy, threads in ((0.0, 8), (None, 8), (6.0, 8), (10.0, 6), (15.6, 1)):
        monkeypatch.setattr(binding, "busy_cores_now", lambda busy=busy: busy)
        assert binding.default_threads() == threads

    from ouroboros_local import doctor

    monkeypatch.setattr(cpu_load, "usable_cores", lambda: 16)
    monkeypatch.setattr(cpu_load, "math_cores", lambda: MathCores(8, "physical cores"))
    monkeypatch.setattr(cpu_load, "busy_cores_now", lambda reuse=0.0: 0.0)
    assert doctor.load_lines()[1].startswith("threads: 8 by default, one per physical core (8 of 16")
    assert "more than the 8 physical cores, so some threads share" in doctor.load_lines(12)[1]   # was silent
    assert "more than" not in doctor.load_lines(8)[1]
    monkeypatch.undo()

    monkeypatch.setattr(cpu_load.sys, "platform", "darwin")
    monkeypatch.setattr(cpu_load, "usable_cores", lambda: 10)
    monkeypatch.setattr(cpu_load, "_sysctl_int", {"hw.perflevel0.physicalcpu": 4, "hw.physicalcpu": 10}.get)
    cpu_load.math_cores.cache_clear()
    try:
        assert cpu_load.math_cores() == MathCores(4, "performance cores")
    finally:
        cpu_load.math_cores.cache_clear()


def test_a_context_without_a_thread_setting_uses_the_idle_cores(tiny_target, monkeypatch) -> None:
    from llama_cpp import llama_cpp as lc

    from ouroboros_local.llama import Context, ContextParams, Model, binding

    monkeypatch.setattr(binding, "usable_cores", lambda: 2)
    monkeypatch.setattr(binding, "math_cores", lambda: cpu_load.MathCores(2, "physical cores"))
    monkeypatch.setattr(binding, "busy_cores_now", lambda: 1.0)
    model = Model(tiny_target)
    try:
        busy = Context(model, ContextParams(n_ctx=64, n_batch=16))
        assert busy.n_threads == 1 == int(lc.llama_n_threads(busy.ptr))
        busy.close()
        monkeypatch.setattr(binding, "busy_cores_now", lambda: 0.0)
        quiet = Context(model, ContextParams(n_ctx=64, n_batch=16))
        assert quiet.n_threads == 2 == int(lc.llama_n_threads_batch(quiet.ptr))
        quiet.close()
        chosen = Context(model, ContextParams(n_ctx=64, n_batch=16, n_threads=2))   # the user's -t wins
        assert chosen.n_threads == 2
        chosen.close()
    finally:
        model.close()


def test_doctor_reports_the_load_and_the_thread_choice(monkeypatch) -> None:
    from ouroboros_local import doctor

    monkeypatch.setattr(cpu_load, "usable_cores", lambda: 2)
    monkeypatch.setattr(cpu_load, "math_cores", lambda: cpu_load.MathCores(2, "physical cores"))
    monkeypatch.setattr(cpu_load, "busy_cores_now", lambda reuse=0.0: 1.0)
    lines = doctor.load_lines()
    assert "1.0 of 2 usable cores busy" in lines[0]
    assert lines[1].startswith("threads: 1 by default, the idle cores")
    assert lines[2].startswith("OpenMP waiting: OMP_WAIT_POLICY=")
    # -t was ignored: "1 by default ... -t N overrides" beside -t 8, and no word of the cores it oversubscribes
    assert doctor.load_lines(2)[1].startswith("threads: 2 (-t; 1 by default") and "more than" not in lines[1]
    assert "more than the 2 usable cores" in doctor.load_lines(8)[1]


@pytest.mark.parametrize("threads, message", [("-1", "must be >= 0"), ("100000", "must be at most")])
def test_doctor_refuses_the_thread_counts_generate_refuses(tiny_target, capsys, threads, message) -> None:
    from ouroboros_local import cli

    assert cli.main(["doctor", "-m", str(tiny_target), "-t", threads]) == 2
    captured = capsys.readouterr()
    assert message in captured.err and captured.out == ""


def test_doctor_says_how_many_tokens_a_round_decodes_and_whether_attention_is_flash(tiny_target, capsys) -> None:
    """On this CPU build: each round its draft's size (rounds of one size are a CUDA GPU's default) and
    flash attention off (on a GPU, llama.cpp's auto)."""
    from ouroboros_local import cli, doctor
    from ouroboros_local.engine_config import CUDA_ROUND_SIZE

    assert cli.main(["doctor", "-m", str(tiny_target)]) == 0
    out = capsys.readouterr().out
    assert "\nrounds: each its draft's size by default" in out and "\ndevice 0: CPU" in out
    assert doctor.rounds_line(True).startswith(f"rounds: {CUDA_ROUND_SIZE} tokens each by default")
    assert "\nflash attention: off by default on the CPU" in out
    assert doctor.flash_attention_line(True).startswith("flash attention: auto by default")


def test_doctor_counts_the_kv_cache_of_the_context_asked_for(tiny_target, capsys) -> None:
    """doctor -c 99999999 said the models fit, and generate then failed to allocate the KV cache."""
    from ouroboros_local import cli
    from ouroboros_local.gguf_file import validate_gguf

    per_token = validate_gguf(tiny_target).kv_bytes_per_token
    assert per_token == 2 * 2 * 2 * 16 * 2   # the tiny model: 2 layers x 2 KV heads x (16 + 16) x 2 bytes
    assert cli.main(["doctor", "-m", str(tiny_target), "-c", "99999999"]) == 0
    out = capsys.readouterr().out
    assert f"KV cache of 99999999 tokens {per_token * 99999999 / 2**30:.1f}" in out and "does NOT fit" in out
    # a quantised cache takes less: q8_0 is 34 bytes a block of 32 against F16's 64
    assert cli.main(["doctor", "-m", str(tiny_target), "-c", "99999999", "--cache-type-k", "q8_0",
                     "--cache-type-v", "q8_0"]) == 0
    assert f"KV cache of 99999999 tokens {per_token * 99999999 * 34 / 64 / 2**30:.1f}" in capsys.readouterr().out
    assert cli.main(["doctor", "-m", str(tiny_target), "-c", "-5"]) == 2
    # -c 0, each model's trained context: with a draft the report stopped halfway at "--ctx-size must be"
    assert cli.main(["doctor", "-m", str(tiny_target), "-d", str(tiny_target), "-c", "0"]) == 0
    assert "pair speed:" in capsys.readouterr().out
    from ouroboros_local.doctor import KV_TYPE_BYTES
    from ouroboros_local.llama.binding import KV_CACHE_TYPES

    assert set(KV_TYPE_BYTES) == set(KV_CACHE_TYPES)   # every cache type the engine takes has its size


def test_a_draft_the_method_never_runs_is_not_loaded(tiny_target, tmp_path, capsys) -> None:
    """generate -d DRAFT --method vanilla (or prompt-lookup, lookahead, suffix) loaded the draft unsaid:
    SmolLM2 with the 0.5B's draft took 808-877 MB where it needs 276 MB."""
    from ouroboros_local import cli

    missing = tmp_path / "no-such-draft.gguf"   # loading it would fail
    for method in ("vanilla", "suffix"):
        assert cli.main(["generate", "-m", str(tiny_target), "-d", str(missing), "--method", method, "-p", "hi",
                         "-n", "2", "-t", "1", "--quiet"]) == 0
        assert f"note: --method {method} runs no draft model: -d {missing} is not loaded" in capsys.readouterr().err
    assert cli.main(["generate", "-m", str(tiny_target), "-d", str(missing), "--method", "auto", "-p", "hi",
                     "-n", "2", "-t", "1", "--quiet"]) == 2   # auto may draft with it


def test_doctor_judges_the_memory_without_proc_meminfo(tiny_target, monkeypatch, capsys) -> None:
    """macOS and Windows have no /proc/meminfo: doctor printed no memory line and no fit verdict at all.
    llama.cpp's CPU device gives the figure there."""
    from ouroboros_local import cli
    from ouroboros_local.llama import huge_pages

    monkeypatch.setattr(huge_pages, "memory_available", lambda: None)
    assert cli.main(["doctor", "-m", str(tiny_target), "-c", "99999999"]) == 0
    out = capsys.readouterr().out
    assert "GiB (llama.cpp's figure for the CPU device)" in out and "does NOT fit" in out


def test_more_threads_than_cores_is_named_and_negative_refused(tiny_target, monkeypatch, capsys) -> None:
    """-t above the usable cores runs (llama.cpp allows it) but says why it may crawl: on 2 cores,
    -t 64 decoded SmolLM2 at 4 tok/s against 160; a negative count is a parameter error (status 2)."""
    from ouroboros_local import cli

    monkeypatch.setattr(cli, "usable_cores", lambda: 2)
    assert cli.main(["generate", "-m", str(tiny_target), "-p", "x", "-n", "2", "-t", "3"]) == 0
    assert "-t 3 is more threads than the 2 cores" in capsys.readouterr().err
    assert cli.main(["generate", "-m", str(tiny_target), "-p", "x", "-n", "2", "-t", "2"]) == 0
    assert "more threads than" not in capsys.readouterr().err
    assert cli.main(["generate", "-m", str(tiny_target), "-p", "x", "-n", "2", "-t", "-1"]) == 2
    assert "--threads must be >= 0" in capsys.readouterr().err


def test_text_that_is_not_utf8_is_a_parameter_error(tiny_target, tmp_path, capsys) -> None:
    """A prompt file in another encoding, or an argument holding a byte that is not UTF-8 (Python keeps
    it as U+DCxx), ends with a one-line error (status 2), not a UnicodeError traceback."""
    from ouroboros_local import cli

    latin = tmp_path / "latin.txt"
    latin.write_bytes("caf\u00e9\n".encode("latin-1"))
    assert cli.main(["generate", "-m", str(tiny_target), "-f", str(latin), "-n", "2"]) == 2
    assert "latin.txt:1: not UTF-8 text (byte 0xe9 at offset 3)" in capsys.readouterr().err
    assert cli.main(["generate", "-m", str(tiny_target), "-p", "caf\udce9", "-n", "2"]) == 2
    assert "holds the byte 0xe9, which is not UTF-8" in capsys.readouterr().err


def test_seed_minus_one_is_random_as_in_llama_cpp(tiny_target, capsys) -> None:
    """--seed -1 is llama.cpp's "random seed" (once a numpy traceback); other negatives are refused."""
    from ouroboros_local import cli

    args = ["generate", "-m", str(tiny_target), "-p", "x", "-n", "2", "--temp", "0.8"]
    assert cli.main(args + ["--seed", "-1"]) == 0
    assert cli.main(args + ["--seed", "-2"]) == 2
    assert "--seed must be >= 0, or -1 for a random seed (got -2)" in capsys.readouterr().err   # -1 unsaid


def test_calibrate_measures_the_draft_it_is_given(tiny_target, tiny_draft, capsys) -> None:
    """calibrate -d loaded the draft and neither measured nor showed it."""
    import json

    from ouroboros_local import cli

    assert cli.main(["calibrate", "-m", str(tiny_target), "-d", str(tiny_draft), "-c", "256"]) == 0
    assert re.search(r"draft .*: one step [\d.]+s \([\d.]+ target steps\); decodes of 2: ", capsys.readouterr().out)
    assert cli.main(["calibrate", "-m", str(tiny_target), "-d", str(tiny_draft), "-c", "256", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["draft"]["sizes"][0] == 1 and report["draft"]["origin"].startswith("cached")
    assert report["saved"] and report["draft"]["saved"]


def test_calibrate_that_cannot_save_its_curve_says_so_in_its_status(tiny_target, tmp_path, monkeypatch,
                                                                    capsys) -> None:
    """Saving the curve is the command's point: a cache it could not write exited 0, --json silent on it."""
    import json

    from ouroboros_local import cli

    (tmp_path / "not-a-folder").write_text("")
    monkeypatch.setenv("OUROBOROS_CALIBRATION_FILE", str(tmp_path / "not-a-folder" / "calibration.json"))
    assert cli.main(["calibrate", "-m", str(tiny_target), "-c", "256", "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["saved"] is False
    frozen = tmp_path / "frozen.json"   # made read-only by its owner: not saved either
    frozen.write_text("{}")
    frozen.chmod(0o444)
    monkeypatch.setenv("OUROBOROS_CALIBRATION_FILE", str(frozen))
    assert cli.main(["calibrate", "-m", str(tiny_target), "-c", "256", "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["saved"] is False and frozen.read_text() == "{}"
