"""MLP Fusion (Wei et al., ICML 2023): compress each chosen MLP from h to k inner neurons by clustering
its neurons, keeping the cluster sizes P as a fixed scale so that the fine-tuning dynamics (Adam NTK)
stay close to the original's; and the baselines the paper compares against, at the same width k (or
the same number of MLP weights).

An MLP is a sum of h one-neuron MLPs. Neuron i is the vector (paper's orientation, W1 (d, h), W2 (h, d)):

    plain:  w_i = [W1[:, i], b1[i], W2[i, :]]
    gated:  w_i = [W_gate[:, i], b_gate[i], W_up[:, i], b_up[i], W_down[i, :]]   (biases where present)

(gated works because the gate acts elementwise: neuron i contributes act(x·g_i)(x·u_i) d_i). k-means on
the h vectors gives a one-hot C (k, h); C̄ is C with rows normalised to sum 1, P = C Cᵀ (cluster sizes):

    W~1 = W1 C̄ᵀ,  b~1 = C̄ b1,  W~2 = C̄ W2,    H~ = act(X W~1 + b~1) P W~2 + b2       (modules/fused.py)

Methods (`FusionConfig.method`):
    fusion     the above, P stand-alone (FusedMLP)
    cluster    the same clusters with P^½ folded into both sides (W~1 P^½, P^½ b~1, P^½ W~2): the paper's
               "Clustering" ablation. For gated MLPs the input side is the gate (the branch inside act),
               as W1 is inside σ in the paper; for ReLU-like activations this gives ≈ the fused output.
    svd        truncated SVD of every MLP projection, rank chosen so each keeps k/h of its weights
    sketch     Gaussian sketching: W1 S, b1 S, Sᵀ W2 with S (h, k), entries N(0, 1/k)
    mmd        k support vectors minimising the MMD (Gaussian kernels, median bandwidth) to the h
               neuron vectors; output scaled by h/k (paper eq. 10: MMD matches means, not sums)
    magnitude  unstructured magnitude pruning to k/h of the MLP weights (methods/pruning/magnitude.py)
    neuron     keep the k most important neurons (importance = ||W_down[:, i]|| times the input norms of
               neuron i, or its mean |activation| on tune text times ||W_down[:, i]||)
    random     keep k neurons drawn at random (seeded)

Optional layer-wise task-specific tuning (paper §4.4): capture each chosen layer's MLP input and output in
the original model on task text, then minimise the sum over layers of MSE(compressed output, original
output) for one epoch (by default), updating only the compressed MLPs' weights (P stays fixed).

Files: config.py (FusionConfig), kmeans.py, neurons.py (neurons as vectors), compress.py (one site, one method),
probes.py (the output error of a compressed MLP), tuning.py (the layer-wise tuning, split by layer under torchrun),
layerwise.py (all of it one decoder layer at a time from the checkpoint's files); `fuse` below drives the whole model.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from ...capture import capture_mlp_io
from ...errors import MLPSurgeryError
from ...io import record
from ...sites import find_sites, parse_layers
from ..pruning import magnitude_prune
from .compress import _mmd_support, compress_site, draw_layer, mmd_draws
from .config import DEFAULT_LAYERS, METHODS, FusionConfig
from .kmeans import KMeansResult, kmeans
from .neurons import cluster_means, neuron_vectors, weights_from_neurons
from ..reconstruct.local import stream_target, stream_target_refusal, subblock_rows, tune_local_
from .probes import _ErrorProbes, count_after
from .tuning import _gather_layers, site_params, split_share, tune_layers

__all__ = ["DEFAULT_LAYERS", "METHODS", "FusionConfig", "KMeansResult", "_mmd_support", "cluster_means",
           "compress_site", "count_after", "draw_layer", "fuse", "kmeans", "layers_and_width", "mmd_draws",
           "neuron_vectors", "site_params", "split_share", "tune_layers", "weights_from_neurons"]


def layers_and_width(sites, cfg: FusionConfig) -> tuple[list[int], int]:
    """The layers cfg chooses and the width k they are compressed to (default a quarter of the narrowest);
    refuses a choice of no layer and a width outside 1..h."""
    layers = parse_layers(cfg.layers, len(sites), DEFAULT_LAYERS)
    if not layers:
        raise MLPSurgeryError(f"layer selection {cfg.layers!r} chose no layer of this {len(sites)}-layer model")
    for i in layers:  # a replaced MLP is compressed from its dense form (fused, nested at its rank); else refused
        if sites.mlp[i].replaced:
            sites.mlp[i].read()
    hs = {sites.mlp[i].h for i in layers}
    k = cfg.width if cfg.width is not None else min(hs) // 4
    bad = sorted(h for h in hs if not 1 <= k <= h)
    if bad:
        raise MLPSurgeryError(f"width {k} is not between 1 and the MLP inner width {bad[0]}; choose a smaller --width")
    return layers, k


def fuse(model: nn.Module, config: FusionConfig | None = None, tune_data: Tensor | None = None,
         progress: bool = True, checkpoint_dir=None, calib_data: Tensor | None = None) -> dict:
    """Compress the chosen layers' MLPs of `model` in place with config.method; tune them layer-wise on
    `tune_data` ((N, T) token blocks of task text) when given. Returns a report; records the run in the
    model's history (saved by mlpsurgery.save).

    calib_data ((N, T) token blocks): the data-aware mode. Each chosen layer is compressed on the MLP inputs of these
    blocks -- as the already-compressed layers before it produce them (cfg.calibration 'sequential', SparseGPT's
    order) or as the original model does ('original') --: neurons scored by their output energy, svd whitened, and
    the down projection of every narrowed MLP refit to the original MLP's output (methods/reconstruct). Without it
    the compression is data-free (the papers' setting). One process only (not under torchrun).

    Under torchrun (N ranks, every one holding the same model and data) the work is split by layer, as DLR-Lock's
    phase 1 is: rank r captures, compresses and tunes layers r, r+N, ... of the chosen ones (the k-means, the
    captured activations, gradients and AdamW moments of its layers only), taking for the other layers only their
    random draws (`draw_layer`), so that its generator gives each of its layers what one process draws for it,
    and giving back the memory of their original MLPs (moved to the meta device); rank 0 gathers the compressed,
    tuned layers and the report rows. The model on the other ranks is left with their own layers compressed and
    the others' MLPs on the meta device (it is not to be run)."""
    from ... import parallel
    from ...files import model_fingerprint

    cfg = config or FusionConfig()
    cfg.validate()
    sites = find_sites(model)
    layers, k = layers_and_width(sites, cfg)
    if cfg.importance == "activation" and cfg.method == "neuron" and tune_data is None:
        raise MLPSurgeryError("importance='activation' scores neurons on text: give tune data (--tune-data)")
    rank, world = parallel.world()
    if calib_data is not None:
        if world > 1:
            raise MLPSurgeryError("the data-aware fuse (calibration data) runs in one process: drop torchrun, or "
                                  "compress data-free (--data-free) and split only the tuning over the ranks")
        if cfg.method == "magnitude":
            raise MLPSurgeryError("magnitude pruning is data-free; drop the calibration data (--data-free) or use "
                                  "`prune --method wanda` / `sparsegpt` for calibrated unstructured pruning")
        return _fuse_calibrated(model, cfg, layers, k, calib_data, tune_data, progress, checkpoint_dir)
    if cfg.budget != "uniform":
        raise MLPSurgeryError("a per-layer budget is measured on calibration data: give it (--calib-data), or keep "
                              "the uniform budget")
    cfg.check_calibrated(False)
    own = split_share(layers, tune_data is not None)
    digest = None if tune_data is None else hashlib.sha256(tune_data.cpu().numpy().tobytes()).hexdigest()
    if world > 1:
        parallel.same_on_every_rank("models, data or settings",
                                    {"model": model_fingerprint(model), "data": digest, "fusion": asdict(cfg)})
    capture = None
    if tune_data is not None:  # this rank's layers' MLP inputs and outputs in the original model
        capture = capture_mlp_io(model, tune_data, layers=own, progress=progress)
    gen = torch.Generator().manual_seed(cfg.seed)
    probes = _ErrorProbes(sites, layers, capture, cfg.seed)
    rows = []
    for i in tqdm(layers, desc=f"{cfg.method}", unit="layer", disable=not progress):
        if i not in own:  # another rank's (under torchrun): only its draws, to keep this rank's generator in step
            draw_layer(sites.mlp[i].h, k, cfg, gen)
            for m in sites.mlp[i].modules():  # its original MLP, captured by its owner, is not needed here: given
                m.to("meta")  # back (rank 0 puts the owner's compressed, tuned MLP in its place)
            continue
        x = capture.layer(i)[0] if capture is not None and cfg.importance == "activation" else None
        probes.before(i)
        # k-means restarts get their own bar under the layers' bar (seconds each on a real model)
        rows.append(compress_site(sites.mlp[i], k, cfg, gen, x=x, progress=progress))
        if cfg.method == "magnitude":
            rows[-1]["pruning"] = magnitude_prune(model, 1.0 - k / rows[-1]["h"], parts="ffn", layers=[i])
        rows[-1]["error_rel"] = probes.error(i)
        count_after(sites.mlp[i], rows[-1])
    report = {"method": cfg.method, "width": k, "layers": layers, "config": asdict(cfg), "sites": rows,
              "error_inputs": probes.description}
    if capture is not None:
        capture.keep(own)
        report["tuning"] = tune_layers(model, capture, own, cfg, progress=progress, checkpoint_dir=checkpoint_dir,
                                       settings={"data": digest, "data_shape": list(tune_data.shape)},
                                       partition=layers if world > 1 else None)
        for r in rows:
            r["error_rel_tuned"] = probes.error(r["layer"])
    if world > 1:
        report["sites"] = _gather_layers(sites, rows, own) or rows
        report["world_size"] = world
    record(model, "fusion", asdict(cfg), width=k, layers=layers,
           tune_tokens=int(tune_data.numel()) if tune_data is not None else 0)
    return report


def calibrated_layer(site, width: int, cfg: FusionConfig, gen: torch.Generator, x: Tensor, probes=None,
                     target: Tensor | None = None) -> dict:
    """One chosen layer of the data-aware fuse (whole model and layer by layer alike): compressed to `width` on its
    calibration rows x (the residual stream entering its MLP sub-block), its report row with the relative output
    error measured where it was fitted -- on up to PROBE_ROWS of x, or on the tune data's captured rows (`probes`)
    when there is tune data, as the data-free fuse measures it. A layer the per-layer budget leaves whole only takes
    its draws."""
    if width == site.h:
        draw_layer(site.h, width, cfg, gen)
        row = {"layer": site.index, "h": width, "width": width, "whole": True, "error_rel": 0.0}
        count_after(site, row)
        row["params_before"] = row["params_after"]
        return row
    probe = x[torch.linspace(0, len(x) - 1, min(len(x), _ErrorProbes.PROBE_ROWS)).long()]
    with torch.no_grad():
        ref = site.subblock(probe).float()
    goal = None
    if cfg.local_epochs > 0:  # what the tuning aims at: the refit's target, else the original sub-block on x
        goal = target if target is not None else subblock_rows(site, x)
    row = compress_site(site, width, cfg, gen, progress=False, calib=x, target=target)
    count_after(site, row)
    if goal is not None:
        row["local"] = tune_local_(site, x, goal, cfg.local_epochs, cfg.local_lr, seed=cfg.seed + site.index)
        del goal
    if probes is not None:
        row["error_rel"] = probes.error(site.index)
    else:
        with torch.no_grad():
            row["error_rel"] = float((site.subblock(probe).float() - ref).norm() / ref.norm().clamp_min(1e-30))
    return row


def calibration_inputs(cfg: FusionConfig, probes) -> str:
    """The report's `error_inputs` of the data-aware fuse."""
    if probes is not None:
        return probes.description
    return (f"the calibration blocks' MLP inputs (up to {_ErrorProbes.PROBE_ROWS} token rows per layer) as the layer saw "
            "them while compressed" + (" (in the original model)" if cfg.calibration == "original" else
                                       " (after the compressed layers before it)")
            + "; reference: the original MLP on the same inputs")


def _fuse_calibrated(model: nn.Module, cfg: FusionConfig, layers: list[int], k: int, calib: Tensor,
                     tune_data: Tensor | None, progress: bool, checkpoint_dir) -> dict:
    """`fuse` with calibration data, in one process (see its docstring)."""
    from ..reconstruct.budget import plan_widths
    from ..reconstruct.sequential import sequential

    sites = find_sites(model)
    gen = torch.Generator().manual_seed(cfg.seed)
    rows: dict[int, dict] = {}
    widths = {i: k for i in layers}
    plan = None
    if cfg.budget == "per-layer":
        plan = plan_widths(model, calib, widths, progress=progress)
        widths = {p.layer: p.width for p in plan}
    original = capture = None
    if tune_data is not None:  # the original MLPs' inputs and outputs on the tune text, before any change
        capture = capture_mlp_io(model, tune_data, layers=layers, progress=progress)
    if cfg.calibration == "original":  # every layer's rows from the dense model, in one pass
        original = capture_mlp_io(model, calib, layers=layers, progress=progress, batch_size=cfg.calib_batch)

    probes = _ErrorProbes(sites, layers, capture, cfg.seed) if capture is not None else None

    def work(i: int, x: Tensor, x_ref: Tensor | None = None, y_ref: Tensor | None = None) -> None:
        # where the original stream goes, from where this is
        target = None if x_ref is None else stream_target(sites.mlp[i], x, x_ref, y_ref)
        rows[i] = calibrated_layer(sites.mlp[i], widths[i], cfg, gen, x, probes, target)

    if original is None:
        why = next(filter(None, (stream_target_refusal(sites.mlp[i]) for i in layers)), None)
        if cfg.calibration == "corrective" and why:
            raise MLPSurgeryError(f"calibration 'corrective' fits the MLP's output to a residual-stream target, and "
                                  f"{why}; use 'sequential'")
        sequential(model, calib, layers, work, batch_size=cfg.calib_batch, progress=progress, desc=cfg.method,
                   reference=cfg.calibration == "corrective")
    else:
        for i in tqdm(layers, desc=cfg.method, unit="layer", disable=not progress):
            work(i, original.layer(i)[0])
    report = {"method": cfg.method, "width": k, "layers": layers, "config": asdict(cfg),
              "sites": [rows[i] for i in layers],
              "calibration": {"mode": cfg.calibration, "blocks": list(calib.shape), "tokens": int(calib.numel())},
              "widths": {i: widths[i] for i in layers},
              "budget": None if plan is None else [asdict(p) for p in plan],
              "error_inputs": calibration_inputs(cfg, probes)}
    if capture is not None:
        report["tuning"] = tune_layers(model, capture, layers, cfg, progress=progress, checkpoint_dir=checkpoint_dir,
                                       settings={"data": _digest(tune_data), "data_shape": list(tune_data.shape),
                                                 "calibration": _digest(calib)})  # (it made the MLPs being tuned)
        for i in layers:
            rows[i]["error_rel_tuned"] = probes.error(i)
    record(model, "fusion", asdict(cfg), width=k, layers=layers, calib_tokens=int(calib.numel()),
           tune_tokens=int(tune_data.numel()) if tune_data is not None else 0)
    return report


def _digest(t: Tensor) -> str:
    return hashlib.sha256(t.cpu().numpy().tobytes()).hexdigest()
