"""The key: what the locked model is missing, its file format (safetensors, JSON header), reading,
writing, and the passphrase."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from ...errors import IntegrityError, MLPSurgeryError
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

    @property
    def entries(self) -> int:
        return sum(len(p) for p in self.positions.values())


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
        raise IntegrityError(f"{what} is damaged or is not a CoreLocker key ({type(e).__name__}: {e})") from None
    return meta, tensors


def save_key(key: Key, path: str | Path, numels: dict[str, int], passphrase: str | None = None,
             overwrite: bool = False) -> int:
    """Write the key (sealed when a passphrase is given) atomically. Returns its size in bytes."""
    path = Path(path)
    if path.exists() and not overwrite:
        raise MLPSurgeryError(f"{path} already exists; choose another --key or pass --overwrite")
    blob = key_bytes(key, numels)
    if passphrase is not None:
        blob = seal(blob, passphrase)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_bytes(blob)
    os.replace(tmp, path)
    return len(blob)


def read_key(path: str | Path, passphrase: str | None = None) -> Key:
    """Read and verify a key file (unsealing it with the passphrase when it is encrypted)."""
    path = Path(path)
    what = f"key {path}"
    if not path.is_file():
        raise MLPSurgeryError(f"{what} does not exist; give the file written by `mlpsurgery lock key --key`")
    meta, tensors = _parse_safetensors(path.read_bytes(), what)
    if "sealed" in meta:
        meta, tensors = _parse_safetensors(_unseal(meta, tensors, passphrase, what), what)
    if "corelocker" not in meta:
        raise IntegrityError(f"{what} is a safetensors file but not a CoreLocker key")
    try:
        header = json.loads(meta["corelocker"])
        if header.get("format") != KEY_FORMAT:
            raise ValueError("format")
        if header.get("version", 0) > KEY_VERSION:
            raise MLPSurgeryError(f"{what} has key version {header['version']}; upgrade mlpsurgery")
        params = header.pop("params")
        payload = header.pop("payload_sha256")
    except (ValueError, KeyError, AttributeError):
        raise IntegrityError(f"{what}: the key header is damaged or was edited") from None
    if _payload_hash(tensors) != payload:
        raise IntegrityError(f"{what}: the stored positions or values were altered (payload checksum mismatch); use "
                             "an intact copy of the key")
    positions, values = {}, {}
    try:
        for i, p in enumerate(params):
            positions[p["name"]] = _decode_positions(p["encoding"], tensors[f"{i}.positions"], p["numel"])
            values[p["name"]] = tensors[f"{i}.values"]
            if len(positions[p["name"]]) != p["count"] or len(values[p["name"]]) != p["count"]:
                raise ValueError(p["name"])
    except (KeyError, ValueError, TypeError):
        raise IntegrityError(f"{what}: the key's entries do not match its header: the key was altered") from None
    return Key(positions, values, header)


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
