"""Captured (x, y) pairs of the locked sub-blocks: training / held-out split, sampling (uniform plus hard tokens)."""

from __future__ import annotations


import torch
from torch import Tensor

from ...errors import MLPSurgeryError


def split_chunks(n_chunks: int, val_fraction: float) -> tuple[list[int], list[int]]:
    """(training, held-out) chunk indices of a capture: the last val_fraction of the chunks, at least one, are
    held out, and at least one is trained on (so the held-out error is never a training error)."""
    if n_chunks < 2:
        raise MLPSurgeryError(f"a capture of {n_chunks} chunk cannot be split into training and held-out tokens; "
                              "capture at least 2 batches (more --calib-blocks)")
    n_val = min(n_chunks - 1, max(1, int(round(val_fraction * n_chunks))))
    return list(range(n_chunks - n_val)), list(range(n_chunks - n_val, n_chunks))


def capture_batch(calib_blocks: int) -> int:
    """Blocks per captured chunk: 8, fewer for small calibration sets so that there are at least two chunks."""
    return max(1, min(8, calib_blocks // 2))


class _CapturedSet:
    """Captured (x, y) of all layers as (n_layers, N, d) tensors in RAM, or per chunk from disk."""

    def __init__(self, cap, layers: list[int], chunks: list[int], memory_limit_gb: float):
        self.cap, self.layers, self.chunks = cap, layers, chunks
        sizes = [cap.tokens_per_chunk[k] for k in chunks]
        self.n = sum(sizes)
        self.nbytes = 2 * len(layers) * self.n * cap.d * 2
        self.in_memory = self.nbytes <= memory_limit_gb * 2**30
        self._norms: Tensor | None = None  # (n_layers, N) update norms, for hard sampling in memory
        if self.in_memory:
            self.X, self.Y = self._read(chunks)

    def _read(self, chunks: list[int]) -> tuple[Tensor, Tensor]:
        """(x, y) of the given chunks, each (n_layers, tokens, d), in the stored dtype. Written chunk by chunk into
        tensors allocated once: stacking the chunks and concatenating them held the set twice while it was read
        (2 x 3.8 GiB for SmolLM2's 256 captured blocks)."""
        X = Y = None
        at = 0
        for k in chunks:
            c = self.cap.chunk(k, self.layers)
            x0, _ = c[self.layers[0]]
            if X is None:
                n = sum(self.cap.tokens_per_chunk[j] for j in chunks)
                X = torch.empty(len(self.layers), n, x0.shape[-1], dtype=x0.dtype)
                Y = torch.empty_like(X)
            for j, i in enumerate(self.layers):
                X[j, at:at + len(x0)] = c[i][0]
                Y[j, at:at + len(x0)] = c[i][1]
            at += len(x0)
            del c
        if X is None or at != X.shape[1]:
            raise MLPSurgeryError(f"the capture's chunks hold {at} tokens, its index says "
                                  f"{0 if X is None else X.shape[1]}: the capture folder is damaged; delete it and "
                                  "capture again")
        return X, Y

    def sample(self, n_tokens: int, g: torch.Generator, hard_fraction: float = 0.0) -> tuple[Tensor, Tensor]:
        """n_tokens per layer: uniformly, except a hard_fraction share drawn per layer in proportion to the
        update norm ||y_t - x_t|| (so the rare tokens that hold most of a layer's update, e.g. the attention
        sink, are in every batch instead of one batch in three)."""
        if self.in_memory:
            X, Y, n = self.X, self.Y, self.n
        else:
            X, Y = self._read([self.chunks[int(torch.randint(0, len(self.chunks), (1,), generator=g))]])
            n = X.shape[1]
        n_hard = int(round(hard_fraction * n_tokens))
        idx = torch.randint(0, n, (n_tokens - n_hard,), generator=g)
        if not n_hard:
            return X[:, idx].float(), Y[:, idx].float()
        if self.in_memory:
            if self._norms is None:  # one layer at a time: a float copy of the whole set would double its RAM
                self._norms = torch.stack([(y.float() - x.float()).norm(dim=-1) for x, y in zip(self.X, self.Y)])
            norms = self._norms
        else:
            norms = (Y.float() - X.float()).norm(dim=-1)
        hard = torch.multinomial(norms, n_hard, replacement=True, generator=g)  # (n_layers, n_hard)
        idx = torch.cat([idx.expand(len(self.layers), -1), hard], 1)
        rows = torch.arange(len(self.layers))[:, None]
        return X[rows, idx].float(), Y[rows, idx].float()

    def median_update_energy(self, max_tokens: int = 1 << 16) -> Tensor:
        """Per layer, the median over (up to max_tokens) captured tokens of ||y_t - x_t||^2: (n_layers,)."""
        if self.in_memory:
            X, Y = self.X[:, :max_tokens], self.Y[:, :max_tokens]
        else:
            X, Y = self._read(self.chunks[:1])
        return (Y.float() - X.float()).pow(2).sum(-1).median(-1).values

    def first(self, max_tokens: int) -> tuple[Tensor, Tensor]:
        """(x, y) of up to max_tokens tokens per layer, (n_layers, tokens, d) in the stored dtype: an even spread
        over the set in memory, else the first chunks read until there are enough."""
        if self.in_memory:
            idx = torch.linspace(0, self.n - 1, min(max_tokens, self.n)).round().long().unique()
            return self.X[:, idx], self.Y[:, idx]
        chunks, have = [], 0
        for k in self.chunks:
            chunks.append(k)
            have += self.cap.tokens_per_chunk[k]
            if have >= max_tokens:
                break
        X, Y = self._read(chunks)
        return X[:, :max_tokens], Y[:, :max_tokens]

    def all(self) -> tuple[Tensor, Tensor]:
        X, Y = (self.X, self.Y) if self.in_memory else self._read(self.chunks)
        return X.float(), Y.float()
