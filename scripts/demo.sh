#!/usr/bin/env bash
# The README's two stories on built-in defaults, offline. First a vLLM operator's three questions
# (README, Quickstart) for two adapters of the real Qwen3-8B size, answered for vLLM 0.32.0 from
# configs and headers alone (no vLLM, no GPU): will they load and with which flags (inspect
# --engine vllm), how much LoRA memory (layout --engine vllm), which --max-loras the traffic
# needs (simulate --engine vllm). Then the main flow (README, Worked example): synthesize two
# adapters of the real Qwen3-Next-80B-A3B size, audit them, plan the pool, pack it and write its
# image, read the image back (show), check its bytes against the adapters (verify), write a slot
# back as a PEFT adapter (unpack) and size max_loras for a generated workload (simulate).
set -euo pipefail
BIN=${1:-.venv/bin}
OUT=${2:-demo-out}
MODEL=qwen3-next-80b-a3b
# Piped (make demo > log), Rich would lay the tables out 80 columns wide; the README's are 100.
export COLUMNS=${COLUMNS:-100}
mkdir -p "$OUT"
run() { printf '\n$ %s\n' "$*"; "$@"; }

ATTN=q_proj,k_proj,v_proj,o_proj
run "$BIN/metrale" synth "$OUT/operator/chat" --model qwen3-8b --modules q_proj,v_proj --rank 16 \
    --force
run "$BIN/metrale" synth "$OUT/operator/code" --model qwen3-8b --modules "$ATTN" --rank 64 \
    --seed 1 --force
run "$BIN/metrale" inspect "$OUT/operator/chat" "$OUT/operator/code" --engine vllm
run "$BIN/metrale" layout --engine vllm --model qwen3-8b --max-rank 64 --modules "$ATTN" \
    --budget 40GiB
run "$BIN/metrale" simulate --engine vllm --model qwen3-8b --modules "$ATTN" --max-rank 64 \
    --adapters 100 --requests 5000 --max-loras 8,16,32 --max-cpu-loras 64 --target-hit-rate 0.9

run "$BIN/metrale" models
run "$BIN/metrale" synth "$OUT/chat" --model "$MODEL" \
    --modules q_proj,k_proj,v_proj,o_proj,out_proj --rank 16 --force
run "$BIN/metrale" synth "$OUT/code" --model "$MODEL" \
    --modules q_proj,v_proj,out_proj --rank 8 --rslora --dtype f32 --seed 1 --force
run "$BIN/metrale" inspect "$OUT/chat" "$OUT/code" --max-rank 16
run "$BIN/metrale" layout "$OUT/chat" "$OUT/code" --budget 40GiB
run "$BIN/metrale" pack "$OUT/chat" "$OUT/code" --max-loras 8 --out "$OUT/pool.safetensors" --force
run "$BIN/metrale" show "$OUT/pool.safetensors"
run "$BIN/metrale" verify "$OUT/pool.safetensors" "$OUT/chat" "$OUT/code"
run "$BIN/metrale" unpack "$OUT/pool.safetensors" --name code "$OUT/code-unpacked" --force
# The unpacked adapter packs back to the very bytes of slot 1.
run "$BIN/metrale" verify "$OUT/pool.safetensors" "code=$OUT/code-unpacked"
run "$BIN/metrale" simulate --model "$MODEL" --modules q_proj,k_proj,v_proj,o_proj,out_proj \
    --max-rank 16 --workload zipf --adapters 100 --requests 5000 --max-loras 8,16,32,64
printf '\nThe pool image is %s; docs/pool-format.md says how to read it.\n' "$OUT/pool.safetensors"
