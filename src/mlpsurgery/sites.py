"""Sites: one uniform view of every layer's MLP and attention heads, for every supported architecture.

Methods never touch `model.model.layers[i].mlp.gate_proj`; they ask `find_sites(model)` and get, per
layer, an `MLPSite` and an `AttnSite` that read and write weights in one canonical orientation:

    MLP:   up, gate (h, d)   down (d, h)   biases up/gate (h,), down (d,)
           plain:  y = down @ act(up @ x + b_up) + b_down
           gated:  y = down @ (act(gate @ x + b_gate) * (up @ x + b_up)) + b_down
    Heads: q (n_heads, hd, d)   k, v (n_kv, hd, d)   o (d, n_heads, hd), biases to match

The per-architecture knowledge lives in `ARCH_SPECS` (attribute names, fused layouts, norm placement);
everything else in the library is architecture-free. An MLP *sub-block* is the map from the residual
stream entering the MLP to what the layer adds to it: `x -> x + post(MLP(pre(x)))` (pre/post norms
where the architecture has them; for post-norm encoders such as BERT the outer LayerNorm stays
outside, applied to `x + MLP(x)`).

Two ways to swap in a module without touching the model's forward code:
- `replace_mlp(m)`:      m takes what the MLP took (the pre-normed hidden state) and returns its output.
- `replace_subblock(f)`: f takes the raw residual stream x and returns the delta added to it
                         (the norms inside the sub-block become Identity), as DLR-Lock needs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
from torch import Tensor, nn
from transformers.activations import ACT2FN
from transformers.pytorch_utils import Conv1D

from .errors import MLPSurgeryError, UnsupportedArchitectureError

# --------------------------------------------------------------------------------------------------
# Canonical weights


@dataclass
class MLPWeights:
    """An MLP's weights in canonical orientation (see module docstring)."""

    up: Tensor  # (h, d): the input weight of a plain MLP, the linear branch of a gated one
    down: Tensor  # (d, h)
    gate: Tensor | None = None  # (h, d), gated MLPs only; act() is applied to this branch
    up_bias: Tensor | None = None  # (h,)
    gate_bias: Tensor | None = None  # (h,)
    down_bias: Tensor | None = None  # (d,)
    activation: str = "gelu"

    @property
    def gated(self) -> bool:
        return self.gate is not None

    @property
    def d(self) -> int:
        return self.up.shape[1]

    @property
    def h(self) -> int:
        return self.up.shape[0]

    def tensors(self) -> dict[str, Tensor]:
        names = ("up", "down", "gate", "up_bias", "gate_bias", "down_bias")
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}

    def map(self, fn: Callable[[Tensor], Tensor]) -> "MLPWeights":
        return dataclasses.replace(self, **{n: fn(t) for n, t in self.tensors().items()})

    def select(self, neurons: Tensor) -> "MLPWeights":
        """The sub-MLP made of the given inner neurons (indices into h), in that order."""
        idx = torch.as_tensor(neurons, dtype=torch.long, device=self.up.device)

        def pick(name: str, t: Tensor) -> Tensor:
            if name == "down":
                return t[:, idx]
            if name == "down_bias":
                return t
            return t[idx]

        return dataclasses.replace(self, **{n: pick(n, t) for n, t in self.tensors().items()})

    def inner(self, x: Tensor) -> Tensor:
        """The h activations feeding the down projection. x: (..., d) -> (..., h)."""
        act = activation_fn(self.activation)
        up = nn.functional.linear(x, self.up, self.up_bias)
        if self.gate is None:
            return act(up)
        return act(nn.functional.linear(x, self.gate, self.gate_bias)) * up

    def __call__(self, x: Tensor) -> Tensor:
        """Reference forward of the MLP. x: (..., d) -> (..., d)."""
        return nn.functional.linear(self.inner(x), self.down, self.down_bias)

    def num_params(self) -> int:
        return sum(t.numel() for t in self.tensors().values())


@dataclass
class AttnWeights:
    """Attention projections split per head (see module docstring)."""

    q: Tensor  # (n_heads, hd, d)
    k: Tensor  # (n_kv, hd, d)
    v: Tensor  # (n_kv, hd, d)
    o: Tensor  # (d, n_heads, hd)
    q_bias: Tensor | None = None  # (n_heads, hd)
    k_bias: Tensor | None = None  # (n_kv, hd)
    v_bias: Tensor | None = None  # (n_kv, hd)
    o_bias: Tensor | None = None  # (d,)

    @property
    def n_heads(self) -> int:
        return self.q.shape[0]

    @property
    def n_kv(self) -> int:
        return self.k.shape[0]

    @property
    def head_dim(self) -> int:
        return self.q.shape[1]

    @property
    def group_size(self) -> int:
        """Query heads per KV group (1 without grouped-query attention)."""
        return self.n_heads // self.n_kv

    def tensors(self) -> dict[str, Tensor]:
        names = ("q", "k", "v", "o", "q_bias", "k_bias", "v_bias", "o_bias")
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}

    def map(self, fn: Callable[[Tensor], Tensor]) -> "AttnWeights":
        return dataclasses.replace(self, **{n: fn(t) for n, t in self.tensors().items()})

    def heads_of_groups(self, groups) -> Tensor:
        """Query-head indices belonging to the given KV groups, in order."""
        g = torch.as_tensor(groups, dtype=torch.long)
        return (g[:, None] * self.group_size + torch.arange(self.group_size)).reshape(-1)

    def select_groups(self, groups) -> "AttnWeights":
        """The attention made of the given KV groups (each with all its query heads)."""
        g = torch.as_tensor(groups, dtype=torch.long, device=self.q.device)
        heads = self.heads_of_groups(g.cpu()).to(self.q.device)
        out = {"q": self.q[heads], "k": self.k[g], "v": self.v[g], "o": self.o[:, heads]}
        if self.q_bias is not None:
            out["q_bias"] = self.q_bias[heads]
        if self.k_bias is not None:
            out["k_bias"] = self.k_bias[g]
        if self.v_bias is not None:
            out["v_bias"] = self.v_bias[g]
        return dataclasses.replace(self, **out)


def activation_fn(name: str) -> nn.Module:
    try:
        return ACT2FN[name]
    except KeyError:
        raise MLPSurgeryError(f"unknown activation {name!r}; transformers knows {sorted(ACT2FN)}") from None


# --------------------------------------------------------------------------------------------------
# Architecture specifications


@dataclass(frozen=True)
class ArchSpec:
    """Where one architecture keeps its MLP and attention (paths relative to one layer)."""

    name: str
    layers: str  # path from the base model to the ModuleList of layers
    decoder: bool = True
    # MLP
    mlp_layout: str = "module"  # "module": one MLP module; "bert": intermediate/output; "opt": fc1/fc2 on the layer
    mlp: str = "mlp"
    up: str | None = "up_proj"
    gate: str | None = "gate_proj"
    gate_up: str | None = None  # fused (2h, d) weight: gate rows first, then up (Phi-3)
    down: str = "down_proj"
    act: str = "act_fn"
    act_keys: tuple[str, ...] = ("hidden_act",)
    pre_norm: str | None = "post_attention_layernorm"
    inner_post_norm: str | None = None  # applied to the MLP output before the residual add (Gemma 2/3)
    outer_post_norm: str | None = None  # applied after the residual add (post-norm encoders)
    norm_plus_one: bool = False  # Gemma's RMSNorm scales by (1 + weight)
    width_key: str = "intermediate_size"  # the config field holding the MLP inner width
    # attention
    attn: str = "self_attn"
    q: str | None = "q_proj"
    k: str | None = "k_proj"
    v: str | None = "v_proj"
    o: str = "o_proj"
    qkv: str | None = None
    qkv_layout: str | None = None  # "blocks": [q; k; v] rows; "neox": per head [q_h; k_h; v_h]; "gpt2": Conv1D [q|k|v]
    attn_norm: str | None = "input_layernorm"
    embeddings: tuple[str, ...] = ("embed_tokens",)  # paths from the base model
    final_norm: str | None = "norm"
    # A layer may hold a subset of the heads (narrower projections); the sites read every layer's head count
    # off its projection widths. (Every supported architecture can; gpt2, opt and phi3 through narrow_attn.)
    heads_per_layer: bool = True
    # Where the stock attention takes its head count from the config (gpt2, opt, phi3), a layer holding fewer
    # heads gets this registered module instead (modules/attention.py: the stock class, its head count read
    # off its own projections); None where the stock attention already infers it from its projections.
    narrow_attn: str | None = None
    # A config with fewer heads keeps head_dim (the config carries head_dim apart from hidden_size / heads).
    heads_in_config: bool = True

    def at_config(self, config) -> "ArchSpec":
        """The spec adjusted for config switches that move norms (OPT-350m is post-norm)."""
        if self.name == "opt" and not getattr(config, "do_layer_norm_before", True):
            return dataclasses.replace(self, pre_norm=None, outer_post_norm="final_layer_norm",
                                       attn_norm=None)
        return self


_LLAMA = ArchSpec(name="llama", layers="layers")
ARCH_SPECS: dict[str, ArchSpec] = {
    "llama": _LLAMA,
    "mistral": dataclasses.replace(_LLAMA, name="mistral"),
    "qwen2": dataclasses.replace(_LLAMA, name="qwen2"),
    "qwen3": dataclasses.replace(_LLAMA, name="qwen3"),
    "gemma": dataclasses.replace(_LLAMA, name="gemma", norm_plus_one=True),
    "gemma2": dataclasses.replace(_LLAMA, name="gemma2", act_keys=("hidden_activation", "hidden_act"),
                                  pre_norm="pre_feedforward_layernorm",
                                  inner_post_norm="post_feedforward_layernorm", norm_plus_one=True),
    "gemma3_text": dataclasses.replace(_LLAMA, name="gemma3_text", act_keys=("hidden_activation", "hidden_act"),
                                       pre_norm="pre_feedforward_layernorm",
                                       inner_post_norm="post_feedforward_layernorm", norm_plus_one=True),
    "phi3": dataclasses.replace(_LLAMA, name="phi3", up=None, gate=None, gate_up="gate_up_proj", act="activation_fn",
                                q=None, k=None, v=None, qkv="qkv_proj", qkv_layout="blocks",
                                narrow_attn="NarrowPhi3Attention"),
    "gpt2": ArchSpec(name="gpt2", layers="h", width_key="n_inner", up="c_fc", gate=None, down="c_proj", act="act",
                     act_keys=("activation_function",), pre_norm="ln_2", attn="attn",
                     q=None, k=None, v=None, o="c_proj", qkv="c_attn", qkv_layout="gpt2", attn_norm="ln_1",
                     embeddings=("wte", "wpe"), final_norm="ln_f", heads_in_config=False,
                     narrow_attn="NarrowGPT2Attention"),
    "gpt_neox": ArchSpec(name="gpt_neox", layers="layers", up="dense_h_to_4h", gate=None, down="dense_4h_to_h",
                         act="act", pre_norm="post_attention_layernorm", attn="attention", q=None, k=None, v=None,
                         o="dense", qkv="query_key_value", qkv_layout="neox", embeddings=("embed_in",),
                         final_norm="final_layer_norm", heads_in_config=False),
    "opt": ArchSpec(name="opt", layers="decoder.layers", width_key="ffn_dim", mlp_layout="opt", mlp="", up="fc1", gate=None, down="fc2",
                    act="activation_fn", act_keys=("activation_function",), pre_norm="final_layer_norm",
                    o="out_proj", attn_norm="self_attn_layer_norm",
                    embeddings=("decoder.embed_tokens", "decoder.embed_positions"), final_norm="decoder.final_layer_norm",
                    heads_in_config=False, narrow_attn="NarrowOPTAttention"),
    "bert": ArchSpec(name="bert", layers="encoder.layer", decoder=False, mlp_layout="bert", mlp="",
                     up="intermediate.dense", gate=None, down="output.dense", act="intermediate.intermediate_act_fn",
                     pre_norm=None, outer_post_norm="output.LayerNorm", attn="attention",
                     q="self.query", k="self.key", v="self.value", o="output.dense", attn_norm=None,
                     embeddings=("embeddings",), final_norm=None, heads_in_config=False),
}
ARCH_SPECS["roberta"] = dataclasses.replace(ARCH_SPECS["bert"], name="roberta")

SUPPORTED = tuple(ARCH_SPECS)


def arch_spec(config) -> ArchSpec:
    model_type = getattr(config, "model_type", None)
    spec = ARCH_SPECS.get(model_type)
    if spec is None:
        raise UnsupportedArchitectureError(
            f"architecture {model_type!r} is not supported; supported: {', '.join(SUPPORTED)}. "
            "Methods that need no sites (CoreLocker on plain PyTorch models) accept any model through "
            "mlpsurgery.sites.generic_layers().")
    return spec.at_config(config)


def _get(module: nn.Module, path: str) -> nn.Module:
    return module.get_submodule(path) if path else module


def _set(module: nn.Module, path: str, new: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(_get(module, parent), name, new)


def _weight(mod: nn.Module) -> Tensor:
    """(out, in) view of a Linear or Conv1D weight (Conv1D stores (in, out))."""
    return mod.weight.t() if isinstance(mod, Conv1D) else mod.weight


def _bias(mod: nn.Module) -> Tensor | None:
    return getattr(mod, "bias", None)


def linear_weight(mod: nn.Module) -> tuple[Tensor, Tensor | None]:
    """(weight (out, in), bias) of a Linear or GPT-2 Conv1D, as views of the module's parameters."""
    return _weight(mod), _bias(mod)


def _copy_(dst: Tensor, src: Tensor) -> None:
    if dst.shape != src.shape:
        raise MLPSurgeryError(f"shape mismatch writing weights: have {tuple(dst.shape)}, got {tuple(src.shape)}")
    with torch.no_grad():
        dst.copy_(src.to(dtype=dst.dtype, device=dst.device))


def _new_linear(weight: Tensor, bias: Tensor | None, like: nn.Module) -> nn.Module:
    """A module of the same kind as `like` (Linear or Conv1D) holding `weight` (out, in), on its device and dtype."""
    p = like.weight
    out_f, in_f = weight.shape
    if isinstance(like, Conv1D):
        mod = Conv1D(out_f, in_f).to(device=p.device, dtype=p.dtype)
        _copy_(mod.weight, weight.t())
        if bias is None:
            mod.bias = None
        else:
            _copy_(mod.bias, bias)
    else:
        mod = nn.Linear(in_f, out_f, bias=bias is not None, device=p.device, dtype=p.dtype)
        _copy_(mod.weight, weight)
        if bias is not None:
            _copy_(mod.bias, bias)
    mod.weight.requires_grad_(p.requires_grad)
    return mod


# --------------------------------------------------------------------------------------------------
# Sites


@dataclass
class MLPSite:
    """One layer's MLP: weights in canonical form, its norms, and where to hook or replace it."""

    index: int
    layer: nn.Module
    spec: ArchSpec
    config: object = field(repr=False)

    # ---- structure ----
    @property
    def activation(self) -> str:
        for key in self.spec.act_keys:
            name = getattr(self.config, key, None)
            if isinstance(name, str):
                return name
        raise MLPSurgeryError(f"{self.spec.name}: config has none of {self.spec.act_keys}")

    @property
    def gated(self) -> bool:
        return self.spec.gate is not None or self.spec.gate_up is not None

    @property
    def replaced(self) -> bool:
        """True once the MLP was swapped for another module (its weights are no longer canonical)."""
        s = self.spec
        names = [s.down] + [n for n in (s.up, s.gate, s.gate_up) if n]
        try:
            parts = [self._mlp_part(n) for n in names]
        except AttributeError:
            return True
        return not all(isinstance(p, (nn.Linear, Conv1D)) for p in parts)

    @property
    def module(self) -> nn.Module:
        """The module computing the MLP: the MLP itself, or what replaced it."""
        s = self.spec
        if s.mlp_layout == "module":
            return _get(self.layer, s.mlp)
        if s.mlp_layout == "bert":
            return _get(self.layer, s.down)
        return _get(self.layer, s.up)  # opt: fc1 holds a replacement, fc2 becomes Identity

    @property
    def pre_norm(self) -> nn.Module | None:
        return _get(self.layer, self.spec.pre_norm) if self.spec.pre_norm else None

    @property
    def inner_post_norm(self) -> nn.Module | None:
        return _get(self.layer, self.spec.inner_post_norm) if self.spec.inner_post_norm else None

    @property
    def outer_post_norm(self) -> nn.Module | None:
        return _get(self.layer, self.spec.outer_post_norm) if self.spec.outer_post_norm else None

    @property
    def entry(self) -> nn.Module:
        """Module whose input is the residual stream x entering the MLP sub-block (hook with a pre-hook)."""
        s = self.spec
        if s.pre_norm:
            return self.pre_norm
        if s.mlp_layout == "bert":
            return _get(self.layer, "intermediate")
        return self.module

    @property
    def exit(self) -> nn.Module:
        """Module whose output is the delta the sub-block adds to x (hook with a forward hook)."""
        s = self.spec
        if s.inner_post_norm:
            return self.inner_post_norm
        if s.mlp_layout == "opt":
            return _get(self.layer, s.down)
        return self.module

    @property
    def down_proj(self) -> nn.Module:
        """The down projection, whose input is the h inner activations (for neuron masks and importance)."""
        self._require_original()
        return self._mlp_part(self.spec.down)

    def _linear_names(self) -> dict[str, str]:
        s = self.spec
        names = {"gate_up": s.gate_up} if s.gate_up else {"up": s.up, **({"gate": s.gate} if s.gate else {})}
        return {**names, "down": s.down}

    def linears(self) -> dict[str, nn.Module]:
        """The MLP's projections by role: up, gate (gated), down; Phi-3's fused gate_up instead of up + gate.
        Use `linear_weight(mod)` for their (out, in) weights whatever the storage (Linear or Conv1D)."""
        return {role: self._mlp_part(name) for role, name in self._linear_names().items()}

    def replace_linear(self, role: str, module: nn.Module) -> None:
        """Swap one projection (see `linears`) for a module computing a map of the same shape."""
        names = self._linear_names()
        if role not in names:
            raise MLPSurgeryError(f"layer {self.index}: the MLP has projections {sorted(names)}, not {role!r}")
        s = self.spec
        _set(self.layer, f"{s.mlp}.{names[role]}" if s.mlp_layout == "module" else names[role], module)

    def _mlp_part(self, name: str) -> nn.Module:
        s = self.spec
        if s.mlp_layout == "module":
            return _get(_get(self.layer, s.mlp), name)
        return _get(self.layer, name)

    def _require_original(self) -> None:
        if self.replaced:
            raise MLPSurgeryError(
                f"layer {self.index}: the MLP was replaced by {type(self.module).__name__}; its weights are not "
                "in canonical form any more. Read the weights before replacing it.")

    @property
    def d(self) -> int:
        return self.config.hidden_size

    @property
    def h(self) -> int:
        """Inner width: of the stock MLP, or of the dense form of what replaced it (see `read`)."""
        if self.replaced:
            return self.read().h
        return _weight(self._mlp_part(self.spec.down)).shape[1]

    def modules(self) -> list[nn.Module]:
        """The modules that compute the MLP (or its replacement), norms excluded."""
        s = self.spec
        if s.mlp_layout == "module":
            return [self.module]
        if s.mlp_layout == "bert":
            return [_get(self.layer, "intermediate"), _get(self.layer, s.down)]
        return [_get(self.layer, s.up), _get(self.layer, s.act), _get(self.layer, s.down)]

    def parameters(self) -> Iterator[nn.Parameter]:
        """Parameters of the MLP (or its replacement), not of the norms around it."""
        seen = set()
        for mod in self.modules():
            for p in mod.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    yield p

    # ---- weights ----
    def read(self) -> MLPWeights:
        """The MLP's weights (detached copies) in canonical orientation: of the function it computes now. After a
        surgery that has a dense form (a fused or dense MLP installed with replace_mlp: `to_mlp_weights`; nested or
        factored projections: `to_dense`, at their current rank) that form is read, so methods compose; after one
        that has none (a DLR-Net in place of the sub-block) this refuses."""
        mod = self.module
        if self.replaced and hasattr(mod, "to_mlp_weights"):
            w = mod.to_mlp_weights()
            if w is not None:
                return w
            if not hasattr(mod, "to_dense"):  # else one projection (OPT's fc1 / BERT's output) was replaced: below
                raise MLPSurgeryError(f"layer {self.index}: the MLP was replaced by {type(mod).__name__}, which has "
                                      "no dense-MLP form to read; apply this method before that one")
        s = self.spec

        def part(name: str) -> nn.Module:
            m = self._mlp_part(name)
            if isinstance(m, (nn.Linear, Conv1D)):
                return m
            if hasattr(m, "to_dense"):
                return m.to_dense()
            if isinstance(m, nn.Identity):  # the whole MLP was replaced (opt / bert layouts keep it in another slot)
                raise MLPSurgeryError(f"layer {self.index}: the MLP was replaced by {type(mod).__name__}, which has no "
                                      "dense-MLP form to read; apply this method before that one")
            raise MLPSurgeryError(f"layer {self.index}: the MLP's {name} was replaced by {type(m).__name__}, which has no "
                                  "dense form to read; apply this method before that one")

        try:
            down = part(s.down)
        except AttributeError:
            raise MLPSurgeryError(f"layer {self.index}: the MLP was replaced by {type(mod).__name__}, which has no "
                                  "dense-MLP form to read; apply this method before that one") from None
        w: dict = {"down": _weight(down), "down_bias": _bias(down), "activation": self.activation}
        if s.gate_up:
            fused = part(s.gate_up)
            gate, up = _weight(fused).chunk(2, dim=0)
            w.update(gate=gate, up=up)
            b = _bias(fused)
            if b is not None:
                w["gate_bias"], w["up_bias"] = b.chunk(2)
        else:
            up = part(s.up)
            w.update(up=_weight(up), up_bias=_bias(up))
            if s.gate:
                gate = part(s.gate)
                w.update(gate=_weight(gate), gate_bias=_bias(gate))
        w = {k: (v.detach().clone() if isinstance(v, Tensor) else v) for k, v in w.items()}
        return MLPWeights(**w)

    def write(self, w: MLPWeights) -> None:
        """Write canonical weights back. A different inner width h replaces the linears with new ones."""
        self._require_original()
        s = self.spec
        if w.gated != self.gated:
            raise MLPSurgeryError(f"layer {self.index}: writing a {'gated' if w.gated else 'plain'} MLP into a "
                                  f"{'gated' if self.gated else 'plain'} one")
        if w.d != self.d:
            raise MLPSurgeryError(f"layer {self.index}: model width is {self.d}, weights have d={w.d}")
        resize = w.h != self.h
        parts: list[tuple[str, Tensor, Tensor | None]] = [(s.down, w.down, w.down_bias)]
        if s.gate_up:
            bias = None
            if w.gate_bias is not None or w.up_bias is not None:
                bias = torch.cat([w.gate_bias, w.up_bias])
            parts.append((s.gate_up, torch.cat([w.gate, w.up], dim=0), bias))
        else:
            parts.append((s.up, w.up, w.up_bias))
            if s.gate:
                parts.append((s.gate, w.gate, w.gate_bias))
        for name, weight, bias in parts:
            mod = self._mlp_part(name)
            have_bias = _bias(mod) is not None
            if have_bias != (bias is not None):
                raise MLPSurgeryError(f"layer {self.index}: {name} {'has' if have_bias else 'has no'} bias, "
                                      f"the weights {'lack' if have_bias else 'carry'} one")
            if resize:
                path = f"{s.mlp}.{name}" if s.mlp_layout == "module" else name
                _set(self.layer, path, _new_linear(weight, bias, like=mod))
            else:
                _copy_(mod.weight, weight.t() if isinstance(mod, Conv1D) else weight)
                if bias is not None:
                    _copy_(mod.bias, bias)
        if resize and s.mlp_layout == "module" and hasattr(self.module, "intermediate_size"):
            self.module.intermediate_size = w.h

    # ---- replacement ----
    def replace_mlp(self, module: nn.Module) -> None:
        """Swap the MLP for `module`, which maps the MLP's input (pre-normed) to its output."""
        s = self.spec
        if s.mlp_layout == "module":
            _set(self.layer, s.mlp, module)
        elif s.mlp_layout == "bert":
            _set(self.layer, "intermediate", nn.Identity())
            _set(self.layer, s.down, module)
        else:
            _set(self.layer, s.up, module)
            _set(self.layer, s.act, nn.Identity())
            _set(self.layer, s.down, nn.Identity())

    def replace_subblock(self, module: nn.Module) -> None:
        """Make the sub-block compute x + module(x) from the raw residual stream x (norms inside become Identity)."""
        for path in (self.spec.pre_norm, self.spec.inner_post_norm):
            if path:
                _set(self.layer, path, nn.Identity())
        self.replace_mlp(module)

    def subblock(self, x: Tensor) -> Tensor:
        """What the sub-block adds to x, computed by the layer's current modules, in their dtype (captured float32
        inputs meet a bfloat16 model here). x: (..., d)."""
        p = next(self.parameters(), None)
        if p is not None and x.dtype != p.dtype:
            x = x.to(p.dtype)
        h = x
        if self.spec.pre_norm:
            h = self.pre_norm(h)
        if self.spec.mlp_layout == "bert":
            h = _get(self.layer, "intermediate")(h)
        h = self.module(h)
        if self.spec.mlp_layout == "opt":
            h = _get(self.layer, self.spec.down)(_get(self.layer, self.spec.act)(h))
        if self.spec.inner_post_norm:
            h = self.inner_post_norm(h)
        return h


@dataclass
class AttnSite:
    """One layer's attention: per-head q/k/v/o slices and the output projection (for head masks)."""

    index: int
    layer: nn.Module
    spec: ArchSpec
    config: object = field(repr=False)

    @property
    def module(self) -> nn.Module:
        return _get(self.layer, self.spec.attn)

    @property
    def _group_size(self) -> int:
        """Query heads per KV group, from the config (a subset keeps whole groups, so it never changes)."""
        return self.config.num_attention_heads // (getattr(self.config, "num_key_value_heads", None)
                                                    or self.config.num_attention_heads)

    @property
    def n_heads(self) -> int:
        """Query heads of this layer: read off the projection widths where a layer may hold a subset of the
        heads (ArchSpec.heads_per_layer), else (or where a projection is not a plain linear) the config's."""
        s = self.spec
        if s.qkv:
            kv = self._fused_kv()
            return kv * self._group_size if kv else self.config.num_attention_heads
        width = self._out_width(s.q)
        return width // self.head_dim if width else self.config.num_attention_heads

    @property
    def n_kv(self) -> int:
        if self.spec.qkv:
            kv = self._fused_kv()
        else:
            width = self._out_width(self.spec.k)
            kv = width // self.head_dim if width else None
        return kv or getattr(self.config, "num_key_value_heads", None) or self.config.num_attention_heads

    def _fused_kv(self) -> int | None:
        """KV groups of a fused qkv projection from its width: (group_size + 2) * hd rows per group (q heads,
        k, v; GPT-2's [q|k|v] and GPT-NeoX's per-head layouts have group size 1, so 3 * hd)."""
        width = self._out_width(self.spec.qkv)
        return width // ((self._group_size + 2) * self.head_dim) if width else None

    @property
    def head_dim(self) -> int:
        hd = getattr(self.config, "head_dim", None)
        return hd if hd else self.config.hidden_size // self.config.num_attention_heads

    def _out_width(self, name: str) -> int | None:
        if not self.spec.heads_per_layer:
            return None
        mod = self._part(name)
        if isinstance(mod, nn.Linear):
            return mod.out_features
        return mod.weight.shape[1] if isinstance(mod, Conv1D) else None  # Conv1D stores (in, out)

    @property
    def d(self) -> int:
        return self.config.hidden_size

    @property
    def pre_norm(self) -> nn.Module | None:
        return _get(self.layer, self.spec.attn_norm) if self.spec.attn_norm else None

    @property
    def o_proj(self) -> nn.Module:
        """Output projection; its input is the heads' outputs concatenated in head order (n_heads * hd)."""
        return _get(self.module, self.spec.o)

    def _part(self, name: str) -> nn.Module:
        return _get(self.module, name)

    def _linear_names(self) -> dict[str, str]:
        s = self.spec
        return {"qkv": s.qkv, "o": s.o} if s.qkv else {"q": s.q, "k": s.k, "v": s.v, "o": s.o}

    def linears(self) -> dict[str, nn.Module]:
        """The attention projections by role: q, k, v, o (or the fused qkv and o)."""
        return {role: self._part(name) for role, name in self._linear_names().items()}

    def replace_linear(self, role: str, module: nn.Module) -> None:
        """Swap one projection (see `linears`) for a module computing a map of the same shape."""
        names = self._linear_names()
        if role not in names:
            raise MLPSurgeryError(f"layer {self.index}: attention has projections {sorted(names)}, not {role!r}")
        _set(self.module, names[role], module)

    def projections(self) -> list[nn.Module]:
        return list(self.linears().values())

    def parameters(self) -> Iterator[nn.Parameter]:
        for m in self.projections():
            yield from m.parameters()

    def _split_qkv(self, t: Tensor, rows_are_out: bool = True) -> tuple[Tensor, Tensor, Tensor]:
        """Split a fused (out, ...) qkv tensor into q (n_heads*hd, ...), k, v (n_kv*hd, ...)."""
        H, K, hd = self.n_heads, self.n_kv, self.head_dim
        layout = self.spec.qkv_layout
        if layout in ("blocks", "gpt2"):
            return t[: H * hd], t[H * hd: H * hd + K * hd], t[H * hd + K * hd:]
        if layout == "neox":
            per_head = t.reshape(H, 3, hd, *t.shape[1:])
            return (per_head[:, 0].reshape(H * hd, *t.shape[1:]), per_head[:, 1].reshape(H * hd, *t.shape[1:]),
                    per_head[:, 2].reshape(H * hd, *t.shape[1:]))
        raise AssertionError(layout)

    def _join_qkv(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        if self.spec.qkv_layout in ("blocks", "gpt2"):
            return torch.cat([q, k, v], dim=0)
        H, hd = self.n_heads, self.head_dim
        rest = q.shape[1:]
        return torch.stack([q.reshape(H, hd, *rest), k.reshape(H, hd, *rest), v.reshape(H, hd, *rest)],
                           dim=1).reshape(3 * H * hd, *rest)

    def read(self) -> AttnWeights:
        s = self.spec
        H, K, hd, d = self.n_heads, self.n_kv, self.head_dim, self.d
        if s.qkv:
            fused = self._part(s.qkv)
            q, k, v = self._split_qkv(_weight(fused))
            b = _bias(fused)
            qb, kb, vb = self._split_qkv(b) if b is not None else (None, None, None)
        else:
            mods = [self._part(n) for n in (s.q, s.k, s.v)]
            q, k, v = (_weight(m) for m in mods)
            qb, kb, vb = (_bias(m) for m in mods)
        o = _weight(self.o_proj)
        w = AttnWeights(
            q=q.reshape(H, hd, d), k=k.reshape(K, hd, d), v=v.reshape(K, hd, d), o=o.reshape(d, H, hd),
            q_bias=None if qb is None else qb.reshape(H, hd), k_bias=None if kb is None else kb.reshape(K, hd),
            v_bias=None if vb is None else vb.reshape(K, hd), o_bias=_bias(self.o_proj))
        return w.map(lambda t: t.detach().clone())

    def write(self, w: AttnWeights) -> None:
        s = self.spec
        if (w.n_heads, w.n_kv, w.head_dim) != (self.n_heads, self.n_kv, self.head_dim):
            raise MLPSurgeryError(
                f"layer {self.index}: attention has {self.n_heads} heads / {self.n_kv} KV groups of {self.head_dim}; "
                f"weights have {w.n_heads} / {w.n_kv} of {w.head_dim}. Fewer heads need a new model built "
                "from a config with fewer heads.")
        d = self.d
        q, k, v = w.q.reshape(-1, d), w.k.reshape(-1, d), w.v.reshape(-1, d)

        def put(mod, weight, bias):
            _copy_(mod.weight, weight.t() if isinstance(mod, Conv1D) else weight)
            if bias is not None:
                _copy_(mod.bias, bias)

        def flat(b):
            return None if b is None else b.reshape(-1)

        if s.qkv:
            bias = None
            if w.q_bias is not None:
                bias = self._join_qkv(flat(w.q_bias), flat(w.k_bias), flat(w.v_bias))
            put(self._part(s.qkv), self._join_qkv(q, k, v), bias)
        else:
            for name, weight, bias in ((s.q, q, w.q_bias), (s.k, k, w.k_bias), (s.v, v, w.v_bias)):
                put(self._part(name), weight, flat(bias))
        put(self.o_proj, w.o.reshape(d, -1), w.o_bias)


@dataclass
class Sites:
    """All sites of one model."""

    model: nn.Module
    spec: ArchSpec
    config: object = field(repr=False)
    mlp: list[MLPSite]
    attn: list[AttnSite]

    def __len__(self) -> int:
        return len(self.mlp)

    @property
    def base(self) -> nn.Module:
        return self.model.base_model

    def embeddings(self) -> list[nn.Module]:
        return [_get(self.base, p) for p in self.spec.embeddings]

    def layers(self) -> list[nn.Module]:
        """The decoder (or encoder) layers in order (the units FSDP shards one by one)."""
        return list(_get(self.base, self.spec.layers))

    def final_norm(self) -> nn.Module | None:
        return _get(self.base, self.spec.final_norm) if self.spec.final_norm else None

    def select(self, layers) -> list[MLPSite]:
        return [self.mlp[i] for i in layers]


def find_sites(model: nn.Module) -> Sites:
    """The MLP and attention sites of every layer of a supported `transformers` model."""
    config = getattr(model, "config", None)
    if config is None:
        raise UnsupportedArchitectureError(
            f"{type(model).__name__} is not a transformers model (no .config); supported architectures: "
            f"{', '.join(SUPPORTED)}. For plain PyTorch models use mlpsurgery.sites.generic_layers().")
    spec = arch_spec(config)
    base = getattr(model, "base_model", model)
    try:
        layers = _get(base, spec.layers)
    except AttributeError:
        raise UnsupportedArchitectureError(
            f"{type(model).__name__} (model_type {spec.name!r}) has no {spec.layers!r} under its base model; "
            "the installed transformers version may lay this architecture out differently") from None
    mlp = [MLPSite(i, layer, spec, config) for i, layer in enumerate(layers)]
    attn = [AttnSite(i, layer, spec, config) for i, layer in enumerate(layers)]
    return Sites(model=model, spec=spec, config=config, mlp=mlp, attn=attn)


def parse_layers(spec: str | None, n_layers: int, default: str = "all") -> list[int]:
    """Layer selection: 'all', 'a-b' (inclusive), 'i,j,k', mixes like '0,4-6', or 'last2/3' (the last two thirds)."""
    text = (spec or default).strip()
    if text == "all":
        return list(range(n_layers))
    if text.startswith("last") and "/" in text:
        num, den = text[4:].split("/")
        start = n_layers - (n_layers * int(num)) // int(den)
        return list(range(start, n_layers))
    out: set[int] = set()
    try:
        for part in text.split(","):
            part = part.strip()
            if "-" in part:
                a, b = part.split("-")
                out.update(range(int(a), int(b) + 1))
            else:
                out.add(int(part))
    except ValueError:
        raise MLPSurgeryError(f"layer selection {text!r} is not understood; use 'all', '8-11', '0,3,5' "
                              "or 'last2/3'") from None
    bad = sorted(i for i in out if not 0 <= i < n_layers)
    if bad:
        raise MLPSurgeryError(f"layers {bad} do not exist; the model has layers 0-{n_layers - 1}")
    return sorted(out)


# --------------------------------------------------------------------------------------------------
# Plain PyTorch models


@dataclass
class GenericLayer:
    """A weight-carrying layer of any PyTorch model, for methods that need no sites."""

    name: str
    module: nn.Module
    kind: str  # linear | conv | batchnorm | layernorm
    role: str  # input | hidden | output (first and last weight layers in module order)


_KINDS = ((nn.Linear, "linear"), (Conv1D, "linear"), (nn.Conv1d, "conv"), (nn.Conv2d, "conv"), (nn.Conv3d, "conv"),
          (nn.modules.batchnorm._BatchNorm, "batchnorm"), (nn.LayerNorm, "layernorm"), (nn.GroupNorm, "layernorm"))


def generic_layers(model: nn.Module) -> list[GenericLayer]:
    """Linear / Conv / BatchNorm / LayerNorm layers in module order; embeddings and the last
    weight layer are marked input / output (the layers CoreLocker leaves alone by default)."""
    found: list[GenericLayer] = []
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Embedding):
            found.append(GenericLayer(name, mod, "embedding", "input"))
            continue
        for klass, kind in _KINDS:
            if isinstance(mod, klass) and getattr(mod, "weight", None) is not None:
                found.append(GenericLayer(name, mod, kind, "hidden"))
                break
    weights = [g for g in found if g.kind in ("linear", "conv")]
    if not weights:
        raise MLPSurgeryError(f"{type(model).__name__} has no Linear or Conv layers to work on")
    if not any(g.kind == "embedding" for g in found):
        weights[0].role = "input"
    weights[-1].role = "output"
    return found
