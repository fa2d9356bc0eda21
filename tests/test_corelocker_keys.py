"""CoreLocker key safety: where keys and locked folders may be written, key permissions, what unlocking a plain
or a sealed key establishes, and refusals of damaged or edited keys (fixed cases, and random mutations of a
saved key fed to `mlpsurgery unlock`: a one-line error and nothing written, or an exact restore)."""

from __future__ import annotations

import base64
import contextlib
import io
import json
import os
import re
import shutil
import stat
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from conftest import edit_manifest
from mlpsurgery.cli import main
from mlpsurgery.errors import IntegrityError, MLPSurgeryError
from mlpsurgery.io import save
from mlpsurgery.methods.corelocker import (SCRYPT, SCRYPT_MAX, CoreLockerConfig, check_kdf, fingerprint, key_bytes,
                                           lock_folder, lock_key, read_key, restore_values, save_key, tensor_hashes,
                                           unlock_folder)
from mlpsurgery.methods.corelocker import sealing
from mlpsurgery.tiny import byte_tokenizer, tiny_model

ARCH = "gpt2"
PASSPHRASE = "correct horse"
FAST_KDF = {"n": 2 ** 4, "r": 8, "p": 1}  # test speed only: the caps accept it, the default is far costlier


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def identical(model, ref) -> bool:
    sd = model.state_dict()
    return sd.keys() == ref.keys() and all(torch.equal(sd[k], ref[k]) and sd[k].dtype == ref[k].dtype for k in ref)


def numels(model):
    return {n: p.numel() for n, p in model.named_parameters()}


def listing(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def cli(*argv) -> tuple[int, str, str]:
    """Run the command line in-process; an exception (a traceback for the user) propagates and fails the test."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in argv])
    return code, out.getvalue(), err.getvalue()


def one_line_error(code: int, err: str) -> bool:
    return code == 2 and err.startswith("mlpsurgery: error: ") and err.count("\n") == 1


def rewrite_header(blob: bytes, fn) -> bytes:
    """The key file with its JSON header (the sealed header for a sealed key, the key header for a plain one)
    changed by fn(header), the safetensors framing kept valid: what a deliberate editor would do."""
    n = int.from_bytes(blob[:8], "little")
    outer = json.loads(blob[8:8 + n])
    meta = outer["__metadata__"]
    field = "sealed" if "sealed" in meta else "corelocker"
    header = json.loads(meta[field])
    fn(header)
    meta[field] = json.dumps(header)
    head = json.dumps(outer).encode()
    head += b" " * (-len(head) % 8)
    return len(head).to_bytes(8, "little") + head + blob[8 + n:]


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """One locked folder with a plain key, one with a sealed key (fast KDF), and the original weights."""
    root = tmp_path_factory.mktemp("made")
    tok = byte_tokenizer()
    lock_folder(tiny_model(ARCH), root / "locked", root / "plain.key", CoreLockerConfig(ratio=0.05), tokenizer=tok)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sealing, "SCRYPT", FAST_KDF)
        lock_folder(tiny_model(ARCH), root / "locked_s", root / "sealed.key", CoreLockerConfig(ratio=0.05),
                    tokenizer=tok, passphrase=PASSPHRASE)
    return root, state(tiny_model(ARCH))


# ---- permissions --------------------------------------------------------------------------------------------

def test_keys_are_readable_by_their_owner_only(tmp_path, monkeypatch):
    old = os.umask(0)  # even a permissive umask must not expose a key
    try:
        lock_folder(tiny_model(ARCH), tmp_path / "locked", tmp_path / "a.key", CoreLockerConfig(ratio=0.05))
        model = tiny_model("llama")
        save_key(lock_key(model, CoreLockerConfig(ratio=0.05)), tmp_path / "sub" / "b.key", numels(model))
        monkeypatch.setattr(sealing, "SCRYPT", FAST_KDF)
        monkeypatch.setenv("MLPSURGERY_PASSPHRASE", PASSPHRASE)
        code, _, err = cli("lock", "key", f"tiny:{ARCH}", "--out", tmp_path / "l2", "--key", tmp_path / "c.key",
                           "--ratio", "0.05", "--encrypt", "--json")
        assert code == 0, err
    finally:
        os.umask(old)
    for name in ("a.key", "sub/b.key", "c.key"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o600, name


# ---- where lock may write -------------------------------------------------------------------------------------

@pytest.mark.parametrize("key, out, needle", [
    ("X", "X", "same path"),
    ("L/k.key", "L", "inside the locked folder"),
    ("k", "k/L", "lies inside --key"),
    ("file/k.key", "L", "is a file"),
])
def test_lock_refuses_a_key_that_clashes_with_out_and_writes_nothing(tmp_path, monkeypatch, key, out, needle):
    monkeypatch.chdir(tmp_path)
    if key.startswith("file/"):
        Path("file").write_text("mine")
    before = listing(tmp_path)
    code, _, err = cli("lock", "key", f"tiny:{ARCH}", "--out", out, "--key", key, "--ratio", "0.05")
    assert one_line_error(code, err) and needle in err, err
    assert listing(tmp_path) == before


def test_lock_refuses_a_key_that_is_a_folder(tmp_path):
    (tmp_path / "kd").mkdir()
    code, _, err = cli("lock", "key", f"tiny:{ARCH}", "--out", tmp_path / "L", "--key", tmp_path / "kd",
                       "--ratio", "0.05", "--overwrite")
    assert one_line_error(code, err) and "is a folder" in err
    assert listing(tmp_path) == ["kd"]


def test_lock_never_writes_over_around_or_into_the_input_model(tmp_path, tokenizer):
    outer = tmp_path / "outer"
    save(tiny_model(ARCH), outer, tokenizer=tokenizer)  # a folder mlpsurgery wrote: --overwrite may replace it...
    inner = outer / "inner"
    save(tiny_model(ARCH, seed=1), inner, tokenizer=tokenizer)
    before = {p: p.read_bytes() for p in inner.iterdir()}
    cases = [(outer, tmp_path / "k.key", "contains the input"),  # ...but not while it holds the input model
             (inner, tmp_path / "k.key", "is the input"),
             (inner / "sub", tmp_path / "k.key", "inside the input"),
             (tmp_path / "L", inner / "k.key", "inside the input"),
             (tmp_path / "L", inner / "config.json", "inside the input")]
    for out, key, needle in cases:
        code, _, err = cli("lock", "key", inner, "--out", out, "--key", key, "--ratio", "0.05", "--overwrite")
        assert one_line_error(code, err) and needle in err, (out, key, err)
    assert {p: p.read_bytes() for p in inner.iterdir()} == before
    assert not (tmp_path / "k.key").exists() and not (tmp_path / "L").exists()
    # through the library: a model loaded from a folder remembers it, and the folder is an input
    from mlpsurgery.models import load_model

    tiny_model(ARCH).save_pretrained(tmp_path / "plain")
    loaded = load_model(tmp_path / "plain")
    with pytest.raises(MLPSurgeryError, match="inside the input"):
        lock_folder(loaded.model, tmp_path / "plain" / "sub", tmp_path / "k.key", CoreLockerConfig(ratio=0.05))
    assert identical(loaded.model, state(tiny_model(ARCH))) and not (tmp_path / "k.key").exists()


class _CreatesADirectory:
    """A tokenizer whose saving makes a folder at the key's path: another process getting in the way after
    the up-front checks, exactly between writing the locked folder and placing the key."""

    def __init__(self, path: Path):
        self.path = path

    def save_pretrained(self, folder):
        self.path.mkdir()


class _FailsToSave:
    def save_pretrained(self, folder):
        raise OSError(28, "No space left on device")


def test_a_key_that_cannot_be_placed_is_kept_and_named(tmp_path):
    key_path = tmp_path / "k.key"
    with pytest.raises(MLPSurgeryError) as info:
        lock_folder(tiny_model(ARCH), tmp_path / "locked", key_path, CoreLockerConfig(ratio=0.05),
                    tokenizer=_CreatesADirectory(key_path))
    staged = [p for p in tmp_path.iterdir() if p.name.startswith("k.key.staged-")]
    assert len(staged) == 1 and str(staged[0]) in str(info.value) and "\n" not in str(info.value)
    assert stat.S_IMODE(staged[0].stat().st_mode) == 0o600
    unlock_folder(tmp_path / "locked", staged[0], tmp_path / "restored")  # the kept key is the way back
    assert identical(type(tiny_model(ARCH)).from_pretrained(tmp_path / "restored"), state(tiny_model(ARCH)))


def test_a_failed_save_leaves_no_key_and_gives_the_model_back(tmp_path):
    model = tiny_model(ARCH)
    with pytest.raises(OSError):
        lock_folder(model, tmp_path / "locked", tmp_path / "k.key", CoreLockerConfig(ratio=0.05),
                    tokenizer=_FailsToSave())
    assert listing(tmp_path) == []
    assert identical(model, state(tiny_model(ARCH)))


# ---- where unlock may write -----------------------------------------------------------------------------------

def test_unlock_never_writes_over_or_into_its_inputs(made, tmp_path):
    root, _ = made
    locked = tmp_path / "locked"
    shutil.copytree(root / "locked", locked)
    key = tmp_path / "k.key"
    shutil.copy(root / "plain.key", key)
    before = listing(tmp_path)
    for out, needle in [(locked, "is the input"), (locked / "sub", "inside the input"), (key, "is the input")]:
        code, _, err = cli("unlock", locked, "--key", key, "--out", out, "--overwrite")
        assert one_line_error(code, err) and needle in err, (out, err)
    code, _, err = cli("unlock", locked, "--key", tmp_path, "--out", tmp_path / "r")  # --out inside the "key"
    assert one_line_error(code, err) and ("is a folder" in err or "inside the input" in err)
    assert listing(tmp_path) == before


# ---- what a successful unlock says -------------------------------------------------------------------------------

def test_unlock_says_authenticated_for_sealed_and_consistent_for_plain(made, tmp_path, monkeypatch):
    root, original = made
    code, out, err = cli("unlock", root / "locked", "--key", root / "plain.key", "--out", tmp_path / "a", "--json")
    r = json.loads(out)
    assert code == 0 and r["check"] == "consistent" and r["cross_checked"] and "verified" not in r, err
    monkeypatch.setenv("MLPSURGERY_PASSPHRASE", PASSPHRASE)
    code, out, err = cli("unlock", root / "locked_s", "--key", root / "sealed.key", "--out", tmp_path / "b")
    assert code == 0 and "key authenticated" in out and "recorded at lock time" in out, err
    for name in ("a", "b"):
        assert identical(type(tiny_model(ARCH)).from_pretrained(tmp_path / name), original)


def forge(key_path: Path, locked: Path) -> bytes:
    """A plain key with one value changed and every checksum and fingerprint in it recomputed to match."""
    key = read_key(key_path)
    name = next(iter(key.values))
    key.values[name] = key.values[name] + 1.0
    model = type(tiny_model(ARCH)).from_pretrained(locked)
    restore_values(model, key.positions, key.values)
    key.header["original_fingerprint"] = fingerprint(tensor_hashes(model))
    return key_bytes(key, numels(model))


def test_a_forged_plain_key_needs_a_forged_locked_folder(made, tmp_path):
    root, _ = made
    (tmp_path / "forged.key").write_bytes(forge(root / "plain.key", root / "locked"))
    with pytest.raises(IntegrityError, match="recorded in the locked folder"):
        unlock_folder(root / "locked", tmp_path / "forged.key", tmp_path / "out")
    assert listing(tmp_path) == ["forged.key"]
    # a folder locked before the original fingerprint was recorded: the forgery is consistent, and the result
    # says that nothing outside the key vouched for it
    old = tmp_path / "old_locked"
    shutil.copytree(root / "locked", old)
    edit_manifest(old, lambda m: m["extra"]["corelocker"].pop("original_fingerprint"))
    code, out, err = cli("unlock", old, "--key", tmp_path / "forged.key", "--out", tmp_path / "out")
    assert code == 0 and "not authenticated" in out and "records no original fingerprint" in out, err


# ---- malformed headers: one-line refusals, never a traceback, never costly -------------------------------------

def _set(path, value):
    def fn(h):
        *parents, last = path
        for p in parents:
            h = h[p]
        h[last] = value
    return fn


SEALED_EDITS = {
    "n not a power of two": _set(("kdf", "n"), 3),
    "4-byte nonce": _set(("nonce",), base64.b64encode(b"1234").decode()),
    "version a string": _set(("version",), "2"),
    "version a float": _set(("version",), 1.0),
    "n true": _set(("kdf", "n"), True),
    "n one": _set(("kdf", "n"), 1),
    "r zero": _set(("kdf", "r"), 0),
    "p negative": _set(("kdf", "p"), -1),
    "15-byte salt": _set(("kdf", "salt"), base64.b64encode(b"x" * 15).decode()),
    "salt not base64": _set(("kdf", "salt"), "!!"),
    "salt a number": _set(("kdf", "salt"), 7),
    "other cipher": _set(("cipher",), "AES-128-CBC"),
    "other kdf": _set(("kdf", "name"), "pbkdf2"),
    "kdf a list": _set(("kdf",), [1, 2]),
    "n above the cap": _set(("kdf", "n"), 2 * SCRYPT_MAX["n"]),
    "r above the cap": _set(("kdf", "r"), SCRYPT_MAX["r"] + 1),
    "p above the cap": _set(("kdf", "p"), SCRYPT_MAX["p"] + 1),
    "no format": lambda h: h.pop("format"),
}


@pytest.mark.parametrize("case", SEALED_EDITS)
def test_a_malformed_sealed_header_is_a_one_line_refusal(made, tmp_path, monkeypatch, case):
    root, _ = made
    monkeypatch.setenv("MLPSURGERY_PASSPHRASE", PASSPHRASE)
    (tmp_path / "k.key").write_bytes(rewrite_header((root / "sealed.key").read_bytes(), SEALED_EDITS[case]))
    code, _, err = cli("unlock", root / "locked_s", "--key", tmp_path / "k.key", "--out", tmp_path / "out")
    assert one_line_error(code, err) and "Traceback" not in err, err
    assert listing(tmp_path) == ["k.key"]


def test_a_header_asking_for_the_old_maximum_kdf_is_refused_before_any_work(made, tmp_path, monkeypatch):
    root, _ = made
    monkeypatch.setenv("MLPSURGERY_PASSPHRASE", PASSPHRASE)
    # the previous caps (N 2^20, r 16, p 4): 56 s and 2.5 GB of scrypt before the refusal
    edit = lambda h: h["kdf"].update(n=2 ** 20, r=16, p=4)  # noqa: E731
    (tmp_path / "k.key").write_bytes(rewrite_header((root / "sealed.key").read_bytes(), edit))
    start = time.perf_counter()
    code, _, err = cli("unlock", root / "locked_s", "--key", tmp_path / "k.key", "--out", tmp_path / "out")
    assert one_line_error(code, err) and "above the accepted maximum" in err
    assert time.perf_counter() - start < 5  # the refusal itself takes milliseconds; scrypt at these would take ~1 min


def test_kdf_caps_accept_the_old_and_new_defaults_and_nothing_beyond():
    for ok in ({"n": 2 ** 15, "r": 8, "p": 1}, SCRYPT, SCRYPT_MAX, {"n": 2, "r": 1, "p": 1}):
        assert check_kdf({"name": "scrypt", **ok}) == ok
    assert SCRYPT["n"] >= 2 ** 17
    for bad in ({"n": 2 * SCRYPT_MAX["n"]}, {"r": SCRYPT_MAX["r"] + 1}, {"p": SCRYPT_MAX["p"] + 1}, {"n": 3},
                {"n": 0}, {"n": -4}, {"r": 0}, {"p": 0}, {"n": 2.0 ** 15}, {"n": "32768"}, {"r": True}, {"p": None}):
        with pytest.raises(IntegrityError):
            check_kdf({"name": "scrypt", **dict(SCRYPT, **bad)})


def test_a_key_sealed_with_the_old_default_kdf_still_opens(tmp_path, monkeypatch):
    model = tiny_model("llama")
    original = state(model)
    key = lock_key(model, CoreLockerConfig(ratio=0.05))
    monkeypatch.setattr(sealing, "SCRYPT", {"n": 2 ** 15, "r": 8, "p": 1})  # the default before the caps
    save_key(key, tmp_path / "old.key", numels(model), passphrase=PASSPHRASE)
    monkeypatch.undo()
    from mlpsurgery.methods.corelocker import unlock_key

    back = read_key(tmp_path / "old.key", PASSPHRASE)
    assert back.check == "authenticated"
    unlock_key(model, back)
    assert identical(model, original)


PLAIN_EDITS = {
    "version a string": _set(("version",), "1"),
    "version a float": _set(("version",), 1.5),
    "version newer": _set(("version",), 99),
    "params not a list": _set(("params",), {"a": 1}),
    "params entry a string": _set(("params", 0), "x"),
    "name a number": _set(("params", 0, "name"), 3),
    "name of no tensor": _set(("params", 0, "name"), "nowhere.weight"),
    "numel a string": _set(("params", 0, "numel"), "100"),
    "numel huge": _set(("params", 0, "numel"), 10 ** 15),
    "count negative": _set(("params", 0, "count"), -1),
    "count larger": _set(("params", 0, "count"), 10 ** 6),
    "encoding unknown": _set(("params", 0, "encoding"), "zip"),
    "encoding swapped": lambda h: h["params"][0].update(encoding={"index": "mask", "mask": "index"}[
        h["params"][0]["encoding"]]),
    "locked_tensors a list": _set(("locked_tensors",), []),
    "fingerprint a number": _set(("original_fingerprint",), 12),
    "entries off by one": lambda h: h.update(entries=h["entries"] + 1),
    "no payload checksum": lambda h: h.pop("payload_sha256"),
    "not an object": None,
}


@pytest.mark.parametrize("case", PLAIN_EDITS)
def test_a_malformed_plain_header_is_a_one_line_refusal(made, tmp_path, case):
    root, _ = made
    blob = (root / "plain.key").read_bytes()
    if PLAIN_EDITS[case] is None:
        n = int.from_bytes(blob[:8], "little")
        outer = json.loads(blob[8:8 + n])
        outer["__metadata__"]["corelocker"] = "[1, 2]"
        head = json.dumps(outer).encode()
        head += b" " * (-len(head) % 8)
        blob = len(head).to_bytes(8, "little") + head + blob[8 + n:]
    else:
        blob = rewrite_header(blob, PLAIN_EDITS[case])
    (tmp_path / "k.key").write_bytes(blob)
    code, _, err = cli("unlock", root / "locked", "--key", tmp_path / "k.key", "--out", tmp_path / "out")
    assert one_line_error(code, err), err
    assert listing(tmp_path) == ["k.key"]


# ---- random mutations of a saved key ----------------------------------------------------------------------

PLAIN_FIELDS = [("version",), ("format",), ("params",), ("params", 0), ("params", 0, "name"), ("params", 0, "numel"),
                ("params", 0, "encoding"), ("params", 0, "count"), ("params", 1, "count"), ("payload_sha256",),
                ("locked_fingerprint",), ("original_fingerprint",), ("locked_tensors",), ("model_class",),
                ("entries",), ("units_extracted",), ("config",), ("model_type",)]
SEALED_FIELDS = [("version",), ("format",), ("cipher",), ("kdf",), ("kdf", "name"), ("kdf", "n"), ("kdf", "r"),
                 ("kdf", "p"), ("kdf", "salt"), ("nonce",)]
DELETE = object()
JSON_VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(-2 ** 70, 2 ** 70), st.integers(0, 64), st.floats(allow_nan=False),
    st.text(max_size=20), st.sampled_from([2 ** 4, 2 ** 5, 1, 2, "index", "mask", "1", "AAAA",
                                           base64.b64encode(b"z" * 12).decode(), base64.b64encode(b"z" * 16).decode()]),
    st.lists(st.integers(), max_size=3), st.dictionaries(st.text(max_size=5), st.integers(), max_size=2),
    st.just(DELETE))


# a deeper search when asked: MLPSURGERY_FUZZ_EXAMPLES=2000 python -m pytest tests/test_corelocker_keys.py -k mutated
EXAMPLES = int(os.environ.get("MLPSURGERY_FUZZ_EXAMPLES", "40"))
# The suite (CI) explores the same examples every run; MLPSURGERY_FUZZ_RANDOM=1 explores new ones.
DERANDOMIZE = not os.environ.get("MLPSURGERY_FUZZ_RANDOM")


def mutations(fields):
    where = st.integers(0, 2 ** 32)
    return st.one_of(
        st.tuples(st.just("flip"), where, st.integers(1, 255), st.booleans()),
        st.tuples(st.just("truncate"), where),
        st.tuples(st.just("insert"), where, st.binary(min_size=1, max_size=16)),
        st.tuples(st.just("delete"), where, st.integers(1, 64)),
        st.tuples(st.just("field"), st.sampled_from(fields), JSON_VALUES),
    )


def mutate(blob: bytes, m) -> bytes:
    kind = m[0]
    if kind == "flip":  # anywhere, or inside the safetensors header (where a sealed key keeps its parameters)
        _, where, xor, in_header = m
        span = 8 + int.from_bytes(blob[:8], "little") if in_header else len(blob)
        i = where % span
        return blob[:i] + bytes([blob[i] ^ xor]) + blob[i + 1:]
    if kind == "truncate":
        return blob[:m[1] % len(blob)]
    if kind == "insert":
        i = m[1] % (len(blob) + 1)
        return blob[:i] + m[2] + blob[i:]
    if kind == "delete":
        i = m[1] % len(blob)
        return blob[:i] + blob[i + m[2]:]
    _, path, value = m

    def edit(h):
        *parents, last = path
        for p in parents:
            if not (isinstance(h, dict) and p in h) and not (isinstance(h, list) and isinstance(p, int) and p < len(h)):
                return
            h = h[p]
        if isinstance(h, dict) and value is DELETE:
            h.pop(last, None)
        elif isinstance(h, dict) or (isinstance(h, list) and last < len(h) and value is not DELETE):
            h[last] = value

    return rewrite_header(blob, edit)


def unlock_mutated(root: Path, original: dict, locked: str, key: str, mutation, work: Path) -> None:
    """Unlock with a mutated key; the outcome is an exact restore or a one-line refusal with nothing written."""
    work.mkdir(exist_ok=True)
    for p in work.iterdir():
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    mutated = mutate((root / key).read_bytes(), mutation)
    (work / "k.key").write_bytes(mutated)
    out = work / "out"
    code, stdout, err = cli("unlock", root / locked, "--key", work / "k.key", "--out", out, "--json")
    if code == 0:
        restored = type(tiny_model(ARCH)).from_pretrained(out)
        assert identical(restored, original), "a changed key restored something other than the original"
        assert json.loads(stdout)["check"] == ("authenticated" if key == "sealed.key" else "consistent")
        shutil.rmtree(out)
        event("restored exactly")
    else:
        assert one_line_error(code, err), err
        event("refused: " + re.sub(r"\S*/\S*", "PATH", err.removeprefix("mlpsurgery: error: "))[:60])
    assert listing(work) == ["k.key"]  # no output folder, no temporary sibling


@settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=DERANDOMIZE,
          suppress_health_check=[HealthCheck.too_slow])
@given(mutation=mutations(PLAIN_FIELDS))
def test_mutated_plain_keys_restore_exactly_or_are_refused_in_one_line(made, mutation):
    root, original = made
    unlock_mutated(root, original, "locked", "plain.key", mutation, root / "work_plain")


@settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=DERANDOMIZE,
          suppress_health_check=[HealthCheck.too_slow])
@given(mutation=mutations(SEALED_FIELDS))
def test_mutated_sealed_keys_restore_exactly_or_are_refused_in_one_line(made, mutation):
    root, original = made
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLPSURGERY_PASSPHRASE", PASSPHRASE)
        unlock_mutated(root, original, "locked_s", "sealed.key", mutation, root / "work_sealed")


def test_a_key_is_written_streamed_and_equals_the_key_in_one_piece(tmp_path, monkeypatch):
    """The key file is written as it is made, chunk by chunk, never whole in memory: plain, it is byte for byte
    safetensors' `save` of the key's tensors (what keys were before the streaming); sealed, its ciphertext is
    AES-GCM's one-shot encryption of that plain key under the same salt and nonce (tag included)."""
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    from mlpsurgery.methods.corelocker.keyfile import key_file_chunks, write_key_file
    from mlpsurgery.methods.corelocker.sealing import _scrypt_key, sealed_header
    from mlpsurgery.tensorfiles import serialized

    monkeypatch.setattr(sealing, "SCRYPT", FAST_KDF)
    model = tiny_model("llama")
    key = lock_key(model, CoreLockerConfig(ratio=0.05))
    plain = key_bytes(key, numels(model))
    size, chunks = key_file_chunks(key, numels(model))
    chunks = [bytes(c) for c in chunks]
    assert b"".join(chunks) == plain and size == len(plain)
    # the header, then one tensor at a time
    assert len(chunks) == 1 + 2 * len(key.positions) and len(chunks[0]) == 8 + int.from_bytes(plain[:8], "little")
    assert write_key_file(tmp_path / "plain.key", key, numels(model)) == len(plain)
    assert (tmp_path / "plain.key").read_bytes() == plain
    assert stat.S_IMODE((tmp_path / "plain.key").stat().st_mode) == 0o600

    size = write_key_file(tmp_path / "sealed.key", key, numels(model), PASSPHRASE)
    blob = (tmp_path / "sealed.key").read_bytes()
    assert size == len(blob) and stat.S_IMODE((tmp_path / "sealed.key").stat().st_mode) == 0o600
    from safetensors.torch import load

    n = int.from_bytes(blob[:8], "little")
    text = json.loads(blob[8:8 + n])["__metadata__"]["sealed"]
    params, salt, nonce = sealed_header(text)
    ct = load(blob)["ciphertext"].numpy().tobytes()
    assert ct == AESGCM(_scrypt_key(PASSPHRASE, salt, params)).encrypt(nonce, plain, text.encode())
    assert blob == b"".join(bytes(c) for c in serialized({"ciphertext": torch.frombuffer(bytearray(ct), dtype=torch.uint8)},
                                                         {"sealed": text})[1])
    back = read_key(tmp_path / "sealed.key", PASSPHRASE)
    assert back.check == "authenticated" and key_bytes(back, numels(model)) == plain
