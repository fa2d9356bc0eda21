"""MLP Fusion and its data-free baselines layer by layer from the checkpoint's files (layerwise.py).

The per-layer work is fusion.py's own (`compress_site` and the error probes on seeded random rows), run in the
same layer order with the same generators, so the folder holds what `fuse` + `save` write: the same tensors,
modules, history and source fingerprint (tests/test_layerwise_reshape.py checks them bit for bit). Only one
decoder layer is in memory at a time (`layerwise.rewrite`): it is read from the safetensors files, compressed,
appended to the output and dropped; a compressed MLP changes shape, so the output's header is written last.

Not here (refused before anything is read or written): layer-wise tuning and activation importance, which need
every layer's captured activations on tune text, and the magnitude baseline, whose masks the pruning commands'
own layer-sequential mode writes (`prune --layerwise`).
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import torch

from ..errors import MLPSurgeryError
from ..io import record
from ..layerwise import LayerStream, rewrite
from ..measure.cost import count_params
from ..sites import find_sites
from .fusion import FusionConfig, _ErrorProbes, compress_site, count_after, layers_and_width

METHODS = ("fusion", "cluster", "svd", "sketch", "mmd", "neuron", "random")


def check_layerwise(cfg: FusionConfig, tune: bool = False) -> None:
    """Refuse what the layer-sequential mode does not do, naming the way out."""
    cfg.validate()
    if cfg.method not in METHODS:
        raise MLPSurgeryError(f"the layer-sequential mode fuses with {', '.join(METHODS)}, not {cfg.method!r} "
                              "(magnitude: use `prune --layerwise --method magnitude`): drop --layerwise")
    if tune or cfg.importance == "activation":
        raise MLPSurgeryError("the layer-sequential mode compresses without tune data (layer-wise tuning and "
                              "activation importance need every layer's captured activations): drop --tune-data "
                              "and --importance activation, or drop --layerwise")


def fuse_layerwise(folder: str | Path, out: str | Path, cfg: FusionConfig, dtype=None, tokenizer=None,
                   overwrite: bool = False, inputs=(), source_name: str | None = None, progress: bool = True) -> dict:
    """Compress the checkpoint in `folder` layer by layer and save the result to `out` (what `fuse` then `save`
    write, without tune data); returns fuse's report with the parameter counts before and after."""
    check_layerwise(cfg)
    stream = LayerStream(Path(folder), dtype=dtype)
    model = stream.model
    sites = find_sites(model)
    layers, k = layers_and_width(sites, cfg)  # on the skeleton: shapes only
    before = count_params(model)
    gen = torch.Generator().manual_seed(cfg.seed)
    probes = _ErrorProbes(sites, layers, None, cfg.seed)
    rows = []

    def work(i: int) -> None:
        if i in layers:
            probes.before(i)
            rows.append(compress_site(sites.mlp[i], k, cfg, gen, progress=progress))
            rows[-1]["error_rel"] = probes.error(i)
            count_after(sites.mlp[i], rows[-1])

    rewrite(stream, out, work, f"{cfg.method} (layer by layer)", tokenizer=tokenizer, overwrite=overwrite,
            inputs=inputs, source_name=source_name, progress=progress,
            finish=lambda: record(model, "fusion", asdict(cfg), width=k, layers=layers, tune_tokens=0))
    after = count_params(model)
    return {"method": cfg.method, "width": k, "layers": layers, "config": asdict(cfg), "sites": rows,
            "error_inputs": probes.description, "layerwise": True, "dtype": str(stream.dtype).split(".")[-1],
            "mlp_params_before": before["mlp"], "mlp_params_after": after["mlp"],
            "params_before": before["total"], "params_after": after["total"]}
