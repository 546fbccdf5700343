#!/usr/bin/env bash
# The first run on a GPU machine (docs/benchmarks_history.md, "On a GPU"):
#   examples/gpt_moe/gpu_check.sh [--wheels DIR] [OUT_DIR]   (default: gpu_check_<date>; PYTHON=python)
# --wheels DIR: a machine without network whose Python has torch already: first install the plugin from
#   DIR (`make wheelhouse` here) into OUT_DIR/site with install_wheels.sh (--no-index --no-deps --target,
#   never over the image's torch) and run every check from there.
# 1. oracle:   the MoE layer on CUDA against the loop oracle, every experts backend that runs there, fp32 and bf16
# 2. ep2:      2 ranks (nccl) with EP 2 against the 1-rank layer; skipped with fewer than 2 GPUs
# 3. example:  pretrain_gpt_moe.py itself for 8 steps on 1 GPU and, with 2 GPUs, under tp2 x ep2 (with and
#              without sequence parallelism) and dp2 x ep2, against the 1-GPU losses (OUT_DIR/example/)
# 4. recipe:   the GPU recipe's model (125M-class, 8 experts, bf16, ZeRO-1) for 20 steps on every GPU: tokens/s,
#              step time, MFU against the device's bf16 peak, the memory estimate against max_memory_allocated
# 4b. bench_deepspeed: moe-plugin bench layer --device cuda --dtype bf16 --vs deepspeed
# 5. bench_megatron:  the same against Megatron-Core's MoELayer (alltoall dispatcher, grouped GEMM)
# Each writes OUT_DIR/<check>.jsonl (its JSON lines), .log (stderr) and .status (exit code or "skip: why");
# then OUT_DIR/gpu_check.json gathers them and a table is printed. Exit status 1 when a check failed.
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
PY=${PYTHON:-$(command -v python || command -v python3)}
WHEELS=
if [ "${1:-}" = "--wheels" ]; then
    WHEELS=${2:?usage: gpu_check.sh --wheels DIR [OUT_DIR]}
    shift 2
fi
OUT=${1:-gpu_check_$(date +%Y%m%d_%H%M%S)}
mkdir -p "$OUT"
if [ -n "$WHEELS" ]; then
    SITE="$(cd "$OUT" && pwd)/site"
    PYTHON="$PY" examples/gpt_moe/install_wheels.sh "$WHEELS" "$SITE" || exit 2
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" PATH="$SITE/bin:$PATH"
fi
GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)")
if [ "$GPUS" -lt 1 ]; then
    echo "error: gpu_check.sh needs a CUDA device (torch finds none)" >&2
    exit 2
fi

check() {   # check NAME COMMAND...: run it, keep its output, record its status
    local name=$1; shift
    echo "== $name: $*"
    "$@" > "$OUT/$name.jsonl" 2> "$OUT/$name.log"
    local status=$?
    echo "$status" > "$OUT/$name.status"
    if [ "$status" -eq 0 ]; then echo "   ok"; else echo "   FAILED (exit $status; see $OUT/$name.log)"; fi
}

skip() {    # skip NAME WHY
    echo "== $1: skipped ($2)"
    echo "skip: $2" > "$OUT/$1.status"
}

check oracle "$PY" examples/gpt_moe/gpu_check.py oracle --device cuda
if [ "$GPUS" -ge 2 ]; then
    check ep2 "$PY" -m torch.distributed.run --standalone --nproc_per_node 2 examples/gpt_moe/gpu_check.py ep2 --device cuda
else
    skip ep2 "$GPUS GPU: the 2-rank check needs 2"
fi
check example "$PY" examples/gpt_moe/gpu_check.py example "$OUT/example" --ranks "$(( GPUS >= 2 ? 2 : 1 ))"
check recipe "$PY" examples/gpt_moe/gpu_check.py recipe "$OUT/recipe" --ranks "$GPUS"
check bench_deepspeed "$PY" -m moe_plugin_tools.cli bench layer --device cuda --dtype bf16 --vs deepspeed --json
if "$PY" -c "import transformer_engine" 2> /dev/null || "$PY" -c "import grouped_gemm" 2> /dev/null; then
    check bench_megatron "$PY" -m moe_plugin_tools.cli bench layer --device cuda --dtype bf16 --vs megatron --json
else
    skip bench_megatron "Megatron-Core's grouped GEMM needs transformer_engine or grouped_gemm, neither is installed"
fi
"$PY" examples/gpt_moe/gpu_check.py collect "$OUT"
