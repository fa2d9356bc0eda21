"""The fused DLR kernel's tile settings swept on a GPU, at the cells where docs/dlr-gpu.md's targets were missed:
each schedule's whole forward (CUDA-graph replay) for every setting tried, checked against a float64 reference,
next to the SwiGLU it replaces and to the launch floor (as many empty kernels as the schedule launches, replayed
the same way). The best setting per cell is what `kernels/dlr_triton.py`'s defaults are chosen from.

    python benchmarks/dlr_gpu_tune.py --json runs/tune.json --md runs/tune.md   # on a CUDA machine, bf16
    python benchmarks/dlr_gpu_tune.py --defaults-only                           # the current defaults alone
    python benchmarks/dlr_gpu_tune.py --dry-run                                 # tiny shapes, Triton's interpreter

cols (T <= 16): a grid over BK (columns per program) and num_warps. gemm (more rows): coordinate descent from
the defaults over SS_EPI (the next block's sum of squares from the up product's epilogue), the row tile, each
product's tile, the pipeline's stages and the warps. A setting that fails to compile (shared memory) is recorded
and skipped. Results are written after every setting. (The sweep of 2026-11-27 also tried NCOPY, copies of the
cols schedule's atomically summed buffers, since removed from the kernel: docs/dlr-gpu.md.)
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import harness

ap = harness.parser(__doc__, summary=True, json="runs/dlr/tune.json", md="runs/dlr/tune.md")
ap.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU (Triton's interpreter)")
ap.add_argument("--deadline", type=float, default=0, help="seconds after which no further setting is tried")
ap.add_argument("--defaults-only", action="store_true", help="time the kernel's default settings only (a check)")
ap.add_argument("--cells", help="comma-separated indices into the list of cells (default: all), e.g. 0 for the "
                                "72-block net at T = 16 (what benchmarks/gpu_session.sh profiles with ncu)")
args = ap.parse_args()
if args.dry_run:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

import gpu_common  # noqa: E402
from mlpsurgery.kernels import dlr_triton as K  # noqa: E402

DEVICE, DTYPE = gpu_common.device_dtype(args.dry_run)
CUDA = DEVICE == "cuda"
PAST_DEADLINE = harness.deadline(args.deadline)

if args.dry_run:
    CELLS = [("cols", 64, 192, 16, 4, 8), ("gemm", 64, 192, 32, 3, 64)]
    COLS_GRID = [{"BK": bk, "num_warps": w} for bk in (16, 32) for w in (4, 8)]
    GEMM_AXES = [("SS_EPI", [False, True]), ("BM", [32, 64])]
else:
    CELLS = [  # (schedule, d, h, r, depth, T): the targets' cells first
        ("cols", 4096, 12288, 256, 72, 16),
        ("gemm", 4096, 12288, 1024, 18, 8192),
        ("gemm", 4096, 12288, 256, 72, 8192),
        ("cols", 4096, 12288, 1024, 18, 16),
        ("gemm", 4096, 12288, 256, 72, 1024),
        ("cols", 1024, 3072, 256, 18, 16),
        ("gemm", 1024, 3072, 256, 18, 8192),
    ]
    COLS_GRID = [{"BK": bk, "num_warps": w} for bk in (16, 32, 64, 128) for w in (4, 8)]
    GEMM_AXES = [  # coordinate descent, one axis at a time, in this order
        ("SS_EPI", [False, True]),
        ("BM", [64, 128]),
        ("BN_down", [64, 128, 256]),
        ("BK_down", [32, 64, 128]),
        ("BN_up", [64, 128, 256]),
        ("BK_up", [32, 64, 128]),
        ("stages", [2, 3, 4]),
        ("warps_down", [4, 8]),
        ("warps_up", [4, 8]),
    ]


def bench(fn) -> float:
    """Median seconds of fn() (CUDA: graph replay timed by do_bench; a dry run: one call after one warm-up)."""
    return gpu_common.bench(gpu_common.graphed(fn) if CUDA else fn, DEVICE, reps=1)


def launch_floor(n: int) -> float | None:
    """Seconds of n empty Triton kernels replayed in one CUDA graph: the dependent launches' own cost."""
    if not CUDA:
        return None
    import triton

    @triton.jit
    def empty(X):
        pass

    buf = torch.empty(1, device=DEVICE)
    return bench(lambda: [empty[(132,)](buf) for _ in range(n)])


def run_cell(cell, res: dict, save) -> None:
    schedule, d, h, r, depth, T = cell
    net = gpu_common.trained_looking_dlr(d, r, depth, DEVICE, DTYPE)
    mlp = gpu_common.swiglu(d, h, DEVICE, DTYPE)
    x = torch.randn(T, d, device=DEVICE, dtype=DTYPE)
    row = {"schedule": schedule, "d": d, "h": h, "r": r, "depth": depth, "T": T, "tried": []}
    res["cells"].append(row)
    with torch.no_grad():
        Dp, Up = K.folded_weights(net, DTYPE)
        ref = net.double()._delta(x.double())
        net.to(DTYPE)
        row["swiglu"] = bench(lambda: mlp(x))
        row["launch_floor"] = launch_floor(depth + 1 if schedule == "cols" else 2 * depth)
        out = torch.empty_like(x)

        def attempt(tiles: dict) -> float | None:
            if PAST_DEADLINE():
                return None
            entry = {"tiles": tiles}
            row["tried"].append(entry)
            try:
                t0 = time.perf_counter()
                y = K.dlr_forward(x, Dp, Up, net.eps, out=out, path=schedule, tiles=tiles).double()
                entry["first_call_s"] = time.perf_counter() - t0
                entry["rel_err"] = float((y - ref).norm() / ref.norm())
                entry["seconds"] = bench(lambda: K.dlr_forward(x, Dp, Up, net.eps, out=out, path=schedule,
                                                               tiles=tiles))
                entry["ratio"] = entry["seconds"] / row["swiglu"]
            except Exception as e:  # noqa: BLE001 - a setting that does not compile is recorded, not fatal
                entry["error"] = gpu_common.failure(e, limit=200)
            print(schedule, d, r, depth, T, json.dumps(entry), flush=True)
            save()
            return entry.get("seconds")

        default = attempt({})
        row["default_seconds"] = default
        best, best_tiles = default, {}
        if args.defaults_only:
            pass
        elif schedule == "cols":
            for tiles in COLS_GRID:
                t = attempt(tiles)
                if t is not None and (best is None or t < best):
                    best, best_tiles = t, tiles
        else:
            current = {}
            for axis, values in GEMM_AXES:
                for v in values:
                    tiles = {**current, axis: v}
                    t = attempt(tiles)
                    if t is not None and (best is None or t < best):
                        best, best_tiles = t, tiles
                current = dict(best_tiles)
        row["best_seconds"], row["best_tiles"] = best, best_tiles
        if best is not None:
            row["best_ratio"], row["default_ratio"] = best / row["swiglu"], (default or float("nan")) / row["swiglu"]
            ok = [e for e in row["tried"] if "rel_err" in e]
            row["max_rel_err"] = max(e["rel_err"] for e in ok)
    save()


def write_md(res: dict, path: Path) -> None:
    ms = lambda t: "-" if t is None else f"{t * 1e3:.3f}"  # noqa: E731
    lines = ["# The fused DLR kernel's tile settings swept (written by `python benchmarks/dlr_gpu_tune.py`)", "",
             f"Machine: {res['machine']}, {res['dtype']}, torch {res['torch']}, triton {res['triton']}. Whole "
             "forward, CUDA-graph replay, medians of do_bench; ratio = fused / SwiGLU (graph replay) at the same T.",
             "", "| schedule | d, r, depth | T | SwiGLU ms | launch floor ms | default ms (ratio) | best ms (ratio) | "
             "best settings | settings tried | max rel. error |", "|---|---|---|---|---|---|---|---|---|---|"]
    for c in res["cells"]:
        lines.append(f"| {c['schedule']} | {c['d']}, {c['r']}, {c['depth']} | {c['T']} | {ms(c.get('swiglu'))} | "
                     f"{ms(c.get('launch_floor'))} | {ms(c.get('default_seconds'))} ({c.get('default_ratio', 0):.2f}x)"
                     f" | {ms(c.get('best_seconds'))} ({c.get('best_ratio', 0):.2f}x) | "
                     f"`{json.dumps(c.get('best_tiles'))}` | {len(c['tried'])} | {c.get('max_rel_err', 0):.2e} |")
    harness.write_md(path, "\n".join(lines))


def main() -> int:
    res = {**gpu_common.result_head(DEVICE, DTYPE), "cells": []}

    def save():
        harness.write_json(args.json, res)
        write_md(res, Path(args.md))

    cells = [CELLS[int(i)] for i in args.cells.split(",")] if args.cells else CELLS
    for cell in cells:
        if PAST_DEADLINE():
            break
        run_cell(cell, res, save)
    save()
    print(Path(args.md).read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
