"""Cost model, acceptance estimate and draft-length choice."""

from __future__ import annotations

import json
from bisect import bisect_right

import numpy as np
import pytest

from ouroboros_local.engine import Engine, EngineConfig
from ouroboros_local.llama import Model
from ouroboros_local.acceptance import Acceptance, ConfidenceTable, probability_class
from ouroboros_local.calibration import SWITCH_STEPS, CalibrationCache, CostModel
from ouroboros_local.proposers.base import Proposer
from ouroboros_local.scheduler import (MAX_ALPHA, MIN_GAIN, PROBE_EVERY, REFRESH_ROUNDS, Scheduler,
                                       _upper_envelope)
from ouroboros_local.tree import TokenTree

CPU = CostModel(sizes=[1, 2, 4, 8, 16], seconds=[1.0, 1.7, 3.0, 5.5, 9.5])   # docs/design.md#cost-model
GPU = CostModel(sizes=[1, 8, 16, 32], seconds=[1.0, 1.05, 1.1, 1.3])


def test_expected_tokens_per_depth() -> None:
    acc = Acceptance()
    for _ in range(200):
        acc.update(drafted=2, accepted=1)     # right at depth 0, wrong at depth 1
    # drafting 0, 1 or 2 tokens yields 1, ~2 and ~2 tokens: the second draft token never lands
    assert acc.expected_all(2) == pytest.approx([1.0, 2.0, 2.0], abs=0.05)


def test_cost_interpolates_and_extrapolates() -> None:
    assert CPU.cost(3) == pytest.approx(2.35)
    assert CPU.cost(20) > CPU.cost(16)
    assert CPU.ratio(8) == pytest.approx(5.5)


def scheduler_with(costs: CostModel, alpha: float) -> Scheduler:
    sched = Scheduler(costs, max_length=16)
    sched.acceptance["x"] = Acceptance(successes=alpha * 1000, failures=(1 - alpha) * 1000)
    return sched


def test_cpu_drafts_short_or_not_at_all_and_gpu_drafts_long() -> None:
    assert scheduler_with(CPU, 0.3).best_length("x") == 0       # nothing pays at 30% on this CPU
    k_cpu = scheduler_with(CPU, 0.9).best_length("x")
    k_gpu = scheduler_with(GPU, 0.9).best_length("x")
    assert 1 <= k_cpu < k_gpu
    assert scheduler_with(GPU, 0.99).best_length("x") == 16


def test_a_one_token_draft_must_promise_a_margin() -> None:
    # on this curve a 1-token draft breaks even at alpha 0.7; at 0.73 it promises ~2%, which the noise
    # in the estimate can turn into a loss (scheduler.MIN_GAIN); at 0.8 it promises ~6% and runs
    assert (1 + 0.73) / CPU.cost(2) > 1.0
    assert scheduler_with(CPU, 0.73).best_length("x") == 0
    assert scheduler_with(CPU, 0.8).best_length("x") == 1


def test_draft_cost_shortens_drafts() -> None:
    free = scheduler_with(GPU, 0.8).best_length("x", draft_cost=0.0)
    paid = scheduler_with(GPU, 0.8).best_length("x", draft_cost=0.5)
    assert paid < free


def test_acceptance_estimate_tracks_observations() -> None:
    acc = Acceptance()
    for _ in range(50):
        acc.update(drafted=4, accepted=4)
    assert acc.alpha > 0.9
    for _ in range(200):
        acc.update(drafted=4, accepted=0)
    assert acc.alpha < 0.2


CHEAP = CostModel(sizes=[1, 2, 4, 8], seconds=[1.0, 1.01, 1.02, 1.04])   # probes cost ~1% of a step


def test_probing_backs_off_after_failed_probes() -> None:
    sched = scheduler_with(CHEAP, 0.01)
    lengths = [sched.best_length("x") for _ in range(8)]
    assert lengths[-1] == sched.probe_length and sum(lengths[:-1]) == 0
    sched.update("x", drafted=2, accepted=0)
    lengths = [sched.best_length("x") for _ in range(16)]
    assert lengths[-1] > 0 and sum(lengths[:-1]) == 0  # the interval doubled to 16


def costly_failing_round(sched: Scheduler) -> int:
    """One round of a draft model whose every draft costs 20 plain steps and is rejected; its length."""
    k = sched.best_length("x", draft_cost=sched.draft_cost("x"))
    sched.note_draft("x", 20.0 if k else 0.0, k)
    sched.update("x", drafted=k, accepted=0)
    sched.observe_round(k + 1, CPU.cost(k + 1))
    return k


def test_costly_probes_stay_within_their_time_budget() -> None:
    # a draft model that must catch up on all the text it skipped: each probe costs 20 plain steps of
    # drafting plus its extra verification; probes go on, but within PROBE_BUDGET of the time
    import ouroboros_local.scheduler as scheduler_module

    sched = scheduler_with(CPU, 0.01)
    probes = spent = elapsed = 0.0
    for _ in range(20000):
        k = costly_failing_round(sched)
        probes += k > 0
        spent += (20.0 + CPU.cost(k + 1) - CPU.cost(1)) if k else 0.0
        elapsed += CPU.cost(k + 1) + (20.0 if k else 0.0)
    assert probes >= 10                                  # it keeps checking whether drafting pays now
    assert spent <= scheduler_module.PROBE_BUDGET * elapsed + 21.35 + CPU.cost(3)


def test_probe_budget_is_each_methods_own() -> None:
    # a benchmark runs many methods on one engine: their time must not pay for one method's probes
    sched = scheduler_with(CPU, 0.01)
    sched.use_method("vanilla")
    for _ in range(10000):
        sched.observe_round(1, CPU.cost(1))          # 10000 steps of another method
    sched.use_method("auto")
    probes = 0
    for _ in range(2000):
        probes += costly_failing_round(sched) > 0
    # auto's own ~2000 steps allow ~20 s of probes (one, plus the allowance for a first one); the
    # other method's 10000 would have allowed five times more
    assert 1 <= probes <= 2


def test_a_methods_candidates_share_its_probe_budget() -> None:
    # auto asks prompt lookup and the suffix tries: together their probes stay within PROBE_BUDGET
    def probes(sources: tuple[str, ...]) -> int:
        sched = Scheduler(CPU, max_length=16)
        sched.use_method("auto")
        n = 0
        for _ in range(20000):
            k_all = 0
            for source in sources:   # drafts that cost 20 plain steps and are always rejected
                sched.acceptance.setdefault(source, Acceptance(successes=10, failures=990))
                k = sched.best_length(source, draft_cost=sched.draft_cost(source))
                sched.note_draft(source, 20.0 if k else 0.0, k)
                sched.update(source, drafted=k, accepted=0)
                n += k > 0
                k_all = max(k_all, k)
            sched.observe_round(k_all + 1, CPU.cost(k_all + 1))
        return n

    one, two = probes(("a",)), probes(("a", "b"))
    assert one >= 3
    assert two <= one + 1


def test_catch_up_is_left_out_of_the_per_token_cost() -> None:
    sched = Scheduler(CPU)
    sched.use_method("auto")
    sched._probing.add("d")
    sched.note_draft("d", 30.2, 2, catch_up=30.0)     # 300 skipped tokens, then 2 drafted
    assert sched.draft_cost("d") == pytest.approx(0.1)
    assert sched._probe_spent["auto"] == pytest.approx(30.2)   # a probe pays for all of it


class BehindDraft(Proposer):
    """A draft model ``behind`` tokens behind the text; its drafts are two tokens, its catch-up 6 s."""

    name = "d"

    def __init__(self, behind: int) -> None:
        self.behind, self.asked = behind, 0

    def catch_up_tokens(self, committed) -> int:
        return self.behind

    def propose(self, committed, budget) -> TokenTree:
        self.asked += 1
        self.catch_up_seconds = 6.0 if self.behind else 0.0
        tree = TokenTree.rooted_at(committed[-1])
        tree.add(tree.add(0, 1), 2)
        return tree


def test_a_probe_does_not_read_a_long_prompt_the_probe_budget_cannot_pay_for() -> None:
    # the 0.5B draft of the 1.5B target probed once on a 773-token prompt it had not read: 6 s of
    # catch-up, 0.30x of plain decoding on that prompt (cnndm, 2 cores)
    import ouroboros_local.scheduler as scheduler_module

    sched = scheduler_with(CPU, 0.01)
    sched.acceptance["d"] = sched.acceptance.pop("x")
    sched.use_method("auto")
    far, near = BehindDraft(773), BehindDraft(0)
    for _ in range(64):
        sched.draft(far, [0, 5], budget=8)
        sched.observe_round(1, CPU.cost(1))
    assert far.asked == 0                      # a probe was due every 8 rounds; none could afford it
    for _ in range(64):
        sched.draft(near, [0, 5], budget=8)
        sched.observe_round(1, CPU.cost(1))
    assert near.asked >= 1                     # a draft that has read the text probes as before
    # once the time run makes the catch-up 1% of it, the probe runs, as a probe (charged to the budget)
    sched.observe_round(1, 100 * 773 * sched.catch_up_cost("d"))
    for _ in range(64):
        if far.asked:
            break
        sched.draft(far, [0, 5], budget=8)
    assert far.asked == 1 and "d" in sched._probing
    assert scheduler_module.CATCH_UP_MIN <= 773


def test_a_probe_does_not_read_the_prompt_before_its_request_has_run_four_times_as_long() -> None:
    # the 0.5B draft's first probe in a benchmark of the 1.5B target, after five sets, read a 45-token
    # prompt on an 8-token answer: the run's probe budget allowed it, one short request paid for it all
    sched = scheduler_with(CPU, 0.01)
    sched.acceptance["d"] = sched.acceptance.pop("x")
    sched.use_method("auto")
    draft = BehindDraft(40)
    catch_up = 40 * sched.catch_up_cost("d")
    sched.observe_round(1, 1000 * catch_up)     # an earlier request: the probe budget covers the catch-up
    sched.begin_request()
    for _ in range(16):                         # probes fall due every 8 rounds
        sched.draft(draft, [0, 5], budget=8)
        sched.observe_round(1, CPU.cost(1))
    assert draft.asked == 0 and 16 * CPU.cost(1) < 4 * catch_up
    sched.observe_round(1, 4 * catch_up)        # the request has now run four times the catch-up
    for _ in range(16):
        if draft.asked:
            break
        sched.draft(draft, [0, 5], budget=8)
        sched.observe_round(1, CPU.cost(1))
    assert draft.asked == 1 and "d" in sched._probing


def test_a_draft_that_pays_catches_up_when_its_saving_repays_it() -> None:
    sched = Scheduler(CPU, draft_scale=0.5)    # 100 tokens: ~30 steps; 64 rounds save ~58
    sched.acceptance["d"] = Acceptance(successes=950, failures=50)
    short, huge = BehindDraft(100), BehindDraft(10**6)
    assert sched.catch_up_pays("d", short.behind) and "d" not in sched._probing
    assert sched.draft(short, [0, 5], budget=8).n_candidates and short.asked == 1
    assert not sched.catch_up_pays("d", huge.behind)   # a million tokens: no saving repays that


def test_the_catch_up_cost_is_priced_by_the_drafts_size_then_measured() -> None:
    sched = Scheduler(CPU, draft_scale=0.5)
    assert sched.catch_up_cost("d") == pytest.approx(0.5 * CPU.cost(16) / 16)
    sched.note_draft("d", 4.2, 2, catch_up=4.0, catch_up_tokens=800)
    assert sched.catch_up_cost("d") == pytest.approx(0.005)
    sched.note_draft("d", 0.3, 2, catch_up=0.1, catch_up_tokens=3)   # too short to say what reading costs
    assert sched.catch_up_cost("d") == pytest.approx(0.005)


def test_catch_up_clock_tells_skipped_rounds() -> None:
    from ouroboros_local.proposers.base import CatchUp

    clock = CatchUp()
    assert clock.asked()              # a new prompt: all of it is skipped text
    clock.observed()
    assert not clock.asked()          # drafted the round before: steady
    clock.observed()
    clock.observed()                  # a round served without it
    assert clock.asked()
    clock.start()                     # next generation
    assert clock.asked()


def test_draft_cost_is_learned_and_damped_against_one_slow_round() -> None:
    sched = Scheduler(CPU)
    assert sched.draft_cost("d") == 0.0
    sched.note_draft("d", 0.2, 2)
    assert sched.draft_cost("d") == pytest.approx(0.1)
    sched.note_draft("d", 30.0, 2)                       # a catch-up on 300 skipped tokens
    assert sched.draft_cost("d") == pytest.approx(0.1 + 0.2 * (0.3 - 0.1))
    sched.note_draft("d", 0.0, 0)                        # nothing drafted: the figure stays
    assert sched.draft_cost("d") == pytest.approx(0.14)


def test_calibration_is_measured_once_and_cached(tiny_target, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("OUROBOROS_CALIBRATION_FILE", str(tmp_path / "cal.json"))
    config = EngineConfig(n_ctx=256, n_batch=32, n_seq_max=4, threads=1)
    with Engine(Model(tiny_target), None, config) as engine:
        first = engine.cost_model()
        assert first.sizes[0] == 1 and all(s > 0 for s in first.seconds)
        assert min(first.seconds) == first.seconds[0]   # kept as measured, but nothing below one token
        data = json.loads((tmp_path / "cal.json").read_text())
        assert first.key in data
        assert CalibrationCache(tmp_path / "cal.json").get(first.key).seconds == first.seconds
        # a second engine with the same settings reuses the curve without measuring
        import ouroboros_local.engine as eng

        monkeypatch.setattr(eng, "measure_costs", lambda *a, **k: pytest.fail("re-measured"))
        assert engine.cost_model().seconds == first.seconds
    # other settings -> another key
    config2 = EngineConfig(n_ctx=256, n_batch=16, n_seq_max=4, threads=1)
    with Engine(Model(tiny_target), None, config2) as engine:
        monkeypatch.setattr(eng, "measure_costs", lambda kv: CostModel([1], [1.0]))
        assert engine.cost_model().key != first.key


def test_probe_that_accepts_but_does_not_pay_still_backs_off(monkeypatch) -> None:
    import ouroboros_local.scheduler as scheduler_module

    monkeypatch.setattr(scheduler_module, "PROBE_BUDGET", 1.0)   # the doubling alone decides here
    sched = scheduler_with(CPU, 0.05)
    cost = CPU.cost(1)  # an expensive draft: one draft token costs a whole target step
    lengths = [sched.best_length("x", cost) for _ in range(8)]
    assert lengths[-1] == sched.probe_length
    sched.update("x", drafted=2, accepted=1)     # something accepted, but drafting still loses
    lengths = [sched.best_length("x", cost) for _ in range(16)]
    assert lengths[-1] > 0 and sum(lengths[:-1]) == 0


def test_acceptance_per_depth_sees_all_or_nothing_runs() -> None:
    acc = Acceptance()
    for i in range(100):
        acc.update(drafted=8, accepted=8 if i % 2 else 0)   # a copy is right to the end, or wrong at once
    assert acc.alpha_at(0) == pytest.approx(0.5, abs=0.05)
    assert all(acc.alpha_at(d) > 0.95 for d in range(1, 8))
    assert acc.expected_all(8)[-1] == pytest.approx(1 + 0.5 * 8, rel=0.05)
    assert acc.alpha_at(20) == acc.alpha          # never drafted that deep: the pooled estimate


def test_measured_round_overhead_stops_drafting_that_does_not_pay() -> None:
    # GPU-like curve: drafting 8 at alpha 0.6 looks like a clear win from c(n) alone
    sched = scheduler_with(GPU, 0.6)
    assert sched.best_length("x") > 0
    for _ in range(60):   # but every drafted round really costs 1.5 steps more than c(n) (small model, GPU)
        sched.observe_round(1, GPU.cost(1))
        sched.observe_round(9, GPU.cost(9) + 1.5)
    seconds = sched.round_seconds(8)
    assert seconds[0] == pytest.approx(GPU.cost(1), rel=1e-6)
    assert seconds[8] == pytest.approx(GPU.cost(9) + 1.5, rel=0.01)
    assert sched.best_length("x") == 0


def test_what_plain_steps_lose_after_a_drafted_round_is_charged_to_drafting() -> None:
    """On an H200, SmolLM2-135M took 1.35 ms per plain step back to back and ~4.2 ms after a decode of
    another size (no CUDA graph); a decode of 8 took 4.7 ms, and the two plain steps after it ran
    without their graph too. The curve timed size after size saw 4.2 ms for a plain step, and drafting
    at alpha 0.6 looked like a win; it is not. Long confident drafts still pay."""
    size_after_size = CostModel(sizes=[1, 2, 8, 16], seconds=[4.2, 4.5, 4.7, 6.2])
    assert scheduler_with(size_after_size, 0.6).best_length("x") > 0
    h200 = CostModel(sizes=[1, 2, 8, 16], seconds=[1.35, 4.5, 4.7, 6.2], switch_seconds=4.0)
    sched = scheduler_with(h200, 0.6)
    assert sched.round_seconds(8)[8] == pytest.approx(h200.cost(9) + 4.0)
    assert sched.best_length("x") == 0
    assert scheduler_with(h200, 0.97).best_length("x") > 0
    # where a shape change costs nothing (2 CPU cores, a 1.5B model), drafting is priced as before
    cpu = scheduler_with(CostModel(sizes=CPU.sizes, seconds=CPU.seconds, switch_seconds=0.0), 0.8)
    assert cpu.round_seconds(8).tolist() == CPU.table(9).tolist() and cpu.best_length("x") > 0


def test_plain_steps_after_a_drafted_round_measure_the_switch_not_the_plain_step() -> None:
    sched = scheduler_with(GPU, 0.6)
    for _ in range(40):
        sched.observe_round(9, GPU.cost(9))
        sched.observe_round(1, 3.0 * GPU.cost(1))    # no CUDA graph: the shape changed
        sched.observe_round(1, 2.0 * GPU.cost(1))    # capturing it again
        for _ in range(3):
            sched.observe_round(1, GPU.cost(1))      # replayed
    assert sched.round_costs.switch == pytest.approx(3.0 * GPU.cost(1), rel=0.01)
    seconds = sched.round_seconds(8)
    assert seconds[0] == pytest.approx(GPU.cost(1))
    assert seconds[8] == pytest.approx(GPU.cost(9) + 3.0 * GPU.cost(1), rel=0.01)
    assert sched.best_length("x") == 0


def test_a_copy_drafted_round_after_round_pays_the_switch_once() -> None:
    """On an H200 (Qwen2.5-Coder-0.5B) a second pass of code edits drafted round after round (6.3
    tokens a pass, 1.61x): only the last drafted round of a run has plain steps after it."""
    h200 = CostModel(sizes=[1, 2, 8, 16], seconds=[1.44, 3.56, 3.8, 5.4], switch_seconds=2.7)
    sched = scheduler_with(h200, 0.75)
    assert sched.best_length("x") == 0          # every drafted round charged the switch: no
    for _ in range(4):
        for _ in range(10):
            sched.observe_round(9, h200.cost(9))
        for lost in (1.35, 1.35, 0.0):              # two plain steps without their graph, then with it
            sched.observe_round(1, h200.cost(1) + lost)
    assert sched.round_costs.switch == pytest.approx(2.7)
    assert sched.round_costs.end_share() == pytest.approx((4 + 2) / (32 + 2))
    assert sched.round_seconds(8)[8] == pytest.approx(h200.cost(9) + 2.7 * 6 / 34)
    assert sched.best_length("x") > 0
    table = sched.round_costs.shared_table(9)
    for _ in range(12):                             # drafted rounds one at a time: each pays the switch
        sched.observe_round(9, h200.cost(9))
        for lost in (1.35, 1.35, 0.0):
            sched.observe_round(1, h200.cost(1) + lost)
    share = sched.round_costs.end_share()
    assert share > 0.4 and sched.round_costs.shared_table(9) is table    # no size drifted: not redrawn
    assert sched.round_seconds(8)[8] == pytest.approx(h200.cost(9) + 2.7 * share)


def test_one_plain_step_slowed_by_another_process_does_not_stop_drafting() -> None:
    """Only drafted rounds measure the switch: a switch estimate made dear by one slow step would stop
    drafting, and nothing would correct it."""
    sched = scheduler_with(CPU, 0.8)
    for i in range(12):
        sched.observe_round(9, CPU.cost(9))
        sched.observe_round(1, (300.0 if i == 5 else 1.0) * CPU.cost(1))   # a burst of load
        sched.observe_round(1, CPU.cost(1))
    assert sched.round_costs.switch == pytest.approx(0.0, abs=1e-9)
    assert sched.best_length("x") > 0


def test_a_curve_measured_too_flat_is_corrected_by_the_rounds() -> None:
    """A cached curve that makes long batches look cheap: measured rounds restore their price, the
    sizes between measured ones interpolated, beyond the largest one its factor."""
    flat = CostModel(sizes=[1, 2, 4, 8, 16], seconds=[1.0, 1.6, 2.6, 3.5, 6.0])
    real = CostModel(sizes=[1, 2, 4, 8, 16], seconds=[1.0, 1.9, 2.9, 5.0, 9.3])
    sched = Scheduler(flat)
    for _ in range(40):
        for n in (1, 2, 4, 8):
            sched.observe_round(n, real.cost(n))
    seconds = sched.round_seconds(15)
    for n in (1, 2, 4, 8):
        assert seconds[n - 1] == pytest.approx(real.cost(n), rel=1e-6)
    assert real.cost(2) < seconds[2] < real.cost(4)                         # n = 3, interpolated
    assert seconds[15] == pytest.approx(flat.cost(16) * real.cost(8) / flat.cost(8), rel=1e-6)
    assert Scheduler(flat).round_seconds(4).tolist() == flat.table(5).tolist()   # nothing measured yet
    slower = Scheduler(flat)             # only plain steps measured, 1.5x slower than calibrated: all sizes
    for _ in range(5):
        slower.observe_round(1, 1.5 * flat.cost(1))
    assert slower.round_seconds(4) == pytest.approx(1.5 * flat.table(5))


def test_engine_feeds_round_costs_to_the_scheduler(tiny_target) -> None:
    config = EngineConfig(n_ctx=256, n_batch=32, n_seq_max=4, threads=1)
    with Engine(Model(tiny_target), None, config) as engine:
        engine.scheduler().costs = CostModel(sizes=[1, 64], seconds=[1e-9, 1e-9])  # ~all is overhead
        for prompt in ("abc abc abc abc abc abc", "a b c", "cab", "bca bca"):
            engine.generate(prompt, max_tokens=24, method="vanilla")
        assert engine.scheduler().round_costs.factor(1) > 1.0


def test_round_costs_are_kept_per_method() -> None:
    sched = scheduler_with(GPU, 0.6)
    sched.use_method("lookahead")                # a window of extra rows: dear rounds
    for _ in range(60):
        sched.observe_round(9, GPU.cost(9) + 1.5)
    sched.use_method("prompt-lookup")            # its own rounds cost what c(n) says
    assert sched.round_seconds(8)[8] == pytest.approx(GPU.cost(9)) and sched.best_length("x") > 0
    sched.use_method("lookahead")
    assert sched.round_seconds(8)[8] == pytest.approx(GPU.cost(9) + 1.5, rel=0.01)


# ---- confidence classes ------------------------------------------------------------------------------

def labelled_chain(classes: list[str]) -> TokenTree:
    tree = TokenTree.rooted_at(0)
    for i, cls in enumerate(classes, 1):
        node = tree.add(i - 1, 100 + i)
        tree.classes[node] = cls
    return tree


def trained(costs: CostModel, rates: dict[str, float], rounds: int = 200) -> Scheduler:
    """A scheduler that has seen 1-token drafts of each class accepted at the given rate."""
    sched = Scheduler(costs, max_length=8)
    rng = np.random.default_rng(0)
    for _ in range(rounds):
        for cls, rate in rates.items():
            tree = labelled_chain([cls])
            sched.trim("x", tree)             # every draft is offered for trimming: its first class counts
            accepted = int(rng.random() < rate)
            sched.update("x", 1, accepted)
            sched.update_classes("x", tree, accepted)
    sched.begin_request()   # what the training rounds did is the table's, not the next request's
    sched.looks._kept_last.clear()   # past the request's first round (looked at in every request: tested apart)
    return sched


def test_probability_classes_are_ordered() -> None:
    assert probability_class(0.1) == "p0"
    assert probability_class(0.999) == "p8"
    assert [probability_class(p) for p in (0.4, 0.85, 0.97)] == ["p1", "p4", "p6"]


def test_trim_keeps_confident_tokens_and_cuts_doubtful_ones() -> None:
    sched = trained(CPU, {"sure": 0.97, "doubt": 0.2})
    assert sched.confidence["x"].alphas(["sure", "doubt"], np.full(2, 0.5))[0] > 0.9
    tree = labelled_chain(["sure", "sure", "doubt", "sure"])
    cut = sched.trim("x", tree)
    assert cut.tokens == tree.tokens[:3] and cut.classes == {1: "sure", 2: "sure"}
    assert sched.trim("x", labelled_chain(["doubt", "sure"])).n_candidates == 0
    # the same doubtful draft pays on a GPU-like curve, where verifying more is nearly free
    gpu = trained(GPU, {"sure": 0.97, "doubt": 0.2})
    assert gpu.trim("x", labelled_chain(["doubt", "sure"])).n_candidates == 2


def test_a_request_whose_drafts_fail_stops_drafting_long_before_the_table_learns_it() -> None:
    # over many requests, copies were right 95% of the time: a 3-token copy pays on this CPU curve
    sched = trained(CPU, {"copy": 0.95}, rounds=400)
    assert sched.trim("x", labelled_chain(["copy"] * 3)).n_candidates == 3
    # this request's text is paraphrased: its copies are wrong, and within two drafts it stops copying
    failed = 0
    while failed < 20 and (tree := sched.trim("x", labelled_chain(["copy"] * 3))).n_candidates:
        sched.learn("x", tree, 0)
        failed += 1
    assert failed <= 2
    assert sched.confidence["x"].alphas(["copy"], np.full(1, 0.5))[0] > 0.85   # the table barely moved
    assert sched.best_length("x", draft_cost=0.05) == 0                      # a paid draft is not started
    # the next request starts from the table's estimate again
    sched.begin_request()
    assert sched.trim("x", labelled_chain(["copy"] * 3)).n_candidates == 3


def test_a_requests_correction_is_bounded() -> None:
    sched = trained(CPU, {"maybe": 0.5})
    for _ in range(50):
        sched.learn("x", labelled_chain(["maybe"]), 1)         # a lucky request
    assert sched.request_scale("x") == pytest.approx(1.25)
    sched.begin_request()
    for _ in range(50):
        sched.learn("x", labelled_chain(["maybe"]), 0)
    assert sched.request_scale("x") == pytest.approx(0.2)
    tree = branching([(0, "maybe"), (0, "maybe"), (0, "maybe")])   # three guesses at one token expect
    sched.begin_request()                                           # at most one accepted token
    sched.learn("x", tree, 1, path=[0, 2])
    assert sched._request["x"] == [1.0, pytest.approx(1.0)]


def test_a_request_that_drafts_better_raises_the_odds_not_the_probability() -> None:
    from ouroboros_local.scheduler import _scaled_alpha

    assert _scaled_alpha(0.8, 1.25) == pytest.approx(5 / 6)          # odds 4 -> 5, not 0.8 * 1.25 = 1
    assert _scaled_alpha(0.3, 1.25) == pytest.approx(0.349, abs=1e-3)
    assert _scaled_alpha(0.8, 0.5) == pytest.approx(0.4)              # one that falls short: in proportion
    assert _scaled_alpha(1.0, 1.25) == MAX_ALPHA and _scaled_alpha(0.9, 1.0) == 0.9
    sched = trained(CPU, {"sure": 0.8})
    sched._request["x"] = [100.0, 50.0]                               # a lucky request: scale 1.25
    q = sched._alphas("x", sched.confidence["x"], ["sure"], np.array([0.5]))[0]
    assert q == pytest.approx(_scaled_alpha(float(sched.confidence["x"].alpha("sure", 0.5)), 1.25))
    assert sched._chain_expected("x", ["sure"] * 8)[-1] < 1 + 8 * 0.9   # not a near-certain chain


def test_sampled_drafts_are_never_trimmed() -> None:
    sched = trained(CPU, {"doubt": 0.1})
    tree = labelled_chain(["doubt", "doubt"])
    tree.draft_probs[1] = np.ones(4) / 4
    assert sched.trim("x", tree) is tree


def test_extend_pays_stops_after_a_doubtful_token() -> None:
    sched = trained(CPU, {"sure": 0.97, "doubt": 0.1})
    assert sched.extend_pays("x", ["sure"], draft_cost=0.05)
    assert not sched.extend_pays("x", ["doubt"], draft_cost=0.05)
    assert not sched.extend_pays("x", ["sure"] * 8, draft_cost=0.0)   # max_length reached


def test_drafting_starts_only_when_the_class_mix_pays() -> None:
    mostly_sure = trained(CPU, {"sure": 0.98, "doubt": 0.3})
    assert mostly_sure.best_length("x", draft_cost=0.05) == 8
    hopeless = trained(CPU, {"doubt": 0.3})
    assert hopeless.best_length("x", draft_cost=0.05) == 0
    # free drafts (prompt lookup) always start: a bad one is trimmed to nothing at no cost
    assert hopeless.best_length("x", draft_cost=0.0) == 8


def test_the_class_mix_counts_drafts_that_were_trimmed_away() -> None:
    # a draft model whose drafts mostly start doubtful: verified drafts are the few sure ones (the rest
    # are trimmed), yet the mix must say that drafting rarely pays
    sched = trained(CPU, {"sure": 0.98, "doubt": 0.1})
    assert sched.best_length("x", draft_cost=0.05) == 8
    for _ in range(400):
        assert sched.trim("x", labelled_chain(["doubt", "doubt"])).n_candidates == 0
        sched.observe_round(1, CPU.cost(1))
    assert sched.best_length("x", draft_cost=0.05) == 0


def test_the_drafting_decision_is_recomputed_only_when_its_inputs_change(monkeypatch) -> None:
    import ouroboros_local.scheduler as scheduler_module

    sched = trained(CPU, {"sure": 0.98, "doubt": 0.1})
    calls = []
    real = Scheduler._classes_pay
    monkeypatch.setattr(Scheduler, "_classes_pay", lambda self, *a: calls.append(1) or real(self, *a))
    for _ in range(scheduler_module.REFRESH_ROUNDS):            # plain rounds: nothing it reads changed
        assert sched.best_length("x", draft_cost=0.02) == 8
        sched.observe_round(1, CPU.cost(1))
    assert len(calls) == 1
    sched.best_length("x", draft_cost=0.02)
    sched.best_length("x", draft_cost=0.02)
    assert len(calls) == 2                                      # the overheads may have drifted
    sched.trim("x", labelled_chain(["doubt", "doubt"]))         # the mix drifts: kept till a refresh
    sched.best_length("x", draft_cost=0.02)
    assert len(calls) == 2
    sched.trim("x", labelled_chain(["new", "doubt"]))           # a class new to the mix
    sched.best_length("x", draft_cost=0.02)
    assert len(calls) == 3
    sched._probing.clear()          # (that draft was kept as a probe of its new class: not this test's)
    sched.best_length("x", draft_cost=0.03)                     # another cost, another question
    assert len(calls) == 4
    # an answer's last rounds shrink the budget every round: priced per power of two, not per budget
    assert [sched.best_length("x", draft_cost=0.03, limit=k) for k in (7, 6, 5, 4)] == [7, 6, 5, 4]
    assert len(calls) == 5                                      # limits 4-7 are all priced at 4
    sched.best_length("x", draft_cost=0.03)
    calls.clear()
    sched.note_draft("x", 0.001, 4)                             # a timed draft (a look): its cost is a key
    sched.update("y", 2, 1)                                     # another proposer learned: not x's inputs
    sched.trim("y", labelled_chain(["new", "doubt"]))
    assert sched.best_length("x", draft_cost=0.03) == 8
    assert calls == []
    sched.best_length("x", draft_cost=0.0305)                   # within the same 10% step of cost
    assert calls == []
    sched.update("x", 2, 0)                                     # x's own acceptance changed
    sched.best_length("x", draft_cost=0.0305)
    assert len(calls) == 1


def test_a_no_stands_through_news_that_can_only_lower_the_estimates(monkeypatch) -> None:
    # on text with nothing to copy, every look's draft is rejected at its first node: recomputing "does
    # drafting pay" after each was most of what auto's idle rounds cost
    sched = stale_mix()
    sched._probe_every["x"] = 10 ** 6                               # no probe in between
    cost = sched.draft_cost("x")
    calls = []
    real = Scheduler._classes_pay
    monkeypatch.setattr(Scheduler, "_classes_pay", lambda self, *a: calls.append(1) or real(self, *a))
    for _ in range(5):
        sched.learn("x", labelled_chain(["lo", "lo", "lo"]), 0)    # rejected at once
        sched._learn_chain("x", ["hi", "lo"], 0)                    # a held draft the text refuted
        assert sched.best_length("x", cost, 8) == 0
    assert [sched.best_length("x", cost, k) for k in (7, 3, 1)] == [0, 0, 0]   # shorter budgets: still no
    assert calls == []
    sched._learn_chain("x", ["hi", "hi"], 2)                        # accepted nodes: may now pay
    sched.best_length("x", cost, 8)
    assert len(calls) == 1
    for _ in range(REFRESH_ROUNDS):                                 # and the slow drift: a refresh
        sched.observe_round(1, CPU.cost(1))
    sched.best_length("x", cost, 8)
    assert len(calls) == 2


def test_cheap_drafting_costs_share_one_key() -> None:
    sched = trained(CPU, {"sure": 0.98, "doubt": 0.1})
    step = CPU.cost(1)
    cheap = [sched._cost_key(c * step, 16) for c in (1e-5, 1e-4, 1e-3)]
    assert cheap == [("cheap", 0)] * 3                          # a free drafter's figure swings; moot here
    assert sched._cost_key(0.0, 16) != sched._cost_key(1e-5 * step, 16)   # unmeasured vs measured
    assert sched._cost_key(0.5 * step, 16) != sched._cost_key(0.6 * step, 16)


def test_without_any_draft_yet_the_prior_decides() -> None:
    cpu, gpu = Scheduler(CPU), Scheduler(GPU)
    for sched in (cpu, gpu):
        sched.labels("x")
    assert gpu.best_length("x", draft_cost=0.01) == 16   # verification nearly free: draft at once
    assert [cpu.best_length("x", draft_cost=0.01) for _ in range(8)] == [0] * 7 + [cpu.probe_length]


def test_truncated_tree_keeps_ids_parents_and_labels() -> None:
    tree = TokenTree.rooted_at(5)
    a = tree.add(0, 6, source="s")
    tree.add(a, 7)
    b = tree.add(0, 8)
    tree.classes.update({a: "x", b: "y"})
    cut = tree.truncated(1)
    assert cut.tokens == [5, 6, 8] and cut.parents == [-1, 0, 0]
    assert cut.classes == {1: "x", 2: "y"} and cut.sources == {1: "s"}
    assert tree.truncated(5) is tree
    assert tree.truncated(0) == tree.subtree([0]) == TokenTree.rooted_at(5)   # the root alone, unlabelled


def test_the_class_mix_decision_matches_the_per_class_rule() -> None:
    """``_classes_pay`` (one envelope of lines for all the first classes) decides as the rule reads: for
    each first class, the best cut of a chain starting with it, weighted by how often the class comes
    first; the class estimates scaled by the request's record."""
    rng = np.random.default_rng(3)
    for trial in range(200):
        costs = CPU if trial % 2 else GPU
        sched = Scheduler(costs, max_length=8)
        table = sched.confidence.setdefault("x", ConfidenceTable())
        for c in range(int(rng.integers(1, 12))):
            cls = f"c{c}"
            table.first[cls] = float(rng.random() * 5)
            table.trials[cls] = float(rng.random() * 4)
            table.successes[cls] = table.trials[cls] * float(rng.random())
        draft_cost = float(rng.choice([0.0, 0.05, 0.3]))
        limit = int(rng.integers(1, 9))
        acc = sched.estimate("x")
        for _ in range(int(rng.integers(0, 6))):
            acc.update(limit, int(rng.integers(0, limit + 1)))
        if trial % 3 == 0:   # this request's drafts fared better or worse than the estimates
            sched._request["x"] = [float(rng.random() * 8), float(rng.random() * 8)]
        scale = sched.request_scale("x")
        base = acc.depth_alphas(limit)
        seconds = sched.round_seconds(limit)
        tokens = time = 0.0
        for cls, weight in table.first.items():
            q = base.copy()
            q[:1] = table.alphas([cls], base, explore=draft_cost <= 0)
            if scale < 1.0:
                q = np.minimum(q * scale, MAX_ALPHA)
            elif scale > 1.0:                               # raised in odds
                q = np.minimum(q / (1 - q) * scale / (1 + q / (1 - q) * scale), MAX_ALPHA)
            expected = np.concatenate(([1.0], 1.0 + np.cumsum(np.cumprod(q))))
            cost = seconds + draft_cost * np.maximum(np.arange(limit + 1), 1)
            k = int(np.argmax(expected / cost))
            tokens += weight * expected[k]
            time += weight * cost[k]
        margin = MIN_GAIN if draft_cost > 0 else 1.0 - 1e-9   # a paid draft must promise MIN_GAIN
        want = tokens / time >= margin / seconds[0]
        assert sched._classes_pay("x", table, draft_cost, limit) == want, trial


def test_the_upper_envelope_picks_the_highest_line_everywhere() -> None:
    rng = np.random.default_rng(5)
    for trial in range(300):
        n = int(rng.integers(1, 18))
        a, b = rng.random(n).tolist(), (rng.random(n) * 3).tolist()
        if trial % 4 == 0:   # equal slopes and equal intercepts
            b[n // 2] = b[0]
            a[-1] = a[0]
        starts, lengths = _upper_envelope(a, b)
        assert starts == sorted(starts) and starts[0] == 0.0
        for q in rng.random(40):
            k = lengths[bisect_right(starts, q) - 1]
            assert a[k] + q * b[k] >= max(ai + q * bi for ai, bi in zip(a, b)) - 1e-12, (trial, q)


def branching(spec: list[tuple[int, str]]) -> TokenTree:
    """A labelled tree from (parent, class) pairs, nodes numbered from 1 in order."""
    tree = TokenTree.rooted_at(0)
    for i, (parent, cls) in enumerate(spec, 1):
        node = tree.add(parent, 100 + i)
        tree.classes[node] = cls
    return tree


def test_branching_trees_keep_their_likeliest_nodes() -> None:
    sched = trained(CPU, {"sure": 0.97, "doubt": 0.1})
    tree = branching([(0, "doubt"), (1, "doubt"), (0, "sure"), (3, "sure"), (4, "doubt")])
    cut = sched.trim("x", tree)
    assert cut.tokens == [0, 103, 104] and cut.parents == [-1, 0, 1]          # the sure branch, not the rest
    assert cut.classes == {1: "sure", 2: "sure"}
    assert sched.trim("x", branching([(0, "doubt"), (0, "doubt")])).n_candidates == 0
    gpu = trained(GPU, {"sure": 0.97, "doubt": 0.1})                          # verifying more is nearly cheap:
    assert gpu.trim("x", tree).tokens == [0, 101, 103, 104, 105]              # all but the 1% node


def test_a_branching_tree_teaches_every_class_it_tried() -> None:
    sched = Scheduler(CPU, max_length=8)
    tree = branching([(0, "a"), (1, "b"), (0, "c"), (3, "d")])
    sched.learn("x", tree, 2, path=[0, 3, 4])                                 # c then d accepted
    table = sched.confidence["x"]
    assert table.trials == {"a": 1.0, "c": 1.0, "d": 1.0}                     # b's parent was rejected
    assert table.successes == {"a": 0.0, "c": 1.0, "d": 1.0}


# ---- the ceiling: a drafter that loses even when always right is retired ----------------------------
# This machine's curves (calibrate, 2 cores, AVX512): the 1.5B target's c(1..8), and its 0.5B draft's step
QWEN_CPU = CostModel(sizes=[1, 2, 3, 4, 6, 8, 16], seconds=[0.035, 0.058, 0.078, 0.097, 0.144, 0.235, 0.30])
DRAFT_CPU = CostModel(sizes=[1, 2, 4, 8, 16], seconds=[0.020, 0.037, 0.049, 0.089, 0.123])


class ChainDraft(Proposer):
    """A model drafter whose every draft is two tokens; counts how often it is asked."""

    name = "d"
    confidence_classes = False

    def draft_cost_floor(self, draft_costs):
        return draft_costs.cost(1)

    def __init__(self) -> None:
        self.asked = 0

    def propose(self, committed, budget):
        self.asked += 1
        tree = TokenTree.rooted_at(committed[-1])
        tree.add(tree.add(0, 1), 2)
        return tree


def test_a_draft_model_that_cannot_pay_even_when_always_right_is_never_asked() -> None:
    # (k + 1) / (k * 0.020 + c(k + 1)) stays below 1 / c(1) for every k: 0.90x at best
    sched = Scheduler(QWEN_CPU, draft_costs=DRAFT_CPU)
    sched.acceptance["d"] = Acceptance(successes=1000, failures=0)   # as if every draft were accepted
    draft = ChainDraft()
    sched.enroll(draft)
    for _ in range(300):   # long enough for several probes, were it probed
        sched.draft(draft, [0, 5], budget=8)
        sched.observe_round(1, QWEN_CPU.cost(1))
    assert draft.asked == 0
    ceiling = sched.ceiling("d")
    assert 0.85 < ceiling < 0.95
    assert sched.retired == {"d": pytest.approx(ceiling, abs=1e-3)}
    assert sched.best_rate("d", sched.draft_cost("d"), 8) == 0.0   # auto never waits for it


def test_a_retired_drafter_is_not_even_checked_until_its_ceiling_is_re_priced() -> None:
    # on an H200 the 0.5B draft was retired; auto still checked its ceiling every round (~7 µs a check)
    from ouroboros_local.scheduler import REFRESH_ROUNDS

    sched = Scheduler(QWEN_CPU, draft_costs=DRAFT_CPU)
    draft = ChainDraft()
    sched.enroll(draft)
    checks: list[str] = []
    check = sched.hopeless
    sched.hopeless = lambda source: checks.append(source) or check(source)
    for _ in range(4 * REFRESH_ROUNDS):
        sched.draft(draft, [0, 5], budget=8)
        sched.observe_round(1, QWEN_CPU.cost(1))
    assert draft.asked == 0 and len(checks) == 4          # once per REFRESH_ROUNDS rounds
    assert sched.retired
    sched.begin_request()                                  # a new request checks at once
    sched.draft(draft, [0, 5], budget=8)
    assert len(checks) == 5 and draft.asked == 0


def test_a_draft_model_that_can_pay_is_not_retired() -> None:
    # the same draft beside a GPU-like flat curve: always right it would be several times faster
    flat = CostModel(sizes=[1, 8, 16], seconds=[0.035, 0.037, 0.040])
    sched = Scheduler(flat, draft_costs=DRAFT_CPU)
    sched.acceptance["d"] = Acceptance(successes=1000, failures=0)
    draft = ChainDraft()
    sched.enroll(draft)
    assert sched.ceiling("d") > 1.5 and not sched.hopeless("d")
    assert sched.draft(draft, [0, 5], budget=8).n_candidates and draft.asked == 1
    assert sched.retired == {}


def test_a_drafter_without_a_prior_is_retired_only_after_its_timed_rounds() -> None:
    # no prior (a drafter whose draft_cost_floor is unknown, e.g. cross-vocabulary drafts): the least
    # measured per-token cost decides, once RETIRE_AFTER rounds were timed; one slow first round (the
    # weights paged in) does not, and a fast round later lowers the floor
    import ouroboros_local.scheduler as scheduler_module

    sched = Scheduler(QWEN_CPU, draft_costs=DRAFT_CPU)
    assert sched.ceiling("w") is None and not sched.hopeless("w")
    sched.note_draft("w", 2.0, 2)            # 1 s a token: a cold start
    for _ in range(scheduler_module.RETIRE_AFTER - 2):
        sched.note_draft("w", 0.06, 2)
    assert not sched.hopeless("w")           # not yet timed often enough
    sched.note_draft("w", 0.06, 2)           # 0.03 s a token: 0.86 target steps
    assert sched.hopeless("w") and sched.retired["w"] < 1.0
    cheap = Scheduler(QWEN_CPU)
    for _ in range(scheduler_module.RETIRE_AFTER):
        cheap.note_draft("w", 0.0001, 2)     # a free drafter (prompt lookup's Python) is never retired,
    for _ in range(10):                      # even where drafted rounds were measured to cost 3x the curve
        cheap.observe_round(9, 3 * QWEN_CPU.cost(9))
    assert cheap.ceiling("w") is None and not cheap.hopeless("w")


def test_a_ceiling_near_one_retires_and_says_so_once(caplog) -> None:
    # perfect drafts gaining under MIN_GAIN never pay at real acceptance; as the measured round costs move
    # such a ceiling around 1, the drafter stays retired and the log line comes once
    import logging

    from ouroboros_local.scheduler import MIN_GAIN

    sched = Scheduler(QWEN_CPU, draft_costs=CostModel(sizes=[1, 16], seconds=[0.0172, 0.2]))
    draft = ChainDraft()
    sched.enroll(draft)
    ceilings = []
    with caplog.at_level(logging.INFO, logger="ouroboros_local"):
        for factor in (1.0, 0.95, 1.03, 0.94, 1.02):
            sched.use_method(f"m{factor}")          # each method keeps its own round costs
            for _ in range(3):
                sched.observe_round(1, factor * QWEN_CPU.cost(1))
            ceilings.append(sched.ceiling("d"))
            assert sched.hopeless("d")               # retired at every one of them, 1.03 included
            sched.draft(draft, [0, 5], budget=8)
    assert min(ceilings) < 1.0 < max(ceilings) < MIN_GAIN
    assert draft.asked == 0
    assert sum("stays idle" in r.message for r in caplog.records) == 1


def test_the_catch_up_prior_is_the_drafts_own_curve_when_calibrated() -> None:
    sched = Scheduler(QWEN_CPU, draft_scale=0.5, draft_costs=DRAFT_CPU)
    assert sched.catch_up_cost("d") == pytest.approx(DRAFT_CPU.cost(16) / 16)


# ---- looks: a cheap drafter is asked even where the class mix says drafting does not pay -------------
class CopyDraft(Proposer):
    """A cheap labelling drafter whose every draft is a chain of ``cls``; counts how often it is asked."""

    name = "x"
    confidence_classes = True
    free_drafts = True

    def __init__(self, cls: str) -> None:
        self.cls = cls
        self.asked = 0

    def propose(self, committed, budget):
        self.asked += 1
        return labelled_chain([self.cls] * min(budget, 8))


def stale_mix() -> Scheduler:
    """A copy drafter "x" whose first classes were mostly hopeless ("lo") and a few sure ("hi"): the mix
    says that drafting does not pay."""
    sched = Scheduler(CPU, max_length=8)
    rng = np.random.default_rng(0)
    for cls, rate, rounds in (("lo", 0.05, 300), ("hi", 1.0, 30)):
        for _ in range(rounds):
            tree = labelled_chain([cls])
            sched.trim("x", tree)
            accepted = int(rng.random() < rate)
            sched.update("x", 1, accepted)
            sched.update_classes("x", tree, accepted)
    sched.begin_request()
    sched.looks._kept_last.clear()   # past the request's first round (looked at in every request: tested apart)
    sched.note_draft("x", 8e-6, 8)                    # a copy costs microseconds
    assert sched.best_length("x", sched.draft_cost("x"), 8) == 0
    return sched


def test_looks_that_cost_more_come_less_often() -> None:
    sched = stale_mix()
    sched.looks._seconds["x"] = 0.1 * CPU.cost(1)     # each look (proposal and trim) costs 0.1 step
    sched._probe_every["x"] = 1000                    # looks alone
    dear = CopyDraft("lo")
    for _ in range(40):
        sched.draft(dear, [0], 8)
    assert dear.asked == 2                            # LOOK_SHARE of the time: one look in 20 rounds


def test_a_cheap_drafter_is_looked_at_where_the_class_mix_says_no() -> None:
    # the mix is learned from the drafts made: mostly hopeless first classes ("lo"), a few sure ones
    # ("hi"). Asked only when the mix pays, a copy drafter would stay idle through a run of sure copies
    # (a repeated request); looked at every LOOK_EVERY idle rounds, its sure drafts are kept by trim and
    # it is asked every round while they are
    from ouroboros_local.scheduler import EARLY_PROBE_ROUNDS
    from ouroboros_local.looks import LOOK_EVERY

    sched = stale_mix()

    def rounds(draft: CopyDraft, right: bool) -> list[int]:
        kept = []
        for _ in range(12):
            tree = sched.draft(draft, [0], 8)
            if tree.n_candidates:   # verified: all of it accepted, or none
                sched.learn("x", tree, tree.n_candidates if right else 0)
            kept.append(tree.n_candidates)
        return kept

    doubtful = CopyDraft("lo")                        # its drafts are trimmed away: looked at now and then
    assert sum(rounds(doubtful, right=False)) <= 2 * sched.probe_length
    assert doubtful.asked <= 12 // LOOK_EVERY + 1
    sched.begin_request()
    sched.looks._kept_last.clear()                          # past the first round (looked at: tested below)
    sched._request_first_round -= EARLY_PROBE_ROUNDS  # and the early looks (tested apart)
    sure = CopyDraft("hi")
    kept = rounds(sure, right=True)
    assert kept[:LOOK_EVERY - 1] == [0] * (LOOK_EVERY - 1) and all(k > 0 for k in kept[LOOK_EVERY - 1:])
    assert sure.asked == 12 - (LOOK_EVERY - 1)
    expensive = Scheduler(CPU, max_length=8)          # a draft model is never looked at
    expensive.confidence = sched.confidence
    expensive.note_draft("x", 0.02 * 8, 8)
    assert not expensive._worth_a_look("x")


def test_after_a_look_cut_to_nothing_the_rounds_until_the_next_are_quiet(monkeypatch) -> None:
    # a look whose draft trim cut to nothing is followed by idle rounds, answered at once as after a
    # skipped look; the round after such a look used to check "does drafting pay" again (~40 µs with
    # the caches cold after a decode, in about a third of auto's busy rounds on SmolLM2's gsm8k)
    from ouroboros_local.looks import LOOK_EVERY

    sched = stale_mix()
    sched._probe_every["x"] = 1000                    # looks alone
    checks = []
    best_length = sched.best_length
    monkeypatch.setattr(sched, "best_length", lambda *a, **k: checks.append(1) or best_length(*a, **k))
    doubtful = CopyDraft("lo")                        # every look is proposed, then cut to nothing
    rounds = 10 * LOOK_EVERY
    for _ in range(rounds):
        assert sched.draft(doubtful, [0], 8).n_candidates == 0
    assert doubtful.asked >= 2                        # looked at, and cut to nothing
    assert len(checks) <= doubtful.asked + 1          # a check per look, not one more after each


class PeekedCopy(CopyDraft):
    """A CopyDraft that tells its first node's class (``Proposer.first_class``) without proposing."""

    def __init__(self, cls: str, peek: str | None = None) -> None:
        super().__init__(cls)
        self.peek = cls if peek is None else peek
        self.peeked = 0

    def first_class(self, committed):
        self.peeked += 1
        return self.peek


def test_looks_at_a_class_trim_keeps_cutting_back_off_and_still_count_in_the_mix() -> None:
    from ouroboros_local.looks import LOOK_BACKOFF_MAX, LOOK_EVERY

    sched = stale_mix()
    sched._probe_every["x"] = 1000                    # looks alone
    sched.looks._dry["x"] = -1                        # in a request whose looks kept nodes (no dry backoff)
    table = sched.confidence["x"]
    before = table.first["lo"]
    doubtful = PeekedCopy("lo")
    for _ in range(50 * LOOK_EVERY):
        sched.draft(doubtful, [0], 8)
    assert doubtful.peeked >= 45                      # a look every LOOK_EVERY idle rounds, as before
    # proposed at the 1st, 2nd, 4th, 8th, 16th, 32nd, 48th look (every LOOK_BACKOFF_MAX-th at most)
    assert 5 <= doubtful.asked <= 2 + doubtful.peeked // LOOK_BACKOFF_MAX + 4
    # the skipped looks' class still counts in the mix (else the mix would promise more than drafting does)
    assert table.first["lo"] > 0.8 * before + 30
    sched.begin_request()                             # a new text: looked at sooner again (half the wait)
    sched.looks._kept_last.clear()
    sched.looks._dry["x"] = -1
    asked, peeked = doubtful.asked, doubtful.peeked
    for _ in range(LOOK_BACKOFF_MAX * LOOK_EVERY):  # 16 looks: once at most before, twice now
        sched.draft(doubtful, [0], 8)
    assert doubtful.peeked - peeked >= LOOK_BACKOFF_MAX - 1 and doubtful.asked - asked >= 2

    sure = PeekedCopy("hi")                           # a class trim keeps is looked at, then drafted
    kept = [sched.draft(sure, [0], 8).n_candidates for _ in range(3 * LOOK_EVERY)]
    assert sum(k > 0 for k in kept) >= 2 * LOOK_EVERY and sure.asked == sum(k > 0 for k in kept)

    nothing = PeekedCopy("hi", peek="")               # nothing to copy: looked at, never proposed
    fresh = stale_mix()
    fresh._probe_every["x"] = 1000
    for _ in range(10 * LOOK_EVERY):
        fresh.draft(nothing, [0], 8)
    assert nothing.peeked >= 4 and nothing.asked == 0


def test_looks_back_off_in_a_request_where_none_kept_anything() -> None:
    # on SmolLM2 the looks (the peek, the "does drafting pay" check, the trim, the scoring) cost auto
    # ~75 µs a round on text with nothing to copy; on an H200 its extra Python was the whole gap to
    # plain decoding
    from ouroboros_local.looks import DRY_LOOKS_EVERY_MAX, LOOK_EVERY

    sched = stale_mix()
    sched._probe_every["x"] = 1000                    # looks alone
    nothing = PeekedCopy("hi", peek="")               # nothing to copy: every look is dry
    rounds = 40 * LOOK_EVERY
    for _ in range(rounds):
        sched.draft(nothing, [0], 8)
    # every 4, 4, 8, 8, then 16 rounds: 12 looks in 160 rounds, not 40
    assert 0 < nothing.peeked <= rounds // DRY_LOOKS_EVERY_MAX + 4 and nothing.asked == 0

    sched.begin_request()                             # a new text: every LOOK_EVERY rounds again
    sched.looks._kept_last.clear()
    peeked = nothing.peeked
    for _ in range(2 * LOOK_EVERY):
        sched.draft(nothing, [0], 8)
    assert nothing.peeked - peeked == 2

    # a request whose looks kept nodes is looked at every LOOK_EVERY rounds, dry looks or not
    sched.begin_request()
    copies = PeekedCopy("hi")
    assert sched.draft(copies, [0], 8).n_candidates > 0
    copies.peek = ""                                  # then nothing to copy
    peeked = copies.peeked
    for _ in range(rounds):
        sched.draft(copies, [0], 8)
    assert copies.peeked - peeked >= rounds // LOOK_EVERY - 1


def test_a_request_starts_with_a_look() -> None:
    # a repeated request is copyable from its first token: waiting LOOK_EVERY idle rounds for the first
    # look cost 3 of the 5-9 target passes such a request takes on SmolLM2
    sched = stale_mix()
    sure, doubtful = CopyDraft("hi"), CopyDraft("lo")
    for draft in (sure, doubtful):
        sched.enroll(draft)
        sched.begin_request()
        first = sched.draft(draft, [0], 8).n_candidates
        assert draft.asked == 1
        assert (first > 0) == (draft is sure)         # kept where it pays, trimmed away where not
    assert sched.draft(doubtful, [0], 8).n_candidates == 0 and doubtful.asked == 1   # then idle again


def test_a_copy_drafter_stays_looked_at_when_short_proposals_make_its_tokens_look_dear() -> None:
    # a copy's proposal costs about the same however few tokens it finds: a run of one-token proposals
    # drives its per-token figure past the bar of a cheap drafter, while what a token cost at least
    # shows what it is (a trie lookup, not a model). Judged on the running figure, it was never looked
    # at again and a repeated request went undrafted
    from ouroboros_local.scheduler import LOOK_COST
    from ouroboros_local.looks import LOOK_EVERY

    sched = stale_mix()
    for _ in range(60):
        sched.note_draft("x", 0.5 * LOOK_COST * CPU.cost(1), 1)   # one token found, for half the bar
    assert sched.draft_cost("x") * sched.max_length > LOOK_COST * CPU.cost(1)
    sure = CopyDraft("hi")
    kept = [sched.draft(sure, [0], 8).n_candidates for _ in range(LOOK_EVERY)]
    assert kept[-1] > 0 and sure.asked == 1


def test_a_drafter_that_runs_no_model_is_looked_at_however_dear_its_proposals_were_timed() -> None:
    # with the caches cold after a decode, a trie lookup that found one or two tokens timed at 0.1-0.3 ms:
    # even its least per-token figure stayed above the bar, and the suffix tries were looked at 0-1 times
    # a request (a repeated set of code edits: 1.06x where runs that looked reached 1.4-1.6x); how often
    # is what looks cost (``Looks.every``), not whether
    from ouroboros_local.looks import LOOK_EVERY, LOOK_SHARE

    for free in (True, False):
        sched = stale_mix()
        sure = CopyDraft("hi")
        sure.free_drafts = free
        sched.enroll(sure)
        sched._draft_costs["x"] = sched._least_costs["x"] = 0.2 * CPU.cost(1)   # dear per token
        sched.looks._seconds["x"] = 0.2 * LOOK_SHARE * LOOK_EVERY * CPU.cost(1)   # looks within the share
        kept = [sched.draft(sure, [0], 8).n_candidates for _ in range(LOOK_EVERY)]
        assert (kept[-1] > 0 and sure.asked == 1) if free else sure.asked == 0, free


def test_a_look_is_priced_without_its_catch_up_on_the_rounds_it_skipped(monkeypatch) -> None:
    # the suffix tries index the text of the rounds since they were last asked when asked: the longer
    # between looks, the dearer each look looked, and the rarer the next
    import types

    import ouroboros_local.scheduler as scheduler_module
    from ouroboros_local.looks import LOOK_EVERY

    clock = [0.0]
    monkeypatch.setattr(scheduler_module, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))

    class Lazy(CopyDraft):
        def propose(self, committed, budget):
            self.catch_up_seconds = 0.009         # indexing the skipped rounds
            clock[0] += 0.01                      # the whole proposal
            return super().propose(committed, budget)

    sched = stale_mix()
    sched._probe_every["x"] = 1000                # looks alone
    lazy = Lazy("lo")
    sched.enroll(lazy)
    for _ in range(LOOK_EVERY):
        sched.draft(lazy, [0], 8)
    assert lazy.asked == 1 and sched.looks._seconds["x"] == pytest.approx(0.001)


def test_a_copy_drafter_is_looked_at_before_it_has_drafted() -> None:
    # a drafter that runs no model is known cheap before it is timed: looked at after LOOK_EVERY idle
    # rounds, not held to probes, which the method's other candidate may have spent (a fresh process:
    # the suffix tries never proposed in the README's request while prompt lookup's probes used the
    # budget)
    from ouroboros_local.looks import LOOK_EVERY

    class Priced(CopyDraft):
        free_drafts = False

    for drafter, first_ask in ((CopyDraft("hi"), LOOK_EVERY), (Priced("hi"), 8)):
        sched = Scheduler(CPU, max_length=8)
        sched.enroll(drafter)
        sched._probe_spent[""] = 1e9 if drafter.free_drafts else 0.0
        for _ in range(first_ask):
            sched.draft(drafter, [0], 8)
        assert drafter.asked == 1, drafter                # the copy on a look, the other on a probe


def test_a_pending_probe_does_not_bar_looks_and_the_look_is_verified_as_the_probe() -> None:
    # a probe whose proposal found nothing (or whose draft auto passed over for another candidate's)
    # stays pending until a draft of that drafter is verified; barring looks meanwhile, it left the
    # suffix tries unasked for the rest of the README's request
    from ouroboros_local.looks import LOOK_EVERY

    sched = stale_mix()
    sched._probing.add("x")
    doubtful = CopyDraft("lo")                        # a draft trim would cut to nothing
    trees = [sched.draft(doubtful, [0], 8) for _ in range(LOOK_EVERY)]
    assert doubtful.asked == 1 and trees[-1].n_candidates == sched.probe_length
    sched.learn("x", trees[-1], 0)
    assert "x" not in sched._probing and sched._probe_spent[""] > 0


def test_a_drafter_that_is_looked_at_is_probed_by_early_looks_that_verify_nothing() -> None:
    # in a request's first rounds, where a drafter that is not looked at is probed, one that is looked at
    # gets looks past its classes' backoff instead: the text scores what they drafted, at no verification
    # cost. A probe verified two tokens the estimates said would not pay: on SmolLM2 (a 3-token round
    # costs ~2.4 steps) early probes cost ~11 steps a set of 16 gsm8k or mt_bench answers. Later in the
    # request only the usual looks come (a probe there made gsm8k drafting look worth it: 0.970x).
    from ouroboros_local.scheduler import EARLY_PROBE_ROUNDS

    def rounds(sched: Scheduler, drafter: CopyDraft, n: int) -> list[TokenTree]:
        trees = []
        for _ in range(n):
            trees.append(sched.draft(drafter, [0], 8))
            sched.observe_round(trees[-1].batch_size, CPU.cost(trees[-1].batch_size))
            if trees[-1].n_candidates:
                sched.learn("x", trees[-1], 0)
        return trees

    sched = stale_mix()
    sched._probe_spent[""] = -1e9                     # the probe budget would allow every probe
    drafter = CopyDraft("lo")
    early = rounds(sched, drafter, EARLY_PROBE_ROUNDS)
    asked_early = drafter.asked
    assert all(tree.n_candidates == 0 for tree in early) and "x" not in sched._probing
    assert 0 < sched._probe_spent[""] + 1e9 < 0.01 * CPU.cost(1)   # no verification: only the looks charged
    late = rounds(sched, drafter, EARLY_PROBE_ROUNDS)
    assert all(tree.n_candidates == 0 for tree in late)
    assert asked_early > drafter.asked - asked_early >= 1   # the early looks come on top of the usual ones
    late = rounds(sched, drafter, 200)
    assert drafter.asked >= 200 // 16                 # still looked at (at most 16 idle rounds apart)
    assert all(tree.n_candidates == 0 for tree in late) and "x" not in sched._probing
    sched.begin_request()                             # a new request: early looks again
    asked = drafter.asked
    rounds(sched, drafter, EARLY_PROBE_ROUNDS)
    assert drafter.asked - asked == asked_early
    model = scheduler_with(CHEAP, 0.01)               # a draft model is not looked at: probed throughout
    model._rounds = 10 * EARLY_PROBE_ROUNDS
    assert any(model.best_length("x") for _ in range(PROBE_EVERY))


def test_an_early_looks_draft_is_learned_as_a_probe_once_the_text_matches_its_first_nodes() -> None:
    # a held draft is otherwise learned once the text decides it (a token that differs, or its end): a
    # right 8-token copy would teach nothing for 8 rounds, where a verified probe taught at once
    sched = stale_mix()
    sched._idle["x"] = 10 ** 6                        # an early look is due (``best_length``)
    held = sched.draft_if_any(CopyDraft("lo"), [0], 8)
    assert held is None or held.n_candidates == 0     # cut by trim, held for the text to score
    table = sched.confidence["x"]
    trials, successes = table.trials["lo"], table.successes["lo"]
    text = [0, 101]                                   # one token written, equal to the draft's first
    sched._score_held("x", text)
    assert table.trials["lo"] == trials               # undecided, and short of a probe's length
    text.append(102)
    sched._score_held("x", text)
    assert table.trials["lo"] == pytest.approx(trials * 0.995 + sched.probe_length)
    assert table.successes["lo"] == pytest.approx(successes * 0.995 + sched.probe_length)
    assert sched._request["x"][0] == sched.probe_length   # the request's record counts it too
    text += [103, 999]                                # the 4th token differs: the rest is learned
    sched._score_held("x", text)
    assert "x" not in sched._held
    assert table.trials["lo"] == pytest.approx((trials * 0.995 + 2) * 0.995 + 2)   # nodes 3 and 4 tried
    assert table.successes["lo"] == pytest.approx((successes * 0.995 + 2) * 0.995 + 1)
    assert sched._request["x"][0] == 3


def labelled_branches(*branches: list[str]) -> TokenTree:
    """A root with one labelled chain per branch (tokens 100 * branch + depth)."""
    tree = TokenTree.rooted_at(0)
    for b, classes in enumerate(branches, 1):
        node = 0
        for depth, cls in enumerate(classes, 1):
            node = tree.add(node, 100 * b + depth)
            tree.classes[node] = cls
    return tree


def test_a_tree_whose_first_class_was_barely_tried_is_verified_as_a_probe() -> None:
    # two verifications, one accepted, put a class at ~0.3: without this rule every later tree that
    # starts with it is cut to nothing and the estimate never moves again (a branching tree's cut nodes
    # are not scored by the text that follows, as a chain's are)
    from ouroboros_local.scheduler import MEASURE_TRIALS

    sched = stale_mix()
    table = sched.confidence["x"]
    table.trials["new"], table.successes["new"] = 2.0, 1.0
    sched._probe_spent[""] = 0.0                             # (the mix's first drafts were such probes)
    tree = sched.trim("x", labelled_branches(["new"] * 4, ["new"] * 4))
    assert tree.n_candidates == sched.probe_length and "x" in sched._probing
    sched.learn("x", tree, 0)                                # verified: charged and ended like a probe
    assert "x" not in sched._probing and sched._probe_spent[""] > 0
    assert sched.trim("x", labelled_branches(["lo"] * 4, ["lo"] * 4)).n_candidates == 0   # measured, hopeless
    sched._probe_spent[""] = 1e9                             # the probe budget is spent
    assert sched.trim("x", labelled_branches(["new"] * 4, ["new"] * 4)).n_candidates == 0
    sched._probe_spent[""] = 0.0
    table.trials["new"] = MEASURE_TRIALS                     # measured enough: the estimate decides
    table.successes["new"] = 1.0
    assert sched.trim("x", labelled_branches(["new"] * 4, ["new"] * 4)).n_candidates == 0
    # a chain is not probed for this: the text scores what trim cuts (below)
    table.trials["new"] = 2.0
    assert sched.trim("x", labelled_chain(["new"] * 8)).n_candidates == 0 and "x" not in sched._probing


def test_the_text_that_follows_scores_a_draft_trim_cut() -> None:
    # "lo" copies are cut to nothing, so verification never corrects their estimate; the text the
    # target writes next says how far each would have been accepted
    sched = stale_mix()
    sched._probe_every["x"] = 1000                    # looks alone
    table = sched.confidence["x"]
    drafter = CopyDraft("lo")
    while not drafter.asked:                          # idle rounds until a look
        assert sched.draft(drafter, [0], 8).n_candidates == 0
    trials, successes = table.trials["lo"], table.successes["lo"]
    sched.draft(drafter, [0, 101, 102, 103], 8)       # so far, the text follows the draft: nothing learned
    assert table.trials["lo"] == trials
    sched.draft(drafter, [0, 101, 102, 103, 7], 8)    # then differs: 3 accepted, the 4th rejected
    d = table.decay
    assert table.trials["lo"] == pytest.approx(trials * d + 4)
    assert table.successes["lo"] == pytest.approx(successes * d + 3)


def test_only_what_verification_did_not_try_is_scored_by_the_text() -> None:
    sched = Scheduler(CPU, max_length=8)
    table = sched.confidence.setdefault("x", ConfidenceTable(decay=1.0))
    chain = labelled_chain(["a"] * 6)                 # tokens 101..106

    sched._held.hold("x", chain, start=1)             # cut to 2 nodes, both verified and accepted
    sched.learn("x", chain.truncated(2), 2)
    assert (table.trials["a"], table.successes["a"]) == (2, 2)
    sched._score_held("x", [0, 101, 102, 103, 104, 9])   # the tail: 2 accepted, the 3rd rejected
    assert (table.trials["a"], table.successes["a"]) == (5, 4)

    sched._held.hold("x", chain, start=1)             # verified in full: nothing left to score
    sched.learn("x", chain, 1)
    assert (table.trials["a"], table.successes["a"]) == (7, 5)
    assert "x" not in sched._held

    sched._held.hold("x", chain, start=1)             # cut to 2 nodes, the 2nd rejected: the tail was
    sched.learn("x", chain.truncated(2), 1)           # never reachable, nothing to score
    sched._score_held("x", [0, 101, 5])
    assert (table.trials["a"], table.successes["a"]) == (9, 6)

    sched._held.hold("x", chain, start=1)             # passed over (auto verified another draft): all of it
    sched._score_held("x", [0, 101, 102, 7])
    assert (table.trials["a"], table.successes["a"]) == (12, 8)


def test_held_drafts_are_bounded_and_dropped_with_the_request() -> None:
    from ouroboros_local.held import MAX_HELD

    sched = Scheduler(CPU, max_length=8)
    for start in range(3 * MAX_HELD):
        sched._held.hold("x", labelled_chain(["a"] * 8), start=start)
    assert len(sched._held.waiting("x")) == MAX_HELD
    sched.begin_request()
    assert "x" not in sched._held
    sampled = labelled_chain(["a"] * 2)
    sampled.draft_probs[1] = np.ones(4) / 4           # a sampled draft's acceptance is a draw: not scored
    sched._held.hold("x", sampled, start=0)
    sched._held.hold("x", labelled_branches(["a"], ["b"]), start=0)   # nor a branching tree's
    assert "x" not in sched._held


def test_round_costs_are_redrawn_once_a_size_is_measured_or_drifts() -> None:
    from ouroboros_local.scheduler import RoundCosts

    sched = Scheduler(CPU)
    for _ in range(RoundCosts.MIN_ROUNDS):
        sched.observe_round(1, 2 * CPU.cost(1))
    assert sched.round_seconds(4)[0] == pytest.approx(2 * CPU.cost(1))
    table = sched.round_costs.shared_table(4)
    for _ in range(50):                                 # an idle run at a steady speed: never redrawn
        sched.observe_round(1, 2 * CPU.cost(1) * (1 + RoundCosts.DRIFT / 2))
        assert sched.round_costs.shared_table(4) is table
    sched.observe_round(1, 4 * CPU.cost(1))            # the machine slowed down: shown at once
    slower = sched.round_seconds(4)[0]
    assert slower > 2.1 * CPU.cost(1)
    for _ in range(RoundCosts.MIN_ROUNDS):             # a drafted size shows at once once measured
        sched.observe_round(5, 3 * CPU.cost(5))
        for _ in range(SWITCH_STEPS):
            sched.observe_round(1, 4 * CPU.cost(1))
    assert sched.round_seconds(4)[4] == pytest.approx(3 * CPU.cost(5) + sched.round_costs.switch)
    table = sched.round_costs.shared_table(4)
    for _ in range(20):                                # drafted rounds at a steady cost: not redrawn
        sched.observe_round(5, 3 * CPU.cost(5) * (1 + RoundCosts.DRIFT / 2))
        for _ in range(SWITCH_STEPS):
            sched.observe_round(1, 4 * CPU.cost(1))      # (the same wake: the same switch)
        assert sched.round_costs.shared_table(4) is table
    sched.observe_round(5, 6 * CPU.cost(5))            # a dearer drafted round moves the EMA 10%
    assert sched.round_costs.shared_table(4) is not table
    assert not sched.round_seconds(4).flags.writeable
    drafted, table = sched.round_seconds(4)[1:].copy(), sched.round_costs.shared_table(4)
    for _ in range(5):                                 # the plain steps slow down: only their price moves
        sched.observe_round(1, 8 * CPU.cost(1))
    plain_factor = sched.round_costs.plain_factor()
    assert sched.round_seconds(4)[0] == pytest.approx(plain_factor * CPU.cost(1))
    assert sched._round_seconds_list(4)[0] == pytest.approx(plain_factor * CPU.cost(1))
    assert sched.round_seconds(4)[1:] == pytest.approx(drafted)
    assert sched.round_costs.factor(1) == pytest.approx(plain_factor)
    assert sched.round_costs.shared_table(4) is table  # priced apart, not drawn again (~150 µs, caches cold)
    assert not sched.round_seconds(4).flags.writeable


def test_a_size_measured_dear_in_a_slow_spell_is_drafted_again_within_a_few_requests() -> None:
    # a copy right 97% of the time pays on this CPU curve; a few drafted rounds timed while another
    # process ran cost 4x what the curve says, and nothing drafted would measure them again
    sched = trained(CPU, {"sure": 0.97})
    chain = ["sure"] * 4
    assert sched.trim("x", labelled_chain(chain)).n_candidates == 4
    for _ in range(6):
        sched.observe_round(5, 4 * CPU.cost(5))
        for _ in range(SWITCH_STEPS + 3):
            sched.observe_round(1, CPU.cost(1))
    assert sched.trim("x", labelled_chain(chain)).n_candidates == 0
    requests = 0
    while sched.trim("x", labelled_chain(chain)).n_candidates == 0 and requests < 10:
        sched.begin_request()                           # requests of plain steps only
        for _ in range(30):
            sched.observe_round(1, CPU.cost(1))
        requests += 1
    assert 1 <= requests <= 6
    # a size that really is dear keeps its factor: measured again in every request, it is not forgotten
    dear = trained(CPU, {"sure": 0.97})
    for _ in range(5):
        for _ in range(6):
            dear.observe_round(5, 4 * CPU.cost(5))
            dear.observe_round(1, CPU.cost(1))
        dear.begin_request()
    assert dear.round_costs.factor(5) == pytest.approx(4.0, rel=0.01)
    # ... also where another method's requests come between (a benchmark, a server's mixed requests)
    mixed = trained(CPU, {"sure": 0.97})
    for _ in range(5):
        mixed.use_method("auto")
        mixed.begin_request()
        for _ in range(6):
            mixed.observe_round(5, 4 * CPU.cost(5))
            mixed.observe_round(1, CPU.cost(1))
        mixed.use_method("prompt-lookup")
        mixed.begin_request()
        for _ in range(6):
            mixed.observe_round(1, CPU.cost(1))
    mixed.use_method("auto")
    mixed.begin_request()
    assert mixed.round_costs.factor(5) == pytest.approx(4.0, rel=0.01)


def test_plain_steps_timed_in_a_slow_spell_stop_making_drafting_look_cheap_within_a_few_requests() -> None:
    """On SmolLM2's gsm8k, plain steps timed in a slow spell (11.5 ms against 8.6) priced the drafted
    rounds of the fast spell that followed a quarter cheaper than a plain step: every round of eleven
    requests was drafted, at 0.6-0.9x each, and with no plain step left to time nothing corrected it."""
    def requests_timing_both(sched: Scheduler, plain: float = 1.0) -> None:
        for _ in range(4):
            sched.begin_request()
            for _ in range(6):
                sched.observe_round(2, CPU.cost(2))
                for _ in range(SWITCH_STEPS + 3):
                    sched.observe_round(1, plain * CPU.cost(1))
        sched.begin_request()

    def requests_drafting_only(sched: Scheduler, n: int) -> None:
        for _ in range(n):
            for _ in range(30):
                sched.observe_round(2, CPU.cost(2))
            sched.begin_request()

    sched = trained(CPU, {"so-so": 0.6})   # a 1-token draft right 60% of the time: a loss on this curve
    requests_timing_both(sched)
    assert sched.trim("x", labelled_chain(["so-so"])).n_candidates == 0
    for _ in range(30):                    # a slow spell of plain steps
        sched.observe_round(1, 1.32 * CPU.cost(1))
    sched.begin_request()
    assert sched.trim("x", labelled_chain(["so-so"])).n_candidates == 1
    requests = 0
    while sched.trim("x", labelled_chain(["so-so"])).n_candidates and requests < 10:
        requests_drafting_only(sched, 1)   # back at the curve's speed
        requests += 1
    assert 1 <= requests <= 3
    # plain steps that really are that dear keep their factor: timed in every request, not forgiven ...
    dear = trained(CPU, {"so-so": 0.6})
    requests_timing_both(dear, plain=1.32)
    assert dear.round_costs.plain_factor() == pytest.approx(1.32, rel=0.01)
    # ... nor in requests drafted throughout, where they always were that much dearer than drafted
    # rounds (a round's fixed cost is a larger share of a short plain step's: a GPU)
    requests_drafting_only(dear, 5)
    assert dear.round_costs.plain_factor() == pytest.approx(1.32, rel=0.01)


class SometimesSure(CopyDraft):
    """A copy drafter that finds nothing 20% of the time, else a chain whose class is sure 30% of the time;
    ``drafted``: where its last chain starts in the text, and its tokens."""

    def __init__(self, name: str = "x", seed: int = 2) -> None:
        super().__init__("lo")
        self.name = name
        self.rng = np.random.default_rng(seed)
        self.drafted: tuple[int, list[int]] = (0, [])

    def propose(self, committed, budget):
        self.asked += 1
        if self.rng.random() < 0.2:
            return labelled_chain([])                # nothing to copy: a probe stays pending
        tree = labelled_chain(["hi" if self.rng.random() < 0.3 else "lo"] * min(budget, 8))
        self.drafted = (len(committed), tree.tokens[1:])
        return tree


def counting(sched: Scheduler, method: str) -> list[int]:
    """Count the calls of ``sched``'s ``method`` from now on (in the one-element list returned)."""
    calls = [0]
    slow = getattr(sched, method)

    def counted(*args, **kwargs):
        calls[0] += 1
        return slow(*args, **kwargs)

    setattr(sched, method, counted)
    return calls


def round_seen(sched: Scheduler, tree: TokenTree, asked: list[int], sources: str) -> tuple[int, ...]:
    """A test round ends: its cost observed; what it drafted, how often each drafter was asked, and each
    source's idle and unlooked rounds (the rounds ``skips`` answered counted first: they are in bulk)."""
    sched.observe_round(tree.n_candidates + 1, CPU.cost(tree.n_candidates + 1))
    sched._count_skipped()
    return (tree.n_candidates, *asked, *(sched._idle.get(s, 0) for s in sources),
            *(sched.looks._unlooked.get(s, 0) for s in sources))


def same_rounds_fewer_calls(plain: tuple[list, int], shortcut: tuple[list, int]) -> None:
    """Runs without and with a shortcut (each: the rounds ``round_seen`` saw, and the calls it saves)
    saw the same rounds, some of which drafted, with under 70% of the calls."""
    assert shortcut[0] == plain[0]
    assert sum(1 for n, *_ in plain[0] if n) >= 3          # probes or looks did draft
    assert shortcut[1] < 0.7 * plain[1]


def test_auto_rounds_skipped_while_every_candidate_is_quiet_change_nothing(monkeypatch) -> None:
    # ``auto`` asks none of its candidates in rounds foreseen quiet for all of them (``Scheduler.skips``);
    # counted in bulk, those rounds must leave every decision and counter as asking would have
    from ouroboros_local.proposers.pick import AutoProposer
    from ouroboros_local.proposers.base import ProposeSetup
    from ouroboros_local.sampling import SamplingParams

    def run(skipping: bool) -> tuple[list[tuple], int]:
        if not skipping:
            monkeypatch.setattr(Scheduler, "foresee_quiet", lambda self, sources: None)
        sched = stale_mix()
        for cls, rounds in (("lo", 300), ("hi", 30)):   # "y" learns the same mix as "x"
            for _ in range(rounds):
                tree = labelled_chain([cls])
                sched.trim("y", tree)
                sched.update_classes("y", tree, int(cls == "hi"))
        sched.note_draft("y", 8e-6, 8)
        asked = counting(sched, "draft_if_any")
        drafters = [SometimesSure("x", 2), SometimesSure("y", 3)]
        auto = AutoProposer(sched, drafters)
        setup = ProposeSetup(sampling=SamplingParams(), rng=np.random.default_rng(0), max_tree_nodes=15,
                             max_branches=1)
        rng = np.random.default_rng(1)
        seen = []
        for i in range(600):
            if i % 150 == 0:
                if i:
                    auto.end()
                committed = [0]
                auto.begin(committed, setup)
            budget = 3 if i % 150 > 140 else 8
            tree = auto.propose(committed, budget)
            if tree.n_candidates:
                sched.learn(auto._last.name, tree, int(rng.random() < 0.3))
            # the text scores the held drafts: half the time it copies the last one made while it can
            start, tokens = max((d.drafted for d in drafters), key=lambda d: d[0])
            at = len(committed) - start
            committed.append(tokens[at] if i % 40 < 20 and at < len(tokens) else 7)
            seen.append(round_seen(sched, tree, [d.asked for d in drafters], "xy"))
        monkeypatch.undo()
        return seen, asked[0]

    same_rounds_fewer_calls(run(skipping=False), run(skipping=True))   # most quiet rounds asked no one


@pytest.mark.parametrize("looked_at", [True, False])
def test_rounds_foreseen_idle_change_nothing_the_scheduler_decides(monkeypatch, looked_at) -> None:
    # ``_plan_quiet`` answers the idle rounds before the next probe, look or refresh at once; the same
    # rounds (requests, short budgets, probes, looks, drafts learned) must draft exactly as before
    def run(quiet: bool) -> tuple[list[tuple[int, ...]], int]:
        if not quiet:
            monkeypatch.setattr(Scheduler, "_plan_quiet", lambda self, source, budget: None)
        sched = stale_mix()
        if not looked_at:
            sched._draft_costs["x"] = sched._least_costs["x"] = 0.2 * CPU.cost(1)   # too dear to look at
        decided = counting(sched, "best_length")
        draft = SometimesSure()
        rng = np.random.default_rng(1)
        seen = []
        for i in range(600):
            if i % 150 == 149:
                sched.begin_request()
            budget = 3 if i % 150 > 140 else 8         # an answer's last tokens
            tree = sched.draft(draft, [0], budget)
            if tree.n_candidates:
                sched.learn("x", tree, int(rng.random() < 0.3))
            seen.append(round_seen(sched, tree, [draft.asked], "x"))
        monkeypatch.undo()
        return seen, decided[0]

    # looks every LOOK_EVERY rounds: 2 of 4 foreseen
    same_rounds_fewer_calls(run(quiet=False), run(quiet=True))
