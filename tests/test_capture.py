import os

import pytest
import torch

from mlpsurgery.capture import capture_mlp_io, open_capture
from mlpsurgery.errors import MLPSurgeryError
from mlpsurgery.sites import find_sites
from mlpsurgery.tiny import tiny_model


def blocks(n=5, t=16, seed=0):
    return torch.randint(0, 256, (n, t), generator=torch.Generator().manual_seed(seed))


def test_capture_matches_the_subblock(model):
    x_blocks = blocks()
    cap = capture_mlp_io(model, x_blocks, batch_size=2, progress=False)
    assert cap.n_chunks == 3 and cap.n_tokens == 5 * 16
    sites = find_sites(model)
    for i in cap.layers:
        x, y = cap.layer(i)
        assert x.shape == y.shape == (80, 32)
        with torch.no_grad():
            torch.testing.assert_close(y - x, sites.mlp[i].subblock(x), rtol=1e-4, atol=1e-5)
        assert cap.relative_error(i, lambda v: v) == pytest.approx(1.0)
        assert cap.relative_error(i, lambda v: v + sites.mlp[i].subblock(v)) < 1e-8


def test_consolidate_and_keep_change_what_is_held_not_the_rows(model):
    cap = capture_mlp_io(model, blocks(), batch_size=2, progress=False)
    before = {i: cap.layer(i) for i in cap.layers}
    cap.consolidate()
    assert cap.n_chunks == 1 and cap.n_tokens == 80
    for i, (x, y) in before.items():
        got = cap.layer(i)
        assert torch.equal(got[0], x) and torch.equal(got[1], y)
        assert cap.layer(i)[0].data_ptr() == got[0].data_ptr()  # handed out without a copy
    cap.keep([cap.layers[-1]])
    assert cap.layers == [1] and set(cap.memory[0]) == {"x.1", "y.1"}


def test_capture_stops_after_last_layer():
    model = tiny_model("llama", num_hidden_layers=4)
    calls = []
    find_sites(model).mlp[3].layer.register_forward_pre_hook(lambda m, a: calls.append(1))
    capture_mlp_io(model, blocks(), layers=[1], progress=False)
    assert not calls


def test_disk_capture_equals_memory_and_resumes(tmp_path):
    model = tiny_model("qwen2")
    data = blocks(7)
    mem = capture_mlp_io(model, data, batch_size=3, progress=False)
    disk = capture_mlp_io(model, data, batch_size=3, out_dir=tmp_path / "cap", progress=False)
    for i in mem.layers:
        for a, b in zip(mem.layer(i), disk.layer(i)):
            assert torch.equal(a, b)
    # simulate a crash after the first chunk: remove the later chunks, note the survivor's mtime
    first = tmp_path / "cap" / "chunk_00000.safetensors"
    stamp = first.stat().st_mtime_ns
    for k in (1, 2):
        os.remove(tmp_path / "cap" / f"chunk_{k:05d}.safetensors")
    again = capture_mlp_io(model, data, batch_size=3, out_dir=tmp_path / "cap", progress=False)
    assert first.stat().st_mtime_ns == stamp  # not recomputed
    for i in mem.layers:
        for a, b in zip(mem.layer(i), again.layer(i)):
            assert torch.equal(a, b)


def test_open_capture_reads_a_finished_folder_and_refuses_an_unfinished_one(tmp_path):
    model = tiny_model("llama")
    made = capture_mlp_io(model, blocks(7), batch_size=3, out_dir=tmp_path / "cap", progress=False)
    opened = open_capture(tmp_path / "cap")
    assert (opened.layers, opened.d, opened.n_chunks, opened.tokens_per_chunk) == \
        (made.layers, made.d, made.n_chunks, made.tokens_per_chunk) == ([0, 1], 32, 3, [48, 48, 16])
    for i in made.layers:
        assert all(torch.equal(a, b) for a, b in zip(made.layer(i), opened.layer(i)))
    os.remove(tmp_path / "cap" / "chunk_00002.safetensors")
    with pytest.raises(MLPSurgeryError, match="unfinished capture"):
        open_capture(tmp_path / "cap")
    with pytest.raises(MLPSurgeryError, match="no capture"):
        open_capture(tmp_path)


def test_disk_capture_refuses_foreign_folder(tmp_path):
    model = tiny_model("llama")
    capture_mlp_io(model, blocks(), out_dir=tmp_path / "cap", progress=False)
    with pytest.raises(MLPSurgeryError, match="another model"):
        capture_mlp_io(model, blocks(seed=1), out_dir=tmp_path / "cap", progress=False)


def test_bfloat16_storage():
    cap = capture_mlp_io(tiny_model("gemma2"), blocks(), dtype=torch.bfloat16, progress=False)
    assert cap.chunk(0)[0][0].dtype == torch.bfloat16
