#!/bin/bash
# Issue 45: NSN's multi-rank training from the whitened start on SmolLM2 (the MLPs of the last 20 layers nested, the
# frontier's setting), against the untrained start, every rank from 25% to 100% of the nested projections' dense
# FLOPs (ranks 105 / 209 / 314 / 419; 576 = exact) on 2,048 held-out Persuasion tokens in windows of 512 (the
# frontier's protocol). STEPS multi-rank steps (uncertainty objective, curriculum, batches of 8 x 128 train tokens).
#     bash benchmarks/notes/nsn_smollm2_training.sh runs/nsn-smollm2 40
set -euo pipefail
OUT=${1:?usage: nsn_smollm2_training.sh OUT [STEPS]}
STEPS=${2:-40}
MS=${MS:-.venv/bin/mlpsurgery}
export OMP_NUM_THREADS=2
mkdir -p "$OUT"
RANKS=105,209,314,419,576
sweep() { $MS nest sweep "$OUT/$1" --ranks $RANKS --block-len 512 --max-tokens 2048 --json --quiet > "$OUT/$1.sweep.json"; }
[ -f "$OUT/start.sweep.json" ] || { $MS nest smollm2 --out "$OUT/start" --layers last2/3 --quiet --overwrite --json \
    > "$OUT/start.json"; sweep start; rm -rf "$OUT/start"; }
[ -f "$OUT/trained.sweep.json" ] || { /usr/bin/time -f "%e" -o "$OUT/trained.seconds" $MS nest smollm2 --out "$OUT/trained" \
    --layers last2/3 --train-steps "$STEPS" --ranks $RANKS --quiet --overwrite --json > "$OUT/trained.json"; sweep trained;
    rm -rf "$OUT/trained"; }
python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
for name in ("start", "trained"):
    rows = json.load(open(f"{out}/{name}.sweep.json"))
    print(name, json.dumps(rows)[:2000])
PY
