"""Whitened, truncation-aware SVD (SVD-LLM, Wang et al. ICLR 2025): factorise a projection in the metric of its inputs.

A projection W (out, in) that sees inputs with second moment C = XᵀX / n (in, in) loses, when replaced by W',

    ||(W - W') Xᵀ||² / n = tr((W - W') C (W - W')ᵀ) = ||(W - W') S||²_F        for any S with S Sᵀ = C,

so the best rank-r W' is the truncated SVD of W S brought back by S⁻¹ (plain SVD is the special case C = I, the
metric of inputs nobody sees). With C = Q Λ Qᵀ we take S = Q Λ^½ (Λ damped: a singular covariance, a dead input, or
more dimensions than calibration rows never fail) and

    W S = U Σ Vᵀ,    B = U Σ^½,    A = Σ^½ Vᵀ S⁻¹ = Σ^½ Vᵀ Λ^-½ Qᵀ,    W_r = B[:, :r] A[:r]

The components stay ordered by Σ, so every rank is a prefix of the next (NSN's nesting holds) and at full rank
B A = W S S⁻¹ = W exactly (up to float64 rounding), whatever the damping."""

from __future__ import annotations

import torch
from torch import Tensor

DAMP = 1e-4  # relative to the mean eigenvalue: a floor for directions the calibration never excites


def whitening(C: Tensor, damp: float = DAMP) -> tuple[Tensor, Tensor]:
    """(S, S⁻¹) with S Sᵀ = C + damp·mean(eig C)·I, both (in, in) float64, from the eigendecomposition of C."""
    C = C.double()
    C = (C + C.T) / 2
    lam, Q = torch.linalg.eigh(C)
    floor = damp * float(lam.clamp_min(0).mean()) or damp
    lam = lam.clamp_min(0) + floor
    root = lam.sqrt()
    return Q * root[None, :], (Q / root[None, :]).T


def whitened_factors(weight: Tensor, C: Tensor | None, damp: float = DAMP) -> tuple[Tensor, Tensor, Tensor]:
    """(B (out, R), A (R, in), sigma (R,)) in float64 with R = min(out, in): W = B A, components ordered by their
    share of the output energy on the inputs of second moment C (None: plain SVD). B[:, :r] A[:r] is the best
    rank-r approximation of W in that metric."""
    W = weight.detach().double()
    if C is None:
        U, sig, Vh = torch.linalg.svd(W, full_matrices=False)
        root = sig.sqrt()
        return U * root, root[:, None] * Vh, sig
    S, S_inv = whitening(C.to(W.device), damp)
    U, sig, Vh = torch.linalg.svd(W @ S, full_matrices=False)
    root = sig.sqrt()
    return U * root, (root[:, None] * Vh) @ S_inv, sig


def truncation_error(sigma: Tensor) -> Tensor:
    """(R + 1,): the relative output error ||(W - W_r) X||² / ||W X||² of keeping r = 0..R whitened components
    (the tail energy of sigma², exact for the metric the factors were built in)."""
    e = sigma.double() ** 2
    tail = torch.cat([e.flip(0).cumsum(0).flip(0), e.new_zeros(1)])
    return tail / tail[0].clamp_min(1e-300)
