"""While the model loads: every request on the server's socket hears 503 ``loading`` at once (llama-server
answers "Loading model" too). The socket listens from the start, so that a taken port fails in a second,
and a health probe sent meanwhile waited in its backlog, unanswered, for the minutes a load and a first
calibration take."""

from __future__ import annotations

import json
import select
import socket
import threading
import time

# protocol.error_body's shape (not imported: the command line reads this module before any command runs)
_BODY = json.dumps({"error": {"message": "the model is loading; retry in a few seconds", "type": "server_error",
                              "param": None, "code": "loading"}}).encode()
REPLY = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 5\r\n"
         b"Connection: close\r\nContent-Length: " + str(len(_BODY)).encode() + b"\r\n\r\n" + _BODY)
MAX_HEAD = 64 * 1024      # a request's head is read (and dropped) up to this many bytes
READ_SECONDS = 2.0        # a client is not waited for longer, its request's head and the rest together
MAX_REPLYING = 64         # connections answered at once; more are closed at once (a flood's)


class LoadingReplies:
    """Answers every connection on ``sock`` with 503 until ``stop`` (the server takes the socket then)."""

    def __init__(self, sock: socket.socket):
        self._sock = sock
        self._stop = threading.Event()
        self._replying = threading.BoundedSemaphore(MAX_REPLYING)
        self._thread = threading.Thread(target=self._accept, name="ouroboros-loading", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join()

    def _accept(self) -> None:
        while not self._stop.is_set():
            if self._sock.fileno() < 0:   # closed under it: the command is ending
                return
            try:
                ready, _, _ = select.select([self._sock], [], [], 0.1)
                if not ready:
                    continue
                conn, _ = self._sock.accept()
            except (OSError, ValueError):   # out of descriptors for a moment (EMFILE), a client gone: go on
                self._stop.wait(0.05)
                continue
            if not self._replying.acquire(blocking=False):
                conn.close()
                continue
            try:
                threading.Thread(target=self._reply, args=(conn,), name="ouroboros-loading-reply",
                                 daemon=True).start()
            except RuntimeError:   # no thread to be had
                self._replying.release()
                conn.close()

    def _reply(self, conn: socket.socket) -> None:
        try:
            _answer(conn, time.monotonic() + READ_SECONDS)
        finally:
            conn.close()
            self._replying.release()


def _answer(conn: socket.socket, deadline: float) -> None:
    try:
        head = b""
        while b"\r\n\r\n" not in head and len(head) < MAX_HEAD:
            chunk = _received(conn, deadline, 4096)
            if not chunk:
                break
            head += chunk
        conn.settimeout(READ_SECONDS)
        conn.sendall(REPLY)
        conn.shutdown(socket.SHUT_WR)
        # until the client closes, or the deadline: a close with its body unread resets the connection,
        # and the reply could be lost with it
        while _received(conn, deadline, 65536):
            pass
    except OSError:   # a timeout past the deadline, a client gone
        pass


def _received(conn: socket.socket, deadline: float, size: int) -> bytes:
    """What ``conn`` sends next, b"" once it has closed or the deadline has passed."""
    left = deadline - time.monotonic()
    if left <= 0:
        return b""
    conn.settimeout(left)
    return conn.recv(size)
