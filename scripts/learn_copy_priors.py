#!/usr/bin/env python3
"""Learn the priors of the drafters that run no model (prompt lookup, the suffix tries) and write
``ouroboros_local/copy_priors.json``, which every engine starts from (learned.py, ``copy_priors``).

    python3 scripts/learn_copy_priors.py -m smollm2-135m-instruct -m qwen2.5-coder-1.5b-instruct \\
        --prompts S/codeedit.jsonl:40:60,S/humaneval.jsonl:40:70,S/gsm8k.jsonl:100:140 -n 128 \\
        --out ouroboros_local/copy_priors.json

How often a copy is right depends on the copy (after a 16-token match, nearly always; after a 1-token
one, seldom) far more than on the model that writes the text, so what ``auto`` learns about it on some
prompts is a better start than the generic prior, which trusts every class alike (an untried class at
0.9, then near the proposer's pooled rate, ~0.6 after one success). Replayed one answer per fresh process
(``scripts/replay_auto.py --fresh-each``), SmolLM2's code edits ran 1.14x with these priors against 1.05x
from the generic ones (docs/benchmarks.md).

Each model answers each set's slice (``FILE:START:END``: prompts START..END-1; pick ones the benchmarks
do not measure, which take a set's first prompts) with ``auto``, greedy, chat template applied, from the
generic priors (a fresh engine per model and set, nothing read from or saved to the user's estimates).
What the scheduler learned of ``PRIOR_SOURCES`` is summed over models and sets: each set's counts are
decayed to its last few hundred observations, so every set weighs about the same. The mix of first
classes is not kept: how often this text copies is the request's to learn.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from tqdm import tqdm

from ouroboros_local.errors import OuroborosError, ParameterError
from ouroboros_local.learned import PRIOR_SOURCES, PRIORS_FILE


def _add(into: list[float], values: list[float]) -> None:
    into.extend([0.0] * (len(values) - len(into)))
    for i, v in enumerate(values):
        into[i] += v


def merge(total: dict[str, Any], learned: dict[str, Any]) -> None:
    """Add ``learned`` (``Scheduler.estimates()``) of PRIOR_SOURCES to ``total``, counts summed."""
    for source in PRIOR_SOURCES:
        entry = learned.get(source)
        if not entry:
            continue
        out = total.setdefault(source, {
            "acceptance": {"successes": 0.0, "failures": 0.0, "depth_successes": [], "depth_failures": []},
            "classes": {"successes": {}, "trials": {}, "first": {}}})
        acc = entry["acceptance"]
        out["acceptance"]["successes"] += acc["successes"]
        out["acceptance"]["failures"] += acc["failures"]
        _add(out["acceptance"]["depth_successes"], acc["depth_successes"])
        _add(out["acceptance"]["depth_failures"], acc["depth_failures"])
        for kind in ("successes", "trials"):
            for cls, n in (entry.get("classes") or {}).get(kind, {}).items():
                out["classes"][kind][cls] = out["classes"][kind].get(cls, 0.0) + n


def observed(total: dict[str, Any]) -> bool:
    """Whether ``total`` holds a verified draft (else the priors would be written empty)."""
    return any(e["acceptance"]["successes"] + e["acceptance"]["failures"] > 0 for e in total.values())


def rounded(total: dict[str, Any]) -> dict[str, Any]:
    """Counts to 3 decimals (the file is read at every start; its size is what is parsed)."""
    def r(x: Any) -> Any:
        if isinstance(x, float):
            return round(x, 3)
        if isinstance(x, list):
            return [r(v) for v in x]
        if isinstance(x, dict):
            return {k: r(v) for k, v in x.items()}
        return x
    return r(total)


def slices(spec: str) -> list[tuple[str, int, int]]:
    """``FILE:START:END,...`` as (file, start, end); a part that is not one is a ParameterError."""
    out = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        path, _, rest = part.partition(":")
        start, _, end = rest.partition(":")
        try:
            out.append((path, int(start or 0), int(end) if end else 10**9))
        except ValueError:
            raise ParameterError(f"--prompts {part}: not FILE:START:END (START and END whole numbers, "
                                 "either left out for the file's start or end)") from None
    if not out:
        raise ParameterError("--prompts names no file")
    return out


def load_slices(spec: str) -> list[tuple[Any, str]]:
    """Each slice's prompt set, cut to the slice, and how the report names it; a slice that selects no
    prompt is a ParameterError (it would learn nothing, and the priors file would be written empty)."""
    from ouroboros_local.bench import prompts as prompts_mod

    out = []
    for path, start, end in slices(spec):
        (prompt_set,) = prompts_mod.load_sets(path)
        total = len(prompt_set.items)
        prompt_set.items = prompt_set.items[start:end]
        if not prompt_set.items:
            raise ParameterError(f"--prompts {path}:{start}:{end if end < 10**9 else ''} selects no prompt "
                                 f"({path} holds {total})")
        out.append((prompt_set, f"{prompt_set.name}[{start}:{start + len(prompt_set.items)}]"))
    return out


def learn(model: str, prompt_set: Any, max_tokens: int) -> dict[str, Any]:
    """What ``auto`` learned answering ``prompt_set`` with ``model`` from the generic priors."""
    from ouroboros_local.bench import prompts as prompts_mod
    from ouroboros_local.engine import Engine, EngineConfig

    with Engine.load(model, config=EngineConfig(learned=False)) as engine:
        built = prompts_mod.build_prompts(
            [prompt_set], lambda text: engine.tokenize(text, add_special=True, parse_special=True),
            True, lambda messages: engine.chat_prompt(messages, add_generation_prompt=True), max_tokens)
        for b in tqdm(built, desc=f"{Path(model).stem} {prompt_set.name}", file=sys.stderr):
            engine.generate(list(b.tokens), max_tokens=b.max_tokens, method="auto")
        return engine.scheduler().estimates()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", action="append", required=True, help="target (repeat for several)")
    ap.add_argument("--prompts", required=True, help="FILE:START:END, comma-separated (JSONL prompt sets)")
    ap.add_argument("-n", "--max-tokens", type=int, default=128)
    ap.add_argument("--out", default=str(PRIORS_FILE), help="where to write (default: %(default)s)")
    args = ap.parse_args()

    chosen = load_slices(args.prompts)   # before any model loads: a bad slice fails at once
    from ouroboros_local import engine as engine_mod

    engine_mod.copy_priors = lambda: {}   # learn from the generic priors, not from the file being replaced
    total: dict[str, Any] = {}
    runs = []
    for model in args.model:
        for prompt_set, named in chosen:
            merge(total, learn(model, prompt_set, args.max_tokens))
            runs.append(f"{model} {named}")
    if not observed(total):
        raise OuroborosError(f"no drafter of {', '.join(PRIOR_SOURCES)} was tried on these prompts: "
                             f"{args.out} not written")
    payload = {"learned_by": "scripts/learn_copy_priors.py", "runs": runs, "max_tokens": args.max_tokens,
               "estimates": rounded(total)}
    Path(args.out).write_text(json.dumps(payload, indent=1) + "\n")
    for source, entry in total.items():
        classes = entry["classes"]
        acc = entry["acceptance"]
        pooled = acc["successes"] / max(acc["successes"] + acc["failures"], 1e-9)
        print(f"{source}: {len(classes['trials'])} classes, {sum(classes['trials'].values()):.0f} trials; "
              f"pooled acceptance {pooled:.2f}")
    return 0


if __name__ == "__main__":
    from _script_errors import run_main   # scripts/ is on sys.path when a script runs

    sys.exit(run_main(main))
