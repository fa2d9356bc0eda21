"""Checks on the real pretrained models; skipped when they are not installed."""

import pytest
import torch

from mlpsurgery.data import load_corpus, read_labelled
from mlpsurgery.measure.accuracy import probe_accuracy
from mlpsurgery.measure.cost import inspect
from mlpsurgery.measure.perplexity import perplexity
from mlpsurgery.modules.dense import DenseMLP
from mlpsurgery.sites import find_sites

pytestmark = pytest.mark.realmodel


def test_smollm2_structure(smollm2):
    info = inspect(smollm2.model)
    assert (info["architecture"], info["layers"], info["d"], info["mlp_inner_width"]) == ("llama", 30, 576, 1536)
    assert (info["heads"], info["kv_groups"], info["head_dim"]) == (9, 3, 64)
    assert info["params"]["total"] == pytest.approx(134.5e6, rel=0.01)


def test_smollm2_predicts_held_out_austen(smollm2):
    corpus = load_corpus(None, smollm2.tokenizer)
    r = perplexity(smollm2.model, corpus.heldout, block_len=256, max_tokens=1024, progress=False)
    assert 10 < r.ppl < 60  # a random model of this vocabulary would give ~49152


def test_smollm2_surgery_is_exact(smollm2):
    model = smollm2.model
    ids = smollm2.tokenizer("It is a truth universally acknowledged", return_tensors="pt").input_ids
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    site = find_sites(model).mlp[7]
    original = site.module
    site.replace_mlp(DenseMLP.from_weights(site.read()))
    try:
        with torch.no_grad():
            torch.testing.assert_close(model(input_ids=ids).logits, ref, rtol=1e-4, atol=1e-4)
    finally:
        site.replace_mlp(original)


def test_minilm_probe_beats_chance(minilm):
    info = inspect(minilm.model)
    assert (info["architecture"], info["layers"], info["d"], info["mlp_inner_width"]) == ("bert", 6, 384, 1536)
    train = read_labelled("r8-train").sample(240, seed=0)
    test = read_labelled("r8-test").sample(160, seed=0)
    r = probe_accuracy(minilm.model, minilm.tokenizer, train, test, max_len=64, progress=False)
    assert r["accuracy"] > 0.7  # chance is 1/8; the majority class is about half
