"""Issue 45: does a bias slot on the down projection help the least-squares refit of a Llama MLP? SmolLM2 rebuilt
with `mlp_bias=True` (gate / up / down biases zero: the same function, 39.26 on the held-out tokens), then half-width
neuron pruning of the last 20 MLPs calibrated on BLOCKS x LEN train tokens, where the refit now also fits the down
bias (FLAP's mean compensation, as a ones column of the least squares). Answer (docs/notes/calibration.md): 57.23
against 57.21 without the slot at 8k tokens -- nothing, since the refit of the uncentred outputs already absorbs the
mean through the kept neurons.

    python benchmarks/notes/calibration_bias_slot.py --blocks 64 --len 128
"""

from __future__ import annotations

import copy
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import harness  # noqa: E402


def main() -> None:
    p = harness.parser(__doc__, threads=2)
    p.add_argument("--blocks", type=int, default=64)
    p.add_argument("--len", type=int, default=128)
    args = p.parse_args()
    harness.set_threads(args.threads)
    import mlpsurgery as ms
    from mlpsurgery.methods.fusion import FusionConfig, fuse

    loaded = ms.load_model()
    model = loaded.model
    corpus = ms.load_corpus(None, loaded.tokenizer)

    def ppl(m) -> float:
        return ms.perplexity(m, corpus.heldout, block_len=512, max_tokens=2048, progress=False, bos_id=corpus.bos).ppl

    cfg = copy.deepcopy(model.config)
    cfg.mlp_bias = True
    biased = type(model)(cfg)
    biased.load_state_dict(model.state_dict(), strict=False)
    for name, param in biased.named_parameters():
        if name.endswith(("mlp.gate_proj.bias", "mlp.up_proj.bias", "mlp.down_proj.bias")):
            param.data.zero_()
    biased.eval()
    before = ppl(biased)
    t0 = time.perf_counter()
    calib = corpus.blocks("train", args.len, max_blocks=args.blocks, seed=0)
    fuse(biased, FusionConfig(width=768, method="neuron", layers="last2/3", n_init=1), calib_data=calib,
         progress=False)
    print(json.dumps({"machine": harness.machine(), "blocks": args.blocks, "len": args.len,
                      "original_with_zero_biases": before, "bias_refit_ppl": ppl(biased),
                      "seconds": time.perf_counter() - t0}))


if __name__ == "__main__":
    main()
