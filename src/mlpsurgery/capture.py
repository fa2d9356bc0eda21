"""Record what each layer's MLP sub-block sees and produces on calibration batches.

For every chosen layer, the pair (x, y): x the residual stream entering the MLP sub-block, y = x + delta
what leaves it (see the sites package; for post-norm encoders y is taken before the outer LayerNorm). Rows are
tokens: x, y are (n_tokens, d).

Captures stream batch by batch into chunks, kept in memory or written to disk as one safetensors file
per chunk, so the corpus size is bounded by disk, not RAM. A disk capture is resumable: an interrupted
run keeps its finished chunks and a rerun with the same model, data and layers computes only the rest. Each chunk
on disk carries its size and SHA-256 (`<chunk>.sum.json`, checksums.py), checked when it is read back: a truncated,
edited or unchecksummed chunk (one written before checksums) is refused, never used.
The forward pass stops after the last chosen layer (nothing downstream is computed).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor, nn
from tqdm.auto import tqdm

from . import checksums, files, parallel
from .errors import IntegrityError, MLPSurgeryError
from .sites import find_sites


class _StopForward(Exception):
    pass


@dataclass
class Capture:
    """Per-layer (x, y) token rows, chunked. Chunks live in `memory` or as files under `root`."""

    layers: list[int]
    d: int
    root: Path | None = None
    memory: list[dict[str, Tensor]] = field(default_factory=list)
    n_chunks: int = 0
    tokens_per_chunk: list[int] = field(default_factory=list)

    @property
    def n_tokens(self) -> int:
        return sum(self.tokens_per_chunk)

    def chunk(self, k: int, layers: list[int] | None = None) -> dict[int, tuple[Tensor, Tensor]]:
        """Chunk k as {layer: (x, y)}, for the given layers (default all)."""
        layers = self.layers if layers is None else layers
        if self.root is None:
            data = self.memory[k]
            return {i: (data[f"x.{i}"], data[f"y.{i}"]) for i in layers}
        path = chunk_path(self.root, k)
        checksums.check(path, lambda: _fix(self.root))  # hashed once per process; then its size, time and inode
        try:
            with safe_open(path, framework="pt") as f:
                return {i: (f.get_tensor(f"x.{i}"), f.get_tensor(f"y.{i}")) for i in layers}
        except Exception as e:  # noqa: BLE001 - safetensors raises its own types for a damaged file
            raise IntegrityError(f"{path} cannot be read ({type(e).__name__}); {_fix(self.root)}") from None

    def keep(self, layers: list[int]) -> None:
        """Forget every other layer's rows (held in memory; a capture on disk only stops listing them)."""
        drop = [i for i in self.layers if i not in set(layers)]
        for chunk in self.memory:
            for i in drop:
                chunk.pop(f"x.{i}", None)
                chunk.pop(f"y.{i}", None)
        self.layers = [i for i in self.layers if i in set(layers)]

    def layer(self, i: int) -> tuple[Tensor, Tensor]:
        """All rows of one layer (concatenated over chunks): only for captures that fit in memory."""
        if self.root is None and self.n_chunks == 1:
            return self.memory[0][f"x.{i}"], self.memory[0][f"y.{i}"]  # no copy
        xs, ys = zip(*(self.chunk(k, [i])[i] for k in range(self.n_chunks)))
        return torch.cat(xs), torch.cat(ys)

    def consolidate(self) -> None:
        """Join an in-memory capture's chunks into one, layer by layer (one layer's rows held twice at a time), so
        that `layer` hands out its rows without copying them."""
        if self.root is not None or self.n_chunks <= 1:
            return
        one: dict[str, Tensor] = {}
        for name in list(self.memory[0]):
            one[name] = torch.cat([chunk.pop(name) for chunk in self.memory])
        self.memory = [one]
        self.tokens_per_chunk, self.n_chunks = [sum(self.tokens_per_chunk)], 1

    def relative_error(self, i: int, fn, batch: int = 4096) -> float:
        """sum ||fn(x) - y||^2 / sum ||y - x||^2 over all rows of layer i (1.0 = no better than identity)."""
        num = den = 0.0
        with torch.no_grad():
            for k in range(self.n_chunks):
                x, y = self.chunk(k, [i])[i]
                for s in range(0, len(x), batch):
                    xb, yb = x[s:s + batch].float(), y[s:s + batch].float()
                    num += (fn(xb) - yb).pow(2).sum().item()
                    den += (yb - xb).pow(2).sum().item()
        return num / max(den, 1e-30)


def open_capture(root: str | Path) -> Capture:
    """A finished capture folder (written by capture_mlp_io with out_dir) opened for reading."""
    root = Path(root)
    meta_path = root / "capture.json"
    if not meta_path.exists():
        raise MLPSurgeryError(f"{root} holds no capture (no capture.json)")
    meta = json.loads(meta_path.read_text())
    layers, n = meta["layers"], meta["n_chunks"]
    missing = [k for k in range(n) if not chunk_path(root, k).exists()]
    if missing:
        raise MLPSurgeryError(f"{root} is an unfinished capture ({len(missing)} of {n} chunks missing); "
                              "rerun the command that made it to finish it")
    sizes = []
    d = 0
    for k in range(n):
        path = chunk_path(root, k)
        checksums.check(path, lambda: _fix(root), full=False)  # size and record here; the contents when a chunk is read
        try:
            with safe_open(path, framework="pt") as f:
                shape = f.get_slice(f"x.{layers[0]}").get_shape()
        except Exception as e:  # noqa: BLE001 - safetensors raises its own types for a damaged file
            raise IntegrityError(f"{path} cannot be read ({type(e).__name__}); {_fix(root)}") from None
        sizes.append(shape[0])
        d = shape[1]
    return Capture(layers=layers, d=d, root=root, n_chunks=n, tokens_per_chunk=sizes)


def fingerprint(model: nn.Module, data: Tensor, **settings) -> str:
    """A digest of a model's weights (a sample and the sum of each tensor), some data and settings: what a
    resumable stage was computed from."""
    h = hashlib.sha256()
    h.update(json.dumps({k: str(v) for k, v in sorted(settings.items())}).encode())
    h.update(json.dumps(list(data.shape)).encode())
    h.update(data.cpu().numpy().tobytes())
    for name, p in model.state_dict().items():
        p = parallel.full_value(p)  # a sharded model: the whole tensor (every rank fingerprints the same model)
        h.update(name.encode())
        h.update(p.detach().float().flatten()[:64].cpu().numpy().tobytes())
        h.update(str(float(p.detach().float().sum())).encode())
    return h.hexdigest()


def chunk_path(root: Path, k: int) -> Path:
    """Where chunk k of a capture on disk lives."""
    return root / f"chunk_{k:05d}.safetensors"


def _write_chunk(path: Path, chunk: dict[str, Tensor]) -> None:
    """One chunk, whole or not at all (a stop mid-write leaves no chunk for a resumed capture to trust), with its
    size and SHA-256 beside it (checksums.seal), checked when it is read back."""
    tmp = path.with_suffix(".tmp")
    save_file(chunk, str(tmp))
    checksums.seal(tmp, path)


def _fix(root: Path) -> str:
    """What to do about a damaged chunk of the capture in `root`: the end of its refusal."""
    root = Path(root)
    work = next((p for p in root.parents if files.is_ours(p)), None)  # the work folder holding the capture
    return (f"delete it to capture it again, or remove the {'work' if work else 'capture'} folder {work or root} "
            "to start afresh")


def _check_done(root: Path, done) -> None:
    """Refuse a resumed capture whose finished chunks were truncated or have no checksum (their contents are
    checked when they are read)."""
    for k in sorted(done):
        checksums.check(chunk_path(root, k), lambda: _fix(root), full=False)


def _chunk_tokens(n_blocks: int, block_len: int, batch_size: int) -> list[int]:
    """Tokens in each chunk of a capture of n_blocks blocks, batch_size blocks per chunk (the last one shorter)."""
    return [min(batch_size, n_blocks - s) * block_len for s in range(0, n_blocks, batch_size)]


def _index(root: Path, fp: str, layers: list[int], n_chunks: int, batch_size: int, dtype: torch.dtype) -> bool:
    """A capture folder's index (capture.json): True when `root` already holds a capture made from `fp` (its chunks
    are kept), False when the index was just written; one made from anything else is refused."""
    meta_path = root / "capture.json"
    if not meta_path.exists():
        meta_path.write_text(json.dumps({"fingerprint": fp, "layers": layers, "n_chunks": n_chunks,
                                         "batch_size": batch_size, "dtype": str(dtype)}))
        return False
    try:
        meta = json.loads(meta_path.read_text())
    except json.JSONDecodeError:
        raise IntegrityError(f"{meta_path} is corrupted; delete the folder {root} to capture afresh") from None
    if meta.get("fingerprint") != fp:
        raise MLPSurgeryError(f"{root} holds a capture of another model, data or layer set; "
                              "choose an empty folder or delete it")
    return True


def capture_mlp_io(model: nn.Module, blocks: Tensor, layers: list[int] | None = None, batch_size: int = 8,
                   out_dir: str | Path | None = None, dtype: torch.dtype = torch.float32,
                   progress: bool = True, device: torch.device | str | None = None,
                   replace: dict[int, Callable[[Tensor], Tensor]] | None = None, tag: str = "") -> Capture:
    """Capture (x, y) of the chosen layers' MLP sub-blocks over `blocks` (N, T) of token ids.

    out_dir: None keeps chunks in memory; a folder writes one safetensors file per batch (resumable).
    dtype: storage precision (bfloat16 halves the disk; the forward itself runs in the model's dtype).
    replace: {layer: fn} runs a student in the stream: y is still the sub-block's own output on the x it sees, but
    what flows on is x + fn(x) (fn: float32 (tokens, d) -> delta), so later layers see the inputs the students
    before them produce (on-policy pairs); a layer may have a student without being captured (another process
    captures it). tag names the students in the resume fingerprint (e.g. their digest).
    """
    sites = find_sites(model)
    layers = list(range(len(sites))) if layers is None else sorted(set(layers))
    if not layers:
        raise MLPSurgeryError("no layers chosen for capture")
    if blocks.dim() != 2 or len(blocks) == 0:
        raise MLPSurgeryError(f"calibration blocks must be a non-empty (N, T) tensor of token ids, got {tuple(blocks.shape)}")
    device = torch.device(device) if device is not None else next(model.parameters()).device
    n_chunks = (len(blocks) + batch_size - 1) // batch_size
    cap = Capture(layers=layers, d=sites.config.hidden_size, n_chunks=n_chunks)
    done: set[int] = set()
    if out_dir is not None:
        root = Path(out_dir)
        root.mkdir(parents=True, exist_ok=True)
        cap.root = root
        fp = fingerprint(model, blocks, layers=layers, dtype=dtype, **({"students": tag} if replace else {}))
        if _index(root, fp, layers, n_chunks, batch_size, dtype):
            done = {k for k in range(n_chunks) if chunk_path(root, k).exists()}
            _check_done(root, done)
    cap.tokens_per_chunk = _chunk_tokens(len(blocks), blocks.shape[1], batch_size)

    last = layers[-1]
    store: dict[str, Tensor] = {}

    def pre_hook(i):
        def hook(mod, args):
            store[f"x.{i}"] = args[0].detach().reshape(-1, cap.d)
        return hook

    def post_hook(i):
        kept = i in layers

        def hook(mod, args, out):
            delta = out[0] if isinstance(out, tuple) else out
            x = store[f"x.{i}"] if kept else store.pop(f"x.{i}")
            if kept:
                store[f"y.{i}"] = (x + delta.detach().reshape(-1, cap.d)).to(dtype=dtype, device="cpu").contiguous()
                store[f"x.{i}"] = x.to(dtype=dtype, device="cpu").contiguous()
            if i == last:
                raise _StopForward
            if replace and i in replace:
                student = replace[i](x.float()).to(delta.dtype).reshape(delta.shape)
                return (student, *out[1:]) if isinstance(out, tuple) else student
        return hook

    handles = []
    try:
        for i in sorted(set(layers) | {j for j in (replace or {}) if j < last}):
            handles.append(sites.mlp[i].entry.register_forward_pre_hook(pre_hook(i)))
            handles.append(sites.mlp[i].exit.register_forward_hook(post_hook(i)))
        todo = [k for k in range(n_chunks) if k not in done]
        with torch.no_grad():
            for k in tqdm(todo, desc="capture", unit="batch", disable=not progress, initial=len(done), total=n_chunks):
                store.clear()
                batch = blocks[k * batch_size:(k + 1) * batch_size].to(device)
                try:
                    model(input_ids=batch)
                except _StopForward:
                    pass
                chunk = {n: store[n] for n in sorted(store)}
                if cap.root is None:
                    cap.memory.append(chunk)
                else:
                    _write_chunk(chunk_path(cap.root, k), chunk)
    finally:
        for hnd in handles:
            hnd.remove()
    return cap


@contextlib.contextmanager
def layer_capture(site, n_blocks: int, block_len: int, batch_size: int, out_dir: str | Path, fp: str,
                  dtype: torch.dtype = torch.float32, layer: int = 0):
    """(x, y) of one layer's MLP sub-block `site` while the caller runs that layer over every calibration batch in
    order (layerwise.LayerStream.run): the layer-by-layer form of capture_mlp_io. Chunk k is batch k, written under
    the same names and format (x.LAYER, y.LAYER), so open_capture and everything reading a capture read it alike.
    Yields (the Capture, whether the layer must still run for it). Resumable: chunks already written are kept, not
    rewritten; a folder made from other inputs (`fp`, the caller's digest of what reaches this layer) is refused."""
    root = Path(out_dir)
    root.mkdir(parents=True, exist_ok=True)
    n_chunks = (n_blocks + batch_size - 1) // batch_size
    d = site.config.hidden_size
    cap = Capture(layers=[layer], d=d, root=root, n_chunks=n_chunks,
                  tokens_per_chunk=_chunk_tokens(n_blocks, block_len, batch_size))
    _index(root, fp, [layer], n_chunks, batch_size, dtype)
    paths = [chunk_path(root, k) for k in range(n_chunks)]
    _check_done(root, [k for k, p in enumerate(paths) if p.exists()])
    if all(p.exists() for p in paths):
        yield cap, False
        return
    state = {"k": 0, "x": None}

    def pre(mod, args):
        state["x"] = args[0].detach().reshape(-1, d)

    def post(mod, args, out):
        delta = out[0] if isinstance(out, tuple) else out
        x, k = state["x"], state["k"]
        state["k"] += 1
        if k < n_chunks and not paths[k].exists():
            _write_chunk(paths[k], {
                f"x.{layer}": x.to(dtype=dtype, device="cpu").contiguous(),
                f"y.{layer}": (x + delta.detach().reshape(-1, d)).to(dtype=dtype, device="cpu").contiguous()})

    handles = [site.entry.register_forward_pre_hook(pre), site.exit.register_forward_hook(post)]
    try:
        yield cap, True
    finally:
        for h in handles:
            h.remove()
    if state["k"] != n_chunks:
        raise MLPSurgeryError(f"internal: layer {layer} ran {state['k']} batches, its capture expects {n_chunks}")
