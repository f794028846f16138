"""`ouroboros-local bench`: every method (and the peers) on the same prompts, with reports and charts.

    ouroboros-local bench -m TARGET [-d DRAFT] --prompts FILE[,FILE...] [--task T]
        [--methods vanilla,prompt-lookup,...|all] [--peers llama-cpp-python-pld,llama.cpp]
        [--llama-cpp-bin DIR] [--limit N [--learn-first K]] [-n N] [--out DIR]
        [--sweep [METHOD[,METHOD...]:]NAME=v1,v2,...]

Writes DIR/results.json, DIR/results.md and DIR/speedup.png (DIR/sweep.png with --sweep).
See docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from ..environment import expand_home
from ..errors import ParameterError
from ..text_input import read_text
from .prompts import TASKS

DEFAULT_METHODS = "all"
TOLERANCE = 0.5   # ouroboros_local.compare.DEFAULT_TOLERANCE (not imported here: keeps --help cheap)


def _print_table(md: str) -> list[str]:
    """The run's table on stdout; the line saying why not where stdout cannot take it (a full disk under
    `> table.md`): the results files are still written (the error ended the run with nothing saved)."""
    try:
        print(md, flush=True)
    except OSError as exc:
        if isinstance(exc, BrokenPipeError):   # `| head`: the reader has what it wanted
            return []
        return [f"cannot write the table to standard output ({exc.strerror or exc}); it is in results.md"]
    return []


def register(subparsers: Any, add_model_args: Callable, add_sampling_args: Callable,
             add_method_args: Callable) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "bench", help="benchmark methods and peers side by side (tokens/s, speed-up, identical output)",
        description="Run vanilla decoding, our methods and the available peers on the same prompts in one "
                    "process (interleaved per prompt), check every output against vanilla, and write "
                    "results.json, results.md and speedup.png. See docs/benchmarks.md.")
    add_model_args(p)
    g = p.add_argument_group("benchmark")
    g.add_argument("--prompts", required=True, metavar="FILE[,FILE...]",
                   help="prompt sets: JSONL files of {id, task, turns, source, meta} (one set per file; "
                        "a non-JSON file is one raw prompt; a file whose whole name holds a comma is taken "
                        "as one file)")
    g.add_argument("--task", choices=TASKS, default=None,
                   help="how to build prompts (default: from each file's task field; raw = first turn as is)")
    g.add_argument("--methods", default=None,
                   help="comma-separated methods, or 'all' (default): every available method; vanilla is "
                        "always run as the reference")
    g.add_argument("--peers", default=None,
                   help="comma-separated peers: llama-cpp-python, llama-cpp-python-pld, llama.cpp "
                        "(= llama.cpp:vanilla,lookup,lookahead,ngram-simple,ngram-mod[,draft-simple]) or "
                        "llama.cpp:VARIANT")
    g.add_argument("--llama-cpp-bin", default=None, metavar="DIR",
                   help="directory with llama.cpp's binaries (scripts/build_llama_cpp.sh); default: PATH")
    g.add_argument("--limit", type=int, default=None, help="first N prompts of each set")
    g.add_argument("--learn-first", type=int, default=0, metavar="K",
                   help="before timing, each of our drafting methods answers the K prompts after --limit's "
                        "in each set, untimed: its estimates and history start where a user's would "
                        "after such requests (with --learned: also from earlier runs' estimates)")
    g.add_argument("-n", "--max-tokens", type=int, default=None,
                   help="max new tokens (default per task: humaneval 192, cnndm 128, gsm8k 256, "
                        "mt_bench 256, wmt 128, raw 128)")
    g.add_argument("--out", default="bench-out", help="output directory (default bench-out)")
    g.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="apply the model's chat template (default: yes for instruct/chat models)")
    g.add_argument("--fewshot", type=int, default=0, help="gsm8k: worked examples before each question")
    g.add_argument("--method-options", default=None, metavar="JSON",
                   help='per-method options, e.g. \'{"ouroboros": {"gamma": 4}, '
                        '"llama-cpp-python-pld": {"num_pred_tokens": 2}}\' (or @FILE)')
    g.add_argument("--sweep", default=None, metavar="[METHOD[,METHOD...]:]NAME=V1,V2,...",
                   help="run METHOD (default: every non-vanilla method that has the option) once per value "
                        "of one option; plots sweep.png (e.g. speculative,prompt-lookup:adaptive=true,false: scheduled "
                        "and fixed-parameter runs side by side)")
    g.add_argument("--variant", action="append", default=[], metavar="LABEL=METHOD[:JSON]",
                   help="also run METHOD with these options under LABEL (repeatable; an ablation in one run), "
                        'e.g. \'no-window=ouroboros:{"window": 0}\'; "reset_pool": true in the JSON '
                        "forgets that contender's history (phrase pools, suffix tries) before every "
                        "generation (its scheduler's estimates, its own, stay warm)")
    g.add_argument("--tolerance-margin", type=float, nargs="?", const=TOLERANCE, default=TOLERANCE,
                   metavar="LOGITS",
                   help="a difference from vanilla is a tie-flip (two tokens the model rated equally, within "
                        "floating-point noise of batched kernels; allowed) when plain decoding preferred its "
                        f"token by less than LOGITS at the first difference (default {TOLERANCE}); "
                        "--exact counts every difference as a mismatch")
    g.add_argument("--exact", action="store_true",
                   help="no tie rule: every output that is not identical to vanilla's is a mismatch")
    g.add_argument("--no-warmup", action="store_true", help="skip the warm-up generation per method")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    g.add_argument("--save-text", action="store_true", help="store every generated text in results.json")
    g.add_argument("--reset-pool", action="store_true",
                   help="forget each contender's history (phrase pools, suffix tries) before every "
                        "generation (default: warm start); the scheduler's estimates are kept")
    g.add_argument("--warm-prefill", action="store_true",
                   help="let a method reuse the prompt cached by the previous one (faster runs; prefill "
                        "numbers then mean little); default: every generation starts from an empty cache")
    g.add_argument("--hash-models", action="store_true", help="sha256 the model files even when large")
    g.add_argument("--no-bandwidth", action="store_true", help="skip the memory bandwidth measurement")
    g.add_argument("--peer-timeout", type=float, default=900.0, help="seconds per llama.cpp binary run")
    g.add_argument("--strict", action="store_true",
                   help="exit with status 3 if any output differs from vanilla's beyond the tie rule, or was "
                        "not compared with it (an error, the method's or vanilla's; sampled outputs are never "
                        "compared), or a contender asked for did not run")
    add_sampling_args(p)
    add_method_args(p)
    # --method is generate's flag (default auto); here it is only a shorthand when given explicitly
    p.set_defaults(func=cmd_bench, method=None)
    method_flag = next(a for a in p._actions if a.dest == "method")
    method_flag.help = "shorthand for --methods vanilla,METHOD (not with --methods)"
    return p


@contextlib.contextmanager
def saving_first(log: Callable[[str], None]) -> Iterator[list[int]]:
    """While the results are summarized and written, Ctrl-C (SIGTERM, SIGHUP) is noted (the list it yields
    fills) instead of raised: the user who pressed it once to stop a long run and again while it saved lost
    everything."""
    pressed: list[int] = []   # the signals heard
    if threading.current_thread() is not threading.main_thread():
        yield pressed
        return

    def note(signum: int, frame: Any) -> None:
        if not pressed:
            log("bench: saving what was measured first, then stopping")
        pressed.append(signum)

    signals = [getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name)]
    previous = {sig: signal.signal(sig, note) for sig in signals}   # a timeout's SIGTERM too
    try:
        yield pressed
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def parse_method_options(text: str | None) -> dict[str, dict[str, Any]]:
    if not text:
        return {}
    if text.startswith("@"):
        text = read_text(Path(text[1:]), "--method-options file")
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ParameterError(f"--method-options is not valid JSON: {exc.msg}") from None
    if not isinstance(obj, dict) or not all(isinstance(v, dict) for v in obj.values()):
        raise ParameterError('--method-options takes {"method": {"option": value, ...}, ...}')
    return obj


def plan_contenders(methods: list[str], method_opts: dict[str, dict[str, Any]], base_opts: dict[str, Any],
                    sweep: tuple[list[str], str, list[Any]] | None,
                    variants: list[tuple[str, str, dict[str, Any]]],
                    reset_pool: bool) -> list[tuple[str, str, dict[str, Any], bool]]:
    """(label, method, options, reset_pool) of each contender of ours: the command line's method flags go
    to the methods that have them, --method-options is per method, a swept method runs once per value,
    and each --variant with its own options."""
    from ..proposers import overlaid
    from .runner import sweep_label

    planned = []
    for m in methods:
        opts = overlaid(m, base_opts, method_opts.get(m, {}))
        if sweep is not None and m in sweep[0]:
            _, name, values = sweep
            planned += [(sweep_label(m, name, v), m, overlaid(m, opts, {name: v}), reset_pool) for v in values]
        else:
            planned.append((m, m, opts, reset_pool))
    for label, m, o in variants:
        rest = {k: v for k, v in o.items() if k != "reset_pool"}
        reset = o.get("reset_pool", reset_pool)
        planned.append((label, m, overlaid(m, base_opts, rest), reset))
    return planned


def check_contender_options(method_opts: dict[str, dict[str, Any]],
                            planned: list[tuple[str, str, dict[str, Any], bool]], known: list[str]) -> None:
    """Every option of every contender of ours checked before a model loads: a misspelt method or option
    name is a one-line error now, not silently ignored or found after the first methods ran. A known
    method this run does not run is allowed (one options file may serve several runs)."""
    from ..proposers import check_options
    from .runner import CUSTOM_METHODS

    unknown = [name for name in method_opts if name not in known]
    if unknown:
        raise ParameterError(f"--method-options names no method or peer: {', '.join(map(repr, unknown))}; "
                             f"known: {', '.join(known)}")
    for _, method, options, _ in planned:
        if method not in CUSTOM_METHODS:
            check_options(method, options)


def peer_options(label: str, method_opts: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """A peer's options from --method-options: a llama.cpp binary's own over those for all of them, of
    which the baseline takes only raw flags: its draft length is 0, and `n_max` for all had it drafting."""
    from .peers import BIN_PREFIX

    own = dict(method_opts.get(label, {}))
    if not label.startswith(BIN_PREFIX):
        return own
    shared = method_opts.get("llama.cpp", {})
    if label == BIN_PREFIX + "vanilla":
        shared = {key: value for key, value in shared.items() if key == "args"}
    return {**shared, **own}


def check_peers_options(peer_labels: list[str], method_opts: dict[str, dict[str, Any]]) -> None:
    """Every peer's options checked before a model loads, as our methods' (check_contender_options): those
    of each peer this run runs, and those --method-options gives a known peer that does not run."""
    from .peers import check_peer_options, peer_names

    for label in peer_labels:
        check_peer_options(label, peer_options(label, method_opts))
    for label in set(method_opts) & set(peer_names()) - set(peer_labels):
        check_peer_options(label, method_opts[label])


def unexpected_skips(skipped: dict[str, str], planned: list[tuple[str, str, dict[str, Any], bool]],
                     has_draft: bool) -> list[str]:
    """The contenders asked for that did not run; not the plain rows of methods that need a draft model,
    which 'all' lists without one (resolve_methods refuses them named). A variant's or a sweep's row of
    such a method was asked for by its own flag."""
    from ..proposers import needs_draft

    method_of = {label: method for label, method, *_ in planned}
    return [label for label in skipped
            if has_draft or method_of.get(label) != label or not needs_draft(label)]


def check_unique_labels(planned: list[tuple[str, str, dict[str, Any], bool]]) -> None:
    """Two contenders under one label (``--sweep gamma=2,2``) are refused before a model loads, not by
    run_benchmark after it."""
    labels = [label for label, *_ in planned]
    repeated = sorted({label for label in labels if labels.count(label) > 1})
    if repeated:
        raise ParameterError(f"two contenders share the label {', '.join(map(repr, repeated))} "
                             "(a value repeated in --sweep?)")


def parse_variant(spec: str, available: list[str]) -> tuple[str, str, dict[str, Any]]:
    """``LABEL=METHOD[:JSON]`` -> (label, method, options)."""
    label, eq, rest = spec.partition("=")
    method, _, text = rest.partition(":")
    label, method = label.strip(), method.strip()
    if not eq or not label or not method:
        raise ParameterError(f"--variant takes LABEL=METHOD[:JSON] (got {spec!r})")
    if method not in available:
        raise ParameterError(f"--variant {label!r}: unknown method {method!r}")
    try:
        options = json.loads(text) if text.strip() else {}
    except json.JSONDecodeError as exc:
        raise ParameterError(f"--variant {label!r}: options are not valid JSON: {exc.msg}") from None
    if not isinstance(options, dict):
        raise ParameterError(f"--variant {label!r}: options must be a JSON object")
    if not isinstance(options.get("reset_pool", False), bool):   # bool("false") is True
        raise ParameterError(f"--variant {label!r}: \"reset_pool\" must be true or false "
                             f"(got {json.dumps(options['reset_pool'])})")
    return label, method, options


def parse_methods(spec: str, available: list[str], custom: list[str]) -> list[str]:
    names = [m.strip() for m in spec.split(",") if m.strip()]
    if not names or names == ["all"]:
        names = list(available)
    for m in names:
        if m not in available and m not in custom:
            raise ParameterError(f"unknown method {m!r}; available: {', '.join(available + custom)}")
    out = ["vanilla"] + [m for m in dict.fromkeys(names) if m != "vanilla"]
    return out


def resolve_methods(args: argparse.Namespace, available: list[str], custom: list[str]) -> list[str]:
    """--methods (default: all), or `--method X` as shorthand for vanilla and X (`--method vanilla`: vanilla
    alone). A method named that needs a draft model is refused when none is given."""
    from ..cli import refuse_without_draft

    spec = args.methods if args.methods is not None else DEFAULT_METHODS   # (None: not given)
    if getattr(args, "method", None) is not None:
        if args.methods is not None:   # one of the two was ignored in silence (`--methods all` too)
            raise ParameterError(f"give --methods or --method, not both (--method {args.method} is "
                                 "--methods vanilla," + args.method + ")")
        spec = args.method
    if not spec.replace(",", "").strip():   # it ran every method
        raise ParameterError(f"--method{'s' if args.methods is not None else ''} is empty: name methods, or 'all'")
    methods = parse_methods(spec, available, custom)
    # 'all' without a draft lists them under "Not run"; a method named without one is a mistake
    if args.draft is None and [m.strip() for m in spec.split(",")] != ["all"]:
        refuse_without_draft(methods)
    return methods


def recorded_prompts(records: list[dict[str, Any]], set_name: str) -> int:
    """Prompts of ``set_name`` with records: after Ctrl-C, fewer than were built."""
    return len({r["id"] for r in records if r["set"] == set_name})


CHARTS = ("speedup.png", "sweep.png")
OUTPUT_NAMES = ("results.json", "results.json.tmp", "results.md", "results.md.tmp", *CHARTS)


def keep_earlier_run(out_dir: Path, log: Callable[[str], None]) -> None:
    """Move an earlier run's results and charts in ``out_dir`` to ``out_dir/previous/`` (replacing the one
    kept there before): a rerun into the same folder, perhaps stopped early, must not wipe a finished run.
    A stopped run goes to ``previous/stopped/`` where ``previous/`` holds a finished one: two stopped
    reruns in a row replaced the finished run with the first of them."""
    names = ("results.json", "results.md", *CHARTS)
    earlier = [out_dir / name for name in names if (out_dir / name).is_file()]
    if not earlier:
        return
    kept = out_dir / "previous"
    if _was_stopped(out_dir) and (kept / "results.json").is_file() and not _was_stopped(kept):
        kept = kept / "stopped"
    kept.mkdir(parents=True, exist_ok=True)
    for name in names:
        (kept / name).unlink(missing_ok=True)
    for path in earlier:
        path.replace(kept / path.name)
    log(f"bench: the earlier run's results in {out_dir} moved to {kept}")


def _was_stopped(run_dir: Path) -> bool:
    """Whether the run whose results.json is in ``run_dir`` stopped early (Ctrl-C, or vanilla's error; its
    notes say so)."""
    from . import report

    try:
        notes = report.read_results(run_dir / "results.json").get("notes")
    except ParameterError:   # none, or not one: nothing says it stopped
        return False
    return isinstance(notes, list) and report.stopped_early(notes)


def check_out_dir(out_dir: Path) -> None:
    """ParameterError before any model loads where the results could not be written at the end: a folder
    that cannot be written, or a file where keep_earlier_run needs a folder, or a folder where a file goes."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out_dir, prefix=".write-test-") as probe:
            probe.write(bytes(4096))   # some bytes: an empty file still fits on a full disk
            probe.flush()
    except OSError as exc:
        raise ParameterError(f"--out {out_dir}: cannot write there ({exc.strerror or exc})") from None
    folders = (out_dir, out_dir / "previous", out_dir / "previous" / "stopped")
    for folder in folders[1:]:
        if folder.exists() and not folder.is_dir():
            raise ParameterError(f"--out: {folder} is not a folder (an earlier run is kept there); move it away")
    for path in (folder / name for folder in folders for name in OUTPUT_NAMES):
        if path.exists() and not path.is_file():
            raise ParameterError(f"--out: {path} is not a file (the results go there); move it away")


def _reason(exc: OSError) -> str:
    return exc.strerror or str(exc)


def save_results(out_dir: Path, payload: dict[str, Any], markdown: str, sweep_info: dict[str, Any] | None,
                 chart_title: str, log: Callable[[str], None]) -> list[str]:
    """results.json, results.md and the charts, each tried on its own (a full disk must not cost the files
    that fit); returns one line per file not written, naming it and why."""
    from . import report

    try:
        keep_earlier_run(out_dir, log)
    except OSError as exc:   # writing now would replace the earlier run's files
        return [f"cannot keep the earlier run's results in {out_dir / 'previous'} ({_reason(exc)}); "
                f"this run's files were not written over them in {out_dir}"]
    writes = {out_dir / "results.json": lambda path: report.write_json(path, payload),
              out_dir / "results.md": lambda path: report.write_text_atomic(path, markdown)}
    unsaved = []
    for path, write in writes.items():
        try:
            write(path)
            log(f"bench: wrote {path}")
        except OSError as exc:
            unsaved.append(f"cannot write {path}: {_reason(exc)}")
    return unsaved + write_charts(payload["summary"], sweep_info, out_dir, chart_title, log)


def write_charts(summary: dict[str, Any], sweep_info: dict[str, Any] | None, out_dir: Path, title: str,
                 log: Callable[[str], None]) -> list[str]:
    """speedup.png (and sweep.png with --sweep), first removing an earlier run's: a chart this run cannot
    draw (no matplotlib, no sweep) must not be left to pass for its own. Returns a line per chart that
    could not be written; its partial file is removed."""
    from . import charts

    plots = {"speedup.png": lambda path: charts.plot_speedup(summary, path, title=title)}
    if sweep_info:
        plots["sweep.png"] = lambda path: charts.plot_sweep(summary, sweep_info, path)
    unsaved = []
    for name in CHARTS:
        path = out_dir / name
        try:
            path.unlink(missing_ok=True)
            if name not in plots:
                continue
            if plots[name](path):
                log(f"bench: wrote {path}")
            else:
                log(f"bench: matplotlib is not installed (pip install matplotlib): no {name}")
        except OSError as exc:
            with contextlib.suppress(OSError):
                path.unlink(missing_ok=True)
            unsaved.append(f"cannot write {path}: {_reason(exc)}")
    return unsaved


def _cost_curves(engine: Any) -> dict[str, Any] | None:
    """The verify-cost curves this run priced rounds with (None where no contender needed them): what
    an H200 run could not tell afterwards when rounds of 4 went on that lost."""
    curves = engine.priced_curves
    if curves is None:
        return None
    target, draft = ({**curve.to_dict(), "origin": curve.origin} if curve is not None else None for curve in curves)
    return {"target": target, "draft": draft}


def _sampling_desc(sampling: Any) -> str:
    if sampling.greedy:
        return "greedy"
    return (f"temperature {sampling.temperature}, top-k {sampling.top_k}, top-p {sampling.top_p}, "
            f"min-p {sampling.min_p}, seed {sampling.seed}")


def _round_up(n: int, m: int = 256) -> int:
    return int(math.ceil(n / m) * m)


def cmd_bench(args: argparse.Namespace) -> int:
    from ..cli import _engine_from_args, _method_options, _sampling_from_args
    from ..proposers import applicable_options, method_names
    from . import peers as peers_mod
    from . import prompts as prompts_mod
    from . import report, runner
    from .machine import machine_info, model_info, versions

    if args.max_tokens is not None and args.max_tokens < 1:
        raise ParameterError("-n/--max-tokens must be >= 1")
    if args.limit is not None and args.limit < 1:
        raise ParameterError("--limit must be >= 1")
    if args.peer_timeout is not None and not args.peer_timeout > 0:
        raise ParameterError("--peer-timeout must be > 0 seconds")
    if args.tolerance_margin is not None and not args.tolerance_margin >= 0:   # nan too
        raise ParameterError("--tolerance-margin must be >= 0")
    if args.exact:
        args.tolerance_margin = None
    sampling = _sampling_from_args(args)
    method_opts = parse_method_options(args.method_options)
    custom = list(runner.CUSTOM_METHODS)
    methods = resolve_methods(args, method_names(), custom)
    def has_option(method: str, name: str) -> bool:
        return method in custom or bool(applicable_options(method, {name: None}))

    sweep = runner.parse_sweep(args.sweep, methods, has_option) if args.sweep else None
    variants_from_args = [parse_variant(v, method_names()) for v in args.variant]
    labels = [v[0] for v in variants_from_args]
    if len(set(labels)) < len(labels) or set(labels) & set(methods):
        raise ParameterError("--variant labels must differ from each other and from the methods")
    learn_n = args.learn_first
    if learn_n < 0:
        raise ParameterError("--learn-first must be >= 0")
    if learn_n and args.limit is None:
        raise ParameterError("--learn-first needs --limit: the prompts after the first --limit of each set "
                             "are the ones learned from")
    sets = prompts_mod.load_sets(args.prompts, task=args.task,
                                 limit=args.limit + learn_n if learn_n else args.limit, fewshot=args.fewshot)
    learn_sets = [dataclasses.replace(ps, items=ps.items[args.limit:]) for ps in sets] if learn_n else []
    sets = [dataclasses.replace(ps, items=ps.items[:args.limit]) for ps in sets] if learn_n else sets
    peer_labels = peers_mod.expand_peers(args.peers, has_draft=args.draft is not None)
    peers_mod.check_some_binary(peer_labels, args.llama_cpp_bin)   # before a model loads
    base_opts = _method_options(args)
    planned = plan_contenders(methods, method_opts, base_opts, sweep, variants_from_args, args.reset_pool)
    check_unique_labels(planned)
    check_contender_options(method_opts, planned, known=method_names() + custom + peers_mod.peer_names())
    check_peers_options(peer_labels, method_opts)
    notes: list[str] = []
    log = lambda msg: print(report.readable(msg), file=sys.stderr)  # noqa: E731   (a path of a non-UTF-8 byte)

    out_dir = expand_home(args.out, "give --out without ~")   # no shell expands it after --out=
    check_out_dir(out_dir)
    if args.learned is None:   # a benchmark starts cold unless asked: its figures must not depend on earlier runs
        args.learned = False
    engine = _engine_from_args(args)
    contenders: list[runner.Contender] = []
    try:
        target = engine.target
        name = " ".join(filter(None, [target.meta("general.name"), Path(target.path).name]))
        has_template = target.chat_template() is not None
        chat = args.chat if args.chat is not None else prompts_mod.looks_like_chat_model(name, has_template)
        if args.chat is None:
            notes.append(f"chat template {'applied' if chat else 'not applied'} (auto-detected from "
                         f"{name!r}; use --chat/--no-chat)")

        def template(messages: list[dict[str, str]]) -> str:
            return engine.chat_prompt(messages, add_generation_prompt=True)

        def tokenize(text: str) -> list[int]:
            return engine.tokenize(text, add_special=True, parse_special=True)

        built = prompts_mod.build_prompts(sets, tokenize, chat, template if chat else None, args.max_tokens)
        n_ctx = engine.target_ctx.n_ctx

        def fits_context(b: prompts_mod.BuiltPrompt) -> bool:
            return len(b.tokens) + b.max_tokens + 1 <= n_ctx

        fits: list[prompts_mod.BuiltPrompt] = []
        longer: list[prompts_mod.BuiltPrompt] = []
        for b in built:
            (fits if fits_context(b) else longer).append(b)
        too_long = {s.name: sum(b.set_name == s.name for b in longer) for s in sets}
        if longer:
            dropped = [f"{b.set_name}/{b.id}" for b in longer]
            notes.append(f"{len(dropped)} prompt(s) longer than the context ({n_ctx}) minus the max new tokens "
                         f"were skipped: {', '.join(dropped[:10])}{' ...' if len(dropped) > 10 else ''}")
            log(f"bench: {notes[-1]}")
        built = fits
        if not built:
            raise ParameterError("no prompt fits the context; use a larger --ctx-size")
        learn_built = [b for b in prompts_mod.build_prompts(learn_sets, tokenize, chat, template if chat else None,
                                                            args.max_tokens)
                       if fits_context(b)] if learn_sets else []
        if learn_n:
            notes.append(f"warm start: each of our drafting methods first answered {len(learn_built)} other "
                         f"prompt(s) (up to {learn_n} after the first {args.limit} of each set), untimed")
            log(f"bench: {notes[-1]}")
        warm_tokens = tokenize("warm up")
        warm = prompts_mod.BuiltPrompt(set_name="warmup", id="warmup", task="raw", text="warm up",
                                       tokens=warm_tokens, chat=False, max_tokens=8)

        # ---- our methods (with per-method options, the sweep's values and the variants) ----
        sweep_info: dict[str, Any] | None = None
        if sweep:
            swept, param, values = sweep
            sweep_info = {"param": param, "methods": swept, "values": values,
                          "labels": {runner.sweep_label(m, param, v): {"method": m, "value": v}
                                     for m in methods if m in swept for v in values}}
        for label, m, o, reset in planned:
            if m in runner.CUSTOM_METHODS:
                contenders.append(runner.FnContender(engine, label, runner.CUSTOM_METHODS[m], sampling,
                                                     options=o, method=m))
            else:
                contenders.append(runner.EngineContender(engine, label, m, o, sampling, reset_shared=reset,
                                                         cold=not args.warm_prefill))

        # ---- peers ----
        threads = engine.target_ctx.n_threads
        # A peer decodes in a context of our engine's size: llama.cpp's decode time depends on it (SmolLM2
        # on a 2-core CPU, 128-token answers: 2-3% faster with 768 cells than with 4096), so a smaller one
        # would compare unlike settings. llama-cpp-python's prompt lookup is the exception: it needs
        # logits_all, a buffer of n_ctx x n_vocab floats, so it gets what the prompts need.
        need_ctx = _round_up(max(len(b.tokens) + b.max_tokens for b in built) + 256)
        gpu_layers = engine.config.gpu_layers
        if peer_labels and not sampling.greedy:
            notes.append("peers run greedy only: skipped with sampling")
            peer_labels = []
        draft_path = engine.draft.path if engine.draft is not None else None
        cache_types = {name: getattr(engine.config, name)
                       for name in ("type_k", "type_v", "draft_type_k", "draft_type_v")}
        for label in peer_labels:
            opts = peer_options(label, method_opts)
            if label.startswith(peers_mod.BIN_PREFIX):
                if label.endswith(":draft-simple") and "n_max" not in opts and "gamma" in base_opts:
                    opts["n_max"] = base_opts["gamma"]
                contenders.append(peers_mod.LlamaCppBinPeer(
                    label, args.llama_cpp_bin, target, target.path, draft_path, n_ctx=n_ctx,
                    n_ubatch=min(512, engine.config.n_batch), threads=threads, gpu_layers=gpu_layers,
                    draft_gpu_layers=engine.config.draft_gpu_layers, flash_attn=engine.config.flash_attn,
                    options=opts, timeout=args.peer_timeout, main_gpu=target.main_gpu, cache_types=cache_types))
            else:
                if label == peers_mod.PY_PLD and "num_pred_tokens" not in opts:
                    # llama-cpp-python's README: 10 on GPU, 2 on CPU
                    opts["num_pred_tokens"] = 10 if gpu_layers != 0 else 2
                contenders.append(peers_mod.LlamaCppPythonPeer(
                    label, target.path, eog=target.eog_tokens,
                    n_ctx=need_ctx if label == peers_mod.PY_PLD else n_ctx,
                    n_batch=engine.target_ctx.n_batch, threads=threads, gpu_layers=gpu_layers,
                    flash_attn=engine.config.flash_attn, options=opts,
                    cold=not args.warm_prefill, main_gpu=target.main_gpu, cache_types=cache_types))
                if label == peers_mod.PY_PLD and need_ctx < n_ctx:
                    notes.append(f"{label} runs in a context of {need_ctx} tokens (its logits_all buffer), "
                                 f"{n_ctx} for the others: its speed-up over llama-cpp-python is a few "
                                 "percent in its favour")
        if peer_labels:
            notes.append("peer speeds are per decode step: a peer's first token comes out of its prompt "
                         "evaluation and is not timed; llama.cpp binaries are compared by text")

        started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        log(f"bench: {len(built)} prompts x {len(contenders)} methods "
            f"({', '.join(c.label for c in contenders)}), chat={chat}, output in {out_dir}")
        run = runner.run_benchmark(built, contenders, engine=engine, warmup_prompt=warm,
                                   warmup=not args.no_warmup, greedy=sampling.greedy,
                                   tolerance_margin=args.tolerance_margin, progress=not args.no_progress,
                                   save_text=args.save_text, log=log, learn_prompts=learn_built)

        if run.failed and not run.records:
            raise ParameterError(run.failed)
        if run.interrupted and not run.records:   # an earlier run's results there stay as they are
            log(f"bench: nothing written to {out_dir}")
            return run.exit_status
        with saving_first(log) as pressed:   # a second Ctrl-C must not lose a long run's measurements
            if run.interrupted:
                how = "Ctrl-C" if run.exit_status == 130 else f"exit status {run.exit_status}: a signal"
                notes.append(f"{report.STOPPED_NOTE} ({how}): only the prompts completed before it are "
                             "included")
            if run.failed:
                notes.append(f"{report.FAILED_NOTE} ({run.failed}): only the prompts completed before it are "
                             "included")
            disturbed = runner.disturbed_note(run.records)
            if disturbed is not None:
                notes.append(disturbed)
            machine = machine_info(measure_bandwidth=not (args.no_bandwidth or run.interrupted or run.failed))
            model_bytes = target.size_bytes
            summary = report.summarize(run.records, run.contenders, model_bytes)
            set_entries = []
            for s in sets:
                n_run = recorded_prompts(run.records, s.name)
                set_entries.append({"name": s.name, "file": s.path, "task": s.task, "prompts": n_run,
                                    "max_tokens": args.max_tokens or prompts_mod.DEFAULT_MAX_TOKENS.get(s.task, 128),
                                    "chat": chat, "fewshot": len(s.fewshot), "too_long": too_long[s.name]})
            payload: dict[str, Any] = {
                "schema": report.SCHEMA,
                "created": started,
                "command": ["ouroboros-local"] + sys.argv[1:],
                "settings": {
                    "target": args.model, "draft": args.draft, "prompts": args.prompts, "task": args.task,
                    "methods": methods, "peers": peer_labels, "llama_cpp_bin": args.llama_cpp_bin,
                    "limit": args.limit, "learn_first": learn_n, "max_tokens": args.max_tokens, "chat": chat,
                    "fewshot": args.fewshot,
                    "sampling": {"temperature": sampling.temperature, "top_k": sampling.top_k,
                                 "top_p": sampling.top_p, "min_p": sampling.min_p, "seed": sampling.seed},
                    "sampling_desc": _sampling_desc(sampling), "method_options": method_opts,
                    "cli_method_options": base_opts, "sweep": args.sweep,
                    "tolerance_margin": args.tolerance_margin, "warmup": not args.no_warmup,
                    "reset_pool": args.reset_pool, "prefill": "warm" if args.warm_prefill else "cold",
                    "threads": threads, "n_ctx": n_ctx,
                    "n_batch": engine.target_ctx.n_batch, "n_seq_max": engine.target_ctx.n_seq_max,
                    "gpu_layers": gpu_layers, "draft_gpu_layers": engine.config.draft_gpu_layers,
                    "flash_attn": engine.config.flash_attn, "order": "balanced per prompt (Williams design)",
                    "engine_config": dataclasses.asdict(engine.config),
                    "cost_curves": _cost_curves(engine),
                },
                "machine": machine,
                "versions": versions(),
                "models": {"target": model_info(target, force_hash=args.hash_models),
                           "draft": model_info(engine.draft, force_hash=args.hash_models)},
                "sets": set_entries,
                "methods": run.contenders,
                "skipped": run.skipped,
                "summary": summary,
                "mismatches": report.mismatch_list(run.records),
                "records": run.records,
                "sweep": sweep_info,
                "notes": notes,
                "wall_seconds": run.wall_seconds,
            }
            md = report.render_markdown(payload)
            not_shown = _print_table(md)   # first: the table survives files the disk has no room for
            offloaded = engine.config.gpu_layers != 0 and machine.get("gpus")
            where = machine["gpus"][0].split(",")[0] if offloaded else machine.get("cpu")
            title = report.readable(f"{Path(target.path).name} on {where}")   # a chart's text, as results.md's
            unsaved = save_results(out_dir, payload, md, sweep_info, title, log) + not_shown
        if pressed and not run.interrupted:   # its exit status: 130 Ctrl-C, 143 SIGTERM, 129 SIGHUP
            run.interrupted, run.exit_status = True, 128 + pressed[0]
        for line in unsaved:
            log(f"bench: error: {line}")
        n_bad = sum(1 for m in payload["mismatches"] if m["match"] == "mismatch")
        n_ties = sum(1 for m in payload["mismatches"] if m["match"] == "tie-flip")
        n_unchecked = sum(1 for r in run.records if r.get("match") in report.UNCHECKED)
        n_sampled = sum(1 for r in run.records if r.get("compare") == "sampled")
        if args.strict and n_sampled:   # --strict promises outputs checked against vanilla's: none was
            log(f"bench: --strict: {n_sampled} sampled output(s) not compared with vanilla's (sampling is not "
                "compared token for token; use --temperature 0 to check outputs)")
        if n_bad:
            log(f"bench: WARNING: {n_bad} output(s) differ from vanilla beyond the tie rule (see results.md)")
        if n_unchecked:
            log(f"bench: WARNING: {n_unchecked} output(s) not compared with vanilla (an error, theirs or "
                "vanilla's; see results.json)")
        if n_ties:
            log(f"bench: {n_ties} output(s) part from vanilla at a near-tie (tie-flip: both tokens within "
                f"{args.tolerance_margin} logits, allowed by the tie rule; see results.md)")
        not_run = unexpected_skips(run.skipped, planned, has_draft=engine.draft is not None)
        if not_run:   # a contender asked for that never ran has no record to count as unchecked
            log(f"bench: WARNING: {len(not_run)} contender(s) did not run: {', '.join(not_run)} (see results.md)")
        if run.interrupted:
            return run.exit_status
        if run.failed:
            log(f"bench: error: {run.failed}")
            return 2
        if unsaved:   # the table is printed, but not every file of the run is there
            return 1
        return 3 if (args.strict and (n_bad or n_unchecked or n_sampled or not_run)) else 0
    finally:
        for c in contenders:
            try:
                c.close()
            except Exception:  # pragma: no cover - best effort
                pass
        engine.close()
