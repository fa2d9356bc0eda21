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
import hashlib
import json
import os
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


def mark(folder: str | Path, kind: str, settings: dict | None = None, adopted: bool = False) -> None:
    """Write the marker that says mlpsurgery created `folder` (and with which settings). adopted: the folder
    itself was there already, empty (the user's): what mlpsurgery puts in it is its own, the folder is not, so
    removing it empties it and leaves it in place."""
    body = {"created_by": "mlpsurgery", "kind": kind}
    if settings is not None:
        body["settings"] = settings
    if adopted:
        body["adopted"] = True
    write_text(Path(folder) / MARKER, json.dumps(body, indent=1, sort_keys=True, default=str))


def marker(folder: str | Path) -> dict | None:
    """The folder's marker, or None when mlpsurgery did not create it."""
    path = Path(folder) / MARKER
    if not path.is_file():
        return None
    try:
        body = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {"created_by": "mlpsurgery", "kind": "?", "damaged": True}
    return body if isinstance(body, dict) else {"created_by": "mlpsurgery", "kind": "?", "damaged": True}


def is_ours(folder: str | Path) -> bool:
    return Path(folder).is_dir() and marker(folder) is not None


def _empty_dir(path: Path) -> bool:
    return path.is_dir() and not any(path.iterdir())


def _remove(folder: Path) -> None:
    """Delete a folder of ours, its marker last: a deletion cut short (kill -9) leaves a folder that still says
    it is mlpsurgery's, so the next run may finish the job. An adopted folder (see `mark`) is emptied, not removed."""
    if not folder.is_dir() or folder.is_symlink():
        return
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


def check_out(out: str | Path, overwrite: bool = False, inputs: Iterable[str | Path | None] = ()) -> None:
    """Refuse an output folder that cannot be written: a file, a non-empty folder (unless --overwrite, and
    then only one mlpsurgery wrote), or a path that is, holds or lies inside an input."""
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
                raise MLPSurgeryError(f"{out} was not written by mlpsurgery (it has no {MARKER} marker), so --overwrite "
                                      "will not replace it; choose another --out or remove it yourself")
    else:
        parent = next((p for p in out.absolute().parents if p.exists()), None)
        if parent is not None and not parent.is_dir():
            raise MLPSurgeryError(f"{out} cannot be created: {parent} is a file; choose another --out")
        if parent is not None and not os.access(parent, os.W_OK | os.X_OK):
            raise MLPSurgeryError(f"{out} cannot be created: {parent} is not writable; choose another --out")
    check_apart(out, inputs)


def check_file_out(path: str | Path, overwrite: bool = False, inputs: Iterable[str | Path | None] = (),
                   what: str = "output file") -> None:
    """Refuse an output file path that is a folder, exists (unless overwriting), or is an input."""
    path = Path(path)
    if path.is_dir():
        raise MLPSurgeryError(f"the {what} {path} is a folder; give a file path")
    if path.exists() and not overwrite:
        raise MLPSurgeryError(f"the {what} {path} already exists; choose another path or pass --overwrite")
    parent = next((p for p in path.absolute().parents if p.exists()), None)
    if parent is not None and not parent.is_dir():
        raise MLPSurgeryError(f"the {what} {path} cannot be created: {parent} is a file")
    if parent is not None and not os.access(parent, os.W_OK | os.X_OK):
        raise MLPSurgeryError(f"the {what} {path} cannot be created: {parent} is not writable")
    check_apart(path, inputs, what=f"the {what}")


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


def _leftovers(out: Path) -> list[tuple[Path, str, int]]:
    """Temporary (.tmp-) and displaced (.old-) siblings of `out` written by mlpsurgery: (path, kind, pid)."""
    found = []
    if not out.parent.is_dir():
        return found
    for p in out.parent.glob(f".{out.name}.*-*"):
        rest = p.name[len(out.name) + 1:]
        for tag in (_TMP, _OLD):
            if rest.startswith(tag):
                pid = rest[len(tag):].split("-", 1)[0]
                if pid.isdigit() and p.is_dir() and not p.is_symlink():
                    found.append((p, tag, int(pid)))
    return found


def clean_leftovers(out: str | Path) -> None:
    """Finish what a killed writer of `out` left: a displaced old folder goes back where it was (if nothing
    replaced it), temporary folders are removed. Only marked (or empty) folders of dead processes are touched."""
    out = Path(out)
    for p, tag, pid in _leftovers(out):
        if _pid_alive(pid) and pid != os.getpid():
            continue
        if not (is_ours(p) or _empty_dir(p)):
            continue
        if tag == _OLD and not out.exists() and is_ours(p):
            os.replace(p, out)
        else:
            _remove(p)


def _temp_name(out: Path, tag: str) -> Path:
    return out.with_name(f".{out.name}{tag}{os.getpid()}-{secrets.token_hex(4)}")


_RENAME_EXCHANGE = 2


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux renameat2). False where the call is unavailable."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_fdcwd = -100
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (22, 38, 95):  # EINVAL, ENOSYS, EOPNOTSUPP: the file system cannot exchange
        return False
    raise OSError(err, os.strerror(err), str(b))


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


def publish(tmp: Path, out: Path) -> None:
    """Put the finished folder `tmp` at `out`, replacing an old folder mlpsurgery wrote there."""
    if out.exists() and not _empty_dir(out):
        if not is_ours(out):  # appeared while we worked: never replace it
            raise MLPSurgeryError(f"{out} was created by someone else while this command ran; the result was not "
                                  "written. Choose another --out and run again")
        if _exchange(tmp, out):
            _remove(tmp)  # tmp now holds the old folder
            return
        old = _temp_name(out, _OLD)
        os.replace(out, old)
        os.replace(tmp, out)
        _remove(old)
        return
    os.replace(tmp, out)


@contextlib.contextmanager
def atomic_dir(out: str | Path, overwrite: bool = False, inputs: Iterable[str | Path | None] = (),
               kind: str = "model"):
    """Yield a marked temporary folder beside `out`; on success it replaces `out`, on error it is removed."""
    out = Path(out)
    check_out(out, overwrite, inputs)
    out.parent.mkdir(parents=True, exist_ok=True)
    clean_leftovers(out)
    tmp = _temp_name(out, _TMP)
    tmp.mkdir()  # the user's umask applies (mkdtemp would make it 0700)
    try:
        mark(tmp, kind)
        yield tmp
        normal_permissions(tmp)
        publish(tmp, out)
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
    folder holding files it did not write, or one that is, holds or lies inside an input or output."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise MLPSurgeryError(f"the {what} folder {folder} is a file; give a folder path")
    if folder.is_dir() and any(folder.iterdir()) and not is_ours(folder):
        raise MLPSurgeryError(f"the {what} folder {folder} holds files mlpsurgery did not write (no {MARKER} marker); "
                              "give an empty or new folder")
    check_apart(folder, inputs, what=f"the {what} folder")


def claim(folder: str | Path, kind: str, settings: dict, inputs: Iterable[str | Path | None] = ()) -> bool:
    """Make `folder` the resumable state of a `kind` run with these settings (JSON-able; include a model
    fingerprint). A new folder is created and marked, an empty one marked as adopted (remove_ours empties it and
    leaves it in place); a folder already marked with the same kind and settings is resumed (True); anything else
    is refused with what differs."""
    folder = Path(folder)
    check_state(folder, inputs, what=kind)
    settings = json.loads(json.dumps(settings, sort_keys=True, default=str))
    if folder.is_dir() and any(folder.iterdir()):
        m = marker(folder)
        if m.get("kind") != kind:
            raise MLPSurgeryError(f"{folder} holds the state of a {m.get('kind')!r} run, not of {kind!r}; use another "
                                  "folder")
        old = m.get("settings") or {}
        if old != settings:
            diff = sorted(k for k in set(old) | set(settings) if old.get(k) != settings.get(k))
            raise MLPSurgeryError(f"{folder} holds a {kind} run made with other settings or another model "
                                  f"({', '.join(diff)}); resume with the same ones, or use another folder")
        return True
    adopted = folder.is_dir()  # an empty folder the user made: used, and left in place (emptied) at the end
    folder.mkdir(parents=True, exist_ok=True)
    mark(folder, kind, settings, adopted=adopted)
    return False
