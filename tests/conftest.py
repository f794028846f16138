"""Shared pytest fixtures."""

from __future__ import annotations

from pathlib import Path

import pytest

from ouroboros_local.testing import write_tiny_model

# ---------------------------------------------------------------------------------------------
# Tiny generated GGUF models (session-scoped: each is written once, in ~0.1 s, never downloaded)
# ---------------------------------------------------------------------------------------------

# Draft = target weights + 2% (of each tensor's init std) fresh noise. Random tiny models have
# small top-1/top-2 margins, so agreement falls fast with noise: 0.01 -> ~92%, 0.02 -> ~87%,
# 0.03 -> ~78%, 0.1 -> ~40% greedy acceptance along the target's greedy path.
TINY_DRAFT_NOISE = 0.02


@pytest.fixture(scope="session")
def tiny_models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tiny_models")


@pytest.fixture(scope="session")
def tiny_target(tiny_models_dir: Path) -> Path:
    """Vocab "a" (509 tokens), seed 1, f32."""
    return write_tiny_model(tiny_models_dir / "target.gguf", vocab="a", seed=1)


@pytest.fixture(scope="session")
def tiny_draft(tiny_models_dir: Path) -> Path:
    """Perturbed copy of `tiny_target`: same vocab and shapes, high but imperfect agreement."""
    return write_tiny_model(
        tiny_models_dir / "draft.gguf", vocab="a", seed=2, base_seed=1, noise=TINY_DRAFT_NOISE
    )


@pytest.fixture(scope="session")
def tiny_noisy_draft(tiny_models_dir: Path) -> Path:
    """`tiny_target` + 10% noise (~57% of sampled draft tokens accepted): a wrong residual after a
    rejection moves enough probability to fail a distribution test (at 2% it hides in the noise)."""
    return write_tiny_model(tiny_models_dir / "noisy_draft.gguf", vocab="a", seed=5, base_seed=1, noise=0.1)


@pytest.fixture(scope="session")
def tiny_self_draft(tiny_models_dir: Path) -> Path:
    """Byte-identical to `tiny_target`, in its own file: every greedy draft token is accepted."""
    return write_tiny_model(tiny_models_dir / "self_draft.gguf", vocab="a", seed=1)


@pytest.fixture(scope="session")
def tiny_other_vocab(tiny_models_dir: Path) -> Path:
    """Vocab "b" (409 tokens, specials at ids 0-2): for cross-vocabulary tests and refusals."""
    return write_tiny_model(tiny_models_dir / "other_vocab.gguf", vocab="b", seed=3)


@pytest.fixture(scope="session")
def tiny_sentencepiece(tiny_models_dir: Path) -> Path:
    """Vocab "s": a Llama-2-style SentencePiece (a space put before the text, byte fallback, BOS)."""
    return write_tiny_model(tiny_models_dir / "sentencepiece.gguf", vocab="s", seed=4)


@pytest.fixture(scope="session")
def tiny_other_sentencepiece(tiny_models_dir: Path) -> Path:
    """Vocab "t": another Llama-2-style SentencePiece ("b"'s pieces), for pairs of two SentencePieces."""
    return write_tiny_model(tiny_models_dir / "other_sentencepiece.gguf", vocab="t", seed=6)


@pytest.fixture(scope="session")
def tiny_f16(tiny_models_dir: Path) -> Path:
    """Same weights as `tiny_target` stored as F16 (logits within ~0.03 of the f32 model)."""
    return write_tiny_model(tiny_models_dir / "target_f16.gguf", vocab="a", seed=1, dtype="f16")


# ---------------------------------------------------------------------------------------------
# Project fixtures (lead engineer): loaded models/contexts, engines, ... go below.
# ---------------------------------------------------------------------------------------------


@pytest.fixture(autouse=True, scope="session")
def _isolated_user_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Keep measured cost curves, and learned estimates, out of the user's cache. The estimates need
    this too: an engine of a module-scoped fixture saves them when it closes, after the per-test
    setting below is undone, and the test suite's 30-odd model pairs once pushed a user's own out of
    the file (it keeps 32): the next real run started from the priors."""
    import os

    session = tmp_path_factory.mktemp("calib")
    os.environ["OUROBOROS_CALIBRATION_FILE"] = str(session / "calibration.json")
    os.environ["OUROBOROS_ESTIMATES_FILE"] = str(session / "estimates.json")


@pytest.fixture(autouse=True)
def _isolated_estimates(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts without learned estimates and keeps what it learns to itself (learned.py)."""
    monkeypatch.setenv("OUROBOROS_ESTIMATES_FILE", str(tmp_path / "estimates.json"))
