"""Nested Subspace Networks: one checkpoint, any compute budget at inference
(papers/nested-subspace-networks.txt; SPEC.md section 3).

Surgery (`nest`): every MLP projection (optionally every attention projection) of a pretrained model
becomes a `NestedLinear` initialised by SVD, B = U_R sqrt(S_R), A = sqrt(S_R) V_R^T: exact at full rank,
the best Frobenius approximation below it, components ordered by singular value.

Inference: `set_rank(model, r)` (whole model, per transformer layer, or per module path) or
`set_budget(model, f)`; the rank is a runtime attribute, switching it copies no weight.

Training (`train_nsn`): each step runs the step's batch twice, at the anchor rank R (the largest rank of
the training set) and at a variant rank r sampled below it (curriculum: start next to the anchor and widen
toward the lowest rank; or uniform), and minimises the multi-rank uncertainty objective (paper eq. 3)

    exp(-s_R) L(R) + s_R + exp(-s_r) L(r) + s_r

with one learnable log-variance s_k per rank of the training set, optimised with the model (they are
parameters handed to `fit`, so checkpoints hold them and a resumed run is the uninterrupted one). The
ablations of the paper's Table 1 are `objective="anchor"` (L(R) only) and `objective="two_ce"`
(L(R) + L(r), no uncertainty).

Analysis: `sweep` (metric vs rank and vs FLOPs), `containment` (paper A.3), `interpolation_check`
(Prop. 1 against measured loss differences), the learned log-variances (`TrainResult.log_var`).
Export at a fixed rank: `truncate` (smaller NestedLinears, loads with mlpsurgery.load) or `fold` (stock
Linear / Conv1D of the original shapes, so `mlpsurgery.export` writes a plain transformers folder).

FLOPs budgets are fractions of the dense FLOPs of the projections that were nested (for `--modules mlp`,
the MLP FLOPs of the original model). A NestedLinear costs 2r(in+out) per token against 2·in·out dense,
so full rank costs more than the dense layer (SmolLM2's MLP: 1.375x at r = 576); the break-even rank is
in·out/(in+out).
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import torch
from torch import Tensor, nn
from transformers.pytorch_utils import Conv1D

from ..errors import MLPSurgeryError
from ..io import check_out, record
from ..modules.nested import NestedLinear, flops_of, rank_all, rank_for_budget
from ..sites import find_sites, linear_weight, parse_layers
from ..train import FitConfig, fit, step_rng, trainable
from ..report import ends_stages, save_figure, stage

MODULE_CHOICES = ("mlp", "mlp+attn")
OBJECTIVES = ("uncertainty", "two_ce", "anchor")
SAMPLINGS = ("curriculum", "uniform")


# --------------------------------------------------------------------------------------------------
# Surgery


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


def nest(model: nn.Module, cfg: NSNConfig | None = None, progress: bool = False) -> nn.Module:
    """Replace the chosen projections with SVD-initialised NestedLinears, in place. Returns the model.
    progress: a bar over the projections (a full SVD each: about 30 s for SmolLM2's 90 MLP projections)."""
    from tqdm.auto import tqdm

    cfg = cfg or NSNConfig()
    if cfg.modules not in MODULE_CHOICES:
        raise MLPSurgeryError(f"modules must be one of {', '.join(MODULE_CHOICES)}, not {cfg.modules!r}")
    if cfg.max_rank is not None and cfg.max_rank < 1:
        raise MLPSurgeryError(f"max_rank must be at least 1, not {cfg.max_rank}")
    layers = parse_layers(cfg.layers, len(find_sites(model)))
    slots = list(_slots(model, cfg.modules, layers))
    done = [f"layer {s.index} {s.role}" for s in slots if isinstance(s.module, NestedLinear)]
    if done:
        raise MLPSurgeryError(f"{done[0]} is already a NestedLinear: this model was nested before; change its rank "
                              "with set_rank / `mlpsurgery nest rank` instead")
    for slot in tqdm(slots, desc="SVD", unit="projection", disable=not progress):
        weight, bias = linear_weight(slot.module)
        R = min(cfg.max_rank or min(weight.shape), min(weight.shape))
        slot.replace(NestedLinear.from_weight(weight, bias, R, dense_class=type(slot.module).__name__))
    record(model, "nsn", asdict(cfg), projections=len(slots))
    return model


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


# --------------------------------------------------------------------------------------------------
# Rank control


def current_ranks(model: nn.Module) -> dict[str, int]:
    return {p: m.rank for p, m in _require_nested(model).items()}


def _by_layer(model: nn.Module) -> dict[int, list[NestedLinear]]:
    out: dict[int, list[NestedLinear]] = {}
    for slot in _slots(model):
        if isinstance(slot.module, NestedLinear):
            out.setdefault(slot.index, []).append(slot.module)
    return out


def set_rank(model: nn.Module, rank) -> dict[str, int]:
    """Set the runtime rank. `rank`: an int for every nested projection (each capped at its own max_rank);
    a sequence with one int per transformer layer (None leaves a layer alone); a mapping from layer index or
    module path to rank. Returns path -> rank. No weight is copied."""
    layers = _require_nested(model)

    def put(m: NestedLinear, r) -> None:
        if isinstance(r, bool) or not isinstance(r, int) or r < 1:
            raise MLPSurgeryError(f"ranks are positive integers, not {r!r}")
        m.rank = min(r, m.max_rank)

    if isinstance(rank, int) and not isinstance(rank, bool):
        rank_all(layers.values(), rank)
    elif isinstance(rank, Mapping):
        by_layer = _by_layer(model) if any(not isinstance(k, str) for k in rank) else {}
        for key, r in rank.items():
            if isinstance(key, str):
                if key not in layers:
                    raise MLPSurgeryError(f"{key!r} is not a NestedLinear of this model (they are "
                                          f"{', '.join(list(layers)[:4])} ...)")
                put(layers[key], r)
            else:
                if key not in by_layer:
                    raise MLPSurgeryError(f"layer {key} has no nested projection (nested layers: {sorted(by_layer)})")
                for m in by_layer[key]:
                    put(m, r)
    elif isinstance(rank, Sequence) and not isinstance(rank, str):
        by_layer = _by_layer(model)
        n = len(find_sites(model))
        if len(rank) != n:
            raise MLPSurgeryError(f"a per-layer rank list needs one entry per layer ({n}), got {len(rank)}")
        for i, r in enumerate(rank):
            if r is not None:
                for m in by_layer.get(i, []):
                    put(m, r)
    else:
        raise MLPSurgeryError(f"rank must be an int, a per-layer list or a mapping, not {type(rank).__name__}")
    return current_ranks(model)


def nested_flops(model: nn.Module) -> dict:
    """FLOPs per token of the nested projections at their current ranks, of the dense projections they
    replaced, and the fraction."""
    return flops_of(_require_nested(model).values())


def budget_rank(model: nn.Module, fraction: float) -> int:
    """The largest single rank r (each projection at min(r, its max_rank)) whose FLOPs fit
    `fraction` x the dense FLOPs of the nested projections."""
    return rank_for_budget(_require_nested(model).values(), fraction)


def set_budget(model: nn.Module, fraction: float) -> dict:
    """Run at the largest rank whose FLOPs fit `fraction` of the dense FLOPs of the nested projections
    (for --modules mlp: of the original MLPs). Returns the rank and the fraction reached (which is lower
    than asked when even the maximum rank costs less)."""
    r = budget_rank(model, fraction)
    set_rank(model, r)
    return {"budget": fraction, "rank": r, **nested_flops(model)}


# --------------------------------------------------------------------------------------------------
# Training with multi-rank uncertainty


@dataclass
class NSNTrainConfig:
    """How `train_nsn` trains the hierarchy of ranks.

    ranks: the training rank set; its maximum is the anchor rank R, the others are the variant ranks.
        None: `n_ranks` ranks spaced geometrically from max_rank/16 to the model's max_rank.
    objective: "uncertainty" (the paper's objective), "two_ce" (L(R) + L(r), Table 1's "Two CEs") or
        "anchor" (L(R) only, Table 1's "CE Only (Anchor)").
    sampling: "curriculum" (the variant pool starts at the rank just below the anchor and widens, in
        order, to the lowest rank by `curriculum_end` of training) or "uniform".
    log_var_lr: learning rate of the log-variances (their own AdamW group, no weight decay): the model's
        learning rate (1e-4 for a pretrained LM) would leave them near 0 over a short run.
    train: "nested" trains the nested factors and their biases plus any parameters outside the base
        model except the LM head (a new classification head); the rest is frozen. "all" trains everything.
    """

    ranks: tuple[int, ...] | None = None
    n_ranks: int = 6
    objective: str = "uncertainty"
    sampling: str = "curriculum"
    curriculum_end: float = 0.5
    log_var_lr: float = 1e-2
    train: str = "nested"
    fit: FitConfig = field(default_factory=lambda: FitConfig(lr=1e-4))


def rank_ladder(top: int, n: int, bottom: int | None = None) -> list[int]:
    """n ranks spaced geometrically from `bottom` (default top/16) to `top`, rounded, distinct."""
    if n < 1 or top < 1:
        raise MLPSurgeryError(f"a rank ladder needs n >= 1 and top >= 1 (got n={n}, top={top})")
    lo = max(1, bottom if bottom is not None else round(top / 16))
    if n == 1 or lo >= top:
        return [top]
    return sorted({int(round(lo * (top / lo) ** (i / (n - 1)))) for i in range(n)})


def variant_rank(ranks: Sequence[int], step: int, steps: int, sampling: str = "curriculum",
                 curriculum_end: float = 0.5, seed: int = 0) -> int:
    """The variant rank of training step `step` (a pure function of its arguments, so resumable)."""
    below = sorted(ranks)[:-1]
    if not below:
        raise MLPSurgeryError("the variant rank needs at least two training ranks (the anchor and one below)")
    if sampling == "uniform":
        pool = below
    elif sampling == "curriculum":
        widen = 1.0 if curriculum_end <= 0 else min(1.0, step / max(1, steps) / curriculum_end)
        pool = below[len(below) - max(1, math.ceil(widen * len(below))):]
    else:
        raise MLPSurgeryError(f"sampling must be one of {', '.join(SAMPLINGS)}, not {sampling!r}")
    g = step_rng(seed, step, stream=1)
    return pool[int(torch.randint(len(pool), (1,), generator=g))]


class MultiRankObjective(nn.Module):
    """The per-step loss of NSN training over the training rank set; holds the log-variances s_k."""

    def __init__(self, ranks: Sequence[int], objective: str = "uncertainty", sampling: str = "curriculum",
                 curriculum_end: float = 0.5, steps: int = 1, seed: int = 0):
        super().__init__()
        if objective not in OBJECTIVES:
            raise MLPSurgeryError(f"objective must be one of {', '.join(OBJECTIVES)}, not {objective!r}")
        if sampling not in SAMPLINGS:
            raise MLPSurgeryError(f"sampling must be one of {', '.join(SAMPLINGS)}, not {sampling!r}")
        self.ranks = sorted(set(int(r) for r in ranks))
        if objective != "anchor" and len(self.ranks) < 2:
            raise MLPSurgeryError(f"objective {objective!r} needs at least two training ranks; got {self.ranks}")
        self.anchor = self.ranks[-1]
        self.objective, self.sampling, self.curriculum_end = objective, sampling, curriculum_end
        self.steps, self.seed = steps, seed
        self.log_var = nn.Parameter(torch.zeros(len(self.ranks)))  # s_k = log sigma_k^2, one per training rank

    def variant(self, step: int) -> int:
        return variant_rank(self.ranks, step, self.steps, self.sampling, self.curriculum_end, self.seed)

    def combine(self, loss_anchor: Tensor, loss_variant: Tensor | None, variant: int | None) -> Tensor:
        if self.objective == "anchor":
            return loss_anchor
        if self.objective == "two_ce":
            return loss_anchor + loss_variant
        s_R, s_r = self.log_var[-1], self.log_var[self.ranks.index(variant)]
        return torch.exp(-s_R) * loss_anchor + s_R + torch.exp(-s_r) * loss_variant + s_r

    def loss_fn(self, model: nn.Module, task_loss: Callable[[int], Tensor]) -> Callable[[int], tuple[Tensor, dict]]:
        """loss_fn(step) for `fit`: task_loss(step) at the anchor rank, then at the step's variant rank (the
        same batch: task_loss draws it from step_rng(seed, step))."""

        def loss_fn(step: int):
            set_rank(model, self.anchor)
            la = task_loss(step)
            metrics = {"loss_anchor": la.detach()}
            if self.objective == "anchor":
                return self.combine(la, None, None), metrics
            r = self.variant(step)
            set_rank(model, r)
            lr_ = task_loss(step)
            set_rank(model, self.anchor)
            metrics.update(loss_variant=lr_.detach(), variant_rank=r)
            if self.objective == "uncertainty":
                metrics.update(s_anchor=self.log_var[-1].detach(), s_variant=self.log_var[self.ranks.index(r)].detach())
            return self.combine(la, lr_, r), metrics

        return loss_fn

    def log_variances(self) -> dict[int, float]:
        return {r: float(s) for r, s in zip(self.ranks, self.log_var.detach())}

    def update_counts(self) -> dict[int, int]:
        """Steps whose loss includes each training rank (the anchor every step, a variant when sampled): s_k moves
        only on those steps, so compare learned log-variances beside these counts, not alone."""
        counts = {r: 0 for r in self.ranks}
        counts[self.anchor] = self.steps
        if self.objective != "anchor":
            for step in range(self.steps):
                counts[self.variant(step)] += 1
        return counts


def nsn_parameters(model: nn.Module, which: str = "nested") -> dict[str, nn.Parameter]:
    """The parameters NSN training updates (see NSNTrainConfig.train)."""
    if which == "all":
        return trainable(model)
    if which != "nested":
        raise MLPSurgeryError(f"train must be 'nested' or 'all', not {which!r}")
    base = getattr(model, "base_model", model)
    if base is model:  # a plain PyTorch model (e.g. an MLP classifier built from NestedLinears): all of it
        return dict(model.named_parameters())
    skip = {id(p) for p in base.parameters()}
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None:
        skip |= {id(p) for p in head.parameters()}
    out = {}
    for path, m in _require_nested(model).items():
        out.update({f"{path}.{n}": p for n, p in m.named_parameters()})
    out.update({n: p for n, p in model.named_parameters() if id(p) not in skip})
    return out


@dataclass
class TrainResult:
    ranks: list[int]
    anchor: int
    log_var: dict[int, float]  # learned s_k per training rank ({} unless objective = uncertainty)
    updates: dict[int, int]  # steps whose loss included each rank (s_k moves only then): read log_var beside it
    history: list[dict]
    steps: int
    resumed_from: int
    seconds: float
    # bytes this process held while training: the model's parameters, the trained ones, their gradients and AdamW
    # moments (under torchrun, its FSDP shard of each) and the number of ranks
    memory: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)


def train_nsn(model: nn.Module, task_loss: Callable[[int], Tensor], cfg: NSNTrainConfig | None = None,
              checkpoint_dir: str | Path | None = None, params: dict[str, nn.Parameter] | None = None,
              progress: bool = True, desc: str = "nsn", settings: dict | None = None) -> TrainResult:
    """Train a nested model with the multi-rank objective. task_loss(step) computes the task loss (LM or
    classification, e.g. mlpsurgery.train.lm_loss / classifier_loss) of the step's batch at the model's
    current rank. Leaves the model at the anchor rank. Checkpoints (factors, log-variances, optimizer,
    RNG) go to checkpoint_dir; a rerun with the same folder resumes, one made from another model or with other
    settings (the NSN config, the model's fingerprint, and the caller's `settings`: its data) is refused.
    Under torchrun with several ranks the model is sharded (FSDP2, mlpsurgery.parallel) for the training and
    plain again afterwards; task_loss must then take this rank's rows (lm_loss / classifier_loss do)."""
    from .. import parallel
    from ..files import model_fingerprint
    from ..measure.memory import peak_rss, reset_peak_rss

    cfg = cfg or NSNTrainConfig()
    top = max_rank(model)
    ranks = sorted(set(cfg.ranks)) if cfg.ranks else rank_ladder(top, cfg.n_ranks)
    if ranks[0] < 1 or ranks[-1] > top:
        raise MLPSurgeryError(f"training ranks must be in 1..{top} (the model's max_rank), got {ranks}")
    objective = MultiRankObjective(ranks, cfg.objective, cfg.sampling, cfg.curriculum_end, cfg.fit.steps,
                                   cfg.fit.seed)
    params = dict(params) if params is not None else nsn_parameters(model, cfg.train)
    chosen = {id(p) for p in params.values()}
    for p in model.parameters():
        p.requires_grad_(id(p) in chosen)
    groups = None
    if cfg.objective == "uncertainty":
        params["nsn.log_var"] = objective.log_var
        groups = [{"params": ["nsn.log_var"], "lr": cfg.log_var_lr, "weight_decay": 0.0}]
    model.train()
    identity = None
    if checkpoint_dir is not None:
        identity = {"model": model_fingerprint(model, skip=params), "nsn": {k: v for k, v in asdict(cfg).items() if k != "fit"},
                    "ranks": ranks, **(settings or {})}
    _, world = parallel.world()
    if world > 1:  # under torchrun: FSDP, each rank its share of every batch and of every tensor
        parallel.same_on_every_rank("models, data or settings", identity if identity is not None else
                                    model_fingerprint(model, skip=params))
        parallel.shard(model, next(model.parameters()).device)
        named = dict(model.named_parameters())
        params = {n: named.get(n, p) for n, p in params.items()}  # the sharded ones (log_var stays plain)
    model_bytes = parallel.local_bytes(model.parameters())
    before = peak_rss()  # loading and nesting
    reset_peak_rss()
    res = fit(params, objective.loss_fn(model, task_loss), cfg.fit, checkpoint_dir=checkpoint_dir, progress=progress,
              desc=desc, optimizer_groups=groups, settings=identity)
    parallel.unshard(model)
    model.eval()
    set_rank(model, objective.anchor)
    log_var = objective.log_variances() if cfg.objective == "uncertainty" else {}
    updates = objective.update_counts()
    record(model, "nsn-train", asdict(cfg) | {"ranks": ranks}, steps=res.steps, seconds=res.seconds,
           log_var={str(k): v for k, v in log_var.items()}, updates={str(k): v for k, v in updates.items()})
    return TrainResult(ranks=ranks, anchor=objective.anchor, log_var=log_var, updates=updates, history=res.history,
                       steps=res.steps, resumed_from=res.resumed_from, seconds=res.seconds,
                       memory={"model_param_bytes": model_bytes, **res.memory, "peak_rss_before_bytes": before,
                               "peak_rss_training_bytes": peak_rss()})


def learned_log_variances(model: nn.Module) -> dict[int, float]:
    """The log-variances of the last NSN training recorded on the model (survives save / load)."""
    return {int(k): v for k, v in _last_training(model).get("log_var", {}).items()}


def training_updates(model: nn.Module) -> dict[int, int]:
    """How many steps of the last NSN training included each rank (beside its log-variance; see update_counts)."""
    return {int(k): v for k, v in _last_training(model).get("updates", {}).items()}


def _last_training(model: nn.Module) -> dict:
    for h in reversed(getattr(model, "_mlpsurgery_history", [])):
        if h.get("method") == "nsn-train":
            return h.get("provenance", {})
    return {}


# --------------------------------------------------------------------------------------------------
# Analysis


def sweep_ranks(model: nn.Module, n: int = 8) -> list[int]:
    """Default ranks to evaluate: a geometric ladder from max_rank/32 to max_rank, plus the rank of a 50%
    FLOPs budget when it is reachable."""
    top = max_rank(model)
    ranks = set(rank_ladder(top, n, bottom=max(1, round(top / 32))))
    try:
        ranks.add(budget_rank(model, 0.5))
    except MLPSurgeryError:
        pass
    return sorted(ranks)


def sweep(model: nn.Module, evaluate: Callable[[], dict], ranks: Sequence[int] | None = None,
          progress: bool = True) -> list[dict]:
    """evaluate() at every rank: rows {rank, flops, dense_flops, fraction, **metrics}. The model's ranks are
    restored afterwards."""
    from tqdm.auto import tqdm

    saved = current_ranks(model)
    ranks = list(ranks) if ranks else sweep_ranks(model)
    rows = []
    try:
        for r in tqdm(ranks, desc="ranks", disable=not progress):
            set_rank(model, int(r))
            rows.append({"rank": int(r), **nested_flops(model), **evaluate()})
    finally:
        set_rank(model, saved)
    return rows


def _basis(m: NestedLinear, r: int) -> Tensor:
    """Orthonormal basis (out, r) of Im(W_r): the first r left singular vectors of W_r = B_r A_r, computed
    through the QR of B_r (W_r = Q (R_B A_r)), which is exact and avoids an SVD of the full matrix."""
    Q, RB = torch.linalg.qr(m.B.detach()[:, :r].double())
    U, _, _ = torch.linalg.svd(RB @ m.A.detach()[:r].double(), full_matrices=False)
    return Q @ U


def containment(model: nn.Module, ranks: Sequence[int], paths: Sequence[str] | None = None) -> Tensor:
    """Containment scores (paper A.3): C[i, j] = ||P_{ranks[j]} U_{ranks[i]}||_F^2 / ranks[i], the share of
    the rank-ranks[i] image inside the rank-ranks[j] image (1 = contained), averaged over the nested
    projections (or those in `paths`). Ranks above a projection's max_rank count as its max_rank."""
    layers = _require_nested(model)
    chosen = [layers[p] for p in paths] if paths else list(layers.values())
    k = len(ranks)
    total = torch.zeros(k, k, dtype=torch.float64)
    for m in chosen:
        rs = [min(int(r), m.max_rank) for r in ranks]
        bases = {r: _basis(m, r) for r in set(rs)}
        for i, small in enumerate(rs):
            for j, large in enumerate(rs):
                total[i, j] += (bases[large].T @ bases[small]).pow(2).sum() / small
    return (total / len(chosen)).float()


def energy_between(model: nn.Module, r1: int, r2: int) -> float:
    """sum over nested projections of sum_{i=r1+1}^{r2} ||b_i|| ||a_i|| (the Prop. 1 bound without C)."""
    total = 0.0
    for m in _require_nested(model).values():
        e = m.component_energy()
        total += float(e[min(r1, m.max_rank):min(r2, m.max_rank)].sum())
    return total


def energy_decay(model: nn.Module) -> dict:
    """How well Assumption 1 holds: the share of adjacent components whose energy ||b_i|| ||a_i|| rises."""
    rises, pairs = 0, 0
    for m in _require_nested(model).values():
        e = m.component_energy()
        rises += int((e[1:] > e[:-1]).sum())
        pairs += len(e) - 1
    return {"adjacent_pairs": pairs, "rising": rises, "rising_share": rises / max(pairs, 1)}


def interpolation_check(model: nn.Module, loss_by_rank: Mapping[int, float], trained: Sequence[int]) -> dict:
    """Prop. 1 against measurement. |E(r_int) - E(r_1)| <= C * sum_{i=r_1+1}^{r_int} ||b_i|| ||a_i||.

    C (= Lipschitz constant x E||x|| in the paper, unknown for a deep network) is fitted as the smallest
    constant for which the bound holds between consecutive *trained* ranks; the bound is then checked at
    every evaluated untrained rank r_int against the nearest trained rank r_1 below it.
    """
    E = {int(k): float(v) for k, v in loss_by_rank.items()}
    tr = sorted(int(r) for r in trained if int(r) in E)
    if len(tr) < 2:
        raise MLPSurgeryError("the interpolation check needs the loss at two or more trained ranks")
    calib = [{"r1": a, "r2": b, "measured": abs(E[b] - E[a]), "energy": energy_between(model, a, b)}
             for a, b in zip(tr, tr[1:])]
    C = max(c["measured"] / c["energy"] for c in calib if c["energy"] > 0)
    rows = []
    for r in sorted(set(E) - set(tr)):
        below = [t for t in tr if t < r]
        if not below:
            continue
        r1 = below[-1]
        measured, energy = abs(E[r] - E[r1]), energy_between(model, r1, r)
        rows.append({"r1": r1, "r_int": r, "measured": measured, "energy": energy, "bound": C * energy,
                     "holds": measured <= C * energy + 1e-12})
    return {"C": C, "calibration": calib, "interpolated": rows,
            "holds_share": sum(r["holds"] for r in rows) / len(rows) if rows else None}


def classifier_metrics(model: nn.Module, tokenizer, data, max_len: int = 128, batch_size: int = 32,
                       progress: bool = True) -> dict:
    """Accuracy and mean cross-entropy of a sequence classifier on a labelled set, in one pass."""
    from tqdm.auto import tqdm

    from ..measure.accuracy import batches

    device = next(model.parameters()).device
    labels = torch.tensor(data.labels)
    correct, loss = 0, 0.0
    was = model.training
    model.eval()
    with torch.no_grad():
        for k, enc in enumerate(tqdm(batches(tokenizer, data.texts, max_len, batch_size), desc="accuracy",
                                     total=-(-len(data) // batch_size), unit="batch", disable=not progress)):
            y = labels[k * batch_size: k * batch_size + len(enc["input_ids"])]
            logits = model(**{n: v.to(device) for n, v in enc.items()}).logits.float().cpu()
            correct += int((logits.argmax(-1) == y).sum())
            loss += float(nn.functional.cross_entropy(logits, y, reduction="sum"))
    model.train(was)
    return {"accuracy": correct / len(data), "loss": loss / len(data)}


# --------------------------------------------------------------------------------------------------
# Export at a fixed rank


def _nested_slots(model: nn.Module) -> list[_Slot]:
    return [s for s in _slots(model) if isinstance(s.module, NestedLinear)]


def truncate(model: nn.Module) -> nn.Module:
    """Keep only the components up to each projection's current rank (smaller, faster, same function at that
    rank; loads with mlpsurgery.load). In place."""
    slots = _nested_slots(model)
    if not slots:
        _require_nested(model)
    ranks = {f"{s.index}.{s.role}": s.module.rank for s in slots}
    for s in slots:
        s.replace(s.module.truncated())
    record(model, "nsn-truncate", {"ranks": sorted(set(ranks.values()))})
    return model


def fold(model: nn.Module) -> nn.Module:
    """Swap every NestedLinear for the stock Linear / Conv1D of the original shape holding W_r = B_r A_r, so
    the model is a stock transformers model again (mlpsurgery.export / save_pretrained). In place."""
    slots = _nested_slots(model)
    if not slots:
        _require_nested(model)
    ranks = sorted({s.module.rank for s in slots})
    for s in slots:
        s.replace(s.module.to_dense())
    record(model, "nsn-fold", {"ranks": ranks})
    return model


# --------------------------------------------------------------------------------------------------
# Plots


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_frontier(curves: Mapping[str, list[dict]], metric: str, path: str | Path, x: str = "fraction",
                  title: str = "", points: Mapping[str, list[dict]] | None = None, xlabel: str | None = None) -> Path:
    """Metric against FLOPs fraction (or rank): one line per curve, optional scattered reference points."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, rows in curves.items():
        ax.plot([r[x] for r in rows], [r[metric] for r in rows], marker="o", ms=3, label=label)
    for label, rows in (points or {}).items():
        ax.scatter([r[x] for r in rows], [r[metric] for r in rows], marker="s", s=30, zorder=3, label=label)
    ax.set_xlabel(xlabel or {"fraction": "FLOPs of the nested projections / dense", "rank": "rank"}.get(x, x))
    ax.set_ylabel(metric)
    if metric in ("ppl", "perplexity"):
        ax.set_yscale("log")  # truncation without training spans orders of magnitude
    if x in ("rank", "flops"):
        ax.set_xscale("log", base=2)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=9)
    return save_figure(fig, path)


def plot_containment(scores: Tensor, ranks: Sequence[int], path: str | Path, title: str = "") -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5, 4.2))
    im = ax.imshow(scores.numpy(), cmap="Blues", vmin=0, vmax=1)
    ax.set_xticks(range(len(ranks)), [str(r) for r in ranks], rotation=45)
    ax.set_yticks(range(len(ranks)), [str(r) for r in ranks])
    ax.set_xlabel("r': projected onto the image of W_r'")
    ax.set_ylabel("r: orthonormal basis of the image of W_r")
    for i in range(len(ranks)):
        for j in range(len(ranks)):
            ax.text(j, i, f"{float(scores[i, j]):.2f}", ha="center", va="center", fontsize=6,
                    color="white" if scores[i, j] > 0.6 else "black")
    fig.colorbar(im, ax=ax)
    ax.set_title(title, fontsize=9)
    return save_figure(fig, path)


def plot_log_variance(curves: Mapping[str, Mapping[int, float]], path: str | Path, title: str = "") -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for label, lv in curves.items():
        ks = sorted(lv)
        ax.plot(ks, [lv[k] for k in ks], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("training rank")
    ax.set_ylabel("learned log-variance s_k")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=9)
    return save_figure(fig, path)


# --------------------------------------------------------------------------------------------------
# End-to-end jobs (what the CLI runs)


def _is_classifier(model: nn.Module) -> bool:
    return type(model).__name__.endswith("ForSequenceClassification")


def is_labelled(data: str | None) -> bool:
    from ..data import BUNDLED_LABELLED

    return data is not None and (data in BUNDLED_LABELLED or
                                 str(data).removesuffix(".gz").endswith((".tab", ".tsv", ".csv", ".jsonl")))


@ends_stages
def nest_model(model_spec: str | None, out: str | Path, cfg: NSNConfig, train: NSNTrainConfig | None = None,
               data: str | None = None, batch_size: int = 8, block_len: int = 128, max_len: int = 128,
               checkpoint_dir: str | Path | None = None, overwrite: bool = False, device: str = "cpu",
               progress: bool = True) -> dict:
    """Load MODEL, nest it, train it with the multi-rank objective when train.fit.steps > 0 (language
    modelling on a corpus; classification on a labelled set, with a new head), save to `out`.

    Checkpoints go to checkpoint_dir (default: `out` + ".ckpt" beside it) and are removed once the model is
    saved; rerunning the same command after an interruption resumes."""
    from ..data import load_corpus, read_labelled
    from ..io import save
    from ..measure.perplexity import is_causal_lm
    from ..models import load_model
    from ..train import classifier_loss, lm_loss

    from ..files import check_state, remove_ours

    from .. import parallel

    out = Path(out)
    steps = train.fit.steps if train else 0
    ckpt = Path(checkpoint_dir) if checkpoint_dir else out.with_name(out.name + ".ckpt")
    rank, world = parallel.world()
    if world > 1 and steps == 0:
        raise MLPSurgeryError("under torchrun `nest` shards its training over the ranks: give --train-steps N, or run "
                              "it as one process")
    progress = progress and rank == 0

    def claims():  # rank 0's (every rank hears of a refusal); before hours of training
        check_out(out, overwrite, inputs=[model_spec, data, ckpt if steps > 0 else None])
        if steps > 0:
            check_state(ckpt, inputs=[model_spec, data, out])

    parallel.on_rank0(claims)
    stage(f"loading {model_spec or 'smollm2 (the default model)'}", progress)
    probe = load_model(model_spec)
    if not _is_classifier(probe.model) and any(a.endswith("ForSequenceClassification")
                                          for a in getattr(probe.model.config, "architectures", None) or []):
        probe = load_model(model_spec, task="classifier")
    encoder = not is_causal_lm(probe.model) and not _is_classifier(probe.model)
    classify = _is_classifier(probe.model) or is_labelled(data) or (data is None and encoder and steps > 0)
    if encoder and data is not None and not classify:
        raise MLPSurgeryError(f"{probe.source} is an encoder without an LM head: train it on labelled data "
                              "(--data r8-train, or a .tab/.csv/.jsonl file)")
    labelled, loaded = None, probe
    if classify and _is_classifier(probe.model):
        id2label = probe.model.config.id2label
        labelled = read_labelled(data or "r8-train", classes=[id2label[i] for i in range(len(id2label))])
    elif classify:
        labelled = read_labelled(data or "r8-train")
        loaded = load_model(model_spec, task="classifier", num_labels=labelled.num_classes)
        loaded.model.config.id2label = dict(enumerate(labelled.classes))
        loaded.model.config.label2id = {c: i for i, c in enumerate(labelled.classes)}
    model, tok = loaded.model.to(device), loaded.tokenizer
    nest(model, cfg, progress=progress)
    result: dict = {"model": loaded.source, "out": str(out), "config": asdict(cfg),
                    "projections": len(nested_linears(model)), "max_rank": max_rank(model),
                    "full_rank_flops_fraction": nested_flops(model)["fraction"]}
    if steps > 0:
        tok = loaded.require_tokenizer()
        if classify:
            task = classifier_loss(model, tok, labelled, batch_size, max_len=max_len, seed=train.fit.seed)
            result["data"] = {"labelled": data or "r8-train", "examples": len(labelled), "classes": labelled.classes}
        else:
            from ..models import check_context

            check_context(model, block_len)
            corpus = load_corpus(data, tok)
            blocks = corpus.blocks("train", block_len)
            task = lm_loss(model, blocks, batch_size, seed=train.fit.seed)
            result["data"] = {"corpus": corpus.source, "train_blocks": len(blocks), "block_len": block_len,
                              "split": corpus.split}
        res = train_nsn(model, task, train, checkpoint_dir=ckpt, progress=progress,
                        settings={"data": result["data"], "batch_size": batch_size, "max_len": max_len})
        result["train"] = {"ranks": res.ranks, "anchor": res.anchor, "log_var": res.log_var, "updates": res.updates,
                           "steps": res.steps,
                           "resumed_from": res.resumed_from, "seconds": res.seconds,
                           "final_loss": res.history[-1]["loss"] if res.history else None,
                           "objective": train.objective, "sampling": train.sampling, "memory": res.memory,
                           "history": res.history}
    if rank != 0:  # rank 0 saves the trained model
        return {**result, "rank": rank, "world_size": world}
    stage(f"saving the nested model to {out}", progress)
    save(model.cpu(), out, tokenizer=tok, overwrite=overwrite, inputs=[model_spec, data])
    if steps > 0:
        remove_ours(ckpt)
    return result


def export_rank(folder: str | Path, out: str | Path, rank: int | None = None, budget: float | None = None,
                form: str = "lowrank", overwrite: bool = False) -> dict:
    """Fix the rank of a nested model folder (by value or FLOPs budget) and write it as `lowrank` (truncated
    NestedLinears; mlpsurgery.load), `dense` (folded; a plain transformers folder) or `nested` (every
    component kept, the rank saved as the serving default)."""
    from ..io import export, save
    from ..measure.cost import count_params
    from ..models import load_model

    check_out(out, overwrite, inputs=[folder])
    if (rank is None) == (budget is None):
        raise MLPSurgeryError("give exactly one of --rank and --budget")
    if form not in ("lowrank", "dense", "nested"):
        raise MLPSurgeryError(f"form must be lowrank, dense or nested, not {form!r}")
    loaded = load_model(folder)
    model = loaded.model
    before = count_params(model)["total"]
    if budget is not None:
        chosen = set_budget(model, budget)
    else:
        set_rank(model, rank)
        chosen = {"rank": rank, **nested_flops(model)}
    if form == "lowrank":
        truncate(model)
    elif form == "dense":
        fold(model)
    if form == "dense":
        export(model, out, tokenizer=loaded.tokenizer, overwrite=overwrite)
    else:
        save(model, out, tokenizer=loaded.tokenizer, overwrite=overwrite, inputs=[folder])
    return {"from": str(folder), "out": str(out), "form": form, "rank": chosen["rank"], "budget": budget,
            "flops_fraction": chosen["fraction"], "params_before": before, "params_after": count_params(model)["total"],
            "loads_with": "transformers from_pretrained" if form == "dense" else "mlpsurgery.load"}


@ends_stages
def sweep_folder(folder: str | Path, data: str | None = None, ranks: Sequence[int] | None = None,
                 max_tokens: int = 8192, block_len: int | None = None, max_examples: int | None = 1000,
                 max_len: int = 128,
                 plot: str | Path | None = None, device: str = "cpu", progress: bool = True) -> dict:
    """Metric at every rank of a nested model folder: accuracy and loss of a classifier on labelled data
    (default r8-test), perplexity of a causal LM on held-out text (default the bundled Austen split; windows of
    `block_len`, default 256 or the model's context if shorter)."""
    from ..data import load_corpus, read_labelled
    from ..measure.perplexity import default_block_len, perplexity
    from ..models import load_model

    stage(f"loading {folder}", progress)
    loaded = load_model(folder)
    model = loaded.model.to(device)
    tok = loaded.require_tokenizer()
    _require_nested(model)
    if _is_classifier(model):
        classes = [model.config.id2label[i] for i in range(model.config.num_labels)]
        test = read_labelled(data or "r8-test", classes=classes)
        if max_examples and len(test) > max_examples:
            test = test.sample(max_examples, seed=0)

        def evaluate() -> dict:  # a bar per rank, left above the bar over the ranks
            return classifier_metrics(model, tok, test, max_len=max_len, progress=progress)

        metric, what = "accuracy", {"labelled": data or "r8-test", "examples": len(test)}
    else:
        if is_labelled(data):
            raise MLPSurgeryError(f"{folder} is a language model: sweep it on text (--data FILE|FOLDER|austen), "
                                  "not on a labelled set")
        corpus = load_corpus(data, tok)
        block_len = block_len or default_block_len(model, 256)

        def evaluate() -> dict:
            p = perplexity(model, corpus.heldout, block_len=block_len, max_tokens=max_tokens, progress=progress,
                           bos_id=corpus.bos)
            return {"ppl": p.ppl, "loss": p.nll, "tokens": p.tokens}

        metric, what = "ppl", {"corpus": corpus.source, "split": corpus.split, "max_tokens": max_tokens}
    t0 = time.perf_counter()
    rows = sweep(model, evaluate, ranks, progress=progress)
    out = {"model": str(folder), "metric": metric, "data": what, "rows": rows,
           "log_var": learned_log_variances(model), "updates": training_updates(model),
           "seconds": time.perf_counter() - t0}
    if plot is not None:
        out["plot"] = str(plot_frontier({Path(folder).name: rows}, metric, plot, title=f"{folder}: {metric} per rank"))
    return out
