"""The extraction order of the units, writing and restoring the extracted entries, and the tensor
hashes that tie a key to a model."""

from __future__ import annotations

import hashlib
import math

import torch
from torch import Tensor, nn

from ...errors import MLPSurgeryError
from ...tensorfiles import tensor_bytes
from .units import UnitGroup


Extraction = dict[str, tuple[Tensor, float]]  # parameter name -> (sorted flat positions, int32 or int64; locked value)


def unit_count(sizes: list[int], scope: str, ratio: float) -> int:
    """Units extracted at `ratio` from groups of these sizes: of all units (global scope) or of each group."""
    if scope == "global":
        return int(round(ratio * sum(sizes)))
    return sum(int(round(ratio * n)) for n in sizes)


class Ranking:
    """The order in which units are extracted, computed once: extracting a ratio r takes the first
    round(r * n) units (globally, or of each group), so every ratio up to `max_ratio` reuses it."""

    def __init__(self, groups: list[UnitGroup], scope: str, max_ratio: float, ordered: bool = True):
        """ordered=False: only `max_ratio` itself will be taken (a lock at a given ratio), so the global ranking
        selects exactly those units and skips sorting them by score (at 5% of a 2 B model, 94 M units: the sort's
        keys, permutation and permuted copies were gigabytes)."""
        self.groups, self.scope = groups, scope
        self.sizes = [len(g) for g in groups]
        self.n_units = sum(self.sizes)
        self.ordered = ordered or scope != "global"
        if scope == "global":
            k = math.ceil(max_ratio * self.n_units) if ordered else self.count(max_ratio)
            self.order = global_top(groups, min(self.n_units, k), ordered=ordered)
        else:
            self.order = [torch.topk(g.score().float().cpu(), min(len(g), math.ceil(max_ratio * len(g))),
                                     sorted=True).indices for g in groups]
        self.max_ratio = max_ratio

    def require_some(self, ratio: float, unit: str) -> None:
        """Refuse a ratio above 0 that extracts nothing (a key that holds no unit locks nothing); ratio 0 itself
        stays the identity, as asked."""
        if ratio > 0 and self.count(ratio) == 0:
            n = self.n_units if self.scope == "global" else max(self.sizes)
            raise MLPSurgeryError(f"--ratio {ratio} selects none of the {n:,} {unit} units"
                                  f"{'' if self.scope == 'global' else ' of the largest group'} (it rounds to 0): "
                                  f"raise --ratio to at least {1 / n:.3g}, or choose a finer --unit")

    def count(self, ratio: float) -> int:
        """Units extracted at `ratio`."""
        return unit_count(self.sizes, self.scope, ratio)

    def take(self, ratio: float) -> tuple[Extraction, int]:
        """The parameter entries of the units extracted at `ratio`, and how many units that is."""
        if ratio > self.max_ratio + 1e-12:
            raise MLPSurgeryError(f"ratio {ratio} exceeds the ranking's maximum {self.max_ratio}")
        if not self.ordered and self.count(ratio) != len(self.order[1]):
            raise MLPSurgeryError(f"internal: an unordered ranking takes only its own ratio {self.max_ratio}, not {ratio}")
        chosen: list[tuple[int, Tensor]] = []
        if self.scope == "global" and not self.ordered:
            # (group, position) order already: each group's ids are a slice (a view), sorted
            counts, uid = self.order
            ends = counts.cumsum(0)
            starts = [0, *ends.tolist()[:-1]]
            chosen = [(g, uid[a:b]) for g, (a, b) in enumerate(zip(starts, ends.tolist())) if b > a]
        elif self.scope == "global":
            k = self.count(ratio)
            gid, uid = self.order[0][:k], self.order[1][:k]
            chosen = [(g, uid[gid == g]) for g in gid.unique().tolist()]
        else:
            chosen = [(g, o[:int(round(ratio * self.sizes[g]))]) for g, o in enumerate(self.order)]
            chosen = [(g, ids) for g, ids in chosen if len(ids)]
        parts: dict[str, list[Tensor]] = {}
        fills: dict[str, float] = {}
        for g, ids in chosen:
            for name, pos, fill in self.groups[g].members(ids if not self.ordered else ids.sort().values):
                # int32 stays int32 (a weight unit's ids: views of the selection, not int64 copies of 100 M ids)
                parts.setdefault(name, []).append(pos.reshape(-1) if pos.dtype in (torch.int32, torch.int64)
                                                  else pos.reshape(-1).long())
                fills[name] = fill
        n_units = sum(len(ids) for _, ids in chosen)
        del chosen
        out = {n: (_sorted_unique(parts.pop(n)), fills[n]) for n in list(parts)}
        return out, n_units


def _sorted_unique(parts: list[Tensor]) -> Tensor:
    """torch.unique of the concatenated positions; one part already strictly increasing (a weight unit's tensor:
    the chosen ids, sorted) is returned as it is, without unique's sort and copies (100 M positions at 5% of a
    2 B model)."""
    if len(parts) == 1:
        p = parts[0]
        if len(p) < 2 or bool((p[1:] > p[:-1]).all()):
            return p
    return torch.unique(torch.cat(parts))


# Global ranking without a full-size copy of the scores: a streaming radix select finds the k-th largest score in
# two passes over the groups (a histogram of the upper 16 bits of an order-preserving integer key, then of the
# lower 16 bits inside the chosen bin), a third pass collects the units above it and, of the units tied with it,
# the first ones in (group, position) order; only those k are sorted. Each pass holds one slice of one group's
# scores. (A torch.topk over the concatenated scores of SmolLM2's 106 M weights needed about 2 GB beside the
# model; ties, frequent in bfloat16 weights, were broken in no stated order.)
_SLICE = 1 << 22


def _keys(scores: Tensor) -> Tensor:
    """int32 keys in the order of the float32 scores (a larger score has a larger key)."""
    bits = (scores.float() + 0.0).contiguous().view(torch.int32)  # (+ 0.0: -0.0 becomes 0.0, its equal)
    return torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


def _slices(groups: list[UnitGroup]):
    """(group index, offset, keys) of every slice of every group's scores, in order."""
    for gi, g in enumerate(groups):
        s = g.score().detach().float().cpu().reshape(-1)
        if len(s) != len(g):
            raise MLPSurgeryError(f"unit group {g.name} scored {len(s)} units, not {len(g)}")
        if torch.isnan(s).any():
            raise MLPSurgeryError(f"the scores of {g.name} hold NaN (NaN weights?); the units cannot be ranked — "
                                  "check the model's weights")
        for a in range(0, len(s), _SLICE):
            yield gi, a, _keys(s[a:a + _SLICE])
        del s


def _select(hist: Tensor, k: int) -> tuple[int, int]:
    """(bin, units in higher bins) for the bin holding the k-th largest of a 65536-bin histogram."""
    at_least = hist.flip(0).cumsum(0).flip(0)  # at_least[b] = units in bins >= b
    b = int((at_least >= k).nonzero().max())
    return b, int(at_least[b + 1]) if b < len(hist) - 1 else 0


def global_top(groups: list[UnitGroup], k: int, ordered: bool = True) -> tuple[Tensor, Tensor]:
    """(group ids, unit ids) of the k highest-scored units of all groups, best first; ties broken by (group,
    position) order. ordered=False: (units chosen in each group, unit ids) of the same k units in (group,
    position) order, unsorted by score (a group id per unit would be as large as the ids themselves). Memory: one
    slice of scores plus the k chosen."""
    if k <= 0:
        return (torch.zeros(0 if ordered else len(groups), dtype=torch.long), torch.zeros(0, dtype=torch.long))
    hist = torch.zeros(65536, dtype=torch.long)
    for _, _, key in _slices(groups):
        hist += torch.bincount((key >> 16).long() + 32768, minlength=65536)
    hi, above = _select(hist, k)
    hist.zero_()
    for _, _, key in _slices(groups):
        hist += torch.bincount((key[(key >> 16) == hi - 32768] & 0xFFFF).long(), minlength=65536)
    lo, more = _select(hist, k - above)
    kth = ((hi - 32768) << 16) | lo
    ties = k - above - more  # units scored exactly the k-th score that are taken
    # the k chosen are most of the memory at a large k (5% of a 2 B model: 100 M units), so ids are kept as int32
    # where they fit and written into their final tensors as each slice is done (no lists to concatenate: those
    # held the ids twice)
    gdt = torch.int32 if len(groups) < 2**31 else torch.long
    udt = torch.int32 if max(len(g) for g in groups) < 2**31 else torch.long
    uid = torch.empty(k, dtype=udt)
    counts = torch.zeros(len(groups), dtype=torch.long)
    if ordered:
        gid, key = torch.empty(k, dtype=gdt), torch.empty(k, dtype=torch.int32)
    at = 0
    for gi, a, key_slice in _slices(groups):
        tied = (key_slice == kth).nonzero().squeeze(1)[:ties]
        ties -= len(tied)
        ids = torch.cat([(key_slice > kth).nonzero().squeeze(1), tied]).sort().values
        n = len(ids)
        uid[at:at + n] = ids + a
        counts[gi] += n
        if ordered:
            gid[at:at + n] = gi
            key[at:at + n] = key_slice[ids]
        at += n
    if at != k:
        raise MLPSurgeryError(f"internal: the selection found {at} units, not {k}")
    if not ordered:
        return counts, uid
    perm = torch.sort(key, descending=True, stable=True).indices  # stable: ties keep (group, position) order
    del key
    gid = gid[perm]
    uid = uid[perm]
    return gid, uid


def _flat(p: Tensor, name: str) -> Tensor:
    if not p.is_contiguous():
        raise MLPSurgeryError(f"parameter {name} is not contiguous; call .contiguous() on the model's parameters")
    return p.detach().view(-1)


def extract_entries(params: dict[str, Tensor], extraction: Extraction) -> dict[str, Tensor]:
    """Write the locked values into those of `params` the extraction names (in place; the layer-sequential lock
    passes one layer's); returns the original values at those positions."""
    originals = {}
    with torch.no_grad():
        for name, (pos, fill) in extraction.items():
            if name in params:
                flat = _flat(params[name], name)
                pos = pos.to(flat.device)
                originals[name] = flat[pos].cpu().clone()
                flat[pos] = fill
    return originals


def restore_entries(params: dict[str, Tensor], positions: dict[str, Tensor], values: dict[str, Tensor]) -> None:
    """Write `values` back at `positions` into those of `params` they name (in place)."""
    with torch.no_grad():
        for name, pos in positions.items():
            if name in params:
                flat = _flat(params[name], name)
                flat[pos.to(flat.device)] = values[name].to(device=flat.device, dtype=flat.dtype)


def apply_extraction(model: nn.Module, extraction: Extraction) -> dict[str, Tensor]:
    """Write the locked values; returns the original values at those positions."""
    params = dict(model.named_parameters())
    return extract_entries({n: params[n] for n in extraction}, extraction)


def restore_values(model: nn.Module, positions: dict[str, Tensor], values: dict[str, Tensor]) -> None:
    params = dict(model.named_parameters())
    restore_entries({n: params[n] for n in positions}, positions, values)


# --------------------------------------------------------------------------------------------------
# Fingerprints


def tensor_hash(name: str, t: Tensor) -> str:
    """SHA-256 of one tensor under its state-dict name (name, dtype and shape included)."""
    h = hashlib.sha256(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
    h.update(tensor_bytes(t))  # the tensor's own bytes, not a copy of them
    return h.hexdigest()


def tensor_hashes(model: nn.Module) -> dict[str, str]:
    """SHA-256 of every tensor of the state dict (name, dtype and shape included)."""
    return {name: tensor_hash(name, t) for name, t in model.state_dict().items()}


def fingerprint(hashes: dict[str, str]) -> str:
    return hashlib.sha256("\n".join(f"{n}:{h}" for n, h in sorted(hashes.items())).encode()).hexdigest()
