"""DLR-Net vs the SwiGLU it replaces on a GPU: inference time in eager PyTorch, PyTorch + CUDA graphs,
torch.compile and our fused Triton kernel; the training-step ratio; phase-1 distillation throughput batched
across layers vs one layer at a time; correctness of the fused kernel at real shapes. Writes docs/dlr-gpu.md.

    python benchmarks/dlr_gpu.py                      # on a CUDA machine (H100 / H200), bf16
    python benchmarks/dlr_gpu.py --dry-run            # tiny shapes on the CPU (fused path via TRITON_INTERPRET=1)

Ratios are DLR / SwiGLU of the same variant, measured in one run, medians of CUDA-event timings
(triton.testing.do_bench) after warm-up, on fresh random bf16 inputs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

SHAPES = [  # (d, h, r, depth) as in the issue: depth matches the SwiGLU's parameters
    (4096, 12288, 256, 72),
    (4096, 12288, 1024, 18),
    (1024, 3072, 256, 18),
]
TOKENS = [16, 1024, 8192]
DRY_SHAPES = [(64, 192, 16, 6), (64, 192, 32, 3)]
DRY_TOKENS = [16, 64]


def parse():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU to check the script itself")
    ap.add_argument("--tokens", help="comma-separated token counts")
    ap.add_argument("--out", default="docs/dlr-gpu.md")
    ap.add_argument("--json", default="runs/dlr/gpu.json")
    ap.add_argument("--skip-compile", action="store_true")
    ap.add_argument("--layers", type=int, default=8, help="layers trained side by side in the phase-1 benchmark")
    return ap.parse_args()


args = parse()
if args.dry_run:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
from torch import nn  # noqa: E402

from mlpsurgery.modules.dense import DenseMLP  # noqa: E402
from mlpsurgery.modules.dlr import DLRNet, StackedDLR  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() and not args.dry_run else "cpu"
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32


def bench(fn, reps: int = 50) -> float:
    """Median seconds of fn()."""
    if DEVICE == "cuda":
        from triton.testing import do_bench

        return do_bench(fn, warmup=25, rep=100, return_mode="median") / 1e3
    fn()
    times = []
    for _ in range(3 if args.dry_run else reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def graphed(module: nn.Module, x: torch.Tensor):
    """CUDA-graph replay of module(x) on a static input (launch overhead removed)."""
    if DEVICE != "cuda":
        return None
    static = x.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.no_grad():
        for _ in range(3):
            module(static)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g), torch.no_grad():
        module(static)
    return g.replay


def swiglu(d: int, h: int) -> nn.Module:
    return DenseMLP(d, h, "silu", gated=True).to(DEVICE, DTYPE).eval()


def dlr(d: int, r: int, depth: int, fused: bool) -> DLRNet:
    net = DLRNet(d, r, depth)
    with torch.no_grad():
        net.alpha.normal_(0, 0.05)  # a trained-looking net
    net = net.to(DEVICE, DTYPE).eval()
    net.fused = fused
    return net


def correctness(d: int, r: int, depth: int, T: int) -> dict:
    """Relative error of the fused forward and of PyTorch's bf16 forward against a float64 reference."""
    net = dlr(d, r, depth, fused=True)
    x = torch.randn(T, d, device=DEVICE, dtype=DTYPE)
    with torch.no_grad():
        ref = net.double().full(x.double()) - x.double()
        net.to(DTYPE)
        from mlpsurgery.kernels.dlr_triton import dlr_forward, folded_weights

        Dp, Up = folded_weights(net, DTYPE)
        out = torch.full_like(x, float("nan"))
        fused = dlr_forward(x, Dp, Up, net.eps, out=out).double()
        net.fused = False
        plain = net(x).double()
    rel = lambda a: float((a - ref).norm() / ref.norm())  # noqa: E731
    return {"fused": rel(fused), "pytorch": rel(plain), "all_written": bool(torch.isfinite(fused).all())}


def inference_row(d: int, h: int, r: int, depth: int, T: int) -> dict:
    x = torch.randn(T, d, device=DEVICE, dtype=DTYPE)
    mlp = swiglu(d, h)
    net = dlr(d, r, depth, fused=False)
    fused = dlr(d, r, depth, fused=True)
    with torch.no_grad():
        fused(x)  # fold the weights and compile the kernel outside the timing
    row = {"d": d, "h": h, "r": r, "depth": depth, "T": T}
    with torch.no_grad():
        row["swiglu_eager"] = bench(lambda: mlp(x))
        row["dlr_eager"] = bench(lambda: net(x))
        row["dlr_fused"] = bench(lambda: fused(x))
        gs, gd = graphed(mlp, x), graphed(net, x)
        if gs is not None:
            row["swiglu_graph"] = bench(gs)
            row["dlr_graph"] = bench(gd)
            gf = graphed(fused, x)
            row["dlr_fused_graph"] = bench(gf)
        if not args.skip_compile:
            cm = torch.compile(mlp)
            cd = torch.compile(net)
            cm(x), cd(x)
            row["swiglu_compile"] = bench(lambda: cm(x))
            row["dlr_compile"] = bench(lambda: cd(x))
    best_swiglu = min(v for k, v in row.items() if k.startswith("swiglu_"))
    row["ratio_eager"] = row["dlr_eager"] / row["swiglu_eager"]
    if "dlr_graph" in row:
        row["ratio_graph"] = row["dlr_graph"] / row["swiglu_graph"]
    if "dlr_compile" in row:
        row["ratio_compile"] = row["dlr_compile"] / row["swiglu_compile"]
    fused_best = min(row["dlr_fused"], row.get("dlr_fused_graph", math.inf))
    row["ratio_fused_vs_best_swiglu"] = fused_best / best_swiglu
    # the physical floor: SwiGLU's FLOPs and weight bytes (equal for both) + one read and write of the residual
    flops = 2 * 3 * d * h * T
    weight_bytes = 3 * d * h * torch.finfo(DTYPE).bits // 8
    resid = 2 * depth * T * d * torch.finfo(DTYPE).bits // 8
    row["fused_tflops"] = flops / fused_best / 1e12
    row["fused_gbps"] = (weight_bytes + resid) / fused_best / 1e9
    return row


def training_row(d: int, h: int, r: int, depth: int, T: int) -> dict:
    """Forward + backward + AdamW of one module on T tokens; fused on or off must not change the DLR's cost."""
    out = {}
    for name, mod in (("swiglu", swiglu(d, h).train()), ("dlr", dlr(d, r, depth, fused=True).train()),
                      ("dlr_fused_off", dlr(d, r, depth, fused=False).train())):
        opt = torch.optim.AdamW(mod.parameters(), lr=1e-5)
        x = torch.randn(T, d, device=DEVICE, dtype=DTYPE)

        def step():
            opt.zero_grad(set_to_none=True)
            mod(x).float().pow(2).mean().backward()
            opt.step()

        out[name] = bench(step, reps=10)
    out["ratio"] = out["dlr"] / out["swiglu"]
    out["ratio_fused_off"] = out["dlr_fused_off"] / out["swiglu"]
    return out


def phase1_throughput(d: int, r: int, depth: int, layers: int, tokens: int, steps: int = 5) -> dict:
    """Tokens x layers per second of a phase-1 step (relative MSE, AdamW): all layers as one StackedDLR vs
    the same layers stepped one after another."""
    x = torch.randn(layers, tokens, d, device=DEVICE)
    y = x + 0.1 * torch.randn_like(x)

    def make(n):
        net = StackedDLR(n, d, r, depth).to(DEVICE)
        return net, torch.optim.AdamW(net.parameters(), lr=1e-3)

    def step(net, opt, xs, ys):
        opt.zero_grad(set_to_none=True)
        rel = ((net(xs) - ys).pow(2).sum((1, 2)) / (ys - xs).pow(2).sum((1, 2))).sum()
        rel.backward()
        opt.step()

    batched, bopt = make(layers)
    t_batched = bench(lambda: step(batched, bopt, x, y), reps=steps)
    singles = [make(1) for _ in range(layers)]

    def sequential():
        for i, (net, opt) in enumerate(singles):
            step(net, opt, x[i:i + 1], y[i:i + 1])

    t_seq = bench(sequential, reps=steps)
    return {"layers": layers, "tokens": tokens, "batched_tok_layers_per_s": layers * tokens / t_batched,
            "sequential_tok_layers_per_s": layers * tokens / t_seq, "speedup": t_seq / t_batched}


def main():
    shapes = DRY_SHAPES if args.dry_run else SHAPES
    tokens = [int(t) for t in args.tokens.split(",")] if args.tokens else (DRY_TOKENS if args.dry_run else TOKENS)
    machine = torch.cuda.get_device_name(0) if DEVICE == "cuda" else "CPU (dry run, Triton interpreter)"
    res = {"machine": machine, "dtype": str(DTYPE), "torch": torch.__version__, "inference": [], "training": [],
           "correctness": [], "phase1": None}
    for d, h, r, depth in shapes:
        for T in (tokens[0], tokens[-1]):
            res["correctness"].append({"d": d, "r": r, "depth": depth, "T": T, **correctness(d, r, depth, T)})
            print("correct", res["correctness"][-1], flush=True)
        for T in tokens:
            res["inference"].append(inference_row(d, h, r, depth, T))
            print({k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in res["inference"][-1].items()}, flush=True)
        res["training"].append({"d": d, "h": h, "r": r, "depth": depth, "T": tokens[1] if len(tokens) > 1 else tokens[0],
                                **training_row(d, h, r, depth, tokens[1] if len(tokens) > 1 else tokens[0])})
        print("train", res["training"][-1], flush=True)
    d, h, r, depth = shapes[-1]
    res["phase1"] = {"d": d, "r": r, "depth": depth,
                     **phase1_throughput(d, r, depth, 2 if args.dry_run else args.layers, 64 if args.dry_run else 2048)}
    print("phase1", res["phase1"], flush=True)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(res, indent=1))
    write_doc(res, Path(args.out) if not args.dry_run else Path(args.json).with_suffix(".md"))


def write_doc(res: dict, path: Path) -> None:
    def f(v, fmt="{:.2f}"):
        return "-" if v is None else fmt.format(v)

    lines = [
        "# DLR-Lock on the GPU: fused inference and batched distillation",
        "",
        f"Machine: {res['machine']}, {res['dtype']}, torch {res['torch']}. Command: `python benchmarks/dlr_gpu.py`.",
        "Ratios are DLR-Net / SwiGLU time of the same variant (eager, CUDA-graph replay, torch.compile); the",
        "fused column is our kernel's best time (eager or graph-replayed) over the best SwiGLU time of any variant.",
        "",
        "| shape (d, h) | r | depth | T | eager | CUDA graphs | torch.compile | fused (ours) | fused TFLOP/s | fused GB/s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in res["inference"]:
        lines.append(f"| {row['d']}, {row['h']} | {row['r']} | {row['depth']} | {row['T']} | {f(row['ratio_eager'])}x | "
                     f"{f(row.get('ratio_graph'))}x | {f(row.get('ratio_compile'))}x | "
                     f"**{f(row['ratio_fused_vs_best_swiglu'])}x** | {f(row['fused_tflops'], '{:.1f}')} | "
                     f"{f(row['fused_gbps'], '{:.0f}')} |")
    lines += ["", "## Training step (forward + backward + AdamW), one module", "",
              "| shape | r | depth | T | DLR / SwiGLU | with the fused path switched off |", "|---|---|---|---|---|---|"]
    for row in res["training"]:
        lines.append(f"| {row['d']}, {row['h']} | {row['r']} | {row['depth']} | {row['T']} | {f(row['ratio'])}x | "
                     f"{f(row['ratio_fused_off'])}x |")
    p = res["phase1"]
    lines += ["", "## Phase-1 distillation throughput", "",
              f"{p['layers']} layers of (d={p['d']}, r={p['r']}, depth {p['depth']}), {p['tokens']} tokens per layer per "
              f"step: batched (one StackedDLR) {p['batched_tok_layers_per_s']:.3g} token-layers/s vs one layer at a "
              f"time {p['sequential_tok_layers_per_s']:.3g} token-layers/s ({p['speedup']:.2f}x).",
              "", "## Correctness (relative error vs a float64 reference, fresh random inputs, NaN-poisoned output)", "",
              "| d | r | depth | T | fused | PyTorch same dtype | every element written |", "|---|---|---|---|---|---|---|"]
    for c in res["correctness"]:
        lines.append(f"| {c['d']} | {c['r']} | {c['depth']} | {c['T']} | {c['fused']:.2e} | {c['pytorch']:.2e} | "
                     f"{c['all_written']} |")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
