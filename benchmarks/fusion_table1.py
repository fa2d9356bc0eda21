"""Table 1 analogue of the MLP Fusion paper: MLP output error and Adam-NTK error of every compression
method against the original model, on real text, 3 seeds, mean ± std.

Model: all-MiniLM-L6-v2 (BERT, 6 layers, d=384, h=1536); the last two thirds of the layers (2-5) are
compressed to width k = 384 (h/4, the paper's 3072 -> 768), or the same MLP weight count (svd, magnitude).
Samples: n blocks of 128 tokens of held-out Austen (Persuasion), the same for every method. Two NTKs
(measure/ntk.py): per MLP (the paper's setting: f = a fixed random projection of the mean MLP output on
the original model's inputs at that layer, θ = that MLP's parameters; the error is the mean over the four
layers of ||K̃−K||_F / ||K||_F), and of the whole model (f = a fixed random projection of the mean-pooled
final hidden state, θ = the MLP parameters of all compressed layers; on the first `--n-model` samples).
Magnitude pruning keeps its pruned weights frozen at zero (as in its fine-tuning), so they drop out of its
kernel. Methods without randomness (svd, magnitude, neuron) run once (std 0).

    OMP_NUM_THREADS=1 flock -s /tmp/mlpsurgery.lock python benchmarks/fusion_table1.py      # runs, resumable
    python benchmarks/fusion_table1.py --report                                           # table + plot

A method written M+calib (e.g. fusion+calib) is `fuse` with calibration data (64 x 128 train-split Austen tokens):
sequential calibration, fuse's calibrated defaults (fusion / cluster: neurons clustered on their activations, since
session 25; docs/results/fusion-ntk-refit.md was measured with the weight clustering) and the down projection refit,
P kept stand-alone.

Results go to runs/fusion_table1.jsonl (one line per method and seed; a rerun skips what is there).
"""

from __future__ import annotations

import copy
import json
import statistics
import time
from pathlib import Path

import harness
import mlpsurgery as ms
from mlpsurgery.measure.ntk import adam_ntk, mlp_ntk_error, output_error
from mlpsurgery.methods.fusion import METHODS, FusionConfig, fuse
from mlpsurgery.sites import parse_layers

DETERMINISTIC = ("svd", "magnitude", "neuron")
ROOT = harness.ROOT


def machine() -> str:
    return harness.machine("{arch}, {threads} torch threads, torch {torch}")


def run(args) -> None:
    done = {(r["method"], r["seed"]) for r in harness.read_jsonl(args.out)}
    loaded = ms.load_model("minilm")
    ref = loaded.model
    ids = ms.text_blocks(None, loaded.tokenizer, block_len=args.block_len, split="heldout", max_blocks=args.n, seed=0)
    layers = parse_layers("last2/3", len(ms.find_sites(ref)))  # [2, 3, 4, 5]
    t0 = time.perf_counter()
    k_ref = adam_ntk(ref, ids[:args.n_model], layers, progress=True)
    ref_seconds = time.perf_counter() - t0
    mlp_cache: dict = {}
    for method in args.methods.split(","):
        for seed in (args.seeds if method not in DETERMINISTIC else args.seeds[:1]):
            if (method, seed) in done:
                continue
            model = copy.deepcopy(ref)
            t0 = time.perf_counter()
            base, _, calibrated = method.partition("+")  # "fusion+calib": the data-aware fuse (refit, P kept)
            calib = None
            if calibrated:
                calib = ms.text_blocks(None, loaded.tokenizer, block_len=args.block_len, max_blocks=64, seed=0)
            rep = fuse(model, FusionConfig(width=args.width, method=base, layers="last2/3", seed=seed), progress=True,
                       calib_data=calib)
            fuse_s = time.perf_counter() - t0
            k = adam_ntk(model, ids[:args.n_model], layers, progress=True)
            per_mlp = mlp_ntk_error(ref, model, ids, layers=layers, progress=True, reference_cache=mlp_cache)
            err = output_error(ref, model, ids, layers=layers)
            row = {"method": method, "seed": seed, "width": rep["width"], "layers": layers, "n": len(ids),
                   "n_model": args.n_model, "block_len": args.block_len,
                   "mlp_ntk_error": per_mlp["ntk_error"], "mlp_ntk_error_rel": per_mlp["ntk_error_rel"],
                   "mlp_ntk_layers": per_mlp["layers"], "ntk_error": float((k - k_ref).norm()),
                   "ntk_error_rel": float((k - k_ref).norm() / k_ref.norm()), "ntk_ref_norm": float(k_ref.norm()),
                   "output_error": err["error"], "output_error_rel": err["error_rel"],
                   "output_error_per_token": sum(r["error_per_token"] for r in err["layers"]) / len(layers),
                   "final_hidden_error_rel": err["final_hidden_error_rel"],
                   "mlp_weights_kept": sum(s["nonzero_after"] for s in rep["sites"]),
                   "compress_seconds": fuse_s, "reference_ntk_seconds": ref_seconds, "machine": machine()}
            harness.append_jsonl(args.out, row)
            print(json.dumps({k: row[k] for k in ("method", "seed", "mlp_ntk_error_rel", "ntk_error_rel",
                                                  "output_error_rel")}), flush=True)


def mean_std(xs: list[float]) -> str:
    m = statistics.fmean(xs)
    s = statistics.stdev(xs) if len(xs) > 1 else 0.0
    return f"{m:.4g} ± {s:.2g}"


def report(args) -> None:
    rows = harness.read_jsonl(args.out)
    methods = [m for m in METHODS if any(r["method"] == m for r in rows)]
    methods += sorted({r["method"] for r in rows} - set(methods))  # the calibrated ones ("fusion+calib")
    by = {m: [r for r in rows if r["method"] == m] for m in methods}
    print("| method | seeds | MLP output error ‖H̃−H‖_F | relative | per-MLP NTK error ‖K̃−K‖_F | "
          "relative | whole-model NTK error ‖K̃−K‖_F | relative | final hidden state rel. error |")
    print("|---|---|---|---|---|---|---|---|---|")
    for m in sorted(methods, key=lambda m: statistics.fmean(r["mlp_ntk_error_rel"] for r in by[m])):
        rs = by[m]
        cells = [mean_std([r[key] for r in rs]) for key in ("output_error", "output_error_rel", "mlp_ntk_error",
                                                             "mlp_ntk_error_rel", "ntk_error", "ntk_error_rel",
                                                             "final_hidden_error_rel")]
        print(f"| {m} | {len(rs)} | " + " | ".join(cells) + " |")
    print("\nper-MLP relative NTK error by layer (mean over seeds):")
    print("| method | " + " | ".join(f"layer {x['layer']}" for x in rows[0]["mlp_ntk_layers"]) + " |")
    print("|---|" + "---|" * len(rows[0]["mlp_ntk_layers"]))
    for m in methods:
        per = [statistics.fmean(r["mlp_ntk_layers"][j]["ntk_error_rel"] for r in by[m])
               for j in range(len(rows[0]["mlp_ntk_layers"]))]
        print(f"| {m} | " + " | ".join(f"{v:.3f}" for v in per) + " |")
    r0 = rows[0]
    print(f"\nn = {r0['n']} blocks x {r0['block_len']} tokens (whole-model kernel: first {r0['n_model']}), layers "
          f"{r0['layers']}, width {r0['width']}; ||K_original||_F (whole model) = {r0['ntk_ref_norm']:.6g}; "
          f"{r0['machine']}")
    from mlpsurgery.report import pyplot

    plt = pyplot()

    order = sorted(methods, key=lambda m: statistics.fmean(r["mlp_ntk_error_rel"] for r in by[m]))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, key, title in ((axes[0], "mlp_ntk_error_rel", "per-MLP Adam-NTK error ‖K̃−K‖/‖K‖"),
                           (axes[1], "ntk_error_rel", "whole-model Adam-NTK error ‖K̃−K‖/‖K‖"),
                           (axes[2], "output_error_rel", "MLP output error ‖H̃−H‖/‖H‖")):
        vals = [[r[key] for r in by[m]] for m in order]
        ax.bar(order, [statistics.fmean(v) for v in vals],
               yerr=[statistics.stdev(v) if len(v) > 1 else 0 for v in vals], capsize=3,
               color=["tab:red" if m == "fusion" else "tab:gray" for m in order])
        ax.set_title(title)
        ax.tick_params(axis="x", rotation=45)
    fig.suptitle(f"all-MiniLM-L6-v2, layers 2-5 compressed 1536 -> {r0['width']}, {r0['n']} held-out Austen blocks")
    fig.tight_layout()
    # the committed plot for the default results file; any other --out gets its plot beside it
    default = Path(args.out).resolve() == (ROOT / "runs" / "fusion_table1.jsonl").resolve()
    img = ROOT / "docs" / "img" / "fusion_table1.png" if default else Path(args.out).with_suffix(".png")
    img.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(img, dpi=110)
    print(f"plot: {img}")


def main() -> None:
    p = harness.parser(__doc__)
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",")], default=[0, 1, 2])
    p.add_argument("--width", type=int, default=384)
    p.add_argument("--n", type=int, default=32, help="samples (kernel size n x n) of the per-MLP kernels")
    p.add_argument("--n-model", type=int, default=16, help="samples of the whole-model kernel")
    p.add_argument("--block-len", type=int, default=128)
    p.add_argument("--out", default=str(ROOT / "runs" / "fusion_table1.jsonl"))
    p.add_argument("--report", action="store_true", help="print the table and draw the plot from --out")
    args = p.parse_args()
    report(args) if args.report else run(args)


if __name__ == "__main__":
    main()
