"""Measured inference speed of a causal LM against a reference, paired in one run.

Prefill: one forward of `batch` x `prompt_len` tokens (no grad), tokens per second. Decode: `new_tokens` steps of one
token each with the KV cache, after that prefill, tokens per second of the steps alone (the loop a serving engine
runs; greedy, the tokens fed are the model's own argmax so both models do the same amount of work). The reference and
the candidate alternate, `repeats` times each after a warm-up, so that drifts of the machine (frequency, other
processes) hit both; the medians and their ratios are reported. The thread count is set for the measurement and
restored after it (benchmarks on a shared CPU are otherwise not comparable).
"""

from __future__ import annotations

import statistics
import time

import torch
from torch import nn


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def _one(model: nn.Module, ids: torch.Tensor, new_tokens: int) -> tuple[float, float]:
    device = _device(model)
    ids = ids.to(device)
    _sync(device)
    t0 = time.perf_counter()
    out = model(input_ids=ids, use_cache=True)
    _sync(device)
    prefill = time.perf_counter() - t0
    past = out.past_key_values
    nxt = out.logits[:, -1:].argmax(-1)
    t0 = time.perf_counter()
    for _ in range(new_tokens):
        out = model(input_ids=nxt, past_key_values=past, use_cache=True)
        past = out.past_key_values
        nxt = out.logits[:, -1:].argmax(-1)
    _sync(device)
    decode = time.perf_counter() - t0
    return prefill, decode


def paired_speed(reference: nn.Module, candidate: nn.Module, prompt_len: int = 256, new_tokens: int = 32,
                 batch: int = 1, repeats: int = 5, threads: int | None = None, seed: int = 0,
                 vocab: int | None = None) -> dict:
    """{reference: {prefill_tok_s, decode_tok_s}, candidate: {...}, ratio: {prefill, decode}} (ratio > 1: the
    candidate is faster)."""
    if prompt_len < 1 or new_tokens < 1 or repeats < 1 or batch < 1:
        raise ValueError("prompt_len, new_tokens, repeats and batch must be at least 1")
    vocab = vocab or reference.get_input_embeddings().num_embeddings
    ids = torch.randint(0, vocab, (batch, prompt_len), generator=torch.Generator().manual_seed(seed))
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    was = reference.training, candidate.training
    reference.eval(), candidate.eval()
    times: dict[str, list[tuple[float, float]]] = {"reference": [], "candidate": []}
    try:
        for m in (reference, candidate):  # warm-up: allocator, lazy init, caches
            _one(m, ids, min(new_tokens, 4))
        for r in range(repeats):
            order = (("reference", reference), ("candidate", candidate))
            for name, m in (order if r % 2 == 0 else order[::-1]):
                times[name].append(_one(m, ids, new_tokens))
    finally:
        torch.set_num_threads(before)
        reference.train(was[0]), candidate.train(was[1])
    out: dict = {"prompt_len": prompt_len, "new_tokens": new_tokens, "batch": batch, "repeats": repeats,
                 "threads": threads or before, "device": str(_device(reference))}
    for name, ts in times.items():
        pre = statistics.median(t[0] for t in ts)
        dec = statistics.median(t[1] for t in ts)
        out[name] = {"prefill_s": pre, "decode_s": dec, "prefill_tok_s": batch * prompt_len / pre,
                     "decode_tok_s": batch * new_tokens / dec}
    out["ratio"] = {"prefill": out["reference"]["prefill_s"] / out["candidate"]["prefill_s"],
                    "decode": out["reference"]["decode_s"] / out["candidate"]["decode_s"]}
    return out
