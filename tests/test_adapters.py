"""peft LoRA on every module mlpsurgery installs: adapters attach inside it (lora_config), forward and backward
run, a training step changes the output, merge_and_unload gives the adapted function exactly, and the merged
model is still ours (saved and reloaded identically; a nested model still switches rank)."""

from __future__ import annotations

import copy

import pytest
import torch

import mlpsurgery as ms
from conftest import outputs
from mlpsurgery.adapters import lora_config
from mlpsurgery.methods import nsn
from mlpsurgery.methods.dlr_lock import locked_like
from mlpsurgery.methods.fusion import FusionConfig, fuse
from mlpsurgery.tiny import tiny_model

peft = pytest.importorskip("peft")
from peft.tuners.lora import LoraLayer  # noqa: E402

IDS = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]])


def _installed(arch, kind):
    m = tiny_model(arch)
    if kind == "fused":
        fuse(m, FusionConfig(width=16, layers="all", n_init=1), progress=False)
    elif kind == "dense":
        fuse(m, FusionConfig(width=16, layers="all", method="neuron"), progress=False)
    elif kind == "svd":
        fuse(m, FusionConfig(width=8, layers="all", method="svd"), progress=False)
    elif kind == "nested":
        nsn.nest(m, nsn.NSNConfig(modules="mlp+attn"))
        nsn.set_rank(m, 6)
    elif kind == "dlr":
        m = locked_like(m, rank=4, depth=3)
    elif kind == "heads":
        m = ms.subset_model(m, attn_groups={0: [0]})
    return m.eval()


CASES = [("llama", "fused"), ("llama", "dense"), ("llama", "svd"), ("llama", "nested"), ("llama", "dlr"),
         ("gpt2", "nested"), ("gpt2", "heads"), ("opt", "heads"), ("bert", "dlr")]


@pytest.mark.parametrize("arch,kind", CASES)
def test_lora_attaches_inside_trains_and_merges_exactly(tmp_path, arch, kind):
    model = _installed(arch, kind)
    installed = {e["path"] for e in ms.io.replaced_modules(model)}
    weighted = {p for p in installed if any(True for _ in model.get_submodule(p).parameters())}  # not Identity
    assert weighted
    pm = peft.get_peft_model(copy.deepcopy(model), lora_config(model, r=2))
    lora_paths = [p for p, mod in pm.named_modules() if isinstance(mod, LoraLayer)]
    for path in weighted:  # every installed module with weights holds an adapter
        assert any(f".{path}." in f".{p}." or p.endswith(path) for p in lora_paths), (path, lora_paths[:6])
    trainable = [p for n, p in pm.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n, p in pm.named_parameters() if p.requires_grad)
    opt = torch.optim.SGD(trainable, lr=0.5)
    for _ in range(2):
        opt.zero_grad()
        out = pm(input_ids=IDS)
        (out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state).pow(2).mean().backward()
        assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in trainable)
        opt.step()
    with torch.no_grad():
        adapted = outputs(pm, IDS)
    assert not torch.allclose(adapted, outputs(model, IDS), atol=1e-6)  # the adapter changed the function
    merged = pm.merge_and_unload()
    assert not any(isinstance(mod, LoraLayer) for mod in merged.modules())
    torch.testing.assert_close(outputs(merged, IDS), adapted, rtol=1e-4, atol=1e-5)
    assert {e["path"] for e in ms.io.replaced_modules(merged)} == installed  # still our structure
    again = ms.load(ms.save(merged, tmp_path / "m"))
    assert torch.equal(outputs(again, IDS), outputs(merged, IDS))
    if kind == "nested":  # the merged model still switches rank
        nsn.set_rank(again, 2)
        assert not torch.allclose(outputs(again, IDS), adapted)
