"""DeepSpeed 0.19.8's group registry, ``deepspeed.utils.groups``: the expert-group dicts its MoE and ZeRO
code read instead of creating groups, and its ``mpu`` (which ``deepspeed.initialize`` replaces, so it
is set again after). Details: docs/design/compat_upstream.md.
"""
from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any, Optional

MODULE = "deepspeed.utils.groups"


def _registries():
    from deepspeed.utils import groups as ds_groups

    return ((ds_groups._EXPERT_PARALLEL_GROUP, ds_groups._EXPERT_PARALLEL_GROUP_RANKS),
            (ds_groups._EXPERT_DATA_PARALLEL_GROUP, ds_groups._EXPERT_DATA_PARALLEL_GROUP_RANKS))


def expert_groups(name: str) -> tuple[Any, Any]:
    """(expert-parallel, expert-data-parallel) group registered under ``name``; None where none is."""
    return tuple(groups.get(name) for groups, _ in _registries())


def set_expert_groups(name: str, ep: Any, ep_ranks: Sequence[int], edp: Any, edp_ranks: Sequence[int],
                      etp_size: int) -> None:
    """Register the EP and EDP groups (with this rank's rank lists) under ``name``, and the ETP size."""
    from deepspeed.utils import groups as ds_groups

    for (groups, ranks), group, members in zip(_registries(), (ep, edp), (ep_ranks, edp_ranks)):
        groups[name] = group
        ranks[name] = members
    ds_groups.expert_tensor_parallel_world_size = etp_size


def forget_expert_groups(name: str, handles: Optional[Sequence[Any]] = None) -> None:
    """Remove the groups registered under ``name`` (only those in ``handles``, when given)."""
    for groups, ranks in _registries():
        if handles is None or any(groups.get(name) is h for h in handles):
            groups.pop(name, None)
            ranks.pop(name, None)


def registered_mpu() -> Optional[Any]:
    """DeepSpeed's ``mpu`` (None: none, or DeepSpeed not imported)."""
    return getattr(sys.modules.get(MODULE), "mpu", None)


def set_mpu(mpu: Any) -> None:
    """Make ``mpu`` DeepSpeed's (also after ``deepspeed.initialize`` replaced it with the engine's)."""
    from deepspeed.utils import groups as ds_groups

    ds_groups.mpu = mpu


def clear_mpu() -> None:
    """No ``mpu``, expert-tensor-parallel size 1: DeepSpeed's defaults."""
    from deepspeed.utils import groups as ds_groups

    ds_groups.mpu = None
    ds_groups.expert_tensor_parallel_world_size = 1
