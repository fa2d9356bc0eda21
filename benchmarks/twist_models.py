"""Train the models behind docs/twist.md: SmolLM2 fine-tuned on the five training novels of the bundled
Austen corpus, data parallel (the baseline) and with TwIST at several subnet ratios, all for the same
number of batches per worker on the same shards.

Each model is one `mlpsurgery twist train` command (printed before it runs); TwIST runs use true mode
with one gloo process per worker under torchrun. A finished model (its folder exists) is skipped; an
interrupted one resumes from its checkpoint when the script is run again.

    OMP_NUM_THREADS=1 flock -s /tmp/mlpsurgery.lock python benchmarks/twist_models.py --out runs/twist/models
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import harness

# name: mode, parts, keep X of R = 12; optional: lr (default --lr), start (a trained model to continue from,
# with its own seed so that blueprints and batches are new), steps (default --steps)
RUNS = {
    "dp": dict(mode="dp", parts="both", keep=4),
    "both-4": dict(mode="true", parts="both", keep=4),
    "ffn-4": dict(mode="true", parts="ffn", keep=4),
    "attn-4": dict(mode="true", parts="attn", keep=4),
    "ffn-6": dict(mode="true", parts="ffn", keep=6),
    "ffn-8": dict(mode="true", parts="ffn", keep=8),
    "dp-lr1e-4": dict(mode="dp", parts="both", keep=4, lr=1e-4),  # the paper's learning rate, for the baselines
    "ffn-4-long": dict(mode="true", parts="ffn", keep=4, start="ffn-4", seed=1, steps=270),  # 360 batches in all
}


def command(name: str, args) -> list[str]:
    run = RUNS[name]
    model = str(Path(args.out) / run["start"]) if "start" in run else "smollm2"
    common = ["twist", "train", model, "--mode", run["mode"], "--workers", str(args.workers), "--blocks", "12",
              "--keep", str(run["keep"]), "--parts", run["parts"], "--steps", str(run.get("steps", args.steps)),
              "--interval", str(args.interval), "--batch-size", str(args.batch_size), "--block-len",
              str(args.block_len), "--lr", str(run.get("lr", args.lr)), "--seed", str(run.get("seed", args.seed)),
              "--out", str(Path(args.out) / name), "--json", "--quiet"]
    if run["mode"] == "dp":
        return [sys.executable, "-m", "mlpsurgery", *common]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.workers),
            "-m", "mlpsurgery", *common]


def main() -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("--out", default="runs/twist/models")
    ap.add_argument("--only", nargs="*", choices=list(RUNS), help="train only these")
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--steps", type=int, default=90)
    ap.add_argument("--interval", type=int, default=15)
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--block-len", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--img", default="docs/img", help="where the training-loss plot goes")
    args = ap.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    env = harness.child_env(os.environ.get("OMP_NUM_THREADS", "1"), src=True)
    for name in args.only or RUNS:
        folder = Path(args.out) / name
        if (folder / "surgery.json").exists():
            print(f"{name}: done ({folder})", flush=True)
            continue
        claim = Path(args.out) / f"{name}.running"
        try:  # several drivers may share the queue: each run is taken by one of them
            claim.touch(exist_ok=False)
        except FileExistsError:
            print(f"{name}: taken by another driver ({claim})", flush=True)
            continue
        cmd = command(name, args)
        shown = " ".join(shlex.quote(c) for c in cmd).replace(sys.executable, "python")
        print(f"{name}: {shown}", flush=True)
        t0 = time.time()
        r = subprocess.run(cmd, env=env, capture_output=True, text=True)
        (Path(args.out) / f"{name}.log").write_text(r.stdout + "\n" + r.stderr)
        claim.unlink()
        if r.returncode != 0:
            print(r.stderr[-4000:], file=sys.stderr)
            sys.exit(f"{name} failed (exit {r.returncode}); rerun to resume from its checkpoint")
        extra = harness.read_json(folder / "surgery.json").get("extra", {})
        history = extra.get("twist_history", [])
        summary = {"name": name, "command": shown, "wall_s": time.time() - t0, "history": history,
                   "ranks": extra.get("twist_ranks", [])}
        harness.write_json(Path(args.out) / f"{name}.json", summary, indent=2)
        print(f"{name}: final loss {history[-1]['loss']:.4f}, {summary['wall_s']:.0f} s", flush=True)
    plot(Path(args.out), Path(args.img))


def plot(out: Path, img: Path) -> None:
    """Training loss per round (mean over workers' batches; TwIST: of the subnets being trained)."""
    from mlpsurgery.report import pyplot

    plt = pyplot()

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for name in RUNS:
        path = out / f"{name}.json"
        if path.exists():
            h = harness.read_json(path)["history"]
            ax.plot([r["step"] for r in h], [r["loss"] for r in h], marker="o",
                    label="data parallel (full model)" if name == "dp" else f"TwIST {name} (its subnets)")
    ax.set_xlabel("batches per worker")
    ax.set_ylabel("training loss (mean per round)")
    ax.set_title("SmolLM2 on Austen, S = 3 workers")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    img.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(img / "twist_training.png", dpi=110)


if __name__ == "__main__":
    main()
