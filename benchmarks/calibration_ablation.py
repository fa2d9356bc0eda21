"""What each data-aware idea buys (issue 45): SmolLM2's MLPs of the last 2/3 of the layers at half width, each variant
built from the same original and scored on the same held-out Persuasion tokens, in one run on one machine; then the
calibration-size curve and the distillation recovery's perplexity against CPU seconds.

Variants (methods/reconstruct; `fuse(..., calib_data=...)` and `nest(..., calib_data=...)`):
- neuron pruning: data-free (weight norms) | output-energy selection without refit | + refit on the original model's
  activations | + refit, sequential (the default) | structured OBS selection | per-layer budget | corrective target
- svd (and NSN's start at the same rank): plain | whitened
- MLP Fusion: data-free (the paper) | calibrated (refit, P kept)
- every layer compressed (not only the last 2/3) at 0.75 of the width: uniform and per-layer budgets
- calibration size (the default, neuron): 2k / 8k / 32k tokens
- recovery: the default neuron model distilled toward the original (KL, on its own activations), perplexity every
  --eval-every steps against the training seconds

    python benchmarks/calibration_ablation.py --json docs/results/calibration-ablation-smollm2.json \\
        --md docs/results/calibration-ablation-smollm2.md --plot docs/img/calibration-recovery-smollm2.png
"""

from __future__ import annotations

import copy
import time

import harness


def main() -> None:
    ap = harness.parser(__doc__, summary=True, json=True, md=True, plot=True, threads=2, required=("json", "md"))
    ap.add_argument("--max-tokens", type=int, default=2048, help="held-out tokens scored per variant")
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--recover-steps", type=int, default=240)
    ap.add_argument("--eval-every", type=int, default=40)
    ap.add_argument("--recover-lr", type=float, default=3e-4)
    ap.add_argument("--skip", default="", help="comma-separated groups to skip: ablation,all,size,recovery")
    args = ap.parse_args()
    harness.set_threads(args.threads, tokenizers_parallelism=False)

    import mlpsurgery as ms
    from mlpsurgery.methods import nsn
    from mlpsurgery.methods.fusion import FusionConfig, fuse
    from mlpsurgery.methods.reconstruct.distill import distill

    loaded = ms.load_model()
    model, tok = loaded.model, loaded.tokenizer
    corpus = ms.load_corpus(None, tok)
    layers = list(range(10, 30))
    spec = ",".join(map(str, layers))

    def ppl(m) -> float:
        return ms.perplexity(m, corpus.heldout, block_len=512, max_tokens=args.max_tokens, progress=False,
                             bos_id=corpus.bos).ppl

    def blocks(n: int, length: int = 128, seed: int = 0):
        return corpus.blocks("train", length, max_blocks=n, seed=seed)

    base = ppl(model)
    result = {"model": loaded.source, "machine": harness.machine(), "layers": layers, "width": args.width, "h": 1536,
              "heldout_tokens": args.max_tokens, "original_ppl": base, "rows": [], "sizes": [], "recovery": []}
    skip = set(args.skip.split(","))

    def variant(group: str, label: str, method: str, calib, **cfg) -> dict:
        m = copy.deepcopy(model)
        t0 = time.perf_counter()
        fuse(m, FusionConfig(width=args.width, method=method, layers=spec, n_init=1, **cfg), calib_data=calib,
             progress=False)
        secs = time.perf_counter() - t0
        row = {"group": group, "variant": label, "method": method, "config": cfg, "seconds": secs, "ppl": ppl(m),
               "calib_tokens": 0 if calib is None else int(calib.numel())}
        row["ratio"] = row["ppl"] / base
        print(f"{group:8s} {label:55s} {row['ppl']:10.2f} {row['ratio']:7.2f}x {secs:6.1f} s", flush=True)
        result["rows"].append(row)
        return row

    c8k = blocks(64)
    if "ablation" not in skip:
        variant("neuron", "data-free: weight-norm selection, no refit", "neuron", None)
        variant("neuron", "output-energy selection, no refit (sequential)", "neuron", c8k, refit=False)
        variant("neuron", "+ refit, on the original model's activations", "neuron", c8k, calibration="original")
        variant("neuron", "+ refit, sequential calibration (the default)", "neuron", c8k)
        variant("neuron", "structured-OBS selection + refit, sequential", "neuron", c8k, importance="obs")
        variant("neuron", "default + per-layer budget", "neuron", c8k, budget="per-layer")
        variant("neuron", "default, corrective target (original stream)", "neuron", c8k, calibration="corrective")
        variant("svd", "plain SVD (data-free)", "svd", None)
        variant("svd", "whitened SVD, sequential", "svd", c8k)
        variant("fusion", "data-free (the paper's one-shot)", "fusion", None)
        variant("fusion", "calibrated: refit of W~2, P kept, sequential", "fusion", c8k)
        variant("random", "data-free random neurons", "random", None)
        variant("random", "random neurons + refit, sequential", "random", c8k)
        # NSN's start at the svd baseline's rank (209 of 576 for up/gate/down at half the weights)
        for label, calib in (("NSN, plain SVD start, rank 209", None), ("NSN, whitened start, rank 209", c8k)):
            m = copy.deepcopy(model)
            t0 = time.perf_counter()
            nsn.nest(m, nsn.NSNConfig(modules="mlp", layers=spec), calib_data=calib)
            nsn.set_rank(m, 209)
            row = {"group": "nsn", "variant": label, "method": "nsn", "seconds": time.perf_counter() - t0,
                   "ppl": ppl(m), "calib_tokens": 0 if calib is None else int(calib.numel())}
            row["ratio"] = row["ppl"] / base
            print(f"nsn      {label:55s} {row['ppl']:10.2f} {row['ratio']:7.2f}x", flush=True)
            result["rows"].append(row)
    if "all" not in skip:  # every layer compressed, at 0.75 of the width: uniform and per-layer budgets
        every = ",".join(map(str, range(30)))
        for budget in ("uniform", "per-layer"):
            m = copy.deepcopy(model)
            t0 = time.perf_counter()
            rep = fuse(m, FusionConfig(width=1152, method="neuron", layers=every, budget=budget), calib_data=c8k,
                       progress=False)
            row = {"group": "all layers", "variant": f"neuron, every layer at 0.75, {budget} budget", "method": "neuron",
                   "seconds": time.perf_counter() - t0, "ppl": ppl(m), "calib_tokens": int(c8k.numel()),
                   "widths": list(rep["widths"].values())}
            row["ratio"] = row["ppl"] / base
            print(f"all      {row['variant']:55s} {row['ppl']:10.2f} {row['ratio']:7.2f}x", flush=True)
            result["rows"].append(row)
    if "size" not in skip:
        for n, length in ((16, 128), (64, 128), (128, 256)):
            r = variant("size", f"{n} x {length} calibration tokens", "neuron", blocks(n, length))
            result["sizes"].append({"tokens": n * length, "ppl": r["ppl"], "ratio": r["ratio"], "seconds": r["seconds"]})
    if "recovery" not in skip:
        m = copy.deepcopy(model)
        t0 = time.perf_counter()
        fuse(m, FusionConfig(width=args.width, method="neuron", layers=spec), calib_data=c8k, progress=False)
        build = time.perf_counter() - t0
        train = blocks(4096, seed=1)
        curve = [{"steps": 0, "seconds": 0.0, "ppl": ppl(m)}]
        spent = 0.0
        for chunk in range(args.recover_steps // args.eval_every):
            r = distill(m, model, train, layers, steps=args.eval_every, lr=args.recover_lr, seed=chunk,
                        progress=False)
            spent += r["seconds"]
            curve.append({"steps": (chunk + 1) * args.eval_every, "seconds": spent, "ppl": ppl(m),
                          "loss_last": r["loss_last"]})
            print(f"recovery {curve[-1]['steps']:4d} steps {spent:7.1f} s  ppl {curve[-1]['ppl']:.2f}", flush=True)
        result["recovery"] = {"build_seconds": build, "lr": args.recover_lr, "batch": "4 x 128",
                              "chunks_of": args.eval_every, "curve": curve}
    harness.write_json(args.json, result)
    harness.write_md(args.md, markdown(result))
    if args.plot and result["recovery"]:
        plot(result, args.plot)


def markdown(r: dict) -> str:
    lines = [f"{r['model']}: MLPs of layers {r['layers'][0]}-{r['layers'][-1]} to width {r['width']} of {r['h']}, "
             f"held-out perplexity on {r['heldout_tokens']} Persuasion tokens (original {r['original_ppl']:.2f}); "
             f"{r['machine']}.", "", "| group | variant | calibration tokens | perplexity | x original | build s |",
             "|---|---|---|---|---|---|"]
    for row in r["rows"]:
        lines.append(f"| {row['group']} | {row['variant']} | {row['calib_tokens']:,} | {row['ppl']:,.2f} | "
                     f"{row['ratio']:.2f} | {row['seconds']:.0f} |")
    if r["recovery"]:
        lines += ["", f"Recovery (distillation toward the original, lr {r['recovery']['lr']}, batches of "
                      f"{r['recovery']['batch']}, in chunks of {r['recovery']['chunks_of']} steps each with its own "
                      "warm-up and cosine):", "", "| steps | training seconds | perplexity | x original |",
                  "|---|---|---|---|"]
        for c in r["recovery"]["curve"]:
            lines.append(f"| {c['steps']} | {c['seconds']:.0f} | {c['ppl']:.2f} | {c['ppl'] / r['original_ppl']:.3f} |")
    return "\n".join(lines)


def plot(r: dict, path: str) -> None:
    from mlpsurgery.report import pyplot

    plt = pyplot()
    curve = r["recovery"]["curve"]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([c["seconds"] for c in curve], [c["ppl"] / r["original_ppl"] for c in curve], "o-",
            label="neuron + refit, then distillation")
    for target in (1.2, 1.3):
        ax.axhline(target, color="grey", lw=0.7, ls="--")
    ax.set_xlabel("recovery CPU seconds (2 threads)")
    ax.set_ylabel("held-out perplexity / original")
    ax.set_title(f"{r['model'].split(' ')[0]}: half-width MLPs, recovery vs time", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
