import pytest
import torch

from mlpsurgery.errors import MLPSurgeryError
from mlpsurgery.methods.pruning import magnitude_prune, prunable_weights
from mlpsurgery.tiny import tiny_model


@pytest.mark.parametrize("scope", ["layer", "global"])
@pytest.mark.parametrize("parts", ["attn", "ffn", "both"])
def test_magnitude_reaches_the_sparsity_on_the_chosen_parts(parts, scope):
    m = tiny_model("llama")
    before = {n: p.clone() for n, p in m.named_parameters()}
    r = magnitude_prune(m, 0.4, parts=parts, scope=scope)
    assert r["sparsity"] == pytest.approx(0.4, abs=0.01)
    chosen = prunable_weights(m, parts)
    for n, p in m.named_parameters():
        if n not in chosen:
            assert torch.equal(p, before[n])
        else:
            kept = p != 0
            # what survives is unchanged, and is never smaller than what was removed (per matrix)
            assert torch.equal(p[kept], before[n][kept])
            if scope == "layer" and (~kept).any():
                assert before[n][~kept].abs().max() <= before[n][kept].abs().min()


def test_zero_sparsity_is_identity_and_bad_input_fails():
    m = tiny_model("gpt2")
    before = [p.clone() for p in m.parameters()]
    magnitude_prune(m, 0.0)
    assert all(torch.equal(a, b) for a, b in zip(before, m.parameters()))
    with pytest.raises(MLPSurgeryError):
        magnitude_prune(m, 1.0)
    with pytest.raises(MLPSurgeryError):
        magnitude_prune(m, 0.5, parts="heads")
