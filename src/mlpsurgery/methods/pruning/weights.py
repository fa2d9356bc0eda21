"""Which weights pruning considers (the 2-D weight matrices of the chosen MLP / attention parts of the chosen
layers), and the masks that keep the zeros made in them at zero through later training (modules/masks.py)."""

from __future__ import annotations

from torch import Tensor, nn

from ...errors import MLPSurgeryError
from ...modules.masks import install_mask
from ...sites import find_sites


PARTS = ("attn", "ffn", "both")


def prunable_weights(model: nn.Module, parts: str = "both", layers: list[int] | None = None) -> dict[str, nn.Parameter]:
    """name -> weight matrix for the chosen parameter types (biases and norms are never pruned)."""
    if parts not in PARTS:
        raise MLPSurgeryError(f"parts must be one of {', '.join(PARTS)}, not {parts!r}")
    sites = find_sites(model)
    layers = list(range(len(sites))) if layers is None else layers
    names = {id(p): n for n, p in model.named_parameters()}
    out: dict[str, nn.Parameter] = {}
    for i in layers:
        params = []
        if parts in ("ffn", "both"):
            params += list(sites.mlp[i].parameters())
        if parts in ("attn", "both"):
            params += list(sites.attn[i].parameters())
        for p in params:
            if p.dim() == 2:
                out[names[id(p)]] = p
    return out


def input_major(model: nn.Module, weights: dict[str, nn.Parameter]) -> dict[str, Tensor]:
    """The same weights as (out, in) views (GPT-2's Conv1D stores (in, out)): N:M groups run along the inputs."""
    from transformers.pytorch_utils import Conv1D

    conv = {f"{n}.weight" for n, mod in model.named_modules() if isinstance(mod, Conv1D)}
    return {n: (w.T if n in conv else w) for n, w in weights.items()}


def _layer_linears(sites, i: int, parts: str) -> dict[str, nn.Module]:
    out = {}
    if parts in ("ffn", "both"):
        out.update({f"ffn.{role}": m for role, m in sites.mlp[i].linears().items()})
    if parts in ("attn", "both"):
        out.update({f"attn.{role}": m for role, m in sites.attn[i].linears().items()})
    return out


def _mask(model: nn.Module, weights: dict[str, nn.Parameter]) -> None:
    """Store the zeros just made as masks, so every later training or NTK run keeps them."""
    for name in weights:
        install_mask(model, name)

