"""TwIST: independent subnetwork training, so that random subnets need no pruning search (papers/twist.txt).

Blocks. In every partitioned layer the attention splits into its KV groups (a group with all of its query
heads; without grouped-query attention a group is one head) and the MLP into R equal chunks of inner
neurons (gate/up rows and down columns together). Embeddings, norms, the LM head, the output projections'
biases and the first `shared_first` / last `shared_last` layers belong to every subnet whole.

Subnet generator (the paper's Algorithm 1, `generate_blueprint`). Per layer and round, S subnets of
N_sub of the N_full blocks: each holds the common set C, every block is held by at least one subnet
(the blocks outside C, in random order, dealt round-robin), the remaining slots are filled at random
without repeats, rows sorted. Possible only when (N_full + (S-1)|C|) / S <= N_sub <= N_full.

Activation shift. A subnet's attention / MLP output is multiplied by sqrt(N_full / N_sub) before the
residual add: a forward hook on the output projection while training, folded into the output
projection's weight and bias at deployment. (Where a norm follows the projection, Gemma 2/3, the norm
absorbs the factor.)

Training, in rounds of `interval` batches (paper: 15): generate blueprints, give worker s its subnet,
train it on shard s of the data, aggregate: an element held by one subnet is copied back, one held by
several (the shared parameters, the common set, blocks dealt twice) becomes their mean (FedAvg).
- masked: one process plays the S workers one after another on the full model, each subnet emulated by
  masking the inputs of the output projections (o_proj: the heads concatenated in head order; down_proj:
  the h inner activations);
- true: one process per worker (torchrun; gloo on CPU, NCCL on GPU). Rank 0 holds the central model; every
  rank, rank 0 included, trains a physically smaller model built by concatenating its blocks. Rank 0
  sends each worker one flat buffer of its blocks and receives it back after the round (one buffer at a
  time, so rank 0 never holds more than one returned subnet): workers hold and send only their subnet;
- hybrid: as true, but rank 0 trains its subnet masked on the central model (no second copy there);
- dp: the baseline, data parallel on the same shards and steps (DDP under torchrun, else one process).
The three TwIST modes compute the same function of (seed, data): masked == true == hybrid up to float
rounding (tested).

Optimiser state rule. Every worker starts every round with a fresh AdamW (zero moments, bias correction
restarted, as in FedAvg local training); moments are never sent nor aggregated. Blocks change owners every
round, so a block's moments would have to travel with it (tripling the traffic) and would describe the
loss of a subnet that no longer exists. A consequence: the state of a run at a round boundary is the
central weights plus the round index, which is what a checkpoint holds. The learning rate is constant
within a round (the schedule, constant by default, is read at the round's first step).

Deployment (`twist_extract`): one random subnet at kappa = X / R (C plus random blocks, seeded, no data),
built as a physically smaller dense model through `mlpsurgery.io.subset_model`, the scale folded in.
For attention, kappa maps to max(1, round(kappa * KV groups)) groups (SmolLM2: 3 groups, so 8/12 and
6/12 keep 2 of 3, 4/12 and 3/12 keep 1 of 3) unless `attn_keep` says otherwise.
"""

from __future__ import annotations

import math
import os
import resource
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from ..errors import MLPSurgeryError
from ..io import history as method_history
from ..io import record, subset_model
from ..sites import AttnWeights, MLPWeights, find_sites
from ..train import FitConfig, fit, load_checkpoint, lr_factor, save_checkpoint, step_rng, trainable

PARTS = ("attn", "ffn", "both")
MODES = ("masked", "true", "hybrid", "dp")

# --------------------------------------------------------------------------------------------------
# Subnet generator (Algorithm 1)


def _check_subnet(n_full: int, n_sub: int, common, what: str) -> None:
    if not 1 <= n_sub <= n_full:
        raise MLPSurgeryError(f"{what}: a subnet keeps N_sub={n_sub} of N_full={n_full}; it must keep between 1 "
                              f"and {n_full}")
    if len(set(common)) > n_sub:
        raise MLPSurgeryError(f"{what}: the common set C has {len(set(common))} blocks, more than a subnet holds "
                              f"(N_sub={n_sub})")
    if any(not 0 <= int(b) < n_full for b in common):
        raise MLPSurgeryError(f"{what}: common blocks {sorted(common)} must lie in 0..{n_full - 1}")


def check_subnet_size(n_full: int, n_sub: int, workers: int, common=(), what: str = "blocks") -> None:
    """The paper's bound (N_full + (S-1)|C|) / S <= N_sub <= N_full, with a message naming the fix."""
    c = len(set(common))
    if workers < 1:
        raise MLPSurgeryError(f"the number of workers S must be at least 1, not {workers}")
    _check_subnet(n_full, n_sub, common, what)
    if n_full + (workers - 1) * c > workers * n_sub:
        need = math.ceil((n_full + (workers - 1) * c) / workers)
        raise MLPSurgeryError(
            f"{what}: S={workers} subnets of N_sub={n_sub} of N_full={n_full} blocks (|C|={c}) cannot cover every "
            f"block: (N_full + (S-1)|C|)/S = {(n_full + (workers - 1) * c) / workers:.2f} > N_sub. Keep at least "
            f"{need} blocks per subnet, use more workers (S >= {math.ceil((n_full - c) / max(n_sub - c, 1e-9))}) "
            "or a smaller common set")


def generate_blueprint(n_full: int, n_sub: int, workers: int, common=(), generator: torch.Generator | None = None
                       ) -> list[list[int]]:
    """Algorithm 1: S sorted rows of N_sub block indices, each holding C, together covering all blocks."""
    check_subnet_size(n_full, n_sub, workers, common)
    common = sorted(set(int(b) for b in common))
    taken = set(common)
    rest = [b for b in range(n_full) if b not in taken]
    rest = [rest[i] for i in torch.randperm(len(rest), generator=generator).tolist()]
    rows = [list(common) for _ in range(workers)]
    for i, b in enumerate(rest):  # every block is assigned
        rows[i % workers].append(b)
    for row in rows:  # every subnet gets N_sub blocks
        taken = set(row)
        pool = [b for b in range(n_full) if b not in taken]
        row += [pool[i] for i in torch.randperm(len(pool), generator=generator)[: n_sub - len(row)].tolist()]
    return [sorted(row) for row in rows]


def deployment_subnet(n_full: int, n_sub: int, common=(), generator: torch.Generator | None = None) -> list[int]:
    """One subnet for deployment: C plus random blocks, sorted (no coverage constraint)."""
    _check_subnet(n_full, n_sub, common, "deployment subnet")
    common = sorted(set(int(b) for b in common))
    taken = set(common)
    rest = [b for b in range(n_full) if b not in taken]
    pick = torch.randperm(len(rest), generator=generator)[: n_sub - len(common)].tolist()
    return sorted(common + [rest[i] for i in pick])


def attn_keep_for(kappa: float, n_kv: int) -> int:
    """KV groups a subnet keeps at subnet ratio kappa: round(kappa * groups), at least 1, halves up."""
    return min(n_kv, max(1, math.floor(kappa * n_kv + 0.5)))


# --------------------------------------------------------------------------------------------------
# Layout: which layers are partitioned, into how many blocks


@dataclass
class Subnet:
    """The blocks one subnet holds in each partitioned layer."""

    attn: dict[int, list[int]] = field(default_factory=dict)  # layer -> KV groups
    mlp: dict[int, list[int]] = field(default_factory=dict)  # layer -> MLP chunks

    def as_dict(self) -> dict:
        """JSON form (layer numbers as strings), as recorded in manifests."""
        return {"attn": {str(k): v for k, v in self.attn.items()}, "mlp": {str(k): v for k, v in self.mlp.items()}}


@dataclass
class Layout:
    """Per partitioned layer: attention N_full / N_sub (KV groups), MLP width h split into R chunks."""

    attn_full: dict[int, int]
    attn_sub: dict[int, int]
    mlp_h: dict[int, int]
    R: int
    ffn_sub: int
    common_attn: tuple[int, ...] = ()
    common_ffn: tuple[int, ...] = ()

    def neurons(self, layer: int, chunks) -> Tensor:
        """Inner-neuron indices of the given MLP chunks of a layer, in chunk order."""
        size = self.mlp_h[layer] // self.R
        c = torch.as_tensor(list(chunks), dtype=torch.long)
        return (c[:, None] * size + torch.arange(size)).reshape(-1)

    def attn_scale(self, layer: int) -> float:
        return math.sqrt(self.attn_full[layer] / self.attn_sub[layer])

    def mlp_scale(self) -> float:
        return math.sqrt(self.R / self.ffn_sub)

    def check(self, workers: int) -> None:
        for i in self.attn_full:
            check_subnet_size(self.attn_full[i], self.attn_sub[i], workers, self.common_attn,
                              what=f"attention KV groups (layer {i})")
        if self.mlp_h:
            check_subnet_size(self.R, self.ffn_sub, workers, self.common_ffn, what="MLP chunks")

    def blueprint(self, workers: int, generator: torch.Generator) -> list[Subnet]:
        """One round's S subnets (Algorithm 1 for every partitioned layer and part)."""
        subnets = [Subnet() for _ in range(workers)]
        for i in sorted(self.attn_full):
            for s, row in enumerate(generate_blueprint(self.attn_full[i], self.attn_sub[i], workers,
                                                       self.common_attn, generator)):
                subnets[s].attn[i] = row
        for i in sorted(self.mlp_h):
            for s, row in enumerate(generate_blueprint(self.R, self.ffn_sub, workers, self.common_ffn, generator)):
                subnets[s].mlp[i] = row
        return subnets

    def deployment(self, generator: torch.Generator) -> Subnet:
        return Subnet(attn={i: deployment_subnet(self.attn_full[i], self.attn_sub[i], self.common_attn, generator)
                            for i in sorted(self.attn_full)},
                      mlp={i: deployment_subnet(self.R, self.ffn_sub, self.common_ffn, generator)
                           for i in sorted(self.mlp_h)})

    def subset_args(self, subnet: Subnet) -> tuple[dict[int, list[int]], dict[int, list[int]]]:
        """(KV groups per layer, inner neurons per layer) for `mlpsurgery.io.subset_model`."""
        return dict(subnet.attn), {i: self.neurons(i, c).tolist() for i, c in subnet.mlp.items()}


def make_layout(model: nn.Module, parts: str, layers, blocks: int, keep: int, attn_keep: int | None = None,
                common_attn=(), common_ffn=()) -> Layout:
    """The layout of `parts` in `layers`: MLPs in `blocks` (R) chunks of which a subnet keeps `keep` (X);
    attention in KV groups of which it keeps `attn_keep` (default: attn_keep_for(X / R, groups))."""
    if parts not in PARTS:
        raise MLPSurgeryError(f"parts must be one of {', '.join(PARTS)}, not {parts!r}")
    sites = find_sites(model)
    layers = sorted(set(int(i) for i in layers))
    if not layers:
        raise MLPSurgeryError(f"no layer is partitioned: the model has {len(sites)} layers; share fewer first / last "
                              "layers (--shared-first / --shared-last)")
    if any(not 0 <= i < len(sites) for i in layers):
        raise MLPSurgeryError(f"layers {layers} do not all exist; the model has layers 0-{len(sites) - 1}")
    if not 1 <= keep <= blocks:
        raise MLPSurgeryError(f"keep X={keep} must lie in 1..R={blocks} (kappa = X / R)")
    attn_full, attn_sub, mlp_h = {}, {}, {}
    if parts in ("attn", "both"):
        for i in layers:
            n_kv = sites.attn[i].n_kv
            k = attn_keep if attn_keep is not None else attn_keep_for(keep / blocks, n_kv)
            if not 1 <= k <= n_kv:
                raise MLPSurgeryError(f"layer {i} has {n_kv} KV groups; a subnet cannot keep {k}")
            attn_full[i], attn_sub[i] = n_kv, k
    if parts in ("ffn", "both"):
        for i in layers:
            h = sites.mlp[i].h
            if h % blocks:
                divisors = [r for r in range(2, 65) if h % r == 0]
                raise MLPSurgeryError(f"layer {i}: MLP width {h} does not split into R={blocks} equal chunks; choose R "
                                      f"among {divisors}")
            mlp_h[i] = h
    for i in attn_full:
        _check_subnet(attn_full[i], attn_sub[i], common_attn, f"attention KV groups (layer {i})")
    if mlp_h:
        _check_subnet(blocks, keep, common_ffn, "MLP chunks")
    return Layout(attn_full, attn_sub, mlp_h, blocks, keep, tuple(int(b) for b in common_attn),
                  tuple(int(b) for b in common_ffn))


# --------------------------------------------------------------------------------------------------
# Hooks: masks (emulated subnets) and the activation-shift scale


class Hooks:
    """Forward hooks installed together, removed together (also as a context manager)."""

    def __init__(self):
        self.handles = []

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    def __enter__(self) -> "Hooks":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def attn_feature_blocks(site) -> Tensor:
    """For each input feature of the attention output projection (heads concatenated), its KV group."""
    return torch.arange(site.n_heads * site.head_dim) // (site.head_dim * (site.n_heads // site.n_kv))


def mlp_feature_blocks(h: int, R: int) -> Tensor:
    """For each of the h inner activations (the down projection's input), its chunk."""
    return torch.arange(h) // (h // R)


def gate_inputs(module: nn.Module, gate: Callable[[], Tensor]):
    """Multiply the module's input features (last dimension) by gate(); returns the hook handle."""
    def hook(mod, args):
        return (args[0] * gate().to(args[0].dtype), *args[1:])
    return module.register_forward_pre_hook(hook)


def scale_outputs(module: nn.Module, factor: float):
    def hook(mod, args, out):
        return out * factor
    return module.register_forward_hook(hook)


def subnet_hooks(model: nn.Module, layout: Layout, subnet: Subnet | None = None, scale: bool = True) -> Hooks:
    """Hooks making `model` compute a subnet: with `subnet`, the full model is masked to its blocks; without,
    the model is taken to be physically that subnet already. `scale` adds the sqrt(N_full/N_sub) factor."""
    sites = find_sites(model)
    hooks = Hooks()
    for i in sorted(layout.attn_full):
        o = sites.attn[i].o_proj
        if subnet is not None:
            blocks = attn_feature_blocks(sites.attn[i])
            mask = torch.isin(blocks, torch.tensor(subnet.attn[i])).to(o.weight.device, torch.float32)
            hooks.handles.append(gate_inputs(o, lambda m=mask: m))
        if scale and layout.attn_sub[i] != layout.attn_full[i]:
            hooks.handles.append(scale_outputs(o, layout.attn_scale(i)))
    for i in sorted(layout.mlp_h):
        down = sites.mlp[i].down_proj
        if subnet is not None:
            blocks = mlp_feature_blocks(layout.mlp_h[i], layout.R)
            mask = torch.isin(blocks, torch.tensor(subnet.mlp[i])).to(down.weight.device, torch.float32)
            hooks.handles.append(gate_inputs(down, lambda m=mask: m))
        if scale and layout.ffn_sub != layout.R:
            hooks.handles.append(scale_outputs(down, layout.mlp_scale()))
    return hooks


# --------------------------------------------------------------------------------------------------
# Moving weights between the central model and subnets


def _params(model: nn.Module) -> dict[str, nn.Parameter]:
    """name -> parameter, tied parameters once, in module order (the flat-buffer order)."""
    out, seen = {}, set()
    for name, p in model.named_parameters():
        if id(p) not in seen:
            seen.add(id(p))
            out[name] = p
    return out


def shared_parameters(model: nn.Module, layout: Layout) -> dict[str, nn.Parameter]:
    """Parameters every subnet holds whole: all but the projections of the partitioned attention / MLPs."""
    sites = find_sites(model)
    split = {id(p) for i in layout.attn_full for p in sites.attn[i].parameters()}
    split |= {id(p) for i in layout.mlp_h for p in sites.mlp[i].parameters()}
    return {n: p for n, p in _params(model).items() if id(p) not in split}


def fill_subnet(sub: nn.Module, central: nn.Module, layout: Layout, subnet: Subnet) -> None:
    """Write the blocks of `subnet` (and the shared parameters) of `central` into the physically smaller `sub`."""
    src = _params(central)
    with torch.no_grad():
        for name, p in shared_parameters(sub, layout).items():
            p.copy_(src[name])
    cs, ss = find_sites(central), find_sites(sub)
    for i, g in subnet.attn.items():
        ss.attn[i].write(cs.attn[i].read().select_groups(g))
    for i, c in subnet.mlp.items():
        ss.mlp[i].write(cs.mlp[i].read().select(layout.neurons(i, c)))


def flatten(model: nn.Module) -> Tensor:
    return torch.cat([p.detach().reshape(-1) for p in _params(model).values()])


def unflatten(model: nn.Module, flat: Tensor) -> None:
    at = 0
    with torch.no_grad():
        for p in _params(model).values():
            p.copy_(flat[at:at + p.numel()].view_as(p))
            at += p.numel()
    if at != flat.numel():
        raise MLPSurgeryError(f"a subnet buffer of {flat.numel()} values does not fit a model of {at} parameters")


class Aggregator:
    """FedAvg over the round's subnets (paper §3.3): every element of the central model becomes the mean of
    the values returned by the subnets that held it; a block held by one subnet is copied back."""

    def __init__(self, central: nn.Module, layout: Layout):
        self.central, self.layout = central, layout
        self.sites = find_sites(central)

        def zeros(t):
            return torch.zeros_like(t, dtype=torch.float32)

        self.shared = {n: zeros(p) for n, p in shared_parameters(central, layout).items()}
        self.attn = {i: self.sites.attn[i].read().map(zeros) for i in layout.attn_full}
        self.attn_n = {i: torch.zeros(n, device=self.attn[i].q.device) for i, n in layout.attn_full.items()}
        self.mlp = {i: self.sites.mlp[i].read().map(zeros) for i in layout.mlp_h}
        self.mlp_n = {i: torch.zeros(h, device=self.mlp[i].up.device) for i, h in layout.mlp_h.items()}
        self.n = 0

    def add(self, model: nn.Module, subnet: Subnet, full: bool) -> None:
        """Add one trained subnet: `model` is the full model masked to it (full=True) or the subnet itself."""
        params = _params(model)
        with torch.no_grad():
            for name, acc in self.shared.items():
                acc += params[name]
            sites = find_sites(model)
            for i, g in subnet.attn.items():
                w, acc = sites.attn[i].read(), self.attn[i]
                if full:
                    w = w.select_groups(g)
                gi = torch.tensor(g, device=acc.q.device)
                heads = acc.heads_of_groups(gi.cpu()).to(acc.q.device)
                acc.q[heads] += w.q
                acc.k[gi] += w.k
                acc.v[gi] += w.v
                acc.o[:, heads] += w.o
                for name, idx in (("q_bias", heads), ("k_bias", gi), ("v_bias", gi)):
                    if getattr(acc, name) is not None:
                        getattr(acc, name)[idx] += getattr(w, name)
                if acc.o_bias is not None:
                    acc.o_bias += w.o_bias
                self.attn_n[i][gi] += 1
            for i, c in subnet.mlp.items():
                idx = self.layout.neurons(i, c).to(self.mlp[i].up.device)
                w, acc = sites.mlp[i].read(), self.mlp[i]
                if full:
                    w = w.select(idx)
                acc.up[idx] += w.up
                acc.down[:, idx] += w.down
                for name in ("gate", "up_bias", "gate_bias"):
                    if getattr(acc, name) is not None:
                        getattr(acc, name)[idx] += getattr(w, name)
                if acc.down_bias is not None:
                    acc.down_bias += w.down_bias
                self.mlp_n[i][idx] += 1
        self.n += 1

    def write(self) -> None:
        """Replace the central model's weights by the means."""
        params = _params(self.central)

        def div(t, n):  # an optional tensor (a bias) divided by its count
            return None if t is None else t / n

        with torch.no_grad():
            for name, acc in self.shared.items():
                params[name].copy_(acc / self.n)
        for i, acc in self.attn.items():
            per_group = self.attn_n[i]
            if (per_group == 0).any():
                missing = per_group.eq(0).nonzero().flatten().tolist()
                raise AssertionError(f"layer {i}: KV groups {missing} held by no subnet")
            per_head = per_group.repeat_interleave(acc.group_size)
            self.sites.attn[i].write(AttnWeights(
                q=acc.q / per_head[:, None, None], k=acc.k / per_group[:, None, None],
                v=acc.v / per_group[:, None, None], o=acc.o / per_head[None, :, None],
                q_bias=div(acc.q_bias, per_head[:, None]), k_bias=div(acc.k_bias, per_group[:, None]),
                v_bias=div(acc.v_bias, per_group[:, None]), o_bias=div(acc.o_bias, self.n)))
        for i, acc in self.mlp.items():
            n = self.mlp_n[i]
            if (n == 0).any():
                raise AssertionError(f"layer {i}: MLP neurons held by no subnet")
            self.sites.mlp[i].write(MLPWeights(
                up=acc.up / n[:, None], down=acc.down / n[None, :], gate=div(acc.gate, n[:, None]),
                up_bias=div(acc.up_bias, n), gate_bias=div(acc.gate_bias, n), down_bias=div(acc.down_bias, self.n),
                activation=acc.activation))


# --------------------------------------------------------------------------------------------------
# Configuration and data


@dataclass
class TwISTConfig:
    """TwIST training settings (paper §5 defaults where it gives them)."""

    workers: int = 4  # S: subnets per round (one process each in true / hybrid mode)
    blocks: int = 12  # R: MLP chunks per layer
    keep: int = 6  # X: MLP chunks a subnet holds (N_sub); kappa = X / R
    attn_keep: int | None = None  # KV groups a subnet holds; None: attn_keep_for(kappa, groups)
    parts: str = "both"  # which blocks are split: attn | ffn | both
    shared_first: int = 2  # first layers every subnet holds whole
    shared_last: int = 2  # last layers every subnet holds whole
    common_attn: list[int] = field(default_factory=list)  # C for the KV groups (paper: empty)
    common_ffn: list[int] = field(default_factory=list)  # C for the MLP chunks (paper: empty)
    interval: int = 15  # repartition interval: local batches per round
    steps: int = 150  # local batches per worker over the whole run
    batch_size: int = 2  # blocks per local batch
    lr: float = 1e-4  # AdamW (paper: Adam, 1e-4)
    weight_decay: float = 0.0
    clip: float | None = 1.0  # gradient-norm clip per worker step; None disables
    warmup: float = 0.0  # fraction of steps of linear warm-up (read at round starts)
    schedule: str = "constant"  # constant | cosine (read at round starts)
    seed: int = 0  # blueprints, batches and dropout all derive from it

    def layers(self, n_layers: int) -> list[int]:
        return list(range(self.shared_first, n_layers - self.shared_last))

    def layout(self, model: nn.Module) -> Layout:
        if self.shared_first < 0 or self.shared_last < 0:
            raise MLPSurgeryError("shared_first / shared_last count layers; they cannot be negative")
        return make_layout(model, self.parts, self.layers(len(find_sites(model))), self.blocks, self.keep,
                           self.attn_keep, self.common_attn, self.common_ffn)

    @property
    def rounds(self) -> int:
        return math.ceil(self.steps / self.interval)

    def validate(self) -> None:
        if self.interval < 1 or self.steps < 1 or self.batch_size < 1:
            raise MLPSurgeryError("interval, steps and batch_size must be positive")
        if self.schedule not in ("constant", "cosine"):
            raise MLPSurgeryError(f"schedule must be constant or cosine, not {self.schedule!r}")


def make_shards(blocks: Tensor, workers: int) -> list[Tensor]:
    """Worker s trains on blocks s, s+S, s+2S, ... (disjoint shards)."""
    if blocks.dim() != 2 or len(blocks) < workers:
        raise MLPSurgeryError(f"training needs at least one token block per worker ({workers}); got "
                              f"{tuple(blocks.shape)}: give more text or a smaller --block-len")
    return [blocks[s::workers] for s in range(workers)]


def _batch(shard: Tensor, cfg: TwISTConfig, step: int, worker: int) -> Tensor:
    idx = torch.randint(0, len(shard), (cfg.batch_size,), generator=step_rng(cfg.seed, step, stream=1 + worker))
    return shard[idx]


def _round_generator(seed: int, r: int) -> torch.Generator:
    return step_rng(seed, r, stream=7919)


def _round_lr(cfg: TwISTConfig, r: int) -> float:
    sched = FitConfig(steps=cfg.steps, lr=cfg.lr, warmup=cfg.warmup, schedule=cfg.schedule)
    return cfg.lr * lr_factor(sched, r * cfg.interval)


def _local_train(model: nn.Module, shard: Tensor, cfg: TwISTConfig, r: int, worker: int) -> list[float]:
    """Worker `worker`'s batches of round r on `model` (hooks already installed): a fresh AdamW (the rule)."""
    first = r * cfg.interval
    n = min(cfg.interval, cfg.steps - first)
    torch.manual_seed(step_rng(cfg.seed, r, stream=104729 + worker).initial_seed())  # dropout
    device = next(model.parameters()).device
    fc = FitConfig(steps=n, lr=_round_lr(cfg, r), weight_decay=cfg.weight_decay, warmup=0.0, schedule="constant",
                   clip=cfg.clip, seed=cfg.seed)

    def loss_fn(t: int) -> Tensor:
        batch = _batch(shard, cfg, first + t, worker).to(device)
        return model(input_ids=batch, labels=batch, use_cache=False).loss

    model.train()
    res = fit(trainable(model), loss_fn, fc, progress=False, desc=f"worker {worker} round {r + 1}")
    return [h["loss"] for h in res.history]


# --------------------------------------------------------------------------------------------------
# torch.distributed plumbing


class Comm:
    """The collective calls TwIST makes, counting the payload bytes this rank sends and receives."""

    def __init__(self, device: torch.device):
        import torch.distributed as dist

        self.dist = dist
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = device
        self.sent = self.received = 0

    @staticmethod
    def _bytes(t: Tensor) -> int:
        return t.numel() * t.element_size()

    def send(self, t: Tensor, dst: int) -> None:
        self.dist.send(t, dst=dst)
        self.sent += self._bytes(t)

    def recv(self, out: Tensor, src: int) -> Tensor:
        self.dist.recv(out, src=src)
        self.received += self._bytes(out)
        return out

    def gather(self, t: Tensor) -> list[Tensor] | None:
        bufs = [torch.empty_like(t) for _ in range(self.world)] if self.rank == 0 else None
        self.dist.gather(t, bufs, dst=0)
        if self.rank == 0:
            self.received += self._bytes(t) * (self.world - 1)
        else:
            self.sent += self._bytes(t)
        return bufs

    def broadcast_object(self, obj=None):
        box = [obj]
        self.dist.broadcast_object_list(box, src=0, device=self.device if self.device.type == "cuda" else None)
        return box[0]

    def send_blocks(self, shards: list[Tensor]) -> Tensor:
        """Rank 0 sends worker s its data shard once; returns this rank's shard."""
        if self.rank == 0:
            for s in range(1, self.world):
                shape = torch.tensor(shards[s].shape, dtype=torch.long, device=self.device)
                self.dist.send(shape, dst=s)
                self.dist.send(shards[s].contiguous().to(self.device), dst=s)
            return shards[0]
        shape = torch.empty(2, dtype=torch.long, device=self.device)
        self.dist.recv(shape, src=0)
        out = torch.empty(*shape.tolist(), dtype=torch.long, device=self.device)
        self.dist.recv(out, src=0)
        return out.cpu()


def init_distributed(device: str | torch.device = "cpu") -> tuple[int, int]:
    """Join the process group torchrun describes (gloo on CPU, NCCL on CUDA); (rank, world size)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return 0, 1
    backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
    dist.init_process_group(backend=backend)
    return dist.get_rank(), dist.get_world_size()


def _distributed() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _structure(model: nn.Module) -> dict:
    """What another rank needs to build an empty copy of `model` (no weights; buffers such as RoPE tables)."""
    from ..io import replaced_modules

    return {"config": model.config.to_dict(), "class": type(model).__name__, "modules": replaced_modules(model),
            "shapes": [(n, list(p.shape)) for n, p in _params(model).items()],
            "buffers": {n: b.detach().cpu() for n, b in model.named_buffers()}}


def _build(structure: dict, device: torch.device) -> nn.Module:
    """The model `_structure` describes, allocated once at its own size (built on the meta device, so a worker
    never holds the full model even for a moment); parameters uninitialised until rank 0 sends them."""
    import transformers

    from ..io import rebuild

    cfg = dict(structure["config"])
    config = transformers.CONFIG_MAPPING[cfg["model_type"]].from_dict(cfg)
    with torch.device("meta"):
        model = rebuild(config, structure["class"], structure["modules"])
    model = model.to_empty(device=device)
    model.tie_weights()  # to_empty gives tied parameters separate storage
    with torch.no_grad():
        for name, buf in model.named_buffers():
            buf.copy_(structure["buffers"][name])
    shapes = [[n, list(p.shape)] for n, p in _params(model).items()]
    if shapes != [[n, list(s)] for n, s in structure["shapes"]]:
        raise MLPSurgeryError("the rebuilt subnet does not match rank 0's: the ranks run different mlpsurgery or "
                              "transformers versions")
    return model


def _rank_stats(models: list[nn.Module], comm: Comm | None, trained: nn.Module, train_s: float, batches: int
                ) -> dict:
    held = {id(p): p for m in models for p in m.parameters()}
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    return {"held_params": sum(p.numel() for p in held.values()),
            "held_bytes": sum(p.numel() * p.element_size() for p in held.values()),
            # AdamW keeps two moments of every trained parameter
            "optimizer_bytes": 2 * sum(p.numel() * p.element_size() for p in trainable(trained).values()),
            "peak_rss_bytes": peak, "sent_bytes": comm.sent if comm else 0,
            "received_bytes": comm.received if comm else 0, "train_seconds": train_s, "batches": batches}


# --------------------------------------------------------------------------------------------------
# Training


@dataclass
class TwISTResult:
    mode: str
    history: list[dict]  # per round: round, step, loss, worker_loss, lr, seconds, time_s
    rounds: int
    steps: int  # local batches per worker
    resumed_from: int  # round the run resumed at (0: fresh)
    seconds: float
    ranks: list[dict]  # per rank: held params / bytes, optimizer bytes, peak RSS, bytes sent / received, time

    def as_dict(self) -> dict:
        return asdict(self)


def _check_lm(model: nn.Module) -> None:
    from ..measure.perplexity import is_causal_lm

    if not is_causal_lm(model):
        raise MLPSurgeryError(f"TwIST training here trains causal language models; {type(model).__name__} is not one")


def twist_train(model: nn.Module | None, blocks: Tensor | None, cfg: TwISTConfig, mode: str = "masked",
                checkpoint_dir: str | Path | None = None, progress: bool = True,
                callback: Callable[[dict], None] | None = None) -> TwISTResult:
    """Train `model` (in place) with TwIST on token `blocks` (N, T), or with the data-parallel baseline.

    mode: masked (one process), true / hybrid (one process per worker, under torchrun: call on every rank;
    ranks other than 0 pass model=None, blocks=None and receive what they need), dp (DDP under torchrun,
    else one process). checkpoint_dir: the run is saved there after every round and resumes from it.
    callback(record) runs on rank 0 after each round (after the checkpoint).
    """
    if mode not in MODES:
        raise MLPSurgeryError(f"mode must be one of {', '.join(MODES)}, not {mode!r}")
    cfg.validate()
    rank, world = _distributed()
    if mode in ("true", "hybrid") and world == 1:
        raise MLPSurgeryError(f"{mode} TwIST runs one process per worker: launch it with `torchrun --nproc-per-node "
                              f"{cfg.workers} -m mlpsurgery twist train ... --mode {mode}` (or initialise "
                              "torch.distributed first); `--mode masked` runs in one process")
    if mode == "masked" and world > 1:
        raise MLPSurgeryError("masked TwIST emulates every worker in one process; run it without torchrun, or use "
                              "--mode true / hybrid")
    if world > 1 and world != cfg.workers:
        raise MLPSurgeryError(f"{world} processes were started for S={cfg.workers} workers; start "
                              f"--nproc-per-node {cfg.workers} or pass --workers {world}")
    if rank == 0:
        if model is None or blocks is None:
            raise MLPSurgeryError("rank 0 needs the model and the token blocks")
        _check_lm(model)
    if mode == "dp":
        return _train_dp(model, blocks, cfg, checkpoint_dir, progress, callback)
    return _train_twist(model, blocks, cfg, mode, checkpoint_dir, progress, callback)


def _resume(model: nn.Module, cfg: TwISTConfig, ckpt: Path | None) -> tuple[int, list[dict], float]:
    state = load_checkpoint(ckpt) if ckpt else None
    if state is None:
        return 0, [], 0.0
    if state.get("config") != asdict(cfg):
        raise MLPSurgeryError(f"checkpoint {ckpt} belongs to a run with other settings ({state.get('config')}); "
                              "resume with the same settings or delete it")
    params = _params(model)
    with torch.no_grad():
        for n, t in state["params"].items():
            params[n].copy_(t)
    return state["round"], state["history"], state["seconds"]


class _Run:
    """One rank's part of a TwIST run: what every round needs, and the rounds of each mode."""

    def __init__(self, model, blocks, cfg: TwISTConfig, mode: str, checkpoint_dir):
        self.rank, self.world = _distributed()
        self.model, self.cfg, self.mode, self.S = model, cfg, mode, cfg.workers
        self.ckpt = Path(checkpoint_dir) if checkpoint_dir else None
        self.comm = self.sub = None
        self.train_s, self.batches = 0.0, 0
        if self.rank == 0:
            self.device = next(model.parameters()).device
            self.layout = cfg.layout(model)
            self.layout.check(self.S)
            self.shards = make_shards(blocks, self.S)
            self.start, self.history, self.elapsed = _resume(model, cfg, self.ckpt)
        else:
            nccl = torch.cuda.is_available() and torch.distributed.get_backend() == "nccl"
            self.device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', self.rank))}" if nccl else "cpu")
            self.start, self.history, self.elapsed = 0, [], 0.0
        if self.world > 1:
            self.comm = Comm(self.device)
            if self.rank == 0:
                # every subnet has the same shapes: any one is the skeleton each rank trains in
                first = self.layout.blueprint(self.S, _round_generator(cfg.seed, 0))[0]
                self.sub = subset_model(model, *self.layout.subset_args(first))
                self.comm.broadcast_object({"structure": _structure(self.sub), "layout": asdict(self.layout),
                                            "start": self.start})
            else:
                info = self.comm.broadcast_object()
                self.sub = _build(info["structure"], self.device)
                self.layout, self.start = Layout(**info["layout"]), info["start"]
            self.shard = self.comm.send_blocks(self.shards if self.rank == 0 else None)
            self.numel = sum(p.numel() for p in _params(self.sub).values())
            self.dtype = next(self.sub.parameters()).dtype
        self.trains_sub = self.sub is not None and (mode == "true" or self.rank > 0)
        if self.trains_sub:
            subnet_hooks(self.sub, self.layout)  # the scale, for the whole run

    def _train(self, model, shard, r: int, worker: int) -> list[float]:
        t = time.perf_counter()
        losses = _local_train(model, shard, self.cfg, r, worker)
        self.train_s += time.perf_counter() - t
        self.batches += len(losses)
        return losses

    def masked_round(self, r: int, subnets: list[Subnet]) -> list[list[float]]:
        """The S workers one after another on the full model, each from the round's starting weights."""
        params = _params(self.model)
        theta = {n: p.detach().clone() for n, p in params.items()}
        agg = Aggregator(self.model, self.layout)
        losses = []
        for s in range(self.S):
            if s:
                with torch.no_grad():
                    for n, p in params.items():
                        p.copy_(theta[n])
            with subnet_hooks(self.model, self.layout, subnets[s]):
                losses.append(self._train(self.model, self.shards[s], r, s))
            agg.add(self.model, subnets[s], full=True)
        del theta
        agg.write()
        return losses

    def distributed_round(self, r: int, subnets: list[Subnet] | None) -> list[list[float]] | None:
        """Send every worker its blocks, train, receive them back, aggregate (true / hybrid; rank 0 returns the
        losses of all workers, the others None)."""
        comm, sub, layout = self.comm, self.sub, self.layout
        if self.rank == 0:  # one flat buffer of concatenated blocks per worker, built and sent one at a time
            for s in range(1, self.S):
                fill_subnet(sub, self.model, layout, subnets[s])
                comm.send(flatten(sub), s)
            if self.trains_sub:
                fill_subnet(sub, self.model, layout, subnets[0])
        else:
            unflatten(sub, comm.recv(torch.empty(self.numel, dtype=self.dtype, device=self.device), 0))
        if self.trains_sub:
            mine = self._train(sub, self.shard, r, self.rank)
        else:  # hybrid: rank 0 trains its subnet masked on the central model
            with subnet_hooks(self.model, layout, subnets[0]):
                mine = self._train(self.model, self.shard, r, 0)
        pad = torch.full((self.cfg.interval,), float("nan"), device=self.device)
        pad[:len(mine)] = torch.tensor(mine, device=self.device)
        all_losses = comm.gather(pad)
        if self.rank != 0:
            comm.send(flatten(sub), 0)
            return None
        agg = Aggregator(self.model, layout)
        if self.trains_sub:
            agg.add(sub, subnets[0], full=False)
        else:
            agg.add(self.model, subnets[0], full=True)
        flat = torch.empty(self.numel, dtype=self.dtype, device=self.device)
        for s in range(1, self.S):  # rank 0 holds one returned subnet at a time
            unflatten(sub, comm.recv(flat, s))
            agg.add(sub, subnets[s], full=False)
        agg.write()
        return [[v for v in row.tolist() if not math.isnan(v)] for row in all_losses]

    def log(self, r: int, losses: list[list[float]], started: float, t0: float) -> dict:
        """Rank 0: the round's record, and the checkpoint of the whole run."""
        flat = [v for row in losses for v in row]
        rec = {"round": r + 1, "step": r * self.cfg.interval + len(losses[0]), "loss": sum(flat) / len(flat),
               "worker_loss": [sum(row) / len(row) for row in losses], "lr": _round_lr(self.cfg, r),
               "seconds": time.perf_counter() - started, "time_s": time.perf_counter() - t0}
        self.history.append(rec)
        if self.ckpt is not None:
            save_checkpoint(self.ckpt, {"config": asdict(self.cfg), "round": r + 1, "history": self.history,
                                        "seconds": time.perf_counter() - t0,
                                        "params": {n: p.detach() for n, p in _params(self.model).items()}})
        return rec

    def rank_stats(self) -> list[dict]:
        held = [m for m in (self.model, self.sub) if m is not None]
        stats = _rank_stats(held, self.comm, self.sub if self.trains_sub else self.model, self.train_s,
                            self.batches)
        stats["rank"] = self.rank
        if self.world == 1:
            return [stats]
        ranks = [None] * self.world if self.rank == 0 else None
        torch.distributed.gather_object(stats, ranks, dst=0)
        return ranks or []


def _train_twist(model, blocks, cfg, mode, checkpoint_dir, progress, callback) -> TwISTResult:
    run = _Run(model, blocks, cfg, mode, checkpoint_dir)
    t0 = time.perf_counter() - run.elapsed
    bar = tqdm(total=cfg.rounds, initial=run.start, desc=f"twist {mode}", unit="round",
               disable=not progress or run.rank != 0)
    for r in range(run.start, cfg.rounds):
        started = time.perf_counter()
        subnets = run.layout.blueprint(cfg.workers, _round_generator(cfg.seed, r)) if run.rank == 0 else None
        losses = run.masked_round(r, subnets) if mode == "masked" else run.distributed_round(r, subnets)
        if run.rank == 0:
            rec = run.log(r, losses, started, t0)
            bar.update(1)
            bar.set_postfix(loss=f"{rec['loss']:.4g}")
            if callback is not None:
                callback(rec)
    bar.close()
    ranks = run.rank_stats()
    if run.rank == 0:
        record(model, "twist", asdict(cfg), mode=mode, rounds=cfg.rounds, data_blocks=list(blocks.shape),
               layers=sorted(set(run.layout.attn_full) | set(run.layout.mlp_h)))
    return TwISTResult(mode=mode, history=run.history, rounds=cfg.rounds, steps=cfg.steps, resumed_from=run.start,
                       seconds=time.perf_counter() - t0, ranks=ranks)


def _rounds_of(fit_history: list[dict], cfg: TwISTConfig) -> list[dict]:
    """Per-step history of a data-parallel run, summarised per repartition interval (for side-by-side plots)."""
    out = []
    for r in range(0, len(fit_history), cfg.interval):
        chunk = fit_history[r:r + cfg.interval]
        out.append({"round": r // cfg.interval + 1, "step": chunk[-1]["step"],
                    "loss": sum(h["loss"] for h in chunk) / len(chunk), "lr": chunk[0]["lr"],
                    "time_s": chunk[-1]["time_s"]})
    return out


def _counting_allreduce(state: dict, bucket):
    """DDP communication hook: all-reduce each gradient bucket as DDP does by default, counting its bytes."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    buf = bucket.buffer()
    state["bytes"] += buf.numel() * buf.element_size()
    return allreduce_hook(None, bucket)


def _train_dp(model, blocks, cfg, checkpoint_dir, progress, callback) -> TwISTResult:
    """The baseline: the full model, data parallel over the same S shards and steps (batch = S x batch_size)."""
    rank, world = _distributed()
    S = cfg.workers
    fc = FitConfig(steps=cfg.steps, lr=cfg.lr, weight_decay=cfg.weight_decay, warmup=cfg.warmup,
                   schedule=cfg.schedule, clip=cfg.clip, seed=cfg.seed, log_every=cfg.interval,
                   checkpoint_every=cfg.interval)
    ckpt = Path(checkpoint_dir) if checkpoint_dir else None
    if world == 1:
        shards = make_shards(blocks, S)
        device = next(model.parameters()).device

        def loss_fn(t: int) -> Tensor:
            batch = torch.cat([_batch(shards[s], cfg, t, s) for s in range(S)]).to(device)
            return model(input_ids=batch, labels=batch, use_cache=False).loss

        model.train()
        res = fit(trainable(model), loss_fn, fc, checkpoint_dir=ckpt, progress=progress, desc="data parallel")
        stats = _rank_stats([model], None, model, res.seconds, cfg.steps * S)
        ranks = [dict(stats, rank=0)]
    else:
        from torch.nn.parallel import DistributedDataParallel

        if rank == 0:
            device = next(model.parameters()).device
            comm = Comm(device)
            comm.broadcast_object(_structure(model))
            shard = comm.send_blocks(make_shards(blocks, S))
        else:
            device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', rank))}") if \
                torch.distributed.get_backend() == "nccl" else torch.device("cpu")
            comm = Comm(device)
            model = _build(comm.broadcast_object(), device)
            shard = comm.send_blocks(None)
        model.train()
        ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
        counter = {"bytes": 0}
        ddp.register_comm_hook(counter, _counting_allreduce)

        def loss_fn(t: int) -> Tensor:
            batch = _batch(shard, cfg, t, rank).to(device)
            return ddp(input_ids=batch, labels=batch, use_cache=False).loss

        res = fit(trainable(model), loss_fn, fc, checkpoint_dir=ckpt / f"rank{rank}" if ckpt else None,
                  progress=progress and rank == 0, desc="DDP")
        stats = _rank_stats([model], comm, model, res.seconds, cfg.steps)
        # ring all-reduce: each rank sends and receives 2(S-1)/S of every bucket
        ring = 2 * (world - 1) / world
        stats.update(rank=rank, allreduce_payload_bytes=counter["bytes"],
                     sent_bytes=comm.sent + int(ring * counter["bytes"]),
                     received_bytes=comm.received + int(ring * counter["bytes"]))
        ranks = [None] * world if rank == 0 else None
        torch.distributed.gather_object(stats, ranks, dst=0)
    history = _rounds_of(res.history, cfg)
    if rank == 0:
        if callback is not None:
            for rec in history:
                callback(rec)
        record(model, "data-parallel", asdict(cfg), workers=S, steps=cfg.steps, data_blocks=list(blocks.shape))
    return TwISTResult(mode="dp", history=history, rounds=cfg.rounds, steps=cfg.steps,
                       resumed_from=res.resumed_from // cfg.interval, seconds=res.seconds, ranks=ranks or [])


# --------------------------------------------------------------------------------------------------
# Deployment


def trained_settings(model: nn.Module) -> dict:
    """The TwIST / data-parallel settings recorded in the model's history (the last run), or {}."""
    for entry in reversed(method_history(model)):
        if entry.get("method") in ("twist", "data-parallel"):
            return dict(entry.get("config", {}))
    return {}


def _scale_output(site, weight: str, bias: str, f: float) -> None:
    """Multiply a site's output projection (`weight` and `bias` of its canonical weights) by f, in place."""
    if f == 1.0:
        return
    w = site.read()
    getattr(w, weight).mul_(f)
    if getattr(w, bias) is not None:
        getattr(w, bias).mul_(f)
    site.write(w)


def materialize(model: nn.Module, layout: Layout, subnet: Subnet, rescale: bool = True) -> nn.Module:
    """The physically smaller dense model of `subnet`, sqrt(N_full/N_sub) folded into the output projections."""
    new = subset_model(model, *layout.subset_args(subnet))
    if rescale:
        sites = find_sites(new)
        for i in subnet.attn:
            _scale_output(sites.attn[i], "o", "o_bias", layout.attn_scale(i))
        for i in subnet.mlp:
            _scale_output(sites.mlp[i], "down", "down_bias", layout.mlp_scale())
    return new


def twist_extract(model: nn.Module, keep: int, blocks: int | None = None, parts: str | None = None,
                  attn_keep: int | None = None, layers=None, shared_first: int | None = None,
                  shared_last: int | None = None, seed: int = 0, rescale: bool = True) -> nn.Module:
    """Deploy one random subnet at kappa = keep / blocks as a physically smaller dense model (no data, no search).

    Unset settings come from the model's TwIST (or data-parallel) training record, else TwISTConfig's defaults:
    R = blocks, parts, shared first / last layers (or an explicit `layers` list), the common sets. The subnet
    holds C plus random blocks drawn with `seed`. Where every layer ends with the same widths the result is a
    stock transformers model; with shared layers kept whole it is saved and reloaded through mlpsurgery.save/load.
    """
    trained = trained_settings(model)
    base = TwISTConfig(**{k: v for k, v in trained.items() if k in TwISTConfig.__dataclass_fields__})
    blocks = blocks or base.blocks
    parts = parts or base.parts
    n_layers = len(find_sites(model))
    if layers is None:
        first = base.shared_first if shared_first is None else shared_first
        last = base.shared_last if shared_last is None else shared_last
        layers = list(range(first, n_layers - last))
    layout = make_layout(model, parts, layers, blocks, keep, attn_keep, base.common_attn, base.common_ffn)
    subnet = layout.deployment(torch.Generator().manual_seed(seed))
    new = materialize(model, layout, subnet, rescale=rescale)
    record(new, "twist-extract", {"keep": keep, "blocks": blocks, "parts": parts, "attn_keep": attn_keep,
                                  "layers": layers, "rescale": rescale},
           seed=seed, subnet=subnet.as_dict())
    return new
