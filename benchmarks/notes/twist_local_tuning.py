"""Issue 45, session 32: does local tuning of a TwIST subnet's narrowed MLPs (after the closed-form refit of their
down and the attention's output projections) bring the demo's TwIST row within 2x? The demo's subnet (6/12 MLP chunks
and 2/3 KV groups in layers 2-27 of the pretrained SmolLM2), 8k calibration tokens, perplexity on the demo's 1,024
held-out tokens, for each number of local epochs given.

    python benchmarks/notes/twist_local_tuning.py 0 2 4      # 133.5 / 128.1 / 127.0 (docs/notes/calibration.md)
"""
import sys
import time

import torch

from mlpsurgery.data import load_corpus
from mlpsurgery.measure.perplexity import default_block_len, perplexity
from mlpsurgery.methods.reconstruct.attention import narrowed_attention
from mlpsurgery.methods.reconstruct.layer import refit_model_
from mlpsurgery.methods.twist import twist_extract
from mlpsurgery.models import load_model
from mlpsurgery.sites import find_sites

torch.set_num_threads(2)
loaded = load_model(None); model, tok = loaded.model, loaded.require_tokenizer()
corpus = load_corpus(None, tok); block = default_block_len(model)
calib = corpus.blocks("train", 128, max_blocks=64, seed=0)


def ppl(m):
    return perplexity(m, corpus.heldout, block_len=block, max_tokens=1024, progress=False, bos_id=corpus.bos).ppl


for epochs in [float(e) for e in sys.argv[1:]]:
    sub = twist_extract(model, keep=6, blocks=12, seed=0, shared_first=2, shared_last=2)
    new, old = find_sites(sub), find_sites(model)
    layers = [s.index for s in new.mlp if s.h < old.mlp[s.index].h]
    t = time.perf_counter()
    refit_model_(sub, model, calib, layers, local_epochs=epochs, attn_layers=narrowed_attention(sub, model))
    print(f"epochs {epochs}: ppl {ppl(sub):.1f}, {time.perf_counter() - t:.0f} s", flush=True)
