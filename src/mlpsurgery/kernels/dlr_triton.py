"""The fused inference forward of the DLR-Net in Triton (CUDA for speed; `TRITON_INTERPRET=1` runs it on the
CPU for correctness checks).

Per block l the network computes  z <- z + a_l U_l silu(D_l (w_l * z / rms(z))).  Every path folds the RMSNorm
weight into the down projection (D'_l = D_l diag(w_l)) and the ReZero scalar into the up projection
(U'_l = a_l U_l), once per weight version, and uses  D_l (w_l * z / rms(z)) = (D'_l z) / rms(z):  the row scale
1/rms(z) comes from a sum of squares taken while z streams through the down projection anyway. The result is the
module's delta DLR(x) - x. Two schedules of that arithmetic, chosen by the number of rows T (`choose_path`):

- **cols** (few rows, e.g. decoding): the weights are what must stream, at full bandwidth, so each block's work is
  split over the *columns* d across all multiprocessors: program j owns columns j*BK.. of the residual, adds
  U'_l[cols] silu(h_l) to them and, in the same pass, accumulates its share of the next block's down projection
  h_{l+1} += z[:, cols] D'_{l+1}[:, cols]^T and sum of squares (fp32 atomics into a per-block buffer). One
  launch per block (depth + 1 in all; CUDA-graph replay removes their launch cost), every weight read once.
- **gemm** (many rows, e.g. prefill): two matrix products per block with the elementwise work in their
  epilogues: down  A = silu((Z D'^T) / rms(Z))  (the sum of squares from the Z tiles the product loads, or -- at
  larger ranks, where it is faster -- added up by the previous block's up epilogue) and up  Z += A U'^T  (the
  residual add in the epilogue; the last block subtracts x). Large row tiles reuse each weight
  tile across 64-128 rows on the tensor cores; the residual moves three times per block (read, read + write).

The first design (one launch running every block for a tile of rows, the activations kept in registers) was
measured on an H100 and removed: every tile of rows streams every block's weights, so it lost to cols at few rows
(10x at T = 16) and to gemm at many (2.8x at T = 8192); see docs/dlr-gpu.md.

Training never uses these paths: autograd needs the stored activations, and locking must not get cheaper.
float32 weights run their products in IEEE float32 (`input_precision="ieee"`), never silently in TF32.
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

PATHS = ("cols", "gemm")
COLS_MAX_T = 16  # at most this many rows: cols; more: gemm. Measured on an H100 (docs/notes/dlr-gpu.md, "Schedules"):
# cols fastest at T = 16 on all three shapes, gemm at T >= 64; at T = 32 it depends on the shape


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
    CUDA (or the interpreter) with triton, the weights on x's device, outside torch.compile and outside any
    forward-mode or functorch differentiation of the input or the weights (the kernel has no tangent)."""
    params = (net.D, net.U, net.norm, net.alpha)
    if not available(x) or torch.compiler.is_compiling() or any(_differentiated(t) for t in (x, *params)):
        return None
    if any(t.device != x.device for t in params):  # PyTorch's own forward says which tensor is where
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


def fold(D: Tensor, U: Tensor, norm: Tensor, alpha: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """D' = D diag(w) (depth, r, d) and U' = a U (depth, d, r), contiguous, in the kernel's weight dtype."""
    with torch.no_grad():
        Dp = (D * norm[:, None, :]).to(dtype).contiguous()
        Up = (U * alpha[:, None, None]).to(dtype).contiguous()
    return Dp, Up


if HAVE_TRITON:
    # Common constexprs: W_F32 runs the products on fp32 operands (the CPU interpreter's bf16 tl.dot is wrong,
    # and fp32 weights must stay fp32); PREC is tl.dot's input_precision ("ieee" for fp32 operands, never TF32).

    @triton.jit
    def _cols_down(Z, DWl, Hn, SSn, rows, rmask, kk, kmask, d, r,
                   BR: tl.constexpr, NRC: tl.constexpr, W_F32: tl.constexpr, PREC: tl.constexpr):
        """This program's share of a block's down projection and sum of squares, from its (BT, BK) tile Z of the
        stored residual: Hn[rows] += Z DWl[:, kk]^T and SSn[rows] += sum Z^2 (fp32 atomics)."""
        w_dtype = tl.float32 if W_F32 else DWl.dtype.element_ty
        zf = Z.to(tl.float32)
        tl.atomic_add(SSn + rows, tl.sum(zf * zf, axis=1), mask=rmask)
        zw = Z.to(w_dtype)
        for r0 in range(0, NRC * BR, BR):  # NRC chunks of the rank (a constexpr bound: triton 3.6's interpreter
            # cannot take a runtime bound in a nested function)
            rr = r0 + tl.arange(0, BR)
            rrmask = rr < r
            dt = tl.load(DWl + rr[None, :] * d + kk[:, None], mask=kmask[:, None] & rrmask[None, :], other=0.0)
            tl.atomic_add(Hn + rows[:, None] * r + rr[None, :], tl.dot(zw, dt.to(w_dtype), input_precision=PREC),
                          mask=rmask[:, None] & rrmask[None, :])

    @triton.jit
    def _cols_first_kernel(X, OUT, DW, H, SS, T, d, r, stride_x, stride_o,
                           BT: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr, NRC: tl.constexpr,
                           W_F32: tl.constexpr, PREC: tl.constexpr):
        """Copy x's tile into the residual and accumulate block 0's down projection (H[0], SS[0])."""
        rows = tl.program_id(0) * BT + tl.arange(0, BT)
        rmask = rows < T
        kk = tl.program_id(1) * BK + tl.arange(0, BK)
        kmask = kk < d
        m2 = rmask[:, None] & kmask[None, :]
        z = tl.load(X + rows[:, None] * stride_x + kk[None, :], mask=m2, other=0.0)
        tl.store(OUT + rows[:, None] * stride_o + kk[None, :], z, mask=m2)
        _cols_down(z, DW, H, SS, rows, rmask, kk, kmask, d, r, BR, NRC, W_F32, PREC)

    @triton.jit
    def _cols_block_kernel(X, OUT, DW, UW, H, SS, T, d, r, l, depth, stride_x, stride_o, eps,
                           BT: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr, NRC: tl.constexpr,
                           W_F32: tl.constexpr, PREC: tl.constexpr):
        """Block l on this program's columns: z[:, kk] += U'_l[kk] silu(H[l] / rms) and, unless l is the last
        block, block l+1's down projection share (H[l+1], SS[l+1]); the last block stores z - x."""
        rows = tl.program_id(0) * BT + tl.arange(0, BT)
        rmask = rows < T
        kk = tl.program_id(1) * BK + tl.arange(0, BK)
        kmask = kk < d
        m2 = rmask[:, None] & kmask[None, :]
        w_dtype = tl.float32 if W_F32 else DW.dtype.element_ty
        scale = tl.rsqrt(tl.load(SS + l * T + rows, mask=rmask, other=0.0) / d + eps)
        z = tl.load(OUT + rows[:, None] * stride_o + kk[None, :], mask=m2, other=0.0).to(tl.float32)
        u_base = UW + l * d * r
        for r0 in range(0, r, BR):
            rr = r0 + tl.arange(0, BR)
            rrmask = rr < r
            h = tl.load(H + l * T * r + rows[:, None] * r + rr[None, :], mask=rmask[:, None] & rrmask[None, :],
                        other=0.0) * scale[:, None]
            a = (h * tl.sigmoid(h)).to(w_dtype)
            ut = tl.load(u_base + kk[None, :] * r + rr[:, None], mask=rrmask[:, None] & kmask[None, :], other=0.0)
            z += tl.dot(a, ut.to(w_dtype), input_precision=PREC)
        if l + 1 < depth:
            zs = z.to(OUT.dtype.element_ty)
            tl.store(OUT + rows[:, None] * stride_o + kk[None, :], zs, mask=m2)
            _cols_down(zs, DW + (l + 1) * r * d, H + (l + 1) * T * r, SS + (l + 1) * T, rows, rmask, kk, kmask,
                       d, r, BR, NRC, W_F32, PREC)
        else:
            x = tl.load(X + rows[:, None] * stride_x + kk[None, :], mask=m2, other=0.0).to(tl.float32)
            tl.store(OUT + rows[:, None] * stride_o + kk[None, :], (z - x).to(OUT.dtype.element_ty), mask=m2)

    @triton.jit
    def _out_tile(T, n, BM: tl.constexpr, BN: tl.constexpr):
        """This program's (BM, BN) tile of a (T, n) output: its rows, columns and their masks. Programs of one row
        tile are adjacent in launch order, so they share that row tile's input in L2."""
        pid = tl.program_id(0)
        n_tiles = tl.cdiv(n, BN)
        rows = (pid // n_tiles) * BM + tl.arange(0, BM)
        cols = (pid % n_tiles) * BN + tl.arange(0, BN)
        return rows, cols, rows < T, cols < n

    @triton.jit
    def _gemm_down_kernel(Z, A, DW, SS, T, d, r, l, stride_z, eps,
                          BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SS_FROM_Z: tl.constexpr,
                          W_F32: tl.constexpr, PREC: tl.constexpr):
        """A[rows, cols] = silu((Z D'_l^T)[rows, cols] / rms(Z[rows])), the sum of squares taken from the Z tiles
        the product loads (SS_FROM_Z) or read from SS[l] (written by the previous block's up epilogue)."""
        rows, cols, rmask, cmask = _out_tile(T, r, BM, BN)
        w_dtype = tl.float32 if W_F32 else DW.dtype.element_ty
        dw = DW + l * r * d
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        ss = tl.zeros((BM,), dtype=tl.float32)
        for k0 in range(0, d, BK):
            kk = k0 + tl.arange(0, BK)
            kmask = kk < d
            z = tl.load(Z + rows[:, None] * stride_z + kk[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
            if SS_FROM_Z:
                zf = z.to(tl.float32)
                ss += tl.sum(zf * zf, axis=1)
            dt = tl.load(dw + cols[None, :] * d + kk[:, None], mask=kmask[:, None] & cmask[None, :], other=0.0)
            acc += tl.dot(z.to(w_dtype), dt.to(w_dtype), input_precision=PREC)
        if not SS_FROM_Z:
            ss = tl.load(SS + l * T + rows, mask=rmask, other=0.0)
        h = acc * tl.rsqrt(ss / d + eps)[:, None]
        tl.store(A + rows[:, None] * r + cols[None, :], (h * tl.sigmoid(h)).to(A.dtype.element_ty),
                 mask=rmask[:, None] & cmask[None, :])

    @triton.jit
    def _gemm_up_kernel(ZSRC, X, OUT, A, UW, SS, T, d, r, l, stride_zs, stride_x, stride_o,
                        LAST: tl.constexpr, SS_OUT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                        BK: tl.constexpr, W_F32: tl.constexpr, PREC: tl.constexpr):
        """OUT[rows, cols] = ZSRC[rows, cols] + A[rows] U'_l[cols]^T, minus x after the last block; with SS_OUT
        this tile's share of the next block's sum of squares (of the stored values) added to SS[l + 1]."""
        rows, cols, rmask, cmask = _out_tile(T, d, BM, BN)
        m2 = rmask[:, None] & cmask[None, :]
        w_dtype = tl.float32 if W_F32 else UW.dtype.element_ty
        uw = UW + l * d * r
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, r, BK):
            kk = k0 + tl.arange(0, BK)
            kmask = kk < r
            a = tl.load(A + rows[:, None] * r + kk[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
            ut = tl.load(uw + cols[None, :] * r + kk[:, None], mask=kmask[:, None] & cmask[None, :], other=0.0)
            acc += tl.dot(a.to(w_dtype), ut.to(w_dtype), input_precision=PREC)
        z = tl.load(ZSRC + rows[:, None] * stride_zs + cols[None, :], mask=m2, other=0.0).to(tl.float32) + acc
        if LAST:
            z -= tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=m2, other=0.0).to(tl.float32)
        zs = z.to(OUT.dtype.element_ty)
        tl.store(OUT + rows[:, None] * stride_o + cols[None, :], zs, mask=m2)
        if SS_OUT:
            zf = tl.where(m2, zs.to(tl.float32), 0.0)
            tl.atomic_add(SS + (l + 1) * T + rows, tl.sum(zf * zf, axis=1), mask=rmask)


def choose_path(T: int, d: int, r: int) -> str:
    """The schedule for T rows (see the module docstring): few rows stream the weights across every
    multiprocessor (cols), many rows run two tiled products per block (gemm)."""
    return "cols" if T <= COLS_MAX_T else "gemm"


def _pow2(n: int, lo: int = 16) -> int:
    return max(lo, triton.next_power_of_2(n))


# Tile settings of each schedule; `dlr_forward(..., tiles=...)` overrides any of them. The defaults come from
# benchmarks/dlr_gpu_tune.py on an H100 (docs/notes/dlr-gpu.md, "Tile settings"): a value of 0 / None is chosen by shape
# from that sweep. cols: BK columns per program (d / BK programs; 0: 64 at d >= 4096, 32 at d >= 2048, else 16),
# num_warps (8 was faster than 4 for every BK tried). gemm: the row tile BM (0: 128 from 2,048 rows on, else 64),
# each product's BN x BK tile (BN_down 0: 256 at r >= 1024 in 16-bit weights, 64 below 2,048 rows, else 128) and
# warps (0: 8 for tiles of 128 x 128 and larger, else 4), the pipeline's stages (0: 3, 2 for float32 weights), and
# SS_EPI (None: from r >= 512 on): the next block's sum of squares added up in the up product's epilogue instead of
# recomputed from the Z tiles the down product loads (faster at r = 1024, slower at r = 256, where the epilogue's
# atomics weigh more than the down product's extra work).
COLS_TILES = {"BK": 0, "num_warps": 8}
GEMM_TILES = {"BM": 0, "BN_down": 0, "BK_down": 64, "warps_down": 0, "BN_up": 128, "BK_up": 64, "warps_up": 0,
              "stages": 0, "SS_EPI": None}


def _tiles(defaults: dict, tiles: dict | None) -> dict:
    unknown = set(tiles or ()) - set(defaults)
    if unknown:
        raise ValueError(f"unknown tile settings {sorted(unknown)}; known: {sorted(defaults)}")
    return {**defaults, **(tiles or {})}


def _cols(x2, out, Dp, Up, eps, opts, tiles=None):
    t = _tiles(COLS_TILES, tiles)
    depth, r, d = Dp.shape
    T = x2.shape[0]
    BT = min(64, _pow2(T))
    BK = t["BK"] or (64 if d >= 4096 else 32 if d >= 2048 else 16)  # d / BK programs per row tile
    BR = min(_pow2(r), max(16, 8192 // BT))  # the (BT x BR) fp32 partial product within a register budget
    H = torch.zeros(depth, T, r, dtype=torch.float32, device=x2.device)
    SS = torch.zeros(depth, T, dtype=torch.float32, device=x2.device)
    grid = (triton.cdiv(T, BT), triton.cdiv(d, BK))
    kw = dict(BT=BT, BK=BK, BR=BR, NRC=triton.cdiv(r, BR), num_warps=t["num_warps"], **opts)
    _cols_first_kernel[grid](x2, out, Dp, H, SS, T, d, r, x2.stride(0), out.stride(0), **kw)
    for l in range(depth):
        _cols_block_kernel[grid](x2, out, Dp, Up, H, SS, T, d, r, l, depth, x2.stride(0), out.stride(0), eps, **kw)


def _gemm(x2, out, Dp, Up, eps, opts, tiles=None):
    t = _tiles(GEMM_TILES, tiles)
    depth, r, d = Dp.shape
    T = x2.shape[0]
    A = torch.empty(T, r, dtype=Dp.dtype, device=x2.device)
    ss_epi = r >= 512 if t["SS_EPI"] is None else bool(t["SS_EPI"])
    SS = torch.zeros(depth if ss_epi else 1, T, dtype=torch.float32, device=x2.device)
    stages = t["stages"] or (2 if Dp.dtype == torch.float32 else 3)
    BM = t["BM"] or (128 if T >= 2048 else 64)
    wide = r >= 1024 and Dp.element_size() == 2  # (float32 weights' 256-wide tiles would not fit shared memory)
    BN_down = min(t["BN_down"] or (256 if wide else 64 if T < 2048 else 128), _pow2(r))
    BK_down = min(t["BK_down"], _pow2(d))
    BN_up, BK_up = min(t["BN_up"], _pow2(d)), min(t["BK_up"], _pow2(r))
    warps_down = t["warps_down"] or (8 if BM * BN_down >= 16384 else 4)
    warps_up = t["warps_up"] or (8 if BM * BN_up >= 16384 else 4)
    down_grid = (triton.cdiv(T, BM) * triton.cdiv(r, BN_down),)
    up_grid = (triton.cdiv(T, BM) * triton.cdiv(d, BN_up),)
    for l in range(depth):
        src = x2 if l == 0 else out
        _gemm_down_kernel[down_grid](src, A, Dp, SS, T, d, r, l, src.stride(0), eps, BM=BM, BN=BN_down, BK=BK_down,
                                     SS_FROM_Z=l == 0 or not ss_epi, num_warps=warps_down, num_stages=stages, **opts)
        last = l == depth - 1
        _gemm_up_kernel[up_grid](src, x2, out, A, Up, SS, T, d, r, l, src.stride(0), x2.stride(0), out.stride(0),
                                 LAST=last, SS_OUT=ss_epi and not last, BM=BM, BN=BN_up, BK=BK_up,
                                 num_warps=warps_up, num_stages=stages, **opts)


_RUN = {"cols": _cols, "gemm": _gemm}


def dlr_forward(x: Tensor, Dp: Tensor, Up: Tensor, eps: float, out: Tensor | None = None,
                path: str | None = None, tiles: dict | None = None) -> Tensor:
    """The DLR-Net delta DLR(x) - x with folded weights (see `fold`). x: (..., d), any float dtype; `path` one
    of PATHS (default: `choose_path`); `tiles` overrides the path's tile settings (COLS_TILES / GEMM_TILES).
    CUDA tensors run the compiled kernels; CPU tensors need TRITON_INTERPRET=1 set before triton is first
    imported (Triton's interpreter: slow, for checking correctness)."""
    if not HAVE_TRITON:
        raise RuntimeError("the fused DLR path needs the triton package")
    shape = x.shape
    depth, r, d = Dp.shape
    x2 = x.reshape(-1, d)
    if x2.stride(-1) != 1 or x2.stride(0) != d:
        x2 = x2.contiguous()
    T = x2.shape[0]
    if out is None:
        out = torch.empty_like(x2)
    elif out.shape != x2.shape or out.dtype != x2.dtype or out.stride(-1) != 1:
        raise ValueError(f"out must be a ({T}, {d}) {x2.dtype} tensor with unit last stride")
    elif out.data_ptr() == x2.data_ptr():  # the last block subtracts x, which the first would have overwritten
        raise ValueError("out must not share memory with x")
    if T == 0:
        return out.reshape(shape)
    if not x2.is_cuda and not interpreting():
        raise RuntimeError("the fused DLR kernel runs on CUDA, or on the CPU under TRITON_INTERPRET=1")
    path = path or choose_path(T, d, r)
    if path not in _RUN:
        raise ValueError(f"path must be one of {PATHS}, not {path!r}")
    w_f32 = not x2.is_cuda or Dp.dtype == torch.float32
    _RUN[path](x2, out, Dp, Up, eps, {"W_F32": w_f32, "PREC": "ieee" if w_f32 else "tf32"}, tiles)
    return out.reshape(shape)
