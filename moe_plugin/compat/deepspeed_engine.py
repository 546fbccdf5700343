"""What DeepSpeed 0.19.8's engine does with the loss scale (``engine_loss_scale`` follows ``backward``
branch for branch) and reads as the gradient norm. Details: docs/design/compat_upstream.md.
"""
from __future__ import annotations

from typing import Any, Optional

import torch


def engine_loss_scale(engine: Any) -> float:
    """The factor ``engine.backward`` multiplies the loss by besides 1 / gas (1 for ZeRO-0 fp16, bf16, fp32)."""
    from deepspeed.runtime.base_optimizer import ZeROOptimizer

    optimizer = getattr(engine, "optimizer", None)
    if isinstance(optimizer, ZeROOptimizer):
        if getattr(optimizer, "custom_loss_scaler", False):
            return float(optimizer.external_loss_scale)
        scaler = getattr(optimizer, "torch_autocast_gradscaler", None)
        if scaler is not None:
            return float(scaler.get_scale())
        loss_scaler = getattr(optimizer, "loss_scaler", None)
        return 1.0 if loss_scaler is None else float(loss_scaler.cur_scale)
    scaler = getattr(engine, "torch_autocast_z0_gradscaler", None)
    return 1.0 if scaler is None else float(scaler.get_scale())


def set_global_grad_norm(optimizer: torch.optim.Optimizer, norm: torch.Tensor) -> None:
    """Store ``norm`` where ``engine.step`` picks it up for ``engine.get_global_grad_norm()``."""
    optimizer._global_grad_norm = norm


def optimizer_loss_scale(engine: Any) -> Optional[float]:
    """The engine's optimizer's current loss scale, None where it has none (not fp16)."""
    scale = getattr(getattr(engine, "optimizer", None), "loss_scale", None)
    return scale if isinstance(scale, (int, float)) else None
