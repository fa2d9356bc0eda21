#!/usr/bin/env bash
# One lent GPU session's checks for issue 16, in priority order, each under its own time limit, so that a short
# lease still brings back what finished: the kernel's tile sweep, the CUDA tests, the CLI smoke run against the CPU,
# the DLR kernel benchmark (each saved as it goes). A stage whose limit is 0 is skipped; TUNE_ARGS are passed to
# the sweep (e.g. --defaults-only), NCU_S (default 0: off) profiles the missed targets' kernels with Nsight Compute,
# TESTS_K selects tests (pytest -k), CROSS_S (default 0: off) times the fused schedules against each other at the
# token counts CROSS_T, SMOKE_ONLY names the smoke run's commands
# (default: all) and SMOKE_PARAMS / SMOKE_D size its model. Logs and results under $OUT (default runs/gpu).
#   bash benchmarks/gpu_session.sh            # on the GPU machine, from the repository root
#   TUNE_S=0 DLR_S=0 SMOKE_ONLY="nest,nest rank" bash benchmarks/gpu_session.sh
set -u
OUT=${OUT:-runs/gpu}
mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
T0=$(date +%s)
stage() {  # stage NAME SECONDS COMMAND...: run it under a time limit, its output to $OUT/NAME.log, tail shown
    local name=$1 limit=$2
    shift 2
    if [ "$limit" = 0 ]; then echo "== $name skipped"; return; fi
    echo "== $name (limit ${limit} s) starts at $(($(date +%s) - T0)) s"
    timeout -k 5 "$limit" "$@" >"$OUT/$name.log" 2>&1
    echo "== $name exit $? at $(($(date +%s) - T0)) s"
    tail -n "${TAIL:-20}" "$OUT/$name.log"
}
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
$PY -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, \
'transformers', transformers.__version__, torch.cuda.get_device_name(), torch.cuda.get_device_properties(0))"
TAIL=30 stage tune "${TUNE_S:-260}" $PY benchmarks/dlr_gpu_tune.py --json "$OUT/dlr-gpu-tune.json" \
    --md "$OUT/dlr-gpu-tune.md" --deadline "$(( ${TUNE_S:-260} - 30 ))" ${TUNE_ARGS:-}
# Nsight Compute on the two missed targets' kernels (the default settings; a few launches each, after warm-up):
# the cols block kernel at T = 16 on the 72-block net, and both gemm kernels at r = 1024, T = 8192
NCU="ncu --launch-skip 40 --launch-count 2 --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \
--section LaunchStats --section WarpStateStats --section SchedulerStats --csv --page details"
stage ncu-cols "${NCU_S:-0}" $NCU --kernel-name regex:_cols_block_kernel $PY benchmarks/dlr_gpu_tune.py \
    --defaults-only --cells 0 --json /tmp/ncu-cols-run.json --md /tmp/ncu-cols-run.md  # (at most 8 files come back)
stage ncu-gemm "${NCU_S:-0}" $NCU --kernel-name regex:_gemm_ $PY benchmarks/dlr_gpu_tune.py \
    --defaults-only --cells 1 --json /tmp/ncu-gemm-run.json --md /tmp/ncu-gemm-run.md
stage tests "${TESTS_S:-120}" $PY -m pytest -q -p no:cacheprovider -rfE tests/test_device.py --device cuda \
    ${TESTS_K:+-k "$TESTS_K"}
stage gpu-smoke "${SMOKE_S:-180}" $PY benchmarks/gpu_smoke.py --device cuda --params "${SMOKE_PARAMS:-2e8}" --parallel \
    --threads 12 --json "$OUT/gpu-smoke.json" --md "$OUT/gpu-smoke.md" --deadline "$(( ${SMOKE_S:-180} - 40 ))" \
    ${SMOKE_D:+--d "$SMOKE_D"} ${SMOKE_ONLY:+--only "$SMOKE_ONLY"}
# the fused schedules against each other at small T (choose_path's threshold; off by default)
stage crossover "${CROSS_S:-0}" $PY benchmarks/dlr_gpu.py --crossover "${CROSS_T:-16,32,64,128,256,512}" \
    --json "$OUT/dlr-gpu-crossover.json" --out "$OUT/dlr-gpu-crossover.md"
TAIL=40 stage dlr-gpu "${DLR_S:-230}" $PY benchmarks/dlr_gpu.py --json "$OUT/dlr-gpu.json" --out "$OUT/dlr-gpu.md" \
    --deadline "${COMPILE_DEADLINE_S:-150}"
echo "== done at $(($(date +%s) - T0)) s"
