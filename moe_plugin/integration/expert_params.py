"""What DeepSpeed's engine and ZeRO-1/2 need of a model with the plugin's MoE layers.

DeepSpeed 0.19.8 decides everything MoE from three things; ``prepare_model`` and
``moe_param_groups`` provide them for a model built from ``MoELayer``:

1. Detection. ``DeepSpeedEngine`` sets ``has_moe_layers`` only when the model contains a
   ``deepspeed.moe.layer.MoE`` (or AutoEP) module. Without it the engine neither reduces expert
   gradients over their expert-data-parallel group (ZeRO-0 even fails: its gradient buckets are
   keyed by the registered expert groups) nor hands the expert groups to ZeRO. Our layer is not
   DeepSpeed's, so ``prepare_model`` adds one parameter-free ``DeepSpeedMoEMarker`` child (an
   ``MoE`` subclass that builds nothing and creates no groups, ``compat/deepspeed_moe.py``) under
   ``MARKER_NAME``. State dicts do not change: the marker has no parameters or buffers.
2. Optimizer param groups (``moe_param_groups``). ZeRO-1/2 partitions each param group over one
   group of ranks: an expert group must hold expert parameters only and carry ``'moe': True``
   and ``'name'``: the key of its expert-data-parallel group in ``deepspeed.utils.groups``
   (``ProcessGroups.expert_group_name``, also each expert parameter's ``group_name``).
3. Parameter attributes. An expert parameter is one with ``allreduce = False`` (DeepSpeed's
   ``is_moe_param``); ``GroupedExperts`` sets it and ``group_name``.

Gradient factor. DeepSpeed averages an expert gradient by *summing it over the expert-data-parallel
group and dividing by the data-parallel size* (``engine._reduce_expert_gradients`` for ZeRO-0,
``average_tensor`` for ZeRO-1/2), not by the expert-data-parallel size. The sum over EDP already
covers every token group of a pipeline stage once, so with that divisor the layer's expert
gradients need no factor at all: ``prepare_model`` sets ``GroupedExperts.grad_scale`` to
``DEEPSPEED_EXPERT_GRAD_SCALE`` (1). The layer's default, edp / dp (``layers/parallel.py`` 4c),
assumes an EDP *average*; under DeepSpeed it would leave expert gradients edp / dp times too small
(1/4 at EP 4 x DP 4: the known "wrong by the EP size" bug).

Gradient norm. ZeRO-1/2 computes its norm per param group by summing squared partition norms over
the data-parallel group and then over the model-parallel (TP x PP) group, where a parameter counts
on TP rank 0 only unless ``is_model_parallel_parameter`` says it differs across TP ranks. Expert
partitions are distinct on every rank of a stage (ETP x EP x EDP covers it), but under folding
(EP carved out of TP) they would count on TP rank 0 only. ``prepare_model`` therefore sets
``model_parallel = True`` on expert parameters (DeepSpeed's attribute, unused by Megatron-Core),
so they count on every rank. Dense parameters keep DeepSpeed's rule (replicated over TP unless
Megatron marked them ``tensor_model_parallel``). ZeRO-0 in fp32 gets its norm from ``grad_norm.py``.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Union

import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.moe.utils import is_moe_param
from torch import nn

from moe_plugin.compat.deepspeed_engine import engine_loss_scale
from moe_plugin.compat.deepspeed_moe import DeepSpeedMoEMarker, is_deepspeed_moe, mark_model_parallel
from moe_plugin.configs.schema import MoEConfig
from moe_plugin.groups.process_groups import ProcessGroups
from moe_plugin.layers.experts import GroupedExperts
from moe_plugin.layers.moe_layer import MoELayer

MARKER_NAME = "deepspeed_moe_marker"
# DeepSpeed divides the EDP sum of an expert gradient by the DP size: the layer's local expert
# gradient must then be unscaled (see the module docstring).
DEEPSPEED_EXPERT_GRAD_SCALE = 1.0

ParamsLike = Union[nn.Module, Iterable[torch.Tensor], Iterable[dict]]


def expert_params(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if is_moe_param(p)]


def prepare_model(model: nn.Module, moe_config: MoEConfig, groups: ProcessGroups) -> bool:
    """Get ``model`` ready for ``deepspeed.initialize``: expert gradient factor, norm attribute,
    engine marker (see the module docstring). Returns whether the model has expert parameters
    (without any, nothing is changed and DeepSpeed runs as for a dense model)."""
    experts = expert_params(model)
    if not experts:
        return False
    names = {getattr(p, "group_name", None) for p in experts}
    if names != {groups.expert_group_name}:
        raise ValueError(f"expert parameters (allreduce=False) carry group_name {sorted(map(str, names))}, but the "
                         f"plugin's groups are registered as {groups.expert_group_name!r}: build every MoE layer "
                         "with the groups that initialize passes to the model provider")
    for module in model.modules():
        if isinstance(module, GroupedExperts):
            module.grad_scale = DEEPSPEED_EXPERT_GRAD_SCALE
    mark_model_parallel(experts)
    _add_marker(model, moe_config, groups)
    return True


def _add_marker(model: nn.Module, moe_config: MoEConfig, groups: ProcessGroups) -> None:
    if not any(is_deepspeed_moe(m) for m in model.modules()):
        model.add_module(MARKER_NAME, DeepSpeedMoEMarker(moe_config.num_experts, groups.layout.sizes.ep,
                                                         groups.expert_group_name, groups.handles["ep"],
                                                         groups.handles["edp"]))


def mark_every_stage(stage: nn.Module, has_experts: bool, moe_config: MoEConfig, groups: ProcessGroups) -> None:
    """A pipeline stage without MoE layers (a model whose first layers are dense: GLM-4.5, DeepSeek)
    gets the engine marker too when another stage has experts (collective over the world): every
    stage then takes DeepSpeed's MoE code paths alike -- one module file per stage, loaded whole
    (its dense path would look for per-layer files and fail on the plugin's module file)."""
    flag = torch.tensor([float(has_experts)], device=get_accelerator().current_device_name())
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item() and not has_experts:
        _add_marker(stage, moe_config, groups)


def follow_loss_scale(engine: Any, model: nn.Module):
    """Keep the aux/z-loss gradients of ``model``'s MoE layers scaled like the main loss's.

    The engine's ``backward`` multiplies the loss by 1 / gradient accumulation steps and, in fp16
    under ZeRO-1/2, by the current loss scale (``compat/deepspeed_engine.py``: ``engine_loss_scale``);
    the layer's aux-loss gradient enters at its output in backward (``AttachAuxLoss``) with
    ``aux_loss_scale``, which must carry the same factors: with 1 / gas alone such an fp16 run would
    divide the balance loss's gradient by the loss scale (4,096 to 65,536) when the optimizer unscales, and lose it.
    A forward pre-hook on ``model`` sets it from the engine's scale before every forward (and once
    now); the scale only changes in ``step``, so the backward that follows sees the same one.
    Returns the hook's handle (``.remove()``)."""
    layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    gas = engine.gradient_accumulation_steps()

    def before_forward(module: nn.Module, args: Any) -> None:
        scale = engine_loss_scale(engine) / gas
        for layer in layers:
            layer.aux_loss_scale = scale

    before_forward(model, ())
    return model.register_forward_pre_hook(before_forward)


def moe_param_groups(params: ParamsLike) -> list[dict]:
    """Optimizer param groups with the expert parameters split off, as ZeRO expects them.

    ``params``: a model (its parameters that require gradients), an iterable of parameters, or of
    param-group dicts (options such as ``weight_decay`` are kept). Each group becomes a dense group
    (same options; left out when empty) followed by one group per expert-data-parallel group name:
    the same options plus ``'moe': True`` and ``'name'``. Groups already marked ``'moe'`` are
    checked and kept.
    """
    if isinstance(params, nn.Module):
        user_groups = [{"params": [p for p in params.parameters() if p.requires_grad]}]
    else:
        items = list(params)
        if all(isinstance(x, torch.Tensor) for x in items):
            user_groups = [{"params": items}]
        elif all(isinstance(x, dict) for x in items):
            user_groups = items
        else:
            raise TypeError("moe_param_groups takes a model, parameters, or param-group dicts, not a mix")
    out: list[dict] = []
    for group in user_groups:
        members = list(group["params"]) if not isinstance(group["params"], torch.Tensor) else [group["params"]]
        options = {k: v for k, v in group.items() if k != "params"}
        if group.get("moe"):
            wrong = [p for p in members if not is_moe_param(p) or p.group_name != group.get("name")]
            if wrong:
                raise ValueError(f"param group {group.get('name')!r} is marked 'moe' but holds {len(wrong)} "
                                 "parameters that are not its expert parameters (allreduce=False, same group_name)")
            out.append({**options, "params": members})
            continue
        dense = [p for p in members if not is_moe_param(p)]
        by_name: dict[str, list] = {}
        for p in members:
            if is_moe_param(p):
                by_name.setdefault(p.group_name, []).append(p)
        if dense:
            out.append({**options, "params": dense})
        for name, experts in by_name.items():
            out.append({**options, "params": experts, "moe": True, "name": name})
    if not out:
        raise ValueError("no parameters to optimize")
    return out


def check_optimizer_groups(optimizer: torch.optim.Optimizer) -> None:
    """A client optimizer built by the user must already have the expert groups split off."""
    for i, group in enumerate(optimizer.param_groups):
        experts = [p for p in group["params"] if is_moe_param(p)]
        if experts and (not group.get("moe") or len(experts) != len(group["params"])):
            raise ValueError(f"optimizer param group {i} mixes expert parameters (allreduce=False) with dense ones "
                             "or lacks 'moe': True; build the optimizer from "
                             "moe_plugin.integration.expert_params.moe_param_groups(model), or pass a callable "
                             "optimizer=lambda groups: torch.optim.X(groups, ...) to initialize")
