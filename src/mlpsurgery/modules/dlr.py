"""The deep low-rank residual network (DLR-Net) of DLR-Lock.

    z_0 = x
    z_{l+1} = z_l + a_l * U_l silu(D_l RMSNorm_l(z_l))      l = 0 .. depth-1
    DLR(x) = z_depth

D_l: d -> r, U_l: r -> d, a_l a learnable ReZero scalar, RMSNorm_l with its own weight. Parameters are
stored stacked over blocks (D: (depth, r, d), U: (depth, d, r), ...) so that many DLR-Nets (one per
layer) can also be trained side by side as one batched network (`StackedDLR`).

Installed with `MLPSite.replace_subblock`, the module returns the *delta* DLR(x) - x, so the layer's own
residual add yields DLR(x) without touching the model's forward code.

Init (our choice, the paper's is lost in extraction): a_l = 0, D_l ~ N(0, 1/d), U_l ~ N(0, 1/r), norm
weights 1. With a_l = 0 the network is exactly the identity (the sub-block adds nothing); the gradient
reaches every a_l at once (d/da_l = <g, U_l silu(...)> != 0) and D_l, U_l from the first step on, as in
ReZero. Each block holds 2dr + d + 1 parameters.
"""

from __future__ import annotations

import math

import torch
import torch.utils.checkpoint
from torch import Tensor, nn

from .base import SurgeryModule, register


def dlr_depth(budget: int, d: int, rank: int) -> int:
    """Blocks whose parameters (2dr + d + 1 each) best match `budget` (the MLP's parameter count)."""
    return max(1, round(budget / (2 * d * rank + d + 1)))


# The fused inference kernel, plugged in by the library (modules/__init__.py -> kernels/dlr_triton.py): a function
# (net, x) -> the delta, or None where the kernel does not apply. None here, so that this file (which saved folders
# carry for stock transformers) runs the plain PyTorch forward.
KERNEL = None


def rms_norm(z: Tensor, eps: float) -> Tensor:
    """RMS normalisation without a scale: z / sqrt(mean(z^2) + eps)."""
    return z * torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + eps)


def dlr_full(x: Tensor, D: Tensor, U: Tensor, norm: Tensor, alpha: Tensor, eps: float) -> Tensor:
    """DLR(x) from a net's stacked tensors (D: (depth, r, d), U: (depth, d, r), norm: (depth, d), alpha: (depth,)).
    A function of the weights rather than a method, so that one torch.compile of it serves every net of a shape
    (DLR phase 2 on the CPU): the weights are arguments, not guarded objects."""
    z = x
    # the blocks' slices taken once with unbind: indexing D[l] in the loop would make autograd write a zero tensor of
    # D's full size for every block's gradient and add them all up (depth^2 traffic: on the CPU 2.4x the backward)
    for D_l, U_l, norm_l, alpha_l in zip(D.unbind(0), U.unbind(0), norm.unbind(0), alpha.unbind(0)):
        a = torch.nn.functional.silu(nn.functional.linear(rms_norm(z, eps) * norm_l, D_l))  # (.., r)
        z = z + alpha_l * nn.functional.linear(a, U_l)
    return z


@register
class DLRNet(SurgeryModule):
    """x (..., d) -> DLR(x) - x (..., d). See the module docstring."""

    def __init__(self, d: int, rank: int, depth: int, eps: float = 1e-6):
        super().__init__()
        self.d, self.rank, self.depth, self.eps = d, rank, depth, eps
        self.D = nn.Parameter(torch.empty(depth, rank, d))
        self.U = nn.Parameter(torch.empty(depth, d, rank))
        self.norm = nn.Parameter(torch.ones(depth, d))
        self.alpha = nn.Parameter(torch.zeros(depth))
        # Runtime switches (not saved): recompute the blocks in backward instead of storing their activations;
        # run inference (no grad, CUDA) through the fused Triton kernel where the library provides one (KERNEL).
        self.checkpoint = False
        self.fused = True
        self._folded: tuple | None = None  # the kernel's folded weights, cached per weight version
        self.reset_parameters()

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        with torch.no_grad():
            self.D.normal_(0.0, 1.0 / math.sqrt(self.d), generator=generator)
            self.U.normal_(0.0, 1.0 / math.sqrt(self.rank), generator=generator)
            self.norm.fill_(1.0)
            self.alpha.zero_()

    def config(self) -> dict:
        return {"d": self.d, "rank": self.rank, "depth": self.depth, "eps": self.eps}

    def export_blocker(self) -> str:
        return (f"a DLR-Net ({self.depth} residual blocks of rank {self.rank}) is a deep network, not an MLP; no "
                "stock transformers layer computes it")

    def flops_per_token(self) -> int:
        return 2 * 2 * self.d * self.rank * self.depth

    def full(self, x: Tensor) -> Tensor:
        """DLR(x) itself. x: (..., d)."""
        return dlr_full(x, self.D, self.U, self.norm, self.alpha, self.eps)

    def forward(self, x: Tensor) -> Tensor:
        if torch.is_grad_enabled():
            if self.checkpoint:
                return torch.utils.checkpoint.checkpoint(self._delta, x, use_reentrant=False)
            return self._delta(x)
        if self.fused and KERNEL is not None:
            out = KERNEL(self, x)
            if out is not None:
                return out
        return self._delta(x)

    def _delta(self, x: Tensor) -> Tensor:
        return self.full(x) - x


class StackedDLR(nn.Module):
    """n independent DLR-Nets of one shape evaluated as one batched network: input (n, T, d).

    Used to train every layer's DLR-Net side by side (phase 1); `unstack(i)` gives layer i's DLRNet.
    The math per slice is exactly DLRNet's.
    """

    def __init__(self, n: int, d: int, rank: int, depth: int, eps: float = 1e-6, seed: int = 0):
        super().__init__()
        self.n, self.d, self.rank, self.depth, self.eps = n, d, rank, depth, eps
        g = torch.Generator().manual_seed(seed)
        self.D = nn.Parameter(torch.randn(n, depth, rank, d, generator=g) / math.sqrt(d))
        self.U = nn.Parameter(torch.randn(n, depth, d, rank, generator=g) / math.sqrt(rank))
        self.norm = nn.Parameter(torch.ones(n, depth, d))
        self.alpha = nn.Parameter(torch.zeros(n, depth))

    def forward(self, x: Tensor) -> Tensor:  # (n, T, d) -> DLR(x) (n, T, d)
        z = x
        blocks = zip(self.D.unbind(1), self.U.unbind(1), self.norm.unbind(1), self.alpha.unbind(1))  # (as dlr_full)
        for D_l, U_l, norm_l, alpha_l in blocks:
            h = rms_norm(z, self.eps) * norm_l[:, None, :]  # (n, T, d)
            a = torch.nn.functional.silu(torch.bmm(h, D_l.transpose(1, 2)))  # (n, T, r)
            z = z + alpha_l[:, None, None] * torch.bmm(a, U_l.transpose(1, 2))
        return z

    def subset(self, idx: list[int]) -> "StackedDLR":
        """The nets at positions `idx`, as a stack of their own (copies): what one rank trains of all the layers."""
        out = StackedDLR(len(idx), self.d, self.rank, self.depth, self.eps)
        with torch.no_grad():
            for name in ("D", "U", "norm", "alpha"):
                getattr(out, name).copy_(getattr(self, name)[idx])
        return out.to(self.D.device)

    def unstack(self, i: int) -> DLRNet:
        net = DLRNet(self.d, self.rank, self.depth, self.eps)
        with torch.no_grad():
            for name in ("D", "U", "norm", "alpha"):
                getattr(net, name).copy_(getattr(self, name)[i])
        return net

    def load_from(self, i: int, net: DLRNet) -> None:
        with torch.no_grad():
            for name in ("D", "U", "norm", "alpha"):
                getattr(self, name)[i].copy_(getattr(net, name))
