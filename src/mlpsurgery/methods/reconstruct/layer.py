"""One MLP rebuilt on its calibration inputs: the pieces every data-aware compressor shares.

- `mlp_inputs`: what the MLP itself sees (the pre-norm applied to the residual stream the capture records);
- `second_moment`: XᵀX / n in float64, summed in chunks;
- `refit_module_`: the down projection of a narrowed DenseMLP / FusedMLP refit to the original MLP's output
  (refit.py); a FusedMLP keeps P stand-alone (the refit solves for P W~2 and divides P back out, so the forward is the
  refit one while the gradient keeps the paper's form);
- `whitened_svd_`: every projection of an MLP replaced by its whitened truncated SVD (whiten.py) at the rank the
  svd baseline gives it: up / gate in the metric of the MLP inputs, down refit to the original output and truncated
  in the metric of the new inner activations (reduced-rank regression)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ...modules.fused import TruncatedSVDLinear
from ...errors import MLPSurgeryError
from ...sites import MLPSite, MLPWeights, linear_weight
from .refit import RIDGE, refit_down, refit_stats, solve_down
from .local import LOCAL_LR, subblock_rows, tune_local_
from .whiten import whitened_factors

CHUNK = 4096


def mlp_inputs(site: MLPSite, x: Tensor) -> Tensor:
    """(n, d) float32: the MLP's own inputs for residual-stream rows x (the pre-norm applied where there is one)."""
    norm = site.pre_norm
    if norm is None:
        return x.float()
    p = next(norm.parameters(), None)
    with torch.no_grad():
        return torch.cat([norm(x[s:s + CHUNK].to(p if p is not None else x)).float() for s in range(0, len(x), CHUNK)])


def second_moment(x: Tensor, fn=None) -> Tensor:
    """XᵀX / n (float64) of the rows x (n, in), or of fn(x) computed chunk by chunk."""
    total, n = None, 0
    with torch.no_grad():
        for s in range(0, len(x), CHUNK):
            a = x[s:s + CHUNK] if fn is None else fn(x[s:s + CHUNK])
            a = a.double().cpu()
            total = a.T @ a if total is None else total + a.T @ a
            n += len(a)
    return total / max(n, 1)


def obs_path(w: MLPWeights, xin: Tensor, k: int, snapshots: dict | None = None):
    """The greedy structured-OBS path (obs.py) of the MLP `w` from h neurons down to k, on its inputs xin: the second
    moment of its inner activations, and their mean where the down projection has a bias."""
    from .obs import obs_prune

    xin = xin.to(w.up)
    a_mean = None
    if w.down_bias is not None:
        with torch.no_grad():
            a_mean = sum(w.inner(xin[s:s + CHUNK]).double().sum(0).cpu() for s in range(0, len(xin), CHUNK)) / len(xin)
    return obs_prune(second_moment(xin, w.inner), w.down.cpu(), k,
                     bias=None if w.down_bias is None else w.down_bias.cpu(), a_mean=a_mean, snapshots=snapshots)


def refit_module_(module: nn.Module, target: MLPWeights, xin: Tensor, ridge: float = RIDGE,
                  y: Tensor | None = None, a: Tensor | None = None) -> dict:
    """Refit the down projection (and its bias) of a DenseMLP or FusedMLP in place to `target`'s output on the MLP
    inputs xin (or to the rows y; a: the module's inner activations on xin where the caller has them). Returns the
    relative output error before and after on xin."""
    new = module.to_mlp_weights()  # (a FusedMLP's P folded into the down projection)
    fitted, info = refit_down(new, target, xin, ridge, y=y, a=a)
    if info["refit"]:
        D = fitted.down
        P = getattr(module, "P", None)
        if P is not None:
            D = D / P.to(D)[None, :]
        with torch.no_grad():
            module.down.weight.copy_(D.to(module.down.weight))
            if fitted.down_bias is not None:
                module.down.bias.copy_(fitted.down_bias.to(module.down.bias))
    return info


def refit_site_(site: MLPSite, target: MLPWeights, xin: Tensor, ridge: float = RIDGE) -> dict:
    """Refit the down projection (and its bias) of the narrowed stock MLP at `site` in place to `target`'s output on
    the MLP inputs xin (kept only where it fits better: refit.py). Returns the relative output error before and
    after."""
    fitted, info = refit_down(site.read(), target, xin, ridge)
    if info["refit"]:
        site.write(fitted)
    return info


def whitened_svd_(site: MLPSite, rank_of, xin: Tensor, refit: bool = True) -> list[dict]:
    """Replace each projection of the (stock) MLP at `site` by its whitened truncated SVD at rank rank_of(out, in),
    fitted on the MLP inputs xin; returns per projection its shape, rank and relative truncation error.

    up / gate (Phi-3's gate_up) are factorised in the metric of xin. The down projection then, with refit, is the
    reduced-rank regression of the original MLP's output on the inner activations the truncated up / gate produce:
    the least-squares down projection on them, truncated in their metric (the best rank-r map from what the layer now
    computes to what it computed); without refit, the original down projection in the metric of the original inner
    activations."""
    w = site.read()
    xin = xin.to(w.up)
    C_in = second_moment(xin)
    ranks = []

    def replace(role: str, mod: nn.Module, weight: Tensor, bias: Tensor | None, C: Tensor) -> None:
        out_f, in_f = weight.shape
        rank = rank_of(out_f, in_f)
        B, A, sig = whitened_factors(weight, C)
        site.replace_linear(role, TruncatedSVDLinear.from_factors(B[:, :rank], A[:rank], bias, like=weight,
                                                                  dense_class=type(mod).__name__))
        e = sig.double() ** 2
        ranks.append({"projection": role, "shape": [out_f, in_f], "rank": rank,
                      "truncation_error": float(e[rank:].sum() / e.sum().clamp_min(1e-300))})

    linears = site.linears()
    for role, mod in linears.items():
        if role != "down":
            weight, bias = linear_weight(mod)
            replace(role, mod, weight, bias, C_in)
    down = linears["down"]
    weight, bias = linear_weight(down)
    if not refit:
        replace("down", down, weight, bias, second_moment(xin, w.inner))
        return ranks
    now = site.read()  # the truncated up / gate (the down projection still the original)
    stats = refit_stats(now, w, xin)
    D, b = solve_down(stats, bias is not None)
    replace("down", down, D.to(weight), None if b is None else b.to(weight), stats.G / max(stats.n, 1))
    ranks[-1]["refit"] = True
    return ranks


def refit_model_(model: nn.Module, original: nn.Module, calib: Tensor, layers: list[int],
                 progress: bool = False, local_epochs: float = 0.0, local_lr: float | None = None,
                 seed: int = 0, attn_layers=()) -> dict[int, dict]:
    """Refit, in sequence, the down projection of each chosen (narrowed) MLP of `model`, a compressed copy of
    `original`, to the original MLP's output on the inputs `model` itself produces there (sequential calibration):
    the compensation for a compressor that narrows without data (Fisher blocks, a random subnet). In place; returns
    each layer's relative output error before and after on its calibration inputs. local_epochs > 0: each layer is
    then tuned on its rows toward the original sub-block's output (local.py) before the next is calibrated; its
    record under "local". attn_layers: the layers whose attention `model` holds with heads cut out, each one's
    output projection refit first (attention.py), in the same walk; their errors under {layer: {"attention": ...}}."""
    from ...sites import find_sites
    from .attention import refit_output_
    from .sequential import sequential

    sites, originals = find_sites(model), find_sites(original)
    attention: dict[int, dict] = {}

    def attn_work(i: int, c: Tensor, y: Tensor) -> None:
        attention[i] = refit_output_(sites.attn[i], c, y)

    def work(i: int, x: Tensor) -> dict:
        site, target = sites.mlp[i], originals.mlp[i].read()
        xin = mlp_inputs(site, x)
        if site.replaced:
            if not hasattr(site.module, "to_mlp_weights") or not hasattr(site.module, "down"):
                raise MLPSurgeryError(f"layer {i}: {type(site.module).__name__} has no down projection to refit")
            info = refit_module_(site.module, target, xin)
        else:
            info = refit_site_(site, target, xin)
        if local_epochs > 0:
            goal = subblock_rows(originals.mlp[i], x)
            info["local"] = tune_local_(site, x, goal, local_epochs, local_lr or LOCAL_LR, seed=seed + i)
        return info

    fitted = sequential(model, calib, layers, work, progress=progress, desc="refit", attn_layers=attn_layers,
                        attn_work=attn_work, original=original)
    for i, info in attention.items():
        fitted.setdefault(i, {})["attention"] = info
    return fitted


def refit_narrowed_(model: nn.Module, original: nn.Module, calib: Tensor, what: str = "the model",
                    progress: bool = False) -> dict[int, dict]:
    """`refit_model_` on every MLP that `model` (a narrowed copy of `original`: a cut-out subnet, pruned blocks) has
    narrower than `original` has it, and on every attention it holds with fewer heads (its output projection).
    Returns {layer: {"error_before", "error_after"}} for the MLPs and {layer: {"attention": {...}}} for the attention
    (both where both were narrowed); refused when `what` narrowed neither (there is nothing to refit)."""
    from ...sites import find_sites
    from .attention import narrowed_attention

    new, old = find_sites(model), find_sites(original)
    layers = [s.index for s in new.mlp if s.h < old.mlp[s.index].h]
    heads = narrowed_attention(model, original)
    if not layers and not heads:
        raise MLPSurgeryError(f"{what} narrowed no MLP and cut no attention head: there is nothing to refit; drop "
                              "the refit")
    fitted = refit_model_(model, original, calib, layers, progress=progress, attn_layers=heads)
    keys = ("error_before", "error_after", "attention")
    return {i: {k: fitted[i][k] for k in keys if k in fitted[i]} for i in sorted(fitted)}
