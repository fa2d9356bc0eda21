"""One DLR-Lock phase-2 step on SmolLM2 (or --model), eager vs torch.compile'd DLR-Nets, side by side in one run.

Phase 2 trains every DLR-Net at once through the whole model (top-k KL to the original's logits; AdamW; each
DLR-Net checkpointed, its blocks recomputed in backward), and in eager PyTorch each of the 30 x 36 blocks is ~11
small element-wise and matrix ops forward and more backward, on 2 x 256 tokens -- so on a CPU the step is bound by
per-op overhead (OpenMP fork/join), not by FLOPs: 15 s a step on a 2-core Intel Xeon of 2026-11-27 against 6.8 s on
the Xeon of 2026-11-26 (docs/dlr-lock.md). Phase 1 compiles its steps (8.1 -> 3.1 s,
benchmarks/notes/dlr_phase1_step.py); phase 2 does not yet. This measures what compiling the DLR-Nets would buy:

- eager: `lock dlr`'s phase 2 as it is (DLRNet._delta, checkpointed);
- net: one torch.compile'd function of (x, D, U, norm, alpha) for a whole DLR-Net (36 blocks unrolled), shared by
  the 30 nets (their weights are arguments, so one compilation serves all) -- `logits._compile_nets`, what
  `lock dlr` phase 2 now runs on the CPU;
- block: one compiled function of one block, called 36 x 30 times (a small graph: quick to compile).

The locked model is `locked_like` (untrained DLR-Nets of matched size: the cost depends on the structure only);
the loss is the top-k KL phase 2 uses, against the original's top-k log-probabilities. Every variant starts from
the same weights and the same batches; the losses of the first steps are printed beside each other (compiled
arithmetic is the same up to float order).

    OMP_NUM_THREADS=2 python benchmarks/notes/dlr_phase2_step.py --json runs/dlr/phase2_step.json
"""

from __future__ import annotations

import copy
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import mlpsurgery as ms
from mlpsurgery.methods.dlr_lock import locked_like
from mlpsurgery.methods.dlr_lock.logits import _compile_nets, _dlr_modules
from mlpsurgery.methods.dlr_lock.losses import topk_kl
from mlpsurgery.modules.dlr import rms_norm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the harness
import harness  # noqa: E402


def block(z, D, U, norm, alpha, eps: float):
    return z + alpha * F.linear(F.silu(F.linear(rms_norm(z, eps) * norm, D)), U)


def install(model, variant: str) -> None:
    """Point every DLR-Net's _delta (what its checkpointed forward runs) at the variant."""
    if variant == "eager":
        return
    if variant == "net":  # what `lock dlr` phase 2 runs on the CPU
        _compile_nets([m for _, m in _dlr_modules(model)])
    else:
        fn = torch.compile(block)

        def per_block(x, m):
            z = x
            for l in range(m.depth):
                z = fn(z, m.D[l], m.U[l], m.norm[l], m.alpha[l], m.eps)
            return z - x

        for _, m in _dlr_modules(model):
            m._delta = lambda x, m=m: per_block(x, m)


def main() -> None:
    ap = harness.parser(__doc__, json="runs/dlr/phase2_step.json")
    ap.add_argument("--model", default=None)
    ap.add_argument("--rank", type=int, default=64)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--top-k", type=int, default=32)
    ap.add_argument("--steps", type=int, default=4, help="timed steps per variant (after 2 warm-up steps)")
    ap.add_argument("--variants", default="eager,net,block")
    args = ap.parse_args()

    original = ms.load_model(args.model).model.eval()
    base = locked_like(original, args.rank)
    g = torch.Generator().manual_seed(0)
    n = args.steps + 2
    batches = [torch.randint(0, original.config.vocab_size, (args.batch, args.seq_len), generator=g) for _ in range(n)]
    with torch.no_grad():
        targets = [torch.log_softmax(original(input_ids=b).logits.float(), -1).topk(args.top_k, -1) for b in batches]
    res = {"machine": harness.machine("CPU ({cpu_name}), {threads} threads, torch {torch}"), "rank": args.rank,
           "batch": args.batch, "seq_len": args.seq_len, "variants": {}}
    for variant in args.variants.split(","):
        model = copy.deepcopy(base).eval()
        params = [p for _, m in _dlr_modules(model) for p in m.parameters()]
        for p in model.parameters():
            p.requires_grad_(False)
        for p in params:
            p.requires_grad_(True)
        for _, m in _dlr_modules(model):
            m.checkpoint = True
        install(model, variant)
        opt = torch.optim.AdamW(params, lr=3e-4)
        times, losses = [], []
        for i, (b, (vals, idx)) in enumerate(zip(batches, targets)):
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            loss = topk_kl(model(input_ids=b).logits, idx, vals, None)
            loss.backward()
            opt.step()
            times.append(time.perf_counter() - t0)
            losses.append(float(loss))
            print(variant, i, f"{times[-1]:.2f} s", f"loss {losses[-1]:.6f}", flush=True)
        timed = sorted(times[2:])
        res["variants"][variant] = {"first_two_s": times[:2], "median_step_s": timed[len(timed) // 2],
                                    "steps_s": times[2:], "losses": losses}
    eager = res["variants"].get("eager", {}).get("median_step_s")
    for v, r in res["variants"].items():
        r["speedup_vs_eager"] = eager / r["median_step_s"] if eager else None
        print(f"{v:6s} {r['median_step_s']:.2f} s/step (first two {r['first_two_s'][0]:.1f}, {r['first_two_s'][1]:.1f})"
              + (f"  {r['speedup_vs_eager']:.2f}x" if eager else ""))
    harness.write_json(args.json, res)


if __name__ == "__main__":
    main()
