"""The measured curve of a half-width method's perplexity against the CPU seconds of gradient steps spent on it
(docs/frontier.md#recovery): every committed `compare` point of SmolLM2 at budget 0.5 with the default 32k calibration
tokens, read from its result file -- one-shot, local tuning only, distillation only, local tuning then distillation
(of the MLPs, or of the chosen decoder layers whole: `--recover-train layers`) --
plotted with one of issue 45's goals. Reads docs/results only (the runs are the commands in docs/frontier.md).

    python benchmarks/notes/recovery_curve.py --plot docs/img/recovery-curve-smollm2.png
    python benchmarks/notes/recovery_curve.py --methods svd,nsn --goal 1.6 \
        --plot docs/img/recovery-curve-smollm2-svd-nsn.png
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import harness  # noqa: E402

RESULTS = Path(__file__).resolve().parents[2] / "docs" / "results"
# (result file, the curve it belongs to)
FILES = [("frontier-smollm2-32k", "one-shot"),
         ("frontier-smollm2-32k-local", "local tuning (8 epochs)"),
         ("frontier-smollm2-recovered-32k", "distillation"),
         ("frontier-smollm2-recovered-32k-lr6e-4", "distillation"),
         ("frontier-smollm2-32k-local-recovered", "local tuning, then distillation"),
         ("frontier-smollm2-32k-local-recovered-clock", "local tuning, then distillation"),
         ("frontier-smollm2-32k-local-recovered-1200", "local tuning, then distillation"),
         ("frontier-smollm2-32k-local-recovered-layers", "local tuning, then distillation of the layers whole"),
         ("frontier-smollm2-32k-nsn-refit", "one-shot"),
         ("frontier-smollm2-32k-nsn-local", "local tuning (8 epochs)"),
         ("frontier-smollm2-32k-nsn-refit-local", "local tuning (8 epochs)"),
         ("frontier-smollm2-32k-recovered-svd-nsn", "distillation")]


def points(methods=("neuron",)) -> tuple[float, list[dict]]:
    rows, original = [], None
    for name, kind in FILES:
        path = RESULTS / f"{name}.json"
        if not path.exists():
            continue
        r = harness.read_json(path)
        original = r["original"]["ppl"]
        for p in r["points"]:
            if p["method"] not in methods or p["budget"] != 0.5:
                continue
            local = (p.get("local") or {}).get("seconds", 0.0)
            rec = (p.get("recovery") or {}).get("seconds", 0.0)
            method = p["method"] + (" (down refit)" if p.get("refit") else "")
            rows.append({"file": name, "kind": kind, "method": method, "seconds": local + rec, "local_s": local,
                         "distill_s": rec, "ppl": p["ppl"], "x": p["ppl"] / original})
    return original, sorted(rows, key=lambda r: r["seconds"])


def main() -> None:
    ap = harness.parser(__doc__, plot=True)
    ap.add_argument("--methods", default="neuron", help="comma-separated methods of the points (neuron)")
    ap.add_argument("--goal", type=float, default=1.2, help="the goal line, x the original (issue 45: 1.20)")
    args = ap.parse_args()
    methods = args.methods.split(",")
    original, rows = points(methods)
    print("| result file | method | kind | local tuning s | distillation s | perplexity | x original |\n"
          "|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['file']} | {r['method']} | {r['kind']} | {r['local_s']:.0f} | {r['distill_s']:.0f} | "
              f"{r['ppl']:.2f} | {r['x']:.3f} |")
    if args.plot:
        from mlpsurgery.report import pyplot

        plt = pyplot()
        fig, ax = plt.subplots(figsize=(6.5, 4))
        colours = dict(zip(sorted({r["method"] for r in rows}), plt.rcParams["axes.prop_cycle"].by_key()["color"]))
        for kind, marker in (("one-shot", "s"), ("local tuning (8 epochs)", "D"), ("distillation", "o"),
                             ("local tuning, then distillation", "^"),
                             ("local tuning, then distillation of the layers whole", "*")):
            for method, colour in colours.items():
                sel = [r for r in rows if r["kind"] == kind and r["method"] == method]
                if sel:
                    ax.plot([r["seconds"] for r in sel], [r["ppl"] for r in sel], marker=marker, linestyle="",
                            color=colour, label=kind if len(colours) == 1 else f"{method}: {kind}")
        ax.axhline(args.goal * original, color="gray", linestyle="--", linewidth=1,
                   label=f"{args.goal:.2f}x the original (issue 45)")
        ax.axvline(600, color="gray", linestyle=":", linewidth=1, label="600 s")
        ax.set_xlabel("CPU seconds of gradient steps (2 cores)")
        ax.set_ylabel("held-out perplexity (2,048 tokens of Persuasion)")
        names = {"neuron": "neuron pruning", "svd": "whitened SVD", "nsn": "NSN"}
        ax.set_title(f"SmolLM2, MLPs of the last 20 layers at half width ({', '.join(names.get(m, m) for m in methods)}"
                     f"); original {original:.2f}", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(args.plot, dpi=110)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
