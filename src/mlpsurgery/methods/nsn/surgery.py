"""NSN surgery: every chosen projection becomes a NestedLinear initialised by SVD (exact at full rank)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Iterator

from torch import Tensor, nn
from transformers.pytorch_utils import Conv1D

from ...errors import MLPSurgeryError
from ...io import record
from ...modules.nested import NestedLinear
from ...sites import find_sites, linear_weight, parse_layers
from ..reconstruct.whiten import whitened_factors

MODULE_CHOICES = ("mlp", "mlp+attn")


@dataclass
class NSNConfig:
    """What `nest` replaces.

    max_rank: R, components kept per projection; None keeps min(in, out) (exact at full rank). A value
        above a projection's min(in, out) is capped there (more components add nothing).
    modules: "mlp" (every MLP projection; Phi-3's fused gate_up is one projection) or "mlp+attn"
        (also q/k/v/o, or the fused qkv).
    layers: which transformer layers ("all", "0-5", "last2/3", ...).
    """

    max_rank: int | None = None
    modules: str = "mlp"
    layers: str = "all"


class _Slot:
    """One projection reachable through the sites layer: where it sits (layer index, role) and how to swap it."""

    def __init__(self, site, role: str, module: nn.Module, owner: nn.Module | None = None):
        self.site, self.role, self.module, self._owner = site, role, module, owner

    @property
    def index(self) -> int:
        return self.site.index

    def replace(self, new: nn.Module) -> None:
        if self._owner is None:
            self.site.replace_linear(self.role, new)
        else:  # a projection inside a module that replaced the MLP (fused or dense MLPs hold stock linears)
            setattr(self._owner, self.role.rpartition(".")[2], new)


def _slots(model: nn.Module, modules: str = "mlp+attn", layers: list[int] | None = None) -> Iterator[_Slot]:
    """Every projection reachable through the sites layer (and the stock linears inside a replaced MLP)."""
    sites = find_sites(model)
    chosen = range(len(sites)) if layers is None else layers
    for i in chosen:
        mlp = sites.mlp[i]
        # a whole-MLP replacement (fused / dense MLP, DLR-Net): its slot holds something that is not a projection
        single = (nn.Linear, Conv1D, NestedLinear) if mlp.spec.mlp_layout != "module" else ()
        if mlp.replaced and not isinstance(mlp.module, (nn.Identity, *single)):
            found = [(name, m) for name, m in mlp.module.named_modules()
                     if isinstance(m, (nn.Linear, Conv1D, NestedLinear))]
            if not found:
                raise MLPSurgeryError(f"layer {i}: the MLP was replaced by {type(mlp.module).__name__}, which has no "
                                      "linear projections to nest; nest before that surgery")
            for name, m in found:
                parent = name.rpartition(".")[0]
                yield _Slot(mlp, name, m, mlp.module.get_submodule(parent) if parent else mlp.module)
        else:
            try:
                parts = mlp.linears()
            except AttributeError:
                raise MLPSurgeryError(f"layer {i}: the MLP was replaced by {type(mlp.module).__name__}, which has no "
                                      "stock projections to nest; nest before that surgery") from None
            yield from (_Slot(mlp, role, m) for role, m in parts.items())
        if modules == "mlp+attn":
            yield from (_Slot(sites.attn[i], role, m) for role, m in sites.attn[i].linears().items())


def check_config(cfg: NSNConfig) -> None:
    if cfg.modules not in MODULE_CHOICES:
        raise MLPSurgeryError(f"modules must be one of {', '.join(MODULE_CHOICES)}, not {cfg.modules!r}")
    if cfg.max_rank is not None and cfg.max_rank < 1:
        raise MLPSurgeryError(f"max_rank must be at least 1, not {cfg.max_rank}")


def nest_slot(slot: _Slot, cfg: NSNConfig, C: Tensor | None = None) -> None:
    """One projection replaced by its SVD-initialised NestedLinear (rank capped at min(in, out)); with C, the second
    moment of its inputs, by the whitened SVD (methods/reconstruct/whiten.py: each rank the best in the metric of those
    inputs; nested and exact at full rank all the same)."""
    weight, bias = linear_weight(slot.module)
    R = min(cfg.max_rank or min(weight.shape), min(weight.shape))
    dense_class = type(slot.module).__name__
    if C is None:
        slot.replace(NestedLinear.from_weight(weight, bias, R, dense_class=dense_class))
        return
    B, A, _ = whitened_factors(weight, C)
    slot.replace(NestedLinear.from_factors(B[:, :R], A[:R], bias, dense_class=dense_class, like=weight))


def input_moments_of(model: nn.Module, slots: list[_Slot], calib: Tensor, batch_size: int = 8) -> dict[int, Tensor]:
    """{id(slot): E[x xᵀ]} of every slot's inputs on the calibration blocks (N, T), in the model as it is (one pass)."""
    from ..pruning.calibrated import input_moments

    linears = {str(n): s.module for n, s in enumerate(slots)}
    moments = input_moments(model, calib, linears, stop_after=max(s.index for s in slots), batch_size=batch_size)
    return {n: moments[str(n)] for n in range(len(slots)) if str(n) in moments}


def nest(model: nn.Module, cfg: NSNConfig | None = None, progress: bool = False,
         calib_data: Tensor | None = None, local_epochs: float = 0.0, local_lr: float | None = None,
         seed: int = 0, refit: bool = False) -> nn.Module:
    """Replace the chosen projections with SVD-initialised NestedLinears, in place. Returns the model.
    progress: a bar over the projections (a full SVD each: about 30 s for SmolLM2's 90 MLP projections).
    calib_data ((N, T) token blocks): the whitened start -- each projection factorised in the metric of its inputs on
    these blocks (the original model's, measured in one pass before any change), so that every rank is the best of its
    size for the outputs the layer really produces; without it the plain SVD (the paper's B.2).
    local_epochs > 0 (needs calib_data, --modules mlp): layer by layer, the whitened start on the rows the nested
    layers before it produce, then `local_epochs` epochs of multi-rank local tuning toward the original MLP's output
    (local.py); its report is recorded in the model's surgery record under "local".
    refit (needs calib_data, --modules mlp): the same sequential start with each down projection refit by least
    squares at every rank it serves (local.py: with enough calibration every rank that saves FLOPs gains; the maximum
    rank is then not the original MLP); with or without local tuning after it."""
    from tqdm.auto import tqdm

    from .local import check_epochs

    cfg = cfg or NSNConfig()
    check_config(cfg)
    check_epochs(local_epochs)
    if local_epochs > 0 and calib_data is None:
        raise MLPSurgeryError("local tuning trains each nested MLP on calibration rows: give calibration data (drop "
                              "--data-free) or drop --local-epochs")
    if refit and calib_data is None:
        raise MLPSurgeryError("the down refit fits each nested MLP on calibration rows: give calibration data (drop "
                              "--data-free) or drop --refit")
    layers = parse_layers(cfg.layers, len(find_sites(model)))
    slots = list(_slots(model, cfg.modules, layers))
    done = [f"layer {s.index} {s.role}" for s in slots if isinstance(s.module, NestedLinear)]
    if done:
        raise MLPSurgeryError(f"{done[0]} is already a NestedLinear: this model was nested before; change its rank "
                              "with set_rank / `mlpsurgery nest rank` instead")
    if local_epochs > 0 or refit:
        from .local import nest_tuned, tuned_provenance

        report = nest_tuned(model, cfg, calib_data, local_epochs, local_lr, progress=progress, seed=seed, refit=refit)
        record(model, "nsn", asdict(cfg), projections=len(slots), calib_tokens=int(calib_data.numel()),
               **tuned_provenance(report, local_epochs, refit))
        return model
    moments = {}
    if calib_data is not None and slots:
        moments = input_moments_of(model, slots, calib_data)
    for n, slot in enumerate(tqdm(slots, desc="whitened SVD" if moments else "SVD", unit="projection",
                                  disable=not progress)):
        nest_slot(slot, cfg, moments.pop(n, None))
        slot.module = None  # the replaced projection is freed now, not when the last one is done
    record(model, "nsn", asdict(cfg), projections=len(slots),
           **({"calib_tokens": int(calib_data.numel()), "init": "whitened svd"} if calib_data is not None else {}))
    return model


def layer_slots(model: nn.Module, cfg: NSNConfig, i: int) -> list[_Slot]:
    """The projections `nest` replaces in decoder layer i (none when cfg does not choose the layer)."""
    if i not in parse_layers(cfg.layers, len(find_sites(model))):
        return []
    return list(_slots(model, cfg.modules, [i]))


def nest_layer(model: nn.Module, cfg: NSNConfig, i: int, moments: dict[int, Tensor] | None = None) -> int:
    """`nest` for decoder layer i alone (the layer-by-layer paths: the layer is in memory, the others may not be):
    its chosen projections replaced, in place; how many. moments: {n: E[x xᵀ]} of the inputs of the layer's n-th
    slot (`layer_slots`), for the whitened start."""
    slots = layer_slots(model, cfg, i)
    if any(isinstance(s.module, NestedLinear) for s in slots):
        raise MLPSurgeryError(f"layer {i} already has a NestedLinear: this model was nested before; change its rank "
                              "with set_rank / `mlpsurgery nest rank` instead")
    for n, slot in enumerate(slots):
        nest_slot(slot, cfg, None if moments is None else moments[n])
        slot.module = None
    return len(slots)


def nested_linears(model: nn.Module) -> dict[str, NestedLinear]:
    """path -> NestedLinear, in module order (works on any PyTorch model)."""
    return {p: m for p, m in model.named_modules() if isinstance(m, NestedLinear)}


def _require_nested(model: nn.Module) -> dict[str, NestedLinear]:
    layers = nested_linears(model)
    if not layers:
        raise MLPSurgeryError("the model has no NestedLinear layers: apply mlpsurgery.nest (or `mlpsurgery nest`) "
                              "first")
    return layers


def max_rank(model: nn.Module) -> int:
    return max(m.max_rank for m in _require_nested(model).values())
