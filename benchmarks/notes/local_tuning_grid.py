"""Issue 45: how many epochs and which learning rate for the on-policy local tuning (`fuse --local-epochs E
--local-lr LR`, methods/reconstruct/local.py)? SmolLM2, the MLPs of layers 10-29 at width 768 of 1,536, calibrated
on the default 256 x 128 train tokens (sequential, refit), then each layer tuned E epochs on its calibration rows
before the next is calibrated; held-out Persuasion perplexity (2,048 tokens, original 39.26). One JSON line per
variant appended to --out (a rerun skips the variants already there).

    python benchmarks/notes/local_tuning_grid.py --out docs/results/local-tuning-grid-smollm2.jsonl \\
        --variants neuron:2:1e-4,neuron:4:1e-3,neuron:8:3e-3,fusion:8:3e-3,fusion:16:3e-3,fusion:8:1e-2,svd:8:3e-3
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import harness  # noqa: E402


def main() -> None:
    p = harness.grid_parser(__doc__, "METHOD:EPOCHS:LR")
    p.add_argument("--width", type=int, default=768)
    p.add_argument("--layers", default="10-29")
    p.add_argument("--max-tokens", type=int, default=2048)
    args = p.parse_args()
    harness.set_threads(args.threads, tokenizers_parallelism=False)
    import copy

    import mlpsurgery as ms
    from mlpsurgery.methods.fusion import FusionConfig, fuse
    from mlpsurgery.methods.reconstruct import CALIB_BLOCKS, CALIB_LEN

    done = {(r["method"], r["epochs"], r["lr"]) for r in harness.read_jsonl(args.out)}
    loaded, corpus, calib = harness.smollm2_calibration(CALIB_LEN, CALIB_BLOCKS)
    for spec in args.variants.split(","):
        method, epochs, lr = spec.split(":")
        key = (method, float(epochs), float(lr))
        if key in done:
            continue
        m = copy.deepcopy(loaded.model)
        t0 = time.perf_counter()
        rep = fuse(m, FusionConfig(width=args.width, method=method, layers=args.layers, n_init=1,
                                   local_epochs=key[1], local_lr=key[2]), calib_data=calib, progress=False)
        build = time.perf_counter() - t0
        ppl = ms.perplexity(m, corpus.heldout, block_len=512, max_tokens=args.max_tokens, progress=False,
                            bos_id=corpus.bos).ppl
        local = [s["local"] for s in rep["sites"] if s.get("local")]
        row = {"method": method, "epochs": key[1], "lr": key[2], "ppl": ppl, "build_s": build,
               "local_s": sum(s["seconds"] for s in local), "steps_per_layer": local[0]["steps"] if local else 0,
               "layers_kept": sum(bool(s["kept"]) for s in local), "calib_tokens": int(calib.numel()),
               "machine": harness.machine()}
        harness.append_jsonl(args.out, row)
        print(f"{method:7s} {key[1]:5g} epochs lr {key[2]:g}: {ppl:8.2f} ({build:.0f} s, local {row['local_s']:.0f} s)",
              flush=True)


if __name__ == "__main__":
    main()
