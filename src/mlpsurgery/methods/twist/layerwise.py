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
                      progress: bool = True) -> dict:
    """Cut the subnet of `seed` out of the TwIST folder `folder` into `out`, layer by layer; returns the subnet,
    the recorded settings and the parameter counts before and after."""
    stream = LayerStream(Path(folder), dtype=dtype)
    model = stream.model
    before = count_params(model)
    layout, subnet, settings = deployment(model, keep, blocks, parts, attn_keep, None, shared_first, shared_last,
                                          seed)
    write_subnet(stream, out, layout, subnet, rescale,
                 ("twist-extract", {**settings, "rescale": rescale}, {"seed": seed, "subnet": subnet.as_dict()}),
                 f"subnet of seed {seed} (layer by layer)", tokenizer=tokenizer, overwrite=overwrite, inputs=inputs,
                 source_name=source_name, progress=progress)
    after = count_params(model)
    entry = model._mlpsurgery_history[-1]
    return {"config": entry["config"], "subnet": entry["provenance"]["subnet"], "params_before": before["total"],
            "params_after": after["total"], "attention_params": [before["attention"], after["attention"]],
            "mlp_params": [before["mlp"], after["mlp"]], "plain_transformers": not replaced_modules(model),
            "layerwise": True,
            "dtype": str(stream.dtype).removeprefix("torch.")}


def write_subnet(stream: LayerStream, out: str | Path, layout, subnet, rescale: bool, entry: tuple[str, dict, dict],
                 desc: str, tokenizer=None, overwrite: bool = False, inputs=(), source_name: str | None = None,
                 progress: bool = True) -> None:
    """Write `subnet` of `stream`'s model to `out`, one source layer read at a time: the result's structure is built
    once on the meta device, each of its layers filled from the source layer (`subsets.fill_layer`, the whole-model
    path's code; sqrt(N_full/N_sub) folded in if `rescale`) and put in the source layer's place as it is written.
    entry: (kind, config, provenance) that `io.record` writes into the history. `stream.model` holds the subnet's
    structure (on the meta device) after."""
    model = stream.model
    plan = plan_subsets(model, *layout.subset_args(subnet))
    new = subset_skeleton(model, plan, empty=True)
    new_sites = find_sites(new)
    base = getattr(new, "base_model", new)
    new_layers = base.get_submodule(arch_spec(new.config).layers)
    new_prefixes = {id(m): n + "." for n, m in new.named_modules()}

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
        stream.release(i)  # the source layer back to the meta device; its subset takes its place
        stream.layers[i] = dst

    def finish() -> None:
        model.config = new.config  # (the folder's history, source and generation config stay the model's)
        for i, layer in enumerate(stream.layers):  # what the layers hold now is the subnet's structure
            if layer is not new_layers[i]:
                raise MLPSurgeryError(f"internal: layer {i} was not rewritten")
        kind, config, provenance = entry
        record(model, kind, config, **provenance)

    rewrite(stream, out, work, desc, tokenizer=tokenizer, overwrite=overwrite, inputs=inputs,
            source_name=source_name, progress=progress, finish=finish)
