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

The package's files name its concerns: surgery.py (nest, NestedLinear slots), ranks.py (set_rank / set_budget),
training.py (the multi-rank objective, train_nsn), analysis.py (sweeps, containment, interpolation check),
export.py (truncate, fold), plots.py, pipeline.py (the jobs the CLI runs: nest_model, export_rank, sweep_folder).
"""

from .analysis import (classifier_metrics, containment, energy_between, energy_decay, interpolation_check, sweep,
                       sweep_ranks)
from .export import fold, truncate
from .pipeline import export_rank, is_labelled, nest_model, sweep_folder
from .plots import _pyplot, plot_containment, plot_frontier, plot_log_variance
from .ranks import budget_rank, current_ranks, nested_flops, set_budget, set_rank
from .surgery import MODULE_CHOICES, NSNConfig, max_rank, nest, nested_linears
from .training import (OBJECTIVES, SAMPLINGS, MultiRankObjective, NSNTrainConfig, TrainResult, learned_log_variances,
                       nsn_parameters, rank_ladder, train_nsn, training_updates, variant_rank)

__all__ = ["MODULE_CHOICES", "OBJECTIVES", "SAMPLINGS", "MultiRankObjective", "NSNConfig", "NSNTrainConfig",
           "TrainResult", "budget_rank", "classifier_metrics", "containment", "current_ranks", "energy_between",
           "energy_decay", "export_rank", "fold", "interpolation_check", "is_labelled", "learned_log_variances",
           "max_rank", "nest", "nest_model", "nested_flops", "nested_linears", "nsn_parameters", "plot_containment",
           "plot_frontier", "plot_log_variance", "rank_ladder", "set_budget", "set_rank", "sweep", "sweep_folder",
           "sweep_ranks", "train_nsn", "training_updates", "truncate", "variant_rank", "_pyplot"]
