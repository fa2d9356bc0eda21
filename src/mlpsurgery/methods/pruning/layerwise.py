"""Magnitude, Wanda and SparseGPT pruning layer by layer from the checkpoint's files (mlpsurgery/layerwise.py).

The same per-matrix math as the whole-model mode (magnitude.py's `magnitude_matrix_`, calibrated.py's
`prune_linears_`), the same sequential calibration -- layer l's input moments measured on the outputs of the layers
before it, already pruned -- but only one decoder layer is ever in memory: it is read from the safetensors files,
its moments taken over the calibration activations that reach it, pruned, run once more to give the next layer its
inputs, written into the output file, and dropped. The folder written is the one `prune` + `save` write (same
tensors, masks, manifest, source fingerprint); tests/test_layerwise.py checks equality with the whole-model mode bit
for bit.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from torch import Tensor
from tqdm.auto import tqdm

from ...errors import MLPSurgeryError
from ...io import MASKS, WEIGHTS, record, streamed_save
from ...layerwise import LayerStream, SourceRecord
from ...tensorfiles import SafetensorsWriter
from ...modules.masks import SUFFIX, install_mask, mask_of
from ...sites import find_sites, linear_weight
from .calibrated import _sparsity_of, moment_hooks, prune_linears_
from .counts import _layer_counts, report_from_counts
from .magnitude import magnitude_matrix_
from .nm import _pattern_text, check_pattern, parse_pattern, pattern_sparsity
from .weights import PARTS, _layer_linears, input_major, prunable_weights

METHODS = ("magnitude", "wanda", "sparsegpt")


def prune_layerwise(folder: str | Path, out: str | Path, method: str, sparsity: float | None = None,
                    parts: str = "both", layers: list[int] | None = None, data: Tensor | None = None,
                    pattern: tuple[int, int] | str | None = None, batch_size: int = 8, dtype=None,
                    max_memory_gb: float | None = None, tokenizer=None, overwrite: bool = False, inputs=(),
                    source_name: str | None = None, progress: bool = True, device=None) -> dict:
    """Prune the checkpoint in `folder` layer by layer and save the result to `out` (what `prune` then `save`
    write); returns prune's report. Only magnitude (per matrix), Wanda and SparseGPT (sequential calibration).
    device: where each layer is pruned (LayerStream; the CPU by default)."""
    if method not in METHODS:
        raise MLPSurgeryError(f"prune_layerwise prunes with {', '.join(METHODS)}, not {method!r} (Fisher blocks and "
                              "random subnets change shapes: pruning.blocks_layerwise.block_prune_layerwise)")
    if parts not in PARTS:
        raise MLPSurgeryError(f"parts must be one of {', '.join(PARTS)}, not {parts!r}")
    if isinstance(pattern, str):
        pattern = parse_pattern(pattern)
    if pattern is not None:
        sparsity = pattern_sparsity(pattern)
    if sparsity is None or not 0.0 <= sparsity < 1.0:
        raise MLPSurgeryError("give a sparsity (a fraction in [0, 1)) or an N:M pattern")
    calibrated = method != "magnitude"
    if calibrated and (data is None or data.dim() != 2 or len(data) == 0):
        raise MLPSurgeryError(f"{method} needs calibration blocks: a non-empty (N, T) tensor of token ids "
                              "(--data and --calib-blocks on the command line)")
    stream = LayerStream(Path(folder), dtype=dtype, max_memory_gb=max_memory_gb, device=device)
    model = stream.model
    model._mlpsurgery_path = str(folder)
    sites = find_sites(model)
    n = stream.n_layers
    chosen = list(range(n)) if layers is None else sorted(set(layers))
    if any(not 0 <= i < n for i in chosen):
        raise MLPSurgeryError(f"layers must lie in 0-{n - 1}")
    weights = prunable_weights(model, parts, chosen)  # on the meta device: names and shapes
    if pattern is not None:
        for w in input_major(model, weights).values():  # all checked before anything is read or written
            check_pattern(w, pattern)
    masked: set[str] = set()  # what the whole-model mode masks: every chosen weight of a part pruned at all
    for part in ("attn", "ffn"):
        if parts in (part, "both") and _sparsity_of(sparsity, part) > 0:
            masked |= set(prunable_weights(model, part, chosen))
    before, after = stream.outside_names()
    source = SourceRecord(stream, source_name)
    for name, t in stream.outside_state(before).items():
        source.add(name, t)
    settings = {"sparsity": sparsity, "parts": parts, "layers": layers}
    if pattern is not None:
        settings["pattern"] = _pattern_text(pattern)

    counts: dict[int, tuple[int, int]] = {}
    errors: dict[int, dict] = {}
    with streamed_save(model, out, tokenizer=tokenizer, overwrite=overwrite, inputs=inputs) as tmp:
        stream.spill_dir = tmp / ".activations"
        writer = SafetensorsWriter(tmp / WEIGHTS, stream.layout(), metadata={"format": "pt", **stream.tied})
        masks = SafetensorsWriter(tmp / MASKS, {k: (torch.bool, tuple(weights[k].shape)) for k in sorted(masked)}) \
            if masked else None
        for name, t in stream.resident_state().items():
            writer.write(name, t)
        acts = None
        if calibrated:
            acts = stream.layer_inputs(data, batch_size, extra_bytes=_moment_bytes(stream, sites, parts, chosen))
        for i in tqdm(range(n), desc=f"{method} (layer by layer)", unit="layer", disable=not progress):
            stream.materialise(i)
            for name, t in stream.layer_state(i).items():
                source.add(name, t)
            if i in chosen:
                linears = _layer_linears(sites, i, parts)
                if calibrated:
                    handles, moments = moment_hooks(linears)
                    try:
                        stream.run(i, acts, keep=False)
                    finally:
                        for h in handles:
                            h.remove()
                    errors[i] = prune_linears_(linears, moments(), method, sparsity, pattern)
                else:
                    mine = prunable_weights(model, parts, [i])
                    for w in (input_major(model, mine) if pattern is not None else mine).values():
                        magnitude_matrix_(w, sparsity, pattern)
                for name in prunable_weights(model, parts, [i]):
                    if name in masked:
                        install_mask(model, name)
                counts.update(_layer_counts(model, parts, [i]))
            if calibrated and i < chosen[-1]:
                acts = stream.run(i, acts)
            for name, t in stream.layer_state(i).items():
                if name.endswith(SUFFIX) and name[:-len(SUFFIX)] in masked:
                    masks.write(name[:-len(SUFFIX)], mask_of(model, name[:-len(SUFFIX)]))
                else:
                    writer.write(name, t)
            stream.release(i)
        for name, t in stream.outside_state(after).items():
            source.add(name, t)
        writer.close()
        if masks is not None:
            masks.close()
        del acts
        shutil.rmtree(tmp / ".activations", ignore_errors=True)
        source.record()
        if calibrated:
            record(model, f"{method}-prune", settings, calibration=list(data.shape))
        else:
            record(model, "magnitude-prune", settings)

    report = report_from_counts(counts, method, parts, sparsity, errors if calibrated else None)
    report.update({"pattern": _pattern_text(pattern), "layerwise": True, "dtype": str(stream.dtype).split(".")[-1],
                   "activations_on_disk": stream.disk, "device": str(stream.device)})
    if calibrated:
        report["sequential"] = True
        report["error_inputs"] = ("the calibration inputs of each projection, measured with the layers before it "
                                  "already pruned (as the method prunes)")
    else:
        report["scope"] = "layer"
    return report


def _moment_bytes(stream: LayerStream, sites, parts: str, chosen: list[int]) -> int:
    """What one layer's calibration statistics take: a float32 (in, in) moment per linear, and SparseGPT's
    working copies of the largest (its inverse Hessian and the float32 weight)."""
    worst = 0
    for i in chosen:
        ins = [linear_weight(m)[0].shape for m in _layer_linears(sites, i, parts).values()]
        worst = max(worst, sum(4 * s[1] * s[1] for s in ins) + max(8 * s[1] * s[1] + 4 * s[0] * s[1] for s in ins))
    return worst
