"""How one MoE layer is spread over ranks: its groups, its token split and its gradient factors,
computed here and only read elsewhere. The promises: TP ranks route their replica's micro-batch as
one process does, the gradients do not depend on the layout, a non-finite input makes every rank
raise together. The semantics (1-7) and the gradient derivation: docs/design/layers_parallel.md.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch.distributed as dist

if TYPE_CHECKING:
    from moe_plugin.groups.process_groups import ProcessGroups

Group = Optional[dist.ProcessGroup]


@dataclass(frozen=True)
class LayerParallelism:
    """The groups (``None`` where a size is 1), sizes and coordinates one MoE layer uses."""

    tp: Group = None
    ep: Group = None
    etp: Group = None
    tokens: Group = None          # tp_dp: the ranks of this stage that hold distinct tokens
    dp: Group = None              # the replicas: one rank of each TP group of this stage
    tp_size: int = 1
    dp_size: int = 1
    ep_size: int = 1
    etp_size: int = 1
    edp_size: int = 1
    ep_rank: int = 0
    etp_rank: int = 0
    token_rank: int = 0           # index in tp_dp
    dp_rank: int = 0              # the replica's index
    sequence_parallel: bool = False
    expert_group_name: str = "ep_size_1"
    ep_is_tokens: bool = False    # the EP group's ranks are exactly ``tokens``' ranks

    @classmethod
    def from_groups(cls, groups: Optional["ProcessGroups"], sequence_parallel: bool = False) -> "LayerParallelism":
        if groups is None:
            return cls(sequence_parallel=sequence_parallel)
        s = groups.layout.sizes
        return cls(tp=groups.tp, ep=groups.ep, etp=groups.etp, tokens=groups.group("tp_dp"), dp=groups.dp,
                   tp_size=s.tp, dp_size=s.dp, ep_size=s.ep, etp_size=s.etp, edp_size=s.edp,
                   ep_rank=groups.rank_in("ep"), etp_rank=groups.rank_in("etp"),
                   token_rank=groups.rank_in("tp_dp"), dp_rank=groups.rank_in("dp"),
                   sequence_parallel=sequence_parallel,
                   expert_group_name=groups.expert_group_name,
                   ep_is_tokens=_same_ranks(groups.ep, groups.group("tp_dp")))

    # -- 1. tokens ------------------------------------------------------------------------
    @property
    def splits_input(self) -> bool:
        """Input replicated over TP (no sequence parallelism): keep a share, gather the output."""
        return self.tp_size > 1 and not self.sequence_parallel

    # -- 2, 3. experts --------------------------------------------------------------------
    @property
    def expert_parallel(self) -> bool:
        """Whether rows leave this rank for the experts (EP or ETP)."""
        return self.ep is not None or self.etp is not None

    # -- 4. gradient factors --------------------------------------------------------------
    @property
    def dense_grad_group(self) -> Group:
        """(a) Dense weights of the layer get their gradient summed over this group."""
        return self.tp

    @property
    def expert_grad_scale(self) -> float:
        """(c) Factor on expert-weight gradients: edp / dp (= tp / (ep * etp) per stage)."""
        return self.edp_size / self.dp_size


def _same_ranks(a: Group, b: Group) -> bool:
    """Whether two groups (not None) hold the same ranks."""
    return (a is not None and b is not None
            and sorted(dist.get_process_group_ranks(a)) == sorted(dist.get_process_group_ranks(b)))
