"""Forward hooks that make a model compute a subnet: masks on the inputs of the output projections (an
emulated subnet on the full model) and the activation shift sqrt(N_full / N_sub) on their outputs."""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor, nn

from ...sites import find_sites
from .blocks import Layout, Subnet


class Hooks:
    """Forward hooks installed together, removed together (also as a context manager)."""

    def __init__(self):
        self.handles = []

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    def __enter__(self) -> "Hooks":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def attn_feature_blocks(site) -> Tensor:
    """For each input feature of the attention output projection (heads concatenated), its KV group."""
    return torch.arange(site.n_heads * site.head_dim) // (site.head_dim * (site.n_heads // site.n_kv))


def mlp_feature_blocks(h: int, R: int) -> Tensor:
    """For each of the h inner activations (the down projection's input), its chunk."""
    return torch.arange(h) // (h // R)


def gate_inputs(module: nn.Module, gate: Callable[[], Tensor]):
    """Multiply the module's input features (last dimension) by gate(); returns the hook handle."""
    def hook(mod, args):
        return (args[0] * gate().to(args[0].dtype), *args[1:])
    return module.register_forward_pre_hook(hook)


def scale_outputs(module: nn.Module, factor: float):
    def hook(mod, args, out):
        return out * factor
    return module.register_forward_hook(hook)


def subnet_hooks(model: nn.Module, layout: Layout, subnet: Subnet | None = None, scale: bool = True) -> Hooks:
    """Hooks making `model` compute a subnet: with `subnet`, the full model is masked to its blocks; without,
    the model is taken to be physically that subnet already. `scale` adds the sqrt(N_full/N_sub) factor."""
    sites = find_sites(model)
    hooks = Hooks()
    for i in sorted(layout.attn_full):
        o = sites.attn[i].o_proj
        if subnet is not None:
            blocks = attn_feature_blocks(sites.attn[i])
            mask = torch.isin(blocks, torch.tensor(subnet.attn[i])).to(o.weight.device, torch.float32)
            hooks.handles.append(gate_inputs(o, lambda m=mask: m))
        if scale and layout.attn_sub[i] != layout.attn_full[i]:
            hooks.handles.append(scale_outputs(o, layout.attn_scale(i)))
    for i in sorted(layout.mlp_h):
        down = sites.mlp[i].down_proj
        if subnet is not None:
            blocks = mlp_feature_blocks(layout.mlp_h[i], layout.R)
            mask = torch.isin(blocks, torch.tensor(subnet.mlp[i])).to(down.weight.device, torch.float32)
            hooks.handles.append(gate_inputs(down, lambda m=mask: m))
        if scale and layout.ffn_sub != layout.R:
            hooks.handles.append(scale_outputs(down, layout.mlp_scale()))
    return hooks
