"""Plain PyTorch models: the weight-carrying layers of any model, for methods that need no sites (CoreLocker)."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn
from transformers.pytorch_utils import Conv1D

from ..errors import MLPSurgeryError


@dataclass
class GenericLayer:
    """A weight-carrying layer of any PyTorch model, for methods that need no sites."""

    name: str
    module: nn.Module
    kind: str  # linear | conv | batchnorm | layernorm
    role: str  # input | hidden | output (first and last weight layers in module order)


_KINDS = ((nn.Linear, "linear"), (Conv1D, "linear"), (nn.Conv1d, "conv"), (nn.Conv2d, "conv"), (nn.Conv3d, "conv"),
          (nn.modules.batchnorm._BatchNorm, "batchnorm"), (nn.LayerNorm, "layernorm"), (nn.GroupNorm, "layernorm"))


def generic_layers(model: nn.Module) -> list[GenericLayer]:
    """Linear / Conv / BatchNorm / LayerNorm layers in module order; embeddings and the last
    weight layer are marked input / output (the layers CoreLocker leaves alone by default)."""
    found: list[GenericLayer] = []
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Embedding):
            found.append(GenericLayer(name, mod, "embedding", "input"))
            continue
        for klass, kind in _KINDS:
            if isinstance(mod, klass) and getattr(mod, "weight", None) is not None:
                found.append(GenericLayer(name, mod, kind, "hidden"))
                break
    weights = [g for g in found if g.kind in ("linear", "conv")]
    if not weights:
        raise MLPSurgeryError(f"{type(model).__name__} has no Linear or Conv layers to work on")
    if not any(g.kind == "embedding" for g in found):
        weights[0].role = "input"
    weights[-1].role = "output"
    return found
