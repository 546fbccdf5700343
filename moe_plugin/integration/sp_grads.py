"""Gradients of parameters replicated over TP under sequence parallelism, summed over TP: by hooks inside
backward (``sequence_parallel_grad_hooks``, which ``initialize`` installs) or after it
(``allreduce_sequence_parallel_grads``, for a loop of one's own). Design: docs/design/integration_deepspeed.md.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from moe_plugin.groups.process_groups import ProcessGroups

SP_HOOKED = "moe_plugin_sp_grad_hook"   # attribute of a parameter whose gradient a hook sums over TP


def allreduce_sequence_parallel_grads(model: torch.nn.Module, groups: Optional[ProcessGroups]) -> int:
    """Sum the ``.grad`` of unhooked ``sequence_parallel`` parameters over TP after backward; returns how many."""
    grads = [p.grad for p in model.parameters()
             if getattr(p, "sequence_parallel", False) and not getattr(p, SP_HOOKED, False) and p.grad is not None]
    tp = groups.tp if groups is not None else None
    if tp is None or not grads:
        return 0
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=tp)
    for grad, part in zip(grads, flat.split([g.numel() for g in grads])):
        grad.copy_(part.view_as(grad))
    return len(grads)


def sequence_parallel_grad_hooks(model: torch.nn.Module, groups: Optional[ProcessGroups]) -> int:
    """Hook each ``sequence_parallel`` parameter once so that backward sums its gradient over TP; returns how many."""
    tp = groups.tp if groups is not None else None
    if tp is None:
        return 0
    hooked = 0
    for param in model.parameters():
        if getattr(param, "sequence_parallel", False) and param.requires_grad and not getattr(param, SP_HOOKED, False):
            param.register_hook(_TPSum(tp))
            setattr(param, SP_HOOKED, True)
            hooked += 1
    return hooked


class _TPSum:
    """A gradient hook: the sum of ``grad`` over ``group``, as a new tensor."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group

    def __call__(self, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        dist.all_reduce(grad, group=self.group)
        return grad
