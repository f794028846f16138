"""What does the cross-vocabulary view cost per committed token as the text grows?

Commits a text's target tokens one at a time to a ``text_bridge.DraftView`` (the draft's re-tokenized
view of the committed text, kept by every cross-vocabulary round) and prints the microseconds per token
for each 1000 tokens, whether the view's byte offsets stayed exact, its restarts without a boundary, and
whether the view equals the draft's tokenization of the whole text. Only the tokenizers load
(vocab-only), so it takes seconds.

Usage:
    python3 scripts/bridge_cost.py -m qwen2.5-coder-0.5b-instruct -d gemma3-270m -f ouroboros_local/engine.py
    python3 scripts/bridge_cost.py -m qwen2.5-coder-0.5b-instruct -d tiny:s -f ouroboros_local/engine.py
(``tiny:s``: the tests' tiny Llama-2-style SentencePiece, written to a temporary file.)
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from ouroboros_local.catalogue import resolve_model
from ouroboros_local.llama import Model
from ouroboros_local.text_bridge import DraftView


def _model(spec: str, tmp: str) -> Model:
    if spec.startswith("tiny:"):
        from ouroboros_local.testing import write_tiny_model

        path = write_tiny_model(Path(tmp) / f"{spec[5:]}.gguf", vocab=spec[5:], seed=4)
    else:
        path = resolve_model(spec)
    return Model(path, vocab_only=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", required=True, help="target: path, catalogue name or tiny:VOCAB")
    ap.add_argument("-d", "--draft", required=True, help="draft: path, catalogue name or tiny:VOCAB")
    ap.add_argument("-f", "--file", required=True, help="the text to commit")
    ap.add_argument("--bytes", type=int, default=30_000, help="the file's first BYTES bytes (default 30000)")
    args = ap.parse_args()
    text = Path(args.file).read_bytes()[:args.bytes].decode("utf-8", "ignore")   # before the models load
    with tempfile.TemporaryDirectory() as tmp:
        target, draft = _model(args.model, tmp), _model(args.draft, tmp)
        tokens = target.tokenize(text, add_special=False, parse_special=False)
        view = DraftView(target, draft)
        print(f"{len(tokens)} target tokens; the draft puts a space before its text: {view.adds_space}")
        t_bucket = 0.0
        for i, token in enumerate(tokens, 1):
            t0 = time.perf_counter()
            view.extend([token])
            t_bucket += time.perf_counter() - t0
            if i % 1000 == 0 or i == len(tokens):
                n = i % 1000 or 1000
                print(f"tokens {i - n + 1}-{i}: {1e6 * t_bucket / n:.0f} us a token, exact {view.exact}, "
                      f"restarts without a boundary {view.inexact_restarts}")
                t_bucket = 0.0
        whole = draft.tokenize(text, add_special=True, parse_special=False)
        print(f"the view equals the whole text's draft tokenization: {view.tokens == whole}")


if __name__ == "__main__":
    from _script_errors import run_main   # scripts/ is on sys.path when a script runs

    sys.exit(run_main(main))
