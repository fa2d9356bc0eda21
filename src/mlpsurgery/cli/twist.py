"""TwIST commands: `twist train`, `twist extract`, and the pruning baselines (`prune`)."""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import MLPSurgeryError
from ..report import human_bytes, human_count, plot_layers, plot_rounds, table
from . import (calibration_blocks, check_max_memory, command, device_of, draw, integer, layer_device, number,
               progress, stage)
from ..methods.reconstruct import CALIB_BLOCKS, CALIB_LEN
from .core import MODEL_HELP, _load


def _ints(text: str | None) -> list[int]:
    if not text:
        return []
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise MLPSurgeryError(f"{text!r} is not a comma-separated list of block indices (e.g. 0,3)") from None


def _free_out(out: str, overwrite: bool, inputs=()) -> None:
    """Refuse an occupied --out before hours of training, not after."""
    from ..io import check_out

    check_out(out, overwrite, inputs)


def _check_checkpoint(ckpt: Path, out: str, inputs) -> None:
    """The checkpoint folder may not be, hold or lie in --out (saving --out would replace it) or an input."""
    from .. import files

    a, b = Path(os.path.abspath(ckpt)), Path(os.path.abspath(out))
    if a == b or a in b.parents or b in a.parents:
        raise MLPSurgeryError(f"the checkpoint folder {ckpt} and --out {out} overlap; give --checkpoint a folder "
                              "outside --out")
    files.check_apart(ckpt, inputs, what="the checkpoint folder")


# ---- twist train ------------------------------------------------------------------------------------

def run_train(args) -> dict:
    from .. import files, parallel
    from ..data import load_corpus
    from ..io import save
    from ..methods.twist import TwISTConfig, init_distributed, on_rank0, twist_train
    from ..models import check_context

    cfg = TwISTConfig(workers=args.workers, blocks=args.blocks, keep=args.keep, attn_keep=args.attn_keep,
                      parts=args.parts, shared_first=args.shared_first, shared_last=args.shared_last,
                      common_attn=_ints(args.common_attn), common_ffn=_ints(args.common_ffn), interval=args.interval,
                      steps=args.steps, batch_size=args.batch_size, lr=args.lr, weight_decay=args.weight_decay,
                      seed=args.seed)
    device = device_of(args)
    rank, world = (0, 1)
    if args.mode != "masked" or int(os.environ.get("WORLD_SIZE", "1")) > 1:  # masked under torchrun: refused below
        device = parallel.rank_device(device)
        rank, world = init_distributed(device)
    ckpt = Path(args.checkpoint) if args.checkpoint else Path(args.out).with_name(Path(args.out).name + ".checkpoint")
    if args.no_checkpoint:
        ckpt = None
    inputs = [args.model, args.data]

    def prepare():  # rank 0; a refusal here reaches every rank (on_rank0) before any waits for work
        _free_out(args.out, args.overwrite, inputs)
        if ckpt is not None:
            _check_checkpoint(ckpt, args.out, inputs)
        loaded = _load(args)
        loaded.model.to(device)
        check_context(loaded.model, args.block_len)
        stage(args, f"reading and tokenising {args.data or 'austen'}")
        corpus = load_corpus(args.data, loaded.require_tokenizer())
        blocks = corpus.blocks("train", args.block_len, max_blocks=args.max_blocks,
                               seed=args.seed if args.max_blocks else None)
        return loaded, blocks

    loaded, blocks = on_rank0(prepare) or (None, None)
    model = loaded.model if loaded is not None else None
    # TwIST checkpoints on rank 0 (the central model); DDP ranks each keep their own copy
    own = ckpt if rank == 0 or args.mode == "dp" else None
    res = twist_train(model, blocks, cfg, mode=args.mode, checkpoint_dir=own, progress=progress(args))
    if rank != 0:
        return {"rank": rank, **res.ranks[0]} if res.ranks else {"rank": rank}
    model.eval()
    stage(args, f"saving to {args.out}")
    save(model, args.out, tokenizer=loaded.tokenizer, overwrite=args.overwrite, inputs=inputs,
         extra={"twist_history": res.history, "twist_ranks": res.ranks, "twist_seconds": res.seconds,
                "twist_mode": args.mode, "world_size": world})
    if ckpt is not None:
        files.remove_ours(ckpt)  # only the folder twist_train claimed (marked); never one it refused
    out = {"out": args.out, "model": loaded.source, "mode": args.mode, "workers": cfg.workers, "world_size": world,
           "kappa": f"{cfg.keep}/{cfg.blocks}", "parts": cfg.parts, "rounds": res.rounds, "steps": res.steps,
           "resumed_from_round": res.resumed_from, "seconds": res.seconds, "data_blocks": list(blocks.shape),
           "final_loss": res.history[-1]["loss"] if res.history else None, "history": res.history,
           "ranks": res.ranks}
    what = "data parallel (the baseline)" if args.mode == "dp" else \
        f"TwIST {args.mode}, S={cfg.workers} subnets at kappa {cfg.keep}/{cfg.blocks} ({cfg.parts})"
    out["plot"] = draw("loss", lambda: plot_rounds(res.history, Path(args.out) / "twist-loss.png",
                                                   title=f"{what}: {loaded.source}"))
    return out


def render_train(r: dict) -> str:
    if "out" not in r:
        return f"rank {r['rank']} done"
    rows = [{"round": h["round"], "step": h["step"], "loss": h["loss"], "s": h.get("seconds", "")}
            for h in r["history"]]
    ranks = [{"rank": s.get("rank"), "held params": human_count(s["held_params"]),
              "held": human_bytes(s["held_bytes"]), "peak RSS": human_bytes(s["peak_rss_bytes"]),
              "sent": human_bytes(s["sent_bytes"]), "received": human_bytes(s["received_bytes"])}
             for s in r["ranks"]]
    return "\n".join([
        f"{r['mode']} run of {r['model']}: S={r['workers']} workers, kappa {r['kappa']} ({r['parts']}), "
        f"{r['rounds']} rounds / {r['steps']} batches per worker on {r['data_blocks'][0]} blocks of "
        f"{r['data_blocks'][1]} tokens, {r['seconds']:.0f} s",
        table(rows[-10:]), table(ranks), f"saved to {r['out']}"] +
        ([f"loss per subnet and round plotted to {r['plot']}"] if r.get("plot") else []))


# ---- twist extract ----------------------------------------------------------------------------------

def run_extract(args) -> dict:
    from ..io import replaced_modules, save
    from ..measure.cost import count_params
    from ..methods.twist import twist_extract
    from ..models import load_model

    _free_out(args.out, args.overwrite, [args.dir, args.calib_data])
    if args.layerwise:
        return _extract_layerwise(args)
    stage(args, f"loading {args.dir}")
    loaded = load_model(args.dir)
    loaded.model.to(device_of(args))
    calib = None
    if args.calib_data:
        from ..data.sampled import calibration_blocks as sampled_blocks
        from ..models import check_context

        check_context(loaded.model, args.calib_len)
        stage(args, f"reading and tokenising the calibration data {args.calib_data}")
        calib = sampled_blocks(args.calib_data, loaded.model, loaded.require_tokenizer(), args.calib_len,
                               args.calib_blocks, seed=args.seed, progress=progress(args))
    before = count_params(loaded.model)
    stage(args, f"cutting out the subnet of seed {args.seed}")
    # without a refit the loaded model is not used again: given up layer by layer as the subnet is built
    new = twist_extract(loaded.model, keep=args.keep, blocks=args.blocks, parts=args.parts, attn_keep=args.attn_keep,
                        shared_first=args.shared_first, shared_last=args.shared_last, seed=args.seed,
                        rescale=not args.no_rescale, consume=calib is None)
    entry = new._mlpsurgery_history[-1]
    refit = None
    if calib is not None:
        from ..methods.twist import refit_subnet_

        stage(args, f"refitting the narrowed projections on {calib.numel():,} calibration tokens")
        refit = refit_subnet_(new, loaded.model, calib, progress=progress(args))
    stage(args, f"saving to {args.out}")
    save(new, args.out, tokenizer=loaded.tokenizer, overwrite=args.overwrite, inputs=[args.dir, args.calib_data])
    after = count_params(new)
    res = {"out": args.out, "from": args.dir, "seed": args.seed, "config": entry["config"],
           "subnet": entry["provenance"]["subnet"], "params_before": before["total"], "params_after": after["total"],
           "attention_params": [before["attention"], after["attention"]], "mlp_params": [before["mlp"], after["mlp"]],
           "plain_transformers": not replaced_modules(new)}
    if refit is not None:
        res["refit"] = {"calibration": list(calib.shape), "layers": refit}
    return res


def _extract_layerwise(args) -> dict:
    """`twist extract --layerwise`: the folder read one decoder layer at a time (methods/twist/layerwise.py)."""
    from ..methods.twist.layerwise import extract_layerwise
    from ..models import _tokenizer, checkpoint_folder, working_dtype

    layer_device(args, on_device=False, what="twist extract")
    folder, _, name = checkpoint_folder(args.dir)
    tokenizer = _tokenizer(folder)
    calib = None
    if args.calib_data:  # the refit layer by layer: the blocks flow through the subnet's layers as they are written
        from ..models import check_context, read_config

        check_context(read_config(folder), args.calib_len)
        calib = calibration_blocks(args, tokenizer, folder, "the refit")
    r = extract_layerwise(folder, args.out, keep=args.keep, blocks=args.blocks, parts=args.parts,
                          attn_keep=args.attn_keep, shared_first=args.shared_first, shared_last=args.shared_last,
                          seed=args.seed, rescale=not args.no_rescale, dtype=working_dtype(),
                          tokenizer=tokenizer, overwrite=args.overwrite, inputs=[args.dir, args.calib_data],
                          source_name=name, progress=progress(args), calib=calib)
    return {"out": args.out, "from": args.dir, "seed": args.seed, **r}


def render_extract(r: dict) -> str:
    c = r["config"]
    how = ("a stock model: plain transformers from_pretrained loads it" if r["plain_transformers"] else
           "no stock transformers config states this structure (layer widths differ where shared layers stay "
           "whole; GPT-2 / OPT attention with fewer heads): load it with mlpsurgery.load")
    return (f"subnet kappa {c['keep']}/{c['blocks']} ({c['parts']}, seed {r['seed']}) of {r['from']}: "
            f"{human_count(r['params_before'])} -> {human_count(r['params_after'])} parameters (attention "
            f"{human_count(r['attention_params'][0])} -> {human_count(r['attention_params'][1])}, MLP "
            f"{human_count(r['mlp_params'][0])} -> {human_count(r['mlp_params'][1])})\n  {how}\n"
            + (_refit_line(r["refit"]["layers"], "on {} x {} calibration tokens".format(*r["refit"]["calibration"]))
               + "\n" if r.get("refit") else "") + f"  saved to {r['out']}")


def _refit_line(errors: dict, where: str) -> str:
    """The summary lines of a refit's {layer: {"error_before", "error_after", "attention": {...}}} (twist extract,
    prune --refit): the narrowed MLPs' down projections, the narrowed attention's output projections."""
    lines = []
    for what, parts in (("down projections of {} narrowed MLPs", [e for e in errors.values() if "error_after" in e]),
                        ("output projections of {} attention layers with heads cut",
                         [e["attention"] for e in errors.values() if "attention" in e])):
        if parts:
            mean = {k: sum(e[k] for e in parts) / len(parts) for k in ("error_before", "error_after")}
            lines.append(f"  {what.format(len(parts))} refit {where}: relative output error "
                         f"{mean['error_before']:.3f} -> {mean['error_after']:.3f} (mean over layers)")
    return "\n".join(lines)


# ---- prune ------------------------------------------------------------------------------------------

def run_prune(args) -> dict:
    from ..io import save
    from ..methods.pruning import prune
    from ..models import check_context
    from ..sites import find_sites, parse_layers

    from ..methods.pruning import parse_pattern

    pattern = parse_pattern(args.pattern)
    if pattern is not None and args.method not in ("magnitude", "wanda", "sparsegpt"):
        raise MLPSurgeryError(f"--pattern applies to magnitude, wanda and sparsegpt, not {args.method} "
                              "(which removes whole blocks: use --sparsity)")
    if args.refit and args.method not in ("fisher", "random"):
        raise MLPSurgeryError("--refit refits the projections that fisher / random narrowed: it needs --method fisher "
                              "or random")
    _free_out(args.out, args.overwrite, [args.model, args.data])
    check_max_memory(args)
    if args.layerwise:
        return _prune_layerwise(args, pattern)
    loaded = _load(args)
    layers = parse_layers(args.layers, len(find_sites(loaded.model)))
    blocks = None
    if args.method in ("wanda", "sparsegpt", "fisher") or args.refit:
        check_context(loaded.model, args.block_len)
        from ..data.sampled import calibration_blocks

        # the default stays Austen: the layer-by-layer mode (which cannot sample) then gives the same folder
        spec = args.data or "austen"
        stage(args, f"reading the calibration data {spec}")
        blocks = calibration_blocks(spec, loaded.model, loaded.require_tokenizer(), args.block_len, args.calib_blocks,
                                    seed=args.seed, progress=progress(args))
    model, report = prune(loaded.model, args.method, args.sparsity, parts=args.parts, layers=layers, data=blocks,
                          blocks=args.blocks, seed=args.seed, progress=progress(args), pattern=pattern)
    if args.refit:  # the closed-form compensation, on what the pruned layers before each produce
        from ..methods.reconstruct.layer import refit_narrowed_

        stage(args, f"refitting the narrowed projections on {blocks.numel():,} calibration tokens")
        errors = refit_narrowed_(model, loaded.model, blocks, what=f"{args.method} pruning at this sparsity",
                                 progress=progress(args))
        report["refit"] = {str(i): e for i, e in errors.items()}
    stage(args, f"saving to {args.out}")
    save(model, args.out, tokenizer=loaded.tokenizer, overwrite=args.overwrite, inputs=[args.model, args.data])
    res = {**report, "out": args.out, "model": loaded.source, "layers": layers,
           "calibration": None if blocks is None else list(blocks.shape)}
    res["plot"] = draw("per-layer", lambda: plot_prune(res, Path(args.out) / "prune-layers.png"))
    return res


def _prune_layerwise(args, pattern) -> dict:
    """`prune --layerwise`: read the checkpoint one layer at a time (methods/pruning/layerwise.py; the structured
    methods, which change shapes: methods/pruning/blocks_layerwise.py, Fisher's activations spilled to OUT.work past
    --max-memory)."""
    from ..data import load_corpus
    from ..data.sampled import refuse_layer_by_layer
    from ..files import check_state
    from ..io import check_out
    from ..methods.pruning.blocks_layerwise import METHODS as BLOCKS, block_prune_layerwise
    from ..methods.pruning.layerwise import prune_layerwise
    from ..models import _tokenizer, check_context, checkpoint_folder, read_config, working_dtype
    from ..sites import parse_layers

    # magnitude, Wanda and SparseGPT work each layer on --device; Fisher's per-layer backward and random subnets on
    # the CPU
    device = layer_device(args, on_device=args.method not in BLOCKS, what=f"prune --method {args.method}")
    folder, source, name = checkpoint_folder(args.model)
    config = read_config(folder)
    layers = parse_layers(args.layers, config.num_hidden_layers)  # (named, as the whole command does)
    tokenizer = _tokenizer(folder)
    work = Path(str(args.out) + ".work")
    if args.method in BLOCKS:
        check_out(args.out, args.overwrite, inputs=[args.model, args.data, work])
        check_state(work, inputs=[args.model, args.data, args.out], what="work")
    blocks = None
    if args.method in ("wanda", "sparsegpt", "fisher") or args.refit:
        refuse_layer_by_layer(args.data, "--data")
        if tokenizer is None:
            raise MLPSurgeryError(f"{folder} has no tokenizer files, which the calibration text needs")
        check_context(config, args.block_len)
        stage(args, f"reading and tokenising the calibration data {args.data or 'austen'}")
        corpus = load_corpus(args.data, tokenizer)
        blocks = corpus.blocks("train", args.block_len, max_blocks=args.calib_blocks, seed=args.seed)
    common = dict(parts=args.parts, layers=layers, data=blocks, dtype=working_dtype(), max_memory_gb=args.max_memory,
                  tokenizer=tokenizer, overwrite=args.overwrite, inputs=[args.model, args.data], source_name=name,
                  progress=progress(args))
    if args.method in BLOCKS:
        report = block_prune_layerwise(folder, args.out, args.method, args.sparsity, blocks=args.blocks,
                                       seed=args.seed, spill_dir=work, refit=args.refit, **common)
    else:
        report = prune_layerwise(folder, args.out, args.method, args.sparsity, pattern=pattern, device=device,
                                 **common)
    res = {**report, "out": args.out, "model": source, "layers": layers,
           "calibration": None if blocks is None else list(blocks.shape)}
    res["plot"] = draw("per-layer", lambda: plot_prune(res, Path(args.out) / "prune-layers.png"))
    return res


def plot_prune(r: dict, path):
    which = {"attn": "attention", "ffn": "MLP", "both": "attention and MLP"}[r["parts"]]
    structured = r["method"] in ("fisher", "random")
    panels = [("sparsity", f"share of each layer's {which} weights " + ("removed (physically)" if structured else
                                                                        "set to zero"), {"sparsity": "sparsity"}),
              ("relative output error", "output projections without the removed blocks, on calibration data"
               if structured else "pruned projections against the dense ones, on their calibration inputs",
               {"error": "error_rel"})]
    return plot_layers(r["per_layer"], panels, path, title=f"{r['method']} pruning of {r['model']}")


def render_prune(r: dict) -> str:
    what = f"{r['method']} pruning of {r['model']} ({r['parts']}, layers {r['layers'][0]}-{r['layers'][-1]})"
    if "sparsity" in r:
        what += f": sparsity {r['sparsity']:.4f} of {human_count(r['considered_params'])} weights"
        if r.get("pattern"):
            what += f" in the {r['pattern']} pattern"
    if r.get("calibration"):
        what += f", calibrated on {r['calibration'][0]} blocks of {r['calibration'][1]} tokens"
    lines = [what]
    per = r.get("per_layer") or []
    if per:
        errs = [x for x in per if x.get("error_rel") is not None]
        sp = [x["sparsity"] for x in per]
        lines.append("  per layer: sparsity " + (", ".join(f"{x['layer']}: {x['sparsity']:.3f}" for x in per)
                                                if len(per) <= 8 else
                                                f"{min(sp):.3f} to {max(sp):.3f} over {len(per)} layers"))
        if errs:
            worst = max(errs, key=lambda x: x["error_rel"])
            lines.append(f"  relative output error on {r['error_inputs']}: mean "
                         f"{sum(x['error_rel'] for x in errs) / len(errs):.4f}, largest {worst['error_rel']:.4f} "
                         f"(layer {worst['layer']})")
    if r.get("refit"):
        lines.append(_refit_line(r["refit"], "on the calibration inputs"))
    lines.append(f"  saved to {r['out']}")
    if r.get("plot"):
        lines.append(f"  plot: {r['plot']}")
    return "\n".join(lines)


def register(sub, groups) -> None:
    g = groups["twist"]
    p = command(g, "train", run_train, render_train,
                "train with TwIST (independent subnets; masked in one process, true / hybrid under torchrun) "
                "or the data-parallel baseline (--mode dp)", ranks=True)
    p.add_argument("model", nargs="?", help=MODEL_HELP)
    p.add_argument("--out", required=True, help="folder for the trained (full, dense) model")
    p.add_argument("--workers", type=integer(1), default=4, help="S: subnets per round; processes under torchrun (4)")
    p.add_argument("--blocks", type=integer(1), default=12, help="R: MLP chunks per layer (12)")
    p.add_argument("--keep", type=integer(1), default=6, help="X: MLP chunks per subnet, kappa = X/R (6)")
    p.add_argument("--attn-keep", type=integer(1), help="KV groups per subnet (default: round(kappa x groups), at least 1)")
    p.add_argument("--parts", choices=("attn", "ffn", "both"), default="both",
                   help="what is split into subnets: attention KV groups, MLP chunks or both (default)")
    p.add_argument("--mode", choices=("masked", "true", "hybrid", "dp"), default="masked",
                   help="masked: one process; true / hybrid: one process per worker under `torchrun "
                        "--nproc-per-node S -m mlpsurgery twist train ...`; dp: data-parallel baseline (DDP under "
                        "torchrun)")
    p.add_argument("--data", help="training text: file, folder of .txt, or austen (default) / r8")
    p.add_argument("--steps", type=integer(1), default=150, help="batches per worker over the run (150)")
    p.add_argument("--interval", type=integer(1), default=15, help="repartition interval in batches (15, as the paper)")
    p.add_argument("--batch-size", type=integer(1), default=2, help="blocks per batch and worker (2)")
    p.add_argument("--block-len", type=integer(2), default=128, help="tokens per block (128)")
    p.add_argument("--max-blocks", type=integer(1), help="use a random subset of this many training blocks")
    p.add_argument("--lr", type=number(0), default=1e-4, help="AdamW learning rate (1e-4)")
    p.add_argument("--weight-decay", type=number(0, low_open=False), default=0.0, help="AdamW weight decay (0)")
    p.add_argument("--shared-first", type=integer(0), default=2, help="first layers every subnet holds whole (2)")
    p.add_argument("--shared-last", type=integer(0), default=2, help="last layers every subnet holds whole (2)")
    p.add_argument("--common-attn", help="common set C of KV groups, e.g. 0 (default: none)")
    p.add_argument("--common-ffn", help="common set C of MLP chunks, e.g. 0,5 (default: none)")
    p.add_argument("--seed", type=integer(0, 2 ** 32 - 1), default=0, help="seed of the partitions and the data order (0)")
    p.add_argument("--checkpoint", help="checkpoint folder (default: OUT.checkpoint; a rerun with the same model, "
                   "data and settings resumes from it, anything else is refused; removed after success)")
    p.add_argument("--no-checkpoint", action="store_true", help="do not checkpoint (short or timed runs)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace OUT if it is a folder mlpsurgery wrote (never one it did not write)")

    p = command(g, "extract", run_extract, render_extract,
                "deploy one random subnet at kappa = X/R as a physically smaller dense model (no data, no search)")
    p.add_argument("dir", help="a TwIST-trained folder (or any MODEL: a random subnet of it)")
    p.add_argument("--keep", type=integer(1), required=True, help="X: MLP chunks kept per layer (kappa = X/R)")
    p.add_argument("--out", required=True,
                   help="folder for the extracted subnet (a plain transformers model where its widths are uniform)")
    p.add_argument("--seed", type=integer(0, 2 ** 32 - 1), default=0, help="which random subnet (0)")
    p.add_argument("--blocks", type=integer(1), help="R (default: as trained, else 12)")
    p.add_argument("--parts", choices=("attn", "ffn", "both"), help="default: as trained, else both")
    p.add_argument("--attn-keep", type=integer(1), help="KV groups kept (default: round(kappa x groups), at least 1)")
    p.add_argument("--shared-first", type=integer(0), help="first layers kept whole (default: as trained, else 2; 0 and "
                   "--shared-last 0 give uniform widths: a plain transformers model)")
    p.add_argument("--shared-last", type=integer(0), help="last layers kept whole (default: as trained, else 2)")
    p.add_argument("--no-rescale", action="store_true", help="do not fold sqrt(N_full/N_sub) into the projections")
    p.add_argument("--calib-data", help="calibration text (file, folder, table, austen; self: sampled from the "
                   "model): the narrowed MLPs' down projections and the narrowed attention's output projections "
                   "refit in sequence to the original's outputs (default: none, the paper's no-data cut)")
    p.add_argument("--calib-blocks", type=integer(1), default=CALIB_BLOCKS,
                   help=f"calibration blocks of --calib-len tokens ({CALIB_BLOCKS})")
    p.add_argument("--calib-len", type=integer(2), default=CALIB_LEN, help=f"tokens per calibration block ({CALIB_LEN})")
    p.add_argument("--layerwise", action="store_true",
                   help="one decoder layer in memory at a time (read from the folder's weights file), the same "
                        "subnet: for models larger than RAM")
    p.add_argument("--overwrite", action="store_true",
                   help="replace OUT if it is a folder mlpsurgery wrote (never one it did not write)")

    p = command(sub, "prune", run_prune, render_prune,
                "pruning baselines at a given sparsity of the chosen weights: magnitude, Wanda, SparseGPT "
                "(unstructured), Fisher block pruning and random subnets (structured)")
    p.add_argument("model", nargs="?", help=MODEL_HELP)
    p.add_argument("--method", choices=("magnitude", "wanda", "sparsegpt", "fisher", "random"), required=True,
                   help="magnitude / wanda / sparsegpt: unstructured or N:M; fisher / random: whole MLP chunks")
    how = p.add_mutually_exclusive_group(required=True)
    how.add_argument("--sparsity", type=number(0, 1, low_open=False, high_open=True),
                     help="fraction of the chosen weights removed; for fisher / random: of the blocks per layer")
    how.add_argument("--pattern", metavar="N:M",
                     help="semi-structured sparsity for magnitude / wanda / sparsegpt: N nonzeros in every M "
                          "consecutive inputs of a row (2:4, the format sparse tensor cores serve; 4:8)")
    p.add_argument("--parts", choices=("attn", "ffn", "both"), default="both",
                   help="what is split into subnets: attention KV groups, MLP chunks or both (default)")
    p.add_argument("--layers", help="layers to prune: all (default), 2-27, 0,3,5, last2/3")
    p.add_argument("--data", help="calibration text (wanda, sparsegpt, fisher, --refit): file, folder, table, austen, "
                   "r8; self: sampled from the model, whole model only; a mix self+austen (default: austen, as layer by "
                   "layer)")
    p.add_argument("--refit", action="store_true",
                   help="fisher / random: then refit each narrowed MLP's down projection (and each narrowed "
                        "attention's output projection) by least squares to the original's output, layer after layer "
                        "on the calibration text (the closed-form compensation)")
    p.add_argument("--calib-blocks", type=integer(1), default=16, help="calibration blocks (16)")
    p.add_argument("--block-len", type=integer(2), default=128, help="tokens per calibration block (128)")
    p.add_argument("--blocks", type=integer(1), default=12, help="R for fisher / random: MLP chunks per layer (12)")
    p.add_argument("--layerwise", action="store_true",
                   help="one decoder layer at a time, read from the checkpoint's safetensors files: memory of one "
                        "layer, not the model (the same result; docs/memory.md); magnitude, Wanda and SparseGPT work each "
                        "layer on --device. Fisher's backward pass goes layer by layer too (on the CPU), over the kept "
                        "inputs of every layer")
    p.add_argument("--max-memory", type=number(0), metavar="GB",
                   help="with --layerwise: keep the calibration activations on disk when the working set would pass "
                        "this many GiB (refused if one layer alone does not fit)")
    p.add_argument("--seed", type=integer(0, 2 ** 32 - 1), default=0,
                   help="seed of the calibration blocks' draw and of the random subnets (0)")
    p.add_argument("--out", required=True, help="folder for the pruned model")
    p.add_argument("--overwrite", action="store_true",
                   help="replace OUT if it is a folder mlpsurgery wrote (never one it did not write)")
