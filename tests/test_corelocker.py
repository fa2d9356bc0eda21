import json
import os

import pytest
import torch
from torch import nn

from mlpsurgery.cli import main
from mlpsurgery.errors import IntegrityError, MLPSurgeryError
from mlpsurgery.methods.corelocker import (CoreLockerConfig, Utility, attack_prune, channel_links,
                                           find_ratio, key_bytes, lock_folder, lock_key, read_key, save_key,
                                           seal, unit_groups, unlock_folder, unlock_key, utility_curve)
from mlpsurgery.sites import find_sites
from mlpsurgery.tiny import ARCHITECTURES, tiny_model

from conftest import outputs


@pytest.fixture(autouse=True)
def one_thread():
    """The models here are tiny: a second thread only adds synchronisation (badly so on a busy machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def identical(model, ref) -> bool:
    sd = model.state_dict()
    return sd.keys() == ref.keys() and all(torch.equal(sd[k], ref[k]) and sd[k].dtype == ref[k].dtype for k in ref)


def numels(model):
    return {n: p.numel() for n, p in model.named_parameters()}


def roundtrip(key, model, tmp_path, passphrase=None):
    path = tmp_path / "k.key"
    save_key(key, path, numels(model), passphrase=passphrase, overwrite=True)
    return read_key(path, passphrase)


class SmallCNN(nn.Module):
    """conv-BN-ReLU x3 with a pooling and a flatten into two linears: filters feed BN channels, convs and
    (through the flatten) groups of linear columns."""

    def __init__(self):
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(1, 6, 3, padding=1), nn.BatchNorm2d(6)
        self.c2, self.b2 = nn.Conv2d(6, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.c3, self.b3 = nn.Conv2d(8, 5, 3, padding=1), nn.BatchNorm2d(5)
        self.fc1, self.fc2 = nn.Linear(5 * 4 * 4, 12), nn.Linear(12, 3)

    def forward(self, x):
        x = torch.relu(self.b1(self.c1(x)))
        x = torch.relu(self.b2(self.c2(x)))
        x = nn.functional.max_pool2d(torch.relu(self.b3(self.c3(x))), 2)
        return self.fc2(torch.relu(self.fc1(torch.flatten(x, 1))))


def small_cnn(seed=0):
    torch.manual_seed(seed)
    m = SmallCNN()
    with torch.no_grad():
        for mod in m.modules():
            if isinstance(mod, nn.BatchNorm2d):
                mod.weight.uniform_(0.2, 2.0)
                mod.bias.uniform_(-0.5, 0.5)
                mod.running_mean.uniform_(-0.1, 0.1)
    return m.eval()


# ---- exact restoration ------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_locked_folder_is_plain_and_unlock_is_bitwise(arch, tokenizer, ids, tmp_path):
    model = tiny_model(arch)
    original = state(model)
    res = lock_folder(model, tmp_path / "locked", tmp_path / "k.key", CoreLockerConfig(ratio=0.1), tokenizer=tokenizer)
    assert res["units_extracted"] == round(0.1 * res["units_eligible"]) > 0
    # the locked folder is a plain transformers checkpoint holding exactly the locked weights
    plain = type(model).from_pretrained(tmp_path / "locked")
    assert identical(plain, state(model)) and not identical(plain, original)
    changed = sum(int((original[k] != v).sum()) for k, v in plain.state_dict().items())
    assert 0 < changed <= res["entries"]
    unlock_folder(tmp_path / "locked", tmp_path / "k.key", tmp_path / "restored")
    restored = type(model).from_pretrained(tmp_path / "restored")
    assert identical(restored, original)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_every_unit_and_indicator_roundtrips_bitwise(arch, tmp_path):
    for unit, indicator, scope in [("neuron", "l1", "layer"), ("head", "random", "global"),
                                   ("weight", "scale", "global"), ("weight", "random", "layer")]:
        model = tiny_model(arch)
        original = state(model)
        cfg = CoreLockerConfig(ratio=0.3, unit=unit, indicator=indicator, scope=scope)
        if indicator == "scale" and arch == "olmo":  # its layer norms carry no weights: nothing to rank
            with pytest.raises(MLPSurgeryError, match="no norm in this olmo model's layers has a weight"):
                lock_key(model, cfg)
            assert identical(model, original)
            continue
        key = lock_key(model, cfg)
        assert key.entries > 0 and not identical(model, original), (unit, indicator)
        unlock_key(model, roundtrip(key, model, tmp_path))
        assert identical(model, original), (unit, indicator, scope)


def test_ratio_zero_is_the_identity(ids, tmp_path):
    model = tiny_model("llama")
    original, before = state(model), outputs(model, ids)
    key = lock_key(model, CoreLockerConfig(ratio=0.0))
    assert key.entries == 0 and identical(model, original) and torch.equal(outputs(model, ids), before)
    unlock_key(model, roundtrip(key, model, tmp_path))
    assert identical(model, original)


def test_small_cnn_filters_roundtrip_and_remove_their_feature_maps(tmp_path):
    model = small_cnn()
    original = state(model)
    links = channel_links(model)
    assert links["c1"].norm == "b1" and links["c1"].consumers == [("c2", 1)]
    assert links["c3"].norm == "b3" and links["c3"].consumers == [("fc1", 16)]  # 4x4 columns per channel
    key = lock_key(model, CoreLockerConfig(ratio=0.4, unit="filter", scope="layer"))
    removed = {}
    for name in ("c2", "c3"):  # c1 is the input layer: left alone
        w = getattr(model, name).weight
        removed[name] = (w.flatten(1) == 0).all(1).nonzero().flatten().tolist()
        assert len(removed[name]) == round(0.4 * w.shape[0])
    assert torch.equal(model.c1.weight, original["c1.weight"])
    # each removed filter: its kernel and bias, its BN channel, and what reads its feature map are zero
    for c in removed["c2"]:
        assert model.c2.bias[c] == 0 and model.b2.weight[c] == 0 and model.b2.bias[c] == 0
        assert (model.c3.weight[:, c] == 0).all()
    for c in removed["c3"]:
        assert (model.fc1.weight[:, 16 * c:16 * (c + 1)] == 0).all()
    maps = {}
    model.b3.register_forward_hook(lambda m, i, o: maps.setdefault("b3", o))
    model(torch.randn(2, 1, 8, 8))
    assert (maps["b3"][:, removed["c3"]] == 0).all() and (maps["b3"][:, [c for c in range(5) if c not in removed["c3"]]] != 0).any()
    unlock_key(model, roundtrip(key, model, tmp_path))
    assert identical(model, original)


def test_small_cnn_scale_ranks_filters_by_the_bn_scale_after_them():
    model = small_cnn()
    gammas = {n: getattr(model, b).weight.detach().abs().clone() for n, b in (("c2", "b2"), ("c3", "b3"))}
    lock_key(model, CoreLockerConfig(ratio=0.25, unit="filter", indicator="scale"))
    chosen = [(g.item(), n, c) for n in gammas for c, g in enumerate(gammas[n])]
    top = sorted(chosen, reverse=True)[:round(0.25 * len(chosen))]
    removed = {(n, c) for n in gammas for c in range(len(gammas[n])) if (getattr(model, n).weight[c] == 0).all()}
    assert removed == {(n, c) for _, n, c in top}


# ---- the indicators and units are what they claim ---------------------------------------------------

def test_l1_takes_exactly_the_largest_weights():
    model = tiny_model("gpt2")
    sites = find_sites(model)
    mats = {n: p.detach().clone() for n, p in model.named_parameters()
            if any(p is m.weight for s in (*sites.mlp, *sites.attn) for m in s.linears().values())}
    key = lock_key(model, CoreLockerConfig(ratio=0.07))
    every = torch.cat([m.abs().flatten() for m in mats.values()])
    k = round(0.07 * every.numel())
    threshold = every.topk(k).values[-1]
    taken = torch.cat([mats[n].flatten()[key.positions[n]].abs() for n in key.positions])
    assert set(key.positions) <= set(mats) and len(taken) == k
    assert taken.min() >= threshold and (every > threshold).sum() <= k
    # per-layer scope: the top 7% of every matrix on its own
    model = tiny_model("gpt2")
    key = lock_key(model, CoreLockerConfig(ratio=0.07, scope="layer"))
    for n, m in mats.items():
        kk = round(0.07 * m.numel())
        assert len(key.positions[n]) == kk
        assert m.flatten()[key.positions[n]].abs().min() >= m.abs().flatten().topk(kk).values[-1]


@pytest.mark.parametrize("case", ["ties", "signed", "one_group"])
def test_streaming_global_ranking_is_the_exact_top_k_with_ties_in_group_then_position_order(case, monkeypatch):
    # Reference: a full sort of all scores, descending, stable over (group, position) order, so equal scores keep
    # that order. The streaming select (2 histogram passes + 1 collect pass over slices) must give the same list.
    import mlpsurgery.methods.corelocker.ranking as rk
    from mlpsurgery.methods.corelocker.units import UnitGroup

    monkeypatch.setattr(rk, "_SLICE", 37)  # slices cut across groups' ties and histogram bins
    g = torch.Generator().manual_seed(0)
    sizes = [2000] if case == "one_group" else [300, 5, 1000, 64]
    vals = [torch.randn(n, generator=g) for n in sizes]
    if case == "ties":  # bfloat16-rounded |w|: many exactly equal scores, and a block of zeros
        vals = [v.abs().bfloat16().float() for v in vals]
        vals[2][:200] = 0.0
    if case == "signed":
        vals = [v * 1e3 for v in vals]
        vals[0][:3] = torch.tensor([-0.0, 0.0, float("inf")])
    groups = [UnitGroup(f"g{i}", (lambda v=v: v), None, size=len(v)) for i, v in enumerate(vals)]
    every = torch.cat(vals)
    gid_all = torch.cat([torch.full((len(v),), i) for i, v in enumerate(vals)])
    uid_all = torch.cat([torch.arange(len(v)) for v in vals])
    perm = torch.sort(every, descending=True, stable=True).indices
    for k in (1, 7, 37, 200, len(every) // 3, len(every) - 1, len(every)):
        gid, uid = rk.global_top(groups, k)
        assert torch.equal(gid, gid_all[perm[:k]]) and torch.equal(uid, uid_all[perm[:k]]), (case, k)
        # unordered (a lock at one ratio): the same units, in (group, position) order
        counts, uu = rk.global_top(groups, k, ordered=False)
        chosen = perm[:k].sort().values
        gu = torch.repeat_interleave(torch.arange(len(groups)), counts)
        assert torch.equal(gu, gid_all[chosen]) and torch.equal(uu.long(), uid_all[chosen]), (case, k)
    assert all(len(t) == 0 for t in rk.global_top(groups, 0))
    counts, uu = rk.global_top(groups, 0, ordered=False)
    assert counts.tolist() == [0] * len(groups) and len(uu) == 0
    vals[-1][0] = float("nan")
    with pytest.raises(MLPSurgeryError, match="NaN"):
        rk.global_top(groups, 5)


@pytest.mark.parametrize("ratio", [0.05, 0.0737, 0.5])
@pytest.mark.parametrize("scope", ["global", "layer"])
def test_an_unordered_ranking_extracts_what_the_ordered_one_does_at_its_ratio(ratio, scope):
    # lock_key ranks without sorting by score (only its ratio is taken); the bisection's ranking is ordered
    from mlpsurgery.methods.corelocker.ranking import Ranking
    from mlpsurgery.methods.corelocker.units import unit_groups

    cfg = CoreLockerConfig(ratio=ratio, scope=scope)
    model = tiny_model("llama")
    a = Ranking(unit_groups(model, cfg), scope, 0.6)
    b = Ranking(unit_groups(model, cfg), scope, ratio, ordered=False)
    (ea, na), (eb, nb) = a.take(ratio), b.take(ratio)
    assert na == nb and list(ea) == list(eb)
    assert all(torch.equal(ea[n][0], eb[n][0]) and ea[n][1] == eb[n][1] for n in ea)
    if scope == "global":
        with pytest.raises(MLPSurgeryError, match="unordered"):
            b.take(ratio / 2)


@pytest.mark.parametrize("arch", ["llama", "gpt2", "gpt_neox"])  # GQA; fused Conv1D qkv; interleaved qkv
def test_a_removed_head_is_dead(arch, ids):
    model = tiny_model(arch)
    lock_key(model, CoreLockerConfig(ratio=0.25, unit="head"))
    before = outputs(model, ids)
    g = torch.Generator().manual_seed(0)
    dead = 0
    for site in find_sites(model).attn:
        w = site.read()
        heads = [h for h in range(w.n_heads) if (w.o[:, h] == 0).all()]
        for h in heads:
            assert (w.q[h] == 0).all()
            w.q[h] = torch.randn(w.q[h].shape, generator=g)  # whatever the head attends to, nothing comes out
            if w.n_kv == w.n_heads:
                assert (w.v[h] == 0).all() and (w.k[h] == 0).all()
                w.v[h] = torch.randn(w.v[h].shape, generator=g)
        dead += len(heads)
        site.write(w)
    assert dead == round(0.25 * 8)
    assert torch.allclose(outputs(model, ids), before, atol=1e-5)


def test_a_removed_neuron_is_dead(ids):
    model = tiny_model("phi3")  # fused gate_up
    lock_key(model, CoreLockerConfig(ratio=0.2, unit="neuron"))
    before = outputs(model, ids)
    dead = 0
    for site in find_sites(model).mlp:
        w = site.read()
        gone = (w.down == 0).all(0).nonzero().flatten()
        assert (w.up[gone] == 0).all() and (w.gate[gone] == 0).all()
        w.up[gone], w.gate[gone] = 1.0, 1.0
        site.write(w)
        dead += len(gone)
    assert dead == round(0.2 * 128)
    assert torch.allclose(outputs(model, ids), before, atol=1e-5)


def test_scale_zeroes_the_largest_norm_scales_including_gemma_plus_one():
    for arch in ("llama", "gemma"):
        model = tiny_model(arch)
        plus_one = arch == "gemma"
        norms = {n: p.detach().clone() for n, p in model.named_parameters()
                 if "norm" in n and p.dim() == 1 and ".layers." in n and "q_norm" not in n and "k_norm" not in n}
        key = lock_key(model, CoreLockerConfig(ratio=0.1, indicator="scale"))
        assert set(key.positions) == set(norms)
        eff = torch.cat([(v + 1 if plus_one else v).abs() for v in norms.values()])
        k = round(0.1 * len(eff))
        taken = torch.cat([(norms[n][p] + 1 if plus_one else norms[n][p]).abs() for n, p in key.positions.items()])
        assert len(taken) == k and taken.min() >= eff.topk(k).values[-1]
        params = dict(model.named_parameters())
        for n, p in key.positions.items():
            assert (params[n].detach()[p] == (-1.0 if plus_one else 0.0)).all()


def test_random_is_seeded_and_differs_from_l1():
    a = lock_key(tiny_model("llama"), CoreLockerConfig(ratio=0.1, indicator="random", seed=3))
    b = lock_key(tiny_model("llama"), CoreLockerConfig(ratio=0.1, indicator="random", seed=3))
    c = lock_key(tiny_model("llama"), CoreLockerConfig(ratio=0.1, indicator="l1"))
    assert all(torch.equal(a.positions[n], b.positions[n]) for n in a.positions)
    assert a.entries == c.entries and any(not torch.equal(a.positions[n], c.positions.get(n, torch.zeros(0)))
                                          for n in a.positions)


def test_bad_configurations_are_clear_errors():
    for cfg, needle in [(CoreLockerConfig(unit="filter"), "no conv filters"),
                        (CoreLockerConfig(indicator="scale", unit="neuron"), "scale"),
                        (CoreLockerConfig(ratio=1.5), "ratio"), (CoreLockerConfig(unit="channel"), "unit")]:
        with pytest.raises(MLPSurgeryError, match=needle):
            unit_groups(tiny_model("llama"), cfg)
    with pytest.raises(MLPSurgeryError, match="attention"):
        unit_groups(small_cnn(), CoreLockerConfig(unit="head"))


# ---- refusals: nothing written -----------------------------------------------------------------------

@pytest.fixture
def locked_pair(tmp_path, tokenizer):
    model = tiny_model("qwen2")
    lock_folder(model, tmp_path / "locked", tmp_path / "k.key", CoreLockerConfig(ratio=0.1), tokenizer=tokenizer)
    other = tiny_model("qwen2", seed=1)
    lock_folder(other, tmp_path / "locked2", tmp_path / "k2.key", CoreLockerConfig(ratio=0.1), tokenizer=tokenizer)
    return tmp_path


def refused(tmp_path, key, locked="locked", passphrase=None, error=IntegrityError, match=None):
    with pytest.raises(error, match=match):
        unlock_folder(tmp_path / locked, key, tmp_path / "out", passphrase=passphrase)
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


def test_wrong_truncated_and_tampered_keys_are_refused(locked_pair):
    t = locked_pair
    refused(t, t / "k2.key", match="does not belong")  # another model's key
    blob = (t / "k.key").read_bytes()
    (t / "cut.key").write_bytes(blob[: len(blob) // 2])
    refused(t, t / "cut.key", match="truncated|damaged")
    (t / "short.key").write_bytes(blob[:5])
    refused(t, t / "short.key", match="truncated")
    flipped = bytearray(blob)
    flipped[-3] ^= 0x40  # inside the last tensor's data: one stored value
    (t / "flip.key").write_bytes(bytes(flipped))
    refused(t, t / "flip.key", match="altered")
    # a tampered key whose checksum was recomputed still cannot pass: the restored model is checked
    key = read_key(t / "k.key")
    name = next(iter(key.values))
    key.values[name] = key.values[name] + 1.0
    (t / "forged.key").write_bytes(key_bytes(key, numels(tiny_model("qwen2"))))
    refused(t, t / "forged.key", match="do not restore")
    (t / "junk.key").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{\"a\": \"b\"}      ")
    refused(t, t / "junk.key", match="damaged|not a CoreLocker key")
    refused(t, t / "missing.key", error=MLPSurgeryError, match="does not exist")


def test_a_modified_locked_folder_is_refused(locked_pair, tokenizer):
    from mlpsurgery.io import save

    t = locked_pair
    model = type(tiny_model("qwen2")).from_pretrained(t / "locked")
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[0, 0] += 1e-3  # test code may reach in: it plays the attacker
    save(model, t / "edited", tokenizer=tokenizer)
    refused(t, t / "k.key", locked="edited", match="mlp.down_proj.weight")


def test_encrypted_key_holds_no_cleartext_and_needs_the_passphrase(tmp_path, tokenizer):
    model = tiny_model("llama")
    original = state(model)
    lock_folder(model, tmp_path / "locked", tmp_path / "k.key", CoreLockerConfig(ratio=0.05), tokenizer=tokenizer,
                passphrase="correct horse")
    sealed = (tmp_path / "k.key").read_bytes()
    plain_key = read_key(tmp_path / "k.key", "correct horse")
    plain = key_bytes(plain_key, numels(model))
    for name, v in list(plain_key.values.items())[:6]:
        chunk = v[:4].numpy().tobytes()  # 16 bytes of original values
        assert chunk in plain and chunk not in sealed
    for secret in (plain_key.header["locked_fingerprint"], plain_key.header["original_fingerprint"], "positions"):
        assert secret.encode() not in sealed
    refused(tmp_path, tmp_path / "k.key", passphrase="wrong horse", match="wrong passphrase")
    refused(tmp_path, tmp_path / "k.key", passphrase=None, error=MLPSurgeryError, match="encrypted")
    tampered = bytearray(sealed)
    tampered[-10] ^= 1
    (tmp_path / "t.key").write_bytes(bytes(tampered))
    refused(tmp_path, tmp_path / "t.key", passphrase="correct horse", match="altered")
    unlock_folder(tmp_path / "locked", tmp_path / "k.key", tmp_path / "out", passphrase="correct horse")
    assert identical(type(model).from_pretrained(tmp_path / "out"), original)
    with pytest.raises(MLPSurgeryError, match="empty"):
        seal(b"x", "")


def test_lock_refuses_to_overwrite_or_to_put_the_key_in_the_handout(tmp_path):
    model = tiny_model("llama")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "f").write_text("x")
    with pytest.raises(MLPSurgeryError, match="not empty"):
        lock_folder(model, tmp_path / "busy", tmp_path / "k.key", CoreLockerConfig())
    with pytest.raises(MLPSurgeryError, match="inside the locked folder"):
        lock_folder(model, tmp_path / "new", tmp_path / "new" / "k.key", CoreLockerConfig())
    assert identical(model, state(tiny_model("llama"))) and not (tmp_path / "k.key").exists()


# ---- granular utility control -------------------------------------------------------------------------

def digits_mlp():
    """An MLP trained on scikit-learn's digits (offline): a real classifier in a few seconds of CPU."""
    from sklearn.datasets import load_digits

    from mlpsurgery.train import FitConfig, fit, step_rng, trainable

    d = load_digits()
    x, y = torch.tensor(d.data, dtype=torch.float32) / 16, torch.tensor(d.target)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))

    def loss(step):
        idx = torch.randint(0, 1400, (64,), generator=step_rng(0, step))
        return nn.functional.cross_entropy(model(x[idx]), y[idx])

    fit(trainable(model), loss, FitConfig(steps=200, lr=3e-3), progress=False)

    def acc(m):
        with torch.no_grad():
            return float((m(x[1400:]).argmax(-1) == y[1400:]).float().mean())

    return model.eval(), Utility(acc, "accuracy", True, "digits", 0.1)


def test_bisection_reaches_the_target_and_leaves_the_model_alone():
    model, utility = digits_mlp()
    original = state(model)
    assert utility(model) > 0.8
    search = find_ratio(model, CoreLockerConfig(), utility, target=0.6, tolerance=0.05, progress=False)
    assert identical(model, original)
    assert search.within_tolerance and abs(search.utility - 0.6) <= 0.05 and 0 < search.ratio < 0.5
    assert [c["ratio"] for c in search.curve] == sorted(c["ratio"] for c in search.curve)
    # locking at the found ratio gives the measured utility
    lock_key(model, CoreLockerConfig(ratio=search.ratio), search.ranking)
    assert utility(model) == search.utility
    with pytest.raises(MLPSurgeryError, match="beyond"):
        find_ratio(model, CoreLockerConfig(), utility, target=1.5, progress=False)


def test_curve_falls_and_pruning_attack_measures_a_copy():
    model, utility = digits_mlp()
    original = state(model)
    curve = utility_curve(model, CoreLockerConfig(), [0.0, 0.01, 0.45], utility, progress=False)
    assert curve[0]["accuracy"] > 0.8 > curve[0]["accuracy"] - 0.2 > curve[-1]["accuracy"] and identical(model, original)
    r = attack_prune(model, 0.4, utility)
    assert r["achieved_sparsity"] == pytest.approx(0.4, abs=0.01) and identical(model, original)


# ---- the command line ---------------------------------------------------------------------------------

def run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_lock_unlock_encrypted(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("MLPSURGERY_PASSPHRASE", "open sesame")
    code, out, err = run(capsys, "lock", "key", "tiny:gpt2", "--out", str(tmp_path / "locked"), "--key",
                         str(tmp_path / "k.key"), "--ratio", "0.05", "--unit", "neuron", "--encrypt", "--json")
    assert code == 0, err
    r = json.loads(out)
    assert r["encrypted"] and r["key_bytes"] == os.path.getsize(tmp_path / "k.key") and r["units_extracted"] == 6
    code, out, err = run(capsys, "unlock", str(tmp_path / "locked"), "--key", str(tmp_path / "k.key"), "--out",
                         str(tmp_path / "out"), "--json")
    assert code == 0 and json.loads(out)["check"] == "authenticated", err
    assert identical(type(tiny_model("gpt2")).from_pretrained(tmp_path / "out"), state(tiny_model("gpt2")))
    monkeypatch.setenv("MLPSURGERY_PASSPHRASE", "open says me")
    code, out, err = run(capsys, "unlock", str(tmp_path / "locked"), "--key", str(tmp_path / "k.key"), "--out",
                         str(tmp_path / "out2"))
    assert code == 2 and "wrong passphrase" in err and not (tmp_path / "out2").exists()


def test_cli_needs_a_passphrase_and_one_of_ratio_or_target(capsys, tmp_path, monkeypatch):
    monkeypatch.delenv("MLPSURGERY_PASSPHRASE", raising=False)
    code, _, err = run(capsys, "lock", "key", "tiny:llama", "--out", str(tmp_path / "l"), "--key",
                       str(tmp_path / "k"), "--ratio", "0.1", "--encrypt")
    assert code == 2 and "MLPSURGERY_PASSPHRASE" in err and not any(tmp_path.iterdir())
    code, _, err = run(capsys, "lock", "key", "tiny:llama", "--out", str(tmp_path / "l"), "--key", str(tmp_path / "k"))
    assert code == 2 and "one of the arguments --ratio --target-utility is required" in err and len(err.splitlines()) == 1


def test_cli_measure_and_attack_on_a_tiny_lm(capsys, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("Emma Woodhouse, handsome, clever, and rich, with a comfortable home and happy disposition. " * 30)
    code, out, err = run(capsys, "lock", "key", "tiny:llama", "--out", str(tmp_path / "l"), "--key",
                         str(tmp_path / "k"), "--ratio", "0.3", "--measure", "--data", str(text), "--json")
    assert code == 0, err
    r = json.loads(out)
    assert r["utility"]["metric"] == "perplexity" and r["utility"]["locked"] != r["utility"]["original"]
    code, out, err = run(capsys, "attack", "key", str(tmp_path / "l"), "--data", str(text), "--finetune", "0.5",
                         "--trials", "1", "--prune", "0.2", "--block-len", "64", "--batch-size", "2", "--epochs", "1",
                         "--json")
    assert code == 0, err
    a = json.loads(out)
    assert [x["attack"] for x in a["rows"]] == ["fine-tune", "prune"] and a["locked"] == pytest.approx(
        r["utility"]["locked"])
    n_bytes = len(text.read_bytes())  # the tiny models' tokenizer is one token per byte
    blocks = (n_bytes - round(0.1 * n_bytes)) // 64  # the training split: all but the last 10%
    assert a["rows"][0]["runs"][0]["steps"] == -(-round(0.5 * blocks) // 2)  # half the blocks, batches of 2


# ---- a real model -----------------------------------------------------------------------------------------

@pytest.mark.realmodel
def test_minilm_l1_key_breaks_it_random_does_not_and_unlock_is_exact(minilm, tmp_path):
    import copy

    from mlpsurgery.measure.accuracy import embed

    texts = ["Oil prices rose sharply after the OPEC meeting.", "The company reported higher quarterly earnings.",
             "Wheat exports fell on weak demand from Asia.", "The central bank cut its interest rate by half a point."]
    ref = embed(minilm.model, minilm.tokenizer, texts, progress=False)

    def similarity(model):
        return float(nn.functional.cosine_similarity(embed(model, minilm.tokenizer, texts, progress=False), ref).mean())

    locked, rnd = copy.deepcopy(minilm.model), copy.deepcopy(minilm.model)
    key = lock_key(locked, CoreLockerConfig(ratio=0.05))
    lock_key(rnd, CoreLockerConfig(ratio=0.05, indicator="random"))
    assert similarity(rnd) > 0.8 > 0.6 > similarity(locked)  # measured: 0.88 and 0.42
    unlock_key(locked, roundtrip(key, locked, tmp_path, passphrase="pw"))
    assert identical(locked, minilm.model.state_dict())


def test_extraction_positions_are_sorted_and_unique_with_or_without_the_fast_path():
    # take() skips torch.unique for one strictly increasing part (a weight unit's tensor); every other case goes
    # through unique: the result must always be what unique of the concatenation gives.
    from mlpsurgery.methods.corelocker import ranking as rk

    g = torch.Generator().manual_seed(0)
    cases = [[torch.arange(0, 50, 3)], [torch.tensor([5, 1, 9])], [torch.tensor([1, 1, 2])], [torch.tensor([7])],
             [torch.zeros(0, dtype=torch.long)], [torch.randint(0, 40, (30,), generator=g) for _ in range(3)],
             [torch.arange(10), torch.arange(5, 15)]]
    for parts in cases:
        got = rk._sorted_unique([p.long() for p in parts])
        assert torch.equal(got, torch.unique(torch.cat(parts).long())), parts


def test_a_ratio_that_selects_no_unit_is_refused_before_anything_is_written(tmp_path):
    """4 heads x 2 layers at 5%: round(0.4) = 0 units. A key that holds nothing locks nothing: refused, whole
    model or layer by layer, with the smallest ratio that selects one."""
    from mlpsurgery.methods.corelocker.layerwise import lock_layerwise

    model = tiny_model("llama")
    cfg = CoreLockerConfig(ratio=0.05, unit="head")
    with pytest.raises(MLPSurgeryError, match="selects none of the 8 head units.*at least 0.125"):
        lock_folder(model, tmp_path / "out", tmp_path / "k.key", cfg, progress=False)
    model.save_pretrained(tmp_path / "src")
    with pytest.raises(MLPSurgeryError, match="selects none"):
        lock_layerwise(tmp_path / "src", tmp_path / "out", tmp_path / "k.key", cfg, progress=False)
    layer = CoreLockerConfig(ratio=0.005, unit="neuron", scope="layer")  # 64 neurons a layer: round(0.32) = 0
    with pytest.raises(MLPSurgeryError, match="of the largest group"):
        lock_folder(tiny_model("llama"), tmp_path / "out", tmp_path / "k.key", layer, progress=False)
    assert not (tmp_path / "out").exists() and not (tmp_path / "k.key").exists()
