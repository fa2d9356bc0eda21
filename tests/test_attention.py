"""modules/attention.py: GPT-2, OPT and Phi-3 attentions whose head count follows their projections, installed by
subsets.subset_model where a layer keeps fewer heads than the config can state."""

import copy
import json

import pytest
import torch

from conftest import edit_manifest, outputs
from mlpsurgery.errors import IntegrityError
from mlpsurgery.io import load, replaced_modules, save
from mlpsurgery.subsets import subset_model
from mlpsurgery.modules import MODULES
from mlpsurgery.sites import find_sites
from mlpsurgery.tiny import tiny_model

ARCHS = ("gpt2", "opt", "phi3")


def four_layers(arch, **overrides):
    return tiny_model(arch, num_hidden_layers=4, **overrides)


def keep(arch):
    """Layer 1 keeps one KV group, layer 2 keeps the last one or two; layers 0 and 3 stay whole."""
    return {1: [1], 2: [2, 3] if arch != "phi3" else [1]}


def masked(model, groups, ids):
    """The full model with the dropped heads' outputs zeroed (the input of the output projection): what the
    narrowed model must compute."""
    sites = find_sites(model)
    handles = []
    for i, g in groups.items():
        a = sites.attn[i]
        per_group = a.head_dim * (a.n_heads // a.n_kv)
        mask = torch.isin(torch.arange(a.n_heads * a.head_dim) // per_group, torch.tensor(g)).float()
        handles.append(a.o_proj.register_forward_pre_hook(lambda mod, args, m=mask: (args[0] * m, *args[1:])))
    try:
        return outputs(model, ids)
    finally:
        for h in handles:
            h.remove()


@pytest.mark.parametrize("arch", ARCHS)
def test_narrowed_layers_compute_the_kept_heads_and_round_trip(arch, ids, tmp_path):
    m = four_layers(arch)
    x = subset_model(m, attn_groups=keep(arch))
    entries = replaced_modules(x)
    name = find_sites(m).spec.narrow_attn
    assert [e["class"] for e in entries] == [name, name]
    assert json.loads(json.dumps(entries)) == entries  # the manifest holds it as JSON
    assert [a.n_kv for a in find_sites(x).attn] == [find_sites(m).attn[0].n_kv, 1, len(keep(arch)[2]),
                                                     find_sites(m).attn[0].n_kv]
    assert torch.allclose(outputs(x, ids), masked(m, keep(arch), ids), atol=1e-5, rtol=1e-5)
    save(x, tmp_path / "x")
    again = load(tmp_path / "x")
    assert type(find_sites(again).attn[1].module).__name__ == name
    assert torch.equal(outputs(again, ids), outputs(x, ids))
    assert torch.equal(outputs(copy.deepcopy(x), ids), outputs(x, ids))


@pytest.mark.parametrize("arch", ARCHS)
def test_narrowed_layers_decode_with_the_kv_cache(arch, ids):
    x = subset_model(four_layers(arch), attn_groups=keep(arch))
    with torch.no_grad():
        full = x(ids).logits
        first = x(ids[:, :-1], use_cache=True)
        last = x(ids[:, -1:], past_key_values=first.past_key_values, use_cache=True).logits
    assert torch.allclose(last[:, 0], full[:, -1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("overrides", [{"scale_attn_by_inverse_layer_idx": True},
                                       {"reorder_and_upcast_attn": True, "attn_implementation": "eager"}])
def test_gpt2_variants_keep_their_scaling(overrides, ids, tmp_path):
    impl = overrides.pop("attn_implementation", None)
    m = four_layers("gpt2", **overrides)
    if impl:
        m.set_attn_implementation(impl)
    x = subset_model(m, attn_groups=keep("gpt2"))
    assert torch.allclose(outputs(x, ids), masked(m, keep("gpt2"), ids), atol=1e-5, rtol=1e-5)
    save(x, tmp_path / "x")
    assert torch.equal(outputs(load(tmp_path / "x"), ids), outputs(x, ids))


def test_narrowed_attention_trains():
    x = subset_model(four_layers("opt"), attn_groups=keep("opt"))
    batch = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    x.train()
    x(input_ids=batch, labels=batch).loss.backward()
    q = find_sites(x).attn[1].module.q_proj.weight
    assert q.shape == (8, 32) and q.grad is not None and q.grad.abs().sum() > 0


def test_no_local_path_reaches_the_manifest(tmp_path):
    from transformers import AutoModelForCausalLM

    four_layers("gpt2").save_pretrained(tmp_path / "plain")
    m = AutoModelForCausalLM.from_pretrained(tmp_path / "plain")
    entry = replaced_modules(subset_model(m, attn_groups=keep("gpt2")))[0]
    assert str(tmp_path) not in json.dumps(entry)


@pytest.mark.parametrize("edit,match", [
    (lambda c: c.update(kv_groups=9), "kv_groups must be an integer in 1..4"),
    (lambda c: c["config"].update(model_type="llama"), "needs a gpt2 config"),
])
def test_an_edited_manifest_is_refused(tmp_path, edit, match):
    save(subset_model(four_layers("gpt2"), attn_groups=keep("gpt2")), tmp_path / "x")
    edit_manifest(tmp_path / "x", lambda m: edit(m["modules"][0]["config"]))
    with pytest.raises(IntegrityError, match=match):
        load(tmp_path / "x")


def test_the_registry_builds_them_from_config_alone():
    m = four_layers("phi3")
    x = subset_model(m, attn_groups=keep("phi3"))
    mod = find_sites(x).attn[1].module
    again = MODULES[type(mod).__name__].from_config(mod.config())
    assert again.config() == mod.config() and again.kv_groups == 1
    assert again.config.num_attention_heads == 2 and again.config.hidden_size == 32  # the layer's view
    assert [tuple(p.shape) for p in again.parameters()] == [tuple(p.shape) for p in mod.parameters()]
