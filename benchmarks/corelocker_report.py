"""Render the CoreLocker benchmark results (runs/corelocker/*.json) as the Markdown tables of
docs/corelocker.md.

    python benchmarks/corelocker_report.py
"""

from __future__ import annotations

import harness
from corelocker_common import RUNS

from mlpsurgery.report import human_bytes, table


def load(name: str) -> dict | None:
    return harness.read_json(RUNS / f"{name}.json", missing=None)


def pct(v: float, std: float | None = None) -> str:
    return f"{100 * v:.2f}%" + (f" ± {100 * std:.2f}" if std else "")


def table1(name: str, d: dict) -> str:
    metrics = [k for k in ("accuracy", "balanced_accuracy", "perplexity") if k in d["rows"][0]]
    rows = []
    for r in d["rows"]:
        row = {"setting": r["setting"], "unit": r.get("unit", "-"),
               "extracted": f"{r['units']:,} of {r['units_eligible']:,}" if "units" in r else "-"}
        for m in metrics:
            std = r.get(f"{m}_std") if len(r.get("seeds", [])) > 1 else None
            row[m] = f"{r[m]:.2f}" + (f" ± {std:.2f}" if std else "") if m == "perplexity" else pct(r[m], std)
        rows.append(row)
    head = f"**{name}** — {d['data']}; ratio {d['ratio']}; {d['machine']}; {d['seconds']:.0f} s\n\n"
    return head + table(rows, markdown=True)


def restoration(name: str, d: dict) -> str:
    rows = []
    for tag, r in d["restoration"].items():
        rows.append({"model": name, "key": tag, "extracted weights": f"{r['entries']:,}",
                     "key size": f"{human_bytes(r['key_bytes'])} ({r['key_bytes']:,} B)",
                     "weights file": f"{human_bytes(r['model_bytes'])} ({r['model_bytes']:,} B)",
                     "key / model": f"{100 * r['key_share']:.2f}%",
                     "tensors changed by lock": f"{r['tensors_changed_by_lock']} of {r['tensors']}",
                     "SHA-256 identical after unlock": f"{r['tensors_identical_after_unlock']} of {r['tensors']}"})
    return table(rows, markdown=True)


def bucket(v: float, width: float = 0.05) -> str:
    lo = min(int(v / width) * width, 1 - width)
    return f"{100 * lo:.0f} – {100 * (lo + width):.0f}"


def curve(name: str, d: dict) -> str:
    metric = "perplexity" if name == "smollm2" else "accuracy"
    labels = list(d["series"])
    ratios = [r["ratio"] for r in d["series"][labels[0]]]
    rows = []
    for i, ratio in enumerate(ratios):
        row = {"ratio": f"{ratio:g}"}
        for label in labels:
            v = d["series"][label][i][metric]
            row[label] = f"{v:.1f}" if metric == "perplexity" else f"{100 * v:.1f}%"
        if metric == "accuracy":
            row["range (CoreLocker l1)"] = bucket(d["series"][labels[0]][i][metric])
        rows.append(row)
    return f"**{name}** — {metric} on {d['data']}; {d['seconds']:.0f} s\n\n" + table(rows, markdown=True)


def attacks(name: str, d: dict) -> str:
    t = d["table"]
    rows = [{"attack": "none (locked)", "setting": "-", "accuracy": pct(t["locked"]), "recovered Δ": "-"}]
    for r in t["rows"]:
        label = "fine-tune on" if r["attack"] == "fine-tune" else "magnitude prune"
        rows.append({"attack": label, "setting": f"{100 * r['setting']:.0f}%", "accuracy": pct(r["accuracy"], r["std"]),
                     "recovered Δ": f"{100 * r['delta']:+.2f} ± {100 * r['std']:.2f}"})
    for r in d["from_scratch_reference"]:
        rows.append({"attack": "reference: same fine-tuning from a model that never saw the task",
                     "setting": f"{100 * r['setting']:.0f}%", "accuracy": pct(r["accuracy"]), "recovered Δ": "-"})
    head = (f"**{name}** — locked with {d['indicator']} at {d['ratio']} (original {pct(d['original'])}); "
            f"{d['data']}" + (f"; fine-tuning: {d['epochs']} epochs, lr {d['lr']}, {d['trials']} trials"
                              if any(r["attack"] == "fine-tune" for r in t["rows"]) else "; pruning only")
            + f"; {d['seconds']:.0f} s\n\n")
    return head + table(rows, markdown=True)


def target(d: dict) -> str:
    rows = [{"target (calibration)": pct(r["target"]), "ratio found": f"{r['ratio']:.5f}", "units": f"{r['units']:,}",
             "calibration accuracy": pct(r["calibration_accuracy"]), "within ±" + pct(d["tolerance"]):
             "yes" if r["within_tolerance"] else "no", "test accuracy": pct(r["test_accuracy"]),
             "evaluations": r["evaluations"]} for r in d["rows"]]
    return f"indicator {d['indicator']}, unit {d['unit']}; {d['seconds']:.0f} s\n\n" + table(rows, markdown=True)


def main():
    harness.parser(__doc__).parse_args()
    for name in ("minilm", "cnn", "smollm2"):
        d = load(f"table1_{name}")
        if d:
            print(f"### Table 1: {name}\n\ncommand: `{d['command']}`\n")
            print(table1(name, d), "\n")
            if d.get("restoration"):
                print(restoration(name, d), "\n")
    for name in ("minilm", "cnn", "smollm2"):
        d = load(f"curve_{name}")
        if d:
            print(f"### Curve: {name}\n\ncommand: `{d['command']}`\n")
            print(curve(name, d), "\n")
    d = load("target_cnn")
    if d:
        print(f"### Bisection to a target: cnn\n\ncommand: `{d['command']}`\n")
        print(target(d), "\n")
    for name in ("minilm", "cnn"):
        d = load(f"attacks_{name}")
        if d:
            print(f"### Attacks: {name}\n\ncommand: `{d['command']}`\n")
            print(attacks(name, d), "\n")


if __name__ == "__main__":
    main()
