"""How concentrated each layer's MLP sub-block update is on a few tokens, from a DLR-Lock work folder.

For every captured layer: the share of sum_t ||y_t - x_t||^2 (the denominator of phase 1's relative MSE)
held by the top 0.1% and top 1% of tokens. Where a handful of tokens hold nearly all of it, the relative
MSE is decided by those tokens alone.

    python benchmarks/notes/dlr_outlier_tokens.py runs/dlr/work-r64 [--chunks 2]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from mlpsurgery.report import table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the harness
import harness  # noqa: E402


def main() -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("workdir", help="a folder given to `mlpsurgery lock dlr --workdir` (kept with --keep-work)")
    ap.add_argument("--chunks", type=int, default=2, help="captured chunks to read, from the last (held-out) one")
    args = ap.parse_args()
    cap = Path(args.workdir) / "capture"
    if not (cap / "capture.json").exists():
        raise SystemExit(f"{cap} holds no capture; run `mlpsurgery lock dlr ... --workdir {args.workdir} --keep-work`")
    meta = harness.read_json(cap / "capture.json")
    chunks = [load_file(str(cap / f"chunk_{i:05d}.safetensors"))
              for i in range(meta["n_chunks"] - 1, max(-1, meta["n_chunks"] - 1 - args.chunks), -1)]
    rows = []
    for layer in meta["layers"]:
        n = torch.cat([(c[f"y.{layer}"].float() - c[f"x.{layer}"].float()).pow(2).sum(-1).flatten() for c in chunks])
        s = n.sort(descending=True).values
        rows.append({"layer": layer, "tokens": len(s), "top 0.1% share": float(s[:max(1, len(s) // 1000)].sum() / s.sum()),
                     "top 1% share": float(s[:max(1, len(s) // 100)].sum() / s.sum())})
    print(table(rows, markdown=True))


if __name__ == "__main__":
    main()
