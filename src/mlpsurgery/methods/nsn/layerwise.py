"""NSN layer by layer from the files (layerwise.py).

`nest_layerwise`: the surgery. Every chosen projection of one decoder layer at a time becomes its SVD-initialised
NestedLinear (surgery.py's own `nest_slot`), is appended to the output and dropped, so a model larger than RAM is
nested in the memory of one layer plus the embeddings; with calibration blocks (the whitened start) they flow through
the original layers beside it. With the down refit or local tuning (`nest --refit / --local-epochs --layerwise`) the
calibration stream goes on through each layer once it is nested, refit and tuned (the per-layer code of the whole-model
mode, local.py `tune_layer_`), so each layer is calibrated on what the nested layers before it give. The folder holds
what `nest` + `save` write without training (tests/test_layerwise_reshape.py checks it bit for bit); multi-rank
training then runs on that folder as on any other (it needs the whole model, or FSDP under torchrun).

`export_rank_layerwise`: `nest rank` on a nested folder. The rank is chosen on the skeleton (it depends on shapes
alone), then each layer is read, its NestedLinears truncated to that rank (lowrank) or kept whole with the rank
recorded (nested), and appended: the folder `nest rank` writes, without the full-rank nested model in memory.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import torch
from torch import Tensor

from ...errors import MLPSurgeryError
from ...io import record
from ...layerwise import LayerStream, rewrite
from ...measure.cost import count_params
from ...sites import find_sites, parse_layers
from .export import _nested_slots
from .pipeline import check_rank_args, choose_rank
from .ranks import nested_flops
from .local import FRACTIONS
from .surgery import NSNConfig, check_config, layer_slots, max_rank, nest_layer, nested_linears


def nest_layerwise(folder: str | Path, out: str | Path, cfg: NSNConfig, dtype=None, tokenizer=None,
                   overwrite: bool = False, inputs=(), source_name: str | None = None, progress: bool = True,
                   device=None, calib_data: Tensor | None = None, local_epochs: float = 0.0,
                   local_lr: float | None = None, refit: bool = False, seed: int = 0) -> dict:
    """Nest the checkpoint in `folder` one layer at a time and save the result to `out` (what `nest` with no
    training steps writes). device: where each layer's SVDs run (LayerStream; the CPU by default). calib_data: (N, T)
    token blocks for the whitened start: they flow through the original layers as the layers are read, and each
    projection's input moments are summed while its layer runs over them (what `nest(calib_data=...)` measures in
    one pass of the whole model).

    local_epochs > 0 or refit (both need calib_data, --modules mlp): the sequential start of `nest(...,
    local_epochs=, refit=)`, the same per-layer code (local.py `tune_layer_`): each chosen layer's MLP rows are
    recorded while the layer, still original, runs over the calibration stream; the layer is nested on them, its
    down projection refit and / or tuned at every rank, and the stream goes on through it at its stream rank, so the
    next layer is calibrated on what the nested layers before it give. The folder is the whole-model one."""
    from ..pruning.calibrated import moment_hooks
    from ..reconstruct.sequential import _Stop, rows_hook
    from .local import at_max_rank, check_epochs, check_tuned, tune_layer_, tuned_provenance, tuned_report

    check_config(cfg)
    tuned = local_epochs > 0 or refit
    check_epochs(local_epochs)
    if tuned:
        if calib_data is None:
            raise MLPSurgeryError("the down refit and local tuning fit each nested MLP on calibration rows: give "
                                  "calibration data (drop --data-free) or drop --refit / --local-epochs")
        check_tuned(cfg, local_epochs, refit)
    stream = LayerStream(Path(folder), dtype=dtype, device=device)
    model = stream.model
    sites = find_sites(model)
    count = 0
    state = {}
    n_layers = len(sites)
    chosen = parse_layers(cfg.layers, n_layers)
    rows: list[dict] = []
    if calib_data is not None and chosen:
        state["acts"] = stream.layer_inputs(calib_data, batch_size=8)

    def tuned_work(i: int) -> None:
        """Layer i of the sequential start: its MLP rows from the original layer, the per-layer code of the whole
        model, then the stream through the nested layer at its stream rank."""
        nonlocal count
        if i in chosen:
            got: list[Tensor] = []
            hook = sites.mlp[i].entry.register_forward_pre_hook(rows_hook(got, stop=True))
            try:
                stream.run(i, state["acts"], keep=False, until=_Stop)  # the rows are all this pass is for
            finally:
                hook.remove()
            count += len(layer_slots(model, cfg, i))
            with torch.enable_grad():  # the tuning's gradient steps (as `sequential` gives the whole model's)
                rows.append(tune_layer_(model, cfg, i, torch.cat(got), local_epochs, local_lr, seed=seed,
                                        refit=refit))
            del got
        state["acts"] = stream.run(i, state["acts"]) if i < chosen[-1] else None
        if i in chosen:
            at_max_rank(model, cfg, i)

    def work(i: int) -> None:
        nonlocal count
        if tuned:
            if i <= chosen[-1]:
                tuned_work(i)
            return
        moments = None
        if "acts" in state and i <= chosen[-1]:
            slots = layer_slots(model, cfg, i)
            handles, get = moment_hooks({str(n): s.module for n, s in enumerate(slots)})
            try:
                nxt = stream.run(i, state["acts"], keep=i < chosen[-1])
            finally:
                for h in handles:
                    h.remove()
            state["acts"] = nxt
            moments = {int(n): m for n, m in get().items()} if slots else None
        count += nest_layer(model, cfg, i, moments)

    prov: dict = {}

    def finish() -> None:
        extra = {}
        if tuned:
            prov.update(tuned_provenance(tuned_report(rows, local_epochs, local_lr, FRACTIONS, cfg), local_epochs,
                                         refit))
            extra = {"calib_tokens": int(calib_data.numel()), **prov}
        elif calib_data is not None:
            extra = {"calib_tokens": int(calib_data.numel()), "init": "whitened svd"}
        record(model, "nsn", asdict(cfg), projections=count, **extra)

    desc = "SVD (layer by layer)" if not tuned else \
        f"nest + {'local tuning' if local_epochs > 0 else 'down refit'} (layer by layer)"
    rewrite(stream, out, work, desc, tokenizer=tokenizer, overwrite=overwrite, inputs=inputs,
            source_name=source_name, progress=progress, finish=finish)
    report = {"out": str(out), "config": asdict(cfg), "projections": len(nested_linears(model)),
              "max_rank": max_rank(model), "full_rank_flops_fraction": nested_flops(model)["fraction"],
              "layerwise": True, "dtype": str(stream.dtype).split(".")[-1],
              "device": str(stream.device)}
    if tuned:  # as `nest_model` reports it
        report["init"] = f"whitened svd ({int(calib_data.numel())} calibration tokens)" + \
            prov["init"].removeprefix("whitened svd")
        if "local" in prov:
            report["local"] = prov["local"]
    return report


def export_rank_layerwise(folder: str | Path, out: str | Path, rank: int | None = None, budget: float | None = None,
                          form: str = "lowrank", dtype=None, tokenizer=None, overwrite: bool = False, inputs=(),
                          progress: bool = True) -> dict:
    """`export_rank` (pipeline.py) one decoder layer at a time: fix the rank of the nested folder `folder` and write
    it to `out` as `lowrank` (truncated NestedLinears) or `nested` (every component, the rank recorded)."""
    check_rank_args(rank, budget, form)
    if form == "dense":
        raise MLPSurgeryError("--form dense is a plain transformers folder, which the layer-sequential mode does not "
                              "write: write --form lowrank --layerwise, then `mlpsurgery export` that folder (the same "
                              "dense weights, folded a tensor at a time), or drop --layerwise")
    stream = LayerStream(Path(folder), dtype=dtype)
    model = stream.model
    before = count_params(model)["total"]
    chosen = choose_rank(model, rank, budget)
    ranks = sorted({s.module.rank for s in _nested_slots(model)})

    def work(i: int) -> None:
        if form == "lowrank":
            for s in _nested_slots(model, layers=[i]):
                s.replace(s.module.truncated())

    def finish() -> None:
        if form == "lowrank":
            record(model, "nsn-truncate", {"ranks": ranks})

    rewrite(stream, out, work, f"rank {chosen['rank']} (layer by layer)", tokenizer=tokenizer, overwrite=overwrite,
            inputs=inputs, progress=progress, finish=finish)
    return {"from": str(folder), "out": str(out), "form": form, "rank": chosen["rank"], "budget": budget,
            "flops_fraction": chosen["fraction"], "params_before": before, "params_after": count_params(model)["total"],
            "loads_with": "mlpsurgery.load", "layerwise": True, "dtype": str(stream.dtype).split(".")[-1]}
