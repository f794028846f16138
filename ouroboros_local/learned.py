"""What the scheduler learned from the text, kept across processes.

The scheduler decides from estimates it learns as it goes: how often each proposer's drafts are accepted,
per depth and per confidence class (a copy after a 16-token match is right far more often than after a
1-token one). A process that answers one request (``generate``, an editor calling the CLI per edit)
ends before those estimates are learned, so each run drafts as timidly as the first. Replays of recorded
answers (``scripts/replay_auto.py --learned-from``; docs/benchmarks.md) put the cost of starting cold
at 3-5% of the speed of `auto` on code edits, against restoring the estimates learned on other edits.

Only counts are kept (no text): per proposer, its ``Acceptance`` and ``ConfidenceTable``, keyed by the
target and draft model files. They are restored scaled down to ``RESTORE_WEIGHT`` observations per class,
so that a new kind of text corrects them within a few drafts: restored at full weight, estimates learned
on code edits cost up to 1.5% on arithmetic answers in the same replays; at this weight, nothing beyond
the replays' noise. What rounds and drafts cost is not kept: the machine's load changes between runs (the
cost curve, calibration.py, has its own cache and check).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from pathlib import Path
from typing import Any

from .catalogue import default_cache_dir
from .environment import env_path
from .errors import PoolError
from .filestore import (file_identity, finite_number, put_json_entry, read_json_object, save_advice,
                        save_obstacle, warn_not_saved)

log = logging.getLogger("ouroboros_local")

FORMAT = 1               # bump when the meaning of saved classes changes: older entries are then ignored
RESTORE_WEIGHT = 10.0    # observations' worth each restored class (and depth) keeps at most
MAX_ENTRIES = 32         # model pairs kept in the file (the least recently saved go first)
SAVE_INTERVAL = 60.0     # seconds between saves after generations (a long-lived server); close() saves too
PRIORS_FILE = Path(__file__).with_name("copy_priors.json")   # scripts/learn_copy_priors.py writes it
PRIOR_SOURCES = ("prompt-lookup", "suffix")   # the drafters it holds priors for: those that run no model
PRIOR_WEIGHT = RESTORE_WEIGHT   # observations' worth each class of the copy priors starts with


def cache_path() -> Path:
    """``OUROBOROS_ESTIMATES_FILE``, else ``estimates.json`` in the cache directory (``OUROBOROS_CACHE``)."""
    return env_path("OUROBOROS_ESTIMATES_FILE") or default_cache_dir() / "estimates.json"


def estimates_key(target: list[Any], draft: list[Any] | None) -> str:
    """The model files the estimates belong to (their ``filestore.file_identity``)."""
    payload = json.dumps({"format": FORMAT, "target": list(target), "draft": list(draft) if draft else None})
    return hashlib.sha256(payload.encode()).hexdigest()[:32]


class LearnedEstimates:
    """The estimates file: one entry per model pair, written atomically, at most MAX_ENTRIES entries."""

    def __init__(self, path: Path | None = None):
        self.path = path or cache_path()

    def _read(self) -> dict[str, Any]:
        return read_json_object(self.path, "learned estimates")

    def entry(self, key: str) -> dict[str, Any] | None:
        """The saved entry of ``key`` (``format``, ``saved_at``, ``estimates``), if it is one of this format."""
        entry = self._read().get(key)
        if not isinstance(entry, dict) or entry.get("format") != FORMAT or not isinstance(entry.get("estimates"), dict):
            return None
        return entry

    def get(self, key: str) -> dict[str, Any] | None:
        entry = self.entry(key)
        return entry["estimates"] if entry is not None else None

    def put(self, key: str, estimates: dict[str, Any]) -> None:
        """Save ``estimates`` under ``key``; OSError or PoolError when the file cannot be written (warned
        about once per process here: the caller may only log it at debug level)."""
        try:
            put_json_entry(self.path, key, {"format": FORMAT, "saved_at": time.time(), "estimates": estimates},
                           keep=MAX_ENTRIES, stamp_key="saved_at", what="learned estimates")
        except (OSError, PoolError) as exc:
            warn_not_saved(self.path, "learned estimates", "OUROBOROS_ESTIMATES_FILE",
                           "what this process learns is lost: the next start begins from what was saved "
                           "before (or the shipped priors)", exc)
            raise


def copy_priors() -> dict[str, Any]:
    """What the drafters that run no model start from before anything is learned or restored: what
    ``auto`` learned of them on prompts the benchmarks do not measure (``PRIORS_FILE``, written by
    scripts/learn_copy_priors.py), in the form of ``Scheduler.estimates()``. How often a copy is right
    depends on the copy (after a 16-token match nearly always, after a 1-token one seldom) more than on the
    model; the generic prior trusts every class alike, so a fresh process drafted short copies that fail
    and held back long ones. Restored like saved estimates, at PRIOR_WEIGHT observations a class, so that
    the request's own text soon outweighs them; saved estimates replace them proposer by proposer. {} if
    the file is missing or unreadable."""
    estimates = read_json_object(PRIORS_FILE).get("estimates")
    if not isinstance(estimates, dict):
        log.debug("copy priors not read from %s", PRIORS_FILE)
        return {}
    return {source: entry for source, entry in estimates.items() if source in PRIOR_SOURCES}


def describe(target: Path, draft: Path | None) -> str:
    """One line for ``doctor``: what the next start with these models begins from."""
    store = LearnedEstimates()
    obstacle = save_obstacle(store.path)   # a read-only or full cache: what a run learns is lost at its end
    unsaved = f"{obstacle}. {save_advice('OUROBOROS_ESTIMATES_FILE')}" if obstacle else ""
    entry = store.entry(estimates_key(file_identity(target), file_identity(draft) if draft else None))
    if entry is None:
        saves = f"cannot save what it learned there: {unsaved}" if obstacle else "saves what it learned at its end"
        return (f"learned estimates: none yet for these models ({store.path}); a run starts copies from the "
                f"shipped priors and {saves}")
    names = ", ".join(sorted(entry["estimates"])) or "no proposer"
    line = (f"learned estimates: {names}, saved {_when(entry.get('saved_at'))} in {store.path} (a run starts "
            "from them; --no-learned: from the priors)")
    return f"{line}; not saved there again: {unsaved}" if obstacle else line


def _when(stamp: Any) -> str:
    """A saved time.time() as a date, "?" where the file (edited by hand) holds no such time: NaN, 1e300."""
    try:
        return time.strftime("%Y-%m-%d %H:%M", time.localtime(finite_number(stamp, math.nan)))
    except (OverflowError, OSError, ValueError):
        return "?"


__all__ = ["LearnedEstimates", "PRIORS_FILE", "PRIOR_SOURCES", "PRIOR_WEIGHT", "RESTORE_WEIGHT", "SAVE_INTERVAL",
           "cache_path", "copy_priors", "describe", "estimates_key"]
