"""NSN's nested start tuned layer by layer at every rank at once (`nest(..., local_epochs=E)`).

The whitened start (surgery.py) makes every rank of a nested MLP the best factorisation *of each projection* in the
metric of its inputs; the MLP's output at a low rank still carries the errors of three truncated projections, one
through the non-linearity of the others. Here each chosen layer, in order:

1. its calibration rows are the residual stream entering its MLP sub-block as the already nested (and tuned) layers
   before it produce it at the *stream rank* (the middle of the trained ranks), as sequential calibration does
   (reconstruct/sequential.py);
2. each projection is nested with the whitened start on those rows (its own inputs' second moment);
3. the nested MLP is trained E epochs (Adam, lr NSN_LOCAL_LR) on the rows toward the original sub-block's output,
   each step at one rank of the trained set (the ranks whose FLOPs fit the `fractions` of the layer's dense MLP),
   every rank's loss weighed by its error before tuning (reconstruct/local.py, `settings`) -- NSN's multi-rank
   objective, local and on the layer's own inputs, so that one checkpoint serves every rank; kept only if the
   weighted error fell.

Every rank stays a prefix of the next (the factors are trained, the nesting is structural), so the folder is an
ordinary NSN checkpoint: `set_rank` / `set_budget` / `nest rank` work unchanged, and the model is left at its
maximum rank as `nest` leaves it. These are gradient steps: the report records their steps and seconds.

With refit (`nest --refit`, no gradient step), step 2's down projection is not the original one factorised: it is
the least-squares down projection (ridge, reconstruct/refit.py) from the inner activations that the truncated gate /
up give at each rank of the trained set, pooled (each rank weighed by 1 / its error before), to the original MLP's
output -- the reduced-rank regression of the `svd` baseline (reconstruct/layer.py) made to serve every rank at once --
and factorised in the metric of those pooled activations, so every rank stays a prefix of the next. What it gives
up: at its maximum rank the nested MLP is no longer the original (the least-squares map is not W_down), which the
plain start keeps exactly; with the default 32k calibration tokens every rank from 25% to 100% of the FLOPs gains on
SmolLM2, with 8k the top ranks lose (docs/notes/nsn.md)."""

from __future__ import annotations

from dataclasses import asdict

import torch
from torch import Tensor, nn

from ...errors import MLPSurgeryError
from ...modules.nested import NestedLinear, rank_all, rank_for_budget
from ...sites import find_sites, parse_layers
from ..reconstruct.local import subblock_rows, tune_local_

FRACTIONS = (0.25, 0.375, 0.5, 0.625, 0.75, 0.875, 1.0)  # of the layer's dense MLP FLOPs: 25% to break-even
NSN_REFIT_RIDGE = 1e-4  # of the down refit pooled over the ranks (rows ~ 2 x the calibration's); reconstruct's 1e-3 was
# 2-3% worse on SmolLM2, 1e-5 no better (unweighted; benchmarks/notes/nsn_refit_ridge.py, docs/notes/nsn.md)
NSN_REFIT_WEIGH = True  # each rank's rows weighed by 1 / its error before (below)
NSN_LOCAL_LR = 3e-4  # factors B, A of a whitened start take smaller steps than whole neurons (reconstruct's 3e-3): on
# SmolLM2 at 8k rows, 4 epochs, 3e-3 was undone in every layer (the error rose), 1e-3 kept in 9 of 20, 3e-4 in 19
# (weighted error -5%), 1e-4 in 20 (-4%); docs/notes/calibration.md


def layer_ranks(modules, fractions=FRACTIONS) -> list[int]:
    """The ranks of the trained set for one layer's nested projections: for each fraction the largest single rank
    whose FLOPs fit it (fractions below what rank 1 costs are skipped), distinct, ascending."""
    top = max(m.max_rank for m in modules)
    ranks = set()
    for f in fractions:
        try:
            ranks.add(min(rank_for_budget(modules, f), top))
        except MLPSurgeryError:  # below rank 1's cost
            continue
    if not ranks:
        raise MLPSurgeryError(f"no rank of this layer fits the tuning fractions {list(fractions)}")
    return sorted(ranks)


def _moments_and_goal(site, slots, x: Tensor) -> tuple[dict[int, Tensor], Tensor]:
    """One pass of the (not yet nested) sub-block over the rows x: {n: E[a aᵀ]} of the n-th slot's inputs and what
    the sub-block adds to x (the tuning's target)."""
    from ..pruning.calibrated import moment_hooks

    handles, moments = moment_hooks({str(n): s.module for n, s in enumerate(slots)})
    try:
        goal = subblock_rows(site, x)
    finally:
        for h in handles:
            h.remove()
    got = moments()
    return {n: got[str(n)] for n in range(len(slots))}, goal


def rank_stats(site, nested, target, xin: Tensor, ranks, every: int) -> tuple[list, list[float]]:
    """For each rank of `ranks` (the nested MLP at `site`, its NestedLinears `nested`, set to it): the refit sums of
    its inner activations against `target`'s output on every `every`-th row of the MLP inputs xin (offset by the
    rank's place), and the relative error of its down projection as it is."""
    from ..reconstruct.refit import fit_error, refit_stats

    stats, before = [], []
    for j, r in enumerate(ranks):
        rank_all(nested, r)
        w = site.read()
        stats.append(refit_stats(w, target, xin[j % every::every]))
        before.append(fit_error(stats[-1], w.down, w.down_bias))
    return stats, before


def refit_down_nested_(site, nested, target, x: Tensor, ranks) -> dict:
    """The nested MLP at `site` (its NestedLinears `nested`) gets the down projection refit at every rank of
    `ranks` at once (the module docstring): one least-squares map from the inner activations the truncated gate / up
    give, pooled over the ranks (each weighed by 1 / its error before), to `target`'s output (the original MLP's
    weights) on the MLP inputs of the residual rows x; then nested in the metric of those activations. Each rank sees
    an equal share of the rows (every ceil(len(ranks) / 2)-th row, offset by the rank's place: the pooled rows are
    about twice x, not len(ranks) times). In place; returns the relative output error of the nested MLP at each rank
    before and after."""
    from ..reconstruct.layer import mlp_inputs
    from ..reconstruct.refit import fit_error, solve_down
    from ..reconstruct.whiten import whitened_factors

    down = site.linears()["down"]
    stats, before = rank_stats(site, nested, target, mlp_inputs(site, x), ranks, max(1, (len(ranks) + 1) // 2))
    # each rank's sums weighed by 1 / its squared error before: every rank's relative improvement counts alike (the
    # weighting of the multi-rank tuning). Unweighted, the low ranks' large errors decide the fit and the top ranks
    # lose: SmolLM2 at 100% of the FLOPs 46.2 against the plain start's 43.7, weighed 43.3 (docs/notes/nsn.md)
    pooled = None
    for st, e in zip(stats, before):
        part = st.scaled(1.0 / max(e * st.yy, 1e-300)) if NSN_REFIT_WEIGH else st
        pooled = part if pooled is None else pooled + part
    D, b = solve_down(pooled, down.bias is not None, NSN_REFIT_RIDGE)
    B, A, _ = whitened_factors(D, pooled.G / pooled.n)
    R = down.max_rank
    like = down.B.detach()
    new = NestedLinear.from_factors(B[:, :R], A[:R], None if b is None else b, dense_class=down.dense_class, like=like)
    site.replace_linear("down", new)
    with torch.no_grad():
        after = [fit_error(st, new.weight_at(r), None if b is None else new.bias) for r, st in zip(ranks, stats)]
    return {"error_before": before, "error_after": after}


def check_epochs(epochs: float) -> None:
    """Refuse a number of local tuning epochs that is not a number >= 0 (whole model and layer by layer alike)."""
    if epochs != epochs or epochs < 0:
        raise MLPSurgeryError(f"local tuning epochs must be a number >= 0, not {epochs}")


def check_tuned(cfg, epochs: float, refit: bool, fractions=FRACTIONS) -> None:
    """Refuse a tuned or refit nesting this configuration cannot have (before anything is read or written)."""
    if cfg.modules != "mlp":
        what = "local tuning trains" if epochs > 0 else "the down refit fits"
        raise MLPSurgeryError(f"{what} each MLP sub-block toward the original's output: nest --modules mlp with it "
                              "(the attention projections have no such target here)")
    if not fractions or any(not 0 < f for f in fractions):
        raise MLPSurgeryError(f"the tuning fractions must be positive FLOPs fractions, not {list(fractions)}")


def tune_layer_(model: nn.Module, cfg, i: int, x: Tensor, epochs: float, lr: float | None = None,
                fractions=FRACTIONS, seed: int = 0, refit: bool = False) -> dict:
    """One chosen layer of `nest_tuned` (steps 2-3 of the module docstring), in place, on the residual rows x entering
    its MLP sub-block: nested with the whitened start on x, its down projection refit at every rank of its trained set
    (refit), then tuned at every rank at once (epochs > 0). The layer is left at its stream rank (the middle of the
    trained ranks: what the next layer is calibrated on); the caller puts it back at its maximum rank. Returns its
    report row. The whole-model walk (`nest_tuned`) and the layer-by-layer one (layerwise.py) both run it."""
    from .surgery import layer_slots, nest_layer

    site = find_sites(model).mlp[i]
    slots = layer_slots(model, cfg, i)
    target = site.read() if refit else None  # the original MLP, before its projections are nested
    moments, goal = _moments_and_goal(site, slots, x)
    nest_layer(model, cfg, i, moments)
    del moments
    nested = [s.module for s in layer_slots(model, cfg, i)]
    ranks = layer_ranks(nested, fractions)
    fitted = {}
    if refit:
        fitted = {"refit": refit_down_nested_(site, nested, target, x, ranks)}
        nested = [s.module for s in layer_slots(model, cfg, i)]
    settings = [lambda r=r: rank_all(nested, r) for r in ranks]
    info = tune_local_(site, x, goal, epochs, lr or NSN_LOCAL_LR, seed=seed + i, settings=settings)
    stream = ranks[len(ranks) // 2]
    rank_all(nested, stream)
    return {"layer": i, "ranks": ranks, "stream_rank": stream, **info, **fitted}


def at_max_rank(model: nn.Module, cfg, i: int) -> None:
    """Every nested projection of layer i back at its maximum rank, as `nest` leaves them."""
    from .surgery import layer_slots

    for s in layer_slots(model, cfg, i):
        s.module.rank = s.module.max_rank


def tuned_report(rows: list[dict], epochs: float, lr: float | None, fractions, cfg) -> dict:
    """`nest_tuned`'s report from its layers' rows (in layer order)."""
    return {"layers": rows, "epochs": epochs, "lr": lr or NSN_LOCAL_LR, "fractions": list(fractions),
            "config": asdict(cfg), "steps": sum(r.get("steps", 0) for r in rows),
            "seconds": sum(r.get("seconds", 0.0) for r in rows)}


def tuned_provenance(report: dict, epochs: float, refit: bool) -> dict:
    """What `nest` records of a tuned or refit nesting beside its config: how it was started (`init`), and the
    summaries of the tuning ("local") and of the refit ("refit")."""
    init = "whitened svd, sequential" + (", down refit at every rank" if refit else "") + \
        (", multi-rank local tuning" if epochs > 0 else "")
    extra: dict = {"init": init}
    if epochs > 0:
        summary = {k: report[k] for k in ("epochs", "lr", "fractions", "steps", "seconds")}
        summary["layers_kept"] = sum(bool(r.get("kept")) for r in report["layers"])
        summary["layers"] = len(report["layers"])
        extra["local"] = summary
    if refit:
        extra["refit"] = {"exact_at_max_rank": False, "layers": len(report["layers"])}
    return extra


def nest_tuned(model: nn.Module, cfg, calib: Tensor, epochs: float, lr: float | None = None,
               fractions=FRACTIONS, progress: bool = False, seed: int = 0, batch_size: int = 8,
               refit: bool = False) -> dict:
    """`nest` with sequential calibration and multi-rank local tuning (the module docstring), in place. Returns the
    per-layer report: ranks trained, steps, seconds, the error at each rank before and after, kept. refit: each
    layer's down projection refit at every rank of its trained set before the tuning (`refit_down_nested_`);
    epochs may then be 0 (the closed form alone)."""
    from ..reconstruct.sequential import sequential

    check_tuned(cfg, epochs, refit, fractions)
    layers = parse_layers(cfg.layers, len(find_sites(model)))
    if not layers:
        return {"layers": []}

    def work(i: int, x: Tensor) -> dict:  # the next layer is calibrated on what this one gives at the stream rank
        return tune_layer_(model, cfg, i, x, epochs, lr, fractions, seed, refit)

    desc = "nest + local tuning" if epochs > 0 else "nest + down refit" if refit else "nest (sequential)"
    rows = sequential(model, calib, layers, work, batch_size=batch_size, progress=progress, desc=desc)
    for i in layers:
        at_max_rank(model, cfg, i)
    return tuned_report([rows[i] for i in layers], epochs, lr, fractions, cfg)
