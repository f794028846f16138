"""The Python API: load a model (and optionally a draft), generate, chat, sample.

    python examples/python_api.py                                  # SmolLM2-135M-Instruct (downloaded once)
    python examples/python_api.py TARGET.gguf [DRAFT.gguf]         # any GGUF, catalogue name or hf:// spec

Every method is lossless: with greedy decoding each token is the target's argmax, the text plain
decoding gives up to near-ties that batched kernels flip (README, Exactness); with sampling it follows
the same distribution. Only the speed differs.
"""

from __future__ import annotations

import argparse
import sys

from ouroboros_local import Engine, EngineConfig, SamplingParams
from ouroboros_local.server import default_method


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("target", nargs="?", default="smollm2-135m-instruct",
                   help="GGUF path, catalogue name or hf:// spec (default: %(default)s)")
    p.add_argument("draft", nargs="?", help="an optional draft model, given the same way")
    args = p.parse_args(argv)
    target, draft = args.target, args.draft
    config = EngineConfig(n_ctx=2048)            # threads, gpu_layers, flash_attn, ... live here too
    with Engine.load(target, draft, config=config) as engine:
        method = default_method(engine.draft is not None)   # the fastest lossless method for the pair

        # 1. Plain completion (greedy by default), checked against plain decoding.
        prompt = "def fibonacci(n):\n"
        result = engine.generate(prompt, max_tokens=48, method=method)
        baseline = engine.generate(prompt, max_tokens=48, method="vanilla")
        s = result.stats
        print(f"--- completion ({method}) ---\n{prompt}{result.text}")
        print(f"[{s.method}] {s.tokens} tokens, {s.tokens_per_second:.1f} tok/s, "
              f"{s.tokens_per_pass:.2f} tokens per target pass, finish: {result.finish_reason}; "
              f"vanilla {baseline.stats.tokens_per_second:.1f} tok/s; identical: {baseline.tokens == result.tokens}")

        # 2. One chat turn: chat=True wraps the prompt in the model's own chat template.
        answer = engine.generate("Name three colours.", chat=True, max_tokens=48, method=method)
        print(f"--- chat ---\n{answer.text}")

        # 3. A whole conversation: chat_tokens renders it with the model's template and tokenizes it as
        #    llama-server does (one BOS where the model wants one). Prefixes shared with the previous
        #    call are not recomputed: the engine keeps the KV cache of the common prefix.
        messages = [
            {"role": "system", "content": "You are a concise assistant."},
            {"role": "user", "content": "Name three colours."},
            {"role": "assistant", "content": answer.text},
            {"role": "user", "content": "And three animals?"},
        ]
        tokens = engine.chat_tokens(messages)
        follow_up = engine.generate(tokens, max_tokens=48, method=method, stop=["\n\n"])
        print(f"--- conversation ({len(tokens)} prompt tokens) ---\n{follow_up.text}")

        # 4. Sampling: temperature / top-k / top-p / min-p. Every method draws from the target's own
        #    distribution; a seed makes plain decoding's draws repeat exactly. A speculative method's run
        #    may part from another with the same seed where a draw falls within the batched kernels'
        #    rounding of a cut-off (README, Exactness): the second call drafts from the first answer.
        sampling = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, seed=42)
        story = engine.generate("Once upon a time", max_tokens=40, method=method, sampling=sampling)
        print(f"--- sampled ({method}, seed 42) ---\n{story.text}")
        plain = [engine.generate("Once upon a time", max_tokens=40, sampling=sampling).text for _ in range(2)]
        print(f"--- plain decoding twice with seed 42: the same text: {plain[0] == plain[1]} ---")
        print(f"--- stats as a dict ---\n{result.stats.to_dict()}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
