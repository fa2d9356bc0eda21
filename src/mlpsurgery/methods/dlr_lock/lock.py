"""The whole lock: teacher targets, phase 1, install, phase 2, the module errors, the record."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import torch
from torch import Tensor, nn

from ... import parallel
from ...capture import fingerprint, open_capture
from ...errors import MLPSurgeryError
from ...io import record
from ...modules.dlr import DLRNet
from ...sites import find_sites
from .captured import split_chunks
from .config import DLRConfig, DLRReport
from .distributed import all_nets, merge_reports
from .modulewise import phase1
from .logits import phase2, teacher_targets
from .workdir import _finish, _save_stage_file, _stage, _stage_file


def install(model: nn.Module, nets: dict[int, DLRNet]) -> None:
    """Replace each listed layer's MLP sub-block by its DLR-Net (in place)."""
    sites = find_sites(model)
    p = next(model.parameters())
    for i, net in nets.items():
        sites.mlp[i].replace_subblock(net.to(device=p.device, dtype=p.dtype))


def dlr_lock(model: nn.Module, calib_blocks: Tensor, phase2_blocks: Tensor, cfg: DLRConfig, workdir: str | Path,
             progress: bool = True, data_name: str = "", on_phase1=None) -> DLRReport:
    """Lock `model` in place: phase 1 on `calib_blocks`, phase 2 on `phase2_blocks` (token blocks (N, T)).
    `workdir` holds everything needed to resume; the result is recorded in the model's history.
    on_phase1(model) is called once the phase-1 DLR-Nets are installed (e.g. to measure phase 1 alone)."""
    cfg.validate()
    top = Path(workdir)
    rank, world = parallel.world()
    # under torchrun each rank keeps its own stages (its layers' captures and nets) in a folder of its own; phase 2's
    # checkpoint, written by rank 0 and read by all, stays at the top
    workdir = top if world == 1 else top / f"rank{rank}-of-{world}"
    model.eval()
    device = next(model.parameters()).device
    # the teacher is the original model: its targets are computed before the surgery
    teacher = teacher_stage(model, phase2_blocks, cfg, workdir, progress) if cfg.phase2_steps > 0 else None
    nets, report = phase1(model, calib_blocks, cfg, workdir, progress, device=device)
    install(model, all_nets(nets))  # every rank's nets: each rank holds the whole locked model
    if on_phase1 is not None:
        on_phase1(model)
    if cfg.phase2_steps > 0:
        before = {"phase1": json.loads((workdir / "phase1.stage.json").read_text())["settings"]}
        if cfg.onpolicy_count > 0:  # (absent otherwise, so work folders from before the option still resume)
            before["onpolicy"] = json.loads((workdir / "onpolicy.stage.json").read_text())["settings"]
        phase2_stage(model, phase2_blocks, cfg, workdir, top, {"teacher": teacher, **before}, report, progress)
        report.phase2_relative_error = module_errors(model, workdir, report.layers, cfg)
    report = merge_reports(report)
    record(model, "dlr_lock", asdict(cfg), data=data_name, seed=cfg.seed, capture_tokens=report.capture_tokens,
           phase1_steps=cfg.phase1_steps, onpolicy_steps=cfg.onpolicy_count, phase2_steps=cfg.phase2_steps,
           phase1_relative_error=report.phase1_relative_error,
           # the defender's one-off cost, beside which `attack dlr` sets the attacker's (capture and teacher excluded)
           distillation_seconds=report.start_seconds + report.phase1_seconds + report.onpolicy_seconds
           + report.phase2_seconds)
    return report


def teacher_stage(original: nn.Module, blocks: Tensor, cfg: DLRConfig, workdir: Path, progress: bool = True) -> str:
    """Phase 2's targets from the original model, computed once into the work folder; returns their fingerprint."""
    fp = fingerprint(original, blocks, top_k=cfg.top_k)
    if not _stage(workdir, "teacher", {"fingerprint": fp}):
        _save_stage_file(workdir / "teacher.safetensors", teacher_targets(original, blocks, cfg.top_k,
                                                                         progress=progress))
        _finish(workdir, "teacher")
    return fp


def phase2_stage(model: nn.Module, blocks: Tensor, cfg: DLRConfig, workdir: Path, top: Path, before: dict,
                 report: DLRReport, progress: bool = True, unshard: bool = True) -> None:
    """Phase 2 on the installed DLR-Nets against the teacher_stage targets in `workdir`, a stage recording what it
    continues (`before`: the teacher's fingerprint and the earlier stages' settings); its record goes to `report`.
    unshard: as `phase2`'s."""
    _stage(workdir, "phase2", {**before, **{k: getattr(cfg, k) for k in ("phase2_steps", "phase2_lr", "phase2_batch",
                                                                           "seed")}})
    res = phase2(model, blocks, _stage_file(workdir / "teacher.safetensors"), cfg, top, progress, unshard=unshard)
    _finish(workdir, "phase2")
    report.phase2_history = [{k: h[k] for k in ("step", "loss", "time_s")} for h in res.history]
    report.phase2_seconds = res.seconds
    report.phase2_tokens_per_step = cfg.phase2_batch * blocks.shape[1]


def continue_phase2(model: nn.Module, original: nn.Module, blocks: Tensor, cfg: DLRConfig, workdir: str | Path,
                    progress: bool = True, data_name: str = "", on_teacher=None, unshard: bool = True) -> DLRReport:
    """Phase 2 alone on a model whose MLPs are already DLR-Nets (a folder `lock dlr --layerwise` wrote: phase 1 one
    layer at a time, in the memory of one layer), against `original`, the model it was locked from: the teacher's
    targets on `blocks` first (then on_teacher(original) is called, e.g. to free it), then the logit distillation of
    every installed net, resumable from `workdir`. Recorded in the model's history as a dlr_lock step of its own.
    Under torchrun both models may come sharded (parallel.load_sharded); unshard=False leaves `model` sharded."""
    cfg.validate()
    if cfg.phase2_steps < 1:
        raise MLPSurgeryError("continuing a locked model with phase 2 needs --phase2-steps >= 1")
    sites = find_sites(model)
    layers = [i for i in range(len(sites)) if isinstance(sites.mlp[i].module, DLRNet)]
    if not layers:
        raise MLPSurgeryError("the model holds no DLR-Nets: phase 2 alone continues a folder `lock dlr` wrote (e.g. "
                              "with --layerwise --phase2-steps 0)")
    top = Path(workdir)
    rank, world = parallel.world()
    workdir = top if world == 1 else top / f"rank{rank}-of-{world}"  # (as dlr_lock keeps each rank's stages)
    model.eval()
    teacher = teacher_stage(original, blocks, cfg, workdir, progress)
    if on_teacher is not None:
        on_teacher(original)
    first = sites.mlp[layers[0]].module
    report = DLRReport(layers=layers, depth=first.depth, rank=first.rank, params_mlp=0,
                       params_dlr=sum(p.numel() for p in first.parameters()))
    phase2_stage(model, blocks, cfg, workdir, top, {"teacher": teacher}, report, progress, unshard=unshard)
    record(model, "dlr_lock", asdict(cfg), data=data_name, seed=cfg.seed, phase2_only=True,
           phase2_steps=cfg.phase2_steps, distillation_seconds=report.phase2_seconds)
    return report


@torch.no_grad()
def module_errors(model: nn.Module, workdir: Path, layers: list[int], cfg: DLRConfig) -> dict[int, float]:
    """Relative error of each installed DLR-Net against the original sub-block on the held-out captured
    tokens (the same tokens phase 1 reports on)."""
    cap = open_capture(workdir / "capture")
    _, chunks = split_chunks(cap.n_chunks, cfg.phase1_val_fraction)
    sites = find_sites(model)
    out = {}
    for i in layers:
        net = sites.mlp[i].module
        dev = net.D.device
        num = den = 0.0
        for k in chunks:
            x, y = cap.chunk(k, [i])[i]
            x, y = x.to(dev).float(), y.to(dev).float()
            num += float((net.full(x.to(net.D.dtype)).float() - y).pow(2).sum())  # the net as installed (its dtype)
            den += float((y - x).pow(2).sum())
        out[i] = num / max(den, 1e-30)
    return out
