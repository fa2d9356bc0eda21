"""CoreLocker under attack (the paper's Tables 2-3): a locked model is fine-tuned on 5% / 10% of the
training data (3 trials, each on a freshly drawn stratified subset) and magnitude-pruned at 20% / 40%;
reported is the accuracy reached and the accuracy recovered (delta against the locked model).

As a reference for what the fine-tuning data alone is worth, the same fine-tuning is run from a model
that never saw the task (MiniLM with a fresh head; a freshly initialised CNN): recovered accuracy at or
below this line means the locked model gave the attacker nothing beyond its public starting point.

    python benchmarks/corelocker_attacks.py cnn
    python benchmarks/corelocker_attacks.py minilm   # scale indicator at 0.05, the paper's attack setting
    python benchmarks/corelocker_attacks.py minilm --indicator l1 --ratio 0.2 --prune-only --eval-sample 200
                                                     # the reduced run in the docs (the lock that reaches chance)
"""

from __future__ import annotations

import copy
import time

import torch

import harness
from corelocker_common import (FT_BATCH, MAX_LEN, DigitsCNN, cnn_accuracy, cnn_loss, digits, digits_cnn,
                               minilm_r8, r8_splits, write_result)

import mlpsurgery as ms
from mlpsurgery.methods.corelocker import (CoreLockerConfig, attack_finetune, attack_table,
                                           classifier_finetune, classifier_utility, lock_key)


def cnn_finetune(xtr, ytr, epochs: int, batch: int = 16):
    """Fine-tuning attack data for the CNN: `fraction` of the training images, drawn per trial."""
    def make(model, fraction, seed):
        g = torch.Generator().manual_seed(seed)
        idx = torch.randperm(len(xtr), generator=g)[:round(fraction * len(xtr))]
        return cnn_loss(model, xtr[idx], ytr[idx], batch=batch, seed=seed), epochs * -(-len(idx) // batch)

    return make


def main():
    p = harness.parser(__doc__)
    p.add_argument("model", choices=("minilm", "cnn"))
    p.add_argument("--indicator", default=None, help="lock indicator (minilm: scale, cnn: l1)")
    p.add_argument("--ratio", type=float, default=0.05)
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--epochs", type=int, default=None, help="passes over the attack data (minilm 3, cnn 10)")
    p.add_argument("--lr", type=float, default=None, help="attack learning rate (minilm 5e-5, cnn 1e-3)")
    p.add_argument("--eval-sample", type=int, default=1000, help="MiniLM: R8 test documents (stratified, seed 0)")
    p.add_argument("--reference-trials", type=int, default=1, help="trials of the from-scratch reference")
    p.add_argument("--fractions", default="0.05,0.1", help="fine-tuning data fractions (0.05,0.1)")
    p.add_argument("--prune-only", action="store_true", help="only the pruning attacks (no fine-tuning, no reference)")
    args = p.parse_args()
    t0 = time.perf_counter()
    fractions = () if args.prune_only else tuple(float(f) for f in args.fractions.split(","))
    sparsities = (0.2, 0.4)
    if args.model == "cnn":
        indicator, epochs, lr = args.indicator or "l1", args.epochs or 10, args.lr or 1e-3
        model = digits_cnn()
        xtr, ytr, xte, yte = digits()
        utility = cnn_accuracy(xte, yte)
        make_loss = cnn_finetune(xtr, ytr, epochs)

        def fresh():
            torch.manual_seed(0)
            return DigitsCNN().eval()

        data = f"digits: attack data drawn from the {len(ytr)} training images; accuracy on {len(yte)} test images"
    else:
        indicator, epochs, lr = args.indicator or "scale", args.epochs or 3, args.lr or 5e-5
        loaded = minilm_r8()
        model = loaded.model
        finetune, _, test = r8_splits()
        if args.eval_sample and len(test) > args.eval_sample:
            test = test.sample(args.eval_sample, seed=0)
        utility = classifier_utility(loaded.tokenizer, test, max_len=MAX_LEN)
        make_loss = classifier_finetune(loaded.tokenizer, finetune, batch_size=FT_BATCH, epochs=epochs, max_len=MAX_LEN)

        def fresh():
            torch.manual_seed(0)
            return ms.load_model("minilm", task="classifier", num_labels=8).model

        data = (f"R8: attack data drawn from the {len(finetune)} fine-tuning documents; accuracy on a stratified "
                f"sample of {len(test)} R8 test documents")
    original = utility(model)
    locked = copy.deepcopy(model)
    lock_key(locked, CoreLockerConfig(ratio=args.ratio, indicator=indicator))
    table = attack_table(locked, utility, make_loss, finetune=fractions, prune=sparsities, trials=args.trials, lr=lr)
    reference = []
    for f in fractions:
        for t in range(args.reference_trials):
            reference.append(attack_finetune(fresh(), make_loss, f, utility, lr=lr, seed=t))
    path, result = write_result(f"attacks_{args.model}.json", {
        "model": args.model, "indicator": indicator, "ratio": args.ratio, "epochs": epochs, "lr": lr,
        "trials": args.trials, "original": original, "table": table, "from_scratch_reference": reference,
        "data": data}, t0)
    print(f"original {original:.4f}, locked {table['locked']:.4f}")
    for r in table["rows"]:
        print(r["attack"], r["setting"], f"{r['accuracy']:.4f} +- {r['std']:.4f}", f"delta {r['delta']:+.4f}")
    for r in reference:
        print("from scratch", r["setting"], r["seed"], f"{r['accuracy']:.4f}")
    print(f"wrote {path} ({result['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
