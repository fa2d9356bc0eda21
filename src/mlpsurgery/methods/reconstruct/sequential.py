"""Sequential calibration (as SparseGPT, OBC and SliceGPT do): each chosen layer is compressed on the activations that
the already-compressed layers before it produce, so the error a layer leaves is what the next one is fitted against.

The model's own forward runs once over the calibration blocks with every decoder layer a recorder (the hidden states
entering layer 0 and what the model passes each layer beside them: masks, positions, rotary tables), exactly as
`layerwise.LayerStream.layer_inputs` records them for a checkpoint on disk. Then the layers run one after another on
those hidden states, in the model: for a chosen layer i, one pass records the residual stream entering its MLP
sub-block (what `capture` records), `work(i, x)` changes the layer in place, and a second pass gives the next layer
its inputs through the changed layer. Cost: one forward of the layers up to the last chosen one, plus one more pass
of each chosen layer; no pass is repeated from the start (the naive way, a partial forward per layer, is quadratic in
depth)."""

from __future__ import annotations

import functools
from typing import Callable

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from ...errors import MLPSurgeryError
from ...sites import find_sites
from .attention import output_rows_hooks
from .local import subblock_rows


class _Stop(Exception):
    pass


def _stop(*_):
    raise _Stop


def record_layer_inputs(model: nn.Module, blocks: Tensor, last: int, batch_size: int = 8):
    """(hidden, calls): the hidden states entering layer 0 per batch of `blocks` (N, T), and calls[j][b] = (args,
    kwargs) the model passes layer j for batch b, for j = 0..last."""
    layers = find_sites(model).layers()
    calls: list[list] = [[] for _ in range(last + 1)]
    hidden: list[Tensor] = []
    device = next(model.parameters()).device

    def recorder(j, *args, **kwargs):
        h = kwargs.pop("hidden_states") if "hidden_states" in kwargs else args[0]
        args = args[1:] if args and args[0] is h else args
        calls[j].append((args, kwargs))
        if j == 0:
            hidden.append(h.detach())
        if j == last:
            raise _Stop
        return h

    for j, layer in enumerate(layers[:last + 1]):
        layer.forward = functools.partial(recorder, j)
    kw = {"use_cache": False} if getattr(model.config, "use_cache", None) is not None else {}
    try:
        with torch.no_grad():
            for b in range(0, len(blocks), batch_size):
                try:
                    model(input_ids=blocks[b:b + batch_size].to(device), **kw)
                except _Stop:
                    pass
    finally:
        for layer in layers[:last + 1]:
            del layer.forward
    return hidden, calls


def rows_hook(into: list, stop: bool = False):
    """A pre-hook that appends its module's input rows (n, d) in float32 to `into`; stop: then ends the pass there
    (raises `_Stop`, which the runners catch per batch), so nothing after the rows is computed for nothing."""
    def hook(mod, args):
        into.append(args[0].detach().reshape(-1, args[0].shape[-1]).float())
        if stop:
            raise _Stop

    return hook


def walk_layer(j: int, run: Callable[..., object], sites, targets, attn: bool, mlp: bool,
               work: Callable[..., object] | None, attn_work: Callable[..., object] | None, extra=()) -> object:
    """One chosen layer j of the sequential walk, in place; `run(hook=, stop=)` runs the layer (as it is now) over
    every calibration batch, with `hook` a pre-hook on its MLP's entry, ending each batch's pass after the module
    `stop`. attn: `attn_work(j, c, y)` on the rows its attention's output projection reads and what `targets`' attention
    (the original's) gives out of its output projection on the same calls (a pass that stops there: the rest of the
    layer waits for the change); then mlp: `work(j, x, *extra)` on the residual rows entering its MLP sub-block, as
    the changed attention gives them (that pass ends at the MLP's entry: `run` must catch `_Stop` per batch); returns
    what work returned (None without mlp). The whole-model walk (`sequential`) and the layer-by-layer one
    (twist/layerwise.py) both run it."""
    if attn:
        c_rows: list[Tensor] = []
        y_rows: list[Tensor] = []
        handles = output_rows_hooks(sites.attn[j], targets.attn[j], c_rows, y_rows)
        try:
            run(stop=sites.attn[j].o_proj)
        finally:
            for handle in handles:
                handle.remove()
        attn_work(j, torch.cat(c_rows), torch.cat(y_rows))
        del c_rows, y_rows
    if not mlp:
        return None
    rows: list[Tensor] = []
    run(hook=rows_hook(rows, stop=True))  # the pass ends at the MLP's entry: its rows are all this pass is for
    with torch.enable_grad():  # the work may fit (k-means, MMD) with autograd
        return work(j, torch.cat(rows), *extra)


def sequential(model: nn.Module, blocks: Tensor, layers: list[int], work: Callable[..., object],
               batch_size: int = 8, progress: bool = True, desc: str = "calibrating",
               reference: bool = False, attn_layers=(), attn_work: Callable[..., object] | None = None,
               original: nn.Module | None = None) -> dict[int, object]:
    """For each chosen layer i in order, `work(i, x)` with x (n_tokens, d) float32 the residual stream entering layer
    i's MLP sub-block on the calibration `blocks` (N, T), as the model -- its chosen layers before i already changed by
    `work` -- produces it. Returns {i: what work returned}. The model is in eval mode and without grad meanwhile.

    reference: also run the original model's stream beside it (every layer before it is changed) and call
    `work(i, x, x_ref, y_ref)` with x_ref the original's rows at the same place and y_ref what the original sub-block
    adds to them, so that work can fit the layer to where the original stream goes, not only to what its MLP does.

    attn_layers, attn_work, original: for each of attn_layers (in the same walk, before the layer's MLP rows are
    taken), `attn_work(i, c, y)` with c the rows the attention's output projection reads and y what `original`'s
    attention (the same layer of the unchanged model) gives out of its output projection on the same inputs
    (attention.py); so a changed attention is in place before its layer's MLP and the layers after are calibrated."""
    if blocks.dim() != 2 or len(blocks) == 0:
        raise MLPSurgeryError(f"calibration blocks must be a non-empty (N, T) tensor of token ids, got "
                              f"{tuple(blocks.shape)}")
    sites = find_sites(model)
    attn_chosen = set(attn_layers)
    if attn_chosen and (attn_work is None or original is None):
        raise MLPSurgeryError("attention layers to calibrate need attn_work and the original model")
    targets = find_sites(original) if attn_chosen else None
    chosen = sorted(set(layers) | attn_chosen)
    mlp_chosen = set(layers)
    was_training = model.training
    model.eval()
    results: dict[int, object] = {}
    try:
        hidden, calls = record_layer_inputs(model, blocks, chosen[-1], batch_size)
        ref_hidden = list(hidden) if reference else None
        decoder = sites.layers()

        def run(j: int, states: list[Tensor], hook=None, stop: nn.Module | None = None) -> list[Tensor]:
            """Layer j over every batch of states (hook: a pre-hook on its MLP's entry); stop: the layer's pass ends
            after that module (nothing is returned then)."""
            handles = [] if hook is None else [sites.mlp[j].entry.register_forward_pre_hook(hook)]
            if stop is not None:
                handles.append(stop.register_forward_hook(_stop))
            try:
                out = []
                for b, h in enumerate(states):
                    args, kwargs = calls[j][b]
                    try:
                        y = decoder[j](h, *args, **kwargs)
                    except _Stop:
                        continue
                    out.append(y[0] if isinstance(y, (tuple, list)) else y)
                return out
            finally:
                for handle in handles:
                    handle.remove()

        bar = tqdm(total=len(chosen), desc=desc, unit="layer", disable=not progress)
        with torch.no_grad():
            for j in range(chosen[-1] + 1):
                ref_rows: list[Tensor] = []
                if ref_hidden is not None:  # the original stream through the layer before work changes it
                    ref_hidden = run(j, ref_hidden, rows_hook(ref_rows) if j in mlp_chosen else None)
                if j in attn_chosen or j in mlp_chosen:
                    extra = ()
                    if ref_hidden is not None and j in mlp_chosen:
                        x_ref = torch.cat(ref_rows)
                        extra = (x_ref, subblock_rows(sites.mlp[j], x_ref))
                    got = walk_layer(j, lambda hook=None, stop=None: run(j, hidden, hook, stop), sites, targets,
                                     j in attn_chosen, j in mlp_chosen, work, attn_work, extra)
                    if j in mlp_chosen:
                        results[j] = got
                    del ref_rows, extra
                    bar.update(1)
                if j == chosen[-1]:
                    break
                hidden = run(j, hidden)
        bar.close()
    finally:
        model.train(was_training)
    return results
