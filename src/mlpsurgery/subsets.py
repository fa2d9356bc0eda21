"""A model made of per-layer subsets of KV groups and MLP neurons (TwIST's deployment), whole or layer by layer.

`subset_model` builds it from a model in memory. The same computation is split into its parts -- `plan_subsets`
(the checked selections and the config of the result), `subset_skeleton` (the result's structure),
`fill_layer` (one layer's values) -- so that the layer-sequential mode (methods/twist/layerwise.py) builds the
structure once with its parameters on the meta device and fills one decoder layer at a time from a
`layerwise.LayerStream`, writing the same tensors.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .errors import MLPSurgeryError, NotExportableError
from .io import copy_config, history, source_of
from .modules import MODULES


def check_heads_removable(site) -> None:
    """Refuse to remove heads from an attention that holds weights across or per heads besides its projections:
    q / k norms over the whole projection (OLMo 2) change when a head goes, and per-head ones (Command R+) would have
    to be sliced; norms over one head's width (Qwen 3, Gemma 3) are shared by all heads and stay."""
    skip = {id(p) for m in site.projections() for p in m.parameters()}
    after_o = site.spec.o.rpartition(".")[0]  # BERT's attention output block: its LayerNorm acts after the heads merge
    if after_o:
        skip |= {id(p) for p in site.module.get_submodule(after_o).parameters()}
    for name, p in site.module.named_parameters():
        if id(p) not in skip and p.numel() > site.head_dim:
            raise NotExportableError(
                f"layer {site.index}: its attention holds {name} {tuple(p.shape)}, weights across or per heads that "
                "removing heads would change; keep every head (narrow the MLP only: --parts ffn)")


def _checked_subset(name: str, layer: int, idx, n: int) -> list[int]:
    idx = [int(i) for i in idx]
    if not idx or len(set(idx)) != len(idx) or not all(0 <= i < n for i in idx):
        raise MLPSurgeryError(f"layer {layer}: the {name} to keep must be distinct indices in 0..{n - 1}, "
                              f"at least one; got {idx[:8]}{' ...' if len(idx) > 8 else ''}")
    return idx


def _release(modules) -> None:
    """Give up the parameters of `modules` and their children (a consumed model's layer): each becomes an empty
    tensor of its dtype, and the freed heap pages go back to the OS (a layer's smaller tensors come from the heap,
    where glibc would otherwise keep them)."""
    from .resources import trim_heap

    for mod in modules:
        for p in mod.parameters():
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
    trim_heap()


@dataclass
class SubsetPlan:
    """What a subset model keeps: every layer's KV groups and MLP neurons (all of them where not named), the
    source's sites, the config of the result, and the source's state-dict prefixes whose tensors are rewritten."""
    sites: Any
    groups: dict[int, list[int]]
    neurons: dict[int, list[int]]
    config: Any
    rewritten: tuple[str, ...]


def plan_subsets(model: nn.Module, attn_groups: dict[int, Any] | None = None,
                 mlp_neurons: dict[int, Any] | None = None) -> SubsetPlan:
    """The checked selections of `subset_model` and the config of its result (from shapes alone: `model` may be a
    skeleton on the meta device)."""
    from .sites import find_sites

    sites = find_sites(model)
    spec, n_layers = sites.spec, len(sites)
    for name, sel in (("attention", attn_groups), ("MLP", mlp_neurons)):
        bad = sorted(i for i in (sel or {}) if not 0 <= int(i) < n_layers)
        if bad:
            raise MLPSurgeryError(f"{name} subsets name layers {bad}; the model has layers 0-{n_layers - 1}")
    groups = {int(i): _checked_subset("KV groups", int(i), g, sites.attn[int(i)].n_kv)
              for i, g in (attn_groups or {}).items()}
    neurons = {int(i): _checked_subset("MLP neurons", int(i), n, sites.mlp[int(i)].h)
               for i, n in (mlp_neurons or {}).items()}
    # Every layer is rewritten (unnamed ones whole), so a model already holding subsets narrows again.
    for i in range(n_layers):
        groups.setdefault(i, list(range(sites.attn[i].n_kv)))
        neurons.setdefault(i, list(range(sites.mlp[i].h)))
    for i in range(n_layers):
        if len(groups[i]) != sites.attn[i].n_kv:
            check_heads_removable(sites.attn[i])
    kv_after = [len(groups[i]) for i in range(n_layers)]
    h_after = [len(neurons[i]) for i in range(n_layers)]

    config = copy_config(model.config)
    config_kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    if len(set(kv_after)) == 1 and spec.heads_in_config:
        if kv_after[0] != config_kv:
            config.head_dim = sites.attn[0].head_dim
            config.num_attention_heads = kv_after[0] * (config.num_attention_heads // config_kv)
            if getattr(config, "num_key_value_heads", None):
                config.num_key_value_heads = kv_after[0]
    elif any(k != config_kv for k in kv_after) and not spec.heads_per_layer:
        why = ("every layer must keep the same number of heads, which its config then states" if spec.heads_in_config
               else "head_dim is tied to hidden_size / heads and the attention splits its projections by the "
                    "config's head count")
        raise NotExportableError(
            f"{spec.name} cannot hold fewer attention heads here: {why}. Keep all heads (narrow the MLP only), "
            "or use an architecture whose attention infers its head count (llama, mistral, qwen2/3, gemma)")
    if len(set(h_after)) == 1:
        setattr(config, spec.width_key, h_after[0])
    path_of = {id(m): p for p, m in model.named_modules()}
    rewritten = [path_of[id(m)] + "." for i in groups for m in sites.attn[i].projections()]
    rewritten += [path_of[id(m)] + "." for i in neurons for m in sites.mlp[i].modules()]  # (or what replaced it)
    return SubsetPlan(sites, groups, neurons, config, tuple(rewritten))


def subset_skeleton(model: nn.Module, plan: SubsetPlan, empty: bool = False) -> nn.Module:
    """The result's structure: the stock class built from the plan's config on `model`'s device and dtype, with
    narrower attention where the config cannot state a layer's heads. Its values are not written (empty=True:
    its parameters are on the meta device, buffers computed: a skeleton to fill one layer at a time)."""
    import transformers

    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # older transformers
        no_init_weights = contextlib.nullcontext
    param = next(model.parameters())
    if empty:
        from accelerate import init_empty_weights

        where = init_empty_weights(include_buffers=False)
    else:
        where = torch.device(param.device)
    with where, no_init_weights():
        new = getattr(transformers, type(model).__name__)._from_config(plan.config)
    new.to(param.dtype)
    new.tie_weights()

    from .sites import find_sites

    spec = plan.sites.spec
    new_sites = find_sites(new)
    new_path = {id(m): p for p, m in new.named_modules()}
    with no_init_weights():  # (the narrower projections are written next: initialising them would touch their
        _narrow_attention(new, new_sites, new_path, plan, spec)  # memory before the source's is given up)
    return new


def _narrow_attention(new: nn.Module, new_sites, new_path: dict, plan: SubsetPlan, spec) -> None:
    for i, g in plan.groups.items():
        site = new_sites.attn[i]
        if site.n_kv != len(g) and spec.narrow_attn:  # the stock attention would split by the config's count
            parent, _, name = new_path[id(site.module)].rpartition(".")
            setattr(new.get_submodule(parent), name, MODULES[spec.narrow_attn].narrowed(site.module, len(g)))
        elif site.n_kv != len(g):
            n_kv = site.n_kv
            for role, mod in site.linears().items():
                if type(mod) is not nn.Linear:
                    raise NotExportableError(f"layer {i}: the attention projection {role} is a "
                                             f"{type(mod).__name__}, which cannot be narrowed to fewer heads")
                fan_in, fan_out = mod.in_features, mod.out_features
                if role == "o":
                    fan_in = fan_in // n_kv * len(g)
                else:
                    fan_out = fan_out // n_kv * len(g)
                site.replace_linear(role, nn.Linear(fan_in, fan_out, bias=mod.bias is not None,
                                                    device=mod.weight.device, dtype=mod.weight.dtype))


def fill_layer(plan: SubsetPlan, new_sites, i: int, attention: bool = True, mlp: bool = True,
               consume: bool = False) -> None:
    """Write layer i's kept KV groups (attention=True) and MLP neurons (mlp=True) from the source's sites into the
    result's. consume=True: the source layer's tensors that were read are released."""
    if attention:
        new_sites.attn[i].write(plan.sites.attn[i].read().select_groups(plan.groups[i]))
        if consume:
            _release(plan.sites.attn[i].projections())
    if mlp:
        new_sites.mlp[i].write(plan.sites.mlp[i].read().select(plan.neurons[i]))
        if consume:
            _release(plan.sites.mlp[i].modules())


def carry_over(model: nn.Module, new: nn.Module) -> None:
    """The source's history, source record and generation config onto the result, and its train / eval mode."""
    new._mlpsurgery_history = history(model)
    new._mlpsurgery_source = source_of(model)
    if getattr(model, "generation_config", None) is not None:
        new.generation_config = copy.deepcopy(model.generation_config)
    new.train(model.training)


def subset_model(model: nn.Module, attn_groups: dict[int, Any] | None = None,
                 mlp_neurons: dict[int, Any] | None = None, consume: bool = False) -> nn.Module:
    """A new model whose layer i keeps only the KV groups `attn_groups[i]` (each with all its query heads;
    without grouped-query attention a group is one head) and the MLP inner neurons `mlp_neurons[i]`, in the
    order given; layers not named keep all of theirs, and every other tensor is copied. `model` is not touched.

    Where every layer ends up with the same numbers, the result is a stock model built from a config with
    fewer heads / a smaller intermediate size, so plain `from_pretrained` loads what `save` writes. Otherwise it
    is the stock class with narrower projections in the reduced layers (`save` records them, `load` rebuilds
    them). A model on the meta device gives a model on the meta device (a skeleton for `to_empty`).
    consume=True: `model` is given up -- each layer's attention and MLP tensors are released once the new layer
    holds its subset, so the two models are not whole in memory together (the caller must not use `model` after).
    Where the stock attention takes its head count from the config (gpt2, opt, phi3: `ArchSpec.narrow_attn`)
    and the config cannot state the layer's count, a layer with fewer heads gets the registered attention
    whose head count follows its projections (modules/attention.py); `save` records it, `load` rebuilds it.
    """
    from .sites import find_sites

    plan = plan_subsets(model, attn_groups, mlp_neurons)
    new = subset_skeleton(model, plan)
    src_state = model.state_dict()
    with torch.no_grad():
        for k, v in new.state_dict().items():
            if not k.startswith(plan.rewritten):
                v.copy_(src_state[k])
    del src_state  # (its references would keep every released tensor alive)
    new_sites = find_sites(new)
    # every attention, then every MLP (of a consumed model, so released: measured lower than layer by layer, where
    # the freed attention and MLP tensors interleave in the heap); a skeleton has no attention values to move
    if next(model.parameters()).device.type != "meta":
        for i in range(len(new_sites)):
            fill_layer(plan, new_sites, i, mlp=False, consume=consume)
    for i in range(len(new_sites)):
        fill_layer(plan, new_sites, i, attention=False, consume=consume)
    carry_over(model, new)
    return new
