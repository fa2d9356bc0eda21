"""Shared fixtures: tiny models of every architecture (built from configs, offline, seeded), the byte
tokenizer, and the real models (SmolLM2, MiniLM) that skip when not installed."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from mlpsurgery.tiny import ARCHITECTURES, DECODERS, byte_tokenizer, tiny_model

torch.set_num_threads(min(2, os.cpu_count() or 1))
SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"
TEXT = ("It is a truth universally acknowledged, that a single man in possession of a good fortune, "
        "must be in want of a wife. However little known the feelings or views of such a man may be.")


def pytest_addoption(parser):
    parser.addoption("--device", default=None,
                     help="run tests/test_device.py on this device (cuda, cuda:N) against the CPU; --device cpu runs "
                          "them here, CPU against CPU, to check the tests themselves")


@pytest.fixture(scope="session")
def device(request):
    """The device of tests/test_device.py (--device); those tests skip without it."""
    name = request.config.getoption("--device")
    if name is None:
        pytest.skip("device tests run with --device cuda (or --device cpu to check them on the CPU)")
    if name.startswith("cuda") and not torch.cuda.is_available():
        pytest.fail(f"--device {name}, but torch sees no CUDA device")
    return name


@pytest.fixture(scope="session")
def tokenizer():
    return byte_tokenizer()


@pytest.fixture(scope="session")
def ids(tokenizer):
    return torch.tensor([tokenizer(TEXT)["input_ids"][:48], tokenizer(TEXT)["input_ids"][48:96]])


def one_line(code, err):
    """A refusal as the CLI must give it: exit 2, one line on stderr, no traceback."""
    return code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def run(capsys, *argv):
    """The CLI in this process: (exit status, stdout, stderr)."""
    from mlpsurgery.cli import main

    code = main([str(a) for a in argv])
    cap = capsys.readouterr()
    return code, cap.out, cap.err


def snapshot(root) -> dict:
    """Every file, link and folder under root (hidden ones too), files with their bytes: what "nothing changed"
    compares."""
    import os

    root, out = Path(root), {}
    for p in sorted(Path(root).rglob("*")):
        rel = str(p.relative_to(root))
        if p.is_symlink():
            out[rel] = ("link", os.readlink(p))
        elif p.is_file():
            out[rel] = p.read_bytes()
        elif p.is_dir():
            out[rel] = "dir"
    return out


def edit_manifest(folder, fn):
    """Change a saved folder's surgery.json with fn(manifest) and re-sign its digest, as a deliberate editor
    would: what load must still catch by its deeper checks."""
    import json

    from mlpsurgery.io import MANIFEST
    from mlpsurgery.io.manifest import _digest

    path = Path(folder) / MANIFEST
    m = json.loads(path.read_text())
    fn(m)
    m["manifest_sha256"] = _digest(m)
    path.write_text(json.dumps(m))


def saved_checkpoint(tmp_path, arch, dtype=torch.float32, shard=None, **overrides):
    """A tiny model of `arch` saved as a stock transformers folder (sharded when `shard` is a size): what the
    layer-sequential mode reads."""
    m = tiny_model(arch, **overrides).to(dtype)
    d = tmp_path / f"ckpt-{arch}"
    m.save_pretrained(d, max_shard_size=shard) if shard else m.save_pretrained(d)
    return d


def file_tensors(folder):
    """Every tensor of folder/model.safetensors, by name."""
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def assert_same_folders(a_dir, b_dir, keys=("source", "history", "masks", "dtype", "model_class", "modules")):
    """Two saved folders hold the same tensors (bit for bit, same dtypes) and the same manifest entries `keys`."""
    import json

    from mlpsurgery.io import MANIFEST

    a, b = file_tensors(a_dir), file_tensors(b_dir)
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    ja, jb = (json.loads((d / MANIFEST).read_text()) for d in (a_dir, b_dir))
    for key in keys:
        assert ja.get(key) == jb.get(key), key
    return ja


def outputs(model, ids):
    """Logits of a causal LM, last hidden state of an encoder."""
    with torch.no_grad():
        out = model(input_ids=ids)
    return out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state


@pytest.fixture(params=ARCHITECTURES)
def arch(request):
    return request.param


@pytest.fixture(params=DECODERS)
def decoder_arch(request):
    return request.param


@pytest.fixture
def model(arch):
    return tiny_model(arch)


def _smollm2():
    from mlpsurgery.models import load_model, smollm2_gguf

    if smollm2_gguf() is None:
        pytest.skip("SmolLM2 is not installed (bash install.sh)")
    return load_model("smollm2")


def _minilm():
    from mlpsurgery.models import load_model, minilm_dir

    if minilm_dir() is None:
        pytest.skip("MiniLM is not installed (bash install.sh)")
    return load_model("minilm")


@pytest.fixture(scope="session")
def smollm2():
    return _smollm2()


@pytest.fixture(scope="session")
def minilm():
    return _minilm()


@pytest.fixture(scope="session")
def shared_data():
    if not SHARED.exists():
        pytest.skip("../shared/data is not beside the checkout")
    return SHARED
