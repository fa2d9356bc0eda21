"""How far each compressed MLP is from the original: its sub-block's output error on probe rows, and its counts."""

from __future__ import annotations

import torch
from torch import Tensor

from ...sites import MLPSite


class _ErrorProbes:
    """Per layer, the relative error ||H~ - H||_F / ||H||_F of the compressed MLP sub-block's output H~ against
    the original's H, on the same inputs: the captured MLP inputs of the tune data when there is some (up to
    PROBE_ROWS token rows, evenly spread; H is the captured original output), else RANDOM_ROWS seeded N(0, 1)
    residual-stream rows (the pre-norm, where the architecture has one, brings them to the scale the MLP sees;
    H is the original MLP on them). Each MLP is measured on its own inputs, so errors do not compound across
    layers: it is what layer-wise tuning minimises (as an MSE). Random rows are fewer: the MLP runs twice on
    them, and 512 x d outputs already pin the ratio down (under a second a layer of SmolLM2, against ~5 s of
    k-means)."""

    PROBE_ROWS = 2048
    RANDOM_ROWS = 512

    def __init__(self, sites, layers: list[int], capture, seed: int):
        self.sites, self.capture = sites, capture
        self.random: dict[int, tuple[Tensor, Tensor]] = {}  # layer -> (inputs, original outputs), without data
        if capture is not None:
            self.description = (f"the tune data's captured MLP inputs (up to {self.PROBE_ROWS} token rows per "
                                "layer); reference: the original model's MLP outputs on them")
        else:
            self.description = (f"{self.RANDOM_ROWS} seeded N(0, 1) residual-stream rows per layer (no tune data); "
                                "reference: the original MLP on the same rows")
        self.gen = torch.Generator().manual_seed(seed + 7919)

    def _like(self, i: int) -> dict:
        p = next(iter(self.sites.mlp[i].parameters()))
        return {"device": p.device, "dtype": p.dtype}

    def before(self, i: int) -> None:
        """Without data: draw layer i's probe rows and record the original MLP on them (call before compressing).
        With data the captured original outputs are the reference, nothing to record."""
        if self.capture is not None:
            return
        site = self.sites.mlp[i]
        x = torch.randn(self.RANDOM_ROWS, site.d, generator=self.gen).to(**self._like(i))
        with torch.no_grad():
            self.random[i] = (x, site.subblock(x))

    def error(self, i: int) -> float:
        """Relative error of layer i's sub-block as it is now."""
        if self.capture is not None:
            x, y = self.capture.layer(i)
            idx = torch.linspace(0, len(x) - 1, min(len(x), self.PROBE_ROWS)).long()
            xb = x[idx].to(**self._like(i))
            ref = y[idx].to(xb) - xb
        else:
            xb, ref = self.random.pop(i)  # measured once: there is no tuning without data
        with torch.no_grad():
            out = self.sites.mlp[i].subblock(xb).float()
        ref = ref.float()
        return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def count_after(site: MLPSite, row: dict) -> None:
    """A compressed layer's parameter and non-zero counts, into its report row."""
    params = list(site.parameters())
    row["params_after"] = sum(p.numel() for p in params)
    row["nonzero_after"] = sum(int((p != 0).sum()) for p in params)

