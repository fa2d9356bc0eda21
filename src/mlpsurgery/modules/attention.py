"""Attentions whose head count follows their own projections, for layers that hold a subset of the heads.

The stock GPT-2, OPT and Phi-3 attentions take their head count from the model config: GPT-2 splits its
fused c_attn output at `split_size = hidden_size`, OPT reshapes to `num_heads = config.num_attention_heads`,
Phi-3 cuts its fused qkv at `config.num_attention_heads * head_dim`. A layer with fewer heads (same head_dim,
narrower projections: a TwIST subnet, a Fisher-pruned layer) therefore cannot be written into the stock
module, and a config cannot state it either (GPT-2 / OPT tie head_dim to hidden_size / heads; one config
holds one count for all layers). These subclasses keep the stock forward, unchanged, and read the count
from their projections instead: the attribute the forward reads is a property of the weights.

The head count of a layer is the number of its KV groups times the config's group size (a subset keeps whole
groups), so a module is rebuilt from (the model config, layer index, KV groups, attention implementation):
`config()` / `from_config` for the registry, which `io.save` records and `io.load` replays.

One name clash is resolved here: the registry calls `module.config()` for the constructor arguments, while
the transformers forward reads `self.config.<field>`. `config` is therefore a property returning a view that
does both: called, it gives the constructor arguments; read, it is the model config with this layer's head
counts (what Phi-3's forward reads).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers.models.gpt2.configuration_gpt2 import GPT2Config
from transformers.models.gpt2.modeling_gpt2 import GPT2Attention
from transformers.models.opt.configuration_opt import OPTConfig
from transformers.models.opt.modeling_opt import OPTAttention
from transformers.models.phi3.configuration_phi3 import Phi3Config
from transformers.models.phi3.modeling_phi3 import Phi3Attention
from transformers.pytorch_utils import Conv1D

from .base import register


# where the model came from, not what it computes (a local path must not reach a manifest)
_SOURCE_KEYS = ("_name_or_path", "_commit_hash", "transformers_version")


def _model_config(hf) -> dict[str, Any]:
    return {k: v for k, v in hf.to_diff_dict().items() if k not in _SOURCE_KEYS}


class _LayerConfig:
    """The model config as one narrowed attention sees it; calling it gives the module's constructor arguments."""

    __slots__ = ("_module",)

    def __init__(self, module: "_HeadsFromWeights"):
        self._module = module

    def __call__(self) -> dict[str, Any]:
        return self._module.surgery_config()

    def __getattr__(self, name: str):
        m = self._module
        if name == "num_attention_heads":
            return m.kv_groups * m.group_size
        if name == "num_key_value_heads" and hasattr(m._hf_config, "num_key_value_heads"):
            return m.kv_groups
        return getattr(m._hf_config, name)


class _HeadsFromWeights:
    """Shared by the three classes: construction from the registry's config, the config view, the counts."""

    config_class: type

    def __init__(self, config: dict[str, Any], layer_idx: int, kv_groups: int, attn_implementation: str | None = None):
        cfg = dict(config)
        if cfg.get("model_type") not in (None, self.config_class.model_type):
            raise ValueError(f"{type(self).__name__} needs a {self.config_class.model_type} config, not "
                             f"{cfg.get('model_type')!r}")
        hf = self.config_class.from_dict(cfg)
        hf._attn_implementation = attn_implementation
        full = getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads
        if not isinstance(kv_groups, int) or not 1 <= kv_groups <= full:
            raise ValueError(f"kv_groups must be an integer in 1..{full}, not {kv_groups!r}")
        super().__init__(hf, layer_idx=layer_idx)  # the stock module, full size
        self._narrow(kv_groups)

    @classmethod
    def from_config(cls, cfg: dict[str, Any]):
        return cls(**cfg)

    @classmethod
    def narrowed(cls, stock: nn.Module, kv_groups: int):
        """A module like the stock attention `stock` (its config, layer, device, dtype), holding `kv_groups` groups;
        its weights are to be written (uninitialised values)."""
        hf = stock.config
        p = next(stock.parameters())
        with torch.device(p.device):
            mod = cls(_model_config(hf), layer_idx=stock.layer_idx, kv_groups=kv_groups,
                      attn_implementation=hf._attn_implementation)
        return mod.to(p.dtype).train(stock.training)

    # ---- the config view (see the module docstring) ----
    @property
    def config(self) -> _LayerConfig:
        return _LayerConfig(self)

    @config.setter
    def config(self, value) -> None:  # the stock __init__ assigns the model config
        self.__dict__["_hf_config"] = value

    def surgery_config(self) -> dict[str, Any]:
        hf = self._hf_config
        return {"config": _model_config(hf), "layer_idx": self.layer_idx, "kv_groups": self.kv_groups,
                "attn_implementation": hf._attn_implementation}

    @property
    def group_size(self) -> int:
        hf = self._hf_config
        return hf.num_attention_heads // (getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads)

    @property
    def kv_groups(self) -> int:
        raise NotImplementedError

    def _narrow(self, kv_groups: int) -> None:
        raise NotImplementedError


def _like(mod: nn.Module, fan_in: int, fan_out: int) -> nn.Module:
    """A projection of the same kind and bias as `mod` with other sizes."""
    if isinstance(mod, Conv1D):
        new = Conv1D(fan_out, fan_in)
        if mod.bias is None:
            new.bias = None
        return new
    return nn.Linear(fan_in, fan_out, bias=mod.bias is not None)


@register
class NarrowGPT2Attention(_HeadsFromWeights, GPT2Attention):
    """GPT-2 self-attention with any number of heads: the [q|k|v] split size is read off c_attn."""

    config_class = GPT2Config

    def _narrow(self, kv_groups: int) -> None:
        width = kv_groups * self.head_dim
        self.c_attn = _like(self.c_attn, self.embed_dim, 3 * width)
        self.c_proj = _like(self.c_proj, width, self.embed_dim)

    @property
    def kv_groups(self) -> int:
        return self.c_attn.weight.shape[1] // (3 * self.head_dim)  # Conv1D stores (in, out)

    # The stock __init__ assigns these from the config before the projections exist; afterwards the forward
    # reads them, and then they come from the weights.
    @property
    def split_size(self) -> int:
        c = self._modules.get("c_attn")
        return self.__dict__["_split_size"] if c is None else c.weight.shape[1] // 3

    @split_size.setter
    def split_size(self, value: int) -> None:
        self.__dict__["_split_size"] = value

    @property
    def num_heads(self) -> int:
        return self.__dict__["_num_heads"] if self._modules.get("c_attn") is None else self.kv_groups

    @num_heads.setter
    def num_heads(self, value: int) -> None:
        self.__dict__["_num_heads"] = value


@register
class NarrowOPTAttention(_HeadsFromWeights, OPTAttention):
    """OPT self-attention with any number of heads: the count is read off q_proj."""

    config_class = OPTConfig

    def _narrow(self, kv_groups: int) -> None:
        width = kv_groups * self.head_dim
        for name in ("q_proj", "k_proj", "v_proj"):
            setattr(self, name, _like(getattr(self, name), self.embed_dim, width))
        self.out_proj = _like(self.out_proj, width, self.embed_dim)

    @property
    def kv_groups(self) -> int:
        return self.q_proj.out_features // self.head_dim

    @property
    def num_heads(self) -> int:
        return self.__dict__["_num_heads"] if self._modules.get("q_proj") is None else self.kv_groups

    @num_heads.setter
    def num_heads(self, value: int) -> None:
        self.__dict__["_num_heads"] = value


@register
class NarrowPhi3Attention(_HeadsFromWeights, Phi3Attention):
    """Phi-3 self-attention with any number of KV groups: the count is read off the fused qkv_proj
    ((group size + 2) x head_dim rows per group); the forward's `config.num_attention_heads` is this layer's."""

    config_class = Phi3Config

    def _narrow(self, kv_groups: int) -> None:
        heads = kv_groups * self.num_key_value_groups
        self.qkv_proj = _like(self.qkv_proj, self._hf_config.hidden_size,
                              (heads + 2 * kv_groups) * self.head_dim)
        self.o_proj = _like(self.o_proj, heads * self.head_dim, self._hf_config.hidden_size)

    @property
    def kv_groups(self) -> int:
        return self.qkv_proj.out_features // ((self.num_key_value_groups + 2) * self.head_dim)

    @property
    def num_key_value_heads(self) -> int:
        return self.__dict__["_num_kv"] if self._modules.get("qkv_proj") is None else self.kv_groups

    @num_key_value_heads.setter
    def num_key_value_heads(self, value: int) -> None:
        self.__dict__["_num_kv"] = value
