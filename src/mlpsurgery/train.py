"""The shared fitting loop: AdamW, cosine schedule with linear warm-up, gradient-norm clipping, a
progress bar, loss history against steps and wall-clock, and checkpoint / resume.

Resumability rests on one rule: the batch of step t is a pure function of (seed, t) (see `step_rng`),
so a run killed at any point and resumed from its last checkpoint replays exactly the steps an
uninterrupted run would have taken. A checkpoint holds the trainable tensors, the optimizer and
schedule state, the RNG state (dropout) and the history, in safetensors + JSON (never pickle), written
atomically with the size and SHA-256 of each file (checksums.json), checked on resume; Ctrl-C writes one before
stopping. A run estimated to take more than an hour says so after its first step.
"""

from __future__ import annotations

import contextlib
import json
import math
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn
from tqdm.auto import tqdm

from . import checksums, files
from .errors import IntegrityError, MLPSurgeryError

CHECKPOINT_FILES = ["tensors.safetensors", "state.json"]  # each recorded in the checkpoint's checksums.json


@dataclass
class FitConfig:
    steps: int = 100
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup: float = 0.05  # fraction of steps of linear warm-up
    schedule: str = "cosine"  # cosine | constant
    min_lr_ratio: float = 0.0  # cosine floor as a fraction of lr
    clip: float | None = 1.0  # gradient-norm clip; None disables
    betas: tuple[float, float] = (0.9, 0.999)
    seed: int = 0
    log_every: int = 10
    checkpoint_every: int = 50
    extra: dict = field(default_factory=dict)  # method-specific settings recorded with the run
    seconds: float | None = None  # a time budget: the run stops once it is spent, and the cosine runs on whichever
    # of the steps or the clock is further along, so the learning rate reaches its floor when either ends


def step_rng(seed: int, step: int, stream: int = 0) -> torch.Generator:
    """The generator for step `step`: data sampling that uses it is identical on resume."""
    return torch.Generator().manual_seed((seed * 1_000_003 + step) * 31 + stream)


def lr_factor(cfg: FitConfig, step: int, elapsed: float = 0.0) -> float:
    """The learning rate of `step` as a fraction of cfg.lr; `elapsed` (seconds of training so far) moves the cosine
    along when cfg.seconds is the tighter budget."""
    warm = max(1, int(round(cfg.warmup * cfg.steps))) if cfg.warmup > 0 else 0
    if step < warm:
        return (step + 1) / warm
    if cfg.schedule == "constant":
        return 1.0
    progress = (step - warm) / max(1, cfg.steps - warm)
    if cfg.seconds:
        progress = max(progress, elapsed / cfg.seconds)
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


# --------------------------------------------------------------------------------------------------
# Checkpoints


def _flatten(obj, prefix: str, tensors: dict[str, Tensor]):
    """JSON skeleton of a nested structure, its tensors moved into `tensors` under dotted names."""
    if isinstance(obj, Tensor):
        # a sharded tensor (DTensor) stays as it is: save_checkpoint gathers it when it writes it
        tensors[prefix] = obj.detach() if type(obj).__name__ == "DTensor" else obj.detach().cpu().contiguous()
        return {"__tensor__": prefix}
    if isinstance(obj, dict):
        return {"__dict__": [[_flatten(k, f"{prefix}.k{i}", tensors), _flatten(v, f"{prefix}.{i}", tensors)]
                             for i, (k, v) in enumerate(obj.items())]}
    if isinstance(obj, (list, tuple)):
        return {"__list__": [_flatten(v, f"{prefix}.{i}", tensors) for i, v in enumerate(obj)],
                "tuple": isinstance(obj, tuple)}
    if isinstance(obj, float) and not math.isfinite(obj):
        return {"__float__": repr(obj)}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"cannot checkpoint a {type(obj).__name__}")


def _unflatten(obj, tensors: dict[str, Tensor]):
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            return tensors[obj["__tensor__"]]
        if "__dict__" in obj:
            return {_unflatten(k, tensors): _unflatten(v, tensors) for k, v in obj["__dict__"]}
        if "__list__" in obj:
            items = [_unflatten(v, tensors) for v in obj["__list__"]]
            return tuple(items) if obj.get("tuple") else items
        if "__float__" in obj:
            return float(obj["__float__"])
    return obj


def save_checkpoint(folder: str | Path, state: dict, sharded: bool = False) -> None:
    """Write a nested dict of tensors and JSON values to folder/{state.json, tensors.safetensors}, atomically
    (a marked folder swapped into place: a kill leaves the old checkpoint or the new one).

    sharded=True (under torchrun, every rank calls it with its own `state`, the same structure): the sharded
    tensors (DTensors: FSDP's parameters and AdamW moments) are gathered one at a time and rank 0 writes each at
    once, so no rank holds the full state (gathering all of it first put the trained parameters and their moments
    whole on every rank at every checkpoint: a 1 B model's sharded run peaked at 10.1 GiB per rank, above one
    process's 9.3). The file holds full tensors, as one process's. A failure on rank 0 is raised on every rank,
    after the gathers."""
    tensors: dict[str, Tensor] = {}
    skeleton = _flatten(state, "s", tensors)
    if not sharded:
        with files.atomic_dir(folder, overwrite=True, kind="checkpoint") as tmp:
            save_file(tensors, str(tmp / "tensors.safetensors"))
            (tmp / "state.json").write_text(json.dumps(skeleton))
            checksums.seal_folder(tmp, CHECKPOINT_FILES)
        return
    from . import parallel
    from .tensorfiles import SafetensorsWriter

    rank, _ = parallel.world()
    failure: list[BaseException] = []
    stack = contextlib.ExitStack()
    writer = None
    if rank == 0:
        try:
            tmp = stack.enter_context(files.atomic_dir(folder, overwrite=True, kind="checkpoint"))
            writer = SafetensorsWriter(tmp / "tensors.safetensors",
                                       {k: (t.dtype, tuple(t.shape)) for k, t in tensors.items()})
        except BaseException as e:  # noqa: BLE001 - told to every rank after the gathers
            failure.append(e)
    for k, t in tensors.items():  # every rank, in the same order: each sharded tensor gathered in turn
        full = t.full_tensor() if parallel.is_dtensor(t) else t
        if writer is not None and not failure:
            try:
                writer.write(k, full.cpu())
            except BaseException as e:  # noqa: BLE001 - as above
                failure.append(e)
        del full
    if rank == 0:
        try:
            if not failure:
                writer.close()
                (tmp / "state.json").write_text(json.dumps(skeleton))
                checksums.seal_folder(tmp, CHECKPOINT_FILES)
        except BaseException as e:  # noqa: BLE001 - as above
            failure.append(e)
        if failure:
            if writer is not None:
                writer.abandon()
            stack.__exit__(type(failure[0]), failure[0], failure[0].__traceback__)  # the temporary folder removed
        else:
            stack.close()  # swapped into place
    parallel.rank0_outcome(failure[0] if failure else None, f"write the checkpoint {folder}")


def load_checkpoint(folder: str | Path) -> dict | None:
    """The state written by save_checkpoint, or None if there is none. Its files are checked against the checksums
    recorded when it was written: a damaged, edited or unchecksummed one (written before checksums) is refused."""
    folder = Path(folder)
    if not (folder / "state.json").exists():
        return None
    checksums.check_folder(folder, CHECKPOINT_FILES, f"remove the checkpoint folder {folder} to start that training "
                                                     "afresh (the run then starts again from step 0)")
    try:
        skeleton = json.loads((folder / "state.json").read_text())
        tensors = load_file(str(folder / "tensors.safetensors"))
    except Exception as e:
        raise IntegrityError(f"checkpoint {folder} is corrupted ({e}); delete it to start over") from None
    return _unflatten(skeleton, tensors)


def rng_state() -> dict:
    out = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# --------------------------------------------------------------------------------------------------
# Sharded parameters (FSDP2 under torchrun, parallel.shard): checkpoints hold full tensors, so that a run
# written by N ranks resumes in one process or in M; every rank takes part in the gathers.


def _like(value: Tensor, param: Tensor) -> Tensor:
    """A full `value` split the way `param` is (this rank's shard of it); unchanged for a plain parameter."""
    from torch.distributed.tensor import distribute_tensor

    from . import parallel

    if not parallel.is_dtensor(param) or parallel.is_dtensor(value) or value.shape != param.shape:
        return value
    return distribute_tensor(value.to(param.device), param.device_mesh, param.placements, src_data_rank=None)


def _sharded_step(params: list[Tensor], clip: float | None) -> float:
    """What DDP and FSDP do between backward and the update, for a mix of sharded and plain parameters: plain
    gradients averaged over the ranks (FSDP averaged the sharded ones), then all scaled by one global norm clip.
    Returns the global gradient norm (the same on every rank, and the one a single process would see)."""
    from . import parallel

    _, size = parallel.world()
    sharded_sq = torch.zeros((), dtype=torch.float64)
    plain_sq = torch.zeros((), dtype=torch.float64)
    for p in params:
        if p.grad is None:
            continue
        if parallel.is_dtensor(p.grad):
            sharded_sq += p.grad.to_local().double().pow(2).sum().cpu()
        else:
            parallel.sum_over_ranks_(p.grad).div_(size)
            plain_sq += p.grad.double().pow(2).sum().cpu()
    parallel.sum_over_ranks_(sharded_sq)  # on the backend's device (NCCL reduces no CPU tensor)
    return _clip_to(params, float((sharded_sq + plain_sq).sqrt()), clip)


def _clip_to(params: list[Tensor], norm: float, clip: float | None) -> float:
    """Scale this rank's gradients (its shards of sharded ones) by the clip of a global norm computed across the
    ranks, as torch.nn.utils.clip_grad_norm_ scales them; returns the norm."""
    from . import parallel

    if clip:
        coef = clip / (norm + 1e-6)  # torch.nn.utils.clip_grad_norm_'s rule
        if coef < 1:
            for p in params:
                if p.grad is not None:
                    (p.grad.to_local() if parallel.is_dtensor(p.grad) else p.grad).mul_(coef)
    return norm


# --------------------------------------------------------------------------------------------------
# Partitioned parameters (`fit(partition=...)` under torchrun): each rank trains its own disjoint share of the
# parameters (the layers given to it) on a loss whose terms are its own (a sum over the layers, each layer's term
# on its own data), so the ranks' gradients need no averaging: only the clip's global norm and the reported loss
# are summed over the ranks. Checkpoints hold every rank's tensors in the order of one process (`partition`), so
# a run written by N ranks resumes in one process or in M.


def _partition_step(params: list[Tensor], clip: float | None) -> float:
    """The global gradient norm over every rank's own parameters (the one a single process would see), and the
    clip by it applied to this rank's gradients."""
    from . import parallel

    sq = torch.zeros((), dtype=torch.float64)
    for p in params:
        if p.grad is not None:
            sq += p.grad.double().pow(2).sum().cpu()
    parallel.sum_over_ranks_(sq)
    return _clip_to(params, float(sq.sqrt()), clip)


def _gather_partition(names: list[str], order: list[str], tensors: dict[str, Tensor], optim: dict,
                      rng: dict) -> tuple[dict, dict, list] | None:
    """Rank 0: every rank's parameters and AdamW state as one process holds them (its state indexed by the
    position in `order`), and every rank's RNG state; None on the other ranks (a collective)."""
    from . import parallel

    state = {n: {k: v.detach().cpu() if isinstance(v, Tensor) else v for k, v in optim["state"][j].items()}
             for j, n in enumerate(names) if j in optim["state"]}
    mine = ({n: tensors[n].detach().cpu() for n in names}, state, rng)
    box = parallel.gather_to_rank0(mine)
    if box is None:
        return None
    params, canon = {}, {}
    for part, st, _ in box:
        params.update(part)
        canon.update({order.index(n): v for n, v in st.items()})
    group = {k: v for k, v in optim["param_groups"][0].items() if k != "params"}
    return ({n: params[n] for n in order}, {"state": canon, "param_groups": [{**group, "params": list(range(len(order)))}]},
            [r for _, _, r in box])


def _local_optimizer_state(canon: dict, names: list[str], order: list[str]) -> dict:
    """This rank's share of an optimizer state written in one process's order."""
    state = {j: canon["state"][order.index(n)] for j, n in enumerate(names) if order.index(n) in canon["state"]}
    group = {k: v for k, v in canon["param_groups"][0].items() if k != "params"}
    return {"state": state, "param_groups": [{**group, "params": list(range(len(names)))}]}


# --------------------------------------------------------------------------------------------------
# The loop


_NO_EFFECT = ("log_every", "checkpoint_every")  # FitConfig fields that do not change what a run computes


def _flat_settings(d, prefix: str = "") -> dict:
    if not isinstance(d, dict):
        return {prefix: d}
    out = {}
    for k, v in d.items():
        out.update(_flat_settings(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


class StopTraining(Exception):
    """Raised by a loss_fn to end training early (e.g. an attack that diverged); fit returns what it has."""


@dataclass
class FitResult:
    history: list[dict]  # {"step", "loss", "lr", "time_s", plus whatever loss_fn reported}
    steps: int
    resumed_from: int
    seconds: float
    stopped_early: str | None = None  # the StopTraining message, when loss_fn ended the run
    # what this process held for the trained parameters at the end (its shard of them when sharded)
    memory: dict = field(default_factory=dict)  # {"param_bytes", "grad_bytes", "optimizer_bytes", "world_size"}

    def as_dict(self) -> dict:
        return asdict(self)


def fit(params: dict[str, nn.Parameter], loss_fn: Callable[[int], Tensor | tuple[Tensor, dict]], cfg: FitConfig,
        checkpoint_dir: str | Path | None = None, progress: bool = True, desc: str = "train",
        optimizer_groups: list[dict] | None = None,
        on_checkpoint: Callable[[dict], None] | None = None,
        on_resume: Callable[[dict], None] | None = None,
        clip_fn: Callable[[], float] | None = None, settings: dict | None = None,
        partition: list[str] | None = None) -> FitResult:
    """Minimise loss_fn(step) over `params` (name -> parameter) for cfg.steps steps.

    loss_fn(step) returns the loss (or (loss, metrics)); it must draw its batch with step_rng(seed, step)
    so that a resumed run is identical to an uninterrupted one. optimizer_groups: extra AdamW param groups
    (dicts with "params" as names and their own "lr"/"weight_decay"). Checkpoints go to checkpoint_dir every
    cfg.checkpoint_every steps, at the end, and on Ctrl-C; a later call with the same folder resumes.
    on_checkpoint / on_resume let the caller save and restore extra state (e.g. learned scalars).
    clip_fn replaces the global gradient-norm clip (e.g. a separate clip per independent sub-network);
    it returns the norm it saw. settings: what else the run depends on (a model fingerprint, the data, the
    method's config), recorded with every checkpoint; a checkpoint made with other settings (these, or the
    FitConfig's) is refused, never resumed.

    Sharded parameters (a model sharded by mlpsurgery.parallel.shard under torchrun; loss_fn takes this rank's
    rows of the batch, parallel.rows): the loss and metrics are averaged over the ranks, plain parameters'
    gradients too, the clip is by the global norm, only rank 0 shows progress and writes checkpoints (full
    tensors; a stop by Ctrl-C keeps the last periodic one, since the ranks may not all reach a gather).

    partition: the names of every rank's parameters in one process's order, where each rank passes its own
    disjoint share of them as `params` and loss_fn computes only its own terms of a loss that is a sum of
    per-share terms (e.g. a sum over layers, each rank given some layers): the loss reported and the clip's norm
    are summed over the ranks, gradients are not averaged, and checkpoints hold every rank's tensors in that
    order (so they resume in one process or under another number of ranks). In one process `params` must be all
    of them. Each rank's RNG state is checkpointed too (restored when resumed under as many ranks).
    """
    from . import parallel

    if cfg.steps < 0:
        raise MLPSurgeryError(f"steps must be >= 0, not {cfg.steps}")
    rank, size = parallel.world()
    sharded = size > 1 and any(parallel.is_dtensor(p) for p in params.values())
    partitioned = size > 1 and partition is not None
    if (sharded or partitioned) and clip_fn is not None:
        raise MLPSurgeryError("this training step clips gradients per group, which sharded training does not "
                              "offer; run it in one process")
    names = list(params)
    order = names
    if partition is not None:
        order = list(partition)
        stray = [n for n in names if n not in set(order)]
        if stray or len(set(order)) != len(order):
            raise MLPSurgeryError(f"parameters {stray[:3]} are not in the partition, or it names one twice")
        if sharded or (partitioned and (optimizer_groups or on_checkpoint or on_resume)):
            raise MLPSurgeryError("partitioned training takes plain parameters in one AdamW group, and no extra "
                                  "checkpoint state (only rank 0's would be kept)")
        if partitioned:
            covered = [n for part in parallel.all_gather(names) for n in part]
            if sorted(covered) != sorted(order):
                raise MLPSurgeryError("the ranks' shares of the parameters do not cover the partition exactly once")
        elif sorted(names) != sorted(order):
            raise MLPSurgeryError("in one process a partitioned training takes every parameter of the partition")
        names = [n for n in order if n in set(names)]  # one process's order within each share
    distributed = sharded or partitioned
    if distributed and cfg.seconds is not None:  # the ranks' clocks differ: one would stop while the others wait
        raise MLPSurgeryError("a time budget (seconds) stops a run on one process's clock; give sharded or "
                              "partitioned training a number of steps instead")
    grouped = set()
    groups = []
    for g in optimizer_groups or []:
        gnames = list(g["params"])
        grouped.update(gnames)
        groups.append({**g, "params": [params[n] for n in gnames]})
    rest = [params[n] for n in names if n not in grouped]
    if rest:
        groups.insert(0, {"params": rest})
    opt = torch.optim.AdamW(groups, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=cfg.betas)
    base_lrs = [g["lr"] for g in opt.param_groups]
    history: list[dict] = []
    start, elapsed = 0, 0.0
    ckpt = Path(checkpoint_dir) if checkpoint_dir else None
    identity = json.loads(json.dumps({"fit": {k: v for k, v in asdict(cfg).items()
                                              if k not in _NO_EFFECT and not (k == "seconds" and v is None)},
                                      **(settings or {})}, sort_keys=True, default=str))
    state = load_checkpoint(ckpt) if ckpt else None
    if state is not None:
        if state.get("names") != order:
            raise MLPSurgeryError(f"checkpoint {ckpt} was written for other parameters; delete it or use another folder")
        if state.get("total_steps") != cfg.steps:
            raise MLPSurgeryError(f"checkpoint {ckpt} belongs to a run of {state.get('total_steps')} steps, not "
                                  f"{cfg.steps}; resume with the same settings or delete it")
        old = state.get("settings")
        if old is not None and old != identity:
            flat_old, flat_new = _flat_settings(old), _flat_settings(identity)
            diff = sorted(k for k in set(flat_old) | set(flat_new) if flat_old.get(k) != flat_new.get(k))
            raise MLPSurgeryError(f"checkpoint {ckpt} was made with other settings or another model "
                                  f"({', '.join(diff[:6])}); resume with the same ones, or delete it")
        with torch.no_grad():
            for n in names:
                p = params[n]
                (p.to_local() if parallel.is_dtensor(p) else p).copy_(
                    _like(state["params"][n], p).to_local() if parallel.is_dtensor(p) else state["params"][n])
        if sharded:
            plist = [p for g in opt.param_groups for p in g["params"]]
            for idx, st in state["optimizer"]["state"].items():
                for k, v in st.items():
                    if isinstance(v, Tensor) and k != "step":
                        st[k] = _like(v, plist[int(idx)])
        opt.load_state_dict(_local_optimizer_state(state["optimizer"], names, order) if partitioned
                            else state["optimizer"])
        per_rank = state.get("rng_ranks")  # each rank's own stream (dropout), when resumed under as many ranks
        set_rng_state(per_rank[rank] if per_rank and len(per_rank) == size else state["rng"])
        history, start, elapsed = state["history"], state["step"], state["seconds"]
        if on_resume is not None:
            on_resume(state.get("extra", {}))
    if distributed:  # a rank that found no checkpoint (another file system) would step out of line with the others
        parallel.same_on_every_rank("checkpoints (the step to resume from)", start)

    def write(step: int, seconds: float, rng: dict | None = None):
        if ckpt is None:
            return
        extra: dict = {}
        if on_checkpoint is not None:
            on_checkpoint(extra)
        rngs = None
        with torch.no_grad():
            tensors = {n: params[n].detach() for n in names}
            optim = opt.state_dict()
            if sharded:  # the sharded tensors are gathered one at a time as rank 0 writes them (save_checkpoint)
                rngs = parallel.all_gather(rng_state())
            elif partitioned:
                tensors, optim, rngs = _gather_partition(names, order, tensors, optim, rng_state()) or (None,) * 3
            state = {"names": order, "total_steps": cfg.steps, "step": step, "seconds": seconds, "params": tensors,
                     "optimizer": optim, "rng": rng or rng_state(), "history": history, "config": asdict(cfg),
                     "extra": extra, "settings": identity, **({"rng_ranks": rngs} if rngs else {})}
            if sharded:
                save_checkpoint(ckpt, state, sharded=True)  # every rank; ends with rank 0's outcome on all
            elif not distributed:
                save_checkpoint(ckpt, state)
            else:  # partitioned: rank 0 writes what it gathered; no rank runs ahead of a checkpoint that may fail
                failure = None
                if rank == 0:
                    try:
                        save_checkpoint(ckpt, state)
                    except BaseException as e:  # noqa: BLE001 - raised on every rank
                        failure = e
                parallel.rank0_outcome(failure, f"write the checkpoint {ckpt}")

    t0 = time.perf_counter() - elapsed
    done = start  # steps whose update is complete: what a checkpoint written now may claim
    rng_next = None  # the RNG as step `done` found it (None: the current state), so a replay draws the same dropout
    stopped = None
    bar = tqdm(total=cfg.steps, initial=start, desc=desc, unit="step", disable=not progress or rank != 0)
    trained = [p for g in opt.param_groups for p in g["params"]]
    try:
        for step in range(start, cfg.steps):
            began = time.perf_counter()
            if cfg.seconds is not None and began - t0 >= cfg.seconds:
                raise StopTraining(f"the time budget of {cfg.seconds:g} s was spent")
            rng_next = rng_state()
            f = lr_factor(cfg, step, began - t0)
            for g, lr in zip(opt.param_groups, base_lrs):
                g["lr"] = lr * f
            out = loss_fn(step)
            loss, metrics = out if isinstance(out, tuple) else (out, {})
            shown = float(loss.detach())
            if distributed:  # what one process would report: the mean over the ranks' equal shares of the batch
                keys = list(metrics)  # (sharded), or the sum of the ranks' own terms of the loss (partitioned)
                both = torch.tensor([shown, *(float(metrics[k]) for k in keys)], dtype=torch.float64)
                both = parallel.sum_over_ranks(both) if partitioned else parallel.mean_over_ranks(both)
                shown, metrics = both[0].item(), dict(zip(keys, both[1:].tolist()))
            if not math.isfinite(shown):
                raise MLPSurgeryError(f"{desc}: loss became {shown} at step {step}; lower the learning rate")
            opt.zero_grad(set_to_none=True)
            loss.backward()
            with _deferred_interrupt():  # the update and its bookkeeping happen entirely or not at all
                if clip_fn is not None:
                    metrics.setdefault("grad_norm", float(clip_fn()))
                elif sharded:
                    metrics.setdefault("grad_norm", _sharded_step(trained, cfg.clip))
                elif partitioned:
                    metrics.setdefault("grad_norm", _partition_step(trained, cfg.clip))
                elif cfg.clip:
                    gn = torch.nn.utils.clip_grad_norm_(trained, cfg.clip)
                    metrics.setdefault("grad_norm", float(gn))
                opt.step()
                rec = {"step": step + 1, "loss": shown, "lr": opt.param_groups[0]["lr"],
                       "time_s": time.perf_counter() - t0, **{k: float(v) for k, v in metrics.items()}}
                history.append(rec)
                done, rng_next = step + 1, None
            bar.update(1)
            if step == start and progress and rank == 0:  # a run of days says so up front, not at its end
                note = long_run_message(time.perf_counter() - began, cfg.steps, start, ckpt is not None)
                if note:
                    tqdm.write(f"mlpsurgery: {desc}: {note}", file=sys.stderr)
            if (step + 1) % cfg.log_every == 0 or step + 1 == cfg.steps:
                bar.set_postfix(loss=f"{rec['loss']:.4g}")
            if (step + 1) % cfg.checkpoint_every == 0 and step + 1 < cfg.steps:
                write(step + 1, time.perf_counter() - t0)
    except StopTraining as e:
        stopped = str(e) or "stopped by the loss function"
    except KeyboardInterrupt:
        bar.close()
        if not distributed:
            write(done, time.perf_counter() - t0, rng=rng_next)
        raise
    bar.close()
    seconds = time.perf_counter() - t0
    if stopped is None:
        write(cfg.steps, seconds)
    memory = {"param_bytes": parallel.local_bytes(trained),
              "grad_bytes": parallel.local_bytes([p.grad for p in trained if p.grad is not None]),
              "optimizer_bytes": parallel.local_bytes([v for st in opt.state.values() for v in st.values()
                                                      if isinstance(v, Tensor) and v.dim() > 0]),
              "world_size": size if distributed else 1}
    return FitResult(history=history, steps=cfg.steps, resumed_from=start, seconds=seconds, stopped_early=stopped,
                     memory=memory)


LONG_RUN_SECONDS = 3600  # a run whose steps would take longer says so after its first step


def _duration(seconds: float) -> str:
    hours = seconds / 3600
    if hours < 48:
        return f"{hours:.1f} hours"
    days = hours / 24
    return f"{days:,.0f} days" if days < 3 * 365 else f"{days / 365.25:,.0f} years"


def long_run_message(seconds_per_step: float, steps: int, resumed_from: int = 0, checkpoint: bool = True) -> str | None:
    """What fit says on stderr (unless quiet) after the first step of a run whose steps left would take more than
    LONG_RUN_SECONDS at that step's pace (the first step is the slowest, so the estimate errs long); None for a
    shorter run. E.g. "at 0.12 s a step, 100,000,000 steps take about 139 days; Ctrl-C stops it ..."."""
    left = steps - resumed_from
    total = seconds_per_step * left
    if not total > LONG_RUN_SECONDS:
        return None
    pace = f"{seconds_per_step:,.0f}" if seconds_per_step >= 10 else f"{seconds_per_step:.2g}"
    return (f"at {pace} s a step, {left:,} steps{' left' if resumed_from else ''} take about "
            f"{_duration(total)}; Ctrl-C stops it, "
            + ("and the same command resumes it from its checkpoint" if checkpoint else
               "and this run keeps no checkpoint to resume from"))


@contextlib.contextmanager
def _deferred_interrupt():
    """Hold a Ctrl-C (SIGINT) that arrives inside the block until the block has finished, so an interrupt never
    lands between an optimizer update and the step counter that says it happened."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        yield  # (an ignored SIGINT -- a background job, nohup -- stays ignored: no handler turns it into a stop)
        return
    hit = []
    old = signal.signal(signal.SIGINT, lambda *_: hit.append(True))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)
    if hit:
        raise KeyboardInterrupt


# --------------------------------------------------------------------------------------------------
# Ready-made losses for fit(): language modelling on token blocks, classification on labelled text


def trainable(model: nn.Module) -> dict[str, nn.Parameter]:
    """name -> parameter for every parameter that requires grad (tied parameters once)."""
    out, seen = {}, set()
    for name, p in model.named_parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out[name] = p
    return out


def lm_loss(model: nn.Module, blocks: Tensor, batch_size: int, seed: int = 0) -> Callable[[int], Tensor]:
    """loss_fn(step): next-token loss on `batch_size` rows of `blocks` (N, T) drawn with step_rng(seed, step)
    (while the model is sharded, this rank's share of them: mlpsurgery.parallel.rows)."""
    from .parallel import rows

    device = next(model.parameters()).device

    def loss_fn(step: int) -> Tensor:
        idx = torch.randint(0, len(blocks), (batch_size,), generator=step_rng(seed, step))
        batch = rows(blocks[idx], model).to(device)
        return model(input_ids=batch, labels=batch).loss

    return loss_fn


def classifier_loss(model: nn.Module, tokenizer, data, batch_size: int, max_len: int = 128,
                    seed: int = 0) -> Callable[[int], Tensor]:
    """loss_fn(step): cross-entropy of a sequence classifier on `batch_size` examples of a LabelledSet (while the
    model is sharded, this rank's share of them)."""
    from .parallel import rows

    device = next(model.parameters()).device
    labels = torch.tensor(data.labels)

    def loss_fn(step: int) -> Tensor:
        idx = rows(torch.randint(0, len(data), (batch_size,), generator=step_rng(seed, step)).tolist(), model)
        enc = tokenizer([data.texts[i] for i in idx], padding=True, truncation=True, max_length=max_len,
                        return_tensors="pt")
        enc = {k: v.to(device) for k, v in enc.items() if k in ("input_ids", "attention_mask", "token_type_ids")}
        return model(**enc, labels=labels[idx].to(device)).loss

    return loss_fn
