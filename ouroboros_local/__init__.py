"""ouroboros-local: faster local generation with GGUF models, without changing what the model writes
(every token is the target's own choice, up to near-ties that batched kernels flip: README, Exactness)."""

__version__ = "0.1.0"

from .errors import (ContextOverflowError, IncompatiblePairError, MethodOptionError, ModelError,  # noqa: E402
                     OuroborosError, ParameterError, PoolError)
from .sampling import SamplingParams  # noqa: E402


def __getattr__(name: str):
    # The engine imports llama.cpp; load it lazily so `import ouroboros_local` stays cheap.
    if name in ("Engine", "EngineConfig", "GenerationResult", "GenerationStats", "StreamEvent"):
        from . import engine

        return getattr(engine, name)
    raise AttributeError(name)


__all__ = ["ContextOverflowError", "Engine", "EngineConfig", "GenerationResult", "GenerationStats",
           "IncompatiblePairError", "MethodOptionError", "ModelError", "OuroborosError", "ParameterError", "PoolError",
           "SamplingParams", "StreamEvent", "__version__"]
