"""k-means (Lloyd with greedy k-means++ seeding, as scikit-learn's KMeans), in torch on any device."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor
from tqdm.auto import tqdm

from ...errors import MLPSurgeryError


@dataclass
class KMeansResult:
    labels: Tensor  # (n,) cluster of each point
    centers: Tensor  # (k, dim)
    inertia: float  # sum of squared distances to the assigned centre
    n_iter: int


def _sq_dist(x: Tensor, x_sq: Tensor, c: Tensor) -> Tensor:
    """(n, m) squared distances between rows of x (n, dim) and c (m, dim); x_sq = |x|² (n,)."""
    return (x_sq[:, None] - 2 * x @ c.T + c.pow(2).sum(1)[None, :]).clamp_min_(0)


def _kmeans_pp(x: Tensor, x_sq: Tensor, k: int, gen: torch.Generator) -> Tensor:
    """Greedy k-means++: each new centre is the best (lowest potential) of 2 + ln k candidates drawn
    with probability proportional to the squared distance to the closest centre so far. Returns indices."""
    n = len(x)
    trials = 2 + int(math.log(k))
    # k sequential rounds of distances to a few candidates: one Gram matrix turns each into a gather
    gram = x @ x.T if n <= 16384 else None

    def dist_to(idx: Tensor) -> Tensor:  # (len(idx), n)
        idx = idx.to(x.device)
        if gram is None:
            return _sq_dist(x, x_sq, x[idx]).T
        return (x_sq[idx, None] + x_sq[None, :] - 2 * gram[idx]).clamp_min_(0)

    idx = torch.empty(k, dtype=torch.long)
    idx[0] = torch.randint(n, (1,), generator=gen)
    closest = dist_to(idx[:1])[0]
    closest[idx[0]] = 0  # a chosen point is at distance 0 exactly, so it is never drawn again
    for c in range(1, k):
        weights = closest.double().cpu()
        if weights.sum() <= 0:  # fewer distinct points than k: any unused point will do
            weights = torch.ones(n, dtype=torch.double)
            weights[idx[:c]] = 0
        cand = torch.multinomial(weights, trials, replacement=True, generator=gen)
        d = torch.minimum(closest[None, :], dist_to(cand))  # (trials, n)
        best = int(d.sum(1).argmin())
        idx[c] = cand[best]
        closest = d[best]
        closest[idx[c]] = 0
    return idx


def kmeans(x: Tensor, k: int, n_init: int = 3, max_iter: int = 300, tol: float = 1e-4, seed: int = 0,
           device: str | torch.device | None = None, progress: bool = False) -> KMeansResult:
    """k-means of the rows of x (n, dim): k-means++ seeding, Lloyd iterations, `n_init` restarts
    (the lowest inertia wins), seeded; runs on `device` (default x's). Empty clusters are refilled with
    the points farthest from their centres. Agrees with sklearn.cluster.KMeans (tests/test_fusion.py)."""
    n = len(x)
    if not 1 <= k <= n:
        raise MLPSurgeryError(f"k-means needs 1 <= k <= {n} (the number of points), got k={k}")
    device = torch.device(device) if device is not None else x.device
    x = x.to(device)
    x_sq = x.pow(2).sum(1)
    tol_abs = tol * float(x.var(0, unbiased=False).mean())
    gen = torch.Generator().manual_seed(seed)
    best: KMeansResult | None = None
    for _ in tqdm(range(n_init), desc="k-means", unit="restart", disable=not progress, leave=False):
        centers = x[_kmeans_pp(x, x_sq, k, gen).to(device)].clone()
        labels = torch.full((n,), -1, dtype=torch.long, device=device)
        it = 0
        for it in range(1, max_iter + 1):
            dist = _sq_dist(x, x_sq, centers)
            new_labels = dist.argmin(1)
            counts = torch.bincount(new_labels, minlength=k)
            empty = (counts == 0).nonzero().flatten()
            if len(empty):
                far = dist.gather(1, new_labels[:, None])[:, 0].argsort(descending=True)[:len(empty)]
                new_labels[far] = empty
                counts = torch.bincount(new_labels, minlength=k)
            new_centers = torch.zeros_like(centers).index_add_(0, new_labels, x) / counts[:, None].to(x.dtype)
            shift = float((new_centers - centers).pow(2).sum())
            converged = torch.equal(new_labels, labels) or shift <= tol_abs
            centers, labels = new_centers, new_labels
            if converged:
                break
        inertia = float((x - centers[labels]).pow(2).sum())
        if best is None or inertia < best.inertia:
            best = KMeansResult(labels=labels, centers=centers, inertia=inertia, n_iter=it)
    return best

