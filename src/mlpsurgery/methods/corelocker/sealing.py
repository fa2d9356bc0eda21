"""Sealing a key with a passphrase: AES-256-GCM under a scrypt-derived key (the `cryptography` package).

The sealed file is a safetensors file holding one uint8 tensor, the ciphertext, and in its metadata a JSON
header: format, version, cipher, the KDF's parameters and salt, and the nonce. The header is the AES-GCM
associated data, so any edit of it fails authentication; but it must be read *before* authentication (it
says how to derive the key), so every field is checked for type and range first and the KDF cost a header
may ask for is capped: an edited header is refused in well under a second, never a traceback or minutes of
work.
"""

from __future__ import annotations

import base64
import binascii
import json
import secrets

import torch
from torch import Tensor

from ...errors import IntegrityError, MLPSurgeryError

SEALED_FORMAT = "mlpsurgery-corelocker-sealed-key"
SEALED_VERSION = 1
CIPHER = "AES-256-GCM"
PASSPHRASE_ENV = "MLPSURGERY_PASSPHRASE"
SALT_BYTES, NONCE_BYTES = 16, 12
# scrypt costs 128 * r * n bytes of memory and time in proportion to n * r * p. The default, N=2^17, r=8:
# 128 MiB and about 0.5 s per passphrase guess on a 2-core x86-64 (docs/corelocker.md). Keys sealed with the
# earlier default (N=2^15) stay readable: they are within the caps.
SCRYPT = {"n": 2 ** 17, "r": 8, "p": 1}
# The most a header may ask for, checked before deriving anything: 256 MiB and about 2 s (N=2^18, r=8, p=2).
SCRYPT_MAX = {"n": 2 ** 18, "r": 8, "p": 2}


def _damaged(what: str, detail: str) -> IntegrityError:
    return IntegrityError(f"{what}: the sealed key's header is damaged or was edited ({detail}); use an intact copy "
                          "of the key")


def _b64(value, size: int, field: str, what: str) -> bytes:
    if not isinstance(value, str):
        raise _damaged(what, f"{field} is not a base64 string")
    try:
        raw = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise _damaged(what, f"{field} is not valid base64") from None
    if len(raw) != size:
        raise _damaged(what, f"{field} has {len(raw)} bytes, not {size}")
    return raw


def _int(value, field: str, what: str) -> int:
    if type(value) is not int:  # bool is an int subclass; JSON true is no KDF parameter
        raise _damaged(what, f"{field} {value!r:.40} is not an integer")
    return value


def check_kdf(kdf, what: str = "key") -> dict:
    """The scrypt parameters of a sealed header, checked for type and range (n a power of two > 1, r and p
    positive) and against the caps. Returns {n, r, p}."""
    if not isinstance(kdf, dict):
        raise _damaged(what, "kdf is not an object")
    if kdf.get("name") != "scrypt":
        raise _damaged(what, f"KDF {kdf.get('name')!r:.40} is not scrypt")
    n, r, p = (_int(kdf.get(k), f"kdf {k}", what) for k in ("n", "r", "p"))
    if n < 2 or n & (n - 1):
        raise _damaged(what, f"scrypt n={n} is not a power of two above 1")
    if r < 1 or p < 1:
        raise _damaged(what, f"scrypt r={r}, p={p} must be positive")
    for k, v in (("n", n), ("r", r), ("p", p)):
        if v > SCRYPT_MAX[k]:
            raise IntegrityError(f"{what}: the sealed key asks for scrypt {k}={v}, above the accepted maximum "
                                 f"{SCRYPT_MAX[k]} (a header edited to make unlocking slow or exhaust memory); use "
                                 "an intact copy of the key")
    return {"n": n, "r": r, "p": p}


def sealed_header(text: str, what: str = "key") -> tuple[dict, bytes, bytes]:
    """Parse and check a sealed key's header. Returns (scrypt parameters, salt, nonce)."""
    if not isinstance(text, str):
        raise _damaged(what, "not a JSON text")
    try:
        header = json.loads(text)
    except (ValueError, RecursionError):
        raise _damaged(what, "not valid JSON") from None
    if not isinstance(header, dict):
        raise _damaged(what, "not a JSON object")
    if header.get("format") != SEALED_FORMAT:
        raise _damaged(what, f"format {header.get('format')!r:.60} is not {SEALED_FORMAT}")
    version = header.get("version")
    if type(version) is not int or version < 1:
        raise _damaged(what, f"version {version!r:.40} is not a positive integer")
    if version > SEALED_VERSION:
        raise MLPSurgeryError(f"{what} is sealed with format version {version}; this mlpsurgery reads up to "
                              f"{SEALED_VERSION}: upgrade mlpsurgery")
    if header.get("cipher") != CIPHER:
        raise _damaged(what, f"cipher {header.get('cipher')!r:.40} is not {CIPHER}")
    params = check_kdf(header.get("kdf"), what)
    salt = _b64(header["kdf"].get("salt"), SALT_BYTES, "salt", what)
    nonce = _b64(header.get("nonce"), NONCE_BYTES, "nonce", what)
    return params, salt, nonce


def _passphrase_bytes(passphrase: str) -> bytes:
    # an environment variable holding bytes that are not UTF-8 reaches Python as surrogate escapes
    return passphrase.encode("utf-8", "surrogateescape")


def _scrypt_key(passphrase: str, salt: bytes, params: dict) -> bytes:
    from cryptography.hazmat.primitives.kdf.scrypt import Scrypt

    params = check_kdf({"name": "scrypt", **params})
    return Scrypt(salt=salt, length=32, n=params["n"], r=params["r"], p=params["p"]).derive(
        _passphrase_bytes(passphrase))


def seal(plain: bytes, passphrase: str) -> bytes:
    """AES-256-GCM under a scrypt key from the passphrase; the header (KDF, salt, nonce) is the AAD."""
    return b"".join(seal_chunks(len(plain), [plain], passphrase)[1])


def seal_chunks(size: int, chunks, passphrase: str):
    """`seal` of the `size` plain bytes that `chunks` yield in order, as (the sealed file's length, its chunks):
    encrypted as they come (GCM is a stream cipher; the 16-byte tag follows the ciphertext, as AESGCM.encrypt
    puts it), so neither the plain key nor the sealed one is ever whole in memory."""
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

    from ...tensorfiles import serialized_header

    if not passphrase:
        raise MLPSurgeryError("an empty passphrase cannot protect a key; choose one")
    salt, nonce = secrets.token_bytes(SALT_BYTES), secrets.token_bytes(NONCE_BYTES)
    header = json.dumps({"format": SEALED_FORMAT, "version": SEALED_VERSION, "cipher": CIPHER,
                         "kdf": {"name": "scrypt", **SCRYPT, "salt": base64.b64encode(salt).decode()},
                         "nonce": base64.b64encode(nonce).decode()})
    enc = Cipher(algorithms.AES(_scrypt_key(passphrase, salt, SCRYPT)), modes.GCM(nonce)).encryptor()
    enc.authenticate_additional_data(header.encode())
    prefix = serialized_header({"ciphertext": (torch.uint8, (size + 16,))}, {"sealed": header})

    def out():
        yield prefix
        done = 0
        for chunk in chunks:
            done += memoryview(chunk).nbytes
            yield enc.update(chunk)
        if done != size:
            raise MLPSurgeryError(f"internal: sealing {done} bytes, not the {size} announced")
        yield enc.finalize() + enc.tag

    return len(prefix) + size + 16, out()


def _unseal(meta: dict, tensors: dict[str, Tensor], passphrase: str | None, what: str) -> memoryview:
    """The plain key inside a sealed one, decrypted into one buffer of its own (usable only once the tag has
    authenticated it: anything else raises)."""
    from cryptography.exceptions import InvalidTag
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

    text = meta["sealed"]
    params, salt, nonce = sealed_header(text, what)
    ct = tensors.get("ciphertext")
    if set(tensors) != {"ciphertext"} or ct.dtype != torch.uint8 or ct.dim() != 1 or len(ct) < 16:
        raise IntegrityError(f"{what}: the sealed key does not hold one ciphertext of bytes (at least the 16-byte "
                             "tag): it is damaged or was edited; use an intact copy")
    if passphrase is None:
        raise MLPSurgeryError(f"{what} is encrypted; give its passphrase (environment variable {PASSPHRASE_ENV}, "
                              "or type it at the prompt)")
    data = ct.numpy()
    try:
        dec = Cipher(algorithms.AES(_scrypt_key(passphrase, salt, params)), modes.GCM(nonce)).decryptor()
        dec.authenticate_additional_data(text.encode("utf-8", "surrogatepass"))
        out = bytearray(len(data) - 16 + 15)  # update_into wants a block's slack
        n = dec.update_into(data[:-16], out)
        dec.finalize_with_tag(data[-16:].tobytes())
        return memoryview(out)[:n]
    except InvalidTag:
        raise IntegrityError(f"{what}: wrong passphrase, or the key file was altered or truncated "
                             "(authentication failed); nothing was changed") from None
