"""The adaptive attacker (the paper's section 3.3): fine-tuning variants, LoRA, reverse distillation."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch
from torch import Tensor, nn

from ...capture import capture_mlp_io
from ...errors import IntegrityError, MLPSurgeryError
from ...io import atomic_write_text
from ...modules.dense import DenseMLP
from ...modules.dlr import DLRNet, rms_norm
from ...sites import find_sites
from ...train import FitConfig, fit, step_rng
from ...report import save_figure
from .captured import _CapturedSet
from .losses import relative_error
from .logits import _dlr_modules


@dataclass
class ReverseResult:
    layers: list[int]
    steps: int
    seconds: float
    seconds_per_layer: float
    relative_error: dict[int, float]
    history: list[dict]
    parts: dict[str, Tensor] | None = field(default=None, repr=False)  # the trained sub-blocks (`install_reversed`)

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "parts"}


def reverse_distill(locked: nn.Module, blocks: Tensor, layers: list[int], steps: int, lr: float = 2e-3,
                    tokens: int = 512, workdir: str | Path | None = None, seed: int = 0,
                    progress: bool = True) -> ReverseResult:
    """The attacker's way back: distil each locked layer's DLR sub-block into a stock pre-norm + dense MLP of
    the original shape (trained side by side over the chosen layers, as the defender did), on the locked
    model's own captured (x, DLR(x)) pairs. Returns the time spent and the relative error reached; the cost of
    unlocking the whole model is about seconds_per_layer x number of locked layers. `parts` holds what was
    trained (each layer's norm scale and dense MLP), which `install_reversed` puts in the locked model's place."""
    import tempfile

    sites = find_sites(locked)
    d = sites.config.hidden_size
    with tempfile.TemporaryDirectory() as tmp:
        cap = capture_mlp_io(locked, blocks, layers=layers, batch_size=8, out_dir=Path(workdir or tmp) / "capture",
                             dtype=torch.bfloat16, progress=progress)
        data = _CapturedSet(cap, layers, list(range(cap.n_chunks)), memory_limit_gb=8.0)
    torch.manual_seed(seed)
    # the stock sub-block the attacker wants back: RMSNorm (learnable scale) + the original dense MLP shape
    orig = _original_mlp_shape(locked)
    mlps = nn.ModuleList(DenseMLP(d, orig["h"], orig["activation"], orig["gated"]) for _ in layers)
    with torch.no_grad():
        for m in mlps:
            m.down.weight.zero_()  # start at the identity (relative error 1), as the defender's DLR-Nets did
    norms = nn.Parameter(torch.ones(len(layers), d))

    def forward(x: Tensor) -> Tensor:  # (n, T, d)
        return torch.stack([x[j] + mlps[j](rms_norm(x[j], 1e-6) * norms[j]) for j in range(len(layers))])

    def loss_fn(step: int):
        x, y = data.sample(tokens, step_rng(seed, step))
        rel = relative_error(forward(x), x, y)
        return rel.sum(), {"relative_error": float(rel.detach().mean())}

    params = {"norms": norms, **{f"mlp.{n}": p for n, p in mlps.named_parameters()}}
    res = fit(params, loss_fn, FitConfig(steps=steps, lr=lr, warmup=0.05, clip=1.0, seed=seed, log_every=10),
              progress=progress, desc="reverse distillation")
    with torch.no_grad():
        x, y = data.all()
        rel = relative_error(forward(x), x, y)
    parts = {"norms": norms.detach().clone(), **{f"mlp.{n}": p.detach().clone() for n, p in mlps.named_parameters()}}
    return ReverseResult(layers=layers, steps=steps, seconds=res.seconds, seconds_per_layer=res.seconds / len(layers),
                         relative_error={i: float(r) for i, r in zip(layers, rel)},
                         history=[{k: h[k] for k in ("step", "relative_error", "time_s")} for h in res.history],
                         parts=parts)


class ReversedSubblock(nn.Module):
    """The attacker's stock sub-block in a DLR-Net's place: RMS norm with its learned scale, then a dense MLP of
    the original shape; the layer adds it to the residual stream (`replace_subblock`), as reverse distillation
    trained it."""

    def __init__(self, scale: Tensor, mlp: nn.Module, eps: float = 1e-6):
        super().__init__()
        self.scale = nn.Parameter(scale.detach().clone())
        self.mlp, self.eps = mlp, eps

    def forward(self, x: Tensor) -> Tensor:
        return self.mlp(rms_norm(x, self.eps) * self.scale)


def install_reversed(model: nn.Module, layers: list[int], parts: dict[str, Tensor]) -> nn.Module:
    """Put the reverse-distilled sub-blocks (`ReverseResult.parts`) in place of the DLR-Nets at `layers`, in place:
    the dense model the attacker then fine-tunes as the original is fine-tuned."""
    for j, i in enumerate(layers):
        _install_one(model, i, j, parts)
    return model


def _install_one(model: nn.Module, i: int, j: int, parts: dict[str, Tensor]) -> None:
    """Layer i's DLR-Net replaced by the j-th reverse-distilled sub-block of `parts`."""
    sites = find_sites(model)
    if not isinstance(sites.mlp[i].module, DLRNet):
        raise MLPSurgeryError(f"layer {i} holds no DLR-Net to replace")
    orig = _original_mlp_shape(model)
    p = next(sites.layers()[i].parameters())  # (the other layers may not be read yet: `reversed_prepare`)
    mlp = DenseMLP(sites.config.hidden_size, orig["h"], orig["activation"], orig["gated"])
    prefix = f"mlp.{j}."
    mlp.load_state_dict({n[len(prefix):]: t for n, t in parts.items() if n.startswith(prefix)})
    sites.mlp[i].replace_subblock(ReversedSubblock(parts["norms"][j], mlp).to(device=p.device, dtype=p.dtype))


def reversed_prepare(layers: list[int], parts: dict[str, Tensor]):
    """The attack's prepare() that puts the reverse-distilled sub-blocks in place (`install_reversed`), also made a
    layer at a time (`finetune_attack` under torchrun: each layer's sub-block once its weights are read)."""
    def prepare(model: nn.Module) -> nn.Module:
        return install_reversed(model, layers, parts)

    def layer(model: nn.Module, i: int) -> None:
        if i in layers:
            _install_one(model, i, layers.index(i), parts)

    prepare.skeleton, prepare.layer = (lambda model: model), layer
    return prepare


def _original_mlp_shape(locked: nn.Module) -> dict:
    """The MLP shape before locking, from the model's config (inner width, activation, gated or not)."""
    cfg = locked.config
    h = getattr(cfg, "intermediate_size", None) or getattr(cfg, "n_inner", None) or getattr(cfg, "ffn_dim", None) \
        or 4 * cfg.hidden_size
    sites = find_sites(locked)
    gated = sites.spec.gate is not None or sites.spec.gate_up is not None
    return {"h": h, "gated": gated, "activation": sites.mlp[0].activation}


@dataclass
class AttackSuiteConfig:
    """The adaptive attacker of the paper's §3.3, run on the locked and the original model side by side."""

    lrs: tuple[float, ...] = (1e-5, 1e-4, 1e-3)  # plain fine-tuning at three learning rates
    steps: int = 40
    batch: int = 4
    attacks: tuple[str, ...] = ("finetune", "checkpointing", "lora", "frozen", "reverse")
    variant_lr: float = 1e-4  # learning rate of the checkpointing / frozen variants
    lora_rank: int = 8
    lora_lr: float = 1e-3
    reverse_layers: int | None = None  # layers reverse-distilled (None: every locked layer, then the dense model
    #                                    is fine-tuned as the original is: the route measured end to end)
    reverse_steps: int = 200
    eval_every: int = 10
    seed: int = 0

    def validate(self) -> None:
        known = {"finetune", "checkpointing", "lora", "frozen", "reverse"}
        bad = set(self.attacks) - known
        if bad:
            raise MLPSurgeryError(f"unknown attacks {sorted(bad)}; choose from {sorted(known)}")
        if self.steps < 1 or self.batch < 1:
            raise MLPSurgeryError("attack steps and batch must be >= 1")
        if self.reverse_layers is not None and self.reverse_layers < 1:
            raise MLPSurgeryError("reverse_layers must be >= 1 (or None: every locked layer)")


def attack_suite(original: nn.Module, locked: nn.Module, train_blocks: Tensor, eval_blocks: Tensor,
                 cfg: AttackSuiteConfig, out_dir: str | Path, progress: bool = True) -> dict:
    """Run every attack on both models; each finished run is written to out_dir/<name>.json, and a rerun
    skips what is there (an interrupted suite resumes).

    Under torchrun (every rank calling it with the same models and data) each fine-tuning run is sharded over the
    ranks (FSDP2, `finetune_attack`); rank 0 decides what is done (a finished result is rank 0's on every rank),
    writes the results and reports them. Reverse distillation is not split: every rank distils every layer, as one
    process does (rather than wait in a collective whose timeout a long distillation could pass), then takes rank
    0's sub-blocks, so that every rank's copy of the reverse route is the same. `original` and `locked` may be
    parallel.ShardedSource (`attack dlr` under torchrun): each run then reads its copy from the files into shards, and
    no rank holds either model whole; reverse distillation captures its pairs through a sharded copy."""
    from ... import parallel
    from ...measure.attacks import AttackConfig, finetune_attack, freeze, lora

    cfg.validate()
    rank, _ = parallel.world()
    out = Path(out_dir)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)

    def done(path: Path, *more: Path, keys=_RUN_KEYS):  # rank 0's reading of a finished result, on every rank
        def read():  # (None: not done; a damaged result is refused on every rank)
            found = path.exists() and all(p.exists() for p in more)
            return _read_result(path, out, keys) if found else None
        return parallel.from_rank0(parallel.on_rank0(read))

    def write(path: Path, row: dict) -> dict:  # rank 0 writes; every rank goes on with what a resumed suite reads
        if rank == 0:
            atomic_write_text(path, json.dumps(row))
        return json.loads(json.dumps(row))
    # (a ShardedSource: a model read into shards afresh for each run; its structure answers what the runs are)
    locked_skeleton, original_skeleton = (m.skeleton if isinstance(m, parallel.ShardedSource) else m
                                          for m in (locked, original))
    spec = find_sites(locked_skeleton).spec
    attn_targets = [n.rpartition(".")[2] for n in ([spec.q, spec.v] if spec.q else [spec.qkv])]
    mlp_names = {n for n, _ in _dlr_modules(locked_skeleton)}

    def is_dlr(name: str) -> bool:
        return any(name.startswith(m + ".") for m in mlp_names)

    def orig_mlp(name: str) -> bool:
        return any(name.startswith(p) for p in _mlp_prefixes(original_skeleton))

    jobs = []  # (family, name, model, AttackConfig overrides, prepare)
    if "finetune" in cfg.attacks:
        for lr in cfg.lrs:
            for who, model in (("original", original), ("locked", locked)):
                jobs.append((f"fine-tuning lr={lr:g}", f"finetune lr={lr:g} {who}", model, dict(lr=lr), None))
    if "checkpointing" in cfg.attacks:
        fam = f"gradient checkpointing lr={cfg.variant_lr:g}"
        for who, model in (("original", original), ("locked", locked)):
            jobs.append((fam, f"checkpointing {who}", model, dict(lr=cfg.variant_lr, gradient_checkpointing=True),
                         None))
        jobs.append((fam, "DLR-only checkpointing locked", locked, dict(lr=cfg.variant_lr), _checkpoint_dlr))
    if "lora" in cfg.attacks:
        fam = f"LoRA r={cfg.lora_rank} lr={cfg.lora_lr:g}"
        for who, model in (("original", original), ("locked", locked)):
            jobs.append((fam, f"LoRA attention {who}", model, dict(lr=cfg.lora_lr),
                         lora(cfg.lora_rank, target_modules=attn_targets)))
        jobs.append((fam, "LoRA on DLR locked", locked, dict(lr=cfg.lora_lr),
                     lora(cfg.lora_rank, target_parameters=["D", "U"])))
    if "frozen" in cfg.attacks:
        fam = f"MLP frozen lr={cfg.variant_lr:g}"
        jobs.append((fam, "MLPs frozen original", original, dict(lr=cfg.variant_lr), freeze(orig_mlp)))
        jobs.append((fam, "DLR frozen locked", locked, dict(lr=cfg.variant_lr), freeze(is_dlr)))

    results = []
    for family, name, model, kw, prepare in jobs:
        path = out / (name.replace(" ", "_").replace("=", "") + ".json")
        row = done(path)
        if row is not None:
            results.append(row)
            continue
        acfg = AttackConfig(steps=cfg.steps, batch=cfg.batch, eval_every=cfg.eval_every, seed=cfg.seed, **kw)
        res = finetune_attack(model, train_blocks, eval_blocks, acfg, name=name, prepare=prepare,
                              progress=progress and rank == 0)
        results.append(write(path, {**res.as_dict(), "family": family}))  # as a resumed suite will read it
    reverse = None
    if "reverse" in cfg.attacks:
        from safetensors.torch import save_file

        path, weights = out / "reverse_distillation.json", out / "reverse_distilled.safetensors"
        reverse = done(path, weights, keys=_REVERSE_KEYS)
        if reverse is not None:
            parts = parallel.from_rank0(parallel.on_rank0(lambda: _read_weights(weights, path, out)))
        else:
            layers = [s.index for s in find_sites(locked_skeleton).mlp
                      if isinstance(s.module, DLRNet)][:cfg.reverse_layers]
            source = isinstance(locked, parallel.ShardedSource)
            target = locked.load() if source else locked  # (sharded: its pairs captured by every rank together)
            rev = reverse_distill(target, train_blocks, layers, cfg.reverse_steps, seed=cfg.seed,
                                  progress=progress and rank == 0)
            if source:
                parallel.drop(target)
            reverse, parts = parallel.from_rank0((rev.as_dict(), rev.parts))  # one distillation for every rank
            reverse["locked_layers"] = len(mlp_names)
            reverse["estimated_seconds_all_layers"] = rev.seconds_per_layer * len(mlp_names)
            if rank == 0:
                save_file({k: v.contiguous() for k, v in parts.items()}, str(weights))
            reverse = write(path, reverse)
        if len(reverse["layers"]) == len(mlp_names):  # every DLR-Net distilled back: fine-tune the dense model
            name = "reverse-distilled locked"
            run = out / (name.replace(" ", "_") + ".json")
            row = done(run)
            if row is None:
                acfg = AttackConfig(steps=cfg.steps, batch=cfg.batch, eval_every=cfg.eval_every, seed=cfg.seed,
                                    lr=cfg.variant_lr)
                res = finetune_attack(locked, train_blocks, eval_blocks, acfg, name=name,
                                      progress=progress and rank == 0,
                                      prepare=reversed_prepare(reverse["layers"], parts))
                row = write(run, {**res.as_dict(), "family": f"reverse distillation, then fine-tuning "
                                  f"lr={cfg.variant_lr:g}", "offset_seconds": reverse["seconds"]})
                # the distillation comes first, on the attacker's clock
            results.append(row)
    return {"attacks": results, "reverse": reverse, "config": asdict(cfg)}


_RUN_KEYS = ("name", "history", "eval", "step_peak_bytes", "step_seconds", "trainable_params", "diverged")
_REVERSE_KEYS = ("layers", "steps", "seconds", "seconds_per_layer", "relative_error", "history")


def _damaged(path: Path, out: Path, again: str) -> IntegrityError:
    return IntegrityError(f"{path} is damaged (not the result mlpsurgery wrote: truncated or edited); delete it to "
                          f"{again}, or remove the results folder {out} to start afresh")


def _read_result(path: Path, out: Path, keys) -> dict:
    """A finished run's result (what a resumed suite reuses), or a one-line refusal when the file was damaged."""
    try:
        row = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        row = None
    if not isinstance(row, dict) or any(k not in row for k in keys) or \
            not all(isinstance(row[k], list) for k in ("history", "eval") if k in keys):
        raise _damaged(path, out, "run that attack again")
    return row


def _read_weights(weights: Path, record: Path, out: Path) -> dict[str, Tensor]:
    """The reverse-distilled sub-blocks a finished reverse distillation left, or a one-line refusal."""
    from safetensors.torch import load_file

    try:
        return load_file(str(weights))
    except Exception:  # noqa: BLE001 - safetensors raises its own types for a damaged file
        raise IntegrityError(f"{weights} is damaged (not the file mlpsurgery wrote); delete it and {record.name} to "
                             f"distil again, or remove the results folder {out} to start afresh") from None


def _checkpoint_dlr(model: nn.Module) -> nn.Module:
    """The adaptive attacker's checkpointing: keep each DLR-Net's input, recompute its blocks in backward."""
    for _, m in _dlr_modules(model):
        m.checkpoint = True
    return model


_checkpoint_dlr.flags_only = True  # a flag on modules, no weights: the sharded copy is made a layer at a time


def _mlp_prefixes(model: nn.Module) -> list[str]:
    path_of = {id(m): n for n, m in model.named_modules()}
    return [path_of[id(m)] + "." for s in find_sites(model).mlp for m in s.modules() if id(m) in path_of]


def attack_table(suite: dict) -> list[dict]:
    """One row per attack run: cost and progress, locked beside original."""
    rows = []
    for r in suite["attacks"]:
        ev = [e for e in r["eval"] if e["loss"] == e["loss"]]  # drop NaN (diverged)
        rows.append({"attack": r["name"], "step peak MiB": r["step_peak_bytes"] / 2**20,
                     "s / step": r["step_seconds"], "trainable": r["trainable_params"],
                     "held-out loss start": r["eval"][0]["loss"], "held-out loss end": ev[-1]["loss"] if ev else None,
                     "steps done": len(r["history"]), "diverged": r["diverged"],
                     "wall-clock s": r["history"][-1]["time_s"] if r["history"] else 0.0})
    return rows


def _first_reach(run: dict, target: float) -> float | None:
    """The attacker's training seconds at the first held-out evaluation at or below `target` (None: never)."""
    for e in run["eval"]:
        if e["loss"] == e["loss"] and e["loss"] <= target:
            return float(e["time_s"])
    return None


def adaptation_costs(suite: dict, defender_seconds: float | None = None, target: float | None = None) -> dict:
    """The paper's adaptation cost (eq. 2.2, Definition 2.3 (ii)) measured in the attacker's wall-clock seconds.

    target: the held-out loss to reach; default the original's fine-tuned loss (the best final held-out loss of its
    runs). For each route, the locked model's cost is the first time one of its runs of that route got
    to the target (None: not within the steps run; each run would get there, if at all, after the seconds it spent,
    so the route -- the attacker's pick of its runs -- costs at least the shortest of them: `at_least`),
    and the original's cost is the cheapest time any of the original's runs got there. A run that starts after
    other work on the attacker's clock carries it as `offset_seconds` (reverse distillation of every DLR-Net, then
    fine-tuning the dense model: the distillation's seconds come first). Where reverse distillation ran on only some
    layers, its route is estimated instead: the measured seconds per layer x the locked layers, then credited at
    the original's fine-tuning cost (optimistic for the attacker: the distilled model is the locked one, not the
    original, and starts from its loss). The amplification factor is C(locked) / C(original) for the cheapest
    locked route."""
    runs = suite["attacks"]
    originals = [r for r in runs if r["name"].endswith(" original")]
    lockeds = [r for r in runs if r["name"].endswith(" locked")]
    if not originals or not lockeds:
        raise MLPSurgeryError("the adaptation cost needs attack runs on both the original and the locked model")
    if target is None:  # the original's fine-tuned loss: the best any of its runs ended at
        ends = [ev[-1]["loss"] for r in originals if (ev := [e for e in r["eval"] if e["loss"] == e["loss"]])]
        if not ends:
            raise MLPSurgeryError("no fine-tuning run of the original has a held-out evaluation to aim at")
        target = min(ends)
    reached = [t for t in (_first_reach(r, target) for r in originals) if t is not None]
    c_orig = min(reached) if reached else None
    routes: dict[str, list[dict]] = {}
    for r in lockeds:
        routes.setdefault(r["family"], []).append(r)
    rows = []
    for family, group in routes.items():
        times = [(t + r.get("offset_seconds", 0.0), r["name"]) for r in group
                 if (t := _first_reach(r, target)) is not None]
        live = [r for r in group if not r.get("diverged")]  # a diverged run bounds nothing: it will never get there
        spent = min(((r["history"][-1]["time_s"] if r["history"] else 0.0) + r.get("offset_seconds", 0.0)
                     for r in live), default=None)
        best = min(times) if times else None
        rows.append({"route": family, "run": best[1] if best else None, "locked_seconds": best[0] if best else None,
                     "at_least": None if best else spent, "diverged": not best and not live})
    rev = suite.get("reverse")
    measured = any("offset_seconds" in r for r in lockeds)
    if rev and c_orig is not None and not measured:
        rows.append({"route": "reverse distillation of every DLR-Net (estimated from the layers run), then "
                              "fine-tuning credited at the original's cost",
                     "run": "reverse distillation", "locked_seconds": rev["estimated_seconds_all_layers"] + c_orig,
                     "at_least": None})
    for row in rows:
        row.setdefault("diverged", False)
        cost = row["locked_seconds"] if row["locked_seconds"] is not None else row["at_least"]
        row["factor"] = cost / c_orig if c_orig and cost is not None else None
        row["factor_is_lower_bound"] = row["locked_seconds"] is None
    finite = [r for r in rows if r["locked_seconds"] is not None]
    cheapest = min(finite, key=lambda r: r["locked_seconds"]) if finite else None
    return {"target_loss": target, "original_seconds": c_orig, "routes": rows,
            "cheapest_route": cheapest["route"] if cheapest else None,
            "amplification": cheapest["factor"] if cheapest else None,
            "amplification_lower_bound": None if cheapest else min((r["factor"] for r in rows if r["factor"]),
                                                                   default=None),
            "defender_seconds": defender_seconds}


def plot_attack_suite(suite: dict, path: str | Path) -> None:
    """Training loss against steps (top row) and against the attacker's wall-clock seconds (bottom row), one
    column per attack family, locked (red) beside original (blue); dashed = DLR-specific variants."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    families: dict[str, list[dict]] = {}
    for r in suite["attacks"]:
        families.setdefault(r["family"], []).append(r)
    fig, axes = plt.subplots(2, len(families), figsize=(3.8 * len(families), 6.6), squeeze=False)
    for j, (family, runs) in enumerate(families.items()):
        for r in runs:
            locked = r["name"].endswith("locked")
            dlr_specific = "DLR" in r["name"]
            style = dict(color="tab:red" if locked else "tab:blue", linestyle="--" if dlr_specific else "-")
            steps = [h["step"] for h in r["history"]]
            loss = [h["loss"] for h in r["history"]]
            axes[0][j].plot(steps, loss, label=r["name"], **style)
            axes[1][j].plot([h["time_s"] for h in r["history"]], loss, **style)
            if r["diverged"] and steps:
                axes[0][j].scatter([steps[-1]], [loss[-1]], marker="x", color="black", zorder=5)
                axes[1][j].scatter([r["history"][-1]["time_s"]], [loss[-1]], marker="x", color="black", zorder=5)
        axes[0][j].set_title(family, fontsize=9)
        axes[0][j].set_xlabel("step")
        axes[1][j].set_xlabel("attacker wall-clock (s)")
        axes[0][j].legend(fontsize=7)
    for row in axes:
        row[0].set_ylabel("training loss (nats/token)")
    fig.suptitle("Fine-tuning attacks on the DLR-locked model (red) and the original (blue); x: diverged",
                 fontsize=10)
    save_figure(fig, path)


def plot_adaptation(suite: dict, costs: dict, path: str | Path) -> None:
    """Held-out loss against the attacker's seconds (a run's `offset_seconds` included: the reverse route starts
    after its distillation), every run of the suite, locked routes red, the original blue, the target (the
    original's fine-tuned loss) dashed: where a curve crosses it is that route's adaptation cost."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10.5, 5.2))
    for r in suite["attacks"]:
        ev = [e for e in r["eval"] if e["loss"] == e["loss"]]
        if not ev:
            continue
        off = r.get("offset_seconds", 0.0)
        locked = r["name"].endswith("locked")
        ax.plot([e["time_s"] + off for e in ev], [e["loss"] for e in ev], marker="o", markersize=3,
                color="tab:red" if locked else "tab:blue", alpha=0.9 if "reverse" in r["name"] else 0.55,
                linestyle=":" if "reverse" in r["name"] else "-", label=r["name"])
        if off:
            ax.axvspan(0, off, color="tab:red", alpha=0.06)
            ax.text(off / 2, 0.03, "reverse distillation", transform=ax.get_xaxis_transform(), ha="center",
                    fontsize=7)
    ax.axhline(costs["target_loss"], color="black", linestyle="--", linewidth=1,
               label=f"target: the original's fine-tuned loss {costs['target_loss']:.3f}")
    ax.set_xlabel("attacker's training seconds")
    ax.set_ylabel("held-out loss (nats/token)")
    ax.set_title("Adaptation cost: held-out loss vs the attacker's seconds, locked (red) and original (blue)",
                 fontsize=9)
    ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1))
    save_figure(fig, path)

