"""`ouroboros-local serve`: the OpenAI-compatible server on loopback (FastAPI + uvicorn)."""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import signal
import socket
import sys
import threading
from pathlib import Path
from typing import Any, Callable

from ..errors import OuroborosError, ParameterError
from ..text_input import check_argument
from ..cli import METHODS_IN_HELP
from . import defer_method_default

API_KEY_ENV = "OUROBOROS_API_KEY"
# The server picks the fastest lossless method for the model pair unless --method names one.
METHOD_HELP = (f"default decoding method, one of {METHODS_IN_HELP}; requests may override it with a 'method' "
               "field (default auto)")


def register(subparsers: Any, add_model_args: Callable, add_sampling_args: Callable,
             add_method_args: Callable) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, ...)",
        description="Serve a model over an OpenAI-compatible HTTP API. Binds to 127.0.0.1 by default. "
                    "Sampling flags set the defaults for requests that omit them.")
    add_model_args(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    g.add_argument("--port", type=int, default=8080, help="TCP port (default 8080)")
    g.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer KEY' on every request (default: ${API_KEY_ENV} if set)")
    g.add_argument("--max-queue", type=int, default=16,
                   help="requests that may wait behind the running one; more get 503 (default 16)")
    g.add_argument("--model-name", default=None,
                   help="model id reported by /v1/models and accepted in requests (default: the file name)")
    g.add_argument("--default-max-tokens", type=int, default=512,
                   help="chat completion length when a request gives no max_tokens (default 512)")
    g.add_argument("--log-level", default="warning",
                   choices=["critical", "error", "warning", "info", "debug", "trace"],
                   help="uvicorn log level (default warning)")
    add_sampling_args(p)
    add_method_args(p)
    defer_method_default(p, METHOD_HELP)
    p.set_defaults(func=cmd_serve)
    return p


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        import fastapi  # noqa: F401
        import uvicorn
    except ImportError as exc:   # the extra only: a required package missing is said as such (cli.main)
        raise OuroborosError(f"the server needs FastAPI and uvicorn ({exc.name} is missing): "
                             "pip install fastapi uvicorn (or, in a checkout: pip install -e '.[server]')") from None
    from .app import ServerConfig, create_app
    from .gate import is_loopback_name
    from .loading import LoadingReplies
    from .. import cli
    from ..proposers import applicable_options

    if not args.host.strip():   # bind('') is every interface, and the lines printed "http://:8080"
        raise ParameterError("--host is empty: give an address (127.0.0.1; 0.0.0.0 for every interface)")
    if not args.model_name and args.model_name is not None:
        raise ParameterError("--model-name is empty: give a name, or leave it out for the file's")
    check_argument(args.model_name, "--model-name")   # not UTF-8: every response naming it was a 500
    if not 0 <= args.port <= 65535:
        raise ParameterError(f"--port must be in 0..65535 (got {args.port})")
    if args.max_queue < 0:
        raise ParameterError("--max-queue must be >= 0")
    if args.default_max_tokens < 1:
        raise ParameterError("--default-max-tokens must be >= 1")
    api_key = _api_key(args.api_key, os.environ.get(API_KEY_ENV))
    sampling = cli._sampling_from_args(args)
    method, options = cli.checked_method(args, for_any_method=True)
    sock = _listen(args.host, args.port)   # before loading: a taken port fails in a second, not minutes
    loading = LoadingReplies(sock)   # until the server takes the socket: 503 "loading", not silence
    try:
        engine = cli._engine_from_args(args, method, applicable_options(method, options))
    except BaseException:
        loading.stop()
        sock.close()
        raise
    try:
        cli.warn_without_chat_template(engine, "/v1/completions takes plain text")
        # a first calibration now, not in the first request (a client's timeout may be shorter)
        engine.prepare(method, applicable_options(method, options))
        path = Path(str(engine.target.path))
        model_id = args.model_name or _utf8_name(path.name)
        aliases = tuple({_utf8_name(str(args.model)), _utf8_name(path.stem)} - {model_id})
        config = ServerConfig(model_id=model_id, aliases=aliases, method=method, method_options=options,
                              sampling=sampling, api_key=api_key, max_queue=args.max_queue,
                              local_names_only=is_loopback_name(args.host) and not api_key,
                              default_max_tokens=args.default_max_tokens)
        app = create_app(engine, config)
        if not is_loopback_name(args.host) and not api_key:
            print(f"warning: listening on {args.host} without --api-key: anyone who can reach this port "
                  "can use the model", file=sys.stderr)
        shown = f"[{args.host}]" if ":" in args.host and not args.host.startswith("[") else args.host
        port = sock.getsockname()[1]
        print(f"serving {model_id} on http://{shown}:{port}/v1 (method {method}, "
              f"context {engine.target_ctx.n_ctx}, queue {args.max_queue}"
              f"{', API key required' if api_key else ''}"
              f"{', history pool ' + options['pool'] if options.get('pool') else ''}); Ctrl-C stops",
              file=sys.stderr, flush=True)
        server = _server(uvicorn, uvicorn.Config(app, log_level=args.log_level, timeout_graceful_shutdown=5,
                                                 access_log=args.log_level in ("info", "debug", "trace"),
                                                 log_config=_log_config(), use_colors=_colours()),
                         app.state.worker.shut_down)
        # uvicorn re-raises the Ctrl-C or SIGTERM it already served by shutting down; SIGTERM's default
        # action (systemd's and docker's stop) would end the process before ``engine.close`` saves.
        # SIGHUP (the terminal closed) stops the server as they do: uvicorn leaves it to the command's
        # handler, whose SystemExit inside the event loop cut streams off and answered queued requests 500.
        in_main = threading.current_thread() is threading.main_thread()   # signals are the main thread's
        previous = {}
        if in_main:
            previous[signal.SIGTERM] = signal.signal(signal.SIGTERM, _interrupt)
            if hasattr(signal, "SIGHUP"):   # not on Windows
                previous[signal.SIGHUP] = signal.signal(signal.SIGHUP, server.handle_exit)
        loading.stop()
        cli.exit_if_ending()   # a SIGTERM during the first calibration that Python swallowed
        try:
            server.run(sockets=[sock])
        except KeyboardInterrupt:
            pass
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
    finally:
        loading.stop()
        sock.close()
        engine.close()
    if server.stopped_by is None:
        return 0
    print(f"stopped ({signal.Signals(server.stopped_by).name})", file=sys.stderr)
    return 128 + server.stopped_by   # 130, 143, 129: what every other command exits with on these signals


def _api_key(flag: str | None, env: str | None) -> str | None:
    """The key clients must send: --api-key, else $OUROBOROS_API_KEY (empty: none). Spaces around it go,
    as the client's token loses them; a key of nothing but spaces is refused (an empty --api-key turned
    authentication off, a blank one locked every client out)."""
    raw, name = (flag, "--api-key") if flag is not None else (env or None, API_KEY_ENV)
    if raw is None:
        return None
    if not raw.strip():
        raise ParameterError(f"{name} is empty: give a key, or leave it out to serve without one")
    check_argument(raw, name)   # not UTF-8: every request, the right key's too, was a 500
    return raw.strip()


def _utf8_name(name: str) -> str:
    """A file name as responses can carry it: bytes that are not UTF-8 (kept by Python as surrogates, which
    no JSON encoder takes: /health and /v1/models were 500s) become U+FFFD."""
    return os.fsencode(name).decode("utf-8", "replace")


def _log_config() -> dict:
    """uvicorn's logging with its access lines on stderr too: stdout carried them, beside nothing else."""
    from uvicorn.config import LOGGING_CONFIG

    config = copy.deepcopy(LOGGING_CONFIG)
    config["handlers"]["access"]["stream"] = "ext://sys.stderr"
    return config


def _colours() -> bool | None:
    """No colours where NO_COLOR is set or the terminal is dumb (https://no-color.org); else uvicorn's own
    choice (a terminal's)."""
    if os.environ.get("NO_COLOR") or os.environ.get("TERM") == "dumb":
        return False
    return None


def _server(uvicorn: Any, config: Any, end_jobs: Callable[[], None]) -> Any:
    """A uvicorn server that ends the queued and running generations as soon as it is asked to stop:
    uvicorn waits for their connections to close, and after its graceful timeout a client got a plain-text
    500 and the log a traceback, while queued jobs still started."""

    # The handler writes a byte to a pipe and takes no lock: the signal may arrive while this thread holds
    # the worker's lock, a job's event or the lock Thread.start takes, and a second signal inside an
    # Event.set() of the first found the event's own lock held (two Ctrl-Cs 2 ms apart hung the server).
    wake_read, wake_write = os.pipe()

    def stopper() -> None:
        try:
            os.read(wake_read, 1)
        finally:
            os.close(wake_read)
        end_jobs()

    # started now, not in the handler (Thread.start takes a lock)
    threading.Thread(target=stopper, name="ouroboros-stop", daemon=True).start()

    class Server(uvicorn.Server):
        stopped_by: int | None = None   # the signal that stopped it: the exit status says it, as other commands'

        def handle_exit(self, sig: int, frame: Any) -> None:
            if self.stopped_by is not None:
                # stopping already, and the jobs ended at once: uvicorn's forced exit on a second Ctrl-C
                # only skipped the app's shutdown, which logged a traceback
                return
            self.stopped_by = int(sig)
            with contextlib.suppress(OSError):   # the pipe is closed: the stopper has its byte
                os.write(wake_write, b"x")
            super().handle_exit(sig, frame)

    return Server(config)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _listen(host: str, port: int) -> socket.socket:
    """A socket bound to (host, port), or a one-line error (address in use, no such address)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        if os.name != "nt":   # on Windows it lets a second server bind a port one already listens on
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host.strip("[]"), port))
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise ParameterError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.set_inheritable(True)
    return sock
