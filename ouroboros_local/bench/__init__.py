"""Benchmark harness: our methods and the peers side by side, with reports and plots.

Entry point: `ouroboros-local bench` (bench/cli.py). Building blocks:

- prompts.py: prompt sets (`{id, task, turns, source, meta}` JSONL) and per-task prompt building;
- runner.py: contenders (our methods, injected callables), the interleaved run, output comparison;
- peers.py: llama-cpp-python (plain and prompt-lookup) and llama.cpp's binaries as contenders;
- report.py: summaries, machine facts, results.json / results.md, speedup.png / sweep.png.
"""

from __future__ import annotations

from .prompts import DEFAULT_MAX_TOKENS, TASKS, BuiltPrompt, PromptItem, PromptSet, load_sets, render_prompt

__all__ = ["DEFAULT_MAX_TOKENS", "TASKS", "BuiltPrompt", "PromptItem", "PromptSet", "load_sets",
           "render_prompt"]
