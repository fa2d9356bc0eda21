"""What mlpsurgery may write, replace and delete (files.py), and how models are loaded from folders: every
rule with real folders, a real kill -9 of a save, and heads that must survive a load."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers as T

import mlpsurgery as ms
from conftest import one_line, outputs, run
from mlpsurgery.errors import MLPSurgeryError
from mlpsurgery.files import MARKER, atomic_dir, check_out, claim, is_ours, remove_ours
from mlpsurgery.models import load_model
from mlpsurgery.tiny import byte_tokenizer, tiny_model


# ---- ownership and refusals --------------------------------------------------------------------------

def test_overwrite_replaces_only_folders_mlpsurgery_wrote(tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("years of work")
    with pytest.raises(MLPSurgeryError, match="not written by mlpsurgery"):
        ms.save(tiny_model("llama"), mine, overwrite=True)
    assert (mine / "thesis.tex").read_text() == "years of work" and not is_ours(mine)
    out = ms.save(tiny_model("llama"), tmp_path / "m")
    assert is_ours(out) and json.loads((out / MARKER).read_text())["kind"] == "model"
    ms.save(tiny_model("gpt2"), out, overwrite=True)  # ours: replaced
    assert ms.load(out).config.model_type == "gpt2"
    assert not remove_ours(mine) and mine.exists() and remove_ours(out) and not out.exists()


def test_out_may_not_be_hold_or_lie_inside_an_input(tmp_path, capsys):
    model_dir = ms.save(tiny_model("llama"), tmp_path / "models" / "m", tokenizer=byte_tokenizer())
    before = {p.name: p.read_bytes() for p in model_dir.iterdir()}
    for out in (model_dir, model_dir / "sub", tmp_path / "models", tmp_path):
        code, _, err = run(capsys, "fuse", model_dir, "--out", out, "--width", "8", "--overwrite", "--quiet")
        assert one_line(code, err), (out, err)
    assert {p.name: p.read_bytes() for p in model_dir.iterdir()} == before
    with pytest.raises(MLPSurgeryError, match="is the input"):  # the library refuses it too
        ms.save(ms.load(model_dir), model_dir, overwrite=True)


def test_output_folders_get_the_users_permissions(tmp_path):
    old = os.umask(0o022)
    try:
        out = ms.save(tiny_model("llama"), tmp_path / "m")
    finally:
        os.umask(old)
    assert out.stat().st_mode & 0o777 == 0o755
    assert {p.stat().st_mode & 0o777 for p in out.iterdir()} == {0o644}


def test_refusals_for_impossible_outputs(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(MLPSurgeryError, match="is a file"):
        check_out(tmp_path / "f")
    with pytest.raises(MLPSurgeryError, match="is a file"):
        check_out(tmp_path / "f" / "below")
    (tmp_path / "link").symlink_to(tmp_path / "nowhere")
    with pytest.raises(MLPSurgeryError, match="broken symbolic link"):
        check_out(tmp_path / "link")


def test_claim_refuses_another_run_and_unknown_folders(tmp_path):
    assert claim(tmp_path / "w", "work", {"model": "a", "lr": 1}) is False
    (tmp_path / "w" / "state").write_text("1")
    assert claim(tmp_path / "w", "work", {"model": "a", "lr": 1}) is True
    with pytest.raises(MLPSurgeryError, match="other settings or another model \\(model\\)"):
        claim(tmp_path / "w", "work", {"model": "b", "lr": 1})
    with pytest.raises(MLPSurgeryError, match="not of 'attacks'"):
        claim(tmp_path / "w", "attacks", {"model": "a", "lr": 1})
    (tmp_path / "u").mkdir()
    (tmp_path / "u" / "x").write_text("mine")
    with pytest.raises(MLPSurgeryError, match="did not write"):
        claim(tmp_path / "u", "work", {})


def test_a_claimed_folder_is_removed_only_if_mlpsurgery_made_it(tmp_path):
    """A work folder claimed new is removed at the end; an empty folder the user made is used and then emptied,
    not removed (the folder is theirs, what was put in it is mlpsurgery's)."""
    assert claim(tmp_path / "new", "work", {}) is False
    (tmp_path / "new" / "part").write_text("1")
    assert remove_ours(tmp_path / "new") and not (tmp_path / "new").exists()
    (tmp_path / "theirs").mkdir()
    os.chmod(tmp_path / "theirs", 0o750)
    assert claim(tmp_path / "theirs", "work", {}) is False
    (tmp_path / "theirs" / "sub").mkdir()
    (tmp_path / "theirs" / "sub" / "part").write_text("1")
    assert claim(tmp_path / "theirs", "work", {}) is True  # resumed: still adopted
    assert remove_ours(tmp_path / "theirs")
    assert (tmp_path / "theirs").is_dir() and not any((tmp_path / "theirs").iterdir())
    assert (tmp_path / "theirs").stat().st_mode & 0o777 == 0o750


# ---- crashes -----------------------------------------------------------------------------------------

KILLED_SAVE = r"""
import os, signal, sys, threading
import mlpsurgery as ms
from mlpsurgery.tiny import tiny_model
import mlpsurgery.io.saving as io_mod
model = tiny_model("llama", seed=int(sys.argv[2]))
delay = float(sys.argv[3])
real = io_mod._write_weights
def slow(*a, **k):  # a large model: the kill lands while the weights are being written or after
    real(*a, **k)
    import time; time.sleep(delay)
io_mod._write_weights = slow
threading.Timer(0.05, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
ms.save(model, sys.argv[1], overwrite=True)
import time; time.sleep(5)
"""


@pytest.mark.parametrize("delay", [0.0, 0.2])
def test_a_save_killed_with_sigkill_leaves_the_old_folder_or_the_new_one(tmp_path, delay):
    out = tmp_path / "m"
    ms.save(tiny_model("llama", seed=1), out)
    old = outputs(ms.load(out), torch.tensor([[1, 2, 3]]))
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1] / "src"), OMP_NUM_THREADS="1")
    for _ in range(3):
        r = subprocess.run([sys.executable, "-c", KILLED_SAVE, str(out), "2", str(delay)], env=env, timeout=120,
                           capture_output=True)
        assert r.returncode == -signal.SIGKILL, r.stderr.decode()[-2000:]
        now = outputs(ms.load(out), torch.tensor([[1, 2, 3]]))  # loads, checksums verified: complete
        assert torch.equal(now, old) or torch.equal(now, outputs(tiny_model("llama", seed=2), torch.tensor([[1, 2, 3]])))
    leftovers = [p.name for p in tmp_path.iterdir() if p.name != "m"]
    assert leftovers or not delay  # killed inside the save: its temporary folder was left behind
    ms.save(tiny_model("llama", seed=3), tmp_path / "m", overwrite=True)  # the next write cleans up
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"], leftovers


def test_a_displaced_old_folder_is_put_back_when_the_swap_was_cut(tmp_path, monkeypatch):
    """Where the file system cannot exchange two folders in one step, a kill between the two renames leaves the
    old folder under a temporary name: the next write of that output puts it back before anything else."""
    import mlpsurgery.files as files

    out = ms.save(tiny_model("llama", seed=1), tmp_path / "m")
    ref = outputs(ms.load(out), torch.tensor([[4, 5]]))
    monkeypatch.setattr(files, "_exchange", lambda a, b: False)
    real_replace = os.replace
    calls = []

    def crash_after_first(src, dst):
        moving_out = Path(src) == out
        real_replace(src, dst)
        if moving_out:
            calls.append(src)
            raise KeyboardInterrupt  # the process dies right after moving the old folder away

    monkeypatch.setattr(files.os, "replace", crash_after_first)
    with pytest.raises(KeyboardInterrupt):
        ms.save(tiny_model("llama", seed=2), out, overwrite=True)
    monkeypatch.setattr(files.os, "replace", real_replace)
    assert not out.exists()
    old = [p for p in tmp_path.iterdir() if ".old-" in p.name]
    assert len(old) == 1
    # the process that left it is gone (simulated: its pid is this one, which is allowed to clean its own)
    files.clean_leftovers(out)
    assert torch.equal(outputs(ms.load(out), torch.tensor([[4, 5]])), ref)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def test_atomic_dir_removes_its_temporary_folder_on_error(tmp_path):
    with pytest.raises(RuntimeError):
        with atomic_dir(tmp_path / "x") as tmp:
            (tmp / "half").write_text("1")
            raise RuntimeError("disk full")
    assert list(tmp_path.iterdir()) == []


# ---- loading: heads, damaged folders -----------------------------------------------------------------

def test_a_folder_loads_as_the_class_its_config_names(tmp_path, capsys):
    """A sequence classifier keeps its head (eval acc uses it), a masked LM keeps lm_head through lock + unlock."""
    cls = tiny_model("bert", task="classifier", num_labels=8)
    cls.save_pretrained(tmp_path / "cls")
    byte_tokenizer().save_pretrained(tmp_path / "cls")
    loaded = load_model(tmp_path / "cls")
    assert type(loaded.model) is T.BertForSequenceClassification
    assert torch.equal(loaded.model.classifier.weight, cls.classifier.weight)

    torch.manual_seed(0)
    mlm = T.RobertaForMaskedLM(tiny_model("roberta").config).eval()
    mlm.save_pretrained(tmp_path / "mlm")
    byte_tokenizer().save_pretrained(tmp_path / "mlm")
    code, _, err = run(capsys, "lock", "key", tmp_path / "mlm", "--out", tmp_path / "locked", "--key",
                       tmp_path / "k.key", "--ratio", "0.1")
    assert code == 0, err
    code, _, err = run(capsys, "unlock", tmp_path / "locked", "--key", tmp_path / "k.key", "--out", tmp_path / "back")
    assert code == 0, err
    back = load_model(tmp_path / "back").model
    assert type(back) is T.RobertaForMaskedLM
    ref = mlm.state_dict()
    got = back.state_dict()
    assert set(got) == set(ref) and all(torch.equal(got[k], ref[k]) for k in ref)


@pytest.mark.parametrize("damage", ["no-config", "bad-json", "no-model-type", "auto-map", "weights-dir",
                                    "truncated-weights", "fake-gguf", "not-gguf-file"])
def test_damaged_model_inputs_get_a_one_line_refusal(tmp_path, capsys, damage):
    folder = tmp_path / "hf"
    tiny_model("gpt2").save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    cfg = json.loads((folder / "config.json").read_text())
    target = folder
    if damage == "no-config":
        (folder / "config.json").unlink()
    elif damage == "bad-json":
        (folder / "config.json").write_text("{ not json")
    elif damage == "no-model-type":
        cfg.pop("model_type")
        (folder / "config.json").write_text(json.dumps(cfg))
    elif damage == "auto-map":
        cfg["auto_map"] = {"AutoModelForCausalLM": "modeling_x.X"}
        (folder / "config.json").write_text(json.dumps(cfg))
    elif damage == "weights-dir":
        (folder / "model.safetensors").unlink()
        (folder / "model.safetensors").mkdir()
    elif damage == "truncated-weights":
        w = folder / "model.safetensors"
        w.write_bytes(w.read_bytes()[: w.stat().st_size // 2])
    elif damage == "fake-gguf":
        target = tmp_path / "model.gguf"
        target.write_bytes(b"NOTGGUF" + b"\0" * 100)
    else:
        target = tmp_path / "weights.bin"
        target.write_bytes(b"\0" * 10)
    code, _, err = run(capsys, "eval", "ppl", target, "--max-tokens", "16", "--quiet")
    assert one_line(code, err), err
    assert not [p for p in tmp_path.iterdir() if p.name not in ("hf", "model.gguf", "weights.bin")]


def test_an_unsupported_architecture_is_one_line(tmp_path, capsys):
    cfg = T.T5Config(d_model=32, d_ff=64, num_layers=1, num_heads=2, vocab_size=300, d_kv=16)
    T.T5ForConditionalGeneration(cfg).save_pretrained(tmp_path / "t5")
    code, _, err = run(capsys, "inspect", tmp_path / "t5")
    assert one_line(code, err) and "not supported" in err
    code, _, err = run(capsys, "lock", "dlr", tmp_path / "t5", "--out", tmp_path / "o")
    assert one_line(code, err) and not (tmp_path / "o").exists() and not (tmp_path / "o.work").exists()


def test_an_edited_config_or_manifest_does_not_load_as_another_model(tmp_path):
    out = ms.save(tiny_model("llama"), tmp_path / "m")
    cfg = json.loads((out / "config.json").read_text())
    cfg["rope_theta"] = 5.0  # loads in transformers, changes every logit
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(MLPSurgeryError, match="config.json does not match the checksum"):
        ms.load(out)
    out2 = ms.save(tiny_model("llama"), tmp_path / "m2")
    man = json.loads((out2 / "surgery.json").read_text())
    man["dtype"] = "float16"
    (out2 / "surgery.json").write_text(json.dumps(man))
    with pytest.raises(MLPSurgeryError, match="its own checksum"):
        ms.load(out2)


def test_manifests_name_the_source_without_a_local_path(tmp_path):
    tiny_model("llama").save_pretrained(tmp_path / "private" / "alice-model")
    byte_tokenizer().save_pretrained(tmp_path / "private" / "alice-model")
    loaded = load_model(tmp_path / "private" / "alice-model")
    out = ms.save(loaded.model, tmp_path / "m", tokenizer=loaded.tokenizer)
    text = (out / "surgery.json").read_text() + (out / "config.json").read_text()
    assert str(tmp_path) not in text
    source = json.loads((out / "surgery.json").read_text())["source"]
    assert source["name"] == "alice-model" and len(source["fingerprint"]) == 64


@pytest.mark.parametrize("argv,needle", [
    (["eval", "ppl", "tiny:llama", "--stride", "0"], "--stride: must be >= 1"),
    (["eval", "ppl", "tiny:llama", "--batch-size", "0"], "--batch-size: must be >= 1"),
    (["eval", "ppl", "tiny:gpt2", "--block-len", "100000"], "exceeds the model's context"),
    (["eval", "cost", "tiny:llama", "--seq-len", "100000"], "--seq-len 100000 exceeds"),
    (["eval", "cost", "tiny:llama", "--repeats", "0"], "--repeats: must be >= 1"),
    (["inspect", "tiny:llama", "--context", "-1"], "--context: must be >= 1"),
    (["nest", "tiny:llama", "--out", "{out}", "--train-steps", "-5"], "--train-steps: must be >= 0"),
    (["lock", "dlr", "tiny:llama", "--out", "{out}", "--rank", "0"], "--rank: must be >= 1"),
    (["lock", "dlr", "tiny:gpt2", "--out", "{out}", "--block-len", "5000"], "exceeds the model's context"),
    (["lock", "key", "tiny:llama", "--out", "{out}", "--key", "{key}", "--ratio", "nan"], "NaN"),
    (["twist", "train", "tiny:llama", "--out", "{out}", "--keep", "0"], "--keep: must be >= 1"),
    (["prune", "tiny:llama", "--method", "magnitude", "--sparsity", "1.5", "--out", "{out}"], "--sparsity"),
    (["fuse", "tiny:llama", "--out", "{out}", "--width", "-3"], "--width: must be >= 1"),
])
def test_numeric_flags_out_of_range_are_refused_before_any_work(tmp_path, capsys, argv, needle):
    argv = [a.format(out=tmp_path / "o", key=tmp_path / "k") for a in argv]
    code, _, err = run(capsys, *argv)
    assert one_line(code, err) and needle in err, err
    assert list(tmp_path.iterdir()) == []


def test_leftovers_of_a_dead_writer_are_finished_only_when_marked(tmp_path):
    """A temporary sibling left by a killed process (dead pid): removed by the next write when it carries the
    marker (mlpsurgery deletes its folders marker last, so a cut-short deletion keeps it), kept otherwise."""
    from mlpsurgery.files import mark

    dead = 2 ** 22 + 12345  # above any pid this machine hands out (pid_max <= 2**22)
    ours = tmp_path / f".m.tmp-{dead}-0a0b"
    ours.mkdir()
    mark(ours, "model")
    (ours / "model.safetensors").write_bytes(b"half")
    theirs = tmp_path / f".m.tmp-{dead}-ffff"
    theirs.mkdir()
    (theirs / "notes.txt").write_text("not mlpsurgery's")
    ms.save(tiny_model("llama"), tmp_path / "m")
    assert not ours.exists() and (theirs / "notes.txt").read_text() == "not mlpsurgery's"
