"""Fine-tuning cost of a fused model vs the original, side by side in one run: wall time and peak memory
of one training step (forward + backward + AdamW step) and of an inference forward.

Model: the all-MiniLM-L6-v2 classifier (8 labels, as for R8) whose layers 2-5 are compressed to width k
(fusion at 128 / 384 / 768; and svd / magnitude at the width-384 weight count, for contrast: unstructured
pruning keeps dense shapes, so it saves nothing). Batch: 16 x 128 random token ids. Measured with
`mlpsurgery.measure.cost.compare_cost` (medians of 5 repeats after a warm-up; peak live tensor bytes),
plus the forward FLOPs per token at context 128 (`measure.cost.flops_per_token`, dense counting), which
does not depend on how busy the machine is.

    flock -x /tmp/mlpsurgery.lock python benchmarks/fusion_cost.py        # exclusive: a quiet machine
"""

from __future__ import annotations

import os

import torch

import harness
import mlpsurgery as ms
from mlpsurgery.measure.cost import compare_cost, flops_per_token
from mlpsurgery.methods.fusion import FusionConfig, fuse
from mlpsurgery.report import human_bytes


def classifier() -> torch.nn.Module:
    torch.manual_seed(0)
    return ms.load_model("minilm", task="classifier", num_labels=8).model


def main() -> None:
    p = harness.parser(__doc__)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    ref = classifier()
    batch = torch.randint(0, ref.config.vocab_size, (args.batch, args.seq_len),
                          generator=torch.Generator().manual_seed(0))
    print(f"machine: {harness.machine('{arch}, {cores} CPUs, {threads} torch threads')}, "
          f"load average {os.getloadavg()[0]:.1f} at start; batch {args.batch} x {args.seq_len}")
    print("| compressed model (layers 2-5) | params | train step (s): original / compressed = ratio | "
          "train step peak memory: original / compressed = ratio | inference forward (s) ratio | "
          "forward FLOPs/token ratio |")
    print("|---|---|---|---|---|---|")
    ref_flops = flops_per_token(ref, args.seq_len)["total"]
    for method, width in (("fusion", 128), ("fusion", 384), ("fusion", 768), ("svd", 384), ("magnitude", 384)):
        cand = classifier()
        fuse(cand, FusionConfig(width=width, method=method, n_init=1), progress=False)
        r = compare_cost(ref, cand, batch, repeats=args.repeats)
        a, b, q = r["reference"], r["candidate"], r["ratio"]
        nz = sum(int((p != 0).sum()) for p in cand.parameters())
        print(f"| {method} k={width} | {nz / 1e6:.2f}M of {sum(p.numel() for p in ref.parameters()) / 1e6:.2f}M "
              f"| {a['step_s']:.3f} / {b['step_s']:.3f} = **{q['step_s']:.3f}** "
              f"| {human_bytes(a['step_peak_bytes'])} / {human_bytes(b['step_peak_bytes'])} = "
              f"**{q['step_peak_bytes']:.3f}** | {q['forward_s']:.3f} "
              f"| {flops_per_token(cand, args.seq_len)['total'] / ref_flops:.3f} |", flush=True)
    print(f"load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
