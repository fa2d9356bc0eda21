"""FSDP2 (`torch.distributed.fsdp.fully_shard`) for a model that outgrows one process: sharding a model in place
(`shard`), reading one from its files into the shards a layer at a time (`load_sharded`, `ShardedSource`), copying
one into shards a layer at a time (`shard_copy`), and back (`unshard`, `drop`, `save_sharded`)."""

from __future__ import annotations

import contextlib
import copy
from pathlib import Path
from typing import Any, Callable

import torch
from torch import Tensor, nn

from ..errors import MLPSurgeryError
from .group import check_split, on_rank0, rank0_outcome, same_on_every_rank, world


def is_dtensor(t: Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def is_sharded(model: nn.Module) -> bool:
    """Whether `model` is sharded by `shard` (its parameters are split across the ranks)."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


_SKELETONS: dict[int, nn.Module] = {}  # id(sharded model) -> its structure before sharding, weights on meta


def shard(model: nn.Module, device: str | torch.device = "cpu") -> nn.Module:
    """Shard `model` in place across the ranks of the process group (FSDP2: one unit per decoder layer, the root
    holding the rest). Every rank must hold the same model. Returns the model."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    rank, size = world()
    if size == 1:
        raise MLPSurgeryError("sharding needs several processes: launch the command with torchrun --nproc-per-node N")
    if is_sharded(model):
        return model
    _one_dtype(model.parameters(), "the model")
    # the structure before sharding, with every parameter on the meta device (no memory): `unshard` fills it with
    # the trained weights and swaps it back in, so the caller's model object becomes the plain model again
    skeleton = copy.deepcopy(model, {id(p): _meta(p) for p in model.parameters()})
    device = torch.device(device)
    mesh = init_device_mesh(device.type, (size,))
    for layer in find_layers(model):  # a peft wrapper: its model's layers (with their adapters) are the units
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    _SKELETONS[id(model)] = skeleton
    return model


def _one_dtype(params, what: str) -> None:
    """Refuse trained parameters of several dtypes: FSDP2 reduce-scatters a unit's gradients as one buffer of one
    dtype. Frozen parameters may differ (it all-gathers a unit of mixed dtypes as bytes): LoRA's float32 adapters
    on a 16-bit model, as peft holds them."""
    dtypes = {p.dtype for p in params if p.requires_grad}
    if len(dtypes) > 1:
        raise MLPSurgeryError(f"{what} mixes trained parameter dtypes {sorted(map(str, dtypes))}; FSDP needs one: "
                              "load it with --dtype")


def load_sharded(spec: str | None, device: str | torch.device = "cpu",
                 work: Callable[[nn.Module, int], None] | None = None,
                 progress: bool = False, dtype: torch.dtype | None = None, hold: torch.dtype | None = None,
                 structure: Callable[[nn.Module], Any] | None = None):
    """MODEL (as `models.load_model` reads it) loaded straight into FSDP2 shards, as `shard` splits it: the files
    are read one decoder layer at a time (layerwise.LayerStream), layer i handed to `work(model, i)` (a surgery that
    may replace its modules; the other layers may be on the meta device), compared across the ranks and
    sharded before the next is read. structure(model): flags set on the whole model before any layer is read
    (requires_grad, gradient checkpointing: the layers' weights are on meta then, and a layer read keeps them).
    A rank's peak is its share of the model plus one whole layer (and the embeddings while they are read), instead
    of the whole model on every rank. Every rank calls it. A model the
    layer-by-layer reader cannot read (a tiny:ARCH model, no safetensors, a conversion on loading, modules kept in
    float32, pruning masks) is loaded whole as load_model loads it, `work` run on each layer, and left for `shard`.
    dtype: the dtype the files are read in (default: the working one, --dtype); what the recorded source fingerprint
    is of. hold: the dtype the model is then held in (each layer cast once fingerprinted; default: as read).
    Returns (models.Loaded, the LayerStream or None)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from tqdm.auto import tqdm

    from ..files import model_fingerprint
    from ..layerwise import LayerStream, SourceRecord
    from ..resources import trim_heap
    from ..models import DEFAULT_MODEL, Loaded, _tokenizer, checkpoint_folder, load_model, working_dtype

    rank, size = world()
    if size == 1:
        raise MLPSurgeryError("sharding needs several processes: launch the command with torchrun --nproc-per-node N")
    text = DEFAULT_MODEL if spec is None else str(spec)
    stream = None
    if not text.startswith("tiny:"):
        folder, source, name = checkpoint_folder(text)
        try:
            stream = LayerStream(folder, dtype=dtype if dtype is not None else working_dtype())
            if any(getattr(stream.model, k, None) for k in ("_keep_in_fp32_modules", "_keep_in_fp32_modules_strict")):
                stream = None
        except MLPSurgeryError:
            stream = None  # what the layer-by-layer reader refuses is loaded whole (load_model words any error)
    if stream is None:
        loaded = load_model(spec, dtype=dtype)
        loaded.model.to(device=device, dtype=hold)
        if structure is not None:
            structure(loaded.model)
        for i in range(len(find_layers(loaded.model)) if work is not None else 0):
            work(loaded.model, i)
        return loaded, None
    model = stream.model
    if text not in ("smollm2", "minilm"):
        model._mlpsurgery_path = str(Path(text).expanduser())
    if structure is not None:
        structure(model)
    record = SourceRecord(stream, name)  # the source fingerprint a whole load records, fed as the files are read
    first, last = stream.outside_names()
    state = model.state_dict()
    for n in first:
        record.add(n, state[n])
    device = torch.device(device)
    mesh = init_device_mesh(device.type, (size,))
    resident = [p for p in model.parameters() if not p.is_meta]
    plain: list[nn.Module] = []  # each layer as it was sharded, its weights on meta (for `unshard`)
    for i in tqdm(range(stream.n_layers), desc="loading into shards", unit="layer", disable=not progress):
        stream.materialise(i)
        for n, t in stream.layer_state(i).items():
            record.add(n, t)
        stream.layers[i].to(device=device, dtype=hold)  # the surgery runs where one process runs it
        if work is not None:
            work(model, i)
        layer = stream.layers[i].to(device)
        _one_dtype([*layer.parameters(), *(resident if hold is None else ())], f"layer {i} with the embeddings")
        same_on_every_rank(f"weights of layer {i} (after loading{' and surgery' if work else ''})",
                           model_fingerprint(layer))
        plain.append(copy.deepcopy(layer, {id(p): _meta(p) for p in layer.parameters()}))
        fully_shard(layer, mesh=mesh)
        trim_heap()
    for n in last:
        record.add(n, state[n])
    record.record()
    same_on_every_rank("embeddings, norms or head", stream.resident_fingerprint())
    _shard_root(model, plain, mesh, device, hold)
    return Loaded(model.eval(), _tokenizer(folder), source), stream


def _shard_root(model: nn.Module, plain: list[nn.Module], mesh, device, dtype: torch.dtype | None = None) -> None:
    """The last step of sharding a model whose decoder layers are sharded already: the rest (embeddings, norms,
    head) to the device (and `dtype`) and sharded as the root unit, and the skeleton `unshard` needs recorded: the
    model's structure with each layer as it was before sharding (`plain`), every parameter on meta."""
    from torch.distributed.fsdp import fully_shard

    holder, leaf = _layer_list(model)
    layers = holder._modules[leaf]
    try:  # the sharded layers swapped out meanwhile
        holder._modules[leaf] = nn.ModuleList()
        model.to(device=device, dtype=dtype)
        _one_dtype(model.parameters(), "the embeddings, norms and head")
        holder._modules[leaf] = nn.ModuleList(plain)
        skeleton = copy.deepcopy(model, {id(p): _meta(p) for p in model.parameters()})
    finally:
        holder._modules[leaf] = layers
    fully_shard(model, mesh=mesh)
    _SKELETONS[id(model)] = skeleton


def shard_copy(model: nn.Module, device: str | torch.device = "cpu",
               structure: Callable[[nn.Module], nn.Module] | None = None,
               work: Callable[[nn.Module, int], None] | None = None) -> nn.Module:
    """A sharded copy of `model` (which stays as it is), made one decoder layer at a time: the structure copied
    with its weights on the meta device, `structure(copy)` applied to it there (flags only: requires_grad,
    gradient checkpointing; it must not create weights), then each layer's weights cloned from `model`,
    `work(copy, i)` run on layer i (it may add weights to it: adapters; the other layers may be on meta) and the
    layer sharded before the next -- instead of a deep copy of the whole model sharded afterwards, which held the
    model twice on every rank. Every rank calls it with the same model."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    rank, size = world()
    if size == 1:
        raise MLPSurgeryError("sharding needs several processes: launch the command with torchrun --nproc-per-node N")
    _one_dtype(model.parameters(), "the model")
    device = torch.device(device)
    new = copy.deepcopy(model, {id(p): _meta(p) for p in model.parameters()})
    if structure is not None:
        new = structure(new)
    source = dict(model.named_parameters(remove_duplicate=False))
    paths = {id(m): n for n, m in new.named_modules()}
    clones: dict[int, nn.Parameter] = {}  # id(model's parameter) -> its clone (tied ones cloned once)

    def fill(module: nn.Module) -> None:
        prefix = paths[id(module)] + "." if paths[id(module)] else ""
        for name, p in list(module.named_parameters(remove_duplicate=False)):
            if not p.is_meta:  # filled already (a tie), or sharded (a layer, when the root is filled)
                continue
            src = source[prefix + name]
            if id(src) not in clones:
                clones[id(src)] = nn.Parameter(src.detach().to(device).clone(), requires_grad=p.requires_grad)
            owner, _, leaf = name.rpartition(".")
            (module.get_submodule(owner) if owner else module)._parameters[leaf] = clones[id(src)]

    mesh = init_device_mesh(device.type, (size,))
    layers = find_layers(new)
    plain: list[nn.Module] = []
    for i, layer in enumerate(layers):
        fill(layer)
        if work is not None:
            work(new, i)
            layer = layers[i]
        layer.to(device)
        plain.append(copy.deepcopy(layer, {id(p): _meta(p) for p in layer.parameters()}))
        fully_shard(layer, mesh=mesh)
    fill(new)
    _shard_root(new, plain, mesh, device)
    return new


class ShardedSource:
    """A model that every rank reads from its files into FSDP2 shards afresh for each use (`load_sharded`), holding
    in between only its structure with every weight on the meta device: what a command that trains several copies
    of a model (the attack suite: a fresh copy per run) keeps instead of the model whole on every rank. Made once on
    every rank: the first read gives `fingerprint` (the whole model's, each tensor gathered in turn) and `source`.
    Files changed meanwhile are refused, not trained on: every later read's source must equal the first's (a stock
    checkpoint's is the fingerprint of its tensors, recomputed as they are read), and a folder mlpsurgery wrote is
    checked against its manifest's file digests on every read."""

    def __init__(self, spec: str, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
                 progress: bool = False, hold: torch.dtype | None = None):
        """dtype, hold: as `load_sharded` takes them (read in, then held in)."""
        from ..files import model_fingerprint
        from ..io import source_of

        self.spec, self.device, self.dtype, self.hold, self.progress = spec, device, dtype, hold, progress
        self.loaded = self._read()  # (models.Loaded: its tokenizer and source; its model becomes the skeleton)
        model = self.loaded.model
        self.fingerprint = model_fingerprint(model)
        self.source = source_of(model)
        self.local_bytes = local_bytes(model.parameters())  # this rank's share of the weights, as read
        drop(model)
        self.skeleton = model  # the plain structure (config, modules, mlpsurgery's records), weights on meta

    def load(self, structure: Callable[[nn.Module], Any] | None = None,
             work: Callable[[nn.Module, int], None] | None = None) -> nn.Module:
        """A fresh sharded copy (every rank calls it): structure(model) and work(model, i) as `load_sharded` takes
        them (a model the layer reader cannot read is loaded whole, changed alike and then sharded)."""
        return self._read(structure, work).model

    def _read(self, structure=None, work=None):
        from ..io import source_of

        loaded, stream = load_sharded(self.spec, self.device, work=work, progress=self.progress, dtype=self.dtype,
                                      hold=self.hold, structure=structure)
        self.streamed = stream is not None
        del stream
        if not self.streamed:
            shard(loaded.model, self.device)
        if hasattr(self, "source") and source_of(loaded.model) != self.source:
            raise MLPSurgeryError(f"{self.spec} changed on disk while it was in use (its source fingerprint differs "
                                  "from the first reading); rerun on files that stay as they are")
        return loaded


def _meta(p: nn.Parameter) -> nn.Parameter:
    return nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)


def _layer_list(model: nn.Module) -> tuple[nn.Module, str]:
    """(the module holding the model's list of decoder layers, the list's attribute name)."""
    first = find_layers(model)[0]
    for mod in model.modules():
        for k, child in mod._modules.items():
            if isinstance(child, nn.ModuleList) and len(child) and child[0] is first:
                return mod, k
    raise MLPSurgeryError("internal: the layer list is not in the model")


def find_layers(model: nn.Module) -> nn.ModuleList:
    from ..sites import find_sites

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return find_sites(base).layers()


def release(model: nn.Module) -> None:
    """Forget a sharded model that is being dropped without unsharding it (its skeleton, kept for `unshard`)."""
    _SKELETONS.pop(id(model), None)


def drop(model: nn.Module) -> None:
    """Free a model's weights in place, sharded or not, without gathering anything (not a collective): the caller's
    object becomes the plain structure with every parameter on the meta device (a sharded model's shards and FSDP
    state go with it), e.g. a teacher no longer needed while the caller still holds it."""
    if not is_sharded(model):
        model.to("meta")
        return
    _become(model, _SKELETONS.pop(id(model)))


def _become(model: nn.Module, skeleton: nn.Module) -> None:
    """The caller's sharded object becomes the plain `skeleton`: its class and attributes are the skeleton's (the
    root's FSDP hooks and state go with the old attributes; the layers were deep-copied before sharding and never
    were FSDP)."""
    with contextlib.suppress(Exception):  # torch keeps a registry of composable state by module; drop ours
        from torch.distributed._composable_state import _module_state_mapping

        _module_state_mapping.pop(model, None)
    model.__class__ = skeleton.__class__
    model.__dict__ = skeleton.__dict__


def full_value(t: Tensor) -> Tensor:
    """A tensor's whole value: a sharded (FSDP) parameter gathered from every rank (a collective: every rank asks
    for the same tensors in the same order), any other tensor as it is."""
    return t.full_tensor() if is_dtensor(t) else t


def unshard(model: nn.Module, keep_on: int | None = None,
            sink: Callable[[str, Tensor], None] | None = None) -> nn.Module:
    """Undo `shard` (or `load_sharded`) in place: gather every parameter's full value (a collective: call it on
    every rank) and turn `model` back into the plain model holding them. keep_on=R: only rank R keeps the weights
    (the others' model is left on the meta device, to be dropped). sink: rank R hands each full parameter (tied
    ones once, under their first name) to sink(name, tensor) as it is gathered and keeps none of them (its model is
    left on meta too): the whole model is never in one process. What was set on the model while it was sharded is
    kept: mlpsurgery's records on the model, and plain values (ints, floats, strings, ...) set on its modules
    (an NSN rank). Returns the model."""
    if not is_sharded(model):
        return model
    skeleton = _SKELETONS.pop(id(model))
    rank, _ = world()
    if sink is not None and keep_on is None:
        raise MLPSurgeryError("internal: unshard with a sink needs keep_on (the rank that writes)")
    keep = (keep_on is None or keep_on == rank) and sink is None
    plain = dict(skeleton.named_parameters(remove_duplicate=False))
    full: dict[int, nn.Parameter] = {}
    with torch.no_grad():
        for name, p in model.named_parameters(remove_duplicate=False):
            if id(p) not in full:
                value = full_value(p).detach()
                if sink is not None and rank == keep_on:
                    sink(name, value)
                full[id(p)] = nn.Parameter(value.clone() if keep else torch.empty_like(value, device="meta"),
                                           requires_grad=p.requires_grad)
                del value
            owner, _, leaf = name.rpartition(".")
            target = skeleton.get_submodule(owner) if owner else skeleton
            if name not in plain:
                raise MLPSurgeryError(f"the sharded model gained parameter {name} while training; cannot unshard it")
            target._parameters[leaf] = full[id(p)]
    for k, v in model.__dict__.items():  # what mlpsurgery recorded while it was sharded (history, source)
        if k.startswith("_mlpsurgery_"):
            skeleton.__dict__[k] = v
    plain_modules = dict(skeleton.named_modules())
    for path, mod in model.named_modules():  # values set on the modules while sharded (an NSN rank, train/eval)
        twin = plain_modules.get(path)
        if twin is not None and twin is not mod:
            for k, v in mod.__dict__.items():
                if isinstance(v, _PLAIN) and k in twin.__dict__ and isinstance(twin.__dict__[k], _PLAIN):
                    twin.__dict__[k] = v
    _become(model, skeleton)  # the caller's object becomes the plain model
    return model


def save_sharded(model: nn.Module, out: str | Path, tokenizer=None, overwrite: bool = False, inputs=()) -> None:
    """`io.save` of a sharded model without gathering it whole anywhere: every rank calls it; each parameter is
    gathered in turn and rank 0 writes it into the weights file at once (the file byte for byte what `save`
    writes of the same model), then every rank's model is the plain structure with its weights on the meta device
    (to be dropped). A failure on rank 0 is raised on every rank once the gathers are done (nothing is written)."""
    from .. import io
    from ..tensorfiles import shared_names

    rank, _ = world()
    if not is_sharded(model):
        raise MLPSurgeryError("internal: save_sharded needs a sharded model (io.save saves a plain one)")
    state = model.state_dict(keep_vars=True)
    tied = shared_names(state)
    buffers = {n: t for n, t in state.items() if n not in tied and not isinstance(t, nn.Parameter)}
    stack = contextlib.ExitStack()

    def prepare():  # rank 0: the temporary folder and the weights file's header (a refusal ends every rank)
        tmp = stack.enter_context(io.streamed_save(model, out, tokenizer=tokenizer, overwrite=overwrite,
                                                   inputs=inputs))
        return io.weights_writer(state, tmp / io.WEIGHTS)

    writer = on_rank0(prepare)
    failure: list[BaseException] = []

    def write(name: str, t: Tensor) -> None:
        if not failure:  # after a failure rank 0 still takes part in the gathers the others make
            try:
                writer.write(tied.get(name, name), t)  # a tied tensor under the name the file keeps
            except BaseException as e:  # noqa: BLE001 - raised once the gathers are done
                failure.append(e)

    try:
        with stack:  # rank 0: on leaving, the manifest is written and the folder swapped in (removed on an error)
            unshard(model, keep_on=0, sink=write if rank == 0 else lambda name, t: None)
            if rank == 0:
                for name, t in buffers.items():
                    write(name, t)
                if failure:
                    writer.abandon()
                    raise failure[0]
                writer.close()
    except BaseException as e:  # noqa: BLE001 - told to the other ranks, then raised
        failure[:] = [e]
    rank0_outcome(failure[0] if failure else None, f"save {out}")


_PLAIN = (bool, int, float, str, type(None))

def rows(batch: Tensor | list, model: nn.Module) -> Tensor | list:
    """This rank's share of a step's batch while `model` is sharded (the batch unchanged otherwise): the global
    batch split in order into equal parts, so the ranks together see exactly one process's batch."""
    if not is_sharded(model):
        return batch
    rank, size = world()
    n = len(batch)
    check_split(n)
    per = n // size
    return batch[rank * per:(rank + 1) * per]

def local_bytes(params) -> int:
    """Bytes this rank holds of the given parameters (its shard of a sharded one)."""
    total = 0
    for p in params:
        t = p.to_local() if is_dtensor(p) else p
        total += t.numel() * t.element_size()
    return total
