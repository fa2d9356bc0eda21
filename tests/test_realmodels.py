"""Checks on the real pretrained models; skipped when they are not installed."""

import pytest
import torch

from mlpsurgery.data import load_corpus, read_labelled
from mlpsurgery.measure.accuracy import probe_accuracy
from mlpsurgery.measure.cost import inspect
from mlpsurgery.measure.perplexity import perplexity
from mlpsurgery.modules.dense import DenseMLP
from mlpsurgery.sites import find_sites

pytestmark = pytest.mark.realmodel


def test_smollm2_structure(smollm2):
    info = inspect(smollm2.model)
    assert (info["architecture"], info["layers"], info["d"], info["mlp_inner_width"]) == ("llama", 30, 576, 1536)
    assert (info["heads"], info["kv_groups"], info["head_dim"]) == (9, 3, 64)
    assert info["params"]["total"] == pytest.approx(134.5e6, rel=0.01)


def test_smollm2_predicts_held_out_austen(smollm2):
    corpus = load_corpus(None, smollm2.tokenizer)
    r = perplexity(smollm2.model, corpus.heldout, block_len=256, max_tokens=1024, progress=False)
    assert 10 < r.ppl < 60  # a random model of this vocabulary would give ~49152


def test_smollm2_surgery_is_exact(smollm2):
    model = smollm2.model
    ids = smollm2.tokenizer("It is a truth universally acknowledged", return_tensors="pt").input_ids
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    site = find_sites(model).mlp[7]
    original = site.module
    site.replace_mlp(DenseMLP.from_weights(site.read()))
    try:
        with torch.no_grad():
            torch.testing.assert_close(model(input_ids=ids).logits, ref, rtol=1e-4, atol=1e-4)
    finally:
        site.replace_mlp(original)


def test_minilm_probe_beats_chance(minilm):
    info = inspect(minilm.model)
    assert (info["architecture"], info["layers"], info["d"], info["mlp_inner_width"]) == ("bert", 6, 384, 1536)
    train = read_labelled("r8-train").sample(240, seed=0)
    test = read_labelled("r8-test").sample(160, seed=0)
    r = probe_accuracy(minilm.model, minilm.tokenizer, train, test, max_len=64, progress=False)
    assert r["accuracy"] > 0.7  # chance is 1/8; the majority class is about half


def test_smollm2_dlr_closed_form_start_is_far_nearer_than_the_identity(smollm2):
    # DLR-Lock's closed-form start (methods/dlr_lock/start.py) on SmolLM2's layer 11 (the attention-sink layer,
    # whose update is one massive activation) and layer 15, rank 64 / depth 36: fitted on 3,072 captured tokens,
    # measured on 1,024 others (docs/dlr-lock.md measures 32k tokens and 4 layers with benchmarks/notes/dlr_start.py)
    from mlpsurgery.capture import capture_mlp_io
    from mlpsurgery.methods.dlr_lock.start import closed_form_start, mlp_directions
    from mlpsurgery.modules.dlr import StackedDLR

    model = smollm2.model
    blocks = load_corpus(None, smollm2.tokenizer).blocks("train", 256, max_blocks=16, seed=0)
    cap = capture_mlp_io(model, blocks, layers=[11, 15], batch_size=4, dtype=torch.bfloat16, progress=False)
    xy = [cap.chunk(k) for k in range(4)]
    X = torch.stack([torch.cat([c[i][0] for c in xy]) for i in (11, 15)]).float()
    Y = torch.stack([torch.cat([c[i][1] for c in xy]) for i in (11, 15)]).float()
    net = StackedDLR(2, 576, 64, 36)
    closed_form_start(net, X[:, :3072], Y[:, :3072], [mlp_directions(model, i, 36 * 64) for i in (11, 15)])
    with torch.no_grad():
        pred = net(X[:, 3072:])
    err = (pred - Y[:, 3072:]).pow(2).sum((1, 2)) / (Y[:, 3072:] - X[:, 3072:]).pow(2).sum((1, 2))
    assert err[0] < 0.3 and err[1] < 0.6, err  # 1.0 = the identity start


def test_smollm2_layerwise_sparsegpt_equals_the_whole_model_one(smollm2, tmp_path):
    """The real checkpoint (a float32 file, read in bfloat16), two layers pruned: the layer-sequential mode
    writes the same tensors as the whole-model one."""
    from safetensors import safe_open

    from mlpsurgery.io import save
    from mlpsurgery.methods.pruning import prune
    from mlpsurgery.methods.pruning.layerwise import prune_layerwise
    from mlpsurgery.models import load_model, smollm2_dir

    data = torch.randint(0, 49152, (2, 32), generator=torch.Generator().manual_seed(0))
    model = load_model("smollm2", dtype=torch.bfloat16).model
    model, _ = prune(model, "sparsegpt", 0.5, parts="ffn", layers=[0, 1], data=data, progress=False)
    save(model, tmp_path / "whole")
    prune_layerwise(smollm2_dir(), tmp_path / "lw", "sparsegpt", 0.5, parts="ffn", layers=[0, 1], data=data,
                    dtype=torch.bfloat16, source_name="smollm2", progress=False)
    with safe_open(str(tmp_path / "whole" / "model.safetensors"), "pt") as a, \
            safe_open(str(tmp_path / "lw" / "model.safetensors"), "pt") as b:
        assert set(a.keys()) == set(b.keys())
        for k in a.keys():
            assert torch.equal(a.get_tensor(k), b.get_tensor(k)), k


def test_smollm2_layerwise_fusion_and_export_equal_the_whole_model_ones(smollm2, tmp_path):
    """The real checkpoint in bfloat16, three layers fused: the layer-sequential fuse writes the same tensors as the
    whole-model one, and export (built from the loaded tensors, consuming them) gives the same stock model as
    to_stock's copying mode."""
    from safetensors import safe_open

    from mlpsurgery.io import export, save, to_stock
    from mlpsurgery.methods.fusion import FusionConfig, fuse
    from mlpsurgery.methods.fusion.layerwise import fuse_layerwise
    from mlpsurgery.models import load_model, smollm2_dir

    cfg = FusionConfig(width=384, layers="27-29", n_init=1)
    model = load_model("smollm2", dtype=torch.bfloat16).model
    fuse(model, cfg, progress=False)
    save(model, tmp_path / "whole")
    fuse_layerwise(smollm2_dir(), tmp_path / "lw", cfg, dtype=torch.bfloat16, source_name="smollm2", progress=False)
    with safe_open(str(tmp_path / "whole" / "model.safetensors"), "pt") as a, \
            safe_open(str(tmp_path / "lw" / "model.safetensors"), "pt") as b:
        assert set(a.keys()) == set(b.keys())
        for k in a.keys():
            assert torch.equal(a.get_tensor(k), b.get_tensor(k)), k
    ref = to_stock(model).state_dict()
    export(tmp_path / "lw", tmp_path / "hf")
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as f:
        got = {k: f.get_tensor(k) for k in f.keys()}
    tied = {"lm_head.weight", "model.embed_tokens.weight"}  # one tensor, stored once under either name
    left = set(ref) - set(got)
    assert all(torch.equal(got[k], ref[k]) for k in got) and len(left) == 1 and left <= tied


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("name", ["smollm2", "minilm"])
def test_real_checkpoint_read_on_loading_equals_transformers_load(name, dtype, request):
    # both are float32 files: they are read tensor by tensor (models._load_read; cast to bfloat16 where asked)
    # rather than through transformers' memory map of the whole file; the model must be transformers' own, bit for bit
    from mlpsurgery.models import _load_read, _model_class, _resolve, load_model, read_config

    request.getfixturevalue(name)  # skips when the model is not installed
    folder, _ = _resolve(name)
    klass = _model_class(read_config(folder), "auto")
    ours = load_model(name, dtype=dtype).model
    if (folder / "model.safetensors").is_file():
        assert _load_read(folder, klass, "auto", dtype) is not None  # the path taken
    ref = klass.from_pretrained(folder, local_files_only=True, dtype=dtype)
    a, b = ours.state_dict(), ref.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) and a[n].dtype == dtype for n in a)
    assert ours.config.to_dict() == ref.config.to_dict()


def test_smollm2_layerwise_lock_equals_the_whole_model_lock(smollm2, tmp_path):
    """CoreLocker layer by layer on the real checkpoint (bfloat16, 5% of the weights, global ranking): the same
    key header (every tensor's hash, both fingerprints) and the same locked tensors as the whole-model lock."""
    from safetensors import safe_open

    from mlpsurgery.methods.corelocker import CoreLockerConfig, lock_folder, read_key
    from mlpsurgery.methods.corelocker.layerwise import lock_layerwise
    from mlpsurgery.models import load_model, smollm2_dir

    cfg = CoreLockerConfig(ratio=0.05)
    model = load_model("smollm2", dtype=torch.bfloat16).model
    lock_folder(model, tmp_path / "whole", tmp_path / "whole.key", cfg, progress=False)
    del model
    lock_layerwise(smollm2_dir(), tmp_path / "lw", tmp_path / "lw.key", cfg, dtype=torch.bfloat16,
                   source_name="smollm2", progress=False)
    ka, kb = read_key(tmp_path / "whole.key"), read_key(tmp_path / "lw.key")
    assert ka.header == kb.header
    assert all(torch.equal(ka.values[n], kb.values[n]) for n in ka.values)
    with safe_open(str(tmp_path / "whole" / "model.safetensors"), "pt") as a, \
            safe_open(str(tmp_path / "lw" / "model.safetensors"), "pt") as b:
        assert set(a.keys()) == set(b.keys())
        for k in a.keys():
            assert torch.equal(a.get_tensor(k), b.get_tensor(k)), k


@pytest.mark.parametrize("name", ["minilm", "smollm2"])
def test_fusion_clustered_on_activations_fits_a_trained_model_better_than_on_weights(name, request):
    import copy

    from mlpsurgery.data import text_blocks
    from mlpsurgery.methods.fusion import FusionConfig, fuse

    loaded = request.getfixturevalue(name)
    calib = text_blocks(None, loaded.tokenizer, block_len=64, max_blocks=16, seed=0)
    layers = "2-5" if name == "minilm" else "20-23"
    err = {}
    for on in ("weights", "activations"):
        rep = fuse(copy.deepcopy(loaded.model), FusionConfig(width=384, method="fusion", layers=layers, n_init=1,
                                                             cluster_on=on), calib_data=calib, progress=False)
        err[on] = [s["error_rel"] for s in rep["sites"]]
    # every layer's output error lower (MiniLM at 3 seeds: 0.186 vs 0.222, docs/results/fusion-ntk-activations.md)
    assert all(a < w for a, w in zip(err["activations"], err["weights"])), err
