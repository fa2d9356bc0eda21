"""Sizes that cannot fit, configs that do not match their weights, and data that cannot be read whole (issue 48):
each refused before anything is allocated or written, with exit status 2 and one line that names the problem, the
number and the fix -- never an allocator traceback, never a hang."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import mlpsurgery as ms
from conftest import TEXT, one_line
from mlpsurgery import resources
from mlpsurgery.cli import main
from mlpsurgery.errors import MLPSurgeryError
from mlpsurgery.tiny import byte_tokenizer, tiny_model

HUGE = "1000000000"


def tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


@pytest.fixture
def here(tmp_path, monkeypatch):
    """tmp_path as the working directory (a relative path a command wrote would land in it)."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


def refused(capsys, root: Path, *argv) -> str:
    """Run the command in-process; assert exit 2, one line, nothing new under root; return the line."""
    before = tree(root)
    capsys.readouterr()  # (what making the inputs printed)
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert one_line(code, err), err
    assert tree(root) == before, tree(root) - before
    return err


def little_memory(monkeypatch, nbytes: int = 1 << 20) -> None:
    monkeypatch.setattr(resources, "available_memory", lambda device=None: nbytes)


# ---- 1. a length beyond the model's context ------------------------------------------------------------

def test_eval_acc_refuses_a_max_len_beyond_the_context(here, capsys):
    err = refused(capsys, here, "eval", "acc", "tiny:llama", "--max-len", HUGE)
    assert f"--max-len {HUGE} exceeds the model's context of 128 positions" in err and "--max-len 128" in err


# ---- 2. eval cost: the batch's memory ------------------------------------------------------------------

def test_eval_cost_refuses_a_batch_that_cannot_fit(here, capsys):
    err = refused(capsys, here, "eval", "cost", "tiny:llama", "--batch-size", HUGE)
    assert f"a batch of {HUGE} x 128 tokens" in err and "needs 953.7 GiB of memory" in err
    assert "available; lower --batch-size" in err


def test_eval_cost_counts_the_models_activations(here, capsys, monkeypatch):
    """The token ids of 1000 x 128 fit in 16 MiB; their logits and hidden states (the model's) do not."""
    little_memory(monkeypatch, 16 << 20)
    err = refused(capsys, here, "eval", "cost", "tiny:llama", "--batch-size", "1000")
    assert "a batch of 1000 x 128 tokens" in err and "needs 159.2 MiB of memory" in err and "16.0 MiB available" in err


def test_check_memory_words_both_numbers(monkeypatch):
    little_memory(monkeypatch, 20 << 30)
    with pytest.raises(MLPSurgeryError, match=r"^X needs 3.0 TiB of memory, this machine has 20.0 GiB available; "
                                              r"lower Y$"):
        resources.check_memory(3 << 40, "X", "lower Y")
    resources.check_memory(1 << 30, "X", "lower Y")  # fits: nothing happens
    assert resources._meminfo_available() is None or resources._meminfo_available() > 0


# ---- 3. lock dlr: the DLR-Nets' memory -----------------------------------------------------------------

def test_lock_dlr_refuses_a_rank_that_cannot_fit(here, capsys):
    err = refused(capsys, here, "lock", "dlr", "tiny:llama", "--out", here / "OUT", "--rank", HUGE)
    assert f"--rank {HUGE} (DLR-Nets of depth 1 on 2 layers at once" in err and "needs 1.9 TiB of memory" in err
    assert "lower --rank" in err
    assert not (here / "OUT").exists() and not (here / "OUT.work").exists()


# ---- 4. eval ntk: more samples than the data holds, a kernel that cannot fit -----------------------------

@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text(TEXT * 20)  # 3,540 bytes: 11 held-out blocks of 32 byte tokens (the last 10%: 354 tokens)
    return path


def test_eval_ntk_refuses_an_n_beyond_the_data(here, capsys, text_file):
    err = refused(capsys, here, "eval", "ntk", "tiny:llama", "tiny:llama", "--data", text_file, "--block-len", "32",
                  "--n", HUGE)
    assert f"--n {HUGE} is more than the 11 held-out blocks of 32 tokens {text_file} holds" in err
    assert "give --n 11 or less" in err


def test_eval_ntk_refuses_a_kernel_that_cannot_fit(here, capsys, text_file, monkeypatch):
    little_memory(monkeypatch, 1000)
    err = refused(capsys, here, "eval", "ntk", "tiny:llama", "tiny:llama", "--data", text_file, "--block-len", "32",
                  "--n", "8")
    assert "--n 8 (the Adam NTK of 8 samples: two 8 x 8 float64 kernels) needs 1.0 KiB of memory" in err
    assert "lower --n" in err


def test_eval_ntk_refuses_more_labelled_examples_than_there_are(here, capsys):
    data = here / "labels.jsonl"
    data.write_text("".join(json.dumps({"text": f"text {i}", "label": "ab"[i % 2]}) + "\n" for i in range(6)))
    err = refused(capsys, here, "eval", "ntk", "tiny:bert", "tiny:bert", "--data", data, "--f", "logit",
                  "--task", "classifier", "--n", "7", "--block-len", "16")
    assert "--n 7 is more than the 6 labelled examples" in err


# ---- 5. a config.json that does not match the weights ---------------------------------------------------

def plain_folder(path: Path, **edits) -> Path:
    """A transformers folder (save_pretrained, no manifest) of tiny:llama with its tokenizer, config.json edited."""
    tiny_model("llama").save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(edits)
    (path / "config.json").write_text(json.dumps(cfg))
    return path


COMMANDS = [("fuse", "{m}", "--out", "{o}", "--width", "8"),
            ("fuse", "{m}", "--out", "{o}", "--width", "8", "--layerwise"),
            ("eval", "ppl", "{m}"),
            ("eval", "ppl", "{m}", "--layerwise")]


def _argv(cmd, model, out):
    return [a.format(m=model, o=out) for a in cmd]


@pytest.mark.parametrize("cmd", COMMANDS, ids=lambda c: " ".join(c[:2]) + (" --layerwise" if "--layerwise" in c
                                                                            else ""))
def test_a_config_edited_to_a_2_40_wide_mlp_is_refused(tmp_path, capsys, cmd):
    model = plain_folder(tmp_path / "m", intermediate_size=2**40)
    err = refused(capsys, tmp_path, *_argv(cmd, model, tmp_path / "O"))
    assert f"{model / 'config.json'} does not match the weights: model.layers.0.mlp.gate_proj.weight is (64, 32) " \
           "in the weight files, config.json makes it (1099511627776, 32); restore the model's config.json" in err


@pytest.mark.parametrize("cmd", COMMANDS, ids=lambda c: " ".join(c[:2]) + (" --layerwise" if "--layerwise" in c
                                                                            else ""))
def test_a_config_edited_to_a_million_layers_is_refused_at_once(tmp_path, capsys, cmd):
    model = plain_folder(tmp_path / "m", num_hidden_layers=1_000_000)
    err = refused(capsys, tmp_path, *_argv(cmd, model, tmp_path / "O"))
    assert "config.json does not match the weights: it says 1000000 layers, the weight files hold 2 (layers 0-1); " \
           "restore the model's config.json" in err


def test_a_folder_mlpsurgery_wrote_refuses_an_edited_config_by_its_digest(tmp_path, capsys):
    model = ms.save(tiny_model("llama"), tmp_path / "m", tokenizer=byte_tokenizer())
    cfg = json.loads((model / "config.json").read_text())
    cfg["intermediate_size"] = 2**40
    (model / "config.json").write_text(json.dumps(cfg))
    err = refused(capsys, tmp_path, "eval", "ppl", model)
    assert "config.json does not match the checksum" in err


def test_a_model_that_cannot_fit_in_memory_is_refused_before_loading(tmp_path, capsys, monkeypatch):
    model = plain_folder(tmp_path / "m")
    little_memory(monkeypatch, 1000)
    err = refused(capsys, tmp_path, "eval", "ppl", model)
    assert f"{model} (" in err and "parameters, 4 bytes each) needs" in err and "1000 B available" in err
    assert "--layerwise" in err
    saved = ms.save(tiny_model("llama"), tmp_path / "s", tokenizer=byte_tokenizer())
    err = refused(capsys, tmp_path, "eval", "ppl", saved)
    assert f"{saved} (" in err and "parameters) needs" in err


def test_an_unedited_folder_still_loads(tmp_path, capsys, text_file):
    model = plain_folder(tmp_path / "m")
    for extra in ([], ["--layerwise"]):
        assert main(["eval", "ppl", str(model), "--data", str(text_file), "--block-len", "32", "--quiet", *extra]) == 0
    capsys.readouterr()


# ---- 6. a FIFO (or a device) as data --------------------------------------------------------------------

def _cli(*argv, cwd):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "mlpsurgery", *map(str, argv)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=60)  # a hang fails the test, not the suite


@pytest.fixture
def fifo(tmp_path):
    path = tmp_path / "pipe"
    os.mkfifo(path)
    return path


@pytest.mark.parametrize("cmd", [("eval", "ppl", "tiny:llama", "--data", "{f}"),
                                 ("nest", "tiny:llama", "--out", "{o}", "--data", "{f}")],
                         ids=["eval ppl", "nest"])
def test_a_fifo_as_data_is_refused_not_waited_on(tmp_path, fifo, cmd):
    before = tree(tmp_path)
    r = _cli(*[a.format(f=fifo, o=tmp_path / "O") for a in cmd], cwd=tmp_path)
    assert one_line(r.returncode, r.stderr), r.stderr
    assert f"data {fifo} is a named pipe (FIFO), which cannot be read as a whole; give a regular file" in r.stderr
    assert tree(tmp_path) == before


@pytest.fixture
def alarm():
    """In-process calls that would block on a FIFO are interrupted after 20 s (the test fails, the suite goes on)."""
    import signal

    def ring(*_):
        raise TimeoutError("blocked on a FIFO for 20 s")

    old = signal.signal(signal.SIGALRM, ring)
    signal.alarm(20)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def test_every_data_reader_refuses_a_fifo_or_a_device(fifo, alarm):
    from mlpsurgery.data import check_data, read_corpus, read_labelled

    for call in (lambda: read_corpus(fifo), lambda: read_labelled(fifo), lambda: check_data(f"austen+{fifo}"),
                 lambda: check_data(f"{fifo}:text=body"), lambda: read_corpus("/dev/zero")):
        with pytest.raises(MLPSurgeryError, match="named pipe|character device"):
            call()
    check_data("austen")  # bundled names and plain files pass
    check_data(__file__)
