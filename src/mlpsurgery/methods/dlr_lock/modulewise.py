"""Phase 1: module-wise distillation of every layer's DLR-Net, side by side as one batched network."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import Tensor, nn
from tqdm.auto import tqdm

from ...capture import capture_mlp_io
from ...io import atomic_write_text
from ...modules.dlr import DLRNet, StackedDLR
from ...sites import find_sites
from ...train import FitConfig, fit, step_rng
from .captured import _CapturedSet, capture_batch, split_chunks
from .config import DLRConfig, DLRReport, plan
from .losses import relative_error, token_relative_error
from .start import closed_form_start, mlp_directions
from .workdir import _finish, _stage, _stage_file


def _compiled(net: nn.Module):
    """net's forward through torch.compile (fuses the element-wise RMSNorm / SiLU / residual work between the
    batched matmuls: 8.1 -> 3.1 s per SmolLM2 phase-1 step on one CPU thread, benchmarks/dlr_phase1_step.py), or net itself where
    compilation is unavailable (no C compiler, unsupported platform): the math is the same."""
    try:
        fn = torch.compile(net)
    except Exception as exc:  # noqa: BLE001 - any failure to set up compilation falls back to eager
        import warnings

        warnings.warn(f"torch.compile unavailable ({exc}); phase 1 runs eagerly")
        return net
    state = {"fn": fn}

    def forward(x: Tensor) -> Tensor:
        try:
            return state["fn"](x)
        except Exception as exc:  # noqa: BLE001 - a backend failure at first call (e.g. no C compiler)
            if state["fn"] is net:
                raise
            import warnings

            warnings.warn(f"torch.compile failed ({type(exc).__name__}: {exc}); phase 1 runs eagerly")
            state["fn"] = net
            return net(x)

    return forward


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


# A layer whose closed-form start leaves held-out error at or above this starts at the identity instead: on small
# random models with gated MLPs the start reaches only 0.9-1.0 and training from it ends worse than from the
# identity (tests/test_dlr.py); on SmolLM2 every layer starts below 0.6 and ends better (docs/dlr-lock.md).
START_MAX_ERROR = 0.8


def _start(model: nn.Module, net: StackedDLR, train: _CapturedSet, val: _CapturedSet, cfg: DLRConfig,
           workdir: Path, report: DLRReport, progress: bool) -> None:
    """The closed-form start (start.py), computed once: a resumed phase 1 reads it from the work folder (its
    training checkpoints, when there are any, then replace it)."""
    path = workdir / "phase1_start.safetensors"
    meta = workdir / "phase1_start.json"
    if path.exists() and meta.exists():
        net.load_state_dict(_stage_file(path))
        info = json.loads(meta.read_text())
    else:
        t0 = time.perf_counter()
        g = torch.Generator().manual_seed(cfg.seed)
        directions = [mlp_directions(model, i, net.depth * net.rank, g) for i in report.layers]
        X, Y = train.first(cfg.start_tokens)
        with tqdm(total=net.n, desc="DLR closed-form start", unit="layer", disable=not progress) as bar:
            closed_form_start(net, X, Y, directions, cfg.start_ridge, bar)
        del X, Y
        heldout = _validate(net, val)
        worse = [j for j, e in enumerate(heldout.tolist()) if not e < START_MAX_ERROR]
        if worse:  # a start that brings a layer little nearer than the identity: that layer starts at the identity
            fresh = StackedDLR(net.n, net.d, net.rank, net.depth, net.eps, seed=cfg.seed)
            with torch.no_grad():
                for name in ("D", "U", "norm", "alpha"):
                    getattr(net, name)[worse] = getattr(fresh, name)[worse].to(getattr(net, name).device)
            heldout[worse] = 1.0
        info = {"seconds": time.perf_counter() - t0, "heldout": {i: float(e) for i, e in zip(report.layers, heldout)},
                "identity_layers": [report.layers[j] for j in worse]}
        save_file({k: v.detach().cpu().contiguous() for k, v in net.state_dict().items()}, str(path) + ".tmp")
        os.replace(str(path) + ".tmp", path)
        atomic_write_text(meta, json.dumps(info))
        info = json.loads(meta.read_text())
    report.start_seconds = info["seconds"]
    report.start_relative_error = {int(k): v for k, v in info["heldout"].items()}
    report.start_identity_layers = info["identity_layers"]


def phase1(model: nn.Module, blocks: Tensor, cfg: DLRConfig, workdir: Path, progress: bool = True,
           device: str | torch.device = "cpu") -> tuple[dict[int, DLRNet], DLRReport]:
    """Capture and module-wise distillation. Returns layer -> trained DLRNet and the report."""
    layers, depth, budget = plan(model, cfg)
    d = find_sites(model).config.hidden_size
    dtype = getattr(torch, cfg.capture_dtype)
    cap = capture_mlp_io(model, blocks, layers=layers, batch_size=capture_batch(len(blocks)),
                         out_dir=workdir / "capture", dtype=dtype, progress=progress)
    train_chunks, val_chunks = split_chunks(cap.n_chunks, cfg.phase1_val_fraction)
    train = _CapturedSet(cap, layers, train_chunks, cfg.memory_limit_gb)
    val = _CapturedSet(cap, layers, val_chunks, cfg.memory_limit_gb)
    net = StackedDLR(len(layers), d, cfg.rank, depth, cfg.eps, seed=cfg.seed).to(device)
    forward = _compiled(net) if cfg.compile else net
    done = workdir / "phase1.safetensors"
    report = DLRReport(layers=layers, depth=depth, rank=cfg.rank, params_mlp=budget,
                       params_dlr=depth * (2 * d * cfg.rank + d + 1), capture_tokens=cap.n_tokens)
    settings = {"capture": json.loads((workdir / "capture" / "capture.json").read_text())["fingerprint"],
                "layers": layers, "depth": depth, **{k: getattr(cfg, k) for k in (
                    "rank", "eps", "phase1_steps", "phase1_lr", "phase1_tokens", "phase1_weight_decay",
                    "phase1_val_fraction", "seed")}}
    # (absent for the paper's recipe, so work folders made with it before these options existed still resume)
    if cfg.phase1_loss != "relative":
        settings["phase1_loss"] = cfg.phase1_loss
    if cfg.phase1_hard_fraction:
        settings["phase1_hard_fraction"] = cfg.phase1_hard_fraction
    if cfg.phase1_start != "identity":
        settings.update(phase1_start=cfg.phase1_start, start_tokens=cfg.start_tokens, start_ridge=cfg.start_ridge)
    if _stage(workdir, "phase1", settings):
        state = _stage_file(done)
        net.load_state_dict(state)
        meta = json.loads((workdir / "phase1.json").read_text())
        report.phase1_history, report.phase1_seconds = meta["history"], meta["seconds"]
        report.start_seconds = meta.get("start_seconds", 0.0)
        report.start_relative_error = {int(k): v for k, v in meta.get("start_relative_error", {}).items()}
        report.start_identity_layers = meta.get("start_identity_layers", [])
    else:
        if cfg.phase1_start == "closed-form":
            _start(model, net, train, val, cfg, workdir, report, progress)
        floor = train.median_update_energy().to(device) if cfg.phase1_loss == "token" else None

        def loss_fn(step: int):
            x, y = train.sample(cfg.phase1_tokens, step_rng(cfg.seed, step), cfg.phase1_hard_fraction)
            x, y = x.to(device), y.to(device)
            pred = forward(x)
            rel = relative_error(pred, x, y)
            loss = rel if floor is None else token_relative_error(pred, x, y, floor)
            return loss.sum(), {"relative_error": float(rel.detach().mean()), "loss": float(loss.detach().mean())}

        fcfg = FitConfig(steps=cfg.phase1_steps, lr=cfg.phase1_lr, weight_decay=cfg.phase1_weight_decay,
                         warmup=0.05, clip=1.0, seed=cfg.seed, log_every=10,
                         checkpoint_every=max(50, cfg.phase1_steps // 20))
        res = fit(dict(net.named_parameters()), loss_fn, fcfg, checkpoint_dir=workdir / "phase1_ckpt",
                  progress=progress, desc="DLR phase 1 (all layers)", clip_fn=_per_layer_clip(net, 1.0))
        report.phase1_history = [{k: h[k] for k in ("step", "relative_error", "loss", "time_s") if k in h}
                                 for h in res.history]
        report.phase1_seconds = res.seconds
        save_file({k: v.detach().cpu().contiguous() for k, v in net.state_dict().items()}, str(done))
        atomic_write_text(workdir / "phase1.json", json.dumps({
            "history": report.phase1_history, "seconds": res.seconds, "start_seconds": report.start_seconds,
            "start_relative_error": report.start_relative_error,
            "start_identity_layers": report.start_identity_layers}))
        _finish(workdir, "phase1")
    rel = _validate(net, val)
    report.phase1_relative_error = {i: float(r) for i, r in zip(layers, rel)}
    nets = {i: net.unstack(j) for j, i in enumerate(layers)}
    return nets, report
