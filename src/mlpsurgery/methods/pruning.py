"""Pruning baselines on the MLP and attention weights of any supported model, reachable by every method
that compares against pruning at equal sparsity.

Unstructured (weights zeroed in place, and masked so that later training keeps them at zero:
modules/masks.py; sparsity counts only the chosen parameter types: the weight matrices of the MLPs `ffn`,
of the attention projections `attn`, or both):
- `magnitude` zeroes the smallest |w| of each weight matrix (layer-wise, the usual LLM-pruning baseline)
  or across all chosen matrices at once (global);
- `wanda` (Sun et al. 2023) scores |w| x the input's norm, per output row;
- `sparsegpt` (Frantar & Alistarh 2023) prunes and reconstructs each matrix from its inputs' Hessian.
Structured (whole blocks removed, a physically smaller model; the blocks of TwIST: KV groups and MLP chunks):
- `fisher` block pruning (TwIST paper §5, after Michel et al. 2019) keeps the blocks of highest Fisher;
- `random`: a random subnet (`twist_extract`), the TwIST deployment applied to any model.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from ..errors import MLPSurgeryError
from ..io import record
from ..modules.masks import install_mask
from ..report import ends_stages, stage
from ..sites import find_sites, linear_weight

PARTS = ("attn", "ffn", "both")


def prunable_weights(model: nn.Module, parts: str = "both", layers: list[int] | None = None) -> dict[str, nn.Parameter]:
    """name -> weight matrix for the chosen parameter types (biases and norms are never pruned)."""
    if parts not in PARTS:
        raise MLPSurgeryError(f"parts must be one of {', '.join(PARTS)}, not {parts!r}")
    sites = find_sites(model)
    layers = list(range(len(sites))) if layers is None else layers
    names = {id(p): n for n, p in model.named_parameters()}
    out: dict[str, nn.Parameter] = {}
    for i in layers:
        params = []
        if parts in ("ffn", "both"):
            params += list(sites.mlp[i].parameters())
        if parts in ("attn", "both"):
            params += list(sites.attn[i].parameters())
        for p in params:
            if p.dim() == 2:
                out[names[id(p)]] = p
    return out


def input_major(model: nn.Module, weights: dict[str, nn.Parameter]) -> dict[str, Tensor]:
    """The same weights as (out, in) views (GPT-2's Conv1D stores (in, out)): N:M groups run along the inputs."""
    from transformers.pytorch_utils import Conv1D

    conv = {f"{n}.weight" for n, mod in model.named_modules() if isinstance(mod, Conv1D)}
    return {n: (w.T if n in conv else w) for n, w in weights.items()}


@ends_stages
def magnitude_prune(model: nn.Module, sparsity: float, parts: str = "both", layers: list[int] | None = None,
                    scope: str = "layer", progress: bool = False, pattern: tuple[int, int] | None = None) -> dict:
    """Zero the `sparsity` fraction of smallest-magnitude weights (per matrix, or global). In place.
    pattern: N:M instead (the N largest of every M consecutive inputs of a row kept; sparsity 1 - N/M).
    progress: a bar over the matrices (a full sort each: tens of seconds for all of SmolLM2's)."""
    if pattern is not None:
        sparsity = pattern_sparsity(pattern)
        if scope != "layer":
            raise MLPSurgeryError("an N:M pattern is chosen per group of inputs: use scope 'layer'")
    if not 0.0 <= sparsity < 1.0:
        raise MLPSurgeryError(f"sparsity must be in [0, 1), not {sparsity}")
    if scope not in ("layer", "global"):
        raise MLPSurgeryError(f"scope must be 'layer' or 'global', not {scope!r}")
    weights = prunable_weights(model, parts, layers)
    if pattern is not None:
        for w in input_major(model, weights).values():
            check_pattern(w, pattern)
    with torch.no_grad():
        if pattern is not None or scope == "layer":
            matrices = input_major(model, weights) if pattern is not None else weights
            for w in tqdm(matrices.values(), desc="magnitude", unit="matrix", disable=not progress):
                magnitude_matrix_(w, sparsity, pattern)
        else:
            scores = torch.cat([w.detach().abs().flatten().float() for w in weights.values()])
            k = int(sparsity * scores.numel())
            thresh = scores.kthvalue(k).values if k > 0 else None
            for w in weights.values():
                if thresh is not None:
                    w.mul_((w.abs().float() > thresh).to(w.dtype))
    stage("recording the masks, counting the zeros of every matrix", progress)
    if sparsity > 0:
        _mask(model, weights)
    return {**_report(model, "magnitude", parts, layers, sparsity), "scope": scope, "pattern": _pattern_text(pattern)}


def magnitude_matrix_(w: Tensor, sparsity: float, pattern: tuple[int, int] | None = None) -> None:
    """Zero the `sparsity` fraction of smallest-magnitude entries of one matrix `w` in place, or, with an N:M
    `pattern`, all but the N largest of every M consecutive inputs of a row (`w` then an input-major view)."""
    with torch.no_grad():
        if pattern is not None:
            w.mul_(nm_keep(w.detach().abs().float(), pattern).to(w.dtype))
            return
        k = int(sparsity * w.numel())
        if k > 0:
            idx = w.detach().abs().flatten().argsort()[:k]
            w.view(-1)[idx] = 0


def _pattern_text(pattern: tuple[int, int] | None) -> str | None:
    return None if pattern is None else f"{pattern[0]}:{pattern[1]}"


def _mask(model: nn.Module, weights: dict[str, nn.Parameter]) -> None:
    """Store the zeros just made as masks, so every later training or NTK run keeps them."""
    for name in weights:
        install_mask(model, name)


# --------------------------------------------------------------------------------------------------
# Calibrated unstructured pruning: Wanda and SparseGPT
#
# The math is in pure functions of one weight matrix W (out, in) and the second moment of its inputs
# H = X^T X / n (in, in); the wiring captures H with forward pre-hooks on the prunable linears, one layer
# at a time with the earlier layers already pruned (both papers prune "sequentially"), or all layers in one
# pass on the dense model.


def parse_pattern(text: str | None) -> tuple[int, int] | None:
    """'2:4' -> (2, 4): N:M semi-structured sparsity, at most N nonzeros in every M consecutive inputs of a row (the
    format NVIDIA's sparse tensor cores and inference engines serve: 2:4). None / '' -> None (unstructured)."""
    if not text:
        return None
    try:
        n, m = (int(x) for x in str(text).split(":"))
    except ValueError:
        raise MLPSurgeryError(f"pattern {text!r} is not N:M (e.g. 2:4: two nonzeros in every four weights)") from None
    if not 0 < n < m or m > 64:
        raise MLPSurgeryError(f"pattern {text!r}: need 0 < N < M <= 64 (e.g. 2:4, 4:8)")
    return n, m


def pattern_sparsity(pattern: tuple[int, int]) -> float:
    n, m = pattern
    return 1 - n / m


def check_pattern(W: Tensor, pattern: tuple[int, int]) -> None:
    if W.shape[1] % pattern[1]:
        raise MLPSurgeryError(f"a {tuple(W.shape)} weight has {W.shape[1]} inputs, not a multiple of {pattern[1]}: "
                              f"{pattern[0]}:{pattern[1]} sparsity needs whole groups of {pattern[1]} inputs")


def nm_keep(scores: Tensor, pattern: tuple[int, int]) -> Tensor:
    """Keep-mask with the N highest scores of every M consecutive entries of each row (ties: the earlier entry)."""
    n, m = pattern
    rows, cols = scores.shape
    check_pattern(scores, pattern)
    groups = scores.reshape(rows, cols // m, m)
    top = groups.topk(n, dim=2).indices
    keep = torch.zeros_like(groups, dtype=torch.bool).scatter_(2, top, True)
    return keep.reshape(rows, cols)


def wanda_mask(W: Tensor, h_diag: Tensor, sparsity: float, pattern: tuple[int, int] | None = None) -> Tensor:
    """Wanda (Sun et al. 2023): keep-mask of W. Score |W_ij| * ||X_j||_2; in every output row the
    `sparsity` fraction of lowest scores goes, or with an N:M `pattern` all but the N highest of every M
    consecutive inputs (the paper's 2:4 / 4:8 variant; sparsity is then ignored)."""
    scores = W.abs() * h_diag.clamp_min(0).sqrt()[None, :]
    if pattern is not None:
        return nm_keep(scores, pattern)
    k = int(sparsity * W.shape[1])
    keep = torch.ones_like(W, dtype=torch.bool)
    if k > 0:
        keep.scatter_(1, scores.argsort(dim=1)[:, :k], False)
    return keep


def sparsegpt_matrix(W: Tensor, H: Tensor, sparsity: float, blocksize: int = 128, percdamp: float = 0.01,
                     pattern: tuple[int, int] | None = None) -> Tensor:
    """SparseGPT (Frantar & Alistarh 2023): W with a `sparsity` fraction of its entries zeroed and the rest
    updated to minimise ||W X - W' X||^2 (optimal brain surgeon column by column with the Cholesky factor
    of H^-1). The mask is chosen adaptively per block of `blocksize` columns by w^2 / [H^-1]_jj^2; with an N:M
    `pattern` (the paper's 2:4 / 4:8 variant) per group of M columns, on the weights as already updated by the
    columns before the group, keeping the N highest scores of each row's group (sparsity is then ignored)."""
    if pattern is not None:
        check_pattern(W, pattern)
        if blocksize % pattern[1]:
            raise MLPSurgeryError(f"blocksize {blocksize} is not a multiple of the pattern's group {pattern[1]}")
    W = W.detach().float().clone(memory_format=torch.contiguous_format)
    H = H.detach().float().clone(memory_format=torch.contiguous_format)
    cols = W.shape[1]
    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    W[:, dead] = 0
    H += percdamp * torch.mean(torch.diag(H)) * torch.eye(cols, device=H.device)
    Hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
    for i1 in range(0, cols, blocksize):
        i2 = min(i1 + blocksize, cols)
        W1 = W[:, i1:i2].clone()
        Q1 = torch.zeros_like(W1)
        Err1 = torch.zeros_like(W1)
        Hinv1 = Hinv[i1:i2, i1:i2]
        mask1 = torch.zeros(W1.shape, dtype=torch.bool, device=W1.device)
        if pattern is None:
            scores = W1 ** 2 / torch.diag(Hinv1)[None, :] ** 2
            k = int(scores.numel() * sparsity)
            if k > 0:
                mask1.view(-1)[scores.flatten().argsort()[:k]] = True
        for i in range(i2 - i1):
            if pattern is not None and i % pattern[1] == 0:
                m = pattern[1]
                scores = W1[:, i:i + m] ** 2 / torch.diag(Hinv1)[i:i + m][None, :] ** 2
                mask1[:, i:i + m] = ~nm_keep(scores, pattern)
            w = W1[:, i]
            q = torch.where(mask1[:, i], torch.zeros_like(w), w)
            Q1[:, i] = q
            err = (w - q) / Hinv1[i, i]
            W1[:, i:] -= err[:, None] @ Hinv1[i, i:][None, :]
            Err1[:, i] = err
        W[:, i1:i2] = Q1
        W[:, i2:] -= Err1 @ Hinv[i1:i2, i2:]
    return W


def _layer_linears(sites, i: int, parts: str) -> dict[str, nn.Module]:
    out = {}
    if parts in ("ffn", "both"):
        out.update({f"ffn.{role}": m for role, m in sites.mlp[i].linears().items()})
    if parts in ("attn", "both"):
        out.update({f"attn.{role}": m for role, m in sites.attn[i].linears().items()})
    return out


def input_moments(model: nn.Module, data: Tensor, linears: dict[str, nn.Module], stop_after: int | None = None,
                  batch_size: int = 8) -> dict[str, Tensor]:
    """H = X^T X / n of each named linear's input over the calibration blocks `data` (N, T). The forward
    stops after layer `stop_after` (nothing downstream is computed)."""
    from ..capture import _StopForward

    sites = find_sites(model)

    def stop(mod, args, out):
        raise _StopForward

    handles, moments = moment_hooks(linears)
    if stop_after is not None:
        handles.append(sites.mlp[stop_after].exit.register_forward_hook(stop))
    _calibration_pass(model, data, handles, batch_size)
    return moments()


def moment_hooks(linears: dict[str, nn.Module]):
    """Forward pre-hooks that sum X^T X and the rows of each named linear's inputs; returns (handles, a function
    giving {name: H = X^T X / n} once the calibration data has run)."""
    sums: dict[str, Tensor] = {}
    rows: dict[str, int] = {}

    def hook(name):
        def fn(mod, args):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).float()
            sums[name] = sums.get(name, 0) + x.T @ x
            rows[name] = rows.get(name, 0) + x.shape[0]
        return fn

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in linears.items()]
    return handles, lambda: {n: sums[n] / rows[n] for n in sums}


def _calibration_pass(model: nn.Module, data: Tensor, handles: list, batch_size: int, progress: bool = False,
                      desc: str = "calibration") -> None:
    """Run the calibration blocks `data` through the model in eval mode without grad, for the hooks in `handles`
    (a forward cut short by _StopForward is expected); the hooks are removed and the mode restored after."""
    from ..capture import _StopForward

    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for b in tqdm(range(0, len(data), batch_size), desc=desc, unit="batch", disable=not progress):
                try:
                    model(input_ids=data[b:b + batch_size].to(device))
                except _StopForward:
                    pass
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)


def _sparsity_of(sparsity: float | dict, name: str) -> float:
    s = sparsity.get(name.split(".")[0], 0.0) if isinstance(sparsity, dict) else sparsity
    if not 0.0 <= s < 1.0:
        raise MLPSurgeryError(f"sparsity must be in [0, 1), not {s}")
    return s


def layer_moments(model: nn.Module, data: Tensor, parts: str = "both", layers: list[int] | None = None,
                  batch_size: int = 8) -> dict[int, dict[str, Tensor]]:
    """Input moments H of every prunable linear of the chosen layers, on the model as it is, in one pass:
    {layer: {"ffn.up": H, "attn.q": H, ...}} (what a non-sequential `calibrated_prune` uses)."""
    sites = find_sites(model)
    layers = list(range(len(sites))) if layers is None else sorted(layers)
    linears = {f"{i}.{n}": m for i in layers for n, m in _layer_linears(sites, i, parts).items()}
    flat = input_moments(model, data, linears, stop_after=layers[-1], batch_size=batch_size)
    return {i: {n.split(".", 1)[1]: h for n, h in flat.items() if int(n.split(".", 1)[0]) == i} for i in layers}


@ends_stages
def calibrated_prune(model: nn.Module, data: Tensor | None, sparsity: float | dict, method: str, parts: str = "both",
                     layers: list[int] | None = None, batch_size: int = 8, sequential: bool = True,
                     moments: dict[int, dict[str, Tensor]] | None = None, progress: bool = True,
                     pattern: tuple[int, int] | None = None) -> dict:
    """Wanda or SparseGPT, in place. sparsity: one fraction, or {"attn": a, "ffn": f}; or an N:M `pattern`
    (2:4: two nonzeros in every four consecutive inputs of a row), which sets the sparsity to 1 - N/M.

    sequential (the papers' procedure): layer l's input moments are measured with the layers before it
    already pruned, one partial forward pass per layer. sequential=False measures all layers once on the
    dense model (one pass; or pass `moments` from `layer_moments` to reuse them across sparsities)."""
    if method not in ("wanda", "sparsegpt"):
        raise MLPSurgeryError(f"calibrated pruning is wanda or sparsegpt, not {method!r}")
    if parts not in PARTS:
        raise MLPSurgeryError(f"parts must be one of {', '.join(PARTS)}, not {parts!r}")
    if moments is None and (data is None or data.dim() != 2 or len(data) == 0):
        raise MLPSurgeryError(f"{method} needs calibration blocks: a non-empty (N, T) tensor of token ids "
                              "(--data and --calib-blocks on the command line)")
    sites = find_sites(model)
    layers = list(range(len(sites))) if layers is None else sorted(layers)
    if pattern is not None:
        sparsity = pattern_sparsity(pattern)
        for w in input_major(model, prunable_weights(model, parts, layers)).values():  # all checked before any change
            check_pattern(w, pattern)
    if moments is None and not sequential:
        moments = layer_moments(model, data, parts, layers, batch_size)
    errors: dict[int, dict[str, tuple[float, float]]] = {}
    for i in tqdm(layers, desc=method, unit="layer", disable=not progress):
        linears = _layer_linears(sites, i, parts)
        h = moments[i] if moments is not None else input_moments(model, data, linears, stop_after=i,
                                                                  batch_size=batch_size)
        errors[i] = prune_linears_(linears, h, method, sparsity, pattern)
    stage("recording the masks, counting the zeros of every matrix", progress)
    for part in ("attn", "ffn"):
        if parts in (part, "both") and _sparsity_of(sparsity, part) > 0:
            _mask(model, prunable_weights(model, part, layers))
    report = {**_report(model, method, parts, layers, sparsity, errors), "sequential": moments is None,
              "pattern": _pattern_text(pattern)}
    report["error_inputs"] = ("the calibration inputs of each projection, " + (
        "measured with the layers before it already pruned (as the method prunes)" if moments is None else
        "measured once on the dense model"))
    return report


def prune_linears_(linears: dict[str, nn.Module], h: dict[str, Tensor], method: str, sparsity: float | dict,
                   pattern: tuple[int, int] | None = None) -> dict[str, tuple[float, float]]:
    """Wanda or SparseGPT on one layer's named linears in place, from their input moments `h`; returns each
    projection's (output error, output) on those inputs (`_output_error`)."""
    errors = {}
    for name, mod in linears.items():
        s = _sparsity_of(sparsity, name)
        W, _ = linear_weight(mod)
        with torch.no_grad():
            before = W.detach().float().clone()
            if method == "wanda":
                W.mul_(wanda_mask(W.float(), torch.diag(h[name]), s, pattern).to(W.dtype))
            else:
                W.copy_(sparsegpt_matrix(W, h[name], s, pattern=pattern).to(W.dtype))
            errors[name] = _output_error(before, W.detach().float(), h[name].float())
    return errors


def _output_error(before: Tensor, after: Tensor, H: Tensor) -> tuple[float, float]:
    """(||(W' - W) X||^2, ||W X||^2) / n for inputs X with second moment H = X^T X / n: the output error of a
    pruned projection on its calibration inputs, from the moment the method already has (no second pass)."""
    D = after - before
    return float(((D @ H) * D).sum()), float(((before @ H) * before).sum())


def _per_layer(sparsity: dict[int, float], errors: dict[int, dict[str, tuple[float, float]]] | None) -> list[dict]:
    """Rows {layer, sparsity, error_rel, projections}: error_rel = sqrt(sum of the squared output errors of the
    layer's pruned projections / sum of their squared outputs) (None without calibration data)."""
    rows = []
    for i, sp in sparsity.items():
        row = {"layer": i, "sparsity": sp, "error_rel": None}
        e = (errors or {}).get(i)
        if e:
            num, den = sum(v[0] for v in e.values()), sum(v[1] for v in e.values())
            row["error_rel"] = (num / den) ** 0.5 if den > 0 else None
            row["projections"] = {n: (a / b) ** 0.5 if b > 0 else None for n, (a, b) in e.items()}
        rows.append(row)
    return rows


def _layer_counts(model: nn.Module, parts: str = "both", layers: list[int] | None = None) -> dict[int, tuple[int, int]]:
    """Per layer, (zero entries, entries) of its prunable weight matrices."""
    layers = list(range(len(find_sites(model)))) if layers is None else layers
    out = {}
    for i in layers:
        ws = prunable_weights(model, parts, [i]).values()
        total = sum(w.numel() for w in ws)
        out[i] = (total - sum(int(torch.count_nonzero(w.detach())) for w in ws), total)
    return out


def layer_sparsity(model: nn.Module, parts: str = "both", layers: list[int] | None = None) -> dict[int, float]:
    """Fraction of zero entries among each layer's prunable weight matrices."""
    return {i: z / max(t, 1) for i, (z, t) in _layer_counts(model, parts, layers).items()}


def _layer_sizes(model: nn.Module, parts: str, layers: list[int]) -> dict[int, int]:
    return {i: sum(w.numel() for w in prunable_weights(model, parts, [i]).values()) for i in layers}


def _report(model: nn.Module, method: str, parts: str, layers, sparsity,
            errors: dict[int, dict[str, tuple[float, float]]] | None = None) -> dict:
    """The whole run's sparsity and, per layer, its sparsity and output error (`_per_layer`), from one count of
    the zeros of every chosen matrix (seconds for a real model: it is counted once)."""
    return report_from_counts(_layer_counts(model, parts, layers), method, parts, sparsity, errors)


def report_from_counts(counts: dict[int, tuple[int, int]], method: str, parts: str, sparsity,
                       errors: dict[int, dict[str, tuple[float, float]]] | None = None) -> dict:
    """`_report` from per-layer (zeros, entries) counts already made (the layer-sequential mode counts each
    layer while it is in memory)."""
    total = sum(t for _, t in counts.values())
    zeros = sum(z for z, _ in counts.values())
    return {"method": method, "parts": parts, "target": sparsity, "sparsity": zeros / max(total, 1),
            "pruned_params": zeros, "considered_params": total,
            "per_layer": _per_layer({i: z / max(t, 1) for i, (z, t) in counts.items()}, errors)}


# --------------------------------------------------------------------------------------------------
# Structured baselines: Fisher block pruning and random subnets (the TwIST blocks, physically removed)


def block_fisher(model: nn.Module, data: Tensor, layout, batch_size: int = 4, progress: bool = True
                 ) -> dict[tuple[str, int], Tensor]:
    """Empirical Fisher of every block (paper §5 "Block Prune", after Michel et al. 2019): a gate m_b = 1 on
    each block's contribution to the output projection; importance = sum over batches of (dL/dm_b)^2."""
    if data is None or data.dim() != 2 or len(data) == 0:
        raise MLPSurgeryError("Fisher block pruning needs calibration blocks: a non-empty (N, T) tensor of token ids")
    check_lm_loss(model)
    device = next(model.parameters()).device
    gates, handles = fisher_gates(find_sites(model), layout, device)
    fisher = {k: torch.zeros_like(g) for k, g in gates.items()}
    frozen = [p for p in model.parameters() if p.requires_grad]
    for p in frozen:
        p.requires_grad_(False)
    was_training = model.training
    model.eval()
    try:
        keys = list(gates)
        for b in tqdm(range(0, len(data), batch_size), desc="fisher", unit="batch", disable=not progress):
            batch = data[b:b + batch_size].to(device)
            loss = model(input_ids=batch, labels=batch, use_cache=False).loss
            for k, gr in zip(keys, torch.autograd.grad(loss, [gates[k] for k in keys])):
                fisher[k] += gr.detach() ** 2
    finally:
        for h in handles:
            h.remove()
        for p in frozen:
            p.requires_grad_(True)
        model.train(was_training)
    return fisher


def fisher_gates(sites, layout, device, layers=None) -> tuple[dict[tuple[str, int], Tensor], list]:
    """The gates m = 1 Fisher differentiates, one per block, on the input features of each chosen layer's attention
    o / MLP down projection (of `layers` only, if given): ({("attn" | "ffn", layer): gates}, attention first, by
    layer; the hook handles)."""
    from .twist import attn_feature_blocks, gate_inputs, mlp_feature_blocks

    gates: dict[tuple[str, int], Tensor] = {}
    handles = []
    for i, n in layout.attn_full.items():
        if layers is None or i in layers:
            g = gates[("attn", i)] = torch.ones(n, device=device, requires_grad=True)
            fb = attn_feature_blocks(sites.attn[i]).to(device)
            handles.append(gate_inputs(sites.attn[i].o_proj, lambda g=g, fb=fb: g[fb]))
    for i, h in layout.mlp_h.items():
        if layers is None or i in layers:
            g = gates[("ffn", i)] = torch.ones(layout.R, device=device, requires_grad=True)
            fb = mlp_feature_blocks(h, layout.R).to(device)
            handles.append(gate_inputs(sites.mlp[i].down_proj, lambda g=g, fb=fb: g[fb]))
    return gates, handles


def check_lm_loss(model: nn.Module) -> None:
    """Refuse a model whose forward computes no loss from labels (an encoder without a head): Fisher block pruning
    differentiates the language-model loss."""
    import inspect

    if "labels" not in inspect.signature(model.forward).parameters:
        raise MLPSurgeryError(f"{type(model).__name__} computes no language-model loss, which Fisher block pruning "
                              "differentiates: use a causal LM checkpoint, or --method random")


def fisher_subnet(fisher: dict[tuple[str, int], Tensor], layout, layers=None):
    """Per layer (of `layers` only, if given), the N_sub blocks of highest Fisher (scores from `block_fisher`,
    possibly computed once for a wider layout and reused across sparsities)."""
    from .twist import Subnet

    def top(scores: Tensor, k: int) -> list[int]:
        return sorted(scores.topk(k).indices.tolist())

    def chosen(full):
        return [i for i in full if layers is None or i in layers]

    return Subnet(attn={i: top(fisher[("attn", i)], layout.attn_sub[i]) for i in chosen(layout.attn_full)},
                  mlp={i: top(fisher[("ffn", i)], layout.ffn_sub) for i in chosen(layout.mlp_h)})


def fisher_block_prune(model: nn.Module, data: Tensor, keep: int, blocks: int = 12, parts: str = "both",
                       layers: list[int] | None = None, attn_keep: int | None = None, batch_size: int = 4,
                       progress: bool = True) -> tuple[nn.Module, dict]:
    """Keep, per layer, the `keep` of `blocks` MLP chunks (and attn_keep KV groups) of highest Fisher; the
    others are removed physically (no rescaling: the baseline masks blocks as trained). Returns a new model."""
    from .twist import make_layout, materialize

    layers = list(range(len(find_sites(model)))) if layers is None else layers
    layout = make_layout(model, parts, layers, blocks, keep, attn_keep)
    fisher = block_fisher(model, data, layout, batch_size=batch_size, progress=progress)
    subnet = fisher_subnet(fisher, layout)
    errors = removal_errors(model, data, layout, subnet, batch_size=batch_size, progress=progress)
    new = materialize(model, layout, subnet, rescale=False)
    config = {"keep": keep, "blocks": blocks, "parts": parts, "layers": layers, "attn_keep": attn_keep}
    record(new, "fisher-block-prune", config, calibration=list(data.shape),
           subnet=subnet.as_dict())
    return new, {"method": "fisher", "parts": parts, **config,
                 "fisher": {f"{k[0]}.{k[1]}": v.tolist() for k, v in fisher.items()},
                 "errors": errors}


FISHER_ERROR_INPUTS = ("the calibration blocks through the dense model: the output of each layer's attention o / MLP "
                       "down projection without the removed blocks' input features")


def removal_errors(model: nn.Module, data: Tensor, layout, subnet, batch_size: int = 4,
                   progress: bool = False) -> dict[int, dict[str, tuple[float, float]]]:
    """What removing the blocks outside `subnet` costs each layer on the calibration blocks, in one forward pass
    of the dense model: per layer and output projection (attention o, MLP down), (||W_removed x_removed||^2,
    ||W x||^2) summed over tokens. Removing a block removes exactly its input features of these projections
    (its q / k / v rows and up / gate rows only feed them), so this is the error of each sub-block's output."""
    from ..capture import _StopForward

    sites = find_sites(model)
    sums: dict[int, dict[str, list[float]]] = {}
    handles = removal_hooks(sites, layout, subnet, sums)
    last = max([*subnet.attn, *subnet.mlp], default=None)
    if last is None:
        return {}

    def stop(mod, args, out):
        raise _StopForward

    handles.append(sites.mlp[last].layer.register_forward_hook(stop))  # nothing after the last layer is needed
    _calibration_pass(model, data, handles, batch_size, progress, desc="removal error")
    return {i: {n: (v[0], v[1]) for n, v in d.items()} for i, d in sums.items()}


def removal_hooks(sites, layout, subnet, sums: dict) -> list:
    """Forward pre-hooks on the attention o / MLP down projections of `subnet`'s layers that add, per batch, each
    layer's (||W_removed x_removed||^2, ||W x||^2) to sums[layer][projection] (the layer-by-layer mode hooks one
    layer at a time with a one-layer subnet). Returns the handles."""
    from .twist import attn_feature_blocks, mlp_feature_blocks

    def hook(i: int, name: str, W: Tensor, removed: Tensor):
        def fn(mod, args):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).float()
            acc = sums.setdefault(i, {}).setdefault(name, [0.0, 0.0])
            acc[0] += float((x[:, removed] @ W[:, removed].T).pow(2).sum())
            acc[1] += float((x @ W.T).pow(2).sum())
        return fn

    handles = []
    for i, kept in subnet.attn.items():
        W, _ = linear_weight(sites.attn[i].o_proj)
        removed = ~torch.isin(attn_feature_blocks(sites.attn[i]), torch.tensor(kept)).to(W.device)
        handles.append(sites.attn[i].o_proj.register_forward_pre_hook(hook(i, "attn.o", W.detach().float(), removed)))
    for i, kept in subnet.mlp.items():
        W, _ = linear_weight(sites.mlp[i].down_proj)
        removed = ~torch.isin(mlp_feature_blocks(layout.mlp_h[i], layout.R), torch.tensor(kept)).to(W.device)
        handles.append(sites.mlp[i].down_proj.register_forward_pre_hook(
            hook(i, "ffn.down", W.detach().float(), removed)))
    return handles


METHODS = ("magnitude", "wanda", "sparsegpt", "fisher", "random")


def keep_for_sparsity(sparsity: float, blocks: int) -> int:
    """Blocks kept out of `blocks` when a `sparsity` fraction of them is removed (at least one)."""
    if not 0.0 <= sparsity < 1.0:
        raise MLPSurgeryError(f"sparsity must be in [0, 1), not {sparsity}")
    return max(1, round((1 - sparsity) * blocks))


def prune(model: nn.Module, method: str, sparsity: float | None, parts: str = "both",
          layers: list[int] | None = None, data: Tensor | None = None, blocks: int = 12, seed: int = 0,
          progress: bool = True, pattern: tuple[int, int] | str | None = None) -> tuple[nn.Module, dict]:
    """One baseline at one sparsity of the chosen weights. Unstructured methods (magnitude, wanda, sparsegpt)
    zero weights in place, at `sparsity` or in an N:M `pattern` ((2, 4) or "2:4": semi-structured, sparsity
    1 - N/M); structured ones (fisher, random) keep round((1-sparsity) x blocks) of `blocks` MLP chunks per
    layer (and the matching share of KV groups) and return a new, physically smaller model."""
    if method not in METHODS:
        raise MLPSurgeryError(f"method must be one of {', '.join(METHODS)}, not {method!r}")
    if isinstance(pattern, str):
        pattern = parse_pattern(pattern)
    if pattern is not None:
        if method not in ("magnitude", "wanda", "sparsegpt"):
            raise MLPSurgeryError(f"an N:M pattern applies to magnitude, wanda and sparsegpt, not {method} "
                                  "(which removes whole blocks)")
        implied = pattern_sparsity(pattern)
        if sparsity is not None and abs(sparsity - implied) > 1e-9:
            raise MLPSurgeryError(f"pattern {pattern[0]}:{pattern[1]} is sparsity {implied:g}, not {sparsity:g}: "
                                  "give one of the two")
        sparsity = implied
    if sparsity is None:
        raise MLPSurgeryError("give a sparsity (a fraction in [0, 1)) or an N:M pattern")
    settings = {"sparsity": sparsity, "parts": parts, "layers": layers}
    if pattern is not None:
        settings["pattern"] = _pattern_text(pattern)
    if method == "magnitude":
        report = magnitude_prune(model, sparsity, parts=parts, layers=layers, progress=progress, pattern=pattern)
        record(model, "magnitude-prune", settings)
        return model, report
    if method in ("wanda", "sparsegpt"):
        report = calibrated_prune(model, data, sparsity, method, parts=parts, layers=layers, progress=progress,
                                  pattern=pattern)
        record(model, f"{method}-prune", settings, calibration=list(data.shape))
        return model, report
    keep = keep_for_sparsity(sparsity, blocks)
    all_layers = list(range(len(find_sites(model))))
    before = _layer_sizes(model, parts, all_layers)
    if method == "fisher":
        new, report = fisher_block_prune(model, data, keep, blocks, parts, layers, progress=progress)
        errors = report.pop("errors")
        report["error_inputs"] = FISHER_ERROR_INPUTS
    else:
        from .twist import twist_extract

        layers = all_layers if layers is None else layers
        new = twist_extract(model, keep=keep, blocks=blocks, parts=parts, layers=layers, seed=seed)
        report, errors = {"method": "random", "parts": parts, "keep": keep, "blocks": blocks, "seed": seed}, None
    # structured pruning removes weights physically: a layer's sparsity is the share of its weights now gone
    after = _layer_sizes(new, parts, all_layers)
    report["per_layer"] = _per_layer({i: 1 - after[i] / before[i] if before[i] else 0.0 for i in all_layers}, errors)
    return new, report
