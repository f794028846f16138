"""Peers measured in the same run: llama-cpp-python's prompt-lookup decoding, and llama.cpp's own binaries.

Peer labels:

- ``llama-cpp-python``: plain ``llama_cpp.Llama`` greedy decoding (the peer's own vanilla).
- ``llama-cpp-python-pld``: ``Llama(draft_model=LlamaPromptLookupDecoding(num_pred_tokens=...),
  logits_all=True)``. ``logits_all=True`` is required: without it the scores buffer has only n_batch
  rows and generation crashes past n_batch tokens (llama-cpp-python 0.3.36).
- ``llama.cpp:<variant>`` (needs ``--llama-cpp-bin DIR``, see scripts/build_llama_cpp.sh):
  ``vanilla`` (``llama-lookup --spec-draft-n-max 0``: no drafts), ``lookup`` (``llama-lookup``),
  ``lookahead`` (``llama-lookahead``, W=15 N=5 G=15 compiled in), and ``llama-speculative-simple
  --spec-type T`` for T in ``ngram-simple``, ``ngram-mod``, ``ngram-cache``, ``ngram-map-k``,
  ``ngram-map-k4v``, ``draft-simple`` (``-md DRAFT``).

Speeds are per decode step, as for our methods: a peer's first token comes out of its prompt
evaluation, so it is not counted in ``timed_tokens`` (tokens/s = timed_tokens / decode seconds).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from ..errors import OuroborosError, ParameterError
from .prompts import BuiltPrompt
from .runner import Contender, Outcome, empty_stats

if TYPE_CHECKING:  # pragma: no cover
    from ..llama import Model

PY_VANILLA = "llama-cpp-python"
PY_PLD = "llama-cpp-python-pld"
BIN_PREFIX = "llama.cpp:"

# variant -> (binary, extra args)
BIN_VARIANTS: dict[str, tuple[str, list[str]]] = {
    "vanilla": ("llama-lookup", ["--spec-draft-n-max", "0"]),
    "lookup": ("llama-lookup", []),
    "lookahead": ("llama-lookahead", []),
    "ngram-simple": ("llama-speculative-simple", ["--spec-type", "ngram-simple"]),
    "ngram-mod": ("llama-speculative-simple", ["--spec-type", "ngram-mod"]),
    "ngram-cache": ("llama-speculative-simple", ["--spec-type", "ngram-cache"]),
    "ngram-map-k": ("llama-speculative-simple", ["--spec-type", "ngram-map-k"]),
    "ngram-map-k4v": ("llama-speculative-simple", ["--spec-type", "ngram-map-k4v"]),
    "draft-simple": ("llama-speculative-simple", ["--spec-type", "draft-simple"]),
}
# what `--peers llama.cpp` expands to (draft-simple only with -d)
DEFAULT_BIN_VARIANTS = ("vanilla", "lookup", "lookahead", "ngram-simple", "ngram-mod", "draft-simple")

# peer option name -> llama.cpp flag
_BIN_OPTION_FLAGS = {
    "n_max": "--spec-draft-n-max", "n_min": "--spec-draft-n-min", "p_min": "--spec-draft-p-min",
    "ngram_mod_n_match": "--spec-ngram-mod-n-match", "ngram_mod_n_min": "--spec-ngram-mod-n-min",
    "ngram_mod_n_max": "--spec-ngram-mod-n-max",
    "size_n": None, "size_m": None, "min_hits": None,   # per --spec-type: see bin_option_args
}


PLD_OPTIONS = ("num_pred_tokens", "max_ngram_size")   # LlamaPromptLookupDecoding's, positive integers
_PER_SPEC_TYPE = ("size_n", "size_m", "min_hits")        # --spec-ngram-simple-size-n and the like


class PeerUnavailable(ParameterError):
    """A peer that cannot run on this machine (not installed, not built)."""


def check_peer_options(label: str, options: dict[str, Any]) -> None:
    """ParameterError, before a model loads, for an option ``label`` does not take: a misspelt one was
    ignored in silence (llama-cpp-python-pld) or found at the warm-up, after the model loaded."""
    if label.startswith(BIN_PREFIX) or label == "llama.cpp":
        bin_option_args(label, options)
        return
    allowed = PLD_OPTIONS if label == PY_PLD else ()
    unknown = [key for key in options if key not in allowed]
    if unknown:
        takes = f"it takes {', '.join(allowed)}" if allowed else "it takes none"
        raise ParameterError(f"{label}: unknown option {unknown[0]!r} ({takes})")
    for key in PLD_OPTIONS:
        value = options.get(key, 1)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ParameterError(f"{label}: {key} must be an integer >= 1 (got {value!r})")


def bin_option_args(label: str, options: dict[str, Any]) -> list[str]:
    """A llama.cpp peer's options as the binary's flags (``label`` "llama.cpp": options for all of them)."""
    spec_type = label[len(BIN_PREFIX):] if label.startswith(BIN_PREFIX) else None
    args: list[str] = []
    for key, value in options.items():
        if key == "args":
            args += [str(a) for a in (value if isinstance(value, list) else str(value).split())]
        elif key in _PER_SPEC_TYPE and spec_type is None:
            continue   # "llama.cpp": checked against each variant that runs
        elif key in _PER_SPEC_TYPE and spec_type.startswith("ngram-") \
                and spec_type not in ("ngram-mod", "ngram-cache"):
            args += [f"--spec-{spec_type}-{key.replace('_', '-')}", str(value)]
        elif _BIN_OPTION_FLAGS.get(key):
            args += [_BIN_OPTION_FLAGS[key], str(value)]
        else:
            raise ParameterError(f"{label}: unknown option {key!r} (use 'args' for raw flags)")
    return args


def peer_names() -> list[str]:
    return [PY_VANILLA, PY_PLD, "llama.cpp"] + [BIN_PREFIX + v for v in BIN_VARIANTS]


def expand_peers(spec: str | Sequence[str] | None, has_draft: bool) -> list[str]:
    """`llama-cpp-python-pld,llama.cpp` -> every peer label to run, each with its own vanilla."""
    if not spec:
        return []
    names = [s.strip() for s in (spec.split(",") if isinstance(spec, str) else spec) if s.strip()]
    out: list[str] = []

    def add(label: str) -> None:
        if label not in out:
            out.append(label)

    for name in names:
        if name in (PY_VANILLA, PY_PLD):
            add(PY_VANILLA)
            add(name)
        elif name in ("llama.cpp", "llama-cpp", "llamacpp"):
            add(BIN_PREFIX + "vanilla")
            for v in DEFAULT_BIN_VARIANTS:
                if v != "draft-simple" or has_draft:
                    add(BIN_PREFIX + v)
        elif name.startswith(BIN_PREFIX) and name[len(BIN_PREFIX):] in BIN_VARIANTS:
            if name == BIN_PREFIX + "draft-simple" and not has_draft:
                raise ParameterError("llama.cpp:draft-simple needs a draft model (-d)")
            add(BIN_PREFIX + "vanilla")
            add(name)
        else:
            raise ParameterError(f"unknown peer {name!r}; choose from {', '.join(peer_names())}")
    return out


def _gpu_layers_flag(n: int) -> str:
    return "999" if n < 0 else str(n)


# ---- llama-cpp-python -------------------------------------------------------------------------
class LlamaCppPythonPeer(Contender):
    """llama_cpp.Llama greedy generation, plain or with LlamaPromptLookupDecoding."""

    kind = "peer"

    def __init__(self, label: str, model_path: str | Path, *, eog: frozenset[int], n_ctx: int,
                 n_batch: int = 512, threads: int | None = None, gpu_layers: int = 0, flash_attn: str = "off",
                 options: dict[str, Any] | None = None, cold: bool = True, main_gpu: int | None = None,
                 cache_types: Mapping[str, str] | None = None):
        self.label = label
        self.cache_types = dict(cache_types or {})   # type_k, type_v: our engine's KV cache types
        self.flash_attn = flash_attn != "off"   # Llama takes a bool: auto as on (a GPU's default)
        self.method = label
        self.cold = cold
        self.pld = label == PY_PLD
        self.baseline = PY_VANILLA
        self.options = dict(options or {})
        if self.pld:
            self.options.setdefault("num_pred_tokens", 10)
            self.options.setdefault("max_ngram_size", 2)
        self.model_path = str(model_path)
        self.eog = eog
        self.n_ctx = n_ctx
        self.n_batch = min(n_batch, n_ctx)
        self.threads = threads or os.cpu_count() or 1
        self.gpu_layers = gpu_layers
        self.main_gpu = main_gpu   # the model on that GPU alone, as ours (Model's main_gpu)
        self.llm: Any = None
        self._counts = {"evals": 0, "drafted": 0}

    def _load(self) -> Any:
        if self.llm is not None:
            return self.llm
        try:
            import llama_cpp
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
        except ImportError as exc:
            raise PeerUnavailable(f"llama-cpp-python is not installed ({exc})") from None
        kwargs: dict[str, Any] = dict(model_path=self.model_path, n_ctx=self.n_ctx, n_batch=self.n_batch,
                                      n_ubatch=self.n_batch, n_threads=self.threads,
                                      n_threads_batch=self.threads, n_gpu_layers=self.gpu_layers,
                                      flash_attn=self.flash_attn, verbose=False, seed=0)
        if self.main_gpu is not None:
            kwargs.update(split_mode=llama_cpp.LLAMA_SPLIT_MODE_NONE, main_gpu=self.main_gpu)
        kwargs.update(_python_cache_types(self.cache_types))
        counts = self._counts
        if self.pld:
            class CountingPLD(LlamaPromptLookupDecoding):
                def __call__(self, input_ids, /, **kw):  # noqa: ANN001
                    out = super().__call__(input_ids, **kw)
                    counts["drafted"] += len(out)
                    return out

            inner = CountingPLD(num_pred_tokens=int(self.options["num_pred_tokens"]),
                                max_ngram_size=int(self.options["max_ngram_size"]))
            kwargs.update(draft_model=inner, logits_all=True)   # logits_all=True: see module doc
        try:
            llm = llama_cpp.Llama(**kwargs)
        except Exception as exc:  # llama-cpp-python raises ValueError/RuntimeError on load failures
            raise PeerUnavailable(f"llama-cpp-python could not load {self.model_path}: {exc}") from None
        plain_eval = llm.eval

        def counting_eval(tokens):  # noqa: ANN001
            counts["evals"] += 1
            return plain_eval(tokens)

        llm.eval = counting_eval
        self.llm = llm
        return llm

    def warmup(self, prompt: BuiltPrompt) -> None:
        self._load()
        super().warmup(prompt)

    def run(self, prompt: BuiltPrompt, max_tokens: int) -> Outcome:
        llm = self._load()
        if len(prompt.tokens) + max_tokens + 1 > self.n_ctx:
            raise OuroborosError(f"prompt of {len(prompt.tokens)} tokens + {max_tokens} does not fit "
                                 f"the peer context of {self.n_ctx}")
        counts = self._counts
        counts["evals"] = counts["drafted"] = 0
        out: list[int] = []
        finish = "length"
        t0 = time.perf_counter()
        t_first = None
        evals0 = drafted0 = 0
        if self.cold:
            llm.reset()   # no prefix reuse from the previous prompt: a full prefill, as for our methods
        gen = llm.generate(list(prompt.tokens), top_k=1, top_p=1.0, min_p=0.0, temp=0.0,
                           repeat_penalty=1.0, reset=True)
        try:
            for tok in gen:
                if t_first is None:
                    t_first = time.perf_counter()
                    evals0, drafted0 = counts["evals"], counts["drafted"]
                if tok in self.eog:
                    finish = "stop"
                    break
                out.append(int(tok))
                if len(out) >= max_tokens:
                    break
        finally:
            gen.close()
        t_end = time.perf_counter()
        t_first = t_first if t_first is not None else t_end
        stats = empty_stats(self.label)
        timed = max(len(out) - 1, 0)     # the first token came out of the prompt evaluation
        passes = counts["evals"] - evals0
        decode = t_end - t_first
        stats.update(tokens=len(out), prompt_tokens=len(prompt.tokens), prefill_seconds=t_first - t0,
                     decode_seconds=decode, timed_tokens=timed, target_passes=passes,
                     tokens_per_second=timed / decode if decode > 0 else 0.0,
                     drafted=counts["drafted"] - drafted0 if self.pld else 0,
                     accepted=max(timed - passes, 0) if self.pld else 0, finish_reason=finish,
                     extra={k: v for k, v in self.options.items()})
        if passes:
            stats["accepted_per_pass"] = stats["accepted"] / passes
            stats["tokens_per_pass"] = timed / passes
        text = llm.detokenize(out).decode("utf-8", "replace")
        return Outcome(tokens=out, text=text, stats=stats)

    def close(self) -> None:
        if self.llm is not None:
            try:
                self.llm.close()
            except Exception:  # pragma: no cover - best effort
                pass
            self.llm = None


# ---- llama.cpp binaries -----------------------------------------------------------------------
def check_some_binary(labels: Sequence[str], bin_dir: str | Path | None) -> None:
    """PeerUnavailable, before a model loads, where llama.cpp peers are asked for and none of their
    binaries is in ``bin_dir`` (a wrong folder ran vanilla alone and said so only after the warm-up); one
    binary of several missing is a note when its peer comes up (``--peers llama.cpp`` lists them all)."""
    names = sorted({BIN_VARIANTS[label[len(BIN_PREFIX):]][0] for label in labels if label.startswith(BIN_PREFIX)
                    and label[len(BIN_PREFIX):] in BIN_VARIANTS})
    if names and not any(find_binary(bin_dir, name) for name in names):
        where = bin_dir if bin_dir is not None else "PATH"
        raise PeerUnavailable(f"no llama.cpp binary ({', '.join(names)}) in {where}: build them with "
                              "scripts/build_llama_cpp.sh and pass --llama-cpp-bin DIR")


def find_binary(bin_dir: str | Path | None, name: str) -> Path | None:
    """`name` in DIR, DIR/bin or DIR/build/bin; on PATH when no DIR is given."""
    exe = name + (".exe" if os.name == "nt" else "")
    if bin_dir is None:
        found = shutil.which(exe)
        return Path(found) if found else None
    base = Path(bin_dir).expanduser()
    for cand in (base / exe, base / "bin" / exe, base / "build" / "bin" / exe):
        if cand.is_file() and os.access(cand, os.X_OK):
            return cand
    return None


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_FLOAT = r"([0-9]+(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?|nan|inf)"


def parse_llama_cpp_output(stderr: str) -> dict[str, Any]:
    """Numbers printed by llama-speculative-simple / llama-lookup / llama-lookahead at exit."""
    out: dict[str, Any] = {}
    m = re.search(r"encoded\s+(\d+) tokens in\s+" + _FLOAT + r" seconds", stderr)
    if m:
        out["prompt_tokens"], out["prefill_seconds"] = int(m.group(1)), float(m.group(2))
    m = re.search(r"decoded\s+(\d+) tokens in\s+" + _FLOAT + r" seconds", stderr)
    if m:
        out["decoded"], out["decode_seconds"] = int(m.group(1)), float(m.group(2))
    for key in ("n_draft", "n_predict", "n_drafted", "n_accept"):
        m = re.search(rf"\b{key}\s*=\s*(-?\d+)", stderr)
        if m:
            out[key] = int(m.group(1))
    m = re.search(r"\baccept\s*=\s*" + _FLOAT + "%", stderr)
    if m:
        out["accept_percent"] = float(m.group(1))
    for key in ("W", "N", "G"):
        m = re.search(rf"^\s*(?:\S+:\s*)?{key}\s*=\s*(\d+)\s*$", stderr, re.MULTILINE)
        if m:
            out[key] = int(m.group(1))
    return out


def generated_text(stdout: str, prompt_text: str) -> str:
    """The generated part of a binary's stdout ("\\n\\n" + prompt + generation + "\\n\\n"...)."""
    text = _ANSI.sub("", stdout)
    head = "\n\n" + prompt_text
    if text.startswith(head):
        text = text[len(head):]
    else:
        i = text.find(prompt_text) if prompt_text else -1
        text = text[i + len(prompt_text):] if i >= 0 else text.lstrip("\n")
    for tail in ("\n\n\n\n", "\n\n"):
        if text.endswith(tail):
            return text[:-len(tail)]
    return text


def _bin_cache_type_args(cache_types: Mapping[str, str], *flags: tuple[str, str]) -> list[str]:
    """A binary's flags for the KV cache types that are not llama.cpp's f16 default: a q8_0 cache of ours
    beside a peer's f16 one compared unlike settings."""
    return [arg for name, flag in flags if cache_types.get(name, "f16") != "f16"
            for arg in (flag, cache_types[name])]


def _python_cache_types(cache_types: Mapping[str, str]) -> dict[str, int]:
    """llama_cpp.Llama's type_k/type_v for our KV cache types that are not the f16 default."""
    from ..llama.binding import KV_CACHE_TYPES

    return {name: KV_CACHE_TYPES[cache_types[name]] for name in ("type_k", "type_v")
            if cache_types.get(name, "f16") != "f16"}


class LlamaCppBinPeer(Contender):
    """One llama.cpp example binary run per prompt (greedy), its printed numbers parsed."""

    kind = "peer"

    def __init__(self, label: str, bin_dir: str | Path | None, target: "Model", target_path: str | Path,
                 draft_path: str | Path | None = None, *, n_ctx: int, n_ubatch: int = 512,
                 threads: int | None = None, gpu_layers: int = 0, draft_gpu_layers: int = 0,
                 flash_attn: str = "off", options: dict[str, Any] | None = None, timeout: float = 900.0,
                 main_gpu: int | None = None, cache_types: Mapping[str, str] | None = None):
        variant = label[len(BIN_PREFIX):]
        self.cache_types = dict(cache_types or {})   # type_k, type_v, draft_type_k, draft_type_v: ours
        if variant not in BIN_VARIANTS:
            raise ParameterError(f"unknown llama.cpp variant {variant!r}")
        self.label = label
        self.method = label
        self.variant = variant
        self.baseline = BIN_PREFIX + "vanilla"
        self.options = dict(options or {})
        self.binary_name, self.variant_args = BIN_VARIANTS[variant]
        self.bin_dir = bin_dir
        self.target = target
        self._end_pieces: list[str] | None = None   # the texts of its end-of-generation tokens
        self.target_path = str(target_path)
        self.draft_path = str(draft_path) if draft_path else None
        self.n_ctx = n_ctx
        self.n_ubatch = min(n_ubatch, n_ctx)
        self.threads = threads or os.cpu_count() or 1
        self.gpu_layers = gpu_layers
        self.draft_gpu_layers = draft_gpu_layers
        self.main_gpu = main_gpu   # the models on that GPU alone, as ours (Model's main_gpu)
        self.flash_attn = flash_attn
        self.timeout = timeout
        self._tmp = tempfile.TemporaryDirectory(prefix="ouroboros-bench-")
        self.binary = find_binary(bin_dir, self.binary_name)

    def command(self, prompt_file: str | Path, max_tokens: int) -> list[str]:
        if self.binary is None:
            where = self.bin_dir if self.bin_dir is not None else "PATH"
            raise PeerUnavailable(f"{self.binary_name} not found in {where} (build it with "
                                  "scripts/build_llama_cpp.sh and pass --llama-cpp-bin DIR)")
        cmd = [str(self.binary), "-m", self.target_path, "-f", str(prompt_file), "-n", str(max_tokens),
               "-c", str(self.n_ctx), "-b", str(self.n_ctx), "-ub", str(self.n_ubatch),
               "-t", str(self.threads), "-tb", str(self.threads), "--temp", "0", "--top-k", "1",
               "-s", "1", "-fa", self.flash_attn, "-ngl", _gpu_layers_flag(self.gpu_layers), "--no-escape"]
        if self.main_gpu is not None:
            cmd += ["-sm", "none", "-mg", str(self.main_gpu)]
        cmd += _bin_cache_type_args(self.cache_types, ("type_k", "-ctk"), ("type_v", "-ctv"))
        cmd += self.variant_args
        if self.variant == "draft-simple":
            if not self.draft_path:
                raise PeerUnavailable("llama.cpp:draft-simple needs a draft model (-d)")
            cmd += ["-md", self.draft_path, "-ngld", _gpu_layers_flag(self.draft_gpu_layers),
                    "-td", str(self.threads), "-tbd", str(self.threads)]
            cmd += _bin_cache_type_args(self.cache_types, ("draft_type_k", "-ctkd"), ("draft_type_v", "-ctvd"))
        cmd += bin_option_args(self.label, self.options)
        return cmd

    def _run_binary(self, cmd: list[str]) -> tuple[float, str, str]:
        """Wall seconds, stdout and stderr of a run that exited cleanly."""
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, timeout=self.timeout, check=False)
        except subprocess.TimeoutExpired:
            raise OuroborosError(f"{self.label} timed out after {self.timeout:g}s") from None   # 2.7s, not 3s
        wall = time.perf_counter() - t0
        stderr = proc.stderr.decode("utf-8", "replace")
        if proc.returncode != 0:
            tail = " | ".join(ln for ln in stderr.strip().splitlines()[-3:])
            raise OuroborosError(f"{self.label} exited with {proc.returncode}: {tail}")
        return wall, proc.stdout.decode("utf-8", "replace"), stderr

    def _prompt_command(self, prompt: BuiltPrompt, max_tokens: int) -> list[str]:
        """The command generating after ``prompt``, its text written to the file it reads. The binary
        tokenizes with add_special=true, parse_special=true, as our tokens were made
        (bench.prompts.build_prompts): the same tokens."""
        pfile = Path(self._tmp.name) / "prompt.txt"
        # `-f` drops one trailing newline of the file: add one so the prompt's own survives.
        pfile.write_bytes((prompt.text + "\n").encode("utf-8"))
        return self.command(pfile, max_tokens)

    def run(self, prompt: BuiltPrompt, max_tokens: int) -> Outcome:
        text = prompt.text
        cmd = self._prompt_command(prompt, max_tokens)
        for attempt in (1, 2):
            wall, stdout, stderr = self._run_binary(cmd)
            nums = parse_llama_cpp_output(stderr)
            if "decode_seconds" in nums:
                break
            if attempt == 2:   # llama.cpp's log thread can lose its last lines at exit (seen on a busy VM)
                tail = " | ".join(stderr.strip().splitlines()[-2:])
                raise OuroborosError(f"{self.label}: could not find the timing lines in its output, twice "
                                     f"(it ended with: {tail})")
        n = nums.get("n_predict", nums.get("decoded", 0))
        acc = nums.get("n_accept", 0)
        if self.binary_name == "llama-speculative-simple":
            tokens, timed, passes = n, n, n - acc          # first token comes from a timed decode
        elif self.binary_name == "llama-lookahead":
            tokens, timed, passes = n + 1, n, n - acc      # first token sampled from the prompt's logits
        else:  # llama-lookup
            tokens, timed, passes = n, max(n - 1, 0), max(n - 1 - acc, 0)
        generated = generated_text(stdout, text)
        if 0 < n <= max_tokens:   # only an end token stops them before they pass the budget
            # they count it (ours do not; its pass counts for both), llama-lookup and llama-lookahead
            # print it, and llama-lookup goes on with the draft tokens it accepted after it
            generated, after = self._cut_at_end_piece(generated)
            tokens, timed = max(tokens - 1 - after, 0), max(timed - 1 - after, 0)
        decode = nums["decode_seconds"]
        stats = empty_stats(self.label)
        stats.update(tokens=tokens, timed_tokens=timed, prompt_tokens=nums.get("prompt_tokens", len(prompt.tokens)),
                     prefill_seconds=nums.get("prefill_seconds", 0.0), decode_seconds=decode,
                     tokens_per_second=timed / decode if decode > 0 else 0.0, target_passes=passes,
                     drafted=nums.get("n_drafted", 0), accepted=acc, finish_reason="",
                     extra={"wall_seconds": wall, "command": " ".join(cmd[1:]), **{
                         k: v for k, v in nums.items() if k in ("n_draft", "accept_percent", "W", "N", "G")}})
        if passes > 0:
            stats["accepted_per_pass"] = acc / passes
            stats["tokens_per_pass"] = timed / passes
        return Outcome(tokens=None, text=generated, stats=stats, compare="text")

    def _cut_at_end_piece(self, text: str) -> tuple[str, int]:
        """The text of a run that stopped on an end token, up to the first end token it printed
        (``<|im_end|>``; our texts never hold it), and how many tokens it printed after that one."""
        if self._end_pieces is None:
            self._end_pieces = [p for p in {self.target.token_text(t) for t in self.target.eog_tokens} if p]
        found = [(i, piece) for piece in self._end_pieces if (i := text.find(piece)) >= 0]
        if not found:
            return text, 0
        i, piece = min(found, key=lambda hit: (hit[0], -len(hit[1])))
        tail = text[i + len(piece):]
        after = len(self.target.tokenize(tail, add_special=False, parse_special=True)) if tail else 0
        return text[:i], after

    def warmup(self, prompt: BuiltPrompt) -> None:
        """A run that pulls the model into the page cache; its numbers are not used, so its log need not
        hold the timing lines (a warm-up's lost lines once dropped the peer from the whole run)."""
        self._run_binary(self._prompt_command(prompt, 4))

    def close(self) -> None:
        self._tmp.cleanup()
