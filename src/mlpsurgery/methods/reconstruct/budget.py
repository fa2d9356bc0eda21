"""Per-layer budgets: for a total MLP width, each layer's width chosen by its measured sensitivity (as SVD-LLM V2 and
FLAP allocate by measured loss, and as Gemma 3n keeps a fragile layer whole).

Two measurements per chosen layer, on the original model and the calibration blocks:

- its error curve e_i(k): the relative output error of the MLP narrowed to every width k (from h down to a floor),
  from one greedy structured-OBS path (obs.py; the down projection refit at each width, as the compressors do);
- its effect on the output: layer i alone narrowed to the uniform width k0 (the others original), how far the model's
  output moves on a few calibration blocks (an LM's mean KL divergence from the original's next-token distribution;
  for a model without an LM head the relative change of its final hidden states) -- dL_i.

The cost of width k at layer i is modelled as dL_i · e_i(k) / e_i(k0): the loss effect measured at k0, scaled along the
layer's own curve. The widths minimise the sum of costs at the total width sum(k0): starting from every layer whole,
`step` neurons at a time go where they cost least, never below `floor` · h. A layer whose neurons all cost more than the
others' stays whole."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from ...errors import MLPSurgeryError
from ...modules.dense import DenseMLP
from ...sites import find_sites
from .layer import mlp_inputs, obs_path
from .sequential import sequential

STEP = 32  # neurons moved at a time
FLOOR = 0.25  # no layer narrower than this fraction of its width
PROBE_BLOCKS = 16  # calibration blocks the loss is measured on


@dataclass
class LayerPlan:
    layer: int
    h: int
    width: int  # the allocated width
    uniform: int  # k0, the width a uniform budget gives
    loss_rise: float  # dL at k0, this layer alone (KL from the original, or relative output change)
    error_uniform: float  # e(k0)
    error: float  # e(width)


class _Probe:
    """How far the model's output moves from the original's on a few calibration blocks: for an LM the mean KL
    divergence of its next-token distribution from the original's (never negative, and far less noisy than the
    difference of two losses), else the relative squared change of the final hidden states. The original's outputs
    are kept (log-probabilities in bfloat16, at most PROBE_BYTES)."""

    PROBE_BYTES = 256 * 2**20

    def __init__(self, model: nn.Module, blocks: Tensor):
        from ...measure.perplexity import is_causal_lm

        self.model, self.lm = model, is_causal_lm(model)
        self.device = next(model.parameters()).device
        if self.lm:
            vocab = model.get_output_embeddings().weight.shape[0]
            rows = max(1, min(len(blocks), self.PROBE_BYTES // (2 * vocab * blocks.shape[1])))
            blocks = blocks[:rows]
        self.blocks = blocks
        self.reference = [self._out(blocks[b:b + 4]) for b in range(0, len(blocks), 4)]

    def _out(self, x: Tensor) -> Tensor:
        with torch.no_grad():
            if self.lm:
                return torch.log_softmax(self.model(input_ids=x.to(self.device)).logits.float(), -1).to(torch.bfloat16)
            base = getattr(self.model, "base_model", self.model)
            return base(input_ids=x.to(self.device)).last_hidden_state.float()

    def distance(self) -> float:
        total, norm = 0.0, 0.0
        for n, b in enumerate(range(0, len(self.blocks), 4)):
            out, ref = self._out(self.blocks[b:b + 4]), self.reference[n]
            if self.lm:
                p = ref.float()
                total += float((p.exp() * (p - out.float())).sum())
                norm += out.shape[0] * out.shape[1]
            else:
                total += float((out - ref).pow(2).sum())
                norm += float(ref.pow(2).sum())
        return total / max(norm, 1e-30)


def plan_widths(model: nn.Module, calib: Tensor, uniform: dict[int, int], step: int = STEP, floor: float = FLOOR,
                probe_blocks: int = PROBE_BLOCKS, progress: bool = True) -> list[LayerPlan]:
    """Per-layer widths for the chosen layers, keeping their total width sum(uniform.values()) (uniform: layer -> the
    width a uniform budget gives it; see the module docstring). The model is left as it was."""
    sites = find_sites(model)
    layers = sorted(uniform)
    hs = {i: sites.mlp[i].h for i in layers}
    k0 = dict(uniform)
    bad = [i for i in layers if not 1 <= k0[i] <= hs[i]]
    if bad:
        raise MLPSurgeryError(f"layer {bad[0]}: width {k0[bad[0]]} is not between 1 and its MLP width {hs[bad[0]]}")
    lo = {i: min(k0[i], max(1, math.ceil(floor * hs[i]))) for i in layers}
    curves: dict[int, list[float]] = {}
    narrowed: dict[int, DenseMLP] = {}

    def measure(i: int, x: Tensor) -> None:  # on the original model's activations (nothing is changed)
        site = sites.mlp[i]
        w = site.read()
        snaps = {k0[i]: None}
        path = obs_path(w, mlp_inputs(site, x), lo[i], snapshots=snaps)
        curves[i] = path.error
        at = snaps[k0[i]] if k0[i] < hs[i] and k0[i] > lo[i] else path
        keep_idx = at.kept(hs[i])
        sub = w.select(keep_idx)
        sub.down = at.down[:, keep_idx].to(w.down)
        if at.bias is not None:
            sub.down_bias = at.bias.to(w.down)
        narrowed[i] = DenseMLP.from_weights(sub)

    if all(k0[i] == hs[i] for i in layers):
        return [LayerPlan(i, hs[i], hs[i], hs[i], 0.0, 0.0, 0.0) for i in layers]
    sequential(model, calib, layers, measure, progress=progress, desc="per-layer budget: error curves")
    rise = loss_rises(model, calib[:probe_blocks], narrowed, progress)

    def err(i: int, k: int) -> float:
        return curves[i][hs[i] - k]

    width = allocate(hs, k0, lo, rise, err, step)
    return [LayerPlan(i, hs[i], width[i], k0[i], rise[i], err(i, k0[i]), err(i, width[i])) for i in layers]


def loss_rises(model: nn.Module, blocks: Tensor, narrowed: dict[int, nn.Module], progress: bool = True
               ) -> dict[int, float]:
    """{layer: how far the model's output moves (`_Probe`) on `blocks` with that layer's MLP alone replaced by
    narrowed[layer]}; the model is left as it was."""
    sites = find_sites(model)
    was_training = model.training
    model.eval()
    rise = {}
    try:
        probe = _Probe(model, blocks)
        for i in tqdm(sorted(narrowed), desc="per-layer budget: each layer narrowed alone", unit="layer",
                      disable=not progress):
            site = sites.mlp[i]
            kept = site.modules()
            site.replace_mlp(narrowed[i])
            try:
                rise[i] = probe.distance()
            finally:
                site.set_modules(kept)
    finally:
        model.train(was_training)
    return rise


def allocate(hs: dict[int, int], k0: dict[int, int], lo: dict[int, int], rise: dict[int, float], err,
             step: int = STEP) -> dict[int, int]:
    """The widths (layer -> k) of total sum(k0) that the module docstring's rule gives: from every layer whole (hs),
    `step` neurons at a time go where the cost rise[i] * (err(i, k) - err(i, k + n)) / err(i, k0[i]) per neuron is
    least, never below lo[i]. err(i, k): layer i's error curve at width k."""
    layers = sorted(hs)
    cost = {i: max(rise[i], 1e-9) / max(err(i, k0[i]), 1e-12) for i in layers}
    width = dict(hs)
    target = sum(k0.values())
    while sum(width.values()) > target:
        best, best_rate, best_n = None, math.inf, 0
        for i in layers:
            n = min(step, width[i] - lo[i], sum(width.values()) - target)
            if n <= 0:
                continue
            rate = cost[i] * (err(i, width[i] - n) - err(i, width[i])) / n
            if rate < best_rate:
                best, best_rate, best_n = i, rate, n
        if best is None:
            raise MLPSurgeryError(f"internal: no layer can be narrowed further toward {target} neurons")
        width[best] -= best_n
    return width
