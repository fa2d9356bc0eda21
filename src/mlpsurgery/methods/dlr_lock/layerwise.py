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

from ...capture import layer_capture
from ...errors import IntegrityError, MLPSurgeryError
from ...files import claim, model_fingerprint
from ...io import atomic_write_text, record
from ...layerwise import LayerStream, digest_chain, rewrite
from ...modules.dlr import DLRNet
from ...sites import find_sites
from .captured import capture_batch
from .config import DLRConfig, DLRReport, combine_reports, plan
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
    the other), histories averaged over the layers step by step (every layer runs the same schedule); the MLP's
    parameters the largest locked MLP's (as `plan` reports them)."""
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
    layer's working files are removed from it. Returns the report's dict."""
    check_layerwise(cfg)
    workdir = Path(workdir)
    model = stream.model
    sites = find_sites(model)
    everything, depth, budget = plan(model, cfg)  # shapes only: the skeleton suffices
    resident = stream.resident_fingerprint()
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
    acts = stream.layer_inputs(blocks, batch_size=batch, extra_bytes=extra)
    on_acts = acts  # the on-policy stream: the same as the teacher's until the first locked layer
    start = digest_chain(resident, blocks.shape, hashlib.sha256(blocks.cpu().numpy().tobytes()).hexdigest(),
                   stream.dtype, cfg.capture_dtype)
    chain = {"teacher": start, "onpolicy": start}
    reports: list[DLRReport] = []
    capture_dtype = getattr(torch, cfg.capture_dtype)
    t0 = time.perf_counter()

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
            acts = stream.run(i, acts)
            if not diverged:
                on_acts = acts
            for k in chain:
                chain[k] = digest_chain(chain[k], i, original)
            return
        wd = workdir / f"layer{i:03d}"
        site = sites.mlp[i]
        # what the layer's net is made of
        key = digest_chain(chain["teacher"], chain["onpolicy"], original, _settings(cfg))
        done = _finished(wd, key, i)
        if done is not None:  # finished before a stop: its net read back, nothing captured or trained again
            net = DLRNet(d, cfg.rank, depth, cfg.eps).to(device=stream.device, dtype=stream.dtype)
            net.load_state_dict(done[0])
            reports.append(done[1])
            next_acts = stream.run(i, acts)
        else:
            with layer_capture(site, len(blocks), blocks.shape[1], batch, wd / "capture", chain["teacher"],
                               capture_dtype, i) as (cap, _):
                next_acts = stream.run(i, acts)  # (needed either way: the next layer's inputs)
            oncap = None
            if onpolicy:
                with layer_capture(site, len(blocks), blocks.shape[1], batch, wd / "capture_onpolicy",
                                   digest_chain(chain["onpolicy"], "onpolicy"), capture_dtype, i) as (oncap, needed):
                    if needed:
                        stream.run(i, on_acts, keep=False)
            # the plan's one depth (the largest locked MLP's budget), as a whole-model run gives every layer
            one = replace(cfg, layers=str(i), seed=layer_seed(cfg, i), depth=depth)
            nets, rep = phase1(model, blocks, one, wd, progress=progress, device=stream.device, captured=cap,
                               onpolicy_captured=oncap)
            reports.append(rep)
            net = nets[i].to(dtype=stream.dtype)
            _keep(wd, key, net, rep)  # the layer's captures and checkpoints go: only its net and report stay
        site.replace_subblock(net)
        chain["teacher"] = digest_chain(chain["teacher"], i, original)
        if onpolicy and i < everything[-1]:  # on through the locked layer
            on_acts = stream.run(i, on_acts, tag="on-")
            chain["onpolicy"] = digest_chain(chain["onpolicy"], i, model_fingerprint(layer))
        if not onpolicy:
            chain["onpolicy"] = chain["teacher"]
        acts = next_acts
        if i == everything[-1]:  # the streams are not needed past the last locked layer
            acts = on_acts = None

    result = {}

    def finish() -> None:
        result["report"] = report = merge_layers(reports, budget)
        record(model, "dlr_lock", asdict(cfg), data=data_name, seed=cfg.seed, capture_tokens=report.capture_tokens,
               phase1_steps=cfg.phase1_steps, onpolicy_steps=cfg.onpolicy_count, phase2_steps=0, layerwise=True,
               phase1_relative_error=report.phase1_relative_error,
               distillation_seconds=report.start_seconds + report.phase1_seconds + report.onpolicy_seconds)

    rewrite(stream, out, work, "DLR-Lock (layer by layer)", tokenizer=tokenizer, overwrite=overwrite,
            inputs=[*inputs, workdir], source_name=source_name, progress=progress, finish=finish)
    return {"out": str(out), "report": result["report"].as_dict(), "layerwise": True, "seconds": time.perf_counter() - t0,
            "dtype": str(stream.dtype).split(".")[-1], "activations_on_disk": stream.disk, "device": str(stream.device)}
