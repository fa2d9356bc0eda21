"""Issue 45, session 33: what the demo's shorter DLR-Lock phase 1 and NSN local tuning cost in quality. On the demo's
data (SmolLM2, 8k calibration tokens / 2k DLR training tokens, perplexity on its 1,024 held-out tokens):

    python benchmarks/notes/demo_short_tuning.py dlr 60,20 40,14 30,10 40,0 30,0
        # DLR-Lock of layers 5, 15, 25 (rank 16), phase-1 steps, on-policy steps:
        # 43.86 (52.5 s) / 44.23 (40.2 s) / 44.50 (33.7 s) / 44.35 (30.2 s) / 44.98 (24.4 s)
    python benchmarks/notes/demo_short_tuning.py nsn 1 1.5
        # NSN (last 2/3 of the layers) with that many local epochs, perplexity at 75 / 50 / 33% of the MLP FLOPs:
        # 1 epoch 59.4 / 104.7 / 225.5 (70 s), 1.5: 59.4 / 105.1 / 224.2 (80 s); the demo's former 2: 59.4 / 104.2 / 222.7
"""
import copy
import sys
import tempfile
import time
from pathlib import Path

import torch

from mlpsurgery.data import load_corpus
from mlpsurgery.measure.perplexity import default_block_len, perplexity
from mlpsurgery.methods import nsn
from mlpsurgery.methods.dlr_lock import DLRConfig, dlr_lock
from mlpsurgery.models import load_model


def main(what: str, specs: list[str]) -> None:
    torch.set_num_threads(2)
    loaded = load_model(None)
    model, tok = loaded.model, loaded.require_tokenizer()
    corpus = load_corpus(None, tok)
    block = default_block_len(model)

    def ppl(m) -> float:
        return perplexity(m, corpus.heldout, block_len=block, max_tokens=1024, progress=False, bos_id=corpus.bos).ppl

    for spec in specs:
        m = copy.deepcopy(model)
        t = time.perf_counter()
        if what == "dlr":
            phase1, onpolicy = map(int, spec.split(","))
            train = corpus.blocks("train", 128, max_blocks=16, seed=0)
            cfg = DLRConfig(rank=16, layers="5,15,25", calib_blocks=16, block_len=128, phase1_steps=phase1,
                            phase1_tokens=256, phase2_steps=0, compile=False, onpolicy_steps=onpolicy)
            dlr_lock(m, train, train[:2], cfg, Path(tempfile.mkdtemp()) / "work", progress=False)
            print(f"dlr {spec}: {time.perf_counter() - t:.1f} s, perplexity {ppl(m):.2f}", flush=True)
        else:
            calib = corpus.blocks("train", 128, max_blocks=64, seed=0)
            nsn.nest(m, nsn.NSNConfig(layers="last2/3"), calib_data=calib, local_epochs=float(spec))
            seconds = time.perf_counter() - t
            nsn.set_budget(m, 1.0)
            nsn.truncate(m)
            out = []
            for fraction in (0.75, 0.5, 0.33):
                nsn.set_rank(m, nsn.budget_rank(m, fraction))
                out.append(f"{ppl(m):.1f}")
            print(f"nsn {spec} epochs: {seconds:.0f} s, at 75 / 50 / 33%: {' / '.join(out)}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
