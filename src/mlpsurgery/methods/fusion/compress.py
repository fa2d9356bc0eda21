"""One site, one method: an MLP compressed to width k by fusion or one of its baselines (the module docstring of
the package lists them)."""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import Tensor, nn

from ...errors import MLPSurgeryError
from ...modules.dense import DenseMLP
from ...modules.fused import FusedMLP, TruncatedSVDLinear
from ...sites import MLPSite, MLPWeights, linear_weight
from .config import FusionConfig
from .kmeans import _sq_dist, kmeans
from .neurons import cluster_means, neuron_vectors, weights_from_neurons


def draw_layer(h: int, k: int, cfg: FusionConfig, gen: torch.Generator) -> dict:
    """Everything `compress_site` draws from the run's generator `gen` for one MLP of inner width h compressed to
    k, in the order it draws it: the k-means seed (fusion, cluster), the sketch S (h, k), the MMD's median
    subsample and starting neurons, the random neurons kept; nothing for svd, magnitude and neuron. The draws
    depend on (h, k, cfg) alone, never on the weights, so a rank that leaves a layer to another under torchrun
    takes them without the layer's work (k-means): its generator stays one process's for the layers after."""
    method = cfg.method
    if method in ("fusion", "cluster"):
        return {"kmeans_seed": int(torch.randint(2**31 - 1, (1,), generator=gen))}
    if method == "sketch":
        return {"sketch": torch.randn(h, k, generator=gen, dtype=torch.float64) / math.sqrt(k)}
    if method == "mmd":
        return {"mmd": mmd_draws(h, k, gen)}
    if method == "random":
        return {"keep": torch.randperm(h, generator=gen)[:k].sort().values}
    return {}


def mmd_draws(h: int, k: int, gen: torch.Generator) -> tuple[Tensor, Tensor]:
    """The MMD support's random choices among h neurons: the (up to 1,024) whose distances set the kernels'
    median bandwidth, and the k it starts from."""
    return torch.randperm(h, generator=gen)[:min(h, 1024)], torch.randperm(h, generator=gen)[:k]


def _mmd_support(vectors: Tensor, k: int, steps: int, lr: float,
                 draws: tuple[Tensor, Tensor]) -> tuple[Tensor, float]:
    """k support vectors minimising MMD² to the empirical distribution of `vectors` (h, dim), with a sum of
    Gaussian kernels at 0.5, 1 and 2 times the median squared distance. Initialised at k random neurons.
    draws: `mmd_draws(h, k, gen)`."""
    x = vectors.float()
    x_sq = x.pow(2).sum(1)
    pick, start = draws
    if len(start) != k:
        raise MLPSurgeryError(f"internal: MMD drawn for {len(start)} support vectors, asked for {k}")
    sub = x[pick.to(x.device)]
    med = float(_sq_dist(sub, sub.pow(2).sum(1), sub).median().clamp_min(1e-12))
    gammas = [1.0 / (s * med) for s in (0.5, 1.0, 2.0)]

    def kern(a: Tensor, a_sq: Tensor, b: Tensor) -> Tensor:
        d = _sq_dist(a, a_sq, b)
        return sum(torch.exp(-g * d) for g in gammas)

    k_xx = float(kern(x, x_sq, x).mean())
    y = nn.Parameter(x[start.to(x.device)].clone())
    scale = float(x.std())
    opt = torch.optim.Adam([y], lr=lr * scale)
    mmd = float("nan")
    for step in range(steps + 1):
        y_sq = y.pow(2).sum(1)
        loss = k_xx + kern(y, y_sq, y).mean() - 2 * kern(x, x_sq, y).mean()
        mmd = float(loss.detach())
        if step == steps:
            break
        opt.zero_grad()
        loss.backward()
        opt.step()
    return y.detach(), mmd


FEATURE_ROWS = 4096  # calibration rows whose activations describe a neuron for the clustering


def _activation_features(w: MLPWeights, xin: Tensor, inner: Tensor | None = None) -> Tensor:
    """(h, m): each neuron's contribution on m <= FEATURE_ROWS calibration rows (its activation times the norm of its
    output weights), the rows evenly spaced through xin: k-means on these merges neurons whose contributions to the
    output move together, which the refit can then carry with one down column (on SmolLM2 at half width, 159.7 ->
    58.3 against the weight vectors of the paper, docs/fusion.md). inner: w's activations on xin where the caller
    holds them."""
    idx = torch.linspace(0, len(xin) - 1, min(len(xin), FEATURE_ROWS)).long()
    with torch.no_grad():
        a = (w.inner(xin[idx].to(w.up)) if inner is None else inner[idx.to(inner.device)]).float()
    return (a * w.down.float().norm(dim=0)[None, :]).T.contiguous()


def _importance(w: MLPWeights, x: Tensor | None, kind: str = "activation", inner: Tensor | None = None) -> Tensor:
    """(h,) neuron scores: on x (MLP inputs) the mean |activation| (kind 'activation') or its root mean square (kind
    'output': with the norm below, the energy the neuron alone adds to the output) or, without data, the product of
    the neuron's input-weight norms; times the norm of its output weights in every case. inner: w's activations on x
    (n, h) where the caller holds them."""
    out_norm = w.down.float().norm(dim=0)
    if x is not None:
        def part(a: Tensor) -> Tensor:
            a = a.float()
            return (a.abs() if kind == "activation" else a * a).sum(0, keepdim=True)

        rows = (lambda s: w.inner(x[s:s + 4096].to(w.up))) if inner is None else (lambda s: inner[s:s + 4096])
        acts = torch.cat([part(rows(s)) for s in range(0, len(x), 4096)]).sum(0) / len(x)
        return (acts if kind == "activation" else acts.sqrt()) * out_norm
    score = torch.cat([w.up, w.up_bias[:, None]], 1).float().norm(dim=1) if w.up_bias is not None \
        else w.up.float().norm(dim=1)
    if w.gated:
        score = score * w.gate.float().norm(dim=1)
    return score * out_norm


def _svd_(site: MLPSite, k: int, h: int) -> list[dict]:
    """Replace each MLP projection by its truncated SVD keeping k/h of its weights."""
    if site.replaced:
        raise MLPSurgeryError(f"layer {site.index}: the svd baseline factorises the stock projections, and this MLP was "
                              f"replaced by {type(site.module).__name__}; apply svd first")
    ranks = []
    for role, mod in site.linears().items():
        weight, bias = linear_weight(mod)
        out_f, in_f = weight.shape
        rank = svd_rank(out_f, in_f, k, h)
        site.replace_linear(role, TruncatedSVDLinear.from_weight(weight, bias, rank, dense_class=type(mod).__name__))
        ranks.append({"projection": role, "shape": [out_f, in_f], "rank": rank})
    return ranks


def cluster_kind(cfg: FusionConfig, calibrated: bool) -> str:
    """What fusion / cluster's k-means runs on: 'auto' is the neurons' activations with calibration data, their
    weight vectors (the paper's) without."""
    if cfg.cluster_on == "auto":
        return "activations" if calibrated else "weights"
    return cfg.cluster_on


def importance_kind(cfg: FusionConfig, calibrated: bool) -> str:
    """The neuron score cfg asks for: 'auto' is the output energy with calibration data (on SmolLM2 as good as the
    structured OBS selection and several times faster: docs/frontier.md), the weights without."""
    if cfg.importance == "auto":
        return "output" if calibrated else "weight"
    return cfg.importance


def _obs_keep(w: MLPWeights, xin: Tensor, k: int, info: dict) -> Tensor:
    """The k neurons the greedy structured OBS keeps (methods/reconstruct/obs.py) on MLP inputs xin."""
    from ..reconstruct.layer import obs_path

    path = obs_path(w, xin, k)
    info["obs_error"] = path.error[-1]
    return path.kept(w.h).to(w.up.device)


def compress_site(site: MLPSite, k: int, cfg: FusionConfig, gen: torch.Generator,
                  x: Tensor | None = None, progress: bool = False, calib: Tensor | None = None,
                  target: Tensor | None = None) -> dict:
    """Compress one MLP with cfg.method to width k (in place, through the site). x: captured residual-stream rows
    entering the sub-block (for a data-scored neuron importance). calib: the same for the data-aware mode (`fuse`
    with calibration data): neurons scored on them (importance 'auto'), svd whitened in their metric (cfg.whiten),
    and the down projection refit to the original MLP's output on them (cfg.refit; every method that narrows the
    MLP); target: rows (n, d) the refit aims at instead of the original MLP's output on calib. Returns what was done
    (for the report). Draws from `gen` what `draw_layer` draws, and nothing else."""
    from ..reconstruct.layer import mlp_inputs, refit_module_, whitened_svd_
    from ..reconstruct.refit import inner_rows, outputs_from_inner

    w = site.read()
    h = w.h
    xin = None if calib is None else mlp_inputs(site, calib)
    if x is None and calib is not None:
        x = calib
    if not 1 <= k <= h:
        raise MLPSurgeryError(f"layer {site.index}: width must be between 1 and the MLP's inner width {h}, got {k}")
    drawn = draw_layer(h, k, cfg, gen)
    info: dict = {"layer": site.index, "h": h, "width": k, "params_before": w.num_params()}
    device = torch.device(cfg.device) if cfg.device else w.up.device
    method = cfg.method
    refit_rows: dict = {}  # the refit's rows where the method computed them anyway (a: the new inner, y: the target)
    if method in ("fusion", "cluster"):
        vec = neuron_vectors(w).float()
        feats = vec
        info["cluster_on"] = cluster_kind(cfg, xin is not None)
        if info["cluster_on"] == "activations":  # neurons that contribute alike on the calibration rows are merged
            if xin is None:
                raise MLPSurgeryError("clustering on activations needs calibration data: give it, or cluster on weights")
            # the original's activations on every calibration row where they fit: the features take their rows,
            # the refit the original's outputs (its gate / up would run again for them)
            acts = inner_rows(w, xin) if cfg.refit and target is None else None
            feats = _activation_features(w, xin, inner=acts)
            if acts is not None:
                refit_rows = {"y": outputs_from_inner(w, acts)}
                del acts
        km = kmeans(feats, k, n_init=cfg.n_init, max_iter=cfg.max_iter, tol=cfg.tol,
                    seed=drawn["kmeans_seed"], device=device, progress=progress)
        centroids, P = cluster_means(vec.to(km.labels.device), km.labels, k)
        fused = weights_from_neurons(centroids.to(w.up.device), w)
        info.update(inertia=km.inertia, kmeans_iterations=km.n_iter,
                    cluster_sizes={"min": int(P.min()), "max": int(P.max()), "singletons": int((P == 1).sum())})
        if method == "fusion":
            module = FusedMLP.from_centroids(fused, P)
        else:
            root = P.sqrt().to(w.up)
            side = "gate" if w.gated else "up"
            fused = dataclasses.replace(fused, **{side: getattr(fused, side) * root[:, None],
                                                  f"{side}_bias": None if getattr(fused, f"{side}_bias") is None
                                                  else getattr(fused, f"{side}_bias") * root,
                                                  "down": fused.down * root[None, :]})
            module = DenseMLP.from_weights(fused)
    elif method == "sketch":
        rows = drawn["sketch"].T.to(device) @ neuron_vectors(w).double().to(device)  # Sᵀ W: (k, dim)
        module = DenseMLP.from_weights(weights_from_neurons(rows.to(w.up.device), w))
    elif method == "mmd":
        rows, mmd = _mmd_support(neuron_vectors(w).to(device), k, cfg.mmd_steps, cfg.mmd_lr, drawn["mmd"])
        sw = weights_from_neurons(rows.to(w.up.device), w)
        module = DenseMLP.from_weights(dataclasses.replace(sw, down=sw.down * (h / k)))
        info["mmd2"] = mmd
    elif method in ("neuron", "random"):
        # the original's activations on the calibration rows, held where they fit (`inner_rows`): the score reads
        # them, and the refit takes the kept neurons' columns and the original's outputs from them, so neither MLP's
        # gate / up runs again
        acts = inner_rows(w, xin) if xin is not None and cfg.refit else None
        if method == "neuron":
            kind = importance_kind(cfg, calib is not None)
            if kind != "weight" and x is None:
                raise MLPSurgeryError(f"importance {kind!r} scores neurons on text: give calibration or tune data")
            scored = None if kind == "weight" else (xin if x is calib else mlp_inputs(site, x.to(w.up)))
            if kind == "obs":
                keep = _obs_keep(w, scored, k, info)
            else:
                keep = _importance(w, scored, kind, inner=acts if scored is xin else None) \
                    .argsort(descending=True)[:k].sort().values
            info["importance"] = kind
        else:
            keep = drawn["keep"]
        module = DenseMLP.from_weights(w.select(keep))
        info["kept_neurons"] = keep.tolist() if k <= 64 else f"{k} of {h}"
        if acts is not None:
            refit_rows = {"a": acts[:, keep.to(acts.device)],
                          "y": outputs_from_inner(w, acts) if target is None else target}
            del acts
    elif method == "svd":
        if xin is not None and cfg.whiten:
            if site.replaced:
                raise MLPSurgeryError(f"layer {site.index}: the svd baseline factorises the stock projections, and "
                                      f"this MLP was replaced by {type(site.module).__name__}; apply svd first")
            info["ranks"] = whitened_svd_(site, lambda o, i: svd_rank(o, i, k, h), xin, refit=cfg.refit)
            info["whitened"] = True
        else:
            info["ranks"] = _svd_(site, k, h)
        module = None
    else:  # magnitude: fuse() zeroes the smallest weights in place (methods/pruning/magnitude.py); the shape stays
        module = None
    if module is not None:
        module.to(device=w.up.device, dtype=w.up.dtype)
        if xin is not None and cfg.refit:
            info["refit"] = refit_module_(module, w, xin, y=refit_rows.get("y", target), a=refit_rows.get("a"))
        site.replace_mlp(module)
    return info


def svd_rank(out_f: int, in_f: int, k: int, h: int) -> int:
    """The rank at which a factored (out, in) projection keeps k/h of its weights."""
    return max(1, (out_f * in_f * k // h) // (out_f + in_f))

