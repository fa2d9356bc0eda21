"""`mlpsurgery compare`: one frontier of every way to shrink the MLPs, on a tiny model (real runs: docs/frontier.md).
Every point's folder is the model that was measured (reloaded, it scores the recorded perplexity), the run resumes
(points made are read back, new budgets added), a rerun with other settings is refused, an encoder is refused."""

import json

import pytest
import torch

import mlpsurgery as ms
from mlpsurgery.cli import main
from mlpsurgery.data import load_corpus
from mlpsurgery.measure.perplexity import perplexity
from mlpsurgery.measure.speed import paired_speed
from mlpsurgery.tiny import byte_tokenizer, tiny_model

SMALL = ["--max-tokens", "128", "--calib-blocks", "2", "--calib-len", "32", "--prompt-len", "16", "--new-tokens",
         "2", "--repeats", "1", "--threads", "1"]


def _run(args, capsys):
    code = main(args)
    cap = capsys.readouterr()
    return code, cap.out, cap.err


def test_compare_builds_measures_saves_and_resumes(tmp_path, capsys):
    out = tmp_path / "cmp"
    code, stdout, err = _run(["compare", "tiny:llama", "--out", str(out), "--methods",
                              "fusion,nsn,fisher,wanda-2:4,magnitude", "--budgets", "0.5", "--recover-steps", "2",
                              "--json", *SMALL], capsys)
    assert code == 0, err
    r = json.loads(stdout)
    names = sorted(f"{p['method']}@{p['budget']:g}" for p in r["points"])
    assert names == ["fisher@0.5", "fusion@0.5", "magnitude@0.5", "nsn@0.5", "wanda-2:4@0.5"], names
    assert (out / "frontier.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| MLP Fusion | 0.5 |" in (out / "frontier.md").read_text()
    base = r["original"]
    corpus = load_corpus(None, byte_tokenizer())
    for p in r["points"]:
        # structured points are smaller and cost fewer FLOPs; unstructured ones keep every matrix, half of the MLP zero
        if p["method"] in ("fusion", "nsn", "fisher"):
            assert p["params"] < base["params"] and p["flops"] < base["flops"] and p["ideal_speedup"] > 1
        else:
            assert p["params"] == base["params"] and p["nonzero_params"] < base["params"]
            assert p["flops"] == base["flops"] and p["flops_nonzero"] < base["flops"]
        assert p["recovery"]["steps"] == 2 and p["speed"]["ratio"]["prefill"] > 0
        folder = out / "models" / f"{p['method'].replace(':', '_')}@0.5"
        again = ms.load(folder)
        got = perplexity(again, corpus.heldout, block_len=r["heldout"]["block_len"], max_tokens=128, progress=False,
                         bos_id=corpus.bos).ppl
        assert got == pytest.approx(p["ppl"], rel=1e-5), p["method"]  # the folder is the model that was measured
    # resume: the points made are read back (their files untouched), a new budget is added
    stamps = {f.name: f.stat().st_mtime_ns for f in (out / "points").iterdir()}
    code, stdout, err = _run(["compare", "tiny:llama", "--out", str(out), "--methods", "fusion,magnitude",
                              "--budgets", "0.5,0.25", "--recover-steps", "2", "--json", *SMALL], capsys)
    assert code == 0, err
    r2 = json.loads(stdout)
    assert sorted(f"{p['method']}@{p['budget']:g}" for p in r2["points"]) == [
        "fusion@0.25", "fusion@0.5", "magnitude@0.25", "magnitude@0.5"]
    assert all((out / "points" / n).stat().st_mtime_ns == t for n, t in stamps.items())
    # other settings (here: another recovery) into the same folder: refused, nothing changed
    before = sorted(p.name for p in (out / "points").iterdir())
    code, _, err = _run(["compare", "tiny:llama", "--out", str(out), "--methods", "fusion", "--budgets", "0.5",
                         *SMALL], capsys)
    assert code == 2 and "other settings" in err and "recover_steps" in err
    assert sorted(p.name for p in (out / "points").iterdir()) == before


def test_compare_refusals(tmp_path, capsys):
    for args, needle in ((["--budgets", "0.5,1.2"], "in (0, 1)"), (["--methods", "fusion,bogus"], "unknown method"),
                         (["--budgets", "half"], "comma-separated")):
        code, _, err = _run(["compare", "tiny:llama", "--out", str(tmp_path / "x"), *args], capsys)
        assert code == 2 and needle in err and err.count("\n") == 1, err
        assert not (tmp_path / "x").exists()
    code, _, err = _run(["compare", "tiny:bert", "--out", str(tmp_path / "x")], capsys)
    assert code == 2 and "causal language model" in err
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("mine")
    code, _, err = _run(["compare", "tiny:llama", "--out", str(tmp_path / "mine"), "--overwrite", *SMALL], capsys)
    assert code == 2 and (tmp_path / "mine" / "notes.txt").read_text() == "mine"


def test_paired_speed_reports_both_and_their_ratio():
    a, b = tiny_model("llama"), tiny_model("llama")
    r = paired_speed(a, b, prompt_len=8, new_tokens=2, repeats=2, threads=1)
    assert set(r) >= {"reference", "candidate", "ratio"} and r["threads"] == 1
    assert r["ratio"]["prefill"] == pytest.approx(r["reference"]["prefill_s"] / r["candidate"]["prefill_s"])
    assert torch.get_num_threads() >= 1


def test_a_twist_trained_model_gets_its_random_subnets_on_the_frontier(tmp_path, capsys):
    from mlpsurgery.methods.twist import TwISTConfig, twist_train

    m = tiny_model("llama")
    cfg = TwISTConfig(workers=2, blocks=4, keep=2, interval=2, steps=2, batch_size=2, lr=1e-3, shared_first=0,
                      shared_last=0, parts="ffn")
    twist_train(m, torch.randint(0, 256, (8, 32), generator=torch.Generator().manual_seed(0)), cfg, progress=False)
    folder = ms.save(m, tmp_path / "twisted", tokenizer=byte_tokenizer())
    code, stdout, err = _run(["compare", str(folder), "--out", str(tmp_path / "cmp"), "--methods", "twist,random",
                              "--budgets", "0.5", "--json", *SMALL], capsys)
    assert code == 0, err
    r = json.loads(stdout)
    tw = next(p for p in r["points"] if p["method"] == "twist")
    assert tw["blocks"] == 4 and tw["keep"] == 2 and tw["params"] < r["original"]["params"]
    assert tw["data"] == "calibration, refit sequential"  # calibrated by default, as every width-reducing method
    again = ms.load(tmp_path / "cmp" / "models" / "twist@0.5")
    assert sum(p.numel() for p in again.parameters()) == tw["params"]
    from mlpsurgery.compare import chosen_layers
    from mlpsurgery.methods.twist import twist_extract
    from mlpsurgery.sites import find_sites

    layers = chosen_layers(m, "last2/3")
    plain = find_sites(twist_extract(m, keep=2, blocks=4, parts="ffn", layers=layers, seed=0))
    for i in layers:  # the same subnet, its down projections refit
        got, cut = find_sites(again).mlp[i].read(), plain.mlp[i].read()
        assert torch.equal(got.up, cut.up) and not torch.allclose(got.down, cut.down)
    assert not r["skipped"]


def test_compare_nsn_refit_is_recorded_and_refused_without_data(tmp_path, capsys):
    out = tmp_path / "cmp"
    code, stdout, err = _run(["compare", "tiny:llama", "--out", str(out), "--methods", "nsn", "--budgets", "0.5",
                              "--nsn-refit", "--no-models", "--json", *SMALL], capsys)
    assert code == 0, err
    (p,) = json.loads(stdout)["points"]
    assert p["refit"] and "down refit" in p["data"] and "sequential" in p["data"]
    assert "NSN (down refit)" in (out / "frontier.md").read_text()
    code, _, err = _run(["compare", "tiny:llama", "--out", str(out), "--methods", "nsn", "--budgets", "0.5",
                         "--no-models", *SMALL], capsys)
    assert code == 2 and "other settings" in err and "nsn_refit" in err
    code, _, err = _run(["compare", "tiny:llama", "--out", str(tmp_path / "free"), "--data-free", "--nsn-refit",
                         *SMALL], capsys)
    assert code == 2 and "--nsn-refit" in err and err.count("\n") == 1 and not (tmp_path / "free").exists()


def test_compare_with_local_tuning_records_it_per_point_and_a_rerun_without_it_is_refused(tmp_path, capsys):
    out = tmp_path / "cmp"
    code, stdout, err = _run(["compare", "tiny:llama", "--out", str(out), "--methods", "neuron,fisher,nsn",
                              "--budgets", "0.5", "--local-epochs", "2", "--no-models", "--json", *SMALL], capsys)
    assert code == 0, err
    points = {p["method"]: p for p in json.loads(stdout)["points"]}
    for m in ("neuron", "fisher", "nsn"):  # every chosen layer tuned, its steps and seconds recorded
        loc = points[m]["local"]
        assert loc["epochs"] == 2 and loc["layers"] == 1 and loc["steps"] > 0 and loc["seconds"] > 0, points[m]
    assert "sequential" in points["nsn"]["data"]  # NSN's layers nested in sequence, tuned at every rank at once
    assert "local 2 epochs" in (out / "frontier.md").read_text()
    code, _, err = _run(["compare", "tiny:llama", "--out", str(out), "--methods", "neuron", "--budgets", "0.5",
                         "--no-models", *SMALL], capsys)
    assert code == 2 and "other settings" in err and "local_epochs" in err
    code, _, err = _run(["compare", "tiny:llama", "--out", str(tmp_path / "free"), "--data-free", "--local-epochs",
                         "1", *SMALL], capsys)
    assert code == 2 and "local" in err and err.count("\n") == 1 and not (tmp_path / "free").exists()
    code, _, err = _run(["fuse", "tiny:llama", "--out", str(tmp_path / "f"), "--data-free", "--local-epochs", "1"],
                        capsys)
    assert code == 2 and "--local-epochs" in err and err.count("\n") == 1 and not (tmp_path / "f").exists()


def test_compare_distillation_of_the_chosen_layers_whole_is_recorded_and_needs_distill(tmp_path, capsys):
    out = tmp_path / "cmp"
    code, stdout, err = _run(["compare", "tiny:llama", "--out", str(out), "--methods", "neuron", "--budgets", "0.5",
                              "--recover", "distill", "--recover-steps", "2", "--recover-train", "layers",
                              "--no-models", "--json", *SMALL], capsys)
    assert code == 0, err
    r = json.loads(stdout)
    assert r["points"][0]["recovery"]["train"] == "layers" and r["points"][0]["recovery"]["steps"] == 2
    assert "distill (layers whole), 2 steps" in (out / "frontier.md").read_text()
    code, _, err = _run(["compare", "tiny:llama", "--out", str(out), "--methods", "neuron", "--budgets", "0.5",
                         "--recover", "distill", "--recover-steps", "2", "--no-models", *SMALL], capsys)
    assert code == 2 and "other settings" in err and "recover_train" in err
    code, _, err = _run(["compare", "tiny:llama", "--out", str(tmp_path / "lw"), "--recover-steps", "2",
                         "--recover-train", "layers", *SMALL], capsys)
    assert code == 2 and "--recover distill" in err and err.count("\n") == 1 and not (tmp_path / "lw").exists()


def test_compare_with_per_layer_budgets_keeps_the_total_width_and_records_each_layer(tmp_path, capsys):
    out = tmp_path / "cmp"
    code, stdout, err = _run(["compare", "tiny:llama", "--out", str(out), "--methods", "neuron", "--layers", "all",
                              "--budgets", "0.5", "--budget", "per-layer", "--json", *SMALL], capsys)
    assert code == 0, err
    r = json.loads(stdout)
    (p,) = r["points"]
    h = tiny_model("llama").config.intermediate_size
    widths = {int(i): w for i, w in p["widths"].items()}
    assert sorted(widths) == list(range(tiny_model("llama").config.num_hidden_layers))
    assert sum(widths.values()) == len(widths) * p["width"] and all(1 <= w <= h for w in widths.values())
    again = ms.load(out / "models" / "neuron@0.5")  # the folder holds those widths
    from mlpsurgery.sites import find_sites

    assert {s.index: s.h for s in find_sites(again).mlp} == widths
    assert "| neuron pruning | 0.5 (per layer) |" in (out / "frontier.md").read_text()
    code, _, err = _run(["compare", "tiny:llama", "--out", str(out), "--methods", "neuron", "--layers", "all",
                         "--budgets", "0.5", *SMALL], capsys)  # the uniform budget into a per-layer folder: refused
    assert code == 2 and "other settings" in err and "budget" in err
    for extra, needle in ((["--methods", "neuron,nsn"], "nsn from --methods"), (["--data-free"], "--data-free")):
        code, _, err = _run(["compare", "tiny:llama", "--out", str(tmp_path / "x"), "--budget", "per-layer", *extra,
                             *SMALL], capsys)
        assert code == 2 and needle in err and err.count("\n") == 1, err
        assert not (tmp_path / "x").exists()


def test_compare_calibrates_on_other_text_when_named_and_records_it(tmp_path, capsys):
    common = ["--methods", "neuron", "--budgets", "0.5", "--no-models", "--json", *SMALL]
    code, stdout, err = _run(["compare", "tiny:llama", "--out", str(tmp_path / "own"), *common], capsys)
    assert code == 0, err
    own = json.loads(stdout)
    code, stdout, err = _run(["compare", "tiny:llama", "--out", str(tmp_path / "self"), "--calib-data", "self",
                              *common], capsys)
    assert code == 0, err
    other = json.loads(stdout)
    # scored on the same held-out text (the original alike), calibrated on the model's samples: another model
    assert other["original"]["ppl"] == own["original"]["ppl"]
    assert other["points"][0]["ppl"] != own["points"][0]["ppl"]
    assert "Calibrated on self" in (tmp_path / "self" / "frontier.md").read_text()
    assert "Calibrated on" not in (tmp_path / "own" / "frontier.md").read_text()
    from mlpsurgery.compare import _documents  # a table of many held-out documents is counted, not listed

    assert _documents(["a", "b"]) == "a, b"
    assert _documents([f"d{i}" for i in range(9)]) == "9 held-out documents (d0, d1, ..., d8)"
    code, _, err = _run(["compare", "tiny:llama", "--out", str(tmp_path / "self"), *common], capsys)
    assert code == 2 and "other settings" in err and "calib_data" in err
    code, _, err = _run(["compare", "tiny:llama", "--out", str(tmp_path / "free"), "--data-free", "--calib-data",
                         "austen", *SMALL], capsys)
    assert code == 2 and "--data-free" in err and err.count("\n") == 1 and not (tmp_path / "free").exists()
