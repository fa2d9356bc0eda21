"""Issue 45, tried in session 28: neurons chosen in the metric of the downstream loss. The refit's least squares is the
same in any metric on the MLP's output (each output column is solved alone), but which neurons are kept is not: the
output-energy score RMS(a_j) * ||W_down[:, j]|| becomes RMS(a_j) * sqrt(W_down[:, j]^T F W_down[:, j]), with F the
Fisher of the LM loss with respect to that MLP's output (E[g g^T] over calibration tokens, g the loss gradient at the
residual stream after the MLP), measured once on the original model.

    python benchmarks/notes/prototype_fisher_metric.py fisher runs/proto/fisher.pt          # F per layer, 64 x 128 tokens
    FISHER=runs/proto/fisher.pt FKIND=diag python benchmarks/notes/prototype_fisher_metric.py compare smollm2 \
        --out runs/proto/f1 --methods neuron --budgets 0.5 --max-tokens 2048 --threads 2 --repeats 1 --no-models

FKIND: diag (F's diagonal) or full (576 x 576)."""
import os, sys, torch

if sys.argv[1] == "fisher":
    import mlpsurgery as ms
    from mlpsurgery.sites import find_sites
    torch.set_num_threads(2)
    L = ms.load_model()
    model = L.model.float().eval()
    sites = find_sites(model)
    blocks = ms.text_blocks(None, L.tokenizer, block_len=128, max_blocks=int(os.environ.get("FBLOCKS", "64")), seed=1)
    outs = {}
    def hook(i):
        def h(mod, args, out):
            out.retain_grad(); outs[i] = out
        return h
    hs = [s.module.register_forward_hook(hook(s.index)) for s in sites.mlp]
    d = model.config.hidden_size
    F = {s.index: torch.zeros(d, d, dtype=torch.float64) for s in sites.mlp}
    n = 0
    for p in model.parameters():
        p.requires_grad_(False)
    for b in range(0, len(blocks), 4):
        ids = blocks[b:b + 4]
        model.get_input_embeddings().weight.requires_grad_(True)
        out = model(input_ids=ids, labels=ids)
        (out.loss * ids[:, 1:].numel()).backward()  # sum over tokens: per-token gradients
        for i, o in outs.items():
            g = o.grad.reshape(-1, d).double()
            F[i] += g.T @ g
        n += ids.numel()
        outs.clear()
        print(b, float(out.loss), flush=True)
    for h in hs:
        h.remove()
    torch.save({i: f / n for i, f in F.items()}, sys.argv[2])
    sys.exit(0)

import mlpsurgery.methods.fusion as FU
import mlpsurgery.methods.fusion.compress as C
FISH = torch.load(os.environ["FISHER"])
KIND = os.environ.get("FKIND", "diag")
CUR = {"i": None}
orig_cs = FU.compress_site
def cs(site, k, cfg, gen, **kw):
    CUR["i"] = site.index
    try:
        return orig_cs(site, k, cfg, gen, **kw)
    finally:
        CUR["i"] = None
FU.compress_site = cs
orig_imp = C._importance
def _importance(w, x, kind="activation"):
    if x is None or CUR["i"] is None or kind != "output":
        return orig_imp(w, x, kind)
    F = FISH[CUR["i"]]
    D = w.down.double()
    if KIND == "diag":
        q = (F.diagonal()[:, None] * D * D).sum(0)
    else:
        q = ((F @ D) * D).sum(0)
    base = orig_imp(w, x, kind) / w.down.float().norm(dim=0).clamp_min(1e-30)
    return base * q.clamp_min(0).sqrt().float()
C._importance = _importance
from mlpsurgery.cli import main
sys.exit(main(sys.argv[1:]))
