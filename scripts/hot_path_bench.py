"""Python cost of one decoding round, outside llama.cpp's decode (issue 18).

    python3 scripts/hot_path_bench.py micro              # synthetic logits: vocabulary 151936, 8-node chain
    python3 scripts/hot_path_bench.py engine -m MODEL    # real generations: Python ms per round per method
    python3 scripts/hot_path_bench.py turns -m MODEL     # a chat's turns: what each adds before it decodes

Runs against whichever ``ouroboros_local`` is importable, so the same command measures an older
checkout too (``PYTHONPATH=/path/to/old/checkout python3 scripts/hot_path_bench.py ...``). Take the
CPU lock for timings (``flock /tmp/cpu.lock ...``): llama.cpp spin-waits.
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import sys
import time
from typing import Callable

import numpy as np

VOCAB = 151936
TREE = 8          # tree nodes, root included: a chain of 7 candidates
CONTEXT = 2048


def best_us(fn: Callable[[], object], repeat: int = 7, number: int = 50) -> float:
    """Best-of-``repeat`` mean microseconds per call."""
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        times.append((time.perf_counter() - t0) / number)
    return min(times) * 1e6


def llm_like_rows(rng: np.random.Generator, rows: int, peaked: bool) -> np.ndarray:
    """Shaped like Qwen2.5's rows (vocabulary 151936): a bulk around -5 with spread 2.7, the top
    token near 20, a few dozen within 10 of it."""
    x = (rng.standard_normal((rows, VOCAB)) * 2.7 - 5.0).astype(np.float32)
    for r in range(rows):
        hot = rng.choice(VOCAB, size=40, replace=False)
        x[r, hot] = rng.uniform(5, 20, size=40).astype(np.float32)
        x[r, hot[0]] = 20.0 + rng.uniform(0, 3)
        if peaked:
            x[r, hot[0]] += 10.0   # the target is sure: sampling keeps one token, a chain is accepted
    return x


def chain(tokens: list[int]):
    from ouroboros_local.tree import TokenTree

    tree = TokenTree.rooted_at(tokens[0])
    node = 0
    for tok in tokens[1:]:
        node = tree.add(node, tok)
    return tree


def micro() -> None:
    from ouroboros_local.kv import common_prefix
    from ouroboros_local.proposers.draft_model import top_probability
    from ouroboros_local.sampling import SamplingParams
    from ouroboros_local.verify import verify

    rng = np.random.default_rng(0)
    greedy = SamplingParams()
    sampled = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05)
    results: list[tuple[str, float]] = []
    for peaked in (True, False):
        rows = llm_like_rows(rng, TREE, peaked)
        best = rows.argmax(axis=1).tolist()
        tree = chain([1] + best[:TREE - 1])              # row i's argmax is node i+1: all accepted
        label = "all 7 accepted" if peaked else "first rejected"
        if not peaked:
            tree = chain([1] + [(t + 1) % VOCAB for t in best[:TREE - 1]])
        results.append((f"verify greedy, {label}", best_us(lambda: verify(tree, rows, greedy, rng))))
        s_tree = chain([1] + best[:TREE - 1])
        results.append((f"verify sampling, {'all 7 accepted' if peaked else 'sample-and-match'}",
                        best_us(lambda: verify(s_tree, rows, sampled, rng), number=10)))
    row = llm_like_rows(rng, 1, False)[0]
    takes_token = len(inspect.signature(top_probability).parameters) > 1
    results.append(("draft confidence (argmax + top_probability)",
                    best_us(lambda: top_probability(row, int(row.argmax())) if takes_token
                            else (int(row.argmax()), top_probability(row)))))
    try:
        from ouroboros_local.sampling import support

        results.append(("sampled draft step (support + sample)",
                        best_us(lambda: support(row, sampled).sample(rng), number=20)))
    except ImportError:
        from ouroboros_local.sampling import distribution, sample

        results.append(("sampled draft step (distribution + sample)",
                        best_us(lambda: sample(distribution(row, sampled), rng), number=5)))
    cached = rng.integers(0, VOCAB, size=CONTEXT).tolist()
    committed = cached[:-3] + [5, 6, 7, 8]
    if "start" in inspect.signature(common_prefix).parameters:
        results.append((f"KV common prefix at {CONTEXT} tokens (watermark)",
                        best_us(lambda: common_prefix(cached, committed, CONTEXT - 4))))
    results.append((f"KV common prefix at {CONTEXT} tokens (full walk)",
                    best_us(lambda: common_prefix(cached, committed))))
    results += batch_fill()
    width = max(len(name) for name, _ in results)
    for name, us in results:
        print(f"{name:<{width}}  {us:9.1f} us")


def batch_fill() -> list[tuple[str, float]]:
    from ouroboros_local.llama import Batch
    from ouroboros_local.tree import layout

    batch = Batch(256, 16)
    lay = layout(chain(list(range(TREE))))
    fast = hasattr(batch, "add_tokens")

    def tree_fill() -> None:
        batch.clear()
        if fast:
            batch.add_tokens(lay.tokens, [100 + o for o in lay.pos_offsets], lay.seq_ids, lay.logits)
        else:
            for tok, off, seqs, want in zip(lay.tokens, lay.pos_offsets, lay.seq_ids, lay.logits):
                batch.add(tok, 100 + off, seqs, want)

    chunk = list(range(256))

    def prefill_fill() -> None:
        batch.clear()
        batch.add_sequence(chunk, 0, (0,), True)

    return [(f"batch fill, {TREE}-node tree layout", best_us(tree_fill)),
            ("batch fill, 256-token prefill chunk", best_us(prefill_fill, number=10))]


def engine(args: argparse.Namespace) -> None:
    prompt = open(args.prompt_file, encoding="utf-8").read() if args.prompt_file else args.prompt
    from ouroboros_local import Engine, EngineConfig, SamplingParams
    from ouroboros_local.llama import binding

    own_clock = not hasattr(binding, "decode_seconds")
    calls: list[tuple[float, float]] = []     # (start, seconds) of every llama_decode
    if own_clock:  # an older checkout: time llama_decode here
        plain = binding.Context.decode

        def timed(self, batch):
            t0 = time.perf_counter()
            try:
                return plain(self, batch)
            finally:
                calls.append((t0, time.perf_counter() - t0))
        binding.Context.decode = timed
    sampling = SamplingParams(temperature=0.8, seed=1) if args.sampling else SamplingParams()
    with Engine.load(args.model, config=EngineConfig(n_ctx=2048, calibration="off"), progress=False) as eng:
        print(f"target {args.model}: vocabulary {eng.target.n_vocab}, "
              f"{'sampling T=0.8' if args.sampling else 'greedy'}, {args.tokens} tokens")
        for method in args.methods.split(","):
            per_round = []
            for _ in range(args.repeat):
                eng.kv.reset()
                calls.clear()
                result = eng.generate(prompt, max_tokens=args.tokens, method=method, sampling=sampling)
                t_end = time.perf_counter()
                st = result.stats
                if own_clock:   # decodes of the decode phase: those after the prefill
                    spent = sum(d for t0, d in calls if t0 >= t_end - st.decode_seconds - 1e-3)
                    py = (st.decode_seconds - spent) * 1e3 / st.target_passes
                else:
                    py = st.extra["python_ms_per_round"]
                per_round.append(py)
            print(f"{method:>14}: python {statistics.median(per_round):.3f} ms/round "
                  f"(runs {', '.join(f'{v:.3f}' for v in per_round)}), {st.target_passes} rounds, "
                  f"{st.tokens_per_second:.1f} tok/s")


def turns(args: argparse.Namespace) -> None:
    """A chat's turns at a conversation of ``--history`` tokens: each prompt is the last one, its answer
    and 20 new tokens, so llama.cpp decodes only those (its cache holds the rest) and a turn's prefill
    time is what the method adds to them (indexing the conversation), beside vanilla's."""
    from ouroboros_local import Engine, EngineConfig

    with Engine.load(args.model, config=EngineConfig(n_ctx=args.history + 512, calibration="off"),
                     progress=False) as eng:
        text = open(args.prompt_file, encoding="utf-8").read() if args.prompt_file else args.prompt
        unit = eng.tokenize(text, add_special=False)
        source = (unit * (1 + (args.history + 40 * args.repeat) // max(1, len(unit))))
        print(f"target {args.model}: a turn of 20 tokens after {args.history} tokens of conversation")
        for method in args.methods.split(","):
            eng.history.clear()
            conversation, at = source[:args.history], args.history
            eng.generate(conversation, max_tokens=4, method=method)
            spent = []
            for _ in range(args.repeat):
                answer = eng.generate(conversation, max_tokens=4, method=method).tokens
                conversation = conversation + answer + source[at:at + 20]
                at += 20
                spent.append(eng.generate(conversation, max_tokens=4, method=method).stats.prefill_seconds * 1e3)
            print(f"{method:>14}: prefill {statistics.median(spent):.1f} ms per turn "
                  f"(turns {', '.join(f'{v:.1f}' for v in spent)})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="what", required=True)
    sub.add_parser("micro", help="synthetic logits, per component")
    e = sub.add_parser("engine", help="real generations")
    e.add_argument("-m", "--model", required=True)
    e.add_argument("--methods", default="vanilla,prompt-lookup")
    e.add_argument("-n", "--tokens", type=int, default=64)
    e.add_argument("--repeat", type=int, default=3)
    e.add_argument("--sampling", action="store_true")
    e.add_argument("-p", "--prompt", default="def quicksort(xs):\n    \"\"\"Sort a list of numbers.\"\"\"\n")
    e.add_argument("-f", "--prompt-file", default=None)
    t = sub.add_parser("turns", help="a chat's turns: prefill per turn as the conversation grows")
    t.add_argument("-m", "--model", required=True)
    t.add_argument("--methods", default="vanilla,prompt-lookup,suffix,ouroboros,auto")
    t.add_argument("--history", type=int, default=6000, help="conversation tokens before the turns")
    t.add_argument("--repeat", type=int, default=3)
    t.add_argument("-p", "--prompt", default="def quicksort(xs):\n    \"\"\"Sort a list of numbers.\"\"\"\n")
    t.add_argument("-f", "--prompt-file", default=None)
    args = p.parse_args()
    if args.what == "micro":
        micro()
    elif args.what == "turns":
        turns(args)
    else:
        engine(args)


if __name__ == "__main__":
    from _script_errors import run_main   # scripts/ is on sys.path when a script runs

    sys.exit(run_main(main))
