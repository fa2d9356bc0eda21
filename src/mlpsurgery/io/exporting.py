"""Export to stock transformers: a replaced structure folded back to the stock modules where it can be
(`to_stock`), written as a plain transformers folder, or with generated modeling code where it cannot."""

from __future__ import annotations

import contextlib
import copy
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import MLPSurgeryError
from ..files import atomic_dir, check_out
from ..modules.masks import masked_parameters
from .loading import load
from .provenance import history, replaced_modules, source_of
from .saving import save


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

    from ..sites import find_sites

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
        from ..checkpoints import _tokenizer

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
