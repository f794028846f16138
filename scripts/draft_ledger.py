#!/usr/bin/env python3
"""Each verified draft of a real run, netted against the plain steps around it: a ledger of drafting.

    python3 scripts/draft_ledger.py -m MODEL [-d DRAFT] --prompts A.jsonl,B.jsonl [--limit 16] [-n 128]
                                    [--method auto] [--estimates FILE] [--out ledger.json]

A benchmark's speed-up moves by 1-2% between runs on a small CPU, while each of the scheduler's choices
that decide it (a probe here, a draft there) is worth a fraction of a step. This runs a method on a
benchmark's prompts (the first turn of each, in the chat template; greedy) and logs every round: a plain
step's seconds, or a verified draft's proposer, first class, length, the tokens the scheduler expected of
it (its classes' estimates), whether it was a probe (in its request's first EARLY_PROBE_ROUNDS rounds or
later), the request's correction of those estimates (``Scheduler.request_scale``), the round of its
request it came in, and the tokens accepted. A drafted round's net, in steps, is 1 + accepted - its
decode over the median of the plain steps up to NEIGHBOURS rounds before and after it: not over the run's
median step, since on a VM that runs in spells the drafted rounds fell in slower moments and looked
dearer than they were. Summed per set, by the gain the scheduler predicted and for probes: what drafting
won or lost, which a benchmark's totals hide in their noise.

``--estimates FILE`` starts from a copy of that estimates file (the file itself is not written), so that
two versions of the code can be compared from the same learned state. Drafts made while a plain step
decodes (``--overlap``, a GPU's default) are not logged: the engine runs with overlap off.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Sequence

from ouroboros_local.errors import OuroborosError

NEIGHBOURS = 3   # plain steps on each side of a drafted round that price it
GAIN_BUCKETS = ((0.0, 1.0), (1.0, 1.05), (1.05, 1.2), (1.2, 1.5), (1.5, float("inf")))
UNLABELLED = "unlabelled"   # a drafted round whose tree no trim of a labelled chain returned


def net_steps(rounds: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The drafted rounds of ``rounds`` (each {"seconds", "draft": None or its record with "accepted"}),
    each with "steps" (its decode in neighbouring plain steps) and "net" (1 + accepted - steps)."""
    plain = [r["seconds"] if r["draft"] is None else None for r in rounds]
    every_plain = [s for s in plain if s is not None]
    out = []
    for i, r in enumerate(rounds):
        if r["draft"] is None:
            continue
        near = [s for s in plain[max(0, i - NEIGHBOURS):i] + plain[i + 1:i + 1 + NEIGHBOURS] if s is not None]
        step = statistics.median(near or every_plain or [r["seconds"]])
        steps = r["seconds"] / step
        out.append({**r["draft"], "steps": steps, "net": 1 + r["draft"]["accepted"] - steps})
    return out


def summary_rows(drafts: Sequence[dict[str, Any]]) -> list[tuple[str, int, int, float, float]]:
    """(kind, rounds, tokens accepted, tokens expected, net steps): drafts by predicted gain over plain
    decoding, drafts not priced by class (no labelled chain: a tree, a sampled draft), probes early and
    late, and all of them."""
    groups: list[tuple[str, list[dict[str, Any]]]] = []
    priced = [d for d in drafts if d["source"] != UNLABELLED and not d["probe"]]
    for lo, hi in GAIN_BUCKETS:
        label = f"drafts, predicted {lo:.2f}-{hi:.2f}x" if hi != float("inf") else f"drafts, predicted {lo:.2f}x+"
        groups.append((label, [d for d in priced if lo <= d["gain"] < hi]))
    groups.append(("drafts not priced by class", [d for d in drafts if d["source"] == UNLABELLED]))
    for phase in ("early", "late"):
        groups.append((f"probes, {phase}", [d for d in drafts if d["probe"] == phase]))
    groups.append(("all drafted rounds", list(drafts)))
    return [(label, len(g), sum(d["accepted"] for d in g), sum(d["expected"] for d in g),
             sum(d["net"] for d in g)) for label, g in groups if g or label == "all drafted rounds"]


class _Ledger:
    """Logs the rounds of an engine's generations (hooks ``Scheduler.trim`` and ``Engine._round``)."""

    def __init__(self) -> None:
        self.rounds: list[dict[str, Any]] = []
        self._trimmed: dict[int, tuple[Any, dict[str, Any]]] = {}   # id(tree) -> (tree, its record)

    def install(self) -> Callable[[], None]:
        """Hook the scheduler and the engine; returns what unhooks them."""
        from ouroboros_local import engine as engine_mod
        from ouroboros_local import scheduler as sched_mod

        ledger, trim, run_round = self, sched_mod.Scheduler.trim, engine_mod.Engine._round

        def logged_trim(sched: Any, source: str, tree: Any) -> Any:
            kept = trim(sched, source, tree)
            if kept.n_candidates and kept.classes and kept.is_chain():
                ledger._trimmed[id(kept)] = (kept, ledger._record(sched, source, kept))
            return kept

        def logged_round(engine: Any, *args: Any, **kwargs: Any) -> Any:
            ledger._trimmed.clear()
            step = run_round(engine, *args, **kwargs)
            draft = None
            if step.tree.batch_size > 1:   # the trees held are alive, so an id is not reused
                found = ledger._trimmed.get(id(step.tree))
                draft = dict(found[1]) if found is not None else {
                    "source": UNLABELLED, "first": None, "n": step.tree.n_candidates, "expected": 0.0,
                    "gain": 0.0, "probe": None}
                draft["accepted"] = len(step.result.accepted)
            ledger.rounds.append({"seconds": step.seconds, "draft": draft})
            return step

        sched_mod.Scheduler.trim = logged_trim
        engine_mod.Engine._round = logged_round

        def uninstall() -> None:
            sched_mod.Scheduler.trim = trim
            engine_mod.Engine._round = run_round
        return uninstall

    @staticmethod
    def _record(sched: Any, source: str, tree: Any) -> dict[str, Any]:
        from ouroboros_local.scheduler import EARLY_PROBE_ROUNDS

        n = tree.n_candidates
        expected = sched._chain_expected(source, tree.node_classes(), explore=False)[-1]
        seconds = sched._round_seconds_list(n)
        round_in_request = sched._rounds - sched._request_first_round
        probe = None
        if source in sched._probing:
            probe = "early" if round_in_request < EARLY_PROBE_ROUNDS else "late"
        return {"source": source, "first": tree.classes.get(1), "n": n, "expected": expected - 1.0,
                "gain": expected / seconds[n] * seconds[0], "probe": probe,
                "scale": sched.request_scale(source), "round": round_in_request}


def run(engine: Any, sets: dict[str, list[str]], method: str, max_tokens: int) -> dict[str, Any]:
    """Generate every prompt of each set with ``method`` (chat, greedy); per set, the rounds logged and
    the drafted ones with their net."""
    ledger = _Ledger()
    uninstall = ledger.install()
    out = {}
    try:
        for name, texts in sets.items():
            ledger.rounds.clear()
            for text in texts:
                engine.generate(text, max_tokens=max_tokens, method=method, chat=True)
            out[name] = {"rounds": len(ledger.rounds), "drafts": net_steps(ledger.rounds)}
    finally:
        uninstall()
    return out


def print_report(ledger: dict[str, Any]) -> None:
    print("| set | kind | rounds | accepted | expected | net steps |")
    print("|---|---|---:|---:|---:|---:|")
    for name, entry in ledger.items():
        for kind, n, accepted, expected, net in summary_rows(entry["drafts"]):
            share = f" ({100 * net / entry['rounds']:+.2f}% of {entry['rounds']})" if kind.startswith("all") else ""
            print(f"| {name} | {kind} | {n} | {accepted} | {expected:.1f} | {net:+.1f}{share} |")


def copy_estimates(path: str, folder: Path) -> Path:
    """A copy of the estimates file ``path`` in ``folder``. One that is missing or not a JSON object is an
    OuroborosError: the engine would start from nothing learned, and the ledger compare nothing alike."""
    copy = folder / "estimates.json"
    try:
        shutil.copyfile(path, copy)
        estimates = json.loads(copy.read_text(encoding="utf-8"))
    except OSError as exc:
        raise OuroborosError(f"--estimates {path}: {exc.strerror or exc}") from None
    except ValueError as exc:   # empty, truncated, not JSON or not UTF-8
        raise OuroborosError(f"--estimates {path}: not an estimates file ({exc})") from None
    if not isinstance(estimates, dict):
        raise OuroborosError(f"--estimates {path}: not an estimates file (not a JSON object)")
    return copy


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("-d", "--draft", help="draft model")
    ap.add_argument("--prompts", required=True, help="prompt files (JSONL), comma-separated")
    ap.add_argument("--limit", type=int, default=16, help="prompts per set (default: %(default)s)")
    ap.add_argument("-n", "--max-tokens", type=int, default=128)
    ap.add_argument("--method", default="auto")
    ap.add_argument("--estimates", help="start from a copy of this estimates file")
    ap.add_argument("--out", help="write the ledger (every drafted round) to this JSON file")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        if args.estimates:   # read at load; the engine's saves go to the copy
            os.environ["OUROBOROS_ESTIMATES_FILE"] = str(copy_estimates(args.estimates, Path(tmp)))
        from ouroboros_local.bench import prompts as prompts_mod
        from ouroboros_local.engine import Engine

        sets = {s.name: [item.turns[0] for item in s.items]
                for s in prompts_mod.load_sets(args.prompts, limit=args.limit)}
        engine = Engine.load(args.model, args.draft, overlap=False)
        try:
            ledger = run(engine, sets, args.method, args.max_tokens)
        finally:
            engine.close()
    print_report(ledger)
    if args.out:
        Path(args.out).write_text(json.dumps(ledger))
    return 0


if __name__ == "__main__":
    from _script_errors import run_main   # scripts/ is on sys.path when a script runs

    sys.exit(run_main(main))
