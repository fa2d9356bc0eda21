import pytest
import torch
from torch import nn

from conftest import outputs
from mlpsurgery.errors import MLPSurgeryError, UnsupportedArchitectureError
from mlpsurgery.modules.dense import DenseMLP
from mlpsurgery.sites import SUPPORTED, find_sites, generic_layers, parse_layers
from mlpsurgery.subsets import check_heads_removable
from mlpsurgery.tiny import ARCHITECTURES, tiny_model

REQUIRED = {"llama", "mistral", "qwen2", "qwen3", "smollm3", "olmo", "ernie4_5", "ministral", "seed_oss", "granite",
            "starcoder2", "gemma", "gemma2", "gemma3_text", "phi3", "phi", "cohere", "cohere2", "olmo2", "olmo3",
            "exaone4", "gpt2", "gpt_neox", "opt", "bert", "roberta", "xlm-roberta", "distilbert"}


# Config switches that change a supported architecture's layer (biases, norm order, parallel attention, windows):
# every site test here runs on them as on the defaults.
VARIANTS = {"llama+bias": ("llama", dict(mlp_bias=True, attention_bias=True)),
            "gpt_neox-sequential": ("gpt_neox", dict(use_parallel_residual=False)),
            "opt-postnorm": ("opt", dict(do_layer_norm_before=False)),  # OPT-350m
            "qwen2-sliding": ("qwen2", dict(use_sliding_window=True, sliding_window=16, max_window_layers=1,
                                            layer_types=["full_attention", "sliding_attention"]))}


@pytest.fixture(params=list(ARCHITECTURES) + list(VARIANTS))
def model(request):
    arch, overrides = VARIANTS.get(request.param, (request.param, {}))
    return tiny_model(arch, **overrides)


def test_every_required_architecture_is_supported():
    assert REQUIRED <= set(SUPPORTED)
    assert REQUIRED <= set(ARCHITECTURES)


def test_sites_found_for_every_layer(model):
    sites = find_sites(model)
    assert len(sites.mlp) == len(sites.attn) == model.config.num_hidden_layers
    for s in sites.mlp:
        w = s.read()
        assert w.d == model.config.hidden_size and w.h == 64
        assert w.up.shape == (64, 32) and w.down.shape == (32, 64)
        assert w.gated == (w.gate is not None) == s.gated
    for a in sites.attn:
        w = a.read()
        assert w.q.shape == (a.n_heads, a.head_dim, 32)
        assert w.o.shape == (32, a.n_heads, a.head_dim)
        assert w.k.shape[0] == a.n_kv


def test_read_write_roundtrip_is_exact(model, ids):
    ref = outputs(model, ids)
    sites = find_sites(model)
    for s, a in zip(sites.mlp, sites.attn):
        s.write(s.read())
        a.write(a.read())
    assert torch.equal(outputs(model, ids), ref)


def test_canonical_weights_compute_the_mlp(model):
    """The canonical reference forward (MLPWeights.__call__) equals the model's own MLP on its input."""
    for s in find_sites(model).mlp:
        x = torch.randn(2, 5, s.d)
        h = s.pre_norm(x) if s.pre_norm is not None else x
        ref = s.read()(h)
        if s.inner_post_norm is not None:
            ref = s.inner_post_norm(ref)
        torch.testing.assert_close(s.subblock(x), ref, rtol=1e-5, atol=1e-6)


def test_replace_mlp_with_equivalent_module_keeps_outputs(model, ids):
    ref = outputs(model, ids)
    for s in find_sites(model).mlp:
        s.replace_mlp(DenseMLP.from_weights(s.read()))
        assert s.replaced
    torch.testing.assert_close(outputs(model, ids), ref, rtol=1e-5, atol=1e-5)


class Delta(nn.Module):
    """x -> what the original sub-block added to x (computed by a frozen copy of its modules)."""

    def __init__(self, pre, mlp, post):
        super().__init__()
        self.pre, self.mlp, self.post = pre or nn.Identity(), mlp, post or nn.Identity()

    def forward(self, x):
        return self.post(self.mlp(self.pre(x)))


def test_replace_subblock_with_equivalent_function_keeps_outputs(model, ids):
    ref = outputs(model, ids)
    for s in find_sites(model).mlp:
        w = s.read()
        f = Delta(s.pre_norm, DenseMLP.from_weights(w), s.inner_post_norm)
        if s.shared_norm:  # Phi-2: attention reads the same norm; removing it would change attention
            norm = s.pre_norm
            with pytest.raises(MLPSurgeryError, match="shares its norm"):
                s.replace_subblock(f)
            assert s.pre_norm is norm and not s.replaced
            continue
        s.replace_subblock(f)
        if s.pre_norm is not None:
            assert isinstance(s.pre_norm, nn.Identity)
    torch.testing.assert_close(outputs(model, ids), ref, rtol=1e-5, atol=1e-5)


def test_replaced_site_reads_the_dense_form_or_refuses(model):
    """After replace_mlp, read() gives the replacement's dense form (so methods compose); a module with no dense form
    is refused with a message naming it, never read as if it were the stock MLP."""
    s = find_sites(model).mlp[0]
    w = s.read()
    dense = DenseMLP.from_weights(w)
    with torch.no_grad():
        dense.up.weight.mul_(2.0)
    s.replace_mlp(dense)
    again = s.read()
    torch.testing.assert_close(again.up, w.up * 2.0)
    torch.testing.assert_close(again.down, w.down)

    class Opaque(nn.Module):
        def forward(self, x):
            return x

    s.replace_mlp(Opaque())
    with pytest.raises(MLPSurgeryError, match="replaced by Opaque"):
        s.read()


def test_writing_fewer_neurons_equals_masking_the_rest(model, ids):
    """select() + write() with a smaller h is the same function as zeroing the other neurons' activations."""
    keep = torch.tensor([0, 3, 5, 8, 13, 21, 34, 55])
    sites = find_sites(model)
    mask = torch.zeros(64)
    mask[keep] = 1
    handles = [s.down_proj.register_forward_pre_hook(lambda m, a: (a[0] * mask,)) for s in sites.mlp]
    masked = outputs(model, ids)
    for h in handles:
        h.remove()
    for s in sites.mlp:
        s.write(s.read().select(keep))
        assert s.h == len(keep)
    torch.testing.assert_close(outputs(model, ids), masked, rtol=1e-5, atol=1e-5)


def test_head_slices_are_consistent_per_kv_group(model, ids):
    """Permuting KV groups (with their query heads) in q, k, v and o leaves the function unchanged; a
    wrong per-head slicing of a fused or interleaved layout would not."""
    ref = outputs(model, ids)
    for a in find_sites(model).attn:
        w = a.read()
        if any(n.startswith(("q_norm", "k_norm")) and p.numel() > a.head_dim for n, p in a.module.named_parameters()):
            # OLMo 2: q / k norms across every head tie the heads' order to theirs; nothing reorders or removes them
            with pytest.raises(MLPSurgeryError, match="weights across or per heads"):
                check_heads_removable(a)
            return
        perm = torch.randperm(w.n_kv, generator=torch.Generator().manual_seed(a.index))
        if w.n_kv > 1 and torch.equal(perm, torch.arange(w.n_kv)):
            perm = perm.flip(0)
        p = w.select_groups(perm)
        assert not torch.equal(p.q, w.q)
        a.write(p)
    torch.testing.assert_close(outputs(model, ids), ref, rtol=1e-4, atol=1e-5)


def test_zeroing_a_groups_values_equals_masking_its_heads(model, ids):
    sites = find_sites(model)
    a0 = sites.attn[0]
    group = a0.n_kv - 1
    heads = a0.read().heads_of_groups([group])
    mask = torch.ones(a0.n_heads, a0.head_dim)
    mask[heads] = 0
    h = a0.o_proj.register_forward_pre_hook(lambda m, a: (a[0] * mask.reshape(-1),))
    masked = outputs(model, ids)
    h.remove()
    w = a0.read()
    w.v[group] = 0
    if w.v_bias is not None:
        w.v_bias[group] = 0
    a0.write(w)
    torch.testing.assert_close(outputs(model, ids), masked, rtol=1e-4, atol=1e-5)


def test_replaced_model_still_generates_and_saves(tmp_path, ids):
    model = tiny_model("llama")
    for s in find_sites(model).mlp:
        s.replace_mlp(DenseMLP.from_weights(s.read()))
    out = model.generate(ids[:1, :8], max_new_tokens=4, do_sample=False)
    assert out.shape == (1, 12)
    model.save_pretrained(tmp_path / "hf")
    assert (tmp_path / "hf" / "model.safetensors").exists()


def test_unknown_architecture_lists_supported():
    class Fake(nn.Module):
        config = type("C", (), {"model_type": "mamba"})()

    with pytest.raises(UnsupportedArchitectureError) as e:
        find_sites(Fake())
    for name in ("llama", "gpt2", "bert"):
        assert name in str(e.value)
    with pytest.raises(UnsupportedArchitectureError):
        find_sites(nn.Linear(2, 2))


def test_generic_layers_on_a_cnn():
    net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3), nn.BatchNorm2d(8),
                        nn.Flatten(), nn.Linear(8 * 4 * 4, 10))
    layers = generic_layers(net)
    assert [g.kind for g in layers] == ["conv", "batchnorm", "conv", "batchnorm", "linear"]
    assert layers[0].role == "input" and layers[-1].role == "output"
    assert {g.role for g in layers[1:-1]} == {"hidden"}


def test_parse_layers():
    assert parse_layers("all", 4) == [0, 1, 2, 3]
    assert parse_layers("8-11", 12) == [8, 9, 10, 11]
    assert parse_layers("0,3,5", 6) == [0, 3, 5]
    assert parse_layers("last2/3", 30) == list(range(10, 30))
    with pytest.raises(MLPSurgeryError, match="do not exist"):
        parse_layers("0,40", 30)
    with pytest.raises(MLPSurgeryError, match="not understood"):
        parse_layers("x", 30)


def test_linears_by_role_and_replace_linear(model, ids):
    """Every projection can be swapped for an equivalent nn.Linear built from its canonical weight."""
    from mlpsurgery.sites import linear_weight

    ref = outputs(model, ids)
    sites = find_sites(model)
    for site in sites.mlp + sites.attn:
        for role, mod in site.linears().items():
            w, b = linear_weight(mod)
            new = nn.Linear(w.shape[1], w.shape[0], bias=b is not None)
            with torch.no_grad():
                new.weight.copy_(w)
                if b is not None:
                    new.bias.copy_(b)
            site.replace_linear(role, new)
            assert site.linears()[role] is new
    torch.testing.assert_close(outputs(model, ids), ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(MLPSurgeryError, match="not 'nope'"):
        sites.mlp[0].replace_linear("nope", nn.Identity())
