"""`ouroboros-local doctor`: what llama.cpp was built with, what it sees, and whether a pair fits."""

from __future__ import annotations

import argparse
import os
import platform
import time
from typing import TYPE_CHECKING, Sequence

from .errors import ModelError, ParameterError

if TYPE_CHECKING:  # pragma: no cover
    from .llama import Device

OMP_SETTINGS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
# bytes per element of each KV cache type the CLI offers (blocks of 32 with their scales where quantised)
KV_TYPE_BYTES = {"f32": 4.0, "f16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32, "q4_1": 20 / 32,
                 "q5_0": 22 / 32, "q5_1": 24 / 32}


def load_lines(asked: int | None = None) -> list[str]:
    """What the CPU's load is now and the thread count it makes the default (or -t's, ``asked``)."""
    from .cpu_load import busy_cores_now, idle_threads, math_cores, usable_cores

    cores, busy, math = usable_cores(), busy_cores_now(reuse=0.0), math_cores()
    try:
        average = "; load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())
    except (AttributeError, OSError):  # pragma: no cover
        average = ""
    threads = idle_threads(cores, busy, math.count)
    now = "unknown" if busy is None else f"other processes keep {busy:.1f} of {cores} usable cores busy now"
    if threads == cores:
        why = "every usable core"
    elif threads == math.count:   # as llama.cpp's own default
        why = f"one per {math.kind[:-1]} ({math.count} of {cores}: a second thread on a core adds no speed)"
    else:
        why = "the idle cores (a thread on a busy core stalls the rest)"
    waits = ", ".join(f"{name}={os.environ.get(name, 'unset')}" for name in OMP_SETTINGS)
    default = f"{threads} by default, {why}; os.cpu_count() = {os.cpu_count()}"
    if not asked:   # None or 0: the default
        chosen = f"threads: {default}; -t N overrides"
    else:
        chosen = f"threads: {asked} (-t; {default})"
        if asked > cores:
            chosen += (f": more than the {cores} usable cores, so threads share cores and wait for each other "
                       "at every step, slowing decoding down")
        elif asked > math.count:
            chosen += (f": more than the {math.count} {math.kind}, so some threads share a core's arithmetic "
                       "units with another, which adds no speed and makes every step wait for the slowest")
    return [f"load: {now}{average}",
            chosen,
            f"OpenMP waiting: {waits} (PASSIVE: no stalls beside another llama.cpp process, but a "
            "small model runs ~35% slower on a quiet 2-core CPU)"]


def main_gpu_line(main_gpu: int | None, gpus: Sequence["Device"]) -> str | None:
    """Where the models go among several GPUs (``--main-gpu``); None where there is nothing to say."""
    if main_gpu is None:
        if len(gpus) < 2:
            return None
        return f"GPUs: the models' layers are split across all {len(gpus)} (--main-gpu N: both on GPU N alone)"
    from .llama import chosen_gpu

    try:
        gpu = chosen_gpu(main_gpu, gpus)
    except ModelError as e:
        return f"refused: {e}"
    if gpu is None:
        return f"--main-gpu {main_gpu}: llama.cpp sees no GPU here, so the models run on the CPU"
    return f"--main-gpu {main_gpu}: both models on {gpu.description or gpu.name} alone"


def rounds_line(cuda: bool) -> str:
    """How many tokens a round decodes by default here (``EngineConfig.round_size``)."""
    from .engine_config import CUDA_ROUND_SIZE

    if cuda:
        return (f"rounds: {CUDA_ROUND_SIZE} tokens each by default where every layer of the target is on the CUDA "
                "GPU (one batch shape keeps llama.cpp's CUDA graph); --round-size 0: each round its draft's size")
    return ("rounds: each its draft's size by default (rounds of one size pay on CUDA GPUs, whose graphs a new "
            "batch shape rebuilds; --round-size K sets one)")


def flash_attention_line(gpu: bool) -> str:
    """Flash attention's default here (``EngineConfig.flash_attn``, ``engine_config.default_flash_attn``)."""
    if gpu:
        return ("flash attention: auto by default for a model with layers on the GPU (llama.cpp's own default); "
                "off for one on the CPU (bit-reproducible greedy output); --flash-attn sets it")
    return "flash attention: off by default on the CPU (bit-reproducible greedy output); --flash-attn sets it"


def huge_pages_line(enabled: bool = True, models: Sequence[tuple[str, int]] = ()) -> str:
    """Whether this run's weights kept on the CPU go into 2 MiB pages (llama/huge_pages.py): ``enabled`` is
    --huge-pages, ``models`` (label, file size) those that ``huge_pages.worth_it`` judges."""
    import mmap

    from .llama import huge_pages

    mode, small = huge_pages.setting(), f"{mmap.PAGESIZE // 1024} KiB pages"
    if not huge_pages.available():   # Apple Silicon's pages are 16 KiB
        return f"huge pages: not available (transparent huge pages: {mode}); weights are mapped in {small}"
    if not enabled:
        return (f"huge pages: off (--no-huge-pages): weights are mapped from the file in {small}, as llama.cpp "
                f"does (transparent huge pages: {mode})")
    share = huge_pages.MEMORY_SHARE
    mapped = [label for label, size in models if not huge_pages.worth_it(size)]
    line = (f"huge pages: weights kept on the CPU are read into 2 MiB pages (transparent huge pages: {mode}; "
            f"models up to {share:.0%} of the available memory); --no-huge-pages maps them")
    if mapped:   # read in, a large model's weights could not be paged back to the file under pressure
        line += (f"; the {' and the '.join(mapped)} {'is' if len(mapped) == 1 else 'are'} larger than that, "
                 f"so mapped in {small}")
    return line


def memory_fix(available: float, target: float, target_kv: float, draft: float, draft_kv: float,
               compute: float) -> str:
    """Which part keeps the models (bytes: weights with their overhead, KV caches, compute buffers) from
    fitting in ``available`` bytes, and the change that makes them fit."""
    if target + compute >= available:
        return (f"the target's weights alone, with the compute buffers, need {(target + compute) / 2**30:.1f} "
                "GiB: a smaller model or quantisation")
    if draft and target + target_kv + compute < available:
        return "the target alone fits: run without the draft (no -d)"
    return ("the KV cache: a smaller -c or a quantised KV cache (--cache-type-k/-v q8_0) needs less"
            + (", as does no draft" if draft else ""))


def cmd_doctor(args: argparse.Namespace) -> int:
    import llama_cpp

    from . import __version__
    from .catalogue import default_draft_for, resolve_draft_spec, resolve_model
    from .cli import engine_config_from_args, trained_context_note
    from .engine_config import MAX_CTX, has_cuda_gpu
    from .gguf_file import validate_gguf
    from .llama import Model, devices, huge_pages, offload_gpus, supports_gpu_offload, system_info
    from .pairs import check_pair

    if args.ctx_size < 0:
        raise ParameterError("-c/--ctx-size must be >= 0 (0: the model's trained context)")
    # the flags checked as generate checks them (a --main-gpu -1 or -b -1 got a clean report)
    # (-c past what generate takes is left to the memory verdict below)
    engine_config_from_args(argparse.Namespace(**{**vars(args), "ctx_size": min(args.ctx_size or 4096, MAX_CTX)}))
    print(f"ouroboros-local {__version__}, llama-cpp-python {llama_cpp.__version__}, "
          f"Python {platform.python_version()} on {platform.system()} {platform.machine()}")
    print(f"llama.cpp system info: {system_info().strip()}")
    gpu = supports_gpu_offload()
    print(f"GPU offload: {'available' if gpu else 'not available (CPU build: --gpu-layers is ignored)'}")
    found = devices()
    for i, dev in enumerate(found):
        # a CPU's figure is llama.cpp's view of RAM, which the "memory available" line below gives better
        memory = (f", {dev.memory_free / 2**30:.1f} of {dev.memory_total / 2**30:.1f} GiB free"
                  if dev.memory_total and dev.kind != "cpu" else "")
        print(f"device {i}: {dev.name} ({dev.kind}: {dev.description}{memory})")
    line = main_gpu_line(args.main_gpu, offload_gpus(found))
    if line:
        print(line)
    print(rounds_line(gpu and has_cuda_gpu(found)))
    print(flash_attention_line(gpu))
    for line in load_lines(args.threads):
        print(line)
    args.draft = resolve_draft_spec(args.model, args.draft)   # -d auto: the target's default draft
    suggested = None if args.draft else default_draft_for(args.model)
    # each resolved once (a catalogue model may be hashed) and its path reused below
    paths = {label: resolve_model(spec, progress=True) for label, spec in (("target", args.model),
                                                                          ("draft", args.draft)) if spec}
    infos = {label: validate_gguf(path) for label, path in paths.items()}
    available, source = huge_pages.memory_available(), ""
    if available is None:   # no /proc/meminfo (macOS, Windows): llama.cpp's figure for the CPU's memory
        available = next((dev.memory_free for dev in found if dev.kind == "cpu" and dev.memory_free), None)
        source = " (llama.cpp's figure for the CPU device)"
    print(huge_pages_line(args.huge_pages, [(label, info.file_size) for label, info in infos.items()]))
    if available:
        print(f"memory available: {available / 2**30:.1f} GiB{source}")
    n_ctx = args.ctx_size   # 0: each model's trained context
    # bytes per cached element of each model's -ctk/-ctv types against F16's 2 (keys and values taken as alike)
    kv_types = {"target": (args.cache_type_k, args.cache_type_v),
                "draft": (args.draft_cache_type_k, args.draft_cache_type_v)}
    weights, kv = {"draft": 0.0}, {"draft": 0.0}
    for label, info in infos.items():
        path = paths[label]
        weights[label] = info.file_size * 1.1
        kv_scale = sum(KV_TYPE_BYTES[kind] for kind in kv_types[label]) / 4
        kv[label] = (info.kv_bytes_per_token or 0) * (n_ctx or info.context_length or 0) * kv_scale
        print(f"{label}: {path} ({info.arch}, vocab {info.n_vocab}, {info.file_size / 2**20:.0f} MiB, "
              f"trained context {info.context_length})")
        if label == "target":
            trained = info.context_length or 0
            note = trained_context_note(n_ctx, trained)
            if note:
                print(note)
        if label == "draft":
            started = time.perf_counter()
            Model(path, n_gpu_layers=0).close()
            print(f"draft cost: about {info.file_size * 1.1 / 2**30:.1f} GiB more memory, "
                  f"{time.perf_counter() - started:.1f} s more to load (now); auto leaves it idle where "
                  "drafting does not pay on this machine")
    from .learned import describe

    print(describe(paths["target"], paths.get("draft")))
    if suggested:
        print(f"draft: none given; this target's same-family draft is {suggested} (-d auto): "
              "measure with `bench` before adopting it (docs/benchmarks.md)")
    if args.draft:
        report = check_pair(paths["target"], paths["draft"])
        print("pair: " + ("same vocabulary (speculative, ouroboros, pearl, auto)" if report.compatible
                          else f"different vocabularies, drafts go through text (speculative, ouroboros, auto): "
                               f"{report.reason}"))
        # the curves do not depend on the context: a small one (-c 0 took 128k)
        small = argparse.Namespace(**{**vars(args), "model": paths["target"], "draft": paths["draft"],
                                      "ctx_size": min(n_ctx or trained or 4096, 4096)})
        print(pair_speed_line(small, through_text=not report.compatible))
    # weights, the KV cache of -c tokens (each model's cache types; once ignored: -c 99999999 "fit" and then
    # failed to allocate) and an allowance for llama.cpp's compute buffers
    compute = 512 * 2**20
    total_weights, total_kv = sum(weights.values()), sum(kv.values())
    need = total_weights + total_kv + compute
    parts = (f"weights {total_weights / 2**30:.1f}, KV cache of {n_ctx or 'the trained'} tokens "
             f"{total_kv / 2**30:.1f}, compute buffers {compute / 2**30:.1f}")   # the parts add up to the whole
    gpu_free = sum(dev.memory_free for dev in found if dev.kind in ("gpu", "igpu"))
    if total_weights and gpu and gpu_free:
        verdict = "fits" if need < gpu_free else "does NOT fit (offload fewer layers: --gpu-layers N, or a smaller -c)"
        print(f"memory: the models need about {need / 2**30:.1f} GiB ({parts}): {verdict} in free GPU memory")
    elif total_weights and available:
        fix = memory_fix(available, weights["target"], kv["target"], weights["draft"], kv["draft"], compute)
        verdict = "fits" if need < available else f"does NOT fit ({fix})"
        print(f"memory: the models need about {need / 2**30:.1f} GiB ({parts}): {verdict} in available memory")
    return 0


def pair_speed_line(args: argparse.Namespace, through_text: bool = False) -> str:
    """Can the draft pay here at all? Both models' calibrated curves (cached, else measured: seconds).
    ``through_text``: the draft's vocabulary is another, each step's text counted as MAX_TARGET_PER_DRAFT
    target tokens (the scheduler's floor too)."""
    from .cli import _engine_from_args
    from .proposers.cross_vocab import MAX_TARGET_PER_DRAFT
    from .scheduler import MIN_GAIN, draft_ceiling

    with _engine_from_args(args) as engine:
        target, draft = engine.cost_model(), engine.draft_cost_model()
    if draft is None:
        return "pair speed: not measured (calibration is off)"
    per_step = MAX_TARGET_PER_DRAFT if through_text else 1.0
    ceiling = draft_ceiling(target, draft, tokens_per_step=per_step)
    # counted, not bounded: Chinese from a Qwen draft spells 3-4 SmolLM2 tokens (code 1.3)
    text = (f" (its text counted as {per_step:g} target tokens: more where the target's vocabulary spells it in "
            "more pieces, as CJK)" if through_text else "")
    head = (f"pair speed: one draft step costs {draft.cost(1) / target.cost(1):.2f} target steps{text}, "
            f"verifying 4 tokens {target.ratio(4):.2f} (calibrated); if every draft token were accepted, a "
            f"draft model would reach {ceiling:.2f}x of plain decoding at best")
    if ceiling < 1.0:
        return head + ": it cannot pay on this machine, and auto leaves it idle"
    if ceiling < MIN_GAIN:   # the scheduler's bar: a ceiling this near 1 is lost to real acceptance
        return head + f": under the {MIN_GAIN:.2f}x a draft must promise, so auto leaves it idle"
    return head + ": measure the real acceptance with `bench` (docs/benchmarks.md)"


def register(sub, add_model_args, add_sampling_args, add_method_args) -> None:
    p = sub.add_parser("doctor", help="report the llama.cpp backend, devices, threads and memory fit")
    add_model_args(p)
    p.set_defaults(func=cmd_doctor)
