"""torch.distributed plumbing for TwIST: the collective calls it makes (counting bytes), shipping a model's
structure to another rank and rebuilding it there, and per-rank statistics (joining the group and rank 0's checks:
mlpsurgery.parallel)."""

from __future__ import annotations

import resource

import torch
from torch import Tensor, nn

from ... import parallel
from ...errors import MLPSurgeryError
from ...train import trainable
from .aggregation import _params


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


init_distributed = parallel.init  # joining the group torchrun describes (gloo on CPU, NCCL on CUDA)
on_rank0 = parallel.on_rank0  # rank 0's checks and loading, its refusal raised on every rank
_distributed = parallel.world


def _structure(model: nn.Module) -> dict:
    """What another rank needs to build an empty copy of `model` (no weights; buffers such as RoPE tables)."""
    from ...io import replaced_modules

    return {"config": model.config.to_dict(), "class": type(model).__name__, "modules": replaced_modules(model),
            "shapes": [(n, list(p.shape)) for n, p in _params(model).items()],
            "buffers": {n: b.detach().cpu() for n, b in model.named_buffers()}}


def _build(structure: dict, device: torch.device) -> nn.Module:
    """The model `_structure` describes, allocated once at its own size (built on the meta device, so a worker
    never holds the full model even for a moment); parameters uninitialised until rank 0 sends them."""
    import transformers

    from ...io import rebuild

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


def _meta_copy(model: nn.Module) -> nn.Module:
    """`model`'s structure on the meta device (no memory): for checking that its subnets can be built."""
    from ...io import rebuild, replaced_modules

    with torch.device("meta"):
        return rebuild(model.config, type(model).__name__, replaced_modules(model))


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


def _counting_allreduce(state: dict, bucket):
    """DDP communication hook: all-reduce each gradient bucket as DDP does by default, counting its bytes."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    buf = bucket.buffer()
    state["bytes"] += buf.numel() * buf.element_size()
    return allreduce_hook(None, bucket)
