"""Layer-sequential processing: a model far larger than RAM, one decoder layer at a time.

A one-shot method (pruning, ...) touches one layer at a time and needs, for that layer, only its weights and
the calibration activations that reach it. `LayerStream` holds the model as a skeleton (every parameter on
the meta device, built from config.json) with the parts outside the layers (embeddings, final norm, head)
read in, and materialises decoder layer i from the (sharded) safetensors files only while it is worked on:

    stream = LayerStream(folder, dtype=torch.bfloat16)
    acts = stream.layer_inputs(blocks)           # the embeddings' output + what each layer is called with
    for i in range(stream.n_layers):
        layer = stream.materialise(i)            # read from disk, in the working dtype
        ...                                      # the method's work on this layer, hooks on its linears
        acts = stream.run(i, acts)               # its outputs: the next layer's inputs
        writer.write_layer(...); stream.release(i)

A folder mlpsurgery wrote is streamed as `io.load` reads it (manifest and file digests checked, the structure it
records rebuilt on the meta device, its history and source carried), so the layer-by-layer commands chain (one's
output is the next one's input); a folder holding pruning masks is refused.

Each layer is called exactly as the model's own forward calls it (the arguments are recorded once from a pass
through the model with every layer a recorder), so a layer-sequential result equals the whole-model one bit
for bit where the arithmetic is the same. The output is streamed into one safetensors file
(`SafetensorsWriter`): its header is known from the skeleton's shapes before any layer is read, each tensor is
written at its offset once its layer is done. Peak memory: the resident parts, one layer (and its copy being
written), the activations in and out (on disk past `max_memory_gb`), the method's per-layer statistics.

On a GPU (`device`): the resident parts live on it, each layer is read into host memory and moved there while it
is worked on, and the activations between layers stay in host memory (or on disk), each batch moved to the device
for its run and back: the device holds the embeddings and head, one layer and one batch, however deep the model.
What leaves the stream -- a layer's tensors for the output file and the source fingerprint, the resident parts --
is handed out in host memory (`layer_state`, `resident_state`, `outside_state`), so files and fingerprints are
the CPU run's.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor, nn

from .checkpoints import config_dtype
from .errors import MLPSurgeryError
from .resources import trim_heap
from .tensorfiles import LazyCheckpoint, SafetensorsAppender, header_reserve, shared_names

GiB = 2**30


class _StopRecording(Exception):
    pass


@dataclass
class Activations:
    """The hidden states entering one layer, one tensor per calibration batch, in RAM or memory-mapped files;
    `calls[b]` is what the model passes the layer beside the hidden states for batch b (masks, positions)."""

    hidden: list[Tensor]
    calls: list[list[tuple[tuple, dict]]] = field(repr=False)  # [layer][batch] -> (args, kwargs)


def digest_chain(h: str, *parts) -> str:
    """h extended by parts: the digest of everything that reaches a layer of a stream (the data, the parts outside
    the layers, every layer before it), which a resumed capture or finished layer must match."""
    return hashlib.sha256("|".join([h, *map(str, parts)]).encode()).hexdigest()


def map_large_allocations(threshold: int = 1 << 20) -> None:
    """glibc: serve every allocation of `threshold` bytes or more by its own memory map, returned to the OS when
    freed (what MALLOC_MMAP_THRESHOLD_=1048576 does). By default the threshold adapts upwards to 32 MB, and the
    freed pieces of a selection over gigabytes of scores stay in the heap between the long-lived ones: CoreLocker's
    global ranking of a 2 B model peaked 2 GB higher (docs/notes/memory.md). A no-op elsewhere."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, threshold)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


def resolve_dtype(config, dtype) -> torch.dtype:
    """The working dtype: a torch dtype as given, 'auto' -> the checkpoint's (config.json), None -> float32."""
    if dtype is None:
        return torch.float32
    if dtype == "auto":
        return config_dtype(config) or torch.float32
    return dtype


class LayerStream:
    """A transformers checkpoint held as a skeleton whose decoder (encoder) layers are read one at a time."""

    def __init__(self, folder: Path, dtype=None, task: str = "auto", max_memory_gb: float | None = None,
                 spill_dir: Path | None = None, ckpt: LazyCheckpoint | None = None, verify: bool = True,
                 device: str | torch.device | None = None):
        """device: where each layer (and the resident parts) computes (the module docstring); the CPU by default.
        ckpt: the folder's checkpoint, where the caller has already opened it (its headers are read once).
        A folder mlpsurgery wrote is read as `io.load` reads it: its manifest checked (and, unless verify=False
        because the caller just did, every file against its digest), the structure it records rebuilt (replaced
        modules, narrowed layers), its dtype the default, its history and source carried; `self.manifest` holds it
        (None for a stock checkpoint). One with pruning masks is refused (their buffers are not streamed). A stock
        checkpoint's config.json is checked against its weight files' headers first (checkpoints.check_weights;
        not with verify=False, where the caller just did)."""
        from accelerate import init_empty_weights

        from .checkpoints import _model_class, check_weights, read_config
        from .io import MANIFEST, read_manifest, rebuild_saved
        from .sites import arch_spec

        self.folder = Path(folder)
        self.device = torch.device(device if device is not None else "cpu")
        self.ckpt = ckpt if ckpt is not None else LazyCheckpoint(self.folder)
        self.manifest = read_manifest(self.folder) if (self.folder / MANIFEST).exists() else None
        if self.manifest is None:
            config = read_config(self.folder)
            self.dtype = resolve_dtype(config, dtype)
            klass = _model_class(config, task)
            if verify:  # config.json against the weight files' headers, before the skeleton is built
                check_weights(self.folder, config, klass, memory=False)
            with init_empty_weights(include_buffers=False):  # parameters on meta; buffers (rotary tables) computed
                build = getattr(klass, "_from_config", None) or klass.from_config
                model = build(config, dtype=self.dtype)
            self._names = self._rename(model)
        else:
            manifest = self.manifest
            if manifest.get("masks"):
                raise MLPSurgeryError(f"{self.folder} holds pruning masks, which the layer-sequential mode does not "
                                      "stream; drop --layerwise")
            saved = getattr(torch, manifest.get("dtype", "float32"))
            self.dtype = saved if dtype is None or dtype == "auto" else dtype
            with init_empty_weights(include_buffers=False):  # as io.load rebuilds it, parameters on meta
                model = rebuild_saved(self.folder, manifest, dtype=self.dtype, verify=verify)
            config = model.config
            self._names = {k: k for k in self.ckpt.where}  # saved under the model's own names
        model.eval()
        if (self.folder / "generation_config.json").is_file():  # as from_pretrained reads it
            with contextlib.suppress(Exception):
                from transformers import GenerationConfig

                model.generation_config = GenerationConfig.from_pretrained(self.folder)
        self.model = model
        self.max_memory = None if max_memory_gb is None else max_memory_gb * GiB
        self.spill_dir = spill_dir
        self.disk = False  # whether the activations live in memory-mapped files (set by layer_inputs)
        spec = arch_spec(config)
        base = getattr(model, "base_model", model)
        self.layers: nn.ModuleList = base.get_submodule(spec.layers)
        names = {id(m): n for n, m in model.named_modules()}
        self.prefixes = [names[id(layer)] + "." for layer in self.layers]
        self._prefix = getattr(model, "base_model_prefix", "") or ""
        self.n_layers = len(self.layers)
        # everything outside the layers is read now and stays
        inside = tuple(self.prefixes)
        model.tie_weights()  # on the meta device: which entries are one tensor
        state = model.state_dict(keep_vars=True)
        tied = shared_names(state)
        resident = {}  # name -> (its skeleton tensor, the name of its tied group the checkpoint holds)
        for n, t in state.items():
            if n.startswith(inside) or n in tied:
                continue
            # of a group of tied names the checkpoint holds one: transformers' files the tie's source (embed_tokens),
            # safetensors' save_model whichever it keeps (lm_head); every name of the group gets that tensor, so
            # tie_weights() finds its source loaded either way
            group = [n, *sorted(d for d, k in tied.items() if k == n)]
            held = next((g for g in group if self._key(g) is not None), n)
            for g in group:
                if not g.startswith(inside):
                    resident[g] = (t, held)
        missing = sorted({h for _, h in resident.values() if self._key(h) is None})
        if missing:
            raise MLPSurgeryError(f"{self.folder}: no tensor {missing[0]!r} in the checkpoint (of {len(missing)} "
                                  "missing); the layer-sequential mode reads every tensor from the files: drop --layerwise")
        read: dict[str, Tensor] = {}
        for t, h in resident.values():
            if h not in read:
                read[h] = self._read(h, t)
        model.load_state_dict({n: read[h] for n, (_, h) in resident.items()}, strict=False, assign=True)
        del read
        model.tie_weights()
        self.tied = shared_names(model.state_dict(keep_vars=True))
        if self.tied != tied:
            raise MLPSurgeryError(f"{self.folder}: the tied weights changed on loading ({tied} -> {self.tied}); "
                                  "drop --layerwise")
        left = [n for n, p in model.named_parameters(remove_duplicate=False)
                if p.is_meta and not n.startswith(inside)]
        if left:
            raise MLPSurgeryError(f"{self.folder}: {left[0]} was not found in the checkpoint nor tied to a tensor "
                                  "that was; drop --layerwise")
        self.resident_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values()
                                  if not t.is_meta)
        self.layer_bytes = [sum(p.numel() * p.element_size() for p in layer.state_dict().values())
                            for layer in self.layers]
        self._place(model)  # the resident parts and the buffers computed at construction (rotary tables)

    # -- names ------------------------------------------------------------------------------------------

    def _rename(self, model) -> dict[str, str]:
        """{model's name: checkpoint's name} through transformers' own renamings of legacy checkpoint keys
        (GPT-NeoX's embed_out -> lm_head, LayerNorm gamma / beta, ...); a checkpoint that needs a conversion beyond
        renaming (tensors merged or split on load) is refused."""
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming

        transforms = get_model_conversion_mapping(model)
        out = {}
        for key in self.ckpt.where:
            name = key
            for t in transforms:
                renamed, matched = t.rename_source_key(name)
                if matched is not None and not isinstance(t, WeightRenaming):
                    raise MLPSurgeryError(f"{self.folder}: tensor {key} is converted on loading ({type(t).__name__}), "
                                          "which the layer-sequential mode does not do; drop --layerwise")
                name = renamed
            out[name] = key
        return out

    def _key(self, name: str) -> str | None:
        """The checkpoint's name for model tensor `name` (after transformers' renamings; checkpoints of a bare
        model lack the head's prefix, and the other way round)."""
        names = self._names
        if name in names:
            return names[name]
        p = self._prefix + "."
        if self._prefix and name.startswith(p) and name[len(p):] in names:
            return names[name[len(p):]]
        if self._prefix and p + name in names:
            return names[p + name]
        return None

    def _read(self, name: str, like: Tensor) -> Tensor:
        key = self._key(name)
        if key is None:
            raise MLPSurgeryError(f"{self.folder}: no tensor {name!r} in the checkpoint; drop --layerwise")
        t = self.ckpt.get(key)
        if tuple(t.shape) != tuple(like.shape):
            raise MLPSurgeryError(f"{self.folder}: {key} is {tuple(t.shape)} in the checkpoint, config.json implies "
                                  f"{tuple(like.shape)}; the files do not match the config")
        return t.to(like.dtype) if t.is_floating_point() and like.is_floating_point() else t

    # -- layers -------------------------------------------------------------------------------------------

    def materialise(self, i: int) -> nn.Module:
        layer = self.layers[i]
        state = layer.state_dict(keep_vars=True)
        layer.load_state_dict({n: self._read(self.prefixes[i] + n, t) for n, t in state.items()},
                              strict=True, assign=True)
        self._place(layer)
        return layer

    def _place(self, module: nn.Module) -> None:
        """Every tensor of `module` that is not on the meta device onto self.device (a tied parameter stays one)."""
        if self.device.type == "cpu":
            return
        moved: dict[int, Tensor] = {}
        for mod in module.modules():
            for k, p in mod._parameters.items():
                if p is not None and not p.is_meta:
                    if id(p) not in moved:
                        moved[id(p)] = nn.Parameter(p.data.to(self.device), requires_grad=p.requires_grad)
                    mod._parameters[k] = moved[id(p)]
            for k, b in mod._buffers.items():
                if b is not None and not b.is_meta:
                    mod._buffers[k] = b.to(self.device)

    def host(self, t: Tensor) -> Tensor:
        """t in host memory (itself when the stream works on the CPU)."""
        return t.to("cpu")

    def to_device(self, t: Tensor) -> Tensor:
        """t on the stream's device (itself when it is there)."""
        return t.to(self.device)

    def release(self, i: int) -> None:
        """Layer i back to the meta device (its masks too: their names stay for the manifest)."""
        for mod in self.layers[i].modules():
            for k, p in mod._parameters.items():
                if p is not None and not p.is_meta:
                    mod._parameters[k] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
            for k, b in mod._buffers.items():
                if b is not None and not b.is_meta and k not in mod._non_persistent_buffers_set:
                    mod._buffers[k] = torch.empty_like(b, device="meta")
        trim_heap()

    def layer_state(self, i: int) -> dict[str, Tensor]:
        """Layer i's persistent tensors under their whole-model names, in host memory."""
        return {self.prefixes[i] + n: self.host(t) for n, t in self.layers[i].state_dict().items()}

    # -- activations --------------------------------------------------------------------------------------

    def check_memory(self, act_bytes: int, extra: int = 0, sets: int = 2) -> bool:
        """Whether the activations must go to disk to stay under max_memory (`sets` of them -- two: in and out --
        plus the resident parts, the largest layer twice -- read and being written -- and the method's `extra`);
        refuses when even that does not fit."""
        if self.max_memory is None:
            return False
        fixed = self.resident_bytes + 2 * max(self.layer_bytes) + extra
        if fixed + sets * act_bytes <= self.max_memory:
            return False
        if fixed > self.max_memory:
            raise MLPSurgeryError(f"--max-memory {self.max_memory / GiB:.2f} GiB is below what one layer needs "
                                  f"(about {fixed / GiB:.2f} GiB: the embeddings and head, one layer read and one "
                                  "being written, the method's statistics); raise it")
        return True

    def _store(self, t: Tensor, disk: bool, tag: str) -> Tensor:
        if not disk:
            return t
        if self.spill_dir is None:
            raise MLPSurgeryError("internal: activations must spill to disk but no folder was given")
        self.spill_dir.mkdir(parents=True, exist_ok=True)
        path = self.spill_dir / f"{tag}.bin"
        with open(path, "wb") as f:
            f.truncate(t.numel() * t.element_size())
        out = torch.from_file(str(path), shared=True, size=t.numel(), dtype=t.dtype).view(t.shape)
        out.copy_(t)
        return out

    def layer_inputs(self, data: Tensor | list[Tensor], batch_size: int = 8, extra_bytes: int = 0,
                     sets: int = 2) -> Activations:
        """Run the model's own forward over the calibration blocks `data` (N, T) with every layer replaced by a
        recorder: the first layer's hidden-state inputs, and the arguments the model passes each layer. data may
        also be a list of batches (each (B, T_b), lengths may differ), used as they are. sets: how many sets of
        activations of this size the method holds at once (`check_memory`)."""
        calls: list[list] = [[] for _ in range(self.n_layers)]
        hidden: list[Tensor] = []
        last = self.n_layers - 1
        batches = data if isinstance(data, list) else [data[b:b + batch_size] for b in range(0, len(data), batch_size)]
        tokens = sum(x.numel() for x in batches)

        def recorder(j, *args, **kwargs):
            h = kwargs.pop("hidden_states") if "hidden_states" in kwargs else args[0]
            args = args[1:] if args and args[0] is h else args
            calls[j].append((args, kwargs))
            if j == 0:
                kept = self.host(h.detach())
                if not hidden:  # the whole set's size from the first batch's: on disk from the first batch on, if
                    # it must be (holding the set in RAM first would pass the cap before the check)
                    self.disk = self.check_memory(tokens * kept.shape[-1] * kept.element_size(), extra_bytes, sets)
                hidden.append(self._store(kept, self.disk, f"in-{len(hidden)}"))
            if j == last:
                raise _StopRecording
            return h

        for j, layer in enumerate(self.layers):
            layer.forward = functools.partial(recorder, j)
        kw = self.call_kwargs()
        try:
            with torch.no_grad():
                for x in batches:
                    try:
                        self.model(input_ids=self.to_device(x), **kw)
                    except _StopRecording:
                        pass
        finally:
            for layer in self.layers:
                del layer.forward
        return Activations(hidden, calls)

    def run(self, i: int, acts: Activations, keep: bool = True, tag: str = "",
            keep_inputs: bool = False, until: type[Exception] | None = None) -> Activations | None:
        """Layer i (materialised) over every batch: the next layer's inputs (keep=False: only for the hooks on
        the layer, nothing kept). The inputs' files, if on disk, are removed once a kept run is done (unless
        keep_inputs). tag: a name prefix for the files of a second stream of activations beside the first (e.g.
        through replaced layers). until (keep=False only): the exception a hook on the layer raises once it has
        what it needs, ending that batch's pass there."""
        if until is not None and keep:
            raise MLPSurgeryError("internal: a pass that ends early has no output to keep")
        layer = self.layers[i]
        out = []
        with torch.no_grad():
            for b, h in enumerate(acts.hidden):
                args, kwargs = acts.calls[i][b]
                try:
                    y = layer(self.to_device(h), *args, **kwargs)
                except until or ():
                    continue
                self.tuple_out = isinstance(y, (tuple, list))  # the layers' output form (for `outputs`)
                if keep:
                    y = y[0] if isinstance(y, (tuple, list)) else y
                    out.append(self._store(self.host(y), self.disk, f"{tag}layer{i}-{b}"))
        if not keep:
            return None
        if self.disk and not keep_inputs:
            for b in range(len(acts.hidden)):
                (self.spill_dir / f"{'in' if i == 0 else f'{tag}layer{i - 1}'}-{b}.bin").unlink(missing_ok=True)
        return Activations(out, acts.calls)

    def outputs(self, batches: list[Tensor], fn, progress: bool = False, desc: str = "layers", work=None) -> list:
        """fn(b, output) for the model's own output (e.g. its logits) on each token batch (B, T_b), computed with one
        decoder layer in memory at a time: the batches' hidden states go through layer 0, 1, ... (each read, run
        and released in turn); then the model's forward runs once more per batch with every layer returning that
        batch's final hidden state, so that what follows the layers (final norm, head, soft-capping) is the
        model's own code. One batch's output is held at a time (fn reduces it: a causal LM's logits of 4 x 512
        tokens of a 49k vocabulary are 0.4 GB). work(i): called on layer i once it is read, before it runs (e.g. to
        change its weights; the files are untouched and the layer is released after)."""
        from tqdm.auto import tqdm

        acts = self.layer_inputs(list(batches))
        for i in tqdm(range(self.n_layers), desc=desc, unit="layer", disable=not progress):
            self.materialise(i)
            try:
                if work is not None:
                    work(i)
                acts = self.run(i, acts)
            finally:
                self.release(i)
        results = []
        for b, x in enumerate(batches):
            with self.past_layers(self.to_device(acts.hidden[b])), torch.no_grad():
                results.append(fn(b, self.model(input_ids=self.to_device(x), **self.call_kwargs())))
        return results

    @contextlib.contextmanager
    def past_layers(self, final: Tensor):
        """While open, every decoder layer returns `final` (a batch's last hidden state, from a run layer by layer),
        so that the model's own forward computes on it only what follows the layers: final norm, head, soft-capping,
        loss."""
        def last(*args, **kwargs):
            return (final,) if self.tuple_out else final

        for layer in self.layers:
            layer.forward = last
        try:
            yield
        finally:
            for layer in self.layers:
                del layer.forward

    def call_kwargs(self) -> dict:
        """What the model's forward is given beside the ids (no cache, where it has one)."""
        return {"use_cache": False} if getattr(self.model.config, "use_cache", None) is not None else {}

    # -- the output file ----------------------------------------------------------------------------------

    def layout(self, extra: dict[str, tuple[torch.dtype, tuple[int, ...]]] | None = None) -> dict:
        """Name -> (dtype, shape) of every tensor the saved model will hold (tied copies once), from the skeleton."""
        state = self.model.state_dict(keep_vars=True)
        out = {n: (t.dtype, tuple(t.shape)) for n, t in state.items() if n not in self.tied}
        out.update(extra or {})
        return out

    def outside_names(self) -> tuple[list[str], list[str]]:
        """The state-dict names before the layers and after them (embeddings; final norm and head), in state-dict
        order: a method that goes through the model layer by layer feeds order-dependent digests (the source
        fingerprint) before, between and after the layers with them."""
        inside = tuple(self.prefixes)
        names = list(self.model.state_dict(keep_vars=True))
        first = next(k for k, n in enumerate(names) if n.startswith(inside))
        last = max(k for k, n in enumerate(names) if n.startswith(inside))
        if any(not n.startswith(inside) for n in names[first:last + 1]):
            raise MLPSurgeryError("internal: the layers' tensors are not contiguous in the state dict")
        return names[:first], names[last + 1:]

    def resident_state(self) -> dict[str, Tensor]:
        """The parts outside the layers (tied copies once), in host memory."""
        inside = tuple(self.prefixes)
        return {n: self.host(t) for n, t in self.model.state_dict().items()
                if not n.startswith(inside) and n not in self.tied}

    def outside_state(self, names) -> dict[str, Tensor]:
        """These state-dict entries outside the layers (tied names included, as `outside_names` gives them), in
        host memory."""
        state = self.model.state_dict()
        return {n: self.host(state[n]) for n in names}

    def resident_fingerprint(self) -> str:
        """files.model_fingerprint of the parts outside the layers (embeddings, final norm, head), with the model's
        class and config: what tells two checkpoints' resident parts apart before any layer is read."""
        from .files import Fingerprint

        fp = Fingerprint(self.model)
        for name, t in self.resident_state().items():
            fp.add(name, t)
        return fp.hexdigest()


class SourceRecord:
    """The source a layer-by-layer output records. A stock checkpoint's is its fingerprint, fed with every tensor in
    state-dict order as it is read (what loading it whole records); a folder mlpsurgery wrote carries the source its
    manifest records (`LayerStream` set it), so nothing is hashed."""

    def __init__(self, stream: LayerStream, source_name: str | None = None):
        from .files import Fingerprint

        self.stream, self.name = stream, source_name or stream.folder.name
        self.fp = Fingerprint(stream.model) if stream.manifest is None else None

    def add(self, name: str, t: Tensor) -> None:
        if self.fp is not None:
            self.fp.add(name, t)

    def record(self) -> None:
        if self.fp is not None:
            self.stream.model._mlpsurgery_source = {"name": self.name, "fingerprint": self.fp.hexdigest()}


# --------------------------------------------------------------------------------------------------
# A method that rewrites the model one layer at a time


def rewrite(stream: LayerStream, out: str | Path, work, desc: str, tokenizer=None, overwrite: bool = False,
            inputs=(), source_name: str | None = None, progress: bool = True, finish=None, write: bool = True) -> None:
    """Write `stream`'s model to `out` as `save` writes it, one decoder layer at a time: layer i is read, handed to
    `work(i)` (which may replace its modules, or put another layer in `stream.layers[i]`: the file takes the shapes
    it leaves), appended to the weights file and released. The source fingerprint is the checkpoint's as read (what
    loading it whole records), or for a folder mlpsurgery wrote the source its manifest records; `finish()` runs on
    the skeleton, every layer done, before the manifest is written (the method records itself there). write=False:
    the same pass over the layers, nothing written (a torchrun rank other than the one that writes)."""
    from tqdm.auto import tqdm

    from .io import WEIGHTS, streamed_save

    if not write:
        for i in range(stream.n_layers):
            stream.materialise(i)
            work(i)
            stream.release(i)
        return
    model = stream.model
    model._mlpsurgery_path = str(stream.folder)
    first, last = stream.outside_names()
    source = SourceRecord(stream, source_name)
    for name, t in stream.outside_state(first).items():
        source.add(name, t)
    with streamed_save(model, out, tokenizer=tokenizer, overwrite=overwrite, inputs=inputs) as tmp:
        writer = SafetensorsAppender(tmp / WEIGHTS, header_reserve(stream.layout()))
        try:
            for name, t in stream.resident_state().items():
                writer.write(name, t)
            for i in tqdm(range(stream.n_layers), desc=desc, unit="layer", disable=not progress):
                stream.materialise(i)
                for name, t in stream.layer_state(i).items():
                    source.add(name, t)
                work(i)
                for name, t in stream.layer_state(i).items():
                    writer.write(name, t)
                stream.release(i)
        except BaseException:
            writer.abandon()  # the temporary folder goes with it
            raise
        writer.close({"format": "pt", **stream.tied})
        for name, t in stream.outside_state(last).items():
            source.add(name, t)
        source.record()
        if finish is not None:
            finish()
