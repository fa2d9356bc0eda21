"""Training split by layer over gloo ranks (`fit(partition=...)`: each rank its own parameters and its own terms of
a loss that is a sum over them) computes what one process computes: the same losses and global gradient norms step
by step, the same trained weights; checkpoints hold every rank's tensors in one process's order, so a run stopped
under two ranks resumes in one and the other way round. Fusion's layer-wise tuning runs this way under torchrun:
`fuse` over two ranks writes the folder one process writes, each rank holding half of the tuning's memory."""

import contextlib
import io
import json
import os

import pytest
import torch
from torch import nn

from mlpsurgery import parallel
from mlpsurgery.io import load
from mlpsurgery.methods.fusion import FusionConfig, fuse
from mlpsurgery.tiny import byte_tokenizer, tiny_model
from mlpsurgery.train import FitConfig, fit, step_rng

from gloo import ranks, run_ranks

pytestmark = pytest.mark.distributed

TEXT = "It was the best of times, it was the worst of times, it was the age of wisdom, the age of foolishness. " * 30
STEPS = 6


# ---- fit itself: three independent regressions, rank 0 trains a and c, rank 1 trains b -------------------------

def _problem():
    torch.manual_seed(0)
    nets = nn.ModuleDict({k: nn.Linear(6, 6) for k in "abc"})
    g = torch.Generator().manual_seed(1)
    data = {k: (torch.randn(40, 6, generator=g), torch.randn(40, 6, generator=g)) for k in "abc"}
    order = [f"{k}.{n}" for k in "abc" for n in ("weight", "bias")]
    return nets, data, order


def _run(ckpt=None, own="abc", stop_at=None, partition=True):
    nets, data, order = _problem()
    params = {f"{k}.{n}": p for k in own for n, p in nets[k].named_parameters()}

    def loss_fn(step):
        if stop_at is not None and step == stop_at:
            raise KeyboardInterrupt
        idx = torch.randint(0, 40, (8,), generator=step_rng(0, step))
        return sum((nets[k](data[k][0][idx]) - data[k][1][idx]).pow(2).mean() for k in own)

    cfg = FitConfig(steps=STEPS, lr=3e-2, clip=0.3, checkpoint_every=2)  # the clip acts on most steps
    res = fit(params, loss_fn, cfg, checkpoint_dir=ckpt, progress=False, partition=order if partition else None)
    return nets, res


def _two_ranks(tmp_path, out: str, ckpt=None, stop_at=None):
    def target():
        parallel.init("cpu")
        own = "ac" if parallel.world()[0] == 0 else "b"
        try:
            nets, res = _run(ckpt, own, stop_at)
        except KeyboardInterrupt:
            return 0
        torch.save({"history": res.history, "state": {k: v for k, v in nets.state_dict().items() if k[0] in own},
                    "memory": res.memory}, f"{out}.{parallel.world()[0]}")
        return 0

    results = run_ranks(tmp_path, target)
    assert all(c == 0 for c, _ in results), results[0][1][-3000:] + results[1][1][-3000:]


def _same(ref_nets, ref_res, history, state):
    for a, b in zip(ref_res.history, history, strict=True):
        assert a["step"] == b["step"] and abs(a["loss"] - b["loss"]) < 1e-5 * max(1, a["loss"])
        assert abs(a["grad_norm"] - b["grad_norm"]) < 1e-5 * a["grad_norm"]
    ref = ref_nets.state_dict()
    for name, t in state.items():
        torch.testing.assert_close(t, ref[name], rtol=1e-5, atol=1e-6, msg=name)


def test_fit_split_by_layer_equals_one_process_step_by_step(tmp_path):
    nets, res = _run()
    assert sum(h["grad_norm"] > 0.3 for h in res.history) >= 3  # the global clip took part
    _two_ranks(tmp_path, str(tmp_path / "two"))
    r0, r1 = torch.load(tmp_path / "two.0"), torch.load(tmp_path / "two.1")
    untimed = [[{k: v for k, v in h.items() if k != "time_s"} for h in r["history"]] for r in (r0, r1)]
    assert untimed[0] == untimed[1]  # both ranks log the total
    _same(nets, res, r0["history"], {**r0["state"], **r1["state"]})
    assert r0["memory"]["world_size"] == 2
    assert r0["memory"]["optimizer_bytes"] == 2 * r1["memory"]["optimizer_bytes"] == 2 * r0["memory"]["param_bytes"]
    assert res.memory["param_bytes"] == r0["memory"]["param_bytes"] + r1["memory"]["param_bytes"]


def test_a_split_run_stopped_under_two_ranks_resumes_in_one_process_and_back(tmp_path):
    ref_nets, ref = _run()
    ckpt = str(tmp_path / "ck")
    _two_ranks(tmp_path, str(tmp_path / "unused"), ckpt, stop_at=3)
    assert json.loads(open(os.path.join(ckpt, "state.json")).read())  # the step-2 checkpoint, every rank's tensors
    nets, res = _run(ckpt)
    assert res.resumed_from == 2
    _same(ref_nets, ref, res.history, nets.state_dict())
    # and one process stopped at step 3 (Ctrl-C writes its checkpoint) resumed under two ranks
    other = str(tmp_path / "ck2")
    with pytest.raises(KeyboardInterrupt):
        _run(other, stop_at=3)
    _two_ranks(tmp_path, str(tmp_path / "two"), other)
    r0, r1 = torch.load(tmp_path / "two.0"), torch.load(tmp_path / "two.1")
    assert r0["history"][2]["step"] == 3
    _same(ref_nets, ref, r0["history"], {**r0["state"], **r1["state"]})


def test_a_partition_that_does_not_cover_the_parameters_is_refused(tmp_path):
    from mlpsurgery.errors import MLPSurgeryError

    with pytest.raises(MLPSurgeryError, match="every parameter of the partition"):
        _run(own="ab")  # one process must train all of them

    def target():
        parallel.init("cpu")
        _run(own="a" if parallel.world()[0] == 0 else "a")  # b and c trained by nobody
        return 0

    for code, log in run_ranks(tmp_path, target):
        assert code == 1 and "cover the partition exactly once" in log, log[-2000:]


# ---- fusion's layer-wise tuning under torchrun -------------------------------------------------------------------

def _ids():
    return torch.tensor(byte_tokenizer()(TEXT * 2)["input_ids"][:320]).view(10, 32)


def count_kmeans(monkeypatch, tmp_path):
    """Make every k-means call (in this process and the ranks forked from it) append its rank to a file; returns
    a reader of the calls per rank."""
    from mlpsurgery.methods.fusion import compress

    real, log = compress.kmeans, tmp_path / "kmeans.calls"

    def kmeans(*args, **kwargs):
        with open(log, "a") as f:
            f.write(os.environ.get("RANK", "-") + "\n")
        return real(*args, **kwargs)

    monkeypatch.setattr(compress, "kmeans", kmeans)

    def calls() -> dict[str, int]:
        got = log.read_text().split() if log.exists() else []
        log.unlink(missing_ok=True)
        return {r: got.count(r) for r in sorted(set(got))}
    return calls


CASES = [("llama", dict(method="fusion")), ("gpt2", dict(method="neuron", importance="activation")),
         ("gpt2", dict(method="magnitude")), ("gpt2", dict(method="cluster")), ("llama", dict(method="sketch")),
         ("bert", dict(method="mmd", mmd_steps=3)), ("llama", dict(method="random"))]


@pytest.mark.parametrize("arch,kw", CASES, ids=["llama-fusion", "gpt2-neuron-activation", "gpt2-magnitude",
                                                "gpt2-cluster", "llama-sketch", "bert-mmd", "llama-random"])
def test_fuse_tuning_split_over_two_ranks_equals_one_process(tmp_path, monkeypatch, arch, kw):
    """Each rank compresses and tunes its own layers only (k-means too), drawing for the others only what one process
    draws for them: every layer gets one process's random draws (sketches, MMD starts, random neurons, k-means
    seeds), so rank 0 gathers one process's model."""
    layers = {"n_layer": 3} if arch == "gpt2" else {"num_hidden_layers": 3}  # rank 0: layers 0 and 2, rank 1: 1
    cfg = FusionConfig(width=16, layers="all", tune_steps=8, tune_lr=3e-3, tune_batch=64, **kw)
    calls = count_kmeans(monkeypatch, tmp_path)
    model = tiny_model(arch, **layers)
    ref = fuse(model, cfg, tune_data=_ids(), progress=False)
    clustered = cfg.method in ("fusion", "cluster")
    assert calls() == ({"-": 3} if clustered else {})
    out = tmp_path / "two.pt"

    def target():
        from mlpsurgery.sites import find_sites

        parallel.init("cpu")
        m = tiny_model(arch, **layers)
        rep = fuse(m, cfg, tune_data=_ids(), progress=False)
        if parallel.world()[0] == 0:
            torch.save({"report": rep, "state": m.state_dict()}, out)
        else:  # rank 1 gave back the memory of the MLPs it left to rank 0
            mlp = find_sites(m).mlp
            assert all(p.is_meta for i in (0, 2) for p in mlp[i].parameters())
            assert not any(p.is_meta for p in mlp[1].parameters())
        return 0

    results = run_ranks(tmp_path, target)
    assert all(c == 0 for c, _ in results), results[0][1][-3000:] + results[1][1][-3000:]
    assert calls() == ({"0": 2, "1": 1} if clustered else {})  # each layer clustered once, by its owner
    two = torch.load(out, weights_only=False)
    rep = two["report"]
    assert rep["world_size"] == 2 and rep["layers"] == ref["layers"] == [0, 1, 2]
    for key in ("mse_before", "mse_after"):
        assert rep["tuning"][key] == pytest.approx(ref["tuning"][key], rel=1e-5)
    assert rep["tuning"]["mse_after"] < rep["tuning"]["mse_before"]
    for a, b in zip(ref["sites"], rep["sites"], strict=True):
        for key in ("error_rel", "error_rel_tuned", "nonzero_after"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), (a["layer"], key)
        assert {k: v for k, v in b.items() if not k.startswith("error")} == \
            {k: v for k, v in a.items() if not k.startswith("error")}  # (the owner's row: counts, k-means inertia)
    for name, t in model.state_dict().items():
        torch.testing.assert_close(two["state"][name], t, rtol=1e-4, atol=2e-6, msg=name)
    # each rank held its own layers' captured rows and AdamW moments only
    mem, one = rep["tuning"]["memory"], ref["tuning"]["memory"]
    assert mem["world_size"] == 2 and one["world_size"] == 1
    for key in ("captured_bytes", "optimizer_bytes"):
        assert mem[key] == pytest.approx(one[key] * 2 / 3, rel=0.01), key


def fuse_args(tmp_path, out: str, *extra: str) -> list[str]:
    (tmp_path / "t.txt").write_text(TEXT)
    return ["fuse", "tiny:llama", "--out", out, "--width", "16", "--layers", "all", "--tune-data",
            str(tmp_path / "t.txt"), "--tune-blocks", "8", "--block-len", "32", "--tune-steps", "5", "--json",
            "--data-free", "--quiet", *extra]  # (under torchrun fuse is data-free: one process's reference too)


def test_cli_fuse_over_two_ranks_saves_what_one_process_saves_and_resumes_its_checkpoint(tmp_path):
    from mlpsurgery.cli import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(fuse_args(tmp_path, str(tmp_path / "one"))) == 0
    one = json.loads(buf.getvalue())
    ckpt = str(tmp_path / "ck")
    (c0, log0), (c1, log1) = ranks(tmp_path, fuse_args(tmp_path, str(tmp_path / "two"), "--checkpoint-dir", ckpt))
    assert (c0, c1) == (0, 0), log0[-3000:] + log1[-3000:]
    r0 = json.loads(log0[log0.index("{"):log0.rindex("}") + 1])
    assert r0["world_size"] == 2 and '"rank": 1' in log1 and not os.path.exists(str(tmp_path / "two") + ".0")
    assert r0["tuning"]["mse_after"] == pytest.approx(one["tuning"]["mse_after"], rel=1e-5)
    a, b = load(str(tmp_path / "one")), load(str(tmp_path / "two"))
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=1e-4, atol=2e-6, msg=name)
    # the two ranks' finished checkpoint is one process's: rerun as one process, it resumes at the end
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(fuse_args(tmp_path, str(tmp_path / "three"), "--checkpoint-dir", ckpt)) == 0
    again = load(str(tmp_path / "three"))
    for (name, p), q in zip(b.named_parameters(), again.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=1e-4, atol=2e-6, msg=name)


@pytest.mark.parametrize("drop,extra,message", [
    (True, [], "give --tune-data"),
    (False, ["--layers", "1"], "2 ranks for 1 compressed layers"),
])
def test_bad_fuse_launches_are_refused_on_every_rank(tmp_path, drop, extra, message):
    out = str(tmp_path / "two")
    argv = fuse_args(tmp_path, out, *extra)
    if drop:
        i = argv.index("--tune-data")
        argv = argv[:i] + argv[i + 2:]
    for code, log in ranks(tmp_path, argv):
        assert code == 2 and message in log, log[-2000:]
    assert not os.path.exists(out)


def test_a_rank_that_finds_no_checkpoint_is_refused_not_run_out_of_step(tmp_path):
    """Ranks on file systems of their own: rank 0 finds the checkpoint, rank 1 does not; both refuse."""
    ckpt = str(tmp_path / "ck")
    with pytest.raises(KeyboardInterrupt):
        _run(ckpt, stop_at=3)

    def target():
        parallel.init("cpu")
        rank = parallel.world()[0]
        _run(ckpt if rank == 0 else str(tmp_path / "elsewhere"), "ac" if rank == 0 else "b")
        return 0

    for code, log in run_ranks(tmp_path, target):
        assert code == 1 and "different checkpoints (the step to resume from)" in log, log[-2000:]


def test_cli_fuse_layerwise_over_two_ranks_writes_what_one_process_writes(tmp_path, monkeypatch):
    """`torchrun ... fuse --layerwise --tune-data`: every rank reads one layer at a time, compresses (k-means) and
    tunes its share of the chosen layers; rank 0 takes the others' compressed, tuned layers and writes the folder.
    Each layer is tuned alone either way, so the folder is one process's `fuse --layerwise` bit for bit (tensors,
    manifest; the report's errors within float summation); neither rank loads the model whole. Refused on every rank as the whole-model
    split refuses it: more ranks than compressed layers."""
    from conftest import assert_same_folders, saved_checkpoint
    from mlpsurgery.cli import main

    src = saved_checkpoint(tmp_path, "llama")
    byte_tokenizer().save_pretrained(src)

    def argv(out, *extra):
        a = fuse_args(tmp_path, str(tmp_path / out), "--layerwise", *extra)
        a[1] = str(src)  # a checkpoint with files, which the layer-by-layer mode reads
        return a

    calls = count_kmeans(monkeypatch, tmp_path)
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(argv("one")) == 0
    one = json.loads(buf.getvalue())
    n = len(one["layers"])
    assert calls() == {"-": n}
    # the tune stream between layers on disk (as past --max-memory): each rank spills into a folder of its own (they
    # wrote and removed the same file names in one folder before)
    from mlpsurgery import layerwise

    monkeypatch.setattr(layerwise.LayerStream, "check_memory", lambda self, *args, **kwargs: True)
    (c0, log0), (c1, log1) = ranks(tmp_path, argv("two"))
    monkeypatch.undo()
    assert (c0, c1) == (0, 0), log0[-3000:] + log1[-3000:]
    assert calls() == {"0": (n + 1) // 2, "1": n // 2}  # each layer clustered once, by its owner
    r0 = json.loads(log0[log0.index("{"):log0.rindex("}") + 1])
    r1 = json.loads(log1[log1.index("{"):log1.rindex("}") + 1])
    assert r0["world_size"] == 2 and r1["rank"] == 1 and r1["layers"] == [i for i in one["layers"] if i % 2]
    assert r0["activations_on_disk"]
    assert_same_folders(tmp_path / "one", tmp_path / "two")
    for a, b in zip(r0["sites"], one["sites"], strict=True):  # (floats summed with other thread counts: approx)
        assert a["layer"] == b["layer"] and a["error_rel_tuned"] == pytest.approx(b["error_rel_tuned"], rel=1e-6)
    assert r0["tuning"]["mse_after"] == pytest.approx(one["tuning"]["mse_after"], rel=1e-6)
    assert not (tmp_path / "two.work").exists()  # every rank's captures, then the folder, removed
    for code, log in ranks(tmp_path, argv("three", "--layers", "1")):
        assert code == 2 and "2 ranks for 1 compressed layers" in log, log[-2000:]
    assert not (tmp_path / "three").exists()
