"""Benchmarks: ``moe-plugin bench layer`` (our MoE layer vs DeepSpeed's, and the expert-GEMM floor),
``moe-plugin bench step`` (whole training steps of a GPT-MoE vs the same GPT with DeepSpeed's MoE) and
``moe-plugin bench checkpoint`` (the model conversions' time, peak memory and bytes).

The torch-free argument parser is imported eagerly (the CLI imports it); the rest on first use.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from moe_plugin.lazy import lazy_getattr
from moe_plugin_tools.bench.args import add_bench_parser

if TYPE_CHECKING:   # the names _LAZY hands on, for type checkers and go-to-definition
    from moe_plugin_tools.bench.breakdown import time_parts
    from moe_plugin_tools.bench.deepspeed_moe import deepspeed_twin
    from moe_plugin_tools.bench.gpt_models import GPTSpec, build_deepspeed_twin, build_ours
    from moe_plugin_tools.bench.hf_model import HFShape, run_measured, write_hf_model
    from moe_plugin_tools.bench.layer import LayerBenchSpec, bench_layer
    from moe_plugin_tools.bench.layer_ep import run_expert_parallel
    from moe_plugin_tools.bench.memory import MemoryProfile, memory_profile, peak_allocated_bytes
    from moe_plugin_tools.bench.step import bench_step
    from moe_plugin_tools.bench.traffic import deepspeed_bytes_sent, ours_bytes_sent

_LAZY = {"LayerBenchSpec": "layer", "bench_layer": "layer", "MemoryProfile": "memory", "memory_profile": "memory",
         "peak_allocated_bytes": "memory", "deepspeed_twin": "deepspeed_moe", "ours_bytes_sent": "traffic",
         "deepspeed_bytes_sent": "traffic", "time_parts": "breakdown",
         "run_expert_parallel": "layer_ep", "bench_step": "step", "GPTSpec": "gpt_models",
         "build_ours": "gpt_models", "build_deepspeed_twin": "gpt_models", "HFShape": "hf_model",
         "write_hf_model": "hf_model", "run_measured": "hf_model"}

__all__ = ["add_bench_parser", *_LAZY]
__getattr__ = lazy_getattr(__name__, _LAZY)
