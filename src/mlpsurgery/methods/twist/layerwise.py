"""`twist extract --layerwise`: one random subnet cut out of a TwIST folder one decoder layer at a time.

The subnet is drawn from shapes and the folder's training record alone (`extraction.deployment`, the same draw
as `twist_extract`), the result's structure is built once with its parameters on the meta device
(`subsets.subset_skeleton`), and `layerwise.rewrite` reads each source layer from the folder's weights file,
hands it to `work`, which fills the result's layer with the kept groups and neurons (`subsets.fill_layer`, the
same code as the whole-model path) and the rescaling folded in, puts it in the source layer's place, and appends
it to the output. Only one source layer and its subset are in memory at a time; the folder written holds what
`twist extract` writes, bit for bit (tests/test_twist.py). The writing (`write_subnet`) also serves `prune
--layerwise` for the structured baselines (methods/pruning/blocks_layerwise.py: Fisher blocks, random subnets).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from ...errors import MLPSurgeryError
from ...io import record, replaced_modules
from ...io.exporting import _materialise
from ...layerwise import LayerStream, rewrite
from ...measure.cost import count_params
from ...sites import arch_spec, find_sites
from ...subsets import fill_layer, plan_subsets, subset_skeleton
from .extraction import deployment, rescale_subnet


def extract_layerwise(folder: str | Path, out: str | Path, keep: int, blocks: int | None = None,
                      parts: str | None = None, attn_keep: int | None = None, shared_first: int | None = None,
                      shared_last: int | None = None, seed: int = 0, rescale: bool = True, dtype=None,
                      tokenizer=None, overwrite: bool = False, inputs=(), source_name: str | None = None,
                      progress: bool = True, calib: Tensor | None = None) -> dict:
    """Cut the subnet of `seed` out of the TwIST folder `folder` into `out`, layer by layer; returns the subnet,
    the recorded settings and the parameter counts before and after. calib ((N, T) token blocks): the narrowed
    projections refit layer by layer on them (`write_subnet`), what `twist_extract` + `refit_subnet_` write; the
    errors under "refit"."""
    from .extraction import refit_entry

    stream = LayerStream(Path(folder), dtype=dtype)
    model = stream.model
    before = count_params(model)
    layout, subnet, settings = deployment(model, keep, blocks, parts, attn_keep, None, shared_first, shared_last,
                                          seed)
    errors = write_subnet(stream, out, layout, subnet, rescale,
                          ("twist-extract", {**settings, "rescale": rescale}, {"seed": seed,
                                                                               "subnet": subnet.as_dict()}),
                          f"subnet of seed {seed} (layer by layer)", tokenizer=tokenizer, overwrite=overwrite,
                          inputs=inputs, source_name=source_name, progress=progress, calib=calib,
                          refit_entry=None if calib is None else lambda e: refit_entry(e, calib))
    after = count_params(model)
    entry = next(e for e in reversed(model._mlpsurgery_history) if e["method"] == "twist-extract")
    return {"config": entry["config"], "subnet": entry["provenance"]["subnet"], "params_before": before["total"],
            "params_after": after["total"], "attention_params": [before["attention"], after["attention"]],
            "mlp_params": [before["mlp"], after["mlp"]], "plain_transformers": not replaced_modules(model),
            "layerwise": True,
            "dtype": str(stream.dtype).removeprefix("torch."),
            **({} if errors is None else {"refit": {"calibration": list(calib.shape), "layers": errors}})}


def write_subnet(stream: LayerStream, out: str | Path, layout, subnet, rescale: bool, entry: tuple[str, dict, dict],
                 desc: str, tokenizer=None, overwrite: bool = False, inputs=(), source_name: str | None = None,
                 progress: bool = True, calib: Tensor | None = None, refit_entry=None) -> dict | None:
    """Write `subnet` of `stream`'s model to `out`, one source layer read at a time: the result's structure is built
    once on the meta device, each of its layers filled from the source layer (`subsets.fill_layer`, the whole-model
    path's code; sqrt(N_full/N_sub) folded in if `rescale`) and put in the source layer's place as it is written.
    entry: (kind, config, provenance) that `io.record` writes into the history. `stream.model` holds the subnet's
    structure (on the meta device) after.

    calib ((N, T) token blocks): the closed-form compensation of the whole-model path (`refit_narrowed_`), layer by
    layer. The blocks flow through the subnet's layers as they are written; a layer with a narrowed attention or MLP
    is refit while its source layer is still in memory (the sequential walk's own per-layer step,
    reconstruct/sequential.py `walk_layer`: the output projection to the source attention's output on the same
    calls, then the down projection to the source MLP's output on the rows the refit attention gives), then the
    stream goes on through it. Returns {layer: errors} as `refit_narrowed_` does (None without calib);
    refit_entry(errors): (kind, config, provenance) of a second history entry for it, or None."""
    from ..reconstruct.attention import refit_output_
    from ..reconstruct.layer import mlp_inputs, refit_site_
    from ..reconstruct.sequential import _Stop, _stop, walk_layer

    model = stream.model
    plan = plan_subsets(model, *layout.subset_args(subnet))
    new = subset_skeleton(model, plan, empty=True)
    new_sites = find_sites(new)
    base = getattr(new, "base_model", new)
    new_layers = base.get_submodule(arch_spec(new.config).layers)
    new_prefixes = {id(m): n + "." for n, m in new.named_modules()}
    old_sites = find_sites(model)
    # what the subnet narrows, from the plan (the skeleton's layers take their shapes as they are filled)
    mlps = sorted(i for i, kept in plan.neurons.items() if len(kept) < old_sites.mlp[i].h)
    heads = sorted(i for i, kept in plan.groups.items() if len(kept) < old_sites.attn[i].n_kv)
    errors: dict[int, dict] = {}
    state = {}
    if calib is not None:
        if not mlps and not heads:
            raise MLPSurgeryError("this subnet narrowed no MLP and cut no attention head: there is nothing to refit; "
                                  "drop the refit")
        new.eval()  # (as `sequential` runs the model)
        state["acts"] = stream.layer_inputs(calib, batch_size=8)
        state["last"] = max(mlps + heads)

    def run(i: int, layer, hook=None, stop=None, keep: bool = False):
        """`layer` (layer i's subset) over the calibration stream, as `sequential`'s run."""
        handles = [] if hook is None else [new_sites.mlp[i].entry.register_forward_pre_hook(hook)]
        if stop is not None:
            handles.append(stop.register_forward_hook(_stop))
        out = []
        try:
            with torch.no_grad():
                for b, h in enumerate(state["acts"].hidden):
                    args, kwargs = state["acts"].calls[i][b]
                    try:
                        y = layer(stream.to_device(h), *args, **kwargs)
                    except _Stop:
                        continue
                    if keep:
                        out.append(stream.host(y[0] if isinstance(y, (tuple, list)) else y))
        finally:
            for handle in handles:
                handle.remove()
        return out

    def refit(i: int, dst) -> None:
        """Layer i's subset refit to the source layer (still in memory) on the stream, then the stream through it."""
        from ...layerwise import Activations

        def attn_work(j: int, c: Tensor, y: Tensor) -> None:
            errors.setdefault(j, {})["attention"] = refit_output_(new_sites.attn[j], c, y)

        def work(j: int, x: Tensor) -> None:
            site = new_sites.mlp[j]
            errors.setdefault(j, {}).update(refit_site_(site, old_sites.mlp[j].read(), mlp_inputs(site, x)))

        if i in mlps or i in heads:
            walk_layer(i, lambda hook=None, stop=None: run(i, dst, hook, stop), new_sites, old_sites, i in heads,
                       i in mlps, work, attn_work)
        if i < state["last"]:
            state["acts"] = Activations(run(i, dst, keep=True), state["acts"].calls)

    def work(i: int) -> None:
        src = stream.layers[i]  # (materialised by rewrite)
        dst = new_layers[i]
        _materialise(dst, "cpu")
        mine = new_prefixes[id(dst)]
        if mine != stream.prefixes[i]:
            raise MLPSurgeryError(f"internal: layer {i} is {mine!r} in the subnet, {stream.prefixes[i]!r} in the model")
        src_state = src.state_dict()
        with torch.no_grad():
            for k, v in dst.state_dict().items():
                if not (mine + k).startswith(plan.rewritten):
                    v.copy_(src_state[k])
            del src_state
            fill_layer(plan, new_sites, i)
            if rescale:
                rescale_subnet(new_sites, layout, subnet, layers=(i,))
        if calib is not None and i <= state["last"]:
            refit(i, dst)
        stream.release(i)  # the source layer back to the meta device; its subset takes its place
        stream.layers[i] = dst

    def finish() -> None:
        model.config = new.config  # (the folder's history, source and generation config stay the model's)
        for i, layer in enumerate(stream.layers):  # what the layers hold now is the subnet's structure
            if layer is not new_layers[i]:
                raise MLPSurgeryError(f"internal: layer {i} was not rewritten")
        kind, config, provenance = entry
        record(model, kind, config, **provenance)
        if calib is not None and refit_entry is not None:
            kind, config, provenance = refit_entry(report())
            record(model, kind, config, **provenance)

    def report() -> dict:
        keys = ("error_before", "error_after", "attention")
        return {i: {k: errors[i][k] for k in keys if k in errors[i]} for i in sorted(errors)}

    rewrite(stream, out, work, desc, tokenizer=tokenizer, overwrite=overwrite, inputs=inputs,
            source_name=source_name, progress=progress, finish=finish)
    return None if calib is None else report()
