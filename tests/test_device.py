"""Every method on an accelerator against its CPU result (issue 16): `pytest tests/test_device.py --device cuda`.
Without --device these tests skip (CI has no GPU); `--device cpu` runs them here, CPU against CPU, so that the
tests themselves are known to run. Tolerances: float32 within 1e-4 relative (TF32, which an fp32 matmul must not
silently use, is off by about 1e-3 on these shapes), bfloat16 within a few bf16 ulps of the output's norm."""

import copy

import pytest
import torch

from mlpsurgery.tiny import tiny_model

ARCHS = ["llama", "gpt2", "bert", "qwen2", "gemma2", "phi3", "gpt_neox"]


def _rel(a, b) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _out(model, ids):
    with torch.no_grad():
        out = model(input_ids=ids.to(next(model.parameters()).device))
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def _pair(arch, device, dtype=torch.float32, **kw):
    """The same tiny model on the CPU and on the device, in eval mode."""
    a = tiny_model(arch, **kw).to(dtype).eval()
    b = tiny_model(arch, **kw).to(dtype).to(device).eval()
    return a, b


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("arch", ARCHS)
def test_forward_on_the_device_is_the_cpu_forward(device, ids, arch, dtype, tol):
    a, b = _pair(arch, device, dtype)
    assert _rel(_out(b, ids), _out(a, ids)) < tol


@pytest.mark.parametrize("T", [16, 300])
def test_dlr_net_in_float32_does_not_run_in_tf32(device, T):
    """The module (under no_grad: the fused kernel's automatic schedule), every schedule of the kernel by name
    where it runs, and the autograd path, in float32 against float64: within 1e-5, which TF32 would miss; in
    bfloat16 every schedule within twice PyTorch's own bfloat16 error on the device."""
    from mlpsurgery.kernels import dlr_triton as k
    from mlpsurgery.modules.dlr import DLRNet

    torch.manual_seed(0)
    net = DLRNet(256, 64, 8)
    with torch.no_grad():
        net.alpha.normal_()  # a trained-looking net, not the identity
        net.norm.uniform_(0.5, 1.5)
    x = torch.randn(T, 256)
    with torch.no_grad():
        ref = net.double()._delta(x.double())
        xd = x.to(device)
        got = net.float().to(device)(xd)  # under no_grad: the fused kernel where there is one
        paths = {}
        if k.HAVE_TRITON and k.available(xd):
            torch_bf16 = _rel(copy.deepcopy(net).to(torch.bfloat16)._delta(xd.to(torch.bfloat16)), ref)
            for dtype in (torch.float32, torch.bfloat16):
                Dp, Up = k.fold(net.D, net.U, net.norm, net.alpha, dtype)
                for p in k.PATHS:
                    poison = torch.full((T, 256), float("nan"), dtype=dtype, device=device)
                    paths[p, str(dtype)] = _rel(k.dlr_forward(xd.to(dtype), Dp, Up, net.eps, out=poison, path=p), ref)
    with torch.enable_grad():
        train = net(xd)  # the autograd path
    assert _rel(got, ref) < 1e-5 and _rel(train, ref) < 1e-5
    # Triton's CPU interpreter casts float32 to bfloat16 by truncation (twice the error of round-to-nearest-even,
    # which the GPU does), so its bf16 bound is looser
    bf16_bound = (3 if k.interpreting() else 2) * torch_bf16 + 1e-3 if paths else None
    for (p, dtype), err in paths.items():
        assert err < (1e-5 if dtype == "torch.float32" else bf16_bound), (p, dtype, err, torch_bf16)


def test_nested_model_at_a_rank_matches(device, ids):
    from mlpsurgery.methods.nsn import NSNConfig, nest, set_rank

    a, b = _pair("llama", device)
    for m in (a, b):
        nest(m, NSNConfig())
        set_rank(m, 4)
    assert _rel(_out(b, ids), _out(a, ids)) < 1e-4


@pytest.mark.parametrize("method", ["neuron", "svd", "fusion"])
def test_fused_model_matches(device, ids, method):
    from mlpsurgery.methods.fusion import FusionConfig, fuse

    a, b = _pair("llama", device)
    reps = [fuse(m, FusionConfig(width=16, layers="all", method=method, device=None), progress=False) for m in (a, b)]
    if method == "fusion":  # k-means may split a tie otherwise on another device: the quality is what must match
        for ra, rb in zip(reps[0]["sites"], reps[1]["sites"]):
            assert rb["error_rel"] == pytest.approx(ra["error_rel"], rel=0.05)
    else:
        assert _rel(_out(b, ids), _out(a, ids)) < 1e-4


@pytest.mark.parametrize("method", ["wanda", "sparsegpt"])
def test_calibrated_pruning_matches(device, ids, method):
    from mlpsurgery.methods.pruning import prune

    a, b = _pair("llama", device)
    data = torch.randint(3, 200, (8, 32), generator=torch.Generator().manual_seed(0))
    for m in (a, b):
        prune(m, method, 0.5, data=data.to(next(m.parameters()).device), progress=False)
    agree = [float(((p != 0) == (q.cpu() != 0)).float().mean()) for p, q in zip(a.parameters(), b.parameters())]
    assert min(agree) > 0.99
    assert _rel(_out(b, ids), _out(a, ids)) < 1e-2


def test_corelocker_key_on_the_device_restores_bit_for_bit(device):
    from mlpsurgery.methods.corelocker import CoreLockerConfig, lock_key, unlock_key

    a, b = _pair("llama", device)
    before = {n: p.detach().clone() for n, p in b.named_parameters()}
    ka, kb = lock_key(a, CoreLockerConfig(ratio=0.05)), lock_key(b, CoreLockerConfig(ratio=0.05))
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(q.cpu(), p), n  # the same weights zeroed on both
    for name, pos in ka.positions.items():  # the same positions chosen, the same values kept
        assert torch.equal(kb.positions[name].cpu(), pos) and torch.equal(kb.values[name].cpu(), ka.values[name]), name
    unlock_key(b, kb)
    for n, p in b.named_parameters():
        assert torch.equal(p, before[n]), n


def test_fine_tuning_steps_match(device):
    from mlpsurgery.train import FitConfig, fit, lm_loss, trainable

    blocks = torch.randint(3, 200, (8, 24), generator=torch.Generator().manual_seed(1))
    losses = []
    for dev in ("cpu", device):
        torch.manual_seed(0)
        m = tiny_model("llama").to(dev).train()
        res = fit(trainable(m), lm_loss(m, blocks, 4), FitConfig(steps=5, lr=3e-3), progress=False)
        losses.append([h["loss"] for h in res.history])
    assert losses[1] == pytest.approx(losses[0], rel=1e-4)


def test_dlr_lock_on_the_device_matches(device, tmp_path):
    from mlpsurgery.methods.dlr_lock import DLRConfig, dlr_lock

    calib = torch.randint(0, 256, (16, 32), generator=torch.Generator().manual_seed(0))
    held = torch.randint(0, 256, (8, 32), generator=torch.Generator().manual_seed(1))
    cfg = dict(rank=8, calib_blocks=16, block_len=32, phase1_steps=20, phase1_lr=1e-2, phase1_tokens=128,
               phase2_steps=2, phase2_batch=2, phase2_blocks=4, top_k=8, gradient_checkpointing=False, compile=False)
    reps = []
    for name, m in zip(("cpu", "dev"), _pair("llama", device)):
        reps.append(dlr_lock(m, calib, held, DLRConfig(**cfg), tmp_path / name, progress=False))
    a, b = (r if isinstance(r, dict) else r.as_dict() for r in reps)
    for layer, err in a["phase1_relative_error"].items():
        assert b["phase1_relative_error"][layer] == pytest.approx(err, rel=0.02), layer


# ---- the layer-sequential mode with each layer on the device (layerwise.LayerStream(device=...)) --------------


def _on(t, device) -> bool:
    return t.device.type == torch.device(device).type


def test_layer_stream_works_each_layer_on_the_device_and_hands_out_host_tensors(device, tmp_path):
    """The resident parts and the layer being worked on are on the device, the activations between layers and
    every tensor handed out (for files and fingerprints) in host memory, equal to the CPU stream's; perplexity
    through the stream matches."""
    from conftest import saved_checkpoint
    from mlpsurgery.layerwise import LayerStream
    from mlpsurgery.measure.perplexity import perplexity_layerwise

    src = saved_checkpoint(tmp_path, "llama")
    cpu, dev = LayerStream(src), LayerStream(src, device=device)
    assert all(_on(p, device) for p in dev.model.parameters() if not p.is_meta)
    assert all(t.device.type == "cpu" for t in dev.resident_state().values())
    assert {n: torch.equal(t, cpu.resident_state()[n]) for n, t in dev.resident_state().items()} == \
        {n: True for n in cpu.resident_state()}
    data = torch.randint(3, 200, (6, 24), generator=torch.Generator().manual_seed(0))
    a, b = cpu.layer_inputs(data, batch_size=4), dev.layer_inputs(data, batch_size=4)
    for i in range(cpu.n_layers):
        cpu.materialise(i)
        layer = dev.materialise(i)
        assert all(_on(p, device) for p in layer.parameters())
        state, ref = dev.layer_state(i), cpu.layer_state(i)
        assert all(t.device.type == "cpu" and torch.equal(t, ref[n]) for n, t in state.items())
        a, b = cpu.run(i, a), dev.run(i, b)
        assert all(y.device.type == "cpu" for y in b.hidden)
        assert max(_rel(y, x) for x, y in zip(a.hidden, b.hidden)) < 1e-4, i
        cpu.release(i)
        dev.release(i)
        assert all(p.is_meta for p in dev.layers[i].parameters())
    seqs = [torch.randint(3, 200, (90,), generator=torch.Generator().manual_seed(s)) for s in range(3)]
    pa = perplexity_layerwise(LayerStream(src), seqs, block_len=32, progress=False)
    pb = perplexity_layerwise(LayerStream(src, device=device), seqs, block_len=32, progress=False)
    assert pb.tokens == pa.tokens and pb.ppl == pytest.approx(pa.ppl, rel=1e-4)


@pytest.mark.parametrize("method", ["magnitude", "wanda", "sparsegpt"])
def test_pruning_layer_by_layer_on_the_device_matches_the_cpu(device, ids, tmp_path, method):
    """The same folder as the CPU run's up to the device's arithmetic: the source fingerprint exactly (taken of
    the tensors as read), the masks within 1% (calibrated: near-ties), the pruned model's outputs within 1e-2."""
    import json

    from conftest import file_tensors, saved_checkpoint
    from mlpsurgery.io import load
    from mlpsurgery.methods.pruning.layerwise import prune_layerwise

    src = saved_checkpoint(tmp_path, "llama")
    data = torch.randint(3, 200, (8, 32), generator=torch.Generator().manual_seed(0))
    reps = [prune_layerwise(src, tmp_path / name, method, 0.5, data=data if method != "magnitude" else None,
                            progress=False, device=d) for name, d in (("cpu", "cpu"), ("dev", device))]
    assert reps[1]["device"].startswith(torch.device(device).type)
    man = [json.loads((tmp_path / name / "surgery.json").read_text()) for name in ("cpu", "dev")]
    assert man[1]["source"] == man[0]["source"] and man[1]["history"] == man[0]["history"]
    fa, fb = file_tensors(tmp_path / "cpu"), file_tensors(tmp_path / "dev")
    assert fa.keys() == fb.keys()
    agree = [float(((fa[k] != 0) == (fb[k] != 0)).float().mean()) for k in fa]
    assert min(agree) > (0.999999 if method == "magnitude" else 0.99)
    assert _rel(_out(load(tmp_path / "dev"), ids), _out(load(tmp_path / "cpu"), ids)) < 1e-2


def test_fusion_and_nesting_layer_by_layer_on_the_device_match_the_cpu(device, ids, tmp_path):
    """fuse --layerwise with tune data (capture, k-means, tuning of each layer on the device) and nest --layerwise
    (each layer's SVDs on the device): the same source, per-layer errors within 5% (k-means may split a tie
    otherwise), the nested model's outputs within 1e-4 (the SVD's signs may differ, not its product)."""
    import json

    from conftest import saved_checkpoint
    from mlpsurgery.io import load
    from mlpsurgery.methods.fusion import FusionConfig
    from mlpsurgery.methods.fusion.layerwise import fuse_layerwise
    from mlpsurgery.methods.nsn import NSNConfig
    from mlpsurgery.methods.nsn.layerwise import nest_layerwise

    src = saved_checkpoint(tmp_path, "llama")
    blocks = torch.randint(3, 200, (8, 32), generator=torch.Generator().manual_seed(0))
    cfg = FusionConfig(width=16, layers="all", tune_steps=4, tune_batch=64)
    fused = [fuse_layerwise(src, tmp_path / f"fuse-{n}", cfg, tune_data=blocks, workdir=tmp_path / f"fuse-{n}.work",
                            progress=False, device=d) for n, d in (("cpu", "cpu"), ("dev", device))]
    assert fused[1]["device"].startswith(torch.device(device).type)
    for ra, rb in zip(fused[0]["sites"], fused[1]["sites"]):
        assert rb["error_rel"] == pytest.approx(ra["error_rel"], rel=0.05)
        assert rb["error_rel_tuned"] == pytest.approx(ra["error_rel_tuned"], rel=0.05)
    nested = [nest_layerwise(src, tmp_path / f"nest-{n}", NSNConfig(), progress=False, device=d)
              for n, d in (("cpu", "cpu"), ("dev", device))]
    assert nested[1]["device"].startswith(torch.device(device).type)
    for kind in ("fuse", "nest"):
        man = [json.loads((tmp_path / f"{kind}-{n}" / "surgery.json").read_text()) for n in ("cpu", "dev")]
        assert man[1]["source"] == man[0]["source"], kind
    assert _rel(_out(load(tmp_path / "nest-dev"), ids), _out(load(tmp_path / "nest-cpu"), ids)) < 1e-4
    # the sequential start with the down refit at every rank (a calibration stream through the nested layers), each
    # layer's least squares on the device: the same model to float32 noise
    for n, d in (("cpu", "cpu"), ("dev", device)):
        nest_layerwise(src, tmp_path / f"refit-{n}", NSNConfig(), progress=False, device=d, calib_data=blocks,
                       refit=True)
    assert _rel(_out(load(tmp_path / "refit-dev"), ids), _out(load(tmp_path / "refit-cpu"), ids)) < 1e-3
    assert _rel(_out(load(tmp_path / "refit-cpu"), ids), _out(load(tmp_path / "nest-cpu"), ids)) > 1e-3


def test_dlr_lock_layer_by_layer_on_the_device_matches_the_cpu(device, tmp_path):
    """`lock dlr --layerwise` with each layer captured and its net trained on the device (on-policy steps
    included): the per-layer phase-1 errors within 2% of the CPU run's, the same source."""
    import json

    from conftest import saved_checkpoint
    from mlpsurgery.methods.dlr_lock import DLRConfig
    from mlpsurgery.methods.dlr_lock.layerwise import lock_layerwise, open_stream

    src = saved_checkpoint(tmp_path, "llama")
    calib = torch.randint(0, 256, (16, 32), generator=torch.Generator().manual_seed(0))
    cfg = DLRConfig(rank=8, calib_blocks=16, block_len=32, phase1_steps=20, phase1_lr=1e-2, phase1_tokens=128,
                    phase2_steps=0, compile=False)
    reps = []
    for name, d in (("cpu", "cpu"), ("dev", device)):
        stream = open_stream(src, tmp_path / f"{name}.work", device=d)
        reps.append(lock_layerwise(stream, tmp_path / name, cfg, calib, tmp_path / f"{name}.work", progress=False))
    assert reps[1]["device"].startswith(torch.device(device).type)
    a, b = (r["report"] for r in reps)
    for layer, err in a["phase1_relative_error"].items():
        assert b["phase1_relative_error"][layer] == pytest.approx(err, rel=0.02), layer
    man = [json.loads((tmp_path / name / "surgery.json").read_text()) for name in ("cpu", "dev")]
    assert man[1]["source"] == man[0]["source"]


def test_a_model_fingerprints_alike_on_the_device_and_on_the_cpu(device):
    """files.model_fingerprint sums on the CPU wherever the tensors live: the same digest on either device, so a
    resume or a source check does not depend on where the model was."""
    from mlpsurgery.files import model_fingerprint

    for dtype in (torch.float32, torch.bfloat16):
        a, b = _pair("llama", device, dtype)
        assert model_fingerprint(b) == model_fingerprint(a), dtype
