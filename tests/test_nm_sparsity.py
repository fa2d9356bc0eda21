"""N:M semi-structured sparsity (2:4, 4:8) for magnitude, Wanda and SparseGPT: every group of M consecutive inputs of
a row keeps N weights; the masks equal the papers' own reference loops (transcribed below from the official Wanda and
SparseGPT code, independent of ours); the calibrated methods beat magnitude at the same pattern; bad patterns refused
before anything changes; the CLI writes a folder whose masks keep the pattern through training."""

import json

import pytest
import torch

from mlpsurgery.errors import MLPSurgeryError
from mlpsurgery.methods.pruning import (input_major, nm_keep, parse_pattern, prunable_weights, prune,
                                        sparsegpt_matrix, wanda_mask)
from mlpsurgery.tiny import tiny_model
from test_twist_pruning import error, layer_problem


def groups_ok(W: torch.Tensor, n: int, m: int) -> bool:
    nonzero = (W != 0).reshape(W.shape[0], -1, m).sum(dim=2)
    return bool((nonzero <= n).all())


def wanda_reference(W, h_diag, n, m):
    """wanda/lib/prune.py, prune_wanda: W_metric = |W| * sqrt(scaler_row); per group of m columns the n smallest go."""
    W_metric = torch.abs(W) * torch.sqrt(h_diag.reshape((1, -1)))
    W_mask = torch.zeros_like(W_metric) == 1
    for ii in range(W_metric.shape[1]):
        if ii % m == 0:
            tmp = W_metric[:, ii:(ii + m)].float()
            W_mask.scatter_(1, ii + torch.topk(tmp, m - n, dim=1, largest=False)[1], True)
    return ~W_mask


def sparsegpt_reference(W, H, n, m, blocksize=128, percdamp=0.01):
    """sparsegpt/sparsegpt.py, SparseGPT.fasterprune with prunen = m - n, prunem = m (the pruned count per group)."""
    W = W.clone().float()
    H = H.clone()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    W[:, dead] = 0
    damp = percdamp * torch.mean(torch.diag(H))
    diag = torch.arange(W.shape[1])
    H[diag, diag] += damp
    H = torch.linalg.cholesky(H)
    H = torch.cholesky_inverse(H)
    H = torch.linalg.cholesky(H, upper=True)
    Hinv = H
    prunen, prunem = m - n, m
    for i1 in range(0, W.shape[1], blocksize):
        i2 = min(i1 + blocksize, W.shape[1])
        count = i2 - i1
        W1 = W[:, i1:i2].clone()
        Q1 = torch.zeros_like(W1)
        Err1 = torch.zeros_like(W1)
        Hinv1 = Hinv[i1:i2, i1:i2]
        mask1 = torch.zeros_like(W1) == 1
        for i in range(count):
            w = W1[:, i]
            d = Hinv1[i, i]
            if i % prunem == 0:
                tmp = W1[:, i:(i + prunem)] ** 2 / (torch.diag(Hinv1)[i:(i + prunem)].reshape((1, -1))) ** 2
                mask1.scatter_(1, i + torch.topk(tmp, prunen, dim=1, largest=False)[1], True)
            q = w.clone()
            q[mask1[:, i]] = 0
            Q1[:, i] = q
            err1 = (w - q) / d
            W1[:, i:] -= err1.unsqueeze(1).matmul(Hinv1[i, i:].unsqueeze(0))
            Err1[:, i] = err1
        W[:, i1:i2] = Q1
        W[:, i2:] -= Err1.matmul(Hinv[i1:i2, i2:])
    return W


@pytest.mark.parametrize("n,m", [(2, 4), (4, 8), (1, 4)])
@pytest.mark.parametrize("seed", [0, 1])
def test_nm_masks_equal_the_papers_reference_code_and_beat_magnitude(seed, n, m):
    W, X, H = layer_problem(seed)
    keep = wanda_mask(W, torch.diag(H), 0.0, (n, m))
    assert torch.equal(keep, wanda_reference(W, torch.diag(H), n, m))
    wanda = W * keep
    sgpt = sparsegpt_matrix(W, H, 0.0, blocksize=16, pattern=(n, m))
    torch.testing.assert_close(sgpt, sparsegpt_reference(W, H, n, m, blocksize=16), rtol=1e-5, atol=1e-5)
    mag = W * nm_keep(W.abs(), (n, m))
    for P in (wanda, sgpt, mag):
        assert groups_ok(P, n, m)
        assert (P == 0).float().mean().item() == pytest.approx(1 - n / m)
    e_mag, e_wanda, e_sgpt = error(W, mag, X), error(W, wanda, X), error(W, sgpt, X)
    assert e_wanda < 0.8 * e_mag and e_sgpt < e_wanda


def test_pattern_parsing_and_refusals():
    assert parse_pattern("2:4") == (2, 4) and parse_pattern(None) is None
    for bad in ("2-4", "4:4", "0:4", "a:b", "5:4", "2:100"):
        with pytest.raises(MLPSurgeryError):
            parse_pattern(bad)
    m = tiny_model("llama")
    before = {k: v.clone() for k, v in m.state_dict().items()}
    with pytest.raises(MLPSurgeryError, match="whole blocks"):
        prune(m, "fisher", None, pattern="2:4")
    with pytest.raises(MLPSurgeryError, match="not 0.3"):
        prune(m, "magnitude", 0.3, pattern="2:4")
    with pytest.raises(MLPSurgeryError, match="not a multiple of 3"):  # the tiny model's widths are not multiples
        prune(m, "wanda", None, pattern="2:3", data=torch.randint(0, 256, (2, 16)))
    assert all(torch.equal(v, before[k]) for k, v in m.state_dict().items())  # nothing changed before refusing


@pytest.mark.parametrize("method", ["magnitude", "wanda", "sparsegpt"])
@pytest.mark.parametrize("arch", ["llama", "gpt2", "opt"])
def test_2_4_on_models_keeps_the_pattern_through_training(method, arch):
    m = tiny_model(arch)
    data = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(0))
    _, r = prune(m, method, None, parts="both", data=data, pattern="2:4", progress=False)
    assert r["pattern"] == "2:4" and r["sparsity"] == pytest.approx(0.5)
    weights = {n: w.detach().clone() for n, w in input_major(m, prunable_weights(m, "both")).items()}
    for name, W in weights.items():
        assert groups_ok(W, 2, 4), name
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    loss = m(input_ids=data, labels=data).loss
    loss.backward()
    opt.step()
    for name, w in input_major(m, prunable_weights(m, "both")).items():
        assert groups_ok(w.detach(), 2, 4) and bool((w[weights[name] == 0] == 0).all()), name  # masks held


def test_prune_cli_with_a_pattern(tmp_path, capsys):
    from mlpsurgery.cli import main
    from mlpsurgery.io import load

    code = main(["prune", "tiny:llama", "--method", "wanda", "--pattern", "2:4", "--calib-blocks", "2",
                 "--block-len", "32", "--out", str(tmp_path / "w"), "--json", "--quiet"])
    r = json.loads(capsys.readouterr().out)
    assert code == 0 and r["pattern"] == "2:4" and r["sparsity"] == pytest.approx(0.5)
    assert load(tmp_path / "w")._mlpsurgery_history[-1]["config"]["pattern"] == "2:4"
    code = main(["prune", "tiny:llama", "--method", "random", "--pattern", "2:4", "--out", str(tmp_path / "r")])
    assert code == 2 and "--pattern applies to" in capsys.readouterr().err and not (tmp_path / "r").exists()
    code = main(["prune", "tiny:llama", "--method", "wanda", "--pattern", "2:4", "--sparsity", "0.5",
                 "--out", str(tmp_path / "b")])
    assert code == 2 and "not allowed with" in capsys.readouterr().err
