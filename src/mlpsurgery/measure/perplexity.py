"""Token-level perplexity with a stated protocol.

Protocol (the `protocol` dict of every result spells it out):
- each document (token sequence) is evaluated on its own; documents never share a window;
- windows of `block_len` tokens start every `stride` tokens; the default stride, block_len - 1, makes
  consecutive windows share one token, so the first token of a window is context, not a target;
  smaller strides give every token more context (at least block_len - stride tokens); the last
  window is pulled back to end at the document's end so that no tail is skipped;
- every token of a document except its first is scored exactly once, in the first window that holds
  it with at least one token of context before it;
- no BOS token is added; perplexity = exp(sum of NLL / number of scored tokens), natural log.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from ..errors import MLPSurgeryError


@dataclass
class Perplexity:
    ppl: float
    nll: float  # mean negative log-likelihood per scored token (nats)
    tokens: int  # scored tokens
    protocol: dict

    def as_dict(self) -> dict:
        return asdict(self)


def _windows(lengths: list[int], block_len: int, stride: int) -> list[tuple[int, int, int, int]]:
    """(doc, start, first scored position, end) for every window, positions absolute in the document."""
    out = []
    for doc, n in enumerate(lengths):
        if n < 2:
            continue
        scored_to = 1  # everything before this position is scored (position 0 never is)
        start = 0
        while scored_to < n:
            start = min(start, max(0, n - block_len))
            end = min(start + block_len, n)
            first = max(scored_to, start + 1)
            if first < end:
                out.append((doc, start, first, end))
            scored_to = end
            start += stride
    return out


def is_causal_lm(model: nn.Module) -> bool:
    return hasattr(model, "get_output_embeddings") and model.get_output_embeddings() is not None and \
        not getattr(model.config, "is_encoder_decoder", False) and \
        getattr(model.config, "model_type", "") not in ("bert", "roberta")


def perplexity(model: nn.Module, sequences: list[Tensor] | Tensor, block_len: int = 512, stride: int | None = None,
               batch_size: int = 4, max_tokens: int | None = None, progress: bool = True,
               device: torch.device | str | None = None) -> Perplexity:
    """Perplexity of a causal LM on token sequences (a list of 1-D tensors, or an (N, T) tensor of blocks)."""
    if not is_causal_lm(model):
        raise MLPSurgeryError(f"perplexity needs a causal language model; {type(model).__name__} is not one "
                              "(for encoders use `mlpsurgery eval acc`)")
    if block_len < 2:
        raise MLPSurgeryError(f"block length must be at least 2 tokens, not {block_len}")
    stride = stride or block_len - 1
    if not 0 < stride < block_len:
        raise MLPSurgeryError(f"stride must be in 1..block_len-1 ({block_len - 1}), not {stride}")
    seqs = list(sequences) if isinstance(sequences, (list, tuple)) else list(sequences.unbind(0))
    wins = _windows([len(s) for s in seqs], block_len, stride)
    if max_tokens is not None:
        kept, total = [], 0
        for w in wins:
            if total >= max_tokens:
                break
            kept.append(w)
            total += w[3] - w[2]
        wins = kept
    if not wins:
        raise MLPSurgeryError("no tokens to score: every sequence is shorter than 2 tokens")
    device = torch.device(device) if device is not None else next(model.parameters()).device
    nll_sum, count = 0.0, 0
    # batch windows of equal length together
    by_len: dict[int, list] = {}
    for w in wins:
        by_len.setdefault(w[3] - w[1], []).append(w)
    groups = [g[i:i + batch_size] for g in by_len.values() for i in range(0, len(g), batch_size)]
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for group in tqdm(groups, desc="perplexity", unit="batch", disable=not progress):
            ids = torch.stack([seqs[doc][start:end] for doc, start, _, end in group]).to(device)
            logits = model(input_ids=ids).logits.float()  # (B, T, V)
            logp = torch.log_softmax(logits[:, :-1], dim=-1)
            nll = -logp.gather(-1, ids[:, 1:, None]).squeeze(-1)  # (B, T-1): nll of token t+1
            for b, (doc, start, first, end) in enumerate(group):
                nll_sum += nll[b, first - start - 1:end - start - 1].double().sum().item()
                count += end - first
    model.train(was_training)
    mean = nll_sum / count
    protocol = {"block_len": block_len, "stride": stride, "documents": len(seqs), "windows": len(wins),
                "scored": "each token once, in the first window giving it >= 1 token of context; a document's "
                          "first token never",
                "bos": "not added", "log": "natural", "max_tokens": max_tokens}
    return Perplexity(ppl=math.exp(mean), nll=mean, tokens=count, protocol=protocol)
