"""NSN export at a fixed rank: smaller NestedLinears (truncate) or stock dense layers (fold)."""

from __future__ import annotations


from torch import nn

from ...io import record
from ...modules.nested import NestedLinear

from .surgery import _Slot, _require_nested, _slots


def _nested_slots(model: nn.Module, layers: list[int] | None = None) -> list[_Slot]:
    return [s for s in _slots(model, layers=layers) if isinstance(s.module, NestedLinear)]


def truncate(model: nn.Module) -> nn.Module:
    """Keep only the components up to each projection's current rank (smaller, faster, same function at that
    rank; loads with mlpsurgery.load). In place."""
    slots = _nested_slots(model)
    if not slots:
        _require_nested(model)
    ranks = {f"{s.index}.{s.role}": s.module.rank for s in slots}
    for s in slots:
        s.replace(s.module.truncated())
    record(model, "nsn-truncate", {"ranks": sorted(set(ranks.values()))})
    return model


def fold(model: nn.Module) -> nn.Module:
    """Swap every NestedLinear for the stock Linear / Conv1D of the original shape holding W_r = B_r A_r, so
    the model is a stock transformers model again (mlpsurgery.export / save_pretrained). In place."""
    slots = _nested_slots(model)
    if not slots:
        _require_nested(model)
    ranks = sorted({s.module.rank for s in slots})
    for s in slots:
        s.replace(s.module.to_dense())
    record(model, "nsn-fold", {"ranks": ranks})
    return model
