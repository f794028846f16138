"""Tiny, deterministic GGUF models for tests.

`write_tiny_model` writes a small llama-architecture GGUF with random weights and a real
byte-level BPE tokenizer (GPT-2 style, merges learned here from a built-in corpus), so unit tests
can exercise tokenization, chat templates, decoding and speculative verification through
llama.cpp itself in milliseconds, without downloading anything.

A "draft" can be a perturbed copy of a "target": pass the target's seed as `base_seed` and a
`noise` level (relative to each tensor's init std); noise=0 gives identical weights. Random tiny
models have small top-1/top-2 margins, so agreement drops fast: along the target's greedy path,
noise 0.01 / 0.02 / 0.03 / 0.1 gives about 92% / 87% / 78% / 40% greedy acceptance. Weights are
drawn per tensor from a stream keyed by (seed, tensor name), so a draft with fewer layers shares
(perturbed) copies of the target's first layers.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import os
import re
import zlib
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = [
    "CHATML_TEMPLATE",
    "ENDOFTEXT",
    "IM_END",
    "IM_START",
    "TinyVocab",
    "corrupt_copies",
    "tiny_vocab",
    "write_tiny_model",
]

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)

# ChatML, as shipped by Qwen-style models; llama.cpp's built-in template detection also
# recognises it (it looks for "<|im_start|>").
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# llama.cpp maps "gpt-2" to LLAMA_VOCAB_PRE_TYPE_GPT2, whose split regex is exactly the GPT-2 one
# our trainer approximates below. ("default" works too, but splits punctuation differently.)
TOKENIZER_PRE = "gpt-2"

# GGUF token types (gguf.TokenType): NORMAL = 1, UNKNOWN = 2, CONTROL = 3, BYTE = 6.
_TOKEN_NORMAL = 1
_TOKEN_UNKNOWN = 2
_TOKEN_CONTROL = 3
_TOKEN_BYTE = 6

# --------------------------------------------------------------------------------------------
# Built-in training corpus (original text; a few KB of prose and Python code).
# Changing it changes every merge, hence every tiny model: edit with care.
# --------------------------------------------------------------------------------------------

_PROSE = """\
The lighthouse keeper woke before the sun and climbed the stairs to the lamp room. The sea was
calm that morning, and the boats were already leaving the harbour. She wrote the time, the wind
and the weather in her book, as she had done every morning for eleven years. Nothing in the book
was ever surprising, and that was the point of the book.

In the town below, the market opened at seven. There were apples and pears from the valley,
bread from the baker on the corner, fish from the boats that had come back in the night, and
cheese from the farm on the hill. People talked about the weather, about the price of bread,
and about the new road that the council had promised for the third year in a row.

A good model of the world does not need to be large. It needs to be right about the things that
matter, and honest about the things it does not know. When we write a program, we make a small
model of a problem, and then we test it against the world. If the test fails, we learn
something; if it passes, we learn a little less, but we can move on to the next question.

Speculative decoding is a simple idea. A small draft model guesses the next few tokens, and the
large target model checks all of the guesses in one pass. When the guesses are right, we keep
them and save time; when they are wrong, we keep the part that was right and continue from there.
The output is the same as if the target model had written every token by itself.

The children walked home from school along the river. They stopped on the bridge to watch the
water, and one of them dropped a stick on one side and ran to the other side to see it come out.
The stick was slow, and then it was fast, and then it was gone. They laughed and went on walking,
talking about dinner, about the game on Saturday, and about nothing at all.

Some words are more common than others: the, of, and, to, in, is, that, it, was, for, on, are,
with, as, at, be, this, have, from, or, one, had, by, but, not, what, all, were, when, we, there.
Numbers appear too: 1, 2, 3, 10, 42, 100, 2024, 3.14, and 1000000.
"""

_CODE = '''\
import math
from dataclasses import dataclass


@dataclass
class Point:
    x: float
    y: float

    def distance(self, other: "Point") -> float:
        """Return the Euclidean distance to another point."""
        return math.hypot(self.x - other.x, self.y - other.y)


def fibonacci(n: int) -> list[int]:
    """Return the first n Fibonacci numbers."""
    result = []
    a, b = 0, 1
    for _ in range(n):
        result.append(a)
        a, b = b, a + b
    return result


def count_words(text: str) -> dict[str, int]:
    counts: dict[str, int] = {}
    for word in text.split():
        word = word.strip(".,;:!?").lower()
        if not word:
            continue
        counts[word] = counts.get(word, 0) + 1
    return counts


class Stack:
    def __init__(self) -> None:
        self.items = []

    def push(self, item) -> None:
        self.items.append(item)

    def pop(self):
        if not self.items:
            raise IndexError("pop from an empty stack")
        return self.items.pop()

    def __len__(self) -> int:
        return len(self.items)


def binary_search(values: list[int], target: int) -> int:
    low, high = 0, len(values) - 1
    while low <= high:
        mid = (low + high) // 2
        if values[mid] == target:
            return mid
        if values[mid] < target:
            low = mid + 1
        else:
            high = mid - 1
    return -1


if __name__ == "__main__":
    print(fibonacci(10))
    print(count_words("the cat and the hat"))
    print(Point(0.0, 0.0).distance(Point(3.0, 4.0)))
'''


# --------------------------------------------------------------------------------------------
# Byte-level BPE
# --------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode character map (llama.cpp uses the same)."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


# The GPT-2 pre-tokenizer regex with \p{L} ~ [^\W\d_] and \p{N} ~ \d (stdlib `re` has no \p{..});
# exact for ASCII, which is all the corpus needs. Tokenization stays lossless whatever the merges.
_PRETOKENIZE = re.compile(
    r"""'s|'t|'re|'ve|'m|'ll|'d| ?[^\W\d_]+| ?\d+| ?(?:[^\s\w]|_)+|\s+(?!\S)|\s+"""
)


def _merge_pair(word: tuple[str, ...], pair: tuple[str, str]) -> tuple[str, ...]:
    out: list[str] = []
    i = 0
    while i < len(word):
        if i + 1 < len(word) and (word[i], word[i + 1]) == pair:
            out.append(word[i] + word[i + 1])
            i += 2
        else:
            out.append(word[i])
            i += 1
    return tuple(out)


def _train_bpe(corpus: str, n_merges: int) -> list[tuple[str, str]]:
    """Learn `n_merges` BPE merges; ties broken by the lexicographically smallest pair.

    Pair counts are updated incrementally (only words containing the merged pair change) and the
    best pair comes from a lazily invalidated heap, so training takes tens of milliseconds.
    """
    b2u = bytes_to_unicode()
    counts = Counter(
        tuple(b2u[b] for b in piece.encode("utf-8")) for piece in _PRETOKENIZE.findall(corpus)
    )
    words = list(counts)
    freqs = [counts[w] for w in words]
    pairs: Counter[tuple[str, str]] = Counter()
    where: dict[tuple[str, str], set[int]] = {}
    for idx, word in enumerate(words):
        for pair in itertools.pairwise(word):
            pairs[pair] += freqs[idx]
            where.setdefault(pair, set()).add(idx)
    heap = [(-n, pair) for pair, n in pairs.items()]
    heapq.heapify(heap)

    merges: list[tuple[str, str]] = []
    while len(merges) < n_merges and heap:
        neg, best = heapq.heappop(heap)
        if -neg != pairs[best] or pairs[best] <= 0:
            continue  # stale entry: the count changed after it was pushed
        merges.append(best)
        changed: set[tuple[str, str]] = set()
        for idx in where.pop(best, set()):
            old, f = words[idx], freqs[idx]
            new = _merge_pair(old, best)
            if new == old:
                continue
            for pair in itertools.pairwise(old):
                pairs[pair] -= f
                changed.add(pair)
            for pair in itertools.pairwise(new):
                pairs[pair] += f
                changed.add(pair)
                where.setdefault(pair, set()).add(idx)
            words[idx] = new
        for pair in changed:
            if pairs[pair] > 0:
                heapq.heappush(heap, (-pairs[pair], pair))
    return merges


@dataclass(frozen=True)
class TinyVocab:
    """A tokenizer section ready to write into a GGUF."""

    name: str
    tokens: tuple[str, ...]
    token_types: tuple[int, ...]
    merges: tuple[str, ...]  # "left right", in rank order
    endoftext_id: int
    im_start_id: int
    im_end_id: int
    scores: tuple[float, ...] = ()   # SentencePiece only: a merge's priority
    bos_id: int | None = None        # None: endoftext_id

    @property
    def sentencepiece(self) -> bool:
        return bool(self.scores)

    @property
    def n_vocab(self) -> int:
        return len(self.tokens)


# Vocab "a": prose + code, 250 merges, specials at the end.
# Vocab "b": code-heavy mixture, 150 merges, specials first. (Reordering the corpus alone would not
# change BPE pair counts, so "b" reweights it to get genuinely different merges.)
# Vocabs "s" and "t": "a"'s and "b"'s pieces as SentencePieces of the Llama-2 family (_sentencepiece).
_VOCAB_SPECS: dict[str, tuple[str, int, bool]] = {
    "a": (_PROSE + "\n" + _CODE, 250, False),
    "b": (_CODE + "\n" + _CODE + "\n" + _CODE + "\n" + _PROSE, 150, True),
}


@functools.cache
def tiny_vocab(name: str = "a") -> TinyVocab:
    """Build (and cache) the named tiny vocabulary."""
    if name in _SENTENCEPIECE_OF:
        return _sentencepiece(name, tiny_vocab(_SENTENCEPIECE_OF[name]))
    if name not in _VOCAB_SPECS:
        raise ValueError(f"unknown tiny vocab {name!r}; expected one of {sorted([*_VOCAB_SPECS, *_SENTENCEPIECE_OF])}")
    corpus, n_merges, specials_first = _VOCAB_SPECS[name]
    b2u = bytes_to_unicode()
    merges = _train_bpe(corpus, n_merges)

    normal: list[str] = [b2u[b] for b in range(256)]
    seen = set(normal)
    for left, right in merges:
        # Two merge paths can spell the same string; a token must appear once.
        if left + right not in seen:
            seen.add(left + right)
            normal.append(left + right)

    specials = list(SPECIAL_TOKENS)
    if specials_first:
        tokens = specials + normal
        types = [_TOKEN_CONTROL] * len(specials) + [_TOKEN_NORMAL] * len(normal)
    else:
        tokens = normal + specials
        types = [_TOKEN_NORMAL] * len(normal) + [_TOKEN_CONTROL] * len(specials)
    index = {t: i for i, t in enumerate(tokens)}
    return TinyVocab(
        name=name,
        tokens=tuple(tokens),
        token_types=tuple(types),
        merges=tuple(f"{l} {r}" for l, r in merges),
        endoftext_id=index[ENDOFTEXT],
        im_start_id=index[IM_START],
        im_end_id=index[IM_END],
    )


_SENTENCEPIECE_OF = {"s": "a", "t": "b"}


def _sentencepiece(name: str, bpe: TinyVocab) -> TinyVocab:
    """A Llama-2-style SentencePiece vocabulary (``<unk> <s> </s>``, 256 byte-fallback tokens, then
    pieces with U+2581 for a space; llama.cpp puts a space before the text) from ``bpe``'s pieces that
    are whole UTF-8, in merge order: a piece's score ranks its merge as the BPE did."""
    u2b = {c: b for b, c in bytes_to_unicode().items()}
    pieces: list[str] = []
    for token, kind in zip(bpe.tokens, bpe.token_types):
        try:
            text = bytes(u2b[c] for c in token).decode("utf-8") if kind == _TOKEN_NORMAL else ""
        except UnicodeDecodeError:
            continue
        if text and (text.isprintable() or text.strip() == ""):
            pieces.append(text.replace(" ", "\u2581"))
    head = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tokens = head + pieces + [IM_START, IM_END]
    types = ([_TOKEN_UNKNOWN, _TOKEN_CONTROL, _TOKEN_CONTROL] + [_TOKEN_BYTE] * 256
             + [_TOKEN_NORMAL] * len(pieces) + [_TOKEN_CONTROL] * 2)
    scores = [0.0] * len(head) + [-float(i) for i in range(len(pieces))] + [0.0, 0.0]
    return TinyVocab(name=name, tokens=tuple(tokens), token_types=tuple(types), merges=(), endoftext_id=2,
                     im_start_id=len(tokens) - 2, im_end_id=len(tokens) - 1, scores=tuple(scores), bos_id=1)


# --------------------------------------------------------------------------------------------
# Weights
# --------------------------------------------------------------------------------------------


def _tensor_specs(
    n_vocab: int, n_layer: int, n_embd: int, n_head: int, n_head_kv: int, n_ff: int
) -> list[tuple[str, tuple[int, ...], float, float]]:
    """(name, numpy shape, mean, std) per tensor. Numpy shape is (out, in): GGUF dims reversed.

    Scales are chosen so the residual stream is dominated by the current token's embedding with a
    sizeable attention contribution (so predictions depend on context), and logits have a std of
    about 3 over the vocabulary: the top-1 probability then typically lies in 0.1-0.9.
    """
    head_dim = n_embd // n_head
    d = n_embd
    specs: list[tuple[str, tuple[int, ...], float, float]] = [
        ("token_embd.weight", (n_vocab, d), 0.0, 1.0),
    ]
    for i in range(n_layer):
        p = f"blk.{i}"
        specs += [
            (f"{p}.attn_norm.weight", (d,), 1.0, 0.1),
            (f"{p}.attn_q.weight", (n_head * head_dim, d), 0.0, 2.0 / np.sqrt(d)),
            (f"{p}.attn_k.weight", (n_head_kv * head_dim, d), 0.0, 2.0 / np.sqrt(d)),
            (f"{p}.attn_v.weight", (n_head_kv * head_dim, d), 0.0, 1.0 / np.sqrt(d)),
            (
                f"{p}.attn_output.weight",
                (d, n_head * head_dim),
                0.0,
                1.0 / np.sqrt(n_head * head_dim),
            ),
            (f"{p}.ffn_norm.weight", (d,), 1.0, 0.1),
            (f"{p}.ffn_gate.weight", (n_ff, d), 0.0, 1.0 / np.sqrt(d)),
            (f"{p}.ffn_up.weight", (n_ff, d), 0.0, 1.0 / np.sqrt(d)),
            (f"{p}.ffn_down.weight", (d, n_ff), 0.0, 1.0 / np.sqrt(n_ff)),
        ]
    specs += [
        ("output_norm.weight", (d,), 1.0, 0.1),
        ("output.weight", (n_vocab, d), 0.0, 3.0 / np.sqrt(d)),
    ]
    return specs


def _normal(seed: int, name: str, stream: int, shape: tuple[int, ...]) -> np.ndarray:
    # One independent stream per (seed, tensor, purpose): adding/removing tensors or layers never
    # shifts the values of the others.
    rng = np.random.default_rng([seed, zlib.crc32(name.encode()), stream])
    return rng.standard_normal(shape, dtype=np.float64)


_WEIGHTS, _NOISE = 0, 1


def write_tiny_model(
    path: str | os.PathLike[str],
    *,
    vocab: str = "a",
    seed: int = 0,
    n_layer: int = 2,
    n_embd: int = 64,
    n_head: int = 4,
    n_head_kv: int = 2,
    n_ff: int = 128,
    n_ctx_train: int = 2048,
    base_seed: int | None = None,
    noise: float = 0.0,
    dtype: str = "f32",
) -> Path:
    """Write a tiny random llama-architecture GGUF with a real tokenizer (byte-level BPE; SentencePiece
    for vocab "s"); return its path.

    Weights come from `seed`, or, when `base_seed` is given, from `base_seed` plus `noise` times
    fresh per-tensor noise from `seed` (scaled to each tensor's init std). Same arguments give a
    byte-identical file. `dtype` is "f32" or "f16" (1-D norm weights always stay f32).
    """
    import gguf  # imported lazily: only test code needs it

    if dtype not in ("f32", "f16"):
        raise ValueError(f"dtype must be 'f32' or 'f16', not {dtype!r}")
    if n_embd % n_head or n_head % n_head_kv:
        raise ValueError("n_embd must be divisible by n_head, and n_head by n_head_kv")
    path = Path(path)
    voc = tiny_vocab(vocab)
    head_dim = n_embd // n_head

    writer_tmp = path.with_name(path.name + ".tmp")
    w = gguf.GGUFWriter(str(writer_tmp), "llama")
    w.add_name(f"tiny-llama-{vocab}-s{seed}" + ("" if base_seed is None else f"-b{base_seed}"))
    w.add_file_type(gguf.LlamaFileType.ALL_F32 if dtype == "f32" else gguf.LlamaFileType.MOSTLY_F16)
    w.add_context_length(n_ctx_train)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)

    w.add_token_list(list(voc.tokens))
    w.add_token_types(list(voc.token_types))
    if voc.sentencepiece:
        w.add_tokenizer_model("llama")
        w.add_token_scores(list(voc.scores))
        w.add_unk_token_id(0)
        w.add_add_space_prefix(True)
    else:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(TOKENIZER_PRE)
        w.add_token_merges(list(voc.merges))
    w.add_bos_token_id(voc.endoftext_id if voc.bos_id is None else voc.bos_id)
    w.add_eos_token_id(voc.endoftext_id)
    # EOT = <|im_end|> makes it end-of-generation (llama.cpp also auto-detects both by text).
    w.add_eot_token_id(voc.im_end_id)
    w.add_pad_token_id(voc.endoftext_id)
    w.add_add_bos_token(voc.sentencepiece)   # as Llama-2 does
    w.add_add_eos_token(False)
    w.add_chat_template(CHATML_TEMPLATE)

    out_dtype = np.float32 if dtype == "f32" else np.float16
    for name, shape, mean, std in _tensor_specs(
        voc.n_vocab, n_layer, n_embd, n_head, n_head_kv, n_ff
    ):
        if base_seed is None:
            x = mean + std * _normal(seed, name, _WEIGHTS, shape)
        else:
            x = mean + std * _normal(base_seed, name, _WEIGHTS, shape)
            if noise:
                x = x + noise * std * _normal(seed, name, _NOISE, shape)
        w.add_tensor(name, x.astype(np.float32 if len(shape) == 1 else out_dtype))

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    # Write-then-rename so a concurrent reader never sees a half-written model.
    os.replace(writer_tmp, path)
    return path


def corrupt_copies(src: str | os.PathLike[str], dir: str | os.PathLike[str]) -> dict[str, Path]:
    """Broken model files for error-path tests: keys "truncated", "not_gguf", "empty"."""
    src, out = Path(src), Path(dir)
    out.mkdir(parents=True, exist_ok=True)
    data = src.read_bytes()
    paths = {
        "truncated": out / f"{src.stem}.truncated.gguf",
        "not_gguf": out / "not_a_model.gguf",
        "empty": out / "empty.gguf",
    }
    paths["truncated"].write_bytes(data[: len(data) // 2])
    paths["not_gguf"].write_text("this is a text file, not a GGUF model\n" * 4)
    paths["empty"].write_bytes(b"")
    return paths


def _main() -> (
    None
):  # pragma: no cover - manual helper: python -m ouroboros_local.testing.tiny_models OUT
    import sys

    out = write_tiny_model(sys.argv[1] if len(sys.argv) > 1 else "tiny.gguf")
    print(out, out.stat().st_size, "bytes")


if __name__ == "__main__":  # pragma: no cover
    _main()
