"""Bad input ends a script with one line, ``error: ...`` on stderr, and exit status 2, not a traceback.

Each script ends with

    if __name__ == "__main__":
        from _script_errors import run_main   # scripts/ is on sys.path when a script runs
        sys.exit(run_main(main))

and raises ``OuroborosError`` (its own or the package's: a bad file, a bad value, a missing model) for
input the user has to fix. The import stays under ``__main__`` because the tests load the scripts by
path, with scripts/ not on sys.path.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from typing import Any

from ouroboros_local.errors import OuroborosError, missing_module

USAGE_ERROR = 2


def describe(exc: BaseException) -> str | None:
    """The one-line message for an error that is the user's to fix; None for a bug (a traceback)."""
    if isinstance(exc, OuroborosError):
        return str(exc)
    if isinstance(exc, ModuleNotFoundError):   # a broken or partial install
        return missing_module(exc)
    if isinstance(exc, BrokenPipeError):   # the reader went away (| head): not the input's fault
        return None
    if isinstance(exc, OSError):   # a file missing or unreadable
        where = f"{exc.filename}: " if exc.filename else ""
        return where + (exc.strerror or str(exc))
    if isinstance(exc, json.JSONDecodeError):   # a file that is not the JSON asked for
        return f"not a JSON file ({exc})"
    if isinstance(exc, UnicodeDecodeError):   # a binary file where text was asked for
        return f"a file is not UTF-8 text ({exc})"
    return None


def run_main(main: Callable[..., Any], *args: Any) -> int:
    """``main(*args)``'s exit status; a user's error printed as one line, exit status 2; a reader that went
    away (``| head -1``) ends it quietly, exit status 0, as ``ouroboros-local`` does."""
    try:
        status = main(*args) or 0
        sys.stdout.flush()   # here, not at exit: a closed pipe found there is printed as "Exception ignored"
        return status
    except BrokenPipeError:
        quiet_stdout()
        return 0
    except Exception as exc:   # a bug is raised again below
        message = describe(exc)
        if message is None:
            raise
        print(f"error: {' '.join(message.split())}", file=sys.stderr)
        return USAGE_ERROR



def quiet_stdout() -> None:
    """Point stdout at /dev/null: what its buffer still holds is dropped, not flushed into the closed pipe at
    exit (which Python would report)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
