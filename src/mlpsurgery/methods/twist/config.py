"""TwIST settings (`TwISTConfig`) and what follows from them alone: the data shards, each worker's batches,
each round's blueprint generator and learning rate."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from ...errors import MLPSurgeryError
from ...sites import find_sites
from ...train import FitConfig, lr_factor, step_rng
from .blocks import Layout, make_layout


@dataclass
class TwISTConfig:
    """TwIST training settings (paper §5 defaults where it gives them)."""

    workers: int = 4  # S: subnets per round (one process each in true / hybrid mode)
    blocks: int = 12  # R: MLP chunks per layer
    keep: int = 6  # X: MLP chunks a subnet holds (N_sub); kappa = X / R
    attn_keep: int | None = None  # KV groups a subnet holds; None: attn_keep_for(kappa, groups)
    parts: str = "both"  # which blocks are split: attn | ffn | both
    shared_first: int = 2  # first layers every subnet holds whole
    shared_last: int = 2  # last layers every subnet holds whole
    common_attn: list[int] = field(default_factory=list)  # C for the KV groups (paper: empty)
    common_ffn: list[int] = field(default_factory=list)  # C for the MLP chunks (paper: empty)
    interval: int = 15  # repartition interval: local batches per round
    steps: int = 150  # local batches per worker over the whole run
    batch_size: int = 2  # blocks per local batch
    lr: float = 1e-4  # AdamW (paper: Adam, 1e-4)
    weight_decay: float = 0.0
    clip: float | None = 1.0  # gradient-norm clip per worker step; None disables
    warmup: float = 0.0  # fraction of steps of linear warm-up (read at round starts)
    schedule: str = "constant"  # constant | cosine (read at round starts)
    seed: int = 0  # blueprints, batches and dropout all derive from it

    def layers(self, n_layers: int) -> list[int]:
        return list(range(self.shared_first, n_layers - self.shared_last))

    def layout(self, model: nn.Module) -> Layout:
        if self.shared_first < 0 or self.shared_last < 0:
            raise MLPSurgeryError("shared_first / shared_last count layers; they cannot be negative")
        return make_layout(model, self.parts, self.layers(len(find_sites(model))), self.blocks, self.keep,
                           self.attn_keep, self.common_attn, self.common_ffn)

    @property
    def rounds(self) -> int:
        return math.ceil(self.steps / self.interval)

    def validate(self) -> None:
        if self.interval < 1 or self.steps < 1 or self.batch_size < 1:
            raise MLPSurgeryError("interval, steps and batch_size must be positive")
        if self.schedule not in ("constant", "cosine"):
            raise MLPSurgeryError(f"schedule must be constant or cosine, not {self.schedule!r}")


def make_shards(blocks: Tensor, workers: int) -> list[Tensor]:
    """Worker s trains on blocks s, s+S, s+2S, ... (disjoint shards)."""
    if blocks.dim() != 2 or len(blocks) < workers:
        raise MLPSurgeryError(f"training needs at least one token block per worker ({workers}); got "
                              f"{tuple(blocks.shape)}: give more text or a smaller --block-len")
    return [blocks[s::workers] for s in range(workers)]


def _batch(shard: Tensor, cfg: TwISTConfig, step: int, worker: int) -> Tensor:
    idx = torch.randint(0, len(shard), (cfg.batch_size,), generator=step_rng(cfg.seed, step, stream=1 + worker))
    return shard[idx]


def _round_generator(seed: int, r: int) -> torch.Generator:
    return step_rng(seed, r, stream=7919)


def _round_lr(cfg: TwISTConfig, r: int) -> float:
    sched = FitConfig(steps=cfg.steps, lr=cfg.lr, warmup=cfg.warmup, schedule=cfg.schedule)
    return cfg.lr * lr_factor(sched, r * cfg.interval)
