"""Megatron-Core's own ``MoELayer`` with the sizes of a ``bench layer`` configuration (``--vs megatron``).

``megatron_twin(spec)`` builds ``megatron.core.transformer.moe.moe_layer.MoELayer`` from
``get_moe_module_spec`` (Transformer Engine's ``TEGroupedMLP`` when it is installed, else the
legacy ``GroupedMLP`` on the ``grouped_gemm`` package) with:

* ``num_moe_experts`` = experts, ``moe_router_topk`` = k, hidden and ``moe_ffn_hidden_size`` = ffn,
  GELU experts without biases, ``moe_token_dispatcher_type="alltoall"``, ``moe_grouped_gemm=True``;
* capacity: ``moe_expert_capacity_factor`` = the capacity factor with ``moe_token_drop_policy
  "position"`` (earlier routes first, like ours), no padding to capacity; dropless: no capacity
  factor (Megatron's dropless path). Megatron's capacity is ``ceil(cf * k * T / E)`` like ours,
  without our ``min_capacity``;
* the aux (balance) loss with our coefficient, attached to the output by Megatron itself.

It has its own weights (Megatron's init) and its own top-k (softmax over the chosen logits), so
it is timed and measured, not compared for outputs. It needs CUDA (Megatron's grouped GEMM and
its RNG tracker) and Megatron's parallel state: a 1-rank world (nccl) is created when no
default process group exists, and ``initialize_model_parallel()`` with every size 1 when the
parallel state is not initialised yet. One rank only (``--ep 1``).
"""
from __future__ import annotations

import os
import socket
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def require_cuda(device: str) -> None:
    """A one-line ``ValueError`` unless ``device`` is a CUDA device."""
    if torch.device(device).type != "cuda":
        raise ValueError(f"--vs megatron needs CUDA (Megatron-Core's MoELayer with grouped GEMM), got --device {device}")


def megatron_config(spec: Any, aux_loss_coeff: float):
    """The ``TransformerConfig`` of ``spec`` (a ``layer.LayerBenchSpec``; module docstring)."""
    from megatron.core.transformer import TransformerConfig

    dtype = spec.target.torch_dtype
    return TransformerConfig(
        num_layers=1, hidden_size=spec.hidden, num_attention_heads=1, ffn_hidden_size=spec.ffn,
        moe_ffn_hidden_size=spec.ffn, num_moe_experts=spec.experts, moe_router_topk=spec.k,
        moe_token_dispatcher_type="alltoall", moe_grouped_gemm=True, moe_aux_loss_coeff=aux_loss_coeff,
        moe_router_load_balancing_type="aux_loss",
        moe_expert_capacity_factor=None if spec.dropless else spec.capacity_factor,
        moe_token_drop_policy="position", moe_pad_expert_input_to_capacity=False,
        activation_func=F.gelu, gated_linear_unit=False, add_bias_linear=False, hidden_dropout=0.0,
        bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16, params_dtype=dtype,
        gradient_accumulation_fusion=False, bias_dropout_fusion=False)


def megatron_twin(spec: Any, aux_loss_coeff: float, ep_size: int = 1) -> nn.Module:
    """Megatron-Core's MoELayer for ``spec`` (a ``layer.LayerBenchSpec``) on CUDA (module docstring)."""
    require_cuda(spec.device)
    if ep_size != 1:
        raise ValueError("--vs megatron runs on one rank (--ep 1)")
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.spec_utils import build_module

    _one_rank_world()
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel()
    tensor_parallel.model_parallel_cuda_manual_seed(spec.seed)
    module_spec = get_moe_module_spec(use_te=_have_transformer_engine(), num_experts=spec.experts,
                                      moe_grouped_gemm=True)
    layer = build_module(module_spec, config=megatron_config(spec, aux_loss_coeff), layer_number=1)
    return layer.to(spec.target.torch_device, spec.target.torch_dtype).train()


def _have_transformer_engine() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def _one_rank_world() -> None:
    """A 1-rank default process group on this machine's accelerator backend, unless one exists."""
    import torch.distributed as dist

    from moe_plugin_tools.bench.device import accelerator

    if dist.is_initialized():
        return
    with socket.socket() as s:   # a free port for the 1-rank rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    accelerator().set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(accelerator().communication_backend_name(), init_method=f"tcp://127.0.0.1:{port}",
                            rank=0, world_size=1)
