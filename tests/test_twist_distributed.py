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
