"""The smallest real drafter: a whole new method in one file plus one registry line.

Run it (`python examples/bigram_drafter.py [TARGET]`) to see it beside plain decoding.

It drafts what followed the previous occurrence of the last token, in the prompt or the output so far
(prompt lookup with a one-token key). Register it, and it is served, benchmarked, scheduled by the cost
model and covered by the contract tests like the built-in methods, with nothing else touched:

    from ouroboros_local.proposers import register_method
    register_method("bigram", "bigram_drafter:create")           # the one registry line
    engine.generate("def f(x):", method="bigram", options={"gamma": 6})

A drafter in the package itself is a module in ouroboros_local/proposers/ and one line in
``proposers._METHODS``. See docs/design.md#adding-a-drafter.
"""

from __future__ import annotations

from typing import Any, Sequence

from ouroboros_local import options as opt
from ouroboros_local.proposers.base import DraftingContext, Proposer
from ouroboros_local.tree import TokenTree

OPTIONS = (opt.GAMMA,)   # the options the method accepts (typed and bounded; --gamma is a flag already)


class BigramProposer(Proposer):
    name = "bigram"
    adaptive = True        # a chain: the scheduler may cap its length by the cost model

    def __init__(self, gamma: int):
        self.gamma = gamma
        self.last_seen: dict[int, int] = {}   # token -> index just after its latest earlier occurrence
        self.indexed = 0

    def propose(self, committed: Sequence[int], budget: int) -> TokenTree:
        for i in range(max(self.indexed - 1, 0), len(committed) - 1):
            self.last_seen[committed[i]] = i + 1
        self.indexed = len(committed)
        tree = TokenTree.rooted_at(committed[-1])
        start = self.last_seen.get(committed[-1])
        if start is not None:
            tree.add_path(0, committed[start:start + min(self.gamma, budget)], source="bigram")
        return tree


def create(ctx: DraftingContext, options: dict[str, Any]) -> Proposer:
    return BigramProposer(gamma=options["gamma"] or 6)


if __name__ == "__main__":   # python examples/bigram_drafter.py [TARGET]: registered, then run beside plain decoding
    import sys

    from ouroboros_local import Engine
    from ouroboros_local.proposers import register_method

    register_method("bigram", "__main__:create")
    prompt = "def add(a, b):\n    return a + b\n\ndef add_three(a, b, c):\n"
    # adaptive=False: the drafter drafts every round. By default the cost model lets it draft only where
    # that pays on this machine, which for so weak a drafter may be nowhere (0 drafted, identical text).
    with Engine.load(sys.argv[1] if len(sys.argv) > 1 else "smollm2-135m-instruct", progress=False,
                     adaptive=False) as engine:
        plain = engine.generate(prompt, max_tokens=48)
        drafted = engine.generate(prompt, max_tokens=48, method="bigram", options={"gamma": 6})
    s = drafted.stats
    print(drafted.text)
    print(f"[bigram] identical to plain decoding: {drafted.tokens == plain.tokens}; {s.drafted} tokens drafted, "
          f"{s.accepted} accepted, {s.tokens_per_pass:.2f} tokens per target pass", file=sys.stderr)
