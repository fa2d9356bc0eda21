"""Closed-form compensation for attention with heads cut out (a TwIST subnet's narrowed attention, Fisher head
blocks): the output projection refit by ridge least squares to the original attention's output on calibration inputs.

Attention keeping H' of its H heads computes y~ = O' c(x) + b with c(x) the kept heads' outputs concatenated (what
the output projection reads); given the rows C = c(X) of calibration inputs X and the original attention's outputs
Y = O c_full(X) + b there, the best O' (and b, where the architecture has an output bias) solves the same ridge least
squares as a narrowed MLP's down projection (refit.py), the heads' outputs in place of the inner activations. The kept
heads' q / k / v stay as they are; what the cut heads added is carried, as far as a linear map of the kept ones can
carry it, by the new output projection."""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor, nn

from ...sites import AttnSite
from .refit import RIDGE, refit_linear, stats_of_rows


def refit_output_(site: AttnSite, c: Tensor, y: Tensor, ridge: float = RIDGE) -> dict:
    """Refit the output projection (and its bias) of the attention at `site` in place: rows c (n, H' hd) of what it
    reads, y (n, d) what the original attention's output projection gave on the same inputs. Returns the relative
    output error before and after on those rows."""
    w = site.read()
    O, b, info = refit_linear(stats_of_rows(c, y), w.o.reshape(w.o.shape[0], -1), w.o_bias, ridge)
    if O is not None:
        site.write(dataclasses.replace(w, o=O.reshape(w.o.shape).to(w.o),
                                       o_bias=None if b is None else b.to(w.o_bias)))
    return info


def output_rows_hooks(site: AttnSite, original: AttnSite, c_rows: list, y_rows: list) -> list:
    """Hooks that, on every forward of `site`'s attention, append to c_rows what its output projection reads and to
    y_rows what the `original` attention's output projection gives on the same call (the original attention run with
    the very arguments the layer passed: masks, positions, rotary tables). Returns the handles to remove."""

    def flat(t: Tensor) -> Tensor:
        return t.detach().reshape(-1, t.shape[-1]).float()

    def own(mod, args):
        c_rows.append(flat(args[0]))

    def target(mod, args, out):
        y_rows.append(flat(out))

    def call_original(mod, args, kwargs):
        handle = original.o_proj.register_forward_hook(target)
        try:
            with torch.no_grad():
                original.module(*args, **kwargs)
        finally:
            handle.remove()

    return [site.o_proj.register_forward_pre_hook(own),
            site.module.register_forward_pre_hook(call_original, with_kwargs=True)]


def narrowed_attention(model: nn.Module, original: nn.Module) -> list[int]:
    """The layers whose attention `model` (a narrowed copy of `original`) holds with fewer heads."""
    from ...sites import find_sites

    new, old = find_sites(model), find_sites(original)
    return [s.index for s in new.attn if s.n_heads < old.attn[s.index].n_heads]
