"""Table 2 / Table 4 analogues of the MLP Fusion paper: fine-tuning accuracy after each compression vs
fine-tuning the original, on Reuters R8 (8 topics) and the 2016 election tweets (Clinton vs Trump), and
accuracy against the compressed width.

Every run: all-MiniLM-L6-v2 with a fresh classification head (seeded), the MLPs of layers 2-5 (the last two
thirds) compressed to width k (default 384 = h/4; svd and magnitude at the same MLP weight count), then the
whole model fine-tuned with the same budget: AdamW (lr 2e-4, weight decay 0.01, 6% warm-up, cosine), batch
16, 60 steps (960 examples), texts cut to 32 tokens (a CPU budget: the title and first line of a Reuters
story, most of a tweet); accuracy on a fixed stratified test sample of 500. The seed sets the head, the
compression's randomness and the batches. "original" is the uncompressed model; "fusion+tune" adds the
paper's layer-wise task-specific tuning (one epoch of MSE to the original layer outputs on 256 blocks of 128
tokens of the task's training text, lr 1e-3). Magnitude-pruned weights stay zero.

    OMP_NUM_THREADS=1 flock -s /tmp/mlpsurgery.lock python benchmarks/fusion_finetune.py --dataset r8
    OMP_NUM_THREADS=1 flock -s /tmp/mlpsurgery.lock python benchmarks/fusion_finetune.py --dataset tweets
    OMP_NUM_THREADS=1 flock -s /tmp/mlpsurgery.lock python benchmarks/fusion_finetune.py --dataset r8 \
        --methods fusion,sketch --widths 128,768                                       # Table 4 widths
    python benchmarks/fusion_finetune.py --report                                      # tables + plots

Results: runs/fusion_finetune.jsonl, one line per (dataset, method, width, seed); a rerun skips finished
runs and resumes an interrupted one from its checkpoint (runs/fusion_ckpt/).
"""

from __future__ import annotations

import json
import shutil
import statistics
import time

import torch

import harness
import mlpsurgery as ms
from mlpsurgery.data import Document, read_labelled, tokenize_corpus
from mlpsurgery.measure.accuracy import accuracy
from mlpsurgery.methods.fusion import METHODS, FusionConfig, fuse
from mlpsurgery.train import FitConfig, classifier_loss, fit, trainable

ROOT = harness.ROOT
TWEETS = ROOT.parent / "shared" / "data" / "labelled" / "election-tweets-2016.tab"
VARIANTS = ("original",) + METHODS + ("fusion+tune",)


def datasets(name: str, n_test: int):
    """(train, test) LabelledSets: R8's own split; the tweets split 80/20 (stratified, seed 0)."""
    if name == "r8":
        train = read_labelled("r8-train")
        test = read_labelled("r8-test", classes=train.classes)
    elif name == "tweets":
        if not TWEETS.exists():
            raise SystemExit(f"{TWEETS} is missing (../shared/data beside the checkout)")
        train, test = read_labelled(TWEETS).split(0.2, seed=0)
    else:
        raise SystemExit(f"unknown dataset {name!r}")
    return train, test.sample(n_test, seed=0) if n_test < len(test) else test


def task_blocks(train, tokenizer, n_blocks: int = 256, block_len: int = 128, seed: int = 0) -> torch.Tensor:
    """Unlabelled task text for the layer-wise tuning: the training texts, one document, cut into blocks."""
    corpus = tokenize_corpus([Document("task", "\n".join(train.texts))], tokenizer, heldout=0.01)
    return corpus.blocks("train", block_len, max_blocks=n_blocks, seed=seed)


def one_run(args, dataset: str, method: str, width: int, seed: int, train, test) -> dict:
    torch.manual_seed(seed)  # the fresh classification head
    loaded = ms.load_model("minilm", task="classifier", num_labels=train.num_classes)
    model, tok = loaded.model, loaded.tokenizer
    t0 = time.perf_counter()
    rep = None
    if method != "original":  # magnitude pruning's zeros stay zero through their stored masks
        base = method.removesuffix("+tune")
        tune = task_blocks(train, tok, seed=seed) if method.endswith("+tune") else None
        rep = fuse(model, FusionConfig(width=width, method=base, seed=seed), tune_data=tune, progress=False)
    compress_s = time.perf_counter() - t0
    ckpt = ROOT / "runs" / "fusion_ckpt" / f"{dataset}-{method}-{width}-{seed}"
    cfg = FitConfig(steps=args.steps, lr=args.lr, weight_decay=0.01, warmup=0.06, seed=seed, checkpoint_every=25)
    model.train()
    res = fit(trainable(model), classifier_loss(model, tok, train, batch_size=args.batch, max_len=args.max_len,
                                                seed=seed), cfg, checkpoint_dir=ckpt, progress=not args.quiet,
              desc=f"{dataset} {method} k={width} s={seed}")
    model.eval()
    acc = accuracy(model, tok, test, max_len=args.max_len, progress=False)
    shutil.rmtree(ckpt, ignore_errors=True)
    losses = [h["loss"] for h in res.history]
    return {"dataset": dataset, "method": method, "width": width if method != "original" else 1536, "seed": seed,
            "accuracy": acc, "n_test": len(test), "steps": args.steps, "batch": args.batch, "max_len": args.max_len,
            "lr": args.lr, "final_loss": statistics.fmean(losses[-10:]), "train_seconds": res.seconds,
            "compress_seconds": compress_s, "resumed_from": res.resumed_from,
            "mlp_weights_kept": None if rep is None else sum(s["nonzero_after"] for s in rep["sites"]),
            "tuning": None if rep is None else rep.get("tuning"), "torch_threads": torch.get_num_threads()}


def run(args) -> None:
    rows = harness.read_jsonl(args.out)
    done = {(r["dataset"], r["method"], r["width"], r["seed"]) for r in rows}
    train, test = datasets(args.dataset, args.n_test)
    for method in args.methods.split(","):
        if method not in VARIANTS:
            raise SystemExit(f"unknown method {method!r}; choose from {', '.join(VARIANTS)}")
    for seed in args.seeds:  # seed outermost: an early stop leaves every method with the same seeds
        for width in args.widths:
            for method in args.methods.split(","):
                key = (args.dataset, method, width if method != "original" else 1536, seed)
                if key in done:
                    continue
                row = one_run(args, args.dataset, method, width, seed, train, test)
                done.add(key)
                harness.append_jsonl(args.out, row)
                print(json.dumps({k: row[k] for k in ("dataset", "method", "width", "seed", "accuracy",
                                                      "train_seconds")}), flush=True)


def _ms(xs: list[float]) -> str:
    return f"{100 * statistics.fmean(xs):.2f} ± {100 * (statistics.stdev(xs) if len(xs) > 1 else 0):.2f}"


def report(args) -> None:
    rows = harness.read_jsonl(args.out)
    names = {"r8": "Reuters R8", "tweets": "election tweets"}
    sets = [d for d in ("r8", "tweets") if any(r["dataset"] == d for r in rows)]
    print("| method | " + " | ".join(f"{names[d]} accuracy (%)" for d in sets) + " |")
    print("|---|" + "---|" * len(sets))
    for m in VARIANTS:
        cells = []
        for d in sets:
            accs = [r["accuracy"] for r in rows if r["dataset"] == d and r["method"] == m
                    and r["width"] == (1536 if m == "original" else args.table_width)]
            seeds = sorted((r["seed"], r["accuracy"]) for r in rows if r["dataset"] == d and r["method"] == m
                           and r["width"] == (1536 if m == "original" else args.table_width))
            cells.append(f"{_ms(accs)} (" + ", ".join(f"s{sd}: {100 * a:.1f}" for sd, a in seeds) + ")"
                         if accs else "-")
        if any(c != "-" for c in cells):
            print(f"| {m} | " + " | ".join(cells) + " |")
    r0 = rows[0]
    print(f"\n{r0['steps']} steps x batch {r0['batch']}, max {r0['max_len']} tokens, lr {r0['lr']}; "
          f"train seconds per run (median): "
          f"{statistics.median(r['train_seconds'] for r in rows):.0f}")
    for d in sets:  # what the layer-wise tuning did (fusion+tune)
        for r in rows:
            if r["dataset"] == d and r["method"] == "fusion+tune" and r.get("tuning"):
                t = r["tuning"]
                print(f"{d} fusion+tune seed {r['seed']}: {t['steps']} tuning steps on {t['tokens']} tokens, "
                      f"layer MSE {t['mse_before']:.4g} -> {t['mse_after']:.4g} ({t['seconds']:.0f} s)")
    widths = sorted({r["width"] for r in rows if r["dataset"] == "r8" and r["method"] in ("fusion", "sketch")})
    if len(widths) > 1:
        print("\n| width (R8) | " + " | ".join(str(w) for w in widths) + " |")
        print("|---|" + "---|" * len(widths))
        for m in ("sketch", "fusion"):
            cells = []
            for w in widths:
                got = sorted((r["seed"], r["accuracy"]) for r in rows
                             if r["dataset"] == "r8" and r["method"] == m and r["width"] == w)
                cells.append(f"{_ms([a for _, a in got])} (" + ", ".join(f"s{sd}: {100 * a:.1f}" for sd, a in got)
                             + ")" if got else "-")
            print(f"| {m} | " + " | ".join(cells) + " |")
        orig = [r["accuracy"] for r in rows if r["dataset"] == "r8" and r["method"] == "original"]
        if orig:
            print(f"\noriginal (h=1536, not compressed) on R8: {_ms(orig)} over {len(orig)} seeds")
        _plot_widths(rows, widths)


def _plot_widths(rows, widths) -> None:
    from mlpsurgery.report import pyplot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for m, color in (("fusion", "tab:red"), ("sketch", "tab:gray")):
        pts = [(w, [r["accuracy"] for r in rows if r["dataset"] == "r8" and r["method"] == m and r["width"] == w])
               for w in widths]
        pts = [(w, a) for w, a in pts if a]
        ax.errorbar([w for w, _ in pts], [100 * statistics.fmean(a) for _, a in pts],
                    yerr=[100 * (statistics.stdev(a) if len(a) > 1 else 0) for _, a in pts], marker="o",
                    capsize=3, label=m, color=color)
    orig = [r["accuracy"] for r in rows if r["dataset"] == "r8" and r["method"] == "original"]
    if orig:
        ax.axhline(100 * statistics.fmean(orig), ls="--", color="black", label="original (h=1536)")
    ax.set_xlabel("MLP inner width k of layers 2-5")
    ax.set_ylabel("R8 test accuracy after fine-tuning (%)")
    ax.set_xticks(widths)
    ax.legend()
    fig.tight_layout()
    img = ROOT / "docs" / "img" / "fusion_width.png"
    fig.savefig(img, dpi=110)
    print(f"plot: {img.relative_to(ROOT)}")


def main() -> None:
    p = harness.parser(__doc__)
    p.add_argument("--dataset", choices=("r8", "tweets"), default="r8")
    p.add_argument("--methods", default=",".join(VARIANTS))
    p.add_argument("--widths", type=lambda s: [int(x) for x in s.split(",")], default=[384])
    p.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",")], default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--max-len", type=int, default=32)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--n-test", type=int, default=500)
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--out", default=str(ROOT / "runs" / "fusion_finetune.jsonl"))
    p.add_argument("--report", action="store_true", help="print the tables and draw the plot from --out")
    p.add_argument("--table-width", type=int, default=384, help="width shown in the method table (--report)")
    args = p.parse_args()
    report(args) if args.report else run(args)


if __name__ == "__main__":
    main()
