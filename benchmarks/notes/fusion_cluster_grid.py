"""Issue 45: what should MLP Fusion's k-means group when it has calibration data -- the neurons' weight vectors (the
paper's) or their contributions on calibration rows, and on how many rows? (`fuse --cluster-on`, FEATURE_ROWS in
methods/fusion/compress.py.) SmolLM2, the MLPs of the last two thirds of the layers to half width, calibrated on 64 x
128 train tokens (the demo's calibration), perplexity on the demo's 1,024 held-out Persuasion tokens (original 35.41).
One JSON line per variant appended to --out (a rerun skips the variants already there).

    python benchmarks/notes/fusion_cluster_grid.py --out docs/results/fusion-cluster-grid-smollm2.jsonl \\
        --variants weights:0:0,activations:1024:0,activations:4096:0,activations:1024:4

A variant is CLUSTER_ON:FEATURE_ROWS:LOCAL_EPOCHS (rows are ignored for weights).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import harness  # noqa: E402


def main() -> None:
    p = harness.grid_parser(__doc__, "CLUSTER_ON:FEATURE_ROWS:LOCAL_EPOCHS")
    p.add_argument("--max-tokens", type=int, default=1024)
    args = p.parse_args()
    harness.set_threads(args.threads, tokenizers_parallelism=False)
    import copy

    import mlpsurgery as ms
    import mlpsurgery.methods.fusion.compress as compress
    from mlpsurgery.measure.perplexity import default_block_len
    from mlpsurgery.methods.fusion import FusionConfig, fuse
    from mlpsurgery.sites import find_sites

    done = {(r["cluster_on"], r["feature_rows"], r["local_epochs"]) for r in harness.read_jsonl(args.out)}
    loaded, corpus, calib = harness.smollm2_calibration(128, 64)
    block = default_block_len(loaded.model)
    for spec in args.variants.split(","):
        on, rows, epochs = spec.split(":")
        key = (on, int(rows), float(epochs))
        if key in done:
            continue
        compress.FEATURE_ROWS = key[1] or compress.FEATURE_ROWS
        m = copy.deepcopy(loaded.model)
        t0 = time.perf_counter()
        fuse(m, FusionConfig(width=find_sites(m).mlp[0].h // 2, method="fusion", n_init=1,
                             cluster_on=on, local_epochs=key[2]), calib_data=calib, progress=False)
        build = time.perf_counter() - t0
        ppl = ms.perplexity(m, corpus.heldout, block_len=block, max_tokens=args.max_tokens, progress=False,
                            bos_id=corpus.bos).ppl
        row = {"cluster_on": on, "feature_rows": key[1], "local_epochs": key[2], "ppl": ppl, "build_s": build,
               "calib_tokens": int(calib.numel()), "machine": harness.machine()}
        harness.append_jsonl(args.out, row)
        print(f"{spec:22s} {ppl:8.2f} ({build:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
