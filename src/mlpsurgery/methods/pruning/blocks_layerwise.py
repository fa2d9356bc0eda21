"""Fisher block pruning and random subnets layer by layer from the checkpoint's files (mlpsurgery/layerwise.py).

The structured baselines (fisher.py, and TwIST's random subnets) remove whole blocks (KV groups, MLP chunks), so the
folder written has other shapes; it is cut out as `twist extract --layerwise` cuts a subnet
(`twist.layerwise.write_subnet`: one source layer read at a time, the whole-model path's `fill_layer`).

`random` needs no data: the subnet is drawn from shapes alone (`twist.extraction.deployment`, the draw of the
whole-model `prune --method random`).

`fisher` needs each block's gradient dL/dm_b of the language-model loss, which flows back through every later
layer; the whole-model mode (`pruning.block_fisher`) holds the model for one backward pass. Here the backward
goes one layer at a time, the layer-wise form of activation checkpointing:
1. forward: the calibration batches go through layer 0, 1, ... (each read, run, released), the input of every
   layer from the first chosen one on kept (in RAM, or in memory-mapped files past --max-memory);
2. the loss's gradient at the last layer's output, from the model's own final norm, head and loss (its forward
   run with every layer returning the stored output);
3. backward: layer L-1, ..., first chosen, each read again and run once more on its stored inputs with the
   gates m = 1 on its output projections' input features (`fisher_gates`, as block_fisher); autograd gives the
   gradient at its input (for the layer below) and at its gates, whose squares are summed over batches as
   block_fisher sums them. The layer's blocks are then chosen (`fisher_subnet`, per layer) and what removing
   the others costs measured on the same inputs (`removal_hooks`, as removal_errors).
Per batch the chain rule through the stored activations is the whole model's backward, so the scores, the
subnet and the folder equal the whole-model mode's (tests/test_layerwise.py). Peak: one layer, the resident
parts, the calibration inputs of every layer worked on (on disk past max_memory) and one layer's gradients.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor
from tqdm.auto import tqdm

from ...errors import MLPSurgeryError
from ...files import claim, remove_ours
from ...layerwise import LayerStream
from ...measure.cost import count_params
from ...sites import find_sites
from . import keep_for_sparsity
from .counts import _layer_sizes, _per_layer
from .fisher import FISHER_ERROR_INPUTS, check_lm_loss, fisher_gates, fisher_subnet, removal_hooks

METHODS = ("fisher", "random")


def block_prune_layerwise(folder: str | Path, out: str | Path, method: str, sparsity: float,
                          parts: str = "both", layers: list[int] | None = None, data: Tensor | None = None,
                          blocks: int = 12, seed: int = 0, batch_size: int = 4, dtype=None,
                          max_memory_gb: float | None = None, spill_dir: str | Path | None = None, tokenizer=None,
                          overwrite: bool = False, inputs=(), source_name: str | None = None,
                          progress: bool = True, refit: bool = False) -> dict:
    """`prune(model, method, sparsity, ...)` then `save` for the structured methods, one layer in memory at a time;
    returns prune's report. spill_dir: a new folder (or one of ours) where Fisher's activations go past max_memory_gb,
    made, marked and removed here. refit: the narrowed projections refit on `data` as they are written
    (`twist.layerwise.write_subnet`; what `prune` + `refit_narrowed_` give), the errors under "refit"."""
    from ..twist import make_layout
    from ..twist.extraction import deployment
    from ..twist.layerwise import write_subnet

    if method not in METHODS:
        raise MLPSurgeryError(f"block pruning layer by layer is {', '.join(METHODS)}, not {method!r}")
    if (method == "fisher" or refit) and (data is None or data.dim() != 2 or len(data) == 0):
        what = "Fisher block pruning" if method == "fisher" else "the refit"
        raise MLPSurgeryError(f"{what} needs calibration blocks: a non-empty (N, T) tensor of token ids "
                              "(--data and --calib-blocks on the command line)")
    if method == "fisher" and max_memory_gb is not None and spill_dir is None:
        raise MLPSurgeryError("a memory cap for Fisher pruning layer by layer needs a folder for the activations it "
                              "sends to disk (spill_dir)")
    keep = keep_for_sparsity(sparsity, blocks)
    stream = LayerStream(Path(folder), dtype=dtype, max_memory_gb=max_memory_gb,
                         spill_dir=None if spill_dir is None else Path(spill_dir))
    model = stream.model
    if method == "fisher":
        check_lm_loss(model)
    everything = list(range(stream.n_layers))
    before = _layer_sizes(model, parts, everything)
    t_before = count_params(model)["total"]
    if method == "random":
        layout, subnet, settings = deployment(model, keep, blocks, parts, None, everything if layers is None else
                                              layers, None, None, seed)
        entry = ("twist-extract", {**settings, "rescale": True}, {"seed": seed, "subnet": subnet.as_dict()})
        report, errors = {"method": "random", "parts": parts, "keep": keep, "blocks": blocks, "seed": seed}, None
    else:
        chosen = everything if layers is None else layers
        layout = make_layout(model, parts, chosen, blocks, keep)
        if spill_dir is not None:
            claim(spill_dir, "prune-spill", {}, inputs=[*inputs, out])  # nothing to resume: any of ours is reused
        try:
            fisher, errors = layer_fisher(stream, data, layout, batch_size=batch_size, progress=progress)
        finally:
            if spill_dir is not None:
                remove_ours(spill_dir)
        subnet = fisher_subnet(fisher, layout)
        config = {"keep": keep, "blocks": blocks, "parts": parts, "layers": chosen, "attn_keep": None}
        entry = ("fisher-block-prune", config, {"calibration": list(data.shape), "subnet": subnet.as_dict()})
        report = {"method": "fisher", "parts": parts, **config,
                  "fisher": {f"{k[0]}.{k[1]}": v.tolist() for k, v in fisher.items()},
                  "error_inputs": FISHER_ERROR_INPUTS}
    fitted = write_subnet(stream, out, layout, subnet, method == "random", entry,
                          f"{method} blocks (layer by layer)", tokenizer=tokenizer, overwrite=overwrite, inputs=inputs,
                          source_name=source_name, progress=progress, calib=data if refit else None)
    after = _layer_sizes(model, parts, everything)
    report["per_layer"] = _per_layer({i: 1 - after[i] / before[i] if before[i] else 0.0 for i in everything}, errors)
    report.update({"layerwise": True, "dtype": str(stream.dtype).removeprefix("torch."),
                   "activations_on_disk": stream.disk, "params_before": t_before,
                   "params_after": count_params(model)["total"]})
    if fitted is not None:
        report["refit"] = {str(i): e for i, e in fitted.items()}
    return report


def layer_fisher(stream: LayerStream, data: Tensor, layout, batch_size: int = 4, progress: bool = True
                 ) -> tuple[dict[tuple[str, int], Tensor], dict[int, dict[str, tuple[float, float]]]]:
    """`pruning.block_fisher` and `pruning.removal_errors` (of the subnet `fisher_subnet` chooses) one layer at a
    time, by the backward pass layer by layer described above: (scores, errors)."""
    model, n = stream.model, stream.n_layers
    sites = find_sites(model)
    chosen = sorted({*layout.attn_full, *layout.mlp_h})
    if not chosen:
        return {}, {}
    lo = chosen[0]
    batches = [data[b:b + batch_size] for b in range(0, len(data), batch_size)]
    # held at once: the inputs of layers lo..n-1, the last output, two sets of gradients
    acts = stream.layer_inputs(batches, sets=n - lo + 3)
    calls = acts.calls
    kept: dict[int, list[Tensor]] = {}
    for i in tqdm(range(n), desc="fisher: forward (layer by layer)", unit="layer", disable=not progress):
        if i >= lo:
            kept[i] = acts.hidden
        stream.materialise(i)
        try:
            acts = stream.run(i, acts, keep_inputs=i >= lo)
        finally:
            stream.release(i)
    top = _loss_gradients(stream, batches, acts.hidden)
    _forget(stream, acts.hidden, f"layer{n - 1}")

    fisher: dict[tuple[str, int], Tensor] = {}
    sums: dict[int, dict[str, list[float]]] = {}
    grads = top
    for i in tqdm(range(n - 1, lo - 1, -1), desc="fisher: backward (layer by layer)", unit="layer",
                  disable=not progress):
        layer = stream.materialise(i)
        handles = []
        try:
            gates, handles = fisher_gates(sites, layout, kept[i][0].device, layers=(i,))
            keys = list(gates)
            for k in keys:
                fisher[k] = torch.zeros_like(gates[k])
            below = []
            for b, h in enumerate(kept[i]):
                args, kwargs = calls[i][b]
                # the input needs a gradient where the whole model's does: some gate lies below this layer
                x = h.detach().requires_grad_(i > lo)
                with torch.enable_grad():
                    y = layer(x, *args, **kwargs)
                    y = y[0] if isinstance(y, (tuple, list)) else y
                    want = [gates[k] for k in keys] + ([x] if i > lo else [])
                    got = torch.autograd.grad(y, want, grad_outputs=grads[b])
                for k, gr in zip(keys, got):
                    fisher[k] += gr.detach() ** 2
                if i > lo:
                    below.append(stream._store(got[-1].detach(), stream.disk, f"grad{i}-{b}"))
                del got, y, x
        finally:
            for hook in handles:
                hook.remove()
        if keys:  # a chosen layer: its blocks, and what removing the others costs on the same inputs
            hooks = removal_hooks(sites, layout, fisher_subnet(fisher, layout, layers=(i,)), sums)
            try:
                with torch.no_grad():
                    for b, h in enumerate(kept[i]):
                        args, kwargs = calls[i][b]
                        layer(h, *args, **kwargs)
            finally:
                for hook in hooks:
                    hook.remove()
        stream.release(i)
        _forget(stream, grads, f"grad{i + 1}")
        _forget(stream, kept.pop(i), "in" if i == 0 else f"layer{i - 1}")
        grads = below
    order = sorted(fisher, key=lambda k: (k[0] != "attn", k[1]))  # block_fisher's: attention first, by layer
    return ({k: fisher[k] for k in order},
            {i: {k: (v[0], v[1]) for k, v in sums[i].items()} for i in sorted(sums)})


def _loss_gradients(stream: LayerStream, batches: list[Tensor], final: list[Tensor]) -> list[Tensor]:
    """Per batch, the gradient of the model's own loss (labels = the input ids, as block_fisher) at the last layer's
    output: the model's forward runs with every layer returning that batch's stored output, so the final norm, head
    and loss are the model's own code."""
    out = []
    for b, x in enumerate(batches):
        f = final[b].detach().requires_grad_(True)
        with stream.past_layers(f), torch.enable_grad():
            loss = stream.model(input_ids=x, labels=x, **stream.call_kwargs()).loss
            (g,) = torch.autograd.grad(loss, [f])
        out.append(stream._store(g, stream.disk, f"grad{stream.n_layers}-{b}"))
    return out


def _forget(stream: LayerStream, tensors: list[Tensor], tag: str) -> None:
    """Drop a set of activations; on disk, its files too."""
    if stream.disk:
        for b in range(len(tensors)):
            (stream.spill_dir / f"{tag}-{b}.bin").unlink(missing_ok=True)
    tensors.clear()
