"""--dtype on every command (issue: models of real size run in bfloat16): the model is loaded and worked in the dtype
asked, what is saved keeps it, float32-only steps (SVD, SparseGPT's Hessian, k-means, perplexity sums) upcast
inside, results stay close to float32's, a bfloat16 key unlocks bit for bit in bfloat16, and a folder mlpsurgery
wrote loads in the dtype it was saved in unless told otherwise."""

import json

import pytest
import torch

import mlpsurgery as ms
from mlpsurgery.cli import main
from mlpsurgery.errors import MLPSurgeryError
from mlpsurgery.io import read_manifest
from mlpsurgery.models import default_dtype, load_model
from mlpsurgery.tiny import byte_tokenizer, tiny_model

TEXT = "It was a truth universally acknowledged, that a single man in possession of a good fortune. " * 60


def _json(args, capsys):
    code = main([*args, "--json"])
    cap = capsys.readouterr()
    assert code == 0, cap.err
    return json.loads(cap.out)


def _dtypes(folder):
    return {p.dtype for p in ms.load(folder).parameters()}


@pytest.fixture
def text(tmp_path):
    (tmp_path / "t.txt").write_text(TEXT)
    return str(tmp_path / "t.txt")


def test_perplexity_in_bfloat16_is_close_to_float32(text, capsys):
    args = ["eval", "ppl", "tiny:llama", "--data", text, "--block-len", "64", "--max-tokens", "512"]
    f32 = _json(args, capsys)["ppl"]
    bf16 = _json([*args, "--dtype", "bfloat16"], capsys)["ppl"]
    assert bf16 == pytest.approx(f32, rel=0.03) and bf16 != f32


@pytest.mark.parametrize("command", [
    ["fuse", "tiny:llama", "--width", "16", "--layers", "all"],
    ["prune", "tiny:llama", "--method", "sparsegpt", "--sparsity", "0.5", "--calib-blocks", "2", "--block-len", "32"],
    ["prune", "tiny:gpt2", "--method", "wanda", "--pattern", "2:4", "--calib-blocks", "2", "--block-len", "32"],
    ["nest", "tiny:llama", "--max-rank", "16"],
    ["fuse", "tiny:opt", "--width", "16", "--layers", "all", "--tune-steps", "2", "--block-len", "32"],  # + tune data
    ["lock", "dlr", "tiny:llama", "--rank", "4", "--depth", "2", "--phase1-steps", "2", "--phase2-steps", "1",
     "--calib-blocks", "2", "--block-len", "32", "--no-compile"],
])
def test_methods_work_and_save_in_bfloat16(tmp_path, capsys, command, text):
    data = {"prune": ["--data", text], "lock": ["--data", text]}.get(command[0], [])
    if "--tune-steps" in command:
        data = ["--tune-data", text]
    _json([*command, *data, "--out", str(tmp_path / "m"), "--dtype", "bfloat16"], capsys)
    assert _dtypes(tmp_path / "m") == {torch.bfloat16}
    assert read_manifest(tmp_path / "m")["dtype"] == "bfloat16"
    # the folder loads in its own dtype by default, in another when asked
    assert {p.dtype for p in load_model(tmp_path / "m").model.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in load_model(tmp_path / "m", dtype="float32").model.parameters()} == {torch.float32}


def test_a_bfloat16_key_unlocks_bit_for_bit(tmp_path, capsys):
    src = tmp_path / "src"
    m = tiny_model("llama").to(torch.bfloat16)
    m.save_pretrained(src)
    byte_tokenizer().save_pretrained(src)
    _json(["lock", "key", str(src), "--ratio", "0.1", "--out", str(tmp_path / "locked"), "--key",
           str(tmp_path / "k.key"), "--dtype", "auto"], capsys)
    assert _dtypes(tmp_path / "locked") == {torch.bfloat16}
    _json(["unlock", str(tmp_path / "locked"), "--key", str(tmp_path / "k.key"), "--out", str(tmp_path / "back")],
          capsys)
    back = load_model(tmp_path / "back").model.state_dict()
    orig = m.state_dict()
    assert set(back) >= set(orig) and all(back[k].dtype == torch.bfloat16 and torch.equal(back[k], orig[k])
                                          for k in orig)


def test_ntk_of_a_bfloat16_candidate(tmp_path, capsys, text):
    """Captured float32 inputs meet the bfloat16 candidate's modules (sites.subblock casts them)."""
    _json(["fuse", "tiny:llama", "--width", "16", "--layers", "all", "--out", str(tmp_path / "f"), "--dtype",
           "bfloat16"], capsys)
    r = _json(["eval", "ntk", "tiny:llama", str(tmp_path / "f"), "--data", text, "--n", "2", "--block-len", "32",
               "--dtype", "bfloat16"], capsys)
    assert r["output"]["layers"] and all(0 <= x["error_rel"] < 10 for x in r["output"]["layers"])


def test_auto_and_refusals(tmp_path):
    folder = tmp_path / "bf"
    tiny_model("llama").to(torch.bfloat16).save_pretrained(folder)
    assert next(load_model(folder).model.parameters()).dtype == torch.float32  # stock default: float32
    assert next(load_model(folder, dtype="auto").model.parameters()).dtype == torch.bfloat16
    with default_dtype("float16"):
        assert next(load_model("tiny:llama").model.parameters()).dtype == torch.float16
    with pytest.raises(MLPSurgeryError, match="not one of"):
        load_model("tiny:llama", dtype="int8")
    with pytest.raises(MLPSurgeryError, match="floating-point"):
        load_model("tiny:llama", dtype=torch.int8)
