"""The process group torchrun describes: joining it, rank 0's checks and outcomes shared with every rank, each
rank's share of a batch, and sums, gathers and broadcasts over the ranks (gloo on CPU, NCCL on CUDA)."""

from __future__ import annotations

import atexit
import os
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch import Tensor

from ..errors import MLPSurgeryError


_ALONE = [0]  # depth of `alone()` blocks this process is in


def world() -> tuple[int, int]:
    """(rank, world size) of the process group this process has joined; (0, 1) without one, or inside `alone()`."""
    import torch.distributed as dist

    if _ALONE[0]:
        return 0, 1
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


@contextmanager
def alone() -> Iterator[None]:
    """Work that is this rank's own (e.g. the one layer it distils by itself while the others distil theirs): inside,
    `world()` is (0, 1), so code that splits its work over the ranks or meets them in a collective runs as one
    process would, without waiting for ranks that are not running it."""
    _ALONE[0] += 1
    try:
        yield
    finally:
        _ALONE[0] -= 1


def rank_folder(top: str | Path) -> Path:
    """This rank's own folder inside a work folder `top` (`rank{r}-of-{N}`; `top` itself in one process): what each
    rank writes for itself (its captures, spilled activations) where the ranks share a file system."""
    rank, size = world()
    return Path(top) / f"rank{rank}-of-{size}" if size > 1 else Path(top)


def launched() -> bool:
    """Whether torchrun started this process as one of several ranks."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def rank_device(device: str) -> str:
    """The device this rank works on: under torchrun on CUDA, the GPU of its LOCAL_RANK (made current)."""
    if device.startswith("cuda") and launched():
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
        torch.cuda.set_device(device)
    return device


def init(device: str | torch.device = "cpu") -> tuple[int, int]:
    """Join the process group torchrun describes (gloo on CPU, NCCL on CUDA); (rank, world size)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if not launched():
        return 0, 1
    backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
    if backend == "gloo":  # CPU ranks: large blocks mapped and returned when freed (glibc kept gigabytes that the
        from ..layerwise import map_large_allocations  # collectives had freed: docs/distributed.md)

        map_large_allocations()
    # ranks wait for each other's long work at collectives (a layer's distillation in `lock dlr --layerwise`, a
    # rank's share of phase 1 left after a resume): far longer than torch's 30-minute default. A rank that dies
    # does not leave the others waiting out this timeout: torchrun stops every rank when one fails.
    dist.init_process_group(backend=backend, timeout=timedelta(hours=24))
    # left to the interpreter's finalisation, gloo's worker threads can still hold work with Python references and
    # abort the process ("terminate called without an active exception", SIGABRT) after its work is done (seen in
    # CI; pytorch/pytorch#190489): the group is destroyed while the interpreter is whole
    atexit.register(_destroy)
    # every rank joined before any returns: a rank that refuses its command at once (its own checks, before any
    # collective) and exits would otherwise take rank 0's store away from a rank still joining ("Connection reset
    # by peer" there instead of the refusal; seen in CI)
    dist.barrier()
    return dist.get_rank(), dist.get_world_size()


def _destroy() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def on_rank0(prepare: Callable[[], Any]) -> Any:
    """Run rank 0's `prepare` (loading, checks, claims) and tell every rank how it went, before any rank waits on
    another for work. A refusal on rank 0 is raised on every rank with the same class and message, so each
    process ends with the one-line error (exit status 2) instead of the others dying on a closed connection.
    Call it on every rank; the others get None. Without torch.distributed it is just `prepare()`."""
    from .. import errors

    rank, size = world()
    if size == 1:
        return prepare()
    out = failure = None
    if rank == 0:
        try:
            out = prepare()
        except BaseException as e:  # noqa: BLE001 - every failure is reported to the other ranks, then re-raised
            failure = e
    told = from_rank0(None if failure is None else
                      (type(failure).__name__, str(failure), isinstance(failure, MLPSurgeryError)))
    if failure is not None:
        raise failure
    if told is not None:
        name, message, user = told
        klass = getattr(errors, name, None) if user else None
        if not (isinstance(klass, type) and issubclass(klass, MLPSurgeryError)):
            klass = MLPSurgeryError if user else RuntimeError
        raise klass(message if user else f"rank 0 failed before training ({name}: {message})")
    return out


def same_on_every_rank(what: str, value: Any) -> None:
    """Refuse, on every rank, a run whose ranks disagree on `value` (settings, data, a model fingerprint)."""
    import torch.distributed as dist

    rank, size = world()
    if size == 1:
        return
    seen: list[Any] = [None] * size
    dist.all_gather_object(seen, value)
    if any(v != seen[0] for v in seen):
        raise MLPSurgeryError(f"the {size} ranks were given different {what}; start every rank with the same "
                              "command and files")


def share(items: list) -> list:
    """This rank's share of `items` (every world-th one, from its rank on); all of them without a process group."""
    rank, size = world()
    return list(items)[rank::size]


def owners(items: list) -> dict:
    """item -> the rank whose `share` of `items` holds it (every item rank 0's without a process group)."""
    size = world()[1]
    return {x: n % size for n, x in enumerate(items)}


def all_gather(obj: Any) -> list[Any]:
    """Every rank's `obj` (picklable; tensors travel on the CPU), in rank order; [obj] without a process group."""
    import torch.distributed as dist

    rank, size = world()
    if size == 1:
        return [obj]
    out: list[Any] = [None] * size
    dist.all_gather_object(out, obj)
    return out


def barrier() -> None:
    import torch.distributed as dist

    if world()[1] > 1:
        dist.barrier()

def rank0_outcome(failure: BaseException | None, what: str) -> None:
    """Every rank learns whether rank 0 did `what` (a write only rank 0 makes): rank 0's failure is raised there
    and, worded, on the others -- instead of the others waiting at the next collective for a rank that is gone.
    A collective: every rank calls it."""
    told = from_rank0(f"{type(failure).__name__}: {failure}" if failure is not None else None)
    if failure is not None:
        raise failure
    if told is not None:
        raise MLPSurgeryError(f"rank 0 could not {what} ({told})")

def check_split(n: int, flag: str = "--batch-size") -> None:
    """Refuse a batch of `n` that the ranks cannot share equally (`flag`: the option that sets it)."""
    size = world()[1]
    if n % size:
        raise MLPSurgeryError(f"a batch of {n} does not split evenly over {size} ranks; give a {flag} that "
                              f"is a multiple of {size}")

def _collective_device() -> torch.device | None:
    """Where a collective's tensors must be: this rank's GPU under NCCL (which reduces no CPU tensor); None (where
    they are) under gloo."""
    import torch.distributed as dist

    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None


def sum_over_ranks_(t: Tensor) -> Tensor:
    """Sum `t` over the ranks in place (a collective; on the backend's device, and back); `t` alone without a
    process group."""
    import torch.distributed as dist

    if world()[1] == 1:
        return t
    dev = _collective_device()
    if dev is None or t.device == dev:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    else:
        there = t.detach().to(dev)
        dist.all_reduce(there, op=dist.ReduceOp.SUM)
        t.copy_(there)
    return t


def sum_over_ranks(values: Tensor) -> Tensor:
    """The element-wise sum of `values` over the ranks (a collective); unchanged without a process group."""
    if world()[1] == 1:
        return values
    return sum_over_ranks_(values.detach().clone())


def mean_over_ranks(values: Tensor) -> Tensor:
    """The element-wise mean of `values` over the ranks (a collective); unchanged without a process group."""
    return sum_over_ranks(values) / world()[1]


def from_rank0(obj: Any) -> Any:
    """Rank 0's `obj` on every rank (a collective; picklable, tensors on the CPU); `obj` without a process group."""
    return from_rank(obj, 0)


def from_rank(obj: Any, src: int) -> Any:
    """Rank `src`'s `obj` on every rank (a collective; picklable, tensors on the CPU; the others pass anything);
    `obj` without a process group."""
    import torch.distributed as dist

    if world()[1] == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, device=_collective_device())
    return box[0]


def send_to(obj: Any, dst: int) -> None:
    """`obj` (picklable; tensors on the CPU) to rank `dst`, which takes it with `recv_from` (point to point: only the
    two ranks take part; the sender may wait until `dst` takes it, so both must post them in the same order)."""
    import torch.distributed as dist

    dist.send_object_list([obj], dst=dst, device=_collective_device())


def recv_from(src: int) -> Any:
    """What rank `src` sends with `send_to`, in the order it sends."""
    import torch.distributed as dist

    box: list[Any] = [None]
    dist.recv_object_list(box, src=src, device=_collective_device())
    return box[0]


def gather_to_rank0(obj: Any) -> list[Any] | None:
    """Every rank's `obj` (picklable; tensors on the CPU), in rank order, on rank 0; None on the others (a
    collective); [obj] without a process group."""
    import torch.distributed as dist

    rank, size = world()
    if size == 1:
        return [obj]
    if _collective_device() is not None:  # NCCL (older releases gather no objects): every rank gets them, 0 keeps
        every = all_gather(obj)
        return every if rank == 0 else None
    out: list[Any] | None = [None] * size if rank == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out
