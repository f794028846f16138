"""How much does the context's size cost a plain decoding step on this machine?

One engine per size in one process; each prompt is answered by every engine in turn (in the benchmark's
balanced order, a new row per prompt and pass), so the machine's drift falls on all sizes alike. Prints each size's time per
token and its per-prompt time ratio to the first size (geometric mean and median).

Usage:
    python3 scripts/context_size.py -m smollm2-135m-instruct --prompts ../shared/bench/gsm8k.jsonl \
        --sizes 4096,768,2048 --limit 16 -n 128 [--passes 2]
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
from tqdm import tqdm

from ouroboros_local.bench import prompts as prompts_mod
from ouroboros_local.bench.runner import balanced
from ouroboros_local.engine import Engine, EngineConfig
from ouroboros_local.errors import ParameterError


def context_sizes(spec: str) -> list[int]:
    """``--sizes`` as whole numbers of tokens; anything else is a ParameterError."""
    try:
        sizes = [int(s) for s in spec.split(",")]
    except ValueError:
        raise ParameterError(f"--sizes {spec}: not comma-separated whole numbers of tokens (e.g. 4096,768)"
                             ) from None
    if any(n < 1 for n in sizes):
        raise ParameterError(f"--sizes {spec}: a context holds at least one token")
    return sizes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", default="smollm2-135m-instruct")
    ap.add_argument("--prompts", required=True, help="a JSONL prompt set")
    ap.add_argument("--sizes", default="4096,768", help="context sizes; the first is the reference")
    ap.add_argument("--limit", type=int, default=16)
    ap.add_argument("-n", "--max-tokens", type=int, default=128)
    ap.add_argument("--passes", type=int, default=2)
    args = ap.parse_args()
    sizes = context_sizes(args.sizes)
    sets = prompts_mod.load_sets(args.prompts, limit=args.limit)   # a bad file fails before the engines load
    engines = {n: Engine.load(args.model, config=EngineConfig(learned=False, n_ctx=n), progress=False)
               for n in sizes}
    first = engines[sizes[0]]
    built = prompts_mod.build_prompts(
        sets, lambda text: first.tokenize(text, add_special=True, parse_special=True), True,
        lambda messages: first.chat_prompt(messages, add_generation_prompt=True), args.max_tokens)
    seconds: dict[int, list[float]] = {n: [] for n in sizes}
    runs = [(p, i) for p in range(args.passes) for i in range(len(built))]
    for p, i in tqdm(runs, desc="prompts", unit="prompt"):
        for n in balanced(sizes, i + p * len(built)):
            stats = engines[n].generate(list(built[i].tokens), max_tokens=built[i].max_tokens,
                                        method="vanilla").stats
            seconds[n].append(stats.decode_seconds / max(stats.tokens, 1))
    reference = np.array(seconds[sizes[0]])
    for n in sizes:
        ratio = np.array(seconds[n]) / reference
        print(f"n_ctx {n:6d}: {np.mean(seconds[n]) * 1e3:.3f} ms/token; time vs {sizes[0]}: "
              f"geomean {np.exp(np.mean(np.log(ratio))):.3f}, median {np.median(ratio):.3f}")
    for engine in engines.values():
        engine.close()


if __name__ == "__main__":
    from _script_errors import run_main   # scripts/ is on sys.path when a script runs

    sys.exit(run_main(main))
