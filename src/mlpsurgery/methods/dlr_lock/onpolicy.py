"""On-policy continuation of phase 1: train each layer's DLR-Net also on the inputs the earlier layers' DLR-Nets
produce, not only on the original model's.

Phase 1 fits layer l's net on x_l, the residual stream the *original* layers before it produce. Once installed,
layer l sees x'_l instead, which the distilled layers before it made, and every layer's small error shifts the
inputs of all later ones (the gap between phase 1's module errors and its end-to-end perplexity). Here the model
runs once over the calibration blocks with every phase-1 net in the stream (capture.capture_mlp_io's `replace`),
recording at each layer the pair (x'_l, y'_l = x'_l + the original sub-block of x'_l): the original function on
the inputs it will actually meet. One pass serves all layers, since layer l's input depends only on the layers
before it. Training then continues from the phase-1 nets on batches whose `onpolicy_mix` share is drawn from these
pairs and the rest from phase 1's (so the nets keep the teacher's inputs too); the held-out on-policy error is
reported before and after.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import torch
from torch import Tensor, nn

from ... import parallel
from ...capture import capture_mlp_io
from ...io import atomic_write_text
from ...modules.dlr import DLRNet, StackedDLR
from .batched import _validate, history, train_batched
from .captured import _CapturedSet, capture_batch, split_chunks
from .config import DLRConfig, DLRReport
from .workdir import _finish, _save_stage_file, _stage, _stage_file


def digest(net: nn.Module) -> str:
    """sha256 of a network's parameters (names, shapes and bytes): which students an on-policy capture ran."""
    h = hashlib.sha256()
    for name, t in sorted(net.state_dict().items()):
        t = parallel.full_value(t)  # a net of a sharded model: its whole value (a collective, as every rank asks)
        h.update(f"{name}{tuple(t.shape)}".encode())
        h.update(t.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def capture_onpolicy(model: nn.Module, blocks: Tensor, net: StackedDLR, layers: list[int], out_dir: Path,
                     dtype: torch.dtype, progress: bool = True, others: dict[int, DLRNet] | None = None):
    """(x', y') of every layer in `layers` with net's slice j running in place of layer layers[j]'s sub-block, and
    `others` (layer -> net: the layers other ranks distil) in place of theirs."""
    students: dict[int, nn.Module] = {}  # unstacked on first use: reopening a finished capture copies no net

    def student(j: int, x: Tensor) -> Tensor:
        if j not in students:
            students[j] = net.unstack(j).to(net.D.device)
        return students[j]._delta(x)

    replace = {i: (lambda x, j=j: student(j, x)) for j, i in enumerate(layers)}
    tag = digest(net)
    for i, other in sorted((others or {}).items()):
        other = other.to(net.D.device)
        replace[i] = lambda x, m=other: m._delta(x)
        tag += f"|{i}:{digest(other)}"
    return capture_mlp_io(model, blocks, layers=layers, batch_size=capture_batch(len(blocks)), out_dir=out_dir,
                          dtype=dtype, progress=progress, tag=tag, replace=replace)


def mixed_sampler(teacher: _CapturedSet, onpol: _CapturedSet, mix: float, hard_fraction: float):
    """sample(n, g) -> (x, y) with round(mix * n) tokens per layer from `onpol`, the rest from `teacher`."""

    def sample(n: int, g: torch.Generator) -> tuple[Tensor, Tensor]:
        n_on = int(round(mix * n))
        parts = [s.sample(k, g, hard_fraction) for s, k in ((teacher, n - n_on), (onpol, n_on)) if k > 0]
        return torch.cat([p[0] for p in parts], 1), torch.cat([p[1] for p in parts], 1)

    return sample


def onpolicy(model: nn.Module, blocks: Tensor, net: StackedDLR, forward, train: _CapturedSet, val: _CapturedSet,
             cfg: DLRConfig, workdir: Path, phase1_settings: dict, report: DLRReport, progress: bool,
             others: dict[int, DLRNet] | None = None, captured=None) -> None:
    """Continue `net` (phase 1's result, trained in place) on the on-policy mix; a stage of its own in workdir,
    resumable, refused when phase 1 or these settings differ. others: the phase-1 nets of the layers other ranks
    distil (under torchrun), in the stream with this rank's. captured: the on-policy pairs, already captured into
    workdir / "capture_onpolicy" by the caller (the layer-by-layer mode, whose stream holds the finished nets)."""
    settings = {"phase1": phase1_settings, "onpolicy_steps": cfg.onpolicy_count, "onpolicy_mix": cfg.onpolicy_mix,
                "onpolicy_lr": cfg.onpolicy_lr}
    done = workdir / "onpolicy.safetensors"
    layers = report.layers
    t0 = time.perf_counter()
    cap = captured if captured is not None else capture_onpolicy(
        model, blocks, net, layers, workdir / "capture_onpolicy", getattr(torch, cfg.capture_dtype), progress,
        others)  # (resumable; a finished capture is only opened)
    train_chunks, val_chunks = split_chunks(cap.n_chunks, cfg.phase1_val_fraction)  # the same blocks as phase 1's
    val_on = _CapturedSet(cap, layers, val_chunks, cfg.memory_limit_gb)
    if _stage(workdir, "onpolicy", settings):
        net.load_state_dict(_stage_file(done))
        meta = json.loads((workdir / "onpolicy.json").read_text())
    else:
        before = _validate(net, val_on)
        capture_seconds = time.perf_counter() - t0
        train_on = _CapturedSet(cap, layers, train_chunks, cfg.memory_limit_gb)  # (beside phase 1's: twice the RAM)
        floor = train.median_update_energy().to(net.D.device) if cfg.phase1_loss == "token" else None
        res = train_batched(net, forward, mixed_sampler(train, train_on, cfg.onpolicy_mix, cfg.phase1_hard_fraction),
                            floor, cfg.onpolicy_count, cfg.onpolicy_lr, cfg.phase1_weight_decay, cfg.seed + 1,
                            cfg.phase1_tokens, workdir / "onpolicy_ckpt", "DLR phase 1, on-policy", progress)
        del train_on
        _save_stage_file(done, net.state_dict())
        meta = {"history": history(res), "seconds": capture_seconds + res.seconds, "capture_seconds": capture_seconds,
                "before": {i: float(e) for i, e in zip(layers, before)}}
        atomic_write_text(workdir / "onpolicy.json", json.dumps(meta))
        _finish(workdir, "onpolicy")
        meta = json.loads((workdir / "onpolicy.json").read_text())
    report.onpolicy_history, report.onpolicy_seconds = meta["history"], meta["seconds"]
    report.onpolicy_start_error = {int(k): v for k, v in meta["before"].items()}
    report.onpolicy_relative_error = {i: float(e) for i, e in zip(layers, _validate(net, val_on))}
