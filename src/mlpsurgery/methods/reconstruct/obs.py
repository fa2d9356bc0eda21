"""Which neurons to keep when the down projection is refit afterwards: structured optimal brain surgeon (the selection of
ZipLM, Kurtic et al. 2023, and SlimGPT) on the MLP's inner activations.

The MLP's output is linear in its h inner activations a: y = W a (+ b), W = W_down (d, h). With G = E[a aᵀ] (h, h)
measured on calibration inputs, removing a set of neurons and refitting the rest by least squares costs

    min_W' E||(W' - W) a||² = tr((W' - W) G (W' - W)ᵀ)        (W' zero on the removed columns)

and, for one neuron j at a time (OBS with H⁻¹ = (G + λI)⁻¹), the cheapest is the one of least ||W[:, j]||² / H⁻¹_jj,
after which the others are compensated exactly: W -= W[:, j] H⁻¹[j, :] / H⁻¹_jj and H⁻¹ is downdated by the same rank
one. Removing greedily down to k neurons gives the kept set, the refit down projection (the OBS updates are the least
squares fit) and the error of every width on the way -- the curve per-layer budgets are allocated from. A bias is a
neuron whose activation is always 1 and which is never removed. For speed, up to `h / 256` of the cheapest neurons
go at once (their joint OBS update: exact for the set, greedy only across steps)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

RIDGE = 1e-3  # relative to the mean of diag(G)


@dataclass
class OBSPath:
    """The greedy removal: `order` the neurons in the order they went, `error[m]` the relative output error
    E||(W' - W) a||² / E||W a||² after m removals (m = 0..len(order)), `down` the compensated (d, h) projection
    after the last removal (zero on removed columns), `bias` the compensated bias (or None)."""

    order: list[int]
    error: list[float]
    down: Tensor
    bias: Tensor | None

    def kept(self, h: int) -> Tensor:
        gone = set(self.order)
        return torch.tensor([j for j in range(h) if j not in gone], dtype=torch.long)


def obs_prune(G: Tensor, W: Tensor, k: int, bias: Tensor | None = None, a_mean: Tensor | None = None,
              ridge: float = RIDGE, steps: int = 256, snapshots: dict[int, OBSPath] | None = None) -> OBSPath:
    """Greedy structured OBS from h neurons down to k. G: (h, h) second moment of the inner activations; W: (d, h)
    down projection; bias (d,) with a_mean (h,) the activations' mean, where the layer has a bias. float64 inside.
    snapshots: {width: None, ...} to fill with the path as it passed each of those widths (k < width < h)."""
    h = W.shape[1]
    G = G.double()
    W = W.double().clone()
    if bias is not None:  # the constant neuron: G gains a row/column of E[a] and E[1·1] = 1
        m = a_mean.double()
        G = torch.cat([torch.cat([G, m[:, None]], 1), torch.cat([m, m.new_ones(1)])[None, :]], 0)
        W = torch.cat([W, bias.double()[:, None]], 1)
    total = float(torch.einsum("ij,jk,ik->", W, G, W))
    lam = ridge * float(torch.diagonal(G)[:h].mean().clamp_min(1e-30))
    reg = torch.eye(G.shape[0], dtype=G.dtype) * lam
    if bias is not None:
        reg[-1, -1] = lam  # (the constant neuron is kept; its damping only conditions the inverse)
    Hinv = torch.linalg.inv(G + reg)
    alive = torch.ones(G.shape[0], dtype=torch.bool)
    protected = torch.zeros_like(alive)
    if bias is not None:
        protected[-1] = True
    order: list[int] = []
    errors = [0.0]
    err = 0.0
    to_remove = h - k
    per_step = max(1, -(-to_remove // steps))
    stops = sorted((h - w for w in (snapshots or {}) if k < w < h), reverse=True)

    def snap():
        out = OBSPath(list(order), list(errors), W[:, :h].clone(), W[:, h].clone() if bias is not None else None)
        snapshots[h - len(order)] = out

    while len(order) < to_remove:
        d = torch.diagonal(Hinv).clamp_min(1e-300)
        score = (W * W).sum(0) / d
        score[~alive | protected] = float("inf")
        n = min(per_step, to_remove - len(order))
        while stops and stops[-1] <= len(order):
            stops.pop()
        if stops:
            n = min(n, stops[-1] - len(order))
        R = torch.topk(score, n, largest=False).indices
        Hrr_inv = torch.linalg.inv(Hinv[R][:, R])  # (n, n)
        WR = W[:, R]
        # joint OBS: the set R removed, the rest compensated: W -= W_R (H⁻¹_RR)⁻¹ H⁻¹_R,:
        err += float(torch.einsum("ij,jk,ik->", WR, Hrr_inv, WR))
        W -= WR @ Hrr_inv @ Hinv[R]
        Hinv -= Hinv[:, R] @ Hrr_inv @ Hinv[R]
        W[:, R] = 0
        alive[R] = False
        for j in R.tolist():
            order.append(j)
        prev = errors[-1]
        errors.extend(prev + (i + 1) / n * (err / max(total, 1e-300) - prev) for i in range(n))
        if stops and len(order) == stops[-1]:
            snap()
    if bias is not None:
        return OBSPath(order, errors, W[:, :h].contiguous(), W[:, h].contiguous())
    return OBSPath(order, errors, W.contiguous(), None)
