"""Writing a folder: `save` (the whole model) and `streamed_save` (a caller that writes the tensors itself, layer by
layer), both atomic, with the manifest and, for a structure that is not stock, generated modeling code."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch
from torch import nn

from .. import __version__, files
from ..errors import MLPSurgeryError
from ..files import atomic_dir, sha256_file
from ..modules.masks import masked_parameters, masks_set_aside, unpack
from .manifest import FORMAT, FORMAT_VERSION, MANIFEST, MASKS, WEIGHTS, _digest
from .provenance import history, loaded_from, replaced_modules, source_of


def save(model: nn.Module, out: str | Path, tokenizer=None, overwrite: bool = False,
         extra: dict | None = None, inputs=()) -> Path:
    """Write `model` (with any surgery) to folder `out` atomically. Returns the folder.

    inputs: paths the model was made from (model folder, data, key); `out` may not be, hold or lie inside one.
    Every file that defines the model (config, weights, generation config, masks, generated modeling code) is
    listed in the manifest with its SHA-256, and the manifest carries a digest of itself: `load` refuses a
    folder where any of them changed. A structure that is not stock also gets generated modeling code, so that
    transformers alone loads the folder with trust_remote_code=True (standalone.py).
    """
    from ..tensorfiles import SafetensorsWriter

    with streamed_save(model, out, tokenizer=tokenizer, overwrite=overwrite, extra=extra, inputs=inputs) as tmp:
        with masks_set_aside(model) as masks:
            _write_weights(model, tmp / WEIGHTS)
        if masks:  # bit-packed in memory, one boolean tensor each in the file: unpacked one at a time
            writer = SafetensorsWriter(tmp / MASKS, {n: (torch.bool, tuple(shape)) for n, (_, shape) in masks.items()})
            for n, (packed, shape) in masks.items():
                writer.write(n, unpack(packed, shape))
            writer.close()
    return Path(out)


def _write_weights(model: nn.Module, path: Path) -> None:
    """The model's state dict as safetensors' `save_model` writes it (tied copies once, under the alphabetically
    first name, the others named in the metadata), one tensor at a time and with the metadata in sorted order:
    save_model writes it in the order of a Rust hash map, which changes from run to run, so the same model gave
    files that differed byte-wise (and in the manifest's digests)."""
    state = model.state_dict(keep_vars=True)  # the parameters themselves: tied ones are one object
    writer = weights_writer(state, path)
    try:
        for n in writer.slots:
            writer.write(n, state[n].detach())
    except BaseException:
        writer.abandon()  # the temporary folder goes with it
        raise
    writer.close()


def weights_writer(state: dict, path: Path):
    """The SafetensorsWriter of the weights file of a model whose state dict (keep_vars=True: tied tensors are one
    object; sharded ones give their full shapes) is `state`: tied copies once, under the alphabetically first name,
    the others named in the metadata (`tensorfiles.shared_names`), as safetensors' save_model lays it out."""
    from ..tensorfiles import SafetensorsWriter, shared_names

    tied = shared_names(state)
    layout = {n: (t.dtype, tuple(t.shape)) for n, t in state.items() if n not in tied}
    return SafetensorsWriter(path, layout, {"format": "pt", **tied})


@contextlib.contextmanager
def streamed_save(model: nn.Module, out: str | Path, tokenizer=None, overwrite: bool = False,
                  extra: dict | None = None, inputs=()):
    """`save` for a caller that writes the tensors itself (the layer-sequential mode streams them layer by layer
    into WEIGHTS and MASKS of the yielded temporary folder, from a model whose layers are back on the meta
    device): on exit the config, generated code, manifest (from the model's structure, history and mask names)
    and tokenizer are added exactly as `save` adds them, and the folder is swapped into place."""
    from .. import standalone

    if not hasattr(model, "config"):
        raise MLPSurgeryError("save() needs a transformers model (with .config); for plain PyTorch models use "
                              "safetensors.torch.save_model")
    inputs = [*inputs, loaded_from(model)]
    with atomic_dir(out, overwrite=overwrite, inputs=inputs) as tmp:
        yield tmp
        if not (tmp / WEIGHTS).is_file():
            raise MLPSurgeryError(f"internal: no {WEIGHTS} was written")
        entries = replaced_modules(model)
        manifest = {
            "format": FORMAT, "format_version": FORMAT_VERSION, "library_version": __version__,
            "model_class": type(model).__name__, "model_type": model.config.model_type,
            "source": source_of(model), "modules": entries, "history": history(model),
            "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
            "masks": masked_parameters(model),
        }
        if extra:
            manifest["extra"] = extra
        model.config.save_pretrained(tmp)
        gen = getattr(model, "generation_config", None)
        if gen is not None and getattr(model, "can_generate", lambda: False)():
            gen.save_pretrained(tmp)
        if entries:
            standalone.write(tmp, model, entries)
        manifest["files"] = {p.name: sha256_file(p) for p in sorted(tmp.iterdir())
                             if p.is_file() and p.name not in (MANIFEST, files.MARKER)}
        manifest["weights_sha256"] = manifest["files"][WEIGHTS]
        # the digest is of what load will read: JSON turns int keys into strings and tuples into lists
        manifest = json.loads(json.dumps(manifest))
        manifest["manifest_sha256"] = _digest(manifest)
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
