"""Issue 45, session 29: NSN's start at every rank the demo shows (100 / 75 / 50 / 33 / 25% of the nested MLPs' dense
FLOPs), the MLPs of SmolLM2's last two thirds of the layers, with and without the down refit (`nest --refit`), its
weighting of the ranks and calibration size; perplexity on the demo's 1,024 held-out Persuasion tokens.

    REFIT=1 WEIGH=1 BLOCKS=256 EPOCHS=0 python benchmarks/notes/nsn_refit_sweep.py

REFIT=0: the whitened start (one pass of the original model) or, with EPOCHS > 0, the sequential start tuned;
WEIGH=0: every rank's rows alike in the refit (methods/nsn/local.py NSN_REFIT_WEIGH); BLOCKS: calibration blocks of
128 Austen train tokens (64 = the demo's 8k, 256 = nest's default 32k); EPOCHS: multi-rank local tuning after it.
Answers: docs/notes/nsn.md (session 29)."""
import copy
import os
import time

import torch

from mlpsurgery.data import load_corpus
from mlpsurgery.measure.perplexity import perplexity
from mlpsurgery.methods import nsn
from mlpsurgery.methods.nsn import local
from mlpsurgery.models import load_model

torch.set_num_threads(int(os.environ.get("THREADS", "2")))
local.NSN_REFIT_WEIGH = os.environ.get("WEIGH", "1") == "1"
loaded = load_model(None)
corpus = load_corpus(None, loaded.require_tokenizer())
calib = corpus.blocks("train", 128, max_blocks=int(os.environ.get("BLOCKS", "256")), seed=0)
model = copy.deepcopy(loaded.model)
t0 = time.perf_counter()
nsn.nest(model, nsn.NSNConfig(layers="last2/3"), calib_data=calib, local_epochs=float(os.environ.get("EPOCHS", "0")),
         refit=os.environ.get("REFIT", "1") == "1")
print(f"built in {time.perf_counter() - t0:.0f} s ({calib.numel():,} calibration tokens)")
for f in (1.0, 0.75, 0.5, 0.33, 0.25):
    nsn.set_budget(model, f)
    got = perplexity(model, corpus.heldout, block_len=512, max_tokens=1024, progress=False, bos_id=corpus.bos).ppl
    print(f"{f:.2f} of the FLOPs: {got:.1f}", flush=True)
