"""Structured pruning by Fisher (TwIST paper §5 "Block Prune", after Michel et al. 2019): per layer the blocks of
TwIST (KV groups, MLP chunks) of highest empirical Fisher are kept and the others removed physically, with each
layer's error from the removal measured on the calibration blocks."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from ...errors import MLPSurgeryError
from ...io import record
from ...sites import find_sites, linear_weight
from .calibrated import _calibration_pass


def block_fisher(model: nn.Module, data: Tensor, layout, batch_size: int = 4, progress: bool = True
                 ) -> dict[tuple[str, int], Tensor]:
    """Empirical Fisher of every block (paper §5 "Block Prune", after Michel et al. 2019): a gate m_b = 1 on
    each block's contribution to the output projection; importance = sum over batches of (dL/dm_b)^2."""
    if data is None or data.dim() != 2 or len(data) == 0:
        raise MLPSurgeryError("Fisher block pruning needs calibration blocks: a non-empty (N, T) tensor of token ids")
    check_lm_loss(model)
    device = next(model.parameters()).device
    gates, handles = fisher_gates(find_sites(model), layout, device)
    fisher = {k: torch.zeros_like(g) for k, g in gates.items()}
    frozen = [p for p in model.parameters() if p.requires_grad]
    for p in frozen:
        p.requires_grad_(False)
    was_training = model.training
    model.eval()
    try:
        keys = list(gates)
        for b in tqdm(range(0, len(data), batch_size), desc="fisher", unit="batch", disable=not progress):
            batch = data[b:b + batch_size].to(device)
            loss = model(input_ids=batch, labels=batch, use_cache=False).loss
            for k, gr in zip(keys, torch.autograd.grad(loss, [gates[k] for k in keys])):
                fisher[k] += gr.detach() ** 2
    finally:
        for h in handles:
            h.remove()
        for p in frozen:
            p.requires_grad_(True)
        model.train(was_training)
    return fisher


def fisher_gates(sites, layout, device, layers=None) -> tuple[dict[tuple[str, int], Tensor], list]:
    """The gates m = 1 Fisher differentiates, one per block, on the input features of each chosen layer's attention
    o / MLP down projection (of `layers` only, if given): ({("attn" | "ffn", layer): gates}, attention first, by
    layer; the hook handles)."""
    from ..twist import attn_feature_blocks, gate_inputs, mlp_feature_blocks

    gates: dict[tuple[str, int], Tensor] = {}
    handles = []
    for i, n in layout.attn_full.items():
        if layers is None or i in layers:
            g = gates[("attn", i)] = torch.ones(n, device=device, requires_grad=True)
            fb = attn_feature_blocks(sites.attn[i]).to(device)
            handles.append(gate_inputs(sites.attn[i].o_proj, lambda g=g, fb=fb: g[fb]))
    for i, h in layout.mlp_h.items():
        if layers is None or i in layers:
            g = gates[("ffn", i)] = torch.ones(layout.R, device=device, requires_grad=True)
            fb = mlp_feature_blocks(h, layout.R).to(device)
            handles.append(gate_inputs(sites.mlp[i].down_proj, lambda g=g, fb=fb: g[fb]))
    return gates, handles


def check_lm_loss(model: nn.Module) -> None:
    """Refuse a model whose forward computes no loss from labels (an encoder without a head): Fisher block pruning
    differentiates the language-model loss."""
    import inspect

    if "labels" not in inspect.signature(model.forward).parameters:
        raise MLPSurgeryError(f"{type(model).__name__} computes no language-model loss, which Fisher block pruning "
                              "differentiates: use a causal LM checkpoint, or --method random")


def fisher_subnet(fisher: dict[tuple[str, int], Tensor], layout, layers=None):
    """Per layer (of `layers` only, if given), the N_sub blocks of highest Fisher (scores from `block_fisher`,
    possibly computed once for a wider layout and reused across sparsities)."""
    from ..twist import Subnet

    def top(scores: Tensor, k: int) -> list[int]:
        return sorted(scores.topk(k).indices.tolist())

    def chosen(full):
        return [i for i in full if layers is None or i in layers]

    return Subnet(attn={i: top(fisher[("attn", i)], layout.attn_sub[i]) for i in chosen(layout.attn_full)},
                  mlp={i: top(fisher[("ffn", i)], layout.ffn_sub) for i in chosen(layout.mlp_h)})


def fisher_block_prune(model: nn.Module, data: Tensor, keep: int, blocks: int = 12, parts: str = "both",
                       layers: list[int] | None = None, attn_keep: int | None = None, batch_size: int = 4,
                       progress: bool = True) -> tuple[nn.Module, dict]:
    """Keep, per layer, the `keep` of `blocks` MLP chunks (and attn_keep KV groups) of highest Fisher; the
    others are removed physically (no rescaling: the baseline masks blocks as trained). Returns a new model."""
    from ..twist import make_layout, materialize

    layers = list(range(len(find_sites(model)))) if layers is None else layers
    layout = make_layout(model, parts, layers, blocks, keep, attn_keep)
    fisher = block_fisher(model, data, layout, batch_size=batch_size, progress=progress)
    subnet = fisher_subnet(fisher, layout)
    errors = removal_errors(model, data, layout, subnet, batch_size=batch_size, progress=progress)
    new = materialize(model, layout, subnet, rescale=False)
    config = {"keep": keep, "blocks": blocks, "parts": parts, "layers": layers, "attn_keep": attn_keep}
    record(new, "fisher-block-prune", config, calibration=list(data.shape),
           subnet=subnet.as_dict())
    return new, {"method": "fisher", "parts": parts, **config,
                 "fisher": {f"{k[0]}.{k[1]}": v.tolist() for k, v in fisher.items()},
                 "errors": errors}


FISHER_ERROR_INPUTS = ("the calibration blocks through the dense model: the output of each layer's attention o / MLP "
                       "down projection without the removed blocks' input features")


def removal_errors(model: nn.Module, data: Tensor, layout, subnet, batch_size: int = 4,
                   progress: bool = False) -> dict[int, dict[str, tuple[float, float]]]:
    """What removing the blocks outside `subnet` costs each layer on the calibration blocks, in one forward pass
    of the dense model: per layer and output projection (attention o, MLP down), (||W_removed x_removed||^2,
    ||W x||^2) summed over tokens. Removing a block removes exactly its input features of these projections
    (its q / k / v rows and up / gate rows only feed them), so this is the error of each sub-block's output."""
    from ...capture import _StopForward

    sites = find_sites(model)
    sums: dict[int, dict[str, list[float]]] = {}
    handles = removal_hooks(sites, layout, subnet, sums)
    last = max([*subnet.attn, *subnet.mlp], default=None)
    if last is None:
        return {}

    def stop(mod, args, out):
        raise _StopForward

    handles.append(sites.mlp[last].layer.register_forward_hook(stop))  # nothing after the last layer is needed
    _calibration_pass(model, data, handles, batch_size, progress, desc="removal error")
    return {i: {n: (v[0], v[1]) for n, v in d.items()} for i, d in sums.items()}


def removal_hooks(sites, layout, subnet, sums: dict) -> list:
    """Forward pre-hooks on the attention o / MLP down projections of `subnet`'s layers that add, per batch, each
    layer's (||W_removed x_removed||^2, ||W x||^2) to sums[layer][projection] (the layer-by-layer mode hooks one
    layer at a time with a one-layer subnet). Returns the handles."""
    from ..twist import attn_feature_blocks, mlp_feature_blocks

    def hook(i: int, name: str, W: Tensor, removed: Tensor):
        def fn(mod, args):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).float()
            acc = sums.setdefault(i, {}).setdefault(name, [0.0, 0.0])
            acc[0] += float((x[:, removed] @ W[:, removed].T).pow(2).sum())
            acc[1] += float((x @ W.T).pow(2).sum())
        return fn

    handles = []
    for i, kept in subnet.attn.items():
        W, _ = linear_weight(sites.attn[i].o_proj)
        removed = ~torch.isin(attn_feature_blocks(sites.attn[i]), torch.tensor(kept)).to(W.device)
        handles.append(sites.attn[i].o_proj.register_forward_pre_hook(hook(i, "attn.o", W.detach().float(), removed)))
    for i, kept in subnet.mlp.items():
        W, _ = linear_weight(sites.mlp[i].down_proj)
        removed = ~torch.isin(mlp_feature_blocks(layout.mlp_h[i], layout.R), torch.tensor(kept)).to(W.device)
        handles.append(sites.mlp[i].down_proj.register_forward_pre_hook(
            hook(i, "ffn.down", W.detach().float(), removed)))
    return handles

