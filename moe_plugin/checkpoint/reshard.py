"""A full (single-process) state dict -> the shard that one rank's model holds.

Which slice a tensor gets is read from the model and the rank's coordinates in the layout,
not from parameter names:

* Megatron tensor-parallel parameters carry ``tensor_model_parallel``, ``partition_dim`` and
  ``partition_stride`` (column-parallel: output dim 0; row-parallel: input dim 1; vocab-parallel
  embedding: dim 0), cut by ``shards.tp_slice`` (the GLU ``linear_fc1`` with stride 2). The
  fused QKV weight needs no special case: Megatron lays it out by query group.
* ``GroupedExperts`` weights ``weight1`` [E, H, F1] and ``weight2`` [E, F, H]: the module's
  slots ``first_slot ... first_slot + num_local - 1`` (expert parallelism; the full and the
  sharded model share one placement; ``experts.expert_weights``), then the rank's F-shard over the expert-tensor-parallel group (``weight1`` dim 2 with stride 2 for
  swiglu's gate and up halves, ``weight2`` dim 1), as ``layers.experts.ffn_shard`` cuts it.
* Anything else (norms, router, shared expert, position embedding, buffers) is replicated.

The same function slices full *gradients* for comparison with a sharded model's.
``own_dense`` joins a load's dense entries saved at another TP size and cuts them, one key at a time: each value of a saved TP rank is read when
its key comes (``checkpoint.readers``' lazy values), joined, cut, and only the rank's part kept; a
tensor saved whole (a conversion's checkpoint) and cut along dim 0 is read as just the rank's rows.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import Tensor, nn

from moe_plugin.checkpoint.experts import expert_weights
from moe_plugin.checkpoint.shards import tp_join, tp_slice
from moe_plugin.groups.layout import RankLayout


def own_dense(pieces: Mapping[str, list[Any]], model: nn.Module, layout: RankLayout, rank: int) -> dict[str, Any]:
    """``model``'s dense entries for global ``rank`` of ``layout`` from ``pieces`` ({key: the value
    of every saved TP rank, in rank order; lazy or read}): key by key, read, joined (``tp_join``,
    the model's partition rules), cut, and the part copied, so the peak is the rank's share plus
    one full tensor. Keys absent from ``pieces`` are left out."""
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
    """Rank ``tp_rank``'s part of a tensor saved whole (one saved TP rank) and cut along dim 0, read
    as just its rows (``tp_slice``'s pieces ``tp_rank::tp``); None where that does not apply."""
    if len(saved) != 1 or dim != 0 or not hasattr(saved[0], "read_rows"):
        return None
    pieces = stride * tp
    if saved[0].shape[0] % pieces:
        return None
    n = saved[0].shape[0] // pieces
    return torch.cat([saved[0].read_rows(j * n, n) for j in range(tp_rank, pieces, tp)])


def shard_state_dict(full: Mapping[str, Any], model: nn.Module, layout: RankLayout, rank: int, *,
                     strict: bool = True) -> dict[str, Any]:
    """The entries of ``model.state_dict()`` cut out of ``full`` for global ``rank`` of ``layout``.

    ``full`` comes from the same model built on one process (same spec and config). Every key
    of the model must be in ``full`` unless ``strict`` is False (then keys absent from ``full``
    are left out: gradients, say, have no buffers); a shape no rule explains is an error naming
    the key.
    """
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
