"""Resumable TwIST folders: what a checkpoint folder is claimed with, and where its state lives.

A checkpoint folder is claimed (`files.claim`, kind "twist-train") with everything that decides a run's
result: every TwISTConfig field, the algorithm (the three TwIST modes compute the same function and share one
state, the central weights and the round index, so they may resume each other; dp has its own), a
fingerprint of the starting model and a digest of the token blocks. A rerun with anything else (another
model, other data, other settings) is refused with what differs, never mixed; a folder mlpsurgery did not
write is refused too, and left alone.

The state itself lives in a subfolder (`state/`; `rank<r>/` per DDP rank): `train.save_checkpoint` replaces
its folder whole at every save, which would drop the claim's marker if it were the claimed folder.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict
from pathlib import Path

import torch
from torch import Tensor, nn

from ... import files
from ...train import load_checkpoint
from .aggregation import _params
from .config import TwISTConfig

KIND = "twist-train"


def data_digest(blocks: Tensor) -> str:
    """SHA-256 of the token blocks (shape and values): the shards and batches follow from them and the seed."""
    t = blocks.detach().to("cpu", torch.int64).contiguous()
    h = hashlib.sha256(str(tuple(t.shape)).encode())
    h.update(t.numpy().tobytes())
    return h.hexdigest()


def run_settings(cfg: TwISTConfig, algorithm: str, model: nn.Module, blocks: Tensor) -> dict:
    """What a checkpoint folder is claimed with (flat, so a refusal names the field that differs)."""
    return {**asdict(cfg), "algorithm": algorithm, "model": files.model_fingerprint(model),
            "data": data_digest(blocks)}


def claim(folder: Path, cfg: TwISTConfig, algorithm: str, model: nn.Module, blocks: Tensor) -> bool:
    """Claim `folder` for this run (True: it holds an earlier part of the same run), or refuse it."""
    return files.claim(folder, KIND, run_settings(cfg, algorithm, model, blocks))


def state_dir(folder: Path, rank: int | None = None) -> Path:
    """Where the state is saved inside a claimed folder (per rank for DDP)."""
    return folder / ("state" if rank is None else f"rank{rank}")


def resume(model: nn.Module, folder: Path | None) -> tuple[int, list[dict], float]:
    """Restore the central weights of a claimed folder's state into `model`: (next round, history, seconds)."""
    state = load_checkpoint(state_dir(folder)) if folder else None
    if state is None:
        return 0, [], 0.0
    params = _params(model)
    with torch.no_grad():
        for n, t in state["params"].items():
            params[n].copy_(t)
    return state["round"], state["history"], state["seconds"]
