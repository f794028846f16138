#!/usr/bin/env python3
"""Speed-ups over several `ouroboros-local bench` runs of the same sets, pooled over all their prompts.

    python3 scripts/pool_runs.py RUN1/results.json RUN2/results.json [...] [--reference vanilla]

On a shared 2-core machine one prompt's timing moves by +-20% (a method that drafts nothing, which runs
plain decoding, measured 0.71-1.21x of vanilla on single prompts), so one run's ratio for a 16-prompt set
moves by +-5%. Pooling runs of the same code gives each set more prompts. Per set and method: the ratio
in each run (sum of tokens over sum of decode seconds, against the reference's) and pooled over all the
runs' prompts (each run's reference timing pairs with that run's method timing).
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict


def load(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return json.load(f)["records"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", help="results.json files of bench runs")
    ap.add_argument("--reference", default="vanilla", help="the label the ratios are taken against")
    args = ap.parse_args()
    # (set, label) -> per run [tokens, seconds]
    sums: dict[tuple[str, str], list[list[float]]] = defaultdict(lambda: [[0.0, 0.0] for _ in args.runs])
    sets: list[str] = []
    labels: list[str] = []
    for i, path in enumerate(args.runs):
        for rec in load(path):
            if rec.get("error") or not rec.get("decode_seconds"):
                continue
            cell = sums[(rec["set"], rec["label"])][i]
            cell[0] += rec.get("timed_tokens") or rec["tokens"]
            cell[1] += rec["decode_seconds"]
            if rec["set"] not in sets:
                sets.append(rec["set"])
            if rec["label"] not in labels:
                labels.append(rec["label"])
    others = [label for label in labels if label != args.reference]
    runs = " / ".join(f"run {i + 1}" for i in range(len(args.runs)))
    print(f"| set | " + " | ".join(others) + " |")
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
            each = [(g[0] / g[1]) / (r[0] / r[1]) for g, r in both]
            pooled = (sum(g[0] for g, _ in both) / sum(g[1] for g, _ in both)) / \
                     (sum(r[0] for _, r in both) / sum(r[1] for _, r in both))
            worst[label] = min(worst.get(label, pooled), pooled)
            cells.append(f"{pooled:.2f}x ({' / '.join(f'{x:.2f}' for x in each)})")
        print(f"| {name} | " + " | ".join(cells) + " |")
    print(f"\npooled over {len(args.runs)} runs (in brackets: {runs}); lowest pooled set per method: " +
          ", ".join(f"{label} {value:.2f}x" for label, value in worst.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
