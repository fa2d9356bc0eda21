"""The module registry: the base class of the modules mlpsurgery installs and the allowlist that lets a
saved model be rebuilt from its manifest (only registered classes are ever constructed).

Like every file of this package, it imports only torch, transformers and mlpsurgery.errors: a folder whose
structure is not stock carries copies of these files (written by io.save through standalone.py), so that
transformers alone rebuilds the model. A module's forward and constructor must therefore not need the rest of mlpsurgery.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from transformers.pytorch_utils import Conv1D

from ..errors import IntegrityError

# Stock modules appear in manifests too: Identity (a removed norm) and resized linears.
MODULES: dict[str, type] = {"Identity": nn.Identity, "Linear": nn.Linear, "Conv1D": Conv1D}


class SurgeryModule(nn.Module):
    """A module the library installs into a model. It can be rebuilt from `config()` alone
    (weights come from the checkpoint), and may say how to fold itself into a dense MLP."""

    def config(self) -> dict[str, Any]:
        """JSON-serialisable constructor arguments."""
        raise NotImplementedError

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> "SurgeryModule":
        return cls(**cfg)

    def to_mlp_weights(self):
        """The equivalent dense MLP (an `MLPWeights`), or None when no dense MLP computes the same function."""
        return None

    def export_blocker(self) -> str:
        """Why this module has no stock `transformers` equivalent (used when to_mlp_weights is None)."""
        return f"{type(self).__name__} has no dense-MLP equivalent"


def register(cls: type) -> type:
    """Class decorator: allow `cls` to be rebuilt from a manifest."""
    MODULES[cls.__name__] = cls
    return cls


def build(name: str, cfg: dict[str, Any]) -> nn.Module:
    klass = MODULES.get(name)
    if klass is None:
        raise IntegrityError(f"the manifest names module class {name!r}, which mlpsurgery does not know "
                             f"(known: {', '.join(sorted(MODULES))}); it was written by a newer or a modified "
                             "mlpsurgery, or edited by hand")
    try:
        if klass is nn.Identity:
            return nn.Identity()
        if klass is nn.Linear:
            return nn.Linear(cfg["in_features"], cfg["out_features"], bias=cfg["bias"])
        if klass is Conv1D:
            mod = Conv1D(cfg["nf"], cfg["nx"])
            if not cfg.get("bias", True):
                mod.bias = None
            return mod
        return klass.from_config(cfg)
    except (KeyError, TypeError, ValueError, RuntimeError, AttributeError) as e:
        raise IntegrityError(f"the manifest's config for {name} is invalid ({type(e).__name__}: {e}); it was edited "
                             "by hand") from None


def module_config(mod: nn.Module) -> dict[str, Any]:
    """Constructor arguments of a registered module (stock linears included, for resized layers)."""
    if isinstance(mod, nn.Identity):
        return {}
    if type(mod) is nn.Linear:
        return {"in_features": mod.in_features, "out_features": mod.out_features, "bias": mod.bias is not None}
    if type(mod) is Conv1D:
        return {"nf": mod.nf, "nx": mod.weight.shape[0], "bias": mod.bias is not None}
    return mod.config()
