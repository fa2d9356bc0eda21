"""The saved folder's manifest (surgery.json): its format, its self-digest, and the checks `load` runs on it and
on the files it lists."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from .. import files
from ..errors import IntegrityError, MLPSurgeryError


FORMAT = "mlpsurgery"
FORMAT_VERSION = 2  # 2: every model-defining file checksummed, the manifest digests itself
MANIFEST = "surgery.json"
WEIGHTS = "model.safetensors"
MASKS = "masks.safetensors"  # pruning masks, apart from the weights (modules/masks.py)
# files that hold or point to weights: each one in a saved folder must be listed in its manifest (verify_files)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".index.json")


DTYPES = ("float32", "float16", "bfloat16", "float64")


def _digest(manifest: dict) -> str:
    """SHA-256 of the manifest's canonical JSON without its own digest: an edit of any field shows."""
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _edited(path: Path, what: str) -> IntegrityError:
    return IntegrityError(f"{path}: {what}; the manifest was edited or damaged. Restore the folder from the original "
                          "save, or save the model again")


def read_manifest(folder: str | Path) -> dict:
    """The folder's manifest, checked: its fields have the types mlpsurgery wrote, and (format 2) its own digest."""
    folder = Path(folder)
    path = folder / MANIFEST
    if not folder.exists():
        raise MLPSurgeryError(f"{folder} does not exist")
    if not folder.is_dir():
        raise MLPSurgeryError(f"{folder} is a file, not a model folder")
    if not path.exists():
        raise MLPSurgeryError(f"{folder} has no {MANIFEST}: it was not written by mlpsurgery.save "
                              "(a plain transformers folder loads with from_pretrained)")
    if not path.is_file():
        raise _edited(path, "is not a file")
    try:
        manifest = json.loads(path.read_bytes())
    except json.JSONDecodeError as e:
        raise IntegrityError(f"{path} is corrupted (not valid JSON: {e.msg} at line {e.lineno}); restore it from "
                             "the original save or save the model again") from None
    except (UnicodeDecodeError, RecursionError, OSError) as e:
        raise IntegrityError(f"{path} cannot be read as JSON ({type(e).__name__}); restore it from the original "
                             "save or save the model again") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise IntegrityError(f"{path} is not an mlpsurgery manifest (no \"format\": \"{FORMAT}\")")
    version = manifest.get("format_version", 0)
    if type(version) is not int or version < 1:
        raise _edited(path, f"format_version {version!r} is not a positive integer")
    if version > FORMAT_VERSION:
        raise IntegrityError(f"{path} has format version {version}; this mlpsurgery reads up to "
                             f"{FORMAT_VERSION}: upgrade mlpsurgery")
    required = ("model_class", "modules", "weights_sha256") + (("files", "manifest_sha256") if version >= 2 else ())
    for key in required:
        if key not in manifest:
            raise IntegrityError(f"{path} lacks {key!r}: the manifest is incomplete or was edited")
    if version >= 2 and manifest["manifest_sha256"] != _digest(manifest):
        raise _edited(path, "its contents do not match its own checksum (manifest_sha256)")
    if not isinstance(manifest["model_class"], str):
        raise _edited(path, "model_class is not a string")
    mods = manifest["modules"]
    if not isinstance(mods, list) or not all(
            isinstance(e, dict) and isinstance(e.get("path"), str) and isinstance(e.get("class"), str)
            and isinstance(e.get("config", {}), dict) for e in mods):
        raise _edited(path, "'modules' must be a list of {path, class, config} entries")
    if not isinstance(manifest.get("history", []), list):
        raise _edited(path, "'history' is not a list")
    if not isinstance(manifest.get("masks", []), list) or not all(isinstance(n, str) for n in manifest.get("masks", [])):
        raise _edited(path, "'masks' must be a list of parameter names")
    if manifest.get("dtype", "float32") not in DTYPES:
        raise _edited(path, f"dtype {manifest.get('dtype')!r} is not one of {', '.join(DTYPES)}")
    listed = manifest.get("files", {WEIGHTS: manifest["weights_sha256"]})
    if not isinstance(listed, dict) or not all(isinstance(k, str) and isinstance(v, str) and "/" not in k
                                               and k not in ("", ".", "..") for k, v in listed.items()):
        raise _edited(path, "'files' must map file names to SHA-256 digests")
    return manifest


def _weight_files(folder: Path) -> list[str]:
    """The files in `folder` that hold (or point to) weights a reader could take: every safetensors, PyTorch or
    GGUF file, every index of shards, and every file such an index names."""
    names = {p.name for p in folder.iterdir() if p.name.endswith(WEIGHT_SUFFIXES) and not p.is_dir()}
    for index in sorted(n for n in names if n.endswith(".index.json")):
        try:
            weight_map = json.loads((folder / index).read_bytes()).get("weight_map", {})
            names.update(str(v) for v in weight_map.values())
        except (OSError, UnicodeDecodeError, ValueError, RecursionError, AttributeError, TypeError):
            pass  # not listed, so refused below as it is
    return sorted(names)


def verify_files(folder: Path, manifest: dict) -> None:
    """Every file the manifest lists is present and unchanged; the weights are checked against weights_sha256
    whatever `files` says, and (format 2, which lists every file it wrote) every weights file in the folder, and
    every file a safetensors index there names, must be listed: removing a file from `files` (and re-signing the
    manifest) does not switch its check off."""
    listed = dict(manifest.get("files", {WEIGHTS: manifest["weights_sha256"]}))
    if listed.setdefault(WEIGHTS, manifest["weights_sha256"]) != manifest["weights_sha256"]:
        raise _edited(Path(folder) / MANIFEST, f"its 'files' entry for {WEIGHTS} and its weights_sha256 differ")
    if manifest.get("format_version", 1) >= 2:
        unlisted = [n for n in _weight_files(Path(folder)) if n not in listed]
        if unlisted:
            raise IntegrityError(f"{Path(folder) / unlisted[0]} holds weights but is not listed in {MANIFEST}: the "
                                 "file was added or the manifest edited. Remove the file, or restore the folder from "
                                 "the original save")
    for name, digest in listed.items():
        path = folder / name
        if not path.exists():
            raise IntegrityError(f"{folder} has no {name}; the save was incomplete or the file was removed")
        if not path.is_file():
            raise IntegrityError(f"{path} is not a file; restore the folder from the original save")
        if files.sha256_file(path) != digest:
            raise IntegrityError(f"{path} does not match the checksum in {MANIFEST}: the file was modified or "
                                 "truncated; restore it, or save the model again")
