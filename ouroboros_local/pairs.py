"""The vocabulary rule: can a draft propose token ids that the target reads the same way?

One rule, read from GGUF metadata (no llama.cpp): the same tokenizer type, vocabulary sizes within
``MAX_VOCAB_SIZE_DIFFERENCE``, the same special ids and add-BOS flag, and the same token texts over
the common range. A pair that fails it still works through text (cross-vocabulary drafting).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from .errors import IncompatiblePairError
from .gguf_file import _tokens, read_metadata, validate_gguf

__all__ = ["MAX_VOCAB_SIZE_DIFFERENCE", "PairReport", "check_pair", "require_compatible"]

# Draft and target may differ by this many (padding) tokens, as in llama.cpp's speculative example.
MAX_VOCAB_SIZE_DIFFERENCE = 128


@dataclass(frozen=True)
class PairReport:
    compatible: bool
    reason: str | None  # the first difference found, when not compatible
    target_vocab: int
    draft_vocab: int


def _show_token(tok: bytes) -> str:
    text = tok.decode("utf-8", errors="replace")
    return repr(text if len(text) <= 40 else text[:40] + "...")


def check_pair(target: str | os.PathLike[str], draft: str | os.PathLike[str]) -> PairReport:
    """Can `draft` propose token ids that `target` reads the same way? Uses GGUF metadata only."""
    t_info, d_info = validate_gguf(target), validate_gguf(draft)
    t_meta, d_meta = read_metadata(target), read_metadata(draft)
    t_tok, d_tok = _tokens(t_meta), _tokens(d_meta)

    def report(reason: str | None) -> PairReport:
        return PairReport(reason is None, reason, len(t_tok), len(d_tok))

    if not t_tok or not d_tok:
        which = "target" if not t_tok else "draft"
        return report(f"the {which} GGUF has no tokenizer.ggml.tokens")
    if t_info.tokenizer_model != d_info.tokenizer_model:
        return report(f"draft tokenizer type {d_info.tokenizer_model!r} differs from the target's "
                      f"{t_info.tokenizer_model!r}")
    if abs(len(t_tok) - len(d_tok)) > MAX_VOCAB_SIZE_DIFFERENCE:
        return report(f"draft vocabulary differs from target: size {len(d_tok)} vs {len(t_tok)}")
    for label, t_val, d_val in (("bos id", t_info.bos_id, d_info.bos_id),
                                ("eos id", t_info.eos_id, d_info.eos_id),
                                ("eot id", t_info.eot_id, d_info.eot_id),
                                ("add_bos flag", t_info.add_bos, d_info.add_bos)):
        if t_val != d_val:
            return report(f"draft {label} {d_val} differs from the target's {t_val}")
    n = min(len(t_tok), len(d_tok))
    if t_tok[:n] != d_tok[:n]:  # one C-level comparison; locate the culprit only on failure
        i = next(i for i in range(n) if t_tok[i] != d_tok[i])
        return report(f"token {i} is {_show_token(t_tok[i])} in the target but {_show_token(d_tok[i])} "
                      f"in the draft")
    return report(None)


def require_compatible(target: str | os.PathLike[str], draft: str | os.PathLike[str]) -> PairReport:
    """Like check_pair, but raise IncompatiblePairError naming the first difference."""
    rep = check_pair(target, draft)
    if not rep.compatible:
        raise IncompatiblePairError(
            f"draft {Path(draft).name} cannot draft for target {Path(target).name}: {rep.reason}")
    return rep
