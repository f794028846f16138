"""While the model loads: every request on the server's socket hears 503 ``loading`` at once (llama-server
answers "Loading model" too). The socket listens from the start, so that a taken port fails in a second,
and a health probe sent meanwhile waited in its backlog, unanswered, for the minutes a load and a first
calibration take."""

from __future__ import annotations

import json
import select
import socket
import threading

# protocol.error_body's shape (not imported: the command line reads this module before any command runs)
_BODY = json.dumps({"error": {"message": "the model is loading; retry in a few seconds", "type": "server_error",
                              "param": None, "code": "loading"}}).encode()
REPLY = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 5\r\n"
         b"Connection: close\r\nContent-Length: " + str(len(_BODY)).encode() + b"\r\n\r\n" + _BODY)
MAX_HEAD = 64 * 1024      # a request's head is read (and dropped) up to this many bytes
READ_SECONDS = 2.0        # a client that sends nothing is not waited for longer


class LoadingReplies:
    """Answers every connection on ``sock`` with 503 until ``stop`` (the server takes the socket then)."""

    def __init__(self, sock: socket.socket):
        self._sock = sock
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, name="ouroboros-loading", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                ready, _, _ = select.select([self._sock], [], [], 0.1)
                if not ready:
                    continue
                conn, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                continue
            except (OSError, ValueError):   # the socket closed under it: the command is ending
                return
            threading.Thread(target=_reply, args=(conn,), name="ouroboros-loading-reply", daemon=True).start()


def _reply(conn: socket.socket) -> None:
    with conn:
        try:
            conn.settimeout(READ_SECONDS)
            head = b""
            while b"\r\n\r\n" not in head and len(head) < MAX_HEAD:
                chunk = conn.recv(4096)
                if not chunk:
                    break
                head += chunk
            conn.sendall(REPLY)
            conn.shutdown(socket.SHUT_WR)
            while conn.recv(65536):   # until the client closes: a close with its body unread resets the
                pass                  # connection, and the reply could be lost with it
        except OSError:
            pass
