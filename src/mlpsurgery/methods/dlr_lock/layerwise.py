"""DLR-Lock's module-wise distillation one decoder layer at a time, from the checkpoint's files (layerwise.py).

A model larger than RAM is locked in the memory of one layer, its DLR-Net's training and the calibration
activations: the skeleton's layers are read in turn (`layerwise.rewrite`); for each locked layer

    1. the layer runs over the calibration batches (the inputs the original layers before it produce), and its
       MLP sub-block's (x, y) pairs are written to the work folder as `capture_mlp_io` writes them;
    2. with on-policy steps, the original layer also runs over the *on-policy* stream -- the inputs the locked
       layers before it (already distilled, their nets installed) produce -- and the sub-block's answer to them is
       recorded: (x', x' + MLP(x')), the original function on the inputs it will meet;
    3. modulewise.phase1 distils the layer's DLR-Net on them (the closed-form start, phase-1 steps, the on-policy
       steps), exactly as a whole-model run of that one layer (`--layers i`, seed + i, the plan's depth) does;
    4. the net is installed, the layer written to the output and dropped; the teacher stream goes on through the
       original layer, the on-policy stream through the locked one.

So a layer's net equals the one `lock dlr --layers i --seed S+i --depth D --phase2-steps 0` trains (D: the depth
of the largest locked MLP's budget, which every layer gets, as in a whole-model run; tested), and the
on-policy pairs are fully on-policy: every earlier layer is locked with its *final* net (in a whole-model run the
on-policy capture runs the phase-1 nets before their own on-policy steps). Not here: phase 2 (end-to-end logit
distillation), which trains every layer at once -- it needs the whole model, or FSDP under torchrun.

Under torchrun the locked layers are split over the ranks (rank r: the locked layers r, r + N, ...), every rank
reading one layer at a time. A first pass runs the teacher's stream through the original layers up to the rank's
last layer and distils each of its layers through phase 1 (its pairs captured; the closed-form start and the
phase-1 steps, which need the original's inputs alone), the ranks side by side; the second pass, which writes,
runs the on-policy stream in layer order: the owner of a layer captures its on-policy pairs (the locked layers
before it being final by then), takes its on-policy steps -- phase 1's own stage, found done, then the on-policy
one -- and sends the net to every rank (`parallel.from_rank`), which installs it and runs the stream on through it;
rank 0 writes the folder. Each layer's arithmetic is one process's, so N ranks write what one process writes, bit
for bit (tested); the on-policy steps are the part that stays in layer order. Each rank's layers and spilled
activations are in `rank{r}-of-{N}` of the work folder (its pairs kept from the first pass to the second).

Everything is resumable from the work folder (`layerNNN/` per locked layer, with phase 1's own stages while the
layer is worked on): a restarted run recomputes the streams through the finished layers and goes on where it
stopped. A finished layer keeps only its net as installed and its report (`net.safetensors`, `layer.json`); its
captures, start and training checkpoints are removed, so the work folder holds about one layer's working files
plus the nets, not a multiple of the model. Captures and finished layers record a digest of everything that
reaches them (the data, the parts outside the layers, every earlier layer as read and, for the on-policy stream,
as locked; the layer itself and the settings), so a work folder made from another model, other data or other
settings is refused, not mixed in.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import Tensor
from tqdm.auto import tqdm

from ... import parallel
from ...capture import layer_capture
from ...errors import IntegrityError, MLPSurgeryError
from ...files import claim, model_fingerprint
from ...io import atomic_write_text, record
from ...layerwise import LayerStream, digest_chain, rewrite
from ...modules.dlr import DLRNet
from ...sites import find_sites
from .captured import capture_batch
from .config import DLRConfig, DLRReport, combine_reports, plan
from .distributed import check_ranks
from .modulewise import phase1
from .workdir import _save_stage_file

LAYER_NET, LAYER_REPORT = "net.safetensors", "layer.json"  # what stays of a finished layer in the work folder


def check_layerwise(cfg: DLRConfig) -> None:
    """Refuse what the layer-by-layer mode does not do, naming the way out."""
    cfg.validate()
    if cfg.phase2_steps:
        raise MLPSurgeryError("lock_layerwise distils each MLP on its own, one layer in memory at a time; phase 2 "
                              "trains the whole model end to end: set phase2_steps=0 and run continue_phase2 on the "
                              "saved folder (what `lock dlr --layerwise` does)")


# settings that change how phase 1 runs, not what it computes: a stopped run may resume with others
_RUNTIME = ("compile", "memory_limit_gb")


def _settings(cfg: DLRConfig) -> str:
    return json.dumps({k: v for k, v in asdict(cfg).items() if k not in _RUNTIME}, sort_keys=True)


def _finished(wd: Path, key: str, i: int) -> tuple[dict[str, Tensor], DLRReport] | None:
    """A layer finished before (its net as installed and its report), or None; a layer finished from other inputs
    or settings is refused (its net would silently stand in for another)."""
    meta, weights = wd / LAYER_REPORT, wd / LAYER_NET
    if not (meta.exists() and weights.exists()):
        return None
    try:
        record = json.loads(meta.read_text())
        report = record["report"]
        state = load_file(str(weights))
    except Exception:  # noqa: BLE001 - a damaged JSON or safetensors file (each library raises its own types)
        raise IntegrityError(f"the record of layer {i} in {wd} is damaged; delete that folder to lock the layer "
                             "again") from None
    if record.get("key") != key:
        raise MLPSurgeryError(f"work folder {wd.parent} holds layer {i} locked from another model, other data or "
                              "other settings; resume with the same ones, or use (or empty) another folder")
    for name, v in report.items():  # JSON made the layer keys strings
        if isinstance(v, dict):
            report[name] = {int(k): x for k, x in v.items()}
    return state, DLRReport(**report)


def _keep(wd: Path, key: str, net: DLRNet, report: DLRReport) -> None:
    """A finished layer's record: its net as installed and its report, written whole or not at all; then its
    captures, start and training checkpoints are removed (they would grow the work folder by a multiple of the
    model: on a 2 B model 2.3 GB per layer)."""
    _save_stage_file(wd / LAYER_NET, net.state_dict())
    atomic_write_text(wd / LAYER_REPORT, json.dumps({"key": key, "report": report.as_dict()}))
    for p in wd.iterdir():
        if p.name in (LAYER_NET, LAYER_REPORT):
            continue
        shutil.rmtree(p) if p.is_dir() else p.unlink()


def layer_seed(cfg: DLRConfig, i: int) -> int:
    """Layer i's seed: its net, start and draws are those of a whole-model run of layer i alone with this seed."""
    return cfg.seed + i


def merge_layers(reports: list[DLRReport], budget: int) -> DLRReport:
    """One report from the per-layer ones: per-layer fields merged, stage times summed (the layers ran one after
    the other; under torchrun the sum over every rank's layers, not a wall time), histories averaged over the
    layers step by step (every layer runs the same schedule); the MLP's parameters the largest locked MLP's (as
    `plan` reports them)."""
    out = combine_reports(reports, seconds=sum, history=_mean_history)
    out.params_mlp = budget
    return out


def _mean_history(histories: list[list[dict]]) -> list[dict]:
    rows = []
    for entries in zip(*histories):
        row = {"step": entries[0]["step"]}
        for key in ("relative_error", "loss"):
            if all(key in e for e in entries):
                row[key] = sum(e[key] for e in entries) / len(entries)
        if all("time_s" in e for e in entries):
            row["time_s"] = sum(e["time_s"] for e in entries)  # the layers' times added up
        rows.append(row)
    return rows


def open_stream(folder: str | Path, workdir: str | Path, dtype=None, max_memory_gb: float | None = None,
                device=None) -> LayerStream:
    """The checkpoint in `folder` as a LayerStream whose activations spill (past max_memory_gb) into the work folder;
    device: where each layer is captured and its net trained (the CPU by default)."""
    return LayerStream(Path(folder), dtype=dtype, max_memory_gb=max_memory_gb, spill_dir=Path(workdir) / "spill",
                       device=device)


def lock_layerwise(stream: LayerStream, out: str | Path, cfg: DLRConfig, blocks: Tensor, workdir: str | Path,
                   tokenizer=None, overwrite: bool = False, inputs=(), source_name: str | None = None,
                   progress: bool = True, data_name: str = "") -> dict:
    """Lock the checkpoint `stream` reads (capture, closed-form start, phase 1, on-policy steps) one decoder layer at a
    time and save the result to `out`. blocks: (N, T) calibration token ids (what `lock dlr` distils on). The work
    folder holds the resumable per-layer stages; it is claimed for this model first (a new or empty folder is
    marked as mlpsurgery's; one holding anything else, or another model's work, is refused), since a finished
    layer's working files are removed from it. Under torchrun the layers are split over the ranks (the module
    docstring; every rank calls this with the same arguments, its stream spilling into `parallel.rank_folder` of
    the work folder); rank 0 writes `out`. Returns the report's dict (on other ranks: which layers they distilled)."""
    check_layerwise(cfg)
    rank, world = parallel.world()
    split = world > 1
    top = Path(workdir)
    model = stream.model
    sites = find_sites(model)
    everything, depth, budget = plan(model, cfg)  # shapes only: the skeleton suffices
    check_ranks(everything)
    owner, mine = parallel.owners(everything), parallel.share(everything)
    resident = stream.resident_fingerprint()
    data = hashlib.sha256(blocks.cpu().numpy().tobytes()).hexdigest()
    if split:  # rank 0 takes the work folder (for this model, data, settings and number of ranks: a resume with
        # others is refused on every rank), each rank keeps its layers in a folder of its own inside it
        parallel.same_on_every_rank("models, data or settings", (resident, data, _settings(cfg)))
        parallel.on_rank0(lambda: claim(top, "dlr-work-layerwise-split", {
            "model": resident, "data": data, "settings": _settings(cfg), "world": world}, inputs=[*inputs, out]))
    workdir = parallel.rank_folder(top)
    claim(workdir, "dlr-work-layerwise", {"model": resident}, inputs=[*inputs, out])
    d = sites.config.hidden_size
    onpolicy = cfg.onpolicy_count > 0
    batch = capture_batch(len(blocks))
    if (len(blocks) + batch - 1) // batch < 2:
        raise MLPSurgeryError(f"{len(blocks)} calibration block gives one captured batch; phase 1 holds some out: "
                              "give at least 2 (--calib-blocks)")
    act_bytes = blocks.numel() * d * torch.empty(0, dtype=stream.dtype).element_size()
    params = depth * (2 * d * cfg.rank + d + 1)
    # beside the streams: the captured sets of one layer in RAM (phase 1's and, on-policy, its second), the net's
    # training state (float32 weights, gradients, AdamW moments) and, on-policy, the second stream in and out
    pairs = 2 * blocks.numel() * d * torch.empty(0, dtype=getattr(torch, cfg.capture_dtype)).element_size()
    extra = (2 if onpolicy else 1) * pairs + 16 * params + (2 * act_bytes if onpolicy else 0)
    start = digest_chain(resident, blocks.shape, data, stream.dtype, cfg.capture_dtype)
    capture_dtype = getattr(torch, cfg.capture_dtype)
    reports: dict[int, DLRReport] = {}
    t0 = time.perf_counter()

    def one(i: int) -> DLRConfig:  # layer i alone, at the plan's one depth (the largest locked MLP's budget), as a
        return replace(cfg, layers=str(i), seed=layer_seed(cfg, i), depth=depth)  # whole-model run gives every layer

    def layer_dir(i: int) -> Path:
        return workdir / f"layer{i:03d}"

    if split:  # first pass: this rank's layers captured and through phase 1, side by side with the other ranks
        _teacher_pass(stream, mine, blocks, batch, extra, start, one, layer_dir, capture_dtype, progress)
    # the pass that writes: in one process each layer's whole work; under torchrun the on-policy steps in layer
    # order (their pairs need every earlier layer's final net), each net sent from its owner to every rank
    acts = stream.layer_inputs(blocks, batch_size=batch, extra_bytes=extra) if onpolicy or not split else None
    on_acts = acts  # the on-policy stream: the same as the teacher's until the first locked layer
    chain = {"teacher": start, "onpolicy": start}

    def work(i: int) -> None:
        nonlocal acts, on_acts
        if i > everything[-1]:  # past the last locked layer nothing more is captured: the layer is only copied
            return
        layer = stream.layers[i]
        original = model_fingerprint(layer)
        if i not in everything:
            diverged = chain["onpolicy"] != chain["teacher"]  # (only once a layer before is locked)
            if onpolicy and diverged:
                on_acts = stream.run(i, on_acts, tag="on-")
            if acts is not None:
                acts = stream.run(i, acts)
            if not diverged:
                on_acts = acts
            for k in chain:
                chain[k] = digest_chain(chain[k], i, original)
            return
        wd = layer_dir(i)
        site = sites.mlp[i]
        # what the layer's net is made of
        key = digest_chain(chain["teacher"], chain["onpolicy"], original, _settings(cfg))
        own = owner[i] == rank
        next_acts = net = None
        if own:
            done = _finished(wd, key, i)
            if done is not None:  # finished before a stop: its net read back, nothing captured or trained again
                net = DLRNet(d, cfg.rank, depth, cfg.eps).to(device=stream.device, dtype=stream.dtype)
                net.load_state_dict(done[0])
                reports[i] = done[1]
                if not split:
                    next_acts = stream.run(i, acts)
            else:
                with layer_capture(site, len(blocks), blocks.shape[1], batch, wd / "capture", chain["teacher"],
                                   capture_dtype, i) as (cap, needed):
                    if not split:
                        next_acts = stream.run(i, acts)  # (needed either way: the next layer's inputs)
                    elif needed:
                        raise MLPSurgeryError(f"internal: layer {i}'s pairs are not in {wd}; the first pass "
                                              "writes them")
                oncap = None
                if onpolicy:
                    with layer_capture(site, len(blocks), blocks.shape[1], batch, wd / "capture_onpolicy",
                                       digest_chain(chain["onpolicy"], "onpolicy"), capture_dtype,
                                       i) as (oncap, needed):
                        if needed:
                            stream.run(i, on_acts, keep=False)
                with parallel.alone():  # this layer is this rank's alone
                    nets, rep = phase1(model, blocks, one(i), wd, progress=progress, device=stream.device,
                                       captured=cap, onpolicy_captured=oncap)
                reports[i] = rep
                net = nets[i].to(device=stream.device, dtype=stream.dtype)  # (unstack gives a CPU copy)
                _keep(wd, key, net, rep)  # the layer's captures and checkpoints go: only its net and report stay
        if split:  # every rank installs every net: the on-policy stream runs through it, and rank 0 writes it
            state = parallel.from_rank({k: v.detach().cpu() for k, v in net.state_dict().items()} if own else None,
                                       owner[i])
            if not own:
                net = DLRNet(d, cfg.rank, depth, cfg.eps).to(device=stream.device, dtype=stream.dtype)
                net.load_state_dict(state)
        site.replace_subblock(net)
        chain["teacher"] = digest_chain(chain["teacher"], i, original)
        if onpolicy and i < everything[-1]:  # on through the locked layer
            on_acts = stream.run(i, on_acts, tag="on-")
            chain["onpolicy"] = digest_chain(chain["onpolicy"], i, model_fingerprint(layer))
        if not onpolicy:
            chain["onpolicy"] = chain["teacher"]
        acts = next_acts  # (under torchrun the teacher's stream stops at the first locked layer: its pairs are taken)
        if i == everything[-1]:  # the streams are not needed past the last locked layer
            acts = on_acts = None
            if split:  # rank 0 records every layer's report
                for part in parallel.all_gather(reports):
                    reports.update(part)

    result = {}

    def finish() -> None:
        result["report"] = report = merge_layers([reports[i] for i in sorted(reports)], budget)
        record(model, "dlr_lock", asdict(cfg), data=data_name, seed=cfg.seed, capture_tokens=report.capture_tokens,
               phase1_steps=cfg.phase1_steps, onpolicy_steps=cfg.onpolicy_count, phase2_steps=0, layerwise=True,
               phase1_relative_error=report.phase1_relative_error,
               distillation_seconds=report.start_seconds + report.phase1_seconds + report.onpolicy_seconds)

    rewrite(stream, out, work, "DLR-Lock (layer by layer)", tokenizer=tokenizer, overwrite=overwrite,
            inputs=[*inputs, top], source_name=source_name, progress=progress, finish=finish, write=rank == 0)
    shared = {"layerwise": True, "seconds": time.perf_counter() - t0, "device": str(stream.device),
              **({"world_size": world} if split else {})}
    if rank != 0:
        return {"rank": rank, "layers": mine, **shared}
    return {"out": str(out), "report": result["report"].as_dict(), **shared,
            "dtype": str(stream.dtype).split(".")[-1], "activations_on_disk": stream.disk}


def _teacher_pass(stream: LayerStream, mine: list[int], blocks: Tensor, batch: int, extra: int, start: str, one,
                  layer_dir, capture_dtype, progress: bool) -> None:
    """Under torchrun, before the pass that writes: the teacher's stream through the original layers up to this
    rank's last one; each of its layers not finished before has its pairs captured and is distilled through phase
    1 (the closed-form start and the phase-1 steps: they need the original's inputs alone), which stays in its
    work folder (`modulewise.phase1`'s stage); the on-policy steps follow in the second pass, which finds that stage
    done. So the ranks distil their layers' phase 1 side by side, and each layer ends as one process ends it."""
    sites = find_sites(stream.model)
    todo = [i for i in mine if not (layer_dir(i) / LAYER_REPORT).exists()]
    if not todo:
        return
    acts = stream.layer_inputs(blocks, batch_size=batch, extra_bytes=extra)
    chain = start
    rank = parallel.world()[0]
    for i in tqdm(range(todo[-1] + 1), desc=f"DLR phase 1, rank {rank}'s layers", unit="layer", disable=not progress):
        layer = stream.materialise(i)
        original = model_fingerprint(layer)
        last = i == todo[-1]
        if i in todo:
            with layer_capture(sites.mlp[i], len(blocks), blocks.shape[1], batch, layer_dir(i) / "capture", chain,
                               capture_dtype, i) as (cap, needed):
                if needed or not last:
                    acts = stream.run(i, acts, keep=not last)
            with parallel.alone():
                phase1(stream.model, blocks, replace(one(i), onpolicy_steps=0), layer_dir(i), progress=progress,
                       device=stream.device, captured=cap)
        else:
            acts = stream.run(i, acts)
        chain = digest_chain(chain, i, original)
        stream.release(i)
