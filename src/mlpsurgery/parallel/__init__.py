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

from .fsdp import (ShardedSource, drop, find_layers, full_value, is_dtensor, is_sharded, load_sharded, local_bytes,
                   release, rows, save_sharded, shard, shard_copy, unshard)
from .group import (all_gather, alone, barrier, check_split, from_rank, from_rank0, gather_to_rank0, init, launched,
                    mean_over_ranks, on_rank0, owners, rank0_outcome, rank_device, rank_folder, recv_from,
                    same_on_every_rank, send_to, share, sum_over_ranks, sum_over_ranks_, world)

__all__ = ["ShardedSource", "all_gather", "alone", "barrier", "check_split", "drop", "find_layers", "from_rank",
           "from_rank0", "full_value", "gather_to_rank0", "init", "is_dtensor", "is_sharded", "launched",
           "load_sharded", "local_bytes", "mean_over_ranks", "on_rank0", "owners", "rank0_outcome", "rank_device",
           "rank_folder", "recv_from", "release", "rows", "same_on_every_rank", "save_sharded", "send_to", "shard",
           "shard_copy", "share", "sum_over_ranks", "sum_over_ranks_", "unshard", "world"]
