#!/usr/bin/env python3
"""Did a change alter what any method writes? Compare two `ouroboros-local bench --save-text` runs made
with the same command before and after the change (docs/benchmarks.md, "behaviour check").

    python3 scripts/compare_runs.py BEFORE/results.json AFTER/results.json

Per method: how many outputs are byte-identical between the runs; for the others, their verdict
against vanilla in each run (identical / tie-flip / mismatch). Methods the cost model schedules decide
from measured timings, so two runs of the same code may verify different trees and part at different
near-ties; a change that preserves behaviour shows only identical outputs for the fixed methods and
only identical/tie-flip verdicts elsewhere. Outputs that failed (an error record, no text) in either
run are listed and not compared; outputs only one run has are named.

Exit status: 0 when no output is a mismatch; 1 when an output is a mismatch (against vanilla) in either
run, byte-identical between them or not; 2 when a file cannot be read, is not a --save-text results file,
the runs share no (set, id, method), or they measured different things (another target model, or a
prompt with another text or budget: a change of the command, not of the code).
"""

from __future__ import annotations

import sys
from collections import Counter, defaultdict
from typing import Any

from ouroboros_local.bench.report import read_results, refuse_different_runs
from ouroboros_local.errors import ParameterError

Key = tuple[str, str, str]   # (set, prompt id, label)
MISMATCH = "mismatch"


class RunError(Exception):
    """A results file that cannot be compared (one line, exit status 2)."""


def records(path: str, data: dict[str, Any]) -> dict[Key, dict[str, Any]]:
    """A --save-text run's records by (set, id, label), which read_results checked each names; failed
    generations keep no text and are kept."""
    out = {(r["set"], r["id"], r["label"]): r for r in data["records"]}
    if any(r.get("text") is None and r.get("match") != "error" for r in out.values()):
        raise RunError(f"{path}: run the benchmark with --save-text")
    return out


def describe(keys: list[Key]) -> str:
    if not keys:
        return "no output"
    shown = ", ".join(f"{s}/{i} {label}" for s, i, label in keys[:5])
    return shown + (f" and {len(keys) - 5} more" if len(keys) > 5 else "")


def compare(before: dict[Key, dict[str, Any]], after: dict[Key, dict[str, Any]]) -> tuple[list[str], bool]:
    """The report's lines and whether an output is a mismatch in either run."""
    same: Counter[str] = Counter()
    verdicts: defaultdict[str, Counter[tuple[str, str]]] = defaultdict(Counter)
    failed: defaultdict[str, list[Key]] = defaultdict(list)
    mismatched: Counter[str] = Counter()
    for key in sorted(before.keys() & after.keys()):
        label, a, b = key[2], before[key], after[key]
        if MISMATCH in (a.get("match"), b.get("match")):
            mismatched[label] += 1
        if "error" in (a.get("match"), b.get("match")):
            failed[label].append(key)
        elif a["text"] == b["text"]:
            same[label] += 1
        else:
            verdicts[label][(a.get("match") or "?", b.get("match") or "?")] += 1
    lines = []
    for label in sorted(same.keys() | verdicts.keys() | failed.keys()):
        differ = sum(verdicts[label].values())
        line = f"{label}: {same[label]}/{same[label] + differ} identical"
        if differ:
            line += "; the others (before -> after): " + ", ".join(
                f"{n} {a} -> {b}" for (a, b), n in verdicts[label].most_common())
        if mismatched[label]:
            line += f"; a MISMATCH against vanilla in either run: {mismatched[label]}"
        if failed[label]:
            line += f"; not compared (failed in either run): {describe(failed[label])}"
        lines.append(line)
    return lines, bool(mismatched)


def main(argv: list[str]) -> int:
    if argv[:1] in (["-h"], ["--help"]):
        print(__doc__.strip())
        return 0
    if len(argv) != 2:
        print("usage: " + __doc__.strip().splitlines()[3].strip(), file=sys.stderr)
        return 2
    try:
        runs = [(path, read_results(path)) for path in argv]
        before, after = (records(path, data) for path, data in runs)
        refuse_different_runs(runs)
    except (RunError, ParameterError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not before.keys() & after.keys():
        print(f"error: the runs share no output (set, id, method): {argv[0]} has {describe(sorted(before))}; "
              f"{argv[1]} has {describe(sorted(after))}", file=sys.stderr)
        return 2
    lines, bad = compare(before, after)
    for name, only in (("BEFORE", before.keys() - after.keys()), ("AFTER", after.keys() - before.keys())):
        if only:
            lines.append(f"only in {name}: {len(only)} output(s), not compared: {describe(sorted(only))}")
    print("\n".join(lines))
    return 1 if bad else 0


if __name__ == "__main__":
    from _script_errors import run_main   # scripts/ is on sys.path when a script runs

    sys.exit(run_main(main, sys.argv[1:]))
