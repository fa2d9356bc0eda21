"""The bundled texts and plain text files: where a corpus's documents come from before any parsing."""

from __future__ import annotations

import gzip
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from ..errors import MLPSurgeryError


AUSTEN = ("austen_emma", "austen_mansfieldpark", "austen_northangerabbey", "austen_prideprejudice",
          "austen_sensesensibility", "austen_persuasion")
AUSTEN_HELDOUT = ("austen_persuasion",)
BUNDLED_CORPORA = ("austen", "r8", "r8-train")
BUNDLED_LABELLED = ("r8-train", "r8-test")


@dataclass
class Document:
    name: str
    text: str
    split: str = ""  # the dataset's own split it came from (a DatasetDict's 'train' / 'test' / 'validation'), else ""


def _bundled(name: str) -> str:
    with resources.files("mlpsurgery").joinpath("_bundled", name).open("rb") as f:
        return gzip.decompress(f.read()).decode("utf-8")


def check_data_path(path: Path) -> None:
    """Refuse a data input that is neither a regular file nor a folder -- a named pipe (FIFO), a socket, a device
    (/dev/stdin, /dev/zero) -- before it is opened: reading one would block until a writer comes, or never end."""
    import stat

    try:
        mode = path.stat().st_mode
    except OSError:
        return  # a missing path: the caller's own refusal names what may be given
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
        return
    kind = ("a named pipe (FIFO)" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode)
            else "a character device" if stat.S_ISCHR(mode) else "a block device" if stat.S_ISBLK(mode)
            else "not a regular file")
    raise MLPSurgeryError(f"data {path} is {kind}, which cannot be read as a whole; give a regular file or a folder "
                          "of files (save the stream to a file first)")


def _read_text(path: Path) -> str:
    if path.is_dir():
        raise MLPSurgeryError(f"{path} is a folder; a file is expected here")
    check_data_path(path)
    try:
        data = path.read_bytes()
        if path.suffix == ".gz":
            data = gzip.decompress(data)
    except (gzip.BadGzipFile, EOFError, OSError) as e:
        what = "not a valid gzip file" if path.suffix == ".gz" else "unreadable"
        raise MLPSurgeryError(f"{path} is {what} ({type(e).__name__}: {e}); give an intact file") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise MLPSurgeryError(f"{path} is not UTF-8 text; convert it (e.g. `iconv -t utf-8`)") from None
