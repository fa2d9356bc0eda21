"""DLR-Lock's `lock dlr` command (`attack dlr`, the adaptive attacker, is in dlr_attack.py)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from ..errors import MLPSurgeryError
from ..report import table
from . import check_max_memory, command, device_of, integer, join_ranks, model_name, number, stage
from .core import MODEL_HELP


# Distillation text of `lock dlr`: two domains (phase 2 on Austen alone made R8 news worse: docs/dlr-lock.md). The
# R8 *test* articles, which `--second-corpus r8` scores, are not in it.
DEFAULT_DATA = "austen+r8-train"


def run_lock(args) -> dict:
    from .. import parallel
    from ..data import load_corpus
    from ..files import check_state, claim, model_fingerprint, remove_ours
    from ..io import check_out, check_source, save, source_spec
    from ..measure.memory import peak_rss
    from ..measure.perplexity import default_block_len, is_causal_lm, perplexity
    from ..methods.dlr_lock import continue_phase2, dlr_lock, plan
    from ..methods.dlr_lock.distributed import check_ranks
    from ..models import check_context, load_model

    out = Path(args.out)
    work = Path(args.workdir) if args.workdir else out.with_name(out.name + ".work")
    inputs = [args.model, args.data, args.second_corpus, args.original]
    layerwise = _layerwise(args)
    check_max_memory(args, layerwise)
    if args.original and not args.phase2_only:
        raise MLPSurgeryError("--original names the model a locked folder was made from, for --phase2-only: add "
                              "--phase2-only, or drop --original")
    if layerwise:
        if args.phase2_only:
            raise MLPSurgeryError("--phase2-only trains the whole locked model (one process, or sharded under "
                                  "torchrun); drop --layerwise")
        return _lock_layerwise(args, out, work, inputs)
    device, rank, world = join_ranks(args)  # torchrun: phase 1 split by layer over the ranks, phase 2 sharded

    def claims():  # rank 0's; every rank hears of a refusal
        check_out(out, args.overwrite, inputs=inputs + [work])
        check_state(work, inputs=inputs + [out], what="work")

    parallel.on_rank0(claims)
    # phase 2 alone under torchrun: both models read into FSDP shards a layer at a time (no rank holds either whole),
    # the locked one trained sharded and saved a tensor at a time
    sharded = args.phase2_only and world > 1
    if sharded:
        stage(args, f"loading {model_name(args.model)} into {world} shards, layer by layer")
        loaded, stream = parallel.load_sharded(args.model, device, progress=not args.quiet)
        streamed = stream is not None
        del stream
        if not streamed:  # (what the layer-by-layer reader cannot read is loaded whole, then sharded)
            parallel.shard(loaded.model, device)
        model = loaded.model
        loaded_bytes = parallel.local_bytes(model.parameters())
    else:
        stage(args, f"loading {model_name(args.model)}")
        loaded = load_model(args.model)
        model = loaded.model.to(device)
    tok = loaded.require_tokenizer()
    cfg = _config(args)
    original = model  # the teacher: the model itself, or (--phase2-only) the one the locked folder was made from
    if args.phase2_only:
        from ..methods.dlr_lock import dlr_parameters

        if not dlr_parameters(model):
            raise MLPSurgeryError(f"{args.model} holds no DLR-Nets: --phase2-only continues a folder `lock dlr` wrote "
                                  "(e.g. with --layerwise --phase2-steps 0); drop --phase2-only to lock this model")
        if cfg.phase2_steps < 1:
            raise MLPSurgeryError("--phase2-only needs --phase2-steps >= 1")
        spec = args.original or source_spec(model)
        if not spec:
            raise MLPSurgeryError("the locked folder names its original model only by name and fingerprint; pass "
                                  "--original MODEL (it is checked against the fingerprint)")
        # read in the dtype it was locked in (what its recorded fingerprint is of), then run in the working one
        saved, held = _locked_dtype(args.model), next(model.parameters()).dtype
        if sharded:
            stage(args, f"loading the original model {model_name(spec)} into {world} shards, layer by layer")
            original = parallel.load_sharded(spec, device, progress=not args.quiet, dtype=saved, hold=held)[0].model
        else:
            stage(args, f"loading the original model {model_name(spec)}")
            original = load_model(spec, dtype=saved).model
        check_source(model, original, spec)
        if not sharded:
            original.to(device=device, dtype=held)
    else:
        _rank_from_depth(args, cfg, model)
        cfg.validate()
        check_ranks(plan(model, cfg)[0])  # the layer selection and the MLPs are checked before anything is written
        _check_net_memory(model, cfg, device, world)
    loaded_rss = peak_rss()  # the peak of loading (both models, for phase 2 alone)
    check_context(model, cfg.block_len)
    _check_top_k(model, cfg)
    data = args.data or DEFAULT_DATA
    stage(args, f"reading and tokenising {data}")
    corpus = load_corpus(data, tok)
    p2 = corpus.blocks("train", cfg.block_len, max_blocks=cfg.phase2_blocks, seed=cfg.seed + 1)
    causal = is_causal_lm(model)
    evals: dict[str, dict] = {}
    second = None
    if causal and args.eval_tokens and args.second_corpus:
        second = load_corpus(args.second_corpus, tok)
    block = default_block_len(model)

    def measure(stage: str, m=model):
        # rank 0 measures (the others go on to the next gather); a sharded model's forward takes every rank
        if not (causal and args.eval_tokens) or (rank != 0 and not parallel.is_sharded(m)):
            return
        row = {"heldout": perplexity(m, corpus.heldout, block_len=block, max_tokens=args.eval_tokens,
                                     progress=not args.quiet, bos_id=corpus.bos).ppl}
        if second is not None:
            row["second_corpus"] = perplexity(m, second.train + second.heldout, block_len=block,
                                              max_tokens=args.eval_tokens, progress=not args.quiet,
                                              bos_id=second.bos).ppl
        evals[stage] = row

    # The work folder belongs to this model (and, for phase 2 alone, its original): its stages also record their
    # own settings.
    owner = {"model": model_fingerprint(model)}
    if args.phase2_only:
        owner["original"] = model_fingerprint(original)
    parallel.on_rank0(lambda: claim(work, "dlr-work", owner, inputs=inputs + [out]))
    measure("original", original)
    t0 = time.perf_counter()
    if args.phase2_only:
        measure("phase1")
        report = continue_phase2(model, original, p2, cfg, work, progress=not args.quiet, data_name=corpus.source,
                                 on_teacher=parallel.drop,  # the original is not needed past its targets
                                 unshard=not sharded)
    else:
        report = dlr_lock(model, _calibration(corpus, cfg), p2, cfg, work, progress=not args.quiet,
                          data_name=corpus.source, on_phase1=lambda m: measure("phase1"))
    del original
    seconds = time.perf_counter() - t0
    if sharded:  # every rank measures and saves (each parameter gathered in turn, written by rank 0)
        measure("phase2")
        stage(args, f"saving to {out}")
        parallel.save_sharded(model, out, tokenizer=tok, overwrite=args.overwrite, inputs=inputs + [work])
    if rank != 0:  # rank 0 reports (and, unless sharded, measures and saves)
        return {"rank": rank, "world_size": world, "seconds": seconds, "peak_rss_bytes": peak_rss(),
                "peak_rss_loaded_bytes": loaded_rss, **({"loaded_param_bytes": loaded_bytes} if sharded else {})}
    if not sharded:
        measure("phase2")
        stage(args, f"saving to {out}")
        save(model, out, tokenizer=tok, overwrite=args.overwrite, inputs=inputs + [work])
    kept = args.keep_work or args.workdir is not None  # a folder the user named is theirs to remove
    if not kept:
        remove_ours(work)
    res = {"out": str(out), "model": loaded.source, "world_size": world, "peak_rss_bytes": peak_rss(),
           "peak_rss_loaded_bytes": loaded_rss,
           "config": cfg.__dict__, "report": report.as_dict(), "phase2_only": args.phase2_only,
           "perplexity": evals, "seconds": seconds, "data": corpus.source, "heldout": corpus.heldout_names,
           "second_corpus": args.second_corpus, "workdir": str(work) if kept else None}
    if sharded:  # this rank's share of the locked model's parameter bytes, as loaded
        res.update(loaded_into_shards=streamed, loaded_param_bytes=loaded_bytes)
    if "original" in evals and "phase2" in evals:
        res["heldout_ratio"] = evals["phase2"]["heldout"] / evals["original"]["heldout"]
    return res


def _locked_dtype(locked: str):
    """The dtype a locked folder was saved in: its original is read in it (what the fingerprint the folder records is
    of) and then held in the working dtype, so that --dtype does not make the original look like another model."""
    import torch

    from ..io import read_manifest
    from ..models import checkpoint_folder

    saved = read_manifest(checkpoint_folder(locked)[0]).get("dtype")
    return getattr(torch, saved) if saved else None


def _config(args):
    from ..methods.dlr_lock import DLRConfig

    return DLRConfig(rank=args.rank or 64, depth=args.depth, layers=args.layers, block_len=args.block_len,
                     calib_blocks=args.calib_blocks, phase1_steps=args.phase1_steps, phase1_lr=args.phase1_lr,
                     phase1_tokens=args.phase1_tokens, phase2_steps=args.phase2_steps, phase2_lr=args.phase2_lr,
                     phase2_batch=args.phase2_batch, phase2_blocks=args.phase2_blocks, top_k=args.top_k,
                     phase1_loss=args.phase1_loss, phase1_hard_fraction=args.phase1_hard_fraction,
                     compile=not args.no_compile, phase1_start=args.phase1_start, start_tokens=args.start_tokens,
                     onpolicy_steps=args.onpolicy_steps, onpolicy_mix=args.onpolicy_mix, onpolicy_lr=args.onpolicy_lr,
                     gradient_checkpointing=not args.no_checkpointing, seed=args.seed, memory_limit_gb=args.memory_gb)


def _rank_from_depth(args, cfg, model) -> None:
    """--depth without --rank: the rank whose blocks at that depth best match the MLP's parameters (shapes only)."""
    if args.depth and not args.rank:
        from ..methods.dlr_lock import DLRConfig, plan, rank_for_depth
        from ..sites import find_sites

        _, _, budget = plan(model, DLRConfig(rank=1, layers=args.layers))
        cfg.rank = rank_for_depth(budget, find_sites(model).config.hidden_size, args.depth)


def _layerwise(args) -> bool:
    """Phase 1 layer by layer? As --layerwise / --no-layerwise say; by default wherever it can run -- a model with
    weight files (not tiny:ARCH), not --phase2-only -- since there it is the better lock in less time and memory
    (docs/notes/dlr-lock.md, "Layer by layer"), in one process or under torchrun (the layers split over the ranks: the
    same lock, bit for bit), and on the CPU: on a GPU it is asked for with --layerwise (each layer captured and its
    net trained on the device), the whole-model phase 1 staying the default there until the layer-by-layer one is
    measured on one."""
    if args.layerwise:
        return True
    if args.layerwise is not None:
        return False
    return not (args.phase2_only or str(args.model or "").startswith("tiny:") or device_of(args) != "cpu")


def _calibration(corpus, cfg):
    calib = corpus.blocks("train", cfg.block_len, max_blocks=cfg.calib_blocks, seed=cfg.seed)
    if len(calib) < 2:
        raise MLPSurgeryError(f"the training split of {corpus.source} gives {len(calib)} block of {cfg.block_len} "
                              "tokens; phase 1 needs at least 2: give more text or a smaller --block-len")
    return calib


def _lock_layerwise(args, out: Path, work: Path, inputs: list) -> dict:
    """`lock dlr --layerwise` (the default in one process): capture and module-wise distillation one decoder layer at
    a time, read from the checkpoint's files (methods/dlr_lock/layerwise.py); then, unless --phase2-steps 0, phase 2
    on the whole locked model as --phase2-only runs it (it trains every layer at once), with the perplexity of the
    original, of phase 1 and of phase 2. In that case the work folder holds three resumable parts: `layers/` (the
    per-layer stages), `phase1/` (the phase-1 lock, a folder `lock dlr` writes) and `phase2/` (phase 2's stages)."""
    from dataclasses import replace

    from .. import parallel
    from ..data import load_corpus
    from ..files import check_state, claim, remove_ours
    from ..io import check_out
    from ..measure.memory import peak_rss
    from ..methods.dlr_lock import plan
    from ..methods.dlr_lock.distributed import check_ranks
    from ..methods.dlr_lock.layerwise import check_layerwise, lock_layerwise, open_stream
    from ..models import _tokenizer, check_context, checkpoint_folder, working_dtype

    # (a device this machine lacks is refused before anything is read); under torchrun the layers are split over
    # the ranks, each reading one layer at a time, and phase 2 runs sharded
    device, rank, world = join_ranks(args)
    cfg = _config(args)
    staged = cfg.phase2_steps > 0  # phase 2 follows on the whole locked model
    cfg.validate()

    def claims():  # rank 0's; every rank hears of a refusal
        check_out(out, args.overwrite, inputs=inputs + [work])
        check_state(work, inputs=inputs + [out], what="work")

    parallel.on_rank0(claims)
    folder, source, name = checkpoint_folder(args.model)
    tok = _tokenizer(folder)
    if tok is None:
        raise MLPSurgeryError(f"{folder} has no tokenizer, which the calibration text needs; add its tokenizer files")
    layers_work, p1_out = (work / "layers", work / "phase1") if staged else (work, out)
    stage(args, f"reading the parts of {model_name(args.model)} outside its layers")
    stream = open_stream(folder, parallel.rank_folder(layers_work), dtype=working_dtype(),
                         max_memory_gb=args.max_memory, device=device)
    _rank_from_depth(args, cfg, stream.model)
    one = replace(cfg, phase2_steps=0)  # what the layer-by-layer part runs (and its work records)
    check_layerwise(one)
    # the layer selection, the model's MLPs and the number of ranks are checked before anything is written
    check_ranks(plan(stream.model, cfg)[0])
    _check_net_memory(stream.model, cfg, device, world, one_layer=not staged)
    check_context(stream.model, cfg.block_len)
    if staged:  # phase 2's own settings, checked before phase 1 spends its hours
        _check_top_k(stream.model, cfg)
        resident = stream.resident_fingerprint()
        parallel.on_rank0(lambda: claim(work, "dlr-work-staged", {"model": resident}, inputs=inputs + [out]))
    data = args.data or DEFAULT_DATA
    stage(args, f"reading and tokenising {data}")
    corpus = load_corpus(data, tok)
    calib = _calibration(corpus, cfg)
    res = lock_layerwise(stream, p1_out, one, calib, layers_work, tokenizer=tok, inputs=inputs + [out],
                         overwrite=args.overwrite or staged,  # (staged: the phase-1 folder is ours, in the work folder)
                         source_name=name, progress=not args.quiet, data_name=corpus.source)
    del stream
    parallel.barrier()  # rank 0 has written the phase-1 folder, and every rank is done with its work folder
    kept = args.keep_work or args.workdir is not None
    if rank == 0:
        res = {**res, "model": source, "world_size": world, "config": cfg.__dict__, "perplexity": {},
               "data": corpus.source, "heldout": corpus.heldout_names, "second_corpus": None}
    if staged:
        stage(args, "phase 2 on the whole locked model" + (f", sharded over {world} ranks" if world > 1 else ""))
        p2 = run_lock(argparse.Namespace(**{**vars(args), "model": str(p1_out), "original": args.model,
                                            "phase2_only": True, "layerwise": False, "max_memory": None,
                                            "workdir": str(work / "phase2")}))
        if rank != 0:
            return {**p2, "layers": res["layers"], "layerwise": True, "phase1_seconds": res["seconds"],
                    "seconds": res["seconds"] + p2["seconds"]}
        rep = {**res["report"], **{k: v for k, v in p2["report"].items() if k.startswith("phase2")}}
        res = {**p2, **{k: res[k] for k in ("model", "layerwise", "dtype", "activations_on_disk", "device")},
               "report": rep,
               "config": cfg.__dict__, "phase2_only": False, "phase1_seconds": res["seconds"],
               "phase2_seconds": p2["seconds"], "seconds": res["seconds"] + p2["seconds"]}
    if rank != 0:
        return {**res, "peak_rss_bytes": peak_rss()}
    if not kept:
        remove_ours(work)
    return {**res, "peak_rss_bytes": peak_rss(), "workdir": str(work) if kept else None}


def _check_net_memory(model, cfg, device, world: int = 1, one_layer: bool = False) -> None:
    """Refuse, before any net is built, a --rank (or --depth) whose DLR-Nets and their AdamW training state (weights,
    gradients, two moments: 4 x float32 per parameter) cannot fit: every locked layer's net at once (phase 2, and the
    whole-model phase 1; under torchrun a rank's share), or one layer's (`one_layer`: layer by layer, no phase 2)."""
    from ..methods.dlr_lock import plan
    from ..resources import check_memory
    from ..sites import find_sites

    layers, depth, _ = plan(model, cfg)
    d = find_sites(model).config.hidden_size
    nets = 1 if one_layer else -(-len(layers) // max(world, 1))
    need = nets * depth * (2 * d * cfg.rank + d + 1) * 4 * 4
    check_memory(need, f"--rank {cfg.rank} (DLR-Nets of depth {depth} on {nets} layer{'s' if nets != 1 else ''} at "
                 "once, with their AdamW state)", "lower --rank (or --depth)", device=device)


def _check_top_k(model, cfg) -> None:
    from ..measure.perplexity import is_causal_lm

    vocab = getattr(model.config, "vocab_size", None)
    if is_causal_lm(model) and vocab and cfg.top_k >= vocab:
        raise MLPSurgeryError(f"--top-k {cfg.top_k} must be below the vocabulary size {vocab}")


def render_lock(r: dict) -> str:
    if "out" not in r:  # a torchrun rank other than 0
        return f"rank {r['rank']} of {r['world_size']} done"
    rep = r["report"]
    if r.get("phase2_only"):
        lines = [f"phase 2 on the {len(rep['layers'])} DLR-Nets of {r['model']} -> {r['out']}",
                 f"  DLR-Nets: rank {rep['rank']}, depth {rep['depth']} ({rep['params_dlr']} parameters each); "
                 f"{r['seconds']:.0f} s"]
    else:
        lines = [f"locked {len(rep['layers'])} MLPs of {r['model']} -> {r['out']}",
                 f"  DLR-Nets: rank {rep['rank']}, depth {rep['depth']} ({rep['params_dlr']} parameters each vs "
                 f"{rep['params_mlp']} in the MLP); {r['seconds']:.0f} s"]
    if r["perplexity"]:
        rows = [{"stage": k, **{c: f"{v:.3f}" for c, v in row.items()}} for k, row in r["perplexity"].items()]
        lines += ["", table(rows)]
        if "heldout_ratio" in r:
            lines.append(f"held-out perplexity ratio locked / original: {r['heldout_ratio']:.3f}")
    p2 = rep["phase2_relative_error"]
    st = rep.get("start_relative_error") or {}
    ob, oa = rep.get("onpolicy_start_error") or {}, rep.get("onpolicy_relative_error") or {}
    errs = [{"layer": i, **({"start": f"{st[i]:.4f}"} if st else {}), "phase 1": f"{e:.4f}",
             **({"on-policy before": f"{ob[i]:.4f}", "on-policy after": f"{oa[i]:.4f}"} if oa else {}),
             "phase 2": f"{p2[i]:.4f}" if i in p2 else "-"} for i, e in rep["phase1_relative_error"].items()]
    producers = "the locked layers before it" if r.get("layerwise") else "the phase-1 nets"
    if errs:  # (phase 2 alone captures nothing)
        lines += ["", "per-layer relative error on held-out captured tokens (1.0 = identity"
                  + (f"; on-policy: on the inputs {producers} produce" if oa else "") + "):", table(errs)]
    if r.get("layerwise"):
        how = (f"layer by layer ({r['dtype']}; activations {'on disk' if r['activations_on_disk'] else 'in RAM'}): "
               "phase 1 one layer at a time, each layer on the inputs the locked layers before it produce")
        if "phase2_seconds" in r:
            lines.append(f"{how} ({r['phase1_seconds']:.0f} s); then phase 2 on the whole locked model "
                         f"({r['phase2_seconds']:.0f} s)")
        else:
            lines.append(f"{how}; no phase 2 (--phase2-steps 0): measure the perplexity with `mlpsurgery eval ppl "
                         f"{r['out']}`")
    if r.get("workdir"):
        lines.append(f"work folder kept: {r['workdir']} (remove it when you no longer need to resume or rerun)")
    return "\n".join(lines)


def register(sub, groups) -> None:
    from ..methods.dlr_lock import PHASE1_LOSSES, PHASE1_STARTS, DLRConfig

    p = command(groups["lock"], "dlr", run_lock, render_lock,
                "DLR-Lock: replace every MLP by a deep low-rank residual net distilled to the same function",
                ranks=True)
    p.add_argument("model", nargs="?", help=MODEL_HELP)
    p.add_argument("--out", required=True, help="folder for the locked model (mlpsurgery format)")
    p.add_argument("--rank", type=integer(1), help="bottleneck rank r of each block (64 unless --depth is given)")
    p.add_argument("--depth", type=integer(1), help="blocks per DLR-Net (default: match the MLP's parameter count)")
    p.add_argument("--layers", default="all", help="layers to lock: all, 8-11, 0,3,5 (default all)")
    p.add_argument("--data", help="calibration / distillation text: file, folder, table, a bundled corpus (austen, r8, "
                                  f"r8-train) or a mix A+B (default {DEFAULT_DATA}: the novels with Persuasion held out "
                                  "plus the Reuters training articles, so the lock serves more than one domain)")
    p.add_argument("--block-len", type=integer(2), default=256,
                   help="tokens per calibration / distillation block (256)")
    p.add_argument("--calib-blocks", type=integer(2), default=DLRConfig.calib_blocks,
                   help=f"blocks captured for phase 1 ({DLRConfig.calib_blocks})")
    p.add_argument("--phase1-steps", type=integer(0), default=DLRConfig.phase1_steps,
                   help=f"phase-1 (module-wise distillation) steps per layer ({DLRConfig.phase1_steps})")
    p.add_argument("--phase1-lr", type=number(0), default=DLRConfig.phase1_lr,
                   help=f"peak learning rate of phase 1 ({DLRConfig.phase1_lr})")
    p.add_argument("--phase1-start", default=DLRConfig.phase1_start, choices=list(PHASE1_STARTS),
                   help="closed-form (default): set each DLR block in turn by least squares on the captured pairs, "
                        "from the replaced MLP's own input directions, then train; identity: start at a = 0")
    p.add_argument("--start-tokens", type=integer(1), default=DLRConfig.start_tokens,
                   help=f"captured tokens per layer the closed-form start fits on ({DLRConfig.start_tokens})")
    p.add_argument("--phase1-tokens", type=integer(1), default=512, help="tokens per layer per phase-1 step")
    p.add_argument("--phase1-loss", default=DLRConfig.phase1_loss, choices=list(PHASE1_LOSSES),
                   help="token (default): each token's own relative error, so the tokens outside the attention sink count "
                        "in the layers the sink dominates; relative: the paper's relative MSE over all tokens "
                        "(docs/dlr-lock.md)")
    p.add_argument("--phase1-hard-fraction", type=number(0, 1, low_open=False, high_open=True), default=DLRConfig.phase1_hard_fraction,
                   help="share of each phase-1 batch drawn in proportion to the token's update norm "
                        f"(default {DLRConfig.phase1_hard_fraction}; 0: uniform, the paper's)")
    p.add_argument("--onpolicy-steps", type=integer(0), default=None,
                   help="after phase 1, this many more steps on batches that mix in the inputs the installed phase-1 "
                        "nets produce (one more capture pass; default: a third of --phase1-steps; 0: off)")
    p.add_argument("--onpolicy-mix", type=number(0, 1, low_open=False), default=DLRConfig.onpolicy_mix,
                   help=f"share of each on-policy batch from the on-policy pairs, the rest phase 1's ({DLRConfig.onpolicy_mix})")
    p.add_argument("--onpolicy-lr", type=number(0), default=DLRConfig.onpolicy_lr,
                   help=f"peak learning rate of the on-policy steps ({DLRConfig.onpolicy_lr})")
    p.add_argument("--no-compile", action="store_true", help="run phase 1 and phase 2 eagerly instead of through torch.compile")
    p.add_argument("--phase2-steps", type=integer(0), default=DLRConfig.phase2_steps,
                   help=f"phase-2 steps: every DLR-Net trained through the whole model against the original's "
                        f"logits ({DLRConfig.phase2_steps}; 0: no phase 2)")
    p.add_argument("--phase2-lr", type=number(0), default=DLRConfig.phase2_lr,
                   help=f"peak learning rate of phase 2 ({DLRConfig.phase2_lr})")
    p.add_argument("--phase2-batch", type=integer(1), default=DLRConfig.phase2_batch,
                   help=f"blocks per phase-2 step ({DLRConfig.phase2_batch})")
    p.add_argument("--phase2-blocks", type=integer(1), default=DLRConfig.phase2_blocks,
                   help=f"teacher-labelled blocks for phase 2 ({DLRConfig.phase2_blocks})")
    p.add_argument("--top-k", type=integer(1), default=32,
                   help="phase 2 matches the original's top-k token log-probabilities and the rest's total (32)")
    p.add_argument("--no-checkpointing", action="store_true", help="phase 2 without activation checkpointing")
    p.add_argument("--memory-gb", type=number(0), default=8.0,
                   help="hold a set of captured activations in RAM up to this size, else stream it from disk (8; "
                        "with --onpolicy-steps there are two such sets, phase 1's and the on-policy one)")
    p.add_argument("--eval-tokens", type=integer(0), default=8192,
                   help="held-out tokens scored after each stage (0: no evaluation)")
    p.add_argument("--second-corpus", default="r8", help="a second, different corpus to score (default: r8 news)")
    p.add_argument("--workdir", help="resumable intermediate state (default: OUT.work, removed on success; a folder "
                                     "you name is kept)")
    p.add_argument("--keep-work", action="store_true", help="keep the work folder after success")
    p.add_argument("--overwrite", action="store_true",
                   help="replace OUT if it is a folder mlpsurgery wrote (never one it did not write)")
    p.add_argument("--layerwise", action=argparse.BooleanOptionalAction, default=None,
                   help="capture and phase 1 one decoder layer at a time, read from the checkpoint's safetensors files "
                        "(memory of one layer and its DLR-Net, not the model; each layer on the inputs the locked "
                        "layers before it produce) on --device, then phase 2 on the whole locked model; the default "
                        "on the CPU for a model with weight files (under torchrun the layers are split over the "
                        "ranks, the same lock). --no-layerwise: every layer's net side by side (the default on a GPU)")
    p.add_argument("--max-memory", type=number(0), metavar="GB",
                   help="with --layerwise: keep the calibration activations on disk when the working set would pass "
                        "this many GiB (refused if one layer alone does not fit)")
    p.add_argument("--phase2-only", action="store_true",
                   help="MODEL is a folder `lock dlr` wrote (e.g. --layerwise --phase2-steps 0): run phase 2 alone on "
                        "its DLR-Nets, against the original model it records (or --original)")
    p.add_argument("--original", help=f"with --phase2-only: the model the locked folder was made from (default: the "
                                      f"one it records; checked against its fingerprint); {MODEL_HELP}")
    p.add_argument("--seed", type=integer(0, 2 ** 32 - 1), default=0, help="seed of the nets' init and every batch draw (0)")
