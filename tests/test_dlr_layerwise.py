"""DLR-Lock layer by layer (methods/dlr_lock/layerwise.py): one decoder layer read from the files at a time, its
pairs captured from the stream, its DLR-Net distilled as a whole-model run of that layer alone would distil it,
the on-policy pairs taken from the locked layers before it, every stage resumable."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import file_tensors, saved_checkpoint
from mlpsurgery.capture import capture_mlp_io
from mlpsurgery.errors import MLPSurgeryError
from mlpsurgery.io import load
from mlpsurgery.methods.dlr_lock import DLRConfig, phase1
from mlpsurgery.methods.dlr_lock import layerwise as lw
from mlpsurgery.models import load_model
from mlpsurgery.sites import find_sites

BLOCKS = torch.randint(0, 256, (8, 16), generator=torch.Generator().manual_seed(0))


def _cfg(**kw):
    base = dict(rank=4, depth=3, calib_blocks=8, block_len=16, phase1_steps=12, phase1_tokens=32, onpolicy_steps=0,
                phase2_steps=0, compile=False, start_tokens=64)
    return DLRConfig(**{**base, **kw})


def _lock(src, tmp_path, cfg, name="out", **kw):
    work = tmp_path / f"{name}.work"
    return lw.lock_layerwise(lw.open_stream(src, work, **kw), tmp_path / name, cfg, BLOCKS, work, progress=False)


def _spy(monkeypatch, layer: int) -> dict:
    """Keep the pairs layer `layer` is distilled on (a finished layer's captures are removed from the work folder)."""
    seen, real = {}, lw.phase1

    def spy(model, blocks, one, wd, **kw):
        if one.layers == str(layer):
            for name in ("captured", "onpolicy_captured"):
                cap = kw.get(name)
                if cap is not None:
                    seen[name] = [cap.chunk(k)[layer] for k in range(cap.n_chunks)]
        return real(model, blocks, one, wd, **kw)

    monkeypatch.setattr(lw, "phase1", spy)
    return seen


@pytest.mark.parametrize("arch", ["llama", "gpt2", "bert"])
def test_each_layer_is_the_net_a_whole_model_run_of_that_layer_trains(tmp_path, arch, monkeypatch):
    src = saved_checkpoint(tmp_path, arch, num_hidden_layers=3)
    cfg = _cfg()
    seen = _spy(monkeypatch, 2)
    res = _lock(src, tmp_path, cfg)
    locked = load(tmp_path / "out")
    model = load_model(src).model
    for i in range(3):
        nets, rep = phase1(model, BLOCKS, replace(cfg, layers=str(i), seed=lw.layer_seed(cfg, i)), tmp_path / f"w{i}",
                           progress=False)
        got = find_sites(locked).mlp[i].module.state_dict()
        ref = nets[i].state_dict()
        assert got.keys() == ref.keys() and all(torch.equal(got[k], ref[k]) for k in ref), (arch, i)
        assert res["report"]["phase1_relative_error"][i] == rep.phase1_relative_error[i]
    # the captured pairs are the whole model's, bit for bit
    whole = capture_mlp_io(model, BLOCKS, layers=[2], batch_size=4, dtype=torch.bfloat16, progress=False)
    streamed = seen["captured"]
    assert len(streamed) == whole.n_chunks == 2
    for k in range(2):
        assert all(torch.equal(a, b) for a, b in zip(whole.chunk(k)[2], streamed[k]))
    # what stays of a finished layer: its net and report
    assert sorted(p.name for p in (tmp_path / "out.work" / "layer002").iterdir()) == ["layer.json", "net.safetensors"]
    history = json.loads((tmp_path / "out" / "surgery.json").read_text())["history"]
    assert history[-1]["method"] == "dlr_lock" and history[-1]["provenance"]["layerwise"]
    with torch.no_grad():
        locked(input_ids=BLOCKS[:2])  # loads and runs as any locked folder


@pytest.mark.parametrize("arch", ["llama", "gpt_neox", "bert"])
def test_onpolicy_pairs_are_what_the_locked_layers_before_produce(tmp_path, arch, monkeypatch):
    src = saved_checkpoint(tmp_path, arch, num_hidden_layers=3)
    seen = _spy(monkeypatch, 2)
    res = _lock(src, tmp_path, _cfg(layers="0,2", onpolicy_steps=6))
    locked = load(tmp_path / "out")
    model = load_model(src).model
    # layer 2's on-policy inputs: layer 0 with its final net, layer 1 original
    find_sites(model).mlp[0].replace_subblock(find_sites(locked).mlp[0].module)
    ref = capture_mlp_io(model, BLOCKS, layers=[2], batch_size=4, dtype=torch.bfloat16, progress=False)
    got, teacher = seen["onpolicy_captured"], seen["captured"]
    for k in range(2):
        assert all(torch.equal(a, b) for a, b in zip(ref.chunk(k)[2], got[k]))
        assert not torch.equal(got[k][0], teacher[k][0])  # not the teacher's inputs
    rep = res["report"]
    assert rep["layers"] == [0, 2] and set(rep["onpolicy_relative_error"]) == {0, 2}
    assert rep["onpolicy_relative_error"][2] < rep["onpolicy_start_error"][2]  # the steps fit the new inputs


def _stopped_at_layer_2(src, tmp_path, cfg, monkeypatch, calls=None) -> None:
    """A lock stopped (Ctrl-C) when layer 2's distillation starts, its pairs captured; phase1 restored after."""
    real = lw.phase1

    def stop(model, blocks, one, wd, **kw):
        if calls is not None:
            calls.append(one.layers)
        if one.layers == "2":
            raise KeyboardInterrupt
        return real(model, blocks, one, wd, **kw)

    monkeypatch.setattr(lw, "phase1", stop)
    with pytest.raises(KeyboardInterrupt):
        _lock(src, tmp_path, cfg)
    monkeypatch.setattr(lw, "phase1", real)


def test_a_stopped_run_resumes_to_the_uninterrupted_result(tmp_path, monkeypatch):
    src = saved_checkpoint(tmp_path, "llama", num_hidden_layers=3)
    cfg = _cfg(onpolicy_steps=6)
    _lock(src, tmp_path, cfg, "ref")
    real, calls = lw.phase1, []
    _stopped_at_layer_2(src, tmp_path, cfg, monkeypatch, calls)
    assert not (tmp_path / "out").exists() and calls == ["0", "1", "2"]
    assert (tmp_path / "out.work" / "layer002" / "capture" / "capture.json").is_file()  # the stopped layer's pairs
    calls.clear()

    def resumed(model, blocks, one, wd, **kw):
        calls.append(one.layers)
        return real(model, blocks, one, wd, **kw)

    monkeypatch.setattr(lw, "phase1", resumed)
    _lock(src, tmp_path, cfg)
    assert calls == ["2"]  # the finished layers are read back, not distilled again
    a, b = file_tensors(tmp_path / "ref"), file_tensors(tmp_path / "out")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_work_folder_of_another_model_or_other_settings_is_refused(tmp_path):
    src = saved_checkpoint(tmp_path, "llama", num_hidden_layers=3)
    cfg = _cfg()
    _lock(src, tmp_path, cfg)
    (tmp_path / "out").rename(tmp_path / "first")
    with pytest.raises(MLPSurgeryError, match="other settings"):
        _lock(src, tmp_path, replace(cfg, phase1_steps=13))
    _lock(src, tmp_path, replace(cfg, compile=True, memory_limit_gb=1.0))  # how it runs, not what: resumed
    assert all(torch.equal(a, b) for a, b in zip(file_tensors(tmp_path / "first").values(),
                                                 file_tensors(tmp_path / "out").values()))
    (tmp_path / "out").rename(tmp_path / "second")
    _change(src, 1)  # layer 1's net would be another model's
    with pytest.raises(MLPSurgeryError, match="layer 1 locked from another model"):
        _lock(src, tmp_path, cfg)


def _change(src, layer: int) -> None:
    weights = load_file(str(src / "model.safetensors"))
    name = next(k for k in weights if f".{layer}." in k and "mlp" in k)
    weights[name] = weights[name] * 1.01
    save_file(weights, str(src / "model.safetensors"), metadata={"format": "pt"})


def test_a_stopped_layers_capture_is_refused_when_what_reaches_it_changed(tmp_path, monkeypatch):
    src = saved_checkpoint(tmp_path, "llama", num_hidden_layers=3)
    cfg = _cfg(layers="0,2")
    _stopped_at_layer_2(src, tmp_path, cfg, monkeypatch)
    _change(src, 1)  # not locked, so only layer 2's capture knows what it was made from
    with pytest.raises(MLPSurgeryError, match="capture of another model"):
        _lock(src, tmp_path, cfg)


def test_activations_on_disk_give_the_same_lock(tmp_path, monkeypatch):
    src = saved_checkpoint(tmp_path, "llama", num_hidden_layers=3)
    cfg = _cfg(layers="0,2", onpolicy_steps=4)
    ram = _lock(src, tmp_path, cfg, "ram")
    monkeypatch.setattr(lw.LayerStream, "check_memory", lambda self, *args, **kwargs: True)  # as past --max-memory
    disk = _lock(src, tmp_path, cfg, "disk")
    assert not ram["activations_on_disk"] and disk["activations_on_disk"]
    a, b = file_tensors(tmp_path / "ram"), file_tensors(tmp_path / "disk")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_cli_lock_dlr_layerwise_and_its_refusals(tmp_path, capsys):
    from mlpsurgery.cli import main
    from mlpsurgery.tiny import byte_tokenizer

    src = saved_checkpoint(tmp_path, "llama", num_hidden_layers=3)
    byte_tokenizer().save_pretrained(src)
    common = [str(src), "--rank", "4", "--depth", "3", "--calib-blocks", "8", "--block-len", "16", "--phase1-steps",
              "6", "--phase1-tokens", "32", "--onpolicy-steps", "2", "--start-tokens", "64", "--no-compile", "--quiet"]
    assert main(["lock", "dlr", *common, "--layerwise", "--phase2-steps", "0", "--json",
                 "--out", str(tmp_path / "out")]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["layerwise"] and res["report"]["layers"] == [0, 1, 2] and res["workdir"] is None
    assert not (tmp_path / "out.work").exists()  # ours, removed on success
    assert (tmp_path / "out" / "tokenizer_config.json").is_file()
    # refused, exit 2, nothing written: phase 2's top-k at the vocabulary (checked before phase 1 runs),
    # --max-memory without the layer-by-layer mode, a model without files, a GPU this machine does not have
    assert main(["lock", "dlr", *common, "--layerwise", "--top-k", "100000", "--out", str(tmp_path / "x1")]) == 2
    assert main(["lock", "dlr", *common, "--phase2-steps", "0", "--no-layerwise", "--max-memory", "1",
                 "--out", str(tmp_path / "x2")]) == 2
    assert main(["lock", "dlr", "tiny:llama", "--layerwise", "--phase2-steps", "0", "--out", str(tmp_path / "x3")]) == 2
    assert main(["lock", "dlr", *common, "--layerwise", "--device", "cuda:99", "--out", str(tmp_path / "x4")]) == 2
    assert not any((tmp_path / x).exists() for x in ("x1", "x2", "x3", "x4", "x1.work", "x2.work", "x3.work",
                                                      "x4.work"))
    err = capsys.readouterr().err
    assert "vocabulary size 260" in err and "add --layerwise" in err and "no weight files" in err
    assert "--device cuda:99" in err and "CUDA device" in err


def test_cli_lock_dlr_by_default_runs_phase1_layer_by_layer_then_phase2_as_the_two_commands_do(tmp_path, capsys,
                                                                                             monkeypatch):
    """`lock dlr FOLDER` (one process): phase 1 layer by layer, then phase 2 on the whole locked model, in one
    call -- the same folder as `--layerwise --phase2-steps 0` followed by `--phase2-only`; stopped in phase 2, the
    rerun reuses the finished layers (none distilled again) and ends at the same folder; --no-layerwise is the
    whole-model mode."""
    import mlpsurgery.methods.dlr_lock as dl
    from mlpsurgery.cli import main
    from mlpsurgery.tiny import byte_tokenizer

    src = saved_checkpoint(tmp_path, "llama", num_hidden_layers=2)
    byte_tokenizer().save_pretrained(src)
    small = [str(src), "--rank", "4", "--depth", "3", "--calib-blocks", "8", "--block-len", "16", "--phase1-steps",
             "4", "--phase1-tokens", "32", "--onpolicy-steps", "2", "--start-tokens", "64", "--no-compile", "--quiet"]
    p2 = ["--phase2-steps", "4", "--phase2-blocks", "6", "--phase2-batch", "2", "--top-k", "8", "--eval-tokens", "256",
          "--second-corpus", "", "--json"]
    assert main(["lock", "dlr", *small, "--phase2-steps", "0", "--layerwise", "--out", str(tmp_path / "p1")]) == 0
    assert main(["lock", "dlr", str(tmp_path / "p1"), "--phase2-only", "--original", str(src), *p2[:-5],
                 "--block-len", "16", "--eval-tokens", "0", "--no-compile", "--quiet", "--out", str(tmp_path / "two")]) == 0
    capsys.readouterr()

    real, calls = dl.continue_phase2, []

    def interrupt(original):
        raise KeyboardInterrupt

    def stop(*a, **kw):
        calls.append(1)
        if len(calls) == 1:  # the first call stops in phase 2, once its teacher targets are written
            kw = {**kw, "on_teacher": interrupt}
        return real(*a, **kw)

    monkeypatch.setattr(dl, "continue_phase2", stop)
    assert main(["lock", "dlr", *small, *p2, "--out", str(tmp_path / "one")]) == 130
    capsys.readouterr()
    assert (tmp_path / "one.work" / "phase1").is_dir() and not (tmp_path / "one").exists()
    distilled = []
    monkeypatch.setattr(lw, "phase1", lambda *a, **kw: distilled.append(1))  # the rerun distils no layer again
    assert main(["lock", "dlr", *small, *p2, "--out", str(tmp_path / "one")]) == 0
    res = json.loads(capsys.readouterr().out)
    assert not distilled and len(calls) == 2
    a, b = load(tmp_path / "one").state_dict(), load(tmp_path / "two").state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert res["layerwise"] and not res["phase2_only"] and res["report"]["layers"] == [0, 1]
    assert res["report"]["phase1_relative_error"] and res["report"]["phase2_history"]
    assert set(res["perplexity"]) == {"original", "phase1", "phase2"} and res["heldout_ratio"] > 0
    assert res["seconds"] == pytest.approx(res["phase1_seconds"] + res["phase2_seconds"])
    assert not (tmp_path / "one.work").exists() and res["workdir"] is None  # ours, removed on success
    history = json.loads((tmp_path / "one" / "surgery.json").read_text())
    assert [h["method"] for h in history["history"]][-2:] == ["dlr_lock", "dlr_lock"]

    monkeypatch.undo()
    assert main(["lock", "dlr", *small, *p2, "--no-layerwise", "--out", str(tmp_path / "whole")]) == 0
    res = json.loads(capsys.readouterr().out)
    assert not res.get("layerwise") and res["report"]["phase2_history"]


# ---- phase 2 alone on a locked folder (lock.continue_phase2, `lock dlr --phase2-only`) ----------------------

def test_phase2_alone_on_a_saved_phase1_lock_equals_the_lock_in_one_run(tmp_path):
    from mlpsurgery.io import save
    from mlpsurgery.methods.dlr_lock import continue_phase2, dlr_lock

    src = saved_checkpoint(tmp_path, "llama", num_hidden_layers=2)
    p2 = torch.randint(0, 256, (6, 16), generator=torch.Generator().manual_seed(1))
    cfg = _cfg(phase2_steps=5, phase2_batch=2, top_k=8)
    one = load_model(src).model
    dlr_lock(one, BLOCKS, p2, cfg, tmp_path / "one.work", progress=False)
    first = load_model(src).model
    dlr_lock(first, BLOCKS, p2, replace(cfg, phase2_steps=0), tmp_path / "p1.work", progress=False)
    save(first, tmp_path / "p1")
    locked = load(tmp_path / "p1")
    report = continue_phase2(locked, load_model(src).model, p2, cfg, tmp_path / "p2.work", progress=False,
                             on_teacher=lambda m: m.to("meta"))
    a, b = one.state_dict(), locked.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert report.layers == [0, 1] and len(report.phase2_history) > 0
    steps = [h["method"] for h in locked._mlpsurgery_history]
    assert steps[-2:] == ["dlr_lock", "dlr_lock"] and locked._mlpsurgery_history[-1]["provenance"]["phase2_only"]
    with pytest.raises(MLPSurgeryError, match="no DLR-Nets"):
        continue_phase2(load_model(src).model, load_model(src).model, p2, cfg, tmp_path / "x.work", progress=False)


def test_cli_phase2_only_continues_a_layerwise_lock_and_its_refusals(tmp_path, capsys):
    from mlpsurgery.cli import main
    from mlpsurgery.tiny import byte_tokenizer

    src = saved_checkpoint(tmp_path, "llama", num_hidden_layers=2)
    byte_tokenizer().save_pretrained(src)
    small = ["--calib-blocks", "8", "--block-len", "16", "--phase1-steps", "4", "--phase1-tokens", "32",
             "--onpolicy-steps", "2", "--start-tokens", "64", "--no-compile", "--quiet", "--rank", "4", "--depth", "3"]
    assert main(["lock", "dlr", str(src), *small, "--layerwise", "--phase2-steps", "0", "--dtype", "bfloat16",
                 "--out", str(tmp_path / "p1")]) == 0
    capsys.readouterr()
    # locked in bfloat16, continued in float32: the original is checked in the dtype it was locked in
    p2 = ["--phase2-steps", "4", "--phase2-blocks", "6", "--phase2-batch", "2", "--top-k", "8", "--block-len", "16",
          "--eval-tokens", "256", "--second-corpus", "", "--quiet", "--json"]
    assert main(["lock", "dlr", str(tmp_path / "p1"), "--phase2-only", "--original", str(src), *p2,
                 "--dtype", "float32", "--out", str(tmp_path / "p2")]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["phase2_only"] and res["report"]["layers"] == [0, 1] and res["report"]["phase2_history"]
    assert json.loads((tmp_path / "p2" / "surgery.json").read_text())["dtype"] == "float32"
    assert set(res["perplexity"]) == {"original", "phase1", "phase2"}
    history = json.loads((tmp_path / "p2" / "surgery.json").read_text())["history"]
    assert [h["method"] for h in history][-2:] == ["dlr_lock", "dlr_lock"]
    # refused, exit 2, nothing written: an unlocked model, --original alone, with --layerwise, another original
    assert main(["lock", "dlr", str(src), "--phase2-only", *p2, "--out", str(tmp_path / "x1")]) == 2
    assert main(["lock", "dlr", str(src), "--original", str(src), *p2, "--out", str(tmp_path / "x2")]) == 2
    assert main(["lock", "dlr", str(tmp_path / "p1"), "--phase2-only", "--layerwise", *p2,
                 "--out", str(tmp_path / "x3")]) == 2
    other = saved_checkpoint(tmp_path / "o", "llama", num_hidden_layers=2, seed=1)
    byte_tokenizer().save_pretrained(other)
    assert main(["lock", "dlr", str(tmp_path / "p1"), "--phase2-only", "--original", str(other), *p2,
                 "--out", str(tmp_path / "x4")]) == 2
    assert not any((tmp_path / x).exists() for x in ("x1", "x2", "x3", "x4", "x1.work", "x4.work"))


def test_mlps_of_different_sizes_get_one_depth_and_resume(tmp_path, monkeypatch):
    """A folder whose MLPs differ in width (layer 0 fused narrower): every net has the depth of the largest MLP's
    budget, as in a whole-model run, so a finished layer's net is read back into the shape it was saved with."""
    from mlpsurgery.methods.fusion import FusionConfig
    from mlpsurgery.methods.fusion.layerwise import fuse_layerwise

    src = saved_checkpoint(tmp_path, "llama", num_hidden_layers=3)
    fuse_layerwise(src, tmp_path / "narrow", FusionConfig(width=8, layers="0", n_init=1), progress=False)
    cfg = _cfg(depth=None)
    _lock(tmp_path / "narrow", tmp_path, cfg, "ref")
    _stopped_at_layer_2(tmp_path / "narrow", tmp_path, cfg, monkeypatch)
    _lock(tmp_path / "narrow", tmp_path, cfg)
    depths = {m.depth for m in load(tmp_path / "out").modules() if type(m).__name__ == "DLRNet"}
    assert len(depths) == 1
    a, b = file_tensors(tmp_path / "ref"), file_tensors(tmp_path / "out")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_work_folder_holding_the_users_files_is_refused_and_left_alone(tmp_path):
    src = saved_checkpoint(tmp_path, "llama", num_hidden_layers=2)
    notes = tmp_path / "mine" / "layer000" / "notes.txt"  # a finished layer's working files are removed: not these
    notes.parent.mkdir(parents=True)
    notes.write_text("mine")
    with pytest.raises(MLPSurgeryError, match="did not write"):
        lw.lock_layerwise(lw.open_stream(src, tmp_path / "mine"), tmp_path / "out", _cfg(), BLOCKS, tmp_path / "mine",
                          progress=False)
    assert notes.read_text() == "mine" and not (tmp_path / "out").exists()
    assert sorted(p.name for p in (tmp_path / "mine").iterdir()) == ["layer000"]


@pytest.mark.parametrize("layerwise", ["--layerwise", "--no-layerwise"])
def test_a_model_whose_mlp_shares_its_norm_with_attention_is_refused_before_anything_is_written(tmp_path, capsys,
                                                                                                  layerwise):
    """Phi-2 runs attention and MLP on one LayerNorm: a DLR-Net of the raw stream in place of the MLP sub-block would
    take that norm from attention too. Refused with one line, exit 2, no folder and no work folder."""
    from mlpsurgery.cli import main
    from mlpsurgery.tiny import byte_tokenizer

    src = saved_checkpoint(tmp_path, "phi")
    byte_tokenizer().save_pretrained(src)
    capsys.readouterr()  # (the save's progress bar)
    out, work = tmp_path / "locked", tmp_path / "work"
    assert main(["lock", "dlr", str(src), "--out", str(out), "--workdir", str(work), layerwise, "--block-len", "32",
                 "--calib-blocks", "4", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "share their norm with attention" in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists() and not work.exists()
