"""DLR-Lock on SmolLM2: held-out perplexity ratio (locked / original) against distillation CPU time, from the
committed `lock dlr --json` results, with a power-law extrapolation to the issue's targets.

Points (all r = 64 / depth 36, austen+r8-train, 2 threads; the first five 128 captured blocks and 256 tokens per
layer per step;
x = the recorded stage seconds: closed-form start + phase 1 + on-policy + phase 2, without capture, teacher targets
and evaluations):

- phase 1 (900 steps) only, and + phase 2 (80 steps): docs/results/dlr-smollm2-third.json (the third run)
- + 300 on-policy steps (mix 0.5) or + 300 steps on the teacher's inputs (mix 0):
  docs/results/dlr-onpolicy-ab-mix05.json, dlr-onpolicy-ab-mix0.json
- + 300 on-policy steps + phase 2: docs/results/dlr-smollm2-onpolicy.json
- run 4 (256 captured blocks, 700 phase-1 steps of 512 tokens, 230 on-policy steps, 60 phase-2 steps):
  docs/results/dlr-smollm2-run4.json, after the on-policy steps and after phase 2
- run 5, run 4's command again (the lock the adaptation-cost table is measured on): docs/results/dlr-smollm2-run5.json;
  its phase 1 shared the CPU with another job for about 20 minutes, so its seconds read high
- run 5's capture, phase 1 and on-policy nets (its work folder, hard-linked without the phase-2 files) with longer
  phase 2s: 240 steps over the same 256 teacher-labelled blocks (docs/results/dlr-smollm2-phase2-240.json), 480
  steps over 512 blocks (dlr-smollm2-phase2-480.json); their earlier stages' seconds are run 5's
- the defaults in one call (`mlpsurgery lock dlr --out L --workdir W --json`, nothing else given: phase 1 layer by
  layer, 256 captured blocks, 700 x 512 + 233 on-policy steps, then 480 phase-2 steps over 512 blocks):
  docs/results/dlr-smollm2.json, after phase 1 and after phase 2, scored on 8,192 held-out tokens (every point is
  scored on its own run's `--eval-tokens`); its first 48 phase-2 steps ran eagerly (788 s), the rest compiled

The best lock at each time (the lower envelope) is fitted as ratio - 1 = c * t^-b in log-log, per corpus, and
extrapolated to ratio 1.10 (Persuasion) / 1.25 (R8): a rough reading of the budget the present recipe would need
if it kept improving at the rate of its last stages, not a measurement.

    python benchmarks/notes/dlr_ratio_curve.py --out docs/img/dlr-ratio-vs-time.png \\
        --json docs/results/dlr-ratio-curve.json
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the harness
import harness  # noqa: E402

RESULTS = harness.ROOT / "docs" / "results"
TARGETS = {"heldout": 1.10, "second_corpus": 1.25}
NAMES = {"heldout": "Persuasion (held out)", "second_corpus": "R8 news (test)"}


def points() -> list[dict]:
    """(label, seconds, ratio per corpus) of every stage measured."""
    out = []

    def add(label: str, path: str, stage: str, stages: tuple[str, ...]):
        d = harness.read_json(RESULTS / path)
        rep, ppl = d["report"], d["perplexity"]
        secs = sum(rep.get(f"{s}_seconds", 0.0) for s in stages)
        out.append({"label": label, "seconds": secs, "source": path,
                    **{c: ppl[stage][c] / ppl["original"][c] for c in TARGETS}})

    add("phase 1 (900 steps)", "dlr-smollm2-third.json", "phase1", ("start", "phase1"))
    add("phase 1 + phase 2 (third run)", "dlr-smollm2-third.json", "phase2", ("start", "phase1", "phase2"))
    add("+ 300 steps, teacher's inputs", "dlr-onpolicy-ab-mix0.json", "phase1", ("start", "phase1", "onpolicy"))
    add("+ 300 on-policy steps", "dlr-onpolicy-ab-mix05.json", "phase1", ("start", "phase1", "onpolicy"))
    add("+ 300 on-policy steps + phase 2", "dlr-smollm2-onpolicy.json", "phase2",
        ("start", "phase1", "onpolicy", "phase2"))
    add("run 4: 700 x 512 + 230 on-policy", "dlr-smollm2-run4.json", "phase1", ("start", "phase1", "onpolicy"))
    add("run 4: + phase 2 (60 steps)", "dlr-smollm2-run4.json", "phase2", ("start", "phase1", "onpolicy", "phase2"))
    add("run 5 (run 4 repeated): + 230 on-policy", "dlr-smollm2-run5.json", "phase1", ("start", "phase1", "onpolicy"))
    add("run 5: + phase 2", "dlr-smollm2-run5.json", "phase2", ("start", "phase1", "onpolicy", "phase2"))
    add("run 5's nets + phase 2 (240 steps)", "dlr-smollm2-phase2-240.json", "phase2",
        ("start", "phase1", "onpolicy", "phase2"))
    add("run 5's nets + phase 2 (480 steps, 512 blocks)", "dlr-smollm2-phase2-480.json", "phase2",
        ("start", "phase1", "onpolicy", "phase2"))
    add("the defaults in one call: phase 1 layer by layer", "dlr-smollm2.json", "phase1",
        ("start", "phase1", "onpolicy"))
    add("the defaults in one call: + phase 2 (480 steps)", "dlr-smollm2.json", "phase2",
        ("start", "phase1", "onpolicy", "phase2"))
    return sorted(out, key=lambda p: p["seconds"])


def envelope(pts: list[dict], corpus: str) -> list[dict]:
    """The best ratio reached by each time: points that beat every earlier one."""
    best, out = math.inf, []
    for p in pts:
        if p[corpus] < best:
            best = p[corpus]
            out.append(p)
    return out


def fit(env: list[dict], corpus: str) -> dict:
    """Least-squares line through (log t, log(ratio - 1)) of the envelope; seconds to reach the target."""
    xs = [math.log(p["seconds"]) for p in env]
    ys = [math.log(p[corpus] - 1) for p in env]
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    a = my - b * mx
    target = TARGETS[corpus]
    return {"exponent": b, "log_c": a, "target": target,
            "seconds_to_target": math.exp((math.log(target - 1) - a) / b) if b < 0 else None}


def main() -> None:
    p = harness.parser(__doc__, json=True)
    p.add_argument("--out", default="docs/img/dlr-ratio-vs-time.png")
    args = p.parse_args()
    pts = points()
    fits = {c: fit(envelope(pts, c), c) for c in TARGETS}
    for pt in pts:
        print(f"{pt['seconds']:7.0f} s  {pt['heldout']:5.2f}  {pt['second_corpus']:5.2f}  {pt['label']}")
    for c, f in fits.items():
        t = f["seconds_to_target"]
        print(f"{NAMES[c]}: ratio - 1 ~ t^{f['exponent']:.2f}; {f['target']} at about "
              + (f"{t:,.0f} s ({t / 3600:.1f} h)" if t else "never (no improvement)"))

    from mlpsurgery.report import pyplot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for c, colour in zip(TARGETS, ("tab:blue", "tab:orange")):
        ax.scatter([q["seconds"] / 60 for q in pts], [q[c] for q in pts], color=colour, label=NAMES[c], zorder=3)
        env = envelope(pts, c)
        ax.plot([q["seconds"] / 60 for q in env], [q[c] for q in env], color=colour, lw=1.5)
        f = fits[c]
        if f["seconds_to_target"]:
            ts = [env[-1]["seconds"], f["seconds_to_target"]]
            ax.plot([t / 60 for t in ts], [1 + math.exp(f["log_c"]) * t ** f["exponent"] for t in ts],
                    color=colour, ls=":", lw=1.2)
        ax.axhline(f["target"], color=colour, ls="--", lw=0.8)
    for q in pts:
        ax.annotate(q["label"], (q["seconds"] / 60, q["heldout"]), fontsize=7, xytext=(4, 4),
                    textcoords="offset points")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("distillation time, minutes (2-core CPU; log)")
    ax.set_ylabel("perplexity locked / original (log)")
    ax.set_title("DLR-Lock, SmolLM2, r = 64 / depth 36: quality vs CPU time\n"
                 "(lines: best so far; dotted: power-law extrapolation; dashed: targets)", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=120)
    if args.json:
        harness.write_json(args.json, {"points": pts, "fits": fits})


if __name__ == "__main__":
    main()
