#!/usr/bin/env bash
# A GPT-125M-class MoE on 8 GPUs (not run in this repository's CI; sizes for reference).
#   examples/gpt_moe/run_gpu_125m.sh [8|64] [--data-path PREFIX] [more flags]
# 8 or 64 experts on every other layer, expert parallelism 8 (one or eight experts per GPU),
# bf16, ZeRO-1. Without --data-path it trains on the byte-level stdlib corpus; point it at data
# preprocessed with Megatron-LM's tools/preprocess_data.py (GPT-2 BPE) for a real run.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
EXPERTS="${1:-8}"
shift || true
cd "$ROOT"
export PATH="$ROOT/.venv/bin:$PATH"
exec deepspeed --num_gpus 8 examples/gpt_moe/pretrain_gpt_moe.py \
    --deepspeed_config "examples/gpt_moe/configs/gpu_125m_${EXPERTS}experts_8gpu.json" \
    --num-layers 12 --hidden-size 768 --num-attention-heads 12 --ffn-hidden-size 3072 \
    --seq-length 1024 --max-position-embeddings 1024 --micro-batch-size 8 \
    --train-iters 20000 --eval-interval 1000 --eval-iters 20 --log-interval 10 \
    --save checkpoints/gpt_125m_moe${EXPERTS} --save-interval 2000 "$@"
