"""Pruning masks are bit-packed in memory (modules/masks.py) and stored as boolean tensors of the parameter's shape:
the packing equals numpy's `packbits`, a pruned model holds an eighth of a byte per masked entry, gradients are
masked exactly as by the boolean mask, and the masks file is byte for byte what safetensors' `save_file` writes
of the boolean masks (what earlier versions wrote), so old and new folders load alike."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from mlpsurgery.io import load, save
from mlpsurgery.methods.pruning import prune
from mlpsurgery.modules import masks
from mlpsurgery.modules.masks import install_mask, mask_of, masked_parameters, pack, unpack
from mlpsurgery.tiny import tiny_model


@pytest.mark.parametrize("shape", [(0,), (1,), (7,), (8,), (9,), (3, 5), (64, 33), (2, 3, 11)])
def test_pack_is_numpys_packbits_and_unpack_inverts_it(shape, monkeypatch):
    g = torch.Generator().manual_seed(sum(shape))
    keep = torch.rand(shape, generator=g) > 0.5
    packed = pack(keep)
    assert packed.dtype == torch.uint8 and packed.shape == ((keep.numel() + 7) // 8,)
    np.testing.assert_array_equal(packed.numpy(), np.packbits(keep.numpy().reshape(-1), bitorder="little"))
    back = unpack(packed, shape)
    assert back.dtype == torch.bool and back.shape == keep.shape and torch.equal(back, keep)
    with pytest.raises(ValueError, match="packed mask"):
        unpack(torch.zeros(packed.numel() + 1, dtype=torch.uint8), shape)
    assert torch.equal(pack(keep.to(torch.uint8) * 3), packed)  # any non-zero byte is a kept entry
    # packed a slice at a time (slices cut at 16 entries here): the same bits; and the non-zeros of a tensor
    values = torch.where(keep, torch.randn(shape, generator=g), torch.zeros(shape))
    values[values.abs() > 1.5] = float("nan")
    assert masks._CHUNK % 8 == 0
    for chunk in (masks._CHUNK, 16):
        monkeypatch.setattr(masks, "_CHUNK", chunk)
        assert torch.equal(pack(keep), packed) and torch.equal(masks.pack_nonzero(values), pack(values != 0))


def _pruned(arch="llama"):
    model = tiny_model(arch)
    model, _ = prune(model, "magnitude", 0.5, progress=False)
    return model


@pytest.mark.parametrize("arch", ["llama", "gpt2", "bert"])
def test_a_pruned_model_holds_bits_and_masks_its_gradients_exactly(arch):
    model = _pruned(arch)
    names = masked_parameters(model)
    assert names
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    for name in names:
        assert buffers[name + "_mask"].dtype == torch.uint8
        assert buffers[name + "_mask"].numel() == (params[name].numel() + 7) // 8
        assert torch.equal(mask_of(model, name), params[name].detach() != 0)
    ids = torch.randint(0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    plain = copy.deepcopy(model)  # the same weights; its masks set aside to get the unmasked gradients
    for name in names:
        owner, _, attr = name.rpartition(".")
        del plain.get_submodule(owner)._buffers[attr + "_mask"]
    for m in (model, plain):
        m(input_ids=ids)[0].float().pow(2).mean().backward()
    pg = dict(plain.named_parameters())
    for name in names:
        keep = mask_of(model, name)
        assert torch.equal(params[name].grad, pg[name].grad * keep.to(pg[name].grad.dtype)), name
        assert (params[name].grad[~keep] == 0).all() and (pg[name].grad[~keep] != 0).any()


def test_install_mask_twice_keeps_the_intersection():
    model = tiny_model("llama")
    name = "model.layers.0.mlp.up_proj.weight"
    w = dict(model.named_parameters())[name]
    g = torch.Generator().manual_seed(1)
    a, b = torch.rand(w.shape, generator=g) > 0.3, torch.rand(w.shape, generator=g) > 0.3
    install_mask(model, name, a)
    install_mask(model, name, b)
    assert torch.equal(mask_of(model, name), a & b)
    assert (w.detach()[~(a & b)] == 0).all()


def test_the_masks_file_is_what_save_file_writes_and_loads_back_bit_packed(tmp_path):
    model = _pruned()
    names = masked_parameters(model)
    save(model, tmp_path / "m")
    stored = load_file(str(tmp_path / "m" / "masks.safetensors"))
    assert sorted(stored) == sorted(names)
    for name in names:
        assert stored[name].dtype == torch.bool and torch.equal(stored[name], mask_of(model, name))
    save_file(stored, str(tmp_path / "reference.safetensors"))  # what io.save wrote before the masks were packed
    assert (tmp_path / "m" / "masks.safetensors").read_bytes() == (tmp_path / "reference.safetensors").read_bytes()
    loaded = load(tmp_path / "m")
    assert masked_parameters(loaded) == names
    want, have = dict(model.named_buffers()), dict(loaded.named_buffers())
    for name in names:
        assert torch.equal(have[name + "_mask"], want[name + "_mask"])
