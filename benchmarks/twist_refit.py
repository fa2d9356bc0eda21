"""What a calibrated refit adds to TwIST's deployment (docs/twist.md): random subnets of a TwIST-trained SmolLM2
cut out as they are (the paper's no-data step) and with their narrowed MLPs' down projections refit on calibration
text (`twist extract --calib-data`, methods/twist/extraction.py `refit_subnet_`), beside random subnets of the
pretrained model (the control: what the refit does without TwIST training) and the calibrated neuron pruning of the
pretrained model at the same widths in the same layers (the best one-shot structured pruner here).

The TwIST run: ffn chunks at kappa = --keep/12, S = 3 workers, 1 x 128-token batches, repartition interval 15,
constant lr 3e-4, seed 0, --steps batches per worker, masked mode (one process emulates the workers; true mode
computes the same function), on the bundled corpus's training novels; checkpointed every round in OUT/train (a
rerun resumes). Every evaluation is cached in OUT/results.json. Perplexity on --tokens held-out tokens of
Persuasion (never trained or calibrated on); calibration: --calib-blocks blocks of 128 training tokens.

    python benchmarks/twist_refit.py --out runs/twist-refit --json docs/results/twist-refit.json \
        --md docs/results/twist-refit.md
"""

from __future__ import annotations

import copy
import time
from pathlib import Path

import harness


def main() -> None:
    ap = harness.parser(__doc__, json=True, md=True, threads=2)
    ap.add_argument("--out", default="runs/twist-refit")
    ap.add_argument("--steps", type=int, default=90, help="TwIST batches per worker (90, as docs/twist.md's models)")
    ap.add_argument("--keep", type=int, default=6, help="X of X/12 the TwIST run trains at (6)")
    ap.add_argument("--kappas", type=int, nargs="+", default=[6, 4], help="X of X/12 extracted (6 4)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="subnet draws (0 1)")
    ap.add_argument("--tokens", type=int, default=2048, help="held-out tokens scored (2048)")
    ap.add_argument("--calib-blocks", type=int, default=256, help="calibration blocks of 128 tokens (256: 32k)")
    args = ap.parse_args()
    harness.set_threads(args.threads)

    import mlpsurgery as ms
    from mlpsurgery.methods.fusion import FusionConfig, fuse
    from mlpsurgery.methods.twist import TwISTConfig, refit_subnet_, twist_extract, twist_train
    from twist_table1 import Cache

    R = 12
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cache = Cache(out / "results.json")
    settings = {k: getattr(args, k) for k in ("steps", "keep", "tokens", "calib_blocks")}
    if cache.data.setdefault("settings", settings) != settings:
        raise SystemExit(f"{out} holds results made with {cache.data['settings']}, not {settings}: use another --out")
    loaded, corpus, calib = harness.smollm2_calibration(128, args.calib_blocks)
    pretrained = loaded.model
    cfg = TwISTConfig(workers=3, blocks=R, keep=args.keep, parts="ffn", interval=15, steps=args.steps, batch_size=1,
                      lr=3e-4, seed=0)
    layers = cfg.layers(len(ms.find_sites(pretrained)))
    h = ms.find_sites(pretrained).mlp[layers[0]].h

    def ppl(model) -> dict:
        r = ms.perplexity(model, corpus.heldout, block_len=512, max_tokens=args.tokens, progress=False,
                          bos_id=corpus.bos)
        return {"ppl": r.ppl, "tokens": r.tokens, "params": sum(p.numel() for p in model.parameters())}

    def subnet(source, kappa: int, seed: int, refit: bool) -> dict:
        t0 = time.perf_counter()
        sub = twist_extract(source, keep=kappa, blocks=R, parts="ffn", layers=layers, seed=seed)
        errors = refit_subnet_(sub, source, calib, progress=False) if refit else None
        row = {**ppl(sub), "build_s": time.perf_counter() - t0}
        if errors:
            row["error_before"] = sum(e["error_before"] for e in errors.values()) / len(errors)
            row["error_after"] = sum(e["error_after"] for e in errors.values()) / len(errors)
        return row

    def neuron(kappa: int) -> dict:
        m = copy.deepcopy(pretrained)
        t0 = time.perf_counter()
        fuse(m, FusionConfig(width=h * kappa // R, method="neuron", layers=",".join(map(str, layers))),
             progress=False, calib_data=calib)
        return {**ppl(m), "build_s": time.perf_counter() - t0}

    cache.get("pretrained", lambda: ppl(pretrained))
    for kappa in args.kappas:
        cache.get(f"neuron/{kappa}", lambda: neuron(kappa))
        for seed in args.seeds:
            for refit in (False, True):
                cache.get(f"pretrained/{kappa}/{seed}/{'refit' if refit else 'plain'}",
                          lambda: subnet(pretrained, kappa, seed, refit))
    keys = [f"twist/{kappa}/{seed}/{kind}" for kappa in args.kappas for seed in args.seeds
            for kind in ("plain", "refit")] + ["twist/full"]
    if all(k in cache.data for k in keys):  # (the finished run's checkpoint is gone: do not train it again)
        return report(cache, args, layers, calib)
    trained = copy.deepcopy(pretrained)
    t0 = time.time()
    res = twist_train(trained, corpus.blocks("train", 128), cfg, mode="masked", checkpoint_dir=out / "train",
                      progress=True)
    cache.data["train"] = {"steps": res.steps, "seconds": res.seconds}
    print(f"TwIST: {res.steps} batches per worker, {res.seconds:.0f} s ({time.time() - t0:.0f} s this run)")
    cache.get("twist/full", lambda: ppl(trained))
    for kappa in args.kappas:
        for seed in args.seeds:
            for refit in (False, True):
                cache.get(f"twist/{kappa}/{seed}/{'refit' if refit else 'plain'}",
                          lambda: subnet(trained, kappa, seed, refit))
    report(cache, args, layers, calib)


def report(cache, args, layers: list[int], calib) -> None:
    result = {"model": "SmolLM2-135M-Instruct", "layers": layers, "twist": {"keep": args.keep, "steps": args.steps,
              "workers": 3, "interval": 15, "lr": 3e-4, "parts": "ffn"}, "calib_tokens": int(calib.numel()),
              "machine": harness.machine("{arch} CPU, {threads} threads, torch {torch}"), "results": cache.data}
    if args.json:
        harness.write_json(args.json, result)
    if args.md:
        harness.write_md(args.md, markdown(result, args))
    print(markdown(result, args))


def markdown(r: dict, args) -> str:
    d = r["results"]

    def cell(prefix: str, kappa: int, kind: str) -> str:
        vals = [d[f"{prefix}/{kappa}/{s}/{kind}"]["ppl"] for s in args.seeds if f"{prefix}/{kappa}/{s}/{kind}" in d]
        return " / ".join(f"{v:,.1f}" for v in vals) or "-"

    lines = [f"Random ffn subnets of SmolLM2 in layers {r['layers'][0]}-{r['layers'][-1]}, held-out perplexity "
             f"({d['pretrained']['tokens']} tokens of Persuasion; pretrained whole {d['pretrained']['ppl']:.2f}, TwIST "
             f"model whole {d.get('twist/full', {}).get('ppl', float('nan')):.2f}); seeds {', '.join(map(str, args.seeds))}; "
             f"refit on {r['calib_tokens']:,} calibration tokens; TwIST trained at {r['twist']['keep']}/12 for "
             f"{r['twist']['steps']} batches per worker ({d.get('train', {}).get('seconds', 0):.0f} s). "
             f"{r['machine']}.", "",
             "| kappa | pretrained subnet | + refit | TwIST subnet | + refit | neuron pruning of the pretrained (calibrated) |",
             "|---|---|---|---|---|---|"]
    for kappa in args.kappas:
        lines.append(f"| {kappa}/12 | {cell('pretrained', kappa, 'plain')} | {cell('pretrained', kappa, 'refit')} | "
                     f"{cell('twist', kappa, 'plain')} | {cell('twist', kappa, 'refit')} | "
                     f"{d[f'neuron/{kappa}']['ppl']:.1f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
