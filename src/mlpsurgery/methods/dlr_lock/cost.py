"""What locking costs: an untrained locked copy of the right shape, inference times, Prop. B.1's activation model."""

from __future__ import annotations


import torch
from torch import nn

from ...modules.dlr import DLRNet, dlr_depth
from ...sites import find_sites
from .lock import install


def locked_like(model: nn.Module, rank: int, depth: int | None = None, seed: int = 0) -> nn.Module:
    """A copy of `model` with every MLP replaced by an untrained DLR-Net of the given shape: enough to
    measure what locking costs (cost depends on the structure, not on the distilled values)."""
    import copy

    m = copy.deepcopy(model)
    sites = find_sites(m)
    d = sites.config.hidden_size
    g = torch.Generator().manual_seed(seed)
    nets = {}
    for s in sites.mlp:
        budget = sum(p.numel() for p in s.parameters())
        net = DLRNet(d, rank, depth or dlr_depth(budget, d, rank))
        net.reset_parameters(g)
        with torch.no_grad():
            net.alpha.fill_(1e-2)  # a non-trivial function, as after distillation
        nets[s.index] = net
    install(m, nets)
    return m


def inference_times(model: nn.Module, tokens: list[int], vocab: int, repeats: int = 5,
                    compiled: bool = False) -> dict[int, float]:
    """Median forward time (no grad) on one sequence of each length; torch.compile'd when asked."""
    import statistics
    import time

    device = next(model.parameters()).device
    fn = torch.compile(model) if compiled else model
    g = torch.Generator().manual_seed(0)
    out = {}
    model.eval()
    with torch.no_grad():
        for t in tokens:
            ids = torch.randint(0, vocab, (1, t), generator=g).to(device)
            for _ in range(2):  # warm-up (and compilation for this shape)
                fn(input_ids=ids)
            times = []
            for _ in range(repeats):
                if device.type == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                fn(input_ids=ids)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            out[t] = statistics.median(times)
    return out


def activation_memory_model(d: int, h: int, rank: int, depth: int) -> dict:
    """Proposition B.1: per-token stored activations (numbers) of one MLP sub-block in training.
    SwiGLU stores its input, the normed input, gate and up pre-activations and their product (~ d + d + 3h);
    each DLR block stores the RMSNorm input and output (2d), the SiLU input and output (2r) and its output (d)."""
    swiglu = 2 * d + 3 * h
    dlr = depth * (3 * d + 2 * rank)
    frozen = depth * (d + rank)
    return {"swiglu": swiglu, "dlr_full_training": dlr, "dlr_frozen": frozen, "ratio": dlr / swiglu}
