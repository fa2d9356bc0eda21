"""Cheap end-to-end recovery: a compressed model distilled toward the original's next-token distribution (KL on the
full vocabulary, temperature 1), training the chosen layers' MLP parameters (what the compression changed;
`train='mlp'`) or every parameter of the chosen decoder layers (`train='layers'`: attention and norms too, so the
layers around a narrowed MLP adapt to it; docs/frontier.md#recovery) on calibration blocks. Unlike layer-wise
tuning, every step sees the compressed model's own activations (on-policy) and aims at what matters in the end, the
output distribution; it costs a teacher forward and a student forward and backward per step.

For a model without an LM head the final hidden states are matched instead (mean squared error, relative to the
teacher's). AdamW with mlpsurgery.train.fit: warm-up, cosine schedule, clip, checkpoint and resume; with a time budget
the cosine runs on the clock (it ends at its floor when the time does, not part-way down when the steps were too many)."""

from __future__ import annotations

import time

import torch
from torch import Tensor, nn

from ...errors import MLPSurgeryError
from ...sites import find_sites
from ...train import FitConfig, fit, step_rng

TRAIN = ("mlp", "layers")  # what the recovery trains: the chosen MLPs, or the chosen decoder layers whole


def distill(student: nn.Module, teacher: nn.Module, blocks: Tensor, layers: list[int], steps: int, lr: float = 3e-4,
            batch_size: int = 4, seconds: float | None = None, seed: int = 0, progress: bool = True,
            checkpoint_dir=None, train: str = "mlp") -> dict:
    """Train the MLP parameters of `layers` of `student` (in place; train='layers': every parameter of those decoder
    layers) to match `teacher` on rows of `blocks` (N, T). seconds: stop once this much training time has passed (the
    steps done are reported). Returns the history, the steps done, the seconds spent and the mean loss of the first
    and last tenth of the steps."""
    from ...measure.perplexity import is_causal_lm

    if steps < 1:
        raise MLPSurgeryError(f"recovery needs at least one step, not {steps}")
    if blocks.dim() != 2 or len(blocks) == 0:
        raise MLPSurgeryError("recovery needs calibration blocks: a non-empty (N, T) tensor of token ids")
    if train not in TRAIN:
        raise MLPSurgeryError(f"recovery trains {' or '.join(TRAIN)}, not {train!r}")
    sites = find_sites(student)
    params: dict[str, nn.Parameter] = {}
    seen: set[int] = set()
    owners = sites.mlp if train == "mlp" else sites.layers()
    for i in layers:
        for n, p in enumerate(owners[i].parameters()):
            if p.is_floating_point() and id(p) not in seen:
                seen.add(id(p))
                params[f"{i}.{n}"] = p
    if not params:
        raise MLPSurgeryError(f"the chosen layers' {'MLPs' if train == 'mlp' else 'decoder layers'} have no parameters "
                              "to train")
    lm = is_causal_lm(student)
    device = next(student.parameters()).device
    frozen = [p for p in student.parameters() if p.requires_grad and id(p) not in seen]
    for p in frozen:
        p.requires_grad_(False)
    for p in params.values():
        p.requires_grad_(True)
    was = student.training, teacher.training
    student.train(False)  # (dropout off: the recovery fits the function, not a regulariser)
    teacher.eval()
    t0 = time.perf_counter()

    def loss_fn(step: int):
        idx = torch.randint(0, len(blocks), (batch_size,), generator=step_rng(seed, step))
        x = blocks[idx].to(device)
        with torch.no_grad():
            ref = _outputs(teacher, x, lm)
        out = _outputs(student, x, lm)
        if lm:
            logp_t = torch.log_softmax(ref.float(), -1)
            logp_s = torch.log_softmax(out.float(), -1)
            return (logp_t.exp() * (logp_t - logp_s)).sum(-1).mean()
        return (out.float() - ref.float()).pow(2).sum() / ref.float().pow(2).sum().clamp_min(1e-30)

    try:
        res = fit(params, loss_fn, FitConfig(steps=steps, lr=lr, seed=seed, log_every=1, seconds=seconds),
                  progress=progress,
                  desc="recovery (KL to the original)" if lm else "recovery (final states)",
                  checkpoint_dir=checkpoint_dir, settings={"kind": "distill", "layers": layers, "train": train,
                                                          "blocks": list(blocks.shape), "batch": batch_size})
    finally:
        for p in frozen:
            p.requires_grad_(True)
        student.train(was[0])
        teacher.train(was[1])
    losses = [h["loss"] for h in res.history]
    tenth = max(1, len(losses) // 10)
    return {"kind": "distill", "train": train, "steps": len(losses), "steps_asked": steps, "lr": lr,
            "batch": batch_size,
            "seconds": time.perf_counter() - t0, "loss_first": sum(losses[:tenth]) / tenth if losses else None,
            "loss_last": sum(losses[-tenth:]) / tenth if losses else None, "stopped": res.stopped_early,
            "tokens": len(losses) * batch_size * blocks.shape[1]}


def _outputs(model: nn.Module, x: Tensor, lm: bool) -> Tensor:
    if lm:
        return model(input_ids=x).logits
    base = getattr(model, "base_model", model)
    return base(input_ids=x).last_hidden_state
