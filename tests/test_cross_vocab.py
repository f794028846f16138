"""Cross-vocabulary drafting: a draft whose tokenizer differs from the target's, bridged through text.

Tiny generated models with different vocabularies ("a": 509 tokens, specials last; "b": 409 tokens,
specials first, other merges; "s": a SentencePiece that puts a space before its text) prove exactness:
the target decides every token, so greedy output equals plain decoding and seeded sampling reproduces
plain sampling. A slow test runs the real pair
(SmolLM2-135M drafting for Qwen2.5-Coder-1.5B) and checks that drafts are accepted.
"""

from __future__ import annotations

import numpy as np
import pytest

from ouroboros_local import pairs
from ouroboros_local.engine import Engine
from ouroboros_local.errors import IncompatiblePairError
from ouroboros_local.llama import Model
from ouroboros_local.sampling import SamplingParams
from ouroboros_local.testing.lossless import assert_greedy_equals_vanilla
from ouroboros_local.text_bridge import (DraftView, adds_space_prefix, is_chunk_start, target_confidences,
                                         text_to_target, tokenize_spelled, valid_utf8_prefix)

from test_engine import PROMPTS, make_engine

CROSS_PROMPTS = PROMPTS + [
    "<|im_start|>user\nWrite a function.<|im_end|>\n<|im_start|>assistant\n",
    "naïve café — ünïcödé 𝄞 déjà vu, déjà vu",
]


@pytest.fixture(scope="module")
def cross_engine(tiny_target, tiny_other_vocab):
    engine = make_engine(tiny_target, tiny_other_vocab)
    yield engine
    engine.close()


@pytest.fixture(scope="module", params=["bpe", "sentencepiece draft", "sentencepiece target",
                                        "two sentencepieces"])
def bridged_engine(request, tiny_target, tiny_other_vocab, tiny_sentencepiece, tiny_other_sentencepiece):
    """A pair of each kind: BPE for BPE, and a SentencePiece that puts a space before its text on
    either side or on both."""
    target, draft = {"bpe": (tiny_target, tiny_other_vocab),
                     "sentencepiece draft": (tiny_target, tiny_sentencepiece),
                     "sentencepiece target": (tiny_sentencepiece, tiny_target),
                     "two sentencepieces": (tiny_sentencepiece, tiny_other_sentencepiece)}[request.param]
    engine = make_engine(target, draft)
    yield engine
    engine.close()


@pytest.fixture(scope="module", params=["bpe", "sentencepiece", "two sentencepieces"])
def models(request, tiny_target, tiny_other_vocab, tiny_sentencepiece, tiny_other_sentencepiece):
    """A target and a draft of another vocabulary: BPE ("a") for BPE ("b") or SentencePiece ("s"), or
    SentencePiece ("s") for SentencePiece ("t"), both putting a space before their text."""
    paths = {"bpe": (tiny_target, tiny_other_vocab), "sentencepiece": (tiny_target, tiny_sentencepiece),
             "two sentencepieces": (tiny_sentencepiece, tiny_other_sentencepiece)}[request.param]
    target, draft = Model(paths[0], vocab_only=True), Model(paths[1], vocab_only=True)
    yield target, draft
    target.close()
    draft.close()


def _tokenizer(model: Model):
    return lambda text: model.tokenize(text, add_special=False, parse_special=False)


# ---- pieces ---------------------------------------------------------------------------------------

def test_chunk_boundaries_and_utf8_prefix() -> None:
    buf = b"def f(x):\n    return x + 1"
    assert is_chunk_start(buf, 0)
    assert is_chunk_start(buf, 3)                  # space after "def"
    assert not is_chunk_start(buf, 4)              # inside a word
    assert not is_chunk_start(buf, 11)             # space after a newline belongs to the indent
    assert is_chunk_start(b"a\nb", 2)              # non-space after a newline
    assert not is_chunk_start(b"a  b", 2)          # the second of two spaces
    assert valid_utf8_prefix("é".encode()) == 2
    assert valid_utf8_prefix("aé".encode()[:2]) == 1   # a cut two-byte character
    assert valid_utf8_prefix("𝄞".encode()[:3]) == 0


def test_pair_is_detected_and_reported(cross_engine: Engine, tiny_target, tiny_other_vocab,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    target, draft = cross_engine.target, cross_engine.draft
    assert cross_engine.pair_compatible is False
    assert "differs" in (cross_engine.pair_reason or "")
    assert pairs.check_pair(target.path, target.path).reason is None
    assert pairs.check_pair(target.path, draft.path).reason == cross_engine.pair_reason
    monkeypatch.setattr(pairs, "MAX_VOCAB_SIZE_DIFFERENCE", 50)
    assert "size 409 vs 509" in (pairs.check_pair(target.path, draft.path).reason or "")


@pytest.mark.parametrize("vocab", ["bpe", "sentencepiece"])
def test_text_to_target_keeps_only_stable_tokens(request, vocab: str) -> None:
    path = request.getfixturevalue("tiny_target" if vocab == "bpe" else "tiny_sentencepiece")
    target = Model(path, vocab_only=True)
    tokenize = _tokenizer(target)
    adds_space = adds_space_prefix(tokenize, target.piece)
    assert adds_space == (vocab == "sentencepiece")
    # the SentencePiece spells the text with a space before it: the committed text does too
    full = (" " if adds_space else "") + "    return a + b\n\ndef add(a, b):"
    ids = tokenize(full[1:] if adds_space else full)
    assert b"".join(target.piece(t) for t in ids) == full.encode()
    for anchor in (b"    return", b"    return a +"):
        anchor = (b" " if adds_space else b"") + anchor
        # a split that falls on a token boundary of the full tokenization
        cut, acc = None, 0
        for j, tok in enumerate(ids):
            acc += len(target.piece(tok))
            if acc == len(anchor):
                cut = j + 1
        assert cut is not None
        rest = full.encode()[len(anchor):]
        out, complete = text_to_target(tokenize, target.piece, anchor, rest, adds_space=adds_space)
        assert out == ids[cut:-1] and not complete         # the last token may still grow: dropped
        out, complete = text_to_target(tokenize, target.piece, anchor, rest, closed=True,
                                       adds_space=adds_space)
        assert out == ids[cut:] and complete
    # a partial UTF-8 character at the end is cut off, never turned into a replacement character
    out, complete = text_to_target(tokenize, target.piece, b"x", " é".encode()[:2], closed=True,
                                   adds_space=adds_space)
    assert not complete and b"".join(target.piece(t) for t in out) in (b"", b" ")
    target.close()


def test_text_spelled_by_a_tokenizer_that_puts_a_space_before_it(tiny_sentencepiece) -> None:
    model = Model(tiny_sentencepiece, vocab_only=True)
    tokenize = _tokenizer(model)

    def spelled(text: bytes, continues: bool) -> tuple[bytes, int]:
        tokens, offset = tokenize_spelled(tokenize, model.piece, text, True, continues)
        return b"".join(model.piece(t) for t in tokens), offset

    assert spelled(b"the sea", False) == (b" the sea", -1)       # the whole text: as llama.cpp has it
    assert spelled(b" the sea", True) == (b" the sea", 0)        # the text's own space is the prefix
    text, offset = spelled(b"sea", True)                         # no space to stand for: one is spelled
    assert text == b" sea" and offset == -1
    model.close()


@pytest.mark.parametrize("text", CROSS_PROMPTS)
def test_incremental_view_equals_full_retokenization(models, text: str) -> None:
    target, draft = models
    tokens = target.tokenize(text, add_special=True, parse_special=True)
    view = DraftView(target, draft)
    for tok in tokens:                      # one committed target token at a time
        view.extend([tok])
    # the reference: draft tokenization of the same text, specials mapped to the draft's own ids
    expected = draft.tokenize(text, add_special=True, parse_special=True)
    assert view.tokens == expected
    assert view.n_target == len(tokens)


def test_a_long_run_without_word_boundaries_restarts_on_a_character(models) -> None:
    # no space or newline for far more than the backtrack: the re-tokenization restarts after a draft token
    # whose bytes may end inside a character (once a UnicodeDecodeError)
    target, draft = models
    text = "日本語のテキストです" * 60     # 1800 bytes: more than a SentencePiece draft looks back for a space
    tokens = target.tokenize(text, add_special=False)
    view = DraftView(target, draft)
    for i in range(0, len(tokens), 3):
        view.extend(tokens[i:i + 3])
    assert view.inexact_restarts > 0
    seen, committed = draft.detokenize(view.tokens), target.detokenize(tokens)
    if view.adds_space:   # a restart there, and the run's start, spell the space a SentencePiece puts first
        seen, committed = seen.replace(" ", ""), committed.replace(" ", "")
    assert seen == committed


def test_a_long_run_without_spaces_is_read_as_it_is(models) -> None:
    """A URL longer than the backtrack: a SentencePiece draft that puts a space before its text restarts
    at the space before it, not inside it (each restart there once spelled one space more: a 500-byte URL
    read with 203 spaces)."""
    target, draft = models
    url = "https://example.com/" + "abc/" * 120
    for text in ("see " + url + "x and more words after it\n", url + " at the run's start"):
        tokens = target.tokenize(text, add_special=False)
        view = DraftView(target, draft)
        for tok in tokens:
            view.extend([tok])
        if view.adds_space:
            assert view.inexact_restarts == 0, text
            assert view.tokens == draft.tokenize(text, add_special=True, parse_special=False)


def test_the_view_costs_the_new_text_not_the_context(models) -> None:
    """Each committed token re-tokenizes a chunk, not the text so far. (A SentencePiece draft that puts
    a space before its text once spelled one byte too many, and then re-tokenized the whole text at
    every token: 2.0 ms a token at 2k tokens, 9.6 ms at 7k, Qwen2.5 committing for vocabulary "s".)"""
    target, draft = models
    text = " ".join(f"value_{i} = compute(x, {i}) + 1\n" for i in range(300))
    tokens = target.tokenize(text, add_special=False)
    view = DraftView(target, draft)
    for tok in tokens:
        view.extend([tok])
    assert view.exact and view.inexact_restarts == 0
    assert view.retokenized_bytes < 16 * len(text.encode())   # whole re-tokenizations: ~len(tokens) / 2 times
    assert view.tokens == draft.tokenize(text, add_special=True, parse_special=False)


# ---- exactness in the engine ----------------------------------------------------------------------

@pytest.mark.parametrize("method", ["speculative", "ouroboros", "auto"])
def test_greedy_equals_vanilla(bridged_engine: Engine, method: str) -> None:
    res = assert_greedy_equals_vanilla(bridged_engine, CROSS_PROMPTS, method, options={"gamma": 5})
    if method != "auto":
        assert res.stats.extra["cross_vocab"] is True
        assert res.stats.drafted > 0


@pytest.mark.parametrize("method", ["ouroboros", "speculative", "auto"])
def test_a_prompt_the_draft_sees_no_text_of(cross_engine: Engine, method: str) -> None:
    """A prompt of the target's BOS alone is no text to the draft: ouroboros's window drew its guesses
    from an empty prompt and raised a numpy ValueError."""
    prompt = [cross_engine.target.bos]
    assert cross_engine.generate(prompt, max_tokens=8, method=method).tokens == \
        cross_engine.generate(prompt, max_tokens=8).tokens


def test_auto_leaves_the_draft_model_idle_until_it_drafts(cross_engine: Engine) -> None:
    """speculative prefills the draft model in begin (counted as prefill); auto and ouroboros do not,
    as they may never ask the draft model: it catches up when it first drafts, timed apart."""
    from ouroboros_local.proposers import create_proposer
    from ouroboros_local.proposers.base import ProposeSetup

    prompt = cross_engine.prompt_tokens(CROSS_PROMPTS[0])
    setup = ProposeSetup(sampling=SamplingParams(), rng=np.random.default_rng(0), max_tree_nodes=31,
                         max_branches=4, eog_tokens=cross_engine.target.eog_tokens)
    kv = cross_engine.draft_kv()
    for method, prefilled in (("speculative", True), ("ouroboros", False), ("auto", False)):
        kv.reset()
        proposer = create_proposer(method, cross_engine.drafting_context(), {})
        drafter = getattr(proposer, "candidates", [proposer])[-1]
        proposer.begin(prompt, setup)
        assert (kv.n_past > 0) == prefilled, method
        drafter.propose(prompt, 3)
        assert kv.n_past >= len(drafter.view.tokens) - 1
        if not prefilled:
            assert drafter.catch_up_seconds > 0
        if method == "ouroboros":
            continue        # observe() needs a verification (test_ouroboros covers the rest)
        drafter.observe(prompt, None)
        drafter.propose(prompt, 3)                 # drafted the round before: nothing to catch up
        assert drafter.catch_up_seconds == 0.0


def test_a_draft_of_another_vocabulary_that_cannot_pay_never_reads_the_prompt(tiny_target, tiny_other_vocab) -> None:
    """Its drafting cost had no floor before it was timed: SmolLM2-135M with Qwen-0.5B's draft (3 target
    steps a draft token) read the prompt and drafted, at 0.52x of plain decoding. Planted curves of that
    kind retire it at once, for speculative, ouroboros and auto; a cheap draft is still asked."""
    from ouroboros_local.calibration import CostModel
    from ouroboros_local.scheduler import Scheduler

    target = CostModel(sizes=[1, 2, 4, 8, 16], seconds=[0.020, 0.026, 0.032, 0.045, 0.070])
    dear = CostModel(sizes=[1, 2, 4, 8, 16], seconds=[0.060, 0.070, 0.090, 0.120, 0.180])
    engine = make_engine(tiny_target, tiny_other_vocab, adaptive=True)
    try:
        base = engine.generate(CROSS_PROMPTS[0], max_tokens=16)
        for method in ("speculative", "ouroboros", "auto"):
            engine._scheduler = Scheduler(target, draft_costs=dear)
            engine._scheduler.observe_round = lambda n_tokens, seconds: None
            engine.draft_kv().reset()
            out = engine.generate(CROSS_PROMPTS[0], max_tokens=16, method=method)
            assert out.tokens == base.tokens
            assert engine.draft_kv().n_past == 0, (method, out.stats.extra)   # never read a token
            assert out.stats.extra["draft_ceiling"], method
        engine._scheduler = Scheduler(CostModel(sizes=[1, 16], seconds=[0.020, 0.021]),
                                      draft_costs=CostModel(sizes=[1, 16], seconds=[0.001, 0.002]))
        engine._scheduler.observe_round = lambda n_tokens, seconds: None
        out = engine.generate(CROSS_PROMPTS[0], max_tokens=16, method="speculative")
        assert out.tokens == base.tokens and "draft_ceiling" not in out.stats.extra and out.stats.drafted > 0
    finally:
        engine.close()


def test_chat_prompt_with_specials(cross_engine: Engine) -> None:
    base = cross_engine.generate("Say hi.", chat=True, max_tokens=24, method="vanilla")
    for method in ("speculative", "ouroboros"):
        res = cross_engine.generate("Say hi.", chat=True, max_tokens=24, method=method)
        assert res.tokens == base.tokens


def test_seeded_sampling_reproduces_plain_sampling(cross_engine: Engine) -> None:
    # Deterministic drafts are checked by sample-and-match: each emitted token is the target's own
    # sample and consumes one uniform, exactly as plain sampling does with the same seed.
    for seed in range(6):
        sp = SamplingParams(temperature=0.9, top_k=20, top_p=0.95, min_p=0.0, seed=seed)
        base = cross_engine.generate(PROMPTS[seed % 3], max_tokens=24, method="vanilla", sampling=sp)
        for method in ("speculative", "ouroboros"):
            res = cross_engine.generate(PROMPTS[seed % 3], max_tokens=24, method=method, sampling=sp)
            assert res.tokens == base.tokens, (method, seed)


def test_pearl_refuses_another_vocabulary(cross_engine: Engine) -> None:
    with pytest.raises(IncompatiblePairError, match="pearl needs a draft with the target's vocabulary"):
        cross_engine.generate("x", method="pearl")


@pytest.mark.parametrize("method", ["speculative", "auto"])
def test_same_vocabulary_draft_settings_are_refused_not_ignored(cross_engine: Engine, method: str) -> None:
    """AdaEDL, p_min and sampled drafts were taken and ignored: the bridged drafter drafts greedily, in full."""
    for options in ({"adaedl": True}, {"p_min": 0.3}, {"adaedl": True, "adaedl_lambda": 0.5}):
        with pytest.raises(IncompatiblePairError, match="not for a draft of another vocabulary"):
            cross_engine.generate("hello there", method=method, max_tokens=2, options=options)
    if method == "speculative":
        with pytest.raises(IncompatiblePairError, match="greedy_draft"):
            cross_engine.generate("hello there", method=method, max_tokens=2, options={"greedy_draft": False})
    assert cross_engine.generate("hello there", method=method, max_tokens=2, options={"gamma": 3}).tokens


def test_the_bridges_settings_are_refused_for_a_draft_of_the_same_vocabulary(tiny_target, tiny_draft) -> None:
    """map_specials and keep_unstable were taken, and did nothing, with a draft of the target's vocabulary."""
    from ouroboros_local.testing.engines import tiny_engine

    with tiny_engine(tiny_target, tiny_draft) as engine:
        for method in ("speculative", "auto"):
            for options in ({"keep_unstable": True}, {"map_specials": False}):
                with pytest.raises(IncompatiblePairError, match="only for a draft of another vocabulary"):
                    engine.generate("hello there", method=method, max_tokens=2, options=options)
            assert engine.generate("hello there", method=method, max_tokens=2, options={"map_specials": True}).tokens


@pytest.mark.parametrize("flags", [["--method", "pearl"], ["--method", "speculative", "--adaedl"],
                                   ["--method", "auto", "--p-min", "0.3"]])
def test_what_the_pair_refuses_is_refused_before_the_weights_load(tiny_target, tiny_other_vocab, capsys,
                                                                   flags) -> None:
    """The GGUF headers decide it: the command line said so only once both models had loaded (10-14 s for
    the 1.5B with SmolLM2)."""
    from ouroboros_local.cli import main

    assert main(["generate", "-m", str(tiny_target), "-d", str(tiny_other_vocab), "-p", "x", "-n", "2",
                 *flags]) == 2
    err = capsys.readouterr().err
    assert "vocabulary" in err and "loading" not in err, err


def test_oracle_draft_text_is_accepted(bridged_engine: Engine) -> None:
    """The conversion is right: text that continues the committed text comes back as the target's own
    tokens for it (the canonical tokenization), short of the last token, which may still grow. (A
    SentencePiece target's space before the text once shifted every offset: the tokens came back
    with a space too many or a token repeated.)"""
    from ouroboros_local.proposers.cross_vocab import CrossVocabProposer

    target = bridged_engine.target
    proposer = CrossVocabProposer(bridged_engine.draft_kv(), target, bridged_engine.draft)
    for text in CROSS_PROMPTS:
        full = target.tokenize(text, add_special=True, parse_special=False)
        k = len(full) // 2
        while valid_utf8_prefix(b"".join(target.piece(t) for t in full[:k])) < \
                len(b"".join(target.piece(t) for t in full[:k])):
            k += 1          # split between characters: inside one there is no token boundary
        proposer.view.reset()
        proposer.view.extend(full[:k])
        toks, _ = proposer.to_target(target.detokenize(full[k:]).encode())
        assert toks == full[k:k + len(toks)], text
        assert len(toks) >= len(full) - k - 2, text


# ---- the real pair --------------------------------------------------------------------------------

@pytest.mark.slow
def test_smollm2_drafts_for_qwen() -> None:
    from ouroboros_local.compare import compare_greedy
    from ouroboros_local.engine import EngineConfig
    from ouroboros_local.errors import ModelError

    try:
        # fixed drafts (adaptive off): on a small CPU the scheduler rightly drafts almost never, and this
        # test is about the bridged draft being verified and accepted
        engine = Engine.load("qwen2.5-coder-1.5b-instruct", "smollm2-135m-instruct",
                             config=EngineConfig(n_ctx=1024, adaptive=False), progress=False)
    except ModelError as exc:  # pragma: no cover - offline machine
        pytest.skip(f"real models unavailable: {exc}")
    with engine:
        assert engine.pair_compatible is False
        prompt = "Write a Python function that returns the n-th Fibonacci number."
        tokens = engine.prompt_tokens(prompt, chat=True)
        base = engine.generate(prompt, chat=True, max_tokens=48, method="vanilla")
        for method in ("speculative", "ouroboros"):
            res = engine.generate(prompt, chat=True, max_tokens=48, method=method)
            report = compare_greedy(engine, tokens, base.tokens, res.tokens)
            assert report.ok, (method, report)
            assert res.stats.extra["cross_vocab"] is True
            assert res.stats.accepted > 0, method        # the small model does predict the big one
            assert np.isfinite(res.stats.tokens_per_second)


def test_target_tokens_take_the_least_confident_overlapping_draft_token() -> None:
    # draft tokens "def", " f", "(x" with confidences; target tokens "de", "f f", "(", "x"
    pieces = {1: b"de", 2: b"f f", 3: b"(", 4: b"x"}
    conf = target_confidences([1, 2, 3, 4], pieces.__getitem__, [3, 2, 2], [0.99, 0.6, 0.9])
    assert conf == [0.99, 0.6, 0.9, 0.9]
    assert target_confidences([], pieces.__getitem__, [3], [0.5]) == []
