"""The fused Triton forward of the DLR-Net, each of its schedules (cols, gemm) and tile settings other than the
defaults (the sum of squares from the up product's epilogue, small tiles), checked against the PyTorch
module's own forward in float64 through Triton's CPU interpreter (a subprocess: TRITON_INTERPRET must be set
before triton is first imported). The reference is `net._delta`, the autograd path: under no_grad the module
itself would pick the kernel."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

SCRIPT = r"""
import json, torch
from mlpsurgery.modules.dlr import DLRNet
from mlpsurgery.kernels.dlr_triton import PATHS, choose_path, dlr_forward, fold
VARIANTS = [("gemm, sum of squares in the up epilogue", "gemm", {"SS_EPI": True}),
            ("gemm, sum of squares in the down product", "gemm", {"SS_EPI": False}),
            ("gemm, small tiles", "gemm", {"SS_EPI": True, "BM": 32, "BN_down": 16, "BK_down": 32, "BN_up": 32,
                                           "BK_up": 16}),
            ("cols, 32 columns per program", "cols", {"BK": 32, "num_warps": 4})]
out = []
# odd sizes: rows, columns and ranks that fill no tile; several row tiles (130 rows), several rank tiles (r = 160)
for seed, (T, d, r, depth, dtype) in enumerate([(37, 64, 16, 3, "float32"), (5, 96, 24, 4, "float32"),
                                              (70, 128, 32, 2, "bfloat16"), (16, 64, 8, 5, "bfloat16"),
                                              (130, 48, 40, 2, "float32"), (66, 32, 160, 1, "float32")]):
    torch.manual_seed(seed)
    dt = getattr(torch, dtype)
    net = DLRNet(d, r, depth)
    with torch.no_grad():
        net.alpha.normal_()  # a trained-looking net, not the identity
        net.norm.uniform_(0.5, 1.5)
    x = torch.randn(T, d)
    with torch.no_grad():
        ref = net.double()._delta(x.double())  # float64 reference: PyTorch's forward
        torch_dt = net.to(dt)._delta(x.to(dt)).double()
        net.float()
        Dp, Up = fold(net.D, net.U, net.norm, net.alpha, dt)
        fused = {}
        for path in PATHS:
            poison = torch.full((T, d), float("nan"), dtype=dt)  # every element must be written
            fused[path] = dlr_forward(x.to(dt), Dp, Up, net.eps, out=poison, path=path).double()
        for name, path, tiles in VARIANTS:  # tile settings other than the defaults (the GPU sweep's options)
            poison = torch.full((T, d), float("nan"), dtype=dt)
            fused[name] = dlr_forward(x.to(dt), Dp, Up, net.eps, out=poison, path=path, tiles=tiles).double()
        net.to(dt)
        auto = net(x.to(dt)).double()  # DLRNet.forward picks the fused path itself under no_grad
    with torch.enable_grad():  # training: the exact autograd path, never the kernel
        train = net(x.to(dt))
        train_exact = bool(train.grad_fn is not None and torch.equal(train, net._delta(x.to(dt))))
    net.float()
    tangent = torch.randn(T, d)
    with torch.no_grad():  # forward-mode AD under no_grad: the kernel would drop the tangent, PyTorch must run
        _, jvp_auto = torch.func.jvp(net, (x,), (tangent,))
        _, jvp_ref = torch.func.jvp(net._delta, (x,), (tangent,))
        import torch.autograd.forward_ad as fwAD
        with fwAD.dual_level():
            fw_auto = fwAD.unpack_dual(net(fwAD.make_dual(x, tangent))).tangent
    jvp_exact = bool(torch.equal(jvp_auto, jvp_ref) and fw_auto is not None and torch.equal(fw_auto, jvp_ref))
    net.to(dt)
    rel = lambda a: float((a - ref).norm() / ref.norm())
    out.append({"shape": [T, d, r, depth], "dtype": dtype, "torch": rel(torch_dt), "auto": rel(auto),
                "fused": {p: rel(f) for p, f in fused.items()}, "chosen": choose_path(T, d, r),
                "finite": {p: bool(torch.isfinite(f).all()) for p, f in fused.items()},
                "train_exact": train_exact, "jvp_exact": jvp_exact})
print("RESULT" + json.dumps(out))
"""


def test_fused_forward_matches_pytorch_in_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(r.stdout.split("RESULT", 1)[1])
    assert {row["chosen"] for row in rows} == {"cols", "gemm"}  # both automatic schedules are among the cases
    for row in rows:
        for path, err in row["fused"].items():
            assert row["finite"][path], (path, row)
            if row["dtype"] == "float32":
                assert err < 1e-5, (path, row)
            else:  # bf16 operands: within bf16 tolerance, and no worse than PyTorch's own bf16 path by much
                assert err < 2e-2 and err < 2 * row["torch"] + 1e-3, (path, row)
        # the module under no_grad runs the schedule choose_path picks
        assert row["auto"] == pytest.approx(row["fused"][row["chosen"]], rel=1e-6, abs=1e-9), row
        assert row["train_exact"], row  # with grad enabled the module runs PyTorch autograd, not the kernel
        assert row["jvp_exact"], row  # under jvp / forward AD too (the kernel has no tangent)


def test_unknown_tile_settings_are_refused():
    from mlpsurgery.kernels.dlr_triton import COLS_TILES, GEMM_TILES, _tiles

    assert _tiles(GEMM_TILES, {"SS_EPI": True})["SS_EPI"] is True
    for defaults in (COLS_TILES, GEMM_TILES):
        with pytest.raises(ValueError, match="unknown tile settings"):
            _tiles(defaults, {"NCOPY": 4})
