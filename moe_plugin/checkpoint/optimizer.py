"""The optimizer state in a checkpoint, and which optimizer holds it per parameter.

``basic_optimizer`` is the one answer to "which optimizer is the basic one": the torch optimizer
itself, which DeepSpeed runs unwrapped at ZeRO-0 in fp32 (its fp16/bf16 and ZeRO-1/2 wrappers are
not torch optimizers). Its per-parameter state tensors of the parameter's shape
(``param_state_names``: Adam's ``exp_avg``, ``exp_avg_sq``; not the scalar ``step``) follow the
experts: into the expert files by global id, through ``load_basic_optimizer`` after a change of
the expert layout, and with a migration (``placement.migration``).
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor, nn

from moe_plugin.checkpoint.errors import CheckpointError
from moe_plugin.checkpoint.experts import expert_weights


def basic_optimizer(engine: Any) -> Optional[torch.optim.Optimizer]:
    """The torch optimizer itself when DeepSpeed runs it unwrapped (ZeRO-0 in fp32), else None."""
    opt = engine.optimizer
    if engine.zero_optimization_stage() == 0 and isinstance(opt, torch.optim.Optimizer):
        return opt
    return None


def param_state_names(optimizer: Optional[torch.optim.Optimizer], param: nn.Parameter) -> list[str]:
    """Sorted names of ``optimizer``'s state tensors of ``param`` that have its shape ([] without one)."""
    state = optimizer.state.get(param, {}) if optimizer is not None else {}
    return [n for n in sorted(state) if isinstance(state[n], Tensor) and state[n].shape == param.shape]


def load_basic_optimizer(run: Any, path: str, saved: dict, moments: dict) -> None:
    """ZeRO-0 after a layout change: the dense state as saved (``saved``: DeepSpeed's optimizer
    state dict, the same on every rank of a model-parallel slice; the file of EP rank 0), the
    expert rows re-cut by global expert id (``moments``). Param-group options come from the
    checkpoint except the expert group's DeepSpeed ``name``, which belongs to the new layout."""
    engine = run.engine
    optimizer = basic_optimizer(engine)
    key_of = {id(w.param): w.key for w in expert_weights(engine.module)}
    state = {}
    if len(saved["param_groups"]) != len(optimizer.param_groups):
        raise CheckpointError(f"{path}: the optimizer had {len(saved['param_groups'])} param groups, now "
                              f"{len(optimizer.param_groups)}")
    for saved_group, group in zip(saved["param_groups"], optimizer.param_groups):
        for index, param in zip(saved_group["params"], group["params"]):
            entry = dict(saved["state"].get(index, {}))
            for name, value in moments.get(key_of.get(id(param)), {}).items():
                entry[name] = value
            if entry:
                state[index] = entry
        for option in ("name", "moe"):
            if option in group:
                saved_group[option] = group[option]
    optimizer.load_state_dict({"state": state, "param_groups": saved["param_groups"]})
