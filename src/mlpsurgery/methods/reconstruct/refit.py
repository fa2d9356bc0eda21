"""Closed-form compensation: the down projection of a narrowed MLP refit by ridge least squares to the original
MLP's output on calibration inputs (the reconstruction step of FLAP / SlimGPT / ZipLM-style structured pruning).

A width-k MLP computes y~ = D a(x) + b with a(x) the k inner activations (gate/up kept, merged or sketched by
whatever method narrowed it). Given calibration inputs X and the original MLP's outputs Y = MLP(X), the best D (and
b, where the architecture has a down bias) solves

    min_D,b  ||A Dᵀ + 1 bᵀ - Y||² + λ ||D||²,        A = a(X) (n, k)

whose normal equations need only G = AᵀA (k, k) and AᵀY (k, d), summed over chunks of rows. λ = ridge · mean diag G
keeps a neuron that the calibration never fires (or two identical ones) from blowing up. Without a bias slot the
mean of what the removed neurons added is still absorbed: the fit is on the uncentred outputs."""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from ...sites import MLPWeights

RIDGE = 1e-3  # relative to the mean of diag(AᵀA)
CHUNK = 4096  # rows per chunk of the Gram sums
# an MLP refit's products within a chunk: float32 (about 3x faster than float64 on the CPU), the sums across chunks
# float64. On SmolLM2's layers 10, 20, 28, 29 at half width the refit's error equals float64 products' to 6 digits
# (docs/notes/calibration.md, session 33); an error near 0 (an exact fit) reads ~1e-7 instead of ~1e-16. The
# narrower attention refit (stats_of_rows) keeps float64 products.
CHUNK_DTYPE = torch.float32


@dataclasses.dataclass
class RefitStats:
    """Sums over calibration rows for one MLP: G = AᵀA, AY = AᵀY of the new inner activations A and the original's
    outputs Y, the column sums of A and Y, and ||Y||² (for the error of any fit without another pass)."""

    G: Tensor
    AY: Tensor
    a_sum: Tensor
    y_sum: Tensor
    yy: float
    n: float  # rows (the sum of their weights when weighed)

    def __add__(self, other: "RefitStats") -> "RefitStats":
        """The sums over both sets of rows (e.g. the same MLP at several ranks: one fit serving them all)."""
        return RefitStats(self.G + other.G, self.AY + other.AY, self.a_sum + other.a_sum, self.y_sum + other.y_sum,
                          self.yy + other.yy, self.n + other.n)

    def scaled(self, w: float) -> "RefitStats":
        """Every row weighed by w (the sums of a weighted least squares; n becomes the sum of the weights)."""
        return RefitStats(self.G * w, self.AY * w, self.a_sum * w, self.y_sum * w, self.yy * w, self.n * w)


ACTS_BYTES = 1 << 29  # inner activations a caller may hold for all calibration rows at once (`inner_rows`)


def inner_rows(w: MLPWeights, x: Tensor, max_bytes: int | None = None) -> Tensor | None:
    """w's inner activations on every row of x (n, h), in w's dtype, chunk by chunk; None where they would take more
    than max_bytes (default ACTS_BYTES; then the caller recomputes what it needs chunk by chunk)."""
    if len(x) * w.h * w.up.element_size() > (ACTS_BYTES if max_bytes is None else max_bytes):
        return None
    with torch.no_grad():
        return torch.cat([w.inner(x[s:s + CHUNK].to(w.up)) for s in range(0, len(x), CHUNK)])


def outputs_from_inner(w: MLPWeights, acts: Tensor) -> Tensor:
    """w's outputs (n, d) from its inner activations (n, h): what w(x) gives, without its gate / up again."""
    with torch.no_grad():
        return torch.cat([torch.nn.functional.linear(acts[s:s + CHUNK], w.down, w.down_bias)
                          for s in range(0, len(acts), CHUNK)])


def refit_stats(new: MLPWeights, target: MLPWeights, x: Tensor, y: Tensor | None = None,
                dtype: torch.dtype = CHUNK_DTYPE, a: Tensor | None = None) -> RefitStats:
    """The sums of `RefitStats` for the narrowed MLP `new` against `target` (the original MLP) on MLP inputs x (n, d),
    or against the given output rows y (n, d). dtype: of each chunk's products (summed in float64 across chunks).
    a: new's inner activations on x (n, k) where the caller has them (kept neurons are a column subset of the
    original's activations it computed to choose them): new's gate / up do not run again."""
    def chunks():
        for s in range(0, len(x), CHUNK):
            xs = x[s:s + CHUNK]
            yield (new.inner(xs.to(new.up)) if a is None else a[s:s + CHUNK]), \
                (target(xs.to(target.up)) if y is None else y[s:s + CHUNK])

    with torch.no_grad():
        return _sums(chunks(), new.h, new.d, dtype)


def stats_of_rows(a: Tensor, y: Tensor, dtype: torch.dtype = torch.float64) -> RefitStats:
    """The sums of `RefitStats` for given input rows a (n, k) of a linear map and its target output rows y (n, d):
    the same least squares for any linear map refit to what it should output (attention's output projection on the
    kept heads' outputs, attention.py)."""
    with torch.no_grad():
        return _sums(((a[s:s + CHUNK], y[s:s + CHUNK]) for s in range(0, len(a), CHUNK)), a.shape[1], y.shape[1],
                     dtype)


def _sums(pairs, k: int, d: int, dtype: torch.dtype) -> RefitStats:
    G = torch.zeros(k, k, dtype=torch.float64)
    AY = torch.zeros(k, d, dtype=torch.float64)
    a_sum = torch.zeros(k, dtype=torch.float64)
    y_sum = torch.zeros(d, dtype=torch.float64)
    yy, n = 0.0, 0
    for a, y in pairs:
        a, y = a.to(dtype).cpu(), y.to(dtype).cpu()
        G += (a.T @ a).double()
        AY += (a.T @ y).double()
        a_sum += a.double().sum(0)
        y64 = y.double()
        y_sum += y64.sum(0)
        yy += float((y64 * y64).sum())
        n += len(a)
    return RefitStats(G, AY, a_sum, y_sum, yy, n)


def solve_down(stats: RefitStats, bias: bool, ridge: float = RIDGE) -> tuple[Tensor, Tensor | None]:
    """(D (d, k), b (d,) or None), float64: the ridge least-squares down projection (and bias) from the sums."""
    G, AY = stats.G, stats.AY
    if bias:  # the ones column appended to A: [[G, a_sum], [a_sumᵀ, n]]
        k = G.shape[0]
        G = torch.cat([torch.cat([G, stats.a_sum[:, None]], 1),
                       torch.cat([stats.a_sum, G.new_tensor([float(stats.n)])])[None, :]], 0)
        AY = torch.cat([AY, stats.y_sum[None, :]], 0)
    lam = ridge * float(torch.diagonal(stats.G).mean().clamp_min(1e-30))
    reg = torch.eye(G.shape[0], dtype=G.dtype) * lam
    if bias:
        reg[-1, -1] = 0  # the bias is not shrunk
    sol = torch.linalg.solve(G + reg, AY)  # (k [+1], d)
    if bias:
        return sol[:k].T.contiguous(), sol[k].contiguous()
    return sol.T.contiguous(), None


def fit_error(stats: RefitStats, D: Tensor, b: Tensor | None) -> float:
    """||A Dᵀ + b - Y||² / ||Y||² from the sums (no second pass over the rows)."""
    D = D.double()
    err = stats.yy - 2 * float((stats.AY * D.T).sum()) + float((D @ stats.G * D).sum())
    if b is not None:
        b = b.double()
        err += -2 * float(b @ stats.y_sum) + 2 * float(b @ (D @ stats.a_sum)) + stats.n * float(b @ b)
    return max(err, 0.0) / max(stats.yy, 1e-300)


def refit_linear(stats: RefitStats, weight: Tensor, bias: Tensor | None,
                 ridge: float = RIDGE) -> tuple[Tensor | None, Tensor | None, dict]:
    """The ridge least-squares replacement (float64) of a linear map (weight (d, k), bias or None) from its sums, and
    the relative output error before and after; (None, None, info) where the fit is no better (cannot happen with
    ridge -> 0; with a large ridge the map stays as it was)."""
    before = fit_error(stats, weight, bias)
    W, b = solve_down(stats, bias is not None, ridge)
    after = fit_error(stats, W, b)
    if after > before:
        return None, None, {"error_before": before, "error_after": before, "refit": False}
    return W, b, {"error_before": before, "error_after": after, "refit": True}


def refit_down(new: MLPWeights, target: MLPWeights, x: Tensor, ridge: float = RIDGE,
               y: Tensor | None = None, a: Tensor | None = None) -> tuple[MLPWeights, dict]:
    """`new` with its down projection (and down bias, where it has one) refit to `target`'s outputs on MLP inputs x
    (or to the rows y; a: new's inner activations on x, as `refit_stats`). Returns the weights (in new's dtype and
    device) and the relative output error on x before and after."""
    D, b, info = refit_linear(refit_stats(new, target, x, y, a=a), new.down, new.down_bias, ridge)
    if D is None:
        return new, info
    return dataclasses.replace(new, down=D.to(new.down), down_bias=None if b is None else b.to(new.down)), info
