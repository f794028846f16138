"""The generated tiny GGUFs are deterministic, load in llama.cpp and behave like small LMs.

These tests talk to llama.cpp through llama-cpp-python's raw ctypes API on purpose: they check
the test models themselves, independently of the project's own wrapper.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from ouroboros_local.testing import (
    CHATML_TEMPLATE,
    ENDOFTEXT,
    IM_END,
    IM_START,
    corrupt_copies,
    tiny_vocab,
    write_tiny_model,
)

L = pytest.importorskip("llama_cpp")

TEXTS = [
    "héllo wörld ✓ 日本",
    "The lighthouse keeper woke before the sun.",
    "def f(x: int) -> int:\n    return x + 1\n",
    "  leading, trailing  \t tabs\n\n\nand 12345 numbers 3.14 ",
    "emoji \U0001f642 and a combining accent: e\u0301",
]

# llama_token_attr bits
ATTR_NORMAL = 1 << 2
ATTR_CONTROL = 1 << 3


@dataclass
class Loaded:
    model: ctypes.c_void_p
    ctx: ctypes.c_void_p
    vocab: ctypes.c_void_p
    n_vocab: int

    def tokenize(self, text: str, *, special: bool = True, add_special: bool = False) -> list[int]:
        data = text.encode()
        buf = (L.llama_token * (len(data) + 8))()
        n = L.llama_tokenize(self.vocab, data, len(data), buf, len(buf), add_special, special)
        assert n >= 0
        return list(buf[:n])

    def detokenize(self, tokens: list[int], *, special: bool = True) -> str:
        arr = (L.llama_token * len(tokens))(*tokens)
        buf = ctypes.create_string_buffer(8192)
        n = L.llama_detokenize(self.vocab, arr, len(tokens), buf, len(buf), False, special)
        assert n >= 0
        return buf.raw[:n].decode("utf-8")

    def logits(self, tokens: list[int]) -> np.ndarray:
        """Logits of every position of one fresh sequence, shape (len(tokens), n_vocab)."""
        L.llama_memory_clear(L.llama_get_memory(self.ctx), True)
        batch = L.llama_batch_init(len(tokens), 0, 1)
        try:
            for i, t in enumerate(tokens):
                batch.token[i] = t
                batch.pos[i] = i
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = 0
                batch.logits[i] = 1
            batch.n_tokens = len(tokens)
            assert L.llama_decode(self.ctx, batch) == 0
            ptr = L.llama_get_logits(self.ctx)
            return np.ctypeslib.as_array(ptr, shape=(len(tokens), self.n_vocab)).copy()
        finally:
            L.llama_batch_free(batch)

    def greedy(self, prompt: list[int], n: int) -> list[int]:
        """Plain one-token-at-a-time greedy decoding (no EOG stop: we only look at tokens)."""
        L.llama_memory_clear(L.llama_get_memory(self.ctx), True)
        arr = (L.llama_token * len(prompt))(*prompt)
        assert L.llama_decode(self.ctx, L.llama_batch_get_one(arr, len(prompt))) == 0
        out: list[int] = []
        for _ in range(n):
            row = np.ctypeslib.as_array(L.llama_get_logits_ith(self.ctx, -1), shape=(self.n_vocab,))
            out.append(int(row.argmax()))
            one = (L.llama_token * 1)(out[-1])
            assert L.llama_decode(self.ctx, L.llama_batch_get_one(one, 1)) == 0
        return out


def _load_model(path: Path) -> ctypes.c_void_p | None:
    params = L.llama_model_default_params()
    params.n_gpu_layers = 0
    return L.llama_model_load_from_file(str(path).encode(), params)


@pytest.fixture(scope="module")
def load() -> Iterator:
    """Returns a loader that caches one model + context per path for the module."""
    L.llama_backend_init()
    cache: dict[Path, Loaded] = {}

    def _load(path: Path) -> Loaded:
        if path not in cache:
            model = _load_model(path)
            assert model, f"llama.cpp failed to load {path}"
            cparams = L.llama_context_default_params()
            cparams.n_ctx = 512
            cparams.n_batch = 512
            cparams.n_ubatch = 512
            # One thread: tiny models gain nothing from more, and ggml thread barriers spin badly
            # when the machine is oversubscribed (parallel test runs).
            cparams.n_threads = cparams.n_threads_batch = 1
            cparams.kv_unified = True
            cparams.flash_attn_type = 0  # LLAMA_FLASH_ATTN_TYPE_DISABLED
            ctx = L.llama_init_from_model(model, cparams)
            assert ctx
            vocab = L.llama_model_get_vocab(model)
            cache[path] = Loaded(model, ctx, vocab, L.llama_vocab_n_tokens(vocab))
        return cache[path]

    yield _load
    for lm in cache.values():
        L.llama_free(lm.ctx)
        L.llama_model_free(lm.model)


# ---------------------------------------------------------------------------------------------
# File generation
# ---------------------------------------------------------------------------------------------


def test_vocabularies() -> None:
    a, b = tiny_vocab("a"), tiny_vocab("b")
    assert (a.n_vocab, len(a.merges)) == (509, 250)
    assert (b.n_vocab, len(b.merges)) == (409, 150)
    assert (a.endoftext_id, a.im_start_id, a.im_end_id) == (506, 507, 508)
    assert (b.endoftext_id, b.im_start_id, b.im_end_id) == (0, 1, 2)
    for v in (a, b):
        assert len(set(v.tokens)) == v.n_vocab
        assert {v.tokens[i] for i in (v.endoftext_id, v.im_start_id, v.im_end_id)} == {
            ENDOFTEXT,
            IM_START,
            IM_END,
        }
    assert a.merges[:150] != b.merges  # genuinely different merges, not a prefix


def test_deterministic(tmp_path: Path) -> None:
    p1 = write_tiny_model(tmp_path / "a1.gguf", seed=5)
    p2 = write_tiny_model(tmp_path / "a2.gguf", seed=5)
    p3 = write_tiny_model(tmp_path / "a3.gguf", seed=6)
    p4 = write_tiny_model(tmp_path / "a4.gguf", seed=5, dtype="f16")
    assert p1.read_bytes() == p2.read_bytes()
    assert p1.read_bytes() != p3.read_bytes()
    assert p4.stat().st_size < p1.stat().st_size
    assert not list(tmp_path.glob("*.tmp"))


def _tensors(path: Path) -> dict[str, np.ndarray]:
    import gguf

    return {t.name: np.array(t.data, dtype=np.float64) for t in gguf.GGUFReader(path).tensors}


def test_base_seed_noise(tmp_path: Path) -> None:
    target = _tensors(write_tiny_model(tmp_path / "t.gguf", seed=1))
    copy = _tensors(write_tiny_model(tmp_path / "c.gguf", seed=9, base_seed=1, noise=0.0))
    noisy = _tensors(write_tiny_model(tmp_path / "n.gguf", seed=9, base_seed=1, noise=0.1))
    assert target.keys() == copy.keys() == noisy.keys()
    for name, x in target.items():
        np.testing.assert_array_equal(copy[name], x)
        rel = np.std(noisy[name] - x) / max(np.std(x), 1e-9)
        assert 0.0 < rel < 0.5, name
    # Per-tensor streams: a one-layer draft shares the target's layer-0 weights exactly.
    short = _tensors(write_tiny_model(tmp_path / "s.gguf", seed=9, base_seed=1, n_layer=1))
    np.testing.assert_array_equal(short["blk.0.attn_q.weight"], target["blk.0.attn_q.weight"])
    assert "blk.1.attn_q.weight" not in short


def test_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        write_tiny_model(tmp_path / "x.gguf", dtype="q4_0")
    with pytest.raises(ValueError):
        write_tiny_model(tmp_path / "x.gguf", vocab="zz")
    with pytest.raises(ValueError):
        write_tiny_model(tmp_path / "x.gguf", n_head=3)


# ---------------------------------------------------------------------------------------------
# Loading in llama.cpp
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fixture, n_vocab",
    [
        ("tiny_target", 509),
        ("tiny_draft", 509),
        ("tiny_self_draft", 509),
        ("tiny_other_vocab", 409),
        ("tiny_f16", 509),
    ],
)
def test_loads(request: pytest.FixtureRequest, load, fixture: str, n_vocab: int) -> None:
    lm = load(request.getfixturevalue(fixture))
    assert lm.n_vocab == n_vocab
    assert L.llama_model_n_embd(lm.model) == 64
    assert L.llama_model_n_layer(lm.model) == 2
    assert L.llama_model_n_ctx_train(lm.model) == 2048
    assert not L.llama_model_is_recurrent(lm.model)
    buf = ctypes.create_string_buffer(64)
    n = L.llama_model_meta_val_str(lm.model, b"general.architecture", buf, len(buf))
    assert buf.value[:n] == b"llama"


@pytest.mark.parametrize("fixture", ["tiny_target", "tiny_other_vocab"])
@pytest.mark.parametrize("text", TEXTS)
def test_tokenize_roundtrip(request: pytest.FixtureRequest, load, fixture: str, text: str) -> None:
    lm = load(request.getfixturevalue(fixture))
    ids = lm.tokenize(text)
    assert all(0 <= t < lm.n_vocab for t in ids)
    assert lm.detokenize(ids) == text
    assert len(ids) < len(text.encode())  # merges actually apply


def test_special_tokens(load, tiny_target: Path) -> None:
    lm = load(tiny_target)
    v = tiny_vocab("a")
    chat = f"{IM_START}user\nhi{IM_END}\n{ENDOFTEXT}"
    ids = lm.tokenize(chat, special=True)
    assert ids[0] == v.im_start_id and v.im_end_id in ids and ids[-1] == v.endoftext_id
    assert lm.detokenize(ids, special=True) == chat
    # Without parse_special the markers are plain text, split into several normal tokens.
    plain = lm.tokenize(IM_END, special=False)
    assert len(plain) > 1 and v.im_end_id not in plain
    assert lm.tokenize(IM_END, special=True) == [v.im_end_id]

    assert L.llama_vocab_is_eog(lm.vocab, v.im_end_id)
    assert L.llama_vocab_is_eog(lm.vocab, v.endoftext_id)
    assert not L.llama_vocab_is_eog(lm.vocab, v.im_start_id)
    assert not any(L.llama_vocab_is_eog(lm.vocab, t) for t in range(v.endoftext_id))
    for t in (v.endoftext_id, v.im_start_id, v.im_end_id):
        assert L.llama_vocab_get_attr(lm.vocab, t) & ATTR_CONTROL
    assert L.llama_vocab_get_attr(lm.vocab, ord("a")) & ATTR_NORMAL
    assert L.llama_vocab_bos(lm.vocab) == L.llama_vocab_eos(lm.vocab) == v.endoftext_id
    assert L.llama_vocab_eot(lm.vocab) == v.im_end_id
    assert not L.llama_vocab_get_add_bos(lm.vocab)
    assert lm.tokenize("hi", add_special=True) == lm.tokenize("hi")  # no BOS added


def test_other_vocab_differs(load, tiny_target: Path, tiny_other_vocab: Path) -> None:
    a, b = load(tiny_target), load(tiny_other_vocab)
    assert a.n_vocab != b.n_vocab
    text = TEXTS[1] + TEXTS[2]
    assert a.tokenize(text) != b.tokenize(text)
    assert b.tokenize(IM_END) == [tiny_vocab("b").im_end_id] != a.tokenize(IM_END)
    assert L.llama_vocab_is_eog(b.vocab, tiny_vocab("b").im_end_id)


def test_sentencepiece_vocab(load, tiny_sentencepiece: Path) -> None:
    """Vocab "s" is a Llama-2-style SentencePiece: a space before the text, BOS, byte fallback."""
    lm = load(tiny_sentencepiece)
    v = tiny_vocab("s")
    assert L.llama_vocab_type(lm.vocab) == L.LLAMA_VOCAB_TYPE_SPM
    assert L.llama_vocab_get_add_bos(lm.vocab) and L.llama_vocab_bos(lm.vocab) == v.bos_id == 1
    ids = lm.tokenize("the sea")
    assert lm.tokenize(" the sea") != ids                 # a space is put before the text...
    assert lm.detokenize(ids) == "the sea"                # ...and taken off again
    assert len(ids) < len("the sea")                      # pieces merge
    text = "naïve 𝄞"                                      # characters without a piece: byte fallback
    assert lm.detokenize(lm.tokenize(text)) == text
    assert lm.tokenize(IM_END, special=True) == [v.im_end_id]
    assert L.llama_vocab_is_eog(lm.vocab, v.im_end_id) and L.llama_vocab_is_eog(lm.vocab, v.endoftext_id)


def test_chat_template(load, tiny_target: Path) -> None:
    lm = load(tiny_target)
    assert L.llama_model_chat_template(lm.model, None).decode() == CHATML_TEMPLATE
    msgs = [("system", "Be brief."), ("user", "Hi!")]
    keep = [(r.encode(), c.encode()) for r, c in msgs]  # keep bytes alive for the call
    arr = (L.llama_chat_message * len(keep))(*[L.llama_chat_message(r, c) for r, c in keep])
    buf = ctypes.create_string_buffer(1024)
    n = L.llama_chat_apply_template(CHATML_TEMPLATE.encode(), arr, len(keep), True, buf, len(buf))
    expected = (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert buf.raw[:n].decode() == expected
    import jinja2

    rendered = jinja2.Template(CHATML_TEMPLATE).render(
        messages=[{"role": r, "content": c} for r, c in msgs], add_generation_prompt=True
    )
    assert rendered == expected


# ---------------------------------------------------------------------------------------------
# Logits
# ---------------------------------------------------------------------------------------------


def _sample_ids(lm: Loaded) -> list[int]:
    return lm.tokenize(" ".join(TEXTS[1:4]) * 2)[:96]


def test_logits_not_degenerate(load, tiny_target: Path) -> None:
    lm = load(tiny_target)
    logits = lm.logits(_sample_ids(lm))
    assert logits.shape[1] == lm.n_vocab
    assert np.isfinite(logits).all()
    probs = np.exp(logits - logits.max(1, keepdims=True))
    probs /= probs.sum(1, keepdims=True)
    top1 = probs.max(1)
    assert 0.1 < np.median(top1) < 0.9  # neither uniform nor one-hot
    argmax = logits.argmax(1)
    assert (argmax[1:] != argmax[:-1]).mean() > 0.3  # predictions move along the sequence
    assert len(set(argmax.tolist())) > 20


def test_f16_close_to_f32(load, tiny_target: Path, tiny_f16: Path) -> None:
    a, b = load(tiny_target), load(tiny_f16)
    ids = _sample_ids(a)
    la, lb = a.logits(ids), b.logits(ids)
    assert np.abs(la - lb).max() < 0.2
    assert (la.argmax(1) == lb.argmax(1)).mean() > 0.9


def test_draft_agreement(load, tiny_target: Path, tiny_draft: Path, tiny_self_draft: Path) -> None:
    """Greedy acceptance of the draft along the target's own greedy path: high, not perfect."""
    target = load(tiny_target)
    prompt = target.tokenize("The lighthouse keeper")
    path = target.greedy(prompt, 64)
    seq = prompt + path
    for fixture, lo, hi in ((tiny_draft, 0.6, 0.98), (tiny_self_draft, 1.0, 1.0)):
        guesses = load(fixture).logits(seq)[len(prompt) - 1 : -1].argmax(1)
        agreement = float((guesses == np.array(path)).mean())
        assert lo <= agreement <= hi, (fixture.name, agreement)


def test_corrupt_copies(tmp_path: Path, tiny_target: Path) -> None:
    broken = corrupt_copies(tiny_target, tmp_path / "broken")
    assert set(broken) == {"truncated", "not_gguf", "empty"}
    assert broken["empty"].stat().st_size == 0
    assert 0 < broken["truncated"].stat().st_size < tiny_target.stat().st_size
    L.llama_backend_init()
    for path in broken.values():
        assert not _load_model(path), path  # llama.cpp refuses them (NULL), without crashing


def test_the_tiny_model_writer_runs_as_a_module_without_warnings(tmp_path: Path) -> None:
    """The package imported the module it runs: runpy printed a RuntimeWarning before every model."""
    import os
    import subprocess
    import sys

    from ouroboros_local import testing
    from ouroboros_local.testing import tiny_models

    assert sorted(testing.__all__) == sorted(tiny_models.__all__)
    out = tmp_path / "t.gguf"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                                        os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-W", "error", "-m", "ouroboros_local.testing.tiny_models", str(out)],
                         capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode == 0 and run.stderr == "" and out.is_file(), run.stderr
    # the module is the package's attribute before anything imported it
    run = subprocess.run([sys.executable, "-c", "import ouroboros_local.testing as t; print(t.tiny_models.__name__)"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert run.stdout.strip() == "ouroboros_local.testing.tiny_models", run.stderr
