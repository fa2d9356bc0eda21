"""A dense MLP in canonical form: what any surgery can fall back to when it needs a plain MLP
module of arbitrary inner width (pruned, extracted, fused and folded)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from transformers.activations import ACT2FN

from ..errors import MLPSurgeryError
from ..sites import MLPWeights  # library side only (from_weights / to_mlp_weights), never at inference
from .base import SurgeryModule, register


@register
class DenseMLP(SurgeryModule):
    """y = down(act(gate x) * up x) (gated) or down(act(up x)) (plain), weights as in MLPWeights."""

    def __init__(self, d: int, h: int, activation: str, gated: bool, up_bias: bool = False,
                 down_bias: bool = False, gate_bias: bool = False):
        super().__init__()
        self._cfg = dict(d=d, h=h, activation=activation, gated=gated, up_bias=up_bias, down_bias=down_bias,
                         gate_bias=gate_bias)
        self.up = nn.Linear(d, h, bias=up_bias)
        self.gate = nn.Linear(d, h, bias=gate_bias) if gated else None
        self.down = nn.Linear(h, d, bias=down_bias)
        if activation not in ACT2FN:
            raise MLPSurgeryError(f"unknown activation {activation!r}; transformers knows {sorted(ACT2FN)}")
        self.act = ACT2FN[activation]

    def config(self):
        return dict(self._cfg)

    @classmethod
    def from_weights(cls, w: MLPWeights) -> "DenseMLP":
        mod = cls(w.d, w.h, w.activation, w.gated, up_bias=w.up_bias is not None,
                  down_bias=w.down_bias is not None, gate_bias=w.gate_bias is not None)
        mod.to(dtype=w.up.dtype, device=w.up.device)
        with torch.no_grad():
            mod.up.weight.copy_(w.up)
            mod.down.weight.copy_(w.down)
            if w.gated:
                mod.gate.weight.copy_(w.gate)
            for lin, b in ((mod.up, w.up_bias), (mod.down, w.down_bias), (mod.gate, w.gate_bias)):
                if b is not None:
                    lin.bias.copy_(b)
        return mod

    def forward(self, x: Tensor) -> Tensor:  # (..., d) -> (..., d)
        a = self.act(self.up(x)) if self.gate is None else self.act(self.gate(x)) * self.up(x)
        return self.down(a)

    def to_mlp_weights(self) -> MLPWeights:
        def b(lin):
            return None if lin is None or lin.bias is None else lin.bias.detach().clone()

        return MLPWeights(up=self.up.weight.detach().clone(), down=self.down.weight.detach().clone(),
                          gate=None if self.gate is None else self.gate.weight.detach().clone(),
                          up_bias=b(self.up), gate_bias=b(self.gate), down_bias=b(self.down),
                          activation=self._cfg["activation"])
