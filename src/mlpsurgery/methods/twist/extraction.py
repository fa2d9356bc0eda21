"""Deployment: one random subnet cut out as a physically smaller dense model, the activation shift folded into
its output projections (no data, no search); optionally its narrowed MLPs' down projections and its narrowed attention's
output projections refit on calibration text (`refit_subnet_`)."""

from __future__ import annotations

import torch
from torch import nn

from ...io import history as method_history
from ...io import record
from ...subsets import subset_model
from ...sites import find_sites
from .blocks import Layout, Subnet, make_layout
from .config import TwISTConfig


def trained_settings(model: nn.Module) -> dict:
    """The TwIST / data-parallel settings recorded in the model's history (the last run), or {}."""
    for entry in reversed(method_history(model)):
        if entry.get("method") in ("twist", "data-parallel"):
            return dict(entry.get("config", {}))
    return {}


def _scale_output(site, weight: str, bias: str, f: float) -> None:
    """Multiply a site's output projection (`weight` and `bias` of its canonical weights) by f, in place."""
    if f == 1.0:
        return
    w = site.read()
    getattr(w, weight).mul_(f)
    if getattr(w, bias) is not None:
        getattr(w, bias).mul_(f)
    site.write(w)


def materialize(model: nn.Module, layout: Layout, subnet: Subnet, rescale: bool = True,
                consume: bool = False) -> nn.Module:
    """The physically smaller dense model of `subnet`, sqrt(N_full/N_sub) folded into the output projections.
    consume=True: `model`'s layers are released as the subnet's are made (`subset_model`), so the two are not
    whole in memory together; `model` is unusable after."""
    new = subset_model(model, *layout.subset_args(subnet), consume=consume)
    if rescale:
        rescale_subnet(find_sites(new), layout, subnet)
    return new


def deployment(model: nn.Module, keep: int, blocks: int | None = None, parts: str | None = None,
               attn_keep: int | None = None, layers=None, shared_first: int | None = None,
               shared_last: int | None = None, seed: int = 0) -> tuple[Layout, Subnet, dict]:
    """The layout, the subnet `twist_extract` cuts out and the settings it records (shapes and the model's history
    only: `model` may be a skeleton)."""
    trained = trained_settings(model)
    base = TwISTConfig(**{k: v for k, v in trained.items() if k in TwISTConfig.__dataclass_fields__})
    blocks = blocks or base.blocks
    parts = parts or base.parts
    n_layers = len(find_sites(model))
    if layers is None:
        first = base.shared_first if shared_first is None else shared_first
        last = base.shared_last if shared_last is None else shared_last
        layers = list(range(first, n_layers - last))
    layout = make_layout(model, parts, layers, blocks, keep, attn_keep, base.common_attn, base.common_ffn)
    subnet = layout.deployment(torch.Generator().manual_seed(seed))
    return layout, subnet, {"keep": keep, "blocks": blocks, "parts": parts, "attn_keep": attn_keep, "layers": layers}


def rescale_subnet(sites, layout: Layout, subnet: Subnet, layers=None) -> None:
    """sqrt(N_full/N_sub) folded into the output projections of the subnet's layers (of `layers` only, if given)."""
    for i in subnet.attn:
        if layers is None or i in layers:
            _scale_output(sites.attn[i], "o", "o_bias", layout.attn_scale(i))
    for i in subnet.mlp:
        if layers is None or i in layers:
            _scale_output(sites.mlp[i], "down", "down_bias", layout.mlp_scale())


def twist_extract(model: nn.Module, keep: int, blocks: int | None = None, parts: str | None = None,
                  attn_keep: int | None = None, layers=None, shared_first: int | None = None,
                  shared_last: int | None = None, seed: int = 0, rescale: bool = True, consume: bool = False
                  ) -> nn.Module:
    """Deploy one random subnet at kappa = keep / blocks as a physically smaller dense model (no data, no search).

    Unset settings come from the model's TwIST (or data-parallel) training record, else TwISTConfig's defaults:
    R = blocks, parts, shared first / last layers (or an explicit `layers` list), the common sets. The subnet
    holds C plus random blocks drawn with `seed`. Where every layer ends with the same widths the result is a
    stock transformers model; with shared layers kept whole it is saved and reloaded through mlpsurgery.save/load.
    consume=True: `model` is given up layer by layer as the subnet is built (`materialize`): the peak is about one
    model, not the model and its subnet. The layer-sequential form, from the folder: `twist/layerwise.py`.
    """
    layout, subnet, settings = deployment(model, keep, blocks, parts, attn_keep, layers, shared_first, shared_last,
                                          seed)
    new = materialize(model, layout, subnet, rescale=rescale, consume=consume)
    record(new, "twist-extract", {**settings, "rescale": rescale}, seed=seed, subnet=subnet.as_dict())
    return new


def refit_subnet_(subnet: nn.Module, original: nn.Module, calib: torch.Tensor, progress: bool = True) -> dict:
    """The closed-form compensation of a cut-out subnet (as every width-reducing method of the package has): the down
    projection of each MLP the subnet narrowed, and the output projection of each attention it holds with fewer
    heads, refit by ridge least squares, layer after layer, to the original's output there on the inputs the subnet
    itself produces (methods/reconstruct/layer.py `refit_model_`, attention.py; sequential calibration on `calib`,
    (N, T) token ids). In place. Returns {layer: relative output error before / after} (the attention's under
    "attention") and records the refit."""
    from ..reconstruct.layer import refit_narrowed_

    errors = refit_narrowed_(subnet, original, calib, what="the subnet", progress=progress)
    kind, config, provenance = refit_entry(errors, calib)
    record(subnet, kind, config, **provenance)
    return errors


def refit_entry(errors: dict, calib: torch.Tensor) -> tuple[str, dict, dict]:
    """(kind, config, provenance) of the history entry of a subnet's refit (whole model and layer by layer)."""
    return ("twist-refit", {"layers": list(errors), "attention": [i for i, e in errors.items() if "attention" in e]},
            {"calib_tokens": int(calib.numel()), "calib_blocks": list(calib.shape)})
