#!/usr/bin/env python3
"""Replay method ``auto`` (or another draft-free method) on recorded greedy answers, with this machine's
cost curve as the clock.

A benchmark run of ``auto`` moves by several percent between runs of the same code (on code edits,
0.99x-1.14x; answered a second time, 1.24x-2.69x), because what rounds are measured to cost steers
what the scheduler learns. A replay runs the real proposers and scheduler on answers recorded once,
so a scheduler change is judged in seconds, over many seeded runs, before the benchmark confirms it.

Each answer is generated again as the engine would: ``auto``'s proposers draft from the prompt, the
answer so far and the history of earlier answers (the sets replay in ``--order``, as one benchmark run
would; with ``--method``, ``prompt-lookup``, ``suffix`` or ``ouroboros`` without a draft model, priced
round by round by the scheduler as the engine prices them); a stand-in target accepts a draft token
where it equals the recorded answer; a round of n tokens costs c(n) of the curve times a seeded
log-normal factor of mean 1 (``--noise``: a real round's cost moves by about that much), and the scheduler learns
from those costs as from measured ones. The speed-up is the answers' cost in plain steps (tokens x
c(1)) over the replayed rounds' cost; drafting and the runtime's own work per round are not counted
(tenths of a millisecond against a 7-28 ms CPU step) unless ``--charge-python`` asks for the drafting
step's time, scaled by ``--python-scale`` (a real run's Python runs with cold caches: 5-10x).

What it ranks well: changes that move acceptance. What it does not: changes that trade the runtime's
Python for copies found at the 1-2% level. Twice (docs/benchmarks.md, twenty-second session) it
predicted gains that alternating benchmark runs did not show: rarer looks, and ``auto`` without the
per-request suffix trie. Confirm such changes with the benchmark.

Usage (the answers from copy_bound.py's ``--outputs``, replayed at the budget -n it recorded there):
    python3 scripts/copy_bound.py -m qwen2.5-coder-1.5b-instruct --limit 16 -n 128 \\
        --prompts ../shared/bench/gsm8k.jsonl,../shared/bench/codeedit.jsonl --outputs answers.json
    python3 scripts/replay_auto.py -m qwen2.5-coder-1.5b-instruct --answers answers.json \\
        --order gsm8k,codeedit,codeedit --seeds 10
    # a later process on half the edits, after one that answered the other half (learned.py)
    python3 scripts/replay_auto.py -m qwen2.5-coder-1.5b-instruct --answers answers.json \\
        --learned-from codeedit:1 --order codeedit:2
    # a refactor that should change no decision: the same table before and after (a stand-in clock)
    python3 scripts/replay_auto.py -m smollm2-135m-instruct --answers answers.json --seeds 3 --clock-step 1e-5
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from collections import Counter
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from ouroboros_local.calibration import CostModel
from ouroboros_local.errors import OuroborosError
from ouroboros_local.text_input import read_json
from ouroboros_local.history import History
from ouroboros_local.learned import PRIOR_WEIGHT, RESTORE_WEIGHT, copy_priors
from ouroboros_local.proposers import DraftingContext, create_method
from ouroboros_local.scheduler import Scheduler
from ouroboros_local.testing.sim import make_setup
from ouroboros_local.tree import BatchLayout
from ouroboros_local.verify import verify_round

DEFAULT_MAX_TOKENS = 128   # copy_bound.py's default -n


def answer_decoder(answer: Sequence[int], committed: list[int], prompt_len: int, vocab: int):
    """A stand-in for the target's decode: each row predicts the recorded answer's next token where the
    path before it follows the answer, else token ``vocab - 1`` (a token no draft holds)."""

    def decode(lay: BatchLayout) -> np.ndarray:
        done = len(committed) - prompt_len   # answer tokens committed; the root is the last of them
        rows = np.zeros((sum(lay.logits), vocab), dtype=np.float32)
        order = sorted(range(len(lay.tokens)), key=lambda j: lay.pos_offsets[j])
        row = 0
        for i, wanted in enumerate(lay.logits):
            if not wanted:
                continue
            seq, pos = lay.seq_ids[i][0], lay.pos_offsets[i]
            path = [lay.tokens[j] for j in order if seq in lay.seq_ids[j] and 0 < lay.pos_offsets[j] <= pos]
            at = done + len(path)
            follows = at < len(answer) and list(answer[done:at]) == path
            rows[row, answer[at] if follows else vocab - 1] = 1.0
            row += 1
        return rows

    return decode


def round_noise(rng: np.random.Generator, sigma: float) -> float:
    """A round's cost factor: log-normal with mean 1. exp(N(0, sigma)) has mean exp(sigma^2 / 2), which
    made every round 1.1% dearer than c(n) at sigma 0.15 and read each replayed speed-up that much low."""
    return float(np.exp(rng.normal(-0.5 * sigma * sigma, sigma)))


def slow_cache(sched: Scheduler, scale: float) -> None:
    """Make ``sched`` see every proposal (and look) take ``scale`` times what it took here: a replay's
    Python runs with warm caches, a real run's after a decode that evicted them (0.1-0.3 ms a lookup on
    SmolLM2 against ~30 µs warm), and which drafters are looked at, and how often, follows those times."""
    note_draft, note_look = sched.note_draft, sched.looks.note_seconds
    def slow_draft(source: str, seconds: float, n_tokens: int, catch_up: float = 0.0, **kw: Any) -> None:
        note_draft(source, seconds * scale, n_tokens, catch_up=catch_up * scale, **kw)

    sched.note_draft = slow_draft   # type: ignore[method-assign]
    sched.looks.note_seconds = lambda source, seconds: note_look(source, seconds * scale)  # type: ignore[method-assign]


@contextmanager
def stand_in_clock(step: float) -> Iterator[None]:
    """``time.perf_counter`` advancing ``step`` seconds a call (``--clock-step``), the real one restored
    after: what the scheduler measures of its drafting is then the same in every run."""
    real, ticks = time.perf_counter, itertools.count()
    time.perf_counter = lambda: next(ticks) * step
    try:
        yield
    finally:
        time.perf_counter = real


def pick(answers: list[dict[str, Any]], name: str, limit: int) -> list[dict[str, Any]]:
    """The first ``limit`` answers of set ``name``; ``SET:1`` and ``SET:2``: every other one of them (two
    halves with nothing in common, e.g. to learn on one and measure on the other)."""
    base, _, half = name.partition(":")
    chosen = [a for a in answers if a["set"] == base][:limit]
    return chosen[int(half) - 1::2] if half in ("1", "2") else chosen


class ShapeClock:
    """A GPU's clock (--gpu-clock): a plain step after two plain steps runs as a CUDA graph and costs
    ``step``; any other decode (a new shape, or the one after it, which captures the graph again) costs
    what ``after_switch`` says (a curve timed size after size, as measure_costs did before 5c4cdb1)."""

    def __init__(self, after_switch: CostModel, step: float):
        self.after_switch, self.step = after_switch, step
        self.last, self.same = 0, 0

    def __call__(self, n: int) -> float:
        self.same = self.same + 1 if n == self.last else 0
        self.last = n
        return self.step if n == 1 and self.same >= 2 else self.after_switch.cost(n)

    def priced(self, old: bool) -> CostModel:
        """The curve the scheduler prices with: the one measured before 5c4cdb1 (``old``), or today's
        (plain steps timed back to back, and what the two steps after another shape lose)."""
        if old:
            return self.after_switch
        seconds = [self.step] + self.after_switch.seconds[1:]
        return CostModel(sizes=self.after_switch.sizes, seconds=seconds,
                         switch_seconds=2 * (self.after_switch.seconds[0] - self.step))


def replay(answers: list[dict[str, Any]], order: list[str], curve: CostModel, noise: float, seed: int,
           limit: int, max_tokens: int, max_draft: int, method: str = "auto",
           learned: dict[str, Any] | None = None, python_scale: float = 1.0, charge_python: bool = False,
           gpu: dict[str, Any] | None = None, priors: float = PRIOR_WEIGHT, fresh_each: bool = False
           ) -> dict[str, tuple[float, Counter]]:
    """One seeded replay of the sets in ``order``; per pass: (speed-up, round counts). ``learned``: the
    session starts from ``learned["estimates"]`` where present, restored as the engine restores an
    earlier session's (learned.py), and leaves its own there at the end. ``python_scale``: the proposals'
    timings, as the scheduler sees them, times this (see --python-scale); ``charge_python``: the clock
    counts each drafting step's time at that scale too (plain decoding has none). ``gpu``: {"sizes", "seconds",
    "step", "old"} for a ShapeClock (see --gpu-clock), which then replaces ``curve``. ``priors``: start
    from the copy priors at this weight, as an engine does (learned.py; 0: the generic priors);
    ``fresh_each``: each answer from a fresh scheduler and history (a process per request, as an editor
    calling ``generate`` on a fresh cache)."""
    ids = sorted({t for a in answers for t in a["prompt"] + a["answer"]})
    dense = {t: i for i, t in enumerate(ids)}   # a small vocabulary keeps the stand-in's rows small
    vocab = len(ids) + 1
    clock: Any = curve.cost
    if gpu is not None:
        clock = ShapeClock(CostModel(sizes=gpu["sizes"], seconds=gpu["seconds"]), gpu["step"])
        curve = clock.priced(gpu.get("old", False))
    step = clock.step if gpu is not None else curve.cost(1)

    shipped = copy_priors() if priors else {}   # read once: a fresh session per answer restores copies

    def session() -> tuple[Scheduler, DraftingContext]:
        sched = Scheduler(curve, max_length=max_draft)
        if python_scale != 1.0:
            slow_cache(sched, python_scale)
        if shipped:
            sched.restore_estimates(shipped, priors)
        if learned is not None and learned.get("estimates"):
            sched.restore_estimates(json.loads(json.dumps(learned["estimates"])), RESTORE_WEIGHT)
        # no draft model: the free proposers need only the history and the scheduler
        ctx = DraftingContext(target=None, target_context=None, draft=None,  # type: ignore[arg-type]
                              pair_compatible=None, pair_reason=None, draft_kv=None,  # type: ignore[arg-type]
                              history=History(), scheduler=lambda: sched)
        return sched, ctx

    sched, ctx = session()
    rng = np.random.default_rng(seed)
    out: dict[str, tuple[float, Counter]] = {}
    for name in order:
        plain = replayed = 0.0
        counts: Counter = Counter()
        for record in pick(answers, name, limit):
            if fresh_each:
                sched, ctx = session()
            prompt = [dense[t] for t in record["prompt"]]
            answer = [dense[t] for t in record["answer"]]
            chosen = create_method(method, ctx, {})
            proposer = chosen.proposer
            sched.use_method(method)
            if chosen.scheduled:   # the engine prices such a method's drafts (auto prices its own)
                sched.begin_request()
                sched.enroll(proposer)
            setup = replace(make_setup(max_tree_nodes=511, max_branches=16), extend_pays=sched.extend_rule())
            committed = list(prompt)
            decode = answer_decoder(answer, committed, len(prompt), vocab)
            proposer.begin(committed, setup)
            while True:
                done = len(committed) - len(prompt)
                budget = max(0, max_tokens - done - 1)
                t0 = time.perf_counter()
                tree = sched.draft(proposer, committed, budget) if chosen.scheduled else \
                    proposer.propose(committed, budget)
                if charge_python:   # the drafting step's own time, as the scheduler sees it
                    replayed += python_scale * (time.perf_counter() - t0)
                result, _ = verify_round(tree, decode, setup.sampling, setup.rng)
                n = tree.batch_size
                seconds = clock(n) * round_noise(rng, noise)
                replayed += seconds
                counts.update(rounds=1, drafted=tree.n_candidates, accepted=len(result.accepted))
                committed.extend(result.tokens)
                if chosen.scheduled:
                    sched.learn(proposer.name, tree, len(result.accepted), result.path)
                written = committed[len(prompt):len(prompt) + len(answer)]
                if written != answer[:len(written)]:
                    raise RuntimeError(f"{name} {record['id']}: the replay left the recorded answer")
                if len(written) == len(answer):   # the answer's end (an end-of-generation token, or -n)
                    break
                proposer.observe(committed, result)
                sched.observe_round(n, seconds)
            proposer.end()
            plain += len(answer) * step
        label = f"{name} (pass {order[:len(out) + 1].count(name)})" if order.count(name) > 1 else name
        out[label] = (plain / replayed if replayed else 1.0, counts)
    if learned is not None:
        learned["estimates"] = sched.estimates()
    return out


def load_answers(paths: str) -> list[dict[str, Any]]:
    """The answers of the comma-separated ``paths`` (copy_bound.py's ``--outputs``); a file that is not
    one is an OuroborosError naming it."""
    answers = []
    for path in paths.split(","):
        got = read_json(path, "answers file")
        if not isinstance(got, list) or not got or not all(
                isinstance(a, dict) and {"set", "id", "prompt", "answer"} <= a.keys() for a in got):
            raise OuroborosError(f"{path}: not an answers file written by copy_bound.py --outputs (a non-empty "
                                 "list of answers with a set, an id, a prompt and an answer)")
        answers += got
    return answers


def answers_budget(answers: list[dict[str, Any]], asked: int | None) -> int:
    """The token budget to replay at: the one copy_bound.py recorded in the answers (files written before
    it recorded one: ``asked``, else DEFAULT_MAX_TOKENS). An answer ends at its end-of-generation token
    or at its budget, so another budget would replay rounds the real run could not have had."""
    recorded = sorted({a["max_tokens"] for a in answers if a.get("max_tokens") is not None})
    if len(recorded) > 1:
        raise OuroborosError("the answers were generated with different budgets (-n "
                             + ", ".join(map(str, recorded)) + "): replay the files of one budget at a time")
    if recorded and asked is not None and asked != recorded[0]:
        raise OuroborosError(f"-n {asked}: the answers were generated with -n {recorded[0]} (copy_bound.py); "
                             "replay them at that budget (leave -n out)")
    return recorded[0] if recorded else asked if asked is not None else DEFAULT_MAX_TOKENS


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", required=True, help="the target whose cached cost curve is the clock")
    ap.add_argument("--answers", required=True,
                    help="greedy answers written by copy_bound.py --outputs (several files: comma-separated)")
    ap.add_argument("--order", help="sets in replay order, comma-separated (a set may repeat: a second pass; "
                                    "SET:1 and SET:2 are alternate answers of SET)")
    ap.add_argument("--method", default="auto", help="a draft-free method (default: auto)")
    ap.add_argument("--limit", type=int, default=16, help="answers per set")
    ap.add_argument("-n", "--max-tokens", type=int,
                    help="the token budget the answers had (default: the one copy_bound.py recorded in them; "
                         f"in files written before it did, {DEFAULT_MAX_TOKENS})")
    ap.add_argument("--seeds", type=int, default=10, help="replays, each with its own round-cost noise")
    ap.add_argument("--noise", type=float, default=0.15, help="log-normal sigma of a round's cost (mean 1)")
    ap.add_argument("--python-scale", type=float, default=1.0, metavar="K",
                    help="the scheduler sees each proposal take K times what it took in the replay (its "
                         "Python runs warm; in a real run the caches are cold after each decode: try 5)")
    ap.add_argument("--charge-python", action="store_true",
                    help="count each round's drafting step (proposals, scheduling), times --python-scale, on the "
                         "clock: what looks and bookkeeping cost on text with nothing to copy")
    ap.add_argument("--learned-from", metavar="SETS",
                    help="first replay these sets (comma-separated) in a session of their own, then start "
                         "from the estimates it learned, as a later process does (learned.py); the two "
                         "sessions share no history")
    ap.add_argument("--clock-step", type=float, metavar="SECONDS",
                    help="every time.perf_counter() call advances a stand-in clock by SECONDS, so that what the "
                         "scheduler measures of its drafting no longer moves between runs: two versions of the "
                         "code that decide alike print the same table (a check that a refactor changed no "
                         "decision; try 1e-5 for cheap drafting and 3e-4 for dear)")
    ap.add_argument("--gpu-clock", metavar="JSON",
                    help='a GPU\'s clock instead of this machine\'s curve: {"sizes": [...], "seconds": [...] '
                         '(decodes timed size after size), "step": plain step back to back, "old": true to '
                         'price with the curve as measured before 5c4cdb1}')
    ap.add_argument("--prior-weight", type=float, default=PRIOR_WEIGHT, metavar="W",
                    help="observations' worth a class of the copy priors starts with (learned.py; default "
                         "%(default)s, an engine's; 0: the generic priors)")
    ap.add_argument("--fresh-each", action="store_true",
                    help="replay each answer from a fresh scheduler and history: a process per request")
    args = ap.parse_args()

    from ouroboros_local.engine import Engine

    answers = load_answers(args.answers)
    max_tokens = answers_budget(answers, args.max_tokens)
    order = args.order.split(",") if args.order else list(dict.fromkeys(a["set"] for a in answers))
    earlier = args.learned_from.split(",") if args.learned_from else []
    missing = sorted({n.partition(":")[0] for n in order + earlier} - {a["set"] for a in answers})
    if missing:
        raise OuroborosError(f"no answers for {', '.join(missing)} in {args.answers}")
    engine = Engine.load(args.model)
    curve, max_draft = engine.cost_model(), engine.config.max_draft
    engine.close()
    gpu = json.loads(Path(args.gpu_clock).read_text()) if args.gpu_clock else None
    runs = []
    with stand_in_clock(args.clock_step) if args.clock_step else nullcontext():
        for seed in range(args.seeds):
            session = partial(replay, answers, curve=curve, noise=args.noise, seed=seed, limit=args.limit,
                              max_tokens=max_tokens, max_draft=max_draft, method=args.method,
                              learned={} if earlier else None, python_scale=args.python_scale,
                              charge_python=args.charge_python,
                              gpu=gpu, priors=args.prior_weight, fresh_each=args.fresh_each)
            if earlier:
                session(earlier)
            runs.append(session(order))
    print("c(n)/c(1): " + ", ".join(f"c({n})={curve.ratio(n):.2f}" for n in (2, 4, 8, 16)))
    print(f"| pass | speed-up, mean of {args.seeds} | lowest | highest | tokens per pass (seed 0) |")
    print("|---|---:|---:|---:|---:|")
    for label in runs[0]:
        ups = [run[label][0] for run in runs]
        counts = runs[0][label][1]
        per_pass = (counts["rounds"] + counts["accepted"]) / max(counts["rounds"], 1)
        print(f"| {label} | {np.mean(ups):.3f}x | {min(ups):.3f}x | {max(ups):.3f}x | {per_pass:.2f} |")
    return 0


if __name__ == "__main__":
    from _script_errors import run_main   # scripts/ is on sys.path when a script runs

    sys.exit(run_main(main))
