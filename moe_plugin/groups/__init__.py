"""Rank layout (pure arithmetic) -> process groups -> registration with Megatron-Core and DeepSpeed.

    layout = RankLayout.build(world_size, tp=2, pp=2, ep=2)
    groups = build_process_groups(layout)      # collective; torch.distributed already initialised
    mpu = register(groups)                     # Megatron's and DeepSpeed's getters now return ours

Names below torch.distributed are imported on first use (``import moe_plugin`` imports no torch).
Design: docs/design/groups_layout.md.
lazy: ``import moe_plugin`` (which reads ``groups.layout``) takes 0.36 s (247 modules) instead of 3.9 s (1,208:
torch), measured 2026-12-02.
"""
from typing import TYPE_CHECKING

from moe_plugin.groups.layout import GROUP_KINDS, RankLayout
from moe_plugin.lazy import lazy_getattr

if TYPE_CHECKING:   # the names _LAZY hands on, for type checkers and go-to-definition
    from moe_plugin.groups.adapters import (
        GroupsMPU, make_mpu, register, register_with_deepspeed, register_with_megatron, unregister,
        unregister_deepspeed, unregister_megatron,
    )
    from moe_plugin.groups.builder import build_process_groups, destroy_process_groups
    from moe_plugin.groups.process_groups import ProcessGroups

_LAZY = {
    "ProcessGroups": "process_groups",
    "build_process_groups": "builder",
    "destroy_process_groups": "builder",
    "register": "adapters",
    "unregister": "adapters",
    "register_with_megatron": "adapters",
    "unregister_megatron": "adapters",
    "register_with_deepspeed": "adapters",
    "unregister_deepspeed": "adapters",
    "make_mpu": "adapters",
    "GroupsMPU": "adapters",
}

__all__ = ["GROUP_KINDS", "RankLayout", *_LAZY]
__getattr__ = lazy_getattr(__name__, _LAZY)
