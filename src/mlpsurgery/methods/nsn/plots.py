"""NSN plots: metric against FLOPs, containment, learned log-variances."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from torch import Tensor

from ...report import save_figure


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_frontier(curves: Mapping[str, list[dict]], metric: str, path: str | Path, x: str = "fraction",
                  title: str = "", points: Mapping[str, list[dict]] | None = None, xlabel: str | None = None) -> Path:
    """Metric against FLOPs fraction (or rank): one line per curve, optional scattered reference points."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, rows in curves.items():
        ax.plot([r[x] for r in rows], [r[metric] for r in rows], marker="o", ms=3, label=label)
    for label, rows in (points or {}).items():
        ax.scatter([r[x] for r in rows], [r[metric] for r in rows], marker="s", s=30, zorder=3, label=label)
    ax.set_xlabel(xlabel or {"fraction": "FLOPs of the nested projections / dense", "rank": "rank"}.get(x, x))
    ax.set_ylabel(metric)
    if metric in ("ppl", "perplexity"):
        ax.set_yscale("log")  # truncation without training spans orders of magnitude
    if x in ("rank", "flops"):
        ax.set_xscale("log", base=2)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=9)
    return save_figure(fig, path)


def plot_containment(scores: Tensor, ranks: Sequence[int], path: str | Path, title: str = "") -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5, 4.2))
    im = ax.imshow(scores.numpy(), cmap="Blues", vmin=0, vmax=1)
    ax.set_xticks(range(len(ranks)), [str(r) for r in ranks], rotation=45)
    ax.set_yticks(range(len(ranks)), [str(r) for r in ranks])
    ax.set_xlabel("r': projected onto the image of W_r'")
    ax.set_ylabel("r: orthonormal basis of the image of W_r")
    for i in range(len(ranks)):
        for j in range(len(ranks)):
            ax.text(j, i, f"{float(scores[i, j]):.2f}", ha="center", va="center", fontsize=6,
                    color="white" if scores[i, j] > 0.6 else "black")
    fig.colorbar(im, ax=ax)
    ax.set_title(title, fontsize=9)
    return save_figure(fig, path)


def plot_log_variance(curves: Mapping[str, Mapping[int, float]], path: str | Path, title: str = "") -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for label, lv in curves.items():
        ks = sorted(lv)
        ax.plot(ks, [lv[k] for k in ks], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("training rank")
    ax.set_ylabel("learned log-variance s_k")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=9)
    return save_figure(fig, path)
