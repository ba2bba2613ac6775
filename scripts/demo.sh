#!/usr/bin/env bash
# The main flow on built-in defaults, offline: synthesize two adapters of the real
# Qwen3-Next-80B-A3B size, audit them, plan the pool, pack it and write its image.
set -euo pipefail
BIN=${1:-.venv/bin}
OUT=${2:-demo-out}
MODEL=qwen3-next-80b-a3b
mkdir -p "$OUT"
run() { printf '\n$ %s\n' "$*"; "$@"; }

run "$BIN/metrale" models
run "$BIN/metrale" synth "$OUT/chat" --model "$MODEL" \
    --modules q_proj,k_proj,v_proj,o_proj,out_proj --rank 16 --force
run "$BIN/metrale" synth "$OUT/code" --model "$MODEL" \
    --modules q_proj,v_proj,out_proj --rank 8 --rslora --dtype f32 --seed 1 --force
run "$BIN/metrale" inspect "$OUT/chat" "$OUT/code" --max-rank 16
run "$BIN/metrale" layout "$OUT/chat" "$OUT/code" --budget 40GiB
run "$BIN/metrale" pack "$OUT/chat" "$OUT/code" --max-loras 8 --out "$OUT/pool.safetensors" --force
printf '\nThe pool image is %s; docs/pool-format.md says how to read it.\n' "$OUT/pool.safetensors"
