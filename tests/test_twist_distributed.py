"""True and hybrid TwIST with real gloo processes (torchrun) give what masked TwIST gives in one process;
the DDP baseline gives what its one-process emulation gives."""

import os
import subprocess
import sys

import pytest
import torch

from mlpsurgery.io import load
from mlpsurgery.methods.twist import TwISTConfig, twist_train
from mlpsurgery.tiny import tiny_model

from gloo import ranks

ARGS = ["tiny:llama", "--workers", "2", "--blocks", "4", "--keep", "2", "--attn-keep", "1", "--steps", "3",
        "--interval", "3", "--batch-size", "2", "--lr", "1e-3", "--shared-first", "0", "--shared-last", "1",
        "--block-len", "32", "--quiet"]


def torchrun(tmp_path, mode: str) -> str:
    out = str(tmp_path / mode)
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([os.path.join(os.path.dirname(__file__), "..", "src"),
                                          os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "mlpsurgery",
           "twist", "train", *ARGS, "--data", str(tmp_path / "t.txt"), "--mode", mode, "--out", out]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


@pytest.mark.distributed
def test_true_and_hybrid_equal_masked_after_one_round(tmp_path):
    from mlpsurgery.data import load_corpus
    from mlpsurgery.tiny import byte_tokenizer

    (tmp_path / "t.txt").write_text("It was the best of times, it was the worst of times, it was the age of wisdom. "
                                    * 40)
    blocks = load_corpus(str(tmp_path / "t.txt"), byte_tokenizer()).blocks("train", 32)
    masked = tiny_model("llama")
    cfg = TwISTConfig(workers=2, blocks=4, keep=2, attn_keep=1, steps=3, interval=3, batch_size=2, lr=1e-3,
                      shared_first=0, shared_last=1)
    twist_train(masked, blocks, cfg, progress=False)
    start = tiny_model("llama")
    for mode in ("true", "hybrid"):
        other = load(torchrun(tmp_path, mode))
        moved = 0.0
        for (name, a), b, c in zip(masked.named_parameters(), other.parameters(), start.parameters()):
            assert torch.allclose(a, b, atol=2e-5, rtol=1e-4), (mode, name, (a - b).abs().max())
            moved = max(moved, (a - c).abs().max().item())
        assert moved > 1e-3  # one round of training did move the weights
        assert other._mlpsurgery_history[-1]["provenance"]["mode"] == mode


@pytest.mark.distributed
def test_ddp_equals_its_one_process_emulation(tmp_path):
    from mlpsurgery.data import load_corpus
    from mlpsurgery.tiny import byte_tokenizer

    (tmp_path / "t.txt").write_text("Call me Ishmael. Some years ago, never mind how long precisely. " * 40)
    blocks = load_corpus(str(tmp_path / "t.txt"), byte_tokenizer()).blocks("train", 32)
    one = tiny_model("llama")
    cfg = TwISTConfig(workers=2, blocks=4, keep=2, attn_keep=1, steps=3, interval=3, batch_size=2, lr=1e-3,
                      shared_first=0, shared_last=1)
    twist_train(one, blocks, cfg, mode="dp", progress=False)
    ddp = load(torchrun(tmp_path, "dp"))
    for a, b in zip(one.parameters(), ddp.parameters()):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4)


# ---- GPT-2 and OPT (attention that takes its head count from the config) -------------------------------
# Real gloo processes, forked from the test process instead of started by torchrun (gloo.ranks): each rank runs
# the same `mlpsurgery twist train` that torchrun would run, with the environment torchrun would give it, and
# starts in well under a second instead of re-importing torch and transformers (the torchrun path itself is
# tested above).

TEXT = "It was the best of times, it was the worst of times, it was the age of wisdom, the age of foolishness. " * 30


def train_args(tmp_path, arch: str, mode: str, parts: str, out: str, *extra: str) -> list[str]:
    (tmp_path / "t.txt").write_text(TEXT)
    return ["twist", "train", f"tiny:{arch}", "--workers", "2", "--blocks", "4", "--keep", "2", "--parts", parts,
            "--steps", "3", "--interval", "3", "--lr", "1e-3", "--shared-first", "0", "--shared-last", "1",
            "--block-len", "32", "--data", str(tmp_path / "t.txt"), "--mode", mode, "--out", out, "--quiet", *extra]


@pytest.mark.distributed
@pytest.mark.parametrize("arch,mode,parts", [("gpt2", "true", "both"), ("gpt2", "hybrid", "attn"),
                                             ("opt", "true", "attn"), ("opt", "hybrid", "both")])
def test_gpt2_and_opt_train_physical_subnets_and_extract_with_defaults(tmp_path, arch, mode, parts):
    from mlpsurgery.cli import main
    from mlpsurgery.data import load_corpus
    from mlpsurgery.io import replaced_modules
    from mlpsurgery.methods.twist import twist_extract
    from mlpsurgery.tiny import byte_tokenizer

    out = str(tmp_path / "tw")
    results = ranks(tmp_path, train_args(tmp_path, arch, mode, parts, out))
    assert [code for code, _ in results] == [0, 0], results[0][1][-3000:] + results[1][1][-3000:]
    trained = load(out)
    assert trained._mlpsurgery_history[-1]["provenance"]["mode"] == mode
    assert not (tmp_path / "tw.checkpoint").exists()  # removed after success
    # the worker held a physically narrower attention (2 of 4 heads): the same function as masked TwIST
    masked = tiny_model(arch)
    cfg = TwISTConfig(workers=2, blocks=4, keep=2, parts=parts, steps=3, interval=3, batch_size=2, lr=1e-3,
                      shared_first=0, shared_last=1)
    twist_train(masked, load_corpus(str(tmp_path / "t.txt"), byte_tokenizer()).blocks("train", 32), cfg,
                progress=False)
    for (name, a), b in zip(masked.named_parameters(), trained.parameters()):
        assert torch.allclose(a, b, atol=2e-5, rtol=1e-4), (name, (a - b).abs().max())
    # `twist extract` with its defaults (the trained settings): fewer heads in layer 0, saved and reloaded
    assert main(["twist", "extract", out, "--keep", "2", "--out", str(tmp_path / "sub"), "--quiet"]) == 0
    sub = load(tmp_path / "sub")
    assert [e["path"].split(".")[-1] for e in replaced_modules(sub)][0] in ("attn", "self_attn", "fc1", "c_fc")
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        again = twist_extract(trained, keep=2).eval()
        assert torch.equal(sub(ids).logits, again(ids).logits)


@pytest.mark.distributed
def test_refusals_reach_every_rank_before_work_and_write_nothing(tmp_path):
    from mlpsurgery.cli import main

    out = tmp_path / "tw"
    # an impossible layout is named without torchrun (before the user starts any process) ...
    bad = train_args(tmp_path, "gpt2", "true", "both", str(out), "--keep", "1")
    assert main(bad) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.txt"]
    # ... and under it every rank ends with the same one-line error, none on a closed connection
    for code, log in ranks(tmp_path, bad):
        assert code == 2 and log.strip().splitlines()[-1].startswith("mlpsurgery: error: attention KV groups "
                                                                     "(layer 0): S=2 subnets of N_sub=1")
    # a checkpoint folder the user filled is refused on every rank and kept as it was
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("the user's")
    for mode in ("true", "dp"):
        for code, log in ranks(tmp_path, train_args(tmp_path, "opt", mode, "both", str(out), "--checkpoint",
                                                    str(mine))):
            assert code == 2 and "mlpsurgery did not write" in log.strip().splitlines()[-1]
    assert not out.exists() and sorted(p.name for p in mine.iterdir()) == ["notes.txt"]
