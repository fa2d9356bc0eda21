"""On-policy local tuning: after a layer is compressed (and refit) on its calibration rows, a few epochs of Adam on the
compressed MLP's own parameters toward what the original sub-block adds to the same rows -- the rows that the
already-compressed (and tuned) layers before it produce, so the next layer is calibrated on what this one now
computes. Block-wise reconstruction as BRECQ and OmniQuant do it for quantisation, here for structured MLP
compression: where the closed-form refit can only move the down projection, this also moves the gate / up
projections (or a merged neuron's averaged weights, or a factorisation's factors).

These are gradient steps: a compressor with `local_epochs > 0` is no longer one-shot, and reports the steps and the
seconds they took. A tuning that ends with a larger error on the rows than it started with is undone (the layer keeps
its closed-form weights), so the option can cost time but never quality on the calibration rows."""

from __future__ import annotations

import math
import time
from typing import Callable, Sequence

import torch
from torch import Tensor

from ...errors import MLPSurgeryError

LOCAL_LR = 3e-3  # Adam, cosine to zero; measured on SmolLM2 (docs/calibration.md)
LOCAL_BATCH = 1024  # token rows per step
CHUNK = 4096
SETTING_POWER = 1  # several settings: each one's loss divided by its error before to this power. 2 would make every
# setting's relative improvement count alike; 1 lets a setting weigh in proportion to its error, so the low ranks of a
# nested MLP (the largest errors) pull harder: SmolLM2, 20 layers, 8 epochs, 75/50/33% of the FLOPs 55.74/80.34/134.11
# with 2, 55.77/79.59/130.68 with 1 (docs/frontier.md, benchmarks/notes/prototype_nsn_rank_weights.py)


def subblock_rows(site, x: Tensor) -> Tensor:
    """What the sub-block at `site` adds to the residual rows x (n, d), float32, chunk by chunk, without grad."""
    with torch.no_grad():
        return torch.cat([site.subblock(x[s:s + CHUNK]).float() for s in range(0, len(x), CHUNK)])


def stream_target_refusal(site) -> str | None:
    """Why the MLP at `site` cannot be fitted to a residual-stream target (`stream_target`), or None where it can."""
    if site.inner_post_norm is not None:
        return "this architecture normalises the MLP's output inside the sub-block"
    if site.parallel:
        return ("this model runs attention and MLP side by side on the layer's input (Phi-2; GPT-NeoX's "
                "use_parallel_residual), so the stream after the MLP also holds the attention's output on other rows")
    return None


def stream_target(site, x: Tensor, x_ref: Tensor, y_ref: Tensor) -> Tensor:
    """The output the sub-block at `site` must give on the rows x to take them where the original stream goes: x_ref
    (the original's rows at the same place) plus y_ref (what the original sub-block gives on them), both reaching the
    stream through the layer's residual scale s: x + s t = x_ref + s y_ref. Only where `stream_target_refusal` is
    None."""
    return y_ref + (x_ref - x) / site.residual_scale


def _error(site, x: Tensor, ref: Tensor, idx: Tensor) -> float:
    out = subblock_rows(site, x[idx])
    return float((out - ref[idx]).norm() / ref[idx].norm().clamp_min(1e-30))


def tune_local_(site, x: Tensor, ref: Tensor, epochs: float, lr: float = LOCAL_LR, batch: int = LOCAL_BATCH,
                seed: int = 0, settings: Sequence[Callable[[], None]] | None = None) -> dict:
    """Train the parameters of the (compressed) MLP at `site` in place so that its sub-block's output on the residual
    rows x (n, d) matches ref (n, d), the original sub-block's output on the same rows: relative squared error,
    Adam, `epochs` passes of random batches of `batch` rows, the learning rate on a cosine to zero. Parameters in a
    low-precision dtype are tuned in float32 and rounded back once. Returns the steps, the seconds and the relative
    error on every 8th row before and after (the closed-form weights are restored if it rose).

    settings: several configurations of the same weights trained at once (a nested MLP at several ranks: each a
    function that switches the MLP to it). Each step draws one uniformly and divides its loss (the squared relative
    error) by its error before tuning to the power SETTING_POWER (1: a setting weighs in proportion to its error, so
    the worst ones pull harder; NSN's uncertainty weighting with the variances fixed at the start); the tuning is kept
    when the mean of those weighted errors fell. The errors are
    then lists, one per setting, and the MLP is left in the last setting drawn: the caller chooses the one to keep."""
    if epochs < 0 or not math.isfinite(epochs):
        raise MLPSurgeryError(f"local tuning epochs must be a finite number >= 0, not {epochs}")
    if lr <= 0 or batch < 1:
        raise MLPSurgeryError(f"local tuning needs a learning rate > 0 and a batch >= 1, not {lr} and {batch}")
    if x.shape != ref.shape:
        raise MLPSurgeryError(f"local tuning: rows {tuple(x.shape)} and targets {tuple(ref.shape)} differ in shape")
    n = len(x)
    steps = math.ceil(epochs * n / batch) if n else 0
    params = [p for p in site.parameters() if p.is_floating_point()]
    if steps == 0 or not params:
        return {"steps": 0, "seconds": 0.0}
    t0 = time.perf_counter()
    # float32 for the tuning: every tensor of the MLP's modules and of the norms its sub-block runs through
    mods = list(site.modules()) + [m for m in (site.pre_norm, site.inner_post_norm) if m is not None]
    tensors, seen = [], set()
    for m in mods:
        for t in list(m.parameters()) + list(m.buffers()):
            if id(t) not in seen and t.is_floating_point():
                seen.add(id(t))
                tensors.append((t, t.dtype))
    for t, _ in tensors:
        t.data = t.data.float()
    saved = [p.detach().clone() for p in params]
    trained = {id(p) for p in params}
    frozen = [t for t, _ in tensors if isinstance(t, torch.nn.Parameter) and id(t) not in trained]  # the norms
    grads = [p.requires_grad for p in params + frozen]
    device = params[0].device
    x, ref = x.to(device, torch.float32), ref.to(device, torch.float32)
    probe = torch.arange(0, n, 8, device=device)
    configs = list(settings) if settings else [lambda: None]

    def errors() -> list[float]:
        out = []
        for choose in configs:
            choose()
            out.append(_error(site, x, ref, probe))
        return out

    try:
        before = errors()
        # one setting: the plain relative error; several: each weighed by its start (an exact one, error 0, is held
        # near exact rather than divided by 0)
        scale = [max(e, 1e-6) ** SETTING_POWER for e in before] if settings else [1.0]
        for p in params:
            p.requires_grad_(True)
        for p in frozen:
            p.requires_grad_(False)
        opt = torch.optim.Adam(params, lr=lr)
        gen = torch.Generator().manual_seed(seed)
        with torch.enable_grad():
            for step in range(steps):
                for group in opt.param_groups:
                    group["lr"] = lr * 0.5 * (1 + math.cos(math.pi * step / steps))
                idx = torch.randint(0, n, (min(batch, n),), generator=gen).to(device)
                k = int(torch.randint(0, len(configs), (1,), generator=gen)) if len(configs) > 1 else 0
                configs[k]()
                out = site.subblock(x[idx]).float()
                loss = (out - ref[idx]).pow(2).sum() / ref[idx].pow(2).sum().clamp_min(1e-30) / scale[k]
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
        after = errors()
        objective = sum(a * a / c for a, c in zip(after, scale)) / len(configs)
        kept = math.isfinite(objective) and objective <= sum(b * b / c for b, c in zip(before, scale)) / len(configs)
        if not kept:
            with torch.no_grad():
                for p, s in zip(params, saved):
                    p.copy_(s)
    finally:
        for p, g in zip(params + frozen, grads):
            p.requires_grad_(g)
            p.grad = None
        for t, dtype in tensors:
            t.data = t.data.to(dtype)
    if not settings:
        before, after = before[0], after[0]
    return {"steps": steps, "epochs": epochs, "lr": lr, "batch": batch, "seconds": time.perf_counter() - t0,
            "error_before": before, "error_after": after if kept else before, "kept": kept}
