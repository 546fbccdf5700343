"""How one MoE layer is spread over ranks: its groups, its token split and its gradient factors.

Every number of the layer that depends on the parallel layout is computed here, from
``groups.layout.sizes`` (per pipeline stage ``tp * dp == etp * ep * edp``). The layer, the
router, the experts and the dispatcher only read a ``LayerParallelism``.

Semantics (a "replica" is one DP rank's micro-batch of T tokens, replicated over its TP group):

1. Tokens. With sequence parallelism the input [S/tp, B, H] is already this TP rank's share;
   without it but tp > 1 the input is replicated over TP: the layer keeps its equal share
   (``comm.split_tokens``) and all-gathers its output (``comm.gather_tokens``), so TP ranks never
   do the same expert work twice. Either way TP rank t holds rows ``[t * T/tp, (t + 1) * T/tp)``
   of the replica's micro-batch flattened to [S*B] as on one process (row ``s * B + b``; an SP
   share is whole positions), and the ranks of a stage's TP x DP grid (``tp_dp``) hold distinct
   tokens. Routing does not depend on tp: each TP rank all-gathers the [T/tp, E] logits over TP
   (rank order: the single-process token order), routes all T tokens as one GShard group
   (capacity, priority and both losses over them) and keeps its own tokens' routes
   (``router.route(own=...)``). Dispatch, experts and ``last_stats``' counts concern this rank's
   tokens; the losses are the replica's, the same on its TP ranks. Document ids (padding: -1) come
   with the input, replicated or this rank's share, and are all-gathered over TP with SP, so the
   routing sees every token's.
2. Expert parallelism (``ep``): a rank hosts experts ``[ep_rank * L, (ep_rank + 1) * L)`` and
   exchanges routed rows with its EP peers (``ep_dispatcher.py``).
3. Expert tensor parallelism (``etp``): each expert's FFN dimension is split over the ETP group;
   rows received over EP are gathered over ETP, each rank computes a partial output with its
   F-shard and the partial outputs are reduce-scattered back. Routing does not depend on etp.
4. Gradients do not depend on the layout. Convention of the layer on its own: after backward
   every rank averages dense-parameter gradients over ``dp`` and expert-parameter gradients
   over ``edp``. (DeepSpeed 0.19's engine differs: it sums expert gradients over ``edp`` and
   divides by ``dp``. Under it factor (c) must be 1; ``moe_plugin.initialize`` sets that, see
   ``integration/expert_params.py``, and its tests check the result against one process.)
   Target: the single-process gradient of ``mean_d L_d``, the mean over DP replicas of their
   losses (``L_d`` is replicated within a TP group; it includes the weighted aux loss ``l_d``
   of the replica, one GShard group). Rank (d, t) back-propagates ``L_d`` through its token
   share only, so:

   (a) ``dense_grad_group`` = tp: a dense weight of the layer (router, shared expert) sees
       only this rank's share, so its gradient is summed over TP inside the layer
       (``comm.all_reduce_grad`` where the weight is used); the dp average then gives
       ``mean_d dL_d/dW``. For the router, the gathered logits' backward keeps this rank's rows
       (``comm.gather_tokens``): rank t's own gates depend on its rows of the logits only, and
       the routes of other tokens it computes but does not keep give no gradient.
   (b) The aux loss needs no factor: every TP rank of replica d computes the same ``l_d`` from
       the same gathered logits Z_TE and adds ``coeff * l_d`` once. Its gradient ``dl_d/dZ`` is
       the same on all of them; rank t keeps rows t of it, so its router-weight gradient gets
       ``x_t^T (dl_d/dZ)_t`` and the TP sum of (a) gives ``sum_t x_t^T (dl_d/dZ)_t = dl_d/dW``,
       each token once. After the dp average: ``coeff * mean_d dl_d/dW``, the gradient of the
       single-process aux loss of ``dp`` micro-batches. (The sequence and global scopes of
       ``balance.py`` are functions of the same gathered logits: the same argument holds.)
   (c) ``expert_grad_scale`` = edp / dp = tp / (ep * etp): an expert shard's local gradient sums
       ``dL_d/dW`` over the tokens of the ``ep * etp`` ranks that send it rows; the edp average
       then covers all ``tp * dp`` token groups of the stage divided by edp, while the target
       divides by dp. Without this factor expert gradients are off by ``dp / edp`` (the
       known "expert gradients wrong by a factor of the EP size" bug).
5. Aux-loss-free bias: the router load (``routed_E`` of this rank's own tokens' routes) is
   summed over ``tokens`` (the ``tp_dp`` group, each token once) before every bias update, so
   the bias stays identical on all ranks. Likewise ``MoELayer.global_stats`` sums the counts
   over ``tokens`` (and averages the losses, which are the same on a replica's TP ranks).
6. Random numbers: the router's generator is offset by ``dp_rank``: a replica's TP ranks draw
   the same jitter [T, H] (each applies its share's rows) and U(0, 1) [T], as one process does for
   that micro-batch; other replicas draw other numbers (one process routing them in turn would
   draw from one stream). Tests pass explicit noise per replica (``MoELayer.forward(noise=...)``).
7. Non-finite input: the router's finite check is agreed over ``tokens``, so every rank of the
   stage raises together, before any row leaves a rank, instead of hanging (``FiniteCheck``;
   when the EP group is ``tokens`` itself, ``ep_is_tokens``, the flags ride in the exchange).
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
