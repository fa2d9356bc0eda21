"""A fused inference forward of the DLR-Net in Triton (CUDA for speed; `TRITON_INTERPRET=1` runs it on the
CPU for correctness checks).

Per block l the network computes  z <- z + a_l U_l silu(D_l (w_l * z / rms(z))).  The fused kernel:
- folds the RMSNorm weight into the down projection (D'_l = D_l diag(w_l)) and the ReZero scalar into the
  up projection (U'_l = a_l U_l), once per weight version;
- computes the row scale 1/rms(z) in the same pass as the down projection (sum of squares accumulated
  while the z tiles stream through), since  D_l (w_l * z / rms(z)) = (D'_l z) / rms(z);
- applies SiLU, the up projection and the residual add, and in that same pass over z already accumulates
  the *next* block's down projection and sum of squares from the freshly written z tile.
So each block reads its residual once and writes it once (the physical floor), and the r-wide activations
stay in registers between blocks. One launch runs every block of the network for a tile of rows (rows are
independent), which also removes the per-block launch overhead that dominates at small token counts.
The result is the module's delta DLR(x) - x; the last block subtracts x from its tiles before storing.

Training never uses this path: autograd needs the stored activations, and locking must not get cheaper.
"""

from __future__ import annotations

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # the package works without triton; only the fused path is unavailable
    HAVE_TRITON = False


def interpreting() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def available(x: Tensor) -> bool:
    """Whether the fused kernel can run on x's device: CUDA, or the CPU under TRITON_INTERPRET=1."""
    return HAVE_TRITON and (x.is_cuda or interpreting())


def _differentiated(t: Tensor) -> bool:
    """Whether `t` carries a derivative the kernel would drop: a forward-mode tangent (torch.autograd.forward_ad)
    or a torch.func transform's wrapper (jvp, vmap, grad, jacfwd ...)."""
    from torch._C import _functorch
    from torch.autograd import forward_ad

    if _functorch.is_functorch_wrapped_tensor(t) or _functorch.is_batchedtensor(t):
        return True
    return forward_ad.unpack_dual(t).tangent is not None


def module_forward(net, x: Tensor) -> Tensor | None:
    """A DLRNet's delta through the fused kernel, or None where the kernel does not apply: plain inference on
    CUDA (or the interpreter) with triton, outside torch.compile and outside any forward-mode or functorch
    differentiation of the input or the weights (the kernel has no tangent)."""
    params = (net.D, net.U, net.norm, net.alpha)
    if not available(x) or torch.compiler.is_compiling() or any(_differentiated(t) for t in (x, *params)):
        return None
    Dp, Up = folded_weights(net, x.dtype)
    return dlr_forward(x, Dp, Up, net.eps)


def folded_weights(net, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """D diag(norm) and alpha U of a DLRNet for the kernel, cached on the net until a parameter changes."""
    params = (net.D, net.U, net.norm, net.alpha)
    key = (dtype, net.D.device, *(p._version for p in params), *(p.data_ptr() for p in params))
    if net._folded is None or net._folded[0] != key:
        net._folded = (key, *fold(*params, dtype))
    return net._folded[1], net._folded[2]


if HAVE_TRITON:

    @triton.jit
    def _dlr_forward_kernel(X, OUT, DW, UW, T, d, r, depth, stride_x, stride_o, eps,
                            BT: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr, DOT_F32: tl.constexpr):
        # DOT_F32: run the matrix products in fp32 (the CPU interpreter's bf16 tl.dot is wrong); on the GPU
        # they run on the tensor cores in the weights' dtype with fp32 accumulation.
        pid = tl.program_id(0)
        rows = pid * BT + tl.arange(0, BT)
        rmask = rows < T
        rr = tl.arange(0, BR)
        rrmask = rr < r
        w_dtype = tl.float32 if DOT_F32 else DW.dtype.element_ty
        # block 0's down projection straight from x, copying x into the running residual buffer
        acc = tl.zeros((BT, BR), dtype=tl.float32)
        ss = tl.zeros((BT,), dtype=tl.float32)
        for k0 in range(0, d, BK):
            kk = k0 + tl.arange(0, BK)
            m2 = rmask[:, None] & (kk < d)[None, :]
            z = tl.load(X + rows[:, None] * stride_x + kk[None, :], mask=m2, other=0.0)
            tl.store(OUT + rows[:, None] * stride_o + kk[None, :], z, mask=m2)
            zf = z.to(tl.float32)
            ss += tl.sum(zf * zf, axis=1)
            dt = tl.load(DW + rr[None, :] * d + kk[:, None], mask=(kk < d)[:, None] & rrmask[None, :], other=0.0)
            acc += tl.dot(z.to(w_dtype), dt.to(w_dtype))
        for l in range(0, depth):
            h = acc * tl.rsqrt(ss / d + eps)[:, None]
            a = (h * tl.sigmoid(h)).to(w_dtype)  # (BT, BR): SiLU output, kept in registers
            acc = tl.zeros((BT, BR), dtype=tl.float32)
            ss = tl.zeros((BT,), dtype=tl.float32)
            u_base = UW + l * d * r
            d_next = DW + (l + 1) * r * d
            for k0 in range(0, d, BK):
                kk = k0 + tl.arange(0, BK)
                kmask = kk < d
                m2 = rmask[:, None] & kmask[None, :]
                z = tl.load(OUT + rows[:, None] * stride_o + kk[None, :], mask=m2, other=0.0).to(tl.float32)
                ut = tl.load(u_base + kk[None, :] * r + rr[:, None], mask=rrmask[:, None] & kmask[None, :],
                             other=0.0)  # (BR, BK) = U'_l[kk, :]^T
                z = z + tl.dot(a, ut.to(w_dtype))
                if l + 1 < depth:
                    zs = z.to(OUT.dtype.element_ty)
                    tl.store(OUT + rows[:, None] * stride_o + kk[None, :], zs, mask=m2)
                    zf = zs.to(tl.float32)
                    ss += tl.sum(zf * zf, axis=1)
                    dt = tl.load(d_next + rr[None, :] * d + kk[:, None], mask=kmask[:, None] & rrmask[None, :],
                                 other=0.0)
                    acc += tl.dot(zs.to(w_dtype), dt.to(w_dtype))
                else:
                    x = tl.load(X + rows[:, None] * stride_x + kk[None, :], mask=m2, other=0.0).to(tl.float32)
                    tl.store(OUT + rows[:, None] * stride_o + kk[None, :], (z - x).to(OUT.dtype.element_ty),
                             mask=m2)


def fold(D: Tensor, U: Tensor, norm: Tensor, alpha: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """D' = D diag(w) (depth, r, d) and U' = a U (depth, d, r), contiguous, in the kernel's weight dtype."""
    with torch.no_grad():
        Dp = (D * norm[:, None, :]).to(dtype).contiguous()
        Up = (U * alpha[:, None, None]).to(dtype).contiguous()
    return Dp, Up


def _block_sizes(T: int, d: int, r: int) -> tuple[int, int, int, int]:
    BR = max(16, triton.next_power_of_2(r))
    # keep the (BT x BR) fp32 accumulator and activations within a register budget
    BT = 16 if BR >= 512 or T <= 16 else 32 if BR >= 256 or T <= 64 else 64
    BK = 64 if BR <= 256 else 32
    num_warps = 8 if BT * BR >= 8192 else 4
    return BT, BK, BR, num_warps


def dlr_forward(x: Tensor, Dp: Tensor, Up: Tensor, eps: float, out: Tensor | None = None) -> Tensor:
    """The DLR-Net delta DLR(x) - x with folded weights (see `fold`). x: (..., d), any float dtype.
    CUDA tensors run the compiled kernel; CPU tensors need TRITON_INTERPRET=1 set before triton is
    first imported (Triton's interpreter: slow, for checking correctness)."""
    if not HAVE_TRITON:
        raise RuntimeError("the fused DLR path needs the triton package")
    shape = x.shape
    depth, r, d = Dp.shape
    x2 = x.reshape(-1, d)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    T = x2.shape[0]
    if out is None:
        out = torch.empty_like(x2)
    elif out.shape != x2.shape or out.dtype != x2.dtype or out.stride(-1) != 1:
        raise ValueError(f"out must be a ({T}, {d}) {x2.dtype} tensor with unit last stride")
    if T == 0:
        return out.reshape(shape)
    BT, BK, BR, num_warps = _block_sizes(T, d, r)
    grid = (triton.cdiv(T, BT),)
    if not x2.is_cuda and not interpreting():
        raise RuntimeError("the fused DLR kernel runs on CUDA, or on the CPU under TRITON_INTERPRET=1")
    _dlr_forward_kernel[grid](x2, out, Dp, Up, T, d, r, depth, x2.stride(0), out.stride(0), eps,
                              BT=BT, BK=BK, BR=BR, DOT_F32=not x2.is_cuda, num_warps=num_warps)
    return out.reshape(shape)
