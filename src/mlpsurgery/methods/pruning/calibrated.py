"""Calibrated unstructured pruning: Wanda (Sun et al. 2023) and SparseGPT (Frantar & Alistarh 2023).

The math is in pure functions of one weight matrix W (out, in) and the second moment of its inputs H = X^T X / n
(in, in); the wiring captures H with forward pre-hooks on the prunable linears, one layer at a time with the
earlier layers already pruned (both papers prune "sequentially"), or all layers in one pass on the dense model."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from ...errors import MLPSurgeryError
from ...report import ends_stages, stage
from ...sites import find_sites, linear_weight
from .counts import _report
from .nm import _pattern_text, check_pattern, nm_keep, pattern_sparsity
from .weights import PARTS, _layer_linears, _mask, input_major, prunable_weights


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


def input_moments(model: nn.Module, data: Tensor, linears: dict[str, nn.Module], stop_after: int | None = None,
                  batch_size: int = 8) -> dict[str, Tensor]:
    """H = X^T X / n of each named linear's input over the calibration blocks `data` (N, T). The forward
    stops after layer `stop_after` (nothing downstream is computed)."""
    from ...capture import _StopForward

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
    from ...capture import _StopForward

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

