#!/usr/bin/env bash
# Train the tiny GPT-MoE on 8 CPU ranks with configs/pp2_ep2_dp2_8rank.json (see launch_cpu.sh).
#   examples/gpt_moe/run_pp2_ep2_dp2_cpu.sh [more flags for pretrain_gpt_moe.py]
exec "$(dirname "${BASH_SOURCE[0]}")/launch_cpu.sh" pp2_ep2_dp2_8rank 8 "$@"
