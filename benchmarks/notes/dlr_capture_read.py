"""Peak resident memory of reading a DLR-Lock captured set into RAM: the chunks stacked and concatenated (how
`_CapturedSet` read them before) against written into one tensor allocated once (`captured.py` now).

A capture of SmolLM2's shape (30 layers, d = 576, bfloat16, chunks of 8 blocks x 256 tokens) is written to a
temporary folder with random values; each way of reading it runs in a process of its own, whose peak RSS is the
kernel's (os.wait4), beside an interpreter that only imports the same modules.

    python benchmarks/notes/dlr_capture_read.py [--chunks 16] [--json docs/results/dlr-capture-read.json]
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the harness
import harness  # noqa: E402

LAYERS, D, TOKENS = 30, 576, 2048

CHILD = """
import sys, torch
from pathlib import Path
from mlpsurgery.capture import Capture
from mlpsurgery.methods.dlr_lock.captured import _CapturedSet
root, n, how = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
layers = list(range({layers}))
cap = Capture(layers=layers, d={d}, root=root, n_chunks=n, tokens_per_chunk=[{tokens}] * n)
if how == "stack-cat":  # the read before: per chunk a stack of the layers, then one concatenation of the chunks
    xs, ys = [], []
    for k in range(n):
        c = cap.chunk(k, layers)
        xs.append(torch.stack([c[i][0] for i in layers]))
        ys.append(torch.stack([c[i][1] for i in layers]))
    X, Y = torch.cat(xs, 1), torch.cat(ys, 1)
elif how == "preallocated":
    s = _CapturedSet(cap, layers, list(range(n)), memory_limit_gb=1e9)
    X, Y = s.X, s.Y
print(0 if how == "baseline" else X.shape[1])
""".format(layers=LAYERS, d=D, tokens=TOKENS)


def peak(args: list[str]) -> int:
    proc = subprocess.Popen([sys.executable, "-c", CHILD, *args], stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status):
        raise SystemExit(f"{args[-1]} failed")
    return usage.ru_maxrss * 1024


def main() -> None:
    p = harness.parser(__doc__, json=True)
    p.add_argument("--chunks", type=int, default=16)
    args = p.parse_args()
    g = torch.Generator().manual_seed(0)
    with tempfile.TemporaryDirectory(prefix="dlr-capture-") as tmp:
        root = Path(tmp)
        for k in range(args.chunks):
            save_file({f"{w}.{i}": torch.randn(TOKENS, D, generator=g).to(torch.bfloat16)
                       for i in range(LAYERS) for w in "xy"}, str(root / f"chunk_{k:05d}.safetensors"))
        set_bytes = 2 * LAYERS * args.chunks * TOKENS * D * 2
        base = peak([tmp, str(args.chunks), "baseline"])
        rows = {how: peak([tmp, str(args.chunks), how]) for how in ("stack-cat", "preallocated")}
    gib = 2**30
    result = {"set_bytes": set_bytes, "baseline_rss_bytes": base, "peak_rss_bytes": rows,
              "excess_over_set": {h: round((r - base) / set_bytes, 2) for h, r in rows.items()},
              "shape": {"layers": LAYERS, "d": D, "chunks": args.chunks, "tokens_per_chunk": TOKENS},
              "machine": harness.machine("{arch} {cores} cores, {platform}")}
    print(f"captured set {set_bytes / gib:.2f} GiB (x and y of {LAYERS} layers, {args.chunks * TOKENS} tokens, "
          f"bfloat16); interpreter {base / gib:.2f} GiB")
    for h, r in rows.items():
        print(f"  {h:13s} peak {r / gib:5.2f} GiB = baseline + {(r - base) / set_bytes:.2f} x the set")
    if args.json:
        harness.write_json(args.json, result)


if __name__ == "__main__":
    main()
