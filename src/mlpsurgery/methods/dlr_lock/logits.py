"""Phase 2: logits (or final hidden-state) distillation of the DLR-Net parameters, everything else frozen."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from ... import parallel
from ...errors import MLPSurgeryError
from ...measure.perplexity import is_causal_lm
from ...modules.dlr import DLRNet, dlr_full
from ...train import FitConfig, fit, step_rng
from .compiling import compiled_or_eager
from .config import DLRConfig
from .losses import _rest_logsumexp, topk_kl
from .onpolicy import digest


@torch.no_grad()
def teacher_targets(model: nn.Module, blocks: Tensor, top_k: int, batch_size: int = 4,
                    progress: bool = True) -> dict[str, Tensor]:
    """What the student must match: top-k token ids and log-probabilities and the log-probability of the rest
    of the vocabulary (causal LMs), or final hidden states (encoders), for every position of every block."""
    device = next(model.parameters()).device
    out: dict[str, list[Tensor]] = {}
    causal = is_causal_lm(model)
    for s in tqdm(range(0, len(blocks), batch_size), desc="teacher targets", disable=not progress):
        ids = blocks[s:s + batch_size].to(device)
        if causal:
            logp = torch.log_softmax(model(input_ids=ids).logits.float(), dim=-1)
            val, idx = logp.topk(top_k, dim=-1)
            out.setdefault("topk_logp", []).append(val.cpu())
            out.setdefault("topk_idx", []).append(idx.to(torch.int32).cpu())
            out.setdefault("tail_logp", []).append(_rest_logsumexp(logp, idx).cpu())
        else:
            h = model(input_ids=ids).last_hidden_state.float()
            out.setdefault("hidden", []).append(h.to(torch.bfloat16).cpu())
    return {k: torch.cat(v) for k, v in out.items()}


def _dlr_modules(model: nn.Module) -> list[tuple[str, DLRNet]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, DLRNet)]


def dlr_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """name -> parameter of every DLR-Net installed in the model."""
    return {f"{path}.{n}": p for path, m in _dlr_modules(model) for n, p in m.named_parameters()}


def _delta(x: Tensor, D: Tensor, U: Tensor, norm: Tensor, alpha: Tensor, eps: float) -> Tensor:
    """DLRNet._delta as a function of the net's tensors, for torch.compile (see dlr_full)."""
    return dlr_full(x, D, U, norm, alpha, eps) - x


def _compile_nets(nets: list[DLRNet]) -> None:
    """Point every net's (checkpointed) forward at one torch.compile'd `_delta`: it fuses each block's element-wise
    work, which in eager mode is most of a CPU step's time (per-op overhead on 2 x 256 tokens): 15.2 -> 9.2 s per
    SmolLM2 phase-2 step on 2 threads after a one-off compilation of about 110 s (benchmarks/notes/dlr_phase2_step.py).
    Eager where compilation fails (compiling.compiled_or_eager; only at the first call: past it, the checkpoint's
    recompute stops by raising through the forward): the math is the same. `_uncompile_nets` undoes it."""
    import functools

    fn = compiled_or_eager(_delta, "phase 2", every_call=False)
    if fn is _delta:  # no compilation: the nets keep their own forward
        return

    def delta(net: DLRNet, x: Tensor) -> Tensor:
        return fn(x, net.D, net.U, net.norm, net.alpha, net.eps)

    for m in nets:
        m._delta = functools.partial(delta, m)  # (an instance attribute: DLRNet.forward's checkpoint calls it)


def _uncompile_nets(nets: list[DLRNet]) -> None:
    for m in nets:
        m.__dict__.pop("_delta", None)


def phase2(model: nn.Module, blocks: Tensor, targets: dict[str, Tensor], cfg: DLRConfig, workdir: Path,
           progress: bool = True, unshard: bool = True):
    """Logits (or hidden-state) distillation of the DLR-Net parameters only; everything else frozen. Under torchrun
    the model is sharded (FSDP2; it may come sharded, parallel.load_sharded) and, with `unshard`, whole again on
    every rank afterwards; else left sharded (to be saved by parallel.save_sharded, never whole in one process)."""
    params = dlr_parameters(model)
    if not params:
        raise MLPSurgeryError("phase 2 needs a model whose MLPs were replaced by DLR-Nets")
    frozen = {n: p.requires_grad for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        p.requires_grad_(n in params)
    device = next(model.parameters()).device
    causal = "topk_idx" in targets
    # Eval mode: distilling a fixed function wants no dropout. Checkpointing is done per DLR-Net (its input
    # is kept, its blocks recomputed in backward), which is where the activations are.
    model.eval()
    nets = [m for _, m in _dlr_modules(model)]
    for m in nets:
        m.checkpoint = cfg.gradient_checkpointing
    # the checkpoint names the phase-1 nets it continues (under torchrun rank 0 writes it and every rank reads it;
    # it resumes with any number of ranks, since the batch of a step is the same)
    settings = {"start": digest(nn.ModuleList(nets))}
    if parallel.world()[1] > 1:  # under torchrun: FSDP, each rank its share of every batch
        parallel.same_on_every_rank("phase-1 nets", settings["start"])
        parallel.shard(model, device)
        named = dict(model.named_parameters())
        params = {n: named[n] for n in params}
    elif cfg.compile and device.type == "cpu":  # (measured on the CPU; FSDP and CUDA run eagerly until measured)
        _compile_nets(nets)

    def loss_fn(step: int):
        idx = torch.randint(0, len(blocks), (cfg.phase2_batch,), generator=step_rng(cfg.seed + 7, step))
        idx = parallel.rows(idx, model)
        ids = blocks[idx].to(device)
        if causal:
            logits = model(input_ids=ids).logits
            tail = targets["tail_logp"][idx].to(device) if "tail_logp" in targets else None
            return topk_kl(logits, targets["topk_idx"][idx].to(device), targets["topk_logp"][idx].to(device), tail)
        h = model(input_ids=ids).last_hidden_state.float()
        t = targets["hidden"][idx].to(device).float()
        return (h - t).pow(2).sum() / t.pow(2).sum()

    fcfg = FitConfig(steps=cfg.phase2_steps, lr=cfg.phase2_lr, warmup=0.05, clip=1.0, seed=cfg.seed, log_every=5,
                     checkpoint_every=max(10, cfg.phase2_steps // 20))
    try:
        res = fit(params, loss_fn, fcfg, checkpoint_dir=workdir / "phase2_ckpt", progress=progress,
                  desc="DLR phase 2 (logits)" if causal else "DLR phase 2 (hidden states)", settings=settings)
        if unshard:
            parallel.unshard(model)  # (every rank holds the trained model again)
    finally:
        _uncompile_nets(nets)
        for _, m in _dlr_modules(model):
            m.checkpoint = False
        for n, p in model.named_parameters():
            p.requires_grad_(frozen[n])
    return res
