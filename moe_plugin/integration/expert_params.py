"""What DeepSpeed's engine and ZeRO-1/2 need of a model with the plugin's MoE layers: the marker that
makes the engine take its MoE paths, the expert gradient factor its averaging expects, expert
parameters marked for ZeRO's norm, and param groups split as ZeRO partitions them.
Design (DeepSpeed 0.19.8's rules): docs/design/integration_deepspeed.md.
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
# gradient must then be unscaled (docs/design/integration_deepspeed.md).
DEEPSPEED_EXPERT_GRAD_SCALE = 1.0

ParamsLike = Union[nn.Module, Iterable[torch.Tensor], Iterable[dict]]


def expert_params(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if is_moe_param(p)]


def prepare_model(model: nn.Module, moe_config: MoEConfig, groups: ProcessGroups) -> bool:
    """Get ``model`` ready for ``deepspeed.initialize``; returns whether it has expert parameters (else unchanged)."""
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
    """Give a stage without MoE layers the engine marker when another stage has experts (collective)."""
    flag = torch.tensor([float(has_experts)], device=get_accelerator().current_device_name())
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item() and not has_experts:
        _add_marker(stage, moe_config, groups)


def follow_loss_scale(engine: Any, model: nn.Module):
    """Scale the MoE layers' aux/z-loss gradients like the main loss (1 / gas, fp16's scale); returns the hook."""
    layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    gas = engine.gradient_accumulation_steps()

    def before_forward(module: nn.Module, args: Any) -> None:
        scale = engine_loss_scale(engine) / gas
        for layer in layers:
            layer.aux_loss_scale = scale

    before_forward(model, ())
    return model.register_forward_pre_hook(before_forward)


def moe_param_groups(params: ParamsLike) -> list[dict]:
    """Param groups with the expert parameters split off, as ZeRO expects them, from a model, parameters or groups
    (options kept): a dense group and one per expert group name (``'moe': True``, ``'name'``) for each."""
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
