#!/usr/bin/env bash
# The GPU figures of docs/benchmarks.md in one prepared run on a CUDA machine, in under 10 minutes:
#
#   1. the overhead benchmark at GradWatch()'s defaults (benchmarks/overhead.py --defaults) under bf16-mixed and
#      16-mixed, on the GPU;
#   2. one applied check's cost in training steps on the GPU (benchmarks/applied.py --cost-only --device cuda);
#   3. float64's price on the device, a check's memory against the step's, and the checks' verdicts and cost under
#      32-true with TF32 off and on, bf16-mixed and 16-mixed (benchmarks/gpu_checks.py --device cuda);
#   4. the CUDA tests (tests/test_cuda.py; they skip without CUDA, so they never run in CI, which has no GPU).
#
# Usage, from anywhere: bash benchmarks/gpu.sh [--device cuda|cpu] [OUT_DIR]   (default benchmarks/gpu-results; each
# step's output is written there as markdown, and a summary of which steps passed). Every step has its own time limit,
# so that one that hangs cannot keep the others from running (limits sum to 9.2 minutes); the exit status is non-zero
# when a step failed or ran out of time. With --device cuda (the default) it needs a CUDA device and refuses to run
# without one. --device cpu is the dry run CI makes (tests/test_gpu_script.py): steps 2 to 4 on the CPU with tiny
# sizes (step 1's Lightning runs are left out: their shortest table takes minutes on a CPU), so that the script is
# known to run end to end before it meets a GPU; its times are not figures.
set -uo pipefail

cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
DEVICE=cuda
if [ "${1:-}" = "--device" ]; then
    DEVICE="${2:-}"
    shift 2
fi
case "$DEVICE" in
    cuda | cpu) ;;
    *) echo "benchmarks/gpu.sh: --device must be cuda or cpu; got '$DEVICE'" >&2; exit 2 ;;
esac
OUT="${1:-benchmarks/gpu-results}"
mkdir -p "$OUT"

if [ "$DEVICE" = cuda ]; then
    if ! python -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
        echo "benchmarks/gpu.sh needs a CUDA device (torch.cuda.is_available() is False); --device cpu is the dry run" >&2
        exit 2
    fi
    python -c 'import torch; print(torch.__version__, torch.cuda.get_device_name())' | tee "$OUT/device.txt"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >>"$OUT/device.txt" 2>/dev/null || true
else
    python -c 'import torch; print(torch.__version__, "cpu (dry run)")' | tee "$OUT/device.txt"
fi

failed=0
step() {  # step NAME SECONDS COMMAND...: run COMMAND with a time limit, its output to OUT/NAME.md and the terminal
    local name=$1 limit=$2
    shift 2
    echo "== $name (limit ${limit}s): $*"
    local started=$SECONDS
    timeout --signal=TERM --kill-after=10 "$limit" "$@" 2>&1 | tee "$OUT/$name.md"
    local status=${PIPESTATUS[0]}
    echo "$name: exit $status after $((SECONDS - started))s" | tee -a "$OUT/summary.txt"
    [ "$status" -eq 0 ] || failed=1
}

: >"$OUT/summary.txt"
if [ "$DEVICE" = cuda ]; then
    step overhead-bf16-mixed 170 python benchmarks/overhead.py --defaults --accelerator gpu --precision bf16-mixed
    step overhead-16-mixed 170 python benchmarks/overhead.py --defaults --accelerator gpu --precision 16-mixed
    step applied-cost 60 python benchmarks/applied.py --cost-only --device cuda --steps 50
    step gpu-checks 60 python benchmarks/gpu_checks.py --device cuda
else
    step applied-cost 150 python benchmarks/applied.py --cost-only --device cpu --steps 2
    step gpu-checks 150 python benchmarks/gpu_checks.py --device cpu --tiny
fi
step cuda-tests 90 python -m pytest tests/test_cuda.py -q -rs -p no:cacheprovider
exit $failed
