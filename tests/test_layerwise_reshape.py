"""Layer-sequential fusion and NSN surgery (methods/fusion/layerwise.py, methods/nsn/layerwise.py): one layer in memory at a time, the compressed layers
appended to a file whose header is written last, and the folder equal to what `fuse` + `save` write."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from conftest import assert_same_folders, file_tensors, saved_checkpoint
from mlpsurgery.errors import MLPSurgeryError
from mlpsurgery.io import load, save
from mlpsurgery.tensorfiles import SafetensorsAppender, header_reserve
from mlpsurgery.methods.fusion import FusionConfig, fuse
from mlpsurgery.methods.fusion.layerwise import fuse_layerwise
from mlpsurgery.models import load_model
from mlpsurgery.tiny import ARCHITECTURES


def _same_folders(a_dir, b_dir, method="fusion"):
    ja = assert_same_folders(a_dir, b_dir)
    assert ja["modules"] and ja["history"][-1]["method"] == method  # something was replaced


def _whole(folder, out, cfg, dtype=None):
    loaded = load_model(folder, dtype=dtype)
    report = fuse(loaded.model, cfg, progress=False)
    save(loaded.model, out)
    return report


@pytest.mark.parametrize("arch", ["llama", "gpt2", "opt", "bert", "gemma2", "phi3"])
@pytest.mark.parametrize("method, calibration", [("neuron", "sequential"), ("svd", "sequential"),
                                                 ("fusion", "original")])
def test_calibrated_fuse_layer_by_layer_writes_the_whole_model_folder(tmp_path, arch, method, calibration):
    """The data-aware fuse (calibration stream through the layers, each compressed on what reaches it) layer by layer
    writes what the whole-model one writes, bit for bit."""
    src = saved_checkpoint(tmp_path, arch)
    calib = torch.randint(3, 250, (6, 24), generator=torch.Generator().manual_seed(0))
    cfg = FusionConfig(width=24, layers="all", n_init=1, method=method, calibration=calibration, calib_batch=4)
    loaded = load_model(src)
    whole = fuse(loaded.model, cfg, progress=False, calib_data=calib)
    save(loaded.model, tmp_path / "whole")
    lw = fuse_layerwise(src, tmp_path / "lw", cfg, progress=False, calib_data=calib)
    _same_folders(tmp_path / "whole", tmp_path / "lw")
    assert lw["sites"] == whole["sites"] and lw["calibration"] == whole["calibration"]
    assert lw["error_inputs"] == whole["error_inputs"]


@pytest.mark.parametrize("arch", ["llama", "gpt2", "bert"])
def test_local_tuning_layer_by_layer_writes_the_whole_model_folder(tmp_path, arch):
    """On-policy local tuning (each layer trained on its calibration rows before the next is calibrated) is the same
    code in both modes: the same folder, bit for bit, and the same report but for the seconds it took."""
    src = saved_checkpoint(tmp_path, arch)
    calib = torch.randint(3, 250, (16, 24), generator=torch.Generator().manual_seed(0))
    cfg = FusionConfig(width=24, layers="all", n_init=1, method="neuron", calib_batch=4, local_epochs=4,
                       local_lr=1e-3)
    loaded = load_model(src)
    whole = fuse(loaded.model, cfg, progress=False, calib_data=calib)
    save(loaded.model, tmp_path / "whole")
    lw = fuse_layerwise(src, tmp_path / "lw", cfg, progress=False, calib_data=calib)
    _same_folders(tmp_path / "whole", tmp_path / "lw")

    def timeless(sites):
        return [{**s, "local": {k: v for k, v in s["local"].items() if k != "seconds"}} for s in sites]

    assert timeless(lw["sites"]) == timeless(whole["sites"])
    assert all(s["local"]["steps"] == 2 for s in whole["sites"])  # ceil(4 epochs x 384 rows / 1024)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_layerwise_fusion_equals_whole_model_bit_for_bit(tmp_path, arch):
    src = saved_checkpoint(tmp_path, arch)
    cfg = FusionConfig(width=16, layers="all", n_init=1)
    whole = _whole(src, tmp_path / "whole", cfg)
    lw = fuse_layerwise(src, tmp_path / "lw", cfg, progress=False)
    _same_folders(tmp_path / "whole", tmp_path / "lw")
    assert lw["sites"] == whole["sites"] and lw["width"] == whole["width"] == 16
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ya, yb = load(tmp_path / "whole")(input_ids=ids), load(tmp_path / "lw")(input_ids=ids)
    key = "logits" if "logits" in ya else "last_hidden_state"
    assert torch.equal(ya[key], yb[key])


@pytest.mark.parametrize("method", ["cluster", "svd", "sketch", "mmd", "neuron", "random"])
def test_every_data_free_baseline_layer_by_layer_equals_whole_model(tmp_path, method):
    src = saved_checkpoint(tmp_path, "llama", num_hidden_layers=3)
    cfg = FusionConfig(width=12, method=method, n_init=1, mmd_steps=10)  # default layers: the last two thirds
    whole = _whole(src, tmp_path / "whole", cfg)
    lw = fuse_layerwise(src, tmp_path / "lw", cfg, progress=False)
    _same_folders(tmp_path / "whole", tmp_path / "lw")
    assert lw["sites"] == whole["sites"] and lw["layers"] == [1, 2]
    assert lw["mlp_params_after"] < lw["mlp_params_before"]


def test_layerwise_fusion_reads_bfloat16_shards(tmp_path):
    src = saved_checkpoint(tmp_path, "gpt2", dtype=torch.bfloat16, shard="20KB", n_layer=4)
    assert (src / "model.safetensors.index.json").is_file()
    cfg = FusionConfig(width=16, layers="1-2", n_init=1)
    _whole(src, tmp_path / "whole", cfg, dtype=torch.bfloat16)
    lw = fuse_layerwise(src, tmp_path / "lw", cfg, dtype=torch.bfloat16, progress=False)
    _same_folders(tmp_path / "whole", tmp_path / "lw")
    assert lw["dtype"] == "bfloat16" and lw["layers"] == [1, 2]


@pytest.mark.parametrize("arch,method,importance", [("llama", "fusion", "weight"), ("gpt2", "fusion", "weight"),
                                                     ("bert", "fusion", "weight"), ("llama", "neuron", "activation")])
def test_layerwise_tuning_equals_whole_model_bit_for_bit(tmp_path, arch, method, importance):
    """Tune data flows through the original layers as they are read; each layer is compressed, scored and tuned on
    its own captured pairs: the folder, the per-layer errors before and after tuning and the summed MSEs are the
    whole model's (the tiny models' tuning gradients stay under the clip, where the two modes are the same
    arithmetic); only one layer's pairs are ever in the work folder, and none after."""
    src = saved_checkpoint(tmp_path, arch, **({"n_layer": 3} if arch == "gpt2" else {"num_hidden_layers": 3}))
    blocks = torch.randint(0, 256, (12, 16), generator=torch.Generator().manual_seed(3))
    cfg = FusionConfig(width=12, method=method, importance=importance, layers="0,2", n_init=1, tune_steps=7,
                       tune_lr=3e-3, tune_batch=64)
    loaded = load_model(src)
    whole = fuse(loaded.model, cfg, tune_data=blocks, progress=False)
    save(loaded.model, tmp_path / "whole")
    seen = []
    import mlpsurgery.methods.fusion.layerwise as flw
    real = flw.tune_layers

    def spy(model, capture, layers, *a, **kw):
        seen.append(sorted(p.name for p in (tmp_path / "lw.work").iterdir() if p.name.startswith("layer")))
        return real(model, capture, layers, *a, **kw)

    flw.tune_layers = spy
    try:
        lw = fuse_layerwise(src, tmp_path / "lw", cfg, tune_data=blocks, workdir=tmp_path / "lw.work", progress=False)
    finally:
        flw.tune_layers = real
    _same_folders(tmp_path / "whole", tmp_path / "lw")
    assert lw["sites"] == whole["sites"] and all("error_rel_tuned" in r for r in lw["sites"])
    assert lw["tuning"]["mse_after"] < lw["tuning"]["mse_before"]
    for key in ("mse_before", "mse_after"):
        assert lw["tuning"][key] == pytest.approx(whole["tuning"][key], rel=1e-6)
    assert seen == [["layer000"], ["layer002"]]  # one layer's pairs at a time
    assert [p.name for p in (tmp_path / "lw.work").iterdir() if p.name.startswith("layer")] == []


def test_layerwise_fusion_refuses_what_it_cannot_do_before_writing(tmp_path):
    src = saved_checkpoint(tmp_path, "llama")
    with pytest.raises(MLPSurgeryError, match="prune --layerwise"):
        fuse_layerwise(src, tmp_path / "o1", FusionConfig(method="magnitude", width=8), progress=False)
    with pytest.raises(MLPSurgeryError, match="tune data"):
        fuse_layerwise(src, tmp_path / "o2", FusionConfig(method="neuron", importance="activation", width=8),
                       progress=False)
    with pytest.raises(MLPSurgeryError, match="width"):
        fuse_layerwise(src, tmp_path / "o3", FusionConfig(width=10_000), progress=False)
    assert not any((tmp_path / o).exists() for o in ("o1", "o2", "o3"))


def test_appended_safetensors_file_reads_back_and_refuses_a_header_past_its_space(tmp_path):
    t = {"b": torch.randn(3, 4), "a": torch.randn(5).bfloat16(), "m": torch.rand(2, 3) > 0.5, "e": torch.zeros(0, 2)}
    w = SafetensorsAppender(tmp_path / "x.safetensors", header_reserve({k: (v.dtype, v.shape) for k, v in t.items()}))
    for k in ("m", "a", "e", "b"):  # any order, shapes known only as they come
        w.write(k, t[k])
    w.close({"format": "pt"})
    back = load_file(str(tmp_path / "x.safetensors"))
    assert back.keys() == t.keys() and all(torch.equal(back[k], t[k]) for k in t)
    with safe_open(str(tmp_path / "x.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"}
    raw = (tmp_path / "x.safetensors").read_bytes()
    assert (8 + struct.unpack("<Q", raw[:8])[0]) % 8 == 0
    w = SafetensorsAppender(tmp_path / "y.safetensors", 64)
    w.write("a-rather-long-name-" * 4, torch.zeros(2))
    with pytest.raises(MLPSurgeryError, match="outgrew"):
        w.close()
    w = SafetensorsAppender(tmp_path / "z.safetensors", 4096)
    w.write("a", torch.zeros(2))
    with pytest.raises(MLPSurgeryError, match="twice"):
        w.write("a", torch.zeros(2))


def test_cli_fuse_layerwise_equals_the_whole_model_command(tmp_path, capsys):
    from mlpsurgery.cli import main
    from mlpsurgery.tiny import byte_tokenizer

    src = saved_checkpoint(tmp_path, "llama", num_hidden_layers=3)
    byte_tokenizer().save_pretrained(src)
    # the layer-by-layer fuse is data-free (as the papers): the whole-model command's data-free mode is its reference
    common = ["fuse", str(src), "--width", "12", "--layers", "all", "--n-init", "1", "--data-free", "--quiet", "--json"]
    assert main([*common, "--out", str(tmp_path / "whole")]) == 0
    whole = json.loads(capsys.readouterr().out)
    assert main([*common, "--layerwise", "--out", str(tmp_path / "lw")]) == 0
    lw = json.loads(capsys.readouterr().out)
    assert lw["layerwise"] and lw["sites"] == whole["sites"]
    assert (lw["mlp_params_before"], lw["mlp_params_after"]) == (whole["mlp_params_before"], whole["mlp_params_after"])
    a, b = file_tensors(tmp_path / "whole"), file_tensors(tmp_path / "lw")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert (tmp_path / "lw" / "tokenizer_config.json").is_file()
    # with tune data: the whole-model command's folder, its work folder gone
    tuned = [*common[:-2], "--tune-data", "austen", "--tune-blocks", "8", "--block-len", "32", "--tune-steps", "3",
             "--quiet", "--json"]
    assert main([*tuned, "--out", str(tmp_path / "whole-t")]) == 0
    whole = json.loads(capsys.readouterr().out)
    assert main([*tuned, "--layerwise", "--out", str(tmp_path / "lw-t")]) == 0
    lw = json.loads(capsys.readouterr().out)
    assert lw["sites"] == whole["sites"] and lw["tuning"]["steps"] == whole["tuning"]["steps"] == 3
    a, b = file_tensors(tmp_path / "whole-t"), file_tensors(tmp_path / "lw-t")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not (tmp_path / "lw-t.work").exists()
    # calibrated (named, layer by layer; the default of the whole-model command), with the tune data too
    calibrated = [*tuned[:-2], "--calib-data", "austen", "--calib-blocks", "4", "--calib-len", "32", "--quiet", "--json"]
    calibrated.remove("--data-free")
    assert main([*calibrated, "--out", str(tmp_path / "whole-c")]) == 0
    whole_c = json.loads(capsys.readouterr().out)
    assert main([*calibrated, "--layerwise", "--out", str(tmp_path / "lw-c")]) == 0
    lw_c = json.loads(capsys.readouterr().out)
    assert lw_c["sites"] == whole_c["sites"] and lw_c["calibration"]["tokens"] == whole_c["calibration"]["tokens"] == 128
    assert all("error_rel_tuned" in r and r["refit"]["refit"] for r in lw_c["sites"])
    c, d = file_tensors(tmp_path / "whole-c"), file_tensors(tmp_path / "lw-c")
    assert c.keys() == d.keys() and all(torch.equal(c[k], d[k]) for k in c)
    # --max-memory just above one layer, the embeddings and a layer's captured pairs: the tune stream goes to files
    # in the work folder from the first batch on, and the folder is the same
    from mlpsurgery.layerwise import LayerStream

    stream = LayerStream(src)
    pairs = 2 * 8 * 32 * stream.model.config.hidden_size * 4  # one layer's captured pairs (fusion/layerwise.py)
    cap = repr((stream.resident_bytes + 2 * max(stream.layer_bytes) + pairs + 1) / 2**30)
    assert main([*tuned, "--layerwise", "--max-memory", cap, "--out", str(tmp_path / "lw-disk")]) == 0
    disk = json.loads(capsys.readouterr().out)
    assert disk["activations_on_disk"] and not lw["activations_on_disk"] and disk["sites"] == lw["sites"]
    a = file_tensors(tmp_path / "lw-disk")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not (tmp_path / "lw-disk.work").exists()
    # --max-memory where it caps nothing is refused: the whole model, layer by layer without tune data
    assert main([*tuned, "--max-memory", "1", "--out", str(tmp_path / "x5")]) == 2
    assert main([*common, "--layerwise", "--max-memory", "1", "--out", str(tmp_path / "x6")]) == 2
    assert "add --layerwise" in capsys.readouterr().err
    # refused, exit 2, nothing written: a block length past the context, the magnitude baseline, a model without
    # files, a work folder holding the user's files
    assert main(["fuse", str(src), "--width", "8", "--layerwise", "--tune-data", "austen", "--block-len", "100000",
                 "--out", str(tmp_path / "x1")]) == 2
    assert main(["fuse", str(src), "--width", "8", "--method", "magnitude", "--layerwise",
                 "--out", str(tmp_path / "x2")]) == 2
    assert main(["fuse", "tiny:llama", "--width", "8", "--layerwise", "--out", str(tmp_path / "x3")]) == 2
    (tmp_path / "x4.work").mkdir()
    (tmp_path / "x4.work" / "notes.txt").write_text("mine")
    assert main(["fuse", str(src), "--width", "8", "--layerwise", "--tune-data", "austen",
                 "--out", str(tmp_path / "x4")]) == 2
    assert not any((tmp_path / x).exists() for x in ("x1", "x2", "x3", "x4", "x5", "x6", "x1.work", "x6.work"))
    assert [p.name for p in (tmp_path / "x4.work").iterdir()] == ["notes.txt"]
    err = capsys.readouterr().err
    assert "exceeds the model's context" in err and "did not write" in err


# ---- NSN surgery (methods/nsn/layerwise.py) -----------------------------------------------------------

@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_layerwise_nesting_equals_whole_model_bit_for_bit(tmp_path, arch):
    from mlpsurgery.methods.nsn import NSNConfig, nest
    from mlpsurgery.methods.nsn.layerwise import nest_layerwise

    src = saved_checkpoint(tmp_path, arch)
    cfg = NSNConfig(max_rank=8, modules="mlp+attn", layers="all")
    loaded = load_model(src)
    nest(loaded.model, cfg)
    save(loaded.model, tmp_path / "whole")
    lw = nest_layerwise(src, tmp_path / "lw", cfg, progress=False)
    _same_folders(tmp_path / "whole", tmp_path / "lw", method="nsn")
    assert lw["projections"] == len([m for m in loaded.model.modules() if type(m).__name__ == "NestedLinear"])


@pytest.mark.parametrize("arch", ["llama", "gpt2", "bert", "phi3"])
@pytest.mark.parametrize("epochs, refit", [(0.0, True), (2.0, False), (2.0, True)])
def test_refit_and_tuned_nesting_layer_by_layer_writes_the_whole_model_folder(tmp_path, arch, epochs, refit):
    """nest --refit / --local-epochs layer by layer: the calibration stream goes on through each nested, refit, tuned
    layer, so the folder is the whole-model one bit for bit (the same per-layer code on the same rows), and it is
    not the plain whitened start's."""
    from mlpsurgery.io import history
    from mlpsurgery.methods.nsn import NSNConfig, nest
    from mlpsurgery.methods.nsn.layerwise import nest_layerwise

    src = saved_checkpoint(tmp_path, arch)
    calib = torch.randint(3, 250, (12, 24), generator=torch.Generator().manual_seed(0))
    cfg = NSNConfig(layers="all")
    loaded = load_model(src)
    nest(loaded.model, cfg, calib_data=calib, local_epochs=epochs, local_lr=1e-3, refit=refit, seed=3)
    save(loaded.model, tmp_path / "whole")
    lw = nest_layerwise(src, tmp_path / "lw", cfg, progress=False, calib_data=calib, local_epochs=epochs,
                        local_lr=1e-3, refit=refit, seed=3)
    ja = assert_same_folders(tmp_path / "whole", tmp_path / "lw", keys=("source", "dtype", "model_class", "modules"))
    a, b = (history(load(tmp_path / d))[-1]["provenance"] for d in ("whole", "lw"))
    for p in (a, b):  # what the tuning took differs from run to run; everything else is the same
        p.get("local", {}).pop("seconds", None)
    assert a == b and ja["modules"]
    assert "sequential" in lw["init"] and ("down refit" in lw["init"]) == refit
    assert ("local" in lw) == (epochs > 0) and lw.get("local", {}).get("layers") in (None, 2)
    plain = tmp_path / "plain"
    nest_layerwise(src, plain, cfg, progress=False, calib_data=calib)
    x, y = file_tensors(tmp_path / "lw"), file_tensors(plain)
    assert any(not torch.equal(x[k], y[k]) for k in x if k in y)


def test_cli_nest_layerwise_equals_the_whole_model_command(tmp_path, capsys):
    from mlpsurgery.cli import main
    from mlpsurgery.tiny import byte_tokenizer

    src = saved_checkpoint(tmp_path, "gpt2", dtype=torch.bfloat16, shard="20KB", n_layer=3)
    byte_tokenizer().save_pretrained(src)
    common = ["nest", str(src), "--max-rank", "6", "--layers", "1-2", "--dtype", "auto", "--data-free", "--quiet",
              "--json"]
    assert main([*common, "--out", str(tmp_path / "whole")]) == 0
    assert main([*common, "--layerwise", "--out", str(tmp_path / "lw")]) == 0
    capsys.readouterr()
    _same_folders(tmp_path / "whole", tmp_path / "lw", method="nsn")
    assert main(["nest", str(src), "--layerwise", "--train-steps", "2", "--out", str(tmp_path / "x1")]) == 2
    assert main(["nest", "tiny:llama", "--layerwise", "--out", str(tmp_path / "x2")]) == 2
    # the whitened start, layer by layer when asked for by name: the whole-model command's folder
    white = [*common, "--calib-data", "austen", "--calib-blocks", "4", "--calib-len", "32"]
    white.remove("--data-free")
    assert main([*white, "--out", str(tmp_path / "whole-w")]) == 0
    assert main([*white, "--layerwise", "--out", str(tmp_path / "lw-w")]) == 0
    capsys.readouterr()
    _same_folders(tmp_path / "whole-w", tmp_path / "lw-w", method="nsn")
    a, b = file_tensors(tmp_path / "whole-w"), file_tensors(tmp_path / "lw")
    assert any(not torch.equal(a[k], b[k]) for k in a)  # and not the plain SVD's
    assert not any((tmp_path / x).exists() for x in ("x1", "x2"))
    # the sequential start (down refit, local tuning) layer by layer: the whole-model command's folder; the rows
    # are asked for by name, as the whitened start's
    for opt in (["--refit"], ["--local-epochs", "1"]):
        assert main([*common, *opt, "--layerwise", "--out", str(tmp_path / "x3")]) == 2
        assert "drop --data-free" in capsys.readouterr().err
    fit = [*white, "--refit", "--local-epochs", "1"]
    assert main([*fit, "--out", str(tmp_path / "whole-f")]) == 0
    assert main([*fit, "--layerwise", "--out", str(tmp_path / "lw-f")]) == 0
    capsys.readouterr()
    assert_same_folders(tmp_path / "whole-f", tmp_path / "lw-f", keys=("source", "dtype", "model_class", "modules"))
    assert not (tmp_path / "x3").exists()


# ---- NSN rank export (nest rank --layerwise) ------------------------------------------------------------

@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_layerwise_rank_export_equals_whole_model_bit_for_bit(tmp_path, arch):
    from mlpsurgery.layerwise import LayerStream
    from mlpsurgery.methods.nsn import NSNConfig, export_rank, nest
    from mlpsurgery.methods.nsn.layerwise import export_rank_layerwise

    loaded = load_model(saved_checkpoint(tmp_path, arch))
    nest(loaded.model, NSNConfig(max_rank=8, modules="mlp+attn", layers="all"))
    save(loaded.model, tmp_path / "nested")
    for form, how in (("lowrank", {"rank": 3}), ("nested", {"budget": 0.2})):
        whole = export_rank(tmp_path / "nested", tmp_path / f"whole-{form}", form=form, **how)
        lw = export_rank_layerwise(tmp_path / "nested", tmp_path / f"lw-{form}", form=form, progress=False, **how)
        _same_folders(tmp_path / f"whole-{form}", tmp_path / f"lw-{form}",
                      method="nsn-truncate" if form == "lowrank" else "nsn")
        assert {k: lw[k] for k in whole if k != "out"} == {k: v for k, v in whole.items() if k != "out"}
        assert lw["rank"] < 8
        # truncated: fewer parameters; nested: every component kept, only the serving rank recorded
        assert (lw["params_after"] < lw["params_before"]) == (form == "lowrank")
    stream = LayerStream(tmp_path / "lw-lowrank")  # what it wrote streams too, at the rank it was cut to
    assert {m.max_rank for m in stream.model.modules() if type(m).__name__ == "NestedLinear"} == {3}


def test_cli_nest_rank_layerwise_and_its_refusals(tmp_path, capsys):
    from mlpsurgery.cli import main
    from mlpsurgery.io import export
    from mlpsurgery.tiny import byte_tokenizer

    src = saved_checkpoint(tmp_path, "llama", dtype=torch.bfloat16, num_hidden_layers=3)
    byte_tokenizer().save_pretrained(src)
    assert main(["nest", str(src), "--max-rank", "6", "--dtype", "auto", "--quiet", "--out", str(tmp_path / "n")]) == 0
    capsys.readouterr()
    common = ["nest", "rank", str(tmp_path / "n"), "--rank", "2", "--quiet", "--json"]
    assert main([*common, "--out", str(tmp_path / "whole")]) == 0
    whole = json.loads(capsys.readouterr().out)
    assert main([*common, "--layerwise", "--out", str(tmp_path / "lw")]) == 0
    lw = json.loads(capsys.readouterr().out)
    assert lw["layerwise"] and lw["dtype"] == "bfloat16" and lw["params_after"] == whole["params_after"]
    _same_folders(tmp_path / "whole", tmp_path / "lw", method="nsn-truncate")
    assert (tmp_path / "lw" / "tokenizer_config.json").is_file()
    # the dense form: lowrank layer by layer, then export, gives the whole-model command's dense weights
    assert main([*common, "--form", "dense", "--out", str(tmp_path / "dense")]) == 0
    export(tmp_path / "lw", tmp_path / "lw-dense")
    a, b = load_file(tmp_path / "dense" / "model.safetensors"), load_file(tmp_path / "lw-dense" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # refused, exit 2, nothing written: --form dense, a folder with nothing nested
    capsys.readouterr()
    assert main([*common, "--form", "dense", "--layerwise", "--out", str(tmp_path / "x1")]) == 2
    assert "mlpsurgery export" in capsys.readouterr().err
    assert main(["nest", "rank", str(tmp_path / "lw-dense"), "--rank", "2", "--layerwise",
                 "--out", str(tmp_path / "x2")]) == 2
    assert not any((tmp_path / x).exists() for x in ("x1", "x2"))
