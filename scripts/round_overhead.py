#!/usr/bin/env python3
"""Our own CPU time per round, with llama.cpp's decode taken out (issue #18).

    python3 scripts/round_overhead.py [METHOD ...] [-m MODEL] [-n TOKENS] [--temperature T]
                                      [--chain N] [--cold] [--idle] [--round-size K] [--overlap] [--profile K]

Loads MODEL, generates a few tokens for real, then replaces the target's decode with a no-op that keeps
the last logits, so every further round costs only what the runtime itself does around the decode:
the proposer, the tree layout and batch fill, the walk, KV bookkeeping, streaming. With the logits
frozen the target repeats one token, so copy-based drafts are long and always accepted.

- ``--chain N`` adds two synthetic methods that draft a chain of N tokens every round: ``chain-hit``
  (the token the frozen logits predict: all N accepted, N + 1 rows read) and ``chain-miss`` (another
  token: rejected at once, one row read): the cost of a tree of N tokens without a proposer's own work.
- ``--cold`` evicts the CPU caches before every round (a pass over 64 MiB, not counted), as a real
  decode does: what a round costs in a real run, where each decode streams the model's weights through.
- ``--idle`` makes the frozen logits predict a new random token every round: text with nothing to copy,
  so copy-based drafters find nothing and their rounds are idle (what gsm8k and mt_bench mostly are).
- ``--round-size K`` runs every round of a drafting method at K tokens (``EngineConfig.round_size``;
  by default the engine's: 4 where the whole target is on a CUDA GPU, else each its draft's size).
- ``--overlap`` drafts during rounds without a draft (``EngineConfig.overlap``, a GPU's default); the
  stubbed decode returns at once, so the line adds the time spent drafting and observing then
  (``hidden``), which a GPU's decode would cover.
- ``--temperature T`` samples (top-k 40, top-p 0.95, min-p 0.05, as the CLI's defaults).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from typing import Any, Sequence

import numpy as np

from ouroboros_local.engine import Engine
from ouroboros_local.llama import binding
from ouroboros_local.proposers import DraftingContext, Proposer, register_method
from ouroboros_local.sampling import SamplingParams
from ouroboros_local.tree import TokenTree, layout

PROMPT = "Write a long story about a dragon who learns to code in Python. Once upon a time"
_CHAIN = {"length": 8, "token": 0}


class _Chain(Proposer):
    """Drafts the same token ``_CHAIN["length"]`` times (a hit or a miss against the frozen logits)."""

    def __init__(self, name: str, hit: bool):
        self.name, self.hit = name, hit

    def propose(self, committed: Sequence[int], budget: int) -> TokenTree:
        tree = TokenTree.rooted_at(committed[-1])
        token = _CHAIN["token"] if self.hit else _CHAIN["token"] + 1
        tree.add_path(0, [token] * min(budget, _CHAIN["length"]))
        return tree


def chain_hit(ctx: DraftingContext, options: dict[str, Any]) -> Proposer:
    return _Chain("chain-hit", hit=True)


def chain_miss(ctx: DraftingContext, options: dict[str, Any]) -> Proposer:
    return _Chain("chain-miss", hit=False)


def _stub_decode(cold: bool, idle: bool, avoid: frozenset[int]):
    """A decode that keeps the last logits; ``cold``: it evicts the caches first; ``idle``: its rows
    predict a fresh random token above a fixed random background, as a model's logits (a flat row of
    ties is not what sampling meets; neither's time is counted)."""
    evict = np.ones(16 * 2**20, dtype=np.float32) if cold else None
    rng = np.random.default_rng(0)
    background: list[np.ndarray] = []

    def decode(self, batch) -> None:
        t0 = time.perf_counter()
        if evict is not None:
            evict.sum()
        if idle:
            rows = self.logits(batch.n_tokens)
            token = int(rng.integers(rows.shape[1]))
            while token in avoid:
                token = int(rng.integers(rows.shape[1]))
            if not background:
                background.append(rng.normal(0.0, 2.0, rows.shape[1]).astype(np.float32))
            rows[:] = background[0]
            rows[:, token] = 30.0
        elapsed = time.perf_counter() - t0
        binding._decode_clock.seconds = getattr(binding._decode_clock, "seconds", 0.0) + elapsed
    return decode


def _frozen_rows(engine: Engine) -> np.ndarray:
    """Logits rows for every row a round may read (a batch's), each predicting one token: one real decode of
    a whole batch first, so that llama.cpp's output buffer holds them all (writing rows past the last
    decode's wrote past the buffer: a segfault at --chain 32), and no round reads a stale row."""
    n = engine.target_ctx.n_batch
    tree = TokenTree.rooted_at(engine.tokenize(PROMPT)[-1])
    tree.add_path(0, tree.tokens * (n - 1))
    engine.kv.reset()
    rows = engine.kv.decode_layout(layout(tree))
    rows[1:] = rows[0]
    engine.kv.reset()
    return rows


def _time_hidden_work() -> list[float]:
    """Count the seconds spent drafting and observing during a round's decode (``--overlap``)."""
    total = [0.0]
    propose_hidden, observer = Engine._propose_hidden, Engine._observer

    def timed_propose(self, *args):
        t0 = time.perf_counter()
        try:
            return propose_hidden(self, *args)
        finally:
            total[0] += time.perf_counter() - t0

    def timed_observer(*args):
        observe = observer(*args)

        def timed(t_observe=None):
            t0 = time.perf_counter()
            observe(t_observe)
            if t_observe is None:          # called during the next round's decode
                total[0] += time.perf_counter() - t0
        return timed

    Engine._propose_hidden = timed_propose
    Engine._observer = staticmethod(timed_observer)
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("methods", nargs="*", default=["vanilla", "prompt-lookup", "suffix", "auto"])
    ap.add_argument("-m", "--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("-n", "--max-tokens", dest="rounds", type=int, default=2000,
                    help="tokens each method generates (default 2000; a round writes one or more)")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--chain", type=int, default=0, metavar="N",
                    help="add chain-hit and chain-miss (N tokens, below the batch size)")
    ap.add_argument("--cold", action="store_true", help="evict the CPU caches before every round")
    ap.add_argument("--idle", action="store_true", help="a new random token every round: nothing to copy")
    ap.add_argument("--round-size", type=int, default=None, metavar="K",
                    help="rounds of K tokens (default: the engine's, 4 where the whole target is on a CUDA GPU)")
    ap.add_argument("--overlap", action="store_true", help="draft during rounds without a draft")
    ap.add_argument("--fixed-rounds", action="store_true",
                    help="with --round-size and --overlap: every round K tokens (EngineConfig.round_switch off)")
    ap.add_argument("--profile", type=int, default=0, metavar="K", help="print each method's K costliest functions")
    args = ap.parse_args()
    methods = list(args.methods)
    if args.chain:
        _CHAIN["length"] = args.chain
        register_method("chain-hit", "__main__:chain_hit")
        register_method("chain-miss", "__main__:chain_miss")
        methods += ["chain-hit", "chain-miss"]
    sampling = SamplingParams(temperature=args.temperature, seed=0)
    engine = Engine.load(args.model, progress=False, round_size=args.round_size,
                         overlap=True if args.overlap else None, round_switch=not args.fixed_rounds)
    for method in methods:
        engine.generate(PROMPT, max_tokens=32, method=method, sampling=sampling)
    rows = _frozen_rows(engine)
    _CHAIN["token"] = int(rows[0].argmax())
    hidden = _time_hidden_work() if args.overlap else None
    real = binding.Context.decode
    binding.Context.decode = _stub_decode(args.cold, args.idle, engine.target.eog_tokens)
    try:
        for method in methods:
            profiler = cProfile.Profile() if args.profile else None
            if profiler:
                profiler.enable()
            if hidden is not None:
                hidden[0] = 0.0
            stats = engine.generate(PROMPT, max_tokens=args.rounds, method=method, sampling=sampling).stats
            if profiler:
                profiler.disable()
                pstats.Stats(profiler).sort_stats("tottime").print_stats(args.profile)
            per_round = 1e3 * stats.extra["python_ms_per_round"]
            print(f"{method}: {per_round:.1f} µs per round ({stats.target_passes} rounds, "
                  f"{stats.tokens / stats.target_passes:.2f} tokens per round, vocabulary {engine.target.n_vocab}"
                  f"{', temperature %g' % args.temperature if args.temperature else ''}"
                  f"{', cold caches' if args.cold else ''}{', idle text' if args.idle else ''}"
                  f"{', rounds of %d' % engine.round_size if engine.round_size else ''})"
                  + (f"; {1e6 * hidden[0] / stats.target_passes:.1f} µs of it hidden" if hidden else ""))
    finally:
        binding.Context.decode = real


if __name__ == "__main__":
    from _script_errors import run_main   # scripts/ is on sys.path when a script runs

    sys.exit(run_main(main))
