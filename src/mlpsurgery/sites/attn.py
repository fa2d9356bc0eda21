"""AttnSite: one layer's attention as per-head q / k / v / o slices, fused layouts split and joined."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

import torch
from torch import Tensor, nn
from transformers.pytorch_utils import Conv1D

from ..errors import MLPSurgeryError
from .linears import _bias, _copy_, _get, _set, _weight
from .specs import ArchSpec
from .weights import AttnWeights


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
