"""Pruning masks that travel with the model.

Unstructured pruning (magnitude, Wanda, SparseGPT, fusion's magnitude baseline) zeroes weights in place. So
that every later training run, attack or NTK measurement keeps them at zero, each pruned parameter `P` of a
module gets a boolean buffer `P_mask` beside it (True = kept), and P's gradient is multiplied by it: a
masked entry never receives an update (Adam's moments stay zero, weight decay of zero is zero), for any
optimizer and for `torch.autograd.grad` alike. `io.save` lists the masked parameters in the manifest and
stores the masks in their own file (masks.safetensors), so model.safetensors holds exactly the stock tensors;
`io.load` puts them back; `io.export` leaves them out (the zeros are in the weights).

The gradient hook is put on the parameter by a forward pre-hook of its module, at the first forward that
can build a graph: tensor hooks do not survive `copy.deepcopy`, module hooks do (a copied model is masked too).
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn

SUFFIX = "_mask"
_HOOKED = "_mlpsurgery_mask_hooked"


def _mask_grad(mod: nn.Module, buffer: str, grad: torch.Tensor) -> torch.Tensor:
    return grad * mod._buffers[buffer].to(device=grad.device, dtype=grad.dtype)


def _ensure_grad_hooks(mod: nn.Module, args) -> None:
    """Forward pre-hook: give each masked parameter of `mod` its gradient mask (once per parameter object)."""
    if not torch.is_grad_enabled():
        return
    for attr, p in mod._parameters.items():
        buffer = attr + SUFFIX
        if p is not None and buffer in mod._buffers and p.requires_grad and not getattr(p, _HOOKED, False):
            p.register_hook(functools.partial(_mask_grad, mod, buffer))
            setattr(p, _HOOKED, True)


def _split(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, attr = name.rpartition(".")
    return (model.get_submodule(path) if path else model), attr


def _watch(mod: nn.Module) -> None:
    if not any(h is _ensure_grad_hooks for h in mod._forward_pre_hooks.values()):
        mod.register_forward_pre_hook(_ensure_grad_hooks)


def install_mask(model: nn.Module, name: str, keep: torch.Tensor | None = None) -> None:
    """Keep parameter `name` of `model` where `keep` (default: where it is non-zero) is True, from now on."""
    mod, attr = _split(model, name)
    p = getattr(mod, attr)
    keep = (p.detach() != 0) if keep is None else keep.to(device=p.device, dtype=torch.bool)
    if keep.shape != p.shape:
        raise ValueError(f"mask shape {tuple(keep.shape)} does not match {name} {tuple(p.shape)}")
    buffer = attr + SUFFIX
    if buffer in mod._buffers:
        keep = keep & mod._buffers[buffer]
        mod._buffers[buffer] = keep
    else:
        mod.register_buffer(buffer, keep)
    _watch(mod)
    with torch.no_grad():
        p.mul_(keep.to(p.dtype))


def masked_parameters(model: nn.Module) -> list[str]:
    """Names of the parameters that carry a pruning mask."""
    out = []
    for path, mod in model.named_modules():
        for attr in mod._parameters:
            if attr + SUFFIX in mod._buffers:
                out.append(f"{path}.{attr}" if path else attr)
    return out


def restore_masks(model: nn.Module, names: list[str]) -> None:
    """Before a state dict is loaded: mask buffers (filled by the load) for the parameters `names`."""
    for name in names:
        mod, attr = _split(model, name)
        p = getattr(mod, attr)
        if not isinstance(p, torch.Tensor):
            raise AttributeError(name)
        mod.register_buffer(attr + SUFFIX, torch.ones(p.shape, dtype=torch.bool, device=p.device))
        _watch(mod)


@contextlib.contextmanager
def masks_set_aside(model: nn.Module):
    """Within the block the model holds no mask buffers (so its state dict is the stock one); yields
    {parameter name: mask}. The buffers are put back afterwards."""
    taken = {}
    for name in masked_parameters(model):
        mod, attr = _split(model, name)
        taken[name] = (mod, attr + SUFFIX, mod._buffers.pop(attr + SUFFIX))
    try:
        yield {name: buf for name, (_, _, buf) in taken.items()}
    finally:
        for mod, buffer, buf in taken.values():
            mod._buffers[buffer] = buf

