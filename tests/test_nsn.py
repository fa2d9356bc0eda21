import json
import math

import pytest
import torch
import transformers as T

from conftest import TEXT, outputs
from mlpsurgery.cli import main
from mlpsurgery.errors import MLPSurgeryError
from mlpsurgery.io import export, load, save
from mlpsurgery.measure.cost import flops_per_token
from mlpsurgery.methods import nsn
from mlpsurgery.modules.nested import NestedLinear
from mlpsurgery.sites import find_sites, linear_weight
from mlpsurgery.tiny import tiny_model
from mlpsurgery.train import FitConfig, lm_loss

EXPORT_ARCHS = ("llama", "gpt2", "phi3", "bert")  # plain Linear, GPT-2 Conv1D, fused gate_up / qkv, encoder


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """conftest asks for 2 threads; on a shared 2-core machine the float64 SVD of `nest` then runs ~12x
    slower (77 s against 6 s for MiniLM's 12 projections, measured), and these tiny models gain nothing."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def lm_blocks(tokenizer, n=16, T_=24):
    ids = tokenizer(TEXT * 4)["input_ids"]
    return torch.tensor(ids[: n * T_]).view(n, T_)


def test_full_rank_svd_init_reproduces_the_model(arch, ids):
    model = tiny_model(arch)
    ref = outputs(model, ids)
    n_mlp = sum(len(s.linears()) for s in find_sites(model).mlp)
    nsn.nest(model, nsn.NSNConfig(modules="mlp+attn"))
    layers = nsn.nested_linears(model)
    assert len(layers) == n_mlp + sum(len(a.linears()) for a in find_sites(model).attn)
    torch.testing.assert_close(outputs(model, ids), ref, rtol=1e-5, atol=2e-5)
    # below full rank it is no longer the same model
    nsn.set_rank(model, 2)
    assert (outputs(model, ids) - ref).abs().max() > 1e-3


def test_nest_mlp_only_leaves_attention_alone(decoder_arch):
    model = tiny_model(decoder_arch)
    nsn.nest(model)
    sites = find_sites(model)
    assert all(isinstance(m, NestedLinear) for s in sites.mlp for m in s.linears().values())
    assert not any(isinstance(m, NestedLinear) for a in sites.attn for m in a.linears().values())


def test_svd_components_give_the_best_approximation_at_every_rank():
    """Eckart-Young: ||W - W_r||_F is the tail of the singular values, so it falls strictly with r."""
    model = tiny_model("gpt2")  # Conv1D: the (out, in) orientation must be respected
    originals = {role: linear_weight(m)[0].detach().clone() for role, m in find_sites(model).mlp[0].linears().items()}
    nsn.nest(model)
    for role, m in find_sites(model).mlp[0].linears().items():
        W = originals[role].double()
        S = torch.linalg.svdvals(W)
        errs = []
        for r in range(1, m.max_rank + 1):
            err = float((W - m.weight_at(r).detach().double()).norm())
            assert err == pytest.approx(float(S[r:].pow(2).sum().sqrt()), abs=1e-4)
            errs.append(err)
        assert all(a > b for a, b in zip(errs, errs[1:]))


def test_rank_switch_copies_nothing_and_comes_back_exactly(ids):
    model = tiny_model("llama")
    nsn.nest(model)
    ptrs = {n: p.data_ptr() for n, p in model.named_parameters()}
    full = outputs(model, ids)
    seen = [full]
    for r in (16, 4, 1):
        nsn.set_rank(model, r)
        out = outputs(model, ids)
        assert all(not torch.equal(out, o) for o in seen)
        seen.append(out)
    nsn.set_rank(model, 32)
    assert torch.equal(outputs(model, ids), full)
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == ptrs
    # adjacent ranks differ by exactly one rank-1 component (Lemma 1)
    m = next(iter(nsn.nested_linears(model).values()))
    x = torch.randn(5, m.in_features)
    m.rank = 7
    y7 = m(x)
    m.rank = 8
    torch.testing.assert_close(m(x) - y7, (x @ m.A[7]).unsqueeze(-1) * m.B[:, 7], rtol=1e-4, atol=1e-5)


def test_per_layer_ranks_and_paths():
    model = tiny_model("qwen2")
    nsn.nest(model, nsn.NSNConfig(modules="mlp+attn"))
    ranks = nsn.set_rank(model, [3, None])
    layer0 = [p for p in ranks if ".layers.0." in p]
    assert layer0 and all(ranks[p] == 3 for p in layer0)
    # k/v projections are 32 -> 16 here: a global rank is capped per projection
    ranks = nsn.set_rank(model, 20)
    assert {p: r for p, r in ranks.items() if "k_proj" in p} and all(r == 16 for p, r in ranks.items() if "k_proj" in p)
    path = next(iter(ranks))
    assert nsn.set_rank(model, {path: 2})[path] == 2
    assert all(r == 5 for p, r in nsn.set_rank(model, {1: 5}).items() if ".layers.1." in p)


def test_untrained_and_every_rank_run_after_training(tokenizer, ids):
    model = tiny_model("gpt_neox")
    nsn.nest(model, nsn.NSNConfig(max_rank=24))
    blocks = lm_blocks(tokenizer)
    res = nsn.train_nsn(model, lm_loss(model, blocks, 4), nsn.NSNTrainConfig(ranks=(4, 12, 24), fit=FitConfig(steps=6, lr=3e-3)),
                        progress=False)
    assert res.anchor == 24 and set(res.log_var) == {4, 12, 24}
    assert all(m.rank == 24 for m in nsn.nested_linears(model).values())
    for r in range(1, 25):  # 1-3, 5-11, 13-23 were never trained
        nsn.set_rank(model, r)
        assert torch.isfinite(outputs(model, ids[:, :8])).all()


@pytest.mark.parametrize("arch", EXPORT_ARCHS)
def test_save_load_identical_at_every_rank_and_the_rank_is_saved(arch, ids, tmp_path):
    model = tiny_model(arch)
    nsn.nest(model, nsn.NSNConfig(max_rank=12, modules="mlp+attn"))
    nsn.set_rank(model, 5)
    save(model, tmp_path / "m")
    again = load(tmp_path / "m")
    assert set(nsn.current_ranks(again).values()) == {5}
    assert torch.equal(outputs(again, ids), outputs(model, ids))
    # identical factors make every rank identical; the forward is checked at the ends and in between
    saved = dict(model.named_parameters())
    assert all(torch.equal(p, saved[n]) for n, p in again.named_parameters())
    for r in (1, 7, 12):
        nsn.set_rank(model, r)
        nsn.set_rank(again, r)
        assert torch.equal(outputs(again, ids), outputs(model, ids))


@pytest.mark.parametrize("arch", EXPORT_ARCHS)
def test_export_lowrank_and_dense(arch, ids, tmp_path):
    model = tiny_model(arch)
    n_params = sum(p.numel() for p in model.parameters())
    nsn.nest(model)
    nsn.set_rank(model, 6)
    ref = outputs(model, ids)
    low = nsn.truncate(load_copy(model, tmp_path / "a"))
    save(low, tmp_path / "low")
    low = load(tmp_path / "low")
    assert all(m.max_rank == 6 for m in nsn.nested_linears(low).values())
    assert sum(p.numel() for p in low.parameters()) < n_params
    torch.testing.assert_close(outputs(low, ids), ref, rtol=1e-5, atol=1e-5)

    dense = nsn.fold(load_copy(model, tmp_path / "b"))
    export(dense, tmp_path / "hf")
    assert not (tmp_path / "hf" / "surgery.json").exists()
    plain, info = type(model).from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert sum(p.numel() for p in plain.parameters()) == n_params
    torch.testing.assert_close(outputs(plain.eval(), ids), ref, rtol=1e-4, atol=1e-5)


def load_copy(model, path):
    save(model, path)
    return load(path)


def test_flops_counted_at_the_current_rank():
    model = tiny_model("llama")  # d=32, h=64: three 32x64 projections per layer, 2 layers
    dense_mlp = flops_per_token(model)["mlp"]
    nsn.nest(model)
    for r in (1, 7, 32):
        nsn.set_rank(model, r)
        assert flops_per_token(model)["mlp"] == 2 * 3 * 2 * r * (32 + 64)
        assert nsn.nested_flops(model)["fraction"] == pytest.approx(2 * 3 * 2 * r * 96 / dense_mlp)
    info = nsn.set_budget(model, 0.5)
    # break-even is 32*64/96 = 21.3, so half the dense FLOPs is rank 10 (10.67 floored)
    assert info["rank"] == 10 and info["fraction"] <= 0.5 < 11 * 96 / (32 * 64)
    assert nsn.set_budget(model, 5.0)["rank"] == 32  # more than full rank costs: capped at the max rank
    with pytest.raises(MLPSurgeryError, match="below what rank 1 costs"):
        nsn.set_budget(model, 0.01)


def test_uncertainty_objective_is_the_papers_formula():
    obj = nsn.MultiRankObjective([4, 8, 16], "uncertainty")
    with torch.no_grad():
        obj.log_var.copy_(torch.tensor([0.3, -0.2, 0.5]))
    L_R, L_r = torch.tensor(2.0), torch.tensor(3.5)
    val = obj.combine(L_R, L_r, 8)
    assert float(val.detach()) == pytest.approx(math.exp(-0.5) * 2.0 + 0.5 + math.exp(0.2) * 3.5 - 0.2, rel=1e-6)
    val.backward()
    # d/ds_k of exp(-s_k) L_k + s_k is 1 - exp(-s_k) L_k; the rank not drawn gets nothing
    assert obj.log_var.grad.tolist() == pytest.approx([0.0, 1 - math.exp(0.2) * 3.5, 1 - math.exp(-0.5) * 2.0], rel=1e-5)
    assert float(nsn.MultiRankObjective([4, 16], "two_ce").combine(L_R, L_r, 4)) == 5.5
    assert float(nsn.MultiRankObjective([16], "anchor").combine(L_R, None, None)) == 2.0
    with pytest.raises(MLPSurgeryError, match="at least two"):
        nsn.MultiRankObjective([16], "uncertainty")


def test_objectives_run_the_model_at_the_right_ranks():
    model = tiny_model("llama")
    nsn.nest(model)
    calls = []

    def task(step):
        calls.append((step, {m.rank for m in nsn.nested_linears(model).values()}))
        return sum(p.sum() for p in model.parameters()) * 0

    for objective, per_step in (("anchor", 1), ("two_ce", 2), ("uncertainty", 2)):
        calls.clear()
        obj = nsn.MultiRankObjective([2, 8, 32], objective, steps=4)
        fn = obj.loss_fn(model, task)
        for step in range(4):
            _, metrics = fn(step)
        assert len(calls) == 4 * per_step
        assert all(ranks == {32} for _, ranks in calls[::per_step])  # the anchor first, every step
        if per_step == 2:
            assert [c[1] for c in calls[1::2]] == [{obj.variant(s)} for s in range(4)]
            assert metrics["variant_rank"] == obj.variant(3)


def test_curriculum_starts_at_the_anchor_and_widens_to_the_lowest_rank():
    ranks = [1, 2, 4, 8, 16, 32, 64]
    draws = [nsn.variant_rank(ranks, s, 400, "curriculum", 0.5, seed=3) for s in range(400)]
    assert set(draws[:20]) == {32}  # only the rank next to the anchor at first
    first = {r: draws.index(r) for r in ranks[:-1]}
    assert [first[r] for r in (32, 16, 8, 4, 2, 1)] == sorted(first[r] for r in (32, 16, 8, 4, 2, 1))
    assert max(first.values()) <= 200  # every variant is reachable by curriculum_end
    assert set(draws[200:]) == set(ranks[:-1])
    uniform = [nsn.variant_rank(ranks, s, 400, "uniform", seed=3) for s in range(60)]
    assert set(uniform) == set(ranks[:-1]) and 64 not in uniform
    assert draws == [nsn.variant_rank(ranks, s, 400, "curriculum", 0.5, seed=3) for s in range(400)]  # resumable


def test_resume_equals_uninterrupted_including_log_variances(tokenizer, tmp_path):
    blocks = lm_blocks(tokenizer)
    cfg = nsn.NSNTrainConfig(ranks=(2, 8, 32), fit=FitConfig(steps=6, lr=3e-3, checkpoint_every=2), log_var_lr=0.1)

    def fresh(scramble=False):
        model = tiny_model("llama")  # the frozen weights are the pretrained model's, in every process
        nsn.nest(model)
        if scramble:  # the trained ones must come from the checkpoint
            for m in nsn.nested_linears(model).values():
                torch.nn.init.normal_(m.A)
                torch.nn.init.normal_(m.B)
        return model

    a = fresh()
    res_a = nsn.train_nsn(a, lm_loss(a, blocks, 4), cfg, progress=False)
    b = fresh()
    inner = lm_loss(b, blocks, 4)

    def crashing(step):
        if step == 4:
            raise KeyboardInterrupt
        return inner(step)

    with pytest.raises(KeyboardInterrupt):
        nsn.train_nsn(b, crashing, cfg, checkpoint_dir=tmp_path / "ck", progress=False)
    c = fresh(scramble=True)  # another process
    res_c = nsn.train_nsn(c, lm_loss(c, blocks, 4), cfg, checkpoint_dir=tmp_path / "ck", progress=False)
    assert res_c.resumed_from == 4
    assert res_c.log_var == res_a.log_var and any(v != 0 for v in res_a.log_var.values())
    for (n, pa), pc in zip(a.named_parameters(), c.parameters()):
        assert torch.equal(pa, pc), n


def test_analysis_containment_and_interpolation(tokenizer):
    model = tiny_model("llama")
    nsn.nest(model)
    ranks = [2, 4, 8, 16, 32]
    C = nsn.containment(model, ranks)
    upper = torch.triu(torch.ones(5, 5, dtype=torch.bool))
    torch.testing.assert_close(C[upper], torch.ones(int(upper.sum())), atol=1e-4, rtol=0)  # nested by construction
    lower = torch.tensor([[min(1.0, rj / ri) for rj in ranks] for ri in ranks])
    torch.testing.assert_close(C, lower, atol=1e-4, rtol=0)  # a larger space is never inside a smaller one
    blocks = lm_blocks(tokenizer)
    loss = lm_loss(model, blocks, 8)
    rows = nsn.sweep(model, lambda: {"loss": float(loss(0).detach())}, [2, 3, 4, 6, 8, 16, 32], progress=False)
    assert [r["rank"] for r in rows] == [2, 3, 4, 6, 8, 16, 32]
    assert all(m.rank == 32 for m in nsn.nested_linears(model).values())  # restored
    check = nsn.interpolation_check(model, {r["rank"]: r["loss"] for r in rows}, trained=[2, 4, 8, 16, 32])
    assert check["C"] > 0 and [r["r_int"] for r in check["interpolated"]] == [3, 6]
    for r in check["interpolated"]:
        assert r["energy"] == pytest.approx(nsn.energy_between(model, r["r1"], r["r_int"]))


def test_bad_input_is_refused():
    model = tiny_model("llama")
    with pytest.raises(MLPSurgeryError, match="no NestedLinear"):
        nsn.set_rank(model, 3)
    with pytest.raises(MLPSurgeryError, match="modules"):
        nsn.nest(model, nsn.NSNConfig(modules="attn"))
    nsn.nest(model)
    with pytest.raises(MLPSurgeryError, match="already"):
        nsn.nest(model)
    with pytest.raises(MLPSurgeryError, match="1..32"):
        nsn.set_rank(model, 33)
    with pytest.raises(MLPSurgeryError, match="one entry per layer"):
        nsn.set_rank(model, [3])
    with pytest.raises(MLPSurgeryError, match="training ranks"):
        nsn.train_nsn(model, lambda s: None, nsn.NSNTrainConfig(ranks=(4, 64)))


def test_cli_train_rank_sweep(tmp_path, capsys):
    corpus = tmp_path / "text.txt"
    corpus.write_text(TEXT * 40)
    out = tmp_path / "nested"
    assert main(["nest", "tiny:llama", "--out", str(out), "--data", str(corpus), "--train-steps", "3",
                 "--ranks", "4,16,32", "--block-len", "32", "--quiet", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["train"]["ranks"] == [4, 16, 32] and r["projections"] == 6
    assert not (tmp_path / "nested.ckpt").exists()
    assert nsn.learned_log_variances(load(out)).keys() == {4, 16, 32}

    assert main(["nest", "rank", str(out), "--budget", "0.5", "--form", "dense", "--out", str(tmp_path / "hf"),
                 "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["rank"] == 10 and r["loads_with"] == "transformers from_pretrained"
    T.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")

    assert main(["nest", "sweep", str(out), "--data", str(corpus), "--ranks", "2,8,32", "--block-len", "64",
                 "--plot", str(tmp_path / "s.png"), "--quiet"]) == 0
    text = capsys.readouterr().out
    assert "ppl" in text and (tmp_path / "s.png").stat().st_size > 1000

    # the form without MODEL parses (options first); bad combinations are refused and write nothing
    assert main(["nest", "rank", str(out), "--rank", "3", "--budget", "0.5", "--out", str(tmp_path / "x")]) == 2
    assert main(["nest", "rank", str(out), "--rank", "3", "--train-steps", "5", "--out", str(tmp_path / "x")]) == 2
    assert main(["nest", "sweep", str(out), "--out", str(tmp_path / "x")]) == 2
    assert main(["nest", "--out", str(out), "tiny:llama"]) == 2  # --out is not empty
    assert not (tmp_path / "x").exists()
    assert "already exists" in capsys.readouterr().err


def test_classifier_training_through_the_pipeline(tmp_path):
    rows = [{"text": ("good " if i % 2 else "bad ") * (1 + i % 4), "label": "pos" if i % 2 else "neg"} for i in range(40)]
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows))
    r = nsn.nest_model("tiny:bert", tmp_path / "clf", nsn.NSNConfig(),
                       nsn.NSNTrainConfig(ranks=(4, 32), objective="two_ce", fit=FitConfig(steps=3, lr=1e-3)),
                       data=str(data), batch_size=8, max_len=16, progress=False)
    assert r["data"]["classes"] == ["neg", "pos"]
    swept = nsn.sweep_folder(tmp_path / "clf", data=str(data), ranks=[4, 32], max_len=16, progress=False)
    assert swept["metric"] == "accuracy" and all(0 <= x["accuracy"] <= 1 for x in swept["rows"])


@pytest.mark.realmodel
def test_minilm_full_rank_exact_and_half_budget(minilm):
    import copy

    model, tok = copy.deepcopy(minilm.model), minilm.tokenizer  # the session fixture is shared: nest a copy
    enc = tok(["Oil prices rose sharply today", "The company reported earnings"], padding=True, return_tensors="pt")
    with torch.no_grad():
        ref = model(**enc).last_hidden_state
        nsn.nest(model)
        torch.testing.assert_close(model(**enc).last_hidden_state, ref, rtol=1e-4, atol=1e-4)
        info = nsn.set_budget(model, 0.5)
        assert info["rank"] == 153  # 0.5 * 384*1536/(384+1536) = 153.6
        assert model(**enc).last_hidden_state.shape == ref.shape


def test_update_counts_say_how_often_each_rank_moved_its_log_variance(tokenizer):
    """The anchor is in every step, each lower rank when sampled; a rank never drawn keeps s_k = 0 exactly."""
    obj = nsn.MultiRankObjective((2, 8, 32), "uncertainty", "curriculum", 0.5, 40, seed=0)
    counts = obj.update_counts()
    assert counts[32] == 40 and counts[2] + counts[8] == 40
    assert counts == {r: sum(1 for s in range(40) if obj.variant(s) == r) + (40 if r == 32 else 0) for r in (2, 8, 32)}
    model = tiny_model("llama")
    nsn.nest(model)
    cfg = nsn.NSNTrainConfig(ranks=(2, 8, 32), fit=FitConfig(steps=3, lr=1e-3), log_var_lr=0.1)
    res = nsn.train_nsn(model, lm_loss(model, lm_blocks(tokenizer), 2), cfg, progress=False)
    assert sum(res.updates.values()) == 6 and nsn.training_updates(model) == res.updates
    never = [r for r, c in res.updates.items() if c == 0]
    assert all(res.log_var[r] == 0.0 for r in never)


# ---- multi-rank local tuning of the nested start (methods/nsn/local.py) --------------------------------------------

@pytest.mark.parametrize("arch", EXPORT_ARCHS)
def test_local_tuning_lowers_every_layers_multi_rank_error_and_the_folder_stays_an_nsn_checkpoint(arch, tmp_path):
    from mlpsurgery.io.provenance import history
    from mlpsurgery.methods.nsn.local import nest_tuned

    model = tiny_model(arch)
    calib = torch.randint(3, 250, (64, 32), generator=torch.Generator().manual_seed(0))
    cfg = nsn.NSNConfig()
    plain = nest_tuned(copy_of(model), cfg, calib, epochs=0.0)  # the sequential whitened start alone
    tuned_model = copy_of(model)
    rep = nest_tuned(tuned_model, cfg, calib, epochs=8, lr=1e-3)
    assert all(r["steps"] == 0 for r in plain["layers"])
    for r in rep["layers"]:
        assert r["ranks"] == sorted(set(r["ranks"])) and len(r["ranks"]) > 2 and r["steps"] == 16
        assert len(r["error_before"]) == len(r["ranks"]) == len(r["error_after"])
        weighted = sum((a / b) ** 2 for a, b in zip(r["error_after"], r["error_before"])) / len(r["ranks"])
        assert weighted <= 1 + 1e-9 and (weighted < 1) == r["kept"], r
    assert any(r["kept"] for r in rep["layers"])
    layers = nsn.nested_linears(tuned_model)
    assert layers and all(m.rank == m.max_rank for m in layers.values())  # left at full rank, as nest leaves it
    # through `nest`: recorded in the history, saved and reloaded with its weights, its rank switchable
    again = copy_of(model)
    nsn.nest(again, cfg, calib_data=calib, local_epochs=8, local_lr=1e-3)
    local = history(again)[-1]["provenance"]["local"]
    assert local["epochs"] == 8 and local["steps"] == 16 * len(rep["layers"]) and local["layers"] == len(rep["layers"])
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), tuned_model.state_dict().values()))
    save(again, tmp_path / "m")
    back = load(tmp_path / "m")
    ids = torch.randint(3, 250, (2, 16), generator=torch.Generator().manual_seed(1))
    for r in (2, 8):
        nsn.set_rank(again, r)
        nsn.set_rank(back, r)
        with torch.no_grad():
            assert torch.allclose(outputs(back, ids), outputs(again, ids), atol=1e-5)


@pytest.mark.parametrize("arch", ("llama", "gpt2", "phi3", "bert", "gemma2", "opt"))
def test_down_refit_lowers_the_error_over_the_ranks_and_leaves_the_max_rank(arch, tmp_path):
    """nest(refit=True): each layer's down projection refit at every rank of its trained set at once lowers the MLP's
    output error over them, weighed alike (gpt2 / opt / bert: a down bias; phi3: fused gate_up; gemma2: a norm after
    the MLP), and the maximum rank is no longer the original, as the record says."""
    from mlpsurgery.io.provenance import history
    from mlpsurgery.methods.nsn.local import nest_tuned

    model = tiny_model(arch)
    calib = torch.randint(3, 250, (64, 32), generator=torch.Generator().manual_seed(0))
    cfg = nsn.NSNConfig()
    refit = copy_of(model)
    rep = nest_tuned(refit, cfg, calib, epochs=0.0, refit=True)
    for r in rep["layers"]:
        before, after = r["refit"]["error_before"], r["refit"]["error_after"]
        assert len(before) == len(after) == len(r["ranks"])
        # one fit serves every rank, each rank's error weighed by 1 / its own before: their mean ratio falls (a
        # single rank may give a little: bert's lowest, gemma2's top)
        assert sum(a / b for a, b in zip(after, before)) < len(before), r
    # at the maximum rank the plain start is the original and the refit one is not (what the record says)
    ids = torch.randint(3, 250, (2, 16), generator=torch.Generator().manual_seed(1))
    plain = copy_of(model)
    nest_tuned(plain, cfg, calib, epochs=0.0)
    with torch.no_grad():
        assert torch.allclose(outputs(plain, ids), outputs(model, ids), atol=1e-4)
        assert not torch.allclose(outputs(refit, ids), outputs(model, ids), atol=1e-3)
    # through `nest`: the same weights, the record, saved and reloaded
    again = copy_of(model)
    nsn.nest(again, cfg, calib_data=calib, refit=True)
    prov = history(again)[-1]["provenance"]
    assert prov["refit"]["exact_at_max_rank"] is False and "down refit" in prov["init"] and "local" not in prov
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), refit.state_dict().values()))
    save(again, tmp_path / "m")
    back = load(tmp_path / "m")
    nsn.set_rank(again, 3)
    nsn.set_rank(back, 3)
    with torch.no_grad():
        assert torch.allclose(outputs(back, ids), outputs(again, ids), atol=1e-5)


def test_down_refit_refusals_and_the_cli(tmp_path, capsys):
    model = tiny_model("llama")
    calib = torch.randint(3, 250, (8, 16))
    with pytest.raises(MLPSurgeryError, match="give calibration data"):
        nsn.nest(copy_of(model), nsn.NSNConfig(), refit=True)
    with pytest.raises(MLPSurgeryError, match="down refit fits each MLP sub-block"):
        nsn.nest(copy_of(model), nsn.NSNConfig(modules="mlp+attn"), calib_data=calib, refit=True)
    for extra in (["--data-free"], ["--layerwise"], ["--modules", "mlp+attn"]):
        out = tmp_path / "n"
        assert main(["nest", "tiny:llama", "--out", str(out), "--refit", *extra]) == 2
        err = capsys.readouterr().err
        assert "--refit" in err and err.strip().count("\n") == 0 and not out.exists(), (extra, err)
    out = tmp_path / "r"
    assert main(["nest", "tiny:llama", "--out", str(out), "--refit", "--calib-blocks", "16", "--json", "--quiet"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert "down refit at every rank" in r["init"] and "local" not in r
    back = load(out)
    nsn.set_budget(back, 0.5)
    assert nsn.nested_linears(back)


def copy_of(model):
    import copy

    return copy.deepcopy(model)


def test_local_tuning_refusals(tmp_path, capsys):
    model = tiny_model("llama")
    calib = torch.randint(3, 250, (8, 16))
    with pytest.raises(MLPSurgeryError, match="give calibration data"):
        nsn.nest(copy_of(model), nsn.NSNConfig(), local_epochs=2)
    with pytest.raises(MLPSurgeryError, match="--modules mlp"):
        nsn.nest(copy_of(model), nsn.NSNConfig(modules="mlp+attn"), calib_data=calib, local_epochs=2)
    with pytest.raises(MLPSurgeryError, match=">= 0"):
        nsn.nest(copy_of(model), nsn.NSNConfig(), calib_data=calib, local_epochs=-1)
    from mlpsurgery.io import save
    from mlpsurgery.methods.nsn.layerwise import nest_layerwise

    src = save(copy_of(model), tmp_path / "src")
    for bad in (-1, float("nan")):  # layer by layer: the same check, before anything is written
        with pytest.raises(MLPSurgeryError, match=">= 0"):
            nest_layerwise(src, tmp_path / "lw", nsn.NSNConfig(), progress=False, calib_data=calib, local_epochs=bad)
        assert not (tmp_path / "lw").exists()
    for extra in (["--data-free"], ["--layerwise"], ["--modules", "mlp+attn"]):
        out = tmp_path / "n"
        assert main(["nest", "tiny:llama", "--out", str(out), "--local-epochs", "2", *extra]) == 2
        err = capsys.readouterr().err
        assert "local" in err and err.strip().count("\n") == 0 and not out.exists(), (extra, err)


def test_nest_cli_with_local_tuning_reports_it_and_writes_a_loadable_folder(tmp_path, capsys):
    out = tmp_path / "n"
    assert main(["nest", "tiny:llama", "--out", str(out), "--local-epochs", "4", "--calib-blocks", "16",
                 "--local-lr", "1e-3", "--json", "--quiet"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["local"]["epochs"] == 4 and r["local"]["lr"] == 1e-3 and r["local"]["layers"] >= 1
    assert "multi-rank local tuning" in r["init"]
    back = load(out)
    nsn.set_budget(back, 0.5)
    assert nsn.nested_linears(back)
    assert main(["nest", "tiny:llama", "--out", str(tmp_path / "m"), "--local-epochs", "1", "--calib-blocks", "8",
                 "--quiet"]) == 0
    assert "local tuning at every rank at once" in capsys.readouterr().out
