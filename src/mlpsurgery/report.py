"""Formatting shared by the CLI, benchmarks and docs: text tables, byte and count units, figures."""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import time
from pathlib import Path


def human_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def human_count(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n:.0f}"


def fmt(v, digits: int = 4) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}g}"
    return str(v)


def table(rows: list[dict], columns: list[str] | None = None, headers: dict | None = None, markdown: bool = False) -> str:
    """A plain-text (or Markdown) table of dict rows."""
    if not rows:
        return "(no rows)"
    columns = columns or list(rows[0])
    headers = headers or {}
    cells = [[headers.get(c, c) for c in columns]] + [[fmt(r.get(c)) for c in columns] for r in rows]
    if markdown:
        lines = ["| " + " | ".join(cells[0]) + " |", "|" + "|".join("---" for _ in columns) + "|"]
        lines += ["| " + " | ".join(r) + " |" for r in cells[1:]]
        return "\n".join(lines)
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def pyplot():
    """matplotlib.pyplot on the Agg backend: figures are files, never windows (no display is needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: str | Path) -> Path:
    """Lay out, write (PNG at 120 dpi unless the suffix names another format; parent folders created) and
    close a matplotlib figure. The file is replaced atomically: a crash leaves the old plot or the new one,
    never a truncated PNG."""
    import io

    import matplotlib.pyplot as plt

    from .files import SIGNATURE, _atomic_bytes

    path = Path(path)
    try:
        fig.tight_layout()
        buf = io.BytesIO()
        fmt = path.suffix[1:].lower() or "png"  # as before: the suffix says the format
        # signed, so that a later run may replace this plot and no other file (files.file_is_ours)
        meta = {"png": {"Software": f"mlpsurgery {SIGNATURE}"}, "pdf": {"Creator": f"mlpsurgery {SIGNATURE}"},
                "svg": {"Creator": f"mlpsurgery {SIGNATURE}"}, "ps": {"Creator": f"mlpsurgery {SIGNATURE}"},
                "eps": {"Creator": f"mlpsurgery {SIGNATURE}"}}.get(fmt)
        fig.savefig(buf, format=fmt, dpi=120, **({"metadata": meta} if meta else {}))
    finally:
        plt.close(fig)
    path.parent.mkdir(parents=True, exist_ok=True)
    _atomic_bytes(path, buf.getvalue(), None)
    return path


# --------------------------------------------------------------------------------------------------
# What a person waiting at the terminal sees: stage lines and warnings on stderr (stdout holds only the
# result, so that --json output stays parseable)

_started = [time.monotonic()]
# A stage line is printed only once its step has run this many seconds: quick steps (and refusals, which come
# in milliseconds) stay silent, so a refused command still prints its one-line error alone; a long step shows
# itself with the time it started. MLPSURGERY_STAGE_DELAY overrides it (0: every stage line at once).
STAGE_DELAY = float(os.environ.get("MLPSURGERY_STAGE_DELAY", "2"))
_pending: list = []  # the timer of the stage now running, if its line is not printed yet


def restart_clock() -> None:
    """Count stage times from now (the CLI calls it when a command starts)."""
    _started[0] = time.monotonic()


def _print_stage(at: float, message: str) -> None:
    import sys

    from tqdm.auto import tqdm

    tqdm.write(f"[{at:7.1f} s] {message}", file=sys.stderr)


def stage(message: str, enabled: bool = True) -> None:
    """Say on stderr, in one line, which step starts now, with the seconds since the command started, if the
    step lasts longer than STAGE_DELAY (the next stage() or end_stage() ends it). So no long step runs in
    silence, and a slow one shows itself by the gap to the next line. Written through tqdm, so that an open
    progress bar is redrawn below the line, not torn."""
    end_stage()
    if not enabled:
        return
    at = time.monotonic() - _started[0]
    if STAGE_DELAY <= 0:
        _print_stage(at, message)
        return
    timer = threading.Timer(STAGE_DELAY, _print_stage, (at, message))
    timer.daemon = True
    _pending.append(timer)
    timer.start()


def end_stage() -> None:
    """The step of the last stage() is over: its line, not printed yet, never will be."""
    while _pending:
        _pending.pop().cancel()


def ends_stages(fn):
    """Decorator of a function that calls stage(): its last stage ends when it returns or raises (a step that is
    over is never announced later)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        finally:
            end_stage()
    return wrapper


@contextlib.contextmanager
def stages(enabled: bool = True):
    """`with stages(progress) as stage: stage("..."); ...`: stage lines of a function's steps, the last one ended
    when the block is left (so that a step already over is never announced)."""
    try:
        yield lambda message: stage(message, enabled)
    finally:
        end_stage()


def warn(message: str) -> None:
    """A warning on stderr, shown even with --quiet: something the user should know although the command
    succeeded (a plot that could not be drawn)."""
    import sys

    from tqdm.auto import tqdm

    tqdm.write(f"mlpsurgery: warning: {message}", file=sys.stderr)


# --------------------------------------------------------------------------------------------------
# The plots the commands write next to their results


def wrap(text: str, width: int) -> str:
    """A title on as many lines as it needs (model names can be long) instead of cut off at the figure's edge."""
    import textwrap

    return "\n".join(textwrap.wrap(text, width)) or text


def plot_cost(result: dict, path: str | Path, title: str = "") -> Path:
    """Bars of `eval cost`: wall time (inference forward, training step) and peak memory (inference, training
    step), reference beside candidate, the ratio over each candidate bar. `result`: what compare_cost gives
    (reference may be None: the candidate alone)."""
    plt = pyplot()
    sides = [s for s in ("reference", "candidate") if result.get(s)]
    panels = [("time (s)", [("forward_s", "inference\nforward"), ("step_s", "training\nstep")], 1.0),
              ("peak memory (MiB)", [("forward_peak_bytes", "inference"), ("step_peak_bytes", "training\nstep")],
               1 / 2**20)]
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.6))
    width = 0.8 / len(sides)
    for ax, (label, keys, scale) in zip(axes, panels):
        for j, side in enumerate(sides):
            vals = [(result[side].get(k) or 0) * scale for k, _ in keys]
            xs = [i + (j - (len(sides) - 1) / 2) * width for i in range(len(keys))]
            bars = ax.bar(xs, vals, width, label=side)
            if side == "candidate" and result.get("ratio"):
                for b, (k, _) in zip(bars, keys):
                    r = result["ratio"].get(k)
                    if r is not None:
                        ax.annotate(f"{r:.2f}x", (b.get_x() + b.get_width() / 2, b.get_height()), ha="center",
                                    va="bottom", fontsize=8)
        ax.set_xticks(range(len(keys)), [n for _, n in keys])
        ax.set_ylabel(label)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend()
    if title:
        fig.suptitle(wrap(title, 90), fontsize=10)
    return save_figure(fig, path)


def plot_layers(rows: list[dict], panels: list[tuple[str, str, dict]], path: str | Path, title: str = "") -> Path:
    """Per-layer bars, one panel per measure: panels = [(ylabel, note, {series label: key in rows})]. A row
    without a value for a key (None) leaves a gap; a panel with no value at all is left out."""
    plt = pyplot()
    layers = [r["layer"] for r in rows]
    kept = [(lab, note, series) for lab, note, series in panels
            if any(r.get(k) is not None for r in rows for k in series.values())]
    fig, axes = plt.subplots(len(kept), 1, figsize=(max(6.0, 0.25 * len(layers) + 2), 2.8 * len(kept)),
                             squeeze=False)
    for ax, (label, note, series) in zip(axes[:, 0], kept):
        width = 0.8 / len(series)
        for j, (name, key) in enumerate(series.items()):
            xs = [i + (j - (len(series) - 1) / 2) * width for i in range(len(layers))]
            vals = [float("nan") if r.get(key) is None else r[key] for r in rows]
            ax.bar(xs, vals, width, label=name)
        ax.set_xticks(range(len(layers)), [str(x) for x in layers], fontsize=8 if len(layers) > 16 else None)
        ax.set_ylabel(label)
        ax.grid(axis="y", alpha=0.3)
        if note:
            ax.set_title(wrap(note, 100), fontsize=9)
        if len(series) > 1:
            ax.legend(fontsize=8)
    axes[-1, 0].set_xlabel("layer")
    if title:
        fig.suptitle(wrap(title, 90), fontsize=10)
    return save_figure(fig, path)


def plot_rounds(history: list[dict], path: str | Path, title: str = "") -> Path:
    """Training loss per round: one line per worker (subnet) where the history has `worker_loss`, and their
    mean (or the single loss of a data-parallel run) in black."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    rounds = [h["round"] for h in history]
    workers = max((len(h.get("worker_loss") or []) for h in history), default=0)
    for s in range(workers):
        pts = [(h["round"], h["worker_loss"][s]) for h in history if len(h.get("worker_loss") or []) > s]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", alpha=0.7, label=f"worker {s}'s subnet")
    ax.plot(rounds, [h["loss"] for h in history], color="black", linewidth=2, marker="o",
            label="mean of the subnets" if workers else "loss")
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("round (a new random subnet per worker each round)" if workers else "round")
    ax.set_ylabel("training loss (nats / token)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2 if workers > 4 else 1)
    if title:
        ax.set_title(wrap(title, 80), fontsize=10)
    return save_figure(fig, path)
