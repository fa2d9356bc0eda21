"""MLP Fusion and its data-free baselines layer by layer from the checkpoint's files (mlpsurgery/layerwise.py).

The per-layer work is the whole-model mode's own (`compress_site` and the error probes on seeded random rows), run in
the same layer order with the same generators, so the folder holds what `fuse` + `save` write: the same tensors,
modules, history and source fingerprint (tests/test_layerwise_reshape.py checks them bit for bit). Only one
decoder layer is in memory at a time (`layerwise.rewrite`): it is read from the safetensors files, compressed,
appended to the output and dropped; a compressed MLP changes shape, so the output's header is written last.

With tune data (layer-wise tuning, activation importance) the tune blocks flow through the original layers as the
layers are read (`LayerStream.run`); each chosen layer's MLP pairs (x, y) are captured while its original runs
(`capture.layer_capture`, bit for bit what `capture_mlp_io` records on the whole model), then the layer is
compressed, scored on those pairs and tuned on them alone (`fusion.tune_layers` of that one layer), and its
capture removed: memory of one layer, one layer's pairs and the stream of hidden states (on disk past
`max_memory_gb`), not every layer's pairs beside the whole model. Each layer's term of the tuning loss depends on its
own MLP alone, so tuning it alone takes the same steps on the same rows; what differs from `fuse` on the whole
model is the gradient-norm clip, which there is one norm over every tuned layer and here each layer's own (equal
where the clip does not act; tested).

Under torchrun (tune data required) the work is split by layer, as `fuse` splits it on the whole model: every rank
reads every layer and runs the tune stream through it, but captures, compresses and tunes only its share (rank r:
the chosen layers r, r + N, ...), taking for the others only their random draws (`draw_layer`: so its generator
gives each of its layers what one process draws for it); the owner of a layer sends its compressed, tuned MLP, its
report row and its tuning report to rank 0 (`parallel.send_to`), which puts the MLP in its copy of the layer and
writes the folder in layer order. Each layer is tuned alone in either case, so N ranks write what one process
writes (tested bit for bit). Every rank holds one layer, its captured pairs and the stream, never the model; the
k-means of the layers is split over the ranks with the rest.

With calibration data (the data-aware mode, `fuse(calib_data=...)`) the calibration blocks flow through the layers
as a second stream: each chosen layer's MLP inputs are recorded while the layer, still original, runs over the stream,
the layer is compressed on them (`calibrated_layer`, the whole-model mode's own), and the stream goes on through the
compressed layer (`calibration` 'sequential'), or through the original one ('original'). In one process; the
per-layer budget and the corrective target need the whole model and are refused here.

Not here (refused before anything is read or written): the magnitude baseline, whose masks the pruning commands'
own layer-sequential mode writes (`prune --layerwise`).
"""

from __future__ import annotations

import hashlib
import shutil
from dataclasses import asdict
from pathlib import Path

import torch
from torch import Tensor

from ... import parallel
from ...capture import layer_capture
from ...errors import MLPSurgeryError
from ...files import claim, model_fingerprint
from ...io import record
from ...layerwise import LayerStream, digest_chain, rewrite
from ...measure.cost import count_params
from ...sites import find_sites
from . import layers_and_width
from .compress import compress_site, draw_layer
from .config import FusionConfig
from .probes import _ErrorProbes, count_after
from .tuning import install_layer, layer_payload, split_share, tune_layers

CAPTURE_BATCH = 8  # blocks per forward, as capture_mlp_io runs them (the chunks are the same)

METHODS = ("fusion", "cluster", "svd", "sketch", "mmd", "neuron", "random")


def check_layerwise(cfg: FusionConfig, tune: bool = False, calibrated: bool = False) -> None:
    """Refuse what the layer-sequential mode does not do, naming the way out."""
    cfg.validate()
    if calibrated and (cfg.budget != "uniform" or cfg.calibration == "corrective"):
        raise MLPSurgeryError("the per-layer budget and the corrective calibration run the whole model: drop "
                              "--layerwise, or use --budget uniform and --calibration sequential / original")
    cfg.check_calibrated(calibrated)
    if calibrated and parallel.world()[1] > 1:
        raise MLPSurgeryError("the data-aware fuse runs in one process: drop torchrun, or compress data-free")
    if cfg.method not in METHODS:
        raise MLPSurgeryError(f"the layer-sequential mode fuses with {', '.join(METHODS)}, not {cfg.method!r} "
                              "(magnitude: use `prune --layerwise --method magnitude`): drop --layerwise")
    if cfg.importance == "activation" and cfg.method == "neuron" and not tune:
        raise MLPSurgeryError("importance='activation' scores neurons on text: give tune data (--tune-data)")


class _Captures:
    """Layer -> its captured pairs (one Capture each), read as the whole model's capture is (`layer(i)`)."""

    def __init__(self):
        self.by_layer = {}

    def layer(self, i: int) -> tuple[Tensor, Tensor]:
        return self.by_layer[i].layer(i)


def fuse_layerwise(folder: str | Path, out: str | Path, cfg: FusionConfig, dtype=None, tokenizer=None,
                   overwrite: bool = False, inputs=(), source_name: str | None = None, progress: bool = True,
                   tune_data: Tensor | None = None, workdir: str | Path | None = None,
                   max_memory_gb: float | None = None, check=None, device=None,
                   calib_data: Tensor | None = None) -> dict:
    """Compress the checkpoint in `folder` layer by layer and save the result to `out` (what `fuse` then `save`
    write); returns fuse's report with the parameter counts before and after. tune_data: (N, T) token blocks for
    layer-wise tuning (and activation importance), captured one layer at a time into `workdir` (a new or empty
    folder, marked as mlpsurgery's; each layer's pairs removed once it is tuned). check(skeleton): the caller's
    checks of the model (shapes and config only), run before anything is written. device: where each layer is
    compressed and tuned (LayerStream; the CPU by default). Under torchrun the tuning is split by layer (module
    docstring): each rank keeps its captures in `workdir`/rank{r}-of-{N}, rank 0 writes `out` and returns the
    report, the others their share's."""
    check_layerwise(cfg, tune=tune_data is not None, calibrated=calib_data is not None)
    tune = tune_data is not None
    calibrated = calib_data is not None
    if calibrated and max_memory_gb is not None:
        raise MLPSurgeryError("--max-memory spills the tune stream to disk, which the calibration stream beside it "
                              "does not do: drop --max-memory (the calibration blocks are small)")
    if tune and workdir is None:
        raise MLPSurgeryError("layer-wise tuning layer by layer needs a work folder for the captured pairs")
    rank, world = parallel.world()
    split = world > 1
    top = workdir = None if workdir is None else Path(workdir)
    if split and workdir is not None:  # each rank's captures and spilled activations in a folder of its own
        workdir = parallel.rank_folder(top)
    stream = LayerStream(Path(folder), dtype=dtype, max_memory_gb=max_memory_gb,
                         spill_dir=None if workdir is None else workdir / "spill", device=device)
    model = stream.model
    sites = find_sites(model)
    layers, k = layers_and_width(sites, cfg)  # on the skeleton: shapes only
    own = set(split_share(layers, tune))  # this rank's share of the tuning (all of it in one process)
    owner = parallel.owners(layers)
    if check is not None:
        check(model)
    before = count_params(model)
    gen = torch.Generator().manual_seed(cfg.seed)
    caps = _Captures() if tune else None
    probes = _ErrorProbes(sites, layers, caps, cfg.seed)
    caps_probes = probes if tune else None  # the data-aware mode's errors: on the tune rows, else the calibration rows
    rows, tuning = [], []  # (under torchrun: every layer's on rank 0, its own layers' tuning on the others)
    state = {}
    if tune:
        digest = hashlib.sha256(tune_data.cpu().numpy().tobytes()).hexdigest()
        resident = stream.resident_fingerprint()
        settings = {"model": resident, "data": digest}
        if split:  # rank 0 takes the work folder; each rank keeps its captures in a folder of its own inside it
            parallel.same_on_every_rank("models, tune data or settings", (settings, asdict(cfg), layers, k))
            parallel.on_rank0(lambda: claim(top, "fuse-work-layerwise-split", {**settings, "world": world},
                                            inputs=[*inputs, out]))
        claim(workdir, "fuse-work-layerwise", settings, inputs=[*inputs, out])
        state["chain"] = digest_chain(resident, tune_data.shape, digest, stream.dtype)
        d = sites.config.hidden_size
        extra = 2 * tune_data.numel() * d * 4  # one layer's captured pairs (float32), beside the stream
        state["acts"] = stream.layer_inputs(tune_data, batch_size=CAPTURE_BATCH, extra_bytes=extra)

    def stream_on(i: int) -> None:
        """With tune data: run original layer i over the tune stream (capturing its MLP pairs if it is chosen)."""
        layer = stream.layers[i]
        original = model_fingerprint(layer)
        if i in own:
            with layer_capture(sites.mlp[i], len(tune_data), tune_data.shape[1], CAPTURE_BATCH,
                               workdir / f"layer{i:03d}", state["chain"], torch.float32, i) as (cap, _):
                nxt = stream.run(i, state["acts"])
            caps.by_layer[i] = cap
        else:
            nxt = stream.run(i, state["acts"])
        state["chain"] = digest_chain(state["chain"], i, original)
        state["acts"] = nxt if i < layers[-1] else None  # not needed past the last chosen layer

    if calibrated:
        from . import calibrated_layer

        state["calib"] = stream.layer_inputs(calib_data, batch_size=cfg.calib_batch)

    def calib_rows(i: int) -> Tensor:
        """Layer i (still original) over the calibration stream: the rows entering its MLP sub-block; in the
        'original' mode the stream also goes on through it here."""
        rows_: list[Tensor] = []
        hook = sites.mlp[i].entry.register_forward_pre_hook(
            lambda mod, args: rows_.append(args[0].detach().reshape(-1, args[0].shape[-1]).float()))
        try:
            nxt = stream.run(i, state["calib"], keep=cfg.calibration == "original")
        finally:
            hook.remove()
        if nxt is not None:
            state["calib"] = nxt
        return torch.cat(rows_)

    def work(i: int) -> None:
        if tune and i <= layers[-1]:
            stream_on(i)
        if calibrated and i <= layers[-1]:
            if i in layers:
                rows.append(calibrated_layer(sites.mlp[i], k, cfg, gen, calib_rows(i), caps_probes))
            if cfg.calibration == "sequential" or i not in layers:  # (before the tuning: as on the whole model,
                # where every layer is compressed before any is tuned, the next layer sees the untuned one)
                state["calib"] = stream.run(i, state["calib"]) if i < layers[-1] else None
            if tune and i in layers:
                tuning.append(tune_layers(model, caps.by_layer[i], [i], cfg, progress=progress))
                rows[-1]["error_rel_tuned"] = caps_probes.error(i)
                del caps.by_layer[i]
                shutil.rmtree(workdir / f"layer{i:03d}")
            return
        if i not in layers:
            return
        if i not in own:  # another rank's: only its draws, to keep this rank's generator in step
            draw_layer(sites.mlp[i].h, k, cfg, gen)
            if rank == 0:  # the owner's compressed, tuned MLP in place of this copy, to be written
                j, modules, row, part = parallel.recv_from(owner[i])
                if j != i:
                    raise MLPSurgeryError(f"internal: rank 0 expected layer {i} from rank {owner[i]}, got layer {j}")
                install_layer(sites.mlp[i], modules)
                rows.append(row)
                if part is not None:
                    tuning.append(part)
            return
        x = caps.layer(i)[0] if tune and cfg.importance == "activation" else None
        probes.before(i)
        row = compress_site(sites.mlp[i], k, cfg, gen, x=x, progress=progress)
        row["error_rel"] = probes.error(i)
        count_after(sites.mlp[i], row)
        part = None
        if tune:
            part = tune_layers(model, caps.by_layer[i], [i], cfg, progress=progress)
            row["error_rel_tuned"] = probes.error(i)
            del caps.by_layer[i]
            shutil.rmtree(workdir / f"layer{i:03d}")
        if part is not None:
            tuning.append(part)  # (on a rank other than 0: this rank's report)
        if rank != 0:  # to rank 0, which writes the folder (it takes them in layer order)
            parallel.send_to((i, layer_payload(sites.mlp[i]), row, part), 0)
            return
        rows.append(row)

    rewrite(stream, out, work, f"{cfg.method} (layer by layer)", tokenizer=tokenizer, overwrite=overwrite,
            inputs=[*inputs, *([top] if top is not None else [])], source_name=source_name,
            progress=progress, finish=lambda: record(model, "fusion", asdict(cfg), width=k, layers=layers,
                                                     **({"calib_tokens": int(calib_data.numel())} if calibrated
                                                        else {}),
                                                     tune_tokens=int(tune_data.numel()) if tune else 0),
            write=rank == 0)
    if rank != 0:  # its share: the layers it tuned (their rows went to rank 0), and what their tuning held
        return {"rank": rank, "world_size": world, "layers": sorted(own), "layerwise": True,
                "device": str(stream.device), **({"tuning": _merge_tuning(tuning)} if tuning else {})}
    after = count_params(model)
    report = {"method": cfg.method, "width": k, "layers": layers, "config": asdict(cfg), "sites": rows,
              "error_inputs": probes.description, "layerwise": True, "dtype": str(stream.dtype).split(".")[-1],
              "activations_on_disk": stream.disk, "device": str(stream.device), "mlp_params_before": before["mlp"],
              "mlp_params_after": after["mlp"], "params_before": before["total"], "params_after": after["total"]}
    if tune:
        report["tuning"] = _merge_tuning(tuning)
    if calibrated:
        from . import calibration_inputs

        report["calibration"] = {"mode": cfg.calibration, "blocks": list(calib_data.shape),
                                 "tokens": int(calib_data.numel())}
        report["widths"] = {i: k for i in layers}
        report["error_inputs"] = calibration_inputs(cfg, caps_probes)
    if split:
        report["world_size"] = world
    return report


def _merge_tuning(parts: list[dict]) -> dict:
    """fuse's tuning report from the per-layer ones: the MSEs summed over the layers (fuse reports their sum), the
    steps, tokens and batch every layer shares, seconds added up, the memory of the largest layer."""
    first = parts[0]
    return {"steps": first["steps"], "tokens": first["tokens"], "batch_rows": first["batch_rows"],
            "mse_before": sum(p["mse_before"] for p in parts), "mse_after": sum(p["mse_after"] for p in parts),
            "seconds": sum(p["seconds"] for p in parts),
            "memory": {k: max(p["memory"].get(k, 0) for p in parts) for k in first["memory"]}, "per_layer": True}
