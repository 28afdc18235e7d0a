"""PNG plots of a run (matplotlib, Agg backend: no display needed).

- ``speedup_by_category.png``: paired geo-mean speedup over ``none`` per category, per method.
- ``throughput_vs_concurrency.png``: output tokens/s against requests in flight, per method.
- ``acceptance_histogram.png``: share of drafted steps by acceptance length, per method.
"""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HIST_CAP = 10  # acceptance lengths >= this share the last bar


def _colors(summary: dict) -> dict[str, tuple]:
    """One colour per method, the same in every plot of a run."""
    names = list(dict.fromkeys([r["method"] for r in summary["overall"]] +
                               [r["method"] for r in summary["load"]]))
    cmap = plt.get_cmap("tab10" if len(names) <= 10 else "tab20")
    return {name: cmap(i % cmap.N) for i, name in enumerate(names)}


def _legend(ax) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))


def _finish(fig, ax, path: Path, title: str) -> Path:
    """Title, legend outside the axes, save as PNG, free the figure."""
    ax.set_title(title)
    _legend(ax)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _grouped_bars(ax, groups: list[str], series: dict[str, list[float | None]],
                  colors: dict[str, tuple]) -> None:
    n = max(1, len(series))
    width = 0.8 / n
    for i, (name, values) in enumerate(series.items()):
        xs = [g + (i - (n - 1) / 2) * width for g in range(len(groups))]
        ax.bar(xs, [v if v is not None else 0.0 for v in values], width, label=name,
               color=colors.get(name))
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups, rotation=30, ha="right")


def speedup_by_category(summary: dict, path: Path, title: str) -> Path:
    methods = [r["method"] for r in summary["overall"] if r["method"] != "none"]
    cats = list(dict.fromkeys(r["category"] for r in summary["per_category"]))
    cell = {(r["category"], r["method"]): r.get("speedup_geomean") for r in summary["per_category"]}
    overall = {r["method"]: r.get("speedup_geomean") for r in summary["overall"]}
    series = {m: [cell.get((c, m)) for c in cats] + [overall.get(m)] for m in methods}
    fig, ax = plt.subplots(figsize=(max(7, 1.1 * (len(cats) + 1) + 3), 4.5))
    _grouped_bars(ax, cats + ["all"], series, _colors(summary))
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_ylabel("speedup vs no speculation (paired geo-mean)")
    return _finish(fig, ax, path, title)


def throughput_vs_concurrency(summary: dict, path: Path, title: str) -> Path:
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    colors = _colors(summary)
    for m in dict.fromkeys(r["method"] for r in summary["load"]):
        pts = sorted((r["concurrency"], r["tokens_per_s"]) for r in summary["load"]
                     if r["method"] == m and r.get("tokens_per_s"))
        if pts:
            ax.plot([c for c, _ in pts], [t for _, t in pts], marker="o", label=m, color=colors.get(m))
    concurrencies = sorted({r["concurrency"] for r in summary["load"]})
    if concurrencies:
        ax.set_xscale("log", base=2)
        ax.set_xticks(concurrencies)
        ax.set_xticklabels([str(c) for c in concurrencies])
    ax.set_ylim(bottom=0)
    ax.set_xlabel("requests in flight (closed loop)")
    ax.set_ylabel("output tokens/s (all requests)")
    return _finish(fig, ax, path, title)


def acceptance_histogram(summary: dict, path: Path, title: str) -> Path:
    rows = [r for r in summary["overall"] if r.get("accepted_histogram")]
    # index k of a histogram: steps accepting k drafts, i.e. acceptance length k + 1
    longest = max([max((k for k, h in enumerate(r["accepted_histogram"]) if h), default=0) + 1
                   for r in rows] + [2])
    cap = min(HIST_CAP, longest)
    labels = [str(k) for k in range(1, cap)] + [f"{cap}+" if longest > cap else str(cap)]
    series = {}
    for r in rows:
        hist = r["accepted_histogram"]
        capped = hist[:cap - 1] + [sum(hist[cap - 1:])]
        capped += [0] * (cap - len(capped))
        total = sum(capped) or 1
        series[r["method"]] = [h / total for h in capped]
    fig, ax = plt.subplots(figsize=(8.5, 4.5))
    _grouped_bars(ax, labels, series, _colors(summary))
    ax.set_xticklabels(labels, rotation=0)
    ax.set_xlabel("acceptance length of a drafted step (accepted + 1)")
    ax.set_ylabel("share of drafted steps")
    return _finish(fig, ax, path, title)


def draw_all(summary: dict, out: Path, model_name: str) -> list[Path]:
    """All three plots into ``out``; returns their paths."""
    return [
        speedup_by_category(summary, out / "speedup_by_category.png",
                            f"{model_name}: speedup per Spec-Bench category (batch 1)"),
        throughput_vs_concurrency(summary, out / "throughput_vs_concurrency.png",
                                  f"{model_name}: throughput vs concurrency"),
        acceptance_histogram(summary, out / "acceptance_histogram.png",
                             f"{model_name}: acceptance length per drafted step (batch 1)"),
    ]
