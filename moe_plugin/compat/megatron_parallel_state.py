"""megatron-core 0.16's ``parallel_state`` globals, set the way ``initialize_model_parallel`` sets them
(so its getters return the groups given), put back and cleared. Details: docs/design/compat_upstream.md.
"""
from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any, Optional

import torch.distributed as dist

MODULE = "megatron.core.parallel_state"
# destroy_model_parallel() destroys these; the plugin's groups are owned elsewhere
GLOO_GROUPS = ("_DATA_PARALLEL_GROUP_GLOO", "_DATA_PARALLEL_GROUP_WITH_CP_GLOO", "_EXPERT_DATA_PARALLEL_GROUP_GLOO",
               "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP_GLOO")
# rank lists and groups destroy_model_parallel() leaves set
RANK_LISTS_KEPT = ("_TENSOR_MODEL_PARALLEL_GLOBAL_RANKS", "_PIPELINE_GLOBAL_RANKS", "_MODEL_PARALLEL_GLOBAL_RANKS",
                   "_EMBEDDING_GLOBAL_RANKS", "_DATA_PARALLEL_GLOBAL_RANKS", "_DATA_PARALLEL_GLOBAL_RANKS_WITH_CP",
                   "_EXPERT_MODEL_PARALLEL_RANKS", "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP",
                   "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO", "_HIERARCHICAL_CONTEXT_PARALLEL_GROUPS",
                   "_MPU_DATA_PARALLEL_WORLD_SIZE", "_MPU_DATA_PARALLEL_RANK")


def held_tensor_parallel_group() -> Optional[dist.ProcessGroup]:
    """The tensor-parallel group ``parallel_state`` holds (None: none, or Megatron not imported)."""
    ps = sys.modules.get(MODULE)
    return None if ps is None else ps._TENSOR_MODEL_PARALLEL_GROUP


def parallel_state_values(handles: Mapping[str, Any], ranks: Mapping[str, Any], rank: int, gloo: bool) -> dict:
    """{global name: value} making ``parallel_state`` hold ``handles`` and this rank's ``ranks`` (cp 1)."""
    h = handles
    unique: list = []
    for handle in h.values():   # shared between kinds with the same ranks
        if all(handle is not other for other in unique):
            unique.append(handle)
    return {
        "_TENSOR_MODEL_PARALLEL_GROUP": h["tp"],
        "_TENSOR_MODEL_PARALLEL_GLOBAL_RANKS": ranks["tp"],
        "_PIPELINE_MODEL_PARALLEL_GROUP": h["pp"],
        "_PIPELINE_GLOBAL_RANKS": ranks["pp"],
        "_MODEL_PARALLEL_GROUP": h["mp"],
        "_MODEL_PARALLEL_GLOBAL_RANKS": ranks["mp"],
        # Only the first and last stage are members; the others keep None, as in Megatron.
        "_EMBEDDING_GROUP": h.get("embedding"),
        "_EMBEDDING_GLOBAL_RANKS": ranks["embedding"],
        "_POSITION_EMBEDDING_GROUP": h.get("pos_embedding"),
        "_POSITION_EMBEDDING_GLOBAL_RANKS": ranks["pos_embedding"],
        "_DATA_PARALLEL_GROUP": h["dp"],
        "_DATA_PARALLEL_GROUP_GLOO": h["dp"] if gloo else None,
        "_DATA_PARALLEL_GLOBAL_RANKS": ranks["dp"],
        # Context parallel is 1: "with CP" groups are the plain ones.
        "_CONTEXT_PARALLEL_GROUP": h["cp"],
        "_CONTEXT_PARALLEL_GLOBAL_RANKS": [rank],
        "_HIERARCHICAL_CONTEXT_PARALLEL_GROUPS": None,
        "_DATA_PARALLEL_GROUP_WITH_CP": h["dp"],
        "_DATA_PARALLEL_GROUP_WITH_CP_AG": None,
        "_DATA_PARALLEL_GROUP_WITH_CP_GLOO": h["dp"] if gloo else None,
        "_DATA_PARALLEL_GLOBAL_RANKS_WITH_CP": ranks["dp"],
        # One distributed-optimizer instance: the "partial" DP groups are the whole DP groups.
        "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP": h["dp"],
        "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO": h["dp"] if gloo else None,
        "_TENSOR_AND_DATA_PARALLEL_GROUP": h["tp_dp"],
        "_TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP": h["tp_dp"],
        "_TENSOR_AND_CONTEXT_PARALLEL_GROUP": h["tp"],
        "_EXPERT_MODEL_PARALLEL_GROUP": h["ep"],
        "_EXPERT_MODEL_PARALLEL_RANKS": ranks["ep"],
        "_EXPERT_TENSOR_PARALLEL_GROUP": h["etp"],
        "_EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP": h["etp_ep"],
        "_EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP": h["etp_ep_pp"],
        "_EXPERT_DATA_PARALLEL_GROUP": h["edp"],
        "_EXPERT_DATA_PARALLEL_GROUP_GLOO": h["edp"] if gloo else None,
        "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP": h["edp"],
        "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP_GLOO": h["edp"] if gloo else None,
        "_INTER_PARTIAL_EXPERT_DATA_PARALLEL_GROUP": None,
        "_INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE_GROUP": dist.group.WORLD,
        # Sizes and ranks come from the groups, not from overrides.
        "_MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE": None,
        "_MPU_TENSOR_MODEL_PARALLEL_RANK": None,
        "_MPU_PIPELINE_MODEL_PARALLEL_WORLD_SIZE": None,
        "_MPU_PIPELINE_MODEL_PARALLEL_RANK": None,
        "_MPU_DATA_PARALLEL_WORLD_SIZE": None,
        "_MPU_DATA_PARALLEL_RANK": None,
        "_MPU_EXPERT_MODEL_PARALLEL_WORLD_SIZE": None,
        "_MPU_EXPERT_MODEL_PARALLEL_RANK": None,
        "_MPU_EXPERT_TENSOR_PARALLEL_WORLD_SIZE": None,
        "_MPU_EXPERT_TENSOR_PARALLEL_RANK": None,
        "_global_process_group_list": [None] + unique,
    }


def set_parallel_state(values: Mapping[str, Any]) -> dict:
    """Set ``parallel_state``'s globals to ``values``; returns what they held (``restore_parallel_state``)."""
    from megatron.core import parallel_state as ps

    for name in values:
        if not hasattr(ps, name):
            raise RuntimeError(f"megatron.core.parallel_state has no {name}: unsupported megatron-core version")
    before = {name: getattr(ps, name) for name in values}
    for name, value in values.items():
        setattr(ps, name, value)
    if ps._GLOBAL_MEMORY_BUFFER is None:
        ps._set_global_memory_buffer()
    return before


def restore_parallel_state(before: Mapping[str, Any]) -> None:
    """Put back what ``set_parallel_state`` returned."""
    from megatron.core import parallel_state as ps

    for name, value in before.items():
        setattr(ps, name, value)


def clear_parallel_state() -> None:
    """Empty ``parallel_state`` without destroying the groups it holds."""
    from megatron.core import parallel_state as ps

    for name in GLOO_GROUPS:
        setattr(ps, name, None)
    ps.destroy_model_parallel()
    for name in RANK_LISTS_KEPT:
        setattr(ps, name, None)
