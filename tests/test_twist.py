import copy
import json
import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from conftest import outputs
from mlpsurgery.errors import MLPSurgeryError
from mlpsurgery.io import load, replaced_modules, save
from mlpsurgery.subsets import subset_model
from mlpsurgery.methods.twist import (Aggregator, Subnet, TwISTConfig, attn_keep_for, check_subnet_size,
                                      deployment_subnet, generate_blueprint, make_layout, materialize, subnet_hooks,
                                      twist_extract, twist_train)
from mlpsurgery.sites import find_sites
from mlpsurgery.tiny import ARCHITECTURES, tiny_config, tiny_model


@st.composite
def blueprint_case(draw):
    n_full = draw(st.integers(1, 16))
    workers = draw(st.integers(1, 6))
    c = draw(st.integers(0, n_full))
    common = draw(st.lists(st.integers(0, n_full - 1), min_size=c, max_size=c, unique=True))
    low = max(1, -(-(n_full + (workers - 1) * len(common)) // workers), len(common))
    n_sub = draw(st.integers(min(low, n_full), n_full))
    return n_full, n_sub, workers, common, draw(st.integers(0, 2 ** 31))


@settings(max_examples=400, deadline=None)
@given(blueprint_case())
def test_blueprint_guarantees(case):
    n_full, n_sub, workers, common, seed = case
    rows = generate_blueprint(n_full, n_sub, workers, common, torch.Generator().manual_seed(seed))
    assert len(rows) == workers
    for row in rows:
        assert row == sorted(row) and len(set(row)) == n_sub == len(row)  # sorted, unique, N_sub blocks
        assert set(common) <= set(row)  # the common set is in every subnet
        assert all(0 <= b < n_full for b in row)
    assert set().union(*map(set, rows)) == set(range(n_full))  # every block is trained by some subnet
    again = generate_blueprint(n_full, n_sub, workers, common, torch.Generator().manual_seed(seed))
    assert again == rows  # seeded


@settings(max_examples=200, deadline=None)
@given(st.integers(2, 16), st.integers(2, 6), st.data())
def test_subnets_too_small_to_cover_are_refused(n_full, workers, data):
    c = data.draw(st.integers(0, n_full - 2))
    bound = (n_full + (workers - 1) * c) / workers
    top = math.ceil(bound) - 1
    assume(top >= max(1, c))
    n_sub = data.draw(st.integers(max(1, c), top))
    with pytest.raises(MLPSurgeryError, match=r"\(N_full \+ \(S-1\)\|C\|\)/S"):
        generate_blueprint(n_full, n_sub, workers, list(range(c)))


def test_blueprint_is_random_across_seeds_and_errors_are_clear():
    seen = {tuple(map(tuple, generate_blueprint(12, 4, 3, (), torch.Generator().manual_seed(s)))) for s in range(30)}
    assert len(seen) > 20
    with pytest.raises(MLPSurgeryError, match="keep at least 4|Keep at least 4"):
        check_subnet_size(12, 3, 3)
    with pytest.raises(MLPSurgeryError, match="between 1 and 12"):
        check_subnet_size(12, 13, 1)
    with pytest.raises(MLPSurgeryError, match="common set"):
        check_subnet_size(12, 2, 12, common=(0, 1, 2))


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 12), st.data())
def test_deployment_subnet(n_full, data):
    n_sub = data.draw(st.integers(1, n_full))
    common = data.draw(st.lists(st.integers(0, n_full - 1), max_size=n_sub, unique=True))
    seed = data.draw(st.integers(0, 1000))
    row = deployment_subnet(n_full, n_sub, common, torch.Generator().manual_seed(seed))
    assert row == sorted(set(row)) and len(row) == n_sub and set(common) <= set(row)
    assert row == deployment_subnet(n_full, n_sub, common, torch.Generator().manual_seed(seed))


def test_kappa_maps_to_kv_groups_as_documented():
    # SmolLM2: 3 KV groups per layer
    assert [attn_keep_for(x / 12, 3) for x in (12, 8, 6, 4, 3, 1)] == [3, 2, 2, 1, 1, 1]
    assert [attn_keep_for(x / 12, 12) for x in (8, 6, 4, 3)] == [8, 6, 4, 3]


# ---- blocks, masks, extraction --------------------------------------------------------------------

SUBSET_ARCHS = ("llama", "mistral", "qwen2", "qwen3", "smollm3", "olmo", "ernie4_5", "ministral", "seed_oss", "granite",
                "starcoder2", "gemma", "gemma2", "gemma3_text", "gpt_neox", "bert", "roberta", "xlm-roberta", "gpt2",
                "opt", "phi3", "phi", "cohere", "cohere2", "olmo2", "olmo3", "exaone4", "distilbert")

HEADS_STAY = ("olmo2", "olmo3")  # q / k norms across every head: their subnets narrow the MLPs only


def parts_of(arch: str) -> str:
    return "ffn" if arch in HEADS_STAY else "both"


def four_layers(arch, seed=0):
    """A tiny model with 4 layers (2 partitioned between shared first and last ones)."""
    extra = {}
    layer_types = getattr(tiny_config(arch), "layer_types", None)
    if layer_types:  # per-layer attention kinds are listed per layer: extend the list
        extra["layer_types"] = (list(layer_types) * 2)[:4]
    return tiny_model(arch, seed=seed, num_hidden_layers=4, **extra)


@pytest.mark.parametrize("arch", ("llama", "gpt2", "bert", "phi3", "opt"))
def test_all_blocks_kept_is_the_original_model_exactly(arch, ids):
    m = four_layers(arch)
    ref = outputs(m, ids)
    layout = make_layout(m, "both", [1, 2], blocks=4, keep=4)
    full = Subnet(attn={i: list(range(layout.attn_full[i])) for i in layout.attn_full},
                  mlp={i: [0, 1, 2, 3] for i in layout.mlp_h})
    with subnet_hooks(m, layout, full):
        assert torch.equal(outputs(m, ids), ref)
    x = twist_extract(m, keep=4, blocks=4, parts="both", layers=[1, 2], seed=3)
    assert torch.equal(outputs(x, ids), ref)
    assert not replaced_modules(x) and sum(p.numel() for p in x.parameters()) == sum(p.numel() for p in m.parameters())


@pytest.mark.parametrize("arch", SUBSET_ARCHS)
def test_extracted_subnet_is_the_masked_model_with_scaling(arch, ids):
    m = four_layers(arch)
    layout = make_layout(m, parts_of(arch), [1, 2], blocks=4, keep=2, attn_keep=1)
    sub = layout.deployment(torch.Generator().manual_seed(5))
    with subnet_hooks(m, layout, sub):
        masked = outputs(m, ids)
    x = materialize(m, layout, sub)
    assert torch.allclose(outputs(x, ids), masked, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(outputs(m, ids), masked, atol=1e-3)  # the subnet does differ from the model
    before, after = find_sites(m), find_sites(x)
    kv = [before.attn[i].n_kv for i in range(4)]
    assert [s.n_kv for s in after.attn] == (kv if arch in HEADS_STAY else [kv[0], 1, 1, kv[3]])
    assert [s.h for s in after.mlp] == [64, 32, 32, 64]


@pytest.mark.parametrize("arch", SUBSET_ARCHS)
def test_a_consumed_model_gives_the_same_subnet_and_is_released_layer_by_layer(arch, ids):
    """twist extract's CLI gives the loaded model up as the subnet is built (consume=True): the same subnet bit for
    bit, and every attention and MLP tensor of the source layers released (the rest is the caller's)."""
    m = four_layers(arch)
    kept = copy.deepcopy(m)
    layout = make_layout(m, parts_of(arch), [1, 2], blocks=4, keep=2, attn_keep=1)
    sub = layout.deployment(torch.Generator().manual_seed(5))
    want = materialize(kept, layout, sub)
    got = materialize(m, layout, sub, consume=True)
    assert want.state_dict().keys() == got.state_dict().keys()
    assert all(torch.equal(v, got.state_dict()[k]) for k, v in want.state_dict().items())
    assert torch.equal(outputs(got, ids), outputs(want, ids))
    sites, full = find_sites(m), find_sites(kept)
    for i in range(len(sites)):
        assert all(p.numel() == 0 for p in sites.attn[i].parameters()), (arch, i)
        assert all(p.numel() == 0 for mod in sites.mlp[i].modules() for p in mod.parameters()), (arch, i)
        assert sum(p.numel() for mod in full.mlp[i].modules() for p in mod.parameters()) > 0
    # what is left is exactly what lies outside the layers' attention projections and MLPs (embeddings, norms)
    inside = sum(p.numel() for i in range(len(full)) for p in (*full.attn[i].parameters(),
                                                               *(q for mod in full.mlp[i].modules() for q in mod.parameters())))
    assert sum(p.numel() for p in m.parameters()) == sum(p.numel() for p in kept.parameters()) - inside > 0


@pytest.mark.parametrize("arch", ("gpt2", "opt", "phi3"))
def test_heads_narrow_where_the_config_cannot_say_so(arch, ids, tmp_path):
    # GPT-2 / OPT / Phi-3 attentions split by the config's head count: a layer with fewer heads gets the
    # registered attention that reads the count off its projections, saved and rebuilt by mlpsurgery.
    m = four_layers(arch)
    x = twist_extract(m, keep=2, blocks=4, parts="both", attn_keep=1, layers=[1, 2], seed=4)
    assert [e["class"] for e in replaced_modules(x)].count(find_sites(m).spec.narrow_attn) == 2
    assert [s.n_kv for s in find_sites(x).attn] == [find_sites(m).attn[0].n_kv, 1, 1, find_sites(m).attn[3].n_kv]
    save(x, tmp_path / "sub")
    assert torch.equal(outputs(load(tmp_path / "sub"), ids), outputs(x, ids))


def test_uniform_subnet_is_a_plain_transformers_model(tmp_path, ids):
    from transformers import AutoModelForCausalLM

    m = four_layers("qwen3")
    x = twist_extract(m, keep=2, blocks=4, parts="both", shared_first=0, shared_last=0, seed=1)
    assert not replaced_modules(x) and x.config.num_key_value_heads == 1 and x.config.intermediate_size == 32
    save(x, tmp_path / "sub")
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "sub").eval()
    assert torch.equal(outputs(plain, ids), outputs(x, ids))


def test_subnet_with_shared_layers_round_trips_through_save_load(tmp_path, ids):
    m = four_layers("llama")
    x = twist_extract(m, keep=1, blocks=4, parts="both", layers=[1, 2], seed=2)
    assert replaced_modules(x)  # narrower projections in layers 1-2 only
    save(x, tmp_path / "sub")
    assert torch.equal(outputs(load(tmp_path / "sub"), ids), outputs(x, ids))
    assert load(tmp_path / "sub")._mlpsurgery_history[-1]["method"] == "twist-extract"


def test_subset_model_errors():
    m = four_layers("llama")
    with pytest.raises(MLPSurgeryError, match="distinct indices"):
        subset_model(m, attn_groups={0: [0, 0]})
    with pytest.raises(MLPSurgeryError, match="layers 0-3"):
        subset_model(m, mlp_neurons={7: [0]})
    with pytest.raises(MLPSurgeryError, match="equal chunks"):
        make_layout(m, "ffn", [1], blocks=5, keep=2)


def test_heads_are_kept_where_the_attention_holds_weights_across_or_per_heads(ids):
    """Command R+ (cohere with use_qk_norm) normalises q and k with per-head weights (4 x 8 here): removing a head
    would have to slice them, so it is refused; the MLP still narrows, and Qwen 3's q / k norms over one head's width
    (shared by every head) do not stop a head from going."""
    m = tiny_model("cohere", use_qk_norm=True)
    assert tuple(find_sites(m).attn[0].module.q_norm.weight.shape) == (4, 8)
    with pytest.raises(MLPSurgeryError, match=r"layer 0: its attention holds q_norm.weight \(4, 8\)"):
        subset_model(m, attn_groups={0: [0]})
    small = subset_model(m, mlp_neurons={0: list(range(32))})
    assert find_sites(small).mlp[0].h == 32 and torch.isfinite(outputs(small, ids)).all()
    q3 = subset_model(tiny_model("qwen3"), attn_groups={0: [1]})
    assert find_sites(q3).attn[0].n_kv == 1
    with pytest.raises(MLPSurgeryError, match="q_norm.weight"):  # TwIST refuses such a layout before training
        make_layout(m, "both", [0, 1], blocks=4, keep=2)
    assert make_layout(m, "ffn", [0, 1], blocks=4, keep=2).mlp_h == {0: 64, 1: 64}


# ---- layer by layer (methods/twist/layerwise.py) -------------------------------------------------------

def _same_subnet_folders(a_dir, b_dir):
    """The same tensors, config and manifest records (the weights file's layout differs: a header written last)."""
    from conftest import file_tensors
    from mlpsurgery.io import MANIFEST

    a, b = file_tensors(a_dir), file_tensors(b_dir)
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    assert (a_dir / "config.json").read_text() == (b_dir / "config.json").read_text()
    ja, jb = (json.loads((d / MANIFEST).read_text()) for d in (a_dir, b_dir))
    for key in ("source", "history", "masks", "dtype", "model_class", "modules"):
        assert ja[key] == jb[key], key
    assert ja["history"][-1]["method"] == "twist-extract"


@pytest.mark.parametrize("arch", SUBSET_ARCHS)
def test_layerwise_extraction_writes_what_the_whole_model_one_writes(arch, ids, tmp_path, monkeypatch):
    from mlpsurgery.layerwise import LayerStream
    from mlpsurgery.methods.twist.layerwise import extract_layerwise

    save(four_layers(arch), tmp_path / "tw")
    kw = dict(keep=2, blocks=4, parts=parts_of(arch), attn_keep=1, shared_first=1, shared_last=1, seed=5)
    whole = twist_extract(load(tmp_path / "tw"), **kw)
    save(whole, tmp_path / "whole")
    held = []  # how many source layers hold real tensors when one more is read: never more than none
    read = LayerStream.materialise

    def materialise(self, i):
        held.append(sum(any(not t.is_meta for t in layer.state_dict().values()) for layer in self.layers))
        return read(self, i)

    monkeypatch.setattr(LayerStream, "materialise", materialise)
    r = extract_layerwise(tmp_path / "tw", tmp_path / "lw", progress=False, **kw)
    assert held == [0, 0, 0, 0]
    _same_subnet_folders(tmp_path / "whole", tmp_path / "lw")
    assert r["params_after"] == sum(p.numel() for p in whole.parameters()) < r["params_before"]
    assert torch.equal(outputs(load(tmp_path / "lw"), ids), outputs(whole, ids))


def _same_refit_folders(a_dir, b_dir):
    """The same tensors and history (the refit's entry last)."""
    from conftest import file_tensors
    from mlpsurgery.io import MANIFEST

    a, b = file_tensors(a_dir), file_tensors(b_dir)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ja, jb = (json.loads((d / MANIFEST).read_text()) for d in (a_dir, b_dir))
    assert ja["history"] == jb["history"] and jb["history"][-1]["method"] == "twist-refit"


@pytest.mark.parametrize("arch", SUBSET_ARCHS)
def test_layerwise_extraction_with_the_refit_writes_what_the_whole_model_one_writes(arch, tmp_path):
    """twist extract --calib-data --layerwise: the calibration stream through the subnet's layers as they are written,
    each narrowed attention and MLP refit while its source layer is in memory (the sequential walk's own step), gives
    the whole-model extraction + refit_subnet_ folder bit for bit, its errors and its history; and the refit changed
    something."""
    from mlpsurgery.methods.twist import refit_subnet_
    from mlpsurgery.methods.twist.layerwise import extract_layerwise

    save(four_layers(arch), tmp_path / "tw")
    calib = torch.randint(3, 250, (10, 16), generator=torch.Generator().manual_seed(1))
    kw = dict(keep=2, blocks=4, parts=parts_of(arch), attn_keep=1, shared_first=1, shared_last=0, seed=5)
    original = load(tmp_path / "tw")
    whole = twist_extract(original, **kw)
    errors = refit_subnet_(whole, original, calib, progress=False)
    save(whole, tmp_path / "whole")
    r = extract_layerwise(tmp_path / "tw", tmp_path / "lw", progress=False, calib=calib, **kw)
    _same_refit_folders(tmp_path / "whole", tmp_path / "lw")
    assert r["refit"] == {"calibration": [10, 16], "layers": errors}
    assert arch in HEADS_STAY or any("attention" in e for e in errors.values())
    assert any("error_after" in e for e in errors.values())
    from conftest import file_tensors

    plain = tmp_path / "plain"
    extract_layerwise(tmp_path / "tw", plain, progress=False, **kw)
    b, c = file_tensors(tmp_path / "lw"), file_tensors(plain)
    assert any(not torch.equal(b[k], c[k]) for k in b)


@pytest.mark.parametrize("arch,parts", [("qwen3", "both"), ("gpt2", "ffn")])  # (GPT-2's config cannot state fewer heads)
def test_layerwise_uniform_subnet_in_bfloat16_is_a_plain_transformers_model(arch, parts, ids, tmp_path):
    from transformers import AutoModelForCausalLM

    from mlpsurgery.methods.twist.layerwise import extract_layerwise

    save(four_layers(arch).to(torch.bfloat16), tmp_path / "tw")
    kw = dict(keep=2, blocks=4, parts=parts, shared_first=0, shared_last=0, seed=1)
    save(twist_extract(load(tmp_path / "tw"), **kw), tmp_path / "whole")
    r = extract_layerwise(tmp_path / "tw", tmp_path / "lw", progress=False, **kw)
    _same_subnet_folders(tmp_path / "whole", tmp_path / "lw")
    assert r["dtype"] == "bfloat16"
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "lw", dtype=torch.bfloat16).eval()
    assert torch.equal(outputs(plain, ids), outputs(load(tmp_path / "whole"), ids))


def test_cli_layerwise_extraction_of_a_stock_checkpoint_equals_the_whole_model_command(tmp_path, capsys):
    """Any MODEL folder, not only a TwIST one: the source recorded is the checkpoint's, as the whole command's."""
    from conftest import saved_checkpoint

    from mlpsurgery.cli import main
    from mlpsurgery.tiny import byte_tokenizer

    src = saved_checkpoint(tmp_path, "gemma2", dtype=torch.bfloat16, shard="20KB", num_hidden_layers=4,
                           layer_types=["sliding_attention", "full_attention"] * 2)
    byte_tokenizer().save_pretrained(src)
    common = ["twist", "extract", str(src), "--keep", "3", "--blocks", "4", "--shared-first", "1", "--dtype", "auto",
              "--quiet", "--json"]
    assert main([*common, "--out", str(tmp_path / "whole")]) == 0
    whole = json.loads(capsys.readouterr().out)
    assert main([*common, "--layerwise", "--out", str(tmp_path / "lw")]) == 0
    lw = json.loads(capsys.readouterr().out)
    assert lw["subnet"] == whole["subnet"] and lw["params_after"] == whole["params_after"] < whole["params_before"]
    _same_subnet_folders(tmp_path / "whole", tmp_path / "lw")
    assert json.loads((tmp_path / "lw" / "surgery.json").read_text())["source"]["name"] == src.name


# ---- aggregation and training ----------------------------------------------------------------------

def test_aggregation_is_fedavg():
    m = four_layers("llama")
    layout = make_layout(m, "both", [1, 2], blocks=4, keep=2, attn_keep=1)
    subnets = layout.blueprint(3, torch.Generator().manual_seed(0))
    agg = Aggregator(m, layout)
    for s, sub in enumerate(subnets):  # worker s returns the value s + 1 everywhere
        with torch.no_grad():
            for p in m.parameters():
                p.fill_(s + 1.0)
        agg.add(m, sub, full=True)
    agg.write()
    sites = find_sites(m)
    assert torch.all(m.model.embed_tokens.weight == 2.0) and torch.all(sites.attn[0].read().q == 2.0)  # shared
    for i in (1, 2):
        w = sites.mlp[i].read()
        for chunk in range(4):
            holders = [s + 1.0 for s, sub in enumerate(subnets) if chunk in sub.mlp[i]]
            cols = layout.neurons(i, [chunk])
            assert torch.all(w.down[:, cols] == sum(holders) / len(holders))
            assert torch.all(w.up[cols] == sum(holders) / len(holders))
        a = sites.attn[i].read()
        for g in range(2):
            holders = [s + 1.0 for s, sub in enumerate(subnets) if g in sub.attn[i]]
            assert torch.all(a.k[g] == sum(holders) / len(holders))
            assert torch.all(a.o[:, a.heads_of_groups([g])] == sum(holders) / len(holders))


@pytest.mark.parametrize("arch", ("llama", "gemma2", "gpt2", "phi3", "opt", "gpt_neox", "bert"))
def test_a_refit_subnet_changes_only_the_narrowed_projections_and_lowers_each_ones_error(arch, ids):
    """refit_subnet_: the narrowed MLPs' down projections and the narrowed attention's output projections (and
    nothing else) refit in sequence; each one's output error on its calibration rows falls, and the layers kept whole
    are untouched. Attention alone (--parts attn) is refit too; a subnet that narrowed nothing is refused."""
    from mlpsurgery.io.provenance import history
    from mlpsurgery.methods.twist import refit_subnet_

    m = four_layers(arch)
    plain = twist_extract(m, keep=2, blocks=4, parts="both", layers=[1, 2], seed=5)
    sub = copy.deepcopy(plain)
    calib = torch.randint(0, 256, (8, 32), generator=torch.Generator().manual_seed(1))
    errs = refit_subnet_(sub, m, calib, progress=False)
    assert sorted(errs) == [1, 2]
    for i, e in errs.items():
        assert e["error_after"] < e["error_before"], (i, e)
        assert e["attention"]["error_after"] < e["attention"]["error_before"], (i, e)
    a, b = find_sites(plain), find_sites(sub)
    for i in range(4):
        wa, wb = a.mlp[i].read(), b.mlp[i].read()
        qa, qb = a.attn[i].read(), b.attn[i].read()
        assert torch.equal(wa.up, wb.up) and torch.equal(qa.q, qb.q) and torch.equal(qa.v, qb.v)
        assert torch.equal(wa.down, wb.down) == (i not in (1, 2))
        assert torch.equal(qa.o, qb.o) == (i not in (1, 2))
    assert history(sub)[-1]["method"] == "twist-refit" and history(sub)[-1]["provenance"]["calib_tokens"] == 256
    assert history(sub)[-1]["config"]["attention"] == [1, 2]
    # each projection was fitted on the rows the final subnet gives it (layer i's MLP on what its refit attention and
    # the refit layers before produce): a second refit finds each one where the first left it
    again = refit_subnet_(copy.deepcopy(sub), m, calib, progress=False)
    for i, e in errs.items():
        assert again[i]["error_before"] == pytest.approx(e["error_after"], rel=1e-4, abs=1e-9)
        assert again[i]["attention"]["error_before"] == pytest.approx(e["attention"]["error_after"], rel=1e-4,
                                                                       abs=1e-9)
    attn_only = twist_extract(m, keep=2, blocks=4, parts="attn", layers=[1, 2], seed=5)
    before = {i: find_sites(attn_only).mlp[i].read().down.clone() for i in range(4)}
    errs = refit_subnet_(attn_only, m, calib, progress=False)
    assert sorted(errs) == [1, 2] and all(set(e) == {"attention"} for e in errs.values())
    assert all(e["attention"]["error_after"] < e["attention"]["error_before"] for e in errs.values())
    assert all(torch.equal(find_sites(attn_only).mlp[i].read().down, before[i]) for i in range(4))
    whole = twist_extract(m, keep=4, blocks=4, parts="both", layers=[1, 2], seed=5)
    with pytest.raises(MLPSurgeryError, match="narrowed no MLP and cut no attention head"):
        refit_subnet_(whole, m, calib, progress=False)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_the_attention_refit_sees_what_the_output_projection_reads_and_the_originals_output(arch):
    """The sequential walk's attention rows (methods/reconstruct/sequential.py, attention.py) on an unchanged copy:
    the original attention, called with the very arguments the layer passed, gives out of its output projection
    exactly what the copy's output projection makes of the rows it read (relative error ~ 0 before any refit), and the
    refit keeps it; every architecture's masks, positions and rotary tables reach it."""
    from mlpsurgery.methods.reconstruct.layer import refit_model_

    m = four_layers(arch)
    same = copy.deepcopy(m)
    calib = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(2))
    fitted = refit_model_(same, m, calib, [], attn_layers=[1, 3])
    assert sorted(fitted) == [1, 3]
    for i, e in fitted.items():
        assert e["attention"]["error_before"] < 1e-10, (i, e)
        assert e["attention"]["error_after"] < 1e-4, (i, e)
    assert torch.allclose(outputs(same, calib[:1]), outputs(m, calib[:1]), atol=1e-3)


def blocks_of(seed=0, n=24, t=32):
    return torch.randint(0, 256, (n, t), generator=torch.Generator().manual_seed(seed))


def test_one_worker_holding_every_block_is_plain_training():
    cfg = TwISTConfig(workers=1, blocks=4, keep=4, interval=5, steps=5, batch_size=2, lr=1e-3, shared_first=1,
                      shared_last=1)
    a, b = four_layers("llama"), four_layers("llama")
    twist_train(a, blocks_of(), cfg, progress=False)
    twist_train(b, blocks_of(), cfg, mode="dp", progress=False)
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)


def test_masked_training_moves_only_what_it_should_and_records():
    m = four_layers("llama")
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    cfg = TwISTConfig(workers=2, blocks=4, keep=2, interval=2, steps=4, batch_size=2, lr=1e-3, shared_first=1,
                      shared_last=1, parts="ffn")
    res = twist_train(m, blocks_of(), cfg, progress=False)
    assert [h["round"] for h in res.history] == [1, 2] and all(len(h["worker_loss"]) == 2 for h in res.history)
    changed = {n for n, p in m.named_parameters() if not torch.equal(p, before[n])}
    assert "model.layers.1.mlp.down_proj.weight" in changed and "model.embed_tokens.weight" in changed
    assert m._mlpsurgery_history[-1]["method"] == "twist"
    # zero learning rate: aggregation puts every value back where it came from
    m2 = four_layers("llama")
    ref = [p.detach().clone() for p in m2.parameters()]
    twist_train(m2, blocks_of(), TwISTConfig(**{**cfg.__dict__, "lr": 0.0}), progress=False)
    assert all(torch.equal(p, r) for p, r in zip(m2.parameters(), ref))


def test_resume_equals_uninterrupted(tmp_path):
    cfg = TwISTConfig(workers=2, blocks=4, keep=2, interval=1, steps=3, batch_size=2, lr=1e-3, shared_first=1,
                      shared_last=1)
    a = four_layers("llama")
    twist_train(a, blocks_of(), cfg, progress=False)

    def stop(rec):
        if rec["round"] == 2:
            raise KeyboardInterrupt

    b = four_layers("llama")
    with pytest.raises(KeyboardInterrupt):
        twist_train(b, blocks_of(), cfg, checkpoint_dir=tmp_path / "ck", progress=False, callback=stop)
    c = four_layers("llama")  # a fresh process: the same starting model, weights restored from the checkpoint
    res = twist_train(c, blocks_of(), cfg, checkpoint_dir=tmp_path / "ck", progress=False)
    assert res.resumed_from == 2 and len(res.history) == 3
    for pa, pc in zip(a.parameters(), c.parameters()):
        assert torch.equal(pa, pc)


def test_resume_with_other_settings_model_or_data_is_refused(tmp_path):
    cfg = TwISTConfig(workers=2, blocks=4, keep=2, interval=1, steps=2, batch_size=2, lr=1e-3, shared_first=1,
                      shared_last=1)

    def stop(rec):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        twist_train(four_layers("llama"), blocks_of(), cfg, checkpoint_dir=tmp_path / "ck", progress=False,
                    callback=stop)
    saved = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    other = TwISTConfig(**{**cfg.__dict__, "keep": 3})
    for what, model, blocks, c, mode in (("keep", four_layers("llama"), blocks_of(), other, "masked"),
                                         ("model", four_layers("llama", seed=7), blocks_of(), cfg, "masked"),
                                         ("data", four_layers("llama"), blocks_of(seed=1), cfg, "masked"),
                                         ("algorithm", four_layers("llama"), blocks_of(), cfg, "dp")):
        before = [p.detach().clone() for p in model.parameters()]
        with pytest.raises(MLPSurgeryError, match=rf"other settings or another model \({what}\)"):
            twist_train(model, blocks, c, mode=mode, checkpoint_dir=tmp_path / "ck", progress=False)
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))  # nothing loaded or trained
        assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == saved  # nor written


def test_a_folder_mlpsurgery_did_not_write_is_refused_and_kept(tmp_path):
    mine = tmp_path / "ck"
    mine.mkdir()
    (mine / "notes.txt").write_text("the user's")
    cfg = TwISTConfig(workers=2, blocks=4, keep=2, interval=1, steps=1, shared_first=1, shared_last=1)
    for mode in ("masked", "dp"):
        with pytest.raises(MLPSurgeryError, match="did not write"):
            twist_train(four_layers("llama"), blocks_of(), cfg, mode=mode, checkpoint_dir=mine, progress=False)
    assert sorted(p.name for p in mine.iterdir()) == ["notes.txt"]


def test_training_errors_come_before_any_work():
    m = four_layers("llama")
    with pytest.raises(MLPSurgeryError, match="cannot cover every block"):
        twist_train(m, blocks_of(), TwISTConfig(workers=2, blocks=4, keep=1, shared_first=1, shared_last=1),
                    progress=False)
    with pytest.raises(MLPSurgeryError, match="torchrun"):
        twist_train(m, blocks_of(), TwISTConfig(workers=2, blocks=4, keep=2, shared_first=1, shared_last=1),
                    mode="true", progress=False)
    # without torchrun, a layout that could not work under it either is named first (not "launch torchrun")
    with pytest.raises(MLPSurgeryError, match="cannot cover every block"):
        twist_train(m, blocks_of(), TwISTConfig(workers=2, blocks=4, keep=1, shared_first=1, shared_last=1),
                    mode="hybrid", progress=False)
    with pytest.raises(MLPSurgeryError, match="no layer is partitioned"):
        twist_train(tiny_model("llama"), blocks_of(), TwISTConfig(workers=2, blocks=4, keep=2), progress=False)
    with pytest.raises(MLPSurgeryError, match="causal language models"):
        twist_train(four_layers("bert"), blocks_of(), TwISTConfig(), progress=False)


# ---- command line ----------------------------------------------------------------------------------

def test_cli_train_extract(tmp_path, capsys):
    from mlpsurgery.cli import main

    text = tmp_path / "t.txt"
    text.write_text("Emma Woodhouse, handsome, clever, and rich, with a comfortable home. " * 60)
    code = main(["twist", "train", "tiny:llama", "--out", str(tmp_path / "tw"), "--workers", "2", "--blocks", "4",
                 "--keep", "2", "--steps", "4", "--interval", "2", "--shared-first", "0", "--shared-last", "1",
                 "--data", str(text), "--block-len", "32", "--json", "--quiet"])
    r = json.loads(capsys.readouterr().out)
    assert code == 0 and r["rounds"] == 2 and len(r["history"]) == 2
    assert not (tmp_path / "tw.checkpoint").exists()
    code = main(["twist", "extract", str(tmp_path / "tw"), "--keep", "1", "--out", str(tmp_path / "sub"), "--json"])
    r = json.loads(capsys.readouterr().out)
    assert code == 0 and r["config"]["blocks"] == 4 and r["params_after"] < r["params_before"]
    assert r["config"]["layers"] == [0] and not r["plain_transformers"]
    code = main(["twist", "extract", str(tmp_path / "tw"), "--keep", "1", "--out", str(tmp_path / "sub"), "--json"])
    assert code == 2 and "already exists" in capsys.readouterr().err
    # layer by layer: the same subnet of the trained folder, as the whole-model command wrote it
    code = main(["twist", "extract", str(tmp_path / "tw"), "--keep", "1", "--out", str(tmp_path / "sub-lw"), "--json",
                 "--layerwise", "--quiet"])
    lw = json.loads(capsys.readouterr().out)
    assert code == 0 and lw["layerwise"] and {k: lw[k] for k in r} == {**r, "out": str(tmp_path / "sub-lw")}
    _same_subnet_folders(tmp_path / "sub", tmp_path / "sub-lw")
    # with calibration text: the same subnet, its narrowed MLPs refit (their error recorded), saved and reloaded
    code = main(["twist", "extract", str(tmp_path / "tw"), "--keep", "1", "--out", str(tmp_path / "sub-fit"),
                 "--calib-data", str(text), "--calib-blocks", "4", "--calib-len", "32", "--json", "--quiet"])
    fit = json.loads(capsys.readouterr().out)
    assert code == 0 and fit["subnet"] == r["subnet"] and fit["refit"]["calibration"] == [4, 32]
    assert [int(i) for i in fit["refit"]["layers"]] == [0]
    assert all(e["error_after"] < e["error_before"] for e in fit["refit"]["layers"].values())
    assert all(e["attention"]["error_after"] < e["attention"]["error_before"] for e in fit["refit"]["layers"].values())
    again, plain = find_sites(load(tmp_path / "sub-fit")), find_sites(load(tmp_path / "sub"))
    assert not torch.equal(again.mlp[0].read().down, plain.mlp[0].read().down)
    assert torch.equal(again.mlp[0].read().up, plain.mlp[0].read().up)
    # on text sampled from the trained model itself (data/sampled.py): refit as well
    code = main(["twist", "extract", str(tmp_path / "tw"), "--keep", "1", "--out", str(tmp_path / "sub-self"),
                 "--calib-data", "self", "--calib-blocks", "4", "--calib-len", "32", "--json", "--quiet"])
    own = json.loads(capsys.readouterr().out)
    assert code == 0 and own["subnet"] == r["subnet"] and own["refit"]["calibration"] == [4, 32]
    assert all(e["error_after"] < e["error_before"] for e in own["refit"]["layers"].values())
    # attention alone: its narrowed layers' output projections refit, no MLP touched
    code = main(["twist", "extract", str(tmp_path / "tw"), "--keep", "1", "--parts", "attn", "--out",
                 str(tmp_path / "sub-attn"), "--calib-data", str(text), "--calib-blocks", "4", "--calib-len", "32",
                 "--quiet"])
    out = capsys.readouterr().out
    assert code == 0 and "output projections of 1 attention layers with heads cut refit" in out
    assert "down projections" not in out
    # layer by layer: the same refit folder (the blocks flow through the subnet's layers as they are written); text
    # sampled from the model cannot be had without the whole model
    code = main(["twist", "extract", str(tmp_path / "tw"), "--keep", "1", "--out", str(tmp_path / "sub-fit-lw"),
                 "--calib-data", str(text), "--calib-blocks", "4", "--calib-len", "32", "--layerwise", "--json",
                 "--quiet"])
    lw = json.loads(capsys.readouterr().out)
    assert code == 0 and lw["refit"] == json.loads(json.dumps(fit["refit"]))
    _same_refit_folders(tmp_path / "sub-fit", tmp_path / "sub-fit-lw")
    code = main(["twist", "extract", str(tmp_path / "tw"), "--keep", "1", "--out", str(tmp_path / "x-fit"),
                 "--calib-data", "self", "--layerwise"])
    err = capsys.readouterr().err
    assert code == 2 and "self" in err and err.count("\n") == 1 and not (tmp_path / "x-fit").exists()
    # refused, exit 2, nothing written: a model without files, a folder holding pruning masks
    from mlpsurgery.methods.pruning import prune

    pruned, _ = prune(load(tmp_path / "tw"), "magnitude", 0.5)
    save(pruned, tmp_path / "pruned")
    for src, why in (("tiny:llama", "no weight files"), (str(tmp_path / "pruned"), "pruning masks")):
        code = main(["twist", "extract", src, "--keep", "1", "--layerwise", "--out", str(tmp_path / "x-lw")])
        assert code == 2 and why in capsys.readouterr().err and not (tmp_path / "x-lw").exists()
    code = main(["twist", "train", "tiny:llama", "--out", str(tmp_path / "x"), "--workers", "3", "--blocks", "4",
                 "--keep", "1", "--shared-first", "0", "--shared-last", "0", "--data", str(text)])
    assert code == 2 and "cannot cover every block" in capsys.readouterr().err and not (tmp_path / "x").exists()


def test_cli_resumes_its_own_checkpoint_and_refuses_others(tmp_path, capsys):
    from mlpsurgery.cli import main
    from mlpsurgery.data import load_corpus
    from mlpsurgery.tiny import byte_tokenizer

    text = tmp_path / "t.txt"
    text.write_text("Emma Woodhouse, handsome, clever, and rich, with a comfortable home. " * 60)
    args = ["--out", str(tmp_path / "tw"), "--workers", "2", "--blocks", "4", "--keep", "2", "--steps", "4",
            "--interval", "2", "--shared-first", "0", "--shared-last", "1", "--data", str(text), "--block-len", "32",
            "--json", "--quiet"]
    # a run of the same command stopped after its first round (the library call the command makes)
    cfg = TwISTConfig(workers=2, blocks=4, keep=2, steps=4, interval=2, shared_first=0, shared_last=1)

    def stop(rec):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        twist_train(tiny_model("llama"), load_corpus(str(text), byte_tokenizer()).blocks("train", 32), cfg,
                    checkpoint_dir=tmp_path / "tw.checkpoint", progress=False, callback=stop)
    # another model, or other settings: refused, the checkpoint kept as it was, nothing written
    for model, extra, why in (("tiny:qwen2", [], "(model)"), ("tiny:llama", ["--lr", "1e-3"], "(lr)")):
        assert main(["twist", "train", model, *args, *extra]) == 2
        assert why in capsys.readouterr().err and not (tmp_path / "tw").exists()
        assert (tmp_path / "tw.checkpoint" / "state" / "state.json").is_file()
    # the same command resumes at round 2 and removes the checkpoint once the model is saved
    assert main(["twist", "train", "tiny:llama", *args]) == 0
    assert json.loads(capsys.readouterr().out)["resumed_from_round"] == 1
    assert not (tmp_path / "tw.checkpoint").exists() and (tmp_path / "tw").is_dir()
    # a checkpoint folder the user filled is refused before any work and never deleted
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("the user's")
    args[1] = str(tmp_path / "tw2")
    assert main(["twist", "train", "tiny:llama", *args, "--checkpoint", str(mine)]) == 2
    assert "did not write" in capsys.readouterr().err
    assert sorted(p.name for p in mine.iterdir()) == ["notes.txt"] and not (tmp_path / "tw2").exists()
    assert main(["twist", "train", "tiny:llama", *args, "--checkpoint", str(tmp_path / "tw2" / "ck")]) == 2
    assert "overlap" in capsys.readouterr().err and not (tmp_path / "tw2").exists()
