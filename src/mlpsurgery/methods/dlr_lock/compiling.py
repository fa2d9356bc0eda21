"""torch.compile with an eager fallback, shared by phase 1 (the batched network) and phase 2 (the installed nets)."""

from __future__ import annotations

import warnings
from typing import Callable

import torch


def compiled_or_eager(fn: Callable, what: str, every_call: bool = True) -> Callable:
    """`fn` through torch.compile, or `fn` itself where compilation is unavailable (no C compiler, unsupported
    platform): the math is the same. A failure to set compilation up, or of the first compiled call, warns and runs
    `fn` eagerly from then on; an eager call's own errors pass through. every_call: also fall back when a later
    compiled call fails (a recompilation for new shapes); False where later exceptions must pass through the compiled
    function untouched (phase 2's non-reentrant checkpoint stops its recompute by raising through the forward)."""
    try:
        compiled = torch.compile(fn)
    except Exception as exc:  # noqa: BLE001 - any failure to set up compilation falls back to eager
        warnings.warn(f"torch.compile unavailable ({exc}); {what} runs eagerly")
        return fn
    state = {"fn": compiled, "ran": False}

    def call(*args):
        f = state["fn"]
        if f is fn or (state["ran"] and not every_call):
            return f(*args)
        try:
            out = f(*args)
        except Exception as exc:  # noqa: BLE001 - a backend failure (e.g. no C compiler)
            warnings.warn(f"torch.compile failed ({type(exc).__name__}: {exc}); {what} runs eagerly")
            state["fn"] = fn
            return fn(*args)
        state["ran"] = True
        return out

    return call
