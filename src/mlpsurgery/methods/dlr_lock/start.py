"""The closed-form start of phase 1: begin near the answer instead of at the identity.

A DLR-Net with depth blocks of rank r is, block by block, a sum of SiLU features of the stream it sees. Here each
block is set in closed form, one after the other on the captured training tokens (forward stagewise, as in
boosting):

    z_0 = x
    for l = 0 .. depth-1:
        phi_l = silu(D_l RMSNorm(z_l))                      D_l: r input directions (below)
        U_l   = argmin ||phi_l U_l^T - (y - z_l)||^2 + ridge  (an r x r linear solve)
        z_{l+1} = z_l + U_l phi_l

so each block fits what the blocks before it left of the sub-block's update y - x, on the stream it actually
sees (the later blocks' inputs are the earlier blocks' outputs, as at inference). The input directions D are the
replaced MLP's own: its gate rows then its up rows (a plain MLP: its input-layer rows), most important neuron
first (by the norm of its output column), with the pre-norm's scale folded in; where the MLP has fewer rows than
depth x r, or has no dense form to read, random rows of the same typical norm fill the rest. a_l carries each
block's scale, U_l is stored at RMS sqrt(1/r) and D_l's rows at norm 1 (the identity start's scales; the rows'
norm goes to the block's norm weight), so the optimiser's steps are relative to a fixed scale whatever the
fitted magnitudes.

Phase 1 checks each layer's start on its held-out captured tokens and starts a layer at the identity where the
start leaves a relative error of 0.8 or more (modulewise.START_MAX_ERROR): on small random models with
near-linear gates, where SiLU features of the gate rows cannot express the gate x up product, the start reaches
only 0.9-1.0 and training from it ends worse than from the identity.

Measured on SmolLM2 (docs/notes/dlr-lock.md, `benchmarks/notes/dlr_start.py`): held-out relative error 1.0 (identity) ->
about 0.35-0.55 in about a second per layer, and lower after the same number of phase-1 steps.
Cost per layer: depth solves of r x r plus 2 x depth matrix products of the sample (tokens x d x r), no
depth x r-sized system, so it scales to wide models.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from ...errors import MLPSurgeryError
from ...modules.dlr import StackedDLR, rms_norm
from ...sites import find_sites


@torch.no_grad()
def mlp_directions(model: nn.Module, layer: int, n_rows: int, generator: torch.Generator | None = None) -> Tensor:
    """(n_rows, d) input directions for layer `layer`'s DLR blocks, from the MLP the DLR-Net replaces (see the
    module docstring); random rows where the MLP has too few or cannot be read."""
    site = find_sites(model).mlp[layer]
    d = site.config.hidden_size
    rows = torch.empty(0, d)
    try:
        w = site.read()
    except MLPSurgeryError:  # a module with no dense form (e.g. one already replaced): random directions
        w = None
    if w is not None:
        order = w.down.float().norm(dim=0).argsort(descending=True)  # neurons by the size of what they write
        parts = ([w.gate.float()[order]] if w.gate is not None else []) + [w.up.float()[order]]
        rows = torch.cat(parts).cpu()  # the directions live on the CPU, whatever the model's device
        norm = site.pre_norm
        scale = getattr(norm, "weight", None) if norm is not None else None
        if isinstance(scale, Tensor) and scale.shape == (d,):
            rows = rows * scale.detach().float().cpu()  # the MLP reads norm(x) * scale; the DLR block reads norm(z)
    rows = rows[:n_rows].cpu()
    if len(rows) < n_rows:
        typical = float(rows.norm(dim=1).median()) if len(rows) else 1.0
        extra = torch.randn(n_rows - len(rows), d, generator=generator)
        rows = torch.cat([rows, extra / extra.norm(dim=1, keepdim=True) * typical])
    return rows


def _ridge(P: Tensor, T: Tensor, ridge: float) -> Tensor:
    """argmin_U ||P U - T||^2 + ridge * mean(diag(P^T P)) ||U||^2: (features, outputs)."""
    A = P.T @ P
    A.diagonal().add_(ridge * float(A.diagonal().mean()) + 1e-12)
    return torch.linalg.solve(A, P.T @ T)


@torch.no_grad()
def closed_form_start(net: StackedDLR, X: Tensor, Y: Tensor, directions: list[Tensor], ridge: float = 1e-3,
                      progress=None) -> Tensor:
    """Set every layer's blocks of `net` in closed form (the module docstring) from captured pairs X, Y
    (n_layers, tokens, d) and each layer's (depth * rank, d) input directions. Returns the per-layer relative
    error reached on these tokens (1.0 = identity)."""
    n, depth, r = net.n, net.depth, net.rank
    dev = net.D.device
    errors = torch.ones(n)
    for j in range(n):
        x, y = X[j].to(dev).float(), Y[j].to(dev).float()
        D = directions[j].to(dev).float().view(depth, r, -1)
        z = x.clone()
        for l in range(depth):
            phi = nn.functional.silu(rms_norm(z, net.eps) @ D[l].T)  # (tokens, r)
            U = _ridge(phi, y - z, ridge)  # (r, d)
            z += phi @ U
            # the same function at the identity start's parameter scales (D rows of norm 1, U of RMS 1/sqrt(r)), so
            # that the optimiser's steps, which are about lr per entry whatever the entry's size, move a block as
            # much as they would from the identity: the directions' norm c goes to the block's norm weight, U's
            # size s to its ReZero scalar (a tiny model's MLP rows of norm 0.1 trained at lr 1e-2 otherwise blow up)
            c = float(D[l].norm(dim=1).mean())
            c = c if c > 0 else 1.0
            s = float(U.pow(2).mean().sqrt()) * math.sqrt(r)
            s = s if s > 0 else 1.0
            net.D[j, l].copy_(D[l] / c)
            net.U[j, l].copy_(U.T / s)
            net.norm[j, l].fill_(c)
            net.alpha[j, l] = s
        errors[j] = (z - y).pow(2).sum() / (y - x).pow(2).sum().clamp_min(1e-30)
        if progress is not None:
            progress.update(1)
    return errors
