"""Blocks: which layers are partitioned, into how many blocks (KV groups, MLP chunks), and the subnets
(per layer, the blocks one worker holds) that the generator deals out."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from ...errors import MLPSurgeryError
from ...sites import find_sites
from ...subsets import check_heads_removable
from .generator import _check_subnet, attn_keep_for, check_subnet_size, deployment_subnet, generate_blueprint

PARTS = ("attn", "ffn", "both")


@dataclass
class Subnet:
    """The blocks one subnet holds in each partitioned layer."""

    attn: dict[int, list[int]] = field(default_factory=dict)  # layer -> KV groups
    mlp: dict[int, list[int]] = field(default_factory=dict)  # layer -> MLP chunks

    def as_dict(self) -> dict:
        """JSON form (layer numbers as strings), as recorded in manifests."""
        return {"attn": {str(k): v for k, v in self.attn.items()}, "mlp": {str(k): v for k, v in self.mlp.items()}}


@dataclass
class Layout:
    """Per partitioned layer: attention N_full / N_sub (KV groups), MLP width h split into R chunks."""

    attn_full: dict[int, int]
    attn_sub: dict[int, int]
    mlp_h: dict[int, int]
    R: int
    ffn_sub: int
    common_attn: tuple[int, ...] = ()
    common_ffn: tuple[int, ...] = ()

    def neurons(self, layer: int, chunks) -> Tensor:
        """Inner-neuron indices of the given MLP chunks of a layer, in chunk order."""
        size = self.mlp_h[layer] // self.R
        c = torch.as_tensor(list(chunks), dtype=torch.long)
        return (c[:, None] * size + torch.arange(size)).reshape(-1)

    def attn_scale(self, layer: int) -> float:
        return math.sqrt(self.attn_full[layer] / self.attn_sub[layer])

    def mlp_scale(self) -> float:
        return math.sqrt(self.R / self.ffn_sub)

    def check(self, workers: int) -> None:
        for i in self.attn_full:
            check_subnet_size(self.attn_full[i], self.attn_sub[i], workers, self.common_attn,
                              what=f"attention KV groups (layer {i})")
        if self.mlp_h:
            check_subnet_size(self.R, self.ffn_sub, workers, self.common_ffn, what="MLP chunks")

    def blueprint(self, workers: int, generator: torch.Generator) -> list[Subnet]:
        """One round's S subnets (Algorithm 1 for every partitioned layer and part)."""
        subnets = [Subnet() for _ in range(workers)]
        for i in sorted(self.attn_full):
            for s, row in enumerate(generate_blueprint(self.attn_full[i], self.attn_sub[i], workers,
                                                       self.common_attn, generator)):
                subnets[s].attn[i] = row
        for i in sorted(self.mlp_h):
            for s, row in enumerate(generate_blueprint(self.R, self.ffn_sub, workers, self.common_ffn, generator)):
                subnets[s].mlp[i] = row
        return subnets

    def deployment(self, generator: torch.Generator) -> Subnet:
        return Subnet(attn={i: deployment_subnet(self.attn_full[i], self.attn_sub[i], self.common_attn, generator)
                            for i in sorted(self.attn_full)},
                      mlp={i: deployment_subnet(self.R, self.ffn_sub, self.common_ffn, generator)
                           for i in sorted(self.mlp_h)})

    def subset_args(self, subnet: Subnet) -> tuple[dict[int, list[int]], dict[int, list[int]]]:
        """(KV groups per layer, inner neurons per layer) for `mlpsurgery.subsets.subset_model`."""
        return dict(subnet.attn), {i: self.neurons(i, c).tolist() for i, c in subnet.mlp.items()}


def make_layout(model: nn.Module, parts: str, layers, blocks: int, keep: int, attn_keep: int | None = None,
                common_attn=(), common_ffn=()) -> Layout:
    """The layout of `parts` in `layers`: MLPs in `blocks` (R) chunks of which a subnet keeps `keep` (X);
    attention in KV groups of which it keeps `attn_keep` (default: attn_keep_for(X / R, groups))."""
    if parts not in PARTS:
        raise MLPSurgeryError(f"parts must be one of {', '.join(PARTS)}, not {parts!r}")
    sites = find_sites(model)
    layers = sorted(set(int(i) for i in layers))
    if not layers:
        raise MLPSurgeryError(f"no layer is partitioned: the model has {len(sites)} layers; share fewer first / last "
                              "layers (--shared-first / --shared-last)")
    if any(not 0 <= i < len(sites) for i in layers):
        raise MLPSurgeryError(f"layers {layers} do not all exist; the model has layers 0-{len(sites) - 1}")
    if not 1 <= keep <= blocks:
        raise MLPSurgeryError(f"keep X={keep} must lie in 1..R={blocks} (kappa = X / R)")
    attn_full, attn_sub, mlp_h = {}, {}, {}
    if parts in ("attn", "both"):
        for i in layers:
            n_kv = sites.attn[i].n_kv
            k = attn_keep if attn_keep is not None else attn_keep_for(keep / blocks, n_kv)
            if not 1 <= k <= n_kv:
                raise MLPSurgeryError(f"layer {i} has {n_kv} KV groups; a subnet cannot keep {k}")
            if k < n_kv:  # a subnet's attention would lose heads: refused before any training where it cannot
                check_heads_removable(sites.attn[i])
            attn_full[i], attn_sub[i] = n_kv, k
    if parts in ("ffn", "both"):
        for i in layers:
            h = sites.mlp[i].h
            if h % blocks:
                divisors = [r for r in range(2, 65) if h % r == 0]
                raise MLPSurgeryError(f"layer {i}: MLP width {h} does not split into R={blocks} equal chunks; choose R "
                                      f"among {divisors}")
            mlp_h[i] = h
    for i in attn_full:
        _check_subnet(attn_full[i], attn_sub[i], common_attn, f"attention KV groups (layer {i})")
    if mlp_h:
        _check_subnet(blocks, keep, common_ffn, "MLP chunks")
    return Layout(attn_full, attn_sub, mlp_h, blocks, keep, tuple(int(b) for b in common_attn),
                  tuple(int(b) for b in common_ffn))
