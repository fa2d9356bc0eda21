"""`mlpsurgery nest`: Nested Subspace Networks (one checkpoint, any compute budget at inference).

    mlpsurgery nest [MODEL] --out DIR [--max-rank R] [--modules mlp|mlp+attn] [--data PATH] [--train-steps N]
    mlpsurgery nest rank DIR (--rank r | --budget F) --out DIR [--form lowrank|dense|nested] [--layerwise]
    mlpsurgery nest sweep DIR [--data PATH] [--ranks r,r,...] [--plot PNG]

Why one parser with a leading positional rather than argparse sub-commands: the default action takes an
optional MODEL first (`nest --out DIR` must work, and so must `nest tiny:llama --out DIR`), which an
argparse sub-command group cannot express (it would read MODEL as an unknown sub-command name, and options
given before the sub-command would land in the wrong parser). So `nest` takes up to two leading words:
`rank DIR`, `sweep DIR`, or `[MODEL]`; the words `rank` and `sweep` are never model names (a folder called
so is reached as ./rank). Options belonging to another form are refused with a message, not ignored.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..errors import MLPSurgeryError
from ..report import human_count, table
from . import (calibration_blocks, check_plot_path, command, device_of, draw, integer, layer_device, number, progress,
               stage)
from ..methods.reconstruct import CALIB_BLOCKS, CALIB_LEN
from .core import MODEL_HELP

ACTIONS = ("rank", "sweep")
# The options each form accepts (argparse dests); the others must keep their defaults.
TRAIN_OPTS = {"out", "max_rank", "modules", "layers", "data", "train_steps", "ranks", "n_ranks", "objective",
              "sampling", "curriculum_end", "lr", "log_var_lr", "batch_size", "block_len", "max_len", "train",
              "seed", "checkpoint", "overwrite", "layerwise", "calib_data", "calib_blocks", "calib_len", "data_free",
              "local_epochs", "local_lr", "refit"}
RANK_OPTS = {"out", "rank", "budget", "form", "overwrite", "layerwise"}
SWEEP_OPTS = {"data", "ranks", "max_tokens", "block_len", "max_examples", "max_len", "plot"}


def _ranks(text: str | None) -> tuple[int, ...] | None:
    if not text:
        return None
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise MLPSurgeryError(f"--ranks takes comma-separated integers such as 32,64,128, not {text!r}") from None


def _check_options(args, parser: argparse.ArgumentParser, form: str, allowed: set[str]) -> None:
    common = {"json", "quiet", "device", "dtype", "words", "run", "render", "nest_parser"}
    for dest in sorted(set(vars(args)) - allowed - common):
        if getattr(args, dest) != parser.get_default(dest):
            flag = "--" + dest.replace("_", "-")
            raise MLPSurgeryError(f"{flag} does not apply to `mlpsurgery nest{'' if form == 'train' else ' ' + form}`; "
                                  "see `mlpsurgery nest --help`")


def run_nest(args) -> dict:
    from .. import parallel
    from ..methods import nsn
    from ..train import FitConfig

    words, parser = args.words, args.nest_parser
    if words and words[0] in ACTIONS:
        action = words[0]
        if len(words) != 2:
            raise MLPSurgeryError(f"`mlpsurgery nest {action}` takes one folder: nest {action} DIR ...")
        folder = words[1]
        if action == "rank":
            _check_options(args, parser, "rank", RANK_OPTS)
            if not args.out:
                raise MLPSurgeryError("`nest rank` needs --out DIR")
            if args.layerwise:
                return {"action": "rank", **_rank_layerwise(args, folder)}
            stage(args, f"loading {folder}, fixing the rank ({args.form}), writing {args.out}")
            out = nsn.export_rank(folder, args.out, rank=args.rank, budget=args.budget, form=args.form,
                                  overwrite=args.overwrite)
            return {"action": "rank", **out}
        _check_options(args, parser, "sweep", SWEEP_OPTS)
        plot = args.plot or f"{folder.rstrip('/')}-sweep.png"
        check_plot_path(plot, inputs=[folder, args.data])
        out = nsn.sweep_folder(folder, data=args.data, ranks=_ranks(args.ranks), max_tokens=args.max_tokens,
                               block_len=args.block_len, max_examples=args.max_examples, max_len=args.max_len,
                               plot=None, device=device_of(args), progress=progress(args))
        # drawn here, not by sweep_folder, so that a plot that fails is a warning after a complete sweep
        out["plot"] = draw("sweep", lambda: nsn.plot_frontier({Path(folder).name: out["rows"]}, out["metric"], plot,
                                                              title=f"{folder}: {out['metric']} per rank"))
        return {"action": "sweep", **out}
    if len(words) > 1:
        raise MLPSurgeryError(f"`mlpsurgery nest` takes at most one MODEL, got {words}; the forms are "
                              "`nest [MODEL] --out DIR`, `nest rank DIR ...`, `nest sweep DIR ...`")
    _check_options(args, parser, "train", TRAIN_OPTS)
    if not args.out:
        raise MLPSurgeryError("`mlpsurgery nest` needs --out DIR (where the nested model is saved)")
    cfg = nsn.NSNConfig(max_rank=args.max_rank, modules=args.modules, layers=args.layers)
    train = nsn.NSNTrainConfig(
        ranks=_ranks(args.ranks), n_ranks=args.n_ranks, objective=args.objective, sampling=args.sampling,
        curriculum_end=args.curriculum_end, log_var_lr=args.log_var_lr, train=args.train,
        fit=FitConfig(steps=args.train_steps, lr=args.lr, seed=args.seed))
    for flag, given, does in (("--local-epochs", args.local_epochs, "tunes"), ("--refit", args.refit, "refits")):
        if given and (args.data_free or parallel.launched()):
            what = "--data-free" if args.data_free else "torchrun"
            raise MLPSurgeryError(f"{flag} {does} each nested MLP on calibration rows in one process, which {what} "
                                  f"does not give: drop {what} or {flag}")
        if given and args.layerwise and not args.calib_data:
            raise MLPSurgeryError(f"{flag} {does} each nested MLP on calibration rows, which layer by layer are asked "
                                  "for by name: give --calib-data (e.g. austen), or drop --layerwise")
    if args.layerwise:
        return _nest_layerwise(args, cfg)
    device = device_of(args)
    if parallel.launched():  # torchrun --nproc-per-node N: the training is sharded over the ranks (FSDP2)
        device = parallel.rank_device(device)
        if parallel.init(device)[0] != 0:
            args.quiet = True  # rank 0 shows the stages and progress
    out = nsn.nest_model(words[0] if words else None, args.out, cfg, train, data=args.data, batch_size=args.batch_size,
                         block_len=args.block_len or 128, max_len=args.max_len, checkpoint_dir=args.checkpoint,
                         overwrite=args.overwrite, device=device, progress=progress(args), calib_data=args.calib_data,
                         calib_blocks=args.calib_blocks, calib_len=args.calib_len,
                         data_free=args.data_free or parallel.launched(), local_epochs=args.local_epochs,
                         local_lr=args.local_lr, refit=args.refit)
    return {"action": "train", **out}


def _nest_layerwise(args, cfg) -> dict:
    """`nest --layerwise`: the SVD surgery one decoder layer at a time (methods/nsn/layerwise.py), no training."""
    from .. import parallel
    from ..io import check_out
    from ..methods.nsn.layerwise import nest_layerwise
    from ..models import _tokenizer, checkpoint_folder, working_dtype

    if parallel.launched():
        raise MLPSurgeryError("--layerwise runs as one process; under torchrun `nest` already reads a language "
                              "model's checkpoint into the shards one layer at a time: drop --layerwise")
    if args.train_steps or args.data:
        raise MLPSurgeryError("--layerwise nests without training (--train-steps 0, no --data): train the folder it "
                              "writes afterwards, or drop --layerwise")
    model = args.words[0] if args.words else None
    check_out(args.out, args.overwrite, inputs=[model, args.calib_data])
    folder, source, name = checkpoint_folder(model)
    tok = _tokenizer(folder)
    # layer by layer the whitened start is asked for by name (the default stays data-free)
    calib = None if args.data_free else calibration_blocks(args, tok, folder, "the whitened start")
    stage(args, f"nesting {source} layer by layer into {args.out}")
    out = nest_layerwise(folder, args.out, cfg, dtype=working_dtype(), tokenizer=tok,
                         overwrite=args.overwrite, inputs=[model, args.calib_data], source_name=name,
                         progress=progress(args), device=layer_device(args), calib_data=calib,
                         local_epochs=args.local_epochs, local_lr=args.local_lr, refit=args.refit, seed=args.seed)
    return {"action": "train", "model": source, **out}


def _rank_layerwise(args, folder: str) -> dict:
    """`nest rank --layerwise`: the nested folder read one decoder layer at a time (methods/nsn/layerwise.py)."""
    from ..io import check_out
    from ..methods.nsn.layerwise import export_rank_layerwise
    from ..models import _tokenizer, checkpoint_folder, working_dtype

    layer_device(args, on_device=False, what="nest rank")
    check_out(args.out, args.overwrite, inputs=[folder])
    path, _, _ = checkpoint_folder(folder)
    stage(args, f"fixing the rank of {folder} ({args.form}) layer by layer into {args.out}")
    return export_rank_layerwise(path, args.out, rank=args.rank, budget=args.budget, form=args.form,
                                 dtype=working_dtype(), tokenizer=_tokenizer(path), overwrite=args.overwrite,
                                 inputs=[folder], progress=progress(args))


def _log_var(r: dict) -> str:
    """s_k beside its update count: a rank sampled less often stays nearer its start (0) whatever its loss."""
    upd = {int(k): v for k, v in (r.get("updates") or {}).items()}
    return ", ".join(f"{k}: {v:.3f}" + (f" ({upd[int(k)]})" if int(k) in upd else "")
                     for k, v in sorted(r["log_var"].items(), key=lambda kv: int(kv[0])))


def render(r: dict) -> str:
    if r.get("rank") and r["action"] == "train":  # a torchrun rank other than 0 (rank 0 saves and reports)
        return f"rank {r['rank']} of {r['world_size']} done"
    if r["action"] == "rank":
        return (f"wrote {r['out']} ({r['form']}): rank {r['rank']}, {r['flops_fraction']:.1%} of the dense FLOPs of the "
                f"nested projections; parameters {human_count(r['params_before'])} -> {human_count(r['params_after'])}"
                f"; loads with {r['loads_with']}")
    if r["action"] == "sweep":
        rows = [{"rank": x["rank"], "FLOPs vs dense": f"{x['fraction']:.3f}",
                 **{k: x[k] for k in ("accuracy", "ppl", "loss") if k in x}} for x in r["rows"]]
        lines = [f"{r['model']}: {r['metric']} per rank on {r['data']}", table(rows)]
        if r["log_var"]:
            lines.append("learned log-variance per training rank (steps that updated it): " + _log_var(r))
        if r.get("plot"):
            lines.append(f"plot: {r['plot']}")
        return "\n".join(lines)
    lines = [f"nested {r['projections']} projections of {r['model']} (max rank {r['max_rank']}; full rank costs "
             f"{r['full_rank_flops_fraction']:.3f}x their dense FLOPs) -> {r['out']}"]
    loc = r.get("local")
    if loc:
        lines.append(f"local tuning at every rank at once: {loc['epochs']:g} epochs, {loc['steps']} steps in "
                     f"{loc['seconds']:.0f} s; kept in {loc['layers_kept']} of {loc['layers']} layers")
    t = r.get("train")
    if t:
        lines.append(f"trained {t['steps']} steps ({t['objective']}, {t['sampling']}) on ranks {t['ranks']} in "
                     f"{t['seconds']:.0f} s; final loss {t['final_loss']:.4g}")
        mem = t.get("memory") or {}
        if mem.get("world_size", 1) > 1:
            lines.append(f"sharded over {mem['world_size']} processes (FSDP2); rank 0 held {mem['model_param_bytes'] / 2**20:.0f} "
                         f"MiB of parameters, {(mem['grad_bytes'] + mem['optimizer_bytes']) / 2**20:.0f} MiB of "
                         "gradients and AdamW moments")
        if t["log_var"]:
            lines.append("log-variance per rank (steps that updated it): " + _log_var(t))
    else:
        lines.append("no end-to-end training (--train-steps 0)" if loc else
                     "no training (--train-steps 0): SVD truncation only")
    return "\n".join(lines)


USAGE = """mlpsurgery nest [MODEL] --out DIR [--max-rank R] [--modules mlp|mlp+attn] [--data PATH] [--train-steps N]
       mlpsurgery nest rank DIR (--rank r | --budget F) --out DIR [--form lowrank|dense|nested] [--layerwise]
       mlpsurgery nest sweep DIR [--data PATH] [--ranks r,r,...] [--plot PNG]"""


def register(sub, groups) -> None:
    p = command(sub, "nest", run_nest, render,
                "Nested Subspace Networks: nest a model's MLPs (train them for every rank), fix a rank, sweep ranks",
                usage=USAGE, epilog="MODEL: " + MODEL_HELP, ranks=True)
    p.set_defaults(nest_parser=p)
    p.add_argument("words", nargs="*", metavar="[MODEL] | rank DIR | sweep DIR",
                   help="MODEL to nest and train (default smollm2); `rank DIR` fixes the rank of a nested folder; "
                        "`sweep DIR` measures it at every rank")
    p.add_argument("--out", help="output folder (nest, nest rank)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")

    g = p.add_argument_group("nest [MODEL]")
    g.add_argument("--max-rank", type=integer(1), help="components kept per projection (default min(in, out): exact)")
    g.add_argument("--modules", choices=("mlp", "mlp+attn"), default="mlp", help="what to nest (mlp)")
    g.add_argument("--layers", default="all", help="layers to nest: all, 0-5, last2/3 ... (all)")
    g.add_argument("--data", help="training data: a corpus (file, folder, austen: language modelling) or a labelled "
                                  "set (r8-train, .tab/.csv/.jsonl: classification with a new head). Default austen "
                                  "for causal LMs, r8-train for encoders. For `sweep`: evaluation data (default: the "
                                  "held-out split of austen, or r8-test)")
    g.add_argument("--train-steps", type=integer(0), default=0, help="multi-rank training steps (0: SVD init only)")
    g.add_argument("--calib-data", help="text whose MLP inputs whiten the SVD start (file, folder, table, austen, "
                   "r8-train; self: sampled from the model; a mix self+austen; default: self+austen+r8-train, a third "
                   "each, or austen for an encoder)")
    g.add_argument("--calib-blocks", type=integer(1), default=CALIB_BLOCKS, help=f"calibration blocks ({CALIB_BLOCKS})")
    g.add_argument("--calib-len", type=integer(2), default=CALIB_LEN,
                   help=f"tokens per calibration block ({CALIB_LEN})")
    g.add_argument("--data-free", action="store_true", help="the paper's plain SVD start, no calibration data (what "
                   "torchrun does, and --layerwise unless --calib-data is given)")
    g.add_argument("--local-epochs", type=number(0, low_open=False), default=0.0, metavar="E",
                   help="after the whitened start, tune each nested MLP E epochs on its calibration rows toward the "
                        "original MLP's output, at ranks from 25%% to 100%% of its dense FLOPs at once, layer after "
                        "layer on what the tuned layers before it produce (gradient steps; 0: none)")
    g.add_argument("--local-lr", type=number(0, low_open=True), help="learning rate of --local-epochs (3e-4)")
    g.add_argument("--refit", action="store_true",
                   help="the start's down projections refit by least squares to the original MLP's output at every "
                        "rank from 25%% to 100%% of the dense FLOPs at once, layer after layer (no gradient step; "
                        "every rank that saves FLOPs gains, but the maximum rank is no longer the original)")
    g.add_argument("--ranks", help="training rank set, comma-separated (its maximum is the anchor); for `sweep`: the "
                                   "ranks to evaluate")
    g.add_argument("--n-ranks", type=integer(1), default=6, help="size of the default training rank set (6)")
    g.add_argument("--objective", choices=("uncertainty", "two_ce", "anchor"), default="uncertainty",
                   help="uncertainty (default: the paper's eq. 3), two_ce (L(R) + L(r), its Table 1 "
                        "ablation) or anchor (L(R) only)")
    g.add_argument("--sampling", choices=("curriculum", "uniform"), default="curriculum",
                   help="the variant rank's draw: curriculum (default: the pool starts just below the anchor "
                        "and widens to the lowest rank by --curriculum-end) or uniform")
    g.add_argument("--curriculum-end", type=number(0, 1, low_open=False), default=0.5,
                   help="fraction of training after which every variant rank can be drawn (0.5)")
    g.add_argument("--lr", type=number(0), default=1e-4, help="learning rate of the training (1e-4)")
    g.add_argument("--log-var-lr", type=number(0), default=1e-2, help="learning rate of the log-variances (1e-2)")
    g.add_argument("--batch-size", type=integer(1), default=8, help="blocks or texts per training step (8)")
    g.add_argument("--block-len", type=integer(2), help="tokens per LM training block (128); for `sweep` the perplexity "
                                                 "window (256)")
    g.add_argument("--max-len", type=integer(2), default=128, help="truncation of classification texts (128)")
    g.add_argument("--train", choices=("nested", "all"), default="nested",
                   help="nested: only the nested factors (+ a new classification head); all: every parameter")
    g.add_argument("--seed", type=integer(0, 2 ** 32 - 1), default=0, help="seed of the data order and rank draws (0)")
    g.add_argument("--checkpoint", help="training checkpoint folder (default DIR.ckpt beside --out; removed after "
                                        "the save; rerun the same command to resume)")
    g.add_argument("--layerwise", action="store_true",
                   help="read the checkpoint's safetensors one decoder layer at a time (memory: one layer plus the "
                        "embeddings), its SVDs on --device; the same folder as without it; no training (train the folder "
                        "afterwards). Also for `nest rank` (lowrank and nested forms; on the CPU)")

    g = p.add_argument_group("nest rank DIR")
    g.add_argument("--rank", type=integer(1), help="the rank to fix (each projection capped at its max rank)")
    g.add_argument("--budget", type=number(0, 1), help="a FLOPs budget as a fraction of the dense FLOPs of the nested "
                                                "projections: the largest rank that fits (e.g. 0.5)")
    g.add_argument("--form", choices=("lowrank", "dense", "nested"), default="lowrank",
                   help="lowrank: truncated factors (smaller, faster; mlpsurgery.load); dense: folded into the "
                        "original shapes (plain transformers); nested: all components, this rank as default")

    g = p.add_argument_group("nest sweep DIR")
    g.add_argument("--max-tokens", type=integer(1), default=8192, help="held-out tokens scored per rank (LM; 8192)")
    g.add_argument("--max-examples", type=integer(1), default=1000, help="test examples per rank (classifier; 1000)")
    g.add_argument("--plot", help="where the plot goes (default DIR-sweep.png)")
