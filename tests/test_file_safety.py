"""Issue 48: the ways `--overwrite`, races, odd paths, full disks and killed runs could still lose or damage a
user's file. Each case runs its exact command and checks: exit 2, one line naming the problem and the fix,
nothing written, no temporary file left, the user's files byte for byte as before."""

import contextlib
import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import mlpsurgery as ms
from mlpsurgery import files
from mlpsurgery.errors import MLPSurgeryError
from mlpsurgery.files import MARKER, atomic_dir, claim, is_ours
from mlpsurgery.tiny import tiny_model

from conftest import one_line, run, snapshot

DEAD = 2 ** 22 + 4321  # above any pid this machine hands out (pid_max <= 2**22)
TEXT = "It is a truth universally acknowledged that a single man in possession of a good fortune must be in want. " * 40


def cli_env():
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[1] / "src")}


def cli_proc(*argv, cwd=None, **kw):
    return subprocess.Popen([sys.executable, "-m", "mlpsurgery", *map(str, argv)], cwd=cwd, env=cli_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


PRUNE = ["prune", "tiny:llama", "--method", "magnitude", "--sparsity", "0.5", "--quiet"]


# ---- data loss ----------------------------------------------------------------------------------------------

def test_a_key_never_replaces_the_training_text(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("corpus.txt").write_text(TEXT)
    before = snapshot(tmp_path)
    code, _, err = run(capsys, "lock", "key", "tiny:llama", "--out", "o", "--key", "corpus.txt", "--data",
                       "corpus.txt", "--overwrite", "--ratio", "0.05")
    assert one_line(code, err) and "is the input" in err, err
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("content", [b"", b"{}", b"garbage \x00\xff", b'{"created_by": "mlpsurgery"}',
                                     b'{"created_by": "mlpsurgery", "kind": "model", "check": "0000"}'])
def test_an_empty_garbage_or_edited_marker_does_not_make_a_folder_ours(tmp_path, capsys, monkeypatch, content):
    monkeypatch.chdir(tmp_path)
    Path("mine").mkdir()
    Path("mine/precious.txt").write_text("p")
    Path("mine", MARKER).write_bytes(content)
    before = snapshot(tmp_path)
    code, _, err = run(capsys, *PRUNE, "--out", "mine", "--overwrite")
    assert one_line(code, err) and "not written by mlpsurgery" in err, err
    assert snapshot(tmp_path) == before and not is_ours("mine")


def test_a_marker_mlpsurgery_wrote_is_still_ours_and_an_edit_to_it_is_not(tmp_path):
    files.mark(tmp_path, "model", {"a": 1})
    assert is_ours(tmp_path) and files.marker(tmp_path)["settings"] == {"a": 1}
    body = json.loads((tmp_path / MARKER).read_text())
    body["kind"] = "checkpoint"  # a marker edited by hand: its digest no longer matches
    (tmp_path / MARKER).write_text(json.dumps(body))
    assert not is_ours(tmp_path)
    del body["check"]  # a marker from before the digest existed: a well-formed one is accepted
    (tmp_path / MARKER).write_text(json.dumps(body))
    assert is_ours(tmp_path)


def test_overwrite_replaces_an_earlier_key_and_no_other_file(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("notes.txt").write_text("my notes")
    before = snapshot(tmp_path)
    code, _, err = run(capsys, "lock", "key", "tiny:llama", "--out", "o", "--key", "notes.txt", "--overwrite",
                       "--ratio", "0.05")
    assert one_line(code, err) and "is not a key mlpsurgery wrote" in err, err
    assert snapshot(tmp_path) == before
    # a key of ours is replaced (and its locked folder), as --overwrite says
    code, _, err = run(capsys, "lock", "key", "tiny:llama", "--out", "o", "--key", "k.key", "--ratio", "0.05",
                       "--quiet")
    assert code == 0, err
    first = Path("k.key").read_bytes()
    code, _, err = run(capsys, "lock", "key", "tiny:llama", "--out", "o", "--key", "k.key", "--ratio", "0.1",
                       "--overwrite", "--quiet")
    assert code == 0 and Path("k.key").read_bytes() != first, err


def test_a_plot_path_replaces_an_earlier_plot_and_no_other_file(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("notes.png").write_bytes(b"\x89PNG my own picture")
    before = snapshot(tmp_path)
    code, _, err = run(capsys, "eval", "cost", "tiny:llama", "--plot", "notes.png", "--repeats", "1")
    assert one_line(code, err) and "is not a plot mlpsurgery wrote" in err, err
    assert snapshot(tmp_path) == before


# ---- races ----------------------------------------------------------------------------------------------------

def test_a_folder_that_appears_during_the_run_is_never_replaced(tmp_path):
    """Two runs with one --out and no --overwrite: both pass the start's check; the later swap must refuse."""
    out = tmp_path / "same"
    with pytest.raises(MLPSurgeryError, match="created by someone else"):
        with atomic_dir(out) as tmp:
            (tmp / "model.safetensors").write_bytes(b"ours")
            out.mkdir()  # the other run finished first (its folder is even marked as ours)
            files.mark(out, "model")
            (out / "theirs.txt").write_text("the other run's result")
    assert (out / "theirs.txt").read_text() == "the other run's result"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["same"]


def test_two_prunes_to_one_out_leave_one_complete_folder_and_one_refusal(tmp_path):
    procs = [cli_proc(*PRUNE, "--out", "same", "--seed", str(i), cwd=tmp_path) for i in range(2)]
    results = [(p.wait(timeout=300), p.stderr.read()) for p in procs]
    codes = sorted(c for c, _ in results)
    assert codes == [0, 2], results
    err = next(e for c, e in results if c == 2)
    assert len(err.strip().splitlines()) == 1 and ("created by someone else" in err or "already exists" in err), err
    assert ms.load(tmp_path / "same") is not None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["same"]


HOLD = """
import sys, time
from mlpsurgery.files import claim
claim(sys.argv[1], "dlr-work", {"x": 1})
print("held", flush=True)
time.sleep(120)
"""


def test_a_work_folder_in_use_by_another_process_is_refused(tmp_path):
    work = tmp_path / "d.work"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(work)], env=cli_env(), stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(MLPSurgeryError, match="in use by another mlpsurgery process"):
            claim(work, "dlr-work", {"x": 1})
    finally:
        holder.kill()
        holder.wait()
    assert claim(work, "dlr-work", {"x": 1})  # free again once the holder is gone: resumed
    assert claim(work, "dlr-work", {"x": 1})  # and this process may ask again (a resume within one run)


def test_two_dlr_locks_on_one_out_do_not_share_the_work_folder(tmp_path, capsys):
    holder = subprocess.Popen([sys.executable, "-c", HOLD.replace('"dlr-work", {"x": 1}', '"dlr-work", {}'),
                               str(tmp_path / "d.work")], env=cli_env(), stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        before = snapshot(tmp_path)
        code, _, err = run(capsys, "lock", "dlr", "tiny:llama", "--out", tmp_path / "d", "--rank", "4",
                           "--block-len", "64",
                           "--phase1-steps", "2", "--phase2-steps", "0", "--quiet")
        assert one_line(code, err) and "in use by another mlpsurgery process" in err, err
        assert snapshot(tmp_path) == before
    finally:
        holder.kill()
        holder.wait()


# ---- wrongly accepted -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("workdir", ["d", "d/w"])
def test_a_workdir_equal_to_or_inside_out_is_refused_before_any_work(tmp_path, capsys, monkeypatch, workdir):
    monkeypatch.chdir(tmp_path)
    t0 = time.perf_counter()
    code, _, err = run(capsys, "lock", "dlr", "tiny:llama", "--out", "d", "--workdir", workdir, "--rank", "4")
    assert one_line(code, err) and "--workdir" in err and "--out" in err, err
    assert time.perf_counter() - t0 < 30 and list(tmp_path.iterdir()) == []


def test_a_symlinked_out_writes_the_folder_it_points_to_and_keeps_the_link(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ms.save(tiny_model("gpt2"), "real")
    os.symlink("real", "link")
    code, _, err = run(capsys, *PRUNE, "--out", "link", "--overwrite")
    assert code == 0, err
    assert os.readlink("link") == "real" and ms.load("real").config.model_type == "llama"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "real"]
    os.mkdir("empty")  # a link to an empty folder (a traceback before)
    os.symlink("empty", "elink")
    code, _, err = run(capsys, *PRUNE, "--out", "elink")
    assert code == 0 and (tmp_path / "empty" / "model.safetensors").is_file(), err


# ---- odd paths ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("out, needle", [(".", "the folder this command runs in"), ("", "is empty"),
                                         ("x" * 300, "give a shorter name"), ("x" * 240, "give a shorter name")])
def test_odd_out_paths_are_one_line(tmp_path, capsys, monkeypatch, out, needle):
    (tmp_path / "empty").mkdir()
    monkeypatch.chdir(tmp_path / "empty")
    code, _, err = run(capsys, *PRUNE, "--out", out)
    assert one_line(code, err) and needle in err, err
    assert list((tmp_path / "empty").iterdir()) == []


@contextlib.contextmanager
def small_disk(path: Path, kib: int, readonly: bool = False):
    """A real file system of `kib` KiB (tmpfs) at `path`: a full disk, or a read-only one. Needs root (skips
    otherwise; the file-size-limit test below covers the same path without it)."""
    path.mkdir()
    opts = f"size={kib}k" + (",ro" if readonly else "")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a small file system here ({r.stderr.decode().strip()[:80]})")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def test_a_workdir_on_a_read_only_file_system_is_refused_before_any_work(tmp_path, capsys):
    with small_disk(tmp_path / "ro", 64, readonly=True) as ro:
        code, _, err = run(capsys, "lock", "dlr", "tiny:llama", "--out", tmp_path / "d", "--workdir", ro / "w",
                           "--rank", "4")
        assert one_line(code, err) and "writable" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ro"]


@pytest.mark.parametrize("argv", [
    [*PRUNE, "--out", "{disk}/o"],
    ["lock", "key", "tiny:llama", "--out", "{disk}/l", "--key", "{disk}/k.key", "--ratio", "0.05", "--quiet"],
    ["nest", "tiny:llama", "--out", "{here}/n", "--checkpoint", "{disk}/ck", "--train-steps", "2", "--quiet"],
])
def test_a_full_disk_is_one_line_and_leaves_nothing_half_written(tmp_path, capsys, argv):
    with small_disk(tmp_path / "disk", 100) as disk:
        (disk / "mine.txt").write_text("mine")
        argv = [a.format(disk=disk, here=tmp_path) for a in argv]
        code, _, err = run(capsys, *argv)
        assert one_line(code, err) and "no space left" in err, err
        assert sorted(p.name for p in disk.iterdir()) in (["mine.txt"], ["ck", "mine.txt"])  # ck: a checkpoint
        assert (disk / "mine.txt").read_text() == "mine"  # folder that resumes (marked, nothing half-written)
        if (disk / "ck").exists():
            assert is_ours(disk / "ck") and not [p for p in (disk / "ck").rglob("*") if ".tmp-" in p.name]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["disk"]


def _limit_file_size():
    resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)


def test_a_file_size_limit_is_one_line_and_leaves_nothing(tmp_path):
    """The full-disk path without root: writes beyond `ulimit -f` fail (EFBIG) the way a full disk does."""
    p = cli_proc(*PRUNE, "--out", "o", cwd=tmp_path, preexec_fn=_limit_file_size)
    code, err = p.wait(timeout=300), p.stderr.read()
    assert code == 2 and len(err.strip().splitlines()) == 1 and "size limit" in err, err
    assert list(tmp_path.iterdir()) == []


# ---- leftovers of killed runs ---------------------------------------------------------------------------------

def test_a_complete_temporary_folder_of_a_killed_run_goes_with_the_next_write_beside_it(tmp_path, capsys):
    left = tmp_path / f".other.tmp-{DEAD}-0a0b0c0d"
    ms.save(tiny_model("llama"), tmp_path / "x")
    (tmp_path / "x").rename(left)  # a complete folder of ours, never swapped into place: the run was killed
    theirs = tmp_path / f".notes.tmp-{DEAD}-0a0b0c0d"
    theirs.write_text("the user's own file with an unlucky name")
    code, _, err = run(capsys, *PRUNE, "--out", tmp_path / "o")
    assert code == 0 and "removed" in err and str(left) in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == [theirs.name, "o"]


def test_a_staged_key_is_mentioned_and_kept_and_a_half_written_one_removed(tmp_path, capsys):
    code, _, err = run(capsys, "lock", "key", "tiny:llama", "--out", tmp_path / "l", "--key", tmp_path / "k.key",
                       "--ratio", "0.05", "--quiet")
    assert code == 0, err
    staged = tmp_path / f"k.key.staged-{DEAD}-0a0b0c0d"  # killed between writing its folder and placing its key
    (tmp_path / "k.key").rename(staged)
    half = tmp_path / f".k.key.staged-{DEAD}-1a1b1c1d.tmp-{DEAD}-2a2b2c2d"  # killed while staging the key
    half.write_bytes(staged.read_bytes()[:100])
    code, _, err = run(capsys, "lock", "key", "tiny:llama", "--out", tmp_path / "l", "--key", tmp_path / "k.key",
                       "--ratio", "0.05", "--overwrite", "--quiet")
    assert code == 0 and str(staged) in err and "only key" in err, err
    assert staged.is_file() and not half.exists() and (tmp_path / "k.key").is_file()
