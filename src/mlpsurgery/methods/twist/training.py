"""Training: rounds of local steps on every worker's subnet and their aggregation, in the masked, true and
hybrid modes, with checkpoint and resume; and the data-parallel baseline (dp)."""

from __future__ import annotations

import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from ...errors import MLPSurgeryError
from ...io import record
from ...subsets import subset_model
from ...train import FitConfig, fit, save_checkpoint, step_rng, trainable
from . import checkpoint
from .aggregation import Aggregator, _params, fill_subnet, flatten, unflatten
from .blocks import Layout, Subnet
from .config import TwISTConfig, _batch, _round_generator, _round_lr, make_shards
from .distributed import (Comm, _build, _counting_allreduce, _distributed, _meta_copy, _rank_stats, _structure,
                          on_rank0)
from .hooks import subnet_hooks

MODES = ("masked", "true", "hybrid", "dp")


def _local_train(model: nn.Module, shard: Tensor, cfg: TwISTConfig, r: int, worker: int,
                 on_batch: Callable[[int, int, int], None] | None = None) -> list[float]:
    """Worker `worker`'s batches of round r on `model` (hooks already installed): a fresh AdamW (the rule).
    on_batch(worker, t, n) is called before batch t of n (the round's progress bar shows it)."""
    first = r * cfg.interval
    n = min(cfg.interval, cfg.steps - first)
    torch.manual_seed(step_rng(cfg.seed, r, stream=104729 + worker).initial_seed())  # dropout
    device = next(model.parameters()).device
    fc = FitConfig(steps=n, lr=_round_lr(cfg, r), weight_decay=cfg.weight_decay, warmup=0.0, schedule="constant",
                   clip=cfg.clip, seed=cfg.seed)

    def loss_fn(t: int) -> Tensor:
        if on_batch is not None:
            on_batch(worker, t, n)
        batch = _batch(shard, cfg, first + t, worker).to(device)
        return model(input_ids=batch, labels=batch, use_cache=False).loss

    model.train()
    res = fit(trainable(model), loss_fn, fc, progress=False, desc=f"worker {worker} round {r + 1}")
    return [h["loss"] for h in res.history]


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
    from ...measure.perplexity import is_causal_lm

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
        if model is not None and blocks is not None:
            # what cannot work under torchrun either is named now, before the user starts any process
            _check_twist(model, blocks, cfg, skeleton="meta")
        raise MLPSurgeryError(f"{mode} TwIST runs one process per worker: launch it with `torchrun --nproc-per-node "
                              f"{cfg.workers} -m mlpsurgery twist train ... --mode {mode}` (or initialise "
                              "torch.distributed first); `--mode masked` runs in one process")
    if mode == "masked" and world > 1:
        raise MLPSurgeryError("masked TwIST emulates every worker in one process; run it without torchrun, or use "
                              "--mode true / hybrid")
    if world > 1 and world != cfg.workers:
        raise MLPSurgeryError(f"{world} processes were started for S={cfg.workers} workers; start "
                              f"--nproc-per-node {cfg.workers} or pass --workers {world}")
    if mode == "dp":
        return _train_dp(model, blocks, cfg, checkpoint_dir, progress, callback)
    return _train_twist(model, blocks, cfg, mode, checkpoint_dir, progress, callback)


def _check_twist(model, blocks, cfg: TwISTConfig, skeleton: str | None = None):
    """Rank 0, before any rank waits on another and before anything is written: every check that can refuse a
    TwIST run. Returns (layout, shards, the physical subnet skeleton): skeleton None builds none, "real" the
    one every rank trains in (any subnet: all have the same shapes), "meta" one on the meta device (a check)."""
    if model is None or blocks is None:
        raise MLPSurgeryError("rank 0 needs the model and the token blocks")
    _check_lm(model)
    layout = cfg.layout(model)
    layout.check(cfg.workers)
    shards = make_shards(blocks, cfg.workers)
    sub = None
    if skeleton is not None:
        first = layout.blueprint(cfg.workers, _round_generator(cfg.seed, 0))[0]
        sub = subset_model(_meta_copy(model) if skeleton == "meta" else model, *layout.subset_args(first))
    return layout, shards, sub


def _claim(ckpt: Path | None, cfg: TwISTConfig, algorithm: str, model, blocks) -> None:
    if ckpt is not None:
        checkpoint.claim(ckpt, cfg, algorithm, model, blocks)


class _Run:
    """One rank's part of a TwIST run: what every round needs, and the rounds of each mode."""

    def __init__(self, model, blocks, cfg: TwISTConfig, mode: str, checkpoint_dir):
        self.rank, self.world = _distributed()
        self.model, self.cfg, self.mode, self.S = model, cfg, mode, cfg.workers
        self.ckpt = Path(checkpoint_dir) if checkpoint_dir else None
        self.comm = self.sub = None
        self.train_s, self.batches = 0.0, 0

        def prepare():  # rank 0: checks, then the claim of the checkpoint folder (the first thing written)
            checked = _check_twist(model, blocks, cfg, skeleton="real" if self.world > 1 else None)
            _claim(self.ckpt, cfg, "twist", model, blocks)
            return checked

        prepared = on_rank0(prepare)
        if self.rank == 0:
            self.device = next(model.parameters()).device
            self.layout, self.shards, self.sub = prepared
            self.start, self.history, self.elapsed = checkpoint.resume(model, self.ckpt)
        else:
            nccl = torch.cuda.is_available() and torch.distributed.get_backend() == "nccl"
            self.device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', self.rank))}" if nccl else "cpu")
            self.start, self.history, self.elapsed = 0, [], 0.0
        if self.world > 1:
            self.comm = Comm(self.device)
            if self.rank == 0:
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
        self.on_batch: Callable[[int, int, int], None] | None = None

    def _train(self, model, shard, r: int, worker: int) -> list[float]:
        t = time.perf_counter()
        losses = _local_train(model, shard, self.cfg, r, worker, self.on_batch)
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
            save_checkpoint(checkpoint.state_dir(self.ckpt), {
                "config": asdict(self.cfg), "round": r + 1, "history": self.history,
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
    last = {"loss": ""}
    if progress and run.rank == 0:
        # a round is S workers x interval batches (minutes on a real model on the CPU): the bar shows each batch
        # (in true / hybrid mode the ones rank 0 trains itself)
        def on_batch(worker: int, t: int, n: int) -> None:
            bar.set_postfix_str(f"{last['loss']}worker {worker + 1}/{cfg.workers} batch {t + 1}/{n}")

        run.on_batch = on_batch
    for r in range(run.start, cfg.rounds):
        started = time.perf_counter()
        subnets = run.layout.blueprint(cfg.workers, _round_generator(cfg.seed, r)) if run.rank == 0 else None
        losses = run.masked_round(r, subnets) if mode == "masked" else run.distributed_round(r, subnets)
        if run.rank == 0:
            rec = run.log(r, losses, started, t0)
            bar.update(1)
            last["loss"] = f"loss={rec['loss']:.4g}, "
            bar.set_postfix_str(last["loss"].rstrip(", "))
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


def _train_dp(model, blocks, cfg, checkpoint_dir, progress, callback) -> TwISTResult:
    """The baseline: the full model, data parallel over the same S shards and steps (batch = S x batch_size)."""
    rank, world = _distributed()
    S = cfg.workers
    fc = FitConfig(steps=cfg.steps, lr=cfg.lr, weight_decay=cfg.weight_decay, warmup=cfg.warmup,
                   schedule=cfg.schedule, clip=cfg.clip, seed=cfg.seed, log_every=cfg.interval,
                   checkpoint_every=cfg.interval)
    ckpt = Path(checkpoint_dir) if checkpoint_dir else None

    def prepare():  # rank 0: checks, then the claim (the first thing written)
        if model is None or blocks is None:
            raise MLPSurgeryError("rank 0 needs the model and the token blocks")
        _check_lm(model)
        shards = make_shards(blocks, S)
        _claim(ckpt, cfg, "data-parallel", model, blocks)
        return shards

    shards = on_rank0(prepare)
    if world == 1:
        device = next(model.parameters()).device

        def loss_fn(t: int) -> Tensor:
            batch = torch.cat([_batch(shards[s], cfg, t, s) for s in range(S)]).to(device)
            return model(input_ids=batch, labels=batch, use_cache=False).loss

        model.train()
        res = fit(trainable(model), loss_fn, fc, checkpoint_dir=checkpoint.state_dir(ckpt) if ckpt else None,
                  progress=progress, desc="data parallel")
        stats = _rank_stats([model], None, model, res.seconds, cfg.steps * S)
        ranks = [dict(stats, rank=0)]
    else:
        from torch.nn.parallel import DistributedDataParallel

        if rank == 0:
            device = next(model.parameters()).device
            comm = Comm(device)
            comm.broadcast_object(_structure(model))
            shard = comm.send_blocks(shards)
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

        res = fit(trainable(model), loss_fn, fc, checkpoint_dir=checkpoint.state_dir(ckpt, rank) if ckpt else None,
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
