"""Table 1, Fig. 4 and Fig. 5 analogues of the TwIST paper on SmolLM2 (docs/twist.md).

Needs the models of benchmarks/twist_models.py. Every subnet is pruned in the partitioned layers only
(2-27 of 30: TwIST shares the first and last two layers whole), at the same sparsity of the same parameter
types for every method:
- TwIST: one random subnet (seed 0) of a TwIST-trained model, extracted physically, no data;
- DP random: the same extraction from the data-parallel model;
- magnitude, Wanda, SparseGPT (unstructured) and Fisher block pruning (structured) of the data-parallel model,
  calibrated on 16 training blocks of 128 tokens (Wanda / SparseGPT: one-pass input moments, see docs).
MLP sparsity at kappa = X/12 is 1 - X/12; attention keeps round(kappa x 3) of SmolLM2's 3 KV groups.
Perplexity: the first windows of 512 tokens of Persuasion (held out) until `--tokens` are scored.

    OMP_NUM_THREADS=1 flock -s /tmp/mlpsurgery.lock python benchmarks/twist_table1.py
"""

from __future__ import annotations

import copy
import math
import time
from pathlib import Path

import torch

import harness
import mlpsurgery as ms
from mlpsurgery.methods.pruning import (block_fisher, calibrated_prune, fisher_subnet, layer_moments,
                                        magnitude_prune)
from mlpsurgery.methods.twist import attn_keep_for, make_layout, materialize, twist_extract

KAPPAS = (8, 6, 4, 3)
PARTS = ("attn", "ffn", "both")
LAYERS = list(range(2, 28))
METHODS = ("twist", "twist_matched", "dp_random", "magnitude", "wanda", "sparsegpt", "fisher")
BASELINES = ("dp_random", "magnitude", "wanda", "sparsegpt", "fisher")  # applied to the data-parallel model
MODELS = ("pretrained", "dp", "dp-lr1e-4", "both-4", "ffn-4", "attn-4", "ffn-6", "ffn-8")
LABELS = {"twist": "TwIST (trained 4/12)", "twist_matched": "TwIST (trained at kappa)", "dp_random": "DP random",
          "magnitude": "magnitude", "wanda": "Wanda", "sparsegpt": "SparseGPT", "fisher": "Fisher block"}


def entry(method: str, key: str, dp: str) -> str:
    """Cache key of one Table 1 cell; baselines are per data-parallel model."""
    return f"table/{method}@{dp}/{key}" if method in BASELINES else f"table/{method}/{key}"


class Cache:
    """Results keyed by name, saved after every entry so an interrupted run continues where it stopped."""

    def __init__(self, path: Path):
        self.path = path
        self.data = harness.read_json(path, missing={})

    def get(self, key: str, fn):
        if key not in self.data:
            t0 = time.time()
            self.data[key] = {**fn(), "seconds": time.time() - t0}
            harness.write_json(self.path, self.data)
            print(f"{key}: {self.data[key]}", flush=True)
        return self.data[key]


def main() -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("--models", default="runs/twist/models")
    ap.add_argument("--out", default="runs/twist/eval")
    ap.add_argument("--img", default="docs/img")
    ap.add_argument("--tokens", type=int, default=1000,
                    help="score held-out tokens until at least this many (1000: two windows, 1022 tokens)")
    ap.add_argument("--spread-tokens", type=int, default=500, help="the same for Fig. 4 (500: one window, 511)")
    ap.add_argument("--spread-seeds", type=int, default=20)
    ap.add_argument("--spread-kappas", type=int, nargs="+", default=[4], help="X of X/12 for Fig. 4 (4)")
    ap.add_argument("--calib-blocks", type=int, default=16)
    ap.add_argument("--skip", nargs="*", default=[], choices=["table", "baselines", "heatmap", "spread"],
                    help="parts not to compute now (baselines: the Table 1 cells of the baselines that are not "
                         "cached yet; a later run without --skip fills them in)")
    ap.add_argument("--dp", default="dp", help="the data-parallel model the baselines prune (dp)")
    args = ap.parse_args()
    torch.manual_seed(0)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cache = Cache(out / "results.json")
    models = Path(args.models)
    base = ms.load_model("smollm2")
    corpus = ms.load_corpus(None, base.tokenizer)
    calib = corpus.blocks("train", 128, max_blocks=args.calib_blocks, seed=0)

    def ppl(model, tokens=args.tokens) -> dict:
        r = ms.perplexity(model, corpus.heldout, block_len=512, max_tokens=tokens, progress=False, bos_id=corpus.bos)
        return {"ppl": r.ppl, "nll": r.nll, "tokens": r.tokens,
                "params": sum(p.numel() for p in model.parameters())}

    loaded: dict[str, torch.nn.Module] = {}

    def model(name: str):
        if name not in loaded:
            for other in [n for n in loaded if n not in ("pretrained", args.dp)]:
                del loaded[other]  # memory: the DP model plus one trained model at a time
            loaded[name] = ms.load(models / name) if name != "pretrained" else base.model
        return loaded[name]

    def have(name: str) -> bool:
        return (models / name / "surgery.json").exists()

    for name in MODELS:
        if name == "pretrained" or have(name):
            cache.get(f"full/{name}", lambda: ppl(model(name)))

    def keeps(kappa: int) -> dict:
        return {"ffn": kappa, "attn": attn_keep_for(kappa / 12, 3)}

    def sparsity(part: str, kappa: int) -> dict:
        k = keeps(kappa)
        s = {"attn": 1 - k["attn"] / 3, "ffn": 1 - k["ffn"] / 12}
        return s if part == "both" else {part: s[part]}

    def subnet_key(part: str, kappa: int) -> str:
        """Entries that prune identically share one evaluation (attention: 8/12 and 6/12 both keep 2 of 3)."""
        k = keeps(kappa)
        return {"attn": f"attn{k['attn']}of3", "ffn": f"ffn{kappa}of12",
                "both": f"attn{k['attn']}of3+ffn{kappa}of12"}[part]

    class Skipping(Cache):
        def get(self, key, fn):
            return self.data.get(key) if "baselines" in args.skip and key.split("/")[1].split("@")[0] in BASELINES \
                else super().get(key, fn)

    cache.__class__ = Skipping

    def twist_subnet(name: str, part: str, kappa: int, seed: int = 0):
        return twist_extract(model(name), keep=kappa, blocks=12, parts=part, layers=LAYERS, seed=seed)

    if "table" not in args.skip:
        dp = model(args.dp)
        moments = fisher = None
        for part in PARTS:
            for kappa in KAPPAS:
                key = subnet_key(part, kappa)
                sp = sparsity(part, kappa)
                if have(f"{part}-4"):  # run again once more models are trained: finished entries are kept
                    cache.get(f"table/twist/{key}", lambda: ppl(twist_subnet(f"{part}-4", part, kappa)))
                matched = f"{part}-{kappa}"
                if have(matched):
                    cache.get(f"table/twist_matched/{key}", lambda: ppl(twist_subnet(matched, part, kappa)))
                cache.get(entry("dp_random", key, args.dp), lambda: ppl(twist_subnet(args.dp, part, kappa)))

                def magnitude():
                    m = copy.deepcopy(dp)
                    for p, s in sp.items():
                        magnitude_prune(m, s, parts=p, layers=LAYERS)
                    return ppl(m)

                cache.get(entry("magnitude", key, args.dp), magnitude)
                for method in ("wanda", "sparsegpt"):
                    def calibrated(method=method):
                        nonlocal moments
                        if moments is None:
                            moments = layer_moments(dp, calib, "both", LAYERS)
                        m = copy.deepcopy(dp)
                        t0 = time.time()
                        calibrated_prune(m, None, sp, method, parts=part, layers=LAYERS, moments=moments,
                                         progress=False)
                        return {**ppl(m), "prune_s": time.time() - t0}

                    cache.get(entry(method, key, args.dp), calibrated)

                def fisher_block():
                    nonlocal fisher
                    if fisher is None:
                        fisher = block_fisher(dp, calib, make_layout(dp, "both", LAYERS, 12, 12), progress=False)
                    layout = make_layout(dp, part, LAYERS, 12, kappa)
                    return ppl(materialize(dp, layout, fisher_subnet(fisher, layout), rescale=False))

                cache.get(entry("fisher", key, args.dp), fisher_block)

    if "heatmap" not in args.skip:
        for train in ("ffn-8", "ffn-6", "ffn-4", args.dp):
            if have(train):
                for kappa in KAPPAS:
                    # the same subnet (seed 0) as a Table 1 cell: that evaluation is reused, not repeated
                    same = {"ffn-4": f"table/twist/ffn{kappa}of12", args.dp: entry("dp_random", f"ffn{kappa}of12", args.dp),
                            f"ffn-{kappa}": f"table/twist_matched/ffn{kappa}of12"}.get(train)
                    cache.get(f"heatmap/{train}/ffn{kappa}of12",
                              lambda: {**cache.data[same], "same_as": same} if same in cache.data
                              else ppl(twist_subnet(train, "ffn", kappa)))

    if "spread" not in args.skip:
        for train in [t for t in ("ffn-6", args.dp) if have(t)]:
            for kappa in args.spread_kappas:
                for seed in range(args.spread_seeds):
                    cache.get(f"spread/{train}/ffn{kappa}of12/seed{seed}",
                              lambda: ppl(twist_subnet(train, "ffn", kappa, seed), tokens=args.spread_tokens))
    report(cache.data, args, models)


def report(data: dict, args, models: Path) -> None:
    from mlpsurgery.report import pyplot

    plt = pyplot()

    img = Path(args.img)
    img.mkdir(parents=True, exist_ok=True)
    out = Path(args.out)
    scored = data["full/pretrained"]["tokens"]
    lines = [f"Full models (no pruning), perplexity on {scored} held-out tokens:", "",
             "| model | ppl |", "|---|---|"]
    for name in MODELS:
        if f"full/{name}" in data:
            lines.append(f"| {name} | {data[f'full/{name}']['ppl']:.2f} |")
    lines += ["", "| parts | kappa | " + " | ".join(LABELS[m] for m in METHODS) + " |",
              "|---|---|" + "---|" * len(METHODS)]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    for ax, part in zip(axes, PARTS):
        for method in METHODS:
            xs, ys = [], []
            for kappa in KAPPAS:
                k = attn_keep_for(kappa / 12, 3)
                key = {"attn": f"attn{k}of3", "ffn": f"ffn{kappa}of12", "both": f"attn{k}of3+ffn{kappa}of12"}[part]
                e = data.get(entry(method, key, args.dp))
                if e:
                    xs.append(kappa)
                    ys.append(e["ppl"])
            if xs:
                ax.plot(xs, ys, marker="o", label=LABELS[method], lw=2.5 if method.startswith("twist") else 1.2)
        ax.set_yscale("log")
        ax.set_title(f"{part}")
        ax.set_xlabel("kappa = X/12 (blocks kept)")
        ax.invert_xaxis()
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(f"held-out perplexity ({scored} tokens of Persuasion)")
    axes[-1].legend(fontsize=8)
    fig.suptitle("SmolLM2-135M, Austen fine-tuning: subnets at kappa (TwIST random subnet vs baselines)")
    fig.tight_layout()
    fig.savefig(img / "twist_table1.png", dpi=110)
    for part in PARTS:
        for kappa in KAPPAS:
            k = attn_keep_for(kappa / 12, 3)
            key = {"attn": f"attn{k}of3", "ffn": f"ffn{kappa}of12", "both": f"attn{k}of3+ffn{kappa}of12"}[part]
            label = {"attn": f"{kappa}/12 (attn {k}/3)", "ffn": f"{kappa}/12", "both": f"{kappa}/12 (attn {k}/3)"}[part]
            cells = [data.get(entry(m, key, args.dp)) for m in METHODS]
            best = min((c["ppl"] for c in cells if c), default=None)
            row = [(f"**{c['ppl']:.1f}**" if c["ppl"] == best else f"{c['ppl']:.1f}") if c else "-" for c in cells]
            lines.append(f"| {part} | {label} | " + " | ".join(row) + " |")

    trains = [t for t in ("ffn-8", "ffn-6", "ffn-4", args.dp) if any(k.startswith(f"heatmap/{t}/") for k in data)]
    if trains:
        grid = [[data.get(f"heatmap/{t}/ffn{k}of12", {}).get("ppl", math.nan) for t in trains] for k in KAPPAS]
        fig, ax = plt.subplots(figsize=(5.5, 4.2))
        im = ax.imshow([[math.log10(v) for v in row] for row in grid], cmap="viridis_r")
        ax.set_xticks(range(len(trains)), [("DP (12/12)" if t == args.dp else f"trained {t[4:]}/12") for t in trains])
        ax.set_yticks(range(len(KAPPAS)), [f"eval {k}/12" for k in KAPPAS])
        for i, row in enumerate(grid):
            for j, v in enumerate(row):
                ax.text(j, i, f"{v:.0f}" if v >= 100 else f"{v:.1f}", ha="center", va="center", color="w", fontsize=9)
        fig.colorbar(im, label="log10 perplexity")
        ax.set_title("ffn: train kappa x eval kappa (random subnet, seed 0)")
        fig.tight_layout()
        fig.savefig(img / "twist_heatmap.png", dpi=110)
        lines += ["", "| eval kappa | " + " | ".join(trains) + " |", "|---|" + "---|" * len(trains)]
        for k, row in zip(KAPPAS, grid):
            lines.append(f"| {k}/12 | " + " | ".join(f"{v:.1f}" for v in row) + " |")

    spread = {}
    for key, e in data.items():
        if key.startswith("spread/"):
            _, train, kappa, _ = key.split("/")
            spread.setdefault((train, kappa), []).append(e["nll"])
    if spread:
        fig, ax = plt.subplots(figsize=(6.5, 4))
        groups = sorted((g for g in spread if g[0] in ("ffn-6", args.dp)), key=lambda k: (k[1], k[0]))
        ax.boxplot([spread[g] for g in groups], tick_labels=[f"{'TwIST 6/12' if g[0] == 'ffn-6' else 'DP'}\n{g[1][3:]}"
                                                             for g in groups])
        for i, g in enumerate(groups, 1):
            ax.scatter([i] * len(spread[g]), spread[g], s=8, alpha=0.5)
        n = next(e["tokens"] for k, e in data.items() if k.startswith("spread/"))
        ax.set_ylabel(f"eval loss (nats/token, {n} held-out tokens)")
        ax.set_title("eval loss over random ffn subnets: TwIST (trained 6/12) vs DP")
        fig.tight_layout()
        fig.savefig(img / "twist_spread.png", dpi=110)
        lines += ["", "| model | kappa | subnets | mean loss | std | min | max |", "|---|---|---|---|---|---|---|"]
        for g in groups:
            v = torch.tensor(spread[g])
            lines.append(f"| {g[0]} | {g[1][3:]} | {len(v)} | {v.mean():.3f} | {v.std():.3f} | {v.min():.3f} | "
                         f"{v.max():.3f} |")
    harness.write_md(out / "tables.md", "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
