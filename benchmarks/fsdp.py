"""Training over torchrun ranks against one process, on a real model, the same settings and seed: run once as one
process and once as `torchrun --nproc-per-node N`.

--what nest: `mlpsurgery nest` with training (FSDP2). Per process: the bytes of the model's parameters, of the
trained parameters, their gradients and AdamW moments it held (its shard under FSDP), its peak resident memory
(the kernel's) before and during training, the wall time; the loss at every step of both runs and the largest
difference between the two saved models' weights.
--what fuse: `mlpsurgery fuse` with layer-wise tuning (split by layer over the ranks). Per process: its tuned
layers' captured activations, trained parameters, gradients and AdamW moments, its peak resident memory, the wall
time; the tuning's MSE before / after and every layer's error in both runs, and the largest weight difference.
With --layerwise both runs read the checkpoint one layer at a time (`fuse --layerwise`; the memory columns are then
those of the largest single layer's tuning). --before SRC: the torchrun command of an earlier checkout too, and its
folder's largest weight difference from this checkout's.
--what attack: `mlpsurgery attack dlr LOCKED` (its fine-tuning runs sharded with FSDP2; a locked folder made by
`mlpsurgery lock dlr`, --locked). Per attack run: one rank's step peak memory and seconds against one process's, the
training and held-out losses of both; per process: what it holds between the runs, its peak resident memory after
loading and over the whole run, the wall time (--before SRC: the torchrun command of an earlier checkout too).
--what phase2-only: `mlpsurgery lock dlr LOCKED --phase2-only` (phase 2 alone on a folder locked layer by layer
with --phase2-steps 0: --locked, or one made here at a small budget). Per process: its share of the locked model's
parameter bytes as loaded, its peak resident memory after loading both models and over the whole run, the wall
time; both runs' phase-2 losses, perplexity ratios and the largest weight difference. --before SRC runs the
torchrun command a second time with PYTHONPATH=SRC (an earlier checkout's src/, e.g. a git worktree of the commit
before the loading into shards) for the before / after columns.
--what lock-dlr: `mlpsurgery lock dlr` (phase 1 split by layer, phase 2 sharded; --phase1-hard-fraction 0, so
that each layer's net is the one-process net). Per process: peak resident memory and wall time; the stage
times, the held-out perplexity ratio and per-layer errors of both runs, and the largest weight difference. Both
runs are `--no-layerwise` (every layer's net side by side, the model loaded whole), or with --layerwise both read
the checkpoint one layer at a time (phase 1 split by layer over the ranks, its on-policy steps in layer order).

    python benchmarks/fsdp.py --what nest [--model smollm2] [--steps 8] [--ranks 2] \
        --json docs/results/fsdp-smollm2.json --md docs/results/fsdp-smollm2.md
    python benchmarks/fsdp.py --what fuse [--before OLD/src] --json docs/results/fsdp-fuse-smollm2.json \
        --md docs/results/fsdp-fuse-smollm2.md
    python benchmarks/fsdp.py --what fuse --layerwise [--before OLD/src] \
        --json docs/results/fsdp-fuse-layerwise-smollm2.json --md docs/results/fsdp-fuse-layerwise-smollm2.md
    python benchmarks/fsdp.py --what attack --locked runs/dlr/smollm2-p2-480 --json docs/results/fsdp-attack-smollm2.json \
        --md docs/results/fsdp-attack-smollm2.md
    python benchmarks/fsdp.py --what lock-dlr --json docs/results/fsdp-dlr-smollm2.json --md docs/results/fsdp-dlr-smollm2.md
    python benchmarks/fsdp.py --what lock-dlr --layerwise --json docs/results/fsdp-dlr-layerwise-smollm2.json \
        --md docs/results/fsdp-dlr-layerwise-smollm2.md
    python benchmarks/fsdp.py --what phase2-only [--before OLD/src] --json docs/results/fsdp-phase2-smollm2.json \
        --md docs/results/fsdp-phase2-smollm2.md
    python benchmarks/fsdp.py --what nest --synthetic 1e9 --dtype bfloat16 --steps 2 --batch-size 2 --block-len 64 \
        --json docs/results/fsdp-synthetic-1b.json --md docs/results/fsdp-synthetic-1b.md
    python benchmarks/fsdp.py --render docs/results/fsdp-smollm2.json     # the markdown again from the JSON

One process gets OMP_NUM_THREADS = N and each rank 1, so both use the same cores.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import harness


def _objects(text: str) -> list[dict]:
    """Every JSON object printed on stdout (each rank prints its own)."""
    dec, out, i = json.JSONDecoder(), [], 0
    while True:
        j = text.find("{", i)
        if j < 0:
            return out
        obj, end = dec.raw_decode(text[j:])
        out.append(obj)
        i = j + end


PEAKS: dict[str, int] = {}  # the largest process's peak resident bytes over the whole run, by run ("one", "sharded")


def run(cmd: list[str], threads: int, tag: str = "", src: str | None = None) -> tuple[list[dict], float]:
    """The command's JSON objects and wall seconds; PEAKS[tag]: the peak resident memory of its largest process
    over the whole run (the kernel's, through wait4: for torchrun, the largest of its ranks), saving included.
    src: the mlpsurgery source folder to run (PYTHONPATH; default: the installed one)."""
    env = harness.child_env(threads, **({"PYTHONPATH": src} if src else {}))
    t0 = time.perf_counter()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        p = subprocess.Popen(cmd, env=env, stdout=out, stderr=err, text=True)
        _, status, usage = os.wait4(p.pid, 0)
        p.returncode = os.waitstatus_to_exitcode(status)
        seconds = time.perf_counter() - t0
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    if p.returncode != 0:
        sys.exit(f"failed ({p.returncode}): {' '.join(cmd)}\n{stderr[-3000:]}")
    PEAKS[tag] = usage.ru_maxrss * 1024
    return _objects(stdout), seconds


def _max_diff(a: str, b: str) -> float:
    import torch

    from mlpsurgery.io import load

    ma, mb = load(a), load(b)
    with torch.no_grad():
        return max((p - q).abs().max().item() for p, q in zip(ma.parameters(), mb.parameters()))


def _runs(res: dict, sharded: str = "", before: str = "") -> list[tuple[str, list[dict], float]]:
    """(label, its processes, wall seconds) of each run in a result: one process, torchrun (its label + `sharded`)
    and, where --before gave one, the earlier checkout's torchrun (+ `before` in its parentheses)."""
    runs = [("one process", res["one"], res["one_seconds"]),
            (f"torchrun, {res['ranks']} ranks{sharded}", res["sharded"], res["sharded_seconds"])]
    if res.get("before"):
        runs.append((f"torchrun, {res['ranks']} ranks, before ({res['before_label']}{before})", res["before"],
                     res["before_seconds"]))
    return runs


LOCK = ["--rank", "64", "--calib-blocks", "32", "--block-len", "128", "--phase1-steps", "40", "--phase1-tokens", "256",
        "--phase1-hard-fraction", "0", "--onpolicy-steps", "10", "--phase2-steps", "6", "--phase2-blocks", "16",
        "--phase2-batch", "4", "--eval-tokens", "2048", "--memory-gb", "4", "--no-layerwise"]  # (swapped for --layerwise by --layerwise)


def _ratio(ppl: dict) -> str:
    return f"{ppl['phase1']['heldout'] / ppl['original']['heldout']:.4f}" if "phase1" in ppl else "--"


def render_lock(res: dict) -> str:
    rows = ["| run | process | peak RSS | wall |", "|---|---|---|---|"]
    for name, procs, wall in _runs(res):
        for p in procs:
            rows.append(f"| {name} | rank {p['rank']} | {p['peak_rss_bytes'] / 2**30:.2f} GiB | {wall:.0f} s |")
    a, b = res["report_one"], res["report_sharded"]
    stages = ["| stage | one process | torchrun |", "|---|---|---|"]
    if "--layerwise" in res["args"]:  # each layer's stages were timed alone (on its rank): their sum, not a wall time
        stages[0] = "| stage (layer by layer: the layers' seconds added up, over every rank) | one process | torchrun |"
    for key in ("start_seconds", "phase1_seconds", "onpolicy_seconds", "phase2_seconds"):
        stages.append(f"| {key.removesuffix('_seconds')} | {a[key]:.0f} s | {b[key]:.0f} s |")
    def err(k: str) -> str:  # (phase 2 after a layer-by-layer phase 1 reports no per-layer errors)
        both = [abs(a[k][i] - b[k][i]) for i in a.get(k) or {} if i in (b.get(k) or {})]
        return f"{max(both):.1e}" if both else "--"

    return "\n".join([
        f"`mlpsurgery lock dlr {res['model']} {' '.join(res['args'])}`; machine: {res['machine']}; torch {res['torch']}.",
        "", *rows, "", *stages, "",
        f"Held-out perplexity ratio: {res['ratio_one']:.4f} (one process) vs {res['ratio_sharded']:.4f} (torchrun)" +
        (f"; after phase 1: {_ratio(res['perplexity_one'])} vs {_ratio(res['perplexity_sharded'])}."
         if "perplexity_one" in res else "."),
        f"Largest per-layer difference of the held-out module error: phase 1 {err('phase1_relative_error')}, "
        f"on-policy {err('onpolicy_relative_error')}, phase 2 {err('phase2_relative_error')}; largest "
        f"difference between the two saved models' weights: {res['max_weight_diff']:.1e}."]) + "\n"


FUSE = ["--width", "384", "--layers", "all", "--tune-data", "austen", "--tune-blocks", "64", "--block-len", "128"]


def render_fuse(res: dict) -> str:
    mib = 2 ** 20
    rows = ["| run | process | captured activations | trained params | gradients | AdamW moments | peak RSS | wall |",
            "|---|---|---|---|---|---|---|---|"]
    for name, procs, wall in _runs(res):
        for p in procs:
            m = p["memory"]
            rows.append(f"| {name} | rank {p['rank']} | {m['captured_bytes'] / mib:.0f} MiB | "
                        f"{m['param_bytes'] / mib:.0f} MiB | {m['grad_bytes'] / mib:.0f} MiB | "
                        f"{m['optimizer_bytes'] / mib:.0f} MiB | {p['peak_rss_bytes'] / 2**30:.2f} GiB | {wall:.0f} s |")
    a, b = res["report_one"], res["report_sharded"]
    held = lambda m: m["captured_bytes"] + m["param_bytes"] + m["grad_bytes"] + m["optimizer_bytes"]  # noqa: E731
    one, mine = held(res["one"][0]["memory"]), max(held(p["memory"]) for p in res["sharded"])
    err = lambda k: max(abs(x[k] - y[k]) for x, y in zip(a["sites"], b["sites"]))  # noqa: E731
    return "\n".join([
        f"`mlpsurgery fuse {res['model']} {' '.join(res['args'])}`; machine: {res['machine']}; torch {res['torch']}.",
        "", *rows, "",
        f"Per process, the tuning's captured activations + trained parameters + gradients + AdamW moments: at most "
        f"{mine / mib:.0f} MiB of {one / mib:.0f} MiB in one process ({mine / one:.2f}x).",
        f"Layer-wise tuning: {a['tuning']['steps']} steps; MSE (sum over the layers) {a['tuning']['mse_before']:.6f} -> "
        f"{a['tuning']['mse_after']:.6f} in one process, {b['tuning']['mse_before']:.6f} -> "
        f"{b['tuning']['mse_after']:.6f} under torchrun.",
        f"Largest per-layer difference of the relative output error: one-shot {err('error_rel'):.1e}, tuned "
        f"{err('error_rel_tuned'):.1e}; largest difference between the two saved models' weights: "
        f"{res['max_weight_diff']:.1e}." + (
            f" The torchrun folder against the one written before ({res['before_label']}): largest weight "
            f"difference {res['before_weight_diff']:.1e}; wall {res['sharded_seconds']:.0f} s against "
            f"{res['before_seconds']:.0f} s ({res['sharded_seconds'] / res['before_seconds']:.2f}x)."
            if res.get("before") else "")]) + "\n"


ATTACK = ["--attacks", "finetune,checkpointing,lora", "--lrs", "1e-4", "--steps", "6", "--batch", "2",
          "--block-len", "128", "--train-blocks", "32", "--eval-blocks", "4"]


def render_attack(res: dict) -> str:
    gib, mib = 2 ** 30, 2 ** 20
    procs = ["| run | process | models held between runs | peak RSS after loading | peak RSS, whole run | wall |",
             "|---|---|---|---|---|---|"]
    for name, ps, wall in _runs(res, " (FSDP2)"):
        for p in ps:
            shares = p.get("loaded_param_bytes")
            held = ("structure only (each read into shards per run: " + " + ".join(
                f"{shares[k] / mib:.0f} MiB" for k in ("locked", "original")) + " per rank as read)") if shares \
                else "both whole"
            loaded = f"{p['peak_rss_loaded_bytes'] / gib:.2f} GiB" if p.get("peak_rss_loaded_bytes") else "--"
            procs.append(f"| {name} | rank {p['rank']} | {held} | {loaded} | {p['peak_rss_bytes'] / gib:.2f} GiB | "
                         f"{wall:.0f} s |")
    rows = ["| attack run | step peak, one process | step peak, one rank | s / step, one process | s / step, one rank "
            "| training loss at the last step, one process / sharded | held-out loss at the end, one process / sharded |",
            "|---|---|---|---|---|---|---|"]
    sharded = {r["attack"]: r for r in res["table_sharded"]}
    for a in res["table_one"]:
        b = sharded[a["attack"]]
        rows.append(f"| {a['attack']} | {a['step peak MiB']:.0f} MiB | {b['step peak MiB']:.0f} MiB "
                    f"({b['step peak MiB'] / a['step peak MiB']:.2f}x) | {a['s / step']:.2f} | {b['s / step']:.2f} | "
                    f"{res['last_loss_one'][a['attack']]:.4f} / {res['last_loss_sharded'][a['attack']]:.4f} | "
                    f"{a['held-out loss end']:.4f} / {b['held-out loss end']:.4f} |")
    return "\n".join([f"`mlpsurgery attack dlr {res['locked']} {' '.join(res['args'])}`; machine: {res['machine']}; "
                      f"torch {res['torch']}.", "", *procs, "", *rows]) + "\n"


PHASE1 = ["--layerwise", "--rank", "64", "--calib-blocks", "16", "--block-len", "128", "--phase1-steps", "20",
          "--phase1-tokens", "256", "--onpolicy-steps", "0", "--phase2-steps", "0", "--eval-tokens", "0"]
PHASE2 = ["--phase2-only", "--phase2-steps", "6", "--phase2-blocks", "16", "--phase2-batch", "4", "--block-len", "128",
          "--eval-tokens", "2048"]


def render_phase2(res: dict) -> str:
    gib = 2 ** 30
    rows = ["| run | process | locked model's parameters held after loading | peak RSS after loading both models | "
            "peak RSS, whole run | wall |", "|---|---|---|---|---|---|"]
    for name, procs, wall in _runs(res, " (loaded into shards)", ": each rank loads both whole"):
        for p in procs:
            held = f"{p['loaded_param_bytes'] / 2**20:.0f} MiB" if p.get("loaded_param_bytes") else \
                f"{res['whole_param_bytes'] / 2**20:.0f} MiB (whole)"
            loaded = f"{p['peak_rss_loaded_bytes'] / gib:.2f} GiB" if p.get("peak_rss_loaded_bytes") else "--"
            rows.append(f"| {name} | rank {p['rank']} | {held} | {loaded} | {p['peak_rss_bytes'] / gib:.2f} GiB | "
                        f"{wall:.0f} s |")
    losses = ["| step | loss, one process | loss, sharded | difference |", "|---|---|---|---|"]
    for a, b in zip(res["loss_one"], res["loss_sharded"]):
        losses.append(f"| {a['step']} | {a['loss']:.6f} | {b['loss']:.6f} | {abs(a['loss'] - b['loss']):.1e} |")
    return "\n".join([
        f"`mlpsurgery lock dlr LOCKED {' '.join(res['args'])}` on {res['locked']}; machine: {res['machine']}; "
        f"torch {res['torch']}.", "", *rows, "", *losses, "",
        f"Held-out perplexity ratio: {res['ratio_one']:.4f} (one process) vs {res['ratio_sharded']:.4f} (torchrun); "
        f"largest difference between the two saved models' weights: {res['max_weight_diff']:.1e}."]) + "\n"


def render(res: dict) -> str:
    if res.get("what") == "phase2-only":
        return render_phase2(res)
    if res.get("what") == "attack":
        return render_attack(res)
    if res.get("what") == "lock-dlr":
        return render_lock(res)
    if res.get("what") == "fuse":
        return render_fuse(res)
    mib = 2 ** 20
    rows = ["| run | process | model params | trained params | gradients | AdamW moments | peak RSS before training "
            "| peak RSS in training | wall |", "|---|---|---|---|---|---|---|---|---|"]
    for name, procs, wall in _runs(res, " (FSDP2)"):
        for p in procs:
            m = p["memory"]
            rows.append(f"| {name} | rank {p['rank']} | {m['model_param_bytes'] / mib:.0f} MiB | "
                        f"{m['param_bytes'] / mib:.0f} MiB | {m['grad_bytes'] / mib:.0f} MiB | "
                        f"{m['optimizer_bytes'] / mib:.0f} MiB | {m['peak_rss_before_bytes'] / 2**30:.2f} GiB | "
                        f"{m['peak_rss_training_bytes'] / 2**30:.2f} GiB | {wall:.0f} s |")
    one, two = res["one"][0]["memory"], res["sharded"][0]["memory"]
    held = lambda m: m["model_param_bytes"] + m["grad_bytes"] + m["optimizer_bytes"]  # noqa: E731
    env = "".join(f"; {k}={v}" for k, v in (res.get("env") or {}).items())
    lines = [f"`{res['command']}` on {res['model']}, {res['steps']} steps of batch {res['batch_size']} x "
             f"{res['block_len']} tokens; machine: {res['machine']}; torch {res['torch']}{env}.", "", *rows, "",
             f"Per rank, parameters + gradients + AdamW moments: {held(two) / mib:.0f} MiB of {held(one) / mib:.0f} MiB "
             f"in one process ({held(two) / held(one):.2f}x).", *([
                 "", f"Peak resident memory over the whole run (loading, training and saving included; the kernel's, of "
                 f"the largest process): {res['run_peak_rss_sharded'] / 2**30:.2f} GiB per rank against "
                 f"{res['run_peak_rss_one'] / 2**30:.2f} GiB in one process."] if "run_peak_rss_one" in res else []),
             "",
             "| step | loss, one process | loss, sharded | difference |", "|---|---|---|---|"]
    for a, b in zip(res["loss_one"], res["loss_sharded"]):
        lines.append(f"| {a['step']} | {a['loss']:.6f} | {b['loss']:.6f} | {abs(a['loss'] - b['loss']):.1e} |")
    lines += ["", f"Largest difference between the two saved models' weights: {res['max_weight_diff']:.1e}."]
    return "\n".join(lines) + "\n"


def _both(args, common: list[str], work: Path) -> tuple[list[dict], float, list[dict], float]:
    """(one process's JSON objects, its wall seconds, the ranks' JSON objects, their wall seconds)."""
    one, one_s = run([sys.executable, "-m", "mlpsurgery", *common, "--out", str(work / "one")], args.ranks, "one")
    sharded, sharded_s = _torchrun(args, common, work, "sharded")
    return one, one_s, sharded, sharded_s


def _torchrun(args, common: list[str], work: Path, tag: str, src: str | None = None) -> tuple[list[dict], float]:
    """`mlpsurgery COMMON --out WORK/TAG` under torchrun on args.ranks ranks of one thread each (src: run that
    mlpsurgery source folder)."""
    return run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.ranks),
                "-m", "mlpsurgery", *common, "--out", str(work / tag)], 1, tag, src=src)


def _machine() -> dict:
    import torch

    return {"machine": harness.machine("{arch}, {cores} cores"), "torch": torch.__version__,
            "env": {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")}}  # glibc's allocator settings


def bench_lock(args, work: Path) -> dict:
    given = [a for a in LOCK if a != "--no-layerwise"] + (["--layerwise"] if args.layerwise else ["--no-layerwise"])
    common = ["lock", "dlr", args.model, *given, "--json", "--quiet"]
    one, one_s, sharded, sharded_s = _both(args, common, work)
    main0 = next(o for o in sharded if "out" in o)
    return {"what": "lock-dlr", "model": args.model, "args": given, "ranks": args.ranks, **_machine(),
            "one_seconds": one_s, "sharded_seconds": sharded_s,
            "one": [{"rank": 0, "peak_rss_bytes": one[0]["peak_rss_bytes"]}],
            "sharded": sorted(({"rank": o.get("rank", 0), "peak_rss_bytes": o["peak_rss_bytes"]} for o in sharded),
                              key=lambda p: p["rank"]),
            "report_one": one[0]["report"], "report_sharded": main0["report"],
            "ratio_one": one[0]["heldout_ratio"], "ratio_sharded": main0["heldout_ratio"],
            "perplexity_one": one[0]["perplexity"], "perplexity_sharded": main0["perplexity"],
            "max_weight_diff": _max_diff(str(work / "one"), str(work / "sharded"))}


def bench_fuse(args, work: Path) -> dict:
    given = FUSE + (["--layerwise"] if args.layerwise else [])
    common = ["fuse", args.model, *given, "--json", "--quiet"]
    one, one_s, sharded, sharded_s = _both(args, common, work)
    main0 = next(o for o in sharded if "out" in o)
    return {"what": "fuse", "model": args.model, "args": given, "ranks": args.ranks, **_machine(),
            "one_seconds": one_s, "sharded_seconds": sharded_s,
            "one": [{"rank": 0, "peak_rss_bytes": one[0]["peak_rss_bytes"], "memory": one[0]["tuning"]["memory"]}],
            "sharded": sorted(({"rank": o.get("rank", 0), "peak_rss_bytes": o["peak_rss_bytes"],
                                "memory": o["tuning"]["memory"]} for o in sharded), key=lambda p: p["rank"]),
            "report_one": one[0], "report_sharded": main0,
            "max_weight_diff": _max_diff(str(work / "one"), str(work / "sharded")), **_before(args, common, work)}


def _before(args, common: list[str], work: Path) -> dict:
    """--before SRC: the same torchrun command from an earlier checkout, its ranks' peaks and memory, its wall time,
    and the largest weight difference of its folder from this checkout's torchrun folder."""
    if not args.before:
        return {}
    before, before_s = _torchrun(args, common, work, "before", src=args.before)
    return {"before": sorted(({"rank": o.get("rank", 0), "peak_rss_bytes": o["peak_rss_bytes"],
                               "memory": o["tuning"]["memory"]} for o in before), key=lambda p: p["rank"]),
            "before_seconds": before_s, "before_label": args.before_label or args.before,
            "before_weight_diff": _max_diff(str(work / "before"), str(work / "sharded"))}


def bench_attack(args, work: Path) -> dict:
    if not args.locked:
        sys.exit("--what attack needs --locked FOLDER (made by `mlpsurgery lock dlr`)")
    common = ["attack", "dlr", args.locked, *ATTACK, "--json", "--quiet"]
    one, one_s, sharded, sharded_s = _both(args, common, work)
    main0 = next(o for o in sharded if "out" in o)

    def last(out: str) -> dict:  # each run's training loss at its last step, from the per-run files
        rows = harness.read_json(work / out / "suite.json")["attacks"]
        return {r["name"]: r["history"][-1]["loss"] for r in rows}

    procs = lambda objs: sorted(({k: o.get(k, 0 if k == "rank" else None) for k in (  # noqa: E731
        "rank", "peak_rss_bytes", "peak_rss_loaded_bytes", "loaded_param_bytes", "loaded_into_shards")} for o in objs),
        key=lambda p: p["rank"])
    res = {"what": "attack", "locked": args.locked, "args": ATTACK, "ranks": args.ranks, **_machine(),
           "one_seconds": one_s, "sharded_seconds": sharded_s, "one": procs(one), "sharded": procs(sharded),
           "table_one": one[0]["table"], "table_sharded": main0["table"],
           "last_loss_one": last("one"), "last_loss_sharded": last("sharded")}
    if args.before:  # the torchrun command of an earlier checkout (each rank held both models whole)
        before, before_s = _torchrun(args, common, work, "before", src=args.before)
        res.update(before=procs(before), before_seconds=before_s, before_label=args.before_label or args.before,
                   last_loss_before=last("before"))
    return res


def bench_phase2(args, work: Path) -> dict:
    from mlpsurgery.io import load
    from mlpsurgery.parallel import local_bytes

    locked, shown = args.locked, args.locked
    if not locked:  # phase 1 layer by layer at a small budget (one process, as a user without the devices runs it)
        locked = str(work / "phase1")
        shown = f"{args.model} locked by `lock dlr {' '.join(PHASE1)}`"
        run([sys.executable, "-m", "mlpsurgery", "lock", "dlr", args.model, *PHASE1, "--out", locked, "--json",
             "--quiet"], args.ranks, "phase1")
    common = ["lock", "dlr", locked, *PHASE2, "--json", "--quiet"]
    one, one_s, sharded, sharded_s = _both(args, common, work)
    procs = lambda objs: sorted(({k: o.get(k, 0 if k == "rank" else None) for k in (  # noqa: E731
        "rank", "peak_rss_bytes", "peak_rss_loaded_bytes", "loaded_param_bytes")} for o in objs),
        key=lambda p: p["rank"])
    main0 = next(o for o in sharded if "out" in o)
    whole = load(str(work / "one"))
    res = {"what": "phase2-only", "locked": shown, "args": PHASE2, "ranks": args.ranks, **_machine(),
           "one_seconds": one_s, "sharded_seconds": sharded_s, "one": procs(one), "sharded": procs(sharded),
           "whole_param_bytes": local_bytes(whole.parameters()),
           "loss_one": [{"step": h["step"], "loss": h["loss"]} for h in one[0]["report"]["phase2_history"]],
           "loss_sharded": [{"step": h["step"], "loss": h["loss"]} for h in main0["report"]["phase2_history"]],
           "ratio_one": one[0]["heldout_ratio"], "ratio_sharded": main0["heldout_ratio"],
           "max_weight_diff": _max_diff(str(work / "one"), str(work / "sharded"))}
    del whole
    if args.before:
        before, before_s = _torchrun(args, common, work, "before", src=args.before)
        res.update(before=procs(before), before_seconds=before_s, before_label=args.before_label or args.before)
    return res


def synthetic(args, work: Path) -> str:
    """--synthetic N: a random-weight llama of about N parameters written (by a child process, so this one stays
    small) as bfloat16 safetensors shards into `work`; its description, args.model set to its folder."""
    from memory import write_synthetic_child  # benchmarks/memory.py (this folder is on sys.path)

    folder = work / "synthetic"
    t0 = time.perf_counter()
    count, d, h, depth = write_synthetic_child(str(folder), args.synthetic)
    args.model = str(folder)
    return (f"a synthetic llama, random weights ({count / 1e9:.2f} B parameters: d {d}, MLP {h}, {depth} layers; "
            f"bfloat16 safetensors shards, written in {time.perf_counter() - t0:.0f} s)")


def bench_nest(args, work: Path) -> dict:
    shown = synthetic(args, work) if args.synthetic else args.model
    common = ["nest", args.model, "--train-steps", str(args.steps), "--batch-size", str(args.batch_size),
              "--block-len", str(args.block_len), "--json", "--quiet",
              *(["--dtype", args.dtype] if args.dtype else []), *(["--data", args.data] if args.data else [])]
    one, one_s, sharded, sharded_s = _both(args, common, work)
    procs = sorted(({"rank": o.get("rank", 0), "memory": o["train"]["memory"]} for o in sharded),
                   key=lambda p: p["rank"])
    main0 = next(o for o in sharded if "rank" not in o)
    return {"what": "nest", "model": shown, "steps": args.steps, "ranks": args.ranks,
            "batch_size": args.batch_size, "block_len": args.block_len,
            "command": "mlpsurgery " + " ".join(common[:1] + (["SYNTHETIC"] if args.synthetic else common[1:2])
                                                + common[2:]), **_machine(),
            "one": [{"rank": 0, "memory": one[0]["train"]["memory"]}], "sharded": procs,
            "one_seconds": one_s, "sharded_seconds": sharded_s,
            "run_peak_rss_one": PEAKS["one"], "run_peak_rss_sharded": PEAKS["sharded"],
            "loss_one": [{"step": h["step"], "loss": h["loss"]} for h in one[0]["train"]["history"]],
            "loss_sharded": [{"step": h["step"], "loss": h["loss"]} for h in main0["train"]["history"]],
            "max_weight_diff": _max_diff(str(work / "one"), str(work / "sharded"))}


def main() -> None:
    ap = harness.parser(__doc__, summary=True, json=True, md=True)
    ap.add_argument("--what", choices=["nest", "lock-dlr", "phase2-only", "fuse", "attack"], default="nest")
    ap.add_argument("--locked", help="--what attack / phase2-only: a folder written by `mlpsurgery lock dlr` (for "
                                     "phase2-only with --phase2-steps 0; default: one made at a small budget)")
    ap.add_argument("--before", metavar="SRC", help="--what phase2-only / attack / fuse: also run the torchrun "
                                                     "command from this mlpsurgery source folder (an earlier commit's "
                                                     "src/)")
    ap.add_argument("--before-label", help="how the table names --before (e.g. the commit)")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--block-len", type=int, default=128)
    ap.add_argument("--synthetic", type=float, metavar="N",
                    help="--what nest: a random-weight llama of about N parameters (bfloat16 shards, written to a "
                         "temporary folder and removed) instead of --model")
    ap.add_argument("--dtype", help="--what nest: passed to the command (e.g. bfloat16)")
    ap.add_argument("--data", help="--what nest: passed to the command (default: its own)")
    ap.add_argument("--layerwise", action="store_true", help="--what fuse / lock-dlr: both runs layer by layer "
                                                             "(--layerwise; lock-dlr's default is --no-layerwise)")
    ap.add_argument("--render", help="print the markdown of a JSON written before")
    args = ap.parse_args()
    if args.render:
        print(render(harness.read_json(args.render)), end="")
        return
    work = Path(tempfile.mkdtemp(prefix="fsdp-bench-"))
    try:
        res = {"lock-dlr": bench_lock, "phase2-only": bench_phase2, "fuse": bench_fuse, "nest": bench_nest,
               "attack": bench_attack}[args.what](args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.json:  # (first: a rendering that fails loses no measurement)
        harness.write_json(args.json, res, indent=2)
    text = render(res)
    if args.md:
        harness.write_md(args.md, text)
    print(text, end="")


if __name__ == "__main__":
    main()
