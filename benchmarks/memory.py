"""Peak resident memory of every one-shot command, float32 vs bfloat16, as multiples of the weights' bytes.

Each command runs as its own process (the CLI a user runs, at small budgets: the memory of these commands is
set by the model, not by the number of calibration tokens); its peak resident set size is read from the
kernel's accounting of that process alone (os.wait4). The interpreter baseline is a process that only imports
mlpsurgery's CLI, torch and transformers. Columns: peak RSS, peak minus the baseline, and that excess as a
multiple of the weights' bytes in the dtype the command ran in.

    python benchmarks/memory.py [--model smollm2] --json docs/results/memory-smollm2.json --md docs/results/memory-smollm2.md
    python benchmarks/memory.py --synthetic 2e9 --dtypes bfloat16 --only inspect,fuse,lock,unlock,export \
        --json docs/results/memory-synthetic-2b.json --md docs/results/memory-synthetic-2b.md
    python benchmarks/memory.py --match magnitude,layerwise --json docs/results/memory-smollm2-layerwise.json \
        --md docs/results/memory-smollm2-layerwise.md          # the layer-sequential rows (and whole magnitude)

Threads are pinned (OMP_NUM_THREADS=2) so that runs are comparable; the numbers do not depend on timing.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import harness

EXE = [sys.executable, "-m", "mlpsurgery"]
cpu_name = harness.cpu_name  # (`from memory import cpu_name` keeps working)


def _status(pid: int) -> dict[str, int]:
    """VmRSS, RssAnon, RssFile of a live process, in bytes (empty once it is gone)."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        key = line.split(":")[0]
        if key in ("VmRSS", "RssAnon", "RssFile"):
            out[key] = int(line.split()[1]) * 1024
    return out


def peak_rss(cmd: list[str], env: dict) -> tuple[int, float, int, str, int]:
    """(peak RSS in bytes, seconds, exit status, the last stage line the command printed before its peak, peak
    anonymous memory) of one process run to completion. The peak RSS is the kernel's (os.wait4). Polling
    /proc every 20 ms beside the command's stderr (progress lines) says which step needs the memory and how much
    of it is anonymous (the process's own allocations) rather than file pages (a memory-mapped checkpoint's
    pages count in RSS while mapped, but the kernel can drop them); a poll can miss a brief spike, so the
    anonymous peak is a lower bound."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    state = {"line": "", "peak": 0, "at": "", "tail": [], "anon": 0}

    def read_stderr():
        for raw in iter(proc.stderr.readline, b""):
            for part in raw.decode(errors="replace").replace("\r", "\n").split("\n"):
                if part.strip():
                    state["line"] = part.strip()[:100]
                    state["tail"] = (state["tail"] + [part])[-20:]

    reader = threading.Thread(target=read_stderr, daemon=True)
    reader.start()
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)  # (not proc.poll(): its reaping loses the rusage)
        if pid:
            break
        now = _status(proc.pid)
        rss = now.get("VmRSS", 0)
        state["anon"] = max(state["anon"], now.get("RssAnon", 0))
        if rss > state["peak"]:
            state["peak"], state["at"] = rss, state["line"]
        time.sleep(0.02)
    rc = proc.returncode = os.waitstatus_to_exitcode(status)
    reader.join(timeout=5)
    peak = usage.ru_maxrss * 1024
    if rc:
        sys.stderr.write("".join(state["tail"])[-2000:] + "\n")
    return peak, time.perf_counter() - t0, rc, state["at"], state["anon"]


def write_synthetic_child(folder: str, n_params: float, env: dict | None = None) -> tuple[int, int, int, int]:
    """A random-weight llama of about `n_params` parameters written to `folder` (bfloat16 safetensors shards, the
    SmolLM2 tokenizer) by a child process, so that the caller stays small (a child's peak RSS, os.wait4, includes
    its parent's resident memory at the fork); (parameters, d, MLP width, layers)."""
    code = ("import json, sys; from mlpsurgery.models import smollm2_dir; "
            "from mlpsurgery.tiny import synthetic_llama_config, write_synthetic; "
            "n = write_synthetic(sys.argv[1], float(sys.argv[2]), tokenizer_from=smollm2_dir()); "
            "c = synthetic_llama_config(float(sys.argv[2])); "
            "print(json.dumps([n, c.hidden_size, c.intermediate_size, c.num_hidden_layers]))")
    out = subprocess.run([sys.executable, "-c", code, folder, str(n_params)], env=env, check=True,
                         capture_output=True, text=True).stdout
    return tuple(json.loads(out))


DLR_SMALL = ["--calib-blocks", "16", "--block-len", "128", "--phase1-steps", "4", "--onpolicy-steps", "2",
             "--start-tokens", "1024", "--phase2-steps", "0", "--eval-tokens", "0"]


def commands(model: str, dtype: str, work: Path, width: int = 768, fuse_method: str = "fusion"
             ) -> list[tuple[str, list[str]]]:
    """(label, argv) of every command measured, in the order they run (unlock and export use earlier outputs)."""
    d = ["--dtype", dtype]
    w = work / dtype
    how = [] if fuse_method == "fusion" else ["--method", fuse_method]
    return [
        ("inspect", ["inspect", model, *d]),
        ("eval ppl (8k tokens)", ["eval", "ppl", model, *d, "--max-tokens", "8192"]),
        ("eval ppl (8k tokens) --layerwise", ["eval", "ppl", model, *d, "--max-tokens", "8192", "--layerwise"]),
        (f"fuse {' '.join(how + [''])}--width {width} --layers all", ["fuse", model, *d, *how, "--width", str(width),
                                                                      "--layers", "all", "--out", str(w / "fused")]),
        (f"fuse {' '.join(how + [''])}--width {width} --layers all --layerwise",
         ["fuse", model, *d, *how, "--width", str(width), "--layers", "all", "--layerwise", "--out", str(w / "fused-lw")]),
        # layer-wise tuning on 16 blocks of 128 tokens of the bundled text: every layer's pairs captured and tuned in
        # one model, or each layer captured and tuned as it is read
        (f"fuse {' '.join(how + [''])}--width {width} --layers all --tune-data austen --tune-blocks 16",
         ["fuse", model, *d, *how, "--width", str(width), "--layers", "all", "--tune-data", "austen", "--tune-blocks",
          "16", "--out", str(w / "fused-tuned")]),
        (f"fuse {' '.join(how + [''])}--width {width} --layers all --tune-data austen --tune-blocks 16 --layerwise",
         ["fuse", model, *d, *how, "--width", str(width), "--layers", "all", "--tune-data", "austen", "--tune-blocks",
          "16", "--layerwise", "--out", str(w / "fused-tuned-lw")]),
        ("nest (SVD of every MLP projection)", ["nest", model, *d, "--out", str(w / "nested")]),
        ("nest (SVD of every MLP projection) --layerwise", ["nest", model, *d, "--layerwise",
                                                            "--out", str(w / "nested-lw")]),
        ("prune magnitude 50%", ["prune", model, *d, "--method", "magnitude", "--sparsity", "0.5",
                                 "--out", str(w / "magnitude")]),
        ("prune magnitude 50% --layerwise", ["prune", model, *d, "--method", "magnitude", "--sparsity", "0.5",
                                             "--layerwise", "--out", str(w / "magnitude-lw")]),
        ("prune wanda 50%", ["prune", model, *d, "--method", "wanda", "--sparsity", "0.5", "--out", str(w / "wanda")]),
        ("prune sparsegpt 50%", ["prune", model, *d, "--method", "sparsegpt", "--sparsity", "0.5",
                                 "--out", str(w / "sparsegpt")]),
        ("prune wanda 50% --layerwise", ["prune", model, *d, "--method", "wanda", "--sparsity", "0.5", "--layerwise",
                                         "--out", str(w / "wanda-lw")]),
        ("prune sparsegpt 50% --layerwise", ["prune", model, *d, "--method", "sparsegpt", "--sparsity", "0.5",
                                             "--layerwise", "--out", str(w / "sparsegpt-lw")]),
        # Fisher block pruning: a backward pass of the whole model, or one layer at a time over every layer's inputs
        ("prune fisher 50%", ["prune", model, *d, "--method", "fisher", "--sparsity", "0.5", "--out", str(w / "fisher")]),
        ("prune fisher 50% --layerwise", ["prune", model, *d, "--method", "fisher", "--sparsity", "0.5", "--layerwise",
                                          "--out", str(w / "fisher-lw")]),
        ("lock key --ratio 0.05", ["lock", "key", model, *d, "--ratio", "0.05", "--out", str(w / "locked"),
                                   "--key", str(w / "key.bin")]),
        ("lock key --ratio 0.05 --layerwise", ["lock", "key", model, *d, "--ratio", "0.05", "--layerwise",
                                               "--out", str(w / "locked-lw"), "--key", str(w / "key-lw.bin")]),
        ("unlock", ["unlock", str(w / "locked"), *d, "--key", str(w / "key.bin"), "--out", str(w / "unlocked")]),
        ("unlock --layerwise", ["unlock", str(w / "locked-lw"), *d, "--key", str(w / "key-lw.bin"), "--layerwise",
                                "--out", str(w / "unlocked-lw")]),
        ("export (fused)", ["export", str(w / "fused"), *d, "--out", str(w / "exported")]),
        ("nest rank --rank 64 (of the nest row's folder)", ["nest", "rank", str(w / "nested"), *d, "--rank", "64",
                                                             "--out", str(w / "nested-r64")]),
        ("nest rank --rank 64 --layerwise (of the nest row's folder)",
         ["nest", "rank", str(w / "nested"), *d, "--rank", "64", "--layerwise", "--out", str(w / "nested-r64-lw")]),
        ("twist extract --keep 6 (of 12 MLP chunks)", ["twist", "extract", model, *d, "--keep", "6",
                                                       "--out", str(w / "twist-k6")]),
        ("twist extract --keep 6 (of 12 MLP chunks) --layerwise", ["twist", "extract", model, *d, "--keep", "6",
                                                                   "--layerwise", "--out", str(w / "twist-k6-lw")]),
        # DLR-Lock's phase 1 (capture, closed-form start, steps, on-policy steps; no phase 2) at a small budget: the
        # whole-model run trains every layer's net side by side, the layer-by-layer one a layer's net at a time
        ("lock dlr phase 1 only (16 blocks x 128 tokens; 4 + 2 steps)", ["lock", "dlr", model, *d, *DLR_SMALL,
                                                                            "--no-layerwise", "--out", str(w / "dlr")]),
        ("lock dlr phase 1 only (16 blocks x 128 tokens; 4 + 2 steps) --layerwise",
         ["lock", "dlr", model, *d, *DLR_SMALL, "--layerwise", "--out", str(w / "dlr-lw")]),
        # layer-by-layer commands chained: the subnet folder above (mlpsurgery's, with narrowed layers) read back
        ("prune magnitude 50% --layerwise (of the layer-by-layer subnet)",
         ["prune", str(w / "twist-k6-lw"), *d, "--method", "magnitude", "--sparsity", "0.5", "--layerwise",
          "--out", str(w / "subnet-magnitude-lw")]),
        ("lock key --ratio 0.05 --layerwise (of the layer-by-layer subnet)",
         ["lock", "key", str(w / "twist-k6-lw"), *d, "--ratio", "0.05", "--layerwise",
          "--out", str(w / "subnet-locked-lw"), "--key", str(w / "subnet-key-lw.bin")]),
    ]


def free_outputs(work: Path, done: list[tuple[str, list[str]]], later: list[tuple[str, list[str]]]) -> None:
    """Remove what the commands run so far wrote (their --out folders and --key files) that no later command reads:
    on the 2 B model in float32 each output is about 8 GB, and all of them together would fill a 64 GB disk."""
    wanted = {a for _, argv in later for a in argv}
    for _, argv in done:
        for flag, value in zip(argv, argv[1:]):
            path = Path(value)
            if flag in ("--out", "--key") and value not in wanted and work in path.parents and path.exists():
                shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink()


def render(result: dict) -> str:
    """The markdown table of a result (also from a saved JSON: --render)."""
    base, base_anon = result["baseline_rss_bytes"], result["baseline_anon_bytes"]
    lines = [f"Model {result['model']} ({result['parameters'] / 1e6:.1f} M parameters); interpreter baseline "
             f"{base / 2**30:.2f} GiB ({base_anon / 2**30:.2f} GiB anonymous); {result['machine']}.", "",
             "| command | dtype | peak RSS | above baseline | x weights | peak anonymous | its excess x weights | s "
             "| peak during |", "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in result["rows"]:
        during = r["peak_during"].split("|")[0].strip()  # a progress bar's label, not its bar
        lines.append(f"| {r['command']} | {r['dtype']} | {r['peak_rss_bytes'] / 2**30:.2f} GiB | "
                     f"{r['excess_bytes'] / 2**30:.2f} GiB | {r['excess_over_weights']:.2f} | "
                     f"{r['peak_anon_bytes'] / 2**30:.2f} GiB | {r['anon_excess_over_weights']:.2f} | {r['seconds']:.0f} | "
                     f"{during} |" + ("" if r["exit_status"] == 0 else f" (exit {r['exit_status']})"))
    return "\n".join(lines) + "\n"


def main() -> None:
    p = harness.parser(__doc__, json=True, md=True)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--synthetic", type=float, metavar="N",
                   help="instead of --model: a random-weight llama of about N parameters (e.g. 2e9), bfloat16, written "
                        "as 1 GB safetensors shards to a temporary folder (SmolLM2's tokenizer); fuse keeps neurons "
                        "by norm (k-means at this size would take hours here)")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--only", help="comma-separated labels' first words to run (e.g. lock,unlock)")
    p.add_argument("--match", help="comma-separated: run only the labels holding one of these (e.g. layerwise)")
    p.add_argument("--skip", help="comma-separated: leave out the labels holding one of these (e.g. tune-data)")
    p.add_argument("--render", metavar="JSON", help="only write --md from a saved --json result")
    args = p.parse_args()
    if args.render:
        harness.write_md(args.md, render(harness.read_json(args.render)))
        return
    env = harness.child_env(2, MKL_NUM_THREADS="2", TOKENIZERS_PARALLELISM="false")
    work = Path(tempfile.mkdtemp(prefix="mlpsurgery-memory-"))
    model, fuse_method, shown = args.model, "fusion", args.model
    rows = []
    head = {}

    def save() -> None:
        if not head:
            return
        result = {**head, "rows": rows}
        if args.json:
            harness.write_json(args.json, result)
        if args.md:
            harness.write_md(args.md, render(result))

    try:  # the temporary folder (and a synthetic model in it) is removed however the run ends
        if args.synthetic:
            # written by a child process: this one must stay small, because a child's peak RSS (os.wait4) includes
            # its parent's resident memory at the fork
            model = str(work / "synthetic")
            t0 = time.perf_counter()
            count, d, h, depth = write_synthetic_child(model, args.synthetic, env)
            shown = (f"synthetic llama, random weights ({count / 1e9:.2f} B parameters: d {d}, MLP {h}, {depth} "
                     f"layers; bfloat16 shards of 1 GB, written in {time.perf_counter() - t0:.0f} s)")
            fuse_method = "neuron"
        info = json.loads(subprocess.run(EXE + ["inspect", model, "--json", "--quiet"], env=env, check=True,
                                         capture_output=True, text=True).stdout)
        n_params = info["params"]["total"]
        width = info["mlp_inner_width"] // 2 if args.synthetic else 768
        base, _, _, _, base_anon = peak_rss([sys.executable, "-c", "import torch, transformers, mlpsurgery.cli"], env)
        machine = harness.machine("{arch} {cores} cores ({cpu_name}), {platform}")
        head.update({"model": shown, "parameters": n_params, "baseline_rss_bytes": base,
                     "baseline_anon_bytes": base_anon, "machine": machine, "python": platform.python_version()})
        for dtype in args.dtypes.split(","):
            weights = n_params * (4 if dtype == "float32" else 2)
            chosen = [(label, argv) for label, argv in commands(model, dtype, work, width, fuse_method)
                      if not (args.only and label.split()[0] not in args.only.split(","))
                      and not (args.match and not any(m in label for m in args.match.split(",")))
                      and not (args.skip and any(m in label for m in args.skip.split(",")))]
            for j, (label, argv) in enumerate(chosen):
                rss, secs, rc, at, anon = peak_rss(EXE + argv, env)
                free_outputs(work, chosen[:j + 1], chosen[j + 1:])
                row = {"command": label, "dtype": dtype, "peak_rss_bytes": rss, "seconds": round(secs, 1),
                       "exit_status": rc, "peak_during": at, "peak_anon_bytes": anon,
                       "anon_excess_over_weights": round((anon - base_anon) / weights, 2),
                       "excess_bytes": rss - base, "weights_bytes": weights,
                       "excess_over_weights": round((rss - base) / weights, 2)}
                rows.append(row)
                save()  # after every row: a run stopped later keeps what it measured
                print(f"{label:32s} {dtype:9s} peak {rss / 2**30:6.2f} GiB  excess {(rss - base) / 2**30:6.2f} GiB "
                      f"= {row['excess_over_weights']:5.2f}x weights; anonymous {anon / 2**30:.2f} GiB  "
                      f"({secs:.0f} s, exit {rc}; peak during: {at})", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    save()

if __name__ == "__main__":
    main()
