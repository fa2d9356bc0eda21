"""Cheap end-to-end recovery: a compressed model distilled toward the original's next-token distribution (KL on the
full vocabulary, temperature 1), training only the chosen layers' MLP parameters (what the compression changed) on
calibration blocks. Unlike layer-wise tuning, every step sees the compressed model's own activations (on-policy) and
aims at what matters in the end, the output distribution; it costs a teacher forward and a student forward and
backward per step.

For a model without an LM head the final hidden states are matched instead (mean squared error, relative to the
teacher's). AdamW with mlpsurgery.train.fit: warm-up, cosine schedule, clip, checkpoint and resume; with a time budget
the cosine runs on the clock (it ends at its floor when the time does, not part-way down when the steps were too many).

The teacher is frozen, so what it computes for a block never changes: the hidden states it hands its LM head are
kept per block the first time the block is drawn (the model's dtype; at most CACHE_BYTES) and later draws only run the
head on them, about half of a step's cost saved once the blocks repeat. The cache is used only after the head alone
reproduced the teacher's logits on the first batch (a model that changes its logits after the head -- soft-capping,
a scale -- is never cached)."""

from __future__ import annotations

import time

import torch
from torch import Tensor, nn

from ...errors import MLPSurgeryError
from ...sites import find_sites
from ...train import FitConfig, fit, step_rng

CACHE_BYTES = 4 << 30  # the teacher's final hidden states kept for reuse, at most


def distill(student: nn.Module, teacher: nn.Module, blocks: Tensor, layers: list[int], steps: int, lr: float = 3e-4,
            batch_size: int = 4, seconds: float | None = None, seed: int = 0, progress: bool = True,
            checkpoint_dir=None) -> dict:
    """Train the MLP parameters of `layers` of `student` (in place) to match `teacher` on rows of `blocks` (N, T).
    seconds: stop once this much training time has passed (the steps done are reported). Returns the history, the
    steps done, the seconds spent and the mean loss of the first and last tenth of the steps."""
    from ...measure.perplexity import is_causal_lm

    if steps < 1:
        raise MLPSurgeryError(f"recovery needs at least one step, not {steps}")
    if blocks.dim() != 2 or len(blocks) == 0:
        raise MLPSurgeryError("recovery needs calibration blocks: a non-empty (N, T) tensor of token ids")
    sites = find_sites(student)
    params: dict[str, nn.Parameter] = {}
    for i in layers:
        for n, p in enumerate(sites.mlp[i].parameters()):
            if p.is_floating_point():
                params[f"{i}.{n}"] = p
    if not params:
        raise MLPSurgeryError("the chosen layers' MLPs have no parameters to train")
    lm = is_causal_lm(student)
    device = next(student.parameters()).device
    frozen = [p for p in student.parameters() if p.requires_grad and all(p is not q for q in params.values())]
    for p in frozen:
        p.requires_grad_(False)
    for p in params.values():
        p.requires_grad_(True)
    was = student.training, teacher.training
    student.train(False)  # (dropout off: the recovery fits the function, not a regulariser)
    teacher.eval()
    t0 = time.perf_counter()
    cache = _TeacherCache(teacher, blocks, device) if lm else None

    def loss_fn(step: int):
        idx = torch.randint(0, len(blocks), (batch_size,), generator=step_rng(seed, step))
        x = blocks[idx].to(device)
        with torch.no_grad():
            ref = cache.logits(idx) if cache is not None else _outputs(teacher, x, lm)
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
                  checkpoint_dir=checkpoint_dir, settings={"kind": "distill", "layers": layers,
                                                          "blocks": list(blocks.shape), "batch": batch_size})
    finally:
        for p in frozen:
            p.requires_grad_(True)
        student.train(was[0])
        teacher.train(was[1])
    losses = [h["loss"] for h in res.history]
    tenth = max(1, len(losses) // 10)
    return {"kind": "distill", "steps": len(losses), "steps_asked": steps, "lr": lr, "batch": batch_size,
            "seconds": time.perf_counter() - t0, "loss_first": sum(losses[:tenth]) / tenth if losses else None,
            "loss_last": sum(losses[-tenth:]) / tenth if losses else None, "stopped": res.stopped_early,
            "tokens": len(losses) * batch_size * blocks.shape[1],
            "teacher_cache": None if cache is None else cache.report()}


class _TeacherCache:
    """The teacher's logits for blocks by index: its final hidden states (what its LM head reads) computed once per
    block and kept, the head run on them each time (module docstring)."""

    def __init__(self, teacher: nn.Module, blocks: Tensor, device):
        self.teacher, self.blocks, self.device = teacher, blocks, device
        self.head = teacher.get_output_embeddings()
        self.kept: dict[int, Tensor] = {}
        self.on: bool | None = None if self.head is not None else False  # None: not yet checked
        self.hits = self.misses = 0
        self.limit = CACHE_BYTES

    def _run(self, x: Tensor) -> tuple[Tensor, Tensor]:
        seen = []
        handle = self.head.register_forward_pre_hook(lambda mod, args: seen.append(args[0].detach()))
        try:
            logits = self.teacher(input_ids=x).logits
        finally:
            handle.remove()
        return logits, seen[-1]

    def logits(self, idx: Tensor) -> Tensor:
        if self.on is False:
            return _outputs(self.teacher, self.blocks[idx].to(self.device), True)
        ids = idx.tolist()
        missing = sorted({i for i in ids if i not in self.kept})
        self.misses += len(missing)
        self.hits += len(ids) - len(missing)
        if missing:
            rows = torch.tensor(missing)
            logits, hidden = self._run(self.blocks[rows].to(self.device))
            if self.on is None:  # the head alone must give the teacher's logits, or nothing is cached
                again = self.head(hidden)
                self.on = again.shape == logits.shape and bool(torch.allclose(again.float(), logits.float(),
                                                                              rtol=1e-4, atol=1e-4))
                if not self.on:
                    return _outputs(self.teacher, self.blocks[idx].to(self.device), True)
            for i, h in zip(missing, hidden):
                if (len(self.kept) + 1) * h.numel() * h.element_size() <= self.limit:
                    self.kept[i] = h
            if missing == ids:  # every block new (and in order): the forward's own logits
                return logits
        rows = [self.kept.get(i) for i in ids]
        if any(r is None for r in rows):  # past the cache's size: those blocks run whole
            return _outputs(self.teacher, self.blocks[idx].to(self.device), True)
        return self.head(torch.stack(rows))

    def report(self) -> dict:
        return {"used": bool(self.on), "blocks_kept": len(self.kept), "hits": self.hits, "misses": self.misses}


def _outputs(model: nn.Module, x: Tensor, lm: bool) -> Tensor:
    if lm:
        return model(input_ids=x).logits
    base = getattr(model, "base_model", model)
    return base(input_ids=x).last_hidden_state
