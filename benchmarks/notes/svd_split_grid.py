"""Issue 45, tried in session 27: how the whitened SVD baseline's weights are best split between gate / up and the
down projection. SmolLM2 layers 12, 20, 27 (original inputs, 64 x 128 calibration tokens): the MLP's relative output
error for (gate rank, up rank, down rank) at the same factored weights as rank 209 each (half the MLP), the down
projection the reduced-rank regression on the truncated gate / up; "shared": gate and up from one whitened input basis.

    python benchmarks/notes/svd_split_grid.py

Answer (docs/notes/calibration.md): (150, 150, 327) lowers each layer's error by 14-19% (0.255 -> 0.215 at layer 12),
a shared basis adds nothing; built as a per-layer search and measured on the frontier, perplexity did not follow
(commit e76303d, reverted)."""
import torch, mlpsurgery as ms
from mlpsurgery.methods.reconstruct.sequential import sequential
from mlpsurgery.methods.reconstruct.layer import mlp_inputs
from mlpsurgery.methods.reconstruct.whiten import whitened_factors
from mlpsurgery.sites import find_sites
torch.set_num_threads(2)
L = ms.load_model()
sites = find_sites(L.model)
calib = ms.text_blocks(None, L.tokenizer, block_len=128, max_blocks=64, seed=0)
def work(i, x):
    site = sites.mlp[i]; w = site.read()
    xin = mlp_inputs(site, x).double()
    keep = torch.ones(len(xin), dtype=torch.bool); keep[::128] = False  # drop pos0 from the error measure? keep all for fit
    C = (xin.T @ xin) / len(xin)
    Wg, Wu, Wd = w.gate.double(), w.up.double(), w.down.double()
    y = w.inner(xin.float()).double() @ Wd.T
    fg = whitened_factors(Wg, C); fu = whitened_factors(Wu, C)
    act = torch.nn.functional.silu
    def err(rg, ru, rd, shared=None):
        if shared is None:
            g = xin @ (fg[0][:, :rg] @ fg[1][:rg]).T; u = xin @ (fu[0][:, :ru] @ fu[1][:ru]).T
        else:
            # shared input subspace: top-r eigvecs of whitened [Wg;Wu]
            B, A, s = whitened_factors(torch.cat([Wg, Wu]), C)
            P = (B[:, :shared] @ A[:shared])
            g = xin @ P[:Wg.shape[0]].T; u = xin @ P[Wg.shape[0]:].T
        a = act(g) * u
        G = a.T @ a; AY = a.T @ y
        lam = 1e-3 * G.diagonal().mean()
        Dls = torch.linalg.solve(G + lam * torch.eye(len(G), dtype=G.dtype), AY).T  # (d,h)
        B, A, s = whitened_factors(Dls, G / len(a))
        yh = a @ (B[:, :rd] @ A[:rd]).T
        e = (yh - y)[keep].pow(2).sum() / y[keep].pow(2).sum()
        return float(e)
    tot = 3 * 209
    res = {}
    for rg, ru in [(209, 209), (180, 180), (150, 150), (120, 120), (104, 104), (80, 80)]:
        rd = tot - rg - ru
        res[(rg, ru, rd)] = err(rg, ru, rd)
    # shared: params r*576 + 2*1536*r + rd*2112 = 3*209*2112
    for rd in (327, 419):
        r = int((3 * 209 * 2112 - rd * 2112) / (576 + 2 * 1536))
        res[("shared", r, rd)] = err(0, 0, rd, shared=r)
    print(i, " ".join(f"{k}:{v:.3f}" for k, v in res.items()), flush=True)
sequential(L.model, calib, [12, 20, 27], work, progress=False)
