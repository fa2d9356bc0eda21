"""What a pruning run reports: the zeros of every chosen matrix counted per layer, and each layer's output error."""

from __future__ import annotations

import torch
from torch import nn

from ...sites import find_sites
from .weights import prunable_weights


def _per_layer(sparsity: dict[int, float], errors: dict[int, dict[str, tuple[float, float]]] | None) -> list[dict]:
    """Rows {layer, sparsity, error_rel, projections}: error_rel = sqrt(sum of the squared output errors of the
    layer's pruned projections / sum of their squared outputs) (None without calibration data)."""
    rows = []
    for i, sp in sparsity.items():
        row = {"layer": i, "sparsity": sp, "error_rel": None}
        e = (errors or {}).get(i)
        if e:
            num, den = sum(v[0] for v in e.values()), sum(v[1] for v in e.values())
            row["error_rel"] = (num / den) ** 0.5 if den > 0 else None
            row["projections"] = {n: (a / b) ** 0.5 if b > 0 else None for n, (a, b) in e.items()}
        rows.append(row)
    return rows


def _layer_counts(model: nn.Module, parts: str = "both", layers: list[int] | None = None) -> dict[int, tuple[int, int]]:
    """Per layer, (zero entries, entries) of its prunable weight matrices."""
    layers = list(range(len(find_sites(model)))) if layers is None else layers
    out = {}
    for i in layers:
        ws = prunable_weights(model, parts, [i]).values()
        total = sum(w.numel() for w in ws)
        out[i] = (total - sum(int(torch.count_nonzero(w.detach())) for w in ws), total)
    return out


def layer_sparsity(model: nn.Module, parts: str = "both", layers: list[int] | None = None) -> dict[int, float]:
    """Fraction of zero entries among each layer's prunable weight matrices."""
    return {i: z / max(t, 1) for i, (z, t) in _layer_counts(model, parts, layers).items()}


def _layer_sizes(model: nn.Module, parts: str, layers: list[int]) -> dict[int, int]:
    return {i: sum(w.numel() for w in prunable_weights(model, parts, [i]).values()) for i in layers}


def _report(model: nn.Module, method: str, parts: str, layers, sparsity,
            errors: dict[int, dict[str, tuple[float, float]]] | None = None) -> dict:
    """The whole run's sparsity and, per layer, its sparsity and output error (`_per_layer`), from one count of
    the zeros of every chosen matrix (seconds for a real model: it is counted once)."""
    return report_from_counts(_layer_counts(model, parts, layers), method, parts, sparsity, errors)


def report_from_counts(counts: dict[int, tuple[int, int]], method: str, parts: str, sparsity,
                       errors: dict[int, dict[str, tuple[float, float]]] | None = None) -> dict:
    """`_report` from per-layer (zeros, entries) counts already made (the layer-sequential mode counts each
    layer while it is in memory)."""
    total = sum(t for _, t in counts.values())
    zeros = sum(z for z, _ in counts.values())
    return {"method": method, "parts": parts, "target": sparsity, "sparsity": zeros / max(total, 1),
            "pruned_params": zeros, "considered_params": total,
            "per_layer": _per_layer({i: z / max(t, 1) for i, (z, t) in counts.items()}, errors)}

