"""What a model went through: its structure against the stock architecture (`replaced_modules`), the history
of methods applied (`record`), and the model it was made from (`source_of`, `check_source`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import IntegrityError, MLPSurgeryError
from ..modules import MODULES, build, module_config


def _stock(config, model_class: str) -> nn.Module:
    import transformers

    klass = getattr(transformers, model_class, None)
    if klass is None or not isinstance(klass, type) or not issubclass(klass, transformers.PreTrainedModel):
        raise IntegrityError(f"the manifest names model class {model_class!r}, which transformers does not have")
    with torch.device("meta"):
        return klass._from_config(config)


def _own_shapes(mod: nn.Module) -> dict[str, tuple]:
    return {n: tuple(p.shape) for n, p in mod.named_parameters(recurse=False)}


def replaced_modules(model: nn.Module) -> list[dict[str, Any]]:
    """Modules whose class (or own parameter shapes) differ from what the path would hold otherwise: what `load`
    must rebuild, in this order, before the weights fit. A replaced module's children are compared with a fresh
    build of it, so surgery inside it (a fused MLP whose projections were nested) is recorded too."""
    ref_of = dict(_stock(model.config, type(model).__name__).named_modules())
    out = []
    for path, mod in model.named_modules():
        ref = ref_of.get(path)
        if ref is not None and type(ref) is type(mod) and _own_shapes(ref) == _own_shapes(mod):
            continue
        name = type(mod).__name__
        if MODULES.get(name) is not type(mod):
            raise MLPSurgeryError(
                f"{path} is a {name}, which is not a registered mlpsurgery module; register it with "
                "@mlpsurgery.modules.register (and give it config()/from_config) so it can be saved and rebuilt")
        config = module_config(mod)
        out.append({"path": path, "class": name, "config": config})
        with torch.device("meta"):
            fresh = build(name, config)
        for sub, child in fresh.named_modules():  # what the rebuilt module's insides hold by themselves
            if sub:
                ref_of[f"{path}.{sub}"] = child
        for stale in [p for p in ref_of if p.startswith(path + ".") and p.removeprefix(path + ".")
                      not in dict(fresh.named_modules())]:
            del ref_of[stale]
    return out


def history(model: nn.Module) -> list[dict]:
    """The list of methods applied to this model (kept on the model between calls)."""
    return list(getattr(model, "_mlpsurgery_history", []))


def record(model: nn.Module, method: str, config: dict | None = None, **provenance) -> None:
    """Append one method application to the model's history (saved in the manifest)."""
    hist = getattr(model, "_mlpsurgery_history", [])
    hist.append({"method": method, "config": config or {}, "provenance": provenance})
    model._mlpsurgery_history = hist


def source_of(model: nn.Module) -> dict | None:
    """{"name", "fingerprint"} of the model this one was made from (format-1 manifests held a path: its name)."""
    src = getattr(model, "_mlpsurgery_source", None)
    if isinstance(src, str):
        return {"name": Path(src).name if "/" in src else src, "fingerprint": None}
    return src if isinstance(src, dict) else None


def loaded_from(model: nn.Module) -> str | None:
    """The local path this model was loaded from (kept in memory only, never written to a manifest): an input
    that nothing written from the model may be, hold or lie inside."""
    return getattr(model, "_mlpsurgery_path", None)


def source_spec(model: nn.Module) -> str | None:
    """A MODEL string that reloads the original, where its name is one (bundled and tiny models); else None."""
    src = source_of(model)
    name = (src or {}).get("name")
    if isinstance(name, str) and (name in ("smollm2", "minilm") or name.startswith("tiny:")):
        return name
    return None


def check_source(model: nn.Module, original: nn.Module, given: str) -> None:
    """Refuse an `original` that is not the model `model` was made from (when the manifest recorded it)."""
    want = (source_of(model) or {}).get("fingerprint")
    have = (source_of(original) or {}).get("fingerprint")
    if want and have and want != have:
        raise MLPSurgeryError(f"{given} is not the model this one was made from ({(source_of(model) or {}).get('name')}, "
                              "by its weights' fingerprint); give the original model")
