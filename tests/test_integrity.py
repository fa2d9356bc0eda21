"""Damaged state files are refused in one line (exit status 2, the file and the fix named, no traceback), never used
or resumed silently, and the user's files are left as they were (issue 48): capture chunks of a DLR work folder,
`attack dlr` results, a saved folder whose manifest no longer lists its weights, training checkpoints. And a run of
days says so after its first step."""

import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import mlpsurgery as ms
from conftest import edit_manifest, one_line, run, snapshot
from mlpsurgery.checksums import sidecar
from mlpsurgery.cli import main
from mlpsurgery.errors import IntegrityError
from mlpsurgery.tiny import byte_tokenizer, tiny_model
from mlpsurgery.train import FitConfig, StopTraining, fit, long_run_message


def flip(path: Path, at: int = -1) -> None:
    """Flip one bit of a file in place (its last byte by default: tensor data, not the safetensors header)."""
    data = bytearray(path.read_bytes())
    data[at] ^= 1
    path.write_bytes(bytes(data))


SMALL = ["--rank", "4", "--calib-blocks", "4", "--block-len", "32", "--phase1-steps", "2", "--phase1-tokens", "32",
         "--no-compile", "--phase2-steps", "2", "--phase2-blocks", "2", "--phase2-batch", "1", "--top-k", "4",
         "--eval-tokens", "0", "--quiet"]
LOCK = ["lock", "dlr", "tiny:llama", "--keep-work", *SMALL]


@pytest.fixture(scope="module")
def locked(tmp_path_factory):
    """A tiny DLR lock, O, with its work folder kept, O.work (captured chunks, stages, training checkpoints)."""
    base = tmp_path_factory.mktemp("locked")
    assert main([*LOCK, "--out", str(base / "O")]) == 0
    return base


def copy_of(locked: Path, tmp_path: Path) -> Path:
    """The lock and its work folder copied into tmp_path (each test damages its own copy)."""
    for name in ("O", "O.work"):
        shutil.copytree(locked / name, tmp_path / name, symlinks=True)
    return tmp_path / "O"


# ---- 1. capture chunks carry their size and SHA-256 ---------------------------------------------------------------

@pytest.mark.parametrize("damage", ["truncated", "edited", "no-checksum"])
def test_a_damaged_capture_chunk_of_a_dlr_work_folder_is_refused(locked, tmp_path, capsys, damage):
    out = copy_of(locked, tmp_path)
    work = tmp_path / "O.work"
    chunk = work / "capture" / "chunk_00000.safetensors"
    assert json.loads(sidecar(chunk).read_text())["size"] == chunk.stat().st_size
    if damage == "truncated":
        os.truncate(chunk, chunk.stat().st_size // 2)
    elif damage == "edited":
        flip(chunk)
    else:  # as a work folder written before checksums holds it
        sidecar(chunk).unlink()
    before, work_before = snapshot(out), snapshot(work)
    code, _, err = run(capsys, *LOCK, "--out", out, "--overwrite")
    assert one_line(code, err), err
    assert str(chunk) in err and f"remove the work folder {work} to start afresh" in err, err
    assert {"truncated": "truncated", "edited": "SHA-256", "no-checksum": "has no checksum"}[damage] in err
    assert snapshot(out) == before and snapshot(work) == work_before  # nothing replaced, nothing recomputed


def test_a_capture_chunk_is_checked_when_it_is_read_back(tmp_path):
    from mlpsurgery.capture import capture_mlp_io, open_capture

    blocks = torch.randint(0, 200, (4, 16), generator=torch.Generator().manual_seed(0))
    cap = capture_mlp_io(tiny_model("llama"), blocks, batch_size=2, out_dir=tmp_path / "cap", progress=False)
    chunk = tmp_path / "cap" / "chunk_00001.safetensors"
    flip(chunk)
    with pytest.raises(IntegrityError, match="SHA-256.*remove the capture folder"):
        cap.chunk(1)
    os.truncate(chunk, 100)
    with pytest.raises(IntegrityError, match="truncated"):
        open_capture(tmp_path / "cap")


# ---- 2. attack dlr results ---------------------------------------------------------------------------------------

def test_a_damaged_attack_result_is_refused(locked, tmp_path, capsys):
    att = tmp_path / "att"
    attack = ["attack", "dlr", locked / "O", "--out", att, "--attacks", "finetune", "--lrs", "1e-4", "--batch", "1",
              "--block-len", "32", "--train-blocks", "4", "--eval-blocks", "1", "--steps", "2", "--quiet"]
    assert run(capsys, *attack)[0] == 0
    result = next(att.glob("finetune*locked.json"))
    for damaged in (result.read_bytes()[: result.stat().st_size // 2], b"{}"):  # truncated; valid JSON, no result
        result.write_bytes(damaged)
        before = snapshot(att)
        code, _, err = run(capsys, *attack)
        assert one_line(code, err), err
        assert f"{result} is damaged" in err and f"remove the results folder {att}" in err, err
        assert snapshot(att) == before


# ---- 3. the weights of a saved folder are verified whatever the manifest's `files` says ---------------------------

def test_weights_dropped_from_the_manifest_are_still_verified(tmp_path, capsys):
    folder = ms.save(tiny_model("llama"), tmp_path / "m", tokenizer=byte_tokenizer())
    flip(folder / "model.safetensors")
    edit_manifest(folder, lambda m: m["files"].pop("model.safetensors"))  # and re-signed, as the loader checks it
    before = snapshot(folder)
    with pytest.raises(IntegrityError, match="does not match the checksum"):
        ms.load(folder)
    code, _, err = run(capsys, "eval", "ppl", folder, "--max-tokens", "16", "--quiet")
    assert one_line(code, err) and str(folder / "model.safetensors") in err, err
    assert snapshot(folder) == before


def test_every_weights_file_of_a_saved_folder_must_be_listed(tmp_path, capsys):
    folder = ms.save(tiny_model("llama"), tmp_path / "m", tokenizer=byte_tokenizer())
    ms.load(folder)
    # a shard and an index planted beside the weights (the layer-by-layer reader would read them)
    shutil.copy(folder / "model.safetensors", folder / "model-00001-of-00001.safetensors")
    code, _, err = run(capsys, "eval", "ppl", folder, "--max-tokens", "16", "--quiet")
    assert one_line(code, err) and "model-00001-of-00001.safetensors holds weights but is not listed" in err, err
    (folder / "model-00001-of-00001.safetensors").unlink()
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "../elsewhere.safetensors"}}))
    with pytest.raises(IntegrityError, match="not listed"):
        ms.load(folder)
    (folder / "model.safetensors.index.json").unlink()
    edit_manifest(folder, lambda m: m.update(weights_sha256="0" * 64))  # the two records disagree
    with pytest.raises(IntegrityError, match="weights_sha256 differ"):
        ms.load(folder)


# ---- 4. training checkpoints carry checksums ----------------------------------------------------------------------

@pytest.mark.parametrize("damage", ["flipped", "no-checksums"])
def test_a_damaged_training_checkpoint_is_refused_not_resumed(locked, tmp_path, capsys, damage):
    out = copy_of(locked, tmp_path)
    ckpt = tmp_path / "O.work" / "phase2_ckpt"
    if damage == "flipped":
        flip(ckpt / "tensors.safetensors")  # a weight's bit: the file still parses
    else:  # as a checkpoint written before checksums holds it
        (ckpt / "checksums.json").unlink()
    before, ckpt_before = snapshot(out), snapshot(ckpt)
    code, _, err = run(capsys, *LOCK, "--out", out, "--overwrite")
    assert one_line(code, err), err
    assert f"remove the checkpoint folder {ckpt} to start that training afresh" in err, err
    assert (f"{ckpt / 'tensors.safetensors'} is damaged" if damage == "flipped" else "has no checksums") in err
    assert snapshot(out) == before and snapshot(ckpt) == ckpt_before


def _read_until(proc, needle: str, seconds: float) -> str:
    """What the process wrote on stderr until `needle` appeared (or the time ran out, or it ended)."""
    text, end = b"", time.monotonic() + seconds
    fd = proc.stderr.fileno()
    while needle.encode() not in text and time.monotonic() < end:
        ready, _, _ = select.select([fd], [], [], 1.0)
        if ready:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            text += chunk
    return text.decode(errors="replace")


def test_a_run_of_days_says_so_then_a_flipped_checkpoint_byte_is_refused(tmp_path):
    """`nest` with 100,000,000 steps: the estimate comes after the first step; Ctrl-C keeps a checkpoint; one bit
    flipped in it, the same command is refused instead of resuming."""
    cmd = [sys.executable, "-m", "mlpsurgery", "nest", "tiny:llama", "--out", str(tmp_path / "O"), "--train-steps",
           "100000000", "--data-free", "--batch-size", "1", "--block-len", "16"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MLPSURGERY_STAGE_DELAY": "100"}
    # Ctrl-C as at a terminal: a suite started in the background (`cmd &`) hands its children SIGINT ignored
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=tmp_path,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        text = _read_until(proc, "Ctrl-C stops it", 240)
        proc.send_signal(signal.SIGINT)
        _, rest = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert re.search(r"at [0-9.]+ s a step, 100,000,000 steps take about [0-9,.]+ (hours|days|years); Ctrl-C stops "
                     r"it, and the same command resumes it from its checkpoint", text), text[-2000:]
    assert proc.returncode == 130, (text + rest.decode())[-2000:]
    ckpt = tmp_path / "O.ckpt"
    assert (ckpt / "checksums.json").is_file() and not (tmp_path / "O").exists()
    flip(ckpt / "tensors.safetensors")
    before = snapshot(ckpt)
    again = subprocess.run(cmd + ["--quiet"], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=240)
    assert again.returncode == 2 and len(again.stderr.strip().splitlines()) == 1, again.stderr[-2000:]
    assert f"{ckpt / 'tensors.safetensors'} is damaged" in again.stderr
    assert f"remove the checkpoint folder {ckpt}" in again.stderr
    assert snapshot(ckpt) == before and not (tmp_path / "O").exists()


# ---- 5. a long run says so after its first step -------------------------------------------------------------------

def test_the_long_run_estimate():
    assert long_run_message(0.12, 100_000_000) == ("at 0.12 s a step, 100,000,000 steps take about 139 days; Ctrl-C "
                                                   "stops it, and the same command resumes it from its checkpoint")
    assert long_run_message(0.12, 30_000) is None  # one hour at most: nothing said
    assert "1,900 steps left take about 1.3 hours" in long_run_message(2.5, 2000, resumed_from=100)
    assert "years" in long_run_message(40.0, 10**7) and "no checkpoint" in long_run_message(1, 10**5, checkpoint=False)


@pytest.mark.parametrize("progress", [True, False])
def test_fit_says_how_long_a_huge_run_takes_unless_quiet(capsys, progress):
    w = torch.nn.Parameter(torch.zeros(4))

    def loss_fn(step):
        if step == 1:
            raise StopTraining("enough")  # (the run is real; it is ended after its first step)
        return (w - 1).pow(2).sum()

    res = fit({"w": w}, loss_fn, FitConfig(steps=10**13), progress=progress, desc="probe")
    assert res.stopped_early == "enough" and len(res.history) == 1
    err = capsys.readouterr().err
    said = re.search(r"mlpsurgery: probe: at \S+ s a step, 10,000,000,000,000 steps take about [0-9,.]+ (hours|days|"
                     r"years); Ctrl-C stops it, and this run keeps no checkpoint", err)
    assert bool(said) == progress, err
