"""Token dispatcher: permute tokens into expert order, and scatter expert outputs back.

Shape suffixes: T tokens, H hidden, E experts, L local experts, K choices per token,
R kept routes (rows in expert order).

The interface, used by ``MoELayer`` in this order::

    plan = dispatcher.prepare(plan)                  # per-batch exchange layout (EP: counts)
    x_RH, counts_L = dispatcher.dispatch(x_TH, plan) # rows grouped by local expert
    out_TH = dispatcher.combine(y_RH, plan)          # gate-weighted sum over each token's routes

``TokenDispatcher`` is the single-process one: permute is a gather (``index_select``), combine
writes each kept route's gate-weighted output to its route slot ``j * T + t`` of a [K*T, H]
buffer (unique indices, so deterministic) and sums over ``j``. Both have gather/scatter
backwards of the same cost. Dropped routes leave zeros: their token keeps only the residual.

Expert parallelism slots in by subclassing and overriding the three hooks
(``ep_dispatcher.ExpertParallelDispatcher``):

* ``prepare``: exchange the per-expert counts across the EP (and ETP) group and return
  ``dataclasses.replace(plan, exchange=...)`` with the splits and the re-sort permutation;
* ``to_experts``: the uneven all-to-all of the expert-sorted rows, then the local re-sort;
  returns the rows and the per-local-expert counts;
* ``from_experts``: the inverse re-sort and the reverse all-to-all.

Everything else (permute, gate weighting, unpermute) stays as it is here.
"""
from __future__ import annotations

import torch
from torch import Tensor

from moe_plugin.layers.router import RoutingPlan


class TokenDispatcher:
    """Local dispatcher: all ``num_experts`` experts live in this process."""

    def __init__(self, num_experts: int):
        self.num_experts = num_experts

    # -- hooks an expert-parallel dispatcher overrides ---------------------------------------
    def prepare(self, plan: RoutingPlan) -> RoutingPlan:
        """Per-batch exchange layout; nothing to exchange in a single process."""
        return plan

    def to_experts(self, x_RH: Tensor, plan: RoutingPlan) -> tuple[Tensor, Tensor]:
        """Rows sorted by global expert -> rows grouped by local expert, and their counts."""
        return x_RH, plan.kept_E

    def from_experts(self, y_RH: Tensor, plan: RoutingPlan) -> Tensor:
        """Inverse of ``to_experts``: rows back in this rank's global-expert order."""
        return y_RH

    # -- the interface -----------------------------------------------------------------------
    def dispatch(self, x_TH: Tensor, plan: RoutingPlan) -> tuple[Tensor, Tensor]:
        """[T, H] -> (rows of kept routes grouped by local expert [R, H], counts per local expert)."""
        return self.to_experts(x_TH.index_select(0, plan.token_R), plan)

    def combine(self, y_RH: Tensor, plan: RoutingPlan) -> Tensor:
        """Expert outputs [R, H] -> [T, H] in the input dtype, summed in fp32 over each token's routes."""
        y_RH = self.from_experts(y_RH, plan)
        T, K, H = plan.num_tokens, plan.k, y_RH.shape[-1]
        weighted_RH = y_RH.float() * plan.gate_R.unsqueeze(-1)
        slots_KTH = torch.index_copy(weighted_RH.new_zeros(K * T, H), 0, plan.route_R, weighted_RH)
        return slots_KTH.view(K, T, H).sum(0).to(y_RH.dtype)
