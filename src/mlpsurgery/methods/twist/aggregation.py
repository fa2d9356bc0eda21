"""Moving weights between the central model and subnets: filling a physically smaller subnet with its blocks,
the flat buffers sent between ranks, and the FedAvg aggregation of a round's returned subnets."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ...errors import MLPSurgeryError
from ...sites import AttnWeights, MLPWeights, find_sites
from .blocks import Layout, Subnet


def _params(model: nn.Module) -> dict[str, nn.Parameter]:
    """name -> parameter, tied parameters once, in module order (the flat-buffer order)."""
    out, seen = {}, set()
    for name, p in model.named_parameters():
        if id(p) not in seen:
            seen.add(id(p))
            out[name] = p
    return out


def shared_parameters(model: nn.Module, layout: Layout) -> dict[str, nn.Parameter]:
    """Parameters every subnet holds whole: all but the projections of the partitioned attention / MLPs."""
    sites = find_sites(model)
    split = {id(p) for i in layout.attn_full for p in sites.attn[i].parameters()}
    split |= {id(p) for i in layout.mlp_h for p in sites.mlp[i].parameters()}
    return {n: p for n, p in _params(model).items() if id(p) not in split}


def fill_subnet(sub: nn.Module, central: nn.Module, layout: Layout, subnet: Subnet) -> None:
    """Write the blocks of `subnet` (and the shared parameters) of `central` into the physically smaller `sub`."""
    src = _params(central)
    with torch.no_grad():
        for name, p in shared_parameters(sub, layout).items():
            p.copy_(src[name])
    cs, ss = find_sites(central), find_sites(sub)
    for i, g in subnet.attn.items():
        ss.attn[i].write(cs.attn[i].read().select_groups(g))
    for i, c in subnet.mlp.items():
        ss.mlp[i].write(cs.mlp[i].read().select(layout.neurons(i, c)))


def flatten(model: nn.Module) -> Tensor:
    return torch.cat([p.detach().reshape(-1) for p in _params(model).values()])


def unflatten(model: nn.Module, flat: Tensor) -> None:
    at = 0
    with torch.no_grad():
        for p in _params(model).values():
            p.copy_(flat[at:at + p.numel()].view_as(p))
            at += p.numel()
    if at != flat.numel():
        raise MLPSurgeryError(f"a subnet buffer of {flat.numel()} values does not fit a model of {at} parameters")


class Aggregator:
    """FedAvg over the round's subnets (paper §3.3): every element of the central model becomes the mean of
    the values returned by the subnets that held it; a block held by one subnet is copied back."""

    def __init__(self, central: nn.Module, layout: Layout):
        self.central, self.layout = central, layout
        self.sites = find_sites(central)

        def zeros(t):
            return torch.zeros_like(t, dtype=torch.float32)

        self.shared = {n: zeros(p) for n, p in shared_parameters(central, layout).items()}
        self.attn = {i: self.sites.attn[i].read().map(zeros) for i in layout.attn_full}
        self.attn_n = {i: torch.zeros(n, device=self.attn[i].q.device) for i, n in layout.attn_full.items()}
        self.mlp = {i: self.sites.mlp[i].read().map(zeros) for i in layout.mlp_h}
        self.mlp_n = {i: torch.zeros(h, device=self.mlp[i].up.device) for i, h in layout.mlp_h.items()}
        self.n = 0

    def add(self, model: nn.Module, subnet: Subnet, full: bool) -> None:
        """Add one trained subnet: `model` is the full model masked to it (full=True) or the subnet itself."""
        params = _params(model)
        with torch.no_grad():
            for name, acc in self.shared.items():
                acc += params[name]
            sites = find_sites(model)
            for i, g in subnet.attn.items():
                w, acc = sites.attn[i].read(), self.attn[i]
                if full:
                    w = w.select_groups(g)
                gi = torch.tensor(g, device=acc.q.device)
                heads = acc.heads_of_groups(gi.cpu()).to(acc.q.device)
                acc.q[heads] += w.q
                acc.k[gi] += w.k
                acc.v[gi] += w.v
                acc.o[:, heads] += w.o
                for name, idx in (("q_bias", heads), ("k_bias", gi), ("v_bias", gi)):
                    if getattr(acc, name) is not None:
                        getattr(acc, name)[idx] += getattr(w, name)
                if acc.o_bias is not None:
                    acc.o_bias += w.o_bias
                self.attn_n[i][gi] += 1
            for i, c in subnet.mlp.items():
                idx = self.layout.neurons(i, c).to(self.mlp[i].up.device)
                w, acc = sites.mlp[i].read(), self.mlp[i]
                if full:
                    w = w.select(idx)
                acc.up[idx] += w.up
                acc.down[:, idx] += w.down
                for name in ("gate", "up_bias", "gate_bias"):
                    if getattr(acc, name) is not None:
                        getattr(acc, name)[idx] += getattr(w, name)
                if acc.down_bias is not None:
                    acc.down_bias += w.down_bias
                self.mlp_n[i][idx] += 1
        self.n += 1

    def write(self) -> None:
        """Replace the central model's weights by the means."""
        params = _params(self.central)

        def div(t, n):  # an optional tensor (a bias) divided by its count
            return None if t is None else t / n

        with torch.no_grad():
            for name, acc in self.shared.items():
                params[name].copy_(acc / self.n)
        for i, acc in self.attn.items():
            per_group = self.attn_n[i]
            if (per_group == 0).any():
                missing = per_group.eq(0).nonzero().flatten().tolist()
                raise AssertionError(f"layer {i}: KV groups {missing} held by no subnet")
            per_head = per_group.repeat_interleave(acc.group_size)
            self.sites.attn[i].write(AttnWeights(
                q=acc.q / per_head[:, None, None], k=acc.k / per_group[:, None, None],
                v=acc.v / per_group[:, None, None], o=acc.o / per_head[None, :, None],
                q_bias=div(acc.q_bias, per_head[:, None]), k_bias=div(acc.k_bias, per_group[:, None]),
                v_bias=div(acc.v_bias, per_group[:, None]), o_bias=div(acc.o_bias, self.n)))
        for i, acc in self.mlp.items():
            n = self.mlp_n[i]
            if (n == 0).any():
                raise AssertionError(f"layer {i}: MLP neurons held by no subnet")
            self.sites.mlp[i].write(MLPWeights(
                up=acc.up / n[:, None], down=acc.down / n[None, :], gate=div(acc.gate, n[:, None]),
                up_bias=div(acc.up_bias, n), gate_bias=div(acc.gate_bias, n), down_bias=div(acc.down_bias, self.n),
                activation=acc.activation))
