#!/usr/bin/env bash
# Train the tiny GPT-MoE on 4 CPU ranks with configs/tiny_cpu_4rank.json (see launch_cpu.sh).
#   examples/gpt_moe/run_tiny_cpu.sh [more flags for pretrain_gpt_moe.py]
exec "$(dirname "${BASH_SOURCE[0]}")/launch_cpu.sh" tiny_cpu_4rank 4 "$@"
