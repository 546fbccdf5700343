"""DeepSpeed 0.19.8's MoE detection: a marker module of its ``MoE`` type, so the engine takes its MoE code
paths, and the flag that makes ZeRO's gradient norm count a parameter on every TP rank. Details:
docs/design/compat_upstream.md.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from deepspeed.moe.layer import MoE as DeepSpeedMoE
from torch import nn

from moe_plugin.compat.deepspeed_groups import expert_groups

MARKER_READS = ("ep_size", "expert_group_name", "num_experts", "num_local_experts")


class DeepSpeedMoEMarker(DeepSpeedMoE):
    """A ``deepspeed.moe.layer.MoE`` in type only: no parameters, and ``set_deepspeed_parallelism`` only checks
    that DeepSpeed's registry holds the groups."""

    def __init__(self, num_experts: int, ep_size: int, group_name: str, ep_group: Any, edp_group: Any):
        nn.Module.__init__(self)
        self.ep_size = ep_size
        self.expert_group_name = group_name
        self.num_experts = num_experts
        self.num_local_experts = num_experts // ep_size
        self.use_residual = False
        self._group_handles = (ep_group, edp_group)

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
        if use_data_before_expert_parallel_:
            raise ValueError("use_data_before_expert_parallel_ is DeepSpeed's own rank layout; the plugin's "
                             "layout comes from moe.parallel.order")
        name = self.expert_group_name
        if any(mine is not theirs for mine, theirs in zip(self._group_handles, expert_groups(name))):
            raise RuntimeError(f"deepspeed.utils.groups does not hold the plugin's {name!r} groups; "
                               "register them first (moe_plugin.groups.register)")

    def forward(self, *args: Any, **kwargs: Any):
        raise RuntimeError("DeepSpeedMoEMarker only marks the model for DeepSpeed's engine; it has no forward")

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, group={self.expert_group_name}"


def is_deepspeed_moe(module: nn.Module) -> bool:
    """Whether the engine counts ``module`` as an MoE layer (DeepSpeed's own or a marker)."""
    return isinstance(module, DeepSpeedMoE)


def mark_model_parallel(params: Iterable[nn.Parameter]) -> None:
    """Make ZeRO's gradient norm count ``params`` on every tensor-parallel rank."""
    for p in params:
        p.model_parallel = True
