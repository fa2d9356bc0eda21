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


@pytest.mark.parametrize("arch", __import__("mlpsurgery.tiny", fromlist=["ARCHITECTURES"]).ARCHITECTURES)
@pytest.mark.parametrize("stored,wanted", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32),
                                           (torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                           (torch.bfloat16, "auto")])
def test_a_checkpoint_read_on_loading_equals_transformers_load(tmp_path, arch, stored, wanted):
    # a checkpoint is read tensor by tensor with plain reads (models._load_read), cast where the file holds another
    # dtype, not through a memory map of the whole file; the model must be the one from_pretrained gives, bit for bit
    from mlpsurgery.models import _config_dtype, _load_read, _model_class, read_config

    folder = tmp_path / "ckpt"
    tiny_model(arch).to(stored).save_pretrained(folder)
    klass = _model_class(read_config(folder), "auto")
    ours = load_model(folder, dtype=wanted).model
    if wanted == "auto":  # the dtype the config names, as transformers' "auto" takes it
        assert _config_dtype(read_config(folder)) == stored
    assert _load_read(folder, klass, "auto", stored if wanted == "auto" else wanted) is not None  # the path taken
    ref = klass.from_pretrained(folder, local_files_only=True, dtype=wanted).eval()
    assert type(ours) is type(ref) and not ours.training
    a, b = ours.state_dict(), ref.state_dict()
    assert a.keys() == b.keys()
    for n in a:
        assert a[n].dtype == b[n].dtype and torch.equal(a[n], b[n]), n
    assert {n: p.requires_grad for n, p in ours.named_parameters()} == \
        {n: p.requires_grad for n, p in ref.named_parameters()}
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in ref.named_parameters()]  # ties kept
    for (n, x), (_, y) in zip(ours.named_buffers(), ref.named_buffers()):
        assert torch.equal(x, y), n
    assert ours.config.to_dict() == ref.config.to_dict()
    gen_a, gen_b = getattr(ours, "generation_config", None), getattr(ref, "generation_config", None)
    assert (gen_a is None) == (gen_b is None) and (gen_a is None or gen_a.to_dict() == gen_b.to_dict())
    ids = torch.randint(3, 200, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out_a, out_b = ours(input_ids=ids), ref(input_ids=ids)
    key = "logits" if "logits" in out_b else "last_hidden_state"
    assert torch.equal(out_a[key], out_b[key])


def test_a_class_keeping_modules_in_float32_is_left_to_transformers(tmp_path, monkeypatch):
    # transformers keeps such modules in float32 when it loads in bfloat16; the tensor-by-tensor reader would cast
    # them, so it declines (also when the class comes through an Auto class, which names none)
    import transformers

    from mlpsurgery.models import _load_read

    tiny_model("llama").save_pretrained(tmp_path / "ckpt")
    assert _load_read(tmp_path / "ckpt", transformers.AutoModelForCausalLM, "causal-lm", torch.bfloat16) is not None
    monkeypatch.setattr(transformers.LlamaForCausalLM, "_keep_in_fp32_modules", ["down_proj"], raising=False)
    assert _load_read(tmp_path / "ckpt", transformers.AutoModelForCausalLM, "causal-lm", torch.bfloat16) is None


@pytest.mark.parametrize("arch", ["llama", "gpt_neox", "gemma2", "phi3"])
def test_a_saved_folder_loads_in_bfloat16_as_transformers_loads_the_same_weights(tmp_path, arch):
    """`load` (and `load_model` asked for another dtype) builds the saved model in its dtype as transformers does: buffers transformers computes in float32
    (the rotary frequencies) stay float32, so the loaded model's outputs are from_pretrained's bit for bit (they
    were cast to bfloat16 with the weights, which moved every rotary position's angle)."""
    from transformers import AutoModel

    tiny_model(arch).save_pretrained(tmp_path / "hf")
    ref = AutoModel.from_pretrained(tmp_path / "hf", dtype=torch.bfloat16).eval()
    ms.save(ref, tmp_path / "ours")
    ms.save(AutoModel.from_pretrained(tmp_path / "hf"), tmp_path / "ours-f32")  # asked for in bfloat16 below
    for got in (ms.load(tmp_path / "ours"), load_model(tmp_path / "ours-f32", dtype=torch.bfloat16).model):
        fp32 = {n for n, b in ref.named_buffers() if b.dtype == torch.float32}
        assert {n for n, b in got.named_buffers() if b.dtype == torch.float32} == fp32
        assert {p.dtype for p in got.parameters()} == {torch.bfloat16}
        ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            assert torch.equal(got(input_ids=ids).last_hidden_state, ref(input_ids=ids).last_hidden_state)
