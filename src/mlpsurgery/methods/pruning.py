"""Unstructured pruning baselines on the MLP and attention weights of any supported model, reachable
by every method that compares against pruning at equal sparsity.

`magnitude` zeroes the smallest |w| of each weight matrix (layer-wise, the usual LLM-pruning baseline)
or across all chosen matrices at once (global). Sparsity counts only the chosen parameter types: the
weight matrices of the MLPs (`ffn`), of the attention projections (`attn`), or both.
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import MLPSurgeryError
from ..sites import find_sites

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


def magnitude_prune(model: nn.Module, sparsity: float, parts: str = "both", layers: list[int] | None = None,
                    scope: str = "layer") -> dict:
    """Zero the `sparsity` fraction of smallest-magnitude weights (per matrix, or global). In place."""
    if not 0.0 <= sparsity < 1.0:
        raise MLPSurgeryError(f"sparsity must be in [0, 1), not {sparsity}")
    if scope not in ("layer", "global"):
        raise MLPSurgeryError(f"scope must be 'layer' or 'global', not {scope!r}")
    weights = prunable_weights(model, parts, layers)
    with torch.no_grad():
        if scope == "global":
            scores = torch.cat([w.detach().abs().flatten().float() for w in weights.values()])
            k = int(sparsity * scores.numel())
            thresh = scores.kthvalue(k).values if k > 0 else None
            for w in weights.values():
                if thresh is not None:
                    w.mul_((w.abs().float() > thresh).to(w.dtype))
        else:
            for w in weights.values():
                k = int(sparsity * w.numel())
                if k > 0:
                    idx = w.detach().abs().flatten().argsort()[:k]
                    w.view(-1)[idx] = 0
    total = sum(w.numel() for w in weights.values())
    zeros = sum(int((w == 0).sum()) for w in weights.values())
    return {"method": "magnitude", "parts": parts, "scope": scope, "sparsity": zeros / max(total, 1),
            "pruned_params": zeros, "considered_params": total}
