"""The optimizer state in a checkpoint (the optimizer record), and which optimizer holds it per parameter.

The record holds every parameter's fp32 master and per-element state (Adam's moments) whole, in the
layout-independent form of the weights, so it follows any change of TP, PP, EP, ETP, DP, ZeRO stage or
model kind: dense parameters in ``optimizer/``, expert ones in the expert files by global id.
``basic_optimizer`` is the torch optimizer DeepSpeed runs unwrapped (ZeRO-0, fp32). fp16 is refused.
Design: docs/design/checkpoint_format.md.
"""
from __future__ import annotations

import os
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from moe_plugin.checkpoint.errors import CheckpointError
from moe_plugin.checkpoint.experts import expert_weights
from moe_plugin.checkpoint.tensor_files import SUFFIX
from moe_plugin.compat.deepspeed_zero import fill_inner_state, has_hp_mapping, link_inner_state

MASTER = "fp32"   # the record's name of the fp32 master copy
RECORD_DIR, RECORD_KIND = "optimizer", "optimizer_record"
SCHEDULED = ("lr", "betas", "momentum")   # param-group options that lr schedulers change as they step


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


# -- the optimizer record ------------------------------------------------------------------------
def dtype_name(dtype: torch.dtype) -> str:
    """How ``weights_from_master`` names a weight's dtype (``"bfloat16"``; ``readers.rounded`` reads it)."""
    return str(dtype).replace("torch.", "")


def record_kind(engine: Any) -> Optional[str]:
    """``"basic"`` (ZeRO-0 fp32), ``"hp"`` (ZeRO-1/2 or bf16: fp32 masters), or None (fp16, none)."""
    if engine.optimizer is None or engine.fp16_enabled():
        return None
    if basic_optimizer(engine) is not None:
        return "basic"
    if engine.zero_optimization_stage() <= 2 and has_hp_mapping(p for _, p in trained(engine)):
        return "hp"
    return None


def trained(engine: Any) -> list[tuple[str, nn.Parameter]]:
    """The module's parameters the optimizer steps (frozen ones have no optimizer state)."""
    return [(k, p) for k, p in engine.module.named_parameters() if p.requires_grad]


def _inner(engine: Any) -> torch.optim.Optimizer:
    return engine.optimizer if record_kind(engine) == "basic" else engine.optimizer.optimizer


def state_names(engine: Any) -> tuple[list[str], dict]:
    """(per-element state names, scalar names) of the torch optimizer; collective."""
    inner = _inner(engine)
    names, scalars = [], {}
    for group in inner.param_groups:
        for p in group["params"]:
            state = inner.state.get(p, {})
            if state:
                names = [n for n in sorted(state) if isinstance(state[n], Tensor) and state[n].shape == p.shape
                         and state[n].dim() > 0]
                scalars = {n: v for n, v in state.items() if n not in names}
                break
        if names or scalars:
            break
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, names)
    if any(other != names for other in everyone):
        raise CheckpointError(f"the optimizer state names differ between ranks ({everyone[:4]}): some rank has not "
                              "stepped; save after the same number of steps on every rank")
    if record_kind(engine) == "hp":
        link_inner_state(engine.optimizer)
        names = [MASTER] + names
    return names, scalars


def full_param_state(engine: Any, param: nn.Parameter, names: list[str]) -> list[Tensor]:
    """``param``'s fp32 master and states ``names``, whole (collective over its data-parallel group)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    if record_kind(engine) == "basic":
        return [engine.optimizer.state[param][n].detach() for n in names]
    return [safe_get_full_fp32_param(param) if n == MASTER else safe_get_full_optimizer_state(param, n)
            for n in names]


def dense_record(run: Any) -> dict:
    """{file name: content} of this rank's dense record ({} off data-parallel rank 0); collective."""
    engine, groups = run.engine, run.groups
    if record_kind(engine) is None:
        return {}
    names, scalars = state_names(engine)
    state, from_master, weights = {}, {}, {}
    for key, p in trained_dense(engine):
        state[key] = dict(zip(names, (t.detach().clone() for t in full_param_state(engine, p, names))))
        if MASTER in state[key]:   # DeepSpeed's module file leaves it out (dense_from_master)
            from_master[key] = dtype_name(p.dtype)
            if not torch.equal(state[key][MASTER].to(p.dtype), p.detach()):   # none is known to differ
                weights[key] = p.detach().clone()
    coords = groups.layout.coords(dist.get_rank())
    if coords["dp"] != 0:
        return {}
    return {record_file(coords["pp"], coords["tp"]): {"names": names, "scalars": scalars, "state": state,
                                                      "options": group_options(engine),
                                                      "weights_from_master": from_master, "weights": weights}}


def dense_from_master(engine: Any) -> set[str]:
    """The trained dense parameters whose weight is its fp32 master rounded (ZeRO-1/2, bf16)."""
    return {key for key, _p in trained_dense(engine)} if record_kind(engine) == "hp" else set()


def trained_dense(engine: Any) -> list[tuple[str, nn.Parameter]]:
    """``trained``'s parameters but the experts' (the dense record's)."""
    experts = {id(w.param) for w in expert_weights(engine.module)}
    return [(k, p) for k, p in trained(engine) if id(p) not in experts]


def group_options(engine: Any) -> list[dict]:
    """What an lr scheduler sets in each param group of the torch optimizer (``SCHEDULED``)."""
    return [{k: g[k] for k in SCHEDULED if k in g} for g in _inner(engine).param_groups]


def set_group_options(engine: Any, path: str, saved: list[dict]) -> None:
    """Set the saved ``group_options``: per group, or the one value all saved groups had."""
    groups = _inner(engine).param_groups
    if len(saved) == len(groups):
        for group, options in zip(groups, saved):
            group.update(options)
        return
    for key in SCHEDULED:
        values = [g[key] for g in saved if key in g]
        if not values:
            continue
        if any(v != values[0] for v in values):
            raise CheckpointError(f"{path}: the optimizer had {len(saved)} param groups with different {key} "
                                  f"({values[:4]}), now {len(groups)} groups; which takes which is unknown")
        for group in groups:
            group[key] = values[0]


def record_file(stage: int, tp_rank: int) -> str:
    """The dense optimizer record of ``stage`` and ``tp_rank`` in the tag."""
    return os.path.join(RECORD_DIR, f"dense_pp_{stage:02d}_tp_{tp_rank:02d}{SUFFIX}")


def check_record_loads(engine: Any) -> None:
    """Raise unless the running engine's optimizer can take a record (not fp16, not ZeRO-3)."""
    if record_kind(engine) is None:
        raise CheckpointError("the optimizer state cannot follow the layout change into this engine: its optimizer "
                              f"is {type(engine.optimizer).__name__} (fp16's loss scaler, ZeRO-3 or no optimizer are "
                              "not supported); load weights only: load_checkpoint(..., load_optimizer_states=False)")


def match_record(run: Any, path: str, dense: dict, names: list[str], scalars: dict, options: list[dict],
                 expert_state: dict) -> dict:
    """{"params": {name: {state: tensor}}, "names", "scalars", "options"} for the running model, from
    ``dense`` and ``expert_state``; a parameter the record lacks is an error before anything loads."""
    engine = run.engine
    check_record_loads(engine)
    experts = {id(w.param): w.key for w in expert_weights(engine.module)}
    params, missing = {}, []
    for key, param in trained(engine):
        saved = expert_state.get(experts[id(param)], {}) if id(param) in experts else {
            n: dense[n][key] for n in names if key in dense.get(n, {})}
        if any(n not in saved for n in names):
            missing.append(key)
        params[key] = saved
    if missing:
        raise CheckpointError(f"{path}: the optimizer record lacks the state {names} of {len(missing)} parameter(s), "
                              f"e.g. {missing[:3]}")
    return {"params": params, "names": names, "scalars": scalars, "options": options}


def load_record(run: Any, path: str, record: dict) -> None:
    """Write every parameter's saved master and state, the scalars and scheduled options back into the
    running optimizer (without saved masters, the masters follow the loaded weights)."""
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    engine = run.engine
    kind = record_kind(engine)
    moments = [n for n in record["names"] if n != MASTER]
    scalars = record["scalars"]
    if kind == "hp":
        fill_inner_state(engine.optimizer, moments, scalars)
    for key, param in trained(engine):
        saved = record["params"][key]
        if kind == "basic":   # the weight is the master: a bf16 checkpoint's fp32 master replaces it
            if MASTER in saved:
                with torch.no_grad():
                    param.copy_(saved[MASTER].reshape(param.shape))
            entry = {k: v.clone() if isinstance(v, Tensor) else v for k, v in scalars.items()}
            entry.update({n: saved[n].to(param.device, torch.float32).reshape(param.shape) for n in moments})
            engine.optimizer.state[param] = entry
            continue
        if MASTER in saved:
            safe_set_full_fp32_param(param, saved[MASTER].float())
        for n in moments:
            safe_set_full_optimizer_state(param, saved[n].float(), n)
    set_group_options(engine, path, record["options"])
