"""Parameter and FLOP counts per site, and a cost probe: wall time and peak memory of a forward pass
and of one training step (forward + backward + AdamW step), on CPU and CUDA alike.

Peak memory is the peak of live tensor bytes (parameters, gradients, optimizer state, activations,
temporaries) during the measured region: on CUDA `torch.cuda.max_memory_allocated`, on CPU a
dispatch-level tracker that sees every tensor storage the region allocates (measure/memory.py). Times are medians over repeats after a warm-up; CUDA is synchronised.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch
from torch import Tensor, nn

from ..errors import MLPSurgeryError
from ..sites import find_sites

# --------------------------------------------------------------------------------------------------
# Counting


def module_flops(module: nn.Module) -> int:
    """Forward FLOPs per token of a module: 2 per weight for every >=2-D parameter (each used once per
    token), unless the module or one of its children says otherwise with `flops_per_token()`."""
    fn = getattr(module, "flops_per_token", None)
    if callable(fn):
        return int(fn())
    own = sum(2 * p.numel() for p in module.parameters(recurse=False) if p.dim() >= 2)
    return own + sum(module_flops(c) for c in module.children())


def count_params(model: nn.Module) -> dict:
    """Parameters by category (embeddings, attention, mlp, head, other = norms and the rest) and per layer."""
    sites = find_sites(model)
    all_ids = {id(p): p for p in model.parameters()}
    cats: dict[str, set[int]] = {"embeddings": set(), "attention": set(), "mlp": set(), "head": set()}
    for m in sites.embeddings():
        cats["embeddings"].update(id(p) for p in m.parameters())
    per_layer = []
    for ms, at in zip(sites.mlp, sites.attn):
        mlp_ids = {id(p) for p in ms.parameters()}
        attn_ids = {id(p) for p in at.module.parameters()}
        cats["mlp"] |= mlp_ids
        cats["attention"] |= attn_ids
        per_layer.append({"layer": ms.index, "mlp": sum(all_ids[i].numel() for i in mlp_ids),
                          "attention": sum(all_ids[i].numel() for i in attn_ids)})
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None:
        cats["head"] = {id(p) for p in head.parameters()} - cats["embeddings"]
    counted = set().union(*cats.values())
    out = {k: sum(all_ids[i].numel() for i in v) for k, v in cats.items()}
    out["other"] = sum(p.numel() for i, p in all_ids.items() if i not in counted)
    out["total"] = sum(p.numel() for p in all_ids.values())
    out["per_layer"] = per_layer
    return out


def flops_per_token(model: nn.Module, context: int = 512) -> dict:
    """Forward FLOPs per token (a multiply-add counts 2) by category, at a sequence length `context`.

    attention = q/k/v/o projections + scores (QK^T and AV: 4 * n_heads * head_dim * c per layer, c the mean
    number of keys a query sees: (context + 1) / 2 causal, context bidirectional). Embedding lookups are free;
    the LM head costs 2 * d * vocab (tied or not).
    """
    sites = find_sites(model)
    mlp = sum(module_flops(m) for s in sites.mlp for m in s.modules())
    proj = sum(module_flops(a.module) for a in sites.attn)
    keys = (context + 1) / 2 if sites.spec.decoder else context
    scores = sum(int(4 * a.n_heads * a.head_dim * keys) for a in sites.attn)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head_flops = 2 * head.weight.numel() if head is not None else 0
    out = {"mlp": mlp, "attention_proj": proj, "attention_scores": scores, "head": head_flops}
    out["total"] = sum(out.values())
    out["context"] = context
    return out


def inspect(model: nn.Module, context: int = 512) -> dict:
    """Architecture, sites, MLP inner widths, and the parameter and FLOP-per-token shares."""
    sites = find_sites(model)
    cfg = sites.config
    params = count_params(model)
    flops = flops_per_token(model, context)
    a0 = sites.attn[0]
    site_rows = []
    for s, pl in zip(sites.mlp, params["per_layer"]):
        row = {"layer": s.index, "mlp": "+".join(type(m).__name__ for m in s.modules()), "params": pl["mlp"]}
        if not s.replaced:
            row.update(h=s.h, gated=s.gated, activation=s.activation)
        site_rows.append(row)
    widths = sorted({r["h"] for r in site_rows if "h" in r})
    ptot, ftot = params["total"], flops["total"]
    return {
        "model_class": type(model).__name__,
        "architecture": sites.spec.name,
        "layers": len(sites),
        "d": cfg.hidden_size,
        "mlp_inner_width": widths[0] if len(widths) == 1 else widths,
        "gated_mlp": sites.mlp[0].gated if not sites.mlp[0].replaced else None,
        "activation": sites.mlp[0].activation,
        "heads": a0.n_heads, "kv_groups": a0.n_kv, "head_dim": a0.head_dim,
        "vocab": getattr(cfg, "vocab_size", None),
        "params": {k: v for k, v in params.items() if k != "per_layer"},
        "param_share": {k: params[k] / ptot for k in ("embeddings", "attention", "mlp", "head", "other")},
        "flops_per_token": flops,
        "flop_share": {k: flops[k] / ftot for k in ("mlp", "attention_proj", "attention_scores", "head")},
        "sites": site_rows,
    }


# --------------------------------------------------------------------------------------------------
# Cost probe


@dataclass
class Cost:
    device: str
    batch: list[int]
    forward_s: float  # inference forward (no grad), median
    forward_peak_bytes: int
    train_forward_s: float  # forward with autograd recording
    backward_s: float
    optimizer_s: float
    step_s: float  # forward + backward + optimizer step
    step_peak_bytes: int
    backward_forward_ratio: float
    trainable_params: int

    def as_dict(self) -> dict:
        return asdict(self)


def default_loss(model: nn.Module, batch: Tensor) -> Tensor:
    """LM loss for causal LMs; for other models the mean square of the final hidden state."""
    from .perplexity import is_causal_lm

    if is_causal_lm(model):
        return model(input_ids=batch, labels=batch).loss
    out = model(input_ids=batch)
    h = getattr(out, "last_hidden_state", None)
    if h is None:
        h = out.logits
    return h.float().pow(2).mean()


def checkpointing_enabled(model: nn.Module) -> bool:
    """Whether gradient (activation) checkpointing is on, across transformers versions."""
    if hasattr(type(model), "is_activation_checkpointing"):
        return bool(model.is_activation_checkpointing)
    return bool(getattr(model, "is_gradient_checkpointing", False))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak(device: torch.device, fn: Callable[[], None], track: tuple) -> int:
    """Peak live tensor bytes while fn runs (tensors existing before it included)."""
    if device.type == "cuda":
        _sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        _sync(device)
        return int(torch.cuda.max_memory_allocated(device))
    from .memory import PeakTracker

    with PeakTracker(*track) as tracker:
        fn()
    return tracker.peak


def batch_bytes(batch_size: int, seq_len: int, model: nn.Module | None = None) -> int:
    """A floor of the memory one timed batch (batch_size, seq_len) takes, known before it is made: its token ids
    (int64), and with `model` (its config: hidden size, layers, vocabulary) the final logits (float32, as the loss
    reads them) and the one hidden state per layer that a training step keeps for its backward. The parameters, the
    optimizer state and every other activation come on top, so a batch refused on this count could never run."""
    tokens = int(batch_size) * int(seq_len)
    need = tokens * 8
    if model is not None:
        cfg = getattr(model, "config", None)
        p = next(iter(model.parameters()), None)
        item = p.element_size() if p is not None else 4
        d = getattr(cfg, "hidden_size", 0) or 0
        layers = getattr(cfg, "num_hidden_layers", 0) or 0
        vocab = getattr(cfg, "vocab_size", 0) or 0
        need += tokens * (vocab * 4 + layers * d * item)
    return need


def measure_cost(model: nn.Module, batch: Tensor, repeats: int = 3, warmup: int = 1, lr: float = 1e-5,
                 loss_fn: Callable[[nn.Module, Tensor], Tensor] = default_loss, memory: bool = True,
                 gradient_checkpointing: bool = False, progress: bool = False, desc: str = "cost") -> Cost:
    """Time and peak memory of inference and of one full training step on `batch` (B, T).

    The model's weights are restored afterwards (the probe's optimizer steps leave no trace).
    repeats=0 (with warmup=0): the peak memories only, one pass each, no timed pass (the times are NaN).
    progress: a bar over the passes (a training step of a real model on the CPU takes seconds, and the
    tracked memory passes longer); it is updated between passes, never inside a timed one.
    """
    from tqdm.auto import tqdm

    device = next(model.parameters()).device
    batch = batch.to(device)
    if repeats < 0 or warmup < 0 or (repeats == 0 and (warmup or not memory)):
        raise MLPSurgeryError(f"cost: repeats {repeats} and warmup {warmup} measure nothing; give repeats >= 1, or "
                              "repeats=0 and warmup=0 with memory for the peaks alone")
    trainable = [p for p in model.parameters() if p.requires_grad]
    if not trainable:
        raise MLPSurgeryError("the model has no trainable parameters to measure a training step on")
    saved = {id(p): p.detach().clone() for p in trainable}
    was_training = model.training
    gc_was = checkpointing_enabled(model)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    opt = torch.optim.AdamW(trainable, lr=lr)

    def infer():
        with torch.no_grad():
            model(input_ids=batch)

    times: dict[str, list[float]] = {"fwd": [], "tfwd": [], "bwd": [], "opt": []}

    def step(record: bool):
        _sync(device)
        t0 = time.perf_counter()
        loss = loss_fn(model, batch)
        _sync(device)
        t1 = time.perf_counter()
        loss.backward()
        _sync(device)
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(device)
        t3 = time.perf_counter()
        if record:
            times["tfwd"].append(t1 - t0)
            times["bwd"].append(t2 - t1)
            times["opt"].append(t3 - t2)

    bar = tqdm(total=2 * (warmup + repeats) + (2 if memory else 0), desc=desc, unit="pass", disable=not progress)
    try:
        model.eval()
        bar.set_postfix_str("inference")
        for i in range(warmup + repeats):
            _sync(device)
            t0 = time.perf_counter()
            infer()
            _sync(device)
            if i >= warmup:
                times["fwd"].append(time.perf_counter() - t0)
            bar.update(1)
        if memory:
            bar.set_postfix_str("inference peak memory")
        fwd_peak = _peak(device, infer, (model, batch)) if memory else 0
        bar.update(1 if memory else 0)
        model.train()
        bar.set_postfix_str("training step")
        for i in range(warmup + repeats):
            step(record=i >= warmup)
            bar.update(1)
        if memory:
            bar.set_postfix_str("training step peak memory")
            if warmup + repeats == 0:  # a step in steady state holds the optimizer's state: make it without a pass
                for p in trainable:  # (zero gradients; the weights are restored below)
                    p.grad = torch.zeros_like(p)
                opt.step()
                opt.zero_grad(set_to_none=True)
        step_peak = _peak(device, lambda: step(False), (model, opt, batch)) if memory else 0
        bar.update(1 if memory else 0)
    finally:
        bar.close()
        with torch.no_grad():
            for p in trainable:
                p.copy_(saved[id(p)])
        for p in trainable:
            p.grad = None
        model.train(was_training)
        if gradient_checkpointing and not gc_was:
            model.gradient_checkpointing_disable()
    med = {k: statistics.median(v) if v else math.nan for k, v in times.items()}
    return Cost(device=str(device), batch=list(batch.shape), forward_s=med["fwd"], forward_peak_bytes=fwd_peak,
                train_forward_s=med["tfwd"], backward_s=med["bwd"], optimizer_s=med["opt"],
                step_s=med["tfwd"] + med["bwd"] + med["opt"], step_peak_bytes=step_peak,
                backward_forward_ratio=med["bwd"] / med["tfwd"],
                trainable_params=sum(p.numel() for p in trainable))


RATIO_KEYS = ("forward_s", "forward_peak_bytes", "train_forward_s", "backward_s", "step_s", "step_peak_bytes",
              "backward_forward_ratio")


def compare_cost(reference: nn.Module, candidate: nn.Module, batch: Tensor, **kw) -> dict:
    """Cost of both models on the same batch, measured back to back, and candidate / reference ratios."""
    kw.pop("desc", None)
    ref = measure_cost(reference, batch, desc="cost of the reference", **kw)
    cand = measure_cost(candidate, batch, desc="cost of the candidate", **kw)
    ratio = {k: (getattr(cand, k) / getattr(ref, k) if getattr(ref, k) else None) for k in RATIO_KEYS}
    return {"reference": ref.as_dict(), "candidate": cand.as_dict(), "ratio": ratio}


def max_batch(model: nn.Module, seq_len: int, budget_bytes: int, vocab: int | None = None,
              loss_fn: Callable = default_loss, probe=(1, 2), max_probe: int = 4096) -> dict:
    """Largest batch whose training-step peak fits `budget_bytes`. The peak is the larger of the backward's (weights,
    gradients, optimizer state and batch x activations: affine in the batch) and the optimizer step's (flat in it), so
    for small batches it does not grow at all: two probes there would put the answer anywhere. The probes double from
    `probe` until two successive pairs give the same slope, at least what one sequence must hold (`batch_bytes`: both on
    the affine part), and the line fixes the answer;
    where the budget is passed first, the answer is the largest probed batch that fitted (a bound, `exact` False)."""
    vocab = vocab or getattr(model.config, "vocab_size", 256)
    g = torch.Generator().manual_seed(0)

    def peak(b: int) -> int:
        x = torch.randint(0, vocab, (b, seq_len), generator=g)
        return measure_cost(model, x, repeats=0, warmup=0, loss_fn=loss_fn).step_peak_bytes

    b1, b2 = probe
    if not 1 <= b1 < b2:
        raise MLPSurgeryError(f"max batch: the probes must be two batch sizes 1 <= b1 < b2, not {probe}")
    sizes, peaks = [b1, b2], [peak(b1), peak(b2)]
    floor = batch_bytes(1, seq_len, model)  # what one more sequence holds at the least: below it, the flat part
    exact = False
    while True:
        per_sample = (peaks[-1] - peaks[-2]) / (sizes[-1] - sizes[-2])
        if len(sizes) >= 3 and per_sample >= floor:
            before = (peaks[-2] - peaks[-3]) / (sizes[-2] - sizes[-3])
            if abs(before - per_sample) <= 0.05 * per_sample:  # two pairs on one line: the affine part
                exact = True
                break
        if peaks[-1] > budget_bytes or 2 * sizes[-1] > max_probe:
            break
        sizes.append(2 * sizes[-1])
        peaks.append(peak(sizes[-1]))
    fixed = peaks[-1] - per_sample * sizes[-1]
    if exact:
        best = int((budget_bytes - fixed) // per_sample)
    else:
        best = max([b for b, p in zip(sizes, peaks) if p <= budget_bytes], default=0)
    return {"budget_bytes": budget_bytes, "seq_len": seq_len, "fixed_bytes": int(fixed),
            "per_sample_bytes": int(per_sample), "max_batch": max(best, 0), "exact": exact,
            "probes": dict(zip(sizes, peaks))}
