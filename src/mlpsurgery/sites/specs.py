"""Architecture specifications: where each supported architecture keeps its MLP, attention, norms and embeddings
(paths relative to one layer), the only per-architecture knowledge in the library."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from ..errors import UnsupportedArchitectureError


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
    # the config field scaling the sub-block's output on its way into the residual stream, outside the modules the
    # sites read and replace (Granite's residual_multiplier); None: added as it is
    residual_scale_key: str | None = None
    # the config switch that runs attention and MLP side by side on the layer's input (GPT-NeoX's
    # use_parallel_residual): the MLP's input is then the stream entering the layer, not the one attention left
    parallel_key: str | None = None
    parallel: bool = False  # always so (Phi-2), whatever the config
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
    # the same pre-norm decoder layer as Llama's, under the same names (checked against each modeling file):
    "smollm3": dataclasses.replace(_LLAMA, name="smollm3"),  # some layers without rotary positions
    "olmo": dataclasses.replace(_LLAMA, name="olmo"),  # layer norms without weights, optional q / k / v clipping
    "ernie4_5": dataclasses.replace(_LLAMA, name="ernie4_5"),
    "ministral": dataclasses.replace(_LLAMA, name="ministral"),  # per-layer sliding-window attention
    "seed_oss": dataclasses.replace(_LLAMA, name="seed_oss"),  # biased q / k / v (and o, optionally)
    # the sub-blocks' outputs scaled by residual_multiplier before the residual add (in the layer's forward, outside
    # the modules the sites replace); embedding / attention / logits multipliers outside the sites too
    "granite": dataclasses.replace(_LLAMA, name="granite", residual_scale_key="residual_multiplier"),
    # Llama's layer with biased LayerNorms and an ungated MLP (c_fc -> act -> c_proj, biased)
    "starcoder2": dataclasses.replace(_LLAMA, name="starcoder2", up="c_fc", gate=None, down="c_proj", act="act"),
    # norms after the sub-blocks only, none before (the MLP reads the raw stream); OLMo 2's q / k norms span every
    # head (so its heads stay, subsets.check_heads_removable), EXAONE 4's one head's width
    "olmo2": dataclasses.replace(_LLAMA, name="olmo2", pre_norm=None, attn_norm=None,
                                 inner_post_norm="post_feedforward_layernorm"),
    "olmo3": dataclasses.replace(_LLAMA, name="olmo3", pre_norm=None, attn_norm=None,  # OLMo 2's + sliding windows
                                 inner_post_norm="post_feedforward_layernorm"),
    "exaone4": dataclasses.replace(_LLAMA, name="exaone4", pre_norm=None, attn_norm=None,
                                   inner_post_norm="post_feedforward_layernorm"),
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
    # attention and MLP side by side on one shared LayerNorm of the layer's input; an ungated MLP (fc1 / fc2)
    "phi": dataclasses.replace(_LLAMA, name="phi", up="fc1", gate=None, down="fc2", act="activation_fn",
                               pre_norm="input_layernorm", o="dense", final_norm="final_layernorm", parallel=True),
    # Phi-2's parallel layer with a gated MLP and weight-only LayerNorms (Command R; Cohere 2 adds sliding windows)
    "cohere": dataclasses.replace(_LLAMA, name="cohere", pre_norm="input_layernorm", parallel=True),
    "cohere2": dataclasses.replace(_LLAMA, name="cohere2", pre_norm="input_layernorm", parallel=True),
    "gpt2": ArchSpec(name="gpt2", layers="h", width_key="n_inner", up="c_fc", gate=None, down="c_proj", act="act",
                     act_keys=("activation_function",), pre_norm="ln_2", attn="attn",
                     q=None, k=None, v=None, o="c_proj", qkv="c_attn", qkv_layout="gpt2", attn_norm="ln_1",
                     embeddings=("wte", "wpe"), final_norm="ln_f", heads_in_config=False,
                     narrow_attn="NarrowGPT2Attention"),
    "gpt_neox": ArchSpec(name="gpt_neox", layers="layers", up="dense_h_to_4h", gate=None, down="dense_4h_to_h",
                         act="act", pre_norm="post_attention_layernorm", attn="attention", q=None, k=None, v=None,
                         o="dense", qkv="query_key_value", qkv_layout="neox", embeddings=("embed_in",),
                         final_norm="final_layer_norm", heads_in_config=False, parallel_key="use_parallel_residual"),
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
# BERT's post-norm layer with its MLP in one module (ffn: lin1 -> activation -> lin2) and its own names
ARCH_SPECS["distilbert"] = ArchSpec(name="distilbert", layers="transformer.layer", decoder=False, mlp="ffn", up="lin1",
                                    gate=None, down="lin2", act="activation", act_keys=("activation",),
                                    width_key="hidden_dim", pre_norm=None, outer_post_norm="output_layer_norm",
                                    attn="attention", q="q_lin", k="k_lin", v="v_lin", o="out_lin", attn_norm=None,
                                    embeddings=("embeddings",), final_norm=None, heads_in_config=False)
ARCH_SPECS["roberta"] = dataclasses.replace(ARCH_SPECS["bert"], name="roberta")
ARCH_SPECS["xlm-roberta"] = dataclasses.replace(ARCH_SPECS["bert"], name="xlm-roberta")

SUPPORTED = tuple(ARCH_SPECS)


def is_encoder_type(model_type: str | None) -> bool:
    """Whether a supported `model_type` is a bidirectional encoder (BERT-like: no next-token head to score)."""
    spec = ARCH_SPECS.get(model_type)
    return spec is not None and not spec.decoder


def arch_spec(config) -> ArchSpec:
    model_type = getattr(config, "model_type", None)
    spec = ARCH_SPECS.get(model_type)
    if spec is None:
        raise UnsupportedArchitectureError(
            f"architecture {model_type!r} is not supported; supported: {', '.join(SUPPORTED)}. "
            "Methods that need no sites (CoreLocker on plain PyTorch models) accept any model through "
            "mlpsurgery.sites.generic_layers().")
    return spec.at_config(config)


def layer_indices(config, names) -> set[int] | None:
    """The layer indices a checkpoint's tensor names hold (`model.layers.3.mlp.up_proj.weight` -> 3), read where the
    config's architecture keeps its layers (with or without the base model's prefix); None for an architecture
    without a spec (the caller then cannot tell which numbers in the names are layers)."""
    spec = ARCH_SPECS.get(getattr(config, "model_type", None))
    if spec is None:
        return None
    pattern = re.compile(r"(?:^|\.)" + re.escape(spec.at_config(config).layers) + r"\.(\d+)\.")
    return {int(m.group(1)) for m in map(pattern.search, names) if m}
