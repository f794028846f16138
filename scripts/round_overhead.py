#!/usr/bin/env python3
"""Our own CPU time per round, with llama.cpp's decode taken out (issue #18).

    python3 scripts/round_overhead.py [METHOD ...] [-m MODEL] [-n ROUNDS]

Loads MODEL, generates a few tokens for real, then replaces the target's decode with a no-op that keeps
the last logits, so every further round costs only what the runtime itself does around the decode:
the proposer, the tree layout and batch fill, the walk, KV bookkeeping, streaming. Caches stay warm
here, which a real decode does not leave them; `bench`'s "py ms/round" column is the in-run figure.
With the logits frozen the target repeats one token, so copy-based drafts are long and always accepted.
"""

from __future__ import annotations

import argparse

from ouroboros_local.engine import Engine
from ouroboros_local.llama import binding

PROMPT = "Write a long story about a dragon who learns to code in Python. Once upon a time"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("methods", nargs="*", default=["vanilla", "prompt-lookup", "suffix", "auto"])
    ap.add_argument("-m", "--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("-n", "--rounds", type=int, default=2000)
    args = ap.parse_args()
    engine = Engine.load(args.model, progress=False)
    for method in args.methods:
        engine.generate(PROMPT, max_tokens=8, method=method)   # real decodes: logits to freeze
    real = binding.Context.decode
    binding.Context.decode = lambda self, batch: None
    try:
        for method in args.methods:
            stats = engine.generate(PROMPT, max_tokens=args.rounds, method=method).stats
            print(f"{method}: {1e6 * stats.decode_seconds / stats.target_passes:.1f} µs per round "
                  f"({stats.target_passes} rounds, vocabulary {engine.target.n_vocab})")
    finally:
        binding.Context.decode = real


if __name__ == "__main__":
    main()
