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

Files: specs.py (ARCH_SPECS: the per-architecture paths and layouts), weights.py (MLPWeights, AttnWeights),
mlp.py (MLPSite), attn.py (AttnSite), linears.py (Linear / GPT-2 Conv1D access by path), find.py (find_sites,
parse_layers), generic.py (plain PyTorch models: generic_layers).
"""

from .attn import AttnSite
from .find import Sites, find_sites, parse_layers
from .generic import GenericLayer, generic_layers
from .linears import linear_weight
from .mlp import MLPSite
from .specs import ARCH_SPECS, SUPPORTED, ArchSpec, arch_spec, layer_indices
from .weights import AttnWeights, MLPWeights, activation_fn

__all__ = ["ARCH_SPECS", "SUPPORTED", "ArchSpec", "AttnSite", "AttnWeights", "GenericLayer", "MLPSite", "MLPWeights",
           "Sites", "activation_fn", "arch_spec", "find_sites", "generic_layers", "layer_indices", "linear_weight",
           "parse_layers"]
