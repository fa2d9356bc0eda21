"""Layer-sequential mode (layerwise.py, methods/pruning/layerwise.py): one layer in memory at a time, results
equal to the whole-model mode bit for bit."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import load_file

from conftest import assert_same_folders, file_tensors, saved_checkpoint
from mlpsurgery.errors import MLPSurgeryError
from mlpsurgery.io import MANIFEST, load, save
from mlpsurgery.layerwise import LayerStream
from mlpsurgery.tensorfiles import SafetensorsWriter
from mlpsurgery.methods.pruning import prune
from mlpsurgery.methods.pruning.blocks_layerwise import block_prune_layerwise
from mlpsurgery.methods.pruning.layerwise import _moment_bytes, prune_layerwise
from mlpsurgery.models import load_model
from mlpsurgery.sites import find_sites
from mlpsurgery.tiny import ARCHITECTURES, ENCODERS

CASES = [("magnitude", 0.5, None), ("wanda", 0.5, None), ("sparsegpt", 0.5, None), ("sparsegpt", None, "2:4")]


def _blocks(n=6, t=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, t), generator=g)


def _whole(folder, out, method, sparsity, pattern, data, parts="both", layers=None, dtype=None):
    loaded = load_model(folder, dtype=dtype)
    model, report = prune(loaded.model, method, sparsity, parts=parts, layers=layers, data=data, pattern=pattern,
                          progress=False)
    save(model, out)
    return report


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("method,sparsity,pattern", CASES)
def test_layerwise_pruning_equals_whole_model_bit_for_bit(tmp_path, arch, method, sparsity, pattern):
    src = saved_checkpoint(tmp_path, arch)
    data = _blocks()
    whole = _whole(src, tmp_path / "whole", method, sparsity, pattern, data)
    lw = prune_layerwise(src, tmp_path / "lw", method, sparsity, data=data, pattern=pattern, progress=False)
    a, b = file_tensors(tmp_path / "whole"), file_tensors(tmp_path / "lw")
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    ma, mb = load_file(str(tmp_path / "whole" / "masks.safetensors")), load_file(str(tmp_path / "lw" / "masks.safetensors"))
    assert ma.keys() == mb.keys() and all(torch.equal(ma[k], mb[k]) for k in ma)
    ja, jb = (json.loads((tmp_path / d / MANIFEST).read_text()) for d in ("whole", "lw"))
    for key in ("source", "history", "masks", "dtype", "model_class", "modules"):
        assert ja[key] == jb[key], key
    assert lw["sparsity"] == whole["sparsity"] and lw["per_layer"] == whole["per_layer"]
    # and the folder loads and runs like the whole-model one
    ids = data[:2]
    with torch.no_grad():
        ya, yb = load(tmp_path / "whole")(input_ids=ids), load(tmp_path / "lw")(input_ids=ids)
    key = "logits" if "logits" in ya else "last_hidden_state"
    assert torch.equal(ya[key], yb[key])


@pytest.mark.parametrize("arch,depth", [("llama", {"num_hidden_layers": 5}), ("gpt2", {"n_layer": 5}),
                                        ("bert", {"num_hidden_layers": 5})])
def test_layerwise_reads_shards_in_bfloat16_and_only_some_layers(tmp_path, arch, depth):
    src = saved_checkpoint(tmp_path, arch, dtype=torch.bfloat16, shard="20KB", **depth)
    assert (src / "model.safetensors.index.json").is_file()
    data = _blocks()
    whole = _whole(src, tmp_path / "whole", "sparsegpt", 0.5, None, data, parts="ffn", layers=[1, 3], dtype="auto")
    lw = prune_layerwise(src, tmp_path / "lw", "sparsegpt", 0.5, parts="ffn", layers=[1, 3], data=data, dtype="auto",
                         progress=False)
    a, b = file_tensors(tmp_path / "whole"), file_tensors(tmp_path / "lw")
    assert all(t.dtype == torch.bfloat16 for t in b.values() if t.is_floating_point())
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert lw["per_layer"] == whole["per_layer"] and lw["dtype"] == "bfloat16"


def test_activations_past_max_memory_go_to_disk_from_the_first_batch_on(tmp_path):
    """The first layer's inputs are not gathered in RAM and then spilled: the set's size is known from the first
    batch, so each batch goes to its file as it is recorded (RAM holds one batch, not the set, even briefly)."""
    src = saved_checkpoint(tmp_path, "llama")
    data = _blocks(n=8, t=32)
    for disk in (False, True):
        stream = LayerStream(src, spill_dir=tmp_path / "spill")
        if disk:
            cap = (stream.resident_bytes + 2 * max(stream.layer_bytes) + 1) / 2**30
            stream = LayerStream(src, spill_dir=tmp_path / "spill", max_memory_gb=cap)
        seen, stored = [], []
        stream.model.get_input_embeddings().register_forward_hook(lambda *a: seen.append(1))
        real = stream._store
        stream._store = lambda t, d, tag: (stored.append((tag, d, len(seen))), real(t, d, tag))[1]
        acts = stream.layer_inputs(data, batch_size=2)
        assert stream.disk == disk and len(acts.hidden) == 4
        # batch b stored while batch b ran (not after the last one), in a file when past the cap
        assert stored == [(f"in-{b}", disk, b + 1) for b in range(4)]
        if disk:
            assert sorted(p.name for p in (tmp_path / "spill").iterdir()) == [f"in-{b}.bin" for b in range(4)]
            ram = LayerStream(src).layer_inputs(data, batch_size=2)
            assert all(torch.equal(a, b) for a, b in zip(acts.hidden, ram.hidden))


def test_a_capture_pass_can_end_at_the_mlps_entry(tmp_path):
    """`run(keep=False, until=E)`: a hook that has its rows raises E and the batch's pass ends there (the MLP never
    runs), with the same rows as the whole pass; a pass that ends early and should keep its output is refused."""
    from mlpsurgery.methods.reconstruct.sequential import _Stop, rows_hook

    src = saved_checkpoint(tmp_path, "llama")
    stream = LayerStream(src)
    acts = stream.layer_inputs(_blocks(n=4, t=16), batch_size=2)
    stream.materialise(0)
    site = find_sites(stream.model).mlp[0]
    got, calls = {}, []
    exit_hook = site.exit.register_forward_hook(lambda *_: calls.append(1))
    for name, stop in (("whole", False), ("ended", True)):
        rows: list = []
        hook = site.entry.register_forward_pre_hook(rows_hook(rows, stop=stop))
        try:
            stream.run(0, acts, keep=False, until=_Stop if stop else None)
        finally:
            hook.remove()
        got[name] = (torch.cat(rows), len(calls))
        calls.clear()
    exit_hook.remove()
    assert torch.equal(got["whole"][0], got["ended"][0])
    assert got["whole"][1] == 2 and got["ended"][1] == 0  # two batches; the ended pass never reached the MLP's exit
    with pytest.raises(MLPSurgeryError, match="internal"):
        stream.run(0, acts, keep=True, until=_Stop)


def test_activations_spill_to_disk_under_max_memory_with_the_same_result(tmp_path):
    src = saved_checkpoint(tmp_path, "llama")
    data = _blocks(n=8, t=32)
    prune_layerwise(src, tmp_path / "ram", "wanda", 0.5, data=data, progress=False)
    stream = LayerStream(src)
    sites = find_sites(stream.model)
    fixed = stream.resident_bytes + 2 * max(stream.layer_bytes) + _moment_bytes(stream, sites, "both", [0, 1])
    acts = data.numel() * stream.model.config.hidden_size * 4
    # room for everything but both sets of activations: they go to memory-mapped files, the result is the same
    r = prune_layerwise(src, tmp_path / "disk", "wanda", 0.5, data=data, progress=False,
                        max_memory_gb=(fixed + 1.5 * acts) / 2**30)
    assert r["activations_on_disk"]
    a, b = file_tensors(tmp_path / "ram"), file_tensors(tmp_path / "disk")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not (tmp_path / "disk" / ".activations").exists()
    with pytest.raises(MLPSurgeryError, match="max-memory"):
        prune_layerwise(src, tmp_path / "tiny-budget", "wanda", 0.5, data=data, progress=False, max_memory_gb=1e-6)
    assert not (tmp_path / "tiny-budget").exists()


def test_layerwise_refuses_what_it_cannot_do_before_writing(tmp_path):
    src = saved_checkpoint(tmp_path, "llama")
    with pytest.raises(MLPSurgeryError, match="layerwise"):
        prune_layerwise(src, tmp_path / "o1", "fisher", 0.5, data=_blocks(), progress=False)
    with pytest.raises(MLPSurgeryError, match="calibration"):
        prune_layerwise(src, tmp_path / "o2", "wanda", 0.5, progress=False)
    (src / "model.safetensors").rename(src / "weights.bin")
    with pytest.raises(MLPSurgeryError, match="safetensors"):
        prune_layerwise(src, tmp_path / "o3", "magnitude", 0.5, progress=False)
    assert not any((tmp_path / o).exists() for o in ("o1", "o2", "o3"))


def test_streamed_safetensors_file_reads_back(tmp_path):
    t = {"b": torch.randn(3, 4), "a": torch.randn(5).bfloat16(), "m": torch.rand(2, 3) > 0.5, "i": torch.arange(4)}
    w = SafetensorsWriter(tmp_path / "x.safetensors", {k: (v.dtype, tuple(v.shape)) for k, v in t.items()},
                          metadata={"format": "pt"})
    for k in ("m", "a", "i", "b"):  # any order
        w.write(k, t[k])
    w.close()
    back = load_file(str(tmp_path / "x.safetensors"))
    assert back.keys() == t.keys() and all(torch.equal(back[k], t[k]) for k in t)
    raw = (tmp_path / "x.safetensors").read_bytes()
    assert (8 + struct.unpack("<Q", raw[:8])[0]) % 8 == 0
    w = SafetensorsWriter(tmp_path / "y.safetensors", {"b": (torch.float32, (3, 4))})
    with pytest.raises(MLPSurgeryError, match="unwritten"):
        w.close()
    with pytest.raises(MLPSurgeryError, match="header"):
        SafetensorsWriter(tmp_path / "z.safetensors", {"b": (torch.float32, (3, 4))}).write("b", torch.zeros(4, 3))


def test_damaged_shard_is_refused_with_its_name(tmp_path):
    src = saved_checkpoint(tmp_path, "llama")
    raw = (src / "model.safetensors").read_bytes()
    (src / "model.safetensors").write_bytes(raw[:len(raw) // 2])  # cut short: offsets beyond the end
    with pytest.raises(MLPSurgeryError, match="model.safetensors"):
        prune_layerwise(src, tmp_path / "o", "magnitude", 0.5, progress=False)
    assert not (tmp_path / "o").exists()


def test_cli_prune_layerwise_equals_the_whole_model_command(tmp_path, capsys):
    from mlpsurgery.cli import main
    from mlpsurgery.tiny import byte_tokenizer

    src = saved_checkpoint(tmp_path, "llama", num_hidden_layers=3)
    byte_tokenizer().save_pretrained(src)
    common = ["prune", str(src), "--method", "sparsegpt", "--sparsity", "0.5", "--calib-blocks", "4",
              "--block-len", "32", "--layers", "1-2", "--quiet", "--json"]
    assert main([*common, "--out", str(tmp_path / "whole")]) == 0
    assert main([*common, "--layerwise", "--max-memory", "4", "--out", str(tmp_path / "lw")]) == 0
    capsys.readouterr()
    a, b = file_tensors(tmp_path / "whole"), file_tensors(tmp_path / "lw")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # refused, exit 2, nothing written: an N:M pattern for a method that removes blocks, a cap without the mode
    assert main(["prune", str(src), "--method", "fisher", "--pattern", "2:4", "--layerwise",
                 "--out", str(tmp_path / "x1")]) == 2
    assert main(["prune", str(src), "--method", "wanda", "--sparsity", "0.5", "--max-memory", "2",
                 "--out", str(tmp_path / "x2")]) == 2
    assert main(["prune", "tiny:llama", "--method", "wanda", "--sparsity", "0.5", "--layerwise",
                 "--out", str(tmp_path / "x3")]) == 2
    assert not any((tmp_path / x).exists() for x in ("x1", "x2", "x3"))


# ---- structured pruning one layer at a time (methods/pruning/blocks_layerwise.py) -------------------------

def _same_folders(a_dir, b_dir):
    assert_same_folders(a_dir, b_dir, keys=("source", "history", "masks", "dtype", "model_class", "modules", "config"))


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("method", ["fisher", "random"])
def test_layerwise_block_pruning_equals_whole_model_bit_for_bit(tmp_path, arch, method):
    """Fisher's backward pass layer by layer (every layer rerun on its kept inputs, the gradient handed down) gives
    the whole model's scores, subnet, errors and folder bit for bit; encoders without a loss are refused by both."""
    src = saved_checkpoint(tmp_path, arch)
    data = _blocks()
    if method == "fisher" and arch in ENCODERS:
        with pytest.raises(MLPSurgeryError, match="no language-model loss"):
            prune(load_model(src).model, "fisher", 0.5, data=data, blocks=4, progress=False)
        with pytest.raises(MLPSurgeryError, match="no language-model loss"):
            block_prune_layerwise(src, tmp_path / "lw", "fisher", 0.5, data=data, blocks=4, progress=False)
        assert not (tmp_path / "lw").exists()
        return
    parts = "both"
    if arch in ("olmo2", "olmo3"):  # q / k norms across every head: its heads stay, asked for by name before any work
        with pytest.raises(MLPSurgeryError, match="q_norm.weight"):
            prune(load_model(src).model, method, 0.5, data=data, blocks=4, progress=False)
        with pytest.raises(MLPSurgeryError, match="q_norm.weight"):
            block_prune_layerwise(src, tmp_path / "lw", method, 0.5, data=data, blocks=4, progress=False)
        assert not (tmp_path / "lw").exists()
        parts = "ffn"
    new, whole = prune(load_model(src).model, method, 0.5, parts=parts, data=data, blocks=4, progress=False)
    save(new, tmp_path / "whole")
    lw = block_prune_layerwise(src, tmp_path / "lw", method, 0.5, parts=parts, data=data, blocks=4, progress=False)
    _same_folders(tmp_path / "whole", tmp_path / "lw")
    assert lw["per_layer"] == whole["per_layer"] and lw.get("fisher") == whole.get("fisher")
    assert lw["params_after"] < lw["params_before"]
    if method == "fisher":  # the errors are measured: a removed block costs something on every chosen layer
        assert all(0 < row["error_rel"] < 1 for row in lw["per_layer"])
    ids = data[:2]
    with torch.no_grad():
        ya, yb = load(tmp_path / "whole")(input_ids=ids), load(tmp_path / "lw")(input_ids=ids)
    key = "logits" if "logits" in ya else "last_hidden_state"
    assert torch.equal(ya[key], yb[key])


@pytest.mark.parametrize("arch", ["llama", "gpt2", "qwen3", "phi3"])
@pytest.mark.parametrize("method", ["fisher", "random"])
def test_layerwise_block_pruning_with_the_refit_equals_whole_model_bit_for_bit(tmp_path, arch, method):
    """prune --refit --layerwise: the narrowed projections refit as the layers are written (the sequential walk's
    own step on a calibration stream through the written layers) give prune + refit_narrowed_'s folder and errors."""
    from mlpsurgery.methods.reconstruct.layer import refit_narrowed_

    src = saved_checkpoint(tmp_path, arch)
    data = _blocks()
    original = load_model(src).model
    new, _ = prune(original, method, 0.5, data=data, blocks=4, progress=False)
    errors = refit_narrowed_(new, original, data)
    save(new, tmp_path / "whole")
    lw = block_prune_layerwise(src, tmp_path / "lw", method, 0.5, data=data, blocks=4, progress=False, refit=True)
    _same_folders(tmp_path / "whole", tmp_path / "lw")
    assert lw["refit"] == {str(i): e for i, e in errors.items()}
    assert all(e["error_after"] < e["error_before"] for e in errors.values() if "error_after" in e)
    with pytest.raises(MLPSurgeryError, match="nothing to refit"):  # nothing narrowed: refused, nothing written
        block_prune_layerwise(src, tmp_path / "none", "random", 0.0, data=data, blocks=4, progress=False, refit=True)
    assert not (tmp_path / "none").exists()


@pytest.mark.parametrize("arch,depth", [("llama", {"num_hidden_layers": 5}), ("gpt2", {"n_layer": 5})])
def test_layerwise_fisher_on_some_layers_in_bfloat16_spilled_to_disk(tmp_path, arch, depth):
    """Layers 1 and 3 of 5 (the backward stops at the first chosen layer, whose input needs no gradient), MLP only,
    bfloat16 shards, and a --max-memory that sends every kept activation and gradient to files: the same folder."""
    src = saved_checkpoint(tmp_path, arch, dtype=torch.bfloat16, shard="20KB", **depth)
    data = _blocks(n=8, t=32)
    new, whole = prune(load_model(src, dtype="auto").model, "fisher", 0.5, parts="ffn", layers=[1, 3], data=data,
                       blocks=4, progress=False)
    save(new, tmp_path / "whole")
    stream = LayerStream(src, dtype="auto")
    fixed = stream.resident_bytes + 2 * max(stream.layer_bytes)
    spill = tmp_path / "spill"
    lw = block_prune_layerwise(src, tmp_path / "lw", "fisher", 0.5, parts="ffn", layers=[1, 3], data=data, blocks=4,
                               dtype="auto", max_memory_gb=(fixed + 1) / 2**30, spill_dir=spill, progress=False)
    assert lw["activations_on_disk"] and lw["dtype"] == "bfloat16" and not spill.exists()
    _same_folders(tmp_path / "whole", tmp_path / "lw")
    assert lw["per_layer"] == whole["per_layer"] and lw["fisher"] == whole["fisher"]
    assert [r["layer"] for r in lw["per_layer"] if r["sparsity"] > 0] == [1, 3]
    with pytest.raises(MLPSurgeryError, match="spill_dir"):  # a cap with nowhere to spill: refused, nothing written
        block_prune_layerwise(src, tmp_path / "nowhere", "fisher", 0.5, data=data, blocks=4, max_memory_gb=1,
                              progress=False)
    assert not (tmp_path / "nowhere").exists()


def test_cli_prune_layerwise_fisher_and_random(tmp_path, capsys):
    from mlpsurgery.cli import main
    from mlpsurgery.tiny import byte_tokenizer

    src = saved_checkpoint(tmp_path, "llama", num_hidden_layers=3)
    byte_tokenizer().save_pretrained(src)
    stream = LayerStream(src)
    cap = repr((stream.resident_bytes + 2 * max(stream.layer_bytes) + 1) / 2**30)
    for method in ("fisher", "random"):
        common = ["prune", str(src), "--method", method, "--sparsity", "0.5", "--blocks", "4", "--calib-blocks", "8",
                  "--block-len", "32", "--layers", "1-2", "--quiet", "--json"]
        assert main([*common, "--out", str(tmp_path / f"whole-{method}")]) == 0
        capsys.readouterr()
        # a cap of one byte above what one layer needs: Fisher's activations go to OUT.work, removed after
        assert main([*common, "--layerwise", "--max-memory", cap, "--out", str(tmp_path / f"lw-{method}")]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["layerwise"] and out["activations_on_disk"] == (method == "fisher")
        assert not (tmp_path / f"lw-{method}.work").exists()
        _same_folders(tmp_path / f"whole-{method}", tmp_path / f"lw-{method}")
        # --refit: the narrowed projections refit on the same blocks, layer by layer as the whole command does
        assert main([*common, "--refit", "--out", str(tmp_path / f"whole-fit-{method}")]) == 0
        whole = json.loads(capsys.readouterr().out)
        assert main([*common, "--refit", "--layerwise", "--out", str(tmp_path / f"lw-fit-{method}")]) == 0
        lw = json.loads(capsys.readouterr().out)
        assert lw["refit"] == whole["refit"] and sorted(int(i) for i in lw["refit"]) == [1, 2]
        _same_folders(tmp_path / f"whole-fit-{method}", tmp_path / f"lw-fit-{method}")
    # a work folder holding the user's files is refused before anything is read or written
    (tmp_path / "x.work").mkdir()
    (tmp_path / "x.work" / "mine.txt").write_text("keep")
    assert main(["prune", str(src), "--method", "fisher", "--sparsity", "0.5", "--layerwise", "--quiet",
                 "--out", str(tmp_path / "x")]) == 2
    assert not (tmp_path / "x").exists() and (tmp_path / "x.work" / "mine.txt").read_text() == "keep"


# ---- perplexity one layer at a time (LayerStream.outputs, measure.perplexity_layerwise) -------------------

CAUSAL = [a for a in ARCHITECTURES if a not in ENCODERS]


@pytest.mark.parametrize("arch", CAUSAL)
def test_layerwise_perplexity_equals_whole_model_bit_for_bit(tmp_path, arch):
    """Windows of several lengths (documents shorter than a block, a cut last window), with and without BOS: the
    streamed layers and the model's own head (final norm, soft-capping) give the whole model's perplexity exactly."""
    from mlpsurgery.measure.perplexity import perplexity, perplexity_layerwise

    src = saved_checkpoint(tmp_path, arch)
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 256, (n,), generator=g) for n in (40, 70, 9, 23)]
    model = load_model(src).model
    for bos, stride, max_tokens in ((None, None, None), (1, 5, 90)):
        a = perplexity(model, seqs, block_len=16, stride=stride, batch_size=3, max_tokens=max_tokens, bos_id=bos,
                       progress=False)
        b = perplexity_layerwise(LayerStream(src), seqs, block_len=16, stride=stride, batch_size=3,
                                 max_tokens=max_tokens, bos_id=bos, progress=False)
        assert (b.ppl, b.tokens, b.protocol) == (a.ppl, a.tokens, a.protocol)
        assert a.protocol["windows"] > 4


def test_layerwise_perplexity_of_a_folder_mlpsurgery_wrote_in_bfloat16(tmp_path):
    """A fused folder (its reshaped MLPs rebuilt from the manifest) read layer by layer in bfloat16."""
    from mlpsurgery.measure.perplexity import perplexity, perplexity_layerwise
    from mlpsurgery.methods.fusion import FusionConfig, fuse

    m = load_model(saved_checkpoint(tmp_path, "llama")).model
    fuse(m, FusionConfig(width=16, layers="all", n_init=1), progress=False)
    save(m.to(torch.bfloat16), tmp_path / "fused")
    seqs = _blocks(5, 30).unbind(0)
    a = perplexity(load(tmp_path / "fused"), list(seqs), block_len=12, progress=False)
    b = perplexity_layerwise(LayerStream(tmp_path / "fused"), list(seqs), block_len=12, progress=False)
    assert b.ppl == a.ppl and LayerStream(tmp_path / "fused").dtype == torch.bfloat16


def test_cli_eval_ppl_layerwise_equals_the_whole_model_command(tmp_path, capsys):
    from mlpsurgery.cli import main
    from mlpsurgery.tiny import byte_tokenizer

    src = saved_checkpoint(tmp_path, "qwen2")
    byte_tokenizer().save_pretrained(src)
    common = ["eval", "ppl", str(src), "--max-tokens", "300", "--block-len", "32", "--json"]
    assert main(common) == 0
    whole = json.loads(capsys.readouterr().out)
    assert main([*common, "--layerwise"]) == 0
    lw = json.loads(capsys.readouterr().out)
    assert lw["layerwise"] and lw["ppl"] == whole["ppl"] and lw["tokens"] == whole["tokens"] == 300
    # --max-memory just above one layer and the embeddings: the windows' hidden states go to a temporary folder
    # (removed after), the same perplexity
    import tempfile

    stream = LayerStream(src)
    cap = repr((stream.resident_bytes + 2 * max(stream.layer_bytes) + 1) / 2**30)
    (tmp_path / "tmp").mkdir()
    old_tmp, tempfile.tempdir = tempfile.tempdir, str(tmp_path / "tmp")
    try:
        assert main([*common, "--layerwise", "--max-memory", cap]) == 0
    finally:
        tempfile.tempdir = old_tmp
    disk = json.loads(capsys.readouterr().out)
    assert disk["activations_on_disk"] and not lw["activations_on_disk"] and disk["ppl"] == whole["ppl"]
    assert list((tmp_path / "tmp").iterdir()) == []
    assert main([*common, "--max-memory", "1"]) == 2  # caps only the layer-by-layer mode
    # refused, exit 2: a model without files, an encoder, a GPU
    bert = saved_checkpoint(tmp_path, "bert")
    byte_tokenizer().save_pretrained(bert)
    assert main(["eval", "ppl", "tiny:llama", "--layerwise"]) == 2
    assert main(["eval", "ppl", str(bert), "--layerwise"]) == 2
    assert main([*common, "--layerwise", "--device", "cuda:99"]) == 2  # no such GPU here (nor on a 1-GPU machine)
    err = capsys.readouterr().err
    assert "no weight files" in err and "causal language model" in err and "CUDA device" in err
    assert "add --layerwise" in err


def test_cli_layerwise_commands_refuse_a_device_they_do_not_work_on(tmp_path, capsys):
    """CoreLocker, TwIST extraction, `nest rank` and Fisher pruning work each layer on the CPU: a GPU named with
    --device is refused (exit 2, one line, nothing written) rather than ignored; an unusable --device is refused by
    every command before any work."""
    from mlpsurgery.cli import main
    from mlpsurgery.tiny import byte_tokenizer

    src = saved_checkpoint(tmp_path, "llama")
    byte_tokenizer().save_pretrained(src)
    out, key = tmp_path / "out", tmp_path / "k.key"
    gpu = ["--layerwise", "--device", "cuda"]
    capsys.readouterr()  # (the checkpoint's writing)
    for argv, what in (
            (["lock", "key", str(src), "--ratio", "0.05", "--out", str(out), "--key", str(key), *gpu], "lock key"),
            (["unlock", str(src), "--key", str(key), "--out", str(out), *gpu], "unlock"),
            (["twist", "extract", str(src), "--keep", "2", "--out", str(out), *gpu], "twist extract"),
            (["nest", "rank", str(src), "--rank", "4", "--out", str(out), *gpu], "nest rank"),
            (["prune", str(src), "--method", "fisher", "--sparsity", "0.5", "--calib-blocks", "2", "--block-len", "16",
              "--out", str(out), *gpu], "prune --method fisher")):
        assert main(argv) == 2, what
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and f"{what} --layerwise works each layer on the CPU, not on cuda" in err, err
        assert not out.exists() and not key.exists()
    for bad, words in (("gpu0", "not a device name"), ("cuda:99", "CUDA device")):
        assert main(["inspect", str(src), "--device", bad]) == 2
        assert words in capsys.readouterr().err
        assert main(["prune", str(src), "--method", "magnitude", "--sparsity", "0.5", "--layerwise", "--out", str(out),
                     "--device", bad]) == 2
        assert words in capsys.readouterr().err and not out.exists()
