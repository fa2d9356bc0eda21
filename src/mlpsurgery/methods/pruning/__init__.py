"""Pruning baselines on the MLP and attention weights of any supported model, reachable by every method
that compares against pruning at equal sparsity. One file per concern: weights.py (which matrices, their masks),
nm.py (N:M patterns), magnitude.py, calibrated.py (Wanda, SparseGPT), fisher.py (Fisher blocks), counts.py (the
report), layerwise.py and blocks_layerwise.py (the same, one layer in memory at a time); `prune` below dispatches.

Unstructured (weights zeroed in place, and masked so that later training keeps them at zero:
modules/masks.py; sparsity counts only the chosen parameter types: the weight matrices of the MLPs `ffn`,
of the attention projections `attn`, or both):
- `magnitude` zeroes the smallest |w| of each weight matrix (layer-wise, the usual LLM-pruning baseline)
  or across all chosen matrices at once (global);
- `wanda` (Sun et al. 2023) scores |w| x the input's norm, per output row;
- `sparsegpt` (Frantar & Alistarh 2023) prunes and reconstructs each matrix from its inputs' Hessian.
Structured (whole blocks removed, a physically smaller model; the blocks of TwIST: KV groups and MLP chunks):
- `fisher` block pruning (TwIST paper §5, after Michel et al. 2019) keeps the blocks of highest Fisher;
- `random`: a random subnet (`twist_extract`), the TwIST deployment applied to any model.
"""

from __future__ import annotations

from torch import Tensor, nn

from ...errors import MLPSurgeryError
from ...io import record
from ...sites import find_sites
from .calibrated import (calibrated_prune, input_moments, layer_moments, moment_hooks, prune_linears_, sparsegpt_matrix,
                         wanda_mask)
from .counts import _layer_sizes, _per_layer, layer_sparsity, report_from_counts
from .fisher import FISHER_ERROR_INPUTS, block_fisher, fisher_block_prune, fisher_subnet, removal_errors
from .magnitude import magnitude_matrix_, magnitude_prune
from .nm import _pattern_text, check_pattern, nm_keep, parse_pattern, pattern_sparsity
from .weights import PARTS, input_major, prunable_weights

__all__ = ["block_fisher", "calibrated_prune", "check_pattern", "fisher_block_prune", "FISHER_ERROR_INPUTS",
           "fisher_subnet", "input_major", "input_moments", "keep_for_sparsity", "layer_moments", "layer_sparsity",
           "magnitude_matrix_", "magnitude_prune", "METHODS", "moment_hooks", "nm_keep", "parse_pattern", "PARTS",
           "pattern_sparsity", "prunable_weights", "prune", "prune_linears_", "removal_errors", "report_from_counts",
           "sparsegpt_matrix", "wanda_mask"]


METHODS = ("magnitude", "wanda", "sparsegpt", "fisher", "random")


def keep_for_sparsity(sparsity: float, blocks: int) -> int:
    """Blocks kept out of `blocks` when a `sparsity` fraction of them is removed (at least one)."""
    if not 0.0 <= sparsity < 1.0:
        raise MLPSurgeryError(f"sparsity must be in [0, 1), not {sparsity}")
    return max(1, round((1 - sparsity) * blocks))


def prune(model: nn.Module, method: str, sparsity: float | None, parts: str = "both",
          layers: list[int] | None = None, data: Tensor | None = None, blocks: int = 12, seed: int = 0,
          progress: bool = True, pattern: tuple[int, int] | str | None = None) -> tuple[nn.Module, dict]:
    """One baseline at one sparsity of the chosen weights. Unstructured methods (magnitude, wanda, sparsegpt)
    zero weights in place, at `sparsity` or in an N:M `pattern` ((2, 4) or "2:4": semi-structured, sparsity
    1 - N/M); structured ones (fisher, random) keep round((1-sparsity) x blocks) of `blocks` MLP chunks per
    layer (and the matching share of KV groups) and return a new, physically smaller model."""
    if method not in METHODS:
        raise MLPSurgeryError(f"method must be one of {', '.join(METHODS)}, not {method!r}")
    if isinstance(pattern, str):
        pattern = parse_pattern(pattern)
    if pattern is not None:
        if method not in ("magnitude", "wanda", "sparsegpt"):
            raise MLPSurgeryError(f"an N:M pattern applies to magnitude, wanda and sparsegpt, not {method} "
                                  "(which removes whole blocks)")
        implied = pattern_sparsity(pattern)
        if sparsity is not None and abs(sparsity - implied) > 1e-9:
            raise MLPSurgeryError(f"pattern {pattern[0]}:{pattern[1]} is sparsity {implied:g}, not {sparsity:g}: "
                                  "give one of the two")
        sparsity = implied
    if sparsity is None:
        raise MLPSurgeryError("give a sparsity (a fraction in [0, 1)) or an N:M pattern")
    settings = {"sparsity": sparsity, "parts": parts, "layers": layers}
    if pattern is not None:
        settings["pattern"] = _pattern_text(pattern)
    if method == "magnitude":
        report = magnitude_prune(model, sparsity, parts=parts, layers=layers, progress=progress, pattern=pattern)
        record(model, "magnitude-prune", settings)
        return model, report
    if method in ("wanda", "sparsegpt"):
        report = calibrated_prune(model, data, sparsity, method, parts=parts, layers=layers, progress=progress,
                                  pattern=pattern)
        record(model, f"{method}-prune", settings, calibration=list(data.shape))
        return model, report
    keep = keep_for_sparsity(sparsity, blocks)
    all_layers = list(range(len(find_sites(model))))
    before = _layer_sizes(model, parts, all_layers)
    if method == "fisher":
        new, report = fisher_block_prune(model, data, keep, blocks, parts, layers, progress=progress)
        errors = report.pop("errors")
        report["error_inputs"] = FISHER_ERROR_INPUTS
    else:
        from ..twist import twist_extract

        layers = all_layers if layers is None else layers
        new = twist_extract(model, keep=keep, blocks=blocks, parts=parts, layers=layers, seed=seed)
        report, errors = {"method": "random", "parts": parts, "keep": keep, "blocks": blocks, "seed": seed}, None
    # structured pruning removes weights physically: a layer's sparsity is the share of its weights now gone
    after = _layer_sizes(new, parts, all_layers)
    report["per_layer"] = _per_layer({i: 1 - after[i] / before[i] if before[i] else 0.0 for i in all_layers}, errors)
    return new, report

