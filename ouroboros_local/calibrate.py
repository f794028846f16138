"""`ouroboros-local calibrate`: measure (or show the cached) verify-cost curve of a target, and with
``-d`` the draft's decode-cost curve (the scheduler's prior of what drafting costs)."""

from __future__ import annotations

import argparse
import json
import time


def cmd_calibrate(args: argparse.Namespace) -> int:
    from .cli import _engine_from_args

    t0 = time.perf_counter()
    engine = _engine_from_args(args)
    t_load = time.perf_counter() - t0
    t1 = time.perf_counter()
    costs = engine.cost_model(refresh=args.refresh)
    draft = engine.draft_cost_model(refresh=args.refresh)   # -d was once loaded and left unmeasured
    t_cal = time.perf_counter() - t1
    curves = [costs] if draft is None else [costs, draft]
    saved = all(curve.unsaved is None for curve in curves)
    if args.json:
        extra = {"draft": {**draft.to_dict(), "origin": draft.origin, "saved": draft.unsaved is None}
                 } if draft is not None else {}
        print(json.dumps({**costs.to_dict(), "origin": costs.origin, "saved": costs.unsaved is None,
                          "load_seconds": t_load, "calibration_seconds": t_cal, **extra}))
    else:
        print(f"target {engine.target.path.name}: {engine.target_ctx.n_threads} threads, "
              f"gpu layers {engine.config.gpu_layers}, flash-attn {engine.config.flash_attn}")
        print("tokens per decode   seconds   x one token")
        for n, s in zip(costs.sizes, costs.seconds):
            print(f"{n:>17}   {s:7.4f}   {s / costs.seconds[0]:6.2f}")
        print(f"after a decode of another size, the next plain steps lose {costs.switch_seconds:.4f}s "
              f"({costs.switch_seconds / costs.seconds[0]:.2f} steps; charged to drafting)")
        print(f"model load {t_load:.2f}s, calibration {t_cal:.2f}s ({costs.origin}; key {costs.key[:12]})")
        if costs.busy_cores is not None:
            print(f"other processes kept {costs.busy_cores:.1f} cores busy while it was measured"
                  + ("; provisional: measured again on a quiet machine" if costs.provisional else ""))
        if draft is not None:
            print(f"draft {engine.draft.path.name}: one step {draft.seconds[0]:.4f}s "
                  f"({draft.seconds[0] / costs.seconds[0]:.2f} target steps); decodes of "
                  + ", ".join(f"{n}: {s / draft.seconds[0]:.2f}x" for n, s in zip(draft.sizes, draft.seconds)
                              if n in (2, 4, 8, 16)) + f" ({draft.origin})")
    engine.close()
    return 0 if saved else 1   # measuring to save is the command's whole point (the warning said why not)


def register(sub, add_model_args, add_sampling_args, add_method_args) -> None:
    p = sub.add_parser("calibrate", help="measure the target's verify-cost curve, and the draft's with -d "
                                         "(cached per settings)")
    add_model_args(p)
    p.add_argument("--refresh", action="store_true", help="measure again even if a cached curve exists")
    p.add_argument("--json", action="store_true",
                   help="print the curve and whether it was saved as one JSON object (no progress lines)")
    p.set_defaults(func=cmd_calibrate)
