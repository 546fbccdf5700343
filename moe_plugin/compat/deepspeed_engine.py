"""What DeepSpeed's engine does with the loss scale and reads as the gradient norm.

Relies on deepspeed 0.19.8 (``deepspeed/runtime/engine.py``, ``runtime/base_optimizer.py``):

* ``DeepSpeedEngine.backward`` multiplies the loss (besides 1 / gas) by a ``ZeROOptimizer``'s
  ``scale_if_loss`` (its ``custom_loss_scaler``'s ``external_loss_scale``, else its
  ``torch_autocast_gradscaler``, else its ``loss_scaler``'s ``cur_scale``), and otherwise by the
  engine's ``torch_autocast_z0_gradscaler`` only: ``engine_loss_scale`` follows it branch for branch.
* ``DeepSpeedEngine.step`` copies the optimizer's ``_global_grad_norm`` (when it has one) into
  what ``get_global_grad_norm()`` returns: ``set_global_grad_norm``.
* fp16 optimizers expose their current dynamic scale as ``loss_scale``: ``optimizer_loss_scale``.
"""
from __future__ import annotations

from typing import Any, Optional

import torch


def engine_loss_scale(engine: Any) -> float:
    """The factor DeepSpeed's ``engine.backward`` multiplies the loss by, besides 1 / gas: a ZeRO
    optimizer scales it by the user's external scale, torch autocast's grad scaler, or its fp16
    loss scaler's ``cur_scale`` (1 in bf16 and fp32). Otherwise only ZeRO-0's torch autocast grad
    scaler scales it; in particular ZeRO-0 fp16 (``FP16_UnfusedOptimizer``) does not: that
    optimizer divides the gradients by its loss scale in ``step`` whatever ``backward`` did, so
    the aux-loss gradient must be left as the main loss's is."""
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
