#!/usr/bin/env bash
# Train the tiny GPT-MoE on CPU ranks (gloo; no GPU needed) with one of configs/*.json:
#   examples/gpt_moe/launch_cpu.sh CONFIG RANKS [more flags for pretrain_gpt_moe.py]
#   examples/gpt_moe/launch_cpu.sh tiny_cpu_4rank 4 --train-iters 100
# Metrics: runs/CONFIG/metrics.jsonl, plot: runs/CONFIG/metrics.png (relative to the repository).
set -euo pipefail
if [ $# -lt 2 ]; then
    echo "usage: $0 CONFIG RANKS [flags for pretrain_gpt_moe.py]   (CONFIG: a name in examples/gpt_moe/configs/)" >&2
    exit 2
fi
CONFIG="$1"
RANKS="$2"
shift 2
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
if [ ! -f "$HERE/configs/$CONFIG.json" ]; then
    echo "error: CONFIG: got $CONFIG; no examples/gpt_moe/configs/$CONFIG.json" >&2
    exit 2
fi
source "$HERE/tiny_model_flags.sh"
cd "$ROOT"
export PATH="$ROOT/.venv/bin:$PATH"   # the launcher starts the ranks with the python it finds first
# DeepSpeed's CPU all-reduce buffers in /dev/shm are named by user, address, port and rank. The
# plugin unlinks them once every rank has mapped them; when the job ends, this removes what a job
# killed before that point left (this job's port only: a concurrent job runs on another port).
PORT="${MASTER_PORT:-29500}"
trap 'rm -f /dev/shm/deepspeed_allreduce_buffer_"$(id -u)"_127.0.0.1_"$PORT"_*' EXIT
deepspeed --master_port "$PORT" --num_gpus "$RANKS" examples/gpt_moe/pretrain_gpt_moe.py \
    --deepspeed_config "examples/gpt_moe/configs/$CONFIG.json" "${TINY_MODEL_FLAGS[@]}" "$@"
