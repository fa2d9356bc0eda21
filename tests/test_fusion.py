"""MLP Fusion: k-means against scikit-learn, exactness at k = h, the stand-alone P (forward = folded,
gradient = P x folded), export to plain transformers, every baseline at its width / weight count,
layer-wise tuning, the CLI and its errors."""

import copy
import json

import pytest
import torch

from conftest import TEXT, outputs
from mlpsurgery.cli import main
from mlpsurgery.errors import MLPSurgeryError
from mlpsurgery.io import export, load, read_manifest, save
from mlpsurgery.methods.fusion import (METHODS, FusionConfig, _mmd_support, cluster_means, fuse, kmeans, mmd_draws,
                                       neuron_vectors, weights_from_neurons)
from mlpsurgery.modules.dense import DenseMLP
from mlpsurgery.modules.fused import FusedMLP
from mlpsurgery.sites import find_sites
from mlpsurgery.tiny import ARCHITECTURES, tiny_model
from mlpsurgery.train import FitConfig, fit, lm_loss


def _blobs(n_per=50, k=6, dim=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(k, dim, generator=g, dtype=torch.float64) * 10
    return torch.cat([c + torch.randn(n_per, dim, generator=g, dtype=torch.float64) for c in centres])


# ---- k-means ----------------------------------------------------------------------------------------

def test_kmeans_agrees_with_sklearn_on_separated_clusters():
    from sklearn.cluster import KMeans
    from sklearn.metrics import adjusted_rand_score

    x = _blobs()
    ours = kmeans(x, 6, n_init=3, seed=0)
    ref = KMeans(6, n_init=3, random_state=0).fit(x.numpy())
    assert adjusted_rand_score(ref.labels_, ours.labels.numpy()) == 1.0
    assert ours.inertia == pytest.approx(ref.inertia_, rel=1e-9)
    # the centres are the cluster means (up to the order of the clusters)
    assert torch.allclose(ours.centers[ours.labels], torch.as_tensor(ref.cluster_centers_)[ref.labels_], atol=1e-9)


def test_kmeans_inertia_as_good_as_sklearn_on_unstructured_data():
    from sklearn.cluster import KMeans

    x = torch.randn(200, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    ours = [kmeans(x, 12, n_init=3, seed=s).inertia for s in range(2)]
    ref = [KMeans(12, n_init=3, random_state=s).fit(x.numpy()).inertia_ for s in range(2)]
    assert sum(ours) <= 1.02 * sum(ref)
    a, b = kmeans(x, 12, seed=5), kmeans(x, 12, seed=5)
    assert torch.equal(a.labels, b.labels)  # seeded


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_kmeans_on_the_gram_matrix_takes_the_explicit_centres_iterations(dtype, monkeypatch):
    """Fewer points than dimensions (fusion's neurons on calibration rows): Lloyd on the Gram matrix alone, the same
    labels, iterations and centres as with explicit centres from the same seeds; and kmeans takes that path."""
    import importlib

    km = importlib.import_module("mlpsurgery.methods.fusion.kmeans")  # the module (the package exports the function)
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(300, 6, generator=g, dtype=torch.float64) @ torch.randn(6, 500, generator=g, dtype=torch.float64)
         + 0.3 * torch.randn(300, 500, generator=g, dtype=torch.float64)).to(dtype)  # no clear clusters: many steps
    x_sq = x.pow(2).sum(1)
    gram = x @ x.T
    seeds = km._kmeans_pp(x, x_sq, 40, torch.Generator().manual_seed(0), gram)
    tol = 1e-4 * float(x.var(0, unbiased=False).mean())
    explicit, it_e = km._lloyd(x, x_sq, None, seeds, 40, 300, tol)
    on_gram, it_g = km._lloyd_gram(x, x_sq, gram, seeds, 40, 300, tol)
    assert it_e > 2 and it_g == it_e and torch.equal(on_gram, explicit)
    calls = []
    real = km._lloyd_gram
    monkeypatch.setattr(km, "_lloyd_gram", lambda *a: calls.append(1) or real(*a))
    res = km.kmeans(x, 40, n_init=2, seed=0)
    assert len(calls) == 2
    means = torch.stack([x[res.labels == j].mean(0) for j in range(40)])
    assert torch.allclose(res.centers, means, atol=1e-5 if dtype == torch.float32 else 1e-12)


def test_kmeans_with_k_equal_n_puts_every_point_alone():
    x = torch.randn(40, 7, generator=torch.Generator().manual_seed(2))
    res = kmeans(x, 40, n_init=1)
    assert sorted(res.labels.tolist()) == list(range(40)) and res.inertia == pytest.approx(0.0, abs=1e-6)
    with pytest.raises(MLPSurgeryError, match="k-means needs"):
        kmeans(x, 41)


# ---- exactness, fused vs folded, the P gradient -----------------------------------------------------

def test_k_equal_h_reproduces_the_original(arch, ids):
    model = tiny_model(arch)
    ref = outputs(model, ids)
    fuse(model, FusionConfig(width=64, layers="all", n_init=1), progress=False)
    for s in find_sites(model).mlp:
        assert isinstance(s.module, FusedMLP) and torch.equal(s.module.P, torch.ones(64))
    torch.testing.assert_close(outputs(model, ids), ref, rtol=1e-5, atol=1e-5)


def _fused_site(arch="llama", k=8, seed=0):
    """A FusedMLP built from layer 0 of a tiny model (non-trivial cluster sizes)."""
    w = find_sites(tiny_model(arch)).mlp[0].read()
    vec = neuron_vectors(w)
    km = kmeans(vec, k, seed=seed)
    centroids, P = cluster_means(vec, km.labels, k)
    assert P.max() > 1
    return FusedMLP.from_centroids(weights_from_neurons(centroids, w), P), w


@pytest.mark.parametrize("arch", ["llama", "gpt2", "bert", "phi3"])
def test_fused_forward_equals_folded_forward(arch):
    fused, w = _fused_site(arch)
    folded = DenseMLP.from_weights(fused.to_mlp_weights())
    x = torch.randn(5, 7, w.d, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(fused(x), folded(x), rtol=1e-6, atol=1e-6)


def test_P_gradient_scaling_differs_from_the_folded_form_as_derived():
    r"""With P stand-alone, H~ = A P W~2 + b2 where A = act(X W~1 + b~1) (n, k). Folded, H~ = A V + b2 with
    V = P W~2: the same function. By the chain rule, with G = ∇_H f (n, d):

        ∇_{W~2} f = P Aᵀ G          (stand-alone)      ∇_V f = Aᵀ G          (folded)
        ∇_A f     = G W~2ᵀ P = G Vᵀ (both)   =>   ∇_{W~1}, ∇_{b~1} (and the gate's) are identical
        ∇_{b2} f  = Gᵀ 1            (both)

    so only the down projection's gradient differs: row j of ∇_{W~2} is P_jj times row j of ∇_V (canonical
    orientation: column j of `down.weight`). Under Adam the first step is -lr·sign(gradient) elementwise for
    both parametrisations, so the folded weight of the stand-alone model moves by P ⊙ (the folded model's
    move): cluster j trains with a P_jj times larger learning rate, which is how fusion keeps the Adam NTK.
    """
    fused, w = _fused_site("llama", k=8)
    folded = DenseMLP.from_weights(fused.to_mlp_weights())
    x = torch.randn(4, 6, w.d, generator=torch.Generator().manual_seed(3))
    proj = torch.randn(w.d, generator=torch.Generator().manual_seed(4))
    for m in (fused, folded):
        (m(x) @ proj).pow(2).sum().backward()
    P = fused.P
    torch.testing.assert_close(fused.down.weight.grad, folded.down.weight.grad * P[None, :], rtol=1e-5, atol=1e-6)
    for name in ("up", "gate"):
        torch.testing.assert_close(getattr(fused, name).weight.grad, getattr(folded, name).weight.grad,
                                   rtol=1e-5, atol=1e-6)
    assert not torch.allclose(fused.down.weight.grad, folded.down.weight.grad, rtol=1e-3)

    before_fused, before_folded = fused.to_mlp_weights().down, folded.down.weight.detach().clone()
    for m in (fused, folded):
        torch.optim.Adam(m.parameters(), lr=1e-3, eps=1e-12).step()
    move_fused = fused.to_mlp_weights().down - before_fused
    move_folded = folded.down.weight.detach() - before_folded
    torch.testing.assert_close(move_fused, move_folded * P[None, :], rtol=1e-4, atol=1e-9)
    assert "P" not in dict(fused.named_parameters()) and "P" in fused.state_dict()


def test_cluster_baseline_equals_fusion_forward_for_relu():
    """P^½ folded into both sides computes act(X W~1 P^½) P^½ W~2 = act(X W~1) P W~2 exactly when act is
    positively homogeneous (ReLU): the 'cluster' baseline is then fusion with another gradient."""
    ids = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(0))
    a, b = tiny_model("gpt2", activation_function="relu"), tiny_model("gpt2", activation_function="relu")
    fuse(a, FusionConfig(width=12, layers="all", method="fusion"), progress=False)
    fuse(b, FusionConfig(width=12, layers="all", method="cluster"), progress=False)
    assert isinstance(find_sites(b).mlp[0].module, DenseMLP) and not isinstance(find_sites(b).mlp[0].module, FusedMLP)
    torch.testing.assert_close(outputs(a, ids), outputs(b, ids), rtol=1e-5, atol=1e-5)


# ---- save, load, export -----------------------------------------------------------------------------

def test_save_load_keeps_P(ids, tmp_path):
    model = tiny_model("qwen2")
    fuse(model, FusionConfig(width=10, layers="all"), progress=False)
    ref = outputs(model, ids)
    save(model, tmp_path / "m")
    again = load(tmp_path / "m")
    assert torch.equal(outputs(again, ids), ref)
    assert torch.equal(find_sites(again).mlp[1].module.P, find_sites(model).mlp[1].module.P)
    assert load(tmp_path / "m")._mlpsurgery_history[-1]["method"] == "fusion"


@pytest.mark.parametrize("arch", ["llama", "gpt2", "bert", "phi3", "opt"])
def test_export_after_fine_tuning_loads_in_plain_transformers(arch, ids, tmp_path):
    model = tiny_model(arch)
    fuse(model, FusionConfig(width=16, layers="all"), progress=False)
    # a few steps of training move W~2 away from C̄ W2, so the export has to fold the trained P W~2
    if arch == "bert":
        def loss(step):
            return model(input_ids=ids).last_hidden_state.pow(2).mean()
    else:
        loss = lm_loss(model, ids, batch_size=2)
    fit(dict(model.named_parameters()), loss, FitConfig(steps=3, lr=1e-2), progress=False)
    model.eval()
    ref = outputs(model, ids)
    save(model, tmp_path / "m")
    export(tmp_path / "m", tmp_path / "hf")
    plain, info = type(model).from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert all(s.h == 16 and not s.replaced for s in find_sites(plain).mlp)
    torch.testing.assert_close(outputs(plain.eval(), ids), ref, rtol=1e-4, atol=1e-5)


def test_export_of_partly_fused_model_folds_p_and_keeps_the_other_width(tmp_path, ids):
    """Fusion of one layer of two: P folded, that layer's linears resized, the other layer whole; no single
    intermediate size states it, so the export carries modeling code (tests/test_standalone.py loads such
    folders in stock transformers)."""
    model = tiny_model("llama")
    fuse(model, FusionConfig(width=16), progress=False)  # default: last two thirds = layer 1 of 2
    ref = outputs(model, ids)
    save(model, tmp_path / "m")
    export(tmp_path / "m", tmp_path / "hf")
    again = load(tmp_path / "hf")
    assert [s.h for s in find_sites(again).mlp] == [64, 16] and not any(s.replaced for s in find_sites(again).mlp)
    assert {e["class"] for e in read_manifest(tmp_path / "hf")["modules"]} == {"Linear"}
    torch.testing.assert_close(outputs(again, ids), ref, rtol=1e-4, atol=1e-5)


# ---- baselines --------------------------------------------------------------------------------------

def _weights(site):
    return [p for p in site.parameters() if p.dim() == 2]


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("method", METHODS)
def test_every_baseline_hits_its_width_or_weight_count(method, arch):
    k, model = 16, tiny_model(arch)
    sites = find_sites(model)
    h, d = sites.mlp[0].h, sites.mlp[0].d
    target = sum(p.numel() for p in _weights(sites.mlp[0])) * k // h  # MLP weights of a width-k MLP
    rep = fuse(model, FusionConfig(width=k, layers="all", method=method, mmd_steps=20), progress=False)
    for s, r in zip(sites.mlp, rep["sites"]):
        kept = sum(int((p != 0).sum()) for p in _weights(s))
        if method == "svd":
            ranks = [x["rank"] for x in r["ranks"]]
            assert kept <= target and target - kept <= sum(o + i for o, i in (x["shape"] for x in r["ranks"]))
            assert all(rk < min(h, d) for rk in ranks)
        elif method == "magnitude":
            assert abs(kept - target) <= len(_weights(s)) and not s.replaced
        else:
            assert s.module.up.out_features == k and kept == target
    if method in ("fusion", "cluster", "sketch", "mmd", "neuron", "random"):
        assert {r["width"] for r in rep["sites"]} == {k}


@pytest.mark.parametrize("method", METHODS)
def test_a_layer_draws_what_draw_layer_says_so_ranks_that_skip_it_stay_in_step(method):
    """Under torchrun a rank takes only `draw_layer`'s draws for another rank's layer: compress_site must draw from
    the run's generator exactly that, for every method, or the layers after it would get other draws than in one
    process."""
    from mlpsurgery.methods.fusion import compress_site, draw_layer

    cfg = FusionConfig(width=16, method=method, mmd_steps=2)
    site = find_sites(tiny_model("llama")).mlp[0]
    a, b = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    h = site.h
    if method != "magnitude":  # (fuse prunes for it, drawing nothing)
        compress_site(site, 16, cfg, a)
    draw_layer(h, 16, cfg, b)
    assert torch.equal(a.get_state(), b.get_state())
    assert torch.equal(torch.rand(4, generator=a), torch.rand(4, generator=b))


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_a_compressed_mlp_sent_to_another_copy_of_the_model_computes_there_what_it_computed(arch):
    """Rank 0 puts the MLPs other ranks compressed (and tuned) into its copy: the modules arrive whole
    (`layer_payload` -> `install_layer`), whatever the architecture keeps its MLP in."""
    import pickle

    from mlpsurgery.methods.fusion.tuning import install_layer, layer_payload

    done, other = tiny_model(arch), tiny_model(arch)
    fuse(done, FusionConfig(width=8, layers="0"), progress=False)
    sent = pickle.loads(pickle.dumps(layer_payload(find_sites(done).mlp[0])))
    install_layer(find_sites(other).mlp[0], sent)
    assert type(find_sites(other).mlp[0].module) is type(find_sites(done).mlp[0].module)
    for (n, a), (m, b) in zip(done.state_dict().items(), other.state_dict().items(), strict=True):
        assert n == m and torch.equal(a, b), n


def test_mmd_support_lowers_the_mmd():
    w = find_sites(tiny_model("gpt2")).mlp[0].read()
    vec = neuron_vectors(w)
    _, start = _mmd_support(vec, 8, 0, 0.01, mmd_draws(w.h, 8, torch.Generator().manual_seed(0)))
    _, end = _mmd_support(vec, 8, 60, 0.01, mmd_draws(w.h, 8, torch.Generator().manual_seed(0)))
    assert end < 0.8 * start


def test_neuron_importance_keeps_the_strongest_neuron():
    model = tiny_model("llama")
    site = find_sites(model).mlp[1]
    w = site.read()
    w.down[:, 5] *= 100  # neuron 5 now dominates
    site.write(w)
    rep = fuse(model, FusionConfig(width=4, layers="1", method="neuron"), progress=False)
    assert 5 in rep["sites"][0]["kept_neurons"]


# ---- layer-wise tuning ------------------------------------------------------------------------------

def test_tuning_lowers_the_layer_error_and_trains_only_the_compressed_mlps(tokenizer):
    model = tiny_model("llama")
    ids = torch.tensor(tokenizer(TEXT * 4)["input_ids"][:320]).view(10, 32)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    rep = fuse(model, FusionConfig(width=8, layers="all", tune_steps=40, tune_lr=3e-3, tune_batch=64), tune_data=ids,
               progress=False)
    t = rep["tuning"]
    assert t["mse_after"] < 0.8 * t["mse_before"]
    for n, p in model.named_parameters():
        if n in before:  # everything outside the fused MLPs is untouched
            assert torch.equal(p, before[n]), n
    assert all(torch.equal(s.module.P, s.module.P.round()) for s in find_sites(model).mlp)


def test_a_tuning_checkpoint_resumes_only_onto_the_same_compression(tokenizer, tmp_path, monkeypatch):
    """The tuning's checkpoint restores the compressed MLPs' parameters, not what the compression fixed beside them
    (cluster sizes P, masks): a resume onto other clusters (k-means run otherwise, e.g. on another machine) would
    pair the saved weights with the wrong P. It is refused; the same compression resumes."""
    from mlpsurgery.methods.fusion import compress

    ids = torch.tensor(tokenizer(TEXT * 4)["input_ids"][:320]).view(10, 32)
    cfg = FusionConfig(width=8, layers="all", tune_steps=4, tune_batch=16)
    ck = tmp_path / "ck"
    done = fuse(tiny_model("llama"), cfg, tune_data=ids, progress=False, checkpoint_dir=ck)
    real = compress.kmeans
    monkeypatch.setattr(compress, "kmeans", lambda *a, seed, **kw: real(*a, seed=seed + 1, **kw))
    with pytest.raises(MLPSurgeryError, match="other settings or another model .*compressed"):
        fuse(tiny_model("llama"), cfg, tune_data=ids, progress=False, checkpoint_dir=ck)
    monkeypatch.undo()
    again = fuse(tiny_model("llama"), cfg, tune_data=ids, progress=False, checkpoint_dir=ck)
    assert again["tuning"]["mse_after"] == done["tuning"]["mse_after"]


def test_activation_importance_and_tuned_magnitude_keep_zeros(tokenizer):
    model = tiny_model("gpt2")
    ids = torch.tensor(tokenizer(TEXT * 4)["input_ids"][:256]).view(8, 32)
    fuse(model, FusionConfig(width=8, layers="all", method="neuron", importance="activation"), tune_data=ids,
         progress=False)
    pruned = tiny_model("gpt2")
    rep = fuse(pruned, FusionConfig(width=16, layers="all", method="magnitude", tune_steps=5, tune_lr=1e-2),
               tune_data=ids, progress=False)
    assert all(r["nonzero_after"] == rep["sites"][0]["nonzero_after"] for r in rep["sites"])
    s = find_sites(pruned).mlp[0]
    kept, total = sum(int((p != 0).sum()) for p in _weights(s)), sum(p.numel() for p in _weights(s))
    assert kept == pytest.approx(total / 4, abs=2)


# ---- errors -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("cfg,needle", [
    (FusionConfig(width=0), "width 0"),
    (FusionConfig(width=65), "width 65"),
    (FusionConfig(method="prune"), "unknown method"),
    (FusionConfig(layers="7"), "do not exist"),
    (FusionConfig(method="neuron", importance="activation"), "tune data"),
])
def test_bad_input_is_a_clear_error_and_leaves_the_model_alone(cfg, needle, ids):
    model = tiny_model("llama")
    ref = outputs(model, ids)
    with pytest.raises(MLPSurgeryError, match=needle):
        fuse(model, cfg, progress=False)
    assert torch.equal(outputs(model, ids), ref)


def test_fusing_a_fused_layer_fuses_its_dense_form():
    """Fusion composes: a second fuse reads the fused MLP's dense form and clusters its neurons again."""
    model = tiny_model("llama")
    fuse(model, FusionConfig(width=8, layers="all"), progress=False)
    first = [s.read() for s in find_sites(model).mlp]
    fuse(model, FusionConfig(width=4, layers="all"), progress=False)
    for s, w in zip(find_sites(model).mlp, first):
        assert isinstance(s.module, FusedMLP) and s.read().up.shape[0] == 4
        assert w.up.shape[0] == 8


# ---- CLI --------------------------------------------------------------------------------------------

def test_cli_fuse_then_export_and_eval_ntk(capsys, tmp_path):
    (tmp_path / "t.txt").write_text(TEXT * 30)
    code = main(["fuse", "tiny:gpt2", "--out", str(tmp_path / "m"), "--width", "16", "--layers", "all", "--json",
                 "--tune-data", str(tmp_path / "t.txt"), "--block-len", "32", "--tune-steps", "3"])
    r = json.loads(capsys.readouterr().out)
    assert code == 0 and r["width"] == 16 and r["tuning"]["steps"] == 3
    assert isinstance(find_sites(load(tmp_path / "m")).mlp[0].module, FusedMLP)
    assert main(["export", str(tmp_path / "m"), "--out", str(tmp_path / "hf"), "--quiet"]) == 0
    capsys.readouterr()
    code = main(["eval", "ntk", "tiny:gpt2", str(tmp_path / "m"), "--data", str(tmp_path / "t.txt"), "--n", "4",
                 "--block-len", "32", "--scope", "both", "--json"])
    r = json.loads(capsys.readouterr().out)
    assert code == 0 and r["layers"] == [0, 1] and r["model"]["ntk_error"] > 0 and len(r["output"]["layers"]) == 2
    assert [x["layer"] for x in r["mlp"]["layers"]] == [0, 1] and r["mlp"]["ntk_error_rel"] > 0
    assert main(["eval", "ntk", "tiny:gpt2", str(tmp_path / "m"), "--data", str(tmp_path / "t.txt"), "--n", "3",
                 "--block-len", "32", "--scope", "mlp", "--quiet"]) == 0
    assert "per-MLP Adam NTK" in capsys.readouterr().out


def test_cli_fuse_says_when_the_layer_wise_tuning_made_the_layers_worse(capsys, tmp_path):
    (tmp_path / "t.txt").write_text(TEXT * 30)
    said = {}
    for lr in ("1e-3", "3"):  # a learning rate that throws the weights off: the MSE rises, and the user is told
        code = main(["fuse", "tiny:llama", "--out", str(tmp_path / lr), "--width", "16", "--tune-data",
                     str(tmp_path / "t.txt"), "--block-len", "32", "--tune-steps", "5", "--tune-lr", lr])
        said[lr] = capsys.readouterr().out
        assert code == 0 and "layer-wise tuning: 5 steps" in said[lr]
    assert "it rose" not in said["1e-3"]
    assert "it rose: the tuning made these layers' outputs worse" in said["3"] and "lower --tune-lr" in said["3"]


def test_cli_fuse_refuses_a_busy_out_and_bad_width(capsys, tmp_path):
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "keep.txt").write_text("mine")
    assert main(["fuse", "tiny:llama", "--out", str(tmp_path / "busy"), "--width", "8"]) == 2
    assert "not empty" in capsys.readouterr().err
    assert (tmp_path / "busy" / "keep.txt").read_text() == "mine"
    assert main(["fuse", "tiny:llama", "--out", str(tmp_path / "new"), "--width", "999"]) == 2
    assert "width 999" in capsys.readouterr().err and not (tmp_path / "new").exists()


# ---- real model -------------------------------------------------------------------------------------

@pytest.mark.realmodel
def test_minilm_fusion_beats_sketching_on_output_error(minilm):
    """On all-MiniLM-L6-v2 and real text, k = h/4 on the last layer: fusion's output error is well below
    the Gaussian sketch's and below 1 (better than dropping the MLP)."""
    from mlpsurgery.data import text_blocks
    from mlpsurgery.measure.ntk import output_error

    ids = text_blocks(None, minilm.tokenizer, block_len=64, split="heldout", max_blocks=4, seed=0)
    errs = {}
    for method in ("fusion", "sketch"):
        m = copy.deepcopy(minilm.model)
        fuse(m, FusionConfig(width=384, layers="5", method=method, n_init=1), progress=False)
        errs[method] = output_error(minilm.model, m, ids)["error_rel"]
    assert errs["fusion"] < 0.5 * errs["sketch"] and errs["fusion"] < 1.0
