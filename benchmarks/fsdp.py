"""Sharded training (FSDP2 under torchrun) against one process, on a real model: `mlpsurgery nest` with training,
run once as one process and once as `torchrun --nproc-per-node N`, the same global batch and seed.

Reported side by side: per process, the bytes of the model's parameters, of the trained parameters, their
gradients and AdamW moments it held (its shard under FSDP), its peak resident memory (the kernel's), the wall
time; the loss at every step of both runs and the largest difference between the two saved models' weights.

    python benchmarks/fsdp.py [--model smollm2] [--steps 8] [--ranks 2] --json docs/results/fsdp-smollm2.json \
        --md docs/results/fsdp-smollm2.md
    python benchmarks/fsdp.py --render docs/results/fsdp-smollm2.json     # the markdown again from the JSON

One process gets OMP_NUM_THREADS = N and each rank 1, so both use the same cores.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _objects(text: str) -> list[dict]:
    """Every JSON object printed on stdout (each rank prints its own)."""
    dec, out, i = json.JSONDecoder(), [], 0
    while True:
        j = text.find("{", i)
        if j < 0:
            return out
        obj, end = dec.raw_decode(text[j:])
        out.append(obj)
        i = j + end


def run(cmd: list[str], threads: int) -> tuple[list[dict], float]:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    t0 = time.perf_counter()
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"failed ({r.returncode}): {' '.join(cmd)}\n{r.stderr[-3000:]}")
    return _objects(r.stdout), time.perf_counter() - t0


def _max_diff(a: str, b: str) -> float:
    import torch

    from mlpsurgery.io import load

    ma, mb = load(a), load(b)
    with torch.no_grad():
        return max((p - q).abs().max().item() for p, q in zip(ma.parameters(), mb.parameters()))


def render(res: dict) -> str:
    mib = 2 ** 20
    rows = ["| run | process | model params | trained params | gradients | AdamW moments | peak RSS before training "
            "| peak RSS in training | wall |", "|---|---|---|---|---|---|---|---|---|"]
    for name, procs, wall in (("one process", res["one"], res["one_seconds"]),
                              (f"torchrun, {res['ranks']} ranks (FSDP2)", res["sharded"], res["sharded_seconds"])):
        for p in procs:
            m = p["memory"]
            rows.append(f"| {name} | rank {p['rank']} | {m['model_param_bytes'] / mib:.0f} MiB | "
                        f"{m['param_bytes'] / mib:.0f} MiB | {m['grad_bytes'] / mib:.0f} MiB | "
                        f"{m['optimizer_bytes'] / mib:.0f} MiB | {m['peak_rss_before_bytes'] / 2**30:.2f} GiB | "
                        f"{m['peak_rss_training_bytes'] / 2**30:.2f} GiB | {wall:.0f} s |")
    one, two = res["one"][0]["memory"], res["sharded"][0]["memory"]
    held = lambda m: m["model_param_bytes"] + m["grad_bytes"] + m["optimizer_bytes"]  # noqa: E731
    lines = [f"`{res['command']}` on {res['model']}, {res['steps']} steps of batch {res['batch_size']} x "
             f"{res['block_len']} tokens; machine: {res['machine']}; torch {res['torch']}.", "", *rows, "",
             f"Per rank, parameters + gradients + AdamW moments: {held(two) / mib:.0f} MiB of {held(one) / mib:.0f} MiB "
             f"in one process ({held(two) / held(one):.2f}x).", "",
             "| step | loss, one process | loss, sharded | difference |", "|---|---|---|---|"]
    for a, b in zip(res["loss_one"], res["loss_sharded"]):
        lines.append(f"| {a['step']} | {a['loss']:.6f} | {b['loss']:.6f} | {abs(a['loss'] - b['loss']):.1e} |")
    lines += ["", f"Largest difference between the two saved models' weights: {res['max_weight_diff']:.1e}."]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--block-len", type=int, default=128)
    ap.add_argument("--json")
    ap.add_argument("--md")
    ap.add_argument("--render", help="print the markdown of a JSON written before")
    args = ap.parse_args()
    if args.render:
        print(render(json.loads(Path(args.render).read_text())), end="")
        return
    import torch

    work = Path(tempfile.mkdtemp(prefix="fsdp-bench-"))
    try:
        common = ["nest", args.model, "--train-steps", str(args.steps), "--batch-size", str(args.batch_size),
                  "--block-len", str(args.block_len), "--json", "--quiet"]
        one, one_s = run([sys.executable, "-m", "mlpsurgery", *common, "--out", str(work / "one")], args.ranks)
        sharded, sharded_s = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                                  str(args.ranks), "-m", "mlpsurgery", *common, "--out", str(work / "sharded")], 1)
        procs = sorted(({"rank": o.get("rank", 0), "memory": o["train"]["memory"]} for o in sharded),
                       key=lambda p: p["rank"])
        main0 = next(o for o in sharded if "rank" not in o)
        res = {"model": args.model, "steps": args.steps, "ranks": args.ranks, "batch_size": args.batch_size,
               "block_len": args.block_len, "command": "mlpsurgery " + " ".join(common[:1] + common[1:2] + ["..."]),
               "machine": f"{platform.machine()}, {os.cpu_count()} cores", "torch": torch.__version__,
               "one": [{"rank": 0, "memory": one[0]["train"]["memory"]}], "sharded": procs,
               "one_seconds": one_s, "sharded_seconds": sharded_s,
               "loss_one": [{"step": h["step"], "loss": h["loss"]} for h in one[0]["train"]["history"]],
               "loss_sharded": [{"step": h["step"], "loss": h["loss"]} for h in main0["train"]["history"]],
               "max_weight_diff": _max_diff(str(work / "one"), str(work / "sharded"))}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    text = render(res)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2) + "\n")
    if args.md:
        Path(args.md).write_text(text)
    print(text, end="")


if __name__ == "__main__":
    main()
