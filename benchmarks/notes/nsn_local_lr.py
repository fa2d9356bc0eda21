"""Issue 45: which learning rate for NSN's multi-rank local tuning (`nest --local-epochs E --local-lr LR`,
methods/nsn/local.py)? SmolLM2, the MLPs of the last two thirds of the layers nested and tuned on 64 x 128 train
tokens (the demo's calibration); per variant: in how many layers the tuning was kept (the others' weighted error
rose, so they keep the whitened start) and the mean over layers of the weighted error after / before (the tuning's
objective, 1 = no change). One JSON line per variant appended to --out (a rerun skips those already there).

    python benchmarks/notes/nsn_local_lr.py --out docs/results/nsn-local-lr-smollm2.jsonl \\
        --variants 4:3e-3,4:1e-3,4:3e-4,4:1e-4,8:3e-4

A variant is EPOCHS:LR.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import harness  # noqa: E402


def main() -> None:
    p = harness.grid_parser(__doc__, "EPOCHS:LR")
    args = p.parse_args()
    harness.set_threads(args.threads, tokenizers_parallelism=False)
    import copy

    from mlpsurgery.methods import nsn
    from mlpsurgery.methods.nsn.local import nest_tuned

    done = {(r["epochs"], r["lr"]) for r in harness.read_jsonl(args.out)}
    loaded, _, calib = harness.smollm2_calibration(128, 64)
    for spec in args.variants.split(","):
        epochs, lr = (float(v) for v in spec.split(":"))
        if (epochs, lr) in done:
            continue
        rep = nest_tuned(copy.deepcopy(loaded.model), nsn.NSNConfig(layers="last2/3"), calib, epochs=epochs, lr=lr)
        ratios = [sum((a / b) ** 2 for a, b in zip(r["error_after"], r["error_before"])) / len(r["ranks"])
                  for r in rep["layers"]]
        row = {"epochs": epochs, "lr": lr, "layers_kept": sum(bool(r["kept"]) for r in rep["layers"]),
               "layers": len(rep["layers"]), "weighted_error_ratio": statistics.mean(ratios),
               "seconds": rep["seconds"], "calib_tokens": int(calib.numel()), "machine": harness.machine()}
        harness.append_jsonl(args.out, row)
        print(f"{spec:10s} kept {row['layers_kept']:2d} of {row['layers']}, weighted error x "
              f"{row['weighted_error_ratio']:.3f} ({row['seconds']:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
