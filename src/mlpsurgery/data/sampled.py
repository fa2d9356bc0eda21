"""Calibration text sampled from the model itself (`--calib-data self`), and mixes of it with a corpus
(`--calib-data self+austen+r8-train`).

A compressor calibrated on one kind of text keeps that kind best and can lose much more elsewhere: SmolLM2's MLPs at
half width, calibrated on Austen, score 1.37x the original's perplexity on held-out Austen but 2.93x on election
tweets, against 1.32x when calibrated on tweets (docs/results/cross-corpus-smollm2.md). Where the user's text is not
at hand, the model's own samples are text of every kind it knows, in the proportions it learned them: the data-free
calibration of LLM-QAT (Liu et al. 2023). Sampled at temperature 1 with no top-k / top-p (the model's own
distribution, not its most likely continuations), each block from the tokenizer's BOS (else EOS), the end of text
suppressed so every block is full; seeded, so a rerun gives the same blocks."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from ..errors import MLPSurgeryError

SELF = "self"
SAMPLE_BATCH = 64  # sequences sampled side by side
# what a model that generates is calibrated on when the user names no text: a third sampled from it, a third of the
# bundled novels, a third of the bundled news. On SmolLM2 at half width it scores 1.45x / 1.31x / 2.21x on held-out
# Austen / Reuters / election tweets (never seen), against 1.37x / 1.83x / 2.93x for Austen alone
# (docs/results/cross-corpus-smollm2.md); a model that does not generate (an encoder) is calibrated on Austen.
DEFAULT_MIX = "self+austen+r8-train"


def can_sample(model: nn.Module) -> bool:
    """Whether `model` generates text (a causal LM with its head; not an encoder, not an encoder-decoder)."""
    can = getattr(model, "can_generate", None)
    return callable(can) and bool(can()) and not getattr(getattr(model, "config", None), "is_encoder_decoder", False)


def default_calibration(model: nn.Module) -> str:
    """The calibration text when none is named: DEFAULT_MIX for a model that generates, else the bundled Austen."""
    return DEFAULT_MIX if can_sample(model) else "austen"


def is_sampled(spec) -> bool:
    """Whether a --calib-data value asks for text sampled from the model: 'self' alone or as a part of a mix."""
    return spec is not None and SELF in str(spec).split("+")


def refuse_layer_by_layer(spec, option: str = "--calib-data") -> None:
    """Refuse text sampled from the model where only one layer is held at a time (the layer-by-layer modes)."""
    if is_sampled(spec):
        raise MLPSurgeryError(f"{option} {spec} samples text from the whole model, which the layer-by-layer mode never "
                              "holds: give a corpus (a file, a folder, a table, austen), or drop --layerwise")


def sample_blocks(model: nn.Module, tokenizer, n: int, length: int, seed: int = 0, batch: int = SAMPLE_BATCH,
                  progress: bool = False) -> Tensor:
    """(n, length) token ids sampled from the causal LM `model`, `batch` sequences at a time. In eval mode meanwhile;
    the global RNG is left as it was."""
    if n < 1 or length < 2:
        raise MLPSurgeryError(f"sampling needs at least one block of at least 2 tokens, got {n} x {length}")
    if not can_sample(model):
        raise MLPSurgeryError(f"{type(model).__name__} does not generate text, so it cannot calibrate on its own "
                              "samples; give --calib-data a corpus (a file, a folder, a table, austen)")
    start = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    if start is None:
        raise MLPSurgeryError("the tokenizer has neither a BOS nor an EOS token to start samples from; give "
                              "--calib-data a corpus instead of self")
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    out = []
    bar = tqdm(total=n * length, desc="sampling calibration text", unit="tok", disable=not progress)
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.no_grad():
            torch.manual_seed(seed)
            for b in range(0, n, batch):
                ids = torch.full((min(batch, n - b), 1), start, dtype=torch.long, device=device)
                gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, top_k=0,
                                     top_p=1.0, temperature=1.0, max_new_tokens=length, min_new_tokens=length,
                                     pad_token_id=tokenizer.eos_token_id if tokenizer.eos_token_id is not None
                                     else start)
                out.append(gen[:, 1:length + 1].cpu())
                bar.update(len(ids) * length)
    finally:
        bar.close()
        model.train(was_training)
    return torch.cat(out)


def calibration_blocks(spec, model: nn.Module, tokenizer, block_len: int, max_blocks: int, seed: int = 0,
                       progress: bool = False) -> Tensor:
    """(N, block_len) calibration blocks of `spec`: a corpus (its train split: `text_blocks`), 'self' (max_blocks
    sampled from the model), or a mix naming self beside corpora ('self+austen+r8-train'): an equal share of the
    blocks from each part, self's sampled, the others' drawn from their own train splits. None: the default
    (`default_calibration`)."""
    from .corpus import text_blocks

    spec = spec or default_calibration(model)
    if not is_sampled(spec):
        return text_blocks(spec, tokenizer, block_len=block_len, max_blocks=max_blocks, seed=seed)
    parts = str(spec).split("+")
    if parts.count(SELF) > 1 or "" in parts:
        raise MLPSurgeryError(f"calibration mix {str(spec)!r}: name self once, joined to corpora as self+austen")
    share = max(1, max_blocks // len(parts))
    pieces = []
    for part in parts:
        if part == SELF:
            pieces.append(sample_blocks(model, tokenizer, share, block_len, seed=seed, progress=progress))
        else:
            pieces.append(text_blocks(part, tokenizer, block_len=block_len, max_blocks=share, seed=seed))
    return torch.cat(pieces)
