"""GPU smoke run (issue 16): every CLI command on a random-weight llama of a real shape in bfloat16, once with
`--device cpu` and once with `--device DEVICE`, each result checked against the CPU's.

No weights travel to the GPU machine: the model (a llama of about --params parameters, SwiGLU, grouped-query
attention, the byte tokenizer's vocabulary) is written on the spot by `mlpsurgery.tiny.write_synthetic`. For every
command: exit status and wall time on both devices, and, where it writes a model, the relative difference of the
two folders' logits on a fixed probe batch (both loaded on the CPU in float32), against a tolerance at bf16
precision (commands that train compare looser: the devices' summation orders diverge over steps). `unlock` must
also give back the input bit for bit on each device.

    python benchmarks/gpu_smoke.py --device cuda --json $OUT/gpu-smoke.json --md $OUT/gpu-smoke.md     # on the GPU
    python benchmarks/gpu_smoke.py --device cpu --params 3e7 --d 256                                   # the harness here

Exit status 1 when a command fails or a comparison is outside its tolerance.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

import harness

BF16 = 5e-2  # relative logits difference two bf16 runs of one model may show (accumulation order, rounding)
TRAINED = 0.25  # after training steps on two devices
# Methods that make discrete choices from bf16 activations (which weights to prune, which neurons to cluster) choose
# differently near their thresholds when another device's kernels compute those activations, and the differences
# cascade (SparseGPT's later choices depend on its earlier updates; k-means on its assignments). Their two models'
# logits are reported, not bounded (on random weights two 99.9%-equal Wanda masks gave logits 4% apart, two 94%-equal
# SparseGPT masks 38%); what must hold is equal quality: each model as far from the original as the other (the ratio
# of their logits distances to the original within SPREAD), and for pruning masks that agree on at least
# MASK_AGREEMENT of the weights either pruned (measured on an H100: Wanda 0.9988, SparseGPT 0.941).
PRUNED = "masks"
QUALITY = "quality"
MASK_AGREEMENT = {"wanda": 0.99, "sparsegpt": 0.90, "sparsegpt-lw": 0.90}
SPREAD = 1.25


def commands(m: Path, w: Path, width: int) -> list[tuple[str, list[str], str | None, float]]:
    """(name, argv, output folder compared, tolerance); `w` is the device's work folder."""
    dlr = ["--layers", "0,1", "--rank", "16", "--calib-blocks", "8", "--block-len", "64", "--phase1-steps", "10",
           "--phase1-tokens", "128", "--phase1-hard-fraction", "0", "--onpolicy-steps", "0", "--phase2-steps", "2",
           "--phase2-blocks", "4", "--phase2-batch", "2", "--top-k", "8", "--eval-tokens", "0", "--no-compile",
           "--no-layerwise"]  # (the default is layer by layer on the CPU, whole on a GPU: one mode on both devices)
    return [
        ("inspect", ["inspect", str(m)], None, 0),
        ("eval ppl", ["eval", "ppl", str(m), "--max-tokens", "4096", "--block-len", "256"], None, 0),
        ("prune wanda", ["prune", str(m), "--method", "wanda", "--sparsity", "0.5", "--calib-blocks", "8",
                         "--block-len", "128", "--out", str(w / "wanda")], "wanda", PRUNED),
        ("prune sparsegpt", ["prune", str(m), "--method", "sparsegpt", "--sparsity", "0.5", "--calib-blocks", "8",
                             "--block-len", "128", "--out", str(w / "sparsegpt")], "sparsegpt", PRUNED),
        ("lock key", ["lock", "key", str(m), "--ratio", "0.05", "--out", str(w / "locked"), "--key",
                      str(w / "key.safetensors")], "locked", BF16),
        ("unlock", ["unlock", str(w / "locked"), "--key", str(w / "key.safetensors"), "--out", str(w / "unlocked")],
         "unlocked", BF16),
        ("fuse neuron", ["fuse", str(m), "--method", "neuron", "--width", str(width), "--layers", "last2/3",
                         "--out", str(w / "fused")], "fused", BF16),
        ("fuse fusion + tuning", ["fuse", str(m), "--width", str(width), "--layers", "0,1", "--tune-data", "austen",
                                  "--tune-blocks", "8", "--block-len", "64", "--out", str(w / "fusion")],
         "fusion", QUALITY),
        ("export", ["export", str(w / "fused"), "--out", str(w / "exported")], "exported", BF16),
        ("nest", ["nest", str(m), "--out", str(w / "nested")], "nested", BF16),
        ("nest rank", ["nest", "rank", str(w / "nested"), "--rank", "64", "--out", str(w / "rank64")], "rank64", BF16),
        ("twist extract", ["twist", "extract", str(m), "--keep", "2", "--blocks", "4", "--out", str(w / "subnet")],
         "subnet", BF16),  # (R = 4 divides every width write_synthetic makes; 12 does not)
        ("lock dlr", ["lock", "dlr", str(m), *dlr, "--out", str(w / "dlr")], "dlr", TRAINED),
        # layer by layer (each layer worked on the device, the activations between layers in host memory)
        ("eval ppl --layerwise", ["eval", "ppl", str(m), "--max-tokens", "4096", "--block-len", "256", "--layerwise"],
         None, 0),
        ("prune sparsegpt --layerwise", ["prune", str(m), "--method", "sparsegpt", "--sparsity", "0.5", "--calib-blocks",
                                         "8", "--block-len", "128", "--layerwise", "--out", str(w / "sparsegpt-lw")],
         "sparsegpt-lw", PRUNED),
        ("fuse fusion + tuning --layerwise", ["fuse", str(m), "--width", str(width), "--layers", "0,1", "--tune-data",
                                              "austen", "--tune-blocks", "8", "--block-len", "64", "--layerwise",
                                              "--out", str(w / "fusion-lw")], "fusion-lw", QUALITY),
        ("nest --layerwise", ["nest", str(m), "--layerwise", "--out", str(w / "nested-lw")], "nested-lw", BF16),
        ("lock dlr --layerwise", ["lock", "dlr", str(m), *dlr[:-1], "--layerwise", "--out", str(w / "dlr-lw")],
         "dlr-lw", TRAINED),
    ]


def start(argv: list[str], device: str, threads: int) -> Future:
    """The command running in a thread of its own; its result (exit status, its own wall time, log tail)."""
    env = harness.child_env(threads)
    cmd = [sys.executable, "-m", "mlpsurgery", *argv, "--device", device, "--dtype", "bfloat16", "--json", "--quiet"]

    def run():
        t0 = time.perf_counter()
        r = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        return r.returncode, time.perf_counter() - t0, r.stdout[-2000:]

    return POOL.submit(run)


POOL = ThreadPoolExecutor(max_workers=2)


def logits(folder: Path, probe: torch.Tensor) -> torch.Tensor:
    from mlpsurgery.models import load_model

    model = load_model(str(folder), dtype=torch.float32).model.eval()
    with torch.no_grad():
        return model(input_ids=probe).logits.double()


def alike(original: Path, a: Path, b: Path, la: torch.Tensor, lb: torch.Tensor, probe: torch.Tensor, row: dict,
          agreement: float | None) -> bool:
    """Two devices' results of a method with discrete choices: equally far from the original (SPREAD) and, for
    pruning (`agreement` given), masks that agree on that fraction of the weights either pruned; the figures go
    into `row`."""
    from mlpsurgery.io import load

    ok = True
    if agreement is not None:
        sa, sb = load(str(a)).state_dict(), load(str(b)).state_dict()
        pruned = agree = 0
        for k, wa in sa.items():
            za, zb = wa == 0, sb[k] == 0
            pruned += int((za | zb).sum())
            agree += int((za & zb).sum())
        row["mask_agreement"] = agree / max(pruned, 1)
        row["mask_agreement_min"] = agreement
        ok = row["mask_agreement"] >= agreement
    base = logits(original, probe)
    da, db = (float((x - base).norm() / base.norm()) for x in (la, lb))
    row["cpu_vs_original"], row["device_vs_original"] = da, db
    return ok and max(da, db) <= SPREAD * min(da, db)


def restores(original: Path, unlocked: Path) -> bool:
    """Whether `unlocked` holds exactly the original checkpoint's tensors."""
    from mlpsurgery.io import load
    from mlpsurgery.models import load_model

    a = load_model(str(original), dtype=torch.bfloat16).model.state_dict()
    b = load(str(unlocked)).state_dict()
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def main() -> int:
    ap = harness.parser(__doc__, summary=True, json=True, md=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--params", type=float, default=5e8, help="parameters of the synthetic llama (5e8)")
    ap.add_argument("--d", type=int, help="its width (default: by size, as write_synthetic chooses)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="CPU threads of the CPU runs")
    ap.add_argument("--parallel", action="store_true", help="run each command on both devices at once (the "
                                                            "GPU run needs little CPU; halves the wall time there)")
    ap.add_argument("--only", help="comma-separated command names to run (default: all); unlock, export and nest "
                                   "rank read what lock key, fuse neuron and nest wrote: name those too")
    ap.add_argument("--deadline", type=float, default=0,
                    help="seconds after which no further command is started (0: none); the tables are still written")
    args = ap.parse_args()

    from mlpsurgery.tiny import byte_tokenizer, write_synthetic

    root = Path(tempfile.mkdtemp(prefix="gpu-smoke-"))
    rows, failed = [], False
    try:
        tok = byte_tokenizer()
        tok.save_pretrained(root / "tok")
        model = root / "model"
        n = write_synthetic(model, n_params=args.params, dtype=torch.bfloat16, tokenizer_from=root / "tok",
                            vocab_size=len(tok), d=args.d)
        h = json.loads((model / "config.json").read_text())["intermediate_size"]
        probe = torch.randint(3, len(tok), (2, 64), generator=torch.Generator().manual_seed(0))
        wanted = set(args.only.split(",")) if args.only else None
        runs = (("ref", "cpu"), ("dev", args.device))  # each in a work folder of its own
        todo = {key: commands(model, root / key, h // 2) for key, _ in runs}
        past_deadline = harness.deadline(args.deadline)
        for j, (name, _, out, tol) in enumerate(todo["ref"]):
            if wanted and name not in wanted:
                continue
            if past_deadline():
                print(f"deadline: {name} and the commands after it not run", flush=True)
                break
            row = {"command": name, "tolerance": tol}
            jobs = {}
            for (key, dev), label in zip(runs, ("cpu", "device")):
                (root / key).mkdir(exist_ok=True)
                jobs[label] = start(todo[key][j][1], dev, args.threads)
                if not args.parallel:
                    jobs[label].result()
            for label, job in jobs.items():
                code, secs, log = job.result()
                row[f"{label}_status"], row[f"{label}_seconds"] = code, secs
                if code:
                    row[f"{label}_log"] = log
            ok = row["cpu_status"] == 0 and row["device_status"] == 0
            if ok and out:
                a, b = root / "ref" / out, root / "dev" / out
                ref, got = logits(a, probe), logits(b, probe)
                row["logits_rel_diff"] = float((got - ref).norm() / ref.norm())
                if tol in (PRUNED, QUALITY):
                    ok = alike(model, a, b, ref, got, probe, row, MASK_AGREEMENT.get(out) if tol == PRUNED else None)
                else:
                    ok = row["logits_rel_diff"] <= tol
                if name == "unlock":  # the input given back bit for bit, on each device
                    row["unlock_exact"] = restores(model, a) and restores(model, b)
                    ok = ok and row["unlock_exact"]
            row["ok"] = ok
            failed |= not ok
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if not k.endswith("_log")}), flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    import mlpsurgery

    res = {"device": args.device, "device_name": torch.cuda.get_device_name() if args.device.startswith("cuda")
           and torch.cuda.is_available() else harness.machine("{processor}"),
           "params": n, "torch": torch.__version__, "mlpsurgery": mlpsurgery.__version__, "rows": rows}
    md = render(res)
    if args.json:
        harness.write_json(args.json, res)
    if args.md:
        harness.write_md(args.md, md)
    print(md, end="")
    return 1 if failed else 0


def render(res: dict) -> str:
    lines = [f"GPU smoke: a random-weight llama of {res['params'] / 1e6:.0f} M parameters, bfloat16; device "
             f"{res['device']} ({res['device_name']}); torch {res['torch']}.", "",
             "| command | CPU | device | logits vs CPU (rel.) | tolerance | ok |", "|---|---|---|---|---|---|"]
    for r in res["rows"]:
        def cell(k):
            return f"{r[k + '_seconds']:.1f} s" + ("" if r[k + "_status"] == 0 else f" (exit {r[k + '_status']})")

        diff = f"{r['logits_rel_diff']:.2e}" if "logits_rel_diff" in r else "-"
        tol = r["tolerance"] or "-"
        if "cpu_vs_original" in r:
            tol = (f"vs the original {r['cpu_vs_original']:.3f} / {r['device_vs_original']:.3f} (ratio <= {SPREAD})"
                   + (f"; masks agree {r['mask_agreement']:.4f} (>= {r['mask_agreement_min']})"
                      if "mask_agreement" in r else ""))
        lines.append(f"| {r['command']} | {cell('cpu')} | {cell('device')} | {diff} | {tol} | "
                     f"{'yes' if r['ok'] else '**no**'} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
