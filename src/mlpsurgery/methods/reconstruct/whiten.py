"""Whitened, truncation-aware SVD (SVD-LLM, Wang et al. ICLR 2025): factorise a projection in the metric of its inputs.

A projection W (out, in) that sees inputs with second moment C = XᵀX / n (in, in) loses, when replaced by W',

    ||(W - W') Xᵀ||² / n = tr((W - W') C (W - W')ᵀ) = ||(W - W') S||²_F        for any S with S Sᵀ = C,

so the best rank-r W' is the truncated SVD of W S brought back by S⁻¹ (plain SVD is the special case C = I, the
metric of inputs nobody sees). The product does not depend on which S: any other is S Q with Q orthogonal, whose
SVD is U Σ (QᵀV)ᵀ, so the factors below are the same. We take the Cholesky factor S = L of the damped covariance
C + δI (δ = damp · mean eigenvalue = damp · tr C / in: a singular covariance, a dead input, or more dimensions than
calibration rows never fail), a few times cheaper than an eigendecomposition (the eigendecomposition remains the
fallback should the factorisation still fail), and

    W S = U Σ Vᵀ,    B = U Σ^½,    A = Σ^½ Vᵀ S⁻¹,    W_r = B[:, :r] A[:r]

The components stay ordered by Σ, so every rank is a prefix of the next (NSN's nesting holds) and at full rank
B A = W S S⁻¹ = W exactly (up to float64 rounding), whatever the damping."""

from __future__ import annotations

import torch
from torch import Tensor

DAMP = 1e-4  # relative to the mean eigenvalue: a floor for directions the calibration never excites


def whitening(C: Tensor, damp: float = DAMP) -> tuple[Tensor, Tensor]:
    """(S, S⁻¹) with S Sᵀ = C + damp·mean(eig C)·I, both (in, in) float64: S the lower Cholesky factor (the
    eigendecomposition's Q Λ^½ where Cholesky fails, which a positive semi-definite C plus the damping never
    should)."""
    C = C.double()
    C = (C + C.T) / 2
    eye = torch.eye(C.shape[0], dtype=C.dtype, device=C.device)
    floor = damp * float(torch.diagonal(C).mean().clamp_min(0)) or damp  # tr C / in: the mean eigenvalue
    L, info = torch.linalg.cholesky_ex(C + floor * eye)
    if int(info) == 0 and bool(torch.isfinite(L).all()):
        return L, torch.linalg.solve_triangular(L, eye, upper=False)
    lam, Q = torch.linalg.eigh(C)  # C not positive semi-definite beyond rounding: its negative part clipped
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
