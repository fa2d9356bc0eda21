"""Fine-tuning attacks: what an adversary who holds the weights does to adapt a (locked) model.

`finetune_attack` fine-tunes a copy of a causal LM on token blocks and records the training loss against
steps and wall-clock time, the held-out loss at intervals, the peak memory of one training step and
whether the run diverged. Variants are expressed by `prepare(model) -> model`, applied to the copy before
training: freeze parameters, wrap with LoRA (`lora`), switch on gradient checkpointing. The original model
is never modified. Under torchrun the copy is sharded over the ranks (FSDP2), made a decoder layer at a time: a
prepare() that sets flags sets them on the structure first, one that makes weights (LoRA's adapters) carries
`.skeleton` (its flags) and `.layer(model, i)` (its weights for layer i, once the layer is real); the model may be a
parallel.ShardedSource (read from its files for each run). Each rank takes its share of every batch, and the cost
measured is one rank's: its seconds and its peak memory.
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch
from torch import Tensor, nn

from ..errors import MLPSurgeryError
from ..train import FitConfig, StopTraining, fit, lm_loss, trainable
from .cost import measure_cost


@dataclass
class AttackConfig:
    lr: float = 1e-4
    steps: int = 40
    batch: int = 4  # blocks per step
    gradient_checkpointing: bool = False  # transformers' per-layer activation checkpointing
    eval_every: int = 10
    warmup: float = 0.05
    seed: int = 0
    divergence_nats: float = 3.0  # the run has diverged once its loss exceeds the first loss by this much
    measure_memory: bool = True


@dataclass
class AttackResult:
    name: str
    config: dict
    history: list[dict]  # per step: step, loss, time_s
    eval: list[dict]  # step, loss (mean NLL on the held-out blocks), time_s
    step_peak_bytes: int
    step_seconds: float  # median time of one training step (forward + backward + optimizer)
    trainable_params: int
    diverged: bool
    seconds: float = 0.0
    notes: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)


@torch.no_grad()
def mean_nll(model: nn.Module, blocks: Tensor, batch: int = 4) -> float:
    """Mean next-token NLL over every position but the first of each block."""
    was = model.training
    model.eval()
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for s in range(0, len(blocks), batch):
        ids = blocks[s:s + batch].to(device)
        loss = model(input_ids=ids, labels=ids).loss
        n = ids.numel() - ids.shape[0]
        total += float(loss) * n
        count += n
    model.train(was)
    return total / count


def lora(rank: int = 8, target_modules: list[str] | None = None, target_parameters: list[str] | None = None,
         alpha: int | None = None) -> Callable[[nn.Module], nn.Module]:
    """A prepare() that wraps the model with LoRA adapters through peft (modules and/or raw parameters)."""
    from peft import LoraConfig, get_peft_model

    def config() -> LoraConfig:
        return LoraConfig(r=rank, lora_alpha=alpha or 2 * rank, target_modules=target_modules or [],
                          target_parameters=target_parameters, lora_dropout=0.0, bias="none")

    def prepare(model: nn.Module) -> nn.Module:
        return get_peft_model(model, config())

    def skeleton(model: nn.Module) -> nn.Module:  # what get_peft_model freezes: everything but the adapters
        for p in model.parameters():
            p.requires_grad_(False)
        return model

    def layer(model: nn.Module, i: int) -> None:
        """Layer i's adapters, as get_peft_model makes them over the whole model (drawn in the same order, the
        16-bit base's adapters held in float32 alike), once the layer's weights are read."""
        from peft import LoraModel

        from .. import parallel

        block = parallel.find_layers(model)[i]
        names = set(target_modules or [])
        params = set(target_parameters or [])
        if not any(n.rpartition(".")[2] in names for n, _ in block.named_modules()) and \
                not any(n.rpartition(".")[2] in params for n, _ in block.named_parameters()):
            return  # nothing of this layer is a target (get_peft_model passes it by too)
        LoraModel(block, config(), "default")._cast_adapter_dtype("default", autocast_adapter_dtype=True)

    prepare.skeleton, prepare.layer = skeleton, layer  # the same made a layer at a time (`finetune_attack`)
    return prepare


def freeze(predicate: Callable[[str], bool]) -> Callable[[nn.Module], nn.Module]:
    """A prepare() that freezes every parameter whose name satisfies `predicate`."""

    def prepare(model: nn.Module) -> nn.Module:
        for n, p in model.named_parameters():
            if predicate(n):
                p.requires_grad_(False)
        if not any(p.requires_grad for p in model.parameters()):
            raise MLPSurgeryError("the attack freezes every parameter; nothing is left to train")
        return model

    prepare.flags_only = True  # it sets flags, creates no weights: runs on a copy whose weights are not made yet
    return prepare


def finetune_attack(model: nn.Module, train_blocks: Tensor, eval_blocks: Tensor, cfg: AttackConfig, name: str = "",
                    prepare: Callable[[nn.Module], nn.Module] | None = None, progress: bool = True) -> AttackResult:
    """Fine-tune a copy of `model` on `train_blocks` as an attacker would, measuring cost and progress (under
    torchrun with several ranks: sharded with FSDP2, every rank calling it with the same arguments)."""
    from .. import parallel

    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []

    def structure(m: nn.Module, flags=prepare) -> nn.Module:
        for p in m.parameters():
            p.requires_grad_(True)
        if flags is not None:  # what it draws (LoRA's A matrices) is the same in every run and on every rank
            with torch.random.fork_rng(devices=devices):  # the caller's generators go on as they were
                torch.manual_seed(cfg.seed)
                m = flags(m)
        if cfg.gradient_checkpointing:
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return m

    sharded = parallel.world()[1] > 1
    if sharded:  # each rank's share of the copy made a layer at a time: no rank holds the model twice (or, for a
        #         ShardedSource, at all)
        flags_only = prepare is None or getattr(prepare, "flags_only", False)
        if not flags_only and getattr(prepare, "layer", None) is None:
            raise MLPSurgeryError(f"internal: attack {name!r} cannot be made a layer at a time")
        flags = prepare if flags_only else prepare.skeleton

        def work(m: nn.Module, i: int) -> None:  # the draws start from the seed, as `structure`'s whole-model ones
            if i == 0:
                torch.manual_seed(cfg.seed)
            prepare.layer(m, i)

        with torch.random.fork_rng(devices=devices):
            if isinstance(model, parallel.ShardedSource):  # read afresh from the files
                m = model.load(structure=lambda s: structure(s, flags), work=None if flags_only else work)
            else:  # FSDP splits each rank's copy: they must be the same model
                from ..files import model_fingerprint

                parallel.same_on_every_rank("models to attack", model_fingerprint(model))
                m = parallel.shard_copy(model, next(model.parameters()).device, lambda s: structure(s, flags),
                                        work=None if flags_only else work)
    else:
        m = structure(copy.deepcopy(model))
    m.train()
    params = trainable(m)
    sample = parallel.rows(train_blocks[:cfg.batch], m)  # one rank's share of a step's batch when sharded
    probe = measure_cost(m, sample, repeats=1, warmup=1, memory=cfg.measure_memory)
    m.train()
    evals = [(0, mean_nll(m, eval_blocks))]
    base = lm_loss(m, train_blocks, cfg.batch, seed=cfg.seed)
    state = {"first": None, "eval_s": 0.0}

    def loss_fn(step: int):
        if step and step % cfg.eval_every == 0:
            t = time.perf_counter()
            evals.append((step, mean_nll(m, eval_blocks)))
            state["eval_s"] += time.perf_counter() - t
        loss = base(step)
        value = float(loss.detach())
        if sharded:  # every rank decides on divergence from the same number: the loss one process would see
            value = float(parallel.mean_over_ranks(loss.detach().double().reshape(1)))
        if state["first"] is None:
            state["first"] = value
        if not math.isfinite(value) or value > state["first"] + cfg.divergence_nats:
            raise StopTraining(f"diverged at step {step}: loss {value:.3g} (first {state['first']:.3g})")
        return loss, {"eval_s": state["eval_s"]}

    fcfg = FitConfig(steps=cfg.steps, lr=cfg.lr, warmup=cfg.warmup, clip=1.0, seed=cfg.seed, log_every=5,
                     checkpoint_every=cfg.steps + 1)
    res = fit(params, loss_fn, fcfg, progress=progress, desc=f"attack {name}".strip())
    # the attacker's wall-clock: training time only, held-out evaluation excluded
    hist = [{"step": h["step"], "loss": h["loss"], "time_s": h["time_s"] - h["eval_s"]} for h in res.history]
    diverged = res.stopped_early is not None
    if not diverged:
        evals.append((cfg.steps, mean_nll(m, eval_blocks)))
    clock = {0: 0.0, **{h["step"]: h["time_s"] for h in hist}}
    eval_hist = [{"step": s, "loss": v, "time_s": clock.get(s, hist[-1]["time_s"] if hist else 0.0)}
                 for s, v in evals]
    step_times = [b["time_s"] - a["time_s"] for a, b in zip(hist, hist[1:])]
    step_s = sorted(step_times)[len(step_times) // 2] if step_times else probe.step_s
    notes = {"stopped": res.stopped_early} if diverged else {}
    parallel.release(m)
    if sharded:
        notes["world_size"] = parallel.world()[1]  # step_peak_bytes and the seconds are one rank's
    return AttackResult(name=name, config=asdict(cfg), history=hist, eval=eval_hist,
                        step_peak_bytes=probe.step_peak_bytes, step_seconds=step_s,
                        trainable_params=sum(int(p.numel()) for p in params.values()), diverged=diverged,
                        seconds=res.seconds, notes=notes)
