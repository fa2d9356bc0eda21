"""The Adam-NTK diagnostic and the output error (measure/ntk.py), on tiny models."""

import copy

import pytest
import torch

from mlpsurgery.errors import MLPSurgeryError
from mlpsurgery.measure.ntk import (adam_ntk, compressed_layers, mlp_ntk_error, ntk_error, output_error,
                                    scalar_output, sites_parameters)
from mlpsurgery.methods.fusion import FusionConfig, fuse
from mlpsurgery.tiny import tiny_model

IDS = torch.randint(0, 256, (5, 16), generator=torch.Generator().manual_seed(0))


def _brute_force(model, ids, layers, labels=None, **kw):
    params = sites_parameters(model, layers)
    grads = []
    for a in range(len(ids)):
        lab = None if labels is None else labels[a:a + 1]
        f = scalar_output(model, {"input_ids": ids[a:a + 1]}, labels=lab, **kw).sum()
        grads.append(torch.cat([g.flatten() for g in torch.autograd.grad(f, params)]).double())
    G = torch.stack(grads)
    return G @ G.sign().T, G


@pytest.mark.parametrize("arch", ["llama", "bert"])
def test_kernel_is_the_sign_kernel(arch):
    model = tiny_model(arch)
    K = adam_ntk(model, IDS, [0, 1], progress=False)
    ref, G = _brute_force(model, IDS, [0, 1])
    torch.testing.assert_close(K, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(K.diagonal(), G.abs().sum(1), rtol=1e-5, atol=1e-6)  # K[a, a] = ||g_a||_1
    assert not torch.allclose(K, K.T)  # the Adam kernel is asymmetric (unlike the SGD NTK G Gᵀ)


def test_model_against_itself_is_zero_and_the_error_is_symmetric():
    a = tiny_model("qwen2")
    r = ntk_error(a, copy.deepcopy(a), IDS, progress=False)
    assert r["ntk_error"] == 0.0 and r["layers"] == [0, 1]
    assert output_error(a, copy.deepcopy(a), IDS)["error_rel"] < 1e-6  # y - x of the capture: rounding only
    b = copy.deepcopy(a)
    fuse(b, FusionConfig(width=16, layers="1"), progress=False)
    ab, ba = ntk_error(a, b, IDS, progress=False), ntk_error(b, a, IDS, progress=False)
    assert ab["layers"] == ba["layers"] == [1]
    assert ab["ntk_error"] == pytest.approx(ba["ntk_error"], rel=1e-12) and ab["ntk_error"] > 0
    # relative to each side's own kernel: the norms differ, so the relative errors do too
    assert ab["ntk_error_rel"] * ab["reference_norm"] == pytest.approx(ba["ntk_error_rel"] * ba["reference_norm"])
    assert ab["params_candidate"] < ab["params_reference"]


def test_kernel_is_equivariant_under_sample_permutation():
    model = tiny_model("gpt2")
    perm = torch.tensor([3, 0, 4, 1, 2])
    K = adam_ntk(model, IDS, [1], progress=False)
    Kp = adam_ntk(model, IDS[perm], [1], progress=False)
    torch.testing.assert_close(Kp, K[perm][:, perm], rtol=1e-6, atol=1e-6)


def test_logit_output_of_a_classifier_and_its_errors():
    model = tiny_model("bert", task="classifier", num_labels=3)
    labels = torch.tensor([0, 2, 1, 1, 0])
    K = adam_ntk(model, IDS, [1], f="logit", labels=labels, progress=False)
    ref, _ = _brute_force(model, IDS, [1], f="logit", labels=labels)
    torch.testing.assert_close(K, ref, rtol=1e-5, atol=1e-6)
    assert K.shape == (5, 5) and K.diagonal().min() > 0
    with pytest.raises(MLPSurgeryError, match="labels"):
        adam_ntk(model, IDS, [1], f="logit", progress=False)
    with pytest.raises(MLPSurgeryError, match="sequence classifier"):
        adam_ntk(tiny_model("bert"), IDS, [1], f="logit", labels=labels, progress=False)
    with pytest.raises(MLPSurgeryError, match="unknown scalar output"):
        adam_ntk(model, IDS, [1], f="loss", progress=False)


def test_pruning_masks_are_stored_with_the_model_and_respected_everywhere(tmp_path):
    """A magnitude-pruned model carries its masks: through save / load and a deep copy, its NTK leaves the pruned
    weights out (the same zeros without masks count them) and training keeps them exactly zero."""
    from mlpsurgery.io import load, read_manifest, save
    from mlpsurgery.modules.masks import masked_parameters
    from mlpsurgery.train import FitConfig, fit, lm_loss

    a = tiny_model("llama")
    b = copy.deepcopy(a)
    fuse(b, FusionConfig(width=16, layers="all", method="magnitude"), progress=False)
    names = masked_parameters(b)
    assert len(names) == 6 and all(".mlp." in n for n in names)
    save(b, tmp_path / "m")
    assert read_manifest(tmp_path / "m")["masks"] == names
    loaded = load(tmp_path / "m")
    plain = tiny_model("llama")  # the same zeros, no masks
    plain.load_state_dict({k: v for k, v in loaded.state_dict().items() if not k.endswith("_mask")})
    free = adam_ntk(plain, IDS, [0, 1], progress=False)
    masked = adam_ntk(loaded, IDS, [0, 1], progress=False)
    assert (masked.diagonal() < free.diagonal()).all()
    torch.testing.assert_close(adam_ntk(copy.deepcopy(loaded), IDS, [0, 1], progress=False), masked)
    zeros = {n: p == 0 for n, p in loaded.named_parameters() if n in names}
    fit(dict(loaded.named_parameters()), lm_loss(loaded, IDS, 2), FitConfig(steps=3, lr=1e-2, weight_decay=0.1),
        progress=False)
    assert all((dict(loaded.named_parameters())[n][z] == 0).all() for n, z in zeros.items())


def test_compressed_layers_and_output_error_see_what_changed():
    a = tiny_model("opt")
    b = copy.deepcopy(a)
    fuse(b, FusionConfig(width=8, layers="0"), progress=False)
    assert compressed_layers(a, b) == [0]
    out = output_error(a, b, IDS)
    assert [r["layer"] for r in out["layers"]] == [0] and out["error_rel"] > 0 and out["final_hidden_error_rel"] > 0
    with pytest.raises(MLPSurgeryError, match="do not exist"):
        adam_ntk(a, IDS, [5], progress=False)


def test_per_mlp_kernel_vanishes_at_k_equal_h_and_sees_compression():
    a = tiny_model("llama")
    b = copy.deepcopy(a)
    fuse(b, FusionConfig(width=64, layers="all", n_init=1), progress=False)  # k = h: a permutation, P = 1
    exact = mlp_ntk_error(a, b, IDS[:3], layers=[0, 1], progress=False)
    assert exact["ntk_error_rel"] < 1e-5
    c = copy.deepcopy(a)
    fuse(c, FusionConfig(width=8, layers="1"), progress=False)
    cache: dict = {}
    first = mlp_ntk_error(a, c, IDS[:3], progress=False, reference_cache=cache)
    again = mlp_ntk_error(a, c, IDS[:3], progress=False, reference_cache=cache)
    assert [r["layer"] for r in first["layers"]] == [1] and first["ntk_error_rel"] > 1e-3 and list(cache) == [1]
    assert again["ntk_error"] == first["ntk_error"]
