"""`mlpsurgery compare`: every way to shrink the MLPs, one frontier (library: mlpsurgery.compare)."""

from __future__ import annotations

from pathlib import Path

from . import command, device_of, draw, integer, number, progress
from ..methods.reconstruct import CALIB_BLOCKS, CALIB_LEN
from .core import MODEL_HELP


def run_compare(args) -> dict:
    from .. import compare as C

    methods = tuple(m.strip() for m in args.methods.split(",") if m.strip()) if args.methods else C.DEFAULT_METHODS
    cfg = C.CompareConfig(methods=methods, budgets=C.check_budgets(args.budgets), layers=args.layers, data=args.data,
                          max_tokens=args.max_tokens, block_len=args.block_len, calib_blocks=args.calib_blocks,
                          calib_data=args.calib_data, calib_len=args.calib_len, recover_steps=args.recover_steps,
                          recover_lr=args.recover_lr,
                          data_free=args.data_free, recover=args.recover, recover_seconds=args.recover_seconds,
                          recover_train=args.recover_train,
                          local_epochs=args.local_epochs, nsn_refit=args.nsn_refit, budget=args.budget,
                          blocks=args.blocks, prompt_len=args.prompt_len, new_tokens=args.new_tokens,
                          repeats=args.repeats, threads=args.threads, seed=args.seed, models=not args.no_models)
    res = C.run(args.model, args.out, cfg, overwrite=args.overwrite, progress=progress(args), device=device_of(args))
    res["plot"] = draw("frontier", lambda: C.plot(res, Path(args.out) / "frontier.png"))
    return res


def render_compare(r: dict) -> str:
    from .. import compare as C

    tail = [f"table: {r['out']}/frontier.md, frontier.json" + (f"; plot: {r['plot']}" if r.get("plot") else "")]
    if r["settings"]["models"]:
        tail.append(f"model folders: {r['out']}/models/<method>@<budget>")
    return C.markdown(r) + "\n\n" + "\n".join(tail)


def register(sub, groups) -> None:
    from ..compare import ALL_METHODS, DEFAULT_METHODS, RECOVER_TRAIN

    p = command(sub, "compare", run_compare, render_compare,
                "one frontier of every way to shrink the MLPs: perplexity, parameters, FLOPs and measured prefill / "
                "decode speed paired with the original, per method and budget (resumable)")
    p.add_argument("model", nargs="?", help=MODEL_HELP)
    p.add_argument("--out", required=True, help="results folder (resumed when it holds a comparison with the same "
                                                "settings and model)")
    p.add_argument("--methods", help=f"comma-separated, from {', '.join(ALL_METHODS)} (default: "
                                     f"{', '.join(DEFAULT_METHODS)}; twist only for a TwIST-trained model)")
    p.add_argument("--budgets", default="0.75,0.5,0.33",
                   help="fractions of each MLP kept (width, rank FLOPs, chunks or nonzero weights); 2:4 rows are 0.5")
    p.add_argument("--layers", default="last2/3",
                   help="layers every method compresses: last2/3 (default, fusion's), all, 2-27, 0,4,8")
    p.add_argument("--data", help="corpus: file, folder, table, austen (default: Persuasion held out) / r8")
    p.add_argument("--max-tokens", type=integer(16), default=4096, help="held-out tokens scored per point (4096)")
    p.add_argument("--block-len", type=integer(2), help="perplexity window (512, or the model's context if shorter)")
    p.add_argument("--calib-blocks", type=integer(1), default=CALIB_BLOCKS,
                   help=f"calibration / recovery blocks ({CALIB_BLOCKS})")
    p.add_argument("--calib-data", help="calibrate on other text than --data's train split (a corpus; self: sampled "
                                        "from the model; a mix self+austen): the cross-domain frontier, still scored "
                                        "on --data's held-out split")
    p.add_argument("--data-free", action="store_true",
                   help="fusion's methods and NSN as their papers: no calibration (plain SVD, no refit, weight-scored "
                        "neurons); default: each layer calibrated on what the compressed layers before it produce")
    p.add_argument("--calib-len", type=integer(2), default=CALIB_LEN,
                   help=f"tokens per calibration block ({CALIB_LEN})")
    p.add_argument("--recover-steps", type=integer(0), default=0,
                   help="recovery steps for every candidate (0: none); see --recover")
    p.add_argument("--recover", choices=("layerwise", "distill"), default="layerwise",
                   help="layerwise (each MLP trained to the original's output on the calibration blocks' captured "
                        "inputs) or distill (the whole model toward the original's next-token distribution, on its "
                        "own activations, batches of 4 train blocks)")
    p.add_argument("--recover-train", choices=RECOVER_TRAIN, default="mlp",
                   help="what --recover distill trains: the chosen MLPs (mlp, the default: the rest of the model stays "
                        "the original's) or the chosen decoder layers whole (layers: attention and norms too)")
    p.add_argument("--local-epochs", type=number(0, low_open=False), default=0.0, metavar="E",
                   help="on-policy local tuning of every compressed layer of fuse's methods and Fisher blocks in the "
                        "calibration pass, and of NSN's nested MLPs at every rank at once (E epochs over its rows; "
                        "gradient steps, recorded per point; 0: none)")
    p.add_argument("--nsn-refit", action="store_true",
                   help="NSN's start with each down projection refit by least squares at every rank it serves (`nest "
                        "--refit`: every rank below break-even gains; the maximum rank is no longer the original)")
    p.add_argument("--budget", choices=("uniform", "per-layer"), default="uniform",
                   help="uniform: every chosen layer keeps the budget's fraction; per-layer: the same total width, "
                        "each layer's chosen by its measured sensitivity, fragile ones left whole (fuse's methods, "
                        "with calibration)")
    p.add_argument("--recover-seconds", type=number(0, low_open=True),
                   help="stop each point's recovery after this many seconds (steps done are recorded)")
    p.add_argument("--recover-lr", type=number(0, 1, low_open=True),
                   help="learning rate of the recovery steps (1e-3 layerwise, 3e-4 distill)")
    p.add_argument("--blocks", type=integer(2), default=12, help="MLP chunks per layer for fisher / twist (12)")
    p.add_argument("--prompt-len", type=integer(1), default=256, help="prefill tokens timed (256)")
    p.add_argument("--new-tokens", type=integer(1), default=32, help="decode steps timed (32)")
    p.add_argument("--repeats", type=integer(1), default=5, help="timed repeats per model, medians (5)")
    p.add_argument("--threads", type=integer(1), help="CPU threads while timing (default: torch's setting)")
    p.add_argument("--seed", type=integer(0, 2 ** 32 - 1), default=0, help="seed of every method's draws (0)")
    p.add_argument("--no-models", action="store_true", help="do not save each point as a model folder")
    p.add_argument("--overwrite", action="store_true",
                   help="start over in an --out made with other settings (only a folder mlpsurgery wrote)")
