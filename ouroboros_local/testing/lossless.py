"""Losslessness checks: greedy answers equal to vanilla decoding's, and sampled outcomes that follow the
target's exact distribution.

One chi-square goodness-of-fit test serves every sampling test (verifiers on synthetic logits, every
method on the tiny generated models), so they all share one threshold and one way of handling rare
cells. Needs scipy (a ``dev`` extra): only tests import this module.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from scipy import stats

from ..kv import KVCache
from ..llama import Context, ContextParams, Model
from ..sampling import SamplingParams, distribution

if TYPE_CHECKING:  # pragma: no cover
    from ..engine import Engine
    from ..generation import GenerationResult

# A sampler that is exactly lossless fails a test with probability ALPHA (the chi-square's p-value is
# uniform then), so a suite of a few dozen such tests stays green; a real bias drives p towards 0.
ALPHA = 1e-3
# Cells expected fewer times than this are pooled into one: the chi-square approximation needs it.
MIN_EXPECTED = 5.0


def chi_square_pvalue(observed: np.ndarray, probs: np.ndarray) -> float:
    """p-value of ``observed`` counts drawn from ``probs`` (all > 0, normalised here), rare cells
    pooled so that every expected count but perhaps the pooled one is >= MIN_EXPECTED."""
    observed = np.asarray(observed, dtype=np.float64).ravel()
    probs = np.asarray(probs, dtype=np.float64).ravel()
    expected = probs / probs.sum() * observed.sum()
    rare = expected < MIN_EXPECTED
    if rare.any():
        expected = np.append(expected[~rare], expected[rare].sum())
        observed = np.append(observed[~rare], observed[rare].sum())
    return float(stats.chisquare(observed, expected).pvalue)


def _aligned(counts: Mapping[Hashable, float] | np.ndarray, probs: Mapping[Hashable, float] | np.ndarray
             ) -> tuple[np.ndarray, np.ndarray, list[Hashable]]:
    """Observed counts and probabilities as two flat arrays over the same outcomes, and the outcomes'
    names (dict keys, or array indices)."""
    if isinstance(probs, Mapping):
        assert isinstance(counts, Mapping), "counts and probs must both be mappings or both arrays"
        outcomes = list(probs) + [k for k in counts if k not in probs]
        return (np.array([counts.get(k, 0) for k in outcomes], dtype=np.float64),
                np.array([probs.get(k, 0.0) for k in outcomes], dtype=np.float64), outcomes)
    counts, probs = np.asarray(counts, dtype=np.float64), np.asarray(probs, dtype=np.float64)
    assert counts.shape == probs.shape, f"counts {counts.shape} and probs {probs.shape} differ in shape"
    names = list(np.ndindex(probs.shape)) if probs.ndim > 1 else list(range(probs.size))
    return counts.ravel(), probs.ravel(), names


def assert_follows(counts: Mapping[Hashable, float] | np.ndarray, probs: Mapping[Hashable, float] | np.ndarray,
                   *, what: str = "", alpha: float = ALPHA) -> float:
    """Assert that sampled ``counts`` follow the exact distribution ``probs``; returns the p-value.

    Both are mappings outcome -> count / probability, or arrays of one shape indexed by outcome. An
    outcome of zero probability that was sampled fails at once; the rest must pass the chi-square test
    at level ``alpha``. ``what`` names the sampler in the failure message."""
    observed, p, outcomes = _aligned(counts, probs)
    label = f"{what}: " if what else ""
    impossible = [outcomes[i] for i in np.flatnonzero((p <= 0) & (observed > 0))]
    assert not impossible, f"{label}sampled outcomes of zero target probability: {impossible[:10]}"
    possible = p > 0
    pvalue = chi_square_pvalue(observed[possible], p[possible])
    if pvalue <= alpha:
        n = observed.sum()
        expected = p / p.sum() * n
        z = (observed - expected) / np.sqrt(np.maximum(expected, 1e-12))
        worst = ", ".join(f"{outcomes[i]}: {observed[i]:g} vs {expected[i]:.1f}"
                          for i in np.argsort(-np.abs(z))[:5])
        raise AssertionError(f"{label}{n:g} samples do not follow the target distribution "
                             f"(chi-square p = {pvalue:.3g} <= {alpha:g}); observed vs expected: {worst}")
    return pvalue


# ---- sampling through an engine ------------------------------------------------------------------

def target_pair_distribution(model_path: str | Path, prompt_tokens: Sequence[int],
                             params: SamplingParams) -> dict[tuple[int, ...], float]:
    """Exact p(t1, t2) of the target after ``prompt_tokens``, over every pair of nonzero probability,
    as plain decoding's answers begin: rows from one-token decodes (a batched row may move a token
    across a top-p or min-p cutoff), and an end-of-generation token ends the answer there (``(t1,)`` or
    ``()``: it is never emitted)."""
    model = Model(model_path)
    ctx = Context(model, ContextParams(n_ctx=256, n_batch=64, n_seq_max=1, n_threads=1))
    try:
        kv = KVCache(ctx)
        prompt = list(prompt_tokens)
        eog = set(model.eog_tokens)

        def next_distribution(tokens: list[int]) -> np.ndarray:
            kv.sync_to(tokens[:-1])
            return distribution(np.array(kv.decode_step(tokens[-1])[0]), params)

        joint: dict[tuple[int, ...], float] = {}

        def add(answer: tuple[int, ...], p: float) -> None:
            joint[answer] = joint.get(answer, 0.0) + p

        p1 = next_distribution(prompt)
        for t1 in map(int, np.nonzero(p1)[0]):
            if t1 in eog:
                add((), p1[t1])
                continue
            p2 = next_distribution(prompt + [t1])
            for t2 in map(int, np.nonzero(p2)[0]):
                add((t1,) if t2 in eog else (t1, t2), p1[t1] * p2[t2])
        return joint
    finally:
        ctx.close()
        model.close()


def assert_greedy_equals_vanilla(engine: "Engine", prompts: Sequence[str], method: str,
                                 max_tokens: int = 32, **generate_kwargs: Any) -> "GenerationResult":
    """Each prompt answered by ``method`` token for token as by vanilla decoding (greedy), the cache left
    holding committed tokens only; returns the last answer."""
    for prompt in prompts:
        base = engine.generate(prompt, max_tokens=max_tokens, method="vanilla")
        res = engine.generate(prompt, max_tokens=max_tokens, method=method, **generate_kwargs)
        assert res.tokens == base.tokens, (method, prompt)
        assert res.text == base.text
        # the cache holds exactly the committed tokens but the uncached last one, and the end token that
        # ended the answer where a draft had it (decoded with the draft, not emitted)
        committed = engine.prompt_tokens(prompt) + res.tokens
        cached = engine.kv.cached
        if len(cached) > len(committed) and res.finish_reason == "stop":
            assert len(cached) == len(committed) + 1 and cached[-1] in engine.target.eog_tokens, (method, prompt)
            cached = cached[:-1]
        assert cached == committed[:len(cached)], (method, prompt)
    return res


def copyable(engine: "Engine", prompt: str | Sequence[int]) -> list[int]:
    """The prompt, its greedy answer (12 tokens) and the prompt again: tokens a copying drafter drafts
    from and the target often accepts, also when sampling."""
    tokens = engine.prompt_tokens(prompt)
    return tokens + engine.generate(tokens, max_tokens=12).tokens + tokens


def assert_seeded_equals_vanilla(engine: "Engine", prompts: Sequence[str], method: str = "auto",
                                 seeds: Sequence[int] = (0, 1, 2)) -> list["GenerationResult"]:
    """Seeded answers of ``method`` (drafting deterministically, as every method but a draft model
    that samples does) as seeded vanilla's, token for token: each emitted token consumes one uniform,
    however it was drafted. On copyable prompts (``copyable``); returns ``method``'s answers."""
    answers = []
    for seed in seeds:
        prompt = copyable(engine, prompts[seed % len(prompts)])
        sp = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, seed=seed)
        base = engine.generate(prompt, max_tokens=30, method="vanilla", sampling=sp)
        answers.append(engine.generate(prompt, max_tokens=30, method=method, sampling=sp))
        assert answers[-1].tokens == base.tokens, (method, seed)
    return answers


def seeded_generations(engine: "Engine", prompt: str, params: SamplingParams, n: int,
                       **generate_kwargs: Any) -> list["GenerationResult"]:
    """``n`` generations of ``prompt`` with seeds 0 .. n-1 (``params`` otherwise)."""
    return [engine.generate(prompt, sampling=replace(params, seed=seed), **generate_kwargs)
            for seed in range(n)]


def assert_first_pairs_follow_the_target(engine: "Engine", model_path: str | Path, prompt: str,
                                         params: SamplingParams, n: int, **generate_kwargs: Any
                                         ) -> list["GenerationResult"]:
    """Generate ``n`` seeded answers (two tokens unless ``max_tokens`` says otherwise) and assert
    that their first two tokens follow the target's exact joint distribution; returns the answers."""
    joint = target_pair_distribution(model_path, engine.prompt_tokens(prompt), params)
    generate_kwargs.setdefault("max_tokens", 2)
    results = seeded_generations(engine, prompt, params, n, **generate_kwargs)
    counts = Counter(tuple(r.tokens[:2]) for r in results)
    assert_follows(counts, joint, what=str(generate_kwargs.get("method", "vanilla")))
    return results
