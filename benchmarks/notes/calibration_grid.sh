#!/bin/bash
# Issue 45, one-shot half-width / 0.75 neuron pruning of SmolLM2's last 20 MLPs: calibration size, block length and
# selection (output energy vs greedy structured OBS). Each variant is `mlpsurgery fuse` then `mlpsurgery eval ppl` on
# 2,048 held-out Persuasion tokens; a line "name seconds ppl" per variant goes to OUT/results.txt (rerun: finished
# variants are skipped). Results: docs/results/calibration-grid-smollm2.md. Run from the repository root:
#     bash benchmarks/notes/calibration_grid.sh runs/calibration-grid
set -euo pipefail
OUT=${1:?usage: calibration_grid.sh OUT}
mkdir -p "$OUT"
export OMP_NUM_THREADS=2
MS=${MS:-.venv/bin/mlpsurgery}
run() { name=$1; shift
  [ -f "$OUT/$name.ppl.json" ] && return
  start=$(date +%s.%N)
  $MS fuse smollm2 --out "$OUT/$name" --method neuron --quiet --overwrite "$@" > "$OUT/$name.fuse.log" 2>&1
  secs=$(python3 -c "import time; print(round(time.time() - $start, 1))")
  $MS eval ppl "$OUT/$name" --max-tokens 2048 --json --quiet > "$OUT/$name.ppl.json"
  echo "$name $secs $(python3 -c "import json; print(json.load(open('$OUT/$name.ppl.json'))['ppl'])")" >> "$OUT/results.txt"
  rm -rf "$OUT/$name"
}
run n05-8k-len512 --width 768 --calib-blocks 16 --calib-len 512
run n05-32k-obs --width 768 --calib-blocks 256 --importance obs
run n05-32k-len512 --width 768 --calib-blocks 64 --calib-len 512
run n05-128k --width 768 --calib-blocks 1024
run n075-32k --width 1152 --calib-blocks 256
run n075-32k-obs --width 1152 --calib-blocks 256 --importance obs
run n075-32k-len512 --width 1152 --calib-blocks 64 --calib-len 512
