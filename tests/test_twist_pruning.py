"""The pruning baselines TwIST is compared against: Wanda, SparseGPT, Fisher block pruning, random subnets."""

import json

import pytest
import torch

from conftest import outputs
from mlpsurgery.errors import MLPSurgeryError
from mlpsurgery.methods.pruning import (block_fisher, calibrated_prune, fisher_block_prune, layer_moments,
                                        magnitude_prune, prunable_weights, prune, sparsegpt_matrix, wanda_mask)
from mlpsurgery.methods.twist import make_layout
from mlpsurgery.sites import find_sites
from mlpsurgery.tiny import tiny_model


def layer_problem(seed=0, out=48, inp=64, n=512):
    """A linear layer whose inputs have very unequal scales and correlations (as LLM activations do)."""
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(out, inp, generator=g)
    scales = torch.logspace(-1.5, 1.0, inp)[torch.randperm(inp, generator=g)]
    mix = torch.eye(inp) + 0.3 * torch.randn(inp, inp, generator=g) / inp ** 0.5
    X = (torch.randn(n, inp, generator=g) * scales) @ mix
    return W, X, X.T @ X / n


def error(W, Wp, X):
    return ((X @ (W - Wp).T) ** 2).sum().item()


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("sparsity", [0.5, 0.7])
def test_wanda_and_sparsegpt_reach_the_sparsity_and_beat_magnitude(seed, sparsity):
    W, X, H = layer_problem(seed)
    k = int(sparsity * W.shape[1])
    mag = W.clone()
    mag.view(-1)[W.abs().flatten().argsort()[: int(sparsity * W.numel())]] = 0
    keep = wanda_mask(W, torch.diag(H), sparsity)
    wanda = W * keep
    assert torch.all((~keep).sum(dim=1) == k)  # exactly k per output row
    sgpt = sparsegpt_matrix(W, H, sparsity, blocksize=16)
    assert (sgpt == 0).float().mean().item() == pytest.approx(sparsity, abs=1 / W.shape[1])
    e_mag, e_wanda, e_sgpt = error(W, mag, X), error(W, wanda, X), error(W, sgpt, X)
    assert e_wanda < 0.7 * e_mag and e_sgpt < 0.7 * e_mag
    assert e_sgpt < e_wanda  # the reconstruction update helps on top of the better mask


def test_sparsegpt_at_zero_sparsity_keeps_the_weights():
    W, X, H = layer_problem()
    assert torch.allclose(sparsegpt_matrix(W, H, 0.0), W, atol=1e-4)


@pytest.mark.parametrize("method", ["wanda", "sparsegpt"])
@pytest.mark.parametrize("arch", ["llama", "gpt2", "phi3"])
def test_calibrated_pruning_on_models(method, arch, ids):
    m = tiny_model(arch)
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    ref = outputs(m, ids)
    data = torch.randint(0, 256, (8, 32), generator=torch.Generator().manual_seed(0))
    r = calibrated_prune(m, data, {"attn": 0.25, "ffn": 0.5}, method, parts="both", layers=[1], progress=False)
    chosen = prunable_weights(m, "both", [1])
    for n, p in m.named_parameters():
        if n not in chosen:
            assert torch.equal(p, before[n]), n
    sites = find_sites(m)
    for part, site, target in (("ffn", sites.mlp[1], 0.5), ("attn", sites.attn[1], 0.25)):
        zeros = sum(int((p == 0).sum()) for p in site.parameters() if p.dim() == 2)
        total = sum(p.numel() for p in site.parameters() if p.dim() == 2)
        assert zeros / total == pytest.approx(target, abs=0.03), part
    assert r["sequential"] and 0.3 < r["sparsity"] < 0.45
    assert not torch.equal(outputs(m, ids), ref)


def test_one_pass_moments_equal_sequential_ones_before_any_pruning():
    m = tiny_model("llama")
    data = torch.randint(0, 256, (6, 32), generator=torch.Generator().manual_seed(1))
    a, b = tiny_model("llama"), tiny_model("llama")
    calibrated_prune(a, data, 0.5, "wanda", parts="ffn", layers=[0], progress=False)
    calibrated_prune(b, data, 0.5, "wanda", parts="ffn", layers=[0], sequential=False, progress=False)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))  # layer 0 sees the same inputs
    moments = layer_moments(m, data, "both", [0, 1])
    assert set(moments[1]) == {"ffn.up", "ffn.gate", "ffn.down", "attn.q", "attn.k", "attn.v", "attn.o"}
    with pytest.raises(MLPSurgeryError, match="calibration blocks"):
        calibrated_prune(m, None, 0.5, "sparsegpt")


def test_fisher_ranks_a_dead_block_last_and_prunes_it(ids):
    m = tiny_model("llama")
    sites = find_sites(m)
    w = sites.mlp[0].read()
    w.down[:, 16:32] = 0  # chunk 1 of 4 contributes nothing: its Fisher is zero
    sites.mlp[0].write(w)
    data = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(0))
    layout = make_layout(m, "ffn", [0, 1], blocks=4, keep=3)
    fisher = block_fisher(m, data, layout, progress=False)
    assert fisher[("ffn", 0)][1] == 0 and (fisher[("ffn", 0)][[0, 2, 3]] > 0).all()
    assert all(p.requires_grad for p in m.parameters())  # restored
    new, report = fisher_block_prune(m, data, keep=3, blocks=4, parts="ffn", layers=[0], progress=False)
    assert new._mlpsurgery_history[-1]["provenance"]["subnet"]["mlp"]["0"] == [0, 2, 3]
    assert torch.allclose(outputs(new, ids), outputs(m, ids), atol=1e-5)  # the dead chunk was all it removed
    full, _ = fisher_block_prune(m, data, keep=4, blocks=4, parts="both", layers=[0, 1], progress=False)
    assert torch.equal(outputs(full, ids), outputs(m, ids))


def test_prune_dispatch_and_random_subnets(ids):
    m = tiny_model("llama")
    new, r = prune(m, "random", 0.5, parts="both", blocks=4, seed=3)
    assert r["keep"] == 2 and sum(p.numel() for p in new.parameters()) < sum(p.numel() for p in m.parameters())
    same, _ = prune(m, "random", 0.5, parts="both", blocks=4, seed=3)
    assert torch.equal(outputs(new, ids), outputs(same, ids))
    _, r = prune(m, "magnitude", 0.3, parts="ffn", layers=[1])
    assert r["sparsity"] == pytest.approx(0.3, abs=0.01)
    with pytest.raises(MLPSurgeryError, match="method must be"):
        prune(m, "obs", 0.5)
    with pytest.raises(MLPSurgeryError, match="sparsity"):
        prune(m, "random", 1.0)


def test_magnitude_prune_keeps_its_signature_for_other_methods():
    m = tiny_model("llama")
    r = magnitude_prune(m, 0.5, parts="ffn", layers=[0])
    assert r["method"] == "magnitude" and r["sparsity"] == pytest.approx(0.5, abs=0.01)


def test_prune_cli(tmp_path, capsys):
    from mlpsurgery.cli import main
    from mlpsurgery.io import load

    text = tmp_path / "t.txt"
    text.write_text("Mr. Darcy walked off; and Elizabeth remained with no very cordial feelings toward him. " * 40)
    code = main(["prune", "tiny:llama", "--method", "sparsegpt", "--sparsity", "0.5", "--parts", "ffn", "--data",
                 str(text), "--calib-blocks", "4", "--block-len", "32", "--out", str(tmp_path / "sg"), "--json",
                 "--quiet"])
    r = json.loads(capsys.readouterr().out)
    assert code == 0 and r["sparsity"] == pytest.approx(0.5, abs=0.02) and r["calibration"] == [4, 32]
    assert load(tmp_path / "sg")._mlpsurgery_history[-1]["method"] == "sparsegpt-prune"
    code = main(["prune", "tiny:llama", "--method", "fisher", "--sparsity", "0.5", "--blocks", "4", "--data",
                 str(text), "--calib-blocks", "2", "--block-len", "32", "--out", str(tmp_path / "fi"), "--quiet"])
    assert code == 0 and "fisher" in capsys.readouterr().out
    code = main(["prune", "tiny:llama", "--method", "wanda", "--sparsity", "0.5", "--out", str(tmp_path / "sg")])
    assert code == 2 and "already exists" in capsys.readouterr().err


@pytest.mark.parametrize("method", ["fisher", "random"])
def test_prune_refit_lowers_every_narrowed_layers_error_and_keeps_the_chosen_blocks(tmp_path, capsys, method):
    """prune --refit: the same blocks as without it, each narrowed MLP's down projection refit (its error falls), with
    --parts attn each narrowed attention's output projection; refused (one line, exit 2, nothing written) for the
    unstructured methods (layer by layer too; tests/test_layerwise.py has the layer-by-layer refit)."""
    from mlpsurgery.cli import main
    from mlpsurgery.io import load
    from mlpsurgery.sites import find_sites

    text = tmp_path / "t.txt"
    text.write_text("Mr. Darcy walked off; and Elizabeth remained with no very cordial feelings toward him. " * 40)
    common = ["prune", "tiny:llama", "--method", method, "--sparsity", "0.5", "--blocks", "4", "--parts", "ffn",
              "--data", str(text), "--calib-blocks", "4", "--block-len", "32", "--json", "--quiet"]
    assert main([*common, "--out", str(tmp_path / "plain")]) == 0
    capsys.readouterr()
    assert main([*common, "--refit", "--out", str(tmp_path / "fit")]) == 0
    r = json.loads(capsys.readouterr().out)
    n = tiny_model("llama").config.num_hidden_layers
    assert sorted(int(i) for i in r["refit"]) == list(range(n))
    assert all(e["error_after"] < e["error_before"] for e in r["refit"].values()), r["refit"]
    plain, fit = find_sites(load(tmp_path / "plain")), find_sites(load(tmp_path / "fit"))
    for i in range(n):
        a, b = plain.mlp[i].read(), fit.mlp[i].read()
        assert torch.equal(a.up, b.up) and not torch.allclose(a.down, b.down)
    attn = [a if a != "ffn" else "attn" for a in common] + ["--refit", "--out", str(tmp_path / "attn")]
    assert main(attn) == 0
    r = json.loads(capsys.readouterr().out)
    assert sorted(int(i) for i in r["refit"]) == list(range(n))
    assert all(set(e) == {"attention"} and e["attention"]["error_after"] < e["attention"]["error_before"]
               for e in r["refit"].values()), r["refit"]
    for extra, m in (([], "sparsegpt"), (["--layerwise"], "wanda")):
        code = main(["prune", "tiny:llama", "--method", m, "--sparsity", "0.5", "--refit", *extra,
                     "--out", str(tmp_path / "x")])
        err = capsys.readouterr().err
        assert code == 2 and "--refit" in err and err.count("\n") == 1 and not (tmp_path / "x").exists()
    code = main([*common[:4], "--sparsity", "0", *common[6:], "--refit", "--out", str(tmp_path / "x")])
    err = capsys.readouterr().err  # sparsity 0 keeps every block: nothing narrowed, nothing to refit
    assert code == 2 and "narrowed no MLP" in err and err.count("\n") == 1 and not (tmp_path / "x").exists()
