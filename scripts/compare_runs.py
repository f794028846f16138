#!/usr/bin/env python3
"""Did a change alter what any method writes? Compare two `ouroboros-local bench --save-text` runs made
with the same command before and after the change (docs/benchmarks.md, "behaviour check").

    python3 scripts/compare_runs.py BEFORE/results.json AFTER/results.json

Per method: how many outputs are byte-identical between the runs; for the others, their verdict
against vanilla in each run (identical / tie-flip / mismatch). Methods the cost model schedules decide
from measured timings, so two runs of the same code may verify different trees and part at different
near-ties; a change that preserves behaviour shows only identical outputs for the fixed methods and
only identical/tie-flip verdicts elsewhere. Exit status 1 when an output is a mismatch in either run.
"""

from __future__ import annotations

import json
import sys
from collections import Counter, defaultdict


def records(path: str) -> dict[tuple[str, str, str], dict]:
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    out = {(r["set"], r["id"], r["label"]): r for r in data["records"]}
    if any(r.get("text") is None for r in out.values()):
        sys.exit(f"{path}: run the benchmark with --save-text")
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: " + __doc__.strip().splitlines()[3].strip(), file=sys.stderr)
        return 2
    before, after = records(argv[0]), records(argv[1])
    same: Counter[str] = Counter()
    verdicts: defaultdict[str, Counter[tuple[str, str]]] = defaultdict(Counter)
    for key in sorted(before.keys() & after.keys()):
        label = key[2]
        a, b = before[key], after[key]
        if a["text"] == b["text"]:
            same[label] += 1
        else:
            verdicts[label][(a.get("match") or "?", b.get("match") or "?")] += 1
    bad = False
    for label in sorted(same.keys() | verdicts.keys()):
        differ = sum(verdicts[label].values())
        line = f"{label}: {same[label]}/{same[label] + differ} identical"
        if differ:
            line += "; the others (before -> after): " + ", ".join(
                f"{n} {a} -> {b}" for (a, b), n in verdicts[label].most_common())
            bad |= any("mismatch" in (a + b).lower() for a, b in verdicts[label])
        print(line)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
