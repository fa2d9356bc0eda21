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
from .ranking import fingerprint
from .sealing import PASSPHRASE_ENV, _unseal, seal

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
    if kind == "mask":
        return torch.from_numpy(np.flatnonzero(np.unpackbits(t.numpy(), count=numel))).long()
    return t.long()


def _payload_hash(tensors: dict[str, Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def key_bytes(key: Key, numels: dict[str, int]) -> bytes:
    """The plain key as safetensors bytes (positions + values, JSON header in the metadata)."""
    from safetensors.torch import save

    tensors, params = {}, []
    for i, name in enumerate(sorted(key.positions)):
        kind, enc = _encode_positions(key.positions[name], numels[name])
        tensors[f"{i}.positions"] = enc.contiguous()
        tensors[f"{i}.values"] = key.values[name].contiguous()
        params.append({"name": name, "numel": numels[name], "encoding": kind, "count": len(key.positions[name])})
    header = dict(key.header, params=params, payload_sha256=_payload_hash(tensors))
    return save(tensors, metadata={"corelocker": json.dumps(header)})


def _one_line(text: str) -> str:
    return " ".join(str(text).split())[:200]


def _parse_safetensors(blob: bytes, what: str) -> tuple[dict, dict[str, Tensor]]:
    from safetensors.torch import load

    if len(blob) < 8:
        raise IntegrityError(f"{what} is truncated ({len(blob)} bytes); use an intact copy")
    n = int.from_bytes(blob[:8], "little")
    if n > len(blob) - 8:
        raise IntegrityError(f"{what} is truncated or is not a CoreLocker key (its header claims {n} bytes, the file "
                             f"has {len(blob) - 8}); use an intact copy")
    try:
        meta = json.loads(blob[8:8 + n]).get("__metadata__") or {}
        tensors = load(blob)
    except Exception as e:  # noqa: BLE001 - any parse error of a foreign or damaged file
        raise IntegrityError(f"{what} is damaged or is not a CoreLocker key ({type(e).__name__}: "
                             f"{_one_line(e)})") from None
    if not isinstance(meta, dict):
        raise IntegrityError(f"{what} is damaged or is not a CoreLocker key (its metadata is not a map)")
    return meta, tensors


def key_file_bytes(key: Key, numels: dict[str, int], passphrase: str | None = None) -> bytes:
    """The key file's contents: the plain key, sealed when a passphrase is given."""
    blob = key_bytes(key, numels)
    return seal(blob, passphrase) if passphrase is not None else blob


def save_key(key: Key, path: str | Path, numels: dict[str, int], passphrase: str | None = None,
             overwrite: bool = False, inputs: Iterable[str | Path | None] = ()) -> int:
    """Write the key (sealed when a passphrase is given) atomically, readable by its owner only (0600).
    Returns its size in bytes. `inputs`: paths the key may not be, or lie inside (the model folder)."""
    path = Path(path)
    check_file_out(path, overwrite, inputs, what="key")
    blob = key_file_bytes(key, numels, passphrase)
    write_private(path, blob)
    return len(blob)


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
            pos = enc.long()
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
    meta, tensors = _parse_safetensors(path.read_bytes(), what)
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
    meta, _ = _parse_safetensors(path.read_bytes(), f"key {path}")
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
