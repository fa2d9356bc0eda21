"""NestedLinear: the layer of Nested Subspace Networks (papers/nested-subspace-networks.txt, Def. 1).

    y = B[:, :r] (A[:r, :] x) + bias          A (R, in), B (out, R), r <= R the runtime rank

Every rank's weight W_r = B_r A_r is a sum of the first r rank-1 components b_i a_i, so the image of
W_r lies in the image of W_{r+1} (the nested subspace property). The rank is a plain attribute: switching
it slices the same two parameters (views), so no weight is copied or reloaded.

The current rank is part of the saved state: `config()` carries it, so `mlpsurgery.save` writes it into
the manifest and `mlpsurgery.load` rebuilds the layer at that rank. A folder saved after `set_rank(r)`
therefore serves at rank r, while still holding every component up to R (switch with `rank = ...`).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn
from transformers.pytorch_utils import Conv1D

from ..errors import MLPSurgeryError
from .base import SurgeryModule, register

DENSE_CLASSES = ("Linear", "Conv1D")


@register
class NestedLinear(SurgeryModule):
    """A linear map factored as B A with a runtime rank (Definition 1 of the paper).

    in_features, out_features: the shape of the map; max_rank: R, the number of rank-1 components kept;
    bias: whether the layer adds a bias; rank: the rank to run at (default R); dense_class: the stock
    module this layer folds back into (`to_dense`): "Linear", or "Conv1D" for GPT-2's transposed linears.
    """

    def __init__(self, in_features: int, out_features: int, max_rank: int, bias: bool = True,
                 rank: int | None = None, dense_class: str = "Linear"):
        super().__init__()
        if not 1 <= max_rank <= min(in_features, out_features):
            raise MLPSurgeryError(f"max_rank must be in 1..{min(in_features, out_features)} (min(in, out)) for a "
                                  f"{in_features}->{out_features} layer, not {max_rank}")
        if dense_class not in DENSE_CLASSES:
            raise MLPSurgeryError(f"dense_class must be one of {DENSE_CLASSES}, not {dense_class!r}")
        self.in_features, self.out_features, self.max_rank = in_features, out_features, max_rank
        self.dense_class = dense_class
        self.A = nn.Parameter(torch.empty(max_rank, in_features))
        self.B = nn.Parameter(torch.empty(out_features, max_rank))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        # Random init for layers trained from scratch (surgery overwrites it with the SVD): each factor
        # scaled like nn.Linear's default so that the product starts at a comparable magnitude.
        nn.init.uniform_(self.A, -1 / math.sqrt(in_features), 1 / math.sqrt(in_features))
        nn.init.uniform_(self.B, -1 / math.sqrt(max_rank), 1 / math.sqrt(max_rank))
        self._rank = max_rank
        self.rank = max_rank if rank is None else rank

    # ---- rank ----
    @property
    def rank(self) -> int:
        return self._rank

    @rank.setter
    def rank(self, r: int) -> None:
        if isinstance(r, bool) or not isinstance(r, int) or not 1 <= r <= self.max_rank:
            raise MLPSurgeryError(f"rank must be an integer in 1..{self.max_rank} (this layer's max_rank), not {r!r}")
        self._rank = r

    def forward(self, x: Tensor) -> Tensor:  # (..., in) -> (..., out)
        r = self._rank
        return nn.functional.linear(nn.functional.linear(x, self.A[:r]), self.B[:, :r], self.bias)

    def flops_per_token(self) -> int:
        """Forward FLOPs at the current rank (the cost counter in measure/cost.py calls this)."""
        return 2 * self._rank * (self.in_features + self.out_features)

    def dense_flops_per_token(self) -> int:
        """FLOPs of the dense layer this one replaces."""
        return 2 * self.in_features * self.out_features

    @property
    def break_even_rank(self) -> float:
        """Below this rank the factored layer is cheaper than the dense one: in*out/(in+out)."""
        return self.in_features * self.out_features / (self.in_features + self.out_features)

    # ---- weights ----
    @classmethod
    def from_weight(cls, weight: Tensor, bias: Tensor | None = None, max_rank: int | None = None,
                    dense_class: str = "Linear") -> "NestedLinear":
        """SVD initialisation (paper B.2): B = U_R sqrt(S_R), A = sqrt(S_R) V_R^T, components ordered by
        singular value. Exact at R = min(in, out); the best rank-r approximation (Frobenius) at every r."""
        out_f, in_f = weight.shape
        R = max_rank or min(in_f, out_f)
        mod = cls(in_f, out_f, R, bias=bias is not None, dense_class=dense_class)
        # float64 SVD so that the full-rank product reproduces a float32 weight to rounding.
        U, S, Vh = torch.linalg.svd(weight.detach().double(), full_matrices=False)
        root = S[:R].sqrt()
        mod.to(device=weight.device, dtype=weight.dtype)
        with torch.no_grad():
            mod.B.copy_(U[:, :R] * root)
            mod.A.copy_(root[:, None] * Vh[:R])
            if bias is not None:
                mod.bias.copy_(bias.detach())
        return mod

    @classmethod
    def from_factors(cls, B: Tensor, A: Tensor, bias: Tensor | None = None, dense_class: str = "Linear",
                     like: Tensor | None = None) -> "NestedLinear":
        """B (out, R), A (R, in) as given (components ordered, e.g. a whitened SVD's: methods/reconstruct/whiten.py),
        in the dtype and device of `like` (default B's)."""
        (out_f, R), in_f = B.shape, A.shape[1]
        like = B if like is None else like
        mod = cls(in_f, out_f, R, bias=bias is not None, dense_class=dense_class).to(device=like.device,
                                                                                     dtype=like.dtype)
        with torch.no_grad():
            mod.B.copy_(B)
            mod.A.copy_(A)
            if bias is not None:
                mod.bias.copy_(bias.detach())
        return mod

    def weight_at(self, r: int | None = None) -> Tensor:
        """W_r = B_r A_r, (out, in)."""
        r = self._rank if r is None else r
        return self.B[:, :r] @ self.A[:r]

    def component_energy(self) -> Tensor:
        """||b_i|| ||a_i|| for every component i (the terms of the Prop. 1 bound), shape (R,)."""
        return (self.B.detach().norm(dim=0) * self.A.detach().norm(dim=1)).float()

    def truncated(self) -> "NestedLinear":
        """A NestedLinear holding only the components up to the current rank (smaller, same function)."""
        r = self._rank
        mod = NestedLinear(self.in_features, self.out_features, r, bias=self.bias is not None,
                           dense_class=self.dense_class).to(device=self.A.device, dtype=self.A.dtype)
        with torch.no_grad():
            mod.A.copy_(self.A[:r])
            mod.B.copy_(self.B[:, :r])
            if self.bias is not None:
                mod.bias.copy_(self.bias)
        return mod

    def to_dense(self) -> nn.Module:
        """The stock module of the original shape computing W_r x + bias (Linear, or GPT-2's Conv1D)."""
        w = self.weight_at().detach()
        p = self.A
        if self.dense_class == "Conv1D":
            mod = Conv1D(self.out_features, self.in_features).to(device=p.device, dtype=p.dtype)
            w = w.t()
            if self.bias is None:
                mod.bias = None
        else:
            mod = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device=p.device,
                            dtype=p.dtype)
        with torch.no_grad():
            mod.weight.copy_(w)
            if self.bias is not None:
                mod.bias.copy_(self.bias)
        return mod

    # ---- save / load ----
    def config(self) -> dict:
        return {"in_features": self.in_features, "out_features": self.out_features, "max_rank": self.max_rank,
                "bias": self.bias is not None, "rank": self._rank, "dense_class": self.dense_class}

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, rank={self._rank}/{self.max_rank}, "
                f"bias={self.bias is not None}")


# --------------------------------------------------------------------------------------------------
# Rank control over many layers: what methods/nsn/ranks.py does through the sites, and what a saved folder's
# generated model class does with transformers alone (set_rank / set_budget on the loaded model).


def rank_all(layers, rank: int) -> None:
    """Run every NestedLinear in `layers` at min(rank, its max_rank)."""
    layers = list(layers)
    top = max(m.max_rank for m in layers)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= top:
        raise MLPSurgeryError(f"rank must be an integer in 1..{top} (the largest max_rank of this model), not {rank!r}")
    for m in layers:
        m.rank = min(rank, m.max_rank)


def flops_of(layers) -> dict:
    """FLOPs per token of the nested layers at their current ranks, of the dense layers they replaced, and the
    fraction."""
    layers = list(layers)
    flops = sum(m.flops_per_token() for m in layers)
    dense = sum(m.dense_flops_per_token() for m in layers)
    return {"flops": flops, "dense_flops": dense, "fraction": flops / dense}


def rank_for_budget(layers, fraction: float) -> int:
    """The largest single rank r (each layer at min(r, its max_rank)) whose FLOPs fit `fraction` x the dense
    FLOPs of the nested layers."""
    layers = list(layers)
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not fraction > 0:
        raise MLPSurgeryError(f"the FLOPs budget is a positive fraction of the dense FLOPs, not {fraction!r}")
    dense = sum(m.dense_flops_per_token() for m in layers)

    def cost(r: int) -> int:
        return sum(2 * min(r, m.max_rank) * (m.in_features + m.out_features) for m in layers)

    if cost(1) > fraction * dense:
        raise MLPSurgeryError(f"a budget of {fraction:.4g} is below what rank 1 costs ({cost(1) / dense:.4g} of the "
                              "dense FLOPs); give a larger budget")
    lo, hi = 1, max(m.max_rank for m in layers)
    while lo < hi:  # cost is non-decreasing in r
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if cost(mid) <= fraction * dense else (lo, mid - 1)
    return lo

