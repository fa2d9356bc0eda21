"""LoRA (peft) on models that went through surgery: what peft should adapt inside the modules we install.

peft's `target_modules="all-linear"` finds the stock linears (nn.Linear, GPT-2's Conv1D). That covers the
modules whose weights are stock linears: DenseMLP, FusedMLP (LoRA on its down projection merges exactly: P
scales the activations before it), TruncatedSVDLinear and the narrowed attentions. It misses the two modules
whose weights are plain parameters, so peft is told about them through `target_parameters`:
- NestedLinear: LoRA on its factors A (R x in) and B (out x R). Every rank's weight W_r = B_r A_r is then
  adapted, the rank hierarchy stays (rank r still uses the first r components), and merging adds the deltas
  into A and B: the merged model is still a nested model that switches rank.
- DLRNet: LoRA on the stacked D (depth, r, d) and U (depth, d, r), one adapter per block, the way peft adapts
  stacked expert weights.

    cfg = mlpsurgery.lora_config(model, r=8)          # a peft LoraConfig
    peft_model = peft.get_peft_model(model, cfg)      # train, then peft_model.merge_and_unload()
"""

from __future__ import annotations

from torch import nn

from .modules.dlr import DLRNet
from .modules.nested import NestedLinear

PARAMETER_TARGETS = {NestedLinear: ("A", "B"), DLRNet: ("D", "U")}


def lora_targets(model: nn.Module) -> dict:
    """{"target_modules": ..., "target_parameters": [full parameter names]} for peft's LoraConfig."""
    params = []
    for path, mod in model.named_modules():
        for klass, names in PARAMETER_TARGETS.items():
            if isinstance(mod, klass):
                params += [f"{path}.{n}" if path else n for n in names]
    return {"target_modules": "all-linear", "target_parameters": params}


def lora_config(model: nn.Module, r: int = 8, lora_alpha: int | None = None, **kwargs):
    """A peft LoraConfig adapting every linear map of `model`, inside the installed modules too (see above).
    Extra keyword arguments go to LoraConfig (e.g. lora_dropout, which peft allows only without parameter
    targets)."""
    from peft import LoraConfig

    targets = lora_targets(model)
    if not targets["target_parameters"]:
        targets.pop("target_parameters")
    return LoraConfig(r=r, lora_alpha=lora_alpha or 2 * r, **{**targets, **kwargs})
