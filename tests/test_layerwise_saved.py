"""Every layer-by-layer command on a folder mlpsurgery wrote (layerwise.LayerStream rebuilds its structure and
carries its history and source): the same folder as the whole-model command, so that layer-by-layer commands chain
(a subnet cut out layer by layer, then pruned, locked, fused or nested layer by layer)."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import file_tensors, saved_checkpoint
from mlpsurgery.cli import main
from mlpsurgery.io import MANIFEST, load
from mlpsurgery.tiny import byte_tokenizer


@pytest.fixture(params=["llama", "gpt2"])
def subnet(request, tmp_path):
    """A TwIST subnet with its first and last layers kept whole: narrower projections in the middle layers, which
    the manifest records (GPT-2: its registered narrow attention), and a history to carry."""
    arch = request.param
    src = saved_checkpoint(tmp_path, arch, **({"n_layer": 4} if arch == "gpt2" else {"num_hidden_layers": 4}))
    byte_tokenizer().save_pretrained(src)
    out = tmp_path / "subnet"
    assert main(["twist", "extract", str(src), "--keep", "2", "--blocks", "4", "--shared-first", "1",
                 "--shared-last", "1", "--layerwise", "--quiet", "--out", str(out)]) == 0
    assert json.loads((out / MANIFEST).read_text())["modules"]  # a structure to rebuild
    return out


def _same(a_dir, b_dir, method):
    a, b = file_tensors(a_dir), file_tensors(b_dir)
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    for name in ("masks.safetensors", "config.json"):
        assert (a_dir / name).is_file() == (b_dir / name).is_file()
        if name.endswith(".safetensors") and (a_dir / name).is_file():
            from safetensors.torch import load_file

            ma, mb = load_file(a_dir / name), load_file(b_dir / name)
            assert ma.keys() == mb.keys() and all(torch.equal(ma[k], mb[k]) for k in ma)
    ja, jb = (json.loads((d / MANIFEST).read_text()) for d in (a_dir, b_dir))
    for key in ("source", "history", "masks", "dtype", "model_class", "modules", "extra"):
        assert ja.get(key) == jb.get(key), key
    assert [h["method"] for h in ja["history"]][-2:] == ["twist-extract", method]


@pytest.mark.parametrize("command, method", [
    (["prune", "--method", "magnitude", "--sparsity", "0.5"], "magnitude-prune"),
    (["prune", "--method", "wanda", "--sparsity", "0.5", "--calib-blocks", "2", "--block-len", "16"], "wanda-prune"),
    (["fuse", "--width", "8", "--layers", "all", "--method", "neuron", "--data-free"], "fusion"),  # (layerwise: no data)
    (["nest", "--max-rank", "4", "--data-free"], "nsn"),
])
def test_a_layerwise_command_on_a_saved_folder_writes_what_the_whole_model_one_writes(tmp_path, subnet, command,
                                                                                     method, capsys):
    text = tmp_path / "t.txt"
    text.write_text("It was a truth universally acknowledged, that a single man in possession of a fortune. " * 40)
    data = ["--data", str(text)] if "wanda" in command else []
    args = [command[0], str(subnet), *command[1:], *data, "--quiet"]
    assert main([*args, "--out", str(tmp_path / "whole")]) == 0
    assert main([*args, "--layerwise", "--out", str(tmp_path / "lw")]) == 0, capsys.readouterr().err
    _same(tmp_path / "whole", tmp_path / "lw", method)


def test_lock_and_unlock_layer_by_layer_of_a_saved_folder(tmp_path, subnet):
    common = ["lock", "key", str(subnet), "--ratio", "0.1", "--quiet"]
    assert main([*common, "--out", str(tmp_path / "whole"), "--key", str(tmp_path / "whole.key")]) == 0
    assert main([*common, "--layerwise", "--out", str(tmp_path / "lw"), "--key", str(tmp_path / "lw.key")]) == 0
    _same(tmp_path / "whole", tmp_path / "lw", "corelocker")
    assert (tmp_path / "whole.key").read_bytes() == (tmp_path / "lw.key").read_bytes()
    assert main(["unlock", str(tmp_path / "lw"), "--key", str(tmp_path / "lw.key"), "--layerwise", "--quiet",
                 "--out", str(tmp_path / "back")]) == 0
    original, back = load(subnet).state_dict(), load(tmp_path / "back").state_dict()
    assert original.keys() == back.keys() and all(torch.equal(original[k], back[k]) for k in original)


def test_a_folder_with_pruning_masks_is_refused_layer_by_layer(tmp_path, subnet, capsys):
    assert main(["prune", str(subnet), "--method", "magnitude", "--sparsity", "0.5", "--quiet",
                 "--out", str(tmp_path / "pruned")]) == 0
    capsys.readouterr()
    pruned = str(tmp_path / "pruned")
    for args in (["prune", pruned, "--method", "magnitude", "--sparsity", "0.5"],
                 ["lock", "key", pruned, "--ratio", "0.1", "--key", str(tmp_path / "k.key")]):
        assert main([*args, "--layerwise", "--out", str(tmp_path / "x")]) == 2
        assert "pruning masks" in capsys.readouterr().err
        assert not (tmp_path / "x").exists() and not (tmp_path / "k.key").exists()


def test_a_saved_bfloat16_folder_asked_for_in_float32_layer_by_layer(tmp_path, subnet):
    """--dtype other than the saved one: built in it and read with a cast, as the whole-model load does."""
    from mlpsurgery.io import save

    save(load(subnet).to(torch.bfloat16), tmp_path / "bf16")
    args = ["nest", str(tmp_path / "bf16"), "--max-rank", "4", "--dtype", "float32", "--data-free", "--quiet"]
    assert main([*args, "--out", str(tmp_path / "whole")]) == 0
    assert main([*args, "--layerwise", "--out", str(tmp_path / "lw")]) == 0
    _same(tmp_path / "whole", tmp_path / "lw", "nsn")
    assert {t.dtype for t in file_tensors(tmp_path / "lw").values() if t.is_floating_point()} == {torch.float32}
