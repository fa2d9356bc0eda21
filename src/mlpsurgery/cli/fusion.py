"""MLP Fusion commands: `fuse` (compress MLPs by clustering neurons, or a baseline) and `eval ntk`
(Adam-NTK and output error of a compressed model against its original)."""

from __future__ import annotations

import time
from pathlib import Path

from ..report import human_count, plot_layers, table
from . import (calibration_blocks, check_max_memory, command, device_of, draw, integer, join_ranks, model_name,
               number, progress, stage)
from ..methods.reconstruct import CALIB_BLOCKS, CALIB_LEN
from .core import MODEL_HELP

METHOD_HELP = ("fusion (clusters, P stand-alone; the paper's method), cluster (P^1/2 folded in), svd, sketch, mmd, "
               "magnitude (unstructured, same weight count), neuron (importance pruning), random (random neurons)")


# ---- fuse -------------------------------------------------------------------------------------------

def run_fuse(args) -> dict:
    from .. import parallel
    from ..data import text_blocks
    from ..data.sampled import calibration_blocks as sampled_blocks, default_calibration, is_sampled
    from ..errors import MLPSurgeryError
    from ..measure.memory import peak_rss
    from ..io import save
    from ..measure.cost import count_params
    from ..methods.fusion import FusionConfig, fuse
    from ..models import load_model

    from ..files import check_state
    from ..io import check_out
    from ..models import check_context

    check_max_memory(args)
    inputs = [args.model, args.tune_data, args.calib_data]
    # torchrun: the layer-wise tuning split by layer over the ranks (whole model, or layer by layer)
    device, rank, world = join_ranks(args)
    if args.calib_data and (args.data_free or world > 1):
        raise MLPSurgeryError("--calib-data is for the data-aware fuse in one process; drop it with --data-free or "
                              "torchrun (those compress data-free)")
    if args.budget != "uniform" and (args.data_free or args.layerwise or world > 1 or args.method == "magnitude"):
        raise MLPSurgeryError("--budget per-layer is measured on calibration data with the whole model, which "
                              "--data-free, --layerwise, torchrun and magnitude do not do: drop it, or those")
    if args.local_epochs > 0 and (args.data_free or world > 1 or args.method == "magnitude"
                                  or (args.layerwise and not args.calib_data)):
        raise MLPSurgeryError("--local-epochs tunes each layer on its calibration rows, which --data-free, torchrun, "
                              "magnitude and --layerwise without --calib-data do not have: drop it, or those")
    if args.cluster_on == "activations" and (args.data_free or world > 1 or (args.layerwise and not args.calib_data)):
        raise MLPSurgeryError("--cluster-on activations clusters on calibration rows, which --data-free, torchrun and "
                              "--layerwise without --calib-data do not have: drop it, or those")
    if args.method == "magnitude" and args.calib_data:
        raise MLPSurgeryError("magnitude pruning is data-free: drop --calib-data (or use `prune --method wanda`)")

    def claims():  # rank 0's; every rank hears of a refusal
        check_out(args.out, args.overwrite, inputs=inputs + [args.checkpoint_dir])
        if args.checkpoint_dir:
            check_state(args.checkpoint_dir, inputs=inputs + [args.out])
        if world > 1 and not args.tune_data:
            raise MLPSurgeryError("under torchrun `fuse` splits its layer-wise tuning over the ranks by layer: give "
                                  "--tune-data, or run it as one process")

    parallel.on_rank0(claims)
    cfg = FusionConfig(width=args.width, method=args.method, layers=args.layers, seed=args.seed, n_init=args.n_init,
                       device=args.kmeans_device, importance=args.importance, cluster_on=args.cluster_on,
                       tune_steps=args.tune_steps,
                       tune_lr=args.tune_lr, calibration=args.calibration, refit=not args.no_refit,
                       budget=args.budget, local_epochs=args.local_epochs, local_lr=args.local_lr)
    cfg.validate()
    t0 = time.perf_counter()
    if args.layerwise:
        return _fuse_layerwise(args, cfg, t0, device)
    stage(args, f"loading {model_name(args.model)}")
    loaded = load_model(args.model, task=args.task, num_labels=args.num_labels)
    model = loaded.model.to(device)
    before = count_params(model)
    tune = None
    if args.tune_data:
        check_context(model, args.block_len)
        stage(args, f"reading and tokenising the tune data {args.tune_data}")
        tune = text_blocks(args.tune_data, loaded.require_tokenizer(), block_len=args.block_len,
                           max_blocks=args.tune_blocks, seed=args.seed)
    calib = None
    if not (args.data_free or world > 1 or args.method == "magnitude"):
        check_context(model, args.calib_len)
        spec = args.calib_data or default_calibration(model)
        stage(args, f"{'sampling and ' if is_sampled(spec) else ''}reading the calibration data {spec}")
        # the train splits: the bundled Austen's leaves Persuasion, its held-out novel, unseen; self: sampled
        calib = sampled_blocks(spec, model, loaded.require_tokenizer(), block_len=args.calib_len,
                               max_blocks=args.calib_blocks, seed=args.seed, progress=progress(args))
    report = fuse(model, cfg, tune_data=tune, progress=progress(args), checkpoint_dir=args.checkpoint_dir,
                  calib_data=calib)
    if calib is not None:
        report["calibration"]["data"] = spec  # which text: the tensor alone does not say
    if rank != 0:  # rank 0 holds every tuned layer, saves and reports
        return {"rank": rank, "world_size": world, "tuning": report["tuning"], "peak_rss_bytes": peak_rss(),
                "seconds": time.perf_counter() - t0}
    after = count_params(model)
    stage(args, f"saving to {args.out}")
    save(model, args.out, tokenizer=loaded.tokenizer, overwrite=args.overwrite, inputs=inputs)
    report.update(model=loaded.source, out=args.out, mlp_params_before=before["mlp"], mlp_params_after=after["mlp"],
                  params_before=before["total"], params_after=after["total"], seconds=time.perf_counter() - t0,
                  peak_rss_bytes=peak_rss())
    # the per-layer error, drawn into the output folder (beside the model, not one of its files)
    report["plot"] = draw("per-layer error", lambda: plot_fuse(report, Path(args.out) / "fuse-error.png"))
    return report


def _fuse_layerwise(args, cfg, t0: float, device: str) -> dict:
    """`fuse --layerwise`: the checkpoint read one layer at a time (methods/fusion/layerwise.py); with --tune-data
    each chosen layer's pairs are captured as the tune text flows through the original layers, into OUT.work (removed
    on success), and the layer tuned on them before the next is read. Under torchrun every rank reads every layer
    and tunes its share of them; rank 0 writes the folder."""
    from .. import parallel
    from ..data import text_blocks
    from ..errors import MLPSurgeryError
    from ..files import check_state, remove_ours
    from ..io import check_out
    from ..measure.memory import peak_rss
    from ..methods.fusion.layerwise import check_layerwise, fuse_layerwise
    from ..models import _tokenizer, checkpoint_folder, working_dtype

    check_layerwise(cfg, tune=bool(args.tune_data), calibrated=bool(args.calib_data))
    if args.max_memory is not None and not args.tune_data:
        raise MLPSurgeryError("--max-memory caps the tune data's hidden states, which only --tune-data has (without "
                              "it the layer-by-layer mode holds one layer and the embeddings): drop --max-memory")
    if args.task != "auto" or args.checkpoint_dir:
        raise MLPSurgeryError("--layerwise compresses the checkpoint's own class and tunes each layer in one go (no "
                              "tuning checkpoints): drop --task and --checkpoint-dir, or drop --layerwise")
    folder, source, name = checkpoint_folder(args.model)
    tok = _tokenizer(folder)
    tune, work = None, Path(str(args.out) + ".work")  # the captured pairs of the layer being tuned
    inputs = [args.model, args.tune_data, args.calib_data]
    check_out(args.out, args.overwrite, inputs=inputs + [work])
    if args.tune_data:
        check_state(work, inputs=inputs + [args.out], what="work")
        if tok is None:
            raise MLPSurgeryError(f"{folder} has no tokenizer, which the tune data needs; add its tokenizer files")
        stage(args, f"reading and tokenising the tune data {args.tune_data}")
        tune = text_blocks(args.tune_data, tok, block_len=args.block_len, max_blocks=args.tune_blocks,
                           seed=args.seed)
    calib = calibration_blocks(args, tok, folder)  # layer by layer asked for by name (the default stays data-free)
    report = fuse_layerwise(folder, args.out, cfg, dtype=working_dtype(), tokenizer=tok, overwrite=args.overwrite,
                            inputs=inputs, source_name=name, progress=progress(args), tune_data=tune,
                            workdir=work if tune is not None else None, max_memory_gb=args.max_memory,
                            check=lambda m: _check_lengths(m, args, tune is not None, calib is not None),
                            device=device, calib_data=calib)
    parallel.barrier()  # (every rank done with its captures before rank 0 removes the work folder)
    if parallel.world()[0] != 0:
        return {**report, "peak_rss_bytes": peak_rss(), "seconds": time.perf_counter() - t0}
    if tune is not None:
        remove_ours(work)
    report.update(model=source, out=args.out, seconds=time.perf_counter() - t0, peak_rss_bytes=peak_rss())
    report["plot"] = draw("per-layer error", lambda: plot_fuse(report, Path(args.out) / "fuse-error.png"))
    return report


def _check_lengths(model, args, tune: bool, calibrated: bool) -> None:
    from ..models import check_context

    if tune:
        check_context(model, args.block_len)
    if calibrated:
        check_context(model, args.calib_len)


def plot_fuse(r: dict, path):
    tuned = "tuning" in r
    series = {"one-shot": "error_rel", **({"after layer-wise tuning": "error_rel_tuned"} if tuned else {})}
    where = ("the tune data's MLP inputs" if r["error_inputs"].startswith("the tune") else
             "the calibration MLP inputs" if r["error_inputs"].startswith("the calibration") else
             "random inputs (no data)")
    return plot_layers(r["sites"], [("relative output error", f"||H~ - H|| / ||H|| on {where}", series)],
                       path, title=f"{r['method']} to width {r['width']}: {r['model']}, each MLP against the original")


def render_fuse(r: dict) -> str:
    if "out" not in r:  # a torchrun rank other than 0
        return f"rank {r['rank']} of {r['world_size']} done"
    rows = [{"layer": s["layer"], "h": s["h"], "width": s["width"], "params": f"{human_count(s['params_before'])} -> "
             f"{human_count(s['nonzero_after'])}", **({"clusters (min/max size)": f"{s['cluster_sizes']['min']}/"
                                                       f"{s['cluster_sizes']['max']}"} if "cluster_sizes" in s else {}),
             "rel. error": f"{s['error_rel']:.4f}",
             **({"tuned": f"{s['error_rel_tuned']:.4f}"} if "error_rel_tuned" in s else {})}
            for s in r["sites"]]
    lines = [f"{r['method']}: {r['model']} layers {r['layers']} compressed to width {r['width']}", table(rows),
             f"MLP parameters {human_count(r['mlp_params_before'])} -> {human_count(r['mlp_params_after'])}, "
             f"model {human_count(r['params_before'])} -> {human_count(r['params_after'])}"]
    if "tuning" in r:
        t = r["tuning"]
        split = f", split by layer over {r['world_size']} processes" if r.get("world_size", 1) > 1 else ""
        rose = (" -- it rose: the tuning made these layers' outputs worse on its own tokens; rerun with a lower "
                "--tune-lr or fewer --tune-steps") if t["mse_after"] > t["mse_before"] else ""
        lines.append(f"layer-wise tuning: {t['steps']} steps on {t['tokens']} tokens, MSE {t['mse_before']:.4g} -> "
                     f"{t['mse_after']:.4g}{split}{rose}")
    lines.append(f"relative error of each compressed MLP's output: on {r['error_inputs']}")
    lines.append(f"saved to {r['out']} ({r['seconds']:.0f} s); after fine-tuning, `mlpsurgery export` folds P into a "
                 "plain transformers model (every layer fused to one width)")
    if r.get("plot"):
        lines.append(f"plot: {r['plot']}")
    return "\n".join(lines)


# ---- eval ntk ---------------------------------------------------------------------------------------

def run_ntk(args) -> dict:
    import torch

    from ..data import load_corpus, read_labelled
    from ..errors import MLPSurgeryError
    from ..measure.ntk import compressed_layers, mlp_ntk_error, ntk_bytes, ntk_error, output_error
    from ..models import load_model
    from ..resources import check_memory
    from ..sites import find_sites, parse_layers

    from ..models import check_context

    dev = device_of(args)
    stage(args, f"loading {args.model_a} and {args.model_b}")
    ref = load_model(args.model_a, task=args.task)
    check_context(ref.model, args.block_len)
    cand = load_model(args.model_b, task=args.task).model.to(dev)
    ref.model.to(dev)
    tok = ref.require_tokenizer()
    labels = None

    def check_n(held: int, what: str) -> int:
        # an --n the data cannot fill is refused (not quietly cut to what it holds); the default takes what there is
        if args.n is not None and 0 < held < args.n:  # (no block at all: corpus.blocks says so)
            raise MLPSurgeryError(f"--n {args.n} is more than the {held} {what} {args.data} holds; give --n {held} "
                                  "or less (or more data)")
        return min(args.n or 32, held)

    if args.f == "logit":
        data = read_labelled(args.data)
        n = check_n(len(data), "labelled examples")
        data = data.sample(n, seed=args.seed) if n < len(data) else data
        enc = tok(data.texts, padding="max_length", truncation=True, max_length=args.block_len, return_tensors="pt")
        inputs = {k: v for k, v in enc.items() if k in ("input_ids", "attention_mask", "token_type_ids")}
        ids, labels = inputs["input_ids"], torch.tensor(data.labels)
    else:
        corpus = load_corpus(args.data, tok)
        held = sum(len(s) // args.block_len for s in corpus.sequences("heldout"))
        n = check_n(held, f"held-out blocks of {args.block_len} tokens")
        ids = inputs = corpus.blocks("heldout", args.block_len, max_blocks=n, seed=args.seed)
    if len(ids) < 2:
        raise MLPSurgeryError(f"{args.data} gave {len(ids)} sample(s); the kernel needs at least 2 (more text or a "
                              "smaller --block-len)")
    layers = parse_layers(args.layers, len(find_sites(ref.model))) if args.layers else \
        compressed_layers(ref.model, cand)
    need = ntk_bytes(ref.model, cand, len(ids), layers, args.scope)  # before any kernel is computed
    what = f"--n {len(ids)} (the Adam NTK of {len(ids)} samples"
    check_memory(need["kernels"], f"{what}: two {len(ids)} x {len(ids)} float64 kernels)", "lower --n")
    check_memory(need["signs"], f"{what}: the gradient signs, {len(ids)} bytes per MLP parameter)",
                 "lower --n (or name fewer --layers)", device=dev)
    t0 = time.perf_counter()
    res = {"reference": ref.source, "candidate": args.model_b, "data": args.data, "samples": len(ids),
           "block_len": args.block_len, "layers": layers, "scope": args.scope, "f": args.f}
    if args.scope in ("model", "both"):
        ntk = ntk_error(ref.model, cand, inputs, layers=layers, f=args.f, labels=labels, seed=args.seed,
                        progress=progress(args))
        res["model"] = {k: v for k, v in ntk.items() if not k.startswith("K_")}
    if args.scope in ("mlp", "both"):
        res["mlp"] = mlp_ntk_error(ref.model, cand, ids, layers=layers, seed=args.seed, progress=progress(args))
    res["output"] = output_error(ref.model, cand, ids, layers=layers)
    res["seconds"] = time.perf_counter() - t0
    return res


def render_ntk(r: dict) -> str:
    mlp = {x["layer"]: x for x in r["mlp"]["layers"]} if "mlp" in r else {}
    rows = [{"layer": x["layer"], "output error ||H~-H||_F": x["error"], "relative": x["error_rel"],
             **({"per-MLP NTK error (relative)": mlp[x["layer"]]["ntk_error_rel"]} if mlp else {})}
            for x in r["output"]["layers"]]
    lines = [f"{r['candidate']} vs {r['reference']} on {r['samples']} samples of {r['data']}"]
    if "model" in r:
        m = r["model"]
        lines.append(f"whole-model Adam NTK (f = {r['f']}) over the MLPs of layers {r['layers']} "
                     f"({human_count(m['params_reference'])} vs {human_count(m['params_candidate'])} parameters): "
                     f"||K_b - K_a||_F = {m['ntk_error']:.5g} (relative {m['ntk_error_rel']:.4f})")
    if mlp:
        lines.append(f"per-MLP Adam NTK: mean relative error {r['mlp']['ntk_error_rel']:.4f}")
    lines += [table(rows), f"final hidden state relative error {r['output']['final_hidden_error_rel']:.4f} "
              f"({r['seconds']:.0f} s)"]
    return "\n".join(lines)


def register(sub, groups) -> None:
    from ..methods.fusion import METHODS

    p = command(sub, "fuse", run_fuse, render_fuse,
                "compress MLPs by clustering neurons (MLP Fusion), or with a baseline at the same width", ranks=True)
    p.add_argument("model", nargs="?", help=MODEL_HELP)
    p.add_argument("--out", required=True, help="output folder (mlpsurgery save format; `mlpsurgery export` after "
                   "fine-tuning folds P into a plain transformers model)")
    p.add_argument("--width", type=integer(1), help="new MLP inner width k (default: a quarter of h)")
    p.add_argument("--method", choices=METHODS, default="fusion", help=METHOD_HELP)
    p.add_argument("--layers", default="last2/3", help="layers to compress: all, 8-11, 0,3,5 or last2/3 (default)")
    p.add_argument("--tune-data", help="task text for layer-wise tuning (file, folder of .txt, austen, r8); omit for "
                   "the one-shot, data-free compression")
    p.add_argument("--tune-blocks", type=integer(1), default=64, help="token blocks of tune data to use (64)")
    p.add_argument("--tune-steps", type=integer(0), help="tuning steps (default: one epoch over the tune tokens)")
    p.add_argument("--tune-lr", type=number(0), default=1e-3, help="learning rate of the layer-wise tuning (1e-3)")
    p.add_argument("--block-len", type=integer(2), default=128, help="tokens per tune block (128)")
    p.add_argument("--importance", choices=("auto", "weight", "obs", "output", "activation"), default="auto",
                   help="neuron selection: auto (output when calibrated, weight with --data-free), weight (norms, no "
                        "data), obs (greedy structured optimal brain surgeon), output (RMS activation x down norm), "
                        "activation (mean |activation| x down norm)")
    p.add_argument("--cluster-on", choices=("auto", "weights", "activations"), default="auto",
                   help="fusion / cluster: what k-means groups neurons by: auto (activations when calibrated, weights "
                        "with --data-free), weights (the paper's neuron weight vectors), activations (each neuron's "
                        "contribution on calibration rows)")
    p.add_argument("--calib-data", help="calibration text for the data-aware compression (file, folder, table, austen, "
                   "r8-train; self: sampled from the model; a mix self+austen; default: self+austen+r8-train, a third "
                   "each; austen for an encoder; none layer by layer). Calibrate on text like the model's use: "
                   "docs/calibration.md")
    p.add_argument("--calib-blocks", type=integer(1), default=CALIB_BLOCKS,
                   help=f"calibration blocks of --calib-len tokens ({CALIB_BLOCKS})")
    p.add_argument("--calib-len", type=integer(2), default=CALIB_LEN,
                   help=f"tokens per calibration block ({CALIB_LEN})")
    p.add_argument("--calibration", choices=("sequential", "original"), default="sequential",
                   help="sequential (default): each layer on what the compressed layers before it produce; original: "
                        "every layer on the original model's activations")
    p.add_argument("--budget", choices=("uniform", "per-layer"), default="uniform",
                   help="uniform: every chosen layer at --width; per-layer: the same total width, each layer's chosen "
                        "by its measured effect on the model's output (calibrated mode only)")
    p.add_argument("--local-epochs", type=number(0, low_open=False), default=0.0, metavar="E",
                   help="on-policy local tuning: after its refit, each layer's MLP trained E epochs over its "
                        "calibration rows toward the original's output on them (gradient steps; 0: one-shot, default; "
                        "8 is what docs/calibration.md measured)")
    p.add_argument("--local-lr", type=number(0), default=3e-3, help="Adam learning rate of the local tuning (3e-3)")
    p.add_argument("--no-refit", action="store_true",
                   help="keep the narrowed MLP's down projection as the method makes it (no least-squares refit)")
    p.add_argument("--data-free", action="store_true",
                   help="the papers' one-shot compression, no calibration data (what torchrun does, and --layerwise "
                        "unless --calib-data is given)")
    p.add_argument("--seed", type=integer(0, 2 ** 32 - 1), default=0, help="seed of k-means, sampling and tuning (0)")
    p.add_argument("--n-init", type=integer(1), default=3, help="k-means restarts (3)")
    p.add_argument("--kmeans-device", help="where k-means runs (default: --device)")
    p.add_argument("--task", default="auto", choices=("auto", "causal-lm", "encoder", "classifier"),
                   help="model head to load (classifier: a sequence-classification head, give --num-labels)")
    p.add_argument("--num-labels", type=integer(2), help="classes of the classifier head (with --task classifier)")
    p.add_argument("--checkpoint-dir", help="checkpoint folder for the layer-wise tuning (resumes when rerun)")
    p.add_argument("--layerwise", action="store_true",
                   help="read the checkpoint's safetensors one decoder layer at a time (memory: one layer plus the "
                   "embeddings), each worked on --device; the same folder as without it. With --tune-data each layer is "
                   "tuned as it is read (its pairs captured into OUT.work, removed after)")
    p.add_argument("--max-memory", type=number(0), metavar="GB",
                   help="with --layerwise --tune-data: keep the tune data's hidden states on disk (in OUT.work) when "
                        "they, one layer and its captured pairs would pass this many GiB (refused if one layer alone "
                        "does not fit)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace OUT if it is a folder mlpsurgery wrote (never one it did not write)")

    p = command(groups["eval"], "ntk", run_ntk, render_ntk,
                "Adam-NTK error and MLP output error of MODEL_B (compressed) against MODEL_A (original)")
    p.add_argument("model_a", help="the reference (original) model: " + MODEL_HELP)
    p.add_argument("model_b", help="the compressed model (e.g. a folder written by `mlpsurgery fuse`)")
    p.add_argument("--data", required=True, help="text (file, folder, austen, r8; held-out split) or, with --f logit, "
                   "a labelled set (.tab/.csv/.jsonl, r8-test)")
    p.add_argument("--n", type=integer(2), help="samples (32, or all the data holds when fewer); the kernel is n x n")
    p.add_argument("--block-len", type=integer(2), default=128, help="tokens per sample (128)")
    p.add_argument("--layers", help="MLPs whose parameters form θ (default: the layers where the models differ)")
    p.add_argument("--f", choices=("projection", "logit"), default="projection",
                   help="scalar output: projection (random projection of the mean final hidden state) or logit "
                   "(classifier logit of the true class)")
    p.add_argument("--scope", choices=("model", "mlp", "both"), default="model",
                   help="model: f of the whole model, θ = the MLPs of the layers; mlp: each MLP on its own (f = a "
                   "projection of its output on the original inputs, the paper's Table 1); both")
    p.add_argument("--task", default="auto", choices=("auto", "causal-lm", "encoder", "classifier"),
                   help="model head to load for both models (auto: from the config)")
    p.add_argument("--seed", type=integer(0, 2 ** 32 - 1), default=0, help="sample choice and the projection vector")
