"""Phase-1 recipes on the layers where a few tokens hold the update (attention-sink layers), from a work folder.

In SmolLM2 layer 11 writes a 'massive activation' (about 25,000 in one coordinate) into the first token
of every sequence, and layer 28 erases it; those tokens hold > 95% of the layer's sum ||y - x||^2
(benchmarks/notes/dlr_outlier_tokens.py). This trains DLR-Nets for the chosen layers alone on the captured pairs
of a `lock dlr --keep-work` folder, with the phase-1 code of the library (sampling, losses, per-layer
clipping, the shared fitting loop), for several recipes, and reports the held-out relative error split
into the sink tokens (position 0 of each captured block) and all the others.

    python benchmarks/notes/dlr_sink_layers.py runs/dlr/work-r64 --layers 11,28 \\
        --recipes relative:0:3e-3:150,token:0:3e-3:150,token:0.125:1e-2:150,token:0.125:1e-2:1500

A recipe is LOSS:HARD_FRACTION:LR:STEPS (loss relative = the paper's, token = per-token relative error).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from mlpsurgery.capture import open_capture
from mlpsurgery.errors import MLPSurgeryError
from mlpsurgery.methods import dlr_lock as dl
from mlpsurgery.methods.dlr_lock.captured import _CapturedSet
from mlpsurgery.methods.dlr_lock.batched import _per_layer_clip
from mlpsurgery.modules.dlr import StackedDLR
from mlpsurgery.report import table
from mlpsurgery.train import FitConfig, fit, step_rng

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the harness
import harness  # noqa: E402


def main() -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("workdir", help="a folder given to `mlpsurgery lock dlr --workdir` (kept with --keep-work)")
    ap.add_argument("--layers", default="11,28")
    ap.add_argument("--recipes", default="relative:0:3e-3:150,token:0.125:1e-2:150")
    ap.add_argument("--rank", type=int, default=64)
    ap.add_argument("--depth", type=int, default=36)
    ap.add_argument("--tokens", type=int, default=256, help="tokens per layer per step")
    ap.add_argument("--block-len", type=int, default=256, help="captured block length (sink = position 0)")
    ap.add_argument("--out", help="write the rows as JSON here")
    args = ap.parse_args()
    root = Path(args.workdir) / "capture"
    try:
        cap = open_capture(root)
    except MLPSurgeryError as exc:
        raise SystemExit(f"{exc}; run `mlpsurgery lock dlr ... --workdir {args.workdir} --keep-work`") from None
    layers = [int(v) for v in args.layers.split(",")]
    if missing := sorted(set(layers) - set(cap.layers)):
        raise SystemExit(f"layers {missing} were not captured in {root} (it has {cap.layers})")
    train_chunks, val_chunks = dl.split_chunks(cap.n_chunks, dl.DLRConfig.phase1_val_fraction)  # phase 1's split
    train = _CapturedSet(cap, layers, train_chunks, memory_limit_gb=8.0)
    val = _CapturedSet(cap, layers, val_chunks, memory_limit_gb=8.0)
    Xv, Yv = val.all()
    sink = torch.arange(Xv.shape[1]) % args.block_len == 0
    floor = train.median_update_energy()  # the token loss's per-layer floor (the same for every recipe)
    rows = []
    for recipe in args.recipes.split(","):
        loss_name, hard, lr, steps = recipe.split(":")
        hard, lr, steps = float(hard), float(lr), int(steps)
        net = StackedDLR(len(layers), cap.d, args.rank, args.depth, seed=0)

        def loss_fn(step: int):
            x, y = train.sample(args.tokens, step_rng(0, step), hard)
            pred = net(x)
            loss = dl.relative_error(pred, x, y) if loss_name == "relative" else dl.token_relative_error(pred, x, y, floor)
            return loss.sum()

        t0 = time.perf_counter()
        fit(dict(net.named_parameters()), loss_fn, FitConfig(steps=steps, lr=lr, warmup=0.05, clip=1.0, log_every=50),
            progress=True, desc=recipe, clip_fn=_per_layer_clip(net, 1.0))
        seconds = time.perf_counter() - t0
        with torch.no_grad():
            pred = net(Xv)
        for j, layer in enumerate(layers):
            e = (pred[j] - Yv[j]).pow(2).sum(-1)
            n = (Yv[j] - Xv[j]).pow(2).sum(-1)
            rows.append({"layer": layer, "loss": loss_name, "hard fraction": hard, "lr": lr, "steps": steps,
                         "rel. error (all)": round(float(e.sum() / n.sum()), 4),
                         "sink tokens": round(float(e[sink].sum() / n[sink].sum()), 4),
                         "other tokens": round(float(e[~sink].sum() / n[~sink].sum()), 4),
                         "median per-token (other)": round(float((e[~sink] / n[~sink]).median()), 4),
                         "seconds": round(seconds)})
        print(table(rows[-len(layers):], markdown=True), flush=True)
    print(table(rows, markdown=True))
    if args.out:
        harness.write_json(args.out, rows)


if __name__ == "__main__":
    main()
