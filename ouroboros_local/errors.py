"""User-facing errors: the CLI prints `str(error)` as one line, with no traceback."""


class OuroborosError(Exception):
    """Base class for every error that is the user's to fix (bad file, bad parameter, ...)."""


class ModelError(OuroborosError):
    """A model file is missing, unreadable, truncated, not a GGUF, or of an unsupported kind."""


class IncompatiblePairError(OuroborosError):
    """Draft and target vocabularies differ, so same-vocabulary drafting is impossible. ``options``: the
    method options at fault where it is they the pair refuses, not the method."""

    def __init__(self, message: str, options: tuple[str, ...] = ()):
        super().__init__(message)
        self.options = options


class ContextOverflowError(OuroborosError):
    """The prompt (plus the room generation needs) does not fit the context window."""

    def __init__(self, message: str, n_tokens: int | None = None, at_least: bool = False):
        super().__init__(message)
        self.n_tokens = n_tokens   # the text's tokens, where they were counted
        self.at_least = at_least   # n_tokens is a lower bound: the text was too long to be worth counting

    @property
    def counted(self) -> str:
        return counted(self.n_tokens or 0, self.at_least)


def counted(n_tokens: int, at_least: bool = False) -> str:
    """A token count as a message says it ("4100", "at least 70000")."""
    return f"{'at least ' if at_least else ''}{n_tokens}"


def clipped(text: str, limit: int = 80) -> str:
    """``text`` for a one-line message: its first ``limit`` characters, and "..." where it goes on (a
    file name past the system's limit is thousands of characters)."""
    return text if len(text) <= limit else text[:limit] + "..."


LLAMA_CPP_PYTHON = "llama-cpp-python>=0.3.36"   # what the binding needs (llama/binding.py checks its names)
_PIP_NAMES = {"llama_cpp": f"'{LLAMA_CPP_PYTHON}'", "huggingface_hub": "huggingface-hub"}


def missing_module(exc: ModuleNotFoundError) -> str:
    """A one-line message for a dependency that cannot be imported (a broken or partial install)."""
    name = (exc.name or "").split(".")[0] or "a module"
    return (f"{name} is missing ({exc}): pip install {_PIP_NAMES.get(name, name)}, or reinstall "
            "ouroboros-local (pip install -e . in a checkout)")


class ParameterError(OuroborosError):
    """A generation or configuration parameter is out of range."""


class MethodOptionError(ParameterError):
    """A method's option (gamma, window, ...) is invalid for that method."""


class DrafterError(OuroborosError):
    """A drafter (a plug-in's) broke its contract with the engine: the drafter's to fix, not the request's
    (the server answers 500 and logs it)."""


class PoolError(OuroborosError):
    """A saved phrase pool is corrupt or belongs to another tokenizer."""
