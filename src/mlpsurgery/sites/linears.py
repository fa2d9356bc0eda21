"""Reading and writing a layer's Linear / GPT-2 Conv1D modules by path, in (out, in) orientation."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from transformers.pytorch_utils import Conv1D

from ..errors import MLPSurgeryError


def _get(module: nn.Module, path: str) -> nn.Module:
    return module.get_submodule(path) if path else module


def _set(module: nn.Module, path: str, new: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(_get(module, parent), name, new)


def _weight(mod: nn.Module) -> Tensor:
    """(out, in) view of a Linear or Conv1D weight (Conv1D stores (in, out))."""
    return mod.weight.t() if isinstance(mod, Conv1D) else mod.weight


def _bias(mod: nn.Module) -> Tensor | None:
    return getattr(mod, "bias", None)


def linear_weight(mod: nn.Module) -> tuple[Tensor, Tensor | None]:
    """(weight (out, in), bias) of a Linear or GPT-2 Conv1D, as views of the module's parameters."""
    return _weight(mod), _bias(mod)


def _copy_(dst: Tensor, src: Tensor) -> None:
    if dst.shape != src.shape:
        raise MLPSurgeryError(f"shape mismatch writing weights: have {tuple(dst.shape)}, got {tuple(src.shape)}")
    with torch.no_grad():
        dst.copy_(src.to(dtype=dst.dtype, device=dst.device))


def _new_linear(weight: Tensor, bias: Tensor | None, like: nn.Module) -> nn.Module:
    """A module of the same kind as `like` (Linear or Conv1D) holding `weight` (out, in), on its device and dtype."""
    p = like.weight
    out_f, in_f = weight.shape
    if isinstance(like, Conv1D):
        mod = Conv1D(out_f, in_f).to(device=p.device, dtype=p.dtype)
        _copy_(mod.weight, weight.t())
        if bias is None:
            mod.bias = None
        else:
            _copy_(mod.bias, bias)
    else:
        mod = nn.Linear(in_f, out_f, bias=bias is not None, device=p.device, dtype=p.dtype)
        _copy_(mod.weight, weight)
        if bias is not None:
            _copy_(mod.bias, bias)
    mod.weight.requires_grad_(p.requires_grad)
    return mod
