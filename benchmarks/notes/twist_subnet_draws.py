"""Issue 45, session 33: how much of the demo's TwIST row is the draw? Random subnets (6 of 12 MLP chunks) of the
pretrained SmolLM2 (not TwIST-trained), cut and then refit on 8k calibration tokens (`refit_subnet_`, sequential),
perplexity on the demo's 1,024 held-out tokens. Each argument is VARIANT:SEED[:KEEP] (KEEP of 12 chunks, default 6;
session 34 added it) with VARIANT one of
  both   the demo's: MLP chunks and KV groups (2 of 3) in layers 2-27
  ffn    MLP chunks only, layers 2-27
  ffn23  MLP chunks only, the last two thirds of the layers (10-29: the other demo rows' layers)
  both23 MLP chunks and KV groups, layers 10-29

    python benchmarks/notes/twist_subnet_draws.py ffn:0 ffn23:0 both23:0 both:1 both:2   # docs/notes/calibration.md
    python benchmarks/notes/twist_subnet_draws.py both:0:9 both:1:9 both:2:9 both:3:9 both:0:8   # session 34
"""
import sys
import time

import torch

from mlpsurgery.data import load_corpus
from mlpsurgery.measure.cost import count_params
from mlpsurgery.measure.perplexity import default_block_len, perplexity
from mlpsurgery.methods.twist import refit_subnet_, twist_extract
from mlpsurgery.models import load_model

VARIANTS = {
    "both": dict(shared_first=2, shared_last=2),
    "ffn": dict(parts="ffn", shared_first=2, shared_last=2),
    "ffn23": dict(parts="ffn", layers=list(range(10, 30))),
    "both23": dict(parts="both", layers=list(range(10, 30))),
}


def main(specs: list[str]) -> None:
    torch.set_num_threads(2)
    loaded = load_model(None)
    model, tok = loaded.model, loaded.require_tokenizer()
    corpus = load_corpus(None, tok)
    block = default_block_len(model)
    calib = corpus.blocks("train", 128, max_blocks=64, seed=0)  # the demo's calibration

    def ppl(m) -> float:
        return perplexity(m, corpus.heldout, block_len=block, max_tokens=1024, progress=False, bos_id=corpus.bos).ppl

    base = count_params(model)["total"]
    for spec in specs:
        name, seed, *keep = spec.split(":")
        t = time.perf_counter()
        sub = twist_extract(model, keep=int(keep[0]) if keep else 6, blocks=12, seed=int(seed), **VARIANTS[name])
        cut = ppl(sub)
        refit_subnet_(sub, model, calib, progress=False)
        print(f"{spec}: params {count_params(sub)['total'] / base:.2f}x, cut {cut:,.1f}, refit {ppl(sub):,.1f} "
              f"({time.perf_counter() - t:.0f} s)", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
