"""Streaming with the Python API: print text as it is accepted, stop early with a cancel Event.

    python examples/streaming.py [TARGET] [DRAFT] [--prompt TEXT] [--max-tokens N] [--timeout SECONDS]

Once the answer starts, Ctrl-C (or the timeout) sets the Event; the engine finishes the current round and ends the stream
cleanly (finish reason "cancelled"), keeping its KV cache consistent for the next call.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time

from ouroboros_local import Engine, EngineConfig
from ouroboros_local.server import default_method


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("target", nargs="?", default="smollm2-135m-instruct")
    p.add_argument("draft", nargs="?", default=None)
    p.add_argument("--prompt", default="Write a short poem about the sea.")
    p.add_argument("--max-tokens", type=int, default=200)
    p.add_argument("--timeout", type=float, default=None, help="stop the answer after this many seconds")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    args = p.parse_args(argv)

    cancel = threading.Event()
    with Engine.load(args.target, args.draft, config=EngineConfig(n_ctx=2048), progress=False) as engine:
        method = default_method(engine.draft is not None)
        engine.prepare(method)   # a first run's cost-curve measurement, before the answer's clock starts
        # from here Ctrl-C stops the answer, not the program (before, it stops the load, as usual)
        signal.signal(signal.SIGINT, lambda *_: cancel.set())
        if args.timeout is not None:   # the answer's time, not the load's
            timer = threading.Timer(args.timeout, cancel.set)
            timer.daemon = True
            timer.start()
        t0 = time.perf_counter()
        first = None
        result = None
        for event in engine.stream(args.prompt, chat=True, max_tokens=args.max_tokens, method=method,
                                   stop=args.stop, cancel=cancel):
            if event.text:
                first = time.perf_counter() - t0 if first is None else first
                sys.stdout.write(event.text)
                sys.stdout.flush()
            result = event.result or result          # the last event carries the GenerationResult
        assert result is not None
        s = result.stats
        waited = f"first text after {first:.2f}s" if first is not None else "no text"
        print(f"\n[{s.method}] {s.tokens} tokens, {waited}, "
              f"{s.tokens_per_second:.1f} tok/s, {s.tokens_per_pass:.2f} tokens/pass, "
              f"finish: {s.finish_reason}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except KeyboardInterrupt:   # during the load or the cost measurement
        print("interrupted", file=sys.stderr)
        sys.exit(130)
