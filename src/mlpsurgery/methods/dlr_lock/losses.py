"""The distillation losses: relative MSE, per-token relative error (phase 1), top-k KL (phase 2)."""

from __future__ import annotations


import torch
from torch import Tensor



def relative_error(pred: Tensor, x: Tensor, y: Tensor) -> Tensor:
    """Per-layer relative MSE sum ||pred - y||^2 / sum ||y - x||^2 over tokens. Inputs (n, T, d) -> (n,)."""
    return (pred - y).pow(2).sum((1, 2)) / (y - x).pow(2).sum((1, 2)).clamp_min(1e-30)


def token_relative_error(pred: Tensor, x: Tensor, y: Tensor, floor: Tensor) -> Tensor:
    """Per-layer mean over tokens of 2 ||pred_t - y_t||^2 / (||y_t - x_t||^2 + floor): 1.0 = no better than
    the identity for a token whose update equals the floor. floor: (n,) per layer, the median update
    energy of the captured tokens.

    Why: in some layers a handful of tokens (the attention-sink first token, whose 'massive activation' a
    layer writes or erases) hold > 95% of sum ||y - x||^2, so the paper's relative MSE is decided by them
    alone and every other token's error is invisible to it. Here each token counts for its own relative
    error (the floor keeps near-zero updates from dominating)."""
    e = (pred - y).pow(2).sum(-1)
    n = (y - x).pow(2).sum(-1)
    return 2 * (e / (n + floor[:, None])).mean(-1)


def _rest_logsumexp(logp: Tensor, idx: Tensor) -> Tensor:
    """log of the probability mass outside the positions `idx` of the last axis, summed in log space."""
    return logp.scatter(-1, idx.long(), float("-inf")).logsumexp(-1)


def topk_kl(student_logits: Tensor, topk_idx: Tensor, topk_logp: Tensor, tail_logp: Tensor | None = None) -> Tensor:
    """Mean over positions of KL(teacher || student) on k+1 categories: the teacher's top-k tokens and
    the rest of the vocabulary pooled. Shapes (B, T, V), (B, T, k), (B, T, k), (B, T).

    Everything is in log space: the student's rest is a logsumexp over the rest of its vocabulary, the teacher's
    is `tail_logp` (stored with the targets; for older targets log(1 - sum p_k) through log1p/expm1), so a tail
    of 1e-7 is not lost to cancellation in 1 - sum p (float32 has 6e-8 of resolution near 1)."""
    logq = torch.log_softmax(student_logits.float(), dim=-1)
    q_k = logq.gather(-1, topk_idx.long())  # (B, T, k)
    q_tail = _rest_logsumexp(logq, topk_idx)  # (B, T)
    if tail_logp is None:
        p_tail = torch.log(-torch.expm1(topk_logp.logsumexp(-1).clamp_max(-1e-30)))
    else:
        p_tail = tail_logp.float()
    pt = p_tail.exp()
    tail = torch.where(pt > 0, pt * (p_tail - q_tail), torch.zeros_like(pt))
    kl = (topk_logp.exp() * (topk_logp - q_k)).sum(-1) + tail
    return kl.mean()
