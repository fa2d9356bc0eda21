"""Magnitude pruning: the smallest |w| of each weight matrix (the usual LLM-pruning baseline) or across all chosen
matrices at once (global), or an N:M pattern of the largest."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from ...errors import MLPSurgeryError
from ...report import ends_stages, stage
from .counts import _report
from .nm import _pattern_text, check_pattern, nm_keep, pattern_sparsity
from .weights import _mask, input_major, prunable_weights


@ends_stages
def magnitude_prune(model: nn.Module, sparsity: float, parts: str = "both", layers: list[int] | None = None,
                    scope: str = "layer", progress: bool = False, pattern: tuple[int, int] | None = None) -> dict:
    """Zero the `sparsity` fraction of smallest-magnitude weights (per matrix, or global). In place.
    pattern: N:M instead (the N largest of every M consecutive inputs of a row kept; sparsity 1 - N/M).
    progress: a bar over the matrices (a full sort each: tens of seconds for all of SmolLM2's)."""
    if pattern is not None:
        sparsity = pattern_sparsity(pattern)
        if scope != "layer":
            raise MLPSurgeryError("an N:M pattern is chosen per group of inputs: use scope 'layer'")
    if not 0.0 <= sparsity < 1.0:
        raise MLPSurgeryError(f"sparsity must be in [0, 1), not {sparsity}")
    if scope not in ("layer", "global"):
        raise MLPSurgeryError(f"scope must be 'layer' or 'global', not {scope!r}")
    weights = prunable_weights(model, parts, layers)
    if pattern is not None:
        for w in input_major(model, weights).values():
            check_pattern(w, pattern)
    with torch.no_grad():
        if pattern is not None or scope == "layer":
            matrices = input_major(model, weights) if pattern is not None else weights
            for w in tqdm(matrices.values(), desc="magnitude", unit="matrix", disable=not progress):
                magnitude_matrix_(w, sparsity, pattern)
        else:
            scores = torch.cat([w.detach().abs().flatten().float() for w in weights.values()])
            k = int(sparsity * scores.numel())
            thresh = scores.kthvalue(k).values if k > 0 else None
            for w in weights.values():
                if thresh is not None:
                    w.mul_((w.abs().float() > thresh).to(w.dtype))
    stage("recording the masks, counting the zeros of every matrix", progress)
    if sparsity > 0:
        _mask(model, weights)
    return {**_report(model, "magnitude", parts, layers, sparsity), "scope": scope, "pattern": _pattern_text(pattern)}


def magnitude_matrix_(w: Tensor, sparsity: float, pattern: tuple[int, int] | None = None) -> None:
    """Zero the `sparsity` fraction of smallest-magnitude entries of one matrix `w` in place, or, with an N:M
    `pattern`, all but the N largest of every M consecutive inputs of a row (`w` then an input-major view)."""
    with torch.no_grad():
        if pattern is not None:
            w.mul_(nm_keep(w.detach().abs().float(), pattern).to(w.dtype))
            return
        k = int(sparsity * w.numel())
        if k > 0:
            idx = w.detach().abs().flatten().argsort()[:k]
            w.view(-1)[idx] = 0

