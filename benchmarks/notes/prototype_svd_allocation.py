"""Issue 45, tried in session 31: the whitened SVD's per-layer budget from SVD's own error curves (SVD-LLM V2
allocates by measured truncation loss), instead of the neuron plan `--budget per-layer` gives every fuse method.

budget.plan_widths is replaced, for this run only, by one whose two measurements are SVD's:
- each chosen layer's error curve e_i(k): the relative output error of its MLP with gate / up whitened-truncated to
  the rank a width k pays for (`svd_rank`) and the down projection the reduced-rank regression on what they give (the
  `svd` baseline's own construction, reconstruct/layer.py `whitened_svd_`), on 4,096 of its calibration rows, every
  GRID neurons (linear in between);
- its effect on the output: that layer alone so compressed at the uniform width k0 (the others original), the
  model's mean KL from the original (budget._Probe, as the neuron plan measures it).
The allocation is budget.plan_widths' own greedy rule on those (cost dL_i * e_i(k) / e_i(k0)); the svd compressor
then gets each layer's width and so its rank. Layers are measured on the original model's activations, as the
neuron plan does.

    python benchmarks/notes/prototype_svd_allocation.py compare smollm2 --out runs/proto/svd-alloc --methods svd \
        --budgets 0.5 --budget per-layer --max-tokens 2048 --threads 2 --repeats 1 --no-models
"""
import math
import sys

import torch

from mlpsurgery.cli import main
from mlpsurgery.methods.fusion.compress import svd_rank
from mlpsurgery.methods.reconstruct import budget
from mlpsurgery.methods.reconstruct.layer import mlp_inputs, second_moment
from mlpsurgery.methods.reconstruct.refit import fit_error, refit_stats, solve_down
from mlpsurgery.methods.reconstruct.whiten import whitened_factors
from mlpsurgery.modules.dense import DenseMLP
from mlpsurgery.sites import find_sites

GRID = 96
ROWS = 4096


def truncated(w, fg, fu, fd_of, k: int):
    """The MLP weights of the svd baseline at width k (dense products of the truncated factors)."""
    r = svd_rank(w.up.shape[0], w.up.shape[1], k, w.h)
    out = w.map(lambda t: t)
    out.up = (fu[0][:, :r] @ fu[1][:r]).to(w.up)
    if w.gate is not None:
        out.gate = (fg[0][:, :r] @ fg[1][:r]).to(w.gate)
    return out, r


def svd_at(w, xin, fg, fu, k: int):
    """(weights, relative error on xin) of the svd baseline at width k: down = reduced-rank regression."""
    new, r = truncated(w, fg, fu, None, k)
    st = refit_stats(new, w, xin)
    D, b = solve_down(st, w.down_bias is not None)
    B, A, _ = whitened_factors(D, st.G / max(st.n, 1))
    Dr = B[:, :r] @ A[:r]
    new.down = Dr.to(w.down)
    if b is not None:
        new.down_bias = b.to(w.down)
    return new, fit_error(st, Dr, b)


def plan_widths(model, calib, uniform, step=budget.STEP, floor=budget.FLOOR, probe_blocks=budget.PROBE_BLOCKS,
                progress=True):
    sites = find_sites(model)
    layers = sorted(uniform)
    hs = {i: sites.mlp[i].h for i in layers}
    k0 = dict(uniform)
    lo = {i: min(k0[i], max(1, math.ceil(floor * hs[i]))) for i in layers}
    curves, narrowed = {}, {}

    def measure(i, x):
        site = sites.mlp[i]
        w = site.read()
        xin = mlp_inputs(site, x)
        sub = xin[torch.randperm(len(xin), generator=torch.Generator().manual_seed(i))[:ROWS]]
        C = second_moment(xin)
        fu = whitened_factors(w.up, C)
        fg = whitened_factors(w.gate, C) if w.gate is not None else None
        grid = sorted({*range(hs[i], lo[i] - 1, -GRID), lo[i], k0[i]})
        errs = {k: svd_at(w, sub, fg, fu, k)[1] if k < hs[i] else 0.0 for k in grid}
        curve = []
        for k in range(hs[i], lo[i] - 1, -1):  # curve[h - k], linear between grid points
            above = min(g for g in grid if g >= k)
            below = max(g for g in grid if g <= k)
            t = 0.0 if above == below else (above - k) / (above - below)
            curve.append((1 - t) * errs[above] + t * errs[below])
        curves[i] = curve
        narrowed[i] = DenseMLP.from_weights(svd_at(w, xin, fg, fu, k0[i])[0])
        print(f"layer {i}: error at k0 {errs[k0[i]]:.3f}, at {lo[i]} {errs[lo[i]]:.3f}", file=sys.stderr, flush=True)

    budget.sequential(model, calib, layers, measure, progress=progress, desc="per-layer budget (svd): error curves")
    rise = budget.loss_rises(model, calib[:probe_blocks], narrowed, progress)

    def err(i, k):
        return curves[i][hs[i] - k]

    width = budget.allocate(hs, k0, lo, rise, err, step)
    print("widths", {i: width[i] for i in layers}, file=sys.stderr, flush=True)
    print("rise", {i: round(rise[i], 4) for i in layers}, file=sys.stderr, flush=True)
    return [budget.LayerPlan(i, hs[i], width[i], k0[i], rise[i], err(i, k0[i]), err(i, width[i])) for i in layers]


budget.plan_widths = plan_widths
sys.exit(main(sys.argv[1:]))
