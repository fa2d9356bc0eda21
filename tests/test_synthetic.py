"""The synthetic checkpoints benchmarks use for models of real size (tiny.write_synthetic): sharded safetensors
with an index, written one shard at a time, loaded by the normal path in the checkpoint's own dtype, and a
command's round trip on them (lock key, unlock: bit for bit)."""

import json

import pytest
import torch

from mlpsurgery.errors import MLPSurgeryError
from mlpsurgery.models import load_model
from mlpsurgery.tiny import VOCAB, byte_tokenizer, synthetic_llama_config, write_synthetic


def test_synthetic_checkpoint_is_sharded_loads_and_round_trips_a_key(tmp_path):
    from mlpsurgery.cli import main
    from mlpsurgery.io import load

    tok = tmp_path / "tok"
    byte_tokenizer().save_pretrained(tok)
    folder = tmp_path / "synthetic"
    count = write_synthetic(folder, 2e6, shard_bytes=400_000, tokenizer_from=tok, vocab_size=VOCAB, d=128)
    with pytest.raises(MLPSurgeryError, match="not empty"):  # never over what is there
        write_synthetic(folder, 2e6, tokenizer_from=tok, vocab_size=VOCAB, d=128)
    cfg = synthetic_llama_config(2e6, VOCAB, 128)
    assert 1.5e6 < count < 2.5e6 and cfg.num_hidden_layers >= 2
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and all((folder / s).stat().st_size <= 400_000 + 100_000 for s in shards)
    loaded = load_model(str(folder), dtype="auto")
    model = loaded.model
    assert next(model.parameters()).dtype == torch.bfloat16  # auto: the checkpoint's own dtype
    assert sum(p.numel() for p in model.parameters()) == count  # tied: the LM head is the embedding
    ids = loaded.tokenizer("It was the best of times", return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits.float()).all()
    assert main(["lock", "key", str(folder), "--ratio", "0.05", "--out", str(tmp_path / "locked"),
                 "--key", str(tmp_path / "k.bin"), "--dtype", "auto", "--quiet"]) == 0
    assert main(["unlock", str(tmp_path / "locked"), "--key", str(tmp_path / "k.bin"), "--out",
                 str(tmp_path / "unlocked"), "--quiet"]) == 0
    again = load(tmp_path / "unlocked")
    for (name, p), q in zip(model.state_dict().items(), again.state_dict().values()):
        assert torch.equal(p, q), name
