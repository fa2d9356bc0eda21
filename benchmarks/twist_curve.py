"""TwIST's claim as a curve (docs/twist.md): random-subnet perplexity against training tokens, next to the
one-shot pruners at the same parameter count.

One TwIST run (masked mode: one process emulates the S workers; true mode computes the same function) of the
model on the bundled corpus's training novels, ffn chunks at kappa = --keep/12, S = 3 workers, 1 x 128-token
batches, repartition interval 15, constant lr 3e-4, seed 0 (the settings of the `ffn-4` model of
benchmarks/twist_models.py, trained here for --steps batches per worker instead of 90). Every --every rounds
(and before the first), a random subnet (seed 0, no data, no search) at kappa = 4/12 and 6/12 of the MLP
chunks of the partitioned layers is extracted and scored on the held-out novel, as is the whole TwIST model.
The reference lines prune the *pretrained* model in the same layers to the same number of MLP weights:
Wanda and SparseGPT (unstructured, sparsity 1 - kappa: dense shapes, no speed-up on a dense runtime) and
Fisher block pruning (structured: a physically smaller model, like the TwIST subnet), calibrated on 16
training blocks of 128 tokens.

Resumable: the TwIST run checkpoints every round in OUT/train, every evaluation is cached in OUT/results.json
(a stop between a round's checkpoint and its evaluation is caught up from the checkpoint when rerun).

    python benchmarks/twist_curve.py --out runs/twist-curve --json docs/results/twist-curve.json \
        --plot docs/img/twist_curve.png
"""

from __future__ import annotations

import copy
import time
from dataclasses import asdict
from pathlib import Path

import harness
import mlpsurgery as ms
from mlpsurgery.methods.pruning import block_fisher, calibrated_prune, fisher_subnet, layer_moments
from mlpsurgery.methods.twist import TwISTConfig, checkpoint, make_layout, materialize, twist_extract, twist_train
from twist_table1 import Cache  # (results keyed by name, saved after every entry)


def main() -> None:
    ap = harness.parser(__doc__, json=True, plot=True, threads=2)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--out", default="runs/twist-curve")
    ap.add_argument("--steps", type=int, default=270, help="batches per worker (270: 3x the 90 of docs/twist.md)")
    ap.add_argument("--every", type=int, default=3, help="evaluate every this many rounds of 15 batches (3)")
    ap.add_argument("--keep", type=int, default=4, help="X of X/12 the TwIST run trains at (4)")
    ap.add_argument("--kappas", type=int, nargs="+", default=[4, 6], help="X of X/12 evaluated (4 6)")
    ap.add_argument("--tokens", type=int, default=1000, help="held-out tokens scored (1000: two windows of 512)")
    ap.add_argument("--block-len", type=int, default=128)
    ap.add_argument("--blocks", type=int, default=12, help="R: MLP chunks per layer (12); kappa = X / R")
    ap.add_argument("--shared", type=int, default=2, help="first and last layers every subnet holds whole (2)")
    args = ap.parse_args()
    harness.set_threads(args.threads)
    R = args.blocks
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cache = Cache(out / "results.json")
    get = cache.get

    loaded = ms.load_model(args.model)
    corpus = ms.load_corpus(None, loaded.tokenizer)
    calib = corpus.blocks("train", args.block_len, max_blocks=16, seed=0)
    cfg = TwISTConfig(workers=3, blocks=R, keep=args.keep, parts="ffn", interval=15, steps=args.steps, batch_size=1,
                      lr=3e-4, seed=0, shared_first=args.shared, shared_last=args.shared)
    pretrained = loaded.model
    layers = cfg.layers(len(ms.find_sites(pretrained)))

    def ppl(model) -> dict:
        r = ms.perplexity(model, corpus.heldout, block_len=min(512, args.block_len * 4), max_tokens=args.tokens,
                          progress=False, bos_id=corpus.bos)
        return {"ppl": r.ppl, "nll": r.nll, "tokens": r.tokens, "params": sum(p.numel() for p in model.parameters())}

    # the reference lines: the pretrained model pruned in the same layers to the same MLP weights
    get("pretrained", lambda: ppl(pretrained))
    moments = fisher = None
    for kappa in args.kappas:
        for method in ("wanda", "sparsegpt"):
            def calibrated(method=method, kappa=kappa):
                nonlocal moments
                moments = moments or layer_moments(pretrained, calib, "ffn", layers)
                m = copy.deepcopy(pretrained)
                calibrated_prune(m, None, {"ffn": 1 - kappa / R}, method, parts="ffn", layers=layers,
                                 moments=moments, progress=False)
                nonzero = sum(int((p != 0).sum()) for p in m.parameters())
                return {**ppl(m), "nonzero": nonzero}

            get(f"{method}/ffn{kappa}of{R}", calibrated)

        def fisher_block(kappa=kappa):
            nonlocal fisher
            fisher = fisher or block_fisher(pretrained, calib, make_layout(pretrained, "ffn", layers, R, R),
                                            progress=False)
            layout = make_layout(pretrained, "ffn", layers, R, kappa)
            return ppl(materialize(pretrained, layout, fisher_subnet(fisher, layout), rescale=False))

        get(f"fisher/ffn{kappa}of{R}", fisher_block)

    # the TwIST run, evaluated every `every` rounds
    blocks = corpus.blocks("train", args.block_len)
    model = pretrained  # the reference lines are done (each pruned a copy): train the loaded model itself

    def evaluate(step: int, model) -> None:
        get(f"twist/{step}/full", lambda: ppl(model))
        for kappa in args.kappas:
            get(f"twist/{step}/ffn{kappa}of{R}",
                lambda: ppl(twist_extract(model, keep=kappa, blocks=R, parts="ffn", layers=layers, seed=0)))

    evaluate(0, model)
    ckpt = out / "train"
    if ckpt.exists():  # a stop after a round's checkpoint and before its evaluation: evaluate the checkpoint
        was = copy.deepcopy(model)  # the run itself restarts from the pretrained weights (its claim checks them)
        done, _, _ = checkpoint.resume(was, ckpt)
        last = min(done * cfg.interval, cfg.steps)
        if done and (done % args.every == 0 or done == cfg.rounds) and f"twist/{last}/full" not in cache.data:
            evaluate(last, was)
        del was
    t0 = time.time()

    def on_round(rec: dict) -> None:
        cache.data.setdefault("history", {})[str(rec["step"])] = {"loss": rec["loss"], "time_s": rec["time_s"]}
        if rec["round"] % args.every == 0 or rec["round"] == cfg.rounds:
            evaluate(rec["step"], model)
        harness.write_json(cache.path, cache.data)

    res = twist_train(model, blocks, cfg, mode="masked", checkpoint_dir=ckpt, progress=True, callback=on_round)
    print(f"trained {res.steps} batches per worker in {res.seconds:.0f} s ({time.time() - t0:.0f} s this run)")
    result = {"model": args.model, "config": {**asdict(cfg), "layers": layers}, "train_seconds": res.seconds,
              "machine": harness.machine("{arch} CPU, {threads} threads, torch {torch}"),
              "results": cache.data}
    if args.json:
        harness.write_json(args.json, result)
    if args.plot:
        plot(result, args, Path(args.plot))


def plot(result: dict, args, path: Path) -> None:
    from mlpsurgery.report import pyplot

    plt = pyplot()

    data, block_len, R = result["results"], args.block_len, args.blocks
    steps = sorted({int(k.split("/")[1]) for k in data if k.startswith("twist/")})
    fig, ax = plt.subplots(figsize=(7, 4.5))
    x = [s * block_len / 1000 for s in steps]
    colors = {k: c for k, c in zip(args.kappas, ("tab:red", "tab:blue", "tab:green", "tab:purple"))}
    for kappa in args.kappas:
        c = colors[kappa]
        ax.plot(x, [data[f"twist/{s}/ffn{kappa}of{R}"]["ppl"] for s in steps], marker="o", color=c,
                label=f"TwIST random subnet, kappa {kappa}/{R}")
        for method, style in (("sparsegpt", "--"), ("wanda", ":"), ("fisher", "-.")):
            key = f"{method}/ffn{kappa}of{R}"
            if key in data:
                ax.axhline(data[key]["ppl"], color=c, linestyle=style, linewidth=1,
                           label=f"{method} of the pretrained model, {kappa}/{R}")
    ax.plot(x, [data[f"twist/{s}/full"]["ppl"] for s in steps], marker="s", color="black",
            label="the whole TwIST model")
    ax.axhline(data["pretrained"]["ppl"], color="gray", linewidth=1, label="pretrained, whole")
    ax.set_yscale("log")
    ax.set_xlabel("training tokens per worker (thousands)")
    ax.set_ylabel(f"held-out perplexity ({data['pretrained']['tokens']} tokens)")
    ax.set_title(f"TwIST (ffn, trained at {args.keep}/{R}, S = 3) vs one-shot pruning at equal MLP weights",
                 fontsize=9)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=6.5, ncol=2)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
