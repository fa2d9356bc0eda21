"""Issue 45, session 30: what refitting the output projection of attention with heads cut out adds to the refit of the
narrowed MLPs' down projections (methods/reconstruct/attention.py), on random TwIST subnets of the pretrained
SmolLM2 (layers 2-27, seeds 0 and 1; no TwIST training): the cut as it is, the MLPs refit alone, the MLPs and the
attention refit (`twist extract --calib-data`, `refit_subnet_`). Parts: both (6 of 12 MLP chunks and TwIST's share
of the KV groups at kappa 6/12, 2 of 3, as the demo cuts) and attn (the attention alone). Perplexity on the first
TOKENS held-out Persuasion tokens; calibration BLOCKS x 128 Austen train tokens (256 = the default 32k; the demo: 64,
1024). Rows are appended to the JSON file as they finish; a rerun resumes, and refuses a file of other settings.

    BLOCKS=256 TOKENS=2048 python benchmarks/notes/twist_attention_refit.py runs/twist-attn-refit.json

Answers: docs/twist.md (the refit), docs/notes/twist.md (session 30)."""
import json
import os
import sys
import time
from pathlib import Path

import torch

from mlpsurgery.data import load_corpus
from mlpsurgery.measure.perplexity import perplexity
from mlpsurgery.methods.reconstruct.layer import refit_model_
from mlpsurgery.methods.twist import refit_subnet_, twist_extract
from mlpsurgery.models import load_model
from mlpsurgery.sites import find_sites

torch.set_num_threads(int(os.environ.get("THREADS", "2")))
BLOCKS, TOKENS = int(os.environ.get("BLOCKS", "256")), int(os.environ.get("TOKENS", "2048"))
out = Path(sys.argv[1] if len(sys.argv) > 1 else "runs/twist-attn-refit.json")
rows = json.loads(out.read_text()) if out.exists() else []  # a rerun resumes
if any((r["blocks"], r["tokens"]) != (BLOCKS, TOKENS) for r in rows):
    raise SystemExit(f"{out} holds rows of other settings than BLOCKS={BLOCKS} TOKENS={TOKENS}: give another file")
done = {(r["parts"], r["seed"], r["refit"]) for r in rows}
loaded = load_model(None)
model = loaded.model
corpus = load_corpus(None, loaded.require_tokenizer())
calib = corpus.blocks("train", 128, max_blocks=BLOCKS, seed=0)


def ppl(m) -> float:
    return perplexity(m, corpus.heldout, block_len=512, max_tokens=TOKENS, progress=False, bos_id=corpus.bos).ppl


def keep(row: dict) -> None:
    rows.append(row)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=1))
    print(json.dumps(row), flush=True)


base = {"blocks": BLOCKS, "tokens": TOKENS}
if ("-", 0, "-") not in done:
    keep({**base, "parts": "-", "seed": 0, "refit": "-", "ppl": ppl(model), "seconds": 0.0})
for parts, seeds in (("both", (0, 1)), ("attn", (0,))):
    for seed in seeds:
        for refit in ("none", "mlp", "mlp+attn"):
            if (parts, seed, refit) in done or (parts == "attn" and refit == "mlp"):
                continue
            sub = twist_extract(model, keep=6, blocks=12, parts=parts, shared_first=2, shared_last=2, seed=seed)
            t = time.perf_counter()
            if refit == "mlp":  # the down projections alone, the attention as cut (the refit before session 30)
                new, old = find_sites(sub), find_sites(model)
                refit_model_(sub, model, calib, [s.index for s in new.mlp if s.h < old.mlp[s.index].h])
            elif refit == "mlp+attn":
                refit_subnet_(sub, model, calib, progress=False)
            seconds = time.perf_counter() - t  # of the refit alone
            keep({**base, "parts": parts, "seed": seed, "refit": refit, "ppl": ppl(sub), "seconds": seconds})
