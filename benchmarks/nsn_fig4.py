"""The paper's Fig. 4 and Table 1 analogues on real data: an MLP classifier on frozen MiniLM sentence
embeddings of Reuters R8 (5,485 train / 2,189 test documents, 8 topics), whose hidden linears are
NestedLinear layers (the paper uses ImageNet embeddings of CIFAR-10).

    classifier:  x (384) -> NestedLinear(384, 256, R=64) -> GELU -> NestedLinear(256, 256, R=64) -> GELU -> Linear(256, 8)
    FLOPs per example at rank r: 2r(384+256) + 2r(256+256) + 2*256*8

Fig. 4: one NSN (uncertainty objective, curriculum, training ranks 1..64 in powers of two) evaluated at every
rank 1..64, against separately trained specialists of equal FLOPs at each of the 7 ranks: the same factored
network trained at that rank only, and a dense MLP (384 -> w -> w -> 8) whose width w gives the same FLOPs.
Table 1: training ranks {1, 4, 16, 64} only; anchor-only, two CEs (uniform / curriculum) and the
uncertainty objective (uniform / curriculum), scored at the highest rank, at the in-training ranks and at the
interpolated ranks {2, 3, 6, 8, 12, 24, 32, 48}. Three seeds each (mean +- std).
Also: learned log-variance per rank, containment heatmap, and the Prop. 1 bound against measured test loss.

    OMP_NUM_THREADS=1 flock -s /tmp/mlpsurgery.lock python benchmarks/nsn_fig4.py

Embeddings are cached under --work (runs/nsn/fig4). Plots go to docs/img/nsn_fig4*.png.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from tqdm.auto import tqdm

import harness
import mlpsurgery as ms
from mlpsurgery.methods import nsn
from mlpsurgery.modules.nested import NestedLinear
from mlpsurgery.report import table
from mlpsurgery.train import FitConfig, fit, step_rng

D, H, R = 384, 256, 64
FIG4_RANKS = (1, 2, 4, 8, 16, 32, 64)
ABL_TRAIN = (1, 4, 16, 64)
ABL_OOD = (2, 3, 6, 8, 12, 24, 32, 48)
VARIANTS = {  # name: (objective, sampling)
    "CE only (anchor)": ("anchor", "uniform"),
    "two CEs, uniform": ("two_ce", "uniform"),
    "two CEs, curriculum": ("two_ce", "curriculum"),
    "uncertainty, uniform": ("uncertainty", "uniform"),
    "uncertainty, curriculum (NSN)": ("uncertainty", "curriculum"),
}


def embeddings(work: Path) -> dict[str, torch.Tensor]:
    path = work / "r8_minilm.safetensors"
    if path.exists():
        return load_file(str(path))
    loaded = ms.load_model("minilm")
    train = ms.read_labelled("r8-train")
    test = ms.read_labelled("r8-test", classes=train.classes)
    out = {"xtr": ms.embed(loaded.model, loaded.tokenizer, train.texts, max_len=128),
           "xte": ms.embed(loaded.model, loaded.tokenizer, test.texts, max_len=128),
           "ytr": torch.tensor(train.labels), "yte": torch.tensor(test.labels)}
    save_file(out, str(path))
    return out


def nested_mlp(max_rank: int) -> nn.Module:
    return nn.Sequential(NestedLinear(D, H, max_rank), nn.GELU(), NestedLinear(H, H, max_rank), nn.GELU(), nn.Linear(H, 8))


def dense_mlp(width: int) -> nn.Module:
    return nn.Sequential(nn.Linear(D, width), nn.GELU(), nn.Linear(width, width), nn.GELU(), nn.Linear(width, 8))


def flops(r: int) -> int:
    return 2 * r * (D + H) + 2 * r * (H + H) + 2 * H * 8


def width_for(r: int) -> int:
    """Width w of the dense specialist with the FLOPs of the nested MLP at rank r: 2(384w + w^2 + 8w)."""
    target = flops(r) / 2
    return max(1, round((-(D + 8) + math.sqrt((D + 8) ** 2 + 4 * target)) / 2))


def main() -> None:
    ap = harness.parser(__doc__, print_json=True)
    ap.add_argument("--steps", type=int, default=800)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--log-var-lr", type=float, default=5e-2)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--work", default="runs/nsn/fig4")
    ap.add_argument("--img", default="docs/img")
    args = ap.parse_args()
    work, img = Path(args.work), Path(args.img)
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    E = embeddings(work)
    mu, sd = E["xtr"].mean(0), E["xtr"].std(0) + 1e-6
    xtr, xte = (E["xtr"] - mu) / sd, (E["xte"] - mu) / sd
    ytr, yte = E["ytr"], E["yte"]
    t_embed = time.perf_counter() - t0

    def task(model, seed):
        def loss(step):
            idx = torch.randint(0, len(xtr), (args.batch_size,), generator=step_rng(seed, step))
            return nn.functional.cross_entropy(model(xtr[idx]), ytr[idx])
        return loss

    def evaluate(model):
        def run():
            with torch.no_grad():
                logits = model(xte)
            return {"accuracy": float((logits.argmax(-1) == yte).float().mean()),
                    "loss": float(nn.functional.cross_entropy(logits, yte))}
        return run

    def fcfg(seed):
        return FitConfig(steps=args.steps, lr=args.lr, seed=seed, log_every=10**9)

    def train_nested(max_rank, ranks, objective, sampling, seed):
        torch.manual_seed(seed)
        model = nested_mlp(max_rank)
        cfg = nsn.NSNTrainConfig(ranks=ranks, objective=objective, sampling=sampling, log_var_lr=args.log_var_lr,
                                 fit=fcfg(seed))
        res = nsn.train_nsn(model, task(model, seed), cfg, progress=False)
        return model, res

    seeds = range(args.seeds)
    jobs = len(seeds) * (1 + 2 * len(FIG4_RANKS) + len(VARIANTS))
    bar = tqdm(total=jobs, desc="models")
    t1 = time.perf_counter()

    # ---- Fig. 4: one NSN vs specialists of equal FLOPs
    nsn_rows, logvars, fig4_models = [], [], []
    for s in seeds:
        model, res = train_nested(R, FIG4_RANKS, "uncertainty", "curriculum", s)
        nsn_rows.append(nsn.sweep(model, evaluate(model), range(1, R + 1), progress=False))
        logvars.append(res.log_var)
        fig4_models.append(model)
        bar.update()
    fixed, dense = {}, {}
    for r in FIG4_RANKS:
        for s in seeds:
            model, _ = train_nested(r, (r,), "anchor", "uniform", s)
            fixed.setdefault(r, []).append(evaluate(model)())
            bar.update()
            torch.manual_seed(s)
            net = dense_mlp(width_for(r))
            fit(dict(net.named_parameters()), task(net, s), fcfg(s), progress=False)
            dense.setdefault(r, []).append(evaluate(net.eval())())
            bar.update()

    def mean_sd(values):
        return statistics.mean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)

    curve = [{"rank": r, "flops": flops(r), "accuracy": statistics.mean(run[r - 1]["accuracy"] for run in nsn_rows),
              "loss": statistics.mean(run[r - 1]["loss"] for run in nsn_rows)} for r in range(1, R + 1)]
    fig4_table = []
    for r in FIG4_RANKS:
        a_nsn = mean_sd([run[r - 1]["accuracy"] for run in nsn_rows])
        a_fix = mean_sd([x["accuracy"] for x in fixed[r]])
        a_den = mean_sd([x["accuracy"] for x in dense[r]])
        fig4_table.append({"rank": r, "FLOPs/example": flops(r), "dense width": width_for(r),
                           "one NSN": f"{a_nsn[0]:.4f} ± {a_nsn[1]:.4f}",
                           "fixed-rank specialist": f"{a_fix[0]:.4f} ± {a_fix[1]:.4f}",
                           "dense specialist": f"{a_den[0]:.4f} ± {a_den[1]:.4f}",
                           "NSN - fixed-rank": round(a_nsn[0] - a_fix[0], 4)})
    nsn.plot_frontier(
        {"one NSN at every rank (mean of seeds)": curve}, "accuracy", img / "nsn_fig4.png", x="flops",
        xlabel="FLOPs per example", title=f"MiniLM embeddings of R8: one NSN vs specialists ({args.seeds} seeds)",
        points={"fixed-rank specialists": [{"flops": flops(r), "accuracy": x["accuracy"]} for r in FIG4_RANKS for x in fixed[r]],
                "dense specialists (equal FLOPs)": [{"flops": flops(r), "accuracy": x["accuracy"]} for r in FIG4_RANKS
                                                    for x in dense[r]]})
    mean_lv = {r: statistics.mean(lv[r] for lv in logvars) for r in FIG4_RANKS}
    nsn.plot_log_variance({f"seed {s}": lv for s, lv in enumerate(logvars)}, img / "nsn_fig4_logvar.png",
                          title="learned log-variance per training rank (R8 embedding MLP)")
    contain = torch.stack([nsn.containment(m, FIG4_RANKS) for m in fig4_models]).mean(0)
    nsn.plot_containment(contain, FIG4_RANKS, img / "nsn_fig4_containment.png",
                         title="containment ||P_large U_small||^2 / r_small (R8 embedding MLP)")

    # ---- Table 1: ablation with sparse training ranks
    abl, abl_rows, interp = {}, {}, {}
    for name, (objective, sampling) in VARIANTS.items():
        for s in seeds:
            model, _ = train_nested(R, ABL_TRAIN, objective, sampling, s)
            rows = nsn.sweep(model, evaluate(model), sorted(set(ABL_TRAIN) | set(ABL_OOD)), progress=False)
            by = {x["rank"]: x for x in rows}
            abl.setdefault(name, []).append({
                "highest": by[R]["accuracy"],
                "id": statistics.mean(by[r]["accuracy"] for r in ABL_TRAIN),
                "ood": statistics.mean(by[r]["accuracy"] for r in ABL_OOD)})
            abl_rows.setdefault(name, []).append(rows)
            if s == 0:
                interp[name] = nsn.interpolation_check(model, {x["rank"]: x["loss"] for x in rows}, ABL_TRAIN)
                interp[name]["energy_decay"] = nsn.energy_decay(model)
            bar.update()
    bar.close()
    table1 = []
    for name, runs in abl.items():
        row = {"objective": name}
        for key, label in (("highest", "highest rank (64)"), ("id", "avg in-training ranks"),
                           ("ood", "avg interpolated ranks")):
            m, sdv = mean_sd([x[key] for x in runs])
            row[label] = f"{m:.4f} ± {sdv:.4f}"
        table1.append(row)
    ranks_all = sorted(set(ABL_TRAIN) | set(ABL_OOD))
    nsn.plot_frontier({name: [{"rank": r, "accuracy": statistics.mean(run[i]["accuracy"] for run in runs)}
                              for i, r in enumerate(ranks_all)] for name, runs in abl_rows.items()},
                      "accuracy", img / "nsn_fig4_ablation.png", x="rank",
                      title=f"training ranks {ABL_TRAIN}; every other rank is interpolated")
    name = "uncertainty, curriculum (NSN)"
    _plot_interpolation(interp[name], img / "nsn_fig4_interpolation.png")
    seconds = time.perf_counter() - t0
    summary = {"fig4": fig4_table, "table1": table1, "log_var_mean": mean_lv, "containment": contain.tolist(),
               "interpolation": interp, "curve": curve, "embedding_seconds": t_embed,
               "training_seconds": time.perf_counter() - t1, "seconds": seconds, "args": vars(args)}
    harness.write_json(work / "summary.json", summary, indent=2, default=str)
    if args.json:
        print(json.dumps(summary, indent=2, default=str))
        return
    print(table(fig4_table, markdown=True))
    print()
    print(table(table1, markdown=True))
    print("\nlearned log-variance (mean over seeds):", {r: round(v, 3) for r, v in mean_lv.items()})
    for n, chk in interp.items():
        print(f"Prop. 1 ({n}): C = {chk['C']:.4g}, holds at {chk['holds_share']:.0%} of interpolated ranks; "
              f"rising component energies {chk['energy_decay']['rising_share']:.1%}")
    print(f"embeddings {t_embed:.0f} s, training + evaluation {summary['training_seconds']:.0f} s")


def _plot_interpolation(check: dict, path: Path) -> None:
    plt = nsn._pyplot()
    fig, ax = plt.subplots(figsize=(5, 3.6))
    rows = check["interpolated"]
    ax.scatter([r["energy"] for r in rows], [r["measured"] for r in rows], label="measured |E(r_int) - E(r_1)|")
    for r in rows:
        ax.annotate(f"{r['r1']}->{r['r_int']}", (r["energy"], r["measured"]), fontsize=7)
    xs = [0, max(r["energy"] for r in rows + check["calibration"])]
    ax.plot(xs, [check["C"] * x for x in xs], "r--", label=f"bound C * energy (C = {check['C']:.3g}, fitted on trained ranks)")
    cal = check["calibration"]
    ax.scatter([c["energy"] for c in cal], [c["measured"] for c in cal], marker="x", c="k", label="trained-rank pairs")
    ax.set_xlabel("energy: sum of ||b_i|| ||a_i||, i = r_1+1..r_int, all nested layers", fontsize=8)
    ax.set_ylabel("test cross-entropy difference")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
