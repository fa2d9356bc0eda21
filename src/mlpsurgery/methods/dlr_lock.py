"""DLR-Lock: lock a pretrained model against fine-tuning (papers/dlr-lock.txt, SPEC §1).

Every MLP residual sub-block `x -> x + MLP(Norm(x))` is replaced by a deep low-rank residual network
(modules/dlr.py) distilled to compute the same function, so inference is unchanged while a training step
must store activations for every one of the DLR-Net's blocks.

    Phase 1 (module-wise): capture (x, y) of every sub-block on calibration text (capture.py, on disk,
      resumable); train all layers' DLR-Nets side by side as one batched network (StackedDLR) on the
      relative MSE  sum ||DLR(x) - y||^2 / sum ||y - x||^2  (1.0 = no better than identity), AdamW, cosine
      with 5% warm-up, gradient norm clipped to 1.0 *per layer* (so batching changes nothing: AdamW is
      element-wise and each layer's loss touches only its own parameters).
    Phase 2 (logits): with every MLP replaced, train only the DLR-Net parameters so that the student's
      next-token distribution matches the original's: top-k KL with the teacher's top-k tokens and one
      bucket for the rest of the mass (a k+1-way KL: unlike a sum restricted to the top-k alone, its optimum
      does not push the student's tail mass to zero). Teacher targets are computed once before the
      surgery and stored. Encoders without an LM head distil the final hidden states (relative MSE).

Everything intermediate lives in a work folder (capture, checkpoints, teacher targets): a killed run
resumes where it stopped and nothing finished is recomputed.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn
from tqdm.auto import tqdm

from ..capture import capture_mlp_io, fingerprint, open_capture
from ..errors import IntegrityError, MLPSurgeryError
from ..io import atomic_write_text, record
from ..measure.perplexity import is_causal_lm
from ..modules.dlr import DLRNet, StackedDLR, dlr_depth, rms_norm
from ..sites import find_sites, parse_layers
from ..train import FitConfig, fit, step_rng
from ..report import save_figure


@dataclass
class DLRConfig:
    """Settings of DLR-Lock. Defaults are sized for SmolLM2-135M on a CPU (see docs/dlr-lock.md)."""

    rank: int = 64  # bottleneck r of every block; smaller r = deeper = more locking
    depth: int | None = None  # blocks per DLR-Net; None: match the replaced MLP's parameter count
    layers: str = "all"  # which layers to lock (parse_layers syntax)
    eps: float = 1e-6
    block_len: int = 256  # tokens per calibration block
    calib_blocks: int = 256  # phase-1 capture: calib_blocks x block_len tokens
    capture_dtype: str = "bfloat16"  # storage of captured activations
    phase1_steps: int = 2000
    phase1_lr: float = 1e-2  # 3e-3 for 150 steps left the attention-sink layers unlearned (docs/dlr-lock.md)
    phase1_tokens: int = 512  # tokens per layer per step
    phase1_weight_decay: float = 0.0
    phase1_val_fraction: float = 0.1  # captured chunks held out to report the relative error
    # Our phase-1 recipe (docs/dlr-lock.md: better on the 99% of tokens the paper's loss cannot see in the
    # attention-sink layers); phase1_loss="relative", phase1_hard_fraction=0 is the paper's.
    phase1_hard_fraction: float = 0.125  # share of each phase-1 batch drawn in proportion to ||y_t - x_t|| (rest uniform)
    phase1_loss: str = "token"  # relative: sum_t ||e_t||^2 / sum_t ||y_t - x_t||^2 | token: see token_relative_error
    compile: bool = True  # torch.compile phase 1's batched network (2.6x faster on one CPU thread); eager if it fails
    phase2_steps: int = 200
    phase2_lr: float = 1e-4
    phase2_batch: int = 4  # blocks per step
    phase2_blocks: int = 256  # teacher-labelled training blocks
    top_k: int = 32
    gradient_checkpointing: bool = True  # phase 2 recomputes each DLR-Net's blocks instead of storing them
    seed: int = 0
    memory_limit_gb: float = 8.0  # load the captured set into RAM when it fits, else read chunks per step

    def validate(self) -> None:
        if self.calib_blocks < 2:
            raise MLPSurgeryError(f"DLR-Lock: calib-blocks must be >= 2 (phase 1 holds some out to measure the error on "
                                  f"tokens it did not train on), not {self.calib_blocks}")
        for name in ("rank", "calib_blocks", "phase1_tokens", "phase2_batch", "phase2_blocks", "top_k", "block_len"):
            if getattr(self, name) < 1:
                raise MLPSurgeryError(f"DLR-Lock: {name.replace('_', '-')} must be >= 1, not {getattr(self, name)}")
        if self.depth is not None and self.depth < 1:
            raise MLPSurgeryError(f"DLR-Lock: depth must be >= 1, not {self.depth}")
        if self.phase1_loss not in PHASE1_LOSSES:
            raise MLPSurgeryError(f"DLR-Lock: phase1-loss must be one of {', '.join(PHASE1_LOSSES)}, not {self.phase1_loss!r}")
        if not 0.0 <= self.phase1_hard_fraction < 1.0:
            raise MLPSurgeryError(f"DLR-Lock: phase1-hard-fraction must be in [0, 1), not {self.phase1_hard_fraction}")
        if self.phase1_steps < 0 or self.phase2_steps < 0:
            raise MLPSurgeryError("DLR-Lock: step counts must be >= 0")


@dataclass
class DLRReport:
    layers: list[int]
    depth: int
    rank: int
    params_mlp: int  # parameters of the replaced MLPs
    params_dlr: int  # parameters of the DLR-Nets
    phase1_relative_error: dict[int, float] = field(default_factory=dict)  # per layer, on held-out captured tokens
    phase2_relative_error: dict[int, float] = field(default_factory=dict)  # same tokens, after phase 2
    phase1_seconds: float = 0.0
    phase2_seconds: float = 0.0
    phase1_history: list[dict] = field(default_factory=list)
    phase2_history: list[dict] = field(default_factory=list)
    capture_tokens: int = 0
    phase2_tokens_per_step: int = 0

    def as_dict(self) -> dict:
        return asdict(self)


def relative_error(pred: Tensor, x: Tensor, y: Tensor) -> Tensor:
    """Per-layer relative MSE sum ||pred - y||^2 / sum ||y - x||^2 over tokens. Inputs (n, T, d) -> (n,)."""
    return (pred - y).pow(2).sum((1, 2)) / (y - x).pow(2).sum((1, 2)).clamp_min(1e-30)


def token_relative_error(pred: Tensor, x: Tensor, y: Tensor, floor: Tensor) -> Tensor:
    """Per-layer mean over tokens of 2 ||pred_t - y_t||^2 / (||y_t - x_t||^2 + floor): 1.0 = no better than
    the identity for a token whose update equals the floor. floor: (n,) per layer, the median update
    energy of the captured tokens.

    Why: in some layers a handful of tokens (the attention-sink first token, whose 'massive activation' a
    layer writes or erases) hold > 95% of sum ||y - x||^2, so the paper's relative MSE is decided by them
    alone and every other token's error is invisible to it. Here each token counts for its own relative
    error (the floor keeps near-zero updates from dominating)."""
    e = (pred - y).pow(2).sum(-1)
    n = (y - x).pow(2).sum(-1)
    return 2 * (e / (n + floor[:, None])).mean(-1)


PHASE1_LOSSES = ("relative", "token")


def rank_for_depth(budget: int, d: int, depth: int) -> int:
    """The bottleneck rank whose `depth` blocks best match a parameter budget (inverse of dlr_depth)."""
    rank = round((budget / depth - d - 1) / (2 * d))
    if rank < 1:
        raise MLPSurgeryError(f"depth {depth} leaves less than rank 1 per block for an MLP of {budget} parameters; "
                              f"the largest depth is {dlr_depth(budget, d, 1)}")
    return rank


def plan(model: nn.Module, cfg: DLRConfig) -> tuple[list[int], int, int]:
    """(layers, depth, MLP parameters per layer). Every locked layer gets the same depth (one stacked net)."""
    sites = find_sites(model)
    layers = parse_layers(cfg.layers, len(sites))
    budgets = {sum(p.numel() for p in sites.mlp[i].parameters()) for i in layers}
    locked = [i for i in layers if isinstance(sites.mlp[i].module, DLRNet)]
    if locked:
        raise MLPSurgeryError(f"layers {locked} are already DLR-locked; choose other layers (--layers)")
    # Any other module computing the sub-block (nested, fused, pruned MLPs) is distilled as it is: phase 1 sees
    # only what enters and leaves the sub-block.
    budget = max(budgets)
    depth = cfg.depth or dlr_depth(budget, sites.config.hidden_size, cfg.rank)
    return layers, depth, budget


def _stage(workdir: Path, name: str, settings: dict) -> bool:
    """Whether stage `name` already finished in `workdir` with these settings. A stage started or finished
    with other settings is an error: its state would silently corrupt this run."""
    path = workdir / f"{name}.stage.json"
    if path.exists():
        try:
            old = json.loads(path.read_text())
            old["settings"], old["done"]
        except (ValueError, KeyError, TypeError, UnicodeDecodeError):
            raise IntegrityError(f"{path} is damaged; delete it to recompute the {name} stage, or start with a new "
                                 "work folder") from None
        if old["settings"] != settings:
            diff = sorted(k for k in set(old["settings"]) | set(settings) if old["settings"].get(k) != settings.get(k))
            raise MLPSurgeryError(f"work folder {workdir} holds a {name} stage made with other settings ({', '.join(diff)}); "
                                  "resume with the same settings, or use (or empty) another folder")
        return bool(old["done"])
    workdir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps({"settings": settings, "done": False}, indent=1))
    return False


def _stage_file(path: Path) -> dict[str, Tensor]:
    """A finished stage's tensors, or a one-line refusal when the file was damaged."""
    try:
        return load_file(str(path))
    except Exception as e:  # noqa: BLE001 - safetensors raises its own types for damaged files
        raise IntegrityError(f"{path} in the work folder is damaged ({type(e).__name__}); delete it and its "
                             f"{path.stem.split('_')[0]}.stage.json to recompute that stage, or start with a new "
                             "work folder") from None


def _finish(workdir: Path, name: str) -> None:
    path = workdir / f"{name}.stage.json"
    state = json.loads(path.read_text())
    state["done"] = True
    atomic_write_text(path, json.dumps(state, indent=1))


# --------------------------------------------------------------------------------------------------
# Phase 1


def split_chunks(n_chunks: int, val_fraction: float) -> tuple[list[int], list[int]]:
    """(training, held-out) chunk indices of a capture: the last val_fraction of the chunks, at least one, are
    held out, and at least one is trained on (so the held-out error is never a training error)."""
    if n_chunks < 2:
        raise MLPSurgeryError(f"a capture of {n_chunks} chunk cannot be split into training and held-out tokens; "
                              "capture at least 2 batches (more --calib-blocks)")
    n_val = min(n_chunks - 1, max(1, int(round(val_fraction * n_chunks))))
    return list(range(n_chunks - n_val)), list(range(n_chunks - n_val, n_chunks))


def capture_batch(calib_blocks: int) -> int:
    """Blocks per captured chunk: 8, fewer for small calibration sets so that there are at least two chunks."""
    return max(1, min(8, calib_blocks // 2))


class _CapturedSet:
    """Captured (x, y) of all layers as (n_layers, N, d) tensors in RAM, or per chunk from disk."""

    def __init__(self, cap, layers: list[int], chunks: list[int], memory_limit_gb: float):
        self.cap, self.layers, self.chunks = cap, layers, chunks
        sizes = [cap.tokens_per_chunk[k] for k in chunks]
        self.n = sum(sizes)
        nbytes = 2 * len(layers) * self.n * cap.d * 2
        self.in_memory = nbytes <= memory_limit_gb * 2**30
        self._norms: Tensor | None = None  # (n_layers, N) update norms, for hard sampling in memory
        if self.in_memory:
            self.X, self.Y = self._read(chunks)

    def _read(self, chunks: list[int]) -> tuple[Tensor, Tensor]:
        """(x, y) of the given chunks, each (n_layers, tokens, d), in the stored dtype."""
        xs, ys = [], []
        for k in chunks:
            c = self.cap.chunk(k, self.layers)
            xs.append(torch.stack([c[i][0] for i in self.layers]))
            ys.append(torch.stack([c[i][1] for i in self.layers]))
        return torch.cat(xs, 1), torch.cat(ys, 1)

    def sample(self, n_tokens: int, g: torch.Generator, hard_fraction: float = 0.0) -> tuple[Tensor, Tensor]:
        """n_tokens per layer: uniformly, except a hard_fraction share drawn per layer in proportion to the
        update norm ||y_t - x_t|| (so the rare tokens that hold most of a layer's update, e.g. the attention
        sink, are in every batch instead of one batch in three)."""
        if self.in_memory:
            X, Y, n = self.X, self.Y, self.n
        else:
            X, Y = self._read([self.chunks[int(torch.randint(0, len(self.chunks), (1,), generator=g))]])
            n = X.shape[1]
        n_hard = int(round(hard_fraction * n_tokens))
        idx = torch.randint(0, n, (n_tokens - n_hard,), generator=g)
        if not n_hard:
            return X[:, idx].float(), Y[:, idx].float()
        if self.in_memory:
            if self._norms is None:  # one layer at a time: a float copy of the whole set would double its RAM
                self._norms = torch.stack([(y.float() - x.float()).norm(dim=-1) for x, y in zip(self.X, self.Y)])
            norms = self._norms
        else:
            norms = (Y.float() - X.float()).norm(dim=-1)
        hard = torch.multinomial(norms, n_hard, replacement=True, generator=g)  # (n_layers, n_hard)
        idx = torch.cat([idx.expand(len(self.layers), -1), hard], 1)
        rows = torch.arange(len(self.layers))[:, None]
        return X[rows, idx].float(), Y[rows, idx].float()

    def median_update_energy(self, max_tokens: int = 1 << 16) -> Tensor:
        """Per layer, the median over (up to max_tokens) captured tokens of ||y_t - x_t||^2: (n_layers,)."""
        if self.in_memory:
            X, Y = self.X[:, :max_tokens], self.Y[:, :max_tokens]
        else:
            X, Y = self._read(self.chunks[:1])
        return (Y.float() - X.float()).pow(2).sum(-1).median(-1).values

    def all(self) -> tuple[Tensor, Tensor]:
        X, Y = (self.X, self.Y) if self.in_memory else self._read(self.chunks)
        return X.float(), Y.float()


def _compiled(net: nn.Module):
    """net's forward through torch.compile (fuses the element-wise RMSNorm / SiLU / residual work between the
    batched matmuls: 8.1 -> 3.1 s per SmolLM2 phase-1 step on one CPU thread, benchmarks/dlr_phase1_step.py), or net itself where
    compilation is unavailable (no C compiler, unsupported platform): the math is the same."""
    try:
        fn = torch.compile(net)
    except Exception as exc:  # noqa: BLE001 - any failure to set up compilation falls back to eager
        import warnings

        warnings.warn(f"torch.compile unavailable ({exc}); phase 1 runs eagerly")
        return net
    state = {"fn": fn}

    def forward(x: Tensor) -> Tensor:
        try:
            return state["fn"](x)
        except Exception as exc:  # noqa: BLE001 - a backend failure at first call (e.g. no C compiler)
            if state["fn"] is net:
                raise
            import warnings

            warnings.warn(f"torch.compile failed ({type(exc).__name__}: {exc}); phase 1 runs eagerly")
            state["fn"] = net
            return net(x)

    return forward


def _per_layer_clip(net: StackedDLR, max_norm: float):
    """Clip each layer's gradient norm separately: batched training equals independent training."""

    def clip() -> float:
        grads = [p.grad for p in net.parameters() if p.grad is not None]
        norms = torch.sqrt(sum(g.reshape(g.shape[0], -1).pow(2).sum(1) for g in grads))  # (n_layers,)
        scale = (max_norm / (norms + 1e-6)).clamp(max=1.0)
        for g in grads:
            g.mul_(scale.view(-1, *([1] * (g.dim() - 1))))
        return float(norms.max())

    return clip


@torch.no_grad()
def _validate(net: StackedDLR, val: _CapturedSet, batch: int = 2048) -> Tensor:
    X, Y = val.all()
    num = torch.zeros(net.n)
    den = torch.zeros(net.n)
    dev = net.D.device
    for s in range(0, X.shape[1], batch):
        x, y = X[:, s:s + batch].to(dev), Y[:, s:s + batch].to(dev)
        num += (net(x) - y).pow(2).sum((1, 2)).cpu()
        den += (y - x).pow(2).sum((1, 2)).cpu()
    return num / den.clamp_min(1e-30)


def phase1(model: nn.Module, blocks: Tensor, cfg: DLRConfig, workdir: Path, progress: bool = True,
           device: str | torch.device = "cpu") -> tuple[dict[int, DLRNet], DLRReport]:
    """Capture and module-wise distillation. Returns layer -> trained DLRNet and the report."""
    layers, depth, budget = plan(model, cfg)
    d = find_sites(model).config.hidden_size
    dtype = getattr(torch, cfg.capture_dtype)
    cap = capture_mlp_io(model, blocks, layers=layers, batch_size=capture_batch(len(blocks)),
                         out_dir=workdir / "capture", dtype=dtype, progress=progress)
    train_chunks, val_chunks = split_chunks(cap.n_chunks, cfg.phase1_val_fraction)
    train = _CapturedSet(cap, layers, train_chunks, cfg.memory_limit_gb)
    val = _CapturedSet(cap, layers, val_chunks, cfg.memory_limit_gb)
    net = StackedDLR(len(layers), d, cfg.rank, depth, cfg.eps, seed=cfg.seed).to(device)
    forward = _compiled(net) if cfg.compile else net
    done = workdir / "phase1.safetensors"
    report = DLRReport(layers=layers, depth=depth, rank=cfg.rank, params_mlp=budget,
                       params_dlr=depth * (2 * d * cfg.rank + d + 1), capture_tokens=cap.n_tokens)
    settings = {"capture": json.loads((workdir / "capture" / "capture.json").read_text())["fingerprint"],
                "layers": layers, "depth": depth, **{k: getattr(cfg, k) for k in (
                    "rank", "eps", "phase1_steps", "phase1_lr", "phase1_tokens", "phase1_weight_decay",
                    "phase1_val_fraction", "seed")}}
    # (absent for the paper's recipe, so work folders made with it before these options existed still resume)
    if cfg.phase1_loss != "relative":
        settings["phase1_loss"] = cfg.phase1_loss
    if cfg.phase1_hard_fraction:
        settings["phase1_hard_fraction"] = cfg.phase1_hard_fraction
    if _stage(workdir, "phase1", settings):
        state = _stage_file(done)
        net.load_state_dict(state)
        meta = json.loads((workdir / "phase1.json").read_text())
        report.phase1_history, report.phase1_seconds = meta["history"], meta["seconds"]
    else:
        floor = train.median_update_energy().to(device) if cfg.phase1_loss == "token" else None

        def loss_fn(step: int):
            x, y = train.sample(cfg.phase1_tokens, step_rng(cfg.seed, step), cfg.phase1_hard_fraction)
            x, y = x.to(device), y.to(device)
            pred = forward(x)
            rel = relative_error(pred, x, y)
            loss = rel if floor is None else token_relative_error(pred, x, y, floor)
            return loss.sum(), {"relative_error": float(rel.detach().mean()), "loss": float(loss.detach().mean())}

        fcfg = FitConfig(steps=cfg.phase1_steps, lr=cfg.phase1_lr, weight_decay=cfg.phase1_weight_decay,
                         warmup=0.05, clip=1.0, seed=cfg.seed, log_every=10,
                         checkpoint_every=max(50, cfg.phase1_steps // 20))
        res = fit(dict(net.named_parameters()), loss_fn, fcfg, checkpoint_dir=workdir / "phase1_ckpt",
                  progress=progress, desc="DLR phase 1 (all layers)", clip_fn=_per_layer_clip(net, 1.0))
        report.phase1_history = [{k: h[k] for k in ("step", "relative_error", "loss", "time_s") if k in h}
                                 for h in res.history]
        report.phase1_seconds = res.seconds
        save_file({k: v.detach().cpu().contiguous() for k, v in net.state_dict().items()}, str(done))
        atomic_write_text(workdir / "phase1.json", json.dumps({"history": report.phase1_history,
                                                               "seconds": res.seconds}))
        _finish(workdir, "phase1")
    rel = _validate(net, val)
    report.phase1_relative_error = {i: float(r) for i, r in zip(layers, rel)}
    nets = {i: net.unstack(j) for j, i in enumerate(layers)}
    return nets, report


# --------------------------------------------------------------------------------------------------
# Phase 2


@torch.no_grad()
def teacher_targets(model: nn.Module, blocks: Tensor, top_k: int, batch_size: int = 4,
                    progress: bool = True) -> dict[str, Tensor]:
    """What the student must match: top-k token ids and log-probabilities and the log-probability of the rest
    of the vocabulary (causal LMs), or final hidden states (encoders), for every position of every block."""
    device = next(model.parameters()).device
    out: dict[str, list[Tensor]] = {}
    causal = is_causal_lm(model)
    for s in tqdm(range(0, len(blocks), batch_size), desc="teacher targets", disable=not progress):
        ids = blocks[s:s + batch_size].to(device)
        if causal:
            logp = torch.log_softmax(model(input_ids=ids).logits.float(), dim=-1)
            val, idx = logp.topk(top_k, dim=-1)
            out.setdefault("topk_logp", []).append(val.cpu())
            out.setdefault("topk_idx", []).append(idx.to(torch.int32).cpu())
            out.setdefault("tail_logp", []).append(_rest_logsumexp(logp, idx).cpu())
        else:
            h = model(input_ids=ids).last_hidden_state.float()
            out.setdefault("hidden", []).append(h.to(torch.bfloat16).cpu())
    return {k: torch.cat(v) for k, v in out.items()}


def _rest_logsumexp(logp: Tensor, idx: Tensor) -> Tensor:
    """log of the probability mass outside the positions `idx` of the last axis, summed in log space."""
    return logp.scatter(-1, idx.long(), float("-inf")).logsumexp(-1)


def topk_kl(student_logits: Tensor, topk_idx: Tensor, topk_logp: Tensor, tail_logp: Tensor | None = None) -> Tensor:
    """Mean over positions of KL(teacher || student) on k+1 categories: the teacher's top-k tokens and
    the rest of the vocabulary pooled. Shapes (B, T, V), (B, T, k), (B, T, k), (B, T).

    Everything is in log space: the student's rest is a logsumexp over the rest of its vocabulary, the teacher's
    is `tail_logp` (stored with the targets; for older targets log(1 - sum p_k) through log1p/expm1), so a tail
    of 1e-7 is not lost to cancellation in 1 - sum p (float32 has 6e-8 of resolution near 1)."""
    logq = torch.log_softmax(student_logits.float(), dim=-1)
    q_k = logq.gather(-1, topk_idx.long())  # (B, T, k)
    q_tail = _rest_logsumexp(logq, topk_idx)  # (B, T)
    if tail_logp is None:
        p_tail = torch.log(-torch.expm1(topk_logp.logsumexp(-1).clamp_max(-1e-30)))
    else:
        p_tail = tail_logp.float()
    pt = p_tail.exp()
    tail = torch.where(pt > 0, pt * (p_tail - q_tail), torch.zeros_like(pt))
    kl = (topk_logp.exp() * (topk_logp - q_k)).sum(-1) + tail
    return kl.mean()


def _dlr_modules(model: nn.Module) -> list[tuple[str, DLRNet]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, DLRNet)]


def dlr_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """name -> parameter of every DLR-Net installed in the model."""
    return {f"{path}.{n}": p for path, m in _dlr_modules(model) for n, p in m.named_parameters()}


def phase2(model: nn.Module, blocks: Tensor, targets: dict[str, Tensor], cfg: DLRConfig, workdir: Path,
           progress: bool = True):
    """Logits (or hidden-state) distillation of the DLR-Net parameters only; everything else frozen."""
    params = dlr_parameters(model)
    if not params:
        raise MLPSurgeryError("phase 2 needs a model whose MLPs were replaced by DLR-Nets")
    frozen = {n: p.requires_grad for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        p.requires_grad_(n in params)
    device = next(model.parameters()).device
    causal = "topk_idx" in targets
    # Eval mode: distilling a fixed function wants no dropout. Checkpointing is done per DLR-Net (its input
    # is kept, its blocks recomputed in backward), which is where the activations are.
    model.eval()
    nets = [m for _, m in _dlr_modules(model)]
    for m in nets:
        m.checkpoint = cfg.gradient_checkpointing

    def loss_fn(step: int):
        idx = torch.randint(0, len(blocks), (cfg.phase2_batch,), generator=step_rng(cfg.seed + 7, step))
        ids = blocks[idx].to(device)
        if causal:
            logits = model(input_ids=ids).logits
            tail = targets["tail_logp"][idx].to(device) if "tail_logp" in targets else None
            return topk_kl(logits, targets["topk_idx"][idx].to(device), targets["topk_logp"][idx].to(device), tail)
        h = model(input_ids=ids).last_hidden_state.float()
        t = targets["hidden"][idx].to(device).float()
        return (h - t).pow(2).sum() / t.pow(2).sum()

    fcfg = FitConfig(steps=cfg.phase2_steps, lr=cfg.phase2_lr, warmup=0.05, clip=1.0, seed=cfg.seed, log_every=5,
                     checkpoint_every=max(10, cfg.phase2_steps // 20))
    try:
        res = fit(params, loss_fn, fcfg, checkpoint_dir=workdir / "phase2_ckpt", progress=progress,
                  desc="DLR phase 2 (logits)" if causal else "DLR phase 2 (hidden states)")
    finally:
        for m in nets:
            m.checkpoint = False
        for n, p in model.named_parameters():
            p.requires_grad_(frozen[n])
    return res


# --------------------------------------------------------------------------------------------------
# The whole lock


def install(model: nn.Module, nets: dict[int, DLRNet]) -> None:
    """Replace each listed layer's MLP sub-block by its DLR-Net (in place)."""
    sites = find_sites(model)
    p = next(model.parameters())
    for i, net in nets.items():
        sites.mlp[i].replace_subblock(net.to(device=p.device, dtype=p.dtype))


def dlr_lock(model: nn.Module, calib_blocks: Tensor, phase2_blocks: Tensor, cfg: DLRConfig, workdir: str | Path,
             progress: bool = True, data_name: str = "", on_phase1=None) -> DLRReport:
    """Lock `model` in place: phase 1 on `calib_blocks`, phase 2 on `phase2_blocks` (token blocks (N, T)).
    `workdir` holds everything needed to resume; the result is recorded in the model's history.
    on_phase1(model) is called once the phase-1 DLR-Nets are installed (e.g. to measure phase 1 alone)."""
    cfg.validate()
    workdir = Path(workdir)
    model.eval()
    device = next(model.parameters()).device
    targets_path = workdir / "teacher.safetensors"
    teacher = {"fingerprint": fingerprint(model, phase2_blocks, top_k=cfg.top_k)} if cfg.phase2_steps > 0 else None
    if teacher is not None and not _stage(workdir, "teacher", teacher):
        # the teacher is the original model: its targets are computed before the surgery
        save_file(teacher_targets(model, phase2_blocks, cfg.top_k, progress=progress), str(targets_path))
        _finish(workdir, "teacher")
    nets, report = phase1(model, calib_blocks, cfg, workdir, progress, device=device)
    install(model, nets)
    if on_phase1 is not None:
        on_phase1(model)
    if cfg.phase2_steps > 0:
        _stage(workdir, "phase2", {"teacher": teacher["fingerprint"], "phase1": json.loads(
            (workdir / "phase1.stage.json").read_text())["settings"], **{k: getattr(cfg, k) for k in (
                "phase2_steps", "phase2_lr", "phase2_batch", "seed")}})
        targets = _stage_file(targets_path)
        res = phase2(model, phase2_blocks, targets, cfg, workdir, progress)
        _finish(workdir, "phase2")
        report.phase2_history = [{k: h[k] for k in ("step", "loss", "time_s")} for h in res.history]
        report.phase2_seconds = res.seconds
        report.phase2_tokens_per_step = cfg.phase2_batch * phase2_blocks.shape[1]
        report.phase2_relative_error = module_errors(model, workdir, report.layers, cfg)
    record(model, "dlr_lock", asdict(cfg), data=data_name, seed=cfg.seed, capture_tokens=report.capture_tokens,
           phase1_steps=cfg.phase1_steps, phase2_steps=cfg.phase2_steps,
           phase1_relative_error=report.phase1_relative_error)
    return report


@torch.no_grad()
def module_errors(model: nn.Module, workdir: Path, layers: list[int], cfg: DLRConfig) -> dict[int, float]:
    """Relative error of each installed DLR-Net against the original sub-block on the held-out captured
    tokens (the same tokens phase 1 reports on)."""
    cap = open_capture(workdir / "capture")
    _, chunks = split_chunks(cap.n_chunks, cfg.phase1_val_fraction)
    sites = find_sites(model)
    out = {}
    for i in layers:
        net = sites.mlp[i].module
        dev = net.D.device
        num = den = 0.0
        for k in chunks:
            x, y = cap.chunk(k, [i])[i]
            x, y = x.to(dev).float(), y.to(dev).float()
            num += float((net.full(x.to(net.D.dtype)).float() - y).pow(2).sum())  # the net as installed (its dtype)
            den += float((y - x).pow(2).sum())
        out[i] = num / max(den, 1e-30)
    return out


# --------------------------------------------------------------------------------------------------
# What locking costs and buys: the locking report and the adaptive attacker


def locked_like(model: nn.Module, rank: int, depth: int | None = None, seed: int = 0) -> nn.Module:
    """A copy of `model` with every MLP replaced by an untrained DLR-Net of the given shape: enough to
    measure what locking costs (cost depends on the structure, not on the distilled values)."""
    import copy

    m = copy.deepcopy(model)
    sites = find_sites(m)
    d = sites.config.hidden_size
    g = torch.Generator().manual_seed(seed)
    nets = {}
    for s in sites.mlp:
        budget = sum(p.numel() for p in s.parameters())
        net = DLRNet(d, rank, depth or dlr_depth(budget, d, rank))
        net.reset_parameters(g)
        with torch.no_grad():
            net.alpha.fill_(1e-2)  # a non-trivial function, as after distillation
        nets[s.index] = net
    install(m, nets)
    return m


def inference_times(model: nn.Module, tokens: list[int], vocab: int, repeats: int = 5,
                    compiled: bool = False) -> dict[int, float]:
    """Median forward time (no grad) on one sequence of each length; torch.compile'd when asked."""
    import statistics
    import time

    device = next(model.parameters()).device
    fn = torch.compile(model) if compiled else model
    g = torch.Generator().manual_seed(0)
    out = {}
    model.eval()
    with torch.no_grad():
        for t in tokens:
            ids = torch.randint(0, vocab, (1, t), generator=g).to(device)
            for _ in range(2):  # warm-up (and compilation for this shape)
                fn(input_ids=ids)
            times = []
            for _ in range(repeats):
                if device.type == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                fn(input_ids=ids)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            out[t] = statistics.median(times)
    return out


def activation_memory_model(d: int, h: int, rank: int, depth: int) -> dict:
    """Proposition B.1: per-token stored activations (numbers) of one MLP sub-block in training.
    SwiGLU stores its input, the normed input, gate and up pre-activations and their product (~ d + d + 3h);
    each DLR block stores the RMSNorm input and output (2d), the SiLU input and output (2r) and its output (d)."""
    swiglu = 2 * d + 3 * h
    dlr = depth * (3 * d + 2 * rank)
    frozen = depth * (d + rank)
    return {"swiglu": swiglu, "dlr_full_training": dlr, "dlr_frozen": frozen, "ratio": dlr / swiglu}


@dataclass
class ReverseResult:
    layers: list[int]
    steps: int
    seconds: float
    seconds_per_layer: float
    relative_error: dict[int, float]
    history: list[dict]

    def as_dict(self) -> dict:
        return asdict(self)


def reverse_distill(locked: nn.Module, blocks: Tensor, layers: list[int], steps: int, lr: float = 2e-3,
                    tokens: int = 512, workdir: str | Path | None = None, seed: int = 0,
                    progress: bool = True) -> ReverseResult:
    """The attacker's way back: distil each locked layer's DLR sub-block into a stock pre-norm + dense MLP of
    the original shape (trained side by side over the chosen layers, as the defender did), on the locked
    model's own captured (x, DLR(x)) pairs. Returns the time spent and the relative error reached; the cost of
    unlocking the whole model is about seconds_per_layer x number of locked layers."""
    import tempfile

    from ..modules.dense import DenseMLP

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
    return ReverseResult(layers=layers, steps=steps, seconds=res.seconds, seconds_per_layer=res.seconds / len(layers),
                         relative_error={i: float(r) for i, r in zip(layers, rel)},
                         history=[{k: h[k] for k in ("step", "relative_error", "time_s")} for h in res.history])


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
    reverse_layers: int = 2  # layers reverse-distilled for real (the cost is per layer)
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


def attack_suite(original: nn.Module, locked: nn.Module, train_blocks: Tensor, eval_blocks: Tensor,
                 cfg: AttackSuiteConfig, out_dir: str | Path, progress: bool = True) -> dict:
    """Run every attack on both models; each finished run is written to out_dir/<name>.json, and a rerun
    skips what is there (an interrupted suite resumes)."""
    from ..measure.attacks import AttackConfig, finetune_attack, freeze, lora

    cfg.validate()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    spec = find_sites(locked).spec
    attn_targets = [n.rpartition(".")[2] for n in ([spec.q, spec.v] if spec.q else [spec.qkv])]
    mlp_names = {n for n, _ in _dlr_modules(locked)}

    def is_dlr(name: str) -> bool:
        return any(name.startswith(m + ".") for m in mlp_names)

    def orig_mlp(name: str) -> bool:
        return any(name.startswith(p) for p in _mlp_prefixes(original))

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
        if path.exists():
            results.append(json.loads(path.read_text()))
            continue
        acfg = AttackConfig(steps=cfg.steps, batch=cfg.batch, eval_every=cfg.eval_every, seed=cfg.seed, **kw)
        res = finetune_attack(model, train_blocks, eval_blocks, acfg, name=name, prepare=prepare, progress=progress)
        row = {**res.as_dict(), "family": family}
        atomic_write_text(path, json.dumps(row))
        results.append(json.loads(path.read_text()))  # as a resumed suite will read it (JSON keys and lists)
    reverse = None
    if "reverse" in cfg.attacks:
        path = out / "reverse_distillation.json"
        if path.exists():
            reverse = json.loads(path.read_text())
        else:
            layers = [s.index for s in find_sites(locked).mlp if isinstance(s.module, DLRNet)][:cfg.reverse_layers]
            rev = reverse_distill(locked, train_blocks, layers, cfg.reverse_steps, seed=cfg.seed, progress=progress)
            reverse = rev.as_dict()
            reverse["locked_layers"] = len(mlp_names)
            reverse["estimated_seconds_all_layers"] = rev.seconds_per_layer * len(mlp_names)
            atomic_write_text(path, json.dumps(reverse))
            reverse = json.loads(path.read_text())
    return {"attacks": results, "reverse": reverse, "config": asdict(cfg)}


def _checkpoint_dlr(model: nn.Module) -> nn.Module:
    """The adaptive attacker's checkpointing: keep each DLR-Net's input, recompute its blocks in backward."""
    for _, m in _dlr_modules(model):
        m.checkpoint = True
    return model


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
