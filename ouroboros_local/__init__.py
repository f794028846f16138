"""ouroboros-local: faster local generation with GGUF models, without changing what the model writes
(every token is the target's own choice, up to near-ties that batched kernels flip: README, Exactness)."""

__version__ = "0.1.0"

from typing import TYPE_CHECKING  # noqa: E402

from .errors import (ContextOverflowError, IncompatiblePairError, MethodOptionError, ModelError,  # noqa: E402
                     OuroborosError, ParameterError, PoolError)

if TYPE_CHECKING:   # what editors and type checkers see of the lazy names below
    from .engine import Engine
    from .engine_config import EngineConfig
    from .generation import GenerationResult, GenerationStats, StreamEvent
    from .sampling import SamplingParams
else:   # hidden from type checkers: a module __getattr__ made every unknown name Any for them
    def __getattr__(name: str) -> object:
        # The engine imports llama.cpp and sampling numpy: both load lazily, so that `import ouroboros_local`
        # stays cheap and the command line parses its arguments, and hears Ctrl-C, within a few milliseconds.
        if name in ("Engine", "EngineConfig", "GenerationResult", "GenerationStats", "StreamEvent"):
            from . import engine

            return getattr(engine, name)
        if name == "SamplingParams":
            from .sampling import SamplingParams

            return SamplingParams
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:   # the lazy names too: tab completion and dir() list them
    return sorted(set(globals()) | set(__all__))


__all__ = ["ContextOverflowError", "Engine", "EngineConfig", "GenerationResult", "GenerationStats",
           "IncompatiblePairError", "MethodOptionError", "ModelError", "OuroborosError", "ParameterError", "PoolError",
           "SamplingParams", "StreamEvent", "__version__"]
