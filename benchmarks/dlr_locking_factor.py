"""What DLR-Lock costs an attacker and a user, measured side by side in one run.

For SmolLM2-135M (or --model) and each rank, the locked model (every MLP replaced by a DLR-Net of matched
parameter count; untrained, since cost depends only on the structure) against the original:
- one training step (forward + backward + AdamW): peak memory, time, backward/forward ratio;
- the largest batch whose training step fits a memory budget (peak is affine in the batch: two probes);
- inference (no grad) forward time at several sequence lengths, eager and torch.compile'd;
- Proposition B.1's prediction of the activation-memory ratio beside the measurement.

    python benchmarks/dlr_locking_factor.py --ranks 16,64,256 --out runs/dlr/locking_factor.json
"""

from __future__ import annotations

import time

import torch

import harness
import mlpsurgery as ms
from mlpsurgery.measure.cost import compare_cost, max_batch
from mlpsurgery.methods.dlr_lock import activation_memory_model, inference_times, locked_like
from mlpsurgery.report import table


def machine() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return harness.machine("CPU ({processor}), {threads} threads, torch {torch}")


def main() -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("--model", default=None, help="MODEL (default SmolLM2-135M)")
    ap.add_argument("--ranks", default="16,64,256")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--budget-gib", type=float, default=8.0, help="memory budget for the max-batch column")
    ap.add_argument("--tokens", default="16,256,1024", help="sequence lengths for inference timing")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--parts", default="train,infer",
                    help="what to measure: train (training step, max batch), infer (inference time), or both")
    ap.add_argument("--out", default="runs/dlr/locking_factor.json")
    args = ap.parse_args()

    loaded = ms.load_model(args.model)
    original = loaded.model
    device = "cuda" if torch.cuda.is_available() else "cpu"
    original.to(device)
    cfg = original.config
    vocab = cfg.vocab_size
    g = torch.Generator().manual_seed(0)
    batch = torch.randint(0, vocab, (args.batch, args.seq_len), generator=g)
    tokens = [int(t) for t in args.tokens.split(",")]
    budget = int(args.budget_gib * 2**30)
    sites = ms.find_sites(original)
    d, h = cfg.hidden_size, sites.mlp[0].h
    rows, results = [], {"machine": machine(), "model": loaded.source, "batch": [args.batch, args.seq_len],
                         "budget_bytes": budget, "ranks": {}}
    t0 = time.perf_counter()
    parts = set(args.parts.split(","))
    if not parts or parts - {"train", "infer"}:
        raise SystemExit(f"--parts takes train, infer or train,infer, not {args.parts!r}")
    orig_mb = max_batch(original, args.seq_len, budget) if "train" in parts else None
    for r in (int(x) for x in args.ranks.split(",")):
        locked = locked_like(original, r).to(device)
        depth = ms.find_sites(locked).mlp[0].module.depth
        theory = activation_memory_model(d, h, r, depth)
        res = {"depth": depth, "prop_b1": theory}
        row = {"rank": r, "depth": depth}
        if "train" in parts:
            cost = compare_cost(original, locked, batch, repeats=args.repeats)
            mb = max_batch(locked, args.seq_len, budget)
            res.update(cost=cost, max_batch={"original": orig_mb, "locked": mb})
            ratio = cost["ratio"]
            row.update({"step peak mem x": ratio["step_peak_bytes"], "step time x": ratio["step_s"],
                        "bwd/fwd orig": cost["reference"]["backward_forward_ratio"],
                        "bwd/fwd locked": cost["candidate"]["backward_forward_ratio"],
                        "max batch orig": orig_mb["max_batch"], "max batch locked": mb["max_batch"],
                        "act. per-token x (B.1)": theory["ratio"],
                        "act. per-token x (measured)": mb["per_sample_bytes"] / orig_mb["per_sample_bytes"]})
        results["ranks"][r] = res
        if "infer" not in parts:
            rows.append(row)
            print(table([row]), flush=True)
            continue
        # the original is timed again beside each locked model, so a change in machine load between ranks
        # does not enter the ratio
        orig_inf = inference_times(original, tokens, vocab, repeats=args.repeats)
        inf = inference_times(locked, tokens, vocab, repeats=args.repeats)
        orig_inf_c = None if args.no_compile else inference_times(original, tokens, vocab, repeats=args.repeats,
                                                                   compiled=True)
        inf_c = None if args.no_compile else inference_times(locked, tokens, vocab, repeats=args.repeats, compiled=True)
        res.update(inference_s={"original": orig_inf, "locked": inf},
                   inference_compiled_s=None if inf_c is None else {"original": orig_inf_c, "locked": inf_c})
        for t in tokens:
            row[f"infer x T={t}"] = inf[t] / orig_inf[t]
            if inf_c:
                row[f"compiled x T={t}"] = inf_c[t] / orig_inf_c[t]
        rows.append(row)
        print(table([row]), flush=True)
    results["seconds"] = time.perf_counter() - t0
    results["table"] = rows
    print(f"\n{loaded.source} on {results['machine']}; training batch {args.batch} x {args.seq_len}, "
          f"budget {args.budget_gib} GiB")
    print(table(rows))
    print("\n" + table(rows, markdown=True))
    harness.write_json(args.out, results, default=str)


if __name__ == "__main__":
    main()
