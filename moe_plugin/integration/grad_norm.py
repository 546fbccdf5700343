"""The global gradient norm of a hybrid-parallel model, and clipping by it for ZeRO-0.

The global norm counts every distinct gradient once: a dense parameter once over its TP x DP
replicas (once per TP shard when Megatron marked it ``tensor_model_parallel``), an expert
parameter once over its expert-data-parallel replicas (each EP x ETP shard once), every pipeline
stage its own (a tied embedding once, on the first stage). ``global_grad_norm`` lets exactly one replica (the "owner") add each gradient's
square and sums over all ranks: one all-reduce of one number.

Why the plugin computes it for ZeRO-0 in fp32: there DeepSpeed clips with
``deepspeed.runtime.utils.clip_grad_norm_``, which sums squares over the model-parallel group and
then *averages the norms* over the data-parallel group. Expert gradients differ between EP ranks,
so that average is not the norm of anything (it is right only without expert parallelism), and
the engine reports no norm at all (``get_global_grad_norm()`` is None). ``GlobalNormClipping`` is an
optimizer step pre-hook that clips by the right norm and leaves it where the engine reads it
(``compat/deepspeed_engine.py``, as ZeRO's optimizers do). ZeRO-1/2 compute the right norm
themselves once expert parameters are marked (``expert_params.prepare_model``).
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
    """Whether the rank with layout coordinates ``coords`` is the one that counts ``p``'s gradient.
    A pipeline's copy of a tied weight (``ds_pipe_replicated``, the last stage's output weight) is
    counted on the stage that owns the weight."""
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
    """(all, expert): the parameters of the whole model, each distinct one counted once over
    all ranks by the owner rule of ``global_grad_norm`` (collective; ``groups`` None: one process)."""
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
    """Optimizer step pre-hook: computes the global norm, clips the gradients to ``max_norm``
    (0: no clipping) and stores the norm where the engine reads it (``set_global_grad_norm``)."""

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
