"""Save, load and export models that went through surgery.

A saved folder holds:
    config.json          the base model's config (a stock transformers config)
    generation_config.json   for models that generate
    model.safetensors    every tensor (shared / tied tensors stored once)
    surgery.json         the manifest: format version, library version, model class, the modules that
                         differ from the stock architecture (path, class, constructor config), the
                         history of methods applied (name, config, provenance: data, seed, steps), the
                         source model (a name and a fingerprint, never a local path), a SHA-256 of every
                         file above, and a digest of the manifest itself
    tokenizer files      when a tokenizer was given
    .mlpsurgery          the marker that says mlpsurgery wrote the folder (see files.py)

`load` rebuilds the stock model from config.json, replays the module replacements from the manifest
(only classes in the module registry can be named: an allowlist), then loads the weights with strict
key checking: a missing or unexpected tensor is an error, never a silently random layer.
`export` writes a folder that plain `AutoModel*.from_pretrained` loads, where the structure allows.
All writes go to a temporary sibling folder that is swapped into place, so a crash leaves no half model, and
only a folder mlpsurgery wrote is ever replaced (files.py).

Files: manifest.py (the manifest's format and checks), provenance.py (structure diff, history, source), saving.py
(save, streamed_save), loading.py (load, rebuild), exporting.py (to_stock, export).
"""

from .. import files
from .exporting import copy_config, export, to_stock, tree_copy
from .loading import load, load_weights, read_config, rebuild, rebuild_saved
from .manifest import DTYPES, FORMAT, FORMAT_VERSION, MANIFEST, MASKS, WEIGHTS, read_manifest, verify_files
from .provenance import check_source, history, loaded_from, record, replaced_modules, source_of, source_spec
from .saving import save, streamed_save, weights_writer

# Folder rules (markers, atomic replacement, refusals) live in files.py; re-exported for the methods.
check_out, atomic_dir, sha256_file, write_text = files.check_out, files.atomic_dir, files.sha256_file, files.write_text
atomic_write_text = files.write_text

__all__ = ["DTYPES", "FORMAT", "FORMAT_VERSION", "MANIFEST", "MASKS", "WEIGHTS", "atomic_dir", "atomic_write_text",
           "check_out", "check_source", "copy_config", "export", "history", "load", "load_weights", "loaded_from",
           "read_config", "read_manifest", "rebuild", "rebuild_saved", "record", "replaced_modules", "save",
           "sha256_file", "source_of", "source_spec", "streamed_save", "to_stock", "tree_copy", "verify_files",
           "weights_writer", "write_text"]
