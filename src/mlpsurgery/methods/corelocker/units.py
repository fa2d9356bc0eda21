"""The units CoreLocker ranks and extracts, grouped per layer-level place: weights, MLP neurons and
attention heads of transformers (through the sites layer), norm channels, and the neurons / filters of
plain PyTorch models with the norm channel and consumers that read them (channel links)."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor, nn

from ...errors import MLPSurgeryError, UnsupportedArchitectureError
from ...sites import AttnSite, MLPSite, find_sites, generic_layers
from .config import CoreLockerConfig


Members = list[tuple[str, Tensor, float]]  # (parameter name, flat positions, value written when locked)


@dataclass
class UnitGroup:
    """The units of one layer-level place (a weight matrix, a layer's MLP or attention, a norm, a
    conv layer): their indicator scores and, for chosen unit ids, the parameter entries they own."""

    name: str
    scores: Tensor | Callable[[], Tensor]  # (n_units,), or computed on demand (weight units: one copy per group
    members: Callable[[Tensor], Members]   # at a time, never all of a large model's |w| at once)
    size: int | None = None  # n_units, where scores is computed on demand

    def score(self) -> Tensor:
        return self.scores() if callable(self.scores) else self.scores

    def __len__(self) -> int:
        return self.size if self.size is not None else len(self.scores)


def _index(shape) -> Tensor:
    """Flat positions of a tensor of this shape, laid out in that shape."""
    return torch.arange(math.prod(shape)).view(shape)


def _random_scores(n: int, seed: int, group: int) -> Tensor:
    return torch.rand(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + group))


def _param_names(model: nn.Module) -> dict[int, str]:
    return {id(p): n for n, p in model.named_parameters()}


def _weight_group(name: str, p: nn.Parameter, cfg: CoreLockerConfig, g: int) -> UnitGroup:
    if cfg.indicator == "l1":
        def scores() -> Tensor:
            return p.detach().abs().flatten().float()
    else:
        def scores() -> Tensor:
            return _random_scores(p.numel(), cfg.seed, g)
    return UnitGroup(name, scores, lambda ids, name=name: [(name, ids, 0.0)], size=p.numel())


def _is_norm(mod: nn.Module) -> bool:
    w = getattr(mod, "weight", None)
    if not isinstance(w, nn.Parameter) or w.dim() != 1:
        return False
    return isinstance(mod, (nn.LayerNorm, nn.GroupNorm, nn.modules.batchnorm._BatchNorm)) or \
        type(mod).__name__.endswith("Norm")


def _norm_group(prefix: str, mod: nn.Module, plus_one: bool, cfg: CoreLockerConfig, g: int) -> UnitGroup:
    """The channels of one norm as units: removing channel c writes gamma_c so that the channel's scale
    is 0 (-1 where the norm scales by 1 + weight, as Gemma's do) and zeroes beta_c."""
    gamma = mod.weight.detach().float()
    scale = gamma + 1 if plus_one else gamma
    scores = scale.abs() if cfg.indicator != "random" else _random_scores(len(gamma), cfg.seed, g)
    has_bias = isinstance(getattr(mod, "bias", None), nn.Parameter)

    def members(ids: Tensor) -> Members:
        out = [(f"{prefix}.weight", ids, -1.0 if plus_one else 0.0)]
        if has_bias:
            out.append((f"{prefix}.bias", ids, 0.0))
        return out

    return UnitGroup(prefix, scores, members)


# ---- transformers -----------------------------------------------------------------------------------


def _shadow_codes(site: MLPSite | AttnSite, layer_path: str):
    """Canonical weights of `site` whose entries are the flat positions of the layer's parameters
    (read from a float64 copy of the layer holding arange codes), and a decoder code -> (name, pos)."""
    shadow = copy.deepcopy(site.layer)  # a skeleton's layer (meta device) works too: only shapes are read
    names, offsets, off = [], [], 0
    codes: dict[int, nn.Parameter] = {}
    for n, p in shadow.named_parameters():
        codes[id(p)] = nn.Parameter(torch.arange(off, off + p.numel(), dtype=torch.float64).view(p.shape),
                                    requires_grad=False)
        names.append(f"{layer_path}.{n}")
        offsets.append(off)
        off += p.numel()
    for mod in shadow.modules():  # every alias of a shared parameter gets its codes
        for k, p in mod._parameters.items():
            if p is not None:
                mod._parameters[k] = codes[id(p)]
    weights = dataclasses.replace(site, layer=shadow).read().map(lambda t: t.long())
    starts = torch.tensor(offsets)

    def decode(codes: Tensor) -> Members:
        codes = codes.reshape(-1)
        which = torch.searchsorted(starts, codes, right=True) - 1
        return [(names[j], codes[which == j] - offsets[j], 0.0) for j in which.unique().tolist()]

    return weights, decode


def _neuron_group(site: MLPSite, path: str, cfg: CoreLockerConfig, g: int) -> UnitGroup:
    w = site.read()
    if cfg.indicator == "l1":
        scores = w.up.abs().sum(1) + w.down.abs().sum(0)
        if w.gate is not None:
            scores = scores + w.gate.abs().sum(1)
    else:
        scores = _random_scores(w.h, cfg.seed, g)

    def members(ids: Tensor) -> Members:
        codes, decode = _shadow_codes(site, path)
        parts = [codes.up[ids], codes.down[:, ids]]
        parts += [getattr(codes, n)[ids] for n in ("gate", "up_bias", "gate_bias") if getattr(codes, n) is not None]
        return decode(torch.cat([p.reshape(-1) for p in parts]))

    return UnitGroup(f"{path}.mlp", scores.float(), members)


def _head_group(site: AttnSite, path: str, cfg: CoreLockerConfig, g: int) -> UnitGroup:
    w = site.read()
    own_kv = w.n_kv == w.n_heads  # a head owns k/v only without grouped-query attention
    if cfg.indicator == "l1":
        scores = w.q.abs().sum((1, 2)) + w.o.abs().sum((0, 2))
        if own_kv:
            scores = scores + w.k.abs().sum((1, 2)) + w.v.abs().sum((1, 2))
    else:
        scores = _random_scores(w.n_heads, cfg.seed, g)

    def members(ids: Tensor) -> Members:
        codes, decode = _shadow_codes(site, path)
        names = ("q", "q_bias") + (("k", "v", "k_bias", "v_bias") if own_kv else ())
        parts = [codes.o[:, ids]] + [getattr(codes, n)[ids] for n in names if getattr(codes, n) is not None]
        return decode(torch.cat([p.reshape(-1) for p in parts]))

    return UnitGroup(f"{path}.attn", scores.float(), members)


def _transformer_groups(model: nn.Module, cfg: CoreLockerConfig, visit=None) -> list[UnitGroup]:
    """visit(i): a context in which layer i's weights are present (the layer-sequential lock reads it from the
    checkpoint there); neuron, head and norm scores are computed inside it, weight units' on demand."""
    visit = visit or (lambda i: contextlib.nullcontext())
    sites = find_sites(model)
    pnames = _param_names(model)
    paths = {id(m): n for n, m in model.named_modules()}
    if cfg.unit == "filter":
        raise MLPSurgeryError("transformers have no conv filters; use --unit weight, neuron or head")
    if cfg.indicator == "scale" and cfg.unit != "weight":
        raise MLPSurgeryError("the scale indicator ranks normalisation channels, and transformers have no norm "
                              f"per MLP neuron or head; use --indicator scale with --unit weight, or --indicator "
                              f"l1 / random with --unit {cfg.unit}")
    if cfg.unit == "neuron":
        for s in sites.mlp:
            if s.replaced:
                raise MLPSurgeryError(f"layer {s.index}: the MLP was replaced by {type(s.module).__name__}, which has no "
                                      "stock neurons; lock with --unit weight (any weights) or lock before that surgery")
    groups: list[UnitGroup] = []
    if cfg.indicator == "scale":
        for mlp, attn in zip(sites.mlp, sites.attn):
            path = paths[id(mlp.layer)]
            exposed = [m for m in (attn.pre_norm, mlp.pre_norm, mlp.inner_post_norm, mlp.outer_post_norm)
                       if m is not None and _is_norm(m)]  # (OLMo's layer norms carry no weights)
            exposed = [m for j, m in enumerate(exposed) if all(m is not e for e in exposed[:j])]  # Phi-2: one norm
            # norms the sites layer does not name (BERT's attention-output LayerNorm, q/k norms) are
            # found by structure: a module of the layer with a 1-D weight whose class is a norm.
            others = [m for m in mlp.layer.modules() if _is_norm(m) and all(m is not e for e in exposed)]
            with visit(mlp.index):
                for mod in exposed + others:
                    groups.append(_norm_group(paths[id(mod)], mod, sites.spec.norm_plus_one, cfg, len(groups)))
        if not groups:
            raise MLPSurgeryError(f"the scale indicator ranks normalisation channels, and no norm in this "
                                  f"{sites.spec.name} model's layers has a weight to rank; use --indicator l1 or "
                                  "random")
        return groups
    if cfg.unit == "weight":
        for mlp, attn in zip(sites.mlp, sites.attn):
            if mlp.replaced:  # whatever computes the MLP now (fused, nested, DLR-Net ...): its weight tensors
                weights = [p for p in mlp.parameters() if p.dim() >= 2]
            else:
                weights = [mod.weight for mod in mlp.linears().values()]
            weights += [mod.weight for mod in attn.linears().values()]
            for w in weights:
                groups.append(_weight_group(pnames[id(w)], w, cfg, len(groups)))
        if cfg.include_io:
            params = dict(model.named_parameters())
            seen = {id(params[g.name]) for g in groups}
            for gl in generic_layers(model):
                if gl.role in ("input", "output") and id(gl.module.weight) not in seen:
                    seen.add(id(gl.module.weight))
                    groups.append(_weight_group(pnames[id(gl.module.weight)], gl.module.weight, cfg, len(groups)))
        return groups
    for mlp, attn in zip(sites.mlp, sites.attn):
        path = paths[id(mlp.layer)]
        with visit(mlp.index):
            groups.append(_neuron_group(mlp, path, cfg, len(groups)) if cfg.unit == "neuron"
                          else _head_group(attn, path, cfg, len(groups)))
    return groups


# ---- plain PyTorch models ---------------------------------------------------------------------------

_PASS_MODULES = (nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.PReLU, nn.ELU, nn.GELU, nn.SiLU, nn.Mish, nn.Hardswish,
                 nn.Tanh, nn.Sigmoid, nn.Identity, nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d,
                 nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d,
                 nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d, nn.AdaptiveMaxPool1d,
                 nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d)
_PASS_FUNCTIONS = {torch.relu, torch.tanh, torch.sigmoid, nn.functional.relu, nn.functional.relu6,
                   nn.functional.gelu, nn.functional.silu, nn.functional.leaky_relu, nn.functional.elu,
                   nn.functional.dropout, nn.functional.max_pool1d, nn.functional.max_pool2d,
                   nn.functional.avg_pool1d, nn.functional.avg_pool2d, nn.functional.adaptive_avg_pool1d,
                   nn.functional.adaptive_avg_pool2d, nn.functional.adaptive_max_pool2d}
_PASS_METHODS = {"relu", "sigmoid", "tanh", "contiguous", "clone"}
_FLATTEN_METHODS = {"flatten", "view", "reshape"}


@dataclass
class ChannelLinks:
    """What reads the output channels of one conv / linear: the norm right after it and the weight
    layers that consume its channels (`factor` input columns per channel after a flatten)."""

    norm: str | None = None
    consumers: list[tuple[str, int]] = field(default_factory=list)


def _channels_in(mod: nn.Module) -> int | None:
    if isinstance(mod, nn.modules.conv._ConvNd):
        return mod.in_channels if mod.groups == 1 else None
    if isinstance(mod, nn.Linear):
        return mod.in_features
    return None


def _norm_channels(mod: nn.Module) -> int:
    return mod.weight.shape[0]


def _links_fx(model: nn.Module, producers: dict[str, nn.Module]) -> dict[str, ChannelLinks]:
    import torch.fx

    graph = torch.fx.symbolic_trace(model).graph
    modules = dict(model.named_modules())
    links = {}
    for node in graph.nodes:
        if node.op != "call_module" or node.target not in producers:
            continue
        channels = _out_channels(producers[node.target])
        link = ChannelLinks()
        stack = [(u, False) for u in node.users]
        seen = set()
        while stack:
            user, flat = stack.pop()
            if (user, flat) in seen:
                continue
            seen.add((user, flat))
            onward = None
            if user.op == "call_module":
                mod = modules[user.target]
                if _is_norm(mod) and not flat and _norm_channels(mod) == channels and link.norm is None:
                    link.norm, onward = user.target, flat
                elif isinstance(mod, _PASS_MODULES):
                    onward = flat
                elif isinstance(mod, nn.Flatten):
                    onward = True
                elif _channels_in(mod):
                    cin = _channels_in(mod)
                    if not flat and cin == channels:
                        link.consumers.append((user.target, 1))
                    elif flat and isinstance(mod, nn.Linear) and cin % channels == 0:
                        link.consumers.append((user.target, cin // channels))
            elif user.op == "call_function":
                if user.target in _PASS_FUNCTIONS:
                    onward = flat
                elif user.target is torch.flatten:
                    onward = True
            elif user.op == "call_method":
                if user.target in _PASS_METHODS:
                    onward = flat
                elif user.target in _FLATTEN_METHODS:
                    onward = True
            if onward is not None:
                stack.extend((u, onward) for u in user.users)
        links[node.target] = link
    return links


def _links_module_order(layers, producers: dict[str, nn.Module]) -> dict[str, ChannelLinks]:
    """Fallback when tracing fails: the norm right after a layer and the next weight layer, in module
    order, when their channel counts fit."""
    links = {}
    for i, gl in enumerate(layers):
        if gl.name not in producers:
            continue
        channels, link = _out_channels(gl.module), ChannelLinks()
        rest = layers[i + 1:]
        if rest and rest[0].kind in ("batchnorm", "layernorm") and _norm_channels(rest[0].module) == channels:
            link.norm = rest[0].name
        nxt = next((g for g in rest if g.kind in ("linear", "conv")), None)
        cin = _channels_in(nxt.module) if nxt is not None else None
        if cin == channels:
            link.consumers.append((nxt.name, 1))
        elif cin and isinstance(nxt.module, nn.Linear) and isinstance(gl.module, nn.modules.conv._ConvNd) \
                and cin % channels == 0:
            link.consumers.append((nxt.name, cin // channels))
        links[gl.name] = link
    return links


def _out_channels(mod: nn.Module) -> int:
    return mod.out_channels if isinstance(mod, nn.modules.conv._ConvNd) else mod.out_features


def channel_links(model: nn.Module, names: list[str] | None = None) -> dict[str, ChannelLinks]:
    """For each conv / linear layer (or the named ones): its norm channel and its consumers."""
    layers = generic_layers(model)
    producers = {g.name: g.module for g in layers if g.kind in ("linear", "conv") and (names is None or g.name in names)
                 and isinstance(g.module, (nn.Linear, nn.modules.conv._ConvNd))}
    try:
        return _links_fx(model, producers)
    except Exception:  # noqa: BLE001 - any tracing failure (data-dependent control flow) means: use module order
        return _links_module_order(layers, producers)


def _channel_group(model: nn.Module, name: str, link: ChannelLinks, cfg: CoreLockerConfig, g: int) -> UnitGroup | None:
    modules = dict(model.named_modules())
    mod = modules[name]
    weight = mod.weight.detach()
    if cfg.indicator == "l1":
        scores = weight.abs().flatten(1).sum(1).float()
    elif cfg.indicator == "scale":
        if link.norm is None:
            return None  # no scale factor ranks this layer's channels
        scores = modules[link.norm].weight.detach().abs().float()
    else:
        scores = _random_scores(weight.shape[0], cfg.seed, g)

    def members(ids: Tensor) -> Members:
        out = [(f"{name}.weight", _index(weight.shape)[ids].reshape(-1), 0.0)]
        if getattr(mod, "bias", None) is not None:
            out.append((f"{name}.bias", ids, 0.0))
        if link.norm is not None:
            norm = modules[link.norm]
            out.append((f"{link.norm}.weight", ids, 0.0))
            if getattr(norm, "bias", None) is not None:
                out.append((f"{link.norm}.bias", ids, 0.0))
        for cname, factor in link.consumers:
            cw = modules[cname].weight
            cols = (ids[:, None] * factor + torch.arange(factor)).reshape(-1)
            out.append((f"{cname}.weight", _index(cw.shape)[:, cols].reshape(-1), 0.0))
        return out

    return UnitGroup(name, scores, members)


def _generic_groups(model: nn.Module, cfg: CoreLockerConfig) -> list[UnitGroup]:
    layers = generic_layers(model)
    roles = ("input", "hidden", "output") if cfg.include_io else ("hidden",)
    if cfg.unit == "head":
        raise MLPSurgeryError(f"{type(model).__name__} is not a supported transformers model, so it has no attention "
                              "sites; use --unit weight, neuron (linear layers) or filter (conv layers)")
    groups: list[UnitGroup] = []
    if cfg.indicator == "scale" and cfg.unit == "weight":
        for gl in layers:
            if gl.kind in ("batchnorm", "layernorm") and _is_norm(gl.module):
                groups.append(_norm_group(gl.name, gl.module, False, cfg, len(groups)))
        return groups
    if cfg.unit == "weight":
        pnames = _param_names(model)
        for gl in layers:
            if gl.kind in ("linear", "conv") and gl.role in roles:
                groups.append(_weight_group(pnames[id(gl.module.weight)], gl.module.weight, cfg, len(groups)))
        return groups
    kind = "conv" if cfg.unit == "filter" else "linear"
    names = [gl.name for gl in layers if gl.kind == kind and gl.role in roles
             and isinstance(gl.module, (nn.Linear, nn.modules.conv._ConvNd))]
    links = channel_links(model, names)
    for name in names:
        group = _channel_group(model, name, links[name], cfg, len(groups))
        if group is not None:
            groups.append(group)
    return groups


def unit_groups(model: nn.Module, cfg: CoreLockerConfig, visit=None) -> list[UnitGroup]:
    """The eligible units of `model` under `cfg`, grouped per layer-level place (visit: see _transformer_groups)."""
    cfg.validate()
    try:
        groups = _transformer_groups(model, cfg, visit)
    except UnsupportedArchitectureError:
        groups = _generic_groups(model, cfg)
    groups = [g for g in groups if len(g)]
    if not groups:
        raise MLPSurgeryError(f"{type(model).__name__} has no eligible {cfg.unit} units for the {cfg.indicator} "
                              "indicator" + ("" if cfg.include_io else " outside its input and output layers "
                                             "(include_io=True / --include-io to use those too)")
                              + ("; the scale indicator needs a norm layer right after the conv / linear layers"
                                 if cfg.indicator == "scale" else ""))
    return groups
