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
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from . import __version__, files
from .errors import IntegrityError, MLPSurgeryError
from .modules import MODULES, build, module_config
from .modules.masks import load_mask, masked_parameters, masks_set_aside, restore_masks, unpack

FORMAT = "mlpsurgery"
FORMAT_VERSION = 2  # 2: every model-defining file checksummed, the manifest digests itself
MANIFEST = "surgery.json"
WEIGHTS = "model.safetensors"
MASKS = "masks.safetensors"  # pruning masks, apart from the weights (modules/masks.py)


# Folder rules (markers, atomic replacement, refusals) live in files.py; re-exported for the methods.
check_out, atomic_dir, sha256_file, write_text = files.check_out, files.atomic_dir, files.sha256_file, files.write_text
atomic_write_text = files.write_text


# --------------------------------------------------------------------------------------------------
# Structure diff against the stock architecture


def _stock(config, model_class: str) -> nn.Module:
    import transformers

    klass = getattr(transformers, model_class, None)
    if klass is None or not isinstance(klass, type) or not issubclass(klass, transformers.PreTrainedModel):
        raise IntegrityError(f"the manifest names model class {model_class!r}, which transformers does not have")
    with torch.device("meta"):
        return klass._from_config(config)


def _own_shapes(mod: nn.Module) -> dict[str, tuple]:
    return {n: tuple(p.shape) for n, p in mod.named_parameters(recurse=False)}


def replaced_modules(model: nn.Module) -> list[dict[str, Any]]:
    """Modules whose class (or own parameter shapes) differ from what the path would hold otherwise: what `load`
    must rebuild, in this order, before the weights fit. A replaced module's children are compared with a fresh
    build of it, so surgery inside it (a fused MLP whose projections were nested) is recorded too."""
    ref_of = dict(_stock(model.config, type(model).__name__).named_modules())
    out = []
    for path, mod in model.named_modules():
        ref = ref_of.get(path)
        if ref is not None and type(ref) is type(mod) and _own_shapes(ref) == _own_shapes(mod):
            continue
        name = type(mod).__name__
        if MODULES.get(name) is not type(mod):
            raise MLPSurgeryError(
                f"{path} is a {name}, which is not a registered mlpsurgery module; register it with "
                "@mlpsurgery.modules.register (and give it config()/from_config) so it can be saved and rebuilt")
        config = module_config(mod)
        out.append({"path": path, "class": name, "config": config})
        with torch.device("meta"):
            fresh = build(name, config)
        for sub, child in fresh.named_modules():  # what the rebuilt module's insides hold by themselves
            if sub:
                ref_of[f"{path}.{sub}"] = child
        for stale in [p for p in ref_of if p.startswith(path + ".") and p.removeprefix(path + ".")
                      not in dict(fresh.named_modules())]:
            del ref_of[stale]
    return out


def history(model: nn.Module) -> list[dict]:
    """The list of methods applied to this model (kept on the model between calls)."""
    return list(getattr(model, "_mlpsurgery_history", []))


def record(model: nn.Module, method: str, config: dict | None = None, **provenance) -> None:
    """Append one method application to the model's history (saved in the manifest)."""
    hist = getattr(model, "_mlpsurgery_history", [])
    hist.append({"method": method, "config": config or {}, "provenance": provenance})
    model._mlpsurgery_history = hist


def source_of(model: nn.Module) -> dict | None:
    """{"name", "fingerprint"} of the model this one was made from (format-1 manifests held a path: its name)."""
    src = getattr(model, "_mlpsurgery_source", None)
    if isinstance(src, str):
        return {"name": Path(src).name if "/" in src else src, "fingerprint": None}
    return src if isinstance(src, dict) else None


def loaded_from(model: nn.Module) -> str | None:
    """The local path this model was loaded from (kept in memory only, never written to a manifest): an input
    that nothing written from the model may be, hold or lie inside."""
    return getattr(model, "_mlpsurgery_path", None)


def source_spec(model: nn.Module) -> str | None:
    """A MODEL string that reloads the original, where its name is one (bundled and tiny models); else None."""
    src = source_of(model)
    name = (src or {}).get("name")
    if isinstance(name, str) and (name in ("smollm2", "minilm") or name.startswith("tiny:")):
        return name
    return None


def check_source(model: nn.Module, original: nn.Module, given: str) -> None:
    """Refuse an `original` that is not the model `model` was made from (when the manifest recorded it)."""
    want = (source_of(model) or {}).get("fingerprint")
    have = (source_of(original) or {}).get("fingerprint")
    if want and have and want != have:
        raise MLPSurgeryError(f"{given} is not the model this one was made from ({(source_of(model) or {}).get('name')}, "
                              "by its weights' fingerprint); give the original model")


# --------------------------------------------------------------------------------------------------
# Save / load


DTYPES = ("float32", "float16", "bfloat16", "float64")


def _digest(manifest: dict) -> str:
    """SHA-256 of the manifest's canonical JSON without its own digest: an edit of any field shows."""
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def save(model: nn.Module, out: str | Path, tokenizer=None, overwrite: bool = False,
         extra: dict | None = None, inputs=()) -> Path:
    """Write `model` (with any surgery) to folder `out` atomically. Returns the folder.

    inputs: paths the model was made from (model folder, data, key); `out` may not be, hold or lie inside one.
    Every file that defines the model (config, weights, generation config, masks, generated modeling code) is
    listed in the manifest with its SHA-256, and the manifest carries a digest of itself: `load` refuses a
    folder where any of them changed. A structure that is not stock also gets generated modeling code, so that
    transformers alone loads the folder with trust_remote_code=True (standalone.py).
    """
    from .tensorfiles import SafetensorsWriter

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
    from .tensorfiles import SafetensorsWriter, shared_names

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
    from . import standalone

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


def rebuild(config, model_class: str, modules: list[dict], weights: Path | None = None,
            dtype: torch.dtype | None = None) -> nn.Module:
    """The stock model with the manifest's module replacements, weights uninitialised. With `weights`, every
    replacement is first built on the meta device and its tensor shapes checked against the file's header, so a
    manifest that asks for other (or absurd) sizes is refused before anything is allocated. With `dtype`, the
    stock model is built in it as transformers builds it (`_from_config(dtype=)`: buffers it computes in float32,
    such as the rotary frequencies, stay float32, as `from_pretrained` keeps them) and the replacements cast to
    it."""
    import transformers

    klass = getattr(transformers, model_class, None)
    if klass is None or not isinstance(klass, type) or not issubclass(klass, transformers.PreTrainedModel):
        raise IntegrityError(f"the manifest names model class {model_class!r}, which transformers does not have")
    if weights is not None:
        _check_shapes(config, klass, modules, weights)
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # older transformers
        no_init_weights = contextlib.nullcontext
    with no_init_weights():
        model = klass._from_config(config, **({"dtype": dtype} if dtype is not None else {}))
    model.tie_weights()  # no_init_weights also skips the tying that init would do
    for entry in modules:
        owner, name = _owner(model, entry)
        mod = build(entry["class"], entry.get("config", {}))
        setattr(owner, name, mod if dtype is None else mod.to(dtype))
    return model


def _owner(model: nn.Module, entry: dict) -> tuple[nn.Module, str]:
    try:
        parent, _, name = entry["path"].rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        getattr(owner, name)
    except (AttributeError, KeyError, TypeError):
        raise IntegrityError(f"the manifest replaces {entry.get('path')!r}, which this model does not have") from None
    return owner, name


def _check_shapes(config, klass, modules: list[dict], weights: Path) -> None:
    from safetensors import safe_open

    try:
        with safe_open(str(weights), framework="pt") as f:
            shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except Exception as e:  # noqa: BLE001 - a damaged header of any kind
        raise IntegrityError(f"{weights} is damaged ({type(e).__name__}: {e}); restore it or save the model again") \
            from None
    with torch.device("meta"):
        skeleton = klass._from_config(config)
        for entry in modules:
            owner, name = _owner(skeleton, entry)
            mod = build(entry["class"], entry.get("config", {}))
            setattr(owner, name, mod)
            for key, t in mod.state_dict().items():
                full = f"{entry['path']}.{key}"
                if full in shapes and shapes[full] != tuple(t.shape):
                    raise IntegrityError(f"the manifest builds {full} as {tuple(t.shape)}, but {weights.name} holds "
                                         f"{shapes[full]}: the manifest was edited")
    wanted = {k: tuple(v.shape) for k, v in skeleton.state_dict().items()}
    odd = sorted(k for k in wanted if k in shapes and wanted[k] != shapes[k])
    if odd:
        raise IntegrityError(f"{weights.name} does not fit the structure in {MANIFEST}: {odd[0]} is "
                             f"{shapes[odd[0]]}, the model needs {wanted[odd[0]]}")


def verify_files(folder: Path, manifest: dict) -> None:
    """Every file the manifest lists is present and unchanged."""
    listed = manifest.get("files", {WEIGHTS: manifest["weights_sha256"]})
    for name, digest in listed.items():
        path = folder / name
        if not path.exists():
            raise IntegrityError(f"{folder} has no {name}; the save was incomplete or the file was removed")
        if not path.is_file():
            raise IntegrityError(f"{path} is not a file; restore the folder from the original save")
        if files.sha256_file(path) != digest:
            raise IntegrityError(f"{path} does not match the checksum in {MANIFEST}: the file was modified or "
                                 "truncated; restore it, or save the model again")


def read_config(folder: Path):
    """The folder's config as the stock config class of its architecture (a folder with generated modeling code
    has config.json's model_type `mlpsurgery_<type>`: mlpsurgery reads the stock type and never runs that code)."""
    from transformers import CONFIG_MAPPING

    from .standalone import stock_config_dict

    path = folder / "config.json"
    try:
        raw = stock_config_dict(json.loads(path.read_bytes()))
        return CONFIG_MAPPING[raw["model_type"]].from_dict(raw)
    except FileNotFoundError:
        raise IntegrityError(f"{folder} has no config.json; restore it from the original save") from None
    except (OSError, ValueError, KeyError, TypeError, UnicodeDecodeError, AttributeError) as e:
        raise IntegrityError(f"{path} cannot be read ({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}); "
                             "restore it from the original save") from None


def _load_masks(model: nn.Module, folder: Path, names: list[str]) -> None:
    if not names:
        return
    from safetensors import safe_open

    try:
        restore_masks(model, names)
    except (AttributeError, TypeError):
        raise IntegrityError(f"the manifest's masks name parameters this model does not have: {names[:4]}; it was "
                             "edited") from None
    def lacks(name: str) -> IntegrityError:
        return IntegrityError(f"{folder / MASKS} lacks the mask of {name} (or it has another shape); restore it")

    if not (folder / MASKS).is_file():
        raise lacks(names[0])
    try:
        with safe_open(str(folder / MASKS), framework="pt") as f:
            stored = set(f.keys())
            for name in names:  # one mask in memory at a time, bit-packed as it is put in
                if name not in stored:
                    raise lacks(name)
                try:
                    load_mask(model, name, f.get_tensor(name))
                except ValueError:
                    raise lacks(name) from None
    except IntegrityError:
        raise
    except Exception as e:  # noqa: BLE001 - safetensors' own errors for a damaged file
        raise IntegrityError(f"{folder / MASKS} is damaged ({type(e).__name__}); restore it") from None


def load_weights(model: nn.Module, weights: Path) -> tuple[list[str], list[str]]:
    """safetensors' `load_model(model, weights, strict=False)` a tensor at a time: each tensor read with pread(2)
    into memory of its own, copied into the model and dropped. `load_model` maps the file and reads it whole first,
    and the mapped pages it read stay resident until it is closed: loading a 2 B bfloat16 folder peaked at twice its
    weights (docs/memory.md). Returns (missing, unexpected) as `load_model` does: a name the file lacks is not
    missing when it shares its tensor with one the file holds (tied weights are saved once)."""
    from safetensors import safe_open

    state = model.state_dict()
    try:
        handle = safe_open(str(weights), framework="pt", backend="pread")
    except TypeError:  # safetensors before the pread backend: a memory map
        handle = safe_open(str(weights), framework="pt")
    loaded: set[int] = set()
    unexpected = []
    with handle as f, torch.no_grad():
        keys = list(f.keys())  # (the file's order, so `unexpected` comes in it)
        names = set(keys)
        for name in keys:
            if name not in state:
                unexpected.append(name)
                continue
            t, dst = f.get_tensor(name), state[name]
            if tuple(t.shape) != tuple(dst.shape):
                raise IntegrityError(f"{weights}: {name} is {tuple(t.shape)} in the file, the model's is "
                                     f"{tuple(dst.shape)}")
            dst.copy_(t)
            loaded.add(dst.data_ptr())
            del t
    missing = [n for n, t in state.items() if n not in names and (t.numel() == 0 or t.data_ptr() not in loaded)]
    return missing, unexpected


def rebuild_saved(folder: Path, manifest: dict, dtype: torch.dtype | None = None, verify: bool = True) -> nn.Module:
    """The model the folder `save` wrote describes, its weights not read: every file checked against the manifest
    (verify), the config read as the stock type, the recorded structure built in `dtype` (default: the dtype it was
    saved in) as transformers builds a model in a dtype, the manifest's history and source on it. `load` fills it;
    the layer-sequential mode (layerwise.LayerStream) builds it on the meta device and reads it layer by layer."""
    weights = folder / WEIGHTS
    if not weights.is_file():
        raise IntegrityError(f"{folder} has no {WEIGHTS} file; the save was incomplete")
    if verify:
        verify_files(folder, manifest)
    model = rebuild(read_config(folder), manifest["model_class"], manifest["modules"], weights=weights,
                    dtype=dtype or getattr(torch, manifest.get("dtype", "float32")))
    model._mlpsurgery_history = manifest.get("history", [])
    model._mlpsurgery_source = manifest.get("source")
    return model


def load(folder: str | Path, verify: bool = True, dtype: torch.dtype | None = None) -> nn.Module:
    """Rebuild a model written by `save`: stock architecture + recorded replacements + strict weights, built in
    `dtype` (default: the dtype it was saved in) as transformers builds a model in a dtype."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    model = rebuild_saved(folder, manifest, dtype=dtype, verify=verify)
    weights = folder / WEIGHTS
    try:
        missing, unexpected = load_weights(model, weights)
    except Exception as e:  # safetensors raises on corrupt headers / shape mismatches
        raise IntegrityError(f"{weights} could not be loaded into the rebuilt model: {e}") from None
    if missing or unexpected:
        raise IntegrityError(f"{weights} does not fit the structure in {MANIFEST}: missing {sorted(missing)[:8]}, "
                             f"unexpected {sorted(unexpected)[:8]}")
    _load_masks(model, folder, manifest.get("masks", []))
    model._mlpsurgery_path = str(folder)
    if (folder / "generation_config.json").is_file():
        with contextlib.suppress(Exception):
            from transformers import GenerationConfig

            model.generation_config = GenerationConfig.from_pretrained(folder)
    return model.eval()


# --------------------------------------------------------------------------------------------------
# Export to stock transformers


def _set_submodule(model: nn.Module, path: str, mod: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, name, mod)


def tree_copy(model: nn.Module) -> nn.Module:
    """A copy of the module tree whose parameters and buffers are `model`'s own tensors: the structure can be edited
    (modules swapped, buffers dropped) without touching `model`, and no weight is copied."""
    memo = {id(t): t for t in (*model.parameters(), *model.buffers())}
    return copy.deepcopy(model, memo)


def _dense_mlp(site) -> Any:
    """The dense-MLP form (`MLPWeights`) of a replaced MLP, or None where it has none."""
    mods = [m for m in site.modules() if not isinstance(m, nn.Identity) and any(True for _ in m.parameters())]
    return mods[0].to_mlp_weights() if len(mods) == 1 and hasattr(mods[0], "to_mlp_weights") else None


def _materialise(mod: nn.Module, device) -> None:
    """Storage for the tensors of `mod` still on the meta device (they are written next); the others stay."""
    for m in mod.modules():
        for group in (m._parameters, m._buffers):
            for k, t in group.items():
                if t is not None and t.is_meta:
                    v = torch.empty(t.shape, dtype=t.dtype, device=device)
                    group[k] = nn.Parameter(v, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else v


def to_stock(model: nn.Module, consume: bool = False) -> nn.Module:
    """The same function in the most stock form the structure allows (a new model; `model` is not touched).

    Nested and truncated-SVD linears become the dense linear of their shape (NestedLinear at its current rank);
    replaced MLPs that have a dense-MLP form (`to_mlp_weights`: fused, pruned, extracted) are written into stock
    MLP modules, the config's intermediate size set to the most common width and the other layers' linears
    resized; pruning masks are dropped (their zeros are in the weights). What has no stock form (DLR-Nets,
    attentions with fewer heads) stays. With nothing left over the result is a stock model that plain
    `from_pretrained` loads; otherwise `replaced_modules` of the result lists what `save` gives modeling code for.

    consume=True: the result is made of `model`'s own tensors (none copied) and each folded MLP is taken out of
    `model` once written, so the peak is the model plus one layer, not three models; `model` is left unusable
    (`export` of a folder it loaded itself). `to_stock(tree_copy(m), consume=True)` shares m's tensors and
    leaves m whole.
    """
    import transformers
    from accelerate import init_empty_weights

    from .sites import find_sites

    entries = replaced_modules(model)
    if not entries and not masked_parameters(model):
        return model
    src = model if consume else tree_copy(model)
    for path in masked_parameters(src):
        owner, attr = path.rpartition(".")[0], path.rpartition(".")[2]
        src.get_submodule(owner)._buffers.pop(attr + "_mask", None)
    for e in entries:
        mod = src.get_submodule(e["path"])
        if hasattr(mod, "to_dense"):
            _set_submodule(src, e["path"], mod.to_dense())
    sites = find_sites(src)
    folded_h: dict[int, int] = {}  # layer -> width of its dense form (computed again, one layer at a time, below)
    for s in sites.mlp:
        if s.replaced:
            w = _dense_mlp(s)
            if w is not None:
                folded_h[s.index] = w.h
            del w
    path_of = {id(mod): p for p, mod in src.named_modules()}
    folded_paths = {i: [path_of[id(m)] for m in sites.mlp[i].modules()] for i in folded_h}
    inside_folded = tuple(p + "." for ps in folded_paths.values() for p in ps)
    widths = [folded_h.get(s.index, s.h) for s in sites.mlp if s.index in folded_h or not s.replaced]
    config = copy_config(src.config)
    if widths:
        setattr(config, sites.spec.width_key, max(set(widths), key=lambda h: (widths.count(h), h)))
    param = next(src.parameters())
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # older transformers
        no_init_weights = contextlib.nullcontext
    with init_empty_weights(include_buffers=False), no_init_weights():  # parameters on meta; buffers computed
        new = getattr(transformers, type(src).__name__)._from_config(config)
    new.to(dtype=param.dtype)
    for m in new.modules():
        for k, b in m._buffers.items():
            if b is not None:
                m._buffers[k] = b.to(param.device)
    new.tie_weights()
    for e in replaced_modules(src):  # no stock form: the same module, in the same place
        if not e["path"].startswith(inside_folded) and not any(e["path"] in ps for ps in folded_paths.values()):
            mod = src.get_submodule(e["path"])
            _set_submodule(new, e["path"], mod if consume else copy.deepcopy(mod))
    # every other tensor of the stock shape: the model's own (consume) or a copy, one per tied group
    src_tensors = dict(src.named_parameters(remove_duplicate=False))
    src_tensors.update(src.state_dict(keep_vars=True))
    made: dict[int, Any] = {}

    def take(t, like):
        if id(t) not in made:
            v = t.detach() if not consume else t
            v = v.to(like.dtype) if v.dtype != like.dtype else (v if consume else v.clone())
            made[id(t)] = nn.Parameter(v, requires_grad=like.requires_grad) if isinstance(like, nn.Parameter) else v
        return made[id(t)]

    persistent = set(new.state_dict(keep_vars=True))
    with torch.no_grad():
        for mpath, mod in new.named_modules(remove_duplicate=False):
            for group in (mod._parameters, mod._buffers):
                for k, t in list(group.items()):
                    name = f"{mpath}.{k}" if mpath else k
                    if t is None or name.startswith(inside_folded):
                        continue
                    if (not t.is_meta) if group is mod._parameters else (name not in persistent):
                        continue  # a kept module's parameter; a computed buffer (rotary table)
                    s = src_tensors.get(name)
                    if s is not None and s.shape == t.shape:
                        group[k] = take(s, t)
    new_sites = find_sites(new)
    for s in new_sites.mlp:
        i = s.index
        old = sites.mlp[i]
        if i in folded_h:
            w = _dense_mlp(old)
        elif not old.replaced and s.h != old.h:  # untouched layer of another width than the config's
            w = old.read()
        else:
            continue
        for m in s.modules():
            _materialise(m, param.device)
        s.write(w)
        del w
        if consume:  # the layer's old MLP is no longer needed: its memory goes before the next layer's is made
            for p in folded_paths.get(i, ()):
                if any(True for _ in src.get_submodule(p).parameters()):
                    _set_submodule(src, p, nn.Identity())
    left = [n for n, t in (*new.named_parameters(), *new.named_buffers()) if t.is_meta]
    if left:
        raise MLPSurgeryError(f"internal: the stock model has no source for {left[:4]}; please report this model")
    new._mlpsurgery_history = history(model)
    new._mlpsurgery_source = source_of(model)
    if getattr(model, "generation_config", None) is not None:
        new.generation_config = copy.deepcopy(model.generation_config)
    return new.eval()


def copy_config(config):
    return type(config).from_dict(config.to_dict())


def export(src: str | Path | nn.Module, out: str | Path, tokenizer=None, overwrite: bool = False) -> Path:
    """Write the model in its most stock form (`to_stock`): a plain transformers folder (config.json +
    model.safetensors) where the structure allows; else a self-contained folder whose generated modeling code
    lets `from_pretrained(..., trust_remote_code=True)` build it (standalone.py), mlpsurgery.load as well."""
    inputs = [src] if isinstance(src, (str, Path)) else []
    check_out(out, overwrite, inputs=inputs)
    if isinstance(src, (str, Path)):
        from .models import _tokenizer

        folder = Path(src)
        model = load(folder)
        if tokenizer is None:
            tokenizer = _tokenizer(folder)
        stock = to_stock(model, consume=True)  # ours: built from its tensors, each folded MLP freed once written
    else:
        stock = to_stock(tree_copy(src), consume=True)  # the caller's tensors shared, nothing of theirs changed
    if replaced_modules(stock):
        return save(stock, out, tokenizer=tokenizer, overwrite=overwrite, inputs=inputs)
    with atomic_dir(out, overwrite=overwrite, inputs=inputs) as tmp:
        stock.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
    return Path(out)
