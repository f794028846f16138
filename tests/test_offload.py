"""GPU offload flags: parsed and honoured on a CPU build (0 layers), exercised for real on a GPU build.

The GPU tests run only where llama.cpp was built with a GPU backend (CI has none; they were run on a
lent H100, see scripts/gpu_check.sh). On a GPU, batched kernels differ from one-token kernels, so the
comparison with plain decoding uses the tolerance rule (ouroboros_local/compare.py).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ouroboros_local.cli import _gpu_layers
from ouroboros_local.compare import compare_greedy
from ouroboros_local.engine import Engine, EngineConfig
from ouroboros_local.errors import ParameterError
from ouroboros_local.llama import Model, supports_gpu_offload
from ouroboros_local.proposers import method_names

GPU = supports_gpu_offload()
PROMPT = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n"


def engine_with(target, draft, gpu_layers: int, draft_gpu_layers: int) -> Engine:
    config = EngineConfig(n_ctx=512, n_batch=64, n_seq_max=8, threads=1,
                          gpu_layers=gpu_layers, draft_gpu_layers=draft_gpu_layers)
    return Engine(Model(target, n_gpu_layers=gpu_layers),
                  Model(draft, n_gpu_layers=draft_gpu_layers) if draft else None, config)


@pytest.mark.parametrize("value, layers", [("all", -1), ("-1", -1), ("0", 0), ("12", 12)])
def test_gpu_layer_flag_values(value: str, layers: int) -> None:
    assert _gpu_layers(value) == layers


def test_gpu_layers_auto_follows_the_backend() -> None:
    assert _gpu_layers("auto") == (-1 if GPU else 0)


@pytest.mark.parametrize("backend", [True, False])
def test_the_python_api_offloads_as_the_command_line_does(backend: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """EngineConfig's layers default to the CLI's auto: a Python user on a CUDA build ran on the CPU."""
    import ouroboros_local.engine_config as config_mod

    monkeypatch.setattr(config_mod, "supports_gpu_offload", lambda: backend)
    config = EngineConfig()
    assert config.gpu_layers == config.draft_gpu_layers == (-1 if backend else 0)
    assert EngineConfig(gpu_layers=3, draft_gpu_layers=0).gpu_layers == 3


def test_an_engine_on_a_loaded_model_takes_its_layers_from_the_model(tiny_target, monkeypatch) -> None:
    """A config's default on a GPU build says every layer; a Model loaded without offload holds none.
    The cost curve's key and the overlap's guess before any step is timed follow the model."""
    import ouroboros_local.engine as engine_mod
    import ouroboros_local.engine_config as config_mod

    for module in (engine_mod, config_mod):
        monkeypatch.setattr(module, "supports_gpu_offload", lambda: True)
    config = EngineConfig(n_ctx=256, n_batch=32, n_seq_max=2, threads=1)
    with Engine(Model(tiny_target), None, config) as engine:
        assert engine.config.gpu_layers == -1 and engine.target.n_gpu_layers == 0
        assert engine.calibration_settings()["gpu_layers"] == 0
        assert engine.target_ctx.step_wait_share() is None and not engine._overlap_here()


@pytest.mark.parametrize("bad", ["-2", "many", "1.5", ""])
def test_bad_gpu_layer_flag_is_refused(bad: str) -> None:
    with pytest.raises(ParameterError, match="--gpu-layers"):
        _gpu_layers(bad)


def test_cli_rejects_bad_gpu_layers_with_one_line(tiny_target, capsys) -> None:
    from ouroboros_local.cli import main

    assert main(["generate", "-m", str(tiny_target), "-p", "x", "-n", "2", "--gpu-layers", "lots"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--gpu-layers" in err[0]
    # the draft's flag is named as the draft's (it said --gpu-layers)
    assert main(["generate", "-m", str(tiny_target), "-p", "x", "-n", "2", "--draft-gpu-layers", "lots"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --draft-gpu-layers takes")


@pytest.mark.skipif(GPU, reason="checks the CPU build's behaviour")
def test_offload_request_on_a_cpu_build_changes_nothing(tiny_target, tiny_draft) -> None:
    with engine_with(tiny_target, tiny_draft, 0, 0) as cpu:
        want = cpu.generate(PROMPT, max_tokens=24, method="speculative").tokens
    with engine_with(tiny_target, tiny_draft, -1, -1) as asked:
        assert asked.target.n_gpu_layers == -1
        assert asked.generate(PROMPT, max_tokens=24, method="speculative").tokens == want


@pytest.mark.skipif(not GPU, reason="llama.cpp has no GPU backend in this build")
@pytest.mark.parametrize("draft_layers", [-1, 0])   # draft on the GPU too, or target on GPU + draft on CPU
def test_offloaded_methods_match_plain_decoding(tiny_target, tiny_draft, draft_layers: int) -> None:
    with engine_with(tiny_target, tiny_draft, -1, draft_layers) as engine:
        prompt_tokens = engine.prompt_tokens(PROMPT)
        base = engine.generate(PROMPT, max_tokens=32, method="vanilla").tokens
        for method in method_names():
            got = engine.generate(PROMPT, max_tokens=32, method=method).tokens
            report = compare_greedy(engine, prompt_tokens, base, got)
            assert report.ok, (method, report)


@pytest.mark.skipif(not GPU, reason="llama.cpp has no GPU backend in this build")
def test_gpu_and_cpu_agree_on_plain_decoding(tiny_target) -> None:
    with engine_with(tiny_target, None, 0, 0) as cpu:
        want = cpu.generate(PROMPT, max_tokens=32, method="vanilla").tokens
    with engine_with(tiny_target, None, -1, 0) as gpu:
        got = gpu.generate(PROMPT, max_tokens=32, method="vanilla").tokens
        report = compare_greedy(gpu, gpu.prompt_tokens(PROMPT), want, got)
        assert report.ok, report


@pytest.mark.skipif(not GPU, reason="llama.cpp has no GPU backend in this build")
def test_a_target_wholly_on_a_cuda_gpu_decodes_rounds_of_one_size(tiny_target) -> None:
    """The default where the whole target is on a CUDA GPU: rounds of CUDA_ROUND_SIZE; on another GPU, or
    with a layer left on the CPU, each round its draft's size."""
    from ouroboros_local.engine_config import CUDA_ROUND_SIZE, has_cuda_gpu
    from ouroboros_local.llama import devices

    with engine_with(tiny_target, None, -1, 0) as gpu:
        assert gpu.config.round_size == (CUDA_ROUND_SIZE if has_cuda_gpu(devices()) else 0)
    with engine_with(tiny_target, None, 1, 0) as split:
        assert split.config.round_size == 0


def test_devices_are_listed_from_a_llama_cpp_built_apart(tmp_path: Path) -> None:
    """With LLAMA_CPP_LIB_PATH naming a llama.cpp built apart and no libraries in the package (how
    scripts/gpu_check.sh runs a CUDA build), the devices come from that build: llama_cpp's own _ggml
    module looks only in the package, so the seventh H200 run found no devices and silently ran without
    rounds of 4."""
    import llama_cpp

    package = Path(llama_cpp.__file__).parent
    shutil.copytree(package, tmp_path / "llama_cpp", ignore=shutil.ignore_patterns("lib", "__pycache__"))
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "LLAMA_CPP_LIB_PATH": str(package / "lib"),
           "PYTHONPATH": os.pathsep.join([str(tmp_path), str(root)])}
    code = ("from ouroboros_local.llama import devices; import llama_cpp, sys; "
            "assert 'lib' not in __import__('os').listdir(llama_cpp.__path__[0]); "
            "print(sorted(d.kind for d in devices()))")
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "cpu" in run.stdout


class _Placed:
    """What ``default_flash_attn`` reads of a model."""

    def __init__(self, n_gpu_layers: int):
        self.n_gpu_layers = n_gpu_layers


@pytest.mark.parametrize("offload, layers, expected", [
    (True, -1, "auto"), (True, 12, "auto"),   # layers on a GPU: llama.cpp's own default there
    (True, 0, "off"),                        # on the CPU: bit-reproducible greedy output
    (False, -1, "off"),                      # a CPU build ignores --gpu-layers
])
def test_flash_attention_follows_llama_cpp_on_a_gpu_and_stays_off_on_a_cpu(
        monkeypatch, offload: bool, layers: int, expected: str) -> None:
    import ouroboros_local.engine_config as config_mod

    monkeypatch.setattr(config_mod, "supports_gpu_offload", lambda: offload)
    assert config_mod.default_flash_attn(_Placed(layers)) == expected


def test_an_engine_resolves_flash_attention_and_keeps_a_setting_given(tiny_target) -> None:
    with engine_with(tiny_target, None, 0, 0) as cpu:
        assert cpu.config.flash_attn == "off"
    config = EngineConfig(n_ctx=512, n_batch=64, n_seq_max=8, threads=1, flash_attn="on")
    with Engine(Model(tiny_target), None, config) as chosen:
        assert chosen.config.flash_attn == "on"


def _fake_gpus(n: int) -> list:
    from ouroboros_local.llama.binding import Device

    cpu = Device(name="CPU", description="cpu", kind="cpu", memory_free=0, memory_total=0)
    return [Device(name=f"CUDA{i}", description=f"GPU {i}", kind="gpu", memory_free=0, memory_total=0)
            for i in range(n)] + [cpu]


def test_main_gpu_puts_the_whole_model_on_that_gpu(tiny_target, monkeypatch, caplog) -> None:
    """llama.cpp reads main_gpu only where the model is not split across GPUs: --main-gpu 1 did nothing
    (the layers stayed split across every GPU); one past the GPUs failed as "could not load"."""
    import logging

    import ouroboros_local.llama.binding as binding
    from ouroboros_local.errors import ModelError

    asked: list = []

    def load(path, params):   # the parameters llama.cpp is given; no model comes back
        asked.append((params.split_mode, params.main_gpu))
        return None

    monkeypatch.setattr(binding.lc, "llama_model_load_from_file", load)
    monkeypatch.setattr(binding, "devices", lambda: _fake_gpus(2))
    for main_gpu, want in ((1, (binding.lc.LLAMA_SPLIT_MODE_NONE, 1)), (None, (binding.lc.LLAMA_SPLIT_MODE_LAYER, 0))):
        with pytest.raises(ModelError, match="could not load"):
            Model(tiny_target, n_gpu_layers=-1, main_gpu=main_gpu)
        assert asked.pop() == want
    with pytest.raises(ModelError, match=r"no GPU 2 \(--main-gpu\): llama.cpp sees 2 \(0: GPU 0, 1: GPU 1\)"):
        Model(tiny_target, n_gpu_layers=-1, main_gpu=2)
    assert not asked                                       # refused before loading
    monkeypatch.setattr(binding, "devices", lambda: _fake_gpus(0))
    monkeypatch.setattr(binding, "_said_no_gpu", set())
    with caplog.at_level(logging.WARNING, logger="ouroboros_local"), pytest.raises(ModelError):
        Model(tiny_target, n_gpu_layers=-1, main_gpu=1)
    assert asked.pop()[0] == binding.lc.LLAMA_SPLIT_MODE_LAYER and "sees no GPU" in caplog.text


def test_main_gpu_reaches_the_llama_cpp_peers(tiny_target, tmp_path) -> None:
    from ouroboros_local.bench.peers import LlamaCppBinPeer

    model = Model(tiny_target, vocab_only=True)
    try:
        for main_gpu, tail in ((1, ["-sm", "none", "-mg", "1"]), (None, [])):
            peer = LlamaCppBinPeer("llama.cpp:vanilla", tmp_path, model, tiny_target, n_ctx=256, main_gpu=main_gpu)
            peer.binary = tmp_path / "llama-cli"
            command = peer.command(tmp_path / "p.txt", 8)
            assert (command[command.index("-sm"):command.index("-sm") + 4] if "-sm" in command else []) == tail
    finally:
        model.close()


def test_doctor_says_where_main_gpu_puts_the_models() -> None:
    from ouroboros_local.doctor import main_gpu_line
    from ouroboros_local.llama import offload_gpus

    two = offload_gpus(_fake_gpus(2))
    assert [g.name for g in two] == ["CUDA0", "CUDA1"]
    assert main_gpu_line(None, offload_gpus(_fake_gpus(1))) is None        # one GPU: nothing to choose
    assert "split across all 2" in main_gpu_line(None, two)
    assert main_gpu_line(1, two).endswith("both models on GPU 1 alone")
    assert main_gpu_line(2, two) == "refused: there is no GPU 2 (--main-gpu): llama.cpp sees 2 (0: GPU 0, 1: GPU 1)"
    assert "sees no GPU here" in main_gpu_line(0, offload_gpus(_fake_gpus(0)))


def test_doctor_says_a_draft_under_the_schedulers_bar_stays_idle(monkeypatch) -> None:
    """The scheduler retires a draft whose ceiling is under MIN_GAIN (1.05x); doctor said "measure it with
    bench" of a ceiling between 1 and that, a draft auto never asks."""
    import argparse
    import contextlib
    from types import SimpleNamespace

    from ouroboros_local import cli, doctor, scheduler
    from ouroboros_local.calibration import CostModel

    engine = SimpleNamespace(cost_model=CostModel.flat, draft_cost_model=CostModel.flat)
    monkeypatch.setattr(cli, "_engine_from_args", lambda args: contextlib.nullcontext(engine))
    lines = {}
    for ceiling in (0.98, 1.02, 1.2):
        monkeypatch.setattr(scheduler, "draft_ceiling", lambda target, draft, **kw: ceiling)
        lines[ceiling] = doctor.pair_speed_line(argparse.Namespace())
    assert lines[0.98].endswith("cannot pay on this machine, and auto leaves it idle")
    assert lines[1.02].endswith(f"under the {scheduler.MIN_GAIN:.2f}x a draft must promise, so auto leaves it idle")
    assert lines[1.2].endswith("measure the real acceptance with `bench` (docs/benchmarks.md)")


def test_doctor_prices_a_draft_of_another_vocabulary_too(tiny_target, tiny_other_vocab, capsys) -> None:
    """doctor printed no pair speed for a draft of another vocabulary (SmolLM2-135M's target, Qwen-0.5B's
    draft: 3 target steps a draft token), and said nothing of which methods take it."""
    from ouroboros_local import cli

    assert cli.main(["doctor", "-m", str(tiny_target), "-d", str(tiny_other_vocab), "-t", "1"]) == 0
    out = capsys.readouterr().out
    assert "pair: different vocabularies, drafts go through text (speculative, ouroboros, auto)" in out
    assert "pair speed: one draft step costs" in out and "(its text counted as 1.5 target tokens" in out


def test_a_build_without_offload_keys_one_curve_whatever_the_layers_asked(tiny_target, monkeypatch) -> None:
    """doctor says --gpu-layers is ignored on a CPU build; each value still measured its own curve."""
    import ouroboros_local.engine as engine_mod
    import ouroboros_local.engine_config as config_mod

    config = EngineConfig(n_ctx=256, n_batch=32, n_seq_max=2, threads=1)
    for backend, expected in ((False, 0), (True, 3)):
        for module in (engine_mod, config_mod):   # the engine's key, and its defaults (flash attention)
            monkeypatch.setattr(module, "supports_gpu_offload", lambda: backend)
        with Engine(Model(tiny_target, n_gpu_layers=3), None, config) as engine:
            assert engine.calibration_settings()["gpu_layers"] == expected
