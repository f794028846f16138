"""Rounds of one size (EngineConfig.round_size): short chains filled with guesses, outputs unchanged, and
llama.cpp's graph reused from round to round (what keeps a CUDA build on its CUDA graph)."""

from __future__ import annotations

import pytest

from ouroboros_local.calibration import CostModel
from ouroboros_local.engine import Engine, filled
from ouroboros_local.engine_config import CUDA_ROUND_SIZE, default_round_size
from ouroboros_local.proposers import method_names
from ouroboros_local.sampling import SamplingParams
from ouroboros_local.scheduler import Scheduler
from ouroboros_local.testing.engines import tiny_engine
from ouroboros_local.testing.lossless import (assert_first_pairs_follow_the_target,
                                              assert_greedy_equals_vanilla)
from ouroboros_local.tree import TokenTree

PROMPTS = ["def add(a, b):\n    return a + b\n\ndef add(a, b):\n",
           "The quick brown fox jumps over the lazy dog. The quick brown"]


@pytest.fixture(scope="module")
def round_engine(tiny_target, tiny_draft):
    engine = tiny_engine(tiny_target, tiny_draft, round_size=4)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def gpu_defaults_engine(tiny_target, tiny_draft):
    """What a CUDA GPU runs by default, on the CPU: rounds of 4 drafting while they decode, the costs
    calibrated (so the round switch sizes rounds), the scheduler on."""
    engine = tiny_engine(tiny_target, tiny_draft, round_size=4, overlap=True, calibration="auto",
                         adaptive=True)
    yield engine
    engine.close()


@pytest.mark.parametrize("method", [m for m in method_names() if m != "vanilla"])
def test_every_method_is_greedy_lossless_in_rounds_of_one_size(round_engine: Engine, method: str) -> None:
    assert_greedy_equals_vanilla(round_engine, PROMPTS, method)


@pytest.mark.parametrize("method", [m for m in method_names() if m != "vanilla"])
def test_every_method_runs_under_a_gpus_defaults(gpu_defaults_engine: Engine, method: str) -> None:
    """Greedy and sampled: paths only a GPU takes by default (``speculative`` raised on every request
    there until dd7760d, and no test ran it)."""
    assert_greedy_equals_vanilla(gpu_defaults_engine, PROMPTS, method)
    sampled = gpu_defaults_engine.generate(PROMPTS[1], max_tokens=16, method=method,
                                           sampling={"temperature": 0.8, "seed": 5})
    assert sampled.stats.tokens == 16


@pytest.mark.parametrize("method", ["prompt-lookup", "speculative"])
def test_filled_rounds_sample_the_target_distribution(round_engine: Engine, tiny_target, method: str) -> None:
    params = SamplingParams(temperature=1.0, top_k=6, top_p=1.0, min_p=0.0)
    assert_first_pairs_follow_the_target(round_engine, tiny_target, PROMPTS[1], params, 1200, method=method)


def test_rounds_of_one_size_reuse_the_graph(tiny_target) -> None:
    """Each decode of another shape makes llama.cpp build a graph (a CUDA build: run without its CUDA
    graph); in rounds of one size only a request's first rounds and its last, shortened ones do."""
    rebuilt = {}
    for size in (0, 4):
        with tiny_engine(tiny_target, round_size=size) as engine:
            res = engine.generate(PROMPTS[0] * 3, max_tokens=48, method="prompt-lookup",
                                  options={"max_ngram": 3})
            rebuilt[size] = res.stats.extra["graphs_rebuilt"], res.stats.target_passes
    assert rebuilt[4][0] <= 6 < rebuilt[4][1]
    assert rebuilt[4][0] < rebuilt[0][0]


@pytest.mark.parametrize("max_tokens", [47, 50])
def test_the_last_rounds_of_an_answer_keep_the_size(tiny_target, max_tokens: int) -> None:
    """A budget that ends inside a round does not shorten it (a new shape rebuilds the graph, on a GPU
    ~2 steps): what passes the budget is cut from the answer, which stays vanilla's."""
    with tiny_engine(tiny_target, round_size=4) as engine:
        engine.generate(PROMPTS[0], max_tokens=8, method="prompt-lookup")   # the first request's graphs
        base = engine.generate(PROMPTS[0] * 3, max_tokens=max_tokens, method="vanilla")
        res = engine.generate(PROMPTS[0] * 3, max_tokens=max_tokens, method="prompt-lookup",
                              options={"max_ngram": 3})
    assert res.tokens == base.tokens and len(res.tokens) == max_tokens
    assert res.stats.extra["graphs_rebuilt"] <= 1 and res.stats.accepted < max_tokens


def test_the_time_split_counts_filled_rounds_without_a_draft_as_plain(round_engine: Engine) -> None:
    """A round filled with guesses but no draft is a plain step of four tokens, and no one-token step
    follows a larger decode (the last rounds of an answer keep the size too)."""
    res = round_engine.generate(PROMPTS[0] * 3, max_tokens=47, method="prompt-lookup", options={"max_ngram": 3})
    split = res.stats.extra["time_split"]
    assert split["drafted"][0] >= 1 and split["plain"][0] >= 1 and split["carried"][0] == 0
    assert split["after_draft"][0] == 0
    assert split["plain"][0] + split["drafted"][0] + split["after_draft"][0] == res.stats.target_passes


def test_a_chain_is_filled_from_the_context_and_a_tree_is_left_alone() -> None:
    chain = TokenTree.rooted_at(5)
    chain.add_path(0, [6], source="prompt-lookup")
    out = filled(chain, 5, context=[1, 6, 7, 8, 2, 3, 5])
    assert out.tokens == [5, 6, 7, 8, 2] and out.sources[2] == "fill" and out.sources[1] == "prompt-lookup"
    assert chain.tokens == [5, 6]                          # the proposer's tree is not changed
    assert filled(chain, 4, context=[9, 9]).tokens == [5, 6, 6, 6]   # nothing to copy: the last token again
    tree = TokenTree.rooted_at(5)
    tree.add_path(0, [6])
    tree.add_path(0, [7])
    assert filled(tree, 6, context=[6, 1, 2]) is tree
    assert filled(chain, 2, context=[]) is chain


def test_in_rounds_of_one_size_drafting_up_to_it_costs_nothing_more() -> None:
    curve = CostModel(sizes=[1, 2, 4, 8, 16], seconds=[1.0, 3.0, 3.2, 3.5, 5.0], switch_seconds=2.0)
    rounds = curve.with_rounds_of(4, 1.1)
    assert [rounds.cost(n) for n in (1, 2, 3, 4)] == pytest.approx([1.1] * 4)
    assert rounds.cost(8) == pytest.approx(3.5) and rounds.round_size == 4
    seconds = Scheduler(rounds).round_seconds(7)
    assert seconds[:4] == pytest.approx([1.1] * 4)           # no switch: the shape never changes
    assert seconds[7] == pytest.approx(3.5 + 2.0)            # a larger tree changes it


def test_the_engine_prices_rounds_of_its_size(tiny_target) -> None:
    with tiny_engine(tiny_target, round_size=4, calibration="auto") as engine:
        costs = engine.scheduler().costs
        assert costs.round_size == 4 and costs.cost(1) == costs.cost(4)


def test_round_size_is_checked_before_anything_loads(capsys) -> None:
    from ouroboros_local.cli import main

    for bad in ("1", "four", "65"):   # 65: more than --batch-size's 64
        assert main(["generate", "-m", "no-such-model.gguf", "--round-size", bad, "-b", "64", "-p", "hi"]) != 0
        assert "--round-size must be auto, 0 or 2 to 64 (--batch-size and --ctx-size)" in capsys.readouterr().err


class _Target:
    """What ``default_round_size`` reads of a model."""

    def __init__(self, n_gpu_layers: int, n_layer: int = 24):
        self.n_gpu_layers, self.n_layer = n_gpu_layers, n_layer


@pytest.mark.parametrize("layers, device, n_batch, expected", [
    (-1, "CUDA0", 512, CUDA_ROUND_SIZE),   # every layer on a CUDA GPU: its graphs want one shape
    (25, "CUDA0", 512, CUDA_ROUND_SIZE),   # 24 layers and the output layer
    (24, "CUDA0", 512, 0),                 # the output layer on the CPU: rounds cost what their tokens do
    (0, "CUDA0", 512, 0),
    (-1, "Metal", 512, 0),                 # no CUDA graphs: measured only on CUDA
    (-1, "CUDA0", 2, 0),                   # a batch smaller than a round
])
def test_rounds_of_one_size_are_the_default_where_the_whole_target_is_on_a_cuda_gpu(
        monkeypatch, layers: int, device: str, n_batch: int, expected: int) -> None:
    import ouroboros_local.engine_config as config_mod
    from ouroboros_local.llama import Device

    monkeypatch.setattr(config_mod, "supports_gpu_offload", lambda: True)
    monkeypatch.setattr(config_mod, "devices", lambda: [Device(device, "a GPU", "gpu", 1, 2),
                                                           Device("CPU", "a CPU", "cpu", 1, 2)])
    assert default_round_size(_Target(layers), n_batch) == expected


@pytest.mark.parametrize("error", [AttributeError("libggml has no ggml_backend_dev_count"),
                                   FileNotFoundError("Shared library with base name 'ggml' not found")])
def test_devices_that_cannot_be_listed_leave_rounds_their_drafts_size_and_say_so(
        monkeypatch, caplog, error: Exception) -> None:
    """Not silently: the seventh H200 run lost its rounds of 4 to a libggml that was not found."""
    import ouroboros_local.engine_config as config_mod

    def no_device_api():
        raise error

    monkeypatch.setattr(config_mod, "supports_gpu_offload", lambda: True)
    monkeypatch.setattr(config_mod, "devices", no_device_api)
    with caplog.at_level("WARNING", logger="ouroboros_local"):
        assert default_round_size(_Target(-1), 512) == 0
    assert f"--round-size {CUDA_ROUND_SIZE}" in caplog.text and str(error) in caplog.text


def test_an_engine_left_to_decide_runs_rounds_of_their_drafts_size_on_a_cpu(tiny_target) -> None:
    """CI's CPU build: the default leaves each round its draft's size, and says so in the config the
    bench reports; a size given by hand stays."""
    with tiny_engine(tiny_target) as engine:
        assert engine.config.round_size == 0 and engine.round_size == 0
    with tiny_engine(tiny_target, round_size=4) as engine:
        assert engine.config.round_size == 4


def test_in_rounds_of_one_size_auto_asks_its_free_drafters_unpriced(round_engine: Engine, monkeypatch) -> None:
    """A draft that fits the round costs nothing more: prompt lookup and the suffix tries draft every
    round without the scheduler's pricing, and the chain expected to keep more is verified."""
    priced: list[str] = []
    draft_if_any = Scheduler.draft_if_any

    def spy(self, proposer, committed, budget):
        priced.append(proposer.name)
        return draft_if_any(self, proposer, committed, budget)

    prompt = round_engine.prompt_tokens(PROMPTS[1])
    prompt = prompt + round_engine.generate(prompt, max_tokens=32).tokens + prompt   # its answer repeats
    monkeypatch.setattr(Scheduler, "draft_if_any", spy)
    res = round_engine.generate(prompt, max_tokens=32, method="auto")
    assert not {"prompt-lookup", "suffix"} & set(priced)            # only the draft model is priced
    rounds = res.stats.extra["auto_rounds"]
    assert rounds.get("prompt-lookup", 0) + rounds.get("suffix", 0) >= 3
    assert res.stats.target_passes < len(res.tokens) / 2


def test_a_branching_free_draft_gives_its_first_path() -> None:
    from ouroboros_local.proposers.pick import _first_chain

    tree = TokenTree.rooted_at(0)
    tree.add_path(0, [1, 2, 3])
    tree.add_path(1, [4])
    tree.classes.update({1: "a", 2: "b", 4: "c"})
    chain = _first_chain(tree)
    assert chain.tokens == [0, 1, 2, 3] and chain.is_chain() and chain.classes == {1: "a", 2: "b"}
    plain = TokenTree.rooted_at(0)
    plain.add_path(0, [5, 6])
    assert _first_chain(plain) is plain
    # grown best first (a suffix tree): a second child of the root can be the lowest-numbered leaf
    best_first = TokenTree.rooted_at(0)
    best_first.add(0, 1)
    best_first.add(0, 2)
    best_first.add(1, 3)
    best_first.add(3, 4)
    assert _first_chain(best_first).tokens == [0, 1, 3, 4]


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("method", ["speculative", "ouroboros"])
def test_priced_draft_models_in_rounds_of_one_size_stay_lossless(tiny_target, tiny_draft, overlap: bool,
                                                                 method: str) -> None:
    """A draft model priced by the scheduler in rounds of one size (a CUDA GPU's default), beside a
    GPU-like flat curve so that it drafts: drafted while the round decodes (overlap) or before it."""
    draft = CostModel(sizes=[1, 2, 4, 8, 16], seconds=[0.020, 0.037, 0.049, 0.089, 0.123])
    with tiny_engine(tiny_target, tiny_draft, round_size=4, adaptive=True, overlap=overlap) as engine:
        engine._scheduler = Scheduler(CostModel(sizes=[1, 16], seconds=[0.035, 0.04]).with_rounds_of(4, 0.035),
                                      draft_costs=draft)
        engine._scheduler.observe_round = lambda n_tokens, seconds: None   # tiny models' times aside
        res = assert_greedy_equals_vanilla(engine, PROMPTS, method, max_tokens=40)
    assert res.stats.drafted > 0


def test_a_generation_counts_the_draft_models_graph_rebuilds(tiny_target, tiny_draft) -> None:
    """The draft model's context alternates catch-up batches and one-token steps, and each change of
    shape rebuilds its graph (on a CUDA build: a decode without its CUDA graph): counted per generation
    as [decodes, rebuilt], absent where no draft model decoded."""
    with tiny_engine(tiny_target, tiny_draft) as engine:
        plain = engine.generate(PROMPTS[0], max_tokens=24, method="vanilla")
        res = engine.generate(PROMPTS[0], max_tokens=24, method="speculative", options={"gamma": 4})
    decodes, rebuilt = res.stats.extra["draft_graphs"]
    assert decodes >= res.stats.extra["draft_steps"] > 0 and 0 < rebuilt < decodes
    assert "draft_graphs" not in plain.stats.extra
