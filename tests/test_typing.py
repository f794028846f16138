"""What type checkers see of the public API: the lazy names' real types, and the documented inputs the
runtime takes (mypy --strict once passed typos as Any and refused a Path-like, a TypedDict message, ...)."""

from __future__ import annotations

import ast
import inspect
import os
import subprocess
import sys
import types
import typing
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from ouroboros_local import server
from ouroboros_local.engine import Engine, EngineConfig


class PathSpec:   # an os.PathLike that is not a Path
    def __init__(self, path: Path) -> None:
        self.path = path

    def __fspath__(self) -> str:
        return str(self.path)


class MyEngine(Engine):
    pass


def test_package_getattr_is_hidden_from_type_checkers_but_lazy_names_resolve() -> None:
    """A module-level __getattr__ seen by mypy made every unknown name (``from ouroboros_local import
    Engin``) Any; it is defined only at runtime, where it still loads the engine and numpy when first used."""
    for module in ("ouroboros_local", "ouroboros_local.testing", "ouroboros_local.server"):
        tree = ast.parse(Path(sys.modules[module].__file__ or "").read_text())
        top_level = [node.name for node in tree.body if isinstance(node, ast.FunctionDef)]
        assert "__getattr__" not in top_level, f"{module}: __getattr__ belongs under `if not TYPE_CHECKING`"
    code = ("import sys, ouroboros_local, ouroboros_local.server, ouroboros_local.testing as t\n"
            "assert 'numpy' not in sys.modules and 'llama_cpp' not in sys.modules, 'imported eagerly'\n"
            "names = [getattr(ouroboros_local, n) for n in ouroboros_local.__all__]\n"
            "names += [getattr(t, n) for n in t.__all__] + [t.tiny_models, ouroboros_local.server.ServerConfig]\n"
            "for mod, typo in ((ouroboros_local, 'Engin'), (t, 'write_tiny'), (ouroboros_local.server, 'Nope')):\n"
            "    try:\n"
            "        getattr(mod, typo)\n"
            "    except AttributeError:\n"
            "        pass\n"
            "    else:\n"
            "        raise SystemExit(typo + ' resolved')\n"
            "print(ouroboros_local.Engine.__module__, ouroboros_local.server.ServerConfig.__module__)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["ouroboros_local.engine", "ouroboros_local.server.app"]


def test_server_create_app_has_the_real_signature() -> None:
    """It was (*args: Any, **kwargs: Any) -> Any: create_app() and create_app(engine, {...}) type-checked."""
    sig = inspect.signature(server.create_app)
    assert list(sig.parameters) == ["engine", "config"]
    assert sig.parameters["engine"].annotation == "Engine"
    assert sig.parameters["config"].annotation == "ServerConfig | None"
    assert sig.parameters["config"].default is None
    assert sig.return_annotation == "FastAPI"
    assert "ServerConfig" not in server.__all__   # a star import without FastAPI failed
    assert server.ServerConfig.__name__ == "ServerConfig"


def test_engine_annotations_take_what_the_runtime_accepts() -> None:
    load = typing.get_type_hints(Engine.load)
    assert os.PathLike[str] in typing.get_args(load["target"]) and os.PathLike[str] in typing.get_args(load["draft"])
    for method in (Engine.load, Engine.__enter__):   # a subclass's load and `with` give the subclass
        returned = typing.get_type_hints(method)["return"]
        assert isinstance(returned, typing.TypeVar) and returned.__bound__ is not None, method
    for method in (Engine.apply_chat_template, Engine.chat_prompt, Engine.chat_tokens):   # TypedDict messages
        assert typing.get_type_hints(method)["messages"] == Sequence[Mapping[str, Any]], method
    for method in (Engine.generate, Engine.stream):
        hints = typing.get_type_hints(method)
        assert np.ndarray in typing.get_args(hints["prompt"])
        assert type(None) in typing.get_args(hints["stop"])
        assert Mapping[str, Any] in typing.get_args(hints["options"])
    assert Mapping[str, Any] in typing.get_args(typing.get_type_hints(Engine.prepare)["options"])


def test_the_widened_inputs_work_at_runtime(tiny_target: Path) -> None:
    """What the annotations now admit, the engine takes: a PathLike, a read-only Mapping of options, an
    array of ids, stop=None, and a subclass's load gives the subclass."""
    with MyEngine.load(PathSpec(tiny_target), config=EngineConfig(n_ctx=256, threads=1, calibration="off"),
                       progress=False) as engine:
        assert type(engine) is MyEngine
        ids = engine.chat_tokens([{"role": "user", "content": "hi"}])
        plain = engine.generate(ids, max_tokens=4)
        assert engine.generate(np.asarray(ids), max_tokens=4, stop=None).tokens == plain.tokens
        options = types.MappingProxyType({"gamma": 2})
        assert engine.generate(ids, max_tokens=4, method="prompt-lookup", options=options).tokens == plain.tokens
