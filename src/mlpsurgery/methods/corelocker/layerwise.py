"""`lock key --layerwise` and `unlock --layerwise`: CoreLocker on a checkpoint read one decoder layer at a time
(layerwise.py), for weight, neuron and head units and the l1, random and scale indicators.

The same ranking, extraction, hashes, key and folder as `lock_folder` on the whole model (tests/test_layerwise.py
checks the key and the locked weights equal bit for bit), but the weights are never all in memory:

- ranking: each weight group's scores are read from the checkpoint when the streaming selection asks for them
  (`ranking.global_top` makes three passes over the groups, each holding one matrix's scores; `--scope layer` one);
  neuron, head and norm-channel scores (one number per unit) are computed with each layer read once beforehand;
- extraction: layer by layer -- read it, hash its tensors (the original's fingerprint), write the locked values,
  hash again (the locked model's), write it into the output file, drop it;
- the parts outside the layers (embeddings, final norm, head) are resident; with `--include-io` their extraction is
  applied after the layers, once their original bytes have gone into the source fingerprint.

`unlock_layerwise` reads a locked folder the same way: each layer's tensors checked against the key's hashes of the
locked model, restored, hashed again and written; the restored fingerprint checked at the end.

What must stay in memory is what the key itself holds: the chosen units' ids during ranking and their positions
and original values (5% of the weights: for a 2 B model 94 M positions).
"""

from __future__ import annotations

import contextlib
import os
import secrets
from dataclasses import asdict
from pathlib import Path
from typing import Iterable

import torch
from torch import Tensor
from tqdm.auto import tqdm

from ...files import clean_leftovers
from ...errors import IntegrityError, MLPSurgeryError
from ...io import WEIGHTS, record, streamed_save
from ...layerwise import LayerStream, SourceRecord, map_large_allocations
from ...tensorfiles import SafetensorsWriter
from ...report import ends_stages, stage
from .config import CoreLockerConfig
from .folders import _place_key, check_lock_targets
from .keyfile import write_key_file
from .lock import check_entries, check_original, make_key
from .ranking import Ranking, extract_entries, fingerprint, restore_entries, tensor_hash, unit_count
from .units import unit_groups


def check_layerwise(cfg: CoreLockerConfig) -> None:
    """The settings the layer-sequential lock supports: a transformer's weight, neuron and head units (and norm
    channels, the scale indicator), not a plain network's filters."""
    if cfg.unit not in ("weight", "neuron", "head"):
        raise MLPSurgeryError(f"--layerwise locks a transformer's weight, neuron or head units, not --unit {cfg.unit}: "
                              "drop --layerwise")


@ends_stages
def lock_layerwise(folder: str | Path, out: str | Path, key_path: str | Path, cfg: CoreLockerConfig, dtype=None,
                   tokenizer=None, passphrase: str | None = None, overwrite: bool = False,
                   inputs: Iterable[str | Path | None] = (), source_name: str | None = None,
                   progress: bool = True) -> dict:
    """Lock the checkpoint in `folder` at cfg.ratio layer by layer: the locked folder in `out`, the key in
    `key_path` (what `lock_folder` writes for the whole model, bit for bit). Nothing is written unless everything
    succeeded; if only placing the key fails, the key is kept beside its path and the error says where."""
    cfg.validate()
    check_layerwise(cfg)
    out, key_path, folder = Path(out), Path(key_path), Path(folder)
    check_lock_targets(out, key_path, overwrite, [*inputs, folder])
    map_large_allocations()  # freed selection pieces go back to the OS instead of piling up in the heap
    stream = LayerStream(folder, dtype=dtype)
    model = stream.model
    model._mlpsurgery_path = str(folder)
    inside = tuple(stream.prefixes)
    params = dict(model.named_parameters())

    stage(f"ranking the {cfg.unit} units by {cfg.indicator} ({cfg.scope}), reading each layer from {folder}", progress)
    groups = _stream_groups(stream, cfg)
    ranking = Ranking(groups, cfg.scope, cfg.ratio, ordered=False)  # only cfg.ratio is taken: no sort by score
    ranking.require_some(cfg.ratio, cfg.unit)
    extraction, n_units = ranking.take(cfg.ratio)
    n_eligible = ranking.n_units
    del ranking, groups

    names = list(model.state_dict(keep_vars=True))  # the order of tensor_hashes (state-dict order)
    before, after = stream.outside_names()
    state = model.state_dict()
    original: dict[str, str] = {}
    locked: dict[str, str] = {}
    values: dict[str, Tensor] = {}
    source = SourceRecord(stream, source_name)
    for n in before:
        source.add(n, state[n])
    for n in before + after:
        original[n] = tensor_hash(n, state[n])

    summary_keys = ("config", "units_extracted", "units_eligible", "locked_fingerprint", "original_fingerprint")
    staged = key_path.with_name(f"{key_path.name}.staged-{os.getpid()}-{secrets.token_hex(4)}")
    clean_leftovers(key_path)  # a half-written hidden copy of a key a killed run was staging
    extra: dict = {}  # the manifest's corelocker summary, known once the last layer is done (read on exit)
    try:
        with streamed_save(model, out, tokenizer=tokenizer, overwrite=overwrite, extra=extra,
                           inputs=[*inputs, key_path]) as tmp:
            writer = SafetensorsWriter(tmp / WEIGHTS, stream.layout(), metadata={"format": "pt", **stream.tied})
            for i in tqdm(range(stream.n_layers), desc="locking (layer by layer)", unit="layer",
                          disable=not progress):
                layer = stream.materialise(i)
                mine = stream.layer_state(i)
                for n, t in mine.items():
                    source.add(n, t)
                    original[n] = tensor_hash(n, t)
                values.update(extract_entries({stream.prefixes[i] + n: p for n, p in layer.named_parameters()},
                                              extraction))
                for n, t in mine.items():
                    locked[n] = tensor_hash(n, t)
                    writer.write(n, t)
                stream.release(i)
            for n in after:
                source.add(n, state[n])
            values.update(extract_entries({n: p for n, p in params.items() if not n.startswith(inside)},
                                          extraction))  # --include-io
            state = model.state_dict()
            for n in before + after:
                locked[n] = tensor_hash(n, state[n])
            for n, t in stream.resident_state().items():
                writer.write(n, t)
            writer.close()
            locked = {n: locked[n] for n in names}
            original = {n: original[n] for n in names}
            source.record()
            key = make_key(model, cfg, extraction, {n: values[n] for n in extraction}, n_units, n_eligible, locked,
                           fingerprint(original))
            header = key.header
            stage("writing the key and the locked model" + (" (sealing the key: scrypt takes a moment)"
                                                             if passphrase else ""), progress)
            # the key first (beside its place, 0600): one that cannot be written stops all
            key_size = write_key_file(staged, key, {n: p.numel() for n, p in model.named_parameters()}, passphrase)
            extra["corelocker"] = {k: header[k] for k in summary_keys}
    except BaseException:
        staged.unlink(missing_ok=True)  # no locked model was written, so this key unlocks nothing
        raise
    _place_key(staged, key_path, out, overwrite)
    weights = out / WEIGHTS
    return {
        "locked": str(out), "key": str(key_path), "encrypted": passphrase is not None, "config": asdict(cfg),
        "units_extracted": n_units, "units_eligible": header["units_eligible"], "entries": key.entries,
        "model_params": header["model_params"], "key_bytes": key_size,
        "model_bytes": weights.stat().st_size if weights.exists() else None,
        "locked_fingerprint": header["locked_fingerprint"], "layerwise": True,
        "dtype": str(stream.dtype).removeprefix("torch."),
    }


def _stream_groups(stream: LayerStream, cfg: CoreLockerConfig) -> list:
    """The unit groups of the checkpoint `stream` reads, their scores read from the files when the ranking asks."""
    model = stream.model
    inside = tuple(stream.prefixes)
    params = dict(model.named_parameters())

    @contextlib.contextmanager
    def visit(i: int):  # neuron, head and norm-channel scores: from layer i, read for the moment they take
        stream.materialise(i)
        try:
            yield
        finally:
            stream.release(i)

    groups = unit_groups(model, cfg, visit=visit)
    for g in groups:  # scores of a layer's matrix from the file (the skeleton's parameter is on the meta device)
        if cfg.unit == "weight" and cfg.indicator == "l1" and g.name.startswith(inside):
            g.scores = lambda name=g.name: stream._read(name, params[name]).abs().flatten().float()
    return groups


@ends_stages
def find_ratio_layerwise(folder: str | Path, cfg: CoreLockerConfig, sequences: list[Tensor], target: float,
                         tolerance: float | None = None, max_ratio: float = 0.5, iterations: int = 14, dtype=None,
                         block_len: int | None = None, max_tokens: int | None = 4096, bos_id: int | None = None,
                         progress: bool = True) -> dict:
    """`find_ratio` for a causal LM read one decoder layer at a time: the ratio whose perplexity on `sequences`
    (as `lm_utility` measures it) lands within `tolerance` of `target`. Each point of the bisection selects that
    ratio's units by the streaming selection (`Ranking(..., ordered=False)`: no ranking of `max_ratio` of the
    units kept in memory) and measures `perplexity_layerwise` with the units extracted in each layer as it is
    read (and in the parts outside the layers, restored after); the files are never changed. Returns the search
    as `RatioSearch.as_dict` gives it, with the original's and the chosen ratio's perplexity."""
    from ...measure.perplexity import default_block_len, is_causal_lm, perplexity_layerwise
    from .utility import Utility, search_ratio

    cfg.validate()
    check_layerwise(cfg)
    map_large_allocations()
    stream = LayerStream(Path(folder), dtype=dtype)
    model = stream.model
    if not is_causal_lm(model):
        raise MLPSurgeryError("--target-utility with --layerwise calibrates a causal LM's perplexity; for a "
                              "classifier drop --layerwise")
    inside = tuple(stream.prefixes)
    params = dict(model.named_parameters())
    resident = {n: p for n, p in params.items() if not n.startswith(inside)}
    groups = _stream_groups(stream, cfg)
    sizes = [len(g) for g in groups]

    def count(r: float) -> int:
        return unit_count(sizes, cfg.scope, r)

    block = block_len or default_block_len(model, 256)
    # the metric's name, direction, tolerance and description for search_ratio (as lm_utility's); `measure` measures
    utility = Utility(lambda m: float("nan"), "perplexity", False,
                      f"{max_tokens or 'all'} held-out tokens, windows of {block_len or 'up to 256'}")

    def measure(r: float) -> tuple[float, int]:
        extraction, n = ({}, 0) if count(r) == 0 else \
            Ranking(groups, cfg.scope, r, ordered=False).take(r)
        originals = extract_entries(resident, extraction)  # (--include-io)

        def locked(i: int) -> None:
            extract_entries({stream.prefixes[i] + k: p for k, p in stream.layers[i].named_parameters()}, extraction)

        try:
            ppl = perplexity_layerwise(stream, sequences, block_len=block, max_tokens=max_tokens, bos_id=bos_id,
                                       progress=progress, work=locked).ppl
        finally:
            restore_entries(resident, {k: extraction[k][0] for k in originals}, originals)
        return ppl, n

    stage(f"searching the ratio that brings perplexity to {target:g} on {utility.data}, layer by layer", progress)
    best, u_best, tol, curve = search_ratio(measure, count, sum(sizes), utility, target, tolerance, max_ratio,
                                            iterations, progress)
    return {"ratio": best, "utility": u_best, "within_tolerance": abs(u_best - target) <= tol, "target": target,
            "tolerance": tol, "curve": curve, "metric": "perplexity", "data": utility.data}


@ends_stages
def unlock_layerwise(locked: str | Path, key_path: str | Path, out: str | Path, passphrase: str | None = None,
                     dtype=None, overwrite: bool = False, progress: bool = False) -> dict:
    """`unlock_folder` layer by layer: each layer of the locked folder is read, its tensors checked against the
    key's hashes of the locked model, its entries restored, hashed again and written; the restored model's
    fingerprint must be the key's original one (and the one the locked folder recorded). Anything refused
    leaves nothing written (the output is built in a temporary folder swapped in only at the end)."""
    from ...io import read_manifest, verify_files
    from ...models import _tokenizer
    from .folders import _recorded_original, check_unlock_targets
    from .keyfile import read_key

    out, locked, key_path = Path(out), Path(locked), Path(key_path)
    check_unlock_targets(locked, key_path, out, overwrite)
    stage(f"reading the key {key_path}" + (" (unsealing: scrypt takes a moment)" if passphrase else ""), progress)
    key = read_key(key_path, passphrase)
    manifest = read_manifest(locked)
    if manifest.get("masks"):
        raise MLPSurgeryError(f"{locked} holds pruning masks, which the layer-sequential unlock does not stream; "
                              "drop --layerwise")
    stage(f"checking the files of {locked} against its manifest", progress)
    verify_files(locked, manifest)
    map_large_allocations()
    stream = LayerStream(locked, dtype=dtype if isinstance(dtype, torch.dtype) else None, verify=False)  # (just verified)
    model = stream.model
    if type(model).__name__ != key.header.get("model_class"):
        raise IntegrityError(f"{locked} holds a {type(model).__name__}, the key was made for a "
                             f"{key.header.get('model_class')}: this key does not belong to this model")
    cross_checked, recorded = _recorded_original(locked)
    if cross_checked:
        check_original(key, recorded, f"the locked folder {locked}")
    params = dict(model.named_parameters())
    check_entries(key, params)
    expected = key.header.get("locked_tensors", {})
    inside = tuple(stream.prefixes)
    names = list(model.state_dict(keep_vars=True))
    locked_h: dict[str, str] = {}
    restored_h: dict[str, str] = {}

    def check(n: str, t: Tensor) -> None:
        locked_h[n] = tensor_hash(n, t)
        if locked_h[n] != expected.get(n):
            raise IntegrityError(f"this key does not belong to this model, or the locked model was modified after "
                                 f"locking: tensor {n} differs from the locked model the key was made for; use the "
                                 "key written with this model")

    state = model.state_dict()
    resident = [n for n in names if not n.startswith(inside)]
    for n in resident:
        check(n, state[n])
    restore_entries({n: p for n, p in params.items() if not n.startswith(inside)}, key.positions, key.values)
    for n in resident:
        restored_h[n] = tensor_hash(n, state[n])
    stage("checking the key against the locked model, restoring, checking the original's fingerprint, layer by "
          "layer", progress)
    with streamed_save(model, out, tokenizer=_tokenizer(locked), overwrite=overwrite, inputs=[locked, key_path]) as tmp:
        writer = SafetensorsWriter(tmp / WEIGHTS, stream.layout(), metadata={"format": "pt", **stream.tied})
        for n, t in stream.resident_state().items():
            writer.write(n, t)
        for i in tqdm(range(stream.n_layers), desc="unlocking (layer by layer)", unit="layer", disable=not progress):
            layer = stream.materialise(i)
            mine = stream.layer_state(i)
            for n, t in mine.items():
                check(n, t)
            restore_entries({stream.prefixes[i] + n: p for n, p in layer.named_parameters()}, key.positions,
                            key.values)
            for n, t in mine.items():
                restored_h[n] = tensor_hash(n, t)
                writer.write(n, t)
            stream.release(i)
        writer.close()
        if set(locked_h) != set(expected):
            raise IntegrityError("this key does not belong to this model: it lists other tensors than the model holds; "
                                 "use the key written with this model")
        if fingerprint(restored_h) != key.header["original_fingerprint"]:
            raise IntegrityError("the key's values do not restore the original model (its fingerprint differs): the "
                                 "key was altered; use an intact copy of the key")
        record(model, "corelocker-unlock", {}, original_fingerprint=key.header["original_fingerprint"])
    return {"unlocked": str(out), "from": str(locked), "key": str(key_path), "entries_restored": key.entries,
            "original_fingerprint": key.header["original_fingerprint"], "check": key.check,
            "cross_checked": cross_checked, "layerwise": True}
