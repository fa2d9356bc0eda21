"""The key: what the locked model is missing, its file format (safetensors, JSON header), reading,
writing, and the passphrase."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import numpy as np
import torch
from torch import Tensor

from ...errors import IntegrityError, MLPSurgeryError
from ...files import check_file_out, write_private
from ...tensorfiles import parse_bytes, serialized, tensor_bytes
from .ranking import fingerprint
from .sealing import PASSPHRASE_ENV, _unseal, seal_chunks

KEY_FORMAT = "mlpsurgery-corelocker-key"
KEY_VERSION = 1


@dataclass
class Key:
    """What the locked model is missing: per parameter the extracted positions and original values,
    and a header (config, counts, fingerprints of the locked and of the original model)."""

    positions: dict[str, Tensor]
    values: dict[str, Tensor]
    header: dict
    sealed: bool = False  # read from a sealed file (authenticated), not a plain one
    numels: dict[str, int] | None = None  # each parameter's size as the key file records it

    @property
    def entries(self) -> int:
        return sum(len(p) for p in self.positions.values())

    @property
    def check(self) -> str:
        """What reading this key established: "authenticated" (AES-GCM under the passphrase: the file is
        exactly what the passphrase holder sealed) or "consistent" (checksums only: the file is intact and
        self-consistent, but anyone can edit a plain key and recompute them)."""
        return "authenticated" if self.sealed else "consistent"


def _encode_positions(pos: Tensor, numel: int) -> tuple[str, Tensor]:
    """int32 indices, or a packed bit mask where that is smaller (dense extractions)."""
    if (numel + 7) // 8 < 4 * len(pos):
        mask = np.zeros(numel, dtype=bool)
        mask[pos.numpy()] = True
        return "mask", torch.from_numpy(np.packbits(mask))
    return "index", pos.to(torch.int32 if numel < 2 ** 31 else torch.int64)


def _decode_positions(kind: str, t: Tensor, numel: int) -> Tensor:
    """Positions as the lock made them: int32 below 2^31 entries (as int64 they were twice the key's size in
    memory), int64 above."""
    if kind == "mask":
        pos = np.flatnonzero(np.unpackbits(t.numpy(), count=numel))
        return torch.from_numpy(pos.astype(np.int32) if numel < 2 ** 31 else pos)
    return t.long()


def _payload_hash(tensors: dict[str, Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name]
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(tensor_bytes(t))
    return h.hexdigest()


def _key_tensors(key: Key, numels: dict[str, int]) -> tuple[dict[str, Tensor], dict[str, str]]:
    """The plain key's tensors (positions + values) and safetensors metadata (the JSON header)."""
    tensors, params = {}, []
    for i, name in enumerate(sorted(key.positions)):
        kind, enc = _encode_positions(key.positions[name], numels[name])
        tensors[f"{i}.positions"] = enc.contiguous()
        tensors[f"{i}.values"] = key.values[name].contiguous()
        params.append({"name": name, "numel": numels[name], "encoding": kind, "count": len(key.positions[name])})
    header = dict(key.header, params=params, payload_sha256=_payload_hash(tensors))
    return tensors, {"corelocker": json.dumps(header)}


def key_bytes(key: Key, numels: dict[str, int]) -> bytes:
    """The plain key as safetensors bytes (positions + values, JSON header in the metadata)."""
    from safetensors.torch import save

    tensors, metadata = _key_tensors(key, numels)
    return save(tensors, metadata=metadata)


def key_file_chunks(key: Key, numels: dict[str, int], passphrase: str | None = None) -> tuple[int, Iterable]:
    """The key file's contents (`key_file_bytes`) as (length, chunks in order), never whole in memory: at 5% of a
    2 B model the key is hundreds of MB, and the file's bytes beside the key's tensors (and, sealed, a second
    copy) were the lock's largest cost after the model itself."""
    size, chunks = serialized(*_key_tensors(key, numels))
    return seal_chunks(size, chunks, passphrase) if passphrase is not None else (size, chunks)


def _one_line(text: str) -> str:
    return " ".join(str(text).split())[:200]


def _parse_safetensors(blob, what: str) -> tuple[dict, dict[str, Tensor]]:
    """(metadata, tensors) of a key file's bytes (a writable buffer: the tensors are views of it, not copies)."""
    if len(blob) < 8:
        raise IntegrityError(f"{what} is truncated ({len(blob)} bytes); use an intact copy")
    n = int.from_bytes(bytes(blob[:8]), "little")
    if n > len(blob) - 8:
        raise IntegrityError(f"{what} is truncated or is not a CoreLocker key (its header claims {n} bytes, the file "
                             f"has {len(blob) - 8}); use an intact copy")
    try:
        meta, tensors = parse_bytes(blob)
    except Exception as e:  # noqa: BLE001 - any parse error of a foreign or damaged file
        raise IntegrityError(f"{what} is damaged or is not a CoreLocker key ({type(e).__name__}: "
                             f"{_one_line(e)})") from None
    meta = meta or {}
    if not isinstance(meta, dict):
        raise IntegrityError(f"{what} is damaged or is not a CoreLocker key (its metadata is not a map)")
    return meta, tensors


def _read(path: Path) -> bytearray:
    """A file's bytes, read once into a buffer of their own."""
    buf = bytearray(path.stat().st_size)
    with open(path, "rb", buffering=0) as f:
        got = f.readinto(buf)
    return buf[:got] if got != len(buf) else buf


def key_file_bytes(key: Key, numels: dict[str, int], passphrase: str | None = None) -> bytes:
    """The key file's contents: the plain key, sealed when a passphrase is given."""
    return b"".join(key_file_chunks(key, numels, passphrase)[1])


def write_key_file(path: str | Path, key: Key, numels: dict[str, int], passphrase: str | None = None) -> int:
    """Write the key file's contents to `path` atomically, 0600, streamed (see `key_file_chunks`). Returns its
    size in bytes."""
    size, chunks = key_file_chunks(key, numels, passphrase)
    written = write_private(path, chunks)
    if written != size:
        raise MLPSurgeryError(f"internal: the key file {path} has {written} bytes, not {size}")
    return size


def is_key_file(path: str | Path) -> bool:
    """Whether `path` is a key file mlpsurgery wrote (plain or sealed), by its header alone: what `--overwrite`
    may replace at a --key path. Any other file there is the user's."""
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if not 2 <= n <= 1 << 26:
                return False
            head = f.read(n)
    except OSError:
        return False
    return len(head) == n and head.lstrip().startswith(b"{") and b"mlpsurgery-corelocker-" in head


def save_key(key: Key, path: str | Path, numels: dict[str, int], passphrase: str | None = None,
             overwrite: bool = False, inputs: Iterable[str | Path | None] = ()) -> int:
    """Write the key (sealed when a passphrase is given) atomically, readable by its owner only (0600).
    Returns its size in bytes. `inputs`: paths the key may not be, or lie inside (the model folder)."""
    path = Path(path)
    check_file_out(path, overwrite, inputs, what="key", ours=is_key_file)
    return write_key_file(path, key, numels, passphrase)


# Every field a key has carried since format version 1, and its JSON type (model_type may be null).
_FIELDS = {"format": str, "version": int, "config": dict, "model_class": str, "model_type": (str, type(None)),
           "units_extracted": int, "units_eligible": int, "entries": int, "model_params": int,
           "locked_fingerprint": str, "locked_tensors": dict, "original_fingerprint": str, "params": list,
           "payload_sha256": str}
_PARAM_FIELDS = {"name": str, "numel": int, "encoding": str, "count": int}


def _is_digest(value) -> bool:
    return isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)


def check_header(header, what: str = "key") -> None:
    """Check a plain key's JSON header: every field present with its type and range, the per-parameter
    entries well formed, the counts adding up and the locked-tensor hashes matching their fingerprint.
    Raises IntegrityError (MLPSurgeryError for a key from a newer mlpsurgery)."""
    def edited(detail: str) -> IntegrityError:
        return IntegrityError(f"{what}: the key header is damaged or was edited ({detail}); use an intact copy of "
                              "the key")

    def typed(value, kind) -> bool:  # JSON true is not an integer here
        return isinstance(value, kind) and not (isinstance(value, bool) and kind in (int, (int,)))

    if not isinstance(header, dict):
        raise edited("not a JSON object")
    if header.get("format") != KEY_FORMAT:
        raise edited(f"format {header.get('format')!r:.60} is not {KEY_FORMAT}")
    version = header.get("version")
    if type(version) is not int or version < 1:
        raise edited(f"version {version!r:.40} is not a positive integer")
    if version > KEY_VERSION:
        raise MLPSurgeryError(f"{what} has key version {version}; this mlpsurgery reads up to {KEY_VERSION}: "
                              "upgrade mlpsurgery")
    for name, kind in _FIELDS.items():
        if name not in header:
            raise edited(f"{name} is missing")
        if not typed(header[name], kind):
            raise edited(f"{name} has the wrong type")
        if kind is int and header[name] < 0:
            raise edited(f"{name} is negative")
    for name in ("locked_fingerprint", "original_fingerprint", "payload_sha256"):
        if not _is_digest(header[name]):
            raise edited(f"{name} is not a SHA-256 hex digest")
    tensors = header["locked_tensors"]
    if not all(isinstance(k, str) and _is_digest(v) for k, v in tensors.items()):
        raise edited("locked_tensors must map tensor names to SHA-256 digests")
    if fingerprint(tensors) != header["locked_fingerprint"]:
        raise edited("locked_tensors do not match locked_fingerprint")
    seen = set()
    for i, p in enumerate(header["params"]):
        if not isinstance(p, dict) or not all(typed(p.get(k), kind) for k, kind in _PARAM_FIELDS.items()):
            raise edited(f"params entry {i} is not {{name, numel, encoding, count}} with their types")
        if p["encoding"] not in ("index", "mask") or not 0 <= p["count"] <= p["numel"] or p["name"] in seen \
                or p["name"] not in tensors:
            raise edited(f"params entry {i} ({p['name']!r:.60}) is out of range, repeated or names no tensor")
        seen.add(p["name"])
    if sum(p["count"] for p in header["params"]) != header["entries"]:
        raise edited("the entries of the params do not add up to entries")


def _entries(header: dict, tensors: dict[str, Tensor], what: str) -> tuple[dict, dict]:
    """Positions and values of each parameter, checked against the header: the tensors it names and no
    other, positions inside the parameter and strictly increasing, one value per position."""
    def altered(detail: str) -> IntegrityError:
        return IntegrityError(f"{what}: the key's entries do not match its header ({detail}): the key was altered; "
                              "use an intact copy")

    params = header["params"]
    expected = {f"{i}.{part}" for i in range(len(params)) for part in ("positions", "values")}
    if set(tensors) != expected:
        raise altered("its tensors are not the ones the header lists")
    positions, values = {}, {}
    for i, p in enumerate(params):
        name, numel, count = p["name"], p["numel"], p["count"]
        enc, val = tensors[f"{i}.positions"], tensors[f"{i}.values"]
        if enc.dim() != 1 or val.dim() != 1 or len(val) != count:
            raise altered(f"{name}: positions and values are not lists of {count} entries")
        if p["encoding"] == "mask":
            if enc.dtype != torch.uint8 or len(enc) != (numel + 7) // 8:
                raise altered(f"{name}: the bit mask does not fit {numel} entries")
            bits = np.unpackbits(enc.numpy())
            if bits[numel:].any():
                raise altered(f"{name}: the bit mask marks entries past the parameter's end")
            pos = _decode_positions("mask", enc, numel)
        else:
            if enc.dtype not in (torch.int32, torch.int64):
                raise altered(f"{name}: positions are not integers")
            pos = enc  # int32 (int64 for a parameter of 2^31 entries or more), as the lock made them
            if len(pos) and (int(pos[0]) < 0 or int(pos[-1]) >= numel or not bool((pos[1:] > pos[:-1]).all())):
                raise altered(f"{name}: positions are not increasing inside the parameter's {numel} entries")
        if len(pos) != count:
            raise altered(f"{name}: {len(pos)} positions, the header says {count}")
        positions[name], values[name] = pos, val
    return positions, values


def read_key(path: str | Path, passphrase: str | None = None) -> Key:
    """Read and check a key file, unsealing it with the passphrase when it is encrypted. A sealed key is
    authenticated (AES-GCM); a plain one is checked for consistency only (payload checksum, header, entries):
    see Key.check."""
    path = Path(path)
    what = f"key {path}"
    if path.is_dir():
        raise MLPSurgeryError(f"{what} is a folder; give the key file written by `mlpsurgery lock key --key`")
    if not path.is_file():
        raise MLPSurgeryError(f"{what} does not exist; give the file written by `mlpsurgery lock key --key`")
    meta, tensors = _parse_safetensors(_read(path), what)
    sealed = "sealed" in meta
    if sealed:
        meta, tensors = _parse_safetensors(_unseal(meta, tensors, passphrase, what), what)
    if "corelocker" not in meta or not isinstance(meta["corelocker"], str):
        raise IntegrityError(f"{what} is a safetensors file but not a CoreLocker key")
    try:
        header = json.loads(meta["corelocker"])
    except (ValueError, RecursionError):
        raise IntegrityError(f"{what}: the key header is damaged or was edited (not valid JSON); use an intact "
                             "copy of the key") from None
    check_header(header, what)
    try:
        payload = _payload_hash(tensors)
    except (RuntimeError, TypeError, ValueError):  # a dtype whose bytes cannot be viewed
        raise IntegrityError(f"{what}: the stored tensors are damaged; use an intact copy of the key") from None
    if payload != header.pop("payload_sha256"):
        raise IntegrityError(f"{what}: the stored positions or values were altered (payload checksum mismatch); use "
                             "an intact copy of the key")
    positions, values = _entries(header, tensors, what)
    numels = {p["name"]: p["numel"] for p in header.pop("params")}
    return Key(positions, values, header, sealed=sealed, numels=numels)


def is_sealed(path: str | Path) -> bool:
    """Whether a key file is encrypted (False for a missing file: reading it then says what is wrong)."""
    path = Path(path)
    if not path.is_file():
        return False
    meta, _ = _parse_safetensors(_read(path), f"key {path}")
    return "sealed" in meta


def passphrase_from_user(confirm: bool = False) -> str:
    """The passphrase from $MLPSURGERY_PASSPHRASE, else typed at a prompt (never a command-line argument)."""
    import getpass
    import sys

    env = os.environ.get(PASSPHRASE_ENV)
    if env:
        return env
    if not sys.stdin.isatty():
        raise MLPSurgeryError(f"a passphrase is needed: set the environment variable {PASSPHRASE_ENV} or run in a "
                              "terminal to type it")
    first = getpass.getpass("key passphrase: ")
    if confirm and getpass.getpass("repeat the passphrase: ") != first:
        raise MLPSurgeryError("the two passphrases differ; nothing was written")
    if not first:
        raise MLPSurgeryError("the passphrase is empty; nothing was written")
    return first
