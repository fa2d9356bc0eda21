"""Random damage to what users hand mlpsurgery: a saved folder's surgery.json and a text corpus, fed to the CLI
(`inspect`, `eval ppl`, `export`). Every outcome is a success or a one-line error with exit status 2: never a
traceback, never a file written. (Keys get the same treatment in test_corelocker_keys.py.)"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import outputs
from mlpsurgery.cli import main
from mlpsurgery.io import MANIFEST, load, save
from mlpsurgery.io.manifest import _digest
from mlpsurgery.modules.dense import DenseMLP
from mlpsurgery.sites import find_sites
from mlpsurgery.tiny import byte_tokenizer, tiny_model

EXAMPLES = int(os.environ.get("MLPSURGERY_FUZZ_EXAMPLES", "40"))
# The suite (CI) explores the same examples every run; MLPSURGERY_FUZZ_RANDOM=1 explores new ones.
DERANDOMIZE = not os.environ.get("MLPSURGERY_FUZZ_RANDOM")
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=DERANDOMIZE,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=True) | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
                    max_leaves=6)
IDS = torch.tensor([[5, 6, 7, 8, 9]])


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A saved folder whose manifest has every kind of field: a replaced MLP (DenseMLP), a resized stock linear,
    a history, pruning masks."""
    from mlpsurgery.methods.pruning import magnitude_prune

    model = tiny_model("llama")
    sites = find_sites(model)
    sites.mlp[0].replace_mlp(DenseMLP.from_weights(sites.mlp[0].read().select(torch.arange(0, 64, 2))))
    sites.mlp[1].write(sites.mlp[1].read().select(torch.arange(40)))
    magnitude_prune(model, 0.3, parts="attn", layers=[1])
    folder = save(model, tmp_path_factory.mktemp("saved") / "m", tokenizer=byte_tokenizer())
    text = tmp_path_factory.mktemp("text") / "t.txt"
    text.write_text("It is a truth universally acknowledged, that a single man. " * 20)
    return folder, outputs(model, IDS), text


def listing(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def run(argv, capsys) -> tuple[int, str]:
    code = main([str(a) for a in argv])
    return code, capsys.readouterr().err


def assert_clean(code: int, err: str) -> None:
    assert code in (0, 2), (code, err)
    if code == 2:
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err


def _paths(obj, prefix=()):
    """Every path (tuple of keys / indices) inside a JSON value."""
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, prefix + (i,))


def _set(obj, path, value):
    if not path:
        return value
    obj[path[0]] = _set(obj[path[0]], path[1:], value)
    return obj


@FUZZ
@given(data=st.data(), resign=st.booleans())
def test_edited_manifest_is_loaded_exactly_or_refused_in_one_line(saved, capsys, data, resign):
    """Any field of the manifest replaced by any JSON value (the digest re-signed, as a deliberate editor would, or
    not): refused in one line, or loaded; unsigned edits are always refused unless they changed nothing."""
    folder, ref, _ = saved
    root = Path(tempfile.mkdtemp())
    try:
        m = root / "m"
        shutil.copytree(folder, m)
        manifest = json.loads((m / MANIFEST).read_text())
        paths = [p for p in _paths(manifest) if p and p[0] != "manifest_sha256"]
        path = data.draw(st.sampled_from(paths))
        edited = _set(json.loads(json.dumps(manifest)), path, data.draw(JSON))
        if resign and isinstance(edited, dict):
            edited["manifest_sha256"] = _digest(edited)
        (m / MANIFEST).write_text(json.dumps(edited))
        before = listing(root)
        code, err = run(["inspect", m], capsys)
        assert_clean(code, err)
        assert listing(root) == before
        if code == 0 and not resign and edited != manifest:
            pytest.fail(f"an unsigned edit at {path} loaded: {err}")
        if code == 0 and not resign:
            assert torch.equal(outputs(load(m), IDS), ref)
    finally:
        shutil.rmtree(root)


@FUZZ
@given(data=st.data())
def test_damaged_manifest_bytes_are_refused_in_one_line(saved, capsys, data):
    folder, ref, _ = saved
    root = Path(tempfile.mkdtemp())
    try:
        m = root / "m"
        shutil.copytree(folder, m)
        raw = bytearray((m / MANIFEST).read_bytes())
        how = data.draw(st.sampled_from(["flip", "truncate", "insert"]))
        at = data.draw(st.integers(0, len(raw) - 1))
        if how == "flip":
            raw[at] ^= data.draw(st.integers(1, 255))
        elif how == "truncate":
            raw = raw[:at]
        else:
            raw[at:at] = data.draw(st.binary(min_size=1, max_size=16))
        (m / MANIFEST).write_bytes(bytes(raw))
        before = listing(root)
        code, err = run(["export", m, "--out", root / "exported"], capsys)
        assert_clean(code, err)
        assert listing(root) == before or (code == 0 and json.loads(raw) == json.loads(folder.joinpath(MANIFEST).read_text()))
    finally:
        shutil.rmtree(root)


@FUZZ
@given(data=st.data(), gz=st.booleans())
def test_any_corpus_file_gives_a_perplexity_or_a_one_line_error(saved, capsys, data, gz):
    """Arbitrary bytes (text, binary, invalid UTF-8, an empty or a too-short file, a broken gzip) as --data."""
    _, _, text = saved
    root = Path(tempfile.mkdtemp())
    try:
        base = text.read_bytes()
        body = data.draw(st.one_of(st.binary(max_size=200), st.text(max_size=300).map(str.encode),
                                   st.builds(lambda cut, junk: base[:cut] + junk, st.integers(0, len(base)),
                                             st.binary(max_size=30))))
        if gz and data.draw(st.booleans()):
            body = gzip.compress(body)
        path = root / ("c.txt.gz" if gz else "c.txt")
        path.write_bytes(body)
        before = listing(root)
        code, err = run(["eval", "ppl", "tiny:llama", "--data", path, "--max-tokens", "64", "--block-len", "16",
                         "--quiet"], capsys)
        assert_clean(code, err)
        assert listing(root) == before
    finally:
        shutil.rmtree(root)
