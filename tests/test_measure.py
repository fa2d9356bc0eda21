import math

import pytest
import torch
import transformers

from mlpsurgery.errors import MLPSurgeryError
from mlpsurgery.measure.cost import compare_cost, count_params, flops_per_token, inspect, max_batch, measure_cost
from mlpsurgery.measure.perplexity import _windows, perplexity
from mlpsurgery.modules.dense import DenseMLP
from mlpsurgery.sites import find_sites
from mlpsurgery.tiny import ENCODERS, tiny_config, tiny_model


@pytest.mark.parametrize("n,block,stride", [(100, 16, 15), (100, 16, 5), (10, 16, 15), (33, 8, 3), (17, 17, 16),
                                            (1000, 64, None)])
def test_every_token_but_the_first_is_scored_once(n, block, stride):
    scored = []
    for doc, start, first, end in _windows([n], block, stride or block - 1):
        assert end - start <= block and start < first <= end
        scored += list(range(first, end))
    assert scored == list(range(1, n))


def test_perplexity_equals_direct_computation():
    model = tiny_model("llama")
    seq = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=seq[None]).logits[0, :-1], -1)
    nll = -logp.gather(-1, seq[1:, None]).mean().item()
    r = perplexity(model, [seq], block_len=40, progress=False)
    assert r.tokens == 39 and r.ppl == pytest.approx(math.exp(nll), rel=1e-5)
    # overlapping windows give every token at least as much context: same count
    r2 = perplexity(model, [seq], block_len=16, stride=4, progress=False)
    assert r2.tokens == 39


@pytest.mark.parametrize("n,block,stride", [(100, 16, 14), (100, 16, 5), (10, 16, 14), (17, 18, 16), (1, 8, 6)])
def test_with_bos_every_token_is_scored_once(n, block, stride):
    scored = []
    for doc, start, first, end in _windows([n], block, stride, bos=True):
        assert end - start <= block - 1 and start <= first < end and (first > start or start == 0)
        scored += list(range(first, end))
    assert scored == list(range(n))


def test_perplexity_with_bos_equals_direct_computation():
    """BOS prepended to every window: the first token is scored with BOS as its context, the rest as usual."""
    from mlpsurgery.data import default_bos
    from mlpsurgery.tiny import byte_tokenizer

    model, bos = tiny_model("llama"), 257
    seq = torch.randint(0, 256, (30,), generator=torch.Generator().manual_seed(1))
    ids = torch.cat([torch.tensor([bos]), seq])[None]
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1], -1)
    nll = -logp.gather(-1, ids[0, 1:, None]).mean().item()
    r = perplexity(model, [seq], block_len=31, bos_id=bos, progress=False)
    assert r.tokens == 30 and r.ppl == pytest.approx(math.exp(nll), rel=1e-5) and "257" in r.protocol["bos"]
    assert perplexity(model, [seq], block_len=8, stride=3, bos_id=bos, progress=False).tokens == 30
    assert default_bos(byte_tokenizer()) is None  # the byte tokenizer adds no BOS by default: none is added


def test_perplexity_max_tokens_cuts_a_long_window_and_refuses_beyond_the_context():
    model = tiny_model("gpt2")
    seq = torch.randint(0, 256, (120,), generator=torch.Generator().manual_seed(2))
    assert perplexity(model, [seq], block_len=100, max_tokens=7, progress=False).tokens == 7
    limit = model.config.n_positions
    with pytest.raises(MLPSurgeryError, match=f"context of {limit}"):
        perplexity(model, [seq], block_len=limit + 1, progress=False)
    with pytest.raises(MLPSurgeryError, match="stride"):
        perplexity(model, [seq], block_len=16, stride=0, progress=False)


@pytest.mark.parametrize("arch", ENCODERS)
def test_perplexity_refuses_an_encoder_even_with_a_masked_lm_head(arch):
    with pytest.raises(MLPSurgeryError, match="causal language model"):
        perplexity(tiny_model(arch), [torch.arange(10)], progress=False)
    masked = transformers.AutoModelForMaskedLM.from_config(tiny_config(arch)).eval()  # it has output embeddings
    with pytest.raises(MLPSurgeryError, match="causal language model"):
        perplexity(masked, [torch.arange(10)], progress=False)


def test_param_counts_partition_the_model(model):
    c = count_params(model)
    assert c["embeddings"] + c["attention"] + c["mlp"] + c["head"] + c["other"] == c["total"]
    assert c["mlp"] == sum(r["mlp"] for r in c["per_layer"])
    assert c["mlp"] == sum(p.numel() for s in find_sites(model).mlp for p in s.parameters())


def test_flops_formula_llama():
    m = tiny_model("llama")
    f = flops_per_token(m, context=64)
    d, h, L, V = 32, 64, 2, 260
    assert f["mlp"] == L * 2 * 3 * d * h
    assert f["attention_proj"] == L * 2 * (d * d + 2 * d * 16 + d * d)  # 2 KV groups of head_dim 8
    assert f["attention_scores"] == L * int(4 * 4 * 8 * 32.5)
    assert f["head"] == 2 * d * V
    info = inspect(m)
    assert info["mlp_inner_width"] == 64 and info["kv_groups"] == 2
    assert sum(info["flop_share"].values()) == pytest.approx(1.0)


def test_cost_probe_leaves_weights_untouched():
    m = tiny_model("llama")
    before = {k: v.clone() for k, v in m.state_dict().items()}
    batch = torch.randint(0, 256, (2, 16))
    c = measure_cost(m, batch, repeats=2)
    assert c.step_s > 0 and c.forward_s > 0 and c.step_peak_bytes > c.forward_peak_bytes > 0
    for k, v in m.state_dict().items():
        assert torch.equal(v, before[k])
    assert all(p.grad is None for p in m.parameters())


def test_peak_memory_counts_weights_grads_and_adam_state():
    m = tiny_model("gpt2")
    n = sum(p.numel() for p in m.parameters())
    c = measure_cost(m, torch.randint(0, 256, (1, 8)), repeats=1)
    assert c.step_peak_bytes >= 4 * 4 * n  # weights + grads + two Adam moments, fp32


def test_peaks_alone_equal_the_peaks_of_the_timed_measure():
    """repeats=0: no timed pass, and the training step's peak still holds the optimizer's state (as a step in steady
    state does), so the peaks are those the full measure takes; weights untouched; nothing to measure is refused."""
    m = tiny_model("llama")
    before = {k: v.clone() for k, v in m.state_dict().items()}
    batch = torch.randint(0, 256, (2, 16))
    full = measure_cost(m, batch, repeats=1, warmup=0)
    alone = measure_cost(m, batch, repeats=0, warmup=0)
    assert alone.step_peak_bytes == full.step_peak_bytes and alone.forward_peak_bytes == full.forward_peak_bytes
    assert math.isnan(alone.step_s) and math.isnan(alone.forward_s)
    for k, v in m.state_dict().items():
        assert torch.equal(v, before[k])
    assert all(p.grad is None for p in m.parameters())
    for kw in ({"repeats": 0, "warmup": 1}, {"repeats": 0, "warmup": 0, "memory": False}, {"repeats": -1}):
        with pytest.raises(MLPSurgeryError, match="measure nothing"):
            measure_cost(m, batch, **kw)


def test_compare_identical_models_memory_ratio_is_one():
    a, b = tiny_model("qwen3"), tiny_model("qwen3")
    r = compare_cost(a, b, torch.randint(0, 256, (2, 16)), repeats=1)
    assert r["ratio"]["step_peak_bytes"] == pytest.approx(1.0)
    assert r["ratio"]["forward_peak_bytes"] == pytest.approx(1.0)


def test_bigger_mlps_cost_more_memory():
    small, big = tiny_model("llama"), tiny_model("llama", intermediate_size=512)
    batch = torch.randint(0, 256, (2, 32))
    r = compare_cost(small, big, batch, repeats=1)
    assert r["ratio"]["step_peak_bytes"] > 1.5


def test_max_batch_is_affine_and_consistent():
    m = tiny_model("llama")
    one = measure_cost(m, torch.randint(0, 256, (1, 32)), repeats=1).step_peak_bytes
    r = max_batch(m, 32, budget_bytes=one * 3)
    assert r["max_batch"] >= 2
    at = measure_cost(m, torch.randint(0, 256, (r["max_batch"], 32)), repeats=1).step_peak_bytes
    assert at <= one * 3 * 1.02


def test_max_batch_reads_the_line_past_the_optimizer_steps_plateau():
    """A wide MLP on short sequences: the optimizer step's peak (flat in the batch) is the step's peak up to a batch
    of about 8, so probes at 1 and 2 see almost no slope (they once answered a batch of millions). The answer must fit
    the budget, and a few sequences more must not."""
    m = tiny_model("llama", intermediate_size=2048, hidden_size=256)
    budget = 100 * 2**20
    r = max_batch(m, 16, budget_bytes=budget)
    assert r["exact"] and 4 < r["max_batch"] < 1000, r

    def at(b):
        return measure_cost(m, torch.randint(0, 256, (b, 16)), repeats=0, warmup=0).step_peak_bytes

    assert at(r["max_batch"]) <= budget < at(r["max_batch"] + 3)
    small = max_batch(m, 16, budget_bytes=at(8))  # the budget passed before the line is seen: the largest fitted probe
    assert not small["exact"] and small["max_batch"] == 8
    with pytest.raises(MLPSurgeryError, match="probes"):
        max_batch(m, 16, budget_bytes=budget, probe=(2, 2))


def test_flops_follow_replaced_modules():
    m = tiny_model("llama")
    before = flops_per_token(m)["mlp"]
    for s in find_sites(m).mlp:
        s.replace_mlp(DenseMLP.from_weights(s.read().select(torch.arange(16))))
    assert flops_per_token(m)["mlp"] == before // 4


def test_peak_tracker_follows_allocations_and_frees():
    from mlpsurgery.measure.memory import PeakTracker

    keep = torch.zeros(1000)  # 4000 bytes alive before the region
    with PeakTracker(keep) as t:
        a = torch.ones(25_000)  # 100 kB
        del a
        b = torch.ones(50_000)  # 200 kB, after a was freed
        c = b.view(-1)  # a view: no new storage
        b.add_(1)  # in place: no new storage
        del b, c
    assert t.base == 4000
    assert t.peak == 4000 + 200_000


def test_cost_probe_with_frozen_parameters():
    m = tiny_model("llama")
    for n, p in m.named_parameters():
        p.requires_grad_("mlp" in n)
    c = measure_cost(m, torch.randint(0, 256, (2, 16)), repeats=1)
    assert c.trainable_params == sum(p.numel() for n, p in m.named_parameters() if "mlp" in n)
    assert c.step_peak_bytes > c.forward_peak_bytes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_next_token_nll_in_pieces_equals_the_one_piece_log_softmax(dtype):
    from mlpsurgery.measure.perplexity import _next_token_nll

    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, 17, 50, generator=g) * 4).to(dtype)
    ids = torch.randint(0, 50, (3, 17), generator=g)
    whole = -torch.log_softmax(logits.float()[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    for chunk_bytes in (1, 4 * 3 * 50 * 5, 1 << 26):  # one position, five, all at once
        assert torch.equal(_next_token_nll(logits, ids, chunk_bytes), whole)
