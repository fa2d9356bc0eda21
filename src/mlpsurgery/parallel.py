"""torch.distributed for the commands that train: joining the process group torchrun describes, rank 0's checks
shared with every rank, and FSDP2 (`torch.distributed.fsdp.fully_shard`) for a model that outgrows one process.

Sharded training is data parallel with every parameter, gradient and optimizer moment split across the ranks:
`shard(model)` makes each decoder layer (the sites know where they are) one FSDP unit and the rest (embeddings,
final norm, LM head, tied or not) the root unit, in place; while it is sharded, `rows(batch)` gives each rank its
share of the step's batch (the global batch of one process, split in order), the gradients are averaged across
ranks by FSDP, and `fit` (train.py) reports the loss averaged over the ranks, clips by the global gradient norm
and checkpoints full tensors — so a sharded run computes what one process computes with the same batch (up to
floating-point summation order), and a checkpoint written by N ranks resumes in one process or in M.
`unshard(model)` turns the model back into the plain one, in place, with the trained weights (on every rank, or
only on rank 0 with `keep_on=0`), ready to save.

Commands join through `init(device)` under `torchrun --nproc-per-node N -m mlpsurgery ...`; gloo on CPU (what
the tests run: two processes on one machine), NCCL on CUDA, one GPU per rank (LOCAL_RANK).
"""

from __future__ import annotations

import contextlib
import copy
import os
from typing import Any, Callable

import torch
from torch import Tensor, nn

from .errors import MLPSurgeryError


def world() -> tuple[int, int]:
    """(rank, world size) of the process group this process has joined; (0, 1) without one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


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
    dist.init_process_group(backend=backend)
    return dist.get_rank(), dist.get_world_size()


def on_rank0(prepare: Callable[[], Any]) -> Any:
    """Run rank 0's `prepare` (loading, checks, claims) and tell every rank how it went, before any rank waits on
    another for work. A refusal on rank 0 is raised on every rank with the same class and message, so each
    process ends with the one-line error (exit status 2) instead of the others dying on a closed connection.
    Call it on every rank; the others get None. Without torch.distributed it is just `prepare()`."""
    from . import errors

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


# --------------------------------------------------------------------------------------------------
# FSDP2


def is_dtensor(t: Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def is_sharded(model: nn.Module) -> bool:
    """Whether `model` is sharded by `shard` (its parameters are split across the ranks)."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


_SKELETONS: dict[int, nn.Module] = {}  # id(sharded model) -> its structure before sharding, weights on meta


def shard(model: nn.Module, device: str | torch.device = "cpu") -> nn.Module:
    """Shard `model` in place across the ranks of the process group (FSDP2: one unit per decoder layer, the root
    holding the rest). Every rank must hold the same model. Returns the model."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from .sites import find_sites

    rank, size = world()
    if size == 1:
        raise MLPSurgeryError("sharding needs several processes: launch the command with torchrun --nproc-per-node N")
    if is_sharded(model):
        return model
    dtypes = {p.dtype for p in model.parameters()}
    if len(dtypes) > 1:
        raise MLPSurgeryError(f"the model mixes parameter dtypes {sorted(map(str, dtypes))}; FSDP needs one: "
                              "load it with --dtype")
    # the structure before sharding, with every parameter on the meta device (no memory): `unshard` fills it with
    # the trained weights and swaps it back in, so the caller's model object becomes the plain model again
    memo: dict[int, Any] = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    skeleton = copy.deepcopy(model, memo)
    device = torch.device(device)
    mesh = init_device_mesh(device.type, (size,))
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # a peft wrapper: its model's
    for layer in find_sites(base).layers():  # layers (with their adapters) are the units
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    _SKELETONS[id(model)] = skeleton
    return model


def release(model: nn.Module) -> None:
    """Forget a sharded model that is being dropped without unsharding it (its skeleton, kept for `unshard`)."""
    _SKELETONS.pop(id(model), None)


def unshard(model: nn.Module, keep_on: int | None = None) -> nn.Module:
    """Undo `shard` in place: gather every parameter's full value (a collective: call it on every rank) and turn
    `model` back into the plain model holding them. keep_on=R: only rank R keeps the weights (the others' model
    is left on the meta device, to be dropped). Returns the model."""
    if not is_sharded(model):
        return model
    skeleton = _SKELETONS.pop(id(model))
    rank, _ = world()
    keep = keep_on is None or keep_on == rank
    plain = dict(skeleton.named_parameters(remove_duplicate=False))
    full: dict[int, nn.Parameter] = {}
    with torch.no_grad():
        for name, p in model.named_parameters(remove_duplicate=False):
            if id(p) not in full:
                value = p.full_tensor() if is_dtensor(p) else p.detach()
                full[id(p)] = nn.Parameter(value.clone() if keep else torch.empty_like(value, device="meta"),
                                           requires_grad=p.requires_grad)
            owner, _, leaf = name.rpartition(".")
            target = skeleton.get_submodule(owner) if owner else skeleton
            if name not in plain:
                raise MLPSurgeryError(f"the sharded model gained parameter {name} while training; cannot unshard it")
            target._parameters[leaf] = full[id(p)]
    # The caller's object becomes the plain model: its class and attributes are the skeleton's (the root's FSDP
    # hooks and state go with the old attributes; the layers were deep-copied before sharding and never were FSDP).
    with contextlib.suppress(Exception):  # torch keeps a registry of composable state by module; drop ours
        from torch.distributed._composable_state import _module_state_mapping

        _module_state_mapping.pop(model, None)
    model.__class__ = skeleton.__class__
    model.__dict__ = skeleton.__dict__
    return model


def check_split(n: int, flag: str = "--batch-size") -> None:
    """Refuse a batch of `n` that the ranks cannot share equally (`flag`: the option that sets it)."""
    size = world()[1]
    if n % size:
        raise MLPSurgeryError(f"a batch of {n} does not split evenly over {size} ranks; give a {flag} that "
                              f"is a multiple of {size}")


def rows(batch: Tensor | list, model: nn.Module) -> Tensor | list:
    """This rank's share of a step's batch while `model` is sharded (the batch unchanged otherwise): the global
    batch split in order into equal parts, so the ranks together see exactly one process's batch."""
    if not is_sharded(model):
        return batch
    rank, size = world()
    n = len(batch)
    check_split(n)
    per = n // size
    return batch[rank * per:(rank + 1) * per]


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
    import torch.distributed as dist

    if world()[1] == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, device=_collective_device())
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


def local_bytes(params) -> int:
    """Bytes this rank holds of the given parameters (its shard of a sharded one)."""
    total = 0
    for p in params:
        t = p.to_local() if is_dtensor(p) else p
        total += t.numel() * t.element_size()
    return total
