"""How close a compressed model stays to its original: the Adam NTK and the MLP output error.

**Adam NTK** (Malladi et al. 2022, the "asymmetric SignGD kernel" MLP Fusion preserves): for n samples
x_1..x_n and a scalar output f,

    K[a, b] = < ∇θ f(x_a), sign(∇θ f(x_b)) >

with θ the parameters of the MLPs at the chosen layers (the compressed sites: whatever module computes
each MLP, its trainable parameters; fixed buffers such as FusedMLP's P are not parameters). K is not
symmetric (K[a, b] ≠ K[b, a] in general); K[a, a] = ||∇θ f(x_a)||₁. Kernels of two models are compared
entry by entry, ||K_candidate − K_reference||_F, and relative to ||K_reference||_F: θ may differ in size
between the two models, K is always n × n.

Two scopes:
- whole model (`adam_ntk`, `ntk_error`): f is a scalar output of the whole model (below), θ the MLPs of the
  chosen layers; the kernel then also sees how the compression changed everything downstream;
- one MLP at a time (`mlp_ntk_error`, the paper's Table 1 setting, "the NTK of the first-layer MLP"):
  f(x) = uᵀ mean_t MLP(x)_t of the layer's MLP sub-block, on the original model's inputs at that layer,
  θ = that MLP's parameters. Since f is linear in the MLP output, ∇_H f is the same for both models and the
  kernel isolates what the compression did to that MLP.

**f**, the scalar output (the same definition, and the same random vector, for both models):
- ``projection`` (default, any model): f(x) = uᵀ mean_t h(x)_t, the final hidden state of the base model
  (after its final norm; CLS pooler and LM head excluded) mean-pooled over the attended tokens and
  projected on a fixed random unit vector u (seeded);
- ``logit`` (sequence classifiers): the logit of the sample's true class.

**Output error**: for each chosen layer, the MLP sub-block of both models applied to the *reference*
model's own inputs at that layer (captured), ||H~ − H||_F over all tokens and relative to ||H||_F, so a
layer's error is its own, not what earlier layers passed on; and, end to end, the relative error of the
final hidden state.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from ..capture import capture_mlp_io
from ..errors import MLPSurgeryError
from ..sites import find_sites

OUTPUTS = ("projection", "logit")


def _rows(inputs, idx) -> dict[str, Tensor]:
    """Samples `idx` of token ids (n, T) or of a tokenizer encoding (dict of (n, T) tensors)."""
    if isinstance(inputs, Tensor):
        return {"input_ids": inputs[idx]}
    return {k: v[idx] for k, v in inputs.items() if k in ("input_ids", "attention_mask", "token_type_ids")}


def _n(inputs) -> int:
    return len(inputs if isinstance(inputs, Tensor) else inputs["input_ids"])


def projection_vector(d: int, seed: int = 0) -> Tensor:
    """The fixed random unit vector u (d,) of f = 'projection'."""
    u = torch.randn(d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return (u / u.norm()).float()


def scalar_output(model: nn.Module, enc: dict[str, Tensor], f: str = "projection", labels: Tensor | None = None,
                  seed: int = 0) -> Tensor:
    """f for each sample of a batch encoding: (B,). See the module docstring for the definitions."""
    if f == "logit":
        if labels is None:
            raise MLPSurgeryError("f='logit' needs the samples' labels")
        logits = getattr(model(**enc), "logits", None)
        if logits is None or logits.dim() != 2:
            raise MLPSurgeryError(f"f='logit' needs a sequence classifier; {type(model).__name__} gives no (B, C) "
                                  "logits. Use f='projection'")
        return logits.float().gather(1, labels.view(-1, 1).to(logits.device))[:, 0]
    if f != "projection":
        raise MLPSurgeryError(f"unknown scalar output {f!r}; choose one of {', '.join(OUTPUTS)}")
    base = getattr(model, "base_model", model)
    h = base(**enc).last_hidden_state.float()  # (B, T, d)
    mask = enc.get("attention_mask")
    m = torch.ones(h.shape[:2], device=h.device) if mask is None else mask.float()
    pooled = (h * m.unsqueeze(-1)).sum(1) / m.sum(1, keepdim=True).clamp_min(1)
    return pooled @ projection_vector(h.shape[-1], seed).to(h.device)


def sites_parameters(model: nn.Module, layers: list[int]) -> list[nn.Parameter]:
    """The trainable parameters of the MLPs at `layers` (θ of the kernel)."""
    sites = find_sites(model)
    bad = [i for i in layers if not 0 <= i < len(sites)]
    if bad:
        raise MLPSurgeryError(f"layers {bad} do not exist; the model has layers 0-{len(sites) - 1}")
    out, seen = [], set()
    for i in layers:
        for p in sites.mlp[i].parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    if not out:
        raise MLPSurgeryError(f"the MLPs at layers {layers} have no trainable parameters")
    return out


def sign_kernel(output: Callable[[int], Tensor], params: list[nn.Parameter], n: int, desc: str = "NTK",
                progress: bool = True) -> Tensor:
    """K (n, n), K[a, b] = <∇θ output(a), sign(∇θ output(b))> (float64), for a scalar `output(a)` of sample a.

    Two passes of n per-sample backward passes: the first keeps sign(∇θ output(b)) as int8 (n bytes per
    parameter), the second fills K row by row, so memory stays n x |θ| bytes. Tensor hooks on the
    parameters (e.g. `keep_pruned_zero` masks) apply to the gradients.
    """
    device = params[0].device

    def grads(a: int) -> list[Tensor]:
        g = torch.autograd.grad(output(a), params, allow_unused=True)
        return [torch.zeros_like(p) if gi is None else gi for p, gi in zip(params, g)]

    signs = [torch.empty(n, p.numel(), dtype=torch.int8, device=device) for p in params]
    for b in tqdm(range(n), desc=f"{desc} signs", disable=not progress, leave=False):
        for s, g in zip(signs, grads(b)):
            s[b] = g.sign().flatten().to(torch.int8)
    K = torch.zeros(n, n, dtype=torch.float64)
    for a in tqdm(range(n), desc=f"{desc} rows", disable=not progress, leave=False):
        row = torch.zeros(n, dtype=torch.float64, device=device)
        for s, g in zip(signs, grads(a)):
            row += (s.to(torch.float32) @ g.flatten().float()).double()
        K[a] = row.cpu()
    return K


def ntk_bytes(reference: nn.Module, candidate: nn.Module, n: int, layers: list[int], scope: str = "model") -> dict:
    """A floor of the memory the kernels of n samples take, known before any is computed: {"kernels": host bytes of
    the two n x n float64 kernels compared, "signs": device bytes of the int8 gradient signs `sign_kernel` keeps,
    n per parameter of θ (the MLPs of `layers` together for the whole-model kernel, one MLP for scope "mlp")}."""
    theta = 0
    for model in (reference, candidate):
        if scope in ("model", "both"):
            theta = max(theta, sum(p.numel() for p in sites_parameters(model, layers)))
        else:
            theta = max(theta, *(sum(p.numel() for p in sites_parameters(model, [i])) for i in layers))
    return {"kernels": 2 * n * n * 8, "signs": n * theta}


def adam_ntk(model: nn.Module, inputs, layers: list[int], f: str = "projection", labels: Tensor | None = None,
             seed: int = 0, progress: bool = True) -> Tensor:
    """K (n, n) of the whole model's scalar output f over the MLP parameters at `layers` (see module doc).
    inputs: token ids (n, T) or an encoding dict."""
    params = sites_parameters(model, layers)
    device = params[0].device

    def output(a: int) -> Tensor:
        enc = {k: v.to(device) for k, v in _rows(inputs, slice(a, a + 1)).items()}
        return scalar_output(model, enc, f, None if labels is None else labels[a:a + 1], seed).sum()

    was = model.training
    model.eval()  # no dropout: the kernel of the function itself
    try:
        return sign_kernel(output, params, _n(inputs), progress=progress)
    finally:
        model.train(was)


def mlp_ntk_error(reference: nn.Module, candidate: nn.Module, ids: Tensor, layers: list[int] | None = None,
                  seed: int = 0, progress: bool = True, reference_cache: dict | None = None) -> dict:
    """The kernel of each MLP on its own (the paper's Table 1 setting): per layer, f(x) = uᵀ mean_t MLP(x)_t
    of the layer's MLP sub-block on the reference model's inputs at that layer (sample a = block a of ids),
    θ = that MLP's parameters. Returns per-layer ||K~ − K||_F, relative errors, and their mean.
    reference_cache: a dict kept between calls with the same reference, ids and seed (layer -> kernel)."""
    layers = compressed_layers(reference, candidate) if layers is None else list(layers)
    cap = capture_mlp_io(reference, ids, layers=layers, batch_size=1, progress=False)
    rows = []
    was = [m.training for m in (reference, candidate)]
    reference.eval()
    candidate.eval()
    try:
        for i in layers:
            kernels = []
            for model in (reference, candidate):
                if model is reference and reference_cache is not None and i in reference_cache:
                    kernels.append(reference_cache[i])
                    continue
                site = find_sites(model).mlp[i]
                params = [p for p in site.parameters() if p.requires_grad]
                device = params[0].device
                u = projection_vector(site.d, seed).to(device)

                def output(a: int, site=site, u=u, device=device) -> Tensor:
                    x = cap.chunk(a, [i])[i][0].to(device)  # (T, d): sample a's residual stream at layer i
                    return (site.subblock(x).float().mean(0) * u).sum()

                kernels.append(sign_kernel(output, params, cap.n_chunks, desc=f"layer {i} NTK", progress=progress))
                if model is reference and reference_cache is not None:
                    reference_cache[i] = kernels[-1]
            diff, ref_norm = float((kernels[1] - kernels[0]).norm()), float(kernels[0].norm())
            rows.append({"layer": i, "ntk_error": diff, "ntk_error_rel": diff / max(ref_norm, 1e-30),
                         "reference_norm": ref_norm})
    finally:
        reference.train(was[0])
        candidate.train(was[1])
    return {"layers": rows, "n": cap.n_chunks, "seed": seed,
            "ntk_error": sum(r["ntk_error"] for r in rows) / len(rows),
            "ntk_error_rel": sum(r["ntk_error_rel"] for r in rows) / len(rows)}


def _differs(a: nn.Module, b: nn.Module) -> bool:
    pa, pb = list(a.parameters()), list(b.parameters())
    if [type(m) for m in a.modules()] != [type(m) for m in b.modules()]:
        return True
    if [p.shape for p in pa] != [p.shape for p in pb]:
        return True
    return any(not torch.equal(x.detach().cpu(), y.detach().cpu()) for x, y in zip(pa, pb))


def compressed_layers(reference: nn.Module, candidate: nn.Module) -> list[int]:
    """Layers whose MLP differs between the two models (module, shapes or values); all layers if none does."""
    ra, rb = find_sites(reference), find_sites(candidate)
    if len(ra) != len(rb):
        raise MLPSurgeryError(f"the models have {len(ra)} and {len(rb)} layers; compare a model with its own "
                              "compression")
    out = [i for i in range(len(ra))
           if any(_differs(x, y) for x, y in zip(ra.mlp[i].modules(), rb.mlp[i].modules()))
           or len(ra.mlp[i].modules()) != len(rb.mlp[i].modules())]
    return out or list(range(len(ra)))


def ntk_error(reference: nn.Module, candidate: nn.Module, inputs, layers: list[int] | None = None,
              f: str = "projection", labels: Tensor | None = None, seed: int = 0, progress: bool = True) -> dict:
    """||K_candidate − K_reference||_F (absolute and relative to ||K_reference||_F) of the Adam NTK over the
    MLPs at `layers` (default: the layers where the two models differ)."""
    layers = compressed_layers(reference, candidate) if layers is None else list(layers)
    k_ref = adam_ntk(reference, inputs, layers, f, labels, seed, progress)
    k_cand = adam_ntk(candidate, inputs, layers, f, labels, seed, progress)
    diff = float((k_cand - k_ref).norm())
    ref_norm = float(k_ref.norm())
    return {"ntk_error": diff, "ntk_error_rel": diff / max(ref_norm, 1e-30), "reference_norm": ref_norm,
            "layers": layers, "n": _n(inputs), "f": f, "seed": seed,
            "params_reference": sum(p.numel() for p in sites_parameters(reference, layers)),
            "params_candidate": sum(p.numel() for p in sites_parameters(candidate, layers)),
            "K_reference": k_ref, "K_candidate": k_cand}


def output_error(reference: nn.Module, candidate: nn.Module, ids: Tensor, layers: list[int] | None = None,
                 batch_size: int = 8) -> dict:
    """Per chosen layer, ||H~ − H||_F and ||H~ − H||_F / ||H||_F of the MLP sub-block output on the reference
    model's inputs at that layer (ids: (n, T) token blocks); and the relative error of the final hidden state."""
    layers = compressed_layers(reference, candidate) if layers is None else list(layers)
    cap = capture_mlp_io(reference, ids, layers=layers, batch_size=batch_size, progress=False)
    cand_sites = find_sites(candidate)
    device = next(candidate.parameters()).device
    rows = []
    was = candidate.training
    candidate.eval()
    try:
        with torch.no_grad():
            for i in layers:
                num = den = 0.0
                for k in range(cap.n_chunks):
                    x, y = cap.chunk(k, [i])[i]
                    x, y = x.to(device), y.to(device)
                    h = (y - x).float()
                    num += float((cand_sites.mlp[i].subblock(x).float() - h).pow(2).sum())
                    den += float(h.pow(2).sum())
                rows.append({"layer": i, "error": num ** 0.5, "error_rel": (num / max(den, 1e-30)) ** 0.5,
                             "error_per_token": (num / cap.n_tokens) ** 0.5})
            num = den = 0.0
            ref_device = next(reference.parameters()).device
            for s in range(0, len(ids), batch_size):
                batch = ids[s:s + batch_size]
                ha = getattr(reference, "base_model", reference)(input_ids=batch.to(ref_device)).last_hidden_state
                hb = getattr(candidate, "base_model", candidate)(input_ids=batch.to(device)).last_hidden_state
                num += float((hb.float().cpu() - ha.float().cpu()).pow(2).sum())
                den += float(ha.float().pow(2).sum())
    finally:
        candidate.train(was)
    n = len(rows)
    return {"layers": rows, "tokens": cap.n_tokens,
            "error": sum(r["error"] for r in rows) / n, "error_rel": sum(r["error_rel"] for r in rows) / n,
            "final_hidden_error_rel": (num / max(den, 1e-30)) ** 0.5}
