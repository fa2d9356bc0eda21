"""DLR-Lock's `attack dlr` command: the adaptive attacker's suite on a locked folder, the original beside it."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..errors import MLPSurgeryError
from ..report import table
from . import command, draw, integer, join_ranks, stage
from .core import MODEL_HELP
from .dlr import _locked_dtype


def run_attack(args) -> dict:
    from dataclasses import asdict

    from .. import parallel

    from ..data import load_corpus
    from ..files import check_state, claim, model_fingerprint, write_text
    from ..io import check_source, history, source_spec
    from ..measure.memory import peak_rss
    from ..methods.dlr_lock import (AttackSuiteConfig, adaptation_costs, attack_suite, attack_table, plot_adaptation,
                                    plot_attack_suite)
    from ..models import check_context, load_model

    try:
        lrs = tuple(float(x) for x in args.lrs.split(","))
    except ValueError:
        raise MLPSurgeryError(f"--lrs takes comma-separated numbers such as 1e-5,1e-4, not {args.lrs!r}") from None
    if not lrs or not all(0 < lr < float("inf") for lr in lrs):
        raise MLPSurgeryError(f"--lrs must be positive numbers, not {args.lrs!r}")
    cfg = AttackSuiteConfig(lrs=lrs, steps=args.steps, batch=args.batch,
                            attacks=tuple(a.strip() for a in args.attacks.split(",")), lora_rank=args.lora_rank,
                            reverse_layers=args.reverse_layers, reverse_steps=args.reverse_steps, seed=args.seed)
    cfg.validate()
    out = Path(args.out)
    dev, rank, world = join_ranks(args)  # torchrun: every fine-tuning run sharded over the ranks (FSDP2)
    parallel.on_rank0(lambda: check_state(out, [args.locked, args.original, args.data], what="attack results"))
    # under torchrun neither model is held whole: each is read into FSDP shards a layer at a time (once here, for
    # its fingerprint and its structure, then afresh for every run), and kept in between as its structure only
    sharded = world > 1
    parallel.check_split(args.batch, "--batch")  # before any reading (each run's batch is shared by the ranks)
    stage(args, f"loading {args.locked}" + (f" into {world} shards, layer by layer" if sharded else ""))
    if sharded:
        locked_source = parallel.ShardedSource(args.locked, dev, progress=not args.quiet)
        locked = locked_source.skeleton
    else:
        loaded = load_model(args.locked)
        locked = loaded.model
    original_spec = args.original or source_spec(locked)
    if not original_spec:
        raise MLPSurgeryError("the locked folder names its original model only by name and fingerprint; pass "
                              "--original MODEL (it is checked against the fingerprint)")
    stage(args, f"loading the original model {original_spec}" + (" into shards" if sharded else ""))
    # read in the dtype it was locked in (what the recorded fingerprint is of), then held in the working one
    saved, working = _locked_dtype(args.locked), next(locked.parameters()).dtype
    if sharded:
        original_source = parallel.ShardedSource(original_spec, dev, progress=not args.quiet, dtype=saved,
                                                 hold=working)
        original = original_source.skeleton
    else:
        original = load_model(original_spec, dtype=saved).model
    check_source(locked, original, original_spec)
    check_context(locked, args.block_len)
    if not sharded:
        locked.to(dev)
        original.to(device=dev, dtype=working)
    loaded_rss = peak_rss()  # the peak of loading both models (under torchrun: of reading each into shards once)
    tok = (locked_source.loaded if sharded else loaded).require_tokenizer()
    corpus = load_corpus(args.data, tok)
    train = corpus.blocks("train", args.block_len, max_blocks=args.train_blocks, seed=args.seed + 2)
    held = corpus.blocks("heldout", args.block_len, max_blocks=args.eval_blocks, seed=args.seed + 3)
    # Results already in --out are reused only for the same attacks on the same two models and data (and as many
    # ranks: the seconds and memory are one rank's).
    settings = {"config": asdict(cfg),
                "locked": locked_source.fingerprint if sharded else model_fingerprint(locked),
                "original": original_source.fingerprint if sharded else model_fingerprint(original),
                "data": corpus.source, "block_len": args.block_len,
                "train_blocks": args.train_blocks, "eval_blocks": args.eval_blocks,
                **({"world_size": world} if world > 1 else {})}
    parallel.same_on_every_rank("models, data or settings", settings)
    parallel.on_rank0(lambda: claim(out, "dlr-attacks", settings, inputs=[args.locked, original_spec, args.data]))
    suite = attack_suite(original_source if sharded else original, locked_source if sharded else locked, train, held,
                         cfg, out, progress=not args.quiet)
    shards = {"peak_rss_loaded_bytes": loaded_rss}  # under torchrun: also whether each model was read into
    #                                                    shards, and this rank's share of its bytes
    if sharded:
        shards |= {"loaded_into_shards": {"locked": locked_source.streamed, "original": original_source.streamed},
                  "loaded_param_bytes": {"locked": locked_source.local_bytes,
                                         "original": original_source.local_bytes}}
    if rank != 0:  # rank 0 writes the tables and plots and reports
        return {"rank": rank, "world_size": world, "peak_rss_bytes": peak_rss(), **shards}
    rows = attack_table(suite)
    lock = [h for h in history(locked) if h.get("method") == "dlr_lock"]
    defender = sum(h["provenance"].get("distillation_seconds", 0.0) for h in lock) or None
    costs = adaptation_costs(suite, defender) if any(r["name"].endswith(" original") for r in suite["attacks"]) \
        else None
    if costs is not None:
        write_text(out / "adaptation.json", json.dumps(costs, indent=1))
    write_text(out / "attacks.md", table(rows, markdown=True) + "\n")
    write_text(out / "suite.json", json.dumps(suite))
    plot = draw("attack", lambda: plot_attack_suite(suite, out / "attacks.png") or out / "attacks.png")
    if costs is not None:
        costs["plot"] = draw("adaptation", lambda: plot_adaptation(suite, costs, out / "adaptation.png")
                             or out / "adaptation.png")
    return {"table": rows, "reverse": suite["reverse"], "adaptation": costs, "plot": plot, "out": str(out),
            "locked": args.locked, "original": original_spec, "world_size": world, "peak_rss_bytes": peak_rss(),
            **shards}


def _all_or_count(text: str) -> int | None:
    if text == "all":
        return None
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"takes all or a positive integer, not {text!r}")
    return n


def _seconds(v) -> str:
    return "-" if v is None else f"{v:.0f} s"


def render_attack(r: dict) -> str:
    if "out" not in r:  # a torchrun rank other than 0
        return f"rank {r['rank']} of {r['world_size']} done"
    lines = [table(r["table"])]
    rev = r["reverse"]
    if rev:
        errors = list(rev["relative_error"].values())
        whole = len(rev["layers"]) == rev["locked_layers"]
        lines.append(f"reverse distillation: {rev['steps']} steps on {len(rev['layers'])} layers took "
                     f"{rev['seconds']:.0f} s ({rev['seconds_per_layer']:.1f} s per layer"
                     + ("; every locked layer, the dense model then fine-tuned" if whole else
                        f"; about {rev['estimated_seconds_all_layers']:.0f} s for all {rev['locked_layers']} locked "
                        "layers") + f"), relative error reached {min(errors):.3f}-{max(errors):.3f} "
                     f"(mean {sum(errors) / len(errors):.3f})")
    cost = r.get("adaptation")
    if cost:
        lines += ["", f"adaptation cost to reach the original's fine-tuned held-out loss {cost['target_loss']:.3f} "
                      f"(attacker's training seconds; original: {_seconds(cost['original_seconds'])}):"]
        lines.append(table([{"route": c["route"], "locked": _seconds(c["locked_seconds"]) if c["locked_seconds"]
                             is not None else "diverged" if c["diverged"] else f"> {c['at_least']:.0f} (not reached)",
                             "factor": "-" if c["factor"] is None else
                             f"{'>= ' if c['factor_is_lower_bound'] else ''}{c['factor']:.2f}x"}
                            for c in cost["routes"]]))
        if cost["defender_seconds"]:
            lines.append(f"defender's one-off distillation: {cost['defender_seconds']:.0f} s")
        if cost.get("plot"):
            lines.append(f"held-out loss vs the attacker's seconds, every route: {cost['plot']}")
    if r.get("plot"):
        lines.append(f"plot: {r['plot']}")
    return "\n".join(lines)


def register(sub, groups) -> None:
    p = command(groups["attack"], "dlr", run_attack, render_attack,
                "the adaptive attacker: fine-tuning (3 LRs), checkpointing, LoRA, frozen DLR, reverse distillation",
                ranks=True)
    p.add_argument("locked", help="a folder written by `mlpsurgery lock dlr`")
    p.add_argument("--original", help=f"the original model (default: the one recorded in the locked folder); {MODEL_HELP}")
    p.add_argument("--out", required=True, help="folder for per-attack results, the table and the plot")
    p.add_argument("--data", help="the attacker's fine-tuning text (default: bundled Austen)")
    p.add_argument("--attacks", default="finetune,checkpointing,lora,frozen,reverse",
                   help="attack families to run, comma-separated (default: all five)")
    p.add_argument("--lrs", default="1e-5,1e-4,1e-3", help="plain fine-tuning learning rates")
    p.add_argument("--steps", type=integer(1), default=40, help="fine-tuning steps per run (40)")
    p.add_argument("--batch", type=integer(1), default=4, help="blocks per fine-tuning step (4)")
    p.add_argument("--block-len", type=integer(2), default=128, help="tokens per block (128)")
    p.add_argument("--train-blocks", type=integer(1), default=512,
                   help="blocks of the attacker's text to train on (512)")
    p.add_argument("--eval-blocks", type=integer(1), default=16, help="held-out blocks the loss is measured on (16)")
    p.add_argument("--lora-rank", type=integer(1), default=8, help="rank of the LoRA attacks' adapters (8)")
    p.add_argument("--reverse-layers", type=_all_or_count, default=None, metavar="all|N",
                   help="DLR-Nets the attacker distils back into dense MLPs (all: every one, and the dense model is "
                        "then fine-tuned as the original, the route measured end to end; N: the first N, and the "
                        "route is estimated from their time); default all")
    p.add_argument("--reverse-steps", type=integer(1), default=200,
                   help="distillation steps per DLR-Net of the reverse route (200)")
    p.add_argument("--seed", type=integer(0, 2 ** 32 - 1), default=0, help="seed of the attacker's batches and initialisations (0)")
