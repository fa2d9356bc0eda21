"""CoreLocker (papers/corelocker.txt): extract the most important weights of a trained model as an
access key. Without the key the model falls to a chosen utility (down to chance, 1/C); with it the
model is restored bit for bit.

Extraction (the paper's Definition 1): rank candidate *units* by an *indicator* and zero the top
`ratio` fraction of them (the paper's extraction ratio 1 - alpha; `ratio` counts units, not bytes).

    unit     weight   one entry of a weight matrix
             neuron   an MLP inner neuron: its up/gate rows, biases and down column (transformers), or
                      an output neuron of a hidden Linear with what consumes it (plain PyTorch models)
             head     an attention head: its q slice and output-projection slice, and its k/v slices
                      when it has its own KV group (without grouped-query attention)
             filter   an output channel of a hidden conv: the filter, its bias, the normalisation
                      channel after it and the next conv's / linear's input slice that reads its
                      feature map (the paper's steps 1-4)
    indicator l1      |w| for a weight, the sum of |w| over the unit's weights otherwise
             scale    normalisation scale factors |gamma|: for filters / neurons, the gamma of the
                      norm channel right after them (BatchNorm in CNNs); with unit=weight, and always
                      in transformers, the units are the norm channels themselves (gamma_c and beta_c of
                      every LayerNorm / RMSNorm inside the layers: the transformer analogue of a BN
                      channel). No per-weight computation.
             random   the paper's baseline: the same number of units, uniformly at random (seeded)
    scope    global   one ranking across every eligible layer (the paper's default)
             layer    the top `ratio` of each layer (each matrix, MLP, attention or norm) separately

Input and output layers (embeddings, LM head / classifier; in plain models the first and last weight
layer) are left alone unless `include_io`. Transformers are reached only through the sites layer:
weights through `MLPSite.read/linears` and `AttnSite.read/linears`, positions inside fused or
transposed storage by reading a float64 shadow copy of the layer whose parameters hold their own flat
indices (so no layout knowledge is repeated here). Plain PyTorch models go through `generic_layers`;
which norm channel and which consumer belong to a filter comes from a `torch.fx` trace of the model
(followed through activations, pooling, dropout and flatten, stopping at anything that mixes channels
such as a residual add), falling back, when the model cannot be traced, to module order (the norm and
the weight layer that come next, when their channel counts match).

The key is one safetensors file: per parameter the extracted positions (int32 indices, or a packed
bit mask when that is smaller) and the original values, with a JSON header holding the config, a
SHA-256 of every tensor of the locked model, the fingerprint of the original model and a SHA-256 of
the payload. With a passphrase the whole key is sealed with AES-256-GCM under a scrypt-derived key
(the `cryptography` package); the header of the sealed file holds only the KDF parameters, salt and
nonce, and is authenticated as associated data. Unlocking verifies the key, checks that the model is
exactly the locked model the key was made for, restores, checks the result against the original's
fingerprint, and only then writes anything.
"""

from __future__ import annotations

import base64
import contextlib
import copy
import dataclasses
import hashlib
import json
import math
import os
import secrets
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from torch import Tensor, nn

from ..errors import IntegrityError, MLPSurgeryError, UnsupportedArchitectureError
from ..io import check_out, record
from ..sites import AttnSite, MLPSite, find_sites, generic_layers
from ..report import save_figure

INDICATORS = ("l1", "scale", "random")
UNITS = ("weight", "neuron", "head", "filter")
SCOPES = ("global", "layer")
KEY_FORMAT = "mlpsurgery-corelocker-key"
SEALED_FORMAT = "mlpsurgery-corelocker-sealed-key"
KEY_VERSION = 1
PASSPHRASE_ENV = "MLPSURGERY_PASSPHRASE"
# scrypt at N=2^15, r=8: 32 MiB and ~0.1 s per guess; the header is checked against these bounds so
# that an edited header cannot make unlocking allocate without limit.
SCRYPT = {"n": 2 ** 15, "r": 8, "p": 1}
SCRYPT_MAX = {"n": 2 ** 20, "r": 16, "p": 4}


@dataclass
class CoreLockerConfig:
    """What to extract. Defaults follow the paper: the l1 indicator, a global ranking, 5% extracted,
    input and output layers kept."""

    ratio: float = 0.05  # fraction of eligible units extracted (the paper's 1 - alpha)
    indicator: str = "l1"  # l1 | scale | random
    unit: str = "weight"  # weight | neuron | head | filter
    scope: str = "global"  # global | layer
    include_io: bool = False  # also extract from embeddings / output layer (first / last layer)
    seed: int = 0  # for the random indicator

    def validate(self) -> None:
        for name, value, allowed in (("indicator", self.indicator, INDICATORS), ("unit", self.unit, UNITS),
                                     ("scope", self.scope, SCOPES)):
            if value not in allowed:
                raise MLPSurgeryError(f"{name} must be one of {', '.join(allowed)}, not {value!r}")
        if not 0.0 <= self.ratio <= 1.0:
            raise MLPSurgeryError(f"the extraction ratio must be in [0, 1], not {self.ratio}")


# --------------------------------------------------------------------------------------------------
# Units


Members = list[tuple[str, Tensor, float]]  # (parameter name, flat positions, value written when locked)


@dataclass
class UnitGroup:
    """The units of one layer-level place (a weight matrix, a layer's MLP or attention, a norm, a
    conv layer): their indicator scores and, for chosen unit ids, the parameter entries they own."""

    name: str
    scores: Tensor  # (n_units,)
    members: Callable[[Tensor], Members]

    def __len__(self) -> int:
        return len(self.scores)


def _index(shape) -> Tensor:
    """Flat positions of a tensor of this shape, laid out in that shape."""
    return torch.arange(math.prod(shape)).view(shape)


def _random_scores(n: int, seed: int, group: int) -> Tensor:
    return torch.rand(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + group))


def _param_names(model: nn.Module) -> dict[int, str]:
    return {id(p): n for n, p in model.named_parameters()}


def _weight_group(name: str, p: nn.Parameter, cfg: CoreLockerConfig, g: int) -> UnitGroup:
    scores = p.detach().abs().flatten().float() if cfg.indicator == "l1" else _random_scores(p.numel(), cfg.seed, g)
    return UnitGroup(name, scores, lambda ids, name=name: [(name, ids, 0.0)])


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
    shadow = copy.deepcopy(site.layer)
    names, offsets, off = [], [], 0
    with torch.no_grad():
        for n, p in shadow.named_parameters():
            p.data = torch.arange(off, off + p.numel(), dtype=torch.float64).view(p.shape)
            names.append(f"{layer_path}.{n}")
            offsets.append(off)
            off += p.numel()
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


def _transformer_groups(model: nn.Module, cfg: CoreLockerConfig) -> list[UnitGroup]:
    sites = find_sites(model)
    pnames = _param_names(model)
    paths = {id(m): n for n, m in model.named_modules()}
    if cfg.unit == "filter":
        raise MLPSurgeryError("transformers have no conv filters; use --unit weight, neuron or head")
    if cfg.indicator == "scale" and cfg.unit != "weight":
        raise MLPSurgeryError("the scale indicator ranks normalisation channels, and transformers have no norm "
                              f"per MLP neuron or head; use --indicator scale with --unit weight, or --indicator "
                              f"l1 / random with --unit {cfg.unit}")
    for s in sites.mlp:
        if s.replaced:
            raise MLPSurgeryError(f"layer {s.index}: the MLP was replaced by {type(s.module).__name__}; CoreLocker "
                                  "extracts from stock MLPs (lock the model before other surgery)")
    groups: list[UnitGroup] = []
    if cfg.indicator == "scale":
        for mlp, attn in zip(sites.mlp, sites.attn):
            path = paths[id(mlp.layer)]
            exposed = [m for m in (attn.pre_norm, mlp.pre_norm, mlp.inner_post_norm, mlp.outer_post_norm) if m is not None]
            # norms the sites layer does not name (BERT's attention-output LayerNorm, q/k norms) are
            # found by structure: a module of the layer with a 1-D weight whose class is a norm.
            others = [m for m in mlp.layer.modules() if _is_norm(m) and all(m is not e for e in exposed)]
            for mod in exposed + others:
                groups.append(_norm_group(paths[id(mod)], mod, sites.spec.norm_plus_one, cfg, len(groups)))
        return groups
    if cfg.unit == "weight":
        for mlp, attn in zip(sites.mlp, sites.attn):
            for mod in list(mlp.linears().values()) + list(attn.linears().values()):
                groups.append(_weight_group(pnames[id(mod.weight)], mod.weight, cfg, len(groups)))
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


def unit_groups(model: nn.Module, cfg: CoreLockerConfig) -> list[UnitGroup]:
    """The eligible units of `model` under `cfg`, grouped per layer-level place."""
    cfg.validate()
    try:
        groups = _transformer_groups(model, cfg)
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


# --------------------------------------------------------------------------------------------------
# Ranking and extraction


Extraction = dict[str, tuple[Tensor, float]]  # parameter name -> (sorted flat positions, locked value)


class Ranking:
    """The order in which units are extracted, computed once: extracting a ratio r takes the first
    round(r * n) units (globally, or of each group), so every ratio up to `max_ratio` reuses it."""

    def __init__(self, groups: list[UnitGroup], scope: str, max_ratio: float):
        self.groups, self.scope = groups, scope
        self.sizes = [len(g) for g in groups]
        self.n_units = sum(self.sizes)
        if scope == "global":
            scores = torch.cat([g.scores.float().cpu() for g in groups])
            k = min(self.n_units, math.ceil(max_ratio * self.n_units))
            top = torch.topk(scores, k, sorted=True).indices if k else torch.zeros(0, dtype=torch.long)
            starts = torch.tensor([0] + self.sizes[:-1]).cumsum(0)
            gid = torch.searchsorted(starts, top, right=True) - 1
            self.order = (gid, top - starts[gid])
        else:
            self.order = [torch.topk(g.scores.float().cpu(), min(len(g), math.ceil(max_ratio * len(g))),
                                     sorted=True).indices for g in groups]
        self.max_ratio = max_ratio

    def count(self, ratio: float) -> int:
        """Units extracted at `ratio`."""
        if self.scope == "global":
            return int(round(ratio * self.n_units))
        return sum(int(round(ratio * n)) for n in self.sizes)

    def take(self, ratio: float) -> tuple[Extraction, int]:
        """The parameter entries of the units extracted at `ratio`, and how many units that is."""
        if ratio > self.max_ratio + 1e-12:
            raise MLPSurgeryError(f"ratio {ratio} exceeds the ranking's maximum {self.max_ratio}")
        chosen: list[tuple[int, Tensor]] = []
        if self.scope == "global":
            k = self.count(ratio)
            gid, uid = self.order[0][:k], self.order[1][:k]
            chosen = [(g, uid[gid == g]) for g in gid.unique().tolist()]
        else:
            chosen = [(g, o[:int(round(ratio * self.sizes[g]))]) for g, o in enumerate(self.order)]
            chosen = [(g, ids) for g, ids in chosen if len(ids)]
        parts: dict[str, list[Tensor]] = {}
        fills: dict[str, float] = {}
        for g, ids in chosen:
            for name, pos, fill in self.groups[g].members(ids.sort().values):
                parts.setdefault(name, []).append(pos.reshape(-1).long())
                fills[name] = fill
        out = {n: (torch.unique(torch.cat(ps)), fills[n]) for n, ps in parts.items()}
        return out, sum(len(ids) for _, ids in chosen)


def _flat(p: Tensor, name: str) -> Tensor:
    if not p.is_contiguous():
        raise MLPSurgeryError(f"parameter {name} is not contiguous; call .contiguous() on the model's parameters")
    return p.detach().view(-1)


def apply_extraction(model: nn.Module, extraction: Extraction) -> dict[str, Tensor]:
    """Write the locked values; returns the original values at those positions."""
    params = dict(model.named_parameters())
    originals = {}
    with torch.no_grad():
        for name, (pos, fill) in extraction.items():
            flat = _flat(params[name], name)
            pos = pos.to(flat.device)
            originals[name] = flat[pos].cpu().clone()
            flat[pos] = fill
    return originals


def restore_values(model: nn.Module, positions: dict[str, Tensor], values: dict[str, Tensor]) -> None:
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, pos in positions.items():
            flat = _flat(params[name], name)
            flat[pos.to(flat.device)] = values[name].to(device=flat.device, dtype=flat.dtype)


# --------------------------------------------------------------------------------------------------
# Fingerprints


def tensor_hashes(model: nn.Module) -> dict[str, str]:
    """SHA-256 of every tensor of the state dict (name, dtype and shape included)."""
    out = {}
    for name, t in model.state_dict().items():
        t = t.detach().cpu().contiguous()
        h = hashlib.sha256(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        out[name] = h.hexdigest()
    return out


def fingerprint(hashes: dict[str, str]) -> str:
    return hashlib.sha256("\n".join(f"{n}:{h}" for n, h in sorted(hashes.items())).encode()).hexdigest()


# --------------------------------------------------------------------------------------------------
# Lock / unlock in memory


@dataclass
class Key:
    """What the locked model is missing: per parameter the extracted positions and original values,
    and a header (config, counts, fingerprints of the locked and of the original model)."""

    positions: dict[str, Tensor]
    values: dict[str, Tensor]
    header: dict

    @property
    def entries(self) -> int:
        return sum(len(p) for p in self.positions.values())


def lock_key(model: nn.Module, cfg: CoreLockerConfig, ranking: Ranking | None = None) -> Key:
    """Extract the key from `model` in place (the model becomes the locked model). Returns the key."""
    cfg.validate()
    original = fingerprint(tensor_hashes(model))
    ranking = ranking or Ranking(unit_groups(model, cfg), cfg.scope, cfg.ratio)
    extraction, n_units = ranking.take(cfg.ratio)
    values = apply_extraction(model, extraction)
    locked = tensor_hashes(model)
    header = {
        "format": KEY_FORMAT, "version": KEY_VERSION, "config": asdict(cfg),
        "model_class": type(model).__name__, "model_type": getattr(getattr(model, "config", None), "model_type", None),
        "units_extracted": n_units, "units_eligible": ranking.n_units,
        "entries": sum(len(p) for p, _ in extraction.values()),
        "model_params": sum(p.numel() for p in model.parameters()),
        "locked_fingerprint": fingerprint(locked), "locked_tensors": locked, "original_fingerprint": original,
    }
    record(model, "corelocker", asdict(cfg), units_extracted=n_units, units_eligible=ranking.n_units,
           locked_fingerprint=header["locked_fingerprint"])
    return Key({n: p for n, (p, _) in extraction.items()}, values, header)


def unlock_key(model: nn.Module, key: Key) -> None:
    """Restore `model` in place from `key`, bit for bit. Refuses (changing nothing) a model that is
    not exactly the locked model of this key, and a key whose values do not give back the original."""
    hashes = tensor_hashes(model)
    if fingerprint(hashes) != key.header["locked_fingerprint"]:
        expected = key.header.get("locked_tensors", {})
        differ = sorted(n for n in set(hashes) | set(expected) if hashes.get(n) != expected.get(n))
        raise IntegrityError(
            "this key does not belong to this model, or the locked model was modified after locking: "
            f"{len(differ)} tensor(s) differ from the locked model the key was made for "
            f"({', '.join(differ[:4])}{' ...' if len(differ) > 4 else ''}); use the key written with this model")
    params = dict(model.named_parameters())
    for name, pos in key.positions.items():
        if name not in params or len(pos) != len(key.values[name]) or \
                (len(pos) and int(pos.max()) >= params[name].numel()):
            raise IntegrityError(f"the key's entry for {name} does not fit the model: the key was altered")
    before = {n: _flat(params[n], n)[pos.to(params[n].device)].cpu().clone() for n, pos in key.positions.items()}
    restore_values(model, key.positions, key.values)
    if fingerprint(tensor_hashes(model)) != key.header["original_fingerprint"]:
        restore_values(model, key.positions, before)
        raise IntegrityError("the key's values do not restore the original model (its fingerprint differs): the "
                             "key was altered; use an intact copy of the key")
    record(model, "corelocker-unlock", {}, original_fingerprint=key.header["original_fingerprint"])


# --------------------------------------------------------------------------------------------------
# Key files


def _encode_positions(pos: Tensor, numel: int) -> tuple[str, Tensor]:
    """int32 indices, or a packed bit mask where that is smaller (dense extractions)."""
    if (numel + 7) // 8 < 4 * len(pos):
        mask = np.zeros(numel, dtype=bool)
        mask[pos.numpy()] = True
        return "mask", torch.from_numpy(np.packbits(mask))
    return "index", pos.to(torch.int32 if numel < 2 ** 31 else torch.int64)


def _decode_positions(kind: str, t: Tensor, numel: int) -> Tensor:
    if kind == "mask":
        return torch.from_numpy(np.flatnonzero(np.unpackbits(t.numpy(), count=numel))).long()
    return t.long()


def _payload_hash(tensors: dict[str, Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def key_bytes(key: Key, numels: dict[str, int]) -> bytes:
    """The plain key as safetensors bytes (positions + values, JSON header in the metadata)."""
    from safetensors.torch import save

    tensors, params = {}, []
    for i, name in enumerate(sorted(key.positions)):
        kind, enc = _encode_positions(key.positions[name], numels[name])
        tensors[f"{i}.positions"] = enc.contiguous()
        tensors[f"{i}.values"] = key.values[name].contiguous()
        params.append({"name": name, "numel": numels[name], "encoding": kind, "count": len(key.positions[name])})
    header = dict(key.header, params=params, payload_sha256=_payload_hash(tensors))
    return save(tensors, metadata={"corelocker": json.dumps(header)})


def _parse_safetensors(blob: bytes, what: str) -> tuple[dict, dict[str, Tensor]]:
    from safetensors.torch import load

    if len(blob) < 8:
        raise IntegrityError(f"{what} is truncated ({len(blob)} bytes); use an intact copy")
    n = int.from_bytes(blob[:8], "little")
    if n > len(blob) - 8:
        raise IntegrityError(f"{what} is truncated or is not a CoreLocker key (its header claims {n} bytes, the file "
                             f"has {len(blob) - 8}); use an intact copy")
    try:
        meta = json.loads(blob[8:8 + n]).get("__metadata__") or {}
        tensors = load(blob)
    except Exception as e:  # noqa: BLE001 - any parse error of a foreign or damaged file
        raise IntegrityError(f"{what} is damaged or is not a CoreLocker key ({type(e).__name__}: {e})") from None
    return meta, tensors


def _scrypt_key(passphrase: str, salt: bytes, params: dict) -> bytes:
    from cryptography.hazmat.primitives.kdf.scrypt import Scrypt

    for k, cap in SCRYPT_MAX.items():
        if not isinstance(params.get(k), int) or not 0 < params[k] <= cap:
            raise IntegrityError(f"the sealed key's KDF parameter {k}={params.get(k)!r} is out of range: the header "
                                 "was altered")
    return Scrypt(salt=salt, length=32, n=params["n"], r=params["r"], p=params["p"]).derive(passphrase.encode())


def seal(plain: bytes, passphrase: str) -> bytes:
    """AES-256-GCM under a scrypt key from the passphrase; the header (KDF, salt, nonce) is the AAD."""
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    from safetensors.torch import save

    if not passphrase:
        raise MLPSurgeryError("an empty passphrase cannot protect a key; choose one")
    salt, nonce = secrets.token_bytes(16), secrets.token_bytes(12)
    header = json.dumps({"format": SEALED_FORMAT, "version": KEY_VERSION, "cipher": "AES-256-GCM",
                         "kdf": {"name": "scrypt", **SCRYPT, "salt": base64.b64encode(salt).decode()},
                         "nonce": base64.b64encode(nonce).decode()})
    ct = AESGCM(_scrypt_key(passphrase, salt, SCRYPT)).encrypt(nonce, plain, header.encode())
    return save({"ciphertext": torch.frombuffer(bytearray(ct), dtype=torch.uint8)}, metadata={"sealed": header})


def _unseal(meta: dict, tensors: dict[str, Tensor], passphrase: str | None, what: str) -> bytes:
    from cryptography.exceptions import InvalidTag
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    if passphrase is None:
        raise MLPSurgeryError(f"{what} is encrypted; give its passphrase (environment variable {PASSPHRASE_ENV}, "
                              "or type it at the prompt)")
    text = meta["sealed"]
    try:
        header = json.loads(text)
        salt, nonce = base64.b64decode(header["kdf"]["salt"]), base64.b64decode(header["nonce"])
        ct = tensors["ciphertext"].numpy().tobytes()
    except (KeyError, ValueError, TypeError):
        raise IntegrityError(f"{what}: the sealed key's header is damaged") from None
    try:
        return AESGCM(_scrypt_key(passphrase, salt, header["kdf"])).decrypt(nonce, ct, text.encode())
    except InvalidTag:
        raise IntegrityError(f"{what}: wrong passphrase, or the key file was altered or truncated "
                             "(authentication failed); nothing was changed") from None


def save_key(key: Key, path: str | Path, numels: dict[str, int], passphrase: str | None = None,
             overwrite: bool = False) -> int:
    """Write the key (sealed when a passphrase is given) atomically. Returns its size in bytes."""
    path = Path(path)
    if path.exists() and not overwrite:
        raise MLPSurgeryError(f"{path} already exists; choose another --key or pass --overwrite")
    blob = key_bytes(key, numels)
    if passphrase is not None:
        blob = seal(blob, passphrase)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_bytes(blob)
    os.replace(tmp, path)
    return len(blob)


def read_key(path: str | Path, passphrase: str | None = None) -> Key:
    """Read and verify a key file (unsealing it with the passphrase when it is encrypted)."""
    path = Path(path)
    what = f"key {path}"
    if not path.is_file():
        raise MLPSurgeryError(f"{what} does not exist; give the file written by `mlpsurgery lock key --key`")
    meta, tensors = _parse_safetensors(path.read_bytes(), what)
    if "sealed" in meta:
        meta, tensors = _parse_safetensors(_unseal(meta, tensors, passphrase, what), what)
    if "corelocker" not in meta:
        raise IntegrityError(f"{what} is a safetensors file but not a CoreLocker key")
    try:
        header = json.loads(meta["corelocker"])
        if header.get("format") != KEY_FORMAT:
            raise ValueError("format")
        if header.get("version", 0) > KEY_VERSION:
            raise MLPSurgeryError(f"{what} has key version {header['version']}; upgrade mlpsurgery")
        params = header.pop("params")
        payload = header.pop("payload_sha256")
    except (ValueError, KeyError, AttributeError):
        raise IntegrityError(f"{what}: the key header is damaged or was edited") from None
    if _payload_hash(tensors) != payload:
        raise IntegrityError(f"{what}: the stored positions or values were altered (payload checksum mismatch); use "
                             "an intact copy of the key")
    positions, values = {}, {}
    try:
        for i, p in enumerate(params):
            positions[p["name"]] = _decode_positions(p["encoding"], tensors[f"{i}.positions"], p["numel"])
            values[p["name"]] = tensors[f"{i}.values"]
            if len(positions[p["name"]]) != p["count"] or len(values[p["name"]]) != p["count"]:
                raise ValueError(p["name"])
    except (KeyError, ValueError, TypeError):
        raise IntegrityError(f"{what}: the key's entries do not match its header: the key was altered") from None
    return Key(positions, values, header)


def is_sealed(path: str | Path) -> bool:
    """Whether a key file is encrypted (False for a missing file: reading it then says what is wrong)."""
    path = Path(path)
    if not path.is_file():
        return False
    meta, _ = _parse_safetensors(path.read_bytes(), f"key {path}")
    return "sealed" in meta


def passphrase_from_user(confirm: bool = False) -> str:
    """The passphrase from $MLPSURGERY_PASSPHRASE, else typed at a prompt (never a command-line argument)."""
    import getpass
    import sys

    env = os.environ.get(PASSPHRASE_ENV)
    if env:
        return env
    if not sys.stdin.isatty():
        raise MLPSurgeryError(f"a passphrase is needed: set the environment variable {PASSPHRASE_ENV} or run in a "
                              "terminal to type it")
    first = getpass.getpass("key passphrase: ")
    if confirm and getpass.getpass("repeat the passphrase: ") != first:
        raise MLPSurgeryError("the two passphrases differ; nothing was written")
    if not first:
        raise MLPSurgeryError("the passphrase is empty; nothing was written")
    return first


# --------------------------------------------------------------------------------------------------
# Utility: what the locked model is still good for


@dataclass
class Utility:
    """A calibration measurement of a model: accuracy of a classifier, perplexity of a causal LM, or
    anything a caller supplies. `higher_is_better` tells the bisection which way the curve runs."""

    fn: Callable[[nn.Module], float]
    name: str
    higher_is_better: bool
    data: str = ""
    chance: float | None = None

    def __call__(self, model: nn.Module) -> float:
        return float(self.fn(model))

    def default_tolerance(self, target: float) -> float:
        return 0.025 if self.name.endswith("accuracy") else 0.05 * abs(target)


def balanced_accuracy(model: nn.Module, tokenizer, data, max_len: int = 128, batch_size: int = 32) -> float:
    """Mean per-class recall: 1/C for any constant or random predictor, whatever the class balance
    (plain accuracy of a constant predictor is its class's frequency: 49% for 'earn' in R8 test)."""
    from ..measure.accuracy import predict

    pred = predict(model, tokenizer, data.texts, max_len=max_len, batch_size=batch_size, progress=False)
    labels = torch.tensor(data.labels)
    recalls = [float((pred[labels == c] == c).float().mean()) for c in labels.unique().tolist()]
    return sum(recalls) / len(recalls)


def classifier_utility(tokenizer, data, max_len: int = 128, batch_size: int = 32, balanced: bool = False) -> Utility:
    from ..measure.accuracy import accuracy

    if balanced:
        return Utility(lambda m: balanced_accuracy(m, tokenizer, data, max_len, batch_size), "balanced_accuracy", True,
                       f"{data.name or 'labelled set'} ({len(data)} examples)", 1 / data.num_classes)
    return Utility(lambda m: accuracy(m, tokenizer, data, max_len=max_len, batch_size=batch_size, progress=False),
                   "accuracy", True, f"{data.name or 'labelled set'} ({len(data)} examples)", 1 / data.num_classes)


def lm_utility(sequences: list[Tensor], block_len: int = 256, max_tokens: int | None = 4096) -> Utility:
    from ..measure.perplexity import perplexity

    return Utility(lambda m: perplexity(m, sequences, block_len=block_len, max_tokens=max_tokens, progress=False).ppl,
                   "perplexity", False, f"{max_tokens or 'all'} held-out tokens, windows of {block_len}")


def default_utility(model: nn.Module, tokenizer, data: str | None = None, size: int | None = None) -> Utility:
    """Accuracy on a labelled calibration set (default: 256 examples of Reuters R8 train) for a model
    with a classification head; perplexity on held-out text (default: the first 4096 tokens of
    Persuasion) for a causal LM."""
    from ..data import load_corpus, read_labelled
    from ..measure.perplexity import is_causal_lm

    if type(model).__name__.endswith("ForSequenceClassification"):
        labelled = read_labelled(data or "r8-train")
        if labelled.num_classes != model.num_labels:
            raise MLPSurgeryError(f"the calibration set has {labelled.num_classes} classes, the model's head "
                                  f"{model.num_labels}; give the labelled set it was trained for with --data")
        n = size or 256
        return classifier_utility(tokenizer, labelled.sample(n, seed=0) if len(labelled) > n else labelled)
    if is_causal_lm(model):
        corpus = load_corpus(data, tokenizer)
        return lm_utility(corpus.heldout, max_tokens=size or 4096)
    raise MLPSurgeryError(f"{type(model).__name__} has neither a classification head nor a language-model head, so "
                          "there is no utility to calibrate; fine-tune a head first or use --ratio")


# --------------------------------------------------------------------------------------------------
# Granular utility control: the ratio -> utility curve and bisection to a target


@contextlib.contextmanager
def extracted(model: nn.Module, ranking: Ranking, ratio: float):
    """Within the block the model has the units of `ratio` extracted; afterwards it is restored exactly.
    Yields the number of units extracted."""
    extraction, n = ranking.take(ratio)
    originals = apply_extraction(model, extraction)
    try:
        yield n
    finally:
        restore_values(model, {k: p for k, (p, _) in extraction.items()}, originals)


def evaluate_at(model: nn.Module, ranking: Ranking, ratio: float, utility: Utility) -> tuple[float, int]:
    """Utility of the model with the units of `ratio` extracted; the model is restored afterwards."""
    with extracted(model, ranking, ratio) as n:
        return utility(model), n


def utility_curve(model: nn.Module, cfg: CoreLockerConfig, ratios, utility: Utility, progress: bool = True,
                  ranking: Ranking | None = None) -> list[dict]:
    """Utility at each extraction ratio (the paper's Tables 5-6 / Fig. 6); the model is left unchanged."""
    from tqdm.auto import tqdm

    ratios = sorted(float(r) for r in ratios)
    ranking = ranking or Ranking(unit_groups(model, cfg), cfg.scope, max(ratios))
    rows = []
    for r in tqdm(ratios, desc="utility curve", disable=not progress):
        u, n = evaluate_at(model, ranking, r, utility)
        rows.append({"ratio": r, "units": n, utility.name: u})
    return rows


@dataclass
class RatioSearch:
    ratio: float
    utility: float
    within_tolerance: bool
    target: float
    tolerance: float
    curve: list[dict]  # every evaluated point, by ratio
    ranking: Ranking = field(repr=False)

    def as_dict(self) -> dict:
        return {"ratio": self.ratio, "utility": self.utility, "within_tolerance": self.within_tolerance,
                "target": self.target, "tolerance": self.tolerance, "curve": self.curve}


def find_ratio(model: nn.Module, cfg: CoreLockerConfig, utility: Utility, target: float,
               tolerance: float | None = None, max_ratio: float = 0.5, iterations: int = 14,
               progress: bool = True) -> RatioSearch:
    """The extraction ratio whose utility lands within `tolerance` of `target`, by bisection over
    log(ratio) on the monotone ratio -> utility curve (falling accuracy, rising perplexity). The model
    is left unchanged. Returns the closest point found when no ratio lands within the tolerance."""
    from tqdm.auto import tqdm

    tol = utility.default_tolerance(target) if tolerance is None else tolerance
    ranking = Ranking(unit_groups(model, cfg), cfg.scope, max_ratio)
    sign = 1.0 if utility.higher_is_better else -1.0

    def side(u: float) -> int:
        """+1: still too useful (extract more), -1: too degraded, 0: on target."""
        return 0 if abs(u - target) <= tol else (1 if sign * (u - target) > 0 else -1)

    curve: list[dict] = []

    def point(r: float) -> float:
        u, n = evaluate_at(model, ranking, r, utility)
        curve.append({"ratio": r, "units": n, utility.name: u})
        bar.update(1)
        return u

    bar = tqdm(total=iterations + 2, desc="target utility", disable=not progress)
    try:
        u0 = point(0.0)
        if side(u0) < 0:
            raise MLPSurgeryError(f"the target {utility.name} {target:g} is beyond the original model's {u0:.4g}; "
                                  "no extraction can reach it")
        best = 0.0
        if side(u0) != 0:
            u_hi = point(max_ratio)
            if side(u_hi) > 0:
                raise MLPSurgeryError(f"extracting {max_ratio:g} of the units still leaves {utility.name} {u_hi:.4g}, "
                                      f"short of the target {target:g}; raise --max-ratio or choose another unit")
            lo, hi = 0.5 / ranking.n_units, max_ratio
            best = max_ratio
            for _ in range(iterations):
                mid = math.sqrt(lo * hi)
                if ranking.count(mid) in (ranking.count(lo), ranking.count(hi)):
                    mid = (lo + hi) / 2
                    if ranking.count(mid) in (ranking.count(lo), ranking.count(hi)):
                        break
                s = side(point(mid))
                if s == 0:
                    break
                lo, hi = (mid, hi) if s > 0 else (lo, mid)
            best = min(curve, key=lambda c: abs(c[utility.name] - target))["ratio"]
    finally:
        bar.close()
    curve.sort(key=lambda c: c["ratio"])
    u_best = next(c[utility.name] for c in curve if c["ratio"] == best)
    return RatioSearch(best, u_best, abs(u_best - target) <= tol, target, tol, curve, ranking)


def plot_curves(curves: dict[str, list[dict]], metric: str, path: str | Path, title: str = "",
                chance: float | None = None, logy: bool = False) -> Path:
    """Utility against extraction ratio (log x), one line per label, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for label, rows in curves.items():
        pts = [(r["ratio"], r[metric]) for r in rows if r["ratio"] > 0]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    if chance is not None:
        ax.axhline(chance, color="grey", linestyle="--", label=f"chance ({chance:.3g})")
    ax.set_xscale("log")
    if logy:
        ax.set_yscale("log")
    ax.set_xlabel("extraction ratio (fraction of eligible units)")
    ax.set_ylabel(metric)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    return save_figure(fig, path)


# --------------------------------------------------------------------------------------------------
# Attacks: fine-tuning with a little data, magnitude pruning


def prune_plain(model: nn.Module, sparsity: float) -> dict:
    """Magnitude pruning of a plain PyTorch model: zero the smallest |w| of each conv / linear weight."""
    if not 0.0 <= sparsity < 1.0:
        raise MLPSurgeryError(f"sparsity must be in [0, 1), not {sparsity}")
    total = zeros = 0
    with torch.no_grad():
        for gl in generic_layers(model):
            if gl.kind not in ("linear", "conv"):
                continue
            w = gl.module.weight
            k = int(sparsity * w.numel())
            if k:
                w.view(-1)[w.detach().abs().flatten().argsort()[:k]] = 0
            total += w.numel()
            zeros += int((w == 0).sum())
    return {"method": "magnitude", "scope": "layer", "sparsity": zeros / max(total, 1)}


def attack_prune(model: nn.Module, sparsity: float, utility: Utility) -> dict:
    """Prune a copy of the locked model (the sites' MLP + attention weights of a transformer with
    `methods.pruning.magnitude_prune`, every conv / linear weight of a plain model) and measure it."""
    from .pruning import magnitude_prune

    victim = copy.deepcopy(model)
    try:
        info = magnitude_prune(victim, sparsity, parts="both", scope="layer")
    except UnsupportedArchitectureError:
        info = prune_plain(victim, sparsity)
    return {"attack": "prune", "setting": sparsity, utility.name: utility(victim), "achieved_sparsity": info["sparsity"]}


FinetuneLoss = Callable[[nn.Module, float, int], tuple[Callable[[int], Tensor], int]]


def classifier_finetune(tokenizer, train, batch_size: int = 16, epochs: int = 3, max_len: int = 128) -> FinetuneLoss:
    """Fine-tuning attack data for a classifier: `fraction` of `train` (stratified, drawn with the trial's
    seed), `epochs` passes of `batch_size`. Returns (loss_fn, steps) for a model."""
    from ..train import classifier_loss

    def make(model: nn.Module, fraction: float, seed: int):
        part = train.sample(fraction, seed=seed)
        steps = epochs * math.ceil(len(part) / batch_size)
        return classifier_loss(model, tokenizer, part, batch_size, max_len=max_len, seed=seed), steps

    return make


def lm_finetune(blocks: Tensor, batch_size: int = 8, epochs: int = 1) -> FinetuneLoss:
    """Fine-tuning attack data for a causal LM: `fraction` of the training blocks."""
    from ..train import lm_loss

    def make(model: nn.Module, fraction: float, seed: int):
        g = torch.Generator().manual_seed(seed)
        part = blocks[torch.randperm(len(blocks), generator=g)[:max(1, int(round(fraction * len(blocks))))]]
        return lm_loss(model, part, batch_size, seed=seed), epochs * math.ceil(len(part) / batch_size)

    return make


def attack_finetune(model: nn.Module, make_loss: FinetuneLoss, fraction: float, utility: Utility, lr: float = 5e-5,
                    seed: int = 0, progress: bool = True) -> dict:
    """Fine-tune a copy of the locked model (every parameter) on `fraction` of the training data."""
    from ..train import FitConfig, fit, trainable

    victim = copy.deepcopy(model).train()
    for p in victim.parameters():
        p.requires_grad_(True)
    loss_fn, steps = make_loss(victim, fraction, seed)
    res = fit(trainable(victim), loss_fn, FitConfig(steps=steps, lr=lr, seed=seed, warmup=0.1), progress=progress,
              desc=f"fine-tune attack {fraction:g}")
    victim.eval()
    return {"attack": "fine-tune", "setting": fraction, "seed": seed, "steps": steps, utility.name: utility(victim),
            "train_seconds": res.seconds, "final_loss": res.history[-1]["loss"] if res.history else None}


def attack_table(model: nn.Module, utility: Utility, make_loss: FinetuneLoss | None = None,
                 finetune=(0.05, 0.10), prune=(0.2, 0.4), trials: int = 3, lr: float = 5e-5,
                 progress: bool = True) -> dict:
    """The paper's Tables 2-3: utility recovered (delta = after - locked, in the utility's units) by
    fine-tuning on each fraction of the training data (mean +- std over `trials` resampled subsets)
    and by magnitude pruning at each sparsity."""
    locked = utility(model)
    rows = []
    for f in finetune if make_loss is not None else ():
        runs = [attack_finetune(model, make_loss, f, utility, lr=lr, seed=t, progress=progress) for t in range(trials)]
        vals = [r[utility.name] for r in runs]
        rows.append({"attack": "fine-tune", "setting": f, utility.name: float(np.mean(vals)),
                     "std": float(np.std(vals)), "delta": float(np.mean(vals)) - locked, "runs": runs})
    for s in prune:
        r = attack_prune(model, s, utility)
        rows.append({**r, "std": 0.0, "delta": r[utility.name] - locked})
    return {"metric": utility.name, "higher_is_better": utility.higher_is_better, "locked": locked, "rows": rows,
            "data": utility.data}


# --------------------------------------------------------------------------------------------------
# Folders: a locked transformers checkpoint + a key file; unlock into a new folder


def _numels(model: nn.Module) -> dict[str, int]:
    return {n: p.numel() for n, p in model.named_parameters()}


def _check_targets(out: Path, key_path: Path | None, overwrite: bool) -> None:
    check_out(out, overwrite)
    if key_path is None:
        return
    if key_path.exists() and not overwrite:
        raise MLPSurgeryError(f"{key_path} already exists; choose another --key or pass --overwrite")
    if out.resolve() in key_path.resolve().parents:
        raise MLPSurgeryError(f"the key {key_path} would be written inside the locked folder {out}, which is what "
                              "you hand out; put the key elsewhere")


def lock_folder(model: nn.Module, out: str | Path, key_path: str | Path, cfg: CoreLockerConfig, tokenizer=None,
                passphrase: str | None = None, target: float | None = None, utility: Utility | None = None,
                tolerance: float | None = None, max_ratio: float = 0.5, measure: bool = False,
                overwrite: bool = False, progress: bool = True) -> dict:
    """Lock `model` (in place) at cfg.ratio, or at the ratio reaching `target` utility, and write the
    locked model as a plain transformers checkpoint in `out` plus the key in `key_path` (sealed with
    `passphrase` when given). Nothing is written unless everything succeeded."""
    out, key_path = Path(out), Path(key_path)
    _check_targets(out, key_path, overwrite)
    if not hasattr(model, "config"):
        raise MLPSurgeryError("lock_folder writes a transformers checkpoint; for plain PyTorch models use lock_key "
                              "and save_key")
    if (target is not None or measure) and utility is None:
        raise MLPSurgeryError("a target utility (or measuring it) needs a Utility: calibration data and a metric")
    search, ranking, before = None, None, None
    if target is not None:
        search = find_ratio(model, cfg, utility, target, tolerance, max_ratio=max_ratio, progress=progress)
        cfg = dataclasses.replace(cfg, ratio=search.ratio)
        ranking, before = search.ranking, search.curve[0][utility.name]
    elif measure:
        before = utility(model)
    key = lock_key(model, cfg, ranking)
    after = utility(model) if utility is not None and (measure or target is not None) else None
    from ..io import save

    tmp_key = key_path.with_name(f".{key_path.name}.tmp-{os.getpid()}")
    key_size = save_key(key, tmp_key, _numels(model), passphrase=passphrase, overwrite=True)
    try:
        summary = {k: key.header[k] for k in ("config", "units_extracted", "units_eligible", "locked_fingerprint")}
        save(model, out, tokenizer=tokenizer, overwrite=overwrite, extra={"corelocker": summary})
        os.replace(tmp_key, key_path)
    finally:
        tmp_key.unlink(missing_ok=True)
    weights = out / "model.safetensors"
    result = {
        "locked": str(out), "key": str(key_path), "encrypted": passphrase is not None, "config": asdict(cfg),
        "units_extracted": key.header["units_extracted"], "units_eligible": key.header["units_eligible"],
        "entries": key.entries, "model_params": key.header["model_params"], "key_bytes": key_size,
        "model_bytes": weights.stat().st_size if weights.exists() else None,
        "locked_fingerprint": key.header["locked_fingerprint"],
    }
    if utility is not None and after is not None:
        result["utility"] = {"metric": utility.name, "data": utility.data, "original": before, "locked": after,
                             "chance": utility.chance}
    if search is not None:
        result["search"] = search.as_dict()
    return result


def _task_of(model_class: str) -> str:
    if model_class.endswith("ForSequenceClassification"):
        return "classifier"
    if model_class.endswith(("ForCausalLM", "LMHeadModel")):
        return "causal-lm"
    return "encoder"


def unlock_folder(locked: str | Path, key_path: str | Path, out: str | Path, passphrase: str | None = None,
                  overwrite: bool = False) -> dict:
    """Restore a locked folder with its key into `out`, bit for bit. A wrong, truncated or tampered key,
    a wrong passphrase or a modified locked folder is refused and nothing is written."""
    from ..io import save
    from ..models import load_model

    out, locked = Path(out), Path(locked)
    _check_targets(out, None, overwrite)
    key = read_key(key_path, passphrase)
    if not (locked / "config.json").exists():
        raise MLPSurgeryError(f"{locked} is not a model folder (no config.json); give the folder written by "
                              "`mlpsurgery lock key --out`")
    loaded = load_model(locked, task=_task_of(key.header.get("model_class", "")))
    if type(loaded.model).__name__ != key.header.get("model_class"):
        raise IntegrityError(f"{locked} holds a {type(loaded.model).__name__}, the key was made for a "
                             f"{key.header.get('model_class')}: this key does not belong to this model")
    unlock_key(loaded.model, key)
    save(loaded.model, out, tokenizer=loaded.tokenizer, overwrite=overwrite)
    return {"unlocked": str(out), "from": str(locked), "key": str(key_path), "entries_restored": key.entries,
            "original_fingerprint": key.header["original_fingerprint"], "verified": True}
