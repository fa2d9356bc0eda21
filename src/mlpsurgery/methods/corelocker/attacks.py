"""Attacks on a locked model: fine-tuning with a little data, magnitude pruning (the paper's Tables 2-3)."""

from __future__ import annotations

import copy
import math
from typing import Callable

import numpy as np
import torch
from torch import Tensor, nn

from ...errors import MLPSurgeryError, UnsupportedArchitectureError
from ...report import ends_stages, stage
from ...sites import generic_layers
from .utility import Utility


def prune_plain(model: nn.Module, sparsity: float) -> dict:
    """Magnitude pruning of a plain PyTorch model: zero the smallest |w| of each conv / linear weight."""
    if not 0.0 <= sparsity < 1.0:
        raise MLPSurgeryError(f"sparsity must be in [0, 1), not {sparsity}")
    total = zeros = 0
    with torch.no_grad():
        for gl in generic_layers(model):
            if gl.kind not in ("linear", "conv"):
                continue
            w = gl.module.weight
            k = int(sparsity * w.numel())
            if k:
                w.view(-1)[w.detach().abs().flatten().argsort()[:k]] = 0
            total += w.numel()
            zeros += int((w == 0).sum())
    return {"method": "magnitude", "scope": "layer", "sparsity": zeros / max(total, 1)}


@ends_stages
def attack_prune(model: nn.Module, sparsity: float, utility: Utility, progress: bool = False) -> dict:
    """Prune a copy of the locked model (the sites' MLP + attention weights of a transformer with
    `methods.pruning.magnitude_prune`, every conv / linear weight of a plain model) and measure it."""
    from ..pruning import magnitude_prune

    stage(f"pruning attack: magnitude pruning at sparsity {sparsity:g}, then {utility.name}", progress)
    victim = copy.deepcopy(model)
    try:
        info = magnitude_prune(victim, sparsity, parts="both", scope="layer")
    except UnsupportedArchitectureError:
        info = prune_plain(victim, sparsity)
    return {"attack": "prune", "setting": sparsity, utility.name: utility(victim, progress=progress),
            "achieved_sparsity": info["sparsity"]}


FinetuneLoss = Callable[[nn.Module, float, int], tuple[Callable[[int], Tensor], int]]


def classifier_finetune(tokenizer, train, batch_size: int = 16, epochs: int = 3, max_len: int = 128) -> FinetuneLoss:
    """Fine-tuning attack data for a classifier: `fraction` of `train` (stratified, drawn with the trial's
    seed), `epochs` passes of `batch_size`. Returns (loss_fn, steps) for a model."""
    from ...train import classifier_loss

    def make(model: nn.Module, fraction: float, seed: int):
        part = train.sample(fraction, seed=seed)
        steps = epochs * math.ceil(len(part) / batch_size)
        return classifier_loss(model, tokenizer, part, batch_size, max_len=max_len, seed=seed), steps

    return make


def lm_finetune(blocks: Tensor, batch_size: int = 8, epochs: int = 1) -> FinetuneLoss:
    """Fine-tuning attack data for a causal LM: `fraction` of the training blocks."""
    from ...train import lm_loss

    def make(model: nn.Module, fraction: float, seed: int):
        g = torch.Generator().manual_seed(seed)
        part = blocks[torch.randperm(len(blocks), generator=g)[:max(1, int(round(fraction * len(blocks))))]]
        return lm_loss(model, part, batch_size, seed=seed), epochs * math.ceil(len(part) / batch_size)

    return make


@ends_stages
def attack_finetune(model: nn.Module, make_loss: FinetuneLoss, fraction: float, utility: Utility, lr: float = 5e-5,
                    seed: int = 0, progress: bool = True) -> dict:
    """Fine-tune a copy of the locked model (every parameter) on `fraction` of the training data."""
    from ...train import FitConfig, fit, trainable

    victim = copy.deepcopy(model).train()
    for p in victim.parameters():
        p.requires_grad_(True)
    loss_fn, steps = make_loss(victim, fraction, seed)
    res = fit(trainable(victim), loss_fn, FitConfig(steps=steps, lr=lr, seed=seed, warmup=0.1), progress=progress,
              desc=f"fine-tune attack {fraction:g}")
    victim.eval()
    stage(f"{utility.name} after fine-tuning on {fraction:g} of the data (trial seed {seed})", progress)
    return {"attack": "fine-tune", "setting": fraction, "seed": seed, "steps": steps,
            utility.name: utility(victim, progress=progress),
            "train_seconds": res.seconds, "final_loss": res.history[-1]["loss"] if res.history else None}


@ends_stages
def attack_table(model: nn.Module, utility: Utility, make_loss: FinetuneLoss | None = None,
                 finetune=(0.05, 0.10), prune=(0.2, 0.4), trials: int = 3, lr: float = 5e-5,
                 progress: bool = True) -> dict:
    """The paper's Tables 2-3: utility recovered (delta = after - locked, in the utility's units) by
    fine-tuning on each fraction of the training data (mean +- std over `trials` resampled subsets)
    and by magnitude pruning at each sparsity."""
    stage(f"{utility.name} of the locked model on {utility.data}", progress)
    locked = utility(model, progress=progress)
    rows = []
    for f in finetune if make_loss is not None else ():
        runs = [attack_finetune(model, make_loss, f, utility, lr=lr, seed=t, progress=progress) for t in range(trials)]
        vals = [r[utility.name] for r in runs]
        rows.append({"attack": "fine-tune", "setting": f, utility.name: float(np.mean(vals)),
                     "std": float(np.std(vals)), "delta": float(np.mean(vals)) - locked, "runs": runs})
    for s in prune:
        r = attack_prune(model, s, utility, progress=progress)
        rows.append({**r, "std": 0.0, "delta": r[utility.name] - locked})
    return {"metric": utility.name, "higher_is_better": utility.higher_is_better, "locked": locked, "rows": rows,
            "data": utility.data}
