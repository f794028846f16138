#!/usr/bin/env python3
"""Speed-ups over several `ouroboros-local bench` runs of the same sets, pooled over all their prompts.

    python3 scripts/pool_runs.py RUN1/results.json RUN2/results.json [...] [--reference vanilla]

On a shared 2-core machine one prompt's timing moves by +-20% (a method that drafts nothing, which runs
plain decoding, measured 0.71-1.21x of vanilla on single prompts), so one run's ratio for a 16-prompt set
moves by +-5%. Pooling runs of the same code gives each set more prompts. Per set and method: the ratio
in each run (sum of tokens over sum of decode seconds, against the reference's; "–" for a run without
both timed) and pooled over all the runs' prompts (each run's reference timing pairs with that run's method
timing). A file given twice, and runs that measured different things (another model, a prompt with
another text or budget), are refused.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict

from ouroboros_local.bench.report import read_results, refuse_different_runs, refuse_repeated_files
from ouroboros_local.errors import OuroborosError


def timed(rec: dict) -> bool:
    """A record with a decode time to pool (failed generations have none)."""
    return not rec.get("error") and bool(rec.get("decode_seconds"))


def run_ratio(got: list[float], ref: list[float]) -> str:
    """One run's ratio in the brackets; "–" where the method or the reference has no timing in that run,
    so that the brackets keep one place per run."""
    if got[1] > 0 and ref[1] > 0:
        return f"{(got[0] / got[1]) / (ref[0] / ref[1]):.2f}"
    return "–"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", help="results.json files of bench runs")
    ap.add_argument("--reference", default="vanilla", help="the label the ratios are taken against")
    args = ap.parse_args()
    # (set, label) -> per run [tokens, seconds]
    sums: dict[tuple[str, str], list[list[float]]] = defaultdict(lambda: [[0.0, 0.0] for _ in args.runs])
    sets: list[str] = []
    labels: list[str] = []
    used: list[int] = []   # the runs with a timed record
    refuse_repeated_files(args.runs)
    payloads = [read_results(path) for path in args.runs]
    refuse_different_runs(list(zip(args.runs, payloads)))
    for i, payload in enumerate(payloads):
        records = [rec for rec in payload["records"] if timed(rec)]
        if records:
            used.append(i)
        for rec in records:
            cell = sums[(rec["set"], rec["label"])][i]
            cell[0] += rec.get("timed_tokens") or rec["tokens"]
            cell[1] += rec["decode_seconds"]
            if rec["set"] not in sets:
                sets.append(rec["set"])
            if rec["label"] not in labels:
                labels.append(rec["label"])
    if not used:
        raise OuroborosError("no run has a timed record (every generation failed, or none was made)")
    if args.reference not in labels:
        raise OuroborosError(f"--reference {args.reference}: no run has it; the runs have "
                             + ", ".join(labels))
    dropped = [f"run {i + 1} ({path})" for i, path in enumerate(args.runs) if i not in used]
    others = [label for label in labels if label != args.reference]
    runs = " / ".join(f"run {i + 1}" for i in used)
    print("| set | " + " | ".join(others) + " |")
    print("|---|" + "---:|" * len(others))
    worst: dict[str, float] = {}
    for name in sets:
        ref = sums.get((name, args.reference))
        if ref is None:
            continue
        cells = []
        for label in others:
            got = sums.get((name, label))
            if got is None:
                cells.append("–")
                continue
            both = [(g, r) for g, r in zip(got, ref) if g[1] > 0 and r[1] > 0]
            if not both:   # the method and the reference were timed in different runs only
                cells.append("–")
                continue
            pooled = (sum(g[0] for g, _ in both) / sum(g[1] for g, _ in both)) / \
                     (sum(r[0] for _, r in both) / sum(r[1] for _, r in both))
            worst[label] = min(worst.get(label, pooled), pooled)
            cells.append(f"{pooled:.2f}x ({' / '.join(run_ratio(got[i], ref[i]) for i in used)})")
        print(f"| {name} | " + " | ".join(cells) + " |")
    pooled_over = f"{len(used)} run{'s' if len(used) > 1 else ''}"
    print(f"\npooled over {pooled_over} (in brackets: {runs}); lowest pooled set per method: " +
          ", ".join(f"{label} {value:.2f}x" for label, value in worst.items()))
    if dropped:
        print("left out, no timed record: " + ", ".join(dropped))
    return 0


if __name__ == "__main__":
    from _script_errors import run_main   # scripts/ is on sys.path when a script runs

    sys.exit(run_main(main))
