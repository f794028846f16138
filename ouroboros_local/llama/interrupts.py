"""Ctrl-C during a long llama.cpp call (a model's load, a context's creation).

Python runs a signal's handler at the next bytecode it executes, and during a load that is often inside
one of our ctypes callbacks (its log, its progress), where the KeyboardInterrupt cannot reach the caller:
ctypes prints "Exception ignored" and the load goes on, or a progress callback's lost return value stops
it with "could not load". For the call, Python's default handler is swapped for one that only notes the
Ctrl-C; a progress callback then stops the load, and the caller raises KeyboardInterrupt once the call
has returned and its work is undone. SIGTERM and SIGHUP are noted the same way where the program's
handler of them is marked as ending it (``ends_the_program``: the command line's, which ends through
its ``finally`` blocks): its SystemExit, raised in a callback, was ignored too, and ``serve`` stopped
during its load went on to serve. Any other handler (an app's that sets a flag) runs where the signal
lands, as before.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any


class CtrlC:
    """Which signal came during the call, if any (``noted``: a Ctrl-C or a noted SIGTERM/SIGHUP)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._handlers: dict[int, Any] = {}   # the program's handler of each noted signal, called afterwards

    @property
    def noted(self) -> bool:
        return self.signum is not None

    def note(self, signum: int, frame: object) -> None:
        if self.signum is None or signum != signal.SIGINT:   # a termination outranks a Ctrl-C
            self.signum = signum

    def raise_if_noted(self, undo: Callable[[], None]) -> None:
        """KeyboardInterrupt where a Ctrl-C came, or what the program's own handler of a SIGTERM or SIGHUP
        raises, once ``undo`` has undone the call's work."""
        if self.signum is None:
            return
        undo()
        if self.signum == signal.SIGINT:
            raise KeyboardInterrupt
        self._handlers[self.signum](self.signum, None)

    def keep_going(self, *_args: object) -> bool:
        """A progress callback's answer: False stops llama.cpp's load."""
        return self.signum is None


# the termination signals whose handler is swapped too where it is marked ``ends_the_program = True``: it
# always raises (SystemExit), so the load is undone, then it is called; a handler that returns must not be
# marked (the load would be undone under its caller)
_TERMINATIONS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name))


@contextmanager
def noted_ctrl_c() -> Iterator[CtrlC]:
    """Within the block a Ctrl-C, and a SIGTERM or SIGHUP whose handler ends the program, is noted, not
    raised. Only in the main thread, and for SIGINT only where Python's default handler is in place: a
    handler of the program's own (a chat's "stop the answer") raises nothing."""
    ctrl_c = CtrlC()
    swapped: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            swapped[signal.SIGINT] = signal.default_int_handler
        for signum in _TERMINATIONS:
            handler = signal.getsignal(signum)
            if getattr(handler, "ends_the_program", False):
                swapped[signum] = ctrl_c._handlers[signum] = handler
    for signum in swapped:
        signal.signal(signum, ctrl_c.note)
    try:
        yield ctrl_c
    finally:
        for signum, handler in swapped.items():
            signal.signal(signum, handler)
