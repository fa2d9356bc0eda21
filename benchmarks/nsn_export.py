"""Export at a fixed rank: size and inference time of the low-rank export against the original model.

For a real model (SmolLM2-135M or MiniLM), every MLP projection is nested (SVD, max rank = min(in, out)),
then for each FLOPs budget the model is (a) truncated to the budget's rank (`nsn.truncate`, the
`nest rank --form lowrank` export) and (b) folded back into dense weights (`nsn.fold`, the `--form dense`
export, which is a stock transformers model of the original size). Reported side by side in one run:
parameters, bytes on disk, and the median wall time of an inference forward pass, each as a ratio to the
original model; plus the max |logit| difference between the low-rank export and the nested model at the
same rank (they must compute the same function).

    flock -x /tmp/mlpsurgery.lock python benchmarks/nsn_export.py --model smollm2

Timings need a quiet machine: run it under the exclusive lock.
"""

from __future__ import annotations

import copy
import tempfile
from pathlib import Path

import torch

import harness
import mlpsurgery as ms
from mlpsurgery.methods import nsn
from mlpsurgery.report import human_bytes, table


def forward_seconds(model, batch, repeats: int) -> float:
    """Median seconds of an inference forward, after one warm-up."""
    with torch.no_grad():
        return harness.median_seconds(lambda: model(input_ids=batch), repeats)


def output(model, batch) -> torch.Tensor:
    with torch.no_grad():
        out = model(input_ids=batch)
    return out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*.safetensors"))


def main() -> None:
    ap = harness.parser(__doc__, print_json=True)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--budgets", default="1.0,0.75,0.5,0.25")
    ap.add_argument("--batch", default="4x128", help="BxT tokens per forward")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    B, T = (int(x) for x in args.batch.split("x"))
    loaded = ms.load_model(args.model)
    original = loaded.model
    batch = torch.randint(0, original.config.vocab_size, (B, T), generator=torch.Generator().manual_seed(0))
    nested = ms.nest(copy.deepcopy(original))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        ms.save(original, f"{tmp}/orig")
        base = {"params": sum(p.numel() for p in original.parameters()), "bytes": folder_bytes(Path(tmp) / "orig"),
                "forward_s": forward_seconds(original, batch, args.repeats)}
        for budget in (float(x) for x in args.budgets.split(",")):
            info = nsn.set_budget(nested, budget)
            ref = output(nested, batch)
            low = nsn.truncate(copy.deepcopy(nested))
            dense = nsn.fold(copy.deepcopy(nested))
            ms.save(low, f"{tmp}/low{budget}")
            again = ms.load(f"{tmp}/low{budget}")
            diff = float((output(again, batch) - ref).abs().max())
            row = {"budget": budget, "rank": info["rank"], "MLP FLOPs vs dense": round(info["fraction"], 3)}
            for name, m in (("low-rank", again), ("folded dense", dense)):
                row[f"{name} params"] = round(sum(p.numel() for p in m.parameters()) / base["params"], 3)
                row[f"{name} forward time"] = round(forward_seconds(m, batch, args.repeats) / base["forward_s"], 3)
            row["low-rank bytes"] = round(folder_bytes(Path(f"{tmp}/low{budget}")) / base["bytes"], 3)
            row["max abs output diff, low-rank vs nested"] = f"{diff:.1e}"
            rows.append(row)
    out = {"model": loaded.source, "batch": [B, T],
           "machine": harness.machine("{arch}, {threads} threads, torch {torch}"),
           "original": {**base, "bytes_h": human_bytes(base["bytes"])}, "rows": rows}
    harness.print_result(out, args.json, f"{out['model']}: original {base['params']:,} parameters, "
                         f"{human_bytes(base['bytes'])}, forward {base['forward_s'] * 1000:.0f} ms on batch {B}x{T} "
                         f"({out['machine']})\n" + table(rows, markdown=True), indent=2)


if __name__ == "__main__":
    main()
