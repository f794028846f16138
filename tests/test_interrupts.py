"""Ctrl-C while llama.cpp loads a model or makes a context: it lands in our ctypes callbacks (its log, the
load's progress), where ctypes printed "Exception ignored" and the load went on to the answer, or a lost
return value stopped it with "llama.cpp could not load" a healthy file."""

from __future__ import annotations

import contextlib
import signal

import pytest

from ouroboros_local.llama import Context, ContextParams, Model, binding
from ouroboros_local.llama.interrupts import CtrlC, noted_ctrl_c


def test_a_ctrl_c_within_the_block_is_noted_not_raised() -> None:
    with noted_ctrl_c() as ctrl_c:
        signal.raise_signal(signal.SIGINT)
        total = sum(range(1000))   # bytecode runs: Python's handler has had its turn
    assert total and ctrl_c.noted and not ctrl_c.keep_going(0.5, None)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_programs_own_handler_is_left_in_place(signum) -> None:
    """A chat's "stop the answer", an app's SIGTERM flag (uvicorn's): they run where the signal lands and
    the load goes on. A SIGTERM handler that returned once had its load undone under it (a segfault)."""
    heard: list[int] = []
    previous = signal.signal(signum, lambda signum, frame: heard.append(signum))
    try:
        with noted_ctrl_c() as ctrl_c:
            signal.raise_signal(signum)
            sum(range(1000))
        assert heard == [signum] and not ctrl_c.noted and ctrl_c.keep_going(0.5, None)
        ctrl_c.raise_if_noted(lambda: pytest.fail("a load undone"))
    finally:
        signal.signal(signum, previous)


@pytest.mark.skipif(not hasattr(signal, "SIGHUP"), reason="no SIGTERM handler of Python's own on Windows")
@pytest.mark.parametrize("signum", [signal.SIGTERM, getattr(signal, "SIGHUP", signal.SIGTERM)])
def test_a_termination_the_program_handles_is_noted_and_its_handler_called_after(signum) -> None:
    """The command line ends on SIGTERM and SIGHUP by raising SystemExit in its handler: raised in a load's
    callback, ctypes ignored it, and `serve` stopped during its load went on to serve."""
    def end(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    end.ends_the_program = True   # type: ignore[attr-defined]

    previous = signal.signal(signum, end)
    try:
        with noted_ctrl_c() as ctrl_c:
            signal.raise_signal(signum)
            sum(range(1000))
        assert ctrl_c.noted and not ctrl_c.keep_going(0.5, None) and signal.getsignal(signum) is end
        undone: list[bool] = []
        with pytest.raises(SystemExit) as exc:
            ctrl_c.raise_if_noted(lambda: undone.append(True))
        assert exc.value.code == 128 + signum and undone
    finally:
        signal.signal(signum, previous)


def test_the_command_lines_termination_handler_is_marked_as_ending_it() -> None:
    from ouroboros_local import cli

    assert getattr(cli._exit_for, "ends_the_program", False)


@pytest.mark.parametrize("huge_pages", [False, True])
def test_a_ctrl_c_during_a_load_stops_it_and_is_raised(tiny_target, monkeypatch, huge_pages) -> None:
    @contextlib.contextmanager
    def at_once():
        ctrl_c = CtrlC()
        ctrl_c.signum = signal.SIGINT   # as if Ctrl-C came with the load's first bytes
        yield ctrl_c

    monkeypatch.setattr(binding, "noted_ctrl_c", at_once)
    monkeypatch.setattr(binding.huge_pages_mod, "worth_it", lambda size: huge_pages)
    freed: list[object] = []
    real_free = binding.lc.llama_model_free
    monkeypatch.setattr(binding.lc, "llama_model_free", lambda ptr: freed.append(ptr) or real_free(ptr))
    with pytest.raises(KeyboardInterrupt):   # not "could not load", and not the load going on
        Model(tiny_target, huge_pages=huge_pages)
    assert len(freed) <= 1   # a load the callback did not stop is freed


def test_a_ctrl_c_while_a_context_is_made_frees_it_and_is_raised(tiny_target, monkeypatch) -> None:
    model = Model(tiny_target)
    try:
        @contextlib.contextmanager
        def at_once():
            ctrl_c = CtrlC()
            yield ctrl_c
            ctrl_c.signum = signal.SIGINT

        monkeypatch.setattr(binding, "noted_ctrl_c", at_once)
        freed: list[object] = []
        real_free = binding.lc.llama_free
        monkeypatch.setattr(binding.lc, "llama_free", lambda ptr: freed.append(ptr) or real_free(ptr))
        with pytest.raises(KeyboardInterrupt):
            Context(model, ContextParams(n_ctx=256, n_batch=32, n_seq_max=1, n_threads=1))
        assert len(freed) == 1
    finally:
        model.close()


def test_a_ctrl_c_while_the_command_line_imports_ends_it_quietly(monkeypatch, capsys) -> None:
    """The command's modules take a few hundred ms to import; a Ctrl-C then printed a traceback."""
    import sys

    from ouroboros_local.__main__ import main

    class CtrlCOnImport:
        def find_spec(self, name, path=None, target=None):
            if name == "ouroboros_local.cli":
                raise KeyboardInterrupt
            return None

    monkeypatch.delitem(sys.modules, "ouroboros_local.cli", raising=False)
    monkeypatch.setattr(sys, "meta_path", [CtrlCOnImport(), *sys.meta_path])
    assert main() == 130
    assert capsys.readouterr().err == "interrupted\n"


def test_a_termination_python_swallowed_during_the_load_still_ends_the_command(tiny_target, monkeypatch) -> None:
    """_exit_for's SystemExit, raised inside a callback (importlib's module lock's), was printed as
    "Exception ignored" and the command went on: a server stopped while it loaded went on to serve."""
    import ouroboros_local.engine as engine_module
    from ouroboros_local import cli

    real_load = engine_module.Engine.load

    def load(*args, **kwargs):
        try:
            cli._exit_for(signal.SIGTERM, None)
        except SystemExit:   # what Python does with it in a callback
            pass
        return real_load(*args, **kwargs)

    monkeypatch.setattr(engine_module.Engine, "load", load)
    with pytest.raises(SystemExit) as ended:
        cli.main(["generate", "-m", str(tiny_target), "-p", "hi", "-n", "2", "--method", "vanilla"])
    assert ended.value.code == 128 + signal.SIGTERM
    monkeypatch.setattr(engine_module.Engine, "load", real_load)   # the next command starts afresh
    assert cli.main(["generate", "-m", str(tiny_target), "-p", "hi", "-n", "2", "--method", "vanilla"]) == 0


def test_a_missing_dependency_is_one_line_naming_what_to_install(tiny_target, monkeypatch, capsys) -> None:
    """A broken install (tqdm, filelock, numpy, gguf missing) ended every model command in a traceback."""
    import builtins

    from ouroboros_local import cli

    real_import = builtins.__import__

    def missing_hub(name, *args, **kwargs):
        if name.split(".")[0] == "huggingface_hub":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(cli, "_engine_from_args", lambda *a, **kw: missing_hub("huggingface_hub.utils"))
    assert cli.main(["generate", "-m", str(tiny_target), "-p", "hi", "-n", "2", "--method", "vanilla"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "huggingface_hub is missing" in err and "pip install huggingface-hub" in err


def test_a_llama_cpp_python_that_lacks_a_function_is_said_at_import() -> None:
    """An older build failed with an AttributeError deep in a load, or after a calibration."""
    import re
    from pathlib import Path
    from types import SimpleNamespace

    from ouroboros_local.errors import OuroborosError

    used = set()
    for module in ("binding.py", "huge_pages.py", "interrupts.py"):
        used |= set(re.findall(r"\blc\.([A-Za-z_]\w*)", (Path(binding.__file__).parent / module).read_text()))
    assert used - {"_lib"} <= set(binding._NEEDED)   # a name used is a name checked
    older = SimpleNamespace(**{name: None for name in binding._NEEDED if name != "llama_memory_seq_rm"})
    with pytest.raises(OuroborosError, match="lacks llama_memory_seq_rm: pip install 'llama-cpp-python>="):
        binding.check_names(older)
    binding.check_names(SimpleNamespace(**{name: None for name in binding._NEEDED}))


def test_the_command_line_inside_a_program_that_set_logging_up_prints_each_line_once(tiny_target, monkeypatch,
                                                                                      capsys) -> None:
    """A notebook's basicConfig, then cli.main: "loading ..." printed twice, then at every later load."""
    import logging

    from ouroboros_local import cli

    library = logging.getLogger("ouroboros_local")
    monkeypatch.setattr(library, "handlers", [])
    root = logging.getLogger()
    handler = logging.StreamHandler()   # to stderr, as basicConfig's
    monkeypatch.setattr(root, "handlers", [handler])
    assert cli.main(["generate", "-m", str(tiny_target), "-p", "hi", "-n", "2", "--method", "vanilla"]) == 0
    assert capsys.readouterr().err.count("loading ") == 1
