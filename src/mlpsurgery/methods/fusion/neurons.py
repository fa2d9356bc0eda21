"""An MLP's neurons as vectors (gate, up and down rows with their biases), and MLP weights made back from them."""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from ...errors import MLPSurgeryError
from ...sites import MLPWeights


_NEURON_PARTS = ("gate", "gate_bias", "up", "up_bias", "down")  # down_bias is shared, not per neuron


def neuron_vectors(w: MLPWeights) -> Tensor:
    """(h, dim): row i is neuron i, [W_gate[:, i], b_gate[i], W_up[:, i], b_up[i], W_down[i, :]] in the paper's
    orientation (canonical up/gate are (h, d), down is (d, h)); parts a model lacks are left out."""
    cols = []
    for name in _NEURON_PARTS:
        t = getattr(w, name)
        if t is not None:
            cols.append(t.T if name == "down" else t[:, None] if t.dim() == 1 else t)
    return torch.cat(cols, 1)


def weights_from_neurons(rows: Tensor, like: MLPWeights) -> MLPWeights:
    """The MLP of width len(rows) whose neurons are `rows` (layout of neuron_vectors(like)); b2 is like's."""
    out, start = {}, 0
    for name in _NEURON_PARTS:
        t = getattr(like, name)
        if t is None:
            continue
        n = 1 if t.dim() == 1 else like.d
        piece = rows[:, start:start + n].to(t)
        start += n
        out[name] = piece.T.contiguous() if name == "down" else piece[:, 0].contiguous() if t.dim() == 1 else piece
    return dataclasses.replace(like, **out)


def cluster_means(vectors: Tensor, labels: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """(C̄ W (k, dim), P (k,)): the mean neuron of each cluster and the cluster sizes."""
    P = torch.bincount(labels, minlength=k).to(vectors.dtype)
    if (P == 0).any():
        raise MLPSurgeryError(f"{int((P == 0).sum())} of {k} clusters are empty; k exceeds the distinct neurons")
    sums = torch.zeros(k, vectors.shape[1], dtype=vectors.dtype, device=vectors.device).index_add_(0, labels, vectors)
    return sums / P[:, None], P

