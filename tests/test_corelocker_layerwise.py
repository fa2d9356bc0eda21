"""`lock key --layerwise` (methods/corelocker/layerwise.py): CoreLocker on a checkpoint read one layer at a time
writes the same key and locked folder as the whole-model lock, bit for bit, and the key unlocks it."""

from __future__ import annotations

import json
import stat

import pytest
import torch

from conftest import file_tensors, saved_checkpoint
from mlpsurgery.cli import main
from mlpsurgery.errors import MLPSurgeryError
from mlpsurgery.io import MANIFEST, load
from mlpsurgery.methods.corelocker import CoreLockerConfig, lock_folder, read_key, unlock_folder
from mlpsurgery.methods.corelocker.layerwise import lock_layerwise, unlock_layerwise
from mlpsurgery.models import load_model
from mlpsurgery.tiny import ARCHITECTURES


def _same_lock(tmp_path, a, b):
    """The two locked folders and keys (a/, a.key; b/, b.key) are the same."""
    ta, tb = file_tensors(tmp_path / a), file_tensors(tmp_path / b)
    assert ta.keys() == tb.keys()
    for k in ta:
        assert ta[k].dtype == tb[k].dtype and torch.equal(ta[k], tb[k]), k
    ka, kb = read_key(tmp_path / f"{a}.key"), read_key(tmp_path / f"{b}.key")
    assert ka.header == kb.header
    assert list(ka.positions) == list(kb.positions)
    for n in ka.positions:
        assert torch.equal(ka.positions[n], kb.positions[n]) and torch.equal(ka.values[n], kb.values[n]), n
    ja, jb = (json.loads((tmp_path / d / MANIFEST).read_text()) for d in (a, b))
    for key in ("source", "history", "extra", "dtype", "model_class", "modules", "masks"):
        assert ja[key] == jb[key], key


def _whole(src, out, key, cfg, dtype=None):
    loaded = load_model(src, dtype=dtype)
    return lock_folder(loaded.model, out, key, cfg, tokenizer=loaded.tokenizer, progress=False, inputs=[src])


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("unit", ["weight", "neuron", "head"])
def test_layerwise_lock_equals_the_whole_model_lock_bit_for_bit(tmp_path, arch, unit):
    src = saved_checkpoint(tmp_path, arch)
    cfg = CoreLockerConfig(ratio=0.1 if unit != "head" else 0.25, unit=unit)
    whole = _whole(src, tmp_path / "whole", tmp_path / "whole.key", cfg)
    lw = lock_layerwise(src, tmp_path / "lw", tmp_path / "lw.key", cfg, progress=False)
    _same_lock(tmp_path, "whole", "lw")
    for k in ("units_extracted", "units_eligible", "entries", "model_params", "locked_fingerprint", "key_bytes"):
        assert whole[k] == lw[k], k
    assert stat.S_IMODE((tmp_path / "lw.key").stat().st_mode) == 0o600
    # the key unlocks the layer-by-layer folder into the original, bit for bit, whole or layer by layer
    unlock_folder(tmp_path / "lw", tmp_path / "lw.key", tmp_path / "back")
    unlock_layerwise(tmp_path / "lw", tmp_path / "lw.key", tmp_path / "back-lw")
    original = load_model(src).model.state_dict()
    for back in (load(tmp_path / "back").state_dict(), load(tmp_path / "back-lw").state_dict()):
        assert all(torch.equal(original[n], back[n]) for n in original)


@pytest.mark.parametrize("cfg", [CoreLockerConfig(ratio=0.2, scope="layer"),
                                 CoreLockerConfig(ratio=0.05, indicator="random", seed=3),
                                 CoreLockerConfig(ratio=0.05, include_io=True),
                                 CoreLockerConfig(ratio=0.1, unit="neuron"),
                                 CoreLockerConfig(ratio=0.25, unit="head", scope="layer"),
                                 CoreLockerConfig(ratio=0.3, indicator="scale")])
def test_layerwise_lock_other_settings_and_bfloat16_shards(tmp_path, cfg):
    # per-layer scope, the random baseline, the embeddings / head included (resident, extracted after the layers);
    # a bfloat16 checkpoint in shards, locked in bfloat16 and (cast on reading) in float32
    src = saved_checkpoint(tmp_path, "llama", torch.bfloat16, shard="20KB", num_hidden_layers=3)
    assert (src / "model.safetensors.index.json").is_file()
    for dtype in (torch.bfloat16, torch.float32):
        tag = str(dtype).split(".")[-1]
        _whole(src, tmp_path / f"whole-{tag}", tmp_path / f"whole-{tag}.key", cfg, dtype=dtype)
        lock_layerwise(src, tmp_path / f"lw-{tag}", tmp_path / f"lw-{tag}.key", cfg, dtype=dtype, progress=False)
        _same_lock(tmp_path, f"whole-{tag}", f"lw-{tag}")


def test_layerwise_lock_refuses_before_writing(tmp_path):
    src = saved_checkpoint(tmp_path, "llama")
    with pytest.raises(MLPSurgeryError, match="drop --layerwise"):
        lock_layerwise(src, tmp_path / "out", tmp_path / "k.key", CoreLockerConfig(ratio=0.1, unit="filter"),
                       progress=False)
    with pytest.raises(MLPSurgeryError, match="key"):  # the key inside the folder handed out
        lock_layerwise(src, tmp_path / "out", tmp_path / "out" / "k.key", CoreLockerConfig(ratio=0.1), progress=False)
    assert not (tmp_path / "out").exists() and not (tmp_path / "k.key").exists()


def test_cli_lock_key_layerwise_equals_the_whole_model_command(tmp_path, capsys):
    src = str(saved_checkpoint(tmp_path, "qwen2"))
    base = ["lock", "key", src, "--ratio", "0.05", "--dtype", "bfloat16", "--quiet"]
    assert main([*base, "--out", str(tmp_path / "whole"), "--key", str(tmp_path / "whole.key")]) == 0
    capsys.readouterr()
    assert main([*base, "--layerwise", "--out", str(tmp_path / "lw"), "--key", str(tmp_path / "lw.key"),
                 "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["layerwise"] and res["dtype"] == "bfloat16"
    _same_lock(tmp_path, "whole", "lw")
    for bad in (["--measure"], ["--unit", "filter"], ["--task", "causal-lm"]):
        code = main([*base, "--layerwise", "--out", str(tmp_path / "x"), "--key", str(tmp_path / "x.key"), *bad])
        assert code == 2 and "--layerwise" in capsys.readouterr().err
        assert not (tmp_path / "x").exists() and not (tmp_path / "x.key").exists()
    assert main(["lock", "key", "tiny:llama", "--ratio", "0.05", "--layerwise", "--out", str(tmp_path / "y"),
                 "--key", str(tmp_path / "y.key")]) == 2
    assert "tiny:llama has no weight files" in capsys.readouterr().err


def _same_folder(a, b):
    ta, tb = file_tensors(a), file_tensors(b)
    assert ta.keys() == tb.keys() and all(ta[k].dtype == tb[k].dtype and torch.equal(ta[k], tb[k]) for k in ta)
    ja, jb = (json.loads((d / MANIFEST).read_text()) for d in (a, b))
    for key in ("source", "history", "dtype", "model_class", "modules", "masks"):
        assert ja[key] == jb[key], key


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_layerwise_unlock_equals_the_whole_model_unlock(tmp_path, arch):
    src = saved_checkpoint(tmp_path, arch)
    _whole(src, tmp_path / "locked", tmp_path / "k.key", CoreLockerConfig(ratio=0.1, include_io=arch == "llama"))
    a = unlock_folder(tmp_path / "locked", tmp_path / "k.key", tmp_path / "whole")
    b = unlock_layerwise(tmp_path / "locked", tmp_path / "k.key", tmp_path / "lw")
    _same_folder(tmp_path / "whole", tmp_path / "lw")
    assert a["original_fingerprint"] == b["original_fingerprint"] and a["cross_checked"] and b["cross_checked"]
    original = load_model(src).model.state_dict()
    back = load(tmp_path / "lw").state_dict()
    assert all(torch.equal(original[n], back[n]) for n in original)


def test_layerwise_unlock_refuses_a_wrong_or_altered_key_and_writes_nothing(tmp_path, monkeypatch):
    from mlpsurgery.errors import IntegrityError
    from mlpsurgery.methods.corelocker import PASSPHRASE_ENV

    src = saved_checkpoint(tmp_path, "llama", torch.bfloat16, shard="20KB", num_hidden_layers=3)
    lock_layerwise(src, tmp_path / "a", tmp_path / "a.key", CoreLockerConfig(ratio=0.1), dtype=torch.bfloat16,
                   progress=False)
    lock_layerwise(src, tmp_path / "b", tmp_path / "b.key", CoreLockerConfig(ratio=0.2), dtype=torch.bfloat16,
                   progress=False)
    with pytest.raises(IntegrityError):  # another lock's key
        unlock_layerwise(tmp_path / "a", tmp_path / "b.key", tmp_path / "out")
    assert not (tmp_path / "out").exists()
    with pytest.raises(MLPSurgeryError, match="drop --layerwise"):  # not a stock structure
        lock = tmp_path / "masked"
        from mlpsurgery.methods.pruning import prune
        from mlpsurgery.io import save

        m, _ = prune(load_model(src).model, "magnitude", 0.5, progress=False)
        save(m, lock)
        unlock_layerwise(lock, tmp_path / "a.key", tmp_path / "out")
    assert not (tmp_path / "out").exists()
    # a sealed key: the same restored model as with the whole-model unlock
    monkeypatch.setenv(PASSPHRASE_ENV, "correct horse battery staple")
    loaded = load_model(src, dtype=torch.bfloat16)
    lock_folder(loaded.model, tmp_path / "s", tmp_path / "s.key", CoreLockerConfig(ratio=0.1),
                passphrase="correct horse battery staple", progress=False)
    r = unlock_layerwise(tmp_path / "s", tmp_path / "s.key", tmp_path / "s-lw", passphrase="correct horse battery staple")
    assert r["check"] == "authenticated"
    unlock_folder(tmp_path / "s", tmp_path / "s.key", tmp_path / "s-whole", passphrase="correct horse battery staple")
    _same_folder(tmp_path / "s-whole", tmp_path / "s-lw")


def test_cli_unlock_layerwise(tmp_path, capsys):
    src = str(saved_checkpoint(tmp_path, "gpt2"))
    assert main(["lock", "key", src, "--ratio", "0.05", "--layerwise", "--out", str(tmp_path / "locked"),
                 "--key", str(tmp_path / "k.key"), "--quiet"]) == 0
    for flag, out in (([], "whole"), (["--layerwise"], "lw")):
        assert main(["unlock", str(tmp_path / "locked"), "--key", str(tmp_path / "k.key"), "--out",
                     str(tmp_path / out), "--quiet", *flag]) == 0
    _same_folder(tmp_path / "whole", tmp_path / "lw")


# ---- the ratio for a target utility, found layer by layer (find_ratio_layerwise) ---------------------------

@pytest.mark.parametrize("unit,scope,include_io", [("weight", "global", False), ("neuron", "layer", False),
                                                   ("weight", "global", True)])
def test_layerwise_search_finds_the_whole_models_ratio_on_the_same_points(tmp_path, unit, scope, include_io):
    """Each point of the bisection: the units of that ratio selected by the streaming selection, the perplexity
    measured layer by layer with them extracted -- the whole model's points bit for bit, so the same ratio; the
    files and the resident parts are unchanged afterwards."""
    from mlpsurgery.methods.corelocker import find_ratio, lm_utility
    from mlpsurgery.methods.corelocker.layerwise import find_ratio_layerwise
    from mlpsurgery.methods.corelocker.ranking import Ranking
    from mlpsurgery.methods.corelocker.units import unit_groups
    from mlpsurgery.methods.corelocker.utility import evaluate_at

    src = saved_checkpoint(tmp_path, "llama", num_hidden_layers=3)
    before = file_tensors(src)
    g = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, 256, (n,), generator=g) for n in (60, 45)]
    cfg = CoreLockerConfig(unit=unit, scope=scope, include_io=include_io)
    model = load_model(src).model
    utility = lm_utility(seqs, block_len=16)
    u0 = utility(model)
    hi, _ = evaluate_at(model, Ranking(unit_groups(model, cfg), scope, 0.5), 0.5, utility)
    target, tol = (u0 + hi) / 2, (hi - u0) / 50  # (a random tiny model's perplexity moves little: 257 -> 259)
    whole = find_ratio(model, cfg, utility, target, tol, progress=False)
    lw = find_ratio_layerwise(src, cfg, seqs, target, tol, block_len=16, progress=False)
    assert lw["curve"] == whole.curve and lw["ratio"] == whole.ratio and len(lw["curve"]) > 3
    assert lw["within_tolerance"] == whole.within_tolerance
    after = file_tensors(src)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_cli_lock_key_layerwise_to_a_target_perplexity_equals_the_whole_model_command(tmp_path, capsys):
    src = str(saved_checkpoint(tmp_path, "llama", num_hidden_layers=3))
    from mlpsurgery.tiny import byte_tokenizer

    byte_tokenizer().save_pretrained(src)
    # random text, on which extraction raises this random model's perplexity (on English it lowers it: the
    # extracted model is nearer uniform)
    rng = torch.Generator().manual_seed(4)
    text = "".join(chr(33 + int(c)) for c in torch.randint(0, 90, (6000,), generator=rng))
    (tmp_path / "noise.txt").write_text("\n\n".join(text[i:i + 600] for i in range(0, 6000, 600)))
    data = ["--data", str(tmp_path / "noise.txt")]
    assert main(["lock", "key", src, "--ratio", "0.5", "--measure", "--calib-size", "256", "--json", *data,
                 "--out", str(tmp_path / "half"), "--key", str(tmp_path / "half.key")]) == 0
    u = json.loads(capsys.readouterr().out)["utility"]  # the target: halfway to what half the weights extracted give
    target, tol = (u["original"] + u["locked"]) / 2, (u["locked"] - u["original"]) / 50
    assert tol > 0  # (extraction raises this random model's perplexity, if only a little)
    base = ["lock", "key", src, "--target-utility", f"{target}", "--tolerance", f"{tol}", "--calib-size", "256",
            "--quiet", "--json", *data]
    assert main([*base, "--out", str(tmp_path / "whole"), "--key", str(tmp_path / "whole.key")]) == 0
    whole = json.loads(capsys.readouterr().out)
    assert main([*base, "--layerwise", "--out", str(tmp_path / "lw"), "--key", str(tmp_path / "lw.key"),
                 "--plot", str(tmp_path / "lw.png")]) == 0
    lw = json.loads(capsys.readouterr().out)
    assert lw["search"] == whole["search"] and lw["utility"] == whole["utility"]
    assert lw["config"]["ratio"] == whole["config"]["ratio"] > 0 and (tmp_path / "lw.png").is_file()
    _same_lock(tmp_path, "whole", "lw")
    # out of reach: refused, exit 2, nothing written, the points tried in the error's details
    assert main([*base[:3], "--target-utility", "1", "--layerwise", "--out", str(tmp_path / "x"),
                 "--key", str(tmp_path / "x.key"), "--json"]) == 2
    out = capsys.readouterr()
    assert "beyond the original" in out.err and json.loads(out.out)["curve"]
    assert not (tmp_path / "x").exists() and not (tmp_path / "x.key").exists()
