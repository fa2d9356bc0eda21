"""Checksums of the state files mlpsurgery writes and later reads back (capture chunks, training checkpoints).

Each file's size and SHA-256 are recorded when it is written and checked when it is read, so that a file that was
truncated, damaged or edited since is refused (IntegrityError: one line naming the file and the fix) instead of
being used. A lone file gets its record in a small JSON file beside it (`<name>.sum.json`), written before the file
is put in place, so that a file in place always has its record; a folder written whole (a checkpoint) holds the
records of its files in one `checksums.json` inside it.

A file without a record was written by an mlpsurgery from before the checksums (or its record was removed): it is
refused too, with the same fix (start that state afresh), never trusted unchecked.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable

from . import files
from .errors import IntegrityError

SUFFIX = ".sum.json"
FOLDER_SUMS = "checksums.json"


def sidecar(path: str | Path) -> Path:
    """Where the record of a lone file lives: beside it, `<name>.sum.json`."""
    path = Path(path)
    return path.with_name(path.name + SUFFIX)


def digest(path: str | Path) -> dict:
    """{"size", "sha256"} of a file as it is now."""
    return {"size": os.path.getsize(path), "sha256": files.sha256_file(path)}


def seal(tmp: str | Path, path: str | Path) -> None:
    """Put the finished temporary file `tmp` at `path` with its record beside it: the record first (atomically),
    then the file (one rename), so that a stop in between leaves no file in place without its record."""
    files.write_text(sidecar(path), json.dumps(digest(tmp)))
    os.replace(tmp, path)


def _text(fix) -> str:
    return fix() if callable(fix) else fix


def _recorded(path: Path, fix) -> dict:
    side = sidecar(path)
    if not side.is_file():
        raise IntegrityError(f"{path} has no checksum ({side.name}): it was written by an mlpsurgery from before "
                             f"checksums, or the checksum was removed; {_text(fix)}")
    try:
        body = json.loads(side.read_text())
        ok = isinstance(body, dict) and type(body.get("size")) is int and isinstance(body.get("sha256"), str)
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        ok = False
    if not ok:
        raise IntegrityError(f"{side} is damaged (not the checksum mlpsurgery wrote for {path.name}); {_text(fix)}")
    return body


_verified: dict[str, tuple] = {}  # path -> (size, mtime, inode, sha256) of a file this process hashed and found whole


def check(path: str | Path, fix: str | Callable[[], str], recorded: dict | None = None, full: bool = True) -> None:
    """Refuse `path` unless it is the file that was written: its size and (full) SHA-256 those of `recorded`
    (default: its `<name>.sum.json`). `fix` ends the message (what the user does about it; a callable is asked
    only for a refusal). A file hashed and found whole before in this process is not hashed again while its size,
    time and inode stay the same (a capture's chunks are read many times)."""
    path = Path(path)
    if recorded is None:
        recorded = _recorded(path, fix)
    try:
        st = path.stat()
    except OSError:
        raise IntegrityError(f"{path} is missing; {_text(fix)}") from None
    if st.st_size != recorded["size"]:
        raise IntegrityError(f"{path} is damaged: it holds {st.st_size:,} bytes, {recorded['size']:,} were written "
                             f"(truncated or overwritten); {_text(fix)}")
    if not full:
        return
    key = os.path.abspath(path)
    stamp = (st.st_size, st.st_mtime_ns, st.st_ino, recorded["sha256"])
    if _verified.get(key) == stamp:
        return
    if files.sha256_file(path) != recorded["sha256"]:
        raise IntegrityError(f"{path} is damaged: its contents do not match the SHA-256 recorded when it was written "
                             f"(edited or corrupted); {_text(fix)}")
    _verified[key] = stamp


def seal_folder(folder: str | Path, names: list[str]) -> None:
    """Record the files `names` of a folder being written whole (e.g. inside files.atomic_dir) in its
    checksums.json."""
    folder = Path(folder)
    files.write_text(folder / FOLDER_SUMS, json.dumps({n: digest(folder / n) for n in names}, indent=1))


def check_folder(folder: str | Path, names: list[str], fix: str) -> None:
    """Refuse a folder written by seal_folder unless every file of `names` is there, recorded and unchanged."""
    folder = Path(folder)
    path = folder / FOLDER_SUMS
    if not path.is_file():
        raise IntegrityError(f"{folder} has no checksums ({FOLDER_SUMS}): it was written by an mlpsurgery from "
                             f"before checksums, or the file was removed; {fix}")
    try:
        sums = json.loads(path.read_text())
        ok = isinstance(sums, dict) and all(isinstance(sums.get(n), dict) and type(sums[n].get("size")) is int
                                            and isinstance(sums[n].get("sha256"), str) for n in names)
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        ok = False
    if not ok:
        raise IntegrityError(f"{path} is damaged (not the checksums mlpsurgery wrote); {fix}")
    for n in names:
        check(folder / n, fix, recorded=sums[n])
