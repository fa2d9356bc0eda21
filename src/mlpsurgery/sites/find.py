"""Every site of a model (`find_sites`) and the layer-selection syntax (`parse_layers`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from ..errors import MLPSurgeryError, UnsupportedArchitectureError
from .attn import AttnSite
from .linears import _get
from .mlp import MLPSite
from .specs import SUPPORTED, ArchSpec, arch_spec


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
