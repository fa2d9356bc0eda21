"""DLR-Net vs the SwiGLU it replaces on a GPU: inference time in eager PyTorch, PyTorch + CUDA graphs,
torch.compile and each schedule of our fused Triton kernel, against the card's measured ceilings (roofline);
the training-step ratio; phase-1 distillation throughput batched across layers vs one layer at a time;
correctness of every schedule at real shapes. Writes --json and a Markdown table (--out), after every row;
docs/dlr-gpu.md quotes a run (docs/results/dlr-gpu-h100.json).

    python benchmarks/dlr_gpu.py                      # on a CUDA machine (H100 / H200), bf16
    python benchmarks/dlr_gpu.py --dry-run            # tiny shapes on the CPU (fused path via TRITON_INTERPRET=1)
    python benchmarks/dlr_gpu.py --crossover 16,32,64,128,256,512   # the schedules against each other only

Ratios are DLR / SwiGLU of the same variant, measured in one run, medians of CUDA-event timings
(triton.testing.do_bench) after warm-up, on fresh random bf16 inputs.
"""

from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path

import harness

SHAPES = [  # (d, h, r, depth) as in the issue: depth matches the SwiGLU's parameters
    (4096, 12288, 256, 72),
    (4096, 12288, 1024, 18),
    (1024, 3072, 256, 18),
]
TOKENS = [16, 1024, 8192]
DRY_SHAPES = [(64, 192, 16, 6), (64, 192, 32, 3)]
DRY_TOKENS = [16, 64]


def parse():
    ap = harness.parser(__doc__, json="runs/dlr/gpu.json")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU to check the script itself")
    ap.add_argument("--tokens", help="comma-separated token counts")
    ap.add_argument("--out", default="runs/dlr/gpu.md", help="the tables (docs/dlr-gpu.md quotes them)")
    ap.add_argument("--skip-compile", action="store_true")
    ap.add_argument("--deadline", type=float, default=0,
                    help="seconds after the start past which no torch.compile cell is started (0: no limit); the "
                         "results are saved after every row, so a run stopped early keeps what it measured")
    ap.add_argument("--crossover", help="comma-separated token counts: only time the fused schedules against each "
                                       "other there (graph-replayed), to place choose_path's threshold")
    ap.add_argument("--layers", type=int, default=8, help="layers trained side by side in the phase-1 benchmark")
    return ap.parse_args()


args = parse()
if args.dry_run:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
from torch import nn  # noqa: E402

import gpu_common  # noqa: E402
from gpu_common import failure  # noqa: E402
from mlpsurgery.kernels import dlr_triton  # noqa: E402
from mlpsurgery.modules.dlr import DLRNet, StackedDLR  # noqa: E402

DEVICE, DTYPE = gpu_common.device_dtype(args.dry_run)


def bench(fn, reps: int = 50) -> float:
    """Median seconds of fn() (3 timed calls in a dry run)."""
    return gpu_common.bench(fn, DEVICE, reps=3 if args.dry_run else reps)


PAST_DEADLINE = harness.deadline(args.deadline)


def graphed(module, x: torch.Tensor):
    """CUDA-graph replay of module(x) (any callable) on a static input (launch overhead removed)."""
    if DEVICE != "cuda":
        return None
    static = x.clone()
    return gpu_common.graphed(lambda: module(static))


def swiglu(d: int, h: int) -> nn.Module:
    return gpu_common.swiglu(d, h, DEVICE, DTYPE)


def dlr(d: int, r: int, depth: int, fused: bool) -> DLRNet:
    return gpu_common.trained_looking_dlr(d, r, depth, DEVICE, DTYPE, fused=fused)


def correctness(d: int, r: int, depth: int, T: int) -> dict:
    """Relative error of each fused schedule and of PyTorch's forward in the same dtype against a float64
    reference (PyTorch's forward in float64), NaN-poisoned outputs (every element must be written)."""
    net = dlr(d, r, depth, fused=False)
    x = torch.randn(T, d, device=DEVICE, dtype=DTYPE)
    out = {}
    with torch.no_grad():
        plain = net._delta(x).double()
        Dp, Up = dlr_triton.folded_weights(net, DTYPE)
        fused = {}
        for path in dlr_triton.PATHS:
            try:
                poison = torch.full_like(x, float("nan"))
                fused[path] = dlr_triton.dlr_forward(x, Dp, Up, net.eps, out=poison, path=path).double()
            except Exception as e:  # noqa: BLE001 - a schedule that fails to compile is reported, not fatal
                out[f"error_{path}"] = failure(e)
        del Dp, Up
        net._folded = None
        ref = net.double()._delta(x.double())
    rel = lambda a: float((a - ref).norm() / ref.norm())  # noqa: E731
    out["pytorch"] = rel(plain)
    for path, f in fused.items():
        out[path] = rel(f)
        out[f"all_written_{path}"] = bool(torch.isfinite(f).all())
    return out


def schedule(Dp, Up, eps: float, path: str):
    """x -> the fused delta through one named schedule, with folded weights."""
    return lambda x: dlr_triton.dlr_forward(x, Dp, Up, eps, path=path)


def timed(row: dict, key: str, fn) -> None:
    """row[key] = median seconds of fn(); a failure is recorded in the row instead."""
    try:
        row[key] = bench(fn)
    except Exception as e:  # noqa: BLE001
        row[f"error_{key}"] = failure(e)


def inference_row(d: int, h: int, r: int, depth: int, T: int) -> dict:
    x = torch.randn(T, d, device=DEVICE, dtype=DTYPE)
    mlp = swiglu(d, h)
    net = dlr(d, r, depth, fused=False)
    row = {"d": d, "h": h, "r": r, "depth": depth, "T": T, "auto_path": dlr_triton.choose_path(T, d, r)}
    with torch.no_grad():
        Dp, Up = dlr_triton.folded_weights(net, DTYPE)
        timed(row, "swiglu_eager", lambda: mlp(x))
        timed(row, "dlr_eager", lambda: net(x))
        gs, gd = graphed(mlp, x), graphed(net, x)
        if gs is not None:
            timed(row, "swiglu_graph", gs)
            timed(row, "dlr_graph", gd)
        for path in dlr_triton.PATHS:
            fused = schedule(Dp, Up, net.eps, path)
            try:
                fused(x)  # compile the kernels outside the timing
            except Exception as e:  # noqa: BLE001
                row[f"error_fused_{path}"] = failure(e)
                continue
            timed(row, f"fused_{path}_eager", lambda: fused(x))
            if DEVICE == "cuda":
                try:
                    timed(row, f"fused_{path}_graph", graphed(fused, x))
                except Exception as e:  # noqa: BLE001
                    row[f"error_fused_{path}_graph"] = failure(e)
    finish_row(row)
    return row


def compile_cells(row: dict) -> None:
    """torch.compile of both modules at this row's shape (minutes of compilation each, so run last)."""
    d, h, r, depth, T = (row[k] for k in ("d", "h", "r", "depth", "T"))
    x = torch.randn(T, d, device=DEVICE, dtype=DTYPE)
    mlp, net = swiglu(d, h), dlr(d, r, depth, fused=False)
    with torch.no_grad():
        cm, cd = torch.compile(mlp), torch.compile(net)
        t0 = time.perf_counter()
        try:
            cm(x), cd(x)
        except Exception as e:  # noqa: BLE001
            row["error_compile"] = failure(e)
            return
        row["compile_seconds"] = time.perf_counter() - t0
        timed(row, "swiglu_compile", lambda: cm(x))
        timed(row, "dlr_compile", lambda: cd(x))
    finish_row(row)


def crossover(shapes, tokens) -> list[dict]:
    """Each fused schedule's graph-replayed time at each T (the threshold between them is read off this)."""
    rows = []
    for d, h, r, depth in shapes:
        net = dlr(d, r, depth, fused=False)
        with torch.no_grad():
            Dp, Up = dlr_triton.folded_weights(net, DTYPE)
            for T in tokens:
                x = torch.randn(T, d, device=DEVICE, dtype=DTYPE)
                row = {"d": d, "r": r, "depth": depth, "T": T, "auto_path": dlr_triton.choose_path(T, d, r)}
                for path in dlr_triton.PATHS:
                    fused = schedule(Dp, Up, net.eps, path)
                    fused(x)
                    timed(row, path, graphed(fused, x) if DEVICE == "cuda" else (lambda: fused(x)))
                print("crossover", row, flush=True)
                rows.append(row)
    return rows


def finish_row(row: dict) -> None:
    """Ratios, the fused schedules' best times, and the roofline: the floor is the larger of the DLR-Net's
    FLOPs over the measured matrix rate and its fewest bytes (weights once, residual read + written once per
    block) over the measured copy bandwidth."""
    d, h, r, depth, T = (row[k] for k in ("d", "h", "r", "depth", "T"))
    swiglu_times = [v for k, v in row.items() if k.startswith("swiglu_") and isinstance(v, float)]
    best_swiglu = min(swiglu_times) if swiglu_times else math.nan
    row["best_swiglu"] = best_swiglu
    for variant in ("eager", "graph", "compile"):
        if f"dlr_{variant}" in row and f"swiglu_{variant}" in row:
            row[f"ratio_{variant}"] = row[f"dlr_{variant}"] / row[f"swiglu_{variant}"]
    bits = torch.finfo(DTYPE).bits
    flops = 2 * 2 * d * r * depth * T
    nbytes = (2 * d * r * depth + 2 * depth * T * d) * bits // 8
    floor = max(flops / CEILINGS["flops"], nbytes / CEILINGS["bytes_per_s"]) if CEILINGS else math.nan
    row["floor_seconds"] = floor
    row["floor_bound"] = ("compute" if CEILINGS and flops / CEILINGS["flops"] > nbytes / CEILINGS["bytes_per_s"]
                          else "memory")
    for path in dlr_triton.PATHS:
        times = [row[k] for k in (f"fused_{path}_eager", f"fused_{path}_graph") if k in row]
        if times:
            row[f"fused_{path}"] = min(times)
            row[f"ratio_fused_{path}"] = min(times) / best_swiglu
    best = [(row[f"fused_{p}"], p) for p in dlr_triton.PATHS if f"fused_{p}" in row]
    if best:
        t, p = min(best)
        row["fused_best"], row["fused_best_path"] = t, p
        row["ratio_fused_best"] = t / best_swiglu
        row["fused_tflops"] = flops / t / 1e12
        row["fused_gbps"] = nbytes / t / 1e9
        row["roofline_fraction"] = floor / t
    if f"fused_{row['auto_path']}" in row:
        row["ratio_fused_auto"] = row[f"fused_{row['auto_path']}"] / best_swiglu


CEILINGS: dict = {}


def measure_ceilings() -> dict:
    """The two ceilings of this card, measured: a large device-to-device copy (bytes read + written per second)
    and a large bf16 matrix product (FLOP/s), on random data."""
    if DEVICE != "cuda":
        return {}
    a = torch.randn(1 << 28, device=DEVICE, dtype=torch.bfloat16)  # 512 MiB
    b = torch.empty_like(a)
    t_copy = bench(lambda: b.copy_(a))
    m = torch.randn(8192, 8192, device=DEVICE, dtype=torch.bfloat16)
    n = torch.randn(8192, 8192, device=DEVICE, dtype=torch.bfloat16)
    t_mm = bench(lambda: m @ n)
    return {"bytes_per_s": 2 * (1 << 28) * 2 / t_copy, "flops": 2 * 8192 ** 3 / t_mm}


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
    head = gpu_common.result_head(DEVICE, DTYPE)
    CEILINGS.update(measure_ceilings())
    res = {**head, "ceilings": dict(CEILINGS), "inference": [], "training": [], "correctness": [], "phase1": None}
    print("ceilings", CEILINGS, flush=True)

    def save():
        harness.write_json(args.json, res)
        write_doc(res, Path(args.out) if not args.dry_run else Path(args.json).with_suffix(".md"))

    if args.crossover:
        res["crossover"] = crossover(shapes, [int(t) for t in args.crossover.split(",")])
        save()
        return
    for d, h, r, depth in shapes:
        for T in (tokens[0], tokens[-1]):
            res["correctness"].append({"d": d, "r": r, "depth": depth, "T": T, **correctness(d, r, depth, T)})
            print("correct", res["correctness"][-1], flush=True)
        for T in tokens:
            res["inference"].append(inference_row(d, h, r, depth, T))
            print(short(res["inference"][-1]), flush=True)
            save()
    T_train = tokens[1] if len(tokens) > 1 else tokens[0]
    for d, h, r, depth in shapes:
        res["training"].append({"d": d, "h": h, "r": r, "depth": depth, "T": T_train,
                                **training_row(d, h, r, depth, T_train)})
        print("train", res["training"][-1], flush=True)
        save()
    d, h, r, depth = shapes[-1]
    res["phase1"] = {"d": d, "r": r, "depth": depth,
                     **phase1_throughput(d, r, depth, 2 if args.dry_run else args.layers, 64 if args.dry_run else 2048)}
    print("phase1", res["phase1"], flush=True)
    save()
    if not args.skip_compile:
        for row in res["inference"]:
            if PAST_DEADLINE():
                print("deadline: the remaining torch.compile cells are not run", flush=True)
                break
            compile_cells(row)
            print("compile", short(row), flush=True)
            save()


def short(row: dict) -> dict:
    return {k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in row.items()
            if k.startswith(("d", "r", "T", "ratio", "fused_best", "roofline", "error", "compile"))}


def write_doc(res: dict, path: Path) -> None:
    def f(v, fmt="{:.2f}"):
        return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else fmt.format(v)

    c = res["ceilings"]
    lines = [
        "# DLR-Net vs SwiGLU on the GPU (written by `python benchmarks/dlr_gpu.py`)",
        "",
        f"Machine: {res['machine']}, {res['dtype']}, torch {res['torch']}, triton {res['triton']}. Ceilings measured "
        f"in the same run: copy {f(c.get('bytes_per_s', math.nan) / 1e12)} TB/s (read + write), bf16 matrix "
        f"product {f(c.get('flops', math.nan) / 1e12, '{:.0f}')} TFLOP/s.",
        "Ratios are DLR-Net / SwiGLU time: eager, CUDA graphs and torch.compile each against the SwiGLU in the same "
        "mode; each fused schedule (our Triton kernels; best of eager and graph replay) against the best SwiGLU of "
        "any mode. Roofline: the floor (the larger of the DLR-Net's FLOPs over the measured matrix rate and its "
        "fewest bytes over the measured copy bandwidth) over the best fused time.",
        "",
        "| shape (d, h) | r | depth | T | eager | CUDA graphs | torch.compile | "
        + " | ".join(f"fused {p}" for p in dlr_triton.PATHS)
        + " | automatic | best fused vs SwiGLU | roofline fraction (bound) |",
        "|---|---|---|---|---|---|---|" + "---|" * len(dlr_triton.PATHS) + "---|---|---|",
    ]
    for row in res["inference"]:
        x = lambda k: f(row.get(k)) + ("x" if row.get(k) is not None else "")  # noqa: E731
        lines.append(f"| {row['d']}, {row['h']} | {row['r']} | {row['depth']} | {row['T']} | {x('ratio_eager')} | "
                     f"{x('ratio_graph')} | {x('ratio_compile')} | "
                     + "".join(f"{x(f'ratio_fused_{p}')} | " for p in dlr_triton.PATHS)
                     + f"{row['auto_path']} | **{x('ratio_fused_best')}** "
                     f"({row.get('fused_best_path', '-')}) | {f(row.get('roofline_fraction'))} "
                     f"({row.get('floor_bound', '-')}) |")
    lines += ["", "Milliseconds (median of CUDA-event timings):", "",
              "| d, r, depth | T | SwiGLU eager / graph / compile | DLR eager / graph / compile | "
              + "".join(f"{p} e / g | " for p in dlr_triton.PATHS) + "floor |",
              "|---|---|---|---|" + "---|" * len(dlr_triton.PATHS) + "---|"]
    ms = lambda row, *ks: " / ".join(f(row.get(k) * 1e3 if row.get(k) is not None else None, "{:.3f}")  # noqa: E731
                                     for k in ks)
    for row in res["inference"]:
        lines.append(f"| {row['d']}, {row['r']}, {row['depth']} | {row['T']} | "
                     f"{ms(row, 'swiglu_eager', 'swiglu_graph', 'swiglu_compile')} | "
                     f"{ms(row, 'dlr_eager', 'dlr_graph', 'dlr_compile')} | "
                     + "".join(f"{ms(row, f'fused_{p}_eager', f'fused_{p}_graph')} | " for p in dlr_triton.PATHS)
                     + f"{ms(row, 'floor_seconds')} |")
    errors = [(row, k, v) for row in res["inference"] + res["correctness"] for k, v in row.items()
              if k.startswith("error")]
    if errors:
        lines += ["", "Failures:", ""] + [f"- d={row['d']} r={row['r']} T={row['T']} {k}: {v}" for row, k, v in errors]
    if res["training"]:
        lines += ["", "## Training step (forward + backward + AdamW), one module", "",
                  "| shape | r | depth | T | DLR / SwiGLU | with the fused path switched off |", "|---|---|---|---|---|---|"]
        for row in res["training"]:
            lines.append(f"| {row['d']}, {row['h']} | {row['r']} | {row['depth']} | {row['T']} | {f(row['ratio'])}x | "
                         f"{f(row['ratio_fused_off'])}x |")
    if res.get("crossover"):
        lines += ["", "## Schedules against each other (milliseconds, CUDA-graph replay)", "",
                  "| d, r, depth | T | " + " | ".join(dlr_triton.PATHS) + " | chosen |",
                  "|---|---|" + "---|" * len(dlr_triton.PATHS) + "---|"]
        for row in res["crossover"]:
            lines.append(f"| {row['d']}, {row['r']}, {row['depth']} | {row['T']} | "
                         + " | ".join(f(row.get(p) * 1e3 if row.get(p) else None, "{:.3f}") for p in dlr_triton.PATHS)
                         + f" | {row['auto_path']} |")
    p = res["phase1"]
    if p:
        lines += ["", "## Phase-1 distillation throughput", "",
                  f"{p['layers']} layers of (d={p['d']}, r={p['r']}, depth {p['depth']}), {p['tokens']} tokens per layer "
                  f"per step: batched (one StackedDLR) {p['batched_tok_layers_per_s']:.3g} token-layers/s vs one layer "
                  f"at a time {p['sequential_tok_layers_per_s']:.3g} token-layers/s ({p['speedup']:.2f}x)."]
    lines += ["", "## Correctness (relative error vs a float64 reference, fresh random inputs, NaN-poisoned output)", "",
              "| d | r | depth | T | PyTorch same dtype | " + " | ".join(dlr_triton.PATHS) + " | every element written |",
              "|---|---|---|---|---|" + "---|" * len(dlr_triton.PATHS) + "---|"]
    for c in res["correctness"]:
        lines.append(f"| {c['d']} | {c['r']} | {c['depth']} | {c['T']} | {c['pytorch']:.2e} | "
                     + " | ".join(f(c.get(p), "{:.2e}") for p in dlr_triton.PATHS) + " | "
                     + str(all(c.get(f"all_written_{p}", False) for p in dlr_triton.PATHS)) + " |")
    harness.write_md(path, "\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
