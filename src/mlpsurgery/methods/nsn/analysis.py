"""NSN analysis: metric per rank, subspace containment (paper A.3), interpolation check (Prop. 1), classifier metrics."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Callable

import torch
from torch import Tensor, nn

from ...errors import MLPSurgeryError
from ...modules.nested import NestedLinear

from .surgery import _require_nested, max_rank
from .ranks import budget_rank, current_ranks, nested_flops, set_rank
from .training import rank_ladder


def sweep_ranks(model: nn.Module, n: int = 8) -> list[int]:
    """Default ranks to evaluate: a geometric ladder from max_rank/32 to max_rank, plus the rank of a 50%
    FLOPs budget when it is reachable."""
    top = max_rank(model)
    ranks = set(rank_ladder(top, n, bottom=max(1, round(top / 32))))
    try:
        ranks.add(budget_rank(model, 0.5))
    except MLPSurgeryError:
        pass
    return sorted(ranks)


def sweep(model: nn.Module, evaluate: Callable[[], dict], ranks: Sequence[int] | None = None,
          progress: bool = True) -> list[dict]:
    """evaluate() at every rank: rows {rank, flops, dense_flops, fraction, **metrics}. The model's ranks are
    restored afterwards."""
    from tqdm.auto import tqdm

    saved = current_ranks(model)
    ranks = list(ranks) if ranks else sweep_ranks(model)
    rows = []
    try:
        for r in tqdm(ranks, desc="ranks", disable=not progress):
            set_rank(model, int(r))
            rows.append({"rank": int(r), **nested_flops(model), **evaluate()})
    finally:
        set_rank(model, saved)
    return rows


def _basis(m: NestedLinear, r: int) -> Tensor:
    """Orthonormal basis (out, r) of Im(W_r): the first r left singular vectors of W_r = B_r A_r, computed
    through the QR of B_r (W_r = Q (R_B A_r)), which is exact and avoids an SVD of the full matrix."""
    Q, RB = torch.linalg.qr(m.B.detach()[:, :r].double())
    U, _, _ = torch.linalg.svd(RB @ m.A.detach()[:r].double(), full_matrices=False)
    return Q @ U


def containment(model: nn.Module, ranks: Sequence[int], paths: Sequence[str] | None = None) -> Tensor:
    """Containment scores (paper A.3): C[i, j] = ||P_{ranks[j]} U_{ranks[i]}||_F^2 / ranks[i], the share of
    the rank-ranks[i] image inside the rank-ranks[j] image (1 = contained), averaged over the nested
    projections (or those in `paths`). Ranks above a projection's max_rank count as its max_rank."""
    layers = _require_nested(model)
    chosen = [layers[p] for p in paths] if paths else list(layers.values())
    k = len(ranks)
    total = torch.zeros(k, k, dtype=torch.float64)
    for m in chosen:
        rs = [min(int(r), m.max_rank) for r in ranks]
        bases = {r: _basis(m, r) for r in set(rs)}
        for i, small in enumerate(rs):
            for j, large in enumerate(rs):
                total[i, j] += (bases[large].T @ bases[small]).pow(2).sum() / small
    return (total / len(chosen)).float()


def energy_between(model: nn.Module, r1: int, r2: int) -> float:
    """sum over nested projections of sum_{i=r1+1}^{r2} ||b_i|| ||a_i|| (the Prop. 1 bound without C)."""
    total = 0.0
    for m in _require_nested(model).values():
        e = m.component_energy()
        total += float(e[min(r1, m.max_rank):min(r2, m.max_rank)].sum())
    return total


def energy_decay(model: nn.Module) -> dict:
    """How well Assumption 1 holds: the share of adjacent components whose energy ||b_i|| ||a_i|| rises."""
    rises, pairs = 0, 0
    for m in _require_nested(model).values():
        e = m.component_energy()
        rises += int((e[1:] > e[:-1]).sum())
        pairs += len(e) - 1
    return {"adjacent_pairs": pairs, "rising": rises, "rising_share": rises / max(pairs, 1)}


def interpolation_check(model: nn.Module, loss_by_rank: Mapping[int, float], trained: Sequence[int]) -> dict:
    """Prop. 1 against measurement. |E(r_int) - E(r_1)| <= C * sum_{i=r_1+1}^{r_int} ||b_i|| ||a_i||.

    C (= Lipschitz constant x E||x|| in the paper, unknown for a deep network) is fitted as the smallest
    constant for which the bound holds between consecutive *trained* ranks; the bound is then checked at
    every evaluated untrained rank r_int against the nearest trained rank r_1 below it.
    """
    E = {int(k): float(v) for k, v in loss_by_rank.items()}
    tr = sorted(int(r) for r in trained if int(r) in E)
    if len(tr) < 2:
        raise MLPSurgeryError("the interpolation check needs the loss at two or more trained ranks")
    calib = [{"r1": a, "r2": b, "measured": abs(E[b] - E[a]), "energy": energy_between(model, a, b)}
             for a, b in zip(tr, tr[1:])]
    C = max(c["measured"] / c["energy"] for c in calib if c["energy"] > 0)
    rows = []
    for r in sorted(set(E) - set(tr)):
        below = [t for t in tr if t < r]
        if not below:
            continue
        r1 = below[-1]
        measured, energy = abs(E[r] - E[r1]), energy_between(model, r1, r)
        rows.append({"r1": r1, "r_int": r, "measured": measured, "energy": energy, "bound": C * energy,
                     "holds": measured <= C * energy + 1e-12})
    return {"C": C, "calibration": calib, "interpolated": rows,
            "holds_share": sum(r["holds"] for r in rows) / len(rows) if rows else None}


def classifier_metrics(model: nn.Module, tokenizer, data, max_len: int = 128, batch_size: int = 32,
                       progress: bool = True) -> dict:
    """Accuracy and mean cross-entropy of a sequence classifier on a labelled set, in one pass."""
    from tqdm.auto import tqdm

    from ...measure.accuracy import batches

    device = next(model.parameters()).device
    labels = torch.tensor(data.labels)
    correct, loss = 0, 0.0
    was = model.training
    model.eval()
    with torch.no_grad():
        for k, enc in enumerate(tqdm(batches(tokenizer, data.texts, max_len, batch_size), desc="accuracy",
                                     total=-(-len(data) // batch_size), unit="batch", disable=not progress)):
            y = labels[k * batch_size: k * batch_size + len(enc["input_ids"])]
            logits = model(**{n: v.to(device) for n, v in enc.items()}).logits.float().cpu()
            correct += int((logits.argmax(-1) == y).sum())
            loss += float(nn.functional.cross_entropy(logits, y, reduction="sum"))
    model.train(was)
    return {"accuracy": correct / len(data), "loss": loss / len(data)}
