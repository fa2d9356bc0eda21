"""Canonical weights: an MLP's and an attention's tensors in the one orientation every method reads and writes
(see the package docstring), whatever the architecture stores."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor, nn
from transformers.activations import ACT2FN

from ..errors import MLPSurgeryError


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
