"""Table 2 / Fig. 6 analogue: per-worker memory, bytes communicated per round and time per batch, true
TwIST vs DDP at the same world size, each a real `torchrun` of gloo processes training SmolLM2 on this
machine (`mlpsurgery twist train --mode true|dp`, printed before it runs).

What is measured, per run (from the ranks' own counters, saved in the model folder's manifest):
- time per batch: the training loop's wall time (rank 0: scatter, local batches, gather, aggregation; DDP:
  forward, backward with its all-reduces, optimizer step) / batches per worker;
- memory: peak resident set size of each process (everything: Python, libraries, tensors), and the bytes of
  the parameters it holds and of its AdamW moments;
- communication: payload bytes each rank sends and receives per round of `interval` batches (TwIST: the
  scatter and gather of flat subnet buffers, counted exactly; DDP: 2(S-1)/S of every all-reduced gradient
  bucket, the ring all-reduce volume).
Run it on a quiet machine (it takes the lock exclusively):

    OMP_NUM_THREADS=1 flock -x /tmp/mlpsurgery.lock python benchmarks/twist_cost.py --world 2
"""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import harness

# label: (mode, parts, keep X of 12, attn keep or None)
CONFIGS = {
    2: {"DDP": ("dp", "both", 12, None), "attn 2/3": ("true", "attn", 8, 2), "ffn 10/12": ("true", "ffn", 10, None),
        "ffn 8/12": ("true", "ffn", 8, None), "ffn 6/12": ("true", "ffn", 6, None),
        "both 8/12": ("true", "both", 8, 2), "both 6/12": ("true", "both", 6, 2)},
    3: {"DDP": ("dp", "both", 12, None), "attn 1/3": ("true", "attn", 4, 1), "ffn 4/12": ("true", "ffn", 4, None),
        "both 4/12": ("true", "both", 4, 1)},
}


def run(label: str, spec, args, workdir: Path) -> dict:
    mode, parts, keep, attn_keep = spec
    out = workdir / label.replace(" ", "-").replace("/", "of")
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.world),
           "-m", "mlpsurgery", "twist", "train", "smollm2", "--mode", mode, "--workers", str(args.world),
           "--blocks", "12", "--keep", str(keep), "--parts", parts, "--steps", str(args.steps), "--interval",
           str(args.interval), "--batch-size", "1", "--block-len", str(args.block_len), "--lr", "1e-4",
           "--out", str(out), "--no-checkpoint", "--quiet"]
    if attn_keep:
        cmd += ["--attn-keep", str(attn_keep)]
    shown = " ".join(shlex.quote(c) for c in cmd).replace(sys.executable, "python")
    print(f"{label}: {shown}", flush=True)
    t0 = time.time()
    r = subprocess.run(cmd, env=harness.child_env(1, src=True), capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"{label} failed:\n{r.stderr[-4000:]}")
    extra = harness.read_json(out / "surgery.json")["extra"]
    shutil.rmtree(out, ignore_errors=True)
    rounds = -(-args.steps // args.interval)
    ranks = sorted(extra["twist_ranks"], key=lambda s: s["rank"])
    return {"label": label, "command": shown, "mode": mode, "wall_s": time.time() - t0,
            "loop_s": extra["twist_seconds"], "ms_per_batch": 1000 * extra["twist_seconds"] / args.steps,
            "ranks": ranks, "rounds": rounds,
            "bytes_per_round": [(s["sent_bytes"] + s["received_bytes"]) / rounds for s in ranks],
            "final_loss": extra["twist_history"][-1]["loss"], "steps": args.steps}


def main() -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("--world", type=int, default=2, choices=sorted(CONFIGS))
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--interval", type=int, default=15)
    ap.add_argument("--block-len", type=int, default=128)
    ap.add_argument("--out", default="runs/twist/cost")
    ap.add_argument("--img", default="docs/img")
    ap.add_argument("--only", nargs="*", help="run only these settings (labels of CONFIGS; DDP is always run)")
    args = ap.parse_args()
    work = Path(args.out)
    work.mkdir(parents=True, exist_ok=True)
    path = work / f"world{args.world}.json"
    results = harness.read_json(path, missing={})
    for label, spec in CONFIGS[args.world].items():
        if args.only and label != "DDP" and label not in args.only:
            continue
        if label not in results:
            results[label] = run(label, spec, args, work)
            results[label]["machine"] = harness.machine("{arch}, {cores} CPU cores, torch gloo")
            harness.write_json(path, results)
            print(json.dumps({k: v for k, v in results[label].items() if k != "ranks"}), flush=True)
    report(results, args)


def report(results: dict, args) -> None:
    from mlpsurgery.report import pyplot

    plt = pyplot()

    ddp = results["DDP"]
    mib = 1024 ** 2
    lines = ["| setting | ms / batch | speed-up vs DDP | worker peak RSS (MiB) | worker params + AdamW (MiB) | "
             "rank 0 peak RSS (MiB) | bytes / round / worker (MiB) | vs DDP |", "|---|---|---|---|---|---|---|---|"]
    for label, r in results.items():
        if r.get("steps", args.steps) != args.steps:
            continue
        w = r["ranks"][1]
        lines.append(f"| {label} | {r['ms_per_batch']:.0f} | {ddp['ms_per_batch'] / r['ms_per_batch']:.2f}x | "
                     f"{w['peak_rss_bytes'] / mib:.0f} | {(w['held_bytes'] + w['optimizer_bytes']) / mib:.0f} | "
                     f"{r['ranks'][0]['peak_rss_bytes'] / mib:.0f} | {r['bytes_per_round'][1] / mib:.1f} | "
                     f"{r['bytes_per_round'][1] / ddp['bytes_per_round'][1]:.3f} |")
    text = "\n".join(lines)
    harness.write_md(Path(args.out) / f"world{args.world}.md", text)
    print(text)
    labels = list(results)
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    axes[0].bar(labels, [results[k]["ms_per_batch"] for k in labels], color=["grey"] + ["C0"] * (len(labels) - 1))
    axes[0].set_ylabel("ms per batch (1 x 128 tokens per worker)")
    axes[1].bar(labels, [results[k]["bytes_per_round"][1] / mib for k in labels],
                color=["grey"] + ["C1"] * (len(labels) - 1))
    axes[1].set_ylabel(f"MiB per worker per round ({args.interval} batches)")
    for ax in axes:
        ax.tick_params(axis="x", rotation=30)
    fig.suptitle(f"SmolLM2 training, {args.world} gloo processes on this machine: true TwIST vs DDP")
    fig.tight_layout()
    fig.savefig(Path(args.img) / f"twist_cost_world{args.world}.png", dpi=110)


if __name__ == "__main__":
    main()
