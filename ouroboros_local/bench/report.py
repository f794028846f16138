"""Summaries (speed-ups, intervals, identity), results.json and results.md; machine facts are in
machine.py, the charts in charts.py."""

from __future__ import annotations

import json
import math
import os
import re
import sys
from collections import OrderedDict
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from ..calibration import CostModel, curve_problem
from ..errors import ParameterError
from ..filestore import replace_text
from ..text_input import read_text
from ..time_split import DECODE_PARTS, PARTS

SCHEMA = "ouroboros-local-bench/1"

# Top-level keys of results.json (stable; tests assert this set).
RESULT_KEYS = ("schema", "created", "command", "settings", "machine", "versions", "models", "sets",
               "methods", "skipped", "summary", "mismatches", "records", "sweep", "notes", "wall_seconds")

# Keys of every summary entry (results.json: summary[set][label]).
SUMMARY_KEYS = ("label", "kind", "method", "prompts", "errors", "tokens", "timed_tokens", "prompt_tokens",
                "prefill_seconds", "decode_seconds", "tokens_per_second", "prefill_tokens_per_second",
                "speedup", "paired", "speedup_geomean", "baseline", "speedup_vs_baseline", "target_passes",
                "drafted", "accepted", "accepted_per_pass", "tokens_per_pass", "passes_per_100_tokens", "compared",
                "identical", "tie_flips", "mismatches", "unchecked", "all_identical", "bandwidth_gbs", "speedup_ci",
                "python_ms_per_round", "graph_rebuilds_per_100_passes", "time_split", "draft_graphs")

CI_LEVEL = 0.90          # speedup_ci: a paired bootstrap interval over the set's prompts
CI_RESAMPLES = 2000

ALL_SETS = "all"

STOPPED_NOTE = "interrupted"   # a stopped run's note begins so (results.json "notes")
FAILED_NOTE = "stopped early"  # a run vanilla's error stopped


def stopped_early(notes: Sequence[Any]) -> bool:
    """Whether a run's notes say it stopped early (Ctrl-C, or vanilla's error)."""
    return any(str(note).startswith((STOPPED_NOTE, FAILED_NOTE)) for note in notes)


# ---- summaries ---------------------------------------------------------------------------------
def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def _geomean(values: Iterable[float]) -> float | None:
    vals = [v for v in values if v and v > 0 and math.isfinite(v)]
    if not vals:
        return None
    return math.exp(sum(math.log(v) for v in vals) / len(vals))


def _per_prompt_tps(rec: Mapping[str, Any]) -> float | None:
    timed = rec.get("timed_tokens") or 0
    dec = rec.get("decode_seconds") or 0.0
    return timed / dec if timed and dec > 0 else None


def _speed_pair(rec: Mapping[str, Any], ref: Mapping[str, Any]) -> tuple[float, float, float, float] | None:
    """(tokens, seconds, reference tokens, reference seconds) of one prompt; None without timings."""
    pair = (rec.get("timed_tokens") or 0, rec.get("decode_seconds") or 0.0,
            ref.get("timed_tokens") or 0, ref.get("decode_seconds") or 0.0)
    return pair if pair[1] > 0 and pair[3] > 0 else None


def _runs_by_prompt(records: Iterable[Mapping[str, Any]], label: str) -> dict[tuple[str, str], Mapping[str, Any]]:
    """``label``'s successful records by (set, prompt id)."""
    return {(r["set"], r["id"]): r for r in records if r["label"] == label and not r.get("error")}


def _pairs(runs: Mapping[tuple[str, str], Mapping[str, Any]], ref_runs: Mapping[tuple[str, str], Mapping[str, Any]]
           ) -> list[tuple[float, float, float, float]]:
    """``_speed_pair`` of every prompt both ran successfully, with timings."""
    pairs = [_speed_pair(r, ref_runs[key]) for key, r in runs.items() if key in ref_runs]
    return [p for p in pairs if p]


def paired_speedup(pairs: Sequence[tuple[float, float, float, float]]) -> float | None:
    """sum(tokens) / sum(seconds) over that of the reference, on the same prompts (a ratio of sums):
    pooling each side over its own successes would compare different prompts (a method as fast as
    vanilla that failed on the slowest prompt came out 3.25x)."""
    tokens, seconds, ref_tokens, ref_seconds = (sum(p[i] for p in pairs) for i in range(4))
    if not (seconds and ref_tokens and ref_seconds):
        return None
    return (tokens / seconds) / (ref_tokens / ref_seconds)


def bootstrap_speedup(pairs: Sequence[tuple[float, float, float, float]], level: float = CI_LEVEL,
                      resamples: int = CI_RESAMPLES, seed: int = 0) -> list[float] | None:
    """Interval for sum(tokens) / sum(seconds) of a method over that of the reference.

    ``pairs`` holds (tokens, seconds, reference tokens, reference seconds) per prompt. Prompts are
    resampled with replacement, each with both of its runs (paired: a prompt that is slow to decode is
    slow for every method), so the interval shows how much the speed-up owes to which prompts were
    drawn and to the machine's noise on each."""
    if len(pairs) < 3:
        return None
    import numpy as np

    a = np.asarray(pairs, dtype=float)
    idx = np.random.default_rng(seed).integers(0, len(a), size=(resamples, len(a)))
    picked = a[idx]                                   # resamples x prompts x 4
    sums = picked.sum(axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratios = (sums[:, 0] / sums[:, 1]) / (sums[:, 2] / sums[:, 3])
    ratios = ratios[np.isfinite(ratios)]
    if not len(ratios):
        return None
    tail = (1.0 - level) / 2.0
    return [float(np.quantile(ratios, tail)), float(np.quantile(ratios, 1.0 - tail))]


def python_ms_per_round(records: Sequence[Mapping[str, Any]]) -> float | None:
    """Milliseconds per target pass spent outside llama.cpp's decoding (our methods' extra.python_seconds:
    the runtime's own overhead, which a fast GPU step exposes); None for peers."""
    timed = [r for r in records if (r.get("extra") or {}).get("python_seconds") is not None
             and r.get("target_passes")]
    rounds = sum(r["target_passes"] for r in timed)
    return 1e3 * sum(r["extra"]["python_seconds"] for r in timed) / rounds if rounds else None


def graph_rebuilds_per_100_passes(records: Sequence[Mapping[str, Any]]) -> float | None:
    """Decodes (prefill included) for which llama.cpp built a new graph, per 100 target passes (our
    methods' extra.graphs_rebuilt): each follows a change of the batch's shape, which on a CUDA build
    also runs without the CUDA graph; None for peers."""
    counted = [r for r in records if (r.get("extra") or {}).get("graphs_rebuilt") is not None
               and r.get("target_passes")]
    passes = sum(r["target_passes"] for r in counted)
    return 100.0 * sum(r["extra"]["graphs_rebuilt"] for r in counted) / passes if passes else None


def draft_graphs(records: Sequence[Mapping[str, Any]]) -> list[int] | None:
    """The draft model's decodes and those that built a new graph (extra.draft_graphs), pooled; None
    where no draft model decoded."""
    counted = [r["extra"]["draft_graphs"] for r in records if (r.get("extra") or {}).get("draft_graphs")]
    return [sum(c[0] for c in counted), sum(c[1] for c in counted)] if counted else None


def time_split_per_100_tokens(records: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, float]] | None:
    """Our methods' extra.time_split pooled over prompts: {part: {"ms": milliseconds per 100 timed
    tokens, "rounds": rounds per 100 timed tokens}} (parts as in time_split.PARTS); None for peers."""
    timed = [r for r in records if (r.get("extra") or {}).get("time_split") and r.get("timed_tokens")]
    tokens = sum(r["timed_tokens"] for r in timed)
    if not tokens:
        return None
    out: dict[str, dict[str, float]] = {}
    for part in PARTS:
        rows = [r["extra"]["time_split"].get(part, [0, 0.0]) for r in timed]
        out[part] = {"ms": 1e5 * sum(s for _, s in rows) / tokens, "rounds": 100.0 * sum(n for n, _ in rows) / tokens}
    return out


def summarize(records: Sequence[Mapping[str, Any]], contenders: Sequence[Mapping[str, Any]],
              model_bytes: int | None, reference: str = "vanilla") -> dict[str, dict[str, dict[str, Any]]]:
    """summary[set][label] = aggregated numbers (see SUMMARY_KEYS); an "all" set when there are several."""
    info = {c["label"]: c for c in contenders}
    labels = [c["label"] for c in contenders]
    sets: list[str] = []
    for r in records:
        if r["set"] not in sets:
            sets.append(r["set"])
    groups: list[tuple[str, list[Mapping[str, Any]]]] = [(s, [r for r in records if r["set"] == s]) for s in sets]
    if len(sets) > 1:
        groups.append((ALL_SETS, list(records)))
    out: dict[str, dict[str, dict[str, Any]]] = OrderedDict()
    for set_name, recs in groups:
        by_label: dict[str, dict[str, Any]] = OrderedDict()
        ref_runs = _runs_by_prompt(recs, reference)
        ref_tps = {key: _per_prompt_tps(r) for key, r in ref_runs.items()}
        for label in labels:
            rs = [r for r in recs if r["label"] == label]
            ok = [r for r in rs if not r.get("error")]
            s: dict[str, Any] = {k: None for k in SUMMARY_KEYS}
            c = info.get(label, {})
            s.update(label=label, kind=c.get("kind"), method=c.get("method"), baseline=c.get("baseline"),
                     prompts=len(ok), errors=len(rs) - len(ok))
            tot = {k: sum((r.get(k) or 0) for r in ok) for k in (
                "tokens", "timed_tokens", "prompt_tokens", "prefill_seconds", "decode_seconds",
                "target_passes", "drafted", "accepted")}
            s.update(tot)
            s["tokens_per_second"] = _ratio(tot["timed_tokens"], tot["decode_seconds"])
            s["prefill_tokens_per_second"] = _ratio(tot["prompt_tokens"], tot["prefill_seconds"])
            if tot["target_passes"]:
                s["accepted_per_pass"] = tot["accepted"] / tot["target_passes"]
                s["tokens_per_pass"] = tot["timed_tokens"] / tot["target_passes"]
            if tot["timed_tokens"]:
                s["passes_per_100_tokens"] = 100.0 * tot["target_passes"] / tot["timed_tokens"]
            if model_bytes and tot["decode_seconds"] > 0 and tot["target_passes"]:
                s["bandwidth_gbs"] = model_bytes * tot["target_passes"] / tot["decode_seconds"] / 1e9
            ratios = []
            for r in ok:
                a, b = _per_prompt_tps(r), ref_tps.get((r["set"], r["id"]))
                if a and b:
                    ratios.append(a / b)
            s["speedup_geomean"] = _geomean(ratios)
            s["python_ms_per_round"] = python_ms_per_round(ok)
            s["graph_rebuilds_per_100_passes"] = graph_rebuilds_per_100_passes(ok)
            s["time_split"] = time_split_per_100_tokens(ok)
            s["draft_graphs"] = draft_graphs(ok)
            runs = _runs_by_prompt(recs, label)
            pairs = _pairs(runs, ref_runs)
            s["speedup"], s["paired"] = paired_speedup(pairs), len(pairs)
            s["speedup_ci"] = bootstrap_speedup(pairs) if label != reference else None
            if s["baseline"] and s["baseline"] in labels:
                s["speedup_vs_baseline"] = paired_speedup(_pairs(runs, _runs_by_prompt(recs, s["baseline"])))
            s.update(identity_counts(rs))
            by_label[label] = s
        out[set_name] = by_label
    return out


UNCHECKED = ("error", "no-reference")   # records whose output was never compared with vanilla's


def identity_counts(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """How a row's outputs compare with vanilla's; ``unchecked`` counts the prompts it failed on, or where
    vanilla failed: an output never compared is not an identical one (--strict fails on it)."""
    compared = [r for r in records if r.get("match") in ("identical", "mismatch", "tie-flip", "reference")]
    counts: dict[str, Any] = {
        "compared": len(compared),
        "identical": sum(r.get("match") in ("identical", "reference") for r in compared),
        "tie_flips": sum(r.get("match") == "tie-flip" for r in compared),
        "mismatches": sum(r.get("match") == "mismatch" for r in compared),
        "unchecked": sum(r.get("match") in UNCHECKED for r in records)}
    checked = compared or counts["unchecked"]
    counts["all_identical"] = (counts["identical"] == len(compared) and not counts["unchecked"]) if checked else None
    return counts


def mismatch_list(records: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    keys = ("set", "id", "label", "match", "compare", "first_diff", "ref_token", "got_token", "margin")
    return [{k: r.get(k) for k in keys} for r in records if r.get("match") in ("mismatch", "tie-flip")]


def _json_default(obj: Any) -> Any:
    try:
        import numpy as np

        if isinstance(obj, np.generic):
            return obj.item()
        if isinstance(obj, np.ndarray):
            return obj.tolist()
    except ImportError:  # pragma: no cover
        pass
    if isinstance(obj, (set, frozenset, tuple)):
        return list(obj)
    if isinstance(obj, Path):
        return str(obj)
    return repr(obj)


def write_text_atomic(path: str | Path, text: str) -> Path:
    """``path`` holds ``text`` whole or is left as it was: written beside it as PATH.tmp, then renamed; the
    .tmp is removed when the write fails (a full disk left a 0-byte results.json.tmp)."""
    path = Path(path)
    replace_text(path, text, path.with_name(path.name + ".tmp"))
    return path


def write_json(path: str | Path, payload: Mapping[str, Any]) -> Path:
    text = json.dumps(payload, indent=1, ensure_ascii=False, default=_json_default) + "\n"
    # what UTF-8 cannot encode (a non-UTF-8 byte of a path given on the command line, kept as U+DC80-U+DCFF)
    # is only ever inside a JSON string: written as its JSON escape ("\\udce9"), which reads back the same
    return write_text_atomic(path, text.encode("utf-8", "backslashreplace").decode("utf-8"))


_SURROGATE = re.compile("[\ud800-\udfff]")


def readable(text: str) -> str:
    """``text`` with what UTF-8 cannot encode shown as an escape: a non-UTF-8 byte of a file name as "\\xe9"
    (as ``ls -b`` does), a lone surrogate as "\\ud800". Written or printed as is, it raised UnicodeEncodeError."""
    def escape(match: re.Match[str]) -> str:
        code = ord(match.group())
        return f"\\x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"\\u{code:04x}"

    return _SURROGATE.sub(escape, text)


def _f(v: Any, fmt: str = "{:.2f}", none: str = "–") -> str:
    if v is None:
        return none
    try:
        return fmt.format(v)
    except (TypeError, ValueError):
        return str(v)


def _human_bytes(n: Any) -> str:
    if not n:
        return "?"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return str(n)


def identical_cell(s: Mapping[str, Any]) -> str:
    unchecked = f"{s['unchecked']} unchecked" if s.get("unchecked") else ""
    if s.get("label") == "vanilla":
        return "reference" + (f", {unchecked}" if unchecked else "")
    if not s.get("compared"):
        return unchecked or "n/a"
    if s.get("all_identical"):
        return f"yes ({s['identical']}/{s['compared']})"
    parts = [f"{s['identical']}/{s['compared']}"]
    if s.get("mismatches"):
        parts.append(f"{s['mismatches']} MISMATCH")
    if s.get("tie_flips"):
        parts.append(f"{s['tie_flips']} tie-flip")
    if unchecked:
        parts.append(unchecked)
    differs = s.get("mismatches") or s.get("tie_flips")
    return ("NO: " if differs else "") + ", ".join(parts)


def _cost_line(curve: Any) -> str | None:
    """The target's calibrated verify costs in plain steps (``settings.cost_curves``: a CostModel's fields
    and its origin), or None (none recorded, or a curve the cost-curve cache would refuse: edited by hand)."""
    fields = {k: v for k, v in curve.items() if k != "origin"} if isinstance(curve, dict) else None
    if curve_problem(fields) is not None:
        return None
    model = CostModel(**fields)
    sizes, seconds, round_size = model.sizes, model.seconds, model.round_size
    step = model.plain_seconds if round_size else seconds[0]
    if len(sizes) < 2 or step <= 0:
        return None
    costs = ", ".join(f"c({n}) {s / step:.2f}" for n, s in zip(sizes, seconds)
                      if n in (2, 4, 8, 16) and n > max(round_size, 1))
    parts = ([f"a round of {round_size} {seconds[0] / step:.2f}"] if round_size else []) + ([costs] if costs else [])
    if model.switch_seconds > 0:
        parts.append(f"the plain steps after another size lose {model.switch_seconds / step:.2f}")
    return f"- verify costs as calibrated, in plain steps of {step * 1e3:.2f} ms: " + "; ".join(parts)


def render_markdown(payload: Mapping[str, Any]) -> str:
    lines: list[str] = ["# ouroboros-local benchmark", ""]
    models = payload.get("models") or {}
    tgt = models.get("target") or {}
    dft = models.get("draft") or {}
    mach = payload.get("machine") or {}
    st = payload.get("settings") or {}
    lines.append(f"- target: `{tgt.get('file')}` ({_human_bytes(tgt.get('size_bytes'))} weights)"
                 + (f", draft: `{dft.get('file')}` ({_human_bytes(dft.get('size_bytes'))})" if dft else ""))
    lines.append(f"- machine: {mach.get('cpu')}, {mach.get('logical_cores')} threads, "
                 f"{_human_bytes(mach.get('memory_bytes'))} RAM, {mach.get('os')}"
                 + (f", GPU: {'; '.join(mach['gpus'])}" if mach.get("gpus") else "")
                 + (f"; memory copy bandwidth {_f(mach.get('memory_bandwidth_gbs'), '{:.1f}')} GB/s"
                    if mach.get("memory_bandwidth_gbs") else ""))
    engine = st.get("engine_config") or {}
    lines.append(f"- settings: {st.get('sampling_desc', 'greedy')}, threads {st.get('threads')}, "
                 f"ctx {st.get('n_ctx')}, chat {st.get('chat')}, warm-up {st.get('warmup')}, "
                 f"gpu layers {st.get('gpu_layers')}"
                 + (f", flash attention {engine['flash_attn']}" if engine.get("flash_attn") else "")
                 + (f", rounds of {engine['round_size']}" if engine.get("round_size")
                    else ", rounds of each draft's size" if engine else "")
                 + ("" if engine.get("overlap") is None else f", overlap {'on' if engine['overlap'] else 'off'}")
                 + (", round switch off" if engine.get("round_size") and engine.get("round_switch") is False
                    else "")
                 + f", created {payload.get('created')}")
    curves = st.get("cost_curves")
    cost = _cost_line(curves.get("target") if isinstance(curves, dict) else None)
    if cost:
        lines.append(cost)
    lines.append("")
    lines.append("tok/s: decode tokens per second (prefill apart); speedup: over vanilla (sum of tokens / "
                 "sum of decode seconds, on the prompts both ran without error), "
                 f"{CI_LEVEL:.0%} CI: paired bootstrap interval of the speedup over "
                 "the prompts; geomean: per-prompt geometric mean; acc/pass: accepted draft "
                 "tokens per target pass; passes/100: target passes per 100 tokens; GB/s: model bytes x "
                 "target passes per second; identical: outputs equal to vanilla's (unchecked: prompts where it or "
                 "vanilla failed); prefill tok/s: prompt tokens per second of its evaluation (ours leave "
                 "the last token to the first decode step, a peer's time may hold its first token: compare "
                 "ours with ours); py ms/round: time per "
                 "target pass outside llama.cpp's decoding and the wait for its logits (our Python); "
                 "rebuilds/100: decodes for which llama.cpp built a new graph (a new batch shape; on a GPU, "
                 "no CUDA graph) per 100 passes.")
    lines.append("")
    for set_name, by_label in (payload.get("summary") or {}).items():
        set_info = next((s for s in payload.get("sets", []) if s.get("name") == set_name), {})
        title = f"## {set_name}"
        if set_info:
            title += f" ({set_info.get('task')}, {set_info.get('prompts')} prompts, " \
                     f"max {set_info.get('max_tokens')} new tokens)"
        lines += [title, "",
                  f"| method | tok/s | speedup | {CI_LEVEL:.0%} CI | geomean | acc/pass | passes/100 tok | "
                  "identical | prefill tok/s | GB/s | py ms/round | rebuilds/100 |",
                  "|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|"]
        for s in by_label.values():
            speed = _f(s.get("speedup"), "{:.2f}x")
            ran = (s.get("prompts") or 0) + (s.get("errors") or 0)
            if s.get("speedup") is not None and s.get("paired") is not None and s["paired"] < ran:
                speed += f" (on {s['paired']}/{ran} prompts)"   # the prompts both it and vanilla ran
            if s.get("kind") == "peer" and s.get("baseline") not in (None, "vanilla", s["label"]):
                speed += f" ({_f(s.get('speedup_vs_baseline'), '{:.2f}x')} vs own)"
            name = s["label"] + (" (peer)" if s.get("kind") == "peer" else "")
            if s.get("errors"):
                name += f" [{s['errors']} errors]"
            ci = s.get("speedup_ci")
            ci_cell = f"{ci[0]:.2f}-{ci[1]:.2f}" if ci else "–"
            lines.append(f"| {name} | {_f(s.get('tokens_per_second'), '{:.1f}')} | {speed} | {ci_cell} | "
                         f"{_f(s.get('speedup_geomean'), '{:.2f}x')} | {_f(s.get('accepted_per_pass'))} | "
                         f"{_f(s.get('passes_per_100_tokens'), '{:.1f}')} | {identical_cell(s)} | "
                         f"{_f(s.get('prefill_tokens_per_second'), '{:.1f}')} | "
                         f"{_f(s.get('bandwidth_gbs'), '{:.1f}')} | "
                         f"{_f(s.get('python_ms_per_round'), '{:.3f}')} | "
                         f"{_f(s.get('graph_rebuilds_per_100_passes'), '{:.1f}')} |")
        lines.append("")
    summarized = set(payload.get("summary") or {})
    for set_info in payload.get("sets", []):   # sets no prompt of finished (a stopped run's, skipped prompts)
        if set_info.get("name") not in summarized:
            lines += [_unfinished_set_heading(set_info, payload.get("notes") or []), ""]
    lines += _time_split_lines(payload.get("summary") or {})
    lines += _draft_graph_lines(payload.get("summary") or {})
    mism = payload.get("mismatches") or []
    if mism:
        lines += ["## Outputs that differ from vanilla", "",
              "margin: how much plain decoding preferred vanilla's token over the method's at the first "
              "difference, replaying the vanilla prefix as plain decoding computed it, one token a step "
              "(--tolerance-margin); below the "
              "tolerance the difference is a tie-flip (a floating-point near-tie), otherwise a mismatch.", "",
                  "| set | prompt | method | verdict | first difference | vanilla token | method token | "
                  "margin (logits) |", "|---|---|---|---|---:|---:|---:|---:|"]
        for m in mism:
            pos = f"{m['compare'] == 'tokens' and 'token' or 'char'} {m['first_diff']}"
            lines.append(f"| {m['set']} | {m['id']} | {m['label']} | {m['match']} | {pos} | "
                         f"{_f(m.get('ref_token'), '{}')} | {_f(m.get('got_token'), '{}')} | "
                         f"{_f(m.get('margin'), '{:.4f}')} |")
        lines.append("")
    skipped = payload.get("skipped") or {}
    if skipped:
        lines += ["## Not run", ""] + [f"- {k}: {v}" for k, v in skipped.items()] + [""]
    notes = payload.get("notes") or []
    if notes:
        lines += ["## Notes", ""] + [f"- {n}" for n in notes] + [""]
    return readable("\n".join(lines))


def _unfinished_set_heading(set_info: Mapping[str, Any], notes: Sequence[str]) -> str:
    """The heading of a set no prompt of finished, saying why: its prompts too long for the context
    (set_info's too_long), the run stopped, or both; "see Notes" only where there are notes."""
    too_long = set_info.get("too_long") or 0
    stopped = stopped_early(notes)
    skipped = f"{too_long} prompt(s) longer than the context minus the max new tokens"
    if too_long and stopped:
        reason = f"no prompt of it finished: {skipped}, and the run stopped early"
    elif too_long:
        reason = f"not run: {skipped}"
    else:
        reason = "no prompt of it finished" + (" before the run stopped" if stopped else "")
    return f"## {set_info.get('name')} ({set_info.get('task')}: {reason}{'; see Notes' if notes else ''})"


_PART_HEADINGS = {"plain": "plain", "after_draft": "plain after a draft", "ahead": "plain, drafting",
                  "drafted": "drafted", "carried": "carried", "propose": "propose", "observe": "observe",
                  "other": "other"}


def _time_split_lines(summary: Mapping[str, Mapping[str, Mapping[str, Any]]]) -> list[str]:
    """One table: per set and method, milliseconds of decode time per 100 tokens by part, and the
    rounds per 100 tokens of each kind of decode."""
    rows = [(set_name, s) for set_name, by_label in summary.items() for s in by_label.values()
            if s.get("time_split")]
    if not rows:
        return []
    heads = [_PART_HEADINGS[p] for p in PARTS]
    lines = ["## Where the decode time goes", "",
             "Milliseconds per 100 tokens (rounds per 100 tokens in brackets): decodes with their verification "
             "(rounds that verified no draft, filled to --round-size or not; the one-token steps after a larger "
             "decode, which on a GPU run without their CUDA graph; plain steps that drafted while decoding; "
             "rounds that verified a draft made before their decode; the rest of a draft a plain step began), "
             "then our Python in the open: asking the proposer and the scheduler before a decode, observing a "
             "round after it, and the rest (the loop, the output).", "",
             "| set | method | " + " | ".join(heads) + " | total |",
             "|---|---|" + "---:|" * (len(heads) + 1)]
    for set_name, s in rows:
        split = s["time_split"]
        cells = [f"{split[p]['ms']:.1f}" + (f" ({split[p]['rounds']:.1f})" if p in DECODE_PARTS and split[p]["rounds"]
                                           else "") for p in PARTS]
        total = sum(split[p]["ms"] for p in PARTS)
        lines.append(f"| {set_name} | {s['label']} | " + " | ".join(cells) + f" | {total:.1f} |")
    lines.append("")
    return lines


def _draft_graph_lines(summary: Mapping[str, Mapping[str, Mapping[str, Any]]]) -> list[str]:
    """Per set and method that decoded with a draft model: its decodes and the share that built a new
    graph (a catch-up batch after one-token steps, or the step after it)."""
    rows = [(set_name, s) for set_name, by_label in summary.items() for s in by_label.values()
            if s.get("draft_graphs") and set_name != ALL_SETS]
    if not rows:
        return []
    lines = ["## The draft model's graphs", "",
             "Decodes of the draft model and those for which llama.cpp built a new graph (a change of batch "
             "shape; on a CUDA build, a decode without its CUDA graph).", "",
             "| set | method | draft decodes | new graph |", "|---|---|---:|---:|"]
    for set_name, s in rows:
        decodes, rebuilt = s["draft_graphs"]
        lines.append(f"| {set_name} | {s['label']} | {decodes} | {rebuilt} ({100.0 * rebuilt / decodes:.0f}%) |")
    lines.append("")
    return lines


# ---- re-rendering -------------------------------------------------------------------------------
def markdown_path(results: Path) -> Path:
    """Where a results file's Markdown goes: results.json's results.md, NAME.json's NAME.md (two files
    re-rendered in one folder once wrote one results.md, the second over the first)."""
    if results.suffix.lower() == ".json":
        return results.with_suffix(".md")
    return results.with_name(results.name + ".md")


def rerender(results: str | Path) -> Path:
    """Recompute a results.json's summary from its records (for columns added since it was written)
    and rewrite it and the Markdown beside it (``markdown_path``); returns the Markdown file's path."""
    path = Path(results)
    payload = read_results(path)
    if "methods" not in payload:
        raise ParameterError(f"{path} is not a bench results.json (no methods)")
    md = markdown_path(path)
    if md.exists() and not md.is_file():   # refused before the results file is rewritten
        raise ParameterError(f"cannot write {md}: it is not a file")
    target = (payload.get("models") or {}).get("target") or {}
    payload["summary"] = summarize(payload["records"], payload["methods"], target.get("size_bytes"))
    try:
        write_json(path, payload)
        write_text_atomic(md, render_markdown(payload))
    except OSError as exc:
        raise ParameterError(f"cannot write {exc.filename or md}: {exc.strerror or exc}") from None
    return md


RECORD_KEYS = ("set", "id", "label")   # what every record of bench's names (runner._record)


def read_results(path: str | Path) -> dict[str, Any]:
    """A bench results.json: a JSON object whose records are objects, each naming its set, id and label. The
    one reader of these files (re-rendering, pooling, scripts/ab_summary.py, pool_runs.py, compare_runs.py):
    ParameterError in one line naming the file where it is missing, unreadable, not JSON or not one."""
    try:
        payload = json.loads(read_text(path, "results file"))
    except ValueError as exc:
        raise ParameterError(f"{path} is not JSON ({exc})") from None
    except RecursionError:   # nested deeper than Python's stack: no results file is
        raise ParameterError(f"{path} is not a bench results.json (nested too deep)") from None
    records = payload.get("records") if isinstance(payload, dict) else None
    if not isinstance(records, list) or not all(
            isinstance(r, dict) and all(isinstance(r.get(key), str) for key in RECORD_KEYS) for r in records):
        raise ParameterError(f"{path} is not a bench results.json (no records, each naming its set, id and label)")
    return payload


def _same_method(label: str) -> str:
    # adaptive=true is every method's default: a sweep's "X[adaptive=True]" row is a plain "X" row
    return label.replace("[adaptive=True]", "")


def pooled_speedups(payloads: Sequence[Mapping[str, Any]], label: str, reference: str = "vanilla"
                    ) -> dict[str, dict[str, Any]]:
    """Speed-up of ``label`` over ``reference`` per set (and "all"), pooling the prompts of several runs;
    each (run, prompt) is one pair of the bootstrap interval."""
    pairs: dict[str, list[tuple[float, float, float, float]]] = OrderedDict()
    for run in payloads:
        by = {(r["set"], r["id"], _same_method(r["label"])): r for r in run["records"] if not r.get("error")}
        for (set_name, pid, lab), r in by.items():
            ref = by.get((set_name, pid, _same_method(reference)))
            if lab != _same_method(label) or ref is None:
                continue
            pair = _speed_pair(r, ref)
            if pair:
                pairs.setdefault(set_name, []).append(pair)
    if len(pairs) > 1:
        pairs[ALL_SETS] = [p for ps in list(pairs.values()) for p in ps]
    out: dict[str, dict[str, Any]] = OrderedDict()
    for set_name, ps in pairs.items():
        out[set_name] = {"pairs": len(ps), "speedup": paired_speedup(ps), "speedup_ci": bootstrap_speedup(ps)}
    return out


# ---- runs put side by side (pooled or compared) ------------------------------------------------------
SIDE_BY_SIDE = "compare or pool only runs of one bench command (its prompts, -n, --chat and model)"


def _measured(payload: Mapping[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    """What a run measured per (set, prompt id): its budget, its prompt's text (--save-text) and its
    token count as our methods counted it (a peer counts its own way)."""
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for r in payload.get("records") or []:
        if not isinstance(r, Mapping):
            continue
        facts = out.setdefault((str(r.get("set")), str(r.get("id"))), {})
        ours_tokens = r.get("prompt_tokens") if r.get("kind") == "ours" else None
        for fact, value in (("prompt", r.get("prompt")), ("prompt tokens", ours_tokens),
                            ("max_tokens", r.get("max_tokens"))):
            if value is not None:
                facts.setdefault(fact, value)
    return out


def _model_difference(first: Mapping[str, Any], other: Mapping[str, Any]) -> tuple[str, str] | None:
    """The two runs' target models where they differ (by sha256 where both have one, else by file name)."""
    a, b = (((run.get("models") or {}).get("target") or {}) for run in (first, other))
    key = "sha256" if a.get("sha256") and b.get("sha256") else "file"
    if not (a.get(key) and b.get(key)) or a[key] == b[key]:
        return None
    if a.get("file") == b.get("file"):
        return f"{a.get('file')} (sha256 {str(a[key])[:12]})", f"{b.get('file')} (sha256 {str(b[key])[:12]})"
    return str(a.get("file")), str(b.get("file"))


def measurement_difference(first: Mapping[str, Any], first_name: str, other: Mapping[str, Any],
                           other_name: str, *, same_model: bool = True) -> str | None:
    """How run ``other`` measured something else than run ``first``: another target model (unless not
    ``same_model``: then only the prompts' text and budgets count), or a (set, prompt id) with another
    prompt or budget; None where they measured the same."""
    models = _model_difference(first, other) if same_model else None
    if models:
        return f"the target model is {models[1]} in {other_name}, {models[0]} in {first_name}"
    mine, theirs = _measured(first), _measured(other)
    facts = ("prompt", "prompt tokens", "max_tokens") if same_model else ("prompt", "max_tokens")
    for set_name, pid in sorted(mine.keys() & theirs.keys()):
        for fact in facts:
            a, b = mine[set_name, pid].get(fact), theirs[set_name, pid].get(fact)
            if a is None or b is None or a == b:
                continue
            if fact == "prompt":
                return f"{set_name}/{pid} has another prompt in {other_name} than in {first_name}"
            return f"{set_name}/{pid} has {fact} {b} in {other_name}, {a} in {first_name}"
    return None


def refuse_different_runs(runs: Sequence[tuple[str, Mapping[str, Any]]], *, same_model: bool = True) -> None:
    """ParameterError naming the first run (path, payload) that measured something else than the first
    one: a chat -n 24 run beside a --no-chat -n 16 one was compared and pooled as runs of one prompt.
    ``same_model=False`` lets the target model differ (two settings of an A/B may be two models)."""
    if not runs:
        return
    first_name, first = runs[0]
    for name, payload in runs[1:]:
        difference = measurement_difference(first, first_name, payload, name, same_model=same_model)
        if difference:
            raise ParameterError(f"the runs measured different things: {difference}; {SIDE_BY_SIDE}")


def refuse_repeated_files(paths: Sequence[str | Path]) -> None:
    """ParameterError when a file is given twice: pooled, each of its prompts would count as two runs'."""
    seen: dict[str, str] = {}
    for path in paths:
        real = os.path.realpath(path)
        if real in seen:
            also = f" (also as {seen[real]})" if seen[real] != str(path) else ""
            raise ParameterError(f"{path} is given twice{also}: each run counts once; give each results file once")
        seen[real] = str(path)


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python3 -m ouroboros_local.bench.report",
                                description="Re-render results.json files (recompute their summary and "
                                            "results.md), or pool several runs with --pool.")
    p.add_argument("files", nargs="+", metavar="RESULTS.json")
    p.add_argument("--pool", metavar="METHOD", default=None,
                   help="print METHOD's speed-up per set over all the files' prompts (paired bootstrap)")
    p.add_argument("--against", metavar="METHOD", default="vanilla", help="reference of --pool")
    args = p.parse_args(argv)
    try:
        if args.pool is None:
            for f in args.files:
                print(f"wrote {rerender(f)}")
            return 0
        refuse_repeated_files(args.files)
        payloads = [read_results(f) for f in args.files]
        refuse_different_runs(list(zip(args.files, payloads)))
    except ParameterError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    pooled = pooled_speedups(payloads, args.pool, args.against)
    if not pooled:
        print(f"no prompt has both {args.pool} and {args.against}")
        return 1
    print(f"| set | runs of a prompt | {args.pool} / {args.against} | {CI_LEVEL:.0%} CI |")
    print("|---|---:|---:|---:|")
    for set_name, row in pooled.items():
        ci = row["speedup_ci"]
        print(f"| {set_name} | {row['pairs']} | {_f(row['speedup'], '{:.3f}x')} | "
              f"{f'{ci[0]:.3f}-{ci[1]:.3f}' if ci else '–'} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
