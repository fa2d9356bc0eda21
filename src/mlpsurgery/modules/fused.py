"""Modules installed by MLP Fusion (methods/fusion/) and its low-rank baseline.

`FusedMLP` is the paper's eq. (5): the MLP whose k inner neurons are the centroids of k clusters of the
original h neurons, with the cluster sizes P = C Cᵀ kept as a fixed stand-alone scale:

    plain:  H~ = act(X W~1 + b~1) P W~2 + b2
    gated:  H~ = (act(X W~gate + b~gate) * (X W~up + b~up)) P W~2 + b2

P is a buffer (saved, never trained). The forward equals that of the dense MLP with P folded into the
down projection (`to_mlp_weights`), but gradients do not: the gradient of W~2 is P times the gradient the
folded weight would get (see tests/test_fusion.py for the derivation), which is what keeps the Adam NTK of
the fused model close to the original's. Fold only for export, after fine-tuning.

`TruncatedSVDLinear` is one projection stored as two factors (the truncated-SVD baseline).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from transformers.pytorch_utils import Conv1D

from ..sites import MLPWeights  # library side only (from_centroids / to_mlp_weights), never at inference
from .base import SurgeryModule, register
from .dense import DenseMLP


@register
class FusedMLP(DenseMLP):
    """A dense MLP of inner width k whose activations are scaled by the fixed cluster sizes P (k,)."""

    def __init__(self, d: int, h: int, activation: str, gated: bool, up_bias: bool = False,
                 down_bias: bool = False, gate_bias: bool = False):
        super().__init__(d, h, activation, gated, up_bias=up_bias, down_bias=down_bias, gate_bias=gate_bias)
        self.register_buffer("P", torch.ones(h))  # (k,): diagonal of P = C Cᵀ, the cluster sizes

    @classmethod
    def from_centroids(cls, centroids: MLPWeights, P: Tensor) -> "FusedMLP":
        """The fused MLP with centroid weights W~ = C̄ W (canonical orientation) and cluster sizes P."""
        if P.shape != (centroids.h,):
            raise ValueError(f"P must have one entry per centroid ({centroids.h}), got {tuple(P.shape)}")
        mod = cls.from_weights(centroids)
        with torch.no_grad():
            mod.P.copy_(P.to(mod.P))
        return mod

    def forward(self, x: Tensor) -> Tensor:  # (..., d) -> (..., d)
        a = self.act(self.up(x)) if self.gate is None else self.act(self.gate(x)) * self.up(x)  # (..., k)
        return self.down(a * self.P)

    def to_mlp_weights(self) -> MLPWeights:
        """The dense MLP with P folded into W~2 (same forward, for export once fine-tuning is done)."""
        w = super().to_mlp_weights()
        w.down = w.down * self.P.to(w.down)
        return w


@register
class TruncatedSVDLinear(SurgeryModule):
    """y = x Vᵀ Uᵀ + b with U (out, r), V (r, in): a rank-r factorisation of one linear map."""

    def __init__(self, in_features: int, out_features: int, rank: int, bias: bool = True,
                 dense_class: str = "Linear"):
        super().__init__()
        self._cfg = dict(in_features=in_features, out_features=out_features, rank=rank, bias=bias)
        if dense_class != "Linear":  # recorded only where it differs, so older manifests read the same
            self._cfg["dense_class"] = dense_class
        self.V = nn.Linear(in_features, rank, bias=False)
        self.U = nn.Linear(rank, out_features, bias=bias)

    def config(self):
        return dict(self._cfg)

    @classmethod
    def from_weight(cls, weight: Tensor, bias: Tensor | None, rank: int,
                    dense_class: str = "Linear") -> "TruncatedSVDLinear":
        """The best rank-`rank` approximation (Eckart-Young) of weight (out, in), the singular values
        split evenly (sqrt) between the two factors so neither is badly scaled for fine-tuning. dense_class: the
        stock module it replaces ("Linear", or "Conv1D" for GPT-2), which `to_dense` gives back."""
        out_f, in_f = weight.shape
        U, S, Vh = torch.linalg.svd(weight.detach().double(), full_matrices=False)
        root = S[:rank].sqrt()
        mod = cls(in_f, out_f, rank, bias=bias is not None, dense_class=dense_class).to(device=weight.device,
                                                                                        dtype=weight.dtype)
        with torch.no_grad():
            mod.U.weight.copy_(U[:, :rank] * root)
            mod.V.weight.copy_(root[:, None] * Vh[:rank])
            if bias is not None:
                mod.U.bias.copy_(bias)
        return mod

    @classmethod
    def from_factors(cls, B: Tensor, A: Tensor, bias: Tensor | None, dense_class: str = "Linear",
                     like: Tensor | None = None) -> "TruncatedSVDLinear":
        """U = B (out, r), V = A (r, in): given factors (e.g. a whitened SVD's, methods/reconstruct/whiten.py), in the
        dtype and device of `like` (default B's)."""
        (out_f, rank), in_f = B.shape, A.shape[1]
        like = B if like is None else like
        mod = cls(in_f, out_f, rank, bias=bias is not None, dense_class=dense_class).to(device=like.device,
                                                                                        dtype=like.dtype)
        with torch.no_grad():
            mod.U.weight.copy_(B)
            mod.V.weight.copy_(A)
            if bias is not None:
                mod.U.bias.copy_(bias)
        return mod

    def forward(self, x: Tensor) -> Tensor:  # (..., in) -> (..., out)
        return self.U(self.V(x))

    def to_dense(self) -> nn.Module:
        """The stock module of the original shape computing the same map (W = U V): Linear, or GPT-2's Conv1D."""
        cfg = self._cfg
        p = self.U.weight
        w = (self.U.weight @ self.V.weight).detach()
        if cfg.get("dense_class") == "Conv1D":
            mod = Conv1D(cfg["out_features"], cfg["in_features"]).to(device=p.device, dtype=p.dtype)
            w = w.t()
            if not cfg["bias"]:
                mod.bias = None
        else:
            mod = nn.Linear(cfg["in_features"], cfg["out_features"], bias=cfg["bias"], device=p.device, dtype=p.dtype)
        with torch.no_grad():
            mod.weight.copy_(w)
            if cfg["bias"]:
                mod.bias.copy_(self.U.bias)
        return mod

    def export_blocker(self) -> str:
        return "a truncated-SVD projection has no smaller dense MLP equivalent"
