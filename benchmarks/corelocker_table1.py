"""CoreLocker, the paper's Table 1 on real models and data, plus key size and exact restoration.

For each model: the original, random extraction (averaged over seeds), CoreLocker l1 and CoreLocker
scale at the same extraction ratio (0.05 by default); then a lock -> unlock round trip through files
(key plain and sealed) with the key size against the model size and a SHA-256 of every tensor of the
original and the restored model.

    python benchmarks/corelocker_table1.py minilm     # MiniLM fine-tuned on Reuters R8 (r8-test, 2189 docs)
    python benchmarks/corelocker_table1.py minilm --sample 200 --seeds 2 --core-only   # the reduced run in the docs
    python benchmarks/corelocker_table1.py cnn        # BatchNorm CNN on scikit-learn digits (360 test images)
    python benchmarks/corelocker_table1.py smollm2    # SmolLM2-135M, perplexity on held-out Persuasion
"""

from __future__ import annotations

import copy
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import harness
from corelocker_common import (MAX_LEN, RUNS, digits_cnn_test, machine, minilm_r8, r8_splits, smollm2_perplexity,
                               write_json)

import mlpsurgery as ms
from mlpsurgery.measure.accuracy import predict
from mlpsurgery.methods.corelocker import (CoreLockerConfig, Ranking, extracted, lock_folder,
                                           lock_key, read_key, save_key, tensor_hashes, unit_groups, unlock_folder,
                                           unlock_key)


def r8_metrics(tok, test):
    """Accuracy and balanced accuracy (mean per-class recall) from one pass over the test set."""
    labels = torch.tensor(test.labels)

    def both(model):
        pred = predict(model, tok, test.texts, max_len=MAX_LEN, progress=False)
        recall = [float((pred[labels == c] == c).float().mean()) for c in range(test.num_classes)]
        return {"accuracy": float((pred == labels).float().mean()), "balanced_accuracy": float(np.mean(recall))}

    return both


def measure(model, metrics, cfg: CoreLockerConfig, seeds=(0,)) -> dict:
    """Metrics of the model with cfg's units extracted (mean and std over seeds); the model is restored."""
    runs = []
    for seed in seeds:
        c = CoreLockerConfig(**{**cfg.__dict__, "seed": seed})
        ranking = Ranking(unit_groups(model, c), c.scope, c.ratio)
        with extracted(model, ranking, c.ratio) as n:
            runs.append({**metrics(model), "units": n})
    keys = [k for k in runs[0] if k != "units"]
    row = {k: float(np.mean([r[k] for r in runs])) for k in keys}
    row.update({f"{k}_std": float(np.std([r[k] for r in runs])) for k in keys})
    row.update(units=runs[0]["units"], units_eligible=ranking.n_units, seeds=list(seeds), runs=runs)
    return row


def rows_for(model, metrics, ratio: float, random_seeds, extra_units=()) -> list[dict]:
    rows = [{"setting": "original", **metrics(model)}]
    for name, cfg, seeds in [("random", CoreLockerConfig(ratio=ratio, indicator="random"), random_seeds),
                             ("CoreLocker l1", CoreLockerConfig(ratio=ratio), (0,)),
                             ("CoreLocker scale", CoreLockerConfig(ratio=ratio, indicator="scale"), (0,))]:
        t0 = time.perf_counter()
        rows.append({"setting": name, "unit": cfg.unit, **measure(model, metrics, cfg, seeds),
                     "seconds": time.perf_counter() - t0})
        print({k: v for k, v in rows[-1].items() if k != "runs"}, file=sys.stderr, flush=True)
    for unit, indicator, seeds in extra_units:
        cfg = CoreLockerConfig(ratio=ratio, unit=unit, indicator=indicator)
        rows.append({"setting": f"{'CoreLocker ' + indicator if indicator != 'random' else 'random'} ({unit})",
                     "unit": unit, **measure(model, metrics, cfg, seeds)})
    return rows


def restoration(model, tokenizer, ratio: float, work: Path) -> dict:
    """lock_folder -> unlock_folder (plain and sealed key); SHA-256 of every tensor, original vs restored."""
    original = tensor_hashes(model)
    out = {}
    for sealed in (False, True):
        victim = copy.deepcopy(model)
        tag = "sealed" if sealed else "plain"
        res = lock_folder(victim, work / f"locked-{tag}", work / f"{tag}.key", CoreLockerConfig(ratio=ratio),
                          tokenizer=tokenizer, passphrase="benchmark passphrase" if sealed else None, progress=False)
        unlock_folder(work / f"locked-{tag}", work / f"{tag}.key", work / f"restored-{tag}",
                      passphrase="benchmark passphrase" if sealed else None)
        restored = tensor_hashes(ms.load(work / f"restored-{tag}"))
        locked = tensor_hashes(ms.load(work / f"locked-{tag}"))
        out[tag] = {"key_bytes": res["key_bytes"], "model_bytes": res["model_bytes"],
                    "key_share": res["key_bytes"] / res["model_bytes"], "entries": res["entries"],
                    "units_extracted": res["units_extracted"], "tensors": len(original),
                    "tensors_identical_after_unlock": sum(restored[n] == h for n, h in original.items()),
                    "tensors_changed_by_lock": sum(locked[n] != h for n, h in original.items())}
    return out


def cnn_restoration(model, ratio: float, work: Path) -> dict:
    from safetensors.torch import save_model

    original = tensor_hashes(model)
    out = {}
    save_model(model, str(work / "cnn.safetensors"))
    for unit in ("weight", "filter"):
        victim = copy.deepcopy(model)
        key = lock_key(victim, CoreLockerConfig(ratio=ratio, unit=unit))
        numels = {n: p.numel() for n, p in victim.named_parameters()}
        size = save_key(key, work / f"cnn-{unit}.key", numels, overwrite=True)
        changed = sum(tensor_hashes(victim)[n] != h for n, h in original.items())
        unlock_key(victim, read_key(work / f"cnn-{unit}.key"))
        restored = tensor_hashes(victim)
        out[unit] = {"key_bytes": size, "model_bytes": (work / "cnn.safetensors").stat().st_size,
                     "entries": key.entries, "units_extracted": key.header["units_extracted"], "tensors": len(original),
                     "tensors_changed_by_lock": changed,
                     "tensors_identical_after_unlock": sum(restored[n] == h for n, h in original.items())}
        out[unit]["key_share"] = out[unit]["key_bytes"] / out[unit]["model_bytes"]
    return out


def main():
    p = harness.parser(__doc__)
    p.add_argument("model", choices=("minilm", "cnn", "smollm2"))
    p.add_argument("--ratio", type=float, default=0.05)
    p.add_argument("--seeds", type=int, default=5, help="random-extraction seeds to average (5)")
    p.add_argument("--max-tokens", type=int, default=8192, help="SmolLM2: held-out tokens scored (8192)")
    p.add_argument("--sample", type=int, default=0,
                   help="MiniLM: score a stratified sample of this many R8 test documents (seed 0); 0: all 2189")
    p.add_argument("--core-only", action="store_true",
                   help="only the paper's four rows: no neuron / head rows, no lock -> unlock round trip through files")
    args = p.parse_args()
    seeds = tuple(range(args.seeds))
    t0 = time.perf_counter()
    result = {"model": args.model, "ratio": args.ratio, "machine": machine(), "command": " ".join(sys.argv)}
    RUNS.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=RUNS) as tmp:
        work = Path(tmp)
        if args.model == "minilm":
            loaded = minilm_r8()
            _, _, test = r8_splits()
            if args.sample and args.sample < len(test):
                test = test.sample(args.sample, seed=0)
            metrics = r8_metrics(loaded.tokenizer, test)
            sampled = f"stratified sample (seed 0) of {len(test)}" if args.sample else f"{len(test)}"
            result["data"] = f"Reuters R8 test, {sampled} documents, {test.num_classes} classes"
            result["rows"] = rows_for(loaded.model, metrics, args.ratio, seeds,
                                      extra_units=[] if args.core_only else [("neuron", "l1", (0,)), ("head", "l1", (0,))])
            result["restoration"] = {} if args.core_only else restoration(loaded.model, loaded.tokenizer, args.ratio,
                                                                           work)
        elif args.model == "cnn":
            model, metrics, n_test = digits_cnn_test()
            result["data"] = f"scikit-learn digits test split, {n_test} images, 10 classes"
            result["rows"] = rows_for(model, metrics, args.ratio, seeds,
                                      extra_units=[("filter", "random", seeds), ("filter", "l1", (0,)),
                                                   ("filter", "scale", (0,))])
            result["restoration"] = cnn_restoration(model, args.ratio, work)
        else:
            loaded, metrics = smollm2_perplexity(args.max_tokens)
            result["data"] = f"held-out Persuasion, first {args.max_tokens} tokens, windows of 512"
            result["rows"] = rows_for(loaded.model, metrics, args.ratio, tuple(range(min(args.seeds, 3))),
                                      extra_units=[("neuron", "l1", (0,)), ("head", "l1", (0,))])
            result["restoration"] = restoration(loaded.model, loaded.tokenizer, args.ratio, work)
    result["seconds"] = time.perf_counter() - t0
    path = write_json(f"table1_{args.model}.json", result)
    for r in result["rows"]:
        vals = {k: v for k, v in r.items() if k not in ("runs", "seeds") and not isinstance(v, (list, dict))}
        print(vals)
    print(result["restoration"])
    print(f"wrote {path} ({result['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
