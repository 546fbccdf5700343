"""Gradients of parameters replicated over TP under sequence parallelism.

Under sequence parallelism each TP rank holds its own part of the sequence outside the
tensor-parallel GEMMs, so a parameter used there -- a norm, a row-parallel linear's bias,
marked ``sequence_parallel = True`` by Megatron-Core (and by ``cpu_modules.TorchNorm``) -- is
replicated over TP but gets a gradient from its rank's tokens only: the true gradient is the sum
over the TP group. Megatron's own DDP sums them in ``finalize_model_grads``; a DeepSpeed training
loop has no such step. Two ways here:

* ``sequence_parallel_grad_hooks(model, groups)`` (what ``moe_plugin.initialize`` installs): a
  hook per parameter sums every incoming gradient inside backward, before autograd accumulates
  it into ``.grad``, so it works under ZeRO-0/1/2 and the PipelineEngine alike;
* ``allreduce_sequence_parallel_grads(model, groups)``: one flat all-reduce of the ``.grad`` tensors
  after backward, for a training loop of one's own (it skips hooked parameters).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from moe_plugin.groups.process_groups import ProcessGroups

SP_HOOKED = "moe_plugin_sp_grad_hook"   # attribute of a parameter whose gradient a hook sums over TP


def allreduce_sequence_parallel_grads(model: torch.nn.Module, groups: Optional[ProcessGroups]) -> int:
    """Sum the ``.grad`` of parameters marked ``sequence_parallel`` over the TP group (what
    Megatron's ``finalize_model_grads`` does for its DDP); call it after backward, before the
    optimizer step or the data-parallel reduction. Parameters whose gradient a hook of
    ``sequence_parallel_grad_hooks`` already sums (every model built by ``moe_plugin.initialize``)
    are left alone. Returns the number of tensors reduced."""
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
    """Sum the gradient of every parameter marked ``sequence_parallel`` over the TP group inside
    backward, so no training loop has to: a hook on the parameter sums each incoming gradient
    before autograd accumulates it into ``.grad``.

    Summed in backward, the sum (why: the module docstring) is in place before DeepSpeed's ZeRO-1/2
    moves ``.grad`` into its buffers (ZeRO-2 does so as soon as autograd has accumulated it) and
    before the PipelineEngine steps, which an all-reduce after ``engine.backward`` could not be. The
    sum is linear, so gradient accumulation over micro-batches gets the same result. Cost: one
    all-reduce of one small tensor per such parameter and micro-batch (norm weights and biases:
    a few per layer). Idempotent; returns the number of parameters hooked now."""
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
    """A gradient hook: the sum of ``grad`` over ``group`` (a new tensor: hooks leave their input as is)."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group

    def __call__(self, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        dist.all_reduce(grad, group=self.group)
        return grad
