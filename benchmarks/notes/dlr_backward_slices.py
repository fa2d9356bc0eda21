"""Session 32: the DLR-Nets' backward with the blocks' weight slices taken by indexing in the loop (D[:, l], as
before commit 'DLR-Nets: take the blocks' weight slices with one unbind') against one unbind per tensor (now), on
the lock's default phase-1 shape (one layer, r = 64, depth 36, 512 tokens) and the demo's (3 layers side by side,
r = 16, depth 140, 256 tokens). Same gradients (tests/test_dlr.py); the time of one forward + backward, 2 threads.

    python benchmarks/notes/dlr_backward_slices.py
"""
import time

import torch

from mlpsurgery.modules.dlr import StackedDLR, rms_norm

torch.set_num_threads(2)


def fwd_index(self, x):
    z = x
    for l in range(self.depth):
        h = rms_norm(z, self.eps) * self.norm[:, l, None, :]
        a = torch.nn.functional.silu(torch.bmm(h, self.D[:, l].transpose(1, 2)))
        z = z + self.alpha[:, l, None, None] * torch.bmm(a, self.U[:, l].transpose(1, 2))
    return z


for n, r, depth, T in ((1, 64, 36, 512), (3, 16, 140, 256)):
    net = StackedDLR(n, 576, r, depth)
    with torch.no_grad(): net.alpha.fill_(0.01)
    x = torch.randn(n, T, 576)
    for name, f in (("index (before)", lambda x: fwd_index(net, x)), ("unbind (now)", net.forward)):
        ts = []
        for rep in range(4):
            net.zero_grad(set_to_none=True)
            t0 = time.perf_counter(); f(x).pow(2).mean().backward(); ts.append(time.perf_counter() - t0)
        print(f"n={n} r={r} depth={depth} T={T} {name}: step fwd+bwd {sorted(ts)[1]:.3f} s")
