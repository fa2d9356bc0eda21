"""Calibration text sampled from the model itself (data/sampled.py) and the default calibration mix."""

import json

import pytest
import torch

from mlpsurgery.cli import main
from mlpsurgery.data import text_blocks
from mlpsurgery.data.sampled import DEFAULT_MIX, calibration_blocks, default_calibration, sample_blocks
from mlpsurgery.errors import MLPSurgeryError
from mlpsurgery.tiny import tiny_model


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_samples_are_full_seeded_blocks_of_the_models_own_text(arch, tokenizer):
    model = tiny_model(arch).train()
    state = torch.random.get_rng_state()
    a = sample_blocks(model, tokenizer, 5, 24, seed=3, batch=2)
    assert torch.equal(torch.random.get_rng_state(), state) and model.training  # the caller's RNG and mode kept
    assert a.shape == (5, 24) and a.dtype == torch.long
    assert not (a == tokenizer.eos_token_id).any()  # the end of text is suppressed: every block is full
    assert torch.equal(a, sample_blocks(model, tokenizer, 5, 24, seed=3, batch=2))  # seeded: the same blocks again
    assert not torch.equal(a, sample_blocks(model, tokenizer, 5, 24, seed=4))
    # they are the model's: a block is far likelier under it than under another model of the same shape
    with torch.no_grad():
        own = model.eval()(input_ids=a, labels=a).loss
        theirs = tiny_model(arch, seed=1)(input_ids=a, labels=a).loss
    assert own < theirs


def test_a_mix_takes_an_equal_share_of_each_part_and_the_default_is_the_mix(tokenizer):
    model = tiny_model("llama")
    mix = calibration_blocks("self+austen", model, tokenizer, 16, 6, seed=0)
    assert torch.equal(mix[:3], sample_blocks(model, tokenizer, 3, 16, seed=0))
    assert torch.equal(mix[3:], text_blocks("austen", tokenizer, block_len=16, max_blocks=3, seed=0))
    assert default_calibration(model) == DEFAULT_MIX == "self+austen+r8-train"
    assert torch.equal(calibration_blocks(None, model, tokenizer, 16, 6), calibration_blocks(DEFAULT_MIX, model,
                                                                                               tokenizer, 16, 6))
    assert torch.equal(calibration_blocks("austen", model, tokenizer, 16, 6, seed=1),
                       text_blocks("austen", tokenizer, block_len=16, max_blocks=6, seed=1))  # a corpus as before
    with pytest.raises(MLPSurgeryError, match="name self once"):
        calibration_blocks("self+self", model, tokenizer, 16, 6)


def test_an_encoder_cannot_sample_and_defaults_to_austen(tokenizer):
    bert = tiny_model("bert")
    assert default_calibration(bert) == "austen"
    with pytest.raises(MLPSurgeryError, match="does not generate text.*give --calib-data a corpus") as e:
        sample_blocks(bert, tokenizer, 2, 8)
    assert "\n" not in str(e.value)


def test_fuse_calibrates_on_the_models_samples_and_layer_by_layer_refuses_them(tmp_path, capsys):
    common = ["fuse", "tiny:llama", "--width", "16", "--method", "neuron", "--calib-blocks", "4", "--calib-len", "16",
              "--quiet", "--json"]
    assert main([*common, "--calib-data", "self", "--out", str(tmp_path / "a")]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["calibration"]["tokens"] == 64 and all(r["refit"]["refit"] for r in out["sites"])
    assert out["calibration"]["data"] == "self"
    # layer by layer the whole model is never held: sampling is refused, exit 2, nothing written
    assert main(["fuse", str(tmp_path / "a"), "--width", "8", "--layerwise", "--calib-data", "self+austen",
                 "--out", str(tmp_path / "b")]) == 2
    assert "layer-by-layer mode never holds" in capsys.readouterr().err and not (tmp_path / "b").exists()


def test_prune_calibrates_on_samples_whole_model_and_refuses_them_layer_by_layer(tmp_path, capsys):
    from mlpsurgery.io import save

    save(tiny_model("llama"), tmp_path / "src")
    common = ["prune", "tiny:llama", "--method", "wanda", "--sparsity", "0.5", "--calib-blocks", "4",
              "--block-len", "16", "--quiet", "--json"]
    assert main([*common, "--data", "self", "--out", str(tmp_path / "a")]) == 0
    assert json.loads(capsys.readouterr().out)["calibration"] == [4, 16]
    common[1] = str(tmp_path / "src")
    assert main([*common, "--data", "self", "--layerwise", "--out", str(tmp_path / "b")]) == 2
    assert "layer-by-layer mode never holds" in capsys.readouterr().err and not (tmp_path / "b").exists()
