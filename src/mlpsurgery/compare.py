"""`mlpsurgery compare`: one frontier for every way to shrink a model's MLPs, on the same model, text and clock.

For each method x budget (the fraction of the MLP kept: its width, rank FLOPs, chunks or nonzero weights) a candidate
is built from the same original, optionally recovered by layer-wise tuning (each compressed MLP sub-block trained to
reproduce the original's output on captured inputs: fusion's tuning, offered to every method), and measured:
held-out perplexity, parameters (stored, and nonzero), forward FLOPs per token (as executed by dense kernels, and
counting only nonzero weights: the FLOP-ideal), and *measured* prefill and decode speed paired against the original in
the same run (measure/speed.py), with the ratio of measured to FLOP-ideal speed-up. Unstructured sparsity (magnitude,
Wanda, SparseGPT, also in the 2:4 pattern) is kept as reference rows: on dense kernels it gives no speed-up, and the
table says so instead of hiding it.

Every point is a JSON file under OUT/points and (unless models=False) a model folder under OUT/models that loads with
mlpsurgery.load and, where its structure is stock or carries generated modeling code, with transformers alone. The
output folder records the settings and the model's fingerprint: a stopped comparison resumes (finished points are
read back), more methods or budgets can be added later, and a rerun with other settings or another model is refused.
"""

from __future__ import annotations

import copy
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from . import files
from .errors import MLPSurgeryError
from .methods.reconstruct import CALIB_BLOCKS, CALIB_LEN
from .methods.reconstruct.distill import TRAIN as RECOVER_TRAIN  # what the distillation may train

FUSE_METHODS = ("fusion", "cluster", "svd", "sketch", "neuron", "random", "mmd")
STRUCTURED = FUSE_METHODS + ("nsn", "twist", "fisher")
UNSTRUCTURED = ("wanda", "sparsegpt", "magnitude", "wanda-2:4", "sparsegpt-2:4", "magnitude-2:4")
ALL_METHODS = STRUCTURED + UNSTRUCTURED
# mmd is left out of the default (Adam on support vectors: minutes a layer on a CPU); twist only for TwIST-trained models
DEFAULT_METHODS = ("fusion", "cluster", "svd", "sketch", "neuron", "random", "nsn", "twist", "fisher",
                   "wanda", "sparsegpt", "magnitude", "wanda-2:4", "sparsegpt-2:4")
NEEDS_DATA = ("fisher", "wanda", "sparsegpt", "wanda-2:4", "sparsegpt-2:4")
RECOVERY = ("layerwise", "distill")
RECOVER_LR = {"layerwise": 1e-3, "distill": 3e-4}
RECOVER_BLOCKS = 4096  # train-split blocks the distillation draws its batches from
LABELS = {"fusion": "MLP Fusion", "cluster": "k-means cluster", "svd": "SVD", "sketch": "sketch", "neuron":
          "neuron pruning", "random": "random neurons", "mmd": "MMD", "nsn": "NSN (untrained)",
          "twist": "TwIST subnet", "fisher": "Fisher blocks", "wanda": "Wanda", "sparsegpt": "SparseGPT",
          "magnitude": "magnitude", "wanda-2:4": "Wanda 2:4", "sparsegpt-2:4": "SparseGPT 2:4",
          "magnitude-2:4": "magnitude 2:4"}


@dataclass
class CompareConfig:
    methods: tuple[str, ...] = DEFAULT_METHODS
    budgets: tuple[float, ...] = (0.75, 0.5, 0.33)  # fraction of the MLP kept
    layers: str = "last2/3"  # the layers every method compresses (fusion's default; 'all', '2-27', ...)
    data: str | None = None  # corpus (default: the bundled Austen, Persuasion held out)
    max_tokens: int = 4096  # held-out tokens scored per point
    block_len: int | None = None  # perplexity window (default: 512 or the model's context)
    calib_blocks: int = CALIB_BLOCKS  # calibration / recovery blocks of calib_len tokens from the train split
    calib_data: str | None = None  # calibration text other than data's train split (a corpus, 'self', a mix
    # self+austen: data/sampled.py); the points are still scored on data's held-out split, recovery trains on data
    calib_len: int = CALIB_LEN
    data_free: bool = False  # True: fusion's methods and NSN as their papers (no calibration; plain SVD, no refit)
    recover_steps: int = 0  # recovery steps per candidate (0: none)
    recover_lr: float | None = None  # default: 1e-3 layer-wise, 3e-4 distill
    recover: str = "layerwise"  # layerwise (each MLP toward the original's output on captured inputs) | distill (the
    # whole model toward the original's next-token distribution, on-policy: methods/reconstruct/distill.py)
    recover_seconds: float | None = None  # stop each point's recovery after this many seconds
    recover_train: str = "mlp"  # what the distillation trains: the chosen MLPs | 'layers', the chosen decoder layers
    # whole (attention and norms too; the rest of the model stays the original's either way)
    budget: str = "uniform"  # uniform: every chosen layer at the budget | per-layer: the same total width, each layer's
    # by its measured sensitivity (fuse's methods only; methods/reconstruct/budget.py, needs calibration)
    nsn_refit: bool = False  # NSN's start with each down projection refit at every rank it serves (nest --refit)
    local_epochs: float = 0.0  # on-policy local tuning of each compressed layer in the calibration pass (fuse's
    # methods, Fisher blocks, NSN at every rank at once; methods/reconstruct/local.py, methods/nsn/local.py):
    # gradient steps, recorded as the point's local tuning
    blocks: int = 12  # MLP chunks per layer for fisher / twist
    prompt_len: int = 256  # prefill length for the speed measurement
    new_tokens: int = 32  # decode steps
    repeats: int = 5
    threads: int | None = None  # CPU threads while timing (default: torch's current setting)
    seed: int = 0
    models: bool = True  # save every point as a model folder

    def validate(self) -> None:
        unknown = [m for m in self.methods if m not in ALL_METHODS]
        if unknown:
            raise MLPSurgeryError(f"unknown method(s) {', '.join(unknown)}; choose from {', '.join(ALL_METHODS)}")
        if not self.methods:
            raise MLPSurgeryError("no methods chosen")
        if self.recover not in RECOVERY:
            raise MLPSurgeryError(f"recovery must be one of {', '.join(RECOVERY)}, not {self.recover!r}")
        if self.recover_train not in RECOVER_TRAIN:
            raise MLPSurgeryError(f"the recovery trains {' or '.join(RECOVER_TRAIN)}, not {self.recover_train!r}")
        if self.recover_train != "mlp" and self.recover != "distill":
            raise MLPSurgeryError("only the distillation recovery can train the chosen layers whole (layer-wise "
                                  "recovery fits each MLP alone): add --recover distill or drop --recover-train")
        if self.local_epochs < 0 or self.local_epochs != self.local_epochs:
            raise MLPSurgeryError(f"local tuning epochs must be >= 0, not {self.local_epochs}")
        if self.calib_data is not None and self.data_free:
            raise MLPSurgeryError("--calib-data names the calibration text and --data-free calibrates on none: drop "
                                  "one of them")
        if self.local_epochs > 0 and self.data_free:
            raise MLPSurgeryError("local tuning trains each layer on its calibration rows: drop --data-free or "
                                  "--local-epochs")
        if self.nsn_refit and self.data_free:
            raise MLPSurgeryError("NSN's down refit fits each MLP on calibration rows: drop --data-free or --nsn-refit")
        if self.budget not in ("uniform", "per-layer"):
            raise MLPSurgeryError(f"budget must be uniform or per-layer, not {self.budget!r}")
        if self.budget == "per-layer":
            other = [m for m in self.methods if m not in FUSE_METHODS]
            if self.data_free or other:
                raise MLPSurgeryError("--budget per-layer allots the width of fuse's methods by sensitivity measured on "
                                      "calibration data: drop " + ("--data-free" if self.data_free else
                                                                   f"{', '.join(other)} from --methods")
                                      + " (or the per-layer budget)")
        bad = [b for b in self.budgets if not 0 < b < 1]
        if bad or not self.budgets:
            raise MLPSurgeryError(f"budgets are fractions of the MLP kept, each in (0, 1), not {bad or 'none'}")

    def point_settings(self) -> dict:
        """What changes a point's numbers (recorded in OUT, a resume with others is refused). Methods, budgets and
        models are not among them: adding some later reuses the points already made."""
        keep = ("layers", "data", "max_tokens", "block_len", "calib_blocks", "calib_len", "recover_steps", "recover_lr",
                "blocks", "prompt_len", "new_tokens", "repeats", "threads", "seed")
        out = {k: getattr(self, k) for k in keep}
        if self.data_free:  # (absent when off: folders of the data-free default before it existed still resume)
            out["data_free"] = True
        if self.local_epochs > 0:  # (absent when off, as data_free)
            out["local_epochs"] = self.local_epochs
        if self.nsn_refit:  # (likewise)
            out["nsn_refit"] = True
        if self.budget != "uniform":  # (likewise)
            out["budget"] = self.budget
        if self.recover != "layerwise":
            out["recover"] = self.recover
            out["recover_seconds"] = self.recover_seconds
        if self.calib_data is not None:  # (absent when not given, as data_free)
            out["calib_data"] = self.calib_data
        if self.recover_train != "mlp":  # (absent when off, as data_free)
            out["recover_train"] = self.recover_train
        return out


def _points(cfg: CompareConfig, twist_trained: bool) -> tuple[list[tuple[str, float]], list[dict]]:
    points, skipped = [], []
    for m in cfg.methods:
        if m == "twist" and not twist_trained:
            skipped.append({"method": m, "why": "the model was not TwIST-trained (`mlpsurgery twist train`): a random "
                                                "subnet of it is the 'random' / 'fisher' baselines' business"})
            continue
        if m.endswith("2:4"):
            points.append((m, 0.5))  # the pattern fixes the budget
        else:
            points.extend((m, b) for b in cfg.budgets)
    return points, skipped


def point_name(method: str, budget: float) -> str:
    return f"{method.replace(':', '_')}@{budget:g}"


# --------------------------------------------------------------------------------------------------
# Building one candidate


def _mlp_width(model: nn.Module, layers: list[int]) -> int:
    from .sites import find_sites

    sites = find_sites(model)
    return min(sites.mlp[i].h for i in layers)


def chosen_layers(model: nn.Module, spec: str) -> list[int]:
    from .sites import find_sites, parse_layers

    n = len(find_sites(model))
    layers = parse_layers(spec, n, "last2/3")
    if not layers:
        raise MLPSurgeryError(f"--layers {spec!r} chose no layer of this {n}-layer model")
    return layers


def build(model: nn.Module, method: str, budget: float, cfg: CompareConfig, calib: torch.Tensor | None,
          cache: dict) -> tuple[nn.Module, dict]:
    """A new model: `method` at `budget` (fraction of each MLP kept) from `model` (left unchanged)."""
    from .methods import nsn
    from .methods.fusion import FusionConfig, fuse
    from .methods.pruning import prune
    from .methods.twist import twist_extract
    from .methods.twist.extraction import trained_settings

    layers = chosen_layers(model, cfg.layers)
    aware = calib is not None and not cfg.data_free
    if method in FUSE_METHODS:
        m = copy.deepcopy(model)
        width = max(1, round(budget * _mlp_width(model, layers)))
        report = fuse(m, FusionConfig(width=width, method=method, layers=",".join(map(str, layers)), n_init=1,
                                      seed=cfg.seed, local_epochs=cfg.local_epochs if aware else 0.0,
                                      budget=cfg.budget),
                      progress=False, calib_data=calib if aware else None)
        info = {"width": width, "data": "calibration, sequential" if aware else "none"}
        if report.get("budget"):  # the per-layer widths (the total is the uniform one's)
            info["widths"] = {str(i): w for i, w in report["widths"].items()}
        return m, {**info, **_local_info([r.get("local") for r in report["sites"]])}
    if method == "nsn":
        if "nested" not in cache:
            nested = copy.deepcopy(model)
            nsn.nest(nested, nsn.NSNConfig(modules="mlp", layers=",".join(map(str, layers))),
                     calib_data=calib if aware else None, local_epochs=cfg.local_epochs if aware else 0.0,
                     seed=cfg.seed, refit=cfg.nsn_refit and aware)
            cache["nested"] = nested
        m = copy.deepcopy(cache["nested"])
        got = nsn.set_budget(m, budget)
        nsn.truncate(m)  # the deployed form: only the components up to the rank are kept
        from .io.provenance import history

        prov = next(h for h in reversed(history(m)) if h["method"] == "nsn")["provenance"]
        tuned = prov.get("local")  # one tuning (every rank at once) serves every budget's point; each point records it
        start = "whitened start" + (", sequential" if tuned or prov.get("refit") else "") + \
            (", down refit" if prov.get("refit") else "")
        return m, {"rank": got["rank"], "mlp_flops_fraction": got["fraction"],
                   "data": f"calibration ({start})" if aware else "none",
                   **({"refit": True} if prov.get("refit") else {}),
                   **({"local": {k: tuned[k] for k in ("epochs", "steps", "seconds", "layers_kept", "layers")}}
                      if tuned else {})}
    if method == "twist":  # the chunking it was trained with
        R = int(trained_settings(model).get("blocks") or cfg.blocks)
        keep = max(1, round(budget * R))
        sub = twist_extract(model, keep=keep, blocks=R, parts="ffn", layers=layers, seed=cfg.seed)
        if aware:  # its narrowed MLPs' down projections refit in sequence, as every width-reducing method's
            from .methods.twist import refit_subnet_

            refit_subnet_(sub, model, calib, progress=False)
        return sub, {"keep": keep, "blocks": R, "data": "calibration, refit sequential" if aware else "none"}
    if method == "fisher":
        h = _mlp_width(model, layers)
        R = max(r for r in range(1, cfg.blocks + 1) if h % r == 0)  # chunks of equal width
        if R < 2:
            raise MLPSurgeryError(f"MLP width {h} does not split into 2..{cfg.blocks} equal chunks; set --blocks")
        new, rep = prune(model, "fisher", 1 - budget, parts="ffn", layers=layers, data=calib, blocks=R,
                         progress=False)
        local = {}
        if aware:  # the blocks chosen by their Fisher scores, then the down projections refit in sequence
            from .methods.reconstruct.layer import refit_model_

            fitted = refit_model_(new, model, calib, layers, local_epochs=cfg.local_epochs, seed=cfg.seed)
            local = _local_info([f.get("local") for f in fitted.values()])
        return new, {"keep": rep.get("keep"), "blocks": R,
                     "data": "calibration, refit sequential" if aware else "calibration", **local}
    base, _, pattern = method.partition("-")
    m = copy.deepcopy(model)
    _, rep = prune(m, base, None if pattern else 1 - budget, parts="ffn", layers=layers, data=calib, progress=False,
                   pattern=pattern or None)
    return m, {"sparsity": rep.get("sparsity"), "pattern": rep.get("pattern"),
               "data": "none" if base == "magnitude" else "calibration, sequential"}


def _local_info(rows: list[dict | None]) -> dict:
    """The point's record of the local tuning of its layers (methods/reconstruct/local.py): {} when there was none."""
    rows = [r for r in rows if r and r.get("steps")]
    if not rows:
        return {}
    return {"local": {"epochs": rows[0]["epochs"], "steps": sum(r["steps"] for r in rows),
                      "seconds": sum(r["seconds"] for r in rows), "layers_kept": sum(bool(r["kept"]) for r in rows),
                      "layers": len(rows)}}


def _zeros_in_linears(model: nn.Module) -> int:
    from .sites import find_sites

    sites = find_sites(model)
    n = 0
    for s in list(sites.mlp) + list(sites.attn):
        for p in s.parameters():
            if p.dim() == 2:
                n += int((p == 0).sum())
    return n


def _recover(candidate: nn.Module, capture, cfg: CompareConfig, teacher: nn.Module, blocks) -> dict:
    from .methods.fusion import FusionConfig, tune_layers
    from .methods.reconstruct.distill import distill

    layers = chosen_layers(candidate, cfg.layers)
    lr = cfg.recover_lr or RECOVER_LR[cfg.recover]
    t0 = time.perf_counter()
    if cfg.recover == "distill":
        return distill(candidate, teacher, blocks, layers, cfg.recover_steps, lr=lr, seconds=cfg.recover_seconds,
                       seed=cfg.seed, progress=False, train=cfg.recover_train)
    tcfg = FusionConfig(tune_steps=cfg.recover_steps, tune_lr=lr, seed=cfg.seed)
    out = tune_layers(candidate, capture, layers, tcfg, progress=False)
    out.setdefault("seconds", time.perf_counter() - t0)
    out["kind"] = "layerwise"
    return out


# --------------------------------------------------------------------------------------------------
# The run


def run(model_spec: str | None, out: str | Path, cfg: CompareConfig | None = None, overwrite: bool = False,
        progress: bool = True, device: str | torch.device | None = None) -> dict:
    from tqdm.auto import tqdm

    from .data import load_corpus
    from .io import save
    from .measure.cost import count_params, flops_per_token
    from .measure.perplexity import default_block_len, is_causal_lm, perplexity
    from .measure.speed import paired_speed
    from .methods.twist.extraction import trained_settings
    from .models import check_context, load_model
    from .report import stage

    cfg = cfg or CompareConfig()
    cfg.validate()
    out = Path(out)
    files.check_apart(out, [model_spec, cfg.data, cfg.calib_data])
    loaded = load_model(model_spec)
    model, tok = loaded.model, loaded.require_tokenizer()
    if device is not None:
        model.to(device)
    if not is_causal_lm(model):
        raise MLPSurgeryError(f"compare scores held-out perplexity and decode speed of a causal language model; "
                              f"{loaded.source} is not one (for an encoder use `fuse` / `prune` with `eval acc`)")
    block = cfg.block_len or default_block_len(model)
    check_context(model, block)
    check_context(model, cfg.prompt_len + cfg.new_tokens)
    chosen_layers(model, cfg.layers)  # a bad selection is refused before any work
    twist_trained = bool(trained_settings(model))
    points, skipped = _points(cfg, twist_trained)
    settings = {**cfg.point_settings(), "model": files.model_fingerprint(model), "source": loaded.source}
    if overwrite and files.is_ours(out) and (files.marker(out) or {}).get("settings") != json.loads(
            json.dumps(settings, sort_keys=True, default=str)):
        files.remove_ours(out)
    files.claim(out, "compare", settings, inputs=[model_spec, cfg.data, cfg.calib_data])
    (out / "points").mkdir(exist_ok=True)
    stage(f"reading {cfg.data or 'austen'}", progress)
    corpus = load_corpus(cfg.data, tok)
    needs_data = any(m in NEEDS_DATA or (not cfg.data_free and m in FUSE_METHODS + ("nsn",)) for m, _ in points) \
        or cfg.recover_steps > 0
    calib = None
    if needs_data and cfg.calib_data is not None:  # other text than the scored corpus's (the cross-domain case)
        from .data.sampled import calibration_blocks

        stage(f"reading the calibration data {cfg.calib_data}", progress)
        calib = calibration_blocks(cfg.calib_data, model, tok, cfg.calib_len, cfg.calib_blocks, seed=cfg.seed,
                                   progress=progress)
    elif needs_data:
        calib = corpus.blocks("train", cfg.calib_len, max_blocks=cfg.calib_blocks, seed=cfg.seed)

    def quality(m: nn.Module) -> float:
        return perplexity(m, corpus.heldout, block_len=block, max_tokens=cfg.max_tokens, progress=False,
                          bos_id=corpus.bos).ppl

    def measure(m: nn.Module, label: str, t_build: float, info: dict, recovery: dict | None) -> dict:
        params = count_params(m)
        flops = flops_per_token(m, context=cfg.prompt_len)
        zeros = _zeros_in_linears(m)
        row = {"method": label, "params": params["total"], "mlp_params": params["mlp"],
               "nonzero_params": params["total"] - zeros, "flops": flops["total"],
               "flops_nonzero": flops["total"] - 2 * zeros, "build_s": t_build, **info}
        t0 = time.perf_counter()
        row["ppl"] = quality(m)
        row["ppl_s"] = time.perf_counter() - t0
        if recovery is not None:
            row["recovery"] = {k: recovery.get(k) for k in ("kind", "steps", "mse_before", "mse_after", "loss_first",
                                                            "loss_last", "seconds", "tokens", "train")}
        return row

    stage("measuring the original", progress)
    base_path = out / "points" / "original.json"
    base = _read_point(base_path)
    if base is None:
        base = measure(model, "original", 0.0, {}, None)
        base["speed"] = paired_speed(model, model, cfg.prompt_len, cfg.new_tokens, repeats=cfg.repeats,
                                     threads=cfg.threads, seed=cfg.seed)
        files.write_text(base_path, json.dumps(base, indent=1, default=str))
    capture = recover_blocks = None
    if cfg.recover_steps > 0 and cfg.recover == "distill":  # fresh blocks of the train split, not the calibration's
        recover_blocks = corpus.blocks("train", cfg.calib_len, max_blocks=RECOVER_BLOCKS, seed=cfg.seed + 1)
    elif cfg.recover_steps > 0:
        from .capture import capture_mlp_io

        stage("capturing the original MLPs' inputs and outputs for recovery", progress)
        capture = capture_mlp_io(model, calib, layers=chosen_layers(model, cfg.layers), progress=progress)
    cache: dict = {}
    rows, t_all = [], time.perf_counter()
    bar = tqdm(points, desc="compare", unit="point", disable=not progress)
    for method, budget in bar:
        name = point_name(method, budget)
        bar.set_postfix_str(name)
        path = out / "points" / f"{name}.json"
        row = _read_point(path)
        if row is not None and (not cfg.models or (out / "models" / name).is_dir()):
            rows.append(row)
            continue
        t0 = time.perf_counter()
        try:
            cand, info = build(model, method, budget, cfg, calib, cache)
        except MLPSurgeryError as e:
            skipped.append({"method": method, "budget": budget, "why": str(e)})
            continue
        recovery = _recover(cand, capture, cfg, model, recover_blocks) if cfg.recover_steps > 0 else None
        row = measure(cand, method, time.perf_counter() - t0, info, recovery)
        row["budget"] = budget
        row["speed"] = paired_speed(model, cand, cfg.prompt_len, cfg.new_tokens, repeats=cfg.repeats,
                                    threads=cfg.threads, seed=cfg.seed)
        row["ideal_speedup"] = base["flops_nonzero"] / row["flops_nonzero"]
        row["dense_flops_speedup"] = base["flops"] / row["flops"]
        row["measured_over_ideal"] = {k: v / row["ideal_speedup"] for k, v in row["speed"]["ratio"].items()}
        if cfg.models:
            save(cand, out / "models" / name, tokenizer=tok, overwrite=True, inputs=[model_spec, cfg.data])
        files.write_text(path, json.dumps(row, indent=1, default=str))  # last: the point is done
        rows.append(row)
        del cand
    bar.close()
    result = {"model": loaded.source, "settings": asdict(cfg), "machine": _machine(cfg), "original": base,
              "points": rows, "skipped": skipped, "seconds": time.perf_counter() - t_all,
              "heldout": {"documents": corpus.heldout_names, "tokens": cfg.max_tokens, "block_len": block}}
    result["settings"]["methods"] = list(cfg.methods)
    result["settings"]["budgets"] = list(cfg.budgets)
    files.write_text(out / "frontier.json", json.dumps(result, indent=1, default=str))
    files.write_text(out / "frontier.md", markdown(result) + "\n")
    result["out"] = str(out)
    return result


def _read_point(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _machine(cfg: CompareConfig) -> str:
    import os
    import platform

    threads = cfg.threads or torch.get_num_threads()
    dev = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"CPU ({os.cpu_count()} cores)"
    return f"{platform.machine()} {dev}, {threads} threads while timing, torch {torch.__version__}"


# --------------------------------------------------------------------------------------------------
# Output


def _h(n: float) -> str:
    for unit, div in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.1f}{unit}"
    return f"{n:.0f}"


def _ppl(x: float) -> str:
    return f"{x:.2f}" if x < 1000 else f"{x:,.0f}"


def _documents(names: list[str] | None) -> str:
    """The held-out documents for a table's first line: named when few, counted when many (a table of tweets)."""
    if not names:
        return "the held-out split"
    if len(names) <= 4:
        return ", ".join(names)
    return f"{len(names):,} held-out documents ({names[0]}, {names[1]}, ..., {names[-1]})"


def markdown(r: dict) -> str:
    base = r["original"]
    s = r["original"]["speed"]["reference"]
    lines = [f"Frontier of {r['model']}, the MLPs of layers {r['settings']['layers']} compressed: held-out perplexity on {r['heldout']['tokens']} tokens of "
             f"{_documents(r['heldout']['documents'])} (window {r['heldout']['block_len']}); "
             f"speed paired with the original in the same run ({r['machine']}; prefill of "
             f"{r['settings']['prompt_len']} tokens, {r['settings']['new_tokens']} decode steps, median of "
             f"{r['settings']['repeats']}). Original: perplexity {base['ppl']:.2f}, {_h(base['params'])} parameters, "
             f"{_h(base['flops'])} FLOPs / token, prefill {s['prefill_tok_s']:.0f} tok/s, decode "
             f"{s['decode_tok_s']:.1f} tok/s." + (f" Calibrated on {r['settings']['calib_data']} (not the scored "
                                                   "corpus)." if r["settings"].get("calib_data") else ""), "",
             "| method | MLP kept | perplexity | x original | parameters | FLOPs / token | prefill speed-up "
             "| decode speed-up | FLOP-ideal | measured / ideal (prefill) | data seen | recovery |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    order = {m: i for i, m in enumerate(ALL_METHODS)}
    for p in sorted(r["points"], key=lambda p: (order.get(p["method"], 99), -p["budget"])):
        sp = p["speed"]["ratio"]
        nz = f" ({_h(p['nonzero_params'])} nonzero)" if p["nonzero_params"] < 0.995 * p["params"] else ""
        rec = "-" if not p.get("recovery") else (f"{p['recovery'].get('kind') or 'layerwise'}"
                                                 + (" (layers whole)" if p["recovery"].get("train") == "layers" else "")
                                                 + ", "
                                                 f"{p['recovery'].get('steps', '?')} steps, "
                                                 f"{p['recovery'].get('seconds') or 0:.0f} s")
        if p.get("local"):
            loc = f"local {p['local']['epochs']:g} epochs, {p['local']['steps']} steps, {p['local']['seconds']:.0f} s"
            rec = loc if rec == "-" else f"{loc}; {rec}"
        label = LABELS.get(p["method"], p["method"])
        if p["method"] == "nsn" and (p.get("local") or p.get("refit")):
            label = "NSN (" + ", ".join((["down refit"] if p.get("refit") else []) +
                                        (["local-tuned"] if p.get("local") else [])) + ")"
        kept = f"{p['budget']:g}" + (" (per layer)" if p.get("widths") else "")
        lines.append(f"| {label} | {kept} | {_ppl(p['ppl'])} | "
                     f"{_ppl(p['ppl'] / base['ppl'])} | {_h(p['params'])}{nz} | {_h(p['flops'])} | {sp['prefill']:.2f}x | "
                     f"{sp['decode']:.2f}x | {p['ideal_speedup']:.2f}x | {p['measured_over_ideal']['prefill']:.2f} | "
                     f"{p.get('data', '?')} | {rec} |")
    dense = [p for p in r["points"] if p["method"] in UNSTRUCTURED]
    if dense:
        lines += ["", "Unstructured and 2:4 rows keep every matrix dense: their FLOP-ideal speed-up counts only "
                      "nonzero weights, which dense kernels (all of PyTorch's CPU kernels, and cuBLAS) do not skip; "
                      "a measured speed-up near 1.0x is the truth of running them as stored."]
    for s in r.get("skipped", []):
        lines.append(f"\nskipped {s['method']}" + (f" @ {s['budget']:g}" if "budget" in s else "") + f": {s['why']}")
    return "\n".join(lines)


def plot(r: dict, path: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .report import save_figure

    fig, axes = plt.subplots(1, 2, figsize=(12, 5), sharey=True)
    base = r["original"]
    by: dict[str, list[dict]] = {}
    for p in r["points"]:
        by.setdefault(p["method"], []).append(p)
    cmap = plt.get_cmap("tab20")
    scale = 300 / max(base["params"], 1)
    for ax, kind in zip(axes, ("prefill", "decode")):
        for i, (m, ps) in enumerate(sorted(by.items(), key=lambda kv: ALL_METHODS.index(kv[0])
                                           if kv[0] in ALL_METHODS else 99)):
            ps = sorted(ps, key=lambda p: p["budget"])
            xs = [p["speed"]["ratio"][kind] for p in ps]
            ys = [p["ppl"] for p in ps]
            style = "--" if m in UNSTRUCTURED else "-"
            ax.plot(xs, ys, style, color=cmap(i % 20), alpha=0.6, linewidth=1)
            ax.scatter(xs, ys, s=[p["nonzero_params"] * scale for p in ps], color=cmap(i % 20),
                       label=LABELS.get(m, m), alpha=0.8, edgecolors="black", linewidths=0.4)
        ax.scatter([1.0], [base["ppl"]], marker="*", s=250, color="black", label="original", zorder=5)
        ax.axvline(1.0, color="grey", linewidth=0.6)
        ax.set_xlabel(f"measured {kind} speed-up vs the original (paired)")
        ax.set_yscale("log")
        ax.grid(alpha=0.3, which="both")
        ax.set_title(f"{kind}: quality vs measured speed (marker area = nonzero parameters)", fontsize=9)
    axes[0].set_ylabel(f"held-out perplexity ({r['heldout']['tokens']} tokens, log scale)")
    axes[1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.suptitle(f"{r['model']}: every way to shrink the MLPs, at MLP budgets "
                 f"{', '.join(f'{b:g}' for b in r['settings']['budgets'])}", fontsize=10)
    fig.tight_layout()
    return save_figure(fig, path)


def check_budgets(text: str) -> tuple[float, ...]:
    try:
        vals = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise MLPSurgeryError(f"--budgets {text!r} is not a comma-separated list of fractions (e.g. 0.75,0.5,0.33)") \
            from None
    if not vals or any(not 0 < v < 1 or math.isnan(v) for v in vals):
        raise MLPSurgeryError(f"--budgets {text!r}: each budget is the fraction of the MLP kept, in (0, 1)")
    return vals
