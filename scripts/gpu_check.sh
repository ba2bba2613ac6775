#!/usr/bin/env bash
# The checks that need a GPU, as one run on a lent device (an H200 with no network): from this
# checkout, with what that machine has (python3 with torch, cupy-cuda13x, transformers, peft,
# pytest, hypothesis, typer, rich, safetensors, regex, huggingface_hub; nvcc, compute-sanitizer,
# nvdisasm), installing nothing.
#
#   bash scripts/gpu_check.sh [--quick] [--dry-run [--json]] OUT_DIR
#
# Steps run in order of value, each under its own `timeout` (budgets below: 400 s in all, 180 s
# with --quick; a lent device gives 15 minutes including its start, so a run must fit 420 s to
# leave time for a second), and a step that fails or runs out of time does not stop the next:
#   device       the device as CuPy and nvidia-smi see it (the memory clock guarded: CUDA 13
#                dropped it from the device properties)
#   correctness  every kernel against the torch reference on the device (pytest -m gpu)
#   pack         the CuPy pack path and the kernels on a real-PEFT pool (pytest -m gpu)
#   bench        a trimmed `metrale bench kernels --json`: each record carries the measured
#                figures beside the model's (expected_us, terms, binding, l2_resident); the
#                measurements' lines, as they are made, are in its log
#   sass         CuPy's compiler (NVRTC) for this device: its machine code through the same
#                SASS counter as nvcc's (metrale_cli.ops.sass)
#   memcheck     compute-sanitizer memcheck over the kernel tests with CuPy's memory pool off
#                (cupy.cuda.set_allocator(None)), so a read past a buffer inside a pooled
#                allocation is caught
#   model        the roofline model for the bench's shapes (CPU only, 2 s on an idle machine:
#                15 s on the device; the dry run gives it 60 s, which holds on a loaded 2-core
#                machine, where its 2 s once took 33)
# A lent device returns at most 8 files from its output folder (16 MiB each, 64 MiB in all, two
# folders deep), so the steps write into a work folder and OUT_DIR gets two files, rewritten
# after every step (a run cut short returns what it finished; scripts/gpu_check_returns.py):
# gpu-check.tar.gz, every step's NAME.json (rc, seconds, timed_out, and the step's own
# results: pytest's per-test outcomes, the bench records, the SASS report), NAME.log with its
# output and its raw files; and summary.json, each step's status, seconds and key figures.
# Exit status: 0 when every step passed.
#
# --dry-run lists the steps with their budgets and what the run returns (--json: {"steps":
# [{"name", "budget_s"}], "total_budget_s", "overhead_s", "fit_s", "returns": {"files",
# "archive"}}) and runs the CPU part (the model) into OUT_DIR's two files;
# tests/test_gpu_check.py runs it in the suite.
set -uo pipefail
cd "$(dirname "$0")/.."

quick=0
dry=0
json=0
out=""
for arg in "$@"; do
    case "$arg" in
        --quick) quick=1 ;;
        --dry-run) dry=1 ;;
        --json) json=1 ;;
        -h|--help) sed -n '2,38p' "$0"; exit 0 ;;
        -*) echo "gpu_check.sh: unknown option $arg (see --help)" >&2; exit 2 ;;
        *) if [ -n "$out" ]; then echo "gpu_check.sh: one OUT_DIR only" >&2; exit 2; fi
           out=$arg ;;
    esac
done
if [ -z "$out" ]; then
    echo "gpu_check.sh: give the directory for the results (bash scripts/gpu_check.sh OUT_DIR)" >&2
    exit 2
fi
if [ $json -eq 1 ] && [ $dry -eq 0 ]; then
    echo "gpu_check.sh: --json goes with --dry-run" >&2
    exit 2
fi
PYTHON=${PYTHON:-python3}

# name budget_s (full) budget_s (--quick), in order of value; 400 s and 180 s in all, which
# with the script's own work between steps (each step's record and the archive: OVERHEAD_S)
# fits FIT_S (tests/test_gpu_check.py checks the sums).
STEPS=(
    "device 10 10"
    "correctness 105 50"
    "pack 50 20"
    "bench 115 45"
    "sass 35 20"
    "memcheck 70 20"
    "model 15 15"
)
FIT_S=420
OVERHEAD_S=20
DRY_MODEL_S=60  # the model step of --dry-run, on whatever CPU machine runs it
# The files each step leaves in the archive beside NAME.log and NAME.json.
declare -A RAW=(
    [device]="device-report.json nvidia-smi.txt" [correctness]="correctness.xml"
    [pack]="pack.xml" [bench]="bench-records.json" [sass]="sass-report.json"
    [memcheck]="memcheck.xml" [model]="model-records.json"
)
ARCHIVE=gpu-check.tar.gz
budget_of() {  # budget_of NAME
    local entry name full short
    for entry in "${STEPS[@]}"; do
        read -r name full short <<< "$entry"
        if [ "$name" = "$1" ]; then
            if [ $quick -eq 1 ]; then echo "$short"; else echo "$full"; fi
            return
        fi
    done
}

if [ $quick -eq 1 ]; then
    bench_args=(--modules q_proj --rank 64 --tokens 1 --tokens 256 --repeats 10)
    memcheck_select=(-k "mixed and y_bf16")
else
    bench_args=(--modules q_proj,k_proj --rank 16 --rank 64 --tokens 1 --tokens 256
                --tokens 4096 --repeats 10)
    memcheck_select=()
fi

total=0
listing=""
members=""
order=""
for entry in "${STEPS[@]}"; do
    read -r name _ _ <<< "$entry"
    budget=$(budget_of "$name")
    total=$((total + budget))
    order+="${order:+ }$name"
    listing+="${listing:+, }{\"name\": \"$name\", \"budget_s\": $budget}"
    for file in "$name.log" "$name.json" ${RAW[$name]}; do
        members+="${members:+, }\"$file\""
    done
done

mkdir -p "$out" || { echo "gpu_check.sh: cannot create $out" >&2; exit 3; }
# Every step writes here; OUT_DIR gets only the archive of it and summary.json.
work=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX") || exit 3
trap 'rm -rf "$work"' EXIT
status=0

record() {  # record NAME RC SECONDS BUDGET: NAME.json and a summary entry
    local name=$1 rc=$2 seconds=$3 budget=$4 timed_out=false
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then timed_out=true; fi
    "$PYTHON" - "$work" "$name" "$rc" "$seconds" "$timed_out" "$budget" <<'EOF'
import json, sys
from pathlib import Path
from xml.etree import ElementTree

out, name, rc, seconds, timed_out, budget = sys.argv[1:]
directory = Path(out)
result = {"name": name, "rc": int(rc), "seconds": int(seconds), "budget_s": int(budget),
          "timed_out": timed_out == "true", "log": f"{name}.log"}
junit = directory / f"{name}.xml"
if junit.is_file():  # pytest's outcomes, test by test
    tests = []
    for case in ElementTree.parse(junit).iter("testcase"):
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[child.tag]
        tests.append({"test": f"{case.get('classname')}::{case.get('name')}",
                      "outcome": outcome, "seconds": float(case.get("time") or 0)})
    result["tests"] = tests
    result["counts"] = {o: sum(t["outcome"] == o for t in tests)
                        for o in ("passed", "failed", "error", "skipped")}
records = directory / f"{name}-records.json"
if records.is_file():  # the bench's and the model's JSON document (none if cut short)
    try:
        result["records"] = json.loads(records.read_text())["records"]
    except ValueError:
        result["records"] = []
report = directory / f"{name}-report.json"  # the device's, the SASS counter's
if report.is_file():
    result["report"] = json.loads(report.read_text())
(directory / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
EOF
    "$PYTHON" scripts/gpu_check_returns.py "$work" "$out" "$ARCHIVE" "$dry" "$quick" "$total" \
        "$order"
}

step() {  # step NAME STDOUT COMMAND...: under the step's timeout; stdout to STDOUT (- : the
    # log), everything else to NAME.log. A step cut by its timeout keeps what it wrote.
    local name=$1 stdout=$2 budget start rc
    shift 2
    budget=$(budget_of "$name")
    if [ $dry -eq 1 ] && [ "$name" = model ]; then budget=$DRY_MODEL_S; fi
    echo "== $name (budget ${budget}s): $*"
    start=$SECONDS
    if [ "$stdout" = "-" ]; then
        timeout --kill-after=5 "$budget" "$@" > "$work/$name.log" 2>&1
    else
        timeout --kill-after=5 "$budget" "$@" > "$stdout" 2> "$work/$name.log"
    fi
    rc=$?
    record "$name" "$rc" $((SECONDS - start)) "$budget"
    if [ "$rc" -ne 0 ]; then
        status=1
        echo "   FAILED rc=$rc (see $name.log in $out/$ARCHIVE)"
    fi
    tail -n 2 "$work/$name.log"
}

model_step() {
    step model "$work/model-records.json" "$PYTHON" -m metrale_cli bench kernels --model-only --json \
        "${bench_args[@]}"
}

if [ $dry -eq 1 ]; then
    if [ $json -eq 1 ]; then
        echo "{\"steps\": [$listing], \"total_budget_s\": $total, \"overhead_s\": $OVERHEAD_S, \"fit_s\": $FIT_S, \"returns\": {\"files\": [\"$ARCHIVE\", \"summary.json\"], \"archive\": [$members]}}"
    else
        for entry in "${STEPS[@]}"; do
            read -r name _ _ <<< "$entry"
            printf '%-12s %4ss\n' "$name" "$(budget_of "$name")"
        done
        printf '%-12s %4ss, and %ss of the script'"'"'s own: within %ss\n' total "$total" \
            "$OVERHEAD_S" "$FIT_S"
        echo "returns: $out/$ARCHIVE (every step's files) and $out/summary.json"
    fi
    model_step > /dev/null 2>&1
    exit $status
fi

pytest_args=(-q -p no:cacheprovider -m gpu --require-gpu)
step device - "$PYTHON" -m metrale_cli.bench.kernels --device-report "$work/device-report.json"
nvidia-smi > "$work/nvidia-smi.txt" 2>&1 || true
step correctness - "$PYTHON" -m pytest "${pytest_args[@]}" --junitxml="$work/correctness.xml" \
    tests/test_kernels_gpu.py tests/test_expert_kernels_gpu.py
step pack - "$PYTHON" -m pytest "${pytest_args[@]}" --junitxml="$work/pack.xml" \
    tests/test_pool_device_path.py tests/test_kernels_end_to_end.py
step bench "$work/bench-records.json" "$PYTHON" -m metrale_cli bench kernels --json "${bench_args[@]}"
step sass - "$PYTHON" -m metrale_cli.ops.sass --nvrtc-device --out "$work/sass-report.json"
sanitizer=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
step memcheck - "$sanitizer" --tool memcheck --error-exitcode 9 --target-processes all \
    "$PYTHON" -c "import sys, cupy, pytest; cupy.cuda.set_allocator(None); \
sys.exit(pytest.main(sys.argv[1:]))" "${pytest_args[@]}" --junitxml="$work/memcheck.xml" \
    tests/test_kernels_gpu.py "${memcheck_select[@]}"
model_step
exit $status
