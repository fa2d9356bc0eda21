"""The extraction order of the units, writing and restoring the extracted entries, and the tensor
hashes that tie a key to a model."""

from __future__ import annotations

import hashlib
import math

import torch
from torch import Tensor, nn

from ...errors import MLPSurgeryError
from .units import UnitGroup


Extraction = dict[str, tuple[Tensor, float]]  # parameter name -> (sorted flat positions, locked value)


class Ranking:
    """The order in which units are extracted, computed once: extracting a ratio r takes the first
    round(r * n) units (globally, or of each group), so every ratio up to `max_ratio` reuses it."""

    def __init__(self, groups: list[UnitGroup], scope: str, max_ratio: float):
        self.groups, self.scope = groups, scope
        self.sizes = [len(g) for g in groups]
        self.n_units = sum(self.sizes)
        if scope == "global":
            scores = torch.cat([g.scores.float().cpu() for g in groups])
            k = min(self.n_units, math.ceil(max_ratio * self.n_units))
            top = torch.topk(scores, k, sorted=True).indices if k else torch.zeros(0, dtype=torch.long)
            starts = torch.tensor([0] + self.sizes[:-1]).cumsum(0)
            gid = torch.searchsorted(starts, top, right=True) - 1
            self.order = (gid, top - starts[gid])
        else:
            self.order = [torch.topk(g.scores.float().cpu(), min(len(g), math.ceil(max_ratio * len(g))),
                                     sorted=True).indices for g in groups]
        self.max_ratio = max_ratio

    def count(self, ratio: float) -> int:
        """Units extracted at `ratio`."""
        if self.scope == "global":
            return int(round(ratio * self.n_units))
        return sum(int(round(ratio * n)) for n in self.sizes)

    def take(self, ratio: float) -> tuple[Extraction, int]:
        """The parameter entries of the units extracted at `ratio`, and how many units that is."""
        if ratio > self.max_ratio + 1e-12:
            raise MLPSurgeryError(f"ratio {ratio} exceeds the ranking's maximum {self.max_ratio}")
        chosen: list[tuple[int, Tensor]] = []
        if self.scope == "global":
            k = self.count(ratio)
            gid, uid = self.order[0][:k], self.order[1][:k]
            chosen = [(g, uid[gid == g]) for g in gid.unique().tolist()]
        else:
            chosen = [(g, o[:int(round(ratio * self.sizes[g]))]) for g, o in enumerate(self.order)]
            chosen = [(g, ids) for g, ids in chosen if len(ids)]
        parts: dict[str, list[Tensor]] = {}
        fills: dict[str, float] = {}
        for g, ids in chosen:
            for name, pos, fill in self.groups[g].members(ids.sort().values):
                parts.setdefault(name, []).append(pos.reshape(-1).long())
                fills[name] = fill
        out = {n: (torch.unique(torch.cat(ps)), fills[n]) for n, ps in parts.items()}
        return out, sum(len(ids) for _, ids in chosen)


def _flat(p: Tensor, name: str) -> Tensor:
    if not p.is_contiguous():
        raise MLPSurgeryError(f"parameter {name} is not contiguous; call .contiguous() on the model's parameters")
    return p.detach().view(-1)


def apply_extraction(model: nn.Module, extraction: Extraction) -> dict[str, Tensor]:
    """Write the locked values; returns the original values at those positions."""
    params = dict(model.named_parameters())
    originals = {}
    with torch.no_grad():
        for name, (pos, fill) in extraction.items():
            flat = _flat(params[name], name)
            pos = pos.to(flat.device)
            originals[name] = flat[pos].cpu().clone()
            flat[pos] = fill
    return originals


def restore_values(model: nn.Module, positions: dict[str, Tensor], values: dict[str, Tensor]) -> None:
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, pos in positions.items():
            flat = _flat(params[name], name)
            flat[pos.to(flat.device)] = values[name].to(device=flat.device, dtype=flat.dtype)


# --------------------------------------------------------------------------------------------------
# Fingerprints


def tensor_hashes(model: nn.Module) -> dict[str, str]:
    """SHA-256 of every tensor of the state dict (name, dtype and shape included)."""
    out = {}
    for name, t in model.state_dict().items():
        t = t.detach().cpu().contiguous()
        h = hashlib.sha256(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        out[name] = h.hexdigest()
    return out


def fingerprint(hashes: dict[str, str]) -> str:
    return hashlib.sha256("\n".join(f"{n}:{h}" for n, h in sorted(hashes.items())).encode()).hexdigest()
