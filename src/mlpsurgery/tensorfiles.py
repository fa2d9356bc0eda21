"""safetensors files read and written tensor by tensor, never whole in memory.

Reading (`LazyCheckpoint`): a checkpoint's tensors by name from one file or an index of shards, each read with
plain reads into memory of its own (a memory-mapped file keeps every page it read resident until it is closed).
Writing: `SafetensorsWriter` (the header fixed from known shapes, each tensor written at its offset in any
order), `SafetensorsAppender` (shapes known only as tensors come; the header written last into reserved space),
and `serialized` (the exact bytes of safetensors' `save`, as chunks, for a stream that must not be built in
memory whole: a CoreLocker key, sealed or not). Files are laid out as safetensors lays out its own (tensors by
dtype, then by name), so a file written here is byte for byte what `save_file` writes of the same tensors and
(at most one) metadata entry.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Iterator

import torch
from torch import Tensor

from .errors import MLPSurgeryError

_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
           torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
           torch.bool: "BOOL"}
_FROM_NAME = {v: k for k, v in _DTYPES.items()}


# --------------------------------------------------------------------------------------------------
# Reading: the checkpoint's tensors by name, from one file or an index of shards


class _SafetensorsFile:
    """One safetensors file read tensor by tensor with plain reads, not a memory map: the pages of a mapped file
    that were read count in the process's resident set until it is unmapped, so reading every layer of a mapped
    checkpoint would end with the whole checkpoint resident; read into memory, a layer's bytes go when it does."""

    def __init__(self, path: Path):
        self.path = path
        try:
            size = path.stat().st_size
            with open(path, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                if n > size - 8:
                    raise ValueError("header longer than the file")
                header = json.loads(f.read(n))
            self.base = 8 + n
            _, self.entries = _parse_header(header, size - self.base)
        except (OSError, ValueError, KeyError, TypeError, struct.error) as e:
            raise MLPSurgeryError(f"{path} cannot be read as safetensors ({type(e).__name__}: {e}); restore it") from None

    def get(self, name: str) -> Tensor:
        b, e, dtype, shape = self.entries[name]
        buf = bytearray(e - b)
        with open(self.path, "rb", buffering=0) as f:
            f.seek(self.base + b)
            if f.readinto(buf) != len(buf):
                raise MLPSurgeryError(f"{self.path}: {name} is cut short; restore the file")
        if not buf:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(buf, dtype=dtype).reshape(shape)


def _parse_header(header, data_size: int, whole: bool = False) -> tuple[dict, dict[str, tuple]]:
    """(metadata, {name: (begin, end, dtype, shape)}) of a parsed safetensors header whose data has `data_size`
    bytes; every tensor inside the data with the size its dtype and shape give. whole: the tensors also cover the
    data exactly, without gaps or overlaps (as safetensors' own reader demands of a file read whole). Raises
    ValueError, KeyError or TypeError for anything else."""
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object")
    entries = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        b, e = info["data_offsets"]
        dtype = _FROM_NAME[info["dtype"]]
        shape = info["shape"]
        if not all(type(v) is int for v in (b, e, *shape)) or any(v < 0 for v in shape):
            raise ValueError(f"tensor {name}: offsets and shape must be non-negative integers")
        if not 0 <= b <= e <= data_size or (e - b) != dtype.itemsize * _numel(shape):
            raise ValueError(f"tensor {name} lies outside the data or has the wrong size")
        entries[name] = (b, e, dtype, tuple(shape))
    if whole:
        end = 0
        for b, e, *_ in sorted(entries.values()):
            if b != end:
                raise ValueError("the tensors do not cover the data without gaps or overlaps")
            end = e
        if end != data_size:
            raise ValueError(f"the tensors cover {end} of the {data_size} data bytes")
    return header.get("__metadata__", {}), entries


def parse_bytes(buf: bytearray) -> tuple[dict, dict[str, Tensor]]:
    """(metadata, tensors) of a safetensors file held in `buf`, the tensors views of it (safetensors' `load`
    copies each: the file's bytes twice in memory). Checked as safetensors checks a file it loads (see
    `_parse_header`); raises ValueError (or KeyError, TypeError, struct.error) for a damaged one."""
    if len(buf) < 8:
        raise ValueError(f"{len(buf)} bytes, shorter than the header's length")
    (n,) = struct.unpack("<Q", bytes(buf[:8]))
    if n > len(buf) - 8:
        raise ValueError(f"its header claims {n} bytes, the file has {len(buf) - 8}")
    header = json.loads(bytes(buf[8:8 + n]))
    meta, entries = _parse_header(header, len(buf) - 8 - n, whole=True)
    tensors = {}
    for name, (b, e, dtype, shape) in entries.items():
        if e == b:
            tensors[name] = torch.empty(shape, dtype=dtype)
            continue
        t = torch.frombuffer(buf, dtype=dtype, count=(e - b) // dtype.itemsize, offset=8 + n + b)
        tensors[name] = (t.clone() if (8 + n + b) % dtype.itemsize else t).reshape(shape)  # aligned, or a copy
    return meta, tensors


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


class LazyCheckpoint:
    """The tensors of a transformers folder's safetensors file(s), by name, read one at a time."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        index = self.folder / "model.safetensors.index.json"
        single = self.folder / "model.safetensors"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                files = sorted(set(weight_map.values()))
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                raise MLPSurgeryError(f"{index} cannot be read ({type(e).__name__}); restore the checkpoint") from None
        elif single.is_file():
            weight_map, files = None, ["model.safetensors"]
        else:
            raise MLPSurgeryError(f"{self.folder} has no model.safetensors (or index of shards): the layer-sequential "
                                  "mode reads safetensors checkpoints; convert it (save_pretrained) or drop --layerwise")
        self._files = {name: _SafetensorsFile(self.folder / name) for name in files}
        if weight_map is None:
            weight_map = {k: files[0] for k in self._files[files[0]].entries}
        for k, name in weight_map.items():
            if k not in self._files[name].entries:
                raise MLPSurgeryError(f"{index}: {k} is not in {name}; restore the checkpoint")
        self.where = weight_map

    def __contains__(self, name: str) -> bool:
        return name in self.where

    @property
    def dtypes(self) -> set[torch.dtype]:
        """The dtypes the checkpoint's tensors are stored in."""
        return {e[2] for f in self._files.values() for e in f.entries.values()}

    def get(self, name: str) -> Tensor:
        return self._files[self.where[name]].get(name)


def checkpoint_layout(folder: Path) -> dict[str, tuple[torch.dtype, tuple[int, ...]]] | None:
    """{name: (dtype, shape)} of a transformers folder's weights, read without loading a tensor: the safetensors
    headers (one file or an index of shards), else a PyTorch checkpoint (pytorch_model.bin or its index of shards)
    mapped onto the meta device. None when the folder holds neither, or they cannot be read that way (the loader
    then words what is wrong with them)."""
    folder = Path(folder)
    if (folder / "model.safetensors.index.json").is_file() or (folder / "model.safetensors").is_file():
        ckpt = LazyCheckpoint(folder)  # (a damaged header is refused here, in one line)
        return {k: ckpt._files[f].entries[k][2:] for k, f in ckpt.where.items()}
    index, single = folder / "pytorch_model.bin.index.json", folder / "pytorch_model.bin"
    try:
        if index.is_file():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        elif single.is_file():
            files = [single.name]
        else:
            return None
        out = {}
        for name in files:
            state = torch.load(folder / name, map_location="meta", mmap=True, weights_only=True)
            out.update({k: (t.dtype, tuple(t.shape)) for k, t in state.items() if isinstance(t, Tensor)})
        return out
    except Exception:  # noqa: BLE001 - an old or damaged format: transformers reads it (and words its errors)
        return None


# --------------------------------------------------------------------------------------------------
# Writing: safetensors files filled tensor by tensor (the header fixed first, or written last)


def shared_names(state: dict[str, Tensor]) -> dict[str, str]:
    """{dropped name: kept name} for entries that are the same tensor object (tied weights), keeping the
    alphabetically first name of each group, as safetensors' save_model does; by identity, so it also works on
    meta tensors (which have no storage to compare)."""
    groups: dict[int, list[str]] = {}
    for name, t in state.items():
        groups.setdefault(id(t), []).append(name)
    out = {}
    for names in groups.values():
        keep, *rest = sorted(names)
        out.update({n: keep for n in rest})
    return out


# safetensors' own order of dtypes (its Dtype enum): a file lists its tensors by dtype, the last of these first, then
# by name
_ORDER = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.float16, torch.bfloat16, torch.int32, torch.float32,
          torch.float64, torch.int64)
Layout = dict[str, tuple[torch.dtype, tuple[int, ...]]]


def _plan(layout: Layout, metadata: dict[str, str] | None) -> tuple[bytes, dict[str, tuple[int, int, torch.dtype,
                                                                                          tuple[int, ...]]], int]:
    """(the file's first bytes: header length and header; each tensor's (offset, size, dtype, shape) in the data;
    the data's size) of a safetensors file holding tensors of `layout`, laid out as safetensors lays it out."""
    for name, (dtype, _) in layout.items():
        if dtype not in _DTYPES:
            raise MLPSurgeryError(f"{name}: dtype {dtype} cannot be stored in safetensors here")
    order = sorted(layout, key=lambda n: (-_ORDER.index(layout[n][0]), n))
    # as safetensors' save_file writes it, the metadata in sorted order (safetensors: its hash map's, which changes
    # from run to run)
    header: dict = {"__metadata__": dict(sorted(metadata.items()))} if metadata else {}
    slots = {}
    pos = 0
    for name in order:
        dtype, shape = layout[name]
        size = dtype.itemsize * _numel(shape)
        header[name] = {"dtype": _DTYPES[dtype], "shape": list(shape), "data_offsets": [pos, pos + size]}
        slots[name] = (pos, size, dtype, tuple(shape))
        pos += size
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw, slots, pos


def serialized_header(layout: Layout, metadata: dict[str, str] | None = None) -> bytes:
    """The first bytes (header length and header) of the safetensors file of `layout`'s tensors."""
    return _plan(layout, metadata)[0]


def tensor_bytes(t: Tensor) -> memoryview:
    """A tensor's bytes as a buffer (no copy for a contiguous CPU tensor): what is written, or hashed."""
    return memoryview(t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy())


def serialized(tensors: dict[str, Tensor], metadata: dict[str, str] | None = None) -> tuple[int, Iterator]:
    """What safetensors' `save(tensors, metadata)` returns, as (its length, its chunks in order: the header, then
    each tensor's own bytes), so that a writer or a cipher can stream it without the whole in memory."""
    prefix, slots, size = _plan({n: (t.dtype, tuple(t.shape)) for n, t in tensors.items()}, metadata)

    def chunks():
        yield memoryview(prefix)
        for name in slots:
            yield tensor_bytes(tensors[name])

    return len(prefix) + size, chunks()


class SafetensorsWriter:
    """A safetensors file written tensor by tensor in any order: the header (names, dtypes, shapes) is fixed at
    creation, each `write` puts one tensor's bytes at its offset, `close` refuses a file with a tensor missing.
    Tensors are laid out as safetensors itself lays them out (by dtype, then by name): the file is byte for byte
    what `save_file` writes of the same tensors (with one metadata entry at most: safetensors writes several in its
    hash map's order, which varies from run to run; here they are sorted, so the same tensors give the same bytes)."""

    def __init__(self, path: Path, layout: Layout, metadata: dict[str, str] | None = None):
        prefix, self.slots, size = _plan(layout, metadata)
        self.base = len(prefix)
        self.path = Path(path)
        self._f = open(self.path, "wb")
        self._f.write(prefix)
        self._f.truncate(self.base + size)
        self.pending = set(self.slots)

    def write(self, name: str, t: Tensor) -> None:
        if name not in self.slots:
            raise MLPSurgeryError(f"internal: {name} is not in the header of {self.path.name}")
        off, size, dtype, shape = self.slots[name]
        if t.dtype != dtype or tuple(t.shape) != shape:
            raise MLPSurgeryError(f"internal: {name} is {t.dtype} {tuple(t.shape)}, the header says {dtype} {shape}")
        self._f.seek(self.base + off)
        self._f.write(tensor_bytes(t))
        self.pending.discard(name)

    def abandon(self) -> None:
        """Close the file unfinished (its folder is being discarded)."""
        self._f.close()

    def close(self) -> None:
        if self._f.closed:
            return
        self._f.close()
        if self.pending:
            raise MLPSurgeryError(f"internal: {self.path.name} was closed with {len(self.pending)} tensors unwritten "
                                  f"({sorted(self.pending)[:3]})")


class SafetensorsAppender:
    """A safetensors file whose tensors' shapes are known only as they come (a layer that a method reshapes): each
    `write` appends one tensor's bytes; the header, which safetensors puts before the data, goes into `reserve`
    bytes kept free at the start and is written by `close`, padded with spaces (as safetensors pads its own to
    8 bytes). `header_reserve` sizes the space from the skeleton; a header that outgrows it is refused, never cut."""

    def __init__(self, path: Path, reserve: int):
        self.path = Path(path)
        self.base = reserve + (-reserve % 8)
        self.entries: dict[str, dict] = {}
        self.pos = 0
        self._f = open(self.path, "wb")
        self._f.truncate(self.base)

    def write(self, name: str, t: Tensor) -> None:
        if name in self.entries:
            raise MLPSurgeryError(f"internal: {name} written twice into {self.path.name}")
        if t.dtype not in _DTYPES:
            raise MLPSurgeryError(f"{name}: dtype {t.dtype} cannot be stored in safetensors here")
        data = tensor_bytes(t)
        self._f.seek(self.base + self.pos)
        self._f.write(data)
        self.entries[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape),
                              "data_offsets": [self.pos, self.pos + data.nbytes]}
        self.pos += data.nbytes

    def abandon(self) -> None:
        """Close the file without a header (its folder is being discarded)."""
        self._f.close()

    def close(self, metadata: dict[str, str] | None = None) -> None:
        if self._f.closed:
            return
        raw = json.dumps({"__metadata__": dict(sorted((metadata or {}).items())), **self.entries},
                         separators=(",", ":")).encode()
        try:
            if 8 + len(raw) > self.base:
                raise MLPSurgeryError(f"internal: the header of {self.path.name} ({len(raw)} bytes) outgrew the "
                                      f"{self.base - 8} reserved for it; please report this model")
            self._f.seek(0)
            self._f.write(struct.pack("<Q", self.base - 8) + raw + b" " * (self.base - 8 - len(raw)))
        finally:
            self._f.close()


def header_reserve(layout: dict[str, tuple[torch.dtype, tuple[int, ...]]]) -> int:
    """Header space for a file of `layout`'s tensors as a method may reshape them: twice the header they need with
    offsets of 20 digits (replacing each linear by two factors at most doubles the entries), plus 64 KiB."""
    big = 10**19
    header = {n: {"dtype": "BF16", "shape": list(s), "data_offsets": [big, big]} for n, (_, s) in layout.items()}
    return 2 * len(json.dumps(header, separators=(",", ":"))) + 65536


# --------------------------------------------------------------------------------------------------
# The skeleton and its layers
