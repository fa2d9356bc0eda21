"""Layer-wise task-specific tuning (paper §4.4) of the compressed MLPs on the original's captured inputs and outputs,
split by layer under torchrun."""

from __future__ import annotations

import copy
import math
from dataclasses import asdict

import torch
from torch import Tensor, nn

from ...errors import MLPSurgeryError
from ...sites import find_sites
from ...train import FitConfig, fit, step_rng
from .config import FusionConfig


def site_params(model: nn.Module, layers: list[int]) -> dict[str, nn.Parameter]:
    """name -> parameter of the MLPs at `layers` (whatever module now computes them)."""
    names = {id(p): n for n, p in model.named_parameters()}
    sites = find_sites(model)
    return {names[id(p)]: p for i in layers for p in sites.mlp[i].parameters()}


def site_tensor_names(model: nn.Module, layers: list[int]) -> list[str]:
    """The state-dict names of everything the MLPs at `layers` hold now (parameters and buffers: cluster sizes,
    masks), whatever module computes them."""
    prefix = {id(m): n for n, m in model.named_modules()}
    sites = find_sites(model)
    return [f"{prefix[id(m)]}.{name}" for i in layers for m in sites.mlp[i].modules() for name in m.state_dict()]


def compressed_digest(model: nn.Module, layer: int) -> str:
    """A digest of a compressed MLP as a resumed tuning must find it: its modules' classes, every tensor's name,
    dtype and shape, and the values of what a checkpoint does not restore (buffers: cluster sizes, masks); the
    parameters' values are the checkpoint's to restore."""
    from ...files import Fingerprint

    mods = find_sites(model).mlp[layer].modules()
    fp = Fingerprint(model, skip={f"{j}.{n}" for j, m in enumerate(mods) for n, _ in m.named_parameters()})
    for j, m in enumerate(mods):
        fp.add(f"{j}:{type(m).__name__}", torch.empty(0))
        for n, t in m.state_dict().items():
            fp.add(f"{j}.{n}", t)
    return fp.hexdigest()


def layers_of_every_rank(model: nn.Module, own: list[int], layers: list[int] | None) -> tuple[list[str], list[str]]:
    """The names of the tuned parameters and the digests (`compressed_digest`) of the compressed MLPs, layer by layer
    in one process's order: of `own` in one process (layers None); under torchrun, where each rank compressed only
    its share `own` of `layers`, every rank's, gathered from their owners."""
    from ... import parallel

    mine = {i: (list(site_params(model, [i])), compressed_digest(model, i)) for i in own}
    if layers is None:
        by_layer, layers = mine, own
    else:
        by_layer = {}
        for part in parallel.all_gather(mine):
            by_layer.update(part)
    return [n for i in layers for n in by_layer[i][0]], [by_layer[i][1] for i in layers]


def tune_layers(model: nn.Module, capture, layers: list[int], cfg: FusionConfig, progress: bool = True,
                checkpoint_dir=None, settings: dict | None = None, partition: list[int] | None = None) -> dict:
    """Layer-wise task-specific tuning: minimise sum over layers of MSE(compressed MLP sub-block output,
    original output) on the captured original inputs, training only the compressed MLPs' weights. A checkpoint
    made from another model, other layers, settings or data (`settings`: its digest) is refused.

    partition (under torchrun): every rank's layers, in order; this rank tunes `layers`, its share, on its own
    captured rows. Each layer's term of the loss depends on its own MLP alone, so the ranks' sum is one process's
    loss and gradient (mlpsurgery.train.fit, partition); the MSEs reported are the sums over the ranks."""
    from ... import parallel
    from ...files import model_fingerprint

    sites = find_sites(model)
    capture.consolidate()  # its rows once in memory, not once in chunks and once joined
    data = {i: capture.layer(i) for i in layers}
    n = len(next(iter(data.values()))[0])
    batch = min(cfg.tune_batch, n)
    steps = cfg.tune_steps if cfg.tune_steps is not None else math.ceil(n / batch)
    perm = torch.randperm(n, generator=step_rng(cfg.seed, 0, stream=7))
    device = next(model.parameters()).device
    params = site_params(model, layers)  # pruned weights keep their zeros through their masks (modules/masks.py)
    every, digests = layers_of_every_rank(model, layers, partition)
    trained = {id(q) for q in params.values()}
    frozen = [p for p in model.parameters() if p.requires_grad and id(p) not in trained]
    for p in frozen:
        p.requires_grad_(False)

    def layer_mse(idx: Tensor) -> Tensor:
        total = 0
        for i in layers:
            x, y = data[i]
            xb, yb = x[idx].to(device), y[idx].to(device)
            total = total + (sites.mlp[i].subblock(xb) - (yb - xb)).float().pow(2).mean()
        return total

    def loss_fn(step: int) -> Tensor:
        # one epoch = one pass over a fixed permutation; later epochs draw from step_rng(seed, step)
        start = (step * batch) % n
        idx = perm[start:start + batch] if start + batch <= n else \
            torch.randint(0, n, (batch,), generator=step_rng(cfg.seed, step))
        return layer_mse(idx)

    def total_mse(idx: Tensor) -> float:
        with torch.no_grad():
            mse = layer_mse(idx).detach().double().reshape(1)
        return float(parallel.sum_over_ranks(mse) if partition is not None else mse)

    probe = perm[:min(n, 4096)]
    before = total_mse(probe)
    was = model.training
    model.train()
    try:
        # the model without the tuned layers' MLPs (each rank holds only its own share compressed), and those MLPs
        # as their owners compressed them
        identity = None if checkpoint_dir is None else {
            "model": model_fingerprint(model, omit=site_tensor_names(model, partition or layers)),
            "compressed": digests, "layers": partition or layers, "fusion": asdict(cfg), **(settings or {})}
        res = fit(params, loss_fn, FitConfig(steps=steps, lr=cfg.tune_lr, seed=cfg.seed, log_every=10),
                  checkpoint_dir=checkpoint_dir, progress=progress, desc="layer-wise tuning", settings=identity,
                  partition=None if partition is None else every)
    finally:
        model.train(was)
        for p in frozen:
            p.requires_grad_(True)
    after = total_mse(probe)
    captured = sum(t.numel() * t.element_size() for pair in data.values() for t in pair)
    return {"steps": steps, "tokens": n, "batch_rows": batch, "mse_before": before, "mse_after": after,
            "seconds": res.seconds, "memory": {**res.memory, "captured_bytes": captured}}


def layer_payload(site) -> list[nn.Module]:
    """A compressed MLP's modules as another rank takes them (`install_layer`): copies on the CPU, with their
    parameters and buffers (cluster sizes, masks); a copy leaves tensor hooks behind (a mask's gradient hook is
    put back by its module's pre-hook at the next forward that can build a graph)."""
    return [copy.deepcopy(m).cpu() for m in site.modules()]


def install_layer(site, modules: list[nn.Module]) -> None:
    """Put a compressed MLP another rank sent (`layer_payload`) in place of this rank's copy of the layer's MLP (which
    may have been given back to the meta device), on the device the rest of the layer is on."""
    device = next((p.device for p in site.layer.parameters() if p.device.type != "meta"), torch.device("cpu"))
    site.set_modules([m.to(device) for m in modules])


def _gather_layers(sites, rows: list[dict], own: list[int]) -> list[dict] | None:
    """Under torchrun, where each rank compressed and tuned its share `own` of the layers: rank 0 takes every
    other rank's layers (their compressed, tuned modules, installed in place of its copies, which were given back
    to the meta device) and report rows, and returns every layer's row in layer order; None on the other ranks (a
    collective)."""
    from ... import parallel

    mine = {} if parallel.world()[0] == 0 else \
        {r["layer"]: (layer_payload(sites.mlp[r["layer"]]), r) for r in rows if r["layer"] in own}
    got = parallel.gather_to_rank0(mine)
    if got is None:
        return None
    every = {r["layer"]: r for r in rows}
    for part in got[1:]:
        for i, (modules, row) in part.items():
            install_layer(sites.mlp[i], modules)
            every[i] = row
    return [every[i] for i in sorted(every)]


def split_share(layers: list[int], tuned: bool) -> list[int]:
    """This rank's share of the compressed `layers` for the layer-wise tuning under torchrun (rank r: layers r, r+N,
    ...; all of them in one process), after refusing a split that cannot be made: no tune data (nothing to split),
    more ranks than layers. `fuse` and `fuse_layerwise` split alike."""
    from ... import parallel

    world = parallel.world()[1]
    if world > 1:
        if not tuned:
            raise MLPSurgeryError("under torchrun `fuse` splits its layer-wise tuning over the ranks by layer: give "
                                  "--tune-data, or run it as one process")
        if len(layers) < world:
            raise MLPSurgeryError(f"{world} ranks for {len(layers)} compressed layers: start at most {len(layers)} "
                                  "processes (torchrun --nproc-per-node)")
    return parallel.share(layers)

