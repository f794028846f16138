"""The package's settings from environment variables, read one way everywhere: yes/no words, paths with ``~``,
and a one-line error naming the variable where a value cannot be used."""

from __future__ import annotations

import os
import re
from pathlib import Path

from .errors import ParameterError

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


class SettingError(ParameterError):
    """An environment variable's value cannot be used (the CLI prints it as one line)."""


def env_flag(name: str) -> bool:
    """The yes/no variable `name`; unset, empty or blank is no. An unknown word is refused: OUROBOROS_OFFLINE=y
    was taken for "online" (and downloaded), OUROBOROS_VERBOSE=y for "on"."""
    value = os.environ.get(name, "").strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE or not value:
        return False
    raise SettingError(f"{name}={os.environ[name]!r} is not a yes/no value: use 1/0, true/false, yes/no or on/off "
                       "(empty means unset)")


def env_path(name: str) -> Path | None:
    """The path in the variable `name`, ``~`` expanded (a systemd unit or a .env file has no shell to do it);
    None when unset, empty or blank (a blank value became a file named " " in the working folder)."""
    value = os.environ.get(name, "")
    if not value.strip():
        return None
    return expand_home(value, f"set {name} to an absolute path", strict=True)


def expand_home(path: str | os.PathLike[str], remedy: str, *, strict: bool = False) -> Path:
    """`path` with a leading ``~`` or ``~user`` expanded, as a shell would (only where the text starts with
    it: "./~x" is a file's name). ``~name`` whose home is not found is kept as written, as a shell keeps it (a
    file or folder named "~notes.txt"; Windows guesses a home for any name, so there a file of that name wins
    where the guessed home has none), unless ``strict`` (a variable's value: no shell was there to expand it).
    SettingError saying `remedy` where the home is needed and not found: no HOME and no passwd entry, as under
    `docker run --user 1234`, or a ``strict`` user that does not exist."""
    text = os.fspath(path)
    if not text.startswith("~"):
        return Path(text)
    expanded = os.path.expanduser(text)   # unchanged where it finds no home (pathlib raised RuntimeError)
    user = re.split(r"[\\/]", text[1:], maxsplit=1)[0]
    if user and not strict and os.path.lexists(text) and not os.path.lexists(expanded):
        return Path(text)
    if expanded != text:
        return Path(expanded)
    if user and not strict:
        return Path(text)
    whose = f"the home folder of user {user!r}" if user else "your home folder (HOME is unset)"
    raise SettingError(f"cannot find {whose} for {text}: {remedy}")
