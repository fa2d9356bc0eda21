"""Token-level perplexity with a stated protocol.

Protocol (the `protocol` dict of every result spells it out):
- each document (token sequence) is evaluated on its own; documents never share a window;
- windows of `block_len` tokens start every `stride` tokens; the default stride, block_len - 1, makes
  consecutive windows share one token, so the first token of a window is context, not a target;
  smaller strides give every token more context (at least block_len - stride tokens); the last
  window is pulled back to end at the document's end so that no tail is skipped;
- every token of a document except its first is scored exactly once, in the first window that holds
  it with at least one token of context before it;
- BOS follows the tokenizer's own default (`bos_id` given: the tokenizer adds one, so the model was trained
  with it): then every window starts with BOS, takes block_len - 1 text tokens, and a document's first token
  is scored too (with BOS as its context); without BOS it never is;
- perplexity = exp(sum of NLL / number of scored tokens), natural log; `max_tokens` cuts the last window so
  that no more than that many tokens are scored.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from ..errors import MLPSurgeryError
from ..models import check_context, context_length
from ..sites.specs import is_encoder_type


@dataclass
class Perplexity:
    ppl: float
    nll: float  # mean negative log-likelihood per scored token (nats)
    tokens: int  # scored tokens
    protocol: dict

    def as_dict(self) -> dict:
        return asdict(self)


def _windows(lengths: list[int], block_len: int, stride: int, bos: bool = False) -> list[tuple[int, int, int, int]]:
    """(doc, start, first scored position, end) for every window, positions absolute in the document. With BOS
    a window holds block_len - 1 text tokens and position 0 is scored (BOS is its context)."""
    span = block_len - 1 if bos else block_len
    out = []
    for doc, n in enumerate(lengths):
        if n < (1 if bos else 2):
            continue
        scored_to = 0 if bos else 1  # everything before this position is scored
        start = 0
        while scored_to < n:
            start = min(start, max(0, n - span))
            end = min(start + span, n)
            first = max(scored_to, start + (0 if bos and start == 0 else 1))
            if first < end:
                out.append((doc, start, first, end))
            scored_to = end
            start += stride
    return out


def default_block_len(model: nn.Module, want: int = 512) -> int:
    """A default window length: `want`, or the model's whole context when that is shorter."""
    limit = context_length(model)
    return min(want, limit) if limit else want


def is_causal_lm(model: nn.Module) -> bool:
    return hasattr(model, "get_output_embeddings") and model.get_output_embeddings() is not None and \
        not getattr(model.config, "is_encoder_decoder", False) and \
        not is_encoder_type(getattr(model.config, "model_type", None))


def _next_token_nll(logits: Tensor, ids: Tensor, chunk_bytes: int = 1 << 26) -> Tensor:
    """-log p(ids[:, t+1] | ..t) from logits (B, T, V) in any dtype, in float32, a few positions at a time: a
    float32 log-softmax of the whole (B, T, V) would hold two more copies of the logits (1.2 GB for 4 x 512 tokens
    of a 49k vocabulary). log_softmax works row by row, so the result is the same as in one piece."""
    B, T, V = logits.shape
    step = max(1, chunk_bytes // (4 * B * V))
    out = torch.empty(B, T - 1, dtype=torch.float32, device=logits.device)
    for s in range(0, T - 1, step):
        e = min(T - 1, s + step)
        logp = torch.log_softmax(logits[:, s:e].float(), dim=-1)
        out[:, s:e] = -logp.gather(-1, ids[:, s + 1:e + 1, None]).squeeze(-1)
    return out


def perplexity(model: nn.Module, sequences: list[Tensor] | Tensor, block_len: int = 512, stride: int | None = None,
               batch_size: int = 4, max_tokens: int | None = None, progress: bool = True,
               device: torch.device | str | None = None, bos_id: int | None = None) -> Perplexity:
    """Perplexity of a causal LM on token sequences (a list of 1-D tensors, or an (N, T) tensor of blocks).
    bos_id: prepend this BOS to every window (`corpus.bos` follows the tokenizer's default: data.default_bos)."""
    plan = _Plan(model, sequences, block_len, stride, batch_size, max_tokens, bos_id)
    device = torch.device(device) if device is not None else next(model.parameters()).device
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for g in tqdm(range(len(plan.groups)), desc="perplexity", unit="batch", disable=not progress):
            ids = plan.ids(g).to(device)
            plan.score(g, model(input_ids=ids).logits, ids)
    model.train(was_training)
    return plan.result()


def perplexity_layerwise(stream, sequences: list[Tensor] | Tensor, block_len: int = 512, stride: int | None = None,
                         batch_size: int = 4, max_tokens: int | None = None, progress: bool = True,
                         bos_id: int | None = None, work=None) -> Perplexity:
    """`perplexity` of the checkpoint a layerwise.LayerStream reads, one decoder layer in memory at a time: the same
    windows, batches and sums (`LayerStream.outputs` runs each layer over every batch in turn, then the model's own
    head), so the result is the whole model's (tested bit for bit). work(i): applied to layer i once read (e.g. a
    CoreLocker extraction), before it runs."""
    plan = _Plan(stream.model, sequences, block_len, stride, batch_size, max_tokens, bos_id)
    batches = [plan.ids(g) for g in range(len(plan.groups))]
    stream.outputs(batches, lambda g, out: plan.score(g, out.logits, batches[g]), progress=progress,
                   desc="perplexity, layer by layer", work=work)
    return plan.result()


class _Plan:
    """The windows, batches and running sums of one perplexity measurement (the protocol of the module docstring)."""

    def __init__(self, model: nn.Module, sequences, block_len: int, stride: int | None, batch_size: int,
                 max_tokens: int | None, bos_id: int | None):
        if not is_causal_lm(model):
            raise MLPSurgeryError(f"perplexity needs a causal language model; {type(model).__name__} is not one "
                                  "(for encoders use `mlpsurgery eval acc`)")
        bos = bos_id is not None
        if block_len < (3 if bos else 2):
            raise MLPSurgeryError(f"block length must be at least {3 if bos else 2} tokens, not {block_len}")
        check_context(model, block_len)
        span = block_len - 1 if bos else block_len
        if stride is None:
            stride = span - 1 if span > 1 else 1
        if not 0 < stride < span:
            raise MLPSurgeryError(f"stride must be in 1..{span - 1} (the window's text tokens minus one), not {stride}")
        if max_tokens is not None and max_tokens < 1:
            raise MLPSurgeryError(f"max tokens must be at least 1, not {max_tokens}")
        self.seqs = list(sequences) if isinstance(sequences, (list, tuple)) else list(sequences.unbind(0))
        wins = _windows([len(s) for s in self.seqs], block_len, stride, bos)
        if max_tokens is not None:
            kept, total = [], 0
            for doc, start, first, end in wins:
                if total >= max_tokens:
                    break
                end = min(end, first + max_tokens - total)  # cut the last window: at most max_tokens are scored
                kept.append((doc, start, first, end))
                total += end - first
            wins = kept
        if not wins:
            raise MLPSurgeryError("no tokens to score: every sequence is shorter than 2 tokens")
        by_len: dict[int, list] = {}  # batch windows of equal length together
        for w in wins:
            by_len.setdefault(w[3] - w[1], []).append(w)
        self.groups = [g[i:i + batch_size] for g in by_len.values() for i in range(0, len(g), batch_size)]
        self.bos_id, self.nll_sum, self.count = bos_id, 0.0, 0
        self.protocol = {"block_len": block_len, "stride": stride, "documents": len(self.seqs), "windows": len(wins),
                         "scored": "each token once, in the first window giving it >= 1 token of context; a "
                                   "document's " + ("first token with BOS as its context" if bos else
                                                    "first token never"),
                         "bos": f"id {bos_id} prepended to every window" if bos else "not added",
                         "log": "natural", "max_tokens": max_tokens}

    def ids(self, g: int) -> Tensor:
        """Group g's windows as one (B, T) batch of token ids (BOS first where the protocol adds it)."""
        rows = [self.seqs[doc][start:end] for doc, start, _, end in self.groups[g]]
        if self.bos_id is not None:
            rows = [torch.cat([torch.tensor([self.bos_id], dtype=r.dtype), r]) for r in rows]
        return torch.stack(rows)

    def score(self, g: int, logits: Tensor, ids: Tensor) -> None:
        nll = _next_token_nll(logits, ids.to(logits.device))  # (B, T-1): nll of input token t+1
        o = 1 if self.bos_id is not None else 0  # where document position `start` sits in the model's input
        for b, (doc, start, first, end) in enumerate(self.groups[g]):
            self.nll_sum += nll[b, first - start + o - 1:end - start + o - 1].double().sum().item()
            self.count += end - first

    def result(self) -> Perplexity:
        mean = self.nll_sum / self.count
        return Perplexity(ppl=math.exp(mean), nll=mean, tokens=self.count, protocol=self.protocol)
