"""CoreLocker, granular utility control: utility against extraction ratio from 1e-4 to 5e-2 (the
paper's Fig. 6 and Tables 5-6), for each indicator, on the three models; then one plot of all.

    python benchmarks/corelocker_curve.py cnn
    python benchmarks/corelocker_curve.py minilm     # on a stratified 600-document sample of R8 test
    python benchmarks/corelocker_curve.py minilm --sample 200 --series "CoreLocker l1,CoreLocker scale" \\
        --ratios 1e-4,1e-3,5e-3,1e-2,2e-2,5e-2,0.1,0.2                # the reduced run in the docs
    python benchmarks/corelocker_curve.py smollm2    # perplexity on 4096 held-out tokens
    python benchmarks/corelocker_curve.py plot       # docs/img/corelocker_curve.png from the three JSON files
"""

from __future__ import annotations

import time
from pathlib import Path

import harness
from corelocker_common import RUNS, digits_cnn_test, minilm_r8, r8_splits, smollm2_perplexity, write_result
from corelocker_table1 import r8_metrics

from mlpsurgery.methods.corelocker import CoreLockerConfig, Ranking, extracted, unit_groups
from mlpsurgery.report import pyplot, save_figure

RATIOS = (1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2e-2, 5e-2)
IMG = harness.ROOT / "docs" / "img" / "corelocker_curve.png"


def curve(model, metrics, cfg: CoreLockerConfig, ratios) -> list[dict]:
    ranking = Ranking(unit_groups(model, cfg), cfg.scope, max(ratios))
    rows = [{"ratio": 0.0, "units": 0, **metrics(model)}]
    for r in ratios:
        t0 = time.perf_counter()
        with extracted(model, ranking, r) as n:
            rows.append({"ratio": r, "units": n, **metrics(model), "seconds": time.perf_counter() - t0})
        print(cfg.indicator, cfg.unit, rows[-1], flush=True)
    return rows


def series_for(name: str) -> list[tuple[str, CoreLockerConfig]]:
    out = [("CoreLocker l1", CoreLockerConfig()), ("CoreLocker scale", CoreLockerConfig(indicator="scale")),
           ("random", CoreLockerConfig(indicator="random"))]
    if name == "cnn":
        out += [("CoreLocker l1 (filter)", CoreLockerConfig(unit="filter")),
                ("CoreLocker scale (filter)", CoreLockerConfig(unit="filter", indicator="scale")),
                ("random (filter)", CoreLockerConfig(unit="filter", indicator="random"))]
    return out


def plot() -> Path:
    plt = pyplot()
    panels = [("minilm", "accuracy", "MiniLM + R8 head: accuracy (R8 test sample)", 1 / 8),
              ("cnn", "accuracy", "BatchNorm CNN: accuracy (digits test)", 0.1),
              ("smollm2", "perplexity", "SmolLM2-135M: perplexity (held-out Persuasion)", None)]
    have = [p for p in panels if (RUNS / f"curve_{p[0]}.json").exists()]
    fig, axes = plt.subplots(1, len(have), figsize=(5.2 * len(have), 4), squeeze=False)
    for ax, (name, metric, title, chance) in zip(axes[0], have):
        data = harness.read_json(RUNS / f"curve_{name}.json")
        for label, rows in data["series"].items():
            pts = [(r["ratio"], r[metric]) for r in rows if r["ratio"] > 0]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=label,
                    linestyle="--" if label.startswith("random") else "-")
        base = next(iter(data["series"].values()))[0][metric]
        ax.axhline(base, color="black", linewidth=0.8, label="original")
        if chance is not None:
            ax.axhline(chance, color="grey", linestyle=":", label=f"chance 1/{round(1 / chance)}")
        if metric == "balanced_accuracy" or metric == "accuracy":
            ax.set_ylim(0, 1.02)
        else:
            ax.set_yscale("log")
        ax.set_xscale("log")
        ax.set_xlabel("extraction ratio (fraction of eligible units)")
        ax.set_ylabel(metric)
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return save_figure(fig, IMG)


def main():
    p = harness.parser(__doc__)
    p.add_argument("model", choices=("minilm", "cnn", "smollm2", "plot"))
    p.add_argument("--sample", type=int, default=600, help="MiniLM: R8 test documents (stratified, seed 0)")
    p.add_argument("--max-tokens", type=int, default=4096, help="SmolLM2: held-out tokens")
    p.add_argument("--ratios", default=None, help="comma-separated ratios (default 1e-4 ... 5e-2, 9 points)")
    p.add_argument("--series", default=None,
                   help="comma-separated series labels to run (default all), e.g. 'CoreLocker l1'")
    args = p.parse_args()
    if args.model == "plot":
        print(f"wrote {plot()}")
        return
    t0 = time.perf_counter()
    if args.model == "cnn":
        model, metrics, n_test = digits_cnn_test()
        data = f"digits test split, {n_test} images"
    elif args.model == "minilm":
        loaded = minilm_r8()
        model = loaded.model
        _, _, test = r8_splits()
        test = test.sample(args.sample, seed=0)
        metrics = r8_metrics(loaded.tokenizer, test)
        data = f"R8 test, stratified sample of {len(test)} documents (seed 0)"
    else:
        loaded, metrics = smollm2_perplexity(args.max_tokens)
        model = loaded.model
        data = f"held-out Persuasion, first {args.max_tokens} tokens"
    wanted = None if args.series is None else {s.strip() for s in args.series.split(",")}
    ratios = RATIOS if args.ratios is None else tuple(float(r) for r in args.ratios.split(","))
    series = {label: curve(model, metrics, cfg, ratios) for label, cfg in series_for(args.model)
              if wanted is None or label in wanted}
    path, _ = write_result(f"curve_{args.model}.json", {"model": args.model, "data": data, "ratios": ratios,
                                                         "series": series}, t0)
    print(f"wrote {path}; plot: {plot()}")


if __name__ == "__main__":
    main()
