#!/usr/bin/env bash
# One member of the scaling study on a GPU cluster (configs and layouts: plan.md next to this file).
#   examples/gpt_moe/scaling/gpu/run_gpu.sh SIZE MODEL HOSTFILE [more flags for pretrain_gpt_moe.py]
#   examples/gpt_moe/scaling/gpu/run_gpu.sh 125m e64-top2 /job/hostfile --data-path data/owt_text_document
# SIZE: 125m or 350m. MODEL: dense, e8-top2, e16-top2, e32-top2, e64-top2, e128-top2.
# HOSTFILE: DeepSpeed's ("node1 slots=8" per line); the configs are planned for 64 GPUs.
# Without --data-path the model trains on the byte-level stdlib corpus; for the real study point
# it at GPT-2 BPE data made with Megatron-LM's tools/preprocess_data.py (vocabulary 50257).
# Every member takes the same flags below, so they see the same tokens; compare them with
#   moe-plugin report runs/gpu_scaling/125m_*
set -euo pipefail
if [ $# -lt 3 ]; then
    echo "usage: $0 SIZE MODEL HOSTFILE [flags for pretrain_gpt_moe.py]" >&2
    exit 2
fi
SIZE="$1"; MODEL="$2"; HOSTFILE="$3"
shift 3
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../../../.." && pwd)"
CONFIG="$HERE/configs/${SIZE}_${MODEL}.json"
case "$SIZE" in
    125m) FLAGS=(--num-layers 12 --hidden-size 768 --num-attention-heads 12 --ffn-hidden-size 3072) ;;
    350m) FLAGS=(--num-layers 24 --hidden-size 1024 --num-attention-heads 16 --ffn-hidden-size 4096) ;;
    *) echo "error: SIZE: got $SIZE; expected 125m or 350m" >&2; exit 2 ;;
esac
if [ ! -f "$CONFIG" ]; then
    echo "error: MODEL: got $MODEL; no $CONFIG (see $HERE/plan.md)" >&2
    exit 2
fi
[ "$MODEL" = dense ] && FLAGS+=(--dense)
cd "$ROOT"
exec deepspeed --hostfile "$HOSTFILE" examples/gpt_moe/pretrain_gpt_moe.py \
    --deepspeed_config "$CONFIG" "${FLAGS[@]}" \
    --seq-length 1024 --max-position-embeddings 1024 --vocab-size 50257 \
    --train-iters 20000 --eval-interval 1000 --eval-iters 20 --log-interval 10 \
    --run-dir "runs/gpu_scaling/${SIZE}_${MODEL}" "$@"
