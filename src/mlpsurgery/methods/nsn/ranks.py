"""NSN rank control: the rank (or FLOPs budget) of the whole model, a layer or one projection, switched at run time."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from torch import nn

from ...errors import MLPSurgeryError
from ...modules.nested import NestedLinear, flops_of, rank_all, rank_for_budget
from ...sites import find_sites

from .surgery import _require_nested, _slots


def current_ranks(model: nn.Module) -> dict[str, int]:
    return {p: m.rank for p, m in _require_nested(model).items()}


def _by_layer(model: nn.Module) -> dict[int, list[NestedLinear]]:
    out: dict[int, list[NestedLinear]] = {}
    for slot in _slots(model):
        if isinstance(slot.module, NestedLinear):
            out.setdefault(slot.index, []).append(slot.module)
    return out


def set_rank(model: nn.Module, rank) -> dict[str, int]:
    """Set the runtime rank. `rank`: an int for every nested projection (each capped at its own max_rank);
    a sequence with one int per transformer layer (None leaves a layer alone); a mapping from layer index or
    module path to rank. Returns path -> rank. No weight is copied."""
    layers = _require_nested(model)

    def put(m: NestedLinear, r) -> None:
        if isinstance(r, bool) or not isinstance(r, int) or r < 1:
            raise MLPSurgeryError(f"ranks are positive integers, not {r!r}")
        m.rank = min(r, m.max_rank)

    if isinstance(rank, int) and not isinstance(rank, bool):
        rank_all(layers.values(), rank)
    elif isinstance(rank, Mapping):
        by_layer = _by_layer(model) if any(not isinstance(k, str) for k in rank) else {}
        for key, r in rank.items():
            if isinstance(key, str):
                if key not in layers:
                    raise MLPSurgeryError(f"{key!r} is not a NestedLinear of this model (they are "
                                          f"{', '.join(list(layers)[:4])} ...)")
                put(layers[key], r)
            else:
                if key not in by_layer:
                    raise MLPSurgeryError(f"layer {key} has no nested projection (nested layers: {sorted(by_layer)})")
                for m in by_layer[key]:
                    put(m, r)
    elif isinstance(rank, Sequence) and not isinstance(rank, str):
        by_layer = _by_layer(model)
        n = len(find_sites(model))
        if len(rank) != n:
            raise MLPSurgeryError(f"a per-layer rank list needs one entry per layer ({n}), got {len(rank)}")
        for i, r in enumerate(rank):
            if r is not None:
                for m in by_layer.get(i, []):
                    put(m, r)
    else:
        raise MLPSurgeryError(f"rank must be an int, a per-layer list or a mapping, not {type(rank).__name__}")
    return current_ranks(model)


def nested_flops(model: nn.Module) -> dict:
    """FLOPs per token of the nested projections at their current ranks, of the dense projections they
    replaced, and the fraction."""
    return flops_of(_require_nested(model).values())


def budget_rank(model: nn.Module, fraction: float) -> int:
    """The largest single rank r (each projection at min(r, its max_rank)) whose FLOPs fit
    `fraction` x the dense FLOPs of the nested projections."""
    return rank_for_budget(_require_nested(model).values(), fraction)


def set_budget(model: nn.Module, fraction: float) -> dict:
    """Run at the largest rank whose FLOPs fit `fraction` of the dense FLOPs of the nested projections
    (for --modules mlp: of the original MLPs). Returns the rank and the fraction reached (which is lower
    than asked when even the maximum rank costs less)."""
    r = budget_rank(model, fraction)
    set_rank(model, r)
    return {"budget": fraction, "rank": r, **nested_flops(model)}
