"""NSN training with the multi-rank uncertainty objective (paper eq. 3), and what it learned."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch
from torch import Tensor, nn

from ...errors import MLPSurgeryError
from ...io import record
from ...train import FitConfig, fit, step_rng, trainable

from .surgery import _require_nested, max_rank
from .ranks import set_rank

OBJECTIVES = ("uncertainty", "two_ce", "anchor")
SAMPLINGS = ("curriculum", "uniform")


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
              progress: bool = True, desc: str = "nsn", settings: dict | None = None,
              unshard: bool = True) -> TrainResult:
    """Train a nested model with the multi-rank objective. task_loss(step) computes the task loss (LM or
    classification, e.g. mlpsurgery.train.lm_loss / classifier_loss) of the step's batch at the model's
    current rank. Leaves the model at the anchor rank. Checkpoints (factors, log-variances, optimizer,
    RNG) go to checkpoint_dir; a rerun with the same folder resumes, one made from another model or with other
    settings (the NSN config, the model's fingerprint, and the caller's `settings`: its data) is refused.
    Under torchrun with several ranks the model is sharded (FSDP2, mlpsurgery.parallel; or given sharded by
    parallel.load_sharded) for the training and plain again afterwards on every rank, or left sharded with
    unshard=False (to be saved by parallel.save_sharded, never whole in one process); task_loss must then take
    this rank's rows (lm_loss / classifier_loss do)."""
    from ... import parallel
    from ...files import model_fingerprint
    from ...measure.memory import peak_rss, reset_peak_rss

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
    if unshard:
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
