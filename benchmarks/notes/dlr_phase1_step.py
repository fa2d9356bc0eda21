"""Phase-1 step time of DLR-Lock, eager vs torch.compile, side by side in one run.

One step = forward + backward of the batched network of all locked layers (StackedDLR) on `--tokens`
tokens per layer: the inner loop of phase 1. Shapes default to SmolLM2-135M at r = 64 (30 layers,
d = 576, depth 36); the values are random (time depends only on the shapes).

    python benchmarks/notes/dlr_phase1_step.py [--layers 30 --d 576 --rank 64 --depth 36 --tokens 256 --threads 1]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from mlpsurgery.modules.dlr import StackedDLR
from mlpsurgery.report import table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the harness
import harness  # noqa: E402


def step_times(fn, net: StackedDLR, x, y, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        (fn(x) - y).pow(2).sum().backward()
        times.append(time.perf_counter() - t0)
        net.zero_grad(set_to_none=True)
    return times


def main() -> None:
    ap = harness.parser(__doc__, print_json=True, threads=1)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--d", type=int, default=576)
    ap.add_argument("--rank", type=int, default=64)
    ap.add_argument("--depth", type=int, default=36)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    harness.set_threads(args.threads)
    net = StackedDLR(args.layers, args.d, args.rank, args.depth)
    with torch.no_grad():
        net.alpha.fill_(0.1)  # non-trivial blocks (alpha = 0 would make every block's output zero)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.layers, args.tokens, args.d, generator=g)
    y = torch.randn(args.layers, args.tokens, args.d, generator=g)
    rows = []
    for name, fn in (("eager", net), ("compiled", torch.compile(net))):
        t0 = time.perf_counter()
        step_times(fn, net, x, y, 1)  # warm-up (compiles)
        warm = time.perf_counter() - t0
        times = step_times(fn, net, x, y, args.repeats)
        rows.append({"mode": name, "median step s": round(sorted(times)[len(times) // 2], 3),
                     "first step s": round(warm, 1)})
    for r in rows:
        r["speed-up vs eager"] = round(rows[0]["median step s"] / r["median step s"], 2)
    machine = harness.machine("{processor}, {threads} thread(s), torch {torch}")
    harness.print_result({"machine": machine, "settings": vars(args), "rows": rows}, args.json,
                         f"phase-1 step, {args.layers} layers x {args.tokens} tokens, d={args.d}, r={args.rank}, "
                         f"depth {args.depth}; {machine}\n" + table(rows, markdown=True))


if __name__ == "__main__":
    main()
