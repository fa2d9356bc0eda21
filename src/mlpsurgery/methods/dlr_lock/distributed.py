"""DLR-Lock over torchrun ranks: each rank captures and distils its share of the layers in phase 1 (every
world-th layer; the nets start exactly as one process would start them, so with --phase1-hard-fraction 0 each
layer's net is the one a single process trains), the phase-1 nets are exchanged for the on-policy capture (every
layer's student in the stream) and for phase 2, which runs sharded (FSDP2) on all ranks; reports are merged."""

from __future__ import annotations

from torch import nn

from ... import parallel
from ...errors import MLPSurgeryError
from ...modules.dlr import DLRNet, StackedDLR
from .config import DLRReport, combine_reports


def check_ranks(layers: list[int]) -> None:
    """Refuse, on every rank alike, more ranks than locked layers (a rank would have no layer to distil)."""
    size = parallel.world()[1]
    if size > len(layers):
        raise MLPSurgeryError(f"{size} ranks for {len(layers)} locked layers: launch at most {len(layers)} "
                              "(torchrun --nproc-per-node), or lock more layers")


def other_nets(net: StackedDLR, layers: list[int]) -> dict[int, DLRNet]:
    """layer -> DLR-Net of every layer the other ranks distil (a collective; {} in one process)."""
    rank, size = parallel.world()
    if size == 1:
        return {}
    mine = {i: {k: v.detach().cpu() for k, v in net.unstack(j).state_dict().items()} for j, i in enumerate(layers)}
    out: dict[int, DLRNet] = {}
    for r, states in enumerate(parallel.all_gather(mine)):
        if r == rank:
            continue
        for i, state in states.items():
            other = DLRNet(net.d, net.rank, net.depth, net.eps)
            other.load_state_dict(state)
            out[i] = other
    return out


def all_nets(nets: dict[int, DLRNet]) -> dict[int, DLRNet]:
    """Every rank's layer -> DLR-Net, merged (a collective; `nets` itself in one process)."""
    if parallel.world()[1] == 1:
        return nets
    mine = {i: (net.d, net.rank, net.depth, net.eps, {k: v.detach().cpu() for k, v in net.state_dict().items()})
            for i, net in nets.items()}
    out: dict[int, DLRNet] = {}
    for states in parallel.all_gather(mine):
        for i, (d, rank, depth, eps, state) in states.items():
            net = nets.get(i) or DLRNet(d, rank, depth, eps)
            net.load_state_dict(state)
            out[i] = net
    return dict(sorted(out.items()))


def merge_reports(report: DLRReport) -> DLRReport:
    """One report for the whole model from every rank's (a collective): per-layer fields merged, layers in order,
    stage times the slowest rank's (they ran side by side), histories rank 0's (its layers' losses)."""
    if parallel.world()[1] == 1:
        return report
    return combine_reports(parallel.all_gather(report))


def install_all(model: nn.Module, nets: dict[int, DLRNet], install) -> dict[int, DLRNet]:
    """Install every rank's nets in this rank's model (each rank then holds the whole locked model)."""
    everything = all_nets(nets)
    install(model, everything)
    return everything
