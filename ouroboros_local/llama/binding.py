"""llama.cpp through ctypes (with huge_pages.py's madvise, the only ctypes code): models, contexts, batches.

Built on llama-cpp-python's low-level bindings (``llama_cpp.llama_cpp``), never on its high-level
``Llama`` class, because we need several sequences per context, a unified KV cache and our own batches.
"""

from __future__ import annotations

import codecs
import ctypes
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Sequence

import numpy as np

from ..cpu_load import busy_cores_now, idle_threads, math_cores, usable_cores  # noqa: F401 (re-exported)
from ..environment import env_flag
from ..errors import LLAMA_CPP_PYTHON, ContextOverflowError, ModelError, OuroborosError, ParameterError
from ..filestore import file_identity
from ..gguf_file import recurrent_refusal
from ..text_input import utf8_bytes
from . import huge_pages as huge_pages_mod
from .interrupts import noted_ctrl_c

try:
    from llama_cpp import llama_cpp as lc
except ImportError as exc:  # pragma: no cover - import guard for a clear message
    if exc.name not in (None, "llama_cpp"):   # installed, but something it imports is missing
        raise OuroborosError(f"llama-cpp-python cannot be imported: {exc} (pip install "
                             f"{exc.name.split('.')[0]})") from exc
    raise OuroborosError(f"llama-cpp-python is not installed: pip install '{LLAMA_CPP_PYTHON}'") from exc

_NEEDED = (   # every name of llama_cpp.llama_cpp this package uses (a test in test_interrupts.py keeps it whole)
    "GGML_TYPE_F16", "GGML_TYPE_F32", "GGML_TYPE_Q4_0", "GGML_TYPE_Q4_1", "GGML_TYPE_Q5_0", "GGML_TYPE_Q5_1",
    "GGML_TYPE_Q8_0", "LLAMA_FLASH_ATTN_TYPE_AUTO", "LLAMA_FLASH_ATTN_TYPE_DISABLED",
    "LLAMA_FLASH_ATTN_TYPE_ENABLED", "LLAMA_LOAD_MODE_NONE", "LLAMA_SPLIT_MODE_NONE", "LLAMA_TOKEN_ATTR_LSTRIP",
    "LLAMA_TOKEN_ATTR_RSTRIP", "LLAMA_VOCAB_TYPE_BPE", "LLAMA_VOCAB_TYPE_SPM", "llama_backend_init",
    "llama_batch_free", "llama_batch_init", "llama_context_default_params", "llama_decode", "llama_free",
    "llama_get_logits", "llama_get_memory", "llama_init_from_model", "llama_log_callback", "llama_log_set",
    "llama_memory_clear", "llama_memory_seq_cp", "llama_memory_seq_keep", "llama_memory_seq_pos_max",
    "llama_memory_seq_pos_min", "llama_memory_seq_rm", "llama_model_chat_template", "llama_model_default_params",
    "llama_model_desc", "llama_model_free", "llama_model_get_vocab", "llama_model_is_hybrid",
    "llama_model_is_recurrent", "llama_model_load_from_file", "llama_model_meta_val_str", "llama_model_n_ctx_train",
    "llama_model_n_layer", "llama_model_n_params", "llama_model_n_swa", "llama_model_quantize",
    "llama_model_quantize_default_params", "llama_model_size", "llama_n_batch", "llama_n_ctx", "llama_n_seq_max",
    "llama_perf_context", "llama_print_system_info", "llama_progress_callback", "llama_seq_id",
    "llama_set_n_threads", "llama_supports_gpu_offload", "llama_token", "llama_token_to_piece", "llama_tokenize",
    "llama_vocab_bos", "llama_vocab_eos", "llama_vocab_get_add_bos", "llama_vocab_get_add_eos",
    "llama_vocab_get_attr", "llama_vocab_get_text", "llama_vocab_is_control", "llama_vocab_is_eog",
    "llama_vocab_n_tokens", "llama_vocab_type",
)


def check_names(module: object) -> None:
    """OuroborosError naming what ``module`` (llama_cpp.llama_cpp) lacks of ``_NEEDED``: an older (or much
    newer) build is said at import, not as an AttributeError deep in a load or after a calibration."""
    lacking = [name for name in _NEEDED if not hasattr(module, name)]
    if lacking:
        more = f" and {len(lacking) - 3} more" if len(lacking) > 3 else ""
        raise OuroborosError(f"this llama-cpp-python lacks {', '.join(lacking[:3])}{more}: pip install "
                             f"'{LLAMA_CPP_PYTHON}'")


check_names(lc)

_init_lock = threading.Lock()
_initialised = False
_log_callback = None  # keep a reference: a collected CFUNCTYPE segfaults when llama.cpp calls it
_log_lines: list[str] = []
_log_count = 0   # error lines logged since the process started: a mark for ``errors_since``


def _verbose() -> bool:
    """OUROBOROS_VERBOSE, read at each line (it may change while the process runs). An unknown value was refused
    by backend_init; here it counts as off, since no exception may leave llama.cpp's log callback."""
    try:
        return env_flag("OUROBOROS_VERBOSE")
    except ParameterError:
        return False


def _on_log(level: int, text: bytes, _user: ctypes.c_void_p) -> None:
    message = text.decode("utf-8", "replace") if text else ""
    if _verbose():
        os.write(2, message.encode())
    elif level >= 4:  # GGML_LOG_LEVEL_ERROR: remember for error messages
        global _log_count
        _log_lines.append(message.strip())
        _log_count += 1
        del _log_lines[:-20]


def backend_init() -> None:
    """Initialise llama.cpp once per process and route its logs (quiet unless OUROBOROS_VERBOSE)."""
    env_flag("OUROBOROS_VERBOSE")   # an unknown value: one line now (the log callback cannot raise)
    global _initialised, _log_callback
    with _init_lock:
        if _initialised:
            return
        _log_callback = lc.llama_log_callback(_on_log)
        lc.llama_log_set(_log_callback, ctypes.c_void_p(0))
        lc.llama_backend_init()
        _initialised = True


def _logits_address_function() -> Callable[[int], int | None]:
    """``llama_get_logits`` returning the buffer's address as an int: no pointer object to build and cast
    in every round (a separate function object: llama_cpp's own keeps its restype). Where the package
    does not expose its library (``_lib``, llama-cpp-python 0.3.x), its function's result is cast."""
    lib = getattr(lc, "_lib", None)
    try:
        fn = lib["llama_get_logits"]   # type: ignore[index]
    except (TypeError, KeyError, AttributeError):
        return lambda ctx: ctypes.cast(lc.llama_get_logits(ctx), ctypes.c_void_p).value
    fn.argtypes, fn.restype = [ctypes.c_void_p], ctypes.c_void_p
    return fn


_logits_address = _logits_address_function()


def last_log_error() -> str:
    return _log_lines[-1] if _log_lines else ""


def errors_since(mark: int) -> str:
    """llama.cpp's error lines logged after ``mark`` (``_log_count`` then), joined: a failed load logs its
    cause ('tensor ... not found') before the generic 'failed to load model' line."""
    lines = [line for line in _log_lines[len(_log_lines) - min(_log_count - mark, len(_log_lines)):] if line]
    return "; ".join(dict.fromkeys(lines)) or last_log_error()


def default_threads() -> int:
    """The usable cores that other processes leave idle now (sampled for ~0.15 s), at least 1, one per
    physical core at most (``math_cores``: llama.cpp's own default).

    Not simply every core: llama.cpp's threads wait for each other at every graph node, so one thread
    sharing a core with a busy process stalls them all (SmolLM2-135M next to another decode loop: 0.3
    tok/s with 2 threads, 55 with 1). ``usable_cores()`` is the affinity count without the load."""
    cores, busy, math = usable_cores(), busy_cores_now(), math_cores().count
    threads = idle_threads(cores, busy, math)
    if threads < min(cores, math):
        logging.getLogger("ouroboros_local").info(
            "other processes keep %.1f of %d cores busy: using %d thread(s) (-t N overrides)",
            busy, cores, threads)
    return threads


def supports_gpu_offload() -> bool:
    backend_init()
    return bool(lc.llama_supports_gpu_offload())


def system_info() -> str:
    backend_init()
    return lc.llama_print_system_info().decode("utf-8", "replace")


def library_identity() -> list | None:
    """The loaded libllama's ``file_identity``: another build (an upgrade, a rebuild) has other kernels,
    so a cost curve measured with one says little about the other. None where it cannot be told."""
    try:
        return file_identity(lc._lib._name)
    except (AttributeError, TypeError, OSError):
        return None


@dataclass(frozen=True)
class Device:
    """A compute device llama.cpp's ggml backends see (the CPU included)."""

    name: str
    description: str
    kind: str                 # cpu, gpu, igpu or accel
    memory_free: int          # bytes
    memory_total: int


_DEVICE_KINDS = {0: "cpu", 1: "gpu", 2: "igpu", 3: "accel"}


_ggml_lib: ctypes.CDLL | None = None


def _ggml_library() -> ctypes.CDLL:
    """libggml from the folder of the libllama this process loaded. llama_cpp's own ``_ggml`` module
    looks only in the package's lib folder and ignores LLAMA_CPP_LIB_PATH, so with a llama.cpp built
    apart (a CUDA build, say) it finds no library, or another build's."""
    from llama_cpp import _ctypes_extensions

    loaded = getattr(getattr(lc, "_lib", None), "_name", None)
    if loaded:
        try:
            return _ctypes_extensions.load_shared_library("ggml", Path(loaded).parent)
        except (OSError, RuntimeError):   # not beside libllama (a static build): the package's copy
            pass
    from llama_cpp import _ggml

    return _ggml.libggml


def _ggml_device_api() -> ctypes.CDLL:
    global _ggml_lib
    if _ggml_lib is None:
        lib = _ggml_library()
        vp, sz = ctypes.c_void_p, ctypes.c_size_t
        lib.ggml_backend_dev_count.restype = sz
        lib.ggml_backend_dev_get.argtypes, lib.ggml_backend_dev_get.restype = [sz], vp
        for fn in (lib.ggml_backend_dev_name, lib.ggml_backend_dev_description):
            fn.argtypes, fn.restype = [vp], ctypes.c_char_p
        lib.ggml_backend_dev_type.argtypes, lib.ggml_backend_dev_type.restype = [vp], ctypes.c_int
        lib.ggml_backend_dev_memory.argtypes = [vp, ctypes.POINTER(sz), ctypes.POINTER(sz)]
        lib.ggml_backend_dev_memory.restype = None
        _ggml_lib = lib
    return _ggml_lib


def devices() -> list[Device]:
    """The devices llama.cpp can run on, in its order (GPUs first in offload order, then the CPU)."""
    backend_init()
    lib = _ggml_device_api()
    found = []
    for i in range(lib.ggml_backend_dev_count()):
        dev = lib.ggml_backend_dev_get(i)
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        lib.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        found.append(Device(name=(lib.ggml_backend_dev_name(dev) or b"").decode("utf-8", "replace"),
                            description=(lib.ggml_backend_dev_description(dev) or b"").decode("utf-8", "replace"),
                            kind=_DEVICE_KINDS.get(lib.ggml_backend_dev_type(dev), "other"),
                            memory_free=free.value, memory_total=total.value))
    return found


def offload_gpus(found: Sequence[Device]) -> list[Device]:
    """The GPUs llama.cpp offloads to, numbered as ``main_gpu`` counts them: the discrete ones, else the
    integrated ones."""
    return [d for d in found if d.kind == "gpu"] or [d for d in found if d.kind == "igpu"]


def chosen_gpu(index: int, gpus: Sequence[Device]) -> Device | None:
    """GPU ``index`` among ``gpus`` (``offload_gpus``' numbering, as ``main_gpu`` counts them); None where
    there is no GPU (the models run on the CPU); ModelError where there are fewer than ``index + 1``."""
    if not gpus:
        return None
    if index >= len(gpus):
        names = ", ".join(f"{i}: {d.description or d.name}" for i, d in enumerate(gpus))
        raise ModelError(f"there is no GPU {index} (--main-gpu): llama.cpp sees {len(gpus)} ({names})")
    return gpus[index]


_said_no_gpu: set[int] = set()


def _one_gpu(index: int) -> bool:
    """Can the model go on GPU ``index`` alone? False, with a warning, where there is no GPU; ModelError
    where there are fewer (``chosen_gpu``)."""
    try:
        seen = devices()
    except (ImportError, AttributeError, OSError, RuntimeError):   # no ggml device API: llama.cpp checks it
        return True
    if chosen_gpu(index, offload_gpus(seen)) is None:
        if index not in _said_no_gpu:   # once, not for the target and again for its draft
            _said_no_gpu.add(index)
            logging.getLogger("ouroboros_local").warning(
                "warning: main GPU %d asked for, but llama.cpp sees no GPU here: the models run on the CPU", index)
        return False
    return True


def _quietly(release: Callable[[], None]) -> None:
    """Run a finalizer's release call, ignoring errors (the library may be gone at interpreter exit)."""
    try:
        release()
    except Exception:  # noqa: BLE001
        pass


class _Native:
    """Owns one llama.cpp object, freed by ``close`` (or, as a last resort, at garbage collection)."""

    _ptr = None

    @staticmethod
    def _free(ptr) -> None:  # pragma: no cover - every subclass names its own
        raise NotImplementedError

    def close(self) -> None:
        if self._ptr is not None:
            self._free(self._ptr)
            self._ptr = None

    def __del__(self) -> None:  # pragma: no cover - best effort at interpreter exit
        _quietly(self.close)


class Model(_Native):
    """A loaded GGUF model: weights, vocabulary, metadata, tokenizer."""

    _free = staticmethod(lambda ptr: lc.llama_model_free(ptr))

    def __init__(self, path: str | Path, n_gpu_layers: int = 0, vocab_only: bool = False,
                 main_gpu: int | None = None, huge_pages: bool = False):
        """``main_gpu``: the whole model on that GPU (None: llama.cpp's default, its layers split across
        every GPU). ``huge_pages``: read the weights into 2 MiB pages where they stay on the CPU
        (huge_pages.py)."""
        backend_init()
        self.path = Path(path)
        if not self.path.is_file():
            raise ModelError(f"model file not found: {self.path}")
        self.file_id = file_identity(self.path)   # learned state's key, whatever happens to the file later
        params = lc.llama_model_default_params()
        params.n_gpu_layers = int(n_gpu_layers)
        params.vocab_only = self.vocab_only = bool(vocab_only)
        if main_gpu is not None and not vocab_only and _one_gpu(main_gpu) and n_gpu_layers != 0:
            # llama.cpp reads main_gpu only where the model is not split (LLAMA_SPLIT_MODE_NONE)
            params.split_mode = lc.LLAMA_SPLIT_MODE_NONE
            params.main_gpu = int(main_gpu)
        self.main_gpu = int(params.main_gpu) if params.split_mode == lc.LLAMA_SPLIT_MODE_NONE else None
        self.n_gpu_layers = int(n_gpu_layers)
        advice = None
        mark = _log_count
        with noted_ctrl_c() as ctrl_c:
            # only weights that stay on the CPU are read in, and only where they fit well (huge_pages.worth_it)
            if (huge_pages and not vocab_only and (n_gpu_layers == 0 or not supports_gpu_offload())
                    and huge_pages_mod.worth_it(self.path.stat().st_size)):
                advice = huge_pages_mod.WeightAdvice(lc.llama_progress_callback, ctrl_c.keep_going)
                params.load_mode = lc.LLAMA_LOAD_MODE_NONE
                progress = advice.callback
            else:   # ours rather than llama.cpp's (dots in its log): a Ctrl-C stops the load
                progress = lc.llama_progress_callback(ctrl_c.keep_going)
            params.progress_callback = progress   # kept alive by ``progress`` while the load runs
            ptr = lc.llama_model_load_from_file(os.fsencode(self.path), params)
        ctrl_c.raise_if_noted(lambda: lc.llama_model_free(ptr) if ptr else None)
        # bytes of weight buffers advised into huge pages (0: mapped as llama.cpp does by default)
        self.huge_page_bytes = advice.advised if advice is not None else 0
        if not ptr:
            detail = errors_since(mark)
            raise ModelError(f"llama.cpp could not load {self.path}" + (f": {detail}" if detail else ""))
        self._ptr = ptr
        self._vocab = lc.llama_model_get_vocab(ptr)
        self._holders = 0   # engines using this model (``hold``/``let_go``)
        self._holders_lock = threading.Lock()
        if not vocab_only and (lc.llama_model_is_recurrent(ptr) or lc.llama_model_is_hybrid(ptr)):
            kind = "recurrent" if lc.llama_model_is_recurrent(ptr) else "hybrid"
            self.close()
            raise recurrent_refusal(self.path.name, f"a {kind} model")
        self.n_vocab = int(lc.llama_vocab_n_tokens(self.vocab))
        self.bos = int(lc.llama_vocab_bos(self.vocab))
        self.eos = int(lc.llama_vocab_eos(self.vocab))
        self.add_bos = bool(lc.llama_vocab_get_add_bos(self.vocab))
        self.add_eos = bool(lc.llama_vocab_get_add_eos(self.vocab))
        self._pieces: dict[tuple[int, bool], bytes] = {}
        self._bytes_per_token: int | None = None   # 0: no bound (``bytes_per_token``)
        # per ``special``: the text of each piece seen that is whole UTF-8 on its own (``TextStream``)
        self._piece_texts: tuple[dict[int, str], dict[int, str]] = ({}, {})
        self._eog: frozenset[int] | None = None

    # ---- metadata -------------------------------------------------------------------------------
    @property
    def ptr(self):
        if self._ptr is None:
            raise OuroborosError("model is closed")
        return self._ptr

    @property
    def vocab(self):
        """The vocabulary's pointer; an error once the model is closed (it points into freed memory)."""
        if self._ptr is None:
            raise OuroborosError("model is closed")
        return self._vocab

    def hold(self) -> None:
        """An engine uses this model: ``let_go`` closes it when the last one is done with it."""
        with self._holders_lock:
            self._holders += 1

    def let_go(self) -> None:
        with self._holders_lock:
            self._holders -= 1
            last = self._holders <= 0
        if last:
            self.close()

    def _checked(self, token: int) -> int:
        """``token`` as an int in the vocabulary: llama.cpp aborts the process on any other id."""
        t = int(token)
        if not 0 <= t < self.n_vocab:
            raise ParameterError(f"token {t} is not in the vocabulary (0..{self.n_vocab - 1})")
        return t

    def meta(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(4096)
        n = lc.llama_model_meta_val_str(self.ptr, key.encode(), buf, len(buf))
        if n < 0:
            return None
        if n >= len(buf):
            buf = ctypes.create_string_buffer(n + 1)
            lc.llama_model_meta_val_str(self.ptr, key.encode(), buf, len(buf))
        return buf.value.decode("utf-8", "replace")

    @property
    def arch(self) -> str:
        return self.meta("general.architecture") or "unknown"

    @property
    def description(self) -> str:
        buf = ctypes.create_string_buffer(256)
        lc.llama_model_desc(self.ptr, buf, len(buf))
        return buf.value.decode("utf-8", "replace")

    size_bytes = property(lambda self: int(lc.llama_model_size(self.ptr)), doc="weights in bytes")
    n_params = property(lambda self: int(lc.llama_model_n_params(self.ptr)))
    n_ctx_train = property(lambda self: int(lc.llama_model_n_ctx_train(self.ptr)), doc="trained context")
    n_layer = property(lambda self: int(lc.llama_model_n_layer(self.ptr)))
    n_swa = property(lambda self: int(lc.llama_model_n_swa(self.ptr)), doc="sliding-window size (0: none)")

    def chat_template(self) -> str | None:
        raw = lc.llama_model_chat_template(self.ptr, None)
        return raw.decode("utf-8", "replace") if raw else None

    # ---- vocabulary -----------------------------------------------------------------------------
    def token_text(self, token: int) -> str:
        raw = lc.llama_vocab_get_text(self.vocab, self._checked(token))
        return raw.decode("utf-8", "replace") if raw else ""

    def is_control(self, token: int) -> bool:
        return bool(lc.llama_vocab_is_control(self.vocab, self._checked(token)))

    @property
    def eog_tokens(self) -> frozenset[int]:
        """Every end-of-generation token (EOS, EOT, <|im_end|>, ...), found once by asking llama.cpp."""
        if self._eog is None:
            is_eog = lc.llama_vocab_is_eog
            vocab = self.vocab
            self._eog = frozenset(t for t in range(self.n_vocab) if is_eog(vocab, t))
        return self._eog

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True,
                 limit: int | None = None) -> list[int]:
        """``limit``: more tokens than that raise ContextOverflowError (naming the count) before they
        become a Python list, ~36 bytes a token (a 21 MB prompt file once took 1.2 GB)."""
        data = utf8_bytes(text)
        if limit is not None and len(data) > 64 * (limit + 1) and (per_token := self.bytes_per_token()):
            floor = len(data) // per_token   # no token covers more bytes: a sure count
            if floor > limit:   # (tokenizing 8 MB took 2 s of CPU only to be refused)
                raise ContextOverflowError(f"the text has more than {limit} tokens", n_tokens=floor,
                                           at_least=True)
        cap = len(data) + 16 if limit is None else min(len(data) + 16, limit + 1)
        while True:
            buf = (lc.llama_token * cap)()
            n = lc.llama_tokenize(self.vocab, data, len(data), buf, cap, add_special, parse_special)
            if limit is not None and abs(n) > limit and n != -(2**31):   # -n: the count a larger buffer needs
                raise ContextOverflowError(f"the text has {abs(n)} tokens, more than {limit}", n_tokens=abs(n))
            if n >= 0:
                return list(buf[:n])
            if n == -(2**31):
                raise OuroborosError("text too long to tokenize")
            cap = -n

    def bytes_per_token(self) -> int | None:
        """The most input bytes one token can stand for, or None where nothing bounds it; measured on
        first use (0.4 s at 152k tokens). The longest piece (special tokens' text included), for BPE; three
        times that for SentencePiece, whose pieces count a typed U+2581 (3 bytes) as the space it stands
        for. None for tokenizers that normalize (WordPiece and Unigram drop whitespace runs and fold case)
        and where a special token strips the whitespace around it (llama.cpp's phi-3 settings)."""
        if self._bytes_per_token is None:
            kind = lc.llama_vocab_type(self.vocab)
            bound = 0
            if kind in (lc.LLAMA_VOCAB_TYPE_BPE, lc.LLAMA_VOCAB_TYPE_SPM):
                strips = lc.LLAMA_TOKEN_ATTR_LSTRIP | lc.LLAMA_TOKEN_ATTR_RSTRIP
                buf = ctypes.create_string_buffer(256)
                longest = 1
                for token in range(self.n_vocab):
                    if lc.llama_vocab_get_attr(self.vocab, token) & strips:
                        longest = 0
                        break
                    n = lc.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, True)
                    longest = max(longest, abs(n))   # -n: the size a piece longer than the buffer needs
                bound = longest * (3 if kind == lc.LLAMA_VOCAB_TYPE_SPM else 1)
            self._bytes_per_token = bound
        return self._bytes_per_token or None

    def piece(self, token: int, special: bool = False) -> bytes:
        """The bytes of one token (may be a partial UTF-8 sequence). Cached."""
        key = (int(token), special)
        cached = self._pieces.get(key)
        if cached is not None:
            return cached
        token = self._checked(token)
        buf = ctypes.create_string_buffer(64)
        n = lc.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = lc.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, special)
        out = buf.raw[:n]
        self._pieces[key] = out
        return out

    def detokenize(self, tokens: Iterable[int], special: bool = False) -> str:
        return b"".join(self.piece(t, special) for t in tokens).decode("utf-8", "replace")



class TextStream:
    """Turns token pieces into text safely: holds back incomplete UTF-8 sequences.

    Runs once per emitted token, after the decode: a piece that is whole UTF-8 on its own, with no bytes
    held back, is the model's cached text (one dict lookup): in real runs, with the caches cold after each
    decode, 2.9 µs a token where the incremental decoder (Python code in ``codecs``) took 13.8."""

    def __init__(self, model: Model, special: bool = False):
        self.model = model
        self.special = special
        self._texts = model._piece_texts[special]
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._holding = False   # the decoder holds the start of a character

    def push(self, token: int) -> str:
        if not self._holding:
            text = self._texts.get(token)
            if text is not None:
                return text
        piece = self.model.piece(token, self.special)
        if not self._holding:
            try:
                text = self._texts[int(token)] = piece.decode("utf-8")
                return text
            except UnicodeDecodeError:
                pass
        text = self._decoder.decode(piece)
        self._holding = bool(self._decoder.getstate()[0])
        return text

    def flush(self) -> str:
        self._holding = False
        return self._decoder.decode(b"", final=True)


@dataclass
class ContextParams:
    n_ctx: int = 4096
    n_batch: int = 512
    n_seq_max: int = 1
    n_threads: int | None = None
    n_threads_batch: int | None = None
    flash_attn: str = "off"        # off | on | auto
    type_k: str = "f16"
    type_v: str = "f16"
    swa_full: bool = True
    offload_kqv: bool = True


KV_CACHE_TYPES = {"f32": lc.GGML_TYPE_F32, "f16": lc.GGML_TYPE_F16, "q8_0": lc.GGML_TYPE_Q8_0,
             "q4_0": lc.GGML_TYPE_Q4_0, "q4_1": lc.GGML_TYPE_Q4_1, "q5_0": lc.GGML_TYPE_Q5_0,
             "q5_1": lc.GGML_TYPE_Q5_1}
_FLASH = {"off": lc.LLAMA_FLASH_ATTN_TYPE_DISABLED, "on": lc.LLAMA_FLASH_ATTN_TYPE_ENABLED,
          "auto": lc.LLAMA_FLASH_ATTN_TYPE_AUTO}


class Batch:
    """A reusable llama_batch with explicit positions, sequence ids and logits flags.

    Filled through numpy views of its arrays (one vectorized assignment per field, not a ctypes
    store per token). The per-token sequence-id arrays llama_batch_init allocates are pointed into
    one (capacity x max_seqs) matrix; the original pointers are put back before llama_batch_free.
    """

    def __init__(self, capacity: int, max_seqs_per_token: int):
        self.capacity = capacity
        self.max_seqs = max_seqs_per_token
        b = self._b = lc.llama_batch_init(capacity, 0, max_seqs_per_token)
        self._token = np.ctypeslib.as_array(b.token, shape=(capacity,))
        self._pos = np.ctypeslib.as_array(b.pos, shape=(capacity,))
        self._n_seq = np.ctypeslib.as_array(b.n_seq_id, shape=(capacity,))
        self._logits = np.ctypeslib.as_array(b.logits, shape=(capacity,))
        self._seq = np.zeros((capacity, max_seqs_per_token), dtype=np.int32)
        self._ramp = np.arange(capacity, dtype=np.int32)
        seq_ptr = ctypes.POINTER(lc.llama_seq_id)
        self._own_seq_ptrs = [ctypes.cast(b.seq_id[i], ctypes.c_void_p).value for i in range(capacity)]
        base, row_bytes = self._seq.ctypes.data, self._seq.strides[0]
        for i in range(capacity):
            b.seq_id[i] = ctypes.cast(base + i * row_bytes, seq_ptr)
        self._n = 0
        self.n_outputs = 0
        self._plain = 0   # leading entries known to be "sequence 0 only, logits wanted" (set_chain)

    @property
    def n_tokens(self) -> int:
        return self._n

    def clear(self) -> None:
        self._b.n_tokens = 0
        self._n = 0
        self.n_outputs = 0

    def _reserve(self, n: int) -> int:
        self._plain = 0   # the general fills below may overwrite the plain metadata
        i = self._n
        if i + n > self.capacity:
            raise OuroborosError(f"batch overflow: capacity {self.capacity}")
        self._n = i + n
        self._b.n_tokens = i + n
        return i

    def _check_seqs(self, seq_ids: Sequence[int]) -> None:
        if not 0 < len(seq_ids) <= self.max_seqs:
            raise OuroborosError(f"a token needs 1..{self.max_seqs} sequence ids")

    def set_chain(self, tokens: Sequence[int], start_pos: int) -> None:
        """Make the batch ``tokens`` at consecutive positions of sequence 0, each wanting logits (a plain
        step, the commonest batch, or a draft chain to verify)."""
        n = len(tokens)
        if n > self.capacity:
            raise OuroborosError(f"batch overflow: capacity {self.capacity}")
        if n == 1:   # a plain step: two stores instead of two array operations (20 µs with cold caches)
            self._token[0] = tokens[0]
            self._pos[0] = start_pos
        else:
            self._token[:n] = tokens
            np.add(self._ramp[:n], start_pos, out=self._pos[:n])
        if n > self._plain:
            self._set_plain(n)
        self._n = self.n_outputs = n
        self._b.n_tokens = n

    def _set_plain(self, n: int) -> None:
        # kept across plain batches: the next plain step or chain rewrites only tokens and positions
        self._n_seq[:n] = 1
        self._seq[:n, 0] = 0
        self._logits[:n] = 1
        self._plain = n

    def add(self, token: int, pos: int, seq_ids: Sequence[int], logits: bool) -> int:
        """Append a token; returns its batch index."""
        self._check_seqs(seq_ids)
        i = self._reserve(1)
        self._token[i] = token
        self._pos[i] = pos
        self._n_seq[i] = len(seq_ids)
        self._seq[i, :len(seq_ids)] = seq_ids
        self._logits[i] = 1 if logits else 0
        if logits:
            self.n_outputs += 1
        return i

    def add_sequence(self, tokens: Sequence[int], start_pos: int, seq_ids: Sequence[int],
                     logits_last: bool) -> None:
        """Append consecutive tokens of the same sequences (a prefill chunk, a draft chain)."""
        n = len(tokens)
        if n == 0:
            return
        self._check_seqs(seq_ids)
        i = self._reserve(n)
        self._token[i:i + n] = tokens
        self._pos[i:i + n] = np.arange(start_pos, start_pos + n, dtype=np.int32)
        self._n_seq[i:i + n] = len(seq_ids)
        self._seq[i:i + n, :len(seq_ids)] = seq_ids
        self._logits[i:i + n] = 0
        if logits_last:
            self._logits[i + n - 1] = 1
            self.n_outputs += 1

    def add_tokens(self, tokens: Sequence[int], positions: Sequence[int], seq_ids: Sequence[Sequence[int]],
                   logits: Sequence[bool]) -> None:
        """Append tokens with their own positions, sequence ids and logits flags (a tree layout)."""
        n = len(tokens)
        if n == 0:
            return
        lengths = [len(s) for s in seq_ids]
        if min(lengths) < 1 or max(lengths) > self.max_seqs:
            raise OuroborosError(f"a token needs 1..{self.max_seqs} sequence ids")
        i = self._reserve(n)
        self._token[i:i + n] = tokens
        self._pos[i:i + n] = positions
        self._n_seq[i:i + n] = lengths
        if max(lengths) == 1:
            self._seq[i:i + n, 0] = [s[0] for s in seq_ids]
        else:
            seq = self._seq
            for k, ids in enumerate(seq_ids):
                seq[i + k, :len(ids)] = ids
        flags = self._logits[i:i + n]
        flags[:] = logits
        self.n_outputs += int(np.count_nonzero(flags))

    def free(self) -> None:
        if self._b is not None:
            seq_ptr = ctypes.POINTER(lc.llama_seq_id)
            for i, addr in enumerate(self._own_seq_ptrs):   # llama_batch_free frees these
                self._b.seq_id[i] = ctypes.cast(addr, seq_ptr)
            lc.llama_batch_free(self._b)
            self._b = None

    def __del__(self) -> None:  # pragma: no cover - best effort at interpreter exit
        _quietly(self.free)


_decode_clock = threading.local()


def decode_seconds() -> float:
    """Seconds this thread has spent inside llama.cpp's decoding (every context) since the process
    began: in llama_decode, and waiting in llama_get_logits for a decode to finish. On a GPU
    llama_decode returns once the work is queued and the wait is in llama_get_logits (on the H200 a
    plain step of SmolLM2 spent 1.25 of its 1.35 ms there, which bench counted as our Python)."""
    return getattr(_decode_clock, "seconds", 0.0)


def _count_decode(context: "Context", seconds: float) -> None:
    context.decode_seconds += seconds
    _decode_clock.seconds = getattr(_decode_clock, "seconds", 0.0) + seconds


class Context(_Native):
    """A llama.cpp context with a unified KV cache over ``n_seq_max`` sequences."""

    _free = staticmethod(lambda ptr: lc.llama_free(ptr))

    def __init__(self, model: Model, params: ContextParams):
        self.model = model
        self.params = params
        threads = params.n_threads or default_threads()
        cp = lc.llama_context_default_params()
        cp.n_ctx = params.n_ctx
        cp.n_batch = params.n_batch
        cp.n_ubatch = params.n_batch  # one verification = one ubatch (uses n_threads_batch)
        # llama.cpp aborts the process (an assertion in output_reserve) when there are more sequences
        # than a batch holds outputs (n_batch, cut to n_ctx): `-b 8` or `-c 8` with the default 16
        # sequences. A batch never uses more sequences than it has tokens, so fewer lose nothing.
        outputs = params.n_batch if params.n_ctx <= 0 else min(params.n_batch, params.n_ctx)   # 0: trained size
        cp.n_seq_max = max(1, min(params.n_seq_max, outputs))
        cp.n_threads = threads
        cp.n_threads_batch = self.n_threads_batch = params.n_threads_batch or threads
        try:
            cp.flash_attn_type = _FLASH[params.flash_attn]
            cp.type_k = KV_CACHE_TYPES[params.type_k]
            cp.type_v = KV_CACHE_TYPES[params.type_v]
        except KeyError as exc:
            raise ModelError(f"unknown setting {exc.args[0]!r}") from None
        cp.kv_unified = True
        cp.swa_full = params.swa_full
        cp.offload_kqv = params.offload_kqv
        cp.no_perf = True
        with noted_ctrl_c() as ctrl_c:   # its buffers' allocation takes seconds for a large context
            ptr = lc.llama_init_from_model(model.ptr, cp)
        ctrl_c.raise_if_noted(lambda: lc.llama_free(ptr) if ptr else None)
        if not ptr:
            detail = last_log_error()
            raise ModelError("llama.cpp could not create a context "
                             f"(n_ctx={params.n_ctx}, n_seq_max={params.n_seq_max})"
                             + (f": {detail}" if detail else ""))
        self._ptr = ptr
        self.mem = lc.llama_get_memory(ptr)
        self.n_ctx = int(lc.llama_n_ctx(ptr))
        self.n_batch = int(lc.llama_n_batch(ptr))
        self.n_seq_max = int(lc.llama_n_seq_max(ptr))
        self.n_vocab = model.n_vocab
        self.n_threads = threads
        self._lock = threading.Lock()
        self.decode_seconds = 0.0          # wall time decoding on this context (llama_decode and the wait for its logits)
        self.decodes = 0                   # llama_decode calls on this context
        # one-token decodes: seconds in llama_decode, then waiting for their logits (``step_wait_share``)
        self._step_launched: float | None = None
        self.step_seconds = [0.0, 0.0]
        self.steps_timed = 0
        self._logits_addr: int | None = None
        self._logits_view = np.empty((0, self.n_vocab), dtype=np.float32)

    @property
    def ptr(self):
        if self._ptr is None:
            raise OuroborosError("context is closed")
        return self._ptr

    def set_threads(self, n_threads: int, n_threads_batch: int) -> None:
        lc.llama_set_n_threads(self.ptr, n_threads, n_threads_batch)

    def step_wait_share(self, min_steps: int = 8) -> float | None:
        """The share of a one-token decode's time spent waiting for its logits after llama_decode
        returned (None: fewer than ``min_steps`` timed). Near 1 where llama_decode only queues the work
        (CUDA: 1.25 of SmolLM2's 1.35 ms on an H200), near 0 where it computes (a CPU)."""
        if self.steps_timed < min_steps:
            return None
        launched, waited = self.step_seconds
        return waited / (launched + waited) if launched + waited > 0 else 0.0

    def graphs_reused(self) -> int:
        """Decodes that reused the previous decode's graph since the context was made: llama.cpp
        reuses it only for a batch of the previous one's shape, and a CUDA build replays its CUDA
        graph only then (compare with ``decodes``)."""
        return int(lc.llama_perf_context(self.ptr).n_reused)

    def decode(self, batch: Batch) -> None:
        """Decode a batch; raises with llama.cpp's reason on failure."""
        t0 = time.perf_counter()
        rc = lc.llama_decode(self.ptr, batch._b)
        seconds = time.perf_counter() - t0
        _count_decode(self, seconds)
        self._step_launched = seconds if batch.n_tokens == 1 else None
        self.decodes += 1
        if rc == 0:
            return
        if rc == 1:
            raise ContextOverflowError(
                f"the context is full ({self.n_ctx} tokens): use a larger --ctx-size or a shorter prompt")
        detail = last_log_error()
        raise OuroborosError(f"llama_decode failed (code {rc})" + (f": {detail}" if detail else ""))

    def logits(self, n_rows: int) -> np.ndarray:
        """Zero-copy view of the last decode's output rows (valid until the next decode)."""
        t0 = time.perf_counter()
        addr = _logits_address(self.ptr)   # waits for the last decode to finish (a GPU's)
        waited = time.perf_counter() - t0
        _count_decode(self, waited)
        if self._step_launched is not None:
            self.step_seconds[0] += self._step_launched
            self.step_seconds[1] += waited
            self.steps_timed += 1
            self._step_launched = None
        if not addr:
            raise OuroborosError("no logits available")
        if addr != self._logits_addr or n_rows > len(self._logits_view):
            # one view per buffer address (building a view costs more than a small decode's Python)
            rows = max(n_rows, self.n_batch)
            ptr = ctypes.cast(addr, ctypes.POINTER(ctypes.c_float))
            self._logits_view = np.ctypeslib.as_array(ptr, shape=(rows, self.n_vocab))
            self._logits_addr = addr
        return self._logits_view[:n_rows]

    # ---- memory (KV cache) ----------------------------------------------------------------------
    def seq_rm(self, seq: int, p0: int, p1: int = -1) -> None:
        if not lc.llama_memory_seq_rm(self.mem, seq, p0, p1):
            raise OuroborosError("llama.cpp could not remove KV cells (recurrent memory?)")

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        lc.llama_memory_seq_cp(self.mem, src, dst, p0, p1)

    def seq_keep(self, seq: int) -> None:
        lc.llama_memory_seq_keep(self.mem, seq)

    def pos_max(self, seq: int) -> int:
        return int(lc.llama_memory_seq_pos_max(self.mem, seq))

    def pos_min(self, seq: int) -> int:
        return int(lc.llama_memory_seq_pos_min(self.mem, seq))

    def clear(self) -> None:
        lc.llama_memory_clear(self.mem, True)



def quantize(src: str | Path, dst: str | Path, ftype: int, n_threads: int | None = None) -> None:
    """Requantize a GGUF (e.g. to make a cheaper draft of the same model)."""
    backend_init()
    params = lc.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = n_threads or default_threads()
    params.allow_requantize = True   # the source is usually already quantized (a Q4 GGUF)
    rc = lc.llama_model_quantize(os.fsencode(src), os.fsencode(dst), ctypes.byref(params))
    if rc != 0:
        raise ModelError(f"quantization of {src} failed (code {rc})")
