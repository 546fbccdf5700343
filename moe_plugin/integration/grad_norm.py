"""The global gradient norm of a hybrid-parallel model, and clipping by it for ZeRO-0.

Every distinct gradient counts once, on the one replica that owns it: one all-reduce of one number.
Why ZeRO-0 needs it (DeepSpeed averages per-rank norms): docs/design/integration_deepspeed.md.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Optional

import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.moe.utils import is_moe_param

from moe_plugin.compat.deepspeed_engine import set_global_grad_norm
from moe_plugin.groups.process_groups import ProcessGroups

EPS = 1e-6  # as DeepSpeed and torch: clip coefficient max_norm / (norm + EPS)


def owns_gradient(p: torch.Tensor, coords: dict[str, int]) -> bool:
    """Whether the rank at layout ``coords`` counts ``p``'s gradient (a tied weight's pipeline copy never does)."""
    if getattr(p, "ds_pipe_replicated", False):
        return False
    if is_moe_param(p):
        return coords["edp"] == 0
    if getattr(p, "tensor_model_parallel", False):
        return coords["dp"] == 0
    return coords["dp"] == 0 and coords["tp"] == 0


def global_grad_norm(params: Iterable[torch.Tensor], groups: ProcessGroups) -> torch.Tensor:
    """L2 norm of all gradients of the model (collective over all ranks); fp32 scalar."""
    coords = groups.layout.coords(groups.rank)
    square = torch.zeros((), dtype=torch.float64, device=get_accelerator().current_device_name())
    for p in params:
        if p.grad is not None and owns_gradient(p, coords):
            square += p.grad.detach().double().square().sum().to(square.device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(square)
    return square.sqrt().float()


def distinct_parameter_count(params: Iterable[torch.Tensor], groups: Optional[ProcessGroups]) -> tuple[int, int]:
    """(all, expert) parameters of the whole model, each distinct one once (collective; ``groups`` None: one rank)."""
    params = list(params)
    if groups is None:
        counts = [sum(p.numel() for p in params), sum(p.numel() for p in params if is_moe_param(p))]
        return counts[0], counts[1]
    coords = groups.layout.coords(groups.rank)
    owned = [p for p in params if owns_gradient(p, coords)]
    counts = torch.tensor([sum(p.numel() for p in owned), sum(p.numel() for p in owned if is_moe_param(p))],
                          dtype=torch.float64, device=get_accelerator().current_device_name())
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(counts)
    return int(counts[0].item()), int(counts[1].item())


class GlobalNormClipping:
    """Optimizer step pre-hook: clip by the global norm to ``max_norm`` (0: none), store it for the engine."""

    def __init__(self, groups: ProcessGroups, max_norm: float):
        self.groups = groups
        self.max_norm = float(max_norm)

    def __call__(self, optimizer: torch.optim.Optimizer, args, kwargs) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        norm = global_grad_norm(params, self.groups)
        if self.max_norm > 0:
            coef = (self.max_norm / (norm + EPS)).clamp(max=1.0)
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(coef.to(p.grad.dtype))
        set_global_grad_norm(optimizer, norm)

    def install(self, optimizer: torch.optim.Optimizer):
        """Register on ``optimizer``; returns the handle (``.remove()``)."""
        return optimizer.register_step_pre_hook(self)
