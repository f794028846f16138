"""Ctrl-C during a long llama.cpp call (a model's load, a context's creation).

Python runs a signal's handler at the next bytecode it executes, and during a load that is often inside
one of our ctypes callbacks (its log, its progress), where the KeyboardInterrupt cannot reach the caller:
ctypes prints "Exception ignored" and the load goes on, or a progress callback's lost return value stops
it with "could not load". For the call, Python's default handler is swapped for one that only notes the
Ctrl-C; a progress callback then stops the load, and the caller raises KeyboardInterrupt once the call
has returned and its work is undone.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager


class CtrlC:
    """Whether a Ctrl-C came during the call (``noted``)."""

    def __init__(self) -> None:
        self.noted = False

    def note(self, signum: int, frame: object) -> None:
        self.noted = True

    def raise_if_noted(self, undo: Callable[[], None]) -> None:
        """KeyboardInterrupt where a Ctrl-C came, once ``undo`` has undone the call's work."""
        if self.noted:
            undo()
            raise KeyboardInterrupt

    def keep_going(self, *_args: object) -> bool:
        """A progress callback's answer: False stops llama.cpp's load."""
        return not self.noted


@contextmanager
def noted_ctrl_c() -> Iterator[CtrlC]:
    """Within the block a Ctrl-C is noted, not raised. Only where Python's default handler is in place
    (in the main thread): a handler of the program's own (a chat's "stop the answer") raises nothing."""
    ctrl_c = CtrlC()
    swap = (threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGINT) is signal.default_int_handler)
    if swap:
        signal.signal(signal.SIGINT, ctrl_c.note)
    try:
        yield ctrl_c
    finally:
        if swap:
            signal.signal(signal.SIGINT, signal.default_int_handler)
