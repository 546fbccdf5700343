"""The run summary's memory per rank: the busiest rank's peak part by part (weights, optimizer, gradients,
DeepSpeed's buffers, activations, runtime), and the stop at start when it does not fit (``check_fits``).
The rules: docs/design/memory_estimate.md; the estimate against measured runs: docs/training.md.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional

from deepspeed.moe.utils import is_moe_param
from torch import nn

from moe_plugin.configs.errors import ConfigError

RUNTIME_SLACK_MB = 350.0
DEFAULT_REDUCE_BUCKET = int(5e8)   # DeepSpeed's zero_optimization.reduce_bucket_size default
SAVED_BYTES = 12   # a checkpoint's bytes per trained parameter: value (or fp32 master) and Adam's two moments
SYNC_SAVE_BYTES = 12   # a synchronous save, per local expert element of one MoE layer
_MB = 2 ** 20


@dataclass(frozen=True)
class Shape:
    """What the activations depend on (None where the model does not say)."""

    layers: int          # transformer layers on this rank
    hidden: int
    kv_hidden: int
    heads: int
    vocab: int           # 0 on a rank without the output layer
    ffn_width: int       # F1 of an expert (2 F with swiglu)
    top_k: int
    seq_length: Optional[int]
    micro_batch: int
    tp: int
    recompute: bool


def local_counts(params: list) -> tuple[int, int]:
    """(dense, expert) trained elements among ``params``, each tensor once."""
    seen: set = set()
    dense = expert = 0
    for p in params:
        if id(p) in seen or not p.requires_grad:
            continue
        seen.add(id(p))
        if is_moe_param(p):
            expert += p.numel()
        else:
            dense += p.numel()
    return dense, expert


def model_shape(model: nn.Module, moe_config: Any, sizes: Any, micro_batch: int, args: Any) -> Optional[Shape]:
    """The activations' shape from the model's Megatron ``TransformerConfig`` (None for another model)."""
    config = next((m.config for m in model.modules() if _is_transformer_config(getattr(m, "config", None))), None)
    if config is None:
        return None
    layers = sum(1 for m in model.modules() if hasattr(m, "self_attention") and hasattr(m, "mlp"))
    heads = config.num_attention_heads
    kv = (config.num_query_groups or heads) * config.kv_channels
    vocab = max((m.weight.shape[0] * sizes.tp for n, m in model.named_modules()
                 if n.endswith("output_layer") and getattr(m, "weight", None) is not None), default=0)
    seq = getattr(args, "seq_length", None) or max(
        (getattr(m, "max_sequence_length", 0) or 0 for m in model.modules()), default=0) or None
    width = moe_config.ffn_hidden_size or config.ffn_hidden_size
    width = 2 * width if moe_config.activation == "swiglu" else width
    return Shape(layers=layers, hidden=config.hidden_size, kv_hidden=kv, heads=heads,
                 vocab=vocab, ffn_width=width, top_k=moe_config.k, seq_length=seq, micro_batch=micro_batch,
                 tp=sizes.tp, recompute=getattr(config, "recompute_granularity", None) == "full")


def _is_transformer_config(config: Any) -> bool:
    return all(hasattr(config, a) for a in ("hidden_size", "num_attention_heads", "kv_channels", "ffn_hidden_size"))


def activation_bytes(shape: Optional[Shape], w: int) -> int:
    """One micro-batch's activations kept for backward (0 where the sequence length is unknown)."""
    if shape is None or shape.seq_length is None:
        return 0
    s, b, h = shape.seq_length, shape.micro_batch, shape.hidden
    if shape.recompute:
        per_layer = s * b * h * w
    else:
        per_layer = (s * b * (8 * h + 2 * shape.kv_hidden + shape.top_k * (2 * h + shape.ffn_width)) * w
                     + 2 * shape.heads * s * s * b * w) // shape.tp
    return shape.layers * per_layer + 3 * s * b * shape.vocab * 4 // shape.tp


def estimate(counts: tuple[int, int], sizes: Any, zero_stage: int, dtype: str, ds_config: dict,
             shape: Optional[Shape], runtime_bytes: float, moe_layer_expert_elements: int) -> dict:
    """MiB of each part on this rank (``steady`` between steps, ``total`` the peak); ``counts``: (dense, expert)."""
    dense, expert = counts
    n = dense + expert
    share = dense / sizes.dp + expert / sizes.edp   # its partition of the optimizer state under ZeRO-1/2
    s = share if zero_stage >= 1 else n
    w = 4 if dtype == "fp32" else 2
    if dtype == "fp32":
        masters = 0.0
    elif zero_stage == 0 and dtype == "fp16":
        masters = 4.0 * n
    else:
        masters = 4.0 * share
    optimizer = 8.0 * s + masters
    zero = ds_config.get("zero_optimization") or {}
    if zero_stage == 0:
        grads = n * w + (0 if dtype == "fp32" else 4 * n)
        buffers = n * w if dtype == "fp32" else 0
        kept = n * w if dtype == "fp32" else 0
    else:
        grads = n * w if zero_stage == 1 else 4.0 * s
        bucket = min(reduce_bucket(ds_config), n) * (4 if zero_stage == 1 else w)
        bucket *= 2 if zero.get("overlap_comm", False) else 1
        flat = s * w + (4.0 * s if w != 4 else 0)
        buffers = max(bucket, flat) if zero_stage == 1 else bucket
        kept = 0
    activations = activation_bytes(shape, w)
    steady = runtime_bytes + n * w + optimizer + kept
    sync_save = SYNC_SAVE_BYTES * moe_layer_expert_elements
    step = steady - kept + grads + buffers + activations
    total = max(step, steady + sync_save)
    parts = {"weights": n * w, "optimizer": optimizer, "grads": grads, "buffers": buffers,
             "activations": activations, "runtime": runtime_bytes, "steady": steady, "total": total}
    return {k: v / _MB for k, v in parts.items()}


def reduce_bucket(ds_config: dict) -> int:
    """Elements of DeepSpeed's reduce bucket (ZeRO-1/2)."""
    zero = ds_config.get("zero_optimization") or {}
    return int(float(zero.get("reduce_bucket_size", DEFAULT_REDUCE_BUCKET)))


def runtime_baseline(device_type: str) -> float:
    """Bytes of the runtime: on CPU the resident memory now plus ``RUNTIME_SLACK_MB``; 0 elsewhere."""
    if device_type != "cpu":
        return 0.0
    return resident_bytes() + RUNTIME_SLACK_MB * _MB


def resident_bytes() -> float:
    """This process's resident set now (Linux ``/proc/self/statm``; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0.0


def available_bytes(device_type: str, local_ranks: int) -> Optional[float]:
    """The memory this rank may use (CPU: its share of ``MemAvailable`` plus its RSS; CUDA: free), or None."""
    if device_type == "cpu":
        try:
            with open("/proc/meminfo") as f:
                info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
        except (OSError, ValueError, IndexError):
            return None
        if "MemAvailable" not in info:
            return None
        return info["MemAvailable"] / max(local_ranks, 1) + resident_bytes()
    if device_type == "cuda":
        import torch

        try:
            return float(torch.cuda.mem_get_info()[0])
        except (RuntimeError, AssertionError):   # no CUDA runtime behind the accelerator (a test's fake)
            return None
    return None


def check_fits(memory: dict, device_type: str, enabled: bool) -> Optional[ConfigError]:
    """None if the estimate fits (or the check is off, or the memory unknown), else the one-line refusal."""
    available = memory.get("available")
    if not enabled or available is None or memory["total"] <= available:
        return None
    fits = [f"{label} ({mb:,.0f} MiB)" for label, mb in memory.get("alternatives", {}).items() if mb <= available]
    where = ("host memory per rank (MemAvailable over this node's ranks)" if device_type == "cpu"
             else "free device memory")
    hint = ("would fit: " + "; ".join(fits)) if fits else \
        "neither ZeRO stage 2 nor a smaller reduce bucket would fit: more ranks or a smaller model"
    return ConfigError(
        "memory per rank", memory["total"],
        f"the {where} is {available:,.0f} MiB; {hint}; \"memory_check\": false in the \"moe\" block goes on anyway",
        shown=f"an estimated peak of {memory['total']:,.0f} MiB (weights {memory['weights']:,.0f} + optimizer "
              f"{memory['optimizer']:,.0f} + gradients {memory['grads']:,.0f} + buffers {memory['buffers']:,.0f} + "
              f"activations {memory['activations']:,.0f} + runtime {memory['runtime']:,.0f})")
