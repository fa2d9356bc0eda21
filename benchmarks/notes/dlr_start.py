"""How DLR-Lock's phase 1 should start and how fast it should learn, measured on a few layers.

Captures the chosen layers' MLP sub-blocks of a model on its calibration text (resumable, into --capture), splits
the captured chunks as phase 1 does, and for every recipe START:LR:STEPS trains those layers' DLR-Nets side by
side with the library's own phase-1 code (sampling with hard tokens, the per-token loss, per-layer clipping,
torch.compile, the shared fitting loop), reporting per layer the held-out relative error after the start and after
training, and the seconds each took.

    python benchmarks/notes/dlr_start.py --layers 3,11,15,25 --calib-blocks 128 --capture runs/dlr/start-capture \\
        --recipes identity:1e-2:300,closed-form:1e-3:300,closed-form:3e-3:300,closed-form:1e-2:300 \\
        --threads 2 --out docs/results/dlr-start.json

START is closed-form (start.py) or identity (a = 0); LR the phase-1 learning rate; STEPS the phase-1 steps.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

import mlpsurgery as ms
from mlpsurgery.capture import capture_mlp_io
from mlpsurgery.methods.dlr_lock import DLRConfig, relative_error, split_chunks, token_relative_error
from mlpsurgery.methods.dlr_lock.captured import _CapturedSet
from mlpsurgery.methods.dlr_lock.batched import _compiled, _per_layer_clip, _validate
from mlpsurgery.methods.dlr_lock.start import closed_form_start, mlp_directions
from mlpsurgery.modules.dlr import StackedDLR, dlr_depth
from mlpsurgery.report import table
from mlpsurgery.sites import find_sites
from mlpsurgery.train import FitConfig, fit, step_rng

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the harness
import harness  # noqa: E402


def main() -> None:
    ap = harness.parser(__doc__, threads=2)
    ap.add_argument("model", nargs="?", help="model (default: the bundled SmolLM2)")
    ap.add_argument("--data", help="calibration text (default: bundled Austen, training novels)")
    ap.add_argument("--layers", default="3,11,15,25")
    ap.add_argument("--calib-blocks", type=int, default=128)
    ap.add_argument("--block-len", type=int, default=256)
    ap.add_argument("--capture", required=True, help="folder for the capture (reused when it holds the same one)")
    ap.add_argument("--rank", type=int, default=64)
    ap.add_argument("--recipes", default="identity:1e-2:300,closed-form:3e-3:300")
    ap.add_argument("--tokens", type=int, default=DLRConfig.phase1_tokens, help="tokens per layer per step")
    ap.add_argument("--start-tokens", type=int, default=DLRConfig.start_tokens)
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args()
    harness.set_threads(args.threads)
    cfg = DLRConfig(rank=args.rank)
    loaded = ms.load_model(args.model)
    model = loaded.model
    corpus = ms.load_corpus(args.data, loaded.tokenizer)
    blocks = corpus.blocks("train", args.block_len, max_blocks=args.calib_blocks, seed=0)
    layers = [int(v) for v in args.layers.split(",")]
    sites = find_sites(model)
    d = sites.config.hidden_size
    depth = dlr_depth(sum(p.numel() for p in sites.mlp[layers[0]].parameters()), d, args.rank)
    cap = capture_mlp_io(model, blocks, layers=layers, batch_size=8, out_dir=args.capture, dtype=torch.bfloat16)
    train_chunks, val_chunks = split_chunks(cap.n_chunks, cfg.phase1_val_fraction)
    train = _CapturedSet(cap, layers, train_chunks, memory_limit_gb=8.0)
    val = _CapturedSet(cap, layers, val_chunks, memory_limit_gb=8.0)
    floor = train.median_update_energy()
    rows, runs = [], []
    for recipe in args.recipes.split(","):
        start, lr, steps = recipe.split(":")
        lr, steps = float(lr), int(steps)
        net = StackedDLR(len(layers), d, args.rank, depth, seed=0)
        t0 = time.perf_counter()
        if start == "closed-form":
            g = torch.Generator().manual_seed(0)
            X, Y = train.first(args.start_tokens)
            closed_form_start(net, X, Y, [mlp_directions(model, i, depth * args.rank, g) for i in layers])
        start_s = time.perf_counter() - t0
        at_start = _validate(net, val)
        forward = _compiled(net)

        def loss_fn(step: int):
            x, y = train.sample(args.tokens, step_rng(0, step), cfg.phase1_hard_fraction)
            pred = forward(x)
            loss = token_relative_error(pred, x, y, floor)
            return loss.sum(), {"relative_error": float(relative_error(pred, x, y).detach().mean())}

        res = fit(dict(net.named_parameters()), loss_fn, FitConfig(steps=steps, lr=lr, warmup=0.05, clip=1.0,
                                                                   log_every=25),
                  progress=True, desc=recipe, clip_fn=_per_layer_clip(net, 1.0))
        after = _validate(net, val)
        for j, layer in enumerate(layers):
            rows.append({"recipe": recipe, "layer": layer, "start error": round(float(at_start[j]), 4),
                         "trained error": round(float(after[j]), 4)})
        runs.append({"recipe": recipe, "start": start, "lr": lr, "steps": steps, "start_seconds": start_s,
                     "train_seconds": res.seconds, "mean_start_error": float(at_start.mean()),
                     "mean_trained_error": float(after.mean()),
                     "start_error": {i: float(e) for i, e in zip(layers, at_start)},
                     "trained_error": {i: float(e) for i, e in zip(layers, after)},
                     "train_history": [{k: h[k] for k in ("step", "relative_error", "time_s")} for h in res.history]})
        print(table(rows[-len(layers):], markdown=True), flush=True)
    summary = [{"recipe": r["recipe"], "start s": round(r["start_seconds"], 1), "train s": round(r["train_seconds"]),
                "mean error at start": round(r["mean_start_error"], 4),
                "mean error trained": round(r["mean_trained_error"], 4),
                **{f"layer {i}": round(r["trained_error"][i], 3) for i in layers}} for r in runs]
    print(table(summary, markdown=True))
    if args.out:
        harness.write_json(args.out, {
            "machine": harness.machine("{arch} {uname_processor}, {threads} threads, torch {torch}"),
            "model": loaded.source, "layers": layers, "rank": args.rank, "depth": depth, "capture_tokens": cap.n_tokens,
            "tokens_per_step": args.tokens, "runs": runs})


if __name__ == "__main__":
    main()
