"""What the GPU benchmarks of the DLR kernel share (`dlr_gpu.py`, `dlr_gpu_tune.py`): the device and dtype of a
run and the head of its result, timing (CUDA: medians of triton.testing.do_bench; CPU dry runs: medians of
wall-clock calls, harness.median_seconds), CUDA-graph capture, and the modules they time -- a trained-looking DLR-Net
and the SwiGLU it replaces.
"""

from __future__ import annotations

import torch
from torch import nn

import harness
from mlpsurgery.modules.dense import DenseMLP
from mlpsurgery.modules.dlr import DLRNet


def device_dtype(dry_run: bool) -> tuple[str, torch.dtype]:
    """("cuda", bfloat16) on a GPU; ("cpu", float32) for a dry run or where there is none."""
    if torch.cuda.is_available() and not dry_run:
        return "cuda", torch.bfloat16
    return "cpu", torch.float32


def bench(fn, device: str, reps: int = 50) -> float:
    """Median seconds of fn(): on CUDA do_bench's median after its warm-up; on the CPU one warm-up call, then
    `reps` timed calls."""
    if device == "cuda":
        from triton.testing import do_bench

        return do_bench(fn, warmup=25, rep=100, return_mode="median") / 1e3
    return harness.median_seconds(fn, reps)


def result_head(device: str, dtype: torch.dtype) -> dict:
    """What every result of these benchmarks starts with: the card (or the CPU of a dry run), dtype and versions."""
    import triton

    return {"machine": torch.cuda.get_device_name(0) if device == "cuda" else "CPU (dry run, Triton interpreter)",
            "dtype": str(dtype), "torch": torch.__version__, "triton": triton.__version__}


def graphed(fn, warmup: int = 3):
    """The replay of a CUDA graph that captured fn() (no arguments: its inputs are static tensors), after
    `warmup` calls on a side stream (kernels compiled, allocator warmed); launch overhead removed."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.no_grad():
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g), torch.no_grad():
        fn()
    return g.replay


def swiglu(d: int, h: int, device: str, dtype: torch.dtype) -> nn.Module:
    """The gated SiLU MLP (d -> h -> d) a DLR-Net replaces, random weights, in eval mode."""
    return DenseMLP(d, h, "silu", gated=True).to(device, dtype).eval()


def trained_looking_dlr(d: int, r: int, depth: int, device: str, dtype: torch.dtype, fused: bool = False) -> DLRNet:
    """A DLR-Net whose ReZero scalars are drawn N(0, 0.05) instead of 0 (an untrained net's blocks add nothing,
    so its output would not test the kernel's arithmetic), in eval mode."""
    net = DLRNet(d, r, depth)
    with torch.no_grad():
        net.alpha.normal_(0, 0.05)
    net = net.to(device, dtype).eval()
    net.fused = fused
    return net


def failure(e: Exception, limit: int = 300) -> str:
    """How a cell that failed (a schedule or setting that does not compile, a capture that breaks) is recorded."""
    return f"{type(e).__name__}: {str(e)[:limit]}"
