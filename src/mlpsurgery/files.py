"""What mlpsurgery may write, replace and delete on the user's disk, and how.

Rules (every command follows them; tests/test_files.py holds each one):
- Every folder mlpsurgery creates carries a marker file (`.mlpsurgery`, JSON: kind, and for resumable
  folders the settings they were made with). Only a marked folder is ever replaced (`--overwrite`) or
  deleted; a folder without the marker belongs to the user and is refused.
- An output is never the same as, inside, or above any input (the model folder, a data file, a key,
  a work folder): writing it could destroy or alter what it is made from.
- Folders are written under a temporary sibling name and swapped into place in one step (Linux
  renameat2 RENAME_EXCHANGE, else two renames that the next run completes), so a crash leaves either no
  output or the complete old one. Temporary folders left by a killed process are removed by the next
  write to the same place.
- Folders get the user's normal permissions (umask); secrets (keys) are written 0600.
- A resumable folder (work folders, checkpoints, attack results) records its kind and settings, model
  fingerprint included; reusing it with other settings or another model is refused, never mixed.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import hashlib
import json
import os
import re
import secrets
import shutil
from pathlib import Path
from typing import Iterable

import torch
from torch import nn

from .errors import MLPSurgeryError

MARKER = ".mlpsurgery"
# config entries that say where or how a model was loaded, not what it computes
_VOLATILE = ("_name_or_path", "transformers_version", "torch_dtype", "dtype", "_commit_hash", "auto_map",
             "architectures", "_attn_implementation_autoset")
_TMP, _OLD = ".tmp-", ".old-"


# --------------------------------------------------------------------------------------------------
# Ownership


def _marker_check(body: dict) -> str:
    """The digest a marker carries of its own content: an edited, truncated or hand-made marker does not match."""
    rest = {k: v for k, v in body.items() if k != "check"}
    return hashlib.sha256(("mlpsurgery-marker|" + json.dumps(rest, sort_keys=True, default=str)).encode()).hexdigest()


def mark(folder: str | Path, kind: str, settings: dict | None = None, adopted: bool = False) -> None:
    """Write the marker that says mlpsurgery created `folder` (and with which settings). adopted: the folder
    itself was there already, empty (the user's): what mlpsurgery puts in it is its own, the folder is not, so
    removing it empties it and leaves it in place."""
    body = {"created_by": "mlpsurgery", "kind": kind}
    if settings is not None:
        body["settings"] = json.loads(json.dumps(settings, sort_keys=True, default=str))
    if adopted:
        body["adopted"] = True
    body["check"] = _marker_check(body)
    write_text(Path(folder) / MARKER, json.dumps(body, indent=1, sort_keys=True, default=str))


def marker(folder: str | Path) -> dict | None:
    """The folder's marker, or None when mlpsurgery did not create it. Only a marker mlpsurgery wrote counts: a
    JSON object naming mlpsurgery and a kind, whose `check` digest matches its content
    (markers written before the digest existed have none). An empty, garbled or edited marker file is not ours,
    so the folder is the user's."""
    path = Path(folder) / MARKER
    try:
        if not path.is_file() or path.is_symlink() or path.stat().st_size > 1 << 20:
            return None
        body = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return None
    if not isinstance(body, dict) or body.get("created_by") != "mlpsurgery" or not isinstance(body.get("kind"), str):
        return None
    if "check" in body and body["check"] != _marker_check(body):
        return None
    return body


def is_ours(folder: str | Path) -> bool:
    return Path(folder).is_dir() and marker(folder) is not None


def _empty_dir(path: Path) -> bool:
    return path.is_dir() and not any(path.iterdir())


def _remove(folder: Path) -> None:
    """Delete a folder of ours, its marker last: a deletion cut short (kill -9) leaves a folder that still says
    it is mlpsurgery's, so the next run may finish the job. An adopted folder (see `mark`) is emptied, not removed."""
    if not folder.is_dir() or folder.is_symlink():
        return
    _release(folder)
    adopted = bool((marker(folder) or {}).get("adopted"))
    for child in folder.iterdir():
        if child.name == MARKER:
            continue
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                child.unlink()
    with contextlib.suppress(OSError):
        (folder / MARKER).unlink()
    if not adopted:
        with contextlib.suppress(OSError):
            folder.rmdir()


def remove_ours(folder: str | Path) -> bool:
    """Delete `folder` if mlpsurgery created it (marker present); leave anything else alone. True if removed."""
    folder = Path(folder)
    if folder.is_symlink() or not is_ours(folder):
        return False
    _remove(folder)
    return True


# --------------------------------------------------------------------------------------------------
# Refusals made before any work starts


def _resolved(path: str | Path) -> Path:
    return Path(os.path.abspath(Path(path).expanduser().resolve()))


def check_apart(out: str | Path, inputs: Iterable[str | Path | None] = (), what: str = "--out") -> None:
    """Refuse an output that is, contains, or lies inside any existing input path."""
    o = _resolved(out)
    for item in inputs:
        if item is None:
            continue
        p = Path(str(item)).expanduser()
        if not p.exists():
            continue
        r = _resolved(p)
        if o == r:
            raise MLPSurgeryError(f"{what} {out} is the input {item}; write the result somewhere else")
        if r in o.parents:
            raise MLPSurgeryError(f"{what} {out} lies inside the input {item}; write the result outside it")
        if o in r.parents:
            raise MLPSurgeryError(f"{what} {out} contains the input {item}, which writing it could destroy; choose "
                                  "a folder that holds no input")


# room kept in a file name for the temporary sibling mlpsurgery writes first (".NAME.tmp-PID-XXXXXXXX")
_TEMP_ROOM = 32


def check_path(path: str | Path, what: str = "--out") -> Path:
    """Refuse a path nothing can be written at: empty, the folder the command runs in or one above it (it
    cannot be swapped out from under the shell), or a name too long for the file system once mlpsurgery's
    temporary suffix is added. Returns the path made absolute (symbolic links kept)."""
    if str(path).strip() == "":
        raise MLPSurgeryError(f"{what} is empty; give a path")
    p = Path(os.path.abspath(Path(path).expanduser()))
    cwd = Path(os.path.abspath(os.getcwd()))
    if p == cwd or p in cwd.parents:
        raise MLPSurgeryError(f"{what} {path} is the folder this command runs in{'' if p == cwd else ' or above it'}; "
                              "give a new folder name (e.g. ./result)")
    parent = next((q for q in p.parents if q.exists()), None)
    try:
        name_max = os.pathconf(parent, "PC_NAME_MAX") if parent is not None and parent.is_dir() else 255
    except (OSError, ValueError):
        name_max = 255
    new_parts = p.relative_to(parent).parts if parent is not None else p.parts
    for part in {*new_parts, p.name} - {""}:
        if len(os.fsencode(part)) + _TEMP_ROOM > name_max:
            raise MLPSurgeryError(f"{what}: the name {part[:40]}... has {len(os.fsencode(part))} bytes; the file system "
                                  f"allows {name_max} and mlpsurgery needs {_TEMP_ROOM} of them for its temporary copy: "
                                  "give a shorter name")
    if len(os.fsencode(str(p))) + _TEMP_ROOM > 4000:
        raise MLPSurgeryError(f"{what}: the path has {len(os.fsencode(str(p)))} bytes, too long for the file system; "
                              "give a shorter one")
    return p


def check_out(out: str | Path, overwrite: bool = False, inputs: Iterable[str | Path | None] = ()) -> None:
    """Refuse an output folder that cannot be written: a file, a non-empty folder (unless --overwrite, and
    then only one mlpsurgery wrote), or a path that is, holds or lies inside an input."""
    check_path(out)
    out = Path(out)
    if out.is_symlink() and not out.exists():
        raise MLPSurgeryError(f"{out} is a broken symbolic link; choose another --out")
    if out.exists():
        if not out.is_dir():
            raise MLPSurgeryError(f"{out} already exists and is a file; choose a folder path for --out")
        if any(out.iterdir()):
            if not overwrite:
                raise MLPSurgeryError(f"{out} already exists and is not empty; choose another --out or pass --overwrite")
            if not is_ours(out):
                raise MLPSurgeryError(f"{out} was not written by mlpsurgery (it has no valid {MARKER} marker), so "
                                      "--overwrite will not replace it; choose another --out or remove it yourself")
    else:
        _check_creatable(out, f"{out} cannot be created", "choose another --out")
    check_apart(out, inputs)


def _check_creatable(path: Path, what: str, fix: str) -> None:
    parent = next((p for p in path.absolute().parents if p.exists()), None)
    if parent is not None and not parent.is_dir():
        raise MLPSurgeryError(f"{what}: {parent} is a file; {fix}")
    if parent is not None and not os.access(parent, os.W_OK | os.X_OK):
        raise MLPSurgeryError(f"{what}: {parent} is not writable; {fix}")


def check_file_out(path: str | Path, overwrite: bool = False, inputs: Iterable[str | Path | None] = (),
                   what: str = "output file", ours=None) -> None:
    """Refuse an output file path that is a folder, exists (unless overwriting, and then only a file `ours`
    recognises as one mlpsurgery wrote: a key, a plot carrying its signature), or is an input."""
    check_path(path, what=f"the {what}")
    path = Path(path)
    if path.is_dir():
        raise MLPSurgeryError(f"the {what} {path} is a folder; give a file path")
    if path.exists() or path.is_symlink():
        if not overwrite:
            raise MLPSurgeryError(f"the {what} {path} already exists; choose another path or pass --overwrite")
        if path.is_symlink() or not path.is_file() or not (ours or file_is_ours)(path):
            raise MLPSurgeryError(f"the {what} {path} exists and is not a {what} mlpsurgery wrote, so it will not be "
                                  "replaced; choose another path or remove it yourself")
    _check_creatable(path, f"the {what} {path} cannot be created", "choose another path")
    check_apart(path, inputs, what=f"the {what}")


# a file mlpsurgery writes and may later replace carries this text near its start or end (a plot's metadata, a
# JSON field); keys are recognised by their own header (methods/corelocker/keyfile.py: is_key_file)
SIGNATURE = "written-by-mlpsurgery"


def file_is_ours(path: str | Path, marks: tuple[str, ...] = (SIGNATURE,), tail: bool = True) -> bool:
    """Whether the file at `path` carries one of `marks` (mlpsurgery's signature) in its first 64 KiB, or (`tail`)
    its last."""
    try:
        with open(path, "rb") as f:
            head = f.read(1 << 16)
            size = os.fstat(f.fileno()).st_size
            if tail and size > 1 << 16:
                f.seek(max(1 << 16, size - (1 << 16)))
                head += f.read(1 << 16)
    except OSError:
        return False
    return any(m.encode() in head for m in marks)


# --------------------------------------------------------------------------------------------------
# Atomic folders


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


_LEFTOVER = re.compile(r"^\.(?P<name>.+)(?P<tag>\.tmp-|\.old-)(?P<pid>\d+)-[0-9a-f]+$")


def _leftovers(folder: Path) -> list[tuple[Path, str, str, int]]:
    """Temporary (.tmp-) and displaced (.old-) entries mlpsurgery's writers leave in `folder` when killed:
    (path, the name they stand for, tag, pid)."""
    found = []
    if not folder.is_dir():
        return found
    for p in folder.glob(".*-*"):
        m = _LEFTOVER.match(p.name)
        if m and not p.is_symlink():
            found.append((p, m["name"], m["tag"], int(m["pid"])))
    return found


def clean_leftovers(out: str | Path) -> None:
    """Finish what killed writers left beside `out` (in its parent folder, for any name): a displaced old folder
    goes back where it was (if nothing replaced it), temporary folders and half-written temporary files are
    removed, each with a note on stderr. Only what is recognisably ours and belongs to a dead process is touched:
    a folder with a valid marker (or empty), a file carrying mlpsurgery's signature (or empty)."""
    out = Path(out)
    for p, name, tag, pid in _leftovers(out.parent):
        if pid == os.getpid():
            if name != out.name:  # this process may be writing it right now (a checkpoint beside --out)
                continue
        elif _pid_alive(pid):
            continue
        target = p.with_name(name)
        if p.is_dir():
            if not (is_ours(p) or _empty_dir(p)):
                continue
            if tag == _OLD and not target.exists() and is_ours(p):
                os.replace(p, target)
                _note(f"put back {target}, which a killed mlpsurgery run (pid {pid}) had moved aside")
            else:
                _remove(p)
                _note(f"removed {p}, left by a killed mlpsurgery run (pid {pid})")
        elif p.is_file() and tag == _TMP and (p.stat().st_size == 0 or _signed(p)):
            with contextlib.suppress(OSError):
                p.unlink()
                _note(f"removed {p}, a file a killed mlpsurgery run (pid {pid}) had half written")


def _signed(path: Path) -> bool:
    """A file mlpsurgery writes: its signature, or a key's format name, in its first 64 KiB."""
    return file_is_ours(path, (SIGNATURE, "mlpsurgery-corelocker-"), tail=False)


def _note(message: str) -> None:
    """A warning on stderr, as report.warn words it (report sits above this module: it writes through it)."""
    import sys

    from tqdm.auto import tqdm

    tqdm.write(f"mlpsurgery: warning: {message}", file=sys.stderr)


def _temp_name(out: Path, tag: str) -> Path:
    return out.with_name(f".{out.name}{tag}{os.getpid()}-{secrets.token_hex(4)}")


_RENAME_NOREPLACE, _RENAME_EXCHANGE = 1, 2


def _renameat2(a: Path, b: Path, flag: int) -> bool:
    """renameat2(a, b, flag) (Linux): True if done, False where the call or the flag is unavailable; an
    OSError for any other failure (EEXIST for RENAME_NOREPLACE onto an existing path)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_fdcwd = -100
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), flag) == 0:
        return True
    err = ctypes.get_errno()
    if err in (22, 38, 95):  # EINVAL, ENOSYS, EOPNOTSUPP: the file system cannot do it
        return False
    raise OSError(err, os.strerror(err), str(b))


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux renameat2). False where the call is unavailable."""
    return _renameat2(a, b, _RENAME_EXCHANGE)


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def normal_permissions(folder: Path) -> None:
    """Give the files written into `folder` the user's usual permissions (some writers, safetensors among them,
    create theirs 0600), so that a model folder handed out is readable like any other file. Keys never pass here."""
    mode = 0o666 & ~_umask()
    for p in folder.rglob("*"):
        if p.is_file() and not p.is_symlink():
            os.chmod(p, mode)


def _appeared(out: Path) -> MLPSurgeryError:
    return MLPSurgeryError(f"{out} was created by someone else while this command ran (another run with the same "
                           "--out?); the result was not written. Choose another --out and run again")


def publish(tmp: Path, out: Path, overwrite: bool = True) -> None:
    """Put the finished folder `tmp` at `out`, replacing an old folder mlpsurgery wrote there (only with
    `overwrite`). Decided at the swap itself, not from what the start of the run saw: a folder that appeared
    meanwhile (another process writing the same --out) is never replaced."""
    if out.exists() and not _empty_dir(out):
        if not overwrite or not is_ours(out):  # appeared while we worked: never replace it
            raise _appeared(out)
        if _exchange(tmp, out):
            _remove(tmp)  # tmp now holds the old folder
            return
        old = _temp_name(out, _OLD)
        os.replace(out, old)
        os.replace(tmp, out)
        _remove(old)
        return
    try:
        if _renameat2(tmp, out, _RENAME_NOREPLACE):
            return
    except FileExistsError:
        if not _empty_dir(out):
            raise _appeared(out) from None
    try:
        os.replace(tmp, out)  # onto nothing, or onto an empty folder (rename fails if it filled meanwhile)
    except OSError as e:
        if e.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.EISDIR, errno.ENOTDIR):
            raise _appeared(out) from None
        raise


@contextlib.contextmanager
def atomic_dir(out: str | Path, overwrite: bool = False, inputs: Iterable[str | Path | None] = (),
               kind: str = "model"):
    """Yield a marked temporary folder beside `out`; on success it replaces `out`, on error it is removed.
    A symbolic link at `out` is followed: the folder it points to is written, the link kept."""
    check_out(out, overwrite, inputs)
    out = Path(os.path.realpath(out)) if Path(out).is_symlink() else Path(os.path.abspath(out))
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise MLPSurgeryError(f"{out.parent} cannot be created ({e.strerror}); choose another --out") from None
    clean_leftovers(out)
    tmp = _temp_name(out, _TMP)
    tmp.mkdir()  # the user's umask applies (mkdtemp would make it 0700)
    try:
        mark(tmp, kind)
        yield tmp
        normal_permissions(tmp)
        publish(tmp, out, overwrite)
    except BaseException:
        _remove(tmp)
        raise


# --------------------------------------------------------------------------------------------------
# Files


def _atomic_bytes(path: Path, data, mode: int | None) -> int:
    """Write `data` (bytes, or an iterable of bytes-like chunks written as they come) to `path` atomically.
    Returns the bytes written."""
    tmp = path.with_name(f".{path.name}{_TMP}{os.getpid()}-{secrets.token_hex(4)}")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
    fd = os.open(tmp, flags, 0o666 if mode is None else mode)
    size = 0
    try:
        with os.fdopen(fd, "wb") as f:
            for chunk in ([data] if isinstance(data, (bytes, bytearray, memoryview)) else data):
                size += f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        if mode is not None:
            os.chmod(tmp, mode)  # in case the umask masked less than asked
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return size


def write_text(path: str | Path, text: str) -> None:
    """Write a text file atomically (a crash leaves the old file or the new one)."""
    _atomic_bytes(Path(path), text.encode(), None)


def write_private(path: str | Path, data) -> int:
    """Write a secret (a key) atomically, readable and writable by its owner only (0600). `data`: bytes, or an
    iterable of chunks (a key streamed, never whole in memory). Returns its size in bytes."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return _atomic_bytes(path, data, 0o600)


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# --------------------------------------------------------------------------------------------------
# Resumable folders


def model_fingerprint(model: nn.Module, skip: Iterable[str] = (), omit: Iterable[str] = ()) -> str:
    """A digest of a model's class, config and weights (per tensor: name, dtype, shape, the float64 sum and
    sum of squares, and 64 evenly spaced values): enough to tell two models apart, in one pass over memory.
    `skip`: tensor names whose values do not count (e.g. what a resumed run restores from its checkpoint);
    `omit`: tensor names left out altogether, names and shapes too (modules that differ in kind from one copy of
    the model to another)."""
    fp = Fingerprint(model, skip)
    omit = set(omit)
    for name, t in model.state_dict().items():
        if name not in omit:
            fp.add(name, t)
    return fp.hexdigest()


class Fingerprint:
    """model_fingerprint fed one tensor at a time, in state-dict order (the layer-sequential mode feeds each
    layer's tensors while the layer is in memory, before any change)."""

    def __init__(self, model: nn.Module, skip: Iterable[str] = ()):
        self.skip = set(skip)
        name = type(model).__name__
        if name.startswith("FSDP") and any(c.__name__ == "FSDPModule" for c in type(model).__mro__):
            name = name[4:]  # sharded by FSDP2 (its class FSDP<class>): the same model as unsharded
        self.h = hashlib.sha256(name.encode())
        cfg = getattr(model, "config", None)
        if cfg is not None and hasattr(cfg, "to_dict"):
            self.h.update(json.dumps({k: v for k, v in cfg.to_dict().items() if k not in _VOLATILE}, sort_keys=True,
                                     default=str).encode())

    def add(self, name: str, t: torch.Tensor) -> None:
        h = self.h
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        if t.numel() == 0 or t.device.type == "meta" or name in self.skip:
            return
        with torch.no_grad():
            if type(t).__name__ == "DTensor":  # a sharded (FSDP) parameter: its whole value, gathered tensor by
                t = t.full_tensor()  # tensor (a collective: every rank fingerprints the same model in the same order)
            flat = t.detach().reshape(-1)
            s1 = s2 = 0.0
            for i in range(0, flat.numel(), 1 << 20):  # float64 in slices: no full-size copy
                # summed on the CPU wherever the tensor lives: a GPU's float64 sums take another order, and a
                # model on it must fingerprint as on the CPU (resumes and source checks across devices)
                part = flat[i:i + (1 << 20)].to("cpu", torch.float64)
                s1 += float(part.sum())
                s2 += float((part * part).sum())
            step = max(1, flat.numel() // 64)
            h.update(f"{s1!r}|{s2!r}|".encode())
            h.update(flat[::step][:64].double().cpu().numpy().tobytes())

    def hexdigest(self) -> str:
        return self.h.hexdigest()


def check_state(folder: str | Path, inputs: Iterable[str | Path | None] = (), what: str = "checkpoint") -> None:
    """Refuse, before any work, a state folder (checkpoint, work folder) that mlpsurgery could not use: a file, a
    folder holding files it did not write, one that cannot be created (read-only file system), or one that is,
    holds or lies inside an input or output."""
    check_path(folder, what=f"the {what} folder")
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise MLPSurgeryError(f"the {what} folder {folder} is a file; give a folder path")
    if folder.is_dir() and any(folder.iterdir()) and not is_ours(folder):
        raise MLPSurgeryError(f"the {what} folder {folder} holds files mlpsurgery did not write (no valid {MARKER} "
                              "marker); give an empty or new folder")
    _check_creatable(folder / MARKER, f"the {what} folder {folder} cannot be written", "give a folder on a writable "
                     "disk")
    check_apart(folder, inputs, what=f"the {what} folder")


# folders this process holds (flock on the folder itself), by (device, inode): a second process asking for one is
# refused; this process asking again (a resume within the same run) is not
_HELD: dict[tuple[int, int], int] = {}


def hold(folder: str | Path, what: str = "folder") -> None:
    """Lock `folder` for this process (an exclusive flock on the directory, released when the process ends):
    two runs sharing a work folder would corrupt each other's state, so the second is refused at once."""
    import fcntl

    folder = Path(folder)
    st = folder.stat()
    if (st.st_dev, st.st_ino) in _HELD:
        return
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise MLPSurgeryError(f"the {what} {folder} is in use by another mlpsurgery process; wait for it to "
                                  "finish, or give this run another folder") from None
        return  # a file system without locks: nothing to hold
    _HELD[(st.st_dev, st.st_ino)] = fd


def _release(folder: Path) -> None:
    with contextlib.suppress(OSError):
        st = folder.stat()
        fd = _HELD.pop((st.st_dev, st.st_ino), None)
        if fd is not None:
            os.close(fd)


def claim(folder: str | Path, kind: str, settings: dict, inputs: Iterable[str | Path | None] = ()) -> bool:
    """Make `folder` the resumable state of a `kind` run with these settings (JSON-able; include a model
    fingerprint), held by this process (`hold`). A new folder is created and marked, an empty one marked as
    adopted (remove_ours empties it and leaves it in place); a folder already marked with the same kind and
    settings is resumed (True); anything else is refused with what differs."""
    folder = Path(folder)
    check_state(folder, inputs, what=kind)
    settings = json.loads(json.dumps(settings, sort_keys=True, default=str))
    adopted = folder.is_dir()  # an empty folder the user made: used, and left in place (emptied) at the end
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise MLPSurgeryError(f"the {kind} folder {folder} cannot be created ({e.strerror}); give a folder on a "
                              "writable disk") from None
    hold(folder, f"{kind} folder")
    if any(folder.iterdir()):
        m = marker(folder)
        if m is None:
            raise MLPSurgeryError(f"the {kind} folder {folder} holds files mlpsurgery did not write (no valid "
                                  f"{MARKER} marker); give an empty or new folder")
        if m.get("kind") != kind:
            raise MLPSurgeryError(f"{folder} holds the state of a {m.get('kind')!r} run, not of {kind!r}; use another "
                                  "folder")
        old = m.get("settings") or {}
        if old != settings:
            diff = sorted(k for k in set(old) | set(settings) if old.get(k) != settings.get(k))
            raise MLPSurgeryError(f"{folder} holds a {kind} run made with other settings or another model "
                                  f"({', '.join(diff)}); resume with the same ones, or use another folder")
        return True
    mark(folder, kind, settings, adopted=adopted)
    return False
