"""How much could copying drafts (prompt lookup, phrase pools) speed up greedy decoding here, at best?

Generates the target's greedy answers to a prompt set (or reads them back with --outputs, which records
each answer's token budget -n for replay_auto.py), then replays each answer against the measured
verify-cost curve c(n) of this machine:

* oracle: a draft copied from the longest earlier match of the context, verified only when, and only
  as far as, it is right (no scheduler can do better with these drafts);
* by match length, in-sample: one draft length per match-length bucket, the best for the very answers
  it is scored on (an upper bound for a scheduler that knows only the match length);
* by match length, cross-validated: buckets fitted on half the prompts, scored on the other half.

Usage:
    python3 scripts/copy_bound.py -m qwen2.5-coder-1.5b-instruct \
        --prompts ../shared/bench/humaneval.jsonl,../shared/bench/cnndm.jsonl --limit 16 -n 128 \
        --outputs bench-out/greedy-outputs.json [--max-draft 15]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
from tqdm import tqdm

from ouroboros_local.errors import OuroborosError
from ouroboros_local.text_input import read_json

BUCKETS = (1, 2, 3, 5, 9, 17)   # match lengths 1, 2, 3-4, 5-8, 9-16, 17+
MAX_DRAFT = 8    # the longest draft (--max-draft): the 1.5B's curve dips at 16 tokens, so 15 tells more there


def longest_match(context: list[int], cap: int = 32) -> tuple[int, int]:
    """(length, end) of the longest suffix of ``context`` that also ends earlier (most recent wins)."""
    n, last = len(context), context[-1]
    best = (0, -1)
    for end in range(n - 2, -1, -1):
        if context[end] != last:
            continue
        length = 1
        while length < cap and end - length >= 0 and context[end - length] == context[n - 1 - length]:
            length += 1
        if length > best[0]:
            best = (length, end)
            if length >= cap:
                break
    return best


def copy_events(prompt: list[int], answer: list[int]) -> list[tuple[int, int]]:
    """For each answer position: (match-length bucket, how many following answer tokens the copy gets right)."""
    events = []
    for t in range(len(answer)):
        context = prompt + answer[:t]
        length, end = longest_match(context)
        run = 0
        if length:
            while (t + run < len(answer) and end + 1 + run < len(context)
                   and context[end + 1 + run] == answer[t + run]):
                run += 1
        bucket = int(np.searchsorted(BUCKETS, length, side="right")) if length else 0
        events.append((bucket, run))
    return events


def replay(answers: list[list[tuple[int, int]]], ratio, choose) -> float:
    """Speed-up over plain decoding when each round drafts ``choose(bucket, run)`` tokens."""
    tokens = steps = 0.0
    for events in answers:
        t = 0
        tokens += len(events)
        while t < len(events):
            bucket, run = events[t]
            k = choose(bucket, run)
            steps += ratio(k + 1)
            t += min(k, run) + 1
    return tokens / steps if steps else 1.0


def fit(answers: list[list[tuple[int, int]]], ratio, max_draft: int = MAX_DRAFT) -> dict[int, int]:
    """Per bucket, the draft length with the largest expected gain (tokens minus cost, in steps)."""
    runs: dict[int, list[int]] = defaultdict(list)
    for events in answers:
        for bucket, run in events:
            runs[bucket].append(run)
    policy = {}
    for bucket, rs in runs.items():
        r = np.array(rs)
        gains = [np.mean(np.minimum(k, r) + 1) - ratio(k + 1) for k in range(max_draft + 1)]
        policy[bucket] = int(np.argmax(gains))
    return policy


def read_answers(path: Path) -> list[dict]:
    """The answers an earlier run wrote to ``--outputs`` (each {"set", "id", "prompt", "answer"} and,
    since it was recorded, "max_tokens"); a file that is not such a list is an OuroborosError."""
    answers = read_json(path, "answers file")
    if not isinstance(answers, list) or not answers or not all(
            isinstance(a, dict) and {"set", "prompt", "answer"} <= a.keys() for a in answers):
        raise OuroborosError(f"{path}: not an answers file written by --outputs (a non-empty list of "
                             "answers with a set, a prompt and an answer)")
    return answers


def greedy_answers(engine, built) -> list[dict]:
    """The target's greedy answer to each built prompt, with the token budget it had (replay_auto.py
    replays the answers at that budget)."""
    answers = []
    for b in tqdm(built, desc="greedy answers", file=sys.stderr):
        result = engine.generate(list(b.tokens), max_tokens=b.max_tokens, method="vanilla")
        answers.append({"set": b.set_name, "id": b.id, "prompt": list(b.tokens), "answer": result.tokens,
                        "max_tokens": b.max_tokens})
    return answers


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--limit", type=int, default=16)
    ap.add_argument("-n", "--max-tokens", type=int, default=128)
    ap.add_argument("--outputs", help="JSON file of greedy answers: read if it exists, else written (with -n)")
    ap.add_argument("--max-draft", type=int, default=MAX_DRAFT, help="longest draft (default: %(default)s)")
    args = ap.parse_args()

    from ouroboros_local.bench import prompts as prompts_mod
    from ouroboros_local.engine import Engine

    path = Path(args.outputs) if args.outputs else None
    answers = read_answers(path) if path is not None and path.is_file() else None
    sets = prompts_mod.load_sets(args.prompts, limit=args.limit) if answers is None else []
    engine = Engine.load(args.model)
    costs = engine.cost_model()
    ratio = lambda n: costs.ratio(n)  # noqa: E731
    if answers is None:
        built = prompts_mod.build_prompts(
            sets, lambda text: engine.tokenize(text, add_special=True, parse_special=True), True,
            lambda messages: engine.chat_prompt(messages, add_generation_prompt=True), args.max_tokens)
        answers = greedy_answers(engine, built)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(answers))
    longest = args.max_draft
    print("c(n)/c(1): " + ", ".join(f"c({n})={ratio(n):.2f}" for n in sorted({2, 3, 4, 6, 8, longest + 1})))
    print("| set | answers | tokens | oracle | by match length, in-sample | cross-validated |")
    print("|---|---:|---:|---:|---:|---:|")
    for name in dict.fromkeys(a["set"] for a in answers):
        evs = [copy_events(a["prompt"], a["answer"]) for a in answers if a["set"] == name]
        oracle = replay(evs, ratio, lambda bucket, run: max(
            range(min(run, longest) + 1), key=lambda k: (k + 1) / ratio(k + 1)))
        policy = fit(evs, ratio, longest)
        in_sample = replay(evs, ratio, lambda bucket, run: policy.get(bucket, 0))
        halves = (evs[::2], evs[1::2])
        cv = []
        for train, test in (halves, halves[::-1]):
            p = fit(train, ratio, longest)
            cv.append(replay(test, ratio, lambda bucket, run, p=p: p.get(bucket, 0)))
        print(f"| {name} | {len(evs)} | {sum(map(len, evs))} | {oracle:.3f}x | {in_sample:.3f}x | "
              f"{cv[0]:.3f}x / {cv[1]:.3f}x |")
    engine.close()
    return 0


if __name__ == "__main__":
    from _script_errors import run_main   # scripts/ is on sys.path when a script runs

    sys.exit(run_main(main))
