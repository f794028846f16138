#!/usr/bin/env python3
"""Speed-ups over vanilla, per set and method, mean (lowest-highest) over several `bench` runs of two
settings side by side (`scripts/gpu_check.sh ab` names them NAME-a1, NAME-b1, NAME-b2, NAME-a2, ...).

    scripts/ab_summary.py OUT_DIR RUN [RUN...]     # each RUN a folder holding bench's results.json

A run's speed-up on a set is the one bench wrote in its summary: vanilla's seconds per token over the
method's, both summed over the set's prompts in that run (the ratio measured side by side in one
process)."""

from __future__ import annotations

import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

from ouroboros_local.bench.report import read_results
from ouroboros_local.errors import OuroborosError


def setting(run: str) -> str:
    """The setting a run belongs to: NAME-a1 -> NAME-a, and so NAME-a1/ as a shell completes it."""
    return re.sub(r"\d+$", "", run.rstrip("/"))


def speedups(summary: dict) -> dict[tuple[str, str], float]:
    """(set, method) -> the run's speed-up over vanilla, as bench's summary has it (the "all" row left
    out)."""
    return {(name, label): row["speedup"] for name, rows in summary.items() if name != "all"
            for label, row in rows.items() if label != "vanilla" and row.get("speedup") is not None}


def load_run(root: Path, run: str) -> dict:
    """``root/run/results.json``, whose summary is set -> method -> row; a run without one is an
    OuroborosError naming the file."""
    path = root / run / "results.json"
    data = read_results(path)
    summary = data.get("summary")
    if not isinstance(summary, dict) or not all(
            isinstance(rows, dict) and all(isinstance(row, dict) for row in rows.values())
            for rows in summary.values()):
        raise OuroborosError(f"{path}: not a bench results.json (no summary of sets and methods)")
    return data


def refuse_runs_of_other_prompts(root: Path, payloads: dict[str, dict]) -> None:
    """A setting's runs measure one thing (model, prompts, budgets), and both settings the same prompts and
    budgets (their models may differ): a run of other prompts was averaged in as one more run."""
    from ouroboros_local.bench.report import refuse_different_runs, refuse_repeated_files

    refuse_repeated_files([root / run for run in payloads])
    by_setting: dict[str, list[tuple[str, dict]]] = defaultdict(list)
    for run, payload in payloads.items():
        by_setting[setting(run)].append((run, payload))
    for runs in by_setting.values():
        refuse_different_runs(runs)
    refuse_different_runs([runs[0] for runs in by_setting.values()], same_model=False)


def main(argv: list[str]) -> int:
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    root, runs = Path(argv[0]), argv[1:]
    payloads = {run: load_run(root, run) for run in runs}
    refuse_runs_of_other_prompts(root, payloads)
    summaries = {run: payload["summary"] for run, payload in payloads.items()}
    per_arm: dict[str, dict[tuple[str, str], list[float]]] = defaultdict(lambda: defaultdict(list))
    sets: list[str] = []
    for run, summary in summaries.items():
        for (name, label), value in speedups(summary).items():
            per_arm[setting(run)][name, label].append(value)
            if name not in sets:
                sets.append(name)
    print("| method | setting | " + " | ".join(sets) + " |")
    print("|---|---|" + "---:|" * len(sets))
    labels = sorted({label for arm in per_arm.values() for _, label in arm})
    for label in labels:
        for arm, values in per_arm.items():
            cells = []
            for name in sets:
                v = values.get((name, label))
                cells.append(f"{statistics.mean(v):.2f}x ({min(v):.2f}-{max(v):.2f})" if v else "–")
            print(f"| {label} | {arm} | " + " | ".join(cells) + " |")
    print_time_split(summaries)
    print_round_switch(payloads)
    return 0


def print_round_switch(payloads: dict[str, dict]) -> None:
    """In rounds of one size (a GPU's default): how often each method's requests ran plain steps instead,
    and the cost of a round of K in plain steps as the round switch timed it (– where no request had timed
    one) against the calibrated figure (medians over the requests; ``stats.extra["round_switch"]``)."""
    rows: dict[tuple[str, str], dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for run, payload in payloads.items():
        for record in payload["records"]:   # each names its set and label (read_results)
            switch = (record.get("extra") or {}).get("round_switch")
            if isinstance(switch, dict):   # keyed by label: a --variant apart from its method
                rows[record["set"], record["label"]][setting(run)].append(
                    {**switch, "passes": record.get("target_passes") or 0})
    if not rows:
        return
    print("\nround switch (per request, medians): plain steps' share of the passes, changes of size, a round"
          " of K in plain steps timed / calibrated:\n")
    print("| set | method | setting | plain share | changes | timed | calibrated |")
    print("|---|---|---|---:|---:|---:|---:|")
    for (name, label), by_arm in rows.items():
        for arm, switches in by_arm.items():
            passes = sum(sw["passes"] for sw in switches)
            share = sum(sw.get("plain_rounds", 0) for sw in switches) / passes if passes else 0.0

            def median(key: str) -> str:
                values = [sw[key] for sw in switches if isinstance(sw.get(key), (int, float))]
                return f"{statistics.median(values):.2f}" if values else "–"
            print(f"| {name} | {label} | {arm} | {share:.0%} | {median('changes')} | {median('timed_ratio')} "
                  f"| {median('calibrated_ratio')} |")


def print_time_split(summaries: dict[str, dict]) -> None:
    """Where the decode time goes (bench's table), milliseconds per 100 tokens per set, averaged over
    each setting's runs: which part makes a setting slower, and on which text."""
    from ouroboros_local.time_split import PARTS

    # (set, method) -> setting -> the runs' splits
    splits: dict[tuple[str, str], dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for run, summary in summaries.items():
        for name, rows in summary.items():
            if name == "all" and len(summary) > 1:
                continue
            for label, row in rows.items():
                if row.get("time_split"):
                    splits[name, label][setting(run)].append(row["time_split"])
    if not splits:
        return
    print("\nms per 100 tokens (mean over runs):\n")
    print("| set | method | setting | " + " | ".join(PARTS) + " | total |")
    print("|---|---|---|" + "---:|" * (len(PARTS) + 1))
    for (name, label), by_arm in splits.items():
        for arm, runs_split in by_arm.items():
            ms = [statistics.mean(split[part]["ms"] for split in runs_split) for part in PARTS]
            print(f"| {name} | {label} | {arm} | " + " | ".join(f"{v:.1f}" for v in ms) + f" | {sum(ms):.1f} |")


if __name__ == "__main__":
    from _script_errors import run_main   # scripts/ is on sys.path when a script runs

    sys.exit(run_main(main, sys.argv[1:]))
