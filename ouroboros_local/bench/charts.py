"""The speed-up chart (speedup.png) and the sweep chart (sweep.png); matplotlib is optional."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def plot_speedup(summary: Mapping[str, Mapping[str, Mapping[str, Any]]], path: str | Path,
                 title: str = "") -> bool:
    """Grouped bars: one group per prompt set, one bar per method; vanilla = 1.0. False without matplotlib."""
    plt = _pyplot()
    if plt is None:
        return False
    sets = list(summary)
    labels: list[str] = []
    for by_label in summary.values():
        for lab in by_label:
            if lab not in labels:
                labels.append(lab)
    n = max(len(labels), 1)
    width = 0.8 / n
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 + len(sets) * (0.35 * n + 0.6)), 4.5))
    cmap = plt.get_cmap("tab20" if n > 10 else "tab10")
    for j, lab in enumerate(labels):
        xs, ys = [], []
        for i, s in enumerate(sets):
            v = summary[s].get(lab, {}).get("speedup")
            if v is not None:
                xs.append(i - 0.4 + width * (j + 0.5))
                ys.append(v)
        bars = ax.bar(xs, ys, width * 0.95, label=lab, color=cmap(j % cmap.N))
        for b, y in zip(bars, ys):
            ax.annotate(f"{y:.2f}", (b.get_x() + b.get_width() / 2, y), ha="center", va="bottom",
                        fontsize=7, xytext=(0, 1), textcoords="offset points")
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(sets)))
    ax.set_xticklabels(sets)
    ax.set_ylabel("speed-up over vanilla (decode tok/s)")
    if title:
        ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, ncol=min(4, n), loc="upper left", bbox_to_anchor=(0, -0.08), frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return True


def plot_sweep(summary: Mapping[str, Mapping[str, Mapping[str, Any]]], sweep: Mapping[str, Any],
               path: str | Path) -> bool:
    """Speed-up against the swept setting, one line per (set, method)."""
    plt = _pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    points = sweep.get("labels", {})
    methods = sorted({p["method"] for p in points.values()})
    numeric = all(isinstance(p["value"], (int, float)) and not isinstance(p["value"], bool)
                  for p in points.values())
    values = list(dict.fromkeys(p["value"] for p in points.values()))
    for set_name, by_label in summary.items():
        for m in methods:
            pts = [(p["value"], by_label.get(lab, {}).get("speedup")) for lab, p in points.items()
                   if p["method"] == m]
            pts = [(v, y) for v, y in pts if y is not None]
            if numeric:   # a line in the order given (--sweep gamma=4,1,2) would zig-zag
                pts.sort(key=lambda point: point[0])
            if not pts:
                continue
            xs = [v if numeric else values.index(v) for v, _ in pts]
            ax.plot(xs, [y for _, y in pts], marker="o", label=f"{set_name}: {m}")
    if numeric:
        ax.set_xticks(sorted(values))
    else:
        ax.set_xticks(range(len(values)))
        ax.set_xticklabels([str(v) for v in values])
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xlabel(sweep.get("param", "setting"))
    ax.set_ylabel("speed-up over vanilla")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
