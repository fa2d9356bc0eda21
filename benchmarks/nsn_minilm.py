"""NSN on a real pretrained model: MiniLM (all-MiniLM-L6-v2) fine-tuned on Reuters R8 with nested MLPs.

Three models, the same data order, the same number of steps and batch size:
  dense   the stock MiniLM classifier fine-tuned normally (every parameter);
  svd     the dense fine-tuned model nested afterwards (SVD of each MLP weight) and truncated, no training:
          "SVD truncation without training";
  nsn     MiniLM with nested MLPs (R = 384, exact at full rank) fine-tuned with the multi-rank uncertainty
          objective and curriculum sampling over the training ranks {32, 64, 128, 256, 384};
  posthoc the dense fine-tuned model nested (exact at full rank) and then trained with the same objective for
          --posthoc-steps more steps at --posthoc-lr, updating only the nested factors and the head (post-hoc NSN
          surgery of a task model);
  anchor  (--anchor) the same nested model trained at the anchor rank only (Table 1's "CE Only").
Each is evaluated on the same stratified sample of r8-test at every rank in RANKS (ranks not in the
training set are interpolated), against the FLOPs of the MLPs relative to the dense MLPs.

    OMP_NUM_THREADS=1 flock -s /tmp/mlpsurgery.lock python benchmarks/nsn_minilm.py --steps 200 --max-len 64

Phases cache their results under --work (runs/nsn/minilm); training checkpoints there too, so a killed
run resumes. Writes docs/img/nsn_minilm_frontier.png and prints the table (JSON with --json).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

import harness
import mlpsurgery as ms
from mlpsurgery.methods import nsn
from mlpsurgery.report import table
from mlpsurgery.train import FitConfig, classifier_loss, fit, trainable

TRAIN_RANKS = (32, 64, 128, 256, 384)
RANKS = (16, 24, 32, 48, 64, 96, 128, 153, 192, 256, 307, 384)  # 153: 50% of the MLP FLOPs; 307: break-even


def classifier(num_labels: int):
    torch.manual_seed(0)  # the new head's init: identical for every model below
    return ms.load_model("minilm", task="classifier", num_labels=num_labels)


def main() -> None:
    ap = harness.parser(__doc__, plot="docs/img/nsn_minilm_frontier.png", print_json=True)
    ap.add_argument("--steps", type=int, default=250)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--max-len", type=int, default=128)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--log-var-lr", type=float, default=5e-2)
    ap.add_argument("--test-examples", type=int, default=800)
    ap.add_argument("--anchor", action="store_true", help="also train the anchor-only ablation")
    ap.add_argument("--posthoc-steps", type=int, default=100)
    ap.add_argument("--posthoc-lr", type=float, default=3e-5)
    ap.add_argument("--work", default="runs/nsn/minilm")
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    train = ms.read_labelled("r8-train")
    test = ms.read_labelled("r8-test", classes=train.classes).sample(args.test_examples, seed=0)
    fcfg = FitConfig(steps=args.steps, lr=args.lr, warmup=0.05, seed=0, checkpoint_every=25)

    def evaluate(model, tok):
        return lambda: nsn.classifier_metrics(model, tok, test, max_len=args.max_len, progress=False)

    def phase(name, run):
        path = work / f"{name}.json"
        if path.exists():
            return harness.read_json(path)
        t0 = time.perf_counter()
        out = run()
        out["seconds"] = time.perf_counter() - t0
        harness.write_json(path, out, indent=2)
        return out

    def run_dense():
        loaded = classifier(train.num_classes)
        model, tok = loaded.model, loaded.tokenizer
        model.train()
        res = fit(trainable(model), classifier_loss(model, tok, train, args.batch_size, args.max_len, seed=0), fcfg,
                  checkpoint_dir=work / "dense.ckpt", desc="dense")
        model.eval()
        ms.save(model, work / "dense", tokenizer=tok, overwrite=True)
        return {"train_seconds": res.seconds, "final_loss": res.history[-1]["loss"], **evaluate(model, tok)()}

    def run_svd():
        model = ms.load(work / "dense")
        tok = ms.load_model(str(work / "dense")).tokenizer
        nsn.nest(model)
        return {"rows": nsn.sweep(model, evaluate(model, tok), RANKS)}

    def run_nested(objective):
        def run():
            loaded = classifier(train.num_classes)
            model, tok = loaded.model, loaded.tokenizer
            nsn.nest(model)
            cfg = nsn.NSNTrainConfig(ranks=TRAIN_RANKS, objective=objective, sampling="curriculum",
                                     log_var_lr=args.log_var_lr, train="all", fit=fcfg)
            task = classifier_loss(model, tok, train, args.batch_size, args.max_len, seed=0)
            res = nsn.train_nsn(model, task, cfg, checkpoint_dir=work / f"{objective}.ckpt", desc=objective)
            ms.save(model, work / objective, tokenizer=tok, overwrite=True)
            rows = nsn.sweep(model, evaluate(model, tok), RANKS)
            return {"train_seconds": res.seconds, "log_var": res.log_var, "rows": rows,
                    "containment": nsn.containment(model, TRAIN_RANKS).tolist(),
                    "interpolation": nsn.interpolation_check(model, {r["rank"]: r["loss"] for r in rows}, TRAIN_RANKS),
                    "energy_decay": nsn.energy_decay(model),
                    "variant_ranks": [h.get("variant_rank") for h in res.history]}
        return run

    def run_posthoc():
        model = ms.load(work / "dense")
        tok = ms.load_model(str(work / "dense")).tokenizer
        nsn.nest(model)
        cfg = nsn.NSNTrainConfig(ranks=TRAIN_RANKS, objective="uncertainty", sampling="curriculum",
                                 log_var_lr=args.log_var_lr, train="nested",
                                 fit=FitConfig(steps=args.posthoc_steps, lr=args.posthoc_lr, warmup=0.05, seed=1,
                                               checkpoint_every=25))
        task = classifier_loss(model, tok, train, args.batch_size, args.max_len, seed=1)
        res = nsn.train_nsn(model, task, cfg, checkpoint_dir=work / "posthoc.ckpt", desc="posthoc")
        rows = nsn.sweep(model, evaluate(model, tok), RANKS)
        return {"train_seconds": res.seconds, "log_var": res.log_var, "rows": rows,
                "containment": nsn.containment(model, TRAIN_RANKS).tolist(),
                "interpolation": nsn.interpolation_check(model, {r["rank"]: r["loss"] for r in rows}, TRAIN_RANKS),
                "energy_decay": nsn.energy_decay(model)}

    dense = phase("dense", run_dense)
    svd = phase("svd", run_svd)
    nested = phase("uncertainty", run_nested("uncertainty"))
    posthoc = phase("posthoc", run_posthoc) if args.posthoc_steps else None
    curves = {"NSN from pretrained (uncertainty + curriculum)": nested["rows"],
              "SVD truncation of the fine-tuned model": svd["rows"]}
    if posthoc:
        curves["NSN post-hoc on the fine-tuned model"] = posthoc["rows"]
    anchor = phase("anchor", run_nested("anchor")) if args.anchor else None
    if anchor:
        curves["anchor-only training, truncated"] = anchor["rows"]
    dense_point = [{"fraction": 1.0, "accuracy": dense["accuracy"]}]
    nsn.plot_frontier(curves, "accuracy", args.plot, points={"dense fine-tuned": dense_point},
                      title=f"MiniLM on R8 ({len(test)} test docs), {args.steps} steps of {args.batch_size}")
    img = Path(args.plot).parent
    logvars = {"NSN from pretrained": nested["log_var"]}
    if posthoc:
        logvars["NSN post-hoc on the fine-tuned model"] = posthoc["log_var"]
        nsn.plot_containment(torch.tensor(posthoc["containment"]), TRAIN_RANKS, img / "nsn_minilm_containment.png",
                             title="MiniLM post-hoc NSN: containment (12 MLP projections)")
    nsn.plot_log_variance({k: {int(r): v for r, v in lv.items()} for k, lv in logvars.items()},
                          img / "nsn_minilm_logvar.png", title="MiniLM on R8: learned log-variance per training rank")
    rows = []
    for i, r in enumerate(RANKS):
        row = {"rank": r, "MLP FLOPs": round(nested["rows"][i]["fraction"], 3), "trained rank": r in TRAIN_RANKS,
               "NSN acc": nested["rows"][i]["accuracy"], "SVD-trunc acc": svd["rows"][i]["accuracy"]}
        if posthoc:
            row["post-hoc NSN acc"] = posthoc["rows"][i]["accuracy"]
        if anchor:
            row["anchor-only acc"] = anchor["rows"][i]["accuracy"]
        row.update({"NSN loss": nested["rows"][i]["loss"], "SVD-trunc loss": svd["rows"][i]["loss"]})
        if posthoc:
            row["post-hoc NSN loss"] = posthoc["rows"][i]["loss"]
        rows.append(row)
    summary = {"dense": dense, "svd": svd, "nsn": nested, "posthoc": posthoc, "anchor": anchor, "table": rows, "test_examples": len(test)}
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(f"dense fine-tuned accuracy {dense['accuracy']:.4f} ({dense['train_seconds']:.0f} s of training)")
        print(table(rows, markdown=True))
        for name, res in (("NSN from pretrained", nested), ("post-hoc NSN", posthoc)):
            if res:
                print(f"{name}: log-variances {res['log_var']}; Prop. 1 "
                      f"{ {k: res['interpolation'][k] for k in ('C', 'holds_share')} }; {res['train_seconds']:.0f} s training")


if __name__ == "__main__":
    main()
