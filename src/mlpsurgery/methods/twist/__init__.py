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
built as a physically smaller dense model through `mlpsurgery.subsets.subset_model`, the scale folded in.
For attention, kappa maps to max(1, round(kappa * KV groups)) groups (SmolLM2: 3 groups, so 8/12 and
6/12 keep 2 of 3, 4/12 and 3/12 keep 1 of 3) unless `attn_keep` says otherwise. Where the stock attention
takes its head count from the config (GPT-2, OPT, Phi-3), a layer with fewer heads gets the registered
attention of `modules/attention.py`, whose count follows its projections: the same physical subnets train in
true / hybrid mode and are extracted, saved and reloaded like any other. With calibration text (`refit_subnet_`,
`twist extract --calib-data`) the narrowed MLPs' down projections are then refit in sequence to the original's
outputs, the closed-form compensation every width-reducing method of the package has.

Refusals come before work: rank 0 checks the layout, builds the subnet skeleton and claims the checkpoint
folder (settings, model fingerprint, data digest: checkpoint.py) and tells every rank the outcome before any
waits for work (distributed.on_rank0), so each process ends with the same one-line error and nothing is written.

The package, one file per concern:
    generator.py    Algorithm 1 and the deployment draw (block indices per layer)
    blocks.py       the layout (partitioned layers, N_full / N_sub) and the subnets of a round
    hooks.py        masks (an emulated subnet) and the activation shift
    aggregation.py  filling a physical subnet, flat buffers, FedAvg
    config.py       TwISTConfig, data shards and batches, per-round generator and learning rate
    distributed.py  torch.distributed: process group, rank 0's checks shared with every rank, counted
                    collectives, shipping structures
    checkpoint.py   resumable folders: claimed with the settings, model fingerprint and data digest
    training.py     twist_train: the rounds of every mode, checkpoint / resume, the dp baseline
    extraction.py   twist_extract: a random subnet as a physically smaller dense model; refit_subnet_
"""

from __future__ import annotations

from .aggregation import Aggregator, fill_subnet, flatten, shared_parameters, unflatten
from .blocks import PARTS, Layout, Subnet, make_layout
from .config import TwISTConfig, make_shards
from .distributed import Comm, init_distributed, on_rank0
from .extraction import materialize, refit_subnet_, trained_settings, twist_extract
from .generator import attn_keep_for, check_subnet_size, deployment_subnet, generate_blueprint
from .hooks import (Hooks, attn_feature_blocks, gate_inputs, mlp_feature_blocks, scale_outputs,
                    subnet_hooks)
from .training import MODES, TwISTResult, twist_train

__all__ = ["Aggregator", "Comm", "Hooks", "Layout", "MODES", "PARTS", "Subnet", "TwISTConfig", "TwISTResult",
           "attn_feature_blocks", "attn_keep_for", "check_subnet_size", "deployment_subnet", "fill_subnet", "flatten",
           "gate_inputs", "generate_blueprint", "init_distributed", "make_layout", "make_shards", "materialize",
           "mlp_feature_blocks", "on_rank0", "refit_subnet_", "scale_outputs", "shared_parameters", "subnet_hooks",
           "trained_settings", "twist_extract", "twist_train", "unflatten"]
