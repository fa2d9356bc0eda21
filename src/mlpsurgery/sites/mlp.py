"""MLPSite: one layer's MLP in canonical form -- its weights, norms, and where to hook or replace it (the module
or the whole sub-block)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterator

import torch
from torch import Tensor, nn
from transformers.pytorch_utils import Conv1D

from ..errors import MLPSurgeryError
from .linears import _bias, _copy_, _get, _new_linear, _set, _weight
from .specs import ArchSpec
from .weights import MLPWeights


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
    def residual_scale(self) -> float:
        """The factor the layer's forward applies to the sub-block's output before adding it to the residual stream
        (Granite's residual_multiplier; 1 elsewhere). `exit` and `subblock` give the output before it."""
        key = self.spec.residual_scale_key
        scale = 1.0 if key is None else getattr(self.config, key, 1.0)
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale or not math.isfinite(scale):
            raise MLPSurgeryError(f"{self.spec.name}: config.{key} = {scale!r}; the sub-block's output must reach the "
                                  "residual stream with a finite non-zero scale")
        return float(scale)

    @property
    def parallel(self) -> bool:
        """Whether the layer runs attention and this MLP side by side on its input (GPT-NeoX's default): `entry` then
        sees the stream entering the layer, and the layer adds both sub-blocks' outputs to it."""
        key = self.spec.parallel_key
        return self.spec.parallel or bool(key and getattr(self.config, key, False))

    @property
    def shared_norm(self) -> bool:
        """Whether the MLP's pre-norm is also the attention's (Phi-2): it cannot be removed for the MLP alone."""
        return self.spec.pre_norm is not None and self.spec.pre_norm == self.spec.attn_norm

    @property
    def exit(self) -> nn.Module:
        """Module whose output is the delta the sub-block adds to x (hook with a forward hook); before the
        `residual_scale` where the layer applies one."""
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

    def _module_names(self) -> list[str]:
        s = self.spec
        if s.mlp_layout == "module":
            return [s.mlp]
        if s.mlp_layout == "bert":
            return ["intermediate", s.down]
        return [s.up, s.act, s.down]

    def modules(self) -> list[nn.Module]:
        """The modules that compute the MLP (or its replacement), norms excluded."""
        return [_get(self.layer, n) for n in self._module_names()]

    def set_modules(self, modules: list[nn.Module]) -> None:
        """Put `modules` where `modules()` finds them: another copy's MLP (e.g. one compressed on another rank)
        installed whole, its class, parameters and buffers with it."""
        names = self._module_names()
        if len(modules) != len(names):
            raise MLPSurgeryError(f"layer {self.index}: the MLP is {len(names)} modules here ({names}), "
                                  f"given {len(modules)}")
        for name, mod in zip(names, modules):
            _set(self.layer, name, mod)

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
        """Make the sub-block compute x + module(x) from the raw residual stream x (norms inside become Identity).
        Refused where the pre-norm is also the attention's (`shared_norm`): attention would read the raw stream."""
        if self.shared_norm:
            raise MLPSurgeryError(f"layer {self.index}: this {self.spec.name} layer's MLP shares its norm "
                                  f"({self.spec.pre_norm}) with attention, so its sub-block cannot be replaced "
                                  "from the raw residual stream; replace the MLP itself (replace_mlp)")
        for path in (self.spec.pre_norm, self.spec.inner_post_norm):
            if path:
                _set(self.layer, path, nn.Identity())
        self.replace_mlp(module)

    def subblock(self, x: Tensor) -> Tensor:
        """What the sub-block adds to x (before the layer's `residual_scale`, where it has one), computed by the
        layer's current modules, in their dtype (captured float32 inputs meet a bfloat16 model here). x: (..., d)."""
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
