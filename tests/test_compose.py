"""Methods compose: every ordered pair of two methods on a tiny model gives a valid model (apply, save, reload:
identical logits; the manifest's history holds both, in order; a key applied last unlocks to the model before
the lock bit for bit; export works and keeps the function), or, where the second method has nothing to act on,
a one-line refusal that says so. The pairs a user is most likely to chain must work."""

from __future__ import annotations

import itertools

import pytest
import torch
from transformers import AutoModel, AutoModelForCausalLM

import mlpsurgery as ms
from conftest import outputs
from mlpsurgery.errors import MLPSurgeryError
from mlpsurgery.io import read_manifest
from mlpsurgery.methods import nsn
from mlpsurgery.methods.corelocker import CoreLockerConfig, lock_key, unlock_key
from mlpsurgery.methods.dlr_lock import DLRConfig, dlr_lock
from mlpsurgery.methods.fusion import FusionConfig, fuse
from mlpsurgery.methods.pruning import prune
from mlpsurgery.methods.twist import twist_extract
from mlpsurgery.tiny import byte_tokenizer, tiny_model

IDS = torch.tensor([[7, 8, 9, 10, 11, 12, 13, 14], [21, 22, 23, 24, 25, 26, 27, 28]])
BLOCKS = torch.randint(0, 256, (6, 16), generator=torch.Generator().manual_seed(0))
METHODS = ("fuse", "nest", "dlr", "key", "twist", "prune")
# The second method has nothing to act on after the first: a DLR-Net replaces the whole MLP sub-block with a
# deep low-rank network, which has no neurons to cluster or chunk and no stock projections to factor.
REFUSED = {("dlr", "fuse"), ("dlr", "nest"), ("dlr", "twist")}
MUST_WORK = {("fuse", "key"), ("nest", "dlr"), ("twist", "key"), ("prune", "fuse"), ("fuse", "dlr"),
             ("prune", "key"), ("nest", "key"), ("fuse", "twist")}


def apply(name: str, model, tmp_path, keys: list):
    if name == "fuse":
        fuse(model, FusionConfig(width=16, layers="all", n_init=1), progress=False)
        return model
    if name == "nest":
        nsn.nest(model)
        nsn.set_rank(model, 12)
        return model
    if name == "dlr":
        cfg = DLRConfig(rank=4, depth=2, calib_blocks=4, block_len=16, phase1_steps=2, phase1_tokens=16,
                        phase2_steps=0, compile=False)
        dlr_lock(model, BLOCKS[:4], BLOCKS[:2], cfg, tmp_path / f"dlr-work-{len(keys)}", progress=False)
        return model
    if name == "key":
        before = {k: v.clone() for k, v in model.state_dict().items()}
        keys.append((lock_key(model, CoreLockerConfig(ratio=0.1)), before))
        return model
    if name == "twist":
        return twist_extract(model, keep=2, blocks=4, parts="both", shared_first=0, shared_last=0, seed=3)
    if name == "prune":
        return prune(model, "magnitude", 0.3, parts="both")[0]
    raise ValueError(name)


PAIRS = [("llama", a, b) for a, b in itertools.permutations(METHODS, 2)]
# the layouts whose MLP lives in separate slots (OPT: fc1/fc2 on the layer; BERT: intermediate/output; GPT-2: Conv1D)
PAIRS += [(arch, a, b) for arch in ("gpt2", "opt", "bert")
          for a, b in sorted(MUST_WORK | {("fuse", "nest"), ("nest", "fuse"), ("dlr", "nest")})]


@pytest.mark.parametrize("arch,first,second", PAIRS)
def test_two_methods_in_sequence_give_a_valid_model(tmp_path, arch, first, second):
    keys: list = []
    model = apply(first, tiny_model(arch), tmp_path, keys)
    try:
        model = apply(second, model, tmp_path, keys)
    except MLPSurgeryError as e:
        assert (first, second) in REFUSED, f"{first} then {second} refused: {e}"
        assert "\n" not in str(e)
        return
    assert (first, second) not in REFUSED, f"{first} then {second} was expected to be refused"
    ref = outputs(model, IDS)
    assert torch.isfinite(ref).all()
    folder = ms.save(model, tmp_path / "m", tokenizer=byte_tokenizer())
    again = ms.load(folder)
    assert torch.equal(outputs(again, IDS), ref), (first, second)
    methods = [h["method"] for h in read_manifest(folder)["history"]]
    assert len(methods) >= 2, methods  # both methods recorded, first before second
    if second == "key":
        key, before = keys[-1]
        unlock_key(again, key)
        after = again.state_dict()
        assert set(after) == set(before) and all(torch.equal(after[k], before[k]) for k in before)
    out = ms.export(folder, tmp_path / "exported")
    stock = AutoModel if arch == "bert" else AutoModelForCausalLM
    exported = ms.load(out) if (out / "surgery.json").exists() else stock.from_pretrained(out).eval()
    torch.testing.assert_close(outputs(exported, IDS), ref, rtol=1e-4, atol=1e-4)


def test_history_order_is_the_order_applied(tmp_path):
    keys: list = []
    model = tiny_model("llama")
    for name in ("prune", "fuse", "key"):
        model = apply(name, model, tmp_path, keys)
    folder = ms.save(model, tmp_path / "m")
    hist = [h["method"] for h in read_manifest(folder)["history"]]
    assert hist[0] == "magnitude-prune" and hist[1] == "fusion" and hist[-1].startswith("corelocker"), hist


def test_the_pairs_users_chain_are_not_in_the_refused_set():
    assert not MUST_WORK & REFUSED
