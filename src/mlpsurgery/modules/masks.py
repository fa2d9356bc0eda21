"""Pruning masks that travel with the model.

Unstructured pruning (magnitude, Wanda, SparseGPT, fusion's magnitude baseline) zeroes weights in place. So
that every later training run, attack or NTK measurement keeps them at zero, each pruned parameter `P` of a
module gets a buffer `P_mask` beside it, and P's gradient is multiplied by that mask (True = kept): a
masked entry never receives an update (Adam's moments stay zero, weight decay of zero is zero), for any
optimizer and for `torch.autograd.grad` alike. `io.save` lists the masked parameters in the manifest and
stores the masks in their own file (masks.safetensors, one boolean tensor of P's shape each), so
model.safetensors holds exactly the stock tensors; `io.load` puts them back; `io.export` leaves them out (the
zeros are in the weights).

In memory a mask is bit-packed: `P_mask` is a flat uint8 tensor of ceil(numel / 8) bytes, bit j of byte i
(least significant first) the entry 8 i + j of P in row-major order (`pack` / `unpack`; `mask_of` gives the
boolean mask). One byte per entry would be half a bfloat16 model's weights beside it while it is pruned and
saved; bits are a sixteenth. The gradient hook unpacks the mask for the step (one byte per entry, freed
after it).

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


_BITS = (1, 2, 4, 8, 16, 32, 64, 128)


_CHUNK = 1 << 20  # entries packed at a time (a multiple of 8)


def pack(keep: torch.Tensor) -> torch.Tensor:
    """A boolean tensor of any shape as bits: flat uint8, ceil(numel / 8) bytes, least significant bit first."""
    return _pack_slices(keep.reshape(-1), lambda part: part.to(torch.bool))


def pack_nonzero(p: torch.Tensor) -> torch.Tensor:
    """`pack(p != 0)` without the byte-per-entry mask: a slice of p at a time."""
    return _pack_slices(p.detach().reshape(-1), lambda part: part != 0)


def _pack_slices(flat: torch.Tensor, to_keep) -> torch.Tensor:
    """The bits of `to_keep(slice)` over `flat`, a slice of _CHUNK entries at a time into one output: no temporary
    of the mask's full size, whose freed pieces between the masks kept (allocated in between) stayed in the heap --
    a 2 B model's masks packed whole in one go grew the process by 0.9 GB beside their 0.24 GB."""
    n = flat.numel()
    out = torch.empty((n + 7) // 8, dtype=torch.uint8, device=flat.device)
    for a in range(0, n, _CHUNK):
        b = min(a + _CHUNK, n)
        out[a // 8:(b + 7) // 8] = _pack_torch(to_keep(flat[a:b]))
    return out


def unpack(packed: torch.Tensor, shape) -> torch.Tensor:
    """The boolean tensor of `shape` that `pack` made `packed` from."""
    shape = torch.Size(shape)
    n = shape.numel()
    if packed.dtype != torch.uint8 or packed.dim() != 1 or packed.numel() != (n + 7) // 8:
        raise ValueError(f"a packed mask of {tuple(shape)} is {(n + 7) // 8} uint8 bytes, "
                         f"not {packed.dtype} {tuple(packed.shape)}")
    return _unpack_torch(packed, n).view(shape)


def _pack_torch(keep: torch.Tensor) -> torch.Tensor:
    """`pack` of a flat boolean tensor on any device, in torch operations."""
    flat = keep.to(torch.uint8)  # a copy: a 0/1 byte per entry
    pad = -flat.numel() % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    bits = torch.tensor(_BITS, dtype=torch.uint8, device=flat.device)
    return flat.view(-1, 8).mul_(bits).sum(dim=1, dtype=torch.uint8)


def _unpack_torch(packed: torch.Tensor, n: int) -> torch.Tensor:
    """`unpack` on any device, in torch operations: the first n bits as a flat boolean tensor."""
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    bits = packed.unsqueeze(1).bitwise_right_shift(shifts).bitwise_and_(1)
    return bits.view(-1)[:n].view(torch.bool)


def mask_of(model: nn.Module, name: str) -> torch.Tensor:
    """The boolean keep-mask of masked parameter `name` of `model` (True = kept)."""
    mod, attr = _split(model, name)
    return unpack(mod._buffers[attr + SUFFIX], getattr(mod, attr).shape)


def _mask_grad(mod: nn.Module, buffer: str, grad: torch.Tensor) -> torch.Tensor:
    keep = unpack(mod._buffers[buffer].to(grad.device), grad.shape)
    return grad * keep.to(dtype=grad.dtype)


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
    buffer = attr + SUFFIX
    if keep is None and buffer not in mod._buffers:
        # keep = the non-zeros: multiplying by it would change nothing (not even a zero's sign)
        mod.register_buffer(buffer, pack_nonzero(p))
        _watch(mod)
        return
    keep = (p.detach() != 0) if keep is None else keep.to(device=p.device, dtype=torch.bool)
    if keep.shape != p.shape:
        raise ValueError(f"mask shape {tuple(keep.shape)} does not match {name} {tuple(p.shape)}")
    if buffer in mod._buffers:
        keep = keep & unpack(mod._buffers[buffer], p.shape)
    with torch.no_grad():
        p.mul_(keep.to(p.dtype))
    mod.register_buffer(buffer, pack(keep))  # (replaces the mask it had)
    _watch(mod)


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
        mod.register_buffer(attr + SUFFIX, torch.full(((p.numel() + 7) // 8,), 255, dtype=torch.uint8,
                                                      device=p.device))
        _watch(mod)


def load_mask(model: nn.Module, name: str, keep: torch.Tensor) -> None:
    """Fill the mask buffer of `name` (made by `restore_masks`) from a boolean mask of the parameter's shape."""
    mod, attr = _split(model, name)
    p = getattr(mod, attr)
    if keep.shape != p.shape:
        raise ValueError(f"mask shape {tuple(keep.shape)} does not match {name} {tuple(p.shape)}")
    mod._buffers[attr + SUFFIX] = pack(keep.to(device=p.device, dtype=torch.bool))


@contextlib.contextmanager
def masks_set_aside(model: nn.Module):
    """Within the block the model holds no mask buffers (so its state dict is the stock one); yields
    {parameter name: (packed mask, parameter shape)} (`unpack` gives each boolean mask). The buffers are put
    back afterwards."""
    taken = {}
    for name in masked_parameters(model):
        mod, attr = _split(model, name)
        shape = getattr(mod, attr).shape
        taken[name] = (mod, attr + SUFFIX, mod._buffers.pop(attr + SUFFIX), shape)
    try:
        yield {name: (buf, shape) for name, (_, _, buf, shape) in taken.items()}
    finally:
        for mod, buffer, buf, _ in taken.values():
            mod._buffers[buffer] = buf

