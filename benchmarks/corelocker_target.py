"""CoreLocker, granular utility control by bisection: for each target accuracy, find the extraction
ratio on a calibration set (`find_ratio`) and report the accuracy that ratio gives on the test set.

The BatchNorm CNN on scikit-learn's digits (cheap: each evaluation is one forward pass of a small CNN).
Calibration: a stratified 360-image sample of the training images (seed 0); test: the 360 test images.

    python benchmarks/corelocker_target.py                      # targets 0.9, 0.75, 0.525, 0.3 with l1
"""

from __future__ import annotations

import time

import torch

import harness
from corelocker_common import cnn_accuracy, digits, digits_cnn, write_result

from mlpsurgery.methods.corelocker import CoreLockerConfig, evaluate_at, find_ratio


def main():
    p = harness.parser(__doc__)
    p.add_argument("--targets", default="0.9,0.75,0.525,0.3", help="target calibration accuracies")
    p.add_argument("--indicator", default="l1")
    p.add_argument("--unit", default="weight")
    p.add_argument("--tolerance", type=float, default=0.025, help="accepted distance from the target (0.025)")
    args = p.parse_args()
    t0 = time.perf_counter()
    model = digits_cnn()
    xtr, ytr, xte, yte = digits()
    g = torch.Generator().manual_seed(0)
    idx = torch.randperm(len(xtr), generator=g)[:360]
    calib, test = cnn_accuracy(xtr[idx], ytr[idx]), cnn_accuracy(xte, yte)
    cfg = CoreLockerConfig(indicator=args.indicator, unit=args.unit)
    rows = []
    for target in (float(t) for t in args.targets.split(",")):
        search = find_ratio(model, cfg, calib, target, tolerance=args.tolerance, max_ratio=0.5, progress=False)
        test_acc, units = evaluate_at(model, search.ranking, search.ratio, test)
        rows.append({"target": target, "ratio": search.ratio, "units": units, "calibration_accuracy": search.utility,
                     "within_tolerance": search.within_tolerance, "test_accuracy": test_acc,
                     "evaluations": len(search.curve)})
        print(rows[-1], flush=True)
    path, _ = write_result("target_cnn.json", {"indicator": args.indicator, "unit": args.unit,
                                               "tolerance": args.tolerance, "rows": rows}, t0)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
