"""What a locked model is still good for: utilities (accuracy, perplexity), the ratio -> utility curve,
the bisection to a target utility, and the curve plot."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from torch import Tensor, nn

from ...errors import MLPSurgeryError
from ...report import ends_stages, pyplot, save_figure, stage, wrap
from .config import CoreLockerConfig
from .ranking import Ranking, apply_extraction, restore_values
from .units import unit_groups


@dataclass
class Utility:
    """A calibration measurement of a model: accuracy of a classifier, perplexity of a causal LM, or
    anything a caller supplies. `higher_is_better` tells the bisection which way the curve runs."""

    fn: Callable[..., float]
    name: str
    higher_is_better: bool
    data: str = ""
    chance: float | None = None
    # fn takes a `progress` keyword (the built-in utilities do): a measurement on a real model takes tens of
    # seconds, and the caller may show it as a progress bar
    takes_progress: bool = False

    def __call__(self, model: nn.Module, progress: bool = False) -> float:
        if progress and self.takes_progress:
            return float(self.fn(model, progress=True))
        return float(self.fn(model))

    def default_tolerance(self, target: float) -> float:
        return 0.025 if self.name.endswith("accuracy") else 0.05 * abs(target)


def balanced_accuracy(model: nn.Module, tokenizer, data, max_len: int = 128, batch_size: int = 32,
                      progress: bool = False) -> float:
    """Mean per-class recall: 1/C for any constant or random predictor, whatever the class balance
    (plain accuracy of a constant predictor is its class's frequency: 49% for 'earn' in R8 test)."""
    from ...measure.accuracy import predict

    pred = predict(model, tokenizer, data.texts, max_len=max_len, batch_size=batch_size, progress=progress)
    labels = torch.tensor(data.labels)
    recalls = [float((pred[labels == c] == c).float().mean()) for c in labels.unique().tolist()]
    return sum(recalls) / len(recalls)


def classifier_utility(tokenizer, data, max_len: int = 128, batch_size: int = 32, balanced: bool = False) -> Utility:
    from ...measure.accuracy import accuracy

    what = f"{data.name or 'labelled set'} ({len(data)} examples)"
    if balanced:
        return Utility(lambda m, progress=False: balanced_accuracy(m, tokenizer, data, max_len, batch_size, progress),
                       "balanced_accuracy", True, what, 1 / data.num_classes, takes_progress=True)
    return Utility(lambda m, progress=False: accuracy(m, tokenizer, data, max_len=max_len, batch_size=batch_size,
                                                      progress=progress),
                   "accuracy", True, what, 1 / data.num_classes, takes_progress=True)


def lm_utility(sequences: list[Tensor], block_len: int | None = None, max_tokens: int | None = 4096,
               bos_id: int | None = None) -> Utility:
    """Perplexity on `sequences` in windows of `block_len` (default 256, or the model's context if shorter);
    bos_id: the tokenizer's BOS when it adds one by default (`corpus.bos`)."""
    from ...measure.perplexity import default_block_len, perplexity

    def ppl(m: nn.Module, progress: bool = False) -> float:
        return perplexity(m, sequences, block_len=block_len or default_block_len(m, 256), max_tokens=max_tokens,
                          progress=progress, bos_id=bos_id).ppl

    return Utility(ppl, "perplexity", False,
                   f"{max_tokens or 'all'} held-out tokens, windows of {block_len or 'up to 256'}", takes_progress=True)


def default_utility(model: nn.Module, tokenizer, data: str | None = None, size: int | None = None) -> Utility:
    """Accuracy on a labelled calibration set (default: 256 examples of Reuters R8 train) for a model
    with a classification head; perplexity on held-out text (default: the first 4096 tokens of
    Persuasion) for a causal LM."""
    from ...data import load_corpus, read_labelled
    from ...measure.perplexity import is_causal_lm

    if type(model).__name__.endswith("ForSequenceClassification"):
        labelled = read_labelled(data or "r8-train")
        if labelled.num_classes != model.num_labels:
            raise MLPSurgeryError(f"the calibration set has {labelled.num_classes} classes, the model's head "
                                  f"{model.num_labels}; give the labelled set it was trained for with --data")
        n = size or 256
        return classifier_utility(tokenizer, labelled.sample(n, seed=0) if len(labelled) > n else labelled)
    if is_causal_lm(model):
        corpus = load_corpus(data, tokenizer)
        return lm_utility(corpus.heldout, max_tokens=size or 4096, bos_id=corpus.bos)
    raise MLPSurgeryError(f"{type(model).__name__} has neither a classification head nor a language-model head, so "
                          "there is no utility to calibrate; fine-tune a head first or use --ratio")


# --------------------------------------------------------------------------------------------------
# Granular utility control: the ratio -> utility curve and bisection to a target


@contextlib.contextmanager
def extracted(model: nn.Module, ranking: Ranking, ratio: float):
    """Within the block the model has the units of `ratio` extracted; afterwards it is restored exactly.
    Yields the number of units extracted."""
    extraction, n = ranking.take(ratio)
    originals = apply_extraction(model, extraction)
    try:
        yield n
    finally:
        restore_values(model, {k: p for k, (p, _) in extraction.items()}, originals)


def evaluate_at(model: nn.Module, ranking: Ranking, ratio: float, utility: Utility,
                progress: bool = False) -> tuple[float, int]:
    """Utility of the model with the units of `ratio` extracted; the model is restored afterwards."""
    with extracted(model, ranking, ratio) as n:
        return utility(model, progress=progress), n


def utility_curve(model: nn.Module, cfg: CoreLockerConfig, ratios, utility: Utility, progress: bool = True,
                  ranking: Ranking | None = None) -> list[dict]:
    """Utility at each extraction ratio (the paper's Tables 5-6 / Fig. 6); the model is left unchanged."""
    from tqdm.auto import tqdm

    ratios = sorted(float(r) for r in ratios)
    ranking = ranking or Ranking(unit_groups(model, cfg), cfg.scope, max(ratios))
    rows = []
    for r in tqdm(ratios, desc="utility curve", disable=not progress):
        u, n = evaluate_at(model, ranking, r, utility)
        rows.append({"ratio": r, "units": n, utility.name: u})
    return rows


class TargetNotReached(MLPSurgeryError):
    """The target utility lies outside what the extraction can reach (beyond the original model, or short of
    it at the largest ratio allowed). `curve` holds the points evaluated before giving up, so that they can
    still be shown (`lock key --plot` draws them)."""

    def __init__(self, message: str, curve: list[dict], metric: str, target: float, original: float):
        super().__init__(message)
        self.curve, self.metric, self.target, self.original = curve, metric, target, original


@dataclass
class RatioSearch:
    ratio: float
    utility: float
    within_tolerance: bool
    target: float
    tolerance: float
    curve: list[dict]  # every evaluated point, by ratio
    ranking: Ranking = field(repr=False)

    def as_dict(self) -> dict:
        return {"ratio": self.ratio, "utility": self.utility, "within_tolerance": self.within_tolerance,
                "target": self.target, "tolerance": self.tolerance, "curve": self.curve}


@ends_stages
def find_ratio(model: nn.Module, cfg: CoreLockerConfig, utility: Utility, target: float,
               tolerance: float | None = None, max_ratio: float = 0.5, iterations: int = 14,
               progress: bool = True) -> RatioSearch:
    """The extraction ratio whose utility lands within `tolerance` of `target`, by bisection over
    log(ratio) on the monotone ratio -> utility curve (falling accuracy, rising perplexity). The model
    is left unchanged. Returns the closest point found when no ratio lands within the tolerance."""
    stage(f"ranking the {cfg.unit} units by {cfg.indicator} ({cfg.scope})", progress)
    ranking = Ranking(unit_groups(model, cfg), cfg.scope, max_ratio)
    stage(f"searching the ratio that brings {utility.name} to {target:g} on {utility.data}", progress)
    best, u_best, tol, curve = search_ratio(lambda r: evaluate_at(model, ranking, r, utility, progress=progress),
                                            ranking.count, ranking.n_units, utility, target, tolerance, max_ratio,
                                            iterations, progress)
    return RatioSearch(best, u_best, abs(u_best - target) <= tol, target, tol, curve, ranking)


def search_ratio(measure: Callable[[float], tuple[float, int]], count: Callable[[float], int], n_units: int,
                 utility: Utility, target: float, tolerance: float | None = None, max_ratio: float = 0.5,
                 iterations: int = 14, progress: bool = True) -> tuple[float, float, float, list[dict]]:
    """The bisection of `find_ratio` over any measurement: measure(r) -> (utility with the units of ratio r
    extracted, units extracted); count(r): the units ratio r extracts (of n_units). Returns (best ratio, its utility,
    the tolerance, every evaluated point by ratio); TargetNotReached when the target is out of reach."""
    from tqdm.auto import tqdm

    tol = utility.default_tolerance(target) if tolerance is None else tolerance
    sign = 1.0 if utility.higher_is_better else -1.0

    def side(u: float) -> int:
        """+1: still too useful (extract more), -1: too degraded, 0: on target."""
        return 0 if abs(u - target) <= tol else (1 if sign * (u - target) > 0 else -1)

    curve: list[dict] = []

    def point(r: float) -> float:
        # each measurement shows its own bar (tens of seconds on a real model); the finished ones stay above the
        # search's bar as a log of the points tried
        u, n = measure(r)
        curve.append({"ratio": r, "units": n, utility.name: u})
        bar.update(1)
        bar.set_postfix({"ratio": f"{r:.3g}", utility.name: f"{u:.4g}"})
        return u

    def unreachable(message: str) -> TargetNotReached:
        return TargetNotReached(message, sorted(curve, key=lambda c: c["ratio"]), utility.name, target,
                                curve[0][utility.name])

    bar = tqdm(total=iterations + 2, desc="target utility", disable=not progress)
    try:
        u0 = point(0.0)
        if side(u0) < 0:
            raise unreachable(f"the target {utility.name} {target:g} is beyond the original model's {u0:.4g}; "
                              "no extraction can reach it")
        best = 0.0
        if side(u0) != 0:
            u_hi = point(max_ratio)
            if side(u_hi) > 0:
                raise unreachable(f"extracting {max_ratio:g} of the units still leaves {utility.name} {u_hi:.4g}, "
                                  f"short of the target {target:g}; raise --max-ratio or choose another unit")
            lo, hi = 0.5 / n_units, max_ratio
            best = max_ratio
            for _ in range(iterations):
                mid = math.sqrt(lo * hi)
                if count(mid) in (count(lo), count(hi)):
                    mid = (lo + hi) / 2
                    if count(mid) in (count(lo), count(hi)):
                        break
                s = side(point(mid))
                if s == 0:
                    break
                lo, hi = (mid, hi) if s > 0 else (lo, mid)
            best = min(curve, key=lambda c: abs(c[utility.name] - target))["ratio"]
    finally:
        bar.close()
    curve.sort(key=lambda c: c["ratio"])
    u_best = next(c[utility.name] for c in curve if c["ratio"] == best)
    return best, u_best, tol, curve


def plot_curves(curves: dict[str, list[dict]], metric: str, path: str | Path, title: str = "",
                chance: float | None = None, logy: bool = False, original: float | None = None,
                target: float | None = None) -> Path:
    """Utility against extraction ratio (log x), one line per label, as a PNG. Ratio 0 (the original model)
    has no place on a log axis: pass its utility as `original` to draw it as a horizontal line, and `target`
    for the utility a search aimed at."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    positive = False
    for label, rows in curves.items():
        pts = sorted((r["ratio"], r[metric]) for r in rows if r["ratio"] > 0)
        positive = positive or bool(pts)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    if original is not None:
        ax.axhline(original, color="tab:green", linestyle=":", label=f"original, ratio 0 ({original:.4g})")
    if target is not None:
        ax.axhline(target, color="tab:red", linestyle="-.", label=f"target ({target:.4g})")
    if chance is not None:
        ax.axhline(chance, color="grey", linestyle="--", label=f"chance ({chance:.3g})")
    if positive:  # a search refused at the original model has no point on a log axis
        ax.set_xscale("log")
    if logy:
        ax.set_yscale("log")
    ax.set_xlabel("extraction ratio (fraction of eligible units)")
    ax.set_ylabel(metric)
    ax.set_title(wrap(title, 70))
    ax.grid(alpha=0.3)
    ax.legend()
    return save_figure(fig, path)
