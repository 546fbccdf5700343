"""A full (single-process) state dict -> the shard that one rank's model holds.

Which slice a tensor gets is read from the model (Megatron's TP partition attributes, the experts'
placement and ETP split) and the rank's coordinates in the layout, not from parameter names; anything
else is replicated. The same function slices full gradients. ``own_dense`` joins a load's dense
entries saved at another TP size and cuts them, one key at a time. Rules:
docs/design/checkpoint_format.md.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import Tensor, nn

from moe_plugin.checkpoint.experts import expert_weights
from moe_plugin.checkpoint.shards import tp_join, tp_slice
from moe_plugin.groups.layout import RankLayout


def own_dense(pieces: Mapping[str, list[Any]], model: nn.Module, layout: RankLayout, rank: int) -> dict[str, Any]:
    """``model``'s dense entries for ``rank`` from ``pieces`` ({key: every saved TP rank's value}), key by
    key: the peak is the share plus one full tensor. Keys absent from ``pieces`` are left out."""
    from moe_plugin.checkpoint.readers import materialize

    experts = {w.key for w in expert_weights(model)}
    local = model.state_dict(keep_vars=True)
    out: dict[str, Any] = {}
    for key, mine in local.items():
        if key in experts or key not in pieces:
            continue
        saved = pieces[key]
        if not isinstance(mine, Tensor):
            out[key] = materialize(saved[0])
            continue
        if getattr(mine, "tensor_model_parallel", False):
            stride = getattr(mine, "partition_stride", 1)
            rows = _own_rows(saved, mine.partition_dim, stride, layout.coords(rank)["tp"], layout.sizes.tp)
            if rows is not None and rows.shape == mine.shape:   # only this rank's rows were read
                out[key] = rows
                continue
            full = tp_join([materialize(v) for v in saved], mine.partition_dim, stride)
        else:
            full = materialize(saved[0])
        out[key] = _part(key, full, mine, None, layout, rank).detach()   # fresh memory: read, or cut by cat
    return out


def _own_rows(saved: list[Any], dim: int, stride: int, tp_rank: int, tp: int) -> Any:
    """Rank ``tp_rank``'s rows of a tensor saved whole and cut along dim 0, or None."""
    if len(saved) != 1 or dim != 0 or not hasattr(saved[0], "read_rows"):
        return None
    pieces = stride * tp
    if saved[0].shape[0] % pieces:
        return None
    n = saved[0].shape[0] // pieces
    return torch.cat([saved[0].read_rows(j * n, n) for j in range(tp_rank, pieces, tp)])


def shard_state_dict(full: Mapping[str, Any], model: nn.Module, layout: RankLayout, rank: int, *,
                     strict: bool = True) -> dict[str, Any]:
    """The entries of ``model.state_dict()`` cut out of ``full`` (the same model on one process) for
    ``rank``. Missing keys are an error unless ``strict`` is False; so is a shape no rule explains."""
    local = model.state_dict(keep_vars=True)
    experts = {w.key: w for w in expert_weights(model)}
    missing = [k for k in local if k not in full]
    if missing and strict:
        raise KeyError(f"the full state dict lacks {len(missing)} key(s) of the model, e.g. {missing[:3]}")
    out: dict[str, Any] = {}
    for key, mine in local.items():
        if key not in full:
            continue
        whole = full[key]
        out[key] = _part(key, whole, mine, experts.get(key), layout, rank).detach().clone() \
            if isinstance(mine, Tensor) else whole
    return out


def _part(key: str, whole: Tensor, mine: Tensor, expert: Any, layout: RankLayout, rank: int) -> Tensor:
    """Rank ``rank``'s part of the full tensor ``whole`` of entry ``key`` (the rules above)."""
    coords, sizes = layout.coords(rank), layout.sizes
    if expert is not None:
        part = whole.narrow(0, expert.module.first_slot, expert.module.num_local)
        part = expert.cut(part, coords["etp"], sizes.etp)
    elif getattr(mine, "tensor_model_parallel", False):
        part = tp_slice(whole, mine.partition_dim, getattr(mine, "partition_stride", 1), coords["tp"], sizes.tp)
    else:
        part = whole
    if part.shape != mine.shape:
        raise ValueError(f"{key}: the full tensor {tuple(whole.shape)} gives {tuple(part.shape)} on rank {rank} "
                         f"(tp {coords['tp']}/{sizes.tp}, ep {coords['ep']}/{sizes.ep}, etp {coords['etp']}/"
                         f"{sizes.etp}), but the model holds {tuple(mine.shape)}")
    return part
