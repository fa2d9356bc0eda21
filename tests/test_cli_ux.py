"""What a person (or a script) sees from the command line: stage lines and bars on stderr only, errors as JSON
with --json, and a PNG beside every result that is a curve or a comparison. Everything through
`mlpsurgery.cli.main` on tiny models."""

import json

import pytest
import torch

from mlpsurgery import report
from mlpsurgery.cli import main
from mlpsurgery.io import load, save
from mlpsurgery.tiny import tiny_model

PNG = b"\x89PNG\r\n\x1a\n"


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def assert_png(path):
    data = open(path, "rb").read()
    assert data[:8] == PNG and len(data) > 5000, (path, len(data))  # a drawn figure, not an empty canvas


@pytest.fixture
def text(tmp_path):
    p = tmp_path / "t.txt"
    p.write_text("Emma Woodhouse, handsome, clever, and rich, with a comfortable home and happy disposition. " * 120)
    return p


@pytest.fixture
def at_once(monkeypatch):
    """Stage lines printed when their step starts (by default only steps longer than two seconds show one)."""
    monkeypatch.setattr(report, "STAGE_DELAY", 0.0)


# ---- --json errors ----------------------------------------------------------------------------------

@pytest.mark.parametrize("argv,command,needle", [
    (["inspect", "tiny:mamba"], "inspect", "no tiny model"),
    (["eval", "ppl", "tiny:bert"], "eval ppl", "causal language model"),
    (["lock", "key", "tiny:llama", "--key", "k"], "lock key", "--out"),  # refused by the argument parser
    (["prune", "tiny:llama", "--method", "magnitude", "--sparsity", "1.5", "--out", "x"], "prune", "sparsity"),
    (["nest", "rank", "/no/such/dir", "--rank", "4", "--out", "x"], "nest", "does not exist"),
])
def test_json_errors_are_a_json_object_on_stdout(capsys, tmp_path, monkeypatch, argv, command, needle):
    monkeypatch.chdir(tmp_path)
    code, out, err = run(capsys, *argv, "--json")
    r = json.loads(out)
    assert code == 2 and r["exit_status"] == 2 and r["command"] == command and needle in r["error"]
    # the one-line message on stderr stays, and is the same error
    assert err.startswith("mlpsurgery: error: ") and len(err.strip().splitlines()) == 1 and needle in err
    assert list(tmp_path.iterdir()) == []


def test_errors_without_json_leave_stdout_empty(capsys):
    code, out, err = run(capsys, "inspect", "tiny:mamba")
    assert code == 2 and out == "" and "no tiny model" in err


def test_interrupt_with_json(capsys, monkeypatch):
    # Ctrl-C cannot be pressed in a test: the command's handler raises what Python raises on SIGINT
    from mlpsurgery.cli import core

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(core, "run_inspect", interrupted)
    code, out, err = run(capsys, "inspect", "tiny:llama", "--json")
    r = json.loads(out)
    assert code == 130 and r == {"error": r["error"], "exit_status": 130, "command": "inspect"}
    assert "interrupted" in r["error"] and err.startswith("mlpsurgery: interrupted")


# ---- progress on stderr -----------------------------------------------------------------------------

def test_stage_lines_go_to_stderr_and_json_silences_them(capsys, tmp_path, text, at_once):
    argv = ["lock", "key", "tiny:llama", "--ratio", "0.1", "--measure", "--data", text, "--calib-size", "128"]
    code, out, err = run(capsys, *argv, "--out", tmp_path / "a", "--key", tmp_path / "a.key")
    assert code == 0 and "locked tiny:llama" in out and "[" not in out
    for step in ("loading tiny:llama", "perplexity of the original model", "hashing every tensor",
                 "ranking the weight units", "extracting", "perplexity of the locked model", "writing the key"):
        assert step in err, step
    assert "perplexity: 100%" in err  # the utility measurements show their bars
    code, out, err = run(capsys, *argv, "--out", tmp_path / "b", "--key", tmp_path / "b.key", "--json")
    assert code == 0 and json.loads(out)["utility"]["metric"] == "perplexity" and err == ""
    code, out, err = run(capsys, *argv, "--out", tmp_path / "c", "--key", tmp_path / "c.key", "--quiet")
    assert code == 0 and err == ""


def test_quick_steps_print_no_stage_line(capsys):
    # the default delay: a refusal that comes at once prints its error alone
    code, _, err = run(capsys, "eval", "ppl", "tiny:bert")
    assert code == 2 and len(err.strip().splitlines()) == 1


def test_stage_line_of_a_long_step(capsys, monkeypatch):
    import time

    monkeypatch.setattr(report, "STAGE_DELAY", 0.2)
    report.restart_clock()
    report.stage("a long step")
    time.sleep(0.6)
    report.stage("a quick step")
    report.end_stage()
    time.sleep(0.4)
    err = capsys.readouterr().err
    assert "a long step" in err and "a quick step" not in err and err.startswith("[")


def test_nest_shows_the_svd_of_every_projection(capsys, tmp_path, at_once):
    code, _, err = run(capsys, "nest", "tiny:llama", "--out", tmp_path / "n")
    assert code == 0 and "loading tiny:llama" in err and "SVD: 100%" in err and "6/6" in err
    assert "saving the nested model" in err


def test_eval_cost_shows_its_passes(capsys):
    code, _, err = run(capsys, "eval", "cost", "tiny:llama", "--baseline", "tiny:llama", "--repeats", "1",
                       "--seq-len", "16")
    assert code == 0 and "cost of the reference: 100%" in err and "cost of the candidate: 100%" in err


# ---- plots ------------------------------------------------------------------------------------------

def test_fuse_plots_the_error_of_each_compressed_mlp(capsys, tmp_path, text):
    code, out, _ = run(capsys, "fuse", "tiny:llama", "--out", tmp_path / "f", "--width", "16", "--layers", "all",
                       "--json")
    r = json.loads(out)
    assert code == 0 and r["plot"] == str(tmp_path / "f" / "fuse-error.png")
    assert_png(r["plot"])
    assert [s["layer"] for s in r["sites"]] == [0, 1] and all(0 < s["error_rel"] < 2 for s in r["sites"])
    assert "calibration blocks' MLP inputs" in r["error_inputs"] and r["calibration"]["mode"] == "sequential"
    code, out, _ = run(capsys, "fuse", "tiny:llama", "--out", tmp_path / "free", "--width", "16", "--layers", "all",
                       "--data-free", "--json")
    assert code == 0 and "N(0, 1)" in json.loads(out)["error_inputs"] and "calibration" not in json.loads(out)
    load(tmp_path / "f")  # the plot beside the model's files leaves the folder loadable

    # with tune data: measured on its captured MLP inputs, before and after the layer-wise tuning
    code, out, _ = run(capsys, "fuse", "tiny:llama", "--out", tmp_path / "g", "--width", "16", "--layers", "all",
                       "--tune-data", text, "--tune-blocks", "4", "--block-len", "32", "--tune-steps", "3", "--json")
    r = json.loads(out)
    assert code == 0 and "tune data" in r["error_inputs"]
    assert all("error_rel_tuned" in s for s in r["sites"])
    assert_png(r["plot"])
    code, out, _ = run(capsys, "fuse", "tiny:llama", "--out", tmp_path / "h", "--width", "16", "--layers", "all")
    assert code == 0 and "plot: " in out and "rel. error" in out


@pytest.mark.parametrize("method", ["fusion", "random"])
def test_fuse_error_is_zero_at_full_width(method):
    # k = h keeps every neuron (k-means: each neuron its own cluster): the compressed MLP is the original
    from mlpsurgery.methods.fusion import FusionConfig, fuse

    model = tiny_model("llama")
    rep = fuse(model, FusionConfig(width=64, method=method, layers="all"), progress=False)
    assert all(s["error_rel"] < 1e-5 for s in rep["sites"])
    rep = fuse(tiny_model("llama"), FusionConfig(width=8, method=method, layers="all"), progress=False)
    assert all(s["error_rel"] > 0.05 for s in rep["sites"])


@pytest.mark.parametrize("method,measured", [("magnitude", False), ("wanda", True), ("sparsegpt", True),
                                             ("fisher", True), ("random", False)])
def test_prune_plots_sparsity_and_error_per_layer(capsys, tmp_path, text, method, measured):
    code, out, _ = run(capsys, "prune", "tiny:llama", "--method", method, "--sparsity", "0.5", "--out",
                       tmp_path / "p", "--data", text, "--calib-blocks", "4", "--block-len", "32", "--blocks", "4",
                       "--json")
    r = json.loads(out)
    assert code == 0 and r["plot"] == str(tmp_path / "p" / "prune-layers.png")
    assert_png(r["plot"])
    assert [x["layer"] for x in r["per_layer"]] == [0, 1]
    assert all(x["sparsity"] == pytest.approx(0.5, abs=0.02) for x in r["per_layer"])
    assert all((x["error_rel"] is not None) == measured for x in r["per_layer"])
    if measured:
        assert all(0 < x["error_rel"] < 1.5 for x in r["per_layer"]) and r["error_inputs"]


def test_wanda_layer_error_is_the_output_error_on_the_calibration_inputs(text):
    # parts=ffn leaves layer 0's attention whole, so layer 0's MLP sees the same inputs before and after
    from mlpsurgery.data import text_blocks
    from mlpsurgery.methods.pruning import prune
    from mlpsurgery.sites import find_sites, linear_weight
    from mlpsurgery.tiny import byte_tokenizer

    model = tiny_model("llama")
    data = text_blocks(text, byte_tokenizer(), block_len=32, max_blocks=4, seed=0)
    up = find_sites(model).mlp[0].linears()["up"]
    w0 = linear_weight(up)[0].detach().clone()
    xs = []
    h = up.register_forward_pre_hook(lambda m, a: xs.append(a[0].detach().reshape(-1, a[0].shape[-1])))
    with torch.no_grad():
        model(input_ids=data)
    h.remove()
    _, rep = prune(model, "wanda", 0.5, parts="ffn", data=data, progress=False)
    x = torch.cat(xs)
    w1 = linear_weight(up)[0].detach()
    direct = float((x @ (w1 - w0).T).norm() / (x @ w0.T).norm())
    assert rep["per_layer"][0]["projections"]["ffn.up"] == pytest.approx(direct, rel=1e-3)


def test_fisher_layer_error_is_the_mlp_output_error(text):
    from mlpsurgery.data import text_blocks
    from mlpsurgery.methods.pruning import prune
    from mlpsurgery.sites import find_sites
    from mlpsurgery.tiny import byte_tokenizer

    model = tiny_model("llama")
    data = text_blocks(text, byte_tokenizer(), block_len=32, max_blocks=4, seed=0)
    site = find_sites(model).mlp[1]
    xs = []
    h = site.entry.register_forward_pre_hook(lambda m, a: xs.append(a[0].detach()))
    with torch.no_grad():
        model(input_ids=data)
    h.remove()
    x = torch.cat(xs)
    with torch.no_grad():
        ref = site.subblock(x)
    new, rep = prune(model, "fisher", 0.5, parts="ffn", data=data, blocks=4, progress=False)
    with torch.no_grad():
        got = find_sites(new).mlp[1].subblock(x)
    direct = float((got - ref).norm() / ref.norm())
    assert rep["per_layer"][1]["error_rel"] == pytest.approx(direct, rel=1e-3)


def test_twist_train_plots_the_loss_of_every_subnet(capsys, tmp_path, text):
    code, out, _ = run(capsys, "twist", "train", "tiny:llama", "--out", tmp_path / "tw", "--data", text, "--steps",
                       "4", "--interval", "2", "--workers", "2", "--blocks", "4", "--keep", "2", "--shared-first",
                       "0", "--shared-last", "0", "--block-len", "32", "--no-checkpoint", "--json")
    r = json.loads(out)
    assert code == 0 and r["plot"] == str(tmp_path / "tw" / "twist-loss.png")
    assert_png(r["plot"])
    assert all(len(h["worker_loss"]) == 2 for h in r["history"]) and len(r["history"]) == 2


def test_eval_cost_plot(capsys, tmp_path):
    png = tmp_path / "cost.png"
    code, out, _ = run(capsys, "eval", "cost", "tiny:llama", "--baseline", "tiny:llama", "--repeats", "1",
                       "--seq-len", "16", "--plot", png, "--json")
    r = json.loads(out)
    assert code == 0 and r["plot"] == str(png)
    assert_png(png)
    code, out, _ = run(capsys, "eval", "cost", "tiny:llama", "--repeats", "1", "--seq-len", "16")
    assert code == 0 and "plot" not in out  # none unless asked: eval commands write no files by default
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cost.png"]


def test_lock_key_plots_a_search_that_fails(capsys, tmp_path, text):
    png = tmp_path / "curve.png"
    code, out, err = run(capsys, "lock", "key", "tiny:llama", "--out", tmp_path / "l", "--key", tmp_path / "k",
                         "--target-utility", "1e9", "--data", text, "--calib-size", "128", "--plot", png, "--json")
    r = json.loads(out)
    assert code == 2 and r["exit_status"] == 2 and "short of the target" in r["error"]
    assert r["plot"] == str(png) and [p["ratio"] for p in r["curve"]] == [0.0, 0.5]
    assert str(png) in err and len(err.strip().splitlines()) == 1
    assert_png(png)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["curve.png", "t.txt"]  # no model, no key


def test_lock_key_plots_the_two_measured_points(capsys, tmp_path, text):
    png = tmp_path / "m.png"
    code, out, _ = run(capsys, "lock", "key", "tiny:llama", "--out", tmp_path / "l", "--key", tmp_path / "k",
                       "--ratio", "0.2", "--data", text, "--calib-size", "128", "--plot", png, "--json")
    r = json.loads(out)
    assert code == 0 and r["plot"] == str(png) and r["utility"]["original"] != r["utility"]["locked"]
    assert_png(png)


def test_lock_key_plot_inside_the_locked_folder_is_refused(capsys, tmp_path, text):
    code, _, err = run(capsys, "lock", "key", "tiny:llama", "--out", tmp_path / "l", "--key", tmp_path / "k",
                       "--ratio", "0.2", "--data", text, "--plot", tmp_path / "l" / "curve.png")
    assert code == 2 and "overlaps the output" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.txt"]


def test_a_plot_that_fails_is_a_warning(capsys, tmp_path, monkeypatch):
    def broken(fig, path):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(report, "save_figure", broken)
    code, out, err = run(capsys, "fuse", "tiny:llama", "--out", tmp_path / "f", "--width", "16", "--json")
    r = json.loads(out)
    assert code == 0 and r["plot"] is None
    assert "warning: the per-layer error plot could not be drawn" in err and "No space left" in err
    load(tmp_path / "f")  # the result itself was written


def test_save_figure_replaces_a_plot_whole(tmp_path):
    plt = report.pyplot()
    path = tmp_path / "a.png"
    path.write_bytes(b"old")
    fig, ax = plt.subplots()
    ax.plot([0, 1], [1, 0])
    report.save_figure(fig, path)
    assert_png(path)
    assert [p.name for p in tmp_path.iterdir()] == ["a.png"]  # no temporary file left beside it


def test_export_of_a_folder_holding_a_plot(capsys, tmp_path):
    save(tiny_model("llama"), tmp_path / "m")
    code, _, _ = run(capsys, "prune", tmp_path / "m", "--method", "magnitude", "--sparsity", "0.5", "--out",
                     tmp_path / "p", "--quiet")
    assert code == 0 and (tmp_path / "p" / "prune-layers.png").exists()
    code, _, _ = run(capsys, "export", tmp_path / "p", "--out", tmp_path / "hf", "--quiet")
    assert code == 0 and not (tmp_path / "hf" / "prune-layers.png").exists()


def test_every_option_of_every_command_says_what_it_does():
    """`--help` is a new user's manual: no option may show up bare (`--steps STEPS` and nothing else)."""
    import argparse

    from mlpsurgery.cli import build_parser

    bare, seen = [], 0

    def walk(parser, path):
        nonlocal seen
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, [*path, name])
            elif action.option_strings and not isinstance(action, argparse._HelpAction):
                seen += 1
                if not (action.help or "").strip():
                    bare.append(f"{' '.join(path)} {action.option_strings[-1]}")

    walk(build_parser(), [])
    assert seen > 200  # every command's options were walked
    assert not bare, f"options without help: {bare}"
