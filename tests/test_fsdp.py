"""Sharded training (FSDP2 over gloo ranks, mlpsurgery.parallel) computes what one process computes: the same
losses and gradient norms step by step, the same trained weights, each rank holding about half of the parameter,
gradient and optimizer bytes; checkpoints hold full tensors, so a run stopped under two ranks resumes in one; the
model comes back plain (saved and reloaded as the stock class); bad launches are refused on every rank."""

import contextlib
import io
import json
import os

import pytest
import torch

from mlpsurgery import parallel
from mlpsurgery.io import load
from mlpsurgery.methods import nsn
from mlpsurgery.tiny import tiny_model
from mlpsurgery.train import FitConfig, fit, lm_loss, trainable

from gloo import ranks, run_ranks

pytestmark = pytest.mark.distributed

TEXT = "It was the best of times, it was the worst of times, it was the age of wisdom, the age of foolishness. " * 30


def _json(log: str) -> dict:
    return json.loads(log[log.index("{"):log.rindex("}") + 1])


def nest_args(tmp_path, arch: str, out: str, *extra: str) -> list[str]:
    data = tmp_path / "t.txt"
    if arch == "bert":  # an encoder trains a classifier head on labelled text
        data = tmp_path / "d.jsonl"
        data.write_text("\n".join(json.dumps({"text": ("good " if i % 2 else "bad ") * (1 + i % 4),
                                              "label": "pos" if i % 2 else "neg"}) for i in range(40)))
    else:
        data.write_text(TEXT)
    return ["nest", f"tiny:{arch}", "--out", out, "--train-steps", "4", "--batch-size", "4", "--block-len", "32",
            "--max-len", "16", "--lr", "3e-3", "--data", str(data), "--data-free", "--json", "--quiet", *extra]
    # (--data-free: under torchrun nest starts from the plain SVD, so one process's reference does too)


@pytest.mark.parametrize("arch", ["llama", "gpt2", "bert"])  # untied; tied embeddings (Conv1D); an encoder
def test_nest_sharded_over_two_ranks_equals_one_process(tmp_path, arch):
    from mlpsurgery.cli import main

    one = str(tmp_path / "one")
    assert main(nest_args(tmp_path, arch, one)) == 0
    two = str(tmp_path / "two")
    (c0, log0), (c1, log1) = ranks(tmp_path, nest_args(tmp_path, arch, two))
    assert (c0, c1) == (0, 0), log0[-3000:] + log1[-3000:]
    r0, r1 = _json(log0), _json(log1)
    assert r1["rank"] == 1 and "rank" not in r0  # rank 0 saves and reports
    a, b = load(one), load(two)
    assert type(b).__name__ == type(a).__name__ and not parallel.is_sharded(b)
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-4, atol=2e-6, msg=name)
    start = tiny_model(arch, task="classifier" if arch == "bert" else "auto")  # SVD: the factors before training
    nsn.nest(start)
    before = {f"{path}.{n}": t for path, m in nsn.nested_linears(start).items() for n, t in m.named_parameters()}
    after = dict(b.named_parameters())
    assert max((after[n] - t).abs().max().item() for n, t in before.items()) > 1e-3  # the training moved them
    assert [h["method"] for h in b._mlpsurgery_history] == [h["method"] for h in a._mlpsurgery_history]
    assert not os.path.exists(two + ".ckpt")  # the checkpoint was removed after the save


def test_nest_reports_the_shards_bytes(tmp_path):
    import contextlib
    import io

    from mlpsurgery.cli import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(nest_args(tmp_path, "llama", str(tmp_path / "one"))) == 0
    one = json.loads(buf.getvalue())["train"]["memory"]
    (c0, log0), (c1, log1) = ranks(tmp_path, nest_args(tmp_path, "llama", str(tmp_path / "two")))
    assert (c0, c1) == (0, 0), log0[-3000:]
    for log in (log0, log1):
        mem = _json(log)["train"]["memory"]
        assert mem["world_size"] == 2 and one["world_size"] == 1
        for key in ("model_param_bytes", "param_bytes", "grad_bytes", "optimizer_bytes"):
            assert 0.45 < mem[key] / one[key] < 0.6, (key, mem[key], one[key])
        assert one["optimizer_bytes"] == 2 * one["param_bytes"] == 2 * one["grad_bytes"]  # AdamW: two moments


def _saved(tmp_path, arch: str) -> str:
    """A tiny model written as a transformers checkpoint (safetensors), so it can be read layer by layer."""
    from mlpsurgery.tiny import byte_tokenizer

    folder = tmp_path / f"{arch}-ckpt"
    tiny_model(arch).save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    return str(folder)


@pytest.mark.parametrize("arch,dtype", [("llama", None), ("gpt2", None), ("llama", "bfloat16")])  # untied; tied
def test_nest_of_a_checkpoint_loads_into_shards_and_equals_one_process(tmp_path, arch, dtype):  # and Conv1D
    """Under torchrun `nest` reads the checkpoint into FSDP shards one layer at a time, nesting each layer while
    it is whole: the trained model, its history and its recorded source equal one process's (in bfloat16 within
    its resolution: the ranks sum in another order)."""
    from mlpsurgery.cli import main
    from mlpsurgery.io import read_manifest

    folder = _saved(tmp_path, arch)
    extra = ["--dtype", dtype] if dtype else []
    argv = lambda out: [folder if a == f"tiny:{arch}" else a for a in nest_args(tmp_path, arch, out, *extra)]  # noqa: E731
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    assert main(argv(one)) == 0
    (c0, log0), (c1, log1) = ranks(tmp_path, argv(two))
    assert (c0, c1) == (0, 0), log0[-3000:] + log1[-3000:]
    r0 = _json(log0)
    assert r0["loaded_into_shards"] and _json(log1)["rank"] == 1
    a, b = load(one), load(two)
    # bfloat16: most entries agree within 5e-4; Adam moves an entry whose tiny gradient rounds to the other sign
    # by up to lr per step the other way, so the bound is steps x lr (4 x 3e-3; measured: one entry of 2,048 at 2.3e-3)
    tol = {"rtol": 1.6e-2, "atol": 1.2e-2} if dtype else {"rtol": 1e-4, "atol": 2e-6}
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert q.dtype == p.dtype == (torch.bfloat16 if dtype else torch.float32)
        torch.testing.assert_close(q, p, **tol, msg=name)
        assert ((q.float() - p.float()).abs() > 1e-3).float().mean() < 0.01, name  # those are rare
    ma, mb = read_manifest(one), read_manifest(two)
    assert mb["source"] == ma["source"] and mb["modules"] == ma["modules"]
    assert [h["method"] for h in mb["history"]] == [h["method"] for h in ma["history"]] == ["nsn", "nsn-train"]


def test_nest_of_a_checkpoint_stopped_under_two_ranks_resumes_in_one_process(tmp_path):
    """The CLI path end to end: a run loaded into shards and stopped after its step-2 checkpoint (streamed, a tensor
    at a time) is resumed by the same command in one process -- which refuses a checkpoint of another model or other
    settings, so the sharded run's identity (model fingerprint) must be the whole model's -- and ends where an
    uninterrupted one-process run ends."""
    import dataclasses

    from mlpsurgery.cli import main

    folder = _saved(tmp_path, "llama")
    argv = lambda out, ck: [folder if a == "tiny:llama" else a for a in nest_args(tmp_path, "llama", out)] + [  # noqa: E731
        "--checkpoint", ck]
    assert main(argv(str(tmp_path / "ref"), str(tmp_path / "ck-ref"))) == 0
    ckpt = str(tmp_path / "ck")

    def stopped():
        import mlpsurgery.methods.nsn.training as training

        real = training.fit

        def fit_then_stop(params, loss_fn, cfg, **kw):
            def loss(step):
                if step == 3:
                    raise SystemExit(7)  # a crash after the step-2 checkpoint
                return loss_fn(step)
            return real(params, loss, dataclasses.replace(cfg, checkpoint_every=2), **kw)

        training.fit = fit_then_stop
        return main(argv(str(tmp_path / "out"), ckpt))

    results = run_ranks(tmp_path, stopped)
    assert all(c == 1 and "SystemExit: 7" in log for c, log in results), results[0][1][-3000:] + results[1][1][-3000:]
    assert json.loads(open(os.path.join(ckpt, "state.json")).read()) and not (tmp_path / "out").exists()
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(argv(str(tmp_path / "out"), ckpt)) == 0
    assert _json(buf.getvalue())["train"]["resumed_from"] == 2
    a, b = load(tmp_path / "ref"), load(tmp_path / "out")
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-4, atol=2e-6, msg=name)


def test_loading_into_shards_holds_half_and_fingerprints_as_the_whole_model(tmp_path):
    """Each rank holds about half of the nested model's parameter bytes after loading; the model's fingerprint
    (what a checkpoint records) is the whole model's, so a run started under two ranks resumes in one; a layer
    that differs between the ranks is refused on every rank."""
    from mlpsurgery.files import model_fingerprint
    from mlpsurgery.models import load_model

    folder = _saved(tmp_path, "llama")
    cfg = nsn.NSNConfig()
    whole = load_model(folder).model
    nsn.nest(whole, cfg)
    want = model_fingerprint(whole)
    full = parallel.local_bytes(whole.parameters())

    def target(skew: bool = False):
        def run():
            parallel.init("cpu")

            def work(model, i):
                nsn.surgery.nest_layer(model, cfg, i)
                if skew and i == 1 and parallel.world()[0] == 1:
                    next(parallel.find_layers(model)[1].parameters()).data.mul_(1.001)

            loaded, stream = parallel.load_sharded(folder, "cpu", work)
            print(json.dumps({"fp": model_fingerprint(loaded.model), "bytes": parallel.local_bytes(
                loaded.model.parameters()), "sharded": parallel.is_sharded(loaded.model), "stream": stream is not None,
                "source": loaded.model._mlpsurgery_source}))
        return run

    results = run_ranks(tmp_path, target())
    assert all(c == 0 for c, _ in results), results[0][1][-3000:] + results[1][1][-3000:]
    for _, log in results:
        r = _json(log)
        assert r["sharded"] and r["stream"] and r["fp"] == want
        assert r["source"] == whole._mlpsurgery_source
        assert 0.4 < r["bytes"] / full < 0.6, (r["bytes"], full)
    results = run_ranks(tmp_path, target(skew=True))
    for code, log in results:
        assert code != 0 and "different weights of layer 1" in log, log[-2000:]


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_a_sharded_model_saves_without_being_gathered_whole_to_the_same_bytes(tmp_path, arch):
    """save_sharded writes each parameter as it is gathered (rank 0 never holds the whole model): the folder is
    byte for byte what one process saves of the same model, module attributes set while sharded (an NSN rank)
    and history recorded while sharded kept; every rank ends with the plain model's structure."""
    from mlpsurgery.io import read_manifest, record, save
    from mlpsurgery.models import load_model

    folder = _saved(tmp_path, arch)
    cfg = nsn.NSNConfig()
    whole = load_model(folder).model
    nsn.nest(whole, cfg)
    nsn.set_rank(whole, 3)
    record(whole, "probe")
    save(whole, tmp_path / "one")

    def run():
        parallel.init("cpu")
        loaded, _ = parallel.load_sharded(folder, "cpu", lambda m, i: nsn.surgery.nest_layer(m, cfg, i))
        model = loaded.model
        record(model, "nsn", {k: v for k, v in vars(cfg).items()}, projections=len(nsn.nested_linears(model)))
        nsn.set_rank(model, 3)
        record(model, "probe")
        parallel.save_sharded(model, tmp_path / "two", inputs=[folder])
        assert not parallel.is_sharded(model) and type(model).__name__ == type(whole).__name__
        assert {m.rank for m in nsn.nested_linears(model).values()} == {3}

    results = run_ranks(tmp_path, run)
    assert all(c == 0 for c, _ in results), results[0][1][-3000:] + results[1][1][-3000:]
    for name in ("model.safetensors", "config.json"):
        assert (tmp_path / "two" / name).read_bytes() == (tmp_path / "one" / name).read_bytes(), name
    one, two = read_manifest(tmp_path / "one"), read_manifest(tmp_path / "two")
    assert two["modules"] == one["modules"] and two["source"] == one["source"]
    assert [h["method"] for h in two["history"]] == ["nsn", "probe"]


def test_a_sharded_save_that_fails_on_rank_0_ends_every_rank_and_writes_nothing(tmp_path):
    from mlpsurgery import tensorfiles

    folder = _saved(tmp_path, "llama")

    def run():
        parallel.init("cpu")
        loaded, _ = parallel.load_sharded(folder, "cpu")
        if parallel.world()[0] == 0:
            def full(self, name, t):
                raise OSError(28, "No space left on device")
            tensorfiles.SafetensorsWriter.write = full
        parallel.save_sharded(loaded.model, tmp_path / "out")

    results = run_ranks(tmp_path, run)
    for code, log in results:
        assert code == 1 and "No space left on device" in log, log[-2000:]
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(("out", ".out"))] == []


@pytest.mark.parametrize("argv_extra,message", [
    (["--batch-size", "3"], "does not split evenly over 2 ranks"),
    (["--train-steps", "0"], "give --train-steps"),
    (["--layerwise"], "already reads a language model's checkpoint into the shards"),
])
def test_bad_launches_are_refused_on_every_rank(tmp_path, argv_extra, message):
    out = str(tmp_path / "two")
    results = ranks(tmp_path, nest_args(tmp_path, "llama", out, *argv_extra))
    for code, log in results:
        assert code == 2 and message in log, log[-2000:]
    assert not os.path.exists(out)


@pytest.mark.parametrize("argv", [
    ["prune", "tiny:llama", "--method", "magnitude", "--sparsity", "0.5"],
    ["compare", "tiny:llama", "--methods", "fusion", "--budgets", "0.5", "--recover-steps", "2"],
    ["lock", "key", "tiny:llama", "--ratio", "0.05", "--key", "k.key"],
])
def test_a_one_process_command_under_torchrun_is_refused_on_every_rank(tmp_path, argv):
    """Each rank would run the whole command and write the same --out: refused, exit 2, nothing written."""
    out = str(tmp_path / "out")
    for code, log in ranks(tmp_path, [*argv, "--out", out]):
        assert code == 2 and "runs as one process" in log and "without torchrun" in log, log[-2000:]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(("out", ".out"))]


# ---- fit itself: step-by-step equality, and a stop under two ranks resumed in one process ---------------

STEPS, BATCH = 6, 4


def _blocks():
    g = torch.Generator().manual_seed(1)
    return torch.randint(3, 200, (16, 24), generator=g)


def _setup():
    torch.manual_seed(0)
    model = tiny_model("llama")
    model.train()
    return model


def _cfg(**kw):
    return FitConfig(steps=STEPS, lr=3e-3, seed=0, clip=0.05, checkpoint_every=2, **kw)  # clip: it acts every step


def _sharded_fit(ckpt: str, out: str, stop_at: int | None = None, setup=None):
    def target():
        parallel.init("cpu")
        model = (setup or _setup)()
        parallel.shard(model)
        base = lm_loss(model, _blocks(), BATCH)

        def loss_fn(step):
            if stop_at is not None and step == stop_at:
                raise KeyboardInterrupt
            return base(step)

        try:
            res = fit(trainable(model), loss_fn, _cfg(), checkpoint_dir=ckpt, progress=False)
        except KeyboardInterrupt:
            return 0
        parallel.unshard(model)
        if parallel.world()[0] == 0:
            torch.save({"history": res.history, "state": model.state_dict(), "from": res.resumed_from}, out)
        return 0

    return target


def test_fit_sharded_equals_one_process_step_by_step(tmp_path):
    model = _setup()
    ref = fit(trainable(model), lm_loss(model, _blocks(), BATCH), _cfg(), progress=False)
    results = run_ranks(tmp_path, _sharded_fit(str(tmp_path / "ck"), str(tmp_path / "two.pt")))
    assert all(c == 0 for c, _ in results), results[0][1][-3000:] + results[1][1][-3000:]
    two = torch.load(tmp_path / "two.pt")
    for a, b in zip(ref.history, two["history"]):
        assert a["step"] == b["step"]
        assert abs(a["loss"] - b["loss"]) < 1e-5 and abs(a["grad_norm"] - b["grad_norm"]) < 1e-5 * a["grad_norm"]
    for name, p in model.state_dict().items():
        torch.testing.assert_close(two["state"][name], p, rtol=1e-4, atol=2e-6, msg=name)


def test_a_run_stopped_under_two_ranks_resumes_in_one_process(tmp_path):
    model = _setup()
    ref = fit(trainable(model), lm_loss(model, _blocks(), BATCH), _cfg(), progress=False)
    ckpt = str(tmp_path / "ck")
    results = run_ranks(tmp_path, _sharded_fit(ckpt, str(tmp_path / "unused.pt"), stop_at=3))
    assert all(c == 0 for c, _ in results), results[0][1][-3000:]
    assert os.path.isfile(os.path.join(ckpt, "state.json"))  # the step-2 checkpoint is there
    again = _setup()
    res = fit(trainable(again), lm_loss(again, _blocks(), BATCH), _cfg(), checkpoint_dir=ckpt, progress=False)
    assert res.resumed_from == 2
    for a, b in zip(ref.history, res.history):
        assert abs(a["loss"] - b["loss"]) < 1e-5
    for (name, p), q in zip(model.named_parameters(), again.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-4, atol=2e-6, msg=name)


# ---- DLR-Lock: phase 1 split by layer over the ranks, phase 2 sharded -----------------------------------


def lock_args(tmp_path, out: str, *extra: str) -> list[str]:
    (tmp_path / "t.txt").write_text(TEXT)
    return ["lock", "dlr", "tiny:llama", "--out", out, "--rank", "4", "--calib-blocks", "8", "--block-len", "32",
            "--phase1-steps", "6", "--phase1-tokens", "64", "--phase1-hard-fraction", "0", "--onpolicy-steps", "3",
            "--no-compile", "--phase2-steps", "4", "--phase2-blocks", "8", "--phase2-batch", "2", "--top-k", "4",
            "--eval-tokens", "256", "--data", str(tmp_path / "t.txt"), "--json", "--quiet", *extra]


def test_a_checkpoint_that_rank_0_cannot_write_ends_every_rank(tmp_path):
    """Sharded checkpoints are gathered a tensor at a time and written by rank 0 as they come; a failure there is
    raised on every rank (no rank left waiting at a collective) and leaves no checkpoint."""
    from mlpsurgery import tensorfiles

    def target():
        parallel.init("cpu")
        if parallel.world()[0] == 0:
            def full(self, name, t):
                raise OSError(28, "No space left on device")
            tensorfiles.SafetensorsWriter.write = full
        model = _setup()
        parallel.shard(model)
        fit(trainable(model), lm_loss(model, _blocks(), BATCH), _cfg(), checkpoint_dir=str(tmp_path / "ck"),
            progress=False)

    results = run_ranks(tmp_path, target)
    assert results[0][0] == 1 and "No space left on device" in results[0][1], results[0][1][-2000:]
    assert results[1][0] == 1 and "rank 0 could not write the checkpoint" in results[1][1], results[1][1][-2000:]
    assert not (tmp_path / "ck").exists()


def test_lock_dlr_over_two_ranks_equals_one_process(tmp_path):
    import contextlib
    import io

    from mlpsurgery.cli import main
    from mlpsurgery.modules.dlr import DLRNet
    from mlpsurgery.sites import find_sites

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(lock_args(tmp_path, str(tmp_path / "one"))) == 0
    one = json.loads(buf.getvalue())
    work = tmp_path / "work"
    (c0, log0), (c1, log1) = ranks(tmp_path, lock_args(tmp_path, str(tmp_path / "two"), "--workdir", str(work)))
    assert (c0, c1) == (0, 0), log0[-3000:] + log1[-3000:]
    two = _json(log0)
    assert two["world_size"] == 2 and _json(log1)["rank"] == 1
    # each rank distilled its share of the layers, in a folder of its own
    for r, layers in ((0, [0]), (1, [1])):
        stage = json.loads((work / f"rank{r}-of-2" / "phase1.stage.json").read_text())
        assert stage["done"] and stage["settings"]["layers"] == layers
    rep1, rep2 = one["report"], two["report"]
    assert rep2["layers"] == rep1["layers"] == [0, 1]
    for key in ("phase1_relative_error", "onpolicy_relative_error", "phase2_relative_error"):
        for layer, err in rep1[key].items():
            assert abs(rep2[key][layer] - err) < 1e-4 * max(1.0, err), (key, layer)
    a, b = load(str(tmp_path / "one")), load(str(tmp_path / "two"))
    assert all(isinstance(s.module, DLRNet) for s in find_sites(b).mlp)
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-3, atol=1e-5, msg=name)
    assert abs(two["heldout_ratio"] - one["heldout_ratio"]) < 1e-3


@pytest.mark.parametrize("dtype", [None, "bfloat16"])
def test_phase2_only_over_two_ranks_equals_one_process(tmp_path, dtype):
    """`lock dlr LOCKED --phase2-only` (phase 2 alone on a folder locked before, layer by layer) under torchrun reads
    the locked folder and its original checkpoint into FSDP shards a layer at a time (each rank holds about half of
    the locked model), trains phase 2 sharded and saves it a tensor at a time: the same lock as one process's, each
    rank's teacher targets in a folder of its own. In bfloat16 the original is read in the float32 it was locked
    from (its fingerprint is checked on that) and held in bfloat16, as one process does it."""
    import contextlib
    import io

    from mlpsurgery.cli import main
    from mlpsurgery.io import read_manifest

    ckpt = _saved(tmp_path, "llama")
    with contextlib.redirect_stdout(io.StringIO()):
        assert main([ckpt if a == "tiny:llama" else a
                     for a in lock_args(tmp_path, str(tmp_path / "p1"), "--phase2-steps", "0")]) == 0
    assert read_manifest(tmp_path / "p1")["history"][-1]["provenance"]["layerwise"]  # (the default in one process)
    p2 = ["lock", "dlr", str(tmp_path / "p1"), "--phase2-only", "--phase2-steps", "4", "--phase2-blocks", "8",
          "--phase2-batch", "2", "--top-k", "4", "--block-len", "32", "--eval-tokens", "256",
          "--data", str(tmp_path / "t.txt"), "--original", ckpt, "--json", "--quiet",
          *(["--dtype", dtype] if dtype else [])]
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main([*p2, "--out", str(tmp_path / "one")]) == 0
    one = json.loads(buf.getvalue())
    work = tmp_path / "work"
    (c0, log0), (c1, log1) = ranks(tmp_path, [*p2, "--out", str(tmp_path / "two"), "--workdir", str(work)])
    assert (c0, c1) == (0, 0), log0[-3000:] + log1[-3000:]
    two = _json(log0)
    assert two["world_size"] == 2 and two["phase2_only"] and (work / "rank1-of-2" / "teacher.stage.json").is_file()
    a, b = load(str(tmp_path / "one")), load(str(tmp_path / "two"))
    whole = parallel.local_bytes(a.parameters())
    assert two["loaded_into_shards"] and 0.4 < two["loaded_param_bytes"] / whole < 0.6
    assert 0.4 < _json(log1)["loaded_param_bytes"] / whole < 0.6
    # bfloat16: the ranks sum in another order; the 4 steps move an entry by at most 4 x lr (3e-4) either way
    tol = {"rtol": 1.6e-2, "atol": 2e-3} if dtype else {"rtol": 1e-3, "atol": 1e-5}
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert q.dtype == p.dtype == (torch.bfloat16 if dtype else torch.float32)
        torch.testing.assert_close(q, p, **tol, msg=name)
    assert abs(two["heldout_ratio"] - one["heldout_ratio"]) < (2e-2 if dtype else 1e-3)
    assert two["perplexity"]["original"] == pytest.approx(one["perplexity"]["original"], rel=1e-5)
    ma, mb = read_manifest(tmp_path / "one"), read_manifest(tmp_path / "two")
    assert mb["source"] == ma["source"] and mb["modules"] == ma["modules"]
    assert [h["method"] for h in mb["history"]] == [h["method"] for h in ma["history"]]
    assert [h["loss"] for h in two["report"]["phase2_history"]] == pytest.approx(
        [h["loss"] for h in one["report"]["phase2_history"]], rel=2e-2 if dtype else 1e-3, abs=1e-5)


def _same_lock(a, b):
    """Two locked folders hold the same tensors and manifest, but for the distillation's seconds."""
    from conftest import assert_same_folders
    from mlpsurgery.io import read_manifest

    assert_same_folders(a, b, keys=("source", "dtype", "model_class", "modules"))
    ha, hb = (read_manifest(d)["history"] for d in (a, b))
    for h in ha + hb:
        h["provenance"].pop("distillation_seconds")
    assert ha == hb


def test_lock_dlr_layerwise_over_two_ranks_writes_what_one_process_writes(tmp_path, monkeypatch):
    """`torchrun ... lock dlr --layerwise`: each rank reads one layer at a time; a first pass distils its share of the
    layers through phase 1 (rank 0 layers 0 and 2, rank 1 layer 1), side by side, the second their on-policy steps
    in layer order, each net sent to every rank for the on-policy stream. Each layer's net is one process's bit for
    bit (the phase-1 folder: tensors and manifest), neither rank holds the model; a rerun resumes every finished
    layer without distilling it again; phase 2 in the same call runs sharded, as `--phase2-only` does. The mode is
    the default under torchrun too (on the CPU, for a checkpoint with files)."""
    import contextlib
    import io

    from conftest import saved_checkpoint
    from mlpsurgery.cli import main
    from mlpsurgery.methods.dlr_lock import layerwise as lw
    from mlpsurgery.tiny import byte_tokenizer

    src = saved_checkpoint(tmp_path, "llama", num_hidden_layers=3)
    byte_tokenizer().save_pretrained(src)

    def argv(out, *extra, flag=("--layerwise",)):
        a = lock_args(tmp_path, str(tmp_path / out), *flag, *extra)
        a[2] = str(src)
        return a

    p1 = ("--phase2-steps", "0")
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(argv("one", *p1)) == 0
    one = json.loads(buf.getvalue())
    work = tmp_path / "work"
    # the activations between layers on disk (as past --max-memory): each rank spills into its own folder
    monkeypatch.setattr(lw.LayerStream, "check_memory", lambda self, *args, **kwargs: True)
    (c0, log0), (c1, log1) = ranks(tmp_path, argv("two", *p1, "--workdir", str(work)))
    assert (c0, c1) == (0, 0), log0[-3000:] + log1[-3000:]
    assert all((work / f"rank{r}-of-2" / "spill").is_dir() for r in (0, 1)) and not (work / "spill").exists()
    monkeypatch.undo()
    two, r1 = _json(log0), _json(log1)
    assert two["activations_on_disk"]
    assert two["world_size"] == 2 and r1["rank"] == 1 and r1["layers"] == [1] and two["layerwise"]
    _same_lock(tmp_path / "one", tmp_path / "two")
    for key in ("phase1_relative_error", "onpolicy_start_error", "onpolicy_relative_error"):
        assert two["report"][key] == pytest.approx(one["report"][key], rel=1e-6), key
    assert two["report"]["layers"] == [0, 1, 2]
    # each rank kept its own layers (their nets and reports) in a folder of its own
    for r, layers in ((0, [0, 2]), (1, [1])):
        kept = sorted(p.name for p in (work / f"rank{r}-of-2").glob("layer*"))
        assert kept == [f"layer{i:03d}" for i in layers]
        assert all(sorted(q.name for q in (work / f"rank{r}-of-2" / n).iterdir()) == [lw.LAYER_REPORT, lw.LAYER_NET]
                   for n in kept)
    # the rerun (the ranks forked from this process) distils no layer again and writes the same folder
    monkeypatch.setattr(lw, "phase1", lambda *a, **kw: (_ for _ in ()).throw(AssertionError("distilled again")))
    for code, log in ranks(tmp_path, argv("three", *p1, "--workdir", str(work))):
        assert code == 0, log[-3000:]
    _same_lock(tmp_path / "one", tmp_path / "three")
    monkeypatch.undo()
    # the default on the CPU for a checkpoint with files, also under torchrun; phase 2 follows in the same call,
    # sharded over the ranks; the work folder (ours) is removed
    (c0, log0), (c1, log1) = ranks(tmp_path, argv("four", flag=()))
    assert (c0, c1) == (0, 0), log0[-3000:] + log1[-3000:]
    four = _json(log0)
    assert four["world_size"] == 2 and four["layerwise"] and four["report"]["phase2_history"]
    assert set(four["perplexity"]) == {"original", "phase1", "phase2"} and four["heldout_ratio"] > 0
    assert 0.4 < four["loaded_param_bytes"] / parallel.local_bytes(load(str(tmp_path / "one")).parameters()) < 0.6
    assert not (tmp_path / "four.work").exists() and (tmp_path / "four" / "surgery.json").is_file()
    # more ranks than locked layers: refused on every rank before anything is written
    for code, log in ranks(tmp_path, argv("five", "--layers", "0")):
        assert code == 2 and "2 ranks for 1 locked layers" in log, log[-2000:]
    assert not any((tmp_path / n).exists() for n in ("five", "five.work"))


def test_lock_dlr_refuses_more_ranks_than_layers_on_every_rank(tmp_path):
    out = str(tmp_path / "two")
    for code, log in ranks(tmp_path, lock_args(tmp_path, out, "--layers", "0")):
        assert code == 2 and "2 ranks for 1 locked layers" in log, log[-2000:]
    assert not os.path.exists(out)


def test_a_sharded_run_with_dropout_resumed_under_as_many_ranks_replays_the_uninterrupted_one(tmp_path):
    """Each rank draws its own dropout masks; its generator state is checkpointed, so the resumed run is the same."""

    def setup():
        model = tiny_model("gpt2", resid_pdrop=0.3, embd_pdrop=0.3)
        torch.manual_seed(parallel.world()[0])  # the ranks' generators differ, as they may in any launch
        return model.train()

    for args in ((str(tmp_path / "a"), str(tmp_path / "whole.pt")), (str(tmp_path / "b"), "", 3),
                 (str(tmp_path / "b"), str(tmp_path / "resumed.pt"))):
        results = run_ranks(tmp_path, _sharded_fit(*args, setup=setup))
        assert all(c == 0 for c, _ in results), results[0][1][-3000:] + results[1][1][-3000:]
    whole, resumed = torch.load(tmp_path / "whole.pt"), torch.load(tmp_path / "resumed.pt")
    assert resumed["from"] == 2
    for a, b in zip(whole["history"], resumed["history"], strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6), a["step"]
    for name, t in whole["state"].items():
        torch.testing.assert_close(resumed["state"][name], t, rtol=1e-5, atol=1e-7, msg=name)


# ---- DLR-Lock's attack suite: every fine-tuning run sharded over the ranks --------------------------------------


def _blocks_of(n, seed, t=32):
    return torch.randint(0, 256, (n, t), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("arch", ["llama", "gpt2"])  # untied; tied embeddings
def test_shard_copy_builds_the_sharded_copy_a_layer_at_a_time(tmp_path, arch):
    """shard_copy (the attack suite's copy per run): each rank holds about half of the copy, the model it copies is
    left as it was, flags set on the structure (a frozen parameter, gradient checkpointing) are kept, and the copy
    unshards to the model's weights with its ties."""
    def target():
        parallel.init("cpu")
        model = tiny_model(arch)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        frozen = next(n for n, _ in model.named_parameters() if "layers.1." in n or ".h.1." in n)

        def structure(m):
            dict(m.named_parameters())[frozen].requires_grad_(False)
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            return m

        copy_ = parallel.shard_copy(model, "cpu", structure)
        share = parallel.local_bytes(copy_.parameters()) / parallel.local_bytes(model.parameters())
        assert parallel.is_sharded(copy_) and 0.4 < share < 0.65, share
        assert not dict(copy_.named_parameters())[frozen].requires_grad
        copy_(input_ids=torch.randint(3, 100, (1, 8))).logits.sum().backward()  # trains (checkpointed)
        parallel.unshard(copy_)
        assert copy_.is_gradient_checkpointing
        for n, p in model.named_parameters():
            assert torch.equal(p, before[n]) and torch.equal(dict(copy_.named_parameters())[n], p), n
        if arch == "gpt2":
            assert copy_.lm_head.weight is copy_.transformer.wte.weight

    results = run_ranks(tmp_path, target)
    assert all(c == 0 for c, _ in results), results[0][1][-3000:] + results[1][1][-3000:]


def test_attack_suite_sharded_over_two_ranks_equals_one_process(tmp_path):
    from mlpsurgery.methods import dlr_lock as dl

    original, locked = tiny_model("llama"), tiny_model("llama")
    dl.dlr_lock(locked, _blocks_of(16, 0), _blocks_of(8, 1),
                dl.DLRConfig(rank=8, calib_blocks=16, block_len=32, phase1_steps=20, phase1_lr=1e-2,
                             phase1_tokens=128, phase2_steps=0, top_k=8, gradient_checkpointing=False, compile=False),
                tmp_path / "w", progress=False)
    cfg = dl.AttackSuiteConfig(steps=3, batch=2, eval_every=3, lrs=(1e-3,), reverse_steps=20)
    train, held = _blocks_of(32, 3), _blocks_of(4, 4)
    one = dl.attack_suite(original, locked, train, held, cfg, tmp_path / "one", progress=False)

    def target():
        parallel.init("cpu")
        dl.attack_suite(original, locked, train, held, cfg, tmp_path / "two", progress=False)
        return 0

    results = run_ranks(tmp_path, target)
    assert all(c == 0 for c, _ in results), results[0][1][-3000:] + results[1][1][-3000:]
    # rank 0 wrote every run; a rerun in one process resumes from them (they are the suite's files)
    two = dl.attack_suite(original, locked, train, held, cfg, tmp_path / "two", progress=False)
    assert [r["name"] for r in two["attacks"]] == [r["name"] for r in one["attacks"]]
    assert "reverse-distilled locked" in {r["name"] for r in two["attacks"]}  # the reverse route, sharded too
    for a, b in zip(one["attacks"], two["attacks"]):
        assert b["notes"]["world_size"] == 2 and a["trainable_params"] == b["trainable_params"], a["name"]
        for x, y in zip(a["history"], b["history"], strict=True):
            assert y["loss"] == pytest.approx(x["loss"], rel=1e-4), (a["name"], x["step"])
        for x, y in zip(a["eval"], b["eval"], strict=True):
            assert y["loss"] == pytest.approx(x["loss"], rel=1e-4), (a["name"], x["step"])
        assert 0 < b["step_peak_bytes"] < a["step_peak_bytes"], a["name"]  # one rank's share of the step
    assert two["reverse"]["relative_error"] == pytest.approx(one["reverse"]["relative_error"], rel=1e-4)


def test_cli_attack_dlr_over_two_ranks_reads_both_models_into_shards_and_equals_one_process(tmp_path):
    """`attack dlr` under torchrun holds neither model whole: the locked folder and its original checkpoint are read
    into FSDP shards a layer at a time (each rank about half of each), afresh for every run (LoRA's adapters and the
    reverse route's dense sub-blocks made on each layer as it is read), and every route's losses equal one
    process's. The results belong to a two-rank run: one process does not reuse them."""
    from mlpsurgery.cli import main
    from mlpsurgery.models import load_model

    ckpt, locked = _saved(tmp_path, "llama"), str(tmp_path / "locked")
    with contextlib.redirect_stdout(io.StringIO()):
        assert main([ckpt if a == "tiny:llama" else a for a in lock_args(
            tmp_path, locked, "--phase2-steps", "0", "--onpolicy-steps", "0", "--eval-tokens", "0")]) == 0
    attack = ["attack", "dlr", locked, "--lrs", "1e-3", "--steps", "2", "--block-len", "32", "--train-blocks", "8",
              "--eval-blocks", "2", "--reverse-steps", "4", "--data", str(tmp_path / "t.txt"), "--original", ckpt,
              "--json", "--quiet"]
    out = str(tmp_path / "att")
    for code, log in ranks(tmp_path, attack + ["--out", out, "--batch", "3"]):  # refused on every rank
        assert code == 2 and "does not split evenly over 2 ranks" in log, log[-2000:]
    assert not os.path.exists(out)
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(attack + ["--out", str(tmp_path / "one"), "--batch", "2"]) == 0
    one = json.loads(buf.getvalue())
    (c0, log0), (c1, log1) = ranks(tmp_path, attack + ["--out", out, "--batch", "2"])
    assert (c0, c1) == (0, 0), log0[-3000:] + log1[-3000:]
    r0, r1 = _json(log0), _json(log1)
    assert r0["world_size"] == 2 and set(r1) == {"rank", "world_size", "peak_rss_bytes", "peak_rss_loaded_bytes",
                                                 "loaded_into_shards", "loaded_param_bytes"}
    whole = {"locked": parallel.local_bytes(load(locked).parameters()),
             "original": parallel.local_bytes(load_model(ckpt).model.parameters())}
    for r in (r0, r1):
        assert r["loaded_into_shards"] == {"locked": True, "original": True}
        for who, n in whole.items():
            assert 0.4 < r["loaded_param_bytes"][who] / n < 0.6, (who, r["loaded_param_bytes"], n)
    names = {row["attack"] for row in one["table"]}
    assert {row["attack"] for row in r0["table"]} == names and {"LoRA on DLR locked", "DLR frozen locked",
                                                               "reverse-distilled locked"} <= names
    suite1 = json.loads((tmp_path / "one" / "suite.json").read_text())
    suite2 = json.loads((tmp_path / "att" / "suite.json").read_text())
    for a, b in zip(suite1["attacks"], suite2["attacks"], strict=True):
        assert a["name"] == b["name"] and a["trainable_params"] == b["trainable_params"], a["name"]
        for x, y in zip(a["history"] + a["eval"], b["history"] + b["eval"], strict=True):
            assert y["loss"] == pytest.approx(x["loss"], rel=1e-4), (a["name"], x["step"])
    assert suite2["reverse"]["relative_error"] == pytest.approx(suite1["reverse"]["relative_error"], rel=1e-4)
    assert os.path.isfile(os.path.join(out, "adaptation.json")) and os.path.isfile(os.path.join(out, "attacks.md"))
    # the results belong to a two-rank run (the seconds and memory are one rank's): one process does not reuse them
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        assert main(attack + ["--out", out, "--batch", "2"]) == 2
    assert "made with other settings or another model (world_size)" in buf.getvalue(), buf.getvalue()


def test_cli_attack_dlr_in_bfloat16_over_two_ranks_equals_one_process(tmp_path):
    """`attack dlr --dtype bfloat16` on a lock saved in float32: the original is read in the float32 it was locked
    from (its fingerprint is checked on that; read in bfloat16 it was refused as another model) and held in
    bfloat16; under torchrun LoRA's float32 adapters on the frozen bfloat16 layers are sharded (FSDP2 gathers a unit
    of mixed dtypes; only trained parameters must share one), and every route equals one process's."""
    from mlpsurgery.cli import main

    ckpt, locked = _saved(tmp_path, "llama"), str(tmp_path / "locked")
    with contextlib.redirect_stdout(io.StringIO()):
        assert main([ckpt if a == "tiny:llama" else a for a in lock_args(
            tmp_path, locked, "--phase2-steps", "0", "--onpolicy-steps", "0", "--eval-tokens", "0")]) == 0
    attack = ["attack", "dlr", locked, "--original", ckpt, "--attacks", "finetune,lora", "--lrs", "1e-3", "--steps",
              "2", "--batch", "2", "--block-len", "32", "--train-blocks", "8", "--eval-blocks", "2", "--data",
              str(tmp_path / "t.txt"), "--dtype", "bfloat16", "--json", "--quiet"]
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(attack + ["--out", str(tmp_path / "one")]) == 0
    (c0, log0), (c1, log1) = ranks(tmp_path, attack + ["--out", str(tmp_path / "two")])
    assert (c0, c1) == (0, 0), log0[-3000:] + log1[-3000:]
    suite1 = json.loads((tmp_path / "one" / "suite.json").read_text())["attacks"]
    suite2 = json.loads((tmp_path / "two" / "suite.json").read_text())["attacks"]
    assert "LoRA on DLR locked" in {a["name"] for a in suite2}
    for a, b in zip(suite1, suite2, strict=True):
        assert a["name"] == b["name"] and a["trainable_params"] == b["trainable_params"], a["name"]
        for x, y in zip(a["history"] + a["eval"], b["history"] + b["eval"], strict=True):
            assert y["loss"] == pytest.approx(x["loss"], abs=2e-3), (a["name"], x["step"])  # bfloat16 sums


def test_a_sharded_source_reads_afresh_and_refuses_files_changed_meanwhile(tmp_path):
    """parallel.ShardedSource (what `attack dlr` keeps under torchrun): between reads only the structure, on meta;
    each read holds about half per rank and fingerprints as the model loaded whole; a checkpoint whose weights
    changed since the first read is refused, not trained on."""
    from safetensors.torch import load_file, save_file

    from mlpsurgery.files import model_fingerprint
    from mlpsurgery.models import load_model

    ckpt = _saved(tmp_path, "llama")
    whole = load_model(ckpt).model
    expected, n = model_fingerprint(whole), parallel.local_bytes(whole.parameters())
    weights = os.path.join(ckpt, "model.safetensors")

    def target():
        parallel.init("cpu")
        src = parallel.ShardedSource(ckpt)
        assert src.fingerprint == expected and src.streamed and 0.4 < src.local_bytes / n < 0.6
        assert all(p.is_meta for p in src.skeleton.parameters()) and not parallel.is_sharded(src.skeleton)
        m = src.load(structure=lambda s: next(s.parameters()).requires_grad_(False))
        assert parallel.is_sharded(m) and not next(m.parameters()).requires_grad
        assert model_fingerprint(m) == expected
        parallel.drop(m)
        parallel.barrier()
        if parallel.world()[0] == 0:  # the checkpoint changes between two reads
            state = load_file(weights)
            key = next(k for k in state if "layers.1." in k)
            state[key] = state[key] + 1
            save_file(state, weights, metadata={"format": "pt"})
        parallel.barrier()
        with pytest.raises(Exception, match="changed on disk while it was in use"):
            src.load()
        return 0

    results = run_ranks(tmp_path, target)
    assert all(c == 0 for c, _ in results), results[0][1][-3000:] + results[1][1][-3000:]
