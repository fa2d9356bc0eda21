"""N:M semi-structured sparsity: at most N nonzeros in every M consecutive inputs of a row (2:4 is what NVIDIA's
sparse tensor cores and inference engines serve)."""

from __future__ import annotations

import torch
from torch import Tensor

from ...errors import MLPSurgeryError


def parse_pattern(text: str | None) -> tuple[int, int] | None:
    """'2:4' -> (2, 4): N:M semi-structured sparsity, at most N nonzeros in every M consecutive inputs of a row (the
    format NVIDIA's sparse tensor cores and inference engines serve: 2:4). None / '' -> None (unstructured)."""
    if not text:
        return None
    try:
        n, m = (int(x) for x in str(text).split(":"))
    except ValueError:
        raise MLPSurgeryError(f"pattern {text!r} is not N:M (e.g. 2:4: two nonzeros in every four weights)") from None
    if not 0 < n < m or m > 64:
        raise MLPSurgeryError(f"pattern {text!r}: need 0 < N < M <= 64 (e.g. 2:4, 4:8)")
    return n, m


def pattern_sparsity(pattern: tuple[int, int]) -> float:
    n, m = pattern
    return 1 - n / m


def check_pattern(W: Tensor, pattern: tuple[int, int]) -> None:
    if W.shape[1] % pattern[1]:
        raise MLPSurgeryError(f"a {tuple(W.shape)} weight has {W.shape[1]} inputs, not a multiple of {pattern[1]}: "
                              f"{pattern[0]}:{pattern[1]} sparsity needs whole groups of {pattern[1]} inputs")


def nm_keep(scores: Tensor, pattern: tuple[int, int]) -> Tensor:
    """Keep-mask with the N highest scores of every M consecutive entries of each row (ties: the earlier entry)."""
    n, m = pattern
    rows, cols = scores.shape
    check_pattern(scores, pattern)
    groups = scores.reshape(rows, cols // m, m)
    top = groups.topk(n, dim=2).indices
    keep = torch.zeros_like(groups, dtype=torch.bool).scatter_(2, top, True)
    return keep.reshape(rows, cols)


def _pattern_text(pattern: tuple[int, int] | None) -> str | None:
    return None if pattern is None else f"{pattern[0]}:{pattern[1]}"

