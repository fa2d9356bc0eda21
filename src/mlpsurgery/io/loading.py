"""Reading a folder back: the stock model rebuilt with the manifest's module replacements (an allowlist), shapes
checked against the weights' header before anything is allocated, weights loaded with strict key checks."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
from torch import nn

from ..checkpoints import read_saved_config as read_config  # (a saved folder's config; defined below io)
from ..errors import IntegrityError
from ..modules import build
from ..modules.masks import load_mask, restore_masks
from .manifest import MANIFEST, MASKS, WEIGHTS, read_manifest, verify_files


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
