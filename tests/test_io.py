import json

import pytest
import torch
import transformers as T

from conftest import edit_manifest, outputs
from mlpsurgery.errors import IntegrityError, MLPSurgeryError
from mlpsurgery.io import export, load, read_manifest, record, save
from mlpsurgery.modules.dense import DenseMLP
from mlpsurgery.sites import find_sites
from mlpsurgery.tiny import tiny_model


def test_save_load_identical(model, ids, tmp_path):
    ref = outputs(model, ids)
    save(model, tmp_path / "m")
    again = load(tmp_path / "m")
    assert type(again) is type(model)
    assert torch.equal(outputs(again, ids), ref)


def test_save_load_replaced_structure(arch, ids, tmp_path):
    model = tiny_model(arch)
    sites = find_sites(model)
    sites.mlp[0].replace_mlp(DenseMLP.from_weights(sites.mlp[0].read().select(torch.arange(0, 64, 2))))
    sites.mlp[1].write(sites.mlp[1].read().select(torch.arange(40)))  # resized stock linears
    record(model, "test", {"note": "half the neurons"}, seed=0)
    ref = outputs(model, ids)
    save(model, tmp_path / "m")
    manifest = read_manifest(tmp_path / "m")
    classes = {e["class"] for e in manifest["modules"]}
    assert "DenseMLP" in classes
    assert manifest["history"][0]["method"] == "test"
    again = load(tmp_path / "m")
    assert torch.equal(outputs(again, ids), ref)


def test_export_untouched_loads_in_plain_transformers(model, ids, tmp_path):
    ref = outputs(model, ids)
    save(model, tmp_path / "m")
    export(tmp_path / "m", tmp_path / "hf")
    klass = type(model)
    plain, info = klass.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert torch.equal(outputs(plain.eval(), ids), ref)


def test_export_uniform_smaller_mlps(arch, ids, tmp_path):
    model = tiny_model(arch)
    keep = torch.arange(0, 64, 4)
    for s in find_sites(model).mlp:
        s.replace_mlp(DenseMLP.from_weights(s.read().select(keep)))
    ref = outputs(model, ids)
    save(model, tmp_path / "m")
    export(tmp_path / "m", tmp_path / "hf")
    plain, info = type(model).from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert find_sites(plain).mlp[0].h == len(keep)
    torch.testing.assert_close(outputs(plain.eval(), ids), ref, rtol=1e-5, atol=1e-5)


def test_export_of_mixed_widths_folds_into_resized_stock_linears_with_modeling_code(tmp_path, ids):
    """One layer's MLP narrowed to 10, the other whole: no single intermediate size states it, so the export holds
    the stock model with that layer's linears resized (no mlpsurgery module left) plus generated modeling code."""
    model = tiny_model("llama")
    s = find_sites(model).mlp[0]
    s.replace_mlp(DenseMLP.from_weights(s.read().select(torch.arange(10))))
    ref = outputs(model, ids)
    save(model, tmp_path / "m")
    export(tmp_path / "m", tmp_path / "hf")
    manifest = read_manifest(tmp_path / "hf")
    assert {e["class"] for e in manifest["modules"]} == {"Linear"}
    assert (tmp_path / "hf" / "modeling_mlpsurgery.py").exists()
    torch.testing.assert_close(outputs(load(tmp_path / "hf"), ids), ref, rtol=1e-5, atol=1e-5)


def test_corrupted_manifest_is_refused(tmp_path):
    save(tiny_model("gpt2"), tmp_path / "m")
    (tmp_path / "m" / "surgery.json").write_text('{"format": "mlpsurgery", "modules": [')
    with pytest.raises(IntegrityError, match="not valid JSON"):
        load(tmp_path / "m")
    (tmp_path / "m" / "surgery.json").write_text(json.dumps({"format": "other"}))
    with pytest.raises(IntegrityError, match="not an mlpsurgery manifest"):
        load(tmp_path / "m")


def test_unknown_module_class_in_manifest_is_refused(tmp_path):
    save(tiny_model("llama"), tmp_path / "m")
    edit_manifest(tmp_path / "m", lambda m: m.update(modules=[{"path": "model.layers.0.mlp", "class": "os.system",
                                                               "config": {}}]))
    with pytest.raises(IntegrityError, match="does not know"):
        load(tmp_path / "m")


def test_tampered_weights_are_refused(tmp_path):
    save(tiny_model("llama"), tmp_path / "m")
    w = tmp_path / "m" / "model.safetensors"
    data = bytearray(w.read_bytes())
    data[-5] ^= 0xFF
    w.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match="checksum"):
        load(tmp_path / "m")


def test_missing_weight_is_a_strict_error(tmp_path):
    """A manifest that does not match the tensors (here: a replacement erased) fails loudly."""
    model = tiny_model("llama")
    s = find_sites(model).mlp[0]
    s.replace_mlp(DenseMLP.from_weights(s.read()))
    save(model, tmp_path / "m")
    edit_manifest(tmp_path / "m", lambda m: m.update(modules=[]))
    with pytest.raises(IntegrityError, match="does not fit"):
        load(tmp_path / "m")


def test_save_refuses_non_empty_target_and_is_atomic(tmp_path, monkeypatch):
    model = tiny_model("gpt2")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "keep.txt").write_text("mine")
    with pytest.raises(MLPSurgeryError, match="not empty"):
        save(model, tmp_path / "busy")
    assert (tmp_path / "busy" / "keep.txt").read_text() == "mine"

    import mlpsurgery.io.saving as io_mod

    def boom(*a, **k):
        raise RuntimeError("disk full")

    monkeypatch.setattr(io_mod, "_write_weights", boom)
    with pytest.raises(RuntimeError):
        save(model, tmp_path / "new")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["busy"]


def test_loading_a_plain_folder_names_the_problem(tmp_path):
    tiny_model("gpt2").save_pretrained(tmp_path / "hf")
    with pytest.raises(MLPSurgeryError, match="no surgery.json"):
        load(tmp_path / "hf")
    with pytest.raises(MLPSurgeryError, match="does not exist"):
        load(tmp_path / "nope")


def test_export_after_in_place_resize(ids, tmp_path):
    """Every MLP narrowed through site.write (stock linears of a new shape, no new module class)."""
    model = tiny_model("gpt2")
    for s in find_sites(model).mlp:
        s.write(s.read().select(torch.arange(24)))
    ref = outputs(model, ids)
    save(model, tmp_path / "m")
    assert torch.equal(outputs(load(tmp_path / "m"), ids), ref)
    export(tmp_path / "m", tmp_path / "hf")
    plain = T.GPT2LMHeadModel.from_pretrained(tmp_path / "hf")
    assert plain.config.n_inner == 24
    torch.testing.assert_close(outputs(plain.eval(), ids), ref)


def test_a_history_with_int_keys_and_tuples_saves_and_loads(tmp_path, ids):
    """The manifest's self-digest is of the JSON load reads back (int keys become strings, tuples lists): a method
    that records {layer: value} must not make its own folder unloadable: sorted as ints 2 < 10, as strings "10" < "2",
    so a digest of the in-memory dict differs from the file's (found on SmolLM2's DLR-Lock of layers 5, 15, 25)."""
    from mlpsurgery.io import record

    model = tiny_model("llama")
    record(model, "test", {"per_layer": {2: 1.5, 10: (2, 4)}}, layers=(2, 10))
    folder = save(model, tmp_path / "m")
    again = load(folder)
    assert again._mlpsurgery_history[-1]["config"]["per_layer"] == {"2": 1.5, "10": [2, 4]}
    torch.testing.assert_close(outputs(again, ids), outputs(model, ids))


@pytest.mark.parametrize("arch", ["llama", "gemma", "gpt2", "bert"])
def test_weights_load_a_tensor_at_a_time_like_safetensors_load_model(tmp_path, arch):
    # io.load_weights replaces safetensors.torch.load_model (which maps the file and reads it whole): the same
    # tensors, the same (missing, unexpected) on a file saved with tied weights once, with a tensor too many, one
    # too few, one of another shape
    from safetensors.torch import load_file, load_model, save_file, save_model

    from mlpsurgery.io import load_weights

    src = tiny_model(arch)
    save_model(src, str(tmp_path / "w.safetensors"))
    a, b = tiny_model(arch), tiny_model(arch)
    for p in [*a.parameters(), *b.parameters()]:
        p.data.zero_()
    assert load_weights(a, tmp_path / "w.safetensors") == ([], []) == tuple(map(list, load_model(
        b, str(tmp_path / "w.safetensors"), strict=False)))
    sa, sb, ss = a.state_dict(), b.state_dict(), src.state_dict()
    assert all(torch.equal(sa[n], sb[n]) and torch.equal(sa[n], ss[n]) for n in ss)
    state = load_file(str(tmp_path / "w.safetensors"))
    gone = sorted(state)[1]
    save_file({**{k: v for k, v in state.items() if k != gone}, "extra.weight": torch.ones(2)},
              str(tmp_path / "x.safetensors"))
    missing, unexpected = load_weights(tiny_model(arch), tmp_path / "x.safetensors")
    assert gone in missing and unexpected == ["extra.weight"]
    save_file({**state, gone: torch.ones(3, 3, 3)}, str(tmp_path / "y.safetensors"))
    with pytest.raises(IntegrityError, match=gone.replace(".", r"\.")):
        load_weights(tiny_model(arch), tmp_path / "y.safetensors")


def _stock_cases():
    from mlpsurgery.methods import nsn
    from mlpsurgery.methods.dlr_lock import locked_like
    from mlpsurgery.methods.fusion import FusionConfig, fuse
    from mlpsurgery.methods.pruning import magnitude_prune

    return {"fused one layer": lambda m: fuse(m, FusionConfig(width=16, layers="0", n_init=1), progress=False) and m,
            "fused all": lambda m: fuse(m, FusionConfig(width=16, layers="all", n_init=1), progress=False) and m,
            "nested": lambda m: (nsn.nest(m), nsn.set_rank(m, 6)) and m,
            "masked": lambda m: magnitude_prune(m, 0.5, parts="ffn") and m,
            "dlr": lambda m: locked_like(m, rank=4, depth=3)}


@pytest.mark.parametrize("case", list(_stock_cases()))
def test_to_stock_consuming_equals_copying_and_leaves_the_callers_model_whole(arch, case, ids):
    """export's mode (to_stock of a tree copy, consume=True: the stock model made of the model's own tensors, each
    folded MLP dropped once written) gives bit for bit the model the copying mode gives; neither changes the
    caller's model, and the consuming one copies no tensor it can share."""
    import copy

    from mlpsurgery.io import to_stock, tree_copy

    if case == "dlr" and find_sites(tiny_model(arch)).mlp[0].shared_norm:  # Phi-2: no DLR-Lock (test_dlr_layerwise)
        with pytest.raises(MLPSurgeryError, match="shares its norm"):
            _stock_cases()[case](tiny_model(arch))
        return
    model = _stock_cases()[case](tiny_model(arch))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    structure = [(n, type(m)) for n, m in model.named_modules()]
    copied = to_stock(model)
    shared = to_stock(tree_copy(model), consume=True)
    consumed = to_stock(copy.deepcopy(model), consume=True)
    assert [(n, type(m)) for n, m in model.named_modules()] == structure
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    ref = copied.state_dict()
    for other in (shared, consumed):
        assert [(n, type(m)) for n, m in other.named_modules()] == [(n, type(m)) for n, m in copied.named_modules()]
        got = other.state_dict()
        assert got.keys() == ref.keys()
        for k in ref:
            assert got[k].dtype == ref[k].dtype and torch.equal(got[k], ref[k]), k
    ptrs = {t.data_ptr() for t in after.values()}
    emb = model.get_input_embeddings().weight
    assert shared.get_input_embeddings().weight.data_ptr() == emb.data_ptr()
    assert not any(t.data_ptr() in ptrs for t in ref.values() if t.numel())
    torch.testing.assert_close(outputs(shared, ids), outputs(model, ids), rtol=1e-4, atol=1e-5)


def test_the_same_model_saves_to_the_same_bytes_in_every_process(tmp_path):
    """safetensors' save_model wrote the tied names' metadata in its hash map's order, which changes from process
    to process: the same model gave weights (and manifest digests) that differed byte-wise. What is written must
    also be what save_model holds: the same tensors, tied copies once under the same name, the same metadata."""
    import subprocess
    import sys

    from safetensors import safe_open
    from safetensors.torch import save_model

    code = ("import sys, torch; from mlpsurgery.tiny import tiny_model; from mlpsurgery.io import save; "
            "m = tiny_model('llama', tie_word_embeddings=True); m.model.norm.weight.data.mul_(1.5); "
            "save(m, sys.argv[1])")
    digests = set()
    for k in range(3):  # each its own process: its own hash seed
        subprocess.run([sys.executable, "-c", code, str(tmp_path / f"m{k}")], check=True)
        digests.add((tmp_path / f"m{k}" / "model.safetensors").read_bytes())
    assert len(digests) == 1
    m = tiny_model("llama", tie_word_embeddings=True)
    m.model.norm.weight.data.mul_(1.5)
    save_model(m, str(tmp_path / "reference.safetensors"), metadata={"format": "pt"})
    with safe_open(str(tmp_path / "reference.safetensors"), "pt") as ref, \
            safe_open(str(tmp_path / "m0" / "model.safetensors"), "pt") as ours:
        assert ours.metadata() == ref.metadata() and len(ref.metadata()) == 2  # format + the tied name
        assert sorted(ours.keys()) == sorted(ref.keys())
        for k in ref.keys():
            assert torch.equal(ours.get_tensor(k), ref.get_tensor(k)), k
    assert torch.equal(load(tmp_path / "m0").model.norm.weight, m.model.norm.weight)
