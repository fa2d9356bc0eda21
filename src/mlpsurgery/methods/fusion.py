"""MLP Fusion (Wei et al., ICML 2023): compress each chosen MLP from h to k inner neurons by clustering
its neurons, keeping the cluster sizes P as a fixed scale so that the fine-tuning dynamics (Adam NTK)
stay close to the original's; and the baselines the paper compares against, at the same width k (or
the same number of MLP weights).

An MLP is a sum of h one-neuron MLPs. Neuron i is the vector (paper's orientation, W1 (d, h), W2 (h, d)):

    plain:  w_i = [W1[:, i], b1[i], W2[i, :]]
    gated:  w_i = [W_gate[:, i], b_gate[i], W_up[:, i], b_up[i], W_down[i, :]]   (biases where present)

(gated works because the gate acts elementwise: neuron i contributes act(x·g_i)(x·u_i) d_i). k-means on
the h vectors gives a one-hot C (k, h); C̄ is C with rows normalised to sum 1, P = C Cᵀ (cluster sizes):

    W~1 = W1 C̄ᵀ,  b~1 = C̄ b1,  W~2 = C̄ W2,    H~ = act(X W~1 + b~1) P W~2 + b2       (modules/fused.py)

Methods (`FusionConfig.method`):
    fusion     the above, P stand-alone (FusedMLP)
    cluster    the same clusters with P^½ folded into both sides (W~1 P^½, P^½ b~1, P^½ W~2): the paper's
               "Clustering" ablation. For gated MLPs the input side is the gate (the branch inside act),
               as W1 is inside σ in the paper; for ReLU-like activations this gives ≈ the fused output.
    svd        truncated SVD of every MLP projection, rank chosen so each keeps k/h of its weights
    sketch     Gaussian sketching: W1 S, b1 S, Sᵀ W2 with S (h, k), entries N(0, 1/k)
    mmd        k support vectors minimising the MMD (Gaussian kernels, median bandwidth) to the h
               neuron vectors; output scaled by h/k (paper eq. 10: MMD matches means, not sums)
    magnitude  unstructured magnitude pruning to k/h of the MLP weights (methods/pruning.py)
    neuron     keep the k most important neurons (importance = ||W_down[:, i]|| times the input norms of
               neuron i, or its mean |activation| on tune text times ||W_down[:, i]||)
    random     keep k neurons drawn at random (seeded)

Optional layer-wise task-specific tuning (paper §4.4): capture each chosen layer's MLP input and output in
the original model on task text, then minimise the sum over layers of MSE(compressed output, original
output) for one epoch (by default), updating only the compressed MLPs' weights (P stays fixed).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from dataclasses import asdict, dataclass

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from ..capture import capture_mlp_io
from ..errors import MLPSurgeryError
from ..io import record
from ..modules.dense import DenseMLP
from ..modules.fused import FusedMLP, TruncatedSVDLinear
from ..sites import MLPSite, MLPWeights, find_sites, linear_weight, parse_layers
from ..train import FitConfig, fit, step_rng
from .pruning import magnitude_prune

METHODS = ("fusion", "cluster", "svd", "sketch", "mmd", "magnitude", "neuron", "random")
DEFAULT_LAYERS = "last2/3"


@dataclass
class FusionConfig:
    """What to compress and how. Defaults follow the paper (k = h/4 on the last two thirds of the layers)."""

    width: int | None = None  # k, the new inner width; None: h // 4 (the paper's 3072 -> 768)
    method: str = "fusion"  # one of METHODS
    layers: str = DEFAULT_LAYERS  # 'all', '8-11', '0,3,5', 'last2/3' (see sites.parse_layers)
    seed: int = 0  # k-means++ / sketch / MMD init / random neurons
    n_init: int = 3  # k-means restarts (best inertia kept)
    max_iter: int = 300  # Lloyd iterations per restart
    tol: float = 1e-4  # Lloyd stops when centres move less than tol x mean feature variance (as scikit-learn)
    device: str | None = None  # where k-means / MMD run (default: the model's device)
    mmd_steps: int = 150  # Adam steps on the support vectors
    mmd_lr: float = 0.03  # in units of the neuron vectors' standard deviation
    importance: str = "weight"  # neuron pruning score: weight (data-free) | activation (needs tune data)
    tune_steps: int | None = None  # layer-wise tuning steps; None: one epoch over the tune tokens
    tune_lr: float = 1e-3
    tune_batch: int = 512  # token rows per tuning step

    def validate(self) -> None:
        if self.method not in METHODS:
            raise MLPSurgeryError(f"unknown method {self.method!r}; choose one of {', '.join(METHODS)}")
        if self.importance not in ("weight", "activation"):
            raise MLPSurgeryError(f"importance must be 'weight' or 'activation', not {self.importance!r}")
        if self.n_init < 1 or self.max_iter < 1:
            raise MLPSurgeryError("n_init and max_iter must be at least 1")


# --------------------------------------------------------------------------------------------------
# k-means (Lloyd with greedy k-means++ seeding, as scikit-learn's KMeans), in torch on any device


@dataclass
class KMeansResult:
    labels: Tensor  # (n,) cluster of each point
    centers: Tensor  # (k, dim)
    inertia: float  # sum of squared distances to the assigned centre
    n_iter: int


def _sq_dist(x: Tensor, x_sq: Tensor, c: Tensor) -> Tensor:
    """(n, m) squared distances between rows of x (n, dim) and c (m, dim); x_sq = |x|² (n,)."""
    return (x_sq[:, None] - 2 * x @ c.T + c.pow(2).sum(1)[None, :]).clamp_min_(0)


def _kmeans_pp(x: Tensor, x_sq: Tensor, k: int, gen: torch.Generator) -> Tensor:
    """Greedy k-means++: each new centre is the best (lowest potential) of 2 + ln k candidates drawn
    with probability proportional to the squared distance to the closest centre so far. Returns indices."""
    n = len(x)
    trials = 2 + int(math.log(k))
    # k sequential rounds of distances to a few candidates: one Gram matrix turns each into a gather
    gram = x @ x.T if n <= 16384 else None

    def dist_to(idx: Tensor) -> Tensor:  # (len(idx), n)
        idx = idx.to(x.device)
        if gram is None:
            return _sq_dist(x, x_sq, x[idx]).T
        return (x_sq[idx, None] + x_sq[None, :] - 2 * gram[idx]).clamp_min_(0)

    idx = torch.empty(k, dtype=torch.long)
    idx[0] = torch.randint(n, (1,), generator=gen)
    closest = dist_to(idx[:1])[0]
    closest[idx[0]] = 0  # a chosen point is at distance 0 exactly, so it is never drawn again
    for c in range(1, k):
        weights = closest.double().cpu()
        if weights.sum() <= 0:  # fewer distinct points than k: any unused point will do
            weights = torch.ones(n, dtype=torch.double)
            weights[idx[:c]] = 0
        cand = torch.multinomial(weights, trials, replacement=True, generator=gen)
        d = torch.minimum(closest[None, :], dist_to(cand))  # (trials, n)
        best = int(d.sum(1).argmin())
        idx[c] = cand[best]
        closest = d[best]
        closest[idx[c]] = 0
    return idx


def kmeans(x: Tensor, k: int, n_init: int = 3, max_iter: int = 300, tol: float = 1e-4, seed: int = 0,
           device: str | torch.device | None = None, progress: bool = False) -> KMeansResult:
    """k-means of the rows of x (n, dim): k-means++ seeding, Lloyd iterations, `n_init` restarts
    (the lowest inertia wins), seeded; runs on `device` (default x's). Empty clusters are refilled with
    the points farthest from their centres. Agrees with sklearn.cluster.KMeans (tests/test_fusion.py)."""
    n = len(x)
    if not 1 <= k <= n:
        raise MLPSurgeryError(f"k-means needs 1 <= k <= {n} (the number of points), got k={k}")
    device = torch.device(device) if device is not None else x.device
    x = x.to(device)
    x_sq = x.pow(2).sum(1)
    tol_abs = tol * float(x.var(0, unbiased=False).mean())
    gen = torch.Generator().manual_seed(seed)
    best: KMeansResult | None = None
    for _ in tqdm(range(n_init), desc="k-means", unit="restart", disable=not progress, leave=False):
        centers = x[_kmeans_pp(x, x_sq, k, gen).to(device)].clone()
        labels = torch.full((n,), -1, dtype=torch.long, device=device)
        it = 0
        for it in range(1, max_iter + 1):
            dist = _sq_dist(x, x_sq, centers)
            new_labels = dist.argmin(1)
            counts = torch.bincount(new_labels, minlength=k)
            empty = (counts == 0).nonzero().flatten()
            if len(empty):
                far = dist.gather(1, new_labels[:, None])[:, 0].argsort(descending=True)[:len(empty)]
                new_labels[far] = empty
                counts = torch.bincount(new_labels, minlength=k)
            new_centers = torch.zeros_like(centers).index_add_(0, new_labels, x) / counts[:, None].to(x.dtype)
            shift = float((new_centers - centers).pow(2).sum())
            converged = torch.equal(new_labels, labels) or shift <= tol_abs
            centers, labels = new_centers, new_labels
            if converged:
                break
        inertia = float((x - centers[labels]).pow(2).sum())
        if best is None or inertia < best.inertia:
            best = KMeansResult(labels=labels, centers=centers, inertia=inertia, n_iter=it)
    return best


# --------------------------------------------------------------------------------------------------
# Neurons as vectors

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


# --------------------------------------------------------------------------------------------------
# One site, one method


def _mlp_input(site: MLPSite, x: Tensor) -> Tensor:
    """What the MLP itself sees, from the residual stream x entering its sub-block (the pre-norm applied)."""
    return site.pre_norm(x) if site.pre_norm is not None else x


def _mmd_support(vectors: Tensor, k: int, steps: int, lr: float, gen: torch.Generator) -> tuple[Tensor, float]:
    """k support vectors minimising MMD² to the empirical distribution of `vectors` (h, dim), with a sum of
    Gaussian kernels at 0.5, 1 and 2 times the median squared distance. Initialised at k random neurons."""
    x = vectors.float()
    x_sq = x.pow(2).sum(1)
    sub = x[torch.randperm(len(x), generator=gen)[:min(len(x), 1024)].to(x.device)]
    med = float(_sq_dist(sub, sub.pow(2).sum(1), sub).median().clamp_min(1e-12))
    gammas = [1.0 / (s * med) for s in (0.5, 1.0, 2.0)]

    def kern(a: Tensor, a_sq: Tensor, b: Tensor) -> Tensor:
        d = _sq_dist(a, a_sq, b)
        return sum(torch.exp(-g * d) for g in gammas)

    k_xx = float(kern(x, x_sq, x).mean())
    y = nn.Parameter(x[torch.randperm(len(x), generator=gen)[:k].to(x.device)].clone())
    scale = float(x.std())
    opt = torch.optim.Adam([y], lr=lr * scale)
    mmd = float("nan")
    for step in range(steps + 1):
        y_sq = y.pow(2).sum(1)
        loss = k_xx + kern(y, y_sq, y).mean() - 2 * kern(x, x_sq, y).mean()
        mmd = float(loss.detach())
        if step == steps:
            break
        opt.zero_grad()
        loss.backward()
        opt.step()
    return y.detach(), mmd


def _importance(w: MLPWeights, x: Tensor | None) -> Tensor:
    """(h,) neuron scores: mean |activation| on x (MLP inputs) or, without data, the product of the
    neuron's input-weight norms; times the norm of its output weights in both cases."""
    out_norm = w.down.float().norm(dim=0)
    if x is not None:
        acts = torch.cat([w.inner(x[s:s + 4096].to(w.up)).abs().float().sum(0, keepdim=True)
                          for s in range(0, len(x), 4096)]).sum(0) / len(x)
        return acts * out_norm
    score = torch.cat([w.up, w.up_bias[:, None]], 1).float().norm(dim=1) if w.up_bias is not None \
        else w.up.float().norm(dim=1)
    if w.gated:
        score = score * w.gate.float().norm(dim=1)
    return score * out_norm


def _svd_(site: MLPSite, k: int, h: int) -> list[dict]:
    """Replace each MLP projection by its truncated SVD keeping k/h of its weights."""
    if site.replaced:
        raise MLPSurgeryError(f"layer {site.index}: the svd baseline factorises the stock projections, and this MLP was "
                              f"replaced by {type(site.module).__name__}; apply svd first")
    ranks = []
    for role, mod in site.linears().items():
        weight, bias = linear_weight(mod)
        out_f, in_f = weight.shape
        rank = max(1, (out_f * in_f * k // h) // (out_f + in_f))
        site.replace_linear(role, TruncatedSVDLinear.from_weight(weight, bias, rank, dense_class=type(mod).__name__))
        ranks.append({"projection": role, "shape": [out_f, in_f], "rank": rank})
    return ranks


def compress_site(site: MLPSite, k: int, cfg: FusionConfig, gen: torch.Generator,
                  x: Tensor | None = None, progress: bool = False) -> dict:
    """Compress one MLP with cfg.method to width k (in place, through the site). x: captured MLP inputs
    (only for importance='activation'). Returns what was done (for the report)."""
    w = site.read()
    h = w.h
    if not 1 <= k <= h:
        raise MLPSurgeryError(f"layer {site.index}: width must be between 1 and the MLP's inner width {h}, got {k}")
    info: dict = {"layer": site.index, "h": h, "width": k, "params_before": w.num_params()}
    device = torch.device(cfg.device) if cfg.device else w.up.device
    method = cfg.method
    if method in ("fusion", "cluster"):
        vec = neuron_vectors(w).float()
        km = kmeans(vec, k, n_init=cfg.n_init, max_iter=cfg.max_iter, tol=cfg.tol,
                    seed=int(torch.randint(2**31 - 1, (1,), generator=gen)), device=device, progress=progress)
        centroids, P = cluster_means(vec.to(km.labels.device), km.labels, k)
        fused = weights_from_neurons(centroids.to(w.up.device), w)
        info.update(inertia=km.inertia, kmeans_iterations=km.n_iter,
                    cluster_sizes={"min": int(P.min()), "max": int(P.max()), "singletons": int((P == 1).sum())})
        if method == "fusion":
            module = FusedMLP.from_centroids(fused, P)
        else:
            root = P.sqrt().to(w.up)
            side = "gate" if w.gated else "up"
            fused = dataclasses.replace(fused, **{side: getattr(fused, side) * root[:, None],
                                                  f"{side}_bias": None if getattr(fused, f"{side}_bias") is None
                                                  else getattr(fused, f"{side}_bias") * root,
                                                  "down": fused.down * root[None, :]})
            module = DenseMLP.from_weights(fused)
    elif method == "sketch":
        S = torch.randn(h, k, generator=gen, dtype=torch.float64) / math.sqrt(k)  # (h, k)
        rows = S.T.to(device) @ neuron_vectors(w).double().to(device)  # Sᵀ W: (k, dim)
        module = DenseMLP.from_weights(weights_from_neurons(rows.to(w.up.device), w))
    elif method == "mmd":
        rows, mmd = _mmd_support(neuron_vectors(w).to(device), k, cfg.mmd_steps, cfg.mmd_lr, gen)
        sw = weights_from_neurons(rows.to(w.up.device), w)
        module = DenseMLP.from_weights(dataclasses.replace(sw, down=sw.down * (h / k)))
        info["mmd2"] = mmd
    elif method in ("neuron", "random"):
        if method == "neuron":
            xin = None if x is None else _mlp_input(site, x.to(w.up))
            keep = _importance(w, xin).argsort(descending=True)[:k].sort().values
        else:
            keep = torch.randperm(h, generator=gen)[:k].sort().values
        module = DenseMLP.from_weights(w.select(keep))
        info["kept_neurons"] = keep.tolist() if k <= 64 else f"{k} of {h}"
    elif method == "svd":
        info["ranks"] = _svd_(site, k, h)
        module = None
    else:  # magnitude: fuse() zeroes the smallest weights in place (methods/pruning.py); the shape stays
        module = None
    if module is not None:
        module.to(device=w.up.device, dtype=w.up.dtype)
        site.replace_mlp(module)
    return info


# --------------------------------------------------------------------------------------------------
# The whole model


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


def site_params(model: nn.Module, layers: list[int]) -> dict[str, nn.Parameter]:
    """name -> parameter of the MLPs at `layers` (whatever module now computes them)."""
    names = {id(p): n for n, p in model.named_parameters()}
    sites = find_sites(model)
    return {names[id(p)]: p for i in layers for p in sites.mlp[i].parameters()}


def tune_layers(model: nn.Module, capture, layers: list[int], cfg: FusionConfig, progress: bool = True,
                checkpoint_dir=None, settings: dict | None = None, partition: list[int] | None = None) -> dict:
    """Layer-wise task-specific tuning: minimise sum over layers of MSE(compressed MLP sub-block output,
    original output) on the captured original inputs, training only the compressed MLPs' weights. A checkpoint
    made from another model, other layers, settings or data (`settings`: its digest) is refused.

    partition (under torchrun): every rank's layers, in order; this rank tunes `layers`, its share, on its own
    captured rows. Each layer's term of the loss depends on its own MLP alone, so the ranks' sum is one process's
    loss and gradient (mlpsurgery.train.fit, partition); the MSEs reported are the sums over the ranks."""
    from .. import parallel
    from ..files import model_fingerprint

    sites = find_sites(model)
    capture.consolidate()  # its rows once in memory, not once in chunks and once joined
    data = {i: capture.layer(i) for i in layers}
    n = len(next(iter(data.values()))[0])
    batch = min(cfg.tune_batch, n)
    steps = cfg.tune_steps if cfg.tune_steps is not None else math.ceil(n / batch)
    perm = torch.randperm(n, generator=step_rng(cfg.seed, 0, stream=7))
    device = next(model.parameters()).device
    params = site_params(model, layers)  # pruned weights keep their zeros through their masks (modules/masks.py)
    every = site_params(model, partition) if partition is not None else params
    frozen = [p for p in model.parameters() if p.requires_grad and all(p is not q for q in params.values())]
    for p in frozen:
        p.requires_grad_(False)

    def layer_mse(idx: Tensor) -> Tensor:
        total = 0
        for i in layers:
            x, y = data[i]
            xb, yb = x[idx].to(device), y[idx].to(device)
            total = total + (sites.mlp[i].subblock(xb) - (yb - xb)).float().pow(2).mean()
        return total

    def loss_fn(step: int) -> Tensor:
        # one epoch = one pass over a fixed permutation; later epochs draw from step_rng(seed, step)
        start = (step * batch) % n
        idx = perm[start:start + batch] if start + batch <= n else \
            torch.randint(0, n, (batch,), generator=step_rng(cfg.seed, step))
        return layer_mse(idx)

    def total_mse(idx: Tensor) -> float:
        with torch.no_grad():
            mse = layer_mse(idx).detach().double().reshape(1)
        return float(parallel.sum_over_ranks(mse) if partition is not None else mse)

    probe = perm[:min(n, 4096)]
    before = total_mse(probe)
    was = model.training
    model.train()
    try:
        identity = None if checkpoint_dir is None else {
            "model": model_fingerprint(model, skip=every), "layers": partition or layers, "fusion": asdict(cfg),
            **(settings or {})}
        res = fit(params, loss_fn, FitConfig(steps=steps, lr=cfg.tune_lr, seed=cfg.seed, log_every=10),
                  checkpoint_dir=checkpoint_dir, progress=progress, desc="layer-wise tuning", settings=identity,
                  partition=None if partition is None else list(every))
    finally:
        model.train(was)
        for p in frozen:
            p.requires_grad_(True)
    after = total_mse(probe)
    captured = sum(t.numel() * t.element_size() for pair in data.values() for t in pair)
    return {"steps": steps, "tokens": n, "batch_rows": batch, "mse_before": before, "mse_after": after,
            "seconds": res.seconds, "memory": {**res.memory, "captured_bytes": captured}}


def _gather_layers(sites, rows: list[dict], own: list[int]) -> None:
    """Under torchrun: rank 0 takes every other rank's tuned layers (their modules' full state, in place of its own
    untuned copies) and their error measurements into `rows`."""
    from .. import parallel

    mine = {i: ([{k: v.detach().cpu() for k, v in m.state_dict().items()} for m in sites.mlp[i].modules()],
                {k: r[k] for k in ("error_rel", "error_rel_tuned") if k in r})
            for r in rows if (i := r["layer"]) in own}
    got = parallel.gather_to_rank0(mine)
    if got is None:
        return
    by_layer = {r["layer"]: r for r in rows}
    with torch.no_grad():
        for part in got[1:]:
            for i, (states, errors) in part.items():
                for m, state in zip(sites.mlp[i].modules(), states):
                    m.load_state_dict(state)
                by_layer[i].update(errors)


def layers_and_width(sites, cfg: FusionConfig) -> tuple[list[int], int]:
    """The layers cfg chooses and the width k they are compressed to (default a quarter of the narrowest);
    refuses a choice of no layer and a width outside 1..h."""
    layers = parse_layers(cfg.layers, len(sites), DEFAULT_LAYERS)
    if not layers:
        raise MLPSurgeryError(f"layer selection {cfg.layers!r} chose no layer of this {len(sites)}-layer model")
    for i in layers:  # a replaced MLP is compressed from its dense form (fused, nested at its rank); else refused
        if sites.mlp[i].replaced:
            sites.mlp[i].read()
    hs = {sites.mlp[i].h for i in layers}
    k = cfg.width if cfg.width is not None else min(hs) // 4
    bad = sorted(h for h in hs if not 1 <= k <= h)
    if bad:
        raise MLPSurgeryError(f"width {k} is not between 1 and the MLP inner width {bad[0]}; choose a smaller --width")
    return layers, k


def split_share(layers: list[int], tuned: bool) -> list[int]:
    """This rank's share of the compressed `layers` for the layer-wise tuning under torchrun (rank r: layers r, r+N,
    ...; all of them in one process), after refusing a split that cannot be made: no tune data (nothing to split),
    more ranks than layers. `fuse` and `fuse_layerwise` split alike."""
    from .. import parallel

    world = parallel.world()[1]
    if world > 1:
        if not tuned:
            raise MLPSurgeryError("under torchrun `fuse` splits its layer-wise tuning over the ranks by layer: give "
                                  "--tune-data, or run it as one process")
        if len(layers) < world:
            raise MLPSurgeryError(f"{world} ranks for {len(layers)} compressed layers: start at most {len(layers)} "
                                  "processes (torchrun --nproc-per-node)")
    return parallel.share(layers)


def fuse(model: nn.Module, config: FusionConfig | None = None, tune_data: Tensor | None = None,
         progress: bool = True, checkpoint_dir=None) -> dict:
    """Compress the chosen layers' MLPs of `model` in place with config.method; tune them layer-wise on
    `tune_data` ((N, T) token blocks of task text) when given. Returns a report; records the run in the
    model's history (saved by mlpsurgery.save).

    Under torchrun (N ranks, every one holding the same model and data) the layer-wise tuning is split by layer,
    as DLR-Lock's phase 1 is: rank r captures and tunes layers r, r+N, ... of the chosen ones (the captured
    activations, gradients and AdamW moments of its layers only: the tuning's memory), every rank compresses
    every layer as one process does (the same arithmetic, the same random draws), and rank 0 gathers the tuned
    layers and the report; the model on the other ranks is left with only their own layers tuned."""
    from .. import parallel
    from ..files import model_fingerprint

    cfg = config or FusionConfig()
    cfg.validate()
    sites = find_sites(model)
    layers, k = layers_and_width(sites, cfg)
    if cfg.importance == "activation" and cfg.method == "neuron" and tune_data is None:
        raise MLPSurgeryError("importance='activation' scores neurons on text: give tune data (--tune-data)")
    rank, world = parallel.world()
    own = split_share(layers, tune_data is not None)
    digest = None if tune_data is None else hashlib.sha256(tune_data.cpu().numpy().tobytes()).hexdigest()
    if world > 1:
        parallel.same_on_every_rank("models, data or settings",
                                    {"model": model_fingerprint(model), "data": digest, "fusion": asdict(cfg)})
    capture = None
    if tune_data is not None:  # neurons scored by their activations: every layer's inputs, until compressed
        scored = cfg.importance == "activation" and cfg.method == "neuron"
        capture = capture_mlp_io(model, tune_data, layers=layers if scored else own, progress=progress)
    gen = torch.Generator().manual_seed(cfg.seed)
    probes = _ErrorProbes(sites, layers, capture, cfg.seed)
    rows = []
    for i in tqdm(layers, desc=f"{cfg.method}", unit="layer", disable=not progress):
        x = capture.layer(i)[0] if capture is not None and cfg.importance == "activation" else None
        probes.before(i)
        # k-means restarts get their own bar under the layers' bar (seconds each on a real model)
        rows.append(compress_site(sites.mlp[i], k, cfg, gen, x=x, progress=progress))
        if cfg.method == "magnitude":
            rows[-1]["pruning"] = magnitude_prune(model, 1.0 - k / rows[-1]["h"], parts="ffn", layers=[i])
        if i in own:
            rows[-1]["error_rel"] = probes.error(i)
    for r in rows:
        count_after(sites.mlp[r["layer"]], r)
    report = {"method": cfg.method, "width": k, "layers": layers, "config": asdict(cfg), "sites": rows,
              "error_inputs": probes.description}
    if capture is not None:
        capture.keep(own)
        report["tuning"] = tune_layers(model, capture, own, cfg, progress=progress, checkpoint_dir=checkpoint_dir,
                                       settings={"data": digest, "data_shape": list(tune_data.shape)},
                                       partition=layers if world > 1 else None)
        for r in rows:
            if r["layer"] in own:
                r["error_rel_tuned"] = probes.error(r["layer"])
    if world > 1:
        _gather_layers(sites, rows, own)
        report["world_size"] = world
    record(model, "fusion", asdict(cfg), width=k, layers=layers,
           tune_tokens=int(tune_data.numel()) if tune_data is not None else 0)
    return report
