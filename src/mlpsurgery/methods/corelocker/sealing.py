"""Sealing a key with a passphrase: AES-256-GCM under a scrypt-derived key (the `cryptography` package)."""

from __future__ import annotations

import base64
import json
import secrets

import torch
from torch import Tensor

from ...errors import IntegrityError, MLPSurgeryError

SEALED_FORMAT = "mlpsurgery-corelocker-sealed-key"
SEALED_VERSION = 1
PASSPHRASE_ENV = "MLPSURGERY_PASSPHRASE"
# scrypt at N=2^15, r=8: 32 MiB and ~0.1 s per guess; the header is checked against these bounds so
# that an edited header cannot make unlocking allocate without limit.
SCRYPT = {"n": 2 ** 15, "r": 8, "p": 1}
SCRYPT_MAX = {"n": 2 ** 20, "r": 16, "p": 4}


def _scrypt_key(passphrase: str, salt: bytes, params: dict) -> bytes:
    from cryptography.hazmat.primitives.kdf.scrypt import Scrypt

    for k, cap in SCRYPT_MAX.items():
        if not isinstance(params.get(k), int) or not 0 < params[k] <= cap:
            raise IntegrityError(f"the sealed key's KDF parameter {k}={params.get(k)!r} is out of range: the header "
                                 "was altered")
    return Scrypt(salt=salt, length=32, n=params["n"], r=params["r"], p=params["p"]).derive(passphrase.encode())


def seal(plain: bytes, passphrase: str) -> bytes:
    """AES-256-GCM under a scrypt key from the passphrase; the header (KDF, salt, nonce) is the AAD."""
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    from safetensors.torch import save

    if not passphrase:
        raise MLPSurgeryError("an empty passphrase cannot protect a key; choose one")
    salt, nonce = secrets.token_bytes(16), secrets.token_bytes(12)
    header = json.dumps({"format": SEALED_FORMAT, "version": SEALED_VERSION, "cipher": "AES-256-GCM",
                         "kdf": {"name": "scrypt", **SCRYPT, "salt": base64.b64encode(salt).decode()},
                         "nonce": base64.b64encode(nonce).decode()})
    ct = AESGCM(_scrypt_key(passphrase, salt, SCRYPT)).encrypt(nonce, plain, header.encode())
    return save({"ciphertext": torch.frombuffer(bytearray(ct), dtype=torch.uint8)}, metadata={"sealed": header})


def _unseal(meta: dict, tensors: dict[str, Tensor], passphrase: str | None, what: str) -> bytes:
    from cryptography.exceptions import InvalidTag
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    if passphrase is None:
        raise MLPSurgeryError(f"{what} is encrypted; give its passphrase (environment variable {PASSPHRASE_ENV}, "
                              "or type it at the prompt)")
    text = meta["sealed"]
    try:
        header = json.loads(text)
        salt, nonce = base64.b64decode(header["kdf"]["salt"]), base64.b64decode(header["nonce"])
        ct = tensors["ciphertext"].numpy().tobytes()
    except (KeyError, ValueError, TypeError):
        raise IntegrityError(f"{what}: the sealed key's header is damaged") from None
    try:
        return AESGCM(_scrypt_key(passphrase, salt, header["kdf"])).decrypt(nonce, ct, text.encode())
    except InvalidTag:
        raise IntegrityError(f"{what}: wrong passphrase, or the key file was altered or truncated "
                             "(authentication failed); nothing was changed") from None
