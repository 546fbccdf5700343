#!/usr/bin/env bash
# Train the tiny GPT-MoE on 8 CPU ranks with configs/pp2_ep2_dp2_8rank.json (gloo; no GPU needed).
#   examples/gpt_moe/run_pp2_ep2_dp2_cpu.sh [more flags for pretrain_gpt_moe.py]
# Metrics: runs/pp2_ep2_dp2_8rank/metrics.jsonl, plot: runs/pp2_ep2_dp2_8rank/metrics.png (relative to the repository).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
source "$HERE/tiny_model_flags.sh"
cd "$ROOT"
export PATH="$ROOT/.venv/bin:$PATH"   # the launcher starts the ranks with the python it finds first
exec deepspeed --num_gpus 8 examples/gpt_moe/pretrain_gpt_moe.py \
    --deepspeed_config examples/gpt_moe/configs/pp2_ep2_dp2_8rank.json "${TINY_MODEL_FLAGS[@]}" "$@"
