#!/usr/bin/env bash
# Train the tiny GPT-MoE on 4 CPU ranks with configs/tiny_cpu_4rank.json (gloo; no GPU needed).
#   examples/gpt_moe/run_tiny_cpu.sh [more flags for pretrain_gpt_moe.py]
# Metrics: runs/tiny_cpu_4rank/metrics.jsonl, plot: runs/tiny_cpu_4rank/metrics.png (relative to the repository).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
source "$HERE/tiny_model_flags.sh"
cd "$ROOT"
export PATH="$ROOT/.venv/bin:$PATH"   # the launcher starts the ranks with the python it finds first
exec deepspeed --num_gpus 4 examples/gpt_moe/pretrain_gpt_moe.py \
    --deepspeed_config examples/gpt_moe/configs/tiny_cpu_4rank.json "${TINY_MODEL_FLAGS[@]}" "$@"
