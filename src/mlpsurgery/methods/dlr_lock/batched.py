"""Training every layer's DLR-Net side by side as one batched network (StackedDLR): compiled forward, per-layer
gradient clipping, held-out error per layer, and the step loop that phase 1 and its on-policy continuation share."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
from torch import Tensor, nn

from ...modules.dlr import StackedDLR
from ...train import FitConfig, FitResult, fit, step_rng
from .captured import _CapturedSet
from .compiling import compiled_or_eager
from .losses import relative_error, token_relative_error


def _compiled(net: nn.Module):
    """net's forward through torch.compile (fuses the element-wise RMSNorm / SiLU / residual work between the
    batched matmuls: 8.1 -> 3.1 s per SmolLM2 phase-1 step on one CPU thread, benchmarks/notes/dlr_phase1_step.py), or
    net itself where compilation is unavailable (compiling.compiled_or_eager): the math is the same."""
    return compiled_or_eager(net, "phase 1")


def _per_layer_clip(net: StackedDLR, max_norm: float):
    """Clip each layer's gradient norm separately: batched training equals independent training."""

    def clip() -> float:
        grads = [p.grad for p in net.parameters() if p.grad is not None]
        norms = torch.sqrt(sum(g.reshape(g.shape[0], -1).pow(2).sum(1) for g in grads))  # (n_layers,)
        scale = (max_norm / (norms + 1e-6)).clamp(max=1.0)
        for g in grads:
            g.mul_(scale.view(-1, *([1] * (g.dim() - 1))))
        return float(norms.max())

    return clip


@torch.no_grad()
def _validate(net: StackedDLR, val: _CapturedSet, batch: int = 2048) -> Tensor:
    X, Y = val.all()
    num = torch.zeros(net.n)
    den = torch.zeros(net.n)
    dev = net.D.device
    for s in range(0, X.shape[1], batch):
        x, y = X[:, s:s + batch].to(dev), Y[:, s:s + batch].to(dev)
        num += (net(x) - y).pow(2).sum((1, 2)).cpu()
        den += (y - x).pow(2).sum((1, 2)).cpu()
    return num / den.clamp_min(1e-30)


def train_batched(net: StackedDLR, forward, sample: Callable[[int, torch.Generator], tuple[Tensor, Tensor]],
                  floor: Tensor | None, steps: int, lr: float, weight_decay: float, seed: int, tokens: int,
                  checkpoint_dir: Path, desc: str, progress: bool) -> FitResult:
    """`steps` AdamW steps (5% warm-up, cosine) of every layer's net on sample(tokens, rng) -> (x, y), each
    (n_layers, tokens, d); the paper's relative loss, or the per-token one when `floor` (the layers' median
    update energy) is given. Resumable from checkpoint_dir; the data of step s depends only on (seed, s)."""
    device = net.D.device

    def loss_fn(step: int):
        x, y = sample(tokens, step_rng(seed, step))
        x, y = x.to(device), y.to(device)
        pred = forward(x)
        rel = relative_error(pred, x, y)
        loss = rel if floor is None else token_relative_error(pred, x, y, floor)
        return loss.sum(), {"relative_error": float(rel.detach().mean()), "loss": float(loss.detach().mean())}

    fcfg = FitConfig(steps=steps, lr=lr, weight_decay=weight_decay, warmup=0.05, clip=1.0, seed=seed, log_every=10,
                     checkpoint_every=max(50, steps // 20))
    return fit(dict(net.named_parameters()), loss_fn, fcfg, checkpoint_dir=checkpoint_dir, progress=progress,
               desc=desc, clip_fn=_per_layer_clip(net, 1.0))


def history(res: FitResult) -> list[dict]:
    """The logged steps of a run, as the report keeps them."""
    return [{k: h[k] for k in ("step", "relative_error", "loss", "time_s") if k in h} for h in res.history]
