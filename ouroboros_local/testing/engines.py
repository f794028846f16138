"""An engine on tiny generated models, set up the way the tests want it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..engine import Engine, EngineConfig
from ..llama import Model

# prompts for end-to-end tests on the tiny models: one repeats itself (copies pay), one does not
E2E_PROMPTS = ["def add(a, b):\n    return a + b\n\ndef add(a, b):\n",
               "The quick brown fox jumps over the lazy dog. The quick brown"]


def tiny_engine(target: str | Path, draft: str | Path | None = None, **cfg: Any) -> Engine:
    """A small context, flat costs and fixed hyperparameters unless ``cfg`` says otherwise; one thread
    (tiny models gain nothing from two, and tests run beside each other on 2 cores); the KV invariant
    checked after every round."""
    config = EngineConfig(n_ctx=cfg.pop("n_ctx", 512), n_batch=cfg.pop("n_batch", 64),
                          n_seq_max=cfg.pop("n_seq_max", 8), calibration=cfg.pop("calibration", "off"),
                          adaptive=cfg.pop("adaptive", False), threads=cfg.pop("threads", 1), **cfg)
    engine = Engine(Model(target), Model(draft) if draft else None, config)
    engine.check_kv = True
    if config.calibration == "off":
        # the flat curve stays flat: a tiny model's rounds are Python-bound (a drafted one ~3x a plain
        # one), and learning their times would make the tests' drafting depend on the machine's timing
        engine.scheduler().observe_round = lambda n_tokens, seconds: None
    return engine
