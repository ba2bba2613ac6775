#!/usr/bin/env bash
# The checks that need a GPU, as one script for a lent device (an H200): the GPU tests, the
# kernel tests under compute-sanitizer (memcheck, racecheck, synccheck), and the kernel
# benchmark with the roofline model's expectation in every record. Results go to $OUT (or the
# first argument, default gpu-check-out); the exit code is non-zero if any step failed.
#
#   pip install -e '.[test,cuda12]'      # CuPy for the device, pytest and the rest
#   OUT=gpu-out bash scripts/gpu_check.sh
#
# BENCH_ARGS picks the benchmark shapes (default: the shapes the kernels issue sets targets
# for, decode at 1, 64 and 256 tokens and prefill at 4096, ranks 16 and 64), so the whole
# script fits a short device loan; set it to "" for every default shape.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-gpu-check-out}}"
mkdir -p "$out"
if [ -z "${PYTHON:-}" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
bench_args=${BENCH_ARGS---tokens 1 --tokens 64 --tokens 256 --tokens 4096 --rank 16 --rank 64}
sanitizer=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
status=0

step() {  # step NAME COMMAND...: run it, its output to $out/NAME.txt, and note a failure
    local name=$1
    shift
    echo "== $name: $*"
    if ! "$@" > "$out/$name.txt" 2>&1; then
        echo "   FAILED (see $out/$name.txt)"
        status=1
    fi
    tail -n 3 "$out/$name.txt"
}

nvidia-smi > "$out/nvidia-smi.txt" 2>&1 || true
step pytest-gpu "$PYTHON" -m pytest -q -m gpu --require-gpu tests
for tool in memcheck racecheck synccheck; do
    step "sanitizer-$tool" "$sanitizer" --tool "$tool" --error-exitcode 9 \
        --target-processes all "$PYTHON" -m pytest -q -m gpu --require-gpu \
        tests/test_kernels_gpu.py
done
# shellcheck disable=SC2086  # BENCH_ARGS is a list of options
step bench-kernels "$PYTHON" -m metrale_cli bench kernels --json $bench_args
step model "$PYTHON" -m metrale_cli bench kernels --model-only --json $bench_args
exit $status
