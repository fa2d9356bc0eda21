"""Issue 45, tried in session 34: NSN's down projection nested from the lowest trained rank up (greedy), instead of
one least-squares map pooled over the ranks and factorised once (`nsn/local.py` `refit_down_nested_`).

The gate / up of a nested MLP at rank r are the whitened truncations the `svd` baseline uses at that rank, so the two
differ only in the down projection: the baseline's is the reduced-rank regression (RRR) on the rank-r inner
activations, one per rank; NSN's must be one nested set of factors. Greedy: at the lowest trained rank r_1 the
prefix is exactly the baseline's RRR; at each next rank r_k the r_k - r_(k-1) new components are the RRR of what
the prefix leaves, on the rank-r_k activations (the last stage keeps every component of its fit, for the ranks
above). Patches the library in this process and runs the CLI with the arguments given:

    python benchmarks/notes/prototype_nsn_greedy_down.py compare smollm2 --out runs/proto/nsn-greedy --methods nsn \
        --nsn-refit --budgets 0.75,0.5,0.33 --max-tokens 2048 --threads 2 --repeats 1 --no-models

Answer (docs/notes/calibration.md, session 34): 67.79 / 93.68 / 137.53 at 0.75 / 0.5 / 0.33 against the pooled
refit's 56.57 / 84.20 / 147.68 and the fixed-rank SVD's 56.66 / 80.10 / 112.16: not built in."""
import os
import sys

import torch

import mlpsurgery.methods.nsn.local as L
from mlpsurgery.methods.reconstruct.layer import mlp_inputs
from mlpsurgery.methods.reconstruct.refit import fit_error, solve_down
from mlpsurgery.methods.reconstruct.whiten import whitened_factors
from mlpsurgery.modules.nested import NestedLinear

EVERY = int(os.environ.get("EVERY", "1"))  # rows per rank: every EVERY-th (1: all)
RIDGE = float(os.environ.get("RIDGE", str(L.NSN_REFIT_RIDGE)))


def refit_down_greedy_(site, nested, target, x, ranks):
    down = site.linears()["down"]
    stats, before = L.rank_stats(site, nested, target, mlp_inputs(site, x), ranks, EVERY)
    d, h = down.out_features, down.in_features
    R = down.max_rank
    Bs, As = [], []
    P = torch.zeros(d, h, dtype=torch.float64)
    bias = None
    prev = 0
    for k, (r, st) in enumerate(zip(ranks, stats)):
        AY = st.AY - st.G @ P.T
        if bias is not None:
            AY = AY - st.a_sum[:, None] * bias[None, :]
        res = type(st)(st.G, AY, st.a_sum, st.y_sum - (P @ st.a_sum if bias is None else P @ st.a_sum + st.n * bias),
                       st.yy, st.n)
        D, b = solve_down(res, down.bias is not None and k == 0, RIDGE)
        if b is not None:
            bias = b
        B, A, _ = whitened_factors(D, st.G / st.n)
        m = (R - prev) if k == len(ranks) - 1 else (r - prev)
        m = min(m, B.shape[1])
        Bs.append(B[:, :m])
        As.append(A[:m])
        P = P + B[:, :m] @ A[:m]
        prev += m
    B = torch.cat(Bs, 1)  # the last stage holds the remaining R - prev components
    A = torch.cat(As, 0)
    new = NestedLinear.from_factors(B[:, :R], A[:R], bias, dense_class=down.dense_class, like=down.B.detach())
    site.replace_linear("down", new)
    with torch.no_grad():
        after = [fit_error(st, new.weight_at(r), None if bias is None else new.bias) for r, st in zip(ranks, stats)]
    print("greedy", [f"{a:.4f}" for a in before], "->", [f"{a:.4f}" for a in after], file=sys.stderr)
    return {"error_before": before, "error_after": after}


if os.environ.get("GREEDY", "1") == "1":
    L.refit_down_nested_ = refit_down_greedy_
from mlpsurgery.cli import main  # noqa: E402

sys.exit(main(sys.argv[1:]))
